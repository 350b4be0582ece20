"""A script built on Hugging Face's Seq2SeqTrainer, knowing nothing of rngcheck: T5 from a tiny
config with dropout and a sampling generation config (as many released models ship one), and
``predict_with_generate``. Each rank predicts for its own share of the test set, sampling with
``generate()`` until its sequences end (a vocabulary of end tokens makes them end early, at
lengths of their own), so each rank draws its own number of random ops.

``TRAIN=1`` then trains for 4 steps after predicting. With accelerate 1.16, predict() before
train() prepares the model for evaluation, which marks it prepared, and train() then leaves it
unwrapped: no DDP, each rank trains on its own batches a model of its own (the parameters differ
across the ranks at the end). A bug of the Trainer's and accelerate's, not of the script.

Writes ``result<RANK>.json`` into the directory given as the first argument: the predictions,
and with ``TRAIN=1`` a digest of the trained parameters and the logged losses.
"""

import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import _hf  # noqa: E402 - tests/_hf.py: the tiny-config builders (and the offline switch)
import transformers  # noqa: E402

TRAIN = os.environ.get("TRAIN") == "1"


class Pairs(torch.utils.data.Dataset):
    """Fixed synthetic source and target sequences of different lengths."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(4, 11, (n, 2), generator=g).tolist()
        self.pairs = [
            (
                torch.randint(1, _hf.VOCAB, (a,), generator=g),
                torch.randint(2, _hf.VOCAB, (b,), generator=g),
            )
            for a, b in lengths
        ]

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.pairs[i][0], "labels": self.pairs[i][1]}


def collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    pad = torch.nn.utils.rnn.pad_sequence
    ids = pad([b["input_ids"] for b in batch], batch_first=True)
    labels = pad([b["labels"] for b in batch], batch_first=True, padding_value=-100)
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": labels}


def main() -> None:
    out = sys.argv[1]
    transformers.set_seed(0)
    model = _hf.build("t5", dropout=0.1)
    model.generation_config = transformers.GenerationConfig(
        do_sample=True,
        top_k=0,
        max_new_tokens=8,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=list(range(1, 24)),  # a third of the vocabulary ends a sequence
    )
    args = transformers.Seq2SeqTrainingArguments(
        output_dir=out,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=3,
        max_steps=4,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        save_strategy="no",
        disable_tqdm=True,
        predict_with_generate=True,
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
    )
    trainer = transformers.Seq2SeqTrainer(
        model=model, args=args, train_dataset=Pairs(16, 1), data_collator=collate
    )
    result: dict[str, Any] = {"predictions": trainer.predict(Pairs(12, 2)).predictions.tolist()}
    if TRAIN:
        trainer.train()
        result["parameters"] = _hf.parameters_digest(model)
        result["losses"] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(out, f"result{rank}.json"), "w") as f:
        json.dump(result, f)
    print("training finished", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
