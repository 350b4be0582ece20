"""A correct training script built on Hugging Face's Trainer, knowing nothing of rngcheck: GPT-2
from a tiny config with dropout, the Trainer's gradient checkpointing and its usual settings, and
batches padded to their longest sequence. Under torchrun the Trainer (through accelerate) moves the
model to its device, ``cpu:0``, which copies every parameter into new storage, then wraps it in
DDP; each rank's dropout draws its own amounts, and each epoch's DataLoader then draws its base
seed from the default generator they moved apart.

Writes ``result<RANK>.json`` into the directory given as the first argument: a digest of the
trained parameters and the logged losses, to compare runs with and without rngcheck bitwise, and
the samples the rank trained on, in order.

``GROUP_BY_LENGTH=1`` turns on the Trainer's ``group_by_length``: its LengthGroupedSampler,
made without a generator, shuffles from the default generator, which the ranks' dropout moved
apart, so from the second epoch on each rank keeps its share of a different order (a bug of the
Trainer's, with accelerate's seedable sampler on, the default). ``SEEDABLE_SAMPLER=0`` is its
workaround: accelerate then gives the sampler a generator and synchronises it each epoch.

``ITERABLE=1`` trains on an ``IterableDataset`` that shuffles its samples each pass with
``torch.randperm`` from the default generator: accelerate (the Trainer's) then dispatches the
batches, rank 0 alone iterating the dataset and broadcasting each global batch, so only rank 0
draws that shuffle (correct). Batches are padded to one fixed length there, as dispatching
requires.

``SAVE_STEPS=N`` saves a checkpoint every N steps (the Trainer saves each rank's RNG state with
it), and ``RESUME=<checkpoint>`` resumes from one (each rank restores its own saved state).

``MLM=1`` trains BERT (from a tiny config, dropout 0.1) on masked language modelling instead:
Hugging Face's ``DataCollatorForLanguageModeling`` pads each batch to its longest sequence and
masks its tokens from the default generator, over each rank's own batch shapes.

``ZERO=3`` trains under DeepSpeed's ZeRO stage 3 (``ZERO=2``, stage 2): the model, made from
its config after the TrainingArguments, is made under ``deepspeed.zero.Init`` and initialised on
rank 0 alone inside ``GatheredParameters(..., modifier_rank=0)``, which broadcasts it.
"""

import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import _hf  # noqa: E402 - tests/_hf.py: the tiny-config builders (and the offline switch)
import transformers  # noqa: E402

STEPS = int(os.environ.get("TRAIN_STEPS", "4"))
ITERABLE = os.environ.get("ITERABLE") == "1"
MLM = os.environ.get("MLM") == "1"
ZERO = int(os.environ.get("ZERO", "0"))
SAVE_STEPS = int(os.environ.get("SAVE_STEPS", "0"))
SEEN: list[int] = []  # the samples this rank trained on, in order (collated in this process)
INDEX: dict[int, int] = {}  # id() of a sample's tensor -> its index


class Tokens(torch.utils.data.Dataset):
    """A fixed synthetic corpus of sequences of different lengths (the Trainer's sampler
    shuffles and shards it; two epochs in four steps)."""

    def __init__(self, n: int = 16) -> None:
        g = torch.Generator().manual_seed(123)
        lengths = torch.randint(6, 13, (n,), generator=g).tolist()
        self.ids = [torch.randint(1, _hf.VOCAB, (k,), generator=g) for k in lengths]
        INDEX.update((id(t), i) for i, t in enumerate(self.ids))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


class Shuffled(torch.utils.data.IterableDataset):
    """The same corpus as a stream, in a new order each pass (from the default generator)."""

    def __init__(self) -> None:
        self.tokens = Tokens()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for i in torch.randperm(len(self.tokens)).tolist():
            yield self.tokens[i]


def pad_to_longest(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Dynamic padding, as Hugging Face's collators do: each batch to its own longest sequence,
    so each rank's batches have their own lengths (and its dropout draws its own amounts)."""
    SEEN.extend(INDEX[id(b["input_ids"])] for b in batch)
    ids = torch.nn.utils.rnn.pad_sequence([b["input_ids"] for b in batch], batch_first=True)
    if ITERABLE:  # dispatched batches are concatenated: one length for all
        ids = torch.nn.functional.pad(ids, (0, 12 - ids.shape[1]))
    mask = (ids != 0).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def masking_collator() -> Callable[[list[dict[str, torch.Tensor]]], Any]:
    """Hugging Face's masked-language-modelling collator, with a word-level tokenizer over the
    tiny vocabulary (tests/_hf.py: nothing is downloaded)."""
    tokenizer = _hf.bert_tokenizer()
    mlm = transformers.DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)

    def collate(batch: list[dict[str, torch.Tensor]]) -> Any:
        SEEN.extend(INDEX[id(b["input_ids"])] for b in batch)
        return mlm([{"input_ids": b["input_ids"].tolist()} for b in batch])

    return collate


def deepspeed_config() -> dict[str, Any] | None:
    if not ZERO:
        return None
    import deepspeed

    # DeepSpeed's CPU accelerator compiles a shared-memory all-reduce for inference when its
    # communication starts (a minute of C++ on a fresh machine); training never calls it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return {
        "zero_optimization": {"stage": ZERO},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_allow_untested_optimizer": True,
    }


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
        save_strategy="steps" if SAVE_STEPS else "no",
        save_steps=SAVE_STEPS or 500,
        disable_tqdm=True,
        deepspeed=deepspeed_config(),
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
        train_sampling_strategy="group_by_length"
        if os.environ.get("GROUP_BY_LENGTH") == "1"
        else "random",
        accelerator_config={"use_seedable_sampler": os.environ.get("SEEDABLE_SAMPLER") != "0"},
    )
    transformers.set_seed(0)
    model = _hf.build("bert" if MLM else "gpt2", dropout=0.1)
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=Shuffled() if ITERABLE else Tokens(),
        data_collator=masking_collator() if MLM else pad_to_longest,
    )
    trainer.train(resume_from_checkpoint=os.environ.get("RESUME") or None)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(out, f"result{rank}.json"), "w") as f:
        json.dump({"parameters": _hf.parameters_digest(model), "losses": losses, "seen": SEEN}, f)
    print("training finished", flush=True)
    if torch.distributed.is_initialized():
        # (without it, gloo's threads may still be running as the interpreter exits, which
        # aborts the process now and then: "terminate called without an active exception")
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
