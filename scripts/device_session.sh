#!/usr/bin/env bash
# One device call (see docs/performance.md): parts of the GPU work, C++ binaries prebuilt on the CPU
# machine and carried in .carry/ (scripts/pack_carry.sh), the Python module built here. Logs and JSON
# go to $OUT.
#
#   scripts/device_session.sh [part ...]     parts (default: tests demo python overhead)
#     tests      every .carry/test_* binary (the C++ GPU suite) + the HGMMA count
#     demo       .carry/poise_demo on the GPU
#     python     pip install the module here, pytest -m gpu
#     overhead   bench/python_overhead.py (needs python first)
#     balance    .carry/balance_bench -> $OUT/balance_h200.json
#     ep         .carry/ep_bench -> $OUT/ep_h200.json
#     mlp        bench/expert_mlp/bench_expert_mlp.py with .carry/libpoise_expert_mlp_bench.so
#                ($MLP_REPEATS: time each case's four blocks that many times, medians recorded;
#                $MLP_ARGS: more arguments, e.g. --back-to-back)
#     chain      bench/expert_mlp/profile_chain.py: each step of the default and the fused chain
#                ($CHAIN_SHAPES, default both shapes) -> $OUT/chain.log
#     multigpu   torchrun, one process per GPU: bench/multigpu/multigpu_bench.py -> $OUT/multigpu_h200.json
#                ($MULTIGPU_ARGS, e.g. --quick; needs python first)
#     gemm_only  the six GEMMs alone, .carry/libpoise_expert_mlp_bench*.so (one line per build and
#                CTA cluster size in $CLUSTERS, e.g. "1 2"; default: the built-in choice), the builds
#                interleaved $ROUNDS times (default 1; A/B comparisons: 3, the card drifts ~3% per call)
#     ncu        ncu source-level stall sampling of single GEMMs (see part_ncu)
#     ncu_mem    ncu DRAM / L2 metrics of single GEMM launches (see part_ncu_mem)
#     probe      power_probe.py A/B of every carried bench library (see part_probe)
#     timeline   profile_gemm.py timeline: start spread of operand-sharing tiles (see part_timeline)
#     l2probe    .carry/l2_partition_probe (build-lead/bench/l2_partition_probe): the SM -> L2 partition
#                map, copies of far lines, one group's SMs vs both groups reading one buffer -> $OUT
#     phases     profile_gemm.py phases for every .carry/libpoise_expert_mlp_bench*phases*.so
#                (scripts/build_bench_variant.sh NAME -DPOISE_PHASE_PROFILE=1) at both shapes
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NCCL_DIR=$(python3 -c "import nvidia.nccl as n; print(list(n.__path__)[0])" 2>/dev/null)
export LD_LIBRARY_PATH="${NCCL_DIR:+$NCCL_DIR/lib:}${LD_LIBRARY_PATH:-}"
# scripts/pack_carry.sh packs the binaries into one tarball; unpack it once.
if [ -f .carry/bins.tar.xz ] && [ ! -f .carry/.unpacked ]; then
  tar xJf .carry/bins.tar.xz -C .carry && touch .carry/.unpacked
