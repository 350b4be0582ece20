"""Sample tests that tests/test_plugin.py runs with pytest, with and without --rngcheck.

Not collected by the main suite (the name does not start with test_).
"""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import rngcheck


def _checkpointed_noise(generator: torch.Generator | None) -> None:
    layer = torch.nn.Linear(8, 8)

    def block(x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(x.shape, generator=generator) if generator else torch.rand(x.shape)
        return layer(x) * (noise > 0.5)

    x = torch.randn(4, 8, requires_grad=True)
    checkpoint(block, x, use_reentrant=False).sum().backward()


def test_clean() -> None:
    _checkpointed_noise(None)  # the default generator: checkpoint restores it


def test_buggy() -> None:
    _checkpointed_noise(torch.Generator().manual_seed(0))  # not restored: a recompute mismatch


@pytest.mark.rngcheck
def test_marked_buggy() -> None:
    _checkpointed_noise(torch.Generator().manual_seed(0))


@pytest.mark.rngcheck(enabled=False)
def test_opted_out() -> None:
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:  # its own mode
        _checkpointed_noise(torch.Generator().manual_seed(0))
    assert not mode.report.ok


def test_fixture_sees_findings(rngcheck_mode) -> None:
    _checkpointed_noise(torch.Generator().manual_seed(0))
    assert [f.kind.value for f in rngcheck_mode.report.findings] == ["recompute_mismatch"]


def test_fails_on_its_own() -> None:
    _checkpointed_noise(torch.Generator().manual_seed(0))
    assert 1 == 2, "the test's own failure"
