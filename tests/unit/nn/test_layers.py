"""Layer gradients by finite differences (float64), deterministic init, state_dict checks."""

import numpy as np
import pytest

import mpifsdp
from mpifsdp import Tensor
from mpifsdp.autodiff.tensor import Param
from mpifsdp.cuda import fused as gpu_fused
from mpifsdp.extend import check_grad
from mpifsdp.nn.layers import MLP, Block, CausalSelfAttention, Embedding, LayerNorm, Linear, norm_and_project

F64 = dict(dtype=np.float64)


def _projected_loss(module, x, xp, seed=3):
    """A scalar that depends on every output element: sum(module(x) * R) for a fixed random R."""
    out_shape = module(x).shape
    R = xp.asarray(np.random.default_rng(seed).standard_normal(out_shape))
    return lambda: (module(x) * R).sum()


LAYERS = {
    "linear": lambda rng, d: (Linear(5, 3, rng=rng, **F64, device=d), (2, 4, 5)),
    "linear-nobias": lambda rng, d: (Linear(5, 3, bias=False, rng=rng, **F64, device=d), (4, 5)),
    "layernorm": lambda rng, d: (LayerNorm(6, **F64, device=d), (3, 2, 6)),
    "mlp": lambda rng, d: (MLP(4, rng=rng, **F64, device=d), (2, 3, 4)),
    "attention": lambda rng, d: (CausalSelfAttention(8, 2, rng=rng, **F64, device=d), (2, 5, 8)),
    "block": lambda rng, d: (Block(8, 2, rng=rng, **F64, device=d), (2, 5, 8)),
}


@pytest.mark.parametrize("name", LAYERS)
def test_layer_gradients(name, device, xp):
    module, x_shape = LAYERS[name](np.random.default_rng(0), device)
    for p in module.parameters():  # LayerNorm starts at w=1, b=0: perturb to exercise every term
        p.data = p.data + xp.asarray(np.random.default_rng(1).normal(0, 0.3, p.shape))
    x = Tensor(xp.asarray(np.random.default_rng(2).standard_normal(x_shape)), requires_grad=True)
    loss = _projected_loss(module, x, xp)
    check_grad(loss, module.parameters() + [x])


def test_embedding_gradient_scatter_adds_repeats(device, xp):
    emb = Embedding(5, 3, rng=np.random.default_rng(0), **F64, device=device)
    idx = xp.asarray([[1, 1, 4], [1, 0, 0]])
    check_grad(_projected_loss(emb, idx, xp), emb.parameters())
    emb.weight.grad = None
    emb(idx).sum().backward()
    assert emb.weight.grad[:, 0].tolist() == [2.0, 3.0, 0.0, 0.0, 1.0]


def test_init_is_seeded_and_identical():
    a = Block(8, 2, rng=np.random.default_rng(7), dtype=np.float32, device="cpu")
    b = Block(8, 2, rng=np.random.default_rng(7), dtype=np.float32, device="cpu")
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        np.testing.assert_array_equal(pa.data, pb.data)


def test_named_parameters_order_is_deterministic():
    block = Block(8, 2, rng=np.random.default_rng(0), dtype=np.float32, device="cpu")
    assert [n for n, _ in block.named_parameters()] == [
        "ln_1.weight", "ln_1.bias",
        "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
        "ln_2.weight", "ln_2.bias",
        "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias",
    ]  # fmt: skip


def test_state_dict_round_trip_and_errors():
    rng = np.random.default_rng(0)
    a = Linear(4, 3, rng=rng, dtype=np.float32, device="cpu")
    b = Linear(4, 3, rng=rng, dtype=np.float32, device="cpu")
    b.load_state_dict(a.state_dict())
    np.testing.assert_array_equal(a.weight.data, b.weight.data)

    bad_shape = {"weight": np.zeros((3, 4)), "bias": np.zeros(3)}
    with pytest.raises(ValueError, match=r"'weight' expects shape \(4, 3\), found \(3, 4\)"):
        b.load_state_dict(bad_shape)
    with pytest.raises(KeyError, match=r"missing parameters \['bias'\], unexpected entries \['extra'\]"):
        b.load_state_dict({"weight": np.zeros((4, 3)), "extra": np.zeros(1)})
    with pytest.raises(TypeError, match="'bias' needs floats"):
        b.load_state_dict({"weight": np.zeros((4, 3)), "bias": np.zeros(3, dtype=np.int64)})
    b.load_state_dict({"bias": np.ones(3)}, strict=False)
    assert b.bias.data.tolist() == [1.0, 1.0, 1.0]


def test_attention_rejects_indivisible_heads():
    with pytest.raises(ValueError, match="n_embd 10 must be divisible by n_head 4"):
        CausalSelfAttention(10, 4, rng=np.random.default_rng(0))


def test_parameters_are_named_by_the_module_tree_from_construction():
    from mpifsdp.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=11, block_size=4, n_layer=2, n_head=2, n_embd=8))
    assert all(p.name == name for name, p in model.named_parameters())
    weight = model.blocks[1].mlp.c_fc.weight
    assert weight.name == "blocks.1.mlp.c_fc.weight"
    with pytest.raises(ValueError, match=r"parameter 'blocks\.1\.mlp\.c_fc\.weight' \(8, 32\)"):
        mpifsdp.ops.linear(np.ones((2, 3), np.float32), weight)  # an unsharded model's error names it
    untied = GPT(GPTConfig(vocab_size=11, block_size=4, n_layer=1, n_head=2, n_embd=8, tie_weights=False))
    untied.lm_head.weight = untied.wte.weight  # tied after construction, as nanoGPT does
    assert untied.wte.weight.name == "wte.weight"  # the name where it is first found, not 'weight'
    assert untied.blocks[0].attn.c_proj.bias.name == "blocks.0.attn.c_proj.bias"


