"""Data parallelism on real gloo groups, with real wrappers (DistributedDataParallel, FSDP,
fully_shard) and a real Hugging Face model: what must agree with what.

Quiet, because it is correct: the same seed everywhere with per-rank data generators; seed + rank
before DDP broadcasts the model; dropout masks that differ across data-parallel ranks. Found,
because it is wrong: replicated parameters initialised differently that nothing broadcasts (a
hand-written gradient all-reduce, DDP(init_sync=False), FSDP without sync_module_states,
fully_shard), and a replicated computation outside the data-parallel forward that one rank runs
alone (rank 0 sampling with generate(do_sample=True)).
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

import pytest
import torch
from _dist import assert_compared, compared, launch_past_exit_aborts, scenario_mode
from _recompute_util import marked_line

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

_HERE = __file__


# ---------------------------------------------------------------------------------------------
# Scenarios: run in every rank as fn(rank, world_size); return plain data


_mode = scenario_mode


def _summary(mode: Any, **extra: Any) -> dict[str, Any]:
    report = mode.report
    return {
        "findings": [
            {
                "kind": f.kind.value,
                "op": f.op,
                "site": f.site,
                "message": f.message,
                "cause": f.cause,
                "differs": f.differs,
                "ranks": list(f.ranks),
                "frames": [fr.short_location for fr in f.stack.user_frames],
                "lines": [fr.line for fr in f.stack.user_frames],
            }
            for f in report.findings
        ],
        "notes": [n.message for n in report.notes],
        "random_ops": report.random_ops,
        "compared": compared(report),
        **extra,
    }


def _hf_model(checkpointing: bool = True) -> torch.nn.Module:
    sys.path.insert(0, str(__import__("pathlib").Path(_HERE).parent))
    import _hf

    model = _hf.build("gpt2")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _hf_steps(model: torch.nn.Module, steps: int, generator: torch.Generator | None) -> None:
    import _hf

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(**_hf.batch("gpt2", generator=generator)).loss.backward()
        opt.step()
        opt.zero_grad()


def hf_ddp_same_seed_per_rank_data(rank: int, world: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    with _mode() as mode:
        model = DDP(_hf_model())
        data = torch.Generator().manual_seed(1000 + rank)  # each rank its own synthetic data
        _hf_steps(model, 3, data)
    return _summary(mode)


def hf_ddp_seed_plus_rank(rank: int, world: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    with _mode() as mode:
        torch.manual_seed(42 + rank)  # timm's habit: DDP broadcasts the model from rank 0 anyway
        model = DDP(_hf_model())
        _hf_steps(model, 3, None)
        x = torch.randn(4, 8)  # per-rank noise outside the model: a per-rank stream
        torch.nn.functional.dropout(x, 0.5)
        weights = [p.detach().clone() for p in model.parameters()]
    return _summary(mode, digest=float(sum(w.double().sum() for w in weights)))


def _hf_generate_on_rank0(reference: bool, forked: bool = False) -> int | None:
    """DDP over GPT-2; between two steps rank 0 alone samples text for its logs with
    Hugging Face's generate(), from the module DDP wraps, or with ``reference``, from a model no
    wrapper wraps (a frozen reference model, replicated on every rank); then every rank draws a
    shuffle from the default generator (after sampling from the wrapped module, it differs
    across the ranks and is compared by what runs only, as after any data-parallel draw; a note
    says so). With ``forked``, rank 0 samples as the finding's advice says: inside
    ``torch.random.fork_rng()`` (which puts the generator back) and ``expect("ignore")``.
    Returns the generate() call's line."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import rngcheck

    model = DDP(_hf_model())
    sampler = _hf_model().eval() if reference else model.module
    _hf_steps(model, 1, None)
    line = None
    try:
        if torch.distributed.get_rank() == 0:  # a sample for the logs, drawn on rank 0 only
            sampler.eval()
            forking = torch.random.fork_rng() if forked else contextlib.nullcontext()
            ignoring = rngcheck.expect("ignore") if forked else contextlib.nullcontext()
            with forking, ignoring:
                line = sys._getframe().f_lineno + 1
                sampler.generate(torch.tensor([[1, 2, 3]]), do_sample=True, max_new_tokens=3)
            sampler.train(reference is False)
        torch.randperm(8)
        _hf_steps(model, 1, None)
    except rngcheck.RNGCheckError:
        pass
    return line


def hf_ddp_generate_on_rank0(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    with _mode(on_finding="raise") as mode:
        line = _hf_generate_on_rank0(reference=False)
    return _summary(mode, line=line)


def hf_ddp_reference_model_generates_on_rank0(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    with _mode(on_finding="raise") as mode:
        line = _hf_generate_on_rank0(reference=True)
    return _summary(mode, line=line)


def hf_ddp_reference_model_generates_on_rank0_forked(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    with _mode(on_finding="raise") as mode:
        _hf_generate_on_rank0(reference=True, forked=True)
    return _summary(mode)


def hf_ranks_reach_a_generate_call_apart(rank: int, world: int) -> dict[str, Any]:
    """Every rank samples with generate() from a model no wrapper wraps (Rule 8), for its own
    prompts, but rank 1 drew aside from the default generator just before (under
    expect("ignore")): the ranks start the call in different states, which is found at the
    call, and a second call after sampling its own amounts is then quiet."""
    import rngcheck

    torch.manual_seed(0)
    sampler = _hf_model(checkpointing=False).eval()
    with _mode(on_finding="record") as mode:
        if rank == 1:
            with rngcheck.expect("ignore"):
                torch.rand(3)
        for length in (3, 5):
            ids = torch.arange(1, 1 + length + rank).unsqueeze(0)  # this rank's own prompt
            sampler.generate(ids, do_sample=True, max_new_tokens=2 + rank, pad_token_id=0)
    return _summary(mode)


def _hf_tensor_parallel_training(rank: int, seed: int, checked: bool) -> dict[str, Any]:
    """GPT-NeoX from a tiny config, loaded with Hugging Face's own tensor parallelism
    (``from_pretrained(tp_plan="auto")`` over every rank), trained two steps with dropout and
    gradient checkpointing: its embedding and residual dropout run on activations every rank
    holds whole, so its peers must draw alike."""
    _hf_model(checkpointing=False)  # (puts tests/_hf.py, and its offline switch, on the path)
    import _hf
    import transformers

    path = _hf.saved_gpt_neox()
    with _mode() if checked else contextlib.nullcontext() as mode:
        seed_line = sys._getframe().f_lineno + 1
        torch.manual_seed(seed)
        model = transformers.GPTNeoXForCausalLM.from_pretrained(path, tp_plan="auto")
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(2):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    result = {"losses": losses, "parameters": _hf.parameters_digest(model), "seed_line": seed_line}
    return _summary(mode, **result) if checked else result


def hf_tensor_parallel_training_same_seed(rank: int, world: int) -> dict[str, Any]:
    """The same seed on every rank (correct): quiet, and trained as without the mode, bitwise."""
    return {
        "plain": _hf_tensor_parallel_training(rank, 0, checked=False),
        "checked": _hf_tensor_parallel_training(rank, 0, checked=True),
    }


def hf_tensor_parallel_training_seed_plus_rank(rank: int, world: int) -> dict[str, Any]:
    """The same, each rank seeded with seed + rank (the data-parallel habit): the peers'
    dropout masks over the activations they share differ."""
    return _hf_tensor_parallel_training(rank, 1 + rank, checked=True)


def hf_tensor_parallel_peers_sample_apart(rank: int, world: int) -> dict[str, Any]:
    """A model whose output layer is tensor-parallel (DTensor parameters over every rank): its
    peers run one computation and must sample alike, so generate() on it is not Rule 8's. Here
    rank 1 draws aside from the default generator between two sampled tokens (a logits
    processor, under expect("ignore")), so its next token is sampled from another state: found
    there."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from transformers import LogitsProcessor, LogitsProcessorList

    import rngcheck

    class Aside(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if rank == 1 and input_ids.shape[1] == 4:  # before the second token
                with rngcheck.expect("ignore"):
                    torch.rand(1)
            return scores

    torch.manual_seed(0)
    model = _hf_model(checkpointing=False).eval()
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    with _mode(on_finding="record") as mode:
        model.generate(
            torch.arange(1, 4).unsqueeze(0),
            do_sample=True,
            max_new_tokens=3,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([Aside()]),
        )
    return _summary(mode)


def hf_ddp_rollouts_on_every_rank(rank: int, world: int) -> dict[str, Any]:
    """Reinforcement-learning fine-tuning (TRL's rollouts): every rank samples completions for
    its own prompts with generate() on the module DDP wraps, its own lengths (so its own number
    of draws), then trains on them."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    with _mode() as mode:
        model = DDP(_hf_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        prompts = torch.Generator().manual_seed(10 + rank)  # this rank's own prompts
        for step in range(2):
            ids = torch.randint(1, 64, (2, 3 + rank), generator=prompts)
            model.module.eval()
            with torch.no_grad():
                out = model.module.generate(
                    ids, do_sample=True, max_new_tokens=3 + rank + step, pad_token_id=0
                )
            model.module.train()
            model(input_ids=out, labels=out).loss.backward()
            opt.step()
            opt.zero_grad()
    return _summary(mode)


def ddp_seed_plus_rank_model_moved_before_wrapping(rank: int, world: int) -> dict[str, Any]:
    """seed + rank, then the model moved before DDP (``model.to(device)``; here to float64, which
    copies every parameter the same way a move to a GPU does): DDP broadcasts the moved
    parameters, not the storage their initialisation wrote to."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    with _mode() as mode:
        torch.manual_seed(42 + rank)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
        model = DDP(model.to(torch.float64))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.ones(4, 8, dtype=torch.float64)).sum().backward()
            opt.step()
            opt.zero_grad()
        weights = [p.detach().clone() for p in model.parameters()]
    return _summary(mode, digest=float(sum(w.sum() for w in weights)))


def ddp_built_with_keywords(rank: int, world: int) -> dict[str, Any]:
    """DistributedDataParallel(module=...), as PyTorch Lightning builds it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    with _mode() as mode:
        torch.manual_seed(42 + rank)
        model = DDP(module=torch.nn.Linear(8, 2), broadcast_buffers=False)
        model(torch.ones(4, 8)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    return _summary(mode)


def _ddp_variable_batches(data: torch.Generator | None, extra_draw: bool = False) -> None:
    """DDP over a model with dropout; each rank's batches have their own lengths (drawn from
    ``data``, or from the default generator when None), as a per-rank random crop makes them."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = torch.distributed.get_rank()
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shuffle = torch.Generator().manual_seed(5)  # replicated: the same order on every rank
    for step in range(3):
        length = 4 + (rank + step) % 3  # this rank's sequence length
        start = torch.randint(0, 16 - length + 1, (1,), generator=data)  # a crop of it
        if extra_draw and rank == 1:
            torch.rand(1, generator=data)  # rank 1's augmentation draws once more
        x = torch.arange(16.0).repeat(8, 1).T[int(start) : int(start) + length]
        torch.randperm(4, generator=shuffle)  # compared: it must agree
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()


def ddp_per_rank_generator_variable_lengths(rank: int, world: int) -> dict[str, Any]:
    """A per-rank data generator whose draws have each rank's own shapes: a per-rank stream."""
    with _mode() as mode:
        torch.manual_seed(0)
        _ddp_variable_batches(torch.Generator().manual_seed(100 + rank))
    return _summary(mode)


def ddp_per_rank_generator_extra_draw(rank: int, world: int) -> dict[str, Any]:
    """A per-rank data generator that draws more on one rank, before a replicated draw that
    agrees: the per-rank stream leaves the comparison, the replicated draw stays in it."""
    with _mode() as mode:
        torch.manual_seed(0)
        _ddp_variable_batches(torch.Generator().manual_seed(100 + rank), extra_draw=True)
    return _summary(mode)


def ddp_seed_plus_rank_crops_on_the_default_generator(rank: int, world: int) -> dict[str, Any]:
    """seed + rank, then random crops of per-rank lengths from the default generator."""
    with _mode() as mode:
        torch.manual_seed(42 + rank)
        _ddp_variable_batches(None)
    return _summary(mode)


def ddp_seed_plus_rank_crops_strict(rank: int, world: int) -> dict[str, Any]:
    """The same under strict=True (for CI): nothing learnt, so the per-rank seeds are found."""
    with _mode(strict=True) as mode:
        torch.manual_seed(42 + rank)
        _ddp_variable_batches(None)
    return _summary(mode)


def ddp_replicated_generator_used_with_per_rank_lengths(rank: int, world: int) -> dict[str, Any]:
    """The bug: a generator seeded alike on every rank (so meant to agree) draws each rank's own
    shapes; from there its states differ."""
    with _mode() as mode:
        torch.manual_seed(0)
        _ddp_variable_batches(torch.Generator().manual_seed(100))
    return _summary(mode)


def _draw_noise(like: torch.Tensor) -> torch.Tensor:
    return torch.randn_like(like)  # (one helper for several callers)


def _own_batches(
    net: torch.nn.Module,
    loss_of: Any,
    steps: int,
    wrap: bool = True,
    after: Any = None,
    checked: bool = True,
    **mode: Any,
) -> tuple[dict[str, Any], str]:
    """``steps`` training steps of ``net`` whose loss ``loss_of(model, step)`` draws for the
    rank's own batch in the loop, from the default generator seeded alike on every rank. Under
    DDP (``wrap``), else with gradients averaged by hand. ``after(step)`` runs after each step.
    Returns the summary (``checked``: under a mode made with ``mode``) and a digest of the
    parameters trained."""
    import hashlib

    from torch.nn.parallel import DistributedDataParallel as DDP

    with _mode(**mode) if checked else contextlib.nullcontext() as m:
        model = DDP(net) if wrap else net
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(steps):
            loss_of(model, step).backward()
            if not wrap:
                for p in net.parameters():
                    torch.distributed.all_reduce(p.grad)
            opt.step()
            opt.zero_grad()
            if after is not None:
                after(step)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters()))
    return (_summary(m) if m is not None else {}), digest.hexdigest()


def _noise_over_own_shapes(rank: int, steps: int, **kwargs: Any) -> tuple[dict[str, Any], str]:
    """A diffusion model's training step over aspect-ratio buckets (the shape of diffusers'
    examples): each rank's batch has its own shape, and the loop draws the noise for it and the
    timesteps, outside the model (``_own_batches``)."""
    torch.manual_seed(42)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.Dropout(0.1), torch.nn.Conv2d(4, 2, 1)
    )
    buckets = [(4, 4), (4, 6), (6, 4)]

    def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
        h, w = buckets[(rank + step) % len(buckets)]  # this rank's bucket this step
        latents = torch.linspace(-1, 1, 2 * 2 * h * w).view(2, 2, h, w) * (1 + rank)
        noise = _draw_noise(latents)  # drawn for this rank's own batch
        t = torch.randint(0, 1000, (latents.shape[0],)).view(-1, 1, 1, 1) / 1000
        return (model(latents * (1 - t) + noise * t) - noise).pow(2).mean()

    return _own_batches(net, loss_of, steps, **kwargs)


def ddp_noise_over_each_ranks_own_shapes(rank: int, world: int) -> dict[str, Any]:
    """Correct: the noise and timesteps of each rank's own batch (Rule 9). Also the parameters'
    digest, and the same training's without rngcheck."""
    return _and_plain(_noise_over_own_shapes, rank, 4)


def _and_plain(run: Any, rank: int, steps: int) -> dict[str, Any]:
    """``run``'s summary under the mode, its parameters' digest, and the same training's
    digest without rngcheck (``plain``)."""
    summary, digest = run(rank, steps)
    _, plain = run(rank, steps, checked=False)
    return {**summary, "digest": digest, "plain": plain}


def ddp_noise_over_each_ranks_own_shapes_strict(rank: int, world: int) -> dict[str, Any]:
    summary, _ = _noise_over_own_shapes(rank, 4, strict=True)
    return summary


def ddp_noise_over_each_ranks_own_shapes_at_the_step_level(rank: int, world: int) -> dict[str, Any]:
    summary, _ = _noise_over_own_shapes(rank, 12, level="step", sample_every=5)
    return summary


def ddp_noise_over_own_shapes_then_one_rank_draws_extra(rank: int, world: int) -> dict[str, Any]:
    """The bug after Rule 9's line: rank 1 draws once more, in the loop, at the second step."""

    def extra(step: int) -> None:
        if rank == 1 and step == 1:
            torch.rand(1)

    return _noise_over_own_shapes(rank, 3, after=extra)[0]


def ddp_noise_over_own_shapes_then_rank0_draws_for_its_logs(
    rank: int, world: int
) -> dict[str, Any]:
    """The bug after Rule 9's line: rank 0 alone draws through the same helper, from another
    line, at the second step (a sample for its logs)."""

    def logs(step: int) -> None:
        if rank == 0 and step == 1:
            _draw_noise(torch.zeros(3))

    return _noise_over_own_shapes(rank, 3, after=logs)[0]


def ddp_noise_over_own_shapes_then_one_rank_reseeds(rank: int, world: int) -> dict[str, Any]:
    """The bug after Rule 9's line: rank 1 alone reseeds the default generator after the first
    step, and its next draw is at that line."""

    def reseed(step: int) -> None:
        if rank == 1 and step == 0:
            torch.manual_seed(99)

    return _noise_over_own_shapes(rank, 3, after=reseed)[0]


def ddp_noise_over_own_shapes_then_a_data_split(rank: int, world: int) -> dict[str, Any]:
    """The bug after Rule 9's line: the script splits its data from the generator the noise moved
    apart (Rule 5 compares the split by state)."""

    def split(step: int) -> None:
        if step == 1:
            torch.utils.data.random_split(list(range(10)), [0.8, 0.2])

    return _noise_over_own_shapes(rank, 2, after=split)[0]


def _jitter_own_boxes(rank: int, steps: int, **kwargs: Any) -> tuple[dict[str, Any], str]:
    """A detector's training step: the loop jitters each box of the rank's own images, one draw
    of the same shape per box, so the ranks draw there as many times as their own images hold
    boxes (the first step's too: 2 boxes on rank 0, 3 on rank 1), then one more draw, the
    same on every rank (``_own_batches``)."""
    torch.manual_seed(42)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 4))

    def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
        boxes = [torch.full((4,), float(b + rank)) for b in range(2 + (rank + step) % 3)]
        jittered = [box + 0.1 * torch.randn(4) for box in boxes]  # <- a draw per own box
        scale = 1 + 0.01 * torch.rand(1)  # (after the loop: every rank draws it once a step)
        return ((model(torch.stack(jittered)) - torch.stack(boxes)) * scale).pow(2).mean()

    return _own_batches(net, loss_of, steps, **kwargs)


def ddp_jitter_for_each_of_its_own_boxes(rank: int, world: int) -> dict[str, Any]:
    """Correct: each rank draws the jitter of its own boxes, as many as they are (Rule 9,
    counts). Also the parameters' digest, and the same training's without rngcheck."""
    return _and_plain(_jitter_own_boxes, rank, 5)


def ddp_jitter_for_each_of_its_own_boxes_at_the_step_level(rank: int, world: int) -> dict[str, Any]:
    summary, _ = _jitter_own_boxes(rank, 12, level="step", sample_every=5)
    return summary


def ddp_jitter_own_boxes_then_one_rank_draws_extra(rank: int, world: int) -> dict[str, Any]:
    """The bug after the count's line: rank 1 draws once more, at another line, at the second
    step."""

    def extra(step: int) -> None:
        if rank == 1 and step == 1:
            torch.randn(4)

    return _jitter_own_boxes(rank, 3, after=extra)[0]


def ddp_jitter_own_boxes_then_one_rank_reseeds(rank: int, world: int) -> dict[str, Any]:
    """The bug after the count's line: rank 1 alone reseeds after the first step, and its next
    draw is at that line."""

    def reseed(step: int) -> None:
        if rank == 1 and step == 0:
            torch.manual_seed(99)

    return _jitter_own_boxes(rank, 3, after=reseed)[0]


def ddp_jitter_own_boxes_then_two_draws_in_another_order(rank: int, world: int) -> dict[str, Any]:
    """The bug after the count's line: at the second step rank 1 draws two numbers in the other
    order than rank 0 (each rank ran the other's first op later in the round, not before)."""

    def two_draws(step: int) -> None:
        if step == 1:
            for draw in (torch.randn, torch.rand)[:: 1 if rank == 0 else -1]:
                draw(2)

    return _jitter_own_boxes(rank, 3, after=two_draws)[0]


def hand_written_allreduce_jitter_own_boxes(rank: int, world: int) -> dict[str, Any]:
    """No data-parallel wrapper is known: the ranks drawing different numbers of times stays a
    finding."""
    return _jitter_own_boxes(rank, 2, wrap=False)[0]


def hand_written_allreduce_noise_over_own_shapes(rank: int, world: int) -> dict[str, Any]:
    """No data-parallel wrapper is known (gradients averaged by hand): Rule 9 does not apply,
    and the noise drawn with each rank's own arguments stays a finding."""
    return _noise_over_own_shapes(rank, 2, wrap=False)[0]


def _ddp_padded_batches_epochs(rank: int, epochs: int = 2) -> torch.nn.Module:
    """DDP over a model with dropout, fed by a DataLoader whose batches each rank pads to its
    own longest sequence (dynamic padding, as Hugging Face's collators do): the forward's
    dropout draws a different amount on each rank, and every epoch's iter(DataLoader) then draws
    its base seed from the default generator."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lengths = [[3, 5, 4, 6], [7, 4, 5, 3]][rank % 2]  # this rank's shard of the corpus
    data = [torch.ones(n, 8) for n in lengths]

    def pad(batch: list[torch.Tensor]) -> torch.Tensor:
        return torch.nn.utils.rnn.pad_sequence(batch, batch_first=True)

    loader = torch.utils.data.DataLoader(data, batch_size=2, collate_fn=pad)
    for _ in range(epochs):
        for x in loader:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    return model


def ddp_dynamic_padding_under_dropout(rank: int, world: int) -> dict[str, Any]:
    with _mode() as mode:
        torch.manual_seed(0)
        _ddp_padded_batches_epochs(rank)
    return _summary(mode)


def ddp_dynamic_padding_then_reseeded_and_one_rank_samples(rank: int, world: int) -> dict[str, Any]:
    """After the forward moved the default generator apart, every rank reseeds it alike (its
    states are compared again; with the seed it started from, so its initial seed alone does not
    show the reseed); then rank 1 draws a sample for its logs under expect('ignore') from it,
    and the next replicated draw differs: a finding."""
    import rngcheck

    with _mode() as mode:
        torch.manual_seed(0)
        _ddp_padded_batches_epochs(rank)
        torch.manual_seed(0)
        if rank == 1:
            with rngcheck.expect("ignore"):
                torch.rand(1)  # a sample for rank 1's logs
        line = sys._getframe().f_lineno + 1
        torch.randperm(8)  # the next replicated shuffle
        torch.distributed.barrier()
    return _summary(mode, line=line)


class _ShuffledSampler(torch.utils.data.Sampler):
    """A sampler that shuffles with ``torch.randperm``, from the default generator when given none
    (as transformers' LengthGroupedSampler does under Trainer(group_by_length=True))."""

    LINE = 0

    def __init__(self, n: int, generator: torch.Generator | None = None, seed: int = 0) -> None:
        self.n, self.generator, self.seed, self.epoch = n, generator, seed, 0

    def __len__(self) -> int:
        return self.n

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if self.generator is not None:
            self.generator.manual_seed(self.seed + epoch)

    def __iter__(self) -> Any:
        _ShuffledSampler.LINE = sys._getframe().f_lineno + 1
        return iter(torch.randperm(self.n, generator=self.generator).tolist())


def _ddp_sharded_epochs(rank: int, world: int, sampler: Any, workers: int = 0) -> list[list[int]]:
    """DDP over a model with dropout, fed through accelerate's BatchSamplerShard (every rank walks
    the sampler's order and keeps its share of each global batch, as Hugging Face's Trainer
    does) with dynamic padding: each rank's dropout draws for its own batch shapes. Returns the
    samples this rank trained on, per epoch."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)))
    lengths = [3, 7, 5, 4, 6, 2, 8, 5]
    data = [(i, torch.ones(n, 8)) for i, n in enumerate(lengths)]
    shard = BatchSamplerShard(
        torch.utils.data.BatchSampler(sampler, batch_size=2, drop_last=False),
        num_processes=world,
        process_index=rank,
    )

    def pad(batch: list[Any]) -> tuple[list[int], torch.Tensor]:
        seqs = [x for _, x in batch]
        return [i for i, _ in batch], torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)

    loader = torch.utils.data.DataLoader(
        data,
        batch_sampler=shard,
        collate_fn=pad,
        num_workers=workers,
        persistent_workers=workers > 0,
    )
    return _two_epochs(model, loader, sampler.set_epoch)


def _two_epochs(
    model: torch.nn.Module,
    loader: Any,
    set_epoch: Any,
    before_step: Any = None,
) -> list[list[int]]:
    """Two epochs of SGD over ``loader`` (batches of sample ids and inputs), up to a finding
    raised; ``before_step(epoch)`` runs before each step. Returns the samples this rank trained
    on, per epoch."""
    import rngcheck

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[list[int]] = []
    for epoch in range(2):
        set_epoch(epoch)
        seen.append([])
        try:
            for ids, x in loader:
                seen[-1].extend(ids.tolist() if isinstance(ids, torch.Tensor) else ids)
                if before_step is not None:
                    before_step(epoch)
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
        except rngcheck.RNGCheckError:
            break
    return seen


def ddp_sharded_order_from_a_generator_moved_apart(rank: int, world: int) -> dict[str, Any]:
    """The bug (Hugging Face's Trainer with group_by_length under DDP): the sampler's order is
    drawn from the default generator, which the ranks' dropout moved apart in the first epoch;
    at the second, each rank keeps its share of a different order."""
    torch.manual_seed(0)
    with _mode(on_finding="raise") as mode:
        seen = _ddp_sharded_epochs(rank, world, _ShuffledSampler(8))
    return _summary(mode, line=_ShuffledSampler.LINE, seen=seen)


def ddp_sharded_order_from_a_generator_of_its_own(rank: int, world: int) -> dict[str, Any]:
    """The same, with the order drawn from a generator seeded alike each epoch: correct."""
    torch.manual_seed(0)
    with _mode() as mode:
        seen = _ddp_sharded_epochs(rank, world, _ShuffledSampler(8, torch.Generator(), seed=7))
    return _summary(mode, seen=seen)


def _at_the_step_level(sampler: Any, rank: int, world: int, workers: int = 0) -> dict[str, Any]:
    """The sharded epochs at level="step": the second epoch begins at step 3, between samples
    (the first two steps are sampled), where the step level does not follow each op."""
    torch.manual_seed(0)
    with _mode(level="step", on_finding="record") as mode:
        seen = _ddp_sharded_epochs(rank, world, sampler, workers)
    return _summary(mode, line=_ShuffledSampler.LINE, seen=seen, level=mode.report.meta["level"])


def ddp_sharded_order_from_a_generator_moved_apart_at_the_step_level(
    rank: int, world: int
) -> dict[str, Any]:
    """The bug at level="step": the second epoch's shuffle is drawn between samples."""
    return _at_the_step_level(_ShuffledSampler(8), rank, world)


def ddp_sharded_order_from_a_generator_moved_apart_read_by_a_worker_at_the_step_level(
    rank: int, world: int
) -> dict[str, Any]:
    """The same, read by a persistent worker process: the loader asks its sampler for the first
    indices of each pass as it resets, in this process."""
    return _at_the_step_level(_ShuffledSampler(8), rank, world, workers=1)


def ddp_sharded_order_from_a_generator_of_its_own_at_the_step_level(
    rank: int, world: int
) -> dict[str, Any]:
    """Correct, at level="step"."""
    return _at_the_step_level(_ShuffledSampler(8, torch.Generator(), seed=7), rank, world)


class _Stream(torch.utils.data.IterableDataset):
    """8 sequences of different lengths, in a new order each pass: shuffled from the default
    generator, or with ``own``, from its own ``generator`` attribute (which accelerate's
    IterableDatasetShard reseeds alike on every rank each pass)."""

    LINE = 0
    LENGTHS = (3, 7, 5, 4, 6, 2, 8, 5)

    def __init__(self, own: bool) -> None:
        self.generator = torch.Generator() if own else None

    def __iter__(self) -> Any:
        _Stream.LINE = sys._getframe().f_lineno + 1
        for i in torch.randperm(len(self.LENGTHS), generator=self.generator).tolist():
            yield i, torch.ones(self.LENGTHS[i], 8)


def _ddp_streamed_epochs(rank: int, world: int, own: bool) -> list[list[int]]:
    """DDP over a model with dropout, fed a stream through accelerate's IterableDatasetShard (an
    IterableDataset under accelerate with dispatch_batches=False: every rank iterates the whole
    stream and keeps its share of each global batch) with dynamic padding, so each rank's dropout
    draws for its own batch shapes. Returns the samples this rank trained on, per epoch."""
    from accelerate.data_loader import IterableDatasetShard
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)))
    shard = IterableDatasetShard(
        _Stream(own), batch_size=2, num_processes=world, process_index=rank
    )

    def pad(batch: list[Any]) -> tuple[list[int], torch.Tensor]:
        seqs = [x for _, x in batch]
        return [i for i, _ in batch], torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)

    loader = torch.utils.data.DataLoader(shard, batch_size=2, collate_fn=pad)
    return _two_epochs(model, loader, shard.set_epoch)


