#!/usr/bin/env bash
# The tests: installs what is missing, builds, and runs every CTest test (unit, MPI with 2
# and 4 ranks, PyTorch/h5py parity, integration). GPU tests skip cleanly without a GPU.
# Where nvcc exists the main build is the CUDA configuration; the CPU-only configuration
# (-DSTRATA_CUDA=OFF, what a machine without the toolkit builds) is compiled too, and its
# train binary must start.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
if grep -q "STRATA_CUDA:BOOL=ON" build/CMakeCache.txt; then
  cmake -S . -B build-cpu -DCMAKE_BUILD_TYPE=Release -DSTRATA_CUDA=OFF -DSTRATA_BUILD_TESTS=OFF \
    -DSTRATA_BUILD_BENCH=OFF >/dev/null
  cmake --build build-cpu -j "$(nproc)"
  ./build-cpu/train --help >/dev/null
fi
source scripts/openblas-env.sh
ctest --test-dir build --output-on-failure -j 2 "$@"
