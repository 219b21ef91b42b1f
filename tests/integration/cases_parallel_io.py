"""--checkpoint-io parallel: every rank writes its own part of the same layout-free file (parallel
HDF5 over MPI-IO). The same bytes as rank 0's files for dp, pp, tp and ZeRO 1-3 layouts at 4
ranks; resume across layouts from either kind; a full disk during a parallel write. (SIGKILL of
one rank during a parallel write: cases_checkpoint.case_checkpoint_sigkill, both modes.)"""
import os
import re
import signal
import subprocess

from cases_async_save import assert_same_checkpoint, saves
from cases_checkpoint import verify_crc
from cases_gpt import GPT_FLAGS_TIED, assert_close, gpt_run, resume, tokenize
from cases_tensor_parallel import GPT4_BYTES
from harness import MPI_ENV, read_model, train_ranks, write_dataset

ADAMW = ["--optimizer", "adamw", "--lr", "0.002", "--dropout", "0.1"]
MODE_LINE = {"parallel": "checkpoints: every rank writes its own part (--checkpoint-io parallel",
             "rank0": "checkpoints: rank 0 writes them (--checkpoint-io rank0"}


def case_parallel_io_equivalence(args):
    """Six 4-rank layouts of the 4-head GPT with AdamW (dp 4 ZeRO 1; pp 2 x dp 2 ZeRO 2, tied;
    tp 2 x dp 2 ZeRO 3; tp 2 x pp 2, tied; tp 4 in bf16; tp 2 x dp 2 ZeRO 1 in bf16): 10 steps
    saving at 5 and 10 with --checkpoint-io rank0 and parallel give the same loss lines and the
    same checkpoints (every dataset, its crc32 attribute and the root attributes but the options
    line); h5py checks every crc32 of the parallel files; each run says at start who writes. The
    data's 257 tokens: tp 2 and tp 4 hold padded wte/lm_head shards (ZeRO 3's shards of them
    too), whose padding rows neither mode writes."""
    data = tokenize(args, "byte")
    layouts = {
        "dp4-zero1": ["--zero", "1", "--tie-embeddings", "false"],
        "pp2-dp2-zero2": ["--pp", "2", "--micro-batch", "4", "--zero", "2", "--tie-embeddings", "true"],
        "tp2-dp2-zero3": ["--tp", "2", "--zero", "3", "--tie-embeddings", "false"],
        "tp2-pp2": ["--tp", "2", "--pp", "2", "--micro-batch", "4", "--tie-embeddings", "true"],
        "tp4-bf16": ["--tp", "4", "--precision", "bf16", "--tie-embeddings", "false"],
        "tp2-dp2-zero1-bf16": ["--tp", "2", "--zero", "1", "--precision", "bf16", "--tie-embeddings", "true"],
    }
    for name, layout in layouts.items():
        outs = {}
        for mode in ("rank0", "parallel"):
            extra = layout + ["--save-every", "5", "--checkpoint-io", mode]
            _, outs[mode] = gpt_run(args, 4, ADAMW, data, f"pio-{name}-{mode}", steps=10, extra=extra, model=GPT4_BYTES)
            assert MODE_LINE[mode] in outs[mode], outs[mode]
            assert len(saves(outs[mode])) == 2, outs[mode]
        losses = {m: re.findall(r"^step \d+/10 .* loss (\S+)", outs[m], re.M) for m in outs}
        assert losses["rank0"] and losses["rank0"] == losses["parallel"], losses
        for step in (5, 10):
            f = f"step-{step:08d}.h5"
            parallel = os.path.join(args.workdir, f"ck-pio-{name}-parallel", f)
            assert_same_checkpoint(parallel, os.path.join(args.workdir, f"ck-pio-{name}-rank0", f), f"{name}: {f}")
            n = verify_crc(parallel)
        print(f"{name}: rank0 and parallel checkpoints identical at steps 5 and 10 ({n} tensors, crc32 verified)")


def case_parallel_io_resume(args):
    """Resume across layouts from either kind of file: 20 steps under tp 2 x pp 2 (tied, SGD with
    momentum: AdamW's normalised steps would turn the layouts' rounding differences into more
    than 1e-5), resumed under tp 2 x dp 2 with ZeRO 3 to 50, in each mode, both within 1e-5 of
    50 steps on one rank, and the two resumed models identical bit for bit (the files were)."""
    data = tokenize(args, "byte")
    reference, _ = gpt_run(args, 1, GPT_FLAGS_TIED, data, "pio-resume-1", model=GPT4_BYTES)
    models = {}
    for mode in ("rank0", "parallel"):
        flags = GPT_FLAGS_TIED + ["--checkpoint-io", mode]
        models[mode] = resume(args, data, f"pio-{mode}", (4, ("--tp", "2", "--pp", "2", "--micro-batch", "4")),
                              (4, ("--tp", "2", "--zero", "3")), flags, model=GPT4_BYTES)
        assert_close(models[mode], reference, f"{mode}: tp2 x pp2 to 20 -> tp2 x dp2 zero 3 to 50 vs 1 rank")
    assert models["rank0"].keys() == models["parallel"].keys()
    for n in models["rank0"]:
        assert (models["rank0"][n] == models["parallel"][n]).all(), n
    print("resumed from a parallel-written and a rank-0-written checkpoint: identical models")


def case_parallel_io_full_disk(args):
    """A full disk during a parallel write (a 20 MiB tmpfs, 12 MiB checkpoints): the first save
    is whole, the second fails; the job exits non-zero on every rank without hanging, with one
    error line naming the file, no .tmp is left and `latest` still names the first checkpoint,
    whose every crc32 h5py checks."""
    w = args.workdir
    data = write_dataset(os.path.join(w, "pio-full.h5"), n=512, shape=(1, 32, 32), seed=7)
    disk = os.path.join(w, "pio-small-disk")
    os.makedirs(disk, exist_ok=True)
    subprocess.run(["umount", disk], capture_output=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", disk], capture_output=True, text=True)
    assert mount.returncode == 0, f"this case mounts a 20 MiB tmpfs (as root): {mount.stderr}"
    try:
        ck = os.path.join(disk, "ck")
        cmd = [args.mpirun, "-np", "4", "--oversubscribe", "--bind-to", "none", args.train, "--model", "mlp",
               "--hidden", "1024", "--optimizer", "adamw", "--data", data, "--global-batch", "32", "--steps", "6",
               "--save-every", "3", "--checkpoint-dir", ck, "--checkpoint-io", "parallel"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env=dict(os.environ, **MPI_ENV))
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # no rank may keep the small disk busy
            out, err = proc.communicate()
            raise AssertionError(f"the job hung after the disk filled\n{out[-3000:]}\n{err[-3000:]}")
        p = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        assert p.returncode != 0, p.stdout
        errors = [l for l in (p.stdout + p.stderr).splitlines() if l.startswith("error")]
        assert len(errors) == 1 and "step-00000006.h5.tmp" in errors[0], (errors, p.stdout, p.stderr)
        names = sorted(os.listdir(ck))
        assert not [n for n in names if n.endswith(".tmp")] and "step-00000006.h5" not in names, names
        assert open(os.path.join(ck, "latest")).read().strip() == "step-00000003.h5", names
        n = verify_crc(os.path.join(ck, "step-00000003.h5"))
        print(f"full disk at the second parallel save: exit {p.returncode}, '{errors[0][:120]}', "
              f"latest step-00000003.h5 ({n} tensors crc-verified), directory {names}")
    finally:
        if subprocess.run(["umount", disk], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", disk], capture_output=True)  # detached once nothing uses it
