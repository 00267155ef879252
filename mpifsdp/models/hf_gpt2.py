"""Our GPT as a Hugging Face GPT-2 directory and back: `config.json` + `model.safetensors` that
`transformers.GPT2LMHeadModel.from_pretrained(dir)` loads (bench/interop_torch.py checks the logits).

The layouts agree except for names and one orientation: GPT-2's Conv1D weights are (in, out), as our
Linear's, so they go as they are; an untied head is torch's nn.Linear, (out, in), so it is transposed.
GPT-2 always has biases and the tanh GELU ("gelu_new"), as our GPT with bias=True. The model config
also travels in the safetensors metadata (`mpifsdp_gpt_config`), so the file alone rebuilds the model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from pathlib import Path

import numpy as np

from mpifsdp import full_state_dict
from mpifsdp.base.files import atomic_file
from mpifsdp.checkpoint.consolidated import (
    read_safetensors_header,
    read_tensor,
    safetensors_header,
    safetensors_metadata,
)
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
        "n_inner": config.mlp_hidden or None,
        "activation_function": {"gelu_tanh": "gelu_new", "relu": "relu"}[config.activation],
        "layer_norm_epsilon": config.ln_eps,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "tie_word_embeddings": config.tie_weights,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "bos_token_id": None,
        "eos_token_id": None,  # GPT-2's 50256 is outside a byte-level vocabulary
    }


def export_hf_gpt2(directory, model: GPT, tokenizer=None) -> Path:
    """Write `directory`/config.json and model.safetensors (collective when `model` is sharded: the
    parameters are gathered, and rank 0 writes). Written to a temporary name and renamed into place.

    tokenizer: a tokenizer.json of the user's (a path) to put beside them; by default a model with
    a 256-token vocabulary (train_gpt.py's byte tokens) gets the byte-level one (byte_tokenizer), so
    that `transformers.pipeline("text-generation", model=DIR)` runs as it is."""
    directory = Path(directory)
    hf = hf_config(model.config)
    sharded = sharded_model(model)
    # checked before a byte is written, on every rank: a typo found after the weights lost the export
    check = functools.partial(_tokenizer_text, tokenizer, model.config)
    tokenizer_text = (
        check()
        if sharded is None
        else sharded.comm.run_everywhere(check, "export_hf_gpt2", (ValueError,), ValueError)
    )
    state = full_state_dict(model)  # every parameter by our name, on every rank
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
    _write_tokenizer(directory, model.config, tokenizer_text)
    if sharded is not None:
        sharded.comm.barrier()
    return directory


def byte_tokenizer() -> dict:
    """A `tokenizers` tokenizer.json whose ids are the bytes of the UTF-8 text (id b = byte b), the
    vocabulary train_gpt.py trains on: byte-level BPE without merges, GPT-2's byte-to-character map."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    model = {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": False,
        "vocab": {chars[b]: b for b in range(256)},
        "merges": [],
    }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": level,
        "post_processor": None,
        "decoder": level,
        "model": model,
    }


def _tokenizer_text(tokenizer, config: GPTConfig) -> bytes | None:
    """The tokenizer.json to write: the user's file, checked (a tokenizers JSON whose ids fit the
    model's vocabulary), or the byte-level one for a 256-token vocabulary; None: none is known."""
    if tokenizer is None:
        return json.dumps(byte_tokenizer()).encode() if config.vocab_size == 256 else None
    where = f"export_hf_gpt2: tokenizer={str(tokenizer)!r}"
    try:
        text = Path(tokenizer).read_bytes()
        spec = json.loads(text)
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file (give the path of a tokenizer.json)") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where} is not a tokenizer.json ({exc})") from None
    model = spec.get("model") if isinstance(spec, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if not isinstance(vocab, (dict, list)):
        raise ValueError(f"{where} is not a tokenizers tokenizer.json (it has no model.vocab)")
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))  # Unigram: by place
    ids += [t.get("id") for t in spec.get("added_tokens") or [] if isinstance(t, dict)]
    largest = max((i for i in ids if isinstance(i, int)), default=-1)
    if largest >= config.vocab_size:
        raise ValueError(
            f"{where}: its ids reach {largest}, the model's vocabulary holds {config.vocab_size} "
            "(a tokenizer of another model)"
        )
    return text


def _write_tokenizer(directory: Path, config: GPTConfig, text: bytes | None):
    """tokenizer.json and the tokenizer_config.json that makes transformers' AutoTokenizer load it."""
    if text is None:
        return  # no tokenizer is known for this vocabulary: the user passes theirs
    with atomic_file(directory / "tokenizer.json") as f:
        f.write(text)
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config.block_size}
    with atomic_file(directory / "tokenizer_config.json") as f:
        f.write((json.dumps(settings, indent=2) + "\n").encode())


def load_hf_gpt2(directory, dtype=np.float32, device: str = "cpu") -> GPT:
    """A GPT (single process) from a GPT-2 directory: ours, or a Hugging Face one with biases.

    A config.json that is not one, or that contradicts the weights (another number of layers, other
    sizes), is refused by name: a model built from it would load silently wrong."""
    directory = Path(directory)
    config = read_hf_config(directory / CONFIG)
    model = GPT(config, dtype=dtype, device=device)
    _load_weights(model, directory / WEIGHTS)  # shapes that contradict config.json are named there
    _agrees_with_export(config, directory)
    return model


