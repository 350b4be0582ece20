"""The checker changes nothing and never takes training down by itself: zero perturbation over
randomly composed programs, clean exits on faults, and composition with torch's other modes."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.utils.checkpoint as tuc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.flop_counter import FlopCounterMode

import rngcheck
from rngcheck.recompute import torch_hooks

# -- zero perturbation over random programs --------------------------------------------------------

_STEPS = (
    "rand",
    "randn_gen",
    "dropout",
    "bernoulli_",
    "matmul",
    "add",
    "randperm",
    "normal_gen",
    "checkpoint_dropout",
    "checkpoint_reentrant",
    "reseed",
    "multinomial",
)


def _run_program(
    steps: list[str], seed: int
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    w = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(6, 6)
    outs: list[torch.Tensor] = []
    for i, step in enumerate(steps):
        if step == "rand":
            x = x + torch.rand(6, 6)
        elif step == "randn_gen":
            x = x + torch.randn(6, 6, generator=gen)
        elif step == "dropout":
            x = torch.nn.functional.dropout(x, 0.3)
        elif step == "bernoulli_":
            x = x * torch.empty(6, 6).bernoulli_(0.5)
        elif step == "matmul":
            x = x @ w
        elif step == "add":
            x = x + 1
        elif step == "randperm":
            x = x[torch.randperm(6)]
        elif step == "normal_gen":
            x = x + torch.empty(6, 6).normal_(generator=gen)
        elif step == "checkpoint_dropout":
            x = tuc.checkpoint(
                lambda t: torch.nn.functional.dropout(t @ w, 0.2), x, use_reentrant=False
            )
        elif step == "checkpoint_reentrant":
            x = tuc.checkpoint(
                lambda t: torch.nn.functional.dropout(t @ w, 0.2), x, use_reentrant=True
            )
        elif step == "reseed":
            torch.manual_seed(seed + i)
        elif step == "multinomial":
            x = x + torch.multinomial(torch.ones(6), 6, replacement=True).float()
        outs.append(x.detach().clone())
    if x.requires_grad:
        x.sum().backward()
    grad = w.grad.clone() if w.grad is not None else torch.zeros(0)
    outs.append(grad)
    return outs, torch.get_rng_state(), gen.get_state()


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(steps=st.lists(st.sampled_from(_STEPS), min_size=1, max_size=12), seed=st.integers(0, 2**16))
def test_random_programs_are_bitwise_identical_with_and_without_the_mode(steps, seed):
    plain = _run_program(steps, seed)
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        checked = _run_program(steps, seed)
    assert mode.report.ok, [f.message for f in mode.report.findings]
    assert len(plain[0]) == len(checked[0])
    for a, b in zip(plain[0], checked[0], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(plain[1], checked[1])  # default generator's final state
    assert torch.equal(plain[2], checked[2])  # user generator's final state


# -- faults ----------------------------------------------------------------------------------------


def _patched_names() -> tuple:
    return (
        getattr(tuc, torch_hooks.HOOKS.nonreentrant),
        tuc.CheckpointFunction,
        torch.manual_seed,
        torch.random.manual_seed,
        torch.set_rng_state,
        torch.random.set_rng_state,
        torch.seed,
    )


@pytest.mark.parametrize("exc", [KeyboardInterrupt, ValueError, SystemExit])
def test_the_mode_leaves_nothing_behind_when_an_exception_leaves_it(exc):
    before = _patched_names()
    with pytest.raises(exc), rngcheck.RNGConsistencyMode():
        torch.rand(2)
        tuc.checkpoint(lambda t: t * 2, torch.ones(2, requires_grad=True), use_reentrant=False)
        raise exc()
    assert _patched_names() == before
    assert not _get_current_dispatch_mode_stack()
    assert rngcheck.active_mode() is None


def test_an_exception_inside_a_checkpointed_forward_propagates_and_cleans_up():
    before = _patched_names()

    def broken(t):
        torch.nn.functional.dropout(t, 0.5)
        raise IndexError("inside the region")

    with pytest.raises(IndexError, match="inside the region"), rngcheck.RNGConsistencyMode():
        tuc.checkpoint(broken, torch.ones(3, requires_grad=True), use_reentrant=False)
    assert _patched_names() == before
    assert not _get_current_dispatch_mode_stack()


# -- composition -------------------------------------------------------------------------------


@pytest.mark.parametrize("ours_outside", [True, False])
def test_composes_with_flop_counter_mode(ours_outside):
    def work():
        torch.nn.functional.dropout(torch.ones(4, 4) @ torch.ones(4, 4), 0.5)

    if ours_outside:
        with rngcheck.RNGConsistencyMode() as mode, FlopCounterMode(display=False) as flops:
            work()
    else:
        with FlopCounterMode(display=False) as flops, rngcheck.RNGConsistencyMode() as mode:
            work()
    assert mode.report.random_ops == 1
    assert flops.get_total_flops() == 128  # our digests did not add counted ops


@pytest.mark.parametrize("ours_outside", [True, False])
def test_composes_with_debug_mode(ours_outside):
    DebugMode = pytest.importorskip("torch.utils._debug_mode").DebugMode  # torch >= 2.10

    if ours_outside:
        with rngcheck.RNGConsistencyMode() as mode, DebugMode() as dm:
            torch.nn.functional.dropout(torch.ones(4), 0.5)
    else:
        with DebugMode() as dm, rngcheck.RNGConsistencyMode() as mode:
            torch.nn.functional.dropout(torch.ones(4), 0.5)
    assert mode.report.random_ops == 1
    assert "bernoulli" in dm.debug_string()


def test_fake_and_meta_tensors_run_and_draw_nothing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    state = torch.get_rng_state()
    with rngcheck.RNGConsistencyMode() as mode:
        with FakeTensorMode():
            x = torch.rand(4, 4)
            torch.nn.functional.dropout(x, 0.5)
        torch.empty(4, device="meta").uniform_()
    assert torch.equal(state, torch.get_rng_state())
    assert mode.report.ok
    assert all(e.before == e.after for e in mode.events)


def test_grad_modes_and_autocast():
    with rngcheck.RNGConsistencyMode() as mode:
        with torch.no_grad():
            torch.rand(2)
        with torch.inference_mode():
            torch.nn.functional.dropout(torch.ones(3), 0.5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.functional.dropout(torch.ones(3, 3) @ torch.ones(3, 3), 0.5)
    assert mode.report.random_ops == 3
    assert mode.report.ok


def test_random_ops_on_another_thread_show_as_out_of_band_changes_not_crashes():
    with rngcheck.RNGConsistencyMode() as mode:
        torch.rand(3)
        worker = threading.Thread(target=lambda: [torch.rand(3) for _ in range(5)])
        worker.start()
        worker.join(timeout=30)
        torch.rand(3)
    assert not worker.is_alive()
    # The other thread did not enter the mode: its draws are invisible as ops, but the main
    # thread's next op sees its generator moved and says so.
    assert mode.report.random_ops == 2
    oob = mode.events[1].out_of_band
    assert oob is not None and not oob.calls
    assert "outside the checker's view" in oob.describe()


def test_torch_compile_does_not_crash_and_its_random_ops_are_checked():
    fn = torch.compile(lambda x: torch.nn.functional.dropout(x, 0.5) * 2, backend="eager")
    fn(torch.ones(8))  # compiled before the mode: a cached graph
    with rngcheck.RNGConsistencyMode() as mode:
        fn(torch.ones(8))
    assert mode.report.ok
    assert mode.report.ops_by_name.get("aten.bernoulli_.float") == 1


def test_group_without_torch_distributed_is_single_process():
    # Documented behaviour: group/expect/sync only matter once torch.distributed is initialised.
    with rngcheck.RNGConsistencyMode(group=[0, 1], expect="differ", sync="op") as mode:
        torch.rand(2)
    assert mode.report.ok and mode.report.world_size == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture_reads_no_generator_state():
    x = torch.ones(16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with rngcheck.RNGConsistencyMode() as mode:
        torch.nn.functional.dropout(x, 0.5)  # warm-up outside capture
        with torch.cuda.graph(graph):
            y = torch.nn.functional.dropout(x, 0.5)
        graph.replay()
    assert y.shape == x.shape
    captured = [e for e in mode.events if e.before is None]
    assert captured, "the op inside capture must be recorded without a state read"


class _CountingDataset(torch.utils.data.Dataset):
    """Each item draws a random number and says how many random ops the inherited mode saw."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        mode = rngcheck.active_mode()
        seen = mode.report.random_ops if mode is not None else -1
        torch.rand(2)
        after = mode.report.random_ops if mode is not None else -1
        return torch.tensor([seen, after])


@pytest.mark.skipif(
    "fork" not in torch.multiprocessing.get_all_start_methods(), reason="needs fork"
)
def test_forked_dataloader_workers_pass_ops_through():
    # A worker forked while the mode is active inherits the pushed dispatch mode; checking there
    # would exchange with the rank group from the wrong process. The copy must stay inert.
    loader = torch.utils.data.DataLoader(
        _CountingDataset(),
        batch_size=None,
        num_workers=1,
        multiprocessing_context="fork",
        timeout=60,
    )
    with rngcheck.RNGConsistencyMode() as mode:
        items = [item.tolist() for item in loader]
    assert len(items) == 4
    assert all(seen == after for seen, after in items), items
    assert mode.report.ok
