"""Trains cleanly, then evaluates with one extra random op on rank 1 after the last optimizer step
(a per-rank sample drawn for logging, say). Only the final exchange can see it: at
destroy_process_group, or at exit when the script never calls it (SKIP_DESTROY=1).
Knows nothing of rngcheck."""

import os

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.nn.functional.dropout(torch.ones(2, 4), 0.1)).sum().backward()
        opt.step()
        opt.zero_grad()
    if dist.get_rank() == 1:
        torch.randint(0, 10, (1,))  # BUG: a draw on one rank only; every later draw shifts
    torch.nn.functional.dropout(torch.ones(2, 4), 0.1)
    print("evaluation finished", flush=True)
    if not os.environ.get("SKIP_DESTROY"):
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
