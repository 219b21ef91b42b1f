"""Oracle for `strata-data convert-idx`: reads the IDX files directly with gzip + numpy and
compares with the shards through h5py. Usage: check_convert.py IMAGES.gz LABELS.gz SHARD.h5..."""
import gzip
import sys

import h5py
import numpy as np

images_path, labels_path, shards = sys.argv[1], sys.argv[2], sorted(sys.argv[3:])
with gzip.open(images_path, "rb") as f:
    raw = f.read()
    assert int.from_bytes(raw[0:4], "big") == 0x803
    n, h, w = (int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(3))
    images = np.frombuffer(raw, np.uint8, offset=16).reshape(n, 1, h, w)
with gzip.open(labels_path, "rb") as f:
    raw = f.read()
    assert int.from_bytes(raw[0:4], "big") == 0x801
    labels = np.frombuffer(raw, np.uint8, offset=8).astype(np.int64)

xs, ys = [], []
for i, path in enumerate(shards):
    with h5py.File(path, "r") as f:
        x, y = f["inputs"], f["labels"]
        assert x.dtype == np.uint8, x.dtype
        assert x.ndim == 4 and x.shape[1:] == (1, h, w), x.shape
        assert np.issubdtype(y.dtype, np.integer) and y.shape == (x.shape[0],), y.shape
        assert x.chunks is None and x.compression is None, "inputs should be contiguous and uncompressed"
        assert abs(float(x.attrs["scale"]) - 1 / 255) < 1e-9
        mean, std = np.atleast_1d(x.attrs["mean"]), np.atleast_1d(x.attrs["std"])
        if i == 0:
            mean0, std0 = mean, std
        assert np.array_equal(mean, mean0) and np.array_equal(std, std0), "attributes differ across shards"
        assert int(y.attrs["num_classes"]) == 10
        xs.append(x[...])
        ys.append(y[...])
x, y = np.concatenate(xs), np.concatenate(ys)
assert x.shape[0] == n, (x.shape, n)
assert np.array_equal(x[0], images[0]), "sample 0 differs"
assert np.array_equal(x, images), "images differ"
assert np.array_equal(np.bincount(y, minlength=10), np.bincount(labels, minlength=10)), "label histogram differs"
assert np.array_equal(y, labels), "labels differ"
pix = images.astype(np.float64) / 255
assert np.allclose(mean0, [pix.mean()], rtol=1e-5), (mean0, pix.mean())
assert np.allclose(std0, [pix.std()], rtol=1e-4), (std0, pix.std())
print(f"ok: {len(shards)} shards, {n} samples, histogram {np.bincount(y).tolist()}, mean {mean0}, std {std0}")
