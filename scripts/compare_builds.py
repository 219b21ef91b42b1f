#!/usr/bin/python3
"""Proves that two builds of Strata train bit-identically (for refactors that must not change results).

Usage: compare_builds.py --old OLD_BUILD_DIR --new NEW_BUILD_DIR [--workdir DIR] [--steps 50]
                         [--only NAME,...] [--mpirun mpirun] [--new-flags='--lr 0.051']

Each build directory holds `train` and `strata-data`. One small dataset (and a held-out split) is made
with OLD's strata-data (NEW's output is compared with it too); then every configuration below trains
with OLD and with NEW, one after the other, in DIR/old/NAME and DIR/new/NAME (same relative paths, so
the effective options match). Per configuration, every checkpoint both runs wrote is compared bit for
bit: each group, dataset (dtype, shape, raw bytes) and attribute. The root `config` attribute (the
options as text) may differ when option printing changes: its diff is printed as a note, not a
failure. The --metrics lines must match exactly apart from timing fields, and so must stdout's
result lines (evaluations, final test, loss-scale overflows, resuming). Exit code 1 if anything
differs or a run fails. --new-flags (debug) appends flags to NEW's train commands, to see a difference
detected.
"""
import argparse
import difflib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
TIMING = ("samples_per_s", "tokens_per_s", "step_time_s", "split", "tflops_per_rank", "mfu", "eta_s")  # vary run to run
RESULT_LINES = re.compile(r"^(eval at step|final test|final evaluation|evaluation|resuming from|step \d+: gradients overflowed).*", re.M)

MLP = ["--model", "mlp", "--hidden", "32,32", "--dropout", "0.1"]
CNN = ["--model", "cnn"]
SGD = ["--optimizer", "sgd", "--momentum", "0.9"]
ADAMW = ["--optimizer", "adamw", "--clip-grad", "1.0"]
FP16 = ["--precision", "fp16", "--loss-scale-init", "1024", "--loss-scale-window", "3"]
# A tiny GPT on byte-tokenized text (tensor-parallel and interleaved layouts): windows of 16.
GPT = ["--model", "gpt", "--layers", "4", "--heads", "2", "--embed", "32", "--seq-len", "16", "--vocab", "258",
       "--dropout", "0.1",
       "--data", "{data}/gpt-train.h5", "--val-data", "{data}/gpt-val.h5"]
