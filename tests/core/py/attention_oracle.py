#!/usr/bin/env python3
"""PyTorch oracle for Strata's causal attention ops (tests/core/test_attention_parity.cpp).

Writes random float32 inputs and PyTorch's causal scaled dot-product attention of them (the
output y, the row log-sum-exp and the gradients of sum(y * dy)) to one little-endian binary
file, which the C++ test reads and compares with ops::attention_* and ops::flash_attention_*
within 1e-5 of each tensor's largest magnitude. The reference is computed in float64 from
the float32 inputs, with torch's own kernel (torch.nn.functional.scaled_dot_product_attention,
or its 1.13 name _scaled_dot_product_attention) checked against the explicit softmax formula.

Layout: b"STRATT01", int32 case count, then per case int32 (B, H, T, Dh) followed by float32
q, k, v, dy, y, dq, dk, dv (B, H, T, Dh each) and lse (B, H, T).

Usage: attention_oracle.py OUT_FILE
"""
import math
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F

CASES = [(2, 3, 37, 16), (1, 2, 130, 64), (2, 2, 1, 8), (1, 1, 300, 8)]


def torch_sdpa(q, k, v):
    """Causal attention with torch's kernel (no dropout)."""
    if hasattr(F, "scaled_dot_product_attention"):  # torch >= 2.0
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F._scaled_dot_product_attention(q, k, v, None, 0.0, False, True)[0]  # torch 1.13


def explicit(q, k, v):
    t = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


def main():
    out_path = sys.argv[1]
    gen = torch.Generator().manual_seed(20240601)
    chunks = [b"STRATT01", struct.pack("<i", len(CASES))]
    for b, h, t, dh in CASES:
        shape = (b, h, t, dh)
        # float32 values (what the C++ side reads), widened to float64 for the reference.
        q, k = [(torch.rand(shape, generator=gen) * 4 - 2).float() for _ in range(2)]
        v, dy = [(torch.rand(shape, generator=gen) * 2 - 1).float() for _ in range(2)]
        q64, k64, v64 = [x.double().requires_grad_(True) for x in (q, k, v)]
        y = torch_sdpa(q64, k64, v64)
        y.backward(dy.double())
        y_ref, lse = explicit(q64.detach(), k64.detach(), v64.detach())
        err = (y.detach() - y_ref).abs().max().item()
        assert err < 1e-12, f"torch's kernel and the explicit formula differ by {err} for {shape}"
        chunks.append(struct.pack("<4i", b, h, t, dh))
        for x in (q, k, v, dy, y.detach(), q64.grad, k64.grad, v64.grad, lse):
            chunks.append(np.ascontiguousarray(x.detach().numpy(), dtype="<f4").tobytes())
    with open(out_path, "wb") as f:
        f.write(b"".join(chunks))
    print(f"attention_oracle: {len(CASES)} cases written to {out_path}")


if __name__ == "__main__":
    main()
