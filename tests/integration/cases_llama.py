"""The Llama model (--model llama: RMSNorm, rotary positions, SwiGLU, grouped-query attention, no
biases) end to end, as cases_gpt.py and cases_tensor_parallel.py check the GPT: every layout against
one rank (dp, pp with 1F1B and interleaved, tp with query and kv heads split and with kv heads
replicated when tp exceeds them, ZeRO 1-3, recomputation, bf16), AdamW's losses, resume across
layouts, the plan against the measured high-water mark, --dry-run of the published shapes,
strata-sample's KV-cached decoder against a numpy forward, and the bad inputs. A tiny Llama: 2
blocks, 4 query heads over 2 kv heads (or 1: multi-query), width 32, SwiGLU hidden 64, 16-token
windows of the licence texts' bytes (vocabulary padded to 260)."""
import json
import math
import os
import re
import shutil

import h5py
import numpy as np

from cases_async_save import assert_same_checkpoint
from cases_gpt import assert_bf16_close, assert_close, gpt_run, resume, tokenize
from cases_memory import planned_totals
from cases_sample import perturbed_copy, sample
from harness import expect_bad_input, train_ranks

LLAMA = ["--model", "llama", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--embed", "32", "--ffn-hidden", "64",
         "--seq-len", "16", "--rope-theta", "10000", "--vocab", "260", "--threads", "1"]
MQA = [("1" if LLAMA[i - 1] == "--kv-heads" else f) for i, f in enumerate(LLAMA)]
# SGD-momentum for the layout comparisons, at lr 0.01 (loss 5.57 -> 4.26 in 50 steps). At the GPT cases'
# lr 0.1 this model trains at the edge of stability (its loss bumps up now and then) and the layouts'
# rounding differences, 2e-7 of a tensor's max after 3 steps, grow ~1.4x per step to 0.4 at step 50
# (dp 2 vs 1 rank; measured: lr 0.03 gives 8e-5, lr 0.01 3e-6): chaos, not a layout's error.
SGD = ["--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.01"]
UNTIED, TIED = ["--tie-embeddings", "false"], ["--tie-embeddings", "true"]


def run(args, ranks, flags, data, name, model=LLAMA, **kw):
    return gpt_run(args, ranks, flags, data, "llama-" + name, model=model, **kw)


