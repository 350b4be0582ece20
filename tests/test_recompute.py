"""Recompute mismatches under torch.utils.checkpoint: every variant issue 3 names, each asserting
the finding's kind, op, differing element, the user line it points at and the cause it names."""

from __future__ import annotations

import contextlib
import functools

import _recompute_util
import pytest
import torch
import torch.nn.functional as F
from _recompute_util import (
    CPURNGStatesTracker,
    assert_culprit,
    assert_recompute_finding,
    run,
    short,
)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)

import rngcheck
from rngcheck import Report

REENTRANT = pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
DROPOUT_OP = "aten.bernoulli_.float"  # what F.dropout runs on CPU
# A reentrant checkpoint nested in another's recompute gets inputs that do not require grad.
pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")


def _input() -> torch.Tensor:
    return torch.randn(4, 16, requires_grad=True)


@REENTRANT
def test_user_generator_is_not_restored(reentrant):
    lin = nn.Linear(16, 16)
    gen = torch.Generator().manual_seed(7)

    def block(x):
        return lin(x) * (torch.rand(x.shape, generator=gen) > 0.1)  # <- user gen

    def step():
        loss = checkpoint(block, _input(), use_reentrant=reentrant).sum()
        loss.backward()

    finding = assert_recompute_finding(
        run(step),
        op="aten.rand.generator",
        differs="state",
        at="user gen",
        cause=["was passed as generator=", "torch.utils.checkpoint stashes and restores only"],
    )
    assert ("reentrant" if reentrant else "non-reentrant") in finding.region
    assert finding.sides[1].event.generator.kind == "user"
    # the two stacks part above the op's line: the forward came from checkpoint(...), the
    # recompute from .backward()
    forward_lines = [f.line for f in finding.stack.user_frames]
    recompute_lines = [f.line for f in finding.other_stack.user_frames]
    assert "loss = checkpoint(block, _input(), use_reentrant=reentrant).sum()" in forward_lines
    assert "loss.backward()" in recompute_lines
    assert "loss.backward()" not in forward_lines


@REENTRANT
def test_preserve_rng_state_false(reentrant):
    lin = nn.Linear(16, 16)

    def block(x):
        return F.dropout(lin(x), 0.1)  # <- dropout

    def step():
        y = checkpoint(block, _input(), use_reentrant=reentrant, preserve_rng_state=False)
        y.sum().backward()

    assert_recompute_finding(
        run(step),
        op=DROPOUT_OP,
        differs="state",
        at="dropout",
        cause=["preserve_rng_state=False", "default cpu"],
    )


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return F.dropout(self.lin(x), 0.2)  # <- sequential block


@REENTRANT
def test_checkpoint_sequential(reentrant):
    model = nn.Sequential(_Block(), _Block(), _Block(), _Block())

    def step():
        y = checkpoint_sequential(
            model, 2, _input(), use_reentrant=reentrant, preserve_rng_state=False
        )
        y.sum().backward()

    finding = assert_recompute_finding(
        run(step),
        op=DROPOUT_OP,
        differs="state",
        at="sequential block",
        cause=["preserve_rng_state=False"],
    )
    assert "checkpoint #" in finding.region


@REENTRANT
def test_nested_checkpoint_reports_the_inner_op_once(reentrant):
    lin = nn.Linear(16, 16)
    gen = torch.Generator().manual_seed(3)

    def inner(x):
        return lin(x) * (torch.rand(x.shape, generator=gen) > 0.5)  # <- nested inner

    def outer(x):
        y = F.dropout(lin(x), 0.3)
        return checkpoint(inner, y, use_reentrant=reentrant)

    report = run(lambda: checkpoint(outer, _input(), use_reentrant=reentrant).sum().backward())
    # The reentrant outer recompute replays the inner region too: one bug, one finding.
    assert_recompute_finding(
        report,
        op="aten.rand.generator",
        differs="state",
        at="nested inner",
        cause=["was passed as generator="],
    )


