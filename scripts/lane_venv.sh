#!/usr/bin/env bash
# Sourced by the lane scripts: lane_venv VENV PIN... builds VENV with the pinned packages, the test
# requirements and the files named in LANE_REQUIREMENTS (space-separated), or reuses it while its
# stamp (the Python, where pip installs from, the pins and those files' contents) matches. The
# stamp is written last, so an interrupted build is rebuilt next time. LANE_REBUILD=1 forces a
# rebuild.
#
# LANE_PIP says where pip installs from:
#   machine   (the default) pip as this machine configures it;
#   registry  the package registry alone: no pip configuration file (PIP_CONFIG_FILE=/dev/null)
#             and no PIP_FIND_LINKS or PIP_CONSTRAINT from the environment. A machine's own
#             configuration may cap a package (these machines cap torch at the newest release
#             that lies on their disk), so a lane that needs the registry's newest release must
#             build without it. An index set in PIP_INDEX_URL (a mirror) is still used.

# The newest torch on the registry, the one the newest lane tests (README.md's "Tested with" names
# it too), and its venv, built from the registry alone: scripts/torch_lane.sh, scripts/gpu_check.sh.
TORCH_NEWEST=2.15.0
TORCH_NEWEST_VENV=.venv-torch-newest
newest_torch_venv() {
  LANE_PIP=registry LANE_REQUIREMENTS=requirements-models.txt \
    lane_venv "$TORCH_NEWEST_VENV" "torch==$TORCH_NEWEST"
}

_lane_pip_from() {  # LANE_PIP, checked
  case ${LANE_PIP:-machine} in
    machine | registry) echo "${LANE_PIP:-machine}" ;;
    *)
      echo "lane: LANE_PIP must be machine or registry, got '$LANE_PIP'" >&2
      return 2
      ;;
  esac
}

lane_pip() {  # lane_pip VENV ARG...: VENV's pip, installing from where LANE_PIP says
  local venv=$1 from
  shift
  from=$(_lane_pip_from) || return 2
  if [ "$from" = registry ]; then
    env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip "$@"
  else
    "$venv/bin/python" -m pip "$@"
  fi
}

lane_venv() {
  local venv=$1
  shift
  local py=${PYTHON:-python3}
  local stamp="$venv/.rngcheck-lane"
  local files=(requirements-test.txt ${LANE_REQUIREMENTS:-})
  local from want
  from=$(_lane_pip_from) || return 2
  want="python $("$py" -c 'import sys; print(sys.version.split()[0])')"
  [ "$from" = machine ] || want+=" pip:$from"  # (machine: the stamps written before LANE_PIP)
  want+=" $* $(cat "${files[@]}")"
  if [ "${LANE_REBUILD:-0}" != "1" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "lane: reusing $venv ($*)"
  else
    echo "lane: building $venv ($*, pip: $from)"
    rm -rf "$venv"
    "$py" -m venv "$venv"
    lane_pip "$venv" install -q --upgrade pip >/dev/null 2>&1 || true
    local reqs=()
    for f in "${files[@]}"; do reqs+=(-r "$f"); done
    lane_pip "$venv" install -q "$@" "${reqs[@]}"
    echo "$want" >"$stamp"
  fi
  lane_pip "$venv" install -q -e . --no-deps
}
