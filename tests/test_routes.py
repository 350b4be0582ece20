"""The two routes by which ops reach the checker (core/dispatch.py, core/selective.py): which ops
the selective route holds kernels for, that both routes record the same events on the same
programs, and how a route is chosen and named. The rest of the suite runs on whichever route
``RNGCHECK_ROUTE`` names (CI runs it on each)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import rngcheck
from rngcheck.core.ops import register_random_op
from rngcheck.core.selective import selective_ops, wanted

ROUTES = ("selective", "dispatch_mode")


def _at_key(op) -> str:
    """What the selective route's key holds for ``op``: "kernel", "fallthrough" or ""."""
    name = op.name()
    if not torch._C._dispatch_has_kernel_for_dispatch_key(name, "PreDispatch"):
        return ""
    fallthrough = torch._C._dispatch_kernel_for_dispatch_key_is_fallthrough(name, "PreDispatch")
    return "fallthrough" if fallthrough else "kernel"


def _has_kernel(op) -> bool:
    return _at_key(op) == "kernel"


def _falls_through(op) -> bool:
    return _at_key(op) == "fallthrough"


def _tagged_ops() -> list:
    """Every op the dispatcher holds that carries the random tag, resolved independently of the
    route's own scan."""
    ops = []
    for full in torch._C._dispatch_get_all_op_names():
        namespace, _, rest = full.partition("::")
        name, _, overload = rest.partition(".")
        try:
            op = getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")
        except (AttributeError, RuntimeError):
            continue
        if torch.Tag.nondeterministic_seeded in op.tags:
            ops.append(op)
    return ops


def test_every_random_op_of_the_tag_list_has_a_kernel_while_the_mode_runs_and_none_after():
    tagged = _tagged_ops()
    assert len(tagged) > 100  # (114 aten overloads and more on torch 2.13)
    composite = [
        op
        for op in tagged
        if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
    ]
    direct = [op for op in tagged if op not in composite]
    assert torch.ops.aten.native_dropout.default in direct
    assert torch.ops.aten.dropout.default in composite  # seen as what it decomposes into
    with rngcheck.RNGConsistencyMode(route="selective", on_finding="record") as mode:
        missing = [str(op) for op in direct if not _has_kernel(op)]
        extra = [str(op) for op in composite if _has_kernel(op)]
        assert torch.ops.c10d.allreduce_.default in selective_ops()  # the exchange's points
        assert _has_kernel(torch.ops.c10d.allreduce_.default)
        # Plain compute never reaches Python, nor torch's boxed fallback for the key.
        for op in (
            torch.ops.aten.mm.default,
            torch.ops.aten.add.Tensor,
            torch.ops.aten.dropout.default,
        ):
            assert not _has_kernel(op) and _falls_through(op), op
    assert mode.report.meta["route"] == "selective"
    assert missing == [] and extra == []
    assert not any(_has_kernel(op) for op in direct)  # removed at exit
    assert not _has_kernel(torch.ops.c10d.allreduce_.default)
    assert not _falls_through(torch.ops.aten.mm.default)


def _jitter_library(name: str) -> tuple[torch.library.Library, object]:
    lib = torch.library.Library(name, "FRAGMENT")  # noqa: TOR901 - test-only op
    lib.define("jitter(Tensor x) -> Tensor")
    lib.impl("jitter", lambda x: x + torch.rand_like(x), "CompositeExplicitAutograd")
    return lib, getattr(torch.ops, name).jitter.default


