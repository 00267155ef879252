"""The layers a GPT is made of (Linear, Embedding, LayerNorm, Dropout, MLP, attention, Block), and
the dispatch that runs a LayerNorm fused into the projection after it where both are plain."""

from __future__ import annotations

import contextlib
import contextvars
import math
import random

import numpy as np

from .. import ops
from ..autodiff.tensor import fusion
from .module import Module, constant_param, normal_param


class Linear(Module):
    """y = x @ weight + bias, weight stored (in_features, out_features)."""

    def __init__(self, n_in, n_out, bias=True, *, rng, std=0.02, dtype=np.float32, device="cpu"):
        self.weight = normal_param(rng, (n_in, n_out), std, dtype, device)
        self.bias = constant_param(0.0, (n_out,), dtype, device) if bias else None

    def forward(self, x, gelu_input: bool = False):
        """gelu_input=True: gelu(x) @ weight + bias, gelu(x) never stored (the MLP's second layer)."""
        return ops.linear(x, self.weight, self.bias, gelu_input=gelu_input)


class Embedding(Module):
    def __init__(self, num, dim, *, rng, std=0.02, dtype=np.float32, device="cpu"):
        self.weight = normal_param(rng, (num, dim), std, dtype, device)

    def forward(self, idx):
        return ops.embedding(self.weight, idx)


class LayerNorm(Module):
    SETTINGS = ("eps",)

    def __init__(self, dim, bias=True, eps=1e-5, *, dtype=np.float32, device="cpu"):
        self.weight = constant_param(1.0, (dim,), dtype, device)
        self.bias = constant_param(0.0, (dim,), dtype, device) if bias else None
        self.eps = eps

    def forward(self, x):
        return ops.layer_norm(x, self.weight, self.bias, eps=self.eps)


_chunk = contextvars.ContextVar("mpifsdp_chunk", default=None)  # deterministic mode: the chunk running


@contextlib.contextmanager
def drawing_for_chunk(index: int):
    """Inside, dropout masks belong to chunk `index` of the global batch: the same masks whichever
    rank runs that chunk (deterministic mode: fsdp/deterministic.py)."""
    token = _chunk.set(int(index))
    try:
        yield
    finally:
        _chunk.reset(token)


class Dropout(Module):
    """Seeded dropout: call k of a Dropout seeded s uses mask seed (s, k), the same on every device;
    inside drawing_for_chunk(c), seed (s, k, c)."""

    SETTINGS = RUN_SETTINGS = ("p",)

    def __init__(self, p: float, seed: int = 0):
        if not 0 <= p < 1:  # p = 1 would scale the survivors by 1 / 0
            raise ValueError(f"Dropout: p={p!r} must be in [0, 1)")
        self.p = p
        self._seed = seed
        self._calls = 0

    def inactive(self) -> bool:
        """Whether forward returns its input as it is (evaluation, or p = 0)."""
        return not self.training or self.p == 0.0

    def forward(self, x):
        if self.inactive():
            return x
        self._calls += 1
        chunk = _chunk.get()
        key = [self._seed, self._calls] if chunk is None else [self._seed, self._calls, chunk]
        seed = np.random.SeedSequence(key).generate_state(1)[0]
        return ops.dropout(x, self.p, int(seed))


def draws_replay(module: Module):
    """A replay() for recompute.recompute: inside it, `module` draws again what it drew since this
    call: its dropouts' positions rewound, and every random generator it holds as an attribute
    (NumPy's Generator or RandomState, Python's Random, in it or in a module inside it; also inside a
    list, tuple or dict attribute) put back to its state now. After it, each goes on from where it
    was. A generator it reaches otherwise (a global of yours, a closure) cannot be seen: the
    re-run then draws anew (docs/training.md, "Activation checkpointing")."""
    dropouts = [m for _, m in module.named_modules() if isinstance(m, Dropout)]
    generators = _generators_in(module)
    before = [d._calls for d in dropouts], [_state(g) for g in generators]

    @contextlib.contextmanager
    def replay():
        after = [d._calls for d in dropouts], [_state(g) for g in generators]
        _rewind(dropouts, generators, before)
        try:
            yield
        finally:
            _rewind(dropouts, generators, after)

    return replay


def _generators_in(module: Module) -> list:
    found = {}
    for _, m in module.named_modules():
        for value in vars(m).values():
            inside = (
                value.values()
                if isinstance(value, dict)
                else value
                if isinstance(value, (list, tuple))
                else [value]
            )
            for v in inside:
                if isinstance(v, (np.random.Generator, np.random.RandomState, random.Random)):
                    found[id(v)] = v
    return list(found.values())


def _state(generator):
    if isinstance(generator, np.random.Generator):
        return generator.bit_generator.state
    return generator.get_state() if isinstance(generator, np.random.RandomState) else generator.getstate()


