"""MkDocs hook (``hooks:`` in mkdocs.yml): the tables the documentation holds that the code already
states are generated from the code, and a stale one fails the build.

Each generated table lies between a ``BEGIN GENERATED: <name>`` and an ``END GENERATED: <name>``
line of its page (:data:`BLOCKS`):

- the environment variables of docs/environment.md, from ``rngcheck.env.variables.VARIABLES``
  (name, values, default, help: the same text the start-up error messages use);
- the scopes the integrations open, in docs/data-parallel.md, from
  ``rngcheck.ranks.integrations.registered()`` (one row per hook: its library, the
  ``module.attribute`` it hooks, its ``doc`` and the reason it gives), and, in one line, the
  names by which a sampler or dataset says it splits the data among the ranks (``shares``).

If a block differs from what the code renders, the build stops and says to run
``bash scripts/docs.sh --fix``, which rewrites every block (``python docs/hooks.py --fix``).
``python docs/hooks.py`` on its own checks, exit code 1 when one is stale.

Neither source needs torch (``import rngcheck`` is lazy, the variable table imports none, and
nothing under ``rngcheck/ranks/integrations/`` imports torch at import time), so the docs build
in a small venv without it. The checkout's own package is imported (its root goes first on
``sys.path``), never another installed rngcheck.

Cell text is the code's, unchanged, except what Markdown would otherwise eat outside code spans:
``|`` is escaped as ``\\|`` and ``<`` as ``&lt;`` (``DIR/rank<N>.json`` would be an HTML tag).
"""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
FIX = "bash scripts/docs.sh --fix"


def _checkout() -> None:
    """Put this checkout's root first on ``sys.path``, so that its own rngcheck is read."""
    if str(ROOT) not in sys.path[:1]:
        sys.path.insert(0, str(ROOT))


def variables() -> dict[str, Any]:
    """``VARIABLES`` of this checkout's ``rngcheck.env.variables``."""
    _checkout()
    from rngcheck.env.variables import VARIABLES

    return VARIABLES


def integrations() -> tuple[Any, ...]:
    """This checkout's registered integrations (rngcheck's own, imported without torch)."""
    _checkout()
    from rngcheck.ranks import integrations as registry

    return registry.registered()


def _cell(text: str) -> str:
    """The code's text as one table cell: only ``|`` and ``<`` outside code spans escaped."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(
        p if p.startswith("`") else p.replace("|", "\\|").replace("<", "&lt;") for p in parts
    ).replace("\n", " ")


def render_table(table: dict[str, Any] | None = None) -> str:
    """The markdown table of ``VARIABLES``: variable | values | default | what it does."""
    table = variables() if table is None else table
    lines = ["| variable | values | default | what it does |", "| --- | --- | --- | --- |"]
    for v in table.values():
        lines.append(f"| `{v.name}` | {_cell(v.values)} | {_cell(v.default)} | {_cell(v.help)} |")
    return "\n".join(lines)


# What a function known by its frames does besides its role's scope, from its record's fields:
# (field, the value that says something, the words).
_FRAME_FLAGS = (
    ("anywhere", True, "also before any data-parallel wrapper is known"),
    ("on_per_rank", False, "not on a generator known to be a per-rank stream"),
    ("forks", True, "drawn in a fork of the generator, which it restores"),
)


def _scope_text(hook: Any) -> str:
    """A hook's scope in words: its ``doc``, and for a function known by its frames what its
    fields add (see ``_FRAME_FLAGS``)."""
    extra = [words for field, value, words in _FRAME_FLAGS if getattr(hook, field, None) is value]
    return "; ".join([hook.doc, *extra])


def _reason(hook: Any) -> str:
    """The reason a hook's scope gives (a ``Frames`` hook's own ``scope``, else its record's)."""
    reason = getattr(hook, "scope", None) or hook.opens
    return f"`{reason.value}`" if reason is not None else ""


def render_scopes(registered: tuple[Any, ...] | None = None) -> str:
    """The markdown table of the integrations' hooks: library | hooks | scope | reason."""
    registered = integrations() if registered is None else registered
    lines = [
        "| library | hooks | the scope it opens | reason |",
        "| --- | --- | --- | --- |",
    ]
    for integration in registered:
        for hook in integration.hooks:
            lines.append(
                f"| {integration.package} | `{hook.module}.{hook.attribute}` | "
                f"{_cell(_scope_text(hook))} | {_reason(hook)} |"
            )
    return "\n".join(lines)


