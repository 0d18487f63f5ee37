#!/usr/bin/env bash
# The support matrix: the lowest and the newest supported combination, each in a throw-away virtual
# environment under .matrix/ (git ignores it), each running the smoke tier of scripts/smoke.py.
#
#   bash scripts/matrix.sh            # both combinations
#   bash scripts/matrix.sh low        # one of them (low | new)
#
# Only PyPI is used. A venv is reused while its pins are unchanged (MATRIX_FRESH=1 rebuilds it);
# MATRIX_CLEAN=1 deletes each venv after its run (about 5 GB each: the old torch releases on PyPI
# are CUDA builds, which run on the CPU). MATRIX_DIR moves the venvs elsewhere.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
MATRIX_DIR="${MATRIX_DIR:-$ROOT/.matrix}"
unset PYTHONPATH

# name | python | the pins (keep the README's "Supported versions" table in step)
LOW_PYTHON=3.10
LOW_TORCH="torch==2.2.2 numpy<2"   # torch 2.2 was built against numpy 1
LOW_PINS=("lightning==2.2.5" "pytorch_lightning==2.2.5" "accelerate==0.30.0"
          "jsonargparse[signatures]==4.27.7" "psutil==7.2.0" "tensorboard==2.14.0")
NEW_PYTHON=3.13
NEW_TORCH="torch==2.14.1"
NEW_PINS=("lightning==2.6.6" "pytorch_lightning==2.6.6" "accelerate==1.15.0"
          "jsonargparse[signatures]==4.53.0" "rich")

pip_in() {  # pip of venv $1 with the rest as arguments; the notes about this machine's local indexes dropped
  local venv=$1
  shift
  "$venv/bin/python" -m pip "$@" 2>&1 | { grep -v "neither a file nor a directory" || true; }
}

find_python() {  # python3.X on PATH, else pyenv's
  local version=$1 candidate
  for candidate in "python$version" "$(pyenv root 2>/dev/null)"/versions/"$version".*/bin/python"$version"; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "" >/dev/null 2>&1; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

build() {  # build (or reuse) the venv $1 with python $2, torch pins $3 (one word each) and the pins after them
  local name=$1 version=$2 torch_pins=$3
  shift 3
  local venv="$MATRIX_DIR/$name" stamp="$MATRIX_DIR/$name/.pins" want python
  want="python$version $torch_pins $(printf '%s ' "$@")"
  if [ -x "$venv/bin/python" ] && [ -z "${MATRIX_FRESH:-}" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    pip_in "$venv" install -q --no-deps -e "$ROOT" || return 1
    return 0
  fi
  python="$(find_python "$version")" || { echo "matrix $name: python$version not found"; return 1; }
  rm -rf "$venv"
  mkdir -p "$MATRIX_DIR"
  "$python" -m venv "$venv" || return 1
  pip_in "$venv" install -q --upgrade pip || return 1
  # torch first, on its own, so that the resolver never swaps it; then the package with the other pins
  # shellcheck disable=SC2086 # one word per pin
  pip_in "$venv" install -q $torch_pins || return 1
  # shellcheck disable=SC2086
  pip_in "$venv" install -q -e "$ROOT[accelerate]" "$@" $torch_pins || return 1
  echo "$want" >"$stamp"
}

versions() {
  "$1/bin/python" - <<'EOF'
import importlib.metadata as m, platform
names = ["torch", "lightning", "pytorch_lightning", "accelerate", "jsonargparse", "psutil", "tensorboard", "numpy"]
print("python", platform.python_version(), " ".join(f"{n} {m.version(n)}" for n in names))
EOF
}

run_one() {  # name, python version, torch pins, pins...
  local name=$1 started=$SECONDS result=0
  echo "matrix $name: building the venv (python$2) ..."
  if ! build "$@"; then
    echo "matrix $name: FAILED to build the venv ($((SECONDS - started)) s)"
    return 1
  fi
  echo "matrix $name: $(versions "$MATRIX_DIR/$name")   (built in $((SECONDS - started)) s)"
  "$MATRIX_DIR/$name/bin/python" "$ROOT/scripts/smoke.py" "$MATRIX_DIR/work-$name" || result=1
  echo "matrix $name: $([ $result = 0 ] && echo passed || echo FAILED) in $((SECONDS - started)) s"
  if [ -n "${MATRIX_CLEAN:-}" ]; then
    rm -rf "$MATRIX_DIR/$name" "$MATRIX_DIR/work-$name"
  fi
  return $result
}

wanted=("$@")
[ $# -gt 0 ] || wanted=(low new)
status=0
for name in "${wanted[@]}"; do
  case $name in
    low) run_one low "$LOW_PYTHON" "$LOW_TORCH" "${LOW_PINS[@]}" || status=1 ;;
    new) run_one new "$NEW_PYTHON" "$NEW_TORCH" "${NEW_PINS[@]}" || status=1 ;;
    *) echo "unknown combination $name (low | new)"; status=2 ;;
  esac
done
echo "matrix: $([ $status = 0 ] && echo "all combinations passed" || echo "a combination FAILED") (${SECONDS} s)"
exit $status
