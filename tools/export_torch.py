#!/usr/bin/env python3
"""Exports a Strata checkpoint to a self-describing PyTorch file: the model's options and its state_dict.

Usage: export_torch.py CHECKPOINT OUT.pt [--eval DATA.h5] [--seq-len T]

CHECKPOINT is a checkpoint file or a checkpoint (run) directory, which gives its newest complete
checkpoint as `train --resume auto` and strata-sample pick it: the one `latest` names, else
step-*.h5 from the highest step down, each checked (manifest, crc32s) and skipped with a warning
when damaged.

OUT.pt is a dict (torch.save) with the keys
  format      "strata-torch-export"      version  1
  kind        "mlp", "cnn", "resnet" or "gpt"
  options     the keyword arguments that rebuild the module: build(kind, options)
  state_dict  the weights, names as below
  model, step, checkpoint, config   the run's --model, step, source file and option lines
and (from the repository's root) the two lines
  import sys; sys.path.insert(0, "tools"); from export_torch import load
  model = load("OUT.pt")
give the module with its weights, in eval mode. Your own class takes
`torch.load("OUT.pt")["state_dict"]`.

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

Every bad input is one line `error: ...` on stderr and exit status 2; OUT.pt is written to a
temporary file beside it and renamed only when everything (--eval included) succeeded.
"""
import argparse
import collections
import contextlib
import math
import os
import re
import sys
import zlib

import h5py
import numpy as np
import torch
from torch import nn

FORMAT, VERSION = "strata-torch-export", 1


class ExportError(ValueError):
    """A bad input; main() prints it as one line `error: ...` and exits 2."""


def one_line(text):
    """`text` on one line, bytes outside printable ASCII as \\xNN (quoted file content may hold anything)."""
    return re.sub(r"[^\x20-\x7e]", lambda m: "".join(f"\\x{b:02x}" for b in m.group().encode()), " ".join(str(text).split()))


# ---- reading checkpoints ---------------------------------------------------------------------

STEP_FILE = re.compile(r"step-\d{8}\.h5")


def check_manifest(path):
    """What train and strata-sample check before HDF5 opens a file (docs/checkpoints.md): the
    manifest's version, file name, size and whole-file crc32, because a damaged file can make
    libhdf5 loop forever. A checkpoint without a manifest (older ones) is checked tensor by tensor."""
    manifest = path + ".manifest"
    if not os.path.exists(manifest):
        return
    with reading("the manifest", manifest), open(manifest, "rb") as f:
        lines = f.read(4096).decode("latin-1").split("\n")
    if lines[0] != "strata-checkpoint-manifest 1":
        raise ExportError(f"checkpoint '{path}': its manifest starts '{one_line(lines[0][:60])}', "
                          "expected 'strata-checkpoint-manifest 1'")
    fields = dict(line.partition(" ")[::2] for line in lines[1:] if line)
    if fields.get("file") != os.path.basename(path):
        raise ExportError(f"checkpoint '{path}': its manifest names file '{one_line(fields.get('file', ''))}'")
    size = os.path.getsize(path)
    if fields.get("size") != str(size):
        raise ExportError(f"checkpoint '{path}' has {size} bytes, its manifest says {one_line(fields.get('size'))}")
    crc = 0
    with reading("checkpoint", path), open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            crc = zlib.crc32(block, crc)
    if fields.get("crc32") != f"{crc:08x}":
        raise ExportError(f"checkpoint '{path}' is corrupt: whole-file crc32 {crc:08x}, its manifest says "
                          f"{one_line(fields.get('crc32'))}")


def h5_reason(path, e):
    """h5py's exception as a short reason (its messages repeat the path and flags)."""
    if not os.path.exists(path):
        return "no such file"
    if os.path.isfile(path) and os.access(path, os.R_OK) and not h5py.is_hdf5(path):
        return "not an HDF5 file"
    return one_line(e)


@contextlib.contextmanager
def reading(what, path):
    """Turns what reading `path` may raise (the OS's, h5py's, numpy's errors) into one ExportError."""
    try:
        yield
    except ExportError:
        raise
    except (OSError, KeyError, RuntimeError, TypeError, ValueError, IndexError) as e:
        raise ExportError(f"cannot read {what} '{path}': {h5_reason(path, e)}") from None


