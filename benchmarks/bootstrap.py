"""How sure a two-rank step-level ratio is: a bootstrap over the rounds of a ``--json`` file.

    .venv/bin/python -m benchmarks --skip single,compiled,gpt2,vit,memory,gpu --sizes 32 \\
        --rounds 100 --modes plain,rngcheck,rngcheck-step --json r.json
    .venv/bin/python -m benchmarks.bootstrap r.json          # every model timed there

For each model and clock: level="step" between samples over plain training, the op level over
plain training, and the amortised row (1 step in SAMPLE_EVERY op by op) per round; their
medians; and a 95% percentile interval of the amortised median from resampling the rounds
(the rounds are the paired unit, as in every ratio of the suite). Needs the modes plain,
rngcheck-step and rngcheck.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from typing import Any

from .common import CLOCKS, SAMPLE_EVERY, Timings, amortised

__all__ = ["interval", "main"]

_NEEDED = ("plain", "rngcheck-step", "rngcheck")


def interval(
    samples: dict[str, Any],
    clock: str,
    draws: int = 4000,
    seed: int = 0,
    per_block: str = "median",
) -> dict[str, float]:
    """One model's bootstrap on ``clock`` (its samples as ``--json`` writes them: clock -> mode
    -> rounds of step times; each round's block summed up by ``per_block``, as the run did)."""
    timings = Timings(samples, per_block)
    between = timings.ratios("rngcheck-step", "plain", clock)
    op = timings.ratios("rngcheck", "plain", clock)
    rounds = len(between)
    rows = [amortised(b, o) for b, o in zip(between, op, strict=True)]
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(rows, k=rounds)) for _ in range(draws))
    return {
        "rounds": rounds,
        "between": statistics.median(between),
        "op": statistics.median(op),
        "amortised": statistics.median(rows),
        "low": medians[int(0.025 * draws)],
        "high": medians[int(0.975 * draws) - 1],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "json",
        help="a file written by python -m benchmarks --json (or python -m benchmarks.distributed)",
    )
    parser.add_argument(
        "--per-block",
        choices=("median", "mean"),
        default=None,
        help="sum each block of steps up this way instead of as the run did (to tell what the "
        "statistic changes from what the blocks' length changes)",
    )
    args = parser.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    ranks = data.get("ranks") or data.get("results") or {}  # (the section run on its own)
    timing = ranks.get("timing", {}) if isinstance(ranks, dict) else {}
    # (files written before blocks had a mean: their medians)
    per_block = args.per_block or ranks.get("per_block", "median")
    usable = {k: v for k, v in timing.items() if all(m in v["wall"] for m in _NEEDED)}
    if not usable:
        print(
            f"{args.json} has no two-rank timing of {', '.join(_NEEDED)}: run the two-rank section "
            "with --modes plain,rngcheck,rngcheck-step and --json",
            file=sys.stderr,
        )
        return 2
    print(
        "| model | clock | rounds | step level between samples | op level "
        f"| 1 in {SAMPLE_EVERY} op by op, median [95% interval] |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for key, samples in usable.items():
        for clock in CLOCKS:
            r = interval(samples, clock, per_block=per_block)
            model = "GPT-2" if key == "gpt2" else f"d={key}"
            print(
                f"| {model} | {clock} | {r['rounds']} | {r['between']:.3f}x | {r['op']:.2f}x | "
                f"{r['amortised']:.3f}x [{r['low']:.3f}, {r['high']:.3f}] |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
