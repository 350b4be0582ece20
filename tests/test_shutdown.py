"""How checked runs end when they do not end well: a SIGTERM ends a checked rank as promptly as an
unchecked one (no signal handler), the report on disk is kept current as the run goes, a peer
whose process ended is named with what happened to it, and nothing closes with "no findings" as
if a crashed or killed run had completed.

The processes are real (two gloo ranks started by hand, real signals); every wait is bounded."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import clean_env as _env
from _dist import free_port
from rich.console import Console
from torch.utils.checkpoint import checkpoint

import rngcheck
from rngcheck.cli import main as cli_main
from rngcheck.output.render import summary_line
from rngcheck.output.report import Report
from rngcheck.session import keeper

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_stops.py"
TIMEOUT = 120  # hard limit for every process
PROMPT_S = 5.0  # "at once": what a SIGTERM may take to end a process, import-free
RECOMPUTE = "recompute_mismatch"


def _start_ranks(reports: Path, **env: str) -> list[subprocess.Popen[str]]:
    """train_stops.py as two checked ranks, findings recorded, reports in ``reports`` (no
    launcher: none stops a rank when the other ends)."""
    port = str(free_port())
    env.update(RNGCHECK="1", RNGCHECK_ON_FINDING="record", RNGCHECK_REPORT=str(reports))
    return [
        subprocess.Popen(
            [sys.executable, str(SCRIPT)],
            env=_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            start_new_session=True,
        )
        for r in (0, 1)
    ]


def _wait_for_line(proc: subprocess.Popen[str], line: str) -> list[str]:
    """The lines ``proc`` printed up to ``line``. Bounded by TIMEOUT: a process that prints
    nothing more is killed then (its output ends), so the test fails instead of hanging."""
    assert proc.stdout is not None
    watchdog = threading.Timer(TIMEOUT, _kill, (proc,))
    watchdog.start()
    seen = []
    try:
        for text in proc.stdout:
            seen.append(text)
            if text.strip() == line:
                return seen
    finally:
        watchdog.cancel()
    raise AssertionError(f"ended (or killed after {TIMEOUT} s) before printing {line!r}: {seen}")


def _kill(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _end(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            _kill(p)
        p.communicate(timeout=TIMEOUT)


def _show(path: Path) -> tuple[int, str]:
    buf = io.StringIO()
    code = cli_main(["show", "--no-context", str(path)], console=Console(file=buf, width=400))
    return code, buf.getvalue()


# -- SIGTERM: at once, whatever the rank is doing, and the report is on disk ---------------------


@pytest.mark.slow
def test_a_sigterm_ends_a_rank_waiting_in_a_collective_at_once_with_its_report_on_disk(
    tmp_path: Path,
) -> None:
    # Rank 1 is slow at step 3; rank 0 waits for it in the step's collective (the checker's
    # exchange, then the program's all_reduce), as a rank waits for one that saves a checkpoint.
    # A Python SIGTERM handler would run only once that wait returned (600 s here).
    procs = _start_ranks(tmp_path, STOP="slow", NOISE="1")
    try:
        _wait_for_line(procs[0], "step 3")
        time.sleep(1.0)  # now in the wait
        sent = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        procs[0].wait(timeout=PROMPT_S)
        took = time.monotonic() - sent
        _, err = procs[0].communicate(timeout=TIMEOUT)
    finally:
        _end(procs)
    assert procs[0].returncode == -signal.SIGTERM, err[-3000:]  # died of it, as unchecked
    assert took < PROMPT_S
    report = Report.load(tmp_path / "rank0.json")
    # Kept as the run went: the finding of step 1 (saved as it was found, recurrences counted
    # when saved since), what was checked until the last save, and that it did not complete.
    assert not report.completed and "ended_by" not in report.meta
    assert [f.kind.value for f in report.findings] == [RECOMPUTE]
    assert report.random_ops > 0 and report.meta["saved_at"]
    assert report.meta["process_group"]["world_size"] == 2
    assert "random op(s) checked" not in err  # no closing line as if it had completed
    code, out = _show(tmp_path)
    assert code == 1  # its finding
    assert "rank(s) 0-1 did not complete: the process ended without finishing its report" in out
    assert "random op(s) checked, 1 finding(s)" in out and "but the run did not complete" in out


_SWALLOWS = """
import time, torch
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
torch.nn.functional.dropout(model(torch.ones(2, 4)), 0.5).sum().backward()
opt.step()
while True:  # a script that retries whatever happens, SystemExit included
    try:
        print("waiting", flush=True)
        time.sleep(60)
    except BaseException as e:
        print("swallowed", type(e).__name__, flush=True)
