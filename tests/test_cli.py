"""The rngcheck CLI on reports and traces saved by real runs of the mode: what it prints and the
exit codes CI relies on."""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch.utils.checkpoint import checkpoint

import rngcheck
from rngcheck.cli import main
from rngcheck.output.report import MAX_REPORT_BYTES, Report
from rngcheck.output.trace import read_trace

SCRIPTS = Path(__file__).resolve().parent / "scripts"
RNGCHECK_BIN = Path(sys.executable).parent / "rngcheck"  # the console script
TITLE = "checkpoint recompute drew different random numbers"
HERE = Path(__file__).name


def _cli(*args: str) -> tuple[int, str]:
    buf = io.StringIO()
    code = main(list(args), console=Console(file=buf, width=200))
    return code, buf.getvalue()


def _line_of(text: str) -> str:
    lines = Path(__file__).read_text().splitlines()
    return f"{HERE}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


# -- programs whose reports and traces the tests read ------------------------------------------


def _buggy_step() -> None:
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(8, 8)

    def block(x: torch.Tensor) -> torch.Tensor:
        return layer(x) * (torch.rand(x.shape, generator=gen) > 0.5)  # not replayed

    checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=False).sum().backward()


def _training(steps: int = 5, *, seed: int = 0, extra_at: int = -1, p: float = 0.1) -> None:
    torch.manual_seed(seed)
    x = torch.ones(4, 4)
    for i in range(steps):
        if i == extra_at:
            torch.rand(3)  # the refactor: one more random op
        torch.nn.functional.dropout(x, p)  # the dropout line


def _save_report(path: Path, fn, **meta) -> Report:
    with rngcheck.RNGConsistencyMode(on_finding="record", report_path=str(path)) as mode:
        fn()
    report = Report.load(path)
    if meta:  # the fields a multi-rank run sets (the same program ran on each "rank")
        report.meta.update({k: v for k, v in meta.items() if k not in ("rank", "world_size")})
        report.rank, report.world_size = meta.get("rank", 0), meta.get("world_size", 1)
        report.save(path)
    assert report.random_ops == mode.report.random_ops
    return report


def _save_trace(path: Path, **kwargs) -> Path:
    with rngcheck.RNGConsistencyMode(on_finding="record", trace=str(path)):
        _training(**kwargs)
    return path


# -- show ----------------------------------------------------------------------------------------


def test_show_renders_a_report_with_the_ops_around_the_finding(tmp_path: Path) -> None:
    report = _save_report(tmp_path / "r.json", _buggy_step)
    code, out = _cli("show", str(tmp_path / "r.json"))
    assert code == 1
    assert out.count(TITLE) == 1
    assert _line_of("# not replayed") in out  # the user's line
    assert "random ops around it:" in out and "aten.rand.generator on Generator #1" in out
    assert f"rngcheck: 1 report, {report.random_ops} random op(s) checked, 1 finding(s)" in out
    code, out = _cli("show", "--no-context", str(tmp_path / "r.json"))
    assert code == 1 and "random ops around it" not in out


def _reseeding_step() -> None:
    layer = torch.nn.Linear(8, 8)
    step = {"n": 0}

    def block(x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(step["n"])  # the reseed show names
        return torch.nn.functional.dropout(layer(x), 0.5)

    y = checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=False)
    step["n"] += 1
    y.sum().backward()


def test_show_draws_the_call_a_cause_names_with_its_line(tmp_path: Path) -> None:
    _save_report(tmp_path / "report.json", _reseeding_step)
    code, out = _cli("show", str(tmp_path / "report.json"))
    assert code == 1
    site = _line_of("the reseed show names")
    assert f"culprit: torch.manual_seed(1) at {site}" in out
    assert 'torch.manual_seed(step["n"])  # the reseed show names' in out.split("culprit stack")[1]


@pytest.mark.slow
def test_show_merges_the_per_rank_files_of_one_run(tmp_path: Path) -> None:
    for rank in (0, 1):
        _save_report(
            tmp_path / f"rank{rank}.json", _buggy_step, rank=rank, world_size=2, run_id="job-7"
        )
    code, out = _cli("show", str(tmp_path))
    assert code == 1
    assert out.count(TITLE) == 1  # one rendering for the finding both ranks recorded
    assert "recorded by rank(s) 0-1" in out
    assert "random ops around it (on rank 0):" in out
    assert "rngcheck: 2 rank report(s) (ranks 0-1 of 2)" in out
    assert "no report from" not in out


