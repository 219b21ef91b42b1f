"""Checkpoint validation and the directory lock (issue #19, items 3 and 4): damaged newest
checkpoints that --resume auto falls back from (the two files that make libhdf5 1.10.8 loop,
damaged attributes, a tampered position), --resume PATH on them, and two jobs on one
checkpoint directory. Each run is a few seconds of a 16-unit MLP."""
import os
import re
import shutil
import signal
import subprocess
import time
import zlib

import h5py
import numpy as np

from harness import run, expect_bad_input, train_ranks, write_dataset, all_tensors
from cases_checkpoint import train_processes

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "hdf5-hang")
MUTANTS = ("fuzz-ck-0021.h5", "fuzz-ck-0028.h5")


def flags(args, ck, steps):
    """The fixtures' model and data shape: an MLP of 16 on [1, 8, 8] inputs, 10 classes, SGD."""
    # Written once: a job the case holds paused may have it open (HDF5 locks it against writers).
    data = os.path.join(args.workdir, "data.h5")
    if not os.path.exists(data):
        write_dataset(data, n=1024, shape=(1, 8, 8), classes=10, seed=4)
    return ["--model", "mlp", "--hidden", "16", "--data", data, "--global-batch", "32", "--optimizer", "sgd",
            "--lr", "0.05", "--seed", "3", "--checkpoint-dir", ck, "--steps", str(steps), "--save-every", "10"]


def assert_identical(path, reference, what):
    a, b = all_tensors(path), all_tensors(reference)
    assert a.keys() == b.keys(), (what, sorted(a), sorted(b))
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), f"{what}: {name} differs"
    print(f"{what}: {len(a)} tensors bit-identical to the run that never saw the bad file")


def write_manifest(path, position):
    """The manifest of docs/checkpoints.md for `path` as it is now (h5py/zlib: an independent writer)."""
    data = open(path, "rb").read()
    text = "step {}\nepoch {}\nstep_in_epoch {}\nseed {}\n".format(*position)
    with open(path + ".manifest", "w") as f:
        f.write(f"strata-checkpoint-manifest 1\nfile {os.path.basename(path)}\nsize {len(data)}\n"
                f"crc32 {zlib.crc32(data):08x}\n{text}position_crc32 {zlib.crc32(text.encode()):08x}\n")


def reference_run(args, ranks=2):
    """30 steps uninterrupted: what every fallback must end with."""
    ck = os.path.join(args.workdir, "ck-reference")
    shutil.rmtree(ck, ignore_errors=True)
    train_ranks(args, ranks, flags(args, ck, 30))
    return os.path.join(ck, "step-00000030.h5")


def fallback(args, name, damage, reference, expect_reason):
    """A 2-rank job saves steps 10 and 20; `damage(step-20 path)` breaks the newest; a new job
    with --resume auto must skip it with one warning naming it, resume at step 10, finish
    within seconds and end bit-identical to `reference`."""
    ck = os.path.join(args.workdir, "ck-" + name)
    shutil.rmtree(ck, ignore_errors=True)
    train_ranks(args, 2, flags(args, ck, 20))
    newest = os.path.join(ck, "step-00000020.h5")
    assert open(os.path.join(ck, "latest")).read().strip() == "step-00000020.h5"
    damage(newest)
    cmd = [args.mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none", args.train] + flags(args, ck, 30) + [
        "--resume", "auto"]
    t0 = time.monotonic()
    rc, out, err = run(args, cmd, timeout=60)  # a parse that loops fails here, not after hours
    seconds = time.monotonic() - t0
    assert rc == 0, f"{name}: rc {rc}\n{out}\n{err}"
    skipped = [l for l in err.splitlines() if "skipping checkpoint" in l]
    assert len(skipped) == 1 and newest in skipped[0] and re.search(expect_reason, skipped[0]), f"{name}:\n{err}"
    assert f"resuming from {os.path.join(ck, 'step-00000010.h5')} at step 10" in out, out
    assert seconds < 30, f"{name}: {seconds:.1f} s"
    print(f"{name}: fell back in {seconds:.1f} s; {skipped[0]}")
    assert_identical(os.path.join(ck, "step-00000030.h5"), reference, name)


def case_checkpoint_hang_fallback(args):
    """The two byte-flipped files that make libhdf5 loop, as the newest checkpoint with the
    manifest of the good file they came from (same size: only the whole-file crc32 tells them
    apart): skipped without HDF5 opening them."""
    reference = reference_run(args)
    base = os.path.join(FIXTURES, "base-ck-step-00000020.h5")
    with h5py.File(base, "r") as f:
        position = [int(f.attrs[k]) for k in ("step", "epoch", "step_in_epoch", "seed")]
    for mutant in MUTANTS:
        def damage(newest, mutant=mutant):
            shutil.copyfile(base, newest)
            write_manifest(newest, position)  # the good file's manifest...
            shutil.copyfile(os.path.join(FIXTURES, mutant), newest)  # ...and the flipped bytes
            assert os.path.getsize(newest) == os.path.getsize(base)
        fallback(args, mutant, damage, reference, r"is corrupt: whole-file crc32")


