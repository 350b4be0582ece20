"""The rank checker's pure parts, in one process: group resolution, localising the first divergent
op from gathered windows, and the findings built from the gathered detail. The same functions run
on every rank after a mismatch, so plain data in, plain data out is all they need."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

import rngcheck
from rngcheck.core.events import OutOfBandChange, Phase, RandomOpEvent, SeedCall
from rngcheck.core.findings import FindingKind
from rngcheck.core.generators import GeneratorId
from rngcheck.core.stacks import Frame, Stack
from rngcheck.ranks.detail import Detail, Uncompared
from rngcheck.ranks.explain import apart_text, seeded_text, uncompared_reasons
from rngcheck.ranks.findings import build_finding
from rngcheck.ranks.groups import resolve_group
from rngcheck.ranks.localise import localise
from rngcheck.ranks.protocol import POLICY_CODE, Point, Row


def test_resolve_group_forms() -> None:
    assert resolve_group(None, 1, 4) == (0, 1, 2, 3)
    assert resolve_group([3, 2], 2, 4) == (2, 3)
    assert resolve_group(range(2), 1, 4) == (0, 1)
    assert resolve_group([2, 3], 0, 4) is None  # not a member: not checked for that stream
    with pytest.raises(ValueError, match="names mesh dimensions"):
        resolve_group("tp", 0, 4)
    with pytest.raises(TypeError, match="ProcessGroup, a list of ranks, a DeviceMesh"):
        resolve_group(3.5, 0, 4)


def _row(op: str, before: int, after: int, stream: int = 7, policy: int = 1) -> Row:
    return Row(hash(op) & 0xFFFF, stream, before, after, policy, generator=1)


def test_localise_extra_op_then_state_then_collision() -> None:
    a, b, c = _row("bernoulli", 1, 2), _row("rand", 2, 3), _row("bernoulli", 2, 3)
    points = {0: Point.EXIT, 1: Point.EXIT}
    flow = localise({0: [a, c], 1: [a, b, c]}, points)
    assert (flow.kind, flow.index) == ("flow", 1)
    state = localise({0: [a, c], 1: [a, _row("bernoulli", 9, 3)]}, points)
    assert (state.kind, state.index, state.stream) == ("state", 1, 7)
    same = _row("rand", 5, 6, stream=8, policy=2)
    collision = localise({0: [a, same], 1: [a, same]}, points)
    assert (collision.kind, collision.index) == ("collision", 0)
    apart = _row("rand", 4, 6, stream=8, policy=2)
    assert localise({0: [a, same], 1: [a, apart]}, points) is None  # a hashed-slot false alarm
    moved = localise({0: [a], 1: [a]}, {0: Point.COLLECTIVE, 1: Point.EXIT})
    assert moved.kind == "points"


def test_localise_names_what_differed_first_in_program_order() -> None:
    points = {0: Point.EXIT, 1: Point.EXIT}
    a, b = _row("bernoulli", 1, 2), _row("rand", 2, 3)
    # States part at op 0 (a generator seeded per rank), the ops at op 1: the state is first.
    first = localise({0: [a, b], 1: [_row("bernoulli", 5, 6), a]}, points)
    assert (first.kind, first.index, first.stream) == ("state", 0, 7)
    # The ops part before any state does: the flow, with the policy its ops share (or none).
    flow = localise({0: [a, b], 1: [a, a]}, points)
    assert (flow.kind, flow.index, flow.policy) == ("flow", 1, 1)
    declared = localise({0: [a, b], 1: [a, _row("randint", 2, 3, policy=3)]}, points)
    assert (declared.kind, declared.index, declared.policy) == ("flow", 1, 0)


def test_localise_leaves_peers_rows_out_of_the_groups_order() -> None:
    """A data-parallel forward's rows compared among tensor-parallel peers (Rule 2): the other
    data-parallel group draws its own shapes there, which is no control-flow divergence; a state
    that differs within one group of peers is found in its stream, and a flow after them is
    placed among the rows in order (the spot's index maps back into each rank's window)."""
    points = dict.fromkeys(range(4), Point.EXIT)
    a, b = _row("randperm", 1, 2, stream=7), _row("rand", 2, 3, stream=7)

    def peers(op: str, before: int, stream: int) -> Row:
        return _row(op, before, before + 1, stream=stream, policy=POLICY_CODE["peers"])

    # ranks 0,1 share a batch (stream 30), ranks 2,3 another, with other shapes (another op).
    low, high = peers("bernoulli[2,3]", 5, 30), peers("bernoulli[2,5]", 5, 31)
    quiet = {0: [a, low, b], 1: [a, low, b], 2: [a, high, high, b], 3: [a, high, high, b]}
    assert localise(quiet, points) is None
    bad = {**quiet, 1: [a, peers("bernoulli[2,3]", 9, 30), b]}  # rank 1's own state there
    spot = localise(bad, points)
    assert (spot.kind, spot.index, spot.stream, spot.policy) == ("state", 0, 30, 4)
    assert spot.index_for(1, bad[1]) == 1
    extra = {**quiet, 3: [a, high, high, a, b]}  # rank 3 draws once more, after the forward
    flow = localise(extra, points)
    assert (flow.kind, flow.index) == ("flow", 1)
    assert [flow.index_for(r, w) for r, w in extra.items()] == [2, 2, 3, 3]


def _event(seq: int, op: str, site: tuple[str, int], *, torch_frame: str = "") -> dict:
    frames = [Frame(filename=f"/app/{site[0]}", lineno=site[1], name="train")]
    if torch_frame:
        frames.append(Frame(filename=torch_frame, lineno=690, name="__init__", user=False))
    return RandomOpEvent(
        seq=seq,
        op=op,
        generator=GeneratorId(kind="default", device="cpu"),
        device="cpu",
        args=(),
        before=11,
        after=12,
        phase=Phase.FORWARD,
        stack=Stack(frames=tuple(frames)),
    ).to_dict()


def _d(event: dict | None, point: str) -> Detail:
    return Detail.from_dict({"event": event, "point": point})


def test_flow_finding_names_the_extra_op_and_the_dataloader() -> None:
    loader = torch.utils.data.__file__.replace("__init__.py", "dataloader.py")
    dropout, draw = _row("bernoulli", 1, 2), _row("random_", 1, 2)
    windows = {0: [draw, dropout], 1: [dropout], 2: [dropout]}
    details = {
        0: _d(
            _event(3, "aten.random_.default", ("train.py", 40), torch_frame=loader),
            "collective c10d.allreduce_.default at train.py:50",
        ),
        1: _d(_event(3, "aten.bernoulli_.float", ("model.py", 9)), "x"),
        2: _d(_event(3, "aten.bernoulli_.float", ("model.py", 9)), "x"),
    }
    spot = localise(windows, dict.fromkeys(windows, Point.COLLECTIVE))
    f = build_finding(spot, windows, details, (0, 1, 2))
    assert f.kind is FindingKind.RANK_DIVERGENCE and f.differs == "op"
    assert f.site == "train.py:40" and f.other_stack.describe() == "model.py:9"
    assert [s.label for s in f.sides] == ["majority", "outliers"]
    assert [s.ranks for s in f.sides] == [(1, 2), (0,)]
    assert "rank 0 ran an extra random op, aten.random_.default" in f.cause
    assert "DataLoader iterator" in f.cause
    text = rngcheck.format_finding(f)
    assert "majority (ranks 1-2)" in text and "outliers (rank 0)" in text
    text = rngcheck.format_finding(f, world_size=3)
    assert "majority (ranks 1-2 of 3)" in text and "outliers (rank 0 of 3)" in text


def test_a_peer_that_skipped_a_forwards_op_is_found_among_its_peers() -> None:
    """Ranks 0 and 1 share a batch (a peers stream); rank 1 ran no dropout there (its mark says
    it is a member): found as the op rank 0 ran, among the peers only, whatever ranks 2 and 3
    (the other data-parallel group) ran in their forward."""
    code = POLICY_CODE["peers"]
    a = _row("randperm", 1, 2)
    mine = _row("bernoulli", 5, 6, stream=30, policy=code)
    theirs = _row("bernoulli[2,5]", 5, 6, stream=31, policy=code)

    def mark(stream: int) -> Row:
        return Row(0, stream, 0, 0, code, 0)

    windows = {
        0: [a, mine, a, mark(30)],
        1: [a, a, mark(30)],
        2: [a, theirs, theirs, a, mark(31)],
        3: [a, theirs, theirs, a, mark(31)],
    }
    spot = localise(windows, dict.fromkeys(windows, Point.EXIT))
    assert (spot.kind, spot.index, spot.stream, spot.policy) == ("flow", 0, 30, code)
    assert [spot.index_for(r, w) for r, w in windows.items()] == [1, 3, 5, 5]
    details = {
        0: Detail.from_dict(
            {
                "event": _event(4, "aten.bernoulli_.float", ("model.py", 9)),
                "point": "x",
                "wrappers": ["fully_shard over ranks 0,2"],
            }
        ),
        1: Detail.from_dict(
            {"event": None, "point": "x", "wrappers": ["fully_shard over ranks 1,3"]}
        ),
        2: _d(None, "x"),
        3: _d(None, "x"),
    }
    f = build_finding(spot, windows, details, (0, 1, 2, 3))
    assert f.kind is FindingKind.RANK_DIVERGENCE and f.ranks == (0, 1), f
    assert f.cause.startswith("rank 0 ran an extra random op, aten.bernoulli_.float"), f.cause
    assert (
        "Ranks 0-1 compute on one batch, as tensor-parallel peers (their parameters are DTensors "
        "over them) inside data-parallel groups (fully_shard over ranks 0,2; fully_shard over "
        "ranks 1,3): the ranks of a data-parallel group may draw apart, but peers must draw alike"
    ) in f.cause
    assert "seed" not in f.cause, f.cause  # (what runs differs: seeding is no cause)


def test_single_process_has_no_rank_checker() -> None:
    with rngcheck.RNGConsistencyMode() as mode:
        torch.rand(2)
    assert mode.report.ok and rngcheck.exchange_stats(mode) == {}
    assert rngcheck.exchange_stats() == {}  # no active mode


def test_flow_finding_when_one_rank_of_three_skipped_an_op() -> None:
    dropout, rand = _row("bernoulli", 1, 2), _row("rand", 2, 3)
    windows = {0: [rand, dropout], 1: [dropout], 2: [rand, dropout]}
    details = {
        0: _d(_event(5, "aten.rand.default", ("train.py", 30)), "x"),
        1: _d(_event(5, "aten.bernoulli_.float", ("model.py", 9)), "x"),
        2: _d(_event(5, "aten.rand.default", ("train.py", 30)), "x"),
    }
    f = build_finding(
        localise(windows, dict.fromkeys(windows, Point.EXIT)), windows, details, (0, 1, 2)
    )
    assert [(s.label, s.ranks) for s in f.sides] == [("majority", (0, 2)), ("outliers", (1,))]
    assert f.cause.startswith("rank 1 skipped a random op, aten.rand.default")
    assert f.site == "train.py:30" and f.other_stack.describe() == "model.py:9"
    assert "random op #5 on ranks 0,2" in f.message


def test_rank_finding_renders_as_a_panel_with_a_side_that_ran_nothing() -> None:
    from rich.console import Console

    dropout = _row("bernoulli", 1, 2)
    windows = {0: [dropout], 1: []}
    details = {
        0: _d(_event(0, "aten.bernoulli_.float", ("model.py", 9)), "x"),
        1: _d(None, "collective c10d.barrier.default at train.py:70"),
    }
    f = build_finding(
        localise(windows, dict.fromkeys(windows, Point.COLLECTIVE)), windows, details, (0, 1)
    )
    idle, extra = f.sides  # the side that ran the op is the divergent one, whatever its rank
    assert extra.ranks == (0,) and extra.event is not None
    assert idle.ranks == (1,) and idle.event is None
    assert (
        idle.note == "ran no random op here; reached collective c10d.barrier.default at train.py:70"
    )
    console = Console(record=True, width=300, force_terminal=True)
    console.print(rngcheck.render_finding(f))
    text = console.export_text()
    assert "RNG state diverged across ranks" in text and "reached collective c10d.barrier" in text
    assert "reference (rank 1)" in text and "divergent (rank 0)" in text


def _seeded(seed: int, args: tuple[str, ...], *, number: int = 1, before: int = 11) -> dict:
    """A randint on a user generator seeded with ``seed`` (its number: which generator)."""
    return RandomOpEvent(
        seq=3,
        op="aten.randint.low_generator",
        generator=GeneratorId(kind="user", device="cpu", number=number, origin="data.py:20"),
        device="cpu",
        args=args,
        before=before,
        after=before + 1,
        phase=Phase.FORWARD,
        stack=Stack(frames=(Frame(filename="/app/data.py", lineno=31, name="crop"),)),
        seed=seed,
    ).to_dict()


def test_a_per_rank_stream_may_draw_per_rank_arguments_but_ranks_seeded_alike_must_agree() -> None:
    from rngcheck.ranks.generators import per_rank_seeding
    from rngcheck.ranks.localise import Spot

    flow = Spot("flow", 0, policy=1)
    crops = {r: _d(_seeded(100 + r, (f"high={13 - r}",)), "x") for r in range(2)}
    seeded = per_rank_seeding(flow, crops)
    assert seeded is not None and "seeded differently on each rank" in seeded_text(seeded[1])
    # seed + data-parallel rank under tensor parallelism: ranks 0-1 share a seed, 2-3 another.
    # Ranks 0 and 1 drew different arguments from one seed: seeding does not explain that.
    shared = {r: _d(_seeded(42 + r // 2, (f"high={13 - r}",)), "x") for r in range(4)}
    assert per_rank_seeding(flow, shared) is None
    agreeing = {r: _d(_seeded(42 + r // 2, (f"high={13 - r // 2}",)), "x") for r in range(4)}
    assert per_rank_seeding(flow, agreeing) is not None
    state = Spot("state", 0, stream=7, policy=1)
    apart = {r: _d(_seeded(42 + r // 2, (), before=10 + r), "x") for r in range(4)}
    assert per_rank_seeding(state, apart) is None
    declared = Spot("flow", 0, policy=3)  # an expect(...) block or a DTensor mesh: as declared
    assert per_rank_seeding(declared, crops) is None


def test_rule_9_a_default_generator_drawing_each_ranks_own_arguments() -> None:
    """Rule 9 is decided from the gathered details alone: the same op at the same line on a
    default generator seeded alike, with each rank's own arguments, in a data-parallel program
    whose wrappers have no tensor-parallel peers; nothing else."""
    from rngcheck.ranks.generators import own_arguments
    from rngcheck.ranks.localise import Spot

    ddp = ["DistributedDataParallel over ranks 0-1"]

    def details(
        shapes: tuple[str, ...] = ("float32[2, 4, 8, 8]", "float32[2, 4, 8, 12]"),
        user: bool = False,
        seeds: tuple[int, int] = (42, 42),
        **detail: Any,
    ) -> dict[int, Detail]:
        out = {}
        for r in range(2):
            event = _event(5, "aten.randn_like.default", ("train.py", 19))
            event["args"], event["seed"] = [shapes[r]], seeds[r]
            if user:
                event["generator"] = _seeded(5, ())["generator"]
            out[r] = Detail.from_dict({"event": event, "point": "x", "wrappers": ddp, **detail})
        return out

    flow = Spot("flow", 0, policy=1)
    own = own_arguments(flow, details())
    assert own is not None and own[0].op == "aten.randn_like.default"
    assert apart_text(own[1]) == (
        "the ranks drew different amounts from it at train.py:19, aten.randn_like.default with "
        "arguments of each rank's own (float32[2, 4, 8, 8] on rank 0; float32[2, 4, 8, 12] on "
        "rank 1)"
    )
    assert own_arguments(flow, details(("float32[2]", "float32[2]"))) is None  # the same call
    assert own_arguments(flow, details(user=True)) is None  # a stream seeded alike on purpose
    assert own_arguments(flow, details(seeds=(42, 43))) is None  # seeded per rank: Rule 3's
    assert own_arguments(flow, details(wrappers=[])) is None  # no data-parallel wrapper known
    assert own_arguments(flow, details(peers=True)) is None  # tensor-parallel peers share a batch
    split = {"reason": "split", "subject": "torch's random_split"}
    assert own_arguments(flow, details(order=split)) is None  # an order every rank walks
    assert own_arguments(Spot("flow", 0, policy=3), details()) is None  # declared: as declared
    assert own_arguments(Spot("state", 0, stream=7, policy=1), details()) is None
    reseeded = details()
    event = reseeded[1].event
    assert event is not None
    call = SeedCall(api="torch.manual_seed", argument="7", stack=Stack.empty())
    moved = replace(event, out_of_band=OutOfBandChange(calls=(call,)))
    reseeded[1] = replace(reseeded[1], event=moved)
    assert own_arguments(flow, reseeded) is None  # a user's seeding call on one rank first


def test_same_line_with_other_arguments_or_another_generator_is_said_as_it_is() -> None:
    row = {r: _row(f"randint{r}", 11, 12) for r in range(2)}
    windows = {0: [row[0]], 1: [row[1]]}
    spot = localise(windows, dict.fromkeys(windows, Point.EXIT))
    alike = {r: _d(_seeded(100, (f"high={13 - r}",)), "x") for r in range(2)}
    f = build_finding(spot, windows, alike, (0, 1))
    assert f.message.startswith(
        "the ranks ran aten.randint.low_generator at data.py:31 with different arguments"
    )
    assert "(high=13 on rank 0; high=12 on rank 1)" in f.cause
    assert "seeded alike on every rank, so its states part here" in f.cause
    # The same line, the same arguments, but each rank's own generator: not "arguments".
    others = {r: _d(_seeded(100, ("high=13",), number=1 + r), "x") for r in range(2)}
    f = build_finding(spot, windows, others, (0, 1))
    assert "with different arguments" not in f.message + f.cause
    assert "rank 0 ran aten.randint.low_generator on Generator #1" in f.cause, f.cause
    assert "rank 1 ran aten.randint.low_generator on Generator #2" in f.cause


def test_a_generate_call_on_some_ranks_only_is_said_as_the_call() -> None:
    """Rule 8: a row that stands for a generate() call (Detail.call) on some ranks and not on
    the others is said as the call, whichever side is the smaller."""
    call, dropout = _row("call", 11, 0), _row("bernoulli", 1, 2)
    sampled = _event(4, "aten.multinomial.default", ("utils.py", 3277))
    for callers, world in (((0,), 2), ((0, 2), 3)):
        windows = {r: [call, dropout] if r in callers else [dropout] for r in range(world)}
        details = {
            r: Detail.from_dict({"event": sampled, "point": "x", "call": "GPT2LMHeadModel"})
            if r in callers
            else _d(_event(4, "aten.bernoulli_.float", ("model.py", 9)), "x")
            for r in range(world)
        }
        spot = localise(windows, dict.fromkeys(windows, Point.EXIT))
        f = build_finding(spot, windows, details, tuple(range(world)))
        what = "generate() of GPT2LMHeadModel, sampling (its first random op "
        if world == 2:
            assert f.cause.startswith(f"rank 0 called {what}"), f.cause
            assert "where rank 1 did not sample (no call there, or one that drew" in f.cause
        else:
            assert f.cause.startswith("rank 1 did not sample (no call there"), f.cause
            assert f"where ranks 0,2 called {what}" in f.cause, f.cause
        assert "torch.random.fork_rng(), rngcheck.expect" in f.cause


def test_different_arguments_in_a_forward_say_when_no_rank_knows_a_wrapper() -> None:
    """A divergence in arguments inside a module's call where no rank knows a data-parallel
    wrapper says so (a model each rank trains alone); with a wrapper known, or outside a
    module, it does not."""
    module = torch.nn.modules.module.__file__
    windows = {r: [_row(f"bernoulli{r}", 11, 12)] for r in range(2)}
    spot = localise(windows, dict.fromkeys(windows, Point.EXIT))

    def cause(in_module: bool, wrappers: tuple[str, ...]) -> str:
        details = {}
        for r in range(2):
            event = _event(3, "aten.bernoulli_.float", ("model.py", 9), torch_frame=module)
            if not in_module:
                event["stack"] = event["stack"][:1]
            event["args"] = [f"float32[4, {9 + r}, 32]"]
            detail = _d(event, "x").to_dict()
            detail["wrappers"] = list(wrappers)
            details[r] = Detail.from_dict(detail)
        return build_finding(spot, windows, details, (0, 1)).cause

    unwrapped = "No rank knows a data-parallel wrapper"
    assert "with different arguments" in cause(True, ()) and unwrapped in cause(True, ())
    assert unwrapped not in cause(True, ("DistributedDataParallel over ranks 0-1",))
    assert unwrapped not in cause(False, ())


def test_a_generator_moved_apart_by_data_parallel_work_is_decided_from_gathered_data() -> None:
    from rngcheck.core.events import OutOfBandChange, SeedCall
    from rngcheck.ranks.generators import data_parallel_drift
    from rngcheck.ranks.localise import Spot
    from rngcheck.ranks.verdict import Apart, Compare, Domain, Reason, Verdict

    def why(reason: Reason, subject: str = "", source: str = "", rank: int = -1) -> Verdict:
        return Verdict(Domain.RANK, Compare.NONE, reason, subject, source, rank=rank)

    state = Spot("state", 0, stream=7, policy=1)
    ddp = "DistributedDataParallel over ranks 0-1"
    forward = Uncompared(12, "aten.bernoulli_.float", "model.py:9", why(Reason.OWN_BATCH, ddp))

    def detail(before: int, **kw: object) -> Detail:
        event = RandomOpEvent.from_dict(_seeded(0, (), before=before))
        oob = kw.pop("oob", None)
        if oob is not None:
            from dataclasses import replace

            event = replace(event, out_of_band=oob)
        return Detail(event=event, point="x", **kw)  # type: ignore[arg-type]

    moved = {0: detail(11, uncompared=forward), 1: detail(15, uncompared=forward)}
    found = data_parallel_drift(state, moved)
    assert found is not None
    assert apart_text(found[1]) == (
        f"the ranks drew different amounts from it in the forward and backward of {ddp} "
        "(each rank's own batch shapes)"
    )
    # Rule 6: a rank that read every rank's batches alone is the surer cause (rank 1 here).
    dispatcher = "accelerate's DataLoaderDispatcher"
    alone_why = why(Reason.READ_ALONE, dispatcher)
    reading = Uncompared(
        3, "aten.randperm.default", "data.py:4", why(Reason.IGNORED), alone=alone_why
    )
    read = {0: detail(11, uncompared=forward), 1: detail(15, uncompared=reading)}
    found = data_parallel_drift(state, read)
    assert found is not None and apart_text(found[1]) == (
        f"the ranks drew different amounts from it while rank 1 alone read every rank's "
        f"batches for {dispatcher}"
    )
    assert uncompared_reasons(reading) == (
        f"under expect('ignore') or reading every rank's batches alone for {dispatcher}"
    )
    # ZeRO-3: rank 0 alone initialised parameters that GatheredParameters broadcast from it.
    gathered = why(
        Reason.BROADCAST,
        "deepspeed GatheredParameters",
        "deepspeed.runtime.zero.partition_parameters:GatheredParameters",
        rank=0,
    )
    init = Uncompared(2, "aten.normal_.default", "initialization.py:54", gathered, gathered)
    found = data_parallel_drift(state, {0: detail(11, uncompared=init), 1: detail(15)})
    assert found is not None and apart_text(found[1]) == (
        "the ranks drew different amounts from it while rank 0 drew inside a deepspeed "
        "GatheredParameters region broadcast by it (ZeRO-3: the parameters it gathered are that "
        "rank's as it exits)"
    )
    assert uncompared_reasons(init) == (
        "inside a deepspeed GatheredParameters region broadcast by rank 0"
    )
    # Each rank loaded its own share of the data (a collator's masking).
    split = "torch's DistributedSampler"
    mask = Uncompared(4, "aten.bernoulli.default", "collate.py:3", why(Reason.OWN_SHARE, split))
    loaded = {r: detail(11 + 4 * r, uncompared=mask) for r in (0, 1)}
    found = data_parallel_drift(state, loaded)
    assert found is not None and apart_text(found[1]) == (
        "the ranks drew different amounts from it while each loaded its own share of the data, "
        f"split by {split} (a dataset's or collator's draws over each rank's own samples)"
    )
    # ... only when it explains every difference: on 3 ranks, rank 2 differing from rank 1
    # too (neither read nor drew in a forward) is a divergence of its own.
    three = {0: detail(11, uncompared=reading), 1: detail(15), 2: detail(15)}
    assert data_parallel_drift(state, three) is not None
    three[2] = detail(17)
    assert data_parallel_drift(state, three) is None
    assert data_parallel_drift(state, {0: detail(11), 1: detail(15)}) is None  # nothing drew
    # Known on one rank only (its rows were sent before every rank knew): still one decision.
    apart = Apart(Reason.OWN_BATCH, ddp)
    known = {0: detail(11, apart=apart), 1: detail(15)}
    assert data_parallel_drift(state, known) == (known[0].event, apart)
    # A rank reseeded it itself just before: that is the divergence, on every rank.
    site = Stack(frames=(Frame(filename="/app/train.py", lineno=57, name="train"),))
    call = SeedCall(api="torch.manual_seed", argument="99", stack=site)
    reseeded = {0: detail(11, apart=apart), 1: detail(15, oob=OutOfBandChange(calls=(call,)))}
    assert data_parallel_drift(state, reseeded) is None
    # A resume: every rank of a data-parallel program restored a state of its own (each rank's
    # saved state, which the forward had moved apart before the save).
    restore = SeedCall(api="torch.random.set_rng_state", argument="<state>", stack=site)
    resumed = {
        r: detail(11 + 4 * r, oob=OutOfBandChange(calls=(call, restore)), wrappers=(ddp,))
        for r in (0, 1)
    }
    found = data_parallel_drift(state, resumed)
    assert found is not None and apart_text(found[1]).startswith(
        "each rank restored a state of its own into it (torch.random.set_rng_state(<state>) "
        "at train.py:57"
    ), found
    # ... not when one rank alone restored (its own stale state), nor outside data parallelism,
    # nor after seeds (per-rank seeds are learnt as per-rank streams, decided before).
    alone = {0: detail(11, wrappers=(ddp,)), 1: resumed[1]}
    assert data_parallel_drift(state, alone) is None
    # At the generator's first op under the mode the restore is among its seeding calls.
    first = {r: detail(11 + 4 * r, seed_calls=(call, restore), wrappers=(ddp,)) for r in (0, 1)}
    assert data_parallel_drift(state, first) is not None
    # Restored by different calls (or lines) on different ranks: not one resume.
    elsewhere = SeedCall(api="torch.set_rng_state", argument="<state>", stack=site)
    mixed = {**resumed, 1: detail(15, oob=OutOfBandChange(calls=(elsewhere,)), wrappers=(ddp,))}
    assert data_parallel_drift(state, mixed) is None
    plain = {r: detail(11 + 4 * r, oob=OutOfBandChange(calls=(restore,))) for r in (0, 1)}
    assert data_parallel_drift(state, plain) is None
    seeded = {
        r: detail(11 + 4 * r, oob=OutOfBandChange(calls=(call,)), wrappers=(ddp,)) for r in (0, 1)
    }
    assert data_parallel_drift(state, seeded) is None


class _Recording(torch.utils.data.Sampler):
    """A sampler that records, as it shuffles, which sampler splitting an order rngcheck sees
    (and, in ``readings``, what reads the data)."""

    def __init__(self, n: int = 4) -> None:
        self.n, self.seen, self.readings = n, [], []

    def __len__(self) -> int:
        return self.n

    def __iter__(self):  # type: ignore[no-untyped-def]
        from rngcheck.ranks.scopes import reading

        now = reading()
        self.seen.append(_label(now.order))
        self.readings.append(now)
        return iter(range(self.n))


def _label(hook: Any) -> str:
    """How the report names the code a walk of the frames found ("" for none)."""
    return hook.label if hook is not None else ""


def _order() -> str:
    from rngcheck.ranks.scopes import reading

    return _label(reading(skip=1).order)


def test_torchs_own_samplers_with_replacement_under_a_splitting_one_are_no_order() -> None:
    """torch's RandomSampler and WeightedRandomSampler are known by their own code (a pipeline's
    stages must walk their orders alike): under a sampler that splits an order among the ranks
    they still draw no order when they draw with replacement, and one without; and they say
    what drew, for a pipeline."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from rngcheck.ranks.scopes import reading

    accelerate = pytest.importorskip("accelerate.data_loader")
    seen: list[tuple[bool, str, str]] = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if torch.Tag.nondeterministic_seeded in func.tags:
                now = reading()
                seen.append((replacement, _label(now.order), _label(now.shuffle)))
            return func(*args, **(kwargs or {}))

    for replacement in (True, False):
        for sampler in (
            torch.utils.data.RandomSampler(range(4), replacement=replacement),
            torch.utils.data.WeightedRandomSampler([1.0] * 4, 4, replacement=replacement),
        ):
            batches = torch.utils.data.BatchSampler(sampler, batch_size=2, drop_last=False)
            with Reads():
                list(accelerate.BatchSamplerShard(batches, num_processes=2, process_index=0))
    shard = "accelerate's BatchSamplerShard"
    assert {(r, order) for r, order, _ in seen} == {(True, ""), (False, shard)}, seen
    assert {shuffle for *_, shuffle in seen} == {
        "torch's RandomSampler",
        "torch's WeightedRandomSampler",
    }, seen


