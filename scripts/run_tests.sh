#!/usr/bin/env bash
# Builds everything (CUDA compiled, not run without a GPU), runs every C++ and Python test that runs on a CPU.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
start=$(date +%s)
configure_and_build
echo "== C++ tests (ctest -L cpu)"
"$CTEST" --test-dir "$BUILD_DIR" -L cpu --output-on-failure -j "$(nproc)"
echo "== C++ package: install, then find_package(Poise) from a separate project (tests/install)"
install_dir="$BUILD_DIR/install-check"
rm -rf "$install_dir"
"$CMAKE" --install "$BUILD_DIR" --prefix "$install_dir/prefix" >/dev/null
"$CMAKE" -S "$repo/tests/install" -B "$install_dir/build" -G Ninja -DCMAKE_PREFIX_PATH="$install_dir/prefix" >/dev/null
"$CMAKE" --build "$install_dir/build" >/dev/null
"$install_dir/build/plan" | grep -q "total device" || { echo "installed package check failed" >&2; exit 1; }
echo "== Python package (pip install .)"
python3 -m pip install -q --disable-pip-version-check --no-build-isolation "$repo"
echo "== Python tests (pytest -m 'not gpu')"
(cd "$repo" && python3 -m pytest -q -m "not gpu" tests/python)
echo "== all CPU tests passed in $(( $(date +%s) - start )) s"
