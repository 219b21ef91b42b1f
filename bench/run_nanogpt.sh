#!/usr/bin/env bash
# nanoGPT's CPU recipe end to end: Strata's train against nanoGPT's own train.py (issue #36), on
# the same character-level text, the same model and the same optimisation, one thread each.
#
# The recipe (nanoGPT's README, "I only have a macbook"): the baby GPT of
# config/train_shakespeare_char.py at 4 layers, 4 heads, width 128, context 64, batch 12,
# ITERS iterations (2000), AdamW lr 1e-3 with 100 warm-up steps and cosine decay to 1e-4, beta2
# 0.99, weight decay 0.1, gradient clipping at 1, no dropout; --bias=True, because Strata's GPT
# has GPT-2's biases. nanoGPT evaluates at its first and last iteration only (20 batches of each
# split, as the recipe: ~1% of its run), Strata once at the end, on the whole validation split
# (~5% of its run; inside its timed process, so the comparison is conservative for Strata).
#
# The text: TEXT (files, concatenated), by default the Shakespeare of nanoGPT's checkout if its
# prepare.py has downloaded it, else the texts of Debian's fortunes package (2.6 MB, 113
# characters). It is encoded as nanoGPT's data/shakespeare_char/prepare.py does (sorted
# characters, 90/10 split, uint16 .bin files and meta.pkl), and Strata reads those very .bin
# files through `strata-data import-bin --raw`. nanoGPT is not ours: its train.py, model.py,
# configurator.py and config/ are copied into a temporary work directory, never into this
# repository.
#
# Each side's final model is scored on the whole validation split, the same windows for both
# (non-overlapping windows of 64, targets shifted by one): nanoGPT's checkpoint afterwards through
# its own model.py, Strata's by its final test. REPS repetitions; the
# table gives the wall time of each training process and the validation loss. PRECISIONS adds a
# Strata run per --precision to each repetition; the order rotates.
#
#   NANOGPT_DIR=~/nanoGPT bash bench/run_nanogpt.sh          # about 10 minutes on 2 cores
#   NANOGPT_DIR=~/nanoGPT ITERS=300 REPS=1 bash bench/run_nanogpt.sh
#   NANOGPT_DIR=~/nanoGPT PRECISIONS="fp32 bf16" bash bench/run_nanogpt.sh   # Strata in both too
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
: "${NANOGPT_DIR:?set NANOGPT_DIR to a nanoGPT checkout (git clone https://github.com/karpathy/nanoGPT)}"
[[ -f "$NANOGPT_DIR/train.py" && -f "$NANOGPT_DIR/model.py" ]] || {
  echo "run_nanogpt.sh: $NANOGPT_DIR has no train.py and model.py: not a nanoGPT checkout" >&2
  exit 2
}
ITERS="${ITERS:-2000}"
REPS="${REPS:-2}"
PRECISIONS="${PRECISIONS:-fp32}"  # Strata's --precision values to run, e.g. "fp32 bf16"
PYTHON="${PYTHON:-$here/.venv/bin/python}"
[[ -x "$PYTHON" ]] || { echo "run_nanogpt.sh: no $PYTHON (python3 -m venv bench/.venv && bench/.venv/bin/pip install torch numpy)" >&2; exit 2; }
source "$here/lib.sh"
train="$(find_bench_bin train "${STRATA_TRAIN_BIN:-}")"
data_tool="$(dirname "$train")/strata-data"
if [[ -z "${TEXT:-}" ]]; then
  if [[ -f "$NANOGPT_DIR/data/shakespeare_char/input.txt" ]]; then
    TEXT="$NANOGPT_DIR/data/shakespeare_char/input.txt"
  else
    TEXT="$(find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' | sort | tr '\n' ' ')"
  fi
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp -r "$NANOGPT_DIR"/{train.py,model.py,configurator.py,config} "$work"/
mkdir -p "$work/data/strata_char"
# shellcheck disable=SC2086
"$PYTHON" - "$work/data/strata_char" $TEXT <<'EOF'
import os, pickle, sys
import numpy as np
out, files = sys.argv[1], sys.argv[2:]
text = "".join(open(f, encoding="utf-8", errors="replace").read() for f in files)
chars = sorted(set(text))
stoi = {c: i for i, c in enumerate(chars)}
ids = np.array([stoi[c] for c in text], dtype=np.uint16)
n = int(0.9 * len(ids))
ids[:n].tofile(os.path.join(out, "train.bin"))
ids[n:].tofile(os.path.join(out, "val.bin"))
with open(os.path.join(out, "meta.pkl"), "wb") as f:
    pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
print(f"text: {len(text)} characters from {len(files)} file(s), vocabulary {len(chars)}, "
      f"{n} training and {len(ids) - n} validation tokens")