def case_llama_equivalence(args):
    """Every layout trains the same Llama as 1 rank after 50 steps of SGD-momentum, each /model
    tensor within 1e-5 of its max abs value (lr 0.01, see SGD): dp 2, pp 2 (1F1B), pp 2 x dp 2 ZeRO 3, ZeRO 1/2/3 at
    dp 2, tp 2 (kv heads split), tp 4 (2 kv heads, each on 2 ranks), tp 2 x dp 2 ZeRO 2, tp 2 x
    pp 2, the interleaved schedule with and without tp 2, recompute block and full (with tp 2),
    untied; tied for dp 2, pp 2, tp 2 and ZeRO 3; multi-query (1 kv head) under tp 2 and tp 4
    (replicated on every rank). bf16 tp 2 against bf16 on 1 rank within 8 bf16 ulps of each
    tensor's max abs value (see below)."""
    data = tokenize(args, "byte")
    interleaved = ("--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--micro-batch", "4")
    layouts = {
        "dp2": (2, ()),
        "pp2": (2, ("--pp", "2", "--micro-batch", "4")),
        "pp2xdp2-zero3": (4, ("--pp", "2", "--micro-batch", "2", "--zero", "3")),
        "dp2-zero1": (2, ("--zero", "1")),
        "dp2-zero2": (2, ("--zero", "2")),
        "dp2-zero3": (2, ("--zero", "3")),
        "tp2": (2, ("--tp", "2")),
        "tp4": (4, ("--tp", "4")),
        "tp2xdp2-zero2": (4, ("--tp", "2", "--zero", "2")),
        "tp2xpp2": (4, ("--tp", "2", "--pp", "2", "--micro-batch", "4")),
        "pp2-interleaved": (2, interleaved),
        "tp2xpp2-interleaved": (4, ("--tp", "2") + interleaved),
        "recompute-block": (1, ("--recompute", "block")),
        "tp2-recompute-full": (2, ("--tp", "2", "--recompute", "full")),
    }
    for tie, flags, names in (("untied", SGD + UNTIED, list(layouts)),
                              ("tied", SGD + TIED, ["dp2", "pp2", "tp2", "dp2-zero3"])):
        reference, _ = run(args, 1, flags, data, f"{tie}-1")
        assert ("lm_head/weight" in reference) == (tie == "untied"), sorted(reference)
        assert "wpe/weight" not in reference and "layers.0/self_attn/k_proj/weight" in reference, sorted(reference)
        assert reference["layers.0/self_attn/k_proj/weight"].shape == (16, 32)  # 2 kv heads of 8
        for name in names:
            ranks, extra = layouts[name]
            model, out = run(args, ranks, flags + list(extra), data, f"{tie}-{name}")
            assert "its plan says" not in out, out
            assert_close(model, reference, f"llama {tie} {name} vs 1 rank")

    # Multi-query: the one kv head on every tp rank, its gradients summed over them.
    reference, _ = run(args, 1, SGD + UNTIED, data, "mqa-1", model=MQA)
    for name, ranks in (("tp2", 2), ("tp4", 4)):
        model, _ = run(args, ranks, SGD + UNTIED + ["--tp", str(ranks)], data, f"mqa-{name}", model=MQA)
        assert_close(model, reference, f"llama multi-query {name} vs 1 rank")

    # bf16: see cases_tensor_parallel.case_tp_equivalence (a row-parallel sum of bf16 partial products).
    # The worst tensor is the untied embedding's, whose gradient the LM head's bf16 dlogits feed:
    # the rounding of a row's softmax sum scales every probability of the row alike, so it moves
    # that row's bf16 gradients together instead of at random. Measured: 3.0 ulps, and 5.5 once
    # the loss summed each row in 16 fixed lanes instead of the SSE loop's order (7 December);
    # tolerance 8.
    bf16 = ["--precision", "bf16"]
    reference, _ = run(args, 1, SGD + UNTIED + bf16, data, "bf16-1")
    model, _ = run(args, 2, SGD + UNTIED + bf16 + ["--tp", "2"], data, "bf16-tp2")
    assert_bf16_close(model, reference, "llama bf16 tp 2 vs bf16 1 rank", ulps=8.0)


def losses(args, ranks, flags, name):
    """Every step's loss (6 digits, --metrics) of a run."""
    path = os.path.join(args.workdir, name + ".jsonl")
    if os.path.exists(path):
        os.remove(path)
    train_ranks(args, ranks, flags + ["--metrics", path])
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def case_llama_adamw(args):
    """AdamW (weight decay on the 2-D weights only): tp 2 x dp 2 ZeRO 1, pp 2 and tp 4 (replicated
    kv heads) give the same loss as 1 rank at each of 50 steps, within 1e-4 relative."""
    data = tokenize(args, "byte")
    adamw = LLAMA + ["--optimizer", "adamw", "--lr", "3e-3", "--weight-decay", "0.1", "--tie-embeddings", "false",
                     "--data", data[0], "--steps", "50", "--global-batch", "16", "--seed", "3", "--log-every", "1"]
    want = losses(args, 1, adamw, "adamw-1")
    assert len(want) == 50, want
    for name, ranks, extra in (("tp2xdp2-zero1", 4, ["--tp", "2", "--zero", "1"]),
                               ("pp2", 2, ["--pp", "2", "--micro-batch", "4"]), ("tp4", 4, ["--tp", "4"])):
        got = losses(args, ranks, adamw + extra, "adamw-" + name)
        assert got.keys() == want.keys(), (got, want)
        worst = max(abs(got[s] - want[s]) / want[s] for s in want)
        assert worst <= 1e-4, f"AdamW {name}: losses {got} vs 1 rank {want}"
        print(f"llama AdamW {name}: 50 losses, worst relative difference {worst:.2e} (loss {want[1]:.4f} -> "
              f"{want[50]:.4f})")


