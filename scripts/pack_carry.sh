#!/usr/bin/env bash
# Packs what a device call needs from this machine's build into .carry/ (see scripts/device_session.sh):
# the C++ GPU test binaries, the demo and, with --bench, routed_experts_bench, fp8_gemm_bench and
# host_overflow_bench,
# stripped and in one xz tarball (about 4 MB instead of about 58: the device tool carries at most
# 64 MiB with the tree), plus
# .carry/COMMIT. --extra FILE (repeatable) packs FILE too, under its own name: e.g. a
# routed_experts_bench_old built against another libpoise (bench/routed_experts/README.md).
# device_session.sh unpacks .carry/bins.tar.xz before its parts run.
#
#   scripts/pack_carry.sh [--bench] [--extra FILE]... [BUILD_DIR]      (default BUILD_DIR: build)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bench=0
extras=()
while [ $# -gt 0 ]; do
  case "$1" in
    --bench) bench=1; shift ;;
    --extra) [ $# -ge 2 ] || { echo "--extra needs a FILE" >&2; exit 2; }
             [ -f "$2" ] || { echo "--extra $2: no such file" >&2; exit 2; }
             extras+=("$2"); shift 2 ;;
    --*) echo "unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
build=${1:-$root/build}
# An object ninja holds no header dependencies for is never rebuilt when a header changes: a struct
# layout changed under it crashes the carried binaries (seen: three .cu objects with "#deps 0" after
# an interrupted build). Rebuild those before packing.
if [ -f "$build/build.ninja" ]; then
  stale=$(cd "$build" && ninja -t deps 2>/dev/null | awk -F: '/#deps 0,/ {print $1}')
  if [ -n "$stale" ]; then
    echo "rebuilding objects without recorded header dependencies:" $stale >&2
    (cd "$build" && rm -f $stale)
  fi
  cmake --build "$build" -j"$(nproc)" >/dev/null
fi
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
cp "$build"/tests/gpu/test_* "$build"/apps/demo/poise_demo "$stage"/
[ "$bench" = 1 ] && cp "$build"/bench/routed_experts_bench "$build"/bench/fp8_gemm_bench "$build"/bench/host_overflow_bench "$stage"/
[ ${#extras[@]} -gt 0 ] && cp "${extras[@]}" "$stage"/
strip --strip-unneeded "$stage"/*
rm -rf "$root/.carry"
mkdir -p "$root/.carry"
(cd "$stage" && tar cf - -- *) | xz -T0 -6 > "$root/.carry/bins.tar.xz"
git -C "$root" rev-parse --short HEAD > "$root/.carry/COMMIT"
du -sh "$root/.carry"
