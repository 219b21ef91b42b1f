"""Ranks on separate network stacks (issue #37 item 3): two "nodes" that share nothing Strata or
Open MPI use but a network link. Each run creates two network namespaces of its own (strata-a-PID,
strata-b-PID) joined by one veth pair, created inside them (nothing appears in the host's stack),
with 198.18.0.1/24 and 198.18.0.2/24 (the benchmarking range, RFC 2544), `lo`, and no IPv6
link-local address. Every process of a node runs as host node-a or node-b (its own UTS namespace)
with its own /dev/shm (a tmpfs in its own mount namespace: neither Strata's shared-memory segments
nor Open MPI's vader segments could reach the other node, and Open MPI's session directories go
there too, so even a killed run leaves no file). The namespaces and every process in them are
removed afterwards, also when a case fails, and `ip netns list` is checked. Not root, or no `ip
netns`, `unshare` or tmpfs mount: exit 77 (CTest's skip).

The launch (the launcher script the case writes, used as mpirun): mpirun runs inside node-a's
namespace with `--host 198.18.0.1:2,198.18.0.2:2` (ranks 0 1 on node-a, 2 3 on node-b). Open MPI
takes 198.18.0.1, one of its own addresses there, for the local node; for 198.18.0.2 it calls its
rsh agent (`--mca plm_rsh_agent`), a script of the case that runs the daemon's command line with
`ip netns exec strata-b-PID` as node-b, where ssh would log in. Options: `--mca btl tcp,self,vader`
(vader only within a node), `btl_tcp_if_include` and `oob_tcp_if_include` 198.18.0.0/24,
`orte_tmpdir_base /dev/shm`; nothing else was needed (no --prefix, tree-spawn or hostname option).

One kernel setting of the namespaces' own stacks: net.ipv4.tcp_retries2 = 4. Strata's watchdog
ends the ranks at --timeout whatever the network does, but Open MPI's runtime (mpirun, orted)
learns of a dead link only from TCP: after the ranks' MPI_Abort, mpirun's kill order to the other
node's daemon is never acknowledged, and with Linux's default of 15 retransmissions (~15 minutes;
keepalive does not probe a connection with data in flight) mpirun was still waiting 40 s after
the cut, the ranks long gone. 4 retransmissions give up after ~6 s: mpirun exits 12-13 s after
the cut, the other node's daemon 1-2 s later. The ranks' own connections, stuck with data in
flight since the cut, would give up after those 6 s too, later than the watchdog's 5 s.

netns_equivalence: dp 4 and tp 2 x dp 2 train the tiny GPT of cases_tensor_parallel 20 steps to
the same bits as 4 ranks on one node (case_simulated_nodes explains dp 4's --shared-memory false
there); rank 0 sees 2 nodes and sends its cross-node groups through MPI, megabytes over the link.
netns_link_cut: the link set down mid-step (`ip link set down`) ends the job non-zero within
--timeout + 10 s, a watchdog line naming node-b and its ranks, the last checkpoint intact. A cut
during a checkpoint write with --checkpoint-io parallel (what auto picks across nodes) leaves the
ranks in libhdf5's own MPI calls (H5Pset_fapl_mpio's MPI_Comm_dup, seen), which the watchdog does
not see: the save's deadline (parallel::BlockingDeadline, the checkpoint deadline of an hour) ends
them, unless Open MPI's runtime gives up first (23 s after the cut in one run). The case cuts
5-20 steps after a save: the progress lines it reads can lag the ranks (mpirun forwards them), and
a cut 20-35 steps after a save once landed in the next one, at step 100 (CI, 7 December)."""
import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import h5py

from cases_gpt import gpt_run, tokenize
from cases_tensor_parallel import GPT4
from harness import MPI_ENV, all_tensors, train_ranks, write_dataset

SKIP = 77  # CTest's SKIP_RETURN_CODE for these cases
TIMEOUT = 5  # --timeout of the link-cut run, seconds
SUBNET = "198.18.0.0/24"
HOSTS = {"node-a": "198.18.0.1", "node-b": "198.18.0.2"}
RANKS_PER_NODE = 2


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(SKIP)


def ip(*words, timeout=20, check=True):
    p = subprocess.run(["ip", *words], capture_output=True, text=True, timeout=timeout)
    assert not check or p.returncode == 0, f"ip {' '.join(words)}: rc={p.returncode}\n{p.stdout}{p.stderr}"
    return p


