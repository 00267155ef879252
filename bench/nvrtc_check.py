"""Compile every GPU kernel of mpifsdp with NVRTC, with no GPU and no driver: the raw kernels
(base/kernels.py RAW_FAMILIES) and the elementwise ones (through CuPy's own code generator, as CuPy
would build them), for float16, bfloat16, float32 and float64, for sm_80 (A100) and sm_90 (H100/H200). One
JSON line per kernel and architecture (registers, spill bytes), then a summary; exit 1 on a compile
error or a spill. Needs CuPy and NVRTC (make test installs them in .venv-gpu-tools: see the Makefile):

    .venv-gpu-tools/bin/python bench/nvrtc_check.py

CuPy's elementwise generator is private API: its version is pinned in the Makefile.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy  # noqa: E402
from cupy._core import _carray, _kernel  # noqa: E402
from cupy._core import core as cupy_core  # noqa: E402
from cupy_backends.cuda.libs import nvrtc  # noqa: E402

import mpifsdp  # noqa: E402, F401 - mpifsdp.cuda (imported by it) declares every kernel family
from mpifsdp.base import kernels  # noqa: E402
from mpifsdp.base.checks import bfloat16  # noqa: E402
from mpifsdp.cuda import kernels as gpu_kernels  # noqa: E402

ARCHES = ("sm_80", "sm_90")
DTYPES = (np.float16, bfloat16().type, np.float32, np.float64)  # bfloat16: ml_dtypes', as CuPy takes it


def include_dirs() -> list[str]:
    """CuPy's headers and the CUDA headers the nvidia-* wheels ship (cuda_fp16.h among them)."""
    root = os.path.dirname(cupy.__file__)
    return [f"{root}/_core/include", *glob.glob(f"{root}/_core/include/cupy/_cccl/*"),
            *glob.glob(f"{os.path.dirname(root)}/nvidia/*/include")]  # fmt: skip


def build(name: str, source: str, arch: str) -> dict:
    program = nvrtc.createProgram(source, f"{name}.cu", [], [])
    options = [f"-arch={arch}", "--std=c++17", "-Xptxas=-v", *(f"-I{d}" for d in include_dirs())]
    try:
        nvrtc.compileProgram(program, options)
        log = nvrtc.getProgramLog(program)
        registers = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
        spills = sum(int(s) for s in re.findall(r"(\d+) bytes spill stores", log))
        return {"kernel": name, "arch": arch, "ok": True, "registers": registers, "spill_bytes": spills}
    except nvrtc.NVRTCError:
        return {"kernel": name, "arch": arch, "ok": False, "log": nvrtc.getProgramLog(program)[-2000:]}
    finally:
        nvrtc.destroyProgram(program)


def elementwise_source(name: str, dtype) -> str:
    """The CUDA source CuPy generates for gpu_kernels' ElementwiseKernel `name` on contiguous arrays
    of `dtype` (every parameter of ours is an array of T), with the headers CuPy puts before it."""
    in_params, out_params, operation = gpu_kernels._SOURCES[name]
    ins, outs = _kernel._get_param_info(in_params, True), _kernel._get_param_info(out_params, False)
    t = np.dtype(dtype).type
    infos = [_kernel._ArgInfo(1, cupy.ndarray, t, 1, True, True) for _ in ins + outs]
    infos.append(_kernel._ArgInfo(2, _carray.Indexer, None, 1, True, True))
    params = ins + outs + _kernel._get_param_info("CIndexer _ind", False)
    headers = "".join(f"#include <{h}>\n" for h in cupy_core._cupy_header_list)
    code = _kernel._get_elementwise_kernel_code(
        tuple(infos), _kernel._TypeMap((("T", t),)), tuple(params), operation, f"mpifsdp_{name}",
        gpu_kernels._PREAMBLE,
    )  # fmt: skip
    return headers + code


def main() -> int:
    results = []
    for arch in ARCHES:
        for family, declared in sorted(kernels.RAW_FAMILIES.items()):
            for dtype in DTYPES:
                results.append(build(f"{family} {np.dtype(dtype).name}", declared.source(dtype), arch))
        for name in gpu_kernels._SOURCES:
            for dtype in DTYPES:
                results.append(build(f"{name} {np.dtype(dtype).name}", elementwise_source(name, dtype), arch))
    for result in results:
        print(json.dumps(result))
    bad = [r for r in results if not r["ok"] or r["spill_bytes"]]
    print(json.dumps({"check": "nvrtc", "cupy": cupy.__version__, "kernels": len(results), "bad": len(bad)}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