"""


@pytest.mark.slow
def test_a_script_that_swallows_every_exception_still_ends_on_sigterm(tmp_path: Path) -> None:
    # The SystemExit a Python handler raised was one `except BaseException` swallows: the
    # process then went on as if nothing had happened.
    proc = subprocess.Popen(
        [sys.executable, "-c", _SWALLOWS],
        env=_env(RNGCHECK="1", RNGCHECK_REPORT=str(tmp_path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        _wait_for_line(proc, "waiting")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=PROMPT_S)
    finally:
        _end([proc])
    assert proc.returncode == -signal.SIGTERM and "swallowed" not in out, (out, err[-2000:])
    report = Report.load(tmp_path / "rank0.json")  # saved at the optimizer step
    assert not report.completed and report.random_ops == 3  # the Linear's 2 inits, the dropout
    assert "no findings" not in err


# -- a peer whose process ended: said at once, with what the store says of it -------------------


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["exit", "kill", "raise"])
def test_a_peer_whose_process_ends_is_named_at_once_with_what_the_store_says(
    tmp_path: Path, stop: str
) -> None:
    # Rank 1 ends at step 3 (os._exit, SIGKILL, an exception unwinding through the script's
    # `finally: destroy_process_group()`); rank 0 waits for it at the step's exchange. The group's
    # timeout is 600 s: the connection that closed says what happened long before.
    procs = _start_ranks(tmp_path, STOP=stop)
    start = time.monotonic()
    try:
        _, err = procs[0].communicate(timeout=TIMEOUT)
        took = time.monotonic() - start
    finally:
        _end(procs)
    assert took < 60, err[-3000:]  # start-up, 3 steps, the store's notes: not the 600 s timeout
    report = Report.load(tmp_path / "rank0.json")
    (missing,) = report.findings  # not a divergence at a final exchange the crashed rank ran
    assert missing.kind.value == "rank_missing" and missing.ranks == (1,), missing
    assert "rank(s) 1 did not reach RNG exchange #" in missing.message, missing.message
    assert "the connection to a peer closed" in missing.message
    assert "within 600 s" not in missing.message and "(the timeout is 600 s)" in missing.message
    if stop == "raise":  # the exception it ended with, as it left it on the store
        assert missing.cause.startswith(
            "rank 1 left the checked block early (ValueError: rank 1 fails at step 3)"
        ), missing.cause
    else:
        assert missing.cause.startswith(
            "rank(s) 1 left no note on the c10d store, where a rank that ends by a Python "
            "exception leaves one: its process was killed"
        ), missing.cause
    # Rank 0 then fails in the program's own all_reduce: its closing line says so, with what it
    # checked until then, not "no findings" as if the run had completed.
    assert report.meta["ended_by"].startswith("RuntimeError: ") and not report.completed
    closing = next(line for line in err.splitlines() if "random op(s) checked" in line)
    assert closing.startswith("rngcheck: the run did not complete (it ended by RuntimeError: ")
    assert "random op(s) checked on rank 0 of 2 until then, 1 finding(s)" in closing


def test_rank_missing_says_when_the_store_is_gone_too_and_a_timeout_as_before() -> None:
    # The dead rank hosted the c10d store (rank 0 under a plain env:// rendezvous): its note,
    # if it left one, cannot be read. Seen with STOP_RANK=0: "DistNetworkError: Broken pipe".
    from rngcheck.core.stacks import Stack
    from rngcheck.ranks.findings import missing_finding

    def finding(**how: object) -> Any:
        return missing_finding(
            rank=1,
            domain=(0, 1),
            arrived=(1,),
            left={},
            number=6,
            here="an optimizer step",
            sent_at="an optimizer step",
            timeout=600.0,
            last=None,
            stack=Stack.capture(),
            error=RuntimeError("Connection closed by peer [127.0.0.1]:34434"),
            **how,
        )

    gone = finding(closed=True, waited=12.34, store="DistNetworkError: Broken pipe")
    assert gone.message.startswith(
        "rank(s) 0 did not reach RNG exchange #6: the connection to a peer closed 12.3 s into "
        "the wait, its process ended (the timeout is 600 s); rank(s) 1 waited at"
    ), gone.message
    assert gone.cause.startswith(
        "the c10d store, where rank(s) 0 would have said why they left, could not be read "
        "(DistNetworkError: Broken pipe): its host, rank 0 or the launcher, may have ended too"
    ), gone.cause
    late = finding()  # a wait that ran out of time reads as it did
    assert late.message.startswith("rank(s) 0 did not reach RNG exchange #6 within 600 s;")


# -- in one process: the report kept on disk, and the words for a run that did not complete -----


def _noisy_checkpoint() -> None:
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(8, 8)

    def block(x: torch.Tensor) -> torch.Tensor:
        return layer(x) * (torch.rand(x.shape, generator=gen) > 0.1)

    checkpoint(block, torch.randn(2, 8, requires_grad=True), use_reentrant=False).sum().backward()


def test_the_report_on_disk_is_kept_current_as_the_run_goes(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    mode = rngcheck.RNGConsistencyMode(on_finding="record", report_path=str(path))
    with mode:
        started = Report.load(path)  # on disk from the start
        assert (started.completed, started.random_ops, started.findings) == (False, 0, [])
        _noisy_checkpoint()
        found = Report.load(path)  # a new finding is saved as it is found
        assert [f.kind.value for f in found.findings] == [RECOMPUTE] and not found.completed
        assert found.findings[0].context  # with the events around it, as far as they go
        # A recurrence is a progress point (as an exchange or an optimizer step is): the first
        # saves at once, the next ones once due (KEEP_EVERY_S), so the counts on disk are a few
        # seconds behind at most.
        _noisy_checkpoint()
        assert Report.load(path).findings[0].count == 2
        _noisy_checkpoint()
        mode._keeper.progress()
        assert Report.load(path).findings[0].count == 2
        assert mode._keeper.saves == 3  # the start, the finding, the first progress point
    final = Report.load(path)
    assert final.completed and final.findings[0].count == 3
    assert final.random_ops == mode.report.random_ops > 0
    assert final.meta["report_saves"]["while_running"] == 3


def test_a_progress_point_saves_again_once_due_and_only_when_something_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keeper, "KEEP_EVERY_S", 0.0)  # (due at once: no wait between saves)
    monkeypatch.setattr(keeper, "COST_SHARE", 0)
    path = tmp_path / "r.json"
    mode = rngcheck.RNGConsistencyMode(on_finding="record", report_path=str(path))
    with mode:
        torch.rand(3)
        mode._keeper.progress()
        mode._keeper.progress()  # nothing changed since: no save
        assert (mode._keeper.saves, Report.load(path).random_ops) == (2, 1)
        torch.rand(3)
        mode._keeper.progress()
        assert (mode._keeper.saves, Report.load(path).random_ops) == (3, 2)


def test_a_run_ended_by_an_exception_is_not_completed_and_says_how(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    mode = rngcheck.RNGConsistencyMode(on_finding="record", report_path=str(path))
    with pytest.raises(KeyError), mode:
        torch.rand(3)
        raise KeyError("boom")
    report = Report.load(path)
    assert not report.completed and report.meta["ended_by"] == "KeyError: 'boom'"
    assert summary_line(report) == (
        "rngcheck: the run did not complete (it ended by KeyError: 'boom'): 1 random op(s) "
        "checked until then, no findings"
    )
    code, out = _show(path)
    assert code == 0  # what it checked until the crash is known, and clean
    assert "rngcheck: 1 report, 1 random op(s) checked, no findings, but the run did not " in out
    assert "rngcheck: the run ended by KeyError: 'boom' before completing" in out


def test_show_says_a_killed_run_did_not_complete_and_exits_incomplete(tmp_path: Path) -> None:
    # What a killed process leaves: the report as last kept, never finished.
    data = json.loads(Report(random_ops=7, completed=False).to_json())
    data["meta"]["saved_at"] = "2025-01-02T03:04:05+00:00"
    (tmp_path / "rank0.json").write_text(json.dumps(data))
    code, out = _show(tmp_path)
    assert code == 3, out  # as for a rank that wrote none: what came after the save is unknown
    assert "rngcheck: 1 report, 7 random op(s) checked, no findings, but the run did not " in out
    assert (
        "rngcheck: the run did not complete: the process ended without finishing its report "
        "(killed by a signal such as SIGTERM or SIGKILL, os._exit, a crash in native code), or "
        "still runs; it was last saved at 2025-01-02T03:04:05+00:00, as the run went" in out
    )
    # A report written before the field existed reads as complete, as it was read then.
    del data["completed"]
    (tmp_path / "rank0.json").write_text(json.dumps(data))
    assert _show(tmp_path)[0] == 0 and Report.load(tmp_path / "rank0.json").completed