def ddp_streamed_order_from_a_generator_moved_apart(rank: int, world: int) -> dict[str, Any]:
    """The bug: the stream shuffles from the default generator, which the ranks' dropout moved
    apart in the first pass; at the second, each rank keeps its share of a different stream."""
    torch.manual_seed(0)
    with _mode(on_finding="raise") as mode:
        seen = _ddp_streamed_epochs(rank, world, own=False)
    return _summary(mode, line=_Stream.LINE, seen=seen)


def ddp_streamed_order_from_the_datasets_generator(rank: int, world: int) -> dict[str, Any]:
    """The same stream drawing from its own generator, which accelerate reseeds: correct."""
    torch.manual_seed(0)
    with _mode() as mode:
        seen = _ddp_streamed_epochs(rank, world, own=True)
    return _summary(mode, seen=seen)


def ddp_distributed_sampler_seeded_per_rank(rank: int, world: int) -> dict[str, Any]:
    """torch's DistributedSampler given a seed that depends on the rank: its shuffles differ, so
    the ranks' shares overlap."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import rngcheck

    torch.manual_seed(0)
    with _mode(on_finding="raise") as mode:
        model = DDP(torch.nn.Linear(4, 4))
        data = list(range(8))
        sampler = torch.utils.data.distributed.DistributedSampler(
            data, num_replicas=world, rank=rank, seed=rank
        )
        seen: list[int] = []
        try:
            for x in torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler):
                seen.extend(x.tolist())
                model(torch.ones(2, 4)).sum().backward()
        except rngcheck.RNGCheckError:
            pass
    return _summary(mode, seen=seen)


def _split_then_train(rank: int, world: int, seed: int, own: bool, level: str = "op") -> Any:
    """A script that splits its data into training and validation sets with torch's
    ``random_split`` (``own``: given a generator seeded alike on every rank, else drawing from
    the default generator seeded with ``seed``), then trains DDP with dropout over the
    training set, read through torch's DistributedSampler, for two epochs."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import rngcheck

    torch.manual_seed(seed)
    seen: list[int] = []
    val: list[int] = []
    with _mode(on_finding="raise", level=level) as mode:
        try:
            generator = torch.Generator().manual_seed(42) if own else None
            train, held_out = torch.utils.data.random_split(
                list(range(10)), [0.8, 0.2], generator=generator
            )
            val = list(held_out)
            model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1)))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            sampler = torch.utils.data.distributed.DistributedSampler(train, world, rank)
            for epoch in range(2):
                sampler.set_epoch(epoch)
                for x in torch.utils.data.DataLoader(train, batch_size=2, sampler=sampler):
                    seen.extend(x.tolist())
                    model(torch.ones(2, 4)).sum().backward()
                    opt.step()
                    opt.zero_grad()
        except rngcheck.RNGCheckError:
            pass
    return _summary(mode, seen=seen, val=val)


def ddp_data_split_on_a_seed_plus_rank_generator(rank: int, world: int) -> dict[str, Any]:
    """The bug: seed + rank, then random_split from the default generator."""
    return _split_then_train(rank, world, 1234 + rank, own=False)


def ddp_data_split_on_a_seed_plus_rank_generator_at_the_step_level(
    rank: int, world: int
) -> dict[str, Any]:
    return _split_then_train(rank, world, 1234 + rank, own=False, level="step")


def ddp_data_split_with_a_generator_of_its_own(rank: int, world: int) -> dict[str, Any]:
    """seed + rank, and random_split given a generator seeded alike: correct."""
    return _split_then_train(rank, world, 1234 + rank, own=True)


def ddp_data_split_on_a_default_generator_seeded_alike(rank: int, world: int) -> dict[str, Any]:
    """random_split from the default generator, every rank seeded alike: correct."""
    return _split_then_train(rank, world, 1234, own=False)


def _rank0_splits_alone(rank: int, seed: int) -> dict[str, Any]:
    """DDP with noise drawn outside the model, and rank 0 alone splitting off a few samples for
    its logs from the default generator, seeded with ``seed``, after the second step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(seed)
    with _mode() as mode:
        model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            if rank == 0 and step == 1:
                torch.utils.data.random_split(list(range(10)), [2, 8])
    return _summary(mode)


def ddp_rank0_splits_alone_from_a_per_rank_stream(rank: int, world: int) -> dict[str, Any]:
    """seed + rank (the noise makes the default generator a known per-rank stream, Rule 3): the
    split is rank 0's own draw."""
    return _rank0_splits_alone(rank, 1234 + rank)


