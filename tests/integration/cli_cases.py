#!/usr/bin/env python3
"""End-to-end cases for the train program, one CTest test per case.

Usage: cli_cases.py CASE --train PATH --workdir DIR [--mpirun PATH]
Datasets are written here with h5py (an oracle we did not write), so every case also checks
that h5py-written files load. Bad-input cases assert: exit code 2, exactly one line on
stderr naming what was expected and what was found, no crash or traceback.
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys

import h5py
import numpy as np

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def write_dataset(path, n=512, shape=(1, 6, 6), classes=4, seed=0, labels=None, inputs_dtype=np.uint8):
    """A learnable task: each class brightens its own band of rows, plus noise."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n) if labels is None else np.asarray(labels)
    x = rng.integers(0, 100, (n,) + tuple(shape)).astype(np.float32)
    rows = shape[-2] if len(shape) >= 2 else shape[-1]
    band = max(1, rows // classes)
    for i, c in enumerate(y):
        if len(shape) >= 2:
            x[i, ..., c * band:(c + 1) * band, :] += 150
        else:
            x[i, c * band:(c + 1) * band] += 150
    x = np.clip(x, 0, 255).astype(inputs_dtype)
    with h5py.File(path, "w") as f:
        f.create_dataset("inputs", data=x)
        f.create_dataset("labels", data=y.astype(np.int64))
    return path


def run(args, cmd, env=None, timeout=120):
    full_env = dict(os.environ, **MPI_ENV, **(env or {}))
    p = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def expect_bad_input(args, flags, pattern, ranks=0):
    cmd = [args.train] + flags
    if ranks:
        cmd = [args.mpirun, "-np", str(ranks), "--oversubscribe", "--quiet"] + cmd
    rc, out, err = run(args, cmd)
    lines = [l for l in err.splitlines() if l.strip()]
    assert rc == 2, f"expected exit code 2, got {rc}\nstdout:\n{out}\nstderr:\n{err}"
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    assert lines[0].startswith("error: "), f"expected 'error: ...', got: {lines[0]}"
    assert re.search(pattern, lines[0]), f"stderr line {lines[0]!r} does not match {pattern!r}"
    for bad in ("terminate called", "Traceback", "core dumped", "Segmentation", "HDF5-DIAG"):
        assert bad not in err + out, f"found {bad!r} in output:\n{err}"


def case_bad_inputs(args):
    w = args.workdir
    good = write_dataset(os.path.join(w, "good.h5"))
    base = ["--model", "mlp", "--hidden", "16", "--steps", "2", "--global-batch", "8"]
    expect_bad_input(args, ["--no-such-flag"], r"no-such-flag")
    expect_bad_input(args, base + ["--data", good, "--lr", "abc"], r"lr.*abc|abc.*lr")
    expect_bad_input(args, base + ["--data", os.path.join(w, "missing.h5")], r"missing\.h5")
    expect_bad_input(args, ["--data", good, "--steps", "1", "--model", "transformer"], r"mlp, cnn, resnet.*transformer")
    expect_bad_input(args, base[:-2] + ["--data", good, "--global-batch", "8", "--micro-batch", "3"], r"micro-batch.*3|3.*micro-batch")
    expect_bad_input(args, ["--data", good, "--model", "mlp"], r"--epochs or --steps")
    expect_bad_input(args, ["--model", "mlp", "--steps", "2", "--data", good, "--hidden", "16,x"], r"--hidden.*16,x")
    expect_bad_input(args, ["--model", "resnet", "--steps", "2", "--data", good, "--dropout", "0.5"],
                     r"--dropout applies to mlp and cnn")
    nested = os.path.join(w, "nested.ini")
    with open(nested, "w") as f:
        f.write(f"data = {good}\nconfig = other.ini\n")
    expect_bad_input(args, base + ["--config", nested], r"cannot include another")
    # Words that follow no flag (an unquoted glob's other files, a list with spaces): not ignored.
    expect_bad_input(args, base + ["--data", good, os.path.join(w, "other.h5")], r"unexpected argument '.*other\.h5'")
    expect_bad_input(args, ["--model", "mlp", "--steps", "2", "--data", good, "--hidden", "16", "16"],
                     r"unexpected argument '16'")

    text = os.path.join(w, "not-hdf5.h5")
    with open(text, "w") as f:
        f.write("hello\n")
    expect_bad_input(args, base + ["--data", text], r"not-hdf5\.h5")

    no_labels = os.path.join(w, "no-labels.h5")
    with h5py.File(no_labels, "w") as f:
        f.create_dataset("inputs", data=np.zeros((10, 1, 6, 6), np.uint8))
    expect_bad_input(args, base + ["--data", no_labels], r"labels")

    empty = os.path.join(w, "empty.h5")
    with h5py.File(empty, "w") as f:
        f.create_dataset("inputs", shape=(0, 1, 6, 6), dtype=np.uint8)
        f.create_dataset("labels", shape=(0,), dtype=np.int64)
    expect_bad_input(args, base + ["--data", empty], r"empty|no samples|0 samples")

    out_of_range = os.path.join(w, "out-of-range.h5")
    with h5py.File(out_of_range, "w") as f:
        f.create_dataset("inputs", data=np.zeros((10, 1, 6, 6), np.uint8))
        lab = f.create_dataset("labels", data=np.array([0, 1, 2, 3, 7, 0, 1, 2, 3, 0]))
        lab.attrs["num_classes"] = 4
    expect_bad_input(args, base + ["--data", out_of_range], r"7")

    negative = os.path.join(w, "negative.h5")
    write_dataset(negative, n=16, labels=[0, 1, 2, 3] * 3 + [0, 1, -1, 2])
    expect_bad_input(args, base + ["--data", negative], r"-1")

    shards = os.path.join(w, "mismatched")
    os.makedirs(shards, exist_ok=True)
    write_dataset(os.path.join(shards, "a.h5"), shape=(1, 6, 6))
    write_dataset(os.path.join(shards, "b.h5"), shape=(1, 7, 7))
    expect_bad_input(args, base + ["--data", shards], r"\[1, 7, 7\].*\[1, 6, 6\]")

    expect_bad_input(args, base + ["--data", os.path.join(w, "nothing-*.h5")], r"nothing-\*\.h5")
    # Too few samples for one global batch.
    small = write_dataset(os.path.join(w, "small.h5"), n=4)
    expect_bad_input(args, base + ["--data", small], r"global-batch")
    # The same under mpirun with 2 ranks: still one line, exit 2 from every rank.
    expect_bad_input(args, base + ["--data", os.path.join(w, "missing.h5")], r"missing\.h5", ranks=2)
    expect_bad_input(args, base[:-2] + ["--data", good, "--global-batch", "9"], r"global-batch 9.*2", ranks=2)
    # A checkpoint from another model.
    ckdir = os.path.join(w, "ck-mlp")
    rc, out, err = run(args, [args.train] + base + ["--data", good, "--checkpoint-dir", ckdir])
    assert rc == 0, err
    ckpt = os.path.join(ckdir, "step-00000002.h5")
    expect_bad_input(args, ["--model", "cnn", "--data", good, "--steps", "1", "--init-from", ckpt], r"no tensor model/conv1")
    expect_bad_input(args, ["--model", "mlp", "--hidden", "32", "--data", good, "--steps", "1", "--init-from", ckpt],
                     r"fc1/weight.*(32|16)")


def case_help(args):
    rc, out, err = run(args, [args.train, "--help"])
    assert rc == 0, err
    for flag in ("--model", "--hidden", "--data", "--val-data", "--epochs", "--steps", "--global-batch", "--micro-batch",
                 "--optimizer", "--lr", "--momentum", "--weight-decay", "--lr-schedule", "--warmup-steps", "--clip-grad",
                 "--seed", "--shuffle", "--threads", "--checkpoint-dir", "--save-every", "--eval-every", "--log-every",
                 "--metrics", "--init-from", "--eval-only", "--config", "--zero", "--dry-run"):
        assert flag in out, f"--help does not mention {flag}"


def case_train_h5py(args):
    """Trains on h5py-written data; checks accuracy, metrics, checkpoint (read back by h5py), eval-only."""
    w = args.workdir
    train = write_dataset(os.path.join(w, "train.h5"), n=1024, seed=1)
    test = write_dataset(os.path.join(w, "test.h5"), n=256, seed=2)
    ckdir = os.path.join(w, "ck")
    metrics = os.path.join(w, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    config = os.path.join(w, "run.ini")
    with open(config, "w") as f:
        f.write(f"model = mlp\nhidden = 32\ndata = {train}\nval-data = {test}\nglobal-batch = 32\nlr = 0.05\n"
                f"steps = 5\nlog-every = 10\n")
    # Command-line flags override the file (--steps 60 wins over steps = 5).
    rc, out, err = run(args, [args.train, "--config", config, "--steps", "60", "--checkpoint-dir", ckdir,
                              "--metrics", metrics, "--save-every", "30", "--micro-batch", "8"])
    assert rc == 0, f"rc={rc}\n{out}\n{err}"
    assert re.search(r"steps\s*=\s*60", out), "effective configuration not printed with the override"
    m = re.search(r"final test: loss ([0-9.]+)\s+accuracy ([0-9.]+)%", out)
    assert m, out
    assert float(m.group(2)) >= 90.0, f"accuracy {m.group(2)}% on a separable task"
    records = [json.loads(l) for l in open(metrics)]
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50, 60], records
    assert records[-1]["loss"] < records[0]["loss"], records
    for r in records:
        assert set(r) >= {"step", "epoch", "loss", "lr", "samples_per_s"}, r
    for step in (30, 60):
        path = os.path.join(ckdir, f"step-{step:08d}.h5")
        with h5py.File(path, "r") as f:
            assert int(f.attrs["step"]) == step
            assert f["model/fc1/weight"].shape == (32, 36)
            assert f["model/fc2/bias"].shape == (4,)
    assert not [p for p in os.listdir(ckdir) if p.endswith(".tmp")], os.listdir(ckdir)
    # --eval-only reproduces the final evaluation exactly.
    rc, out2, err = run(args, [args.train, "--model", "mlp", "--hidden", "32", "--val-data", test, "--eval-only",
                               "--init-from", os.path.join(ckdir, "step-00000060.h5")])
    assert rc == 0, err
    m2 = re.search(r"evaluation: loss ([0-9.]+)\s+accuracy ([0-9.]+)%", out2)
    assert m2 and m2.groups() == m.groups(), (m.groups(), out2)
    # Evaluation data without the highest class: the model keeps the checkpoint's 4 classes.
    subset = os.path.join(w, "test-no-class-3.h5")
    with h5py.File(test, "r") as f, h5py.File(subset, "w") as g:
        keep = f["labels"][...] < 3
        g["inputs"], g["labels"] = f["inputs"][...][keep], f["labels"][...][keep]
    rc, out3, err = run(args, [args.train, "--model", "mlp", "--hidden", "32", "--val-data", subset, "--eval-only",
                               "--init-from", os.path.join(ckdir, "step-00000060.h5")])
    m3 = re.search(r"evaluation: loss ([0-9.]+)\s+accuracy ([0-9.]+)%\s+\((\d+) samples\)", out3)
    assert rc == 0 and m3 and int(m3.group(3)) == int(keep.sum()) and float(m3.group(2)) >= 90.0, f"{out3}\n{err}"
    # A switch set in the file is turned off on the command line.
    with open(config, "a") as f:
        f.write("dry-run = true\n")
    rc, out, err = run(args, [args.train, "--config", config])
    assert rc == 0 and "--dry-run: not training" in out and "final test" not in out, f"{out}\n{err}"
    rc, out, err = run(args, [args.train, "--config", config, "--dry-run", "false"])
    assert rc == 0 and "--dry-run: not training" not in out and "final test" in out, f"{out}\n{err}"


def case_divergence(args):
    """A step whose loss is not finite stops the run on every rank (exit 1, one line from rank
    0) without saving that state: the last checkpoint stays the newest, and --metrics stays
    valid JSON. A NaN in the data is named at setup instead (exit 2)."""
    import shutil
    w = args.workdir
    data = write_dataset(os.path.join(w, "diverge.h5"), n=512)
    ck = os.path.join(w, "ck-diverge")
    shutil.rmtree(ck, ignore_errors=True)
    metrics = os.path.join(w, "diverge.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    base = ["--model", "mlp", "--hidden", "16", "--data", data, "--global-batch", "16", "--checkpoint-dir", ck,
            "--metrics", metrics, "--log-every", "1"]
    train_ranks(args, 2, base + ["--steps", "3"])  # a good checkpoint at step 3
    cmd = [args.mpirun, "-np", "2", "--oversubscribe", "--quiet", args.train] + base + [
        "--steps", "20", "--lr", "1e30", "--resume", "auto"]
    rc, out, err = run(args, cmd)
    lines = [l for l in err.splitlines() if l.strip()]
    assert rc == 1 and len(lines) == 1 and re.match(r"error: the loss of step \d+ is nan", lines[0]), f"{rc}\n{out}\n{err}"
    assert sorted(os.listdir(ck)) == ["latest", "step-00000003.h5"], os.listdir(ck)
    records = [json.loads(l) for l in open(metrics)]  # every line parses
    assert all(math.isfinite(r["loss"]) for r in records), records
    print(f"--lr 1e30: {lines[0]}; checkpoints {sorted(os.listdir(ck))}; {len(records)} metrics lines, all finite")

    # A metrics file that cannot take the lines (a full disk: /dev/full): one warning, training goes on.
    rc, out, err = run(args, [args.train, "--model", "mlp", "--hidden", "16", "--data", data, "--global-batch", "16",
                              "--steps", "4", "--log-every", "1", "--metrics", "/dev/full"])
    warnings = [l for l in err.splitlines() if "--metrics: cannot write '/dev/full'" in l]
    assert rc == 0 and len(warnings) == 1 and "final test" in out, f"{rc}\n{out}\n{err}"
    # --resume auto that finds no checkpoint starts again: the old run's lines go.
    shutil.rmtree(ck, ignore_errors=True)
    train_ranks(args, 1, base + ["--steps", "3", "--resume", "auto"])
    assert [json.loads(l)["step"] for l in open(metrics)] == [1, 2, 3], open(metrics).read()

    bad = os.path.join(w, "nan-sample.h5")
    x = np.random.default_rng(0).random((64, 8), dtype=np.float32)
    x[37, 2] = np.nan
    with h5py.File(bad, "w") as f:
        f["inputs"] = x
        f["labels"] = np.arange(64) % 4
    expect_bad_input(args, ["--model", "mlp", "--hidden", "16", "--data", bad, "--steps", "2", "--global-batch", "8"],
                     r"--data: sample 37 of '.*nan-sample\.h5' holds a non-finite input value", ranks=2)


def case_train_two_ranks(args):
    """2 ranks train together and report one progress stream and the same final metric format."""
    w = args.workdir
    train = write_dataset(os.path.join(w, "train2.h5"), n=512, seed=3)
    rc, out, err = run(args, [args.mpirun, "-np", "2", "--oversubscribe", args.train, "--model", "cnn", "--data", train,
                              "--val-data", train, "--steps", "20", "--global-batch", "16", "--log-every", "10"])
    assert rc == 0, f"rc={rc}\n{out}\n{err}"
    assert len(re.findall(r"^step 10/20", out, re.M)) == 1, out
    assert "[rank 1]" not in out, out
    assert re.search(r"final test: loss [0-9.]+\s+accuracy [0-9.]+%\s+\(512 samples\)", out), out


def train_ranks(args, ranks, flags, timeout=600):
    """Runs train on `ranks` ranks (mpirun even for 1, as users do) and returns its stdout."""
    cmd = [args.mpirun, "-np", str(ranks), "--oversubscribe", "--bind-to", "none", args.train] + flags
    rc, out, err = run(args, cmd, timeout=timeout)
    assert rc == 0, f"{' '.join(cmd)}\nrc={rc}\n{out}\n{err}"
    return out


def read_model(path):
    with h5py.File(path, "r") as f:
        tensors = {}
        f["model"].visititems(lambda name, obj: tensors.update({name: obj[...]}) if isinstance(obj, h5py.Dataset) else None)
        return tensors


def assert_same_model(a, b, what, rtol=1e-5, only_trainable=False):
    """Every /model tensor equal within rtol, norm-wise relative (||a-b|| / ||b||)."""
    skip = ("running_mean", "running_var") if only_trainable else ()
    names = [n for n in a if not n.endswith(skip)]
    assert names and set(names) <= set(b), (what, sorted(a), sorted(b))
    worst = 0.0
    for n in names:
        diff = np.linalg.norm(a[n].astype(np.float64) - b[n]) / max(np.linalg.norm(b[n].astype(np.float64)), 1e-30)
        worst = max(worst, diff)
        assert diff <= rtol, f"{what}: {n} differs by {diff:.3g} (relative), tolerance {rtol}"
    print(f"{what}: {len(names)} tensors, worst relative difference {worst:.3g}")


def equivalence_runs(args, model_flags, layouts, steps=50, global_batch=32, outputs=None):
    """Trains the same model under each layout (ranks, micro_batch[, extra flags]); returns
    their /model tensors by layout (and their stdout in `outputs` if given)."""
    data = write_dataset(os.path.join(args.workdir, "eq.h5"), n=2048, shape=(1, 8, 8), classes=4, seed=7)
    models = {}
    for layout in layouts:
        ranks, micro, extra = (tuple(layout) + ((),))[:3]
        name = "-".join(model_flags + [str(ranks), str(micro)] + list(extra)).replace("/", "_").replace(",", "_")
        ck = os.path.join(args.workdir, "ck" + name)
        out = train_ranks(args, ranks, model_flags + list(extra) + [
            "--data", data, "--steps", str(steps), "--global-batch", str(global_batch), "--micro-batch", str(micro),
            "--lr", "0.05", "--seed", "3", "--checkpoint-dir", ck, "--log-every", "25", "--bucket-mb", "0.01"])
        if outputs is not None:
            outputs[layout] = out
        models[layout] = read_model(os.path.join(ck, f"step-{steps:08d}.h5"))
    return models


def case_ddp_equivalence(args):
    """N data-parallel ranks == 1 rank, and 4 accumulated micro-batches == one batch, for the
    MLP (with dropout: masks are keyed by global sample index) and the CNN, after 50 steps."""
    for model in (["--model", "mlp", "--hidden", "64,32", "--dropout", "0.1"], ["--model", "cnn"]):
        runs = equivalence_runs(args, model, [(1, 32), (2, 16), (4, 8), (1, 8), (2, 4)])
        reference = runs[(1, 32)]
        for layout, tensors in runs.items():
            if layout != (1, 32):
                assert_same_model(tensors, reference, f"{model[1]} ranks={layout[0]} micro-batch={layout[1]} vs 1 rank")


def case_ddp_batchnorm(args):
    """BatchNorm statistics are local to each micro-batch on each rank (as torch.nn.BatchNorm2d
    under DDP without SyncBatchNorm). What this proves: 2 ranks x micro-batch 8 train exactly
    like 1 rank accumulating 2 micro-batches of 8 (same normalisation groups), so only the
    grouping of samples into normalisation batches differs from a 1 x 16 run, not the sync.
    Running statistics are per replica (the checkpoint holds replica 0's), so only trainable
    tensors are compared."""
    runs = equivalence_runs(args, ["--model", "resnet", "--depth", "8", "--width", "4"], [(1, 8), (2, 8)], steps=20,
                            global_batch=16)
    assert_same_model(runs[(2, 8)], runs[(1, 8)], "resnet-8 2 ranks x 8 vs 1 rank x 2 x 8", only_trainable=True)


def case_pipeline_equivalence(args):
    """p pipeline stages with m micro-batches == 1 stage accumulating m micro-batches, for both
    schedules, on the MLP and the CNN: pp=2, pp=4 and pp=2 x dp=2 on 4 ranks, after 50 steps,
    with the one-node shared-memory transports and with --shared-memory false (all MPI).
    Checkpoints are gathered from every stage to rank 0, so this also checks the gathering."""
    # One thread per rank everywhere: thread count splits the convolution sums differently.
    for model in (["--model", "mlp", "--hidden", "64,32,16", "--dropout", "0.1", "--threads", "1"],
                  ["--model", "cnn", "--threads", "1"]):
        layouts = [(1, 8)]
        for schedule in ("gpipe", "1f1b"):
            s = ("--schedule", schedule)
            layouts += [(2, 8, ("--pp", "2") + s), (4, 8, ("--pp", "4") + s), (4, 4, ("--pp", "2") + s),
                        (4, 8, ("--pp", "4", "--partition", "1,2,3") + s)]
        # Everything through MPI instead of shared memory (messages, all-reduce, ZeRO 1's reduce
        # and all-gather): the same model.
        layouts += [(4, 4, ("--pp", "2", "--shared-memory", "false")),
                    (4, 4, ("--pp", "2", "--zero", "1", "--shared-memory", "false"))]
        runs = equivalence_runs(args, model, layouts)
        for layout, tensors in runs.items():
            if layout != (1, 8):
                # A pure pipeline (one replica) adds in the same order as 1 stage: bit for bit.
                pure = layout[0] == int(layout[2][layout[2].index("--pp") + 1])
                assert_same_model(tensors, runs[(1, 8)], f"{model[1]} {layout} vs 1 rank", rtol=0.0 if pure else 1e-5)


def case_pipeline_memory(args):
    """Peak micro-batches in flight per stage: GPipe holds all m, 1F1B at most P - s."""
    m = 8
    outputs = {}
    equivalence_runs(args, ["--model", "mlp", "--hidden", "32,32,32"],
                     [(4, 4, ("--pp", "4", "--schedule", k)) for k in ("gpipe", "1f1b")], steps=3, outputs=outputs)
    for (ranks, micro, extra), out in outputs.items():
        kind = extra[-1]
        line = re.search(r"peak micro-batches in flight per stage: ([0-9. ]+)", out)
        assert line, out
        peaks = [int(float(v)) for v in line.group(1).split()]
        expected = [m] * 4 if kind == "gpipe" else [min(m, 4 - s) for s in range(4)]
        assert peaks == expected, f"{kind}: peaks {peaks}, expected {expected}"
        print(f"{kind}: peak in flight per stage {peaks}")

    # --bench-stage-ms (stand-in compute for bench/pipeline_bubble.py): every forward lasts at
    # least the given time and every backward twice that, and the model is unchanged by it.
    svg = os.path.join(args.workdir, "standin.svg")
    plain, standin = (2, 8, ("--pp", "2")), (2, 8, ("--pp", "2", "--bench-stage-ms", "15", "--timeline", svg))
    runs = equivalence_runs(args, ["--model", "mlp", "--hidden", "32,32,32"], [plain, standin], steps=2)
    assert_same_model(runs[standin], runs[plain], "--bench-stage-ms 15 vs without", rtol=0.0)
    events = re.findall(r"<title>stage (\d) ([FB])(\d+): ([0-9.]+) - ([0-9.]+) s</title>", open(svg).read())
    assert len(events) == 2 * 2 * 4, events  # 2 stages x forward and backward x 4 micro-batches
    for stage, op, i, start, end in events:
        least = 0.015 if op == "F" else 0.030
        assert float(end) - float(start) >= least, f"stage {stage} {op}{i} took {float(end) - float(start)} s < {least}"
    print(f"--bench-stage-ms 15: {len(events)} timeline events, each at least its stand-in time; same model")


def case_pipeline_bad_inputs(args):
    """Pipeline layouts that cannot work: one line each, exit 2 on every rank."""
    data = write_dataset(os.path.join(args.workdir, "pp.h5"))
    # mlp with one hidden layer has 4 layers: flatten, fc1, relu1, fc2.
    base = ["--data", data, "--steps", "2", "--global-batch", "8", "--model", "mlp", "--hidden", "16"]
    expect_bad_input(args, base + ["--pp", "3"], r"--pp 3 does not divide the 4 ranks", ranks=4)
    expect_bad_input(args, base + ["--pp", "5"], r"--pp 5 needs at least 5 layers, but the model has 4", ranks=5)
    expect_bad_input(args, base + ["--pp", "2", "--partition", "1,2"], r"--partition '1,2' makes 3 stages but --pp is 2",
                     ranks=2)
    expect_bad_input(args, base + ["--pp", "4", "--partition", "1,2,9"], r"cut points.*1\.\.3.*'9'", ranks=4)
    expect_bad_input(args, base + ["--pp", "2", "--partition", "3,2"], r"increase", ranks=2)
    expect_bad_input(args, base + ["--pp", "2", "--micro-batch", "3"], r"micro-batch \(3\)", ranks=2)
    expect_bad_input(args, base + ["--pp", "2", "--schedule", "interleaved"], r"interleaved", ranks=2)
    expect_bad_input(args, base + ["--pp", "2", "--bench-stage-ms", "-1"], r"--bench-stage-ms must be in", ranks=2)


ZERO_MLP = ["--model", "mlp", "--hidden", "64,32"]


def case_zero_equivalence(args):
    """ZeRO 1 (optimizer state sharded, parameters all-gathered), ZeRO 2 (gradients reduced to
    their owners per bucket and micro-batch, only the own shard kept) and ZeRO 3 (parameters
    sharded too, gathered per layer around forward and backward) == ZeRO 0 after 50 steps, with
    SGD-momentum and with AdamW + clipping (the norm is summed over shards), for dp = 2, dp = 4
    and pp = 2 x dp = 2, each also with gradient accumulation (micro-batch smaller than the
    per-replica batch: ZeRO 2 and 3 reduce every micro-batch into the shard). dp = 4 splits the
    MLP's 6384 elements into 1600-element shards, so the last rank's shard is shorter (1584);
    --bucket-mb 0.01 cuts the MLP into buckets that straddle shard boundaries, and fc1 (4160
    elements) spans three owners' shards. The CNN runs once under ZeRO 3. A checkpoint saved
    under ZeRO 3 loads with --init-from under ZeRO 0 and evaluates the same as under ZeRO 3."""
    for optimizer in (("--optimizer", "sgd", "--momentum", "0.9"), ("--optimizer", "adamw", "--clip-grad", "1.0")):
        # The last three accumulate 4 micro-batches per replica (global batch 32).
        for ranks, micro, grid, stages in ((2, 16, (), "0123"), (4, 8, (), "0123"), (4, 8, ("--pp", "2"), "0123"),
                                           (2, 4, (), "023"), (4, 2, (), "023"), (4, 4, ("--pp", "2"), "023")):
            layouts = {z: (ranks, micro, grid + optimizer + ("--zero", z)) for z in stages}
            runs = equivalence_runs(args, ZERO_MLP, list(layouts.values()))
            for z in stages[1:]:
                assert_same_model(runs[layouts[z]], runs[layouts["0"]],
                                  f"zero {z} vs 0, {ranks} ranks micro-batch {micro} {grid} {optimizer}")
    # The CNN with SGD-momentum. (With AdamW + clipping ZeRO 2 and 3 are bit-identical to each
    # other and 9.2e-6 from ZeRO 0 after 50 steps: AdamW's m/sqrt(v) amplifies last-bit gradient
    # differences on near-zero gradients; too close to the tolerance for a stable test.)
    for optimizer in (("--optimizer", "sgd", "--momentum", "0.9"),):
        layouts = [(2, 8, optimizer + ("--zero", z)) for z in "023"]
        runs = equivalence_runs(args, ["--model", "cnn"], layouts)
        for k in (1, 2):
            assert_same_model(runs[layouts[k]], runs[layouts[0]], f"cnn {layouts[k][2]} vs zero 0, 2 ranks micro 8")

    # Save under ZeRO 3 (pp = 2 x dp = 2), evaluate that checkpoint under ZeRO 3 and under ZeRO 0.
    data = os.path.join(args.workdir, "eq.h5")
    ck = os.path.join(args.workdir, "ck-zero3-eval")
    train_ranks(args, 4, ZERO_MLP + ["--pp", "2", "--zero", "3", "--data", data, "--steps", "5", "--global-batch",
                                     "32", "--checkpoint-dir", ck])
    results = []
    for zero in ("3", "0"):
        out = train_ranks(args, 4, ZERO_MLP + ["--pp", "2", "--zero", zero, "--data", data, "--global-batch", "32",
                                               "--eval-only", "--init-from", os.path.join(ck, "step-00000005.h5")])
        m = re.search(r"evaluation: loss ([0-9.]+)\s+accuracy ([0-9.]+)%", out)
        assert m, out
        results.append(m.groups())
    assert results[0] == results[1], f"--eval-only under zero 3 {results[0]} != under zero 0 {results[1]}"
    print(f"zero 3 checkpoint evaluated under zero 3 and zero 0: loss, accuracy {results[0]}")


RESUME_MLP = ["--model", "mlp", "--hidden", "64,32", "--dropout", "0.1"]


def resumed_run(args, model_flags, save_layout, resume_layout, optimizer, steps=50, split=20, global_batch=32):
    """Trains `split` steps under save_layout (ranks, flags) with a checkpoint, then resumes it
    in a new process under resume_layout up to `steps`; returns the final /model tensors and
    the resumed run's stdout."""
    data = write_dataset(os.path.join(args.workdir, "eq.h5"), n=2048, shape=(1, 8, 8), classes=4, seed=7)
    name = "-".join(model_flags + list(optimizer) + [str(save_layout[0])] + list(save_layout[1]) +
                    [str(resume_layout[0])] + list(resume_layout[1])).replace(",", "_")
    ck = os.path.join(args.workdir, "ck-resume" + name)
    if os.path.isdir(ck):
        for f in os.listdir(ck):
            os.remove(os.path.join(ck, f))
    common = model_flags + list(optimizer) + ["--data", data, "--global-batch", str(global_batch), "--lr", "0.05",
                                              "--seed", "3", "--checkpoint-dir", ck, "--log-every", "25"]
    train_ranks(args, save_layout[0], common + list(save_layout[1]) + ["--steps", str(split), "--save-every", str(split)])
    assert open(os.path.join(ck, "latest")).read().strip() == f"step-{split:08d}.h5"
    out = train_ranks(args, resume_layout[0], common + list(resume_layout[1]) + ["--steps", str(steps), "--resume", "auto"])
    assert f"resuming from {os.path.join(ck, f'step-{split:08d}.h5')} at step {split}" in out, out
    return read_model(os.path.join(ck, f"step-{steps:08d}.h5")), out


def case_checkpoint_resume(args):
    """50 uninterrupted steps == 20 steps, checkpoint, new process, --resume auto, 30 more: for
    SGD-momentum and AdamW, on the MLP with dropout (masks keyed by global sample index) mid-epoch
    (64 steps per epoch); bit-identical on the same layout, within 1e-5 relative when the saved
    (dp=2, ZeRO 1) run resumes under (pp=2, dp=1, ZeRO 0) and (dp=4, ZeRO 3). The checkpoint
    holds the full optimizer state, gathered from the shards, and the training position."""
    import time
    for optimizer in (("--optimizer", "sgd", "--momentum", "0.9"), ("--optimizer", "adamw")):
        reference = equivalence_runs(args, RESUME_MLP + list(optimizer), [(1, 32)])[(1, 32)]
        same = (1, ())
        t0 = time.monotonic()
        model, _ = resumed_run(args, RESUME_MLP, same, same, optimizer)
        print(f"{optimizer[1]} 1 rank save+resume: {time.monotonic() - t0:.1f} s")
        assert_same_model(model, reference, f"{optimizer[1]} resumed on the same layout vs uninterrupted", rtol=0.0)
        saved = (2, ("--zero", "1"))
        for layout in ((2, ("--pp", "2", "--zero", "0")), (4, ("--zero", "3"))):
            model, _ = resumed_run(args, RESUME_MLP, saved, layout, optimizer)
            assert_same_model(model, reference, f"{optimizer[1]} saved dp=2 zero 1, resumed {layout}", rtol=1e-5)
    # The optimizer state is stored full, under stable names, with the training position.
    ck = [d for d in os.listdir(args.workdir) if d.startswith("ck-resume") and "adamw" in d][0]
    with h5py.File(os.path.join(args.workdir, ck, "step-00000020.h5"), "r") as f:
        assert f["optimizer/exp_avg/fc1/weight"].shape == (64, 64)
        assert f["optimizer/exp_avg_sq/fc3/bias"].shape == (4,)
        assert int(f.attrs["format_version"]) == 2 and int(f.attrs["step"]) == 20
        assert int(f.attrs["optimizer_step"]) == 20 and int(f.attrs["epoch"]) == 0
        assert int(f.attrs["step_in_epoch"]) == 20 and int(f.attrs["global_batch"]) == 32
        assert int(f.attrs["seed"]) == 3 and "optimizer = adamw" in f.attrs["config"]


def case_checkpoint_keep(args):
    """--keep 2 leaves the newest two checkpoints and a `latest` naming the newest; a different
    --global-batch resumes with one warning line."""
    data = write_dataset(os.path.join(args.workdir, "keep.h5"), n=512)
    ck = os.path.join(args.workdir, "ck-keep")
    if os.path.isdir(ck):
        for f in os.listdir(ck):
            os.remove(os.path.join(ck, f))
    base = ["--model", "mlp", "--hidden", "16", "--data", data, "--global-batch", "16", "--checkpoint-dir", ck]
    train_ranks(args, 2, base + ["--steps", "50", "--save-every", "10", "--keep", "2"])
    assert sorted(os.listdir(ck)) == ["latest", "step-00000040.h5", "step-00000050.h5"], os.listdir(ck)
    assert open(os.path.join(ck, "latest")).read().strip() == "step-00000050.h5"
    cmd = [args.mpirun, "-np", "2", "--oversubscribe", args.train] + base[:-4] + [
        "--global-batch", "32", "--checkpoint-dir", ck, "--steps", "60", "--resume", "auto"]
    rc, out, err = run(args, cmd)
    assert rc == 0, err
    warnings = [l for l in err.splitlines() if "global-batch" in l]
    assert len(warnings) == 1 and "approximate" in warnings[0], err
    assert "resuming from" in out and "at step 50" in out, out


def snapshot(directory):
    """{file name: bytes} of a directory, to show that nothing on disk changed."""
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))}


