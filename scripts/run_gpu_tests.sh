#!/usr/bin/env bash
# The GPU suite (needs an SM90 GPU): ctest label gpu and pytest marker gpu. Logs go to ${OUT:-.}/gpu_tests.log.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${POISE_BUILD_DIR:-$repo/build}"
log="${OUT:-$repo}/gpu_tests.log"
status=0
ctest --test-dir "$BUILD_DIR" -L gpu --output-on-failure 2>&1 | tee "$log" || status=1
if python3 -c "import poise" 2>/dev/null; then
  (cd "$repo" && python3 -m pytest -q -m gpu tests/python 2>&1 | tee -a "$log") || status=1
fi
exit $status
