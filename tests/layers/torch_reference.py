#!/usr/bin/python3
"""PyTorch reference for Strata's layers, loss, model zoo, optimizers and schedules.

Usage: torch_reference.py OUT.h5

Builds the same computations with torch.nn / torch.optim in float32 (the oracle we did not
write), runs forward and backward with a fixed upstream gradient, and writes one HDF5 file
that tests/layers/test_torch_parity.cpp and test_optimizer_parity.cpp read with the HDF5 C API.

Layout (every tensor float32 unless stated, labels int32):
  /layers/<case>   attrs: kind, mode ("train"/"eval") and hyper-parameters
                   datasets: input, output, grad_output, grad_input (train mode only),
                   params/<name>, grads/<name>, updated/<name> (BatchNorm running stats
                   after the forward), labels (loss)
  /models/<case>   attrs: model, classes, seed, hidden/depth/width; datasets: input, labels,
                   logits, loss (scalar, mean over the batch), grad_input, params/<name>
                   (Strata's own initial values, recomputed here), grads/<name>, updated/<name>
  /optim/<case>    attrs: name, lr, momentum, nesterov, weight_decay, beta1, beta2, eps;
                   params0 (N), grads (S, N), params (S, N) after each step, state/<name>
  /sched/<case>    attrs: the LrScheduleConfig fields, reference ("torch" or "formula");
                   lr (S) in float64
  /clip/<case>     attrs: max_norm; grads (N), clipped (N), norm (scalar, float64)
  /gpt/<case>      a nanoGPT-style GPT (pre-LN blocks, causal attention by the explicit softmax
                   formula, exact GELU, ln_f, head tied to wte or not) with Strata's initial
                   values (GPT-2 init recomputed from (seed, name)); attrs: layers, heads, embed,
                   seq_len, vocab, tied, seed, lr, beta1, beta2, eps, weight_decay, steps;
                   datasets: input, labels (int32, (B, T)), params/<name>, logits, loss (mean
                   over tokens), grads/<name>; then `steps` torch.optim.AdamW steps with two
                   param groups (decay: 2-D Linear weights; none: biases, LayerNorm,
                   embeddings) on batches train_input/train_labels (S, B, T): train_loss (S)
                   before each step, final/<name> the parameters after the last
  /llama/<case>    Hugging Face's Llama written out (RMSNorm, rotate-half RoPE, grouped-query
                   attention by repeat_interleave, SwiGLU): see llama_cases

Parameter names are Strata's ParamEntry names ("fc1/weight", "block2_1/shortcut/bn/running_var");
h5py turns the slashes into nested groups, which the C++ side opens by the same path.
"""
import math
import sys

import h5py
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
RNG = np.random.RandomState(20240611)
MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF


# ---- Strata's counter-based RNG (src/core/rng.hpp), re-implemented to reproduce its ---------
# ---- parameter initialisation and dropout masks. -------------------------------------------

def philox(key, c0, c1, c2, c3):
    """Philox-4x32-10 on uint64 arrays holding 32-bit counters; returns the 4 outputs."""
    k0 = np.uint64(key & MASK32)
    k1 = np.uint64((key >> 32) & MASK32)
    m = np.uint64(MASK32)
    s32 = np.uint64(32)
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in (c0, c1, c2, c3))
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * c0
        p1 = np.uint64(0xCD9E8D57) * c2
        n0 = (p1 >> s32) ^ c1 ^ k0
        n2 = (p0 >> s32) ^ c3 ^ k1
        c1 = p1 & m
        c3 = p0 & m
        c0 = n0
        c2 = n2
        k0 = np.uint64((int(k0) + 0x9E3779B9) & MASK32)
        k1 = np.uint64((int(k1) + 0xBB67AE85) & MASK32)
    return c0, c1, c2, c3


def derive_key(seed, tag):
    z = (seed + 0x9E3779B97F4A7C15 * (tag + 1)) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def uniform(key, stream, n, start=0):
    """uniform(key, stream, i) for i in [start, start + n), as float32."""
    i = np.arange(start, start + n, dtype=np.uint64)
    outs = philox(key, (i >> np.uint64(2)) & np.uint64(MASK32), i >> np.uint64(34),
                  np.full(n, stream & MASK32, dtype=np.uint64),
                  np.full(n, (stream >> 32) & MASK32, dtype=np.uint64))
    sel = np.choose((i & np.uint64(3)).astype(np.int64), outs)
    return (sel >> np.uint64(8)).astype(np.float32) * np.float32(1.0 / 16777216.0)


def fnv1a(s):
    h = 1469598103934665603
    for c in s.encode():
        h = ((h ^ c) * 1099511628211) & MASK64
    return h


KINIT, KDROPOUT = 1, 3


def strata_fan_in_uniform(seed, name, shape, fan_in):
    """Strata's Init::FanInUniform for parameter `name` (parameter_store.cpp: initialise)."""
    n = int(np.prod(shape))
    bound = np.float32(1.0) / np.sqrt(np.float32(fan_in))
    u = uniform(derive_key(seed, KINIT), fnv1a(name), n)
    return ((np.float32(2.0) * u - np.float32(1.0)) * bound).astype(np.float32).reshape(shape)