class TwoNodes:
    """Two network namespaces joined by a veth pair, the launcher and the rsh agent; a context
    manager that removes them, and every process left in them, on the way out."""

    def __init__(self, args):
        tag = str(os.getpid())
        self.ns = {"node-a": f"strata-a-{tag}", "node-b": f"strata-b-{tag}"}
        self.veth = {"node-a": f"sva{tag}", "node-b": f"svb{tag}"}  # at most 15 characters
        self.launcher = os.path.join(args.workdir, f"netns-mpirun-{tag}")
        self.agent = os.path.join(args.workdir, f"netns-rsh-{tag}")
        self.mpirun = args.mpirun

    def __enter__(self):
        if os.geteuid() != 0:
            skip("network namespaces need root")
        for tool in ("ip", "unshare", "mount", "hostname", "tc"):
            if not shutil.which(tool):
                skip(f"{tool} is not installed")
        created = []
        try:
            for node, ns in self.ns.items():
                p = ip("netns", "add", ns, check=False)
                if p.returncode != 0:
                    skip(f"ip netns add failed here: {p.stderr.strip()}")
                created.append(ns)
            a, b = self.ns["node-a"], self.ns["node-b"]
            ip("-n", a, "link", "add", self.veth["node-a"], "type", "veth", "peer", "name", self.veth["node-b"],
               "netns", b)
            for node, ns in self.ns.items():
                # No IPv6 link-local address either (where IPv6 is on): the namespaces' only addresses are ours.
                ip("-n", ns, "link", "set", self.veth[node], "addrgenmode", "none", check=False)
                ip("-n", ns, "addr", "add", HOSTS[node] + "/24", "dev", self.veth[node])
                ip("-n", ns, "link", "set", "lo", "up")
                ip("-n", ns, "link", "set", self.veth[node], "up")
                subprocess.run(["ip", "netns", "exec", ns, "sh", "-c", "echo 4 > /proc/sys/net/ipv4/tcp_retries2"],
                               check=True, timeout=20)
            for node, ns in self.ns.items():
                found = set(re.findall(r" inet6? (\S+)", ip("-n", ns, "-o", "addr").stdout))
                assert found <= {"127.0.0.1/8", "::1/128", HOSTS[node] + "/24"}, (ns, found)
            # Each node's processes: its own hostname and /dev/shm (a new mount namespace per `ip netns exec`).
            enter = 'hostname "$1" && mount -t tmpfs -o size=512m netns-shm /dev/shm && shift && '
            probe = ["ip", "netns", "exec", a, "unshare", "--uts", "sh", "-c", enter + "true", "sh", "node-a"]
            p = subprocess.run(probe, capture_output=True, text=True, timeout=20)
            if p.returncode != 0:
                skip(f"cannot set a namespace's hostname or mount its /dev/shm here: {p.stderr.strip()}")
        except BaseException:
            self.remove(created)
            raise
        with open(self.agent, "w") as f:
            f.write("#!/bin/sh\n# Open MPI's rsh agent for the two namespaces: HOST COMMAND..., as ssh would run it.\n"
                    "case \"$1\" in\n"
                    f"  {HOSTS['node-b']}) ns={self.ns['node-b']} name=node-b ;;\n"
                    f"  {HOSTS['node-a']}) ns={self.ns['node-a']} name=node-a ;;\n"
                    "  *) echo \"netns rsh agent: unknown host $1\" >&2; exit 255 ;;\n"
                    "esac\n"
                    "shift\n"
                    f"exec ip netns exec \"$ns\" unshare --uts sh -c '{enter}exec sh -c \"$*\"' sh \"$name\" \"$@\"\n")
        hosts = ",".join(f"{addr}:{RANKS_PER_NODE}" for addr in HOSTS.values())
        with open(self.launcher, "w") as f:
            f.write("#!/bin/sh\n# mpirun inside node-a's namespace, the ranks on both nodes: use as mpirun.\n"
                    f"exec ip netns exec {self.ns['node-a']} unshare --uts sh -c '{enter}exec \"$@\"' sh node-a "
                    f"{self.mpirun} --host {hosts} --mca plm_rsh_agent {self.agent} --mca btl tcp,self,vader "
                    f"--mca btl_tcp_if_include {SUBNET} --mca oob_tcp_if_include {SUBNET} "
                    "--mca orte_tmpdir_base /dev/shm \"$@\"\n")
        os.chmod(self.agent, 0o755)
        os.chmod(self.launcher, 0o755)
        return self

    def pids(self):
        """(pid, command name) of every process in the two namespaces."""
        found = []
        for ns in self.ns.values():
            for pid in ip("netns", "pids", ns, check=False).stdout.split():
                try:
                    with open(f"/proc/{pid}/comm") as f:
                        found.append((int(pid), f.read().strip()))
                except OSError:
                    pass
        return found

    def link_bytes(self):
        """Bytes sent and received over node-a's end of the link."""
        path = f"/sys/class/net/{self.veth['node-a']}/statistics"
        out = subprocess.run(["ip", "netns", "exec", self.ns["node-a"], "cat", f"{path}/tx_bytes", f"{path}/rx_bytes"],
                             capture_output=True, text=True, check=True, timeout=20).stdout.split()
        return int(out[0]) + int(out[1])

    def cut(self):
        ip("-n", self.ns["node-a"], "link", "set", self.veth["node-a"], "down")

    def remove(self, namespaces):
        end = time.monotonic() + 20
        while time.monotonic() < end:
            left = self.pids()
            if not left:
                break
            for pid, _ in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        for ns in namespaces:
            ip("netns", "del", ns, check=False)
        listed = ip("netns", "list", check=False).stdout
        left = [ns for ns in namespaces if re.search(rf"^{ns}\b", listed, re.M)]
        assert not left, f"namespaces {left} are still there:\n{listed}"

    def __exit__(self, *exc):
        for path in (self.launcher, self.agent):
            if os.path.exists(path):
                os.remove(path)
        self.remove(list(self.ns.values()))
        print(f"removed {' and '.join(self.ns.values())}; nothing left in `ip netns list`")