def _two_random_ops(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    a = lin(x) * (torch.rand(x.shape) > 0.5)  # <- sac first
    return lin(a) * (torch.rand(x.shape) > 0.5)  # <- sac second


def test_selective_checkpoint_that_saves_a_random_op_shifts_the_later_ones():
    lin = nn.Linear(16, 16)
    counts = {False: 0, True: 0}  # rand ops seen per pass (torch 2.9 asks again in recompute)

    def save_the_first_rand(ctx, op, *args, **kwargs):
        if op is torch.ops.aten.rand.default:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] == 1:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(create_selective_checkpoint_contexts, save_the_first_rand)

    def step():
        y = checkpoint(_two_random_ops, lin, _input(), use_reentrant=False, context_fn=context_fn)
        y.sum().backward()

    finding = assert_recompute_finding(
        run(step),
        op="aten.rand.default",
        differs="state",
        at="sac second",
        cause=[
            "selective activation checkpointing saved the output of aten.rand.default",
            f"random op #0, at {short('sac first', __file__)}",
            "shifted state",
        ],
    )
    assert finding.message.startswith("random op #1 of checkpoint")


class _CountingMode(TorchDispatchMode):
    """A user's own recompute context (not SAC): counts the ops of the recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_user_context_fn_keeps_working_and_mismatches_are_still_found():
    lin = nn.Linear(16, 16)
    gen = torch.Generator().manual_seed(1)
    modes: list[_CountingMode] = []
    entered = []

    @contextlib.contextmanager
    def forward_ctx():
        entered.append("forward")
        yield

    def context_fn():
        modes.append(_CountingMode())
        return forward_ctx(), modes[-1]

    def block(x):
        return lin(x) * (torch.rand(x.shape, generator=gen) > 0.5)  # <- user ctx

    def step():
        y = checkpoint(block, _input(), use_reentrant=False, context_fn=context_fn)
        y.sum().backward()

    assert_recompute_finding(
        run(step),
        op="aten.rand.generator",
        differs="state",
        at="user ctx",
        cause=["was passed as generator="],
        # The user's own __torch_dispatch__ runs the recompute's op; the report still points
        # both sides at the random op's line, not at the mode's hook.
    )
    assert entered == ["forward"]
    assert modes and modes[0].ops > 0, "the user's recompute context saw the recompute's ops"


@REENTRANT
def test_reseed_inside_the_region_names_its_call_site(reentrant):
    lin = nn.Linear(16, 16)
    step_no = {"n": 0}

    def block(x):
        torch.manual_seed(step_no["n"])  # <- reseed
        return F.dropout(lin(x), 0.5)  # <- reseeded dropout

    def step():
        y = checkpoint(block, _input(), use_reentrant=reentrant)
        step_no["n"] += 1  # the step counter moves before backward
        y.sum().backward()

    finding = assert_recompute_finding(
        run(step),
        op=DROPOUT_OP,
        differs="state",
        at="reseeded dropout",
        cause=[
            "reseeded inside the checkpointed region",
            f"torch.manual_seed(1) at {short('reseed', __file__)}",
            "in the forward it was torch.manual_seed(0)",
        ],
    )
    assert "named RNG stream" not in finding.cause
    # The reseed is a frame of the finding, not only words in its cause.
    assert_culprit(finding, "seed", "torch.manual_seed(1)", "reseed", __file__)


@REENTRANT
def test_argument_changed_between_forward_and_backward(reentrant):
    lin = nn.Linear(16, 16)
    schedule = {"p": 0.5}

    def block(x):
        return F.dropout(lin(x), schedule["p"])  # <- scheduled dropout

    def step():
        y = checkpoint(block, _input(), use_reentrant=reentrant)
        schedule["p"] = 0.3  # the schedule advances before backward
        y.sum().backward()

    finding = assert_recompute_finding(
        run(step),
        op=DROPOUT_OP,
        differs="argument",
        at="scheduled dropout",
        cause=["an argument of the random op changed between forward and backward", "schedule"],
    )
    # bernoulli_ draws with the keep probability: 1 - 0.5 in the forward, 1 - 0.3 in backward
    assert "p=0.5 (forward) vs p=0.7 (recompute)" in finding.message
    assert "keep probability" in finding.message


@REENTRANT
def test_named_rng_stream_that_the_checkpoint_does_not_rewind(reentrant):
    lin = nn.Linear(16, 16)
    tracker = CPURNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)

    def block(x):
        with tracker.fork():
            return F.dropout(lin(x), 0.1)  # <- tensor-parallel dropout

    report = run(lambda: checkpoint(block, _input(), use_reentrant=reentrant).sum().backward())
    finding = assert_recompute_finding(
        report,
        op=DROPOUT_OP,
        differs="state",
        at="tensor-parallel dropout",
        cause=[
            "named RNG stream",
            "fork()",
            f"torch.set_rng_state(<state>) at {short('tracker swap in', _recompute_util.__file__)}",
            "did not rewind",
        ],
    )
    where = _recompute_util.__file__
    assert_culprit(finding, "restore", "torch.set_rng_state(<state>)", "tracker swap in", where)


def test_named_stream_restored_by_the_user_is_quiet():
    """The fix the cause text suggests: save the tracker's states and restore them in the
    checkpointed function's recompute."""
    lin = nn.Linear(16, 16)
    tracker = CPURNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)

    def step():
        saved = dict(tracker.states)

        def block(x):
            tracker.states.update(saved)
            with tracker.fork():
                return F.dropout(lin(x), 0.1)

        checkpoint(block, _input(), use_reentrant=False).sum().backward()

    assert run(step).ok


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_generator_touched_only_inside_the_function():
    lin = nn.Linear(16, 16).cuda()

    def block(x):  # a CPU argument: checkpoint stashes the CPU generator only
        return F.dropout(lin(x.cuda()), 0.5)  # <- cuda dropout

    def step():
        torch.cuda.manual_seed(0)
        y = checkpoint(block, _input(), use_reentrant=False)
        torch.rand(8, device="cuda")  # the CUDA generator moves on before backward
        y.sum().backward()

    assert_recompute_finding(
        run(step),
        op=DROPOUT_OP,
        differs="state",
        at="cuda dropout",
        cause=["is used only inside the checkpointed function", "Pass a cuda tensor"],
    )


