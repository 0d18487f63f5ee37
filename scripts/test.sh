#!/usr/bin/env bash
# The whole test suite; under CI (CI=true) then the support matrix (scripts/matrix.sh: the lowest and the
# newest supported versions, each in a venv of its own, about 15 minutes with empty caches).
# One pytest-xdist worker per core ("-n 0" among the arguments runs it in one process, as "-n 4" sets four).
source "$(dirname "$0")/_env.sh"
if [ "${CI:-}" != "true" ]; then
  exec .venv/bin/python -m pytest -n auto --dist worksteal "$@"
fi
status=0
.venv/bin/python -m pytest -n auto --dist worksteal "$@" || status=$?
# the matrix's venvs (about 11 GB) are kept between CI runs on one machine, outside the fresh clone
MATRIX_DIR="${MATRIX_DIR:-$HOME/.cache/lightning-debug/matrix}" bash scripts/matrix.sh || status=$((status > 0 ? status : 1))
exit "$status"
