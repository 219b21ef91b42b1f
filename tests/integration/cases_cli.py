"""Cases of the command line itself: bad inputs, --help, training on h5py-written data (with
checkpoints, metrics and --eval-only), a diverging loss, two ranks together and a failing rank."""
import json
import math
import os
import re
import shutil
import sys

import h5py
import numpy as np

from harness import write_dataset, run, expect_bad_input, expect_tool_error, train_ranks, progress_lines


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
    # Outputs on a full device: the training goes on (the checkpoints are what matter), but the
    # lost lines are said, once per file.
    rc, out, err = run(args, [args.train] + base + ["--data", good, "--log-every", "1", "--metrics", "/dev/full",
                                                    "--log-file", "/dev/full"])
    assert rc == 0, err
    assert "warning: --metrics: cannot write '/dev/full' (No space left on device): its lines are being lost" in err, err
    assert "warning: --log-file: writing failed (No space left on device): its lines are being lost" in err, err
    assert err.count("its lines are being lost") == 2, err
    # A run refused during setup leaves no --checkpoint-dir it created (nor its .lock) behind;
    # one that existed stays, as it was.
    for refused in (["--data", text], ["--data", good, "--metrics", "/nonexistent/m.jsonl"],
                    ["--data", good, "--trace", "/nonexistent/t.json"]):
        ck = os.path.join(w, "ck-refused")
        shutil.rmtree(ck, ignore_errors=True)
        expect_bad_input(args, base + refused + ["--checkpoint-dir", ck], r".", ranks=2)
        assert not os.path.exists(ck), (refused, os.listdir(ck))
        os.makedirs(ck)
        expect_bad_input(args, base + refused + ["--checkpoint-dir", ck], r".")
        assert os.path.isdir(ck), refused

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
    expect_bad_input(args, ["--model", "cnn", "--data", good, "--steps", "1", "--init-from", ckpt],
                     r"--init-from .*step-00000002\.h5 holds a --model mlp but this run has --model cnn")
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
    """Trains on h5py-written data; checks accuracy, metrics (with the memory high-water mark),
    checkpoint (read back by h5py), eval-only."""
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
                              "--metrics", metrics, "--save-every", "30", "--micro-batch", "8", "--eval-every", "30"])
    assert rc == 0, f"rc={rc}\n{out}\n{err}"
    assert re.search(r"^options: .*--steps 60\b", out, re.M), "the options given not printed with the override"
    m = re.search(r"final test: loss ([0-9.]+)\s+accuracy ([0-9.]+)%", out)
    assert m, out
    assert float(m.group(2)) >= 90.0, f"accuracy {m.group(2)}% on a separable task"
    lines = [json.loads(l) for l in open(metrics)]
    records = [r for r in lines if "eval" not in r]
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50, 60], records
    # The closing evaluation is a line of its own, the numbers the run printed.
    evals = [r for r in lines if "eval" in r]
    assert [(r["step"], r["eval"]) for r in evals] == [(30, "val"), (60, "final")], evals
    assert abs(evals[1]["eval_loss"] - float(m.group(1))) <= 1e-6, (evals, m.groups())
    assert abs(100 * evals[1]["eval_accuracy"] - float(m.group(2))) <= 0.005 and evals[1]["eval_samples"] > 0, evals
    at30 = re.search(r"eval at step 30: loss ([0-9.e-]+)", out)
    assert at30 and abs(evals[0]["eval_loss"] - float(at30.group(1))) <= 1e-5 * max(1.0, evals[0]["eval_loss"]), evals
    assert records[-1]["loss"] < records[0]["loss"], records
    for r in records:
        assert set(r) >= {"step", "epoch", "loss", "lr", "samples_per_s", "peak_bytes", "tp_bytes_per_step"}, r
    # The memory high-water mark: at least the parameters, gradients and optimizer state the
    # plan counts (what lives the whole run), and never falling from one line to the next.
    plan = re.search(r"rank 0 \(stage 0, replica 0\): params (\d+), grads (\d+), optimizer (\d+)", out)
    peak = re.search(r"memory high-water mark per rank \(bytes: [^)]*\): (\d+)$", out, re.M)
    assert plan and peak, out
    persistent = sum(int(v) for v in plan.groups())
    assert int(peak.group(1)) >= persistent, (peak.group(1), persistent)
    peaks = [r["peak_bytes"] for r in records]
    assert peaks == sorted(peaks) and persistent <= peaks[0] and peaks[-1] <= int(peak.group(1)), (peaks, persistent)
    print(f"memory high-water mark {peak.group(1)} bytes; the plan's parameters, gradients and optimizer state "
          f"{persistent}; metrics {peaks[0]}..{peaks[-1]}")
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
    # Without --model and --hidden the checkpoint's recorded model is taken: the same numbers; a
    # different --model is one line saying so, not a tensor-shape error.
    rc, out4, err = run(args, [args.train, "--val-data", test, "--eval-only", "--init-from",
                               os.path.join(ckdir, "step-00000060.h5")])
    m4 = re.search(r"evaluation: loss ([0-9.]+)\s+accuracy ([0-9.]+)%", out4)
    assert rc == 0 and m4 and m4.groups() == m.groups() and "--init-from: the model of" in out4, (out4, err)
    rc, out5, err = run(args, [args.train, "--hidden", "32", "--val-data", test, "--eval-only", "--init-from",
                               os.path.join(ckdir, "step-00000060.h5")])  # a shape flag given: it wins, no clash
    m5 = re.search(r"evaluation: loss ([0-9.]+)\s+accuracy ([0-9.]+)%", out5)
    assert rc == 0 and m5 and m5.groups() == m.groups(), (out5, err)
    expect_bad_input(args, ["--model", "cnn", "--val-data", test, "--eval-only", "--init-from",
                            os.path.join(ckdir, "step-00000060.h5")],
                     r"holds a --model mlp but this run has --model cnn \(leave --model")
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
    assert sorted(os.listdir(ck)) == [".lock", "latest", "step-00000003.h5", "step-00000003.h5.manifest"], os.listdir(ck)
    records = progress_lines(metrics)  # every line parses
    assert all(math.isfinite(r["loss"]) for r in records), records
    print(f"--lr 1e30: {lines[0]}; checkpoints {sorted(os.listdir(ck))}; {len(records)} metrics lines, all finite")

    # A metrics file that cannot take the lines (a full disk: /dev/full): one warning, training goes on.
    rc, out, err = run(args, [args.train, "--model", "mlp", "--hidden", "16", "--data", data, "--global-batch", "16",
                              "--steps", "4", "--log-every", "1", "--metrics", "/dev/full"])
    warnings = [l for l in err.splitlines() if "--metrics: cannot write '/dev/full'" in l]
    assert rc == 0 and len(warnings) == 1, f"{rc}\n{out}\n{err}"
    # Without --val-data the closing line says it measured the training data (not "final test").
    assert "final evaluation of the training data (no --val-data): loss" in out and "final test" not in out, out
    # --resume auto that finds no checkpoint starts again: the old run's lines go.
    shutil.rmtree(ck, ignore_errors=True)
    train_ranks(args, 1, base + ["--steps", "3", "--resume", "auto"])
    assert [r["step"] for r in progress_lines(metrics)] == [1, 2, 3], open(metrics).read()

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


