"""A NumPy-backed stand-in for CuPy: what a training step would launch and wait for on a GPU, counted
on a CPU (bench/gpu_budget.py). `install()` puts it in sys.modules as cupy, cupyx and
cupy.cuda.nccl before mpifsdp imports them; its arrays' type lives in a module named "cupy", so
mpifsdp takes its GPU branches.

Counted, by phase (set `PHASE[0]`): a launch for every ufunc call, reduction, matmul, copy, indexed
gather or scatter, fill (a filled new array, or ndarray.fill) and one of mpifsdp's own kernels
(CuPy issues one kernel for each); a host sync for every float()/int()/bool()/item()/get(), a
boolean-mask index (its size is read back) and an eventQuery. NCCL runs through MPI on host memory
(on one rank it copies; GPUS[0] GPUs a node, so N ranks with N GPUs choose it). Our raw
kernels run as their NumPy twins (with STANDIN_KERNELS=source as their CUDA source itself, built by
g++: kernel_emulator.py), our elementwise kernels as NumPy formulas of the same math,
cuDNN's attention as tools/gpusim/cudnn_standin.py's twin. The time all that takes is the device's
(`on_device`, DEVICE_S): the rest of a step's wall time is its host's.

CUDA graphs (Stream.begin_capture / end_capture, Graph.launch) as a GPU runs them: while a stream
captures, every launch is recorded as a thunk (the same call, on the same arrays: a graph binds
addresses and freezes the values it took by value) and nothing it did stays done (the device's
memory is restored at end_capture, and what the capture allocated is poisoned: a graph's work happens
at launch). What a capture refuses raises CaptureError: a host sync, a copy from pageable host
memory, a collective on a stream the capture does not reach, work forked onto another stream and not
joined back. Graph.launch replays the thunks in order.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import os
import sys
import time
import types
import weakref

import numpy as np

LAUNCHES: collections.Counter = collections.Counter()  # (phase, kind) -> count
SYNCS: collections.Counter = collections.Counter()
RECORD: list | None = None  # while a list: (phase, kind, what it takes from the host, where) a launch
PHASE = ["setup"]
GPUS = [1]  # GPUs on the stand-in's node: set to the ranks' count for one rank per GPU (NCCL)
DEVICE_S = [0.0]  # seconds spent doing what a GPU would (the NumPy work of every launch, copy, sync)
_DEPTH = [0]
_ROOTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> every device buffer alive
_CAPTURE: list = [None]  # the stream capture in progress, if any
_REPLAYING = [False]


class CaptureError(RuntimeError):
    """What CUDA refuses while a stream captures (cudaErrorStreamCaptureUnsupported and kin)."""


def on_device(work):
    """`work` timed as the device's, not the host's: a step's host time is its wall time less this
    (the Python a GPU step would run on its host: mpifsdp's own, with CuPy's calls taken as free)."""

    @functools.wraps(work)
    def timed(*args, **kwargs):
        if _DEPTH[0]:
            return work(*args, **kwargs)
        _DEPTH[0] += 1
        start = time.perf_counter()
        try:
            result = work(*args, **kwargs)
            _keep_roots(result)
            if _CAPTURE[0] is not None:
                _CAPTURE[0].record(work, args, kwargs, result)
            return result
        finally:
            DEVICE_S[0] += time.perf_counter() - start
            _DEPTH[0] -= 1

    return timed


def _launch(kind: str, host=()):
    """Count a launch; while RECORD is a list, also note what it takes from the host by value (its
    scalars, the bytes a host-to-device copy reads): what a CUDA graph would freeze at capture."""
    if _REPLAYING[0]:  # a graph's launches were counted as one
        return
    if _CAPTURE[0] is not None and kind == "host-to-device copy":
        raise CaptureError(
            "a copy from pageable host memory cannot be captured (the host's bytes are read now)"
        )
    LAUNCHES[(PHASE[0], kind)] += 1
    if RECORD is not None:
        RECORD.append((PHASE[0], kind, _host_values(host), _caller()))


def _caller() -> str:
    """The innermost mpifsdp function (its models' too) on the stack: where a recorded launch comes
    from; base/backend.py, which moves memory for its callers, is passed by (its caller is)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/mpifsdp/" in path and not path.endswith("/mpifsdp/base/backend.py"):
            return f"{path.rsplit('/mpifsdp/', 1)[1]}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _host_values(values) -> tuple:
    """Scalars as floats, host arrays as a digest of their bytes, device arrays left out."""
    taken = []
    for v in values:
        if isinstance(v, ndarray) or v is None:
            continue
        if isinstance(v, (np.ndarray, list, tuple)):
            taken.append(hash(np.ascontiguousarray(v).tobytes()))
        elif isinstance(v, (int, float, np.generic)):
            taken.append(float(v))
    return tuple(taken)


def _sync(kind: str):
    if _CAPTURE[0] is not None:
        raise CaptureError(f"a host sync ({kind}) while a stream captures: nothing has run yet")
    SYNCS[(PHASE[0], kind)] += 1


def _root(a):
    """The array that owns `a`'s buffer."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _keep_roots(result):
    """Note the buffers of a launch's results: the device's memory, as a capture must restore it, and
    the bytes alive (ALIVE)."""
    for a in result if isinstance(result, tuple) else (result,):
        if isinstance(a, np.ndarray):
            root = _root(a)
            if _ROOTS.get(id(root)) is not root:
                _ROOTS[id(root)] = root
                _alive(root.nbytes)
                weakref.finalize(root, _alive, -root.nbytes)


NCCL_VERSION = [22800]  # ncclGetVersion's code the stand-in's NCCL reports (--nccl-version)
ALIVE = {"bytes": 0, "peak": 0}  # device bytes alive now, and the most at once since the peak was reset


def _alive(change: int):
    ALIVE["bytes"] += change
    ALIVE["peak"] = max(ALIVE["peak"], ALIVE["bytes"])


def _host(x):
    return x.view(np.ndarray) if isinstance(x, ndarray) else x


def _unwrap(x):
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(i) for i in x)
    if isinstance(x, dict):
        return {k: _unwrap(v) for k, v in x.items()}
    return _host(x)


def _device(r):
    """A result as CuPy gives it: arrays on the device, 0-d arrays for scalars."""
    if isinstance(r, np.generic):
        return np.asarray(r).view(ndarray)
    if isinstance(r, np.ndarray) and not isinstance(r, ndarray):
        return r.view(ndarray)
    if isinstance(r, tuple):
        return tuple(_device(x) for x in r)
    return r


def _wrapped(parts: tuple, shape: tuple) -> tuple:
    """Integer-array indices wrapped into their axes, as CuPy's indexing does (NumPy raises on an index
    out of bounds; a device batch's ids are checked later, so the stand-in must index as a GPU does)."""
    return tuple(
        np.mod(_host(p), shape[axis]) if isinstance(p, np.ndarray) and p.dtype.kind in "iu" else p
        for axis, p in enumerate(parts)
    )


def _through_cupys_cublas():
    """CuPy's cuBLAS bindings (its matmul) refuse to run while the current stream captures, as CuPy
    14's do (seen on an H200); cuBLAS's C API captures (cublas_library: cuda/cublas_api.py's)."""
    if _current_stream().is_capturing():
        raise NotImplementedError("calling cuBLAS API during stream capture is currently unsupported")


def _all_bfloat16(inputs) -> bool:
    return all(getattr(a, "dtype", None) is not None and a.dtype.name == "bfloat16" for a in inputs)


@on_device
def _bfloat16_matmul(a, b, out=None):
    """CuPy's bfloat16 matmul: float32 products and sums (cuBLAS), the result rounded to bfloat16
    (ml_dtypes' own matmul returns float32)."""
    _launch("matmul")
    product = np.matmul(_host(a).astype(np.float32), _host(b).astype(np.float32))
    if out is None:
        return _device(product.astype(a.dtype))
    np.copyto(out[0], product, casting="unsafe")
    return _device(out[0])


class ndarray(np.ndarray):  # noqa: N801 - CuPy's name
    @on_device
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        outs = kwargs.get("out")
        if outs is not None:
            kwargs["out"] = tuple(_host(o) for o in outs)
        if ufunc is np.matmul:
            _through_cupys_cublas()
        if ufunc is np.matmul and _all_bfloat16(inputs):
            return _bfloat16_matmul(*inputs, **kwargs)
        result = getattr(ufunc, method)(*_unwrap(inputs), **kwargs)
        kind = "matmul" if ufunc is np.matmul else "elementwise" if method == "__call__" else method
        _launch(kind, inputs)
        if outs is not None and method == "__call__":  # `a /= b` is `a` itself, as in CuPy
            return outs[0] if len(outs) == 1 else outs
        return _device(result)

    @on_device
    def __array_function__(self, func, types_, args, kwargs):
        _launch(func.__name__)
        return _device(func(*_unwrap(args), **_unwrap(kwargs)))

    @on_device
    def __getitem__(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, np.ndarray) and p.dtype == bool for p in parts):
            _sync("boolean-mask index")
        if any(isinstance(p, (np.ndarray, list)) for p in parts):
            _launch("gather")
            index = _wrapped(parts, self.shape)
        return _device(np.ndarray.__getitem__(self, _unwrap(index)))

    @on_device
    def __setitem__(self, index, value):
        if isinstance(value, np.ndarray) and not isinstance(value, ndarray) and value.ndim:
            _launch("host-to-device copy", (value,))  # CuPy copies host values over first
        _launch("setitem", (value,))
        np.ndarray.__setitem__(_host(self), _unwrap(index), _host(value))

    @on_device
    def reshape(self, *shape, **kwargs):
        result = np.ndarray.reshape(self, *shape, **kwargs)
        if not np.shares_memory(_host(result), _host(self)):
            _launch("copy")
        return _device(result)

    @on_device
    def set(self, arr, stream=None):
        """A host array copied in (cudaMemcpy from pageable memory)."""
        _launch("host-to-device copy", (arr,))
        np.copyto(_host(self), arr)

    def __float__(self):
        _sync("float()")
        return float(_host(self))

    def __int__(self):
        _sync("int()")
        return int(_host(self))

    def __bool__(self):
        _sync("bool()")
        return bool(_host(self))

    def item(self):
        _sync("item()")
        return _host(self).item()

    @on_device
    def get(self, out=None, blocking=True):
        if blocking:
            _sync("get()")
        if out is None:
            return _host(self).copy()
        np.copyto(out, _host(self))  # blocking=False: queued (its stream's event says when it is done)
        return out

    @property
    @on_device  # what a CuPy array knows at once, found here through NumPy's ctypes: not the host's cost
    def data(self):  # .data.ptr: the buffer's address (NCCL copies through it)
        return types.SimpleNamespace(ptr=_host(self).ctypes.data)

    @property
    def device(self):
        return types.SimpleNamespace(id=0)


