"""Every recompute, whoever wrote the checkpoint: hand-written autograd.Function checkpoints (the
diffusion code bases' kind), DeepSpeed's and FairScale's real checkpoint functions. Their
recomputes are recognised without a marker and compared like torch's; randomness that belongs in
backward stays a note."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from _recompute_util import assert_recompute_finding, run
from torch import nn

DROPOUT = "aten.bernoulli_.float"  # what F.dropout runs on CPU


class UnrestoredCheckpoint(torch.autograd.Function):
    """guided-diffusion's checkpoint (issue 167 there): the forward runs the block without a
    graph, the backward runs it again with one. Nothing restores the generator in between."""

    @staticmethod
    def forward(ctx, run_function, *args):
        ctx.run_function = run_function
        ctx.save_for_backward(*args)
        with torch.no_grad():
            return run_function(*args)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_(True) for x in ctx.saved_tensors]
        with torch.enable_grad():
            outputs = ctx.run_function(*inputs)
        torch.autograd.backward(outputs, grads)
        return (None, *[x.grad for x in inputs])


class RestoringCheckpoint(torch.autograd.Function):
    """Megatron's shape: stash the CPU generator's state in the forward, restore it before the
    recompute, and put the backward's own state back afterwards."""

    @staticmethod
    def forward(ctx, run_function, *args):
        ctx.run_function = run_function
        ctx.fwd_cpu_state = torch.get_rng_state()
        ctx.save_for_backward(*args)
        with torch.no_grad():
            return run_function(*args)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_(True) for x in ctx.saved_tensors]
        bwd_cpu_state = torch.get_rng_state()
        torch.set_rng_state(ctx.fwd_cpu_state)
        with torch.enable_grad():
            outputs = ctx.run_function(*inputs)
        torch.set_rng_state(bwd_cpu_state)
        torch.autograd.backward(outputs, grads)
        return (None, *[x.grad for x in inputs])


