"""A buggy training script with two classic RNG bugs. Knows nothing of rngcheck.

- The seed depends on the rank (Lightning issue 12986) before a replicated model is built, and
  nothing broadcasts its parameters (gradients are averaged by hand, not by DDP): the replicas
  start from different weights. Found by the cross-rank check under torchrun.
- A user generator drives the noise inside a checkpointed block: torch.utils.checkpoint does not
  restore it, so the recompute draws different numbers than the forward. Found in one process.
"""

import os
import time

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

STEPS = int(os.environ.get("TRAIN_STEPS", "3"))
noise = torch.Generator().manual_seed(7)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x))
        return h * (torch.rand(h.shape, generator=noise) > 0.1)  # not replayed by checkpoint


def main() -> None:
    distributed = "RANK" in os.environ  # started by torchrun
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(1234 + rank)  # BUG: rank-dependent seed before the replicated model
    model = Block()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        x = torch.nn.functional.dropout(torch.randn(8, 16), p=0.1).requires_grad_()
        loss = checkpoint(model, x, use_reentrant=False).sum()
        loss.backward()
        if distributed:  # data parallelism by hand: average the gradients
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        opt.step()
        opt.zero_grad()
    print("training finished", flush=True)
    if os.environ.get("TRAIN_HANG"):  # lets a test stop it with SIGTERM, as torchrun would
        print("waiting", flush=True)
        time.sleep(60)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
