"""A two-rank training that stops part-way, the ways jobs stop: a rank that is slow (the other
waits for it in a collective until someone sends it SIGTERM), and a rank whose process ends
(``os._exit``, SIGKILL, an exception). Knows nothing of rngcheck. Started by hand with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT (no torchrun, which would stop the other rank itself).

STOP=slow: rank STOP_RANK (1) sleeps before step AT (the other waits in the step's collective).
STOP=exit / kill / raise: rank STOP_RANK (1) leaves at step AT by os._exit(3), SIGKILL, or a
ValueError.
NOISE=1: the checkpointed block draws from a user generator (a recompute_mismatch finding).
Each rank prints "step N" (flushed) before step N's collective.
"""

import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

STEPS = int(os.environ.get("STEPS", "6"))
AT = int(os.environ.get("AT", "3"))
STOP = os.environ.get("STOP", "")
STOP_RANK = int(os.environ.get("STOP_RANK", "1"))
NOISE = bool(os.environ.get("NOISE"))
noise = torch.Generator().manual_seed(7)


def block(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = torch.relu(layer(x))
    if NOISE:  # from a user generator, which checkpoint does not replay
        return h * (torch.rand(h.shape, generator=noise) > 0.1)
    return torch.nn.functional.dropout(h, 0.1)


def stop_here(rank: int) -> None:
    if rank != STOP_RANK:
        return
    if STOP == "slow":
        time.sleep(600)
    elif STOP == "exit":
        os._exit(3)
    elif STOP == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif STOP == "raise":
        raise ValueError(f"rank {rank} fails at step {AT}")


def step(layer: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, n: int) -> None:
    x = torch.nn.functional.dropout(torch.randn(8, 16), p=0.1).requires_grad_()
    checkpoint(block, layer, x, use_reentrant=False).sum().backward()
    if n == AT:
        stop_here(rank)
    print(f"step {n}", flush=True)
    for p in layer.parameters():  # data parallelism by hand: average the gradients
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    opt.step()
    opt.zero_grad()


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    try:
        for n in range(1, STEPS + 1):
            step(layer, opt, rank, n)
        print("training finished", flush=True)
    finally:  # also as an exception unwinds, as many scripts do
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
