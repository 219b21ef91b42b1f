#!/usr/bin/env python3
"""Writes the Hugging Face GPT-2 fixtures of tests/fixtures/hf/ with transformers (the venv's
python: bench/.venv/bin/python tools/interop/make_gpt2_fixtures.py [OUT_DIR]).

- gpt2-tiny/: a random GPT2LMHeadModel (2 layers, n_embd 32, 4 heads, n_positions 32, vocab 100,
  gelu_new, layer_norm_epsilon 1e-3, seed 0; weights and LayerNorms perturbed so every tensor
  matters), saved by save_pretrained (model.safetensors, config.json).
- gpt2-tiny-sharded/: the same model in bfloat16, saved with max_shard_size 20KB (shards and
  model.safetensors.index.json).
- reference.json: the token ids (4 windows of 32 tokens and the last target: 129 ids), the mean
  next-token loss transformers computes over the 4 windows (f32 model), the library versions;
  logits.npy: transformers' logits (32, 100) f32 of the first window.
Everything stays small (< 300 KB): the CI tests read these with Debian's numpy and h5py only.
"""
import copy
import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

T, WINDOWS = 32, 4


def tiny_model(seed=0, activation="gelu_new", eps=1e-3, tie=True, vocab=100):
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_positions=T, n_embd=32, n_layer=2, n_head=4,
                        activation_function=activation, layer_norm_epsilon=eps, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.1,
                        tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # LayerNorms and biases off their 1 / 0 init
            p.add_(torch.randn_like(p) * (0.2 if "ln_" in name else 0.05))
    return model


def reference(model, ids):
    """(mean next-token loss over the windows, logits (WINDOWS, T, V) f32) by transformers."""
    x = torch.tensor(ids[:-1]).view(WINDOWS, T)
    y = torch.tensor(ids[1:]).view(WINDOWS, T)
    with torch.no_grad():
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return float(loss), logits.numpy().astype(np.float32)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures", "hf")
    os.makedirs(out, exist_ok=True)
    model = tiny_model()
    for sub in ("gpt2-tiny", "gpt2-tiny-sharded"):
        shutil.rmtree(os.path.join(out, sub), ignore_errors=True)
    model.save_pretrained(os.path.join(out, "gpt2-tiny"), safe_serialization=True)
    # A copy: Module.to converts in place, and the reference below is the f32 model's.
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(os.path.join(out, "gpt2-tiny-sharded"),
                                                            safe_serialization=True, max_shard_size="20KB")
    for sub in ("gpt2-tiny", "gpt2-tiny-sharded"):  # not read by Strata
        gen = os.path.join(out, sub, "generation_config.json")
        if os.path.exists(gen):
            os.remove(gen)
    ids = torch.randint(0, model.config.vocab_size, (WINDOWS * T + 1,),
                        generator=torch.Generator().manual_seed(1)).tolist()
    loss, logits = reference(model, ids)
    np.save(os.path.join(out, "logits.npy"), logits[0])
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump({"tokens": ids, "seq_len": T, "windows": WINDOWS, "loss": loss,
                   "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                                "numpy": np.__version__}}, f, indent=1)
        f.write("\n")
    print(f"fixtures in {out}: loss {loss:.6f}")


if __name__ == "__main__":
    main()
