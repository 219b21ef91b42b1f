#!/usr/bin/env bash
# GPT: Strata vs PyTorch, side by side in one invocation (issue #16). Three sides: Strata
# (build*/bench_gpt_step), Debian's torch (/usr/bin/python3) and the newest torch
# (bench/.venv/bin/python, if it exists), each running bench/torch_gpt_step.py or its C++
# counterpart in a fresh process, with the same environment (bench/lib.sh).
#
# 1. The single-core GEMM peaks (fp32: OpenBLAS; bf16: oneDNN on the CPU's bf16 units where it
#    has them; N = 2048, best of 5): MFU's denominators, one per precision.
# 2. GPT training steps, tokens/s: 4 layers, width 256, 4 heads, T = 256, batch 8, vocabulary
#    8192, tied head, AdamW; with 1 thread and with 2 threads; in each of PRECISIONS (fp32;
#    bf16: Strata's --precision bf16 against torch.autocast("cpu", torch.bfloat16), fp32 master
#    weights on both sides). REPS repetitions, the order of
#    the sides rotating each repetition so drifting load hits all alike; each run reports the
#    median of its timed windows, the table the median over repetitions, the ratio of the
#    medians and the median of the per-repetition (back-to-back) ratios, and MFU = tokens/s x
#    FLOPs/token / (threads x the precision's single-core GEMM peak), FLOPs/token as llm.c
#    counts them.
# 3. Causal attention forward+backward alone (B = 8, H = 4, Dh = 64, one thread) for
#    T = 256 ... 2048: Strata's flash and plain ops, the newest torch's
#    F.scaled_dot_product_attention(is_causal=True) and Debian's torch 1.13, which has no SDPA
#    (the written-out softmax(q k^T + mask) v). ATTN_REPS repetitions, order rotating.
# 4. Peak memory of one attention forward+backward at T = 2048 above its inputs: the resident
#    set's high-water mark (VmHWM, reset before the call) for every side, and Strata's
#    allocator high-water mark; run with MALLOC_MMAP_THRESHOLD_=131072 so that freed blocks
#    leave the resident set (see torch_gpt_step.py: peak_rss_of_one_call).
#
#   cmake --build build --target bench_gpt_step
#   bash bench/run_gpt_vs_torch.sh                  # about 10 minutes on 2 idle cores
#   REPS=5 THREADS="1" ATTN_T="256 1024" bash bench/run_gpt_vs_torch.sh
#   ATTN_T= bash bench/run_gpt_vs_torch.sh          # steps only (an empty ATTN_T: no attention sections)
#   MODEL_KIND=llama bash bench/run_gpt_vs_torch.sh  # the Llama of the same size: steps only
# MODEL_KIND=llama: section 2 for a Llama (4 layers, width 256, 4 heads over 2 kv heads, SwiGLU
# of 768, rotary theta 10000, tied head; torch_models.Llama on the torch sides); the attention
# sections (the same op) are left out unless ATTN_T is given.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPS="${REPS:-3}"
WARMUP="${WARMUP:-2}"
STEPS="${STEPS:-2}"
WINDOWS="${WINDOWS:-3}"
THREADS="${THREADS:-1 2}"
PRECISIONS="${PRECISIONS:-fp32 bf16}"
MODEL_KIND="${MODEL_KIND:-gpt}"
if [[ "$MODEL_KIND" == llama ]]; then ATTN_T="${ATTN_T:-}"; else ATTN_T="${ATTN_T-256 512 1024 2048}"; fi
ATTN_REPS="${ATTN_REPS:-2}"      # processes per (side, T), order rotating
ATTN_CALLS="${ATTN_CALLS:-3}"    # timed calls per process (median)
ATTN_BATCH="${ATTN_BATCH:-8}"
MEMORY_T="${MEMORY_T:-2048}"
PYTHON="${PYTHON:-/usr/bin/python3}"
VENV_PYTHON="$here/.venv/bin/python"
case "$MODEL_KIND" in
  gpt) MODEL=(--layers 4 --heads 4 --embed 256 --seq-len 256 --batch 8 --vocab 8192) ;;
  llama) MODEL=(--model llama --layers 4 --heads 4 --kv-heads 2 --embed 256 --ffn-hidden 768 --seq-len 256 --batch 8
                --vocab 8192) ;;
  *) echo "run_gpt_vs_torch.sh: MODEL_KIND must be gpt or llama, found '$MODEL_KIND'" >&2; exit 2 ;;
