"""Checkpoints: resume (bit for bit, and across layouts), --keep, bad checkpoints, failures only
some ranks see at setup, preemption by SIGTERM, SIGKILL during a write, a chain of layouts,
and export to torch."""
import os
import re
import shutil
import subprocess
import sys

import h5py
import numpy as np

from harness import (MPI_ENV, write_dataset, run, expect_bad_input, expect_tool_error, train_ranks, read_model,
                     assert_same_model, equivalence_runs, RESUME_MLP, resumed_run, progress_lines)


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
    assert sorted(os.listdir(ck)) == [".lock", "latest", "step-00000040.h5", "step-00000040.h5.manifest",
                                      "step-00000050.h5", "step-00000050.h5.manifest"], os.listdir(ck)
    assert open(os.path.join(ck, "latest")).read().strip() == "step-00000050.h5"
    cmd = [args.mpirun, "-np", "2", "--oversubscribe", args.train] + base[:-4] + [
        "--global-batch", "32", "--checkpoint-dir", ck, "--steps", "60", "--resume", "auto"]
    rc, out, err = run(args, cmd)
    assert rc == 0, err
    warnings = [l for l in err.splitlines() if "global-batch" in l]
    assert len(warnings) == 1 and "approximate" in warnings[0], err
    assert "resuming from" in out and "at step 50" in out, out


def snapshot(directory):
    """{file name: bytes} of a directory, to show that nothing on disk changed (but .lock, which
    names the last job that held the directory)."""
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory)) if n != ".lock"}


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
    losses = [[r["loss"] for r in progress_lines(os.path.join(w, n))] for n in ("log-whole.jsonl", "log-resumed.jsonl")]
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


def start_two_ranks(args, flags, metrics):
    """Starts train on 2 ranks with --metrics METRICS and returns (the mpirun process, the ranks'
    pids) once training is under way: rank 0 has appended its first metrics line (unbuffered,
    unlike stdout through mpirun)."""
    import time
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [args.mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none", args.train] + flags + ["--metrics", metrics]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, **MPI_ENV))
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0) and p.poll() is None:
        time.sleep(0.005)
    ranks = train_processes(p.pid, args.train)
    assert len(ranks) == 2, ranks
    return p, ranks


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
    p, ranks = start_two_ranks(args, common + ["--checkpoint-dir", ck], os.path.join(w, "preempt-metrics.jsonl"))
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
    """SIGKILL to one rank of a 2-rank job while a checkpoint is being written (step-N.h5.tmp
    exists at the moment of the kill and still exists afterwards, with no step-N.h5): rank 0
    while it writes alone (--checkpoint-io rank0), rank 1 while both write their parts
    (parallel). Each time the previous checkpoint and `latest` are intact (every tensor's crc32
    checked with h5py), and --resume auto continues from it and ends bit-identical to an
    uninterrupted run."""
    import shutil
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
    for mode, victim in (("rank0", 0), ("parallel", 1)):
        kill_during_write(args, common + ["--checkpoint-io", mode], steps, ref_ck, victim, mode)


