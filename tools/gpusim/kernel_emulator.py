"""mpifsdp's raw CUDA kernels run on the CPU: the very source NVRTC compiles, built by g++ against a
small header that gives it CUDA's execution model, so a kernel's logic (its indexing, its block-wide
reductions, its last-block-finishes sums, its casts) is checked against its NumPy twin before a
device ever runs it. The twins check the mathematics a kernel means; this checks what it does.

    STANDIN_KERNELS=source python -m gpusim tools/gpusim/standin_checks.py   # a whole GPU step

(about a minute; tests/project/test_kernel_emulator.py runs every kernel family's first-use checks
so, in each element type, and the emulator's own semantics.)

How a launch runs: its thread blocks one after another, each block's threads as fibers on one OS
thread (ucontext), so `__shared__` variables (static here: one block at a time owns them),
`__syncthreads()` (a barrier of the block's live threads: a thread that returns early leaves it, as
on a GPU), warp shuffles (a barrier of the warp's lanes) and the atomics behave as CUDA specifies for
code that does not race, the same way every run; a barrier some threads never reach is named.
What it cannot show: speed, a race that a GPU's scheduling would expose, and the device's own
rounding (g++ does not contract a * b + c into an FMA as NVRTC does; float16 is `_Float16`,
bfloat16 rounds to nearest even as `__float2bfloat16` does): compare with the twins' derived bounds,
never bit for bit. Needs g++ (C++17) and glibc's ucontext; nothing of CUDA.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np

# What the kernels take from CUDA, for g++. One block at a time: `__shared__` is `static`.
HEADER = r"""
#include <algorithm>
#include <cmath>
#include <csetjmp>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <type_traits>
#include <ucontext.h>
#include <vector>
struct dim3 { unsigned x = 1, y = 1, z = 1; };
static dim3 gridDim, blockDim;
static dim3 threadIdx, blockIdx;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static
using std::exp; using std::log; using std::sqrt; using std::tanh; using std::fabs; using std::isfinite;
inline double __dmul_rn(double a, double b) { return a * b; }  /* one rounding each (g++ -std=c++17 */
inline double __dsub_rn(double a, double b) { return a - b; }  /* contracts nothing) */
typedef _Float16 __half;
struct __nv_bfloat16 {  /* bfloat16 as CUDA's: float's top half, rounded to nearest even */
    uint16_t bits;
    __nv_bfloat16() = default;
    template <class T> __nv_bfloat16(T value) {
        float f = (float)value; uint32_t u; std::memcpy(&u, &f, 4);
        if (std::isnan(f)) { bits = (uint16_t)((u >> 16) | 0x40); return; }
        u += 0x7fff + ((u >> 16) & 1);
        bits = (uint16_t)(u >> 16);
    }
    operator float() const { uint32_t u = (uint32_t)bits << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
inline bool isfinite(__half x) { return std::isfinite((float)x); }
inline bool isfinite(__nv_bfloat16 x) { return std::isfinite((float)x); }
template <class A, class B> inline std::common_type_t<A, B> min(A a, B b) { return b < a ? b : a; }
template <class A, class B> inline std::common_type_t<A, B> max(A a, B b) { return a < b ? b : a; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) double2 { double x, y; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
template <class T> inline T __ldcg(const T* p) { return *p; }

/* A launch runs its blocks one after another, a block's threads as fibers on this one OS thread
   (ucontext): a fiber runs until it returns or waits at a barrier; a barrier opens once every live
   thread of its block (or warp) waits there. Nothing left to run with a barrier shut is a deadlock
   (a __syncthreads some threads never reach): that raises. */
enum EmuWait { EMU_RUNNABLE, EMU_BLOCK, EMU_WARP, EMU_DONE };
struct EmuFiber { ucontext_t context; jmp_buf jump; bool started; EmuWait wait; std::vector<char> stack; };
static std::vector<EmuFiber> emu_fibers;
static jmp_buf emu_scheduler;
static unsigned emu_current;
static std::vector<unsigned char> emu_lanes;  /* 16 bytes a thread: what a shuffle exchanges */
static std::function<void()> emu_kernel;
static unsigned char* emu_dynamic_shared;
/* Switches are _setjmp/_longjmp (no system call; swapcontext's signal mask costs one a switch):
   ucontext only starts a fiber on its own stack. */
static void emu_wait(EmuWait wait) {
    EmuFiber& f = emu_fibers[emu_current];
    f.wait = wait;
    if (!_setjmp(f.jump)) _longjmp(emu_scheduler, 1);
}
inline void __syncthreads() { emu_wait(EMU_BLOCK); }
inline void __threadfence() {}
template <class T> T __shfl_xor_sync(unsigned, T value, int mask) {
    const unsigned t = emu_current;
    std::memcpy(&emu_lanes[16 * t], &value, sizeof(T));
    emu_wait(EMU_WARP);
    T other;
    std::memcpy(&other, &emu_lanes[16 * ((t & ~31u) | ((t & 31u) ^ (unsigned)mask))], sizeof(T));
    emu_wait(EMU_WARP);
    return other;
}
inline unsigned atomicInc(unsigned* address, unsigned limit) {
    const unsigned old = *address;
    *address = old >= limit ? 0u : old + 1u;
    return old;
}
template <class T> inline T atomicAdd(T* address, T value) {
    const T old = *address;
    *address = old + value;
    return old;
}
static void emu_fiber_main() {
    emu_kernel();
    emu_fibers[emu_current].wait = EMU_DONE;
    _longjmp(emu_scheduler, 1);
}
static void emu_resume(unsigned t) {
    EmuFiber& f = emu_fibers[t];
    if (_setjmp(emu_scheduler)) return;  /* the fiber waits, or is done */
    if (f.started) _longjmp(f.jump, 1);
    f.started = true;
    ucontext_t here;
    swapcontext(&here, &f.context);
}
static void emu_set_thread(unsigned t) {
    emu_current = t;
    threadIdx = {t % blockDim.x, (t / blockDim.x) % blockDim.y, t / (blockDim.x * blockDim.y)};
}
static bool emu_open(unsigned first, unsigned count, EmuWait barrier) {
    /* threads first..first+count: open their barrier if every live one waits there */
    bool any = false;
    for (unsigned t = first; t < first + count; ++t) {
        if (emu_fibers[t].wait == EMU_DONE) continue;
        if (emu_fibers[t].wait != barrier) return false;
        any = true;
    }
    for (unsigned t = first; t < first + count; ++t)
        if (emu_fibers[t].wait == barrier) emu_fibers[t].wait = EMU_RUNNABLE;
    return any;
}
static const char* emu_run_block(unsigned count) {
    for (unsigned t = 0; t < count; ++t) {
        EmuFiber& f = emu_fibers[t];
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = f.stack.data();
        f.context.uc_stack.ss_size = f.stack.size();
        f.context.uc_link = nullptr;
        makecontext(&f.context, emu_fiber_main, 0);
        f.wait = EMU_RUNNABLE;
        f.started = false;
    }
    for (;;) {
        bool ran = false, live = false;
        for (unsigned t = 0; t < count; ++t) {
            if (emu_fibers[t].wait != EMU_RUNNABLE) continue;
            ran = true;
            emu_set_thread(t);
            emu_resume(t);
        }
        bool opened = emu_open(0, count, EMU_BLOCK);
        for (unsigned w = 0; w < count; w += 32) opened |= emu_open(w, std::min(32u, count - w), EMU_WARP);
        for (unsigned t = 0; t < count; ++t) live |= emu_fibers[t].wait != EMU_DONE;
        if (!live) return nullptr;
        if (!ran && !opened)
            return "deadlock: threads wait at a __syncthreads or shuffle others of the block never reach";
    }
}
static char emu_error[256];
template <class Kernel>
const char* emu_launch(const unsigned* grid, const unsigned* block, size_t shared, Kernel kernel) {
    gridDim = {grid[0], grid[1], grid[2]};
    blockDim = {block[0], block[1], block[2]};
    const unsigned count = block[0] * block[1] * block[2];
    std::vector<unsigned char> dynamic(shared + 16);
    emu_dynamic_shared = dynamic.data() + (16 - (uintptr_t)dynamic.data() % 16) % 16;
    emu_fibers.resize(count);
    for (auto& f : emu_fibers) f.stack.resize(64 * 1024);
    emu_lanes.assign(16 * count, 0);
    emu_kernel = kernel;
    for (unsigned z = 0; z < grid[2]; ++z) for (unsigned y = 0; y < grid[1]; ++y)
        for (unsigned x = 0; x < grid[0]; ++x) {
            blockIdx = {x, y, z};
            if (const char* error = emu_run_block(count)) {
                std::snprintf(emu_error, sizeof emu_error, "block (%u, %u, %u): %s", x, y, z, error);
                return emu_error;
            }
        }
    return nullptr;
}
template <class T> T emu_arg(void* slot) {
    if constexpr (std::is_pointer_v<T>) return (T)(uintptr_t)(*(uint64_t*)slot);
    else if constexpr (std::is_floating_point_v<T>) return (T)(*(double*)slot);
    else return (T)(*(int64_t*)slot);
}
"""

_BOUNDS = r"(?:__launch_bounds__\([^)]*\)\s+)?"
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+' + _BOUNDS + r"(\w+)\s*\(([^)]*)\)")
_DYNAMIC_SHARED = re.compile(r"extern\s+__shared__\s+([\w ]+?)\s+(\w+)\s*\[\s*\]\s*;")
_CACHE = Path(tempfile.gettempdir()) / f"mpifsdp-kernel-emulator-{os.getuid()}"


def parameter_types(params: str) -> list[str]:
    """The C types of a kernel's parameters: each declaration without its name."""
    return [re.sub(r"\s*\b\w+\s*$", "", p.strip()) for p in params.split(",") if p.strip()]


def cpu_source(source: str) -> str:
    """The kernel source made a g++ translation unit: CUDA's headers out (HEADER stands in for
    them), dynamic shared memory as a pointer into the launch's buffer, and a C entry point per
    kernel, `emu_NAME(grid, block, shared bytes, argument slots)`."""
    body = re.sub(r"#include\s*<cuda_\w+\.h>", "", source)
    body = _DYNAMIC_SHARED.sub(r"\1* \2 = (\1*)emu_dynamic_shared;", body)
    entries = []
    for name, params in _KERNEL.findall(source):
        args = ", ".join(f"emu_arg<{t}>(slots[{i}])" for i, t in enumerate(parameter_types(params)))
        entries.append(
            f'extern "C" const char* emu_{name}(const unsigned* grid, const unsigned* block, size_t shared, '
            f"void** slots) {{ return emu_launch(grid, block, shared, [&]() {{ {name}({args}); }}); }}"
        )
    return HEADER + body + "\n" + "\n".join(entries) + "\n"


FAILED: list = []  # the build errors of this process: mpifsdp falls back to unfused passes on one


def build(source: str) -> ctypes.CDLL:
    """The shared library of `source` (cached by its text: a g++ build takes seconds)."""
    text = cpu_source(source)
    key = hashlib.sha256(text.encode()).hexdigest()[:20]
    library = _CACHE / f"{key}.so"
    if not library.exists():
        _CACHE.mkdir(parents=True, exist_ok=True)
        mine = f"{key}.{os.getpid()}"  # this process's files: another may build the same meanwhile
        cpp, partial = _CACHE / f"{mine}.cpp", _CACHE / f"{mine}.so"
        cpp.write_text(text)
        flags = ["-std=c++17", "-O1", "-fPIC", "-shared", "-Wno-unknown-pragmas", "-ffp-contract=off"]
        flags.append("-U_FORTIFY_SOURCE")  # its longjmp check refuses a jump between the fibers' stacks
        done = subprocess.run(["g++", *flags, "-o", str(partial), str(cpp)], capture_output=True, text=True)
        if done.returncode:  # the source stays, for the error's line numbers
            FAILED.append(f"g++ could not build the emulated kernels ({cpp}):\n{done.stderr[-3000:]}")
            raise RuntimeError(FAILED[-1])
        cpp.unlink()
        os.replace(partial, library)  # whole
    return ctypes.CDLL(str(library))


def _slot(value, host) -> ctypes._SimpleCData:
    """One argument as emu_arg reads it: an array's address, an integer, or a float as a double."""
    if isinstance(value, np.ndarray):
        return ctypes.c_uint64(host(value).ctypes.data)
    if isinstance(value, (int, np.integer, bool, np.bool_)):
        return ctypes.c_int64(int(value))
    return ctypes.c_double(float(value))


def _dims(value) -> tuple:
    dims = tuple(int(v) for v in (value if isinstance(value, tuple) else (value,)))
    return (dims + (1, 1, 1))[:3]


class RawModule:
    """cupy.RawModule's interface over the emulated source: get_function(name)(grid, block, args,
    shared_mem). `host` turns an argument array into the NumPy array holding its memory."""

    def __init__(self, code: str = "", options=(), host=np.asarray):
        self.library, self.host = build(code), host

    def get_function(self, name: str):
        entry = getattr(self.library, f"emu_{name}")
        entry.restype = ctypes.c_char_p

        def launch(grid, block, args, shared_mem=0):
            slots = [_slot(a, self.host) for a in args]
            pointers = (ctypes.c_void_p * max(len(slots), 1))(*(ctypes.addressof(s) for s in slots))
            grid3, block3 = (ctypes.c_uint * 3)(*_dims(grid)), (ctypes.c_uint * 3)(*_dims(block))
            error = entry(grid3, block3, ctypes.c_size_t(int(shared_mem)), pointers)
            if error:
                raise RuntimeError(f"emulated kernel {name}: {error.decode()}")

        return launch
