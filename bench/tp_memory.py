#!/usr/bin/env python3
"""Parameters per rank of the GPT-2 presets under tensor parallelism, from `train --dry-run`
(planned from shapes, nothing allocated), against the formula.

Megatron's split: every weight of c_attn, attn/c_proj, c_fc, mlp/c_proj, c_attn's and c_fc's
biases and wte (the vocabulary padded to 50304, which 1..128 divide) is cut T ways; the
LayerNorms, the row-parallel layers' biases (attn/c_proj, mlp/c_proj), wpe and ln_f stay whole
on every rank. So per rank: split / T + replicated elements. Each tensor is stored padded to 16
elements (64 bytes), which the plan counts and the formula does not.

  python3 bench/tp_memory.py --train build/train
"""
import argparse
import re
import subprocess

PRESETS = {"gpt2-124m": (12, 12, 768), "gpt2-350m": (24, 16, 1024), "gpt2-774m": (36, 20, 1280),
           "gpt2-1.5b": (48, 25, 1600)}
VOCAB, CONTEXT = 50304, 1024


def formula(layers, d, tp):
    """(split, replicated) parameter elements of a GPT-2 with an untied head on one tp rank."""
    block_split = 3 * d * d + 3 * d + d * d + 4 * d * d + 4 * d + 4 * d * d  # c_attn, attn/c_proj W, c_fc, mlp/c_proj W
    block_whole = 2 * 2 * d + d + d  # ln_1, ln_2, the two row-parallel biases
    split = layers * block_split + 2 * VOCAB * d  # + wte and the untied head
    whole = layers * block_whole + CONTEXT * d + 2 * d  # + wpe, ln_f
    return split / tp + whole


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train", default="build/train")
    a = p.parse_args()
    print("fp32 parameter bytes on rank 0, untied head, vocabulary 50304, one pipeline stage "
          "(train --dry-run --world T --tp T); formula: 4 x (split / T + replicated)")
    print("| model | tp | plan: params per rank | formula | plan / formula | vs tp 1 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (layers, heads, d) in PRESETS.items():
        first = None
        for tp in (1, 2, 4, 8):
            if heads % tp:
                print(f"| {name} | {tp} | refused: --heads {heads} not divisible by --tp {tp} | | | |")
                continue
            out = subprocess.run([a.train, "--model", name, "--dry-run", "--world", str(tp), "--tp", str(tp),
                                  "--vocab", str(VOCAB), "--tie-embeddings", "false", "--global-batch", "8"],
                                 capture_output=True, text=True, check=True).stdout
            params = int(re.search(r"ranks? 0\S* \([^)]*\): params (\d+)", out).group(1))
            expected = 4 * formula(layers, d, tp)
            first = first or params
            print(f"| {name} | {tp} | {params:,} | {expected:,.0f} | {params / expected:.5f} | {params / first:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
