"""Data-parallel training whose DataLoader workers (forked processes) draw random augmentations.
Knows nothing of rngcheck; tests/test_env.py runs it with RNGCHECK=1 under torchrun."""

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset


class Augmented(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(4) + i  # random augmentation, in a worker process


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        for x in DataLoader(Augmented(), batch_size=8, num_workers=2):
            model(torch.nn.functional.dropout(x, 0.1)).sum().backward()
            opt.step()
            opt.zero_grad()
    dist.destroy_process_group()
    print("training finished")


if __name__ == "__main__":
    main()
