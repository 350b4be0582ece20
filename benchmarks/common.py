"""What every benchmark shares: the model, the training step, the modes compared, interleaved timing
and the markdown table.

The model is a stack of pre-norm MLP blocks with dropout, each block under non-reentrant
``torch.utils.checkpoint``: per step, every block runs forward, recompute and backward, and each
forward and recompute draws one dropout mask, so the checker sees its whole hot path (random ops in
checkpoint regions, the recompute comparison, the seeding hooks checkpoint's RNG restore triggers).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from rngcheck.core.dispatch import DynamoSkippedMode

__all__ = [
    "MODES",
    "Block",
    "Budget",
    "CLOCKS",
    "Focus",
    "Mode",
    "NO_FOCUS",
    "Model",
    "Timings",
    "SAMPLE_EVERY",
    "amortised",
    "block_value",
    "budget_table",
    "ratio_table",
    "cli",
    "interleave",
    "machine",
    "make_step",
    "markdown_table",
    "model_section",
]


class Block(nn.Module):
    """x + dropout(fc2(gelu(fc1(norm(x))))): one LayerNorm, two Linears, one dropout mask."""

    def __init__(self, d: int, p: float = 0.1) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.norm(x)))), self.p, self.training)


class Model(nn.Module):
    """``depth`` checkpointed blocks; ``debug`` turns on ``checkpoint(debug=True)``."""

    def __init__(self, d: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.debug = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False, debug=self.debug)
        return x


def make_step(
    d: int, depth: int = 4, batch: int = 256, seed: int = 0, ddp: bool = False
) -> tuple[Model, Callable[[], None]]:
    """A model and one training step on it: forward, backward, optimizer step.

    ``ddp``: wrap the model in DistributedDataParallel (gradients all-reduced in backward); every
    rank builds the same model and batch from the same seed, so replicated dropout agrees.
    """
    torch.manual_seed(seed)
    model = Model(d, depth)
    net: nn.Module = model
    if ddp:
        net = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(batch, d)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        net(x).square().mean().backward()
        opt.step()

    return model, step


class _NoOpMode(DynamoSkippedMode):
    """The floor: a Python dispatch mode that only calls the op, kept from Dynamo the way
    rngcheck's own mode is (a plain ``TorchDispatchMode`` costs about 5% more at d=32: torch
    wraps its ``__torch_dispatch__`` in a per-call ``torch._disable_dynamo``)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _debug_mode_hashes() -> Iterator[None]:
    from torch.utils._debug_mode import DebugMode

    # DebugMode keeps every call it logs; a fresh one per timed block keeps memory bounded.
    with DebugMode(), DebugMode.log_tensor_hashes():
        yield


@contextlib.contextmanager
def _checkpoint_debug(model: Model) -> Iterator[None]:
    model.debug = True
    try:
        yield
    finally:
        model.debug = False


def _rngcheck(**kwargs: Any) -> Callable[[Model], Any]:
    def enter(_model: Model) -> Any:
        import rngcheck

        return rngcheck.RNGConsistencyMode(**kwargs)

    return enter


@dataclass(frozen=True, slots=True)
class Mode:
    """One configuration to time: a name and a factory for the context it runs under."""

    name: str
    enter: Callable[[Model], contextlib.AbstractContextManager[Any]]
    label: str = ""
    warmup: int = 1  # untimed steps after entering (level="step": past its first, sampled ones)


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("plain", lambda _m: contextlib.nullcontext(), "plain training"),
        Mode("noop", lambda _m: _NoOpMode(), "no-op TorchDispatchMode (floor)"),
        Mode("rngcheck", _rngcheck(), "rngcheck, defaults"),
        Mode(
            "rngcheck-dispatch",
            _rngcheck(route="dispatch_mode"),
            'rngcheck, route="dispatch_mode" (op level)',
        ),
        Mode("rngcheck-op", _rngcheck(sync="op"), 'rngcheck, sync="op"'),
        # Between samples: sample_every is out of reach here; the amortised cost of one sampled
        # step in SAMPLE_EVERY is computed from the defaults' row (budgets()).
        Mode(
            "rngcheck-step",
            _rngcheck(level="step", sample_every=10**9),
            'rngcheck, level="step" (between samples)',
            warmup=3,
        ),
        Mode(
            "rngcheck-step-10",
            _rngcheck(level="step", sample_every=10**9, every_steps=10),
            'rngcheck, level="step", every_steps=10 (between samples)',
            warmup=3,
        ),
        Mode("debugmode", lambda _m: _debug_mode_hashes(), "DebugMode + log_tensor_hashes()"),
        Mode("ckpt-debug", _checkpoint_debug, "checkpoint(debug=True)"),
    )
}


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
SAMPLE_EVERY = 100  # level="step"'s default: one step in this many is checked op by op


