#!/usr/bin/env bash
# The main job: a short CPU training run with a planted NaN, and what lightning-debug reports.
source "$(dirname "$0")/_env.sh"
exec .venv/bin/lightning-debug demo "$@"
