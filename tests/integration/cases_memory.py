"""Memory (issue #18): the --device-memory cap refuses a layout whose plan does not fit with one
line before allocating, holds a CPU rank to it while training, and the same model trains under
the same cap once tensor and pipeline parallelism divide it, with the 1-rank result."""
import os
import re
import shutil

import numpy as np

from cases_gpt import SGD, UNTIED, assert_close, gpt_run, tokenize
from cases_tensor_parallel import GPT4
from harness import expect_bad_input, read_model, train_ranks, write_dataset


def case_memory_cap(args):
    """The tiny GPT (4 heads, vocabulary 260) plans 2.5 MiB on one rank (case_plan_matches_peak
    measures it). Under --device-memory 500KiB: one rank is refused by the plan (exit 2, one line
    naming the fullest rank, its parts and the largest, activations); a cap of exactly the plan
    trains (the allocator's stop, for what the plan would miss, is test_allocator's); no layout
    of 1 rank fits 500KiB (--plan), and the layout
    `--dry-run --plan --world 4` puts first trains on 4 ranks under 500KiB (checkpoints and
    the final evaluation included) and matches 1 rank without a
    cap within 1e-5; --dry-run of that layout prints the step time --plan ranked it by."""
    data = tokenize(args, "byte")
    flags = GPT4 + SGD + UNTIED + ["--data", data[0], "--steps", "2", "--global-batch", "16"]
    expect_bad_input(args, flags + ["--device-memory", "500KiB"],
                     r"--device-memory 500\.00 KiB is too small: rank 0 \(stage 0, replica 0\) needs [0-9.]+ MiB by "
                     r"the plan \(parameters .*; the largest part, activations .* does not fit", ranks=1)
    planned = planned_totals(train_ranks(args, 1, flags + ["--dry-run"]), 1)[0]
    train_ranks(args, 1, flags + ["--device-memory", str(planned)])
    expect_bad_input(args, flags + ["--device-memory", "12 GiB"], r"--device-memory expects a size", ranks=1)
    print(f"1 rank under 500KiB: refused by the plan; under {planned} bytes (the plan): trains")

    # No layout of 1 rank fits (micro-batches of 1 and full recomputation included); --plan on
    # one process picks a layout of 4 ranks, and that command, run as printed, trains.
    out = train_ranks(args, 1, flags + ["--dry-run", "--plan", "--device-memory", "500KiB"])
    assert re.search(r"0 fit 500\.00 KiB per rank.*\n  none fits: the smallest, .* needs [0-9.]+ KiB", out), out
    rate = ["--plan-tflops", "0.1", "--plan-rows", "64"]  # not measured: both runs below model the same rates
    out = train_ranks(args, 1, flags + rate + ["--bucket-mb", "0.01", "--dry-run", "--plan", "--world", "4",
                                               "--device-memory", "500KiB"])
    command = re.search(r"^  1\. .* (\S+)  \((\S+) / (\S+) / (\S+) / (\S+) / (\S+)\)(?:  \(slower or larger: zero "
                        r"[\d,]+\))?\n\s+(mpirun -np 4 \./build/train .*)$",
                        out, re.M)
    assert command, out
    printed = command.group(7).split()[4:]
    assert "--data" in printed and "--device-memory" in printed and "--plan" not in printed, printed
    layout = re.search(r"--tp \d+(?: --sequence-parallel)? --pp \d+ --zero \d+ --micro-batch \d+ --recompute \w+$",
                       command.group(7)).group(0)
    # --dry-run of that layout prints the step-time model --plan ranked it by, the same numbers.
    out = train_ranks(args, 1, printed + rate + ["--dry-run", "--world", "4"])
    model_line = re.search(r"step-time model: (\S+) s per step \(compute / bubble / dp / tp / pp: (\S+) / (\S+) / "
                           r"(\S+) / (\S+) / (\S+)\)", out)
    assert model_line and model_line.groups() == command.groups()[:6], (model_line and model_line.groups(), out)
    reference, _ = gpt_run(args, 1, SGD + UNTIED, data, "cap-1", model=GPT4)
    model, out = gpt_run(args, 4, SGD + UNTIED + layout.split() + ["--device-memory", "500KiB"], data, "cap-planned",
                         model=GPT4)
    peaks = [int(v) for v in re.search(r"memory high-water mark per rank \([^)]*\):([ 0-9]+)$", out, re.M).group(1).split()]
    assert len(peaks) == 4 and max(peaks) <= 500 * 1024, peaks
    assert_close(model, reference, f"the plan's layout ({layout}) under --device-memory 500KiB vs 1 rank without")
    print(f"--plan picked {layout}: trains under 500 KiB (which no layout of 1 rank meets), high-water marks {peaks} bytes")


