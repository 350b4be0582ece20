"""A correct PyTorch Lightning script, knowing nothing of rngcheck: GPT-2 from a tiny config with
dropout and Hugging Face's gradient checkpointing, trained with ``strategy="ddp"`` on 2 CPU
processes. Started as ``python train_lightning.py OUT``, it is rank 0 and Lightning starts rank 1
as a child process running the same command (with LOCAL_RANK=1 and no RANK). Lightning builds
DDP as ``DistributedDataParallel(module=...)``.

Each rank writes ``OUT/result<rank>.json``: a digest of its trained parameters.
``SEED_PER_RANK=1`` seeds each rank with its rank (``seed_everything``), which Lightning also
gives its DistributedSampler: the bug. ``SPLIT=1`` reads the data through a LightningDataModule
whose ``setup()`` splits it into training and validation sets with ``random_split``, as
Lightning's documentation does (with a generator of its own); ``SPLIT=default`` without one, from
the default generator (correct only when every rank is seeded alike).
"""

import json
import os
import sys

import lightning
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import _hf  # noqa: E402 - tests/_hf.py: the tiny-config builders


class Model(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _hf.build("gpt2", dropout=0.1)
        self.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def validation_step(self, batch: list[torch.Tensor], index: int) -> None:
        (ids,) = batch
        self.log("val_loss", self.model(input_ids=ids, labels=ids).loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Split(lightning.LightningDataModule):
    """20 sequences, split in setup() (on every rank) into 16 to train on and 4 to validate on."""

    def setup(self, stage: str) -> None:
        ids = torch.randint(0, _hf.VOCAB, (20, 12), generator=torch.Generator().manual_seed(123))
        own = os.environ["SPLIT"] != "default"
        self.train, self.val = torch.utils.data.random_split(
            torch.utils.data.TensorDataset(ids),
            [16, 4],
            generator=torch.Generator().manual_seed(42) if own else None,
        )

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.train, batch_size=4, shuffle=True)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.val, batch_size=2)


def main() -> None:
    out = sys.argv[1]
    # SEED_PER_RANK=1: the bug, each rank seeded with its rank (for per-rank augmentation)
    rank = int(os.environ.get("LOCAL_RANK", "0")) if os.environ.get("SEED_PER_RANK") else 0
    lightning.seed_everything(rank)
    model = Model()
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if os.environ.get("SPLIT"):
        trainer.fit(model, datamodule=Split())
    else:
        ids = torch.randint(0, _hf.VOCAB, (16, 12), generator=torch.Generator().manual_seed(123))
        data = torch.utils.data.TensorDataset(ids)
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
    with open(os.path.join(out, f"result{trainer.global_rank}.json"), "w") as f:
        json.dump({"parameters": _hf.parameters_digest(model)}, f)
    print("training finished", flush=True)


if __name__ == "__main__":
    main()