def _kernel_method(name: str):
    @on_device
    def method(self, *args, **kwargs):
        _launch("reduction" if name in ("sum", "max", "min", "any", "all", "mean") else name, args)
        return _device(getattr(_host(self), name)(*_unwrap(args), **_unwrap(kwargs)))

    return method


for _name in ("sum", "max", "min", "any", "all", "mean", "astype", "copy", "fill"):
    setattr(ndarray, _name, _kernel_method(_name))
ndarray.__module__ = "cupy"


def _fresh(make, fills: bool):
    @on_device
    def create(*args, **kwargs):
        result = np.asarray(make(*_unwrap(args), **_unwrap(kwargs)))
        out = np.empty(result.shape, result.dtype).view(ndarray)
        np.copyto(_host(out), result)
        if fills:
            _launch("fill")
        return out

    return create


def _poisoned(make):
    """np.empty (or empty_like) whose floats are NaN: device memory is not zeroed, and a kernel or
    pass that reads what nothing wrote must show it (fresh host pages would read as zeros)."""

    def create(*args, **kwargs):
        result = make(*args, **kwargs)
        if result.dtype.kind == "f" or result.dtype.name == "bfloat16":
            result.fill(np.nan)
        return result

    return create


@on_device
def _asarray(a, dtype=None, **_):
    """cupy.asarray: a device array of the asked dtype is returned as it is (no launch), anything
    else copied (or cast) into a new one."""
    if isinstance(a, ndarray) and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return _array(a, dtype)


