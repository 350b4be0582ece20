"""torch.compile under rngcheck: compiled code stays compiled (bitwise the same results, no
recompilation), its random draws are checked (inductor's seed draws on the CPU), a compiled
backward that redraws a recomputed random op is found (pytorch issue 190758), and checkpoint and
compile nest either way. Real compilation with the inductor backend on the CPU."""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from _recompute_util import marked_line, run
from torch import nn
from torch.utils.checkpoint import checkpoint

import rngcheck
from rngcheck.recompute import torch_hooks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),  # inductor's
    # Each test compiles its own graph afresh: inductor's graph cache would hand a graph the
    # source lines of an identical graph compiled by another test.
    pytest.mark.usefixtures("_no_graph_cache"),
]

_HERE = __file__


@pytest.fixture
def _no_graph_cache():
    with inductor_config.patch(fx_graph_cache=False):
        yield
    torch._dynamo.reset()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return F.dropout(self.lin(x), 0.3).sum()  # <- compiled dropout


def _steps(fn, steps: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Seeded steps of ``fn``: its outputs and the input gradients."""
    outs, grads = [], []
    for i in range(steps):
        torch.manual_seed(i)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(i), requires_grad=True)
        y = fn(x)
        y.backward()
        outs.append(y.detach())
        grads.append(x.grad)
    return outs, grads


def test_compiled_code_stays_compiled_and_gives_the_same_bits():
    net = Net()
    compiled = torch.compile(net)
    plain = _steps(compiled)
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        checked = _steps(compiled)
    for a, b in zip(plain[0] + plain[1], checked[0] + checked[1], strict=True):
        assert torch.equal(a, b)
    # Inductor's random numbers are not eager's: a fallback to eager would show.
    eager = _steps(net)
    assert not torch.equal(eager[0][0], checked[0][0])
    assert mode.report.ok
    assert mode.report.meta["compiled"] == {"forward_draws": 2, "backward_draws": 0}
    file, line = marked_line("compiled dropout")
    draws = [e for e in mode.events if e.compiled]
    assert [e.compiled for e in draws] == ["compiled forward"] * 2
    assert all(e.site == f"{os.path.basename(file)}:{line}" for e in draws), [e.site for e in draws]


def test_entering_the_mode_compiles_at_most_once_more():
    """The dispatch-mode route leaves compiled code as it was. The selective route's key is in
    the thread's dispatch keys, which Dynamo guards on: code compiled before the mode is entered
    compiles once more, and that compile serves every later block (the step level's switches
    leave the key in place)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(Net(), backend=counter)
    _steps(compiled, 1)
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        _steps(compiled, 2)
    with rngcheck.RNGConsistencyMode(on_finding="record", level="step", sample_first=1):
        _steps(compiled, 3)
    _steps(compiled, 1)
    assert counter.frame_count == (1 if mode.report.meta["route"] == "dispatch_mode" else 2)


def test_a_compiled_backward_that_redraws_dropout_is_found():
    """pytorch issue 190758: with a memory budget below 1 the partitioner recomputes the dropout
    in the compiled backward, which draws new seeds: the gradients belong to another mask."""
    compiled = torch.compile(Net())
    with functorch_config.patch(activation_memory_budget=0.0):
        report = run(lambda: _steps(compiled, 2))
    assert len(report.findings) == 1, [f.message for f in report.findings]
    f = report.findings[0]
    assert f.kind is rngcheck.FindingKind.RECOMPUTE_MISMATCH and f.differs == "state"
    assert "compiled backward" in f.region
    assert "activation_memory_budget is 0" in f.cause and "pytorch issue 190758" in f.cause
    file, line = marked_line("compiled dropout")
    site = f"{os.path.basename(file)}:{line}"
    assert [s.event.site for s in f.sides] == [site, site]
    assert [s.event.compiled for s in f.sides] == ["compiled forward", "compiled backward"]


def test_checkpoint_inside_compiled_code_is_quiet():
    lin = nn.Linear(16, 16)

    def block(x):
        return F.dropout(lin(x), 0.3)

    compiled = torch.compile(lambda x: checkpoint(block, x, use_reentrant=False).sum())
    report = run(lambda: _steps(compiled, 2))
    assert report.ok, [f.message for f in report.findings]
    assert report.meta["compiled"]["forward_draws"] == 2
    assert not report.notes


def _checkpointed_dropout() -> tuple[nn.Module, Any]:
    lin = nn.Linear(16, 16)

    def block(x):
        return F.dropout(lin(x), 0.3)

    return lin, lambda x: checkpoint(block, x, use_reentrant=False).sum()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_checkpoint_that_nothing_replays_is_found_and_named(backend):
    """torch.compile runs torch.utils.checkpoint as its checkpoint operator, always with
    preserve_rng_state=False, and leaves replaying the region's randomness to AOT autograd. A
    backend without it (backend="eager") recomputes a new dropout mask: the gradients are not the
    uncompiled ones (pytorch issue 160773; torch 2.9 skipped such a recompute altogether). Found
    exactly when they differ, with that cause, not "use preserve_rng_state=True", which the user
    never set. aot_eager replays the forward's mask and is quiet."""
    torch.manual_seed(0)
    _, fn = _checkpointed_dropout()
    uncompiled = _steps(fn)
    compiled = torch.compile(fn, backend=backend)
    plain = _steps(compiled)
    checked: list[Any] = []
    report = run(lambda: checked.append(_steps(compiled)))
    for a, b in zip(plain[0] + plain[1], checked[0][0] + checked[0][1], strict=True):
        assert torch.equal(a, b)  # the checker changes no result
    assert all(torch.equal(a, b) for a, b in zip(uncompiled[0], plain[0], strict=True))
    redrawn = not all(torch.equal(a, b) for a, b in zip(uncompiled[1], plain[1], strict=True))
    if torch_hooks.TORCH_VERSION >= (2, 13):  # the torches this was measured on
        assert redrawn is (backend == "eager")
    if not redrawn:
        assert report.ok, [f.message for f in report.findings]
        return
    (f,) = report.findings
    assert f.kind is rngcheck.FindingKind.RECOMPUTE_MISMATCH and f.differs == "state"
    assert f.count == 2  # each step's region recomputes a new mask
    assert "tag_activation_checkpoint" in f.cause and 'backend="eager"' in f.cause
    assert "pytorch issue 160773" in f.cause and "Use preserve_rng_state=True" not in f.cause
    assert [s.event.op for s in f.sides] == ["aten.bernoulli_.float"] * 2


def test_a_compiled_checkpoint_that_nothing_replays_is_named_between_sampled_steps():
    """The step level finds it by generator states between sampled steps, then names it op by op
    at the next step, with the same cause: one finding."""
    torch.manual_seed(0)
    lin, fn = _checkpointed_dropout()
    compiled = torch.compile(fn, backend="eager")
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    with rngcheck.RNGConsistencyMode(
        level="step", sample_first=1, sample_every=1000, on_finding="record"
    ) as mode:
        for step in range(4):
            x = torch.randn(4, 16, requires_grad=True)
            # The first step, checked op by op, runs no checkpoint.
            (compiled(x) if step else lin(x).sum()).backward()
            opt.step()
    # One finding: found at step 2 by generator states, named op by op at step 3.
    (located,) = mode.report.findings
    assert located.op == "aten.bernoulli_.float" and "tag_activation_checkpoint" in located.cause
    assert "160773" in located.cause and located.first_step == 2, located.first_step
    assert located.found_by.startswith("between sampled steps at step 2, by generator states (")
    assert located.found_by.endswith("named op by op at step 3"), located.found_by


def _dropout_sum(x):
    return F.dropout(x * 2, 0.5).sum()


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_compiled_graph_goes_when_its_function_goes(backend):
    """TorchDynamo deletes a compiled graph from its module when the transformed code dies. The
    mode's random ops walked that code's frames; a cache of rngcheck's that kept the code alive
    kept every graph compiled under the mode until exit (and on torch 2.14 its cleanup then
    raised in a weakref callback at interpreter shutdown)."""

    def graphs() -> set[str]:
        return {k for k in globals() if k.startswith("__compiled_fn")}

    before = graphs()
    compiled = torch.compile(_dropout_sum, backend=backend)
    x = torch.randn(8, requires_grad=True)
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        compiled(x).backward()
    assert mode.report.random_ops >= 1
    made = graphs() - before
    assert made  # compiled here
    del compiled, mode
    torch._dynamo.reset()
    gc.collect()
    assert not graphs() & made


@pytest.mark.parametrize("preserve", [True, False])
def test_compiled_code_inside_checkpoint(preserve):
    compiled = torch.compile(Net())

    def step():
        x = torch.randn(4, 16, requires_grad=True)
        checkpoint(compiled, x, use_reentrant=False, preserve_rng_state=preserve).backward()

    report = run(step)
    if preserve:
        assert report.ok and report.meta["recompute"]["compared_ops"] == 1
        return
    (f,) = report.findings
    assert f.differs == "state" and "preserve_rng_state=False" in f.cause
    file, line = marked_line("compiled dropout")
    assert f.sides[1].event.site == f"{os.path.basename(file)}:{line}"


def test_graph_breaks_and_disabled_regions_run_eagerly_and_are_checked_op_by_op():
    gen = torch.Generator().manual_seed(0)

    @torch.compiler.disable
    def noise(h):
        return h * (torch.rand(h.shape, generator=gen) > 0.5)  # <- eager noise

    lin = nn.Linear(16, 16)
    compiled = torch.compile(lambda x: noise(F.relu(lin(x))).sum())

    def step():
        x = torch.randn(4, 16, requires_grad=True)
        checkpoint(compiled, x, use_reentrant=False).backward()

    (f,) = run(step).findings
    file, line = marked_line("eager noise")
    assert f.op == "aten.rand.generator" and f.site == f"{os.path.basename(file)}:{line}"
    assert "was passed as generator=" in f.cause


# -- two ranks -------------------------------------------------------------------------------------


def _compiled_training(rank: int, seed: int) -> dict[str, Any]:
    import torch.distributed as dist
    from _dist import scenario_mode

    with inductor_config.patch(fx_graph_cache=False):
        torch.manual_seed(0)
        net = Net()
        compiled = torch.compile(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with scenario_mode(timeout=60) as mode:
            for step in range(2):
                torch.manual_seed(seed + step)  # replicated computation: every rank the same...
                compiled(torch.ones(4, 16)).backward()
                for p in net.parameters():
                    dist.all_reduce(p.grad)
                opt.step()
                opt.zero_grad()
        torch._dynamo.reset()
    report = mode.report
    return {
        "findings": [
            {
                "kind": f.kind.value,
                "site": f.site,
                "op": f.op,
                "compiled": f.sides[0].event.compiled,
            }
            for f in report.findings
            if f.sides and f.sides[0].event is not None
        ],
        "count": len(report.findings),
        "compiled": report.meta.get("compiled"),
    }


def clean_compiled(rank: int, world: int) -> dict[str, Any]:
    return _compiled_training(rank, seed=10)


def divergent_compiled(rank: int, world: int) -> dict[str, Any]:
    return _compiled_training(rank, seed=10 + rank)  # ...but rank 1 seeds its own


def test_compiled_dropout_across_two_ranks(tmp_path):
    from _dist import run_scenarios

    run_ = run_scenarios(
        _HERE, ["clean_compiled", "divergent_compiled"], world_size=2, out_dir=tmp_path, timeout=300
    )
    for rank, r in run_["clean_compiled"].items():
        assert "error" not in r, r.get("traceback")
        assert r["count"] == 0 and r["compiled"]["forward_draws"] == 2, (rank, r)
    file, line = marked_line("compiled dropout")
    for rank, r in run_["divergent_compiled"].items():
        assert "error" not in r, r.get("traceback")
        assert r["count"] == 1, (rank, r)
        (f,) = r["findings"]
        assert f["kind"] == "rank_divergence" and f["op"] == "compiled_graph.forward"
        assert (
            f["site"] == f"{os.path.basename(file)}:{line}" and f["compiled"] == "compiled forward"
        )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_compiled_dropout_is_checked_and_identical():  # pragma: no cover - CUDA lane
    net = Net().cuda()
    compiled = torch.compile(net)

    def steps():
        outs = []
        for i in range(2):
            torch.manual_seed(i)
            outs.append(compiled(torch.ones(4, 16, device="cuda")))
        return outs

    plain = steps()
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        checked = steps()
    assert all(torch.equal(a, b) for a, b in zip(plain, checked, strict=True))
    assert mode.report.ok
    assert any(e.compiled for e in mode.events), "the compiled graphs' philox draws were not seen"
