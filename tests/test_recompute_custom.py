"""Custom checkpoint functions marked with rngcheck.checkpoint_region: a hand-written
torch.autograd.Function that forgets to restore the RNG is found; one that restores is quiet."""

from __future__ import annotations

from pathlib import Path

import _recompute_util
import pytest
import torch
import torch.nn.functional as F
from _recompute_util import CPURNGStatesTracker, assert_recompute_finding, run, short
from torch import nn

import rngcheck


class HandCheckpoint(torch.autograd.Function):
    """A hand-written checkpoint in the shape of Megatron's CheckpointFunction.

    ``restore`` says what it restores before the recompute: ``"cpu"`` (the default CPU
    generator), ``"cpu+gen"`` (that and ``gen``), ``"cpu+tracker"`` (that and a tracker's
    streams) or ``""`` (nothing: the bug).
    """

    @staticmethod
    def forward(ctx, run_function, restore, extra, *args):
        ctx.run_function, ctx.restore, ctx.extra = run_function, restore, extra
        ctx.cpu_state = torch.get_rng_state()
        if restore == "cpu+gen":
            ctx.gen_state = extra.get_state()
        if restore == "cpu+tracker":
            ctx.tracker_states = dict(extra.states)
        ctx.rng_region = rngcheck.checkpoint_region("hand-written layer")
        with torch.no_grad(), ctx.rng_region.forward():
            outputs = run_function(*args)
        ctx.save_for_backward(*args)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.random.fork_rng(devices=[]):
            if ctx.restore.startswith("cpu"):
                torch.set_rng_state(ctx.cpu_state)
            if ctx.restore == "cpu+gen":
                ctx.extra.set_state(ctx.gen_state)
            if ctx.restore == "cpu+tracker":
                ctx.extra.states.update(ctx.tracker_states)
            with torch.enable_grad(), ctx.rng_region.recompute():
                outputs = ctx.run_function(*inputs)
        torch.autograd.backward(outputs, grads)
        return (None, None, None, *(t.grad for t in inputs))


def _input() -> torch.Tensor:
    return torch.randn(4, 16, requires_grad=True)


def _dropout_block(lin: nn.Module):
    def block(x):
        return F.dropout(lin(x), 0.2)  # <- custom dropout

    return block


def test_custom_checkpoint_that_forgets_to_restore_is_found():
    block = _dropout_block(nn.Linear(16, 16))

    def step():
        HandCheckpoint.apply(block, "", None, _input()).sum().backward()

    finding = assert_recompute_finding(
        run(step),
        op="aten.bernoulli_.float",
        differs="state",
        at="custom dropout",
        cause=["the custom checkpoint did not restore default cpu", "set_state()"],
    )
    assert finding.region.startswith("hand-written layer (custom) at ")


def test_custom_checkpoint_that_restores_is_quiet():
    block = _dropout_block(nn.Linear(16, 16))

    def train():
        for _ in range(3):
            y = HandCheckpoint.apply(block, "cpu", None, _input())
            torch.rand(5)  # randomness between forward and backward
            y.sum().backward()

    report = run(train)
    assert report.ok, [f.message for f in report.findings]
    assert report.random_ops >= 3 * 2 + 3


def test_custom_checkpoint_with_a_user_generator_it_does_not_restore():
    lin = nn.Linear(16, 16)
    gen = torch.Generator().manual_seed(11)

    def block(x):
        return lin(x) * (torch.rand(x.shape, generator=gen) > 0.5)  # <- custom gen

    def step(restore):
        HandCheckpoint.apply(block, restore, gen, _input()).sum().backward()

    assert_recompute_finding(
        run(lambda: step("cpu")),
        op="aten.rand.generator",
        differs="state",
        at="custom gen",
        cause=["was passed as generator= and the custom checkpoint did not restore its state"],
    )
    assert run(lambda: step("cpu+gen")).ok


