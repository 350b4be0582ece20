"""torch_xla support, on a real torch_xla running on the CPU (PJRT_DEVICE=CPU). Nothing is mocked.

These run in the XLA lane of .ci/run (scripts/xla_lane.sh: torch==2.9.0 + torch-xla==2.9.0 in
.venv-xla); in the main lane torch_xla is not installed and the whole module skips.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
torch_xla = pytest.importorskip("torch_xla")

import torch  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.utils.checkpoint as xla_checkpoint  # noqa: E402
from _dist import assert_compared, compared  # noqa: E402
from torch_xla.distributed.fsdp import checkpoint_module  # noqa: E402

import rngcheck  # noqa: E402
from rngcheck import FindingKind, Phase  # noqa: E402

pytestmark = pytest.mark.xla

_REPO = Path(__file__).resolve().parent.parent
_EXAMPLE = _REPO / "examples" / "xla_checkpoint_dropout.py"


def _load_example() -> Any:
    spec = importlib.util.spec_from_file_location("xla_checkpoint_dropout", _EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _load_example()


@pytest.fixture
def device() -> torch.device:
    d = torch_xla.device()
    xm.set_rng_state(0, d)
    return d


def _dropout_block(device: torch.device) -> tuple[torch.nn.Module, Any]:
    layer = torch.nn.Linear(32, 32).to(device)

    def block(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(layer(x), p=0.5)  # dropout line

    return layer, block


# -- the torch_xla report (pytorch/xla PR 4690) -------------------------------------------------


def test_report_scenario_detected():
    """checkpoint_module + Dropout with the XLA seed not restored: the masks differ, rngcheck says
    so, at the dropout op, on the user's line, naming the XLA seed."""
    report, same_output = example.run(fixed=False)
    assert not same_output  # the report's own symptom, reproduced
    assert len(report.findings) == 1
    finding = report.findings[0]
    assert finding.kind is FindingKind.RECOMPUTE_MISMATCH
    assert finding.op.startswith("aten.bernoulli")
    assert finding.differs == "state"
    assert "torch_xla checkpoint" in finding.region
    site = finding.stack.call_site
    assert site is not None and Path(site.filename).name == _EXAMPLE.name
    assert site.line == "output = self.dropout(x)  # the line a finding points at"
    forward, recompute = finding.sides
    assert forward.event is not None and recompute.event is not None
    assert forward.event.generator.label == "default xla:0"
    assert recompute.event.phase is Phase.RECOMPUTE
    assert forward.event.before != recompute.event.before
    assert "the XLA seed of default xla:0 was not restored before the recompute" in finding.cause
    assert "pytorch/xla PR 4690" in finding.cause


def test_fixed_checkpoint_quiet():
    report, same_output = example.run(fixed=True)
    assert same_output
    assert report.ok, rngcheck.format_report(report)
    assert report.ops_by_generator == {"default xla:0": 2}  # forward and recompute, both seen


