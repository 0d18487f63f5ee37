#!/usr/bin/env bash
# The GPU check in one command: a CUDA torch in ./.venv, the CUDA test tier (tests/gpu) and the
# GPT-134M bf16 benchmark (plain, Trainer(detect_anomaly=True), the grad_norm recipe, DeviceStatsMonitor,
# lightning-debug at its defaults and with every check every step), all written to one results file.
#
#   scripts/gpu-check.sh                 # results in gpu-check-results.md
#   RESULTS=/tmp/r.md ROUNDS=3 scripts/gpu-check.sh
#   TORCH_INDEX=https://download.pytorch.org/whl/cu126 scripts/gpu-check.sh   # another CUDA build
#
#   PY=python3 scripts/gpu-check.sh     # a Python that already has a CUDA torch and the packages: no .venv
#
# Without a GPU it still runs: the tier skips (module-level skip) and the benchmark is left out, and the
# results file says so.
if [ -z "${PY:-}" ]; then
  source "$(dirname "$0")/_env.sh"
  PY=.venv/bin/python
else
  set -euo pipefail
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
RESULTS="${RESULTS:-gpu-check-results.md}"
ROUNDS="${ROUNDS:-3}"
STEPS="${STEPS:-120}"
TORCH_INDEX="${TORCH_INDEX:-https://download.pytorch.org/whl/cu128}"

if [ "$PY" = .venv/bin/python ] && command -v nvidia-smi >/dev/null 2>&1 && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)"; then
  version="$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")"
  echo "installing a CUDA build of torch $version into .venv ($TORCH_INDEX)" >&2
  "$PY" -m pip install -q --force-reinstall --no-deps "torch==$version" --index-url "$TORCH_INDEX" \
    || "$PY" -m pip install -q --force-reinstall --no-deps "torch==$version"
fi

{
  echo "# lightning-debug GPU check ($(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
  echo
  "$PY" - <<'PYEOF'
import platform, torch, lightning
cuda = torch.cuda.is_available()
print(f"- torch {torch.__version__} (CUDA {torch.version.cuda}), lightning {lightning.__version__}, "
      f"Python {platform.python_version()}")
print(f"- device: {torch.cuda.get_device_name() if cuda else 'no CUDA device: the tier skips, no benchmark'}")
PYEOF
  echo
  echo "## tests/gpu"
  echo
  echo '```'
} > "$RESULTS"

set +e
"$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu 2>&1 | tail -40 >> "$RESULTS"
tier=${PIPESTATUS[0]}
set -e
echo '```' >> "$RESULTS"

bench=0
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  {
    echo
    echo "## GPT-134M, bf16-mixed, batch 8 x 512 tokens ($ROUNDS interleaved rounds of $STEPS steps)"
    echo
  } >> "$RESULTS"
  set +e
  PYTHONPATH="$PWD" "$PY" benchmarks/overhead.py --model gpt --prime --rounds "$ROUNDS" --steps "$STEPS" --warmup 20 \
    --only plain,anchor_detect_anomaly,anchor_grad_norm_recipe,anchor_device_stats,plugin_defaults,all_four \
    2>&1 | grep -v "^round " >> "$RESULTS"
  bench=${PIPESTATUS[0]}
  echo >> "$RESULTS"
  PYTHONPATH="$PWD" "$PY" benchmarks/gpu_probe.py --steps "$STEPS" 2>&1 | grep -E "^#|^- |^  - " >> "$RESULTS"
  set -e
fi
echo >> "$RESULTS"
echo "tier exit status: $tier; benchmark exit status: $bench" >> "$RESULTS"
echo "results: $RESULTS" >&2
[ "$tier" -eq 0 ] || [ "$tier" -eq 5 ] || exit "$tier"
exit "$bench"
