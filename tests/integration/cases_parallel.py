"""Parallel layouts against one rank: data parallel (DDP, BatchNorm), pipeline stages (both
schedules, peak memory) and ZeRO 1-3 (equivalence, per-rank memory), and their bad inputs; the
one-node shared-memory segments after two stop signals."""
import ctypes
import glob
import os
import re
import select
import shutil
import signal
import struct
import subprocess
import tempfile
import time

from harness import MPI_ENV, write_dataset, expect_bad_input, train_ranks, assert_same_model, equivalence_runs
from cases_checkpoint import train_processes


def case_ddp_equivalence(args):
    """N data-parallel ranks == 1 rank, and 4 accumulated micro-batches == one batch, for the
    MLP (with dropout: masks are keyed by global sample index) and the CNN, after 50 steps."""
    for model in (["--model", "mlp", "--hidden", "64,32", "--dropout", "0.1"], ["--model", "cnn"]):
        runs = equivalence_runs(args, model, [(1, 32), (2, 16), (4, 8), (1, 8), (2, 4)])
        reference = runs[(1, 32)]
        for layout, tensors in runs.items():
            if layout != (1, 32):
                assert_same_model(tensors, reference, f"{model[1]} ranks={layout[0]} micro-batch={layout[1]} vs 1 rank")


def case_ddp_batchnorm(args):
    """BatchNorm statistics are local to each micro-batch on each rank (as torch.nn.BatchNorm2d
    under DDP without SyncBatchNorm). What this proves: 2 ranks x micro-batch 8 train exactly
    like 1 rank accumulating 2 micro-batches of 8 (same normalisation groups), so only the
    grouping of samples into normalisation batches differs from a 1 x 16 run, not the sync.
    Running statistics are per replica (the checkpoint holds replica 0's), so only trainable
    tensors are compared."""
    runs = equivalence_runs(args, ["--model", "resnet", "--depth", "8", "--width", "4"], [(1, 8), (2, 8)], steps=20,
                            global_batch=16)
    assert_same_model(runs[(2, 8)], runs[(1, 8)], "resnet-8 2 ranks x 8 vs 1 rank x 2 x 8", only_trainable=True)


def case_pipeline_equivalence(args):
    """p pipeline stages with m micro-batches == 1 stage accumulating m micro-batches, for the three
    schedules (interleaved with 2 and 3 chunks per rank), on the MLP and the CNN: pp=2, pp=4 and
    pp=2 x dp=2 on 4 ranks, after 50 steps,
    with the one-node shared-memory transports and with --shared-memory false (all MPI).
    Checkpoints are gathered from every stage to rank 0, so this also checks the gathering."""
    # One thread per rank everywhere: thread count splits the convolution sums differently.
    for model in (["--model", "mlp", "--hidden", "64,32,16", "--dropout", "0.1", "--threads", "1"],
                  ["--model", "cnn", "--threads", "1"]):
        layouts = [(1, 8)]
        for schedule in ("gpipe", "1f1b"):
            s = ("--schedule", schedule)
            layouts += [(2, 8, ("--pp", "2") + s), (4, 8, ("--pp", "4") + s), (4, 4, ("--pp", "2") + s),
                        (4, 8, ("--pp", "4", "--partition", "1,2,3") + s)]
        # Interleaved 1F1B: each rank holds v chunks (virtual stages s, s + P, ...), each with its
        # own gradient buckets and optimizer; m = 4 micro-batches (global batch 32), a multiple of P.
        il = ("--schedule", "interleaved", "--virtual-stages")
        layouts += [(2, 8, ("--pp", "2") + il + ("2",)), (2, 8, ("--pp", "2") + il + ("3",)),
                    (4, 8, ("--pp", "4") + il + ("2",)), (4, 4, ("--pp", "2", "--zero", "1") + il + ("2",))]
        # Everything through MPI instead of shared memory (messages, all-reduce, ZeRO 1's reduce
        # and all-gather): the same model.
        layouts += [(4, 4, ("--pp", "2", "--shared-memory", "false")),
                    (4, 4, ("--pp", "2", "--zero", "1", "--shared-memory", "false"))]
        runs = equivalence_runs(args, model, layouts)
        for layout, tensors in runs.items():
            if layout != (1, 8):
                # A pure pipeline (one replica) adds in the same order as 1 stage: bit for bit.
                pure = layout[0] == int(layout[2][layout[2].index("--pp") + 1])
                assert_same_model(tensors, runs[(1, 8)], f"{model[1]} {layout} vs 1 rank", rtol=0.0 if pure else 1e-5)