# The small GPT: 4 blocks of width 64 over 64 positions, in place of the tiny one's values.
SMALL = {"--layers": "4", "--embed": "64", "--seq-len": "64"}


def small(flags):
    """The layout's flags with the tiny GPT's model flags changed to the small one's."""
    model = [SMALL.get(GPT4[i - 1], f) if i else f for i, f in enumerate(GPT4)]
    return ["--model-flags"] + model + flags
# (name, ranks, flags): the layouts whose plan must meet the measured high-water mark.
PLAN_LAYOUTS = [
    ("1 rank", 1, []),
    ("dp 2", 2, []),
    ("dp 2 zero 1", 2, ["--zero", "1"]),
    ("dp 2 zero 2", 2, ["--zero", "2"]),
    ("dp 2 zero 3", 2, ["--zero", "3"]),
    # Buckets of 2621 elements: the embedding, the blocks and the untied head (260 x 32) write
    # their gradients through the ring in pieces.
    ("dp 2 zero 2, streamed", 2, ["--zero", "2", "--bucket-mb", "0.01"]),
    ("dp 2 zero 3, streamed", 2, ["--zero", "3", "--bucket-mb", "0.01"]),
    ("pp 2 1f1b, 4 micro-batches", 2, ["--pp", "2", "--micro-batch", "4"]),
    ("pp 2 gpipe, 4 micro-batches", 2, ["--pp", "2", "--micro-batch", "4", "--schedule", "gpipe"]),
    ("pp 2 interleaved", 2, ["--pp", "2", "--micro-batch", "4", "--schedule", "interleaved", "--virtual-stages", "2"]),
    ("tp 2", 2, ["--tp", "2"]),
    ("tp 2 x pp 2, zero 1", 4, ["--tp", "2", "--pp", "2", "--micro-batch", "4", "--zero", "1"]),
    ("recompute block", 1, ["--recompute", "block"]),
    ("recompute full, pp 2", 2, ["--recompute", "full", "--pp", "2", "--micro-batch", "4"]),
    ("bf16", 1, ["--precision", "bf16"]),
    ("bf16 dp 2 zero 2", 2, ["--precision", "bf16", "--zero", "2"]),
    ("small: 1 rank", 1, small([])),
    ("small: pp 2 x dp 2, zero 3, bf16", 4, small(["--pp", "2", "--zero", "3", "--precision", "bf16",
                                                   "--micro-batch", "2"])),
    ("small: tp 2 x dp 2, recompute block", 4, small(["--tp", "2", "--recompute", "block"])),
    ("tp 2, sequence-parallel", 2, ["--tp", "2", "--sequence-parallel"]),
    ("small: tp 2 x pp 2, sequence-parallel", 4, small(["--tp", "2", "--pp", "2", "--micro-batch", "4",
                                                         "--sequence-parallel"])),
]


def planned_totals(out, ranks):
    """Per-rank totals from the plan's lines ("rank 2 (...)" or "ranks 0-1 (...)" ... "total N")."""
    totals = {}
    for first, last, total in re.findall(r"^\s+ranks? (\d+)(?:-(\d+))? \(.*total (\d+) ", out, re.M):
        for k in range(int(first), int(last or first) + 1):
            totals[k] = int(total)
    assert sorted(totals) == list(range(ranks)), out
    return [totals[k] for k in range(ranks)]