def test_composable_checkpoint_of_a_module_is_tracked():
    composable = pytest.importorskip("torch.distributed._composable")
    gen = torch.Generator().manual_seed(5)

    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            return self.lin(x) * (torch.rand(x.shape, generator=gen) > 0.5)  # <- composable

    model = nn.Sequential(Noisy(), nn.Linear(16, 16))
    composable.checkpoint(model[0])
    assert_recompute_finding(
        run(lambda: model(_input()).sum().backward()),
        op="aten.rand.generator",
        differs="state",
        at="composable",
        cause=["was passed as generator="],
    )


def test_a_training_loop_with_the_bug_reports_it_once_with_its_count_and_steps():
    lin = nn.Linear(16, 16)
    gen = torch.Generator().manual_seed(7)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)

    def block(x):
        return lin(x) * (torch.rand(x.shape, generator=gen) > 0.1)  # <- loop gen

    def train():
        for _ in range(5):
            checkpoint(block, _input(), use_reentrant=False).sum().backward()
            opt.step()

    report = run(train)
    # One bug, one finding: every step's region hit it, counted on the first occurrence.
    assert len(report.findings) == 1
    (finding,) = report.findings
    assert (finding.count, finding.first_step, finding.last_step) == (5, 1, 5)
    assert report.meta["optimizer_steps"] == 5
    assert finding.region.startswith("checkpoint #1 ")  # numbered per mode, from 1
    assert_recompute_finding(
        report, op="aten.rand.generator", differs="state", at="loop gen", cause=["generator="]
    )
    assert finding.site == short("loop gen", __file__)
    saved = Report.from_json(report.to_json()).findings[0]
    assert (saved.count, saved.first_step, saved.last_step) == (5, 1, 5)


