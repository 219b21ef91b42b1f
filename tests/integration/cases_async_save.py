"""--async-save: checkpoints are written in the background while training goes on, by rank 0
(--checkpoint-io rank0) or by every rank its own part (parallel, the default where HDF5 is
parallel). Its checkpoints equal synchronous ones (every dataset and attribute but the recorded
options), and a preemption while writes are in flight leaves a complete `latest` (the stall of
a save step is measured by bench/checkpoint_bench.py)."""
import os
import re
import shutil
import signal

import h5py
import numpy as np

from harness import write_dataset, train_ranks, read_model, assert_same_model, RESUME_MLP
from cases_checkpoint import start_two_ranks, verify_crc


def contents(path):
    """Every dataset and root attribute of a checkpoint, but `config` (the options, --async-save included)."""
    with h5py.File(path, "r") as f:
        data = {}
        f.visititems(lambda n, o: data.update({n: (o[...], dict(o.attrs))}) if isinstance(o, h5py.Dataset) else None)
        attrs = {k: v for k, v in f.attrs.items() if k != "config"}
    return data, attrs


def assert_same_checkpoint(a, b, what):
    (da, aa), (db, ab) = contents(a), contents(b)
    assert da.keys() == db.keys(), (what, sorted(da), sorted(db))
    for name in da:
        assert np.array_equal(da[name][0], db[name][0]), f"{what}: {name} differs"
        assert da[name][1] == db[name][1], f"{what}: {name}'s attributes differ: {da[name][1]} vs {db[name][1]}"
    assert aa.keys() == ab.keys() and all(np.array_equal(aa[k], ab[k]) for k in aa), (what, aa, ab)


def saves(out):
    """(path, seconds, seconds training held or None) of each 'saved checkpoint' line."""
    found = re.findall(r"^saved checkpoint (\S+) \(\S+ \S+ in (\S+) s(?:, written in the background(?: by every "
                       r"rank)?: training held (\S+) s)?\)$", out, re.M)
    return [(p, float(t), float(h) if h else None) for p, t, h in found]


def case_async_save_equivalence(args):
    """The same runs with and without --async-save, rank 0 writing in the background or every
    rank its part (dp 2 with ZeRO 1, 2 pipeline stages, dp 2 in bf16; AdamW, a save every 5 of 40
    steps, --keep 3): the same loss lines and the same checkpoints, bit for bit; the async runs'
    save lines say how long training was held; the host copy --dry-run counts for rank 0's
    background write is the checkpoint's tensor bytes."""
    w = args.workdir
    data = write_dataset(os.path.join(w, "async.h5"), n=2048, shape=(1, 8, 8), seed=7)
    common = RESUME_MLP + ["--optimizer", "adamw", "--data", data, "--global-batch", "32", "--seed", "3",
                           "--steps", "40", "--save-every", "5", "--keep", "3", "--log-every", "5"]
    layouts = (("dp2-zero1", ["--zero", "1"]), ("pp2", ["--pp", "2", "--micro-batch", "8"]),
               ("dp2-bf16", ["--precision", "bf16"]))  # bf16: the f32 master weights are saved too
    modes = {"sync": [], "async": ["--async-save", "--checkpoint-io", "rank0"],
             "async-parallel": ["--async-save", "--checkpoint-io", "parallel"]}
    for name, layout in layouts:
        outs, dirs = {}, {}
        for mode, flags in modes.items():
            dirs[mode] = os.path.join(w, f"ck-async-{name}-{mode}")
            shutil.rmtree(dirs[mode], ignore_errors=True)
            outs[mode] = train_ranks(args, 2, common + layout + ["--checkpoint-dir", dirs[mode]] + flags)
        losses = {m: re.findall(r"^step \d+/40 .* loss (\S+)", outs[m], re.M) for m in outs}
        assert len(losses["sync"]) == 8 and all(losses[m] == losses["sync"] for m in modes), losses
        kept = {m: sorted(n for n in os.listdir(dirs[m]) if n.endswith(".h5")) for m in dirs}
        assert all(kept[m] == [f"step-{s:08d}.h5" for s in (30, 35, 40)] for m in modes), kept
        for mode in ("async", "async-parallel"):
            for n in kept["sync"]:
                assert_same_checkpoint(os.path.join(dirs[mode], n), os.path.join(dirs["sync"], n), f"{name} {mode}: {n}")
            assert open(os.path.join(dirs[mode], "latest")).read().strip() == "step-00000040.h5"
            background = saves(outs[mode])[:-1]  # the last, at the end of training, is waited for
            assert len(background) == 7 and all(h is not None for _, _, h in background), outs[mode]
        assert all(h is None for _, _, h in saves(outs["sync"])), outs["sync"]
        held = {m: max(h for _, _, h in saves(outs[m])[:-1]) for m in ("async", "async-parallel")}
        # --dry-run counts the host copy rank 0 keeps: every tensor of the checkpoint.
        plan = train_ranks(args, 2, common + layout + modes["async"] + ["--dry-run"])
        planned = int(re.search(r"--async-save: rank 0 holds .*: (\d+) bytes", plan).group(1))
        with h5py.File(os.path.join(dirs["async"], kept["async"][-1]), "r") as f:
            stored = []
            f.visititems(lambda n, o: stored.append(o.nbytes) if isinstance(o, h5py.Dataset) else None)
        assert planned == sum(stored), (name, planned, sum(stored))
        print(f"{name}: 8 saves, losses and the 3 kept checkpoints identical with --async-save by rank 0 and by every "
              f"rank (training held at most {held['async']:.3f} s and {held['async-parallel']:.3f} s); --dry-run's "
              f"host copy {planned} bytes = the checkpoint's tensors")


