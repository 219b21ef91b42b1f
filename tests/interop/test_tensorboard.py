"""train --tensorboard against tensorboard's own readers: a tiny GPT with evaluations logs to
--tensorboard and --metrics, and every number of every JSON line must be the scalar of the same
tag at the same step, equal to float32 (no other scalars). On 1 rank; on 2 ranks (one event file:
rank 0's); and a run resumed from its step-6 checkpoint, whose restart makes the readers drop the
first run's later steps as --metrics drops its lines. Readers: event_accumulator.EventAccumulator
(every run), plugin_event_accumulator.EventAccumulator (the web app's Python backend, scalars as
tensors) and the `tensorboard` program itself over HTTP (its Rust data server where installed,
as --load_fast=auto picks) on the resumed run. Exit 77 (skipped) without tensorboard or h5py.

Usage: PYTHON test_tensorboard.py --train BUILD/train --mpirun mpirun --workdir DIR
"""
import argparse
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

try:
    import h5py
    import numpy as np
    import tensorboard
    from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
    from tensorboard.util import tensor_util
except ImportError as e:
    print(f"skipped: {e}")
    sys.exit(77)

GPT = ["--model", "gpt", "--layers", "1", "--heads", "2", "--embed", "16", "--seq-len", "16", "--threads", "1",
       "--global-batch", "8", "--seed", "1", "--steps", "12", "--log-every", "2", "--eval-every", "6"]


def tokens(path, seed):
    """A byte-tokenizer shard (docs/formats.md): lower-case words, end-of-text (256) between."""
    rng = np.random.default_rng(seed)
    words = [bytes(rng.integers(97, 123, rng.integers(2, 8))) for _ in range(40)]
    ids = []
    for _ in range(60):
        ids += list(b" ".join(words[i] for i in rng.integers(0, len(words), 12))) + [256]
    with h5py.File(path, "w") as f:
        f.create_dataset("tokens", data=np.array(ids, np.uint16))
        f.attrs["kind"] = "tokens"
        f.attrs["vocab_size"] = np.int64(257)
        f.attrs["num_tokens"] = np.int64(len(ids))
        f.attrs["tokenizer"] = "byte"
        f.attrs["eot"] = np.int64(256)
    return path


def train(args, ranks, flags):
    cmd = [args.mpirun, "-np", str(ranks), "--oversubscribe", "--bind-to", "none", args.train] + GPT + flags
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{' '.join(cmd)}\nrc={p.returncode}\n{p.stdout}\n{p.stderr}"
    return p.stdout


def expected_scalars(metrics):
    """{tag: [(step, float32)]} of a --metrics file, by docs/formats.md's rule: each number under
    its key (a nested object's as OUTER/INNER), an evaluation's prefixed by its "eval" text;
    "step" is the step; null and text are not scalars."""
    scalars = {}

    def numbers(obj, prefix):
        for key, value in obj.items():
            if isinstance(value, dict):
                yield from numbers(value, prefix + key + "/")
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                yield prefix + key, value

    for line in open(metrics):
        record = json.loads(line)
        label = record["eval"] + "/" if "eval" in record else ""
        for key, value in numbers(record, ""):
            if key != "step":
                scalars.setdefault(label + key, []).append((record["step"], np.float32(value)))
    return scalars


