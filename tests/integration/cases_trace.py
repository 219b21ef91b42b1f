"""train --trace: the Chrome trace-event file of every rank, checked as a viewer would read it,
and the progress lines' step-time split and metrics fields."""
import json
import os
import re

from cases_gpt import GPT_FLAGS_UNTIED, tokenize
from cases_tensor_parallel import GPT4
from harness import expect_bad_input, train_ranks, write_dataset


def check_trace(path, ranks, steps, pipeline=True):
    """Parses the file and checks what a reader of it relies on (with `pipeline`, its messages);
    returns its events."""
    with open(path) as f:
        trace = json.load(f)
    events, other = trace["traceEvents"], trace["otherData"]
    assert other["ranks"] == ranks and other["cut_ranks"] == [], other
    # One node: every rank's clock is CLOCK_MONOTONIC, so the measured offset is the error.
    assert all(abs(o) < 1000 for o in other["clock_offset_us"]), other
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {pid for pid, _ in names} == set(range(ranks)), names
    # Every rank: its steps, compute (layers inside forward/backward) and communication.
    step_spans = {}
    for e in events:
        if e["ph"] == "X" and e["cat"] == "step":
            step_spans[(e["pid"], e["args"]["step"])] = (e["ts"], e["ts"] + e["dur"])
    assert set(step_spans) == {(p, s) for p in range(ranks) for s in steps}, sorted(step_spans)
    for pid in range(ranks):
        mine = [e for e in events if e["pid"] == pid]
        assert any(e["ph"] == "X" and e["cat"] == "compute" and e["name"] == "forward" for e in mine), pid
        assert any(e["ph"] == "X" and e["cat"] == "compute" and e["name"] == "backward" for e in mine), pid
        assert any(e["ph"] == "b" and e["cat"] == "communication" for e in mine), pid
        assert any(e["ph"] == "X" and e["cat"] == "optimizer" for e in mine), pid
        assert any(e["ph"] == "X" and e["cat"] == "loader thread" for e in mine), pid
    # In-flight operations: a begin and an end per id, the end not before the begin.
    begins = {(e["pid"], e["id2"]["local"]): e for e in events if e["ph"] == "b"}
    ends = {(e["pid"], e["id2"]["local"]): e for e in events if e["ph"] == "e"}
    assert begins.keys() == ends.keys() and begins, (len(begins), len(ends))
    # The events of a step nest inside the step (1 us of slack: times are printed to the ns).
    slack = 1e-3
    for e in events:
        step = e.get("args", {}).get("step", -1)
        if e["ph"] not in "Xb" or step < 0:
            continue
        start = e["ts"]
        end = start + e["dur"] if e["ph"] == "X" else ends[(e["pid"], e["id2"]["local"])]["ts"]
        lo, hi = step_spans[(e["pid"], step)]
        assert lo - slack <= start <= end <= hi + slack, (e, lo, hi)
    # Every send has its matching receive on the peer, and the flow arrows join them.
    sends = [e for e in begins.values() if e["args"].get("flow") and e["name"].startswith("send")]
    recvs = {e["args"]["flow"]: e for e in begins.values() if e["args"].get("flow") and e["name"].startswith("recv")}
    assert len(sends) == len(recvs) and bool(sends) == pipeline, (len(sends), len(recvs))
    for s in sends:
        r = recvs[s["args"]["flow"]]
        assert (r["pid"], r["args"]["peer"], r["args"]["bytes"]) == (s["args"]["peer"], s["pid"], s["args"]["bytes"]), (s, r)
        assert r["args"]["tag"] == s["args"]["tag"], (s, r)
    flows = {}
    for e in events:
        if e["ph"] in "sf":
            flows.setdefault(e["id"], []).append(e["ph"])
    assert len(flows) == len(sends) and all(sorted(v) == ["f", "s"] for v in flows.values()), flows
    return events


def progress_lines(out):
    """(step, {wait: percent}, MFU or '', memory) of each progress line; compute is the rest."""
    lines = re.findall(r"^step (\d+)/\d+ .* ms(?: \(([a-z0-9%, ]+)\))?(?:  MFU ([0-9.]+)%)?  mem ([0-9.]+) (KiB|MiB|GiB)",
                       out, re.M)
    return [(step, {k: int(v) for k, v in re.findall(r"(\w+) (\d+)%", waits)}, mfu, mem) for step, waits, mfu, mem, _ in lines]


