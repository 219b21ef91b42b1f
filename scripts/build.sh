#!/usr/bin/env bash
# Configures and builds Strata in ./build (Release). Extra arguments go to cmake, e.g.
# -DSTRATA_CUDA=OFF. CUDA kernels are built when nvcc is found (on PATH or /usr/local/cuda).
# STRATA_TARGETS="train strata-data" builds only those (the jobs: not the tests and benchmarks).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "$@"
# shellcheck disable=SC2086  # a list of target names
cmake --build build -j "$(nproc)" ${STRATA_TARGETS:+--target $STRATA_TARGETS}
