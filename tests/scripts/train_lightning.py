"""A correct PyTorch Lightning script, knowing nothing of rngcheck: GPT-2 from a tiny config with
dropout and Hugging Face's gradient checkpointing, trained with ``strategy="ddp"`` on 2 CPU
processes. Started as ``python train_lightning.py OUT``, it is rank 0 and Lightning starts rank 1
as a child process running the same command (with LOCAL_RANK=1 and no RANK). Lightning builds
DDP as ``DistributedDataParallel(module=...)``.

Each rank writes ``OUT/result<rank>.json``: a digest of its trained parameters.
``SEED_PER_RANK=1`` seeds each rank with its rank (``seed_everything``), which Lightning also
gives its DistributedSampler: the bug.
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

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    out = sys.argv[1]
    # SEED_PER_RANK=1: the bug, each rank seeded with its rank (for per-rank augmentation)
    rank = int(os.environ.get("LOCAL_RANK", "0")) if os.environ.get("SEED_PER_RANK") else 0
    lightning.seed_everything(rank)
    ids = torch.randint(0, _hf.VOCAB, (16, 12), generator=torch.Generator().manual_seed(123))
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(ids), batch_size=4, shuffle=True
    )
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
    trainer.fit(model, data)
    with open(os.path.join(out, f"result{trainer.global_rank}.json"), "w") as f:
        json.dump({"parameters": _hf.parameters_digest(model)}, f)
    print("training finished", flush=True)


if __name__ == "__main__":
    main()
