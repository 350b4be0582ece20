"""RNGCHECK=1 on unmodified scripts: real processes (python and torchrun), real reports on disk.

Each subprocess imports torch (2-3 s), so every run checks all a user would see of it at once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _dist import assert_compared, launch_past_exit_aborts
from _dist import clean_env as _env

from rngcheck.core.config import RANGES, Config
from rngcheck.core.findings import Finding
from rngcheck.env import VARIABLES, EnvError, settings_from_env
from rngcheck.output.report import Report
from rngcheck.output.trace import first_divergence, read_trace

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
TIMEOUT = 120  # hard limit for every subprocess
_PIPES = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
RECOMPUTE_TITLE = "checkpoint recompute drew different random numbers"


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, env=_env(**env), capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT
    )


def _line(script: str, text: str) -> str:
    """``script:N`` of the line holding ``text``: where a report must point."""
    lines = (SCRIPTS / script).read_text().splitlines()
    return f"{script}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


def _torchrun(
    nproc: int, script: str, *script_args: str, **env: str
) -> subprocess.CompletedProcess[str]:
    # --standalone: the rendezvous binds a free port itself (a port picked here could be taken
    # by a concurrent test before torchrun binds it); gloo stays on loopback (GLOO_SOCKET_IFNAME).
    args = [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", str(SCRIPTS / script)]
    return launch_past_exit_aborts(lambda: _run([*args, *script_args], **env), nproc, script)


# -- off means off -------------------------------------------------------------------------------

_PROBE = (
    "import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in ('rngcheck', 'torch')))"
)


@pytest.mark.parametrize("value", [None, "0", "off", "False", ""])
def test_without_rngcheck_nothing_of_it_is_imported(value: str | None) -> None:
    env = {} if value is None else {"RNGCHECK": value}
    r = _run([PYTHON, "-X", "importtime", "-c", _PROBE], **env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
    assert "rngcheck" not in r.stderr  # -X importtime lists every module imported at all


def test_the_startup_hook_is_installed_with_the_package() -> None:
    import site

    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    hooks = [Path(d) / "rngcheck-autostart.pth" for d in dirs]
    hooks = [h for h in hooks if h.exists()]
    assert hooks, f"rngcheck-autostart.pth is in none of {dirs}: reinstall the package"
    assert hooks[0].read_text() == (ROOT / "rngcheck" / "rngcheck-autostart.pth").read_text()


# -- validation at the edge ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "valid"),
    [
        ("RNGCHECK", "maybe", "1, true, on, yes"),
        ("RNGCHECK_ON_FINDING", "crash", "raise, warn, record"),
        ("RNGCHECK_SYNC", "sometimes", "op, step, off"),
        ("RNGCHECK_EXPECT", "equal", "same, differ, ignore"),
        ("RNGCHECK_EVERY", "0", "a whole number from 1 to 1,000,000,000"),
        ("RNGCHECK_EVERY_OPS", "many", "a whole number from 1 to 1,000,000,000"),
        ("RNGCHECK_TIMEOUT", "-3", "a number of seconds from 0.001 to 2,592,000 (30 days)"),
        ("RNGCHECK_WINDOW", "1.5", "a whole number from 1 to 1,000,000"),
        ("RNGCHECK_RECOMPUTE", "sure", "0, false, off, no"),
        ("RNGCHECK_RECOMPUTE", "", "is set but empty: use one of 1, true, on, yes"),
        ("RNGCHECK_STRICT", "always", "0, false, off, no"),
        ("RNGCHECK_REPORT", " ", "a directory or a file path"),
    ],
)
def test_a_bad_value_names_the_variable_and_its_valid_values(name: str, value: str, valid: str):
    env = {"RNGCHECK": "1", name: value}
    with pytest.raises(EnvError) as info:
        settings_from_env(env)
    assert name in str(info.value) and valid in str(info.value)


# Each numeric variable and the mode's argument it sets: one range for both (core/config.RANGES).
_NUMBERS = {
    "RNGCHECK_WINDOW": "window",
    "RNGCHECK_TIMEOUT": "timeout",
    "RNGCHECK_EVERY_OPS": "every_ops",
    "RNGCHECK_EVERY_STEPS": "every_steps",
    "RNGCHECK_EVERY": "every_steps",
    "RNGCHECK_SAMPLE_EVERY": "sample_every",
    "RNGCHECK_SAMPLE_FIRST": "sample_first",
}


@pytest.mark.parametrize(("name", "setting"), _NUMBERS.items())
def test_a_number_has_one_range_for_the_variable_and_the_argument(name: str, setting: str):
    allowed = RANGES[setting]
    assert set(_NUMBERS.values()) == set(RANGES)  # every numeric setting has a variable here
    # and the docs' table shows its range
    assert VARIABLES[name].values in (str(allowed), allowed.text("N"))
    for value in (allowed.low, allowed.high):
        s = settings_from_env({"RNGCHECK": "1", name: str(value)})
        assert s.mode_kwargs[setting] == value
        Config(**{setting: value})
    below = allowed.low - 1 if allowed.whole else allowed.low / 2
    for value in (below, allowed.high + 1, 10**23):
        with pytest.raises(EnvError) as info:
            settings_from_env({"RNGCHECK": "1", name: str(value)})
        assert str(info.value).startswith(
            f"{name}={str(value)!r} is not valid: use {allowed}, e.g."
        )
        with pytest.raises(ValueError, match=re.escape(f"{setting} must be {allowed}")):
            Config(**{setting: value})


def test_a_misspelt_variable_is_refused_when_checking_is_on() -> None:
    with pytest.raises(EnvError, match="unknown variable RNGCHECK_SYNCH .*RNGCHECK_SYNC"):
        settings_from_env({"RNGCHECK": "1", "RNGCHECK_SYNCH": "op"})
    assert not settings_from_env({"RNGCHECK_SYNCH": "op"}).enabled  # off: nothing is read


def test_settings_map_to_the_mode_and_per_rank_files(tmp_path: Path) -> None:
    s = settings_from_env(
        {
            "RNGCHECK": "on",
            "RNGCHECK_ON_FINDING": "Record",
            "RNGCHECK_SYNC": "op",
            "RNGCHECK_EXPECT": "differ",
            "RNGCHECK_EVERY": "10",
            "RNGCHECK_TIMEOUT": "30",
            "RNGCHECK_RECOMPUTE": "0",
            "RNGCHECK_STRICT": "1",
            "RNGCHECK_REPORT": str(tmp_path),
            "RNGCHECK_TRACE": str(tmp_path / "t-{rank}.jsonl"),
            "RANK": "3",
            "WORLD_SIZE": "4",
        }
    )
    assert s.enabled and s.mode_kwargs["every_steps"] == 10 and (s.rank, s.world_size) == (3, 4)
    kw = s.mode_kwargs
    assert (kw["on_finding"], kw["sync"], kw["expect"]) == ("record", "op", "differ")
    assert kw["timeout"] == 30.0
    assert kw["check_recompute"] is False and kw["strict"] is True
    assert kw["report_path"] == str(tmp_path / "rank3.json")
    assert kw["trace"] == str(tmp_path / "t-3.jsonl")
    # A plain file name in a multi-rank job gets the rank, so ranks never overwrite each other.
    s = settings_from_env(
        {"RNGCHECK": "1", "RNGCHECK_REPORT": "out/r.json", "RANK": "1", "WORLD_SIZE": "2"}
    )
    assert s.mode_kwargs["report_path"] == os.path.abspath("out/r.rank1.json")


def test_every_variable_is_in_the_docs_table() -> None:
    readme = (ROOT / "docs" / "environment.md").read_text()
    section = readme.split("<!-- SECTION:env -->")[1].split("<!-- /SECTION:env -->")[0]
    for name in VARIABLES:
        assert f"| `{name}` |" in section, f"{name} is missing from the docs' table"


def test_a_bad_value_stops_the_run_before_user_code() -> None:
    r = _run([PYTHON, "-c", "print('user code ran')"], RNGCHECK="1", RNGCHECK_SYNC="sometimes")
    assert r.returncode == 2
    assert "user code ran" not in r.stdout
    expected = "RNGCHECK_SYNC='sometimes' is not valid: use one of op, step, off"
    assert f"rngcheck: cannot start: {expected}" in r.stderr


_PROC = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        # Past the top: was accepted, then an OverflowError in init_process_group (a timedelta)
        # or "cannot start: OverflowError: Python int too large to convert to C ssize_t".
        (
            "RNGCHECK_TIMEOUT",
            "99999999999999999999999",
            "RNGCHECK_TIMEOUT='99999999999999999999999' is not valid: use a number of seconds "
            "from 0.001 to 2,592,000 (30 days), e.g. 600",
        ),
        (
            "RNGCHECK_WINDOW",
            str(10**30),
            f"RNGCHECK_WINDOW='{10**30}' is not valid: use a whole number from 1 to 1,000,000, "
            "e.g. 4096",
        ),
        # Was read as off: the recompute check silently left out.
        (
            "RNGCHECK_RECOMPUTE",
            "",
            "RNGCHECK_RECOMPUTE is set but empty: use one of 1, true, on, yes (on) or 0, false, "
            "off, no (off), or unset it",
        ),
        # Passed the start check as root (os.access says yes), then failed at exit.
        pytest.param(
            "RNGCHECK_REPORT",
            "/proc/forbidden",
            "RNGCHECK_REPORT='/proc/forbidden' cannot be written: the folder /proc/forbidden "
            "cannot be created (",
            marks=_PROC,
        ),
        pytest.param(
            "RNGCHECK_TRACE",
            "/proc/forbidden/t.jsonl",
            "RNGCHECK_TRACE='/proc/forbidden/t.jsonl' cannot be written: the folder "
            "/proc/forbidden cannot be created (",
            marks=_PROC,
        ),
    ],
    ids=["timeout", "window", "recompute", "report", "trace"],
)
def test_input_that_cannot_work_stops_the_run_before_user_code_by_name(
    name: str, value: str, expected: str
) -> None:
    r = _run([PYTHON, "-c", "print('user code ran')"], RNGCHECK="1", **{name: value})
    assert r.returncode == 2, r.stderr
    assert "user code ran" not in r.stdout
    assert r.stderr.startswith(f"rngcheck: cannot start: {expected}"), r.stderr
    assert r.stderr.count("\n") == 1, r.stderr


# -- single process ------------------------------------------------------------------------------


@pytest.mark.slow
def test_clean_script_runs_checked_and_leaves_report_and_full_trace(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = _run(
        [PYTHON, str(SCRIPTS / "train_clean.py")],
        RNGCHECK="1",
        RNGCHECK_REPORT=str(out),
        RNGCHECK_TRACE=str(out),
        RNGCHECK_WINDOW="4",  # a small window: the trace must still hold every op
        TRAIN_STEPS="5",
    )
    assert r.returncode == 0, r.stderr
    assert "training finished" in r.stdout
    report = Report.load(out / "rank0.json")
    assert report.ok and report.random_ops > 10
    assert report.meta["activated_by"] == "RNGCHECK"
    assert report.meta["argv"][0].endswith("train_clean.py")
    assert r.stderr.count("rngcheck: checking checkpoint recomputes (torch ") == 1
    summary = f"rngcheck: {report.random_ops} random op(s) checked, no findings; reports: {out}"
    assert summary in r.stderr
    trace = read_trace(out / "rank0.trace.jsonl")
    ops = list(trace.ops())
    assert len(ops) == report.random_ops == trace.footer["random_ops"]
    assert [op.seq for op in ops] == list(range(len(ops)))
    assert any(op.site.startswith("train_clean.py:") for op in ops)
    assert not [p for p in os.listdir(out) if p.endswith(".tmp")]  # written atomically


@pytest.mark.slow
def test_buggy_script_fails_at_the_first_finding_with_one_rendering(tmp_path: Path) -> None:
    r = _run(
        [PYTHON, str(SCRIPTS / "train_buggy.py")], RNGCHECK="yes", RNGCHECK_REPORT=str(tmp_path)
    )
    assert r.returncode != 0
    assert "training finished" not in r.stdout
    assert r.stderr.count(RECOMPUTE_TITLE) == 1
    assert _line("train_buggy.py", "generator=noise") in r.stderr  # the user's line, not torch's
    assert "Traceback (most recent call last)" not in r.stderr  # the rendering says it all
    assert "stopped the run at the first finding (RecomputeMismatchError" in r.stderr
    report = Report.load(tmp_path / "rank0.json")
    (finding,) = report.findings
    assert finding.kind.value == "recompute_mismatch"
    assert finding.context and finding.context[-1].op == "aten.rand.generator"


@pytest.mark.slow
def test_record_mode_runs_to_the_end_and_a_sigterm_ends_it_with_its_findings_on_disk(
    tmp_path: Path,
) -> None:
    proc = subprocess.Popen(
        [PYTHON, str(SCRIPTS / "train_buggy.py")],
        env=_env(
            RNGCHECK="1",
            RNGCHECK_ON_FINDING="record",
            RNGCHECK_REPORT=str(tmp_path),
            RNGCHECK_TRACE=str(tmp_path),
            TRAIN_HANG="1",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # wait until it trains no more and sleeps, as a stuck rank would
            lines.append(line)
            if line.startswith("waiting"):
                break
        assert "training finished\n" in lines
        proc.send_signal(signal.SIGTERM)  # what torchrun sends the other ranks when one fails
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
    # No handler: it dies of the signal at once, as an unchecked process does (test_shutdown.py).
    assert proc.returncode == -signal.SIGTERM
    # The report was kept on disk as the run went: the finding, saved as it was found.
    report = Report.load(tmp_path / "rank0.json")
    assert [f.kind.value for f in report.findings] == ["recompute_mismatch"]
    assert not report.completed and "ended_by" not in report.meta
    assert RECOMPUTE_TITLE not in err  # record draws at exit; a killed process has none
    assert not (tmp_path / "rank0.trace.jsonl").exists()  # a trace is whole, or not there


# -- torchrun ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_torchrun_single_rank_binds_to_the_process_group(tmp_path: Path) -> None:
    r = _torchrun(1, "train_clean.py", RNGCHECK="1", RNGCHECK_REPORT=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    report = Report.load(tmp_path / "rank0.json")
    assert report.ok and report.random_ops > 0
    assert report.meta["process_group"] == {
        "backend": "gloo",
        "world_size": 1,
        "bound_after_step": 0,
    }
    # Nothing is compared across ranks, by design: a group of one rank has no other to compare
    # with, and no rank checker starts.
    assert "rank_compared" not in report.meta, report.meta


def _skip_until_ranks_land(r: subprocess.CompletedProcess[str]) -> None:
    if "cross-rank checking is not implemented yet" in r.stderr:
        pytest.skip("rngcheck.ranks does not check across ranks yet")


@pytest.mark.slow
def test_torchrun_two_ranks_record_renders_each_finding_once_at_exit(tmp_path: Path) -> None:
    record = {"RNGCHECK_ON_FINDING": "record", "RNGCHECK_REPORT": str(tmp_path)}
    r = _torchrun(2, "train_buggy.py", RNGCHECK="1", **record)
    _skip_until_ranks_land(r)
    assert r.returncode == 0, r.stderr[-3000:]  # record: the job runs to the end
    # One start-up line, from rank 0, naming the timeout that applies (torchrun's gloo group's).
    start = "rngcheck: checking random ops across ranks 0-1 (sync=step, timeout 1800 s from the "
    assert r.stderr.count(start + "process group) and checkpoint recomputes") == 1
    assert r.stdout.count("training finished") == 2
    reports = [Report.load(tmp_path / f"rank{i}.json") for i in range(2)]
    kinds = [sorted({f.kind.value for f in rep.findings}) for rep in reports]
    assert kinds == [["rank_divergence", "recompute_mismatch"]] * 2
    # A rank finding is the same on every rank and drawn once (by rank 0); a recompute mismatch
    # is each rank's own and drawn by that rank.
    assert r.stderr.count("RNG state diverged across ranks") == 1
    own = sum(f.kind.value == "recompute_mismatch" for rep in reports for f in rep.findings)
    assert r.stderr.count(RECOMPUTE_TITLE) == own
    summary = f"rngcheck: {reports[0].random_ops} random op(s) checked on rank 0 of 2, "
    assert r.stderr.count(summary) == 1  # one summary line, from rank 0


@pytest.mark.slow
def test_a_data_split_before_init_process_group_is_compared_once_the_group_is_up(
    tmp_path: Path,
) -> None:
    """The random ops before init_process_group are the environment-started mode's alone; the
    splits among them (random_split from a rank-seeded generator) are compared at the first
    exchange, and a split from a generator of its own stays quiet, training as without it."""
    runs = {}
    for own in ("0", "1"):
        for on in ("0", "1"):
            out, reports = tmp_path / f"out{own}{on}", tmp_path / f"reports{own}{on}"
            out.mkdir()
            env = {"RNGCHECK_ON_FINDING": "record", "RNGCHECK_REPORT": str(reports)}
            r = _torchrun(
                2, "split_before_init.py", str(out), RNGCHECK=on, SPLIT_GENERATOR=own, **env
            )
            assert r.returncode == 0, r.stderr[-3000:]
            runs[own, on] = [json.loads((out / f"result{i}.json").read_text()) for i in (0, 1)]
    assert runs["1", "1"] == runs["1", "0"]  # bitwise: the checker changed nothing
    # what the finding claims: split from the rank-seeded generator, one rank's held-out samples
    # are the other's to train on
    apart = runs["0", "0"]
    assert set(apart[0]["val"]) & set(apart[1]["seen"]) or set(apart[1]["val"]) & set(
        apart[0]["seen"]
    )
    for rank in (0, 1):
        quiet = Report.load(tmp_path / "reports11" / f"rank{rank}.json")
        assert quiet.ok
        # The split (drawn before the group was up, adopted at the first exchange) and the
        # sampler's two orders, by state; DDP's broadcast, its 2 parameters compared by digest,
        # and its dropout at the 4 steps; the two epochs' DataLoader seeds, from the default
        # generator seeded per rank.
        assert_compared(
            quiet.meta["rank_compared"],
            rank,
            by_state=3,
            initialisations_broadcast=2,
            replicated_parameters=2,
            not_compared={"own_batch": 4, "per_rank_seed": 2},
        )
        (f,) = Report.load(tmp_path / "reports01" / f"rank{rank}.json").findings
        assert f.op == "aten.randperm.generator" and f.site == _line(
            "split_before_init.py", "random_split("
        ), f
        assert f.cause.startswith("torch's random_split divides a dataset into parts"), f.cause


@pytest.mark.slow
def test_steps_before_init_process_group_leave_the_late_checker_at_the_step_level(
    tmp_path: Path,
) -> None:
    """RNGCHECK_LEVEL=step on a script that steps an optimizer of its own before it creates the
    process group: the mode is between samples when the rank checker starts, and the checker
    learns it at the next training step (no exchange at every step between samples)."""
    env = {"RNGCHECK_LEVEL": "step", "RNGCHECK_REPORT": str(tmp_path), "STEPS": "40"}
    r = _torchrun(2, "train_steps_before_init.py", RNGCHECK="1", **env)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        report = Report.load(tmp_path / f"rank{rank}.json")
        assert report.ok
        meta = report.meta
        assert meta["process_group"]["bound_after_step"] == 4
        # the DDP model's optimizer took over as the lead after 16 steps: 4 + 24 steps counted
        assert meta["level"]["steps"] >= 20 and meta["level"]["op_level"] == ["1-2"], meta
        # (26 when the new checker was left checking op by op: one exchange at every step)
        assert meta["rank_exchange"]["exchanges"] < 5, meta["rank_exchange"]
        # Nothing is compared op by op across the ranks, by design: the sampled steps (1-2) were
        # the warm-up's, before the process group existed; the DDP training is compared by the
        # step digests alone.
        compared = meta["rank_compared"]
        assert compared["by_state"] == compared["by_what_runs"] == 0, compared
        assert compared["not_compared"] == {}, compared


# What train_clean.py's ranks compare: the inputs of its 4 steps by state (the same seed on
# every rank), DDP's broadcast of the Block's 2 initialisations; the dropout of DDP's forward
# and of its checkpoint recompute in backward is each rank's own.
_TRAIN_CLEAN = {"by_state": 4, "initialisations_broadcast": 2, "not_compared": {"own_batch": 8}}


@pytest.mark.slow
def test_torchrun_two_ranks_clean_and_buggy(tmp_path: Path) -> None:
    from rngcheck.cli import main as cli_main

    clean, buggy = tmp_path / "clean", tmp_path / "buggy"
    out = {"RNGCHECK_REPORT": str(clean), "RNGCHECK_TRACE": str(clean)}
    r = _torchrun(2, "train_clean.py", RNGCHECK="1", **out)
    _skip_until_ranks_land(r)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("training finished") == 2
    reports = [Report.load(clean / f"rank{i}.json") for i in range(2)]
    assert all(rep.ok and rep.world_size == 2 for rep in reports)
    for rank, rep in enumerate(reports):
        assert_compared(rep.meta["rank_compared"], rank, **_TRAIN_CLEAN)
    assert reports[0].meta["run_id"] == reports[1].meta["run_id"]
    assert cli_main(["show", str(clean)]) == 0
    # Replicas draw the same random numbers: their traces are the same, op for op.
    traces = [str(clean / f"rank{i}.trace.jsonl") for i in range(2)]
    assert cli_main(["diff", *traces]) == 0

    # The recompute check off: its finding (in the first backward) would stop the run before the
    # first step settles the parameters' initialisations.
    out = {"RNGCHECK_REPORT": str(buggy), "RNGCHECK_TRACE": str(buggy), "RNGCHECK_RECOMPUTE": "0"}
    r = _torchrun(2, "train_buggy.py", RNGCHECK="1", **out)
    assert r.returncode != 0
    assert "training finished" not in r.stdout
    # Default settings (sync="step"): the first optimizer step settles the parameters'
    # initialisations (nothing broadcast them), and the finding is pinned to the first random op
    # the ranks drew differently, with the cause.
    assert r.stderr.count("RNG state diverged across ranks") == 1  # one merged rendering
    first_op = _line("train_buggy.py", "torch.nn.Linear(16, 16)")
    assert f"before aten.uniform_.default at {first_op}" in r.stderr
    seed = _line("train_buggy.py", "torch.manual_seed(1234 + rank)")
    assert f"rank 1 torch.manual_seed(1235) at {seed}" in r.stderr
    files = ["rank0.json", "rank0.trace.jsonl", "rank1.json", "rank1.trace.jsonl"]
    assert sorted(os.listdir(buggy)) == files  # both ranks saved, the killed one too
    saved = [json.loads((buggy / f).read_text()) for f in files[::2]]
    assert all(d["findings"] for d in saved)
    assert cli_main(["show", str(buggy)]) == 1
    # The two ranks' streams part at their very first op: the same op, another state before it.
    (divergence, _) = first_divergence(*(read_trace(buggy / f).ops() for f in files[1::2]))
    assert divergence is not None and (divergence.index, divergence.differs) == (0, "state before")


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _assert_two_ranks_checked(
    r: subprocess.CompletedProcess[str], reports: Path, **compared: Any
) -> None:
    """Two ranks checked, quiet, each saving a report; each rank compared what ``compared``
    says (_dist.assert_compared)."""
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("training finished") == 2, r.stdout[-2000:]
    assert "random op(s) checked on rank 0 of 2, no findings" in r.stderr, r.stderr[-3000:]
    assert sorted(os.listdir(reports)) == ["rank0.json", "rank1.json"]
    saved = [Report.load(reports / f"rank{i}.json") for i in range(2)]
    assert [(rep.rank, rep.world_size, rep.ok) for rep in saved] == [(0, 2, True), (1, 2, True)]
    assert saved[0].meta["run_id"] == saved[1].meta["run_id"]  # one run for `rngcheck show`
    assert all(rep.random_ops > 0 for rep in saved)
    for rep in saved:
        assert_compared(rep.meta.get("rank_compared"), rep.rank, **compared)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["accelerate", "deepspeed"])
def test_ranks_started_by_other_launchers_are_checked(tmp_path: Path, launcher: str) -> None:
    # `accelerate launch` and DeepSpeed's `deepspeed` are launchers, as torchrun is. Were the
    # launcher checked, its ranks (its children) would not be: a run with nothing checked, and
    # the launcher's empty report written over rank 0's at its exit.
    bindir = Path(sys.executable).parent
    script = str(SCRIPTS / "train_clean.py")
    port = str(_free_port())
    if launcher == "accelerate":
        args = [str(bindir / "accelerate"), "launch", "--multi_gpu", "--num_processes=2"]
        args += ["--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no"]
        args += [f"--main_process_port={port}", script]
        extra = {"ACCELERATE_USE_CPU": "1"}
    else:
        args = [str(bindir / "deepspeed"), "--num_accelerators=2", f"--master_port={port}", script]
        extra = {}
    r = _run(args, RNGCHECK="1", RNGCHECK_REPORT=str(tmp_path), **extra)
    _assert_two_ranks_checked(r, tmp_path, **_TRAIN_CLEAN)


def _lightning(out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """tests/scripts/train_lightning.py writing into ``out``: rank 0 as the user starts it
    (again after torch's abort at exit: _dist.EXIT_ABORT, also without rngcheck)."""
    out.mkdir()

    def launch() -> subprocess.CompletedProcess[str]:
        # Its own session: a timeout kills rank 1 too (rank 0's child, not ours).
        proc = subprocess.Popen(
            [PYTHON, str(SCRIPTS / "train_lightning.py"), str(out)],
            env=_env(**env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=out.parent,
            start_new_session=True,
        )
        try:
            stdout, stderr = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)

    return launch_past_exit_aborts(launch, 2, "train_lightning.py")


@pytest.mark.slow
def test_lightning_ranks_started_by_rank_0_are_checked_and_train_unchanged(tmp_path: Path):
    # Lightning's DDP starts rank 1 as a child of rank 0 (the process the user started), with
    # LOCAL_RANK but no RANK: it is another rank of the job, not a helper of rank 0's, and it
    # takes its rank's report file once the process group names it.
    from rngcheck.cli import main as cli_main

    # Its data: a LightningDataModule splitting a dataset in setup() with random_split from the
    # default generator, seeded alike on every rank (correct), and a validation loop.
    runs = {}
    for on in ("0", "1"):
        out = tmp_path / f"out{on}"
        reports = tmp_path / f"reports{on}"
        r = _lightning(out, RNGCHECK=on, RNGCHECK_REPORT=str(reports), SPLIT="default")
        if on == "1":
            # The split in setup() and each epoch's order, by state; GPT-2's dropout in DDP's
            # forward, each rank's own. (Its initialisations come before Lightning starts the
            # process group, so before any rank checker: they are compared by no one.)
            _assert_two_ranks_checked(r, reports, by_state=3, not_compared={"own_batch": 1})
        else:
            assert r.returncode == 0, r.stderr[-3000:]
        runs[on] = sorted(p.read_text() for p in out.iterdir())
    assert runs["1"] == runs["0"]  # bitwise: the checker changed nothing
    assert cli_main(["show", str(tmp_path / "reports1")]) == 0


def _lightning_seeded_per_rank(tmp_path: Path, **env: str) -> dict[int, list[Finding]]:
    """tests/scripts/train_lightning.py with seed_everything(rank), checked with its findings
    recorded: each rank's findings."""
    reports = tmp_path / "reports"
    r = _lightning(
        tmp_path / "out",
        RNGCHECK="1",
        RNGCHECK_ON_FINDING="record",
        RNGCHECK_REPORT=str(reports),
        SEED_PER_RANK="1",
        **env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return {rank: Report.load(reports / f"rank{rank}.json").findings for rank in (0, 1)}


@pytest.mark.slow
def test_lightning_seeded_per_rank_shuffles_apart_and_the_finding_says_where_the_seed_came_from(
    tmp_path: Path,
) -> None:
    # seed_everything(rank), for per-rank augmentation: Lightning gives its DistributedSampler
    # that seed (PL_GLOBAL_SEED), so each rank takes its share of a different shuffle.
    (f,) = _lightning_seeded_per_rank(tmp_path)[0]
    assert f.op == "aten.randperm.generator", f
    assert f.cause.startswith("torch's DistributedSampler splits one order"), f.cause
    assert "it is seeded differently on each rank (initial seed 0 on rank 0, 1 on rank 1)" in (
        f.cause
    )
    assert "PyTorch Lightning makes the sampler with the seed seed_everything was given" in (
        f.cause
    )


@pytest.mark.slow
def test_lightning_seeded_per_rank_splits_its_data_apart_in_setup(tmp_path: Path) -> None:
    # The same seed_everything(rank), with a LightningDataModule whose setup() splits the data
    # with random_split and no generator: each rank validates on samples another trains on.
    for (f,) in _lightning_seeded_per_rank(tmp_path, SPLIT="default").values():
        assert f.op == "aten.randperm.generator", f
        assert f.site.startswith("train_lightning.py:"), f.site
        assert "random_split(" in f.stack.user_frames[-1].line, f.stack.user_frames[-1]
        assert f.cause.startswith("torch's random_split divides a dataset into parts"), f.cause
        assert "initial seed 0 on rank 0, 1 on rank 1" in f.cause, f.cause


@pytest.mark.slow
def test_dataloader_workers_are_left_out_and_the_job_finishes(tmp_path: Path) -> None:
    # Forked workers inherit the running checker; left on, their augmentation ops would be
    # exchanged with the other ranks from the wrong process (sync="op": at once) and hang the job.
    r = _torchrun(
        2, "train_dataloader.py", RNGCHECK="1", RNGCHECK_SYNC="op", RNGCHECK_REPORT=str(tmp_path)
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("training finished") == 2
    reports = [Report.load(tmp_path / f"rank{i}.json") for i in range(2)]
    assert all(rep.ok for rep in reports)
    # Each rank checked its own random ops: the Linear's init, the loader's base seed per epoch
    # and dropout (2 epochs x 8 batches); the workers' torch.rand ran unchecked.
    expected = {"aten.uniform_.default": 2, "aten.random_.default": 2, "aten.bernoulli_.float": 16}
    assert [rep.ops_by_name for rep in reports] == [expected, expected]
    # The dropout (outside the model, over batches alike) and the loader's seeds, by state;
    # DDP's broadcast of the Linear's 2 initialisations.
    for rank, rep in enumerate(reports):
        compared = rep.meta["rank_compared"]
        assert_compared(compared, rank, by_state=18, initialisations_broadcast=2, not_compared={})


@pytest.mark.slow
def test_a_crash_still_leaves_the_report_and_says_how_the_run_ended(tmp_path: Path) -> None:
    from rngcheck.cli import main as cli_main

    crash = "import torch\ntorch.rand(3)\nraise KeyError('boom')\n"
    r = _run([PYTHON, "-c", crash], RNGCHECK="1", RNGCHECK_REPORT=str(tmp_path))
    assert r.returncode == 1
    assert "KeyError: 'boom'" in r.stderr and "Traceback" in r.stderr  # not ours: left as is
    report = Report.load(tmp_path / "rank0.json")
    assert report.ok and report.random_ops == 1
    assert report.meta["ended_by"] == "KeyError: 'boom'" and not report.completed
    assert cli_main(["show", str(tmp_path)]) == 0
    # The closing line says first that the run did not complete: not "no findings" alone.
    closing = (
        "rngcheck: the run did not complete (it ended by KeyError: 'boom'): 1 random op(s) "
        f"checked until then, no findings; reports: {tmp_path}"
    )
    assert closing in r.stderr, r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("skip_destroy", ["", "1"], ids=["at-destroy", "at-exit"])
def test_a_divergence_after_the_last_step_still_fails_the_job(tmp_path: Path, skip_destroy: str):
    # Only the final exchange sees it: in destroy_process_group, or at interpreter exit.
    r = _torchrun(
        2, "eval_buggy.py", RNGCHECK="1", RNGCHECK_REPORT=str(tmp_path), SKIP_DESTROY=skip_destroy
    )
    _skip_until_ranks_land(r)
    assert r.returncode != 0
    assert r.stdout.count("evaluation finished") == 2, r.stderr[-3000:]
    assert r.stderr.count("RNG state diverged across ranks") == 1
    assert "rank 1 ran an extra random op, aten.randint.low on default cpu at " in r.stderr
    assert _line("eval_buggy.py", "torch.randint(0, 10, (1,))") in r.stderr
    assert "rngcheck.core.findings.RankDivergenceError" not in r.stderr  # no traceback repeating it
    reports = [Report.load(tmp_path / f"rank{i}.json") for i in range(2)]
    assert all(rep.findings for rep in reports)
    ended = "destroy_process_group()" if not skip_destroy else "exit"
    assert reports[0].meta["ended_by"] == ended


@pytest.mark.slow
def test_a_group_made_by_init_device_mesh_is_bound_too(tmp_path: Path) -> None:
    r = _torchrun(2, "mesh_buggy.py", RNGCHECK="1", RNGCHECK_REPORT=str(tmp_path))
    _skip_until_ranks_land(r)
    assert r.returncode != 0 and r.stdout.count("done") == 2
    assert r.stderr.count("RNG state diverged across ranks") == 1
    dropout = _line("mesh_buggy.py", "dropout(x, 0.5)")
    assert f"before aten.bernoulli_.float at {dropout}" in r.stderr
    report = Report.load(tmp_path / "rank0.json")
    assert report.meta["process_group"]["world_size"] == 2
    assert report.meta["ended_by"] == "destroy_process_group()"  # the final exchange found it


# -- ranks a script starts itself --------------------------------------------------------------


def _spawned(out: Path, start: str, **env: str) -> subprocess.CompletedProcess[str]:
    """tests/scripts/train_spawned.py: the script starts its two ranks itself (``start``)."""
    out.mkdir()
    script = [PYTHON, str(SCRIPTS / "train_spawned.py")]
    return launch_past_exit_aborts(
        lambda: _run([*script, str(_free_port()), str(out)], START=start, **env),
        2,
        f"train_spawned.py {start}",
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("start", "reports_to", "launcher_draws"),
    [
        ("spawn", "reports", False),
        ("forkserver", "", False),
        ("process", "reports", True),
        ("elastic", "reports", False),
    ],
)
def test_ranks_a_script_starts_itself_are_checked_and_train_unchanged(
    tmp_path: Path, start: str, reports_to: str, launcher_draws: bool
) -> None:
    # PyTorch's DDP tutorial runs `python script.py`, and the script starts its ranks with
    # torch.multiprocessing.spawn (or multiprocessing.Process). Before, RNGCHECK=1 checked the
    # script's own process alone ("0 random op(s) checked, no findings") and no rank at all.
    from rngcheck.cli import main as cli_main

    env = {"RNGCHECK": "1"}
    reports = tmp_path / "reports"
    if reports_to:
        env["RNGCHECK_REPORT"] = str(reports)
    if launcher_draws:  # the launching process draws a random op of its own first
        env["LAUNCHER_DRAWS"] = "1"
    r = _spawned(tmp_path / "on", start, **env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("training finished") == 2
    assert r.stderr.count("rngcheck: checking random ops across ranks 0-1") == 1, r.stderr
    assert r.stderr.count("random op(s) checked on rank 0 of 2, no findings") == 1, r.stderr
    # The launching process saves no report over rank 0's; it says nothing at exit unless it
    # checked something itself, and then as what it is, a run of its own beside the ranks'.
    mine = "rngcheck: 1 random op(s) checked, no findings in the process that started the ranks"
    assert (mine in r.stderr) == launcher_draws, r.stderr[-3000:]
    assert ("random op(s) checked, no findings" in r.stderr) == launcher_draws, r.stderr
    launchers = ["launcher.json"] if launcher_draws else []
    if reports_to:
        assert sorted(os.listdir(reports)) == [*launchers, "rank0.json", "rank1.json"]
        saved = [Report.load(reports / f"rank{i}.json") for i in range(2)]
        assert [(rep.rank, rep.world_size, rep.ok) for rep in saved] == [
            (0, 2, True),
            (1, 2, True),
        ]
        assert saved[0].meta["run_id"] == saved[1].meta["run_id"]
        assert saved[0].meta["pid"] != saved[1].meta["pid"]
        # Every random op of the ranks: the two Linears' init (before DDP's broadcast), then
        # per step the input, dropout and the target.
        assert all(rep.random_ops == 4 + 4 * 3 for rep in saved), [rep.ops_by_name for rep in saved]
        for rep in saved:  # the inputs and targets by state; the init broadcast, dropout own
            assert_compared(
                rep.meta["rank_compared"],
                rep.rank,
                by_state=8,
                initialisations_broadcast=4,
                not_compared={"own_batch": 4},
            )
        if launcher_draws:
            launcher = Report.load(reports / "launcher.json")
            assert (launcher.world_size, launcher.random_ops) == (1, 1)
            assert launcher.meta["run_id"] == f"{saved[0].meta['run_id']}-launcher"
        assert cli_main(["show", str(reports)]) == 0  # (the launcher's, a run of its own, too)
    plain = _spawned(tmp_path / "off", start, RNGCHECK="0")
    assert plain.returncode == 0, plain.stderr[-3000:]
    for i in range(2):  # bitwise: the checker changed nothing
        name = f"result{i}.json"
        assert (tmp_path / "on" / name).read_text() == (tmp_path / "off" / name).read_text()


@pytest.mark.slow
@pytest.mark.parametrize("start", ["spawn", "forkserver"])
def test_a_rank_a_script_starts_itself_that_draws_extra_is_found(
    tmp_path: Path, start: str
) -> None:
    reports = tmp_path / "reports"
    r = _spawned(tmp_path / "out", start, BUG="1", RNGCHECK="1", RNGCHECK_REPORT=str(reports))
    assert r.returncode != 0
    assert "training finished" not in r.stdout
    extra = _line("train_spawned.py", "torch.rand(1)")
    # Drawn by one rank, and in the launching process's traceback from the one that raised
    # (torch.multiprocessing's join stops the other with SIGTERM).
    assert f"rank 0 ran an extra random op, aten.rand.default on default cpu at {extra}" in (
        r.stderr
    ), r.stderr[-3000:]
    # The rank that raised saved its report (a forkserver child leaves by os._exit, without
    # atexit); the other may have been stopped before it could, or killed while it wrote (its
    # temporary file stays: the report itself is written atomically, never half).
    names = {n for n in os.listdir(reports) if not n.endswith(".json.tmp")}
    assert names <= {"rank0.json", "rank1.json"}
    saved = [Report.load(reports / n) for n in names]
    assert any(f.site == extra for rep in saved for f in rep.findings), saved


@pytest.mark.slow
def test_a_rank_a_script_starts_itself_that_fails_ends_with_its_error_not_a_finding(
    tmp_path: Path,
) -> None:
    # torch.multiprocessing turns the error into SystemExit(1) and the rank leaves through
    # multiprocessing's exit function: a final exchange there would meet the other rank
    # mid-step and report a divergence that is only the crash. The other rank reports it
    # missing, with the error that ended it.
    reports = tmp_path / "reports"
    r = _spawned(tmp_path / "out", "spawn", CRASH="1", RNGCHECK="1", RNGCHECK_REPORT=str(reports))
    assert r.returncode != 0
    assert "diverged" not in r.stderr, r.stderr[-3000:]
    assert "rank 0 left the checked block early (ValueError: rank 0 fails)" in r.stderr, r.stderr
    failed = Report.load(reports / "rank0.json")
    assert (failed.ok, failed.meta["ended_by"]) == (True, "ValueError: rank 0 fails")
    other = Report.load(reports / "rank1.json")
    assert [f.kind.value for f in other.findings] == ["rank_missing"]


@pytest.mark.slow
def test_ranks_started_with_fork_are_named_as_unchecked(tmp_path: Path) -> None:
    # A forked rank inherits the launching process's checker, which switches itself off there
    # (as in a DataLoader worker): each such rank says so, rather than a silent pass.
    r = _spawned(tmp_path / "out", "fork", RNGCHECK="1")
    assert r.returncode == 0, r.stderr[-3000:]
    warning = "RNGCheckWarning: rngcheck does not check this rank: it was forked from a checked"
    assert r.stderr.count(warning) == 2, r.stderr[-3000:]


_ARMED = """
import os, sys, tempfile
from datetime import timedelta
from rngcheck.env.spawned import when_a_rank
calls = []
when_a_rank(lambda: calls.append(1))  # before torch.distributed is imported: the watcher
import torch.distributed as dist
from torch.distributed import init_process_group  # a copy by name, as scripts hold one
store = tempfile.mktemp()
for i in range(2):  # init, destroy, init: one start
    init_process_group("gloo", init_method=f"file://{store}{i}", rank=0, world_size=1,
                       timeout=timedelta(seconds=30))
    dist.destroy_process_group()
ours = [f.__code__.co_filename.endswith("spawned.py")
        for f in (dist.init_process_group, init_process_group)]
print(len(calls), *ours)
"""


def test_a_rank_to_be_starts_checking_at_its_first_process_group_only() -> None:
    r = _run([PYTHON, "-c", _ARMED])
    assert r.returncode == 0, r.stderr[-3000:]
    # Called once, though the copy imported by name still holds the wrapper; torch.distributed
    # holds the original again.
    assert r.stdout.split() == ["1", "False", "True"], r.stdout


@pytest.mark.slow
def test_ranks_of_a_launcher_rngcheck_does_not_know_make_one_run(tmp_path: Path) -> None:
    # srun starts every rank itself, with Slurm's variables only (no RANK, no run id rngcheck
    # reads): each rank names its run as rank 0 does once the group is up, so that `rngcheck
    # show` reads one run of two ranks, not two runs each missing a rank.
    from rngcheck.cli import main as cli_main

    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = _env(RNGCHECK="1", RNGCHECK_REPORT=str(tmp_path), MASTER_ADDR="127.0.0.1")
        env.update(MASTER_PORT=port, SLURM_JOB_ID="4242", SLURM_PROCID=str(rank))
        env.update(SLURM_NTASKS="2")
        script = [PYTHON, str(SCRIPTS / "train_clean.py")]
        procs.append(subprocess.Popen(script, env=env, cwd=ROOT, text=True, **_PIPES))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=TIMEOUT))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    # The start lines are rank 0's (the first task's at start-up, the ranks' at bind), none from
    # the other tasks.
    assert [err.count("rngcheck: checking") for _, err in outs] == [2, 0], outs
    saved = [Report.load(tmp_path / f"rank{i}.json") for i in range(2)]
    assert [(rep.rank, rep.world_size) for rep in saved] == [(0, 2), (1, 2)]
    assert saved[0].meta["run_id"] == saved[1].meta["run_id"]
    assert cli_main(["show", str(tmp_path)]) == 0