def case_netns_equivalence(args):
    """Each rank's node (host name, network namespace), then dp 4 and tp 2 x dp 2 on two nodes
    against one node, bit for bit, the cross-node groups over the link."""
    layouts = {  # name: (flags, one-node reference flags, what rank 0's groups go through)
        "dp4": ((), ("--shared-memory", "false"), "dp MPI"),
        "tp2xdp2": (("--tp", "2"), (), "dp MPI, tp shared memory"),
    }
    with TwoNodes(args) as nodes:
        data = tokenize(args, "byte")
        env = dict(os.environ, **MPI_ENV)
        p = subprocess.run([nodes.launcher, "-np", "4", "sh", "-c",
                            'echo "$OMPI_COMM_WORLD_RANK $(hostname) $(readlink /proc/self/ns/net)"'],
                           capture_output=True, text=True, env=env, timeout=60)
        assert p.returncode == 0, f"rc={p.returncode}\n{p.stdout}\n{p.stderr}"
        where = {int(r): (host, net) for r, host, net in (l.split() for l in p.stdout.splitlines() if l.strip())}
        own = os.readlink("/proc/self/ns/net")
        assert [where[r][0] for r in range(4)] == ["node-a", "node-a", "node-b", "node-b"], where
        assert where[0][1] == where[1][1] != where[2][1] == where[3][1] and own not in (where[0][1], where[2][1]), where
        print(f"ranks 0 1 on node-a ({where[0][1]}), 2 3 on node-b ({where[2][1]}); this process: {own}")

        two_nodes = copy.copy(args)
        two_nodes.mpirun = nodes.launcher
        for name, (flags, reference_flags, transport) in layouts.items():
            want, _ = gpt_run(args, 4, list(flags) + list(reference_flags), data, "netns-one-node-" + name, steps=20,
                              model=GPT4)
            before = nodes.link_bytes()
            got, out = gpt_run(two_nodes, 4, flags, data, "netns-two-nodes-" + name, steps=20, model=GPT4)
            crossed = nodes.link_bytes() - before
            assert "(4 rank(s) on 2 node(s): [0 1] [2 3]," in out, out
            assert f"rank 0's groups communicate through: {transport}\n" in out, out
            assert want.keys() == got.keys()
            for tensor in want:
                assert (want[tensor] == got[tensor]).all(), f"{name}: {tensor} differs between one node and two"
            # 20 steps of dp all-reduces of the 34k-parameter model (137 KB each): megabytes, not just the launch.
            assert crossed > 1_000_000, f"{name}: only {crossed} bytes crossed the link"
            print(f"  {name}: identical to one node; {transport}; {crossed / 1e6:.1f} MB over the link")


