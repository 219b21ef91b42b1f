"""Elastic jobs (issue #37 item 1; docs/slurm.md, "Elastic jobs"): with STRATA_ELASTIC, the job
runner jobs/lib/run.sh continues a job that lost a node on the nodes left, from the newest
checkpoint, in a layout re-planned for the smaller world (--layout auto, --resume auto).

Without Slurm (CI): jobs/fashion-mnist.sbatch run by bash with STRATA_LAUNCHER=mpirun,
STRATA_NTASKS=4 and STRATA_RANKS_PER_NODE=2 (two simulated nodes of 2 ranks, sim0 and sim1)
trains the tiny GPT with SGD; once the first checkpoint exists, node sim1's two ranks are killed
(SIGKILL: mpirun names a dead rank) or stopped (SIGSTOP: the watchdog names them). The launch
ends within --timeout + 10 s, the runner names the lost node, launches train again on the 2 ranks
left and the job finishes; its final /model tensors equal an uninterrupted 4-rank job's within
1e-5. A fixed layout in an elastic job's arguments is refused (one line, exit 2).

The cluster path, against a mocked Slurm (elastic_cluster_mock): the nodes from Slurm, the node a
launcher or watchdog line names, a node that does not answer the probe step, the relaunch's
srun --nodelist / mpirun --host."""
import os
import re
import signal
import subprocess
import time

from cases_gpt import SGD, UNTIED, assert_close, tokenize
from cases_tensor_parallel import GPT4
from cases_watchdog import rank_pids
from harness import MPI_ENV, read_model

SOURCE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = 5  # --timeout of the runs: a stopped node's ranks are named by the watchdog after it
STEPS = 100


def job_dir(args, name):
    """A fresh directory to run a job script from: jobs/ and build/ link to the source's and the build's."""
    path = os.path.join(args.workdir, name)
    subprocess.run(["rm", "-rf", path], check=True)
    os.makedirs(path)
    os.symlink(os.path.join(SOURCE, "jobs"), os.path.join(path, "jobs"))
    os.symlink(os.path.dirname(os.path.abspath(args.train)), os.path.join(path, "build"))
    return path


def job_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # not a Slurm job, even inside one
    env.update(MPI_ENV, STRATA_LAUNCHER="mpirun", STRATA_NTASKS="4", STRATA_RANKS_PER_NODE="2")
    env.update(extra)
    return env


def final_model(directory):
    return read_model(os.path.join(directory, "runs", "strata-local", "checkpoints", f"step-{STEPS:08d}.h5"))


