#!/usr/bin/env bash
# Builds and runs the demo: one MoE layer forward+backward (GPU when present, else the CPU reference).
# Extra arguments go to the demo (see `poise_demo --help`), e.g. the DeepSeek-V3 EP8 layer on one H200:
#   ./scripts/run_demo.sh --tokens 4096 --hidden 7168 --intermediate 2048 --experts 256 --topk 8 --ranks 8
# Exit code: 0 PASS (or --check none), 1 FAIL, 2 bad arguments or a layer that does not fit.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
configure_and_build poise_demo
"$BUILD_DIR/apps/demo/poise_demo" "$@"