# (name, phases): each phase is (ranks, flags), run in order in the same directory (checkpoints and
# metrics shared); a phase without --steps trains to --steps. Flags override run_config's common ones.
CONFIGS = [
    ("mlp-1rank-accum4",       [(1, MLP + SGD + ["--micro-batch", "8"])]),
    ("mlp-dp2",                [(2, MLP + SGD)]),
    ("mlp-dp2-accum2",         [(2, MLP + SGD + ["--micro-batch", "8"])]),
    ("cnn-dp2-accum2",         [(2, CNN + SGD + ["--micro-batch", "8"])]),
    ("resnet8-dp2-shards",     [(2, ["--model", "resnet", "--depth", "8", "--width", "4", "--data", "{data}/shards",
                                     "--micro-batch", "8"])]),
    ("mlp-dp2-nesterov-cosine", [(2, MLP + SGD + ["--nesterov", "true", "--weight-decay", "1e-4", "--lr-schedule",
                                                  "cosine", "--warmup-steps", "5", "--min-lr", "0.001"])]),
    ("mlp-pp2-1f1b",           [(2, MLP + SGD + ["--pp", "2", "--schedule", "1f1b", "--micro-batch", "8"])]),
    ("mlp-pp2-gpipe",          [(2, MLP + SGD + ["--pp", "2", "--schedule", "gpipe", "--micro-batch", "8"])]),
    ("cnn-pp2-1f1b",           [(2, CNN + SGD + ["--pp", "2", "--micro-batch", "8"])]),
    ("mlp-pp2xdp2",            [(4, MLP + SGD + ["--pp", "2", "--micro-batch", "4"])]),
    ("mlp-pp2xdp2-gpipe-mpi",  [(4, MLP + SGD + ["--pp", "2", "--schedule", "gpipe", "--micro-batch", "4",
                                                 "--shared-memory", "false"])]),
    ("mlp-dp2-zero1-sgd",      [(2, MLP + SGD + ["--zero", "1", "--micro-batch", "4"])]),
    ("mlp-dp2-zero2-sgd",      [(2, MLP + SGD + ["--zero", "2", "--micro-batch", "4"])]),
    ("mlp-dp2-zero3-sgd",      [(2, MLP + SGD + ["--zero", "3", "--micro-batch", "4"])]),
    ("mlp-dp2-zero0-adamw",    [(2, MLP + ADAMW + ["--micro-batch", "4"])]),
    ("mlp-dp2-zero1-adamw",    [(2, MLP + ADAMW + ["--zero", "1", "--micro-batch", "4"])]),
    ("mlp-dp2-zero2-adamw",    [(2, MLP + ADAMW + ["--zero", "2", "--micro-batch", "4"])]),
    ("mlp-dp2-zero3-adamw",    [(2, MLP + ADAMW + ["--zero", "3", "--micro-batch", "4"])]),
    ("cnn-dp2-zero3-sgd",      [(2, CNN + SGD + ["--zero", "3", "--micro-batch", "8"])]),
    ("mlp-pp2xdp2-zero3",      [(4, MLP + ADAMW + ["--pp", "2", "--zero", "3", "--micro-batch", "4"])]),
    ("mlp-dp2-bf16-adamw",     [(2, MLP + ADAMW + ["--precision", "bf16", "--micro-batch", "8"])]),
    ("mlp-dp2-bf16-zero3",     [(2, MLP + ADAMW + ["--precision", "bf16", "--zero", "3"])]),
    ("mlp-dp2-fp16-overflow",  [(2, MLP + SGD + FP16 + ["--micro-batch", "8", "--debug-overflow-step", "7"])]),
    ("mlp-dp2-fp16-zero2",     [(2, MLP + ADAMW + FP16 + ["--zero", "2"])]),
    ("gpt-tp2",                [(2, GPT + SGD + ["--tp", "2"])]),
    ("gpt-tp2xdp2-zero3-adamw", [(4, GPT + ADAMW + ["--tp", "2", "--zero", "3", "--micro-batch", "4"])]),
    ("gpt-tp2xpp2-untied",     [(4, GPT + SGD + ["--tp", "2", "--pp", "2", "--micro-batch", "8",
                                                 "--tie-embeddings", "false"])]),
    ("gpt-pp2-interleaved",    [(2, GPT + SGD + ["--pp", "2", "--virtual-stages", "2", "--schedule", "interleaved",
                                                 "--micro-batch", "4"])]),
    ("gpt-pp2xdp2-interleaved-zero2", [(4, GPT + ADAMW + ["--pp", "2", "--virtual-stages", "2", "--schedule",
                                                          "interleaved", "--zero", "2", "--micro-batch", "4"])]),
    ("resume-sgd-pp2xdp2z1-dp2z3", [(4, MLP + SGD + ["--pp", "2", "--zero", "1", "--steps", "20"]),
                                    (2, MLP + SGD + ["--zero", "3", "--resume", "auto"])]),
    ("resume-adamw-4-2-1-chain",   [(4, MLP + ADAMW + ["--pp", "2", "--zero", "1", "--steps", "20"]),
                                    (2, MLP + ADAMW + ["--zero", "0", "--steps", "30", "--resume", "auto"]),
                                    (1, MLP + ADAMW + ["--micro-batch", "16", "--resume", "auto"])]),
    ("resume-fp16-path-1-2",       [(1, MLP + SGD + FP16 + ["--steps", "20"]),
                                    (2, MLP + SGD + FP16 + ["--zero", "2", "--resume", "ck/step-00000020.h5"])]),
]


def make_data(build, out):
    """The training set (also as 2 shards) and a held-out split with the training statistics."""
    os.makedirs(out, exist_ok=True)
    tool = os.path.join(build, "strata-data")
    for extra in (["--out", f"{out}/toy"], ["--out", f"{out}/shards/toy", "--shards", "2"],
                  ["--out", f"{out}/val", "--first-sample", "2048", "--stats-from", f"{out}/toy.h5"]):
        cmd = [tool, "synthetic", "--samples", "512" if "val" in extra[1] else "2048", "--shape", "1,8,8",
               "--classes", "4", "--seed", "1"] + extra
        subprocess.run(cmd, check=True, capture_output=True)
    # Byte tokens of two licence texts (Debian's base-files): {data}/gpt-train.h5 and gpt-val.h5.
    texts = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0"]
    subprocess.run([tool, "tokenize", "--input"] + texts + ["--out", f"{out}/gpt", "--tokenizer", "byte"], check=True,
                   capture_output=True)