def case_thread_placement(args):
    """The default thread count is the rank's affinity mask shared among the ranks that overlap
    it (issue #20 item 3): 1 per rank when mpirun binds each of 2 ranks to a core, 2 for one rank
    given 2 cores (--map-by slot:PE=2); and ranks whose threads outnumber the cores they are bound
    to (two ranks pinned to core 0 with --threads 2) get one warning line naming them."""
    data = write_dataset(os.path.join(args.workdir, "threads.h5"), n=64)
    flags = ["--data", data, "--model", "mlp", "--hidden", "16", "--steps", "2", "--global-batch", "8"]

    def threads(mpirun_flags, extra=()):
        rc, out, err = run(args, [args.mpirun] + mpirun_flags + [args.train] + flags + list(extra))
        assert rc == 0, f"{mpirun_flags}: rc={rc}\n{out}\n{err}"
        found = re.search(r"\((\d+) rank\(s\) on .*, (\d+) thread\(s\) per rank\)", out)
        warnings = [l for l in err.splitlines() if "threads wait for each other" in l]
        return int(found.group(2)), warnings

    assert threads(["-np", "2", "--bind-to", "core"]) == (1, [])
    assert threads(["-np", "1", "--map-by", "slot:PE=2", "--bind-to", "core"]) == (2, [])
    n, warnings = threads(["-np", "2", "--cpu-set", "0", "--bind-to", "core"], ["--threads", "2"])
    assert n == 2 and len(warnings) == 1, warnings
    assert warnings[0].startswith("warning: ranks 0, 1 run 4 threads on 1 core (0): "), warnings
    # More ranks than cores, one thread each, is what --oversubscribe asks for: no warning.
    assert threads(["-np", "4", "--oversubscribe"]) == (1, [])
    print("threads: 1 per rank bound to a core, 2 with PE=2; " + warnings[0])


