#!/usr/bin/env python3
"""ZeRO stages 0-3 side by side: bytes per rank (from --dry-run's plan, which equals the real allocations)
against the ZeRO paper's formulas, and step time and data-parallel bytes per step.

Paper (Rajbhandari et al. 2020, section 5) per data-parallel rank, Psi parameters, Nd ranks,
K bytes of optimizer state per parameter; here everything is fp32, so parameters and gradients
are 4 Psi each and K = 4 for SGD-momentum (the momentum), K = 8 for AdamW (two moments):
  stage 0: 4Psi + 4Psi + K Psi        stage 1: 4Psi + 4Psi + K Psi / Nd
  stage 2: 4Psi + (4Psi + K Psi) / Nd stage 3: (4Psi + 4Psi + K Psi) / Nd
Strata adds alignment padding, a gradient ring of the largest tile + one bucket (stages 2-3; a
tile is a bucket-sized piece of a Linear larger than a bucket, any other layer whole) and two
parameter windows of the largest layers (stage 3); the table shows both.

  OPENBLAS_CORETYPE=SkylakeX python3 bench/zero_bench.py \\
      --train build/train --data data/fashion-mnist/train
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile

ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
MODELS = {"mlp": ["--model", "mlp", "--hidden", "1024,1024"], "cnn": ["--model", "cnn"]}
BATCH = {"mlp": 128, "cnn": 64}  # per rank, one micro-batch


def train(args, ranks, flags):
    cmd = [args.mpirun, "-np", str(ranks), "--oversubscribe", "--bind-to", "none", args.train, "--data", args.data,
           "--threads", "1"] + flags
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, check=True).stdout


def memory(args, model, optimizer, zero, dp):
    out = train(args, dp, MODELS[model] + ["--dry-run", "--zero", str(zero), "--optimizer", optimizer,
                                           "--global-batch", str(BATCH[model] * dp), "--bucket-mb", args.bucket_mb])
    psi = int(re.search(r"\), (\d+) parameters", out).group(1))
    rows = re.findall(r"ranks? ([\d-]+) \(stage \d+, replicas? [\d-]+\): params (\d+), grads (\d+), optimizer (\d+)", out)
    worst = max(rows, key=lambda r: int(r[1]) + int(r[2]) + int(r[3]))  # the fullest rank
    return psi, [int(v) for v in worst[1:]]


def formula(psi, zero, dp, k):
    p, g, o = 4 * psi, 4 * psi, k * psi
    return [p, g, o] if zero == 0 else [p, g, o / dp] if zero == 1 else [p, g / dp, o / dp] if zero == 2 else \
        [p / dp, g / dp, o / dp]


def timing(args, model, zero, dp):
    metrics = os.path.join(tempfile.mkdtemp(), "m.jsonl")
    train(args, dp, MODELS[model] + ["--zero", str(zero), "--steps", str(args.steps), "--log-every", "20",
                                     "--global-batch", str(BATCH[model] * dp), "--metrics", metrics,
                                     "--bucket-mb", args.bucket_mb, "--optimizer", "sgd"])
    # Progress lines only (evaluation lines have an "eval" key); the first window includes warm-up.
    records = [r for r in (json.loads(l) for l in open(metrics)) if "eval" not in r][1:]
    rate = statistics.median(r["samples_per_s"] for r in records)
    sent = statistics.median(r.get("dp_bytes_per_step", float("nan")) for r in records)
    return BATCH[model] * dp / rate * 1e3, sent


def mb(x):
    return f"{x / 2**20:.2f}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train", default="build/train")
    p.add_argument("--data", default="data/fashion-mnist/train")
    p.add_argument("--mpirun", default="mpirun")
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--bucket-mb", default="1")
    p.add_argument("--memory-only", action="store_true", help="the bytes table only, no timed runs")
    a = p.parse_args()

    print(f"## Bytes per rank (MiB, the fullest rank; fp32; --bucket-mb {a.bucket_mb}): measured vs paper formula\n")
    print("| model | optimizer | dp | zero | params | grads | optimizer state | total | formula total | formula p / g / o |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for model in MODELS:
        for optimizer, k in (("sgd", 4), ("adamw", 8)):
            for dp in a.dp:
                for zero in a.stages:
                    psi, got = memory(a, model, optimizer, zero, dp)
                    want = formula(psi, zero, dp, k)
                    print(f"| {model} | {optimizer} | {dp} | {zero} | {mb(got[0])} | {mb(got[1])} | {mb(got[2])} | "
                          f"{mb(sum(got))} | {mb(sum(want))} | {' / '.join(mb(w) for w in want)} |", flush=True)

    if a.memory_only:
        return
    print(f"\n## Step time and data-parallel bytes sent per step and rank (dp = 2, SGD-momentum, {a.steps} steps, "
          f"one micro-batch of {BATCH['mlp']} (mlp) / {BATCH['cnn']} (cnn) per rank)\n")
    print("| model | zero | step ms | MiB sent per step | vs zero 0 |")
    print("|---|---:|---:|---:|---:|")
    for model in MODELS:
        base = None
        for zero in a.stages:
            ms, sent = timing(a, model, zero, 2)
            base = sent if zero == 0 else base
            print(f"| {model} | {zero} | {ms:.2f} | {mb(sent)} | {sent / base:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
