#!/usr/bin/env bash
# The GPU check, for whoever has a machine with an NVIDIA GPU: bash scripts/gpu_check.sh
# From a checkout, within about 8 minutes (each step under a timeout, GPU_CHECK_SECONDS=480 in all):
#   1. picks a Python whose torch (2.9 or later) sees a CUDA device: $PYTHON when set, else the
#      first of .venv-gpu (an earlier run's), the machine's python3, .venv-torch-newest, .venv.
#      With a GPU but no such Python, and no .venv-torch-newest yet, it builds that (the newest
#      lane's venv, torch TORCH_NEWEST from the registry: ~5.7 GB, about 2 minutes on a fast
#      link; its CUDA build needs a driver recent enough for it). Without a GPU it takes the first
#      Python with torch, else makes .venv (scripts/setup.sh, a CPU torch);
#   2. adds what the tests need and that Python lacks (requirements-test.txt; transformers for the
#      GPT-2 rows) in .venv-gpu, a venv on top of it (that Python's sys.path through a .pth file:
#      its torch is kept, and the Python itself is left as it was), when the registry can be
#      reached; rngcheck itself comes from the checkout (PYTHONPATH);
#   3. runs every cuda-marked test (pytest -m cuda), then the benchmark's GPU rows (python -m
#      benchmarks.gpu: plain training, the op level and the step level on a GPT-2 of GPT-2 small's
#      size), and prints a short summary. Logs and the benchmark's JSON go to .gpu-check/.
# Needs: bash, coreutils' timeout, and either a Python with a CUDA torch and the test requirements
# (then no network at all), or the package registry. Without CUDA it runs what it can and says in
# one line what it skipped. Exits non-zero when a test or the benchmark fails, or when the machine
# has a GPU that no torch here could use.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1
unset "${!RNGCHECK@}"  # (an RNGCHECK=1 in this shell would check the benchmark's plain rows too)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=.gpu-check
rm -rf "$OUT" && mkdir -p "$OUT"
deadline=$((SECONDS + ${GPU_CHECK_SECONDS:-480}))
say() { echo "gpu check: $*"; }

within() {  # within CAP CMD...: CMD under a timeout of CAP seconds or what is left, if less
  local cap=$1 left=$((deadline - SECONDS))
  shift
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 10 ]; then
    say "out of time before: $*"
    return 124
  fi
  timeout -k 10 "$cap" "$@"
}

# --- the machine
gpu="" driver_cuda=""
if command -v nvidia-smi >/dev/null 2>&1; then
  gpu=$(timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
    2>/dev/null | head -n 1)
  driver_cuda=$(timeout 30 nvidia-smi 2>/dev/null |
    sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -n 1)
  [ -n "$gpu" ] && gpu="$gpu, driver up to CUDA ${driver_cuda:-?}"
fi
say "machine: ${gpu:-no NVIDIA GPU found (nvidia-smi lists none)}"

# --- a Python: torch version, its CUDA, how many devices it sees (or no line: no usable torch)
probe() {
  within 120 "$1" - 2>/dev/null <<'EOF'
import torch

version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
if version >= (2, 9):
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(torch.__version__, torch.version.cuda or "none", n)
EOF
}

candidates=()
if [ -n "${PYTHON:-}" ]; then
  candidates=("$PYTHON")
else
  for p in .venv-gpu/bin/python "$(command -v python3 || true)" .venv-torch-newest/bin/python \
    .venv/bin/python; do
    [ -n "$p" ] && [ -x "$p" ] && candidates+=("$p")
  done
fi
py="" found="" cpu_py="" cpu_found=""
pick() {  # pick PYTHON...: the first that sees CUDA in py, else the first with torch in cpu_py
  local p line v c n
  for p in "$@"; do
    line=$(probe "$p") || line=""
    [ -n "$line" ] || continue
    read -r v c n <<<"$line"
    say "  $p: torch $v (CUDA $c), $n CUDA device(s)"
    if [ "$n" -gt 0 ]; then
      py=$p found=$line
      return
    fi
    [ -n "$cpu_py" ] || cpu_py=$p cpu_found=$line
  done
}
say "looking for a Python whose torch sees CUDA:"
pick "${candidates[@]}"
if [ -z "$py" ] && [ -n "$gpu" ] && [ -z "${PYTHON:-}" ] && [ ! -x .venv-torch-newest/bin/python ]; then
  say "a GPU, but no torch here sees it: building .venv-torch-newest from the registry"
  within 300 bash -c 'source scripts/lane_venv.sh && newest_torch_venv' >"$OUT/setup.log" 2>&1 ||
    say "building .venv-torch-newest failed or timed out (see $OUT/setup.log)"
  [ -x .venv-torch-newest/bin/python ] && pick .venv-torch-newest/bin/python
