# Sourced by the set-up commands: create (once) and reuse ./.venv with everything installed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
VENV_PY=.venv/bin/python
# torch first: a bare `torch` requirement with nothing installed pulls a multi-GB CUDA build.
if ! "$VENV_PY" -c "import torch" >/dev/null 2>&1; then
  "$VENV_PY" -m pip install -q torch==2.13.0 || "$VENV_PY" -m pip install -q torch
fi
stamp=.venv/.lightning-debug-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$VENV_PY" -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
