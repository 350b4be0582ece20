"""Real third-party models: Hugging Face transformers built from tiny configs, trained for a few
steps under Hugging Face's own gradient checkpointing. Correct training gives no finding; the bugs
users actually hit (preserve_rng_state=False, a user generator inside a layer, a dropout schedule
that changes p before backward) are found, pointing at the model file's line on both sides. The
same training compiled whole with torch.compile is quiet where the compiler replays each region's
randomness and found where it does not."""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch._inductor.config as inductor_config
from _recompute_util import marked_line
from torch import nn

import rngcheck
from rngcheck.recompute import torch_hooks

_hf = pytest.importorskip("_hf", reason="needs transformers (requirements-test.txt)")

pytestmark = [
    pytest.mark.slow,
    # transformers 5.24 renamed gradient_checkpointing_enable (the name users know, tested here)
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated"),
]

REENTRANT = pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
ATTN = pytest.mark.parametrize("attn", ["eager", "sdpa"])


def _checkpointed(family: str, reentrant: bool, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    model = _hf.build(family, **kwargs)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


@pytest.mark.parametrize("family", list(_hf.FAMILIES))
@pytest.mark.parametrize("dropout", [0.1, 0.0], ids=["dropout", "no-dropout"])
@ATTN
@REENTRANT
def test_correct_training_is_quiet(family, dropout, attn, reentrant):
    model = _checkpointed(family, reentrant, dropout=dropout, attn=attn)
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        _hf.train(model, family, steps=2)
    report = mode.report
    assert report.ok, [f"{f.message} / {f.cause}" for f in report.findings]
    assert not report.notes, [n.message for n in report.notes]
    if dropout:
        # Not quiet by accident: random ops ran inside checkpointed layers and were recomputed.
        assert {e.phase.value for e in mode.events} >= {"forward", "recompute"}
        assert {e.region for e in mode.events} - {""}


@pytest.mark.skipif(
    not hasattr(_hf.transformers.PreTrainedModel, "activation_checkpointing_enable"),
    reason="transformers before 5.24 has no activation_checkpointing_enable",
)
@pytest.mark.parametrize("family", list(_hf.FAMILIES))
def test_the_newer_activation_checkpointing_api_is_quiet_too(family):
    torch.manual_seed(0)
    model = _hf.build(family)
    model.activation_checkpointing_enable(every_n_layers=2)
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        _hf.train(model, family, steps=2)
    assert mode.report.ok and not mode.report.notes
    assert {e.phase.value for e in mode.events} >= {"forward", "recompute"}


@pytest.mark.parametrize("family", ["gpt2", "bert"])
@ATTN
@REENTRANT
def test_preserve_rng_state_false_is_found_in_the_model_file(family, attn, reentrant):
    torch.manual_seed(0)
    model = _hf.build(family, attn=attn)
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": reentrant, "preserve_rng_state": False}
    )
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        _hf.train(model, family, steps=1)
    finding = mode.report.findings[0]
    assert finding.kind is rngcheck.FindingKind.RECOMPUTE_MISMATCH
    assert finding.differs == "state"
    assert "preserve_rng_state=False" in finding.cause
    _assert_model_lines(finding, f"modeling_{family}.py")


@pytest.mark.parametrize(
    ("family", "layer"),
    [("llama", "model.layers.1 (LlamaDecoderLayer)"), ("gpt2", "transformer.h.1 (GPT2Block)")],
)
@REENTRANT
def test_a_bug_in_every_layer_and_step_is_one_finding_naming_the_layer(family, layer, reentrant):
    torch.manual_seed(0)
    model = _hf.build(family)
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": reentrant, "preserve_rng_state": False}
    )
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        _hf.train(model, family, steps=4)
    # Every layer shares one call line of HF's checkpoint wrapper: the layer is named by the
    # module it runs. Backward recomputes the last layer first, where the first mismatch is.
    # The same dropout line in both layers at all 4 steps: one finding, seen 8 times.
    (finding,) = mode.report.findings
    assert finding.op == "aten.bernoulli_.float"
    assert finding.region.startswith("checkpoint #2 ") and f" of {layer} at " in finding.region
    assert (finding.count, finding.first_step, finding.last_step) == (8, 1, 4)