def case_pipeline_memory(args):
    """Peak micro-batches in flight per stage: GPipe holds all m, 1F1B at most P - s."""
    m = 8
    outputs = {}
    equivalence_runs(args, ["--model", "mlp", "--hidden", "32,32,32"],
                     [(4, 4, ("--pp", "4", "--schedule", k)) for k in ("gpipe", "1f1b")], steps=3, outputs=outputs)
    for (ranks, micro, extra), out in outputs.items():
        kind = extra[-1]
        line = re.search(r"peak micro-batches in flight per stage: ([0-9. ]+)", out)
        assert line, out
        peaks = [int(float(v)) for v in line.group(1).split()]
        expected = [m] * 4 if kind == "gpipe" else [min(m, 4 - s) for s in range(4)]
        assert peaks == expected, f"{kind}: peaks {peaks}, expected {expected}"
        print(f"{kind}: peak in flight per stage {peaks}")

    # --bench-stage-ms (stand-in compute for bench/pipeline_bubble.py): every forward lasts at
    # least the given time and every backward twice that, and the model is unchanged by it.
    svg = os.path.join(args.workdir, "standin.svg")
    plain, standin = (2, 8, ("--pp", "2")), (2, 8, ("--pp", "2", "--bench-stage-ms", "15", "--timeline", svg))
    runs = equivalence_runs(args, ["--model", "mlp", "--hidden", "32,32,32"], [plain, standin], steps=2)
    assert_same_model(runs[standin], runs[plain], "--bench-stage-ms 15 vs without", rtol=0.0)
    events = re.findall(r"<title>stage (\d) ([FB])(\d+): ([0-9.]+) - ([0-9.]+) s</title>", open(svg).read())
    assert len(events) == 2 * 2 * 4, events  # 2 stages x forward and backward x 4 micro-batches
    for stage, op, i, start, end in events:
        least = 0.015 if op == "F" else 0.030
        assert float(end) - float(start) >= least, f"stage {stage} {op}{i} took {float(end) - float(start)} s < {least}"
    print(f"--bench-stage-ms 15: {len(events)} timeline events, each at least its stand-in time; same model")


def case_pipeline_bad_inputs(args):
    """Pipeline layouts that cannot work: one line each, exit 2 on every rank."""
    data = write_dataset(os.path.join(args.workdir, "pp.h5"))
    # mlp with one hidden layer has 4 layers: flatten, fc1, relu1, fc2.
    base = ["--data", data, "--steps", "2", "--global-batch", "8", "--model", "mlp", "--hidden", "16"]
    expect_bad_input(args, base + ["--pp", "3"], r"--pp 3 does not divide the 4 ranks", ranks=4)
    expect_bad_input(args, base + ["--pp", "5"], r"--pp 5 needs at least 5 layers, but the model has 4", ranks=5)
    expect_bad_input(args, base + ["--pp", "2", "--partition", "1,2"], r"--partition '1,2' makes 3 stages but --pp is 2",
                     ranks=2)
    expect_bad_input(args, base + ["--pp", "4", "--partition", "1,2,9"], r"cut points.*1\.\.3.*'9'", ranks=4)
    expect_bad_input(args, base + ["--pp", "2", "--partition", "3,2"], r"increase", ranks=2)
    expect_bad_input(args, base + ["--pp", "2", "--micro-batch", "3"], r"micro-batch \(3\)", ranks=2)
    expect_bad_input(args, base + ["--pp", "2", "--virtual-stages", "2"],
                     r"--virtual-stages 2 needs --schedule interleaved, found --schedule 1f1b", ranks=2)
    expect_bad_input(args, base + ["--schedule", "interleaved", "--virtual-stages", "2"],
                     r"--virtual-stages 2 needs --pp 2 or more.*found --pp 1", ranks=2)
    expect_bad_input(args, base + ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "3"],
                     r"--pp 2 x --virtual-stages 3 \(6 stages\) needs at least 6 layers, but the model has 4", ranks=2)
    expect_bad_input(args, base + ["--pp", "2", "--bench-stage-ms", "-1"], r"--bench-stage-ms must be in", ranks=2)