def read_checkpoint(path):
    """(attrs, {"fc1/weight": array}) with the manifest and every tensor's crc32 checked."""
    check_manifest(path)
    tensors = {}
    with reading("checkpoint", path), h5py.File(path, "r") as f:
        if not isinstance(f.get("model"), h5py.Group):
            what = "a dataset" if "inputs" in f or "tokens" in f else "an HDF5 file"
            raise ExportError(f"'{path}' is {what}, not a Strata checkpoint (no /model group)")
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
        attrs["step"], attrs["format_version"] = int(attrs.get("step", 0)), int(attrs.get("format_version", 0))

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                data = obj[...]
                if "crc32" not in obj.attrs or zlib.crc32(data.tobytes()) != int(obj.attrs["crc32"]):
                    raise ExportError(f"checkpoint '{path}': tensor 'model/{name}' is corrupt (crc32 mismatch)")
                tensors[name] = data

        f["model"].visititems(visit)
    if not tensors:
        raise ExportError(f"checkpoint '{path}' holds no model tensors")
    return attrs, tensors


def find_checkpoint(spec):
    """(path, attrs, tensors) of `spec`: a checkpoint file, or the newest complete checkpoint of a
    directory as train --resume auto and strata-sample choose it (io::newest_checkpoint)."""
    if not os.path.isdir(spec):
        if not os.path.exists(spec):
            raise ExportError(f"checkpoint '{spec}': no such file or directory")
        return (spec,) + read_checkpoint(spec)
    candidates, words = [], []
    with reading("checkpoint directory", spec):
        names = os.listdir(spec)
        if os.path.exists(os.path.join(spec, "latest")):
            with open(os.path.join(spec, "latest"), "rb") as f:
                words = f.read(4096).decode("latin-1").split()
    if words and STEP_FILE.fullmatch(words[0]):
        candidates.append(os.path.join(spec, words[0]))
    elif words:  # e.g. a path written by hand: the step files decide
        print(f"warning: ignoring {os.path.join(spec, 'latest')}: it holds '{one_line(words[0][:80])}', expected the "
              "name of a step-NNNNNNNN.h5 file in that directory", file=sys.stderr)
    for name in sorted((n for n in names if STEP_FILE.fullmatch(n)), reverse=True):  # zero-padded
        if os.path.join(spec, name) not in candidates:
            candidates.append(os.path.join(spec, name))
    for path in candidates:
        try:
            attrs, tensors = read_checkpoint(path)
            if attrs["format_version"] < 2:
                raise ExportError(f"checkpoint '{path}' holds no training state (format_version 1)")
            return path, attrs, tensors
        except ExportError as e:  # whatever the damage, the next older one may be good
            print(f"warning: skipping checkpoint {path}: {e}", file=sys.stderr)
    raise ExportError(f"the directory '{spec}' holds no complete checkpoint (step-NNNNNNNN.h5)")


def config_of(attrs):
    """The run's options from the checkpoint's `config` attribute (key = value lines)."""
    config = {}
    for line in str(attrs.get("config", "")).splitlines():
        key, _, value = line.partition(" = ")
        config[key.strip()] = value.strip()
    config.setdefault("model", str(attrs.get("model", "")))
    return config


def number(config, key, default, kind=int):
    """config[key] as `kind`, `default` when absent or empty; an error naming the key otherwise."""
    try:
        return kind(config.get(key, "") or default)
    except ValueError:
        raise ExportError(f"the checkpoint's config has {key} = '{one_line(config[key])}', not a number") from None


# ---- the modules -----------------------------------------------------------------------------

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


def build_mlp(features, dropout):
    """Strata's mlp: flatten, then Linear(features[i], features[i + 1]) with ReLU (and dropout) between."""
    layers = collections.OrderedDict(flatten=nn.Flatten())
    n = len(features) - 1
    for i in range(1, n + 1):
        layers[f"fc{i}"] = nn.Linear(features[i - 1], features[i])
        if i < n:
            layers[f"relu{i}"] = nn.ReLU()
            if dropout > 0:
                layers[f"dropout{i}"] = nn.Dropout(dropout)
    return nn.Sequential(layers)


