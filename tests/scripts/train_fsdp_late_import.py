"""A correct FSDP training script, knowing nothing of rngcheck, that imports FSDP only when it
wraps the model, after torch.distributed is up (accelerate's ``prepare()`` does the same), and
whose ranks see batches of their own lengths (random crops from a per-rank data generator) under
dropout. Run under torchrun with ``RNGCHECK=1``, FSDP's module is imported while the mode is
already active.

Writes ``result<RANK>.json`` into the directory given as the first argument: the digest of the
rank's trained parameter shards and the losses, to compare runs with and without rngcheck bitwise.
"""

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist


def wrap(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if "torch.distributed.fsdp" in sys.modules:  # what this script is about
        raise SystemExit("torch.distributed.fsdp was imported before the script imports it")
    torch.manual_seed(0)
    model = wrap(
        torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    series = torch.randn(64, 8, generator=torch.Generator().manual_seed(7))
    losses = []
    for step in range(3):
        length = 6 + (rank + step) % 3  # this rank's crop length
        start = int(torch.randint(0, 64 - length + 1, (1,), generator=data))
        loss = model(series[start : start + length]).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    digest = hashlib.sha256()  # this rank's shards
    for p in model.parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    out = os.path.join(sys.argv[1], f"result{rank}.json")
    with open(out, "w") as f:
        json.dump({"parameters": digest.hexdigest(), "losses": losses}, f)
    print("training finished", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
