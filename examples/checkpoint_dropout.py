"""The model from the torch_xla report that started rngcheck (pytorch/xla PR 4690), on CPU.

A Linear(128, 128) and a Dropout(0.1) run under activation checkpointing: once in the forward and
again in backward to rebuild the activations. The dropout output of both passes is captured, the
way the original report did it. When the recompute draws a different mask, the gradients belong
to a mask the loss never saw, and torch says nothing. rngcheck says where and why.

Run it with ``bash scripts/demo.sh`` or ``.venv/bin/python examples/checkpoint_dropout.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn
from torch.utils.checkpoint import checkpoint

import rngcheck

P = 0.1
STEPS = 30


class Model(nn.Module):
    """Linear + dropout. With ``generator``, the dropout mask is drawn from that Generator."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.linear = nn.Linear(128, 128)
        self.generator = generator
        self.captured: list[torch.Tensor] = []  # the dropout output of every pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        if self.generator is None:
            out = F.dropout(h, P, training=self.training)
        else:
            keep = torch.empty_like(h).bernoulli_(1 - P, generator=self.generator)
            out = h * keep / (1 - P)
        self.captured.append(out.detach().clone())
        return out


def train_step(model: Model, function=None, **checkpoint_kwargs) -> bool:
    """Forward and backward through the checkpointed model; True if both passes drew one mask."""
    model.captured.clear()
    x = torch.randn(16, 128, requires_grad=True)
    # Reentrant, like torch_xla's own checkpoint: its recompute runs the whole function, so it
    # reaches the capture line (a non-reentrant recompute stops once the saved tensors exist).
    loss = checkpoint(function or model, x, use_reentrant=True, **checkpoint_kwargs).sum()
    loss.backward()
    forward, recompute = model.captured
    return torch.equal(forward == 0, recompute == 0)


def show(console: Console, mode: rngcheck.RNGConsistencyMode, same_mask: bool) -> None:
    console.print(f"dropout masks of forward and recompute equal: {same_mask}")
    rngcheck.print_report(mode.report, console)
    console.print()


def main() -> int:
    torch.manual_seed(0)
    console = Console(width=max(Console().width, 120))  # room for the side-by-side table
    # on_finding="record": keep findings in the report and go on, so the demo shows them all
    # (the default, "raise", stops training with a RecomputeMismatchError out of backward).

    console.rule(f"1. dropout drawn from a user Generator, {STEPS} training steps")
    gen = torch.Generator().manual_seed(1234)
    with_generator = Model(generator=gen)
    optimizer = torch.optim.SGD(with_generator.parameters(), lr=0.01)
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        same = True
        for _ in range(STEPS):  # one bug at every step: one finding, seen STEPS times
            same = train_step(with_generator) and same
            optimizer.step()
            optimizer.zero_grad()
    show(console, mode, same)

    console.rule("2. checkpoint(..., preserve_rng_state=False)")
    plain = Model()
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        same = train_step(plain, preserve_rng_state=False)
    show(console, mode, same)

    console.rule("3. fixed: preserve_rng_state=True, and the Generator's state restored")
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        same = train_step(plain)  # torch restores the default generator itself
        saved = gen.get_state()  # the fix for a user Generator: restore it in the function

        def restoring(x: torch.Tensor) -> torch.Tensor:
            gen.set_state(saved)
            return with_generator(x)

        same = train_step(with_generator, function=restoring) and same
    show(console, mode, same)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
