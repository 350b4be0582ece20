"""Shared test set-up. Tests run real torch (CPU) and real process groups; nothing is mocked."""

import pytest
import torch

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same global RNG state and leaves no mode behind."""
    torch.manual_seed(0)
    yield
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    assert not _get_current_dispatch_mode_stack(), "a test left a dispatch mode on the stack"
    key = torch._C.DispatchKey.PreDispatch  # the selective route's (core/selective.py)
    assert not torch._C._dispatch_tls_is_dispatch_key_included(key), "a test left the key on"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that start process groups are slow too: `-m "not slow"` is the quick local run."""
    for item in items:
        if item.get_closest_marker("distributed") is not None:
            item.add_marker(pytest.mark.slow)
