#!/usr/bin/env python3
"""Exports a Strata checkpoint to a PyTorch state_dict for the matching torch.nn model.

Usage: export_torch.py CHECKPOINT OUT.pt [--eval DATA.h5] [--seq-len T]

The model is rebuilt as an nn.Sequential whose children carry Strata's layer names in
Strata's order (mlp: flatten, fc1, relu1[, dropout1], ..., fcN; cnn: conv1, relu1, pool1,
conv2, relu2, pool2, flatten, fc1, relu3[, dropout], fc2; resnet: conv1, bn1, relu1,
block{stage}_{i} (ResidualBlock: conv1, bn1, relu1, conv2, bn2 and, where the shape changes,
shortcut.conv/shortcut.bn; y = relu(main + shortcut)), pool, fc), so /model/fc1/weight becomes
state_dict key "fc1.weight". resnet's depth and width come from the checkpoint's `config`
attribute; its BatchNorm2d layers use eps 1e-5, momentum 0.1 like Strata's, and their
num_batches_tracked buffers (which Strata does not keep) are set to the checkpoint's step.
Every tensor's crc32 is verified; the state_dict is loaded into the rebuilt model with
strict=True before it is saved. With --eval, the model is evaluated (eval mode: BatchNorm uses
the running statistics) on an HDF5 dataset (inputs, labels, Strata's normalisation attributes)
and prints the mean loss and accuracy in the format of `train --eval-only`.

GPT checkpoints (--model gpt or a gpt2-* preset) become a nanoGPT-style module (class Gpt):
wte, wpe (nn.Embedding), h0..h{L-1} (pre-LN blocks: x + attn(ln_1(x)), then x + mlp(ln_2(x));
attn: c_attn's fused (3D, D) weight gives q | k | v in that order along the output rows, heads
split each into D/H-wide slices, causal softmax(q k^T / sqrt(D/H)) v, then c_proj; mlp: c_fc,
exact (erf) GELU, c_proj), ln_f (LayerNorm eps 1e-5 like Strata's), lm_head (no bias; tied to
wte.weight when the checkpoint has no lm_head/weight). Keys are Strata's names with "/" -> "."
("h0/attn/c_attn/weight" -> "h0.attn.c_attn.weight"); a tied model's state_dict also carries
lm_head.weight (the same tensor as wte.weight, as in torch). Layers, heads, width, context
length and tying come from the `config` attribute and are checked against the tensors' shapes.
With --eval TOKENS.h5 (a token dataset, docs/formats.md) the model reads the file's
(num_tokens - 1) // T non-overlapping windows of T = --seq-len (default: the checkpoint's)
tokens, predicts each window's next tokens and prints the mean per-token loss, its perplexity
and the next-token accuracy in the format of `train --eval-only`.
"""
import argparse
import collections
import math
import sys
import zlib

import h5py
import numpy as np
import torch
from torch import nn


def read_checkpoint(path):
    """(attrs, {"fc1/weight": array}) with every tensor's crc32 checked."""
    tensors = {}
    with h5py.File(path, "r") as f:
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                data = obj[...]
                if zlib.crc32(data.tobytes()) != int(obj.attrs["crc32"]):
                    sys.exit(f"error: checkpoint '{path}': tensor 'model/{name}' is corrupt (crc32 mismatch)")
                tensors[name] = data

        f["model"].visititems(visit)
    return attrs, tensors


def config_of(attrs):
    """The run's options from the checkpoint's `config` attribute (key = value lines)."""
    config = {}
    for line in str(attrs.get("config", "")).splitlines():
        key, _, value = line.partition(" = ")
        config[key.strip()] = value.strip()
    config.setdefault("model", str(attrs.get("model", "")))
    return config


