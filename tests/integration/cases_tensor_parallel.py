"""Tensor parallelism (--tp, Megatron-style) end to end on the tiny GPT of cases_gpt.py, with 4
heads so that tp 2 and tp 4 split whole heads: every layout with tp against one rank, resume
from a tp layout on layouts without it, the plan of a tp grid, and its bad inputs."""
import os
import re

import numpy as np

from cases_gpt import GPT, GPT_FLAGS_TIED, GPT_FLAGS_UNTIED, assert_bf16_close, assert_close, gpt_run, resume, tokenize
from harness import expect_bad_input, read_model, train_ranks, write_dataset

# cases_gpt's GPT with 4 heads, and the byte vocabulary (257 tokens) as --vocab 260 (which tp 2
# and tp 4 divide: no padding rows; the memory cases count its bytes).
GPT4 = [("4" if flag == "2" and GPT[i - 1] == "--heads" else flag) for i, flag in enumerate(GPT)] + ["--vocab", "260"]
# The same GPT with the data's 257 tokens, which tp 2 pads to 258 rows and tp 4 to 260 (the
# padding rows' logits -inf, never saved): the layouts below train it as one rank does.
GPT4_BYTES = GPT4[:-2]


def final_eval(out):
    """The run's closing evaluation line: (loss, accuracy)."""
    m = re.search(r"(?:final test|evaluation): loss ([0-9.]+)\s+perplexity [0-9.]+\s+next-token accuracy ([0-9.]+)%", out)
    assert m, out
    return float(m.group(1)), float(m.group(2))


LAYERS = ["embedding", "drop", "h0", "h1", "ln_f", "lm_head"]  # the tiny GPT with dropout


def tp_bytes_formula(out, tp, pp, micro, micro_batches, seq=16, width=32, vocab=260, dtype_bytes=4):
    """The bytes rank 0 sends on the tp communicator in a step, by the convention of
    MpiCommunicator::bytes_sent (all-reduce: 2(T-1)/T of the tensor; all-gather: (T-1)/T of the
    output): per micro-batch, each transformer block of stage 0 all-reduces b·s·h twice forward
    (the row-parallel outputs) and twice backward (the column-parallel input gradients); the
    embedding all-reduces its lookup; with the head on rank 0 too, the head's input gradient is
    all-reduced and the cross-entropy all-gathers the row maxima (N = b·s floats per rank) and
    all-reduces (sum exp, target logit) per row; with pp, stage 0 all-gathers each received
    gradient from its 1/T parts."""
    first, last = map(int, re.search(r"stage 0: layers (\d+)-(\d+)", out).groups())
    blocks = sum(1 for name in LAYERS[first:last + 1] if re.fullmatch(r"h\d+", name))
    act, rows = micro * seq * width * dtype_bytes, micro * seq
    all_reduce = lambda n: n * 2 * (tp - 1) // tp
    all_gather = lambda n: n * (tp - 1) // tp
    per_micro = blocks * 4 * all_reduce(act) + all_reduce(act)
    if pp == 1:
        per_micro += all_reduce(act) + all_gather(tp * rows * 4) + all_reduce(rows * 2 * 4)
    else:
        per_micro += all_gather(act)
    return micro_batches * per_micro