def amortised(step_ratio: float, op_ratio: float, every: int = SAMPLE_EVERY) -> float:
    """The long-run cost of level="step" from its between-samples cost and the op level's: one
    step in ``every`` runs op by op."""
    return ((every - 1) * step_ratio + op_ratio) / every


@dataclass(slots=True)
class Timings:
    """Step times per clock and mode, one list per round.

    ``wall`` is elapsed time; ``cpu`` is this thread's CPU time, which leaves out the time the
    scheduler gave to other processes (on a shared machine, the steadier of the two for a
    single-threaded step; it also leaves out waiting for other ranks).
    """

    samples: dict[str, dict[str, list[list[float]]]] = field(default_factory=dict)
    # How a round's block of steps is summed up: "median" (the one-process sections, whose
    # steps all do the same work), or "mean" (two ranks, whose blocks hold a whole round of the
    # step level's exchange: its work falls on 2 steps in 32, which a median leaves out).
    per_block: str = "median"

    @property
    def modes(self) -> list[str]:
        return list(self.samples["wall"])

    def block(self, times: list[float]) -> float:
        return block_value(times, self.per_block)

    def median(self, name: str, clock: str = "wall") -> float:
        """The step time: the median of every step timed, or with ``per_block="mean"`` the
        median over rounds of each block's mean."""
        blocks = self.samples[clock][name]
        if self.per_block == "mean":
            return statistics.median(map(self.block, blocks))
        return statistics.median(t for block in blocks for t in block)

    def ratios(self, name: str, base: str, clock: str = "wall") -> list[float]:
        """Per round, this mode's block / base's block, each summed up by ``per_block``."""
        ours, theirs = self.samples[clock][name], self.samples[clock][base]
        return [self.block(a) / self.block(b) for a, b in zip(ours, theirs, strict=True)]

    def ratio(self, name: str, base: str, clock: str = "wall") -> float:
        """Median over rounds of :meth:`ratios`: paired, so a burst of load from other
        processes moves both sides of most ratios together."""
        return statistics.median(self.ratios(name, base, clock))


def block_value(times: list[float], per_block: str) -> float:
    """One block of step times summed up: its ``"median"`` or its ``"mean"``."""
    if per_block == "mean":
        return statistics.fmean(times)
    if per_block == "median":
        return statistics.median(times)
    raise ValueError(f'per_block must be "median" or "mean"; got {per_block!r}')


def interleave(
    modes: list[Mode],
    model: Model,
    step: Callable[[], None],
    *,
    rounds: int,
    steps: int,
    warmup: int = 1,
    barrier: Callable[[], None] | None = None,
) -> Timings:
    """Round-robin over ``modes``: each round enters every mode once (rotating the order), runs
    ``warmup`` untimed steps and times ``steps`` steps. Entering and leaving a mode is not timed.

    ``barrier``, when given, runs before every timed block (ranks start each block together).
    """
    out = Timings({clock: {m.name: [] for m in modes} for clock in CLOCKS})
    wall, cpu = CLOCKS["wall"], CLOCKS["cpu"]
    for r in range(rounds):
        shift = r % len(modes)
        for m in modes[shift:] + modes[:shift]:
            with m.enter(model):
                for _ in range(max(warmup, m.warmup)):
                    step()
                if barrier is not None:
                    barrier()
                walls, cpus = [], []
                for _ in range(steps):
                    w0, c0 = wall(), cpu()
                    step()
                    c1, w1 = cpu(), wall()
                    walls.append(w1 - w0)
                    cpus.append(c1 - c0)
            out.samples["wall"][m.name].append(walls)
            out.samples["cpu"][m.name].append(cpus)
    return out


