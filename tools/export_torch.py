#!/usr/bin/env python3
"""Exports a Strata checkpoint to a PyTorch state_dict for the matching torch.nn model.

Usage: export_torch.py CHECKPOINT OUT.pt [--eval DATA.h5]

The model is rebuilt as an nn.Sequential whose children carry Strata's layer names in
Strata's order (mlp: flatten, fc1, relu1[, dropout1], ..., fcN; cnn: conv1, relu1, pool1,
conv2, relu2, pool2, flatten, fc1, relu3[, dropout], fc2), so /model/fc1/weight becomes
state_dict key "fc1.weight". Every tensor's crc32 is verified; the state_dict is loaded into
the rebuilt model with strict=True before it is saved. With --eval, the model is evaluated on
an HDF5 dataset (inputs, labels, Strata's normalisation attributes) and prints the mean loss
and accuracy in the format of `train --eval-only`. resnet is not supported (yet).
"""
import argparse
import collections
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
    else:
        sys.exit(f"error: export of --model {kind!r} is not supported (mlp, cnn)")
    return nn.Sequential(layers)


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
    p.add_argument("--eval", help="an HDF5 dataset to evaluate the exported model on")
    a = p.parse_args()
    attrs, tensors = read_checkpoint(a.checkpoint)
    model = build_model(config_of(attrs), tensors)
    state = collections.OrderedDict((k.replace("/", "."), torch.from_numpy(v.copy())) for k, v in sorted(tensors.items()))
    model.load_state_dict(state, strict=True)  # every name and shape must match
    torch.save(model.state_dict(), a.out)
    print(f"wrote {a.out}: {len(state)} tensors of {config_of(attrs)['model']} at step {int(attrs.get('step', 0))}")
    if a.eval:
        x, y = load_inputs(a.eval)
        model.eval()
        with torch.no_grad():
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.double(), y).item()
            accuracy = (logits.argmax(1) == y).double().mean().item()
        print(f"evaluation: loss {loss:.6f}  accuracy {100 * accuracy:.2f}%  ({len(y)} samples)")


if __name__ == "__main__":
    main()
