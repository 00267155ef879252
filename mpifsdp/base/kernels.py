"""Raw GPU kernels: what every one shares (its C types, a block-wide reduction, compiling it, its
NumPy twin, its check at first use). Each kernel's CUDA C is a .cu file beside the module that
launches it (ops/*.cu, optim/*.cu; here block_reduce.cu, which `typed_source` puts before every
kernel's own, and flag_nonfinite.cu, which shard/unit.py uses), read by `cuda_source`; nothing here
imports CuPy.

Every raw kernel (CUDA C, compiled by NVRTC) has a NumPy twin taking the same arguments (`TWINS`):
the tests hold the twin to float64 formulas on any machine, tools/gpusim/cupy_standin.py runs the twin where
it counts launches, and on a device each kernel is compared once with its twin on a small problem
before its first real use (`checked_once`): a compiler or GPU that computes it wrong is named, not
trained with. tests/project/test_kernels_compile.py compiles every source with NVRTC, with no GPU;
tests/project/test_kernel_emulator.py runs every source on the CPU (tools/gpusim/kernel_emulator.py, g++),
so those checks compare the CUDA code itself with its twin before a device sees it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import functools
import logging
import os

import numpy as np

from .backend import array_module_of, to_numpy
from .checks import bfloat16, env_flag, finfo, is_bfloat16, yes_or_no

log = logging.getLogger(__name__)


def cuda_source(package: str, name: str) -> str:
    """The CUDA C of `name`, a .cu file beside its launcher in `package`, as it is: package data, so
    it ships in the wheel, and NVRTC, the CPU emulator and the compile check all read this one text."""
    from importlib.resources import files

    return files(package).joinpath(name).read_text(encoding="utf-8")


SUM_GROUP = 32  # blocks a group of column_sums_done adds (BLOCK_REDUCE below)
MAX_SUM_BLOCKS = 64 * SUM_GROUP  # the most blocks a launch using column_sums_done may have
# BLOCK_REDUCE: the sum (or max) of one value per thread over a thread block, every thread gets it;
# and column sums across thread blocks in one launch: each block writes its partial sums, the last
# block of each group of blocks to finish (self-resetting counters, after a fence) adds its group's,
# and the last group to finish adds the groups', in a fixed order.
BLOCK_REDUCE = cuda_source(__package__, "block_reduce.cu").replace("@SUM_GROUP@", str(SUM_GROUP))

SHARED_BYTES = 48 * 1024  # the shared memory a thread block may take without opting in to more
_counters: dict = {}  # (kernel, device id) -> its counters of finished blocks (they reset themselves)


def row_runs(n: int, max_blocks: int) -> tuple[int, int]:
    """(thread blocks, rows a block) for n rows cut into runs of equal length, at most max_blocks
    runs (the last may be shorter): how the column-sum kernels share out their rows."""
    per = -(-n // min(n, max_blocks))
    return -(-n // per), per


_multiprocessors: dict = {}  # device id -> its streaming multiprocessors


def multiprocessors(xp) -> int | None:
    """The current GPU's streaming multiprocessors, or None where the array module does not say (a
    stand-in): a launch of as many blocks as are resident at once runs in one wave."""
    device = xp.cuda.Device()
    if device.id not in _multiprocessors:
        attributes = getattr(device, "attributes", None)
        _multiprocessors[device.id] = None if attributes is None else int(attributes["MultiProcessorCount"])
    return _multiprocessors[device.id]


def column_sum_counters(xp, like, kernel: str, blocks: int):
    """The zeroed uint32 counters a kernel using column_sums_done counts its finished blocks in (one
    for the groups, then one for each group of SUM_GROUP blocks, up to MAX_SUM_BLOCKS blocks), one
    set per kernel and device (kernels on different streams must not share them); `blocks`: the
    launch's, checked."""
    if blocks > MAX_SUM_BLOCKS:
        raise ValueError(f"{kernel}: {blocks} thread blocks, column_sums_done counts up to {MAX_SUM_BLOCKS}")
    key = (kernel, getattr(getattr(like, "device", None), "id", None))
    if key not in _counters:
        _counters[key] = xp.zeros(1 + MAX_SUM_BLOCKS // SUM_GROUP, dtype=np.uint32)
    return _counters[key]


class _ElementTypes(dict):
    """The C types of a kernel's elements and of its arithmetic, by NumPy scalar type; bfloat16
    (ml_dtypes', which CuPy computes in) is known by its name: importing ml_dtypes takes most of a
    second, so only a program that made a bfloat16 array has it loaded."""

    def __contains__(self, dtype) -> bool:
        return dict.__contains__(self, dtype) or is_bfloat16(dtype)

    def __missing__(self, dtype):
        if is_bfloat16(dtype):
            return ("__nv_bfloat16", "float")
        raise KeyError(dtype)


ELEMENT_TYPES = _ElementTypes(
    {np.float16: ("__half", "float"), np.float32: ("float", "float"), np.float64: ("double", "double")}
)
TWINS: dict = {}  # kernel name -> twin(grid, block, args, shared_mem): the same effect, in NumPy
RAW_FAMILIES: dict = {}  # every family of raw kernels by name (KernelFamily): the NVRTC check's list


@dataclasses.dataclass(frozen=True)
class KernelFamily:
    """One family of raw kernels, declared once where it is launched: its name (in log lines and the
    NVRTC check), `source(dtype)` (its .cu file, typed, with its flags' names defined), its entry
    points and each one's NumPy twin (the same arguments: what the stand-in GPU runs, and what its
    first-use check compares the device with)."""

    name: str
    source: object  # dtype -> the CUDA source
    kernels: tuple
    twins: dict

    def compiled(self, xp, dtype, source: str | None = None):
        """The entry points compiled for `dtype` (or from `source`), or None where NVRTC cannot."""
        return compiled(xp, source or self.source(dtype), self.kernels, self.name)


def family(name: str, source, kernels: tuple, twins: dict) -> KernelFamily:
    """Declare a family: its twins registered by entry point, itself in RAW_FAMILIES."""
    if name in RAW_FAMILIES:
        raise ValueError(f"kernel family {name!r} is declared twice")
    if set(twins) - set(kernels):
        raise ValueError(f"kernel family {name!r}: twins {sorted(set(twins) - set(kernels))} of no kernel")
    TWINS.update(twins)
    RAW_FAMILIES[name] = KernelFamily(name, source, tuple(kernels), dict(twins))
    return RAW_FAMILIES[name]


def flag_defines(flags: type[enum.IntFlag], prefix: str) -> str:
    """`#define PREFIX_NAME bit` for each bit of a kernel's flags (an IntFlag): one name for a bit
    in the CUDA source, the Python that sets it and the twin that reads it."""
    return "".join(f"#define {prefix}{flag.name} {int(flag)}\n" for flag in flags)


def device_address(array) -> int:
    """An array's device address, as a kernel's table holds it (a NumPy array's host address: the
    twins run on host memory)."""
    return array.ctypes.data if type(array) is np.ndarray else array.data.ptr


def pack_width(dtype) -> int:
    """The elements of `dtype` in a kernel's Pack<PACK>: one 16-byte load or store."""
    return 16 // np.dtype(dtype).itemsize


def in_packs(dtype, lengths, *arrays) -> bool:
    """Whether a kernel can read and write in whole packs of `dtype`: every row length in `lengths`
    a multiple of pack_width(dtype), every array given (None: not one) on a 16-byte boundary (the
    kernels' packs_fit)."""
    width = pack_width(dtype)
    return all(n % width == 0 for n in lengths) and all(
        device_address(a) % 16 == 0 for a in arrays if a is not None
    )


TABLE_DTYPES = ("float16", "float32", "float64", "bfloat16")  # a table's dtype entry: a place here


def table_dtype(code: int) -> np.dtype:
    """The dtype a kernel's table names by its place in TABLE_DTYPES (for the twins, which read the
    arrays at the table's addresses)."""
    name = TABLE_DTYPES[int(code)]
    return bfloat16() if name == "bfloat16" else np.dtype(name)


def host_array(address: int, dtype, count: int) -> np.ndarray:
    """The `count` elements of `dtype` at a host address (writable, not a copy): what a twin reads
    and writes where its kernel takes raw device addresses, since the twins run on host memory."""
    dtype = np.dtype(dtype)
    if not count:
        return np.empty(0, dtype=dtype)
    buffer = (ctypes.c_char * (count * dtype.itemsize)).from_address(address)
    return np.frombuffer(buffer, dtype=dtype, count=count)


@functools.cache
def typed_source(dtype, body: str) -> str:
    """A raw kernel's CUDA source for `dtype`: its ELEM and ACC types, BLOCK_REDUCE, then `body`.
    Made once: every launch looks its compiled kernel up by this string (one object, hashed once)."""
    elem, acc = ELEMENT_TYPES[dtype]
    return f"#define ELEM {elem}\n#define ACC {acc}\n" + BLOCK_REDUCE + body


@functools.cache
def compiled(cupy, source: str, names: tuple, what: str):
    """The functions `names` of `source`; where NVRTC cannot build them, SlowPathError naming `what`
    (or, with MPIFSDP_ALLOW_SLOW=1, None: the caller keeps its array-module passes, one warning)."""
    if not fused_enabled():
        return None
    try:
        module = cupy.RawModule(code=source, options=("--std=c++17",))
        return tuple(module.get_function(name) for name in names)
    except Exception as exc:  # a CUDA toolkit without cuda_fp16.h for NVRTC, say
        slow_path(what, exc)
        return None


class SlowPathError(RuntimeError):
    """A GPU fast path (a raw kernel, cuDNN's attention) cannot run on this machine."""


_said_slow: set = set()


def slow_path(what: str, why) -> None:
    """A fast path that cannot run here: raised, naming it and the setting that accepts the slower
    passes (MPIFSDP_ALLOW_SLOW=1: one warning, then the array-module passes). Why: a step 5-10x
    slower that one warning mentioned went unnoticed for whole runs (issue 50)."""
    if env_flag("MPIFSDP_ALLOW_SLOW"):
        if what not in _said_slow:
            _said_slow.add(what)
            log.warning(
                "%s unavailable (%s): the slower passes run instead (MPIFSDP_ALLOW_SLOW=1)", what, why
            )
        return
    raise SlowPathError(
        f"{what} cannot run on this machine ({why}): training would go on several times slower on the "
        "plain array passes. Fix what is named, or set MPIFSDP_ALLOW_SLOW=1 to train on the slower passes "
        "(MPIFSDP_FUSED=0: none of the raw kernels at all)"
    )


def fused_enabled() -> bool:
    """MPIFSDP_FUSED=0 turns the raw kernels off (the array-module passes run instead): to compare
    them, or to train on while a kernel that fails its check on a new device is looked into."""
    return yes_or_no(os.environ.get("MPIFSDP_FUSED", "1"))


def accumulator(dtype):
    """The NumPy type of a kernel's scalar arguments in ACC (float64 kernels: double; else float)."""
    return np.float64 if dtype == np.float64 else np.float32


_checked: set = set()


def checked_once(key, probe):
    """Run `probe()` the first time `key` (a kernel and dtype) is used in this process. probe runs the
    kernel on a small problem and returns [(what, got, want, bound)], `got` from the device and `want`
    from the kernel's NumPy twin on the same inputs; an error beyond its bound raises, naming the
    kernel, before any result of it is used."""
    if key in _checked:
        return
    for what, got, want, bound in probe():
        err = float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)), initial=0))
        if not err <= bound:
            raise RuntimeError(
                f"mpifsdp GPU kernel {key[0]} ({np.dtype(key[1]).name}) computes {what} wrong on this "
                f"device: max error {err:.3g} against its NumPy reference, bound {bound:.3g}. Report it "
                "with your GPU, CUDA, CuPy (and cuDNN) versions; MPIFSDP_FUSED=0 runs the unfused "
                "passes meanwhile."
            )
    _checked.add(key)


