#!/usr/bin/env bash
# gpu-check.sh: Strata's GPU checks and benchmark on a machine that has the NVIDIA driver, CUDA
# runtime, cuBLAS, cuDNN and NCCL (e.g. PyTorch's pip wheels) but none of our packages, from
# the bundle made here by `cmake --build build --target bundle`. Fast (about 3-5 minutes),
# every step under a timeout, a failure does not stop the rest, a summary at the end.
#
#   bash jobs/gpu-check.sh [BUNDLE.tar.gz]     # default: the newest build*/bundle/strata-bundle.tar.gz
#
# 1. unpacks the bundle into /tmp; finds cuBLAS/cuDNN/NCCL (site-packages nvidia/*/lib, then
#    /usr/local/cuda) and prints nvidia-smi, the libraries used and their versions;
# 2. GPU tests: test_cuda_ops, test_cuda_dnn and test_nccl on 1 rank, and test_nccl on 2 ranks
#    sharing the GPU (its MPI-transport cases stage through pinned memory; NCCL parts skip with
#    one GPU);
#    then 2 ranks of `train --device cuda --comm mpi` sharing the GPU, and the same 2-rank runs
#    (2 pipeline stages; 2 replicas under ZeRO 3) on the GPU and on the CPU, whose losses must agree;
# 3. benchmark: `train --device cuda` on Fashion-MNIST-shaped synthetic data, mlp and cnn, fp32
#    and bf16, and the same models in PyTorch on the same GPU when `import torch` works there
#    (bench/torch_train_step.py --device cuda --dtype ...), as a table of samples/s;
# 4. the pipeline bubble for P = 4 with real compute on the machine's CPU cores
#    (bench/pipeline_bubble.py: a core per stage, more than the 2-core development machines
#    have; they measure P = 4 with stand-in compute, --sleep-ms).
# Output goes to stdout and, when OUT is set, to $OUT/gpu-check.log.
# Knobs (environment): BATCH (256), STEPS (400), LOG_EVERY (50), MODELS ("mlp cnn"),
# PRECISIONS ("fp32 bf16"), TORCH=0 to skip PyTorch, PYTHON (python3 with torch), BUBBLE_STAGES
# ("4"; "4 2" adds P = 2; none to skip), BUBBLE_REPEATS (3), EQ_TOLERANCE (1e-3).
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BATCH="${BATCH:-256}"
STEPS="${STEPS:-400}"
LOG_EVERY="${LOG_EVERY:-50}"
MODELS="${MODELS:-mlp cnn}"
PRECISIONS="${PRECISIONS:-fp32 bf16}"
BUBBLE_STAGES="${BUBBLE_STAGES:-4}"
BUBBLE_REPEATS="${BUBBLE_REPEATS:-3}"
TORCH="${TORCH:-1}"
work="$(mktemp -d /tmp/strata-gpu-check.XXXXXX)"
t_start=$SECONDS
summary=()

# step NAME TIMEOUT_S COMMAND...: runs the command under a timeout, output to the log (and to
# $work/NAME.out for parsing), and records PASS / FAIL / TIMEOUT (with gtest's skips) and time.
step() {
  local name="$1" limit="$2" start=$SECONDS rc status file
  shift 2
  file="$work/$(tr -c 'A-Za-z0-9_.-' '_' <<<"$name").out"
  echo
  echo "=== $name  (timeout ${limit}s)"
  timeout -k 10 "$limit" "$@" >"$file" 2>&1
  rc=$?
  cat "$file"
  case $rc in
    0) status=PASS ;;
    124 | 137) status=TIMEOUT ;;
    *) status="FAIL($rc)" ;;
  esac
  local skipped
  skipped=$(sed -n 's/.*\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$file" | tail -1)
  [[ -n "$skipped" && "$skipped" != 0 ]] && status="$status, $skipped skipped"
  summary+=("$(printf '%-52s %-20s %4ds' "$name" "$status" $((SECONDS - start)))")
  last_out="$file"
  return $rc
}