def ddp_rank0_splits_alone_from_a_generator_seeded_alike(rank: int, world: int) -> dict[str, Any]:
    """Every rank seeded alike: rank 0's split shifts its default generator, and every later
    draw from it differs across the ranks (the noise of the next step)."""
    return _rank0_splits_alone(rank, 1234)


def ddp_data_split_after_dropout_moved_the_generator_apart(rank: int, world: int) -> dict[str, Any]:
    """The bug, with every rank seeded alike: a step of dropout over each rank's own batch size
    moves the default generator apart (Rule 2), then the script splits its data from it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(1234)
    with _mode() as mode:
        model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(2 + rank, 4)).sum().backward()
        opt.step()
        torch.utils.data.random_split(list(range(10)), [0.8, 0.2])
    return _summary(mode)


def _distributed_sampler_epochs(
    rank: int, world: int, epochs: int, seed: Any, extra_pass: Any = None
) -> dict[str, Any]:
    """DDP at level="step" over 8 samples read one at a time (``batch_size=None``: the loader
    iterates torch's DistributedSampler as it is made, and its ``__iter__`` draws the order at
    once) through torch's DistributedSampler, seeded ``seed(epoch)``, shuffling from the second
    epoch (4 steps an epoch: the second begins at step 5, between samples). ``extra_pass(epoch)``
    runs before each epoch. Also returns how many generators the mode tracks after the first
    epoch and at the end (the sampler makes one each pass)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    tracked = []
    with _mode(level="step", on_finding="record") as mode:
        model = DDP(torch.nn.Linear(4, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = list(range(8))
        seen: list[list[int]] = []
        for epoch in range(epochs):
            if extra_pass is not None:
                extra_pass(epoch)
            sampler = torch.utils.data.distributed.DistributedSampler(
                data, num_replicas=world, rank=rank, shuffle=epoch > 0, seed=seed(epoch)
            )
            sampler.set_epoch(epoch)
            seen.append([])
            for x in torch.utils.data.DataLoader(data, batch_size=None, sampler=sampler):
                seen[-1].append(int(x))
                model(torch.ones(4)).sum().backward()
                opt.step()
                opt.zero_grad()
            tracked.append(len(mode._generators.tracked()))
    return _summary(mode, seen=seen, level=mode.report.meta["level"], tracked=tracked)


def ddp_distributed_sampler_seeded_per_rank_from_the_second_epoch(
    rank: int, world: int
) -> dict[str, Any]:
    """The first epoch in order, then shuffled by torch's DistributedSampler given a seed that
    depends on the rank: the shuffle is drawn at step 5, between samples."""
    return _distributed_sampler_epochs(rank, world, 3, lambda epoch: rank)


def ddp_one_rank_reads_an_extra_pass_then_seeds_per_rank(rank: int, world: int) -> dict[str, Any]:
    """In the second epoch rank 0 alone also reads a loader over torch's DistributedSampler, so
    the ranks' pass counts part for good; from the tenth epoch (step 37) the training sampler
    is seeded by rank. The round of steps 1-32 finds the counts apart all through its second
    half, the ranks count again from there, and the tenth epoch's order is found."""

    def extra_pass(epoch: int) -> None:
        if epoch == 1 and rank == 0:
            sampler = torch.utils.data.distributed.DistributedSampler(
                list(range(8)), num_replicas=world, rank=rank, seed=0
            )
            for _ in torch.utils.data.DataLoader(list(range(8)), batch_size=2, sampler=sampler):
                pass

    return _distributed_sampler_epochs(
        rank, world, 11, lambda epoch: rank if epoch >= 9 else 0, extra_pass
    )


class _Jittered(torch.utils.data.Dataset):
    """8 samples, each jittered as it is read with noise from the default generator."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, torch.ones(3, 8) + 0.01 * torch.randn(3, 8)


def _ddp_dispatched_epochs(rank: int, world: int, log_sample: bool = False) -> list[list[int]]:
    """DDP over a model with dropout, fed by accelerate's DataLoaderDispatcher (what accelerate
    and Hugging Face's Trainer use for an IterableDataset, or with dispatch_batches=True): rank 0
    alone iterates the DataLoader, whose sampler shuffles from the default generator and whose
    dataset jitters each sample from it, and broadcasts each global batch to every rank.
    ``log_sample``: at the second epoch's first step rank 0 also draws a value for its logs from
    the default generator (a random op of rank 0's alone, outside the reading). Returns the
    samples this rank trained on, per epoch."""
    from accelerate import PartialState
    from accelerate.data_loader import prepare_data_loader
    from torch.nn.parallel import DistributedDataParallel as DDP

    PartialState(cpu=True)  # accelerate's view of the process group (the dispatcher's ranks)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)))
    loader = prepare_data_loader(
        torch.utils.data.DataLoader(_Jittered(), batch_size=2, shuffle=True),
        num_processes=world,
        process_index=rank,
        device=torch.device("cpu"),
        put_on_device=True,
        dispatch_batches=True,
    )

    def log(epoch: int) -> None:
        if log_sample and rank == 0 and epoch == 1:
            torch.rand(1)  # the bug: a value for rank 0's logs

    return _two_epochs(model, loader, loader.set_epoch, log)


def ddp_dispatched_batches_read_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    with _mode() as mode:
        seen = _ddp_dispatched_epochs(rank, world)
    return _summary(mode, seen=seen)


def ddp_dispatched_batches_then_rank0_draws_for_its_logs(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    with _mode(on_finding="raise") as mode:
        seen = _ddp_dispatched_epochs(rank, world, log_sample=True)
    return _summary(mode, seen=seen)


def ddp_collator_masks_each_ranks_own_batch(rank: int, world: int) -> dict[str, Any]:
    """Rule 7: torch's DistributedSampler gives each rank its share of 8 sequences of different
    lengths; the collator pads each batch to its longest and masks its tokens from the default
    generator (as Hugging Face's DataCollatorForLanguageModeling does), over each rank's own
    batch shapes. Correct: the masks are each rank's own. The model has no dropout, so only the
    collator moves the default generator apart. DDP is built before the mode starts (so known at
    its first forward, after the first batch was read)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 8))
    with _mode() as mode:
        data = [(i, torch.ones(n, 8)) for i, n in enumerate(_Stream.LENGTHS)]
        sampler = torch.utils.data.distributed.DistributedSampler(
            data, num_replicas=world, rank=rank, seed=3
        )

        def pad_and_mask(batch: list[Any]) -> tuple[list[int], torch.Tensor]:
            x = torch.nn.utils.rnn.pad_sequence([x for _, x in batch], batch_first=True)
            keep = torch.bernoulli(torch.full(x.shape[:2], 0.85))  # this batch's own shape
            return [i for i, _ in batch], x * keep[..., None]

        loader = torch.utils.data.DataLoader(
            data, batch_size=2, sampler=sampler, collate_fn=pad_and_mask
        )
        seen = _two_epochs(model, loader, sampler.set_epoch)
    return _summary(mode, seen=seen)


def ddp_one_rank_reseeds_mid_training(rank: int, world: int) -> dict[str, Any]:
    """The bug: every rank seeds alike, then rank 1 alone reseeds (a resume that restores its
    own state): the replicated shuffle after it differs. Not a per-rank stream: the ranks'
    seeds differ because one rank reseeded alone."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import rngcheck

    torch.manual_seed(0)
    with _mode(on_finding="raise") as mode:
        model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        seed_line = line = None
        try:
            for step in range(3):
                if step == 1 and rank == 1:
                    seed_line = sys._getframe().f_lineno + 1
                    torch.manual_seed(99)
                line = sys._getframe().f_lineno + 1
                torch.randperm(8)  # the next shuffle, replicated
                model(torch.ones(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
        except rngcheck.RNGCheckError:
            pass
    return _summary(mode, line=line, seed_line=seed_line)


def ddp_dropout_masks_differ(rank: int, world: int) -> dict[str, Any]:
    """A plain model with dropout: every rank seeds per rank, dropout masks differ, DDP syncs."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    with _mode() as mode:
        torch.manual_seed(rank)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    return _summary(mode)


def _powersgd_training(
    rank: int,
    steps: int,
    random_seed: int,
    checked: bool = True,
    warm_start: bool = False,
    **mode: Any,
) -> tuple[dict[str, Any], str]:
    """DDP with torch's PowerSGD communication hook, which draws its low-rank Q in backward, in a
    fork of the default generator seeded from ``PowerSGDState``'s ``random_seed``: from the
    third step on, afresh at each step (``warm_start=False``) or at the first only. Each rank
    trains on batches of its own size, so its dropout draws its own amounts from the default
    generator (they part there by design), and every rank draws once more from it after every
    third step, the first time after the first compressed step (a random choice for the logs:
    compared by what runs). Returns the summary (``checked``: under a mode made with ``mode``)
    and a digest of the parameters trained."""
    import hashlib

    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    data = torch.Generator().manual_seed(100 + rank)
    net = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 32)
    )
    with _mode(**mode) if checked else contextlib.nullcontext() as m:
        model = DDP(net)
        state = powersgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=2,
            start_powerSGD_iter=2,
            warm_start=warm_start,
            random_seed=random_seed,
        )
        model.register_comm_hook(state, powersgd.powerSGD_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(steps):
            x = torch.randn(8 + 4 * rank, 32, generator=data)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step % 3 == 2:
                torch.rand(1)  # a random choice for the logs, on every rank
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters()))
    return (_summary(m) if m is not None else {}), digest.hexdigest()


def ddp_powersgd_seeded_alike(rank: int, world: int) -> dict[str, Any]:
    """Correct: PowerSGDState's default random_seed on every rank; at the op level and at the
    step level (every other step checked op by op), and the same training without rngcheck."""
    summary, digest = _powersgd_training(rank, 6, random_seed=0)
    step, _ = _powersgd_training(rank, 7, random_seed=0, level="step", sample_every=2)
    warm, _ = _powersgd_training(rank, 6, random_seed=0, warm_start=True)
    _, plain = _powersgd_training(rank, 6, random_seed=0, checked=False)
    return {**summary, "digest": digest, "plain": plain, "step_level": step, "warm": warm}


def ddp_powersgd_seeded_per_rank(rank: int, world: int) -> dict[str, Any]:
    """The bug: random_seed=rank (a script's seed + rank habit), so each rank starts its Q from
    another state; at the op level, and at the step level (found at a step checked op by op)."""
    summary, _ = _powersgd_training(rank, 4, random_seed=rank)
    step, _ = _powersgd_training(rank, 7, random_seed=rank, level="step", sample_every=3)
    warm, _ = _powersgd_training(rank, 4, random_seed=rank, warm_start=True)
    return {**summary, "step_level": step, "warm": warm}


def ddp_comm_hook_collective_runs_inline_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    """A communication hook shaped as PowerSGD's: a collective, then another one in a callback
    chained on its future. A callback chained on a future already done runs at once on the
    calling thread, else later on gloo's: here rank 0 waits first (under load, timing alone
    decides it, which stopped correct PowerSGD training with "rank(s) 0 did not reach RNG
    exchange #22 within 30 s"). Between the forward and its backward, a frozen teacher wrapped
    in a DDP of its own (no hook) runs forward too. Correct training, under the mode and without
    it."""
    import hashlib

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    def averaged(state: Any, bucket: Any) -> Any:
        grads = bucket.buffer().div_(world)
        fut = dist.all_reduce(grads, async_op=True).get_future()
        if rank == 0:
            fut.wait()  # done before .then(): the callback runs inline, on this thread

        def then(done: Any) -> torch.Tensor:
            norm = grads.norm().reshape(1)  # (a second collective, as PowerSGD's callbacks run)
            dist.all_reduce(norm, async_op=True).get_future().wait()
            return done.value()[0]

        return fut.then(then)

    # (DDP checks a hook's annotations against the classes; under postponed annotations they
    # are strings)
    averaged.__annotations__.clear()

    def train(checked: bool) -> tuple[dict[str, Any], str]:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.1))
        data = torch.Generator().manual_seed(rank)
        with _mode() if checked else contextlib.nullcontext() as m:
            model = DDP(net)
            model.register_comm_hook(None, averaged)
            teacher = DDP(torch.nn.Linear(16, 16))  # (frozen: run under no_grad)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(4):
                x = torch.randn(4, 16, generator=data)
                out = model(x)
                with torch.no_grad():
                    target = teacher(x)
                (out - target).square().mean().backward()
                opt.step()
                opt.zero_grad()
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters()))
        return (_summary(m) if m is not None else {}), digest.hexdigest()

    summary, digest = train(checked=True)
    _, plain = train(checked=False)
    return {**summary, "digest": digest, "plain": plain}


def _seed_rank_init() -> torch.nn.Module:
    torch.manual_seed(7 + torch.distributed.get_rank())  # the bug under test: nothing broadcasts
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def hand_written_allreduce_seed_plus_rank(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    with _mode() as mode:
        model = _seed_rank_init()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.ones(4, 8)).sum().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            opt.step()
            opt.zero_grad()
    return _summary(mode)


def ddp_without_init_sync_seed_plus_rank(rank: int, world: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    with _mode() as mode:
        model = DDP(_seed_rank_init(), init_sync=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.ones(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    return _summary(mode)


def fsdp_seed_plus_rank(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with _mode() as mode:
        model = FSDP(_seed_rank_init(), device_id=torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(4, 8)).sum().backward()
        opt.step()
    return _summary(mode)


def fully_shard_seed_plus_rank(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with _mode() as mode:
        model = _seed_rank_init()
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(4, 8)).sum().backward()
        opt.step()
    return _summary(mode)


def fully_shard_same_seed_dropout(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    with _mode() as mode:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(rank)
        for _ in range(2):
            model(torch.randn(4, 8, generator=data)).sum().backward()
            opt.step()
            opt.zero_grad()
    return _summary(mode)


def _deepspeed() -> Any:
    import deepspeed

    # DeepSpeed's CPU accelerator compiles a shared-memory all-reduce for inference when its
    # communication starts (a minute of C++ on a fresh machine); training never calls it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def _deepspeed_steps(
    deepspeed: Any, zero_init: bool, stage: int, extra_on_rank0: bool = False
) -> Any:
    """DeepSpeed's engine (ZeRO ``stage``; with ``zero_init`` the model is made under
    ``deepspeed.zero.Init``), seed + rank before the model, per-rank data: three steps."""
    import contextlib

    rank = torch.distributed.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    torch.manual_seed(42 + rank)
    zero = deepspeed.zero
    with zero.Init(config_dict_or_path=config) if zero_init else contextlib.nullcontext():
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2)
        )
    params = model.parameters()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    if extra_on_rank0:
        torch.manual_seed(0)  # seeded alike again: the default generator is replicated from here
    data = torch.Generator().manual_seed(100 + rank)
    line = None
    for _ in range(3):
        engine.backward(engine(torch.randn(4, 8, generator=data)).square().mean())
        engine.step()
        if extra_on_rank0 and rank == 0:
            line = sys._getframe().f_lineno + 1
            torch.rand(1)  # a sample for rank 0's logs, from the default generator
        torch.randperm(8)  # the next shuffle, replicated: each rank must draw the same order
    return engine, line


def deepspeed_seed_plus_rank(rank: int, world: int) -> dict[str, Any]:
    deepspeed = _deepspeed()  # imported before the mode starts, as a script's imports are
    with _mode() as mode:
        engine, _ = _deepspeed_steps(deepspeed, zero_init=False, stage=1)
        weights = [p.detach().clone() for p in engine.module.parameters()]
    return _summary(mode, digest=float(sum(w.double().sum() for w in weights)))


def deepspeed_zero3_init_seed_plus_rank(rank: int, world: int) -> dict[str, Any]:
    deepspeed = _deepspeed()
    with _mode() as mode:
        engine, _ = _deepspeed_steps(deepspeed, zero_init=True, stage=3)
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            digest = float(sum(p.detach().double().sum() for p in params))
    return _summary(mode, digest=digest)


def deepspeed_rank0_draws_before_a_replicated_shuffle(rank: int, world: int) -> dict[str, Any]:
    deepspeed = _deepspeed()
    with _mode() as mode:
        _, line = _deepspeed_steps(deepspeed, zero_init=False, stage=0, extra_on_rank0=True)
    return _summary(mode, line=line)


def _deepspeed_initialised_on_rank0(deepspeed: Any, modifier_rank: int | None) -> Any:
    """ZeRO-3, as Hugging Face's Trainer makes a model from a config (its
    initialize_weights_zero3): seeded alike, made under zero.Init, then initialised on rank 0
    alone inside GatheredParameters(..., modifier_rank), which broadcasts rank 0's values as it
    exits (only with a modifier rank). Then three steps, each drawing a replicated shuffle from
    the default generator. Returns a digest of the weights and the initialisation's line."""
    rank = torch.distributed.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
    }
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2)
        )
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank):
        if rank == 0:
            for p in params:
                line = sys._getframe().f_lineno + 1
                torch.nn.init.normal_(p, std=0.02)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        torch.randperm(4)  # replicated: compared (by what runs, once the init moved it apart)
        engine.backward(engine(torch.randn(4, 8, generator=data)).square().mean())
        engine.step()
    with deepspeed.zero.GatheredParameters(params):
        digest = float(sum(p.detach().double().sum() for p in params))
    return digest, line if rank == 0 else None


