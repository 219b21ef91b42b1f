"""Sequence parallelism (--sequence-parallel, Megatron's; issue #35 item 3) end to end: the tiny
GPT and Llama of cases_tensor_parallel.py and cases_llama.py cut along the sequence between the
tensor-parallel regions. Each layout against one rank and against tp without it, the bytes each
step sends against the formula, the activations measured and planned, resume into layouts
without it, and its bad input."""
import re
import shutil

from cases_gpt import GPT_FLAGS_TIED, GPT_FLAGS_UNTIED, assert_bf16_close, assert_close, gpt_run, tokenize
from cases_llama import LLAMA, MQA, SGD as LLAMA_SGD, UNTIED
from cases_memory import planned_totals
from cases_tensor_parallel import GPT4, GPT4_BYTES, LAYERS, final_eval, resume_more
from harness import expect_bad_input, train_ranks

SP = ["--sequence-parallel"]
HIGH_WATER = r"memory high-water mark per rank \([^)]*\):([ 0-9]+)$"


def sp_bytes_formula(out, tp, pp, micro, micro_batches, seq=16, width=32, dtype_bytes=4):
    """The bytes rank 0 sends on the tp communicator in a step with --sequence-parallel, by
    MpiCommunicator::bytes_sent's convention (an all-gather or a reduce-scatter: (T-1)/T of the
    whole tensor; an all-reduce: 2(T-1)/T). Per micro-batch and whole activation A = b·s·h:
    each transformer block gathers and scatters A once per region forward (attention, MLP: 4) and
    gathers the region's input again, gathers the output's gradient and scatters the input's
    gradient backward (6), and all-reduces its two LayerNorms' gradients (2h f32 each); the
    embedding scatters its lookup and gathers its gradient (2); with the head on rank 0 too,
    ln_f's gradients are all-reduced, the head gathers its input forward and again backward and
    scatters its input's gradient (3), and the cross-entropy gathers the row maxima and
    all-reduces (sum exp, target logit) per row. Stage boundaries carry each rank's own part,
    with no gather."""
    first, last = map(int, re.search(r"stage 0: layers (\d+)-(\d+)", out).groups())
    names = LAYERS[first:last + 1]
    blocks = sum(1 for name in names if re.fullmatch(r"h\d+", name))
    act, rows, norm = micro * seq * width * dtype_bytes, micro * seq, 2 * width * 4
    part = lambda n: n * (tp - 1) // tp  # an all-gather or reduce-scatter of n bytes
    all_reduce = lambda n: n * 2 * (tp - 1) // tp
    per_micro = blocks * (10 * part(act) + 2 * all_reduce(norm)) + 2 * part(act)
    if "ln_f" in names:
        per_micro += all_reduce(norm)
    if "lm_head" in names:
        per_micro += 3 * part(act) + part(tp * rows * 4) + all_reduce(rows * 2 * 4)
    return micro_batches * per_micro


def high_water(out):
    return [int(v) for v in re.search(HIGH_WATER, out, re.M).group(1).split()]


