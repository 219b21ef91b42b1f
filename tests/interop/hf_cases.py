"""strata-convert against Hugging Face transformers (GPT-2, Llama), one case per CTest test:

- fixture (Debian's python: numpy, h5py, torch): tests/fixtures/hf/ (made by transformers with
  tools/interop/make_gpt2_fixtures.py) -> import-hf -> `train --eval-only` gives transformers'
  loss within 1e-5 relative on 1 rank, with --tp 2 and with --pp 2; `strata-convert logits`
  gives transformers' logits within 1e-5; the imported tensors are the safetensors' (Conv1D
  weights transposed); export-hf -> the same safetensors tensors bit for bit, re-import -> the same
  checkpoint tensors; the sharded bfloat16 variant imports (index, shards, exact widening) and
  exports back to bit-identical BF16 shards.
- bad_inputs: each bad model directory or file is one line on stderr, exit 2.
- live (label interop; needs transformers: run by STRATA_INTEROP_PYTHON, SKIP 77 without it): a
  random GPT-2 made now -> import -> eval loss equals transformers'; it trains on (tp 2 x pp 2,
  4 ranks) and exports to logits transformers reproduces; Strata-trained models
  (tanh GELU tied; exact GELU untied) -> export-hf -> from_pretrained logits equal Strata's within
  1e-5, the exact one's config says "gelu"; import -> export is bit-identical (safetensors' own
  reader).
- llama_fixture (Debian's python): tests/fixtures/hf/llama-tiny/ (a LlamaForCausalLM with
  grouped-query attention and Llama 3.1's rope scaling, made by tools/interop/make_llama_fixtures.py)
  -> import-hf -> logits and `train --eval-only` loss (1 rank, tp 2) equal transformers' within
  1e-5; the imported tensors are the safetensors' by name, untransposed; export-hf gives them back
  bit for bit.
- llama_live (label interop): a random Llama (GQA, tied and untied) made now -> import -> logits
  equal transformers'; Strata-trained llamas (tp 2, kv heads 1 and 2, rope scaling) -> export-hf ->
  from_pretrained logits equal Strata's within 1e-5.
"""
import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys

import h5py
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "fixtures", "hf")
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
SKIP = 77


def run(cmd, timeout=300):
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=ENV, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def ok(cmd, timeout=300):
    rc, out, err = run(cmd, timeout)
    assert rc == 0, f"{' '.join(map(str, cmd))}\nrc={rc}\n{out}\n{err}"
    return out


def read_safetensors(path):
    """{name: (dtype, shape, raw bytes)} by the format's definition (8-byte length, JSON, data)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {k: (v["dtype"], tuple(v["shape"]), data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items()}


def read_model_dir(d):
    """Every tensor of a model directory (single file or shards)."""
    out = {}
    for name in sorted(os.listdir(d)):
        if name.endswith(".safetensors"):
            out.update(read_safetensors(os.path.join(d, name)))
    return out


def as_f32(dtype, shape, raw):
    if dtype == "F32":
        return np.frombuffer(raw, "<f4").reshape(shape)
    assert dtype == "BF16", dtype
    return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)


def read_checkpoint(path):
    """({name: array} of /model, root attributes)."""
    tensors = {}
    with h5py.File(path, "r") as f:
        f["model"].visititems(lambda k, o: tensors.update({k: o[...]}) if isinstance(o, h5py.Dataset) else None)
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
    return tensors, attrs


def strata_name(hf):
    """HF GPT-2 name -> (Strata name, transposed)."""
    name = hf.removeprefix("transformer.")
    m = re.match(r"h\.(\d+)\.(.*)", name)
    if m:
        name = f"h{m.group(1)}.{m.group(2)}"
    conv1d = re.search(r"(c_attn|c_proj|c_fc)\.weight$", name) is not None
    return name.replace(".", "/"), conv1d


def llama_strata_name(hf):
    """HF Llama name -> Strata name (nothing is transposed)."""
    name = hf.removeprefix("model.").replace("embed_tokens.", "wte.")
    m = re.match(r"layers\.(\d+)\.(.*)", name)
    if m:
        return f"layers.{m.group(1)}/" + m.group(2).replace(".", "/")
    return name.replace(".", "/")


def assert_imported(hf_tensors, ckpt):
    """The checkpoint holds exactly the HF tensors (widened to f32, Conv1D transposed)."""
    tensors, _ = read_checkpoint(ckpt)
    expected = {}
    for hf, (dtype, shape, raw) in hf_tensors.items():
        name, transposed = strata_name(hf)
        v = as_f32(dtype, shape, raw)
        expected[name] = v.T if transposed else v
    assert sorted(tensors) == sorted(expected), (sorted(tensors), sorted(expected))
    for k, v in expected.items():
        assert tensors[k].dtype == np.float32 and np.array_equal(tensors[k], v), k


def write_tokens(path, ids, vocab):
    with h5py.File(path, "w") as f:
        f.create_dataset("tokens", data=np.asarray(ids, np.uint16))
        f.attrs["kind"] = "tokens"
        f.attrs["vocab_size"] = np.int64(vocab)
        f.attrs["num_tokens"] = np.int64(len(ids))
        f.attrs["tokenizer"] = "external"
        f.attrs["eot"] = np.int64(vocab - 1)
    return path


def eval_loss(a, ckpt, data, batch, ranks=1, layout=(), tag="eval"):
    """train --eval-only's loss (full precision, from its --metrics line)."""
    metrics = os.path.join(a.workdir, f"{tag}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    ok([a.mpirun, "-np", ranks, "--oversubscribe", "--bind-to", "none", a.train, "--init-from", ckpt, "--data", data,
        "--eval-only", "--global-batch", batch, "--metrics", metrics, *layout])
    lines = [json.loads(l) for l in open(metrics)]
    return [l for l in lines if l.get("eval") == "eval-only"][-1]["eval_loss"]