@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_fused_into_linear_is_the_two_ops_bit_for_bit_and_keeps_less(bias):
    """norm_and_project(ln, lin, x) recomputes ln(x) in backward from the same passes as its forward: every
    value and gradient equals linear(ln(x)) exactly (float32, rows over several threads' blocks), a
    frozen weight gets no gradient, and the tape keeps x instead of x and ln(x)."""
    from mpifsdp.autodiff.tensor import graph_nbytes
    from mpifsdp.base.threads import elementwise_threads, set_elementwise_threads

    rng = np.random.default_rng(0)
    kw = dict(dtype=np.float32)
    ln, lin = LayerNorm(64, bias, **kw), Linear(64, 48, bias, rng=rng, **kw)
    ln.weight.data[:] = rng.standard_normal(64)
    if bias:
        ln.bias.data[:] = rng.standard_normal(64)
    x0 = rng.standard_normal((4, 2100, 64)).astype(np.float32)  # 8400 rows: blocks on 2 threads
    R = rng.standard_normal((4, 2100, 48)).astype(np.float32)
    params = [p for p in (ln.weight, ln.bias, lin.weight, lin.bias) if p is not None]
    previous = elementwise_threads()
    set_elementwise_threads(2)
    try:
        results = []
        for fused in (False, True):
            for p in params:
                p.grad = None
            x = Tensor(x0.copy(), requires_grad=True)
            out = norm_and_project(ln, lin, x) if fused else lin(ln(x))
            loss = (out * R).sum()
            kept = graph_nbytes(loss)
            loss.backward()
            results.append((out.data, x.grad, [p.grad for p in params], kept))
    finally:
        set_elementwise_threads(previous)
    (o1, gx1, gp1, kept1), (o2, gx2, gp2, kept2) = results
    np.testing.assert_array_equal(o2, o1)
    np.testing.assert_array_equal(gx2, gx1)
    for a, b in zip(gp1, gp2):
        np.testing.assert_array_equal(b, a)
    assert kept1 - kept2 == x0.nbytes  # ln(x) is no longer kept
    lin.weight.requires_grad = False
    lin.weight.grad = ln.weight.grad = None
    (norm_and_project(ln, lin, Tensor(x0)) * R).sum().backward()
    assert lin.weight.grad is None and ln.weight.grad is not None


def test_a_subclass_with_its_own_forward_still_sees_the_normalized_input():
    """LayerNorms are fused only into the library's own forwards: a Linear subclass (a LoRA adapter)
    or an MLP subclass that overrides forward is called as before, on ln(x); a LayerNorm subclass
    runs its own forward too."""
    rng = np.random.default_rng(0)
    seen = []

    class Recording(Linear):
        def forward(self, x, gelu_input=False):
            seen.append(x.data)
            return super().forward(x, gelu_input)

    class Shifted(LayerNorm):
        def forward(self, x):
            return super().forward(x) + 1.0

    x = Tensor(rng.standard_normal((3, 8)))
    ln, lin = LayerNorm(8, **F64), Recording(8, 4, rng=rng, **F64)
    np.testing.assert_array_equal(norm_and_project(ln, lin, x).data, lin(ln(x)).data)
    np.testing.assert_array_equal(seen[0], ln(x).data)
    plain = Linear(8, 4, rng=rng, **F64)
    np.testing.assert_array_equal(norm_and_project(Shifted(8, **F64), plain, x).data, plain(ln(x) + 1.0).data)

    class OwnMLP(MLP):  # a block's sublayer with a forward of its own gets the normalized input too
        def forward(self, x):
            seen.append(x.data)
            return super().forward(x)

    block = Block(8, 2, rng=rng, **F64, device="cpu")
    block.mlp = OwnMLP(8, rng=rng, **F64)
    block(Tensor(rng.standard_normal((2, 3, 8))))
    assert np.allclose(seen[-1].mean(axis=-1), 0) and np.allclose(seen[-1].std(axis=-1), 1, atol=1e-3)


def test_a_seed_is_taken_once_and_only_for_the_residual_and_bias_it_was_written_from():
    """cuda/fused.py Seed: a projection's GEMM adds into the array the LayerNorm kernel wrote x + bias into
    only where its residual is that x and its bias that bias; taken, the seed is empty (a stale
    sum is never added twice, or to another residual)."""
    bias, other_bias = Param(np.zeros(4), name="b"), Param(np.ones(4), name="b2")
    x, other_x = np.zeros((2, 4)), np.zeros((2, 4))
    seed = gpu_fused.Seed(bias)
    array, bias_array = seed.target(x)
    assert array.shape == x.shape and bias_array is bias.data
    assert seed.take(x, bias.data) is None  # nothing written yet
    seed.written(array, x, bias_array)
    assert seed.take(other_x, bias.data) is None  # another residual: empty now, too
    assert seed.take(x, bias.data) is None
    seed.written(array, x, bias_array)
    assert seed.take(x, other_bias.data) is None  # another bias
    seed.written(array, x, bias_array)
    assert seed.take(x, bias.data) is array
    assert seed.take(x, bias.data) is None  # once
    assert gpu_fused.Seed(Param(np.zeros(3), name="c")).target(x) is None  # another width
    assert gpu_fused.Seed(Param(np.zeros(4, np.float32), name="d")).target(x) is None  # another type