def case_sp_equivalence(args):
    """The tiny GPT (4 heads, dropout 0.1: the residual and embedding dropouts draw the whole
    sequence's masks at each rank's positions) after 50 steps of SGD-momentum with
    --sequence-parallel, each /model tensor within 1e-5 of its max abs value of one rank's and of
    the same layout's without it: tp 2, tp 4, tp 2 x dp 2 ZeRO 3, tp 2 x pp 2, tp 2 x pp 2
    interleaved, tp 2 with recompute full, tied and untied; the closing evaluation matches; the
    tp bytes per step equal the formula; the high-water mark is below tp's without it; bf16 tp 2
    within 5 bf16 ulps of bf16 on one rank (as cases_tensor_parallel's bf16 tp 2)."""
    data = tokenize(args, "byte")
    layouts = {
        "tp2": (2, ("--tp", "2")),
        "tp4": (4, ("--tp", "4")),
        "tp2xdp2-zero3": (4, ("--tp", "2", "--zero", "3")),
        "tp2xpp2": (4, ("--tp", "2", "--pp", "2", "--micro-batch", "4")),
        "tp2xpp2-interleaved": (4, ("--tp", "2", "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2",
                                    "--micro-batch", "4")),
        "tp2-recompute-full": (2, ("--tp", "2", "--recompute", "full")),
    }
    # (tp, pp, micro-batch, micro-batches) of the layouts whose tp traffic is checked.
    bytes_checked = {"tp2": (2, 1, 16, 1), "tp4": (4, 1, 16, 1), "tp2xpp2": (2, 2, 4, 4)}
    for tie, flags, names in (("untied", GPT_FLAGS_UNTIED, list(layouts)),
                              ("tied", GPT_FLAGS_TIED, ["tp2", "tp2xpp2"])):
        reference, ref_out = gpt_run(args, 1, flags, data, f"sp-{tie}-1", model=GPT4_BYTES)
        ref_loss, ref_accuracy = final_eval(ref_out)
        for name in names:
            ranks, extra = layouts[name]
            plain, plain_out = gpt_run(args, ranks, flags + list(extra), data, f"sp-{tie}-{name}-plain",
                                       model=GPT4_BYTES)
            model, out = gpt_run(args, ranks, flags + list(extra) + SP, data, f"sp-{tie}-{name}", model=GPT4_BYTES)
            assert "tensor-parallel ranks (sequence-parallel)" in out and "its plan says" not in out, out
            assert_close(model, reference, f"{tie} {name} sequence-parallel vs 1 rank")
            assert_close(model, plain, f"{tie} {name} sequence-parallel vs without")
            loss, accuracy = final_eval(out)
            assert abs(loss - ref_loss) <= 1e-5 * ref_loss and abs(accuracy - ref_accuracy) <= 0.01, (
                name, loss, ref_loss, accuracy, ref_accuracy)
            if tie == "untied" and name in bytes_checked:
                sent = int(re.search(r"tensor-parallel bytes sent by rank 0 in the last step: (\d+)", out).group(1))
                expected = sp_bytes_formula(out, *bytes_checked[name])
                assert sent == expected, f"{name}: rank 0 sent {sent} bytes on tp, the formula says {expected}"
                without = int(re.search(r"tensor-parallel bytes sent by rank 0 in the last step: (\d+)",
                                        plain_out).group(1))
                print(f"  {name}: {sent} tp bytes per step on rank 0 = the formula ({without} without)")
            peak, plain_peak = max(high_water(out)), max(high_water(plain_out))
            assert peak < plain_peak, (name, peak, plain_peak)
            print(f"  {name}: high-water {peak} bytes per rank against {plain_peak} without")

    bf16 = ["--precision", "bf16"]
    reference, _ = gpt_run(args, 1, GPT_FLAGS_UNTIED + bf16, data, "sp-bf16-1", model=GPT4_BYTES)
    model, _ = gpt_run(args, 2, GPT_FLAGS_UNTIED + bf16 + ["--tp", "2"] + SP, data, "sp-bf16-tp2", model=GPT4_BYTES)
    assert_bf16_close(model, reference, "bf16 sequence-parallel tp 2 vs bf16 1 rank", ulps=5.0)


def case_sp_llama(args):
    """The tiny Llama (grouped-query, rotary, SwiGLU, RMSNorm) with --sequence-parallel against
    one rank after 50 steps of SGD-momentum, within 1e-5 (tp 2 and tp 4 also against the same
    layout without it): tp 2 (kv heads split), tp 4 (each kv
    head on 2 ranks), tp 2 x pp 2, tp 2 x dp 2 ZeRO 3 with recompute block; multi-query under tp
    2 and tp 4 (the one kv head on every rank, its gradients summed)."""
    data = tokenize(args, "byte")
    flags = LLAMA_SGD + UNTIED
    run = lambda ranks, extra, name, model=LLAMA: gpt_run(args, ranks, flags + list(extra), data, "sp-llama-" + name,
                                                          model=model)
    reference, _ = run(1, (), "1")
    for name, ranks, extra in (("tp2", 2, ("--tp", "2")), ("tp4", 4, ("--tp", "4")),
                               ("tp2xpp2", 4, ("--tp", "2", "--pp", "2", "--micro-batch", "4")),
                               ("tp2xdp2-zero3-recompute", 4, ("--tp", "2", "--zero", "3", "--recompute", "block"))):
        model, _ = run(ranks, extra + tuple(SP), name)
        assert_close(model, reference, f"llama {name} sequence-parallel vs 1 rank")
        if name in ("tp2", "tp4"):
            plain, _ = run(ranks, extra, name + "-plain")
            assert_close(model, plain, f"llama {name} sequence-parallel vs without")
    reference, _ = run(1, (), "mqa-1", model=MQA)
    for ranks in (2, 4):
        model, _ = run(ranks, ("--tp", str(ranks)) + tuple(SP), f"mqa-tp{ranks}", model=MQA)
        assert_close(model, reference, f"llama multi-query tp {ranks} sequence-parallel vs 1 rank")


