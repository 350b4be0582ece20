"""Culprits across ranks, on real gloo ranks: the seeding call a cross-rank cause names is a frame
of the finding (``finding.culprits``, in the API and the JSON report), a DTensor op's finding says
why its mesh's ranks must agree, and DTensor random ops that torch draws from the default
generator instead of the ``generator=`` passed (a mesh without DTensor's RNG tracker: CPU) are
checked as draws from it, with a note.

The scenarios run inside the spawned ranks (``tests/_dist.py``); each returns its findings as
their JSON, as a saved report holds them.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from _dist import scenario_mode

pytestmark = pytest.mark.distributed

_HERE = __file__
_FAST = 10.0  # exchange timeout inside scenarios (seconds)


def _line() -> int:
    """The line after the caller's: put it just above the call a finding should name."""
    return sys._getframe(1).f_lineno + 1


def _summary(mode: Any, **lines: int) -> dict[str, Any]:
    report = mode.report
    return {
        "findings": [f.to_dict() for f in report.findings],
        "notes": [n.to_dict() for n in report.notes],
        "random_ops": report.random_ops,
        "compared": dict(report.meta.get("rank_compared", {})),
        "rendered": mode.console.file.getvalue(),
        **lines,
    }


# ---------------------------------------------------------------------------------------------
# Scenarios: run in every rank as fn(rank, world_size)


def seed_before_the_model(rank: int, world: int) -> dict[str, Any]:
    """``torch.manual_seed(seed + rank)`` before building a replicated model nothing broadcasts."""
    with scenario_mode(timeout=_FAST) as mode:
        line = _line()
        torch.manual_seed(1234 + rank)  # the bug
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    return _summary(mode, line=line)


def reseeded_after_the_model(rank: int, world: int) -> dict[str, Any]:
    """A replicated model built alike, then ``torch.manual_seed(seed + rank)`` before its
    dropout: not a seed before building the model."""
    torch.manual_seed(0)
    with scenario_mode(timeout=_FAST) as mode:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        line = _line()
        torch.manual_seed(100 + rank)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    return _summary(mode, line=line)


def tensor_parallel_reseeded_after_it_was_built(rank: int, world: int) -> dict[str, Any]:
    """A tensor-parallel MLP built alike on every rank, then ``torch.manual_seed(seed + rank)``
    (after the model was built), then dropout on its replicated DTensor output; and a second
    run where rank 1 alone reseeds before dropout on a sharded DTensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    with scenario_mode(timeout=_FAST) as mode:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        kept = RowwiseParallel(output_layouts=Replicate(), use_local_output=False)
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": kept})
        y = model(torch.ones(2, 8))
        line = _line()
        torch.manual_seed(100 + rank)  # the bug: a seed that depends on the rank
        dropout_line = _line()
        torch.nn.functional.dropout(y, 0.5)
    out["reseeded"] = _summary(mode, line=line, dropout_line=dropout_line)

    torch.manual_seed(0)
    s = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    with scenario_mode(timeout=_FAST, sync="op") as mode:
        torch.nn.functional.dropout(s, 0.5)
        line = _line()
        if rank == 1:
            torch.manual_seed(99)  # rank 1 alone
        torch.nn.functional.dropout(s, 0.5)
    out["alone"] = _summary(mode, line=line + 1)
    return out


def flow_after_a_reseed(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 reseeds and draws an extra number: the extra op's cause names the reseed."""
    torch.manual_seed(0)
    with scenario_mode(timeout=_FAST) as mode:
        torch.rand(2)
        if rank == 1:
            line = _line()
            torch.manual_seed(5)
            torch.rand(1)
        torch.rand(2)
    return _summary(mode, line=locals().get("line", 0))


def per_rank_stream_not_offset(rank: int, world: int) -> dict[str, Any]:
    """expect("differ") on a generator seeded alike on every rank: the seeding call is blamed."""
    import rngcheck

    with scenario_mode(timeout=_FAST) as mode:
        line = _line()
        torch.manual_seed(100)  # alike on every rank: the per-rank stream is not offset
        with rngcheck.expect("differ"):
            torch.rand(4)
    return _summary(mode, line=line)


