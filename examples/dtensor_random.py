"""DTensor random ops on ranks whose generators drift, and what rngcheck says about it.

DTensor's contract for random ops (the RNG-semantics discussion, pytorch/pytorch 159933): every rank
of the mesh must hold the same generator state before a DTensor random op, and then holds the
same state again after it. On a CPU mesh there is no RNG tracker at all: each rank runs the op on
its own generator. One plain ``torch.rand`` on one rank (an augmentation, a debugging print of a
random sample, a DataLoader peeked at on rank 0) breaks the contract, and from then on a
"replicated" dropout draws different masks on different ranks, silently.

Run on CPU::

    torchrun --nproc-per-node 2 examples/dtensor_random.py          # drifts: one finding
    torchrun --nproc-per-node 2 examples/dtensor_random.py --fixed  # no drift: no finding
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import rngcheck


def train(mesh, fixed: bool) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same seed everywhere: DTensor's contract holds at the start
    weight = distribute_tensor(torch.randn(64, 64), mesh, [Replicate()])
    batch = distribute_tensor(torch.randn(8, 64), mesh, [Shard(0)])
    for step in range(4):
        hidden = torch.nn.functional.dropout(batch @ weight, p=0.1)  # replicated dropout
        if step == 1 and rank == 1 and not fixed:
            torch.rand(1)  # one extra draw on rank 1: from here on its masks differ
        hidden.sum()


def local_mask_digest(mesh) -> int:
    """What the drift does without rngcheck: the 'replicated' DTensor differs across ranks."""
    x = distribute_tensor(torch.ones(256), mesh, [Replicate()])
    mask = torch.nn.functional.dropout(x, p=0.5).to_local()
    digests = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(digests, mask.sum().reshape(1))
    return len({float(d) for d in digests})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixed", action="store_true", help="do not draw the extra number")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete")
    warnings.filterwarnings("ignore", category=rngcheck.RNGCheckWarning)  # drawn once, below
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    # Without a checker: nothing fails, the replicas just stop being replicas.
    train(mesh, args.fixed)
    distinct = local_mask_digest(mesh)
    if dist.get_rank() == 0:
        print(f"without rngcheck: {distinct} distinct dropout mask(s) across ranks (expect 1)\n")

    # With the checker: the first DTensor op after the drift is named, with both call sites.
    # One merged rendering (on the lowest involved rank); every rank keeps the finding.
    with rngcheck.RNGConsistencyMode(on_finding="warn", timeout=60) as mode:
        train(mesh, args.fixed)
    findings = len(mode.report.findings)
    stats = rngcheck.exchange_stats(mode)
    print(
        f"rank {dist.get_rank()}: {findings} finding(s); {stats['exchanges']} exchange(s), "
        f"{stats['fast_bytes']} bytes on the fast path, {stats['slow_bytes']} on the slow path"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