fi
commit=$(cat .carry/COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
export POISE_COMMIT="$commit"

part_tests() {
  local log="$OUT/gpu_suite.log"
  for t in .carry/test_*; do
    echo "== $t" >> "$log"
    timeout 150 "$t" >> "$log" 2>&1; local rc=$?
    echo "$t rc=$rc $(grep -E '^\[  (PASSED|FAILED) ' "$log" | tail -1)"
  done
  for cluster in 1 4; do
    echo "== .carry/test_expert_mlp with POISE_SM90_CLUSTER=$cluster" >> "$log"
    POISE_SM90_CLUSTER=$cluster timeout 150 .carry/test_expert_mlp >> "$log" 2>&1
    echo "test_expert_mlp (POISE_SM90_CLUSTER=$cluster) rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$log" | tail -1)"
  done
  grep -E '^\[  FAILED  \]' "$log" | head -20
  echo "HGMMA instructions in test_expert_mlp: $(cuobjdump --dump-sass .carry/test_expert_mlp | grep -c HGMMA)" | tee -a "$log"
}
part_demo() { timeout 60 .carry/poise_demo > "$OUT/demo.log" 2>&1; echo "demo rc=$? $(tail -1 "$OUT/demo.log")"; }
part_python() {
  local flags=()
  [ -n "$NCCL_DIR" ] && flags=(-C "cmake.define.POISE_NCCL_INCLUDE=$NCCL_DIR/include" -C "cmake.define.POISE_NCCL_LIBRARY=$NCCL_DIR/lib/libnccl.so.2")
  CMAKE_BUILD_PARALLEL_LEVEL=16 timeout 200 python3 -m pip install -q --no-build-isolation --no-deps "${flags[@]}" . > "$OUT/pip.log" 2>&1 || { echo "pip failed"; tail -20 "$OUT/pip.log"; }
  timeout 150 python3 -m pytest -q -m gpu tests/python > "$OUT/pytest_gpu.log" 2>&1; echo "pytest rc=$?"; tail -8 "$OUT/pytest_gpu.log"
}
part_overhead() {
  PYTHONUNBUFFERED=1 timeout 150 python3 bench/python_overhead.py "$OUT/python_overhead_h200.json" > "$OUT/python_overhead.log" 2>&1
  echo "overhead rc=$?"; tail -12 "$OUT/python_overhead.log"
}
part_balance() {
  timeout 240 .carry/balance_bench "$OUT/balance_h200.json" 16 7 > "$OUT/balance.log" 2>&1; echo "balance rc=$?"
  grep -E "^(exact|off)" "$OUT/balance.log"
}
part_ep() { timeout 120 .carry/ep_bench "$OUT/ep_h200.json" > "$OUT/ep.log" 2>&1; echo "ep rc=$?"; tail -5 "$OUT/ep.log"; }
part_mlp() {
  PYTHONUNBUFFERED=1 timeout $((240 + 160 * ${MLP_REPEATS:-1})) python3 bench/expert_mlp/bench_expert_mlp.py --lib .carry/libpoise_expert_mlp_bench.so \
    --out "$OUT/expert_mlp_h200.json" --commit "$commit" --repeats "${MLP_REPEATS:-1}" ${MLP_ARGS:-} > "$OUT/mlp.log" 2>&1
  echo "mlp rc=$?"; tail -20 "$OUT/mlp.log"
}
part_chain() {
  local shape
  for shape in ${CHAIN_SHAPES:-deepseek_v3_ep8_rank qwen3_30b_a3b}; do
    PYTHONUNBUFFERED=1 timeout 150 python3 bench/expert_mlp/profile_chain.py .carry/libpoise_expert_mlp_bench.so "$shape" 2>&1
  done | tee -a "$OUT/chain.log"
}
# The carried bench libraries built for timing (not the phases / timeline profiling builds).
timing_libs() {
  local lib
  for lib in .carry/libpoise_expert_mlp_bench*.so; do
    [[ "$lib" == *phases* || "$lib" == *timeline* ]] || echo "$lib"
  done
}
part_gemm_only() {
  for round in $(seq "${ROUNDS:-1}"); do
  for lib in $(timing_libs); do
    for cluster in ${CLUSTERS:-default}; do
      local label; label="$(basename "$lib" .so) cluster=$cluster"
      [ "$cluster" = default ] && cluster=""
      POISE_SM90_CLUSTER=$cluster PYTHONUNBUFFERED=1 timeout 120 python3 bench/expert_mlp/bench_expert_mlp.py --lib "$lib" \
        --out /dev/null --skews "${GEMM_SKEWS:-1}" --gemm-only "$label" 2>&1 | tee -a "$OUT/gemm_only.log" | grep -v "^$"
    done
  done
  done
}
part_phases() {
  for lib in .carry/libpoise_expert_mlp_bench*phases*.so; do
    for shape in qwen3_30b_a3b deepseek_v3_ep8_rank; do
      echo "[$(basename "$lib" .so)]"
      PYTHONUNBUFFERED=1 timeout 100 python3 bench/expert_mlp/profile_gemm.py "$lib" "$shape" phases 20 2>&1
    done
  done | tee -a "$OUT/phases.log"
}
# ncu source-level warp-state sampling of single GEMMs ($NCU_SHAPE, default Qwen3; $NCU_GEMMS,
# default the four short-K ones; $NCU_LIB, default the base build): per GEMM the SASS with its stall
# samples as gzipped CSV ($OUT/ncu_src_LIBTAG_SHAPE_GEMM.csv.gz), the sections' text in $OUT/ncu.log.
part_ncu() {
  local lib=${NCU_LIB:-.carry/libpoise_expert_mlp_bench_base.so} shape=${NCU_SHAPE:-qwen3_30b_a3b}
  local tag; tag=$(basename "$lib" .so); tag=${tag#libpoise_expert_mlp_bench}; tag=${tag#_}
  ncu --version | tail -1 >> "$OUT/ncu.log"
  for gemm in ${NCU_GEMMS:-dgrad_w2 fprop_w13 wgrad_w13 fprop_w2}; do
    local rep=/tmp/ncu_${tag}_${shape}_${gemm}
    timeout 240 ncu --clock-control none --kernel-name regex:grouped_gemm --launch-skip 8 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section SourceCounters --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --import-source no -f -o "$rep" python3 bench/expert_mlp/profile_gemm.py "$lib" "$shape" "$gemm" 3 >> "$OUT/ncu.log" 2>&1
    echo "ncu $tag $shape $gemm rc=$?"
    ncu -i "$rep.ncu-rep" --print-details all >> "$OUT/ncu.log" 2>&1
    ncu -i "$rep.ncu-rep" --page source --csv --print-source sass 2>> "$OUT/ncu.log" | gzip > "$OUT/ncu_src_${tag}_${shape}_${gemm}.csv.gz"
  done
}
# DRAM bytes, L2 hit rate and what the L2 throughput is made of, per GEMM launch, for the
# combinations in $MEM_RUNS ("lib:shape:gemm:cluster ...", lib a tag of .carry/libpoise_expert_mlp_bench_TAG.so,
# cluster "-" for the built-in choice): $OUT/ncu_mem.log.
part_ncu_mem() {
  local run lib shape gemm cluster
  for run in $MEM_RUNS; do
    IFS=: read -r lib shape gemm cluster <<< "$run"
    [ "$cluster" = "-" ] && cluster=""
    echo "### $run" >> "$OUT/ncu_mem.log"
    POISE_SM90_CLUSTER=$cluster timeout 120 ncu --clock-control none --kernel-name regex:grouped_gemm --launch-skip 8 --launch-count 1 \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex_op_read.sum,breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed \
      python3 bench/expert_mlp/profile_gemm.py ".carry/libpoise_expert_mlp_bench_$lib.so" "$shape" "$gemm" 3 2>&1 \
      | grep -vE "^==PROF==|^ *$|Warning|runs after" >> "$OUT/ncu_mem.log"
    echo "ncu_mem $run rc=$?"
  done
}
part_probe() {
  # power probe of every .carry/libpoise_expert_mlp_bench*.so ($PROBE_SHAPES, $PROBE_FILTER), $ROUNDS rounds
  # $PROBE_ENVS: space-separated VAR=value settings, each run in turn ("_": none), e.g. A/B of a knob.
  local spec
  for round in $(seq "${ROUNDS:-1}"); do
    for lib in $(timing_libs); do
      for spec in ${PROBE_ENVS:-_}; do
        echo "[$(basename "$lib" .so) round $round${PROBE_ENVS:+ env $spec}]"
        [ "$spec" = _ ] && spec=""
        env $spec PYTHONUNBUFFERED=1 timeout 200 python3 bench/expert_mlp/power_probe.py "$lib" /dev/null "${PROBE_SECONDS:-2.0}" \
          "${PROBE_SHAPES:-qwen3_30b_a3b,deepseek_v3_ep8_rank}" "${PROBE_FILTER:-poise}" 2>&1 | grep -v "^$"
      done
    done
  done | tee -a "$OUT/probe.log"
}
# timeline: profile_gemm.py timeline for every .carry/libpoise_expert_mlp_bench*timeline*.so
# (-DPOISE_TILE_TIMELINE=1) at both shapes, for each CTA cluster size in $CLUSTERS (default: built-in).
part_timeline() {
  for lib in .carry/libpoise_expert_mlp_bench*timeline*.so; do
    for cluster in ${CLUSTERS:-default}; do
      for shape in qwen3_30b_a3b deepseek_v3_ep8_rank; do
        echo "[$(basename "$lib" .so) cluster=$cluster]"
        POISE_SM90_CLUSTER=${cluster/default/} PYTHONUNBUFFERED=1 timeout 100 python3 bench/expert_mlp/profile_gemm.py "$lib" "$shape" timeline 2>&1
      done
    done
  done | tee -a "$OUT/timeline.log"
}
part_l2probe() {
  local run
  for run in 1 2; do
    timeout 120 .carry/l2_partition_probe "$OUT/l2_partition_$run.csv" > "$OUT/l2_partition_$run.log" 2>&1
    echo "l2probe run $run rc=$?"; cat "$OUT/l2_partition_$run.log"
    python3 bench/l2_partition/analyze.py "$OUT/l2_partition_$run.csv" 2>&1 | grep -v "^group" | tail -6
  done
}
part_multigpu() {
  local n; n=$(nvidia-smi -L | wc -l)
  PYTHONUNBUFFERED=1 timeout "${MULTIGPU_TIMEOUT:-400}" python3 -m torch.distributed.run --standalone \
    --nproc_per_node="$n" bench/multigpu/multigpu_bench.py "$OUT/multigpu_h200.json" ${MULTIGPU_ARGS:-} \
    > "$OUT/multigpu.log" 2>&1
  echo "multigpu ($n GPUs) rc=$?"; grep -v "^\[W\|^W1" "$OUT/multigpu.log" | tail -40
}

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests demo python overhead)
for p in "${parts[@]}"; do
  echo "=== $p ($(date +%T))"
  "part_$p"
done
