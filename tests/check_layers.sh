#!/usr/bin/env bash
# Fails when an #include crosses DESIGN.md's "Layers of the code": a folder of src/ includes
# only itself and the folders above it (core < layers < parallel < io < train); nothing outside
# src/core includes core's private kernel headers (core/ops/...; tests may); src/train includes no
# transport (parallel/comm/) and not the watchdog; core and layers include no MPI or HDF5 header. Prints file:line and the rule broken for each offence.
set -uo pipefail
cd "$(dirname "$0")/.."
order=(core layers parallel io train)
fail=0
offence() {
  echo "$1: $2"
  fail=1
}
rank() {
  for i in "${!order[@]}"; do [[ ${order[$i]} == "$1" ]] && echo "$i"; done
}
quoted='^[[:space:]]*#[[:space:]]*include[[:space:]]*"'

# 1. Downward only: src/<dir> may include "<above>/..." but nothing of a folder below it.
for dir in "${order[@]}"; do
  while IFS=: read -r file line text; do
    target=$(sed -E "s|.*include[[:space:]]*\"([a-z]+)/.*|\1|" <<<"$text")
    if (($(rank "$target") > $(rank "$dir"))); then
      offence "$file:$line" "src/$dir must not include $target/ (may include: ${order[*]:0:$(($(rank "$dir") + 1))})"
    fi
  done < <(grep -rnE "$quoted(core|layers|parallel|io|train)/" "src/$dir")
done

# 2. Core's kernels (ops/cpu, ops/cuda and their helpers) are core's own; the rest uses core/ops.hpp.
while IFS=: read -r file line _; do
  offence "$file:$line" "only src/core (and tests) may include core's private core/ops/ headers; use core/ops.hpp (kernels) or core/cuda/ (CUDA runtime)"
done < <(grep -rnE "${quoted}core/ops/" src bench tools | grep -v '^src/core/')

# 3. The app wires owners and never reaches a transport: src/train includes nothing of
#    parallel/comm/ (communicators, shared memory, MPI and NCCL) nor the watchdog's internals.
while IFS=: read -r file line _; do
  offence "$file:$line" "src/train must not include parallel/comm/ or parallel/runtime/watchdog.hpp (ask the stage engine, the process grid or the runtime)"
done < <(grep -rnE "${quoted}parallel/(comm/|runtime/watchdog\.hpp)" src/train)

# 4. Core and layers know no MPI and no files.
while IFS=: read -r file line _; do
  offence "$file:$line" "src/core and src/layers must not include MPI or HDF5 headers"
done < <(grep -rnE '^[[:space:]]*#[[:space:]]*include[[:space:]]*<(mpi|hdf5)\.h>' src/core src/layers)

((fail)) && echo "include layering: violations of DESIGN.md's 'Layers of the code' above" && exit 1
echo "include layering: src/ follows DESIGN.md's table"
