"""The commands of the README, docs/gpt.md, docs/migration.md and docs/troubleshooting.md run as
written (issues #22, #39).

The convention (stated at the top of both documents):
- A fenced block whose info string is `sh` (or `bash`) is run with `bash -e -o pipefail`, one
  whose info string is `python` with python3; every other block (`text`, `ini`, `json`, no info
  string, indented output) is shown, never run.
- `<!-- not run: REASON -->` on the line before such a block (blank lines between allowed)
  leaves it out: what needs a cluster, a GPU, Slurm or a long job. It is still checked for
  syntax (`bash -n`, `compile`).
- `<!-- exit: N -->` before a block says the block shows an error on purpose: it must end with
  exit status N (so the failing command is its last one); every other block must exit 0.

Each document's runnable blocks run in order in a fresh directory laid out like the
repository's root: `build/train`, `build/strata-data`, `build/strata-sample` are the binaries
under test, `tools/`, `jobs/` and `scripts/` link to the repository's, and `train`,
`strata-data`, `strata-sample`, `strata-plot` and `mpirun` (the launcher given with --mpirun)
are on PATH; so a later block may use what an earlier one wrote. Open MPI runs as root and
oversubscribes (OMPI_ALLOW_RUN_AS_ROOT*, OMPI_MCA_rmaps_base_oversubscribe). A failing block is
reported with its document, line, text, exit status and the tail of its output; the case
asserts a minimum number of blocks run, so an extraction that finds nothing cannot pass.
"""
import os
import re
import shutil
import subprocess
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DOCS = {"docs/migration.md": 12, "docs/troubleshooting.md": 6, "README.md": 2, "docs/gpt.md": 1}  # document: the fewest runnable blocks it must have
LANGUAGES = {"sh": "sh", "bash": "sh", "python": "python"}
MARKER = re.compile(r"^\s*<!--\s*(not run|exit)\s*:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,})\s*([\w+-]*)")
CRASHES = ("terminate called", "Traceback (most recent call last)", "core dumped", "Segmentation fault",
           "HDF5-DIAG", "AddressSanitizer")
BLOCK_TIMEOUT = 300


class Block:
    def __init__(self, doc, line, language, text, skip=None, exit_code=0):
        self.doc, self.line, self.language, self.text = doc, line, language, text
        self.skip, self.exit_code = skip, exit_code

    def where(self):
        return f"{self.doc}:{self.line} ({self.language} block)"


