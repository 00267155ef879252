"""The array module: NumPy on the CPU, CuPy on a GPU.

Every array operation in mpifsdp goes through an array module `xp` so one code path serves both.
This is the only file that imports cupy, and it does so only when a GPU device is asked for, so
CPU users never need CuPy installed.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib
import os
import sys

import numpy as np

from .accounting import HOST_SYNCS
from .checks import env_flag, is_bfloat16

CPU = "cpu"


def _cupy():
    try:
        return importlib.import_module("cupy")
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise RuntimeError(
            "device 'cuda' needs CuPy: pip install 'mpifsdp[cuda12]' or 'mpifsdp[cuda13]' "
            "(your CUDA major version)"
        ) from exc


def parse_device(device: str) -> tuple[str, int]:
    """'cpu' -> ('cpu', 0); 'cuda' -> ('cuda', 0); 'cuda:3' -> ('cuda', 3). Anything else raises."""
    kind, _, index = str(device).partition(":")
    if kind == CPU and not index:
        return CPU, 0
    if kind == "cuda" and (not index or index.isdigit()):
        return "cuda", int(index or 0)
    raise ValueError(f"unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N'")


def array_module(device: str = CPU):
    """The array module for a device name ('cpu', 'cuda', 'cuda:N'). 'cuda:N' makes GPU N current;
    plain 'cuda' keeps the current one, which select_gpu chose for this rank (making GPU 0 current
    here would move every rank of a multi-GPU node onto it)."""
    kind, index = parse_device(device)
    if kind == CPU:
        return np
    cp = _cupy()
    if ":" in str(device):
        cp.cuda.Device(index).use()
    return cp


def array_module_of(array):
    """numpy or cupy, whichever owns `array`, without importing cupy for NumPy inputs."""
    if type(array).__module__.startswith("cupy") and "cupy" in sys.modules:
        return sys.modules["cupy"]
    return np


class _Host:
    """What host (NumPy) memory needs: nothing to copy, count or wait for."""

    kind = CPU

    @staticmethod
    def device(array) -> str:
        return CPU

    @staticmethod
    def to_numpy(array) -> np.ndarray:
        return np.asarray(array)

    @staticmethod
    def read(purpose: str):
        """A read of device memory by the host is about to happen (none here)."""

    @staticmethod
    def scatter_add(target, index, values):
        np.add.at(target, index, values)

    @staticmethod
    def synchronize():
        """Wait for the kernels queued so far (none here)."""

    @staticmethod
    def copy_to(xp, array):
        """A copy of `array` in xp's memory (a device's, from the host: one transfer)."""
        return xp.asarray(np.ascontiguousarray(array))

    @staticmethod
    def onto(xp, array):
        """(`array` in xp's memory, whether it was copied there)."""
        return xp.asarray(array), True

    @staticmethod
    def piece(cache_sized: int, numel: int) -> int:
        """Elements a pass over a vector takes at once: a cache's worth, so its passes stay in cache."""
        return cache_sized

    @staticmethod
    def write_into(target, array):
        """target[...] = array, target a device array: one host-to-device copy."""
        target.set(np.ascontiguousarray(array))


class _Device:
    """What GPU (CuPy) memory needs: a copy to the host, each read counted as a host sync
    (HOST_SYNCS), the stream waited for, cupyx's scatter_add."""

    kind = "cuda"

    @staticmethod
    def device(array) -> str:
        return f"cuda:{array.device.id}"

    @staticmethod
    def to_numpy(array) -> np.ndarray:
        return array.get()

    @staticmethod
    def read(purpose: str):
        HOST_SYNCS.count(purpose)

    @staticmethod
    def scatter_add(target, index, values):
        """cupyx.scatter_add (the one use of cupyx); bfloat16, which it lacks, added in float32."""
        cupyx = importlib.import_module("cupyx")
        if is_bfloat16(target.dtype):  # round once
            wide = target.astype(np.float32)
            cupyx.scatter_add(wide, index, values.astype(np.float32))
            target[...] = wide
        else:
            cupyx.scatter_add(target, index, values)

    @staticmethod
    def synchronize():
        _cupy().cuda.get_current_stream().synchronize()

    @staticmethod
    def copy_to(xp, array):
        return array.copy()

    @staticmethod
    def onto(xp, array):
        return array, False

    @staticmethod
    def piece(cache_sized: int, numel: int) -> int:
        """The whole vector: a piece is a launch, and a GPU has no cache to fit."""
        return max(numel, 1)

    @staticmethod
    def write_into(target, array):
        target[...] = array


def _memory(array):
    """Where `array` lives, as what its memory needs: the one place this file asks."""
    return _memory_of(array_module_of(array))


def _memory_of(xp):
    return _Host if xp is np else _Device


def pieces(xp, numel: int, cache_sized: int) -> list[tuple[int, int]]:
    """(start, stop) pieces of a vector of xp's: `cache_sized` elements in host memory (a pass over
    one stays in cache), the whole vector on a device (each piece would be launches)."""
    step = _memory_of(xp).piece(cache_sized, numel)
    return [(start, min(start + step, numel)) for start in range(0, numel, step)]


def device_kind(array) -> str:
    """'cpu' or 'cuda': which implementation of an operation runs on `array` (autodiff's device seam)."""
    return _memory(array).kind


def device_of(array) -> str:
    return _memory(array).device(array)


def to_numpy(array) -> np.ndarray:
    """A host (NumPy) copy or view of any array; CuPy arrays are copied to the host."""
    return _memory(array).to_numpy(array)


def host_value(array, purpose: str) -> float:
    """float(array) of a one-element array; on a GPU a host sync, counted in HOST_SYNCS by `purpose`."""
    _memory(array).read(purpose)
    return float(array)


def host_values(array, purpose: str) -> np.ndarray:
    """A host copy of a small array (several values in one read); counted as host_value is."""
    _memory(array).read(purpose)
    return to_numpy(array)


def to_device(array, device: str = CPU, dtype=None):
    """Put a host array on `device` (a copy on a GPU, a view or cast on the CPU)."""
    xp = array_module(device)
    return xp.asarray(array, dtype=dtype)


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one GPU. Never raises, unless MPIFSDP_REQUIRE_GPU is on
    (make gpu-check sets it): then a broken CuPy or a missing GPU raises with its cause, instead of
    quietly leaving only the CPU tests to pass."""
    try:
        cp = importlib.import_module("cupy")
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception as exc:
        if env_flag("MPIFSDP_REQUIRE_GPU"):
            raise RuntimeError(f"MPIFSDP_REQUIRE_GPU is on, but no GPU is usable: {exc!r}") from exc
        return False


# -- the node and its GPUs (threads.py, transport.py); every cupy access stays in this file -----------


def copy_to(xp, array):
    """A copy of `array` (host or device memory) in xp's device memory."""
    return _memory(array).copy_to(xp, array)


def onto(xp, array):
    """(`array` in xp's device memory, whether it came from the host: a copy made once)."""
    return _memory(array).onto(xp, array)


def write_into(target, array):
    """target[...] = array (host or device memory) for a device array `target`, as one copy."""
    _memory(array).write_into(target, array)


def scatter_add(target, index, values):
    """target[index] += values with repeated indices adding up, in place (np.add.at on the CPU,
    cupyx.scatter_add on the GPU, kept here with every other CuPy import)."""
    _memory(target).scatter_add(target, index, values)
    return target


def bytes_digest(arrays) -> str:
    """A hash of the arrays' bytes, copied to the host a piece at a time (pieces of a large array are
    fine: pass them as the sequence), equal on every rank exactly when the bits are."""
    digest = hashlib.blake2b(digest_size=16)
    for array in arrays:
        digest.update(np.ascontiguousarray(to_numpy(array)).view(np.uint8))
    return digest.hexdigest()


def synchronize(array):
    """Wait for the kernels that produce `array` (a no-op for NumPy arrays): MPI does not see streams."""
    _memory(array).synchronize()


def rank_device(device: str, bind_gpu: bool, node_rank: int) -> str:
    """The device this rank computes on: 'cpu'; or, a GPU asked for, that one, or with bind_gpu
    its node's GPU by node rank (select_gpu)."""
    if parse_device(device)[0] == CPU:
        return CPU
    return select_gpu(node_rank) if bind_gpu else device


def select_gpu(node_rank: int) -> str:
    """Bind this rank to GPU (its index on the node mod GPUs), before any NCCL communicator exists."""
    index = node_rank % _cupy().cuda.runtime.getDeviceCount()
    _cupy().cuda.Device(index).use()
    return f"cuda:{index}"


def ranks_sharing_gpu(ranks_on_node: int) -> int:
    return -(-ranks_on_node // _cupy().cuda.runtime.getDeviceCount())


def nccl():
    return importlib.import_module("cupy.cuda.nccl")


@functools.cache
def cublas_library():
    """libcublas as CuPy loaded it, for cuda/cublas_api.py's ctypes calls: CuPy's handle is made first,
    which maps the library into this process, and it is found by its path there."""
    _cupy().cuda.device.get_cublas_handle()
    try:
        with open("/proc/self/maps") as maps:
            paths = mapped_paths(maps, "libcublas.so")
    except OSError:  # no /proc: the library by its name, as the dynamic loader finds it
        paths = []
    for path in paths or ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise RuntimeError("mpifsdp's GPU GEMMs need libcublas, which CuPy's cuBLAS module should have loaded")


def mapped_paths(maps, library: str) -> list:
    """The paths of a library in a process's memory map (the lines of /proc/self/maps): those whose
    file name starts `library` (libcublas.so, not libcublasLt.so)."""
    return sorted({line.split()[-1] for line in maps if f"/{library}" in line})


def nccl_available() -> bool:
    try:
        return bool(getattr(nccl(), "available", True))
    except ImportError:
        return False


NCCL_SHARES_GPUS = 23000  # ncclGetVersion's code of 2.30, the first NCCL that lets ranks share a GPU


def nccl_shares_gpus() -> bool:
    """Whether NCCL may run several ranks on one GPU: asked for (NCCL_MULTI_RANK_GPU_ENABLE=1) of an
    NCCL that can (2.30 and later; earlier ones hang or fail when two ranks share a device). The
    variable and the version are as issue 50 gives them, not yet checked on a device here."""
    if os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE", "0").strip() != "1" or not nccl_available():
        return False
    return int(nccl().get_version()) >= NCCL_SHARES_GPUS


def nccl_dtype(dtype):
    """NCCL's code for a dtype (looked up once per dtype: every collective asks)."""
    return _nccl_code(np.dtype(dtype))


@functools.cache
def _nccl_code(dtype: np.dtype):
    mod = nccl()
    names = {
        "float32": "NCCL_FLOAT32",
        "float16": "NCCL_FLOAT16",
        "float64": "NCCL_FLOAT64",
        "int64": "NCCL_INT64",
        "bfloat16": "NCCL_BFLOAT16",
    }
    return getattr(mod, names[dtype.name])


def new_stream():
    return _cupy().cuda.Stream(non_blocking=True)


def collective_stream():
    """A stream for collectives: non-blocking and at the device's highest priority, so that a gather or
    a reduction queued behind compute starts as soon as its inputs are ready instead of waiting for
    the compute kernels queued since (FSDP2 gives its collectives such streams)."""
    cp = _cupy()
    greatest = cp.cuda.runtime.deviceGetStreamPriorityRange()[1]  # (least, greatest): lower is sooner
    return cp.cuda.Stream(non_blocking=True, priority=greatest)


def current_stream():
    return _cupy().cuda.get_current_stream()


def free_cached_blocks():
    """Give the device back what CuPy's default pool holds unused (its cache of freed blocks)."""
    _cupy().get_default_memory_pool().free_all_blocks()


def record_event():
    """An event recorded on the current stream now (timing on): where the stream has got to."""
    return _cupy().cuda.get_current_stream().record()


def elapsed_s(start, end) -> float:
    """Seconds between two completed events of one stream (no sync: both must be done)."""
    return _cupy().cuda.get_elapsed_time(start, end) / 1e3


def stream_wait_current(stream):
    """Make `stream` wait for all work queued so far on the current stream."""
    stream.wait_event(current_stream().record())


_CUDA_ERROR_NOT_READY = 600  # cudaErrorNotReady: the event's work is still running


def event_done(event) -> bool:
    """Whether a CUDA event completed. Raises on any CUDA error: a failed kernel or collective must
    surface here, not spin as "not ready" until the watchdog blames a collective instead."""
    status = _cupy().cuda.runtime.eventQuery(event.ptr)
    if status not in (0, _CUDA_ERROR_NOT_READY):
        raise RuntimeError(f"CUDA error {status} while waiting for a collective's stream")
    return status == 0


class StreamRequest:
    """Completion of work queued on a stream, as an MPI-like request (Test / Wait). `check` raises
    an error the stream's library reports asynchronously (NCCL's check_async_error)."""

    def __init__(self, stream, check=None):
        self.event, self.check = stream.record(), check

    def Test(self):
        if self.check is not None:
            self.check()
        if event_done(self.event):
            _cupy().cuda.get_current_stream().wait_event(self.event)
            return True
        return False

    def order_after(self):
        """Make the compute stream wait for this work on the device, and return at once: the host
        goes on issuing kernels (Comm.wait; Comm.settle checks completion once, under the watchdog)."""
        if self.check is not None:
            self.check()
        _cupy().cuda.get_current_stream().wait_event(self.event)

    def Wait(self):
        self.event.synchronize()
        self.Test()


class DeviceRead(StreamRequest):
    """A small device array copied into pinned host memory behind everything queued on the current
    stream, as a request: the host polls its completion like a collective's (Comm.read, under the
    watchdog) and then finds the values in `host`, with no blocking copy."""

    def __init__(self, array):
        import cupyx

        self.source, self.host = array, cupyx.empty_pinned(array.shape, array.dtype)
        array.get(out=self.host, blocking=False)
        super().__init__(_cupy().cuda.get_current_stream())
