#!/usr/bin/env bash
# The whole test suite.
source "$(dirname "$0")/_env.sh"
exec .venv/bin/python -m pytest "$@"
