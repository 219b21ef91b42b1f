#!/usr/bin/env bash
# The main job: installs what is missing, builds, converts Fashion-MNIST (the Debian
# package's IDX files) to HDF5 shards, and trains the CNN on 2 MPI ranks on the CPU.
# Usage: bash scripts/main-job.sh [extra train flags, e.g. --epochs 1]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
STRATA_TARGETS="train strata-data" bash scripts/build.sh  # only what this job runs

idx=/usr/share/datasets/fashion-mnist
out=data/fashion-mnist
if [ ! -f "$out/test.h5" ]; then
  mkdir -p "$out/train"
  ./build/strata-data convert-idx --images "$idx/train-images-idx3-ubyte.gz" \
    --labels "$idx/train-labels-idx1-ubyte.gz" --out "$out/train/train" --shards 4
  # The test split is normalised with the training split's statistics, as the model saw them.
  ./build/strata-data convert-idx --images "$idx/t10k-images-idx3-ubyte.gz" \
    --labels "$idx/t10k-labels-idx1-ubyte.gz" --out "$out/test" --shards 1 --stats-from "$out/train"
fi

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Debian's OpenBLAS (0.3.21) runs generic SSE3 kernels on CPUs newer than it; on AVX-512 CPUs
# name its AVX-512 ones unless the environment already chose (train warns when it runs generic).
if [ -z "${OPENBLAS_CORETYPE:-}" ] && grep -qw avx512bw /proc/cpuinfo; then export OPENBLAS_CORETYPE=SkylakeX; fi
mpirun -np 2 --oversubscribe --bind-to none ./build/train --config jobs/configs/fashion-mnist.ini "$@"
