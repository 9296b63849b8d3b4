#!/usr/bin/env bash
# v21d: dynamic tile order (1-CTA launches) against the static order, one device call.
set -uo pipefail
export PYTHONUNBUFFERED=1
echo "=== correctness + chain: dynamic, POISE_SM90_CLUSTER=1"
POISE_SM90_CLUSTER=1 timeout 200 python3 bench/expert_mlp/bench_expert_mlp.py --lib .carry/libpoise_expert_mlp_bench_dynamic.so \
  --out "$OUT/dyn_cluster1.json" --skews 1 --commit v21d-dynamic-cluster1 2>&1 | tee "$OUT/v21d_bench.log" | grep -v "^$" | tail -12
echo "=== ncu DRAM"
MEM_RUNS="dynamic:deepseek_v3_ep8_rank:fprop_w13:1 dynamic:deepseek_v3_ep8_rank:dgrad_w2:- dynamic:deepseek_v3_ep8_rank:fprop_w2:1 dynamic:deepseek_v3_ep8_rank:dgrad_w13:1 base:deepseek_v3_ep8_rank:dgrad_w13:1 base:deepseek_v3_ep8_rank:dgrad_w13:- dynamic:qwen3_30b_a3b:dgrad_w2:-" \
  bash scripts/device_session.sh ncu_mem
grep -E "###|dram__bytes_read|duration|hit_rate" "$OUT/ncu_mem.log"
echo "=== timeline (dynamic, 1-CTA)"
CLUSTERS=1 bash scripts/device_session.sh timeline 2>&1 | grep -E "tiles"
echo "=== power probe"
for spec in base:- base:1 dynamic:1; do
  lib=${spec%%:*}; c=${spec##*:}; [ "$c" = "-" ] && c=""
  echo "[$lib cluster=${c:-default}]"
  POISE_SM90_CLUSTER=$c timeout 200 python3 bench/expert_mlp/power_probe.py ".carry/libpoise_expert_mlp_bench_$lib.so" /dev/null 2.0 \
    deepseek_v3_ep8_rank,qwen3_30b_a3b poise 2>&1 | grep -v "^$"
done | tee "$OUT/v21d_probe.log"
