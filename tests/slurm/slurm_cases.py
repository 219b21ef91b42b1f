"""The job scripts of jobs/ against a real Slurm (issue #20): a single-node slurmctld + slurmd +
munge started by scripts/slurm/start.sh for these tests (`setup`) and stopped by pid (`cleanup`).
Each case submits jobs/fashion-mnist.sbatch with a small MLP on synthetic data in place of the
CNN, from a work directory where `jobs` and `build` link to the source's and the build's.

  setup | cleanup            start / stop the cluster (exit 77, a CTest skip, without Slurm)
  complete_srun_mpirun       the job to completion with each launcher: identical checkpoints
  preempt_requeue            two manual preemptions (scancel --signal=USR1 --batch) -> two
                             requeues -> the same final checkpoint as an uninterrupted job,
                             with the three runs' log lines in one appended log
  time_limit_requeue         the time limit's USR1 (--time=1, --signal=B:USR1@40) twice -> two
                             requeues -> the same final checkpoint (about 80 s)
  cancel                     plain scancel with mpirun and with srun: the job ends, is never
                             requeued, the final save's lines are in the run's train.log and
                             once in the job's log, and `latest` names a complete checkpoint

Requeued jobs wait ~120 s for eligibility (Slurm's BeginTime); 2 s after the requeue the tests
move it to now with `scontrol update StartTime=now`, as an operator can (see requeue_now)."""
import argparse
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np

SKIP = 77
SUBMITTED = []  # (job, env) of this case: cancelled at its end, so a failed case leaves no job behind
SOURCE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(SOURCE, "tests", "integration"))
from harness import all_tensors  # noqa: E402  (the end-to-end cases' checkpoint reader)


