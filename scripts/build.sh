#!/usr/bin/env bash
# Configures and builds Strata in ./build (Release). Extra arguments go to cmake, e.g.
# -DSTRATA_CUDA=OFF, or -DSTRATA_MARCH=native for a binary tuned to (and needing) this CPU. CUDA kernels are built when nvcc is found (on PATH or /usr/local/cuda), except
# for a job's build on a machine without a GPU.
# STRATA_TARGETS="train strata-data" builds only those (the jobs: not the tests and benchmarks).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
# A job's build (STRATA_TARGETS) on a machine without a GPU leaves out the CUDA kernels it would
# never run, unless the folder is configured already (its choice stands) or the caller chose.
if [ -n "${STRATA_TARGETS:-}" ] && [ ! -f build/CMakeCache.txt ] && ! nvidia-smi -L >/dev/null 2>&1 &&
  [[ " $* " != *" -DSTRATA_CUDA="* ]]; then
  echo "no GPU here: building ${STRATA_TARGETS} without the CUDA kernels (scripts/test.sh builds them)"
  set -- -DSTRATA_CUDA=OFF "$@"
fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "$@"
# shellcheck disable=SC2086  # a list of target names
cmake --build build -j "$(nproc)" ${STRATA_TARGETS:+--target $STRATA_TARGETS}
