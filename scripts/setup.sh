#!/usr/bin/env bash
# Creates .venv with a light CPU torch (2.13.0 from requirements-dev.txt) and rngcheck installed
# in editable mode. Idempotent: a second run reuses the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -r requirements-dev.txt
.venv/bin/python -m pip install -q -e . --no-deps