def error_bound(dtype, terms: int, scale: float) -> float:
    """What a kernel may differ from its float64 twin by: `terms` roundings in ACC (sums of up to
    `terms` values no larger than `scale`) and the result's one rounding to the element type."""
    acc = float(np.finfo(accumulator(dtype)).eps)
    return (terms * acc + float(finfo(dtype).eps)) * scale


# -- a flag for NaN and Inf: mixed precision's overflow check of each gather, one launch ----------
# flag_nonfinite checks an array; cast_flag_nonfinite casts float32 masters to ELEM and checks the
# cast in the same pass (a gather's send buffer: one launch, not a cast and a check).
FLAG_THREADS, FLAG_BLOCKS = 256, 1024
FLAG_SOURCE = cuda_source(__package__, "flag_nonfinite.cu")
FLAG_KERNELS = ("flag_nonfinite", "cast_flag_nonfinite")


def flag_source(dtype) -> str:
    return typed_source(dtype, FLAG_SOURCE)


def _flag_twin(grid, block, args, shared_mem=0):
    x, flag, n, token = args
    if not np.isfinite(x.reshape(-1)[: int(n)].astype(np.float64)).all():
        flag[0] = int(token)


def _cast_flag_twin(grid, block, args, shared_mem=0):
    x, out, flag, n, token = args
    n = int(n)
    with np.errstate(over="ignore"):  # what the cast overflows is what the flag is for
        out.reshape(-1)[:n] = x.reshape(-1)[:n]
    _flag_twin(grid, block, (out, flag, n, token))


