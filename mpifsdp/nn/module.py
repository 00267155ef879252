"""Module: a parameter container with a deterministic order, and deferred initialisation.

Initialisation draws from a NumPy Generator on the host, then moves the arrays to the device, so
every rank (and CPU vs GPU) starts from bit-identical weights given the same seed. Under
deferred_init() nothing is allocated until fully_shard() materializes the model unit by unit.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict

import numpy as np

from ..autodiff.tensor import Param, Tensor
from ..base import deferred
from ..base.backend import device_of, to_device, to_numpy
from ..base.checks import is_count

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
    None: a cheap check that names the argument, the bad value and the valid range. The values of
    ids on a GPU are checked there, and a bad one raises the ValueError at the next read (the step's
    verdict, a loss: base/deferred.py), not with a host sync in the forward."""
    ids = ids.data if isinstance(ids, Tensor) else ids
    if not hasattr(ids, "dtype") or ids.dtype.kind not in "iu":
        kind = f"{ids.dtype} array" if hasattr(ids, "dtype") else type(ids).__name__
        return f"{name} must be an integer array of ids, got a {kind}"
    if ids.ndim != ndim:
        return f"{name} must have {ndim} dimensions, got {tuple(ids.shape)}"
    outside = (ids < 0) | (ids >= count)
    if ignore is not None:
        outside &= ids != ignore
    also = "" if ignore is None else f" (and is not the ignore index {ignore})"
    message = lambda: f"{name} holds {int(ids[outside][0])}, outside [0, {count}){also}"  # noqa: E731
    return deferred.problem(outside.any(), ValueError, message)  # a device batch's: at the verdict


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
    # The ShardedModel fully_shard made of this model (its units): how optimizers and checkpoints find
    # a model's shards without importing the FSDP runtime (fsdp.sharded_model reads it).
    _sharded = None
    training = True  # Dropout draws masks only in training mode: eval() for evaluation and sampling
    # The attributes besides `training` that change what this module computes from its parameters
    # (a LayerNorm's eps, the number of heads): settings() reports them, so that ranks and a
    # checkpoint's weights are held to one value. A module of yours names its own.
    SETTINGS: tuple[str, ...] = ()
    RUN_SETTINGS: tuple[str, ...] = ()  # those of SETTINGS a run may change over the same weights

    def __setattr__(self, name, value):
        """Name parameters by their path in the module tree as soon as they join it, so every error
        names the parameter ('blocks.0.attn.c_attn.weight'), sharded or not. A module attached to a
        parent remembers it, so a later change deep inside (tying `lm_head.weight = wte.weight`)
        renames the tree from its root: a tied weight keeps the name where it is first found."""
        object.__setattr__(self, name, value)
        if name == "training" or name in type(self).SETTINGS:
            _SETTINGS_CHANGED[0] += 1
        if name.startswith("_") or not _holds_parameters(value):
            return
        _SETTINGS_CHANGED[0] += 1  # a module attached: its settings join the model's
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

    def settings(self, of_the_weights: bool = False) -> dict:
        """Each module's settings that change what it computes, by module name: `training` and its
        SETTINGS. of_the_weights: only those a checkpoint's weights were made for (not train/eval,
        not RUN_SETTINGS such as a dropout rate). fully_shard holds the ranks to one value of each
        (fsdp/model.py `ShardedModel.check_inputs`), checkpoints to the saved one."""
        found = {}
        for name, m in self.named_modules():
            names = [k for k in m.SETTINGS if not (of_the_weights and k in m.RUN_SETTINGS)]
            values = {k: _plain(getattr(m, k, None), m, k) for k in names}
            if not of_the_weights:
                values["training"] = bool(m.training)
            if values:
                found[name] = values
        return found

    def random_state(self) -> dict:
        """Where each module's random draws stand (a Dropout's count of masks drawn), by module name:
        checkpoints save it, so that a resumed run draws the masks the uninterrupted one would have."""
        return {
            name: m._calls for name, m in self.named_modules() if isinstance(getattr(m, "_calls", None), int)
        }

    def load_random_state(self, state: dict):
        """Put back what random_state() gave (names this model lacks are refused: another model)."""
        modules = dict(self.named_modules())
        wrong = [
            n
            for n, calls in state.items()
            if not (n in modules and hasattr(modules[n], "_calls") and is_count(calls))
        ]
        if wrong:
            raise ValueError(
                f"random state for {wrong[:3]}: not this model's random modules, or not counts >= 0"
            )
        for name, calls in state.items():
            modules[name]._calls = calls

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


_SETTINGS_CHANGED = [0]  # bumped whenever a module's setting (or a module) is assigned, in any model


def settings_changes() -> int:
    """How many times any module's setting was assigned in this process: a model's settings() can be
    reused while this stays the same (a forward compares them across ranks, at no cost then)."""
    return _SETTINGS_CHANGED[0]


def _plain(value, module=None, name: str = ""):
    """A setting as JSON holds it (a NumPy scalar as a Python number), so ranks and files compare it;
    anything else (an object whose text holds its address differs on every rank) is refused."""
    value = value.item() if hasattr(value, "item") and getattr(value, "ndim", None) == 0 else value
    if value is not None and not isinstance(value, (bool, int, float, str)):
        raise TypeError(
            f"{type(module).__name__}.SETTINGS names {name}={value!r}: settings are plain values "
            "(numbers, strings, booleans, None), compared across ranks and saved with checkpoints"
        )
    return value
