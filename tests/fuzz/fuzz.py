#!/usr/bin/python3
"""A seeded mutation fuzzer over Strata's input files (issue #19, item 7).

It writes a good dataset (strata-data synthetic) and a good checkpoint directory (train saves
steps 4 and 8 of a tiny MLP, with manifests), then damages copies of them: byte flips,
truncation, zeroed ranges and duplicated ranges at seeded random offsets (half of them in the
first 4 KiB, where HDF5 keeps its superblock and object headers). Each mutant is run under a
timeout:
  dataset mutants:    train (2 steps) on it, and strata-data inspect on it;
  checkpoint mutants: the newest checkpoint (step 8) or its manifest is the mutant;
                      train --resume PATH to step 10, and train --resume auto to step 10 (with
                      the good step-4 checkpoint present).
Outcomes: ok (exit 0), clean error (exit 2, exactly one stderr line "error: ..."; strata-data's
start "strata-data: error: "), fallback
(--resume auto warned and resumed from step 4), and the failures: crash (a signal, a sanitizer
report, a C++ terminate or traceback), unclean (any other exit: exit 1, or exit 2 with more
than one line), hang (past the timeout) and silent change (a resume that accepted a damaged
checkpoint file, or any resume that ended different from the uninterrupted run's step 10).
Every failure is printed and its input saved under --save-to (tests/fuzz/cases/ by default);
the cases there are re-run first on every run, as regression inputs. Exit 1 on any failure.

  /usr/bin/python3 tests/fuzz/fuzz.py --train build/train --data-tool build/strata-data \\
      --workdir /tmp/fuzz --mutants 300 --seed 1
"""
import argparse
import collections
import concurrent.futures
import json
import os
import random
import re
import shutil
import subprocess
import sys
import zlib

import h5py
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
MODEL = ["--model", "mlp", "--hidden", "8", "--global-batch", "16", "--optimizer", "sgd", "--lr", "0.05",
         "--seed", "3", "--threads", "1", "--prefetch", "1"]
NEWEST, OLDER = "step-00000008.h5", "step-00000004.h5"
FAILURES = ("crash", "unclean", "hang", "silent change")
CRASH_SIGNS = ("AddressSanitizer", "UndefinedBehaviorSanitizer", "runtime error:", "ThreadSanitizer",
               "terminate called", "Traceback", "Segmentation", "core dumped", "Aborted")


def run(cmd, timeout):
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=ENV, timeout=timeout)
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        return None, str(e.stdout or ""), str(e.stderr or "")


def classify(rc, out, err):
    """One of ok, clean error, crash, unclean, hang for one process's result."""
    if rc is None:
        return "hang"
    if rc < 0 or rc >= 128 or any(s in out + err for s in CRASH_SIGNS):
        return "crash"
    if rc == 0:
        return "ok"
    lines = [l for l in err.splitlines() if l.strip()]
    if rc == 2 and len(lines) == 1 and lines[0].startswith(("error: ", "strata-data: error: ")):
        return "clean error"
    return "unclean"


def tensors(path):
    """{name: array} of every dataset of a checkpoint, for bit-for-bit comparison."""
    with h5py.File(path, "r") as f:
        out = {}
        f.visititems(lambda n, o: out.update({n: o[...]}) if isinstance(o, h5py.Dataset) else None)
        return out


def same_tensors(a, b):
    return a.keys() == b.keys() and all(a[n].dtype == b[n].dtype and np.array_equal(a[n], b[n]) for n in a)