def test_a_sampler_splitting_an_order_among_the_ranks_is_known_by_what_iterates_it() -> None:
    """Rule 5 knows the real wrappers (accelerate's, Lightning's) by the function that walks
    the inner sampler's order; the same sampler iterated on its own, or by a plain BatchSampler
    and DataLoader, is not one."""
    sampler = _Recording()
    list(torch.utils.data.DataLoader(range(4), sampler=sampler, batch_size=2))
    list(torch.utils.data.BatchSampler(sampler, batch_size=2, drop_last=False))
    assert sampler.seen == ["", ""]

    accelerate = pytest.importorskip("accelerate.data_loader")
    batches = torch.utils.data.BatchSampler(sampler, batch_size=2, drop_last=False)
    list(accelerate.BatchSamplerShard(batches, num_processes=2, process_index=1))
    assert sampler.seen[-1] == "accelerate's BatchSamplerShard"

    # Draws with replacement are no order: each rank's share is independent draws either way.
    class Weighted(torch.utils.data.WeightedRandomSampler):
        seen: list[str] = []

        def __iter__(self):  # type: ignore[no-untyped-def]
            self.seen.append(_order())
            return super().__iter__()

    for replacement in (True, False):
        weighted = Weighted([1.0] * 4, 4, replacement=replacement)
        batches = torch.utils.data.BatchSampler(weighted, batch_size=2, drop_last=False)
        list(accelerate.BatchSamplerShard(batches, num_processes=2, process_index=0))
    assert Weighted.seen == ["", "accelerate's BatchSamplerShard"]

    # A stream every rank iterates whole under IterableDatasetShard: what it draws is an order.
    class Stream(torch.utils.data.IterableDataset):
        seen: list[str] = []

        def __iter__(self):  # type: ignore[no-untyped-def]
            self.seen.append(_order())
            yield from range(4)

    list(Stream())
    list(accelerate.IterableDatasetShard(Stream(), batch_size=2, num_processes=2))
    assert Stream.seen == ["", "accelerate's IterableDatasetShard"]
    transformers = pytest.importorskip("transformers.trainer_pt_utils")
    list(transformers.IterableDatasetShard(Stream(), batch_size=2, num_processes=2))
    assert Stream.seen[-1] == "transformers' IterableDatasetShard"

    # torch's DistributedSampler by its own __iter__ only: a subclass overriding it may shard
    # first (and then shuffle its share per rank), so it is not one.
    class Sized:  # a dataset whose len() the sampler asks as it shuffles
        seen: list[str] = []

        def __len__(self) -> int:
            self.seen.append(_order())
            return 4

    class Own(torch.utils.data.DistributedSampler):
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(range(len(self.dataset)))

    list(torch.utils.data.DistributedSampler(Sized(), num_replicas=2, rank=0))  # type: ignore[arg-type]
    assert Sized.seen[-1] == "torch's DistributedSampler"
    list(Own(Sized(), num_replicas=2, rank=0))  # type: ignore[arg-type]
    assert Sized.seen[-1] == ""

    lightning = pytest.importorskip("lightning.fabric.utilities.distributed")
    list(lightning.DistributedSamplerWrapper(sampler, num_replicas=2, rank=0, shuffle=False))
    assert sampler.seen[-1] == "Lightning's DistributedSamplerWrapper"


