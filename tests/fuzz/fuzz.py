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
Then --reader-mutants N mutants for each reader of text files and small binary headers (class
Readers: --config INI, --deepspeed-config JSON, import-bin's llm.c headers and --raw tokens,
tokenizer.json, safetensors + config.json, strata-plot's metrics JSONL, TensorBoard event
files): 30% byte edits, the rest structure-aware (deep nesting, huge numbers and sizes, wrong
types, duplicate keys, invalid UTF-8, NUL, truncation mid-token, header fields 0 / -1 / 2^31 /
2^63, offsets past the data, catastrophic regexes...), each run once: ok or clean error only.
Every failure is printed and its input saved under --save-to (tests/fuzz/cases/ by default);
the cases there are re-run first on every run, as regression inputs. Exit 1 on any failure.

  /usr/bin/python3 tests/fuzz/fuzz.py --train build/train --data-tool build/strata-data \\
      --convert build/strata-convert --events build/strata-events --workdir /tmp/fuzz --mutants 300 --seed 1
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
    # Bytes decoded here, not text=True: its universal newlines would make a "\r" a line end.
    text = lambda b: (b or b"").decode(errors="replace")
    try:
        p = subprocess.run(cmd, capture_output=True, env=ENV, timeout=timeout)
        return p.returncode, text(p.stdout), text(p.stderr)
    except subprocess.TimeoutExpired as e:
        return None, text(e.stdout), text(e.stderr)


def classify(rc, out, err):
    """One of ok, clean error, crash, unclean, hang for one process's result."""
    if rc is None:
        return "hang"
    if rc < 0 or rc >= 128 or any(s in out + err for s in CRASH_SIGNS):
        return "crash"
    if rc == 0:
        return "ok"
    lines = [l for l in err.split("\n") if l.strip()]  # a "\r" from a damaged value ends no line
    if rc == 2 and len(lines) == 1 and lines[0].startswith(
            ("error: ", "strata-data: error: ", "strata-convert: error: ", "strata-events: error: ")):
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

    def one(self, category, d, what, file=None):
        if file:
            return self.readers.run(category, d, file)
        if category == "dataset":
            return self.dataset(d)
        if category == "checkpoint":
            return self.checkpoint(d, not what.startswith(NEWEST + ".manifest"))
        return {}


# --- the text and small-header readers (structure-aware as well as byte mutants) ---------------
RAW = "\x00RAW{}\x00"  # a placeholder json.dumps keeps, replaced by raw text after dumping


