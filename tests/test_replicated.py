"""Replicated parameters are an invariant: what a wrapper (DDP) or a DTensor placement
(``Replicate``) says is replicated is compared across its group by digest at the first step, and
the initialisations rngcheck recorded explain a difference instead of deciding it. Real gloo
ranks, real DDP and DTensor; every run is also checked against the same training without
rngcheck."""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import pytest
import torch
from _dist import run_scenarios, scenario_mode


def _train(model: torch.nn.Module, params: Any, rank: int, steps: int = 2) -> str:
    opt = torch.optim.SGD(params, lr=0.1)
    for _ in range(steps):
        model(torch.ones(2 + rank, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    data = b"".join(p.detach().reshape(-1).numpy().tobytes() for p in model.parameters())
    return hashlib.sha256(data).hexdigest()


def _summary(mode: Any, **extra: Any) -> dict[str, Any]:
    report = mode.report
    return {
        "findings": [
            {
                "message": f.message,
                "cause": f.cause,
                "op": f.op,
                "differs": f.differs,
                "ranks": list(f.ranks),
                "lines": [fr.line for fr in f.stack.user_frames],
            }
            for f in report.findings
        ],
        "compared": report.meta.get("rank_compared", {}),
        **extra,
    }


def _ddp(rank: int, checked: bool, edit: Any = None, **ddp: Any) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    with scenario_mode() if checked else _nothing() as mode:
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.2))
        if edit is not None:
            edit(net, rank)
        model = DDP(net, **ddp)
        digest = _train(model, model.parameters(), rank)
    return _summary(mode, digest=digest) if mode is not None else {"digest": digest}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def ddp_correct(rank: int, world: int) -> dict[str, Any]:
    """Correct DDP (it broadcast the module when built): every replicated parameter agrees."""
    return {**_ddp(rank, True), "plain": _ddp(rank, False)["digest"]}


def _loaded_on_rank0(net: torch.nn.Module, rank: int) -> None:
    """A checkpoint loaded on rank 0 alone, before a DDP that does not broadcast: no random op
    shows it."""
    if rank == 0:
        with torch.no_grad():
            net[0].bias.fill_(0.5)


def ddp_loaded_on_one_rank_without_init_sync(rank: int, world: int) -> dict[str, Any]:
    return _ddp(rank, True, _loaded_on_rank0, init_sync=False)


def ddp_loaded_on_one_rank_with_init_sync(rank: int, world: int) -> dict[str, Any]:
    """The same load, but DDP broadcasts rank 0's states as it is built: quiet."""
    return _ddp(rank, True, _loaded_on_rank0)


def _replicated_dtensor(rank: int, checked: bool, value: Any) -> dict[str, Any]:
    """A layer whose bias is a DTensor Replicate over a 'tp' mesh of every rank (as a row-wise
    parallel layer's bias), set from ``value(rank)`` with no random op."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    torch.manual_seed(0)
    with scenario_mode() if checked else _nothing() as mode:
        mesh = init_device_mesh(
            "cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("tp",)
        )
        local = torch.full((4,), float(value(rank)))
        bias = torch.nn.Parameter(DTensor.from_local(local, mesh, [Replicate()], run_check=False))
        weight = torch.nn.Parameter(torch.ones(4, 4))

        def step() -> None:
            out = torch.ones(2, 4) @ weight + bias.to_local()
            out.sum().backward()

        opt = torch.optim.SGD([weight, bias], lr=0.1)
        for _ in range(2):
            step()
            opt.step()
            opt.zero_grad()
    return _summary(mode) if mode is not None else {}


def dtensor_replicated_alike(rank: int, world: int) -> dict[str, Any]:
    return _replicated_dtensor(rank, True, lambda r: 1.0)


def dtensor_replicated_apart(rank: int, world: int) -> dict[str, Any]:
    return _replicated_dtensor(rank, True, lambda r: 1.0 + r)


def ddp_seed_plus_rank_without_init_sync(rank: int, world: int) -> dict[str, Any]:
    """The classic bug: seed + rank before a replicated model no one broadcasts. The digests
    differ, and the initialisations explain it: the finding is theirs, as before."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    with scenario_mode() as mode:
        torch.manual_seed(7 + rank)
        line = sys._getframe().f_lineno + 1
        model = DDP(torch.nn.Linear(4, 4), init_sync=False)
        _train(model, model.parameters(), rank)
    return _summary(mode, line=line)


