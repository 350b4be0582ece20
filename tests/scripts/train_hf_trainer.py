"""A correct training script built on Hugging Face's Trainer, knowing nothing of rngcheck: GPT-2
from a tiny config with dropout, the Trainer's gradient checkpointing and its usual settings. Under
torchrun the Trainer (through accelerate) moves the model to its device, ``cpu:0``, which copies
every parameter into new storage, then wraps it in DDP.

Writes ``result<RANK>.json`` into the directory given as the first argument: a digest of the
trained parameters and the logged losses, to compare runs with and without rngcheck bitwise.
"""

import hashlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import _hf  # noqa: E402 - tests/_hf.py: the tiny-config builders (and the offline switch)
import transformers  # noqa: E402

STEPS = int(os.environ.get("TRAIN_STEPS", "4"))


class Tokens(torch.utils.data.Dataset):
    """A fixed synthetic corpus (the Trainer's sampler shuffles and shards it)."""

    def __init__(self, n: int = 32, length: int = 12) -> None:
        g = torch.Generator().manual_seed(123)
        self.ids = torch.randint(0, _hf.VOCAB, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    out = sys.argv[1]
    args = transformers.TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=4,
        max_steps=STEPS,
        gradient_checkpointing=True,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        save_strategy="no",
        disable_tqdm=True,
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
    )
    transformers.set_seed(0)
    model = _hf.build("gpt2", dropout=0.1)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(out, f"result{rank}.json"), "w") as f:
        json.dump({"parameters": digest.hexdigest(), "losses": losses}, f)
    print("training finished", flush=True)


if __name__ == "__main__":
    main()