def case_trace(args):
    """--trace on 4 ranks, pp 2 x dp 2 (an MLP, steps 3-6 of 12, a checkpoint at step 4) and tp 2
    x dp 2 (the tiny GPT, the last 2 steps of 6 and the closing evaluation): the file parses as
    JSON, has one process per rank, each with its steps, forward/backward and per-layer compute,
    communication in flight, the optimizer and the loader thread; the events of a step lie
    inside it; every pipeline send has its receive on the peer (same flow id, bytes and tag, one
    flow arrow each); the clock offsets are below 1 ms; tp collectives and the evaluation are
    there. The progress lines carry the step-time split (shares summing to 100% +- rounding),
    MFU and memory, and --metrics the same fields. Bad --trace-steps and an unwritable --trace are
    one line, exit 2."""
    w = args.workdir
    data = write_dataset(os.path.join(w, "trace.h5"), n=512, shape=(1, 8, 8), seed=3)
    path, metrics = os.path.join(w, "pp.trace.json"), os.path.join(w, "trace-metrics.jsonl")
    for f in (path, metrics):
        if os.path.exists(f):
            os.remove(f)
    ck = os.path.join(w, "ck-trace")
    out = train_ranks(args, 4, ["--model", "mlp", "--hidden", "64,64", "--data", data, "--steps", "12",
                                "--log-every", "4", "--pp", "2", "--global-batch", "32", "--micro-batch", "8",
                                "--trace", path, "--trace-steps", "3:6", "--metrics", metrics,
                                "--checkpoint-dir", ck, "--save-every", "4"])
    m = re.search(r"^trace: (\S+) \((\d+) events of 4 ranks, steps 3-6; clock offsets at most ([0-9.]+) us", out, re.M)
    assert m and m.group(1) == path, out
    events = check_trace(path, 4, range(3, 7))
    layer_names = {e["name"] for e in events if e["ph"] == "X" and e["cat"] == "compute"}
    assert {"fc1", "fc2", "forward", "backward", "loss"} <= layer_names, layer_names
    micro = {e["args"].get("micro") for e in events if e["ph"] == "X" and e["name"] == "forward"}
    assert micro == {0, 1}, micro  # 32 / 2 replicas / 8 per micro-batch
    saves = [e for e in events if e["ph"] == "X" and e["cat"] == "checkpoint"]
    assert {e["pid"] for e in saves} == set(range(4)), saves  # every rank takes part in the save of step 4
    assert any(e["name"].startswith("all_reduce") and "dp" in e["name"] for e in events if e["ph"] == "b"), "no dp"

    # 6 x the forward multiply-adds of a sample: 64*64 + 64*64 + 64*4 weights on the flattened 8x8 input.
    flops_per_sample = 6 * (64 * 64 + 64 * 64 + 64 * 4)
    lines = progress_lines(out)
    assert [int(l[0]) for l in lines] == [4, 8, 12], out
    for l in lines:
        assert l[2], l  # MFU against the GEMM rate measured at start (CPU); 0.0% on a loaded machine
    with open(metrics) as f:
        records = [json.loads(line) for line in f if '"eval"' not in line]
    assert [r["step"] for r in records] == [4, 8, 12], records
    for r, l in zip(records, lines):
        # The line names the waits of --metrics' split that round to 1% or more (pipeline always: pp 2);
        # --metrics holds 4 decimals, so a share at a rounding boundary may go either way.
        waits = {k: 100 * v for k, v in r["split"].items() if k != "compute"}
        assert "pipeline" in l[1] and all(abs(l[1][k] - waits[k]) <= 0.51 for k in l[1]), (l, r)
        assert all(v < 0.51 for k, v in waits.items() if k not in l[1]), (l, r)
        assert abs(sum(r["split"].values()) - 1) < 1e-3 and r["split"]["pipeline"] > 0, r
        assert r["step_time_s"] > 0 and r["tflops_per_rank"] > 0 and r["mfu"] is not None and r["peak_bytes"] > 0, r
        # The model's FLOP rate per rank: 6 x forward multiply-adds per sample x samples/s over 4 ranks.
        # --metrics rounds samples/s to 0.1 and the rate to 6 significant digits: the tolerance is
        # those roundings (a relative bound alone fails on a slow machine's small samples/s).
        expected = flops_per_sample * r["samples_per_s"] / 4
        tolerance = flops_per_sample * 0.05 / 4 + 1e-5 * expected
        assert abs(r["tflops_per_rank"] * 1e12 - expected) <= tolerance, (r, expected)

    # tp 2 x dp 2 on the GPT: the tp collectives, and the closing evaluation after the last step.
    tokens = tokenize(args, "byte")
    path = os.path.join(w, "tp.trace.json")
    out = train_ranks(args, 4, GPT4 + GPT_FLAGS_UNTIED + [
        "--data", tokens[0], "--val-data", tokens[1], "--steps", "6", "--global-batch", "8", "--log-every", "3",
        "--tp", "2", "--trace", path, "--trace-steps", "5:6"])
    events = check_trace(path, 4, [5, 6], pipeline=False)
    assert any(e["ph"] == "b" and e["args"]["group"] == "tp" for e in events), "no tp collective"
    assert {e["pid"] for e in events if e["ph"] == "X" and e["cat"] == "evaluation"} == set(range(4))
    assert {"h0", "h1", "lm_head"} <= {e["name"] for e in events if e["ph"] == "X" and e["cat"] == "compute"}
    assert re.search(r"^step 6/6 .* tokens/s ", out, re.M), out

    expect_bad_input(args, ["--model", "mlp", "--data", data, "--steps", "2", "--trace", path, "--trace-steps", "6"],
                     r"--trace-steps expects FIRST:LAST .* found '6'")
    expect_bad_input(args, ["--model", "mlp", "--data", data, "--steps", "2", "--trace", path, "--trace-steps", "7:3"],
                     r"--trace-steps expects FIRST:LAST .* found '7:3'")
    expect_bad_input(args, ["--model", "mlp", "--data", data, "--steps", "2", "--trace", os.path.join(w, "no-such-dir", "t.json")],
                     r"--trace")