ZERO_MLP = ["--model", "mlp", "--hidden", "64,32"]


def case_zero_equivalence(args):
    """ZeRO 1 (optimizer state sharded, parameters all-gathered), ZeRO 2 (gradients reduced to
    their owners per bucket and micro-batch, only the own shard kept) and ZeRO 3 (parameters
    sharded too, gathered per layer around forward and backward) == ZeRO 0 after 50 steps, with
    SGD-momentum and with AdamW + clipping (the norm is summed over shards), for dp = 2, dp = 4
    and pp = 2 x dp = 2, each also with gradient accumulation (micro-batch smaller than the
    per-replica batch: ZeRO 2 and 3 reduce every micro-batch into the shard). dp = 4 splits the
    MLP's 6384 elements into 1600-element shards, so the last rank's shard is shorter (1584);
    --bucket-mb 0.01 cuts the MLP into buckets that straddle shard boundaries, and fc1 (4160
    elements) spans two buckets and three owners' shards; with --bucket-mb 0.001 ZeRO 2/3's
    gradient ring wraps. The CNN runs once under ZeRO 3. A checkpoint saved
    under ZeRO 3 loads with --init-from under ZeRO 0 and evaluates the same as under ZeRO 3."""
    for optimizer in (("--optimizer", "sgd", "--momentum", "0.9"), ("--optimizer", "adamw", "--clip-grad", "1.0")):
        # The last three accumulate 4 micro-batches per replica (global batch 32).
        for ranks, micro, grid, stages in ((2, 16, (), "0123"), (4, 8, (), "0123"), (4, 8, ("--pp", "2"), "0123"),
                                           (2, 4, (), "023"), (4, 2, (), "023"), (4, 4, ("--pp", "2"), "023")):
            layouts = {z: (ranks, micro, grid + optimizer + ("--zero", z)) for z in stages}
            runs = equivalence_runs(args, ZERO_MLP, list(layouts.values()))
            for z in stages[1:]:
                assert_same_model(runs[layouts[z]], runs[layouts["0"]],
                                  f"zero {z} vs 0, {ranks} ranks micro-batch {micro} {grid} {optimizer}")
    # --bucket-mb 0.001 (262 elements): every layer but fc3 streams its gradients in pieces of 4
    # rows (256 elements) through a ring of 518 elements, which wraps about 12 times per backward:
    # a bucket a wrap splits is reduced as two pieces. With and without accumulation.
    for ranks, micro in ((2, 16), (4, 2)):
        layouts = {z: (ranks, micro, ("--optimizer", "sgd", "--momentum", "0.9", "--zero", z)) for z in "023"}
        runs = equivalence_runs(args, ZERO_MLP, list(layouts.values()), bucket_mb="0.001")
        for z in "23":
            assert_same_model(runs[layouts[z]], runs[layouts["0"]],
                              f"zero {z} vs 0, {ranks} ranks micro-batch {micro}, a ring that wraps")
    # The CNN with SGD-momentum. (With AdamW + clipping ZeRO 2 and 3 are bit-identical to each
    # other and 9.2e-6 from ZeRO 0 after 50 steps: AdamW's m/sqrt(v) amplifies last-bit gradient
    # differences on near-zero gradients; too close to the tolerance for a stable test.)
    for optimizer in (("--optimizer", "sgd", "--momentum", "0.9"),):
        layouts = [(2, 8, optimizer + ("--zero", z)) for z in "023"]
        runs = equivalence_runs(args, ["--model", "cnn"], layouts)
        for k in (1, 2):
            assert_same_model(runs[layouts[k]], runs[layouts[0]], f"cnn {layouts[k][2]} vs zero 0, 2 ranks micro 8")

    # Save under ZeRO 3 (pp = 2 x dp = 2), evaluate that checkpoint under ZeRO 3 and under ZeRO 0.
    data = os.path.join(args.workdir, "eq.h5")
    ck = os.path.join(args.workdir, "ck-zero3-eval")
    train_ranks(args, 4, ZERO_MLP + ["--pp", "2", "--zero", "3", "--data", data, "--steps", "5", "--global-batch",
                                     "32", "--checkpoint-dir", ck])
    results = []
    for zero in ("3", "0"):
        out = train_ranks(args, 4, ZERO_MLP + ["--pp", "2", "--zero", zero, "--data", data, "--global-batch", "32",
                                               "--eval-only", "--init-from", os.path.join(ck, "step-00000005.h5")])
        m = re.search(r"evaluation: loss ([0-9.]+)\s+accuracy ([0-9.]+)%", out)
        assert m, out
        results.append(m.groups())
    assert results[0] == results[1], f"--eval-only under zero 3 {results[0]} != under zero 0 {results[1]}"
    print(f"zero 3 checkpoint evaluated under zero 3 and zero 0: loss, accuracy {results[0]}")


