"""What the recompute check patches is restored on every exit, and on_finding="raise" raises a
RecomputeMismatchError out of .backward()."""

from __future__ import annotations

import inspect
import io
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from _recompute_util import marked_line
from rich.console import Console
from torch import nn
from torch.utils.checkpoint import checkpoint

import rngcheck
from rngcheck.recompute import torch_hooks

# torch < 2.10's non-reentrant checkpoint() does not throw a forward's exception into its
# generator (pytorch PR 184018), so torch's own saved-tensor hooks, and the region with them,
# stay open while the exception's traceback lives: nothing rngcheck can close from outside.
_THROWS_INTO_GENERATOR = "gen.throw" in inspect.getsource(tuc)
needs_forward_exception_handling = pytest.mark.skipif(
    not _THROWS_INTO_GENERATOR,
    reason="this torch leaves a failed non-reentrant checkpoint forward open (pytorch PR 184018)",
)

REENTRANT = pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
COMPOSABLE = torch_hooks.COMPOSABLE
ENTRY = torch_hooks.HOOKS.nonreentrant  # the name torch calls per region, on this torch
ORIGINAL_GENERATOR = getattr(tuc, ENTRY)
ORIGINAL_FUNCTION = tuc.CheckpointFunction
ORIGINAL_MODES = (nn.Module.train, nn.Module.eval)  # (watched for switches between passes)


def _assert_torch_untouched() -> None:
    assert getattr(tuc, ENTRY) is ORIGINAL_GENERATOR
    assert tuc.CheckpointFunction is ORIGINAL_FUNCTION
    assert (nn.Module.train, nn.Module.eval) == ORIGINAL_MODES
    composable = sys.modules.get(COMPOSABLE)
    if composable is not None:
        assert getattr(composable, ENTRY) is ORIGINAL_GENERATOR
    assert rngcheck.active_mode() is None


def _quiet_console() -> Console:
    return Console(file=io.StringIO(), width=120)


def test_patches_are_in_place_inside_and_gone_after():
    with rngcheck.RNGConsistencyMode():
        assert getattr(tuc, ENTRY) is not ORIGINAL_GENERATOR
        assert tuc.CheckpointFunction is not ORIGINAL_FUNCTION
        assert nn.Module.train is not ORIGINAL_MODES[0]
    _assert_torch_untouched()


def test_check_recompute_false_patches_nothing():
    gen = torch.Generator().manual_seed(0)

    def block(x):
        return x * torch.rand(x.shape, generator=gen)

    with rngcheck.RNGConsistencyMode(check_recompute=False, on_finding="record") as mode:
        assert getattr(tuc, ENTRY) is ORIGINAL_GENERATOR
        assert tuc.CheckpointFunction is ORIGINAL_FUNCTION
        assert (nn.Module.train, nn.Module.eval) == ORIGINAL_MODES
        checkpoint(block, torch.randn(3, requires_grad=True), use_reentrant=False).sum().backward()
    assert mode.report.ok


def test_restored_when_an_exception_leaves_the_mode():
    with pytest.raises(KeyError), rngcheck.RNGConsistencyMode():
        raise KeyError("user code failed")
    _assert_torch_untouched()


@REENTRANT
def test_restored_when_the_checkpointed_forward_raises(reentrant):
    if not reentrant and not _THROWS_INTO_GENERATOR:
        pytest.skip("this torch leaves a failed non-reentrant forward open (pytorch PR 184018)")

    def block(x):
        F.dropout(x, 0.5)
        raise ValueError("inside the region")

    with pytest.raises(ValueError, match="inside the region"), rngcheck.RNGConsistencyMode() as m:
        try:
            checkpoint(block, torch.randn(3, requires_grad=True), use_reentrant=reentrant)
        finally:
            assert not m.recompute_tracker.active(), "the failed region was left open"
    _assert_torch_untouched()