def _array(a, dtype=None, **_):
    """cupy.array: always a new device array, a copy (or cast) of a."""
    _launch("copy" if isinstance(a, ndarray) else "host-to-device copy", (a,))
    return _fresh(np.asarray, False)(_host(a), dtype=dtype)


class _Event:
    def __init__(self, stream=None):
        self.stream = stream
        self.after = stream.launches if stream is not None else 0  # its stream's work before it
        self.captured = _CAPTURE[0] is not None  # a node of a graph, not an event a host can query
        self.ptr, self.at = id(self), time.perf_counter()  # the stand-in's "device" runs as the host does
        _EVENTS[self.ptr] = self

    def synchronize(self):
        _sync("event.synchronize()")


class _Stream:
    """A stream: the current one inside `with`, capturing between begin_capture and end_capture."""

    def __init__(self, priority: int = 0):
        self.ptr, self.priority = id(self), priority  # lower is sooner, as CUDA's
        self.launches = 0  # collectives queued on it (what a capture must see joined back)
        _STREAMS[self.ptr] = self

    def record(self, *_):
        return _Event(self)

    def wait_event(self, event):
        capture = _CAPTURE[0]
        if capture is not None and event.stream is not None:
            capture.ordered(self, event)

    def synchronize(self):
        _sync("stream.synchronize()")

    def __enter__(self):
        _CURRENT.append(self)
        return self

    def __exit__(self, *_):
        _CURRENT.pop()

    def begin_capture(self, mode=None):
        if _CAPTURE[0] is not None:
            raise CaptureError("a stream is capturing already")
        _CAPTURE[0] = _Capture(self)

    def end_capture(self):
        capture, _CAPTURE[0] = _CAPTURE[0], None
        if capture is None or capture.stream is not self:
            raise CaptureError("end_capture on a stream that is not capturing")
        return capture.end()

    def is_capturing(self):
        return _CAPTURE[0] is not None and _CAPTURE[0].stream is self