def lose_node(args, flags, sig):
    """Runs the elastic job, sends `sig` to node sim1's ranks (2 and 3) once the step-20
    checkpoint is saved; returns (its output with each line's time after the signal, the
    directory) after asserting the story."""
    directory = job_dir(args, f"elastic-{sig.name.lower()}")
    # --bench-stage-ms only sleeps (the same result): the run lasts past the signal.
    cmd = ["bash", "jobs/fashion-mnist.sbatch"] + flags + ["--bench-stage-ms", "5"]
    p = subprocess.Popen(cmd, cwd=directory, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=job_env(STRATA_ELASTIC="1"))
    lines, pids, signalled = [], {}, None
    try:
        pids = rank_pids(p.pid, 4)
        for line in p.stdout:
            lines.append((time.monotonic() - signalled if signalled else None, line))
            if signalled is None and re.match(r"saved checkpoint \S+/step-00000020\.h5", line):
                for rank in (2, 3):
                    os.kill(pids[rank], sig)
                signalled = time.monotonic()
        p.wait(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for pid in pids.values():  # a stopped rank left behind would hold its cores
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    out = "".join(line for _, line in lines)
    assert p.returncode == 0, f"rc={p.returncode}\n{out}"
    assert signalled, f"the run ended before its step-20 checkpoint\n{out}"

    def at(pattern):
        found = [t for t, line in lines if t is not None and re.match(pattern, line)]
        assert found, f"no line {pattern!r} after the signal\n{out}"
        return found[0]
    ended = at(r"strata: train exited \d+ ")
    code = int(re.search(r"^strata: train exited (\d+) ", out, re.M)[1])
    assert code not in (0, 2, 3, 4), out
    assert ended <= TIMEOUT + 10, f"the launch ended {ended:.1f} s after the {sig.name}, over --timeout + 10 s\n{out}"
    lost = re.findall(r"^strata: lost node (.*)$", out, re.M)
    assert len(lost) == 1, out
    m = re.fullmatch(r"sim1 \(ranks 2-3\): continuing on 1 node\(s\), 2 rank\(s\) from step (\d+)", lost[0])
    assert m, lost[0]
    step = int(m[1])
    assert 20 <= step < STEPS and f"resuming from runs/strata-local/checkpoints/step-{step:08d}.h5 at step {step}" \
        in out, out
    choices = re.findall(r"^--layout auto: .* layouts of (\d+) ranks that fit", out, re.M)
    assert choices == ["4", "2"], f"expected a layout for 4 ranks, then for 2: {choices}\n{out}"
    if sig == signal.SIGSTOP:
        watchdog = [l for l in out.splitlines() if "] watchdog: " in l]
        assert watchdog and re.search(r"ranks [23]\b", watchdog[0]), f"the watchdog did not name a rank of sim1\n{out}"
    assert out.rstrip().endswith("strata: finished"), out
    relaunched = at(r"strata: lost node ")
    resumed = at(r"resuming from ")
    print(f"{sig.name} of sim1's ranks at step 20: launch ended after {ended:.1f} s (exit {code}), relaunch named "
          f"{relaunched - ended:.2f} s later, resumed on 2 ranks from step {step} {resumed:.1f} s after the signal")
    return directory


def case_elastic_lost_node(args):
    data = tokenize(args, "byte")
    flags = GPT4 + SGD + UNTIED + ["--data", data[0], "--val-data", data[1], "--global-batch", "16", "--seed", "3",
                                   "--log-every", "10", "--bucket-mb", "0.01", "--steps", str(STEPS), "--save-every",
                                   "20", "--timeout", str(TIMEOUT), "--layout", "auto"]
    t0 = time.monotonic()
    reference = job_dir(args, "elastic-reference")
    p = subprocess.run(["bash", "jobs/fashion-mnist.sbatch"] + flags, cwd=reference, capture_output=True, text=True,
                       env=job_env(), timeout=300)
    assert p.returncode == 0 and p.stdout.rstrip().endswith("strata: finished"), f"{p.stdout}\n{p.stderr}"
    want = final_model(reference)
    print(f"uninterrupted 4-rank job: {time.monotonic() - t0:.1f} s")
    for sig in (signal.SIGKILL, signal.SIGSTOP):
        t0 = time.monotonic()
        got = final_model(lose_node(args, flags, sig))
        assert_close(got, want, f"{sig.name} of a node, continued on the other vs uninterrupted")
        print(f"{sig.name}: the whole job took {time.monotonic() - t0:.1f} s")

    # A fixed layout cannot follow the world down: refused before anything starts.
    for bad, flag in ((["--tp", "2"], "--tp"), (["--micro-batch=4"], "--micro-batch")):
        p = subprocess.run(["bash", "jobs/fashion-mnist.sbatch"] + flags + bad, cwd=reference, capture_output=True,
                           text=True, env=job_env(STRATA_ELASTIC="1"), timeout=60)
        assert p.returncode == 2 and not p.stdout and p.stderr.strip().count("\n") == 0, p
        assert re.fullmatch(rf"strata: STRATA_ELASTIC: .*--layout auto\): leave out {flag}", p.stderr.strip()), p.stderr


MOCK = r"""set -uo pipefail
source jobs/lib/run.sh
export SLURM_JOB_ID=99 SLURM_JOB_NODELIST="n[1-3]" SLURM_TASKS_PER_NODE="2(x3)" SLURM_NTASKS=6 STRATA_ELASTIC=2
scontrol() {  # the job's nodes: n1-n3 at submission, $MOCK_NODELIST now
  case "$1 $2" in
    "show hostnames") case "$3" in "n[1-3]") printf 'n1\nn2\nn3\n' ;; *) tr ',' '\n' <<<"$3" ;; esac ;;
    "show job") echo "JobId=99 ReqNodeList=(null) NodeList=$MOCK_NODELIST BatchHost=n1" ;;
  esac
}
sinfo() { [[ " $MOCK_DOWN " == *" $4 "* ]] && echo 'down*' || echo alloc; }
srun() { echo "launch: srun $*" | sed 's| ./build/train.*||' >&2; mock_launch; }
mpirun() { echo "launch: mpirun $*" | sed 's| ./build/train.*||' >&2; mock_launch; }
mock_launch() {  # the first launch writes $MOCK_STDERR and exits $MOCK_RC, the next ones finish
  if [ ! -e launched ]; then touch launched; printf '%b' "$MOCK_STDERR" >&2; return "$MOCK_RC"; fi
  return 0
}
strata_args --steps 10
strata_run ./build/train
"""


def case_elastic_cluster_mock(args):
    """jobs/lib/run.sh's cluster path (no simulated nodes) with scontrol, sinfo and the launchers as
    shell functions, and srun's probe step (`srun --overlap -N1 -w NODE true`, run by `timeout`) a
    script on PATH that fails on the nodes in MOCK_SILENT: 3 nodes n1-n3 of 2 ranks."""
    directory = job_dir(args, "elastic-mock")
    with open(os.path.join(directory, "mock.sh"), "w") as f:
        f.write(MOCK)
    bin_dir = os.path.join(directory, "bin")
    os.makedirs(bin_dir)
    with open(os.path.join(bin_dir, "srun"), "w") as f:
        f.write('#!/bin/bash\nfor node in $MOCK_SILENT; do [[ "$*" == *"--nodelist=$node "* ]] && exit 1; done\n'
                'exit 0\n')
    os.chmod(os.path.join(bin_dir, "srun"), 0o755)

    def job(launcher, stderr, rc, nodelist="n[1-3]", silent="", down=""):
        checkpoints = os.path.join(directory, "runs", "strata-99", "checkpoints")
        subprocess.run(["rm", "-rf", os.path.join(directory, "runs"), os.path.join(directory, "launched")], check=True)
        os.makedirs(checkpoints)
        with open(os.path.join(checkpoints, "latest"), "w") as f:
            f.write("step-00000040.h5\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "STRATA_"))}
        env.update(PATH=bin_dir + ":" + os.environ["PATH"], STRATA_LAUNCHER=launcher, MOCK_STDERR=stderr,
                   MOCK_RC=str(rc), MOCK_NODELIST=nodelist, MOCK_SILENT=silent, MOCK_DOWN=down)
        p = subprocess.run(["bash", "mock.sh"], cwd=directory, capture_output=True, text=True, env=env, timeout=120)
        return p.returncode, p.stdout + p.stderr

    # mpirun names a killed rank of n2; n3 does not run the probe step: both lost, continued on n1.
    rc, out = job("mpirun", "mpirun noticed that process rank 3 with PID 0 on node n2 exited on signal 9 (Killed).\n",
                  137, silent="n3")
    assert rc == 0, out
    launches = re.findall(r"^launch: (.*)$", out, re.M)
    assert launches[0] == "mpirun --map-by slot:PE=1 --bind-to core", out  # no --quiet: its line names the rank
    assert launches[1] == "mpirun --map-by slot:PE=1 --bind-to core -np 2 --host n1:2", out
    assert "strata: lost nodes n2 (ranks 2-3), n3 (ranks 4-5): continuing on 1 node(s), 2 rank(s) from step 40\n" \
        in out, out
    # srun: the tasks killed before it aborted the step count, not those it killed itself; n1 no
    # longer in the job's NodeList (Slurm took it out, --no-kill) is lost too.
    rc, out = job("srun", "srun: error: n3: tasks 4-5: Killed\nsrun: Job step aborted: Waiting up to 32 seconds\n"
                  "srun: error: n1: tasks 0-1: Killed\nsrun: error: n2: tasks 2-3: Killed\n", 137, nodelist="n2,n3")
    assert rc == 0, out
    launches = re.findall(r"^launch: (.*)$", out, re.M)
    assert launches == ["srun --mpi=pmix --cpu-bind=cores",
                        "srun --mpi=pmix --cpu-bind=cores --ntasks=2 --nodes=1 --nodelist=n2"], out
    assert "strata: lost nodes n1 (ranks 0-1), n3 (ranks 4-5): continuing on 1 node(s), 2 rank(s) from step 40" in out
    # The watchdog names the ranks of n2 by host; a down node (sinfo) is lost too.
    watchdog = ("[rank 0] watchdog: #5 all_reduce sum of 4 B f32 on world (collective 3 there, step 41) not complete "
                "after 5.0 s (--timeout 5); every peer on this node is alive (waiting elsewhere); ranks 2, 3 (n2), "
                "4, 5 (n3): unknown (not on this node); aborting the job\n")
    rc, out = job("srun", watchdog, 5, down="n3")
    assert rc == 0 and "strata: lost node n3 (ranks 4-5): continuing on 2 node(s), 4 rank(s) from step 40" in out, out
    assert re.findall(r"^launch: (.*)$", out, re.M)[1].endswith("--ntasks=4 --nodes=2 --nodelist=n1,n2"), out
    # Ranks of two nodes unknown and every node answering: no node can be named, the job ends.
    rc, out = job("srun", watchdog, 5)
    assert rc == 5 and "strata: elastic: no lost node found (train exited 5): not continuing" in out, out
    assert len(re.findall(r"^launch: ", out, re.M)) == 1, out
    # An exit that is not a loss (1: a rank's error) with nothing named: not continued either.
    rc, out = job("mpirun", "error on rank 1: something\n", 1)
    assert rc == 1 and "not continuing" in out and len(re.findall(r"^launch: ", out, re.M)) == 1, out
    print("mocked Slurm: mpirun and srun lines, Slurm's NodeList, sinfo and the probe name the lost nodes; "
          "the relaunch's --host / --nodelist hold the nodes left")