def case_llama_resume(args):
    """Checkpoints stay layout-free: 20 steps under tp 4 (kv heads replicated), resumed under pp 2
    x dp 2 ZeRO 3 to 50 == 50 uninterrupted steps on 1 rank, within 1e-5 of each tensor's max; with
    AdamW under tp 4 (2 kv heads, each on 2 ranks) and tp 2 x dp 2 ZeRO 3, --checkpoint-io parallel
    (each replicated shard written by its first holder) writes rank 0's file, every tensor and
    optimizer state the same."""
    data = tokenize(args, "byte")
    flags = SGD + UNTIED
    reference, _ = run(args, 1, flags, data, "resume-1")
    model = resume(args, data, "llama-tp4", (4, ("--tp", "4")), (4, ("--pp", "2", "--micro-batch", "2", "--zero", "3")),
                   flags, model=LLAMA)
    assert_close(model, reference, "llama: tp 4 to 20 -> pp2 x dp2 zero 3 to 50 vs 1 rank 50")

    adamw = ["--optimizer", "adamw", "--lr", "3e-3"] + UNTIED
    for name, layout in (("tp4", ["--tp", "4"]), ("tp2xdp2-zero3", ["--tp", "2", "--zero", "3"])):
        for mode in ("rank0", "parallel"):
            run(args, 4, adamw + layout + ["--checkpoint-io", mode], data, f"pio-{name}-{mode}", steps=10)
        f = "step-00000010.h5"
        assert_same_checkpoint(os.path.join(args.workdir, f"ck-llama-pio-{name}-parallel", f),
                               os.path.join(args.workdir, f"ck-llama-pio-{name}-rank0", f), f"llama {name}")
        print(f"llama {name}: --checkpoint-io parallel and rank0 write the same checkpoint")


def case_llama_plan(args):
    """The plan rank 0 prints is within 5% of every rank's measured high-water mark for the tiny
    Llama on 1 rank, tp 2 (kv heads split), tp 4 (replicated), pp 2 x dp 2 ZeRO 3 and recompute
    full; --dry-run of the published shapes counts their parameters (Llama 3.1 8B: 8,030,261,248;
    70B: 70,553,706,496; 3.2 1B, tied: 1,235,814,400) and --plan finds layouts of 70B on 64 ranks."""
    data = tokenize(args, "byte")
    common = LLAMA + SGD + UNTIED + ["--data", data[0], "--steps", "3", "--global-batch", "16"]
    worst = 0.0
    for name, ranks, flags in (("1 rank", 1, []), ("tp 2", 2, ["--tp", "2"]), ("tp 4", 4, ["--tp", "4"]),
                               ("pp 2 x dp 2 zero 3", 4, ["--pp", "2", "--micro-batch", "2", "--zero", "3"]),
                               ("recompute full", 1, ["--recompute", "full"])):
        out = train_ranks(args, ranks, common + flags)
        planned = planned_totals(out, ranks)
        measured = [int(v) for v in re.search(r"memory high-water mark per rank \([^)]*\):([ 0-9]+)$", out,
                                              re.M).group(1).split()]
        errors = [p / m - 1 for p, m in zip(planned, measured)]
        print(f"llama {name:20s} planned {planned} measured {measured} error {', '.join(f'{e:+.1%}' for e in errors)}")
        worst = max(worst, max(abs(e) for e in errors))
    assert worst <= 0.05, f"the plan is {worst:.1%} off the measured high-water mark"

    for preset, params in (("llama3.1-8b", 8030261248), ("llama3.1-70b", 70553706496), ("llama3.2-1b", 1235814400)):
        out = train_ranks(args, 1, ["--model", preset, "--dry-run", "--global-batch", "1", "--optimizer", "adamw",
                                    "--precision", "bf16"])
        found = re.search(r"total trainable parameters: (\d+)", out)
        assert found and int(found.group(1)) == params, (preset, found and found.group(0), out)
        print(f"{preset}: {params:,} parameters")
    out = train_ranks(args, 1, ["--model", "llama3.1-70b", "--dry-run", "--plan", "--world", "64",
                                "--device-memory", "80GiB", "--global-batch", "64", "--optimizer", "adamw",
                                "--precision", "bf16", "--plan-tflops", "400"])
    assert re.search(r"^  1\. ", out, re.M), out