def deepspeed_zero3_initialised_on_rank0_and_broadcast(rank: int, world: int) -> dict[str, Any]:
    deepspeed = _deepspeed()
    with _mode() as mode:
        digest, line = _deepspeed_initialised_on_rank0(deepspeed, modifier_rank=0)
    return _summary(mode, digest=digest, line=line)


def deepspeed_zero3_initialised_on_rank0_not_broadcast(rank: int, world: int) -> dict[str, Any]:
    """The bug: without a modifier rank the region broadcasts nothing (rank 0's values are
    dropped as it exits), so rank 0's draws there are its own extra random ops."""
    deepspeed = _deepspeed()
    with _mode() as mode:
        digest, line = _deepspeed_initialised_on_rank0(deepspeed, modifier_rank=None)
    return _summary(mode, digest=digest, line=line)


def _train_with_a_probe_on_rank0() -> float:
    """DDP training in which rank 0 alone trains a linear probe on the model's features every 10
    steps, for its logs: its own optimizer, 20 steps each time, its randomness forked from the
    default generator and declared its own (as docs/data-parallel.md says to). Returns the sum
    of the model's parameters."""
    from torch.nn.parallel import DistributedDataParallel

    import rngcheck

    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
    )
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + rank)
    for step in range(24):
        ddp(torch.randn(4, 8, generator=data)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and step % 10 == 5:
            with torch.random.fork_rng(), rngcheck.expect("ignore"):
                probe = torch.nn.Linear(16, 2)
                probe_opt = torch.optim.SGD(probe.parameters(), lr=0.1)
                with torch.no_grad():
                    features = model[0](torch.randn(32, 8))
                for _ in range(20):
                    loss = torch.nn.functional.cross_entropy(
                        probe(features), torch.zeros(32, dtype=torch.long)
                    )
                    loss.backward()
                    probe_opt.step()
                    probe_opt.zero_grad()
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def _probe_scenario(**mode_kwargs: Any) -> dict[str, Any]:
    plain = _train_with_a_probe_on_rank0()
    with _mode(**mode_kwargs) as mode:
        digest = _train_with_a_probe_on_rank0()
    return _summary(mode, bitwise=digest == plain)


def ddp_rank0_trains_a_probe_alone(rank: int, world: int) -> dict[str, Any]:
    return _probe_scenario()


def ddp_rank0_trains_a_probe_alone_at_the_step_level(rank: int, world: int) -> dict[str, Any]:
    return _probe_scenario(level="step")


def ddp_then_a_head_on_every_rank_collected_on_rank0(rank: int, world: int) -> dict[str, Any]:
    """Two stages: DDP training whose wrapper and optimizer a trainer object holds (which refers
    to itself), dropped; then every rank trains a head of its own, unwrapped, on the same data.
    The garbage collector frees the first stage on rank 0 only (as collections fall where each
    rank's allocations put them). Whether the head's optimizer took the lead depended on it."""
    import gc

    from torch.nn.parallel import DistributedDataParallel

    gc.disable()
    try:
        with _mode() as mode:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout())
            ddp = DistributedDataParallel(model)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
            schedule = torch.optim.lr_scheduler.StepLR(opt, 5)
            for _ in range(4):
                ddp(torch.randn(4, 8)).square().mean().backward()
                opt.step()
                schedule.step()
                opt.zero_grad()
            stage = {"ddp": ddp, "opt": opt, "schedule": schedule}
            stage["stage"] = stage
            del ddp, opt, schedule, stage
            if rank == 0:
                gc.collect()
            head = torch.nn.Sequential(torch.nn.Linear(8, 2), torch.nn.Dropout())
            head_opt = torch.optim.SGD(head.parameters(), lr=0.1)
            for _ in range(20):
                head(model(torch.ones(4, 8))).square().mean().backward()
                head_opt.step()
                head_opt.zero_grad()
    finally:
        gc.enable()
    return _summary(mode)


def _steps_once_more(rank: int, steps: int) -> dict[str, Any]:
    """Rank 1 steps its optimizer once more than rank 0 at the end (with no gradients), after
    ``steps`` training steps: the ranks end the block at different step counts."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout()))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    with _mode(level="step") as mode:
        for _ in range(steps):
            ddp(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        if rank == 1:
            opt.step()
    return _summary(mode)


def ddp_rank1_steps_once_more_at_the_step_level(rank: int, world: int) -> dict[str, Any]:
    """... within one round of the step level's (10 and 11 steps)."""
    return _steps_once_more(rank, 10)


def ddp_rank1_steps_once_more_to_a_full_round(rank: int, world: int) -> dict[str, Any]:
    """... where rank 1's extra step fills a round (31 and 32 steps): it posts that round as
    rank 0 posts its closing one."""
    return _steps_once_more(rank, 31)


# ---------------------------------------------------------------------------------------------
# Tests (parent process): one launch of 2 ranks runs every scenario


SCENARIOS = [
    "hf_ddp_same_seed_per_rank_data",
    "hf_ddp_seed_plus_rank",
    "ddp_dropout_masks_differ",
    "ddp_seed_plus_rank_model_moved_before_wrapping",
    "ddp_built_with_keywords",
    "ddp_per_rank_generator_variable_lengths",
    "ddp_per_rank_generator_extra_draw",
    "ddp_seed_plus_rank_crops_on_the_default_generator",
    "ddp_seed_plus_rank_crops_strict",
    "ddp_replicated_generator_used_with_per_rank_lengths",
    "ddp_noise_over_each_ranks_own_shapes",
    "ddp_noise_over_each_ranks_own_shapes_strict",
    "ddp_noise_over_each_ranks_own_shapes_at_the_step_level",
    "ddp_noise_over_own_shapes_then_one_rank_draws_extra",
    "ddp_noise_over_own_shapes_then_a_data_split",
    "ddp_noise_over_own_shapes_then_rank0_draws_for_its_logs",
    "ddp_noise_over_own_shapes_then_one_rank_reseeds",
    "hand_written_allreduce_noise_over_own_shapes",
    "ddp_jitter_for_each_of_its_own_boxes",
    "ddp_jitter_for_each_of_its_own_boxes_at_the_step_level",
    "ddp_jitter_own_boxes_then_one_rank_draws_extra",
    "ddp_jitter_own_boxes_then_one_rank_reseeds",
    "ddp_jitter_own_boxes_then_two_draws_in_another_order",
    "hand_written_allreduce_jitter_own_boxes",
    "ddp_dynamic_padding_under_dropout",
    "ddp_dynamic_padding_then_reseeded_and_one_rank_samples",
    "ddp_one_rank_reseeds_mid_training",
    "ddp_sharded_order_from_a_generator_moved_apart",
    "ddp_sharded_order_from_a_generator_of_its_own",
    "ddp_distributed_sampler_seeded_per_rank",
    "ddp_data_split_on_a_seed_plus_rank_generator",
    "ddp_data_split_on_a_seed_plus_rank_generator_at_the_step_level",
    "ddp_data_split_with_a_generator_of_its_own",
    "ddp_data_split_on_a_default_generator_seeded_alike",
    "ddp_rank0_splits_alone_from_a_per_rank_stream",
    "ddp_rank0_splits_alone_from_a_generator_seeded_alike",
    "ddp_data_split_after_dropout_moved_the_generator_apart",
    "ddp_sharded_order_from_a_generator_moved_apart_at_the_step_level",
    "ddp_sharded_order_from_a_generator_moved_apart_read_by_a_worker_at_the_step_level",
    "ddp_sharded_order_from_a_generator_of_its_own_at_the_step_level",
    "ddp_distributed_sampler_seeded_per_rank_from_the_second_epoch",
    "ddp_one_rank_reads_an_extra_pass_then_seeds_per_rank",
    "ddp_streamed_order_from_a_generator_moved_apart",
    "ddp_streamed_order_from_the_datasets_generator",
    "ddp_dispatched_batches_read_on_one_rank",
    "ddp_dispatched_batches_then_rank0_draws_for_its_logs",
    "ddp_collator_masks_each_ranks_own_batch",
    "hand_written_allreduce_seed_plus_rank",
    "ddp_without_init_sync_seed_plus_rank",
    "fsdp_seed_plus_rank",
    "fully_shard_seed_plus_rank",
    "fully_shard_same_seed_dropout",
    "deepspeed_seed_plus_rank",
    "deepspeed_zero3_init_seed_plus_rank",
    "deepspeed_rank0_draws_before_a_replicated_shuffle",
    "deepspeed_zero3_initialised_on_rank0_and_broadcast",
    "deepspeed_zero3_initialised_on_rank0_not_broadcast",
    "hf_ddp_generate_on_rank0",
    "hf_ddp_reference_model_generates_on_rank0",
    "hf_ddp_reference_model_generates_on_rank0_forked",
    "hf_ranks_reach_a_generate_call_apart",
    "hf_tensor_parallel_peers_sample_apart",
    "hf_ddp_rollouts_on_every_rank",
    "hf_tensor_parallel_training_same_seed",
    "hf_tensor_parallel_training_seed_plus_rank",
    "ddp_rank0_trains_a_probe_alone",
    "ddp_rank0_trains_a_probe_alone_at_the_step_level",
    "ddp_rank1_steps_once_more_at_the_step_level",
    "ddp_rank1_steps_once_more_to_a_full_round",
    "ddp_then_a_head_on_every_rank_collected_on_rank0",
    "ddp_powersgd_seeded_alike",
    "ddp_powersgd_seeded_per_rank",
    "ddp_comm_hook_collective_runs_inline_on_one_rank",
]


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from _dist import run_scenarios

    return run_scenarios(
        _HERE, SCENARIOS, world_size=2, out_dir=tmp_path_factory.mktemp("dp"), timeout=300
    )


# What each correct run compares across the ranks, beside what it leaves uncompared and why
# (each rank's meta rank_compared: at least so many, for those reasons alone, see
# _dist.assert_compared), and the per-rank stream its notes name (its draws, per_rank_seed).


def _ddp(own_batch: int, per_rank_seed: int = 0, **at_least: int) -> dict[str, Any]:
    """DDP over a Linear with dropout: its weight and bias broadcast, and compared by digest as
    the replicated parameters they are; the dropout of its forward at ``own_batch`` steps each
    rank's own; ``per_rank_seed`` draws from a per-rank stream; ``at_least`` compared beside."""
    own = {"own_batch": own_batch, **({"per_rank_seed": per_rank_seed} if per_rank_seed else {})}
    replicated = {"initialisations_broadcast": 2, "replicated_parameters": 2}
    return {**at_least, **replicated, "not_compared": own}


# GPT-2 from _hf's tiny config: DDP broadcasts its initialisations and holds its 28 parameters
# (the output layer is the input embedding's) whole on every rank, compared by digest.
_GPT2 = {"initialisations_broadcast": 1, "replicated_parameters": 28}

QUIET: dict[str, tuple[dict[str, Any], str]] = {
    # Nothing replicated is drawn: DDP broadcasts GPT-2's initialisations, its dropout is each
    # rank's own, and the data comes from a generator seeded per rank (3 batches).
    "hf_ddp_same_seed_per_rank_data": (
        {**_GPT2, "not_compared": {"own_batch": 1, "per_rank_seed": 3}},
        "Generator #1 (cpu)",
    ),
    # The three batches' tokens, each from a generator _hf.batch seeds alike on every rank; the
    # noise and its dropout after training, from the default generator seeded per rank.
    "hf_ddp_seed_plus_rank": (
        {"by_state": 3, **_GPT2, "not_compared": {"own_batch": 1, "per_rank_seed": 2}},
        "default cpu",
    ),
    # Nothing replicated is drawn: the inputs of the 3 steps come from the default generator
    # seeded per rank.
    "ddp_dropout_masks_differ": (_ddp(3, per_rank_seed=3), "default cpu"),
    # Nothing replicated is drawn (see test_a_model_moved_before_wrapping_is_still_known_...).
    "ddp_seed_plus_rank_model_moved_before_wrapping": (_ddp(2), ""),
    # DistributedDataParallel(module=...) is known: its model's initialisations are broadcast
    # and its parameters compared as replicated (nothing else is drawn).
    "ddp_built_with_keywords": (
        {"initialisations_broadcast": 2, "replicated_parameters": 2, "not_compared": {}},
        "",
    ),
    # The shuffle every rank draws from a generator seeded alike, at each of the 3 steps; the
    # crops, from the per-rank stream (rank 1 draws from it twice a step in the extra draw's).
    "ddp_per_rank_generator_variable_lengths": (
        _ddp(3, per_rank_seed=3, by_state=3),
        "Generator #1 (cpu)",
    ),
    "ddp_per_rank_generator_extra_draw": (
        _ddp(3, per_rank_seed=3, by_state=3),
        "Generator #1 (cpu)",
    ),
    "ddp_seed_plus_rank_crops_on_the_default_generator": (
        _ddp(3, per_rank_seed=3, by_state=3),
        "default cpu",
    ),
    # The first epoch's DataLoader seed, before the dropout of 4 steps moved its generator apart.
    "ddp_dynamic_padding_under_dropout": (_ddp(4, by_state=1), ""),
    # The two epochs' orders from the sampler's generator, and the first DataLoader seed.
    "ddp_sharded_order_from_a_generator_of_its_own": (_ddp(4, by_state=3), ""),
    # The first pass's DataLoader seed, which every rank draws (rank 0 alone reads the batches:
    # see test_batches_one_rank_reads_for_every_rank_are_its_own_and_said).
    "ddp_dispatched_batches_read_on_one_rank": (
        {"by_state": 1, "initialisations_broadcast": 2, "replicated_parameters": 2},
        "",
    ),
    # The two passes' orders from the dataset's own generator, and the first DataLoader seed.
    "ddp_streamed_order_from_the_datasets_generator": (_ddp(4, by_state=3), ""),
    # The two epochs' orders of torch's DistributedSampler and the first DataLoader seed; the
    # collator's masks over each rank's 2 batches an epoch are its own (DDP was built before the
    # mode: no initialisation to broadcast, but its parameters are compared as replicated).
    "ddp_collator_masks_each_ranks_own_batch": (
        {"by_state": 3, "replicated_parameters": 2, "not_compared": {"own_share": 4}},
        "",
    ),
    # fully_shard broadcasts nothing: the Linear's two initialisations are compared at the
    # first step (its parameters are sharded, not replicated). The inputs of the 2 steps come
    # from a generator seeded per rank.
    "fully_shard_same_seed_dropout": (
        {"initialisations": 2, "not_compared": {"own_batch": 2, "per_rank_seed": 2}},
        "Generator #1 (cpu)",
    ),
    # The split and the two epochs' orders of torch's DistributedSampler; the two epochs'
    # DataLoader seeds, from the default generator seeded per rank.
    "ddp_data_split_with_a_generator_of_its_own": (
        _ddp(4, per_rank_seed=2, by_state=3),
        "default cpu",
    ),
    "ddp_data_split_on_a_default_generator_seeded_alike": (_ddp(4, by_state=3), ""),
    # Nothing replicated is drawn: the noise of the 3 steps and rank 0's split (a fourth draw
    # there) come from the default generator seeded per rank.
    "ddp_rank0_splits_alone_from_a_per_rank_stream": (_ddp(3, per_rank_seed=3), "default cpu"),
}


@pytest.mark.parametrize("name", list(QUIET))
def test_correct_data_parallel_training_is_quiet(two: Any, name: str) -> None:
    expected, per_rank = QUIET[name]
    for rank, r in two.ok(name).items():
        assert not r["findings"], (rank, r["findings"])
        assert r["random_ops"] > 0
        assert_compared(r["compared"], rank, **expected)
        if per_rank:  # (a per-rank stream is said in a note; its draws count as per_rank_seed)
            said = f"not compared: {per_rank} is seeded differently on each rank"
            assert said in "\n".join(r["notes"]), (rank, r["notes"])


@pytest.mark.parametrize(
    ("name", "stream"),
    [
        ("ddp_per_rank_generator_variable_lengths", "Generator #1 (cpu)"),
        ("ddp_per_rank_generator_extra_draw", "Generator #1 (cpu)"),
        ("ddp_seed_plus_rank_crops_on_the_default_generator", "default cpu"),
    ],
)
def test_per_rank_streams_may_draw_per_rank_shapes_and_amounts(
    two: Any, name: str, stream: str
) -> None:
    """A per-rank stream serves per-rank data: its draws may have each rank's shapes, and one
    rank may draw more; the ranks' ops differ there, not only their states."""
    for rank, r in two.ok(name).items():
        text = "\n".join(r["notes"])
        assert f"not compared: {stream} is seeded differently on each rank" in text, (rank, text)