def newest_checkpoint(out):
    saved = re.findall(r"^saved checkpoint (\S+/step-(\d+)\.h5) ", out, re.M)
    return (saved[-1][0], int(saved[-1][1])) if saved else (None, 0)


def case_netns_link_cut(args):
    """dp 4 over the two nodes (--timeout 5, a checkpoint every 50 steps); once one is saved, the
    link is set down 5-20 steps after it. Every rank and mpirun are gone within --timeout + 10 s
    with a non-zero exit; a rank on node-a names what it waited for, in which step, and the ranks
    of node-b (their own lines stay on node-b: its daemon forwards output over the cut link); the
    last checkpoint and `latest` are intact and a one-node run resumes from it. Last, as the issue
    asks: the line names node-b itself, the host of those ranks."""
    with TwoNodes(args) as nodes:
        data = write_dataset(os.path.join(args.workdir, "netns-cut.h5"), n=4096, seed=5)
        ck = os.path.join(args.workdir, "netns-cut-ck")
        shutil.rmtree(ck, ignore_errors=True)
        flags = ["--model", "mlp", "--hidden", "64", "--data", data, "--global-batch", "16", "--checkpoint-dir", ck]
        out_path, err_path = (os.path.join(args.workdir, f"netns-cut.{s}") for s in ("out", "err"))
        cmd = [nodes.launcher, "-np", "4", "--bind-to", "none", args.train] + flags + [
            "--steps", "1000000", "--log-every", "1", "--timeout", str(TIMEOUT), "--save-every", "50"]
        with open(out_path, "w") as out_file, open(err_path, "w") as err_file:
            p = subprocess.Popen(cmd, stdout=out_file, stderr=err_file, env=dict(os.environ, **MPI_ENV),
                                 start_new_session=True)
        try:
            end = time.monotonic() + 120
            while True:
                assert p.poll() is None, f"the job ended before the cut: rc={p.returncode}\n{open(err_path).read()}"
                assert time.monotonic() < end, f"no checkpoint and steps after it in 120 s\n{open(out_path).read()}"
                out = open(out_path).read()
                steps = re.findall(r"^step (\d+)/", out, re.M)
                if newest_checkpoint(out)[0] and steps and 5 <= int(steps[-1]) % 50 < 20:
                    break
                time.sleep(0.02)
            nodes.cut()
            cut = time.monotonic()
            ranks_gone = mpirun_gone = all_gone = None
            while time.monotonic() < cut + TIMEOUT + 10 + 20:
                left = nodes.pids()
                now = time.monotonic() - cut
                if ranks_gone is None and not any(name == "train" for _, name in left):
                    ranks_gone = now
                if mpirun_gone is None and p.poll() is not None:
                    mpirun_gone = now
                if not left and p.poll() is not None:
                    all_gone = now
                    break
                time.sleep(0.1)
            remaining = nodes.pids()
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=20)
    out, err = open(out_path).read(), open(err_path).read()
    what = f"\nstdout (end):\n{out[-1500:]}\nstderr:\n{err[-6000:]}"
    assert ranks_gone is not None and mpirun_gone is not None, (
        f"after the cut: ranks gone after {ranks_gone} s, mpirun after {mpirun_gone} s; left 30 s on: {remaining}"
        f"{what}")
    print(f"link cut: ranks gone {ranks_gone:.1f} s after it, mpirun {mpirun_gone:.1f} s (exit {p.returncode}), "
          f"every process of the namespaces {'not' if all_gone is None else f'{all_gone:.1f} s'}")
    assert p.returncode != 0, f"exit 0 after a cut link{what}"
    assert ranks_gone < TIMEOUT + 10 and mpirun_gone < TIMEOUT + 10, (
        f"the job took {max(ranks_gone, mpirun_gone):.1f} s after the cut to end{what}")
    assert all_gone is not None, f"left 30 s after the cut: {remaining}{what}"
    ours = [l for l in err.splitlines() if re.match(r"\[rank [01]\] watchdog: ", l)]
    assert ours, f"no watchdog line from a rank of node-a{what}"
    line = ours[0]
    assert re.search(r"#\d+ (all_reduce|all_gather|reduce|broadcast|barrier)\w* .*\bstep \d+\)", line), line
    assert re.search(rf"not complete after [0-9.]+ s \(--timeout {TIMEOUT}\)", line), line
    m = re.search(r"ranks ([\d, ]+) \(node-b\): unknown \(not on this node\)", line)
    assert m and {int(r) for r in m.group(1).split(",")} <= {2, 3}, f"node-b and its ranks not named: {line}"
    print(f"  {line}")

    # The last checkpoint: what `latest` names, complete (no unfinished write), readable, resumable.
    path, step = newest_checkpoint(out)
    assert open(os.path.join(ck, "latest")).read().strip() == os.path.basename(path), os.listdir(ck)
    assert os.path.exists(path + ".manifest"), os.listdir(ck)
    assert not [f for f in os.listdir(ck) if ".tmp" in f], f"a checkpoint write was cut: {os.listdir(ck)}"
    tensors = all_tensors(path)
    with h5py.File(path, "r") as f:
        assert "model" in f, list(f)
    resumed = train_ranks(args, 2, flags + ["--steps", str(step + 5), "--resume", "auto"], timeout=120)
    assert f"resuming from {path} at step {step}" in resumed, resumed
    print(f"  {os.path.basename(path)}: {len(tensors)} datasets, resumed on one node to step {step + 5}")


