"""Oracle for the C++ reader: writes datasets with h5py (as a user would) plus the values numpy
expects Dataset::read to return, in OUT/expected.h5. Usage: write_dataset.py OUT"""
import os
import sys

import h5py
import numpy as np

out = sys.argv[1]
rng = np.random.default_rng(1234)
os.makedirs(os.path.join(out, "u8"), exist_ok=True)
os.makedirs(os.path.join(out, "f32"), exist_ok=True)

# u8 images in two shards, int64 labels, per-channel mean/std, float64 scale attribute.
n, shape = 50, (3, 4, 5)
x = rng.integers(0, 256, size=(n,) + shape, dtype=np.uint8)
y = rng.integers(0, 6, size=n).astype(np.int64)
scale, mean, std = 1.0 / 255.0, np.array([0.5, 0.4, 0.3], np.float32), np.array([0.2, 0.25, 0.3], np.float32)
for i, (lo, hi) in enumerate([(0, 23), (23, n)]):
    with h5py.File(os.path.join(out, "u8", f"part-{i}.h5"), "w") as f:
        d = f.create_dataset("inputs", data=x[lo:hi])
        d.attrs["scale"] = scale
        d.attrs["mean"] = mean
        d.attrs["std"] = std
        f.create_dataset("labels", data=y[lo:hi]).attrs["num_classes"] = 6

# f32 features in one file, uint16 labels, no attributes (identity normalisation).
xf = rng.standard_normal((30, 7)).astype(np.float32)
yf = rng.integers(0, 4, size=30).astype(np.uint16)
with h5py.File(os.path.join(out, "f32", "feat.h5"), "w") as f:
    f.create_dataset("inputs", data=xf)
    f.create_dataset("labels", data=yf)

# A fletcher32-checked file whose third chunk (samples 8..11) has a flipped byte: opening
# without loading succeeds, reading a batch that touches the chunk is an Input error.
os.makedirs(os.path.join(out, "damaged"), exist_ok=True)
damaged = os.path.join(out, "damaged", "chunks.h5")
with h5py.File(damaged, "w") as f:
    f.create_dataset("inputs", data=x[:16], chunks=(4,) + shape, fletcher32=True)
    f.create_dataset("labels", data=y[:16])
    offset = f["inputs"].id.get_chunk_info(2).byte_offset
with open(damaged, "r+b") as f:
    f.seek(offset + 5)
    byte = f.read(1)[0]
    f.seek(offset + 5)
    f.write(bytes([byte ^ 0xFF]))

idx_u8 = np.array([49, 0, 22, 23, 24, 7, 7, 31], np.int64)
idx_f32 = np.array([29, 3, 4, 5, 0], np.int64)
expect_u8 = (x[idx_u8].astype(np.float64) * scale - mean[None, :, None, None]) / std[None, :, None, None]
with h5py.File(os.path.join(out, "expected.h5"), "w") as f:
    f["u8/indices"] = idx_u8
    f["u8/x"] = expect_u8.astype(np.float32)
    f["u8/y"] = y[idx_u8].astype(np.int32)
    f["f32/indices"] = idx_f32
    f["f32/x"] = xf[idx_f32]
    f["f32/y"] = yf[idx_f32].astype(np.int32)
print("wrote", out)
