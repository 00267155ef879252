"""mpifsdp against transformers' own results, through fixtures tests/fixtures/make_hf_fixtures.py made
with transformers and torch (too heavy for make test's install): logits of GPT-2 variants, and the
tokens transformers' pipeline generated from an exported mpifsdp GPT."""

import json
from pathlib import Path

import numpy as np
import pytest

from mpifsdp.models.hf_gpt2 import byte_tokenizer, export_hf_gpt2, load_hf_gpt2

FIXTURES = Path(__file__).parents[2] / "fixtures" / "hf"
SCRIPT_DIR = str(FIXTURES.parent)
VARIANTS = sorted(p.name for p in FIXTURES.iterdir() if (p / "logits.json").is_file())


def test_every_variant_the_script_makes_is_here():
    import sys

    sys.path.insert(0, SCRIPT_DIR)
    try:
        import make_hf_fixtures
    finally:
        sys.path.remove(SCRIPT_DIR)
    assert VARIANTS == sorted(make_hf_fixtures.VARIANTS), "run tests/fixtures/make_hf_fixtures.py again"


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_transformers_gpt2_loads_with_its_logits(variant):
    """Each GPT2Config variant transformers saved (activations, epsilon, n_inner, untied; float64,
    float16 and bfloat16 files) gives transformers' logits: float32 to a few ulps of the largest
    logit, float64 to a few float64 ulps (the same arithmetic, in another order)."""
    fixture = json.loads((FIXTURES / variant / "logits.json").read_text())
    want = np.array(fixture["logits"])
    dtype = np.float64 if fixture["dtype"] == "torch.float64" else np.float32
    model = load_hf_gpt2(FIXTURES / variant, dtype=dtype)
    tokens = np.array([[3, 14, 15, 9, 2, 6, 5, 35], [8, 9, 7, 9, 3, 2, 3, 8]])
    got = model(tokens).data.astype(np.float64)
    # layers of sums of n_embd products, each rounding once: 64 ulps of the dtype, relative to the largest
    bound = 64 * np.finfo(dtype).eps * np.abs(want).max()
    assert np.abs(got - want).max() <= bound, (variant, np.abs(got - want).max(), bound)


def test_transformers_generates_the_tokens_mpifsdp_generates_from_an_export(tmp_path):
    """The exported byte-level GPT (tokenizer.json included) in transformers' pipeline: its greedy
    continuation of each prompt is the one GPT.generate(temperature=0) gives here."""
    directory = FIXTURES / "bytes-gpt"
    model = load_hf_gpt2(directory)
    for run in json.loads((directory / "generation.json").read_text()):
        prompt = np.frombuffer(run["prompt"].encode(), dtype=np.uint8).astype(np.int64)[None]
        ours = model.generate(prompt, max_new_tokens=len(run["tokens"]) - prompt.shape[1], temperature=0)
        assert ours[0].tolist() == run["tokens"], (run["generated_text"], bytes(ours[0].tolist()))
    again = export_hf_gpt2(tmp_path / "again", model)  # the tokenizer files are the ones it was made with
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (directory / name).read_bytes(), name


def test_the_byte_tokenizer_maps_every_byte_to_its_own_id():
    vocab = byte_tokenizer()["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(256)) and len(set(vocab)) == 256


def test_the_loader_knows_every_field_transformers_writes():
    """Each field of transformers' GPT2Config (recorded by the script) is read into the model,
    known not to change its function, or refused unless it has our one value: none is ignored
    silently, none refuses a plain GPT-2 config.json."""
    from mpifsdp.models import hf_gpt2

    fields = json.loads((FIXTURES / "gpt2_config_fields.json").read_text())
    assert not sorted(set(fields) - hf_gpt2.KNOWN), "fields the loader does not know"
