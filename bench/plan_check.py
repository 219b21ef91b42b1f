#!/usr/bin/env python3
"""--plan's step-time model against measured steps, side by side: for layouts of a small GPT on 2
ranks of this machine, the time `train --dry-run` models for each (the number --plan ranks layouts
by; docs/parallelism.md, "Will it fit?") and the step time `train` then measures (median of the
progress windows after the first). The model is a bound that ranks layouts, not a prediction of
seconds, so what matters is the order: the table ends with the rank correlation of the two
columns and the pairs the model orders the wrong way round. Each layout is measured --repeats
times, the layouts in a rotating order (round r starts r layouts further on), so a slow minute
of the machine falls on different layouts; the median counts, and the range says which
measured differences are noise: a pair whose ranges overlap is a measured tie.

  python3 bench/plan_check.py --train build/train            # ~10 minutes on 2 idle cores
  python3 bench/plan_check.py --gbps 1.5 --steps 8 --repeats 3   # a bandwidth of your own

The rates are measured once, by the first dry run on the 2 ranks, and then given to every dry
run, so all predictions use the same ones: the compute rate (the GEMMs `train` times when
--plan-tflops is 0) and, unless --gbps gives it, the bandwidth per rank the model charges
communication at (what `train` measures when --plan-gbps is 0: all-reduces between the ranks
while they compute; idle cores' shared memory reaches ~10-30 GB/s of bus bandwidth by
bench_collectives, several times more). OpenBLAS runs its own kernel choice
(OPENBLAS_CORETYPE is unset).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile

ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
ENV.pop("OPENBLAS_CORETYPE", None)
ENV.pop("OPENBLAS_L2_SIZE", None)

# (name, flags) on 2 ranks; the global batch is 16 sequences.
LAYOUTS = [
    ("dp 2", []),
    ("dp 2, 2 micro-batches", ["--micro-batch", "4"]),
    ("dp 2, zero 3", ["--zero", "3"]),
    ("dp 2, recompute block", ["--recompute", "block"]),
    ("tp 2", ["--tp", "2"]),
    ("tp 2, 2 micro-batches", ["--tp", "2", "--micro-batch", "8"]),
    ("tp 2, sequence-parallel", ["--tp", "2", "--sequence-parallel"]),
    ("pp 2, m 2", ["--pp", "2", "--micro-batch", "8"]),
    ("pp 2, m 4", ["--pp", "2", "--micro-batch", "4"]),
    ("pp 2, m 8", ["--pp", "2", "--micro-batch", "2"]),
]


def token_file(work):
    """Random token ids (the cost does not depend on them), written by Debian's h5py."""
    script = """
import sys, h5py, numpy as np
with h5py.File(sys.argv[1], "w") as f:
    f.create_dataset("tokens", data=np.random.default_rng(0).integers(0, 8192, 200_000, dtype=np.uint16))
    f.attrs["kind"] = "tokens"; f.attrs["vocab_size"] = np.int64(8192)
    f.attrs["num_tokens"] = np.int64(200_000); f.attrs["tokenizer"] = "external"; f.attrs["eot"] = np.int64(0)
"""
    path = os.path.join(work, "train.h5")
    subprocess.run(["/usr/bin/python3", "-c", script, path], check=True)
    return path


def run(args, flags, ranks=2):
    cmd = [args.mpirun, "-np", str(ranks), "--oversubscribe", "--bind-to", "none", args.train] + flags
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, check=True).stdout


def modelled(args, common, flags, tflops, rows, gbps):
    """The dry run's step-time model of the layout, launched on the 2 ranks: total, compute,
    bubble, dp, tp, pp, and the TFLOP/s, half-rate rows and GB/s it used (0: `train` measures
    them: its GEMMs, and all-reduces between the 2 ranks while they compute)."""
    out = run(args, common + flags + ["--dry-run", "--plan-tflops", str(tflops), "--plan-rows", str(rows),
                                      "--plan-gbps", str(gbps)])
    m = re.search(r"step-time model: (\S+) s per step \(compute / bubble / dp / tp / pp: (\S+) / (\S+) / (\S+) / "
                  r"(\S+) / (\S+)\) at (\S+) TFLOP/s \(half that below (\S+) rows\) and (\S+) GB/s per rank", out)
    assert m, out
    return [float(v) for v in m.groups()]


