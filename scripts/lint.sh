#!/usr/bin/env bash
# The linter and the type checker, as CI runs them (after scripts/setup.sh made .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check rngcheck tests benchmarks examples
.venv/bin/ruff format --check rngcheck tests benchmarks examples
.venv/bin/mypy  # the package, with the settings in pyproject.toml ([tool.mypy])
