"""Our GPT exported as a Hugging Face GPT-2 directory, loaded by transformers.GPT2LMHeadModel: the same
logits (relative error <= 1e-5 in float32), tied and untied heads, and a Hugging Face directory loaded
back into our GPT. Runs only where torch and transformers are installed (neither is a dependency).
    python bench/interop_torch.py [--out out/hf-gpt2]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="out/hf-gpt2")
    args = ap.parse_args()
    try:
        import torch
        from transformers import GPT2LMHeadModel
    except ImportError as exc:
        print(json.dumps({"bench": "interop_torch", "skipped": f"needs torch and transformers ({exc})"}))
        return 0
    from mpifsdp.models import GPT, GPTConfig
    from mpifsdp.models.hf_gpt2 import export_hf_gpt2, load_hf_gpt2

    worst = 0.0
    for tie in (True, False):
        config = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128, tie_weights=tie)
        ours = GPT(config, seed=7)
        directory = export_hf_gpt2(f"{args.out}-{'tied' if tie else 'untied'}", ours)
        theirs = GPT2LMHeadModel.from_pretrained(directory).eval()
        tokens = np.random.default_rng(0).integers(0, 256, (3, 64))
        want = ours(tokens).data.astype(np.float64)
        with torch.no_grad():
            got = theirs(torch.from_numpy(tokens)).logits.numpy().astype(np.float64)
        rel = float(np.abs(got - want).max() / np.abs(want).max())
        back = load_hf_gpt2(directory)  # and their directory into ours again
        same = bool(np.array_equal(back(tokens).data, ours(tokens).data))
        print(json.dumps({"tied": tie, "max_relative_logit_error": rel, "round_trip_identical": same}))
        worst = max(worst, rel)
    print(json.dumps({"bench": "interop_torch", "max_relative_logit_error": worst, "ok": worst <= 1e-5}))
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