def case_checkpoint_bad(args):
    """--resume with a bad checkpoint: one line each, exit 2 on every rank, and neither the
    checkpoint directory nor the file changes. --resume auto skips a corrupt newest checkpoint
    with a warning and continues from the one before."""
    import shutil
    w = args.workdir
    data = write_dataset(os.path.join(w, "bad.h5"), n=512)
    ck = os.path.join(w, "ck-bad")
    shutil.rmtree(ck, ignore_errors=True)
    base = ["--model", "mlp", "--hidden", "16", "--data", data, "--global-batch", "16", "--checkpoint-dir", ck]
    train_ranks(args, 2, base + ["--steps", "20", "--save-every", "10"])
    good = os.path.join(ck, "step-00000010.h5")

    def variant(name, edit):
        path = os.path.join(w, name)
        shutil.copyfile(good, path)
        edit(path)
        return path

    def drop(path):
        with h5py.File(path, "r+") as f:
            del f["optimizer/momentum/fc1/weight"]

    def corrupt(path):
        with h5py.File(path, "r+") as f:
            f["model/fc2/bias"][0] += 1.0

    def truncate(path):
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)

    def text(path):
        with open(path, "w") as f:
            f.write("not a checkpoint\n")

    cases = [
        (good, ["--model", "cnn"], r"no tensor model/conv1"),
        (good, ["--model", "mlp", "--hidden", "32"], r"fc1/weight.*\[16, 64\].*\[32, 64\]|fc1/weight.*32"),
        (good, ["--model", "mlp", "--hidden", "16", "--optimizer", "adamw"], r"--optimizer sgd.*--optimizer adamw"),
        (variant("missing.h5", drop), ["--model", "mlp", "--hidden", "16"], r"no tensor 'optimizer/momentum/fc1/weight'"),
        (variant("crc.h5", corrupt), ["--model", "mlp", "--hidden", "16"], r"model/fc2/bias.*corrupt.*crc32"),
        (variant("truncated.h5", truncate), ["--model", "mlp", "--hidden", "16"], r"truncated\.h5"),
        (variant("text.h5", text), ["--model", "mlp", "--hidden", "16"], r"text\.h5.*not an HDF5 file"),
    ]
    for path, model, pattern in cases:
        before, file_before = snapshot(ck), open(path, "rb").read()
        expect_bad_input(args, model + ["--data", data, "--global-batch", "16", "--steps", "30", "--checkpoint-dir",
                                        ck, "--resume", path], pattern, ranks=2)
        assert snapshot(ck) == before, f"{path}: the checkpoint directory changed"
        assert open(path, "rb").read() == file_before, f"{path} changed"
        print(f"{os.path.basename(path)} {model[-1]}: rejected as expected, nothing changed")

    # A mixed-precision checkpoint also holds f32 master weights; a shape mismatch names the model's.
    ck16 = os.path.join(w, "ck-bad-bf16")
    train_ranks(args, 1, base[:-1] + [ck16, "--steps", "2", "--precision", "bf16"])
    expect_bad_input(args, ["--model", "mlp", "--hidden", "32", "--data", data, "--eval-only", "--init-from",
                            os.path.join(ck16, "step-00000002.h5")], r"tensor 'model/fc1/weight' has shape", ranks=2)

    # The newest checkpoint corrupt: --resume auto warns once and continues from step 10.
    corrupt(os.path.join(ck, "step-00000020.h5"))
    cmd = [args.mpirun, "-np", "2", "--oversubscribe", args.train] + base + ["--steps", "30", "--resume", "auto"]
    rc, out, err = run(args, cmd)
    assert rc == 0, f"{out}\n{err}"
    skipped = [l for l in err.splitlines() if "skipping checkpoint" in l]
    assert len(skipped) == 1 and "step-00000020.h5" in skipped[0] and "corrupt" in skipped[0], err
    assert f"resuming from {good} at step 10" in out, out
    print(f"--resume auto: {skipped[0]}")