def machine() -> str:
    """One line about where the numbers came from."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{cpu}, {os.cpu_count()} cores (load {load:.1f}), torch {torch.__version__}, "
        f"Python {platform.python_version()}, torch.set_num_threads({torch.get_num_threads()}), "
        f"rngcheck {_revision()}"
    )


def _revision() -> str:
    """The rngcheck commit measured ("1d606a6", "+ local changes" when its tree is dirty)."""
    import rngcheck

    root = os.path.dirname(os.path.dirname(os.path.abspath(rngcheck.__file__)))

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "rngcheck")
    except (OSError, subprocess.SubprocessError):
        return rngcheck.__version__
    return f"at {head}" + (" + local changes" if dirty else "")


@dataclass(frozen=True, slots=True)
class Budget:
    """One line of the issue's budget: what was measured (per clock), the limit, the verdict."""

    what: str
    measured: dict[str, float]  # clock -> value
    limit: float

    @property
    def verdict(self) -> str:
        met = {c for c, v in self.measured.items() if v <= self.limit}
        if met == set(self.measured):
            return "met"
        if met:
            return f"met on {' and '.join(sorted(met))} time only"
        return "NOT met"


def model_section(
    quick: bool,
    focus: Focus,
    *,
    name: str,
    column: str,
    modes: tuple[str, ...],
    make: Callable[[], tuple[Any, Callable[[], None]] | None],
    budgets: Callable[[Timings], list[Budget]],
    missing: Callable[[], str | None],
) -> tuple[str, dict[str, Any]]:
    """The section of one third-party model: its training step under each of ``modes``,
    interleaved in one run, as ratios to plain training (its table's column is ``column``), and
    its ``budgets``. ``make`` builds the model and its step; ``missing`` says why it cannot be
    built here (the section is then that one line), or None."""
    rounds, steps = (2, 2) if quick else (15, 10)
    rounds = focus.rounds or rounds
    title = f"### {name} ({rounds} interleaved rounds x {steps} steps)"
    why = missing()
    if why is not None:
        return f"{title}\n\nSkipped: {why}.", {}
    torch.set_num_threads(1)
    made = make()
    assert made is not None  # (``missing`` said it can be built)
    model, step = made
    modes = focus.pick(modes)
    t = interleave([MODES[m] for m in modes], model, step, rounds=rounds, steps=steps)
    labels = {m: MODES[m].label for m in modes}
    table = ratio_table("mode", labels, {column: t}, "plain")
    text = "\n\n".join([title, table, budget_table(budgets(t))])
    raw = {m: {f"median_{c}_s": t.median(m, c) for c in CLOCKS} for m in modes}
    return text, raw


def budget_table(items: list[Budget]) -> str:
    clocks = list(CLOCKS)
    rows = [
        [b.what, *(f"{b.measured[c]:.2f}" if c in b.measured else "" for c in clocks)]
        + [f"<= {b.limit:.2f}", b.verdict]
        for b in items
    ]
    return markdown_table(["budget", *(f"{c} time" for c in clocks), "limit", "verdict"], rows)


