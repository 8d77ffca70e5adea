#!/usr/bin/env bash
# One device check, under 8 minutes on an H200: install, GPU tests, kernel benchmark, other
# benchmarks. Everything lands in $OUT (default bench_out/gpu_check):
#   gpu_check.log        environment, pytest -m gpu, every benchmark's table
#   bench_kernels.json   tools/bench_kernels.py
#   bench_<name>.json    each other tools/bench_<name>.py that ran
# Run from the repository root:  OUT=/some/dir bash tools/gpu_check.sh [--quick]
# Carried wheels (.whl/*.whl, e.g. msgspec, pyzmq, compressed-tensors) are installed first.
set -uo pipefail

OUT=${OUT:-bench_out/gpu_check}
QUICK=${1:-}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: >"$LOG"
START=$(date +%s)
BUDGET_S=450  # leaves margin under the 8-minute target
export PYTHONUNBUFFERED=1
export TRITON_INTERPRET=0  # tests/conftest.py turns the interpreter on unless told otherwise
PY=${PYTHON:-python3}

say() { echo "== $* ($(($(date +%s) - START))s)" | tee -a "$LOG"; }
left() { echo $((BUDGET_S - ($(date +%s) - START))); }

say "install"
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | tee -a "$LOG"
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# specd maps its subpackages from top-level folders; a link farm imports it without pip.
SRC=/tmp/specd_src
rm -rf "$SRC" && mkdir -p "$SRC/specd"
cp specd/__init__.py "$SRC/specd/"
for sub in daemon ipc workers kernels; do ln -s "$PWD/$sub" "$SRC/specd/$sub"; done
export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}"

say "environment"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
print('device', torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs'))" 2>&1 || true
    $PY -c "import specd.kernels.int4_gemm, specd.kernels.tree_attention; print('specd kernels import')"
} 2>&1 | tee -a "$LOG"

say "pytest -m gpu"
timeout 200 $PY -m pytest -m gpu tests -q -rfEs --tb=short -p no:cacheprovider \
    --continue-on-collection-errors 2>&1 | tee -a "$LOG"
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$LOG"

say "bench_kernels"
timeout "$(left)" $PY tools/bench_kernels.py --out "$OUT/bench_kernels.json" --sweep $QUICK 2>&1 | tee -a "$LOG"
echo "bench_kernels exit: ${PIPESTATUS[0]}" | tee -a "$LOG"

for bench in tools/bench_*.py; do
    name=$(basename "$bench" .py)
    [ "$name" = bench_kernels ] && continue
    if [ "$(left)" -lt 30 ]; then
        say "skip $name: under 30 s of the budget left"
        continue
    fi
    say "$name"
    timeout "$(left)" $PY "$bench" --out "$OUT/$name.json" 2>&1 | tee -a "$LOG"
    echo "$name exit: ${PIPESTATUS[0]}" | tee -a "$LOG"
done
say "done"
