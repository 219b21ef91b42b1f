#!/usr/bin/env python3
"""torch_ddp_step.py: global samples/s of PyTorch DistributedDataParallel training steps over
gloo, the counterpart of bench_ddp_step. Same models as Strata's zoo (mlp 784-1024-1024-10,
cnn), same per-rank batch, random in-memory data (different per rank), SGD(momentum=0.9),
F.cross_entropy, zero_grad(set_to_none=True), one thread per process, DDP defaults
(bucket_cap_mb=25, gradient_as_bucket_view=False). Same warm-up and timing as the other
benchmarks: each window is timed on every rank and the slowest rank's time counts; the median
window is reported.

  python3 bench/torch_ddp_step.py --model mlp --batch 128 --nproc 2     # DDP over gloo, 2 processes
  python3 bench/torch_ddp_step.py --model mlp --batch 128 --nproc 1     # one process, no DDP: the baseline

--batch is per process (global batch = batch x nproc). Processes are started with
torch.multiprocessing (spawn); MASTER_ADDR=127.0.0.1 and a free port found at start.
"""
import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
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


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, a, port, queue):
    torch.set_num_threads(a.threads)
    distributed = a.nproc > 1
    if distributed:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=a.nproc)
    torch.manual_seed(a.seed)  # same initial parameters everywhere (DDP broadcasts rank 0's anyway)
    model = build(a.model, [int(h) for h in a.hidden.split(",") if h])
    model.train()
    if distributed:
        model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    g = torch.Generator().manual_seed(a.seed + 1000 * rank)
    x = torch.rand(a.batch, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (a.batch,), generator=g)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()  # DDP: bucketed all-reduce overlapped with backward, waited for at its end
        opt.step()
        return loss

    first = None
    for s in range(a.warmup):
        l = step()
        if s == 0:
            first = l.item()
    rates, step_ms = [], []
    t_max = torch.zeros(1, dtype=torch.float64)
    for _ in range(a.windows):
        if distributed:
            dist.barrier()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            l = step()
        t = time.perf_counter() - t0
        if distributed:
            t_max[0] = t
            dist.all_reduce(t_max, op=dist.ReduceOp.MAX)  # a step is done when the slowest rank is
            t = t_max.item()
        rates.append(a.steps * a.batch * a.nproc / t)
        step_ms.append(1e3 * t / a.steps)
    last = l.item()
    if rank == 0:
        queue.put((rates, step_ms, first, last))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mlp")
    p.add_argument("--hidden", default="1024,1024")
    p.add_argument("--batch", type=int, default=128, help="per process")
    p.add_argument("--nproc", type=int, default=2, help="processes; 1 = no DDP, plain training step")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--windows", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    if a.nproc == 1:
        worker(0, a, 0, queue)
    else:
        mp.spawn(worker, args=(a, free_port(), queue), nprocs=a.nproc, join=True)
    rates, step_ms, first, last = queue.get()
    med = statistics.median(rates)
    mode = f"DDP gloo, {a.nproc} processes" if a.nproc > 1 else "1 process, no DDP"
    print(f"torch {torch.__version__} ddp_step: model {a.model}, {mode} x {a.threads} thread(s), "
          f"batch {a.batch} per process (global {a.batch * a.nproc}), bucket_cap_mb {a.bucket_mb:g}")
    print("windows (global samples/s): " + " ".join(f"{r:.1f}" for r in rates))
    print(f"loss (rank 0): first {first:.4f}, last {last:.4f}")
    print(f"median {med:.1f} samples/s, {statistics.median(step_ms):.3f} ms/step")
    print(f"RESULT impl=torch-ddp model={a.model} ranks={a.nproc} batch={a.batch} threads={a.threads} "
          f"samples_per_s={med:.2f} step_ms={statistics.median(step_ms):.3f} version={torch.__version__}")


if __name__ == "__main__":
    main()