def kill_during_write(args, common, steps, ref_ck, victim, mode):
    import shutil
    import signal
    import time
    w = args.workdir
    for attempt in range(1, 6):
        ck = os.path.join(w, "ck-kill-" + mode)
        shutil.rmtree(ck, ignore_errors=True)
        os.makedirs(ck)
        cmd = [args.mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none", args.train] + common + [
            "--checkpoint-dir", ck, "--save-every", "2"]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, **MPI_ENV))
        target, killed_tmp = None, None
        deadline = time.monotonic() + 300
        while p.poll() is None and time.monotonic() < deadline:
            if target is None:
                ranks = train_processes(p.pid, args.train)
                if len(ranks) == 2:
                    try:
                        target = [r for r in ranks if rank_of(r) == victim][0]
                    except (OSError, IndexError):
                        target = None
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
                os.kill(target, signal.SIGKILL)
                killed_tmp = tmps[0]
                break
        out, err = p.communicate(timeout=120)
        if killed_tmp is None:
            print(f"{mode} attempt {attempt}: no kill (rc {p.returncode}); retrying")
            continue
        names = sorted(os.listdir(ck))
        final = killed_tmp[:-len(".tmp")]
        if killed_tmp not in names or final in names:
            print(f"{mode} attempt {attempt}: {killed_tmp} was committed before the kill landed ({names}); retrying")
            continue
        assert p.returncode != 0, f"the job survived SIGKILL of rank {victim}\n{out}\n{err}"
        latest = open(os.path.join(ck, "latest")).read().strip()
        killed_step = int(final[5:13])
        assert latest == f"step-{killed_step - 2:08d}.h5", (latest, killed_tmp, names)
        n = verify_crc(os.path.join(ck, latest))
        print(f"{mode} attempt {attempt}: SIGKILL to rank {victim} (pid {target}) while {killed_tmp} was being "
              f"written ({os.path.getsize(os.path.join(ck, killed_tmp))} bytes on disk); mpirun exit {p.returncode}; "
              f"latest = {latest}, {n} tensors crc-verified by h5py; directory: {names}")
        # The requeued job runs the same command; its save of step N replaces the stale .tmp.
        out = train_ranks(args, 2, common + ["--checkpoint-dir", ck, "--save-every", "2", "--resume", "auto"])
        assert f"resuming from {os.path.join(ck, latest)} at step {killed_step - 2}" in out, out
        assert not [x for x in os.listdir(ck) if x.endswith(".tmp")], os.listdir(ck)
        assert_same_model(read_model(os.path.join(ck, f"step-{steps:08d}.h5")),
                          read_model(os.path.join(ref_ck, f"step-{steps:08d}.h5")),
                          f"{mode}: killed + resumed vs uninterrupted", rtol=0.0)
        return
    raise AssertionError(f"could not kill rank {victim} during a {mode} checkpoint write in 5 attempts")


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
    """tools/export_torch.py, given the run's checkpoint directory, writes a self-describing file
    (options + state_dict) that `from export_torch import load; model = load(PT)` turns back into
    the module, in eval mode; its state_dict holds the checkpoint's tensors exactly, and the
    loaded module's loss on a test set equals `train --eval-only` within 1e-5 (accuracy equal), as
    does --eval's, for the MLP with dropout, the CNN and a depth-8 width-4 ResNet (BatchNorm
    running statistics, shortcut convs), saved from a 2-rank pp=2 run. Bad inputs (a text file, a
    directory without checkpoints, truncated checkpoints, a dataset, unwritable outputs, --eval on
    bad data) are one line `error: ...`, exit 2, and leave no output file; a directory whose
    `latest` names a damaged file gives the next older checkpoint, with a warning."""
    import torch
    import torch.nn.functional as F
    w = args.workdir
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    export = [sys.executable, os.path.join(repo, "tools", "export_torch.py")]
    sys.path.insert(0, os.path.join(repo, "tools"))
    from export_torch import load
    train = write_dataset(os.path.join(w, "train.h5"), n=512, shape=(1, 8, 8), seed=1)
    test = write_dataset(os.path.join(w, "test.h5"), n=300, shape=(1, 8, 8), seed=2)
    with h5py.File(test, "r") as f:  # uint8 without normalisation attributes: Strata scales by 1/255
        x, y = torch.from_numpy(f["inputs"][...].astype(np.float32) / 255), torch.from_numpy(f["labels"][...])
    for model in (["--model", "mlp", "--hidden", "32,16", "--dropout", "0.2"], ["--model", "cnn"],
                  ["--model", "resnet", "--depth", "8", "--width", "4"]):
        ck = os.path.join(w, "ck-" + model[1])
        shutil.rmtree(ck, ignore_errors=True)
        # Few small steps: a loss far from 0, so the comparison means something.
        train_ranks(args, 2, model + ["--pp", "2", "--data", train, "--steps", "12", "--global-batch", "32",
                                      "--lr", "0.02", "--checkpoint-dir", ck])
        path = os.path.join(ck, "step-00000012.h5")
        out_pt = os.path.join(w, model[1] + ".pt")
        rc, out, err = run(args, export + [ck, out_pt, "--eval", test])  # the directory: its newest checkpoint
        assert rc == 0 and f"exporting {path} " in out, f"{out}\n{err}"
        saved, stored = torch.load(out_pt), read_model(path)
        assert saved["format"] == "strata-torch-export" and saved["kind"] == model[1] and saved["step"] == 12, \
            {k: v for k, v in saved.items() if k != "state_dict"}
        state = saved["state_dict"]
        # torch's BatchNorm keeps a num_batches_tracked counter that Strata has no tensor for.
        counters = [n for n in state if n.endswith(".num_batches_tracked")]
        assert bool(counters) == (model[1] == "resnet"), counters
        assert sorted(set(state) - set(counters)) == sorted(n.replace("/", ".") for n in stored), \
            (sorted(state), sorted(stored))
        if model[1] == "resnet":  # the shortcut convs and the BatchNorm statistics travel too
            assert "block2_1.shortcut.conv.weight" in state and "block3_1.bn2.running_var" in state, sorted(state)
            assert not np.allclose(state["bn1.running_mean"].numpy(), 0), "running statistics never updated"
        # The loader: the module, in eval mode, with the checkpoint's tensors.
        loaded = load(out_pt)
        assert not loaded.training and all(not m.training for m in loaded.modules()), loaded
        loaded_state = loaded.state_dict()
        for n, v in stored.items():
            assert np.array_equal(state[n.replace("/", ".")].numpy(), v), n
            assert np.array_equal(loaded_state[n.replace("/", ".")].numpy(), v), n
        with torch.no_grad():
            logits = loaded(x)
        loss, accuracy = F.cross_entropy(logits.double(), y).item(), 100 * (logits.argmax(1) == y).double().mean().item()
        mine = re.search(r"evaluation: loss ([0-9.]+)\s+accuracy ([0-9.]+)%", out)
        rc, out2, err = run(args, [args.train] + model + ["--val-data", test, "--eval-only", "--init-from", path])
        assert rc == 0, err
        theirs = re.search(r"evaluation: loss ([0-9.]+)\s+accuracy ([0-9.]+)%", out2)
        assert mine and theirs, (out, out2)
        diff = abs(float(mine.group(1)) - float(theirs.group(1)))
        assert diff <= 1e-5 and mine.group(2) == theirs.group(2), (mine.groups(), theirs.groups())
        loaded_diff = abs(loss - float(theirs.group(1)))
        assert loaded_diff <= 1e-5 and f"{accuracy:.2f}" == theirs.group(2), (loss, accuracy, theirs.groups())
        print(f"{model[1]}: torch --eval loss {mine.group(1)} accuracy {mine.group(2)}%, loaded module loss {loss:.6f} "
              f"accuracy {accuracy:.2f}%, Strata --eval-only loss {theirs.group(1)} accuracy {theirs.group(2)}%: "
              f"|diff| {diff:.2g}, {loaded_diff:.2g}")
    # The documented two lines, run from the repository's root in a fresh interpreter.
    snippet = ('import sys; sys.path.insert(0, "tools"); from export_torch import load\n'
               f'model = load({os.path.join(w, "mlp.pt")!r})\nprint(type(model).__name__, model.training, model.fc1)')
    p = subprocess.run([sys.executable, "-c", snippet], cwd=repo, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.split()[:2] == ["Sequential", "False"], (p.stdout, p.stderr)

    # Bad inputs: one line, exit 2, no output left behind (nor its temporary file).
    good = os.path.join(w, "ck-mlp", "step-00000012.h5")
    bad = os.path.join(w, "bad")
    shutil.rmtree(bad, ignore_errors=True)
    os.makedirs(os.path.join(bad, "empty"))
    os.makedirs(os.path.join(bad, "cut"))
    text = os.path.join(bad, "notes.txt")
    with open(text, "w") as f:
        f.write("not a checkpoint\n")
    with open(good, "rb") as f:
        content = f.read()
    cut = os.path.join(bad, "cut", "step-00000012.h5")  # truncated, with its manifest
    with open(cut, "wb") as f:
        f.write(content[:len(content) // 2])
    shutil.copy(good + ".manifest", cut + ".manifest")
    bare_cut = os.path.join(bad, "bare-cut.h5")  # truncated, no manifest: HDF5 itself refuses it
    with open(bare_cut, "wb") as f:
        f.write(content[:len(content) // 2])
    small = write_dataset(os.path.join(bad, "small.h5"), n=20, shape=(1, 4, 4), seed=2)
    labels = write_dataset(os.path.join(bad, "labels.h5"), n=20, shape=(1, 8, 8), seed=2, labels=[9] * 20)
    pt = os.path.join(bad, "out.pt")
    for argv, pattern in (([text, pt], r"not an HDF5 file"),
                          ([os.path.join(bad, "empty"), pt], r"holds no complete checkpoint"),
                          ([cut, pt], r"has \d+ bytes, its manifest says \d+"),
                          ([bare_cut, pt], r"cannot read checkpoint .*truncated"),
                          ([train, pt], r"is a dataset, not a Strata checkpoint"),
                          ([good, os.path.join(bad, "missing-dir", "out.pt")], r"cannot write .*no directory"),
                          ([good, os.path.join(text, "out.pt")], r"cannot write"),
                          ([good, bad], r"cannot write .*is a directory"),
                          ([good, pt, "--eval", text], r"--eval .* not an HDF5 file"),
                          ([good, pt, "--eval", good], r"--eval .* has no 'inputs' dataset"),
                          ([good, pt, "--eval", small], r"inputs of shape \(1, 4, 4\) do not fit the model"),
                          ([good, pt, "--eval", labels], r"labels outside 0\.\.3"),
                          ([good], r"required")):
        expect_tool_error(export + argv, pattern, absent=[pt])
    print("bad inputs: one line each, exit 2, no output file left")
    # A directory whose `latest` names a damaged checkpoint: as strata-sample, the next older one,
    # with a warning naming the one skipped.
    fallback = os.path.join(bad, "fallback")
    shutil.copytree(os.path.join(w, "ck-mlp"), fallback)
    with open(os.path.join(fallback, "step-00000013.h5"), "wb") as f:
        f.write(content[:len(content) // 2])
    with open(os.path.join(fallback, "latest"), "w") as f:
        f.write("step-00000013.h5\n")
    rc, out, err = run(args, export + [fallback, pt])
    assert rc == 0 and f"exporting {os.path.join(fallback, 'step-00000012.h5')} " in out, (out, err)
    assert err.startswith("warning: skipping checkpoint") and "step-00000013.h5" in err and err.count("\n") == 1, err
    assert torch.load(pt)["step"] == 12