class ResidualBlock(nn.Module):
    """Strata's ResidualBlock::basic: relu(bn2(conv2(relu1(bn1(conv1(x))))) + shortcut(x))."""

    def __init__(self, in_channels, out_channels, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels, eps=1e-5, momentum=0.1)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels, eps=1e-5, momentum=0.1)
        self.shortcut = nn.Sequential()  # identity when empty
        if stride != 1 or in_channels != out_channels:
            self.shortcut.add_module("conv", nn.Conv2d(in_channels, out_channels, 1, stride, 0, bias=False))
            self.shortcut.add_module("bn", nn.BatchNorm2d(out_channels, eps=1e-5, momentum=0.1))

    def forward(self, x):
        main = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
        return torch.relu(main + self.shortcut(x))


def build_resnet(config, tensors):
    """Strata's build_resnet: depth and width from the run's config, shapes checked on load."""
    depth, width = int(config.get("depth", "20")), int(config.get("width", "16"))
    if depth < 8 or (depth - 2) % 6:
        sys.exit(f"error: resnet depth {depth} in the checkpoint's config is not 6n+2")
    c_in = tensors["conv1/weight"].shape[1]
    classes = tensors["fc/weight"].shape[0]
    layers = collections.OrderedDict()
    layers.update(conv1=nn.Conv2d(c_in, width, 3, 1, 1, bias=False),
                  bn1=nn.BatchNorm2d(width, eps=1e-5, momentum=0.1), relu1=nn.ReLU())
    channels = width
    for stage in range(3):
        out = width << stage
        for i in range((depth - 2) // 6):
            stride = 2 if stage > 0 and i == 0 else 1
            layers[f"block{stage + 1}_{i + 1}"] = ResidualBlock(channels, out, stride)
            channels = out
    layers.update(pool=nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()), fc=nn.Linear(channels, classes))
    return nn.Sequential(layers)


def build_model(config, tensors):
    """The torch.nn.Sequential matching Strata's layer list; shapes come from the tensors."""
    kind, dropout = config["model"], float(config.get("dropout", "0") or 0)
    layers = collections.OrderedDict()
    if kind == "mlp":
        n = len([k for k in tensors if k.startswith("fc") and k.endswith("/weight")])
        layers["flatten"] = nn.Flatten()
        for i in range(1, n + 1):
            out_features, in_features = tensors[f"fc{i}/weight"].shape
            layers[f"fc{i}"] = nn.Linear(in_features, out_features)
            if i < n:
                layers[f"relu{i}"] = nn.ReLU()
                if dropout > 0:
                    layers[f"dropout{i}"] = nn.Dropout(dropout)
    elif kind == "cnn":
        c1, c_in = tensors["conv1/weight"].shape[:2]
        c2 = tensors["conv2/weight"].shape[0]
        hidden, features = tensors["fc1/weight"].shape
        layers.update(conv1=nn.Conv2d(c_in, c1, 3, 1, 1), relu1=nn.ReLU(), pool1=nn.MaxPool2d(2, 2),
                      conv2=nn.Conv2d(c1, c2, 3, 1, 1), relu2=nn.ReLU(), pool2=nn.MaxPool2d(2, 2),
                      flatten=nn.Flatten(), fc1=nn.Linear(features, hidden), relu3=nn.ReLU())
        if dropout > 0:
            layers["dropout"] = nn.Dropout(dropout)
        layers["fc2"] = nn.Linear(hidden, tensors["fc2/weight"].shape[0])
    elif kind == "resnet":
        return build_resnet(config, tensors)
    else:
        sys.exit(f"error: export of --model {kind!r} is not supported (mlp, cnn, resnet)")
    return nn.Sequential(layers)


# ---- GPT -------------------------------------------------------------------------------------

GPT_PRESETS = {"gpt2-124m": (12, 12, 768), "gpt2-350m": (24, 16, 1024), "gpt2-774m": (36, 20, 1280),
               "gpt2-1.5b": (48, 25, 1600)}