def case_deepspeed_config(args):
    """--deepspeed-config: 2 ranks trained from a ds_config.json (ZeRO 1, AdamW with betas, a
    warm-up, clipping, micro-batches) end with the same checkpoint, bit for bit, as the same run
    from the flags it maps to; its unmapped keys are one warning line each; a batch that does not
    add up (train_batch_size != micro x accumulation x dp) is one line, exit 2."""
    w = args.workdir
    data = write_dataset(os.path.join(w, "ds.h5"), n=512, shape=(1, 8, 8), seed=3)
    ds = os.path.join(w, "ds_config.json")
    config = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
              "gradient_clipping": 0.5, "steps_per_print": 5, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.002, "betas": [0.85, 0.98], "eps": 1e-7,
                                                         "weight_decay": 0.01}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.003, "warmup_num_steps": 4,
                                                           "warmup_type": "linear"}},
              "wall_clock_breakdown": False, "tensorboard": {"enabled": False}}
    with open(ds, "w") as f:
        json.dump(config, f)
    common = ["--model", "mlp", "--hidden", "32", "--data", data, "--steps", "10"]
    ck = {k: os.path.join(w, "ck-ds-" + k) for k in ("json", "flags")}
    out = train_ranks(args, 2, common + ["--deepspeed-config", ds, "--checkpoint-dir", ck["json"]])
    train_ranks(args, 2, common + ["--global-batch", "32", "--micro-batch", "8", "--clip-grad", "0.5", "--log-every", "5",
                                   "--zero", "1", "--optimizer", "adamw", "--lr", "0.003", "--beta1", "0.85",
                                   "--beta2", "0.98", "--eps", "1e-07", "--weight-decay", "0.01", "--warmup-steps", "4",
                                   "--checkpoint-dir", ck["flags"]])
    with h5py.File(os.path.join(ck["json"], "step-00000010.h5"), "r") as a, \
            h5py.File(os.path.join(ck["flags"], "step-00000010.h5"), "r") as b:
        names = []
        a.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        assert names and all(np.array_equal(a[n][...], b[n][...]) for n in names), names
    assert len(re.findall(r"^step \d+/10 ", out, re.M)) == 2, out  # steps_per_print 5
    rc, _, err = run(args, [args.mpirun, "-np", "2", "--oversubscribe", args.train] + common +
                     ["--deepspeed-config", ds, "--dry-run"])
    warned = sorted(l.split("'")[1] for l in err.splitlines() if "is not supported; ignored" in l)
    assert rc == 0 and warned == ["tensorboard.enabled", "wall_clock_breakdown"], err
    mapped = os.path.join(w, "ds_mapped.json")  # no unmapped keys: the error line is alone
    with open(mapped, "w") as f:
        json.dump({k: v for k, v in config.items() if k not in ("wall_clock_breakdown", "tensorboard")}, f)
    expect_bad_input(args, common + ["--deepspeed-config", mapped, "--micro-batch", "4"],
                     r"train_batch_size 32 = train_micro_batch_size_per_gpu 4 x .* gives 4 accumulation steps, "
                     r"but gradient_accumulation_steps is 2", ranks=2)
    print(f"ds_config run == flags run ({len(names)} tensors identical); warned {warned}")