def test_show_exit_codes_clean_and_incomplete(tmp_path: Path) -> None:
    clean = tmp_path / "clean"
    report = _save_report(clean / "rank0.json", _training)
    assert _cli("show", str(clean)) == (
        0,
        f"rngcheck: 1 report, {report.random_ops} random op(s) checked, no findings\n",
    )
    # Rank 1 of 2 never wrote its report (killed hard): no findings, but not a clean bill either.
    partial = tmp_path / "partial"
    _save_report(partial / "rank0.json", _training, rank=0, world_size=2, run_id="job-8")
    code, out = _cli("show", str(partial))
    assert code == 3
    assert "no report from rank(s) 1" in out


def test_show_keeps_runs_apart(tmp_path: Path) -> None:
    _save_report(tmp_path / "a.json", _training, run_id="run-a")
    _save_report(tmp_path / "b.json", _buggy_step, run_id="run-b")
    code, out = _cli("show", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert code == 1
    assert "== run run-a" in out and "== run run-b" in out
    assert out.index("== run run-b") < out.index(TITLE)  # the finding is under its own run


def test_show_reads_a_run_directory_that_also_holds_the_trainings_json(
    tmp_path: Path, capsys
) -> None:
    # RNGCHECK_REPORT=$OUTPUT_DIR: the training writes its own JSON beside the rank reports.
    for rank in (0, 1):
        _save_report(
            tmp_path / f"rank{rank}.json", _buggy_step, rank=rank, world_size=2, run_id="job-9"
        )
    alone = _cli("show", str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2}')
    (tmp_path / "trainer_state.json").write_text('{"global_step": 4, "log_history": []}')
    (tmp_path / "losses.json").write_text("[4.2, 4.1]")
    (tmp_path / "notes.json").write_text("step 4: ok")
    (tmp_path / "blob.json").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "format-only.json").write_text('{"format": 1}')  # claims to be a report, is not
    _save_trace(tmp_path / "trace.json")  # begins with a "format" too, but a trace's
    with open(tmp_path / "dataset.json", "wb") as f:  # too large to be one (sparse: no disk)
        f.truncate(MAX_REPORT_BYTES + 1)
    assert _cli("show", str(tmp_path)) == alone
    assert alone[0] == 1 and "rngcheck: 2 rank report(s) (ranks 0-1 of 2)" in alone[1]
    # Named on its own, a file must still be a report; a directory must hold one.
    assert _cli("show", str(tmp_path / "config.json")) == (2, "")
    assert "config.json: not an rngcheck report" in capsys.readouterr().err
    assert _cli("show", str(tmp_path), str(tmp_path / "config.json")) == (2, "")
    assert "config.json: not an rngcheck report" in capsys.readouterr().err
    # rank0.json cut off (an incomplete copy): named, not "rank 0 may have been killed".
    (tmp_path / "rank0.json").write_text((tmp_path / "rank0.json").read_text()[:1000])
    assert _cli("show", str(tmp_path)) == (2, "")
    assert capsys.readouterr().err == (
        f"rngcheck: {tmp_path / 'rank0.json'}: an rngcheck report cut off after 1,000 bytes (an "
        "incomplete copy?): its findings are unknown\n"
    )
    for name in ("rank0.json", "rank1.json"):
        (tmp_path / name).unlink()
    assert _cli("show", str(tmp_path)) == (2, "")
    assert capsys.readouterr().err == (
        f"rngcheck: {tmp_path}: no rngcheck report among its 8 *.json file(s); show reads the "
        "reports written by report_path= or RNGCHECK_REPORT\n"
    )


