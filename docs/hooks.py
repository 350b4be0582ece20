"""MkDocs hook (``hooks:`` in mkdocs.yml): the environment-variable table of environment.md is
generated from the code, and a stale one fails the build.

The table is rendered from ``rngcheck.env.variables.VARIABLES`` (name, values, default, help: the
same text the start-up error messages use) and compared with the block between the
``BEGIN GENERATED`` and ``END GENERATED`` lines of docs/environment.md. If they differ, the build
stops and says to run ``bash scripts/docs.sh --fix``, which rewrites the block
(``python docs/hooks.py --fix``). ``python docs/hooks.py`` on its own checks, exit code 1 when
stale.

Importing ``rngcheck.env.variables`` needs no torch (``import rngcheck`` is lazy, and the table's
modules import none), so the docs build in a small venv without torch. The checkout's own
package is imported (its root goes first on ``sys.path``), never another installed rngcheck.

Cell text is the code's, unchanged, except what Markdown would otherwise eat outside code spans:
``|`` is escaped as ``\\|`` and ``<`` as ``&lt;`` (``DIR/rank<N>.json`` would be an HTML tag).
"""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
PAGE = "environment.md"
BEGIN = "<!-- BEGIN GENERATED: environment variables -->"
END = "<!-- END GENERATED: environment variables -->"
FIX = "bash scripts/docs.sh --fix"


def variables() -> dict[str, Any]:
    """``VARIABLES`` of this checkout's ``rngcheck.env.variables``."""
    if str(ROOT) not in sys.path[:1]:
        sys.path.insert(0, str(ROOT))
    from rngcheck.env.variables import VARIABLES

    return VARIABLES


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


def _split(text: str) -> tuple[str, str, str]:
    """(before the block, the block, after it); ValueError if the marker lines are not there."""
    lines = text.split("\n")
    try:
        begin = lines.index(BEGIN)
        end = lines.index(END, begin + 1)
    except ValueError:
        raise ValueError(
            f"docs/{PAGE} must contain the lines {BEGIN!r} and {END!r} (in that order) around "
            f"the generated environment-variable table; put them back, then run `{FIX}`"
        ) from None
    return (
        "\n".join(lines[: begin + 1]),
        "\n".join(lines[begin + 1 : end]),
        "\n".join(lines[end:]),
    )


def problem(text: str) -> str | None:
    """Why the page's table is not the generated one, or None when it is."""
    try:
        _, block, _ = _split(text)
    except ValueError as e:
        return str(e)
    want = render_table()
    if block.strip("\n") == want:
        return None
    diff = "\n".join(
        difflib.unified_diff(
            block.strip("\n").split("\n"),
            want.split("\n"),
            f"docs/{PAGE} (as written)",
            "rngcheck/env/variables.py (VARIABLES)",
            lineterm="",
            n=0,
        )
    )
    return (
        f"the environment-variable table in docs/{PAGE} is stale: it differs from "
        f"rngcheck.env.variables.VARIABLES. Run `{FIX}` to regenerate it.\n{diff}"
    )


def fixed(text: str) -> str:
    """The page with its generated block rewritten from the code."""
    before, _, after = _split(text)
    return f"{before}\n{render_table()}\n{after}"


# -- MkDocs ------------------------------------------------------------------------------------


def on_pre_build(config: Any) -> None:
    from mkdocs.exceptions import PluginError

    path = Path(config["docs_dir"]) / PAGE
    if not path.is_file():
        raise PluginError(f"docs/{PAGE} is missing: it holds the generated table (`{FIX}`)")
    why = problem(path.read_text(encoding="utf-8"))
    if why is not None:
        raise PluginError(why)


# -- as a script: check, or --fix --------------------------------------------------------------


def main(argv: list[str]) -> int:
    path = DOCS / PAGE
    text = path.read_text(encoding="utf-8")
    if argv[:1] == ["--fix"]:
        try:
            new = fixed(text)
        except ValueError as e:
            print(f"docs: {e}", file=sys.stderr)
            return 1
        if new == text:
            print(f"docs: docs/{PAGE}: the environment-variable table is up to date")
        else:
            path.write_text(new, encoding="utf-8")
            print(f"docs: docs/{PAGE}: regenerated the environment-variable table")
        return 0
    why = problem(text)
    if why is not None:
        print(f"docs: {why}", file=sys.stderr)
        return 1
    print(f"docs: docs/{PAGE}: the environment-variable table is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
