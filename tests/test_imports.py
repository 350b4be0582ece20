"""The post-import hook that patches wrapper classes imported after the mode started: real
imports of real modules (written to a temporary directory), through Python's import system."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rngcheck.core.imports import watch_imports


@pytest.fixture
def package(tmp_path: Path) -> Iterator[str]:
    """A package ``pkg_<id>`` with two submodules, importable for the test only."""
    name = f"pkg_{tmp_path.name.replace('-', '_')}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "engine.py").write_text("class Engine:\n    built = True\n")
    (root / "other.py").write_text("VALUE = 3\n")
    sys.path.insert(0, str(tmp_path))
    try:
        yield name
    finally:
        sys.path.remove(str(tmp_path))
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


def test_the_callback_runs_as_the_module_finishes_importing(package: str) -> None:
    seen = []

    def patch(name: str) -> None:  # what the tracker does: patch the class it defines
        cls = sys.modules[name].Engine
        seen.append((name, cls.built))
        cls.patched = True

    stop = watch_imports([f"{package}.engine"], patch)
    try:
        other = importlib.import_module(f"{package}.other")
        from_import = importlib.import_module(f"{package}.engine")
    finally:
        stop()
    assert seen == [(f"{package}.engine", True)]  # once, for the watched module only
    assert from_import.Engine.patched  # before the importing code got the module
    assert other.VALUE == 3
    # The module keeps its own loader.
    assert type(from_import.__loader__) is importlib.machinery.SourceFileLoader
    assert type(from_import.__spec__.loader) is importlib.machinery.SourceFileLoader


def test_stopping_removes_the_finder_and_nothing_is_called_after(package: str) -> None:
    seen = []
    before = list(sys.meta_path)
    stop = watch_imports([f"{package}.engine"], seen.append)
    assert len(sys.meta_path) == len(before) + 1
    stop()
    assert sys.meta_path == before
    importlib.import_module(f"{package}.engine")
    assert seen == []


def test_two_watches_of_one_module_both_run(package: str) -> None:
    seen: list[str] = []
    stops = [watch_imports([f"{package}.engine"], lambda n, k=k: seen.append(k)) for k in "ab"]
    try:
        importlib.import_module(f"{package}.engine")
    finally:
        for stop in stops:
            stop()
    assert sorted(seen) == ["a", "b"]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_failing_callback_never_fails_the_users_import(package: str) -> None:
    def broken(name: str) -> None:
        raise RuntimeError("a bug in the patch")

    records = _Records()
    logger = logging.getLogger("rngcheck.core.imports")
    logger.addHandler(records)
    stop = watch_imports([f"{package}.engine"], broken)
    try:
        module = importlib.import_module(f"{package}.engine")
    finally:
        stop()
        logger.removeHandler(records)
    assert module.Engine.built
    assert records.messages == [f"rngcheck: the post-import hook for {package}.engine failed"]


def test_a_missing_module_is_still_a_plain_import_error(package: str) -> None:
    stop = watch_imports([f"{package}.absent"], lambda name: None)
    try:
        with pytest.raises(ModuleNotFoundError, match="absent"):
            importlib.import_module(f"{package}.absent")
    finally:
        stop()


def test_the_specs_loader_answers_as_the_modules_own_before_the_import(package: str) -> None:
    """runpy, pkgutil and importlib.resources ask a spec's loader before importing."""
    stop = watch_imports([f"{package}.engine"], lambda name: None)
    try:
        spec = importlib.util.find_spec(f"{package}.engine")
        assert spec is not None
        assert spec.loader.get_filename(spec.name).endswith("engine.py")
        assert spec.loader.is_package(spec.name) is False
        assert "class Engine" in spec.loader.get_source(spec.name)
    finally:
        stop()


class _AskingAgain(importlib.abc.MetaPathFinder):
    """Another post-import hook, of the kind that asks the import system again from its own
    find_spec (wrapt's does)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        try:
            return importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)


def test_a_finder_that_asks_again_does_not_run_the_callback_twice(package: str) -> None:
    seen: list[str] = []
    stop = watch_imports([f"{package}.engine"], seen.append)
    other = _AskingAgain(f"{package}.engine")
    sys.meta_path.insert(1, other)  # behind ours: ours asks it, it asks everyone again
    try:
        importlib.import_module(f"{package}.engine")
    finally:
        sys.meta_path.remove(other)
        stop()
    assert seen == [f"{package}.engine"]
