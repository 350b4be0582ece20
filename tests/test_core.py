"""The single-process core: op table, generator resolution and digests, events, out-of-band
attribution, argument validation, bounded memory and zero perturbation."""

from __future__ import annotations

import gc
import io
import os
import tracemalloc
import weakref

import pytest
import torch
from _recompute_util import marked_line

import rngcheck
from rngcheck.core.generators import GeneratorRegistry, state_digest
from rngcheck.core.ops import OpKind, classify, register_random_op, summarize_args

THIS = os.path.basename(__file__)


def _at(marker: str) -> int:
    """The line number of this file's line ending in ``# <- marker``."""
    return marked_line(marker, __file__)[1]


# -- the op table ---------------------------------------------------------------------------------


def test_tagged_random_ops_are_random_and_others_pass():
    aten = torch.ops.aten
    for op in (
        aten.bernoulli_.float,
        aten.rand.default,
        aten.randn.generator,
        aten.randint.low,
        aten.randperm.default,
        aten.normal_.default,
        aten.uniform_.default,
        aten.multinomial.default,
        aten.native_dropout.default,
        aten.exponential_.default,
    ):
        assert classify(op) is OpKind.RANDOM, op
    for op in (aten.add.Tensor, aten.mm.default, aten.empty.memory_format, aten.copy_.default):
        assert classify(op) is OpKind.PASS, op
    assert classify(torch.ops.c10d.allreduce_.default) is OpKind.COLLECTIVE


def test_every_tagged_overload_is_classified_random():
    tagged = [
        getattr(packet, name)
        for packet in (getattr(torch.ops.aten, n) for n in ("bernoulli", "dropout", "poisson"))
        for name in packet.overloads()
        if torch.Tag.nondeterministic_seeded in getattr(packet, name).tags
    ]
    assert tagged
    assert all(classify(op) is OpKind.RANDOM for op in tagged)


def test_register_random_op_for_a_custom_op_and_refuses_duplicates():
    lib = torch.library.Library("rngcheck_test", "FRAGMENT")  # noqa: TOR901 - test-only op
    lib.define("noise(Tensor x) -> Tensor")

    def noise(x):
        return x + torch.rand_like(x)

    lib.impl("noise", noise, "CompositeExplicitAutograd")
    op = torch.ops.rngcheck_test.noise.default
    assert classify(op) is OpKind.PASS
    register_random_op(torch.ops.rngcheck_test.noise)
    assert classify(op) is OpKind.RANDOM
    with pytest.raises(ValueError, match="already treated as random"):
        register_random_op(op)
    with pytest.raises(ValueError, match="already treated as random"):
        register_random_op(torch.ops.aten.bernoulli_.float)
    with pytest.raises(TypeError, match="expects torch ops"):
        register_random_op("aten::rand")  # type: ignore[arg-type]

    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        op(torch.zeros(3))
    assert [e.op for e in mode.events] == ["rngcheck_test.noise.default"]


def test_an_op_registered_while_a_mode_runs_is_checked_from_then_on():
    """The mode had already classified the op as plain compute: registering it must reach the
    one table the running mode reads (there once were two, and the op stayed unchecked)."""
    lib = torch.library.Library("rngcheck_late", "FRAGMENT")  # noqa: TOR901 - test-only op
    lib.define("jitter(Tensor x) -> Tensor")
    lib.impl("jitter", lambda x: x + torch.rand_like(x), "CompositeExplicitAutograd")
    op = torch.ops.rngcheck_late.jitter.default
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        op(torch.zeros(3))  # not random: a dispatch mode sees none of it, the selective route
        before = [e.op for e in mode.events]  # the random op its implementation runs
        nested = [] if mode.report.meta["route"] == "dispatch_mode" else ["aten.rand_like.default"]
        assert before == nested
        register_random_op(op)
        op(torch.zeros(3))
    assert [e.op for e in mode.events] == [*nested, "rngcheck_late.jitter.default"]


def test_argument_summary_names_scalars_and_tensor_shapes():
    args = (torch.zeros(2, 3), 0.25)
    assert summarize_args(torch.ops.aten.bernoulli_.float, args, {}) == ("float32[2, 3]", "p=0.25")
    summary = summarize_args(
        torch.ops.aten.randint.low, (0, 10, [4]), {"dtype": torch.int64, "device": "cpu"}
    )
    assert summary == ("low=0", "high=10", "size=[4]", "dtype=int64", "device='cpu'")


# -- generators and digests -----------------------------------------------------------------------


