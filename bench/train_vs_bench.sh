#!/usr/bin/env bash
# train and bench_gpt_step run the same step (parallel::StageEngine): for one GPT shape (4 layers,
# width 256, T 256, batch 8, vocabulary 8192, AdamW with nanoGPT's betas, one thread, one rank,
# no dropout) this runs `train` on random tokens and `bench_gpt_step` alternately, REPS times,
# and prints each side's tokens/s and their ratio. train's rate is its progress line's over the
# steps after the first window (the warm-up), bench_gpt_step's the median of its windows.
#
#   cmake --build build --target train strata-data bench_gpt_step
#   bash bench/train_vs_bench.sh                  # REPS=5 STEPS=40
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/lib.sh"
REPS="${REPS:-5}"
STEPS="${STEPS:-40}"
bench_bin="$(find_bench_bin bench_gpt_step "${STRATA_BENCH_BIN:-}")"
build="$(dirname "$bench_bin")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# Random tokens below 8192 as a headerless uint16 file (nanoGPT's .bin), imported as token shards.
/usr/bin/python3 -c "
import numpy as np
np.random.default_rng(1).integers(0, 8192, 100000, dtype=np.uint16).tofile('$work/tokens.bin')"
"$build/strata-data" import-bin --raw --input "$work/tokens.bin" --out "$work/tokens" --vocab-size 8192 >/dev/null
data="$(ls "$work"/tokens*.h5 | head -1)"

shape=(--layers 4 --heads 4 --embed 256 --seq-len 256)
train_side() {
  rm -f "$work/metrics.jsonl"
  "${run_env[@]}" "$build/train" --model gpt "${shape[@]}" --vocab 8192 --data "$data" --global-batch 8 \
    --optimizer adamw --lr 6e-4 --weight-decay 0.1 --beta2 0.95 --steps "$STEPS" --log-every $((STEPS / 2)) \
    --threads 1 --metrics "$work/metrics.jsonl" >/dev/null
  # The last progress record (the final evaluation's record follows it).
  /usr/bin/python3 -c "import json; print(round([r for r in map(json.loads, open('$work/metrics.jsonl')) if 'tokens_per_s' in r][-1]['tokens_per_s']))"
}
bench_side() {
  "${run_env[@]}" "$bench_bin" "${shape[@]}" --batch 8 --vocab 8192 --threads 1 --warmup 3 --steps 5 --windows 4 |
    sed -n 's/^RESULT .*tokens_per_s=\([0-9.]*\).*/\1/p' | cut -d. -f1
}

echo "train vs bench_gpt_step, the same StageEngine step: gpt L4 H4 D256 T256 V8192, batch 8, AdamW, 1 thread"
echo "cpu: $(cpu_model); load average before: $(load_average)"
t=() b=() r=()
for ((i = 1; i <= REPS; ++i)); do
  if ((i % 2)); then x=$(train_side); y=$(bench_side); else y=$(bench_side); x=$(train_side); fi
  t+=("$x") b+=("$y") r+=("$(awk -v a="$x" -v b="$y" 'BEGIN {printf "%.3f", a / b}')")
  echo "  rep $i: train $x tokens/s, bench_gpt_step $y tokens/s, ratio ${r[-1]}"
done
echo "median: train $(median "${t[@]}") tokens/s, bench_gpt_step $(median "${b[@]}") tokens/s, ratio $(median "${r[@]}")"
echo "load average after: $(load_average)"
