"""torch_models.py: what the torch benchmarks share: Strata's zoo models as torch.nn.Sequential
(mlp 784-hidden-10, cnn) and its GPT (class Gpt, for torch_gpt_step.py), the common flags, the fixed random batch, the
training step (SGD momentum 0.9, F.cross_entropy, zero_grad(set_to_none=True)) and the timing
loop (untimed warm-up, then timed windows; the caller takes the median). On a GPU (--device
cuda) the step can run under bf16 autocast (--dtype bf16) and each window ends with a
synchronisation, so it times the GPU's work and not only the launches.
"""
import contextlib
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def build(name, hidden):
    if name == "mlp":
        layers, width = [nn.Flatten()], 784
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 10))
        return nn.Sequential(*layers)
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))
    raise SystemExit(f"--model must be mlp or cnn, found {name!r}")


def build_from_args(a):
    return build(a.model, [int(h) for h in a.hidden.split(",") if h])


def add_common_args(p, batch_help=None, threads_help=None):
    """The flags of both scripts, with the defaults of the C++ benchmarks."""
    p.add_argument("--model", default="mlp")
    p.add_argument("--hidden", default="1024,1024")
    p.add_argument("--batch", type=int, default=128, help=batch_help)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--windows", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help=threads_help)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=1)


def add_device_args(p):
    """--device cpu|cuda and --dtype fp32|bf16 (bf16: torch.autocast, fp32 parameters and optimizer,
    matrix products and convolutions in bf16, the counterpart of Strata's --precision bf16)."""
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--tf32", action="store_true", help="allow TF32 for fp32 matmul/conv on the GPU (off, like Strata's --tf32)")


def setup_device(a):
    """Applies --device/--tf32; returns the torch.device."""
    device = torch.device(a.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no GPU")
        torch.backends.cuda.matmul.allow_tf32 = a.tf32
        torch.backends.cudnn.allow_tf32 = a.tf32
    return device


def autocast(a):
    """The context of a forward pass for --dtype."""
    if a.dtype == "bf16":
        return torch.autocast(device_type=a.device, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def synchronizer(device):
    """What ends a timed window: waits for the GPU's queued work (nothing on the CPU)."""
    return torch.cuda.synchronize if device.type == "cuda" else None


def random_batch(batch, generator=None):
    """x uniform in [0, 1) of shape (batch, 1, 28, 28), y labels in 0..9."""
    x = torch.rand(batch, 1, 28, 28, generator=generator)
    y = torch.randint(0, 10, (batch,), generator=generator)
    return x, y


def make_step(model, opt, x, y, context=contextlib.nullcontext):
    def step():
        # Strata zeroes its flat gradient buffer; set_to_none is torch's cheapest equivalent
        # (and the default from torch 2.0).
        opt.zero_grad(set_to_none=True)
        with context():
            loss = F.cross_entropy(model(x), y)
        loss.backward()  # DDP: bucketed all-reduce overlapped with backward, waited for at its end
        opt.step()
        return loss

    return step


def warm_up(step, n):
    """Runs n untimed steps; returns the first one's loss (None when n is 0)."""
    first = None
    for s in range(n):
        l = step()
        if s == 0:
            first = l.item()
    return first


def timed_windows(step, windows, steps, before=None, elapsed=lambda t: t, sync=None):
    """Times `windows` windows of `steps` steps each; returns (seconds per window, last loss).
    before() runs ahead of each window (a barrier); sync() ends it (GPU work done); elapsed(t)
    maps a window's time (max over ranks)."""
    times, l = [], None
    if sync is not None:
        sync()
    for _ in range(windows):
        if before is not None:
            before()
        t0 = time.perf_counter()
        for _ in range(steps):
            l = step()
        if sync is not None:
            sync()
        times.append(elapsed(time.perf_counter() - t0))
    return times, l.item()


# ---- GPT (bench/torch_gpt_step.py) -----------------------------------------------------------
# Strata's build_gpt as tools/export_torch.py writes it (nanoGPT's layout): wte + wpe, pre-LN
# blocks (LayerNorm eps 1e-5, c_attn D -> 3D, causal attention, c_proj, c_fc D -> 4D, exact
# GELU, c_proj, all with bias), ln_f, lm_head tied to wte; no dropout. GPT-2's init.

def causal_attention_math(q, k, v):
    """softmax(q k^T / sqrt(Dh) masked to j <= i) v on (B, H, T, Dh), written out: what torch
    1.13 (no scaled_dot_product_attention) runs, and SDPA's math backend. Materialises (T, T)."""
    t = q.shape[-2]
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    return torch.softmax(att.masked_fill(~mask, float("-inf")), dim=-1) @ v


def causal_attention_sdpa(q, k, v):
    """F.scaled_dot_product_attention(is_causal=True) (torch >= 2.0): on the CPU its fused
    flash-attention kernel for f32, O(T) memory per head."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


ATTENTIONS = {"math": causal_attention_math, "sdpa": causal_attention_sdpa}


def default_attention():
    """sdpa where torch has it (2.0 and newer), else math."""
    return "sdpa" if hasattr(F, "scaled_dot_product_attention") else "math"


class GptAttention(nn.Module):
    def __init__(self, embed, heads, attention):
        super().__init__()
        self.c_attn = nn.Linear(embed, 3 * embed)
        self.c_proj = nn.Linear(embed, embed)
        self.heads = heads
        self.attention = ATTENTIONS[attention]

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, H, T, Dh)
        y = self.attention(q, k, v).transpose(1, 2).contiguous().view(b, t, d)
        return self.c_proj(y)


class GptBlock(nn.Module):
    def __init__(self, embed, heads, attention):
        super().__init__()
        self.ln_1 = nn.LayerNorm(embed, eps=1e-5)
        self.attn = GptAttention(embed, heads, attention)
        self.ln_2 = nn.LayerNorm(embed, eps=1e-5)
        self.c_fc = nn.Linear(embed, 4 * embed)
        self.c_proj = nn.Linear(4 * embed, embed)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))  # exact GELU (erf), as Strata's


class Gpt(nn.Module):
    def __init__(self, layers, heads, embed, positions, vocab, attention):
        super().__init__()
        self.wte = nn.Embedding(vocab, embed)
        self.wpe = nn.Embedding(positions, embed)
        self.blocks = nn.ModuleList(GptBlock(embed, heads, attention) for _ in range(layers))
        self.ln_f = nn.LayerNorm(embed, eps=1e-5)
        self.lm_head = nn.Linear(embed, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        # GPT-2's init, as Strata's: N(0, 0.02^2), residual projections / sqrt(2 L), biases 0.
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "ln_" in name:
                nn.init.ones_(p)
            else:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def param_groups(self, weight_decay):
        """Strata's groups (nanoGPT's AdamW rule without the embeddings): decay on the Linear
        weights; biases, LayerNorm and the embeddings (wte, so the tied head too) without."""
        decay = [m.weight for m in self.modules() if isinstance(m, nn.Linear) and m is not self.lm_head]
        ids = {id(p) for p in decay}
        rest = [p for p in self.parameters() if id(p) not in ids]
        return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


# ---- Llama (bench/torch_gpt_step.py --model llama) -------------------------------------------
# Strata's build_llama: wte (tied head), pre-norm blocks (RMSNorm eps 1e-5; q/k/v/o projections
# without biases, rotary positions by rotate-half with theta 10000, grouped-query attention: each
# kv head repeated for its group of query heads; SwiGLU MLP down(silu(gate(x)) * up(x))), a final
# RMSNorm; no dropout. N(0, 0.02^2) init, o_proj and down_proj / sqrt(2 L).

class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, embed, heads, kv_heads, attention):
        super().__init__()
        self.heads, self.kv_heads, self.dh = heads, kv_heads, embed // heads
        self.q_proj = nn.Linear(embed, embed, bias=False)
        self.k_proj = nn.Linear(embed, kv_heads * self.dh, bias=False)
        self.v_proj = nn.Linear(embed, kv_heads * self.dh, bias=False)
        self.o_proj = nn.Linear(embed, embed, bias=False)
        self.attention = ATTENTIONS[attention]

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.dh).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.dh).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.dh).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return self.o_proj(self.attention(q, k, v).transpose(1, 2).reshape(b, t, d))


class LlamaBlock(nn.Module):
    def __init__(self, embed, heads, kv_heads, ffn, attention):
        super().__init__()
        self.input_layernorm = RMSNorm(embed)
        self.self_attn = LlamaAttention(embed, heads, kv_heads, attention)
        self.post_attention_layernorm = RMSNorm(embed)
        self.gate_proj = nn.Linear(embed, ffn, bias=False)
        self.up_proj = nn.Linear(embed, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, embed, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, layers, heads, kv_heads, embed, ffn, positions, vocab, attention, theta=10000.0):
        super().__init__()
        self.wte = nn.Embedding(vocab, embed)
        self.blocks = nn.ModuleList(LlamaBlock(embed, heads, kv_heads, ffn, attention) for _ in range(layers))
        self.norm = RMSNorm(embed)
        self.lm_head = nn.Linear(embed, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        dh = embed // heads
        freqs = theta ** (-torch.arange(0, dh, 2, dtype=torch.float32) / dh)
        angles = torch.outer(torch.arange(positions, dtype=torch.float32), freqs)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for name, p in self.named_parameters():
            if "norm" in name:
                continue
            std = 0.02 / math.sqrt(2 * layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            nn.init.normal_(p, 0.0, std)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x, self.cos[:t], self.sin[:t])
        return self.lm_head(self.norm(x))

    def param_groups(self, weight_decay):
        """As Gpt's: decay on the Linear weights; the norms and the (tied) embedding without."""
        decay = [m.weight for m in self.modules() if isinstance(m, nn.Linear) and m is not self.lm_head]
        ids = {id(p) for p in decay}
        rest = [p for p in self.parameters() if id(p) not in ids]
        return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
