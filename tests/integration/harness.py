"""The harness shared by the end-to-end cases (cli_cases.py dispatches to the cases_*.py
modules): running train alone or under mpirun, bad-input expectations, h5py-written datasets,
reading and comparing checkpoints' models, the equivalence and resume runs, and the case
registry and command line."""
import argparse
import json
import os
import re
import subprocess

import h5py
import numpy as np

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def write_dataset(path, n=512, shape=(1, 6, 6), classes=4, seed=0, labels=None, inputs_dtype=np.uint8):
    """A learnable task: each class brightens its own band of rows, plus noise."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n) if labels is None else np.asarray(labels)
    x = rng.integers(0, 100, (n,) + tuple(shape)).astype(np.float32)
    rows = shape[-2] if len(shape) >= 2 else shape[-1]
    band = max(1, rows // classes)
    for i, c in enumerate(y):
        if len(shape) >= 2:
            x[i, ..., c * band:(c + 1) * band, :] += 150
        else:
            x[i, c * band:(c + 1) * band] += 150
    x = np.clip(x, 0, 255).astype(inputs_dtype)
    with h5py.File(path, "w") as f:
        f.create_dataset("inputs", data=x)
        f.create_dataset("labels", data=y.astype(np.int64))
    return path


def run(args, cmd, env=None, timeout=120):
    full_env = dict(os.environ, **MPI_ENV, **(env or {}))
    p = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def expect_bad_input(args, flags, pattern, ranks=0):
    cmd = [args.train] + flags
    if ranks:
        cmd = [args.mpirun, "-np", str(ranks), "--oversubscribe", "--quiet"] + cmd
    rc, out, err = run(args, cmd)
    lines = [l for l in err.splitlines() if l.strip()]
    assert rc == 2, f"expected exit code 2, got {rc}\nstdout:\n{out}\nstderr:\n{err}"
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    assert lines[0].startswith("error: "), f"expected 'error: ...', got: {lines[0]}"
    assert re.search(pattern, lines[0]), f"stderr line {lines[0]!r} does not match {pattern!r}"
    for bad in ("terminate called", "Traceback", "core dumped", "Segmentation", "HDF5-DIAG"):
        assert bad not in err + out, f"found {bad!r} in output:\n{err}"


def expect_tool_error(cmd, pattern, absent=()):
    """A tool (tools/export_torch.py, tools/strata-plot) given a bad input: exit 2, one stderr line
    `error: ...` matching `pattern`, no traceback, and none of the paths `absent` (its output, or
    a temporary file beside it) left behind."""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    what = f"{' '.join(cmd)}\nrc={p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    assert p.returncode == 2, f"expected exit code 2: {what}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"expected one line 'error: ...': {what}"
    assert re.search(pattern, lines[0]), f"stderr line {lines[0]!r} does not match {pattern!r}"
    assert "Traceback" not in p.stdout + p.stderr, what
    for path in absent:
        folder = os.path.dirname(path) or "."
        left = [n for n in (os.listdir(folder) if os.path.isdir(folder) else []) if os.path.basename(path) in n]
        assert not left, f"{' '.join(cmd)} left {left} in {folder}"
    return lines[0]


def train_ranks(args, ranks, flags, timeout=600):
    """Runs train on `ranks` ranks (mpirun even for 1, as users do) and returns its stdout."""
    cmd = [args.mpirun, "-np", str(ranks), "--oversubscribe", "--bind-to", "none", args.train] + flags
    rc, out, err = run(args, cmd, timeout=timeout)
    assert rc == 0, f"{' '.join(cmd)}\nrc={rc}\n{out}\n{err}"
    return out


def progress_lines(path):
    """The --metrics file's progress lines (every line parses as JSON; evaluation lines, which have
    an "eval" key, left out)."""
    return [r for r in (json.loads(l) for l in open(path)) if "eval" not in r]


def read_model(path):
    with h5py.File(path, "r") as f:
        tensors = {}
        f["model"].visititems(lambda name, obj: tensors.update({name: obj[...]}) if isinstance(obj, h5py.Dataset) else None)
        return tensors


def all_tensors(path):
    """{name: array} of every dataset of a checkpoint, for bit-for-bit comparison."""
    with h5py.File(path, "r") as f:
        out = {}
        f.visititems(lambda n, o: out.update({n: o[...]}) if isinstance(o, h5py.Dataset) else None)
        return out


def assert_same_model(a, b, what, rtol=1e-5, only_trainable=False):
    """Every /model tensor equal within rtol, norm-wise relative (||a-b|| / ||b||)."""
    skip = ("running_mean", "running_var") if only_trainable else ()
    names = [n for n in a if not n.endswith(skip)]
    assert names and set(names) <= set(b), (what, sorted(a), sorted(b))
    worst = 0.0
    for n in names:
        diff = np.linalg.norm(a[n].astype(np.float64) - b[n]) / max(np.linalg.norm(b[n].astype(np.float64)), 1e-30)
        worst = max(worst, diff)
        assert diff <= rtol, f"{what}: {n} differs by {diff:.3g} (relative), tolerance {rtol}"
    print(f"{what}: {len(names)} tensors, worst relative difference {worst:.3g}")


def equivalence_runs(args, model_flags, layouts, steps=50, global_batch=32, outputs=None, bucket_mb="0.01"):
    """Trains the same model under each layout (ranks, micro_batch[, extra flags]); returns
    their /model tensors by layout (and their stdout in `outputs` if given)."""
    data = write_dataset(os.path.join(args.workdir, "eq.h5"), n=2048, shape=(1, 8, 8), classes=4, seed=7)
    models = {}
    for layout in layouts:
        ranks, micro, extra = (tuple(layout) + ((),))[:3]
        name = "-".join(model_flags + [str(ranks), str(micro), bucket_mb] + list(extra)).replace("/", "_").replace(",", "_")
        ck = os.path.join(args.workdir, "ck" + name)
        out = train_ranks(args, ranks, model_flags + list(extra) + [
            "--data", data, "--steps", str(steps), "--global-batch", str(global_batch), "--micro-batch", str(micro),
            "--lr", "0.05", "--seed", "3", "--checkpoint-dir", ck, "--log-every", "25", "--bucket-mb", bucket_mb])
        if outputs is not None:
            outputs[layout] = out
        models[layout] = read_model(os.path.join(ck, f"step-{steps:08d}.h5"))
    return models


RESUME_MLP = ["--model", "mlp", "--hidden", "64,32", "--dropout", "0.1"]


def resumed_run(args, model_flags, save_layout, resume_layout, optimizer, steps=50, split=20, global_batch=32):
    """Trains `split` steps under save_layout (ranks, flags) with a checkpoint, then resumes it
    in a new process under resume_layout up to `steps`; returns the final /model tensors and
    the resumed run's stdout."""
    data = write_dataset(os.path.join(args.workdir, "eq.h5"), n=2048, shape=(1, 8, 8), classes=4, seed=7)
    name = "-".join(model_flags + list(optimizer) + [str(save_layout[0])] + list(save_layout[1]) +
                    [str(resume_layout[0])] + list(resume_layout[1])).replace(",", "_")
    ck = os.path.join(args.workdir, "ck-resume" + name)
    if os.path.isdir(ck):
        for f in os.listdir(ck):
            os.remove(os.path.join(ck, f))
    common = model_flags + list(optimizer) + ["--data", data, "--global-batch", str(global_batch), "--lr", "0.05",
                                              "--seed", "3", "--checkpoint-dir", ck, "--log-every", "25"]
    train_ranks(args, save_layout[0], common + list(save_layout[1]) + ["--steps", str(split), "--save-every", str(split)])
    assert open(os.path.join(ck, "latest")).read().strip() == f"step-{split:08d}.h5"
    out = train_ranks(args, resume_layout[0], common + list(resume_layout[1]) + ["--steps", str(steps), "--resume", "auto"])
    assert f"resuming from {os.path.join(ck, f'step-{split:08d}.h5')} at step {split}" in out, out
    return read_model(os.path.join(ck, f"step-{steps:08d}.h5")), out


def collect_cases(modules):
    """{case name: function} for every case_<name> function of `modules`."""
    cases = {}
    for module in modules:
        for name, fn in vars(module).items():
            if name.startswith("case_"):
                assert name[5:] not in cases, f"case {name[5:]} is defined twice"
                cases[name[5:]] = fn
    return cases


def main(modules):
    """Parses the command line and runs one case of `modules` in its own work directory."""
    cases = collect_cases(modules)
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=sorted(cases))
    p.add_argument("--train", required=True)
    p.add_argument("--mpirun", default="mpirun")
    p.add_argument("--data-tool", default="strata-data")
    p.add_argument("--sample-tool", default="strata-sample")
    p.add_argument("--workdir", required=True)
    a = p.parse_args()
    a.workdir = os.path.join(a.workdir, a.case)
    os.makedirs(a.workdir, exist_ok=True)
    cases[a.case](a)
    print(f"{a.case}: ok")
