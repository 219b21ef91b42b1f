"""The watchdog (docs/reliability.md, "Deadlines and the watchdog"): a stopped rank ends the job
within --timeout + 10 s with the rank and the operation named; ranks whose collectives differ
are reported (first differing collective, both sides), not left to hang. A slow rank is named
(stragglers)."""
import json
import os
import re
import signal
import subprocess
import time

from harness import MPI_ENV, write_dataset

TIMEOUT = 5  # --timeout of these runs, seconds


def children_of(pid):
    """Every descendant of `pid` (the train processes under mpirun), from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                pass
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, parent in parents.items() if parent == p]
        found += kids
        frontier += kids
    return found


def rank_pids(mpirun_pid, ranks, deadline_s=60):
    """World rank -> pid, from the OMPI_COMM_WORLD_RANK of each train process once all run."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        pids = {}
        for pid in children_of(mpirun_pid):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() != "train":
                        continue
            except OSError:
                continue
            if b"OMPI_COMM_WORLD_RANK" in env:
                pids[int(env[b"OMPI_COMM_WORLD_RANK"])] = pid
        if len(pids) == ranks:
            return pids
        time.sleep(0.2)
    raise AssertionError(f"did not find {ranks} train processes")


def stop_one_rank(args, data, ranks, layout, stopped):
    """Starts a long run, SIGSTOPs rank `stopped` once it trains, asserts that every rank is
    gone within --timeout + 10 s, non-zero, with a line naming the stopped rank and an operation."""
    cmd = [args.mpirun, "-np", str(ranks), "--oversubscribe", "--bind-to", "none", args.train, "--model", "mlp",
           "--hidden", "64", "--data", data, "--steps", "1000000", "--global-batch", "16", "--log-every", "1",
           "--timeout", str(TIMEOUT)] + layout
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, **MPI_ENV))
    try:
        pids = rank_pids(p.pid, ranks)
        # Training, not setup: wait for the first step lines.
        for line in p.stdout:
            if re.match(r"step 3/", line):
                break
        os.kill(pids[stopped], signal.SIGSTOP)
        start = time.monotonic()
        out, err = p.communicate(timeout=TIMEOUT + 10 + 20)
        elapsed = time.monotonic() - start
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode != 0, f"exit code 0 with rank {stopped} stopped\n{err}"
    assert elapsed < TIMEOUT + 10, f"took {elapsed:.1f} s after SIGSTOP to end the job\n{err}"
    ours = [l for l in err.splitlines() if "watchdog:" in l]
    assert ours, f"no watchdog line\n{err}"
    line = ours[0]
    # The first rank to notice waits for the stopped one or for a peer that waits for it (pp); a
    # peer blocked on the stopped rank shows no sign of life either and may be listed before it.
    assert re.search(f"waiting (in turn )?for (rank \\d+ \\([^)]*\\), )*rank {stopped} \\(no sign of life", line), \
        f"the stopped rank {stopped} is not named: {line}"
    assert re.search(r"#\d+ (all_reduce|all_gather|reduce|broadcast|send|recv|barrier|reduce_scatter)", line), line
    assert "flight recorder:" in err and "NOT completed" in err, f"no flight recorder dump\n{err}"
    print(f"{ranks} ranks {' '.join(layout) or 'dp'}: rank {stopped} stopped, job ended {elapsed:.1f} s later, "
          f"exit {p.returncode}: {line}")


def case_watchdog_stopped_rank(args):
    data = write_dataset(os.path.join(args.workdir, "watchdog.h5"), n=4096, seed=5)
    stop_one_rank(args, data, 2, [], 1)
    stop_one_rank(args, data, 2, [], 0)


def case_watchdog_stopped_rank_4(args):
    data = write_dataset(os.path.join(args.workdir, "watchdog4.h5"), n=4096, seed=5)
    stop_one_rank(args, data, 4, ["--pp", "2"], 3)
    stop_one_rank(args, data, 4, ["--zero", "3"], 2)


def case_watchdog_fingerprint(args):
    """One rank issues an average where the others sum: rank 0 names the first differing
    collective and both sides' operations; every rank exits non-zero within seconds."""
    data = write_dataset(os.path.join(args.workdir, "fingerprint.h5"), n=4096, seed=5)
    cmd = [args.mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none", args.train, "--model", "mlp", "--hidden",
           "64", "--data", data, "--steps", "1000", "--global-batch", "16", "--debug-mismatch-step", "7",
           "--debug-fail-rank", "1", "--timeout", str(TIMEOUT)]
    start = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **MPI_ENV), timeout=60)
    elapsed = time.monotonic() - start
    assert p.returncode != 0, f"exit code 0 with differing collectives\n{p.stderr}"
    ours = [l for l in p.stderr.splitlines() if "disagree about their collectives" in l]
    assert len(ours) == 1, p.stderr
    m = re.search(r"collective (\d+) on world differs: rank (\d) (#\d+ all_reduce (sum|avg) of 16 B f32 on world[^;]*); "
                  r"rank (\d) (#\d+ all_reduce (sum|avg) of 16 B f32 on world.*?\)); aborting", ours[0])
    assert m, ours[0]
    assert {m.group(4), m.group(7)} == {"sum", "avg"}, ours[0]
    assert {m.group(2), m.group(5)} == {"0", "1"}, ours[0]
    assert "step 7" in ours[0], ours[0]
    assert "watchdog:" not in p.stderr.replace(ours[0], ""), f"a deadline passed as well\n{p.stderr}"
    print(f"reported in {elapsed:.1f} s, exit {p.returncode}: {ours[0]}")