def strata_logits(a, ckpt, ids, vocab):
    out = os.path.join(a.workdir, "logits.f32")
    ok([a.convert, "logits", "--checkpoint", ckpt, "--tokens", ",".join(map(str, ids)), "--out", out])
    return np.fromfile(out, "<f4").reshape(len(ids), vocab)


def rel(x, y):
    return abs(x - y) / abs(y)


# ---- fixture -----------------------------------------------------------------------------------


def case_fixture(a):
    w = a.workdir
    ref = json.load(open(os.path.join(FIXTURES, "reference.json")))
    tiny, sharded = os.path.join(FIXTURES, "gpt2-tiny"), os.path.join(FIXTURES, "gpt2-tiny-sharded")
    ck = os.path.join(w, "tiny.h5")
    ok([a.convert, "import-hf", "--model-dir", tiny, "--out", ck])
    hf = read_model_dir(tiny)
    assert_imported(hf, ck)
    _, attrs = read_checkpoint(ck)
    assert "activation = gelu_tanh" in attrs["config"] and "norm-eps = 0.001" in attrs["config"], attrs["config"]

    # Loss: 1 rank, tensor-parallel, pipeline; transformers' within 1e-5, the layouts equal to rounding.
    data = write_tokens(os.path.join(w, "tokens.h5"), ref["tokens"], 100)
    one = eval_loss(a, ck, data, ref["windows"])
    tp = eval_loss(a, ck, data, ref["windows"], 2, ["--tp", "2"], "tp")
    pp = eval_loss(a, ck, data, ref["windows"], 2, ["--pp", "2", "--micro-batch", "2"], "pp")
    print(f"eval loss: transformers {ref['loss']:.8f}, Strata 1 rank {one:.8f}, tp 2 {tp:.8f}, pp 2 {pp:.8f}")
    assert rel(one, ref["loss"]) <= 1e-5, (one, ref["loss"])
    assert rel(tp, one) <= 1e-6 and rel(pp, one) <= 1e-6, (one, tp, pp)

    # Logits of the first window.
    want = np.load(os.path.join(FIXTURES, "logits.npy"))
    got = strata_logits(a, ck, ref["tokens"][:ref["seq_len"]], 100)
    print(f"logits: max |Strata - transformers| {np.abs(got - want).max():.3g} (max |logit| {np.abs(want).max():.3g})")
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5)

    # export -> the same safetensors tensors; re-import -> the same checkpoint.
    out = os.path.join(w, "exported")
    shutil.rmtree(out, ignore_errors=True)
    ok([a.convert, "export-hf", "--checkpoint", ck, "--out", out])
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"], os.listdir(out)
    assert read_safetensors(os.path.join(out, "model.safetensors")) == hf
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["activation_function"] == "gelu_new" and config["layer_norm_epsilon"] == 0.001, config
    ck2 = os.path.join(w, "tiny2.h5")
    ok([a.convert, "import-hf", "--model-dir", out, "--out", ck2])
    t1, t2 = read_checkpoint(ck)[0], read_checkpoint(ck2)[0]
    assert sorted(t1) == sorted(t2) and all(np.array_equal(t1[k], t2[k]) for k in t1)

    # The sharded bfloat16 copy: its index and shards, widened exactly; exported back bit for bit.
    ck_bf16 = os.path.join(w, "tiny-bf16.h5")
    ok([a.convert, "import-hf", "--model-dir", sharded, "--out", ck_bf16])
    hf16 = read_model_dir(sharded)
    assert_imported(hf16, ck_bf16)
    import torch  # Debian's: the bf16 rounding of the f32 fixture, an oracle we did not write
    for name, (dtype, shape, raw) in hf.items():
        rounded = torch.from_numpy(as_f32(dtype, shape, raw).copy()).to(torch.bfloat16).view(torch.int16).numpy()
        assert hf16[name][0] == "BF16" and rounded.tobytes() == hf16[name][2], name
    assert read_checkpoint(ck_bf16)[1]["precision"] == "bf16"
    out16 = os.path.join(w, "exported-bf16")
    shutil.rmtree(out16, ignore_errors=True)
    ok([a.convert, "export-hf", "--checkpoint", ck_bf16, "--out", out16, "--shard-size", "20KB"])
    assert sorted(f for f in os.listdir(out16) if f.endswith(".safetensors")) == \
        sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors")), os.listdir(out16)
    assert read_model_dir(out16) == hf16
    index = json.load(open(os.path.join(out16, "model.safetensors.index.json")))
    assert index["weight_map"] == json.load(open(os.path.join(sharded, "model.safetensors.index.json")))["weight_map"]
    print(f"versions of the fixture's makers: {ref['versions']}")

    # The tokenizer beside the weights. A model trained on text tokenized with a tokenizer.json
    # (its vocabulary: 1502 ids) takes it from its training data by default, or as given.
    hf_tokenizer = os.path.join(FIXTURES, "gpt2.json")
    with open(os.path.join(w, "text.txt"), "w") as f:
        f.write(open("/usr/share/common-licenses/GPL-3").read()[:8000])
    hf_data = os.path.join(w, "hf")
    ok([a.data_tool, "tokenize", "--input", os.path.join(w, "text.txt"), "--out", hf_data, "--tokenizer",
        "hf:" + hf_tokenizer, "--val-fraction", "0"])
    run_dir = os.path.join(w, "ck-hf-tokens")
    shutil.rmtree(run_dir, ignore_errors=True)
    ok([a.train, "--model", "gpt", "--layers", "1", "--heads", "2", "--embed", "16", "--seq-len", "16", "--data",
        hf_data + "-train.h5", "--steps", "1", "--global-batch", "4", "--checkpoint-dir", run_dir])
    trained = os.path.join(run_dir, "step-00000001.h5")
    for flag in ([], ["--tokenizer", hf_tokenizer], ["--tokenizer", hf_data + "-train.h5"]):
        out = os.path.join(w, "exported-tokenizer")
        shutil.rmtree(out, ignore_errors=True)
        line = ok([a.convert, "export-hf", "--checkpoint", trained, "--out", out] + flag)
        assert open(os.path.join(out, "tokenizer.json"), "rb").read() == open(hf_tokenizer, "rb").read(), flag
        tokenizer_config = json.load(open(os.path.join(out, "tokenizer_config.json")))
        assert tokenizer_config["eos_token"] == "<|endoftext|>" and tokenizer_config["model_max_length"] == 16
        config = json.load(open(os.path.join(out, "config.json")))
        assert config["eos_token_id"] == config["bos_token_id"] == 0, config  # <|endoftext|> is id 0 there
    assert "tokenizer of " + hf_data + "-train.h5" in line, line
    none = os.path.join(w, "exported-none")
    shutil.rmtree(none, ignore_errors=True)
    assert "no tokenizer (--tokenizer none)" in ok(
        [a.convert, "export-hf", "--checkpoint", trained, "--out", none, "--tokenizer", "none"])
    assert sorted(os.listdir(none)) == ["config.json", "model.safetensors"], os.listdir(none)
    # Token data of another kind, or a tokenizer larger than the model: one line.
    expect_error(a, ["export-hf", "--checkpoint", ck, "--out", os.path.join(w, "x-ext"), "--tokenizer", data],
                 r"--tokenizer .*: its tokenizer is Strata's external, not a Hugging Face tokenizer.json")
    expect_error(a, ["export-hf", "--checkpoint", ck, "--out", os.path.join(w, "x-big"), "--tokenizer", hf_tokenizer],
                 r"has 1502 ids but the model's vocabulary 100")
    # No training data recorded (an imported model): none, and the line says why.
    shutil.rmtree(os.path.join(w, "x-none"), ignore_errors=True)
    assert "no tokenizer: the checkpoint's training data is not recorded" in ok(
        [a.convert, "export-hf", "--checkpoint", ck, "--out", os.path.join(w, "x-none")])


