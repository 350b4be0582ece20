"""level="step": op by op on sampled steps only, generator states at optimizer steps and
checkpoint regions in between. Quiet on correct real training (bitwise the same results), finds a
recurring bug between samples and names its op and line at the step after (escalation). Real
checkpointing, real optimizers, real gloo process groups, Hugging Face models from tiny configs."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from _dist import assert_compared, compared, scenario_mode
from _recompute_util import marked_line
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.checkpoint import checkpoint

import rngcheck

_HERE = __file__
STEP = {"level": "step", "on_finding": "record"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.noise: torch.Generator | None = None  # set: the bug, a user generator inside
        self.preserve = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.noise is not None:
            return h * (torch.rand(h.shape, generator=self.noise) > 0.2)  # <- user generator
        return F.dropout(h, 0.2)  # <- block dropout


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False, preserve_rng_state=b.preserve)
        return x.sum()


def _checking() -> bool:
    """Whether the running checker checks ops one by one now (on either route)."""
    active = rngcheck.active_mode()
    interceptor = active._interceptor if active is not None else None
    return interceptor is not None and not interceptor.suspended


def _train(
    model: nn.Module,
    steps: int,
    data: torch.Generator,
    bug_at: int = 0,
    kind: str = "",
    optimizers: int = 1,
):
    """``steps`` training steps; from step ``bug_at`` (1-based) the bug ``kind`` is in.
    ``optimizers=2``: the blocks' parameters split between SGD and AdamW, both stepped after
    backward (as Muon beside AdamW): still one training step per iteration."""
    opts = [torch.optim.SGD(model.parameters(), lr=0.01)]
    if optimizers == 2:
        first, second = model.blocks
        opts = [
            torch.optim.SGD(first.parameters(), lr=0.01),
            torch.optim.AdamW(second.parameters(), lr=0.01),
        ]
    losses = []
    stacks = []
    for step in range(1, steps + 1):
        if bug_at and step == bug_at:
            for b in model.blocks:
                if kind == "user generator":
                    b.noise = data  # drawn in the forward, not restored for the recompute
                else:
                    b.preserve = False
        x = torch.randn(4, 8, generator=data)  # the data generator: known from step 1
        loss = model(x)
        stacks.append(([type(m).__name__ for m in _get_current_dispatch_mode_stack()], _checking()))
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(loss.detach())
    return losses, stacks


def test_correct_training_is_quiet_bitwise_the_same_and_unintercepted_between_samples():
    torch.manual_seed(0)
    plain_model = Net()
    plain, _ = _train(plain_model, 12, torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = Net()
    with rngcheck.RNGConsistencyMode(sample_every=5, **STEP) as mode:
        checked, stacks = _train(model, 12, torch.Generator().manual_seed(1))
    assert all(torch.equal(a, b) for a, b in zip(plain, checked, strict=True))
    assert mode.report.ok and not mode.report.notes, mode.report.notes
    level = mode.report.meta["level"]
    assert level["op_level"] == ["1-2", "5", "10"] and level["escalations"] == 0
    # 8 steps between samples, 2 regions each: watched for the data's generator (known to the
    # probe: the blocks could draw from it; they do not, so there is nothing to compare), their
    # dropout left to torch's restore (the CPU default, early stop: no state shows a thing).
    probe = level["checkpoint_probe"]
    assert probe == {
        "regions": 2 * 8,
        "compared": 0,
        "mismatches": 0,
        "restored_and_stopped_early": 2 * 8,
    }, probe
    # Sampled steps are checked op by op, the others not. The dispatch-mode route is on the
    # dispatch stack on sampled steps only; the selective route never puts a mode there.
    op_steps = {1, 2, 5, 10}
    on_stack = mode.report.meta["route"] == "dispatch_mode"
    for step, (stack, checking) in enumerate(stacks, 1):
        assert checking is (step in op_steps), step
        assert stack == (["Interceptor"] if step in op_steps and on_stack else []), (step, stack)
    # Random ops are recorded on sampled steps only (4 dropouts and 1 data draw a step).
    assert mode.report.random_ops == 4 * len(op_steps) + 4


@pytest.mark.parametrize(
    ("kind", "line", "cause"),
    [
        ("user generator", "user generator", "torch.utils.checkpoint stashes"),
        ("preserve_rng_state=False", "block dropout", "preserve_rng_state=False, so default cpu"),
    ],
)
@pytest.mark.parametrize("optimizers", [1, 2])
def test_a_recompute_bug_between_samples_is_found_then_located_at_the_next_step(
    kind, line, cause, optimizers
):
    torch.manual_seed(0)
    model = Net()
    with rngcheck.RNGConsistencyMode(sample_every=1000, **STEP) as mode:
        _train(
            model, 20, torch.Generator().manual_seed(1), bug_at=6, kind=kind, optimizers=optimizers
        )
    # One bug, one finding: found at step 6 between samples by generator states (the region
    # and the generator), held, and named at step 7, checked op by op (the op, its line, the
    # likely cause); every occurrence between samples before and after is counted on it.
    (located,) = mode.report.findings
    assert located.op == found_op(kind) and cause in located.cause
    file, lineno = marked_line(line)
    assert located.site == f"{os.path.basename(file)}:{lineno}"
    # 2 blocks a step: steps 6 and 8-20 between samples, step 7 op by op.
    assert (located.first_step, located.last_step, located.count) == (6, 20, 2 * 15)
    assert located.found_by.startswith("between sampled steps at step 6, by generator states (")
    assert " (non-reentrant) of blocks." in located.found_by, located.found_by
    assert located.found_by.endswith("); named op by op at step 7"), located.found_by
    assert "(checked at the step level)" not in located.found_by
    level = mode.report.meta["level"]
    assert level["op_level"] == ["1-2", "7"] and level["escalations"] == 1


def test_raised_a_bug_between_samples_stops_the_run_at_its_op_and_line():
    """on_finding="raise" (RNGCHECK=1's default): the finding between samples does not stop the
    run before the next step has named its op and line; the error raised there, its drawing and
    the saved report say both, and how it was found."""
    from io import StringIO

    from rich.console import Console

    from rngcheck.output.render import format_finding

    console = Console(file=StringIO(), width=400, color_system=None)
    torch.manual_seed(0)
    model = Net()
    with (
        pytest.raises(rngcheck.RecomputeMismatchError) as info,
        rngcheck.RNGConsistencyMode(level="step", sample_every=1000, console=console) as mode,
    ):
        _train(model, 20, torch.Generator().manual_seed(1), bug_at=6, kind="preserve")
    (finding,) = mode.report.findings
    assert info.value.finding is finding
    assert finding.op == "aten.bernoulli_.float"
    # both blocks at step 6 between samples, the first one at step 7 op by op: raised there
    assert (finding.first_step, finding.last_step, finding.count) == (6, 7, 3)
    file, lineno = marked_line("block dropout")
    assert finding.site == f"{os.path.basename(file)}:{lineno}"
    assert finding.found_by.endswith("named op by op at step 7")
    drawn = console.file.getvalue()
    assert drawn.count("checkpoint recompute drew different random numbers") == 1, drawn
    assert (
        f"Found: {finding.found_by}" in drawn
        and "Recurring: seen 3 times in all, steps 6 to 7" in drawn
    )
    again = rngcheck.Finding.from_dict(finding.to_dict())
    assert again.found_by == finding.found_by
    assert f"  Found: {finding.found_by}" in format_finding(again).splitlines()


def _one_off(model: Net, steps: int, bad: set[int]) -> None:
    """``steps`` training steps, the blocks checkpointed with preserve_rng_state=False at the
    steps in ``bad`` only (1-based)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        for b in model.blocks:
            b.preserve = step not in bad
        model(torch.randn(4, 8, generator=data)).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("on_finding", ["record", "raise"])
def test_a_bug_of_one_step_between_samples_is_reported_after_the_next_step_as_found(on_finding):
    """Step 7, checked op by op after the step 6 that had the bug, has none: the finding by
    generator states is reported as it is (region and generator, no op), saying why, at the end
    of step 7 (raised there under on_finding="raise")."""
    torch.manual_seed(0)
    model = Net()
    raised = (
        contextlib.nullcontext()
        if on_finding == "record"
        else pytest.raises(rngcheck.RecomputeMismatchError)
    )
    with (
        raised as info,
        rngcheck.RNGConsistencyMode(level="step", sample_every=1000, on_finding=on_finding) as mode,
    ):
        _one_off(model, 12, bad={6})
    (found,) = mode.report.findings
    assert found.op == "non-reentrant checkpoint" and not found.found_by
    assert "(checked at the step level)" in found.message and " of blocks." in found.region
    assert (found.first_step, found.last_step, found.count) == (6, 6, 2)  # both blocks
    assert "preserve_rng_state=False" in found.cause and "The step after" not in found.cause
    assert found.cause.endswith(
        "Step 7, checked op by op after it, had no recompute that drew differently from default "
        "cpu, so the op and its line are not known: look for what changes from step to step in "
        "this region (a flag, a schedule, data-dependent control flow)."
    ), found.cause
    if on_finding == "raise":
        assert info.value.finding is found
        # raised by the step hook of step 7: its optimizer step, in the training loop
        assert any("opt.step()" in (f.line or "") for f in traceback_frames(info.value))


@pytest.mark.parametrize("how", ["normal exit", "exception"])
def test_a_bug_at_the_last_step_is_reported_at_exit(how):
    """The run ends before a step checked op by op: the finding is reported at exit as found,
    raised there when the block ends normally, and only recorded when an exception ends it (the
    user's exception is the one to see)."""
    torch.manual_seed(0)
    model = Net()
    expected = rngcheck.RecomputeMismatchError if how == "normal exit" else KeyError
    with (
        pytest.raises(expected),
        rngcheck.RNGConsistencyMode(level="step", sample_every=1000) as mode,
    ):
        _one_off(model, 8, bad={8})
        if how == "exception":
            raise KeyError("the user's own error")
    (found,) = mode.report.findings
    assert found.op == "non-reentrant checkpoint" and found.first_step == 8
    assert found.cause.endswith(
        "The run ended before a step could be checked op by op, so the op and its line are not "
        "known."
    ), found.cause


def traceback_frames(exc: BaseException) -> list[Any]:
    import traceback

    return traceback.extract_tb(exc.__traceback__)


def found_op(kind: str) -> str:
    return "aten.rand.generator" if kind == "user generator" else "aten.bernoulli_.float"


def test_selective_checkpointing_and_reentrant_checkpoints_stay_quiet():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):  # keep the mask's draw: the recompute skips it
        if op is torch.ops.aten.rand.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    lin = nn.Linear(8, 8)
    opt = torch.optim.SGD(lin.parameters(), lr=0.01)

    def block(x):
        h = lin(x)
        return torch.relu(h * (torch.rand(h.shape) > 0.3))

    torch.manual_seed(0)
    with rngcheck.RNGConsistencyMode(sample_every=1000, **STEP) as mode:
        for _ in range(8):
            x = torch.randn(4, 8)
            sac = checkpoint(
                block,
                x,
                use_reentrant=False,
                context_fn=lambda: create_selective_checkpoint_contexts(policy),
            )
            reentrant = checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=True)
            (sac.sum() + reentrant.sum()).backward()
            opt.step()
    assert mode.report.ok, [f.message for f in mode.report.findings]
    # Between samples (6 steps): the reentrant regions' end states are compared; the selective
    # ones are left to torch's restore (the CPU default, early stop).
    probe = mode.report.meta["level"]["checkpoint_probe"]
    assert probe["regions"] == probe["compared"] == 6, probe
    assert probe["restored_and_stopped_early"] == 6, probe


