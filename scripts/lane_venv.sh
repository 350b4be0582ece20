#!/usr/bin/env bash
# Sourced by the lane scripts: lane_venv VENV PIN... builds VENV with the pinned packages, the test
# requirements and the files named in LANE_REQUIREMENTS (space-separated), or reuses it while its
# stamp (the Python, the pins and those files' contents) matches. The stamp is written last, so an
# interrupted build is rebuilt next time. LANE_REBUILD=1 forces a rebuild.
lane_venv() {
  local venv=$1
  shift
  local py=${PYTHON:-python3}
  local stamp="$venv/.rngcheck-lane"
  local files=(requirements-test.txt ${LANE_REQUIREMENTS:-})
  local want
  want="python $("$py" -c 'import sys; print(sys.version.split()[0])') $* $(cat "${files[@]}")"
  if [ "${LANE_REBUILD:-0}" != "1" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "lane: reusing $venv ($*)"
  else
    echo "lane: building $venv ($*)"
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    local reqs=()
    for f in "${files[@]}"; do reqs+=(-r "$f"); done
    "$venv/bin/python" -m pip install -q "$@" "${reqs[@]}"
    echo "$want" >"$stamp"
  fi
  "$venv/bin/python" -m pip install -q -e . --no-deps
}