def crc32c(data, _t=[]):
    if not _t:
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
            _t.append(c)
    c = 0xFFFFFFFF
    for b in data:
        c = _t[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc(data):
    c = crc32c(data)
    return ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecords(data):
    """The payloads of a TFRecord file (TensorBoard events), or None when it does not parse."""
    out, at = [], 0
    while at + 12 <= len(data):
        n = int.from_bytes(data[at:at + 8], "little")
        if at + 16 + n > len(data):
            return None
        out.append(data[at + 12:at + 12 + n])
        at += 16 + n
    return out if at == len(data) else None


def tfrecord(payload, length=None):
    head = (len(payload) if length is None else length).to_bytes(8, "little")
    return head + masked_crc(head).to_bytes(4, "little") + payload + masked_crc(payload).to_bytes(4, "little")


def weird_value(rng, raws):
    """A value of the wrong type or size, or deep nesting, for a JSON mutant; raw text via raws."""
    k = rng.choice(("deep", "deep", "huge-int", "huge-real", "neg", "big-array", "big-string", "null", "string",
                    "object", "array", "bool", "nan", "utf8", "nul", "zero", "float"))
    def raw(text):
        raws.append(text)
        return RAW.format(len(raws) - 1), k
    if k == "deep":
        n = rng.choice((100, 1000, 10 ** 4, 10 ** 5))
        o, c = rng.choice((("[", "]"), ('{"a":', "}")))
        return raw(o * n + "1" + c * n)
    if k == "huge-int":
        return raw(rng.choice(("9223372036854775808", "18446744073709551616", "-9223372036854775809",
                               "1" + "0" * 400, "2147483648", "4294967296")))
    if k == "huge-real":
        return raw(rng.choice(("1e999", "-1e999", "1e-999", "1.7976931348623157e308")))
    if k == "nan":
        return raw(rng.choice(("NaN", "Infinity", "-Infinity")))
    if k == "neg":
        return rng.choice((-1, -2 ** 31, -2 ** 63)), k
    if k == "big-array":
        return raw("[" + ",".join(["1"] * 10 ** 6) + "]")
    if k == "big-string":
        return "x" * (1 << 20), k
    if k == "utf8":
        return raw('"\udcff\udcfe\udcc3("')
    if k == "nul":
        return raw('"a\x00b"')
    return {"null": None, "string": "7", "object": {"a": 1}, "array": [1, 2], "bool": True, "zero": 0,
            "float": 0.5}[k], k


def paths(obj, at=()):
    """Every path (tuple of keys/indices) into a parsed JSON value, the root included."""
    yield at
    if isinstance(obj, dict):
        for key, v in obj.items():
            yield from paths(v, at + (key,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:50]):
            yield from paths(v, at + (i,))


def mutate_json(text, rng, pick=None):
    """A structure-aware mutant of JSON text: a value replaced/removed, a duplicate key, the top
    level replaced, truncation mid-token, invalid UTF-8 or NUL bytes, or an empty file."""
    obj = json.loads(text)
    k = rng.choice(("value", "value", "value", "delete", "duplicate", "top", "truncate", "empty", "bytes"))
    if k == "empty":
        return b"", "empty file"
    if k == "truncate":
        raw = text.encode()
        at = rng.randrange(len(raw))
        return raw[:at], f"truncated at {at}"
    if k == "bytes":
        raw = bytearray(text.encode())
        at = rng.randrange(len(raw))
        ins = rng.choice((b"\xff", b"\xc3", b"\x00", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"))
        raw[at:at] = ins
        return bytes(raw), f"inserted {ins!r} at {at}"
    raws = []
    if k == "top":
        obj, what = weird_value(rng, raws)
        what = f"top level: {what}"
    else:
        all_paths = [p for p in paths(obj) if p] if pick is None else pick(obj)
        if not all_paths:
            return b"[]", "top level: array"
        at = rng.choice(all_paths)
        parent = obj
        for key in at[:-1]:
            parent = parent[key]
        if k == "delete":
            del parent[at[-1]]
            what = f"deleted {'.'.join(map(str, at))}"
        elif k == "duplicate" and isinstance(parent, dict):
            v, vk = weird_value(rng, raws)  # json.dumps cannot write a key twice: raw text does
            raws.append(json.dumps(parent[at[-1]]) + ", " + json.dumps(at[-1]) + ": " + json.dumps(v))
            parent[at[-1]] = RAW.format(len(raws) - 1)
            what = f"duplicate key {'.'.join(map(str, at))} ({vk})"
        else:
            v, vk = weird_value(rng, raws)
            parent[at[-1]] = v
            what = f"{'.'.join(map(str, at))} = {vk}"
    out = json.dumps(obj)
    for i in reversed(range(len(raws))):  # the later may hold the earlier
        out = out.replace(json.dumps(RAW.format(i)), raws[i])
    return out.encode("utf-8", "surrogateescape"), what


def mutate_ini(text, rng):
    lines = text.splitlines()
    k = rng.choice(("duplicate", "unknown", "hidden", "long", "recursion", "wrong-type", "huge", "empty", "nul",
                    "utf8", "truncate", "no-equals", "section"))
    i = rng.randrange(len(lines))
    key = lines[i].split("=")[0].strip()
    if k == "duplicate":
        lines.insert(rng.randrange(len(lines) + 1), lines[i])
    elif k == "unknown":
        lines.insert(i, rng.choice(("no-such-option = 1", "hiden = 8", "= 3", "steps.x = 1")))
    elif k == "hidden":
        lines = [l for l in lines if not l.startswith("hidden")] + ["hidden = " + ",".join(["8"] * 350000)]
    elif k == "long":
        lines[i] = lines[i] + "9" * (1 << 20)
    elif k == "recursion":
        lines.insert(0, "config = " + rng.choice(("{self}", "{self}", "/nonexistent.ini", "")))
    elif k == "wrong-type":
        lines[i] = f"{key} = " + rng.choice(("abc", "1.5.3", "-1", "", "true", "[1]", "0x10", "1e400"))
    elif k == "huge":
        lines[i] = f"{key} = " + rng.choice(("9223372036854775808", "99999999999999999999", "2147483648", "-2147483649",
                                             "1e999", "nan", "inf"))
    elif k == "empty":
        return b"", "empty file"
    elif k == "nul":
        lines[i] = lines[i][:3] + "\x00" + lines[i][3:]
    elif k == "utf8":
        return ("\n".join(lines).encode() + b"\nmodel = \xff\xfe\n"), "invalid UTF-8"
    elif k == "truncate":
        raw = "\n".join(lines).encode()
        at = rng.randrange(len(raw))
        return raw[:at], f"truncated at {at}"
    elif k == "no-equals":
        lines[i] = key
    else:
        lines.insert(i, rng.choice(("[section]", "[", "]", "[[x]]")))
    return ("\n".join(lines) + "\n").encode(), f"{k} (line {i})"


FIELD_VALUES = (0, -1, 1, 2 ** 31, 2 ** 31 - 1, 2 ** 32 - 1, 2 ** 63, 2 ** 64 - 1)


def mutate_llmc(data, rng, tokens):
    data = bytearray(data)
    k = rng.choice(("magic", "version", "count", "count", "count-beyond", "short-header", "int64"))
    if k in ("magic", "version", "count"):
        v = rng.choice(FIELD_VALUES)
        field = ("magic", "version", "count").index(k)
        data[field * 4:field * 4 + 4] = (v & 0xFFFFFFFF).to_bytes(4, "little")
        return bytes(data), f"{k} = {v}"
    if k == "count-beyond":
        v = tokens + rng.choice((1, 2, 1000, 2 ** 30))
        data[8:12] = (v & 0xFFFFFFFF).to_bytes(4, "little")
        return bytes(data), f"count = {v} (file holds {tokens})"
    if k == "int64":  # a 2^63 written over count and the next slot
        data[8:16] = (2 ** 63).to_bytes(8, "little")
        return bytes(data), "count..+1 = 2^63 as int64"
    n = rng.choice((0, 3, 4, 11, 12, 1023))
    return bytes(data[:n]), f"header truncated to {n} bytes"


def mutate_safetensors(data, rng):
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    k = rng.choice(("length", "length", "offsets", "offsets", "dtype", "shape", "json", "json"))
    if k == "length":
        v = rng.choice((0, 1, n - 1, n + 1, len(data), len(data) + 1, 2 ** 31, 2 ** 63, 2 ** 64 - 1))
        return v.to_bytes(8, "little") + data[8:], f"header length = {v} (was {n})"
    names = [t for t in header if t != "__metadata__"]
    t = rng.choice(names)
    if k == "offsets":
        a, b = header[t]["data_offsets"]
        other = header[rng.choice(names)]["data_offsets"]
        header[t]["data_offsets"] = rng.choice((
            [a, len(body) + 4], [b, a], [a, a], [0, 2 ** 63], [-1, b], [a, b - 4], [a, b + 4], list(other),
            [other[0] + 4, other[1] + 4], [a], "x", [str(a), b], [2 ** 64, 2 ** 64 + 4]))
        what = f"{t}.data_offsets = {header[t]['data_offsets']}"
    elif k == "dtype":
        header[t]["dtype"] = rng.choice(("F99", "", "f32", 5, None, "BOOL", "F64", "I64", "U8", "BF16", "F8_E4M3"))
        what = f"{t}.dtype = {header[t]['dtype']!r}"
    elif k == "shape":
        header[t]["shape"] = rng.choice(([-1], [2 ** 62, 2 ** 62], [], ["3"], [0], "3", None, [1.5],
                                         [2 ** 64], [1] * 100, [3, 3, 3, 3, 3, 3, 3, 3, 3]))
        what = f"{t}.shape = {header[t]['shape']!r}"
    else:
        text, what = mutate_json(json.dumps(header), rng)
        return len(text).to_bytes(8, "little") + text + body, f"header json: {what}"
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + body, what


def mutate_tokenizer(text, rng):
    obj = json.loads(text)
    m = obj["model"]
    k = rng.choice(("merge", "vocab-dup", "vocab-id", "regex", "regex", "json", "json", "added"))
    vocab = list(m["vocab"])
    if k == "merge":
        i = rng.randrange(len(m["merges"]))
        bad = rng.choice(("nosuch tok", "a", "", "a b c", "Ġ Ġ Ġ", ["x", "y"], ["a"], 5, None))
        m["merges"][i] = bad
        what = f"merges[{i}] = {bad!r}"
    elif k == "vocab-dup":
        a, b = rng.sample(vocab, 2)
        m["vocab"][a] = m["vocab"][b]
        what = f"vocab[{a!r}] = vocab[{b!r}] = {m['vocab'][b]}"
    elif k == "vocab-id":
        t = rng.choice(vocab)
        m["vocab"][t] = rng.choice((-1, -2 ** 31, 2 ** 31, 2 ** 31 - 1, 2 ** 63, 10 ** 9, 1.5, "3", None))
        what = f"vocab[{t!r}] = {m['vocab'][t]!r}"
    elif k == "added":
        obj["added_tokens"] = rng.choice(([{"id": -1, "content": "<x>", "special": True}],
                                          [{"id": 2 ** 40, "content": "<x>", "special": True}],
                                          [{"id": 0, "content": "", "special": True}], [{"content": 5}], [5], {}))
        what = f"added_tokens = {obj['added_tokens']!r}"
    elif k == "regex":
        pat = rng.choice(("(a+)+$", "(a|aa)+$", "(.*a){20}", "([", "(?<x", "\\", "\\p{Nope}", "a{99999999}",
                          "(?=a)*", "", "(a*)*b", "\\x{110000}", "[z-a]", "(?i:'s|\\p{L}+"))
        obj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pat}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
        what = f"pre_tokenizer regex {pat!r}"
    else:
        out, what = mutate_json(text, rng, lambda o: [p for p in paths(o) if p and (len(p) < 2 or p[0] != "model"
                                                      or p[1] not in ("vocab", "merges") or len(p) == 2)])
        return out, f"json: {what}"
    return json.dumps(obj).encode(), what


def mutate_jsonl(text, rng):
    lines = text.splitlines()
    i = rng.randrange(len(lines))
    k = rng.choice(("field", "field", "line", "blank", "long", "empty"))
    if k == "empty":
        return b"", "empty file"
    if k == "blank":
        lines.insert(i, rng.choice(("", "  ", "{", "[]", "null", "1", '"x"', "\x00", "{}")))
        what = f"line {i} inserted"
    elif k == "long":
        lines.insert(i, json.dumps({"step": 1, "loss": 1, "lr": 1, "samples_per_s": 1, "x": "y" * (1 << 20)}))
        what = "a 1 MB line"
    elif k == "line":
        out, what = mutate_json(lines[i], rng)
        lines[i] = out.decode("utf-8", "surrogateescape")
        what = f"line {i}: {what}"
    else:
        obj = json.loads(lines[i])
        key = rng.choice(list(obj))
        raws = []
        v, vk = weird_value(rng, raws)
        obj[key] = v
        line = json.dumps(obj)
        for j in reversed(range(len(raws))):
            line = line.replace(json.dumps(RAW.format(j)), raws[j])
        lines[i] = line
        what = f"line {i}: {key} = {vk}"
    return "\n".join(lines).encode("utf-8", "surrogateescape") + b"\n", what


def mutate_events(data, rng, byte_mutate):
    recs = tfrecords(data)
    k = rng.choice(("length", "payload", "payload", "append", "crc"))
    i = rng.randrange(len(recs))
    if k == "length":  # a length field with a valid CRC, so the reader believes it
        v = rng.choice((0, 1, len(recs[i]) + 1, 2 ** 31, 2 ** 32, 2 ** 63, 2 ** 64 - 1))
        recs[i] = (recs[i], v)
        what = f"record {i} length = {v}"
    elif k == "payload":  # damaged protobuf with valid CRCs
        recs[i], what = byte_mutate(recs[i], rng)
        what = f"record {i} payload: {what}"
    elif k == "append":
        extra = rng.choice((b"\x09" + bytes(8) + b"\x10" + b"\xff" * 10, b"\x0a\xff\xff\xff\xff\x0f",
                            b"\x2a\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01", b"\x12\x05ab", b"\x17", b""))
        recs[i] = recs[i] + extra
        what = f"record {i} + {extra!r}"
    else:
        out = bytearray(data)
        out[8] ^= 1
        return bytes(out), "first length crc flipped"
    out = b""
    for r in recs:
        out += tfrecord(*r) if isinstance(r, tuple) else tfrecord(r)
    return out, what


class Readers:
    """The readers of text files and small binary headers, each with a good input, its
    structure-aware mutator, and the command that reads a mutant (its file under d/)."""
    NAMES = ("ini", "deepspeed", "import-bin", "import-bin-raw", "tokenizer", "safetensors", "plot", "events")

    def __init__(self, f, a):
        self.f, self.a, self.w = f, a, os.path.join(f.work, "readers")
        os.makedirs(self.w)
        fx = os.path.join(HERE, "..", "fixtures")
        pairs = [MODEL[i:i + 2] for i in range(0, len(MODEL), 2)]
        self.ini = "".join(f"{k[2:]} = {v}\n" for k, v in pairs) + f"data = {f.data}\n"
        self.ds = json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 16, "gradient_clipping": 1.0,
                              "steps_per_print": 1, "seed": 3, "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
                              "zero_optimization": {"stage": 0, "overlap_comm": True}, "fp16": {"enabled": False}},
                             indent=1)
        self.tokens = 64
        ids = np.arange(self.tokens, dtype="<u2") * 7 % 50257
        head = np.zeros(256, "<i4")
        head[:3] = (20240520, 1, self.tokens)
        self.bin = head.tobytes() + ids.tobytes()
        self.tok = {n: open(os.path.join(fx, "hf", n)).read() for n in ("gpt2.json", "llama3.json")}
        self.text = os.path.join(self.w, "text.txt")
        open(self.text, "w").write("Hello world, it's 2024! " * 20 + "a" * 40 + "!\n")
        self.model = os.path.join(fx, "hf", "gpt2-tiny")
        lines = []
        for s in range(1, 11):
            line = {"step": s, "loss": 2.0 / s, "lr": 0.05, "samples_per_s": 1000.0 + s}
            if s % 5 == 0:
                line.update(eval_loss=2.5 / s, eval_accuracy=0.1 * s)
            lines.append(json.dumps(line))
        self.jsonl = "\n".join(lines) + "\n"
        self.events = {n: open(os.path.join(fx, "tensorboard", n), "rb").read()
                       for n in ("tensorboard.events", "torch.events")}
        self.plot = [sys.executable, os.path.join(HERE, "..", "..", "tools", "strata-plot")]

    def make(self, reader, d, rng):
        """Writes mutant files under d; returns (file name, what was done)."""
        byte = rng.random() < 0.3  # the rest structure-aware
        if reader == "ini":
            name, good = "config.ini", self.ini.encode()
            bad, what = self.f.mutate(good, rng) if byte else mutate_ini(self.ini, rng)
            bad = bad.replace(b"{self}", os.path.join(d, name).encode())
        elif reader == "deepspeed":
            name, good = "ds.json", self.ds.encode()
            bad, what = self.f.mutate(good, rng) if byte else mutate_json(self.ds, rng)
        elif reader == "import-bin":
            name = "tokens.bin"
            bad, what = self.f.mutate(self.bin, rng) if byte else mutate_llmc(self.bin, rng, self.tokens)
        elif reader == "import-bin-raw":
            name = "tokens.bin"
            bad, what = self.f.mutate(self.bin[1024:], rng)
        elif reader == "tokenizer":
            src = rng.choice(sorted(self.tok))
            name = "tokenizer.json"
            bad, what = self.f.mutate(self.tok[src].encode(), rng) if byte else mutate_tokenizer(self.tok[src], rng)
            what = f"{src}: {what}"
        elif reader == "safetensors":
            shutil.copytree(self.model, os.path.join(d, "model"))
            if rng.random() < 0.25:
                name = "model/config.json"
                good = open(os.path.join(self.model, "config.json")).read()
                bad, what = self.f.mutate(good.encode(), rng) if byte else mutate_json(good, rng)
            else:
                name = "model/model.safetensors"
                good = open(os.path.join(self.model, "model.safetensors"), "rb").read()
                bad, what = self.f.mutate(good, rng) if byte else mutate_safetensors(good, rng)
        elif reader == "plot":
            name = "metrics.jsonl"
            bad, what = self.f.mutate(self.jsonl.encode(), rng) if byte else mutate_jsonl(self.jsonl, rng)
        else:
            src = rng.choice(sorted(self.events))
            name = "run.events"
            bad, what = (self.f.mutate(self.events[src], rng) if byte else
                         mutate_events(self.events[src], rng, self.f.mutate))
            what = f"{src}: {what}"
        open(os.path.join(d, name), "wb").write(bad)
        return name, ("bytes: " if byte else "") + what

    def check_good(self, reader):
        """The unmutated input must be accepted, else every mutant's clean error means nothing."""
        d = os.path.join(self.w, "good-" + reader)
        os.makedirs(d)
        shutil.copytree(self.model, os.path.join(d, "model"))
        good = {"ini": ("config.ini", self.ini.encode()), "deepspeed": ("ds.json", self.ds.encode()),
                "import-bin": ("tokens.bin", self.bin), "import-bin-raw": ("tokens.bin", self.bin[1024:]),
                "tokenizer": ("tokenizer.json", self.tok["llama3.json"].encode()),
                "safetensors": ("model/config.json", open(os.path.join(self.model, "config.json"), "rb").read()),
                "plot": ("metrics.jsonl", self.jsonl.encode()), "events": ("run.events", self.events["torch.events"])}
        name, data = good[reader]
        open(os.path.join(d, name), "wb").write(data)
        kind, err = self.run(reader, d, name)[reader]
        assert kind == "ok", f"{reader}: the good input gave {kind}: {err}"

    def prepare(self, reader, d, name):
        """A regression case's directory d holds `name` only: the other files its reader needs."""
        path = os.path.join(d, name)
        data = open(path, "rb").read()
        open(path, "wb").write(data.replace(b"{DIR}", d.encode()).replace(b"{WORK}", self.f.work.encode()))
        if reader == "safetensors":
            for file in os.listdir(self.model):
                if not os.path.exists(os.path.join(d, "model", file)):
                    shutil.copyfile(os.path.join(self.model, file), os.path.join(d, "model", file))

    def run(self, reader, d, name):
        a, path, t = self.a, os.path.join(d, name), self.a.timeout
        if reader == "ini":  # --dry-run: the reader and the plan, nothing trained
            cmd = [a.train, "--config", path, "--dry-run"]
        elif reader == "deepspeed":
            cmd = [a.train, "--model", "mlp", "--hidden", "8", "--data", self.f.data, "--threads", "1",
                   "--deepspeed-config", path, "--dry-run"]
        elif reader.startswith("import-bin"):
            cmd = [a.data_tool, "import-bin", "--input", path, "--out", os.path.join(d, "out", "t")] + (
                ["--raw"] if reader.endswith("raw") else [])
        elif reader == "tokenizer":
            cmd = [a.data_tool, "tokenize", "--input", self.text, "--out", os.path.join(d, "out", "t"),
                   "--tokenizer", "hf:" + path]
        elif reader == "safetensors":
            cmd = [a.convert, "import-hf", "--model-dir", os.path.join(d, "model"), "--out", os.path.join(d, "m.h5")]
        elif reader == "plot":
            cmd = self.plot + [path, "--out", os.path.join(d, "plot.svg")]
        else:
            cmd = [a.events, path]
        rc, out, err = run(cmd, t)
        return {reader: (classify(rc, out, err), err)}