class Block(nn.Module):
    def __init__(self, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.generator = generator

    def forward(self, x):
        h = F.dropout(self.lin(x), 0.3)  # <- block dropout
        if self.generator is not None:
            h = h * (torch.rand(h.shape, generator=self.generator) > 0.1)  # <- block noise
        return h


def _train(checkpoint_fn, blocks: list[nn.Module], steps: int = 2) -> None:
    opt = torch.optim.SGD([p for b in blocks for p in b.parameters()], lr=0.1)
    for _ in range(steps):
        x = torch.randn(4, 16, requires_grad=True)
        for block in blocks:
            x = checkpoint_fn(block, x)
        x.sum().backward()
        opt.step()
        opt.zero_grad()


def test_a_hand_written_checkpoint_that_restores_nothing_is_found():
    finding = assert_recompute_finding(
        run(lambda: _train(UnrestoredCheckpoint.apply, [Block()], steps=1)),
        op=DROPOUT,
        differs="state",
        at="block dropout",
        cause=[
            "a checkpoint rngcheck does not know re-ran the forward's random ops in backward",
            "UnrestoredCheckpoint.backward (test_recompute_inferred.py:",
            "without restoring default cpu",
            "Stash default cpu's state in the forward",
        ],
    )
    assert "(inferred)" in finding.region and "UnrestoredCheckpoint.backward" in finding.region


def test_layers_sharing_a_line_are_matched_in_reverse_and_found():
    blocks = [Block() for _ in range(3)]
    report = run(lambda: _train(UnrestoredCheckpoint.apply, blocks, steps=1))
    assert report.findings and all(f.op == DROPOUT for f in report.findings)
    assert report.meta["inferred_recompute"]["regions"] == 3


def test_a_restoring_checkpoint_is_quiet_and_was_compared():
    blocks = [Block() for _ in range(3)]  # three layers, one dropout line
    report = run(lambda: _train(RestoringCheckpoint.apply, blocks, steps=3))
    assert report.ok, [f.message for f in report.findings]
    assert not report.notes, [n.message for n in report.notes]
    inferred = report.meta["inferred_recompute"]
    assert inferred["regions"] == 9 and inferred["compared_ops"] == 9


def test_restoring_the_default_generator_does_not_cover_a_user_generator():
    gen = torch.Generator().manual_seed(3)
    assert_recompute_finding(
        run(lambda: _train(RestoringCheckpoint.apply, [Block(gen)], steps=1)),
        op="aten.rand.generator",
        differs="state",
        at="block noise",
        cause=["RestoringCheckpoint.backward", "without restoring Generator #1 (cpu"],
    )


def test_outputs_are_compared_once_a_line_was_seen_recomputed():
    """From the second iteration on, a recomputed line keeps its forward output digest: same
    state but another input (a tensor changed in place before backward) is found."""
    scale = torch.ones(16)
    lin = nn.Linear(16, 16)

    def block(x):
        return torch.bernoulli(torch.sigmoid(lin(x)) * scale)  # <- reads a global

    def step():
        for i in range(2):
            x = torch.randn(4, 16, requires_grad=True)
            y = RestoringCheckpoint.apply(block, x)
            if i == 1:
                scale.mul_(0.5)  # changed between forward and backward
            y.sum().backward()

    report = run(step)
    assert [f.differs for f in report.findings] == ["output"], [f.message for f in report.findings]


class GradientNoise(torch.autograd.Function):
    """Randomness that belongs in backward: noise added to the gradient (the forward draws none)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad + 0.01 * torch.randn(grad.shape)  # <- gradient noise


def test_randomness_that_belongs_in_backward_stays_a_note():
    lin = nn.Linear(16, 16)

    def step():
        x = torch.randn(4, 16, requires_grad=True)
        h = F.dropout(lin(GradientNoise.apply(x)), 0.3)
        h.register_hook(lambda g: g * (torch.rand(g.shape) > 0.01))  # stochastic gradient mask
        h.sum().backward()

    report = run(step)
    assert report.ok, [f.message for f in report.findings]
    notes = [n for n in report.notes if n.kind == "backward_random_ops"]
    assert len(notes) == 2  # the noise line and the hook's line
    assert "inferred_recompute" not in report.meta


def test_a_marked_or_torch_checkpoint_is_reported_by_its_own_region_only():
    """Explicit regions keep precedence: a recompute a known region covers is never reported
    again by an inferred one."""
    gen = torch.Generator().manual_seed(1)
    lin = nn.Linear(16, 16)

    def block(x):
        return lin(x) * (torch.rand(x.shape, generator=gen) > 0.5)

    def step():
        x = torch.randn(4, 16, requires_grad=True)
        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True).sum().backward()

    report = run(step)
    assert len(report.findings) == 1
    assert "(reentrant)" in report.findings[0].region
    assert "inferred_recompute" not in report.meta


# -- real checkpoint functions of other libraries, where they install on CPU -------------------


def test_deepspeed_checkpoint():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = pytest.importorskip("deepspeed.runtime.activation_checkpointing.checkpointing")
    # DeepSpeed's CheckpointFunction restores the CPU generator: its dropout replays (quiet)...
    report = run(lambda: _train(ds.checkpoint, [Block(), Block()], steps=2))
    assert report.ok, [f.message for f in report.findings]
    assert report.meta["inferred_recompute"]["compared_ops"] == 4
    # ...but not a user generator the block draws from: found, naming DeepSpeed's function.
    gen = torch.Generator().manual_seed(2)
    finding = assert_recompute_finding(
        run(lambda: _train(ds.checkpoint, [Block(gen)], steps=1)),
        op="aten.rand.generator",
        differs="state",
        at="block noise",
        cause=["CheckpointFunction.backward (checkpointing.py:", "Generator #1"],
    )
    assert "CheckpointFunction.backward" in finding.region


def test_fairscale_checkpoint_wrapper():
    fairscale = pytest.importorskip("fairscale.nn.checkpoint")
    blocks = [fairscale.checkpoint_wrapper(Block()) for _ in range(2)]
    report = run(lambda: _train(lambda b, x: b(x), blocks, steps=2))
    assert report.ok, [f.message for f in report.findings]
    assert report.meta["inferred_recompute"]["compared_ops"] == 4
    gen = torch.Generator().manual_seed(2)
    wrapped = [fairscale.checkpoint_wrapper(Block(gen))]
    assert_recompute_finding(
        run(lambda: _train(lambda b, x: b(x), wrapped, steps=1)),
        op="aten.rand.generator",
        differs="state",
        at="block noise",
        cause=["CheckpointFunction.backward", "Generator #1"],
    )