def case_tp_equivalence(args):
    """Every layout with tensor parallelism trains the same GPT as 1 rank after 50 steps of
    SGD-momentum with dropout 0.1 (the attention-dropout masks keyed by global head, so they do
    not depend on T), each /model tensor within 1e-5 of its max abs value: tp 2, tp 4, tp 2 x dp 2,
    tp 2 x pp 2, tp 2 x pp 2 x dp 2 on 8 ranks, tp 2 x dp 2 under ZeRO 1, 2 and 3, the interleaved schedule (2 chunks per
    rank) with and without tp 2, untied and tied (the head on the last stage with pp: a copy of
    its tp rank's wte rows). The closing evaluation (the vocabulary-parallel
    cross-entropy and argmax) matches 1 rank's too; bf16 tp 2 against bf16 on 1 rank within 5
    bf16 ulps of each tensor's max abs value (see below)."""
    data = tokenize(args, "byte")
    model_flags = GPT4_BYTES
    layouts = {
        "tp2": (2, ("--tp", "2")),
        "tp4": (4, ("--tp", "4")),
        "tp2xdp2": (4, ("--tp", "2")),
        "tp2xpp2": (4, ("--tp", "2", "--pp", "2", "--micro-batch", "4")),
        "tp2xdp2-zero1": (4, ("--tp", "2", "--zero", "1")),
        "tp2xdp2-zero2": (4, ("--tp", "2", "--zero", "2")),
        "tp2xdp2-zero3": (4, ("--tp", "2", "--zero", "3")),
        "tp2xpp2xdp2": (8, ("--tp", "2", "--pp", "2", "--micro-batch", "4")),
        # The interleaved schedule: each pipeline rank holds 2 chunks (embedding+drop | h0 on
        # rank 0, h1 | ln_f on rank 1... as the balanced cut into 4 falls), each its own DataParallel.
        "pp2-interleaved": (2, ("--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--micro-batch", "4")),
        "tp2xpp2-interleaved": (4, ("--tp", "2", "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2",
                                    "--micro-batch", "4")),
    }
    # (tp, pp, micro-batch, micro-batches) of the layouts whose tp traffic is checked.
    bytes_checked = {"tp2": (2, 1, 16, 1), "tp4": (4, 1, 16, 1), "tp2xdp2": (2, 1, 8, 1), "tp2xpp2": (2, 2, 4, 4),
                     "tp2xpp2xdp2": (2, 2, 4, 2)}
    for tie, flags in (("untied", GPT_FLAGS_UNTIED), ("tied", GPT_FLAGS_TIED)):
        reference, ref_out = gpt_run(args, 1, flags, data, f"tp-{tie}-1", model=model_flags)
        ref_loss, ref_accuracy = final_eval(ref_out)
        for name, (ranks, extra) in layouts.items():
            if tie == "tied" and name in ("tp4", "tp2xdp2-zero1", "tp2xpp2xdp2"):
                continue  # the tied head's paths are those of tp 2, pp 2 and ZeRO 2/3
            model, out = gpt_run(args, ranks, flags + list(extra), data, f"tp-{tie}-{name}", model=model_flags)
            if "--tp" in extra:
                assert f"x {extra[1]} tensor-parallel ranks" in out and "tp groups:" in out, out
                padded = {"2": 258, "4": 260}[extra[1]]
                assert f"vocabulary of 257 tokens padded to {padded} for --tp {extra[1]}" in out, out
            assert "its plan says" not in out, out
            assert_close(model, reference, f"{tie} {name} vs 1 rank")
            if tie == "untied" and name in bytes_checked:
                sent = int(re.search(r"tensor-parallel bytes sent by rank 0 in the last step: (\d+)", out).group(1))
                expected = tp_bytes_formula(out, *bytes_checked[name])
                assert sent == expected, f"{name}: rank 0 sent {sent} bytes on tp, the formula says {expected}"
                print(f"  {name}: {sent} tp bytes per step on rank 0 = the formula")
            loss, accuracy = final_eval(out)
            assert abs(loss - ref_loss) <= 1e-5 * ref_loss and abs(accuracy - ref_accuracy) <= 0.01, (
                name, loss, ref_loss, accuracy, ref_accuracy)

    # Gradient clipping's global norm counts each parameter once: the split ones summed over the
    # tp ranks, the ones every tp rank holds whole (LayerNorms, wpe, row-parallel biases) once.
    # 0.05 is below the norm at every step here, so every step is clipped.
    clip = ["--clip-grad", "0.05"]
    reference, _ = gpt_run(args, 1, GPT_FLAGS_UNTIED + clip, data, "tp-clip-1", model=model_flags)
    for name in ("tp2xpp2", "tp2xdp2-zero2"):
        ranks, extra = layouts[name]
        model, _ = gpt_run(args, ranks, GPT_FLAGS_UNTIED + clip + list(extra), data, f"tp-clip-{name}",
                            model=model_flags)
        assert_close(model, reference, f"clipped {name} vs 1 rank")

    # bf16: a row-parallel layer's partial products leave each rank rounded to bf16 and are
    # summed by the all-reduce (as in Megatron), one rounding more per block than one rank's
    # GEMM, which rounds its f32 sum once. Measured: 3.56 bf16 ulps of the tensor's max abs value
    # after 50 steps (h1/attn/c_proj/weight, seed 3), against 1.0-1.5 for dp 2 and ~4 between
    # bf16 and fp32 on one rank (cases_gpt.case_gpt_equivalence). Tolerance: 5 ulps.
    bf16 = ["--precision", "bf16"]
    reference, _ = gpt_run(args, 1, GPT_FLAGS_UNTIED + bf16, data, "tp-bf16-1", model=model_flags)
    model, _ = gpt_run(args, 2, GPT_FLAGS_UNTIED + bf16 + ["--tp", "2"], data, "tp-bf16-tp2", model=model_flags)
    assert_bf16_close(model, reference, "bf16 tp 2 vs bf16 1 rank", ulps=5.0)