_STREAMS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # ptr -> stream
_EVENTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # ptr -> event
_CURRENT: list = []  # the streams entered, innermost last


def _current_stream():
    if not _CURRENT:
        _CURRENT.append(_Stream())  # the default stream, made once
    return _CURRENT[-1]


class _Capture:
    """One stream capture: the launches recorded as thunks, what the device held before, and which
    streams its work reaches (forked by waiting on its events, joined back by its stream waiting
    on theirs)."""

    def __init__(self, stream):
        self.stream, self.thunks = stream, []
        self.saved = [(root, root.copy()) for root in list(_ROOTS.values())]
        self.before = set(_ROOTS.keys())
        self.reached = {stream}
        self.joined: dict = {}  # forked stream -> its launches the capture stream waited for

    def record(self, work, args, kwargs, result):
        self.thunks.append((work, args, dict(kwargs), result))

    def ordered(self, stream, event):
        """`stream` waits for `event`: a fork into the capture, or a join back into its stream."""
        if event.stream in self.reached:
            self.reached.add(stream)
        if stream is self.stream and event.stream is not stream:
            self.joined[event.stream] = max(self.joined.get(event.stream, 0), event.after)

    def launch_on(self, stream):
        if stream not in self.reached:
            raise CaptureError(
                "a collective on a stream the capture does not reach would run now, not in the graph"
            )
        stream.launches += 1

    def end(self):
        for stream in self.reached - {self.stream}:
            if stream.launches > self.joined.get(stream, 0):
                raise CaptureError(
                    "work forked onto another stream was not joined back into the capturing stream "
                    "(cudaErrorStreamCaptureUnjoined)"
                )
        for root, saved in self.saved:  # nothing ran: the device holds what it held
            np.copyto(root, saved)
        for key, root in list(_ROOTS.items()):  # what the capture allocated holds nothing yet
            if key not in self.before and (root.dtype.kind == "f" or root.dtype.name == "bfloat16"):
                root.fill(np.nan)
        return _Graph(self.thunks)


