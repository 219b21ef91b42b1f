#!/usr/bin/env python3
"""End-to-end cases for the train program, one CTest test per case.

Usage: cli_cases.py CASE --train PATH --workdir DIR [--mpirun PATH]
Datasets are written here with h5py (an oracle we did not write), so every case also checks
that h5py-written files load. Bad-input cases assert: exit code 2, exactly one line on
stderr naming what was expected and what was found, no crash or traceback.
"""
import argparse
import json
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
                 "--metrics", "--init-from", "--eval-only", "--config"):
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


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=sorted(CASES))
    p.add_argument("--train", required=True)
    p.add_argument("--mpirun", default="mpirun")
    p.add_argument("--workdir", required=True)
    a = p.parse_args()
    a.workdir = os.path.join(a.workdir, a.case)
    os.makedirs(a.workdir, exist_ok=True)
    CASES[a.case](a)
    print(f"{a.case}: ok")
