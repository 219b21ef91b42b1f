"""strata-data with Hugging Face tokenizers (--tokenizer hf:tokenizer.json) against the ids the
`tokenizers` library wrote into tests/fixtures/hf/cases.json: tokenize (one document per case,
eot after each) gives exactly those ids in the shards h5py reads; the shards carry the
tokenizer.json; inspect decodes them; import-bin attaches the tokenizer to llm.c / nanoGPT .bin
files; bad tokenizer.json files and flags exit 2 with one line. Needs only h5py and numpy.
Usage: check_hf_tokens.py STRATA_DATA FIXTURE_DIR WORKDIR"""
import glob
import json
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np

exe, fixtures, work = sys.argv[1], sys.argv[2], sys.argv[3]
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
cases = json.load(open(os.path.join(fixtures, "cases.json"), encoding="utf-8"))["cases"]


def run(*args, rc=0):
    p = subprocess.run([exe, *args], capture_output=True, text=True)
    assert p.returncode == rc, f"{args}: exit {p.returncode}, expected {rc}\n{p.stdout}{p.stderr}"
    return p


def bad(words, *args):
    err = run(*args, rc=2).stderr.strip()
    assert "\n" not in err, f"not one line: {err!r}"
    for w in words:
        assert w in err, f"{w!r} not in {err!r}"


def read_tokens(prefix):
    """The train shards then the val file, as one stream, and the first file's attributes."""
    files = sorted(glob.glob(prefix + "-train*.h5")) + sorted(glob.glob(prefix + "-val.h5"))
    assert files, prefix
    parts, attrs = [], None
    for path in files:
        with h5py.File(path, "r") as f:
            a = dict(f.attrs)
            a["json"] = f["tokenizer/json"][...].tobytes()
            parts.append(f["tokens"][...].astype(np.int64))
        attrs = attrs or a
        assert a["tokenizer"] == attrs["tokenizer"] and a["json"] == attrs["json"], path
    return np.concatenate(parts), attrs


for name, eot_text, shards, val in (("gpt2.json", "<|endoftext|>", 1, "0"), ("llama3.json", "<|end_of_text|>", 3, "0.2"),
                                    ("qwen2.json", "<|endoftext|>", 2, "0.1")):
    path = os.path.join(fixtures, name)
    mine = [c for c in cases if c["tokenizer"] == name]
    docs = os.path.join(work, name + "-docs")
    os.makedirs(docs)
    for i, c in enumerate(mine):  # one file per case, the empty string included
        open(os.path.join(docs, f"{i:03d}.txt"), "wb").write(c["text"].encode("utf-8"))
    vocab = json.load(open(path, encoding="utf-8"))
    eot = next(t["id"] for t in vocab["added_tokens"] if t["content"] == eot_text)
    prefix = os.path.join(work, name.split(".")[0])
    out = run("tokenize", "--input", docs, "--out", prefix, "--tokenizer", "hf:" + path, "--shards", str(shards),
              "--val-fraction", val).stdout
    assert "tokenizer hf" in out, out
    ids, attrs = read_tokens(prefix)
    expected = [i for c in mine for i in c["ids"] + [eot]]
    assert ids.tolist() == expected, f"{name}: ids differ from the library's at {np.argmax(ids != expected)}"
    assert attrs["tokenizer"] == "hf" and attrs["eot"] == eot, attrs
    assert attrs["json"] == open(path, "rb").read(), "the shard holds another tokenizer.json"
    max_id = max(max(vocab["model"]["vocab"].values()), max(t["id"] for t in vocab["added_tokens"]))
    assert attrs["vocab_size"] == max_id + 1, attrs["vocab_size"]

    # inspect decodes the excerpt with the stored tokenizer (the first documents: "", " ", "\n", ...).
    shown = run("inspect", prefix + "-train*.h5").stdout
    assert "tokenizer:     hf (Hugging Face byte-level BPE" in shown and f"eot '{eot_text}'" in shown, shown
    assert f'excerpt:       "{eot_text} {eot_text}\\n{eot_text}Hello, world!{eot_text}' in shown, shown

    # The ids as an llm.c file (and as a headerless nanoGPT file): import-bin with the tokenizer.
    stream = np.array(expected, dtype=np.uint16)
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [20240520, 1, len(stream)]
    llmc, raw = os.path.join(work, name + ".bin"), os.path.join(work, name + ".raw.bin")
    with open(llmc, "wb") as f:
        f.write(header.tobytes() + stream.tobytes())
    stream.tofile(raw)
    for src, extra in ((llmc, []), (raw, ["--raw"])):
        out_prefix = os.path.join(work, os.path.basename(src) + "-imported")
        out = run("import-bin", "--input", src, "--out", out_prefix, "--tokenizer", "hf:" + path, *extra).stdout
        assert f"tokenizer hf (vocab_size {max_id + 1}, eot {eot})" in out, out
        with h5py.File(out_prefix + ".h5", "r") as f:
            assert f["tokens"][...].tolist() == expected and f.attrs["tokenizer"] == "hf"
            assert f["tokenizer/json"][...].tobytes() == open(path, "rb").read()
        shown = run("inspect", out_prefix + ".h5").stdout
        assert f'excerpt:       "{eot_text} {eot_text}\\n' in shown, shown