class _Graph:
    """A captured graph: launch() runs its thunks again, in order, on the arrays they were given."""

    def __init__(self, thunks):
        self.thunks = thunks

    def upload(self, stream=None):
        pass

    @on_device
    def launch(self, stream=None):
        LAUNCHES[(PHASE[0], "graph launch")] += 1
        _REPLAYING[0] = True
        try:
            for work, args, kwargs, recorded in self.thunks:
                _copy_result(recorded, work(*args, **kwargs))
        finally:
            _REPLAYING[0] = False


def _copy_result(recorded, fresh):
    """A replayed launch's output into the buffer its capture returned (a graph writes there)."""
    if isinstance(recorded, tuple):
        for r, f in zip(recorded, fresh):
            _copy_result(r, f)
    elif isinstance(recorded, np.ndarray) and not np.may_share_memory(recorded, fresh):
        np.copyto(_host(recorded), _host(fresh))


def _event_query(ptr):
    if _CAPTURE[0] is not None:
        raise CaptureError("eventQuery while a stream captures: the event's work is not queued yet")
    if _EVENTS[ptr].captured:
        raise CaptureError(
            "eventQuery of an event recorded inside a capture: it marks a graph node, not work"
        )
    _sync("eventQuery")
    return 0


class ElementwiseKernel:
    """mpifsdp's own kernels (cuda/kernels.py), by name, as NumPy formulas of the same math."""

    def __init__(self, in_params, out_params, operation, name, preamble=""):
        self.name = name

    @on_device
    def __call__(self, *arrays):
        from mpifsdp.cuda.kernels import _C, _K

        _launch(self.name, arrays)
        a = [_host(x) for x in arrays]

        def sigmoid(x):
            return 1 / (1 + np.exp(np.clip(-2 * _C * (x + _K * x**3), -80, 80)))

        def slope(x, s):
            return s * (1 + x * (2 * _C + 6 * _C * _K * x * x) * (1 - s))

        if self.name == "mpifsdp_gelu":
            a[1][...] = a[0] * sigmoid(a[0])
        elif self.name == "mpifsdp_gelu_bias":
            x = (a[0] + a[1]).astype(a[0].dtype)  # rounded to T, as the kernel's (T) cast
            a[2][...] = x * sigmoid(x)
        elif self.name == "mpifsdp_gelu_grad":
            a[2][...] = a[0] * slope(a[1], sigmoid(a[1]))
        elif self.name == "mpifsdp_bias_residual":
            a[3][...] = (a[0] + a[1]) + a[2]  # rounded after each add, as the kernel's (T) casts
        elif self.name == "mpifsdp_gelu_and_grad":
            s = sigmoid(a[0])
            a[1][...] = a[0] * s
            a[2][...] *= slope(a[0], s)