def regression_cases(f, root, readers):
    """The saved failing inputs, as (category, directory, description) of fresh mutant dirs."""
    cases = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        src = os.path.join(root, name)
        if not os.path.isdir(src):
            continue
        meta = json.load(open(os.path.join(src, "case.json")))
        d = os.path.join(f.work, "regression", name)
        os.makedirs(d)
        if meta["category"] in Readers.NAMES:
            if readers is None or meta["category"] not in readers.chosen:
                continue
            os.makedirs(os.path.dirname(os.path.join(d, meta["file"])), exist_ok=True)
            shutil.copyfile(os.path.join(src, os.path.basename(meta["file"])), os.path.join(d, meta["file"]))
            readers.prepare(meta["category"], d, meta["file"])
            cases.append((meta["category"], d, f"regression {name}: {meta['what']}", meta["file"]))
            continue
        if meta["category"] == "dataset":
            shutil.copyfile(os.path.join(src, "data.h5"), os.path.join(d, "data.h5"))
        else:
            shutil.copytree(f.ck, os.path.join(d, "ck"))
            for file in (NEWEST, NEWEST + ".manifest"):  # a case without a manifest is unsealed
                if os.path.exists(os.path.join(src, file)):
                    shutil.copyfile(os.path.join(src, file), os.path.join(d, "ck", file))
                else:
                    os.remove(os.path.join(d, "ck", file))
        cases.append((meta["category"], d, f"regression {name}: {meta['what']}", None))
    return cases


