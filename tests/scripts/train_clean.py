"""A correct little training script: dropout, activation checkpointing, an optimizer.

Knows nothing of rngcheck; the tests run it with RNGCHECK=1 (as `python` and under torchrun).
"""

import os

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

STEPS = int(os.environ.get("TRAIN_STEPS", "4"))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(torch.relu(self.fc(x)), p=0.1, training=self.training)


def main() -> None:
    if "SLURM_PROCID" in os.environ and "RANK" not in os.environ:
        # srun: the script maps Slurm's variables itself, as launch utilities do
        os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"])
    distributed = "RANK" in os.environ  # started by torchrun (or srun)
    if distributed:
        dist.init_process_group("gloo")
    torch.manual_seed(1234)  # the same seed on every rank: replicated model and dropout masks
    block = Block()
    model = torch.nn.parallel.DistributedDataParallel(block) if distributed else block
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        x = torch.randn(8, 16, requires_grad=True)
        loss = checkpoint(model, x, use_reentrant=False).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    if distributed:
        dist.destroy_process_group()
    print("training finished")


if __name__ == "__main__":
    main()
