"""Live comparison with the Hugging Face `tokenizers` library: strata-data tokenize
--tokenizer hf:... on a few MB of Debian documentation must give, per document, exactly the
library's encode(doc, add_special_tokens=False) ids followed by the end-of-text id (the shards
read back with h5py). Tokenizers: GPT-2 style (ByteLevel with its built-in regex), the same with
add_prefix_space, Llama 3 style (Split by Llama 3's regex, then ByteLevel; ignore_merges) and
Qwen 2 style (NFC normalizer, Qwen 2's regex), trained here by the library (no network: the real GPT-2 / Llama 3 files cannot be fetched).
Also reports encode throughput, ours (strata-data's own timing) vs the library's (one thread).
STRATA_INTEROP_TOKENIZERS=a.json:b.json adds real tokenizer.json files (e.g. GPT-2's) to the list.
Exit 77 (CTest SKIP) when this python lacks `tokenizers`.
Usage: check_hf_tokenizer.py STRATA_DATA WORKDIR [MEGABYTES]"""
import glob
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the library's timing on one thread, like ours
try:
    import h5py
    import numpy as np
    import tokenizers
    from tokenizers import Tokenizer
except ImportError as e:
    print(f"SKIP: {sys.executable} lacks {e.name} (set STRATA_INTEROP_PYTHON to a python with tokenizers)")
    sys.exit(77)

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "tools", "interop"))
import make_tokenizer_fixtures as fixtures  # noqa: E402

exe, work = sys.argv[1], sys.argv[2]
megabytes = float(sys.argv[3]) if len(sys.argv) > 3 else 4.0
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)


def translations(limit):
    """Message catalogs (gettext .mo) of Debian packages: up to 20 KB from one catalog per
    language (accents, Cyrillic, Greek, Arabic, Hebrew, Indic, Thai, CJK, ...), one document each."""
    import gettext
    by_language = {}
    for p in sorted(glob.glob("/usr/share/locale/*/LC_MESSAGES/*.mo")):
        by_language.setdefault(p.split("/")[4], []).append(p)
    out, total = [], 0
    for language, paths in sorted(by_language.items()):
        for p in paths:
            try:
                catalog = gettext.GNUTranslations(open(p, "rb"))._catalog
            except Exception:  # a catalog python cannot read is simply not used
                continue
            text = "\n".join(v for v in catalog.values() if isinstance(v, str) and v)[:20000]
            if len(text) > 2000 and sum(ord(ch) > 127 for ch in text) > 200:
                out.append(text)
                total += len(text.encode("utf-8"))
                break
        if total >= limit:
            break
    return out


def documents(limit):
    """Debian's text: half licences, fortunes, package copyright files and changelogs (UTF-8
    only), half translations; then the fixture's tricky strings; about `limit` bytes."""
    paths = sorted(glob.glob("/usr/share/common-licenses/*")) + sorted(glob.glob("/usr/share/doc/*/copyright"))
    paths += sorted(glob.glob("/usr/share/doc/*/changelog*.gz")) + sorted(glob.glob("/usr/share/games/fortunes/*.u8"))
    # Long runs that stress the regexes and the merge loop.
    docs, total = list(fixtures.CASES) + [" " * 50000 + "x", "1" * 30000, "=-" * 20000, "\n" * 20000 + " \t" * 10000], 0
    for p in paths:
        if total >= limit / 2:
            break
        try:
            raw = gzip.open(p).read() if p.endswith(".gz") else open(p, "rb").read()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError):
            continue
        docs.append(text)
        total += len(raw)
    more = translations(limit - total)
    # Decomposed (NFD) copies of some: what an NFC normalizer must compose back (Hangul, Vietnamese, ...).
    import unicodedata
    nfd = [unicodedata.normalize("NFD", d) for d in more[::15]]
    return docs + more + [d for d in nfd if d not in more]


docs = documents(megabytes * 1e6)
doc_dir = os.path.join(work, "docs")
os.makedirs(doc_dir)
for i, d in enumerate(docs):
    with open(os.path.join(doc_dir, f"{i:06d}.txt"), "wb") as f:
        f.write(d.encode("utf-8"))
