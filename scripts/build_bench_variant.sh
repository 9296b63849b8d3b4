#!/usr/bin/env bash
# Builds a variant of the expert-MLP bench library for A/B runs on the device (gemm_only part of
# scripts/device_session.sh): the SM90 kernels compiled with extra flags (e.g. -DPOISE_STAGING_RING=2)
# and linked like build-lead's libpoise_expert_mlp_bench.so, into .carry/libpoise_expert_mlp_bench_NAME.so.
#   scripts/build_bench_variant.sh NAME [nvcc flags...]     (after cmake --build build-lead)
set -euo pipefail
name=$1; shift
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build-lead}
tmp=$(mktemp -d)
nvcc=/usr/local/cuda/bin/nvcc
common=(-I"$root/include" -I"$root/src" -O3 -DNDEBUG -std=c++20 -Xcompiler=-fPIC
        -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -lineinfo "$@")
"$nvcc" "${common[@]}" -x cu -c "$root/src/kernels/sm90/expert_mlp.cu" -o "$tmp/expert_mlp.o"
"$nvcc" "${common[@]}" -x cu -c "$root/bench/expert_mlp/bench_lib.cu" -o "$tmp/bench_lib.o"
obj=$build/src/kernels/sm90/CMakeFiles/poise_kernels_sm90.dir
mkdir -p "$root/.carry"
c++ -fPIC -O3 -shared -o "$root/.carry/libpoise_expert_mlp_bench_$name.so" "$tmp/bench_lib.o" "$tmp/expert_mlp.o" \
  "$obj/device_info.cu.o" "$obj/tensor_map.cpp.o" "$build/src/libpoise_core.a" \
  -L/usr/local/cuda/targets/x86_64-linux/lib /usr/local/lib/libcudart_static.a -ldl -lrt -lpthread
rm -rf "$tmp"
echo ".carry/libpoise_expert_mlp_bench_$name.so"
