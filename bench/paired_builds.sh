#!/usr/bin/env bash
# Speed of two builds side by side (a refactor must not slow anything): the same benchmark
# from OLD and NEW alternately, REPS pairs, in bench/lib.sh's one environment; prints each
# pair's samples/s and the median of the paired ratios NEW/OLD.
#   bash bench/paired_builds.sh OLD_BUILD_DIR NEW_BUILD_DIR [DATA.h5]
#   REPS=7 bash bench/paired_builds.sh /work/baseline/build build
# Cases: bench_train_step mlp and cnn (1 rank, 1 thread), bench_ddp_step mlp on 2 ranks (ZeRO 0
# and 1), and the `train` program itself: the CNN, 2 ranks, 60 steps of 64 on DATA (default: a
# synthetic 1x28x28 set made with OLD's strata-data), its last progress line's samples/s.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
old="$1" new="$2" data="${3:-}"
reps="${REPS:-5}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if [[ -z "$data" ]]; then
  data="$(mktemp -d)/img.h5"
  "$old/strata-data" synthetic --out "${data%.h5}" --samples 4096 --shape 1,28,28 --classes 10 >/dev/null
fi
mpi=(mpirun -np 2 --oversubscribe --bind-to none)
rate() {  # rate BUILD CASE: one run's samples/s
  local b="$1"
  case "$2" in
    train-mlp) "${run_env[@]}" "$b/bench_train_step" --model mlp --batch 128 --warmup 10 --steps 20 --windows 5 --threads 1 ;;
    train-cnn) "${run_env[@]}" "$b/bench_train_step" --model cnn --batch 64 --warmup 5 --steps 10 --windows 5 --threads 1 ;;
    ddp-zero0) "${run_env[@]}" "${mpi[@]}" "$b/bench_ddp_step" --model mlp --batch 64 --warmup 10 --steps 20 --windows 5 --threads 1 --zero 0 ;;
    ddp-zero1) "${run_env[@]}" "${mpi[@]}" "$b/bench_ddp_step" --model mlp --batch 64 --warmup 10 --steps 20 --windows 5 --threads 1 --zero 1 ;;
    train-program) "${run_env[@]}" "${mpi[@]}" "$b/train" --model cnn --data "$data" --steps 60 --global-batch 64 \
                     --threads 1 --log-every 30 --lr 0.01 2>&1 | sed -n 's/.*step 60\/60.* \([0-9.]*\) samples\/s.*/RESULT samples_per_s=\1/p' ;;
  esac 2>&1 | sed -n 's/^RESULT .*samples_per_s=\([0-9.]*\).*/\1/p' | tail -1
}
echo "paired builds: old $old, new $new; $reps pairs; $(cpu_model); load $(load_average)"
printf '%-14s %-44s %s\n' case "pairs old/new samples/s" "median new/old"
for c in train-mlp train-cnn ddp-zero0 ddp-zero1 train-program; do
  ratios=() pairs=""
  for ((i = 0; i < reps; i++)); do
    o="$(rate "$old" "$c")" n="$(rate "$new" "$c")"
    pairs+="$(printf '%.0f/%.0f ' "$o" "$n")"
    ratios+=("$(awk -v o="$o" -v n="$n" 'BEGIN {print n / o}')")
  done
  printf '%-14s %-44s %.3f\n' "$c" "$pairs" "$(median "${ratios[@]}")"
done
