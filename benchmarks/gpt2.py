"""A Hugging Face GPT-2 from a tiny config (2 layers, width 64, dropout 0.1, gradient
checkpointing on): plain training, the no-op dispatch mode, rngcheck at the op level and at the
step level, interleaved in one run. Needs transformers (requirements-models.txt).

.venv/bin/python -m benchmarks.gpt2            # a minute or two
.venv/bin/python -m benchmarks.gpt2 --quick    # seconds
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from .common import (
    CLOCKS,
    MODES,
    NO_FOCUS,
    Budget,
    Focus,
    Timings,
    budget_table,
    cli,
    interleave,
    ratio_table,
)

__all__ = ["make_gpt2_step", "run", "section"]

GPT2_MODES = ("plain", "noop", "rngcheck", "rngcheck-dispatch", "rngcheck-step")


def make_gpt2_step(
    layers: int = 2,
    width: int = 64,
    batch: int = 8,
    length: int = 32,
    ddp: bool = False,
    *,
    heads: int = 2,
    vocab: int = 256,
    device: str = "cpu",
) -> tuple[Any, Callable[[], None]] | None:
    """The model and one training step (forward, backward, SGD step), or None without
    transformers. ``ddp``: under DistributedDataParallel (every rank builds the same model and
    batch, so replicated dropout agrees). On a CUDA ``device`` the step ends with a
    synchronize, so that its time is the GPU's work and not only the host's launches."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=length,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    net = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else None

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        net(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        if sync is not None:
            sync()

    return model, step


def run(rounds: int, steps: int, modes: tuple[str, ...] = GPT2_MODES) -> Timings | None:
    torch.set_num_threads(1)
    made = make_gpt2_step()
    if made is None:
        return None
    model, step = made
    return interleave([MODES[m] for m in modes], model, step, rounds=rounds, steps=steps)


def budgets(t: Timings) -> list[Budget]:
    """level="step" within 1.05x of plain training, the defaults (op level) within 1.10x."""
    from .overhead import op_level_budgets, step_level_budgets

    what = "GPT-2 (tiny config)"
    return step_level_budgets(what, t) + op_level_budgets(what, t)


def section(quick: bool, focus: Focus = NO_FOCUS) -> tuple[str, dict[str, Any]]:
    rounds, steps = (2, 2) if quick else (15, 10)
    rounds = focus.rounds or rounds
    modes = focus.pick(GPT2_MODES)
    t = run(rounds, steps, modes)
    title = f"### Hugging Face GPT-2, tiny config ({rounds} interleaved rounds x {steps} steps)"
    if t is None:
        return f"{title}\n\nSkipped: transformers is not installed.", {}
    labels = {m: MODES[m].label for m in modes}
    table = ratio_table("mode", labels, {"GPT-2": t}, "plain")
    text = "\n\n".join([title, table, budget_table(budgets(t))])
    raw = {m: {f"median_{c}_s": t.median(m, c) for c in CLOCKS} for m in modes}
    return text, raw


if __name__ == "__main__":
    sys.exit(cli(__doc__ or "", section))