def dry_run_table(args, ranks, flags):
    """Runs --dry-run and returns {rank: {params, grads, optimizer, activations}} in bytes."""
    data = write_dataset(os.path.join(args.workdir, "eq.h5"), n=2048, shape=(1, 8, 8), classes=4, seed=7)
    out = train_ranks(args, ranks, flags + ["--data", data, "--global-batch", "32", "--dry-run"], timeout=120)
    assert not re.search(r"^step ", out, re.M), f"--dry-run trained:\n{out}"
    rows = {}
    # "rank 3 (stage 1, replica 1): ..." or, for ranks of one stage with equal bytes, "ranks 0-2 (stage 0, ...".
    for m in re.finditer(r"ranks? (\d+)(?:-(\d+))? \(stage \d+, replicas? [\d-]+\): params (\d+), grads (\d+), "
                         r"optimizer (\d+), activations (\d+)", out):
        first, last = int(m.group(1)), int(m.group(2) or m.group(1))
        for r in range(first, last + 1):
            rows[r] = dict(zip(("params", "grads", "optimizer", "activations"), map(int, m.groups()[2:])))
    assert sorted(rows) == list(range(ranks)), out
    return rows


def ring_elements(layers, total, bucket_mb):
    """Elements of ZeRO 2/3's gradient ring, as the GradientRing sizes it: the largest tile plus one
    bucket of bucket_mb MiB, at most the whole buffer. A layer whose gradients (weight + bias)
    exceed a bucket writes them in pieces, the bias first, then blocks of max(bucket // cols, 1)
    weight rows from the last down, each piece's tile reaching up to the one above (the highest
    to the layer's end, the lowest down to its start); another layer is one tile, its extent.
    layers: (rows, cols) of each Linear, forward order; every tensor starts on a 16-element
    boundary and the last layer's extent reaches to the padded end `total`."""
    align = lambda n, m=16: (n + m - 1) // m * m
    bucket = max(int(bucket_mb * (1 << 20)) // 4, 1)
    tiles, begin = [], 0
    for k, (rows, cols) in enumerate(layers):
        bias_at = begin + align(rows * cols)
        end = total if k == len(layers) - 1 else bias_at + align(rows)
        if rows * cols + rows <= bucket:
            tiles.append(end - begin)
        else:
            block = max(bucket // cols, 1)
            top = end
            for cut in [bias_at] + [begin + max(hi - block, 0) * cols for hi in range(rows, 0, -block)]:
                tiles.append(top - cut)
                top = cut
        begin = end
    return min(max(tiles) + bucket, total)


def case_zero_memory(args):
    """--dry-run's per-rank table, from the real allocations: with ZeRO 1 and 2 each rank holds
    optimizer state for S = align_up(ceil(N / dp), 16) elements (64-byte alignment), 4 bytes x
    (1 for SGD-momentum, 2 for AdamW) each; the last rank may hold less (N - (dp-1) S).
    Parameters stay whole, padded to dp x S elements; so do gradients with ZeRO 1, while ZeRO 2
    and 3 keep a gradient shard of S elements plus a ring of the largest tile + one bucket (fc1
    and fc2 stream their gradients in pieces of 20 rows).
    ZeRO 3 keeps a parameter shard of S elements plus two window slots, layer j in slot j % 2,
    each as large as its largest layer (from its first parameter to the end of its last): fc1's
    4096 + 64 elements (fc1 and fc3 share slot 0) and fc2's 2048 + 32."""
    align = lambda n, m=16: (n + m - 1) // m * m
    # The MLP's flat layout, computed here independently: 8x8 inputs, 64, 32, 4 classes;
    # every tensor starts on a 16-element boundary.
    sizes = [64 * 64, 64, 32 * 64, 32, 4 * 32, 4]
    n = sum(align(s) for s in sizes)
    layer_span = [align(sizes[k]) + sizes[k + 1] for k in (0, 2, 4)]  # fc1, fc2, fc3
    windows = max(layer_span[0], layer_span[2]) + layer_span[1]
    bucket_mb = 0.005  # 1310 elements: fc1 (4160) and fc2 (2080) stream, ring 1280 + 1310 < dp*S
    for optimizer, per_element in (("sgd", 1), ("adamw", 2)):
        for dp in (1, 2, 4):
            flags = ZERO_MLP + ["--optimizer", optimizer, "--bucket-mb", str(bucket_mb)]
            base = dry_run_table(args, dp, flags + ["--zero", "0"])
            shard = align(-(-n // dp))
            ring = ring_elements([(64, 64), (32, 64), (4, 32)], dp * shard, bucket_mb)
            for zero in (1, 2, 3):
                rows = dry_run_table(args, dp, flags + ["--zero", str(zero)])
                for r in range(dp):
                    assert base[r]["grads"] == 4 * n and base[r]["optimizer"] == 4 * per_element * n, (r, base[r])
                    owned = max(0, min(shard, n - r * shard))
                    assert owned == shard or r == dp - 1, (dp, r, owned)
                    grads = 4 * dp * shard if zero == 1 else 4 * shard + 4 * ring
                    params = 4 * dp * shard if zero < 3 else 4 * shard + 4 * windows
                    expected = {"params": params, "grads": grads, "optimizer": 4 * per_element * owned,
                                "activations": base[r]["activations"]}
                    assert rows[r] == expected, f"{optimizer} zero {zero} dp={dp} rank {r}: {rows[r]}, expected {expected}"
                print(f"{optimizer} zero {zero} dp={dp}: N={n} S={shard} gradient ring {ring}: optimizer bytes per "
                      f"rank {[rows[r]['optimizer'] for r in range(dp)]} (zero 0: {base[0]['optimizer']}), "
                      f"params/grads {rows[0]['params']}/{rows[0]['grads']} "
                      f"(zero 0: {base[0]['params']}/{base[0]['grads']})")


def case_zero_bad_inputs(args):
    """Unknown ZeRO stages: one line each, exit 2 on every rank."""
    data = write_dataset(os.path.join(args.workdir, "zero.h5"))
    base = ["--data", data, "--steps", "2", "--global-batch", "8", "--model", "mlp", "--hidden", "16"]
    expect_bad_input(args, base + ["--zero", "4"], r"--zero must be 0, 1, 2 or 3, found 4", ranks=2)
    expect_bad_input(args, base + ["--zero", "x"], r"zero.*x|x.*zero")


def shm_names_of_run(ranks, jobs=()):
    """/dev/shm entries that belong to the job of these rank pids: Strata's segments (named after
    the pid of the group's rank 0), its heartbeats and Open MPI's vader segments of `jobs`."""
    pids = "|".join(str(r) for r in ranks)
    pattern = re.compile(rf"^strata-(heartbeat-)?({pids})(-|$)" + "".join(f"|{re.escape(j)}" for j in jobs))
    return sorted(n for n in os.listdir("/dev/shm") if pattern.search(n))


def mapped_shm(pid):
    """{name: deleted} of the /dev/shm files that process `pid` maps."""
    found = {}
    for line in open(f"/proc/{pid}/maps"):
        m = re.search(r"/dev/shm/(\S+)( \(deleted\))?$", line.rstrip("\n"))
        if m:
            found[m.group(1)] = bool(m.group(2))
    return found


def vader_jobs(names):
    """The job part of Open MPI's vader segment names (vader_segment.HOST.UID.JOBID.RANK -> '.JOBID.')."""
    return sorted({"." + n.split(".")[-2] + "." for n in names if n.startswith("vader_segment.")})


def running(pid):
    """Whether process `pid` exists and is not a zombie."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def finish(p, ranks, what):
    """Waits for mpirun; returns (rc, stderr); no rank may outlive it by 10 s."""
    try:
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    for _ in range(100):
        alive = [r for r in ranks if running(r)]
        if not alive:
            break
        time.sleep(0.1)
    for r in alive:
        os.kill(r, signal.SIGKILL)
    assert not alive, f"{what}: ranks {alive} still running 10 s after mpirun ended\n{out}\n{err}"
    return p.returncode, err


def remove_leftovers(ranks, jobs):
    """Removes (after the assertion's evidence is taken) whatever this run left in /dev/shm."""
    left = shm_names_of_run(ranks, jobs)
    for n in left:
        try:
            os.remove(os.path.join("/dev/shm", n))
        except OSError:
            pass
    return left


def signal_while_named(args, cmd, env):
    """Runs `cmd` (train on 2 ranks) and, when inotify sees a rank create a segment in /dev/shm,
    stops the other rank (so the name stays until the creator exits) and sends the creator a
    SIGINT (in setup: it exits at once), then the other rank one. Returns (the segment, or None if
    every one had lost its name before the peer stopped; mpirun's exit code; its stderr; the
    ranks; Open MPI's job ids)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK)
    assert fd >= 0 and libc.inotify_add_watch(fd, b"/dev/shm", 0x100) >= 0, "inotify"  # IN_CREATE
    tested, ranks, jobs, pending = None, [], [], b""
    try:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.monotonic() + 120
        while tested is None and p.poll() is None and time.monotonic() < deadline:
            if len(ranks) < 2:
                ranks = train_processes(p.pid, args.train)
            if not select.select([fd], [], [], 0.01)[0]:
                continue
            pending += os.read(fd, 65536)
            names = []
            while len(pending) >= 16:  # struct inotify_event: wd, mask, cookie, len, name[len]
                length = struct.unpack_from("iIII", pending)[3]
                names.append(pending[16:16 + length].rstrip(b"\0").decode())
                pending = pending[16 + length:]
            for n in names:
                m = re.match(r"strata-(\d+)-(\d+)-([01])$", n)  # /strata-<group rank 0's pid>-<serial>-<rank>
                if tested is not None or not m or len(ranks) < 2 or int(m.group(1)) not in ranks:
                    continue
                creator = int(m.group(1)) if m.group(3) == "0" else [r for r in ranks if r != int(m.group(1))][0]
                peer = [r for r in ranks if r != creator][0]
                os.kill(peer, signal.SIGSTOP)  # the creator cannot get past the agreement that all opened it
                time.sleep(0.3)
                if not os.path.exists(os.path.join("/dev/shm", n)):  # too late: the peer had opened it
                    os.kill(peer, signal.SIGCONT)  # try the next segment
                    continue
                jobs = vader_jobs(mapped_shm(peer))
                os.kill(creator, signal.SIGINT)  # while its segment has a name
                time.sleep(0.3)
                os.kill(peer, signal.SIGCONT)
                os.kill(peer, signal.SIGINT)
                tested = n
        if len(ranks) < 2:
            ranks = train_processes(p.pid, args.train)
        if tested is None:
            for r in ranks:
                try:
                    os.kill(r, signal.SIGKILL)
                except OSError:
                    pass
        rc, err = finish(p, ranks, "setup")
    finally:
        os.close(fd)
    return tested, rc, err, ranks, jobs


def case_shm_two_signals(args):
    """Stop signals that end a 2-rank job whose data-parallel group uses one-node shared memory at
    once (_exit in the handler) leave no /dev/shm name of the job.
    (1) Mid-training: the group's segments lost their names as soon as every rank had mapped
    them (so not even SIGKILL could leave them); two SIGINTs to both ranks -> exit 4, and mpirun
    removes Open MPI's vader segments too.
    (2) During setup, in the moment a segment has a name (created, the peer has not opened it
    yet: the peer is held there with SIGSTOP, found by inotify on /dev/shm): one SIGINT to the
    creating rank -> exit 3 at once (a stop in setup), and the handler has unlinked the name
    (parallel::unlink_shared_segments_for_exit).
    (3) Ctrl-C twice to mpirun: Open MPI 4's mpirun exit(1)s at once and leaves its own vader
    segments (removed here, not asserted on); nothing of Strata's is left.
    Names are matched by the ranks' pids and the job id in Open MPI's names, so the runs of other
    tests beside this one do not count."""
    w = args.workdir
    data = write_dataset(os.path.join(w, "shm.h5"), n=256, shape=(1, 8, 8))
    # --bench-stage-ms: 1.5 s per step, so the first signal's stop (and save) cannot end the run
    # before the second signal comes.
    flags = ["--model", "mlp", "--hidden", "2048,2048", "--threads", "1", "--data", data, "--steps", "100000",
             "--global-batch", "16", "--log-every", "1", "--bench-stage-ms", "500"]
    mpirun = [args.mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none", args.train]
    env = dict(os.environ, **MPI_ENV)
    second = "error: a second stop signal: exiting at once, without saving (exit code 4)"

    # (1) Mid-training.
    # Names of its own in the work folder that every case shares (cases_cli's run writes
    # metrics.jsonl there, and CTest runs the two side by side).
    metrics = os.path.join(w, "shm-two-signals.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    p = subprocess.Popen(mpirun + flags + ["--checkpoint-dir", os.path.join(w, "ck-shm1"), "--metrics", metrics],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0) and p.poll() is None:
        time.sleep(0.01)
    ranks = train_processes(p.pid, args.train)
    assert len(ranks) == 2, ranks
    mapped = {}
    for r in ranks:
        mapped.update(mapped_shm(r))
    strata = {n: deleted for n, deleted in mapped.items() if n.startswith("strata-")}
    jobs = vader_jobs(mapped)
    assert any(re.match(r"strata-\d+-\d+-\d+$", n) for n in strata), f"no shared-memory group in use: {mapped}"
    assert all(strata.values()), f"segments still named in /dev/shm while training: {strata}"
    for sig in (signal.SIGINT, signal.SIGINT):
        for r in ranks:
            os.kill(r, sig)
        time.sleep(0.2)
    rc, err = finish(p, ranks, "mid-training")
    left = remove_leftovers(ranks, jobs)
    assert rc == 4 and second in err, f"exit code {rc}\n{err}"
    assert not left, f"mid-training: left in /dev/shm: {left}"
    print(f"(1) mid-training: {len(strata)} segments mapped, none named; two SIGINTs to the ranks: exit 4, "
          f"nothing left (Open MPI job {jobs})")

    # (2) During setup. A larger model: reserving its gradient buffer in /dev/shm takes long
    # enough to stop the peer before it opens the name. A run in which every segment lost its
    # name before the peer was stopped (a busy machine) tests nothing: up to 3 runs.
    for attempt in range(1, 4):
        cmd = mpirun + [("4096,4096" if f == "2048,2048" else f) for f in flags] + [
            "--checkpoint-dir", os.path.join(w, "ck-shm2")]
        tested, rc, err, ranks, jobs = signal_while_named(args, cmd, env)
        left = remove_leftovers(ranks, jobs)
        if tested:
            break
    assert tested, f"no segment was caught while named in 3 runs (rc {rc}): nothing was tested\n{err}"
    in_setup = "error: a stop signal during setup: exiting at once, nothing to save (exit code 3)"
    assert rc == 3 and in_setup in err, f"exit code {rc}\n{err}"
    assert not left, f"setup: a signal while {tested} was named: left in /dev/shm: {left}"
    print(f"(2) setup: a SIGINT while /dev/shm/{tested} was named (its peer stopped; run {attempt}): exit 3, "
          f"nothing left")

    # (3) Ctrl-C twice to mpirun.
    if os.path.exists(metrics):
        os.remove(metrics)
    p = subprocess.Popen(mpirun + flags + ["--checkpoint-dir", os.path.join(w, "ck-shm3"), "--metrics", metrics],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0) and p.poll() is None:
        time.sleep(0.01)
    ranks = train_processes(p.pid, args.train)
    assert len(ranks) == 2, ranks
    jobs = vader_jobs(mapped_shm(ranks[0]))
    p.send_signal(signal.SIGINT)
    time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    rc, err = finish(p, ranks, "Ctrl-C twice to mpirun")
    left = remove_leftovers(ranks, jobs)
    # mpirun's forced exit skips its cleanup: its session directory stays in /tmp as well.
    for d in glob.glob(os.path.join(tempfile.gettempdir(), "ompi.*", f"pid.{p.pid}")):
        shutil.rmtree(d, ignore_errors=True)
    assert rc != 0, err
    ours = [n for n in left if n.startswith("strata-")]
    assert not ours, f"Ctrl-C twice to mpirun: left in /dev/shm: {ours}"
    print(f"(3) Ctrl-C twice to mpirun: exit {rc}; nothing of Strata's left; Open MPI's own: {left or 'none'}")
