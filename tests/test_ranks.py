"""Cross-rank checks on real gloo process groups (2 and 4 CPU processes on 127.0.0.1).

The scenarios below run inside the spawned ranks (``tests/_dist.py`` starts them once per world
size and runs several scenarios in one process group); the tests in the parent assert on what a
user would see: the finding's kind, ranks, op, the user's file:line, the cause, and that only one
rank drew it. Every launch has a hard timeout and every checker a short exchange timeout.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _dist import assert_compared, compared, scenario_mode

pytestmark = pytest.mark.distributed

_HERE = __file__
_FAST = 10.0  # exchange timeout inside scenarios (seconds): nothing waits long


# ---------------------------------------------------------------------------------------------
# Scenarios: run in every rank as fn(rank, world_size); return plain data


def _mode(**kwargs: Any) -> Any:
    kwargs.setdefault("timeout", _FAST)
    return scenario_mode(**kwargs)


def _line() -> int:
    """The line after the caller's: put it just above the op a finding should point at."""
    return sys._getframe(1).f_lineno + 1


def _summary(mode: Any, error: BaseException | None = None) -> dict[str, Any]:
    report = mode.report
    findings = [error.finding] if error is not None else report.findings
    out: dict[str, Any] = {
        "ok": report.ok,
        "rank": report.rank,
        "world_size": report.world_size,
        "raised": type(error).__name__ if error is not None else None,
        "stats": dict(report.meta.get("rank_exchange", {})),
        "compared": compared(report),
        "rendered": mode.console.file.getvalue(),
        "findings": [],
    }
    for f in findings:
        out["findings"].append(
            {
                "kind": f.kind.value,
                "ranks": list(f.ranks),
                "op": f.op,
                "site": f.site,
                "other_site": f.other_stack.describe() if f.other_stack is not None else None,
                "message": f.message,
                "cause": f.cause,
                "differs": f.differs,
                "sides": [
                    {
                        "label": s.label,
                        "ranks": list(s.ranks),
                        "op": s.event.op if s.event is not None else None,
                        "site": s.event.site if s.event is not None else None,
                        "note": s.note,
                    }
                    for s in f.sides
                ],
            }
        )
    return out


def _raising(body: Callable[[dict[str, Any]], None], **kwargs: Any) -> dict[str, Any]:
    """Run ``body(notes)`` under a checker that raises; return what a user would see, plus the
    ``notes`` the body wrote before the error (the lines it expects to be named)."""
    import rngcheck

    mode = _mode(on_finding="raise", **kwargs)
    notes: dict[str, Any] = {}
    error = None
    try:
        with mode:
            body(notes)
    except rngcheck.RNGCheckError as e:
        error = e
    return {**_summary(mode, error), **notes}


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    import torch.distributed as dist

    x = torch.ones(4, 8)
    loss = model(x).sum()
    loss.backward()
    for p in model.parameters():  # a hand-rolled DDP: the all_reduce is an alignment point
        dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()