class Branchy(nn.Module):
    """Draws a second mask only while ``extra`` is set: set between its forward and its
    backward, the recompute draws more than the forward did (control flow on a flag)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.fc(x), 0.2)
        if self.extra:  # noise that saves no tensor (torch would notice one more saved)
            h = h + 0.0 * torch.rand(h.shape)  # <- drawn in the recompute only
        return h


@pytest.mark.parametrize(
    "how", ["reentrant", "early_stop=False", "set_checkpoint_early_stop(False)"]
)
def test_a_recompute_that_draws_more_from_a_restored_generator_is_found_between_samples(how):
    """torch restores the CPU default generator for the recompute, so between samples only its
    end states are compared: a recompute run to its end (reentrant, or early stop turned off by
    the call's argument or torch's switch) that drew a different amount is a step-level finding
    with the control-flow cause, then located op by op at the next step."""
    torch.manual_seed(0)
    block = Branchy()
    opt = torch.optim.SGD(block.parameters(), lr=0.01)
    with rngcheck.RNGConsistencyMode(sample_every=1000, **STEP) as mode:
        for step in range(1, 13):
            x = torch.randn(4, 8, requires_grad=True)
            if how == "reentrant":
                out = checkpoint(block, x, use_reentrant=True)
            elif how == "early_stop=False":
                out = checkpoint(block, x, use_reentrant=False, early_stop=False)
            else:
                with tuc.set_checkpoint_early_stop(False):
                    out = checkpoint(block, x, use_reentrant=False)
            block.extra = step >= 6  # the bug, from step 6: the recompute takes the branch
            out.sum().backward()
            block.extra = False
            opt.step()
    (located,) = mode.report.findings  # found at step 6, named op by op at step 7
    kind = "reentrant" if how == "reentrant" else "non-reentrant"
    assert located.op.startswith("aten.") and "control flow" in located.cause, located.message
    assert located.first_step == 6 and located.found_by.endswith("named op by op at step 7")
    assert f"({kind}) of Branchy: " in located.found_by, located.found_by
    assert "drew a different amount" in located.found_by, located.found_by


def test_an_early_stopping_recompute_before_the_extra_draw_is_quiet():
    """torch restores the CPU default for the recompute and stops it once the saved tensors are
    back, before the extra draw: it drew the forward's numbers. No state could show otherwise,
    so none is read between samples (the regions are counted as left to torch)."""
    torch.manual_seed(0)
    block = Branchy()
    opt = torch.optim.SGD(block.parameters(), lr=0.01)
    with rngcheck.RNGConsistencyMode(sample_every=1000, **STEP) as mode:
        for _ in range(8):
            out = checkpoint(block, torch.randn(4, 8), use_reentrant=False)
            block.extra = True  # torch stops the recompute once the saved tensors are back
            out.sum().backward()
            block.extra = False
            opt.step()
    assert mode.report.ok, [f.message for f in mode.report.findings]
    probe = mode.report.meta["level"]["checkpoint_probe"]
    assert probe["restored_and_stopped_early"] == 6 and probe["regions"] == 0, probe


def test_a_plain_function_region_between_samples_is_named_by_its_line():
    lin = nn.Linear(8, 8)
    opt = torch.optim.SGD(lin.parameters(), lr=0.01)
    noise = torch.Generator().manual_seed(5)
    bug = False

    def noisy_block(x):
        h = lin(x)
        return h * (torch.rand(h.shape, generator=noise) > 0.2) if bug else F.dropout(h, 0.2)

    with rngcheck.RNGConsistencyMode(sample_every=1000, **STEP) as mode:
        for step in range(1, 10):
            bug = step >= 5
            x = torch.randn(4, 8, generator=noise)  # (known from step 1: the data's)
            out = checkpoint(noisy_block, x, use_reentrant=False)  # <- noisy call
            out.sum().backward()
            opt.step()
    (located,) = mode.report.findings  # found at step 5 between samples, named at step 6
    file, lineno = marked_line("noisy call")  # (a layer is named by its layer instead)
    where = f"(non-reentrant) at {os.path.basename(file)}:{lineno}: "
    assert where in located.found_by, located.found_by
    assert located.first_step == 5 and located.op == "aten.rand.generator"


def test_a_derivative_inside_the_region_still_leaves_its_recompute_checked():
    """``torch.autograd.grad`` inside a checkpointed function (a physics-informed loss) makes torch
    recompute the region inside its own forward: the real recompute in backward is still
    compared between samples, found at step 6 and located at step 7."""
    lin = nn.Linear(8, 8)
    opt = torch.optim.SGD(lin.parameters(), lr=0.01)
    extra = False

    def block(x):
        h = torch.tanh(lin(x))
        (g,) = torch.autograd.grad(h.sum(), x, create_graph=True)
        out = F.dropout(h + g, 0.2)
        return out + 0.0 * torch.rand(out.shape) if extra else out

    torch.manual_seed(0)
    with rngcheck.RNGConsistencyMode(sample_every=1000, **STEP) as mode:
        for step in range(1, 11):
            x = torch.randn(4, 8, requires_grad=True)
            with tuc.set_checkpoint_early_stop(False):
                out = checkpoint(block, x, use_reentrant=False)
            extra = step >= 6  # the recompute draws more from here on
            out.sum().backward()
            extra = False
            opt.step()
    (located,) = mode.report.findings
    assert located.first_step == 6 and located.found_by.endswith("named op by op at step 7")
    assert not mode.recompute_tracker.waiting()


def test_two_marked_regions_with_bugs_at_different_times_are_each_located():
    """Regions of ``checkpoint_region`` between samples are told apart by their name and line:
    each one's bug is escalated and located op by op."""
    lin = nn.Linear(8, 8)
    opt = torch.optim.SGD(lin.parameters(), lr=0.01)

    def marked(name: str, x: torch.Tensor, restore: bool) -> torch.Tensor:
        region = rngcheck.checkpoint_region(name)
        start = torch.get_rng_state()
        with region.forward():  # <- marked forward
            y = F.dropout(lin(x), 0.2)
        after = torch.get_rng_state()
        if restore:
            torch.set_rng_state(start)
        with region.recompute():
            F.dropout(lin(x), 0.2)
        torch.set_rng_state(after)
        return y

    torch.manual_seed(0)
    with rngcheck.RNGConsistencyMode(sample_every=1000, **STEP) as mode:
        for step in range(1, 14):
            y = marked("attn", torch.randn(4, 8), restore=not 4 <= step <= 5)
            z = marked("mlp", y, restore=step < 9)
            (y.sum() + z.sum()).backward()
            opt.step()
    level = mode.report.meta["level"]
    assert level["escalations"] == 2 and level["op_level"] == ["1-2", "5", "10"], level
    # Both located op by op (one finding: the same line draws both masks), attn's first: attn
    # found at step 4 between samples and named at 5, mlp found at 9, named at 10 and found
    # again at 11 to 13, every occurrence counted on the one finding.
    (located,) = mode.report.findings
    assert (located.first_step, located.last_step, located.count) == (4, 13, 7)
    assert located.found_by.startswith("between sampled steps at step 4, by generator states")
    file, lineno = marked_line("marked forward")
    assert located.region == f"attn (custom) at {os.path.basename(file)}:{lineno}"


