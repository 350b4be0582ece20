"""Drawing findings and reports: rich panels, tables and tracebacks on a terminal, plain text
elsewhere. This module (with the CLI and the pytest plugin) is the only one that writes to a
console; the rest of rngcheck records, warns and raises."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from rich.traceback import Frame as RichFrame
from rich.traceback import Stack as RichStack
from rich.traceback import Trace, Traceback

from ..core.events import RandomOpEvent
from ..core.findings import Culprit, Finding, Side, format_ranks
from ..core.stacks import Stack
from .report import Report

__all__ = [
    "format_finding",
    "format_report",
    "incomplete_text",
    "print_finding",
    "print_repeats",
    "print_report",
    "render_finding",
    "summary_line",
]

_MAX_FRAMES = 6  # user frames shown per side: the call site and a few callers


def _hex(d: int | None) -> str:
    return "-" if d is None else f"{d & 0xFFFFFFFFFFFFFFFF:016x}"


def _side_label(side: Side, world_size: int = 0) -> str:
    if side.ranks:
        word = "rank" if len(side.ranks) == 1 else "ranks"
        return f"{side.label} ({word} {format_ranks(side.ranks, world_size)})"
    return side.label


def _culprit_label(culprit: Culprit, world_size: int = 0) -> str:
    """``culprit (rank 1)``."""
    if culprit.ranks:
        word = "rank" if len(culprit.ranks) == 1 else "ranks"
        return f"culprit ({word} {format_ranks(culprit.ranks, world_size)})"
    return "culprit"


def _culprit_lines(finding: Finding, world_size: int) -> list[str]:
    """One line per call the cause names, with its line: ``culprit (rank 1):
    torch.manual_seed(99) at train.py:57``."""
    return [f"{_culprit_label(c, world_size)}: {c.call} at {c.site}" for c in finding.culprits]


def _stacks(finding: Finding, world_size: int) -> list[tuple[str, Stack, str]]:
    """The stacks a finding shows, each with its label and caption: each side's (or its call
    site's), then each culprit's."""
    stacks: list[tuple[str, Stack, str]] = [
        (_side_label(s, world_size), s.stack, _caption(s.event))
        for s in finding.sides
        if s.event is not None
    ] or [("call site", finding.stack, finding.op)]
    stacks += [
        (_culprit_label(c, world_size), c.stack, f"{c.call} at {c.site}") for c in finding.culprits
    ]
    return stacks


def _steps(first: int, last: int) -> str:
    if first <= 0:
        return ""
    return f", step {first}" if last in (first, 0) else f", steps {first} to {last}"


def repeats_line(finding: Finding) -> str:
    """How often a finding recurred: "seen 1000 times in all, steps 1 to 1000"."""
    if finding.count <= 1:
        return ""
    return f"seen {finding.count} times in all{_steps(finding.first_step, finding.last_step)}"


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


def _sides_table(sides: tuple[Side, ...], world_size: int) -> Table:
    """Sides as columns, fields as rows: two or three sides stay readable in a narrow terminal."""
    table = Table(show_header=True, header_style="bold", expand=False)
    table.add_column("", style="bold", no_wrap=True)
    for side in sides:
        table.add_column(_side_label(side, world_size), overflow="fold")
    columns = [_event_cells(side.event, side.note) for side in sides]
    for i, row in enumerate(_ROWS):
        values = [col[i] for col in columns]
        if row == "output" and all(v in ("-", "") for v in values):
            continue  # digests of outputs exist only inside checkpoint regions
        table.add_row(row, *values)
    return table


def _caption(e: RandomOpEvent) -> str:
    state = "(served from cache)" if e.cached else f"in state {_hex(e.before)}"
    return f"{e.op} drew from {e.generator.short_label} {state}"


def _drawn_before(stacks: Sequence[tuple[Any, ...]]) -> list[str | None]:
    """Per ``(label, stack, ...)``, the label of an earlier one with the same frames, else None:
    ranks in several states at one line (every rank's own, at 8 ranks) show its stack once."""
    first: dict[tuple[tuple[str, int, str], ...], str] = {}
    out: list[str | None] = []
    for label, stack, *_ in stacks:
        key = tuple((f.filename, f.lineno, f.name) for f in stack.user_frames[-_MAX_FRAMES:])
        shown = first.setdefault(key, label) if key else label
        out.append(None if shown == label else shown)
    return out


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
    # As wide as the console (rich's default is 100 columns): long source lines stay whole.
    return Traceback(
        trace=trace, extra_lines=1, max_frames=_MAX_FRAMES, width=None, code_width=None
    )


def render_finding(finding: Finding, world_size: int = 0) -> RenderableType:
    """A rich panel: what diverged, the likely cause, a table of the sides, and their call sites."""
    parts: list[RenderableType] = [Text(finding.message, style="bold")]
    if finding.cause:
        parts.append(Text.assemble(("Likely cause: ", "bold yellow"), finding.cause))
    for line in _culprit_lines(finding, world_size):
        parts.append(Text(line, style="bold yellow"))
    if finding.found_by:
        parts.append(Text.assemble(("Found: ", "bold"), finding.found_by))
    repeats = repeats_line(finding)
    if repeats:
        parts.append(Text.assemble(("Recurring: ", "bold"), repeats))
    if finding.sides:
        parts.append(_sides_table(finding.sides, world_size))
    stacks = _stacks(finding, world_size)
    for (label, stack, caption), same in zip(stacks, _drawn_before(stacks), strict=True):
        if same is not None:
            parts.append(Text(f"{label}: the same stack as {same}", style="bold"))
            continue
        tb = _traceback(stack, label, caption)
        if tb is not None:
            parts.append(Text(f"{label}:", style="bold"))
            parts.append(tb)
    # A Text, not a str: "[recompute_mismatch]" would be read as rich markup and vanish.
    title = Text(f"rngcheck: {finding.title} [{finding.kind.value}]")
    return Panel(Group(*parts), title=title, border_style="red", title_align="left")


def format_finding(finding: Finding, world_size: int = 0) -> str:
    """The same content as plain text, for logs and non-terminal output."""
    lines = [f"rngcheck: {finding.title} [{finding.kind.value}]", f"  {finding.message}"]
    if finding.cause:
        lines.append(f"  Likely cause: {finding.cause}")
    lines += [f"  {line}" for line in _culprit_lines(finding, world_size)]
    if finding.found_by:
        lines.append(f"  Found: {finding.found_by}")
    repeats = repeats_line(finding)
    if repeats:
        lines.append(f"  Recurring: {repeats}")
    for side in finding.sides:
        label = _side_label(side, world_size)
        e = side.event
        if e is None:
            lines.append(f"  {label}: {side.note or '-'}")
            continue
        state = "served from cache" if e.cached else _hex(e.before)
        lines.append(
            f"  {label}: {e.op}({', '.join(e.args)}) on {e.generator.label}, "
            f"state {state}, at {e.site}"
        )
    stacks = _stacks(finding, world_size)
    for (label, stack, _), same in zip(stacks, _drawn_before(stacks), strict=True):
        frames = stack.user_frames[-_MAX_FRAMES:]
        if not frames:
            continue
        if same is not None:
            lines.append(f"  {label}: the same stack as {same}")
            continue
        lines.append(f"  {label} stack (most recent call last):")
        for f in frames:
            lines.append(f'    File "{f.filename}", line {f.lineno}, in {f.name}')
            if f.line:
                lines.append(f"      {f.line}")
    return "\n".join(lines)


def _default_console() -> Console:
    return Console(file=sys.stderr, stderr=True)


def print_finding(finding: Finding, console: Console | None = None, world_size: int = 0) -> None:
    console = console or _default_console()
    if console.is_terminal:
        console.print(render_finding(finding, world_size))
    else:
        text = format_finding(finding, world_size)
        console.print(text, markup=False, highlight=False, soft_wrap=True)


def summary_line(report: Report) -> str:
    """One line: what was checked and what was found, with true totals (repeats, findings not
    kept, findings ignored); for a run that did not complete (a crash, or a report saved while it
    ran), that first, and what was checked until then, never as if it had run to its end."""
    where = f" on rank {report.rank} of {report.world_size}" if report.world_size > 1 else ""
    if report.ok:
        status = "no findings"
    else:
        status = f"{report.distinct} finding(s)"
        if report.occurrences > len(report.findings):
            status += f" ({report.occurrences} occurrences)"
        if report.findings_dropped:
            status += f", {report.findings_dropped} of them not kept"
    ignored = sum(report.ignored.values())
    if ignored:
        status += f", ignored: {ignored}"
    if not report.completed:
        return (
            f"rngcheck: {incomplete_text(report)}: {report.random_ops} random op(s) checked"
            f"{where} until then, {status}"
        )
    return f"rngcheck: {report.random_ops} random op(s) checked{where}, {status}"


def incomplete_text(report: Report) -> str:
    """How a run that did not complete ended, as far as its report says ("" when it completed)."""
    if report.completed:
        return ""
    how = str(report.meta.get("ended_by", ""))
    if how:
        return f"the run did not complete (it ended by {how})"
    saved = report.meta.get("saved_at")
    at = f" at {saved}" if saved else ""
    return f"the run had not completed when this report was saved{at}"


def format_report(report: Report) -> str:
    parts = [summary_line(report)]
    parts.extend(format_finding(f, report.world_size) for f in report.findings)
    parts.extend(f"note: {n.message}" for n in report.notes)
    return "\n".join(parts)


def print_report(report: Report, console: Console | None = None) -> None:
    """Draw a whole report: its findings, then its notes, then one summary line."""
    console = console or _default_console()
    for finding in report.findings:
        print_finding(finding, console, report.world_size)
    for note in report.notes:
        if console.is_terminal:
            console.print(Panel(Text(note.message), title="rngcheck note", border_style="yellow"))
        else:
            console.print(f"note: {note.message}", markup=False, highlight=False, soft_wrap=True)
    console.print(summary_line(report), markup=False, highlight=False)


def print_repeats(report: Report, repeated: list[Finding], console: Console | None = None) -> None:
    """At the end of a warned run: one line per finding that recurred after it was drawn."""
    console = console or _default_console()
    for f in repeated:
        line = f"rngcheck: the {f.kind.value} at {f.site} ({f.op}) was {repeats_line(f)}"
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if report.findings_dropped:
        console.print(
            f"rngcheck: {report.findings_dropped} further distinct finding(s) were counted but "
            "not kept or drawn",
            markup=False,
            highlight=False,
        )