def render_shares(registered: tuple[Any, ...] | None = None) -> str:
    """One line: each library's names for a split of the data among the ranks (the number of
    ranks and this rank, as attributes of a sampler or dataset, or of its ``holder``)."""
    registered = integrations() if registered is None else registered
    parts = []
    for integration in registered:
        for share in integration.shares:
            on = f"{share.holder}." if share.holder else ""
            parts.append(f"{integration.package}: `{on}{share.size}` and `{on}{share.index}`")
    return "; ".join(parts) + "."


@dataclass(frozen=True)
class Block:
    """One generated block (a table, or a line): its page, its name (in the marker lines), what
    it is rendered from (for the messages) and how."""

    page: str
    name: str
    source: str
    render: Callable[[], str]

    @property
    def begin(self) -> str:
        return f"<!-- BEGIN GENERATED: {self.name} -->"

    @property
    def end(self) -> str:
        return f"<!-- END GENERATED: {self.name} -->"


BLOCKS = (
    Block(
        "environment.md",
        "environment variables",
        "rngcheck.env.variables.VARIABLES",
        render_table,
    ),
    Block(
        "data-parallel.md",
        "integration scopes",
        "the integrations' hooks (rngcheck.ranks.integrations.registered())",
        render_scopes,
    ),
    Block(
        "data-parallel.md",
        "data splits",
        "the integrations' shares (rngcheck.ranks.integrations.registered())",
        render_shares,
    ),
)


def _split(text: str, block: Block) -> tuple[str, str, str]:
    """(before the block, the block, after it); ValueError if the marker lines are not there."""
    lines = text.split("\n")
    try:
        begin = lines.index(block.begin)
        end = lines.index(block.end, begin + 1)
    except ValueError:
        raise ValueError(
            f"docs/{block.page} must contain the lines {block.begin!r} and {block.end!r} (in "
            f"that order) around the generated block '{block.name}'; put them back, then run "
            f"`{FIX}`"
        ) from None
    return (
        "\n".join(lines[: begin + 1]),
        "\n".join(lines[begin + 1 : end]),
        "\n".join(lines[end:]),
    )


def problem(text: str, block: Block) -> str | None:
    """Why the page's ``block`` is not the generated one, or None when it is."""
    try:
        _, written, _ = _split(text, block)
    except ValueError as e:
        return str(e)
    want = block.render()
    if written.strip("\n") == want:
        return None
    diff = "\n".join(
        difflib.unified_diff(
            written.strip("\n").split("\n"),
            want.split("\n"),
            f"docs/{block.page} (as written)",
            block.source,
            lineterm="",
            n=0,
        )
    )
    return (
        f"the generated block '{block.name}' in docs/{block.page} is stale: it differs from "
        f"{block.source}. Run `{FIX}` to regenerate it.\n{diff}"
    )


def fixed(text: str, block: Block) -> str:
    """The page with ``block`` rewritten from the code."""
    before, _, after = _split(text, block)
    return f"{before}\n{block.render()}\n{after}"


def problems(docs_dir: Path = DOCS) -> list[str]:
    """Why each generated block is missing or stale (empty when all are up to date)."""
    out = []
    for block in BLOCKS:
        path = docs_dir / block.page
        if not path.is_file():
            out.append(f"docs/{block.page} is missing: it holds the generated block '{block.name}'")
            continue
        why = problem(path.read_text(encoding="utf-8"), block)
        if why is not None:
            out.append(why)
    return out


# -- MkDocs ------------------------------------------------------------------------------------


def on_pre_build(config: Any) -> None:
    from mkdocs.exceptions import PluginError

    found = problems(Path(config["docs_dir"]))
    if found:
        raise PluginError("\n".join(found))


# -- as a script: check, or --fix --------------------------------------------------------------


def main(argv: list[str]) -> int:
    if argv[:1] == ["--fix"]:
        for block in BLOCKS:
            path = DOCS / block.page
            text = path.read_text(encoding="utf-8")
            try:
                new = fixed(text, block)
            except ValueError as e:
                print(f"docs: {e}", file=sys.stderr)
                return 1
            if new == text:
                print(f"docs: docs/{block.page}, {block.name}: up to date")
            else:
                path.write_text(new, encoding="utf-8")
                print(f"docs: docs/{block.page}, {block.name}: regenerated")
        return 0
    found = problems()
    for why in found:
        print(f"docs: {why}", file=sys.stderr)
    if found:
        return 1
    print("docs: every generated block is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