def test_example_script_exit_codes():
    """The example runs as the report's script did and prints the report's line."""
    env = dict(os.environ, PJRT_DEVICE="CPU")
    for args, same in (([], "False"), (["--fixed"], "True")):
        done = subprocess.run(
            [sys.executable, str(_EXAMPLE), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"xla 1 same_output {same}" in done.stdout


# -- torch_xla.utils.checkpoint.checkpoint ------------------------------------------------------


def test_preserve_rng_state_false_detected(device):
    _, block = _dropout_block(device)
    x = torch.randn(8, 32, device=device, requires_grad=True)
    with pytest.raises(rngcheck.RecomputeMismatchError) as info:  # noqa: SIM117
        with rngcheck.RNGConsistencyMode(console=_quiet_console()):
            out = xla_checkpoint.checkpoint(block, x, preserve_rng_state=False)
            out.sum().backward()
    finding = info.value.finding
    assert finding.op.startswith("aten.bernoulli")
    assert finding.differs == "state"
    assert "preserve_rng_state=False" in finding.cause
    assert "XLA seed of default xla:0" in finding.cause
    site = finding.stack.call_site
    assert site is not None and site.line.endswith("# dropout line")


def test_outputs_on_the_device_are_compared_at_the_recompute_end_first_difference_first(device):
    """An XLA output's digest stays on the device until the recompute ends (one fetch for the
    region, not a sync per op). The first difference is still the one reported: op 0's output
    (a global it reads changed before backward), not op 1's arguments, found while the recompute
    ran."""
    keep = torch.full((4, 16), 0.7, device=device)
    size = [16]

    def block(x):
        a = x * torch.bernoulli(keep)  # <- reads a global
        return a * torch.rand(size, device=device).sum()

    x = torch.randn(4, 16, device=device, requires_grad=True)
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        out = xla_checkpoint.checkpoint(block, x)
        keep.fill_(0.2)
        size[0] = 8
        out.sum().backward()
        xm.mark_step()
    [finding] = mode.report.findings
    assert finding.op == "aten.bernoulli.default" and finding.differs == "output", finding.message
    recomputed = [e for e in mode.events if e.phase is Phase.RECOMPUTE]
    assert [e.op for e in recomputed] == ["aten.bernoulli.default", "aten.rand.default"]


def test_checkpoint_restoring_quiet_across_steps(device):
    """torch_xla's checkpoint restores the seed: quiet, step after step, with syncs between."""
    layer, block = _dropout_block(device)
    with rngcheck.RNGConsistencyMode() as mode:
        for _ in range(3):
            x = torch.randn(8, 32, device=device, requires_grad=True)
            xla_checkpoint.checkpoint(block, x).sum().backward()
            xm.mark_step()
    assert mode.report.ok
    phases = [e.phase for e in mode.events if e.op.startswith("aten.bernoulli")]
    assert phases == [Phase.FORWARD, Phase.RECOMPUTE] * 3
    restored = [e for e in mode.events if e.phase is Phase.RECOMPUTE]
    # The checkpoint's own xm.set_rng_state is torch_xla's doing, not a line of the user's.
    for e in restored:
        assert e.out_of_band is not None
        assert [c.api for c in e.out_of_band.calls][-1] == "torch_xla.core.xla_model.set_rng_state"
        assert not e.out_of_band.user_calls
    del layer


def test_checkpoint_module_keeps_weights_in_barrier(device):
    """The shim keeps checkpoint_module's bound method, so torch_xla still puts the module's
    weights into the recompute's optimization barrier; gradients match an unchecked run."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()).to(device)
    checkpoint_module(model)
    x = torch.randn(4, 16).to(device).requires_grad_()
    model(x).sum().backward()
    expected = model[0].weight.grad.cpu()
    model.zero_grad()
    with rngcheck.RNGConsistencyMode() as mode:
        model(x).sum().backward()
    assert torch.allclose(model[0].weight.grad.cpu(), expected)
    assert mode.report.ok


# -- the XLA seed as a generator ------------------------------------------------------------------


def test_random_op_without_checkpoint_quiet(device):
    """Dropout and factories across syncs: the seed reset at each sync is attributed, not found."""
    x = torch.ones(16, 16, device=device)
    with rngcheck.RNGConsistencyMode() as mode:
        for _ in range(2):
            torch.nn.functional.dropout(x, 0.5)
            torch.rand(4, device="xla")  # no index: the same generator, "default xla:0"
            xm.mark_step()
        with torch_xla.step():
            torch.randn(4, device=device)
        torch.rand(2, device=device)
    report = mode.report
    assert report.ok and not report.notes, rngcheck.format_report(report)
    assert set(report.ops_by_generator) == {"default xla:0"}
    after_sync = [e for e in mode.events if e.out_of_band is not None]
    assert len(after_sync) == 3  # the first op after each of the three syncs
    apis = [[c.api for c in e.out_of_band.calls] for e in after_sync]
    mark_step, sync = "torch_xla.core.xla_model.mark_step", "torch_xla.torch_xla.sync"
    assert apis == [[mark_step], [mark_step, sync], [sync]]  # torch_xla.step() syncs on both ends
    assert not any(e.out_of_band.user_calls for e in after_sync)  # explained, not blamed


def test_event_digest_is_the_seed_digest(device):
    from rngcheck.core.xla import seed_digest

    x = torch.ones(8, device=device)
    with rngcheck.RNGConsistencyMode() as mode:
        seed = xm.get_rng_state(device)
        torch.nn.functional.dropout(x, 0.5)
    (event,) = mode.events
    assert event.generator.label == "default xla:0"
    assert event.before == seed_digest(seed)
    assert event.after == seed_digest(xm.get_rng_state(device)) != event.before


def test_set_rng_state_attributed_to_user_line(device):
    x = torch.ones(8, device=device)
    with rngcheck.RNGConsistencyMode() as mode:
        torch.nn.functional.dropout(x, 0.5)
        xm.set_rng_state(7, device)  # reseed line
        torch.nn.functional.dropout(x, 0.5)
    second = mode.events[-1]
    assert second.out_of_band is not None
    (call,) = second.out_of_band.user_calls
    assert call.api == "torch_xla.core.xla_model.set_rng_state"
    assert call.argument == "7, device=xla:0"
    site = call.stack.call_site
    assert site is not None and site.line.endswith("# reseed line")


def test_mode_restores_torch_xla_on_exit(device):
    checkpoint_function = xla_checkpoint.CheckpointFunction
    set_rng_state, sync = xm.set_rng_state, torch_xla.sync
    with pytest.raises(ValueError), rngcheck.RNGConsistencyMode():
        assert xla_checkpoint.CheckpointFunction is not checkpoint_function
        assert xm.set_rng_state is not set_rng_state
        raise ValueError("user error inside the block")
    assert xla_checkpoint.CheckpointFunction is checkpoint_function
    assert xm.set_rng_state is set_rng_state and torch_xla.sync is sync


def test_torch_xla_imported_after_the_mode_started():
    """RNGCHECK=1 starts the mode before the script imports torch_xla: the support loads at the
    first XLA random op, with the seeding APIs and the checkpoint from then on."""
    code = (
        "import torch, rngcheck\n"
        "with rngcheck.RNGConsistencyMode(on_finding='record') as mode:\n"
        "    import torch_xla, torch_xla.core.xla_model as xm\n"
        "    import torch_xla.utils.checkpoint as xc\n"
        "    d = torch_xla.device()\n"
        "    x = torch.ones(8, 8, device=d, requires_grad=True)\n"
        "    torch.nn.functional.dropout(x, 0.5)\n"
        "    xm.set_rng_state(3, d)\n"
        "    f = lambda t: torch.nn.functional.dropout(t * 2, 0.5)\n"
        "    xc.checkpoint(f, x, preserve_rng_state=False).sum().backward()\n"
        "calls = [c.api for c in mode.events[1].out_of_band.user_calls]\n"
        "print(mode.report.ops_by_generator, [f.kind.value for f in mode.report.findings], calls)\n"
    )
    env = dict(os.environ, PJRT_DEVICE="CPU")
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == (
        "{'default xla:0': 3} ['recompute_mismatch'] ['torch_xla.core.xla_model.set_rng_state']"
    )


def test_mode_never_imports_torch_xla():
    """With torch_xla installed but not imported, a mode must not import it (nor start XLA)."""
    code = (
        "import sys, torch, rngcheck\n"
        "with rngcheck.RNGConsistencyMode():\n"
        "    torch.rand(3)\n"
        "assert 'torch_xla' not in sys.modules, 'rngcheck imported torch_xla'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=_REPO
    )
    assert done.returncode == 0, done.stderr


# -- several torch_xla processes, XLA seeds compared over a side gloo group ------------------------
# Each process has its own XLA CPU device (they form no XLA collective group); tests/_dist.py puts
# a gloo group beside them, which the rank checker uses. Scenarios run in every rank.


def _xla_ranks_mode() -> Any:
    return rngcheck.RNGConsistencyMode(on_finding="record", timeout=30.0, console=_quiet_console())


def _ranks_summary(mode: Any) -> dict[str, Any]:
    report = mode.report
    return {
        "ok": report.ok,
        "ops_by_generator": report.ops_by_generator,
        "compared": compared(report),
        "findings": [
            {
                "kind": f.kind.value,
                "ranks": list(f.ranks),
                "op": f.op,
                "site": f.site,
                "cause": f.cause,
                "generators": sorted({s.event.generator.label for s in f.sides if s.event}),
            }
            for f in report.findings
        ],
    }


def _xla_training(rank: int, *, rank_seed: bool) -> tuple[dict[str, Any], int]:
    device = torch_xla.device()
    xm.set_rng_state(0, device)
    layer = torch.nn.Linear(16, 16).to(device)
    x = torch.ones(8, 16, device=device)
    line = 0
    with _xla_ranks_mode() as mode:
        for step in range(3):
            if rank_seed and step == 1:
                xm.set_rng_state(1000 + rank, device)  # the bug: an XLA seed that depends on rank
                line = sys._getframe().f_lineno + 1
            torch.nn.functional.dropout(layer(x), 0.5).sum().backward()
            xm.mark_step()  # every step resets the seed the same way on every rank: no finding
    return _ranks_summary(mode), line


def xla_ranks_same_seed(rank: int, world: int) -> dict[str, Any]:
    return _xla_training(rank, rank_seed=False)[0]


def xla_ranks_seed_differs(rank: int, world: int) -> dict[str, Any]:
    summary, line = _xla_training(rank, rank_seed=True)
    return {**summary, "line": line}


@pytest.fixture(scope="module")
def xla_ranks(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from _dist import run_scenarios

    names = ["xla_ranks_same_seed", "xla_ranks_seed_differs"]
    env = {"PJRT_DEVICE": "CPU"}
    return run_scenarios(
        __file__, names, world_size=2, out_dir=tmp_path_factory.mktemp("xla"), env=env
    )


@pytest.mark.distributed
def test_ranks_with_equal_xla_seeds_quiet(xla_ranks: Any) -> None:
    for rank, r in xla_ranks["xla_ranks_same_seed"].items():
        assert "error" not in r, r.get("traceback")
        assert r["ok"], (rank, r["findings"])
        assert r["ops_by_generator"] == {"default xla:0": 3}
        # The dropout of the 3 steps, compared by state: the XLA seeds agree.
        assert_compared(r["compared"], rank, by_state=3, not_compared={})


@pytest.mark.distributed
def test_ranks_whose_xla_seeds_differ_detected(xla_ranks: Any) -> None:
    for rank, r in xla_ranks["xla_ranks_seed_differs"].items():
        assert "error" not in r, r.get("traceback")
        assert len(r["findings"]) == 1, (rank, r["findings"])
        (finding,) = r["findings"]
        assert finding["kind"] == "rank_divergence"
        assert finding["ranks"] == [0, 1]
        assert finding["op"].startswith("aten.bernoulli")
        assert finding["generators"] == ["default xla:0"]
        assert finding["site"] == f"test_xla.py:{r['line']}"
        assert "torch_xla.core.xla_model.set_rng_state(1001" in finding["cause"], finding["cause"]
        assert "mark_step" not in finding["cause"]  # the syncs reset every rank alike


def _quiet_console() -> Any:
    import io

    from rich.console import Console

    return Console(file=io.StringIO())