def save_case(root, category, d, what, found, file=None):
    """Keeps a failing input: data.h5, the newest checkpoint with its manifest, or a reader's file."""
    dst = os.path.join(root, f"{category}-{zlib.crc32(what.encode()):08x}")
    os.makedirs(dst, exist_ok=True)
    if file:  # its paths (an INI's data = and config =) kept as {DIR} and {WORK}, for any checkout
        data = open(os.path.join(d, file), "rb").read()
        data = data.replace(d.encode(), b"{DIR}").replace(os.path.dirname(os.path.dirname(os.path.dirname(d))).encode(),
                                                          b"{WORK}")
        open(os.path.join(dst, os.path.basename(file)), "wb").write(data)
        json.dump({"category": category, "what": what, "found": found, "file": file},
                  open(os.path.join(dst, "case.json"), "w"), indent=1)
        return dst
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
    p.add_argument("--mutants", type=int, default=300, help="damaged datasets and checkpoints")
    p.add_argument("--convert", help="strata-convert (the safetensors reader; skipped without it)")
    p.add_argument("--events", help="strata-events (the TensorBoard reader; skipped without it)")
    p.add_argument("--readers", default=",".join(Readers.NAMES), help="the readers to fuzz (all: " +
                   ", ".join(Readers.NAMES) + ")")
    p.add_argument("--reader-mutants", type=int, default=40, help="mutants per reader")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=20, help="seconds per process before it counts as a hang")
    p.add_argument("--unsealed", action="store_true",
                   help="remove the damaged checkpoint's manifest (the pre-manifest format): no checksum, so "
                        "resuming from it is a silent change only if step 10 differs")
    p.add_argument("--save-to", default=os.path.join(HERE, "cases"), help="where failing inputs are kept")
    a = p.parse_args()
    f = Fuzzer(a)
    f.readers = Readers(f, a)
    f.readers.chosen = [r for r in a.readers.split(",") if r and not (r == "safetensors" and not a.convert)
                        and not (r == "events" and not a.events)]
    assert all(r in Readers.NAMES for r in f.readers.chosen), f"--readers: known ones are {Readers.NAMES}"
    for reader in f.readers.chosen:
        f.readers.check_good(reader)
    rng = random.Random(a.seed)
    todo = regression_cases(f, a.save_to, f.readers) + [f.make(i, rng) + (None,) for i in range(a.mutants)]
    n = len(todo)
    for reader in f.readers.chosen:
        rrng = random.Random(f"{a.seed}:{reader}")  # each reader's mutants apart from the others'
        for i in range(a.reader_mutants):
            d = os.path.join(f.work, "r", reader, f"{i:05d}")
            os.makedirs(d)
            todo.append((reader, d) + tuple(reversed(f.readers.make(reader, d, rrng))))
    mutants = a.mutants + len(todo) - n
    tally = collections.Counter()
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        for (category, d, what, file), result in zip(todo, pool.map(lambda c: f.one(*c), todo)):
            tally[category] += 1
            bad = {prog: (kind, text) for prog, (kind, text) in result.items() if kind in FAILURES}
            for prog, (kind, _) in result.items():
                tally[(category, prog, kind)] += 1
            if bad:
                failed += 1
                found = sorted({k for k, _ in bad.values()})
                kept = src if (src := d).startswith(os.path.join(f.work, "regression")) else save_case(
                    a.save_to, category, d, what, found, file)
                for prog, (kind, text) in bad.items():
                    print(f"FAIL {kind}: {category} {what} ({prog}); kept in {kept}\n{text.strip()[-2000:]}\n")
            else:
                shutil.rmtree(d)
    print(f"fuzz: seed {a.seed}, {mutants} mutants (+ {len(todo) - mutants} regression cases), "
          f"timeout {a.timeout:g} s")
    for category in ("dataset", "checkpoint", "unchanged") + tuple(f.readers.chosen):
        print(f"  {category}: {tally[category]} cases")
        for key in sorted(k for k in tally if isinstance(k, tuple) and k[0] == category):
            print(f"    {key[1]:12s} {key[2]:14s} {tally[key]}")
    print(f"fuzz: {failed} failing case(s)")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
