#!/usr/bin/env bash
# Strata vs PyTorch training-step throughput, side by side in one invocation: the mlp
# (784-1024-1024-10, batch 128) and the cnn (batch 64), SGD momentum 0.9, one process and one
# thread each, the same environment for both. Runs alternate (Strata first on odd repetitions,
# torch first on even ones) so drifting machine load hits both sides alike; each run reports the
# median of its timed windows and the table shows the median over repetitions, the ratio of the
# medians and the median of the per-repetition (back-to-back) ratios.
#
#   cmake -S . -B build-bench -DSTRATA_CUDA=OFF && cmake --build build-bench --target bench_train_step
#   bash bench/run_vs_torch.sh                 # REPS=5 STEPS=20 WINDOWS=7 WARMUP=20 by default
#   STRATA_BENCH_BIN=build/bench_train_step REPS=9 bash bench/run_vs_torch.sh
#
# Environment for BOTH sides: the same OpenBLAS kernels, named explicitly (bench/lib.sh:
# SkylakeX on AVX-512 CPUs; autodetection in OpenBLAS 0.3.21 gives generic kernels on newer
# CPUs, and the dev/CI environment may pin Haswell), and OMP/OpenBLAS/MKL use one thread.
# Optional: a second torch in bench/.venv (any version) adds a column.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPS="${REPS:-5}"
STEPS="${STEPS:-20}"
WINDOWS="${WINDOWS:-7}"
WARMUP="${WARMUP:-20}"
PYTHON="${PYTHON:-/usr/bin/python3}"
VENV_PYTHON="$here/.venv/bin/python"

source "$here/lib.sh"
bin="$(find_bench_bin bench_train_step "${STRATA_BENCH_BIN:-}")"
common=(--warmup "$WARMUP" --steps "$STEPS" --windows "$WINDOWS" --threads 1)

# Prints the samples/s of one run (its RESULT line), or exits with the run's output on failure.
samples_per_s() {
  local out
  if ! out="$("${run_env[@]}" "$@" 2>&1)"; then
    echo "run_vs_torch.sh: failed: $*" >&2
    echo "$out" >&2
    exit 1
  fi
  local v
  v=$(sed -n 's/^RESULT .*samples_per_s=\([0-9.]*\).*/\1/p' <<<"$out")
  if [[ -z "$v" ]]; then
    echo "run_vs_torch.sh: no RESULT line from: $*" >&2
    echo "$out" >&2
    exit 1
  fi
  echo "$v"
}

torch_version="$("${run_env[@]}" "$PYTHON" -c 'import torch; print(torch.__version__)')"
venv_version=""
if [[ -x "$VENV_PYTHON" ]] && "$VENV_PYTHON" -c 'import torch' 2>/dev/null; then
  venv_version="$("${run_env[@]}" "$VENV_PYTHON" -c 'import torch; print(torch.__version__)')"
fi
cpu="$(cpu_model)"

echo "Strata vs PyTorch, one process, one thread each: $REPS alternating repetitions x ($WARMUP warm-up steps, median of $WINDOWS windows of $STEPS steps)"
echo "strata: $bin"
echo "torch:  $torch_version ($PYTHON)${venv_version:+; torch $venv_version ($VENV_PYTHON)}"
echo "cpu:    $cpu, $(nproc) cores; load average before: $(load_average)"
echo

rows=()
for config in "mlp 128" "cnn 64"; do
  read -r model batch <<<"$config"
  s_runs=() t_runs=() v_runs=() ratios=()
  for ((r = 1; r <= REPS; ++r)); do
    strata_cmd=("$bin" --model "$model" --batch "$batch" "${common[@]}")
    torch_cmd=("$PYTHON" "$here/torch_train_step.py" --model "$model" --batch "$batch" "${common[@]}")
    if ((r % 2)); then
      s=$(samples_per_s "${strata_cmd[@]}"); t=$(samples_per_s "${torch_cmd[@]}")
    else
      t=$(samples_per_s "${torch_cmd[@]}"); s=$(samples_per_s "${strata_cmd[@]}")
    fi
    s_runs+=("$s"); t_runs+=("$t"); ratios+=("$(awk -v s="$s" -v t="$t" 'BEGIN {print s / t}')")
    line="  $model b$batch rep $r: strata $s  torch $t"
    if [[ -n "$venv_version" ]]; then
      v=$(samples_per_s "$VENV_PYTHON" "$here/torch_train_step.py" --model "$model" --batch "$batch" "${common[@]}")
      v_runs+=("$v"); line+="  torch-$venv_version $v"
    fi
    echo "$line"
  done
  s_med=$(median "${s_runs[@]}"); t_med=$(median "${t_runs[@]}"); r_med=$(median "${ratios[@]}")
  row=$(awk -v m="$model" -v b="$batch" -v s="$s_med" -v t="$t_med" -v r="$r_med" -v tv="$torch_version" \
    'BEGIN {printf "| %s | %s | %.0f | %.0f | %.2fx | %.2fx | %s |", m, b, s, t, s / t, r, tv}')
  if [[ -n "$venv_version" ]]; then
    v_med=$(median "${v_runs[@]}")
    row+=$(awk -v s="$s_med" -v v="$v_med" -v tv="$venv_version" 'BEGIN {printf " %.0f | %.2fx (%s) |", v, s / v, tv}')
  fi
  rows+=("$row")
done

echo
header="| model | batch | Strata samples/s | torch samples/s | Strata / torch | paired ratio | torch |"
rule="|---|---:|---:|---:|---:|---:|---|"
if [[ -n "$venv_version" ]]; then
  header+=" torch (venv) samples/s | Strata / venv torch |"
  rule+="---:|---:|"
fi
echo "$header"
echo "$rule"
printf '%s\n' "${rows[@]}"
echo
echo "Strata / torch = ratio of the medians; paired ratio = median over repetitions of the ratio of the two"
echo "back-to-back runs (less sensitive to load that drifts during the benchmark)."
echo "cpu: $cpu; load average after: $(load_average)"
warn_if_busy 1
