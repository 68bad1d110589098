#!/usr/bin/env bash
# make cuda-check: builds smp against a CUDA build of torch with nvcc (its kernels for every
# architecture torch was built for, or TORCH_CUDA_ARCH_LIST) and runs the CPU test suites against
# that build. Needs no GPU. The CUDA torch lives in its own venv (CUDA_VENV, default .venv-cuda)
# so the CPU venv stays small; the build goes to build-cuda/, and the package is assembled in
# build-cuda/python/smp (links to smp/'s sources beside the CUDA _C), so both builds coexist.
#
#   CUDA_TORCH_VERSION   torch to install in the venv (default 2.14.1)
#   CUDA_CHECK_PYTEST    what pytest runs (default: tests/python -q)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${CUDA_VENV:-.venv-cuda}
TORCH=${CUDA_TORCH_VERSION:-2.14.1}
JOBS=${JOBS:-$(nproc)}
start=$SECONDS
stamp() { echo "--- cuda-check: $1 ($((SECONDS - start)) s)"; }

if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ] && [ -z "${CUDACXX:-}" ]; then
  echo "error: cuda-check needs nvcc (on PATH, in /usr/local/cuda/bin, or CUDACXX)" >&2
  exit 1
fi
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
PY=$(cd "$VENV" && pwd)/bin/python
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
  stamp "installing torch $TORCH (a CUDA build) into $VENV"
  "$PY" -m pip install --quiet "torch==$TORCH"
fi
"$PY" -m pip install --quiet -r tools/requirements-dev.txt
stamp "torch $("$PY" -c 'import torch; print(torch.__version__)') ready"

cmake -S . -B build-cuda -G Ninja -DPython3_EXECUTABLE="$PY" -DSMP_CUDA=ON -DSMP_BUILD_TESTS=ON \
  -DSMP_PYTHON_OUTPUT_DIR="$ROOT/build-cuda/python/smp" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build-cuda -j "$JOBS"
stamp "built"

# The package: smp/'s sources linked beside the CUDA build's _C.
pkg=build-cuda/python/smp
mkdir -p "$pkg"
for entry in smp/*; do
  case "$entry" in smp/_C*.so | smp/__pycache__) continue ;; esac
  ln -sfn "$ROOT/$entry" "$pkg/$(basename "$entry")"
done
# Not the checkout's smp/ (with the CPU build's _C): no current directory on sys.path.
export PYTHONPATH=$ROOT/build-cuda/python PYTHONSAFEPATH=1
"$PY" - <<'PYEOF'
import smp, smp._C, torch
assert smp._C.built_with_cuda, "the CUDA build of smp._C has no CUDA kernels"
assert smp._C.__file__.startswith(smp.__path__[0]), smp._C.__file__
ops = [name for name in ("vocab_ce_stats", "vocab_ce_grad", "bias_gelu", "bias_gelu_backward")
       if not torch._C._dispatch_has_kernel_for_dispatch_key(f"smp::{name}", "CUDA")]
assert not ops, f"no CUDA kernel registered for {ops}"
print(f"smp._C with CUDA kernels: {smp._C.__file__} (torch {torch.__version__})")
PYEOF
# The architectures in the fatbinary (cuobjdump is not in every toolkit; the ELF names are).
echo "GPU code in _C for: $(strings -n 5 build-cuda/python/smp/_C*.so | grep -o -- '-arch sm_[0-9]*[af]\?' | cut -c7- \
  | sort -u -V | tr '\n' ' ')"
ctest --test-dir build-cuda --output-on-failure
stamp "C++ tests passed"
# shellcheck disable=SC2086
"$PY" -m pytest ${CUDA_CHECK_PYTEST:-tests/python -q}
stamp "done"