def ratio_table(
    first: str,
    labels: dict[str, str],
    results: dict[Any, Timings],
    base: str,
    plain: bool = False,
) -> str:
    """Rows: modes (name -> label); per width (an int key, ``d=32``; a str key is its own
    heading): median step time, ratio to ``base`` (wall and CPU), and with ``plain`` the ratio
    to plain training (unless ``base`` is plain training already)."""
    plain = plain and base != "plain"
    header = [first]
    for d in results:
        w = f"d={d}" if isinstance(d, int) else str(d)
        header += [f"{w} ms", f"{w} / {base}", f"{w} / {base} (CPU)"]
        header += [f"{w} / plain"] if plain else []
    rows = []
    for name, label in labels.items():
        row = [label]
        for t in results.values():
            row += [
                f"{t.median(name) * 1e3:.2f}",
                f"{t.ratio(name, base):.2f}x",
                f"{t.ratio(name, base, 'cpu'):.2f}x",
            ]
            if plain:
                row.append(f"{t.ratio(name, 'plain'):.2f}x" if "plain" in t.modes else "")
        rows.append(row)
    return markdown_table(header, rows)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Focus:
    """What the command line narrows the timing sections to (one process, GPT-2, ranks), so one
    question can be asked with many rounds on a noisy machine; None: the section's own choice."""

    rounds: int | None = None
    modes: tuple[str, ...] | None = None
    sizes: tuple[int | str, ...] | None = None  # widths d, and GPT2 (the two-rank section)

    @property
    def widths(self) -> tuple[int, ...]:
        """The widths d asked for (the one-process section's; () when none)."""
        return tuple(d for d in self.sizes or () if isinstance(d, int))

    def pick(self, modes: tuple[str, ...]) -> tuple[str, ...]:
        """The section's ``modes`` that were asked for, in the section's order."""
        return modes if self.modes is None else tuple(m for m in modes if m in self.modes)

    @staticmethod
    def base(modes: tuple[str, ...]) -> str:
        """What a table's ratios are to: the no-op mode when timed, else plain training."""
        return "noop" if "noop" in modes else "plain"


NO_FOCUS = Focus()  # every section's own rounds, modes and sizes

Section = Callable[[bool, Focus], tuple[str, Any]]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def _names(text: str) -> tuple[str, ...]:
    names = tuple(filter(None, text.split(",")))
    unknown = [n for n in names if n not in MODES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown mode {', '.join(map(repr, unknown))}; expected some of: {', '.join(MODES)}"
        )
    if "plain" not in names:
        raise argparse.ArgumentTypeError(
            f"got {text!r}: include plain (every ratio is to plain training or the no-op mode)"
        )
    return names


GPT2 = "gpt2"  # in --sizes: the Hugging Face GPT-2 from a tiny config, over two ranks


def _sizes(text: str) -> tuple[int | str, ...]:
    sizes: list[int | str] = []
    for token in filter(None, (t.strip().lower() for t in text.split(","))):
        try:
            size: int | str = token if token == GPT2 else _positive(token)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"expected a whole number of at least 1 (a width d) or {GPT2}, got {token!r}"
            ) from None
        if size not in sizes:
            sizes.append(size)
    return tuple(sizes)


def cli(doc: str, sections: Section | dict[str, Section], argv: list[str] | None = None) -> int:
    """Command line of a benchmark script: ``--quick``, ``--json PATH``, ``--rounds``,
    ``--modes`` and ``--sizes`` (a :class:`Focus`), and ``--skip`` when it has several sections.
    Prints the machine line and each section's markdown."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a tiny run (seconds)")
    parser.add_argument("--json", default=None, help="also write the raw results here")
    parser.add_argument(
        "--rounds", type=_positive, default=None, help="interleaved rounds of the timing sections"
    )
    parser.add_argument(
        "--modes",
        type=_names,
        default=None,
        help=f"only these modes, comma-separated, plain among them: {','.join(MODES)}",
    )
    parser.add_argument(
        "--sizes",
        type=_sizes,
        default=None,
        help=f"model widths d, comma-separated (32,128), and {GPT2} for the two-rank section's "
        "GPT-2 from a tiny config",
    )
    if isinstance(sections, dict):
        parser.add_argument(
            "--skip", default="", help=f"sections to leave out: {','.join(sections)}"
        )
    args = parser.parse_args(argv)
    if not isinstance(sections, dict):
        sections = {"results": sections}
    skip = set(filter(None, getattr(args, "skip", "").split(",")))
    focus = Focus(rounds=args.rounds, modes=args.modes, sizes=args.sizes or None)
    torch.set_num_threads(1)
    raw: dict[str, Any] = {"machine": machine()}
    print(f"Machine: {raw['machine']}", flush=True)
    for name, section in sections.items():
        if name not in skip:
            text, raw[name] = section(args.quick, focus)
            print(f"\n{text}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=2)
    return 0
