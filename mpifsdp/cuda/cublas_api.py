"""cuBLAS's C API through ctypes, for the GEMMs of cuda/gemm.py.

CuPy's cuBLAS bindings refuse every call while a stream captures a CUDA graph (CuPy 14: "calling
cuBLAS API during stream capture is currently unsupported", met by fsdp/graphed.py),
though cuBLAS itself captures as long as it allocates nothing meanwhile. So the GEMMs call the
libcublas CuPy loaded (backend.cublas_library) on a handle of ours, which runs on every stream with
a workspace of ours: cuBLAS then allocates none, and a graph that captured a GEMM finds its
workspace kept here. cublasSetStream puts a handle back on cuBLAS's own workspaces, so ours is set
again after it. tools/gpusim/cupy_standin.py stands in for the library on a machine without a GPU.
"""

from __future__ import annotations

import ctypes

import numpy as np

from ..base import backend
from ..base.kernels import device_address

# cuBLAS's and CUDA's enumerations (cublas_api.h, library_types.h)
OP_N, OP_T = 0, 1
COMPUTE_32F, COMPUTE_64F = 68, 70
GEMM_DEFAULT_TENSOR_OP = 99
DATA_TYPES = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 14}
WORKSPACE_BYTES = 32 << 20  # NVIDIA's advice for Hopper; older GPUs use part of it

_INT, _POINTER = ctypes.c_int, ctypes.c_void_p
# cublasGemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype,
# ldc, computeType, algo)
_GEMM_EX_ARGS = [_POINTER, *[_INT] * 5, _POINTER, _POINTER, _INT, _INT, _POINTER, _INT, _INT, _POINTER]
_GEMM_EX_ARGS += [_POINTER, _INT, _INT, _INT, _INT]


class _Handle:
    """A cuBLAS handle of ours on one device, with a workspace for each stream it has run on."""

    def __init__(self, lib, xp):
        self.lib, self.xp = lib, xp
        lib.cublasGemmEx.argtypes = _GEMM_EX_ARGS
        self.ptr = _POINTER()
        _check(lib.cublasCreate_v2(ctypes.byref(self.ptr)), "cublasCreate")
        self.stream, self.workspaces = None, {}

    def on_current_stream(self):
        """The handle, set to the current stream and that stream's workspace (again only when the
        stream is another than the last call's)."""
        stream = self.xp.cuda.get_current_stream().ptr
        if stream != self.stream:
            if stream not in self.workspaces:
                self.workspaces[stream] = self.xp.empty(WORKSPACE_BYTES, dtype=np.uint8)
            workspace = _POINTER(device_address(self.workspaces[stream]))
            _check(self.lib.cublasSetStream_v2(self.ptr, _POINTER(stream)), "cublasSetStream")
            size = ctypes.c_size_t(WORKSPACE_BYTES)
            _check(self.lib.cublasSetWorkspace_v2(self.ptr, workspace, size), "cublasSetWorkspace")
            self.stream = stream
        return self.ptr


_HANDLES: dict = {}  # device id -> _Handle


def _handle() -> _Handle:
    xp = backend.array_module("cuda")
    device = xp.cuda.Device().id
    if device not in _HANDLES:
        _HANDLES[device] = _Handle(backend.cublas_library(), xp)
    return _HANDLES[device]


def bind_current_stream() -> None:
    """Give the current stream its workspace now: before a capture begins on it, so that nothing is
    allocated for cuBLAS while the stream captures."""
    _handle().on_current_stream()


def gemm_ex(transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, compute) -> None:
    """cublasGemmEx on the current stream: c (m x n, column-major) = alpha op(a) op(b) + beta c, with
    a, b and c given as (device address, dtype) and alpha, beta as host addresses of scalars of the
    compute type (read when called: a captured graph keeps their values)."""
    handle = _handle()
    (a, a_type), (b, b_type), (c, c_type) = (
        (address, DATA_TYPES[np.dtype(t).name]) for address, t in (a, b, c)
    )
    args = (transa, transb, m, n, k, alpha, a, a_type, lda, b, b_type, ldb, beta, c, c_type, ldc, compute)
    status = handle.lib.cublasGemmEx(handle.on_current_stream(), *args, GEMM_DEFAULT_TENSOR_OP)
    _check(status, "cublasGemmEx")


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed: cuBLAS status {status} (cublas_api.h's cublasStatus_t)")
