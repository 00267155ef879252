"""A GPT exported as a Hugging Face GPT-2 directory (mpifsdp/models/hf_gpt2.py) and loaded back. The logits
against transformers itself are checked by bench/interop_torch.py where torch is installed."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpifsdp import fully_shard
from mpifsdp.checkpoint import save
from mpifsdp.checkpoint.consolidated import read_safetensors_header, read_tensor, safetensors_header
from mpifsdp.models import GPT, GPTConfig
from mpifsdp.models.hf_gpt2 import export_hf_gpt2, hf_name, load_hf_gpt2

from support import shared_dir


def _config(tie):
    return GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=8, tie_weights=tie)


@pytest.mark.parametrize("tie", [True, False])
def test_export_and_load_back(comm, tmp_path, tie):
    root = shared_dir(comm, tmp_path)
    plain = GPT(_config(tie), seed=1)
    model = GPT(_config(tie), seed=1)
    fully_shard(model, comm, units=model.blocks)  # the export gathers a sharded model
    directory = export_hf_gpt2(f"{root}/hf", model)
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["tie_word_embeddings"] is tie
    assert (config["n_layer"], config["n_embd"], config["n_positions"]) == (2, 8, 16)
    header, _ = read_safetensors_header(directory / "model.safetensors")
    want = {hf_name(n): list(p.shape) for n, p in plain.named_parameters()}
    if not tie:  # torch's nn.Linear orientation: (out, in)
        want["lm_head.weight"] = [50, 8]
    assert {n: e["shape"] for n, e in header.items()} == want
    back = load_hf_gpt2(directory)
    tokens = np.arange(12).reshape(2, 6) % 50
    assert np.array_equal(back(tokens).data, plain(tokens).data)


def test_the_config_travels_in_the_metadata_and_gpt2_needs_biases(tmp_path):
    directory = export_hf_gpt2(tmp_path / "hf", GPT(_config(True), seed=1))
    raw = (directory / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert json.loads(header["__metadata__"]["mpifsdp_gpt_config"])["n_embd"] == 8
    no_bias = GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=8, bias=False)
    with pytest.raises(ValueError, match="biases"):
        export_hf_gpt2(tmp_path / "nb", GPT(no_bias, seed=1))


def test_command_line_exports_a_train_gpt_checkpoint(comm, tmp_path):
    if comm.size > 1:
        pytest.skip("drives its own process: runs in the plain-pytest pass of make test")
    config = _config(False)
    model = GPT(config, seed=3)
    fully_shard(model, comm, units=model.blocks)
    save(tmp_path / "ck", model, extra={"config": dataclasses.asdict(config)})
    command = [sys.executable, "-m", "mpifsdp", "export", str(tmp_path / "ck"), str(tmp_path / "hf")]
    done = subprocess.run([*command, "--format", "hf-gpt2"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    tokens = np.arange(12).reshape(2, 6) % 50
    assert np.array_equal(load_hf_gpt2(tmp_path / "hf")(tokens).data, GPT(config, seed=3)(tokens).data)
    again = subprocess.run([*command, "--format", "hf-gpt2"], capture_output=True, text=True)
    assert again.returncode == 1 and "pass --force" in again.stderr
    save(tmp_path / "odd", model, extra={"config": {**dataclasses.asdict(config), "bogus": 1}})
    odd = [sys.executable, "-m", "mpifsdp", "export", str(tmp_path / "odd"), str(tmp_path / "hf2")]
    done = subprocess.run([*odd, "--format", "hf-gpt2"], capture_output=True, text=True)  # a traceback before
    assert done.returncode == 1 and "has fields GPTConfig does not: ['bogus']" in done.stderr, done.stderr


def _edited_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize(
    "config_text, message",
    [
        ("{not json", "config.json is not JSON"),  # was a raw JSONDecodeError
        ("[1, 2]", "holds a JSON list, not a GPT-2 config"),  # was a TypeError
        ('{"n_layer": 2}', "has no vocab_size, n_positions, n_head, n_embd"),  # was a KeyError
        (None, "config.json does not exist"),
    ],
)
def test_a_malformed_config_is_named(tmp_path, config_text, message):
    directory = export_hf_gpt2(tmp_path / "hf", GPT(_config(True), seed=1))
    if config_text is None:
        (directory / "config.json").unlink()
    else:
        (directory / "config.json").write_text(config_text)
    with pytest.raises(ValueError, match=message):
        load_hf_gpt2(directory)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"n_layer": 1}, r"holds 12 tensors the model of config.json has not \(transformer.h.1"),
        ({"n_layer": 3}, "has no transformer.h.2.ln_1.weight"),
        (
            {"n_embd": 16, "n_head": 4},
            r"transformer.wte.weight is \[50, 8\], the model of config.json needs \[50, 16\]",
        ),
        ({"n_head": 3}, "n_embd=8 must be divisible by n_head=3"),
        ({"n_layer": "2"}, r"n_layer='2': sizes are integers"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings='yes' must be true or false"),
        (
            {"tie_word_embeddings": True},
            "config.json ties the head to the embedding, but lm_head.weight differs",
        ),
    ],
)
def test_a_config_that_contradicts_the_weights_is_refused(tmp_path, changes, message):
    directory = export_hf_gpt2(tmp_path / "hf", GPT(_config(False), seed=1))  # untied: lm_head saved
    _edited_config(directory, **changes)
    with pytest.raises(ValueError, match=message):
        load_hf_gpt2(directory)


@pytest.mark.parametrize(
    "changes, said",
    [
        ({"n_head": 4}, r"n_head=4 \(the weights': 2\)"),
        ({"layer_norm_epsilon": 1e-6}, r"ln_eps=1e-06 \(the weights': 1e-05\)"),
    ],
)
def test_a_config_that_fits_the_shapes_but_not_the_exported_model_is_refused(tmp_path, changes, said):
    """Another head count (or eps) over the same shapes loaded silently, its logits 1e-3 off: the
    weights' own config (the export's metadata) names the contradiction. Dropout may differ."""
    directory = export_hf_gpt2(tmp_path / "hf", GPT(_config(True), seed=1))
    _edited_config(directory, **changes)
    with pytest.raises(
        ValueError, match=r"config.json contradicts the config model.safetensors was exported with: " + said
    ):
        load_hf_gpt2(directory)
    _edited_config(directory, n_head=2, layer_norm_epsilon=1e-5, resid_pdrop=0.3)
    assert load_hf_gpt2(directory).config.n_head == 2


def _exported_tensors(tmp_path, model):
    """(the GPT-2 directory export_hf_gpt2 writes of `model`, its weights file's tensors by name)."""
    directory = export_hf_gpt2(tmp_path / "hf", model)
    header, start = read_safetensors_header(directory / "model.safetensors")
    with open(directory / "model.safetensors", "rb") as f:
        return directory, {n: read_tensor(f, e, start).reshape(e["shape"]) for n, e in header.items()}


def test_torch_buffers_and_a_tied_head_equal_to_the_embedding_are_accepted(tmp_path):
    """Older GPT-2 files hold the attention's mask buffers, and some a tied head: neither is a
    contradiction (a head that differs from the embedding is)."""
    plain = GPT(_config(True), seed=1)
    directory, tensors = _exported_tensors(tmp_path, plain)
    path = directory / "model.safetensors"
    mask = np.tril(np.ones((1, 1, 16, 16), np.float32))
    for head in (tensors["transformer.wte.weight"], tensors["transformer.wte.weight"] + 1):
        more = {**tensors, "transformer.h.0.attn.bias": mask, "lm_head.weight": head}
        entries = [(n, a.dtype, list(a.shape)) for n, a in more.items()]
        path.write_bytes(safetensors_header(entries) + b"".join(a.tobytes() for a in more.values()))
        if head is tensors["transformer.wte.weight"]:
            tokens = np.arange(12).reshape(2, 6) % 50
            assert np.array_equal(load_hf_gpt2(directory)(tokens).data, plain(tokens).data)
        else:
            with pytest.raises(
                ValueError, match="ties the head to the embedding, but lm_head.weight differs"
            ):
                load_hf_gpt2(directory)


# Every field transformers' GPT2Config (4.x) defines, and what a config.json's non-default value does.
GPT2_CONFIG_FIELDS = {
    "vocab_size": ("used", 60), "n_positions": ("used", 20), "n_embd": ("used", 12), "n_layer": ("used", 3),
    "n_head": ("used", 4), "n_inner": ("used", 20), "activation_function": ("used", "relu"),
    "layer_norm_epsilon": ("used", 0.01), "tie_word_embeddings": ("used", False),
    "resid_pdrop": ("inert", 0.3), "embd_pdrop": ("inert", 0.3), "attn_pdrop": ("inert", 0.3),
    "initializer_range": ("inert", 0.5), "summary_type": ("inert", "mean"),
    "summary_use_proj": ("inert", False),
    "summary_activation": ("inert", "tanh"), "summary_proj_to_labels": ("inert", False),
    "summary_first_dropout": ("inert", 0.5), "use_cache": ("inert", False), "bos_token_id": ("inert", 3),
    "eos_token_id": ("inert", 4), "reorder_and_upcast_attn": ("inert", True),
    "scale_attn_weights": ("refused", False), "scale_attn_by_inverse_layer_idx": ("refused", True),
}  # fmt: skip


@pytest.mark.parametrize("field", sorted(GPT2_CONFIG_FIELDS))
def test_every_gpt2_config_field_changes_the_model_as_transformers_does_or_is_refused(tmp_path, field):
    """Each field with a value other than GPT-2's default: a field we compute builds the GPT it
    describes (the same logits as that GPT built directly); a field that cannot change the function
    loads the same model; any other is refused by name (each was ignored silently: relu 0.97 off,
    layer_norm_epsilon=0.01 0.85 off, scale_attn_weights=False 1.99 off, n_inner a broadcast error)."""
    kind, value = GPT2_CONFIG_FIELDS[field]
    base = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=8, tie_weights=True)
    ours = {"vocab_size": "vocab_size", "n_positions": "block_size", "n_embd": "n_embd", "n_layer": "n_layer",
            "n_head": "n_head", "n_inner": "mlp_hidden", "layer_norm_epsilon": "ln_eps",
            "tie_word_embeddings": "tie_weights", "activation_function": "activation"}  # fmt: skip
    mapped = {"relu": "relu"}.get(value, value) if field == "activation_function" else value
    config = dataclasses.replace(base, **{ours[field]: mapped}) if kind == "used" else base
    model = GPT(config, seed=4)
    directory = export_hf_gpt2(tmp_path / "hf", model)
    _edited_config(directory, **{field: value})
    if kind == "refused":
        with pytest.raises(ValueError, match=f"cannot compute: {field}={value!r}"):
            load_hf_gpt2(directory)
        return
    loaded = load_hf_gpt2(directory)
    tokens = np.arange(12).reshape(2, 6) % config.vocab_size
    assert loaded.config == config and np.array_equal(loaded(tokens).data, model(tokens).data)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"activation_function": "gelu"}, "its GELU is the tanh form; transformers' 'gelu' is the erf form"),
        ({"activation_function": "silu"}, "activation_function='silu'"),
        ({"rotary_dim": 16}, "rotary_dim=16: a field mpifsdp does not know"),
    ],
)
def test_activations_mpifsdp_cannot_compute_and_unknown_fields_are_refused(tmp_path, changes, message):
    directory = export_hf_gpt2(tmp_path / "hf", GPT(_config(True), seed=1))
    _edited_config(directory, **changes)
    with pytest.raises(ValueError, match=message):
        load_hf_gpt2(directory)


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_half_precision_files_load_into_the_models_dtype(tmp_path, dtype):
    """A float16 or bfloat16 model.safetensors (bfloat16 was KeyError: 'BF16'): values widened exactly."""
    plain = GPT(_config(True), seed=1)
    directory, tensors = _exported_tensors(tmp_path, plain)
    path = directory / "model.safetensors"
    if dtype == "F16":
        halves = {n: a.astype(np.float16) for n, a in tensors.items()}
        raw, widened = (
            {n: h.tobytes() for n, h in halves.items()},
            {n: h.astype(np.float32) for n, h in halves.items()},
        )
    else:  # bfloat16: the top 16 bits of each float32 (truncated)
        bits = {n: (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16) for n, a in tensors.items()}
        raw = {n: b.astype("<u2").tobytes() for n, b in bits.items()}
        widened = {n: (b.astype(np.uint32) << 16).view(np.float32) for n, b in bits.items()}
    entries = [(n, np.dtype(np.float16), list(a.shape)) for n, a in tensors.items()]  # 2 bytes each
    head = safetensors_header(entries)
    if dtype == "BF16":  # our writer knows no bfloat16: name it in the header, with the halved sizes
        text = json.loads(head[8:])
        offset = 0
        for name, _, shape in entries:
            size = 2 * int(np.prod(shape))
            text[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
        body = json.dumps(text).encode()
        head = len(body).to_bytes(8, "little") + body
    path.write_bytes(head + b"".join(raw.values()))
    loaded = load_hf_gpt2(directory, dtype=np.float64)
    for name, p in loaded.named_parameters():
        assert p.data.dtype == np.float64 and np.array_equal(p.data, widened[hf_name(name)]), name


def test_a_tokenizer_that_cannot_serve_the_export_is_named_before_anything_is_written(comm, tmp_path):
    """tokenizer= a typo, a file that is no tokenizer, or one of another vocabulary: found (on rank 0
    only) after the weights were written, or not at all. Now on every rank, before a byte is written."""
    root = shared_dir(comm, tmp_path)
    model = GPT(_config(True), seed=1)  # a 50-token vocabulary
    fully_shard(model, comm, units=model.blocks)

    def write(name, content):
        path = f"{root}/{name}"
        if comm.rank == 0:
            with open(path, "w") as f:
                f.write(content)
        comm.barrier()
        return path

    wide = json.dumps({"model": {"type": "BPE", "vocab": {"a": 0, "b": 60}}})
    cases = [
        (f"{root}/tokenizr.json", "no such file"),
        (write("notes.txt", "just notes"), "is not a tokenizer.json"),
        (write("other.json", json.dumps({"version": "1.0"})), "it has no model.vocab"),
        (write("wide.json", wide), "its ids reach 60, the model's vocabulary holds 50"),
    ]
    for tokenizer, said in cases:
        with pytest.raises(ValueError, match=said):
            export_hf_gpt2(f"{root}/hf", model, tokenizer=tokenizer)
        assert not Path(f"{root}/hf").exists()  # nothing written
    fits = write("fits.json", json.dumps({"model": {"type": "BPE", "vocab": {"a": 0, "b": 49}}}))
    export_hf_gpt2(f"{root}/hf", model, tokenizer=fits)
    assert json.loads(open(f"{root}/hf/tokenizer.json").read())["model"]["vocab"]["b"] == 49