def test_a_dispatcher_reading_every_ranks_batches_is_known_whatever_splits_below_it() -> None:
    """Rule 6 knows accelerate's DataLoaderDispatcher by the function that reads for every rank
    (here in one process, where it is rank 0), over a plain sampler and over a BatchSamplerShard
    (which would otherwise be Rule 5's): whatever is drawn there, one rank draws it alone."""
    accelerate = pytest.importorskip("accelerate.data_loader")
    from accelerate.state import PartialState

    from rngcheck.ranks.scopes import NOT_READING, Reading, reading

    sampler = _Recording()
    list(torch.utils.data.DataLoader(range(4), sampler=sampler, batch_size=2))
    assert sampler.readings == [NOT_READING]
    collated: list[Reading] = []

    def collate(batch: list[int]) -> torch.Tensor:
        collated.append(reading())  # (its own share would be known below: the reader wins)
        return torch.tensor(batch)

    try:
        list(accelerate.DataLoaderDispatcher(list(range(4)), batch_size=2, sampler=sampler))
        batches = torch.utils.data.BatchSampler(sampler, batch_size=2, drop_last=False)
        shard = accelerate.BatchSamplerShard(batches, num_processes=2, process_index=0)
        list(
            accelerate.DataLoaderDispatcher(list(range(4)), batch_sampler=shard, collate_fn=collate)
        )
    finally:
        PartialState._reset_state()  # the dispatcher made accelerate's process state
    dispatcher = "accelerate's DataLoaderDispatcher"

    def read_alone(now: Reading) -> bool:
        return _label(now.reader) == dispatcher and now == Reading(reader=now.reader)

    assert len(sampler.readings) == 3 and all(map(read_alone, sampler.readings[1:]))
    assert collated and all(map(read_alone, collated)), collated