@needs_forward_exception_handling
def test_the_mode_keeps_working_after_a_failed_region():
    lin = nn.Linear(4, 4)

    def bad(x):
        raise RuntimeError("boom")

    def good(x):
        return F.dropout(lin(x), 0.5)

    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        with pytest.raises(RuntimeError, match="boom"):
            checkpoint(bad, torch.randn(2, 4, requires_grad=True), use_reentrant=False)
        checkpoint(
            good, torch.randn(2, 4, requires_grad=True), use_reentrant=False
        ).sum().backward()
    assert mode.report.ok
    assert [e.phase for e in mode.events][-2:] == [rngcheck.Phase.FORWARD, rngcheck.Phase.RECOMPUTE]


@REENTRANT
def test_raise_mode_raises_out_of_backward(reentrant):
    lin = nn.Linear(16, 16)
    gen = torch.Generator().manual_seed(0)

    def block(x):
        return lin(x) * (torch.rand(x.shape, generator=gen) > 0.1)  # <- raised gen

    console = _quiet_console()
    with rngcheck.RNGConsistencyMode(console=console) as mode:
        y = checkpoint(block, torch.randn(4, 16, requires_grad=True), use_reentrant=reentrant)
        with pytest.raises(rngcheck.RecomputeMismatchError) as info:
            y.sum().backward()
    _assert_torch_untouched()
    finding = info.value.finding
    assert finding.kind is rngcheck.FindingKind.RECOMPUTE_MISMATCH
    assert finding.op == "aten.rand.generator" and finding.differs == "state"
    path, line = marked_line("raised gen")
    assert (finding.stack.call_site.filename, finding.stack.call_site.lineno) == (path, line)
    # Drawn above it, the error says what and where in one line; the drawing explains.
    assert str(info.value) == (
        f"recompute_mismatch: aten.rand.generator at test_recompute_lifecycle.py:{line} "
        "(rngcheck drew the finding above)"
    )
    assert mode.report.findings == [finding]
    rendered = console.file.getvalue()
    assert rendered.count("Likely cause:") == 1 and "generator=" in rendered
    assert "checkpoint recompute drew different random numbers" in rendered
    assert f"test_recompute_lifecycle.py:{line}" in rendered


def test_raise_leaves_the_mode_restored_even_when_the_error_propagates_out():
    gen = torch.Generator().manual_seed(0)

    def block(x):
        return x * torch.rand(x.shape, generator=gen)

    with (
        pytest.raises(rngcheck.RecomputeMismatchError),
        rngcheck.RNGConsistencyMode(console=_quiet_console()),
    ):
        checkpoint(block, torch.randn(3, requires_grad=True), use_reentrant=False).sum().backward()
    _assert_torch_untouched()


def test_composable_checkpoint_imported_during_the_mode_gets_the_original_back():
    """torch imports the composable checkpoint lazily from inside checkpoint(); a copy of our
    wrapper taken then must not outlive the mode. Runs in a fresh interpreter, where that
    module is not imported yet."""
    script = textwrap.dedent(
        f"""
        import sys, torch, rngcheck
        import torch.utils.checkpoint as tuc
        assert {COMPOSABLE!r} not in sys.modules
        original = getattr(tuc, {ENTRY!r})
        with rngcheck.RNGConsistencyMode():
            x = torch.randn(3, requires_grad=True)
            tuc.checkpoint(lambda t: t * 2, x, use_reentrant=False).sum().backward()
        copy = sys.modules.get({COMPOSABLE!r})
        assert copy is None or getattr(copy, {ENTRY!r}) is original
        print("ok", copy is not None)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok")


@REENTRANT
def test_backward_after_the_mode_exited_is_not_compared(reentrant):
    """The forward ran inside the mode, the recompute after it: nothing is recorded any more,
    so comparing would report a recompute that 'ran no random op'."""
    x = torch.randn(3, 4, requires_grad=True)
    with rngcheck.RNGConsistencyMode(console=_quiet_console()) as mode:
        y = checkpoint(lambda t: F.dropout(t, 0.5), x, use_reentrant=reentrant)
        region = rngcheck.checkpoint_region("custom")
        with region.forward():
            torch.rand(3)
    y.sum().backward()  # raises if the stale region were compared
    with region.recompute():
        torch.rand(3)
    assert mode.report.ok
    _assert_torch_untouched()
