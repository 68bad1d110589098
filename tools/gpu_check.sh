#!/usr/bin/env bash
# The GPU check: on a machine with a CUDA GPU, a CUDA build of torch and nvcc (no internet
# needed), builds smp from source, runs the GPU test tier and benchmarks/gpu.py, and writes a log
# and a JSON summary: the kernels, the step and the round trip, then the pipeline (pp 2, 8
# microbatches, 200 steps, two ranks sharing the GPU over gloo, against one process) and the
# synchronizing CUDA operations of a TP step (design.md §4.8, §6.3). Sized to end within 10
# minutes on one H100 or H200.
#
#   bash tools/gpu_check.sh [OUT_DIR]      (default build-gpu/out)
#   PYTHON         the interpreter whose torch to build against (default python3)
#   TORCH_CUDA_ARCH_LIST  default: this machine's GPU only (a faster build)
#   GPU_CHECK_BUILD_TIMEOUT  seconds for the build (default 300)
#   GPU_CHECK_DRY=1  check the script itself on a machine without a GPU (a CUDA torch and nvcc
#                  still needed): builds for sm 9.0, the GPU tests skip, the benchmark runs small
#                  on the CPU
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:-build-gpu/out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
LOG=$OUT/gpu_check.log
SUMMARY=$OUT/gpu_check.json
start=$SECONDS
exec > >(tee "$LOG") 2>&1
stamp() { echo "=== gpu-check: $1 ($((SECONDS - start)) s)"; }
declare -A status

DRY=${GPU_CHECK_DRY:-0}
"$PY" - "$DRY" <<'PYEOF' || { echo "no CUDA device: nothing to check"; exit 1; }
import sys, torch
if sys.argv[1] == "1":
    print(f"dry run: torch {torch.__version__} (CUDA {torch.version.cuda}), no GPU used")
    sys.exit(0)
assert torch.cuda.is_available()
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name()}")
PYEOF
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST=9.0
  [ "$DRY" = 1 ] || TORCH_CUDA_ARCH_LIST=$("$PY" -c \
    "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
  export TORCH_CUDA_ARCH_LIST
fi

stamp "building for sm ${TORCH_CUDA_ARCH_LIST}"
# The extension is written into smp/ (no pip: the machine may have no index to build from).
build_timeout=${GPU_CHECK_BUILD_TIMEOUT:-300}
if timeout "$build_timeout" cmake -S . -B build-gpu -G Ninja -DPython3_EXECUTABLE="$(command -v "$PY")" \
      -DSMP_CUDA=ON -DSMP_BUILD_TESTS=OFF -DSMP_BUILD_BENCHMARKS=OFF \
      -DSMP_PYTHON_OUTPUT_DIR="$ROOT/smp" -DCMAKE_BUILD_TYPE=Release >/dev/null &&
    timeout "$build_timeout" cmake --build build-gpu -j "$(nproc)"; then
  status[build]=passed
else
  status[build]=failed
fi
stamp "build ${status[build]}"

export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if [ "${status[build]}" = passed ]; then
  if timeout 240 "$PY" -m pytest -q -m gpu tests/python/gpu -p no:cacheprovider \
      --junitxml "$OUT/gpu_tests.xml"; then
    status[tests]=passed
  else
    status[tests]=failed
  fi
  stamp "GPU tests ${status[tests]}"
  bench_args=()
  [ "$DRY" = 1 ] && bench_args=(--device cpu --small --rounds 2)
  if timeout 210 "$PY" benchmarks/gpu.py "${bench_args[@]}" --only kernels,step,roundtrip \
      --json "$OUT/gpu_bench.json"; then
    status[bench]=passed
  else
    status[bench]=failed
  fi
  stamp "benchmark ${status[bench]}"
  pipeline_args=()
  [ "$DRY" = 1 ] && pipeline_args=(--pipeline-steps 6)
  if timeout 180 "$PY" benchmarks/gpu.py "${bench_args[@]}" "${pipeline_args[@]}" \
      --only pipeline,tp_syncs --json "$OUT/gpu_pipeline.json"; then
    status[pipeline]=passed
  else
    status[pipeline]=failed
  fi
  stamp "pipeline and TP syncs ${status[pipeline]}"
fi

"$PY" - "$SUMMARY" "$((SECONDS - start))" "${status[build]:-}" "${status[tests]:-skipped}" \
    "${status[bench]:-skipped}" "${status[pipeline]:-skipped}" "$OUT" <<'PYEOF'
import json, sys, pathlib, xml.etree.ElementTree as ET
path, seconds, build, tests, bench, pipeline, out = sys.argv[1:]
summary = {"seconds": int(seconds), "build": build, "tests": tests, "benchmark": bench,
           "pipeline": pipeline}
junit = pathlib.Path(out) / "gpu_tests.xml"
if junit.exists():
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    summary["test_counts"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
bench_json = pathlib.Path(out) / "gpu_bench.json"
if bench_json.exists():
    summary["bench"] = json.loads(bench_json.read_text())
pipeline_json = pathlib.Path(out) / "gpu_pipeline.json"
if pipeline_json.exists():
    summary["bench_pipeline"] = json.loads(pipeline_json.read_text())
pathlib.Path(path).write_text(json.dumps(summary, indent=1))
print(json.dumps({k: v for k, v in summary.items() if not k.startswith("bench")}))
PYEOF
stamp "done: $LOG, $SUMMARY"
[ "${status[build]}" = passed ] && [ "${status[tests]:-}" = passed ] && [ "${status[bench]:-}" = passed ] &&
  [ "${status[pipeline]:-}" = passed ]