def test_strict_learns_nothing_and_finds_every_such_difference(two: Any) -> None:
    """What is learnt from a mismatch is said as learnt (a per-rank stream, a line drawing each
    rank's own arguments); with strict=True (RNGCHECK_STRICT=1, for CI) nothing is learnt, and
    the same programs are found at the op where the ranks parted."""
    learnt = "Learnt from the ranks' draws, not declared: with strict=True"
    for name in (
        "ddp_seed_plus_rank_crops_on_the_default_generator",
        "ddp_noise_over_each_ranks_own_shapes",
    ):
        for rank, r in two.ok(name).items():
            assert not r["findings"], (name, rank, r["findings"])
            assert learnt in "\n".join(r["notes"]), (name, rank, r["notes"])
    # The noise line's 4 draws, the one it was learnt from included, are left uncompared as
    # drawn with each rank's own arguments (a per-rank stream is said in a note, not counted).
    for rank, r in two.ok("ddp_noise_over_each_ranks_own_shapes").items():
        assert r["compared"]["not_compared"]["own_arguments"] == 4, (rank, r["compared"])
    learnt_reasons = {"per_rank_seed", "own_arguments", "own_count"}
    for name in ("ddp_seed_plus_rank_crops_strict", "ddp_noise_over_each_ranks_own_shapes_strict"):
        for rank, r in two.ok(name).items():
            assert not learnt_reasons & set(r["compared"]["not_compared"]), (rank, r["compared"])
    for rank, r in two.ok("ddp_seed_plus_rank_crops_strict").items():
        assert len(r["findings"]) == 1, (rank, r["findings"], r["notes"])
        f = r["findings"][0]
        assert f["kind"] == "rank_divergence", f
        assert "with different arguments" in f["message"], f
        assert "seeded differently on each rank (initial seed 42 on rank 0" in f["cause"], f
        assert learnt not in "\n".join(r["notes"]), r["notes"]
    for rank, r in two.ok("ddp_noise_over_each_ranks_own_shapes_strict").items():
        assert len(r["findings"]) == 1, (rank, r["findings"], r["notes"])
        f = r["findings"][0]
        assert f["op"] == "aten.randn_like.default" and "with different arguments" in f["message"]
        assert learnt not in "\n".join(r["notes"]), r["notes"]


def test_a_generator_moved_apart_by_the_data_parallel_forward_is_said_and_not_compared(
    two: Any,
) -> None:
    """Dynamic padding under dropout: the ranks draw different amounts in DDP's forward, so the
    default generator differs across ranks from there, harmlessly for the DataLoader's base
    seed; the report says so, and the generator's later ops are compared by what runs."""
    for rank, r in two.ok("ddp_dynamic_padding_under_dropout").items():
        text = "\n".join(r["notes"])
        assert (
            "not compared by state: default cpu after the ranks drew different amounts from it "
            "in the forward and backward of DistributedDataParallel over ranks 0-1"
        ) in text, (rank, text)


def test_a_generator_reseeded_after_that_is_compared_by_state_again(two: Any) -> None:
    results = two.ok("ddp_dynamic_padding_then_reseeded_and_one_rank_samples")
    line = results[0]["line"]
    for rank, r in results.items():
        assert len(r["findings"]) == 1, (rank, r["findings"])
        f = r["findings"][0]
        assert f["kind"] == "rank_divergence" and f["op"] == "aten.randperm.default", f
        assert f["site"] == f"test_data_parallel.py:{line}", f
        assert "under expect('ignore')" in f["cause"], f["cause"]


def test_one_rank_reseeding_in_a_data_parallel_program_is_found_with_its_call(two: Any) -> None:
    results = two.ok("ddp_one_rank_reseeds_mid_training")
    seed_line = results[1]["seed_line"]
    for rank, r in results.items():
        assert len(r["findings"]) == 1, (rank, r["findings"], r["notes"])
        f = r["findings"][0]
        assert f["kind"] == "rank_divergence" and f["op"] == "aten.randperm.default", f
        assert f["site"] == f"test_data_parallel.py:{r['line']}", f
        assert "rank 1 changed default cpu outside a random op" in f["cause"], f["cause"]
        assert f"torch.manual_seed(99) at test_data_parallel.py:{seed_line}" in f["cause"]


def _partition(shares: Any, size: int) -> bool:
    """Whether the ranks' shares of an epoch (lists of sample indices) partition the dataset."""
    return sorted(i for share in shares for i in share) == list(range(size))


def _partitions(results: dict[int, dict[str, Any]], epoch: int) -> bool:
    """Whether the scenario's ranks' shares of ``epoch`` partition its 8 samples."""
    return _partition((r["seen"][epoch] for r in results.values()), 8)


def _order_found(results: dict[int, dict[str, Any]], cause: str, advice: str) -> None:
    """Each rank reports one finding at the scenario's shuffle (its ``line``), whose cause
    starts with ``cause`` and gives ``advice``, after the second epoch's first step; the first
    epoch's shares partition the data."""
    for rank, r in results.items():
        assert len(r["findings"]) == 1, (rank, r["findings"], r["notes"])
        f = r["findings"][0]
        assert f["kind"] == "rank_divergence" and f["op"] == "aten.randperm.generator", f
        assert f["site"] == f"test_data_parallel.py:{r['line']}", f
        assert f["cause"].startswith(cause), f["cause"]
        assert (
            "Why default cpu differs: the ranks drew different amounts from it in the forward "
            "and backward of DistributedDataParallel over ranks 0-1"
        ) in f["cause"], f["cause"]
        assert advice in f["cause"], f["cause"]
        assert len(r["seen"]) == 2 and len(r["seen"][1]) == 2, r["seen"]  # its first batch
    assert _partitions(results, 0)


def test_an_order_split_among_the_ranks_drawn_from_a_moved_apart_generator_is_found(
    two: Any,
) -> None:
    """Rule 5: the order accelerate's BatchSamplerShard splits is compared by state even after
    the data-parallel forward moved its generator apart (Rule 2's wake): the first epoch is
    quiet (and its shares partition the data), the second stops at its first step."""
    _order_found(
        two.ok("ddp_sharded_order_from_a_generator_moved_apart"),
        "accelerate's BatchSamplerShard splits one order of the dataset among the ranks",
        "use_seedable_sampler",
    )


def test_an_order_split_among_the_ranks_from_a_shared_generator_is_quiet_and_partitions(
    two: Any,
) -> None:
    results = two.ok("ddp_sharded_order_from_a_generator_of_its_own")
    assert _partitions(results, 0) and _partitions(results, 1)
    notes = "\n".join(results[0]["notes"])
    assert "not compared by state: default cpu after the ranks drew different amounts" in notes


def test_an_order_drawn_apart_between_samples_is_found_at_the_step_level(two: Any) -> None:
    """level="step" runs no dispatch mode between samples, and its step digests leave out the
    default generator the ranks' dropout moves apart; a DataLoader iterator asking its sampler
    for a pass's first indices is still checked op by op there (a sampler that draws when first
    asked, a sampler that draws as it is iterated), so the order is found at the pass it was
    drawn apart in, with the sampler's line, and a generator seeded by rank is said."""
    moved = two.ok("ddp_sharded_order_from_a_generator_moved_apart_at_the_step_level")
    worker = two.ok(
        "ddp_sharded_order_from_a_generator_moved_apart_read_by_a_worker_at_the_step_level"
    )
    seeded = two.ok("ddp_distributed_sampler_seeded_per_rank_from_the_second_epoch")
    sharded = (
        "accelerate's BatchSamplerShard splits one order of the dataset among the ranks",
        "Why default cpu differs: it differs across the ranks as the pass begins",
        3,
    )
    for results, cause, why, step in [
        (moved, *sharded),
        (worker, *sharded),
        (
            seeded,
            "torch's DistributedSampler splits one order of the dataset among the ranks",
            "is seeded differently on each rank (initial seeds from 1 to 2)",  # seed + epoch
            5,
        ),
    ]:
        for rank, r in results.items():
            assert r["findings"], (rank, r["notes"])
            f = r["findings"][0]
            assert f["kind"] == "rank_divergence" and f["op"] == "aten.randperm.generator", f
            assert f["cause"].startswith(cause) and why in f["cause"], f["cause"]
            assert f"the first batch of a pass begun by step {step}" in f["message"], f
            assert r["level"]["op_level"] == ["1-2"], r["level"]
    for r in [*moved.values(), *worker.values()]:
        assert len(r["findings"]) == 1 and r["level"]["data_passes_compared"] == 1, r
        assert r["findings"][0]["site"] == f"test_data_parallel.py:{r['line']}"
        assert "use_seedable_sampler" in r["findings"][0]["cause"]
    for r in seeded.values():  # the second and third epochs, one finding seen twice
        assert len(r["findings"]) == 1 and r["level"]["data_passes_compared"] == 2, r
        # The generator the sampler makes each pass is not kept (not read at every step).
        assert r["tracked"][0] == r["tracked"][-1], r["tracked"]
    # what the finding claims: the shares of the pass overlap
    assert _partitions(moved, 0) and not _partitions(moved, 1)
    assert _partitions(worker, 0) and not _partitions(worker, 1)
    assert _partitions(seeded, 0) and not _partitions(seeded, 1)
    own = two.ok("ddp_sharded_order_from_a_generator_of_its_own_at_the_step_level")
    for rank, r in own.items():
        assert not r["findings"] and r["level"]["data_passes_compared"] == 1, (rank, r)
        # The first pass's DataLoader seed and order, drawn at a sampled step (the second
        # pass's are in the step digests); the dropout of the two sampled steps is its own.
        assert_compared(r["compared"], rank, by_state=2, not_compared={"own_batch": 2})
    assert _partitions(own, 0) and _partitions(own, 1)


def test_ranks_that_began_different_numbers_of_passes_count_again_and_still_find(
    two: Any,
) -> None:
    results = two.ok("ddp_one_rank_reads_an_extra_pass_then_seeds_per_rank")
    for rank, r in results.items():
        assert len(r["findings"]) == 1, (rank, r["findings"], r["notes"])
        f = r["findings"][0]
        assert "the first batch of a pass begun by step 37" in f["message"], f["message"]
        assert "initial seeds from 9 to 10" in f["cause"], f["cause"]
        (note,) = [n for n in r["notes"] if "different numbers of passes" in n]
        assert note.startswith("not compared: 1 round(s) of 32 steps"), note
    assert _partition((r["seen"][10] for r in results.values()), 8) is False


def test_a_stream_every_rank_iterates_drawn_from_a_moved_apart_generator_is_found(
    two: Any,
) -> None:
    """Rule 5 with accelerate's IterableDatasetShard: every rank iterates the whole stream, so
    its shuffle is compared by state even after the forward moved the default generator apart;
    the first pass is quiet (its shares partition the data), the second stops at its shuffle."""
    _order_found(
        two.ok("ddp_streamed_order_from_a_generator_moved_apart"),
        "accelerate's IterableDatasetShard has every rank iterate the whole stream",
        "a torch.Generator kept as its generator attribute",
    )


def test_a_stream_drawing_from_the_datasets_own_generator_is_quiet_and_partitions(
    two: Any,
) -> None:
    results = two.ok("ddp_streamed_order_from_the_datasets_generator")
    assert _partitions(results, 0) and _partitions(results, 1)


def test_a_distributed_sampler_seeded_per_rank_is_found_not_taken_for_a_per_rank_stream(
    two: Any,
) -> None:
    results = two.ok("ddp_distributed_sampler_seeded_per_rank")
    for rank, r in results.items():
        assert len(r["findings"]) == 1, (rank, r["findings"], r["notes"])
        f = r["findings"][0]
        assert f["kind"] == "rank_divergence" and f["op"] == "aten.randperm.generator", f
        assert f["cause"].startswith("torch's DistributedSampler splits one order"), f["cause"]
        assert (
            "is seeded differently on each rank (initial seed 0 on rank 0, 1 on rank 1)"
            in (f["cause"])
        ), f["cause"]
        assert "use_seedable_sampler" not in f["cause"]
    # what the finding claims: without it, the ranks' shares of the epoch would overlap
    import torch.utils.data.distributed as tud

    shares = [list(tud.DistributedSampler(list(range(8)), 2, r, seed=r)) for r in (0, 1)]
    assert sorted(shares[0] + shares[1]) != list(range(8))


@pytest.mark.parametrize(
    "name",
    [
        "ddp_data_split_on_a_seed_plus_rank_generator",
        "ddp_data_split_on_a_seed_plus_rank_generator_at_the_step_level",
    ],
)
def test_a_data_split_drawn_from_a_per_rank_stream_is_found_at_the_split(
    two: Any, name: str
) -> None:
    """random_split's permutation is every rank's to draw alike, even from a generator seeded
    per rank (before any wrapper is built): found at the split, not left to Rule 3."""
    results = two.ok(name)
    for rank, r in results.items():
        assert len(r["findings"]) == 1, (rank, r["findings"], r["notes"])
        f = r["findings"][0]
        assert f["kind"] == "rank_divergence" and f["op"] == "aten.randperm.generator", f
        assert "random_split(" in f["lines"][-1], f
        assert f["cause"].startswith("torch's random_split divides a dataset into parts"), f
        assert (
            "it is seeded differently on each rank (initial seed 1234 on rank 0, 1235 on"
            in (f["cause"])
        )
        assert "Give random_split a generator seeded alike on every rank" in f["cause"]
        assert not r["seen"]  # (stopped at the split, before training)
    # what the finding claims: without it, one rank's held-out samples are another's to train on
    splits = [
        torch.utils.data.random_split(
            list(range(10)), [0.8, 0.2], generator=torch.Generator().manual_seed(1234 + r)
        )
        for r in (0, 1)
    ]
    assert set(splits[0][1]) & set(splits[1][0]) and set(splits[1][1]) & set(splits[0][0])


def test_a_data_split_on_one_rank_from_a_generator_seeded_alike_is_named(two: Any) -> None:
    for rank, r in two.ok("ddp_rank0_splits_alone_from_a_generator_seeded_alike").items():
        assert len(r["findings"]) == 1, (rank, r["findings"], r["notes"])
        f = r["findings"][0]
        assert f["op"] == "aten.randperm.generator" and f["differs"] == "op", f
        assert (
            "rank 0 ran an extra random op, aten.randperm.generator on default cpu" in (f["cause"])
        ), f["cause"]
        assert (
            "It was torch's random_split, drawn from default cpu on some ranks only" in (f["cause"])
        ), f["cause"]


def test_a_data_split_after_dropout_moved_its_generator_apart_says_so(two: Any) -> None:
    for rank, r in two.ok("ddp_data_split_after_dropout_moved_the_generator_apart").items():
        assert len(r["findings"]) == 1, (rank, r["findings"], r["notes"])
        cause = r["findings"][0]["cause"]
        assert cause.startswith("torch's random_split divides a dataset into parts"), cause
        assert (
            "Why default cpu differs: the ranks drew different amounts from it in the forward "
            "and backward of DistributedDataParallel over ranks 0-1"
        ) in cause, cause


def test_a_data_split_drawn_alike_keeps_every_ranks_held_out_samples_apart(two: Any) -> None:
    for name in (
        "ddp_data_split_with_a_generator_of_its_own",
        "ddp_data_split_on_a_default_generator_seeded_alike",
    ):
        results = two.ok(name)
        assert results[0]["val"] == results[1]["val"], name
        seen = results[0]["seen"] + results[1]["seen"]
        assert not set(seen) & set(results[0]["val"]) and len(set(seen)) == 8, name


def test_batches_one_rank_reads_for_every_rank_are_its_own_and_said(two: Any) -> None:
    """Rule 6: under accelerate's DataLoaderDispatcher rank 0 alone draws the shuffle and the
    jitter (it reads every rank's batches), so those ops are not compared, and the default
    generator they moved apart is compared by what runs from there; the report says both, and
    every epoch's shares still partition the data."""
    results = two.ok("ddp_dispatched_batches_read_on_one_rank")
    assert _partitions(results, 0) and _partitions(results, 1)
    notes = {rank: "\n".join(r["notes"]) for rank, r in results.items()}
    assert (
        "random op(s) rank 0 drew alone, reading every rank's batches for accelerate's "
        "DataLoaderDispatcher (the other ranks receive the batches by broadcast)"
    ) in notes[0], notes[0]
    assert "drew alone" not in notes[1], notes[1]
    # Rank 0 drew the jitter of every rank's 8 samples each epoch, and the shuffles, alone.
    assert results[0]["compared"]["not_compared"]["read_alone"] >= 16, results[0]["compared"]
    assert "read_alone" not in results[1]["compared"]["not_compared"], results[1]["compared"]
    for text in notes.values():
        assert (
            "not compared by state: default cpu after the ranks drew different amounts from it "
            "while rank 0 alone read every rank's batches for accelerate's DataLoaderDispatcher"
        ) in text, text