class Fuzzer:
    def __init__(self, a):
        self.a = a
        self.work = a.workdir
        shutil.rmtree(self.work, ignore_errors=True)
        os.makedirs(self.work)
        self.data = os.path.join(self.work, "good.h5")
        self.check([a.data_tool, "synthetic", "--out", os.path.join(self.work, "good"), "--samples", "256",
                    "--shape", "1,6,6", "--classes", "4", "--seed", "1"])
        self.ck = os.path.join(self.work, "good-ck")
        self.check([a.train] + MODEL + ["--data", self.data, "--steps", "8", "--save-every", "4",
                                        "--checkpoint-dir", self.ck])
        os.remove(os.path.join(self.ck, ".lock"))  # each mutant's copy gets its own job's lock
        ref = os.path.join(self.work, "ref-ck")
        self.check([a.train] + MODEL + ["--data", self.data, "--steps", "10", "--checkpoint-dir", ref])
        self.reference = tensors(os.path.join(ref, "step-00000010.h5"))

    def check(self, cmd):
        rc, out, err = run(cmd, 120)
        assert rc == 0, f"{' '.join(cmd)}\nrc={rc}\n{out}\n{err}"

    # --- the mutants ---------------------------------------------------------------------------
    def mutate(self, data, rng):
        """1-3 seeded edits of `data`; returns the new bytes and what was done."""
        data = bytearray(data)
        done = []
        for _ in range(rng.randint(1, 3)):
            if not data:
                break
            head = rng.random() < 0.5 and len(data) > 4096
            at = rng.randrange(4096 if head else len(data))
            kind = rng.choice(("flip", "flip", "truncate", "zero", "duplicate"))
            n = min(rng.choice((1, 2, 4, 8, 16, 64, 256)), len(data) - at)
            if kind == "flip":
                data[at] ^= rng.randrange(1, 256)
                n = 1
            elif kind == "truncate":
                del data[at:]
            elif kind == "zero":
                data[at:at + n] = bytes(n)
            else:  # a copy of [at, at + n) inserted right after it
                data[at + n:at + n] = data[at:at + n]
            done.append(f"{kind}@{at}" + (f"+{n}" if kind in ("zero", "duplicate") else ""))
        return bytes(data), " ".join(done)

    def make(self, i, rng):
        """Mutant i: (category, directory, description), its files written under its directory."""
        d = os.path.join(self.work, "m", f"{i:05d}")
        os.makedirs(d)
        if rng.random() < 0.5:
            good = open(self.data, "rb").read()
            bad, what = self.mutate(good, rng)
            open(os.path.join(d, "data.h5"), "wb").write(bad)
            return ("dataset", d, what) if bad != good else ("unchanged", d, what)
        ck = os.path.join(d, "ck")
        shutil.copytree(self.ck, ck)
        if self.a.unsealed:  # a checkpoint from before manifests: HDF5 itself parses the damage
            os.remove(os.path.join(ck, NEWEST + ".manifest"))
        target = NEWEST + (".manifest" if rng.random() < 0.25 and not self.a.unsealed else "")
        good = open(os.path.join(ck, target), "rb").read()
        bad, what = self.mutate(good, rng)
        open(os.path.join(ck, target), "wb").write(bad)
        return ("checkpoint", d, f"{target}: {what}") if bad != good else ("unchanged", d, what)

    # --- running them --------------------------------------------------------------------------
    def dataset(self, d):
        """{program: outcome} for a damaged dataset d/data.h5."""
        path = os.path.join(d, "data.h5")
        t = self.a.timeout
        rc, out, err = run([self.a.train] + MODEL + ["--data", path, "--steps", "2"], t)
        rc2, out2, err2 = run([self.a.data_tool, "inspect", path], t)
        return {"train": (classify(rc, out, err), err), "inspect": (classify(rc2, out2, err2), err2)}

    def resumed(self, ck, out, err, damaged_sealed):
        """The outcome of an exit-0 resume that saved ck/step-00000010.h5."""
        m = re.search(r"resuming from (\S+) at step (\d+)", out)
        if not m:
            return "silent change", "exit 0 without resuming\n" + out
        if m.group(2) == "4" and "skipping checkpoint" in err:
            kind = "fallback"
        elif damaged_sealed:
            return "silent change", f"resumed from the damaged file {m.group(1)}\n{err}"
        else:
            kind = "ok"  # a manifest edit that changed nothing it checks (e.g. a duplicated newline)
        if not same_tensors(tensors(os.path.join(ck, "step-00000010.h5")), self.reference):
            return "silent change", f"resumed from {m.group(1)}: step 10 differs from the uninterrupted run\n{err}"
        return kind, err

    def checkpoint(self, d, damaged_h5):
        """{program: outcome} for a directory d/ck whose newest checkpoint or manifest is damaged."""
        ck, t = os.path.join(d, "ck"), self.a.timeout
        # Resuming from a damaged file that has a manifest is always wrong; without one (the
        # pre-manifest format) nothing promises to see the damage, only step 10 is compared.
        damaged_sealed = damaged_h5 and os.path.exists(os.path.join(ck, NEWEST + ".manifest"))
        common = [self.a.train] + MODEL + ["--data", self.data, "--steps", "10"]
        result = {}
        fresh = os.path.join(d, "ck-path")
        rc, out, err = run(common + ["--resume", os.path.join(ck, NEWEST), "--checkpoint-dir", fresh], t)
        kind = classify(rc, out, err)
        result["resume PATH"] = self.resumed(fresh, out, err, damaged_sealed) if kind == "ok" else (kind, err)
        rc, out, err = run(common + ["--resume", "auto", "--checkpoint-dir", ck], t)
        kind = classify(rc, out, err)
        result["resume auto"] = self.resumed(ck, out, err, damaged_sealed) if kind == "ok" else (kind, err)
        return result

    def one(self, category, d, what):
        if category == "dataset":
            return self.dataset(d)
        if category == "checkpoint":
            return self.checkpoint(d, not what.startswith(NEWEST + ".manifest"))
        return {}