def final_metric(out, what="final test"):
    m = re.search(what + r": loss ([0-9.]+)  accuracy ([0-9.]+)%  \((\d+) samples\)", out)
    assert m, out
    return float(m.group(1)), float(m.group(2)), int(m.group(3))


def case_setup_on_some_ranks(args):
    """Failures only some ranks see at setup, and evaluation edges that once hung or disagreed:
    a corrupt checkpoint tensor that only one pipeline stage reads, a checkpoint directory or
    --metrics file rank 0 cannot write (found before training, not at the first save), optimizer
    values that failed only inside the first step: one line, exit 2 on every rank, no hang.
    An evaluation set smaller than the replicas under ZeRO 3; BatchNorm replicas evaluating with
    replica 0's statistics (the saved model's metric); the logged losses of a run resumed between
    two progress lines equal the uninterrupted run's."""
    import shutil
    w = args.workdir
    data = write_dataset(os.path.join(w, "some.h5"), n=512)
    ck = os.path.join(w, "ck-some")
    shutil.rmtree(ck, ignore_errors=True)
    base = ["--model", "mlp", "--hidden", "16,16", "--data", data, "--global-batch", "16", "--micro-batch", "8"]
    train_ranks(args, 2, base + ["--pp", "2", "--steps", "4", "--checkpoint-dir", ck])
    good = os.path.join(ck, "step-00000004.h5")
    for tensor in ("model/fc1/weight", "model/fc3/bias"):  # stage 0's, stage 1's
        bad = os.path.join(w, "some-" + tensor.replace("/", "-") + ".h5")
        shutil.copyfile(good, bad)
        with h5py.File(bad, "r+") as f:
            f[tensor][0] += 1.0
        for flags in (["--resume", bad, "--steps", "8"], ["--eval-only", "--init-from", bad]):
            expect_bad_input(args, base + ["--pp", "2"] + flags, tensor + r".*corrupt", ranks=2)
    expect_bad_input(args, base + ["--steps", "8", "--resume", ck], r"is a directory; expected a step-NNNNNNNN\.h5",
                     ranks=2)
    expect_bad_input(args, base + ["--steps", "2", "--checkpoint-dir", os.path.join(data, "ck")],
                     r"--checkpoint-dir: cannot create", ranks=2)
    expect_bad_input(args, base + ["--steps", "2", "--metrics", w], r"--metrics must name a file", ranks=2)
    expect_bad_input(args, base + ["--steps", "2", "--momentum", "-1"], r"--momentum must be in \[0, 1\), found -1",
                     ranks=2)
    expect_bad_input(args, base + ["--steps", "2", "--lr-schedule", "cosine", "--min-lr", "1"], r"--min-lr", ranks=2)

    tiny = write_dataset(os.path.join(w, "tiny.h5"), n=3, seed=5)
    out = train_ranks(args, 4, base[:-2] + ["--zero", "3", "--val-data", tiny, "--steps", "4", "--checkpoint-dir",
                                            os.path.join(w, "ck-tiny")], timeout=120)
    alone = train_ranks(args, 1, ["--model", "mlp", "--hidden", "16,16", "--eval-only", "--init-from",
                                  os.path.join(w, "ck-tiny", "step-00000004.h5"), "--val-data", tiny], timeout=120)
    assert final_metric(out)[2] == 3
    assert abs(final_metric(out)[0] - final_metric(alone, "evaluation")[0]) <= 2e-6, (out, alone)
    print(f"3 samples on 4 ZeRO-3 replicas: {final_metric(out)} (1 rank: {final_metric(alone, 'evaluation')})")

    resnet = ["--model", "resnet", "--depth", "8", "--width", "4", "--data", data, "--global-batch", "16",
              "--val-data", data, "--steps", "6"]
    out = train_ranks(args, 2, resnet + ["--checkpoint-dir", os.path.join(w, "ck-bn")])
    alone = train_ranks(args, 1, resnet + ["--eval-only", "--init-from", os.path.join(w, "ck-bn", "step-00000006.h5")])
    trained, evaluated = final_metric(out), final_metric(alone, "evaluation")
    assert abs(trained[0] - evaluated[0]) <= 1e-5 * trained[0] and trained[1] == evaluated[1], (trained, evaluated)
    print(f"resnet, 2 replicas: final test {trained} = its checkpoint evaluated on 1 rank {evaluated}")

    # `latest` edited by hand to point elsewhere: ignored with a warning, the directory's files decide.
    with open(os.path.join(ck, "latest"), "w") as f:
        f.write(os.path.join(w, "ck-bn", "step-00000006.h5") + "\n")
    cmd = [args.mpirun, "-np", "2", "--oversubscribe", args.train] + base + ["--pp", "2", "--steps", "6",
                                                                           "--checkpoint-dir", ck, "--resume", "auto"]
    rc, out, err = run(args, cmd)
    assert rc == 0 and "ignoring" in err and f"resuming from {good} at step 4" in out, f"{out}\n{err}"

    logged = base + ["--steps", "20", "--log-every", "5", "--checkpoint-dir"]
    shutil.rmtree(os.path.join(w, "ck-log"), ignore_errors=True)
    for name in ("log-whole.jsonl", "log-resumed.jsonl"):
        if os.path.exists(os.path.join(w, name)):
            os.remove(os.path.join(w, name))
    train_ranks(args, 2, logged + [os.path.join(w, "ck-log-whole"), "--metrics", os.path.join(w, "log-whole.jsonl")])
    resumed = logged + [os.path.join(w, "ck-log"), "--metrics", os.path.join(w, "log-resumed.jsonl")]
    # Saved at step 7, killed at step 12 (logged: steps 5 and 10), resumed from step 7: the
    # line of step 10 is dropped and logged again, so the file reads as one run.
    cmd = [args.mpirun, "-np", "2", "--oversubscribe", args.train] + resumed + ["--save-every", "7",
                                                                               "--debug-fail-step", "12", "--debug-fail-rank", "1"]
    rc, out, err = run(args, cmd)
    assert rc != 0 and "injected failure" in err, f"{out}\n{err}"
    train_ranks(args, 2, resumed + ["--resume", "auto"])
    losses = [[json.loads(l)["loss"] for l in open(os.path.join(w, n))] for n in ("log-whole.jsonl", "log-resumed.jsonl")]
    assert len(losses[0]) == 4 and losses[0] == losses[1], losses
    print(f"logged losses, uninterrupted vs resumed from step 7: {losses[0]} == {losses[1]}")


