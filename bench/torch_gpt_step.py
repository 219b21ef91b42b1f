#!/usr/bin/env python3
"""torch_gpt_step.py: tokens/s of full PyTorch GPT training steps, the counterpart of
bench_gpt_step. Same model as Strata's gpt (torch_models.Gpt: tied head, exact GELU, LayerNorm
eps 1e-5, GPT-2 init, no dropout), same batch of random tokens, F.cross_entropy over every
position (mean), torch.optim.AdamW(betas=(0.9, 0.95), eps=1e-8) with Strata's parameter groups
(weight decay 0.1 on the Linear weights) and torch's default implementation for CPU tensors
(foreach=None, fused=None: the single-tensor loop), zero_grad(set_to_none=True); same warm-up
and timing (median of several timed windows). --model llama: torch_models.Llama, Strata's llama
(RMSNorm, rotate-half rotary positions, SwiGLU, grouped-query attention, tied head).

--attention sdpa (default where torch has it, >= 2.0) calls F.scaled_dot_product_attention
(is_causal=True); math writes out softmax(q k^T / sqrt(Dh) + mask) v, which is all torch 1.13
has. --attention-only times one such attention forward+backward on random (B, H, T, Dh)
tensors; with --memory it measures the peak resident memory of one call instead (see
peak_rss_of_one_call).

  python3 bench/torch_gpt_step.py --layers 4 --heads 4 --embed 256 --seq-len 256 --batch 8
  python3 bench/torch_gpt_step.py --attention-only --seq-len 2048 --memory
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # torch_models.py, from any cwd
import torch_models  # noqa: E402


def status_kib(field):
    """A field of /proc/self/status in KiB (VmRSS: resident now; VmHWM: peak since start or reset)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def reset_peak_rss():
    """Linux >= 4.0: writing 5 to clear_refs sets VmHWM to the current VmRSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def flops_per_token(params, a):
    """llm.c's model FLOPs per token: 6 N (N = every parameter, the tied wte once) + 6 L D T."""
    return 6 * params + 6 * a.layers * a.embed * a.seq_len


def run_steps(a):
    torch.manual_seed(a.seed)
    if a.model == "llama":
        ffn = a.ffn_hidden or (8 * a.embed // 3 + 255) // 256 * 256  # Llama's rule, as Strata's
        model = torch_models.Llama(a.layers, a.heads, a.kv_heads or a.heads, a.embed, ffn, a.seq_len, a.vocab,
                                   a.attention)
    else:
        model = torch_models.Gpt(a.layers, a.heads, a.embed, a.seq_len, a.vocab, a.attention)
    model.train()
    opt = torch.optim.AdamW(model.param_groups(a.weight_decay), lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    stream = torch.randint(0, a.vocab, (a.batch, a.seq_len + 1))
    x, y = stream[:, :-1].contiguous(), stream[:, 1:].contiguous()

    bf16 = a.dtype == "bf16"

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x).view(-1, a.vocab), y.view(-1))
        loss.backward()
        opt.step()
        return loss

    params = sum(p.numel() for p in model.parameters())  # the tied weight once
    fpt = flops_per_token(params, a)
    tokens = a.batch * a.seq_len
    print(f"torch {torch.__version__} {a.model} step: L{a.layers} H{a.heads} D{a.embed} T{a.seq_len} V{a.vocab}, "
          f"{a.attention} attention, {a.dtype}, batch {a.batch} ({tokens} tokens/step), AdamW "
          f"(foreach={opt.defaults.get('foreach')}, fused={opt.defaults.get('fused')}), "
          f"threads {torch.get_num_threads()}, {params} parameters")
    first = torch_models.warm_up(step, a.warmup)
    times, last = torch_models.timed_windows(step, a.windows, a.steps)
    rates = [a.steps * tokens / t for t in times]
    med = statistics.median(rates)
    print("windows (tokens/s): " + " ".join(f"{r:.0f}" for r in rates))
    print(f"loss: first {'-' if first is None else f'{first:.4f}'}, last {last:.4f}")
    print(f"median {med:.0f} tokens/s, {1e3 * tokens / med:.1f} ms/step, {med * fpt * 1e-9:.2f} GFLOP/s "
          f"({fpt:.4g} FLOP/token, llm.c's 6N + 6LDT)")
    print(f"RESULT impl=torch mode=step attention={a.attention} precision={a.dtype} threads={a.threads} tokens_per_s={med:.2f} "
          f"flops_per_token={fpt} params={params} version={torch.__version__}")

    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(a.profile_steps):
                step()
        print(f"\nper-op breakdown ({a.profile_steps} profiled steps; divide totals by that for per-step)")
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=40,
                                                                  max_name_column_width=40,
                                                                  max_shapes_column_width=60))


