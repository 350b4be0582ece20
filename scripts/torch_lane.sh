#!/usr/bin/env bash
# A torch lane of .ci/run: the whole test suite on one torch release, in a venv of its own, reused
# while its pins match (see scripts/lane_venv.sh).
#   bash scripts/torch_lane.sh [PYTEST ARG...]                    the newest torch (TORCH_NEWEST)
#   LANE_TORCH=2.14.1 bash scripts/torch_lane.sh [PYTEST ARG...]  another release
# PyPI ships torch as a CUDA build (~5.7 GB in the venv); it runs here on the CPU.
#
# The newest torch (.venv-torch-newest) comes from the registry alone: these machines' pip
# configuration caps torch at the newest release that lies on their disk, so pip as configured
# would install an older torch than the one users get. The lane says when the registry has a
# newer torch than TORCH_NEWEST, and checks that `pip install .` beside it installs rngcheck alone
# (pyproject.toml's range keeps the user's torch). Another release (.venv-torch-VERSION) installs
# through pip as the machine configures it: from its disk, where the release lies there.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
# shellcheck source=scripts/lane_venv.sh
source scripts/lane_venv.sh

version=${LANE_TORCH:-$TORCH_NEWEST}
status=0
if [ "$version" = "$TORCH_NEWEST" ]; then
  VENV=$TORCH_NEWEST_VENV
  newest_torch_venv
  export LANE_PIP=registry
  latest=$(lane_pip "$VENV" index versions torch 2>/dev/null | sed -n 's/^torch (\(.*\))$/\1/p') || true
  if [ -n "$latest" ] && [ "$latest" != "$TORCH_NEWEST" ]; then
    echo "torch lane: note: the registry's newest torch is $latest; this lane tests $TORCH_NEWEST" \
      "(raise TORCH_NEWEST in scripts/lane_venv.sh and README.md's 'Tested with')"
  fi
  report=$(mktemp)
  lane_pip "$VENV" install -q --dry-run --report "$report" . || status=1
  if ! "$VENV/bin/python" - "$report" <<'EOF'; then
import json
import sys

names = [item["metadata"]["name"] for item in json.load(open(sys.argv[1]))["install"]]
if names != ["rngcheck"]:
    sys.exit(f"torch lane: `pip install .` beside this torch would install {names}, not rngcheck alone")
print("torch lane: `pip install .` beside this torch installs rngcheck alone")
EOF
    status=1
  fi
  rm -f "$report"
else
  VENV=.venv-torch-$version
  LANE_REQUIREMENTS=requirements-models.txt lane_venv "$VENV" "torch==$version"
fi

echo "torch lane: the whole suite on torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
"$VENV/bin/python" -m pytest -q "$@" || status=1
echo "torch lane: $(($(date +%s) - start)) s, $VENV uses $(du -sh "$VENV" | cut -f1)"
exit $status