def test_digest_is_stable_and_seeds_do_not_collide():
    digests = set()
    for seed in range(2000):
        g = torch.Generator().manual_seed(seed)
        d1 = state_digest(g.get_state())
        assert d1 == state_digest(g.get_state())  # same state, same digest
        digests.add(d1)
    assert len(digests) == 2000
    # A single draw changes the digest, and the digest fits a signed int64 for the exchange.
    g = torch.Generator().manual_seed(0)
    d0 = state_digest(g.get_state())
    torch.rand(1, generator=g)
    assert state_digest(g.get_state()) != d0
    assert -(2**63) <= d0 < 2**63


def test_digest_sees_a_one_byte_change_anywhere_in_the_mt19937_state():
    state = torch.Generator().manual_seed(0).get_state()
    base = state_digest(state)
    for pos in (0, 1000, 2500, state.numel() - 1):
        changed = state.clone()
        changed[pos] ^= 1
        assert state_digest(changed) != base


def test_generator_identity_default_and_user():
    reg = GeneratorRegistry()
    cpu = reg.default(torch.device("cpu"))
    assert cpu is not None and cpu.ident.label == "default cpu"
    assert reg.user(torch.default_generator, lambda: "x.py:1") is cpu  # explicit default
    g1, g2 = torch.Generator(), torch.Generator()
    t1 = reg.user(g1, lambda: "data.py:14")
    t2 = reg.user(g2, lambda: "data.py:20")
    assert reg.user(g1, lambda: "elsewhere") is t1  # stable
    assert t1.ident.label == "Generator #1 (cpu, first used at data.py:14)"
    assert t2.ident.number == 2
    # The wrapper an op receives at dispatch is a new Python object: identity is the C++ one.
    seen = []

    class Catch(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((kwargs or {}).get("generator"))
            return func(*args, **(kwargs or {}))

    with Catch():
        torch.rand(2, generator=g1)
    assert seen[0] is not g1
    assert reg.user(seen[0], lambda: "elsewhere") is t1
    # Bounded: a program that makes a generator per batch does not grow the registry forever.
    small = GeneratorRegistry(max_users=4)
    keep = [torch.Generator() for _ in range(10)]
    for g in keep:
        small.user(g, lambda: "")
    assert len(small.tracked()) == 4


def test_events_name_the_generator_each_op_drew_from():
    g = torch.Generator().manual_seed(1)
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        torch.rand(3)
        torch.randn(2, generator=g)  # <- user-generator-line
        torch.empty(4).uniform_(generator=g)
        torch.nn.functional.dropout(torch.ones(8), 0.5)  # <- dropout-op
    events = mode.events
    assert [e.generator.label for e in events] == [
        "default cpu",
        f"Generator #1 (cpu, first used at {THIS}:{_at('user-generator-line')})",
        f"Generator #1 (cpu, first used at {THIS}:{_at('user-generator-line')})",
        "default cpu",
    ]
    assert [e.op for e in events] == [
        "aten.rand.default",
        "aten.randn.generator",
        "aten.uniform_.default",
        "aten.bernoulli_.float",
    ]
    # Each op's "before" is the state the previous op on that generator left.
    assert events[1].after == events[2].before
    assert events[0].after == events[3].before
    assert all(e.phase is rngcheck.Phase.FORWARD for e in events)
    assert events[3].site == f"{THIS}:{_at('dropout-op')}"


def test_factory_ops_in_place_and_out_variants_are_seen():
    out = torch.empty(3)
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        torch.rand(2, 2, dtype=torch.float64, device="cpu")
        torch.randint(0, 5, (3,))
        torch.rand(3, out=out)
        torch.zeros(3).normal_()
        torch.zeros(3).bernoulli_(0.5)
    ops = [e.op for e in mode.events]
    assert ops == [
        "aten.rand.default",
        "aten.randint.low",
        "aten.rand.out",
        "aten.normal_.default",
        "aten.bernoulli_.float",
    ]
    assert {e.device for e in mode.events} == {"cpu"}


def test_backward_phase_is_recorded():
    x = torch.ones(4, requires_grad=True)

    class NoisyGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * torch.rand_like(grad)

    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        NoisyGrad.apply(x).sum().backward()
    assert [e.phase for e in mode.events] == [rngcheck.Phase.BACKWARD]
    notes = [n for n in mode.report.notes if n.kind == "backward_random_ops"]
    assert len(notes) == 1 and "during backward" in notes[0].message


# -- out-of-band changes ---------------------------------------------------------------------------


def test_out_of_band_reseed_is_attributed_to_its_call_site():
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        torch.rand(3)
        torch.manual_seed(5)  # <- reseed-here
        torch.rand(3)
        torch.rand(3)
        torch.set_rng_state(torch.Generator().manual_seed(1).get_state())  # <- set-state-here
        torch.rand(3)
    e = mode.events
    assert e[0].out_of_band is None and e[2].out_of_band is None
    calls = e[1].out_of_band.user_calls
    assert [c.api for c in calls] == ["torch.manual_seed"]
    assert calls[0].argument == "5"
    assert calls[0].stack.describe() == f"{THIS}:{_at('reseed-here')}"
    calls = e[3].out_of_band.user_calls
    assert [c.api for c in calls] == ["torch.set_rng_state"]
    assert calls[0].stack.describe() == f"{THIS}:{_at('set-state-here')}"
    assert "torch.manual_seed(5) at" in e[1].out_of_band.describe()
    assert mode.report.ok  # seeding on its own is not a finding


def test_out_of_band_reseed_of_a_user_generator_reports_the_new_seed():
    g = torch.Generator().manual_seed(3)
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        torch.rand(2, generator=g)
        g.manual_seed(9)  # a C method: no call site, but the seed is visible
        torch.rand(2, generator=g)
    oob = mode.events[1].out_of_band
    assert oob is not None and oob.new_seed == 9 and not oob.calls
    assert "reseeded to 9" in oob.describe()


def test_seeding_functions_are_restored_on_exit_also_after_an_exception():
    originals = (torch.manual_seed, torch.random.manual_seed, torch.set_rng_state, torch.seed)
    with pytest.raises(KeyError), rngcheck.RNGConsistencyMode(on_finding="record"):
        assert torch.manual_seed is not originals[0]
        raise KeyError("boom")
    assert (
        torch.manual_seed,
        torch.random.manual_seed,
        torch.set_rng_state,
        torch.seed,
    ) == originals


# -- validation and lifecycle ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"on_finding": "explode"},
            "on_finding must be one of 'raise', 'warn', 'record'; got 'explode'",
        ),
        ({"sync": "sometimes"}, "sync must be one of 'op', 'step', 'off'; got 'sometimes'"),
        ({"expect": "equal"}, "expect must be one of 'same', 'differ', 'ignore'; got 'equal'"),
        ({"check_recompute": "yes"}, "check_recompute must be True or False; got 'yes'"),
        ({"window": 0}, "window must be a whole number from 1 to 1,000,000; got 0"),
        ({"every_ops": 2.5}, "every_ops must be a whole number from 1 to 1,000,000,000; got 2.5"),
        ({"every_steps": 0}, "every_steps must be a whole number from 1 to 1,000,000,000; got 0"),
        ({"timeout": -1}, "timeout must be a number of seconds from 0.001 to 2,592,000 (30 days)"),
        ({"timeout": True}, "timeout must be a number of seconds from 0.001 to 2,592,000"),
        ({"timeout": float("nan")}, "timeout must be a number of seconds from 0.001 to 2,592,000"),
        # Past the top: refused by name, not an OverflowError from a deque or a timedelta later.
        ({"window": 10**30}, f"window must be a whole number from 1 to 1,000,000; got {10**30}"),
        ({"timeout": 1e23}, "or None for the process group's own timeout; got 1e+23"),
        ({"every_ops": 10**10}, "every_ops must be a whole number from 1 to 1,000,000,000"),
        ({"every_steps": 2**63}, "every_steps must be a whole number from 1 to 1,000,000,000"),
        ({"sample_every": 10**10}, "sample_every must be a whole number from 1 to 1,000,000,000"),
        ({"sample_first": 0}, "sample_first must be a whole number from 1 to 1,000,000,000"),
        ({"console": "stderr"}, "console must be a rich.console.Console"),
        ({"console": io.StringIO()}, "console must be a rich.console.Console"),
        ({"report_path": 3}, "report_path must be a file path (a str or os.PathLike)"),
        ({"trace": ["t.jsonl"]}, "trace must be a file path (a str or os.PathLike)"),
        ({"report_path": ""}, "report_path must be a file path"),
    ],
)
def test_bad_arguments_name_the_valid_choices(kwargs, message):
    with pytest.raises(ValueError) as info:
        rngcheck.RNGConsistencyMode(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("name", ["report_path", "trace"])
def test_a_path_that_can_never_be_written_fails_when_the_mode_starts(tmp_path, name):
    afile = tmp_path / "afile.txt"
    afile.write_text("x")
    cases = {
        str(afile / "sub" / "out.json"): "is a file, not a folder",
        str(tmp_path): "is a directory; give the path of a file",
        # A folder nothing can be made in, even by root (for whom os.access says yes); and a
        # name too long to create, below a folder created first (and removed again).
        "/proc/forbidden/out.json": "the folder /proc/forbidden cannot be created",
        str(tmp_path / "made" / ("x" * 300) / "out.json"): f"the folder {tmp_path}/made/xxx",
    }
    for path, message in cases.items():
        mode = rngcheck.RNGConsistencyMode(**{name: path})
        with pytest.raises(ValueError, match=message), mode:
            pytest.fail("the mode started")  # pragma: no cover - it must not
        assert rngcheck.active_mode() is None
    assert sorted(os.listdir(tmp_path)) == ["afile.txt"]  # nothing made is left
    # A folder that does not exist yet is created when the mode starts (proven by making a
    # file in it, which it removes), and the file when it is written: a report from the start,
    # kept current as the run goes (a killed process leaves it), a trace whole, at the end.
    deep = tmp_path / "new" / "dir" / "out.json"
    with rngcheck.RNGConsistencyMode(**{name: deep}):
        assert os.listdir(deep.parent) == (["out.json"] if name == "report_path" else [])
    assert deep.exists()


def test_the_former_every_argument_still_works_and_says_its_new_name():
    with pytest.warns(DeprecationWarning, match=r"every_ops="):
        mode = rngcheck.RNGConsistencyMode(every=7)
    assert mode.config.every_ops == 7


def test_expect_validates_its_policy():
    with (
        pytest.raises(ValueError, match="'same', 'differ', 'ignore'"),
        rngcheck.expect("sometimes"),
    ):
        pass


def test_reentrant_use_is_refused_and_leaves_the_mode_usable():
    mode = rngcheck.RNGConsistencyMode(on_finding="record")
    with mode:
        with pytest.raises(RuntimeError, match="already active"), mode:
            pass
        with pytest.raises(RuntimeError, match="another RNGConsistencyMode"):
            rngcheck.RNGConsistencyMode().__enter__()
        torch.rand(2)
        assert rngcheck.active_mode() is mode
    assert rngcheck.active_mode() is None
    with mode:  # entering again after exit is fine
        torch.rand(2)
    assert mode.report.random_ops == 2


def test_exception_inside_an_op_propagates_unchanged():
    with (
        pytest.raises(RuntimeError, match=r"expects p to be in \[0, 1\]"),
        rngcheck.RNGConsistencyMode(),
    ):
        torch.zeros(3).bernoulli_(1.5)


# -- zero perturbation and bounded memory ----------------------------------------------------------


def _train(steps: int = 5) -> tuple[list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 4)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        x = torch.randn(8, 16)
        h = torch.utils.checkpoint.checkpoint(model[:3], x.requires_grad_(), use_reentrant=False)
        loss = model[3](h).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], torch.get_rng_state()