def test_show_says_in_one_line_what_it_cannot_read(tmp_path: Path, capsys) -> None:
    _save_trace(tmp_path / "t.jsonl")
    report = _save_report(tmp_path / "r.json", _training)
    files = {
        "other.json": '{"name": "a package.json, say"}',
        "list.json": "[1, 2]",
        "bad.json": "{not json",
        "empty.json": "",
        "v99.json": json.dumps({**report.to_dict(), "format": 99}),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "format-only.json").write_text('{"format": 1}')  # was shown as an empty report
    text = report.to_json()
    (tmp_path / "cut.json").write_text(text[: len(text) // 2])
    with open(tmp_path / "huge.json", "wb") as f:  # sparse: no disk behind it
        f.truncate(MAX_REPORT_BYTES + 1)
    (tmp_path / "empty").mkdir()
    _save_report(tmp_path / "x" / "one.json", _training, run_id="r")
    _save_report(tmp_path / "x" / "two.json", _training, run_id="r")
    shows = "show reads the reports written by report_path= or RNGCHECK_REPORT"
    foreign = 'not an rngcheck report (JSON without rngcheck\'s "format" field); rngcheck reads'
    cases = {
        "missing.json": "no such file or directory",
        "other.json": foreign,
        "list.json": foreign,
        "v99.json": "unsupported rngcheck report format 99; this rngcheck reads format",
        "bad.json": f"not an rngcheck report (not JSON: Expecting property name enclosed in "
        f"double quotes, line 1); {shows}",
        "empty.json": f"not an rngcheck report (an empty file); {shows}",
        "binary.json": f"not an rngcheck report (not text); {shows}",
        "t.jsonl": "an rngcheck trace, not a report; compare traces with `rngcheck diff A B`",
        "empty": "no *.json reports in this directory",
        "format-only.json": 'not an rngcheck report (JSON with rngcheck\'s "format" field but '
        "without rank, world_size, random_ops, ops_by_name, ops_by_generator, findings, notes, "
        "meta, which every report has)",
        "cut.json": f"an rngcheck report cut off after {len(text) // 2:,} bytes (an incomplete "
        "copy?): its findings are unknown",
        "huge.json": f"too large for an rngcheck report ({MAX_REPORT_BYTES + 1:,} bytes; rngcheck "
        "reads at most 64 MiB of one, and a report is a few MiB at most)",
        # Read up to the cap, not until the kernel kills the process (it did at 23 GB).
        "/dev/zero": f"too large for an rngcheck report (over {MAX_REPORT_BYTES:,} bytes;",
    }
    for name, message in cases.items():
        path = tmp_path / name  # (an absolute name stays itself)
        assert _cli("show", str(path)) == (2, "")
        err = capsys.readouterr().err
        assert err.startswith(f"rngcheck: {path}: {message}") and err.count("\n") == 1, err
    assert _cli("show", str(tmp_path / "x")) == (2, "")
    assert "are both rank 0 of run r: show one run's files at a time" in capsys.readouterr().err


# -- diff ----------------------------------------------------------------------------------------


def test_diff_same_program_is_the_same(tmp_path: Path) -> None:
    a = _save_trace(tmp_path / "golden.jsonl")
    b = _save_trace(tmp_path / "new.jsonl")
    assert _cli("diff", str(a), str(b)) == (
        0,
        "rngcheck diff: the random-op streams are the same (5 random op(s))\n",
    )


def test_diff_shows_the_first_divergent_op_with_both_call_sites(tmp_path: Path) -> None:
    a = _save_trace(tmp_path / "before.jsonl")
    b = _save_trace(tmp_path / "after.jsonl", extra_at=2)
    code, out = _cli("diff", str(a), str(b))
    assert code == 1
    assert "diverge at random op #2 (2 op(s) agree before it); first difference: op" in out
    assert "A ran aten.bernoulli_.float, B ran aten.rand.default" in out
    dropout, extra = _line_of("# the dropout line"), _line_of("# the refactor")
    assert f"A ({a}): aten.bernoulli_.float(float32[4, 4], p=0.9) on default cpu" in out
    assert f"at {dropout}" in out and f"B ({b}): aten.rand.default(size=[3]" in out
    assert f"at {extra}" in out
    assert "A stack (most recent call last):" in out and "B stack (most recent call last):" in out
    assert "torch.rand(3)  # the refactor" in out  # B's source line


@pytest.mark.parametrize(
    ("b_kwargs", "differs", "explanation"),
    [
        ({"seed": 1}, "state before", "was in a different state before it"),
        ({"p": 0.5}, "arguments", "same op, different arguments (float32[4, 4], p=0.9 vs"),
        ({"steps": 3}, "length", "B ended after 3 random op(s); A went on with"),
    ],
)
def test_diff_names_what_differs_first(tmp_path: Path, b_kwargs, differs, explanation) -> None:
    a = _save_trace(tmp_path / "a.jsonl")
    b = _save_trace(tmp_path / "b.jsonl", **b_kwargs)
    code, out = _cli("diff", str(a), str(b))
    assert code == 1
    assert f"first difference: {differs}" in out and explanation in out


def test_diff_structure_only_ignores_states(tmp_path: Path) -> None:
    a = _save_trace(tmp_path / "a.jsonl")
    b = _save_trace(tmp_path / "b.jsonl", seed=1)
    assert _cli("diff", "--structure-only", str(a), str(b))[0] == 0
    c = _save_trace(tmp_path / "c.jsonl", seed=1, extra_at=0)
    assert _cli("diff", "--structure-only", str(a), str(c))[0] == 1


def test_a_trace_holds_every_op_however_small_the_window(tmp_path: Path) -> None:
    path = tmp_path / "long.jsonl"
    with rngcheck.RNGConsistencyMode(on_finding="record", trace=str(path), window=8):
        _training(steps=600)
    trace = read_trace(path)
    ops = list(trace.ops())
    assert [op.seq for op in ops] == list(range(600)) and trace.footer["random_ops"] == 600
    assert path.stat().st_size < 600 * 400  # call stacks are stored once, not per op
    assert [p.name for p in tmp_path.iterdir()] == ["long.jsonl"]  # no temporary file left


def test_diff_refuses_truncated_or_foreign_files(tmp_path: Path, capsys) -> None:
    a = _save_trace(tmp_path / "a.jsonl")
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(a.read_text().splitlines(keepends=True)[:-1]))
    report = tmp_path / "r.json"
    _save_report(report, _training)
    endless = tmp_path / "endless.jsonl"  # a trace's first line, then one of 17 MiB (sparse)
    with open(endless, "wb") as f:
        f.write(a.read_bytes().splitlines(keepends=True)[0])
        f.seek(17 * 2**20, os.SEEK_CUR)
        f.write(b"\n")
    for other, message in (
        (cut, "the trace has no end line (a truncated file?)"),
        (report, "is not an rngcheck trace"),
        (tmp_path / "nope.jsonl", f"{tmp_path / 'nope.jsonl'}: no such file or directory"),
        (tmp_path, f"{tmp_path} is a directory and the other is not: compare two trace files"),
        (Path("/dev/zero"), "/dev/zero is not an rngcheck trace"),  # read up to a line's cap
        (endless, f"{endless} is not an rngcheck trace (a line of over 16 MiB; a trace's lines"),
    ):
        assert _cli("diff", str(a), str(other)) == (2, "")
        err = capsys.readouterr().err
        assert err.startswith("rngcheck: ") and message in err and err.count("\n") == 1, err
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    assert _cli("diff", str(binary), str(a)) == (2, "")
    assert capsys.readouterr().err == f"rngcheck: {binary} is not an rngcheck trace (not text)\n"


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("RNGCHECK", "_RNGCHECK"))}


