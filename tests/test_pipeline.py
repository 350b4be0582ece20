"""Pipeline parallelism on real gloo groups with torch's own pipelining (PipelineStage, GPipe,
1F1B, interleaved 1F1B): each rank runs its own stages' layers, so what they draw differs by
design, and their sends and receives are no alignment point of the group.

Quiet, because it is correct: stages built on the meta device and initialised after (torchtitan's
order and torch's own example), or cut from one model built alike; at the op level and at the
step level; over 2 stages and over 4 (where the middle stages send and receive twice as often
as the ends), with training bitwise equal to a run without the mode. Found, because it is wrong:
a rank that draws an extra number from the data generator every rank shares.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
from _dist import assert_compared, compared, scenario_mode

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

_HERE = __file__
_D = 16


def _block() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(_D, _D), torch.nn.GELU(), torch.nn.Dropout(0.1))


def _stage_module(stage: int, stages: int, per: int) -> torch.nn.Module:
    """A stage's own layers: an input layer on the first stage, a norm and a head on the last."""
    parts = [torch.nn.Linear(_D, _D)] if stage == 0 else []
    parts += [_block() for _ in range(per)]
    if stage == stages - 1:
        parts += [torch.nn.LayerNorm(_D), torch.nn.Linear(_D, _D, bias=False)]
    return torch.nn.Sequential(*parts)