def test_a_collators_draws_over_each_ranks_own_batch_are_its_own_and_said(two: Any) -> None:
    """Rule 7: what a collator draws for the batch of a rank's own share (torch's
    DistributedSampler) is not compared, and the default generator its per-rank shapes moved
    apart is compared by what runs from there (the next epoch's DataLoader seed); the report says
    both, and every epoch's shares partition the data."""
    results = two.ok("ddp_collator_masks_each_ranks_own_batch")
    assert _partitions(results, 0) and _partitions(results, 1)
    for rank, r in results.items():
        notes = "\n".join(r["notes"])
        assert (
            f"random op(s) drawn while loading rank {rank}'s own share of the data, split among "
            "the ranks by torch's DistributedSampler"
        ) in notes, notes
        assert (
            "not compared by state: default cpu after the ranks drew different amounts from it "
            "while each loaded its own share of the data, split by torch's DistributedSampler"
        ) in notes, notes


def test_a_random_op_of_the_reading_rank_outside_the_reading_is_still_found(two: Any) -> None:
    """Only the reading is the dispatching rank's own: a value rank 0 alone draws in the
    training loop, from the generator the reading moved apart, is an extra random op there."""
    for rank, r in two.ok("ddp_dispatched_batches_then_rank0_draws_for_its_logs").items():
        assert len(r["findings"]) == 1, (rank, r["findings"], r["notes"])
        f = r["findings"][0]
        assert f["kind"] == "rank_divergence" and f["op"] == "aten.rand.default", f
        assert "rank 0 ran an extra random op" in f["cause"], f["cause"]
        assert [len(epoch) for epoch in r["seen"]] == [4, 2], r["seen"]  # its first step


def test_noise_drawn_for_each_ranks_own_batch_shape_is_the_ranks_own(two: Any) -> None:
    """Rule 9: a diffusion model's noise over each rank's own bucket shape, drawn in the loop
    from the default generator seeded alike, stopped correct training ("the ranks ran
    aten.randn_like.default ... with different arguments"); it is each rank's own, the note
    says so and what that leaves compared, and the training is bitwise the same as without
    rngcheck. At the step level too."""
    for name in (
        "ddp_noise_over_each_ranks_own_shapes",
        "ddp_noise_over_each_ranks_own_shapes_at_the_step_level",
    ):
        for rank, r in two.ok(name).items():
            assert r["findings"] == [], (name, rank, r["findings"])
            text = "\n".join(r["notes"])
            assert "drawn at test_data_parallel.py:" in text, (name, text)
            assert "from a default generator with arguments of each rank's own" in text, text
            assert (
                "not compared by state: default cpu after the ranks drew different amounts from "
                "it at test_data_parallel.py:"
            ) in text, text
            assert "aten.randn_like.default with arguments of each rank's own" in text, text
            # The noise of the 4 steps is the ranks' own; the timesteps after the first, from
            # the generator it moved apart, are compared by what runs.
            assert_compared(
                r["compared"],
                rank,
                by_what_runs=3,
                not_compared={"own_batch": 4, "own_arguments": 4},
            )
    for rank, r in two.ok("ddp_noise_over_each_ranks_own_shapes").items():
        assert r["digest"] == r["plain"], rank
        assert "float32[2, 2, 4, 4] on rank 0; float32[2, 2, 4, 6] on rank 1" in "\n".join(
            r["notes"]
        )


def test_after_rule_9_an_extra_draw_and_a_split_are_still_found(two: Any) -> None:
    """What Rule 9 leaves compared: the ops the ranks run (one rank drawing once more) and, by
    state, a split of the data from the generator the noise moved apart (its cause says so)."""
    for rank, r in two.ok("ddp_noise_over_own_shapes_then_one_rank_draws_extra").items():
        assert len(r["findings"]) == 1, (rank, r["findings"])
        f = r["findings"][0]
        assert f["cause"].startswith("rank 1 ran an extra random op, aten.rand.default"), f
    for rank, r in two.ok("ddp_noise_over_own_shapes_then_a_data_split").items():
        assert len(r["findings"]) == 1, (rank, r["findings"])
        f = r["findings"][0]
        assert f["op"] == "aten.randperm.generator", f
        assert (
            "Why default cpu differs: the ranks drew different amounts from it at " in (f["cause"])
        ), f["cause"]
        assert "aten.randn_like.default with arguments of each rank's own" in f["cause"]


def test_after_rule_9_a_helpers_other_caller_and_a_reseed_alone_are_found(two: Any) -> None:
    """Rule 9 knows a line by its caller's frames too: rank 0 drawing through the noise helper
    from another line, for its logs, is an extra op. A rank that reseeds alone is found at its
    next draw, on the rule's own line, with the seeding call in the cause."""
    name = "ddp_noise_over_own_shapes_then_rank0_draws_for_its_logs"
    for rank, r in two.ok(name).items():
        assert len(r["findings"]) == 1, (rank, r["findings"])
        cause = r["findings"][0]["cause"]
        assert cause.startswith("rank 0 ran an extra random op, aten.randn_like.default"), cause
    for rank, r in two.ok("ddp_noise_over_own_shapes_then_one_rank_reseeds").items():
        assert len(r["findings"]) == 1, (rank, r["findings"])
        cause = r["findings"][0]["cause"]
        assert cause.startswith("rank 1 ran an extra random op, aten.randn_like.default"), cause
        assert "On rank 1 it comes right after torch.manual_seed(99) at test_data_parallel" in (
            cause
        ), cause


def test_a_loop_over_each_ranks_own_data_is_the_ranks_own(two: Any) -> None:
    """Rule 9, counts: the loop jitters each of a rank's own boxes, so the ranks draw there as
    many times as their images hold boxes (a crop drawn until it fits each rank's own image is
    the same shape). That stopped correct training ("rank 1 ran no random op here; reached
    collective ... but rank 0 ran aten.uniform_.default"); the line's draws are each rank's own,
    the notes say so, and the training is bitwise the same as without rngcheck. At the step level
    too."""
    _, jitter = marked_line("a draw per own box")
    for name in (
        "ddp_jitter_for_each_of_its_own_boxes",
        "ddp_jitter_for_each_of_its_own_boxes_at_the_step_level",
    ):
        for rank, r in two.ok(name).items():
            assert r["findings"] == [], (name, rank, r["findings"])
            text = "\n".join(r["notes"])
            assert (
                "from a default generator a number of times of each rank's own (the ranks "
                "looped there over their own data"
            ) in text, (name, text)
            assert (
                "not compared by state: default cpu after the ranks drew different amounts from "
                "it at test_data_parallel.py:"
            ) in text, text
            assert "which rank 1 had run there more times than rank 0 when they parted" in text
            # The loop's line, not the draw after it that rank 0 ran as rank 1 looped once more.
            counted = [n for n in r["notes"] if "a number of times of each rank's own" in n]
            assert (
                len(counted) == 1 and f"drawn at test_data_parallel.py:{jitter} " in (counted[0])
            ), counted
            assert f"at test_data_parallel.py:{jitter}, aten.randn.default, which rank 1" in text
            # The jitter of every box (2 to 4 a step) at the 4 steps, at least, followed op by
            # op is the ranks' own; the scale drawn after the loop is compared by what runs.
            assert_compared(
                r["compared"],
                rank,
                by_what_runs=3,
                not_compared={"own_batch": 4, "own_count": 8},
            )
    for rank, r in two.ok("ddp_jitter_for_each_of_its_own_boxes").items():
        assert r["digest"] == r["plain"], rank


def test_after_a_counts_line_an_extra_draw_a_reseed_and_no_wrapper_are_found(two: Any) -> None:
    """What the counts clause leaves compared: a rank drawing once more at another line, a rank
    that reseeds alone (found at its next draw, on the clause's own line), two draws in another
    order on one rank, and, with gradients averaged by hand, the different counts themselves."""
    for rank, r in two.ok("ddp_jitter_own_boxes_then_one_rank_draws_extra").items():
        assert len(r["findings"]) == 1, (rank, r["findings"])
        cause = r["findings"][0]["cause"]
        assert cause.startswith("rank 1 ran an extra random op, aten.randn.default"), cause
    for rank, r in two.ok("ddp_jitter_own_boxes_then_one_rank_reseeds").items():
        assert len(r["findings"]) == 1, (rank, r["findings"])
        cause = r["findings"][0]["cause"]
        assert "torch.manual_seed(99)" in cause, cause
    for rank, r in two.ok("ddp_jitter_own_boxes_then_two_draws_in_another_order").items():
        assert len(r["findings"]) == 1, (rank, r["findings"])
        f = r["findings"][0]
        assert f["message"].startswith("the ranks ran different random ops"), f
        assert f["op"] in ("aten.randn.default", "aten.rand.default"), f
    for rank, r in two.ok("hand_written_allreduce_jitter_own_boxes").items():
        assert len(r["findings"]) == 1, (rank, r["findings"])
        f = r["findings"][0]
        assert f["kind"] == "rank_divergence" and f["op"] == "aten.randn.default", f
        assert "ran an extra random op" in f["cause"] or "ran no random op here" in f["message"], f


def test_noise_over_own_shapes_without_a_known_wrapper_is_found(two: Any) -> None:
    """Rule 9 needs a data-parallel wrapper: with gradients averaged by hand nothing says the
    ranks train on their own batches, and the different arguments stay a finding."""
    for rank, r in two.ok("hand_written_allreduce_noise_over_own_shapes").items():
        assert len(r["findings"]) == 1, (rank, r["findings"])
        f = r["findings"][0]
        assert f["message"].startswith("the ranks ran aten.randn_like.default at "), f
        assert "with different arguments" in f["message"], f


def test_a_replicated_generator_drawing_per_rank_shapes_is_found(two: Any) -> None:
    for rank, r in two.ok("ddp_replicated_generator_used_with_per_rank_lengths").items():
        assert len(r["findings"]) == 1, (rank, r["findings"])
        f = r["findings"][0]
        assert f["kind"] == "rank_divergence" and f["op"] == "aten.randint.low_generator"
        assert "# a crop of it" in " ".join(f["lines"]), f["lines"]
        site = f["site"]
        assert f["message"].startswith(
            f"the ranks ran aten.randint.low_generator at {site} with different arguments"
        ), f["message"]
        # Step 1: rank 0 crops 4 of 16 (high=13), rank 1 crops 5 (high=12).
        assert "(low=0, high=13, size=[1], device=cpu on rank 0; low=0, high=12" in f["cause"]
        assert (
            "drawn from Generator #1 (cpu" in f["cause"]
            and "seeded alike on every rank" in (f["cause"])
        ), f["cause"]


def test_what_is_not_compared_is_said_in_the_report(two: Any) -> None:
    notes = two.ok("hf_ddp_seed_plus_rank")[0]["notes"]
    text = "\n".join(notes)
    # Rule 2: the wrapped model's forward and backward (HF's checkpointed dropout included).
    assert "in the forward and backward of DistributedDataParallel over ranks 0-1" in text
    # Rule 4: the per-rank initialisation, overwritten by DDP's broadcast.
    assert "parameter initialisation(s); DistributedDataParallel over ranks 0-1 broadcast" in text
    # Rule 3: seed + rank, a per-rank stream of a data-parallel program.
    assert "default cpu is seeded differently on each rank" in text
    assert "a per-rank stream" in text
    # ...and the replicas did end up equal: DDP's broadcast made them so.
    digests = {r["digest"] for r in two.ok("hf_ddp_seed_plus_rank").values()}
    assert len(digests) == 1


def test_a_model_moved_before_wrapping_is_still_known_as_broadcast(two: Any) -> None:
    results = two.ok("ddp_seed_plus_rank_model_moved_before_wrapping")
    for rank, r in results.items():
        # Nothing is compared across the ranks here, by design: the initialisations are DDP's
        # to broadcast and the dropout is each rank's own; nothing else is drawn.
        compared = r["compared"]
        assert compared["initialisations_broadcast"] == 2, (rank, compared)
        assert compared["by_state"] == compared["by_what_runs"] == 0, (rank, compared)
        text = "\n".join(r["notes"])
        # Both of nn.Linear's initialisations (weight and bias), though moved to new storage.
        assert "not compared: 2 parameter initialisation(s); DistributedDataParallel" in text, (
            rank,
            r["notes"],
        )
    assert len({r["digest"] for r in results.values()}) == 1


@pytest.mark.parametrize(
    ("name", "wrapper"),
    [
        ("hand_written_allreduce_seed_plus_rank", ""),
        ("ddp_without_init_sync_seed_plus_rank", "DistributedDataParallel over ranks 0-1"),
        ("fsdp_seed_plus_rank", "FullyShardedDataParallel over ranks 0-1"),
        ("fully_shard_seed_plus_rank", "fully_shard over ranks 0-1"),
    ],
)
def test_parameters_initialised_per_rank_and_never_broadcast_are_found(
    two: Any, name: str, wrapper: str
) -> None:
    for rank, r in two.ok(name).items():
        assert len(r["findings"]) == 1, (rank, r["findings"])
        f = r["findings"][0]
        assert f["kind"] == "rank_divergence" and f["ranks"] == [0, 1]
        assert f["op"] == "aten.uniform_.default"  # nn.Linear's weight initialisation
        assert f["message"].startswith("parameters initialised differently across ranks")
        assert "nothing broadcast these replicated parameters" in f["cause"]
        assert "torch.manual_seed(7) at" in f["cause"] and "torch.manual_seed(8) at" in f["cause"]
        if wrapper:
            assert f"{wrapper} does not broadcast module states" in f["cause"]
        assert "torch.nn.Sequential(torch.nn.Linear(8, 8)" in " ".join(f["lines"])


@pytest.mark.parametrize(
    ("name", "broadcast_by"),
    [
        ("deepspeed_seed_plus_rank", "DeepSpeedEngine over ranks 0-1"),
        ("deepspeed_zero3_init_seed_plus_rank", "deepspeed.zero.Init over ranks 0-1"),
    ],
)
def test_deepspeed_is_data_parallel_and_broadcasts_the_model(
    two: Any, name: str, broadcast_by: str
) -> None:
    """seed + rank before the model and per-rank data: correct under DeepSpeed, whose engine
    (or zero.Init, for ZeRO-3) broadcasts the parameters from one rank."""
    results = two.ok(name)
    for rank, r in results.items():
        assert not r["findings"], (rank, r["findings"])
        text = "\n".join(r["notes"])
        assert "in the forward and backward of DeepSpeedEngine over ranks 0-1" in text
        assert f"4 parameter initialisation(s); {broadcast_by} broadcast" in text, r["notes"]
        assert "Generator #1 (cpu) is seeded differently on each rank" in text
        # (nothing replicated is drawn: the data and the shuffles of the 3 steps come from
        # per-rank streams; below ZeRO-3 the engine holds the 4 parameters whole on every rank,
        # compared by digest, and ZeRO-3 shards them)
        whole = {"replicated_parameters": 4} if name == "deepspeed_seed_plus_rank" else {}
        assert_compared(
            r["compared"],
            rank,
            initialisations_broadcast=4,
            **whole,
            not_compared={"own_batch": 3, "per_rank_seed": 6},
        )
    assert len({r["digest"] for r in results.values()}) == 1


def test_deepspeed_training_still_has_its_replicated_draws_compared(two: Any) -> None:
    results = two.ok("deepspeed_rank0_draws_before_a_replicated_shuffle")
    line = results[0]["line"]
    for rank, r in results.items():
        assert len(r["findings"]) == 1, (rank, r["findings"])
        f = r["findings"][0]
        assert f["kind"] == "rank_divergence" and f["ranks"] == [0, 1]
        assert "rank 0 ran an extra random op, aten.rand" in f["cause"], f["cause"]
        assert f["site"] == f"test_data_parallel.py:{line}", f


def test_zero3_parameters_one_rank_initialises_for_a_broadcast_are_its_own(two: Any) -> None:
    """ZeRO-3's GatheredParameters(modifier_rank=0) broadcasts rank 0's modifications as it
    exits, so what rank 0 alone draws inside it (Hugging Face's initialisation of a model made
    from a config) is not compared, and the default generator it moved apart is compared by
    what runs from there; the report says both. Without a modifier rank nothing is broadcast,
    and rank 0's draws are found at their line."""
    results = two.ok("deepspeed_zero3_initialised_on_rank0_and_broadcast")
    broadcast = {r["digest"] for r in results.values()}
    assert len(broadcast) == 1  # the broadcast made them rank 0's
    for rank, r in results.items():
        assert not r["findings"], (rank, r["findings"])
        notes = "\n".join(r["notes"])
        inside = (
            "4 random op(s) drawn inside a deepspeed GatheredParameters region broadcast by "
            "rank 0: the parameters it gathered are rank 0's as it exits"
        )
        assert (inside in notes) == (rank == 0), notes  # (rank 1 drew nothing there)
        assert (
            "not compared by state: default cpu after the ranks drew different amounts from it "
            "while rank 0 drew inside a deepspeed GatheredParameters region broadcast by it"
        ) in notes, notes
        # Rank 0's 4 initialisations in the region are its own; the shuffles of the 3 steps
        # are compared by what runs (the first in the round that found the generator apart);
        # zero.Init broadcast the model's 4; the data comes from a per-rank stream.
        inside = {"broadcast": 4} if rank == 0 else {}
        assert_compared(
            r["compared"],
            rank,
            by_what_runs=3,
            initialisations_broadcast=4,
            not_compared={**inside, "own_batch": 3, "per_rank_seed": 3},
        )
    results = two.ok("deepspeed_zero3_initialised_on_rank0_not_broadcast")
    # What the finding is about: rank 0's initialisation was dropped (the weights are those
    # zero.Init made, the same everywhere), and rank 0 drew from the default generator alone.
    assert len({r["digest"] for r in results.values()} | broadcast) == 2
    line = results[0]["line"]
    for rank, r in results.items():
        assert r["findings"], (rank, r["notes"])
        f = r["findings"][0]
        assert f["kind"] == "rank_divergence" and f["ranks"] == [0, 1], f
        assert "rank 0 ran 4 extra random ops, the first, aten.normal_" in f["cause"], f["cause"]
        assert f["site"] == f"test_data_parallel.py:{line}", f


