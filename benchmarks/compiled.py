"""A compiled training step (inductor, CPU) with and without rngcheck, interleaved in one run.

Under rngcheck the step stays compiled (the mode declares ignore_compile_internals): what it costs
is the ops compiled code still dispatches (extern kernels such as addmm, the seed draw of each
compiled forward) passing through the mode. The budget: rngcheck at most 1.05x the same compiled
step without it.

.venv/bin/python -m benchmarks.compiled            # d=32 and d=128
.venv/bin/python -m benchmarks.compiled --quick    # seconds
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch

from .common import (
    CLOCKS,
    NO_FOCUS,
    Budget,
    Focus,
    Mode,
    Timings,
    budget_table,
    cli,
    interleave,
    ratio_table,
)
from .common import make_step as _make_step

__all__ = ["main", "run", "section"]

COMPILED_MODES = (
    Mode("compiled", lambda _m: contextlib.nullcontext(), "compiled step"),
    Mode("compiled-rngcheck", lambda _m: _rngcheck(), "compiled step under rngcheck, defaults"),
)


def _rngcheck() -> Any:
    import rngcheck

    return rngcheck.RNGConsistencyMode()


def run(sizes: tuple[int, ...], rounds: int, steps: int) -> dict[int, Timings]:
    """The benchmark model (checkpointed dropout blocks) and its loss compiled as one function,
    trained with foreach SGD (one optimizer op per step: what stays eager is autograd's glue)."""
    torch.set_num_threads(1)
    out = {}
    for d in sizes:
        model, _ = _make_step(d)
        compiled = torch.compile(lambda x, model=model: model(x).square().mean())
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, foreach=True)
        x = torch.randn(256, d)

        def step(compiled: Any = compiled, opt: Any = opt, x: torch.Tensor = x) -> None:
            opt.zero_grad(set_to_none=True)
            compiled(x).backward()
            opt.step()

        step()  # compile outside the timing
        out[d] = interleave(list(COMPILED_MODES), model, step, rounds=rounds, steps=steps)
    return out


def table(results: dict[int, Timings]) -> str:
    return ratio_table("mode", {m.name: m.label for m in COMPILED_MODES}, results, "compiled")


def budgets(results: dict[int, Timings]) -> list[Budget]:
    return [
        Budget(
            f"d={d}: compiled step under rngcheck / compiled step",
            {c: t.ratio("compiled-rngcheck", "compiled", c) for c in CLOCKS},
            1.05,
        )
        for d, t in results.items()
    ]


def section(quick: bool, _focus: Focus = NO_FOCUS) -> tuple[str, dict[str, Any]]:
    sizes, rounds, steps = ((8,), 2, 2) if quick else ((32, 128), 15, 10)
    results = run(sizes, rounds, steps)
    text = "\n\n".join(
        [
            f"### Compiled (inductor) step ({rounds} interleaved rounds x {steps} steps per mode)",
            table(results),
            budget_table(budgets(results)),
        ]
    )
    raw = {
        str(d): {
            m.name: {f"median_{c}_s": t.median(m.name, c) for c in CLOCKS} for m in COMPILED_MODES
        }
        for d, t in results.items()
    }
    return text, raw


def main(argv: list[str] | None = None) -> int:
    return cli(__doc__, section, argv)


if __name__ == "__main__":
    sys.exit(main())