def case_plan_matches_peak(args):
    """The plan that rank 0 prints before training is within 5% of every rank's measured
    high-water mark (allocator and shared-memory buffers) for each layout of PLAN_LAYOUTS
    on the 4-head tiny GPT and a small one (4 blocks of width 64, 64 positions)."""
    data = tokenize(args, "byte")
    common = SGD + UNTIED + ["--data", data[0], "--steps", "3", "--global-batch", "16"]
    worst = 0.0
    for name, ranks, flags in PLAN_LAYOUTS:
        model = GPT4
        if flags[:1] == ["--model-flags"]:  # small(): its own model flags first
            model, flags = flags[1:len(GPT4) + 1], flags[len(GPT4) + 1:]
        out = train_ranks(args, ranks, model + common + flags)
        planned = planned_totals(out, ranks)
        measured = [int(v) for v in re.search(r"memory high-water mark per rank \([^)]*\):([ 0-9]+)$", out,
                                              re.M).group(1).split()]
        errors = [p / m - 1 for p, m in zip(planned, measured)]
        print(f"{name:32s} planned {planned} measured {measured} error {', '.join(f'{e:+.1%}' for e in errors)}")
        worst = max(worst, max(abs(e) for e in errors))
    assert worst <= 0.05, f"the plan is {worst:.1%} off the measured high-water mark"


def case_layout_auto(args):
    """--layout auto: the planner's fastest layout for the world the job got, printed with the
    runner-up. A 4-rank run stopped at step 20 resumes on 2 ranks (the job lost half its ranks),
    each run choosing again, and ends where the uninterrupted 4-rank run ends (SGD, each /model
    tensor within 1e-5); with --device-memory the choice fits it; nothing fitting, or a layout flag
    beside it, is one line, exit 2."""
    data = tokenize(args, "byte")
    flags = GPT4 + UNTIED + SGD + ["--layout", "auto", "--data", data[0], "--global-batch", "16", "--seed", "3",
                                   "--log-every", "10", "--bucket-mb", "0.01"]
    choice = r"^--layout auto: tp (\d+), pp (\d+), dp (\d+), zero (\d), micro-batch (\d+), recompute (\w+)" \
             r"(?:, sequence-parallel)? " \
             r"\(the fastest of \d+ layouts of (\d+) ranks that fit.*\); runner-up: tp \d+"

    def chosen(out, ranks):
        m = re.search(choice, out, re.M)
        assert m and int(m[7]) == ranks and int(m[1]) * int(m[2]) * int(m[3]) == ranks, out
        return m.groups()[:6]

    whole = os.path.join(args.workdir, "ck-auto-whole")
    split = os.path.join(args.workdir, "ck-auto-split")
    for d in (whole, split):
        shutil.rmtree(d, ignore_errors=True)
    four = chosen(train_ranks(args, 4, flags + ["--steps", "40", "--checkpoint-dir", whole]), 4)
    train_ranks(args, 4, flags + ["--steps", "20", "--save-every", "20", "--checkpoint-dir", split])
    out = train_ranks(args, 2, flags + ["--steps", "40", "--checkpoint-dir", split, "--resume", "auto"])
    two = chosen(out, 2)
    assert "resuming from" in out and "at step 20" in out, out
    worst = assert_close(read_model(os.path.join(split, "step-00000040.h5")),
                         read_model(os.path.join(whole, "step-00000040.h5")), "4 ranks -> 2 ranks, --layout auto")
    print(f"4 ranks chose tp {four[0]} pp {four[1]} dp {four[2]} zero {four[3]} micro {four[4]}; after the resume 2 "
          f"ranks chose tp {two[0]} pp {two[1]} dp {two[2]} zero {two[3]} micro {two[4]}; worst difference {worst:.3g}")

    # A cap the fastest layout exceeds: the choice is one that fits it.
    dry = GPT4 + UNTIED + SGD + ["--layout", "auto", "--data", data[0], "--global-batch", "16", "--dry-run", "--world",
                                 "4"]
    out = train_ranks(args, 1, dry)
    fastest_bytes = int(re.search(r"total (\d+) \([^)]*\)  <- fullest", out)[1])
    out = train_ranks(args, 1, dry + ["--device-memory", str(fastest_bytes - 1)])
    capped = int(re.search(r"total (\d+) \([^)]*\)  <- fullest", out)[1])
    assert capped < fastest_bytes and chosen(out, 4), out
    expect_bad_input(args, dry + ["--device-memory", "64KiB"], r"--layout auto: no layout of 4 ranks fits 64\.00 KiB")

    # The bandwidth the model charges: measured where ranks are launched on the CPU (all-reduces
    # between them while they compute), else assumed, or given; the choice and the dry run say which.
    measured = r"([0-9.e+]+) GB/s per rank \(measured: all-reduces between the (\d) ranks launched, while they compute\)"
    m = re.search(measured, train_ranks(args, 2, dry[:-2]))  # planned for the 2 ranks launched
    assert m and int(m[2]) == 2 and 0 < float(m[1]) < 1e4, m
    out = train_ranks(args, 4, flags + ["--steps", "1"])
    m = re.search(r"^--layout auto: .*" + measured, out, re.M)
    assert m and int(m[2]) == 4 and 0 < float(m[1]) < 1e4, out
    assert "25 GB/s per rank (assumed: one rank launched, none to measure; --plan-gbps)" in train_ranks(args, 1, dry)
    assert "3 GB/s per rank (--plan-gbps)" in train_ranks(args, 2, dry + ["--plan-gbps", "3"])
    print(f"bandwidth: measured {float(m[1]):.3g} GB/s per rank between 4 ranks while they compute")
    expect_bad_input(args, dry + ["--zero", "1"], r"--layout auto chooses .*; leave out --zero")