class CausalSelfAttention(nn.Module):
    """Strata's CausalSelfAttention: c_attn -> q | k | v, per-head causal softmax, c_proj."""

    def __init__(self, embed, heads, dropout):
        super().__init__()
        self.c_attn = nn.Linear(embed, 3 * embed)
        self.c_proj = nn.Linear(embed, embed)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))  # (B, H, T, Dh)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device))
        att = self.attn_dropout(torch.softmax(att.masked_fill(~mask, float("-inf")), dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, d)
        return self.resid_dropout(self.c_proj(y))


class GptMlp(nn.Module):
    def __init__(self, embed, dropout):
        super().__init__()
        self.c_fc = nn.Linear(embed, 4 * embed)
        self.c_proj = nn.Linear(4 * embed, embed)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(nn.functional.gelu(self.c_fc(x))))  # exact GELU (erf)


class GptBlock(nn.Module):
    def __init__(self, embed, heads, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(embed, eps=1e-5)
        self.attn = CausalSelfAttention(embed, heads, dropout)
        self.ln_2 = nn.LayerNorm(embed, eps=1e-5)
        self.mlp = GptMlp(embed, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt(nn.Module):
    """Strata's build_gpt: wte + wpe, [dropout], h0..h{L-1}, ln_f, lm_head (tied or not)."""

    def __init__(self, layers, heads, embed, positions, vocab, tied, dropout):
        super().__init__()
        self.wte = nn.Embedding(vocab, embed)
        self.wpe = nn.Embedding(positions, embed)
        self.drop = nn.Dropout(dropout)
        self.layers = layers
        for i in range(layers):
            self.add_module(f"h{i}", GptBlock(embed, heads, dropout))
        self.ln_f = nn.LayerNorm(embed, eps=1e-5)
        self.lm_head = nn.Linear(embed, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        t = idx.shape[1]
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))
        for i in range(self.layers):
            x = getattr(self, f"h{i}")(x)
        return self.lm_head(self.ln_f(x))


def build_gpt(config, tensors):
    """The Gpt of the checkpoint's config (presets: GPT-2's shapes), checked against the tensors."""
    kind = config["model"]
    if kind in GPT_PRESETS:
        layers, heads, embed = GPT_PRESETS[kind]
    else:
        layers, heads, embed = (int(config.get(k, "0") or 0) for k in ("layers", "heads", "embed"))
    tied = config.get("tie-embeddings", "true").lower() in ("true", "1", "yes", "on")
    if "wte/weight" not in tensors or "wpe/weight" not in tensors:
        sys.exit("error: the checkpoint has no wte/weight or wpe/weight: not a gpt model")
    vocab, width = tensors["wte/weight"].shape
    positions = tensors["wpe/weight"].shape[0]
    blocks = len({k.split("/")[0] for k in tensors if k.startswith("h") and k.split("/")[0][1:].isdigit()})
    seq_len = int(config.get("seq-len", "0") or 0)
    problems = []
    if (layers, embed) != (blocks, width):
        problems.append(f"config layers {layers}, embed {embed} but the tensors hold {blocks} blocks of width {width}")
    if heads < 1 or embed % heads:
        problems.append(f"config heads {heads} does not divide embed {embed}")
    if kind not in GPT_PRESETS and seq_len and seq_len != positions:
        problems.append(f"config seq-len {seq_len} but wpe/weight has {positions} positions")
    if tied == ("lm_head/weight" in tensors):
        problems.append(f"config tie-embeddings {tied} but lm_head/weight is {'present' if tied else 'absent'}")
    if problems:
        sys.exit("error: the checkpoint's config does not match its tensors: " + "; ".join(problems))
    dropout = float(config.get("dropout", "0") or 0)
    return Gpt(layers, heads, embed, positions, vocab, tied, dropout), positions


def load_tokens(path):
    """A token dataset's ids (int64) and vocab_size, as docs/formats.md describes them."""
    with h5py.File(path, "r") as f:
        if "tokens" not in f:
            sys.exit(f"error: --eval '{path}' has no 'tokens' dataset: not a token dataset")
        return f["tokens"][...].astype(np.int64), int(f.attrs["vocab_size"])


def evaluate_gpt(model, path, seq_len, batch=64):
    """Mean per-token loss, accuracy and window count over the (N - 1) // T windows of `path`."""
    tokens, vocab = load_tokens(path)
    if vocab > model.wte.weight.shape[0]:
        sys.exit(f"error: --eval '{path}' has a vocabulary of {vocab} tokens but the model of "
                 f"{model.wte.weight.shape[0]}")
    if seq_len > model.wpe.weight.shape[0]:
        sys.exit(f"error: --seq-len {seq_len} exceeds the model's {model.wpe.weight.shape[0]} positions")
    windows = (len(tokens) - 1) // seq_len
    if windows < 1:
        sys.exit(f"error: --eval '{path}' holds {len(tokens)} tokens, fewer than --seq-len + 1 = {seq_len + 1}")
    x = torch.from_numpy(tokens[:windows * seq_len].reshape(windows, seq_len))
    y = torch.from_numpy(tokens[1:windows * seq_len + 1].reshape(windows, seq_len))
    total, correct = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, windows, batch):
            logits = model(x[i:i + batch])
            targets = y[i:i + batch]
            total += nn.functional.cross_entropy(logits.double().flatten(0, 1), targets.flatten(),
                                                 reduction="sum").item()
            correct += (logits.argmax(-1) == targets).sum().item()
    n = windows * seq_len
    return total / n, correct / n, windows


