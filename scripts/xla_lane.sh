#!/usr/bin/env bash
# The torch_xla lane of .ci/run. A separate venv, .venv-xla, with torch==2.9.0 + torch-xla==2.9.0
# (torch_xla needs exactly that torch but does not declare it: both are pinned here) and rngcheck
# installed editable without deps; then, on the CPU (PJRT_DEVICE=CPU):
#   1. the XLA tests (tests/test_xla.py, marker "xla"; they skip in the main lane);
#   2. the single-process core tests, since rngcheck claims torch 2.9 support, and the
#      integrations' coverage test (every name rngcheck hooks resolves on torch 2.9).
# Both run on each route by which ops reach the checker (RNGCHECK_ROUTE).
# The venv is reused while its pins match (see scripts/lane_venv.sh); otherwise it is rebuilt
# (PyPI's torch 2.9.0 for x86_64 is the CUDA build: ~3.9 GB to download, ~7 GB on disk, ~2 min).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)

# shellcheck source=scripts/lane_venv.sh
source scripts/lane_venv.sh
VENV=.venv-xla
# torch_xla needs exactly this torch but does not declare it: both are pinned.
lane_venv "$VENV" torch==2.9.0 torch-xla==2.9.0

export PJRT_DEVICE=CPU
status=0
for route in selective dispatch_mode; do  # (both routes by which ops reach the checker)
  echo "xla lane: XLA tests on the $route route (torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'))"
  RNGCHECK_ROUTE=$route "$VENV/bin/python" -m pytest -q -m xla tests/test_xla.py || status=1
done

shopt -s nullglob
# (and the integrations' coverage: every hooked name resolves on torch 2.9)
core=(tests/test_core*.py tests/test_recompute*.py tests/test_torch_versions.py tests/test_integrations.py tests/test_routes.py)
if [ ${#core[@]} -gt 0 ]; then
  for route in selective dispatch_mode; do
    echo "xla lane: core single-process tests on torch 2.9, on the $route route"
    RNGCHECK_ROUTE=$route "$VENV/bin/python" -m pytest -q "${core[@]}" || status=1
  done
fi

echo "xla lane: $(($(date +%s) - start)) s, $VENV uses $(du -sh "$VENV" | cut -f1)"
exit $status
