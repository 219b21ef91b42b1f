#!/usr/bin/env bash
# Strata DDP vs PyTorch DDP (gloo): data-parallel training-step throughput, side by side in one
# invocation. For the mlp (784-1024-1024-10, batch 128 per rank) and the cnn (batch 64 per
# rank), SGD momentum 0.9, one thread per process, the same environment for both sides, it runs
#   strata 1 rank  (bench_ddp_step)            torch 1 process, no DDP (torch_ddp_step.py --nproc 1)
#   strata 2 ranks (mpirun -np 2 bench_ddp_step) torch DDP gloo, 2 processes (--nproc 2)
# alternating which side goes first, REPS times, and prints the medians: samples/s, scaling
# efficiency (= 2-rank samples/s / (2 x 1-rank samples/s)), Strata DDP / torch DDP, and
# Strata's step-time breakdown at 2 ranks (compute, exposed communication).
#
#   cmake --build build --target bench_ddp_step
#   bash bench/run_ddp_vs_torch.sh               # REPS=5 STEPS=20 WINDOWS=7 WARMUP=20 BUCKET_MB=25
#   STRATA_DDP_BIN=build-lead/bench_ddp_step BUCKET_MB=2 bash bench/run_ddp_vs_torch.sh
#
# BUCKET_MB is Strata's --bucket-mb; torch keeps DDP's default bucket_cap_mb=25 unless
# TORCH_BUCKET_MB is set. Environment for BOTH sides: the same OpenBLAS kernels (bench/lib.sh),
# OMP/OpenBLAS/MKL one thread. Strata runs four times at 2 ranks: as train does (gradients in shared
# memory, all-reduce in place), with --no-shared-memory (all-reduce through MPI's ring), with
# --zero 1 (train's ZeRO 1: reduce to the shards' owners, sharded SGD, parameter all-gather), and
# with --no-sync (no communication at all: the scaling this machine allows two busy ranks).
# Scaling is printed twice: from the medians, and as the median of each repetition's ratio
# (its runs back to back, so load that drifts during the benchmark cancels out).
# MPI: --oversubscribe --bind-to none (set OMPI_ALLOW_RUN_AS_ROOT=1
# OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 when running as root).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPS="${REPS:-5}"
STEPS="${STEPS:-20}"
WINDOWS="${WINDOWS:-7}"
WARMUP="${WARMUP:-20}"
BUCKET_MB="${BUCKET_MB:-25}"
TORCH_BUCKET_MB="${TORCH_BUCKET_MB:-25}"
PYTHON="${PYTHON:-/usr/bin/python3}"
MPIRUN="${MPIRUN:-mpirun}"
MODELS="${MODELS:-mlp:128 cnn:64}"

source "$here/lib.sh"
bin="$(find_bench_bin bench_ddp_step "${STRATA_DDP_BIN:-}")"
common=(--warmup "$WARMUP" --steps "$STEPS" --windows "$WINDOWS" --threads 1)
mpi=("$MPIRUN" -np 2 --oversubscribe --bind-to none)

# Prints the RESULT line of one run. torch's gloo rendezvous can (rarely) hang: every run has a
# time limit and is retried once.
result() {
  local out attempt
  for attempt in 1 2; do
    if out="$(timeout 300 "${run_env[@]}" "$@" 2>&1)"; then
      local line
      line=$(grep '^RESULT ' <<<"$out" || true)
      if [[ -n "$line" ]]; then echo "$line"; return; fi
    fi
    echo "run_ddp_vs_torch.sh: attempt $attempt failed: $*" >&2
    echo "$out" | tail -5 >&2
  done
  exit 1
}
field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$2"; }

torch_version="$("${run_env[@]}" "$PYTHON" -c 'import torch; print(torch.__version__)')"
cpu="$(cpu_model)"
echo "Strata DDP vs PyTorch DDP (gloo), 1 thread per process: $REPS alternating repetitions x ($WARMUP warm-up steps, median of $WINDOWS windows of $STEPS steps)"
echo "strata: $bin (--bucket-mb $BUCKET_MB), $("$MPIRUN" --version 2>/dev/null | head -1)"
echo "torch:  $torch_version ($PYTHON), DDP bucket_cap_mb $TORCH_BUCKET_MB"
echo "cpu:    $cpu, $(nproc) cores; load average before: $(load_average)"
echo