esac
TOKENS=2048  # per step: batch x seq-len

source "$here/lib.sh"
bin="$(find_bench_bin bench_gpt_step "${STRATA_BENCH_BIN:-}")"

# run_out CMD...: the output of CMD run in the environment of the current thread count ($tenv),
# or exits with it when CMD fails.
run_out() {
  local out
  if ! out="$("${tenv[@]}" "$@" 2>&1)"; then
    echo "run_gpt_vs_torch.sh: failed: $*" >&2
    echo "$out" >&2
    exit 1
  fi
  echo "$out"
}
# field KEY OUTPUT: the KEY=value of OUTPUT's RESULT line, or exits with OUTPUT.
field() {
  local v
  v=$(sed -n "s/^RESULT .*[ ]$1=\\([-0-9.e+]*\\).*/\\1/p" <<<"$2")
  if [[ -z "$v" ]]; then
    echo "run_gpt_vs_torch.sh: no $1 in the RESULT line of:" >&2
    echo "$2" >&2
    exit 1
  fi
  echo "$v"
}
fmt() { awk -v x="$1" -v f="$2" 'BEGIN {printf f, x}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2fx", a / b}'; }

# The sides: name, label, command prefix. The newest torch only if bench/.venv has one.
sides=(strata debian)
declare -A label
label[strata]="Strata"
debian_version="$("${run_env[@]}" "$PYTHON" -c 'import torch; print(torch.__version__)')"
label[debian]="torch $debian_version"
venv_version=""
if [[ -x "$VENV_PYTHON" ]] && "$VENV_PYTHON" -c 'import torch' 2>/dev/null; then
  venv_version="$("${run_env[@]}" "$VENV_PYTHON" -c 'import torch; print(torch.__version__)')"
  label[venv]="torch $venv_version"
  sides=(strata venv debian)