def measured(args, common, flags, work):
    metrics = os.path.join(work, "m.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    run(args, common + flags + ["--steps", str(args.steps), "--log-every", "2", "--metrics", metrics])
    windows = [r for r in (json.loads(line) for line in open(metrics)) if "eval" not in r][1:]
    return statistics.median(r["step_time_s"] for r in windows)


def ranks_of(values):
    """Ranks from 0, equal values sharing their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    k = 0
    while k < len(order):
        end = k
        while end + 1 < len(order) and values[order[end + 1]] == values[order[k]]:
            end += 1
        for i in order[k:end + 1]:
            ranks[i] = (k + end) / 2
        k = end + 1
    return ranks


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train", default="build/train")
    p.add_argument("--mpirun", default="mpirun")
    p.add_argument("--gbps", type=float, default=0.0, help="0: what train measures (the planner's default)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    work = tempfile.mkdtemp()
    common = ["--model", "gpt", "--layers", "4", "--heads", "4", "--embed", "256", "--seq-len", "128", "--vocab",
              "8192", "--optimizer", "adamw", "--lr", "1e-4", "--global-batch", "16", "--threads", "1", "--seed", "1",
              "--data", token_file(work)]
    # Measured once (or given), then given to every prediction, so that all use the same rates.
    tflops, half_rows, gbps = modelled(a, common, [], 0, 0, a.gbps)[6:9]
    print(f"GPT 4 x 256, T 128, vocabulary 8192, 16 sequences per step, 2 ranks of 1 thread; model at {tflops:.3g} "
          f"TFLOP/s, half that below {half_rows:.3g} rows (measured GEMMs) and {gbps:.3g} GB/s "
          f"({'given' if a.gbps else 'measured by train'}); measured: median over "
          f"{a.repeats} runs (rotating order) of each run's median step of {a.steps} steps' windows after the first\n")
    models = [modelled(a, common, flags, tflops, half_rows, gbps) for _, flags in LAYOUTS]
    times = [[] for _ in LAYOUTS]
    for r in range(a.repeats):
        for k in range(len(LAYOUTS)):
            i = (k + r) % len(LAYOUTS)
            times[i].append(measured(a, common, LAYOUTS[i][1], work))
    print("| layout | modelled s | compute / bubble / dp / tp / pp | measured s (median) | range | measured / modelled |")
    print("|---|---:|---|---:|---:|---:|")
    rows = []
    for (name, _), m, ts in zip(LAYOUTS, models, times):
        t = statistics.median(ts)
        rows.append((name, m[0], t, min(ts), max(ts)))
        print(f"| {name} | {m[0]:.3g} | {' / '.join(f'{v:.3g}' for v in m[1:6])} | {t:.3f} | {min(ts):.3f}–{max(ts):.3f} "
              f"| {t / m[0]:.2f} |")
    model_ranks, real_ranks = ranks_of([r[1] for r in rows]), ranks_of([r[2] for r in rows])
    n = len(rows)
    rho = statistics.correlation(model_ranks, real_ranks)  # Pearson's of the ranks: Spearman's, ties averaged
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    wrong = [(i, j) for i, j in pairs if (rows[i][1] - rows[j][1]) * (rows[i][2] - rows[j][2]) < 0]
    ties = sum(1 for i, j in pairs if rows[i][1] == rows[j][1])
    apart = lambda i, j: rows[i][4] < rows[j][3] or rows[j][4] < rows[i][3]  # measured ranges do not overlap
    print(f"\nSpearman rank correlation, modelled vs measured: {rho:.2f}; of {len(pairs)} pairs, {ties} modelled "
          f"equal and {len(wrong)} ordered the other way round ({sum(1 for p in wrong if apart(*p))} of them with "
          f"measured ranges apart; {sum(1 for p in pairs if apart(*p))} pairs are):")
    for i, j in wrong:
        print(f"  {rows[i][0]} / {rows[j][0]}{'' if apart(i, j) else ' (measured ranges overlap)'}")
    # The same measured medians against the model without its small-micro-batch term (--plan-rows
    # ~0: every product at the full rate), the term's effect on the ranking.
    flat = [modelled(a, common, flags, tflops, 1e-6, gbps)[0] for _, flags in LAYOUTS]
    rho_flat = statistics.correlation(ranks_of(flat), real_ranks)
    print(f"without the small-micro-batch term (--plan-rows ~0): rank correlation {rho_flat:.2f}")
    best_model = min(rows, key=lambda r: r[1])[0]
    best_real = min(rows, key=lambda r: r[2])[0]
    print(f"fastest by the model: {best_model}; measured: {best_real}")


if __name__ == "__main__":
    main()