def _train(
    rank: int,
    world: int,
    schedule: str,
    init: str,
    steps: int,
    extra_draw_from: int | None,
    loader: str = "",
) -> str:
    """Train a pipeline of ``world`` ranks for ``steps`` steps; a digest of this rank's
    parameters. ``init``: "meta" (each rank builds its stages on the meta device, makes them
    PipelineStages, then initialises their weights: different ops on every rank) or "cut" (every
    rank builds the whole model alike and keeps its stages). ``extra_draw_from``: from that step
    on, rank 1 draws one extra number from the data generator each step (the bug). ``loader``:
    "default", the batches come from a shuffling DataLoader whose order is drawn from the
    default generator (which the stages' own draws moved apart: the bug), "shared" from one
    given a generator seeded alike."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    torch.manual_seed(0)
    per_rank = 2 if schedule == "interleaved" else 1
    stages = world * per_rank
    per = 4 // per_rank if world == 2 else 1
    mine = [rank + k * world for k in range(per_rank)]  # looped placement
    if init == "meta":
        with torch.device("meta"):
            modules = [_stage_module(s, stages, per) for s in mine]
    else:
        whole = [_stage_module(s, stages, per) for s in range(stages)]
        modules = [whole[s] for s in mine]
    cpu = torch.device("cpu")
    built = [PipelineStage(m, s, stages, cpu) for m, s in zip(modules, mine, strict=True)]
    if init == "meta":
        for m in modules:
            m.to_empty(device="cpu")
            with torch.no_grad():
                for sub in m.modules():
                    if hasattr(sub, "reset_parameters"):
                        sub.reset_parameters()

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out - target).square().mean()

    if schedule == "gpipe":
        run = ScheduleGPipe(built[0], n_microbatches=4, loss_fn=loss_fn)
    elif schedule == "1f1b":
        run = Schedule1F1B(built[0], n_microbatches=4, loss_fn=loss_fn)
    else:
        run = ScheduleInterleaved1F1B(built, n_microbatches=4, loss_fn=loss_fn)
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.05)
    data = torch.Generator().manual_seed(1)  # every rank draws the same batches
    first, last = 0 in mine, stages - 1 in mine
    dataset = torch.utils.data.TensorDataset(
        torch.randn(32, _D, generator=data), torch.randn(32, _D, generator=data)
    )
    shared = torch.Generator().manual_seed(2) if loader == "shared" else None
    sampler = None
    if loader == "weighted":  # (draws with replacement: still one order for every stage)
        sampler = torch.utils.data.WeightedRandomSampler(torch.ones(32), num_samples=32)
    batches = torch.utils.data.DataLoader(
        dataset, batch_size=8, shuffle=sampler is None, sampler=sampler, generator=shared
    )
    read = iter(())
    for step in range(steps):
        if loader:
            batch = next(read, None)
            if batch is None:  # a new pass over the data: a new order
                read = iter(batches)
                batch = next(read)
            x, y = batch
        else:
            x = torch.randn(8, _D, generator=data)
            y = torch.randn(8, _D, generator=data)
        if extra_draw_from is not None and rank == 1 and step >= extra_draw_from:
            torch.rand(1, generator=data)  # the bug: this rank's data stream moves ahead
        opt.zero_grad()
        if first and last:
            run.step(x, target=y, losses=[])
        elif first:
            run.step(x)
        elif last:
            run.step(target=y, losses=[])
        else:
            run.step()
        opt.step()
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def _scenario(
    rank: int,
    world: int,
    schedule: str,
    init: str = "meta",
    steps: int = 4,
    extra_draw_from: int | None = None,
    loader: str = "",
    **mode: Any,
) -> dict[str, Any]:
    plain = _train(rank, world, schedule, init, steps, extra_draw_from, loader)
    with scenario_mode(on_finding="record", **mode) as checked:
        digest = _train(rank, world, schedule, init, steps, extra_draw_from, loader)
    report = checked.report
    return {
        "findings": [
            {"kind": f.kind.value, "op": f.op, "site": f.site, "cause": f.cause}
            for f in report.findings
        ],
        "notes": [n.message for n in report.notes],
        "random_ops": report.random_ops,
        "compared": compared(report),
        "bitwise": digest == plain,
    }


def gpipe_stages_built_on_meta(rank: int, world: int) -> dict[str, Any]:
    return _scenario(rank, world, "gpipe")


def one_f_one_b_cut_from_one_model(rank: int, world: int) -> dict[str, Any]:
    return _scenario(rank, world, "1f1b", init="cut")


def interleaved_at_the_step_level(rank: int, world: int) -> dict[str, Any]:
    return _scenario(rank, world, "interleaved", steps=12, level="step")


def gpipe_rank_1_draws_extra_data(rank: int, world: int) -> dict[str, Any]:
    return _scenario(rank, world, "gpipe", extra_draw_from=2)


def one_f_one_b_rank_1_draws_extra_data_at_the_step_level(rank: int, world: int) -> dict[str, Any]:
    return _scenario(rank, world, "1f1b", steps=40, extra_draw_from=3, level="step")


def gpipe_shuffled_from_the_default_generator(rank: int, world: int) -> dict[str, Any]:
    return _scenario(rank, world, "gpipe", steps=6, loader="default")


def gpipe_sampled_with_weights_from_the_default_generator(rank: int, world: int) -> dict[str, Any]:
    return _scenario(rank, world, "gpipe", steps=6, loader="weighted")


def gpipe_shuffled_from_a_shared_generator(rank: int, world: int) -> dict[str, Any]:
    return _scenario(rank, world, "gpipe", steps=6, loader="shared")


def gpipe_over_four_stages(rank: int, world: int) -> dict[str, Any]:
    return _scenario(rank, world, "gpipe")


def _train_fully_sharded_stages(rank: int) -> str:
    """torchtitan's layout on 4 ranks: a (pp=2, dp=2) mesh; each rank builds its stage on the
    meta device, shards it with fully_shard over its data-parallel ranks, makes it a
    PipelineStage over its pipeline ranks, then initialises its weights; each data-parallel
    replica reads its own share (DistributedSampler over dp). Returns a digest of this rank's
    shards after two epochs of 1F1B."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    with torch.device("meta"):
        module = _stage_module(stage, 2, 2)
    fully_shard(module, mesh=mesh["dp"])
    built = PipelineStage(module, stage, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    module.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for sub in module.modules():
            if hasattr(sub, "reset_parameters"):
                sub.reset_parameters()
    run = Schedule1F1B(built, n_microbatches=2, loss_fn=lambda o, t: (o - t).square().mean())
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(32, _D, generator=data), torch.randn(32, _D, generator=data)
    )
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=2, rank=dp, seed=3)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            if stage == 0:
                run.step(x)
            else:
                run.step(target=y, losses=[])
            opt.step()
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.to_local().detach().numpy().tobytes())
    return h.hexdigest()