def case_run_dir(args):
    """--run-dir runs/x-{time}: the first lines are a short summary naming the directory (no
    option dump); it holds the checkpoints, metrics.jsonl, train.log and config.ini; a second run
    of the same command gets a directory of its own; `train --config DIR/config.ini` repeats the
    run (same final checkpoint, bit for bit) in a new directory; an unwritable --run-dir is one
    line, exit 2."""
    import glob
    import time
    import h5py
    import numpy as np
    w = args.workdir
    data = write_dataset(os.path.join(w, "rundir.h5"), n=256, shape=(1, 8, 8), seed=5)
    base = os.path.join(w, "rundirs")
    import shutil
    shutil.rmtree(base, ignore_errors=True)
    flags = ["--model", "mlp", "--hidden", "32", "--data", data, "--steps", "6", "--log-every", "3",
             "--run-dir", os.path.join(base, "mlp-{time}")]
    out = train_ranks(args, 2, flags)
    m = re.search(r"^options: (.*)\n  \(2 rank\(s\) on .*\)\nrun directory: (\S+) \(every option's value in its "
                  r"config.ini\)", out, re.M)
    assert m, out
    first = m.group(2)
    assert re.fullmatch(re.escape(os.path.join(base, "mlp-")) + r"\d{8}-\d{6}", first), first
    assert "--run-dir " + os.path.join(base, "mlp-{time}") in m.group(1), m.group(1)
    assert "configuration:" not in out and len(out.splitlines()[0]) < 400, out.splitlines()[0]
    assert {"config.ini", "latest", "metrics.jsonl", "step-00000006.h5", "train.log"} <= set(os.listdir(first)), \
        os.listdir(first)
    with open(os.path.join(first, "train.log")) as f:
        assert "step 6/6" in f.read()
    time.sleep(1.1)  # a new second: a new name
    train_ranks(args, 2, flags)
    again = os.path.join(base, "config-run")
    train_ranks(args, 2, ["--config", os.path.join(first, "config.ini"), "--run-dir", again])
    dirs = sorted(glob.glob(os.path.join(base, "mlp-*")))
    assert len(dirs) == 2 and first in dirs, dirs
    with h5py.File(os.path.join(first, "step-00000006.h5"), "r") as a, \
            h5py.File(os.path.join(again, "step-00000006.h5"), "r") as b:
        names = []
        a.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        assert names and all(np.array_equal(a[n][...], b[n][...]) for n in names), names
    # A fixed --run-dir reused by a different run: the earlier config.ini is kept, and said; the
    # same run again (a requeue) replaces nothing.
    before = open(os.path.join(again, "config.ini")).read()
    out = train_ranks(args, 2, ["--config", os.path.join(first, "config.ini"), "--run-dir", again, "--steps", "7"])
    assert f"note: --run-dir {again} held an earlier run's config.ini: kept as config.ini.1" in out, out
    assert open(os.path.join(again, "config.ini.1")).read() == before
    out = train_ranks(args, 2, ["--config", os.path.join(first, "config.ini"), "--run-dir", again, "--steps", "7"])
    assert "held an earlier run's config.ini" not in out and not os.path.exists(os.path.join(again, "config.ini.2"))
    blocker = os.path.join(w, "rundir-file")
    open(blocker, "w").close()
    expect_bad_input(args, ["--model", "mlp", "--data", data, "--steps", "1", "--run-dir", os.path.join(blocker, "x")],
                     r"--run-dir .*: cannot write its config.ini there")
