"""Training quality: the main job's Fashion-MNIST configurations reach the promised accuracy,
and mixed precision (bf16/fp16 with f32 master weights and loss scaling)."""
import os
import re

import h5py
import numpy as np

from harness import write_dataset, run, train_ranks, assert_same_model, equivalence_runs, RESUME_MLP, resumed_run


def fashion_mnist(args):
    """Converts the Debian package's Fashion-MNIST once into the work tree (as the main job does)."""
    out = os.path.join(os.path.dirname(args.workdir), "fashion-mnist")
    idx = "/usr/share/datasets/fashion-mnist"
    if not os.path.exists(os.path.join(out, "test.h5")):
        os.makedirs(os.path.join(out, "train"), exist_ok=True)
        for split, prefix, extra in (("train", "train/train", ["--shards", "4"]),
                                     ("t10k", "test", ["--stats-from", os.path.join(out, "train")])):
            rc, o, e = run(args, [args.data_tool, "convert-idx", "--images", f"{idx}/{split}-images-idx3-ubyte.gz",
                                  "--labels", f"{idx}/{split}-labels-idx1-ubyte.gz", "--out",
                                  os.path.join(out, prefix)] + extra)
            assert rc == 0, e
    return os.path.join(out, "train"), os.path.join(out, "test.h5")


def train_fashion_mnist(args, config, minimum, flags=()):
    """The main job's configuration on 2 ranks must reach `minimum` percent test accuracy;
    returns the accuracy."""
    train, test = fashion_mnist(args)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    name = "-".join(("ck",) + tuple(flags)).replace("-", "")
    rc, out, err = run(args, [args.mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none", args.train, "--config",
                              os.path.join(repo, "jobs", "configs", config), "--data", train, "--val-data", test,
                              "--checkpoint-dir", os.path.join(args.workdir, name), "--metrics",
                              os.path.join(args.workdir, name + "-metrics.jsonl")] + list(flags), timeout=1500)
    assert rc == 0, f"rc={rc}\n{out}\n{err}"
    m = re.search(r"final test: loss ([0-9.]+)\s+accuracy ([0-9.]+)%\s+\(10000 samples\)", out)
    assert m, out
    print(f"{config} {' '.join(flags)}: test accuracy {m.group(2)}% (required >= {minimum}%)")
    assert float(m.group(2)) >= minimum, out
    return float(m.group(2))


def case_fashion_mnist_cnn(args):
    train_fashion_mnist(args, "fashion-mnist.ini", 89.0)


def case_fashion_mnist_mlp(args):
    """The MLP reaches 85% in fp32, and bf16 (bf16 parameters and activations, f32 master
    weights and gradients) reaches the fp32 accuracy within 1 point."""
    fp32 = train_fashion_mnist(args, "fashion-mnist-mlp.ini", 85.0)
    bf16 = train_fashion_mnist(args, "fashion-mnist-mlp.ini", 85.0, ("--precision", "bf16"))
    print(f"bf16 {bf16}% vs fp32 {fp32}%: {bf16 - fp32:+.2f} points (allowed -1)")
    assert bf16 >= fp32 - 1.0, (bf16, fp32)


def read_group(path, group):
    with h5py.File(path, "r") as f:
        tensors = {}
        f[group].visititems(lambda name, obj: tensors.update({name: obj[...]}) if isinstance(obj, h5py.Dataset) else None)
        return tensors, dict(f.attrs)


