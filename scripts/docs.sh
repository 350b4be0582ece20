#!/usr/bin/env bash
# Builds the documentation site strictly: bash scripts/docs.sh [--fix]
#
# A small venv, .venv-docs (mkdocs from requirements-docs.txt, rngcheck editable without its
# dependencies: no torch), reused while its stamp (the Python, requirements-docs.txt) matches;
# then `mkdocs build --strict` into .venv-docs/site (ignored by git). Strict: a broken link or
# anchor, a page left out of the nav, or a stale generated table (docs/hooks.py: the
# environment variables, the integrations' scopes) fails the build.
#   --fix   rewrite the generated tables (docs/environment.md's from rngcheck/env/variables.py,
#           docs/data-parallel.md's from rngcheck/ranks/integrations/), instead of building.
# DOCS_REBUILD=1 rebuilds the venv. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-docs
SITE=$VENV/site
PY=${PYTHON:-python3}
export PYTHONDONTWRITEBYTECODE=1
# The venv's rngcheck installs its startup hook: an RNGCHECK=1 in this shell would try to check
# mkdocs itself (with no torch to do it).
unset "${!RNGCHECK@}"

fix=0
for arg in "$@"; do
  case $arg in
    --fix) fix=1 ;;
    -h | --help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "docs.sh: unknown argument $arg (use --fix, or nothing)" >&2; exit 2 ;;
  esac
done

stamp=$VENV/.rngcheck-docs
want="python $("$PY" -c 'import sys; print(sys.version.split()[0])') $(cksum <requirements-docs.txt)"
if [ "${DOCS_REBUILD:-0}" = "1" ] || [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "docs: building $VENV"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$VENV/bin/python" -m pip install -q -r requirements-docs.txt
  "$VENV/bin/python" -m pip install -q -e . --no-deps
  echo "$want" >"$stamp"
fi

# The table hook needs rngcheck's variable table and its integrations' registry, and must get
# them without torch.
if ! "$VENV/bin/python" -c '
import sys
import rngcheck.env.variables
from rngcheck.ranks import integrations
integrations.registered()
heavy = sorted(m for m in ("torch", "rich") if m in sys.modules)
sys.exit(f"importing the sources of the generated tables imported {heavy}" if heavy else 0)'; then
  echo "docs: rngcheck.env.variables and rngcheck.ranks.integrations must import without torch" \
    "(docs/hooks.py reads them)" >&2
  exit 1
fi

if [ "$fix" = 1 ]; then
  exec "$VENV/bin/python" docs/hooks.py --fix
fi
"$VENV/bin/mkdocs" build --strict --clean --site-dir "$SITE"
echo "docs: built $SITE/index.html"
