#!/usr/bin/env bash
# One device call (see docs/performance.md): GPU tests of the data path, balance and entry points,
# the demo on the GPU, the balance benchmark, then the Python GPU tests. Binaries come prebuilt in
# .carry/ (compiled on the CPU machine); the Python module is built here. Logs and JSON go to $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
B=.carry
run() { echo "== $*"; timeout 240 "$@" > "$OUT/$(basename "$1").log" 2>&1; echo "rc=$?"; tail -4 "$OUT/$(basename "$1").log"; }
run $B/test_context_gpu
run $B/test_ep_balance
run $B/test_ep_layer
run $B/test_ep_transport
run $B/poise_demo
run $B/balance_bench "$OUT/balance_h200.json" 16 3
echo "== python"
(CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/pip.log" 2>&1 && \
  timeout 200 python3 -m pytest -q -m gpu tests/python > "$OUT/pytest_gpu.log" 2>&1; echo "rc=$?"; tail -5 "$OUT/pytest_gpu.log") || tail -5 "$OUT/pip.log"