FLAG_FAMILY = family(
    "the non-finite flag",
    flag_source,
    FLAG_KERNELS,
    dict(flag_nonfinite=_flag_twin, cast_flag_nonfinite=_cast_flag_twin),
)


def flag_nonfinite(x, flag, token: int = 1) -> bool:
    """flag[0] = token where the contiguous device array x holds a NaN or an Inf, left as it is
    otherwise (flag: a one-element int32 device array, so one flag gathers the verdicts of several
    arrays; a new token a step spares zeroing it); False where the kernel cannot run (the caller
    then checks with array passes)."""
    dtype = x.dtype.type
    if dtype not in ELEMENT_TYPES or not x.flags.c_contiguous:
        return False
    return _flag_launch(0, dtype, x, (x, flag, np.int64(x.size), np.int32(token)), _flag_probe)


def cast_flag_nonfinite(x, out, flag, token: int = 1) -> bool:
    """out = x cast to out's dtype (x: contiguous float32 on the device, out: as large), and flag[0]
    = token where the cast holds a NaN or an Inf, in one launch; False (nothing written) where the
    kernel cannot run (the caller then casts and checks apart)."""
    dtype = out.dtype.type
    usable = x.dtype == np.float32 and dtype in ELEMENT_TYPES and x.size == out.size
    if not usable or not (x.flags.c_contiguous and out.flags.c_contiguous):
        return False
    return _flag_launch(1, dtype, x, (x, out, flag, np.int64(x.size), np.int32(token)), _cast_flag_probe)