@pytest.mark.parametrize("how", ["debug=True", "no_grad", "debug enabled"])
def test_checkpoints_torch_runs_its_own_way_between_samples_stay_quiet(how, monkeypatch):
    """checkpoint(debug=True) and set_checkpoint_debug_enabled (torch's own context_fn: rngcheck
    marks the passes from outside) and a checkpoint under no_grad (torch runs no pass context)
    between samples: quiet, bitwise the same, and probed where there is a recompute."""
    # torch's checkpoint debug mode logs records that pytest's log capture cannot format (a
    # TypeError in logging, with or without rngcheck): keep them away from it.
    monkeypatch.setattr(logging.getLogger("LoggingTensor"), "propagate", False)

    def run(mode: Any) -> list[torch.Tensor]:
        torch.manual_seed(0)
        block = Block()
        opt = torch.optim.SGD(block.parameters(), lr=0.01)
        losses = []
        with mode:
            for _ in range(6):
                x = torch.randn(4, 8, requires_grad=True)
                if how == "no_grad":
                    with torch.no_grad():
                        checkpoint(block, x, use_reentrant=False)
                    loss = F.dropout(block(x), 0.2).sum()
                elif how == "debug=True":
                    loss = checkpoint(block, x, use_reentrant=False, debug=True).sum()
                else:
                    with tuc.set_checkpoint_debug_enabled(True):
                        loss = checkpoint(block, x, use_reentrant=False).sum()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
        return losses

    plain = run(contextlib.nullcontext())
    mode = rngcheck.RNGConsistencyMode(sample_every=1000, **STEP)
    checked = run(mode)
    assert all(torch.equal(a, b) for a, b in zip(plain, checked, strict=True))
    assert mode.report.ok and not mode.report.notes, [f.message for f in mode.report.findings]
    probe = mode.report.meta["level"]["checkpoint_probe"]
    # Every call between samples (4 steps) draws only from the CPU default, which torch restores
    # and whose recompute it stops early: left to torch, nothing read, however torch runs it.
    assert probe["restored_and_stopped_early"] == 4 and probe["regions"] == 0, probe
    assert not mode.recompute_tracker.waiting()


