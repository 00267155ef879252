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
import re
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
    """A GPT (single process) from a GPT-2 directory: ours, or a Hugging Face one with biases.

    A config.json that is not one, or that contradicts the weights (another number of layers, other
    sizes), is refused by name: a model built from it would load silently wrong."""
    directory = Path(directory)
    model = GPT(read_hf_config(directory / CONFIG), dtype=dtype, device=device)
    _load_weights(model, directory / WEIGHTS)
    return model


SIZES = {"vocab_size": "vocab_size", "n_positions": "block_size", "n_layer": "n_layer", "n_head": "n_head"}
SIZES["n_embd"] = "n_embd"  # GPT-2's name -> ours
BUFFERS = re.compile(r"transformer\.h\.\d+\.attn\.(masked_)?bias")  # torch buffers old GPT-2 files hold


def read_hf_config(path: Path) -> GPTConfig:
    """Our GPTConfig from a GPT-2 config.json, each problem named with the file."""
    try:
        hf = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"{path} does not exist: a GPT-2 directory holds config.json and {WEIGHTS}"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not JSON ({exc})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{path} holds a JSON {type(hf).__name__}, not a GPT-2 config (an object)")
    missing = [k for k in SIZES if k not in hf]
    if missing:
        raise ValueError(f"{path} has no {', '.join(missing)}: a GPT-2 config.json names every size")
    tie = hf.get("tie_word_embeddings", True)
    if not isinstance(tie, bool):
        raise ValueError(f"{path}: tie_word_embeddings={tie!r} must be true or false")
    try:
        return GPTConfig(**{ours: hf[theirs] for theirs, ours in SIZES.items()}, tie_weights=tie, bias=True)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _load_weights(model: GPT, path: Path):
    """Every parameter from the file, whose tensors must be exactly the model's (torch's buffers
    aside) with the model's shapes; a tied model's saved head must equal the embedding."""
    header, start = read_safetensors_header(path)
    ours = {hf_name(n): (n, p) for n, p in model.named_parameters()}
    tied_head = "lm_head.weight" if model.config.tie_weights and "lm_head.weight" in header else None
    extra = sorted(n for n in header if n not in ours and not BUFFERS.fullmatch(n) and n != tied_head)
    if extra:
        raise ValueError(
            f"{path} holds {len(extra)} tensors the model of config.json has not ({', '.join(extra[:3])}"
            f"{', ...' if len(extra) > 3 else ''}): config.json contradicts the weights"
        )
    with open(path, "rb") as f:
        for theirs, (name, p) in ours.items():
            p.data[...] = _read(f, header, start, theirs, p.shape, transposed=name == "lm_head.weight")
        embedding = model.wte.weight
        if tied_head is not None and not np.array_equal(
            _read(f, header, start, tied_head, embedding.shape, transposed=False), embedding.data
        ):
            raise ValueError(
                f"{path}: config.json ties the head to the embedding, but lm_head.weight differs"
            )


def _read(f, header: dict, start: int, name: str, shape: tuple, transposed: bool):
    want = list(shape[::-1] if transposed else shape)
    entry = header.get(name)
    if entry is None:
        raise ValueError(f"{f.name} has no {name}, which the model of config.json has")
    if entry["shape"] != want:
        raise ValueError(
            f"{f.name}: {name} is {entry['shape']}, the model of config.json needs {want}: config.json "
            "contradicts the weights"
        )
    value = read_tensor(f, entry, start).reshape(want)
    return value.T if transposed else value
