"""Our GPT as a Hugging Face GPT-2 directory and back: `config.json` + `model.safetensors` that
`transformers.GPT2LMHeadModel.from_pretrained(dir)` loads (bench/interop_torch.py checks the logits).

The layouts agree except for names and one orientation: GPT-2's Conv1D weights are (in, out), as our
Linear's, so they go as they are; an untied head is torch's nn.Linear, (out, in), so it is transposed.
GPT-2 always has biases and the tanh GELU ("gelu_new"), as our GPT with bias=True. The model config
also travels in the safetensors metadata (`mpifsdp_gpt_config`), so the file alone rebuilds the model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from mpifsdp import full_state_dict
from mpifsdp.base.files import atomic_file
from mpifsdp.checkpoint.consolidated import read_safetensors_header, read_tensor, safetensors_header
from mpifsdp.fsdp.build import sharded_model

from .gpt import GPT, GPTConfig

WEIGHTS, CONFIG = "model.safetensors", "config.json"


def hf_name(name: str) -> str:
    """Our parameter name -> GPT-2's ('blocks.3.attn.c_attn.weight' -> 'transformer.h.3.attn...')."""
    if name.startswith("blocks."):
        return "transformer.h." + name[len("blocks.") :]
    return name if name.startswith("lm_head.") else "transformer." + name


def hf_config(config: GPTConfig) -> dict:
    if not config.bias:
        raise ValueError(
            "GPT-2 has biases in every LayerNorm and projection: export a GPT built with bias=True"
        )
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": config.tie_weights,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "bos_token_id": None,
        "eos_token_id": None,  # GPT-2's 50256 is outside a byte-level vocabulary
    }


def export_hf_gpt2(directory, model: GPT) -> Path:
    """Write `directory`/config.json and model.safetensors (collective when `model` is sharded: the
    parameters are gathered, and rank 0 writes). Written to a temporary name and renamed into place."""
    directory = Path(directory)
    hf = hf_config(model.config)
    state = full_state_dict(model)  # every parameter by our name, on every rank
    sharded = sharded_model(model)
    if sharded is not None and sharded.comm.rank != 0:
        sharded.comm.barrier()
        return directory
    tensors = {hf_name(n): (a.T if n == "lm_head.weight" else a) for n, a in state.items()}
    entries = [(n, np.dtype(a.dtype), list(a.shape)) for n, a in tensors.items()]
    metadata = {"mpifsdp_gpt_config": json.dumps(dataclasses.asdict(model.config))}
    directory.mkdir(parents=True, exist_ok=True)
    with atomic_file(directory / WEIGHTS) as f:
        f.write(safetensors_header(entries, metadata))
        for array in tensors.values():
            f.write(np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes())
    with atomic_file(directory / CONFIG) as f:
        f.write((json.dumps(hf, indent=2) + "\n").encode())
    if sharded is not None:
        sharded.comm.barrier()
    return directory


def load_hf_gpt2(directory, dtype=np.float32, device: str = "cpu") -> GPT:
    """A GPT (single process) from a GPT-2 directory: ours, or a Hugging Face one with biases."""
    directory = Path(directory)
    hf = json.loads((directory / CONFIG).read_text())
    config = GPTConfig(
        vocab_size=hf["vocab_size"],
        block_size=hf["n_positions"],
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        n_embd=hf["n_embd"],
        tie_weights=hf.get("tie_word_embeddings", True),
        bias=True,
    )
    model = GPT(config, dtype=dtype, device=device)
    header, start = read_safetensors_header(directory / WEIGHTS)
    with open(directory / WEIGHTS, "rb") as f:
        for name, p in model.named_parameters():
            entry = header.get(hf_name(name))
            if entry is None:
                raise ValueError(f"{directory / WEIGHTS} has no {hf_name(name)} (for our {name})")
            value = read_tensor(f, entry, start).reshape(entry["shape"])
            p.data[...] = value.T if name == "lm_head.weight" else value
    return model