def _gan(
    reentrant: bool, bug: bool, critic_steps: int, make_mode: Any = None, **config: Any
) -> rngcheck.Report:
    """A GAN's iterations: the generator's checkpointed forward, ``critic_steps`` steps of the
    discriminator (the lead optimizer: it steps first), then the generator's backward (its
    recompute) and step. ``bug``: a user generator inside the checkpointed block."""
    torch.manual_seed(0)
    gen_net, disc = nn.Linear(8, 8), nn.Linear(8, 1)
    opt_g = torch.optim.SGD(gen_net.parameters(), lr=0.01)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.01)
    noise = torch.Generator().manual_seed(3)

    def block(z):
        h = gen_net(z)
        if bug:
            return h * (torch.rand(h.shape, generator=noise) > 0.3)  # <- gan noise
        return F.dropout(h, 0.3)

    mode_of = make_mode or (lambda **kw: rngcheck.RNGConsistencyMode(**{**STEP, **kw}))
    with mode_of(**config) as mode:
        for _ in range(9):
            z = torch.randn(4, 8, requires_grad=reentrant)
            fake = checkpoint(block, z, use_reentrant=reentrant)
            for _ in range(critic_steps):
                opt_d.zero_grad()
                disc(fake.detach()).mean().backward()
                opt_d.step()
            opt_g.zero_grad()
            (-disc(fake).mean()).backward()
            opt_g.step()
    return mode.report


