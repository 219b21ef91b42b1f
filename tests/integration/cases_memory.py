"""Memory (issue #18): the --device-memory cap refuses a layout whose plan does not fit with one
line before allocating, holds a CPU rank to it while training, and the same model trains under
the same cap once tensor and pipeline parallelism divide it, with the 1-rank result."""
import os
import re

from cases_gpt import SGD, UNTIED, assert_close, gpt_run, tokenize
from cases_tensor_parallel import GPT4
from harness import expect_bad_input


def case_memory_cap(args):
    """The tiny GPT (4 heads, vocabulary 260) plans 924 KiB on one rank, which measures ~2.6 MB
    (the plan does not count what layers save for backward yet). Under --device-memory 800KiB:
    one rank is refused by the plan (exit 2, one line naming the fullest rank, its parts and
    the largest, activations); with 1500KiB the plan fits but the allocator stops the run
    during the first step (exit 2, one line); tp 2 x pp 2 on 4 ranks trains under that 1500KiB
    (checkpoints and the final evaluation included) and matches 1 rank without a cap within 1e-5."""
    data = tokenize(args, "byte")
    flags = GPT4 + SGD + UNTIED + ["--data", data[0], "--steps", "2", "--global-batch", "16"]
    expect_bad_input(args, flags + ["--device-memory", "800KiB"],
                     r"--device-memory 800\.00 KiB is too small: rank 0 \(stage 0, replica 0\) needs [0-9.]+ KiB by "
                     r"the plan \(parameters .*; the largest part, activations .* does not fit", ranks=1)
    expect_bad_input(args, flags + ["--device-memory", "1500KiB"],
                     r"--device-memory: \d+ more bytes would bring this rank to \d+ bytes of tensors, over its 1536000",
                     ranks=1)
    expect_bad_input(args, flags + ["--device-memory", "12 GiB"], r"--device-memory expects a size", ranks=1)
    print("1 rank under 800KiB: refused by the plan; under 1500KiB: stopped by the allocator")

    reference, _ = gpt_run(args, 1, SGD + UNTIED, data, "cap-1", model=GPT4)
    layout = ["--tp", "2", "--pp", "2", "--micro-batch", "4", "--device-memory", "1500KiB"]
    model, out = gpt_run(args, 4, SGD + UNTIED + layout, data, "cap-tp2xpp2", model=GPT4)
    peaks = [int(v) for v in re.search(r"memory high-water mark per rank \([^)]*\):([ 0-9]+)$", out, re.M).group(1).split()]
    assert len(peaks) == 4 and max(peaks) <= 1500 * 1024, peaks
    assert_close(model, reference, "tp 2 x pp 2 under --device-memory 1500KiB vs 1 rank without")
    print(f"tp 2 x pp 2 under 1500 KiB (which 1 rank cannot meet): high-water marks {peaks} bytes")