# ---- bad inputs --------------------------------------------------------------------------------


def expect_error(a, args, pattern):
    rc, out, err = run([a.convert] + args)
    lines = [l for l in err.splitlines() if l.strip()]
    assert rc == 2, f"{args}: expected exit 2, got {rc}\n{out}\n{err}"
    assert len(lines) == 1 and lines[0].startswith("strata-convert: error: "), f"{args}: not one line:\n{err}"
    assert re.search(pattern, lines[0]), f"{args}: {lines[0]!r} does not match {pattern!r}"
    print(f"ok: {lines[0]}")


def case_bad_inputs(a):
    w = a.workdir
    tiny, sharded = os.path.join(FIXTURES, "gpt2-tiny"), os.path.join(FIXTURES, "gpt2-tiny-sharded")

    def copy(src, name, edit_config=None):
        d = os.path.join(w, name)
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(src, d)
        if edit_config:
            path = os.path.join(d, "config.json")
            config = json.load(open(path))
            edit_config(config)
            json.dump(config, open(path, "w"))
        return d

    out = os.path.join(w, "out.h5")

    def imp(d, pattern):
        expect_error(a, ["import-hf", "--model-dir", d, "--out", out], pattern)
        assert not os.path.exists(out) and not os.path.exists(out + ".tmp")

    d = copy(sharded, "missing-shard")
    os.remove(os.path.join(d, "model-00003-of-00004.safetensors"))
    imp(d, r"names shard 'model-00003-of-00004.safetensors', which is missing")
    imp(copy(sharded, "dtype", lambda c: c.update(dtype="float32")), r"is BF16 but config.json's torch_dtype is float32")
    imp(copy(tiny, "shape", lambda c: c.update(n_positions=64)), r"'transformer.wpe.weight' has shape \[32, 32\] but "
        r"config.json implies \[64, 32\]")
    imp(copy(tiny, "arch", lambda c: c.update(architectures=["LlamaForCausalLM"])), r"'architectures'.*LlamaForCausalLM")
    imp(copy(tiny, "inverse", lambda c: c.update(scale_attn_by_inverse_layer_idx=True)),
        r"'scale_attn_by_inverse_layer_idx' is true")
    imp(copy(tiny, "upcast", lambda c: c.update(reorder_and_upcast_attn=True)), r"'reorder_and_upcast_attn' is true")
    imp(copy(tiny, "inner", lambda c: c.update(n_inner=64)), r"'n_inner' is 64")
    imp(copy(tiny, "act", lambda c: c.update(activation_function="relu")), r"'activation_function' is 'relu'")
    imp(copy(tiny, "layers", lambda c: c.update(n_layer=3)), r"no tensor 'transformer.h.2.ln_1.weight'")
    imp(copy(tiny, "fewer", lambda c: c.update(n_layer=1)), r"holds 'transformer.h.1.attn.c_attn.bias', which is not")

    st = os.path.join(tiny, "model.safetensors")
    raw = open(st, "rb").read()
    d = copy(tiny, "truncated-header")
    open(os.path.join(d, "model.safetensors"), "wb").write(raw[:8 + 40])
    imp(d, r"declares a header of \d+ bytes but holds only 40")
    d = copy(tiny, "short")
    open(os.path.join(d, "model.safetensors"), "wb").write(raw[:5])
    imp(d, r"shorter than its 8-byte header length")
    d = copy(tiny, "beyond")
    open(os.path.join(d, "model.safetensors"), "wb").write(struct.pack("<Q", 1 << 40) + raw[8:])
    imp(d, r"declares a header of 1099511627776 bytes")
    d = copy(tiny, "truncated-data")
    open(os.path.join(d, "model.safetensors"), "wb").write(raw[:len(raw) - 1000])
    imp(d, r"ends at byte \d+ of the data but the file holds \d+ \(truncated\)")
    d = copy(tiny, "not-json")
    open(os.path.join(d, "model.safetensors"), "wb").write(struct.pack("<Q", 4) + b"{{{{")
    imp(d, r"header is not a JSON object")
    d = copy(tiny, "no-weights")
    os.remove(os.path.join(d, "model.safetensors"))
    imp(d, r"has neither model.safetensors nor model.safetensors.index.json")
    d = copy(tiny, "bad-config")
    open(os.path.join(d, "config.json"), "w").write("{")
    imp(d, r"config.json is not a JSON object")
    imp(os.path.join(w, "nowhere"), r"is not a directory")

    expect_error(a, ["export-hf", "--checkpoint", os.path.join(w, "nowhere.h5"), "--out", os.path.join(w, "x")],
                 r"does not exist")
    ck = os.path.join(w, "tiny.h5")
    ok([a.convert, "import-hf", "--model-dir", tiny, "--out", ck])
    expect_error(a, ["export-hf", "--checkpoint", ck, "--out", os.path.join(w, "x"), "--dtype", "F64"],
                 r"--dtype must be F32, BF16 or F16")
    expect_error(a, ["export-hf", "--checkpoint", ck, "--out", os.path.join(w, "x"), "--shard-size", "5XB"],
                 r"unknown unit 'XB'")
    used = os.path.join(w, "used")
    shutil.rmtree(used, ignore_errors=True)
    ok([a.convert, "export-hf", "--checkpoint", ck, "--out", used])
    expect_error(a, ["export-hf", "--checkpoint", ck, "--out", used], r"already holds model weights")
    expect_error(a, ["frobnicate"], r"unknown command 'frobnicate'")
    expect_error(a, ["logits", "--checkpoint", ck, "--tokens", "1,x", "--out", os.path.join(w, "l")],
                 r"--tokens must be comma-separated")
    # The imported file is a model, not a training state.
    rc, _, err = run([a.train, "--resume", ck, "--data", write_tokens(os.path.join(w, "t.h5"), list(range(65)), 100),
                      "--steps", "1", "--global-batch", "2", "--model", "gpt", "--layers", "2", "--heads", "4", "--embed", "32", "--seq-len",
                      "32", "--vocab", "100", "--activation", "gelu_tanh", "--norm-eps", "1e-3"])
    assert rc == 2 and "holds no training state" in err, err


