"""Blocked (flash-style) causal attention: the same values and gradients as the one-block path, at a
length that is not a multiple of the block, and memory that grows with T, not T²."""

import tracemalloc

import numpy as np
import pytest

import mpifsdp.cuda.attention as gpu_attention
import mpifsdp.ops.causal_attention as attention
from mpifsdp.autodiff.tensor import implementation
from mpifsdp.extend import PRIMITIVES, check_vjp

ATTENTION = PRIMITIVES["attention"]


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(attention, "ATTENTION_BLOCK", 16)


def _qkv(T, heads=(2, 3), hs=8, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((*heads, T, hs)) for _ in range(3)]


def test_blocked_attention_equals_the_one_block_path(monkeypatch, xp):
    q, k, v = (xp.asarray(a) for a in _qkv(50))  # 50 = 3 blocks of 16 and a partial one
    g = xp.asarray(np.random.default_rng(1).standard_normal(q.shape))
    op = implementation("attention", q)  # the reference, or the device's own
    want, _ = op.forward(q, k, v)
    want_grads = op.vjp(g, None, q, k, v)
    monkeypatch.setattr(attention, "ATTENTION_BLOCK", 16)
    monkeypatch.setattr(gpu_attention, "BLOCK", 16)
    got, saved = op.forward(q, k, v)
    assert saved is not None  # the blocked path ran
    got_grads = op.vjp(g, saved, q, k, v)
    # Both sum the same terms in another order: each output is a weighted sum over <= T terms, so the
    # difference is bounded by T float64 roundings of the largest term (|values| <= max|v| or max|g|).
    bound = 50 * np.finfo(np.float64).eps * 4 * float(max(abs(v).max(), abs(g).max()))
    assert float(abs(got - want).max()) <= bound
    for a, b in zip(got_grads, want_grads):
        assert float(abs(a - b).max()) <= bound * float(abs(q).max() * abs(k).max())


def test_blocked_attention_vjp_against_central_differences(small_blocks):
    check_vjp("attention", _qkv(37, heads=(1, 2), hs=4))


def _peak_bytes(T):
    q, k, v = _qkv(T, heads=(1, 2), hs=16)
    g = np.ones_like(q)
    tracemalloc.start()
    tracemalloc.reset_peak()
    out, saved = ATTENTION.forward(q, k, v)
    ATTENTION.vjp(g, saved, q, k, v)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def test_blocked_attention_memory_grows_with_t_not_t_squared(monkeypatch):
    monkeypatch.setattr(attention, "ATTENTION_BLOCK", 128)
    small, large = _peak_bytes(1024), _peak_bytes(2048)
    scores = 2 * 2048 * 2048 * 8  # one (heads, T, T) float64 array at T = 2048: 64 MiB
    assert large < scores / 8, f"peak {large} bytes: a (T, T) array was built"
    assert large < 2.5 * small, f"peak {small} -> {large} bytes when T doubles: not linear in T"
