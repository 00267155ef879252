"""Causal attention on a GPU through cuDNN's fused (flash) scaled dot-product attention.

Without it, attention.py builds the (B, heads, T, T) scores, softmaxes them and recomputes them in
backward: 4 launches forward and 10 backward a layer, most of a GPU step's time. cuDNN's SDPA
(the nvidia-cudnn-frontend package, with libcudnn.so.9 from nvidia-cudnn-cu12 or -cu13) reads q, k
and v straight out of the fused (B, T, 3C) projection by their strides, writes the heads side by
side into (B, T, C) and one float32 log-sum-exp per row, and its backward writes dq, dk and dv into
the (B, T, 3C) gradient: one launch each way and no T x T array. cuDNN's SDPA takes float16 and
bfloat16; other dtypes and MPIFSDP_FUSED=0 run attention.py's passes; a shape its engines refuse, or
no cuDNN, raises (base/kernels.py slow_path) unless MPIFSDP_ALLOW_SLOW=1 accepts those passes.
Graphs are built once per shape and cached, with one workspace for all; each shape is checked
against a float64 reference at its first use.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np

from ..base import kernels as gk
from ..base.backend import array_module_of, to_numpy
from ..base.checks import finfo

log = logging.getLogger(__name__)

IO_TYPES = {"float16": "HALF", "bfloat16": "BFLOAT16"}  # numpy dtype name -> cudnn.data_type
PROBE_POSITIONS = 64  # of the first-use check (one sequence, the model's heads and head size)


class Saved(NamedTuple):
    """What backward needs: the graphs, the output (the projection's input, kept anyway) and the row
    statistics (one float32 log-sum-exp per head and position). A tuple, so graph_nbytes counts it."""

    graphs: object
    out: object
    stats: object


class Graphs:
    """The forward and backward SDPA graphs of one shape and the tensors each execute binds."""

    def __init__(self, forward, forward_tensors, backward, backward_tensors):
        self.forward, self.forward_tensors = forward, forward_tensors
        self.backward, self.backward_tensors = backward, backward_tensors


def build_graphs(cudnn, shape, dtype_name: str, scale: float, **graph_args) -> Graphs:
    """The two graphs of `shape` = (B, heads, T, head size), validated and lowered to cuDNN's operation
    graph; graph_args: `handle=` on a device, `device_property=` to check them without one (CI)."""
    B, H, T, D = shape
    io, f32 = getattr(cudnn.data_type, IO_TYPES[dtype_name]), cudnn.data_type.FLOAT
    qkv_stride, out_stride, stats_stride = (
        [T * 3 * H * D, D, 3 * H * D, 1],
        [T * H * D, D, H * D, 1],
        [H * T, T, 1, 1],
    )

    def graph():
        return cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, **graph_args)

    def tensor(g, name, stride, data_type=io, dim=(B, H, T, D)):
        return g.tensor(name=name, dim=list(dim), stride=list(stride), data_type=data_type)

    f = graph()
    q, k, v = (tensor(f, name, qkv_stride) for name in "qkv")
    o, stats = f.sdpa(
        name="attention", q=q, k=k, v=v, generate_stats=True, attn_scale=scale, use_causal_mask=True
    )
    o.set_output(True).set_dim([B, H, T, D]).set_stride(out_stride)
    stats.set_output(True).set_data_type(f32).set_dim([B, H, T, 1]).set_stride(stats_stride)
    b = graph()
    bq, bk, bv = (tensor(b, name, qkv_stride) for name in "qkv")
    bo, bg = tensor(b, "o", out_stride), tensor(b, "dO", out_stride)
    bstats = tensor(b, "stats", stats_stride, f32, (B, H, T, 1))
    grads = b.sdpa_backward(
        name="attention_backward",
        q=bq,
        k=bk,
        v=bv,
        o=bo,
        dO=bg,
        stats=bstats,
        attn_scale=scale,
        use_causal_mask=True,
    )
    for grad in grads:  # written straight into the (B, T, 3C) gradient
        grad.set_output(True).set_dim([B, H, T, D]).set_stride(qkv_stride)
    for g in (f, b):
        g.validate()
        g.build_operation_graph()
    return Graphs(f, (q, k, v, o, stats), b, (bq, bk, bv, bo, bg, bstats, *grads))


class _Library:
    """This process's cuDNN: the module (None where it cannot load), one handle, the graphs of every
    shape met (None where cuDNN refused it) and one workspace large enough for all of them."""

    def __init__(self):
        self.tried, self.cudnn, self.handle, self.graphs, self.workspace = False, None, None, {}, None
        self.failure = ""  # why cudnn could not load


_LIBRARY = _Library()


def _cudnn():
    """cudnn with a handle; where it cannot load, SlowPathError saying why and what to install (with
    MPIFSDP_ALLOW_SLOW=1: None, one warning, and attention runs as batched passes)."""
    if not _LIBRARY.tried:
        _LIBRARY.tried = True
        try:
            import cudnn

            cudnn.backend_version()  # loads libcudnn.so.9
            _LIBRARY.handle, _LIBRARY.cudnn = cudnn.create_handle(), cudnn
        except Exception as exc:  # not installed, no libcudnn.so.9, a driver it cannot use
            _LIBRARY.failure = (
                f"{type(exc).__name__}: {exc}; `pip install --no-deps nvidia-cudnn-frontend` and `pip "
                "install nvidia-cudnn-cu12` (or -cu13) provide it"
            )
    if _LIBRARY.cudnn is None:
        gk.slow_path("cuDNN's fused attention", _LIBRARY.failure)
    return _LIBRARY.cudnn


def version() -> str:
    """'cuDNN <n>' where the fused attention can run on this device, else why not (a run's preflight)."""
    try:
        cudnn = _cudnn()
    except gk.SlowPathError as exc:
        return f"unavailable: {exc}"
    if cudnn is None:
        return "unavailable (see the warning)"
    return f"cuDNN {cudnn.backend_version()}"


def _planned(cudnn, shape, dtype_name: str, scale: float):
    """The graphs of one shape with their execution plans built (once: cached), or None where cuDNN
    refuses the shape (said once)."""
    key = (shape, dtype_name, scale)
    if key not in _LIBRARY.graphs:
        try:
            graphs = build_graphs(cudnn, shape, dtype_name, scale, handle=_LIBRARY.handle)
            for graph in (graphs.forward, graphs.backward):
                graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
                graph.check_support()
                graph.build_plans()
            graphs.workspace_bytes = max(g.get_workspace_size() for g in (graphs.forward, graphs.backward))
        except Exception as exc:
            gk.slow_path(f"cuDNN's attention of shape {shape} in {dtype_name}", f"cuDNN refuses it: {exc}")
            graphs = None
        _LIBRARY.graphs[key] = graphs
    return _LIBRARY.graphs[key]


def graphs_for(qkv, n_head: int, scale: float):
    """The planned graphs attention of this (B, T, 3C) projection runs on, checked against a float64
    reference at the first use of its dtype and head size; None where cuDNN's SDPA does not run it."""
    xp = array_module_of(qkv)
    if qkv.dtype.name not in IO_TYPES or not gk.fused_enabled() or _cudnn() is None:
        return None
    B, T, C3 = qkv.shape
    head = C3 // (3 * n_head)
    graphs = _planned(_LIBRARY.cudnn, (B, n_head, T, head), qkv.dtype.name, scale)
    if graphs is not None:
        key = ("cudnn_sdpa", qkv.dtype.type, head)
        gk.checked_once(key, lambda: _probe(xp, qkv.dtype, n_head, head, min(T, PROBE_POSITIONS), scale))
    return graphs


def workspace():
    """The workspace cuDNN's graphs execute with now (None before the first): a CUDA graph that
    captured them keeps it alive, since a larger shape met later replaces it (fsdp/graphed.py)."""
    return _LIBRARY.workspace


def _execute(xp, graph, pointers: dict, workspace_bytes: int):
    """One launch of `graph` on the current stream, tensors bound by device address."""
    if _LIBRARY.workspace is None or _LIBRARY.workspace.size < workspace_bytes:
        _LIBRARY.workspace = xp.empty(max(workspace_bytes, 1), dtype=xp.uint8)
    _LIBRARY.cudnn.set_stream(handle=_LIBRARY.handle, stream=xp.cuda.get_current_stream().ptr)
    graph.execute(pointers, _LIBRARY.workspace.data.ptr, handle=_LIBRARY.handle)


def _heads(a, C: int):
    """The device addresses of q, k and v (or their gradients) in a (B, T, 3C) array."""
    p, item = a.data.ptr, a.dtype.itemsize
    return p, p + C * item, p + 2 * C * item


def forward(graphs, qkv, n_head: int):
    """(out (B, T, C), Saved) of causal attention on the contiguous projection `qkv`."""
    xp = array_module_of(qkv)
    B, T, C3 = qkv.shape
    out = xp.empty((B, T, C3 // 3), dtype=qkv.dtype)
    stats = xp.empty((B, n_head, T, 1), dtype=np.float32)
    q, k, v, o, s = graphs.forward_tensors
    pointers = dict(zip((q, k, v), _heads(qkv, C3 // 3)))
    _execute(xp, graphs.forward, {**pointers, o: out.data.ptr, s: stats.data.ptr}, graphs.workspace_bytes)
    return out, Saved(graphs, out, stats)


def backward(g, saved: Saved, qkv):
    """The (B, T, 3C) gradient of the projection, from the output's gradient g (B, T, C)."""
    xp = array_module_of(qkv)
    g = xp.ascontiguousarray(g)
    gqkv = xp.empty_like(qkv)
    graphs = saved.graphs
    q, k, v, o, dout, s, dq, dk, dv = graphs.backward_tensors
    C = qkv.shape[-1] // 3
    pointers = {**dict(zip((q, k, v), _heads(qkv, C))), **dict(zip((dq, dk, dv), _heads(gqkv, C)))}
    pointers.update({o: saved.out.data.ptr, dout: g.data.ptr, s: saved.stats.data.ptr})
    _execute(xp, graphs.backward, pointers, graphs.workspace_bytes)
    return gqkv


def _probe(xp, dtype, n_head: int, head: int, T: int, scale: float):
    """cuDNN's output and gradients on a small random problem against float64 ones, each divided by
    the magnitude its terms sum to (so one bound serves every element, see `reference`)."""
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((1, T, 3 * n_head * head)).astype(dtype)
    g = rng.standard_normal((1, T, n_head * head)).astype(dtype)
    graphs = _planned(_LIBRARY.cudnn, (1, n_head, T, head), dtype.name, scale)
    if graphs is None:
        raise RuntimeError(
            f"cuDNN's SDPA takes the model's attention but not its check's shape {(1, n_head, T, head)}"
        )
    out, saved = forward(graphs, xp.asarray(qkv), n_head)
    gqkv = backward(xp.asarray(g), saved, xp.asarray(qkv))
    want, magnitude = reference(qkv, g, n_head, scale)
    got = dict(
        zip(("out", "dq", "dk", "dv"), (_split(to_numpy(out), n_head), *_split_qkv(to_numpy(gqkv), n_head)))
    )
    bound, floor = error_bound(dtype, T)
    return [
        (name, got[name] / (magnitude[name] + floor), want[name] / (magnitude[name] + floor), bound)
        for name in want
    ]


def error_bound(dtype, T: int) -> tuple[float, float]:
    """(bound, floor): cuDNN's results on T positions differ from float64's by at most bound times
    (their magnitude + floor). Per term of each sum an operand is rounded to the element type once
    (flash attention's P, and dS in backward) and the output once; the sums of up to 2T terms run
    in float32. A result below the element type's normal range is rounded to its subnormal spacing,
    an error not relative to itself (a float16 dk near 1e-6 was off by many eps of its magnitude,
    bench/HISTORY.md): that spacing, over the bound, is the floor."""
    io = finfo(dtype)
    bound = 8 * float(io.eps) + 2 * T * float(np.finfo(np.float32).eps)
    return bound, float(io.smallest_subnormal) / bound


def _split(a, n_head: int):
    B, T, C = a.shape
    return a.astype(np.float64).reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3)


def _split_qkv(a, n_head: int):
    B, T, C3 = a.shape
    return a.astype(np.float64).reshape(B, T, 3, n_head, C3 // (3 * n_head)).transpose(2, 0, 3, 1, 4)


def reference(qkv, g, n_head: int, scale: float):
    """Causal attention's output and q/k/v gradients in float64 on the host, each with the sum of its
    terms' magnitudes (|P| |V| for the output, and so on): what rounding errors scale with."""
    q, k, v = _split_qkv(qkv, n_head)
    go = _split(g, n_head)
    T = q.shape[-2]
    s = q @ k.swapaxes(-1, -2) * scale
    s[..., np.triu(np.ones((T, T), dtype=bool), k=1)] = -np.inf
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = p @ v
    dp = go @ v.swapaxes(-1, -2)
    ds = p * (dp - (go * out).sum(axis=-1, keepdims=True)) * scale
    ds_size = p * (np.abs(dp) + (np.abs(go) * np.abs(out)).sum(axis=-1, keepdims=True)) * scale
    want = {"out": out, "dq": ds @ k, "dk": ds.swapaxes(-1, -2) @ q, "dv": p.swapaxes(-1, -2) @ go}
    tiny = np.finfo(np.float64).tiny
    magnitude = {
        "out": p @ np.abs(v) + tiny,
        "dq": ds_size @ np.abs(k) + tiny,
        "dk": ds_size.swapaxes(-1, -2) @ np.abs(q) + tiny,
        "dv": p.swapaxes(-1, -2) @ np.abs(go) + tiny,
    }
    return want, magnitude
