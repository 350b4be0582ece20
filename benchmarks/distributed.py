"""Several ranks over gloo: step time with DistributedDataParallel, and what the exchange sends.

    .venv/bin/python -m benchmarks.distributed            # 2-rank timing, exchange at 2 and 4 ranks
    .venv/bin/python -m benchmarks.distributed --quick
    .venv/bin/python -m benchmarks.distributed --sizes gpt2 --rounds 100   # GPT-2 only

The timed models: the MLP of the other sections at each width d, and the Hugging Face GPT-2 from
a tiny config (``gpt2``, needs transformers); the exchange is counted on the MLP.

Ranks are local processes (one thread each) rendezvousing through a file, so the run needs no
free port. Each rank times the modes interleaved, with a barrier before every timed block; the
table reports rank 0 (DDP's all-reduce in every backward keeps the ranks in lock step).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rngcheck.ranks.step_digest import STEPS_PER_ROUND

from .common import (
    CLOCKS,
    GPT2,
    MODES,
    NO_FOCUS,
    Budget,
    Focus,
    Timings,
    budget_table,
    cli,
    interleave,
    make_step,
    markdown_table,
    ratio_table,
)
from .gpt2 import make_gpt2_step

__all__ = [
    "budgets",
    "report",
    "exchange_table",
    "main",
    "payload_check",
    "run",
    "section",
    "timing_table",
]

# Each mode's block of steps is summed up by its mean: a median leaves out a block's slower
# steps, and at level="step" (every_steps=1) a block of TIMED_STEPS steps after its warmup holds
# a whole round of the exchange (posted at step STEPS_PER_ROUND of the mode, settled at the
# next). With every_steps=10 a round fills only after 320 steps: that row never times one.
PER_BLOCK = "mean"
TIMED_STEPS = STEPS_PER_ROUND
RANK_MODES = ("plain", "noop", "rngcheck", "rngcheck-op", "rngcheck-step", "rngcheck-step-10")
_RNGCHECK_MODES = ("rngcheck", "rngcheck-op", "rngcheck-step", "rngcheck-step-10")


def _stats(mode: Any) -> dict[str, int]:
    """The counters of the mode's rank exchange so far (``rngcheck.exchange_stats``)."""
    from rngcheck import exchange_stats

    return exchange_stats(mode)


def _rngcheck_available() -> str:
    """'' when the cross-rank checker starts here, else why not (every rank gets the same)."""
    import rngcheck

    try:
        with rngcheck.RNGConsistencyMode():
            pass
    except NotImplementedError as e:
        return f"rngcheck's cross-rank checker is not available: {e}"
    return ""


@contextlib.contextmanager
def _timed_exchanges() -> Iterator[dict[str, list[float]]]:
    """Wall and CPU time of each exchange, for attribution only: it wraps a private method of
    rngcheck.ranks.checker and records nothing if that method is gone."""
    from rngcheck.ranks import checker as ranks

    times: dict[str, list[float]] = {c: [] for c in CLOCKS}
    original = getattr(ranks.RankChecker, "_exchange_now", None)
    if original is None:
        yield times
        return

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = {c: clock() for c, clock in CLOCKS.items()}
        try:
            return original(self, *args, **kwargs)
        finally:
            for c, clock in CLOCKS.items():
                times[c].append(clock() - start[c])

    ranks.RankChecker._exchange_now = timed
    try:
        yield times
    finally:
        ranks.RankChecker._exchange_now = original


def _exchange(steps: int, sync: str, d: int) -> dict[str, Any]:
    """The exchange's collectives, bytes and time per step on a model with no divergence."""
    import rngcheck

    _model, step = make_step(d, ddp=True)
    with _timed_exchanges() as times, rngcheck.RNGConsistencyMode(sync=sync) as mode:
        step()  # the first step: side-group set-up is not per-step cost
        start = _stats(mode)
        for c in times:
            times[c].clear()
        for _ in range(steps):
            step()
        end = _stats(mode)
        ok = mode.report.ok
    if not end:
        return {"error": "the mode published no exchange counters"}
    delta = {k: (end[k] - start.get(k, 0)) / steps for k in end}
    calls = delta["fast_calls"] + delta["slow_calls"]
    nbytes = delta["fast_bytes"] + delta["slow_bytes"]
    return {
        "exchanges_per_step": delta["exchanges"],
        "calls_per_step": calls,
        "bytes_per_step": nbytes,
        "bytes_per_call": nbytes / calls if calls else 0.0,
        "slow_calls_per_step": delta["slow_calls"],
        **{f"{c}_ms_per_step": sum(t) / steps * 1e3 for c, t in times.items() if t},
        **{f"{c}_us_per_exchange": statistics.median(t) * 1e6 for c, t in times.items() if t},
        "ok": ok,
    }