# Bad input: each one line, exit 2.
gpt2 = os.path.join(fixtures, "gpt2.json")
docs = os.path.join(work, "gpt2.json-docs")
good = json.load(open(gpt2, encoding="utf-8"))


def variant(name, edit):
    j = json.loads(json.dumps(good))
    edit(j)
    p = os.path.join(work, name)
    open(p, "w", encoding="utf-8").write(json.dumps(j))
    return p


def set_model_type(j):
    j["model"]["type"] = "WordPiece"


def unknown_merge(j):
    j["model"]["merges"][7] = ["Ġt", "notatoken"]


def no_eot(j):
    j["added_tokens"] = []
    del j["model"]["vocab"]["<|endoftext|>"]


malformed = os.path.join(work, "malformed.json")
open(malformed, "w").write('{"model": {"type": "BPE", "vocab": {')
out = os.path.join(work, "bad", "x")
tok = ["tokenize", "--input", docs, "--out", out, "--tokenizer"]
bad(["--tokenizer", "missing.json", "does not exist"], *tok, "hf:" + os.path.join(work, "missing.json"))
bad(["malformed.json", "not valid JSON"], *tok, "hf:" + malformed)
bad(["not byte-level BPE", "WordPiece"], *tok, "hf:" + variant("wordpiece.json", set_model_type))
bad(["merge 7", "'notatoken' is not in the vocabulary"], *tok, "hf:" + variant("merge.json", unknown_merge))
bad(["neither <|endoftext|> nor <|end_of_text|>", "--eot-token"], *tok, "hf:" + variant("noeot.json", no_eot))
bad(["no token '<|nope|>'"], *tok, "hf:" + gpt2, "--eot-token", "<|nope|>")
bad(["--vocab-size", "tokenizer.json"], *tok, "hf:" + gpt2, "--vocab-size", "50257")
bad(["--tokenizer", "byte, bpe or hf:PATH"], *tok, "gpt2")
bad(["--eot-token", "only for --tokenizer hf"], *tok, "bpe", "--vocab-size", "300", "--eot-token", "x")
llmc = os.path.join(work, "gpt2.json.bin")
imp = ["import-bin", "--input", llmc, "--out", out]
bad(["--vocab-size", "50257", "1502 ids"], *imp, "--tokenizer", "hf:" + gpt2, "--vocab-size", "50257")
bad(["--eot", "ends documents with id 0"], *imp, "--tokenizer", "hf:" + gpt2, "--eot", "5")
bad(["--tokenizer", "expected hf:PATH"], *imp, "--tokenizer", gpt2)
bad(["malformed.json", "not valid JSON"], *imp, "--tokenizer", "hf:" + malformed)
big = os.path.join(work, "big.bin")
np.array([1, 2, 40000], dtype=np.uint16).tofile(big)
bad(["holds token 40000", "1502"], "import-bin", "--input", big, "--out", out, "--raw", "--tokenizer", "hf:" + gpt2)
assert not glob.glob(os.path.join(work, "bad", "*.h5")), "a failed command left shards behind"
print("check_hf_tokens: ok")