def train_processes(root_pid, train):
    """PIDs of the train processes under `root_pid` (mpirun's children or deeper), by /proc."""
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
                children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(d))
            except OSError:
                pass
    found, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        for c in children.get(pid, []):
            try:
                exe = os.readlink(f"/proc/{c}/exe")
            except OSError:
                exe = ""
            if os.path.basename(exe) == os.path.basename(train):
                found.append(c)
            todo.append(c)
    return sorted(found)


def case_checkpoint_preempt(args):
    """SIGTERM to one rank of a 2-rank job mid-training: all ranks agree at the next step
    boundary (the flag rides on the step's loss all-reduce), save a complete checkpoint and exit
    with code 3; --resume auto then finishes with the same model as an uninterrupted run."""
    import shutil
    import signal
    import time
    w = args.workdir
    data = write_dataset(os.path.join(w, "preempt.h5"), n=2048, shape=(1, 8, 8), seed=7)
    steps = 4000
    common = RESUME_MLP + ["--optimizer", "adamw", "--data", data, "--global-batch", "32", "--seed", "3",
                           "--steps", str(steps), "--log-every", "10", "--lr", "0.01"]
    ref_ck, ck = os.path.join(w, "ck-ref"), os.path.join(w, "ck-preempt")
    for d in (ref_ck, ck):
        shutil.rmtree(d, ignore_errors=True)
    train_ranks(args, 2, common + ["--checkpoint-dir", ref_ck])
    metrics = os.path.join(w, "preempt-metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [args.mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none", args.train] + common + [
        "--checkpoint-dir", ck, "--metrics", metrics]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, **MPI_ENV))
    # Rank 0 appends a metrics line every 10 steps (unbuffered, unlike stdout through mpirun).
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0) and p.poll() is None:
        time.sleep(0.005)
    ranks = train_processes(p.pid, args.train)
    assert len(ranks) == 2, ranks
    start = time.monotonic()
    os.kill(ranks[-1], signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    elapsed = time.monotonic() - start
    assert p.returncode == 3, f"exit code {p.returncode}\n{out}\n{err}"
    stopped = re.search(r"stopping after step (\d+)", out)
    assert stopped, out
    step = int(stopped.group(1))
    assert 10 <= step < steps, step
    latest = open(os.path.join(ck, "latest")).read().strip()
    assert latest == f"step-{step:08d}.h5" and not [n for n in os.listdir(ck) if n.endswith(".tmp")], os.listdir(ck)
    with h5py.File(os.path.join(ck, latest), "r") as f:
        assert int(f.attrs["step"]) == step and "optimizer/exp_avg/fc1/weight" in f
    print(f"SIGTERM to rank pid {ranks[-1]}: all ranks stopped after step {step}, saved {latest}, exit 3 "
          f"after {elapsed:.2f} s")
    out = train_ranks(args, 2, common + ["--checkpoint-dir", ck, "--resume", "auto"])
    assert f"at step {step}" in out, out
    assert_same_model(read_model(os.path.join(ck, f"step-{steps:08d}.h5")),
                      read_model(os.path.join(ref_ck, f"step-{steps:08d}.h5")), "preempted + resumed vs uninterrupted",
                      rtol=0.0)  # the same layout: bit for bit


def rank_of(pid):
    """The MPI rank of a train process, from Open MPI's environment variable."""
    env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    for kv in env:
        if kv.startswith(b"OMPI_COMM_WORLD_RANK="):
            return int(kv.split(b"=", 1)[1])
    return None


def verify_crc(path):
    """Every dataset's zlib crc32 equals its stored `crc32` attribute (h5py, not our reader)."""
    import zlib
    count = 0
    with h5py.File(path, "r") as f:
        def check(name, obj):
            nonlocal count
            if isinstance(obj, h5py.Dataset):
                data = np.ascontiguousarray(obj[...])
                assert zlib.crc32(data.tobytes()) == int(obj.attrs["crc32"]), f"{path}: {name} crc32 mismatch"
                count += 1
        f.visititems(check)
    return count


def case_checkpoint_sigkill(args):
    """SIGKILL to rank 0 of a 2-rank job while it is writing a checkpoint (step-N.h5.tmp exists
    at the moment of the kill and still exists afterwards, with no step-N.h5): the previous
    checkpoint and `latest` are intact (every tensor's crc32 checked with h5py), and
    --resume auto continues from it and ends bit-identical to an uninterrupted run."""
    import shutil
    import signal
    import time
    w = args.workdir
    data = write_dataset(os.path.join(w, "kill.h5"), n=2048, shape=(1, 16, 16), seed=7)
    steps = 200
    # A wide write window: 256-1024-1024-4 with AdamW is ~ 16 MB per checkpoint, every 2 steps;
    # the kill lands once at least 4 MB of the new file are on disk.
    common = ["--model", "mlp", "--hidden", "1024,1024", "--optimizer", "adamw", "--data", data, "--global-batch",
              "32", "--seed", "3", "--steps", str(steps), "--log-every", "50", "--lr", "0.001"]
    ref_ck = os.path.join(w, "ck-ref")
    shutil.rmtree(ref_ck, ignore_errors=True)
    train_ranks(args, 2, common + ["--checkpoint-dir", ref_ck])
    for attempt in range(1, 6):
        ck = os.path.join(w, "ck-kill")
        shutil.rmtree(ck, ignore_errors=True)
        os.makedirs(ck)
        cmd = [args.mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none", args.train] + common + [
            "--checkpoint-dir", ck, "--save-every", "2"]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, **MPI_ENV))
        rank0, killed_tmp = None, None
        deadline = time.monotonic() + 300
        while p.poll() is None and time.monotonic() < deadline:
            if rank0 is None:
                ranks = train_processes(p.pid, args.train)
                if len(ranks) == 2:
                    try:
                        rank0 = [r for r in ranks if rank_of(r) == 0][0]
                    except (OSError, IndexError):
                        rank0 = None
                continue
            names = os.listdir(ck)
            # Kill during the write of a checkpoint after the first complete one (4 steps in).
            # Kill once a few MB of it are on disk: mid-write, not before the first tensor.
            tmps = [n for n in names if n.endswith(".h5.tmp") and n >= "step-00000006"]
            try:
                size = os.path.getsize(os.path.join(ck, tmps[0])) if tmps else 0
            except OSError:
                size = 0
            if size >= 4 << 20 and "latest" in names:
                os.kill(rank0, signal.SIGKILL)
                killed_tmp = tmps[0]
                break
        out, err = p.communicate(timeout=120)
        if killed_tmp is None:
            print(f"attempt {attempt}: no kill (rc {p.returncode}); retrying")
            continue
        names = sorted(os.listdir(ck))
        final = killed_tmp[:-len(".tmp")]
        if killed_tmp not in names or final in names:
            print(f"attempt {attempt}: {killed_tmp} was committed before the kill landed ({names}); retrying")
            continue
        assert p.returncode != 0, f"the job survived SIGKILL of rank 0\n{out}\n{err}"
        latest = open(os.path.join(ck, "latest")).read().strip()
        killed_step = int(final[5:13])
        assert latest == f"step-{killed_step - 2:08d}.h5", (latest, killed_tmp, names)
        n = verify_crc(os.path.join(ck, latest))
        print(f"attempt {attempt}: SIGKILL to rank 0 (pid {rank0}) while {killed_tmp} was being written "
              f"({os.path.getsize(os.path.join(ck, killed_tmp))} bytes on disk); mpirun exit {p.returncode}; "
              f"latest = {latest}, {n} tensors crc-verified by h5py; directory: {names}")
        # The requeued job runs the same command; its save of step N replaces the stale .tmp.
        out = train_ranks(args, 2, common + ["--checkpoint-dir", ck, "--save-every", "2", "--resume", "auto"])
        assert f"resuming from {os.path.join(ck, latest)} at step {killed_step - 2}" in out, out
        assert not [x for x in os.listdir(ck) if x.endswith(".tmp")], os.listdir(ck)
        assert_same_model(read_model(os.path.join(ck, f"step-{steps:08d}.h5")),
                          read_model(os.path.join(ref_ck, f"step-{steps:08d}.h5")),
                          "killed + resumed vs uninterrupted", rtol=0.0)
        return
    raise AssertionError("could not kill rank 0 during a checkpoint write in 5 attempts")


