"""A correct Hugging Face training script that knows nothing of rngcheck: GPT-2 from a tiny config
with dropout and Hugging Face's gradient checkpointing, trained for a few steps. Under torchrun it
is data-parallel the way many scripts are: seed + rank (timm's habit) before the model, DDP
broadcasting it from rank 0, and per-rank data."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import _hf  # noqa: E402 - tests/_hf.py: the tiny-config builders

STEPS = int(os.environ.get("TRAIN_STEPS", "3"))


def main() -> None:
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(1234 + rank)
    model = _hf.build("gpt2", dropout=0.1)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(99 + rank)
    for _ in range(STEPS):
        model(**_hf.batch("gpt2", generator=data)).loss.backward()
        opt.step()
        opt.zero_grad()
    print("training finished", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
