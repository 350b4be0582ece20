"""What rngcheck knows of other libraries' code, as data: one file per library, each a registered
:class:`Integration`, a list of hooks. A hook names what it hooks (an import path and an
attribute) and the scope that code opens, in the vocabulary of ``records.py``; the rank checker
(``ranks/hooks.py``) installs them, and each kind of hook does one thing the principle says
(``ranks/scopes.py``). Adding a library is one new file that calls :func:`register`, and nothing
else: a test registers one from its own file.

Every hooked name is resolved as its module is imported; one the installed version lacks is a
loud ``RNGCheckCoverageWarning`` and a report note (``ranks/hooks.py``), never a silent change of
verdict. ``tests/test_integrations.py`` resolves every registered name on each CI lane.

Nothing here imports torch or the libraries named: the documentation's scope table is built from
this registry (``docs/hooks.py``).
"""

from __future__ import annotations

import importlib

from .records import (
    Frames,
    Hook,
    Integration,
    SeedHint,
    ShareSplit,
)

__all__ = [
    "Frames",
    "Hook",
    "Integration",
    "REGISTRY",
    "changes",
    "SeedHint",
    "ShareSplit",
    "hook_of",
    "register",
    "registered",
    "unregister",
]

REGISTRY: dict[str, Integration] = {}
_changes = 0  # registrations and removals so far (what a cache of the registry keys on)

# The integrations rngcheck ships, one module each (imported by registered()).
_BUILT_IN = (
    "torch_ddp",
    "torch_fsdp",
    "torch_pipelining",
    "torch_join",
    "torch_powersgd",
    "torch_data",
    "accelerate",
    "lightning",
    "deepspeed",
    "transformers",
    "datasets",
    "megatron",
)
_loaded = False


def register(integration: Integration) -> Integration:
    """Add ``integration`` to the registry (a module's one call, at its import); a second one
    with the same name is refused, as is a hook whose name another integration already holds."""
    if integration.name in REGISTRY and REGISTRY[integration.name] is not integration:
        raise ValueError(
            f"an integration named {integration.name!r} is already registered; give yours "
            "another name, or unregister the first"
        )
    held = {h.key: i.name for i in REGISTRY.values() if i is not integration for h in i.hooks}
    for hook in integration.hooks:
        if hook.key and hook.key in held:
            raise ValueError(
                f"{hook.key} is already hooked by the integration {held[hook.key]!r}; one name "
                "has one hook"
            )
    global _changes
    REGISTRY[integration.name] = integration
    _changes += 1
    return integration


def unregister(name: str) -> None:
    """Remove an integration (a test's own, once it is done)."""
    global _changes
    if REGISTRY.pop(name, None) is not None:
        _changes += 1


def changes() -> int:
    """How many times the registry changed: a cache built from it is stale when this moved."""
    return _changes


def hook_of(key: str) -> Hook | None:
    """The registered hook whose ``key`` is ``key`` (the ``source`` of a verdict), or None."""
    for integration in registered():
        for hook in integration.hooks:
            if hook.key == key:
                return hook
    return None


def registered() -> tuple[Integration, ...]:
    """Every integration: rngcheck's own, then any registered since."""
    global _loaded
    if not _loaded:
        for name in _BUILT_IN:
            importlib.import_module(f"{__name__}.{name}")
        _loaded = True
    return tuple(REGISTRY.values())