def empty_step(path):
    with h5py.File(path, "r+") as f:
        del f.attrs["step"]
        f.attrs.create("step", data=h5py.Empty("<i8"))


def step_7(path):
    with h5py.File(path, "r+") as f:
        f.attrs["step"] = 7


def string_heap(path):
    """The global heap that holds the variable-length strings (model, optimizer, config, ...)
    loses its signature: every string attribute fails to read."""
    data = bytearray(open(path, "rb").read())
    assert data.count(b"GCOL") == 1
    at = data.find(b"GCOL")
    data[at:at + 4] = b"XCOL"
    open(path, "wb").write(bytes(data))


def unsealed(edit):
    """`edit` on a checkpoint from before manifests (its manifest removed): the attribute
    checks alone must catch it."""
    def damage(path):
        os.remove(path + ".manifest")
        edit(path)
    return damage


def case_checkpoint_damage_fallback(args):
    """An empty `step` attribute, `step = 7` in the step-20 file and a damaged string: each as the
    newest checkpoint, with its manifest (the whole-file crc32 sees the edit) and without one
    (an older checkpoint: the attribute checks see it); --resume auto falls back each time."""
    reference = reference_run(args)
    sealed = r"whole-file crc32|bytes, its manifest says"  # h5py's edits may change the size
    cases = [("empty-step", empty_step, sealed), ("step-7", step_7, sealed), ("string-heap", string_heap, sealed),
             ("empty-step-old", unsealed(empty_step), r"attribute 'step' of '/' is empty"),
             ("step-7-old", unsealed(step_7), r"holds step 7 but its name says step 20"),
             ("string-heap-old", unsealed(string_heap), r"step-00000020\.h5")]
    for name, damage, reason in cases:
        fallback(args, name, damage, reference, reason)


def case_checkpoint_resume_bad_path(args):
    """--resume PATH on a hang mutant (with the good file's manifest) and on a position-tampered
    file: one line, exit 2 on both ranks, within seconds."""
    ck = os.path.join(args.workdir, "ck-path")
    shutil.rmtree(ck, ignore_errors=True)
    train_ranks(args, 2, flags(args, ck, 20))
    base = os.path.join(FIXTURES, "base-ck-step-00000020.h5")
    with h5py.File(base, "r") as f:
        position = [int(f.attrs[k]) for k in ("step", "epoch", "step_in_epoch", "seed")]
    bad = os.path.join(args.workdir, "step-00000020.h5")
    shutil.copyfile(base, bad)
    write_manifest(bad, position)
    for mutant in MUTANTS:
        shutil.copyfile(os.path.join(FIXTURES, mutant), bad)
        t0 = time.monotonic()
        expect_bad_input(args, flags(args, ck, 30) + ["--resume", bad], r"step-00000020\.h5' is corrupt: whole-file",
                         ranks=2)
        print(f"--resume {mutant}: exit 2 in {time.monotonic() - t0:.1f} s")
    tampered = os.path.join(ck, "step-00000020.h5")
    step_7(tampered)
    expect_bad_input(args, flags(args, ck, 30) + ["--resume", tampered],
                     r"step-00000020\.h5' (is corrupt|has \d+ bytes, its manifest says)", ranks=2)
    os.remove(tampered + ".manifest")
    expect_bad_input(args, flags(args, ck, 30) + ["--resume", tampered], r"holds step 7 but its name says step 20",
                     ranks=2)
    empty_step(tampered)  # an older checkpoint whose step HDF5 cannot read
    expect_bad_input(args, flags(args, ck, 30) + ["--resume", tampered], r"attribute 'step' of '/' is empty",
                     ranks=2)