def _rewind(dropouts, generators, states):
    for d, calls in zip(dropouts, states[0]):
        d._calls = calls
    for g, state in zip(generators, states[1]):
        if isinstance(g, np.random.Generator):
            g.bit_generator.state = state
        elif isinstance(g, np.random.RandomState):
            g.set_state(state)
        else:
            g.setstate(state)


class MLP(Module):
    """The transformer feed-forward: Linear(C, H) -> GELU (tanh form) or ReLU -> Linear(H, C), H = 4C
    unless given."""

    SETTINGS = ("activation",)

    def __init__(
        self,
        n_embd,
        bias=True,
        dropout=0.0,
        proj_std=0.02,
        *,
        hidden=None,
        activation="gelu_tanh",
        rng,
        dtype=np.float32,
        device="cpu",
    ):
        if activation not in ("gelu_tanh", "relu"):
            raise ValueError(f"MLP: activation={activation!r} is not 'gelu_tanh' or 'relu'")
        kw = dict(rng=rng, dtype=dtype, device=device)
        hidden = hidden or 4 * n_embd
        self.activation = activation
        self.c_fc = Linear(n_embd, hidden, bias, **kw)
        self.c_proj = Linear(hidden, n_embd, bias, std=proj_std, **kw)
        self.drop = Dropout(dropout, seed=int(rng.integers(2**31)))

    def forward(self, x, norm: LayerNorm | None = None, residual=None):
        """norm: the block's LayerNorm, fused into c_fc (its output is not stored); residual: added
        to the output (fused into c_proj: project_into)."""
        seed = branch_seed(norm, x, residual, self.c_proj, self.drop)
        if self.activation == "relu":
            h = ops.relu(norm_and_project(norm, self.c_fc, x, seed=seed))
            return project_into(residual, self.c_proj, self.drop, h, seed=seed)
        if self._bias_in_gelu(x, residual):  # c_fc's bias added inside the GELU: a launch less
            h = norm_and_project(norm, self.c_fc, x, with_bias=False, seed=seed)
            proj = self.c_proj
            return ops.linear_add(
                h, proj.weight, proj.bias, residual, gelu_input=True, gelu_bias=self.c_fc.bias, seed=seed
            )
        # c_proj(gelu(h)) as one op: gelu(h), the block's largest activation, is recomputed in backward.
        h = norm_and_project(norm, self.c_fc, x, seed=seed)
        return project_into(residual, self.c_proj, self.drop, h, gelu_input=True, seed=seed)

    def _bias_in_gelu(self, x, residual) -> bool:
        """Where c_fc's bias goes into the GELU of c_proj's linear_add: where linear_add's
        implementation on x's device offers it (a GPU: a launch less; the CPU keeps x + b in place
        in c_fc instead, no temporary), both linears plain ones with biases, the dropout off, a
        residual to add into."""
        plain = all(
            fusable(linear, Linear) and linear.bias is not None for linear in (self.c_fc, self.c_proj)
        )
        fits = plain and residual is not None and self.drop.inactive()
        return fits and fusion("linear_add", "gelu_bias", x.data) is not None


class CausalSelfAttention(Module):
    SETTINGS = ("n_head",)

    def __init__(
        self, n_embd, n_head, bias=True, dropout=0.0, proj_std=0.02, *, rng, dtype=np.float32, device="cpu"
    ):
        if n_embd % n_head:
            raise ValueError(f"n_embd {n_embd} must be divisible by n_head {n_head}")
        kw = dict(rng=rng, dtype=dtype, device=device)
        self.n_head = n_head
        self.c_attn = Linear(n_embd, 3 * n_embd, bias, **kw)
        self.c_proj = Linear(n_embd, n_embd, bias, std=proj_std, **kw)
        self.drop = Dropout(dropout, seed=int(rng.integers(2**31)))

    def forward(self, x, norm: LayerNorm | None = None, residual=None):
        """norm: the block's LayerNorm, fused into c_attn (its output is not stored); residual: added
        to the output (fused into c_proj: project_into)."""
        seed = branch_seed(norm, x, residual, self.c_proj, self.drop)
        qkv = norm_and_project(norm, self.c_attn, x, seed=seed)  # (B, T, 3C): q, k, v side by side
        hs = x.shape[-1] // self.n_head
        y = ops.attention_qkv(qkv, self.n_head, scale=1.0 / math.sqrt(hs))  # (B, T, C), heads side by side
        return project_into(residual, self.c_proj, self.drop, y, seed=seed)