nbytes = sum(len(d.encode("utf-8")) for d in docs)
non_ascii = sum(1 for d in docs for ch in d if ord(ch) > 127)
print(f"{len(docs)} documents, {nbytes / 1e6:.2f} MB ({non_ascii} non-ASCII characters); tokenizers {tokenizers.__version__}")

# The tokenizers: trained by the library on the licences (vocabulary 4000 for more merges).
made = {}
for kind in ("gpt2", "llama3", "qwen2"):
    made[kind] = fixtures.train(kind, vocab_size=4000)
# GPT-2's size: 50257 ids learned from the documents themselves (~50k merges, a 2 MB file).
made["gpt2_50k"] = fixtures.train("gpt2", vocab_size=50257,
                                  files=[os.path.join(doc_dir, f) for f in sorted(os.listdir(doc_dir))])
j = json.loads(made["gpt2"].to_str())
j["pre_tokenizer"]["add_prefix_space"] = True
made["gpt2_prefix_space"] = Tokenizer.from_str(json.dumps(j))

real_paths = {}
# Real tokenizer.json files, when given (no network here): STRATA_INTEROP_TOKENIZERS=a.json:b.json.
for path in filter(None, os.environ.get("STRATA_INTEROP_TOKENIZERS", "").split(":")):
    real = Tokenizer.from_file(path)
    real.no_truncation()  # documents are encoded whole (GPT-2's file truncates to 50 ids)
    made["file:" + os.path.basename(path)] = real
    real_paths["file:" + os.path.basename(path)] = path  # given to strata-data as it is

failed = False
for name, tok in made.items():
    path = real_paths.get(name) or os.path.join(work, name + ".json")
    if name not in real_paths:
        tok.save(path)
    vocab = tok.get_vocab_size()
    eot = tok.token_to_id("<|endoftext|>")
    if eot is None:
        eot = tok.token_to_id("<|end_of_text|>")
    t0 = time.perf_counter()
    expected = [tok.encode(d, add_special_tokens=False).ids for d in docs]
    lib_s = time.perf_counter() - t0
    prefix = os.path.join(work, name)
    p = subprocess.run([exe, "tokenize", "--input", doc_dir, "--out", prefix, "--tokenizer", "hf:" + path,
                        "--val-fraction", "0"], capture_output=True, text=True)
    assert p.returncode == 0, f"{name}: strata-data exit {p.returncode}\n{p.stdout}{p.stderr}"
    m = re.search(r"encoded in ([0-9.]+) s", p.stdout)
    ours_s = float(m.group(1))
    with h5py.File(glob.glob(prefix + "-train*.h5")[0], "r") as f:
        ids = f["tokens"][...].astype(np.int64)
        assert f.attrs["tokenizer"] == "hf" and f.attrs["eot"] == eot
    # Per document: find the first that differs.
    at, bad_docs = 0, []
    for i, e in enumerate(expected):
        got = ids[at:at + len(e) + 1].tolist()
        if got != e + [eot]:
            bad_docs.append(i)
            # Resynchronise on the eot (documents hold no eot of their own except the tricky strings).
            break
        at += len(e) + 1
    ok = not bad_docs and at == len(ids)
    print(f"{name:18s} {'IDENTICAL' if ok else 'DIFFERENT'}: {len(ids)} ids of {vocab}; encode ours {nbytes / 1e6 / ours_s:6.2f} MB/s, "
          f"tokenizers {nbytes / 1e6 / lib_s:6.2f} MB/s (encode per document, one thread)")
    if not ok:
        failed = True
        if bad_docs:
            i = bad_docs[0]
            e = expected[i] + [eot]
            got = ids[at:at + len(e)].tolist()
            k = next((k for k in range(min(len(e), len(got))) if e[k] != got[k]), min(len(e), len(got)))
            print(f"  document {i} ({len(docs[i])} chars): first difference at id {k}: "
                  f"library {e[max(0, k - 3):k + 4]} ours {got[max(0, k - 3):k + 4]}; "
                  f"text near it {tok.decode(e[max(0, k - 3):k + 4])!r}")
sys.exit(1 if failed else 0)
