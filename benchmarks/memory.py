"""Memory over many steps under rngcheck with its defaults (flat once the event window is full)
and at ``level="step"`` between samples (flat: no event is kept, regions and exchange rounds are
dropped with their step).

    .venv/bin/python -m benchmarks.memory              # 1000 steps at d=32 (about a minute)
    .venv/bin/python -m benchmarks.memory --quick

The Python heap is traced with tracemalloc (the events, their stacks' summaries, the counters);
RSS adds what torch allocates in C++ (captured tracebacks, generator-state copies).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import tracemalloc
from dataclasses import dataclass
from typing import Any

import torch

from .common import NO_FOCUS, Focus, cli, make_step, markdown_table

__all__ = ["Sample", "main", "run", "section", "table"]


@dataclass(frozen=True, slots=True)
class Sample:
    step: int
    random_ops: int  # random ops the mode has seen so far
    events_kept: int  # events in its window
    heap: int  # bytes traced by tracemalloc
    rss: int  # resident set size in bytes


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def run(
    steps: int, d: int = 32, samples: int = 6, window: int | None = None, **config: Any
) -> list[Sample]:
    """Train ``steps`` steps under ``RNGConsistencyMode(**config)``, sampling memory evenly."""
    import rngcheck

    torch.set_num_threads(1)
    _model, step = make_step(d)
    kwargs = dict(config) if window is None else {**config, "window": window}
    marks = {max(1, steps * (i + 1) // samples) for i in range(samples)}
    out: list[Sample] = []
    step()  # first-call allocations (autograd graph caches, optimizer state) are not the checker's
    tracemalloc.start()
    try:
        with rngcheck.RNGConsistencyMode(**kwargs) as mode:
            gc.collect()
            out.append(Sample(0, 0, 0, tracemalloc.get_traced_memory()[0], _rss()))
            for i in range(1, steps + 1):
                step()
                if i in marks:
                    gc.collect()
                    out.append(
                        Sample(
                            i,
                            mode.report.random_ops,
                            len(mode.events),
                            tracemalloc.get_traced_memory()[0],
                            _rss(),
                        )
                    )
    finally:
        tracemalloc.stop()
    return out


def table(samples: list[Sample]) -> str:
    base = samples[0]
    rows = [
        [
            str(s.step),
            str(s.random_ops),
            str(s.events_kept),
            f"{(s.heap - base.heap) / 1024:.0f}",
            f"{(s.rss - base.rss) / 2**20:+.1f}",
        ]
        for s in samples
    ]
    return markdown_table(
        ["step", "random ops seen", "events kept", "Python heap growth (KiB)", "RSS growth (MiB)"],
        rows,
    )


def summary(samples: list[Sample]) -> str:
    """Growth per event once the window is full, against the bytes one kept event costs."""
    full = [s for s in samples if s.random_ops > s.events_kept]
    kept = samples[-1]
    per_event = (kept.heap - samples[0].heap) / max(kept.events_kept, 1)
    text = f"About {per_event / 1024:.1f} KiB of Python heap per kept event."
    if len(full) >= 2:
        growth = full[-1].heap - full[0].heap
        ops = full[-1].random_ops - full[0].random_ops
        text += (
            f" After the window filled: {growth / 1024:+.0f} KiB over {ops} more random ops "
            f"({growth / max(ops, 1):+.1f} bytes per op)."
        )
    return text


def step_level_summary(samples: list[Sample]) -> str:
    """Growth between samples at level="step", after its first steps (checked op by op)."""
    later = [s for s in samples if s.step >= 10]
    if len(later) < 2:
        return ""
    growth = later[-1].heap - later[0].heap
    return (
        f"Between samples (steps {later[0].step} to {later[-1].step}): {growth / 1024:+.0f} KiB "
        f"of Python heap ({growth / max(later[-1].step - later[0].step, 1):+.1f} bytes per step)."
    )


def section(quick: bool, _focus: Focus = NO_FOCUS) -> tuple[str, dict[str, list[dict[str, int]]]]:
    """The memory section of the report: markdown and raw samples."""
    samples = run(12, d=8, samples=3, window=16) if quick else run(1000, samples=5)
    # level="step" with no sampled step after its first two: what it keeps between samples.
    stepped = (
        run(12, d=8, samples=3, level="step", sample_every=10**9)
        if quick
        else run(2000, samples=5, level="step", sample_every=10**9)
    )
    text = "\n\n".join(
        [
            f"### Memory over {samples[-1].step} steps under rngcheck's defaults",
            table(samples),
            summary(samples),
            f'### Memory over {stepped[-1].step} steps at level="step", between samples',
            table(stepped),
            step_level_summary(stepped),
        ]
    )
    return text, {
        "defaults": [dataclasses.asdict(s) for s in samples],
        "step_level": [dataclasses.asdict(s) for s in stepped],
    }


def main(argv: list[str] | None = None) -> int:
    return cli(__doc__, section, argv)


if __name__ == "__main__":
    sys.exit(main())
