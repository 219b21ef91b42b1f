"""Damaged and adversarial data files and out-of-range flags (issue #19, items 5 and 6): each is
refused before anything is allocated for it, with exit code 2 and one line naming the file and
the dataset (or the flag); a second SIGTERM stops a run at once. The files are small: their
declared shapes are what matter."""
import os
import re
import shutil
import signal
import struct
import subprocess
import time

import h5py
import numpy as np

from cases_checkpoint import train_processes
from harness import MPI_ENV, expect_bad_input, run, write_dataset

MLP = ["--model", "mlp", "--hidden", "16", "--steps", "2", "--global-batch", "8", "--threads", "1"]
GPT = ["--model", "gpt", "--layers", "1", "--heads", "2", "--embed", "16", "--seq-len", "8", "--steps", "2",
       "--global-batch", "8", "--threads", "1"]


def small_inputs(f, n=16):
    f.create_dataset("inputs", data=np.zeros((n, 1, 6, 6), np.uint8))


def write_bad_files(w):
    """{name: (path, pattern its one line must match)}."""
    files = {}

    def add(name, pattern, write):
        path = os.path.join(w, name + ".h5")
        with h5py.File(path, "w") as f:
            write(f)
        files[name] = (path, pattern)
        return path

    # The adversarial run's shape: its product wraps to 1 value per sample in 64 bits.
    shape = (2, 4294967295, 4294967297, 4294967295, 4294967297)
    add("overflow", r"overflow\.h5' 'inputs' declare shape \[2, 4294967295, 4294967297, 4294967295, 4294967297\] "
        r"whose size in bytes overflows 64 bits",
        lambda f: (f.create_dataset("inputs", shape=shape, dtype=np.uint8, chunks=(1,) * 5),
                   f.create_dataset("labels", data=np.array([0, 1]))))
    # Huge but representable: 2^50 bytes declared in chunks, none written; and 2^44 bytes
    # contiguous, never allocated (labels of 2^24 samples would be 128 MiB of fill values).
    add("huge-chunked", r"huge-chunked\.h5' 'inputs' declare shape \[1048576, 1048576, 1024\] in chunks of "
        r"\[1, 1, 1024\] but the file holds 0 of its 1099511627776 chunks",
        lambda f: (f.create_dataset("inputs", shape=(1 << 20, 1 << 20, 1024), dtype=np.uint8, chunks=(1, 1, 1024)),
                   f.create_dataset("labels", shape=(1 << 20,), dtype=np.int64, chunks=(1024,))))
    add("huge-contiguous", r"huge-contiguous\.h5' 'inputs' declare shape \[16777216, 1048576\] \(17592186044416 "
        r"bytes\) but the file holds none of them",
        lambda f: (f.create_dataset("inputs", shape=(1 << 24, 1 << 20), dtype=np.uint8),
                   f.create_dataset("labels", shape=(1 << 24,), dtype=np.int64)))

    # A flipped bit 27 in one label: 134 M classes.
    def flipped_label(f):
        small_inputs(f)
        labels = np.arange(16) % 4
        labels[5] |= 1 << 27
        f.create_dataset("labels", data=labels)
    add("classes-134m", r"classes-134m\.h5' label 134217729 at index 5 of 'labels' is out of range; expected a "
        r"class index in \[0, 16777215\]", flipped_label)

    def classes_3e9(f):
        small_inputs(f)
        f.create_dataset("labels", data=np.arange(16) % 4).attrs["num_classes"] = 3e9
    add("classes-3e9", r"classes-3e9\.h5' 'labels' attribute num_classes should be one integer in \[1, 16777216\], "
        r"found 3e\+09", classes_3e9)

    def empty_attr(f):
        small_inputs(f)
        f.create_dataset("labels", data=np.arange(16) % 4)
        f["inputs"].attrs["scale"] = h5py.Empty("f4")
    add("empty-attribute", r"empty-attribute\.h5' attribute 'scale' of '/inputs' is empty", empty_attr)

    # A byte of the second chunk flipped after writing: its fletcher32 checksum fails.
    def checksummed(f):
        x = (np.arange(16 * 36) % 251).astype(np.uint8).reshape(16, 1, 6, 6)
        f.create_dataset("inputs", data=x, chunks=(4, 1, 6, 6), fletcher32=True)
        f.create_dataset("labels", data=np.arange(16) % 4)
    path = add("fletcher32", r"fletcher32\.h5' 'inputs' cannot be read \(data error detected by Fletcher32 checksum\)",
               checksummed)
    with h5py.File(path, "r") as f:
        offset = f["inputs"].id.get_chunk_info(1).byte_offset
    with open(path, "r+b") as f:
        f.seek(offset + 3)
        byte = f.read(1)[0]
        f.seek(offset + 3)
        f.write(bytes([byte ^ 0xFF]))

    # The data address moved past the end of the file; a maximum dimension below the current one.
    def contiguous(f):
        small_inputs(f)
        f.create_dataset("labels", data=np.arange(16) % 4)
    path = add("bad-address", r"bad-address\.h5' 'inputs' declare shape \[16, 1, 6, 6\] \(576 bytes\) at address "
               r"\d+ but the file ends at \d+", contiguous)
    with h5py.File(path, "r") as f:
        offset = f["inputs"].id.get_offset()
    replace_first(path, struct.pack("<Q", offset), struct.pack("<Q", offset + 100000))
    path = add("beyond-maximum", r"beyond-maximum\.h5' 'inputs' has dimension 0 of 16 beyond its declared maximum 3",
               lambda f: (f.create_dataset("inputs", data=np.zeros((16, 1, 6, 6), np.uint8), chunks=(4, 1, 6, 6),
                                           maxshape=(77, 1, 6, 6)),
                          f.create_dataset("labels", data=np.arange(16) % 4)))
    replace_first(path, struct.pack("<Q", 77), struct.pack("<Q", 3))
    return files