def _flag_launch(which: int, dtype, x, args: tuple, probe) -> bool:
    """Kernel FLAG_KERNELS[which] for element type dtype over x's elements, checked once by
    probe(xp, dtype, kernel); False where it cannot be compiled."""
    xp = array_module_of(x)
    kernels = FLAG_FAMILY.compiled(xp, dtype)
    if kernels is None:
        return False
    checked_once((FLAG_KERNELS[which], dtype), lambda: probe(xp, dtype, kernels[which]))
    blocks = max(1, min(FLAG_BLOCKS, -(-x.size // FLAG_THREADS)))
    kernels[which]((blocks,), (FLAG_THREADS,), args)
    return True


def _flag_probe(xp, dtype, kernel):
    """The flag of an array with one Inf far from its start, and of one with none, against the twin."""
    values = np.linspace(-3, 3, 5000).astype(dtype)
    got, want = [], []
    for bad in (3777, None):
        host = values.copy()
        if bad is not None:
            host[bad] = np.inf
        flag, expected = xp.zeros(1, dtype=np.int32), np.zeros(1, dtype=np.int32)
        kernel((4,), (FLAG_THREADS,), (xp.asarray(host), flag, np.int64(host.size), np.int32(7)))
        _flag_twin(None, None, (host, expected, host.size, 7))
        got.append(int(to_numpy(flag)[0]))
        want.append(int(expected[0]))
    return [("the flag", np.array(got), np.array(want), 0.0)]


def _cast_flag_probe(xp, dtype, kernel):
    """The cast and flag of float32 values with one far beyond float16's range (an Inf in float32
    itself: every element type overflows on it; among the first 5000, cast four at a time, and
    among the last 3, one at a time) and of values with none, against the twin: the cast bit for
    bit (both round to nearest), the flag exactly."""
    values = np.linspace(-3, 3, 5003, dtype=np.float32)  # four at a time, and 3 one at a time
    got, want = [], []
    for bad in (3777, 5001, None):
        host = values.copy()
        if bad is not None:
            host[bad] = np.inf
        out, flag = xp.empty(host.size, dtype=dtype), xp.zeros(1, dtype=np.int32)
        expected, expected_flag = np.empty(host.size, dtype=dtype), np.zeros(1, dtype=np.int32)
        kernel((4,), (FLAG_THREADS,), (xp.asarray(host), out, flag, np.int64(host.size), np.int32(7)))
        _cast_flag_twin(None, None, (host, expected, expected_flag, host.size, 7))
        got += [comparable(to_numpy(out)), comparable(to_numpy(flag))]
        want += [comparable(expected), comparable(expected_flag)]
    return [(f"the cast and its flag ({k})", g, w, 0.0) for k, (g, w) in enumerate(zip(got, want))]


def comparable(values):
    """float64 values with Inf as a large finite number, so that Inf - Inf is 0, not NaN."""
    return np.nan_to_num(np.asarray(values, np.float64), posinf=1e300, neginf=-1e300)