def _agrees_with_export(config: GPTConfig, directory: Path):
    """Weights we exported carry the config they were trained with (`mpifsdp_gpt_config`); config.json
    must say the same in every field that changes the function (n_head over the same shapes computes
    other attention: silently wrong logits). A Hugging Face file has none: its shapes are checked."""
    saved = safetensors_metadata(directory / WEIGHTS).get("mpifsdp_gpt_config")
    if saved is None:
        return
    try:
        saved = json.loads(saved)
    except ValueError as exc:
        raise ValueError(
            f"{directory / WEIGHTS}: its mpifsdp_gpt_config metadata is not JSON ({exc})"
        ) from None
    mine = dataclasses.asdict(config)
    differ = [
        f"{k}={mine[k]!r} (the weights': {v!r})"
        for k, v in (saved.items() if isinstance(saved, dict) else ())
        if k in mine and k != "dropout" and mine[k] != v
    ]
    if differ:
        raise ValueError(
            f"{directory / CONFIG} contradicts the config {WEIGHTS} was exported with: {', '.join(differ)}; "
            f"mend config.json (the weights' own config is in the file's mpifsdp_gpt_config metadata)"
        )


SIZES = {"vocab_size": "vocab_size", "n_positions": "block_size", "n_layer": "n_layer", "n_head": "n_head"}
SIZES["n_embd"] = "n_embd"  # GPT-2's name -> ours
BUFFERS = re.compile(r"transformer\.h\.\d+\.attn\.(masked_)?bias")  # torch buffers old GPT-2 files hold
# transformers' activation names our MLP computes (gelu_new, gelu_pytorch_tanh and gelu_fast are all
# the tanh form); "gelu" (the erf form), "silu", "quick_gelu", ... are refused by name
ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
}
# Fields that cannot change what the model computes from given weights at inference: dropout
# rates (the loaded model is built with none), initialisation, the sequence-summary head's
# settings (GPT2DoubleHeadsModel only), token ids, caching, bookkeeping, the classification heads'
# problem_type. reorder_and_upcast_attn only moves a scale and upcasts float16 attention, and
# chunk_size_feed_forward only cuts the MLP's rows into pieces: the same function.
INERT = {
    "n_ctx",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "initializer_range",
    "summary_type",
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
    "summary_first_dropout",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "architectures",
    "model_type",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "task_specific_params",
    "_name_or_path",
    "reorder_and_upcast_attn",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "id2label",
    "label2id",
    "tokenizer_class",
    "prefix",
    "decoder_start_token_id",
    "chunk_size_feed_forward",
    "problem_type",
}
# Fields our GPT computes only at GPT-2's value: another one is refused, saying why.
FIXED = {
    "scale_attn_weights": (True, "mpifsdp's GPT always scales attention scores by 1/sqrt(head size)"),
    "scale_attn_by_inverse_layer_idx": (False, "mpifsdp's GPT does not scale scores by 1/(layer index + 1)"),
    "add_cross_attention": (False, "mpifsdp's GPT has no cross-attention"),
    "is_encoder_decoder": (False, "mpifsdp's GPT is a decoder only"),
}
# Fields read into our config besides the sizes; every field the loader knows, of the four kinds.
READ = ("n_inner", "activation_function", "layer_norm_epsilon", "tie_word_embeddings")
KNOWN = {*SIZES, *READ, *INERT, *FIXED}


def read_hf_config(path: Path) -> GPTConfig:
    """Our GPTConfig from a GPT-2 config.json, each problem named with the file. Every field either
    changes our model as it changes transformers' (sizes, n_inner, activation_function,
    layer_norm_epsilon, tie_word_embeddings), cannot change the function (INERT), or is refused
    unless it has the one value our GPT computes (FIXED); a field mpifsdp does not know is refused."""
    hf = _config_json(path)
    missing = [k for k in SIZES if k not in hf]
    if missing:
        raise ValueError(f"{path} has no {', '.join(missing)}: a GPT-2 config.json names every size")
    refused = [f"{k}={hf[k]!r}: {why}" for k, (want, why) in FIXED.items() if k in hf and hf[k] != want]
    refused += [
        f"{k}={hf[k]!r}: a field mpifsdp does not know (remove it if it cannot change the model)"
        for k in sorted(set(hf) - KNOWN)
    ]
    activation = hf.get("activation_function", "gelu_new")
    if activation not in ACTIVATIONS:
        refused.append(
            f"activation_function={activation!r}: mpifsdp's MLP computes {sorted(ACTIVATIONS)} (its GELU "
            "is the tanh form; transformers' 'gelu' is the erf form)"
        )
    if refused:
        raise ValueError(f"{path} describes a model mpifsdp's GPT cannot compute: " + "; ".join(refused))
    tie = hf.get("tie_word_embeddings", True)
    if not isinstance(tie, bool):
        raise ValueError(f"{path}: tie_word_embeddings={tie!r} must be true or false")
    try:
        return GPTConfig(
            **{ours: hf[theirs] for theirs, ours in SIZES.items()},
            tie_weights=tie,
            bias=True,
            activation=ACTIVATIONS[activation],
            mlp_hidden=hf.get("n_inner") or 0,
            ln_eps=hf.get("layer_norm_epsilon", 1e-5),
        )
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _config_json(path: Path) -> dict:
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
    return hf


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
    if entry["dtype"] == "BF16":  # the top half of a float32: widened exactly
        f.seek(start + entry["data_offsets"][0])
        half = np.frombuffer(f.read(2 * math.prod(want)), dtype="<u2")
        value = (half.astype(np.uint32) << 16).view(np.float32).reshape(want)
    else:
        value = read_tensor(f, entry, start).reshape(want)
    return value.T if transposed else value