def case_tp_resume(args):
    """Checkpoints stay layout-free: 20 steps under tp 2 x pp 2 (tied), resumed under tp 1 x dp 2
    to 35, then on 1 rank to 50 == 50 uninterrupted steps on 1 rank; and 20 steps under pp 2 with
    the interleaved schedule (2 chunks per rank) resumed under tp 2 x dp 2 ZeRO 3 to 50 (untied).
    Within 1e-5 of each tensor's max abs value. The tied chain has the data's 257 tokens, so its
    tp 2 checkpoint is written from padded shards (and read back into whole ones)."""
    data = tokenize(args, "byte")
    flags = GPT_FLAGS_TIED
    reference, _ = gpt_run(args, 1, flags, data, "tp-resume-tied-1", model=GPT4_BYTES)
    # tp 2 x pp 2 -> dp 2 (steps 20..35) -> 1 rank (35..50), one checkpoint directory.
    resume(args, data, "tp-chain", (4, ("--tp", "2", "--pp", "2", "--micro-batch", "4")), (2, ()), flags,
           split=20, steps=35, model=GPT4_BYTES)
    model = resume_more(args, data, "tp-chain", (1, ()), flags, steps=50, split=35, model=GPT4_BYTES)
    assert_close(model, reference, "tied: tp2 x pp2 to 20 -> dp2 to 35 -> 1 rank to 50 vs 1 rank 50")

    flags = GPT_FLAGS_UNTIED
    reference, _ = gpt_run(args, 1, flags, data, "tp-resume-untied-1", model=GPT4)
    interleaved = ("--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--micro-batch", "4")
    model = resume(args, data, "tp-untied", (2, interleaved), (4, ("--tp", "2", "--zero", "3")), flags,
                   model=GPT4)
    assert_close(model, reference, "untied: pp 2 interleaved to 20 -> tp2 x dp2 zero 3 to 50 vs 1 rank 50")


def resume_more(args, data, name, layout, flags, steps, split, model):
    """Continues cases_gpt.resume's run `name` (its checkpoint at `split`) under `layout` to `steps`."""
    ck = os.path.join(args.workdir, "ck-resume-" + name)
    common = model + list(flags) + ["--data", data[0], "--val-data", data[1], "--global-batch", "16", "--seed", "3",
                                  "--log-every", "10", "--bucket-mb", "0.01", "--checkpoint-dir", ck]
    out = train_ranks(args, layout[0], common + list(layout[1]) + ["--steps", str(steps), "--resume", "auto"])
    assert f"at step {split}" in out, out
    return read_model(os.path.join(ck, f"step-{steps:08d}.h5"))