def replace_first(path, old, new):
    """Overwrites the first occurrence of the bytes `old` in the file (an address or a
    dimension in an object header)."""
    with open(path, "r+b") as f:
        data = f.read()
        at = data.find(old)
        assert at >= 0, f"{old!r} not in {path}"
        f.seek(at)
        f.write(new)


def case_data_bad_shapes(args):
    w = args.workdir
    for name, (path, pattern) in write_bad_files(w).items():
        start = time.monotonic()
        expect_bad_input(args, MLP + ["--data", path], r"^error: --data: '.*" + pattern)
        elapsed = time.monotonic() - start
        assert elapsed < 15, f"{name}: {elapsed:.1f} s"
        # strata-data inspect opens the same way: one line, exit 2.
        rc, out, err = run(args, [args.data_tool, "inspect", path])
        lines = [l for l in err.splitlines() if l.strip()]
        assert rc == 2 and len(lines) == 1 and re.search(pattern, lines[0]), f"inspect {name}: rc {rc}\n{err}"
        print(f"{name}: exit 2 in {elapsed:.2f} s: {lines[0]}")
    # Every rank of a 2-rank job agrees: exit 2, one line.
    path, pattern = write_bad_files(w)["overflow"]
    expect_bad_input(args, MLP + ["--data", path], pattern, ranks=2)

    # A token file that declares 2^40 tokens and stores none.
    tokens = os.path.join(w, "huge-tokens.h5")
    with h5py.File(tokens, "w") as f:
        f.create_dataset("tokens", shape=(1 << 40,), dtype=np.uint16, chunks=(1 << 16,))
        f.attrs.update({"kind": "tokens", "vocab_size": 257, "eot": 256, "tokenizer": "byte"})
    expect_bad_input(args, GPT + ["--data", tokens],
                     r"huge-tokens\.h5' 'tokens' declare shape \[1099511627776\] in chunks of \[65536\] but the file "
                     r"holds 0 of its 16777216 chunks")

    # A vocabulary of 2^31 - 1 ids (the output layer of a GPT would be 2^31 x embed).
    vocab = os.path.join(w, "huge-vocab.h5")
    with h5py.File(vocab, "w") as f:
        f.create_dataset("tokens", data=np.arange(64, dtype=np.uint32))
        f.attrs.update({"kind": "tokens", "vocab_size": 2**31 - 1, "eot": 0, "tokenizer": "external"})
    expect_bad_input(args, GPT + ["--data", vocab], r"huge-vocab\.h5' has vocab_size 2147483647; expected 1\.\.16777216")

    # inspect prints the first 50 classes, then one line for the rest.
    many = write_dataset(os.path.join(w, "sixty-classes.h5"), n=120, shape=(1, 6, 6),
                         labels=list(range(55)) * 2 + list(range(10)))
    rc, out, err = run(args, [args.data_tool, "inspect", many])
    assert rc == 0, err
    assert "classes:       55" in out and "  0: 3\n" in out and "  49: 2\n" in out and "  50:" not in out, out
    assert "  ... 5 more classes (5 of them with samples)" in out, out