def test_training_is_bitwise_identical_with_and_without_the_mode():
    params_plain, rng_plain = _train()
    with rngcheck.RNGConsistencyMode() as mode:
        params_checked, rng_checked = _train()
    assert mode.report.ok and mode.report.random_ops > 0
    assert all(torch.equal(a, b) for a, b in zip(params_plain, params_checked, strict=True))
    assert torch.equal(rng_plain, rng_checked)


def test_memory_stays_bounded_over_tens_of_thousands_of_random_ops():
    def burst(mode, n):
        x = torch.empty(4)
        for _ in range(n):
            x.uniform_()

    with rngcheck.RNGConsistencyMode(on_finding="record", window=256) as mode:
        burst(mode, 2000)  # warm up caches and counters
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        burst(mode, 20000)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
    assert len(mode.events) == 256
    assert mode.report.random_ops == 22000
    assert grown < 2_000_000, f"memory grew by {grown} bytes over 20000 random ops"


def test_records_keep_no_tensors_alive():
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        t = torch.rand(1000)
        ref = weakref.ref(t)
        del t
    gc.collect()
    assert ref() is None
    assert mode.events[0].args == ("size=[1000]", "device=cpu")


def test_what_is_learned_per_code_object_keeps_no_code_alive():
    """A cache keyed by code objects must not hold them: generated code (TorchDynamo's, a
    template's) dies with what made it, and a strong reference would keep it and everything it
    holds for the life of the process."""
    from rngcheck.core.stacks import CodeFlags

    seen = []
    flags = CodeFlags(lambda code: seen.append(code.co_name) or True, limit=2)
    code = compile("def made(): pass", "<generated>", "exec").co_consts[0]
    alive = weakref.ref(code)
    assert flags(code) and flags(code) and seen == ["made"]  # learned once
    del code
    gc.collect()
    assert alive() is None and not flags._known  # gone, and its entry with it
    codes = [compile(f"x{i} = {i}", "<generated>", "exec") for i in range(5)]
    assert all(flags(c) for c in codes) and len(flags._known) <= 3  # the limit holds
