#!/usr/bin/env bash
# The tests: installs what is missing, builds, and runs every CTest test (unit, MPI with 2
# and 4 ranks, PyTorch/h5py parity, integration). GPU tests skip cleanly without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j 2 "$@"
