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
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # torch_models.py, from any cwd
import torch_models  # noqa: E402


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
    model = torch_models.build_from_args(a)
    model.train()
    if distributed:
        model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    x, y = torch_models.random_batch(a.batch, torch.Generator().manual_seed(a.seed + 1000 * rank))
    step = torch_models.make_step(model, opt, x, y)

    t_max = torch.zeros(1, dtype=torch.float64)

    def slowest_rank(t):  # a step is done when the slowest rank is
        if not distributed:
            return t
        t_max[0] = t
        dist.all_reduce(t_max, op=dist.ReduceOp.MAX)
        return t_max.item()

    first = torch_models.warm_up(step, a.warmup)
    times, last = torch_models.timed_windows(step, a.windows, a.steps, before=dist.barrier if distributed else None,
                                             elapsed=slowest_rank)
    rates = [a.steps * a.batch * a.nproc / t for t in times]
    step_ms = [1e3 * t / a.steps for t in times]
    if rank == 0:
        queue.put((rates, step_ms, first, last))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    torch_models.add_common_args(p, batch_help="per process", threads_help="torch threads per process")
    p.add_argument("--nproc", type=int, default=2, help="processes; 1 = no DDP, plain training step")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
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
