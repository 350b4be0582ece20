#!/usr/bin/env bash
# The README's demo: set-up on a fresh machine (scripts/setup.sh), then the torch_xla report's
# model on CPU under rngcheck: two recompute mismatches rendered, then the quiet report once fixed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/checkpoint_dropout.py "$@"