def case_async_save_preempt(args):
    """SIGTERM while background writes are in flight (a 12 MiB checkpoint every step), by rank 0
    and by every rank: the job stops at the next step boundary, finishes the write in flight,
    saves its own checkpoint synchronously and exits 3; `latest` names it, no .tmp is left, every
    checkpoint passes h5py's crc32 check, and --resume auto ends bit-identical to an
    uninterrupted run."""
    w = args.workdir
    data = write_dataset(os.path.join(w, "async-preempt.h5"), n=2048, shape=(1, 32, 32), seed=7)
    steps = 200
    common = ["--model", "mlp", "--hidden", "1024", "--optimizer", "adamw", "--data", data, "--global-batch", "32",
              "--seed", "3", "--steps", str(steps), "--log-every", "10", "--lr", "0.001"]
    ref_ck, ck = os.path.join(w, "ck-async-ref"), os.path.join(w, "ck-async-preempt")
    for d in (ref_ck, ck):
        shutil.rmtree(d, ignore_errors=True)
    train_ranks(args, 2, common + ["--checkpoint-dir", ref_ck])
    for io, says in (("rank0", "rank 0 writes them in the background"),
                     ("parallel", "every rank writes its own part in the background")):
        shutil.rmtree(ck, ignore_errors=True)
        preempt_async(args, common, ck, ref_ck, steps, io, says)


def preempt_async(args, common, ck, ref_ck, steps, io, says):
    p, ranks = start_two_ranks(args, common + ["--checkpoint-dir", ck, "--save-every", "1", "--keep", "4", "--async-save",
                                               "--checkpoint-io", io],
                               os.path.join(args.workdir, "async-preempt-metrics.jsonl"))
    os.kill(ranks[0], signal.SIGTERM)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 3, f"exit code {p.returncode}\n{out}\n{err}"
    step = int(re.search(r"stopping after step (\d+)", out).group(1))
    assert 10 <= step < steps, step
    assert f"checkpoints: {says}" in out, out
    final = saves(out)[-1]
    assert final[0].endswith(f"step-{step:08d}.h5") and final[2] is None, final
    latest = open(os.path.join(ck, "latest")).read().strip()
    names = os.listdir(ck)
    assert latest == f"step-{step:08d}.h5" and not [n for n in names if n.endswith(".tmp")], names
    kept = sorted(n for n in names if n.endswith(".h5"))
    assert kept[-1] == latest and len(kept) == 4 and all(n + ".manifest" in names for n in kept), names
    for n in kept:
        verify_crc(os.path.join(ck, n))
    out = train_ranks(args, 2, common + ["--checkpoint-dir", ck, "--resume", "auto"])
    assert f"at step {step}" in out, out
    assert_same_model(read_model(os.path.join(ck, f"step-{steps:08d}.h5")),
                      read_model(os.path.join(ref_ck, f"step-{steps:08d}.h5")),
                      "async saves every step, preempted + resumed vs uninterrupted", rtol=0.0)
    print(f"--checkpoint-io {io}: SIGTERM during background writes: stopped after step {step}, `latest` {latest}, "
          "4 kept checkpoints whole, resumed run identical to the uninterrupted one")
