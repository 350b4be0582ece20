"""A data-parallel script that reads its rank from the environment, seeds with seed + rank (timm's
habit) and splits its data with ``random_split`` before it initialises torch.distributed; then DDP
with dropout over its share of the training set for two epochs. Knows nothing of rngcheck.

``SPLIT_GENERATOR=1`` gives the split a generator seeded alike on every rank (correct); without it
the split comes from the rank-seeded default generator: each rank holds out different samples.
Writes ``result<RANK>.json`` into the directory given as the first argument: the samples each
rank read and held out.
"""

import json
import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    torch.manual_seed(1234 + rank)
    own = torch.Generator().manual_seed(42) if os.environ.get("SPLIT_GENERATOR") == "1" else None
    train, val = torch.utils.data.random_split(list(range(20)), [16, 4], generator=own)
    dist.init_process_group("gloo")
    layers = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1))
    model = torch.nn.parallel.DistributedDataParallel(layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = torch.utils.data.distributed.DistributedSampler(train)
    seen: list[int] = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x in torch.utils.data.DataLoader(train, batch_size=4, sampler=sampler):
            seen += x.tolist()
            model(torch.ones(4, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    with open(os.path.join(out, f"result{rank}.json"), "w") as f:
        json.dump({"seen": seen, "val": list(val)}, f)
    print("training finished", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
