"""Oracle for CheckpointWriter: reads the checkpoint test_io_checkpoint wrote (write_known in
test_checkpoint.cpp) with h5py. Usage: check_checkpoint.py PATH"""
import sys
import zlib

import h5py
import numpy as np


def arange(shape, start):
    return (start + 0.5 * np.arange(int(np.prod(shape)))).astype(np.float32).reshape(shape)


with h5py.File(sys.argv[1], "r") as f:
    assert int(f.attrs["format_version"]) == 2
    assert int(f.attrs["step"]) == 1234
    assert abs(float(f.attrs["lr"]) - 0.05) < 1e-15
    model = f.attrs["model"]
    assert (model.decode() if isinstance(model, bytes) else model) == "cnn", model
    expected = {
        "model/conv1/weight": arange((2, 1, 3, 3), -4.0),
        "model/conv1/bias": arange((2,), 1.0),
        "model/fc/weight": arange((3, 4), 0.0),
        "state/counts": (np.arange(5) ** 2 - 3).astype(np.int32),
    }
    found = []
    f.visititems(lambda name, obj: found.append(name) if isinstance(obj, h5py.Dataset) else None)
    assert sorted(found) == sorted(expected), found
    for name, want in expected.items():
        d = f[name]
        assert d.dtype == want.dtype and d.shape == want.shape, (name, d.dtype, d.shape)
        got = d[...]
        assert np.array_equal(got, want), name
        assert int(d.attrs["crc32"]) == zlib.crc32(np.ascontiguousarray(got).tobytes()), name + " crc32"
print("ok: checkpoint matches")
