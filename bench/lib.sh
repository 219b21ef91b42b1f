# Shared by the bench/run_*.sh scripts (sourced, not run): finding a built benchmark, the one
# environment both sides of a comparison run in, medians, and the machine-load report.

# best_blas_core: the fastest OpenBLAS kernel family this CPU runs. Named explicitly because
# OpenBLAS 0.3.21 falls back to its generic Prescott kernels on CPUs newer than it (measured
# on an Emerald Rapids guest, model 207: MLP step 3.7x slower), and the dev/CI environment may
# pin Haswell (AVX2 only) on AVX-512 machines.
best_blas_core() {
  if grep -qw avx512bw /proc/cpuinfo; then echo SkylakeX; elif grep -qw avx2 /proc/cpuinfo; then echo Haswell; fi
}

# The one environment both sides of a comparison run in: the same OpenBLAS kernels (above;
# OPENBLAS_L2_SIZE unset), one thread everywhere. Tests keep the environment as it is.
run_env=(env -u OPENBLAS_L2_SIZE OPENBLAS_CORETYPE="$(best_blas_core)" OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
  MKL_NUM_THREADS=1)

# threads_env N: run_env's words with N threads everywhere instead of one, for multi-threaded
# columns: tenv=($(threads_env 2)).
threads_env() {
  echo env -u OPENBLAS_L2_SIZE OPENBLAS_CORETYPE="$(best_blas_core)" OMP_NUM_THREADS="$1" OPENBLAS_NUM_THREADS="$1" \
    MKL_NUM_THREADS="$1"
}

# find_bench_bin NAME OVERRIDE: the built benchmark NAME (OVERRIDE if set), or exits with a hint.
find_bench_bin() {
  local name="$1" bin="$2" root cand
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  if [[ -z "$bin" ]]; then
    for cand in "$root"/build-bench/"$name" "$root"/build/"$name" "$root"/build*/"$name" "$root"/build*/bench/"$name"; do
      if [[ -x "$cand" ]]; then bin="$cand"; break; fi
    done
  fi
  if [[ -z "$bin" || ! -x "$bin" ]]; then
    echo "$(basename "$0"): $name not found; build it (cmake --build build --target $name) or set its *_BIN variable" >&2
    exit 1
  fi
  echo "$bin"
}

median() { printf '%s\n' "$@" | sort -g | awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }

cpu_model() { lscpu | sed -n 's/^Model name: *//p' | head -1; }
load_average() { cut -d' ' -f1-3 /proc/loadavg; }

# warn_if_busy OWN_LOAD: a warning when the 1-minute load exceeds what this benchmark causes.
warn_if_busy() {
  local load1
  load1=$(cut -d' ' -f1 /proc/loadavg)
  if awk -v l="$load1" -v own="$1" 'BEGIN {exit !(l > own + 0.5)}'; then
    echo "warning: the machine was busy (load $load1 on $(nproc) cores, of which ~$1 is this benchmark); rerun when it is idle for numbers worth quoting"
  fi
}

# Open MPI refuses to run as root unless told; containers and CI run as root.
if [[ "$(id -u)" -eq 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
