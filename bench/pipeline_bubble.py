#!/usr/bin/env python3
"""Measured pipeline bubble per stage against (P-1)/(m+P-1), from the executor's own timeline.

Trains an MLP whose stages are balanced by construction (8 input features, so fc1 is nearly
free and every stage holds one 1024x1024 layer), records the last step's timeline with
--timeline, and reads per-stage idle fractions and event times back from the SVG. The
point-to-point overhead per micro-batch is the gap between a stage's forward(i) ending and the
next stage's forward(i) starting, where the next stage was waiting for it. Each case runs
--repeats times (default 7); the table shows medians (per stage for the idle fractions). Every
run is paired with one of `train --shared-memory false` (messages through MPI instead of the
shared-memory mailboxes), the baseline columns.

  python3 bench/pipeline_bubble.py --train build/train --data-tool build/strata-data [--stages 2 4]
      [--schedules gpipe 1f1b interleaved] [--virtual-stages 2 4]
Run with the OpenBLAS kernels named (OPENBLAS_CORETYPE=SkylakeX on AVX-512 CPUs, as bench/lib.sh does).

With --sleep-ms T, every stage sleeps T ms per micro-batch forward and 2T per backward
(train --bench-stage-ms) and the layers are 64 wide, so compute takes no core: the schedule's
bubble and the hand-offs are measured with more stages than cores (P = 4 on 2 cores).
"""
import argparse
import os
import re
import shlex
import statistics
import subprocess
import tempfile

EVENT = re.compile(r"<title>stage (\d+) ([FB])(\d+): ([0-9.e+-]+) - ([0-9.e+-]+) s</title>")


def run_case(args, data, stages, m, kind, work, extra=(), chunks=1):
    # chunks > 1: the interleaved schedule, P x chunks virtual stages of one layer each.
    virtual = stages * chunks
    hidden = ",".join([str(args.width)] * (virtual + 1))
    # layers: flatten, (fc_i, relu_i) x (virtual+1), fc_out; stage 0 = fc1 + fc2, then one fc each
    cuts = ",".join(str(5 + 2 * k) for k in range(virtual - 1))
    svg = os.path.join(work, f"tl-{kind}-{stages}-{m}.svg")
    if chunks > 1:
        extra = tuple(extra) + ("--virtual-stages", str(chunks))
    cmd = shlex.split(args.mpirun) + ["-np", str(stages), "--oversubscribe", "--bind-to", "none", args.train, "--model", "mlp",
           "--hidden", hidden, "--data", data, "--steps", str(args.steps), "--global-batch", str(m * args.micro_batch),
           "--micro-batch", str(args.micro_batch), "--pp", str(stages), "--partition", cuts, "--schedule", kind,
           "--threads", "1", "--log-every", "1000", "--timeline", svg, "--bench-stage-ms", str(args.sleep_ms)] + list(extra)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_mpi_yield_when_idle="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    bubbles = [float(v) for v in re.search(r"bubble \(idle\) fraction per stage: ([0-9.e\- ]+?)\s+\(", out).group(1).split()]
    found = EVENT.findall(open(svg).read())
    step = max(float(b) for *_, b in found) - min(float(a) for *_, a, _ in found)
    if chunks > 1:  # events carry no chunk: no per-hand-off gaps
        return bubbles, float("nan"), step
    events = {}
    for s, op, i, a, b in found:
        events[(int(s), op, int(i))] = (float(a), float(b))
    gaps = []
    for s in range(1, stages):
        for i in range(m):
            prev_end = events[(s - 1, "F", i)][1]
            start = events[(s, "F", i)][0]
            earlier = [e[1] for k, e in events.items() if k[0] == s and e[1] <= start and e != events[(s, "F", i)]]
            if not earlier or max(earlier) < prev_end:  # stage s was idle, waiting for this message
                gaps.append(start - prev_end)
    return bubbles, (statistics.median(gaps) if gaps else float("nan")), step


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train", default="build/train")
    p.add_argument("--data-tool", default="build/strata-data")
    p.add_argument("--mpirun", default="mpirun", help="a command: may carry a launcher, e.g. 'strata-bundle/run mpirun'")
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    p.add_argument("--micro", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=7, help="runs per case; medians reported (one step is noisy)")
    p.add_argument("--sleep-ms", type=float, default=0.0, help="stand-in compute per micro-batch forward (2x backward), no core used")
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], help="gpipe, 1f1b, interleaved")
    p.add_argument("--virtual-stages", type=int, nargs="+", default=[2], help="interleaved: chunks per rank (one layer each)")
    a = p.parse_args()
    a.width = 64 if a.sleep_ms > 0 else 1024
    work = tempfile.mkdtemp(prefix="strata-bubble-")
    data = os.path.join(work, "features")
    subprocess.run(shlex.split(a.data_tool) + ["synthetic", "--out", data, "--samples", "16384", "--shape", "8", "--classes", "10",
                    "--dtype", "f32"], check=True, capture_output=True)
    compute = (f"stand-in compute: sleeps of {a.sleep_ms:g} ms per forward, {2 * a.sleep_ms:g} ms per backward"
               if a.sleep_ms > 0 else "real compute")
    print(f"cores: {os.cpu_count()}; micro-batch {a.micro_batch}; MLP 8-{a.width}x(P+1)-10, one {a.width}x{a.width} layer "
          f"per stage; {compute}; medians of {a.repeats} runs per case")
    print("Messages through shared-memory mailboxes (train's default on one node); baseline: the same runs with "
          "--shared-memory false (MPI point-to-point), interleaved")
    print("Interleaved, v chunks per rank: each chunk's forward sleeps the stand-in time, formula (P-1)/(v*m+P-1)")
    print("| P | m | schedule | formula (P-1)/(m+P-1) | measured idle per stage | worst - formula | p2p overhead per "
          "micro-batch | step | MPI p2p: worst - formula | MPI p2p: overhead per micro-batch |")
    print("|---:|---:|---|---:|---|---:|---:|---:|---:|---:|")
    for stages in a.stages:
        for m in a.micro:
            cases = [(k, 1) for k in a.schedules if k != "interleaved"]
            if "interleaved" in a.schedules and m % stages == 0:  # its chunks take turns in groups of P
                cases += [("interleaved", v) for v in a.virtual_stages]
            for kind, v in cases:
                formula = (stages - 1) / (v * m + stages - 1)
                runs, base = [], []
                for _ in range(a.repeats):
                    runs.append(run_case(a, data + ".h5", stages, m, kind, work, chunks=v))
                    base.append(run_case(a, data + ".h5", stages, m, kind, work, ("--shared-memory", "false"), chunks=v))

                def summary(rs):
                    bubbles = [statistics.median(r[0][s] for r in rs) for s in range(stages)]
                    worst = max(abs(b - formula) for b in bubbles)
                    return bubbles, worst, statistics.median(r[1] for r in rs), statistics.median(r[2] for r in rs)

                bubbles, worst, gap, step = summary(runs)
                _, base_worst, base_gap, _ = summary(base)
                note = " (oversubscribed)" if stages > (os.cpu_count() or 1) and a.sleep_ms == 0 else ""
                label = kind if v == 1 else f"interleaved v={v}"
                print(f"| {stages}{note} | {m} | {label} | {100 * formula:.1f}% | "
                      f"{' '.join(f'{100 * b:.1f}%' for b in bubbles)} | {100 * worst:.1f} pt | "
                      f"{1e6 * gap:.0f} µs | {1e3 * step:.1f} ms | {100 * base_worst:.1f} pt | {1e6 * base_gap:.0f} µs |",
                      flush=True)


if __name__ == "__main__":
    main()