def regression_cases(f, root):
    """The saved failing inputs, as (category, directory, description) of fresh mutant dirs."""
    cases = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        src = os.path.join(root, name)
        if not os.path.isdir(src):
            continue
        meta = json.load(open(os.path.join(src, "case.json")))
        d = os.path.join(f.work, "regression", name)
        os.makedirs(d)
        if meta["category"] == "dataset":
            shutil.copyfile(os.path.join(src, "data.h5"), os.path.join(d, "data.h5"))
        else:
            shutil.copytree(f.ck, os.path.join(d, "ck"))
            for file in (NEWEST, NEWEST + ".manifest"):  # a case without a manifest is unsealed
                if os.path.exists(os.path.join(src, file)):
                    shutil.copyfile(os.path.join(src, file), os.path.join(d, "ck", file))
                else:
                    os.remove(os.path.join(d, "ck", file))
        cases.append((meta["category"], d, f"regression {name}: {meta['what']}"))
    return cases


def save_case(root, category, d, what, found):
    """Keeps a failing input: data.h5, or the newest checkpoint with its manifest."""
    dst = os.path.join(root, f"{category}-{zlib.crc32(what.encode()):08x}")
    os.makedirs(dst, exist_ok=True)
    if category == "dataset":
        shutil.copyfile(os.path.join(d, "data.h5"), os.path.join(dst, "data.h5"))
    else:
        for file in (NEWEST, NEWEST + ".manifest"):
            if os.path.exists(os.path.join(d, "ck", file)):
                shutil.copyfile(os.path.join(d, "ck", file), os.path.join(dst, file))
    json.dump({"category": category, "what": what, "found": found}, open(os.path.join(dst, "case.json"), "w"),
              indent=1)
    return dst


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", required=True)
    p.add_argument("--data-tool", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--mutants", type=int, default=300)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=20, help="seconds per process before it counts as a hang")
    p.add_argument("--unsealed", action="store_true",
                   help="remove the damaged checkpoint's manifest (the pre-manifest format): no checksum, so "
                        "resuming from it is a silent change only if step 10 differs")
    p.add_argument("--save-to", default=os.path.join(HERE, "cases"), help="where failing inputs are kept")
    a = p.parse_args()
    f = Fuzzer(a)
    rng = random.Random(a.seed)
    todo = regression_cases(f, a.save_to) + [f.make(i, rng) for i in range(a.mutants)]
    tally = collections.Counter()
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        for (category, d, what), result in zip(todo, pool.map(lambda c: f.one(*c), todo)):
            tally[category] += 1
            bad = {prog: (kind, text) for prog, (kind, text) in result.items() if kind in FAILURES}
            for prog, (kind, _) in result.items():
                tally[(category, prog, kind)] += 1
            if bad:
                failed += 1
                found = sorted({k for k, _ in bad.values()})
                kept = src if (src := d).startswith(os.path.join(f.work, "regression")) else save_case(
                    a.save_to, category, d, what, found)
                for prog, (kind, text) in bad.items():
                    print(f"FAIL {kind}: {category} {what} ({prog}); kept in {kept}\n{text.strip()[-2000:]}\n")
            else:
                shutil.rmtree(d)
    print(f"fuzz: seed {a.seed}, {a.mutants} mutants (+ {len(todo) - a.mutants} regression cases), "
          f"timeout {a.timeout:g} s")
    for category in ("dataset", "checkpoint", "unchanged"):
        print(f"  {category}: {tally[category]} cases")
        for key in sorted(k for k in tally if isinstance(k, tuple) and k[0] == category):
            print(f"    {key[1]:12s} {key[2]:14s} {tally[key]}")
    print(f"fuzz: {failed} failing case(s)")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