def _edited_mid_training(rank: int, level: str, edit_at: int | None) -> dict[str, Any]:
    """DDP trained 12 steps at ``level`` (the step level samples steps 1-2, then every 5th);
    at step ``edit_at`` rank 1 alone nudges a weight (no random op shows it; DDP averages the
    gradients, not the weights, so the replicas stay apart)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    with scenario_mode(level=level, sample_every=5) as mode:
        model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.2)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(12):
            model(torch.ones(2 + rank, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            if step == edit_at and rank == 1:
                with torch.no_grad():
                    model.module[0].weight[0, 0] += 1.0
    return _summary(mode, steps=[f.get("first_step") for f in mode.report.to_dict()["findings"]])


def step_level_replicas_edited_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    return _edited_mid_training(rank, "step", edit_at=6)


def step_level_replicas_left_alone(rank: int, world: int) -> dict[str, Any]:
    return _edited_mid_training(rank, "step", edit_at=None)


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return run_scenarios(
        __file__,
        [
            "ddp_correct",
            "ddp_loaded_on_one_rank_with_init_sync",
            "dtensor_replicated_alike",
            "ddp_seed_plus_rank_without_init_sync",
            "step_level_replicas_left_alone",
            "dtensor_replicated_apart",
            "step_level_replicas_edited_on_one_rank",
            "ddp_loaded_on_one_rank_without_init_sync",
        ],
        world_size=2,
        out_dir=tmp_path_factory.mktemp("replicated"),
        timeout=180,
    )


pytestmark = pytest.mark.distributed


def test_replicated_parameters_that_agree_are_compared_and_quiet(two: Any) -> None:
    """DDP's module parameters (both of Linear's) and a DTensor replicated over the mesh are
    compared by digest at the first step, and agree; training is bitwise the same."""
    for rank, r in two.ok("ddp_correct").items():
        assert r["findings"] == [], (rank, r["findings"])
        assert r["compared"]["replicated_parameters"] == 2, r["compared"]
        assert r["digest"] == r["plain"], rank
    for name in ("ddp_loaded_on_one_rank_with_init_sync", "dtensor_replicated_alike"):
        for rank, r in two.ok(name).items():
            assert r["findings"] == [], (name, rank, r["findings"])
            assert r["compared"]["replicated_parameters"] >= 1, (name, r["compared"])


def test_a_parameter_loaded_on_one_rank_is_found_by_its_digest(two: Any) -> None:
    """No random op shows a checkpoint loaded on rank 0 alone; DDP(init_sync=False) keeps the
    difference. The digests of what DDP holds as replicated differ at the first step."""
    for rank, r in two.ok("ddp_loaded_on_one_rank_without_init_sync").items():
        assert len(r["findings"]) == 1, (rank, r["findings"])
        f = r["findings"][0]
        assert f["differs"] == "parameter" and f["ranks"] == [0, 1], f
        assert f["message"].startswith(
            "replicated parameters differ across ranks: module.0.bias holds different values on "
            "rank 0 and rank 1, where DistributedDataParallel over ranks 0-1 says it is "
            "replicated over ranks 0-1"
        ), f
        assert "no random op rngcheck saw explains it" in f["cause"], f
        assert "a checkpoint loaded on one rank" in f["cause"], f


def test_a_dtensor_replicated_apart_is_found(two: Any) -> None:
    for rank, r in two.ok("dtensor_replicated_apart").items():
        assert len(r["findings"]) == 1, (rank, r["findings"])
        f = r["findings"][0]
        assert f["message"].startswith(
            "replicated parameters differ across ranks: parameter 1 of SGD holds different "
            "values on rank 0 and rank 1, where a DTensor replicated over mesh dimension 'tp' "
            "says it is replicated over ranks 0-1"
        ), f


def test_initialisations_explain_a_difference_as_theirs(two: Any) -> None:
    """seed + rank before a DDP that does not broadcast: the digests differ, and the recorded
    initialisations drew from different states, so the finding names them (as it did when the
    initialisations decided): the op, both seeding calls, and the model's line."""
    results = two.ok("ddp_seed_plus_rank_without_init_sync")
    line = results[0]["line"]
    for rank, r in results.items():
        assert len(r["findings"]) == 1, (rank, r["findings"])
        f = r["findings"][0]
        assert f["op"] == "aten.uniform_.default" and f["ranks"] == [0, 1], f
        assert f["message"].startswith("parameters initialised differently across ranks"), f
        assert "torch.manual_seed(7) at" in f["cause"] and "torch.manual_seed(8) at" in f["cause"]
        assert "DistributedDataParallel over ranks 0-1 does not broadcast" in f["cause"], f
        assert any("torch.nn.Linear(4, 4), init_sync=False" in x for x in f["lines"]), f
        assert r["compared"]["replicated_parameters"] == 2, r["compared"]
        assert r["compared"]["initialisations"] == 0, r["compared"]  # (explaining, not deciding)
    assert line


def test_the_step_level_compares_replicas_again_at_sampled_steps(two: Any) -> None:
    """At the step level the replicated parameters are compared again at each sampled step
    (read at its first forward): a weight one rank nudged after step 7 is found at the next
    sampled step, by its digest. Left alone, every sampled step compares them and stays quiet."""
    for rank, r in two.ok("step_level_replicas_left_alone").items():
        assert r["findings"] == [], (rank, r["findings"])
        # the first step's two parameters, then again at (at least two) sampled steps
        assert r["compared"]["replicated_parameters"] >= 2 * 3, r["compared"]
    for rank, r in two.ok("step_level_replicas_edited_on_one_rank").items():
        assert len(r["findings"]) == 1, (rank, r["findings"])
        f = r["findings"][0]
        assert f["message"].startswith(
            "replicated parameters differ across ranks: module.0.weight holds different values "
            "on rank 0 and rank 1"
        ), f
        assert len(r["steps"]) == 1 and 7 < r["steps"][0] <= 12, r["steps"]  # (sampled after)
