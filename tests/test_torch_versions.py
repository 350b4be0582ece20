"""The torch that users have: rngcheck hooks the checkpoint entry points of the running torch
(one table, one version test), checks every variant on it, and says so loudly when it cannot see a
checkpoint region rather than staying silent."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from _recompute_util import assert_recompute_finding, run
from torch import nn

import rngcheck
from rngcheck.recompute import torch_hooks

REENTRANT = pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])


def test_the_version_table_names_the_entry_points_of_each_torch():
    assert torch_hooks.hooks_for((2, 9)).nonreentrant == "_checkpoint_without_reentrant_generator"
    assert torch_hooks.hooks_for((2, 13)).nonreentrant == (
        "_checkpoint_without_reentrant_generator"
    )
    assert torch_hooks.hooks_for((2, 14)).nonreentrant == (
        "_checkpoint_without_reentrant_generator_impl"
    )
    assert torch_hooks.hooks_for((2, 15)) == torch_hooks.hooks_for((2, 14))
    # The running torch has every name its table entry promises.
    assert torch_hooks.missing_names() == []


def _dropout_region(reentrant: bool) -> None:
    lin = nn.Linear(8, 8)
    x = torch.randn(2, 8, requires_grad=True)
    tuc.checkpoint(lambda t: F.dropout(lin(t), 0.5), x, use_reentrant=reentrant).sum().backward()


@REENTRANT
def test_every_region_of_the_running_torch_is_seen(reentrant):
    """A region with a random op is recorded as a region on this torch (not merely quiet)."""
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        _dropout_region(reentrant)
    regions = {e.region for e in mode.events}
    assert len(regions - {""}) == 1, regions
    assert {e.phase.value for e in mode.events} == {"forward", "recompute"}
    assert mode.report.ok and not mode.report.notes


@pytest.mark.skipif(
    torch_hooks.TORCH_VERSION < (2, 14), reason="checkpoint() as a decorator is torch 2.14+"
)
def test_the_decorator_form_of_torch_2_14_is_checked():
    gen = torch.Generator().manual_seed(3)
    lin = nn.Linear(8, 8)

    @tuc.checkpoint(use_reentrant=False)
    def block(x):
        return lin(x) * torch.rand(x.shape, generator=gen)  # <- decorated

    def step():
        block(torch.randn(2, 8, requires_grad=True)).sum().backward()

    assert_recompute_finding(
        run(step), op="aten.rand.generator", differs="state", at="decorated", cause=["generator="]
    )


def _an_unknown_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a torch whose checkpoint internals moved looks like to rngcheck: the entry point its
    table names does not exist (the real torch runs unchanged underneath)."""
    moved = dataclasses.replace(torch_hooks.HOOKS, nonreentrant="_a_name_torch_no_longer_has")
    monkeypatch.setattr(torch_hooks, "HOOKS", moved)


def _a_changed_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch that keeps the entry point's name but reads its call differently (as 2.14 did):
    rngcheck must leave it unwrapped, not crash the user's checkpoint."""
    entry = getattr(tuc, torch_hooks.HOOKS.nonreentrant)

    def entry_with_a_new_signature(*everything, **named):
        return entry(*everything, **named)

    monkeypatch.setattr(tuc, torch_hooks.HOOKS.nonreentrant, entry_with_a_new_signature)


@pytest.mark.parametrize(
    "change, said",
    [
        (_an_unknown_torch, "_a_name_torch_no_longer_has"),
        (_a_changed_signature, "no 'fn' parameter"),
    ],
    ids=["name-gone", "signature-changed"],
)
def test_an_internals_change_is_a_loud_warning_and_a_report_note(monkeypatch, change, said):
    change(monkeypatch)
    with (
        pytest.warns(rngcheck.RNGCheckCoverageWarning) as caught,
        rngcheck.RNGConsistencyMode(on_finding="record") as mode,
    ):
        _dropout_region(reentrant=False)  # runs, unchecked, on the user's torch
    texts = [str(w.message) for w in caught]
    # Once at the start (what changed), once at the first unseen region: never per op.
    assert len(texts) == 2, texts
    assert said in texts[0] and torch.__version__ in texts[0]
    assert "did not see begin" in texts[1] and "not compared" in texts[1]
    notes = [n for n in mode.report.notes if n.kind == "not_checked"]
    assert len(notes) == 2
    assert torch.__version__ in notes[1].message


