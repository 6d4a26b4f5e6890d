#!/usr/bin/env bash
# One prepared check on a bare CUDA machine (no network): environment, offline wheels, the CUDA test subset, then
# benchmarks/gpu_kernels.py. Every step is time-boxed and the run goes on past a failed one; the whole run stays
# under ~7.5 minutes (GPU_CHECK_TOTAL_S). Results under $OUT (default results/gpu/), at most 5 files:
#   summary.txt        one line per step: ok / FAILED rc / TIMEOUT / skipped, with its wall time
#   gpu_check.log      everything printed
#   env.txt            nvidia-smi, torch / triton / CUDA versions, pip list
#   gpu_kernels.json   the measurements (see benchmarks/gpu_kernels.py), and gpu_kernels.png
#
#   benchmarks/gpu_wheels.sh wheels       # beforehand, on a machine with PyPI access
#   bash benchmarks/gpu_check.sh          # there; WHEELS=wheels OUT=... GPU_CHECK_TOTAL_S=450
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
OUT=${OUT:-results/gpu}
WHEELS=${WHEELS:-wheels}
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/deepinfer-site}
TOTAL_S=${GPU_CHECK_TOTAL_S:-450}  # every step together
BENCH_S=${GPU_CHECK_BENCH_S:-270}  # kept for benchmarks/gpu_kernels.py, the last step
TEST_CAP_S=${GPU_CHECK_TEST_CAP_S:-60}  # one pytest file
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SUMMARY=$OUT/summary.txt
export PYTHONUNBUFFERED=1
export DEEPINFER_TEST_DEVICE=cuda  # the kernel tests move their tensors to the GPU (tests/conftest.py)
export MPLBACKEND=Agg
: > "$SUMMARY"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
TEE_PID=$!
START=$SECONDS
FAILED=0

note() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME CAP RESERVE CMD...: run CMD under a timeout of min(CAP, time left - RESERVE); record the outcome
step() {
  local name=$1 cap=$2 reserve=$3; shift 3
  local left=$((TOTAL_S - (SECONDS - START) - reserve))
  local limit=$((cap < left ? cap : left))
  echo; echo "=== $name (limit ${limit}s, $((SECONDS - START))s elapsed) ==="
  if ((limit < 5)); then note "$name: skipped (no time left)"; FAILED=1; return 0; fi
  local t0=$SECONDS rc=0
  timeout -k 5 "$limit" "$@" || rc=$?
  local wall=$((SECONDS - t0))
  if ((rc == 0)); then note "$name: ok (${wall}s)"
  elif ((rc == 124 || rc == 137)); then note "$name: TIMEOUT after ${limit}s"; FAILED=1
  else note "$name: FAILED rc=$rc (${wall}s)"; FAILED=1; fi
  return 0
}

environment() {
  nvidia-smi || echo "nvidia-smi failed"
  "$PY" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs", p.total_memory >> 20, "MiB")
try:
    import triton
    print("triton", triton.__version__)
except ImportError as e:
    print("triton missing:", e)
EOF
  nvcc --version 2>/dev/null | tail -2 || echo "no nvcc"
  "$PY" -m pip list 2>/dev/null || true
}

missing_wheels() {  # the wheels in $WHEELS whose distribution is not installed (one per line)
  "$PY" - "$WHEELS" <<'EOF'
import importlib.metadata as md, re, sys
from pathlib import Path

for whl in sorted(Path(sys.argv[1]).glob("*.whl")):
    name = whl.name.split("-")[0]
    try:
        md.version(re.sub(r"[-_.]+", "-", name))
    except md.PackageNotFoundError:
        print(whl)
EOF
}

install_wheels() {
  if [[ ! -d "$WHEELS" ]]; then echo "no $WHEELS/ directory: nothing to install"; return 0; fi
  local todo; mapfile -t todo < <(missing_wheels)
  echo "${#todo[@]} wheel(s) to install into $SITE: ${todo[*]##*/}"
  ((${#todo[@]})) || return 0
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    --find-links "$WHEELS" "${todo[@]}"
}

import_check() {
  "$PY" - <<'EOF'
import torch
import deepinfer
from deepinfer.kernels import HAS_TRITON, interpreting
import deepinfer.kernels.sparse_attention, deepinfer.kernels.mla_decode, deepinfer.kernels.indexer  # noqa
import deepinfer.kernels.fused_moe, deepinfer.kernels.fp8_gemm  # noqa
print("deepinfer from", deepinfer.__file__, "| HAS_TRITON", HAS_TRITON, "| interpreting", interpreting(),
      "| cuda", torch.cuda.is_available())
try:
    import deepinfer.worker.cuda_graphs as g
    print("worker.cuda_graphs:", sorted(n for n in vars(g) if n[0].isupper()))
except Exception as e:  # noqa: BLE001
    print("worker.cuda_graphs not importable:", type(e).__name__, e)
for mod in ("fastapi", "uvicorn", "xgrammar", "zmq", "msgspec", "jsonschema", "matplotlib", "transformers"):
    try:
        __import__(mod)
        print("import", mod, "ok")
    except Exception as e:  # noqa: BLE001
        print("import", mod, "FAILED:", type(e).__name__, e)
EOF
}

export PY WHEELS SITE OUT
export -f environment missing_wheels install_wheels import_check
tests_reserve=$BENCH_S  # the tests may use what is left before it
step environment 30 "$tests_reserve" bash -c 'environment 2>&1 | tee "$OUT/env.txt"'
step "install wheels" 60 "$tests_reserve" bash -c install_wheels
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"  # the project from the tree, then the carried wheels
step "import check" 60 "$tests_reserve" bash -c import_check

tests=(tests/test_kernels_*.py)
for extra in tests/test_cuda_graphs.py tests/test_static_step.py; do [[ -f "$extra" ]] && tests+=("$extra"); done
for t in "${tests[@]}"; do
  step "pytest $(basename "$t")" "$TEST_CAP_S" "$tests_reserve" \
    "$PY" -m pytest -q -x -p no:cacheprovider --durations=5 "$t"
done

bench=$((TOTAL_S - (SECONDS - START)))  # at least BENCH_S (reserved), more when the tests ended early
step "gpu_kernels.py" "$bench" 0 "$PY" benchmarks/gpu_kernels.py --out "$OUT/gpu_kernels.json" \
  --budget $((bench > 60 ? bench - 30 : bench / 2))

echo
note "total: $((SECONDS - START))s; $( ((FAILED)) && echo 'some steps failed' || echo 'all steps ok')"
echo "=== summary ($SUMMARY) ==="
cat "$SUMMARY"
exec >&- 2>&-
wait "$TEE_PID" 2>/dev/null || true  # the log is complete before the command returns
exit "$FAILED"