def run_config(build, phases, cwd, data, steps, extra_flags):
    """Runs the phases of one configuration in cwd; returns (error or None, stdout result lines)."""
    shutil.rmtree(cwd, ignore_errors=True)
    os.makedirs(cwd)
    common = ["--data", f"{data}/toy.h5", "--val-data", f"{data}/val.h5", "--global-batch", "32", "--lr", "0.05",
              "--seed", "3", "--threads", "1", "--bucket-mb", "0.01", "--log-every", "5", "--eval-every", "25",
              "--checkpoint-dir", "ck", "--metrics", "metrics.jsonl"]
    results = []
    for ranks, flags in phases:
        # Every flag takes a value; a later one replaces an earlier one (train rejects repeats).
        options = dict(zip(*[iter(common + ["--steps", str(steps)] + flags + extra_flags)] * 2))
        cmd = [ARGS.mpirun, "-np", str(ranks), "--oversubscribe", "--bind-to", "none", os.path.join(build, "train")]
        cmd += [v.replace("{data}", data) for kv in options.items() for v in kv]
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=dict(os.environ, **MPI_ENV), timeout=600)
        if p.returncode != 0:
            return f"exit {p.returncode}: {shlex.join(cmd)}: " + " | ".join(p.stderr.strip().splitlines()[:2]), results
        results += [m.group(0) for m in RESULT_LINES.finditer(p.stdout)]
    return None, results


def h5_items(path):
    """{name: (kind, attrs, data)} for the root, every group and every dataset."""
    items = {}
    with h5py.File(path, "r") as f:
        items["/"] = ("group", dict(f.attrs), None)
        f.visititems(lambda n, o: items.update({n: ("dataset", dict(o.attrs), o[()]) if isinstance(o, h5py.Dataset)
                                               else ("group", dict(o.attrs), None)}))
    return items