def case_llama_bad_inputs(args):
    """Inputs the Llama cannot take are one line, exit 2, on every rank."""
    data = tokenize(args, "byte")
    steps = ["--data", data[0], "--steps", "2", "--global-batch", "8"]
    bad = lambda model, pattern, ranks=1: expect_bad_input(args, model + steps, pattern, ranks=ranks)
    swap = lambda flag, value: [(value if LLAMA[i - 1] == flag else f) for i, f in enumerate(LLAMA)]
    bad(swap("--kv-heads", "3"), r"--kv-heads \(3\) must divide --heads \(4\)")
    bad(swap("--heads", "3"), r"--heads \(3\) must divide --embed \(32\)")
    bad(LLAMA + ["--tp", "2", "--dropout", "0.1"], r"--dropout: the llama models have none", ranks=2)
    bad(swap("--ffn-hidden", "63") + ["--tp", "2"], r"--ffn-hidden \(63\) must be divisible by --tp \(2\)", ranks=2)
    bad(swap("--heads", "2") + ["--tp", "4"],
        r"--heads \(2\) must be divisible by --tp \(4\)", ranks=4)
    bad(LLAMA + ["--norm-eps", "0"], r"--norm-eps must be in \(0, 1\)")
    bad(LLAMA + ["--rope-scaling", "0.5"], r"--rope-scaling must be 0 \(none\) or a factor >= 1")
    bad(LLAMA + ["--activation", "gelu_tanh"], r"--activation gelu_tanh applies to the gpt models")
    gpt = ["--model", "gpt", "--layers", "1", "--heads", "2", "--embed", "16", "--seq-len", "16", "--threads", "1"]
    bad(gpt + ["--kv-heads", "1"], r"--kv-heads, --ffn-hidden, --rope-theta and --rope-scaling apply to the llama")