def build_cnn(in_channels, channels, features, hidden, classes, dropout):
    """Strata's cnn: two 3x3 conv + ReLU + 2x2 max-pool stages, then fc1 (features -> hidden) and fc2."""
    c1, c2 = channels
    layers = collections.OrderedDict(
        conv1=nn.Conv2d(in_channels, c1, 3, 1, 1), relu1=nn.ReLU(), pool1=nn.MaxPool2d(2, 2),
        conv2=nn.Conv2d(c1, c2, 3, 1, 1), relu2=nn.ReLU(), pool2=nn.MaxPool2d(2, 2),
        flatten=nn.Flatten(), fc1=nn.Linear(features, hidden), relu3=nn.ReLU())
    if dropout > 0:
        layers["dropout"] = nn.Dropout(dropout)
    layers["fc2"] = nn.Linear(hidden, classes)
    return nn.Sequential(layers)


def build_resnet(in_channels, depth, width, classes):
    """Strata's build_resnet: (depth - 2) / 6 basic blocks per stage, widths width, 2 width, 4 width."""
    layers = collections.OrderedDict()
    layers.update(conv1=nn.Conv2d(in_channels, width, 3, 1, 1, bias=False),
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


BUILDERS = {"mlp": build_mlp, "cnn": build_cnn, "resnet": build_resnet, "gpt": Gpt}


def build(kind, options):
    """The module of `kind` ("mlp", "cnn", "resnet", "gpt") from its options (a file's "options")."""
    return BUILDERS[kind](**options)


def load(path, map_location="cpu"):
    """The module that export_torch.py wrote to `path`, with its weights, in eval mode."""
    saved = torch.load(path, map_location=map_location)
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ExportError(f"'{path}' is not a file of export_torch.py (a bare state_dict from an older "
                          "export? export the checkpoint again)")
    if saved.get("version", 0) > VERSION:
        raise ExportError(f"'{path}' has version {saved['version']}; this export_torch.py reads version {VERSION}")
    model = build(saved["kind"], saved["options"])
    model.load_state_dict(saved["state_dict"], strict=True)
    return model.eval()


# ---- a checkpoint's options ------------------------------------------------------------------

GPT_PRESETS = {"gpt2-124m": (12, 12, 768), "gpt2-350m": (24, 16, 1024), "gpt2-774m": (36, 20, 1280),
               "gpt2-1.5b": (48, 25, 1600)}


def gpt_options(config, tensors):
    """Gpt's options from the checkpoint's config (presets: GPT-2's shapes), checked against the tensors."""
    kind = config["model"]
    if kind in GPT_PRESETS:
        layers, heads, embed = GPT_PRESETS[kind]
    else:
        layers, heads, embed = (number(config, k, 0) for k in ("layers", "heads", "embed"))
    tied = config.get("tie-embeddings", "true").lower() in ("true", "1", "yes", "on")
    if "wte/weight" not in tensors or "wpe/weight" not in tensors:
        raise ExportError("the checkpoint has no wte/weight or wpe/weight: not a gpt model")
    vocab, width = tensors["wte/weight"].shape
    positions = tensors["wpe/weight"].shape[0]
    blocks = len({k.split("/")[0] for k in tensors if k.startswith("h") and k.split("/")[0][1:].isdigit()})
    seq_len = number(config, "seq-len", 0)
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
        raise ExportError("the checkpoint's config does not match its tensors: " + "; ".join(problems))
    return dict(layers=layers, heads=heads, embed=embed, positions=int(positions), vocab=int(vocab), tied=tied,
                dropout=number(config, "dropout", 0, float))


def options_of(config, tensors):
    """(kind, options) that rebuild the checkpoint's model; shapes come from the tensors."""
    kind, dropout = config["model"], number(config, "dropout", 0, float)
    try:
        if kind == "gpt" or kind in GPT_PRESETS:
            return "gpt", gpt_options(config, tensors)
        if kind == "mlp":
            n = len([k for k in tensors if re.fullmatch(r"fc\d+/weight", k)])
            features = [int(tensors["fc1/weight"].shape[1])] + [int(tensors[f"fc{i}/weight"].shape[0])
                                                                for i in range(1, n + 1)]
            return "mlp", dict(features=features, dropout=dropout)
        if kind == "cnn":
            c1, c_in = tensors["conv1/weight"].shape[:2]
            hidden, features = tensors["fc1/weight"].shape
            return "cnn", dict(in_channels=int(c_in), channels=[int(c1), int(tensors["conv2/weight"].shape[0])],
                               features=int(features), hidden=int(hidden), classes=int(tensors["fc2/weight"].shape[0]),
                               dropout=dropout)
        if kind == "resnet":
            depth, width = number(config, "depth", 20), number(config, "width", 16)
            if depth < 8 or (depth - 2) % 6:
                raise ExportError(f"resnet depth {depth} in the checkpoint's config is not 6n+2")
            return "resnet", dict(in_channels=int(tensors["conv1/weight"].shape[1]), depth=depth, width=width,
                                  classes=int(tensors["fc/weight"].shape[0]))
    except ExportError:
        raise
    except KeyError as e:
        raise ExportError(f"the checkpoint's {kind} has no tensor {e}") from None
    except (ValueError, IndexError):  # a shape of another rank than the layer's
        shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in sorted(tensors.items()))
        raise ExportError(f"the checkpoint's tensors do not make a {kind}: {shapes[:300]}") from None
    raise ExportError(f"export of --model {kind!r} is not supported (mlp, cnn, resnet, gpt, gpt2-*)")


