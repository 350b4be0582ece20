"""Drawing findings and reports: rich panels, tables and tracebacks on a terminal, plain text
elsewhere. This module (with the CLI and the pytest plugin) is the only one that writes to a
console; the rest of rngcheck records, warns and raises."""

from __future__ import annotations

import sys

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from rich.traceback import Frame as RichFrame
from rich.traceback import Stack as RichStack
from rich.traceback import Trace, Traceback

from ..core.events import RandomOpEvent
from ..core.findings import Finding, Side, format_ranks
from ..core.stacks import Stack
from .report import Report

__all__ = ["format_finding", "format_report", "print_finding", "print_report", "render_finding"]

_MAX_FRAMES = 6  # user frames shown per side: the call site and a few callers


def _hex(d: int | None) -> str:
    return "-" if d is None else f"{d & 0xFFFFFFFFFFFFFFFF:016x}"


def _side_label(side: Side) -> str:
    if side.ranks:
        return f"{side.label} (ranks {format_ranks(side.ranks)})"
    return side.label


_ROWS = ("op", "generator", "arguments", "state before", "output", "call site")


def _event_cells(e: RandomOpEvent | None, note: str) -> list[str]:
    """One side's column: a value per row of ``_ROWS``."""
    if e is None:
        return [note or "-", "", "", "", "", ""]
    output = e.output_digest
    state = "served from cache (did not run)" if e.cached else _hex(e.before)
    return [
        e.op,
        e.generator.short_label,
        ", ".join(e.args),
        state,
        _hex(output) if output is not None else "-",
        e.site,
    ]


def _sides_table(sides: tuple[Side, ...]) -> Table:
    """Sides as columns, fields as rows: two or three sides stay readable in a narrow terminal."""
    table = Table(show_header=True, header_style="bold", expand=False, pad_edge=False)
    table.add_column("", style="bold", no_wrap=True)
    for side in sides:
        table.add_column(_side_label(side), overflow="fold")
    columns = [_event_cells(side.event, side.note) for side in sides]
    for i, row in enumerate(_ROWS):
        values = [col[i] for col in columns]
        if row == "output" and all(v in ("-", "") for v in values):
            continue  # digests of outputs exist only inside checkpoint regions
        table.add_row(row, *values)
    return table


def _caption(side_label: str, e: RandomOpEvent | None, op: str) -> str:
    if e is None:
        return op
    state = "(served from cache)" if e.cached else f"in state {_hex(e.before)}"
    return f"{e.op} drew from {e.generator.short_label} {state}"


def _traceback(stack: Stack, title: str, message: str) -> Traceback | None:
    frames = stack.user_frames[-_MAX_FRAMES:]
    if not frames:
        return None
    trace = Trace(
        stacks=[
            RichStack(
                exc_type=title,
                exc_value=message,
                frames=[
                    RichFrame(filename=f.filename, lineno=f.lineno, name=f.name, line=f.line)
                    for f in frames
                ],
            )
        ]
    )
    return Traceback(trace=trace, extra_lines=1, max_frames=_MAX_FRAMES, width=100)


def render_finding(finding: Finding) -> RenderableType:
    """A rich panel: what diverged, the likely cause, a table of the sides, and their call sites."""
    parts: list[RenderableType] = [Text(finding.message, style="bold")]
    if finding.cause:
        parts.append(Text.assemble(("Likely cause: ", "bold yellow"), finding.cause))
    if finding.sides:
        parts.append(_sides_table(finding.sides))
    stacks: list[tuple[str, Stack, RandomOpEvent | None]] = [
        (_side_label(s), s.stack, s.event) for s in finding.sides if s.event is not None
    ] or [("call site", finding.stack, None)]
    for label, stack, event in stacks:
        tb = _traceback(stack, label, _caption(label, event, finding.op))
        if tb is not None:
            parts.append(Text(f"{label}:", style="bold"))
            parts.append(tb)
    # A Text, not a str: "[recompute_mismatch]" would be read as rich markup and vanish.
    title = Text(f"rngcheck: {finding.title} [{finding.kind.value}]")
    return Panel(Group(*parts), title=title, border_style="red", title_align="left")


def format_finding(finding: Finding) -> str:
    """The same content as plain text, for logs and non-terminal output."""
    lines = [f"rngcheck: {finding.title} [{finding.kind.value}]", f"  {finding.message}"]
    if finding.cause:
        lines.append(f"  Likely cause: {finding.cause}")
    for side in finding.sides:
        e = side.event
        if e is None:
            lines.append(f"  {_side_label(side)}: {side.note or '-'}")
            continue
        state = "served from cache" if e.cached else _hex(e.before)
        lines.append(
            f"  {_side_label(side)}: {e.op}({', '.join(e.args)}) on {e.generator.label}, "
            f"state {state}, at {e.site}"
        )
    stacks = [(_side_label(s), s.stack) for s in finding.sides if s.event is not None] or [
        ("call site", finding.stack)
    ]
    for label, stack in stacks:
        frames = stack.user_frames[-_MAX_FRAMES:]
        if not frames:
            continue
        lines.append(f"  {label} stack (most recent call last):")
        for f in frames:
            lines.append(f'    File "{f.filename}", line {f.lineno}, in {f.name}')
            if f.line:
                lines.append(f"      {f.line}")
    return "\n".join(lines)


def _default_console() -> Console:
    return Console(file=sys.stderr, stderr=True)


def print_finding(finding: Finding, console: Console | None = None) -> None:
    console = console or _default_console()
    if console.is_terminal:
        console.print(render_finding(finding))
    else:
        console.print(format_finding(finding), markup=False, highlight=False, soft_wrap=True)


def _summary(report: Report) -> str:
    where = f"rank {report.rank} of {report.world_size}, " if report.world_size > 1 else ""
    status = "no findings" if report.ok else f"{len(report.findings)} finding(s)"
    return f"rngcheck: {where}{report.random_ops} random op(s) checked, {status}"


def format_report(report: Report) -> str:
    parts = [_summary(report)]
    parts.extend(format_finding(f) for f in report.findings)
    parts.extend(f"note: {n.message}" for n in report.notes)
    return "\n".join(parts)


def print_report(report: Report, console: Console | None = None) -> None:
    """Draw a whole report: its findings, then its notes, then one summary line."""
    console = console or _default_console()
    for finding in report.findings:
        print_finding(finding, console)
    for note in report.notes:
        if console.is_terminal:
            console.print(Panel(Text(note.message), title="rngcheck note", border_style="yellow"))
        else:
            console.print(f"note: {note.message}", markup=False, highlight=False, soft_wrap=True)
    console.print(_summary(report), markup=False, highlight=False)