def generator_on_a_cpu_mesh(rank: int, world: int) -> dict[str, Any]:
    """The DTensor RNG-semantics discussion's test_init_with_user_generator on a CPU mesh: torch
    drops the generator= of a DTensor random op there and draws from the default generator.
    Quiet, with every op checked; then rank 1 draws once more with the generator passed, which
    moves the default generator on rank 1 alone."""
    import torch.distributed.tensor as dt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for case in ("quiet", "extra"):
        torch.manual_seed(42)
        rng = torch.Generator().manual_seed(42)
        with scenario_mode(timeout=_FAST) as mode:
            t1 = dt.empty((2, 3), device_mesh=mesh, placements=[Shard(0)])
            t2 = dt.empty((2, 3), device_mesh=mesh, placements=[Shard(0)])
            for _ in range(2):
                torch.nn.init.uniform_(t1, 0.0, 1.0)
                line = _line()
                torch.nn.init.uniform_(t2, 0.0, 1.0, rng)
            if case == "extra" and rank == 1:
                torch.nn.init.uniform_(t2, 0.0, 1.0, rng)
            torch.nn.init.uniform_(t1, 0.0, 1.0)
            torch.nn.init.uniform_(t2, 0.0, 1.0, rng)
        out[case] = _summary(mode, line=line)
    return out


# ---------------------------------------------------------------------------------------------
# The tests (parent side)

_TWO = [
    "seed_before_the_model",
    "reseeded_after_the_model",
    "tensor_parallel_reseeded_after_it_was_built",
    "flow_after_a_reseed",
    "per_rank_stream_not_offset",
    "generator_on_a_cpu_mesh",
]


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from _dist import run_scenarios

    return run_scenarios(_HERE, _TWO, world_size=2, out_dir=tmp_path_factory.mktemp("two"))


