"""Smoke tests: the benchmark suite runs end to end in its quick configuration and prints its
tables. Timings are the benchmark's business, never asserted here (the machine is shared)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _run(*args: str) -> str:
    proc = _bench(*args)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """One quick run of every one-process section (the two-rank one has tests of its own): its
    markdown and its JSON file, shared by the tests of what each section prints."""
    path = tmp_path_factory.mktemp("bench") / "r.json"
    out = _run("--skip", "ranks", "--json", str(path))
    return out, json.loads(path.read_text())


@pytest.mark.slow
def test_single_process_and_memory_tables(quick_run):
    out, raw = quick_run
    for label in (
        "plain training",
        "no-op TorchDispatchMode (floor)",
        "rngcheck, defaults",
        'rngcheck, route="dispatch_mode" (op level)',
        'rngcheck, sync="op"',
        'rngcheck, level="step" (between samples)',
        "DebugMode + log_tensor_hashes()",
        "checkpoint(debug=True)",
        "compiled step",
        "compiled step under rngcheck, defaults",
    ):
        assert f"| {label} |" in out
    assert "compiled step under rngcheck / compiled step" in out
    assert "d=8: rngcheck defaults (op level) / plain" in out  # (the op level's goal)
    assert 'd=8: rngcheck route="dispatch_mode" / no-op mode' in out
    assert 'd=8: level="step", 1 step in 100 op by op / plain' in out
    assert "| random ops seen | events kept |" in out
    assert "### GPT-2 small's size on a CUDA GPU" in out  # (timed, or skipped in one line)
    assert "### timm ViT, tiny config" in out  # (timed, or skipped in one line)

    assert [len(block) for block in raw["single"]["8"]["rngcheck"]["samples"]] == [2, 2]
    # The window (16 events in the quick run) bounds what the checker keeps.
    assert [s["events_kept"] for s in raw["memory"]["defaults"]][1:] == [16, 16, 16]
    # level="step" keeps only the events of its first two steps (8 dropout draws each).
    assert 'steps at level="step", between samples' in out
    assert [s["events_kept"] for s in raw["memory"]["step_level"]][1:] == [16, 16, 16]


@pytest.mark.slow
def test_a_hugging_face_gpt2_table_and_its_budgets(quick_run):
    """GPT-2 from a tiny config, when transformers is installed (the main lane installs it)."""
    pytest.importorskip("transformers")
    out, raw = quick_run
    assert "| GPT-2 ms | GPT-2 / plain | GPT-2 / plain (CPU) |" in out
    assert 'GPT-2 (tiny config): level="step" between samples / plain' in out
    assert "GPT-2 (tiny config): rngcheck defaults (op level) / plain" in out  # (the goal)
    assert set(raw["gpt2"]) == {"plain", "noop", "rngcheck", "rngcheck-dispatch", "rngcheck-step"}


@pytest.mark.slow
def test_a_timm_vit_table_and_its_budgets(quick_run):
    """A timm ViT from a tiny config (stochastic depth, dropout, gradient checkpointing), when
    timm imports (no lane installs it: benchmarks/vit.py says why)."""
    pytest.importorskip("timm")
    out, raw = quick_run
    assert "| ViT ms | ViT / plain | ViT / plain (CPU) |" in out
    for label in (
        "plain training",
        "rngcheck, defaults",
        'rngcheck, level="step" (between samples)',
    ):
        assert f"| {label} |" in out
    assert 'timm ViT (tiny config): level="step" between samples / plain' in out
    assert 'timm ViT (tiny config): level="step", 1 step in 100 op by op / plain' in out
    assert "timm ViT (tiny config): rngcheck defaults (op level) / plain" in out  # (the goal)
    assert set(raw["vit"]) == {"plain", "noop", "rngcheck", "rngcheck-dispatch", "rngcheck-step"}


def test_the_vit_section_says_in_one_line_why_it_was_skipped():
    """Without timm (or with one whose torchvision does not import beside this torch) the ViT
    section times nothing and says why in one line."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import vit

    missing = vit.timm_missing()
    if missing is None:
        pytest.skip("timm imports here: the section times its ViT")
    text, raw = vit.section(True)
    assert (text.splitlines()[-1], raw) == (f"Skipped: {missing}.", {})
    assert missing == "timm is not installed" or missing.startswith("timm does not import (")