def strata_normal(seed, name, shape, std):
    """Strata's Init::Normal (parameter_store.cpp: initialise): Box-Muller on uniforms 2i, 2i+1, in double."""
    n = int(np.prod(shape))
    u = uniform(derive_key(seed, KINIT), fnv1a(name), 2 * n).astype(np.float64)
    u1 = 1.0 - u[0::2]
    u2 = u[1::2]
    z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
    return (std * z).astype(np.float32).reshape(shape)


def dropout_keep(seed, step, index, first_sample, batch, sample_numel, p):
    """Strata's dropout keep mask (ops.hpp DropoutKey, basic.cpp Dropout::key)."""
    key = derive_key(derive_key(seed, KDROPOUT), index)
    u = uniform(key, step, batch * sample_numel, first_sample * sample_numel)
    return (u >= np.float32(p)).reshape(batch, sample_numel)


# ---- helpers ---------------------------------------------------------------------------------

def randn(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def t(a, grad=False):
    x = torch.tensor(np.asarray(a, dtype=np.float32))
    x.requires_grad_(grad)
    return x


def put(group, name, value, dtype=np.float32):
    group.create_dataset(name, data=np.asarray(value, dtype=dtype))


def set_attrs(group, **attrs):
    for k, v in attrs.items():
        if isinstance(v, str):
            group.attrs[k] = np.bytes_(v)  # fixed-length ASCII: simple to read from C
        elif isinstance(v, bool):
            group.attrs[k] = np.int64(v)
        elif isinstance(v, (int, np.integer)):
            group.attrs[k] = np.int64(v)
        else:
            group.attrs[k] = np.float64(v)


def module_params(named):
    """(name, tensor, trainable) for a dict prefix -> module, in Strata's naming."""
    out = []
    for prefix, mod in named:
        pre = prefix + "/" if prefix else ""
        if isinstance(mod, (nn.Linear, nn.Conv2d, nn.LayerNorm)):
            out.append((pre + "weight", mod.weight, True))
            if mod.bias is not None:
                out.append((pre + "bias", mod.bias, True))
        elif isinstance(mod, nn.BatchNorm2d):
            out += [(pre + "weight", mod.weight, True), (pre + "bias", mod.bias, True),
                    (pre + "running_mean", mod.running_mean, False),
                    (pre + "running_var", mod.running_var, False)]
    return out


def run_case(group, fn, x, params, grad_output=True, train=True, labels=None):
    """Runs y = fn(x); backward with a random upstream gradient; writes everything.

    params: list of (name, tensor, trainable); their current values are written before the
    forward (BatchNorm's running stats change during it)."""
    pg = group.create_group("params")
    for name, p, _ in params:
        put(pg, name, p.detach().numpy())
    xt = t(x, grad=train)
    put(group, "input", x)
    y = fn(xt)
    put(group, "output", y.detach().numpy())
    upd = [(n, p) for n, p, tr in params if not tr]
    if upd:
        ug = group.create_group("updated")
        for name, p in upd:
            put(ug, name, p.detach().numpy())
    if not train:
        return
    dy = randn(*y.shape)
    put(group, "grad_output", dy)
    y.backward(torch.tensor(dy))
    put(group, "grad_input", xt.grad.numpy())
    gg = group.create_group("grads")
    for name, p, tr in params:
        if tr:
            put(gg, name, p.grad.numpy())


def init_module_random(named):
    """Random (not default) parameters so that a swapped weight/bias is noticed."""
    for _, mod in named:
        with torch.no_grad():
            if isinstance(mod, (nn.Linear, nn.Conv2d)):
                mod.weight.copy_(t(randn(*mod.weight.shape, scale=0.5)))
                if mod.bias is not None:
                    mod.bias.copy_(t(randn(*mod.bias.shape, scale=0.5)))
            elif isinstance(mod, (nn.BatchNorm2d, nn.LayerNorm)):
                mod.weight.copy_(t(1.0 + randn(*mod.weight.shape, scale=0.3)))
                mod.bias.copy_(t(randn(*mod.bias.shape, scale=0.3)))
                if isinstance(mod, nn.BatchNorm2d):
                    mod.running_mean.copy_(t(randn(*mod.running_mean.shape, scale=0.3)))
                    mod.running_var.copy_(t(RNG.uniform(0.5, 1.5, mod.running_var.shape)))


# ---- single layers ---------------------------------------------------------------------------

def layer_cases(root):
    g = root.create_group("layers")

    for name, bias in (("linear_bias", True), ("linear_nobias", False)):
        m = nn.Linear(7, 5, bias=bias)
        init_module_random([("", m)])
        c = g.create_group(name)
        set_attrs(c, kind="linear", mode="train", in_features=7, out_features=5, bias=bias)
        run_case(c, m, randn(4, 7), module_params([("", m)]))

    conv_cfgs = [  # name, C, O, k, stride, padding, H, W, bias
        ("conv_k3_s1_p0", 2, 3, 3, 1, 0, 7, 5, True),
        ("conv_k3_s1_p1", 3, 4, 3, 1, 1, 6, 9, True),
        ("conv_k3_s2_p1", 2, 4, 3, 2, 1, 8, 7, True),
        ("conv_k3_s2_p0_nobias", 3, 2, 3, 2, 0, 9, 6, False),
        ("conv_k1_s1_p0", 4, 3, 1, 1, 0, 5, 6, True),
        ("conv_k1_s2_p0_nobias", 3, 5, 1, 2, 0, 7, 8, False),
    ]
    for name, ci, co, k, s, p, h, w, bias in conv_cfgs:
        m = nn.Conv2d(ci, co, k, stride=s, padding=p, bias=bias)
        init_module_random([("", m)])
        c = g.create_group(name)
        set_attrs(c, kind="conv2d", mode="train", in_channels=ci, out_channels=co, kernel=k, stride=s,
                  padding=p, bias=bias)
        run_case(c, m, randn(2, ci, h, w), module_params([("", m)]))

    pool_cfgs = [  # name, kind, k, stride, padding, H, W
        ("maxpool_k2_s2", "max", 2, 2, 0, 6, 8),
        ("maxpool_k3_s2_p1", "max", 3, 2, 1, 7, 6),
        ("maxpool_k3_s1", "max", 3, 1, 0, 5, 7),
        ("avgpool_k2_s2", "avg", 2, 2, 0, 6, 8),
        ("avgpool_k3_s2_p1", "avg", 3, 2, 1, 7, 6),
        ("avgpool_k3_s1_p1", "avg", 3, 1, 1, 5, 4),
    ]
    for name, kind, k, s, p, h, w in pool_cfgs:
        if kind == "max":
            fn = lambda x, k=k, s=s, p=p: F.max_pool2d(x, k, s, p)
        else:
            fn = lambda x, k=k, s=s, p=p: F.avg_pool2d(x, k, s, p, count_include_pad=True)
        c = g.create_group(name)
        set_attrs(c, kind="pool2d", pool=kind, mode="train", kernel=k, stride=s, padding=p)
        # A random permutation: no ties, so the max's argument is unique.
        x = (RNG.permutation(2 * 3 * h * w).astype(np.float32) * 0.05 - 1.0).reshape(2, 3, h, w)
        run_case(c, fn, x, [])

    c = g.create_group("global_avg_pool")
    set_attrs(c, kind="global_avg_pool", mode="train")
    run_case(c, lambda x: x.mean(dim=(2, 3)), randn(3, 4, 5, 6), [])

    c = g.create_group("relu")
    set_attrs(c, kind="relu", mode="train")
    run_case(c, F.relu, randn(3, 4, 5), [])

    c = g.create_group("gelu")
    set_attrs(c, kind="gelu", mode="train")
    run_case(c, lambda x: F.gelu(x), randn(3, 4, 5, scale=2.0), [])

    # Dropout: torch's mask comes from its own generator, so the reference mask is Strata's
    # documented one (ops.hpp DropoutKey), recomputed here; torch does the arithmetic.
    seed, step, index, first, p = 1234, 7, 2, 3, 0.3
    batch, sample = 4, (3, 5)
    keep = dropout_keep(seed, step, index, first, batch, int(np.prod(sample)), p).reshape(batch, *sample)
    c = g.create_group("dropout")
    set_attrs(c, kind="dropout", mode="train", p=p, seed=seed, step=step, index=index, first_sample=first)
    run_case(c, lambda x: x * torch.tensor(keep.astype(np.float32)) / (1.0 - p), randn(batch, *sample), [])
    put(c, "keep", keep.astype(np.float32))

    c = g.create_group("flatten")
    set_attrs(c, kind="flatten", mode="train")
    run_case(c, lambda x: torch.flatten(x, 1), randn(2, 3, 4, 5), [])

    for mode in ("train", "eval"):
        m = nn.BatchNorm2d(3, momentum=0.1, eps=1e-5)
        init_module_random([("", m)])
        m.train(mode == "train")
        c = g.create_group("batchnorm_" + mode)
        set_attrs(c, kind="batchnorm2d", mode=mode, channels=3, momentum=0.1, eps=1e-5)
        run_case(c, m, randn(4, 3, 5, 6, scale=2.0) + 0.5, module_params([("", m)]), train=(mode == "train"))

    for name, shape in (("layernorm_2d", (5, 12)), ("layernorm_3d", (3, 4, 12))):
        m = nn.LayerNorm(12, eps=1e-5)
        init_module_random([("", m)])
        c = g.create_group(name)
        set_attrs(c, kind="layernorm", mode="train", features=12, eps=1e-5)
        run_case(c, m, randn(*shape, scale=1.5) + 0.3, module_params([("", m)]))

    for name, cin, cout, stride in (("residual_identity", 4, 4, 1), ("residual_projection", 4, 6, 2)):
        blk = BasicBlock(cin, cout, stride)
        init_module_random(blk.named())
        c = g.create_group(name)
        set_attrs(c, kind="residual_basic", mode="train", in_channels=cin, out_channels=cout, stride=stride)
        run_case(c, blk, randn(3, cin, 6, 5), module_params(blk.named()))

    # Loss: torch's mean cross-entropy; Strata returns the sum and takes scale = 1/B.
    batch, classes = 6, 5
    logits = randn(batch, classes, scale=2.0)
    labels = RNG.randint(0, classes, batch).astype(np.int32)
    c = g.create_group("softmax_xent")
    set_attrs(c, kind="softmax_xent", mode="train", classes=classes)
    put(c, "labels", labels, np.int32)
    xt = t(logits, grad=True)
    loss = F.cross_entropy(xt, torch.tensor(labels, dtype=torch.int64))
    loss.backward()
    put(c, "input", logits)
    put(c, "output", loss.detach().numpy())  # scalar: the mean over the batch
    put(c, "grad_input", xt.grad.numpy())


# ---- the model zoo ---------------------------------------------------------------------------

class BasicBlock(nn.Module):
    """Strata's ResidualBlock::basic: relu(bn2(conv2(relu(bn1(conv1 x)))) + shortcut x)."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.proj = stride != 1 or cin != cout
        if self.proj:
            self.sc_conv = nn.Conv2d(cin, cout, 1, stride, 0, bias=False)
            self.sc_bn = nn.BatchNorm2d(cout)

    def named(self, prefix=""):
        pre = prefix + "/" if prefix else ""
        out = [(pre + "conv1", self.conv1), (pre + "bn1", self.bn1), (pre + "conv2", self.conv2),
               (pre + "bn2", self.bn2)]
        if self.proj:
            out += [(pre + "shortcut/conv", self.sc_conv), (pre + "shortcut/bn", self.sc_bn)]
        return out

    def forward(self, x):
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        s = self.sc_bn(self.sc_conv(x)) if self.proj else x
        return F.relu(y + s)


class Mlp(nn.Module):
    def __init__(self, features, hidden, classes):
        super().__init__()
        sizes = [features] + hidden + [classes]
        self.fcs = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def named(self):
        return [("fc%d" % (i + 1), m) for i, m in enumerate(self.fcs)]

    def forward(self, x):
        h = torch.flatten(x, 1)
        for i, fc in enumerate(self.fcs):
            h = fc(h)
            if i + 1 < len(self.fcs):
                h = F.relu(h)
        return h


class Cnn(nn.Module):
    def __init__(self, c, h, w, classes):
        super().__init__()
        self.conv1 = nn.Conv2d(c, 32, 3, 1, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1, 1)
        self.fc1 = nn.Linear(64 * (h // 2 // 2) * (w // 2 // 2), 128)
        self.fc2 = nn.Linear(128, classes)

    def named(self):
        return [("conv1", self.conv1), ("conv2", self.conv2), ("fc1", self.fc1), ("fc2", self.fc2)]

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.conv1(x)), 2, 2)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2, 2)
        h = F.relu(self.fc1(torch.flatten(h, 1)))
        return self.fc2(h)


class ResNet(nn.Module):
    def __init__(self, c, depth, width, classes):
        super().__init__()
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(c, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.blocks = nn.ModuleList()
        self.block_names = []
        ch = width
        for stage in range(3):
            out = width << stage
            for i in range(n):
                self.blocks.append(BasicBlock(ch, out, 2 if stage > 0 and i == 0 else 1))
                self.block_names.append("block%d_%d" % (stage + 1, i + 1))
                ch = out
        self.fc = nn.Linear(ch, classes)

    def named(self):
        out = [("conv1", self.conv1), ("bn1", self.bn1)]
        for name, b in zip(self.block_names, self.blocks):
            out += b.named(name)
        return out + [("fc", self.fc)]

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        for b in self.blocks:
            h = b(h)
        return self.fc(h.mean(dim=(2, 3)))


def strata_init(named, seed):
    """Loads Strata's initial parameters (parameter_store.cpp) into the torch modules."""
    with torch.no_grad():
        for prefix, mod in named:
            if isinstance(mod, (nn.Linear, nn.Conv2d)):
                fan_in = int(np.prod(mod.weight.shape[1:]))
                mod.weight.copy_(t(strata_fan_in_uniform(seed, prefix + "/weight", tuple(mod.weight.shape), fan_in)))
                if mod.bias is not None:
                    mod.bias.copy_(t(strata_fan_in_uniform(seed, prefix + "/bias", tuple(mod.bias.shape), fan_in)))
            elif isinstance(mod, nn.BatchNorm2d):
                mod.reset_parameters()  # weight 1, bias 0, running mean 0, running var 1


def model_cases(root):
    g = root.create_group("models")
    cfgs = [  # name, model, input shape, classes, batch, extra attrs
        ("mlp", Mlp(64, [32, 16], 7), (1, 8, 8), 7, 6, dict(hidden="32,16")),
        ("cnn", Cnn(1, 12, 12, 10), (1, 12, 12), 10, 5, {}),
        ("resnet8", ResNet(3, 8, 4, 10), (3, 8, 8), 10, 4, dict(depth=8, width=4)),
    ]
    seed = 42
    for name, model, shape, classes, batch, extra in cfgs:
        named = model.named()
        strata_init(named, seed)
        model.train()
        c = g.create_group(name)
        set_attrs(c, model=name.rstrip("0123456789"), classes=classes, seed=seed, **extra)
        params = module_params(named)
        pg = c.create_group("params")
        for pname, p, _ in params:
            put(pg, pname, p.detach().numpy())
        x = randn(batch, *shape)
        labels = RNG.randint(0, classes, batch).astype(np.int32)
        put(c, "input", x)
        put(c, "labels", labels, np.int32)
        xt = t(x, grad=True)
        logits = model(xt)
        loss = F.cross_entropy(logits, torch.tensor(labels, dtype=torch.int64))
        loss.backward()
        put(c, "logits", logits.detach().numpy())
        put(c, "loss", loss.detach().numpy())
        put(c, "grad_input", xt.grad.numpy())
        gg = c.create_group("grads")
        ug = None
        for pname, p, tr in params:
            if tr:
                put(gg, pname, p.grad.numpy())
            else:
                ug = ug or c.create_group("updated")
                put(ug, pname, p.detach().numpy())


# ---- optimizers, schedules, clipping ---------------------------------------------------------

def optim_cases(root):
    g = root.create_group("optim")
    n, steps = 37, 5  # 37: not a multiple of any vector width
    p0 = randn(n)
    grads = randn(steps, n)
    cfgs = [
        ("sgd_momentum", "sgd", dict(lr=0.1, momentum=0.9, nesterov=False, weight_decay=1e-4)),
        ("sgd_nesterov", "sgd", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)),
        ("sgd_plain", "sgd", dict(lr=0.1, momentum=0.0, nesterov=False, weight_decay=1e-4)),
        ("adamw", "adamw", dict(lr=0.01, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.01)),
        ("adamw_default_betas", "adamw", dict(lr=0.003, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)),
    ]
    for name, kind, kw in cfgs:
        p = torch.nn.Parameter(t(p0))
        if kind == "sgd":
            opt = torch.optim.SGD([p], lr=kw["lr"], momentum=kw["momentum"], dampening=0.0,
                                  nesterov=kw["nesterov"], weight_decay=kw["weight_decay"])
        else:
            opt = torch.optim.AdamW([p], lr=kw["lr"], betas=(kw["beta1"], kw["beta2"]), eps=kw["eps"],
                                    weight_decay=kw["weight_decay"])
        out = []
        for s in range(steps):
            p.grad = t(grads[s])
            opt.step()
            out.append(p.detach().numpy().copy())
        c = g.create_group(name)
        set_attrs(c, name=kind, **kw)
        put(c, "params0", p0)
        put(c, "grads", grads)
        put(c, "params", np.stack(out))
        st = opt.state[p]
        sg = c.create_group("state")
        if kind == "sgd" and kw["momentum"] != 0:
            put(sg, "momentum", st["momentum_buffer"].numpy())
        elif kind == "adamw":
            put(sg, "exp_avg", st["exp_avg"].numpy())
            put(sg, "exp_avg_sq", st["exp_avg_sq"].numpy())

    # Schedules: the lr torch's scheduler gives at each optimizer step (0-based).
    sg = root.create_group("sched")

    def torch_lrs(make, steps, lr):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        sch = make(opt)
        lrs = []
        for _ in range(steps):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sch.step()
        return np.array(lrs, dtype=np.float64)

    lrs_sched = torch.optim.lr_scheduler

    def warm(opt, w):  # Strata's warm-up: lr * (step + 1) / w for step < w
        return lrs_sched.LinearLR(opt, start_factor=1.0 / w, end_factor=1.0, total_iters=w - 1)

    cases = [
        ("constant", dict(kind="constant", lr=0.05), 12,
         lambda o: lrs_sched.LambdaLR(o, lambda s: 1.0), "torch"),
        ("step", dict(kind="step", lr=0.1, step_size=3, gamma=0.5), 14,
         lambda o: lrs_sched.StepLR(o, step_size=3, gamma=0.5), "torch"),
        ("constant_warmup", dict(kind="constant", lr=0.05, warmup_steps=4), 12,
         lambda o: lrs_sched.SequentialLR(o, [warm(o, 4), lrs_sched.ConstantLR(o, factor=1.0, total_iters=0)],
                                          milestones=[4]), "torch"),
        ("step_warmup", dict(kind="step", lr=0.1, warmup_steps=3, step_size=4, gamma=0.3), 16,
         lambda o: lrs_sched.SequentialLR(o, [warm(o, 3), lrs_sched.StepLR(o, step_size=4, gamma=0.3)],
                                          milestones=[3]), "torch"),
        ("cosine", dict(kind="cosine", lr=0.2, total_steps=20, min_lr=0.001), 21,
         lambda o: lrs_sched.CosineAnnealingLR(o, T_max=20, eta_min=0.001), "torch"),
    ]
    for name, cfg, steps, make, ref in cases:
        c = sg.create_group(name)
        set_attrs(c, reference=ref, **cfg)
        put(c, "lr", torch_lrs(make, steps, cfg["lr"]), np.float64)

    # Warm-up + cosine: SequentialLR(LinearLR, CosineAnnealingLR) in torch 1.13 steps the
    # cosine scheduler with an explicit epoch at the milestone (the deprecated closed-form
    # path) and then recursively, and CosineAnnealingLR is periodic past T_max where Strata
    # holds min_lr. So the reference is the formula, written out here:
    #   step < W:  lr * (step + 1) / W
    #   else:      min_lr + (lr - min_lr) * (1 + cos(pi * min((step - W) / (T - W), 1))) / 2
    lr, w, total, min_lr = 0.1, 5, 25, 0.002
    lrs = []
    for s in range(32):  # past total_steps: held at min_lr
        if s < w:
            lrs.append(lr * (s + 1) / w)
        else:
            frac = min((s - w) / (total - w), 1.0)
            lrs.append(min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * frac)))
    c = sg.create_group("cosine_warmup")
    set_attrs(c, reference="formula", kind="cosine", lr=lr, warmup_steps=w, total_steps=total, min_lr=min_lr)
    put(c, "lr", lrs, np.float64)
    # ... and, as a check on the formula itself, torch's own composition over the cosine's
    # first period where the two agree mathematically (recorded, compared loosely in C++).
    put(c, "lr_torch_sequential", torch_lrs(
        lambda o: lrs_sched.SequentialLR(o, [warm(o, w), lrs_sched.CosineAnnealingLR(o, T_max=total - w, eta_min=min_lr)],
                                         milestones=[w]), total + 1, lr), np.float64)

    # Linear decay and warmup-stable-decay (wsd) with a linear decay: torch's own compositions
    # (LinearLR from 1 to min_lr / lr, after a ConstantLR for wsd's stable phase).
    lr, w, total, min_lr, decay = 0.1, 4, 20, 0.01, 6
    for name, cfg, make in (
            ("linear", dict(kind="linear", lr=lr, total_steps=total, min_lr=min_lr),
             lambda o: lrs_sched.LinearLR(o, start_factor=1.0, end_factor=min_lr / lr, total_iters=total)),
            ("linear_warmup", dict(kind="linear", lr=lr, warmup_steps=w, total_steps=total, min_lr=min_lr),
             lambda o: lrs_sched.SequentialLR(o, [warm(o, w), lrs_sched.LinearLR(o, 1.0, min_lr / lr, total - w)],
                                              milestones=[w])),
            ("wsd", dict(kind="wsd", lr=lr, warmup_steps=w, total_steps=total, min_lr=min_lr, decay_steps=decay,
                         decay_shape="linear"),
             lambda o: lrs_sched.SequentialLR(o, [warm(o, w), lrs_sched.ConstantLR(o, factor=1.0, total_iters=0),
                                                  lrs_sched.LinearLR(o, 1.0, min_lr / lr, decay)],
                                              milestones=[w, total - decay]))):
        c = sg.create_group(name)
        set_attrs(c, reference="torch", **cfg)
        put(c, "lr", torch_lrs(make, total + 3, lr), np.float64)
    # wsd's other decay shapes, and its default decay (the last fifth of the run): the formula of
    # Hägele et al. 2024 (1 - sqrt of the decay's progress) and the half cosine, written out.
    total = 30
    for name, shape, factor in (("wsd_sqrt", "sqrt", lambda p: 1 - math.sqrt(p)),
                                ("wsd_cosine", "cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p)))):
        start = total - total // 5
        lrs = [lr * (s + 1) / w if s < w else lr if s < start else
               min_lr + (lr - min_lr) * factor(min((s - start) / (total - start), 1.0)) for s in range(total + 3)]
        c = sg.create_group(name)
        set_attrs(c, reference="formula", kind="wsd", lr=lr, warmup_steps=w, total_steps=total, min_lr=min_lr,
                  decay_shape=shape)
        put(c, "lr", lrs, np.float64)

    cg = root.create_group("clip")
    for name, scale, max_norm in (("clip_active", 1.0, 1.5), ("clip_inactive", 0.05, 10.0)):
        shapes = [(3, 4), (5,), (2, 3, 3)]
        tensors = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        for p in tensors:
            p.grad = t(randn(*p.shape, scale=scale))
        flat = np.concatenate([p.grad.numpy().ravel() for p in tensors])
        norm = torch.nn.utils.clip_grad_norm_(tensors, max_norm)
        c = cg.create_group(name)
        set_attrs(c, max_norm=max_norm)
        put(c, "grads", flat)
        put(c, "clipped", np.concatenate([p.grad.numpy().ravel() for p in tensors]))
        put(c, "norm", float(norm), np.float64)


# ---- GPT (nanoGPT's model, written out) ------------------------------------------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
        att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, d)
        return self.c_proj(y)


class GptMlp(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class GptBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = GptMlp(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt(nn.Module):
    def __init__(self, layers, heads, d, seq_len, vocab, tied):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq_len, d)
        self.h = nn.ModuleList(GptBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight
        self.tied = tied
        self.layers = layers

    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for blk in self.h:
            x = blk(x)
        return self.lm_head(self.ln_f(x))

    def strata_params(self):
        """(Strata name, parameter, init std or None for LayerNorm/bias, decays)."""
        out = [("wte/weight", self.wte.weight), ("wpe/weight", self.wpe.weight)]
        for i, blk in enumerate(self.h):
            pre = "h%d/" % i
            for name, mod in (("ln_1", blk.ln_1), ("attn/c_attn", blk.attn.c_attn), ("attn/c_proj", blk.attn.c_proj),
                              ("ln_2", blk.ln_2), ("mlp/c_fc", blk.mlp.c_fc), ("mlp/c_proj", blk.mlp.c_proj)):
                out += [(pre + name + "/weight", mod.weight), (pre + name + "/bias", mod.bias)]
        out += [("ln_f/weight", self.ln_f.weight), ("ln_f/bias", self.ln_f.bias)]
        if not self.tied:
            out.append(("lm_head/weight", self.lm_head.weight))
        return out

    def strata_init(self, seed):
        """GPT-2's init as Strata draws it (gpt.hpp): N(0, 0.02), residual projections
        N(0, 0.02 / sqrt(2 * layers)), biases 0, LayerNorm 1 / 0."""
        proj_std = 0.02 / math.sqrt(2.0 * self.layers)
        with torch.no_grad():
            for name, p in self.strata_params():
                if "ln_" in name:
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    std = proj_std if name.endswith("c_proj/weight") else 0.02
                    p.copy_(t(strata_normal(seed, name, tuple(p.shape), std)))

    @staticmethod
    def decays(name, p):
        return p.dim() >= 2 and not name.startswith("wte/") and not name.startswith("wpe/")


def lm_step(c, model, named, vocab, batch, seq_len):
    """A language model's step on random tokens into case `c`: input, labels, logits, loss and
    every parameter's gradient. Returns the input tokens and the labels."""
    x = RNG.randint(0, vocab, (batch, seq_len)).astype(np.int32)
    y = RNG.randint(0, vocab, (batch, seq_len)).astype(np.int32)
    put(c, "input", x, np.int32)
    put(c, "labels", y, np.int32)
    logits = model(torch.tensor(x, dtype=torch.int64))
    loss = F.cross_entropy(logits.view(-1, vocab), torch.tensor(y, dtype=torch.int64).view(-1))
    loss.backward()
    put(c, "logits", logits.detach().numpy())
    put(c, "loss", loss.detach().numpy())
    gg = c.create_group("grads")
    for pname, p in named:
        put(gg, pname, p.grad.numpy())
    return x, y


def gpt_cases(root):
    g = root.create_group("gpt")
    layers, heads, d, seq_len, vocab, batch, seed = 2, 2, 32, 16, 256, 2, 1234
    lr, beta1, beta2, eps, wd, steps = 3e-3, 0.9, 0.95, 1e-8, 0.1, 20
    for name, tied in (("tied", True), ("untied", False)):
        torch.manual_seed(0)
        model = Gpt(layers, heads, d, seq_len, vocab, tied)
        model.strata_init(seed)
        named = model.strata_params()
        c = g.create_group(name)
        set_attrs(c, layers=layers, heads=heads, embed=d, seq_len=seq_len, vocab=vocab, tied=tied, seed=seed, lr=lr,
                  beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd, steps=steps)
        pg = c.create_group("params")
        for pname, p in named:
            put(pg, pname, p.detach().numpy())
        x, y = lm_step(c, model, named, vocab, batch, seq_len)

        # AdamW with nanoGPT's two parameter groups, from the same initial values.
        model.zero_grad(set_to_none=True)
        decay = [p for n, p in named if Gpt.decays(n, p)]
        no_decay = [p for n, p in named if not Gpt.decays(n, p)]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=lr, betas=(beta1, beta2), eps=eps)
        # Two batches in turn, so the loss falls fast enough (memorisation) for the optimizer's
        # details, the groups included, to show in it.
        xs = np.stack([x, y] * (steps // 2))
        ys = np.stack([y, x] * (steps // 2))
        losses = []
        for s in range(steps):
            opt.zero_grad(set_to_none=True)
            out = model(torch.tensor(xs[s], dtype=torch.int64))
            l = F.cross_entropy(out.view(-1, vocab), torch.tensor(ys[s], dtype=torch.int64).view(-1))
            l.backward()
            opt.step()
            losses.append(l.item())
        put(c, "train_input", xs, np.int32)
        put(c, "train_labels", ys, np.int32)
        put(c, "train_loss", losses, np.float64)
        fg = c.create_group("final")
        for pname, p in named:
            put(fg, pname, p.detach().numpy())


# ---- Llama (Hugging Face's LlamaModel, written out) ---------------------------------------------

def rope_inv_freq(dh, theta, scaling):
    """transformers' default rotary frequencies, and its "llama3" scaling (f32 throughout)."""
    inv = 1.0 / (theta ** (torch.arange(0, dh, 2, dtype=torch.int64).float() / dh))
    if scaling is None:
        return inv
    factor, low, high, old = scaling
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    inv_l = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, inv_l)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


class LlamaAttention(nn.Module):
    def __init__(self, d, heads, kv_heads, inv_freq):
        super().__init__()
        dh = d // heads
        self.q_proj = nn.Linear(d, heads * dh, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * dh, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * dh, bias=False)
        self.o_proj = nn.Linear(heads * dh, d, bias=False)
        self.heads, self.kv_heads, self.dh, self.inv_freq = heads, kv_heads, dh, inv_freq

    def forward(self, x):
        b, t, d = x.shape
        h, hkv, dh = self.heads, self.kv_heads, self.dh
        q = self.q_proj(x).view(b, t, h, dh).transpose(1, 2)
        k = self.k_proj(x).view(b, t, hkv, dh).transpose(1, 2)
        v = self.v_proj(x).view(b, t, hkv, dh).transpose(1, 2)
        freqs = torch.arange(t).float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(h // hkv, dim=1)  # query head i reads kv head i // (h / hkv)
        v = v.repeat_interleave(h // hkv, dim=1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(dh)
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
        att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, h * dh)
        return self.o_proj(y)


class LlamaMlp(nn.Module):
    def __init__(self, d, ffn):
        super().__init__()
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, d, heads, kv_heads, ffn, eps, inv_freq):
        super().__init__()
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = LlamaAttention(d, heads, kv_heads, inv_freq)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = LlamaMlp(d, ffn)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, layers, heads, kv_heads, d, ffn, vocab, eps, inv_freq, tied):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaBlock(d, heads, kv_heads, ffn, eps, inv_freq) for _ in range(layers))
        self.norm = RMSNorm(d, eps)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight
        self.tied = tied

    def forward(self, idx):
        x = self.embed_tokens(idx)
        for blk in self.layers:
            x = blk(x)
        return self.lm_head(self.norm(x))

    def strata_params(self):
        """(Strata name, parameter): Hugging Face's names with '/' for '.', wte for embed_tokens."""
        out = [("wte/weight", self.embed_tokens.weight)]
        for i, blk in enumerate(self.layers):
            for name, p in blk.named_parameters():
                out.append(("layers.%d/%s" % (i, name.replace(".", "/")), p))
        out.append(("norm/weight", self.norm.weight))
        if not self.tied:
            out.append(("lm_head/weight", self.lm_head.weight))
        return out


def llama_cases(root):
    """/llama/<case>: attrs layers, heads, kv_heads, embed, ffn_hidden, vocab, norm_eps, rope_theta,
    rope_scaling, tied, seed; init/<name> (Strata's initial values: N(0, 0.02) weights, RMSNorm 1),
    params/<name> (random values the comparison runs with, large enough that attention is far from
    uniform), input, labels, logits, loss, grads/<name>."""
    g = root.create_group("llama")
    layers, d, ffn, vocab, batch, t, eps, seed = 2, 32, 48, 64, 2, 12, 1e-5, 77
    cases = (("gqa", 4, 2, 10000.0, 0.0, False),
             ("mqa_tied_scaled", 4, 1, 500000.0, 8.0, True),
             ("mha", 2, 2, 10000.0, 0.0, False))
    for name, heads, kv_heads, theta, scaling, tied in cases:
        inv_freq = rope_inv_freq(d // heads, theta, (scaling, 1.0, 4.0, 8192) if scaling else None)
        model = Llama(layers, heads, kv_heads, d, ffn, vocab, eps, inv_freq, tied)
        named = model.strata_params()
        c = g.create_group(name)
        set_attrs(c, layers=layers, heads=heads, kv_heads=kv_heads, embed=d, ffn_hidden=ffn, vocab=vocab,
                  norm_eps=eps, rope_theta=theta, rope_scaling=scaling, tied=tied, seed=seed)
        ig, pg = c.create_group("init"), c.create_group("params")
        with torch.no_grad():
            for pname, p in named:
                if pname.endswith("norm/weight"):
                    put(ig, pname, np.ones(tuple(p.shape), np.float32))
                    p.copy_(t_(1.0 + randn(*p.shape, scale=0.2)))
                else:
                    put(ig, pname, strata_normal(seed, pname, tuple(p.shape), 0.02))
                    p.copy_(t_(randn(*p.shape, scale=0.3)))
                put(pg, pname, p.detach().numpy())
        lm_step(c, model, named, vocab, batch, t)


def t_(a):
    return torch.tensor(np.asarray(a, dtype=np.float32))


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: torch_reference.py OUT.h5")
    with h5py.File(sys.argv[1], "w") as f:
        f.attrs["torch_version"] = np.bytes_(torch.__version__)
        layer_cases(f)
        model_cases(f)
        optim_cases(f)
        gpt_cases(f)
        llama_cases(f)
    print("wrote", sys.argv[1])


if __name__ == "__main__":
    main()
