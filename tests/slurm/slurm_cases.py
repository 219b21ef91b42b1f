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
  elastic_lost_node          STRATA_ELASTIC through sbatch and srun: the job's 2 tasks as 2
                             simulated nodes of 1 rank; node sim1's rank SIGKILLed after a
                             checkpoint -> srun ends the step, the script names sim1 and runs
                             train again on 1 rank in the same allocation -> COMPLETED, the final
                             model within 1e-5 of an uninterrupted job's; then a job stopped
                             (scancel) and resubmitted into its checkpoints with 1 task continues
                             there, --layout auto, no conversion

Requeued jobs wait ~120 s for eligibility (Slurm's BeginTime); 2 s after the requeue the tests
move it to now with `scontrol update StartTime=now`, as an operator can (see requeue_now)."""
import argparse
import os
import re
import shutil
import signal
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


GPT = ["--model", "gpt", "--layers", "2", "--heads", "4", "--embed", "32", "--seq-len", "16", "--threads", "1",
       "--vocab", "260", "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.1", "--dropout", "0.1",
       "--tie-embeddings", "false", "--data", "byte-train.h5", "--val-data", "byte-val.h5", "--global-batch", "16",
       "--seed", "3", "--log-every", "10", "--bucket-mb", "0.01", "--steps", "100", "--save-every", "20",
       "--timeout", "5", "--layout", "auto"]


def train_pid(job, rank, timeout=60):
    """The pid of the job's train process of world rank `rank` (srun's SLURM_PROCID), from /proc."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/comm") as f:
                    if f.read().strip() != "train":
                        continue
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            except OSError:
                continue
            if env.get(b"SLURM_JOB_ID") == job.encode() and env.get(b"SLURM_PROCID") == str(rank).encode():
                return int(entry)
        time.sleep(0.2)
    raise AssertionError(f"job {job}: no train process of rank {rank}")