def draw_run(rng, ranks, data):
    """A random model and layout of `ranks` ranks (model, layout and checkpoint flags)."""
    pick = lambda options: options[int(rng.integers(len(options)))]
    kind = pick(["gpt", "llama", "mlp"])
    if kind == "mlp":
        model = ["--model", "mlp", "--hidden", pick(["16,16", "64,32", "32,32,32"])]
        source = data["images"]
    else:
        heads = pick([2, 4])
        model = ["--model", kind, "--layers", str(pick([1, 2, 3])), "--heads", str(heads), "--embed",
                 str(heads * pick([8, 16])), "--seq-len", "16", "--vocab", "260",
                 "--tie-embeddings", pick(["true", "false"]), "--recompute", pick(["none", "block", "full"])]
        if kind == "llama":
            model += ["--kv-heads", str(pick([1, 2])), "--ffn-hidden", str(pick([32, 48]))]
        source = data["tokens"]
    layouts = {2: [[], ["--zero", "1"], ["--zero", "2"], ["--zero", "3"], ["--pp", "2"], ["--pp", "2", "--schedule",
                   "gpipe"], ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2"], ["--tp", "2"]],
               4: [[], ["--zero", "3"], ["--pp", "2"], ["--pp", "2", "--zero", "2"], ["--tp", "2"],
                   ["--tp", "2", "--zero", "1"], ["--tp", "2", "--pp", "2"], ["--pp", "4"]]}
    layout = pick([l for l in layouts[ranks] if kind != "mlp" or "--tp" not in l])
    if "--tp" in layout:
        layout = layout + pick([[], ["--sequence-parallel"]])
    flags = model + layout + ["--micro-batch", pick(["1", "2", "4"]), "--precision", pick(["fp32", "bf16"]),
                              "--optimizer", pick(["sgd", "adamw"]), "--lr", "0.01", "--bucket-mb",
                              pick(["0.01", "25"]), "--data", source[0], "--val-data", source[1], "--global-batch",
                              "16", "--steps", "4", "--eval-every", "2", "--log-every", "2", "--threads", "1"]
    save = pick(["none", "sync", "async"])
    return flags, save


def case_plan_promise(args):
    """The plan is a promise (issue #37 item 4): for randomly drawn models (GPT, Llama, MLP) and
    layouts of 2 and 4 ranks (ZeRO 0-3, pp with every schedule, tp with and without sequence
    parallelism, their products, recompute,
    bf16, SGD or AdamW, checkpoints synchronous or in the background, evaluation every 2 steps),
    --device-memory = the fullest rank's plan + 1% trains to the end, and the plan - 1% is refused
    before anything is allocated (exit 2, one line). Also for --layout auto: the layout it chooses
    under a cap trains within it. The seed is printed (STRATA_PLAN_SEED repeats a draw)."""
    seed = int(os.environ.get("STRATA_PLAN_SEED", np.random.SeedSequence().entropy % 2**31))
    print(f"seed {seed} (STRATA_PLAN_SEED={seed} repeats these draws)")
    rng = np.random.default_rng(seed)
    images = [write_dataset(os.path.join(args.workdir, f"promise-{s}.h5"), n=256, shape=(1, 8, 8), seed=k)
              for k, s in enumerate(("train", "val"))]
    data = {"tokens": tokenize(args, "byte"), "images": images}

    def promise(ranks, flags, name):
        ck = os.path.join(args.workdir, "ck-promise")
        shutil.rmtree(ck, ignore_errors=True)
        planned = max(planned_totals(train_ranks(args, 1, flags + ["--dry-run", "--world", str(ranks)]), ranks))
        out = train_ranks(args, ranks, flags + ["--device-memory", str(planned * 101 // 100)])
        peaks = [int(v) for v in re.search(r"memory high-water mark per rank \([^)]*\):([ 0-9]+)$", out,
                                           re.M).group(1).split()]
        assert max(peaks) <= planned * 101 // 100, (name, peaks, planned)
        expect_bad_input(args, flags + ["--device-memory", str(planned * 99 // 100)],
                         r"--device-memory .* is too small: rank \d+ .* needs .* by the plan", ranks=ranks)
        print(f"  {name}: plan {planned}, high-water {max(peaks)} ({max(peaks) / planned - 1:+.2%}); plan - 1% refused")

    for k in range(8):
        ranks = 2 if k < 4 else 4
        flags, save = draw_run(rng, ranks, data)
        if save != "none":
            flags += ["--checkpoint-dir", os.path.join(args.workdir, "ck-promise"), "--save-every", "2"]
            flags += ["--async-save"] if save == "async" else []
        promise(ranks, flags, f"{ranks} ranks, {save} saves: {' '.join(f for f in flags if not f.startswith('/'))}")

    # --layout auto under a cap between the smallest and the fastest layout's plan: what it chooses fits.
    auto = GPT4 + UNTIED + SGD + ["--layout", "auto", "--data", data["tokens"][0], "--global-batch", "16",
                                  "--steps", "4", "--bucket-mb", "0.01"]
    fastest = int(re.search(r"total (\d+) \([^)]*\)  <- fullest", train_ranks(args, 1, auto + ["--dry-run", "--world",
                                                                                                "4"]))[1])
    out = train_ranks(args, 4, auto + ["--device-memory", str(fastest - 1)])
    peaks = [int(v) for v in re.search(r"memory high-water mark per rank \([^)]*\):([ 0-9]+)$", out, re.M)[1].split()]
    assert max(peaks) <= fastest - 1, (peaks, fastest)
    print(f"--layout auto under {fastest - 1} bytes: {re.search(r'--layout auto: ([^(]*)', out)[1].strip()}, "
          f"high-water {max(peaks)}")