fi
if [ -z "$py" ] && [ -z "$cpu_py" ]; then
  say "no torch here: making .venv (scripts/setup.sh, a CPU torch)"
  within 300 bash scripts/setup.sh >"$OUT/setup.log" 2>&1 ||
    say "scripts/setup.sh failed or timed out (see $OUT/setup.log)"
  pick .venv/bin/python
fi
cuda=1
if [ -z "$py" ]; then
  cuda=0 py=$cpu_py found=$cpu_found
fi
if [ -z "$py" ]; then
  say "no Python with torch 2.9 or later could be found or made: nothing can run"
  exit 1
fi
read -r v c n <<<"$found"
torch_line="torch $v (CUDA $c), $n CUDA device(s)"

# --- what the tests need besides torch: from the registry, where that Python lacks it
missing() {  # the modules the cuda tests and the GPT-2 rows need that "$py" lacks
  "$py" - <<'EOF'
import importlib.util

need = ("pytest", "hypothesis", "rich", "numpy", "transformers")
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
EOF
}
lacks=$(missing)
if [ -n "$lacks" ]; then
  if [[ "$py" != .venv* ]]; then
    # A venv of our own on top of that Python: its sys.path (torch and all) through a .pth file,
    # so that pip installs only what is missing and the machine's Python stays as it was.
    say "$py lacks $lacks: adding them in .venv-gpu"
    rm -rf .venv-gpu
    if "$py" -m venv .venv-gpu >>"$OUT/setup.log" 2>&1; then
      site=$(.venv-gpu/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
      "$py" - >"$site/_gpu_check_base.pth" <<'EOF'
import os
import sys

print("\n".join(p for p in sys.path if p and p != os.getcwd() and os.path.isdir(p)))
EOF
      py=.venv-gpu/bin/python
    fi
  fi
  # (few retries: on a machine that reaches no registry, fail in seconds rather than minutes)
  within 240 "$py" -m pip install -q --retries 1 --timeout 20 -r requirements-test.txt \
    "$(grep '^transformers' requirements-models.txt | cut -d'#' -f1 | xargs)" \
    >>"$OUT/setup.log" 2>&1 || say "pip could not add them (see $OUT/setup.log)"
  lacks=$(missing)
fi
say "python: $py: $torch_line"

# --- the cuda-marked tests, then the GPU rows
status=0
mapfile -t files < <(grep -l 'pytest.mark.cuda' tests/test_*.py)
if [[ " $lacks " == *" pytest "* || " $lacks " == *" hypothesis "* ]]; then
  tests="NOT RUN: $py lacks $lacks" status=1
else
  say "pytest -m cuda ${files[*]}"
  within 240 "$py" -m pytest -q -rfEs -m cuda "${files[@]}" 2>&1 | tee "$OUT/pytest.log"
  rc=${PIPESTATUS[0]}
  tests=$(grep -E '^=* *[0-9]+ (passed|failed|skipped|deselected|errors?|xfailed|xpassed)' \
    "$OUT/pytest.log" | tail -n 1 | sed 's/^=* *//; s/ *=*$//')
  case $rc in
    0) ;;
    124 | 137) tests="TIMED OUT after: ${tests:-nothing}" status=1 ;;
    *) tests="FAILED (exit $rc): ${tests:-see $OUT/pytest.log}" status=1 ;;
  esac
fi

say "python -m benchmarks.gpu"
within 180 "$py" -m benchmarks.gpu --json "$OUT/benchmark.json" 2>&1 | tee "$OUT/benchmark.md"
rc=${PIPESTATUS[0]}
case $rc in
  0) bench=$(grep -E '^(\| |Skipped)' "$OUT/benchmark.md" | grep -v '^|---') ;;
  124 | 137) bench="timed out (see $OUT/benchmark.md)" status=1 ;;
  *) bench="FAILED (exit $rc): $(tail -n 1 "$OUT/benchmark.md")" status=1 ;;
esac

echo
echo "=== GPU check: rngcheck $(git rev-parse --short HEAD 2>/dev/null || echo '(no git)'), $SECONDS s"
echo "machine: ${gpu:-no NVIDIA GPU}"
echo "python:  $py, $torch_line"
echo "cuda tests (pytest -m cuda): $tests"
echo "GPU rows (python -m benchmarks.gpu):"
echo "$bench" | sed 's/^/  /'
if [ "$cuda" = 0 ]; then
  why="torch $v sees no CUDA device"
  [ "$c" = none ] && why="torch $v is built without CUDA"
  echo "SKIPPED, needs CUDA: the cuda tests and the GPU rows ($why)"
  if [ -n "$gpu" ]; then
    echo "FAILED: the machine has a GPU that no torch here could use; run again with the Python" \
      "of a torch built for CUDA ${driver_cuda:-as old as the driver} or before: PYTHON=... bash $0"
    status=1
  fi
fi
echo "logs: $OUT/"
exit $status
