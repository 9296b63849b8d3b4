#!/usr/bin/env bash
# Builds and runs the demo: one MoE layer forward+backward (GPU when present, else the CPU reference).
# Extra arguments go to the demo (see `poise_demo --help`).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
configure_and_build poise_demo
"$BUILD_DIR/apps/demo/poise_demo" "$@"
