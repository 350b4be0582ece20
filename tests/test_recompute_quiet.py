"""No false alarms: correct checkpointing stays quiet, the checker changes no result, and fresh
randomness during backward outside any region shows as a note, not a finding."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from _recompute_util import marked_line, run
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)

import rngcheck

REENTRANT = pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")


def _input() -> torch.Tensor:
    return torch.randn(4, 16, requires_grad=True)


def _assert_quiet(report: rngcheck.Report, recomputed: bool = True) -> None:
    """No finding, no note, and (unless the test runs no recompute) a recompute was compared:
    quiet because the passes agreed, not because the hooks stopped seeing them."""
    if recomputed:
        checked = report.meta.get("recompute", {})
        assert checked.get("recomputes", 0) > 0 and checked.get("compared_ops", 0) > 0, checked
    assert report.ok, [f"{f.message} / {f.cause}" for f in report.findings]
    assert not [n for n in report.notes if n.kind == "backward_random_ops"], report.notes


@REENTRANT
def test_random_numbers_between_forward_and_backward(reentrant):
    lin = nn.Linear(16, 16)

    def block(x):
        return F.dropout(lin(x), 0.3) + torch.randn(x.shape) * 0.01

    def step():
        y = checkpoint(block, _input(), use_reentrant=reentrant)
        torch.rand(100)  # the default generator moves on; checkpoint restores it
        torch.randint(0, 10, (7,))
        y.sum().backward()

    _assert_quiet(run(step))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(torch.relu(self.lin(x)))


@REENTRANT
def test_several_training_steps_with_an_optimizer(reentrant):
    blocks = nn.ModuleList([_Block() for _ in range(3)])
    head = nn.Linear(16, 1)
    opt = torch.optim.SGD([*blocks.parameters(), *head.parameters()], lr=0.1)

    def train():
        for _ in range(4):
            x = torch.randn(8, 16, requires_grad=True)
            for block in blocks:
                x = checkpoint(block, x, use_reentrant=reentrant)
            loss = F.dropout(head(x), 0.1).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    report = run(train)
    _assert_quiet(report)
    # per step: the input, three block dropouts and their recomputes, the head's dropout
    assert report.random_ops == 4 * (1 + 3 + 3 + 1)


@REENTRANT
def test_checkpoint_sequential_is_quiet(reentrant):
    model = nn.Sequential(*[_Block() for _ in range(4)])
    report = run(
        lambda: checkpoint_sequential(model, 2, _input(), use_reentrant=reentrant).sum().backward()
    )
    _assert_quiet(report)


@REENTRANT
def test_nested_regions(reentrant):
    lin = nn.Linear(16, 16)

    def inner(x):
        return F.dropout(lin(x), 0.3)

    def outer(x):
        y = F.dropout(lin(x), 0.2)
        y = checkpoint(inner, y, use_reentrant=reentrant)
        return F.dropout(y, 0.1)

    def step():
        for _ in range(2):
            checkpoint(outer, _input(), use_reentrant=reentrant).sum().backward()

    _assert_quiet(run(step))


def _two_random_ops(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    a = lin(x) * (torch.rand(x.shape) > 0.5)
    return F.dropout(lin(a), 0.2) * (torch.rand(x.shape) > 0.5)


def _recompute_everything(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def _save_matmuls(ctx, op, *args, **kwargs):
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _save_every_rand(ctx, op, *args, **kwargs):
    # every rand saved: the recompute draws none of them, in the same order as the forward
    if op is torch.ops.aten.rand.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("policy", [_recompute_everything, _save_matmuls])
def test_selective_checkpointing_that_recomputes_random_ops(policy):
    lin = nn.Linear(16, 16)
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)

    def step():
        y = checkpoint(_two_random_ops, lin, _input(), use_reentrant=False, context_fn=context_fn)
        torch.rand(3)
        y.sum().backward()

    _assert_quiet(run(step))


def test_selective_checkpointing_that_saves_every_random_op_of_a_generator():
    lin = nn.Linear(16, 16)

    def only_rand(x):
        a = lin(x) * (torch.rand(x.shape) > 0.5)
        return lin(a) * (torch.rand(x.shape) > 0.5)

    context_fn = functools.partial(create_selective_checkpoint_contexts, _save_every_rand)

    def step():
        checkpoint(only_rand, _input(), use_reentrant=False, context_fn=context_fn).sum().backward()

    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        step()
    _assert_quiet(mode.report)
    cached = [e for e in mode.events if e.cached]
    assert [e.op for e in cached] == ["aten.rand.default", "aten.rand.default"]


def _early_stopping_block(lin: nn.Module):
    def block(x):
        h = F.dropout(lin(x), 0.5)
        # rand's output is only added: nothing after the dropout is saved for backward, so the
        # non-reentrant recompute stops before drawing it.
        return h + torch.rand(h.shape)

    return block


@pytest.mark.parametrize("early_stop", [True, False])
def test_early_stop_recompute_is_a_prefix(early_stop):
    block = _early_stopping_block(nn.Linear(16, 16))

    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        with tuc.set_checkpoint_early_stop(early_stop):
            y = checkpoint(block, _input(), use_reentrant=False)
        y.sum().backward()
    _assert_quiet(mode.report)
    recomputed = [e.op for e in mode.events if e.phase is rngcheck.Phase.RECOMPUTE]
    if early_stop:
        assert recomputed == ["aten.bernoulli_.float"]  # a prefix of the forward's two ops
    else:
        assert recomputed == ["aten.bernoulli_.float", "aten.rand.default"]


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("bug", [False, True], ids=["correct", "user-generator"])
def test_a_derivative_inside_the_region_recomputes_it_inside_its_forward(early_stop, bug):
    """``torch.autograd.grad`` inside a checkpointed function (a physics-informed loss, a
    gradient penalty) makes torch recompute the region inside its own forward, from the
    forward's start state: those replayed draws are that recompute's, not more of the
    forward's, so the real recompute in backward agrees op for op. (They were taken as the
    forward's second op: a false recompute_mismatch on correct training.) A generator torch does
    not restore is still found."""
    a, b = nn.Linear(16, 16), nn.Linear(16, 16)
    noise = torch.Generator().manual_seed(3)

    def block(x):
        h = F.dropout(a(x), 0.3)
        (g,) = torch.autograd.grad(h.sum(), x, create_graph=True)
        h = b(h + g)
        if bug:
            return h * (torch.rand(h.shape, generator=noise) > 0.3)  # <- not restored
        return F.dropout(h, 0.3)

    def step():
        with tuc.set_checkpoint_early_stop(early_stop):
            y = checkpoint(block, _input(), use_reentrant=False)
        y.sum().backward()

    report = run(step)
    if not bug:
        _assert_quiet(report)
        return
    (found,) = report.findings
    assert found.op == "aten.rand.generator" and "passed as generator=" in found.cause, found.cause


def test_reentrant_region_with_non_tensor_arguments():
    lin = nn.Linear(16, 16)

    def block(x, p, how, extra, times):
        assert how == "scaled" and extra is None
        for _ in range(times):
            x = F.dropout(lin(x), p)
        return x

    def step():
        y = checkpoint(block, _input(), 0.25, "scaled", None, 2, use_reentrant=True)
        torch.rand(4)
        y.sum().backward()

    _assert_quiet(run(step))


@REENTRANT
def test_eval_and_no_grad_forwards(reentrant):
    model = _Block()

    def evaluate():
        model.eval()
        checkpoint(model, _input(), use_reentrant=reentrant)  # dropout is off in eval
        model.train()
        with torch.no_grad():  # no graph: checkpoint only runs the forward
            checkpoint(model, torch.randn(4, 16), use_reentrant=reentrant)
        with torch.inference_mode():
            model(torch.randn(4, 16))

    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        evaluate()
        assert not mode.recompute_tracker.active(), "a forward-only region was left open"
    _assert_quiet(mode.report, recomputed=False)


class _NoisyBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * (torch.rand(grad.shape) > 0.5)  # <- fresh randomness in backward


def test_random_ops_in_backward_outside_any_region_are_a_note():
    def step():
        for _ in range(2):
            _NoisyBackward.apply(torch.randn(4, requires_grad=True)).sum().backward()

    report = run(step)
    assert report.ok  # not a finding: nothing to compare it with
    notes = [n for n in report.notes if n.kind == "backward_random_ops"]
    assert len(notes) == 1
    note = notes[0]
    path, line = marked_line("fresh randomness in backward")
    site = note.stack.call_site
    assert site is not None and (site.filename, site.lineno) == (path, line)
    assert note.count == 2
    assert "aten.rand.default" in note.message
    assert "rngcheck.checkpoint_region" in note.message


def _training_step(reentrant: bool, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    blocks = nn.ModuleList([_Block() for _ in range(2)])
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
    out = []
    for _ in range(2):
        x = torch.randn(8, 16, requires_grad=True)
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=reentrant)
        x = x * (torch.rand(x.shape, generator=gen) > 0.2)
        loss = x.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        out.append(loss.detach().clone())
        out.extend(p.grad.clone() for p in blocks.parameters())
        opt.step()
    out.extend(p.detach().clone() for p in blocks.parameters())
    out.append(torch.get_rng_state())
    out.append(gen.get_state())
    return out


@REENTRANT
def test_results_are_bitwise_identical_with_and_without_the_mode(reentrant):
    plain = _training_step(reentrant, seed=3)
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        checked = _training_step(reentrant, seed=3)
    _assert_quiet(mode.report)
    assert len(plain) == len(checked)
    for a, b in zip(plain, checked, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_bits(a), _bits(b))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


@REENTRANT
def test_a_generator_made_and_seeded_inside_the_region(reentrant):
    """A new Generator in each pass, seeded the same: a different object, the same numbers."""
    lin = nn.Linear(16, 16)

    def block(x):
        gen = torch.Generator().manual_seed(42)
        return lin(x) * (torch.rand(x.shape, generator=gen) > 0.5)

    _assert_quiet(
        run(lambda: checkpoint(block, _input(), use_reentrant=reentrant).sum().backward())
    )


@REENTRANT
def test_retain_graph_microbatches_and_autocast(reentrant):
    lin = nn.Linear(16, 16)

    def block(x):
        return F.dropout(lin(x), 0.5)

    def step():
        y = checkpoint(block, _input(), use_reentrant=reentrant)
        y.sum().backward(retain_graph=True)  # two backwards, two recomputes
        torch.rand(3)
        y.sum().backward()
        a = checkpoint(block, _input(), use_reentrant=reentrant)  # two microbatches,
        b = checkpoint(block, _input(), use_reentrant=reentrant)  # one backward, b's first
        (b.sum() + a.sum()).backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            c = checkpoint(block, _input(), use_reentrant=reentrant)
        c.float().sum().backward()

    _assert_quiet(run(step))


@REENTRANT
def test_a_constant_reseed_inside_the_region(reentrant):
    """Seeding with the same value in both passes replays the same numbers, even with
    preserve_rng_state=False."""
    lin = nn.Linear(16, 16)

    def block(x):
        torch.manual_seed(1234)
        return F.dropout(lin(x), 0.5)

    def step():
        y = checkpoint(block, _input(), use_reentrant=reentrant, preserve_rng_state=False)
        torch.rand(3)
        y.sum().backward()

    _assert_quiet(run(step))