class Block(Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)); each LayerNorm runs fused
    into the projection after it, so its output is recomputed in backward instead of stored."""

    def __init__(
        self,
        n_embd,
        n_head,
        bias=True,
        dropout=0.0,
        proj_std=0.02,
        *,
        hidden=None,
        activation="gelu_tanh",
        eps=1e-5,
        rng,
        dtype,
        device,
    ):
        kw = dict(rng=rng, dtype=dtype, device=device)
        self.ln_1 = LayerNorm(n_embd, bias, eps, dtype=dtype, device=device)
        self.attn = CausalSelfAttention(n_embd, n_head, bias, dropout, proj_std, **kw)
        self.ln_2 = LayerNorm(n_embd, bias, eps, dtype=dtype, device=device)
        self.mlp = MLP(n_embd, bias, dropout, proj_std, hidden=hidden, activation=activation, **kw)

    def forward(self, x):
        x = _residual_after_norm(self.ln_1, self.attn, CausalSelfAttention, x)
        return _residual_after_norm(self.ln_2, self.mlp, MLP, x)


def _residual_after_norm(norm, module, cls, x):
    """x + module(norm(x)), norm and x handed to the module to fuse where it runs cls's own forward."""
    return module(x, norm=norm, residual=x) if fusable(module, cls) else x + module(norm(x))


def fusable(module: Module, cls: type) -> bool:
    """module runs cls's own forward, unwrapped: its call may be fused with a neighbour's. A subclass
    that overrides forward (a LoRA adapter) or a module with hooks (a unit of its own) is called."""
    return type(module).forward is cls.forward and module._forward_wrapper is None


def norm_then_linear(norm: LayerNorm, x, weight, bias=None, transpose_w: bool = False, seed=None):
    """linear(norm(x), weight, bias): one op (layer_norm_linear: norm's output recomputed in backward,
    not stored) where norm is fusable, else norm's own call first (a tied head's weight, say). seed:
    what its LayerNorm kernel writes on a device that offers it (branch_seed)."""
    if fusable(norm, LayerNorm):
        return ops.layer_norm_linear(
            x, norm.weight, norm.bias, weight, bias, eps=norm.eps, transpose_w=transpose_w, seed=seed
        )
    return ops.linear(norm(x), weight, bias, transpose_w=transpose_w)


def norm_and_project(norm: LayerNorm | None, linear: Linear, x, with_bias: bool = True, seed=None):
    """linear(norm(x)), fused where both are fusable (norm_then_linear), else the two calls, so a
    subclass's forward sees what it always saw. with_bias=False: linear's bias left out (its caller
    adds it; a fusable linear only)."""
    bias = linear.bias if with_bias else None
    if norm is None:
        return linear(x) if with_bias else ops.linear(x, linear.weight)
    if fusable(linear, Linear):
        return norm_then_linear(norm, x, linear.weight, bias, seed=seed)
    return linear(norm(x))


def _closes_in_linear_add(linear: Linear, dropout: Dropout) -> bool:
    """Whether project_into adds the residual in linear_add: the dropout off, the linear a plain
    fusable one with a bias."""
    return dropout.inactive() and linear.bias is not None and fusable(linear, Linear)


def branch_seed(norm: LayerNorm | None, x, residual, linear: Linear, dropout: Dropout):
    """The seed of a block's branch residual + dropout(linear(... norm(x) ...)), where the LayerNorm's
    implementation on x's device offers one (a GPU's, cuda/fused.py Seed: its LayerNorm kernel
    writes x + linear's bias, and linear's GEMM adds into that, a launch less). None elsewhere: the
    reference, a residual other than x, a LayerNorm or a close not fused."""
    fuses = norm is not None and residual is x and fusable(norm, LayerNorm)
    seed = fusion("layer_norm_linear", "seed", x.data)
    if seed is None or not (fuses and _closes_in_linear_add(linear, dropout)):
        return None
    return seed(linear.bias)


def project_into(residual, linear: Linear, dropout: Dropout, x, gelu_input: bool = False, seed=None):
    """residual + dropout(linear(x)): one op (linear_add) where the dropout is off and the linear is
    a plain fusable one with a bias, else the calls (a LoRA adapter's forward, say). seed: where a
    LayerNorm kernel wrote residual + bias (branch_seed)."""
    if residual is None:
        return dropout(linear(x, gelu_input=gelu_input))
    if _closes_in_linear_add(linear, dropout):
        return ops.linear_add(x, linear.weight, linear.bias, residual, gelu_input=gelu_input, seed=seed)
    return residual + dropout(linear(x, gelu_input=gelu_input))


__all__ = [
    "Linear",
    "Embedding",
    "LayerNorm",
    "Dropout",
    "MLP",
    "CausalSelfAttention",
    "Block",
    "fusable",
    "norm_then_linear",
    "norm_and_project",
    "branch_seed",
    "project_into",
]
