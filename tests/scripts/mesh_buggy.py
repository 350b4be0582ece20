"""DTensor on a CPU mesh made by init_device_mesh (which initialises torch.distributed itself),
with a rank-dependent seed before a replicated random op. Knows nothing of rngcheck."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor


def main() -> None:
    mesh = init_device_mesh("cpu", (2,))  # run with torchrun --nproc-per-node 2
    torch.manual_seed(100 + dist.get_rank())  # BUG: replicated DTensor ops need equal generators
    x = distribute_tensor(torch.ones(4, 4), mesh, [Replicate()])
    torch.nn.functional.dropout(x, 0.5)
    print("done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