def test_an_op_registered_as_random_has_a_kernel_before_and_while_the_mode_runs():
    lib_before, before = _jitter_library("rngcheck_route_before")
    lib_during, during = _jitter_library("rngcheck_route_during")
    register_random_op(before)
    try:
        with rngcheck.RNGConsistencyMode(route="selective", on_finding="record") as mode:
            assert _has_kernel(before) and not _has_kernel(during)
            register_random_op(during)
            assert _has_kernel(during)
            before(torch.zeros(3))
            during(torch.zeros(3))
        assert [e.op for e in mode.events] == [
            "rngcheck_route_before.jitter.default",
            "rngcheck_route_during.jitter.default",
        ]
        assert not _has_kernel(before) and not _has_kernel(during)
    finally:
        lib_before._destroy()
        lib_during._destroy()
    assert not wanted(before)  # gone with its library: no kernel asked for at the next scan


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.lin(x).view(2, 2, 4, 4)
        a = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5).reshape(4, 16)
        return self.drop(a) + F.rrelu(x, training=True)


def _program() -> list[torch.Tensor]:
    """A bit of everything random a training step meets: checkpointed regions (non-reentrant,
    reentrant), attention dropout, a user generator, randperm and multinomial, in-place init,
    autocast, no_grad, a compiled function."""
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    nn.init.normal_(model[0].lin.weight, std=0.02)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 16, generator=gen)
    order = torch.randperm(4)
    out = checkpoint(model[0], x[order], use_reentrant=False)
    out = checkpoint(model[1], out, use_reentrant=True)
    out.sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    z = F.alpha_dropout(x, 0.5, training=True)
    with torch.no_grad():
        w = torch.multinomial(torch.ones(8), 3, generator=gen)
    compiled = torch.compile(lambda t: F.dropout(t, 0.5) * 2, backend="eager")
    c = compiled(x)
    return [out, y.float(), z, w, c, model[0].lin.weight.grad]


def _key(event) -> tuple:
    return (event.op, event.generator, event.before, event.after, event.phase, event.region)


def test_both_routes_record_the_same_events_and_change_no_result():
    torch._dynamo.reset()
    plain = _program()
    seen = {}
    for route in ROUTES:
        torch._dynamo.reset()
        with rngcheck.RNGConsistencyMode(route=route, on_finding="record") as mode:
            results = _program()
        assert mode.report.meta["route"] == route
        assert mode.report.ok, [f.message for f in mode.report.findings]
        for a, b in zip(plain, results, strict=True):
            assert torch.equal(a, b)  # bitwise the run without the checker
        seen[route] = [_key(e) for e in mode.events]
        sites = [e.site for e in mode.events]
        assert all("rngcheck" not in s for s in sites), sites
    assert seen["selective"] == seen["dispatch_mode"]
    ops = [key[0] for key in seen["selective"]]
    for op in ("aten.bernoulli_.float", "aten.randperm.default", "aten.multinomial.default"):
        assert op in ops
    assert "aten.rrelu_with_noise.default" in ops and "aten.alpha_dropout.default" not in ops


def test_the_selective_route_sees_the_draws_inside_an_eager_higher_order_operator():
    """torch.cond run eagerly: a dispatch mode is handed the operator and runs it popped, so the
    branch's draw goes unseen; the selective route lets the operator fall through its key and
    sees the draw (found, were it a bug)."""
    seen = {}
    for route in ROUTES:
        with rngcheck.RNGConsistencyMode(route=route, on_finding="record") as mode:
            x = torch.ones(3)
            torch.cond(torch.tensor(True), lambda t: t + torch.rand_like(t), lambda t: t - 1, (x,))
        seen[route] = [e.op for e in mode.events]
    assert seen == {"selective": ["aten.rand_like.default"], "dispatch_mode": []}


def test_under_inference_mode_the_selective_route_names_what_dropout_decomposes_into():
    """Without autograd's keys torch no longer decomposes dropout before the Python key: a
    dispatch mode sees aten.dropout, the selective route still the bernoulli_ it runs (its
    kernel is above autograd either way). The same draw, from the same state."""
    seen = {}
    for route in ROUTES:
        torch.manual_seed(0)
        with (
            rngcheck.RNGConsistencyMode(route=route, on_finding="record") as mode,
            torch.inference_mode(),
        ):
            F.dropout(torch.ones(8), 0.5, training=True)
        seen[route] = [(e.op, e.before, e.after) for e in mode.events]
    ((op, before, after),) = seen["selective"]
    assert op == "aten.bernoulli_.float"
    assert seen["dispatch_mode"] == [("aten.dropout.default", before, after)]


