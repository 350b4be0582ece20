"""The ``rngcheck`` command: read what a run left behind.

``rngcheck show PATH...`` renders saved reports (files or directories of them), merging the per-rank
files of one run into one rendering per finding. ``rngcheck diff A B`` compares the random-op
streams of two saved traces and shows the first op where they part, with both call sites.

Exit codes, for CI:

=====  ===================================================================================
code   meaning
=====  ===================================================================================
0      ``show``: no findings. ``diff``: the two streams are the same.
1      ``show``: at least one finding. ``diff``: the streams diverge (the first op is shown).
2      usage error, or a file that cannot be read or is not an rngcheck report or trace.
3      ``show``: no findings, but a run's reports are incomplete (a rank wrote none, or its
       process was killed: its report was last saved while it ran).
=====  ===================================================================================
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from rich.traceback import Frame as RichFrame
from rich.traceback import Stack as RichStack
from rich.traceback import Trace, Traceback

__all__ = ["main"]

EXIT_OK, EXIT_FOUND, EXIT_ERROR, EXIT_INCOMPLETE = 0, 1, 2, 3


class _UsageError(Exception):
    pass


def _os_error_line(e: OSError) -> str:
    """``PATH: no such file or directory``: the file first, as every other line names it (not
    Python's ``[Errno 2] No such file or directory: 'PATH'``)."""
    if e.filename is None or not e.strerror:
        return str(e)
    return f"{e.filename}: {e.strerror[0].lower()}{e.strerror[1:]}"


# -- show ------------------------------------------------------------------------------------------


def _print(console: Console, text: str, style: str | None = None) -> None:
    if console.is_terminal:
        console.print(text, style=style, markup=False, highlight=False)
    else:
        console.print(text, markup=False, highlight=False, soft_wrap=True)


def _context_table(console: Console, merged: Any, several: bool) -> None:
    """The events around the finding, as the run saw them (the finding's op marked)."""
    events = merged.finding.context
    if not events:
        return
    rows = [
        (
            ">" if e.seq == merged.finding.seq else "",
            str(e.seq),
            e.op,
            e.generator.label,
            e.phase.value + (f" ({e.region})" if e.region else ""),
            "-" if e.before is None else f"{e.before & 0xFFFFFFFFFFFFFFFF:016x}",
            e.site,
        )
        for e in events
    ]
    header = ("", "#", "op", "generator", "phase", "state before", "call site")
    on = f" (on rank {merged.rank})" if several else ""
    if console.is_terminal:
        title = f"random ops around it{on}"
        table = Table(*header, title=title, title_justify="left")
        for row in rows:
            table.add_row(*row)
        console.print(table)
        return
    _print(console, f"  random ops around it{on}:")
    for row in rows:
        _print(
            console,
            f"  {row[0]:1} #{row[1]:>5} {row[2]} on {row[3]}, {row[4]}, state "
            f"{row[5]}, at {row[6]}",
        )


def _run_status(run: Any) -> str:
    """The run's totals: distinct findings, their occurrences, those not kept, those ignored."""
    reports = run.reports.values()
    dropped = max((r.findings_dropped for r in reports), default=0)
    occurrences = sum(m.finding.count for m in run.findings.values())
    ignored = sum(sum(r.ignored.values()) for r in reports)
    if run.findings:
        status = f"{len(run.findings) + dropped} finding(s)"
        if occurrences > len(run.findings):
            status += f" ({occurrences} occurrences)"
        if dropped:
            status += f", {dropped} of them not kept"
    else:
        status = "no findings"
    return status + (f", ignored: {ignored}" if ignored else "")


def _show(paths: Sequence[str], console: Console, context: bool) -> int:
    from .core.findings import format_ranks
    from .output.render import print_finding
    from .output.runs import load_runs, report_files

    found = report_files(paths)
    try:
        runs = load_runs(found.files, skip_foreign=found.in_directories)
    except ValueError:  # ReportError, and UnicodeDecodeError from a binary file
        for path in found.files:
            if path not in found.in_directories:
                _check_report(path)  # one plain line for the first file that is not a report
        raise
    code = EXIT_OK
    for run in runs:
        if len(runs) > 1:
            _print(console, f"== run {run.run_id}", style="bold")
        for merged in run.findings.values():
            print_finding(merged.finding, console, run.world_size)
            if len(run.reports) > 1:
                _print(console, f"  recorded by rank(s) {format_ranks(merged.seen_on)}")
            if context:
                _context_table(console, merged, several=len(run.reports) > 1)
        for note, ranks in run.notes.values():
            on = f" (rank(s) {format_ranks(ranks)})" if len(run.reports) > 1 else ""
            _print(console, f"note{on}: {note.message}", style="yellow")
        ops = sum(r.random_ops for r in run.reports.values())
        status = _run_status(run)
        which = format_ranks(run.reports, run.world_size)
        what = (
            f"{len(run.reports)} rank report(s) (ranks {which})"
            if run.world_size > 1
            else "1 report"
        )
        if run.unfinished or run.crashed:
            status += ", but the run did not complete"
        _print(console, f"rngcheck: {what}, {ops} random op(s) checked, {status}")
        ended: dict[tuple[str, bool], list[int]] = {}
        for rank, r in sorted(run.reports.items()):
            how = str(r.meta.get("ended_by", ""))
            if how and (not r.completed or how not in ("exit", "destroy_process_group()")):
                ended.setdefault((how, r.completed), []).append(rank)
        one = run.world_size == 1
        for (how, completed), ranks_ in ended.items():
            who = "the run" if one else f"rank(s) {format_ranks(ranks_)}"
            before = "" if completed else " before completing"
            _print(console, f"rngcheck: {who} ended by {how}{before}")
        if run.unfinished:
            saved = {str(run.reports[r].meta.get("saved_at", "")) for r in run.unfinished}
            at = f" at {saved.pop()}" if len(saved) == 1 and "" not in saved else ""
            who = "the run" if one else f"rank(s) {format_ranks(run.unfinished)}"
            _print(
                console,
                f"rngcheck: {who} did not complete: the process ended without finishing its "
                "report (killed by a signal such as SIGTERM or SIGKILL, os._exit, a crash in "
                f"native code), or still runs; it was last saved{at}, as the run went: what was "
                "checked after that is unknown",
                style="yellow",
            )
        if run.missing:
            _print(
                console,
                f"rngcheck: no report from rank(s) {format_ranks(run.missing)}: they may have "
                "been killed before writing one; their findings are unknown",
                style="yellow",
            )
        if run.findings:
            code = EXIT_FOUND
        elif (run.missing or run.unfinished) and code == EXIT_OK:
            code = EXIT_INCOMPLETE
    return code


_SHOW_READS = "show reads the reports written by report_path= or RNGCHECK_REPORT"


def _check_report(path: str) -> None:
    """Raise a one-line :class:`_UsageError` when ``path`` is not a report this rngcheck reads:
    unreadable, too large, not text, not JSON (a trace, say), cut off, or JSON that is not a
    report."""
    from .output.report import Report, ReportTooLarge, broken_report, read_report_text
    from .output.runs import is_trace

    try:
        text = read_report_text(path)
        data = json.loads(text)
    except ReportTooLarge as e:
        raise _UsageError(f"{path}: {e}") from None
    except UnicodeDecodeError:
        raise _UsageError(f"{path}: not an rngcheck report (not text); {_SHOW_READS}") from None
    except json.JSONDecodeError as e:
        if is_trace(path):
            raise _UsageError(
                f"{path}: an rngcheck trace, not a report; compare traces with `rngcheck diff A B`"
            ) from None
        broken = broken_report(text, e)
        if broken:
            raise _UsageError(f"{path}: {broken}") from None
        what = "an empty file" if not e.doc.strip() else f"not JSON: {e.msg}, line {e.lineno}"
        raise _UsageError(f"{path}: not an rngcheck report ({what}); {_SHOW_READS}") from None
    try:
        Report.from_dict(data)
    except (ValueError, KeyError, TypeError) as e:  # JSON of another kind, another format version
        raise _UsageError(f"{path}: {e}") from None


# -- diff ------------------------------------------------------------------------------------------


def _frames_text(op: Any, label: str) -> list[str]:
    lines = [f"  {label} stack (most recent call last):"]
    for f in op.frames[-6:]:
        lines.append(f'    File "{f.filename}", line {f.lineno}, in {f.name}')
        if f.line:
            lines.append(f"      {f.line}")
    return lines if op.frames else []


def _op_line(op: Any) -> str:
    extra = f", in region {op.region}" if op.region else ""
    state = "served from cache" if op.cached else (op.before or "-")
    return f"{op.call} on {op.generator}, {op.phase}{extra}, state {state}, at {op.site}"


def _diff_dirs(a_dir: str, b_dir: str, console: Console, structure_only: bool) -> int:
    """Two RNGCHECK_TRACE directories: each rank's trace against the same rank's."""
    names = {
        side: {os.path.basename(p) for p in glob.glob(os.path.join(d, "*.jsonl"))}
        for side, d in (("A", a_dir), ("B", b_dir))
    }
    if not names["A"] and not names["B"]:
        raise _UsageError(f"no *.jsonl traces in {a_dir} or {b_dir}")
    code = EXIT_OK
    for name in sorted(names["A"] ^ names["B"]):
        where = b_dir if name in names["A"] else a_dir
        _print(console, f"rngcheck diff: {name} is missing from {where}")
        code = EXIT_FOUND
    for name in sorted(names["A"] & names["B"]):
        _print(console, f"== {name}", style="bold")
        a, b = os.path.join(a_dir, name), os.path.join(b_dir, name)
        code = max(code, _diff(a, b, console, structure_only))
    return code


def _read_trace(path: str) -> Any:
    from .output.trace import read_trace

    try:
        return read_trace(path)
    except UnicodeDecodeError:
        raise _UsageError(f"{path} is not an rngcheck trace (not text)") from None


def _diff(a_path: str, b_path: str, console: Console, structure_only: bool) -> int:
    if os.path.isdir(a_path) and os.path.isdir(b_path):
        return _diff_dirs(a_path, b_path, console, structure_only)
    for path in (a_path, b_path):
        if os.path.isdir(path):
            raise _UsageError(
                f"{path} is a directory and the other is not: compare two trace files, or two "
                "directories of them (RNGCHECK_TRACE of two runs)"
            )
    from .output.trace import TraceFormatError, first_divergence

    try:
        a, b = _read_trace(a_path), _read_trace(b_path)
        divergence, compared = first_divergence(a.ops(), b.ops(), structure_only=structure_only)
    except (TraceFormatError, KeyError, ValueError) as e:  # OSError: main() names the file
        raise _UsageError(str(e)) from None
    what = "op sequences" if structure_only else "random-op streams"
    if divergence is None:
        _print(console, f"rngcheck diff: the {what} are the same ({compared} random op(s))")
        return EXIT_OK
    d = divergence
    headline = (
        f"rngcheck diff: the {what} diverge at random op #{d.index} "
        f"({d.index} op(s) agree before it); first difference: {d.differs}"
    )
    if console.is_terminal:
        console.print(_diff_panel(d, headline, a_path, b_path))
        return EXIT_FOUND
    lines = [headline, f"  {d.explanation}"]
    if d.agreed:
        lines.append(f"  last op both ran: {_op_line(d.agreed[-1])}")
    for label, path, op in (("A", a_path, d.a), ("B", b_path, d.b)):
        lines.append(f"  {label} ({path}): " + (_op_line(op) if op else "ended here"))
    for label, op in (("A", d.a), ("B", d.b)):
        if op is not None:
            lines.extend(_frames_text(op, label))
    _print(console, "\n".join(lines))
    return EXIT_FOUND


def _diff_panel(d: Any, headline: str, a_path: str, b_path: str) -> Panel:
    """The terminal rendering: the explanation, a table of both sides, and both call stacks."""
    table = Table(show_header=True, header_style="bold", pad_edge=False)
    for col in ("", "op", "generator", "arguments", "phase", "state before", "call site"):
        table.add_column(col, overflow="fold")

    def row(label: str, op: Any) -> None:
        if op is None:
            table.add_row(label, "(ended here)", "", "", "", "", "")
            return
        state = "served from cache" if op.cached else (op.before or "-")
        table.add_row(label, op.op, op.generator, ", ".join(op.args), op.phase, state, op.site)

    if d.agreed:
        row("last both ran", d.agreed[-1])
    row(f"A {a_path}", d.a)
    row(f"B {b_path}", d.b)
    parts: list[Any] = [Text(d.explanation, style="bold"), table]
    for label, op in (("A", d.a), ("B", d.b)):
        if op is not None and op.frames:
            frames = [
                RichFrame(filename=f.filename, lineno=f.lineno, name=f.name, line=f.line)
                for f in op.frames[-6:]
            ]
            stack = RichStack(exc_type=label, exc_value=op.call, frames=frames)
            parts.append(Traceback(trace=Trace(stacks=[stack]), extra_lines=1, width=100))
    return Panel(Group(*parts), title=headline, title_align="left", border_style="red")


# -- entry point -----------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rngcheck",
        description="Read what rngcheck saved: reports (show) and random-op traces (diff).",
        epilog="Exit codes: 0 clean / same, 1 findings / diverged, 2 error, 3 reports missing.",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"rngcheck {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser(
        "show",
        help="render saved reports, merging the per-rank files of one run",
        description="Render saved reports. PATH: a report file or a directory of them "
        "(RNGCHECK_REPORT). The per-rank files of one run are merged.",
    )
    show.add_argument("paths", nargs="+", metavar="PATH")
    show.add_argument(
        "--no-context", action="store_true", help="leave out the random ops around each finding"
    )
    diff = sub.add_parser(
        "diff",
        help="compare the random-op streams of two traces; show the first divergent op",
        description="Compare two traces (RNGCHECK_TRACE or trace=...) op by op: the op, its "
        "generator, its arguments, its phase, then the generator state before and after. Two "
        "directories (RNGCHECK_TRACE of two runs): each rank's trace against the same rank's.",
    )
    diff.add_argument("a", metavar="A")
    diff.add_argument("b", metavar="B")
    diff.add_argument(
        "--structure-only",
        action="store_true",
        help="compare ops, generators and arguments only, not states (runs with other seeds)",
    )
    return parser


def main(argv: Sequence[str] | None = None, console: Console | None = None) -> int:
    """Run the CLI; returns the exit code (see the module docstring)."""
    args = _parser().parse_args(argv)
    console = console or Console()
    try:
        if args.command == "show":
            return _show(args.paths, console, context=not args.no_context)
        return _diff(args.a, args.b, console, args.structure_only)
    except Exception as e:  # noqa: BLE001 - narrowed below; the modules load only on failure
        from .output.runs import ReportError
        from .output.trace import TraceFormatError

        if not isinstance(e, (_UsageError, ReportError, TraceFormatError, OSError)):
            raise
        line = _os_error_line(e) if isinstance(e, OSError) else str(e)
        Console(file=sys.stderr).print(
            f"rngcheck: {line}", markup=False, highlight=False, soft_wrap=True
        )
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