# ---- live: transformers now --------------------------------------------------------------------


def case_live(a):
    try:
        import torch
        import transformers
        from safetensors.numpy import load_file
        from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
    except ImportError as e:
        print(f"SKIP: {sys.executable} lacks transformers or safetensors ({e})")
        sys.exit(SKIP)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, numpy {np.__version__}")
    w = a.workdir
    vocab, t, windows = 127, 16, 6  # odd, as GPT-2's 50257: tp 2 pads it to 2 x 64 rows
    ids = np.random.default_rng(3).integers(0, vocab, windows * t + 1).tolist()
    data = write_tokens(os.path.join(w, "tokens.h5"), ids, vocab)

    # 1. A random GPT-2 -> import -> eval loss equals transformers'.
    torch.manual_seed(7)
    config = GPT2Config(vocab_size=vocab, n_positions=t, n_embd=48, n_layer=3, n_head=6, layer_norm_epsilon=1e-5,
                        activation_function="gelu_new", resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
                        initializer_range=0.1, bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(config).eval()
    src = os.path.join(w, "random-gpt2")
    shutil.rmtree(src, ignore_errors=True)
    model.save_pretrained(src, safe_serialization=True)
    ck = os.path.join(w, "random.h5")
    ok([a.convert, "import-hf", "--model-dir", src, "--out", ck])
    x = torch.tensor(ids[:-1]).view(windows, t)
    y = torch.tensor(ids[1:]).view(windows, t)
    with torch.no_grad():
        want = float(torch.nn.functional.cross_entropy(model(input_ids=x).logits.reshape(-1, vocab), y.reshape(-1)))
    got = eval_loss(a, ck, data, windows)
    got_tp = eval_loss(a, ck, data, windows, 2, ["--tp", "2"], "live-tp")
    print(f"random GPT-2: transformers loss {want:.8f}, Strata {got:.8f} (tp 2 {got_tp:.8f}), "
          f"relative {rel(got, want):.2g}")
    assert rel(got, want) <= 1e-5 and rel(got_tp, want) <= 1e-5

    # 2. import -> export: bit-identical tensors by safetensors' own reader.
    back = os.path.join(w, "random-back")
    shutil.rmtree(back, ignore_errors=True)
    ok([a.convert, "export-hf", "--checkpoint", ck, "--out", back])
    orig, again = load_file(os.path.join(src, "model.safetensors")), load_file(os.path.join(back, "model.safetensors"))
    assert sorted(orig) == sorted(again), (sorted(orig), sorted(again))
    for k in orig:
        assert orig[k].dtype == again[k].dtype and orig[k].tobytes() == again[k].tobytes(), k

    # 3. Continued pretraining of the imported model on 4 ranks (tp 2 x pp 2), no --model given;
    # the checkpoint from padded shards holds the 127 real rows (from_pretrained checks the shape).
    run_dir = os.path.join(w, "ck-continued")
    shutil.rmtree(run_dir, ignore_errors=True)
    ok([a.mpirun, "-np", "4", "--oversubscribe", "--bind-to", "none", a.train, "--init-from", ck, "--data", data,
        "--tp", "2", "--pp", "2", "--steps", "4", "--global-batch", "4", "--micro-batch", "2", "--optimizer", "adamw",
        "--lr", "0.01", "--checkpoint-dir", run_dir])
    continued = os.path.join(run_dir, "step-00000004.h5")
    _, attrs = read_checkpoint(continued)
    assert "activation = gelu_tanh" in attrs["config"], attrs["config"]
    out = os.path.join(w, "hf-continued")
    shutil.rmtree(out, ignore_errors=True)
    ok([a.convert, "export-hf", "--checkpoint", continued, "--out", out])
    hf_model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        theirs = hf_model(input_ids=torch.tensor([ids[:t]])).logits[0].numpy()
    mine = strata_logits(a, continued, ids[:t], vocab)
    print(f"continued (tp 2 x pp 2): max |Strata - transformers| logits {np.abs(mine - theirs).max():.3g}")
    assert np.allclose(mine, theirs, rtol=1e-5, atol=1e-5)
    assert not np.allclose(read_checkpoint(continued)[0]["wte/weight"], read_checkpoint(ck)[0]["wte/weight"])

    # 4. Trained on text tokenized with a Hugging Face tokenizer: export-hf takes it from the
    # training data, and AutoTokenizer loads the directory and encodes as the library does.
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer
    hf_tokenizer = os.path.join(FIXTURES, "gpt2.json")
    text = os.path.join(w, "text.txt")
    with open(text, "w") as f:
        f.write(open("/usr/share/common-licenses/GPL-3").read()[:20000])
    ok([a.data_tool, "tokenize", "--input", text, "--out", os.path.join(w, "hf"), "--tokenizer", "hf:" + hf_tokenizer,
        "--val-fraction", "0"])
    run_dir = os.path.join(w, "ck-hf-tokens")
    shutil.rmtree(run_dir, ignore_errors=True)
    ok([a.train, "--model", "gpt", "--layers", "1", "--heads", "2", "--embed", "16", "--seq-len", t, "--data",
        os.path.join(w, "hf-train.h5"), "--steps", "2", "--global-batch", "4", "--checkpoint-dir", run_dir])
    out = os.path.join(w, "hf-with-tokenizer")
    shutil.rmtree(out, ignore_errors=True)
    ok([a.convert, "export-hf", "--checkpoint", os.path.join(run_dir, "step-00000002.h5"), "--out", out])
    loaded = AutoTokenizer.from_pretrained(out)
    sample = "Everyone is permitted to copy and distribute verbatim copies — café 東京 😀  42"
    assert loaded.encode(sample) == Tokenizer.from_file(hf_tokenizer).encode(sample).ids, loaded.encode(sample)
    assert loaded.eos_token == "<|endoftext|>" and AutoModelForCausalLM.from_pretrained(out).config.eos_token_id == 0
    print(f"export-hf with the training data's tokenizer: AutoTokenizer encodes as tokenizers does "
          f"({len(loaded.encode(sample))} ids)")

    # 5. Strata-trained models -> export -> from_pretrained logits equal Strata's.
    for activation, tie in (("gelu_tanh", "true"), ("gelu", "false")):
        run_dir = os.path.join(w, f"ck-{activation}")
        shutil.rmtree(run_dir, ignore_errors=True)
        ok([a.mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none", a.train, "--model", "gpt", "--layers", "2",
            "--heads", "4", "--embed", "32", "--seq-len", t, "--vocab", vocab, "--activation", activation,
            "--tie-embeddings", tie, "--norm-eps", "1e-4", "--data", data, "--steps", "6", "--global-batch", "4",
            "--optimizer", "adamw", "--lr", "0.01", "--tp", "2", "--checkpoint-dir", run_dir])
        trained = os.path.join(run_dir, "step-00000006.h5")
        out = os.path.join(w, f"hf-{activation}")
        shutil.rmtree(out, ignore_errors=True)
        ok([a.convert, "export-hf", "--checkpoint", trained, "--out", out])
        exported = json.load(open(os.path.join(out, "config.json")))
        assert exported["activation_function"] == ("gelu_new" if activation == "gelu_tanh" else "gelu"), exported
        hf_model = AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            theirs = hf_model(input_ids=torch.tensor([ids[:t]])).logits[0].numpy()
        mine = strata_logits(a, trained, ids[:t], vocab)
        diff = np.abs(mine - theirs).max()
        print(f"trained ({activation}, tied {tie}): max |Strata - transformers| logits {diff:.3g}")
        assert np.allclose(mine, theirs, rtol=1e-5, atol=1e-5), diff


# ---- llama ---------------------------------------------------------------------------------------


def case_llama_fixture(a):
    w, src = a.workdir, os.path.join(FIXTURES, "llama-tiny")
    ref = json.load(open(os.path.join(FIXTURES, "llama-reference.json")))
    ids, t, windows, vocab = ref["ids"], ref["t"], ref["windows"], ref["vocab"]
    ck = os.path.join(w, "llama-tiny.h5")
    ok([a.convert, "import-hf", "--model-dir", src, "--out", ck])
    hf_tensors = read_model_dir(src)
    tensors, attrs = read_checkpoint(ck)
    assert attrs["model"] == "llama" and "kv-heads = 2" in attrs["config"] and "rope-scaling = 8" in attrs["config"], attrs
    assert sorted(tensors) == sorted(llama_strata_name(k) for k in hf_tensors), sorted(tensors)
    for k, (dtype, shape, raw) in hf_tensors.items():
        assert np.array_equal(tensors[llama_strata_name(k)], as_f32(dtype, shape, raw)), k
    want_logits = np.load(os.path.join(FIXTURES, "llama-logits.npy"))
    mine = strata_logits(a, ck, ids[:t], vocab)
    print(f"llama-tiny: max |Strata - transformers| logits {np.abs(mine - want_logits).max():.3g}")
    assert np.allclose(mine, want_logits, rtol=1e-5, atol=1e-5)
    data = write_tokens(os.path.join(w, "llama-tokens.h5"), ids, vocab)
    got = eval_loss(a, ck, data, windows, tag="llama-eval")
    got_tp = eval_loss(a, ck, data, windows, 2, ["--tp", "2"], "llama-eval-tp")
    print(f"llama-tiny: transformers loss {ref['loss']:.8f}, Strata {got:.8f} (tp 2 {got_tp:.8f})")
    assert rel(got, ref["loss"]) <= 1e-5 and rel(got_tp, ref["loss"]) <= 1e-5
    back = os.path.join(w, "llama-back")
    shutil.rmtree(back, ignore_errors=True)
    ok([a.convert, "export-hf", "--checkpoint", ck, "--out", back])
    assert read_model_dir(back) == hf_tensors
    exported = json.load(open(os.path.join(back, "config.json")))
    assert exported["num_key_value_heads"] == 2 and exported["rope_scaling"]["factor"] == 8, exported


def case_llama_live(a):
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        print(f"SKIP: {sys.executable} lacks transformers ({e})")
        sys.exit(SKIP)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    w = a.workdir
    vocab, t = 127, 16
    ids = np.random.default_rng(5).integers(0, vocab, 4 * t + 1).tolist()
    data = write_tokens(os.path.join(w, "llama-tokens.h5"), ids, vocab)

    def hf_logits(model_dir):
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids[:t]])).logits[0].numpy()

    # 1. Random Llamas (multi-query and grouped-query, tied and untied) -> import -> logits.
    for kv, tie in ((1, True), (2, False)):
        torch.manual_seed(11 + kv)
        config = LlamaConfig(vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                             num_attention_heads=6, num_key_value_heads=kv, max_position_embeddings=t,
                             rms_norm_eps=1e-6, rope_theta=500000.0, tie_word_embeddings=tie, initializer_range=0.1,
                             bos_token_id=None, eos_token_id=None, pad_token_id=None)
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * 0.2)
        src = os.path.join(w, f"random-llama-{kv}")
        shutil.rmtree(src, ignore_errors=True)
        model.save_pretrained(src, safe_serialization=True)
        ck = os.path.join(w, f"random-llama-{kv}.h5")
        ok([a.convert, "import-hf", "--model-dir", src, "--out", ck])
        theirs, mine = hf_logits(src), strata_logits(a, ck, ids[:t], vocab)
        print(f"random llama (kv heads {kv}, tied {tie}): max |Strata - transformers| logits "
              f"{np.abs(mine - theirs).max():.3g}")
        assert np.allclose(mine, theirs, rtol=1e-5, atol=1e-5)

    # 2. Strata-trained llamas (tp 2; kv heads 1 replicated over tp, and 2 split) -> export-hf ->
    # from_pretrained gives Strata's logits.
    for kv, scaling, tie in ((1, "0", "true"), (2, "8", "false")):
        run_dir = os.path.join(w, f"ck-llama-{kv}")
        shutil.rmtree(run_dir, ignore_errors=True)
        ok([a.mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none", a.train, "--model", "llama", "--layers", "2",
            "--heads", "4", "--kv-heads", kv, "--embed", "32", "--ffn-hidden", "64", "--seq-len", t, "--vocab", vocab,
            "--rope-theta", "10000", "--rope-scaling", scaling, "--tie-embeddings", tie, "--norm-eps", "1e-4",
            "--data", data, "--steps", "6", "--global-batch", "4", "--optimizer", "adamw", "--lr", "0.01", "--tp", "2",
            "--checkpoint-dir", run_dir])
        trained = os.path.join(run_dir, "step-00000006.h5")
        out = os.path.join(w, f"hf-llama-{kv}")
        shutil.rmtree(out, ignore_errors=True)
        ok([a.convert, "export-hf", "--checkpoint", trained, "--out", out])
        theirs, mine = hf_logits(out), strata_logits(a, trained, ids[:t], vocab)
        diff = np.abs(mine - theirs).max()
        print(f"trained llama (kv heads {kv}, rope scaling {scaling}, tied {tie}): max |Strata - transformers| "
              f"logits {diff:.3g}")
        assert np.allclose(mine, theirs, rtol=1e-5, atol=1e-5), diff


def main():
    cases = {k[5:]: v for k, v in globals().items() if k.startswith("case_")}
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=sorted(cases))
    p.add_argument("--convert", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--data-tool", required=True, help="strata-data")
    p.add_argument("--mpirun", default="mpirun")
    p.add_argument("--workdir", required=True)
    p.add_argument("--interop-python", help="live: the python with transformers (re-runs this file with it)")
    a = p.parse_args()
    if a.case in ("live", "llama_live") and a.interop_python:  # run again by that python, without this flag
        if not os.path.exists(a.interop_python):
            print(f"SKIP: STRATA_INTEROP_PYTHON {a.interop_python} does not exist")
            sys.exit(SKIP)
        i = sys.argv.index("--interop-python")
        args = [a.interop_python, os.path.abspath(__file__)] + sys.argv[1:i] + sys.argv[i + 2:]
        sys.exit(subprocess.run(args).returncode)
    a.workdir = os.path.join(a.workdir, a.case)
    os.makedirs(a.workdir, exist_ok=True)
    cases[a.case](a)
    print(f"{a.case}: ok")


if __name__ == "__main__":
    main()