def _share() -> str:
    from rngcheck.ranks.scopes import reading

    return reading(skip=1).share


class _Shares(torch.utils.data.Dataset):
    """``n`` samples; records, as each is read, what rngcheck sees splitting the data (Rule 7)."""

    def __init__(self, n: int = 4) -> None:
        self.n, self.seen = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.seen.append(_share())
        return i


def test_a_ranks_own_share_of_the_data_is_known_where_its_loader_fetches_it() -> None:
    """Rule 7 knows a batch read for this rank's own share (its dataset's __getitem__ and its
    collate_fn, under torch's fetcher) from what splits the loader's data among the ranks: a
    sampler in the chain from its index sampler, or its dataset, holding a rank and a number of
    ranks above one. Not a loader whose data is not split, nor the sampler's own iteration, nor
    a stream every rank iterates whole (Rule 5's); a dispatcher wins (Rule 6)."""
    from rngcheck.ranks.scopes import NOT_READING, reading

    collated: list[str] = []

    def collate(batch: list[int]) -> list[int]:
        collated.append(_share())
        return batch

    def read(loader: Any) -> tuple[list[str], list[str]]:
        dataset, collated[:] = loader.dataset, []
        dataset.seen[:] = []
        list(loader)
        return sorted(set(dataset.seen)), sorted(set(collated))

    plain = torch.utils.data.DataLoader(_Shares(), batch_size=2, collate_fn=collate)
    assert read(plain) == ([""], [""])
    for replicas, label in ((1, ""), (2, "torch's DistributedSampler")):
        data = _Shares()
        split = torch.utils.data.DistributedSampler(data, num_replicas=replicas, rank=0)
        loader = torch.utils.data.DataLoader(data, 2, sampler=split, collate_fn=collate)
        assert read(loader) == ([label], [label]), replicas
    sampler = _Recording()  # the sampler's own iteration is no batch read
    list(torch.utils.data.DataLoader(_Shares(), 2, sampler=sampler, collate_fn=collate))
    assert sampler.readings == [NOT_READING]

    class Megatron(torch.utils.data.Sampler):  # a batch sampler of Megatron-LM's pattern
        data_parallel_size, data_parallel_rank = 2, 1

        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from ([0, 1], [2, 3])

    megatron = torch.utils.data.DataLoader(_Shares(), batch_sampler=Megatron())
    assert [label.rpartition("'s ")[2] for label in read(megatron)[0]] == ["Megatron"]

    # A stream that splits itself by rank after it shuffles: what it draws as it is iterated is
    # its order (every rank must draw alike), so not the rank's own; its collation is.
    class SelfSplit(torch.utils.data.IterableDataset):
        num_replicas, rank = 2, 0
        seen: list[Any] = []

        def __iter__(self):  # type: ignore[no-untyped-def]
            self.seen.append(reading())
            yield from torch.randperm(8)[self.rank :: self.num_replicas].tolist()

    collated[:] = []
    list(torch.utils.data.DataLoader(SelfSplit(), batch_size=2, collate_fn=collate))
    assert SelfSplit.seen == [NOT_READING]
    assert len(collated) == 2 and {c.rpartition("'s ")[2] for c in collated} == {"SelfSplit"}

    accelerate = pytest.importorskip("accelerate.data_loader")
    shard = accelerate.prepare_data_loader(
        torch.utils.data.DataLoader(_Shares(8), 2, shuffle=True, collate_fn=collate),
        num_processes=2,
        process_index=1,
        put_on_device=False,
    )
    ours = "accelerate's BatchSamplerShard"
    assert read(shard) == ([ours], [ours])
    assert read(accelerate.skip_first_batches(shard, 1)) == ([ours], [ours])

    class Stream(torch.utils.data.IterableDataset):
        seen: list[Any] = []

        def __iter__(self):  # type: ignore[no-untyped-def]
            self.seen.append(reading())
            yield from range(4)

    stream = accelerate.IterableDatasetShard(Stream(), batch_size=2, num_processes=2)
    collated[:] = []
    list(torch.utils.data.DataLoader(stream, batch_size=2, collate_fn=collate))
    assert collated == ["accelerate's IterableDatasetShard"]  # the rank's own batch
    shuffled = Stream.seen[-1]  # ... while what the stream draws is Rule 5's order
    assert (_label(shuffled.order), shuffled.share) == ("accelerate's IterableDatasetShard", "")


