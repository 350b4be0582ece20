#!/usr/bin/env bash
# Sourced by the lane scripts: lane_venv VENV PIN... builds VENV with the pinned packages and the
# test requirements, or reuses it while its stamp (the Python, the pins and the requirements file)
# matches. The stamp is written last, so an interrupted build is rebuilt next time.
# LANE_REBUILD=1 forces a rebuild.
lane_venv() {
  local venv=$1
  shift
  local py=${PYTHON:-python3}
  local stamp="$venv/.rngcheck-lane"
  local want
  want="python $("$py" -c 'import sys; print(sys.version.split()[0])') $* $(cat requirements-test.txt)"
  if [ "${LANE_REBUILD:-0}" != "1" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "lane: reusing $venv ($*)"
  else
    echo "lane: building $venv ($*)"
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    "$venv/bin/python" -m pip install -q "$@" -r requirements-test.txt
    echo "$want" >"$stamp"
  fi
  "$venv/bin/python" -m pip install -q -e . --no-deps
}