def sh(cmd, check=True, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}: rc={p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


def setup(args):
    if not shutil.which("sbatch") or not shutil.which("slurmctld"):
        print("SKIP: Slurm is not installed (scripts/install-deps.sh installs slurm-wlm)")
        return SKIP
    shutil.rmtree(args.cluster, ignore_errors=True)
    p = sh(["bash", os.path.join(SOURCE, "scripts", "slurm", "start.sh"), args.cluster, "-c"], check=False)
    print(p.stdout + p.stderr)
    if "already running" in p.stderr:  # another cluster's daemons would fail every job: say so, not skip
        return 1
    if p.returncode != 0 or "idle" not in p.stdout:
        print("SKIP: Slurm could not be started here")
        return SKIP
    return 0


def cleanup(args):
    sh(["bash", os.path.join(SOURCE, "scripts", "slurm", "stop.sh"), args.cluster], check=False)
    return 0


class Cluster:
    def __init__(self, args, name):
        self.work = os.path.join(args.workdir, name)
        self.cluster = args.cluster
        shutil.rmtree(self.work, ignore_errors=True)
        os.makedirs(self.work)
        os.symlink(os.path.join(SOURCE, "jobs"), os.path.join(self.work, "jobs"))
        os.symlink(args.build, os.path.join(self.work, "build"))
        sh([os.path.join(args.build, "strata-data"), "synthetic", "--out", os.path.join(self.work, "syn"),
            "--samples", "256", "--shape", "1,8,8", "--classes", "4"])
        self.env = dict(os.environ, SLURM_CONF=os.path.join(args.cluster, "slurm.conf"),
                        OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")

    def submit(self, train_args, launcher="srun"):
        env = dict(self.env, STRATA_LAUNCHER=launcher)
        flags = ["--data", "syn.h5", "--val-data", "syn.h5", "--model", "mlp", "--hidden", "16",
                 "--global-batch", "32", "--seed", "5"] + train_args
        return self.sbatch(["--chdir", self.work, "jobs/fashion-mnist.sbatch"] + flags, env)

    def sbatch(self, args, env):
        job = sh(["sbatch", "--parsable"] + args, env=env).stdout.strip().split(";")[0]
        SUBMITTED.append((job, env))
        return job

    def state(self, job):
        """Slurm's JobState (finished jobs stay known for MinJobAge, 300 s)."""
        p = sh(["scontrol", "-o", "show", "job", job], check=False, env=self.env)
        found = re.search(r"JobState=(\S+)", p.stdout)
        return found.group(1) if found else "UNKNOWN"

    def wait(self, job, done, what, timeout=120):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if done():
                return
            time.sleep(0.2)
        raise AssertionError(f"job {job}: {what} not within {timeout} s\n{self.report(job)}")

    def wait_gone(self, job, timeout=120):
        """Until the job has ended for good (not pending a requeue); returns its state."""
        ended = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
        self.wait(job, lambda: self.state(job) in ended, "the end", timeout)
        return self.state(job)

    def report(self, job):
        """What a failure message shows: the job's log and Slurm's view of the job and the node."""
        show = sh(["scontrol", "show", "job", job], check=False, env=self.env)
        node = sh(["sinfo", "-N", "-o", "%N %T %E"], check=False, env=self.env)
        daemons = ""
        for name in ("slurmctld.log", "slurmd.log"):
            path = os.path.join(self.cluster, name)
            lines = open(path).read().splitlines()[-25:] if os.path.exists(path) else ["(none)"]
            daemons += f"--- last lines of {name}:\n" + "\n".join(lines) + "\n"
        return (f"--- its log:\n{self.log(job)}\n--- scontrol show job:\n{show.stdout}{show.stderr}"
                f"--- sinfo:\n{node.stdout}{node.stderr}{daemons}")

    def log(self, job):
        path = os.path.join(self.work, f"strata-fmnist-{job}.out")
        return open(path).read() if os.path.exists(path) else ""

    def train_log(self, job):
        path = os.path.join(self.run_dir(job), "train.log")
        return open(path).read() if os.path.exists(path) else ""

    def run_dir(self, job):
        return os.path.join(self.work, "runs", f"strata-fmnist-{job}")

    def checkpoint(self, job):
        ck = os.path.join(self.run_dir(job), "checkpoints")
        return os.path.join(ck, open(os.path.join(ck, "latest")).read().strip())

    def requeue_now(self, job):
        """A requeued job pends for BeginTime (~120 s): make it eligible now, as an operator can,
        but 2 s after the requeue: Slurm refuses a batch launch in the second its credential was
        revoked (the requeue) and fails the job ("Job credential revoked"), which is why it
        waits at all. Slurm sets BeginTime when the job has finished completing, which can
        follow the state's turn to PENDING: an earlier update would be overwritten, so it is
        repeated while BeginTime is still the far one."""
        self.wait(job, lambda: self.state(job) == "PENDING", "the requeue")
        time.sleep(2)

        def started():
            p = sh(["scontrol", "-o", "show", "job", job], check=False, env=self.env)
            found = re.search(r"JobState=(\S+).* EligibleTime=(\S+)", p.stdout)
            if not found or found.group(1) != "PENDING":
                return True
            eligible = time.mktime(time.strptime(found.group(2), "%Y-%m-%dT%H:%M:%S"))
            if eligible > time.time() + 10:
                sh(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=False, env=self.env)
            time.sleep(0.5)
            return False
        self.wait(job, started, "the requeued job's start")


def assert_same_checkpoint(a, b, what):
    ta, tb = all_tensors(a), all_tensors(b)
    assert ta.keys() == tb.keys(), (what, sorted(ta), sorted(tb))
    for name in ta:
        assert np.array_equal(ta[name], tb[name]), f"{what}: {name} differs ({a} vs {b})"


def complete_srun_mpirun(args):
    c = Cluster(args, "complete")
    finals = {}
    for launcher in ("srun", "mpirun"):
        t0 = time.monotonic()
        job = c.submit(["--epochs", "3"], launcher)
        assert c.wait_gone(job) == "COMPLETED", c.report(job)
        log = c.log(job)
        assert f"strata: job {job} (restart 0) on " in log and f", {launcher}, run directory" in log, log
        assert "strata: finished" in log and "final test: loss" in log, log
        finals[launcher] = c.checkpoint(job)
        assert finals[launcher].endswith("step-00000024.h5"), finals[launcher]
        print(f"{launcher}: job {job} finished in {time.monotonic() - t0:.1f} s")
    assert_same_checkpoint(finals["srun"], finals["mpirun"], "srun --mpi=pmix vs mpirun")
    return 0


def preempt_requeue(args):
    c = Cluster(args, "preempt")
    train = ["--epochs", "100", "--save-every", "100", "--log-every", "20"]  # 800 steps
    slow = train + ["--bench-stage-ms", "5"]  # sleeps only: the same result, in ~15 s
    t0 = time.monotonic()
    alone = c.submit(train)
    assert c.wait_gone(alone) == "COMPLETED", c.report(alone)
    print(f"uninterrupted: job {alone} in {time.monotonic() - t0:.1f} s")
    t0 = time.monotonic()
    job = c.submit(slow)
    for restart in (0, 1):
        # Preempt once this run is under way: two step lines after its start in train.log
        # (which holds every run's lines), and past the runner's 3 s grace for early signals.
        def under_way():
            runs = re.split(r"^(?:resuming from|--resume auto: no complete).*$", c.train_log(job), flags=re.M)
            return len(runs) == restart + 2 and len(re.findall(r"^step \d+/800", runs[-1], re.M)) >= 2
        c.wait(job, under_way, f"steps of run {restart}")
        time.sleep(1)
        sh(["scancel", "--signal=USR1", "--batch", job], env=c.env)
        c.requeue_now(job)
    assert c.wait_gone(job) == "COMPLETED", c.report(job)
    log = c.log(job)
    starts = re.findall(rf"^strata: job {job} \(restart (\d)\)", log, re.M)
    assert starts == ["0", "1", "2"], f"expected three runs in the one log, found {starts}:\n{log}"
    assert log.count("strata: preempted: requeueing job") == 2, log
    assert len(re.findall(r"^resuming from \S+ at step \d+", log, re.M)) == 2, log
    assert log.rstrip().endswith("strata: finished"), log
    assert_same_checkpoint(c.checkpoint(job), c.checkpoint(alone), "preempted twice vs uninterrupted")
    print(f"preempted twice: job {job} requeued twice and finished in {time.monotonic() - t0:.1f} s, "
          "identical to the uninterrupted job")
    return 0


def time_limit_requeue(args):
    """The time limit itself: --time=1 with --signal=B:USR1@40 (Slurm sends it 20-40 s into each
    run) stops the job twice, the script requeues it twice; then the operator raises its limit
    and the third run finishes. The result equals an uninterrupted run's: --bench-stage-ms only
    sleeps, so the reference runs without it, in seconds."""
    c = Cluster(args, "time-limit")
    train = ["--epochs", "150", "--save-every", "100", "--log-every", "100"]  # 1200 steps, ~85 s at 20 ms sleeps
    alone = c.submit(train)
    assert c.wait_gone(alone) == "COMPLETED", c.report(alone)
    t0 = time.monotonic()
    env = dict(c.env, STRATA_LAUNCHER="srun")
    flags = ["--data", "syn.h5", "--val-data", "syn.h5", "--model", "mlp", "--hidden", "16", "--global-batch", "32",
             "--seed", "5", "--bench-stage-ms", "20"] + train
    job = c.sbatch(["--time=1", "--signal=B:USR1@40", "--chdir", c.work, "jobs/fashion-mnist.sbatch"] + flags, env)
    for requeue in (1, 2):
        c.wait(job, lambda: c.log(job).count("strata: preempted: requeueing job") == requeue, f"time limit {requeue}",
               timeout=150)
        if requeue == 2:
            sh(["scontrol", "update", f"JobId={job}", "TimeLimit=10"], env=c.env)
        c.requeue_now(job)
    assert c.wait_gone(job, timeout=300) == "COMPLETED", c.report(job)
    log = c.log(job)
    starts = re.findall(rf"^strata: job {job} \(restart (\d)\)", log, re.M)
    assert starts == ["0", "1", "2"], f"expected three runs in the one log, found {starts}:\n{log}"
    assert log.rstrip().endswith("strata: finished"), log
    assert_same_checkpoint(c.checkpoint(job), c.checkpoint(alone), "stopped twice by the time limit vs uninterrupted")
    stops = re.findall(r"stopping after step (\d+)", log)
    print(f"time limit: job {job} stopped at steps {', '.join(stops)}, requeued twice, finished in "
          f"{time.monotonic() - t0:.0f} s, identical to the uninterrupted job")
    return 0


def cancel(args):
    c = Cluster(args, "cancel")
    for launcher in ("mpirun", "srun"):
        job = c.submit(["--epochs", "200", "--save-every", "100", "--log-every", "20", "--bench-stage-ms", "5"],
                       launcher)
        c.wait(job, lambda: re.search(r"^step \d+/", c.train_log(job), re.M), "the first steps")
        t0 = time.monotonic()
        sh(["scancel", job], env=c.env)
        assert c.wait_gone(job) == "CANCELLED", c.state(job)
        took = time.monotonic() - t0
        time.sleep(3)  # a requeue would show the job again
        assert c.state(job) == "CANCELLED", f"job {job} came back after scancel: {c.state(job)}"
        log, train_log = c.log(job), c.train_log(job)
        assert "requeueing" not in log and "(restart 1)" not in log, log
        saved = re.search(r"^preemption signal received: stopping after step (\d+)\nsaved checkpoint (\S+) .*\n",
                          train_log, re.M)
        assert saved, f"the final save's lines are not in train.log:\n{train_log}"
        # Each once, in order; the launcher's own lines ("srun: forcing job termination") may fall between.
        stop_line, save_line = saved.group(0).splitlines()
        assert log.count(stop_line + "\n") == 1 and log.count(save_line + "\n") == 1 and \
            log.index(stop_line) < log.index(save_line), f"the final save's lines are not once in the job's log:\n{log}"
        step = int(saved.group(1))
        assert c.checkpoint(job).endswith(f"step-{step:08d}.h5"), (c.checkpoint(job), step)
        assert os.path.exists(c.checkpoint(job) + ".manifest")
        all_tensors(c.checkpoint(job))  # h5py reads every dataset
        print(f"{launcher}: scancel of job {job}: saved at step {step}, gone {took:.1f} s later, not requeued")
    return 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("case")
    parser.add_argument("--build", required=True)
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    try:
        return {"setup": setup, "cleanup": cleanup, "complete_srun_mpirun": complete_srun_mpirun,
                "preempt_requeue": preempt_requeue, "time_limit_requeue": time_limit_requeue,
                "cancel": cancel}[args.case](args)
    finally:
        for job, env in SUBMITTED:
            sh(["scancel", job], check=False, env=env)


if __name__ == "__main__":
    sys.exit(main())