# ---- evaluation ------------------------------------------------------------------------------

def read_h5(path, names, what):
    """{name: array} and the attributes of datasets `names` of `path`, whose reader says `what` it needs."""
    with reading("--eval", path), h5py.File(path, "r") as f:
        missing = [n for n in names if not isinstance(f.get(n), h5py.Dataset)]
        if missing:
            raise ExportError(f"--eval '{path}' has no '{missing[0]}' dataset: not {what}")
        return {n: f[n][...] for n in names}, {n: dict(f[n].attrs) for n in names}, dict(f.attrs)


def evaluate_gpt(model, path, seq_len, batch=64):
    """Mean per-token loss, accuracy and window count over the (N - 1) // T windows of `path`."""
    data, _, attrs = read_h5(path, ["tokens"], "a token dataset")
    model_vocab = model.wte.weight.shape[0]
    with reading("--eval", path):
        tokens, vocab = data["tokens"].astype(np.int64).reshape(-1), int(attrs.get("vocab_size", model_vocab))
    if vocab > model_vocab or (len(tokens) and (tokens.min() < 0 or tokens.max() >= model_vocab)):
        raise ExportError(f"--eval '{path}' has a vocabulary of {max(vocab, int(tokens.max()) + 1)} tokens but the "
                          f"model of {model_vocab}")
    if seq_len > model.wpe.weight.shape[0]:
        raise ExportError(f"--seq-len {seq_len} exceeds the model's {model.wpe.weight.shape[0]} positions")
    windows = (len(tokens) - 1) // seq_len
    if windows < 1:
        raise ExportError(f"--eval '{path}' holds {len(tokens)} tokens, fewer than --seq-len + 1 = {seq_len + 1}")
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
    """Inputs normalised as Strata's loader does: (x * scale - mean) / std per channel; labels."""
    data, attrs, _ = read_h5(path, ["inputs", "labels"], "a dataset of inputs and labels")
    x, y, a = data["inputs"], data["labels"].astype(np.int64).reshape(-1), attrs["inputs"]
    if x.ndim < 2 or len(x) != len(y) or len(y) == 0:
        raise ExportError(f"--eval '{path}' holds inputs of shape {x.shape} and {len(y)} labels: expected "
                          "(N, ...) inputs and N > 0 labels")
    with reading("--eval", path):  # attributes of another shape or type than Strata's loader reads
        scale = float(np.asarray(a.get("scale", 1 / 255 if x.dtype == np.uint8 else 1.0)).reshape(-1)[0])
        mean = np.asarray(a.get("mean", [0.0]), np.float32).reshape(-1)
        std = np.asarray(a.get("std", [1.0]), np.float32).reshape(-1)
        x = x.astype(np.float32) * np.float32(scale)
        shape = (1, -1) + (1,) * (x.ndim - 2)
        x = (x - mean.reshape(shape)) / std.reshape(shape)
    return torch.from_numpy(x), torch.from_numpy(y)


def evaluate_classifier(model, path, batch=1024):
    """Mean loss, accuracy and sample count of `model` on the dataset at `path`."""
    x, y = load_inputs(path)
    model.eval()
    total, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(y), batch):
            try:
                logits = model(x[i:i + batch])
            except RuntimeError as e:  # the shapes do not fit: torch says which
                raise ExportError(f"--eval '{path}': inputs of shape {tuple(x.shape[1:])} do not fit the model "
                                  f"({one_line(str(e).splitlines()[0])})") from None
            targets = y[i:i + batch]
            if targets.min() < 0 or targets.max() >= logits.shape[1]:
                raise ExportError(f"--eval '{path}' has labels outside 0..{logits.shape[1] - 1}, the model's classes")
            total += nn.functional.cross_entropy(logits.double(), targets, reduction="sum").item()
            correct += (logits.argmax(1) == targets).sum().item()
    return total / len(y), correct / len(y), len(y)