def test_custom_checkpoint_that_restores_the_cpu_generator_but_not_the_tracker():
    lin = nn.Linear(16, 16)
    tracker = CPURNGStatesTracker()
    tracker.add("model-parallel-rng", 99)

    def block(x):
        with tracker.fork():
            return F.dropout(lin(x), 0.1)  # <- custom tracker dropout

    def step(restore):
        HandCheckpoint.apply(block, restore, tracker, _input()).sum().backward()

    assert_recompute_finding(
        run(lambda: step("cpu")),
        op="aten.bernoulli_.float",
        differs="state",
        at="custom tracker dropout",
        cause=["named RNG stream", short("tracker swap in", _recompute_util.__file__)],
    )
    assert run(lambda: step("cpu+tracker")).ok


def test_region_marked_restores_rng_false_says_so():
    lin = nn.Linear(16, 16)

    def forward_and_recompute():
        region = rngcheck.checkpoint_region("no-restore layer", restores_rng=False)
        x = _input()
        for pass_ in (region.forward, region.recompute):
            with pass_():
                F.dropout(lin(x), 0.5)  # <- both passes

    finding = assert_recompute_finding(
        run(forward_and_recompute),
        op="aten.bernoulli_.float",
        differs="state",
        at="both passes",
        cause=["marked restores_rng=False"],
    )
    assert finding.region.startswith("no-restore layer (custom)")


def test_checkpoint_region_outside_a_mode_does_nothing():
    region = rngcheck.checkpoint_region("layer")
    with region.forward():
        a = torch.rand(3)
    with region.recompute():
        b = torch.rand(3)
    assert not torch.equal(a, b)  # plain torch, no checker involved


def test_recompute_without_forward_is_ignored():
    def step():
        region = rngcheck.checkpoint_region("layer")
        with region.recompute():
            torch.rand(3)

    assert run(step).ok


def test_checkpoint_region_name_must_be_a_string():
    with pytest.raises(TypeError, match="name must be a str"):
        rngcheck.checkpoint_region(3)  # type: ignore[arg-type]


def test_a_region_may_recompute_in_each_of_several_backwards():
    block = _dropout_block(nn.Linear(16, 16))

    def step():
        y = HandCheckpoint.apply(block, "cpu", None, _input())
        y.sum().backward(retain_graph=True)
        y.sum().backward()

    assert run(step).ok


def _readme_checkpoint_function(drop_line: str = "") -> type:
    """The Megatron-style CheckpointFunction of the docs' recompute page, executed as
    written (minus ``drop_line``), with a CPU tracker behind ``get_rng_tracker()``."""
    readme = Path(__file__).resolve().parent.parent / "docs" / "recompute.md"
    text = readme.read_text(encoding="utf-8")
    section = text[text.index("### Custom checkpoint functions") :]
    code = section[section.index("```python") + len("```python") : section.index("```\n\n")]
    if drop_line:
        assert drop_line in code
        code = "\n".join(line for line in code.splitlines() if drop_line not in line)
    tracker = CPURNGStatesTracker()
    tracker.add("model-parallel-rng", 2024)
    namespace = {"torch": torch, "rngcheck": rngcheck, "get_rng_tracker": lambda: tracker}
    exec(compile(code, str(readme), "exec"), namespace)
    function = namespace["CheckpointFunction"]
    function.tracker = tracker
    return function


@pytest.mark.parametrize("forget_tracker", [False, True])
def test_the_readme_custom_checkpoint_example(forget_tracker):
    function = _readme_checkpoint_function("set_states" if forget_tracker else "")
    lin = nn.Linear(16, 16)

    def block(x):
        with function.tracker.fork():
            return F.dropout(lin(x), 0.1)

    report = run(lambda: function.apply(block, _input()).sum().backward())
    if not forget_tracker:
        assert report.ok, [f.cause for f in report.findings]
        return
    [finding] = report.findings
    assert finding.region.startswith("transformer layer (custom)")
    assert finding.differs == "state" and "named RNG stream" in finding.cause
