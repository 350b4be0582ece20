"""A script that trains a small model on each rank alone (a warm-up of its own, stepping an
optimizer) before it initialises torch.distributed, then trains a DDP model with dropout. Knows
nothing of rngcheck: started under ``RNGCHECK=1``, the mode is entered before the first step and
binds to the process group only once the script creates it, after steps it already took."""

import os

import torch
import torch.distributed as dist


def main() -> None:
    torch.manual_seed(0)
    warm = torch.nn.Linear(4, 4)
    warm_opt = torch.optim.SGD(warm.parameters(), lr=0.1)
    for _ in range(int(os.environ.get("WARM_STEPS", "4"))):
        warm(torch.ones(2, 4)).sum().backward()
        warm_opt.step()
        warm_opt.zero_grad()
    dist.init_process_group("gloo")
    layers = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1))
    model = torch.nn.parallel.DistributedDataParallel(layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(int(os.environ.get("STEPS", "12"))):
        model(torch.ones(4, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    print("training finished", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