def _clean(sync: str, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    with _mode(sync=sync) as mode:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(steps):
            _train_step(model, opt)
    return _summary(mode)


def clean_training(rank: int, world: int) -> dict[str, Any]:
    return _clean("step", 3)


def clean_training_op_sync(rank: int, world: int) -> dict[str, Any]:
    return _clean("op", 2)


def pair_streams(rank: int, world: int) -> dict[str, Any]:
    """Streams over pairs of ranks (tensor-parallel style): checked on per-pair gloo groups, so
    each rank's cost does not depend on how many pairs there are."""
    import rngcheck

    torch.manual_seed(0)
    pair = [rank - rank % 2, rank - rank % 2 + 1]
    tp = torch.Generator().manual_seed(100 + rank)  # must differ within the pair
    with _mode() as mode:
        for _ in range(3):
            with rngcheck.expect("differ", group=pair):
                torch.rand(4, generator=tp)
            torch.nn.functional.dropout(torch.ones(8), 0.5)  # world-wide "same"
            mode.check()
    return _summary(mode)


def rank_seed(rank: int, world: int) -> dict[str, Any]:
    with _mode() as mode:
        line = _line()
        torch.manual_seed(1234 + rank)  # the bug: a rank-dependent seed before a replicated model
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _train_step(model, opt)
    return {**_summary(mode), "line": line}


def extra_draw(rank: int, world: int) -> dict[str, Any]:
    def body(notes: dict[str, Any]) -> None:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _train_step(model, opt)
        if rank == 1:
            notes["line"] = _line()
            torch.rand(1)  # one rank draws one extra number
        _train_step(model, opt)

    torch.manual_seed(0)
    return _raising(body)


def drift_found_one_step_later(rank: int, world: int) -> dict[str, Any]:
    """sync="step" without collectives: each optimizer step's round stays in flight until the
    next exchange point, so an extra draw in step 1 is reported at step 2's optimizer step."""

    def body(notes: dict[str, Any]) -> None:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            notes["reached"] = step
            model(torch.ones(2, 8)).sum().backward()
            if step == 1 and rank == 1:
                notes["line"] = _line()
                torch.rand(1)  # one rank draws one extra number in step 1
            opt.step()
            notes["stepped"] = step

    torch.manual_seed(0)
    return _raising(body)


def user_generator(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    with _mode() as mode:
        gen = torch.Generator().manual_seed(7)
        noise = torch.randn(4, generator=gen)
        if rank == 1:
            line = _line()
            torch.randn(2, generator=gen)  # advances the user Generator on one rank only
        noise = noise + torch.randn(4, generator=gen)
        mode.check()
    return {**_summary(mode), "line": locals().get("line")}


def dataloader_one_rank(rank: int, world: int) -> dict[str, Any]:
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2)
    with _mode() as mode:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if rank == 0:
            line = _line()
            next(iter(loader))  # peeking at the data on rank 0 only draws a base seed there
        _train_step(model, opt)
    return {**_summary(mode), "line": locals().get("line")}


def ignored_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    """An ignored block that draws from the default generator on rank 0 only (an eval sample)."""
    import rngcheck

    torch.manual_seed(0)
    with _mode() as mode:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if rank == 0:
            with rngcheck.expect("ignore"):
                ignored_line = _line()
                torch.rand(3)  # not compared, but it moves the default generator on rank 0
        _train_step(model, opt)
    return {**_summary(mode), "ignored_line": locals().get("ignored_line")}


def differ_streams(rank: int, world: int) -> dict[str, Any]:
    import rngcheck

    torch.manual_seed(0)
    results = {}
    for name, seed in (("offset", 100 + rank), ("collide", 100)):
        with _mode() as mode:
            aug = torch.Generator().manual_seed(seed)  # the per-rank augmentation stream
            with rngcheck.expect("differ"):
                line = _line()
                torch.rand(4, generator=aug)
            torch.nn.functional.dropout(torch.ones(8), 0.5)  # the shared stream stays "same"
        results[name] = {**_summary(mode), "line": line}
    return results


def dtensor_replicate(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    x = distribute_tensor(torch.ones(8, 8), mesh, [Replicate()])
    s = distribute_tensor(torch.ones(8, 8), mesh, [Shard(0)])
    out = {}
    with _mode(sync="op") as mode:
        for _ in range(2):
            x = torch.nn.functional.dropout(x, 0.5)
            s = torch.nn.functional.dropout(s, 0.5)
    out["clean"] = _summary(mode)

    def drift(notes: dict[str, Any]) -> None:
        y = torch.nn.functional.dropout(x, 0.5)
        if rank == 1:
            notes["seed_line"] = _line()
            torch.manual_seed(99)  # this rank's generator drifts from the mesh's
        notes["line"] = _line()
        torch.nn.functional.dropout(y, 0.5)

    out["drift"] = _raising(drift, sync="op")
    return out


def op_sync_before_collective(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    def body(notes: dict[str, Any]) -> None:
        torch.rand(2)
        if rank == 1:
            notes["line"] = _line()
            torch.rand(2)  # rank 1 draws while rank 0 is already in the collective
        dist.all_reduce(torch.ones(2))

    torch.manual_seed(0)
    return _raising(body, sync="op")


def destroyed_inside(rank: int, world: int) -> dict[str, Any]:
    """The script tears torch.distributed down inside the block: no finding, no error."""
    import torch.distributed as dist

    with _mode() as mode:
        torch.rand(2)
        dist.destroy_process_group()
    return _summary(mode)


destroyed_inside.breaks_group = True  # type: ignore[attr-defined]  # (no group left: run it last)


def step_every(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    with _mode(every_ops=4) as mode:
        for _ in range(10):
            torch.rand(3)
    return _summary(mode)


def every_third_step(rank: int, world: int) -> dict[str, Any]:
    """every_steps=3: steps 0 and 3 are checked; rank 1 drifts on unchecked step 1."""
    out = {}
    torch.manual_seed(0)
    with _mode(every_steps=3) as mode:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(6):
            _train_step(model, opt)
    out["clean"] = _summary(mode)

    def drift(notes: dict[str, Any]) -> None:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            if step == 1 and rank == 1:
                torch.rand(1)  # drawn on an unchecked step: seen at the next checked one
            notes[f"done{step}"] = True
            _train_step(model, opt)

    torch.manual_seed(0)
    out["drift"] = _raising(drift, every_steps=3)
    return out


def subgroups(rank: int, world: int) -> dict[str, Any]:
    """Ranks 0,1 replicate a stream; ranks 2,3 must keep theirs apart."""
    import torch.distributed as dist

    import rngcheck

    torch.manual_seed(0)
    results = {}
    cases = {
        "clean": {0: 10, 1: 10, 2: 21, 3: 22},
        "collide": {0: 10, 1: 10, 2: 20, 3: 20},
        "diverge": {0: 10, 1: 11, 2: 21, 3: 22},
    }
    # Every rank creates both process groups; the clean case passes them instead of rank lists.
    pgs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for name, seeds in cases.items():
        with _mode(on_finding="warn") as mode:
            gen = torch.Generator().manual_seed(seeds[rank])
            policy, group = ("same", [0, 1]) if rank < 2 else ("differ", [2, 3])
            if name == "clean":
                group = pgs[rank // 2]
            with rngcheck.expect(policy, group=group):
                line = _line()
                torch.rand(4, generator=gen)
            torch.nn.functional.dropout(torch.ones(8), 0.5)  # world-wide "same"
        results[name] = {**_summary(mode), "line": line}
    return results


def one_of_four(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    with _mode(on_finding="warn") as mode:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if rank == 2:
            line = _line()
            torch.randperm(8)  # a shuffle drawn on one rank of four
        _train_step(model, opt)
    return {**_summary(mode), "line": locals().get("line")}


def _drawn_apart(rank: int, world: int, unseen: int) -> dict[str, Any]:
    """Two training steps; before the second this rank draws ``unseen`` numbers where no mode
    can see them, so the ranks meet its dropout in as many states as they drew amounts."""
    from rich.console import Console

    import rngcheck

    torch.manual_seed(0)
    with _mode(on_finding="warn") as mode:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _train_step(model, opt)
        if unseen:
            with torch._C._DisableTorchDispatch():
                torch.rand(unseen)
        line = _line()
        _train_step(model, opt)
    out: dict[str, Any] = {**_summary(mode), "line": line}
    if mode.report.findings and rank == 0:
        console = Console(file=io.StringIO(), force_terminal=True, width=160, color_system=None)
        console.print(rngcheck.render_finding(mode.report.findings[0], world))
        out["rich"] = console.file.getvalue()
    return out


def three_states(rank: int, world: int) -> dict[str, Any]:
    """Four ranks in three states: ranks 1 and 2 each drew their own amount, ranks 0 and 3 none."""
    return _drawn_apart(rank, world, unseen={1: 1, 2: 2}.get(rank, 0))


def four_states(rank: int, world: int) -> dict[str, Any]:
    """Four ranks in four states: each drew its own amount."""
    return _drawn_apart(rank, world, unseen=rank)


def rank_list_group(rank: int, world: int) -> dict[str, Any]:
    """group=[0, 1] on four ranks: ranks 0 and 1 are checked with each other, 2 and 3 not at all."""
    torch.manual_seed(rank if rank >= 2 else 0)  # ranks 2 and 3 differ: nobody asked them to agree
    with _mode(group=[0, 1]) as mode:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _train_step(model, opt)
        if rank == 1:
            line = _line()
            torch.rand(1)
        _train_step(model, opt)
    return {**_summary(mode), "line": locals().get("line")}


def mesh_dims(rank: int, world: int) -> dict[str, Any]:
    """A 2x2 (dp, tp) mesh: tensor-parallel dropout differs across tp, agrees across dp."""
    from torch.distributed.device_mesh import init_device_mesh

    import rngcheck

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh.get_local_rank("tp")
    results = {}
    for name, seed in (("clean", 50 + tp), ("collide", 50)):
        with _mode() as mode:
            gen = torch.Generator().manual_seed(seed)
            with rngcheck.expect("differ", group=mesh["tp"]):
                line = _line()
                torch.rand(4, generator=gen)
            with rngcheck.expect("same", group=mesh["dp"]):
                torch.rand(4, generator=gen)
        results[name] = {**_summary(mode), "line": line}
    return results


class _ParallelBlock(torch.nn.Module):
    """A residual MLP whose dropout runs on the activations every tensor-parallel peer holds
    whole (after the row-wise layer's all-reduce), as a transformer's residual dropout does."""

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.dropout(self.down(torch.relu(self.up(x))), self.p)
        return x + (h.to_local() if hasattr(h, "to_local") else h)  # (a DTensor: its dropout too)


def tensor_parallel_inside_fully_shard(rank: int, world: int) -> dict[str, Any]:
    """A 2x2 (dp, tp) mesh: parallelize_module over tp, then fully_shard over dp, each
    data-parallel group training on its own batches (its own sequence lengths). The dropout
    of a data-parallel forward may differ across dp, but tensor-parallel peers must draw
    alike: seeded alike everywhere, or by data-parallel rank, quiet; seed + rank, found; and
    rank 1 alone built with no dropout in its second block (p=0 draws nothing), found there
    among the peers, not waited for. And the row-wise layers' output kept a DTensor
    (``use_local_output=False``), so the dropout is DTensor's, over the tp mesh: quiet too,
    though each data-parallel group draws its own shapes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_local_rank("dp")
    results = {}
    cases = (
        ("same", 0),
        ("per_dp", 10 + dp),
        ("per_rank", 20 + rank),
        ("skips", 0),
        ("dtensor", 0),
    )
    for name, seed in cases:
        with _mode() as mode:
            torch.manual_seed(0)
            p = 0.0 if name == "skips" and rank == 1 else 0.1
            model = torch.nn.Sequential(_ParallelBlock(), _ParallelBlock(p))
            kept = {"output_layouts": Replicate(), "use_local_output": False}
            down = kept if name == "dtensor" else {}
            plan = {f"{i}.{n}": c for i in (0, 1) for n, c in ((
                "up", ColwiseParallel()), ("down", RowwiseParallel(**down)))}  # fmt: skip
            parallelize_module(model, mesh["tp"], plan)
            fully_shard(model, mesh=mesh["dp"])
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            seed_line = _line()
            torch.manual_seed(seed)
            for step in range(2):
                g = torch.Generator().manual_seed(10 * dp + step)  # this group's own batch
                model(torch.randn(2, 3 + dp + step, 8, generator=g)).sum().backward()
                opt.step()
                opt.zero_grad()
            # A draw every rank makes outside the forward, from the generator the groups' own
            # lengths moved apart: compared by what runs from there (Rule 2's wake), quiet.
            torch.randperm(4)
        notes = [n.message for n in mode.report.notes]
        results[name] = {**_summary(mode), "notes": notes, "seed_line": seed_line}
    return results


def hf_tensor_and_fully_sharded(rank: int, world: int) -> dict[str, Any]:
    """Hugging Face's own 2D parallelism: GPT-NeoX from a tiny config loaded with
    ``DistributedConfig(tp_size=2, fsdp_size=2)`` (tensor parallelism inside FSDP2), trained two
    steps with dropout and gradient checkpointing, each fsdp group on its own batches: quiet and
    trained bitwise as without the mode; seed + rank, found."""
    import os

    sys.path.insert(0, os.path.dirname(_HERE))
    import _hf
    import transformers
    from transformers.distributed import DistributedConfig

    path = _hf.saved_gpt_neox()

    def train(seed: int, checked: bool) -> dict[str, Any]:
        with _mode(timeout=60.0) if checked else contextlib.nullcontext() as mode:
            torch.manual_seed(seed)
            model = transformers.GPTNeoXForCausalLM.from_pretrained(
                path, distributed_config=DistributedConfig(tp_size=2, fsdp_size=2)
            )
            model.train()
            model.gradient_checkpointing_enable({"use_reentrant": False})
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            g = torch.Generator().manual_seed(rank // 2)  # (ranks 0,1 and 2,3: tp peers)
            losses = []
            for step in range(2):
                ids = torch.randint(1, 64, (2, 8 + 2 * (rank // 2) + step), generator=g)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        out: dict[str, Any] = {"losses": losses, "parameters": _hf.parameters_digest(model)}
        return {**_summary(mode), **out} if checked else out

    return {
        "plain": train(0, checked=False),
        "checked": train(0, checked=True),
        "per_rank": train(1 + rank, checked=True),
    }


def stage_dims(rank: int, world: int) -> dict[str, Any]:
    """DTensor ops on a 2x2 (pp, dp) mesh whose pipeline stages are seeded apart on purpose."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    import rngcheck

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    x = distribute_tensor(torch.ones(4, 4), mesh, [Replicate(), Replicate()])
    results = {}
    for name in ("undeclared", "declared", "per_stage"):
        torch.manual_seed(10 + mesh.get_local_rank("pp"))
        # per_stage: each pipeline stage gets its own checker (and its own side group).
        with _mode(group=mesh["dp"] if name == "per_stage" else None) as mode:
            if name == "declared":
                with rngcheck.expect("same", group="dp"):  # only data-parallel peers agree
                    torch.nn.functional.dropout(x, 0.5)
            else:
                line = _line()
                torch.nn.functional.dropout(x, 0.5)
        results[name] = {**_summary(mode), "line": line}
    return results


def exit_vs_barrier(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    def body(notes: dict[str, Any]) -> None:
        torch.rand(2)
        if rank == 0:
            dist.barrier()  # rank 1 leaves the checked block instead

    torch.manual_seed(0)
    return _raising(body)


def _rank_one_leaves(rank: int, hang: float, timeout: float, message: str) -> dict[str, Any]:
    """Three optimizer steps; at the second, rank 1 hangs for ``hang`` seconds, then raises."""
    import time

    torch.manual_seed(0)
    mode = _mode(timeout=timeout, on_finding="warn")
    start = time.monotonic()
    try:
        with mode:
            model = _model()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(3):
                if rank == 1 and step == 1:
                    time.sleep(hang)
                    raise RuntimeError(message)  # leaves the block; rank 0 steps on
                model(torch.ones(2, 8)).sum().backward()
                opt.step()
    except RuntimeError as e:
        return {"error": str(e)}
    return {**_summary(mode), "waited": time.monotonic() - start}


def rank_raises(rank: int, world: int) -> dict[str, Any]:
    return _rank_one_leaves(rank, hang=0.0, timeout=5.0, message="rank 1 crashed")


def rank_stops(rank: int, world: int) -> dict[str, Any]:
    # Hangs past the timeout: the others report it instead of hanging too.
    return _rank_one_leaves(rank, hang=8.0, timeout=3.0, message="rank 1 gave up")


rank_stops.breaks_group = True  # type: ignore[attr-defined]


def slow_rank(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 spends a while between steps (saving a checkpoint, evaluating): with the default
    timeout (the process group's, 60 s in these workers) the others wait for it."""
    import time

    import rngcheck

    torch.manual_seed(0)
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _train_step(model, opt)
        if rank == 0:
            time.sleep(4.0)
        _train_step(model, opt)
    return {**_summary_plain(mode), "timeout": mode.report.meta.get("rank_timeout")}


def entered_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    """Only rank 0 enters the mode (under `if rank == 0:`): it says so instead of hanging in the
    side group's creation; afterwards both ranks start a mode together as usual."""
    out: dict[str, Any] = {}
    if rank == 0:
        try:
            with _mode(timeout=2.0):
                pass
        except RuntimeError as e:
            out["error"] = str(e)
    torch.distributed.barrier()
    with _mode() as mode:  # the next start on every rank is not confused by the failed one
        torch.rand(3)
    return {
        **out,
        "ok_after": mode.report.ok,
        "stats": dict(mode.report.meta["rank_exchange"]),
        "compared": compared(mode.report),
    }


def _summary_plain(mode: Any) -> dict[str, Any]:
    return {
        "ok": mode.report.ok,
        "findings": [f.kind.value for f in mode.report.findings],
        "compared": compared(mode.report),
    }


# ---------------------------------------------------------------------------------------------
# The tests (parent side)

_TWO = [
    "clean_training",
    "clean_training_op_sync",
    "rank_seed",
    "extra_draw",
    "drift_found_one_step_later",
    "user_generator",
    "dataloader_one_rank",
    "differ_streams",
    "dtensor_replicate",
    "op_sync_before_collective",
    "step_every",
    "every_third_step",
    "exit_vs_barrier",
    "pair_streams",
    "ignored_on_one_rank",
    "slow_rank",
    "entered_on_one_rank",
    "destroyed_inside",
]
_FOUR = [
    "clean_training",
    "pair_streams",
    "one_of_four",
    "three_states",
    "four_states",
    "subgroups",
    "rank_list_group",
    "mesh_dims",
    "stage_dims",
    "tensor_parallel_inside_fully_shard",
    "hf_tensor_and_fully_sharded",
]


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from _dist import run_scenarios

    return run_scenarios(_HERE, _TWO, world_size=2, out_dir=tmp_path_factory.mktemp("two"))


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from _dist import run_scenarios

    return run_scenarios(_HERE, _FOUR, world_size=4, out_dir=tmp_path_factory.mktemp("four"))


def _only(result: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in result, result.get("traceback", result)
    assert len(result["findings"]) == 1, result["findings"]
    return result["findings"][0]


def _rendered_once(results: dict[int, dict[str, Any]], renderer: int) -> None:
    for rank, r in results.items():
        if rank == renderer:
            assert "rngcheck:" in r["rendered"], r["rendered"]
        else:
            assert r["rendered"] == "", (rank, r["rendered"])


def _site(line: int) -> str:
    return f"test_ranks.py:{line}"


# What a clean run compares, by state (at least, each rank): the dropout of every step (3, or 2
# with sync="op"), or the 10 draws of step_every; the model's 4 initialisations at the first
# step (a hand-rolled DDP: nothing broadcasts them). Nothing is left uncompared.
_CLEAN = {
    "clean_training": {"by_state": 3, "initialisations": 4},
    "clean_training_op_sync": {"by_state": 2, "initialisations": 4},
    "step_every": {"by_state": 10},
    "pair_streams": {"by_state": 3, "must_differ": 3},  # (and the pairs' streams, apart)
}


def test_clean_training_reports_nothing(two: Any) -> None:
    for name in ("clean_training", "clean_training_op_sync", "step_every"):
        for rank, r in two[name].items():
            assert "error" not in r, r.get("traceback")
            assert r["ok"], (name, rank, r["findings"])
            assert r["world_size"] == 2 and r["rank"] == rank
            assert r["stats"]["mismatches"] == 0 and r["stats"]["slow_calls"] == 0
            assert r["rendered"] == ""
            assert_compared(r["compared"], rank, **_CLEAN[name], not_compared={})


def test_every_steps_checks_only_every_nth_step_and_still_finds_a_drift(two: Any) -> None:
    for r in two["every_third_step"].values():
        clean, drift = r["clean"], r["drift"]
        assert "error" not in clean and "error" not in drift, r
        assert clean["ok"], clean["findings"]
        # Six steps, two checked (0 and 3): their all_reduce points and optimizer steps
        # exchange (3 parameters + step = 4 each), plus the final exchange at exit.
        assert clean["stats"]["exchanges"] == 2 * 5 + 1, clean["stats"]
        # The dropout of the two checked steps alone is compared (and the initialisations).
        assert clean["compared"]["by_state"] == 2, clean["compared"]
        assert clean["compared"]["initialisations"] == 4, clean["compared"]
        # The extra draw on step 1 is not seen until step 3, the next checked step.
        assert drift["raised"] == "RankDivergenceError"
        assert drift.get("done3") and not drift.get("done4")
        (f,) = drift["findings"]
        assert f["kind"] == "rank_divergence" and sorted(f["ranks"]) == [0, 1]
        assert f["differs"] in ("state", "state before"), f


def test_process_group_destroyed_inside_the_block(two: Any) -> None:
    for r in two["destroyed_inside"].values():
        assert "error" not in r, r.get("traceback")
        # Nothing is compared across the ranks, by design: the group is destroyed before the
        # first exchange point, so no round ever goes out.
        assert r["ok"] and r["stats"]["exchanges"] == 0


def test_step_sync_exchanges_at_steps_collectives_every_and_exit(two: Any) -> None:
    op = two["clean_training_op_sync"][0]["stats"]
    step = two["clean_training"][0]["stats"]
    every = two["step_every"][0]["stats"]
    # 10 random ops with every_ops=4: exchanges after op 4 and op 8, then at exit.
    assert every["exchanges"] == 3
    # sync="step": 3 steps x (4 all_reduces + 1 optimizer step) + exit
    assert step["exchanges"] == 3 * 5 + 1
    # sync="op" also exchanges at each random op (weight init, one dropout per step)
    assert op["exchanges"] > 2 * 5 + 1
    # Nothing but the group-wide vector on the fast path: 11 int64 per exchange.
    assert step["fast_calls"] == step["exchanges"] and step["fast_bytes"] == 88 * step["exchanges"]


def test_a_slow_rank_is_not_a_missing_rank(two: Any) -> None:
    for rank, r in two["slow_rank"].items():
        assert "error" not in r, r.get("traceback")
        assert r["ok"], (rank, r["findings"])
        # The default timeout is the process group's own (60 s in the test workers), not 120 s.
        assert r["timeout"] == {"seconds": 60.0, "from": "the process group"}
        # Compared after the wait: the dropout of both steps and the 4 initialisations.
        assert_compared(r["compared"], rank, by_state=2, initialisations=4, not_compared={})


def test_a_mode_entered_on_one_rank_says_so(two: Any) -> None:
    r0, r1 = two["entered_on_one_rank"][0], two["entered_on_one_rank"][1]
    assert r0["error"].startswith(
        "rngcheck: the RNGConsistencyMode was entered on rank 0 of 2 but not on rank 1 within 2 s"
    )
    assert "enter the mode on every rank" in r0["error"] and "sync='off'" in r0["error"]
    assert "error" not in r1
    for rank, r in enumerate((r0, r1)):  # and the next mode started on both ranks checks as usual
        assert r["ok_after"] and r["stats"]["exchanges"] == 1
        assert_compared(r["compared"], rank, by_state=1, not_compared={})  # (its torch.rand)


def test_rank_dependent_seed_before_building_a_replicated_model(two: Any) -> None:
    results = two["rank_seed"]
    for _rank, r in results.items():
        f = _only(r)
        assert f["kind"] == "rank_divergence"
        assert f["ranks"] == [0, 1]
        assert f["differs"] == "state"
        assert f["op"] == "aten.uniform_.default"  # nn.Linear's weight init
        assert "seeded default cpu differently" in f["cause"]
        line = r["line"]
        assert f"torch.manual_seed(1234) at {_site(line)}" in f["cause"]
        assert f"torch.manual_seed(1235) at {_site(line)}" in f["cause"]
        assert [s["ranks"] for s in f["sides"]] == [[0], [1]]


def test_one_rank_draws_an_extra_number(two: Any) -> None:
    results = two["extra_draw"]
    line = results[1]["line"]
    for r in results.values():
        assert r["raised"] == "RankDivergenceError"  # every rank gets the error
        f = _only(r)
        assert f["kind"] == "rank_divergence" and f["differs"] == "op"
        assert f["op"] == "aten.rand.default"
        assert f["site"] == _site(line)
        assert "rank 1 ran an extra random op, aten.rand.default" in f["cause"]
        assert f"at {_site(line)}" in f["cause"]
        assert f["sides"][1]["ranks"] == [1] and f["sides"][1]["op"] == "aten.rand.default"
        assert f["sides"][0]["ranks"] == [0] and f["sides"][0]["op"] == "aten.bernoulli_.float"
    _rendered_once(results, 0)


def test_step_sync_reports_a_drift_at_the_exchange_after_it(two: Any) -> None:
    results = two["drift_found_one_step_later"]
    line = results[1]["line"]
    for rank, r in results.items():
        assert r["raised"] == "RankDivergenceError", r  # every rank gets the error
        # Step 1's round was still in flight after its optimizer step; step 2's settled it.
        assert r["stepped"] == 1 and r["reached"] == 2, (rank, r)
        f = _only(r)
        assert f["kind"] == "rank_divergence" and f["differs"] == "op"
        assert f["op"] == "aten.rand.default" and f["site"] == _site(line)
        assert "rank 1 ran an extra random op, aten.rand.default" in f["cause"]
        # Rounds 1 and 2 were sent (one all-reduce each), nothing after the mismatch; the
        # gathers of the slow path ran once.
        stats = r["stats"]
        assert stats["exchanges"] == 2 and stats["mismatches"] == 1, stats
        assert stats["fast_calls"] == 2 and stats["fast_bytes"] == 2 * 88, stats
        assert stats["slow_calls"] == 4, stats
    _rendered_once(results, 0)


def test_user_generator_advanced_on_one_rank(two: Any) -> None:
    results = two["user_generator"]
    line = results[1]["line"]
    for r in results.values():
        f = _only(r)
        assert f["kind"] == "rank_divergence"
        assert f["op"] == "aten.randn.generator" and f["site"] == _site(line)
        assert "Generator #1" in f["cause"] and "on those ranks only" in f["cause"]
        assert f["sides"][1]["ranks"] == [1]


def test_dataloader_iterated_on_one_rank(two: Any) -> None:
    results = two["dataloader_one_rank"]
    line = results[0]["line"]
    for r in results.values():
        f = _only(r)
        assert f["kind"] == "rank_divergence"
        assert f["op"] == "aten.random_.default"
        assert f["site"] == _site(line)
        assert "rank 0 ran an extra random op" in f["cause"]
        assert "DataLoader iterator" in f["cause"]
        assert f["sides"][1]["ranks"] == [0]


def test_an_ignored_block_that_draws_on_one_rank(two: Any) -> None:
    results = two["ignored_on_one_rank"]
    line = results[0]["ignored_line"]
    for r in results.values():
        f = _only(r)
        assert f["kind"] == "rank_divergence" and f["differs"] == "state"
        assert f["op"] == "aten.bernoulli_.float"  # the next checked op on that generator
        assert [s["ranks"] for s in f["sides"]] == [[1], [0]]  # rank 0 is the divergent side
        assert (
            f"rank 0 drew 1 random op(s) under expect('ignore') from default cpu since its last "
            f"checked op (the last: aten.rand.default at {_site(line)})"
        ) in f["cause"]


def test_differ_streams_collide(two: Any) -> None:
    for rank, r in two["differ_streams"].items():
        assert r["offset"]["ok"], r["offset"]["findings"]
        # The augmentation stream, compared as one that must differ; the dropout, by state.
        assert_compared(r["offset"]["compared"], rank, must_differ=1, by_state=1, not_compared={})
        f = _only(r["collide"])
        assert f["kind"] == "rank_collision"
        assert f["ranks"] == [0, 1]
        assert f["op"] == "aten.rand.generator" and f["site"] == _site(r["collide"]["line"])
        assert f["sides"][0]["label"] == "share a state" and f["sides"][0]["ranks"] == [0, 1]
        assert r["collide"]["stats"]["mismatches"] == 1
        assert r["offset"]["stats"]["mismatches"] == 0


def test_dtensor_replicate_on_a_cpu_mesh(two: Any) -> None:
    results = two["dtensor_replicate"]
    for rank, r in results.items():
        assert "error" not in r, r.get("traceback")
        assert r["clean"]["ok"], r["clean"]["findings"]
        # The replicated and the sharded dropout, twice each, by state over the mesh.
        assert_compared(r["clean"]["compared"], rank, by_state=4, not_compared={})
        drift = r["drift"]
        assert drift["raised"] == "RankDivergenceError"
        f = _only(drift)
        assert f["kind"] == "rank_divergence" and f["differs"] == "state"
        assert f["op"] == "aten.bernoulli_.float"  # dropout on the DTensor, checked at the op
        assert f["site"] == _site(drift["line"])
        seed_line = results[1]["drift"]["seed_line"]
        assert "rank 1 changed default cpu outside a random op" in f["cause"]
        assert f"torch.manual_seed(99) at {_site(seed_line)}" in f["cause"]
    _rendered_once({r: v["drift"] for r, v in results.items()}, 0)


def test_op_sync_rank_at_a_collective_is_reported_not_hung(two: Any) -> None:
    results = two["op_sync_before_collective"]
    line = results[1]["line"]
    for r in results.values():
        assert r["raised"] == "RankDivergenceError"
        f = _only(r)
        assert f["site"] == _site(line)
        reference, odd = f["sides"]
        assert odd["ranks"] == [1] and odd["op"] == "aten.rand.default"
        assert reference["ranks"] == [0] and reference["op"] is None
        assert "reached collective c10d.allreduce_" in reference["note"]


def test_exchange_costs_the_same_at_world_size_two_and_four(two: Any, four: Any) -> None:
    for name in ("clean_training", "pair_streams"):
        s2 = two[name][0]["stats"]
        for rank, r in four[name].items():
            assert r["ok"], (name, rank, r["findings"])
            s4 = r["stats"]
            assert s2["exchanges"] == s4["exchanges"]
            assert s2["fast_calls"] == s4["fast_calls"] and s2["fast_bytes"] == s4["fast_bytes"]
            assert s2["slow_calls"] == s4["slow_calls"] == 0
            assert_compared(r["compared"], rank, **_CLEAN[name], not_compared={})
        print(f"{name}: world 2: {s2}\n{name}: world 4: {s4}")


def test_subgroups_with_different_expectations(four: Any) -> None:
    results = four["subgroups"]
    for rank, r in results.items():
        assert "error" not in r, r.get("traceback")
        assert r["clean"]["ok"], (rank, r["clean"]["findings"])
        # Ranks 0 and 1 compare their stream by state, ranks 2 and 3 theirs as one that must
        # differ; every rank, the world-wide dropout by state.
        stream = {"by_state": 2} if rank < 2 else {"by_state": 1, "must_differ": 1}
        assert_compared(r["clean"]["compared"], rank, **stream, not_compared={})
        f = _only(r["collide"])
        assert f["kind"] == "rank_collision" and f["ranks"] == [2, 3]
        assert f["site"] == _site(r["collide"]["line"])
        f = _only(r["diverge"])
        assert f["kind"] == "rank_divergence" and f["ranks"] == [0, 1]
        assert f["site"] == _site(r["diverge"]["line"])
        assert "Generator #1" in f["cause"]
    _rendered_once({k: v["collide"] for k, v in results.items()}, 2)


def test_one_rank_of_four_is_the_outlier(four: Any) -> None:
    results = four["one_of_four"]
    line = results[2]["line"]
    for r in results.values():
        f = _only(r)
        assert f["kind"] == "rank_divergence" and f["ranks"] == [0, 1, 2, 3]
        assert f["op"] == "aten.randperm.default" and f["site"] == _site(line)
        majority, outliers = f["sides"]
        assert majority["label"] == "majority" and majority["ranks"] == [0, 1, 3]
        assert outliers["label"] == "outliers" and outliers["ranks"] == [2]
    _rendered_once(results, 0)
    assert "majority (ranks 0-1,3 of 4)" in results[0]["rendered"]


def test_four_ranks_in_three_states_name_every_group_and_show_a_shared_stack_once(
    four: Any,
) -> None:
    """Seen on Hugging Face's Trainer over 4 ranks: three states at one line named only two of
    them ("ranks 0,3 and rank 2 differ"), and the same stack was drawn three times."""
    results = four["three_states"]
    for r in results.values():
        f = _only(r)
        assert f["kind"] == "rank_divergence" and f["ranks"] == [0, 1, 2, 3]
        assert [s["ranks"] for s in f["sides"]] == [[0, 3], [1], [2]] or [
            s["ranks"] for s in f["sides"]
        ] == [[0, 3], [2], [1]], f["sides"]
        assert "ranks 0,3; rank 1 and rank 2 hold 3 different states before " in f["message"]
        # The cause is told of the divergent side, and of the third one too.
        (odd,) = f["sides"][1]["ranks"]
        assert f["cause"].startswith(f"rank {odd}: default cpu changed outside"), f["cause"]
        assert f["cause"].endswith(f". The same on rank {3 - odd}"), f["cause"]
    _rendered_once(results, 0)
    plain, rich = results[0]["rendered"], results[0]["rich"]
    assert plain.count("stack (most recent call last):") == 1, plain
    assert plain.count(": the same stack as majority (ranks 0,3 of 4)") == 2, plain
    assert rich.count(": the same stack as majority (ranks 0,3 of 4)") == 2, rich
    assert rich.count(f"test_ranks.py:{results[0]['line']}") == 1, rich


def test_four_ranks_in_four_states_are_each_on_their_own(four: Any) -> None:
    results = four["four_states"]
    for r in results.values():
        f = _only(r)
        assert sorted(s["ranks"] for s in f["sides"]) == [[0], [1], [2], [3]], f["sides"]
        assert "ranks 0-3 each hold a different state before aten.bernoulli_" in f["message"]
        assert f["cause"].endswith(". The same on ranks 2-3"), f["cause"]  # (0: the reference)
    _rendered_once(results, 0)
    assert results[0]["rendered"].count("stack (most recent call last):") == 1
    assert results[0]["rendered"].count(": the same stack as ") == 3


def test_mode_group_as_a_rank_list(four: Any) -> None:
    results = four["rank_list_group"]
    line = results[1]["line"]
    for rank in (0, 1):
        f = _only(results[rank])
        assert f["kind"] == "rank_divergence" and f["ranks"] == [0, 1]
        assert f["site"] == _site(line)
    for rank in (2, 3):
        # Nothing is compared on ranks 2 and 3, by design: outside the mode's group they start
        # no rank checker at all.
        assert results[rank]["ok"] and results[rank]["stats"] == {}
        assert results[rank]["compared"] is None, results[rank]["compared"]


def test_mesh_dimensions_as_groups(four: Any) -> None:
    for rank, r in four["mesh_dims"].items():
        assert "error" not in r, r.get("traceback")
        assert r["clean"]["ok"], (rank, r["clean"]["findings"])
        # Apart across tp, by state across dp.
        assert_compared(r["clean"]["compared"], rank, must_differ=1, by_state=1, not_compared={})
        f = _only(r["collide"])
        assert f["kind"] == "rank_collision"
        assert f["ranks"] in ([0, 1], [2, 3])


def test_dtensor_pipeline_stages_declared_to_differ(four: Any) -> None:
    for rank, r in four["stage_dims"].items():
        assert "error" not in r, r.get("traceback")
        assert r["declared"]["ok"], (rank, r["declared"]["findings"])
        assert r["per_stage"]["ok"], (rank, r["per_stage"]["findings"])
        assert r["per_stage"]["stats"]["exchanges"] == 1  # at exit, within the stage
        for name in ("declared", "per_stage"):  # the dropout, by state (over dp, or the stage)
            assert_compared(r[name]["compared"], rank, by_state=1, not_compared={})
        f = _only(r["undeclared"])
        assert f["kind"] == "rank_divergence" and f["ranks"] == [0, 1, 2, 3]
        assert f["op"] == "aten.bernoulli_.float" and f["site"] == _site(r["undeclared"]["line"])
        assert [s["ranks"] for s in f["sides"]] == [[0, 1], [2, 3]]


def test_ranks_that_reach_different_exchange_points(two: Any) -> None:
    for r in two["exit_vs_barrier"].values():
        assert r["raised"] == "RankDivergenceError"
        f = _only(r)
        assert f["differs"] == "exchange point"
        notes = {tuple(s["ranks"]): s["note"] for s in f["sides"]}
        assert "collective c10d.barrier" in notes[(0,)]
        assert "the end of the checked block" in notes[(1,)]


def test_a_rank_that_stops_reaching_the_exchange(tmp_path: Any) -> None:
    from _dist import run_scenarios

    names = ["rank_raises", "rank_stops"]
    run = run_scenarios(_HERE, names, world_size=2, out_dir=tmp_path, timeout=120)
    # A rank that leaves with an exception says why, and the others need not wait long.
    r0, r1 = run["rank_raises"][0], run["rank_raises"][1]
    assert r1 == {"error": "rank 1 crashed"}
    f = _only(r0)
    assert f["kind"] == "rank_missing" and f["ranks"] == [1]
    assert "rank 1 left the checked block early (RuntimeError: rank 1 crashed)" in f["cause"]
    # A rank that hangs: the others report it after the timeout instead of hanging too.
    r0, r1 = run["rank_stops"][0], run["rank_stops"][1]
    assert r1 == {"error": "rank 1 gave up"}
    f = _only(r0)
    assert f["kind"] == "rank_missing" and f["ranks"] == [1]
    assert f["sides"][0]["label"] == "arrived" and f["sides"][0]["ranks"] == [0]
    assert "Adam" not in f["message"] and "SGD.step()" in f["message"]
    assert "rngcheck:" in r0["rendered"]


def _cuda_device() -> torch.device:
    import torch.distributed as dist

    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def cuda_philox(rank: int, world: int) -> dict[str, Any]:
    """Philox generators (seed, offset): a rank-dependent CUDA seed before replicated dropout."""
    device = _cuda_device()
    torch.cuda.manual_seed(0)
    with _mode() as mode:
        x = torch.ones(64, device=device)
        torch.nn.functional.dropout(x, 0.5)  # agrees: same seed, same offset on every rank
        line = _line()
        torch.cuda.manual_seed(1000 + rank)
        torch.nn.functional.dropout(x, 0.5)
        mode.check()
    return {**_summary(mode), "line": line}


def cuda_dtensor_tracker(rank: int, world: int) -> dict[str, Any]:
    """DTensor's OffsetBasedRNGTracker on a CUDA mesh: sharded dropout keeps the mesh in step
    (each shard at its own offset, the same state after); a rank that reseeds breaks it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    device = _cuda_device()
    torch.manual_seed(0)
    mesh = init_device_mesh("cuda", (world,))
    # from_local: no scatter needed (the process group here is gloo)
    x = DTensor.from_local(torch.ones(4, 8, device=device), mesh, [Shard(0)], run_check=False)
    torch.nn.functional.dropout(x, 0.5)  # creates the tracker (it broadcasts rank 0's state)
    with _mode(sync="op") as mode:
        torch.nn.functional.dropout(x, 0.5)
        clean = mode.report.ok
        if rank == 1:
            seed_line = _line()
            torch.cuda.manual_seed(5)
        line = _line()
        torch.nn.functional.dropout(x, 0.5)
    return {**_summary(mode), "clean": clean, "line": line, "seed_line": locals().get("seed_line")}


@pytest.fixture(scope="module")
def cuda_two(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from _dist import run_scenarios

    names = ["cuda_philox", "cuda_dtensor_tracker"]
    return run_scenarios(_HERE, names, world_size=2, out_dir=tmp_path_factory.mktemp("cuda"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_philox_rank_dependent_seed(cuda_two: Any) -> None:  # pragma: no cover - CUDA lane
    results = cuda_two["cuda_philox"]
    for r in results.values():
        f = _only(r)
        assert f["kind"] == "rank_divergence" and f["differs"] == "state"
        assert f["op"] == "aten.bernoulli_.float"
        assert "default cuda" in f["message"]
        assert f"torch.cuda.manual_seed(1000) at {_site(r['line'])}" in f["cause"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dtensor_offset_tracker(cuda_two: Any) -> None:  # pragma: no cover - CUDA lane
    results = cuda_two["cuda_dtensor_tracker"]
    seed_line = results[1]["seed_line"]
    for r in results.values():
        assert "error" not in r, r.get("traceback")
        assert r["clean"], "a sharded DTensor dropout under the tracker must leave ranks in step"
        f = _only(r)
        assert f["kind"] == "rank_divergence" and f["site"] == _site(r["line"])
        assert f"torch.cuda.manual_seed(5) at {_site(seed_line)}" in f["cause"]


def test_tensor_parallel_peers_inside_fully_shard_are_compared_among_themselves(four: Any) -> None:
    """Rule 2 with tensor parallelism inside data parallelism: the dropout of fully_shard's
    forward is each data-parallel group's own (their batches' lengths differ), and compared
    among the tensor-parallel peers that share a batch."""
    results = four["tensor_parallel_inside_fully_shard"]
    for rank, r in results.items():
        assert "error" not in r, r.get("traceback")
        for name in ("same", "per_dp", "dtensor"):
            assert r[name]["ok"] and not r[name]["findings"], (rank, name, r[name]["findings"])
            # The dropout of both blocks at both steps, compared among the peers alone; the
            # parallelized layers' 8 initialisations at the first step; the row-wise layers'
            # biases, Replicate over the tensor-parallel peers, by digest. Each data-parallel
            # group's batches come from a generator of its own (a per-rank stream); the shuffle
            # after training is compared by what runs, from the default generator the groups'
            # lengths moved apart, but with per_dp that generator is seeded per data-parallel
            # group: a per-rank stream too.
            after = {"by_what_runs": 1} if name != "per_dp" else {}
            peers = {"among_peers_only": 4, "per_rank_seed": 3 if name == "per_dp" else 2}
            assert_compared(
                r[name]["compared"],
                rank,
                **after,
                among_peers=4,
                initialisations=8,
                replicated_parameters=2,
                not_compared=peers,
            )
        note = next(n for n in r["same"]["notes"] if "tensor-parallel peers" in n)
        assert any("not compared by state: default cpu" in n for n in r["same"]["notes"]), r["same"]
        label = f"fully_shard over ranks {'0,2' if rank % 2 == 0 else '1,3'}"
        assert f"random op(s) of the module {label} wraps" in note, note
        assert "compared only among the ranks that share this rank's batch" in note, note
        f = _only(r["per_rank"])
        assert f["kind"] == "rank_divergence" and f["differs"] == "state", f
        assert f["op"] == "aten.bernoulli_.float", f
        assert f["site"].startswith("test_ranks.py:"), f
        assert "compute on one batch, as tensor-parallel peers" in f["cause"], f["cause"]
        line = r["per_rank"]["seed_line"]
        assert f"torch.manual_seed(20) at test_ranks.py:{line}" in f["cause"], f["cause"]
        f = _only(r["skips"])  # (ranks 2 and 3 agree: the same finding, drawn from the gathered)
        assert f["kind"] == "rank_divergence" and f["differs"] == "op", f
        assert f["ranks"] == [0, 1], f
        assert f["cause"].startswith("rank 0 ran an extra random op, aten.bernoulli_"), f
        assert "compute on one batch, as tensor-parallel peers" in f["cause"], f["cause"]


def test_hugging_face_tensor_parallelism_inside_fsdp2_is_quiet_and_its_peers_compared(
    four: Any,
) -> None:
    """Hugging Face's DistributedConfig(tp_size=2, fsdp_size=2): quiet and unchanged with the
    same seed everywhere; seed + rank found at GPT-NeoX's first dropout."""
    results = four["hf_tensor_and_fully_sharded"]
    for rank, r in results.items():
        assert "error" not in r, r.get("traceback")
        checked = r["checked"]
        assert checked["ok"] and not checked["findings"], (rank, checked["findings"])
        assert checked["losses"] == r["plain"]["losses"], rank
        # GPT-NeoX's dropout, compared among the tensor-parallel peers alone; the row-wise
        # layers' biases of its 2 layers, Replicate over the peers, by digest. Each fsdp group's
        # 2 batches come from a generator of its own (a per-rank stream).
        peers = {"among_peers_only": 1, "per_rank_seed": 2}
        assert_compared(
            checked["compared"], rank, among_peers=1, replicated_parameters=4, not_compared=peers
        )
        assert checked["parameters"] == r["plain"]["parameters"], rank
        f = _only(r["per_rank"])
        assert f["kind"] == "rank_divergence" and f["differs"] == "state", f
        assert f["site"].startswith("modeling_gpt_neox.py:"), f
        assert "compute on one batch, as tensor-parallel peers" in f["cause"], f["cause"]
    assert results[0]["plain"]["losses"] == results[1]["plain"]["losses"]
    assert results[0]["plain"]["losses"] != results[2]["plain"]["losses"]