def case_checkpoint_layout_chain(args):
    """The issue's chain, for SGD-momentum and AdamW on the MLP with dropout: 40 uninterrupted
    steps on 1 rank == 20 steps under pp=2 x dp=2 x ZeRO 1 (4 ranks), save, resume under dp=2
    ZeRO 0 for 10 steps, save, resume on 1 rank up to 40: /model within 1e-5 relative."""
    import shutil
    w = args.workdir
    data = write_dataset(os.path.join(w, "eq.h5"), n=2048, shape=(1, 8, 8), classes=4, seed=7)
    for optimizer in (["--optimizer", "sgd", "--momentum", "0.9"], ["--optimizer", "adamw"]):
        common = RESUME_MLP + optimizer + ["--data", data, "--global-batch", "32", "--lr", "0.05", "--seed", "3",
                                           "--log-every", "10"]
        ref, ck = os.path.join(w, "ck-ref-" + optimizer[1]), os.path.join(w, "ck-chain-" + optimizer[1])
        for d in (ref, ck):
            shutil.rmtree(d, ignore_errors=True)
        train_ranks(args, 1, common + ["--steps", "40", "--checkpoint-dir", ref])
        train_ranks(args, 4, common + ["--pp", "2", "--zero", "1", "--steps", "20", "--checkpoint-dir", ck])
        assert open(os.path.join(ck, "latest")).read().strip() == "step-00000020.h5"
        out = train_ranks(args, 2, common + ["--zero", "0", "--steps", "30", "--checkpoint-dir", ck, "--resume", "auto"])
        assert f"resuming from {os.path.join(ck, 'step-00000020.h5')} at step 20" in out, out
        assert open(os.path.join(ck, "latest")).read().strip() == "step-00000030.h5"
        out = train_ranks(args, 1, common + ["--steps", "40", "--checkpoint-dir", ck, "--resume", "auto"])
        assert f"resuming from {os.path.join(ck, 'step-00000030.h5')} at step 30" in out, out
        reference = read_model(os.path.join(ref, "step-00000040.h5"))
        for step in (20, 30):
            with h5py.File(os.path.join(ck, f"step-{step:08d}.h5"), "r") as f:
                assert int(f.attrs["step"]) == step and int(f.attrs["optimizer_step"]) == step
        assert_same_model(read_model(os.path.join(ck, "step-00000040.h5")), reference,
                          f"{optimizer[1]}: 1 rank 40 steps vs pp2 x dp2 x zero1 20 -> dp2 zero0 30 -> 1 rank 40",
                          rtol=1e-5)