def case_mixed_precision(args):
    """--precision bf16/fp16 with f32 master weights and loss scaling, checked through h5py:
    - a forced overflow (--debug-overflow-step) skips exactly that step: the model and the
      master weights after it equal those before it, the optimizer step count stays, and the
      dynamic loss scale is halved; without overflow it doubles every --loss-scale-window steps;
    - checkpoints hold f32 tensors: /model is the bf16-rounded master (exactly representable in
      bf16), /optimizer/master the full-precision weights;
    - ZeRO 1, 2, 3 == ZeRO 0 under bf16 (dp = 2; master shards, bf16 all-gathers and windows);
    - fp16 with dynamic loss scaling: save, kill, --resume == uninterrupted, bit for bit (the
      loss scale and its counter are part of the checkpoint)."""
    data = write_dataset(os.path.join(args.workdir, "mp.h5"), n=2048, shape=(1, 8, 8), classes=4, seed=7)
    common = ["--model", "mlp", "--hidden", "64,32", "--data", data, "--global-batch", "32", "--lr", "0.05",
              "--seed", "3", "--log-every", "1"]
    fp16 = ["--precision", "fp16", "--loss-scale-init", "1024", "--loss-scale-window", "3"]
    runs = {}
    for steps, extra in ((6, []), (7, ["--debug-overflow-step", "7"])):
        ck = os.path.join(args.workdir, f"ck-mp-{steps}")
        cmd = [args.mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none", args.train] + common + fp16 + [
            "--steps", str(steps), "--checkpoint-dir", ck] + extra
        rc, out, err = run(args, cmd)
        assert rc == 0, f"rc={rc}\n{out}\n{err}"
        out += err  # warnings go to stderr
        runs[steps] = (read_group(os.path.join(ck, f"step-{steps:08d}.h5"), "model"),
                       read_group(os.path.join(ck, f"step-{steps:08d}.h5"), "optimizer/master")[0], out)
    (model6, attrs6), master6, _ = runs[6]
    (model7, attrs7), master7, out7 = runs[7]
    assert "step 7: gradients overflowed at loss scale 4096; step skipped, loss scale now 2048" in out7, out7
    assert attrs6["loss_scale"] == 4096.0 and attrs6["loss_scale_good_steps"] == 0, attrs6  # 1024 x 2 x 2
    assert attrs7["loss_scale"] == 2048.0 and attrs7["loss_scale_good_steps"] == 0, attrs7
    assert attrs6["optimizer_step"] == 6 and attrs7["optimizer_step"] == 6 and attrs7["step"] == 7
    assert_same_model(model7, model6, "fp16 model after the skipped step 7 vs after step 6", rtol=0.0)
    assert_same_model(master7, master6, "fp16 master weights after the skipped step vs after step 6", rtol=0.0)

    # bf16 checkpoints: f32 datasets; the model is the master rounded to bf16.
    ck = os.path.join(args.workdir, "ck-mp-bf16")
    train_ranks(args, 2, common + ["--precision", "bf16", "--steps", "5", "--checkpoint-dir", ck])
    with h5py.File(os.path.join(ck, "step-00000005.h5"), "r") as f:
        assert f.attrs["precision"] == "bf16"
        for name in ("fc1/weight", "fc3/bias"):
            model, master = f["model/" + name][...], f["optimizer/master/" + name][...]
            assert model.dtype == np.float32 and master.dtype == np.float32
            assert not (model.view(np.uint32) & 0xFFFF).any(), f"{name}: /model is not bf16-representable"
            bits = master.view(np.uint32).astype(np.uint64)  # round to nearest even, as our bf16 does
            rounded = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
            assert np.array_equal(model, rounded), f"{name}: /model != bf16(master)"
            assert (master.view(np.uint32) & 0xFFFF).any(), f"{name}: master weights lost their low bits"

    # ZeRO under bf16 == replicated, and fp16 resume == uninterrupted.
    layouts = {z: (2, 16, ("--precision", "bf16", "--optimizer", "adamw", "--zero", z)) for z in "0123"}
    runs = equivalence_runs(args, ["--model", "mlp", "--hidden", "64,32"], list(layouts.values()), steps=20)
    for z in "123":
        assert_same_model(runs[layouts[z]], runs[layouts["0"]], f"bf16 zero {z} vs zero 0, 2 ranks", rtol=0.0)
    fp16_resume = ["--precision", "fp16", "--loss-scale-init", "256", "--loss-scale-window", "7"]
    reference = equivalence_runs(args, RESUME_MLP + fp16_resume, [(1, 32)], steps=30)[(1, 32)]
    model, _ = resumed_run(args, RESUME_MLP, (1, tuple(fp16_resume)), (1, tuple(fp16_resume)), ("--optimizer", "sgd"),
                           steps=30, split=10)
    assert_same_model(model, reference, "fp16 resumed at step 10 vs uninterrupted", rtol=0.0)
    # An fp32 checkpoint resumed as fp16: the scale starts at --loss-scale-init, not at fp32's 1.
    ck32 = os.path.join(args.workdir, "ck-mp-fp32")
    train_ranks(args, 1, common + ["--steps", "2", "--checkpoint-dir", ck32])
    train_ranks(args, 1, common + ["--precision", "fp16", "--loss-scale-init", "1024", "--steps", "3",
                                   "--checkpoint-dir", ck32, "--resume", "auto"])
    with h5py.File(os.path.join(ck32, "step-00000003.h5"), "r") as f:
        assert f.attrs["loss_scale"] == 1024.0 and f.attrs["precision"] == "fp16", dict(f.attrs)