def test_sampling_with_generate_on_the_wrapped_module_is_each_ranks_own(two: Any) -> None:
    """Rule 2 covers generate() on the module a wrapper wraps: each rank samples for its own
    inputs (RL rollouts on every rank; rank 0 alone sampling for its logs), not compared, and
    the default generator it moved apart is compared by what runs from there (the shuffle after
    it, which differs across the ranks now); the report says both."""
    for name in ("hf_ddp_rollouts_on_every_rank", "hf_ddp_generate_on_rank0"):
        for rank, r in two.ok(name).items():
            assert not r["findings"], (name, rank, r["findings"])
            notes = "\n".join(r["notes"])
            generated = (
                "random op(s) in generate() of the module DistributedDataParallel over ranks 0-1 "
                "wraps (data-parallel: each rank samples for its own inputs)"
            )
            assert (generated in notes) == (rank == 0 or name.endswith("every_rank")), notes
            sampled = rank == 0 or name.endswith("every_rank")
            exempted = {"own_batch": 1, **({"own_samples": 1} if sampled else {})}
            if name.endswith("every_rank"):  # (the prompts of the 2 steps: a per-rank stream)
                exempted["per_rank_seed"] = 2
            assert_compared(r["compared"], rank, not_compared=exempted)
    for rank, r in two.ok("hf_ddp_generate_on_rank0").items():
        assert (
            "not compared by state: default cpu after the ranks drew different amounts from it "
            "in generate() of the module DistributedDataParallel over ranks 0-1 wraps"
        ) in "\n".join(r["notes"]), r["notes"]
        # The two steps' batches from a generator _hf.batch seeds alike, by state; the shuffle
        # after rank 0 sampled, by what runs.
        assert_compared(r["compared"], rank, by_state=2, by_what_runs=1)


def test_one_rank_sampling_with_a_model_no_wrapper_wraps_is_found_at_that_call(
    two: Any,
) -> None:
    """A model outside data parallelism (a frozen reference model on every rank): every rank
    must call its generate() (Rule 8), so rank 0 alone sampling from it is found at that call.
    Done as the finding advises (the generator put back with fork_rng, under expect("ignore")),
    it is quiet."""
    results = two.ok("hf_ddp_reference_model_generates_on_rank0")
    line = results[0]["line"]
    for rank, r in results.items():
        assert len(r["findings"]) == 1, (rank, r["findings"])
        f = r["findings"][0]
        assert f["kind"] == "rank_divergence" and f["differs"] == "op"
        assert (
            "rank 0 called generate() of GPT2LMHeadModel, sampling (its first random op "
            "aten.multinomial.default at utils.py:"
        ) in f["cause"], f["cause"]
        assert "where rank 1 did not sample" in f["cause"], f["cause"]
        # The finding's stack goes through the user's generate() call.
        assert f"test_data_parallel.py:{line}" in f["frames"], f["frames"]
    for rank, r in two.ok("hf_ddp_reference_model_generates_on_rank0_forked").items():
        assert r["findings"] == [], (rank, r["findings"])
        # The reference model's initialisations (no wrapper broadcasts them) are compared at
        # the first step, and so are the shuffle and the two batches after rank 0 sampled in a
        # fork of the generator; what it sampled there (3 tokens) is under expect("ignore").
        ignored = {"ignored": 3} if rank == 0 else {}
        assert_compared(
            r["compared"],
            rank,
            by_state=3,
            initialisations=1,
            initialisations_broadcast=1,
            replicated_parameters=28,
            not_compared={"own_batch": 1, **ignored},
        )


# ---------------------------------------------------------------------------------------------
# An unmodified Hugging Face script under RNGCHECK=1: one process, and two ranks under torchrun