class RawModule:
    """mpifsdp's raw kernels, each run as its NumPy twin (base/kernels.py TWINS: the same arguments),
    or with STANDIN_KERNELS=source as their CUDA source itself, built by g++ (kernel_emulator.py)."""

    def __init__(self, code="", options=()):
        self.emulated = None
        if os.environ.get("STANDIN_KERNELS") == "source":
            from . import kernel_emulator

            self.emulated = kernel_emulator.RawModule(code, host=_host)

    def get_function(self, name):
        from mpifsdp.base.kernels import TWINS

        run = self.emulated.get_function(name) if self.emulated else None

        @on_device
        def launch(grid, block, args, shared_mem=0):
            _launch(name, args)
            if run is not None:
                run(grid, block, args, shared_mem)
            else:
                TWINS[name](grid, block, tuple(_host(a) for a in args), shared_mem)

        return launch


class _MemoryPool:
    """cupy.cuda.MemoryPool: a private pool (a capture's); here every buffer is NumPy's."""

    def malloc(self, nbytes):
        raise NotImplementedError("the stand-in allocates with NumPy")

    def used_bytes(self):
        return 0

    def total_bytes(self):
        return 0


def _on_stream(stream_ptr):
    """A collective queued on the stream at stream_ptr: a capture must reach that stream."""
    if _CAPTURE[0] is not None:
        _CAPTURE[0].launch_on(_STREAMS[stream_ptr])


class _Nccl:
    """NCCL over MPI on host memory: the ranks' buffers gathered through an MPI communicator of the
    NCCL communicator's ranks (split from COMM_WORLD by the unique id: every rank must make its NCCL
    communicators in the same order, as Comm does), reductions summed in rank order (float32 for
    16-bit types, as NCCL accumulates them); on one rank the collectives copy."""

    def __init__(self, n, uid, rank):
        self.size, self.mpi = n, None
        if n > 1:
            from mpi4py import MPI

            self.mpi = MPI.COMM_WORLD.Split(int.from_bytes(uid[:3], "little"), rank)

    def _everyone(self, send, count: int, dtype) -> np.ndarray:
        """Every rank's `count` elements at `send`, as a (ranks, count) array."""
        from mpifsdp.base.kernels import host_array

        mine = host_array(send, _nccl_dtype(dtype), count)
        if self.mpi is None:
            return mine.reshape(1, -1).copy()
        everyone = np.empty((self.size, count), dtype=mine.dtype)
        self.mpi.Allgather(mine.view(np.uint8), everyone.view(np.uint8))
        return everyone

    def _write(self, recv, values, dtype):
        from mpifsdp.base.kernels import host_array

        np.copyto(host_array(recv, _nccl_dtype(dtype), values.size), values.reshape(-1), casting="unsafe")

    @staticmethod
    def _sum(everyone):
        acc = np.float64 if everyone.dtype.itemsize == 8 else np.float32
        return everyone.astype(acc).sum(axis=0) if everyone.dtype.kind != "i" else everyone.sum(axis=0)

    @on_device
    def allGather(self, send, recv, count, dtype, stream):  # noqa: N802 - NCCL's names
        _on_stream(stream)
        _launch("nccl allGather")
        self._write(recv, self._everyone(send, count, dtype), dtype)

    @on_device
    def reduceScatter(self, send, recv, count, dtype, op, stream):  # noqa: N802
        _on_stream(stream)
        _launch("nccl reduceScatter")
        rank = 0 if self.mpi is None else self.mpi.Get_rank()
        total = self._sum(self._everyone(send, count * self.size, dtype))
        self._write(recv, total[rank * count : (rank + 1) * count], dtype)

    @on_device
    def allReduce(self, send, recv, count, dtype, op, stream):  # noqa: N802
        _on_stream(stream)
        _launch("nccl allReduce")
        self._write(recv, self._sum(self._everyone(send, count, dtype)), dtype)

    @on_device
    def broadcast(self, send, recv, count, dtype, root, stream):
        _on_stream(stream)
        _launch("nccl broadcast")
        self._write(recv, self._everyone(send, count, dtype)[root], dtype)

    def check_async_error(self):
        pass


