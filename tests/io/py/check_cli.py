"""strata-data end to end: synthetic data is written, readable with h5py and learnable; inspect
describes it; bad input exits 2 with one line on stderr. Usage: check_cli.py STRATA_DATA WORKDIR"""
import glob
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np

exe, work = sys.argv[1], sys.argv[2]
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)


def run(*args, rc=0):
    p = subprocess.run([exe, *args], capture_output=True, text=True)
    assert p.returncode == rc, f"{args}: exit {p.returncode}, expected {rc}\n{p.stdout}{p.stderr}"
    return p


prefix = os.path.join(work, "syn/s")
run("synthetic", "--out", prefix, "--samples", "600", "--shape", "2,4,4", "--classes", "3", "--shards", "3", "--seed", "5")
files = sorted(glob.glob(prefix + "-*-of-00003.h5"))
assert len(files) == 3, files
x = np.concatenate([h5py.File(p, "r")["inputs"][...] for p in files]).astype(np.float64)
y = np.concatenate([h5py.File(p, "r")["labels"][...] for p in files])
assert x.shape == (600, 2, 4, 4) and set(np.unique(y)) == {0, 1, 2}
# Learnable: nearest class mean (fit on the first half) classifies the second half well.
flat = x.reshape(600, -1)
means = np.stack([flat[:300][y[:300] == k].mean(0) for k in range(3)])
pred = np.argmin(((flat[300:, None, :] - means[None]) ** 2).sum(-1), axis=1)
acc = (pred == y[300:]).mean()
assert acc > 0.9, acc
# Deterministic from the seed.
run("synthetic", "--out", os.path.join(work, "again/s"), "--samples", "600", "--shape", "2,4,4", "--classes", "3",
    "--shards", "3", "--seed", "5")
for a, b in zip(files, sorted(glob.glob(os.path.join(work, "again/s-*.h5")))):
    assert np.array_equal(h5py.File(a, "r")["inputs"][...], h5py.File(b, "r")["inputs"][...])
run("synthetic", "--out", os.path.join(work, "f/feat"), "--samples", "10", "--shape", "6", "--classes", "2",
    "--dtype", "f32")
assert h5py.File(os.path.join(work, "f/feat.h5"), "r")["inputs"].dtype == np.float32

# --first-sample: samples 300.. of the same sequence (the same class patterns), so a held-out
# split is disjoint from the training one and equal to the sequence's continuation.
run("synthetic", "--out", os.path.join(work, "tail/s"), "--samples", "300", "--first-sample", "300", "--shape", "2,4,4",
    "--classes", "3", "--seed", "5")
tail = h5py.File(os.path.join(work, "tail/s.h5"), "r")
assert np.array_equal(tail["inputs"][...].astype(np.float64), x[300:]) and np.array_equal(tail["labels"][...], y[300:])
run("synthetic", "--out", os.path.join(work, "held/s"), "--samples", "300", "--first-sample", "600", "--shape", "2,4,4",
    "--classes", "3", "--seed", "5")
held = h5py.File(os.path.join(work, "held/s.h5"), "r")
hx, hy = held["inputs"][...].astype(np.float64).reshape(300, -1), held["labels"][...]
assert not any(np.array_equal(hx[i], flat[j]) for i in range(20) for j in range(600)), "held-out repeats training"
held_acc = (np.argmin(((hx[:, None, :] - means[None]) ** 2).sum(-1), axis=1) == hy).mean()
assert held_acc > 0.9, held_acc

# What --out took names what it wrote (PREFIX.h5, or PREFIX's shards); COMMAND --help is the usage.
assert "samples:       10" in run("inspect", os.path.join(work, "f/feat")).stdout
assert "samples:       600" in run("inspect", prefix).stdout
assert "inspect SPEC" in run("inspect", "--help").stdout and "synthetic" in run("synthetic", "--help").stdout
out = run("inspect", os.path.join(work, "syn")).stdout
assert "samples:       600" in out and "[2, 4, 4]" in out and "classes:       3" in out, out


def bad(words, *args):
    p = run(*args, rc=2)
    err = p.stderr.strip()
    assert "\n" not in err, f"not one line: {err!r}"
    for w in words:
        assert w in err, f"{w!r} not in {err!r}"