REENTRANT = pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])


@REENTRANT
@pytest.mark.parametrize("bug", [False, True], ids=["correct", "user-generator"])
def test_a_gan_steps_two_optimizers_per_iteration_and_splits_forward_from_recompute(reentrant, bug):
    """One training step per iteration (the lead optimizer's), and a level switch due at the
    discriminator's step waits for the generator's recompute: every recompute is compared the
    way its forward was watched, and the bug is located at an op-level step."""
    report = _gan(reentrant, bug, critic_steps=1, sample_first=1, sample_every=3)
    counts, level = report.meta["recompute"], report.meta["level"]
    assert counts["unpaired"] == 0 and counts["recomputes"] == 9, counts
    assert level["steps"] == 9 and level["postponed_switches"] > 0, level
    if not bug:
        assert report.ok, [f.message for f in report.findings]
        return
    located = [f for f in report.findings if f.op == "aten.rand.generator"]
    file, lineno = marked_line("gan noise")
    assert located and located[0].site == f"{os.path.basename(file)}:{lineno}"


@pytest.mark.parametrize("critic_steps", [1, 2])
def test_a_gan_recompute_that_draws_more_is_located_on_sampled_steps(critic_steps):
    """The generator's region draws only from the CPU default, restored by torch, with early
    stop: left to torch between samples (no state could show its bug). From iteration 3 its
    recompute draws one more number between its two masks (control flow on a flag), so the
    second mask differs. The forward still waits for its recompute, so the switches to op by op
    line up with whole iterations, even with two critic steps between the forward and the
    backward, and the sampled steps find it."""
    torch.manual_seed(0)
    g1, g2, disc = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)
    opt_g = torch.optim.SGD([*g1.parameters(), *g2.parameters()], lr=0.01)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.01)
    extra = False

    def block(z):
        h = F.dropout(g1(z), 0.3)
        if extra:
            torch.rand(2)  # <- drawn in the recompute only
        return F.dropout(g2(h), 0.3)

    with rngcheck.RNGConsistencyMode(sample_first=1, sample_every=3, **STEP) as mode:
        for it in range(12):
            extra = False
            fake = checkpoint(block, torch.randn(4, 8), use_reentrant=False)
            for _ in range(critic_steps):
                opt_d.zero_grad()
                disc(fake.detach()).mean().backward()
                opt_d.step()
            extra = it >= 2
            opt_g.zero_grad()
            (-disc(fake).mean()).backward()
            opt_g.step()
    probe = mode.report.meta["level"]["checkpoint_probe"]
    assert probe["restored_and_stopped_early"] and not probe["regions"], probe
    (found,) = mode.report.findings
    assert "control flow" in found.cause and found.first_step > 1, (found.message, found.cause)


