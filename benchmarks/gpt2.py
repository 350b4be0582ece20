"""A Hugging Face GPT-2 from a tiny config (2 layers, width 64, dropout 0.1, gradient
checkpointing on): plain training, the no-op dispatch mode, rngcheck at the op level and at the
step level, interleaved in one run. Needs transformers (requirements-models.txt).

.venv/bin/python -m benchmarks.gpt2            # a minute or two
.venv/bin/python -m benchmarks.gpt2 --quick    # seconds
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from .common import NO_FOCUS, Focus, cli, model_section

__all__ = ["GPT2_MODES", "make_gpt2_step", "section"]

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


def _missing() -> str | None:
    return None if importlib.util.find_spec("transformers") else "transformers is not installed"


def section(quick: bool, focus: Focus = NO_FOCUS) -> tuple[str, dict[str, Any]]:
    from .overhead import model_budgets

    return model_section(
        quick,
        focus,
        name="Hugging Face GPT-2, tiny config",
        column="GPT-2",
        modes=GPT2_MODES,
        make=make_gpt2_step,
        budgets=functools.partial(model_budgets, "GPT-2 (tiny config)"),
        missing=_missing,
    )


if __name__ == "__main__":
    sys.exit(cli(__doc__ or "", section))