bad(["does not exist"], "inspect", os.path.join(work, "missing"))
bad(["matches no files"], "inspect", os.path.join(work, "nothing-*.h5"))
labels = "/usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz"
bad(["--images", "magic"], "convert-idx", "--images", labels, "--labels", labels, "--out", os.path.join(work, "x"))
bad(["--images", "cannot open"], "convert-idx", "--images", "/nope.gz", "--labels", labels, "--out", work + "/x")
bad(["classes"], "synthetic", "--out", prefix, "--samples", "10", "--shape", "4")
bad(["--shape"], "synthetic", "--out", prefix, "--samples", "10", "--shape", "4,x", "--classes", "2")
bad(["--samples 4294967297 of --shape 4294967297,4294967297 need more than 2^63 bytes"], "synthetic", "--out", prefix,
    "--samples", "4294967297", "--shape", "4294967297,4294967297", "--classes", "2")
bad(["--classes: expected 2..16777216, found 30000000"], "synthetic", "--out", prefix, "--samples", "10", "--shape", "4",
    "--classes", "30000000")
bad(["unknown command"], "frobnicate")
# --stats-from: a split normalised with another dataset's statistics (a test split with its
# training split's); the values themselves are unchanged.
images = "/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz"
if os.path.exists(images):
    run("synthetic", "--out", os.path.join(work, "stats"), "--samples", "50", "--shape", "1,28,28", "--classes", "2")
    run("convert-idx", "--images", images, "--labels", labels, "--out", os.path.join(work, "own"))
    run("convert-idx", "--images", images, "--labels", labels, "--out", os.path.join(work, "borrowed"), "--stats-from",
        os.path.join(work, "stats.h5"))
    with h5py.File(os.path.join(work, "stats.h5"), "r") as a, h5py.File(os.path.join(work, "borrowed.h5"), "r") as b, \
            h5py.File(os.path.join(work, "own.h5"), "r") as c:
        for key in ("scale", "mean", "std"):
            assert np.allclose(a["inputs"].attrs[key], b["inputs"].attrs[key], rtol=1e-6), key
        assert not np.allclose(c["inputs"].attrs["mean"], b["inputs"].attrs["mean"])
        assert np.array_equal(c["inputs"][...], b["inputs"][...])
    bad(["--stats-from", "has samples [6]", "[1, 28, 28]"], "convert-idx", "--images", images, "--labels", labels, "--out",
        os.path.join(work, "x"), "--stats-from", os.path.join(work, "f/feat.h5"))
bad(["--out", "expected a file prefix"], "synthetic", "--out", work + "/", "--samples", "10", "--shape", "4", "--classes", "2")
bad(["--batch and --steps must be positive"], "bench", os.path.join(work, "f/feat.h5"), "--steps", "-5")
# num_classes is --classes even when a small file lacks the highest labels.
run("synthetic", "--out", os.path.join(work, "few"), "--samples", "3", "--shape", "4", "--classes", "10")
assert h5py.File(os.path.join(work, "few.h5"), "r")["labels"].attrs["num_classes"] == 10


def idx(path, magic, dims, body):
    """A gzip'd IDX file of unsigned bytes: its header claims `dims`, `body` follows."""
    import gzip
    import struct
    with gzip.open(path, "wb") as f:
        f.write(struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in dims) + body)
    return path


images = idx(os.path.join(work, "huge-images.gz"), 0x803, [100000, 10000, 10000], b"\0")
good_labels = idx(os.path.join(work, "labels.gz"), 0x801, [2], bytes([0, 1]))
bad(["--images", "truncated", "claims 10000000000000 bytes"], "convert-idx", "--images", images, "--labels", good_labels,
    "--out", work + "/x")
images = idx(os.path.join(work, "long-images.gz"), 0x803, [2, 2, 2], bytes(9))
bad(["--images", "data beyond the 8 bytes"], "convert-idx", "--images", images, "--labels", good_labels, "--out",
    work + "/x")
print(f"ok: synthetic accuracy {acc:.3f}")