def fully_sharded_stages_over_four_ranks(rank: int, world: int) -> dict[str, Any]:
    plain = _train_fully_sharded_stages(rank)
    with scenario_mode() as checked:
        digest = _train_fully_sharded_stages(rank)
    report = checked.report
    return {
        "findings": [{"kind": f.kind.value, "cause": f.cause} for f in report.findings],
        "random_ops": report.random_ops,
        "compared": compared(report),
        "bitwise": digest == plain,
    }


SCENARIOS = [
    "gpipe_stages_built_on_meta",
    "one_f_one_b_cut_from_one_model",
    "interleaved_at_the_step_level",
    "gpipe_rank_1_draws_extra_data",
    "one_f_one_b_rank_1_draws_extra_data_at_the_step_level",
    "gpipe_shuffled_from_the_default_generator",
    "gpipe_shuffled_from_a_shared_generator",
    "gpipe_sampled_with_weights_from_the_default_generator",
]


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from _dist import run_scenarios

    return run_scenarios(
        _HERE, SCENARIOS, world_size=2, out_dir=tmp_path_factory.mktemp("pp"), timeout=300
    )


# What the stages compare (at least, each rank): the data every rank draws from the generator
# it seeds alike, by state (the dataset's 2 draws, and each step's batch and target: at the 4
# steps, or at the step level's 2 sampled steps; or each pass's DataLoader seed and order from
# the generator given to it); stages built alike, their 19 initialisations at the first step.
# What each rank's stages draw is their own: the dropout of their layers, and the
# initialisations of stages built on the meta device (10 on rank 0, 9 on rank 1).
_OWN_STAGES = {"stage_init": 9, "own_layers": 1}


@pytest.mark.parametrize(
    ("name", "compared"),
    [
        ("gpipe_stages_built_on_meta", {"by_state": 10, "not_compared": _OWN_STAGES}),
        (
            "one_f_one_b_cut_from_one_model",
            {"by_state": 10, "initialisations": 19, "not_compared": {"own_layers": 1}},
        ),
        ("interleaved_at_the_step_level", {"by_state": 6, "not_compared": _OWN_STAGES}),
        ("gpipe_shuffled_from_a_shared_generator", {"by_state": 7, "not_compared": _OWN_STAGES}),
    ],
)
def test_correct_pipeline_training_is_quiet_and_unchanged(
    two: Any, name: str, compared: dict[str, Any]
) -> None:
    for rank, r in two.ok(name).items():
        assert not r["findings"], (rank, r["findings"])
        assert r["random_ops"] > 0
        assert r["bitwise"], rank
        assert_compared(r["compared"], rank, **compared)


def test_what_each_stage_draws_is_said_as_its_own(two: Any) -> None:
    """Each rank's stages draw for their own layers, and each rank initialises its own stages'
    weights (other ops on every rank): both are said, per rank, in the notes."""
    for rank, r in two.ok("gpipe_stages_built_on_meta").items():
        text = "\n".join(r["notes"])
        assert "random op(s) in the pipeline stages ScheduleGPipe over ranks 0-1 runs" in text, (
            rank,
            text,
        )
        assert f"parameter initialisation(s) of pipeline stage {rank} of 2" in text, (rank, text)
        # Stage 0's input layer and 4 blocks (10 initialisations); stage 1's 4 blocks and head
        # (9); the dropout of its 4 blocks for the 4 microbatches of the 4 steps, at least.
        exempted = r["compared"]["not_compared"]
        assert exempted["stage_init"] == (10 if rank == 0 else 9), (rank, exempted)
        assert exempted["own_layers"] >= 64, (rank, exempted)