@REENTRANT
def test_a_recompute_watched_another_way_than_its_forward_is_not_compared(reentrant):
    """Two critic steps between the generator's forward and its recompute: the switch is
    held back once, then made; a recompute watched op by op after a forward watched by states
    (or the other way round) is counted as unpaired, not reported as a missing op."""
    report = _gan(reentrant, False, critic_steps=2, sample_first=1, sample_every=3)
    assert report.ok, [f.message for f in report.findings]
    counts = report.meta["recompute"]
    assert 0 < counts["unpaired"] < counts["recomputes"] == 9, counts


def _op_steps(ranges: list[str]) -> set[int]:
    out: set[int] = set()
    for r in ranges:
        first, _, last = r.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


def test_a_graph_kept_across_steps_does_not_cost_the_sampled_steps():
    """A checkpointed output kept alive across the optimizer step (its backward never runs in
    that step): the switch held back for it is made at the next training step, the step meant
    to run op by op is owed and runs next, and the report lists the steps that really ran op by
    op."""
    torch.manual_seed(0)
    body, head = nn.Linear(8, 8), nn.Linear(8, 1)
    opt = torch.optim.SGD(head.parameters(), lr=0.01)
    on_stack = []
    with rngcheck.RNGConsistencyMode(sample_first=1, sample_every=4, **STEP) as mode:
        for _ in range(12):
            on_stack.append(_checking())
            x = torch.randn(4, 8, requires_grad=True)
            feats = checkpoint(lambda t: F.dropout(body(t), 0.2), x, use_reentrant=False)
            head(feats.detach()).sum().backward()  # feats' own backward never runs
            opt.step()
            opt.zero_grad()
    level = mode.report.meta["level"]
    assert level["postponed_switches"] > 0, level
    ran = {step for step, on in enumerate(on_stack, 1) if on}
    assert _op_steps(level["op_level"]) == ran, (level["op_level"], sorted(ran))
    assert len(ran) >= 4, sorted(ran)  # step 1 and one in 4 after it, each at most one late
    assert mode.report.ok, [f.message for f in mode.report.findings]


def test_a_second_training_stage_with_its_own_optimizer_keeps_counting_steps():
    """A head-only optimizer, then one for the whole model, the first still alive (a scheduler
    holds it): the new optimizer leads once it has stepped 16 times without the old one, so
    steps keep ending and sampled steps keep coming. A critic that steps 5 times per step of
    the first optimizer does not take over (one training step per iteration)."""
    torch.manual_seed(0)
    model = Net()
    first = torch.optim.SGD(model.blocks[1].parameters(), lr=0.01)
    critic = torch.optim.SGD(model.blocks[0].parameters(), lr=0.01)
    stage_two = torch.optim.AdamW(model.parameters(), lr=0.01)
    with rngcheck.RNGConsistencyMode(sample_first=1, sample_every=5, **STEP) as mode:
        for _ in range(4):  # stage one: the first optimizer, then the critic 5 times
            model(torch.randn(4, 8)).backward()
            first.step()
            for _ in range(5):
                critic.step()
        for _ in range(30):  # stage two
            model(torch.randn(4, 8)).backward()
            stage_two.step()
            stage_two.zero_grad()
    level = mode.report.meta["level"]
    # 4 iterations of stage one; stage two's first 15 steps belong to the step running when
    # its optimizer took over at its 16th, then one step each.
    assert level["steps"] == 4 + 15, level
    assert level["op_level"] == ["1", "5", "10", "15"], level
    assert mode.report.ok, [f.message for f in mode.report.findings]


_hf = None