@pytest.mark.slow
@pytest.mark.distributed
def test_two_rank_timing_and_exchange_tables():
    out = _run("--skip", "single,memory")
    assert "| mode (2 ranks, DDP over gloo) |" in out
    assert "| rngcheck, defaults |" in out
    assert '| rngcheck, level="step" (between samples) |' in out
    assert '2 ranks, d=8: level="step" between samples / plain' in out
    assert '| 2 | sync="step" |' in out
    assert '| 2 | sync="op" |' in out


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_also_time_a_hugging_face_gpt2():
    """--sizes gpt2: the two-rank section times GPT-2 from a tiny config under DDP (the step
    level's budget names it), and the one-process section keeps its own widths."""
    pytest.importorskip("transformers")
    out = _run(
        "--skip", "compiled,gpt2,memory", "--modes", "plain,rngcheck-step", "--sizes", "8,gpt2"
    )
    lines = out.splitlines()
    assert "| mode | d=8 ms | d=8 / plain | d=8 / plain (CPU) |" in lines  # (widths only)
    assert (
        "| mode (2 ranks, DDP over gloo) | d=8 ms | d=8 / plain | d=8 / plain (CPU) "
        "| GPT-2 ms | GPT-2 / plain | GPT-2 / plain (CPU) |"
    ) in lines
    assert '2 ranks, GPT-2 (tiny config): level="step" between samples / plain' in out


def test_the_two_rank_report_orders_its_models_and_says_what_was_skipped():
    """The two-rank section's tables from a result (no ranks started): widths in order, then
    GPT-2; a run whose one model was skipped says so instead of drawing an empty table."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import distributed

    samples = {c: {"plain": [[1.0, 1.0]], "rngcheck-step": [[1.02, 1.02]]} for c in ("wall", "cpu")}
    timed = {"gpt2": samples, "32": samples, "8": samples}  # (keys as JSON gives them back)
    result = {"note": "", "skipped": "", "timing": timed, "exchange": {2: None}, "exchange_d": 8}
    assert list(distributed._timings(result)) == [8, 32, "GPT-2"]
    text = distributed.report(result, 1, 2)
    assert "| d=8 ms | d=8 / plain | d=8 / plain (CPU) | d=32 ms |" in text
    budgets = [b.what for b in distributed.budgets(result) if "between samples" in b.what]
    assert [b.split(":")[0] for b in budgets] == [
        "2 ranks, d=8",
        "2 ranks, d=32",
        "2 ranks, GPT-2 (tiny config)",
    ]
    assert "(MLP, d=8)" in text
    skipped = "Skipped: GPT-2 (tiny config): transformers is not installed."
    text = distributed.report({**result, "timing": {}, "skipped": skipped}, 1, 2)
    assert skipped in text and "| mode (2 ranks" not in text


def test_the_gpu_section_says_in_one_line_what_it_needs_without_cuda():
    """The GPU rows (scripts/gpu_check.sh runs them) need a CUDA device: without one the section
    times nothing and says why, in the line the script's summary shows."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import gpu

    missing = gpu.cuda_missing()
    if missing is None:
        pytest.skip("a CUDA device is here: the section times it (scripts/gpu_check.sh)")
    text, raw = gpu.section(True)
    assert (text.splitlines()[-1], raw) == (f"Skipped: needs a CUDA device; {missing}.", {})
    assert missing.startswith("torch ")
    assert "built without CUDA" in missing or "sees no CUDA device" in missing


def test_the_bootstrap_reads_a_json_file_and_refuses_one_without_its_modes(tmp_path, capsys):
    sys.path.insert(0, str(ROOT))
    from benchmarks import bootstrap

    # 40 rounds: the step level 2% over plain, the op level 2x, so 1 in 100 is 1.03x
    rounds = {"plain": [[1.0]] * 40, "rngcheck-step": [[1.02]] * 40, "rngcheck": [[2.0]] * 40}
    samples = {c: dict(rounds) for c in ("wall", "cpu")}
    r = bootstrap.interval(samples, "cpu")
    assert (r["rounds"], r["low"], r["high"]) == (40, r["amortised"], r["amortised"])
    assert r["amortised"] == pytest.approx((99 * 1.02 + 2.0) / 100)
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"ranks": {"timing": {"gpt2": samples}}}))
    assert bootstrap.main([str(path)]) == 0
    assert (
        "| GPT-2 | cpu | 40 | 1.020x | 2.00x | 1.030x [1.030, 1.030] |" in capsys.readouterr().out
    )
    del samples["wall"]["rngcheck"]
    path.write_text(json.dumps({"ranks": {"timing": {"8": samples}}}))
    assert bootstrap.main([str(path)]) == 2
    assert "with --modes plain,rngcheck,rngcheck-step" in capsys.readouterr().err


