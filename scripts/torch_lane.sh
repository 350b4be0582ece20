#!/usr/bin/env bash
# The newest-torch lane of .ci/run: the whole test suite on the newest torch that installs on these
# machines (torch 2.14.1; PyPI ships it as a CUDA build, ~5.5 GB in the venv, run here on the CPU).
# The venv, .venv-torch-newest, is reused while its pins match (see scripts/lane_venv.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
# shellcheck source=scripts/lane_venv.sh
source scripts/lane_venv.sh
VENV=.venv-torch-newest
LANE_REQUIREMENTS=requirements-models.txt lane_venv "$VENV" torch==2.14.1
echo "torch lane: the whole suite on torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
status=0
"$VENV/bin/python" -m pytest -q "$@" || status=1
echo "torch lane: $(($(date +%s) - start)) s, $VENV uses $(du -sh "$VENV" | cut -f1)"
exit $status
