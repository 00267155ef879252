"""Modules: parameter containers with a deterministic order, and the layers a GPT is made of.

Initialisation draws from a NumPy Generator on the host, then moves the arrays to the device, so
every rank (and CPU vs GPU) starts from bit-identical weights given the same seed. Under
deferred_init() nothing is allocated until fully_shard() materializes the model unit by unit.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections import OrderedDict

import numpy as np

from . import ops
from .autodiff import Param, Tensor
from .backend import device_of, to_device, to_numpy

_deferring = threading.local()


@contextlib.contextmanager
def deferred_init():
    """Build a model without allocating its parameters.

    Inside, parameters record only their shape, dtype and the seed of their initial values;
    fully_shard() then materializes them one unit at a time and keeps each rank's shard, so no rank
    ever holds the whole model: the way to shard a model that does not fit one rank's memory.
    """
    previous = getattr(_deferring, "on", False)
    _deferring.on = True
    try:
        yield
    finally:
        _deferring.on = previous


_initializers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # deferred Param -> its maker
DEFERRED = (
    "it was built under deferred_init() and has no values yet: fully_shard() the model first "
    "(it materializes one unit at a time)"
)


def _param(make, shape, dtype, device: str) -> Param:
    def initial():
        return to_device(make(), device, dtype=dtype)

    if getattr(_deferring, "on", False):
        param = Param(None, shape=shape, dtype=dtype, absent=DEFERRED)
        _initializers[param] = initial
        return param
    return Param(initial())


def initial_value(param: Param):
    """The array `param` starts from: its data, or (deferred) freshly made from its own seed."""
    make = _initializers.get(param)
    return make() if make is not None and param.absent == DEFERRED else param.data


def normal_param(rng: np.random.Generator, shape, std: float, dtype, device: str) -> Param:
    """N(0, std) values drawn on the host from this parameter's own seed (taken from `rng`), so they are
    the same whether built now or deferred, on every rank and every device."""
    seed = int(rng.integers(2**63))
    return _param(lambda: np.random.default_rng(seed).normal(0.0, std, size=shape), shape, dtype, device)


def constant_param(value: float, shape, dtype, device: str) -> Param:
    return _param(lambda: np.full(shape, value), shape, dtype, device)


def ids_problem(name: str, ids, count: int, ndim: int, ignore: int | None = None) -> str | None:
    """What is wrong with `ids` as a `ndim`-D integer array of ids in [0, count) (or `ignore`), or
    None: a cheap check that names the argument, the bad value and the valid range."""
    ids = ids.data if isinstance(ids, Tensor) else ids
    if not hasattr(ids, "dtype") or ids.dtype.kind not in "iu":
        kind = f"{ids.dtype} array" if hasattr(ids, "dtype") else type(ids).__name__
        return f"{name} must be an integer array of ids, got a {kind}"
    if ids.ndim != ndim:
        return f"{name} must have {ndim} dimensions, got {tuple(ids.shape)}"
    valid = ids if ignore is None else ids[ids != ignore]
    outside = valid[(valid < 0) | (valid >= count)]
    if outside.size:
        also = "" if ignore is None else f" (and is not the ignore index {ignore})"
        return f"{name} holds {int(outside[0])}, outside [0, {count}){also}"
    return None


def _holds_parameters(value) -> bool:
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, Module) for v in value)
    return isinstance(value, (Param, Module))


class Module:
    """Base class. Parameters are found by walking attributes in assignment order.

    `_forward_wrapper`, when set (fully_shard sets it on each unit module and the model), receives the
    bound forward and its arguments and runs it inside whatever it needs (gathered parameters, a
    scope): the one hook point that keeps layers free of FSDP.
    """

    _forward_wrapper = None
    _parent = None  # the module this one was first attached to (for parameter names)
    training = True  # Dropout draws masks only in training mode: eval() for evaluation and sampling

    def __setattr__(self, name, value):
        """Name parameters by their path in the module tree as soon as they join it, so every error
        names the parameter ('blocks.0.attn.c_attn.weight'), sharded or not. A module attached to a
        parent remembers it, so a later change deep inside (tying `lm_head.weight = wte.weight`)
        renames the tree from its root: a tied weight keeps the name where it is first found."""
        object.__setattr__(self, name, value)
        if name.startswith("_") or not _holds_parameters(value):
            return
        for child in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(child, Module) and child._parent is None and child is not self:
                object.__setattr__(child, "_parent", self)
        for path, param in self._root().named_parameters():
            param.name = path

    def _root(self) -> Module:
        node, seen = self, {id(self)}
        while node._parent is not None and id(node._parent) not in seen:
            node = node._parent
            seen.add(id(node))
        return node

    def forward(self, *args, **kwargs):
        raise NotImplementedError

    def __call__(self, *args, **kwargs):
        if self._forward_wrapper is None:
            problem = self.check_inputs(*args, **kwargs)
            if problem:
                raise ValueError(f"{type(self).__name__}: {problem}")
            return self.forward(*args, **kwargs)
        return self._forward_wrapper(self.forward, *args, **kwargs)

    def check_inputs(self, *args, **kwargs) -> str | None:
        """What is wrong with these inputs, or None. Models override it with cheap checks (shapes,
        dtypes, id ranges); under fully_shard every rank's verdict is exchanged with the batch sizes,
        so bad input on one rank is named on every rank instead of hanging the others."""
        return None

    def _children(self):
        """(name, value) for Params, Modules and lists of Modules, in assignment order."""
        for name, value in vars(self).items():
            if name.startswith("_"):
                continue
            if isinstance(value, (Param, Module)):
                yield name, value
            elif isinstance(value, (list, tuple)) and value and all(isinstance(v, Module) for v in value):
                for i, child in enumerate(value):
                    yield f"{name}.{i}", child

    def named_modules(self, prefix: str = ""):
        """Every module once, depth first, with its dotted name ('' for self)."""
        yield prefix, self
        for name, child in self._children():
            if isinstance(child, Module):
                yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def named_parameters(self, prefix: str = ""):
        """Every parameter once, under the name where it is first found (tied weights appear once)."""
        seen = set()
        for module_name, module in self.named_modules(prefix):
            for name, child in module._children():
                if isinstance(child, Param) and id(child) not in seen:
                    seen.add(id(child))
                    yield (f"{module_name}.{name}" if module_name else name), child

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def requires_grad_(self, requires_grad: bool = True):
        """Freeze (False) or unfreeze every parameter of this module; returns the module. A frozen
        parameter gets no gradient and no optimizer state; under fully_shard it is gathered but never
        reduced, so decide before sharding (fully_shard reads it)."""
        for p in self.parameters():
            p.requires_grad = bool(requires_grad)
        return self

    def train(self, mode: bool = True) -> Module:
        """Training mode (True) or evaluation mode (False) for this module and every module inside it;
        returns the module. Evaluation turns dropout off, so a validation loss is a function of the
        parameters alone (the same twice); `GPT.generate` samples in evaluation mode."""
        if not isinstance(mode, bool):
            raise TypeError(f"{type(self).__name__}.train: mode must be True or False, not {mode!r}")
        for _, module in self.named_modules():
            module.training = mode
        return self

    def eval(self) -> Module:
        """Evaluation mode: `train(False)`."""
        return self.train(False)

    def num_params(self) -> int:
        return sum(p.size for p in self.parameters())

    def zero_grad(self):
        for p in self.parameters():
            p.zero_grad()

    def state_dict(self) -> OrderedDict:
        """Host copies of every parameter, by name."""
        return OrderedDict((name, to_numpy(p.data).copy()) for name, p in self.named_parameters())

    def load_state_dict(self, state: dict, strict: bool = True):
        """Copy arrays into the parameters in place; names and shapes must match."""
        params = dict(self.named_parameters())
        missing = [n for n in params if n not in state]
        unexpected = [n for n in state if n not in params]
        if strict and (missing or unexpected):
            raise KeyError(
                f"load_state_dict: missing parameters {missing}, unexpected entries {unexpected}; "
                "pass strict=False to load a subset"
            )
        for name, value in state.items():
            if name not in params:
                continue
            p = params[name]
            value = to_numpy(value)
            if value.shape != p.shape:
                raise ValueError(
                    f"load_state_dict: parameter {name!r} expects shape {p.shape}, found {value.shape}"
                )
            if value.dtype.kind != "f":
                raise TypeError(f"load_state_dict: parameter {name!r} needs floats, found {value.dtype}")
            p.data[...] = to_device(value, device_of(p.data), dtype=p.dtype)


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
    def __init__(self, dim, bias=True, eps=1e-5, *, dtype=np.float32, device="cpu"):
        self.weight = constant_param(1.0, (dim,), dtype, device)
        self.bias = constant_param(0.0, (dim,), dtype, device) if bias else None
        self.eps = eps

    def forward(self, x):
        return ops.layer_norm(x, self.weight, self.bias, eps=self.eps)


class Dropout(Module):
    """Seeded dropout: call k of a Dropout seeded s uses mask seed (s, k), the same on every device."""

    def __init__(self, p: float, seed: int = 0):
        if not 0 <= p < 1:  # p = 1 would scale the survivors by 1 / 0
            raise ValueError(f"Dropout: p={p!r} must be in [0, 1)")
        self.p = p
        self._seed = seed
        self._calls = 0

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        self._calls += 1
        seed = np.random.SeedSequence([self._seed, self._calls]).generate_state(1)[0]
        return ops.dropout(x, self.p, int(seed))


def dropout_replay(module: Module):
    """A replay() for recompute.recompute: inside it, the dropouts of `module` draw the masks they drew
    since this call again (their positions rewound, then restored), so a re-run forward equals the first."""
    dropouts = [m for _, m in module.named_modules() if isinstance(m, Dropout)]
    before = [d._calls for d in dropouts]

    @contextlib.contextmanager
    def replay():
        after = [d._calls for d in dropouts]
        for d, calls in zip(dropouts, before):
            d._calls = calls
        try:
            yield
        finally:
            for d, calls in zip(dropouts, after):
                d._calls = calls

    return replay


class MLP(Module):
    """The transformer feed-forward: Linear(C, 4C) -> GELU -> Linear(4C, C)."""

    def __init__(self, n_embd, bias=True, dropout=0.0, proj_std=0.02, *, rng, dtype=np.float32, device="cpu"):
        kw = dict(rng=rng, dtype=dtype, device=device)
        self.c_fc = Linear(n_embd, 4 * n_embd, bias, **kw)
        self.c_proj = Linear(4 * n_embd, n_embd, bias, std=proj_std, **kw)
        self.drop = Dropout(dropout, seed=int(rng.integers(2**31)))

    def forward(self, x, norm: LayerNorm | None = None):
        """norm: the block's LayerNorm, fused into c_fc (its output is not stored)."""
        # c_proj(gelu(h)) as one op: gelu(h), the block's largest activation, is recomputed in backward.
        h = norm_and_project(norm, self.c_fc, x)
        return self.drop(self.c_proj(h, gelu_input=True))


