"""Zero perturbation across ranks: DDP training with checkpointed dropout, and DTensor random ops,
give bitwise the same parameters, outputs and final generator states with and without the
checker, on real gloo process groups (2 ranks)."""

from __future__ import annotations

import contextlib
import hashlib
import io
from typing import Any

import pytest
import torch
from _dist import assert_compared, compared

_HERE = __file__


# -- scenarios (run in every rank; return plain data) ---------------------------------------------


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _ddp_run(checked: bool, sync: str) -> dict[str, Any]:
    import rich.console
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.checkpoint import checkpoint

    import rngcheck

    torch.manual_seed(0)
    inner = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 8)
    )
    model = DDP(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    console = rich.console.Console(file=io.StringIO())
    mode = rngcheck.RNGConsistencyMode(sync=sync, timeout=20.0, console=console)
    outputs = []
    with mode if checked else contextlib.nullcontext():
        for _ in range(3):
            x = torch.randn(4, 8, requires_grad=True)
            y = checkpoint(model, x, use_reentrant=False)
            y.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            outputs.append(y.detach())
    return {
        "params": _digest(list(inner.parameters())),
        "outputs": _digest(outputs),
        "rng": _digest([torch.get_rng_state()]),
        "ok": mode.report.ok if checked else True,
        "random_ops": mode.report.random_ops if checked else 0,
        "compared": compared(mode.report) if checked else None,
    }


def _dtensor_run(checked: bool) -> dict[str, Any]:
    import rich.console
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import rngcheck

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,))
    console = rich.console.Console(file=io.StringIO())
    mode = rngcheck.RNGConsistencyMode(sync="op", timeout=20.0, console=console)
    outs = []
    with mode if checked else contextlib.nullcontext():
        r = distribute_tensor(torch.ones(8, 8), mesh, [Replicate()])
        s = distribute_tensor(torch.ones(8, 8), mesh, [Shard(0)])
        for _ in range(2):
            r = torch.nn.functional.dropout(r, 0.5)
            s = torch.nn.functional.dropout(s, 0.5)
            outs += [r.to_local(), s.to_local()]
    return {
        "outputs": _digest(outs),
        "rng": _digest([torch.get_rng_state()]),
        "ok": mode.report.ok if checked else True,
        "compared": compared(mode.report) if checked else None,
    }


def ddp_plain_vs_checked(rank: int, world: int) -> dict[str, Any]:
    return {
        "plain": _ddp_run(False, "step"),
        "step": _ddp_run(True, "step"),
        "op": _ddp_run(True, "op"),
    }


def dtensor_plain_vs_checked(rank: int, world: int) -> dict[str, Any]:
    return {"plain": _dtensor_run(False), "checked": _dtensor_run(True)}


# -- the test (parent side) -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from _dist import run_scenarios

    names = ["ddp_plain_vs_checked", "dtensor_plain_vs_checked"]
    return run_scenarios(_HERE, names, world_size=2, out_dir=tmp_path_factory.mktemp("perturb"))


def test_ddp_training_is_bitwise_identical_with_and_without_the_checker(runs: Any) -> None:
    for rank, r in runs["ddp_plain_vs_checked"].items():
        assert "error" not in r, r.get("traceback")
        for sync in ("step", "op"):
            checked = r[sync]
            assert checked["ok"] and checked["random_ops"] > 0, (rank, sync, checked)
            # The inputs of the 3 steps, by state (the default generator seeded alike); the
            # dropout of DDP's forward and of its recompute in backward, each rank's own.
            assert_compared(checked["compared"], rank, by_state=3, not_compared={"own_batch": 6})
            for key in ("params", "outputs", "rng"):
                assert checked[key] == r["plain"][key], (rank, sync, key)


def test_dtensor_random_ops_are_bitwise_identical_with_and_without_the_checker(runs: Any) -> None:
    for rank, r in runs["dtensor_plain_vs_checked"].items():
        assert "error" not in r, r.get("traceback")
        assert r["checked"]["ok"], (rank, r)
        # The replicated and the sharded dropout, twice each, by state over the mesh.
        assert_compared(r["checked"]["compared"], rank, by_state=4, not_compared={})
        assert r["checked"]["outputs"] == r["plain"]["outputs"], rank
        assert r["checked"]["rng"] == r["plain"]["rng"], rank
