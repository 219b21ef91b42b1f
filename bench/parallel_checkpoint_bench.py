#!/usr/bin/env python3
"""Checkpoint save and load of a GPT with 772 MB of state at 1, 2 and 4 ranks: --checkpoint-io
rank0 (rank 0 gathers and writes) against parallel (every rank writes its part: parallel HDF5
over MPI-IO), and the stall of --async-save in each (rank 0 writing in the background, or every
rank its part), beside a plain sequential write (+fsync) and read of the same number of bytes on
the same disk, in the same invocation.

Usage: /usr/bin/python3 bench/parallel_checkpoint_bench.py --train build/train --data-tool build/strata-data
       [--dir /tmp/pckbench] [--saves 4] [--ranks 1,2,4]

The model: GPT, 4 blocks of width 512, 8 heads, a 50257-token vocabulary (GPT-2's; the byte-level
data uses the first 257), untied head, AdamW: 64.3 M parameters, 3 tensors each (value, exp_avg,
exp_avg_sq) = 772 MB of f32. At N ranks: data parallel with ZeRO 1 (N > 1), so the optimizer
state, two thirds of the bytes, is sharded: in parallel mode each rank writes its shard of it,
replica 0 the model. Save time: what each 'saved checkpoint' line reports (rank 0, from the
start of the save to the commit: gather or parallel write, crc32s, fsync, manifest, rename),
median over the saves after the first (which touches fresh pages). Held: the step's stall with
--async-save (its line's 'training held'; with every rank writing, rank 0's, from the start of
the save to the step going on: the parts gathered, copied and the file's tensors created). Load: wall time of a --resume run of one more step
minus a fresh run of one step (median of 3), the file's pages dropped from the page cache first;
each rank reads only its parts (hyperslabs) after rank 0's whole-file crc32 check.
"""
import argparse
import os
import re
import statistics
import subprocess
import time

import h5py

from checkpoint_bench import drop_cache, plain_read, plain_write  # the same baseline as 1-rank saves

LICENSES = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0"]
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
MODEL = ["--model", "gpt", "--layers", "4", "--embed", "512", "--heads", "8", "--vocab", "50257", "--seq-len", "64",
         "--tie-embeddings", "false", "--optimizer", "adamw", "--lr", "0.0003", "--global-batch", "8",
         "--log-every", "1000", "--seed", "1", "--threads", "1"]


def run(cmd):
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **MPI_ENV))
    elapsed = time.perf_counter() - t0
    assert p.returncode == 0, f"{' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return elapsed, p.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--data-tool", required=True)
    ap.add_argument("--dir", default="/tmp/pckbench")
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--ranks", default="1,2,4")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    prefix = os.path.join(a.dir, "licenses")
    subprocess.run([a.data_tool, "tokenize", "--input"] + LICENSES + ["--out", prefix, "--tokenizer", "byte"],
                   check=True, capture_output=True)
    # The closing evaluation is of --val-data: a few windows of a short text (the data's own
    # evaluation, 50257-wide logits for every window, would cost more than the saves).
    short = os.path.join(a.dir, "short.txt")
    with open(short, "w") as f:
        f.write(open(LICENSES[1]).read()[:4000])
    subprocess.run([a.data_tool, "tokenize", "--input", short, "--out", prefix + "-short", "--tokenizer", "byte"],
                   check=True, capture_output=True)
    data = ["--data", prefix + "-train.h5", "--val-data", prefix + "-short-val.h5"]
    rows, nbytes = [], 0
    for ranks in (int(r) for r in a.ranks.split(",")):
        launch = ["mpirun", "-np", str(ranks), "--oversubscribe", "--bind-to", "none", a.train] + MODEL + data + (
            ["--zero", "1"] if ranks > 1 else [])
        row = {"ranks": ranks}
        for mode, flags in (("rank0", ["--checkpoint-io", "rank0"]), ("parallel", ["--checkpoint-io", "parallel"]),
                            ("async", ["--checkpoint-io", "rank0", "--async-save"]),
                            ("parallel-async", ["--checkpoint-io", "parallel", "--async-save"])):
            ck = os.path.join(a.dir, f"ck-{ranks}-{mode}")
            subprocess.run(["rm", "-rf", ck], check=True)
            _, out = run(launch + flags + ["--steps", str(a.saves), "--save-every", "1", "--checkpoint-dir", ck])
            lines = re.findall(r"^saved checkpoint \S+ \((\S+) MiB in (\S+) s(?:, written in the background(?: by "
                               r"every rank)?: training held (\S+) s)?\)$", out, re.M)
            assert len(lines) == a.saves, out[-2000:]
            row[mode] = statistics.median(float(t) for _, t, _ in lines[1:])
            if "async" in mode:  # the last save, at the end of training, is waited for
                row[mode + " held"] = statistics.median(float(h) for _, _, h in lines[1:-1])
            last = os.path.join(ck, f"step-{a.saves:08d}.h5")
            nbytes = os.path.getsize(last)
            if mode == "parallel":
                loads = []
                for _ in range(3):
                    drop_cache(last)
                    resumed, _ = run(launch + ["--resume", last, "--steps", str(a.saves + 1)])
                    fresh, _ = run(launch + ["--steps", "1"])
                    loads.append(max(resumed - fresh, 0.0))
                row["load"] = statistics.median(loads)
            if mode != "parallel":
                subprocess.run(["rm", "-rf", ck], check=True)
        rows.append(row)
    plain = os.path.join(a.dir, "plain.bin")
    pw = min(plain_write(plain, nbytes) for _ in range(2))
    pr = min(plain_read(plain) for _ in range(2))
    os.remove(plain)
    mb = nbytes / 1e6
    with h5py.File(os.path.join(a.dir, f"ck-{rows[-1]['ranks']}-parallel", f"step-{a.saves:08d}.h5"), "r") as f:
        params = []
        f["model"].visititems(lambda n, o: params.append(o.size) if isinstance(o, h5py.Dataset) else None)
    print(f"GPT {sum(params) / 1e6:.1f} M parameters, AdamW: a {mb:.0f} MB checkpoint. Plain sequential write + fsync of the same bytes: "
          f"{pw:.2f} s ({mb / pw:.0f} MB/s); plain read (page cache dropped): {pr:.2f} s ({mb / pr:.0f} MB/s).\n")
    print("| ranks | layout | rank0 save s | MB/s | parallel save s | MB/s | parallel / rank0 | async rank0 held s "
          "| held / rank0 save | async parallel held s | held / parallel save | save / plain write | load s | MB/s "
          "| load / plain read |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        layout = "1 rank" if r["ranks"] == 1 else f"dp {r['ranks']}, ZeRO 1"
        best = min(r["rank0"], r["parallel"])
        held, held_parallel = r["async held"], r["parallel-async held"]
        print(f"| {r['ranks']} | {layout} | {r['rank0']:.2f} | {mb / r['rank0']:.0f} | {r['parallel']:.2f} | "
              f"{mb / r['parallel']:.0f} | {r['parallel'] / r['rank0']:.2f}x | {held:.3f} | "
              f"{100 * held / r['rank0']:.0f}% | {held_parallel:.3f} | {100 * held_parallel / r['parallel']:.0f}% | "
              f"{best / pw:.2f}x | {r['load']:.2f} | {mb / max(r['load'], 1e-9):.0f} | {r['load'] / pr:.2f}x |")


if __name__ == "__main__":
    main()