def case_sp_resume_and_plan(args):
    """Checkpoints stay layout-free: 20 steps of tp 2 x pp 2 with --sequence-parallel resumed on
    one rank to 50 == 50 uninterrupted steps on one rank (within 1e-5). The plan: a Llama's
    planned high-water mark within 5% of the measured one under tp 2 and tp 2 x pp 2 with it;
    for llama3.1-8b at tp 8 (--dry-run, T 4096, 8 sequences) each rank plans 1/8 of one rank's
    activations with it (Korthikanti et al.: every activation is then cut by tp), against the
    replicated share that stays whole without it. Bad input: sequences that tp does not divide,
    one line, exit 2. The planner: each tp layout with and without it; under a cap that among the
    fastest layouts only a sequence-parallel one meets, --layout auto chooses that one, trains
    within the cap and ends as one rank does; --sequence-parallel beside --layout auto is refused."""
    data = tokenize(args, "byte")
    flags = GPT_FLAGS_UNTIED
    reference, _ = gpt_run(args, 1, flags, data, "sp-resume-1", model=GPT4)
    ck = f"{args.workdir}/ck-resume-sp-chain"
    common = GPT4 + list(flags) + ["--data", data[0], "--val-data", data[1], "--global-batch", "16", "--seed", "3",
                                   "--log-every", "10", "--bucket-mb", "0.01", "--checkpoint-dir", ck]
    shutil.rmtree(ck, ignore_errors=True)
    train_ranks(args, 4, common + ["--tp", "2", "--pp", "2", "--micro-batch", "4", "--steps", "20"] + SP)
    model = resume_more(args, data, "sp-chain", (1, ()), flags, steps=50, split=20, model=GPT4)
    assert_close(model, reference, "tp 2 x pp 2 sequence-parallel to 20 -> 1 rank to 50 vs 1 rank 50")

    base = LLAMA + LLAMA_SGD + UNTIED + ["--data", data[0], "--steps", "3", "--global-batch", "16"]
    for name, ranks, extra in (("tp 2", 2, ["--tp", "2"]),
                               ("tp 2 x pp 2", 4, ["--tp", "2", "--pp", "2", "--micro-batch", "4"])):
        out = train_ranks(args, ranks, base + extra + SP)
        planned, measured = planned_totals(out, ranks), high_water(out)
        errors = [p / m - 1 for p, m in zip(planned, measured)]
        print(f"llama {name} sequence-parallel: planned {planned} measured {measured} error "
              f"{', '.join(f'{e:+.1%}' for e in errors)}")
        assert max(abs(e) for e in errors) <= 0.05, (name, planned, measured)

    def activations(extra):
        out = train_ranks(args, 1, ["--model", "llama3.1-8b", "--dry-run", "--global-batch", "8", "--seq-len", "4096"]
                          + extra)
        return int(re.search(r"activations (\d+)", out).group(1))
    one = activations(["--world", "1"])
    with_sp = activations(["--world", "8", "--tp", "8"] + SP)
    without = activations(["--world", "8", "--tp", "8"])
    print(f"llama3.1-8b, 8 x 4096 tokens: activations per rank {one} on one rank; tp 8 {without} without sequence "
          f"parallelism, {with_sp} with it ({without / with_sp:.2f}x fewer; one rank's / 8 = {one // 8})")
    assert abs(with_sp / (one / 8) - 1) <= 0.02 and without > 2 * with_sp, (one, with_sp, without)

    # The planner tries each tp layout with and without it: under a cap that only a sequence-parallel
    # layout among the fastest meets, --layout auto chooses it and trains as one rank does.
    # Not measured (the GEMMs, and on 4 ranks the all-reduces): the ranking is the same every run.
    rates = ["--plan-tflops", "0.1", "--plan-rows", "64", "--plan-gbps", "25"]
    # gpt_run's flags below (the loader's batches and checkpoints count in the plan too).
    as_run = ["--data", data[0], "--val-data", data[1], "--steps", "50", "--global-batch", "16", "--seed", "3",
              "--bucket-mb", "0.01", "--checkpoint-dir", f"{args.workdir}/ck-sp-auto"]
    plan = GPT4 + list(flags) + as_run + ["--dry-run", "--plan", "--world", "4", "--plan-top", "200"] + rates
    rows = re.findall(r"^\s+\d+\.\s+(\d+) (sp|  )\s.*?([0-9.]+) KiB\s+\S+  \(", train_ranks(args, 1, plan), re.M)
    assert any(sp == "sp" for _, sp, _ in rows) and any(sp != "sp" for _, sp, _ in rows), rows
    first = next(k for k, (_, sp, kib) in enumerate(rows)
                 if sp == "sp" and all(float(r[2]) > float(kib) for r in rows[:k]))
    cap = f"{float(rows[first][2]) + 0.01:.2f}KiB"
    auto = GPT4 + list(flags) + ["--layout", "auto", "--device-memory", cap] + rates
    model, out = gpt_run(args, 4, auto[len(GPT4):], data, "sp-auto", model=GPT4)
    assert re.search(r"^--layout auto: tp \d+, .*, sequence-parallel \(the fastest", out, re.M), out
    assert max(high_water(out)) <= float(cap[:-3]) * 1024, (cap, high_water(out))
    assert_close(model, reference, f"--layout auto under {cap} (sequence-parallel) vs 1 rank")
    expect_bad_input(args, auto + ["--data", data[0], "--steps", "2", "--sequence-parallel"],
                     r"--layout auto chooses --tp, --sequence-parallel, .*; leave out --sequence-parallel", ranks=4)

    odd = [("15" if f == "16" and GPT4[i - 1] == "--seq-len" else f) for i, f in enumerate(GPT4)]
    expect_bad_input(args, odd + ["--data", data[0], "--steps", "2", "--global-batch", "8", "--tp", "2"] + SP,
                     r"--sequence-parallel cuts each sequence into --tp 2 parts: the sequences. 15 tokens", ranks=2)