# cuBLAS's C API as cuda/cublas_api.py calls it through ctypes, on host addresses: the column-major
# product cublasGemmEx computes, in float32 (CUBLAS_COMPUTE_32F) or float64, and its workspace rule.
def _cuda_dtype(code: int):
    from mpifsdp.base.checks import bfloat16
    from mpifsdp.cuda.cublas_api import DATA_TYPES

    name = {c: n for n, c in DATA_TYPES.items()}[code]
    return bfloat16() if name == "bfloat16" else np.dtype(name)


def _column_major(address: int, dtype, rows: int, cols: int, ld: int) -> np.ndarray:
    """The (rows, cols) column-major matrix with leading dimension ld at a host address (a view)."""
    from mpifsdp.base.kernels import host_array

    flat = host_array(address, dtype, ld * (cols - 1) + rows)
    return np.lib.stride_tricks.as_strided(flat, (rows, cols), (dtype.itemsize, ld * dtype.itemsize))


def cublas_library():
    """libcublas's functions that cuda/cublas_api.py calls. As in cuBLAS, a handle runs on cuBLAS's own
    workspace until one is set, and cublasSetStream puts it back there; cuBLAS allocates its own at
    a stream's first GEMM, which a capturing stream refuses (CaptureError)."""
    has_workspace = {}  # handle -> whether one of ours is set

    def create(pointer):
        pointer._obj.value = len(has_workspace) + 1
        has_workspace[pointer._obj.value] = False
        return 0

    def set_stream(handle, stream):
        has_workspace[handle.value] = False
        return 0

    def set_workspace(handle, workspace, size):
        has_workspace[handle.value] = True
        return 0

    def gemm_ex(
        handle,
        transa,
        transb,
        m,
        n,
        k,
        alpha,
        A,
        a_type,
        lda,
        B,
        b_type,
        ldb,
        beta,
        C,
        c_type,
        ldc,
        compute,
        algo,
    ):  # noqa: N803
        """alpha and beta are read from host memory when it is called (a graph keeps the values it was
        captured with), the product when it runs."""
        if _current_stream().is_capturing() and not has_workspace[handle.value]:
            raise CaptureError("cuBLAS would allocate its workspace while the stream captures")
        scalar = ctypes.c_double if compute == 70 else ctypes.c_float  # 64F, 32F
        scale = tuple(scalar.from_address(address).value for address in (alpha, beta))
        _gemm(transa, transb, m, n, k, scale, (A, a_type, lda), (B, b_type, ldb), (C, c_type, ldc), compute)
        return 0

    library = types.SimpleNamespace(cublasCreate_v2=create, cublasSetStream_v2=set_stream)
    library.cublasSetWorkspace_v2, library.cublasGemmEx = set_workspace, gemm_ex
    return library


@on_device
def _gemm(transa, transb, m, n, k, scale, a, b, c, compute):
    """C = scale[0] * op(A) op(B) + scale[1] * C, each matrix given as (address, type, leading dim)."""
    acc = np.float64 if compute == 70 else np.float32
    _launch("matmul", scale)
    (A, a_type, lda), (B, b_type, ldb), (C, c_type, ldc) = a, b, c
    ops = []
    for address, code, ld, trans, shape in (
        (A, a_type, lda, transa, (m, k)),
        (B, b_type, ldb, transb, (k, n)),
    ):
        dtype = _cuda_dtype(code)
        rows, cols = shape if trans == 0 else shape[::-1]
        matrix = _column_major(address, dtype, rows, cols, ld).astype(acc)
        ops.append(matrix if trans == 0 else matrix.T)
    out = _column_major(C, _cuda_dtype(c_type), m, n, ldc)
    product = scale[0] * (ops[0] @ ops[1])
    if scale[1]:
        product += scale[1] * out.astype(acc)
    np.copyto(out, product, casting="unsafe")