def case_flag_ranges(args):
    """The adversarial run's flags: accepted before (--eps inf, --seed -1) or refused without
    naming the flag (--threads 100000, --prefetch 100000000)."""
    good = write_dataset(os.path.join(args.workdir, "flags.h5"), n=64)
    base = [f for f in MLP if f not in ("--threads", "1")] + ["--data", good]
    expect_bad_input(args, base + ["--optimizer", "adamw", "--eps", "inf"], r"--eps must be in \(0, 1\], found inf")
    expect_bad_input(args, base + ["--seed=-1"], r"--seed must be in \[0, 2\^63 - 1\], found -1")
    expect_bad_input(args, base + ["--threads", "100000"], r"--threads must be in \[0, \d+\], found 100000")
    expect_bad_input(args, base + ["--prefetch", "100000000"], r"--prefetch must be in \[1, 64\], found 100000000")
    expect_bad_input(args, base + ["--prefetch", "100000000"], r"--prefetch must be in \[1, 64\]", ranks=2)
    expect_bad_input(args, base + ["--setup-timeout", "0"], r"--setup-timeout must be in \[1, 86400\], found 0")
    expect_bad_input(args, base + ["--log-file", "/nonexistent/x.log"],
                     r"--log-file: cannot open '/nonexistent/x.log' for appending: No such file", ranks=2)


def case_second_signal(args):
    """A first SIGTERM asks for a save at the next step boundary; a second one while that is
    pending exits at once with code 4 and one line. Each step here takes 1.5 s
    (--bench-stage-ms 500 sleeps 0.5 s in forward and 1 s in backward), so the run is mid-step
    when both signals arrive and only the second-signal path can end it within 0.5 s."""
    w = args.workdir
    data = write_dataset(os.path.join(w, "signal.h5"), n=64)
    ck = os.path.join(w, "ck-signal")
    cmd = [args.train, "--model", "mlp", "--hidden", "16", "--threads", "1", "--data", data, "--steps", "100", "--global-batch", "8",
                                     "--bench-stage-ms", "500", "--log-every", "1", "--checkpoint-dir", ck]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, **MPI_ENV))
    for line in p.stdout:  # the first step is under way once the plan is printed
        if line.startswith("data:"):
            break
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    start = time.monotonic()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    elapsed = time.monotonic() - start
    lines = [l for l in err.splitlines() if l.strip() and not l.startswith("warning:")]
    assert p.returncode == 4, f"exit code {p.returncode}\n{out}\n{err}"
    assert lines == ["error: a second stop signal: exiting at once, without saving (exit code 4)"], err
    assert elapsed < 0.5, f"exited {elapsed:.2f} s after the second signal"
    assert not os.path.exists(os.path.join(ck, "latest")), os.listdir(ck)
    print(f"second SIGTERM: exit 4 after {elapsed * 1000:.0f} ms, nothing saved")


def case_signal_during_setup(args):
    """A stop signal during setup (here: a rank sleeping there, as a slow data or checkpoint load
    would) exits at once with code 3 and one line, saving nothing; on 2 ranks under mpirun too,
    with eval-only runs and --dry-run alike."""
    w = args.workdir
    data = write_dataset(os.path.join(w, "setup-signal.h5"), n=64)
    ck = os.path.join(w, "ck-setup-signal")
    shutil.rmtree(ck, ignore_errors=True)
    base = [args.train, "--model", "mlp", "--hidden", "16", "--threads", "1", "--data", data, "--steps", "10",
            "--global-batch", "8", "--checkpoint-dir", ck, "--debug-fail-rank", "0", "--debug-setup-sleep", "60"]
    line = "error: a stop signal during setup: exiting at once, nothing to save (exit code 3)"
    for what, cmd in [("1 rank", base), ("2 ranks", [args.mpirun, "-np", "2", "--oversubscribe"] + base)]:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, **MPI_ENV))
        for out_line in p.stdout:  # setup has begun once the options are printed
            if out_line.startswith("options:"):
                break
        time.sleep(0.3)
        start = time.monotonic()
        if what == "1 rank":
            p.send_signal(signal.SIGTERM)
        else:  # as Slurm does: every rank gets it
            for r in train_processes(p.pid, args.train):
                os.kill(r, signal.SIGTERM)
        out, err = p.communicate(timeout=60)
        elapsed = time.monotonic() - start
        assert p.returncode == 3, f"{what}: exit code {p.returncode}\n{out}\n{err}"
        assert line in err.splitlines(), f"{what}: {err}"
        assert elapsed < 5, f"{what}: exited {elapsed:.2f} s after the signal"
        assert not os.path.exists(os.path.join(ck, "latest")), os.listdir(ck)
        print(f"SIGTERM during setup ({what}): exit 3 after {elapsed * 1000:.0f} ms, nothing saved")