def attention_call(fn, q, k, v, dy):
    """One forward+backward; returns the forward's seconds. Gradients come back from
    autograd.grad (fresh tensors each call, nothing accumulates into .grad)."""
    t0 = time.perf_counter()
    out = fn(q, k, v)
    fwd = time.perf_counter() - t0
    torch.autograd.grad(out, (q, k, v), dy)
    return fwd


def peak_rss_of_one_call(fn, q, k, v, dy):
    """The peak resident set of one forward+backward above the resident set before it (MiB):
    VmHWM is reset to VmRSS, then read after the call. torch's CPU allocator has no statistics
    of its own (no caching: tensors come from malloc and go back to it), so this is the one
    measure that sees everything, including the kernels' scratch. Run under
    MALLOC_MMAP_THRESHOLD_=131072 (run_gpt_vs_torch.sh does, for both sides): blocks of 128 KiB
    and more are then mmap'ed and unmapped on free, so memory freed by the warm-up call is not
    resident any more, and the measured call's pages are its own. -1 without clear_refs."""
    before = status_kib("VmRSS")
    if not reset_peak_rss():
        return -1.0
    attention_call(fn, q, k, v, dy)
    return (status_kib("VmHWM") - before) / 1024.0


def sdpa_backend(q, k, v):
    """The kernel SDPA picks for these inputs (torch's private _fused_sdp_choice: for the log)."""
    try:
        from torch.nn.attention import SDPBackend
        choice = int(torch._fused_sdp_choice(q, k, v, None, 0.0, True))
        return next((name for name, b in SDPBackend.__members__.items() if int(b.value) == choice), str(choice))
    except (ImportError, AttributeError, RuntimeError, TypeError):
        return "unknown"


def run_attention(a):
    fn = torch_models.ATTENTIONS[a.attention]
    g = torch.Generator().manual_seed(a.seed)
    shape = (a.batch, a.heads, a.seq_len, a.head_dim)
    q, k, v = (torch.randn(shape, generator=g).requires_grad_() for _ in range(3))
    dy = torch.randn(shape, generator=g)
    pairs = a.batch * a.heads * a.seq_len * (a.seq_len + 1) / 2
    flops = 12.0 * a.head_dim * pairs  # as bench_gpt_step: 2 matmuls forward, 4 backward, causal half
    backend = f", SDPA backend {sdpa_backend(q, k, v)}" if a.attention == "sdpa" else ""
    print(f"torch {torch.__version__} attention ({a.attention}{backend}): B {a.batch}, H {a.heads}, T {a.seq_len}, "
          f"Dh {a.head_dim}, threads {torch.get_num_threads()}")
    for _ in range(max(a.warmup, 1 if a.memory else 0)):
        attention_call(fn, q, k, v, dy)
    if a.memory:
        peak = peak_rss_of_one_call(fn, q, k, v, dy)
        print(f"peak memory of one call above the inputs: resident set {peak:.1f} MiB")
        print(f"RESULT impl=torch mode=memory attention={a.attention} seq_len={a.seq_len} rss_peak_mib={peak:.1f} "
              f"version={torch.__version__}")
        return
    totals, fwds = [], []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        fwds.append(attention_call(fn, q, k, v, dy))
        totals.append(time.perf_counter() - t0)
    ms, fwd_ms = 1e3 * statistics.median(totals), 1e3 * statistics.median(fwds)
    print(f"forward+backward: median {ms:.2f} ms (forward {fwd_ms:.2f} ms), {flops / ms * 1e-6:.1f} GFLOP/s "
          f"({flops:.4g} model FLOPs)")
    print(f"RESULT impl=torch mode=attention attention={a.attention} seq_len={a.seq_len} threads={a.threads} "
          f"ms={ms:.3f} fwd_ms={fwd_ms:.3f} gflops={flops / ms * 1e-6:.2f} version={torch.__version__}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["gpt", "llama"], default="gpt")
    p.add_argument("--kv-heads", type=int, default=0, help="llama: key/value heads (0: --heads)")
    p.add_argument("--ffn-hidden", type=int, default=0, help="llama: SwiGLU hidden size (0: Llama's rule)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--embed", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--attention", choices=sorted(torch_models.ATTENTIONS), default=torch_models.default_attention())
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: torch.autocast (bf16 matrix products), the counterpart of Strata's --precision bf16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--attention-only", action="store_true")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--memory", action="store_true")
    a = p.parse_args()
    if a.attention == "sdpa" and not hasattr(F, "scaled_dot_product_attention"):
        raise SystemExit(f"--attention sdpa: torch {torch.__version__} has no F.scaled_dot_product_attention")
    torch.set_num_threads(a.threads)
    if a.attention_only:
        run_attention(a)
    else:
        run_steps(a)


if __name__ == "__main__":
    main()
