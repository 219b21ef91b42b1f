"""strata-data tokenize / import-bin / inspect against h5py and numpy: the token files' dtype and
attributes, decoding with the stored BPE merges (reimplemented here) gives back the input files,
llm.c and nanoGPT .bin files import to the same tokens, and bad input exits 2 with one line.
Usage: check_tokens.py STRATA_DATA WORKDIR"""
import glob
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np

exe, work = sys.argv[1], sys.argv[2]
shutil.rmtree(work, ignore_errors=True)
os.makedirs(os.path.join(work, "text"))


def run(*args, rc=0):
    p = subprocess.run([exe, *args], capture_output=True, text=True)
    assert p.returncode == rc, f"{args}: exit {p.returncode}, expected {rc}\n{p.stdout}{p.stderr}"
    return p


def bad(words, *args):
    err = run(*args, rc=2).stderr.strip()
    assert "\n" not in err, f"not one line: {err!r}"
    for w in words:
        assert w in err, f"{w!r} not in {err!r}"


# Input documents: real English text where the machine has it, UTF-8 of several scripts, and
# every byte value (not UTF-8 at all).
gpl = "/usr/share/common-licenses/GPL-3"
if os.path.exists(gpl):
    english = open(gpl, "rb").read()
else:
    words = "the program license software free copy of and to you".split()
    english = " ".join(words[(i * 7 + i // 13) % 10] for i in range(6000)).encode()
mixed = "naïve café — 日本語, Ελληνικά 🙂\n".encode() * 20 + bytes(range(256)) + b"<|endoftext|> is just text"
docs = [english, mixed, b"short"]
for i, d in enumerate(docs):
    open(os.path.join(work, "text", f"{i:02d}.txt"), "wb").write(d)


def read_stream(prefix):
    """The train shards then the val file: (tokens, the first file's attributes and merges)."""
    files = sorted(glob.glob(prefix + "-train*.h5")) + [prefix + "-val.h5"]
    arrays, attrs, merges = [], None, None
    for path in files:
        with h5py.File(path, "r") as f:
            t = f["tokens"]
            assert t.ndim == 1 and t.dtype == np.uint16, (path, t.dtype)
            a = dict(f.attrs)
            assert a["kind"] == "tokens" and a["num_tokens"] == t.shape[0], a
            m = f["tokenizer/merges"][...] if "tokenizer" in f else None
            if attrs is None:
                attrs, merges = a, m
            else:
                assert a["vocab_size"] == attrs["vocab_size"] and a["eot"] == attrs["eot"]
                assert (m is None) == (merges is None) and (m is None or np.array_equal(m, merges))
            arrays.append(t[...].astype(np.int64))
    return np.concatenate(arrays), attrs, merges, files


def decode(ids, merges):
    """Byte-level BPE decoding: ids 0..255 are bytes, merge i makes id 256 + i."""
    vocab = [bytes([b]) for b in range(256)]
    for a, b in (merges if merges is not None else []):
        vocab.append(vocab[a] + vocab[b])
    return b"".join(vocab[i] for i in ids)


def encode(text, merges):
    """Merge 0 over the whole text left to right, then merge 1, ... (slow; small texts)."""
    ids = list(text)
    for i, (a, b) in enumerate(merges):
        out, k = [], 0
        while k < len(ids):
            if k + 1 < len(ids) and ids[k] == a and ids[k + 1] == b:
                out.append(256 + i)
                k += 2
            else:
                out.append(ids[k])
                k += 1
        ids = out
    return ids


def split_docs(stream, eot):
    """Documents are each followed by eot."""
    assert stream[-1] == eot
    cuts = np.flatnonzero(stream == eot)
    return [stream[a + 1 if i else 0:b] for i, (a, b) in enumerate(zip(np.r_[-1, cuts[:-1]], cuts))]


# ---- BPE ---------------------------------------------------------------------------------------
prefix = os.path.join(work, "bpe/gpl")
out = run("tokenize", "--input", os.path.join(work, "text"), "--out", prefix, "--tokenizer", "bpe", "--vocab-size",
          "600", "--val-fraction", "0.1", "--shards", "2").stdout
assert "343 merges" in out and "3 documents" in out, out
stream, attrs, merges, files = read_stream(prefix)
assert len(files) == 3, files
assert attrs["tokenizer"] == "bpe" and attrs["vocab_size"] == 600 and attrs["eot"] == 599, attrs
assert merges.dtype == np.int32 and merges.shape == (343, 2), (merges.dtype, merges.shape)
assert all(merges[i].max() < 256 + i for i in range(len(merges)))
assert stream.max() < 600
# Val is the last 10% of the token stream (rounded down).
n_val = h5py.File(prefix + "-val.h5", "r")["tokens"].shape[0]
assert n_val == int(len(stream) * 0.1), (n_val, len(stream))
pieces = split_docs(stream, attrs["eot"])
assert len(pieces) == 3
for piece, doc in zip(pieces, docs):
    assert decode(piece, merges) == doc, "decoding with the stored merges does not give back the file"
assert encode(mixed, merges) == list(pieces[1]), "tokens differ from replaying the merges"
assert len(stream) < 0.5 * sum(map(len, docs)), "343 merges should more than halve English text"
# Deterministic: the same input, the same merges and tokens.
run("tokenize", "--input", os.path.join(work, "text"), "--out", os.path.join(work, "again/gpl"), "--tokenizer", "bpe",
    "--vocab-size", "600", "--val-fraction", "0.1", "--shards", "2")
again, _, merges2, _ = read_stream(os.path.join(work, "again/gpl"))
assert np.array_equal(again, stream) and np.array_equal(merges2, merges)
inspect = run("inspect", prefix + "-train*").stdout
assert "tokens:        " + str(len(stream) - n_val) in inspect and "bpe (343 merges" in inspect, inspect
assert 'excerpt:       "' in inspect and english[:60].decode().strip() in inspect, inspect

# ---- byte ----------------------------------------------------------------------------------------
prefix = os.path.join(work, "byte/all")
run("tokenize", "--input", *sorted(glob.glob(os.path.join(work, "text/*.txt"))), "--out", prefix, "--tokenizer", "byte")
stream, attrs, merges, _ = read_stream(prefix)
assert attrs["tokenizer"] == "byte" and attrs["vocab_size"] == 257 and attrs["eot"] == 256 and merges is None
assert np.array_equal(stream, np.concatenate([np.r_[np.frombuffer(d, np.uint8), 256] for d in docs]))

# ---- import-bin ----------------------------------------------------------------------------------
rng = np.random.default_rng(0)
tokens = rng.integers(0, 50256, size=5000).astype(np.uint16)
tokens[::100] = 50256  # GPT-2's <|endoftext|>


def llmc(path, toks, magic=20240520, version=1, count=None, extra=b""):
    header = np.zeros(256, np.int32)
    header[:3] = magic, version, len(toks) if count is None else count
    with open(path, "wb") as f:
        f.write(header.tobytes() + toks.tobytes() + extra)
    return path


bins = os.path.join(work, "bins")
os.makedirs(bins)
llmc(os.path.join(bins, "train_000.bin"), tokens[:3000])
llmc(os.path.join(bins, "train_001.bin"), tokens[3000:])
open(os.path.join(bins, "notes.txt"), "w").write("not a .bin file: skipped")
run("import-bin", "--input", bins, "--out", os.path.join(work, "gpt2/train"))
shards = sorted(glob.glob(os.path.join(work, "gpt2/train-*-of-00002.h5")))
assert len(shards) == 2, shards
got = []
for path in shards:
    with h5py.File(path, "r") as f:
        assert f["tokens"].dtype == np.uint16 and "tokenizer" not in f
        assert f.attrs["tokenizer"] == "external" and f.attrs["vocab_size"] == 50257 and f.attrs["eot"] == 50256
        got.append(f["tokens"][...])
assert np.array_equal(np.concatenate(got), tokens)
# nanoGPT: the same tokens without a header.
tokens.tofile(os.path.join(work, "val.bin"))
run("import-bin", "--input", os.path.join(work, "val.bin"), "--raw", "--out", os.path.join(work, "gpt2/val"))
assert np.array_equal(h5py.File(os.path.join(work, "gpt2/val.h5"), "r")["tokens"][...], tokens)
# llm.c version 2: uint32 tokens (LLaMA 3), here with a wide vocabulary.
wide = rng.integers(0, 128256, size=300).astype(np.uint32)
llmc(os.path.join(work, "llama.bin"), wide, version=2)
run("import-bin", "--input", os.path.join(work, "llama.bin"), "--vocab-size", "128256", "--eot", "128001", "--out",
    os.path.join(work, "llama/t"))
with h5py.File(os.path.join(work, "llama/t.h5"), "r") as f:
    assert f["tokens"].dtype == np.uint32 and np.array_equal(f["tokens"][...], wide) and f.attrs["eot"] == 128001
inspect = run("inspect", os.path.join(work, "gpt2/val.h5")).stdout
assert "tokenizer:     external" in inspect and "excerpt:       not available" in inspect, inspect

x = os.path.join(work, "x")
bad(["--input", "magic.bin", "expected magic 20240520, found 12345", "--raw"], "import-bin", "--input",
    llmc(os.path.join(work, "magic.bin"), tokens, magic=12345), "--out", x)
bad(["--input", "version 7"], "import-bin", "--input", llmc(os.path.join(work, "v7.bin"), tokens, version=7), "--out", x)
bad(["header counts 5010 tokens", "has only"], "import-bin", "--input",
    llmc(os.path.join(work, "count.bin"), tokens, count=5010), "--out", x)
bad(["6 bytes beyond the 5000 tokens"], "import-bin", "--input",
    llmc(os.path.join(work, "tail.bin"), tokens, extra=b"\0" * 6), "--out", x)
open(os.path.join(work, "short.bin"), "wb").write(b"\0" * 100)
bad(["short.bin", "100 bytes, too few for llm.c's 1024-byte header"], "import-bin", "--input",
    os.path.join(work, "short.bin"), "--out", x)
open(os.path.join(work, "odd.bin"), "wb").write(b"\0" * 7)
bad(["odd.bin", "odd number"], "import-bin", "--input", os.path.join(work, "odd.bin"), "--raw", "--out", x)
bad(["holds token", ">= --vocab-size 1000"], "import-bin", "--input", os.path.join(bins, "train_000.bin"),
    "--vocab-size", "1000", "--out", os.path.join(work, "small/t"))
assert not glob.glob(os.path.join(work, "small/*.h5")), "a failed import left a file behind"
bad(["--input", "does not exist"], "import-bin", "--input", os.path.join(work, "nope.bin"), "--out", x)

# ---- tokenize errors -----------------------------------------------------------------------------
text = os.path.join(work, "text")
bad(["--vocab-size", ">= 257"], "tokenize", "--input", text, "--out", x, "--tokenizer", "bpe")
bad(["--vocab-size", "257 ids"], "tokenize", "--input", text, "--out", x, "--tokenizer", "byte", "--vocab-size", "300")
bad(["--tokenizer", "wordpiece"], "tokenize", "--input", text, "--out", x, "--tokenizer", "wordpiece")
bad(["--val-fraction"], "tokenize", "--input", text, "--out", x, "--tokenizer", "byte", "--val-fraction", "1.5")
bad(["--input", "does not exist"], "tokenize", "--input", os.path.join(work, "missing"), "--out", x, "--tokenizer", "byte")
os.makedirs(os.path.join(work, "empty"))
bad(["--input", "holds no regular"], "tokenize", "--input", os.path.join(work, "empty"), "--out", x, "--tokenizer", "byte")
# Inputs are never destroyed, nor read twice, and a refused run leaves no output behind.
one = os.path.join(work, "text", "02.txt")
bad(["--input", "is given twice"], "tokenize", "--input", one, one, "--out", x, "--tokenizer", "byte")
bad(["--input", "is given twice"], "tokenize", "--input", text, one, "--out", x, "--tokenizer", "byte")
mine = os.path.join(work, "own")
run("tokenize", "--input", one, "--out", mine, "--tokenizer", "byte", "--val-fraction", "0")
before = open(mine + "-train.h5", "rb").read()
bad(["--input", "which --out would overwrite"], "tokenize", "--input", mine + "-train.h5", "--out", mine,
    "--tokenizer", "byte", "--val-fraction", "0")
assert open(mine + "-train.h5", "rb").read() == before
good_bin, odd_bin = os.path.join(work, "good.bin"), os.path.join(work, "odd.bin")
np.arange(100, dtype=np.uint16).tofile(good_bin)
half = os.path.join(work, "half")
bad(["odd.bin", "odd number"], "import-bin", "--raw", "--input", good_bin, odd_bin, "--out", half)
assert not [f for f in os.listdir(work) if f.startswith("half")], os.listdir(work)
bad(["--eot: -2 is outside the vocabulary"], "import-bin", "--raw", "--input", good_bin, "--out", half, "--eot", "-2")
bad(["--out", "255-byte limit"], "tokenize", "--input", one, "--out", os.path.join(work, "y" * 300), "--tokenizer", "byte")
bad(["inspect needs the data: strata-data inspect FILE"], "inspect")
print(f"ok: {len(docs)} documents; bpe round trip; import-bin {len(tokens)} tokens")
