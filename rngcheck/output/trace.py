"""Random-op traces: the full stream of random ops of one run, on disk, for ``rngcheck diff``.

A trace is JSON lines (never pickle): a header, then one line per random op, then a footer. Call
stacks repeat (a training loop draws from the same few lines), so each distinct stack is written
once as its own line and ops refer to it by number; an op costs ~200 bytes. The recorder streams to
a temporary file next to the target and renames it into place when the run ends, so a trace on
disk is always complete: a reader never sees half of one. Memory stays bounded however long the run:
only a small batch of events waits to be written.

The mode feeds :func:`feed` at every random op when ``trace=`` is set; :func:`write_trace` finishes
the file at exit. :func:`read_trace` and :func:`first_divergence` serve the CLI.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..core.events import RandomOpEvent
from ..core.stacks import Frame

__all__ = [
    "Divergence",
    "TraceFile",
    "TraceOp",
    "TraceRecorder",
    "TraceFeed",
    "first_divergence",
    "read_trace",
    "write_trace",
]

TRACE_FORMAT = "rngcheck-trace"
TRACE_VERSION = 1
_MAX_FRAMES = 8  # user frames kept per op: the call site and its callers
_BATCH = 256  # events summarised and written together
# The longest line read from a trace (an op's record is about 200 bytes, a stack's 8 frames a few
# KiB): a file with a longer one is not a trace, and is not read on (`rngcheck diff /dev/zero`).
_MAX_LINE = 16 * 1024 * 1024


def _hex(d: int | None) -> str | None:
    return None if d is None else f"{d & 0xFFFFFFFFFFFFFFFF:016x}"


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceOp:
    """One random op as a trace keeps it: enough to compare two runs and point at both lines."""

    seq: int
    op: str
    generator: str  # the generator's label: "default cpu", "Generator #1 (cpu, first used at ...)"
    generator_key: str  # what must match between runs: "default:cpu", "user#1:cpu"
    args: tuple[str, ...]
    before: str | None  # hex digest of the generator state before the op
    after: str | None
    phase: str
    expect: str = "same"
    region: str = ""
    cached: bool = False
    out_of_band: str = ""  # how the state changed since the previous op on this generator
    frames: tuple[Frame, ...] = ()  # user frames, outermost first

    @property
    def site(self) -> str:
        return self.frames[-1].short_location if self.frames else "<unknown>"

    @property
    def call(self) -> str:
        return f"{self.op}({', '.join(self.args)})"

    @classmethod
    def from_event(cls, event: RandomOpEvent) -> TraceOp:
        oob = event.out_of_band
        return cls(
            seq=event.seq,
            op=event.op,
            generator=event.generator.label,
            generator_key=event.generator.key,
            args=tuple(event.args),
            before=_hex(event.before),
            after=_hex(event.after),
            phase=event.phase.value,
            expect=event.expect,
            region=event.region,
            cached=event.cached,
            out_of_band=oob.describe() if oob is not None else "",
            frames=event.stack.user_frames[-_MAX_FRAMES:],
        )


class TraceRecorder:
    """Streams random ops to a temporary file; :meth:`close` moves the finished trace into place."""

    def __init__(self, path: str | os.PathLike[str], meta: dict[str, Any] | None = None) -> None:
        self.path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        fd, self._tmp = tempfile.mkstemp(prefix=".rngcheck-trace-", suffix=".tmp", dir=directory)
        self._file = os.fdopen(fd, "w", encoding="utf-8")
        self._pending: list[RandomOpEvent] = []
        self._stacks: dict[tuple[tuple[str, int, str], ...], int] = {}
        self._lock = threading.Lock()
        self.count = 0
        self._write({"format": TRACE_FORMAT, "version": TRACE_VERSION, "meta": dict(meta or {})})

    def _write(self, obj: dict[str, Any]) -> None:
        self._file.write(json.dumps(obj, separators=(",", ":")) + "\n")

    def add(self, event: RandomOpEvent) -> None:
        with self._lock:
            self._pending.append(event)
            self.count += 1
            if len(self._pending) >= _BATCH:
                self._flush()

    def _stack_id(self, frames: tuple[Frame, ...]) -> int:
        key = tuple((f.filename, f.lineno, f.name) for f in frames)
        sid = self._stacks.get(key)
        if sid is None:
            sid = self._stacks[key] = len(self._stacks)
            rows = [[f.filename, f.lineno, f.name, f.line] for f in frames]
            self._write({"stack": sid, "frames": rows})
        return sid

    def _flush(self) -> None:
        # Stacks are summarised here, a batch at a time, not at the op: the op only captured them.
        pending, self._pending = self._pending, []
        for event in pending:
            op = TraceOp.from_event(event)
            record: dict[str, Any] = {
                "seq": op.seq,
                "op": op.op,
                "gen": op.generator,
                "key": op.generator_key,
                "args": list(op.args),
                "before": op.before,
                "after": op.after,
                "phase": op.phase,
                "stack": self._stack_id(op.frames),
            }
            if op.expect != "same":
                record["expect"] = op.expect
            if op.region:
                record["region"] = op.region
            if op.cached:
                record["cached"] = True
            if op.out_of_band:
                record["oob"] = op.out_of_band
            self._write(record)

    def close(self, footer: dict[str, Any] | None = None) -> str:
        """Write the rest and the footer, then atomically rename the trace into place."""
        with self._lock:
            try:
                self._flush()
                self._write({"end": {"random_ops": self.count, **(footer or {})}})
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                os.replace(self._tmp, self.path)
            except BaseException:
                self.abort()
                raise
        return self.path

    def abort(self) -> None:
        """Drop the unfinished trace (its temporary file)."""
        try:
            self._file.close()
        finally:
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)


# -- the mode's side ---------------------------------------------------------------------------


class TraceFeed:
    """A mode's trace: the recorder opens at the first random op (when the rank is known).

    A disk error never stops training: the recorder is dropped and the error kept, to be
    reported (as a warning) when the mode writes its outputs at exit.
    """

    def __init__(self, path: str, meta: Callable[[], dict[str, Any]]) -> None:
        self._path = path
        self._meta = meta  # the run's metadata when the recorder opens (rank, world size, ...)
        self._recorder: TraceRecorder | None = None
        self._error: OSError | None = None

    def add(self, event: RandomOpEvent) -> None:
        if self._error is not None:
            return
        try:
            if self._recorder is None:
                self._recorder = TraceRecorder(self._path, meta=self._meta())
            self._recorder.add(event)
        except OSError as e:
            if self._recorder is not None:
                self._recorder.abort()
            self._recorder, self._error = None, e

    def move(self, path: str) -> None:
        """Put the finished trace at ``path`` instead (it streams to a temporary file till then)."""
        self._path = path
        if self._recorder is not None:
            self._recorder.path = path

    def stream(self) -> TraceRecorder | list[RandomOpEvent]:
        """The recorder holding the stream so far (handed over), or an empty stream.

        Raises the OSError that stopped the recording, if one did: an incomplete trace must not
        be written as if it were the whole stream.
        """
        if self._error is not None:
            raise OSError(f"recording stopped at a disk error: {self._error}")
        recorder, self._recorder = self._recorder, None
        return recorder if recorder is not None else []


def write_trace(
    path: str | os.PathLike[str],
    events: TraceRecorder | Iterable[RandomOpEvent],
    report: Any = None,
) -> str:
    """Finish a streamed trace, or write ``events`` as a trace at ``path``, atomically."""
    footer: dict[str, Any] = {}
    if report is not None:
        footer = {
            "findings": len(report.findings),
            "rank": report.rank,
            "world_size": report.world_size,
            "meta": dict(report.meta),
        }
    if isinstance(events, TraceRecorder):
        if os.path.abspath(events.path) == os.path.abspath(os.fspath(path)):
            return events.close(footer)
        events.abort()
        raise ValueError(f"the recorder streams to {events.path}, not {os.fspath(path)}")
    recorder = TraceRecorder(path, meta=dict(getattr(report, "meta", {}) or {}))
    try:
        for event in events:
            recorder.add(event)
    except BaseException:
        recorder.abort()
        raise
    return recorder.close(footer)


# -- reading and comparing ---------------------------------------------------------------------


class TraceFormatError(ValueError):
    """The file is not a complete rngcheck trace."""


@dataclass(slots=True)
class TraceFile:
    """A trace opened for streaming: ``header`` now, ``ops()`` once, ``footer`` after that."""

    path: str
    header: dict[str, Any]
    footer: dict[str, Any] | None = None
    _lines: Iterator[str] | None = field(default=None, repr=False)

    @property
    def meta(self) -> dict[str, Any]:
        return dict(self.header.get("meta", {}))

    def ops(self) -> Iterator[TraceOp]:
        stacks: dict[int, tuple[Frame, ...]] = {}
        lines, self._lines = self._lines, None
        if lines is None:
            raise RuntimeError("a TraceFile's ops can be read once")
        for lineno, line in enumerate(lines, start=2):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(f"{self.path}:{lineno}: not JSON ({e.msg})") from None
            if "stack" in rec and "frames" in rec:
                stacks[int(rec["stack"])] = tuple(
                    Frame(filename=f[0], lineno=int(f[1]), name=f[2], line=f[3])
                    for f in rec["frames"]
                )
            elif "end" in rec:
                self.footer = dict(rec["end"])
                return
            else:
                yield TraceOp(
                    seq=int(rec["seq"]),
                    op=rec["op"],
                    generator=rec.get("gen", ""),
                    generator_key=rec.get("key", ""),
                    args=tuple(rec.get("args", ())),
                    before=rec.get("before"),
                    after=rec.get("after"),
                    phase=rec.get("phase", "forward"),
                    expect=rec.get("expect", "same"),
                    region=rec.get("region", ""),
                    cached=bool(rec.get("cached", False)),
                    out_of_band=rec.get("oob", ""),
                    frames=stacks.get(int(rec.get("stack", -1)), ()),
                )
        raise TraceFormatError(f"{self.path}: the trace has no end line (a truncated file?)")


def read_trace(path: str | os.PathLike[str]) -> TraceFile:
    """Open a trace; raises TraceFormatError when the file is not one, OSError when unreadable."""
    path = os.fspath(path)
    f = open(path, encoding="utf-8")  # noqa: SIM115 - closed by the generator below
    first = f.readline(_MAX_LINE)
    try:
        header = json.loads(first) if first.strip() else {}
    except json.JSONDecodeError:
        header = {}
    if not isinstance(header, dict) or header.get("format") != TRACE_FORMAT:
        f.close()
        raise TraceFormatError(f"{path} is not an rngcheck trace (record one with trace=...)")
    if header.get("version") != TRACE_VERSION:
        f.close()
        raise TraceFormatError(
            f"{path} is trace version {header.get('version')!r}; this rngcheck reads version "
            f"{TRACE_VERSION}. Record it again with this version."
        )

    def lines() -> Iterator[str]:
        with f:
            while line := f.readline(_MAX_LINE + 1):
                if len(line) > _MAX_LINE:
                    raise TraceFormatError(
                        f"{path} is not an rngcheck trace (a line of over {_MAX_LINE // 2**20} "
                        "MiB; a trace's lines are a few KiB at most)"
                    )
                yield line

    return TraceFile(path=path, header=header, _lines=lines())


@dataclass(frozen=True, slots=True, kw_only=True)
class Divergence:
    """The first random op where two traces differ, and what differs first."""

    index: int  # position in the streams, from 0
    differs: str  # "op", "generator", "arguments", "phase", "state before", "state after", "length"
    a: TraceOp | None  # None: stream A ended here
    b: TraceOp | None
    agreed: tuple[TraceOp, ...] = ()  # the last ops both streams agreed on

    @property
    def explanation(self) -> str:
        a, b = self.a, self.b
        if a is None or b is None:
            short, longer = ("A", "B") if a is None else ("B", "A")
            extra = b if a is None else a
            assert extra is not None
            return (
                f"{short} ended after {self.index} random op(s); {longer} went on with "
                f"{extra.call} at {extra.site}."
            )
        if self.differs == "op":
            return f"A ran {a.op}, B ran {b.op}: the two runs call different random ops here."
        if self.differs == "generator":
            return f"the op draws from {a.generator} in A but {b.generator} in B."
        if self.differs == "arguments":
            return (
                f"same op, different arguments ({', '.join(a.args)} vs {', '.join(b.args)}): "
                "a different shape or probability draws a different amount of randomness."
            )
        if self.differs == "phase":
            return f"A ran it during {a.phase}, B during {b.phase}."
        if self.differs == "state before":
            sides = (("A", a), ("B", b))
            why = [f"{side}: {op.out_of_band}" for side, op in sides if op.out_of_band]
            hint = (
                " The state changed outside the random ops: " + "; ".join(why) + "."
                if why
                else " Different seeds, or state changed outside any random op before this one."
            )
            return (
                f"same op on the same generator, but the generator was in a different state "
                f"before it.{hint}"
            )
        return (
            "same op, same arguments, same state before, but a different state after: the op "
            "consumed a different amount of randomness (another kernel or torch version?)."
        )


def _compare(a: TraceOp, b: TraceOp, structure_only: bool) -> str:
    """The first element that differs, structure before values (DebugMode's order)."""
    if a.op != b.op:
        return "op"
    if a.generator_key != b.generator_key:
        return "generator"
    if a.args != b.args:
        return "arguments"
    if a.phase != b.phase:
        return "phase"
    if structure_only or a.cached or b.cached:
        return ""
    if a.before != b.before:
        return "state before"
    if a.after != b.after:
        return "state after"
    return ""


def first_divergence(
    a: Iterable[TraceOp], b: Iterable[TraceOp], *, structure_only: bool = False, keep: int = 3
) -> tuple[Divergence | None, int]:
    """Walk two op streams in step. Returns the first divergence (or None) and the ops compared."""
    agreed: deque[TraceOp] = deque(maxlen=keep)
    ia, ib = iter(a), iter(b)
    index = 0
    while True:
        x = next(ia, None)
        y = next(ib, None)
        if x is None and y is None:
            return None, index
        if x is None or y is None:
            return Divergence(index=index, differs="length", a=x, b=y, agreed=tuple(agreed)), index
        what = _compare(x, y, structure_only)
        if what:
            return Divergence(index=index, differs=what, a=x, b=y, agreed=tuple(agreed)), index
        agreed.append(x)
        index += 1
