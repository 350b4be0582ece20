"""A Hugging Face GPT-2 of GPT-2 small's size on a CUDA GPU (12 layers, width 768, 12 heads,
GPT-2's vocabulary, dropout 0.1, gradient checkpointing on; batch 8 x 512 tokens): plain
training, rngcheck at the op level and at the step level, interleaved in one run. Each timed step
ends with torch.cuda.synchronize(), so wall time is the GPU's step; CPU time then also counts the
host waiting there. Needs a CUDA device and transformers (requirements-models.txt): without
either the section says so in one line. scripts/gpu_check.sh runs it.

python -m benchmarks.gpu            # about a minute on one GPU
python -m benchmarks.gpu --quick    # seconds on one GPU
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from .common import CLOCKS, MODES, NO_FOCUS, Focus, budget_table, cli, interleave, ratio_table
from .gpt2 import make_gpt2_step
from .overhead import step_level_budgets

__all__ = ["GPU_MODES", "cuda_missing", "section"]

GPU_MODES = ("plain", "rngcheck", "rngcheck-step")
GPT2_SMALL = {"layers": 12, "width": 768, "heads": 12, "vocab": 50257}
BATCH, LENGTH = 8, 512


def cuda_missing() -> str | None:
    """Why this torch cannot run on a CUDA device, or None when it can."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
    return None


def section(quick: bool, focus: Focus = NO_FOCUS) -> tuple[str, dict[str, Any]]:
    rounds, steps = (2, 2) if quick else (8, 5)
    rounds = focus.rounds or rounds
    modes = focus.pick(GPU_MODES)
    title = (
        f"### GPT-2 small's size on a CUDA GPU ({rounds} interleaved rounds x {steps} steps "
        "per mode)"
    )
    missing = cuda_missing()
    if missing is not None:
        return f"{title}\n\nSkipped: needs a CUDA device; {missing}.", {}
    made = make_gpt2_step(batch=BATCH, length=LENGTH, device="cuda", **GPT2_SMALL)
    if made is None:
        return f"{title}\n\nSkipped: transformers is not installed.", {}
    model, step = made
    params = sum(p.numel() for p in model.parameters())
    where = (
        f"{torch.cuda.get_device_name()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"{params / 1e6:.0f}M parameters, batch {BATCH} x {LENGTH} tokens"
    )
    t = interleave([MODES[m] for m in modes], model, step, rounds=rounds, steps=steps)
    labels = {m: MODES[m].label for m in modes}
    table = ratio_table("mode", labels, {"GPT-2 small": t}, "plain")
    budgets = budget_table(step_level_budgets("GPT-2 small, GPU", t))
    text = "\n\n".join([title, where, table, budgets])
    raw = {
        "device": where,
        **{m: {f"median_{c}_s": t.median(m, c) for c in CLOCKS} for m in modes},
    }
    return text, raw


if __name__ == "__main__":
    sys.exit(cli(__doc__ or "", section))