# ---- the command -----------------------------------------------------------------------------

class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as every other bad input
        self.exit(2, f"error: {message} (usage: export_torch.py CHECKPOINT OUT.pt [--eval DATA.h5] [--seq-len T])\n")


def export(a):
    """Reads, rebuilds, writes OUT through a temporary file and evaluates; ExportError on bad input."""
    if a.seq_len < 0:
        raise ExportError(f"--seq-len {a.seq_len} is negative")
    out_dir = os.path.dirname(os.path.abspath(a.out))
    if os.path.isdir(a.out) or not os.path.isdir(out_dir):
        raise ExportError(f"cannot write '{a.out}': " + ("it is a directory" if os.path.isdir(a.out) else
                                                         f"no directory '{out_dir}'"))
    path, attrs, tensors = find_checkpoint(a.checkpoint)
    if path != a.checkpoint:
        print(f"exporting {path} (the newest complete checkpoint of {a.checkpoint})")
    config = config_of(attrs)
    kind, options = options_of(config, tensors)
    model = build(kind, options)
    state = collections.OrderedDict((k.replace("/", "."), torch.from_numpy(v.copy())) for k, v in sorted(tensors.items()))
    if kind == "gpt" and "lm_head.weight" not in state:  # tied: torch's state_dict names the shared tensor twice
        state["lm_head.weight"] = state["wte.weight"]
    step = attrs["step"]
    for name, buffer in model.state_dict().items():  # BatchNorm's counter: torch has it, Strata does not
        if name.endswith(".num_batches_tracked") and name not in state:
            state[name] = torch.tensor(step, dtype=buffer.dtype)
    try:
        model.load_state_dict(state, strict=True)  # every name and shape must match
    except RuntimeError as e:
        raise ExportError(f"checkpoint '{path}': its tensors do not fit a {kind} with {options}: "
                          f"{one_line(e)[:300]}") from None
    saved = {"format": FORMAT, "version": VERSION, "kind": kind, "options": options, "state_dict": model.state_dict(),
             "model": config["model"], "step": step, "checkpoint": path, "config": str(attrs.get("config", ""))}
    # A temporary name beside OUT, renamed once everything succeeded: a failure leaves no OUT behind.
    tmp = os.path.join(out_dir, f".{os.path.basename(a.out)}.{os.getpid()}.tmp")
    try:
        try:
            with open(tmp, "xb") as f:
                torch.save(saved, f)
        except (OSError, RuntimeError) as e:  # RuntimeError: torch's writer, e.g. on a full disk
            raise ExportError(f"cannot write '{a.out}': {getattr(e, 'strerror', None) or one_line(e)}") from None
        if a.eval and kind == "gpt":
            seq_len = a.seq_len or number(config, "seq-len", 0) or options["positions"]
            loss, accuracy, windows = evaluate_gpt(model, a.eval, seq_len)
            print(f"evaluation: loss {loss:.6f}  perplexity {math.exp(loss):.3f}  next-token accuracy "
                  f"{100 * accuracy:.2f}%  ({windows} windows)")
        elif a.eval:
            loss, accuracy, samples = evaluate_classifier(model, a.eval)
            print(f"evaluation: loss {loss:.6f}  accuracy {100 * accuracy:.2f}%  ({samples} samples)")
        try:
            os.replace(tmp, a.out)
        except OSError as e:
            raise ExportError(f"cannot write '{a.out}': {e.strerror or e}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    print(f"wrote {a.out}: {len(state)} tensors of {config['model']} at step {step} (load: export_torch.load)")


def main():
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a checkpoint file, or a checkpoint (run) directory: its newest complete one")
    p.add_argument("out", help="the .pt file to write (options + state_dict; export_torch.load reads it)")
    p.add_argument("--eval", help="an HDF5 dataset (gpt: a token dataset) to evaluate the exported model on")
    p.add_argument("--seq-len", type=int, default=0, help="gpt --eval: tokens per window (default: the checkpoint's)")
    a = p.parse_args()
    try:
        export(a)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
