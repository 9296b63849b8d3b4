#!/usr/bin/env bash
# Installs the PyPI build/test tools (requirements-dev.txt) and checks the system ones. Sourced by the others.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PATH="/usr/local/cuda/bin:${PATH}"
python3 -m pip install -q --disable-pip-version-check -r "$repo/requirements-dev.txt"
hash -r
command -v nvcc >/dev/null || { echo "bootstrap: nvcc not found (CUDA 13 toolkit expected under /usr/local/cuda)" >&2; exit 1; }
# The PyPI cmake lives in the interpreter's scripts folder; prefer it over an older system cmake.
CMAKE="$(python3 -c 'import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, "cmake"))')"
CTEST="$(dirname "$CMAKE")/ctest"
export CMAKE CTEST
BUILD_DIR="${POISE_BUILD_DIR:-$repo/build}"
export BUILD_DIR
configure_and_build() {  # configure_and_build [targets...]
  "$CMAKE" -S "$repo" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
  "$CMAKE" --build "$BUILD_DIR" -j "$(nproc)" ${1:+--target "$@"}
}