fi
python_of() { [[ "$1" == venv ]] && echo "$VENV_PYTHON" || echo "$PYTHON"; }
# side_cmd SIDE ARGS...: sets cmd to the command line of one run.
side_cmd() {
  local side="$1"
  shift
  if [[ "$side" == strata ]]; then cmd=("$bin" "$@"); else cmd=("$(python_of "$side")" "$here/torch_gpt_step.py" "$@"); fi
}
# The i-th rotation of the sides, so each goes first as often as the others.
rotated() {
  local i="$1" n=${#sides[@]} k
  for ((k = 0; k < n; ++k)); do printf '%s ' "${sides[$(((i + k) % n))]}"; done
}
cpu="$(cpu_model)"

echo "$MODEL_KIND: Strata vs PyTorch, one process per run"
echo "strata: $bin"
echo "torch:  ${label[debian]} ($PYTHON)${venv_version:+; ${label[venv]} ($VENV_PYTHON)}"
echo "cpu:    $cpu, $(nproc) cores; OPENBLAS_CORETYPE=$(best_blas_core); load average before: $(load_average)"
echo "model:  ${MODEL[*]}, tied head, AdamW (betas 0.9/0.95, weight decay 0.1 on Linear weights)"
echo "timing: $REPS rotating repetitions x ($WARMUP warm-up steps, median of $WINDOWS windows of $STEPS steps)"
echo

# ---- 1. GEMM peaks --------------------------------------------------------------------------
declare -A peak1  # single-core GEMM GFLOP/s per precision
for precision in $PRECISIONS; do
  for threads in 1 2; do
    read -ra tenv <<<"$(threads_env "$threads")"
    out=$(run_out "$bin" --gemm-peak 2048 --reps 5 --threads "$threads" --precision "$precision")
    ((threads == 1)) && peak1[$precision]=$(field gflops "$out")
    grep '^gemm ' <<<"$out"
  done
done
echo "(fp32 on OpenBLAS's $(best_blas_core) kernels)"
echo

# ---- 2. training steps ----------------------------------------------------------------------
rows=()
fpt=""
for precision in $PRECISIONS; do
for threads in $THREADS; do
  read -ra tenv <<<"$(threads_env "$threads")"
  declare -A runs=()
  declare -a ratio_venv=() ratio_debian=()
  for ((r = 0; r < REPS; ++r)); do
    declare -A this=()
    line="  $precision threads $threads rep $((r + 1)):"
    read -ra order <<<"$(rotated "$r")"
    for side in "${order[@]}"; do
      if [[ "$side" == strata ]]; then dtype=(--precision "$precision"); else dtype=(--dtype "$precision"); fi
      side_cmd "$side" "${MODEL[@]}" "${dtype[@]}" --threads "$threads" --warmup "$WARMUP" --steps "$STEPS" \
        --windows "$WINDOWS"
      out=$(run_out "${cmd[@]}")
      this[$side]=$(field tokens_per_s "$out")
      [[ "$side" == strata && -z "$fpt" ]] && fpt=$(field flops_per_token "$out")
      runs[$side]+="${this[$side]} "
      line+="  ${label[$side]} $(fmt "${this[$side]}" %.0f)"
    done
    echo "$line tokens/s"
    [[ -n "$venv_version" ]] && ratio_venv+=("$(awk -v s="${this[strata]}" -v t="${this[venv]}" 'BEGIN {print s / t}')")
    ratio_debian+=("$(awk -v s="${this[strata]}" -v t="${this[debian]}" 'BEGIN {print s / t}')")
  done
  peak=$(awk -v p="${peak1[$precision]}" -v t="$threads" 'BEGIN {print p * t}')
  for side in "${sides[@]}"; do
    # shellcheck disable=SC2086
    med=$(median ${runs[$side]})
    mfu=$(awk -v m="$med" -v f="$fpt" -v p="$peak" 'BEGIN {printf "%.1f%%", 100 * m * f / (p * 1e9)}')
    row="| $precision | $threads | ${label[$side]} | $(fmt "$med" %.0f) | $(fmt "$(awk -v m="$med" -v n="$TOKENS" 'BEGIN {print n / m * 1000}')" %.0f) | $(awk -v m="$med" -v f="$fpt" 'BEGIN {printf "%.1f", m * f * 1e-9}') | $mfu |"
    if [[ "$side" == strata ]]; then
      s_med=$med
      row+=" | |"
    else
      if [[ "$side" == venv ]]; then paired=$(median "${ratio_venv[@]}"); else paired=$(median "${ratio_debian[@]}"); fi
      row+=" $(ratio "$s_med" "$med") | $(fmt "$paired" %.2fx) |"
    fi
    rows+=("$row")
  done
  unset runs ratio_venv ratio_debian
done
done
echo
echo "Training step, tokens/s (median over $REPS repetitions); FLOPs/token $(fmt "$fpt" %.0f) (llm.c: 6 N + 6 L D T);"
echo "MFU = tokens/s x FLOPs/token / (threads x the precision's single-core GEMM peak above)"
echo
echo "| precision | threads | implementation | tokens/s | ms/step | GFLOP/s | MFU | Strata / this | paired ratio |"
echo "|---|---:|---|---:|---:|---:|---:|---:|---:|"
printf '%s\n' "${rows[@]}"
echo

# ---- 3. attention alone ---------------------------------------------------------------------
if [[ -n "$ATTN_T" ]]; then
tenv=("${run_env[@]}")
attn_sides=(strata-flash strata-plain)
[[ -n "$venv_version" ]] && attn_sides+=(venv)
attn_sides+=(debian)
attn_cmd() {  # attn_cmd SIDE T [extra args]: sets cmd to the command line of one attention run
  local side="$1" t="$2"
  shift 2
  local common=(--attention-only --batch "$ATTN_BATCH" --heads 4 --head-dim 64 --seq-len "$t" --threads 1 "$@")
  case "$side" in
    strata-flash) cmd=("$bin" "${common[@]}" --attention flash) ;;
    strata-plain) cmd=("$bin" "${common[@]}" --attention plain) ;;
    venv) cmd=("$VENV_PYTHON" "$here/torch_gpt_step.py" "${common[@]}" --attention sdpa) ;;
    debian) cmd=("$PYTHON" "$here/torch_gpt_step.py" "${common[@]}" --attention math) ;;
  esac
}
attn_name() {
  case "$1" in
    strata-flash) echo "Strata flash" ;;
    strata-plain) echo "Strata plain" ;;
    venv) echo "${label[venv]} SDPA" ;;
    debian) echo "${label[debian]} math" ;;
  esac
}
echo "Causal attention forward+backward alone: B $ATTN_BATCH, H 4, Dh 64, one thread; $ATTN_REPS rotating repetitions x median of $ATTN_CALLS calls (after 1 warm-up)"
attn_rows=()
for t in $ATTN_T; do
  declare -A ms=()
  for ((r = 0; r < ATTN_REPS; ++r)); do
    n=${#attn_sides[@]}
    for ((k = 0; k < n; ++k)); do
      side=${attn_sides[$(((r + k) % n))]}
      attn_cmd "$side" "$t" --warmup 1 --reps "$ATTN_CALLS"
      ms[$side]+="$(field ms "$(run_out "${cmd[@]}")") "
    done
  done
  row="| $t |"
  line="  T $t:"
  declare -A med=()
  for side in "${attn_sides[@]}"; do
    # shellcheck disable=SC2086
    m=$(median ${ms[$side]})
    med[$side]=$m
    row+=" $(fmt "$m" %.1f) |"
    line+="  $(attn_name "$side") ${ms[$side]}"
  done
  echo "$line ms"
  # GFLOP/s of Strata flash (model FLOPs: 12 Dh per (query, key) pair of the causal half)
  gf=$(awk -v t="$t" -v b="$ATTN_BATCH" -v m="${med[strata-flash]}" 'BEGIN {printf "%.1f", 12 * 64 * b * 4 * t * (t + 1) / 2 / (m * 1e6)}')
  row+=" $gf |"
  [[ -n "$venv_version" ]] && row+=" $(ratio "${med[venv]}" "${med[strata-flash]}") |"
  row+=" $(ratio "${med[debian]}" "${med[strata-flash]}") |"
  attn_rows+=("$row")
  unset ms med
done
echo
header="| T | $(attn_name strata-flash) ms | $(attn_name strata-plain) ms |"
rule="|---:|---:|---:|"
[[ -n "$venv_version" ]] && header+=" $(attn_name venv) ms |" && rule+="---:|"
header+=" $(attn_name debian) ms | Strata flash GFLOP/s |"
rule+="---:|---:|"
[[ -n "$venv_version" ]] && header+=" $(attn_name venv) / Strata flash |" && rule+="---:|"
header+=" $(attn_name debian) / Strata flash |"
rule+="---:|"
echo "$header"
echo "$rule"
printf '%s\n' "${attn_rows[@]}"
echo "(time ratios: above 1x Strata's flash attention is faster)"
echo

# ---- 4. peak memory -------------------------------------------------------------------------
tenv=("${run_env[@]}" MALLOC_MMAP_THRESHOLD_=131072)
mem_line="Peak memory of one attention forward+backward at T = $MEMORY_T (B $ATTN_BATCH, H 4, Dh 64) above the inputs, MiB (resident set):"
for side in "${attn_sides[@]}"; do
  attn_cmd "$side" "$MEMORY_T" --warmup 1 --memory
  out=$(run_out "${cmd[@]}")
  mem_line+="  $(attn_name "$side") $(fmt "$(field rss_peak_mib "$out")" %.1f)"
  if [[ "$side" == strata-* ]]; then mem_line+=" (allocator $(fmt "$(field alloc_peak_mib "$out")" %.1f))"; fi
done
echo "$mem_line"
echo
fi
echo "cpu: $cpu; load average after: $(load_average)"
warn_if_busy 2
