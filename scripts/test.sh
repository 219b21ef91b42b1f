#!/usr/bin/env bash
# The tests: installs what is missing, builds, and runs every CTest test (unit, MPI with 2
# and 4 ranks, PyTorch/h5py parity, integration). GPU tests skip cleanly without a GPU.
# Where nvcc exists the main build is the CUDA configuration; the CPU-only configuration
# (-DSTRATA_CUDA=OFF, what a machine without the toolkit builds) is compiled too, against the
# serial HDF5 (-DHDF5_PREFER_PARALLEL=OFF: a machine without libhdf5-openmpi-dev), and its train
# binary must start and refuse --checkpoint-io parallel with one line, exit 2.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
# The CUDA code must compile wherever nvcc is, also in a folder a job configured without it.
cuda=()
if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then cuda=(-DSTRATA_CUDA=ON); fi
bash scripts/build.sh "${cuda[@]}"
if grep -q "STRATA_CUDA:BOOL=ON" build/CMakeCache.txt; then
  cmake -S . -B build-cpu -DCMAKE_BUILD_TYPE=Release -DSTRATA_CUDA=OFF -DSTRATA_BUILD_TESTS=OFF \
    -DSTRATA_BUILD_BENCH=OFF -DHDF5_PREFER_PARALLEL=OFF >/dev/null
  grep -q "^HDF5_C_LIBRARY_hdf5:FILEPATH=.*/serial/" build-cpu/CMakeCache.txt
  cmake --build build-cpu -j "$(nproc)"
  ./build-cpu/train --help >/dev/null
  set +e
  refused=$(./build-cpu/train --data none.h5 --checkpoint-io parallel 2>&1)
  rc=$?
  set -e
  if [ "$rc" -ne 2 ] || ! grep -q -- "--checkpoint-io parallel needs a parallel HDF5" <<<"$refused"; then
    echo "serial-HDF5 build: expected one line and exit 2 for --checkpoint-io parallel, got exit $rc:"
    echo "$refused"
    exit 1
  fi
fi
source scripts/openblas-env.sh
ctest --test-dir build --output-on-failure -j 2 "$@"
