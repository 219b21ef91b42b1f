"""torch_models.py: what torch_train_step.py and torch_ddp_step.py share: Strata's zoo models as
torch.nn.Sequential (mlp 784-hidden-10, cnn), the common flags, the fixed random batch, the
training step (SGD momentum 0.9, F.cross_entropy, zero_grad(set_to_none=True)) and the timing
loop (untimed warm-up, then timed windows; the caller takes the median).
"""
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


def build_from_args(a):
    return build(a.model, [int(h) for h in a.hidden.split(",") if h])


def add_common_args(p, batch_help=None, threads_help=None):
    """The flags of both scripts, with the defaults of the C++ benchmarks."""
    p.add_argument("--model", default="mlp")
    p.add_argument("--hidden", default="1024,1024")
    p.add_argument("--batch", type=int, default=128, help=batch_help)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--windows", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help=threads_help)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=1)


def random_batch(batch, generator=None):
    """x uniform in [0, 1) of shape (batch, 1, 28, 28), y labels in 0..9."""
    x = torch.rand(batch, 1, 28, 28, generator=generator)
    y = torch.randint(0, 10, (batch,), generator=generator)
    return x, y


def make_step(model, opt, x, y):
    def step():
        # Strata zeroes its flat gradient buffer; set_to_none is torch's cheapest equivalent
        # (and the default from torch 2.0).
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()  # DDP: bucketed all-reduce overlapped with backward, waited for at its end
        opt.step()
        return loss

    return step


def warm_up(step, n):
    """Runs n untimed steps; returns the first one's loss (None when n is 0)."""
    first = None
    for s in range(n):
        l = step()
        if s == 0:
            first = l.item()
    return first


def timed_windows(step, windows, steps, before=None, elapsed=lambda t: t):
    """Times `windows` windows of `steps` steps each; returns (seconds per window, last loss).
    before() runs ahead of each window (a barrier); elapsed(t) maps a window's time (max over ranks)."""
    times, l = [], None
    for _ in range(windows):
        if before is not None:
            before()
        t0 = time.perf_counter()
        for _ in range(steps):
            l = step()
        times.append(elapsed(time.perf_counter() - t0))
    return times, l.item()
