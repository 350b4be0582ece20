"""Uneven inputs: torch's ``Join`` context manager (``torch.distributed.algorithms.join``, which
accelerate's ``join_uneven_inputs`` enters) on real gloo groups. Each rank trains on its own number
of batches; a rank that runs out shadows the others' collectives until every rank has. So from
the moment one rank runs out, the ranks run different iterations, by design.

Quiet, because it is correct: DistributedDataParallel (alone, and with ZeroRedundancyOptimizer)
over two epochs of uneven inputs, at the op level, the step level and ``sync="op"``, on 2 ranks
and on 3, with training bitwise equal to a run without the mode. Before, the op level stopped
such training with a false rank_divergence ("rank 0 reached collective c10d.allreduce_ ... rank 1
reached SGD.step()") and the step level killed it (gloo aborted on rngcheck's own collectives,
whose sizes no longer matched). Found, because it is wrong: a rank that draws an extra number
from the generator every rank shares before any rank ran out of inputs, at its line.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
from _dist import assert_compared, compared, scenario_mode

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

_HERE = __file__


def _train(
    rank: int,
    epochs: int = 2,
    zero: bool = False,
    extra_draw: str = "",
    throw: bool = False,
    batches: int = 4,
    micro: int = 1,
) -> dict[str, Any]:
    """Train under Join for ``epochs`` epochs: rank r has ``batches + 2r + epoch`` batches of
    its own (from a generator seeded per rank), augmented with a mask drawn from a generator
    every rank seeds alike. ``extra_draw``: "once", rank 1 draws one extra number from that
    shared generator at its second iteration; "every", at every iteration; "before forward", at
    its second iteration after the mask (the bugs). ``micro``: forwards and backwards per
    optimizer step (gradient accumulation).
    ``throw``: Join(throw_on_early_termination=True). Returns a digest of the parameters and
    the message of the RuntimeError that ended training, if any."""
    from torch.distributed.algorithms.join import Join
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
    )
    ddp = DistributedDataParallel(model)
    if zero:
        opt: Any = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.05)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    own = torch.Generator().manual_seed(100 + rank)
    shared = torch.Generator().manual_seed(7)
    raised = ""
    try:
        for epoch in range(epochs):
            data = [torch.randn(4, 8, generator=own) for _ in range(batches + 2 * rank + epoch)]
            with Join([ddp, opt] if zero else [ddp], throw_on_early_termination=throw):
                for i, x in enumerate(data):
                    x = x * (torch.rand(x.shape, generator=shared) > 0.1)
                    if rank == 1 and extra_draw == "before forward" and i == 1:
                        torch.rand(1, generator=shared)
                    for part in x.chunk(micro):
                        ddp(part).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
                    if rank == 1 and (extra_draw == "every" or (extra_draw == "once" and i == 1)):
                        torch.rand(1, generator=shared)
    except RuntimeError as e:
        raised = str(e)
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return {"digest": h.hexdigest(), "raised": raised}


def _scenario(rank: int, mode: dict[str, Any] | None = None, **train: Any) -> dict[str, Any]:
    plain = _train(rank, **train)
    with scenario_mode(**(mode or {})) as checked:
        got = _train(rank, **train)
    report = checked.report
    return {
        "findings": [
            {"kind": f.kind.value, "op": f.op, "cause": f.cause, "message": f.message}
            for f in report.findings
        ],
        "notes": [n.message for n in report.notes],
        "random_ops": report.random_ops,
        "compared": compared(report),
        "bitwise": got["digest"] == plain["digest"],
        "raised": got["raised"],
        "plain_raised": plain["raised"],
    }


def uneven_inputs(rank: int, world: int) -> dict[str, Any]:
    return _scenario(rank)


def uneven_inputs_at_the_step_level(rank: int, world: int) -> dict[str, Any]:
    return _scenario(rank, {"level": "step"}, epochs=3)


def uneven_inputs_synced_at_every_op(rank: int, world: int) -> dict[str, Any]:
    return _scenario(rank, {"sync": "op"})


def uneven_inputs_with_zero(rank: int, world: int) -> dict[str, Any]:
    return _scenario(rank, zero=True)


def uneven_inputs_throwing_on_early_termination(rank: int, world: int) -> dict[str, Any]:
    return _scenario(rank, throw=True, epochs=1)


def extra_draw_before_any_rank_ran_out(rank: int, world: int) -> dict[str, Any]:
    return _scenario(rank, extra_draw="once", epochs=1)


def recurring_extra_draw_at_the_step_level(rank: int, world: int) -> dict[str, Any]:
    return _scenario(rank, {"level": "step"}, extra_draw="every", epochs=1, batches=30)


def extra_draw_raised_at_joins_own_point(rank: int, world: int) -> dict[str, Any]:
    return _scenario(rank, {"on_finding": "raise"}, extra_draw="before forward", epochs=1, micro=2)


def uneven_inputs_accumulating_gradients(rank: int, world: int) -> dict[str, Any]:
    return _scenario(rank, micro=2)


def uneven_inputs_a_rank_with_none(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 has no batch in the first epoch (one in the second)."""
    return _scenario(rank, batches=0)