@REENTRANT
def test_control_flow_that_changed_before_backward(reentrant):
    """(Non-reentrant runs without early stop here: with it, the recompute stops before the
    extra op, which then cannot matter.)"""
    lin = nn.Linear(16, 16)
    flags = {"noise": False}

    def block(x):
        h = F.dropout(lin(x), 0.1)
        if flags["noise"]:
            h = h + torch.randn(h.shape)  # <- extra op
        return h

    def step():
        y = checkpoint(block, _input(), use_reentrant=reentrant, early_stop=False)
        flags["noise"] = True  # a global flag flips before backward
        y.sum().backward()

    finding = assert_recompute_finding(
        run(step),
        op="aten.randn.default",
        differs="op",
        at="extra op",
        cause=["control flow differs between forward and recompute"],
        sides=("recompute",),
    )
    assert finding.sides[0].event is None and finding.sides[0].note == "ran no random op here"


def test_recompute_that_runs_fewer_random_ops():
    lin = nn.Linear(16, 16)
    flags = {"noise": True}

    def block(x):
        h = F.dropout(lin(x), 0.1)
        if flags["noise"]:
            h = h * (torch.rand(h.shape) > 0.5)  # <- skipped op
        return h

    def step():
        y = checkpoint(block, _input(), use_reentrant=True)
        flags["noise"] = False
        y.sum().backward()

    finding = assert_recompute_finding(
        run(step),
        op="aten.rand.default",
        differs="op",
        at="skipped op",
        cause=["control flow differs"],
        sides=("forward",),
    )
    assert "the recompute ended after 1 random op(s); the forward ran 2" in finding.message


def _dropout_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 16), nn.Dropout(0.5))


def test_a_module_switched_to_eval_between_forward_and_backward_is_the_cause():
    """A reentrant checkpoint recomputes with the modules as they are in backward: switched to
    eval() before loss.backward(), its dropout does not run. The call and its line are the cause
    (once a generic control-flow cause), and a frame of the finding."""
    model = _dropout_model()

    def step():
        loss = checkpoint(model, _input(), use_reentrant=True).sum()  # <- checkpointed model
        model.eval()  # <- switched to eval
        loss.backward()

    finding = assert_recompute_finding(
        run(step),
        op=DROPOUT_OP,
        differs="op",
        at="checkpointed model",
        cause=["switched the checkpointed modules to evaluation mode", "ran in the forward but"],
        sides=("forward",),
    )
    assert "the recompute ended after 0 random op(s); the forward ran 2" in finding.message
    assert "control flow differs" not in finding.cause
    assert_culprit(finding, "mode", "Sequential.eval()", "switched to eval", __file__)


def test_a_submodule_switched_to_train_before_backward_is_the_cause():
    """The other way: a dropout in eval mode in the forward, switched to train() (on the layer
    itself, inside the checkpointed model) before backward: the recompute runs an extra op."""
    model = _dropout_model()
    model[3].eval()

    def step():
        loss = checkpoint(model, _input(), use_reentrant=True).sum()
        model[3].train()  # <- switched to train
        loss.backward()

    report = run(step)
    assert len(report.findings) == 1, [f.message for f in report.findings]
    finding = report.findings[0]
    assert finding.differs == "op" and "the forward ran only 1" in finding.message
    assert "switched the checkpointed modules to training mode" in finding.cause
    assert "ran in the recompute but not in the forward" in finding.cause
    assert_culprit(finding, "mode", "Dropout.train()", "switched to train", __file__)