def _worker(rank: int, world: int, init_file: str, config: dict[str, Any], out_dir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    try:
        torch.set_num_threads(1)
        result: dict[str, Any] = {"note": _rngcheck_available()}
        if config["timing"]:
            names = [m for m in config["modes"] if not (result["note"] and m in _RNGCHECK_MODES)]
            result["timing"] = {}
            for d in config["sizes"]:
                if d == GPT2:
                    made = make_gpt2_step(ddp=True)
                    if made is None:
                        result["skipped"] = (
                            "Skipped: GPT-2 (tiny config): transformers is not installed."
                        )
                        continue
                    model, step = made
                else:
                    model, step = make_step(d, ddp=True)
                t = interleave(
                    [MODES[m] for m in names],
                    model,
                    step,
                    rounds=config["rounds"],
                    steps=config["steps"],
                    barrier=dist.barrier,
                )
                result["timing"][d] = t.samples
        if not result["note"]:
            result["exchange"] = {
                s: _exchange(config["exchange_steps"], s, config["exchange_d"])
                for s in ("step", "op")
            }
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_world(world: int, config: dict[str, Any]) -> dict[str, Any]:
    """Start ``world`` ranks with ``config``; rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.start_processes(
            _worker, args=(world, init_file, config, tmp), nprocs=world, start_method="spawn"
        )
        with open(os.path.join(tmp, "rank0.json")) as f:
            return json.load(f)


def run(
    sizes: tuple[int | str, ...],
    rounds: int,
    steps: int,
    exchange_steps: int,
    worlds: tuple[int, ...],
    modes: tuple[str, ...] = RANK_MODES,
    exchange_d: int = 32,
) -> dict[str, Any]:
    """2-rank timing of ``modes`` on ``sizes`` (widths d and GPT2); the exchange on the MLP at
    the smallest width timed (else ``exchange_d``) at each of ``worlds``."""
    widths = [d for d in sizes if isinstance(d, int)]
    config = {"exchange_steps": exchange_steps, "exchange_d": min(widths, default=exchange_d)}
    timing = run_world(
        2,
        {
            **config,
            "timing": True,
            "modes": modes,
            "sizes": sizes,
            "rounds": rounds,
            "steps": steps,
        },
    )
    exchange = {2: timing.get("exchange")}
    for w in worlds:
        if w != 2 and not timing["note"]:
            exchange[w] = run_world(w, {**config, "timing": False}).get("exchange")
    return {
        "note": timing["note"],
        "skipped": timing.get("skipped", ""),
        "timing": timing["timing"],
        "per_block": PER_BLOCK,
        "exchange": exchange,
        "exchange_d": config["exchange_d"],
    }


_GPT2_LABEL = "GPT-2"


def _timings(result: dict[str, Any]) -> dict[int | str, Timings]:
    """Rank 0's timings per model: the widths d (ints, in order), then "GPT-2" (the tiny
    config)."""
    per_block = result.get("per_block", "median")
    timed = {
        _GPT2_LABEL if d == GPT2 else int(d): Timings(v, per_block)
        for d, v in result["timing"].items()
    }
    return {d: timed[d] for d in sorted(timed, key=lambda d: (isinstance(d, str), d))}


def _what(d: int | str) -> str:
    return f"d={d}" if isinstance(d, int) else f"{d} (tiny config)"


def budgets(result: dict[str, Any]) -> list[Budget]:
    """2 ranks: defaults (the op level, selective route) within 1.10x of plain training,
    ``sync="op"`` within 2x of the no-op mode, level="step" within 1.05x of plain training."""
    from .overhead import step_level_budgets

    out = []
    for d, t in _timings(result).items():
        out += step_level_budgets(f"2 ranks, {_what(d)}", t)
        if {"rngcheck", "plain"} <= set(t.modes):
            out.append(
                Budget(
                    f"2 ranks, {_what(d)}: {MODES['rngcheck'].label} / plain",
                    {c: t.ratio("rngcheck", "plain", c) for c in CLOCKS},
                    1.10,
                )
            )
        for name, limit in (("rngcheck-op", 2.0),):
            if {name, "noop"} <= set(t.modes):
                out.append(
                    Budget(
                        f"2 ranks, {_what(d)}: {MODES[name].label} / no-op mode",
                        {c: t.ratio(name, "noop", c) for c in CLOCKS},
                        limit,
                    )
                )
    return out


def payload_check(result: dict[str, Any]) -> str:
    """Whether a no-divergence collective carries the same bytes at every world size measured."""
    lines = []
    for sync in ("step", "op"):
        sizes = {
            int(w): per_sync[sync]["bytes_per_call"]
            for w, per_sync in result.get("exchange", {}).items()
            if per_sync and "bytes_per_call" in per_sync.get(sync, {})
        }
        if len(sizes) > 1:
            same = len(set(sizes.values())) == 1
            shown = ", ".join(f"{b:.0f} at {w} ranks" for w, b in sorted(sizes.items()))
            verdict = "independent of world size: met" if same else "grows with world size: NOT met"
            lines.append(f'- sync="{sync}": bytes per collective {shown}; {verdict}.')
    return "\n".join(lines)


def timing_table(result: dict[str, Any]) -> str:
    results = _timings(result)
    names = results[next(iter(results))].modes
    labels = {n: MODES[n].label for n in names}
    return ratio_table("mode (2 ranks, DDP over gloo)", labels, results, Focus.base(tuple(names)))


def _time_cell(e: dict[str, Any], clock: str) -> str:
    if f"{clock}_ms_per_step" not in e:
        return ""
    return f"{e[f'{clock}_ms_per_step']:.2f} ms ({e[f'{clock}_us_per_exchange']:.0f} us)"


def exchange_table(result: dict[str, Any]) -> str:
    rows = []
    for world, per_sync in sorted(result["exchange"].items(), key=lambda kv: int(kv[0])):
        for sync, e in (per_sync or {}).items():
            if "error" in e:
                rows.append([str(world), sync, e["error"], "", "", "", "", "", ""])
                continue
            rows.append(
                [
                    str(world),
                    f'sync="{sync}"',
                    f"{e['exchanges_per_step']:.2f}",
                    f"{e['calls_per_step']:.2f}",
                    f"{e['bytes_per_step']:.0f}",
                    f"{e['bytes_per_call']:.0f}",
                    _time_cell(e, "wall"),
                    _time_cell(e, "cpu"),
                    "yes" if e["ok"] else "NO",
                ]
            )
    return markdown_table(
        [
            "ranks",
            "sync",
            "exchanges per step",
            "collectives per step",
            "bytes sent per step",
            "bytes per collective",
            "exchange wall time per step (per exchange)",
            "exchange CPU time per step (per exchange)",
            "no finding",
        ],
        rows,
    )


def section(quick: bool, focus: Focus = NO_FOCUS) -> tuple[str, dict[str, Any]]:
    """The several-ranks section of the report: markdown and raw numbers."""
    rounds, steps = (2, 2) if quick else (15, TIMED_STEPS)
    rounds = focus.rounds or rounds
    result = run(
        focus.sizes or ((8,) if quick else (32, 128, GPT2)),
        rounds=rounds,
        steps=steps,
        exchange_steps=2 if quick else 10,
        worlds=(2,) if quick else (2, 4),
        modes=focus.pick(RANK_MODES),
        exchange_d=8 if quick else 32,
    )
    return report(result, rounds, steps), result


def report(result: dict[str, Any], rounds: int, steps: int) -> str:
    """The markdown of :func:`run`'s ``result`` (timed over ``rounds`` x ``steps``)."""
    per_block = result.get("per_block", "median")
    parts = [
        f"### Two ranks, gloo ({rounds} interleaved rounds x {steps} steps per mode, "
        f"the {per_block} of each block)"
    ]
    parts += [
        text for text in (result["note"] and f"Note: {result['note']}", result["skipped"]) if text
    ]
    if result["timing"]:  # (none when the one model asked for was skipped)
        parts += [timing_table(result), budget_table(budgets(result))]
    if not result["note"]:
        heading = (
            f"### The exchange per training step, no divergence (MLP, d={result['exchange_d']})"
        )
        parts += [heading, exchange_table(result)]
        check = payload_check(result)
        if check:
            parts.append(check)
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    return cli(__doc__, section, argv)


if __name__ == "__main__":
    sys.exit(main())