def case_export_torch(args):
    """tools/export_torch.py: the exported state_dict holds the checkpoint's tensors exactly,
    loads (strict) into the matching torch.nn.Sequential, and that model's evaluation loss on a
    test set equals `train --eval-only` within 1e-5 (accuracy equal), for the MLP with dropout,
    the CNN and a depth-8 width-4 ResNet (BatchNorm running statistics, shortcut convs), saved
    from a 2-rank pp=2 run."""
    import torch
    w = args.workdir
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    train = write_dataset(os.path.join(w, "train.h5"), n=512, shape=(1, 8, 8), seed=1)
    test = write_dataset(os.path.join(w, "test.h5"), n=300, shape=(1, 8, 8), seed=2)
    for model in (["--model", "mlp", "--hidden", "32,16", "--dropout", "0.2"], ["--model", "cnn"],
                  ["--model", "resnet", "--depth", "8", "--width", "4"]):
        ck = os.path.join(w, "ck-" + model[1])
        # Few small steps: a loss far from 0, so the comparison means something.
        train_ranks(args, 2, model + ["--pp", "2", "--data", train, "--steps", "12", "--global-batch", "32",
                                      "--lr", "0.02", "--checkpoint-dir", ck])
        path = os.path.join(ck, "step-00000012.h5")
        out_pt = os.path.join(w, model[1] + ".pt")
        rc, out, err = run(args, [sys.executable, os.path.join(repo, "tools", "export_torch.py"), path, out_pt,
                                  "--eval", test])
        assert rc == 0, f"{out}\n{err}"
        state, stored = torch.load(out_pt), read_model(path)
        # torch's BatchNorm keeps a num_batches_tracked counter that Strata has no tensor for.
        counters = [n for n in state if n.endswith(".num_batches_tracked")]
        assert bool(counters) == (model[1] == "resnet"), counters
        assert sorted(set(state) - set(counters)) == sorted(n.replace("/", ".") for n in stored), \
            (sorted(state), sorted(stored))
        if model[1] == "resnet":  # the shortcut convs and the BatchNorm statistics travel too
            assert "block2_1.shortcut.conv.weight" in state and "block3_1.bn2.running_var" in state, sorted(state)
            assert not np.allclose(state["bn1.running_mean"].numpy(), 0), "running statistics never updated"
        for n, v in stored.items():
            assert np.array_equal(state[n.replace("/", ".")].numpy(), v), n
        mine = re.search(r"evaluation: loss ([0-9.]+)\s+accuracy ([0-9.]+)%", out)
        rc, out2, err = run(args, [args.train] + model + ["--val-data", test, "--eval-only", "--init-from", path])
        assert rc == 0, err
        theirs = re.search(r"evaluation: loss ([0-9.]+)\s+accuracy ([0-9.]+)%", out2)
        assert mine and theirs, (out, out2)
        diff = abs(float(mine.group(1)) - float(theirs.group(1)))
        assert diff <= 1e-5 and mine.group(2) == theirs.group(2), (mine.groups(), theirs.groups())
        print(f"{model[1]}: torch loss {mine.group(1)} accuracy {mine.group(2)}%, Strata --eval-only loss "
              f"{theirs.group(1)} accuracy {theirs.group(2)}%: |diff| {diff:.2g}")