def case_netns_slow_link(args):
    """A slow link between the nodes (a token bucket of 40 Mbit/s each way on the veth, `tc tbf`):
    dp 4 over the two nodes spends most of each step waiting in communication (the progress
    line's comm share, every window) where the same run over the full-speed link does not, and no
    rank is named a straggler: every rank waits alike, so the line shows the wait as comm and
    blames no rank (docs/reliability.md, the straggler rule)."""
    with TwoNodes(args) as nodes:
        data = write_dataset(os.path.join(args.workdir, "netns-slow.h5"), 1024, (1, 28, 28), 10, seed=5)
        two_nodes = copy.copy(args)
        two_nodes.mpirun = nodes.launcher
        records = {}
        for speed in ("full", "slow"):
            if speed == "slow":
                for node, ns in nodes.ns.items():
                    p = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", nodes.veth[node],
                                        "root", "tbf", "rate", "40mbit", "burst", "64kbit", "latency", "400ms"],
                                       capture_output=True, text=True, timeout=20)
                    if p.returncode != 0:
                        skip(f"cannot limit the link's rate here (tc tbf): {p.stderr.strip()}")
            metrics = os.path.join(args.workdir, f"netns-slow-{speed}.jsonl")
            if os.path.exists(metrics):
                os.remove(metrics)
            out = train_ranks(two_nodes, 4, ["--model", "mlp", "--hidden", "256", "--data", data, "--global-batch",
                                             "64", "--steps", "30", "--log-every", "5", "--threads", "1", "--metrics",
                                             metrics], timeout=300)
            assert "(4 rank(s) on 2 node(s): [0 1] [2 3]," in out, out
            assert not re.search(r"^step \d+/.*  slow: rank", out, re.M), f"{speed} link: a rank was named\n{out}"
            records[speed] = [json.loads(l) for l in open(metrics) if '"eval"' not in l]
            assert records[speed] and not any(r["straggler"] for r in records[speed]), records[speed]
        # Each window after the first (whose times include the start).
        comm = {speed: [r["split"]["comm"] for r in rs[1:] if r["split"]] for speed, rs in records.items()}
        step = {speed: [r["step_time_s"] for r in rs[1:]] for speed, rs in records.items()}
        assert all(len(c) >= 4 for c in comm.values()), records
        print(f"step time per window: full-speed link {', '.join(f'{t:.3f}' for t in step['full'])} s; 40 Mbit/s "
              f"{', '.join(f'{t:.3f}' for t in step['slow'])} s; comm share {', '.join(f'{c:.0%}' for c in comm['full'])}"
              f" and {', '.join(f'{c:.0%}' for c in comm['slow'])}; no rank named on either")
        assert min(step["slow"]) > 2 * max(step["full"]), step  # the limit bites
        assert min(comm["slow"]) > 0.9, comm  # and the slow steps are waits in communication