EOF
vocab="$("$PYTHON" -c "import pickle; print(pickle.load(open('$work/data/strata_char/meta.pkl', 'rb'))['vocab_size'])")"
for split in train val; do
  "$data_tool" import-bin --raw --vocab-size "$vocab" --input "$work/data/strata_char/$split.bin" \
    --out "$work/strata-$split" >/dev/null
done

nanogpt_cmd=("$PYTHON" train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
  --log_interval=100 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters="$ITERS"
  --lr_decay_iters="$ITERS" --dropout=0.0 --bias=True --dataset=strata_char --eval_interval="$ITERS"
  --out_dir=nanogpt-out)
model=(--model gpt --layers 4 --heads 4 --embed 128 --seq-len 64 --dropout 0 --tie-embeddings true --threads 1)
strata_cmd=("$train" "${model[@]}" --global-batch 12 --steps "$ITERS" --optimizer adamw --lr 1e-3
  --lr-schedule cosine --warmup-steps 100 --min-lr 1e-4 --beta2 0.99 --weight-decay 0.1 --clip-grad 1.0
  --data "$work/strata-train.h5" --val-data "$work/strata-val.h5" --log-every "$ITERS")

# nanoGPT's final checkpoint on Strata's validation windows, through nanoGPT's own model.py.
nanogpt_val_loss() {
  (cd "$work" && "$PYTHON" - <<'EOF'
import numpy as np, torch
import torch.nn.functional as F
from model import GPT, GPTConfig
ck = torch.load("nanogpt-out/ckpt.pt", map_location="cpu")
model = GPT(GPTConfig(**ck["model_args"]))
model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ck["model"].items()})
model.eval()
val = np.fromfile("data/strata_char/val.bin", dtype=np.uint16).astype(np.int64)
t = 64
windows = (len(val) - 1) // t
x = torch.from_numpy(val[:windows * t].reshape(windows, t))
y = torch.from_numpy(val[1:windows * t + 1].reshape(windows, t))
total = 0.0
with torch.no_grad():
    for i in range(0, windows, 256):
        logits, _ = model(x[i:i + 256], y[i:i + 256])
        total += F.cross_entropy(logits.view(-1, logits.size(-1)), y[i:i + 256].reshape(-1), reduction="sum").item()
print(f"{total / (windows * t):.4f}")
EOF
  ) | tail -1  # model.py prints its parameter count first
}
seconds_of() {  # seconds_of CMD...: the wall seconds of CMD (run in run_env), its output kept in $work/last.log
  local t0 t1
  t0=$(date +%s.%N)
  "${run_env[@]}" "$@" >"$work/last.log" 2>&1 || { cat "$work/last.log" >&2; exit 1; }
  t1=$(date +%s.%N)
  awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.1f", b - a}'
}

torch_version="$("${run_env[@]}" "$PYTHON" -c 'import torch; print(torch.__version__)')"
echo "nanoGPT's CPU recipe, $ITERS iterations: Strata ($train) against nanoGPT $(git -C "$NANOGPT_DIR" rev-parse --short HEAD 2>/dev/null || echo '(no git)') on torch $torch_version"
echo "cpu: $(cpu_model), $(nproc) cores; OPENBLAS_CORETYPE=$(best_blas_core); one thread each; load average before: $(load_average)"
echo "$("$train" --version)"
declare -a rows
for ((r = 0; r < REPS; ++r)); do
  sides=(nanogpt)
  for p in $PRECISIONS; do sides+=("strata-$p"); done
  order=("${sides[@]:r % ${#sides[@]}}" "${sides[@]:0:r % ${#sides[@]}}")  # rotated by the repetition
  for side in "${order[@]}"; do
    if [[ "$side" == nanogpt ]]; then
      rm -rf "$work/nanogpt-out"
      secs=$(cd "$work" && seconds_of "${nanogpt_cmd[@]}")
      loss=$(nanogpt_val_loss)
      label="nanoGPT (torch $torch_version)"
    else
      secs=$(seconds_of "${strata_cmd[@]}" --precision "${side#strata-}")
      loss=$(sed -n 's/^final test: loss \([0-9.]*\).*/\1/p' "$work/last.log")
      label="Strata (${side#strata-})"
    fi
    echo "  rep $((r + 1)): $label: $secs s, validation loss $loss"
    rows+=("| $((r + 1)) | $label | $secs | $(awk -v s="$secs" -v n="$ITERS" 'BEGIN {printf "%.1f", 1000 * s / n}') | $loss |")
  done
done
echo
echo "| rep | implementation | training process, s | ms per iteration (all in) | validation loss (whole split) |"
echo "|---:|---|---:|---:|---:|"
printf '%s\n' "${rows[@]}"
