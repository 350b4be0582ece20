"""Scopes nest by one rule, whatever the library: a declaration (``rngcheck.expect``, a DTensor's
mesh) wins over what a library's scope says and over what was learnt from a mismatch. Real gloo
ranks and DDP."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist import run_scenarios, scenario_mode

import rngcheck


def _per_rank_stream_then(rank: int, declared: str) -> dict[str, Any]:
    """Under DDP, a data generator seeded per rank (learnt as a per-rank stream, quiet), then
    one draw from it under ``expect(declared)``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    with scenario_mode() as mode:
        model = DDP(torch.nn.Linear(4, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(100 + rank)
        for _ in range(3):
            x = torch.rand(2, 4, generator=data)  # each rank's own data
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        with rngcheck.expect(declared):
            torch.rand(1, generator=data)
        torch.distributed.barrier()
    report = mode.report
    return {
        "findings": [{"message": f.message, "kind": f.kind.value} for f in report.findings],
        "notes": [n.message for n in report.notes],
    }


def declared_same_on_a_learnt_per_rank_stream(rank: int, world: int) -> dict[str, Any]:
    return _per_rank_stream_then(rank, "same")


def declared_differ_on_a_learnt_per_rank_stream(rank: int, world: int) -> dict[str, Any]:
    return _per_rank_stream_then(rank, "differ")


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return run_scenarios(
        __file__,
        [
            "declared_differ_on_a_learnt_per_rank_stream",
            "declared_same_on_a_learnt_per_rank_stream",
        ],
        world_size=2,
        out_dir=tmp_path_factory.mktemp("scopes"),
        timeout=180,
    )


@pytest.mark.distributed
def test_a_declaration_wins_over_what_was_learnt(two: Any) -> None:
    """The generator was learnt to be a per-rank stream (its draws quiet, the note says so);
    a draw from it the user declares must agree is still compared, and found; one declared to
    differ is quiet."""
    for rank, r in two.ok("declared_differ_on_a_learnt_per_rank_stream").items():
        assert r["findings"] == [], (rank, r["findings"])
        assert "Generator #1 (cpu) is seeded differently on each rank" in "\n".join(r["notes"])
    for rank, r in two.ok("declared_same_on_a_learnt_per_rank_stream").items():
        assert len(r["findings"]) == 1, (rank, r["findings"], r["notes"])
        f = r["findings"][0]
        assert f["kind"] == "rank_divergence", f
        assert f["message"].startswith("ranks that must hold the same Generator #1 (cpu"), f