rows=() brows=()
for config in $MODELS; do
  model="${config%%:*}" batch="${config##*:}"
  s1=() s2=() s3=() s4=() s5=() paired=() t1=() t2=() comp=() expo=() stp=() ar=() expo3=() stp3=()
  for ((r = 1; r <= REPS; ++r)); do
    strata_side() {
      local a b c d e
      a=$(result "$bin" --model "$model" --batch "$batch" --bucket-mb "$BUCKET_MB" "${common[@]}")
      b=$(result "${mpi[@]}" "$bin" --model "$model" --batch "$batch" --bucket-mb "$BUCKET_MB" "${common[@]}")
      c=$(result "${mpi[@]}" "$bin" --model "$model" --batch "$batch" --bucket-mb "$BUCKET_MB" "${common[@]}" \
          --no-shared-memory)
      d=$(result "${mpi[@]}" "$bin" --model "$model" --batch "$batch" --bucket-mb "$BUCKET_MB" "${common[@]}" --no-sync)
      e=$(result "${mpi[@]}" "$bin" --model "$model" --batch "$batch" --bucket-mb "$BUCKET_MB" "${common[@]}" --zero 1)
      s4+=("$(field samples_per_s "$d")"); s5+=("$(field samples_per_s "$e")")
      paired+=("$(awk -v a="$(field samples_per_s "$a")" -v b="$(field samples_per_s "$b")" 'BEGIN {print b / (2 * a)}')")
      s1+=("$(field samples_per_s "$a")"); s2+=("$(field samples_per_s "$b")"); s3+=("$(field samples_per_s "$c")")
      expo3+=("$(field exposed_ms "$c")"); stp3+=("$(field step_ms "$c")")
      comp+=("$(field compute_ms "$b")"); expo+=("$(field exposed_ms "$b")")
      stp+=("$(field step_ms "$b")"); ar+=("$(field allreduce_alone_ms "$b")")
    }
    torch_side() {
      local a b
      a=$(result "$PYTHON" "$here/torch_ddp_step.py" --model "$model" --batch "$batch" --nproc 1 "${common[@]}")
      b=$(result "$PYTHON" "$here/torch_ddp_step.py" --model "$model" --batch "$batch" --nproc 2 \
          --bucket-mb "$TORCH_BUCKET_MB" "${common[@]}")
      t1+=("$(field samples_per_s "$a")"); t2+=("$(field samples_per_s "$b")")
    }
    if ((r % 2)); then strata_side; torch_side; else torch_side; strata_side; fi
    echo "  $model b$batch rep $r: strata 1x1 ${s1[-1]}  2x1 ${s2[-1]} (exposed ${expo[-1]} of ${stp[-1]} ms)  2x1 MPI ${s3[-1]} (exposed ${expo3[-1]} of ${stp3[-1]} ms)  2x1 zero1 ${s5[-1]}  2x1 no-sync ${s4[-1]}   torch 1x1 ${t1[-1]}  DDP 2x1 ${t2[-1]}"
  done
  S1=$(median "${s1[@]}"); S2=$(median "${s2[@]}"); T1=$(median "${t1[@]}"); T2=$(median "${t2[@]}")
  C=$(median "${comp[@]}"); X=$(median "${expo[@]}")
  P=$(median "${stp[@]}"); A=$(median "${ar[@]}")
  S4=$(median "${s4[@]}"); S5=$(median "${s5[@]}"); SP=$(median "${paired[@]}")
  S3=$(median "${s3[@]}"); X3=$(median "${expo3[@]}"); P3=$(median "${stp3[@]}")
  rows+=("$(awk -v m="$model" -v b="$batch" -v s1="$S1" -v s2="$S2" -v t1="$T1" -v t2="$T2" -v x="$X" -v p="$P" \
    -v s3="$S3" -v x3="$X3" -v p3="$P3" -v s4="$S4" -v s5="$S5" -v sp="$SP" \
    'BEGIN {printf "| %s | %s | %.0f | %.0f | %.0f%% | %.0f%% | %.1f%% | %.0f | %.0f%% | %.1f%% | %.0f | %.0f%% | %.0f%% | %.0f | %.0f | %.0f%% | %.2fx |",
            m, b, s1, s2, 100 * s2 / (2 * s1), 100 * sp, 100 * x / p, s3, 100 * s3 / (2 * s1), 100 * x3 / p3,
            s5, 100 * s5 / (2 * s1), 100 * s4 / (2 * s1),
            t1, t2, 100 * t2 / (2 * t1), s2 / t2}')")
  brows+=("$(awk -v m="$model" -v b="$batch" -v c="$C" -v x="$X" -v p="$P" -v a="$A" -v bm="$BUCKET_MB" -v s1="$S1" \
    'BEGIN {printf "| %s | %s | %.2f | %.2f | %.2f | %.2f | %.2f | %s |", m, b, 1e3 * b / s1, c, x, p, a, bm}')")
done

echo
echo "| model | batch per rank | Strata 1x1 samples/s | Strata 2x1 | Strata scaling | paired | Strata exposed comm | Strata 2x1, MPI ring (--no-shared-memory) | its scaling | its exposed comm | Strata 2x1 --zero 1 | its scaling | no-sync scaling (ceiling) | torch 1x1 | torch DDP 2x1 | torch scaling | Strata DDP / torch DDP |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
printf '%s\n' "${rows[@]}"
echo
echo "Strata at 2 ranks, ms per step (rank 0, medians):"
echo
echo "| model | batch per rank | 1-rank step | compute (step - exposed comm) | exposed comm | 2-rank step | all-reduce alone | --bucket-mb |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|"
printf '%s\n' "${brows[@]}"
echo
echo "scaling = 2x1 samples/s / (2 x 1x1 samples/s) from the medians; paired = median over repetitions of that ratio;"
echo "no-sync = 2 ranks that never communicate (--no-sync), the ceiling for any communication; exposed comm = time blocked in the step's collectives (the watchdog's count) / step time;"
echo "all-reduce alone = blocking all-reduce of the gradients' bytes with nothing else running."
echo "cpu: $cpu; load average after: $(load_average)"
warn_if_busy 2
