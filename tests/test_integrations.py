"""Integrations are data: every registered hook names code of a library that the installed version
has (resolved here, on each CI lane's versions), an integration registered from outside rngcheck
(this file) changes verdicts with no edit anywhere else, and a hook the installed version does
not allow is a loud coverage gap, never a silent change of verdict."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from typing import Any

import pytest
import torch
from _dist import assert_compared, run_scenarios, scenario_mode

from rngcheck.ranks import integrations
from rngcheck.ranks.hooks import Hooks, resolve
from rngcheck.ranks.integrations.records import (
    Frames,
    Integration,
    Role,
    Wrapper,
    WrapperForward,
)
from rngcheck.ranks.program import Program
from rngcheck.ranks.verdict import Reason


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module.partition(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def test_every_registered_name_resolves_on_the_installed_versions() -> None:
    """What each integration hooks exists in the installed library (the ones installed on this
    lane; the others are said). A release that renames one fails here, in CI, before a user
    meets the warning."""
    resolved: list[str] = []
    absent: set[str] = set()
    for integration in integrations.registered():
        for hook in integration.hooks:
            if not _importable(hook.module):
                absent.add(integration.library)
                continue
            try:
                importlib.import_module(hook.module)
            except ImportError as e:  # (a standalone package of a library that is not installed)
                absent.add(f"{hook.module} ({e})")
                continue
            resolve(hook)  # raises LookupError, naming what is missing
            resolved.append(hook.key)
    print(f"resolved {len(resolved)} hooks; libraries not installed here: {sorted(absent)}")
    # torch's own (DDP, FSDP, pipelining, Join, PowerSGD, samplers, random_split, fetchers).
    torch_hooks = [k for k in resolved if k.startswith("torch.")]
    assert len(torch_hooks) >= 16, torch_hooks
    assert len(resolved) == len(set(resolved))


def test_the_registry_refuses_a_name_held_twice() -> None:
    ddp = next(i for i in integrations.registered() if i.library == "torch" and i.hooks)
    twin = Integration(name="tests.twin", library="torch", hooks=(ddp.hooks[0],))
    with pytest.raises(ValueError, match="already hooked by the integration"):
        integrations.register(twin)
    with pytest.raises(ValueError, match="already registered"):
        integrations.register(Integration(name=ddp.name, library="torch"))


# -- a library of the test's own: a wrapper, and a sampler that splits one order ------------------


class TestWrapper(torch.nn.Module):
    """A data-parallel wrapper of a library rngcheck does not ship an integration for."""

    __test__ = False

    def __init__(self, module: torch.nn.Module, ranks: tuple[int, ...]) -> None:
        super().__init__()
        self.module, self.ranks = module, ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def _wrapper_integration(attribute: str = "TestWrapper.forward") -> Integration:
    def describe(wrapper: Any) -> Wrapper:
        return Wrapper(kind="TestWrapper", ranks=wrapper.ranks)

    return Integration(
        name="tests.wrapper",
        library="torch",
        hooks=(
            WrapperForward(
                module=__name__, attribute=attribute, label="TestWrapper", describe=describe
            ),
        ),
    )


def _hooks(gaps: list[str]) -> tuple[Hooks, Program, list[Wrapper]]:
    program = Program()
    seen: list[Wrapper] = []
    hooks = Hooks(
        program,
        on_wrapper=seen.append,
        on_forward=lambda: None,
        on_join=lambda what, join: None,
        on_gap=lambda integration, hook, why: gaps.append(f"{integration.name}: {why}"),
    )
    return hooks, program, seen


def test_an_integration_registered_from_outside_is_installed_and_taken_off() -> None:
    """A wrapper this file defines, registered here: its forward runs in its scope while the
    hooks are installed (the program knows it, and it carries into backward), and the class is
    as it was once they are taken off."""
    original = TestWrapper.forward
    integrations.register(_wrapper_integration())
    gaps: list[str] = []
    hooks, program, seen = _hooks(gaps)
    try:
        hooks.install()
        assert TestWrapper.forward is not original
        inside: list[Any] = []
        wrapped = TestWrapper(torch.nn.Linear(2, 2), ranks=(0, 1))
        wrapped.module.register_forward_hook(lambda *_: inside.append(program.current(False)))
        wrapped(torch.ones(1, 2))
        assert [w.kind for w in inside] == ["TestWrapper"] and seen == inside
        assert program.current(in_backward=True) == inside[0]  # its backward's scope, to the step
        assert program.current(in_backward=False) is None
    finally:
        hooks.uninstall()
        integrations.unregister("tests.wrapper")
    assert TestWrapper.forward is original and not gaps


def test_a_name_the_installed_version_lacks_is_a_gap_said_once() -> None:
    """A hook whose name is not there (a release renamed it) is reported once, naming it."""
    integrations.register(_wrapper_integration("TestWrapper.forward_renamed"))
    gaps: list[str] = []
    hooks, _, _ = _hooks(gaps)
    try:
        hooks.install()
        hooks.refresh()
    finally:
        hooks.uninstall()
        integrations.unregister("tests.wrapper")
    assert gaps == [f"tests.wrapper: {__name__}.TestWrapper.forward_renamed is not defined"], gaps


# -- the same, across ranks (run in every rank as fn(rank, world)) --------------------------------


class SplitOrder(torch.utils.data.Sampler):
    """A sampler of the test's own that makes every rank walk one shuffled order and keep its
    share, shuffling from the default generator."""

    def __init__(self, n: int, rank: int, world: int) -> None:
        self.n, self.rank, self.world = n, rank, world

    def __len__(self) -> int:
        return self.n // self.world

    def __iter__(self) -> Any:
        return iter(torch.randperm(self.n).tolist()[self.rank :: self.world])


class SameCodeUnregistered(torch.utils.data.Sampler):
    """The same sampler, code of its own, which no integration names."""

    def __init__(self, n: int, rank: int, world: int) -> None:
        self.n, self.rank, self.world = n, rank, world

    def __len__(self) -> int:
        return self.n // self.world

    def __iter__(self) -> Any:
        return iter(torch.randperm(self.n).tolist()[self.rank :: self.world])


_SAMPLER = Integration(
    name="tests.sampler",
    library="torch",
    hooks=(
        Frames(
            module=__name__,
            attribute="SplitOrder.__iter__",
            label="the test's SplitOrder",
            role=Role.ORDER,
            scope=Reason.ORDER,
            advice="Give SplitOrder a generator seeded alike on every rank",
        ),
    ),
)


def _epochs(rank: int, world: int, sampler_cls: type) -> dict[str, Any]:
    """DDP over a model with dropout, each rank's batches of its own length (its dropout draws its
    own amounts), fed by ``sampler_cls``: from the second epoch its order is drawn from a default
    generator the ranks moved apart."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    with scenario_mode() as mode:
        model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sampler = sampler_cls(8, rank, world)
        for _ in range(2):
            for i in sampler:
                model(torch.ones(1 + rank + i % 2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
    report = mode.report
    return {
        "findings": [{"message": f.message, "cause": f.cause} for f in report.findings],
        "notes": [n.message for n in report.notes],
        "compared": report.meta.get("rank_compared", {}),
    }


def registered_sampler(rank: int, world: int) -> dict[str, Any]:
    integrations.register(_SAMPLER)
    try:
        return _epochs(rank, world, SplitOrder)
    finally:
        integrations.unregister(_SAMPLER.name)


def unregistered_sampler(rank: int, world: int) -> dict[str, Any]:
    return _epochs(rank, world, SameCodeUnregistered)


def renamed_hook(rank: int, world: int) -> dict[str, Any]:
    import warnings

    import rngcheck

    renamed = Integration(
        name="tests.renamed",
        library="torch",
        hooks=(
            Frames(
                module=__name__,
                attribute="SplitOrder.iterate",
                label="the test's SplitOrder",
                role=Role.ORDER,
                scope=Reason.ORDER,
            ),
        ),
    )
    integrations.register(renamed)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with scenario_mode() as mode:
                torch.rand(1)
    finally:
        integrations.unregister(renamed.name)
    return {
        "warnings": [
            str(w.message)
            for w in caught
            if issubclass(w.category, rngcheck.RNGCheckCoverageWarning)
        ],
        "notes": [(n.kind, n.message) for n in mode.report.notes],
    }


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return run_scenarios(
        __file__,
        ["unregistered_sampler", "registered_sampler", "renamed_hook"],
        world_size=2,
        out_dir=tmp_path_factory.mktemp("integrations"),
        timeout=180,
    )


@pytest.mark.distributed
def test_an_integration_registered_from_a_test_file_decides_its_draws(two: Any) -> None:
    """Adding a library is one file: registered from this test's own module (in each rank),
    its sampler's shuffle is an order every rank must walk alike, compared by state even after
    the ranks' dropout moved the default generator apart, and found with its own advice. The
    same code unregistered is compared by what runs only (the generator is apart), and the bug
    stays silent."""
    for rank, r in two.ok("unregistered_sampler").items():
        assert r["findings"] == [], (rank, r["findings"])
        assert "not compared by state: default cpu" in "\n".join(r["notes"]), r["notes"]
        # The first epoch's shuffle, by state; DDP's dropout at the 8 steps, each rank's own.
        assert_compared(
            r["compared"],
            rank,
            by_state=1,
            initialisations_broadcast=2,
            not_compared={"own_batch": 8},
        )
    for rank, r in two.ok("registered_sampler").items():
        assert len(r["findings"]) == 1, (rank, r["findings"])
        cause = r["findings"][0]["cause"]
        assert cause.startswith("the test's SplitOrder splits one order of the dataset"), cause
        assert "Why default cpu differs: the ranks drew different amounts from it in the " in cause
        assert cause.endswith("Give SplitOrder a generator seeded alike on every rank"), cause


@pytest.mark.distributed
def test_a_hook_the_installed_version_lacks_is_loud(two: Any) -> None:
    """A registered name the installed code lacks (as a release that renames it): one
    RNGCheckCoverageWarning and a report note that name the integration, the library and its
    version, and what is no longer understood."""
    for rank, r in two.ok("renamed_hook").items():
        assert len(r["warnings"]) == 1, (rank, r)
        (note,) = [m for kind, m in r["notes"] if kind == "not_checked"]
        assert note == r["warnings"][0].removeprefix("rngcheck: ").rstrip("."), (note, r)
        assert f"rngcheck's tests.renamed integration hooks {'_rngcheck_scenarios'}" in note
        version = importlib.metadata.version("torch")  # (as pip has it: "2.9.0", no "+cu128")
        assert f"which torch {version} does not allow" in note, note
        assert "SplitOrder.iterate does not exist" in note or "is not defined" in note, note
        assert "compared as any draw, without its scope" in note, note


def test_the_registry_imports_without_torch() -> None:
    """The documentation's scope table is built from the registry without torch installed."""
    code = (
        "import sys, builtins\n"
        "real = builtins.__import__\n"
        "def guard(name, *a, **k):\n"
        "    if name == 'torch' or name.startswith('torch.'):\n"
        "        raise ImportError('torch is not allowed here')\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guard\n"
        "from rngcheck.ranks import integrations\n"
        "print(len(integrations.registered()))\n"
    )
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 10