def _only(result: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in result, result.get("traceback", result)
    assert len(result["findings"]) == 1, [f["message"] for f in result["findings"]]
    return result["findings"][0]


def _culprits(finding: dict[str, Any]) -> list[tuple[str, str, list[int], str, int]]:
    """(kind, call, ranks, file, line) of each culprit, from the finding's JSON."""
    return [
        (c["kind"], c["call"], c["ranks"], c["frame"]["filename"], c["frame"]["lineno"])
        for c in finding["culprits"]
    ]


def test_a_rank_dependent_seed_before_the_model_is_a_frame_of_the_finding(two: Any) -> None:
    results = two.ok("seed_before_the_model")
    for rank, r in results.items():
        f = _only(r)
        line = r["line"]
        assert f["op"] == "aten.uniform_.default" and f["differs"] == "state", f["message"]
        assert _culprits(f) == [
            ("seed", "torch.manual_seed(1234)", [0], _HERE, line),
            ("seed", "torch.manual_seed(1235)", [1], _HERE, line),
        ], rank
        assert f"torch.manual_seed(1235) at test_rank_culprits.py:{line}" in f["cause"]
        assert "before building a replicated model" in f["cause"]  # (it was: an initialisation)


def test_a_rank_dependent_reseed_under_tensor_parallelism_is_a_frame_of_the_finding(
    two: Any,
) -> None:
    results = two.ok("tensor_parallel_reseeded_after_it_was_built")
    for r in results.values():
        reseeded = r["reseeded"]
        f = _only(reseeded)
        assert f["op"] == "aten.bernoulli_.float" and f["differs"] == "state", f["message"]
        line = reseeded["line"]
        assert [x for x in f["stack"] if x["user"]][-1]["lineno"] == reseeded["dropout_line"]
        assert _culprits(f) == [
            ("seed", "torch.manual_seed(100)", [0], _HERE, line),
            ("seed", "torch.manual_seed(101)", [1], _HERE, line),
        ]
        assert f"torch.manual_seed(101) at test_rank_culprits.py:{line}" in f["cause"]
        alone = r["alone"]
        f = _only(alone)
        assert "rank 1 changed default cpu outside a random op: torch.manual_seed(99)" in f["cause"]
        assert _culprits(f) == [("seed", "torch.manual_seed(99)", [1], _HERE, alone["line"])]


def test_a_dtensor_finding_says_why_its_mesh_must_agree(two: Any) -> None:
    """The op's mesh ranks and placements, DTensor's contract; and a reseed after the model was
    built is not explained as a seed before building a replicated model."""
    for r in two.ok("tensor_parallel_reseeded_after_it_was_built").values():
        cause = _only(r["reseeded"])["cause"]
        assert "The op ran on a DTensor placed [Replicate()] over a DeviceMesh" in cause
        assert "(dimension 'tp') of ranks 0-1" in cause, cause
        assert "every rank of the mesh holds the same generator state" in cause
        assert "before building a replicated model" not in cause
        assert "seed every rank of the mesh alike" in cause
        cause = _only(r["alone"])["cause"]
        assert "placed [Shard(dim=0)] over a DeviceMesh (dimension 'tp') of ranks 0-1" in cause


def test_a_reseed_after_the_model_was_built_is_not_a_seed_before_building_it(two: Any) -> None:
    for r in two.ok("reseeded_after_the_model").values():
        f = _only(r)
        assert f["op"] == "aten.bernoulli_.float" and f["differs"] == "state", f["message"]
        assert "the ranks seeded default cpu differently" in f["cause"]
        assert "before building a replicated model" not in f["cause"]
        assert "makes ranks that must draw alike draw apart" in f["cause"]
        assert [c["frame"]["lineno"] for c in f["culprits"]] == [r["line"]] * 2


def test_an_extra_op_after_a_reseed_names_the_reseed(two: Any) -> None:
    results = two.ok("flow_after_a_reseed")
    line = results[1]["line"]
    for r in results.values():
        f = _only(r)
        assert f["differs"] == "op" and "it comes right after torch.manual_seed(5)" in f["cause"]
        assert _culprits(f) == [("seed", "torch.manual_seed(5)", [1], _HERE, line)]


def test_a_stream_that_must_differ_names_the_seed_it_shares(two: Any) -> None:
    for r in two.ok("per_rank_stream_not_offset").values():
        f = _only(r)
        assert f["kind"] == "rank_collision" and "torch.manual_seed(100)" in f["cause"]
        assert _culprits(f) == [("seed", "torch.manual_seed(100)", [0, 1], _HERE, r["line"])]


def test_dtensor_ops_that_draw_from_the_default_generator_are_counted_and_noted(
    two: Any,
) -> None:
    """Before: the ops given generator= were dropped as having drawn nothing (3 of 6 checked),
    so rank 1's extra draw went unseen."""
    results = two.ok("generator_on_a_cpu_mesh")
    for rank, r in results.items():
        quiet = r["quiet"]
        assert not quiet["findings"], quiet["findings"]
        assert quiet["random_ops"] == 6 and quiet["compared"]["by_state"] == 6, quiet
        notes = [n for n in quiet["notes"] if n["kind"] == "drew_from_default"]
        assert [n["count"] for n in notes] == [2, 1]  # (one per line)
        note = notes[0]
        message = note["message"]
        assert "2 DTensor random op(s) (aten.uniform_.default) at test_rank_culprits.py:" in message
        assert "were passed generator=Generator #1 (cpu" in note["message"]
        assert "but drew from default cpu" in note["message"]
        assert [x for x in note["stack"] if x["user"]][-1]["lineno"] == quiet["line"]

        extra = r["extra"]
        f = _only(extra)
        assert f["kind"] == "rank_divergence" and f["differs"] == "op", (rank, f["message"])
        assert f["op"] == "aten.uniform_.default"
        assert "rank 1 ran an extra random op, aten.uniform_.default on default cpu" in f["cause"]
        assert "placed [Shard(dim=0)]" in f["cause"]