_NCCL_TYPES = ["NCCL_INT64", "NCCL_FLOAT16", "NCCL_FLOAT32", "NCCL_FLOAT64", "NCCL_BFLOAT16"]


def _nccl_dtype(code: int):
    """The NumPy dtype of an NCCL type code (their order in _NCCL_TYPES)."""
    from mpifsdp.base.checks import bfloat16

    name = _NCCL_TYPES[code].removeprefix("NCCL_").lower()
    return bfloat16() if name == "bfloat16" else np.dtype(name)


def install():
    """Make `import cupy` (and cupyx, cupy.cuda.nccl) give the stand-ins; call before importing
    mpifsdp (gpusim.install adds cuDNN's)."""
    cp = types.ModuleType("cupy")
    for name in dir(np):
        if not name.startswith("_"):
            setattr(cp, name, getattr(np, name))
    cp.__version__, cp.ndarray = "stand-in", ndarray
    for name in ("empty", "empty_like"):
        setattr(cp, name, _fresh(_poisoned(getattr(np, name)), False))
    for name in ("zeros", "zeros_like", "ones", "ones_like", "full", "arange"):
        setattr(cp, name, _fresh(getattr(np, name), True))
    cp.asarray, cp.array = _asarray, _array
    cp.ascontiguousarray = lambda a: a if _host(a).flags.c_contiguous else _array(a)
    cp.ElementwiseKernel, cp.RawModule = ElementwiseKernel, RawModule
    as_strided = functools.partial(np.lib.stride_tricks.as_strided, subok=True)  # a view: no launch
    cp.lib = types.SimpleNamespace(stride_tricks=types.SimpleNamespace(as_strided=as_strided))
    cp.get_default_memory_pool = lambda: types.SimpleNamespace(  # a pool that held the most ever alive
        total_bytes=lambda: ALIVE["peak"], used_bytes=lambda: ALIVE["bytes"], free_all_blocks=lambda: None
    )
    properties = {"name": b"gpusim stand-in", "totalGlobalMem": 16 << 30}  # what the scripts read
    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: GPUS[0],
        eventQuery=_event_query,
        getDeviceProperties=lambda index: properties,
        deviceGetStreamPriorityRange=lambda: (0, -5),  # an H100's and an H200's
        runtimeGetVersion=lambda: 13000,
    )

    def device(i=0):
        return types.SimpleNamespace(
            use=lambda: None, id=i, synchronize=lambda: _sync("device.synchronize()")
        )

    cp.cuda = types.SimpleNamespace(
        get_current_stream=_current_stream,
        get_elapsed_time=lambda start, end: (end.at - start.at) * 1e3,  # milliseconds, as CuPy's
        Stream=lambda priority=0, **_: _Stream(priority),
        MemoryPool=_MemoryPool,
        using_allocator=lambda allocator=None: contextlib.nullcontext(),
        runtime=runtime,
        Device=device,
    )
    nccl = types.ModuleType("cupy.cuda.nccl")
    for i, name in enumerate(_NCCL_TYPES):
        setattr(nccl, name, i)
    nccl.NCCL_SUM, nccl.available, nccl.NcclCommunicator = 0, True, _Nccl
    nccl.get_unique_id, nccl.get_version = (lambda: os.urandom(128)), (lambda: NCCL_VERSION[0])
    cupyx = types.ModuleType("cupyx")

    @on_device
    def scatter_add(target, index, values):
        _launch("scatter_add")
        np.add.at(_host(target), np.mod(_host(index), target.shape[0]), _host(values))  # CuPy wraps

    cupyx.scatter_add = scatter_add
    cupyx.empty_pinned = np.empty
    sys.modules.update({"cupy": cp, "cupyx": cupyx, "cupy.cuda.nccl": nccl})
    from mpifsdp.base import backend

    backend.cublas_library = cublas_library
    return cp