def _load_hf() -> Any:
    return pytest.importorskip("_hf", reason="needs transformers (requirements-models.txt)")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_hugging_face_training_at_the_step_level(family, reentrant):
    hf = _load_hf()
    torch.manual_seed(0)
    model = hf.build(family)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    with rngcheck.RNGConsistencyMode(sample_every=4, **STEP) as mode:
        hf.train(model, family, steps=6)
    assert mode.report.ok and not mode.report.notes, [f.message for f in mode.report.findings]
    probe = mode.report.meta["level"]["checkpoint_probe"]
    if reentrant:  # the layers' dropout: their end states compared between samples
        assert probe["regions"] and probe["compared"], probe
    else:  # the CPU default restored, early stop: left to torch between samples
        assert probe["restored_and_stopped_early"] and not probe["compared"], probe
    # The same model with preserve_rng_state=False: found at step 1 (op by op), found again by
    # the probe at step 3, escalated once (step 4 names it again) and counted on the one
    # finding at every step.
    torch.manual_seed(0)
    model = hf.build(family)
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": reentrant, "preserve_rng_state": False}
    )
    with rngcheck.RNGConsistencyMode(sample_every=1000, **STEP) as mode:
        hf.train(model, family, steps=6)
    (found,) = mode.report.findings
    assert found.op == "aten.bernoulli_.float" and (found.first_step, found.last_step) == (1, 6)
    assert not found.found_by  # found op by op first
    assert mode.report.meta["level"]["op_level"] == ["1-2", "4"]  # one escalation, at step 3


# -- across ranks (2 gloo ranks: scenarios run in one launch) -----------------------------------


def _dist_mode(**kwargs: Any) -> Any:
    return scenario_mode(timeout=20, **STEP, **kwargs)


def _summary(mode: Any) -> dict[str, Any]:
    report = mode.report
    return {
        "findings": [
            {
                "kind": f.kind.value,
                "op": f.op,
                "site": f.site,
                "first_step": f.first_step,
                "seq": f.seq,
                "message": f.message,
            }
            for f in report.findings
        ],
        "notes": [n.kind for n in report.notes],
        "level": report.meta.get("level", {}),
        "recompute": report.meta.get("recompute", {}),
        "compared": compared(report),
    }