def numpy_llama_greedy(ckpt, heads, kv_heads, theta, context, n, t_max):
    """Greedy continuation by a float64 numpy Llama forward (Hugging Face's: RMSNorm, rotate-half
    rotary positions, repeat_interleave'd kv heads, SwiGLU) over the last t_max tokens; also the
    margin (top-1 minus top-2 logit) of each choice."""
    with h5py.File(ckpt, "r") as f:
        w = {}
        f["model"].visititems(lambda k, o: w.update({k: o[...].astype(np.float64)}) if isinstance(o, h5py.Dataset) else None)
    d = w["wte/weight"].shape[1]
    head = w.get("lm_head/weight", w["wte/weight"])
    layers = len({k.split("/")[0] for k in w if k.startswith("layers.")})
    dh = d // heads
    inv_freq = 1.0 / theta ** (np.arange(0, dh, 2) / dh)

    def rms(x, p):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w[p + "/weight"]

    def rope(x):  # (heads, t, dh)
        ang = np.arange(x.shape[1])[:, None] * inv_freq[None, :]
        cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
        rot = np.concatenate([-x[..., dh // 2:], x[..., :dh // 2]], -1)
        return x * cos + rot * sin

    out, margins, ctx = [], [], list(context)
    for _ in range(n):
        toks = ctx[-t_max:]
        t = len(toks)
        x = w["wte/weight"][toks]
        for i in range(layers):
            a = f"layers.{i}/self_attn/"
            h = rms(x, f"layers.{i}/input_layernorm")
            q = (h @ w[a + "q_proj/weight"].T).reshape(t, heads, dh).transpose(1, 0, 2)
            k = (h @ w[a + "k_proj/weight"].T).reshape(t, kv_heads, dh).transpose(1, 0, 2)
            v = (h @ w[a + "v_proj/weight"].T).reshape(t, kv_heads, dh).transpose(1, 0, 2)
            q, k = rope(q), rope(k)
            k, v = np.repeat(k, heads // kv_heads, 0), np.repeat(v, heads // kv_heads, 0)
            s = q @ k.transpose(0, 2, 1) / math.sqrt(dh) + np.triu(np.full((t, t), -np.inf), 1)
            p = np.exp(s - s.max(-1, keepdims=True))
            y = (p / p.sum(-1, keepdims=True)) @ v
            x = x + y.transpose(1, 0, 2).reshape(t, d) @ w[a + "o_proj/weight"].T
            h = rms(x, f"layers.{i}/post_attention_layernorm")
            m = f"layers.{i}/mlp/"
            gate, up = h @ w[m + "gate_proj/weight"].T, h @ w[m + "up_proj/weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ w[m + "down_proj/weight"].T
        logits = (rms(x, "norm")[-1] @ head.T)[:257]  # the byte tokenizer's ids (strata-sample's limit)
        top = np.sort(logits)[-2:]
        out.append(int(np.argmax(logits)))
        margins.append(top[1] - top[0])
        ctx.append(out[-1])
    return out, margins


def case_llama_sample(args):
    """strata-sample's KV-cached decoder on a Llama trained here (30 AdamW steps, 2 kv heads of 4,
    32 positions), its tensors perturbed so that greedy text varies: 60 greedy tokens from a
    26-byte prompt (the window of 32 slides) equal a float64 numpy forward's but for near ties;
    the same seed gives the same sampled text, another seed other text."""
    data = tokenize(args, "byte")
    ck_dir = os.path.join(args.workdir, "ck-llama-sample")
    shutil.rmtree(ck_dir, ignore_errors=True)
    model = [("32" if LLAMA[i - 1] == "--seq-len" else f) for i, f in enumerate(LLAMA)]
    train_ranks(args, 1, model + ["--data", data[0], "--steps", "30", "--global-batch", "8", "--optimizer", "adamw",
                                  "--lr", "0.01", "--checkpoint-dir", ck_dir, "--log-every", "10"])
    ckpt = perturbed_copy(os.path.join(ck_dir, "step-00000030.h5"), os.path.join(args.workdir, "llama-noisy.h5"), 1)
    prompt = "GNU General Public License"
    base = ["--checkpoint", ckpt, "--prompt", prompt, "--tokens", "60"]
    greedy, speed = sample(args, base + ["--temperature", "0"])
    assert re.match(r"^-- 60 tokens in [0-9.]+ s: [0-9.]+ tokens/s .*context 32", speed), speed
    got = list(greedy[len(prompt):])
    want, margins = numpy_llama_greedy(ckpt, 4, 2, 10000.0, list(prompt.encode()), 60, 32)
    assert len(got) == 60 and len(set(got)) >= 5, greedy
    same = next((i for i, (g, e) in enumerate(zip(got, want)) if g != e), len(got))
    if same < len(got):  # only a near tie decided by rounding
        assert margins[same] < 1e-4, f"greedy token {same}: strata-sample {got[same]}, numpy {want[same]} " \
                                     f"(margin {margins[same]:.3g})"
    print(f"llama: greedy equals numpy's forward for {same} of {len(got)} tokens: {greedy!r}")
    a, _ = sample(args, base + ["--seed", "1"])
    assert sample(args, base + ["--seed", "1"])[0] == a and sample(args, base + ["--seed", "2"])[0] != a
