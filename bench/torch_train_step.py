#!/usr/bin/env python3
"""torch_train_step.py: samples/s of full PyTorch training steps, the counterpart of
bench_train_step. Same models as Strata's zoo (mlp 784-1024-1024-10, cnn), same batch, random
in-memory data, SGD(momentum=0.9), one thread, same warm-up and timing (median of several timed
windows). --profile prints torch.profiler's per-op table for comparison with Strata's breakdown.
--device cuda runs on the GPU (--dtype bf16: autocast), the counterpart of `train --device cuda`.

  python3 bench/torch_train_step.py --model mlp --batch 128 --warmup 20 --steps 20 --windows 7
  python3 bench/torch_train_step.py --model cnn --batch 256 --device cuda --dtype bf16
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # torch_models.py, from any cwd
import torch_models  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    torch_models.add_common_args(p)
    torch_models.add_device_args(p)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-steps", type=int, default=20)
    a = p.parse_args()

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    device = torch_models.setup_device(a)
    model = torch_models.build_from_args(a).to(device)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    x, y = torch_models.random_batch(a.batch)
    x, y = x.to(device), y.to(device)
    step = torch_models.make_step(model, opt, x, y, lambda: torch_models.autocast(a))

    nparams = sum(t.numel() for t in model.parameters())
    where = f"device {torch.cuda.get_device_name(device)}, dtype {a.dtype}" if device.type == "cuda" else \
        f"threads {torch.get_num_threads()}"
    print(f"torch {torch.__version__} train_step: model {a.model}, batch {a.batch}, "
          f"{where}, {nparams} trainable parameters")
    first = torch_models.warm_up(step, a.warmup)
    times, last = torch_models.timed_windows(step, a.windows, a.steps, sync=torch_models.synchronizer(device))
    rates = [a.steps * a.batch / t for t in times]
    med = statistics.median(rates)
    print("windows (samples/s): " + " ".join(f"{r:.1f}" for r in rates))
    print(f"loss: first {first:.4f}, last {last:.4f}")
    print(f"median {med:.1f} samples/s, {1e3 * a.batch / med:.3f} ms/step")
    print(f"RESULT impl=torch model={a.model} batch={a.batch} threads={a.threads} "
          f"device={a.device} dtype={a.dtype} samples_per_s={med:.2f} version={torch.__version__}")

    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        # Grouped by input shape, so conv1/conv2 and pool1/pool2 get separate rows.
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(a.profile_steps):
                step()
        print(f"\nper-op breakdown ({a.profile_steps} profiled steps; divide totals by that for per-step)")
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=30,
                                                                  max_name_column_width=40,
                                                                  max_shapes_column_width=60))


if __name__ == "__main__":
    main()
