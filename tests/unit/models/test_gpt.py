"""The GPT end to end: gradients, shapes, sampling, and learning real text."""

import numpy as np
import pytest

from mpifsdp import no_grad
from mpifsdp.data import TextData, unigram_entropy
from mpifsdp.extend import check_grad
from mpifsdp.models import GPT, GPTConfig, MLPClassifier
from mpifsdp.optim.optimizers import AdamW

TINY = GPTConfig(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=8)


@pytest.mark.parametrize("tied", [True, False])
def test_gpt_gradients_end_to_end(tied, device, xp):
    cfg = GPTConfig(**{**TINY.__dict__, "tie_weights": tied})
    model = GPT(cfg, seed=0, dtype=np.float64, device=device)
    rng = np.random.default_rng(1)
    idx, targets = (xp.asarray(rng.integers(0, 11, (2, 5))) for _ in range(2))
    check_grad(lambda: model(idx, targets), model.parameters())


def test_mlp_classifier_gradients():
    model = MLPClassifier([5, 7, 3], activation="gelu", dtype=np.float64)
    x = np.random.default_rng(0).standard_normal((4, 5))
    check_grad(lambda: model(x, np.array([0, 2, 1, 2])), model.parameters())


def test_gpt_shapes_counts_and_sampling():
    model = GPT(TINY, seed=0)
    idx = np.zeros((3, 4), dtype=np.int64)
    assert model(idx).shape == (3, 4, 11)
    per_block = 2 * 2 * 8 + (8 * 24 + 24) + (8 * 8 + 8) + (8 * 32 + 32) + (32 * 8 + 8)
    assert model.num_params() == 11 * 8 + 6 * 8 + 2 * per_block + 2 * 8
    assert model.num_params(non_embedding=True) == model.num_params() - 6 * 8
    out = model.generate(idx[:, :2], max_new_tokens=7, top_k=3)
    assert out.shape == (3, 9) and out.max() < 11
    with pytest.raises(ValueError, match="sequence length 7 exceeds block_size 6"):
        model(np.zeros((1, 7), dtype=np.int64))


def test_tiny_gpt_learns_the_stdlib_corpus():
    """Val loss must end well below the unigram byte entropy: the model uses context."""
    data = TextData()
    entropy = unigram_entropy(data.splits["train"])
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
    model = GPT(cfg, seed=0)
    opt = AdamW(model, lr=3e-3, weight_decay=0.01)
    for step in range(300):
        x, y = data.global_batch("train", step, batch_size=16, block_size=32)
        loss = model(x, y)
        loss.backward()
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
    with no_grad():
        val = np.mean([model(*data.global_batch("val", s, 32, 32)).item() for s in range(4)])
    print(f"unigram entropy {entropy:.3f} nats, val loss after 300 steps {val:.3f}")
    assert val < entropy - 0.5, (val, entropy)


def test_evaluation_mode_turns_dropout_off_sharded_and_in_sampling(comm):
    """A GPT with dropout 0.1 in eval() gives the same validation loss twice, equal to the same weights
    with dropout off; train() turns dropout back on; generate samples in eval mode and restores the mode."""
    import mpifsdp

    config = GPTConfig(**{**TINY.__dict__, "dropout": 0.1})
    with_dropout, without = GPT(config, seed=3, dtype=np.float64), GPT(TINY, seed=3, dtype=np.float64)
    without.load_state_dict(with_dropout.state_dict())
    rng = np.random.default_rng(comm.rank)
    x, y = rng.integers(0, 11, (2, 6)), rng.integers(0, 11, (2, 6))
    prompt = np.zeros((1, 2), dtype=np.int64)
    reference = without.generate(prompt, 4, top_k=1)
    for model in (with_dropout, without):
        mpifsdp.fully_shard(model, comm, units=model.blocks)
    with no_grad():
        off = without(x, y).item()
        assert with_dropout.eval() is with_dropout and not any(
            m.training for _, m in with_dropout.named_modules()
        )
        first, second = with_dropout(x, y).item(), with_dropout(x, y).item()
        with_dropout.train()
        training = with_dropout(x, y).item()
    assert first == second == off
    assert training != off  # dropout is on again: the mechanism above is not vacuous
    np.testing.assert_array_equal(with_dropout.generate(prompt, 4, top_k=1), reference)
    assert all(m.training for _, m in with_dropout.named_modules())
    with pytest.raises(TypeError, match="mode must be True or False"):
        with_dropout.train("no")


@pytest.mark.parametrize(
    "prompt, kwargs, said",
    [
        (np.zeros((1, 2), np.int64), {"temperature": float("nan")}, r"temperature=nan \(finite, >= 0"),
        (np.zeros((1, 2), np.int64), {"temperature": -1.0}, r"temperature=-1.0 \(finite, >= 0"),
        (np.zeros((1, 2), np.int64), {"top_k": 2.5}, r"top_k=2.5 \(None or an integer >= 1\)"),
        (np.zeros((1, 2), np.int64), {"top_k": -1}, r"top_k=-1 \(None or an integer >= 1\)"),
        (np.zeros((1, 2), np.int64), {"max_new_tokens": -3}, r"max_new_tokens=-3 \(an integer >= 0\)"),
        (np.zeros((1, 0), np.int64), {}, r"prompt of shape \(1, 0\) \(batch, tokens\), both >= 1"),
        (np.zeros(3, np.int64), {}, r"prompt of shape \(3,\) \(batch, tokens\)"),
        (np.zeros((1, 2)), {}, r"prompt of dtype float64 \(token ids: integers\)"),
        (np.full((1, 2), 11), {}, r"prompt ids 11..11 \(in \[0, 11\)\)"),
    ],
)
def test_generate_names_a_bad_argument(prompt, kwargs, said):
    """generate with temperature=nan, top_k=2.5, an empty, 1-D or float prompt: errors deep inside, or
    something else sampled silently (a negative temperature was greedy)."""
    model = GPT(GPTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=2, n_embd=8), seed=0)
    with pytest.raises(ValueError, match="GPT.generate: invalid .*" + said):
        model.generate(prompt, **{"max_new_tokens": 2, **kwargs})


@pytest.mark.mpi(min_size=2)
def test_a_bad_prompt_on_one_rank_is_named_on_every_rank(comm):
    """Ranks sample from prompts of their own: one rank's out-of-vocabulary prompt must not leave
    the others waiting in the forward's first collective."""
    from mpifsdp import fully_shard

    model = GPT(GPTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=2, n_embd=8), seed=0)
    fully_shard(model, comm, units=model.blocks)
    prompt = np.full((1, 2), 11 if comm.rank == 1 else 3)
    with pytest.raises(
        ValueError, match=r"GPT.generate failed on 1 of \d+ ranks:\n  rank 1: .*prompt ids 11..11"
    ):
        model.generate(prompt, 2)
    assert model.generate(np.full((1, 2), 3), 2).shape == (1, 4)  # usable afterwards