def case_watchdog_setup_deadline(args):
    """Setup's blocking MPI calls have a deadline too (--setup-timeout): one rank that stays in
    setup (--debug-setup-sleep, as a stopped or much slower rank would) ends the job with exit 5
    within --setup-timeout + 10 s on 2 and 4 ranks, each stuck rank saying so in one line."""
    data = write_dataset(os.path.join(args.workdir, "setup-deadline.h5"), n=256, shape=(1, 8, 8), classes=4)
    for ranks in (2, 4):
        cmd = [args.mpirun, "-np", str(ranks), "--oversubscribe", "--quiet", args.train, "--data", data, "--model",
               "mlp", "--hidden", "16", "--steps", "5", "--global-batch", "32", "--setup-timeout", "3",
               "--debug-fail-rank", str(ranks - 1), "--debug-setup-sleep", "120"]
        t0 = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **MPI_ENV), timeout=60)
        took = time.monotonic() - t0
        assert p.returncode == 5, f"rc={p.returncode}\n{p.stdout}\n{p.stderr}"
        assert took < 3 + 10, f"the job took {took:.1f} s to end"
        lines = [l for l in p.stderr.splitlines() if l.startswith("error")]
        assert lines and all(re.fullmatch(r"error on rank \d: setup did not finish within 3 s \(--setup-timeout\): .*"
                                          r"exiting \(code 5\)", l) for l in lines), p.stderr
        assert f"error on rank {ranks - 1}:" in p.stderr, p.stderr  # the sleeping rank itself
        for bad in ("Traceback", "core dumped", "Segmentation", "terminate called"):
            assert bad not in p.stdout + p.stderr, p.stderr
        print(f"{ranks} ranks: exit 5 after {took:.1f} s; {len(lines)} rank(s) reported")


def straggler_lines(out):
    """(step, rank, host, percent, cause) of the progress lines that name a slow rank."""
    return [(int(m[0]), int(m[1]), m[2], int(m[3]), m[4]) for m in
            re.findall(r"^step (\d+)/\d+ .*  slow: rank (\d+) \((\S+)\) \+(\d+)% (compute|data)$", out, re.M)]


def case_stragglers(args):
    """A rank slower than the others of its stage is named on the progress line and in --metrics
    once it is the straggler of two windows running: rank 1 of dp 4 sleeping 20 ms per step
    (--debug-slow-ms); rank 3 of pp 2 x dp 2 likewise, compared with its stage's other rank only;
    rank 1 of dp 2 stopped and continued in bursts from outside (SIGSTOP 40 ms of every 80 ms), as
    a throttled or shared core would, on steps of mostly compute; a run without a slow rank names
    none."""
    data = write_dataset(os.path.join(args.workdir, "straggler.h5"), 1024, (1, 28, 28), 10, seed=5)
    env = dict(os.environ, **MPI_ENV)

    def train(name, ranks, flags, bursts_of=None, log_every=5):
        metrics = os.path.join(args.workdir, f"straggler-{name}.jsonl")
        if os.path.exists(metrics):
            os.remove(metrics)
        cmd = [args.mpirun, "-np", str(ranks), "--oversubscribe", "--bind-to", "none", args.train, "--model", "mlp",
               "--data", data, "--log-every", str(log_every), "--threads", "1", "--metrics", metrics, *flags]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            if bursts_of is not None:
                pid = rank_pids(p.pid, ranks)[bursts_of]
                while p.poll() is None:  # 40 ms stopped of every 80 ms until the run ends
                    try:
                        os.kill(pid, signal.SIGSTOP)
                        time.sleep(0.04)
                        os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:
                        break
                    time.sleep(0.04)
            out, err = p.communicate(timeout=300)
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
        assert p.returncode == 0, f"{' '.join(cmd)}\n{out}\n{err}"
        records = [json.loads(l) for l in open(metrics) if '"eval"' not in l]
        named = straggler_lines(out)
        flagged = [r["straggler"] for r in records if r["straggler"]]
        assert [(n[1], n[2], n[4]) for n in named] == [(f["rank"], f["host"], f["cause"]) for f in flagged], (out, records)
        print(f"{name}: named on {len(named)} of {len(records)} progress lines{f', e.g. {named[-1]}' if named else ''}")
        return named

    small = ["--hidden", "256", "--global-batch", "64", "--steps", "40"]
    slow = ["--debug-fail-rank", "1", "--debug-slow-ms", "20"]
    named = train("dp 4, rank 1 sleeping 20 ms a step", 4, small + slow)
    assert named and all(n[1] == 1 and n[4] == "compute" and n[3] >= 50 for n in named), named
    assert named[0][0] == 10, f"named first at step {named[0][0]}, not after two windows (5 and 10)"

    named = train("pp 2 x dp 2, rank 3 sleeping 20 ms a step", 4, small + ["--pp", "2", "--debug-fail-rank", "3",
                                                                           "--debug-slow-ms", "20"])
    assert named and all(n[1] == 3 for n in named), named

    named = train("dp 2, rank 1 stopped 40 ms of every 80", 2,
                  ["--hidden", "1024,1024", "--global-batch", "256", "--steps", "60"], bursts_of=1)
    assert named and all(n[1] == 1 for n in named), named

    # Two ranks on the two cores, windows of 10 steps: what any machine's jitter stays within.
    assert not train("dp 2 without a slow rank", 2, small, log_every=10)