def elastic_lost_node(args):
    """Elastic jobs (docs/slurm.md): a node lost mid-run, and a job resubmitted with fewer tasks.
    One Slurm node cannot lose a node and keep the batch shell, so the job's 2 tasks are 2 simulated
    nodes of 1 rank (STRATA_RANKS_PER_NODE=1): SIGKILL of rank 1 is node sim1's loss; srun reports
    the task killed and ends the step, and the script, STRATA_ELASTIC=1, runs train again with
    `srun --ntasks=1` in the same allocation, --layout auto, --resume auto."""
    c = Cluster(args, "elastic")
    build = os.path.join(c.work, "build")
    sh([os.path.join(build, "strata-data"), "tokenize", "--input", "/usr/share/common-licenses/GPL-3",
        "/usr/share/common-licenses/Apache-2.0", "--out", os.path.join(c.work, "byte"), "--tokenizer", "byte"])
    env = dict(c.env, STRATA_LAUNCHER="srun")

    def submit(flags, extra_env=None, sbatch=()):
        return c.sbatch(["--chdir", c.work] + list(sbatch) + ["jobs/fashion-mnist.sbatch"] + GPT + flags,
                        dict(env, **(extra_env or {})))

    def final(job):
        return all_tensors(os.path.join(c.run_dir(job), "checkpoints", "step-00000100.h5"))

    t0 = time.monotonic()
    alone = submit([])
    assert c.wait_gone(alone) == "COMPLETED", c.report(alone)
    want = final(alone)
    print(f"uninterrupted: job {alone} (2 tasks) in {time.monotonic() - t0:.1f} s")

    # A node lost mid-run. --bench-stage-ms only sleeps: the same result, the job lasts past the kill.
    t0 = time.monotonic()
    job = submit(["--bench-stage-ms", "10"], {"STRATA_ELASTIC": "1", "STRATA_RANKS_PER_NODE": "1"})
    c.wait(job, lambda: "saved checkpoint" in c.train_log(job), "the first checkpoint")
    os.kill(train_pid(job, 1), signal.SIGKILL)
    killed = time.monotonic()
    c.wait(job, lambda: "strata: train exited" in c.log(job), "the end of the first launch")
    ended = time.monotonic() - killed
    assert c.wait_gone(job) == "COMPLETED", c.report(job)
    log = c.log(job)
    assert ended <= 5 + 10, f"the launch ended {ended:.1f} s after the SIGKILL (--timeout 5)\n{log}"
    code = re.search(r"^strata: train exited (\d+) ", log, re.M)[1]
    assert re.search(r"^srun: error: \S+: task 1: Killed$", log, re.M), log
    lost = re.findall(r"^strata: lost node (.*)$", log, re.M)
    m = re.fullmatch(r"sim1 \(rank 1\): continuing on 1 node\(s\), 1 rank\(s\) from step (\d+)", lost[0]) \
        if len(lost) == 1 else None
    assert m, log
    step = int(m[1])
    assert f"resuming from runs/strata-fmnist-{job}/checkpoints/step-{step:08d}.h5 at step {step}" in log, log
    assert re.findall(r"^--layout auto: .* layouts of (\d+) ranks? that fit", log, re.M) == ["2", "1"], log
    assert log.rstrip().endswith("strata: finished") and "requeueing" not in log, log
    worst = max_relative_difference(final(job), want)
    assert worst <= 1e-5, f"node lost vs uninterrupted: worst /model difference {worst:.3g}"
    print(f"node sim1 lost: job {job}: srun ended the step {ended:.1f} s after the SIGKILL (exit {code}), the "
          f"script continued on 1 rank from step {step}, COMPLETED in {time.monotonic() - t0:.1f} s; "
          f"worst /model difference from the uninterrupted job {worst:.2g}")

    # Fewer tasks at the next submission: stopped by scancel (saves), resubmitted with 1 task into
    # its checkpoints; --layout auto plans for 1 rank and --resume auto continues, no conversion.
    t0 = time.monotonic()
    first = submit(["--bench-stage-ms", "10"])
    c.wait(first, lambda: re.search(r"^step [3-9]0/100", c.train_log(first), re.M), "step 30")
    sh(["scancel", first], env=c.env)
    assert c.wait_gone(first) == "CANCELLED", c.report(first)
    saved = re.findall(r"^saved checkpoint \S+/step-(\d+)\.h5", c.train_log(first), re.M)
    second = submit(["--checkpoint-dir", f"runs/strata-fmnist-{first}/checkpoints"], sbatch=["--ntasks-per-node=1"])
    assert c.wait_gone(second) == "COMPLETED", c.report(second)
    log = c.log(second)
    step = int(saved[-1])
    assert f"resuming from runs/strata-fmnist-{first}/checkpoints/step-{step:08d}.h5 at step {step}" in log, log
    assert re.search(r"^--layout auto: .* layouts of 1 rank", log, re.M), log
    got = all_tensors(os.path.join(c.run_dir(first), "checkpoints", "step-00000100.h5"))
    worst = max_relative_difference(got, want)
    assert worst <= 1e-5, f"resubmitted with 1 task vs uninterrupted: worst /model difference {worst:.3g}"
    print(f"resubmitted with fewer tasks: job {first} (2 tasks) cancelled at step {step}, job {second} (1 task) "
          f"continued it, {time.monotonic() - t0:.1f} s; worst /model difference {worst:.2g}")
    return 0


def max_relative_difference(got, want):
    """The worst max |a - b| / max |b| over the /model tensors (cases_gpt.assert_close's measure)."""
    names = [n for n in want if n.startswith("model/")]
    assert names and sorted(names) == sorted(n for n in got if n.startswith("model/")), (sorted(got), sorted(want))
    return max(float(np.abs(got[n].astype(np.float64) - want[n]).max() / max(np.abs(want[n]).max(), 1e-30))
               for n in names)


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
                "cancel": cancel, "elastic_lost_node": elastic_lost_node}[args.case](args)
    finally:
        for job, env in SUBMITTED:
            sh(["scancel", job], check=False, env=env)


if __name__ == "__main__":
    sys.exit(main())