def test_a_rank_drawing_extra_data_is_found_at_its_line(two: Any) -> None:
    results = two.ok("gpipe_rank_1_draws_extra_data")
    for rank, r in results.items():
        assert len(r["findings"]) >= 1, (rank, r)
        first = r["findings"][0]
        assert first["kind"] == "rank_divergence", first
        assert first["op"] == "aten.rand.generator", first
        assert "rank 1 ran an extra random op" in first["cause"], first


def test_a_recurring_extra_draw_is_found_at_the_step_level(two: Any) -> None:
    results = two.ok("one_f_one_b_rank_1_draws_extra_data_at_the_step_level")
    for rank, r in results.items():
        ops = [f["op"] for f in r["findings"]]
        assert "aten.rand.generator" in ops, (rank, r["findings"])


@pytest.mark.parametrize(
    ("name", "sampler"),
    [
        ("gpipe_shuffled_from_the_default_generator", "RandomSampler"),
        ("gpipe_sampled_with_weights_from_the_default_generator", "WeightedRandomSampler"),
    ],
)
def test_stages_sampling_their_data_apart_is_found_at_the_sampler(
    two: Any, name: str, sampler: str
) -> None:
    """A DataLoader's sampler without a generator draws each pass's order from the default
    generator, which each stage's own initialisation and dropout moved apart: the first stage
    feeds one order of samples, the last computes the loss against the labels of another.
    Without a pipeline known this was "a per-rank stream" in a note (RandomSampler), or a row
    compared by what runs only (WeightedRandomSampler, which draws with replacement)."""
    for rank, r in two.ok(name).items():
        assert r["findings"], (rank, r)
        first = r["findings"][0]
        assert first["kind"] == "rank_divergence", first
        assert f"torch's {sampler} samples the dataset on every stage" in first["cause"], first
        assert "initialising the parameters of pipeline stage" in first["cause"], first


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from _dist import run_scenarios

    return run_scenarios(
        _HERE,
        ["gpipe_over_four_stages", "fully_sharded_stages_over_four_ranks"],
        world_size=4,
        out_dir=tmp_path_factory.mktemp("pp4"),
        timeout=300,
    )


def test_four_stages_send_and_receive_without_aligning_on_it(four: Any) -> None:
    """Over 4 stages the middle ones send and receive twice as often as the ends: when every
    send and receive was an alignment point, the ranks waited for each other in different
    exchanges until the timeout (a false rank_missing: after 30 s here, 30 minutes by
    default)."""
    for rank, r in four.ok("gpipe_over_four_stages").items():
        assert not r["findings"], (rank, r["findings"])
        assert r["bitwise"], rank
        # The data, by state, on every stage; each stage's one block (and the first's input
        # layer, the last's head) its own.
        exempted = {"stage_init": 2, "own_layers": 16}
        assert_compared(r["compared"], rank, by_state=10, not_compared=exempted)


def test_fully_sharded_stages_are_quiet_and_unchanged(four: Any) -> None:
    """torchtitan's layout: fully_shard's all-gathers run over each stage's data-parallel ranks
    while the other stage's ranks wait to receive, and each stage initialises its own shards
    (DTensors over its own mesh). When a collective over a subgroup was an alignment point of
    all four ranks, they waited for each other until the timeout."""
    for rank, r in four.ok("fully_sharded_stages_over_four_ranks").items():
        assert not r["findings"], (rank, r["findings"])
        assert r["random_ops"] > 0
        assert r["bitwise"], rank
        # The dataset's 2 draws and the DistributedSampler's order of each epoch, by state on
        # all 4 ranks; each stage's initialisations its own, and the dropout of fully_shard's
        # forward each data-parallel replica's own (its own share of the data).
        exempted = {"stage_init": 5, "own_batch": 1}
        assert_compared(r["compared"], rank, by_state=4, not_compared=exempted)