def test_two_rank_blocks_count_the_rounds_a_median_would_leave_out(tmp_path, capsys):
    """Two ranks sum each block up by its mean: the step level's round of exchange falls on 2
    steps in 32, and a block's median would drop exactly those. The report, the budget rows and
    the bootstrap (reading the run's choice from its JSON file) all count them."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import bootstrap, distributed
    from benchmarks.common import Timings, block_value

    # A block of 4 steps: the step level's are 1.0 except one at 1.4 (a round's post), so its
    # median is 1.0 and its mean 1.1.
    rounds = {"plain": [[1.0] * 4] * 20, "rngcheck-step": [[1.0, 1.4, 1.0, 1.0]] * 20}
    rounds["rngcheck"] = [[2.0] * 4] * 20
    samples = {c: dict(rounds) for c in ("wall", "cpu")}
    assert Timings(samples).ratio("rngcheck-step", "plain") == 1.0
    assert Timings(samples, "mean").ratio("rngcheck-step", "plain") == pytest.approx(1.1)
    assert Timings(samples, "mean").median("rngcheck-step") == pytest.approx(1.1)
    with pytest.raises(ValueError, match='"median" or "mean"'):
        block_value([1.0], "max")

    result = {
        "note": "",
        "skipped": "",
        "timing": {"8": samples},
        "per_block": distributed.PER_BLOCK,
        "exchange": {2: None},
        "exchange_d": 8,
    }
    assert "x 4 steps per mode, the mean of each block)" in distributed.report(result, 20, 4)
    between = next(b for b in distributed.budgets(result) if "between samples" in b.what)
    assert between.measured["cpu"] == pytest.approx(1.1)
    assert between.verdict == "NOT met"

    path = tmp_path / "r.json"
    path.write_text(json.dumps({"ranks": result}))
    assert bootstrap.main([str(path)]) == 0
    amortised = (99 * 1.1 + 2.0) / 100
    assert f"| d=8 | cpu | 20 | 1.100x | 2.00x | {amortised:.3f}x" in capsys.readouterr().out
    assert bootstrap.main([str(path), "--per-block", "median"]) == 0  # (what the mean changes)
    assert "| d=8 | cpu | 20 | 1.000x | 2.00x | 1.010x" in capsys.readouterr().out
    path.write_text(json.dumps({"results": result}))  # python -m benchmarks.distributed's file
    assert bootstrap.main([str(path)]) == 0
    assert "| d=8 | cpu | 20 | 1.100x |" in capsys.readouterr().out


def test_a_two_rank_block_holds_the_post_and_the_settle_of_a_round():
    """The step level posts a round's digests at its STEPS_PER_ROUND-th step and settles them at
    the next: the timed block after the mode's warmup holds both (steps counted from 1 as the
    mode enters; the block times steps warmup + 1 to warmup + TIMED_STEPS)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import distributed
    from benchmarks.common import MODES
    from rngcheck.ranks.step_digest import STEPS_PER_ROUND

    warmup = max(1, MODES["rngcheck-step"].warmup)  # (interleave's default warmup is 1)
    first, last = warmup + 1, warmup + distributed.TIMED_STEPS
    assert first <= STEPS_PER_ROUND and last >= STEPS_PER_ROUND + 1


@pytest.mark.slow
def test_one_question_with_more_rounds(tmp_path):
    """--modes, --sizes and --rounds narrow the timing sections to one comparison (what a noisy
    machine needs many rounds of); the budgets that lack a mode are left out, not faked."""
    out = _run(
        "--skip",
        "ranks,compiled,memory,gpt2,vit",
        "--modes",
        "plain,rngcheck,rngcheck-step",
        "--sizes",
        "8,16",
        "--rounds",
        "3",
        "--json",
        str(tmp_path / "r.json"),
    )
    assert "### One process (3 interleaved rounds x 2 steps per mode)" in out
    for label in (
        "plain training",
        "rngcheck, defaults",
        'rngcheck, level="step" (between samples)',
    ):
        assert f"| {label} |" in out
    assert "no-op TorchDispatchMode" not in out and "DebugMode" not in out
    # Ratios to plain training (the no-op mode was not timed), in one column per clock.
    assert (
        "| d=8 ms | d=8 / plain | d=8 / plain (CPU) | d=16 ms | d=16 / plain | d=16 / plain (CPU) |"
        in out
    )
    assert 'd=16: level="step", 1 step in 100 op by op / plain' in out
    assert 'route="dispatch_mode" / no-op mode' not in out  # (no no-op mode timed)
    raw = json.loads((tmp_path / "r.json").read_text())
    assert set(raw["single"]) == {"8", "16"}
    assert set(raw["single"]["16"]) == {"plain", "rngcheck", "rngcheck-step"}
    assert [len(block) for block in raw["single"]["16"]["rngcheck"]["samples"]] == [2, 2, 2]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--modes", "rngcheck"], "include plain"),
        (["--modes", "plain,fast"], "unknown mode 'fast'; expected some of: plain, noop"),
        (["--rounds", "0"], "expected a whole number of at least 1, got '0'"),
        (["--sizes", "32,x"], "expected a whole number of at least 1 (a width d) or gpt2, got 'x'"),
    ],
)
def test_a_bad_focus_is_refused_before_anything_runs(args, expected):
    proc = _bench(*args)
    assert proc.returncode == 2
    assert expected in proc.stderr
    assert "Machine:" not in proc.stdout