def test_a_layer_wrapped_by_torchs_checkpoint_wrapper_is_named_as_the_model_names_it():
    """torch's apply_activation_checkpointing (FSDP's recipe) holds each layer as
    ``_checkpoint_wrapped_module``; the finding names the layer as the user's model does."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    torch.manual_seed(0)
    model = _hf.build("llama")
    layer_type = type(model.model.layers[0])
    wrap = functools.partial(
        checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False
    )
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=wrap, check_fn=lambda m: isinstance(m, layer_type)
    )
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        _hf.train(model, "llama", steps=1)
    (finding,) = mode.report.findings
    assert " of model.layers.1 (LlamaDecoderLayer) at " in finding.region, finding.region
    assert "preserve_rng_state=False" in finding.cause


@pytest.mark.parametrize("family", ["gpt2", "bert"])
@ATTN
@REENTRANT
def test_a_dropout_schedule_that_changes_p_before_backward(family, attn, reentrant):
    model = _checkpointed(family, reentrant, attn=attn)
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        loss = model(**_hf.batch(family)).loss
        for module in model.modules():  # the schedule steps between forward and backward
            if isinstance(module, nn.Dropout):
                module.p = 0.3
        loss.backward()
    finding = mode.report.findings[0]
    assert finding.differs == "argument"
    assert "p=0.9 (forward) vs p=0.7 (recompute)" in finding.message
    _assert_model_lines(finding, f"modeling_{family}.py")


class NoisyDropout(nn.Module):
    """A user's layer with its own generator, for reproducible noise: checkpoint does not stash
    user generators, so its recompute draws the next numbers instead of the same ones."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (torch.rand(x.shape, generator=self.gen) > 0.1)  # <- noisy layer


@REENTRANT
def test_a_user_generator_inside_a_layer(reentrant):
    model = _checkpointed("gpt2", reentrant)
    model.transformer.h[1].mlp.dropout = NoisyDropout()
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        _hf.train(model, "gpt2", steps=1)
    finding = mode.report.findings[0]
    assert finding.differs == "state" and finding.op == "aten.rand.generator"
    file, line = marked_line("noisy layer")
    for side in finding.sides:
        assert side.event is not None and side.event.site == f"{os.path.basename(file)}:{line}"
    assert "was passed as generator=" in finding.cause
    # The layer's call comes from the model's own file on both sides.
    _assert_model_lines(finding, "modeling_gpt2.py", innermost=False)


def _assert_model_lines(finding, model_file: str, innermost: bool = True) -> None:
    """Both sides point into the model's code: the innermost user frame is transformers' own (the
    model file, or its attention integration), and the model file is on each side's stack."""
    for side in finding.sides:
        assert side.event is not None, side
        frames = side.event.stack.user_frames
        assert any(os.path.basename(f.filename) == model_file for f in frames), (
            side.label,
            [f.short_location for f in frames],
        )
        if innermost:
            assert f"{os.sep}transformers{os.sep}" in frames[-1].filename, frames[-1]


def _compiled_training(backend: str, checked: bool) -> tuple[list[torch.Tensor], Any]:
    """Three SGD steps of a checkpointed GPT-2 compiled whole with ``backend``: its losses and
    parameters, and the report when ``checked``."""
    model = _checkpointed("gpt2", reentrant=False)
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mode = rngcheck.RNGConsistencyMode(on_finding="record") if checked else nullcontext()
    losses = []
    with mode:
        for _ in range(3):
            loss = compiled(**_hf.batch("gpt2")).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    torch._dynamo.reset()
    out = losses + [p.detach() for p in model.parameters()]
    return out, mode.report if checked else None


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")  # inductor's
@pytest.mark.parametrize("backend", ["inductor", "aot_eager", "eager"])
def test_compiled_training_with_gradient_checkpointing(backend):
    """GPT-2 under Hugging Face's gradient checkpointing, compiled whole. Inductor and aot_eager
    replay each region's randomness: quiet. The eager backend recomputes every region's dropout
    afresh (torch.compile's checkpoint operator runs it with preserve_rng_state=False): found,
    with that cause. Bitwise the same results with and without the checker either way."""
    with inductor_config.patch(fx_graph_cache=False):
        plain, _ = _compiled_training(backend, checked=False)
        checked, report = _compiled_training(backend, checked=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, checked, strict=True))
    assert report.random_ops > 0
    if backend != "eager" or torch_hooks.TORCH_VERSION < (2, 13):
        assert report.ok, [f.message for f in report.findings]
        return
    assert report.findings and all(
        f.kind is rngcheck.FindingKind.RECOMPUTE_MISMATCH for f in report.findings
    )
    assert all("tag_activation_checkpoint" in f.cause for f in report.findings)
