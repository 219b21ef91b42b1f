#!/usr/bin/env python3
"""Writes the Hugging Face Llama fixture of tests/fixtures/hf/ with transformers (the venv's
python: bench/.venv/bin/python tools/interop/make_llama_fixtures.py [OUT_DIR]).

- llama-tiny/: a random LlamaForCausalLM with grouped-query attention (2 layers, hidden 32,
  4 heads over 2 kv heads, intermediate 80, vocab 100, rope_theta 10000, Llama 3.1's rope scaling
  with factor 8, rms_norm_eps 1e-5, untied head, seed 0; RMSNorm weights perturbed off 1), saved
  by save_pretrained (model.safetensors, config.json).
- llama-reference.json: the token ids (3 windows of 32 and the last target), the mean
  next-token loss transformers computes over them, the library versions; llama-logits.npy:
  transformers' logits (32, 100) f32 of the first window.
Small (< 100 KB): the CI test reads these with Debian's numpy and h5py only.
"""
import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

T, WINDOWS, VOCAB = 32, 3, 100


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                         initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # RMSNorm weights off their init of 1
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures", "hf")
    model = tiny_llama()
    shutil.rmtree(os.path.join(out, "llama-tiny"), ignore_errors=True)
    model.save_pretrained(os.path.join(out, "llama-tiny"), safe_serialization=True)
    ids = np.random.default_rng(1).integers(0, VOCAB, WINDOWS * T + 1).tolist()
    x = torch.tensor(ids[:-1]).view(WINDOWS, T)
    y = torch.tensor(ids[1:]).view(WINDOWS, T)
    with torch.no_grad():
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
    np.save(os.path.join(out, "llama-logits.npy"), logits[0].numpy().astype(np.float32))
    with open(os.path.join(out, "llama-reference.json"), "w") as f:
        json.dump({"ids": ids, "t": T, "windows": WINDOWS, "vocab": VOCAB, "loss": float(loss),
                   "torch": torch.__version__, "transformers": transformers.__version__}, f, indent=1)
        f.write("\n")
    print(f"llama-tiny: loss {float(loss):.6f} (torch {torch.__version__}, transformers {transformers.__version__})")


if __name__ == "__main__":
    main()