def load_inputs(path):
    """Inputs normalised as Strata's loader does: (x * scale - mean) / std per channel."""
    with h5py.File(path, "r") as f:
        x, y = f["inputs"][...], f["labels"][...].astype(np.int64)
        a = f["inputs"].attrs
        scale = float(np.asarray(a.get("scale", 1 / 255 if x.dtype == np.uint8 else 1.0)).reshape(-1)[0])
        mean = np.asarray(a.get("mean", [0.0]), np.float32).reshape(-1)
        std = np.asarray(a.get("std", [1.0]), np.float32).reshape(-1)
    x = x.astype(np.float32) * np.float32(scale)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    x = (x - mean.reshape(shape)) / std.reshape(shape)
    return torch.from_numpy(x), torch.from_numpy(y)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--eval", help="an HDF5 dataset (gpt: a token dataset) to evaluate the exported model on")
    p.add_argument("--seq-len", type=int, default=0, help="gpt --eval: tokens per window (default: the checkpoint's)")
    a = p.parse_args()
    attrs, tensors = read_checkpoint(a.checkpoint)
    config = config_of(attrs)
    gpt = config["model"] == "gpt" or config["model"] in GPT_PRESETS
    if gpt:
        model, positions = build_gpt(config, tensors)
    else:
        model = build_model(config, tensors)
    state = collections.OrderedDict((k.replace("/", "."), torch.from_numpy(v.copy())) for k, v in sorted(tensors.items()))
    if gpt and "lm_head.weight" not in state:  # tied: torch's state_dict names the shared tensor twice
        state["lm_head.weight"] = state["wte.weight"]
    step = int(attrs.get("step", 0))
    for name, buffer in model.state_dict().items():  # BatchNorm's counter: torch has it, Strata does not
        if name.endswith(".num_batches_tracked") and name not in state:
            state[name] = torch.tensor(step, dtype=buffer.dtype)
    model.load_state_dict(state, strict=True)  # every name and shape must match
    torch.save(model.state_dict(), a.out)
    print(f"wrote {a.out}: {len(state)} tensors of {config['model']} at step {step}")
    if a.eval and gpt:
        seq_len = a.seq_len or int(config.get("seq-len", "0") or 0) or positions
        loss, accuracy, windows = evaluate_gpt(model, a.eval, seq_len)
        print(f"evaluation: loss {loss:.6f}  perplexity {math.exp(loss):.3f}  next-token accuracy "
              f"{100 * accuracy:.2f}%  ({windows} windows)")
    elif a.eval:
        x, y = load_inputs(a.eval)
        model.eval()
        with torch.no_grad():
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.double(), y).item()
            accuracy = (logits.argmax(1) == y).double().mean().item()
        print(f"evaluation: loss {loss:.6f}  accuracy {100 * accuracy:.2f}%  ({len(y)} samples)")


if __name__ == "__main__":
    main()