def read_scalars(logdir):
    """{tag: [(step, value)]} as TensorBoard's reader loads the run directory."""
    acc = event_accumulator.EventAccumulator(logdir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_plugin_scalars(logdir):
    """{tag: [(step, value)]} as the web app's Python backend loads it (simple_value migrated to
    float32 tensors)."""
    acc = plugin_event_accumulator.EventAccumulator(logdir, size_guidance={plugin_event_accumulator.TENSORS: 0})
    acc.Reload()
    return {tag: [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"]}


def read_served_scalars(logdir, tags):
    """{tag: [(step, value)]} of `tags` as the `tensorboard` program serves them, once it has
    loaded them all (it loads in the background)."""
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", logdir, "--port", "0",
                               "--host", "127.0.0.1", "--load_fast", "auto"],
                              stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 120
        url = None
        while url is None and time.monotonic() < deadline:
            line = server.stderr.readline()
            assert line or server.poll() is None, "tensorboard exited before serving"
            m = re.search(r"(http://[^ ]+?)/? \(Press CTRL\+C", line)
            url = m and m.group(1)
        assert url, "tensorboard never said where it serves"
        while time.monotonic() < deadline:
            loaded = json.load(urllib.request.urlopen(f"{url}/data/plugin/scalars/tags")).get(".", {})
            if set(loaded) >= set(tags):
                break
            time.sleep(0.5)
        time.sleep(2)  # a tag's points may still be loading
        return {tag: [(step, value) for _, step, value in json.load(urllib.request.urlopen(
            f"{url}/data/plugin/scalars/scalars?run=.&tag={urllib.parse.quote(tag)}"))] for tag in tags}
    finally:
        server.terminate()
        server.wait(timeout=30)


def check_same(logdir, metrics, what, read=read_scalars):
    want, got = expected_scalars(metrics), read(logdir)
    assert set(got) == set(want), f"{what}: tags differ: only TensorBoard {sorted(set(got) - set(want))}, " \
                                  f"only --metrics {sorted(set(want) - set(got))}"
    for tag in sorted(want):
        steps = [s for s, _ in want[tag]]
        assert [s for s, _ in got[tag]] == steps, f"{what}: {tag} steps {[s for s, _ in got[tag]]} != {steps}"
        for (step, w), (_, g) in zip(want[tag], got[tag]):
            # The reader's float is the float32 the file holds; NaN is no number JSON can hold.
            assert np.float32(g) == w, f"{what}: {tag} at step {step}: TensorBoard {g!r}, --metrics {w!r}"
    print(f"{what}: {len(want)} tags, {sum(len(v) for v in want.values())} scalars equal")
    return want


def event_files(logdir):
    return sorted(glob.glob(os.path.join(logdir, "*")))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--mpirun", default="mpirun")
    p.add_argument("--workdir", required=True)
    args = p.parse_args()
    w = args.workdir
    shutil.rmtree(w, ignore_errors=True)
    os.makedirs(w)
    print(f"tensorboard {tensorboard.__version__}")
    data = ["--data", tokens(os.path.join(w, "train.h5"), 1), "--val-data", tokens(os.path.join(w, "val.h5"), 2)]

    # One rank: every number of the JSON lines, at its step.
    tb, metrics = os.path.join(w, "tb1"), os.path.join(w, "m1.jsonl")
    train(args, 1, data + ["--tensorboard", tb, "--metrics", metrics])
    (name,) = [os.path.basename(f) for f in event_files(tb)]
    host = re.escape(socket.gethostname())
    assert re.fullmatch(rf"events\.out\.tfevents\.\d{{10}}\.{host}\.\d+", name), name
    want = check_same(tb, metrics, "1 rank")
    for tag in ("loss", "lr", "tokens_per_s", "mfu", "peak_bytes", "split/comm", "val/eval_loss",
                "val/eval_accuracy", "val/eval_perplexity", "final/eval_loss"):
        assert tag in want, f"{tag} not in the metrics: {sorted(want)}"
    assert [s for s, _ in want["loss"]] == [2, 4, 6, 8, 10, 12], want["loss"]
    assert [s for s, _ in want["val/eval_loss"]] == [6], want["val/eval_loss"]  # step 12's is the final one
    assert [s for s, _ in want["final/eval_loss"]] == [12], want["final/eval_loss"]

    # Two ranks: rank 0 alone writes, one file.
    tb, metrics = os.path.join(w, "tb2"), os.path.join(w, "m2.jsonl")
    train(args, 2, data + ["--tensorboard", tb, "--metrics", metrics])
    files = event_files(tb)
    assert len(files) == 1, f"2 ranks wrote {files}"
    check_same(tb, metrics, "2 ranks")

    # Resumed from step 6: the second run's file restarts at step 7; the reader's scalars are the
    # metrics file's once more (the first run's steps 8..12 dropped, logged again).
    tb, metrics, ck = os.path.join(w, "tb3"), os.path.join(w, "m3.jsonl"), os.path.join(w, "ck3")
    outputs = data + ["--tensorboard", tb, "--metrics", metrics, "--checkpoint-dir", ck, "--save-every", "6"]
    train(args, 1, outputs)
    first = expected_scalars(metrics)
    time.sleep(1.1)  # TensorBoard reads a directory's files in name order: whole seconds first
    train(args, 1, outputs + ["--resume", os.path.join(ck, "step-00000006.h5")])
    assert len(event_files(tb)) == 2, event_files(tb)
    assert [s for s, _ in expected_scalars(metrics)["loss"]] == [2, 4, 6, 8, 10, 12]
    resumed = check_same(tb, metrics, "resumed at step 6")
    check_same(tb, metrics, "resumed, TensorBoard's web backend", read_plugin_scalars)
    check_same(tb, metrics, "resumed, served by tensorboard", lambda d: read_served_scalars(d, list(resumed)))
    assert resumed["loss"][:3] == first["loss"][:3], (resumed["loss"], first["loss"])


if __name__ == "__main__":
    main()
