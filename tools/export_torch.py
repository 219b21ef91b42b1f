#!/usr/bin/env python3
"""Exports a Strata checkpoint to a PyTorch state_dict for the matching torch.nn model.

Usage: export_torch.py CHECKPOINT OUT.pt [--eval DATA.h5]

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
    step = int(attrs.get("step", 0))
    for name, buffer in model.state_dict().items():  # BatchNorm's counter: torch has it, Strata does not
        if name.endswith(".num_batches_tracked") and name not in state:
            state[name] = torch.tensor(step, dtype=buffer.dtype)
    model.load_state_dict(state, strict=True)  # every name and shape must match
    torch.save(model.state_dict(), a.out)
    print(f"wrote {a.out}: {len(state)} tensors of {config_of(attrs)['model']} at step {step}")
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