def case_checkpoint_dir_lock(args):
    """Two jobs on one checkpoint directory: while a 2-rank job runs, a second (2 ranks, then 4)
    exits 2 on every rank with one line naming the holder (a pid of the first job); the first's result is bit-identical to the
    same job run alone; a job after it (a requeue) gets the lock."""
    steps = 1500
    alone_ck, ck = os.path.join(args.workdir, "ck-alone"), os.path.join(args.workdir, "ck-shared")
    for d in (alone_ck, ck):
        shutil.rmtree(d, ignore_errors=True)
    train_ranks(args, 2, flags(args, alone_ck, steps) + ["--keep", "1"])
    cmd = [args.mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none", args.train] + flags(args, ck, steps) + [
        "--keep", "1"]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
    lock = os.path.join(ck, ".lock")
    deadline = time.monotonic() + 30
    while not (os.path.exists(lock) and "pid" in open(lock).read()) and time.monotonic() < deadline:
        time.sleep(0.05)
    holder = open(lock).read().strip()
    pids = train_processes(first.pid, args.train)
    assert len(pids) == 2, pids
    # Paused (not ended) while the others try, so that the first is surely still holding the
    # lock however slow this machine is; a pause changes nothing in its result.
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        took = []
        for ranks in (2, 4):
            t0 = time.monotonic()
            expect_bad_input(args, flags(args, ck, steps) + ["--keep", "1"], r"--checkpoint-dir .* is in use by another "
                             r"job \(host \S+ pid \d+\); one job per checkpoint directory", ranks=ranks)
            took.append(f"{ranks} ranks: {time.monotonic() - t0:.1f} s")
        assert first.poll() is None, "the first job ended before the second tried: the test proves nothing"
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    assert int(re.search(r"pid (\d+)", holder).group(1)) in pids, (holder, pids)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, f"{out}\n{err}"
    print(f"second job refused while the first ran ({', '.join(took)}; holder: {holder})")
    assert sorted(os.listdir(ck)) == sorted(os.listdir(alone_ck)), (os.listdir(ck), os.listdir(alone_ck))
    assert_identical(os.path.join(ck, f"step-{steps:08d}.h5"), os.path.join(alone_ck, f"step-{steps:08d}.h5"),
                     "the first job")
    # The first job is gone: the next one on the directory gets the lock and resumes.
    out = train_ranks(args, 2, flags(args, ck, steps + 10) + ["--resume", "auto"])
    assert f"at step {steps}" in out, out


def case_shared_filesystem(args):
    """Ranks that do not see rank 0's files (issue #20 item 4). mpirun's -wdir gives the two ranks
    of one job different working directories, so the relative paths name different storage, as
    on nodes without a shared filesystem: a checkpoint directory rank 1 does not see, then data that
    differs on rank 1 or is missing there, each exit 2 on both ranks with one line naming rank 1.
    Identical copies of the data and a directory both see train."""
    root = os.path.join(args.workdir, "shared-fs")
    shutil.rmtree(root, ignore_errors=True)
    nodes = [os.path.join(root, "node0"), os.path.join(root, "node1")]
    for d in nodes:
        os.makedirs(d)
        write_dataset(os.path.join(d, "data.h5"), n=256, shape=(1, 8, 8), classes=10, seed=4)

    def job(extra, checkpoint_dir):
        flags = ["--model", "mlp", "--hidden", "16", "--data", "data.h5", "--global-batch", "32", "--steps", "3",
                 "--checkpoint-dir", checkpoint_dir, "--save-every", "3"] + extra
        cmd = [args.mpirun, "--oversubscribe", "--quiet"]
        for i, d in enumerate(nodes):
            cmd += (["-np", "1", "-wdir", d, args.train] + flags) + ([":"] if i == 0 else [])
        return run(args, cmd)

    def expect_refused(checkpoint_dir, pattern):
        rc, out, err = job([], checkpoint_dir)
        lines = [l for l in err.splitlines() if l.strip()]
        assert rc == 2, f"rc={rc}\n{out}\n{err}"
        assert len(lines) == 1 and re.search(pattern, lines[0]), err
        return lines[0]

    said = [expect_refused("ck", r"^error: --checkpoint-dir 'ck': rank 1 \(host \S+\) does not see what rank 0 sees: "
                                 r"no probe file \.strata-probe-[0-9a-f]{16} there; it must be a directory on a "
                                 r"filesystem every node mounts")]
    # Nothing left: the refused run removed the directory it created (probe and .lock with it).
    assert not os.path.exists(os.path.join(nodes[0], "ck")), os.listdir(os.path.join(nodes[0], "ck"))
    shared_ck = os.path.join(root, "ck")  # an absolute path: the same directory for both
    write_dataset(os.path.join(nodes[1], "data.h5"), n=256, shape=(1, 8, 8), classes=10, seed=5)
    said.append(expect_refused(shared_ck, r"^error: --data 'data.h5': rank 1 \(host \S+\) does not see what rank 0 "
                                          r"sees: 'data.h5' has other bytes than rank 0's; every node needs the same"))
    os.remove(os.path.join(nodes[1], "data.h5"))
    said.append(expect_refused(shared_ck, r"^error: --data 'data.h5': rank 1 .* sees: --data: 'data.h5' does not exist"))
    shutil.copy(os.path.join(nodes[0], "data.h5"), os.path.join(nodes[1], "data.h5"))
    rc, out, err = job([], shared_ck)
    assert rc == 0, f"identical copies and a shared directory must train: rc={rc}\n{out}\n{err}"
    assert os.path.exists(os.path.join(shared_ck, "step-00000003.h5")), os.listdir(shared_ck)
    print("\n".join(said))
