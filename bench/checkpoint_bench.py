#!/usr/bin/env python3
"""Checkpoint save and load time and MB/s, against a plain sequential write (+fsync) and read of
the same number of bytes on the same disk.

Usage: /usr/bin/python3 bench/checkpoint_bench.py --train build-lead/train [--dir /tmp/ckbench] [--repeats 3]

Save time = (wall time of `train --steps S --save-every 1 --checkpoint-dir D` minus that of the
same run without --checkpoint-dir) / S: the whole save (gather, HDF5 write, flush, fsync,
rename, directory fsync, `latest`), with process start and training cancelled out.
Load time = wall time of `train --resume CKPT --steps N+1` minus `train --steps 1`: open, crc32
check and read of every tensor. Before every load (and every baseline read) the file's pages are
dropped from the page cache (posix_fadvise DONTNEED), so both reads come from the disk.
Saves: the best of --repeats runs; loads: the median of max(--repeats, 7) runs. 1 rank, AdamW (parameters + 2 states).
--async-save (written on a background thread): "held" is the median of what its save lines
report training was held for (the state's copy to host buffers; the first save, which touches
fresh pages, left out), and its wall cost per save is computed like the synchronous save's.
"""
import argparse
import os
import re
import subprocess
import time

import h5py
import numpy as np


def dataset(path, n=1024, classes=10):
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f.create_dataset("inputs", data=rng.integers(0, 256, (n, 1, 28, 28)).astype(np.uint8))
        f.create_dataset("labels", data=rng.integers(0, classes, n).astype(np.int64))
    return path


def wall(cmd, out=None):
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    assert p.returncode == 0, f"{' '.join(cmd)}\n{p.stdout}\n{p.stderr}"
    if out is not None:
        out.append(p.stdout)
    return elapsed


def drop_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def plain_write(path, nbytes, chunk=4 << 20):
    buf = np.random.default_rng(1).integers(0, 256, chunk, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    left = nbytes
    while left > 0:
        left -= os.write(fd, buf[:min(chunk, left)])
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t0


def plain_read(path, chunk=4 << 20):
    drop_cache(path)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    while os.read(fd, chunk):
        pass
    os.close(fd)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--dir", default="/tmp/ckbench")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", default="1024,1024;4096,4096", help="';'-separated --hidden values")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    data = dataset(os.path.join(a.dir, "data.h5"))
    rows = []
    for hidden in a.hidden.split(";"):
        saves = 8 if hidden == "1024,1024" else 3
        common = [a.train, "--model", "mlp", "--hidden", hidden, "--optimizer", "adamw", "--data", data,
                  "--global-batch", "32", "--log-every", "1000", "--seed", "1"]
        ck = os.path.join(a.dir, "ck-" + hidden.replace(",", "x"))
        with_save, with_async, without, load, base, logs = [], [], [], [], [], []
        for _ in range(a.repeats):
            for f in os.listdir(ck) if os.path.isdir(ck) else []:
                os.remove(os.path.join(ck, f))
            with_save.append(wall(common + ["--steps", str(saves), "--save-every", "1", "--checkpoint-dir", ck]))
            with_async.append(wall(common + ["--steps", str(saves), "--save-every", "1", "--checkpoint-dir", ck + "-async",
                                             "--async-save"], logs))
            without.append(wall(common + ["--steps", str(saves)]))
        held = [float(h) for log in logs for h in re.findall(r"training held (\S+) s", log)[1:-1]]
        path = os.path.join(ck, f"step-{saves:08d}.h5")
        nbytes = os.path.getsize(path)
        for _ in range(max(a.repeats, 7)):  # process start is noisy next to a small load
            drop_cache(path)
            load.append(wall(common + ["--resume", path, "--steps", str(saves + 1)]))
            base.append(wall(common + ["--steps", "1"]))
        save_s = max(min(with_save) - min(without), 0.0) / saves
        async_s = max(min(with_async) - min(without), 0.0) / saves
        load_s = max(float(np.median(load)) - float(np.median(base)), 0.0)
        plain = os.path.join(a.dir, "plain.bin")
        pw = min(plain_write(plain, nbytes) for _ in range(a.repeats))
        pr = min(plain_read(plain) for _ in range(a.repeats))
        os.remove(plain)
        params = 0
        with h5py.File(path, "r") as f:
            f["model"].visititems(lambda n, o: None)
            def count(n, o):
                nonlocal params
                if isinstance(o, h5py.Dataset):
                    params += o.size
            f["model"].visititems(count)
        mb = nbytes / 1e6
        rows.append((f"mlp 784-{hidden.replace(',', '-')}-10", params, mb, save_s, pw, load_s, pr,
                     float(np.median(held)), async_s))
    print("| model (AdamW) | parameters | file MB | save ms | save MB/s | plain write+fsync ms | plain MB/s "
          "| save / plain | load ms | load MB/s | plain read ms | plain MB/s | load / plain |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, params, mb, s, pw, l, pr, _, _ in rows:
        print(f"| {name} | {params / 1e6:.2f} M | {mb:.1f} | {s * 1e3:.0f} | {mb / max(s, 1e-9):.0f} | {pw * 1e3:.0f} | "
              f"{mb / pw:.0f} | {s / pw:.2f}x | {l * 1e3:.0f} | {mb / max(l, 1e-9):.0f} | {pr * 1e3:.0f} | {mb / pr:.0f} "
              f"| {l / pr:.2f}x |")
    print("\n| model (AdamW) | file MB | synchronous save ms | --async-save: training held ms | held / synchronous "
          "| async wall cost per save ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, _, mb, s, _, _, _, held, async_s in rows:
        print(f"| {name} | {mb:.1f} | {s * 1e3:.0f} | {held * 1e3:.1f} | {100 * held / max(s, 1e-9):.0f}% "
              f"| {async_s * 1e3:.0f} |")


if __name__ == "__main__":
    main()
