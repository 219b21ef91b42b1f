#!/usr/bin/env python3
"""Writes tests/fixtures/tensorboard/: event files made by the reference writers, for the C++
reader and writer to match byte for byte without them (test_io_tensorboard; CI has no tensorboard).

Usage: bench/.venv/bin/python tools/interop/make_tensorboard_fixtures.py [OUT_DIR]

- tensorboard.events: tensorboard's own EventFileWriter (the one torch and tensorboardX use),
  given Events of several scalars each (zero, negative, huge, inf, NaN, a UTF-8 tag, a step past
  2^32), an empty summary and a SessionLog START.
- torch.events: torch.utils.tensorboard.SummaryWriter.add_scalar, one scalar an event.
Wall times are fixed (time.time patched for the file-version event), so the bytes are the same on
every run. Beside each, NAME.txt lists its events as tensorboard's LegacyEventFileLoader reads
them back, one a line, tab-separated: wall_time's float64 bits (hex), step, file_version,
SessionLog status, source_metadata.writer, then TAG=BITS per scalar (simple_value's float32
bits, hex).
"""
import glob
import os
import shutil
import struct
import sys
import tempfile
from unittest import mock

import tensorboard
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer import event_file_writer

T0 = 1700000000.25  # the file-version event's wall time


def written(out, name, write):
    """Runs write(logdir) with time.time() = T0, moves its one event file to OUT/NAME."""
    with tempfile.TemporaryDirectory() as logdir:
        with mock.patch.object(event_file_writer.time, "time", return_value=T0):
            write(logdir)
        (path,) = glob.glob(os.path.join(logdir, "**", "*tfevents*"), recursive=True)
        shutil.move(path, os.path.join(out, name))


def scalars(step, wall_time, values):
    return Event(wall_time=wall_time, step=step,
                 summary=Summary(value=[Summary.Value(tag=t, simple_value=v) for t, v in values]))


def write_tensorboard(logdir):
    w = event_file_writer.EventFileWriter(logdir)
    w.add_event(scalars(1, 1700000001.5, [("loss", 2.302585), ("lr", 0.001), ("split/compute", 0.75)]))
    w.add_event(scalars(2, 1700000002.123456789, [("zero", 0.0), ("negative", -1.5e-7), ("huge", 1e30),
                                                  ("peak_bytes", 123456789012.0), ("ünïcode/tag", 1.0)]))
    w.add_event(scalars(2**40 + 3, 1700000003.0, [("inf", float("inf")), ("-inf", float("-inf")),
                                                   ("nan", float("nan"))]))
    w.add_event(Event(wall_time=1700000004.0, step=7, summary=Summary()))
    w.add_event(Event(wall_time=1700000005.0, step=5, session_log=SessionLog(status=SessionLog.START)))
    w.add_event(scalars(5, 1700000006.0, [("val/eval_loss", 1.234568)]))
    w.close()


def write_torch(logdir):
    from torch.utils.tensorboard import SummaryWriter
    w = SummaryWriter(logdir)
    for step, (loss, lr) in enumerate([(2.5, 0.1), (1.25, 0.05), (0.625, 0.025)], 1):
        w.add_scalar("loss", loss, global_step=step, walltime=T0 + step)
        w.add_scalar("lr", lr, global_step=step, walltime=T0 + step)
    w.close()


def bits(fmt, value):
    return struct.unpack("<" + {"d": "Q", "f": "I"}[fmt], struct.pack("<" + fmt, value))[0]


def listing(path):
    lines = []
    for e in LegacyEventFileLoader(path).Load():
        fields = [f"{bits('d', e.wall_time):016x}", str(e.step), e.file_version, str(e.session_log.status),
                  e.source_metadata.writer]
        fields += [f"{v.tag}={bits('f', v.simple_value):08x}" for v in e.summary.value]
        lines.append("\t".join(fields) + "\n")
    return "".join(lines)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "..", "tests", "fixtures", "tensorboard")
    os.makedirs(out, exist_ok=True)
    for name, write in [("tensorboard.events", write_tensorboard), ("torch.events", write_torch)]:
        written(out, name, write)
        with open(os.path.join(out, name + ".txt"), "w", encoding="utf-8") as f:
            f.write(listing(os.path.join(out, name)))
    print(f"tensorboard {tensorboard.__version__}: fixtures in {os.path.abspath(out)}")


if __name__ == "__main__":
    main()
