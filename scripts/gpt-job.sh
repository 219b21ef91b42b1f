#!/usr/bin/env bash
# The GPT job: installs what is missing, builds train, strata-data and strata-sample (to sample
# from the result, docs/gpt.md), tokenizes Debian's
# fortunes (byte-level BPE, 2048 ids) once into data/fortunes/, and trains a small GPT on 2 MPI
# ranks on the CPU (docs/gpt.md).
# Usage: bash scripts/gpt-job.sh [--config FILE] [extra train flags, e.g. --steps 100]
# (--config first: another model on the same text, e.g. jobs/configs/llama-fortunes.ini)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
STRATA_TARGETS="train strata-data strata-sample" bash scripts/build.sh  # the programs this job and its docs run

# The plain-text fortune files of the fortunes and fortunes-min packages, sorted: not the
# .dat indexes, not the .u8 links to the same files, not the off/ subfolder (fortunes-off).
src=/usr/share/games/fortunes
out=data/fortunes
if [ ! -f "$out/fortunes-val.h5" ]; then
  mapfile -t files < <(find "$src" -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' | sort)
  ./build/strata-data tokenize --input "${files[@]}" --out "$out/fortunes" \
    --tokenizer bpe --vocab-size 2048 --val-fraction 0.05
fi

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Debian's OpenBLAS (0.3.21) runs generic SSE3 kernels on CPUs newer than it; on AVX-512 CPUs
# name its AVX-512 ones unless the environment already chose (train warns when it runs generic).
if [ -z "${OPENBLAS_CORETYPE:-}" ] && grep -qw avx512bw /proc/cpuinfo; then export OPENBLAS_CORETYPE=SkylakeX; fi
config=jobs/configs/gpt-fortunes.ini
if [ "${1:-}" = --config ]; then config=$2; shift 2; fi
mpirun -np 2 --oversubscribe --bind-to none ./build/train --config "$config" "$@"