def case_tp_plan_and_bad_inputs(args):
    """--dry-run with --tp prints the tp groups and per-rank bytes that halve the split
    parameters; inputs tensor parallelism cannot use are one line, exit 2, on every rank."""
    # gpt2-124m (vocabulary padded to 50304, as nanoGPT does) on 8 ranks: pp 2 x dp 2 x tp 2,
    # ZeRO 0, fp32, SGD; only the parameter bytes are compared.
    def plan(tp, world):
        out = train_ranks(args, 1, ["--model", "gpt2-124m", "--dry-run", "--world", str(world), "--pp", "2",
                                    "--tp", str(tp), "--global-batch", "8", "--optimizer", "sgd",
                                    "--tie-embeddings", "false", "--vocab", "50304"])
        params = {int(m[1]): int(m[2]) for m in re.finditer(r"ranks? (\d+)\S* \(stage \d+[^)]*\): params (\d+)", out)}
        return out, params
    out2, by_rank2 = plan(2, 8)
    assert "process grid: pp 2 x dp 2 x tp 2 = 8 ranks" in out2, out2
    assert "tp groups: [0 1] [2 3] [4 5] [6 7]" in out2 and "dp groups: [0 2] [1 3] [4 6] [5 7]" in out2, out2
    _, by_rank1 = plan(1, 4)
    # Stage 0 (embedding + blocks): the split weights halve, LayerNorms, wpe and row-parallel
    # biases stay whole: between 50% and 52% of the tp 1 bytes.
    ratio = by_rank2[0] / by_rank1[0]
    assert 0.5 < ratio < 0.52, (by_rank2, by_rank1)
    print(f"gpt2-124m stage 0 parameter bytes per rank: tp 1 {by_rank1[0]}, tp 2 {by_rank2[0]} ({ratio:.4f})")

    data = tokenize(args, "byte")
    steps = ["--data", data[0], "--steps", "2", "--global-batch", "8"]
    base = GPT4 + steps  # --vocab 260
    bad = lambda flags, pattern, ranks=2: expect_bad_input(args, flags, pattern, ranks=ranks)
    one_head = GPT4[:GPT4.index("--heads")] + ["--heads", "1"] + GPT4[GPT4.index("--heads") + 2:]
    bad(one_head + steps + ["--tp", "2"], r"--heads \(1\) must be divisible by --tp \(2\)")
    bad(base + ["--tp", "3"], r"--tp 3 .*2 ranks")
    images = write_dataset(os.path.join(args.workdir, "images.h5"))
    bad(["--model", "mlp", "--hidden", "16", "--tp", "2", "--steps", "2", "--global-batch", "8", "--data", images],
        r"--tp applies to the gpt models")


def case_simulated_nodes(args):
    """Cross-node code paths on one machine (issue #20 item 5): with STRATA_RANKS_PER_NODE=2, 4
    ranks are 2 nodes of 2, so groups that span them go through MPI instead of shared memory
    (rank 0 says which), and dp 4, pp 2 x dp 2 and tp 2 x dp 2 train the tiny GPT to the same
    bits as on one node. dp 4's one-node reference runs with --shared-memory false: a 4-rank sum
    in shared memory adds in rank order, MPI's ring in another (2-rank sums are the same). A
    value that is not a positive integer: exit 2, one line."""
    data = tokenize(args, "byte")
    model_flags = GPT4_BYTES
    layouts = {  # name: (flags, one-node reference flags, what rank 0's groups go through across nodes)
        "dp4": ((), ("--shared-memory", "false"), "dp MPI"),
        "pp2xdp2": (("--pp", "2", "--micro-batch", "4"), (), "pp MPI, dp shared memory"),
        "tp2xdp2": (("--tp", "2"), (), "dp MPI, tp shared memory"),
    }
    for name, (flags, reference_flags, transport) in layouts.items():
        want, _ = gpt_run(args, 4, list(flags) + list(reference_flags), data, "one-node-" + name, steps=20,
                          model=GPT4)
        os.environ["STRATA_RANKS_PER_NODE"] = "2"
        try:
            got, out = gpt_run(args, 4, flags, data, "two-nodes-" + name, steps=20, model=GPT4)
        finally:
            del os.environ["STRATA_RANKS_PER_NODE"]
        assert "(4 rank(s) on 2 node(s): [0 1] [2 3]," in out, out
        assert f"rank 0's groups communicate through: {transport}\n" in out, out
        assert want.keys() == got.keys()
        for tensor in want:
            assert np.array_equal(want[tensor], got[tensor]), f"{name}: {tensor} differs across simulated nodes"
        print(f"  {name}: identical to one node; {transport}")
    os.environ["STRATA_RANKS_PER_NODE"] = "two"
    try:
        expect_bad_input(args, GPT4 + ["--data", data[0]], r"STRATA_RANKS_PER_NODE must be a positive integer, "
                         r"found 'two'", ranks=2)
    finally:
        del os.environ["STRATA_RANKS_PER_NODE"]