def test_a_random_higher_order_operator_is_checked_on_the_selective_route():
    """What an aot_eager graph with functionalised RNG runs: run_and_save_rng_state draws."""
    from torch._prims.rng_prims import run_and_save_rng_state

    with rngcheck.RNGConsistencyMode(route="selective", on_finding="record") as mode:
        state, out = run_and_save_rng_state(torch.ops.aten.rand.default, [3], device="cpu")
    assert out.shape == (3,)
    assert [e.op for e in mode.events] == ["run_and_save_rng_state"]


def test_the_step_level_leaves_the_key_in_place_between_samples():
    """Dynamo guards on the thread's dispatch keys: switching them at every sampled step would
    compile a compiled function again. Between samples the random ops' kernels go instead."""
    key = torch._C.DispatchKey.PreDispatch
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    included, kernels = [], []
    with rngcheck.RNGConsistencyMode(
        route="selective", level="step", sample_first=1, sample_every=3, on_finding="record"
    ) as mode:
        for _ in range(6):
            # Between samples the random ops' kernels are parked: they cost what they cost
            # without the checker; on sampled steps they are back.
            checking = not mode._interceptor.suspended
            kernels.append(_has_kernel(torch.ops.aten.bernoulli_.float) is checking)
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            included.append(torch._C._dispatch_tls_is_dispatch_key_included(key))
    assert included == [True] * 6
    assert kernels == [True] * 6
    assert not torch._C._dispatch_tls_is_dispatch_key_included(key)
    assert mode.report.meta["level"]["op_level"] == ["1", "3", "6"]  # the others between samples


def test_an_export_inside_the_block_loses_the_key_and_the_next_step_puts_it_back():
    """An export traces at the selective route's key: the other ops' fallthroughs go while it
    runs (the export would fail on them), and torch takes the key out of the include set when
    its tracing ends; the next optimizer step puts both back, and a note says so."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with rngcheck.RNGConsistencyMode(route="selective", on_finding="record") as mode:
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        torch.export.export(nn.Linear(8, 8), (torch.randn(2, 8),))
        model(torch.randn(2, 8)).sum().backward()  # (may go unseen: the note says so)
        opt.step()
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        assert _falls_through(torch.ops.aten.mm.default)  # (left off while the export traced)
    steps = [e.op for e in mode.events if e.op == "aten.bernoulli_.float"]
    assert len(steps) >= 2  # the first step's and the third's
    lost = torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PreDispatch)
    assert not lost
    notes = [n for n in mode.report.notes if n.kind == "route_healed"]
    if len(steps) == 2:  # torch took the key out: found and said
        assert len(notes) == 1 and "step(s) 2" in notes[0].message, notes
    else:
        assert notes == []


def test_auto_takes_the_route_rngcheck_route_names_and_refuses_what_is_not_one():
    code = (
        "import rngcheck, torch\n"
        "with rngcheck.RNGConsistencyMode(on_finding='record') as m:\n"
        "    torch.rand(2)\n"
        "print(m.report.meta['route'], m.report.random_ops)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNGCHECK")}
    for named, taken in (("", "selective"), ("dispatch_mode", "dispatch_mode")):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**env, "RNGCHECK_ROUTE": named},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [taken, "1"]
    bad = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "RNGCHECK_ROUTE": "fast"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0
    assert "RNGCHECK_ROUTE='fast' is not a route; expected one of auto, selective" in bad.stderr


def test_a_route_that_is_not_one_is_refused_by_name():
    with pytest.raises(ValueError, match="route"):
        rngcheck.RNGConsistencyMode(route="fast")