def case_second_signal_during_save(args):
    """A second SIGTERM while the first one's checkpoint is being written (inside libhdf5: its
    .tmp exists, the file is not renamed yet) exits at once with code 4; the checkpoint before it
    and `latest` are intact, and --resume auto continues from that one to the same weights as a
    run never interrupted, naming the unfinished .tmp. The model is large (17 M parameters + momentum: a 136 MB file) so that
    the write lasts long enough to be interrupted; the test asserts that it was."""
    w = args.workdir
    data = write_dataset(os.path.join(w, "signal-save.h5"), n=64, shape=(1, 8, 8), classes=10)
    ck, alone = os.path.join(w, "ck-signal-save"), os.path.join(w, "ck-signal-save-alone")
    for d in (ck, alone):
        shutil.rmtree(d, ignore_errors=True)
    model = ["--model", "mlp", "--hidden", "4096,4096", "--threads", "1", "--data", data, "--global-batch", "8",
             "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.001", "--log-every", "1", "--save-every", "2"]
    p = subprocess.Popen([args.train] + model + ["--steps", "100", "--checkpoint-dir", ck], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=dict(os.environ, **MPI_ENV))
    latest = os.path.join(ck, "latest")
    deadline = time.monotonic() + 120
    while not os.path.exists(latest) and time.monotonic() < deadline:  # the step-2 checkpoint is committed
        time.sleep(0.01)
    assert os.path.exists(latest), "no first checkpoint within 120 s"
    first = open(latest).read()
    p.send_signal(signal.SIGTERM)  # save at the next step boundary (step 3), then exit 3 ...
    tmp = os.path.join(ck, "step-00000003.h5.tmp")
    while not os.path.exists(tmp) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    p.send_signal(signal.SIGTERM)  # ... unless a second signal comes during the write
    start = time.monotonic()
    out, err = p.communicate(timeout=60)
    elapsed = time.monotonic() - start
    assert p.returncode == 4, f"exit code {p.returncode}\n{out}\n{err}"
    assert [l for l in err.splitlines() if l.strip() and not l.startswith("warning:")] == [
        "error: a second stop signal: exiting at once, without saving (exit code 4)"], err
    assert elapsed < 0.5, f"exited {elapsed:.2f} s after the second signal"
    assert not os.path.exists(os.path.join(ck, "step-00000003.h5")), "the write finished first: nothing was tested"
    assert open(latest).read() == first, (open(latest).read(), first)
    # The requeued run: from step 2, to the uninterrupted run's weights at step 4.
    rc, out, err = run(args, [args.train] + model + ["--steps", "4", "--checkpoint-dir", ck, "--resume", "auto"])
    assert rc == 0 and re.search(r"resuming from \S*step-00000002\.h5 at step 2 ", out), f"rc={rc}\n{out}\n{err}"
    rc, out2, err2 = run(args, [args.train] + model + ["--steps", "4", "--checkpoint-dir", alone])
    assert rc == 0, err2
    with h5py.File(os.path.join(ck, "step-00000004.h5")) as a, h5py.File(os.path.join(alone, "step-00000004.h5")) as b:
        for name in ("model/fc1/weight", "model/fc3/weight"):
            assert np.array_equal(a[name][...], b[name][...]), name
    # Not this job's file, so not deleted (#19: no job deletes a file it did not create), but named.
    assert re.search(r"note: \S*step-00000003\.h5\.tmp \(\d+ bytes\) is an unfinished write of an earlier job", out), out
    print(f"second SIGTERM inside the step-3 write: exit 4 after {elapsed * 1000:.0f} ms; resumed from step 2, "
          f"identical at step 4; the unfinished .tmp named by the resumed run")