main() {
echo "Strata GPU check on $(uname -n), $(date -u +%Y-%m-%dT%H:%M:%SZ)"

# ---- 1. bundle, libraries, machine ---------------------------------------------------------------
tarball="${1:-}"
if [[ -z "$tarball" ]]; then
  tarball="$(ls -t "$root"/build*/bundle/strata-bundle.tar.gz 2>/dev/null | head -1)"
fi
if [[ -z "$tarball" || ! -f "$tarball" ]]; then
  echo "gpu-check.sh: no bundle (build it: cmake --build build --target bundle; carry build/bundle/strata-bundle.tar.gz)"
  return 2
fi
step "unpack $(basename "$tarball") ($(du -h "$tarball" | cut -f1))" 120 tar -xzf "$tarball" -C "$work" || return 1
bundle="$work/strata-bundle"
sed -n '1,3p' "$bundle/README"

# cuBLAS, cuDNN and NCCL: PyTorch's wheels first (a consistent set), then the toolkit.
cuda_dirs=()
add_dir() {
  local d
  for d in "$@"; do
    [[ -d "$d" ]] || continue
    compgen -G "$d/lib*.so*" >/dev/null || continue
    [[ " ${cuda_dirs[*]} " == *" $d "* ]] || cuda_dirs+=("$d")
  done
}
sites=()
for py in ${PYTHON:-} python3 /opt/torch/.venv/bin/python3 /usr/bin/python3; do
  command -v "$py" >/dev/null 2>&1 || continue
  while read -r d; do sites+=("$d"); done < <(timeout 30 "$py" -c \
    'import site; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null)
done
for d in /opt/*/.venv/lib/python3*/site-packages /usr/local/lib/python3*/dist-packages /usr/lib/python3/dist-packages; do
  sites+=("$d")
done
for s in "${sites[@]}"; do add_dir "$s"/nvidia/cu13/lib "$s"/nvidia/*/lib "$s"/nvidia/*/lib64; done
add_dir /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia/lib64 /usr/local/nvidia/lib
STRATA_CUDA_LIBS="$(IFS=:; echo "${cuda_dirs[*]}")"
export STRATA_CUDA_LIBS
# shellcheck source=/dev/null
source "$bundle/env.sh"
echo "CUDA library folders: ${STRATA_CUDA_LIBS:-none found}"
echo "libraries train uses:"
ldd "$bundle/bin/train" | grep -E "lib(cuda|cudart|cublas|cublasLt|cudnn|nccl|stdc\+\+|gomp)\.so" |
  while read -r soname _ path _; do printf '  %-22s %s\n' "$soname" "$(readlink -f "$path" 2>/dev/null || echo "$path")"; done
step "nvidia-smi" 30 nvidia-smi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null
gpu_name="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"

# ---- 2. tests ------------------------------------------------------------------------------------
gtest=(--gtest_brief=1 --gtest_color=no)
step "test_cuda_ops" 180 "$bundle/bin/test_cuda_ops" "${gtest[@]}"
if [[ -x "$bundle/bin/test_cuda_dnn" ]]; then
  step "test_cuda_dnn" 240 "$bundle/bin/test_cuda_dnn" "${gtest[@]}"
fi
step "test_nccl, 1 rank" 180 env NCCL_DEBUG=VERSION "$bundle/bin/test_nccl" "${gtest[@]}"
grep -m1 "NCCL version" "$last_out" || true
if [[ -x "$bundle/bin/mpirun" ]]; then
  step "test_nccl, 2 ranks sharing the GPU" 240 mpirun -np 2 --oversubscribe "$bundle/bin/test_nccl" "${gtest[@]}"
fi
# A driver too old for this CUDA makes every GPU test skip as if there were no GPU: not a pass.
if grep -l "no CUDA device" "$work"/test_*.out >/dev/null 2>&1; then
  grep -h -m1 "no CUDA device" "$work"/test_*.out
  summary+=("$(printf '%-52s %-20s' "the GPU tests used the GPU" "FAIL(skipped)")")
fi

# ---- 3. benchmark --------------------------------------------------------------------------------
data="$work/fashion-mnist-synthetic"
step "strata-data synthetic (32768 x 1x28x28 u8)" 90 \
  strata-data synthetic --out "$data" --samples 32768 --shape 1,28,28 --classes 10
data_file="$(ls "$data"*.h5 2>/dev/null | head -1)"

# same_as_cpu NAME ARGS...: 2 ranks of train with ARGS on the CPU and on the GPU (sharing it over
# --comm mpi), f32, from the same initialisation and data; the losses logged every 10 steps
# must agree within EQ_TOLERANCE relative (summation orders differ; a wrong kernel, message
# or shard differs by far more). The pipeline and ZeRO, unchanged on the GPU (issue #7).
EQ_TOLERANCE="${EQ_TOLERANCE:-1e-3}"
same_as_cpu() {
  local name="$1" d worst status
  shift
  for d in cpu cuda; do
    rm -f "$work/eq-$d.jsonl"
    step "$name, --device $d" 150 mpirun -np 2 --oversubscribe train --data "$data_file" --device "$d" --comm mpi \
      --steps 40 --log-every 10 --threads 4 --metrics "$work/eq-$d.jsonl" "$@" || return
  done
  worst=$(paste <(sed -n 's/.*"loss": \([^,]*\),.*/\1/p' "$work/eq-cpu.jsonl") \
    <(sed -n 's/.*"loss": \([^,]*\),.*/\1/p' "$work/eq-cuda.jsonl") |
    awk '{d = $1 - $2; if (d < 0) d = -d; s = $1 < 0 ? -$1 : $1; r = d / (s > 1 ? s : 1); if (r > w) w = r; n++}
         END {if (n == 4) printf "%.2e", w; else print "incomplete"}')
  status=FAIL
  [[ "$worst" != incomplete ]] && awk -v w="$worst" -v t="$EQ_TOLERANCE" 'BEGIN {exit !(w <= t)}' && status=PASS
  echo "$name: losses on the GPU vs the CPU, worst relative difference $worst (limit $EQ_TOLERANCE): $status"
  summary+=("$(printf '%-52s %-20s' "GPU = CPU: $name" "$status ($worst)")")
}

if [[ -x "$bundle/bin/mpirun" && -n "$data_file" ]]; then
  step "train cnn, 2 ranks sharing the GPU (--comm mpi)" 150 mpirun -np 2 --oversubscribe train --model cnn \
    --data "$data_file" --device cuda --comm mpi --global-batch 128 --steps 100 --log-every 50 --threads 4
  same_as_cpu "mlp, 2 pipeline stages, 1f1b" --model mlp --hidden 256,256 --pp 2 --schedule 1f1b \
    --global-batch 64 --micro-batch 16
  same_as_cpu "cnn, 2 replicas, zero 3" --model cnn --zero 3 --global-batch 64
fi

# The median of the samples/s of a run's progress lines after the first (warm-up, cuDNN setup).
train_rate() {
  grep -o '[0-9.]* samples/s' "$1" | awk 'NR > 1 {print $1}' | sort -g |
    awk '{v[NR] = $1} END {if (NR) print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'
}
declare -A strata_rate torch_rate
for model in $MODELS; do
  for precision in $PRECISIONS; do
    [[ -n "$data_file" ]] || break
    if step "train $model $precision batch $BATCH" 150 train --model "$model" --data "$data_file" --device cuda \
      --precision "$precision" --global-batch "$BATCH" --steps "$STEPS" --log-every "$LOG_EVERY" --threads 8; then
      strata_rate[$model.$precision]="$(train_rate "$last_out")"
    fi
  done
done

torch_py=""
if [[ "$TORCH" == 1 ]]; then
  for py in ${PYTHON:-} python3 /opt/torch/.venv/bin/python3 /usr/bin/python3; do
    if command -v "$py" >/dev/null 2>&1 && timeout 60 env -u LD_LIBRARY_PATH "$py" -c \
      'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
      torch_py="$py"
      break
    fi
  done
fi
torch_version=""
if [[ -n "$torch_py" ]]; then
  torch_version="$(env -u LD_LIBRARY_PATH "$torch_py" - 2>/dev/null <<'PY'
import torch
parts = [torch.__version__, "CUDA " + str(torch.version.cuda), "cuDNN " + str(torch.backends.cudnn.version())]
try:
    parts.append("NCCL " + ".".join(map(str, torch.cuda.nccl.version())))
except Exception:
    pass
print(", ".join(parts))
PY
)"
  echo "torch: $torch_version ($torch_py)"
  script="$root/bench/torch_train_step.py"
  [[ -f "$script" ]] || script="$bundle/scripts/torch_train_step.py"
  for model in $MODELS; do
    for precision in $PRECISIONS; do
      # torch uses its own libraries: the bundle's LD_LIBRARY_PATH stays out of its way.
      if step "torch $model $precision batch $BATCH" 150 env -u LD_LIBRARY_PATH "$torch_py" "$script" --model "$model" \
        --batch "$BATCH" --device cuda --dtype "$precision" --warmup 30 --steps 50 --windows 5 --threads 8; then
        torch_rate[$model.$precision]="$(sed -n 's/^RESULT .*samples_per_s=\([0-9.]*\).*/\1/p' "$last_out")"
      fi
    done
  done
else
  echo "torch: not available here (import torch failed or no GPU for it); Strata only"
fi

echo
echo "=== training throughput on ${gpu_name:-the GPU}, batch $BATCH, samples/s (higher is better)"
echo "strata: train --device cuda, median of its progress lines after the first ($STEPS steps, HDF5 loader, loss read every step)"
echo "torch:  bench/torch_train_step.py --device cuda, median of 5 windows of 50 steps after 30 warm-up (one in-memory batch)${torch_version:+; torch $torch_version}"
printf '%-6s %-6s %14s %14s %14s\n' model dtype strata torch strata/torch
for model in $MODELS; do
  for precision in $PRECISIONS; do
    s="${strata_rate[$model.$precision]:-}" t="${torch_rate[$model.$precision]:-}"
    ratio="-"
    [[ -n "$s" && -n "$t" ]] && ratio="$(awk -v s="$s" -v t="$t" 'BEGIN {printf "%.2f", s / t}')"
    printf '%-6s %-6s %14s %14s %14s\n' "$model" "$precision" "${s:--}" "${t:--}" "$ratio"
  done
done

# ---- 4. pipeline bubble on this machine's CPU cores ---------------------------------------------
# The P = 4 bubble needs a core per stage, which the 2-core development machines lack (issue #4):
# bench/pipeline_bubble.py with the bundled train and mpirun, one thread per rank, the OpenBLAS
# kernels named as bench/lib.sh does. Runs last, so a slow CPU cannot cost the GPU results.
bubble_py=""
for py in python3 /usr/bin/python3; do command -v "$py" >/dev/null 2>&1 && { bubble_py="$py"; break; }; done
if [[ -n "$bubble_py" && -x "$bundle/bin/mpirun" && "$BUBBLE_STAGES" != none ]]; then
  lib="$root/bench/lib.sh"
  [[ -f "$lib" ]] || lib="$bundle/scripts/lib.sh"
  # shellcheck source=/dev/null
  source "$lib"  # run_env: the kernels and threads every benchmark runs with
  echo "cpu: $(cpu_model), $(nproc) cores; OpenBLAS kernels: $(best_blas_core)"
  # Python without the bundle's libraries; its programs get them through the bundle's `run`.
  # shellcheck disable=SC2086
  step "pipeline bubble, P = $BUBBLE_STAGES ($BUBBLE_REPEATS paired repeats)" 240 env -u LD_LIBRARY_PATH \
    "${run_env[@]}" "$bubble_py" \
    "$bundle/scripts/pipeline_bubble.py" --train "$bundle/bin/train" --data-tool "$bundle/run strata-data" \
    --mpirun "$bundle/run mpirun" --stages $BUBBLE_STAGES --repeats "$BUBBLE_REPEATS"
else
  echo "pipeline bubble: skipped (no python3, no bundled mpirun, or BUBBLE_STAGES=none)"
fi

echo
echo "=== summary ($((SECONDS - t_start)) s)"
printf '%s\n' "${summary[@]}"
failed=$(printf '%s\n' "${summary[@]}" | grep -c -E " (FAIL|TIMEOUT)" || true)
echo "$failed step(s) failed"
return $((failed > 0))
}

if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  main "$@" 2>&1 | tee "$OUT/gpu-check.log"
  rc=${PIPESTATUS[0]}
else
  main "$@"
  rc=$?
fi
rm -rf "$work"
exit $rc