def uneven_inputs_a_rank_with_none_at_the_step_level(rank: int, world: int) -> dict[str, Any]:
    return _scenario(rank, {"level": "step"}, batches=0)


SCENARIOS = [
    "uneven_inputs",
    "uneven_inputs_at_the_step_level",
    "uneven_inputs_synced_at_every_op",
    "uneven_inputs_with_zero",
    "uneven_inputs_throwing_on_early_termination",
    "extra_draw_before_any_rank_ran_out",
    "recurring_extra_draw_at_the_step_level",
    "extra_draw_raised_at_joins_own_point",
    "uneven_inputs_accumulating_gradients",
    "uneven_inputs_a_rank_with_none",
    "uneven_inputs_a_rank_with_none_at_the_step_level",
]


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from _dist import run_scenarios

    return run_scenarios(
        _HERE, SCENARIOS, world_size=2, out_dir=tmp_path_factory.mktemp("join"), timeout=300
    )


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from _dist import run_scenarios

    return run_scenarios(
        _HERE,
        ["uneven_inputs"],
        world_size=3,
        out_dir=tmp_path_factory.mktemp("join3"),
        timeout=300,
    )


# What the ranks compare (at least, each rank): the augmentation masks from the generator every
# rank seeds alike, by state in the iterations every rank ran (the op level: the 4 of the first
# epoch; the step level: those of its 2 sampled steps), and, over two epochs at the op level, by
# what runs in the 5 of the second (rank 1's extra masks moved their generator apart; the first
# in the round that found it so); DDP broadcast the model's 4 initialisations and holds its 4
# parameters whole, compared by digest. The dropout is each rank's own, and so is what rank 1
# draws once rank 0 ran out of inputs (join), where the mode follows it op by op: at the step
# level only when rank 0 has no batch in the first epoch (the sampled steps are then rank 1's
# alone). With no batch for rank 0 in the first epoch nothing is compared by state: rank 1's
# masks in that Join moved their generator apart, and the one mask every rank draws in the
# second epoch is compared by what runs.
_MASKS = {"by_state": 4, "by_what_runs": 5}
_NONE = {"by_what_runs": 1}
# The batches each rank draws from its generator seeded per rank (4 + 2 * rank + epoch an epoch,
# before its Join): over the two epochs at the op level; in the first epoch, before the first
# step, at the step level; with no batch for rank 0 in the first epoch, in the second (rank 1's
# two of the first are in the Join's round, which rank 0 joined having run out: join).
_DATA = {0: 9, 1: 13}


@pytest.mark.parametrize(
    ("name", "masks", "join", "data"),
    [
        ("uneven_inputs", _MASKS, True, _DATA),
        ("uneven_inputs_at_the_step_level", {"by_state": 2}, False, {0: 4, 1: 6}),
        ("uneven_inputs_synced_at_every_op", _MASKS, True, _DATA),
        ("uneven_inputs_with_zero", _MASKS, True, _DATA),
        ("uneven_inputs_accumulating_gradients", _MASKS, True, _DATA),
        ("uneven_inputs_a_rank_with_none", _NONE, True, {0: 1, 1: 3}),
        (
            "uneven_inputs_a_rank_with_none_at_the_step_level",
            {**_NONE, "step_rounds": 1},
            True,
            {0: 1, 1: 3},
        ),
    ],
)
def test_uneven_inputs_are_quiet_and_unchanged(
    two: Any, name: str, masks: dict[str, int], join: bool, data: dict[int, int]
) -> None:
    for rank, r in two.ok(name).items():
        assert not r["findings"], (rank, r["findings"])
        assert not r["raised"], (rank, r["raised"])
        assert r["random_ops"] > 0
        assert r["bitwise"], rank
        exempted = {
            "own_batch": 1,
            "per_rank_seed": data[rank],
            **({"join": 1} if join and rank == 1 else {}),
        }
        assert_compared(
            r["compared"],
            rank,
            **masks,
            initialisations_broadcast=4,
            replicated_parameters=4,
            not_compared=exempted,
        )


