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
#     bench      bench/routed_experts/bench.py, Poise against eager PyTorch (needs python first)
#                -> $OUT/routed_experts_h200.json ($BENCH_ARGS: more arguments); then every
#                .carry/routed_experts_bench* binary, the binaries alternated $ROUNDS times (default 3),
#                -> $OUT/<binary>_r<round>.json, compared by bench/routed_experts/compare.py. One built
#                from the same source against another libpoise (routed_experts_bench_old: see
#                bench/routed_experts/README.md) is carried by scripts/pack_carry.sh --bench --extra FILE.
#     transformers  bench/transformers/bench.py: a Qwen3-30B-A3B-dims model, "poise" against
#                transformers' "grouped_mm" and "eager" -> $OUT/transformers_h200.json, then a
#                gpt-oss-20b-dims model (--family gpt_oss) -> $OUT/transformers_gpt_oss_h200.json
#                (needs python first; $TRANSFORMERS_ARGS: more arguments to both;
#                $TRANSFORMERS_FAMILIES: which, default "qwen3_moe gpt_oss"; at most 3 + 3 minutes)
#     decodecall bench/transformers/decode_call.py: one Experts call at decode (8 tokens), host time per
#                call of "poise" against "grouped_mm" -> $OUT/transformers_decode_call_h200.json (needs python first)
#     decodetrace bench/transformers/decode_trace.py: inside the model's generate(), each MoE call's host
#                time and the synchronizing CUDA calls per step -> $OUT/transformers_decode_trace_h200.json
#                (needs python first)
#     padding    bench/free_padding/bench.py: a context of 8192 tokens serving 1024 (ids -1 padding)
#                against one of 1024 -> $OUT/free_padding_h200.json (needs python first)
#     fp8        bench/fp8_weights/bench.py: poise.prepare_weights refilling FP8 weights in place
#                -> $OUT/fp8_weights_h200.json (needs python first)
#     fp8gemm    .carry/fp8_gemm_bench (the FP8 forward GEMMs against the BF16 ones) -> $OUT/fp8_gemm_h200.json,
#                then bench/fp8_gemm/ceiling.py (dense BF16 / FP8 ceilings) -> $OUT/fp8_ceiling_h200.json
#     fp8fwd     bench/fp8_forward/bench.py: the FP8 forward, poise.routed_experts on an FP8 context vs a
#                BF16 one, eager torch._scaled_grouped_mm and the eager BF16 baseline
#                -> $OUT/fp8_forward_h200.json ($FP8FWD_ARGS: more arguments; needs python first)
#     fp8step    bench/fp8_step/bench.py: forward+backward, poise.routed_experts on an FP8 context vs a BF16
#                one, an eager torch._scaled_grouped_mm FP8 step and the eager BF16 baseline
#                -> $OUT/fp8_step_h200.json ($FP8STEP_ARGS: more arguments; needs python first)
#     fp8train   bench/fp8_training/curve.py --device cuda: 300 training steps of examples/train_moe.py in BF16,
#                FP8 and FP8 with fp8_wgrad -> $OUT/fp8_training_h200.json and .png (needs python first)
#     fuzz       .carry/test_fuzz_gpu with POISE_FUZZ_CASES=${FUZZ_CASES:-800}
#     memcheck   compute-sanitizer memcheck over $MEMCHECK (default: test_ep_balance test_context_fp8)
#     multigpu   torchrun, one process per GPU: bench/multigpu/multigpu_bench.py -> $OUT/multigpu_h200.json
#                ($MULTIGPU_ARGS, e.g. --quick; needs python first)
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
part_bench() {
  PYTHONUNBUFFERED=1 timeout 420 python3 bench/routed_experts/bench.py --out "$OUT/routed_experts_h200.json" \
    --commit "$commit" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; tail -7 "$OUT/bench.log"
  local bins=() bin name round
  for bin in .carry/routed_experts_bench*; do [ -f "$bin" ] && [ -x "$bin" ] && bins+=("$bin"); done
  [ ${#bins[@]} -eq 0 ] && return
  for round in $(seq "${ROUNDS:-3}"); do
    for bin in "${bins[@]}"; do
      name=$(basename "$bin")
      timeout 150 "$bin" "$OUT/${name}_r$round.json" --label "$name" >> "$OUT/routed_experts_bench.log" 2>&1
      echo "$name round $round rc=$?"
    done
  done
  local runs=()
  for bin in "${bins[@]}"; do
    name=$(basename "$bin")
    for round in $(seq "${ROUNDS:-3}"); do [ -f "$OUT/${name}_r$round.json" ] && runs+=("$OUT/${name}_r$round.json"); done
  done
  [ ${#runs[@]} -gt 0 ] && python3 bench/routed_experts/compare.py "${runs[@]}"
}
part_transformers() {
  local family out log
  for family in ${TRANSFORMERS_FAMILIES:-qwen3_moe gpt_oss}; do
    case "$family" in
      qwen3_moe) out=transformers_h200.json log=transformers.log ;;
      *) out=transformers_${family}_h200.json log=transformers_$family.log ;;
    esac
    PYTHONUNBUFFERED=1 timeout 180 python3 bench/transformers/bench.py --family "$family" --out "$OUT/$out" \
      --commit "$commit" ${TRANSFORMERS_ARGS:-} > "$OUT/$log" 2>&1
    echo "transformers $family rc=$?"; grep -v "^\[transformers\]" "$OUT/$log" | tail -6
  done
}
part_decodecall() {
  PYTHONUNBUFFERED=1 timeout 120 python3 bench/transformers/decode_call.py --out "$OUT/transformers_decode_call_h200.json" \
    --commit "$commit" > "$OUT/decode_call.log" 2>&1
  echo "decodecall rc=$?"; grep -E '"(host_us_median|graph_gpu_us|grouped_mm_host_over_poise|poise_rel_l2_vs_grouped_mm)"' "$OUT/decode_call.log"
}
part_decodetrace() {
  PYTHONUNBUFFERED=1 timeout 240 python3 bench/transformers/decode_trace.py --out "$OUT/transformers_decode_trace_h200.json" \
    --commit "$commit" > "$OUT/decode_trace.log" 2>&1
  echo "decodetrace rc=$?"; grep -E '"(decode_step_ms_median|moe_call_host_us_median)"' "$OUT/decode_trace.log"
}
part_padding() {
  PYTHONUNBUFFERED=1 timeout 240 python3 bench/free_padding/bench.py --out "$OUT/free_padding_h200.json" \
    --commit "$commit" > "$OUT/free_padding.log" 2>&1
  echo "padding rc=$?"; tail -12 "$OUT/free_padding.log"
}
part_fp8() {
  PYTHONUNBUFFERED=1 timeout 120 python3 bench/fp8_weights/bench.py --out "$OUT/fp8_weights_h200.json" \
    --commit "$commit" > "$OUT/fp8_weights.log" 2>&1
  echo "fp8 rc=$?"; tail -3 "$OUT/fp8_weights.log"
}
part_fp8gemm() {
  timeout 120 .carry/fp8_gemm_bench --out "$OUT/fp8_gemm_h200.json" 2> "$OUT/fp8_gemm.log"
  echo "fp8gemm rc=$?"; tail -24 "$OUT/fp8_gemm.log"
  timeout 150 python3 bench/fp8_gemm/ceiling.py --out "$OUT/fp8_ceiling_h200.json" 2>&1 | tail -5
}
part_fp8fwd() {
  PYTHONUNBUFFERED=1 timeout 300 python3 bench/fp8_forward/bench.py --out "$OUT/fp8_forward_h200.json" \
    --commit "$commit" ${FP8FWD_ARGS:-} > "$OUT/fp8_forward.log" 2>&1
  echo "fp8fwd rc=$?"; tail -24 "$OUT/fp8_forward.log"
}
part_fp8step() {
  PYTHONUNBUFFERED=1 timeout 300 python3 bench/fp8_step/bench.py --out "$OUT/fp8_step_h200.json" \
    --commit "$commit" ${FP8STEP_ARGS:-} > "$OUT/fp8_step.log" 2>&1
  echo "fp8step rc=$?"; tail -24 "$OUT/fp8_step.log"
}
part_fp8train() {
  PYTHONUNBUFFERED=1 timeout 300 python3 bench/fp8_training/curve.py --device cuda --commit "$commit" \
    --out "$OUT/fp8_training_h200.json" --png "$OUT/fp8_training_h200.png" > "$OUT/fp8_training.log" 2>&1
  echo "fp8train rc=$?"; tail -3 "$OUT/fp8_training.log"
}
part_multigpu() {
  local n; n=$(nvidia-smi -L | wc -l)
  PYTHONUNBUFFERED=1 timeout "${MULTIGPU_TIMEOUT:-400}" python3 -m torch.distributed.run --standalone \
    --nproc_per_node="$n" bench/multigpu/multigpu_bench.py "$OUT/multigpu_h200.json" ${MULTIGPU_ARGS:-} \
    > "$OUT/multigpu.log" 2>&1
  echo "multigpu ($n GPUs) rc=$?"; grep -v "^\[W\|^W1" "$OUT/multigpu.log" | tail -40
}

part_fuzz() {
  (time POISE_FUZZ_CASES=${FUZZ_CASES:-800} timeout 300 .carry/test_fuzz_gpu) > "$OUT/fuzz.log" 2>&1
  echo "fuzz rc=$?"; grep -E "^fuzz: [0-9]+ cases|FAILED|POISE_FUZZ_SEED=.*CASES=1" "$OUT/fuzz.log" | head -8
}
part_memcheck() {  # $MEMCHECK: the test binaries (default: the exact-balance and FP8 layer tests)
  for t in ${MEMCHECK:-test_ep_balance test_context_fp8}; do
    timeout 300 compute-sanitizer --tool memcheck ".carry/$t" > "$OUT/memcheck_$t.log" 2>&1
    echo "memcheck $t rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck_$t.log" | tail -1)"
  done
}

# The device tool returns at most 8 files from $OUT: past that the logs, then the JSON results,
# travel in one archive each.
out_files() { find "$OUT" -maxdepth 1 -type f | wc -l; }
pack_out() {
  if [ "$(out_files)" -gt 8 ] && ls "$OUT"/*.log > /dev/null 2>&1; then
    (cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)
  fi
  if [ "$(out_files)" -gt 8 ] && ls "$OUT"/*.json > /dev/null 2>&1; then
    (cd "$OUT" && tar czf results.tgz ./*.json && rm -f ./*.json)
  fi
}

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests demo python overhead)
for p in "${parts[@]}"; do
  echo "=== $p ($(date +%T))"
  "part_$p"
done
pack_out