def png_top_rows(path, rows):
    """The first `rows` rows of an 8-bit RGB or RGBA PNG (what rsvg-convert writes) as a (rows,
    width, channels) array: the PNG's filters undone by hand (the standard library has no PNG reader)."""
    import struct
    import zlib
    data, pos, idat = open(path, "rb").read(), 8, b""
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body, pos = data[pos + 8:pos + 8 + n], pos + 12 + n
        if kind == b"IHDR":
            width, _, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
            bpp = 4 if color == 6 else 3
        elif kind == b"IDAT":
            idat += body
    raw, stride = zlib.decompress(idat), width * bpp
    prev, out = bytearray(stride), []
    for r in range(rows):
        kind, line = raw[r * (stride + 1)], bytearray(raw[r * (stride + 1) + 1:(r + 1) * (stride + 1)])
        for i in range(stride):
            a, b, c = (line[i - bpp] if i >= bpp else 0), prev[i], (prev[i - bpp] if i >= bpp else 0)
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        out.append(bytes(line))
        prev = line
    return np.frombuffer(b"".join(out), np.uint8).reshape(rows, width, bpp)


def case_plot(args):
    """strata-plot (tools/): two runs of different --lr, each with --metrics and an evaluation
    every 10 steps, compared in one SVG (and a PNG, a PDF; a language model's runs in tokens/s):
    it parses as XML; its four panels (loss, evaluation accuracy, learning rate, throughput) have
    their axis labels and readable ticks (14k, 0.05: never 1.4e+04); each run has a loss, an
    accuracy, an lr and a throughput line whose points are its progress lines (accuracy: its
    evaluations of --val-data), its evaluations as markers on the loss and accuracy panels (the final
    one a ring), and its name in the legend, inside the picture (estimated from its length, and
    seen in the PNG: the right-most pixel column stays background although the label is long and
    wide); a run directory works as its metrics file. Bad inputs (not JSON, a line missing a
    field, non-UTF-8 bytes, a directory without metrics, a missing file, an unwritable or
    unsupported --out) are one line `error: ...`, exit 2, and leave no picture."""
    import subprocess
    import xml.etree.ElementTree as ET
    w = args.workdir
    plot = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "strata-plot")]
    data = write_dataset(os.path.join(w, "plot.h5"), n=512, shape=(1, 8, 8), seed=3)
    runs = {}
    for name, lr in (("lr0.05", "0.05"), ("lr0.2", "0.2")):
        runs[name] = os.path.join(w, "run-" + name)
        shutil.rmtree(runs[name], ignore_errors=True)
        os.makedirs(runs[name])
        train_ranks(args, 2, ["--model", "mlp", "--hidden", "32", "--data", data, "--val-data", data, "--steps", "30",
                              "--log-every", "5", "--eval-every", "10", "--lr", lr,
                              "--metrics", os.path.join(runs[name], "metrics.jsonl")])
    svg = os.path.join(w, "plot.svg")
    long_label = "lr 0.2 WWWWMMMM with a much longer name than the legend's column"
    p = subprocess.run(plot + [runs["lr0.05"], os.path.join(runs["lr0.2"], "metrics.jsonl"),
                               "--labels", "lr 0.05," + long_label, "--out", svg], capture_output=True, text=True)
    assert p.returncode == 0 and "wrote" in p.stdout, p
    S = "{http://www.w3.org/2000/svg}"
    root = ET.parse(svg).getroot()
    width = float(root.get("width"))
    texts = [t.text for t in root.iter(S + "text")]
    for label in ("training loss", "accuracy (%)", "lr", "samples/s", "step", "lr 0.05", long_label):
        assert label in texts, (label, texts)
    lines = root.findall(S + "polyline")
    points = sorted(len(l.get("points").split()) for l in lines)
    # loss, lr and throughput of each run: steps 5..30; accuracy: the evaluations at 10, 20 and the final one.
    assert points == [3, 3] + [6] * 6, points
    circles = root.findall(S + "circle")
    # Each run's evaluations at 10, 20 and the final one, on the loss and the accuracy panels.
    assert len(circles) == 12 and sum(c.get("fill") == "white" for c in circles) == 4, len(circles)
    tick_texts = [t.text for t in root.iter(S + "text") if t.get("class") == "tick"]
    assert len(tick_texts) >= 24, tick_texts  # 4 panels, both axes
    readable = re.compile(r"-?\d+(\.\d+)?[kM]?|-?\d(\.\d)?e-\d+")
    assert all(readable.fullmatch(t) for t in tick_texts), tick_texts
    for t in root.iter(S + "text"):  # the legend's labels: about 0.6 em per character, inside the picture
        if t.get("class") == "legend":
            assert float(t.get("x")) + 0.6 * float(t.get("font-size")) * len(t.text) <= width, (t.text, t.get("x"), width)
    # Bad inputs: one line, exit 2, no picture (nor a temporary file) left.
    bad_dir = os.path.join(w, "bad")
    shutil.rmtree(bad_dir, ignore_errors=True)
    os.makedirs(os.path.join(bad_dir, "no-metrics"))
    good_line = open(os.path.join(runs["lr0.05"], "metrics.jsonl")).readline()
    cases = {"not-json.jsonl": b"step 1 loss 2\n", "no-loss.jsonl": good_line.replace('"loss"', '"los"').encode(),
             "latin1.jsonl": good_line.encode() + b'{"step": 10, "eval": "val\xe9"}\n'}
    for name, content in cases.items():
        with open(os.path.join(bad_dir, name), "wb") as f:
            f.write(content)
    out = os.path.join(bad_dir, "p.svg")
    for argv, pattern in (([os.path.join(bad_dir, "not-json.jsonl")], r"line 1 is not JSON"),
                          ([os.path.join(bad_dir, "no-loss.jsonl")], r"line 1 has no number 'loss'"),
                          ([os.path.join(bad_dir, "latin1.jsonl")], r"line 2 is not UTF-8"),
                          ([os.path.join(bad_dir, "no-metrics")], r"holds no metrics\.jsonl"),
                          ([os.path.join(bad_dir, "missing.jsonl")], r"cannot read .*No such file"),
                          ([runs["lr0.05"], "--out", os.path.join(bad_dir, "no-dir", "p.svg")], r"cannot write"),
                          ([runs["lr0.05"], "--out", os.path.join(bad_dir, "not-json.jsonl", "p.svg")], r"cannot write"),
                          ([runs["lr0.05"], "--out", os.path.join(bad_dir, "p.jpg")], r"unsupported format '\.jpg'"),
                          ([runs["lr0.05"], "--labels", "a,b"], r"--labels names 2 runs, 1 given")):
        expect_tool_error(plot + argv + ([] if "--out" in argv else ["--out", out]), pattern,
                          absent=[out, os.path.join(bad_dir, "p.jpg")])
    # A PNG: the same picture rasterised (rsvg-convert); the long label ends before the right edge.
    png = os.path.join(w, "plot.png")
    p = subprocess.run(plot + [runs["lr0.05"], runs["lr0.2"], "--labels", "lr 0.05," + long_label, "--out", png],
                       capture_output=True, text=True)
    assert p.returncode == 0, p
    with open(png, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(head[16:20], "big") == width, head
    pixels = png_top_rows(png, 120)  # the legend's rows
    legend = pixels[40:100, 750:, :3]
    assert (legend < 128).any(), "no legend text rendered"
    assert (pixels[:, -3:, :3] == 255).all(), "the legend's text reaches the picture's right edge"
    pdf = os.path.join(w, "plot.pdf")  # a PDF: rsvg-convert's, not an SVG under another name
    p = subprocess.run(plot + [runs["lr0.05"], "--out", pdf], capture_output=True, text=True)
    assert p.returncode == 0, p
    with open(pdf, "rb") as f:
        assert f.read(5) == b"%PDF-", pdf
    # Language models' runs: throughput in tokens/s, its ticks in thousands.
    lm = os.path.join(w, "lm-metrics.jsonl")
    with open(lm, "w") as f:
        for step in (5, 10, 15):
            f.write(json.dumps({"step": step, "epoch": 0, "loss": 3.0 / step, "lr": 3e-4 * step / 15,
                                "samples_per_s": 10.0, "tokens_per_s": 13000.0 + 200 * step}) + "\n")
    p = subprocess.run(plot + [lm, "--out", svg], capture_output=True, text=True)
    assert p.returncode == 0, p
    root = ET.parse(svg).getroot()
    texts = [t.text for t in root.iter(S + "text")]
    assert "tokens/s" in texts and "samples/s" not in texts and "accuracy (%)" not in texts, texts
    tick_texts = [t.text for t in root.iter(S + "text") if t.get("class") == "tick"]
    assert "14k" in tick_texts and all(readable.fullmatch(t) for t in tick_texts), tick_texts
    assert any(re.fullmatch(r"\d(\.\d)?e-4", t) for t in tick_texts), tick_texts  # lr 1e-4 .. 3e-4
    print(f"strata-plot: {svg} with {len(lines)} lines, {len(circles)} evaluation markers; {png}; {pdf}")
