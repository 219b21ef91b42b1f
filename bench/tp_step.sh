#!/usr/bin/env bash
# Tensor parallelism on this machine (issue #17): the GPT bench model of bench_gpt_step (4
# blocks, width 256, 4 heads, T = 256, vocabulary 8192, tied head, AdamW) trained by `train` on
# 2 ranks of one thread each, as tp 1 (dp 2) and tp 2, with the one-node shared-memory
# transports and with everything through MPI (--shared-memory false); side by side in one
# invocation, REPS runs per case with the order rotating. Reports the median step time over
# the runs (each from the wall times of two runs that differ by STEPS steps), tokens/s and rank 0's bytes
# on the tp communicator per step (train's own count; the formula is checked by
# integration_tp_equivalence).
#
#   bash bench/tp_step.sh                     # build/train; ~5 minutes on 2 idle cores
#   REPS=5 STEPS=10 bash bench/tp_step.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TRAIN="${TRAIN:-$here/../build/train}"
REPS="${REPS:-3}"
WARMUP="${WARMUP:-2}"
STEPS="${STEPS:-6}"  # timed: the difference between runs of WARMUP + STEPS and WARMUP steps
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Benchmarks run OpenBLAS's own kernel choice (bench/lib.sh explains the environment's setting).
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

/usr/bin/python3 - "$work/tokens.h5" "$work/val.h5" <<'EOF'
import sys, h5py, numpy as np
rng = np.random.default_rng(0)
for path, n in ((sys.argv[1], 200_000), (sys.argv[2], 4_000)):  # random ids: the cost does not depend on them
    with h5py.File(path, "w") as f:
        f.create_dataset("tokens", data=rng.integers(0, 8192, n, dtype=np.uint16))
        f.attrs["kind"] = "tokens"; f.attrs["vocab_size"] = np.int64(8192)
        f.attrs["num_tokens"] = np.int64(n); f.attrs["tokenizer"] = "external"; f.attrs["eot"] = np.int64(0)
EOF

model=(--model gpt --layers 4 --heads 4 --embed 256 --seq-len 256 --vocab 8192 --tie-embeddings true
       --optimizer adamw --lr 1e-4 --global-batch 16 --threads 1 --data "$work/tokens.h5"
       --val-data "$work/val.h5"
       --log-every 4 --seed 1)
cases=("tp1-dp2-shm:--tp 1 --shared-memory true" "tp2-shm:--tp 2 --shared-memory true"
       "tp1-dp2-mpi:--tp 1 --shared-memory false" "tp2-mpi:--tp 2 --shared-memory false")
declare -A times bytes
for ((r = 0; r < REPS; ++r)); do
  for ((k = 0; k < ${#cases[@]}; ++k)); do
    c="${cases[$(((k + r) % ${#cases[@]}))]}"
    name="${c%%:*}"
    # The same run with WARMUP and WARMUP + STEPS steps: the difference of their wall times is
    # STEPS steps without start-up, data opening and the final evaluation.
    t0="$(date +%s.%N)"
    # shellcheck disable=SC2086
    mpirun -np 2 --bind-to none "$TRAIN" "${model[@]}" --steps "$WARMUP" ${c#*:} >/dev/null 2>&1
    t1="$(date +%s.%N)"
    # shellcheck disable=SC2086
    out="$(mpirun -np 2 --bind-to none "$TRAIN" "${model[@]}" --steps $((WARMUP + STEPS)) ${c#*:} 2>&1)"
    t2="$(date +%s.%N)"
    times[$name]+="$(awk -v a="$t0" -v b="$t1" -v c="$t2" -v s="$STEPS" 'BEGIN { printf "%.1f", ((c - b) - (b - a)) / s * 1000 }') "
    bytes[$name]="$(grep -oP "tensor-parallel bytes sent by rank 0 in the last step: \K[0-9]+" <<<"$out" || echo 0)"
  done
done
echo "2 ranks x 1 thread; global batch 16 windows of 256 tokens per step (tp 1: 8 per replica; tp 2: 16 on both ranks)"
echo "| case | step (median of $REPS runs) | tokens/s | tp bytes per step, rank 0 | runs (ms) |"
echo "|---|---:|---:|---:|---|"
for c in "${cases[@]}"; do
  name="${c%%:*}"
  median="$(tr ' ' '\n' <<<"${times[$name]}" | grep . | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }')"
  awk -v n="$name" -v m="$median" -v b="${bytes[$name]}" -v all="${times[$name]}" \
    'BEGIN { printf "| %s | %.0f ms | %.0f | %d | %s|\n", n, m, 16 * 256 / (m / 1000), b, all }'
done
