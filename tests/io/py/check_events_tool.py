"""strata-events on the event files tensorboard's and torch's writers made
(tests/fixtures/tensorboard): every line parses as JSON and says what tensorboard's own reader read
(the NAME.txt listings: wall time and float32 bits); a file that is no event file is one line on
stderr, exit code 2. Debian's python3 only.

Usage: python3 check_events_tool.py STRATA_EVENTS FIXTURES_DIR
"""
import json
import os
import struct
import subprocess
import sys

tool, fixtures = sys.argv[1], sys.argv[2]
for name in ("tensorboard.events", "torch.events"):
    path = os.path.join(fixtures, name)
    out = subprocess.run([tool, path], capture_output=True, text=True, check=True).stdout
    got = [json.loads(line) for line in out.splitlines()]
    want = [line.rstrip("\n").split("\t") for line in open(path + ".txt", encoding="utf-8")]
    assert len(got) == len(want), (name, len(got), len(want))
    for g, (wall, step, version, status, writer, *scalars) in zip(got, want):
        assert struct.pack("<d", g.pop("wall_time")) == struct.pack("<Q", int(wall, 16)), (name, g, wall)
        assert g.pop("file") == path and g.pop("step") == int(step), (name, g, step)
        assert g.pop("file_version", "") == version and g.pop("writer", "") == writer, (name, g)
        assert (g.pop("session", None) == "START") == (status == "1"), (name, g, status)
        for tag, bits in (s.rsplit("=", 1) for s in scalars):
            assert struct.pack("<f", g.pop(tag)) == struct.pack("<I", int(bits, 16)), (name, tag, bits)
        assert not g, (name, "fields the reference did not read", g)
    print(f"{name}: {len(got)} events as tensorboard read them")

bad = subprocess.run([tool, os.path.join(fixtures, "torch.events.txt")], capture_output=True, text=True)
assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1 and "CRC" in bad.stderr, bad
print("a text file: exit 2,", bad.stderr.strip())
