"""Records two traces of the same random ops, on plain tensors and on DTensors over a one-rank CPU
mesh, for `rngcheck diff` (tests/test_cli.py). Usage: dtensor_vs_plain.py OUT_DIR PORT"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

import rngcheck


def steps(x: torch.Tensor) -> None:
    torch.nn.functional.dropout(x, 0.5)
    torch.rand_like(x)
    x.uniform_()


def main() -> None:
    out, port = sys.argv[1], sys.argv[2]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1,))
    for name in ("plain", "dtensor"):
        torch.manual_seed(0)
        x = torch.ones(8, 8)
        if name == "dtensor":
            x = distribute_tensor(x, mesh, [Replicate()])
        trace = os.path.join(out, f"{name}.jsonl")
        with rngcheck.RNGConsistencyMode(on_finding="record", sync="off", trace=trace):
            steps(x)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