def _script_env() -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("RNGCHECK", "_RNGCHECK"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(RNGCHECK="1", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    return env


@pytest.mark.parametrize("ranks", [1, 2], ids=["python", "torchrun"])
def test_an_unmodified_hugging_face_script_is_quiet_under_rngcheck(
    ranks: int, tmp_path: Any
) -> None:
    import os
    import subprocess
    from pathlib import Path

    script = str(Path(_HERE).parent / "scripts" / "train_hf.py")
    if ranks == 1:
        args = [sys.executable, script]
    else:
        torchrun = str(Path(sys.executable).parent / "torchrun")
        args = [torchrun, "--standalone", f"--nproc-per-node={ranks}", script]
    env = {**_script_env(), "RNGCHECK_REPORT": str(tmp_path)}
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=240, cwd=os.getcwd())
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.count("training finished") == ranks
    where = f" on rank 0 of {ranks}" if ranks > 1 else ""
    assert f"random op(s) checked{where}, no findings" in r.stderr, r.stderr[-2000:]
    if ranks == 1:  # Nothing is compared across ranks, by design: one process, no rank checker.
        report = json.loads((tmp_path / "rank0.json").read_text())
        assert "rank_compared" not in report["meta"], report["meta"]
        return
    # Nothing replicated is drawn (seed + rank, per-rank data: the 3 batches): DDP broadcasts
    # GPT-2's initialisations and holds its parameters whole, and its dropout is each rank's own.
    for rank, found in _saved_compared(tmp_path).items():
        exempted = {"own_batch": 1, "per_rank_seed": 3}
        assert_compared(found, rank, **_GPT2, not_compared=exempted)


def _torchrun_script(name: str, out: Any, **env: str) -> dict[str, Any]:
    """``tests/scripts/<name>`` on 2 ranks under torchrun, writing into ``out``: its stderr and
    each rank's ``result<RANK>.json``."""
    import os
    import subprocess
    from pathlib import Path

    script = str(Path(_HERE).parent / "scripts" / name)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    out.mkdir()
    # A rank of the Trainer's script aborts now and then as the interpreter exits, after
    # training and writing its results (_dist.EXIT_ABORT), also without rngcheck.
    r = launch_past_exit_aborts(
        lambda: subprocess.run(
            [torchrun, "--standalone", "--nproc-per-node=2", script, str(out)],
            env={**_script_env(), **env},
            capture_output=True,
            text=True,
            timeout=240,
            cwd=os.getcwd(),
        ),
        2,
        f"{name} {env}",
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.count("training finished") == 2
    results = {rank: (out / f"result{rank}.json").read_text() for rank in (0, 1)}
    return {"stderr": r.stderr, "results": results}


def _trainer_run(out: Any, **env: str) -> dict[str, Any]:
    return _torchrun_script("train_hf_trainer.py", out, **env)


def _shares_partition(run: dict[str, Any], epoch: int) -> bool:
    """Whether the two ranks' samples of ``epoch`` (two steps of 4 each) partition the 16."""
    seen = (json.loads(run["results"][r])["seen"][epoch * 8 : epoch * 8 + 8] for r in (0, 1))
    return _partition(seen, 16)


def test_hugging_face_trainers_group_by_length_order_is_found_and_its_workaround_quiet(
    tmp_path: Any,
) -> None:
    """Rule 5 on Hugging Face's Trainer with group_by_length: its LengthGroupedSampler shuffles
    from the default generator, which the ranks' dropout moved apart (dynamic padding), and
    accelerate's BatchSamplerShard splits that order; the second epoch's shares overlap without
    rngcheck, the checked run names the shuffle (and trains bitwise the same, recording), and
    with the workaround the cause gives the shares partition the data and the run is quiet."""
    env = {"GROUP_BY_LENGTH": "1"}
    plain = _trainer_run(tmp_path / "plain", RNGCHECK="0", **env)
    assert _shares_partition(plain, 0) and not _shares_partition(plain, 1)
    reports = tmp_path / "reports"
    checked = _trainer_run(
        tmp_path / "checked", RNGCHECK_ON_FINDING="record", RNGCHECK_REPORT=str(reports), **env
    )
    assert checked["results"] == plain["results"]
    findings = json.loads((reports / "rank0.json").read_text())["findings"]
    assert [f["kind"] for f in findings] == ["rank_divergence"], findings
    f = findings[0]
    assert f["op"] == "aten.randperm.generator", f
    shuffle = [fr for fr in f["stack"] if fr["name"] == "get_length_grouped_indices"]
    assert shuffle and shuffle[-1]["filename"].endswith("trainer_pt_utils.py"), f["stack"]
    assert f["cause"].startswith("accelerate's BatchSamplerShard splits one order"), f["cause"]
    assert "use_seedable_sampler" in f["cause"]
    reports = tmp_path / "fixed-reports"
    fixed = _trainer_run(
        tmp_path / "fixed", SEEDABLE_SAMPLER="0", RNGCHECK_REPORT=str(reports), **env
    )
    assert "random op(s) checked on rank 0 of 2, no findings" in fixed["stderr"], fixed["stderr"][
        -3000:
    ]
    for rank, found in _saved_compared(reports).items():  # (the order among them, by state)
        exempted = {"own_batch": 1}
        assert_compared(found, rank, by_state=1, initialisations_broadcast=1, not_compared=exempted)
    assert _shares_partition(fixed, 0) and _shares_partition(fixed, 1)
    # At the step level the second epoch's shuffle is drawn at step 3, between samples (no
    # dispatch mode, and a default generator the step digests leave out): the first batch of a
    # pass is checked op by op, and the same shuffle is found; the workaround stays quiet.
    for name, extra in [("step", {}), ("step-fixed", {"SEEDABLE_SAMPLER": "0"})]:
        reports = tmp_path / f"{name}-reports"
        run = _trainer_run(
            tmp_path / name,
            RNGCHECK_LEVEL="step",
            RNGCHECK_ON_FINDING="record",
            RNGCHECK_REPORT=str(reports),
            **env,
            **extra,
        )
        assert run["results"] == (plain if not extra else fixed)["results"]
        report = json.loads((reports / "rank0.json").read_text())
        assert report["meta"]["level"]["data_passes_compared"] == 1, report["meta"]["level"]
        if extra:
            assert report["findings"] == [], report["findings"]
            continue
        (f,) = report["findings"]
        assert f["op"] == "aten.randperm.generator" and f["first_step"] == 3, f
        assert any(fr["name"] == "get_length_grouped_indices" for fr in f["stack"]), f["stack"]
        assert f["cause"].startswith("accelerate's BatchSamplerShard splits one order"), f["cause"]


def _trainer_quiet_and_unchanged(tmp_path: Any, **env: str) -> tuple[dict[str, Any], str]:
    return _quiet_and_unchanged(tmp_path, "train_hf_trainer.py", **env)


def _quiet_and_unchanged(tmp_path: Any, script: str, **env: str) -> tuple[dict[str, Any], str]:
    """A script run without rngcheck and with it (recording reports into ``tmp_path/reports``):
    the checked run is quiet and its results are bitwise the plain one's. Returns the plain run
    and rank 0's notes."""
    plain = _torchrun_script(script, tmp_path / "plain", RNGCHECK="0", **env)
    reports = tmp_path / "reports"
    checked = _torchrun_script(script, tmp_path / "checked", RNGCHECK_REPORT=str(reports), **env)
    assert "random op(s) checked on rank 0 of 2, no findings" in checked["stderr"], checked[
        "stderr"
    ][-3000:]
    assert checked["results"] == plain["results"]
    report = json.loads((reports / "rank0.json").read_text())
    return plain, "\n".join(n["message"] for n in report["notes"])


def _saved_compared(reports: Any) -> dict[int, Any]:
    """What each rank of a checked run compared across the ranks: its report's meta
    rank_compared, saved in ``reports`` (``tmp_path/"reports"`` for _quiet_and_unchanged)."""
    saved = {r: json.loads((reports / f"rank{r}.json").read_text()) for r in (0, 1)}
    return {r: report["meta"].get("rank_compared") for r, report in saved.items()}


def test_hugging_face_trainer_dispatching_an_iterable_dataset_is_quiet_and_unchanged(
    tmp_path: Any,
) -> None:
    """Rule 6 on Hugging Face's Trainer with an IterableDataset that shuffles from the default
    generator: accelerate dispatches its batches, rank 0 alone iterating the dataset (so alone
    drawing its shuffle) and broadcasting every rank's batch. Correct, so quiet (it was "rank 0
    ran an extra random op"), and it trains bitwise as it does without rngcheck."""
    plain, notes = _trainer_quiet_and_unchanged(tmp_path, ITERABLE="1")
    for rank, found in _saved_compared(tmp_path / "reports").items():  # rank 0 read alone
        exempted = {"own_batch": 1, **({"read_alone": 1} if rank == 0 else {})}
        assert_compared(found, rank, by_state=1, initialisations_broadcast=1, not_compared=exempted)
    seen = [json.loads(plain["results"][r])["seen"] for r in (0, 1)]
    assert sorted(seen[0][:16]) == list(range(16)) and seen[1] == [], seen  # rank 0 reads all
    assert (
        "rank 0 drew alone, reading every rank's batches for accelerate's DataLoaderDispatcher"
        in notes
    ), notes
    # The shuffle moved rank 0's default generator: the next pass's DataLoader seed shows it.
    assert (
        "not compared by state: default cpu after the ranks drew different amounts from it "
        "while rank 0 alone read every rank's batches"
    ) in notes, notes


def test_hugging_face_trainer_resumed_from_a_checkpoint_is_quiet_and_unchanged(
    tmp_path: Any,
) -> None:
    """A resume: the Trainer restores each rank's own saved RNG state, which dynamic padding under
    dropout had moved apart before the save, so the ranks' default generators differ from the
    first step of the resumed run. Correct (the resumed run is the original's), so quiet (it was
    "rank 1 changed default cpu outside a random op"), and bitwise as without rngcheck."""
    original = tmp_path / "original"
    _trainer_run(original, RNGCHECK="0", TRAIN_STEPS="6", SAVE_STEPS="2")
    _, notes = _trainer_quiet_and_unchanged(
        tmp_path, TRAIN_STEPS="6", RESUME=str(original / "checkpoint-4")
    )
    for rank, found in _saved_compared(tmp_path / "reports").items():
        exempted = {"own_batch": 1}
        assert_compared(found, rank, by_state=1, initialisations_broadcast=1, not_compared=exempted)
    assert (
        "not compared by state: default cpu after each rank restored a state of its own into it "
        "(torch.random.set_rng_state(<state>) at trainer.py:"
    ) in notes, notes


def test_hugging_face_trainer_masked_language_modelling_is_quiet_and_unchanged(
    tmp_path: Any,
) -> None:
    """Rule 7 on Hugging Face's Trainer training BERT with DataCollatorForLanguageModeling: the
    collator masks each rank's own batch, padded to its own longest sequence, from the default
    generator. Correct, so quiet (it was "the ranks ran aten.bernoulli.default at
    data_collator.py with different arguments"), and bitwise as without rngcheck."""
    plain, notes = _trainer_quiet_and_unchanged(tmp_path, MLM="1")
    assert _shares_partition(plain, 0) and _shares_partition(plain, 1)
    for rank, found in _saved_compared(tmp_path / "reports").items():  # the masks: own share
        exempted = {"own_share": 1, "own_batch": 1}
        assert_compared(found, rank, by_state=1, initialisations_broadcast=1, not_compared=exempted)
    assert (
        "random op(s) drawn while loading rank 0's own share of the data, split among the ranks "
        "by accelerate's BatchSamplerShard"
    ) in notes, notes


def test_hugging_face_trainer_under_deepspeed_zero3_is_quiet_and_unchanged(tmp_path: Any) -> None:
    """Hugging Face's Trainer under DeepSpeed ZeRO-3: transformers initialises the model made
    from its config on rank 0 alone, inside GatheredParameters(modifier_rank=0), which
    broadcasts it. Correct, so quiet (it was "rank 0 ran an extra random op" at the first
    initialisation), and bitwise as without rngcheck."""
    _, notes = _trainer_quiet_and_unchanged(tmp_path, ZERO="3")
    for rank, found in _saved_compared(tmp_path / "reports").items():  # rank 0's init: broadcast
        exempted = {"own_batch": 1, **({"broadcast": 1} if rank == 0 else {})}
        assert_compared(found, rank, by_state=1, not_compared=exempted)
    assert (
        "random op(s) drawn inside a deepspeed GatheredParameters region broadcast by rank 0: "
        "the parameters it gathered are rank 0's as it exits"
    ) in notes, notes


def test_ranks_that_reach_a_generate_call_in_different_states_are_found(two: Any) -> None:
    """Rule 8 compares the state a generate() call starts from: rank 1 drew aside just before
    (under expect("ignore")), which is found there, once; what the calls sample is not."""
    for rank, r in two.ok("hf_ranks_reach_a_generate_call_apart").items():
        assert len(r["findings"]) == 1, (rank, r["findings"])
        f = r["findings"][0]
        assert f["kind"] == "rank_divergence" and f["differs"] == "state", f
        assert "rank 1 drew 1 random op(s) under expect('ignore')" in f["cause"], f["cause"]


def test_tensor_parallel_peers_sampling_apart_are_found(two: Any) -> None:
    """generate() on a model with DTensor parameters is compared op by op (Rule 1, not 8): its
    tensor-parallel peers must sample alike, and rank 1's second token, sampled from another
    state, is found."""
    for rank, r in two.ok("hf_tensor_parallel_peers_sample_apart").items():
        assert len(r["findings"]) == 1, (rank, r["findings"])
        f = r["findings"][0]
        assert f["kind"] == "rank_divergence" and f["differs"] == "state", f
        assert f["op"] == "aten.multinomial.default", f
        assert "rank 1 drew 1 random op(s) under expect('ignore')" in f["cause"], f["cause"]


def test_hugging_face_tensor_parallel_training_is_quiet_and_unchanged(two: Any) -> None:
    """Hugging Face's own tensor parallelism (tp_plan="auto"), the same seed everywhere:
    quiet, and the losses and the parameters are those of the run without the mode, bitwise."""
    results = two.ok("hf_tensor_parallel_training_same_seed")
    for rank, r in results.items():
        checked = r["checked"]
        assert not checked["findings"], (rank, checked["findings"])
        assert checked["random_ops"] > 0
        # Every random op is compared by state: the peers hold the activations whole, and no
        # data-parallel wrapper makes any draw a rank's own.
        compared = checked["compared"]
        assert compared["by_state"] == checked["random_ops"], (rank, compared)
        assert compared["not_compared"] == {}, (rank, compared)
        assert checked["losses"] == r["plain"]["losses"], rank
        assert checked["parameters"] == r["plain"]["parameters"], rank
    assert results[0]["plain"]["parameters"] == results[1]["plain"]["parameters"]


def test_hugging_face_tensor_parallel_peers_seeded_per_rank_are_found(two: Any) -> None:
    """seed + rank under tensor parallelism: the peers' first dropout (GPT-NeoX's, over the
    embeddings every rank holds whole) is found, with each rank's seeding call."""
    results = two.ok("hf_tensor_parallel_training_seed_plus_rank")
    line = results[0]["seed_line"]
    for rank, r in results.items():
        assert len(r["findings"]) == 1, (rank, r["findings"])
        f = r["findings"][0]
        assert f["kind"] == "rank_divergence" and f["differs"] == "state", f
        assert f["site"].startswith("modeling_gpt_neox.py:"), f
        assert f"rank 0 torch.manual_seed(1) at test_data_parallel.py:{line}" in f["cause"], f
        assert f"rank 1 torch.manual_seed(2) at test_data_parallel.py:{line}" in f["cause"], f


def test_hugging_face_predict_sampling_on_every_rank_is_quiet_and_unchanged(
    tmp_path: Any,
) -> None:
    """Rule 8 on Hugging Face's Seq2SeqTrainer.predict() with predict_with_generate and a
    sampling generation config, before any training (no data-parallel wrapper exists): each
    rank samples for its own share of the test set until its sequences end, its own number of
    draws. Correct, so quiet (it was "rank 1 ran an extra random op, aten.multinomial"), and
    bitwise as without rngcheck."""
    _quiet_and_unchanged(tmp_path, "predict_hf_seq2seq.py")
    reports = tmp_path / "reports"
    for rank, found in _saved_compared(reports).items():  # generate() as calls; what it samples
        assert_compared(found, rank, as_calls=1, not_compared={"sampling": 1})
    counts = []
    for rank in (0, 1):
        notes = [
            n["message"] for n in json.loads((reports / f"rank{rank}.json").read_text())["notes"]
        ]
        sampled = [n for n in notes if "in generate() of T5ForConditionalGeneration, which no" in n]
        assert len(sampled) == 1, notes
        counts.append(int(sampled[0].split("not compared: ")[1].split(" ")[0]))
    assert counts[0] != counts[1], counts  # each rank drew its own number: compared, a finding


def test_hugging_face_trainer_left_unwrapped_after_predict_is_found(tmp_path: Any) -> None:
    """Seq2SeqTrainer.predict() before train(): with accelerate 1.16 the evaluation's prepare
    marks the model prepared, so train() never wraps it in DDP and each rank trains a model of
    its own on its own batches (the plain run's ranks end with different parameters). The
    checked run finds it at the first dropout whose shapes differ across the ranks, says that no
    rank knows a data-parallel wrapper, and trains bitwise as the plain run. Should a later
    accelerate wrap it again, the plain run's ranks agree, the checked run must be quiet, and
    the test reports itself skipped (the finding is not exercised)."""
    plain = _torchrun_script("predict_hf_seq2seq.py", tmp_path / "plain", RNGCHECK="0", TRAIN="1")
    reports = tmp_path / "reports"
    checked = _torchrun_script(
        "predict_hf_seq2seq.py",
        tmp_path / "checked",
        TRAIN="1",
        RNGCHECK_ON_FINDING="record",
        RNGCHECK_REPORT=str(reports),
    )
    assert checked["results"] == plain["results"]
    ranks = [json.loads(plain["results"][r]) for r in (0, 1)]
    report = json.loads((reports / "rank0.json").read_text())
    if ranks[0]["parameters"] == ranks[1]["parameters"]:  # wrapped: DDP kept them equal
        assert report["findings"] == [], report["findings"]
        pytest.skip("this accelerate wraps the model after predict(): nothing left to find")
    assert len(report["findings"]) == 1, report["findings"]
    f = report["findings"][0]
    assert f["kind"] == "rank_divergence" and "modeling_t5.py" in f["message"], f["message"]
    assert "No rank knows a data-parallel wrapper" in f["cause"], f["cause"]


def test_a_streaming_dataset_split_by_node_is_each_ranks_own_share(tmp_path: Any) -> None:
    """Rule 7 on a custom loop over a streaming dataset of Hugging Face's ``datasets`` split with
    split_dataset_by_node, masked by DataCollatorForLanguageModeling under DDP: each rank masks
    its own batches. Correct, so quiet (it was "the ranks ran aten.bernoulli.default at
    data_collator.py with different arguments"), and bitwise as without rngcheck. ``datasets``
    is not among the suite's requirements (its releases that install beside transformers 5.24
    here fail to build a dataset on Python 3.11): where it is installed, this runs."""
    pytest.importorskip("datasets")
    _, notes = _quiet_and_unchanged(tmp_path, "train_hf_datasets_streaming.py")
    for rank, found in _saved_compared(tmp_path / "reports").items():  # the masks: own share
        assert found is not None and found["not_compared"].get("own_share", 0) > 0, (rank, found)
    assert (
        "random op(s) drawn while loading rank 0's own share of the data, split among the ranks "
        "by Hugging Face datasets' split_dataset_by_node"
    ) in notes, notes


def test_fsdp_imported_after_the_mode_started_is_known(tmp_path: Any) -> None:
    """FSDP imported inside the script, after torch.distributed is up (as accelerate's prepare()
    does), with per-rank batch lengths under dropout: patched as its import ends, so its
    forward's random ops are known as data-parallel from the first step."""
    _, notes = _quiet_and_unchanged(tmp_path, "train_fsdp_late_import.py")
    for rank, found in _saved_compared(tmp_path / "reports").items():
        # FSDP broadcasts nothing here: the model's 4 initialisations, compared at the first
        # step, and the series every rank draws alike, by state; FSDP's dropout and the crops of
        # the 3 steps (from a per-rank stream), each rank's own.
        exempted = {"own_batch": 1, "per_rank_seed": 3}
        assert_compared(found, rank, by_state=1, initialisations=4, not_compared=exempted)
    assert "in the forward and backward of FullyShardedDataParallel over ranks 0-1" in notes


@pytest.mark.parametrize("level", ["op", "step"])
def test_hugging_face_trainer_under_torchrun_is_quiet_and_unchanged(tmp_path: Any, level: str):
    """Hugging Face's Trainer, as people run it: accelerate moves the model to ``cpu:0`` (new
    storage for every parameter) before DDP, and batches are padded to their longest sequence.
    The parameters' initialisations are still known as broadcast, the default generator the
    ranks' dropout moved apart is not compared by state at the next epoch's DataLoader; the run
    trains bitwise as it does without rngcheck."""
    plain = _trainer_run(tmp_path / "plain", RNGCHECK="0")
    checked = _trainer_run(
        tmp_path / "checked", RNGCHECK_LEVEL=level, RNGCHECK_REPORT=str(tmp_path / "reports")
    )
    assert "random op(s) checked on rank 0 of 2, no findings" in checked["stderr"], checked[
        "stderr"
    ][-3000:]
    assert checked["results"] == plain["results"]
    for rank, found in _saved_compared(tmp_path / "reports").items():
        exempted = {"own_batch": 1}
        assert_compared(found, rank, by_state=1, initialisations_broadcast=1, not_compared=exempted)
    if level == "op":
        report = json.loads((tmp_path / "reports" / "rank0.json").read_text())
        notes = "\n".join(n["message"] for n in report["notes"])
        assert "parameter initialisation(s); DistributedDataParallel over ranks 0-1 broadcast" in (
            notes
        )
        # GPT-2's output layer, tied to its input embedding after it was initialised.
        assert "of parameters that no longer existed at the first step" in notes
        # Dynamic padding: the ranks' dropout drew different amounts from the default generator.
        assert "not compared by state: default cpu after the ranks drew different amounts" in (
            notes
        )


@pytest.mark.parametrize(
    "name", ["ddp_rank0_trains_a_probe_alone", "ddp_rank0_trains_a_probe_alone_at_the_step_level"]
)
def test_an_optimizer_one_rank_steps_alone_does_not_take_the_lead(two: Any, name: str) -> None:
    """Rank 0 alone trains a linear probe for 20 steps at a time, declared its own: its
    optimizer stepped 16 times without the training optimizer in between, so it took the lead
    on rank 0 alone, whose training steps then moved away from rank 1's. The op level reported a
    false rank_divergence ("rank 0 reached SGD.step() ...; rank 1 reached collective
    c10d.allreduce_"), and at the step level gloo aborted the job (rngcheck's own collectives no
    longer matched in size). An optimizer of no data-parallel wrapper's parameters does not
    take the lead from one that trains them."""
    op_level = name.endswith("alone")
    steps = 24 if op_level else 2  # (the op level's steps; the step level's sampled)
    for rank, r in two.ok(name).items():
        assert not r["findings"], (rank, r["findings"])
        assert r["random_ops"] > 0
        assert r["bitwise"], rank
        # Nothing replicated is drawn: the data comes from a per-rank stream, and rank 0's probe
        # is declared its own. So what the check stands on: DDP's dropout and the batch at
        # every step the mode followed op by op, each rank's own, and the model's 4 parameters,
        # their initialisations broadcast and their values compared. At the op level rank 0's
        # two probes drew under expect("ignore") (3 ops each: its Linear's 2 initialisations
        # and its features' input); the step level follows the first 2 steps op by op, before
        # either probe.
        ignored = {"ignored": 6} if op_level and rank == 0 else {}
        assert_compared(
            r["compared"],
            rank,
            initialisations_broadcast=4,
            replicated_parameters=4,
            not_compared={"own_batch": steps, "per_rank_seed": steps, **ignored},
        )


@pytest.mark.parametrize(
    ("name", "counts"),
    [
        ("ddp_rank1_steps_once_more_at_the_step_level", "10 to 11"),
        ("ddp_rank1_steps_once_more_to_a_full_round", "31 to 32"),
    ],
)
def test_ranks_that_end_at_different_step_counts_leave_a_note_not_an_abort(
    two: Any, name: str, counts: str
) -> None:
    """The step level's last round held each rank's steps since the round before: when a rank
    stepped once more, the rounds differed in size and gloo aborted the job ("Received data size
    doesn't match expected size"), and so did a full round that met the other rank's last one.
    Every round now has one size and carries the steps each rank exchanged in all (on a group of
    the step digests' own); the steps that cannot be paired are said in a note."""
    for rank, r in two.ok(name).items():
        assert not r["findings"], (rank, r["findings"])
        text = "\n".join(r["notes"])
        assert f"different numbers of training steps ({counts} exchanged" in text, text
        # The inputs of the 2 sampled steps, compared by state; their dropout is each rank's own.
        assert_compared(r["compared"], rank, by_state=2, not_compared={"own_batch": 2})


def test_which_optimizer_leads_does_not_depend_on_garbage_collection(two: Any) -> None:
    """The lead trained the DDP wrapper's parameters: a later optimizer takes over only if it
    trains them too, read as the lead became the lead, not from whether the lead was collected
    since: rank 0 took the head's optimizer as the lead alone, and its exchange points moved
    away from rank 1's ("rank 0 ran no random op here; reached SGD.step() ... but rank 1 ran
    aten.bernoulli_.float")."""
    for rank, r in two.ok("ddp_then_a_head_on_every_rank_collected_on_rank0").items():
        assert not r["findings"], (rank, r["findings"])
        assert r["random_ops"] > 0
        # The head's dropout at its 20 steps (2 a step), unwrapped: compared by state.
        assert_compared(
            r["compared"],
            rank,
            by_state=40,
            initialisations_broadcast=2,
            not_compared={"own_batch": 4},
        )


def test_powersgd_hook_seeded_alike_is_quiet_and_trains_unchanged(two: Any) -> None:
    """Rule 10, correct: the hook's Q is compared by state even though each rank's dropout moved
    the default generator apart; the fork it draws in leaves the generator as it was, so the
    draw after each step is still compared by what runs. Quiet at both levels, and bitwise the
    same training as without rngcheck."""
    results = two.ok("ddp_powersgd_seeded_alike")
    for rank, r in results.items():
        for summary in (r, r["step_level"], r["warm"]):
            assert summary["findings"] == [], (rank, summary["findings"])
        assert r["digest"] == r["plain"], rank
        # Q for the model's two weight matrices at each of the 4 compressed steps, by state; the
        # draws after the third and the sixth steps, by what runs (the first in the round that
        # found the generator apart); the dropout and the batch of the 6 steps are each rank's
        # own (the batches, from a per-rank stream); DDP's 4 parameters, compared as replicated.
        exempted = {"own_batch": 6, "per_rank_seed": 6}
        assert_compared(
            r["compared"],
            rank,
            by_state=8,
            by_what_runs=2,
            replicated_parameters=4,
            not_compared=exempted,
        )
        # The note on randomness in backward names the hook, not a possible redraw of dropout.
        text = "\n".join(r["notes"])
        assert "random op(s) in backward were drawn by torch's PowerSGD hook" in text, text
        assert "every replica must draw it alike" in text, text
        assert "ran during backward" not in text, text
    assert len({r["digest"] for r in results.values()}) == 1  # (DDP keeps the replicas equal)


def test_powersgd_hook_seeded_per_rank_is_found_at_the_hooks_draw(two: Any) -> None:
    """Rule 10: ranks that start PowerSGD's Q from different states are found at its randn in
    backward (Rule 2 left every draw there to the rank before), with the hook named, the seeds,
    and the fix; at the step level too, at a step checked op by op; and with PowerSGD's
    default warm_start=True, which draws Q at the first compressed step only."""
    for rank, r in two.ok("ddp_powersgd_seeded_per_rank").items():
        for summary in (r, r["step_level"], r["warm"]):
            assert len(summary["findings"]) == 1, (rank, summary["findings"])
            f = summary["findings"][0]
            assert f["kind"] == "rank_divergence" and f["op"] == "aten.randn.default", f
            assert f["differs"] == "state", f
            cause = f["cause"]
            assert cause.startswith("torch's PowerSGD hook compresses each gradient bucket"), f
            assert "it is seeded differently on each rank (initial seed " in cause, cause
            assert "Give PowerSGDState the same random_seed on every rank" in cause, cause


def test_a_comm_hooks_collectives_are_no_exchange_points(two: Any) -> None:
    """A communication hook's collectives are seen as its futures' timing allows (one rank ran
    the chained callback on its own thread, the other on gloo's), so they are no exchange
    points: quiet, and bitwise the same training as without rngcheck. (Without the fix: "rank(s)
    1 did not reach RNG exchange #5 within 30 s".)"""
    for rank, r in two.ok("ddp_comm_hook_collective_runs_inline_on_one_rank").items():
        assert r["findings"] == [], (rank, r["findings"])
        assert r["digest"] == r["plain"], rank
        # Nothing replicated is drawn (the data of the 4 steps comes from a per-rank stream): the
        # teacher's initialisations are its DDP's to broadcast, the parameters of both DDPs are
        # compared as replicated, and the dropout of the 4 steps is each rank's own.
        assert_compared(
            r["compared"],
            rank,
            initialisations_broadcast=2,
            replicated_parameters=4,
            not_compared={"own_batch": 4, "per_rank_seed": 4},
        )
