"""Activation recomputation (--recompute block|full) end to end on the tiny GPT of
cases_tensor_parallel.py (4 heads, --vocab 260, so tp 2 splits it): on every layout the final
checkpoint's /model tensors are exactly those of --recompute none (rtol 0): recomputing the
blocks' forward in backward runs the same ops on the same inputs with the same dropout keys."""
import numpy as np

from cases_gpt import GPT_FLAGS_UNTIED, gpt_run, tokenize
from cases_tensor_parallel import GPT4
from harness import expect_bad_input


def assert_identical(a, b, what):
    """Every /model tensor of `a` bit-for-bit equal to `b`'s."""
    assert a and set(a) == set(b), (what, sorted(a), sorted(b))
    for n in sorted(a):
        assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, (what, n)
        differ = int(np.count_nonzero(a[n].view(np.uint8) != b[n].view(np.uint8)))
        assert differ == 0, f"{what}: {n} differs in {differ} bytes from --recompute none"
    print(f"{what}: {len(a)} tensors identical")


def case_recompute_equivalence(args):
    """20 steps of SGD-momentum with dropout 0.1, --recompute block and full against none on:
    1 rank, dp 2 under ZeRO 3 (parameters gathered per layer around the recomputing backward),
    pp 2 (4 micro-batches in flight), tp 2 (the recomputed forward re-issues its all-reduces),
    bf16 on 1 rank, tp 2 x pp 2, the interleaved schedule (2 chunks per rank) and tp 2 x dp 2
    under ZeRO 3 in bf16: every /model tensor identical."""
    data = tokenize(args, "byte")
    layouts = {
        "1": (1, ()),
        "dp2-zero3": (2, ("--zero", "3")),
        "pp2": (2, ("--pp", "2", "--micro-batch", "4")),
        "tp2": (2, ("--tp", "2")),
        "bf16": (1, ("--precision", "bf16")),
        "tp2xpp2": (4, ("--tp", "2", "--pp", "2", "--micro-batch", "4")),
        "pp2-interleaved": (2, ("--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--micro-batch", "4")),
        "tp2xdp2-zero3-bf16": (4, ("--tp", "2", "--zero", "3", "--precision", "bf16")),
    }
    for name, (ranks, flags) in layouts.items():
        reference, _ = gpt_run(args, ranks, GPT_FLAGS_UNTIED + list(flags), data, f"{name}-none", steps=20, model=GPT4)
        for mode in ("block", "full"):
            got, out = gpt_run(args, ranks, GPT_FLAGS_UNTIED + list(flags) + ["--recompute", mode], data,
                               f"{name}-{mode}", steps=20, model=GPT4)
            assert f"recompute {mode}" in out, out  # the model summary names it
            assert_identical(got, reference, f"{name} --recompute {mode}")


def case_recompute_bad_inputs(args):
    """An unknown --recompute value, and --recompute on a model without transformer blocks:
    one line each, exit 2."""
    data = tokenize(args, "byte")
    expect_bad_input(args, GPT4 + ["--data", data[0], "--steps", "1", "--recompute", "all"],
                     r"--recompute must be none, block or full, found 'all'")
    expect_bad_input(args, ["--model", "mlp", "--data", data[0], "--steps", "1", "--recompute", "block"],
                     r"--recompute block applies to the gpt models.*--model mlp runs with --recompute none")