def same_value(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def max_abs(a, b):
    try:
        return f"max abs difference {np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))):.3g}"
    except (TypeError, ValueError):
        return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"


def same_evaluation(x, y):
    """Two evaluation lines that print the same values in another format (digits, words, a count
    added): each number of the shorter list equal to its partner to the coarser of the two printed
    precisions. The full-precision values are in --metrics, compared exactly."""
    if x is None or y is None or x.split(":")[0] != y.split(":")[0]:
        return False
    number = re.compile(r"-?\d+(?:\.(\d+))?(?:e[-+]?\d+)?")
    xs, ys = list(number.finditer(x)), list(number.finditer(y))
    for a, b in zip(xs, ys):
        decimals = min(len(a.group(1) or ""), len(b.group(1) or ""))
        if "e" in a.group(0) + b.group(0) or abs(float(a.group(0)) - float(b.group(0))) > 0.5 * 10 ** -decimals + 1e-12:
            return False
    return True


def compare_h5(old, new, label):
    """Returns (first difference or None, config note or None) for two HDF5 files."""
    a, b = h5_items(old), h5_items(new)
    note = None
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b or a[name][0] != b[name][0]:
            return f"{label}:{name} only in {'new' if name not in a else 'old'} (or a group in one)", note
        (kind, attrs_a, data_a), (_, attrs_b, data_b) = a[name], b[name]
        if kind == "dataset" and not same_value(data_a, data_b):
            return f"{label}:{name} {max_abs(data_a, data_b)}", note
        for key in sorted(set(attrs_a) | set(attrs_b)):
            va, vb = attrs_a.get(key), attrs_b.get(key)
            if name == "/" and key == "config":
                if va != vb:  # the changed lines, '-old' then '+new'
                    lines = difflib.unified_diff(str(va).splitlines(), str(vb).splitlines(), lineterm="", n=0)
                    note = "  ".join(l for l in lines if l[:1] in "-+" and l[:3] not in ("---", "+++"))
            elif va is None or vb is None or not same_value(va, vb):
                return f"{label}:{name} attribute {key}: {va!r} vs {vb!r}", note
    return None, note


def metrics(path, varying=TIMING):
    lines = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
    return [{k: v for k, v in line.items() if k not in varying} for line in lines]


def compare_runs(old_dir, new_dir, old_lines, new_lines, flags):
    """Returns (first difference or None, config note or None) for two runs of one configuration."""
    # Without shared memory, MPI's receives complete in the order the network delivers them, so the
    # allocator's high-water mark varies run to run (one build against itself differs by 512 B).
    varying = TIMING + (("peak_bytes",) if "--shared-memory" in flags else ())
    ck_old, ck_new = sorted(os.listdir(f"{old_dir}/ck")), sorted(os.listdir(f"{new_dir}/ck"))
    if ck_old != ck_new:
        return f"checkpoint files differ: {ck_old} vs {ck_new}", None
    if open(f"{old_dir}/ck/latest").read() != open(f"{new_dir}/ck/latest").read():
        return "ck/latest differs", None
    note = None
    for name in ck_old:
        if name.endswith(".h5"):
            diff, note = compare_h5(f"{old_dir}/ck/{name}", f"{new_dir}/ck/{name}", name)
            if diff:
                return diff, note
    m_old, m_new = metrics(f"{old_dir}/metrics.jsonl", varying), metrics(f"{new_dir}/metrics.jsonl", varying)
    for i, (x, y) in enumerate(zip(m_old + [None] * len(m_new), m_new + [None] * len(m_old))):
        if x != y:
            return f"metrics line {i + 1}: {x} vs {y}", note
    for x, y in zip(old_lines + [None] * len(new_lines), new_lines + [None] * len(old_lines)):
        if x != y and not same_evaluation(x, y):
            return f"stdout: {x!r} vs {y!r}", note
    return None, note


def main():
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, help="build directory with the reference train and strata-data")
    p.add_argument("--new", required=True, help="build directory with the train and strata-data to check")
    p.add_argument("--workdir", help="where data, runs and checkpoints go (default: a new temporary directory)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--only", help="comma-separated configuration names")
    p.add_argument("--mpirun", default="mpirun")
    p.add_argument("--new-flags", default="", help="debug: flags appended to NEW's train runs (shows a difference)")
    ARGS = p.parse_args()
    ARGS.old, ARGS.new = os.path.abspath(ARGS.old), os.path.abspath(ARGS.new)
    for build in (ARGS.old, ARGS.new):
        for program in ("train", "strata-data"):
            if not os.access(os.path.join(build, program), os.X_OK):
                p.error(f"{build}/{program} is not an executable")
    work = os.path.abspath(ARGS.workdir or tempfile.mkdtemp(prefix="strata-compare-"))
    configs = [c for c in CONFIGS if not ARGS.only or c[0] in ARGS.only.split(",")]
    start = time.monotonic()

    data = f"{work}/data"
    shutil.rmtree(data, ignore_errors=True)
    shutil.rmtree(f"{work}/data-new", ignore_errors=True)
    make_data(ARGS.old, data)
    make_data(ARGS.new, f"{work}/data-new")
    rows, failed = [], False
    diff = next(filter(None, (compare_h5(f"{data}/{f}", f"{work}/data-new/{f}", f)[0]
                              for f in ("toy.h5", "val.h5", "shards/toy-00000-of-00002.h5",
                                        "shards/toy-00001-of-00002.h5"))), None)
    rows.append(("strata-data synthetic", "-", "DIFFERENT" if diff else "IDENTICAL", diff or ""))
    failed |= bool(diff)
    print(f"{'configuration':28} {'ranks':7} {'result':10} detail", flush=True)
    print(f"{rows[0][0]:28} {rows[0][1]:7} {rows[0][2]:10} {rows[0][3]}", flush=True)

    for name, phases in configs:
        t0 = time.monotonic()
        ranks = ">".join(str(r) for r, _ in phases)
        old_err, old_lines = run_config(ARGS.old, phases, f"{work}/old/{name}", data, ARGS.steps, [])
        new_err, new_lines = run_config(ARGS.new, phases, f"{work}/new/{name}", data, ARGS.steps,
                                        shlex.split(ARGS.new_flags))
        note = None
        if old_err or new_err:
            result, detail = "FAILED", f"old {old_err}" if old_err else f"new {new_err}"
        else:
            flags = [f for _, phase_flags in phases for f in phase_flags]
            diff, note = compare_runs(f"{work}/old/{name}", f"{work}/new/{name}", old_lines, new_lines, flags)
            result, detail = ("DIFFERENT", diff) if diff else ("IDENTICAL", "")
        failed |= result != "IDENTICAL"
        print(f"{name:28} {ranks:7} {result:10} {detail} ({time.monotonic() - t0:.1f} s)", flush=True)
        if note:
            print(f"  note (not a failure): the config attribute differs: {note}")

    print(f"{len(configs)} configurations, --steps {ARGS.steps}, workdir {work}, {time.monotonic() - start:.0f} s: "
          f"{'SOME DIFFER OR FAILED' if failed else 'ALL IDENTICAL'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