def test_switches_that_leave_the_region_as_it_was_are_not_blamed():
    """eval() undone by train() before backward changes nothing (quiet); a switch of a module
    the region does not hold is not the cause of its mismatch (control flow is)."""
    model = _dropout_model()

    def undone():
        loss = checkpoint(model, _input(), use_reentrant=True).sum()
        model.eval()  # an evaluation between the forward and backward ...
        model.train()  # ... that switches back
        loss.backward()

    quiet = run(undone)
    assert quiet.ok and quiet.meta["recompute"]["compared_ops"] == 2

    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.noise = True

        def forward(self, x):
            h = F.dropout(self.lin(x), 0.5, self.training)
            return h * (torch.rand(h.shape) > 0.5) if self.noise else h

    noisy, other = Noisy(), _dropout_model()

    def elsewhere():
        loss = checkpoint(noisy, _input(), use_reentrant=True).sum()
        other.eval()  # another model's switch
        noisy.noise = False  # what changed the region's control flow
        loss.backward()

    report = run(elsewhere)
    assert len(report.findings) == 1
    finding = report.findings[0]
    assert "control flow differs" in finding.cause and not finding.culprits


@REENTRANT
def test_generator_chosen_at_run_time(reentrant):
    lin = nn.Linear(16, 16)
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    current = {"i": 0}

    def block(x):
        return lin(x) * (torch.rand(x.shape, generator=gens[current["i"]]) > 0.5)  # <- picked

    def step():
        y = checkpoint(block, _input(), use_reentrant=reentrant)
        current["i"] = 1  # e.g. a tracker's current stream changed
        y.sum().backward()

    assert_recompute_finding(
        run(step),
        op="aten.rand.generator",
        differs="generator",
        at="picked",
        cause=["picks its generator at run time"],
    )


def test_device_generator_only_inside_the_function_cause_without_a_device():
    """The CUDA case's cause text, checked here on the tracker with two recorded events (the
    real CUDA run is the test above, marked cuda)."""
    from rngcheck.core.generators import GeneratorId
    from rngcheck.core.stacks import Stack
    from rngcheck.recompute import RecomputeTracker

    cuda = GeneratorId(kind="default", device="cuda:0")

    def event(before: int, phase: rngcheck.Phase) -> rngcheck.RandomOpEvent:
        return rngcheck.RandomOpEvent(
            seq=0,
            op=DROPOUT_OP,
            generator=cuda,
            device="cuda:0",
            args=("float32[4, 16]", "p=0.5"),
            before=before,
            after=before + 1,
            phase=phase,
            stack=Stack.capture(),
        )

    findings: list[rngcheck.Finding] = []
    tracker = RecomputeTracker(findings.append)
    tracker.live = True
    region = tracker.new_region(
        kind="non-reentrant", preserve_rng_state=True, args=(torch.randn(2),)
    )
    with tracker.phase(region, rngcheck.Phase.FORWARD):
        tracker.on_event(event(10, rngcheck.Phase.FORWARD))
    with tracker.phase(region, rngcheck.Phase.RECOMPUTE):
        tracker.on_event(event(20, rngcheck.Phase.RECOMPUTE))
    [finding] = findings
    assert finding.differs == "state"
    assert "default cuda:0 is used only inside the checkpointed function" in finding.cause
    assert "tensor arguments' device (cpu) only" in finding.cause
    assert "Pass a cuda tensor as an argument" in finding.cause


@REENTRANT
def test_an_input_tensor_changed_in_place_before_backward(reentrant):
    keep = torch.full((4, 16), 0.7)  # read from outside the region, not an argument

    def block(x):
        return x * torch.bernoulli(keep)  # <- bernoulli of a global

    def step():
        y = checkpoint(block, _input(), use_reentrant=reentrant)
        keep.fill_(0.2)  # updated in place before backward
        y.sum().backward()

    assert_recompute_finding(
        run(step),
        op="aten.bernoulli.default",
        differs="output",
        at="bernoulli of a global",
        cause=["same op, arguments and generator state, but a different output", "in place"],
    )
