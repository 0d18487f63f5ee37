#!/usr/bin/env bash
# The whole test suite; under CI (CI=true) then the support matrix (scripts/matrix.sh: the lowest and the
# newest supported versions, each in a venv of its own, about 15 minutes with empty caches).
source "$(dirname "$0")/_env.sh"
if [ "${CI:-}" != "true" ]; then
  exec .venv/bin/python -m pytest "$@"
fi
status=0
.venv/bin/python -m pytest "$@" || status=$?
# the matrix's venvs (about 11 GB) are kept between CI runs on one machine, outside the fresh clone
MATRIX_DIR="${MATRIX_DIR:-$HOME/.cache/lightning-debug/matrix}" bash scripts/matrix.sh || status=$((status > 0 ? status : 1))
exit "$status"
