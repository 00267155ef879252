"""A stand-in for cuDNN Frontend's Python graphs on a CPU, beside tools/gpusim/cupy_standin.py: the calls
mpifsdp/cuda/sdpa.py makes, with each SDPA graph's execute run as a NumPy twin on the
memory its tensors' addresses and strides name (the stand-in's arrays are host memory). The twin
computes as flash attention does: float32 arithmetic, the probabilities P (and dS in backward)
rounded to the element type before their products, one log-sum-exp per row kept for backward.
Each execute counts one launch. The graphs' construction itself is checked against the real
library by bench/cudnn_check.py; this checks what mpifsdp binds to them and what it gets back.

BROKEN = {"causal": True} plants a fault (the twin then ignores the causal mask) for the tests.
"""

from __future__ import annotations

import types

import numpy as np

from mpifsdp.base.checks import bfloat16
from mpifsdp.base.kernels import host_array

from .cupy_standin import _launch, on_device

BROKEN: dict = {}
_TYPES = {"HALF": np.float16, "FLOAT": np.float32, "BFLOAT16": "bfloat16"}  # bfloat16: ml_dtypes', when asked


def _numpy_type(data_type: str):
    kind = _TYPES[data_type]
    return bfloat16() if kind == "bfloat16" else kind


class _Tensor:
    def __init__(self, name, dim, stride, data_type):
        self.name, self.dim, self.stride, self.data_type = name, list(dim), list(stride), data_type

    def set_output(self, _):
        return self

    def set_dim(self, dim):
        self.dim = list(dim)
        return self

    def set_stride(self, stride):
        self.stride = list(stride)
        return self

    def set_data_type(self, data_type):
        self.data_type = data_type
        return self


def _view(address: int, t: _Tensor) -> np.ndarray:
    """The strided array `t` describes at `address`."""
    dtype = np.dtype(_numpy_type(t.data_type))
    flat = host_array(address, dtype, 1 + sum((d - 1) * s for d, s in zip(t.dim, t.stride)))
    return np.lib.stride_tricks.as_strided(flat, t.dim, [s * dtype.itemsize for s in t.stride])


def _scores(q, k, scale):
    T = q.shape[-2]
    s = q @ k.swapaxes(-1, -2) * np.float32(scale)
    if not BROKEN.get("causal"):
        s[..., np.triu(np.ones((T, T), dtype=bool), k=1)] = -np.inf
    return s


def _forward(a, scale, io):
    q, k, v = (a[n].astype(np.float32) for n in ("q", "k", "v"))
    s = _scores(q, k, scale)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    rows = p.sum(axis=-1, keepdims=True)
    a["o"][...] = (p.astype(io).astype(np.float32) @ v) / rows
    a["stats"][...] = m + np.log(rows)


def _backward(a, scale, io):
    q, k, v, o, go = (a[n].astype(np.float32) for n in ("q", "k", "v", "o", "dO"))
    p = np.exp(_scores(q, k, scale) - a["stats"])
    ds = p * (go @ v.swapaxes(-1, -2) - (go * o).sum(axis=-1, keepdims=True))
    ds = ds.astype(io).astype(np.float32)
    a["dq"][...] = ds @ k * np.float32(scale)
    a["dk"][...] = ds.swapaxes(-1, -2) @ q * np.float32(scale)
    a["dv"][...] = p.astype(io).astype(np.float32).swapaxes(-1, -2) @ go


class pygraph:  # noqa: N801 - cuDNN's name
    def __init__(self, io_data_type=None, intermediate_data_type=None, compute_data_type=None, **_):
        self.io, self.node, self.planned = io_data_type, None, False

    def tensor(self, name, dim, stride, data_type):
        return _Tensor(name, dim, stride, data_type)

    def sdpa(self, name, q, k, v, generate_stats, attn_scale, use_causal_mask):
        o, stats = _Tensor("o", q.dim, q.stride, self.io), _Tensor("stats", q.dim[:3] + [1], [], "FLOAT")
        self.node = (_forward, attn_scale, {"q": q, "k": k, "v": v, "o": o, "stats": stats})
        return o, stats

    def sdpa_backward(self, name, q, k, v, o, dO, stats, attn_scale, use_causal_mask):  # noqa: N803
        grads = tuple(_Tensor(n, q.dim, q.stride, self.io) for n in ("dq", "dk", "dv"))
        tensors = {"q": q, "k": k, "v": v, "o": o, "dO": dO, "stats": stats}
        self.node = (_backward, attn_scale, {**tensors, **dict(zip(("dq", "dk", "dv"), grads))})
        return grads

    def validate(self):
        assert self.node is not None and all(len(t.dim) == len(t.stride) == 4 for t in self.node[2].values())

    def build_operation_graph(self):
        pass

    def create_execution_plans(self, modes):
        pass

    def check_support(self):
        pass

    def build_plans(self):
        self.planned = True

    def get_workspace_size(self):
        return 1 << 10

    @on_device
    def execute(self, pointers: dict, workspace: int, handle=None):
        assert self.planned and workspace, "executed before its plans were built, or with no workspace"
        _launch("cudnn sdpa")
        run, scale, tensors = self.node
        by_tensor = {id(t): address for t, address in pointers.items()}
        run({n: _view(by_tensor[id(t)], t) for n, t in tensors.items()}, scale, _numpy_type(self.io))


def module() -> types.ModuleType:
    cudnn = types.ModuleType("cudnn")
    cudnn.pygraph = pygraph
    cudnn.data_type = types.SimpleNamespace(HALF="HALF", FLOAT="FLOAT", BFLOAT16="BFLOAT16")
    cudnn.heur_mode = types.SimpleNamespace(A="A", FALLBACK="FALLBACK")
    cudnn.backend_version = lambda: 92700
    cudnn.create_handle = lambda: object()
    cudnn.set_stream = lambda handle, stream: None
    return cudnn