def test_an_order_split_among_the_ranks_is_not_excused_by_per_rank_seeds_or_drift() -> None:
    """Rules 3 and 2's wake step aside when the divergent op drew an order a sampler splits: the
    gathered details decide it, so every rank judges alike."""
    from rngcheck.ranks.generators import data_parallel_drift, per_rank_seeding
    from rngcheck.ranks.integrations import hook_of
    from rngcheck.ranks.localise import Spot
    from rngcheck.ranks.verdict import Apart, Compare, Domain, Reason, Verdict

    def event(rank: int) -> RandomOpEvent:
        return RandomOpEvent(
            seq=3,
            op="aten.randperm.generator",
            generator=GeneratorId(kind="default", device="cpu"),
            device="cpu",
            args=("n=8",),
            before=10 + rank,
            after=20 + rank,
            phase=Phase.FORWARD,
            stack=Stack(frames=(Frame(filename="/app/data.py", lineno=5, name="shuffle"),)),
            seed=rank,
        )

    windows = {0: [_row("randperm", 10, 20)], 1: [_row("randperm", 11, 21)]}
    spot = localise(windows, {0: Point.EXIT, 1: Point.EXIT})
    assert isinstance(spot, Spot) and spot.kind == "state"
    stream = "transformers' IterableDatasetShard"
    moved = Apart(Reason.OWN_BATCH, "DDP")
    sources = {
        "torch's DistributedSampler": "torch.utils.data.distributed:DistributedSampler.__iter__",
        stream: "transformers.trainer_pt_utils:IterableDatasetShard.__iter__",
    }
    for order in ("", "torch's DistributedSampler", stream):
        scope = (
            Verdict(Domain.GROUP, Compare.STATE, Reason.ORDER, order, sources[order], firm=True)
            if order
            else None
        )
        assert scope is None or hook_of(scope.source) is not None
        details = {
            r: Detail(event=event(r), point="exit", apart=moved, order=scope) for r in (0, 1)
        }
        excused = (per_rank_seeding(spot, details), data_parallel_drift(spot, details))
        if order:
            assert excused == (None, None)
            cause = build_finding(spot, windows, details, (0, 1)).cause
            what = (
                "has every rank iterate the whole stream" if order == stream else "splits one order"
            )
            assert cause.startswith(f"{order} {what}"), cause
            assert "Why default cpu differs: the ranks drew different amounts" in cause, cause
            assert "{" not in cause, cause
        else:
            assert excused[0] is not None  # seeded per rank: a per-rank stream