class CausalSelfAttention(Module):
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

    def forward(self, x, norm: LayerNorm | None = None):
        """norm: the block's LayerNorm, fused into c_attn (its output is not stored)."""
        qkv = norm_and_project(norm, self.c_attn, x)  # (B, T, 3C): q, k, v side by side, n_head heads each
        hs = x.shape[-1] // self.n_head
        y = ops.attention_qkv(qkv, self.n_head, scale=1.0 / math.sqrt(hs))  # (B, T, C), heads side by side
        return self.drop(self.c_proj(y))


class Block(Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)); each LayerNorm runs fused
    into the projection after it, so its output is recomputed in backward instead of stored."""

    def __init__(self, n_embd, n_head, bias=True, dropout=0.0, proj_std=0.02, *, rng, dtype, device):
        kw = dict(rng=rng, dtype=dtype, device=device)
        self.ln_1 = LayerNorm(n_embd, bias, dtype=dtype, device=device)
        self.attn = CausalSelfAttention(n_embd, n_head, bias, dropout, proj_std, **kw)
        self.ln_2 = LayerNorm(n_embd, bias, dtype=dtype, device=device)
        self.mlp = MLP(n_embd, bias, dropout, proj_std, **kw)

    def forward(self, x):
        x = x + _after_norm(self.ln_1, self.attn, CausalSelfAttention, x)
        return x + _after_norm(self.ln_2, self.mlp, MLP, x)


def _after_norm(norm, module, cls, x):
    """module(norm(x)), norm handed to the module to fuse where it runs cls's own forward."""
    return module(x, norm=norm) if fusable(module, cls) else module(norm(x))