def test_the_unseen_region_warning_fires_when_the_hook_is_routed_around(monkeypatch):
    """Even with every name present, a region torch runs without calling the hooked name (here:
    a copy of the entry point taken before the mode started) is noticed at its random ops."""
    entry = getattr(tuc, torch_hooks.HOOKS.nonreentrant)
    lin = nn.Linear(8, 8)
    gen = torch.Generator().manual_seed(1)

    def block(x):
        return lin(x) * torch.rand(x.shape, generator=gen)

    def routed_around(fn, x):
        """torch.utils.checkpoint's own non-reentrant path, driving the generator rngcheck did
        not wrap (the shape of the 2.14 restructuring that silenced rngcheck 0.1)."""
        args, kwargs = _entry_args(fn, x)
        gen_ = entry(*args, **kwargs)
        next(gen_)
        out = fn(x)
        with pytest.raises(StopIteration):
            next(gen_)
        return out

    with (
        pytest.warns(rngcheck.RNGCheckCoverageWarning, match="did not see begin"),
        rngcheck.RNGConsistencyMode(on_finding="record") as mode,
    ):
        routed_around(block, torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert any(n.kind == "not_checked" for n in mode.report.notes)


def _entry_args(fn, x):
    if torch_hooks.HOOKS.nonreentrant.endswith("_impl"):
        return (fn, (x,), {}), {"preserve_rng_state": True}
    return (fn, True, tuc.noop_context_fn, "default", False, True, x), {}


def test_no_warning_without_checkpoint_or_with_check_recompute_off():
    lin = nn.Linear(8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", rngcheck.RNGCheckCoverageWarning)
        with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
            F.dropout(lin(torch.randn(2, 8)), 0.5).sum().backward()
            seq = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5))
            # checkpoint_sequential runs its last segment unchecked on purpose: not a region
            tuc.checkpoint_sequential(
                seq, 2, torch.randn(2, 8), use_reentrant=False
            ).sum().backward()
        assert not mode.report.notes
        with rngcheck.RNGConsistencyMode(on_finding="record", check_recompute=False) as mode:
            _dropout_region(reentrant=False)
        assert not [n for n in mode.report.notes if n.kind == "not_checked"]


# -- TorchDynamo and the mode ----------------------------------------------------------------------
# torch wraps a dispatch mode's __torch_dispatch__ in torch._disable_dynamo, which costs every op
# its Python layers and imports TorchDynamo at the first op (seconds); rngcheck's mode is kept
# from TorchDynamo by a mark on its code object instead, on every torch in CI.


def test_dynamo_never_compiles_the_checker_itself():
    # The ops of a graph break run eagerly in the compiled frame, with TorchDynamo's frame
    # callback still set: the mode's frames (and all they call) must run as plain Python, never
    # be taken for user code to compile. torch 2.9 has no per-call wrapper: there, before the
    # mark, TorchDynamo compiled about 60 of rngcheck's functions (__torch_dispatch__, _on_random
    # and what they call, with graph breaks inside), as 2.13 does with neither wrapper nor mark.
    from torch._dynamo import convert_frame

    gen = torch.Generator().manual_seed(0)

    def f(x):
        y = x * 2
        s = y.sum().item()  # a graph break: runs eagerly
        z = torch.bernoulli(torch.full_like(y, 0.5), generator=gen)  # eager too (a generator)
        return y + z + s

    torch._dynamo.reset()  # (forgets the code objects TorchDynamo took in so far)
    compiled = torch.compile(f, backend="eager")
    with rngcheck.RNGConsistencyMode() as mode:
        for _ in range(3):
            compiled(torch.ones(4))
    taken = [c for c in (ref() for ref in convert_frame.input_codes.seen) if c is not None]
    torch._dynamo.reset()
    assert f.__code__ in taken  # (TorchDynamo did compile f)
    package = os.path.dirname(rngcheck.__file__) + os.sep
    ours = sorted({c.co_name for c in taken if c.co_filename.startswith(package)})
    assert not ours, f"TorchDynamo took rngcheck's own frames to compile: {ours}"
    assert mode.report.random_ops == 3 and mode.report.ok  # each call's eager draw was checked


def test_a_run_that_compiles_nothing_never_imports_torch_dynamo():
    code = (
        "import sys, torch, rngcheck\n"
        "with rngcheck.RNGConsistencyMode():\n"
        "    torch.nn.functional.dropout(torch.ones(8), 0.5)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RNGCHECK", "_RNGCHECK"))
        and k not in ("PYTHONOPTIMIZE", "PYTHONSTARTUP")
    }
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False", "the mode imported torch._dynamo"
