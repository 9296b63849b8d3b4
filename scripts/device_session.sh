#!/usr/bin/env bash
# One device call (see docs/performance.md): the whole GPU suite (C++ binaries prebuilt on the CPU
# machine and carried in .carry/, the Python module built here), the demo on the GPU and the Python
# overhead benchmark. Logs and JSON go to $OUT (at most 8 files come back).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NCCL_DIR=$(python3 -c "import nvidia.nccl as n; print(list(n.__path__)[0])" 2>/dev/null)
export LD_LIBRARY_PATH="${NCCL_DIR:+$NCCL_DIR/lib:}${LD_LIBRARY_PATH:-}"
log="$OUT/gpu_suite.log"
for t in .carry/test_*; do
  echo "== $t" | tee -a "$log"
  timeout 120 "$t" >> "$log" 2>&1; rc=$?
  echo "$t rc=$rc $(grep -E '^\[  (PASSED|FAILED) ' "$log" | tail -1)"
done
echo "HGMMA instructions in test_expert_mlp: $(cuobjdump --dump-sass .carry/test_expert_mlp | grep -c HGMMA)" | tee -a "$log"
timeout 60 .carry/poise_demo > "$OUT/demo.log" 2>&1; echo "demo rc=$? $(tail -1 "$OUT/demo.log")"
echo "== python module"
flags=()
[ -n "$NCCL_DIR" ] && flags=(-C "cmake.define.POISE_NCCL_INCLUDE=$NCCL_DIR/include" -C "cmake.define.POISE_NCCL_LIBRARY=$NCCL_DIR/lib/libnccl.so.2")
CMAKE_BUILD_PARALLEL_LEVEL=16 timeout 200 python3 -m pip install -q --no-build-isolation --no-deps "${flags[@]}" . > "$OUT/pip.log" 2>&1 || { echo "pip failed"; tail -20 "$OUT/pip.log"; }
timeout 150 python3 -m pytest -q -m gpu tests/python > "$OUT/pytest_gpu.log" 2>&1; echo "pytest rc=$?"; tail -8 "$OUT/pytest_gpu.log"
PYTHONUNBUFFERED=1 timeout 75 python3 bench/python_overhead.py "$OUT/python_overhead_h200.json" > "$OUT/python_overhead.log" 2>&1; echo "overhead rc=$?"; tail -12 "$OUT/python_overhead.log"
