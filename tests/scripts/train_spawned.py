"""PyTorch's DDP tutorial, as its users run it: the script starts its ranks itself with
torch.multiprocessing (START=spawn, the tutorial's mp.spawn; fork or forkserver through
start_processes), with multiprocessing.Process (START=process, the "Writing Distributed
Applications" tutorial) or with torch.distributed's elastic_launch (START=elastic). BUG=1: rank 0
draws one extra number at its second step. LAUNCHER_DRAWS=1: the launching process draws a random
op of its own first. CRASH=1: rank 0 raises an error at its second step.

Knows nothing of rngcheck; the tests run it with RNGCHECK=1. Writes OUT/result<rank>.json.
"""

import json
import multiprocessing
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class ToyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = torch.nn.Linear(10, 10)
        self.drop = torch.nn.Dropout(0.1)
        self.net2 = torch.nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.drop(torch.relu(self.net1(x))))


def demo_basic(rank: int, world_size: int, port: str, out: str) -> None:
    if port:  # (else the launcher set them: elastic_launch)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = port
    timeout = timedelta(seconds=60)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(ToyModel())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for step in range(4):
        x = torch.randn(20, 10)
        if os.environ.get("BUG") and rank == 0 and step == 1:
            torch.rand(1)  # the bug: rank 0 alone draws here
        if os.environ.get("CRASH") and rank == 0 and step == 1:
            raise ValueError("rank 0 fails")
        loss = torch.nn.functional.mse_loss(model(x), torch.randn(20, 5))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with open(os.path.join(out, f"result{rank}.json"), "w") as f:
        json.dump(losses, f)
    dist.destroy_process_group()
    print("training finished", flush=True)


def elastic_rank(out: str) -> None:
    demo_basic(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "", out)


def main() -> None:
    port, out = sys.argv[1], sys.argv[2]
    start = os.environ.get("START", "spawn")
    args = (2, port, out)
    if os.environ.get("LAUNCHER_DRAWS"):
        torch.rand(3)  # the launching process's own random op, checked there
    if start == "spawn":
        mp.spawn(demo_basic, args=args, nprocs=2, join=True)
    elif start == "process":
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=demo_basic, args=(rank, *args)) for rank in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        if any(p.exitcode != 0 for p in procs):
            sys.exit(1)
    elif start == "elastic":
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=2,
            rdzv_backend="c10d",
            rdzv_endpoint=f"127.0.0.1:{port}",
            max_restarts=0,
            monitor_interval=0.5,
        )
        elastic_launch(config, elastic_rank)(out)
    else:
        mp.start_processes(demo_basic, args=args, nprocs=2, join=True, start_method=start)


if __name__ == "__main__":
    main()