def dry_run_table(args, ranks, flags):
    """Runs --dry-run and returns {rank: {params, grads, optimizer, activations}} in bytes."""
    data = write_dataset(os.path.join(args.workdir, "eq.h5"), n=2048, shape=(1, 8, 8), classes=4, seed=7)
    out = train_ranks(args, ranks, flags + ["--data", data, "--global-batch", "32", "--dry-run"], timeout=120)
    assert not re.search(r"^step ", out, re.M), f"--dry-run trained:\n{out}"
    rows = {}
    for m in re.finditer(r"rank (\d+) \(stage \d+, replica \d+\): params (\d+), grads (\d+), optimizer (\d+), "
                         r"activations (\d+)", out):
        rows[int(m.group(1))] = dict(zip(("params", "grads", "optimizer", "activations"), map(int, m.groups()[1:])))
    assert sorted(rows) == list(range(ranks)), out
    return rows


def largest_bucket(layer_sizes, total, bucket_mb):
    """Elements of the largest gradient bucket, as GradientSync cuts them: whole layers from the
    last one backwards, closed once at least bucket_mb MiB; the last bucket (the first cut) also
    covers the padding up to `total`, the first reaches down to element 0. layer_sizes: each
    layer's aligned trainable elements, in forward order."""
    starts = [sum(layer_sizes[:k]) for k in range(len(layer_sizes))]
    minimum = max(int(bucket_mb * (1 << 20)) // 4, 1)
    sizes, end = [], total
    for k in reversed(range(len(layer_sizes))):
        if end - starts[k] >= minimum or k == 0:
            begin = 0 if k == 0 else starts[k]
            sizes.append(end - begin)
            end = begin
    return max(sizes)


def case_zero_memory(args):
    """--dry-run's per-rank table, from the real allocations: with ZeRO 1 and 2 each rank holds
    optimizer state for S = align_up(ceil(N / dp), 16) elements (64-byte alignment), 4 bytes x
    (1 for SGD-momentum, 2 for AdamW) each; the last rank may hold less (N - (dp-1) S).
    Parameters stay whole, padded to dp x S elements; so do gradients with ZeRO 1, while ZeRO 2
    and 3 keep a gradient shard of S elements plus two scratch slots of the largest bucket.
    ZeRO 3 keeps a parameter shard of S elements plus two window slots of the largest layer
    (from its first parameter to the end of its last: fc1's 4096 + 64 elements)."""
    align = lambda n, m=16: (n + m - 1) // m * m
    # The MLP's flat layout, computed here independently: 8x8 inputs, 64, 32, 4 classes;
    # every tensor starts on a 16-element boundary.
    sizes = [64 * 64, 64, 32 * 64, 32, 4 * 32, 4]
    layer_sizes = [align(sizes[0]) + align(sizes[1]), align(sizes[2]) + align(sizes[3]),
                   align(sizes[4]) + align(sizes[5])]
    n = sum(align(s) for s in sizes)
    window = max(align(sizes[k]) + sizes[k + 1] for k in (0, 2, 4))
    bucket_mb = 0.005  # 1310 elements: buckets [0, 4160) and [4160, dp*S) - two, of different sizes
    for optimizer, per_element in (("sgd", 1), ("adamw", 2)):
        for dp in (1, 2, 4):
            flags = ZERO_MLP + ["--optimizer", optimizer, "--bucket-mb", str(bucket_mb)]
            base = dry_run_table(args, dp, flags + ["--zero", "0"])
            shard = align(-(-n // dp))
            bucket = largest_bucket(layer_sizes, dp * shard, bucket_mb)
            for zero in (1, 2, 3):
                rows = dry_run_table(args, dp, flags + ["--zero", str(zero)])
                for r in range(dp):
                    assert base[r]["grads"] == 4 * n and base[r]["optimizer"] == 4 * per_element * n, (r, base[r])
                    owned = max(0, min(shard, n - r * shard))
                    assert owned == shard or r == dp - 1, (dp, r, owned)
                    grads = 4 * dp * shard if zero == 1 else 4 * shard + 2 * 4 * bucket
                    params = 4 * dp * shard if zero < 3 else 4 * shard + 2 * 4 * window
                    expected = {"params": params, "grads": grads, "optimizer": 4 * per_element * owned,
                                "activations": base[r]["activations"]}
                    assert rows[r] == expected, f"{optimizer} zero {zero} dp={dp} rank {r}: {rows[r]}, expected {expected}"
                print(f"{optimizer} zero {zero} dp={dp}: N={n} S={shard} largest bucket {bucket}: optimizer bytes per "
                      f"rank {[rows[r]['optimizer'] for r in range(dp)]} (zero 0: {base[0]['optimizer']}), "
                      f"params/grads {rows[0]['params']}/{rows[0]['grads']} "
                      f"(zero 0: {base[0]['params']}/{base[0]['grads']})")


def case_zero_bad_inputs(args):
    """Unknown ZeRO stages: one line each, exit 2 on every rank."""
    data = write_dataset(os.path.join(args.workdir, "zero.h5"))
    base = ["--data", data, "--steps", "2", "--global-batch", "8", "--model", "mlp", "--hidden", "16"]
    expect_bad_input(args, base + ["--zero", "4"], r"--zero must be 0, 1, 2 or 3, found 4", ranks=2)
    expect_bad_input(args, base + ["--zero", "x"], r"zero.*x|x.*zero")


def case_rank_failure(args):
    """A rank that throws mid-training ends every rank, non-zero, within 10 s, naming the rank."""
    import time
    data = write_dataset(os.path.join(args.workdir, "fail.h5"), n=4096, seed=5)
    for ranks, failing in ((2, 1), (4, 2)):
        cmd = [args.mpirun, "-np", str(ranks), "--oversubscribe", args.train, "--model", "mlp", "--hidden", "64",
               "--data", data, "--steps", "100000", "--global-batch", "16", "--debug-fail-step", "20",
               "--debug-fail-rank", str(failing)]
        start = time.monotonic()
        rc, out, err = run(args, cmd, timeout=60)
        elapsed = time.monotonic() - start
        assert rc != 0, f"exit code 0 after an injected failure\n{out}\n{err}"
        assert elapsed < 10.0 + 3.0, f"took {elapsed:.1f} s to end the job"  # 3 s: mpirun start-up
        ours = [l for l in err.splitlines() if "injected failure" in l]
        assert len(ours) == 1 and f"rank {failing}" in ours[0], err
        print(f"{ranks} ranks: rank {failing} failed, job ended in {elapsed:.1f} s with exit code {rc}: {ours[0]}")


def fashion_mnist(args):
    """Converts the Debian package's Fashion-MNIST once into the work tree (as the main job does)."""
    out = os.path.join(os.path.dirname(args.workdir), "fashion-mnist")
    idx = "/usr/share/datasets/fashion-mnist"
    if not os.path.exists(os.path.join(out, "test.h5")):
        os.makedirs(os.path.join(out, "train"), exist_ok=True)
        for split, prefix, extra in (("train", "train/train", ["--shards", "4"]),
                                     ("t10k", "test", ["--stats-from", os.path.join(out, "train")])):
            rc, o, e = run(args, [args.data_tool, "convert-idx", "--images", f"{idx}/{split}-images-idx3-ubyte.gz",
                                  "--labels", f"{idx}/{split}-labels-idx1-ubyte.gz", "--out",
                                  os.path.join(out, prefix)] + extra)
            assert rc == 0, e
    return os.path.join(out, "train"), os.path.join(out, "test.h5")


def train_fashion_mnist(args, config, minimum, flags=()):
    """The main job's configuration on 2 ranks must reach `minimum` percent test accuracy;
    returns the accuracy."""
    train, test = fashion_mnist(args)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    name = "-".join(("ck",) + tuple(flags)).replace("-", "")
    rc, out, err = run(args, [args.mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none", args.train, "--config",
                              os.path.join(repo, "jobs", "configs", config), "--data", train, "--val-data", test,
                              "--checkpoint-dir", os.path.join(args.workdir, name), "--metrics",
                              os.path.join(args.workdir, name + "-metrics.jsonl")] + list(flags), timeout=1500)
    assert rc == 0, f"rc={rc}\n{out}\n{err}"
    m = re.search(r"final test: loss ([0-9.]+)\s+accuracy ([0-9.]+)%\s+\(10000 samples\)", out)
    assert m, out
    print(f"{config} {' '.join(flags)}: test accuracy {m.group(2)}% (required >= {minimum}%)")
    assert float(m.group(2)) >= minimum, out
    return float(m.group(2))


def case_fashion_mnist_cnn(args):
    train_fashion_mnist(args, "fashion-mnist.ini", 89.0)


def case_fashion_mnist_mlp(args):
    """The MLP reaches 85% in fp32, and bf16 (bf16 parameters and activations, f32 master
    weights and gradients) reaches the fp32 accuracy within 1 point."""
    fp32 = train_fashion_mnist(args, "fashion-mnist-mlp.ini", 85.0)
    bf16 = train_fashion_mnist(args, "fashion-mnist-mlp.ini", 85.0, ("--precision", "bf16"))
    print(f"bf16 {bf16}% vs fp32 {fp32}%: {bf16 - fp32:+.2f} points (allowed -1)")
    assert bf16 >= fp32 - 1.0, (bf16, fp32)


def read_group(path, group):
    with h5py.File(path, "r") as f:
        tensors = {}
        f[group].visititems(lambda name, obj: tensors.update({name: obj[...]}) if isinstance(obj, h5py.Dataset) else None)
        return tensors, dict(f.attrs)


def case_mixed_precision(args):
    """--precision bf16/fp16 with f32 master weights and loss scaling, checked through h5py:
    - a forced overflow (--debug-overflow-step) skips exactly that step: the model and the
      master weights after it equal those before it, the optimizer step count stays, and the
      dynamic loss scale is halved; without overflow it doubles every --loss-scale-window steps;
    - checkpoints hold f32 tensors: /model is the bf16-rounded master (exactly representable in
      bf16), /optimizer/master the full-precision weights;
    - ZeRO 1, 2, 3 == ZeRO 0 under bf16 (dp = 2; master shards, bf16 all-gathers and windows);
    - fp16 with dynamic loss scaling: save, kill, --resume == uninterrupted, bit for bit (the
      loss scale and its counter are part of the checkpoint)."""
    data = write_dataset(os.path.join(args.workdir, "mp.h5"), n=2048, shape=(1, 8, 8), classes=4, seed=7)
    common = ["--model", "mlp", "--hidden", "64,32", "--data", data, "--global-batch", "32", "--lr", "0.05",
              "--seed", "3", "--log-every", "1"]
    fp16 = ["--precision", "fp16", "--loss-scale-init", "1024", "--loss-scale-window", "3"]
    runs = {}
    for steps, extra in ((6, []), (7, ["--debug-overflow-step", "7"])):
        ck = os.path.join(args.workdir, f"ck-mp-{steps}")
        cmd = [args.mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none", args.train] + common + fp16 + [
            "--steps", str(steps), "--checkpoint-dir", ck] + extra
        rc, out, err = run(args, cmd)
        assert rc == 0, f"rc={rc}\n{out}\n{err}"
        out += err  # warnings go to stderr
        runs[steps] = (read_group(os.path.join(ck, f"step-{steps:08d}.h5"), "model"),
                       read_group(os.path.join(ck, f"step-{steps:08d}.h5"), "optimizer/master")[0], out)
    (model6, attrs6), master6, _ = runs[6]
    (model7, attrs7), master7, out7 = runs[7]
    assert "step 7: gradients overflowed at loss scale 4096; step skipped, loss scale now 2048" in out7, out7
    assert attrs6["loss_scale"] == 4096.0 and attrs6["loss_scale_good_steps"] == 0, attrs6  # 1024 x 2 x 2
    assert attrs7["loss_scale"] == 2048.0 and attrs7["loss_scale_good_steps"] == 0, attrs7
    assert attrs6["optimizer_step"] == 6 and attrs7["optimizer_step"] == 6 and attrs7["step"] == 7
    assert_same_model(model7, model6, "fp16 model after the skipped step 7 vs after step 6", rtol=0.0)
    assert_same_model(master7, master6, "fp16 master weights after the skipped step vs after step 6", rtol=0.0)

    # bf16 checkpoints: f32 datasets; the model is the master rounded to bf16.
    ck = os.path.join(args.workdir, "ck-mp-bf16")
    train_ranks(args, 2, common + ["--precision", "bf16", "--steps", "5", "--checkpoint-dir", ck])
    with h5py.File(os.path.join(ck, "step-00000005.h5"), "r") as f:
        assert f.attrs["precision"] == "bf16"
        for name in ("fc1/weight", "fc3/bias"):
            model, master = f["model/" + name][...], f["optimizer/master/" + name][...]
            assert model.dtype == np.float32 and master.dtype == np.float32
            assert not (model.view(np.uint32) & 0xFFFF).any(), f"{name}: /model is not bf16-representable"
            bits = master.view(np.uint32).astype(np.uint64)  # round to nearest even, as our bf16 does
            rounded = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
            assert np.array_equal(model, rounded), f"{name}: /model != bf16(master)"
            assert (master.view(np.uint32) & 0xFFFF).any(), f"{name}: master weights lost their low bits"

    # ZeRO under bf16 == replicated, and fp16 resume == uninterrupted.
    layouts = {z: (2, 16, ("--precision", "bf16", "--optimizer", "adamw", "--zero", z)) for z in "0123"}
    runs = equivalence_runs(args, ["--model", "mlp", "--hidden", "64,32"], list(layouts.values()), steps=20)
    for z in "123":
        assert_same_model(runs[layouts[z]], runs[layouts["0"]], f"bf16 zero {z} vs zero 0, 2 ranks", rtol=0.0)
    fp16_resume = ["--precision", "fp16", "--loss-scale-init", "256", "--loss-scale-window", "7"]
    reference = equivalence_runs(args, RESUME_MLP + fp16_resume, [(1, 32)], steps=30)[(1, 32)]
    model, _ = resumed_run(args, RESUME_MLP, (1, tuple(fp16_resume)), (1, tuple(fp16_resume)), ("--optimizer", "sgd"),
                           steps=30, split=10)
    assert_same_model(model, reference, "fp16 resumed at step 10 vs uninterrupted", rtol=0.0)
    # An fp32 checkpoint resumed as fp16: the scale starts at --loss-scale-init, not at fp32's 1.
    ck32 = os.path.join(args.workdir, "ck-mp-fp32")
    train_ranks(args, 1, common + ["--steps", "2", "--checkpoint-dir", ck32])
    train_ranks(args, 1, common + ["--precision", "fp16", "--loss-scale-init", "1024", "--steps", "3",
                                   "--checkpoint-dir", ck32, "--resume", "auto"])
    with h5py.File(os.path.join(ck32, "step-00000003.h5"), "r") as f:
        assert f.attrs["loss_scale"] == 1024.0 and f.attrs["precision"] == "fp16", dict(f.attrs)


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=sorted(CASES))
    p.add_argument("--train", required=True)
    p.add_argument("--mpirun", default="mpirun")
    p.add_argument("--data-tool", default="strata-data")
    p.add_argument("--workdir", required=True)
    a = p.parse_args()
    a.workdir = os.path.join(a.workdir, a.case)
    os.makedirs(a.workdir, exist_ok=True)
    CASES[a.case](a)
    print(f"{a.case}: ok")
