#!/usr/bin/env python3
"""torch_train_step.py: samples/s of full PyTorch training steps, the counterpart of
bench_train_step. Same models as Strata's zoo (mlp 784-1024-1024-10, cnn), same batch, random
in-memory data, SGD(momentum=0.9), one thread, same warm-up and timing (median of several timed
windows). --profile prints torch.profiler's per-op table for comparison with Strata's breakdown.

  python3 bench/torch_train_step.py --model mlp --batch 128 --warmup 20 --steps 20 --windows 7
"""
import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def build(name, hidden):
    if name == "mlp":
        layers, width = [nn.Flatten()], 784
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 10))
        return nn.Sequential(*layers)
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))
    raise SystemExit(f"--model must be mlp or cnn, found {name!r}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mlp")
    p.add_argument("--hidden", default="1024,1024")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--windows", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-steps", type=int, default=20)
    a = p.parse_args()

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model = build(a.model, [int(h) for h in a.hidden.split(",") if h])
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    x = torch.rand(a.batch, 1, 28, 28)
    y = torch.randint(0, 10, (a.batch,))

    def step():
        # Strata zeroes its flat gradient buffer; set_to_none is torch's cheapest equivalent
        # (and the default from torch 2.0).
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    nparams = sum(t.numel() for t in model.parameters())
    print(f"torch {torch.__version__} train_step: model {a.model}, batch {a.batch}, "
          f"threads {torch.get_num_threads()}, {nparams} trainable parameters")
    first = last = None
    for s in range(a.warmup):
        l = step()
        if s == 0:
            first = l.item()
    rates = []
    for _ in range(a.windows):
        t0 = time.perf_counter()
        for _ in range(a.steps):
            l = step()
        rates.append(a.steps * a.batch / (time.perf_counter() - t0))
    last = l.item()
    med = statistics.median(rates)
    print("windows (samples/s): " + " ".join(f"{r:.1f}" for r in rates))
    print(f"loss: first {first:.4f}, last {last:.4f}")
    print(f"median {med:.1f} samples/s, {1e3 * a.batch / med:.3f} ms/step")
    print(f"RESULT impl=torch model={a.model} batch={a.batch} threads={a.threads} "
          f"samples_per_s={med:.2f} version={torch.__version__}")

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
