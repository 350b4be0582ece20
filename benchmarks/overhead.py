"""Single-process step time: every mode interleaved in one run, medians and paired ratios.

.venv/bin/python -m benchmarks.overhead            # d=32 and d=128, a few minutes
.venv/bin/python -m benchmarks.overhead --quick    # seconds: the smoke test's configuration
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from .common import (
    CLOCKS,
    MODES,
    NO_FOCUS,
    SAMPLE_EVERY,
    Budget,
    Focus,
    Timings,
    amortised,
    budget_table,
    cli,
    interleave,
    make_step,
    ratio_table,
)

__all__ = [
    "budgets",
    "main",
    "op_level_budgets",
    "run",
    "section",
    "step_level_budgets",
    "table",
    "to_json",
]

SINGLE_MODES = (
    "plain",
    "noop",
    "rngcheck",
    "rngcheck-dispatch",
    "rngcheck-op",
    "rngcheck-step",
    "debugmode",
    "ckpt-debug",
)


def run(
    sizes: tuple[int, ...], rounds: int, steps: int, modes: tuple[str, ...] = SINGLE_MODES
) -> dict[int, Timings]:
    """Time ``modes`` on the checkpointed MLP of each width in ``sizes``, one thread."""
    torch.set_num_threads(1)
    out = {}
    for d in sizes:
        model, step = make_step(d)
        out[d] = interleave([MODES[m] for m in modes], model, step, rounds=rounds, steps=steps)
    return out


def table(results: dict[int, Timings], base: str = "noop") -> str:
    """Rows: modes; per width: median step time, ratio to ``base`` (wall and CPU), to plain."""
    names = results[next(iter(results))].modes
    return ratio_table("mode", {n: MODES[n].label for n in names}, results, base, plain=True)


def budgets(results: dict[int, Timings]) -> list[Budget]:
    """The single-process budgets: the defaults (the op level on the selective route) within
    1.10x of plain training, the dispatch-mode route within 1.10x of the no-op mode, at most half of
    DebugMode's extra time over plain training, and level="step" within 1.05x of plain training
    (between samples, and amortised over one sampled step in SAMPLE_EVERY)."""
    out = []
    for d, t in results.items():
        out += step_level_budgets(f"d={d}", t)
        out += op_level_budgets(f"d={d}", t)
        if {"rngcheck-dispatch", "noop"} <= set(t.modes):
            out.append(
                Budget(
                    f'd={d}: rngcheck route="dispatch_mode" / no-op mode',
                    {c: t.ratio("rngcheck-dispatch", "noop", c) for c in CLOCKS},
                    1.10,
                )
            )
        if {"rngcheck", "debugmode", "plain"} <= set(t.modes):
            extra = {
                c: (t.ratio("rngcheck", "plain", c) - 1) / (t.ratio("debugmode", "plain", c) - 1)
                for c in CLOCKS
            }
            out.append(Budget(f"d={d}: extra time, rngcheck / DebugMode with hashes", extra, 0.5))
    return out


def op_level_budgets(what: str, t: Timings) -> list[Budget]:
    """The op level's goal on the model ``what`` names: the defaults (the op level on the
    selective route) within 1.10x of plain training (none when either mode was not timed)."""
    if not {"rngcheck", "plain"} <= set(t.modes):
        return []
    op = {c: t.ratio("rngcheck", "plain", c) for c in CLOCKS}
    return [Budget(f"{what}: rngcheck defaults (op level) / plain", op, 1.10)]


def model_budgets(what: str, t: Timings) -> list[Budget]:
    """A third-party model's budgets: level="step" within 1.05x of plain training, the defaults
    (the op level) within 1.10x."""
    return step_level_budgets(what, t) + op_level_budgets(what, t)


def step_level_budgets(what: str, t: Timings) -> list[Budget]:
    """level="step" against plain training (not the dispatch-mode floor): between samples, and
    amortised with the op level's cost on one step in SAMPLE_EVERY."""
    if not {"rngcheck-step", "plain"} <= set(t.modes):
        return []
    between = {c: t.ratio("rngcheck-step", "plain", c) for c in CLOCKS}
    out = [Budget(f'{what}: level="step" between samples / plain', between, 1.05)]
    if "rngcheck-step-10" in t.modes:
        spaced = {c: t.ratio("rngcheck-step-10", "plain", c) for c in CLOCKS}
        out.append(
            Budget(f'{what}: level="step", every_steps=10, between samples / plain', spaced, 1.05)
        )
    if "rngcheck" in t.modes:
        op = {c: t.ratio("rngcheck", "plain", c) for c in CLOCKS}
        out.append(
            Budget(
                f'{what}: level="step", 1 step in {SAMPLE_EVERY} op by op / plain',
                {c: amortised(between[c], op[c]) for c in CLOCKS},
                1.05,
            )
        )
    return out


def to_json(results: dict[int, Timings]) -> dict[str, Any]:
    return {
        str(d): {
            name: {
                **{f"median_{c}_s": t.median(name, c) for c in CLOCKS},
                **{f"vs_noop_{c}": t.ratio(name, "noop", c) for c in CLOCKS if "noop" in t.modes},
                **{
                    f"vs_plain_{c}": t.ratio(name, "plain", c) for c in CLOCKS if "plain" in t.modes
                },
                "samples": t.samples["wall"][name],
            }
            for name in t.modes
        }
        for d, t in results.items()
    }


def section(quick: bool, focus: Focus = NO_FOCUS) -> tuple[str, dict[str, Any]]:
    """The one-process section of the report: markdown and raw numbers."""
    sizes, rounds, steps = ((8,), 2, 2) if quick else ((32, 128), 15, 10)
    sizes, rounds = focus.widths or sizes, focus.rounds or rounds
    title = f"### One process ({rounds} interleaved rounds x {steps} steps per mode)"
    if focus.sizes and not focus.widths:  # (--sizes gpt2: the two-rank section's model only)
        return f"{title}\n\nSkipped: --sizes named no width d.", {}
    modes = focus.pick(SINGLE_MODES)
    results = run(sizes, rounds, steps, modes)
    text = "\n\n".join(
        [
            title,
            table(results, Focus.base(modes)),
            budget_table(budgets(results)),
        ]
    )
    return text, to_json(results)


def main(argv: list[str] | None = None) -> int:
    return cli(__doc__, section, argv)


if __name__ == "__main__":
    sys.exit(main())