def extract(doc, text):
    """Every fenced block of `text` that has a runnable info string, with its marker applied."""
    blocks, lines, marker, i = [], text.splitlines(), None, 0
    while i < len(lines):
        line = lines[i]
        m = MARKER.match(line)
        assert m or not re.match(r"^\s*<!--\s*(not[ _-]?run|exit)\b", line, re.I), \
            f"{doc}:{i + 1}: malformed marker {line.strip()!r}; expected '<!-- not run: REASON -->' or '<!-- exit: N -->'"
        if m:
            assert marker is None, f"{doc}:{i + 1}: two markers in a row ({marker[2]} and this one)"
            kind, value = m.group(1), m.group(2)
            assert value, f"{doc}:{i + 1}: a '{kind}:' marker needs a reason or an exit status"
            if kind == "exit":
                assert re.fullmatch(r"[0-9]+", value), f"{doc}:{i + 1}: '<!-- exit: {value} -->' is not an exit status"
            marker = (kind, value, i + 1)
            i += 1
            continue
        fence = FENCE.match(line)
        if not fence:
            assert marker is None or not line.strip(), \
                f"{doc}:{marker[2]}: the marker is not followed by a fenced block (line {i + 1}: {line.strip()!r})"
            i += 1
            continue
        indent, ticks, info = fence.groups()
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not re.match(r"^\s*" + ticks + r"\s*$", lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        assert i < len(lines), f"{doc}:{start}: the fenced block is never closed"
        i += 1
        language = LANGUAGES.get(info)
        if language is None:
            assert marker is None, f"{doc}:{marker[2]}: a marker before a ```{info} block, which is never run"
            continue
        block = Block(doc, start, language, "\n".join(body) + "\n")
        if marker:
            if marker[0] == "not run":
                block.skip = marker[1]
            else:
                block.exit_code = int(marker[1])
        blocks.append(block)
        marker = None
    assert marker is None, f"{doc}:{marker[2]}: the marker is not followed by a fenced block"
    return blocks


def link(target, name):
    if os.path.lexists(name):
        os.remove(name)
    os.symlink(os.path.abspath(target), name)


def which(program):
    found = shutil.which(program)
    assert found, f"{program} not found on PATH"
    return found


def sandbox(args, name):
    """A fresh directory laid out like the repository's root, and the environment to run in it."""
    root = os.path.join(args.workdir, name)
    shutil.rmtree(root, ignore_errors=True)
    for sub in ("bin", "build", ".blocks"):
        os.makedirs(os.path.join(root, sub))
    tools = {"train": args.train, "strata-data": args.data_tool, "strata-sample": args.sample_tool}
    for tool, path in tools.items():
        if os.path.exists(path):
            link(path, os.path.join(root, "build", tool))
            link(path, os.path.join(root, "bin", tool))
    link(os.path.join(REPO, "tools", "strata-plot"), os.path.join(root, "bin", "strata-plot"))
    link(which(args.mpirun), os.path.join(root, "bin", "mpirun"))
    link(sys.executable, os.path.join(root, "bin", "python3"))
    for sub in ("tools", "jobs", "scripts"):
        link(os.path.join(REPO, sub), os.path.join(root, sub))
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", PYTHONDONTWRITEBYTECODE="1", PATH=os.path.join(root, "bin") + os.pathsep + os.environ["PATH"])
    return root, env


def check_syntax(block, path):
    """A block that is not run must at least parse."""
    if block.language == "sh":
        p = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
        assert p.returncode == 0, f"{block.where()} (not run) does not parse:\n{block.text}\n{p.stderr}"
    else:
        compile(block.text, block.where(), "exec")


def run_block(block, root, env, path):
    """Runs one block; returns (exit status, combined output, seconds)."""
    cmd = ["bash", "-e", "-o", "pipefail", path] if block.language == "sh" else [sys.executable, path]
    start = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=BLOCK_TIMEOUT)
        rc, out = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        rc, out = "timeout", (e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or "")
        out += f"\n(killed after {BLOCK_TIMEOUT} s)"
    return rc, out, time.monotonic() - start


def failure(block, rc, out, why):
    tail = "\n".join(out.splitlines()[-40:])
    return (f"{block.where()}: {why}\n--- the block ---\n{block.text}--- exit status {rc}, the last 40 lines "
            f"of its output ---\n{tail}")


def run_doc(args, doc):
    """Runs `doc`'s runnable blocks in order; returns (run, skipped, failure message or None)."""
    blocks = extract(doc, open(os.path.join(REPO, doc), encoding="utf-8").read())
    runnable = [b for b in blocks if b.skip is None]
    assert len(runnable) >= DOCS[doc], \
        f"{doc}: {len(runnable)} runnable blocks found, expected at least {DOCS[doc]} (is the extraction broken?)"
    root, env = sandbox(args, os.path.splitext(os.path.basename(doc))[0])
    ran = 0
    for n, block in enumerate(blocks):
        path = os.path.join(root, ".blocks", f"{n:02d}-line{block.line}.{'sh' if block.language == 'sh' else 'py'}")
        with open(path, "w") as f:
            f.write(block.text)
        if block.skip is not None:
            check_syntax(block, path)
            print(f"  {block.where()}: not run ({block.skip})")
            continue
        rc, out, seconds = run_block(block, root, env, path)
        with open(os.path.splitext(path)[0] + ".out", "w") as f:
            f.write(out)
        ran += 1
        print(f"  {block.where()}: exit {rc} in {seconds:.1f} s")
        if rc != block.exit_code:
            return ran, len(blocks) - len(runnable), failure(block, rc, out, f"expected exit status {block.exit_code}")
        crash = next((c for c in CRASHES if c in out), None)
        if crash:
            return ran, len(blocks) - len(runnable), failure(block, rc, out, f"its output holds {crash!r}")
    return ran, len(blocks) - len(runnable), None


def case_docs_commands(args):
    """Every runnable block of docs/migration.md and docs/troubleshooting.md exits as documented."""
    start, total, failures = time.monotonic(), 0, []
    for doc in DOCS:
        print(f"{doc}:")
        ran, skipped, problem = run_doc(args, doc)
        total += ran
        print(f"{doc}: {ran} blocks run, {skipped} not run")
        if problem:
            failures.append(problem)
    assert not failures, "\n\n".join(failures)
    assert total >= sum(DOCS.values()), total
    print(f"docs: {total} blocks run in {time.monotonic() - start:.0f} s")
