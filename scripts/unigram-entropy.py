#!/usr/bin/env python3
"""The baseline a language model must beat: the cross-entropy (nats/token) of the validation
tokens under the training split's unigram distribution, with add-one smoothing over the whole
vocabulary. A model that ignores context does no better than this.

Usage: python3 scripts/unigram-entropy.py TRAIN.h5 [TRAIN2.h5 ...] VAL.h5
"""
import sys

import h5py
import numpy as np


def tokens(path):
    with h5py.File(path, "r") as f:
        return f["tokens"][...].astype(np.int64), int(f.attrs["vocab_size"])


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__.strip().splitlines()[-1])
    *train_paths, val_path = argv[1:]
    val, vocab = tokens(val_path)
    counts = np.zeros(vocab, dtype=np.int64)
    n_train = 0
    for p in train_paths:
        t, v = tokens(p)
        if v != vocab:
            sys.exit(f"{p}: vocab_size {v} differs from {val_path}'s {vocab}")
        counts += np.bincount(t, minlength=vocab)
        n_train += t.size
    p = (counts + 1) / (n_train + vocab)  # add-one smoothing
    h = -np.log(p[val]).mean()
    print(f"train {n_train} tokens, val {val.size} tokens, vocab {vocab}")
    print(f"unigram cross-entropy of val under train (add-one): {h:.4f} nats/token"
          f"  (perplexity {np.exp(h):.1f})")


if __name__ == "__main__":
    main(sys.argv)