def test_over_three_ranks_two_run_on_after_one_ran_out(three: Any) -> None:
    """Rank 0 runs out first, rank 1 next: the ranks still running learn it at their next
    iteration, together, from the flag of that round."""
    for rank, r in three.ok("uneven_inputs").items():
        assert not r["findings"], (rank, r["findings"])
        assert r["bitwise"], rank
        # What ranks 1 and 2 drew after rank 0 ran out is their own (rank 2, which runs on
        # after rank 1 ran out too, the most); the batches of the two epochs, 9 + 4 * rank,
        # come from a generator seeded per rank.
        exempted = {
            "own_batch": 1,
            "per_rank_seed": 9 + 4 * rank,
            **({"join": 4 * rank} if rank else {}),
        }
        assert_compared(
            r["compared"],
            rank,
            **_MASKS,
            initialisations_broadcast=4,
            replicated_parameters=4,
            not_compared=exempted,
        )


def test_what_the_ranks_draw_after_one_ran_out_is_said(two: Any) -> None:
    """Rank 1 has more batches: what it draws once rank 0 ran out is its own, said in a note;
    rank 0 drew nothing then."""
    notes = {rank: "\n".join(r["notes"]) for rank, r in two.ok("uneven_inputs").items()}
    said = (
        "drawn in Join([DistributedDataParallel]) from the last iteration every rank ran "
        "together, as a rank ran out of inputs"
    )
    assert said in notes[1], notes[1]
    assert said not in notes[0], notes[0]
    # Counted too (join): what rank 1 drew once it knew rank 0 ran out, the mask and dropout of
    # its last iteration each epoch at least.
    compared = {rank: r["compared"] for rank, r in two.ok("uneven_inputs").items()}
    assert compared[1]["not_compared"]["join"] >= 4, compared[1]
    assert "join" not in compared[0]["not_compared"], compared[0]
    # The augmentation's generator, drawn more often on rank 1, is compared by what runs from
    # the next epoch on, and said so on every rank, naming the Join.
    for text in notes.values():
        assert (
            "after the ranks drew different amounts from it in the iterations some ranks ran "
            "after another had run out of inputs in Join([DistributedDataParallel])"
        ) in text, text


def test_a_join_that_throws_on_early_termination_raises_as_without_the_mode(two: Any) -> None:
    for rank, r in two.ok("uneven_inputs_throwing_on_early_termination").items():
        assert not r["findings"], (rank, r["findings"])
        assert r["raised"] and r["raised"] == r["plain_raised"], (rank, r)
        # Compared up to the error: the masks of the iterations both ranks ran (one epoch); its
        # batches (4 + 2 * rank) come from a generator seeded per rank.
        exempted = {
            "own_batch": 1,
            "per_rank_seed": 4 + 2 * rank,
            **({"join": 1} if rank == 1 else {}),
        }
        assert_compared(
            r["compared"],
            rank,
            by_state=4,
            initialisations_broadcast=4,
            replicated_parameters=4,
            not_compared=exempted,
        )


def test_an_extra_draw_before_any_rank_ran_out_is_found_at_its_line(two: Any) -> None:
    for rank, r in two.ok("extra_draw_before_any_rank_ran_out").items():
        assert r["findings"], (rank, r)
        first = r["findings"][0]
        assert first["kind"] == "rank_divergence", first
        assert first["op"] == "aten.rand.generator", first
        assert "test_join.py" in first["message"], first


def test_a_recurring_extra_draw_is_found_at_the_step_level(two: Any) -> None:
    for rank, r in two.ok("recurring_extra_draw_at_the_step_level").items():
        ops = [f["op"] for f in r["findings"]]
        assert "aten.rand.generator" in ops, (rank, r["findings"])


def test_a_finding_settled_at_joins_own_point_raises_on_every_rank(two: Any) -> None:
    """Two forwards per optimizer step: the round holding rank 1's extra draw is settled at the
    second forward's notify_join_context, inside Join. With on_finding="raise" the finding was
    swallowed there (logged at debug level); now it raises from the forward on every rank, and
    each leaves the Join with it (none waits in Join's own all-reduce for the others)."""
    for rank, r in two.ok("extra_draw_raised_at_joins_own_point").items():
        assert r["findings"], (rank, r)
        assert r["findings"][0]["op"] == "aten.rand.generator", r["findings"][0]
        assert "aten.rand.generator" in r["raised"], (rank, r["raised"])
        assert not r["plain_raised"], r