@pytest.mark.slow
def test_a_missing_file_is_one_line_naming_it_for_show_and_diff(tmp_path: Path) -> None:
    # Through the console script: exit status 2, one line on stderr, no traceback.
    missing = tmp_path / "nope.json"
    for args in (["show", str(missing)], ["diff", str(missing), str(missing)]):
        r = subprocess.run(
            [str(RNGCHECK_BIN), *args],
            env=_clean_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert (r.returncode, r.stdout) == (2, "")
        assert r.stderr == f"rngcheck: {missing}: no such file or directory\n"


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [
        ["RNGCHECK_BIN", "--version"],
        ["RNGCHECK_BIN", "--help"],
        ["RNGCHECK_BIN", "show", "--help"],
        ["RNGCHECK_BIN", "diff", "--help"],
        ["-m", "rngcheck.cli", "--help"],
    ],
)
def test_version_and_help_answer_without_importing_torch(command: list[str]) -> None:
    argv = [str(RNGCHECK_BIN) if a == "RNGCHECK_BIN" else a for a in command]
    r = subprocess.run(
        [sys.executable, "-X", "importtime", *argv],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rngcheck" in r.stdout  # the version or the usage text
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in r.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert {"rngcheck", "rich.console"} <= imported  # the probe sees what the CLI imports
    assert not {m for m in imported if m == "torch" or m.startswith("torch.")}


@pytest.mark.slow
def test_plain_tensors_and_dtensor_draw_the_same_numbers(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RNGCHECK", "_RNGCHECK"))}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, str(SCRIPTS / "dtensor_vs_plain.py"), str(tmp_path), str(port)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    # Through the console script, as CI would call it.
    r = subprocess.run(
        [str(RNGCHECK_BIN), "diff", str(tmp_path / "plain.jsonl"), str(tmp_path / "dtensor.jsonl")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (r.returncode, r.stdout) == (
        0,
        "rngcheck diff: the random-op streams are the same (3 random op(s))\n",
    )


def test_on_a_terminal_show_and_diff_draw_panels_with_both_stacks(tmp_path: Path) -> None:
    def tty(*args: str) -> tuple[int, str]:
        buf = io.StringIO()
        console = Console(file=buf, force_terminal=True, color_system=None, width=160)
        return main(list(args), console=console), buf.getvalue()

    _save_report(tmp_path / "r.json", _buggy_step)
    code, out = tty("show", str(tmp_path / "r.json"))
    assert code == 1
    assert f"╭─ rngcheck: {TITLE}" in out  # a rich panel
    assert "random ops around it" in out

    a = _save_trace(tmp_path / "before.jsonl")
    b = _save_trace(tmp_path / "after.jsonl", extra_at=2)
    code, out = tty("diff", str(a), str(b))
    assert code == 1
    assert "rngcheck diff: the random-op streams diverge at random op #2" in out
    assert "A: aten.bernoulli_.float(float32[4, 4], p=0.9)" in out  # A's traceback caption
    assert "B: aten.rand.default(size=[3], device=cpu)" in out
    assert "torch.rand(3)  # the refactor" in out  # B's source line, in its traceback
    assert "last both ran" in out


def test_a_trace_that_cannot_be_written_warns_and_never_stops_training(tmp_path: Path) -> None:
    folder = tmp_path / "traces"
    folder.mkdir()
    path = folder / "trace.jsonl"
    warns = pytest.warns(rngcheck.RNGCheckWarning, match=f"could not write its trace to {path}")
    with warns, rngcheck.RNGConsistencyMode(on_finding="record", trace=str(path)) as mode:
        _training()
        # Writable when the mode started (checked then); during the run its folder became a file.
        shutil.rmtree(folder)
        folder.write_text("")
    assert mode.report.random_ops == 5 and not path.exists()


def test_diff_two_trace_directories_rank_by_rank(tmp_path: Path) -> None:
    golden, new = tmp_path / "golden", tmp_path / "new"
    for rank in (0, 1):  # the per-rank files RNGCHECK_TRACE=DIR writes
        _save_trace(golden / f"rank{rank}.trace.jsonl")
        _save_trace(new / f"rank{rank}.trace.jsonl", extra_at=3 if rank == 1 else -1)
    code, out = _cli("diff", str(golden), str(new))
    assert code == 1
    assert "== rank0.trace.jsonl\nrngcheck diff: the random-op streams are the same" in out
    diverged = "rngcheck diff: the random-op streams diverge at random op #3"
    assert f"== rank1.trace.jsonl\n{diverged}" in out
    (new / "rank1.trace.jsonl").unlink()
    code, out = _cli("diff", str(golden), str(new))
    assert code == 1 and f"rngcheck diff: rank1.trace.jsonl is missing from {new}" in out
    (new / "rank0.trace.jsonl").rename(new / "rank1.trace.jsonl")
    (golden / "rank0.trace.jsonl").unlink()
    assert _cli("diff", str(golden), str(new))[0] == 0