def fusable(module: Module, cls: type) -> bool:
    """module runs cls's own forward, unwrapped: its call may be fused with a neighbour's. A subclass
    that overrides forward (a LoRA adapter) or a module with hooks (a unit of its own) is called."""
    return type(module).forward is cls.forward and module._forward_wrapper is None


def norm_then_linear(norm: LayerNorm, x, weight, bias=None, transpose_w: bool = False):
    """linear(norm(x), weight, bias): one op (layer_norm_linear: norm's output recomputed in backward,
    not stored) where norm is fusable, else norm's own call first (a tied head's weight, say)."""
    if fusable(norm, LayerNorm):
        return ops.layer_norm_linear(
            x, norm.weight, norm.bias, weight, bias, eps=norm.eps, transpose_w=transpose_w
        )
    return ops.linear(norm(x), weight, bias, transpose_w=transpose_w)


def norm_and_project(norm: LayerNorm | None, linear: Linear, x):
    """linear(norm(x)), fused where both are fusable (norm_then_linear), else the two calls, so a
    subclass's forward sees what it always saw."""
    if norm is None:
        return linear(x)
    if fusable(linear, Linear):
        return norm_then_linear(norm, x, linear.weight, linear.bias)
    return linear(norm(x))


__all__ = [
    "Module",
    "Linear",
    "Embedding",
    "LayerNorm",
    "Dropout",
    "MLP",
    "CausalSelfAttention",
    "Block",
    "Tensor",
    "fusable",
    "norm_then_linear",
    "norm_and_project",
]
