#!/usr/bin/env bash
# Packs what a device call needs from this machine's build into .carry/ (see scripts/device_session.sh):
# the C++ GPU test binaries, the demo and, with --bench, the expert-MLP bench library, stripped and in
# one xz tarball (about 4 MB instead of about 58: the device tool carries at most 64 MiB with the tree),
# plus .carry/COMMIT. device_session.sh unpacks .carry/bins.tar.xz before its parts run.
#
#   scripts/pack_carry.sh [--bench] [BUILD_DIR]      (default BUILD_DIR: build-lead)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bench=0
if [ "${1:-}" = "--bench" ]; then bench=1; shift; fi
build=${1:-$root/build-lead}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
cp "$build"/tests/gpu/test_* "$build"/apps/demo/poise_demo "$stage"/
[ "$bench" = 1 ] && cp "$build"/bench/expert_mlp/libpoise_expert_mlp_bench.so "$stage"/
strip --strip-unneeded "$stage"/*
rm -rf "$root/.carry"
mkdir -p "$root/.carry"
(cd "$stage" && tar cf - -- *) | xz -T0 -6 > "$root/.carry/bins.tar.xz"
git -C "$root" rev-parse --short HEAD > "$root/.carry/COMMIT"
du -sh "$root/.carry"