def ddp_dropout_variable_lengths(rank: int, world: int) -> dict[str, Any]:
    """Correct data parallelism whose ranks draw per-rank amounts (their batches differ in length,
    dropout draws per element): never a finding, and no escalation at every step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    with _dist_mode(sample_every=5) as mode:
        model = DDP(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Linear(8, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
        for step in range(10):
            x = torch.randn(8, 8, generator=data)[: 4 + rank + step % 2]  # lengths differ
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    return _summary(mode)


def _replicated_extra_draw(rank: int, from_step: int, steps: int = 36) -> dict[str, Any]:
    """Replicated training (gradients averaged by hand): from ``from_step`` rank 1 draws one extra
    number every step. Between samples the generator digests drift apart."""
    import torch.distributed as dist

    torch.manual_seed(0)
    line = 0
    with _dist_mode(sample_every=1000) as mode:
        model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(1, steps + 1):
            model(torch.ones(4, 8)).sum().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            if step >= from_step and rank == 1:
                line = sys._getframe().f_lineno + 1
                torch.rand(1)  # one rank draws one extra number, every step from from_step
            opt.step()
            opt.zero_grad()
    return {**_summary(mode), "line": line}


def replicated_extra_draw_from_step_6(rank: int, world: int) -> dict[str, Any]:
    """The rank finding names the op and line op by op at the step after the round holding step
    6 settles."""
    return _replicated_extra_draw(rank, from_step=6)


def _line_in_the_default_generators_slot(file: str) -> int:
    """A line of ``file`` whose first use of a CPU generator puts it in the step digests' slot
    of the default CPU generator (generators share slots by the hash of their name)."""
    from rngcheck.core.generators import GeneratorId
    from rngcheck.ranks.step_digest import slot_of

    default = slot_of(GeneratorId(kind="default", device="cpu"))
    return next(
        n
        for n in range(1, 1000)
        if slot_of(GeneratorId(kind="user", device="cpu", number=1, origin=f"{file}:{n}"))
        == default
    )


def ddp_per_rank_data_then_extra_draw_from_step_6(rank: int, world: int) -> dict[str, Any]:
    """DDP over a model with dropout, each rank's batches from its own generator (seed + rank:
    a per-rank stream), and from step 6 rank 1 draws one extra number from the default
    generator every step, so the default generators drift apart. The data generator is first
    used at a line that puts it in the default generator's slot: a per-rank stream left in the
    digests hid that drift (the slot never agreed), and the run was silent."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    file = "per_rank_data.py"
    at = _line_in_the_default_generators_slot(file)
    first_use = compile("\n" * (at - 1) + "x = torch.randn(4, 8, generator=data)", file, "exec")
    torch.manual_seed(0)
    line = 0
    with _dist_mode(sample_every=1000) as mode:
        model = DDP(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Linear(8, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        data = torch.Generator().manual_seed(100 + rank)
        for step in range(1, 37):
            scope = {"torch": torch, "data": data}
            exec(first_use, scope)  # (the same line every step)
            model(scope["x"]).sum().backward()
            if step >= 6 and rank == 1:
                line = sys._getframe().f_lineno + 1
                torch.rand(1)  # one rank draws one extra number, every step from step 6
            opt.step()
            opt.zero_grad()
    return {**_summary(mode), "line": line}


def gan_on_two_ranks(rank: int, world: int) -> dict[str, Any]:
    """A GAN's iterations, replicated on each rank: level switches are not held back across
    ranks, so a generator recompute on the other side of a switch is unpaired, never a finding,
    and every rank posts the same collectives."""
    report = _gan(
        False, False, critic_steps=1, make_mode=_dist_mode, sample_first=1, sample_every=3
    )
    return {
        "ok": report.ok,
        "recompute": report.meta["recompute"],
        "level": report.meta["level"],
        "compared": compared(report),
    }


def replicated_extra_draw_in_the_last_round(rank: int, world: int) -> dict[str, Any]:
    """The drift starts in the steps the mode's end sends: said in a note, never dropped."""
    return _replicated_extra_draw(rank, from_step=34)


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from _dist import run_scenarios

    names = [
        "ddp_dropout_variable_lengths",
        "replicated_extra_draw_from_step_6",
        "replicated_extra_draw_in_the_last_round",
        "ddp_per_rank_data_then_extra_draw_from_step_6",
        "gan_on_two_ranks",
    ]
    return run_scenarios(_HERE, names, world_size=2, out_dir=tmp_path_factory.mktemp("two"))


@pytest.mark.slow
def test_per_rank_amounts_under_ddp_stay_quiet_at_the_step_level(two: Any) -> None:
    for rank, r in two["ddp_dropout_variable_lengths"].items():
        assert "error" not in r, r.get("traceback")
        assert r["findings"] == [] and "step_level_drift" not in r["notes"], (rank, r)
        assert r["level"]["op_level"] == ["1-2", "5", "10"] and r["level"]["escalations"] == 0
        # Op by op (the sampled steps): DDP's broadcast of the model's 4 initialisations, its 4
        # parameters compared by digest at each of the 4 sampled steps, and its dropout there,
        # each rank's own. Nothing replicated is drawn: the batches come from a per-rank stream
        # (its 4 draws at the sampled steps; the step digests leave it out). The step digests'
        # closing round, at the end.
        exempted = {"own_batch": 4, "per_rank_seed": 4}
        assert_compared(
            r["compared"],
            rank,
            initialisations_broadcast=4,
            replicated_parameters=16,
            step_rounds=1,
            not_compared=exempted,
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "scenario",
    [
        "replicated_extra_draw_from_step_6",
        # A per-rank stream does not hide a drift that shares its digest slot.
        "ddp_per_rank_data_then_extra_draw_from_step_6",
    ],
)
def test_a_recurring_rank_drift_between_samples_is_escalated_and_located(
    two: Any, scenario: str
) -> None:
    results = two[scenario]
    line = results[1]["line"]
    for r in results.values():
        assert "error" not in r, r.get("traceback")
        (finding,) = r["findings"]
        assert finding["kind"] == "rank_divergence" and finding["op"] == "aten.rand.default"
        assert finding["site"] == f"test_step_level.py:{line}", finding
        assert r["level"]["drifted_at_steps"] == [6]
        # Drift from step 6, in the round of steps 1-32 (settled at step 33's hook): step 34 ran
        # op by op and located it.
        assert r["level"]["op_level"] == ["1-2", "34"] and finding["first_step"] == 34, r
        assert "step_level_drift" in r["notes"]


@pytest.mark.slow
def test_a_rank_drift_in_the_last_steps_is_a_note_not_silence(two: Any) -> None:
    for rank, r in two["replicated_extra_draw_in_the_last_round"].items():
        assert "error" not in r, r.get("traceback")
        assert r["findings"] == [] and r["level"]["op_level"] == ["1-2"], r
        # The round of steps 1-32 was compared (quiet: the drift starts at step 34), and the
        # dropout of the 2 sampled steps by state, the 4 initialisations at the first step.
        assert_compared(
            r["compared"], rank, by_state=2, initialisations=4, step_rounds=1, not_compared={}
        )
        assert r["notes"].count("step_level_drift") == 1, r["notes"]


@pytest.mark.slow
def test_a_gan_on_two_ranks_leaves_split_recomputes_unpaired(two: Any) -> None:
    for rank, r in two["gan_on_two_ranks"].items():
        assert "error" not in r, r.get("traceback")
        assert r["ok"] and r["level"]["postponed_switches"] == 0, r
        # The replicated GAN's draws at its sampled steps, by state: nothing is exempted.
        assert_compared(r["compared"], rank, by_state=1, not_compared={})
        assert 0 < r["recompute"]["unpaired"] < r["recompute"]["recomputes"] == 9, r
