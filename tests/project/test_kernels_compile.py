"""Every GPU kernel compiles with NVRTC for sm_80 and sm_90, without spills, on a machine with no GPU
(bench/nvrtc_check.py, run with the tools `make test` installs in .venv-gpu-tools): a kernel that does
not compile fails here, not at a user's first step on a device."""

import pytest

from mpifsdp.base import kernels
from mpifsdp.cuda import kernels as gpu_kernels

from support import ROOT, run_gpu_tool

CHECK = ROOT / "bench" / "nvrtc_check.py"


def test_every_gpu_kernel_compiles_for_sm80_and_sm90_without_spills(comm):
    if comm.size > 1:
        pytest.skip("one single-process job: the plain-pytest pass covers it")
    done, lines = run_gpu_tool(CHECK, timeout=600)
    assert done.returncode == 0, [
        r for r in lines if not r.get("ok", True) or r.get("spill_bytes")
    ] or done.stderr
    built = {(r["kernel"], r["arch"]): r for r in lines if "kernel" in r}
    dtypes = ["float16", "bfloat16", "float32", "float64"]  # bfloat16: CuPy's, as ml_dtypes gives it
    for arch in ("sm_80", "sm_90"):
        for family, declared in kernels.RAW_FAMILIES.items():
            for dtype in dtypes:
                result = built[(f"{family} {dtype}", arch)]
                assert len(result["registers"]) == len(declared.kernels), result  # every function built
        for name in gpu_kernels._SOURCES:
            for dtype in dtypes:
                assert built[(f"{name} {dtype}", arch)]["ok"]


def test_a_kernel_that_does_not_compile_is_reported(comm):
    """The check fails on a broken source (it would pass anything if it never compiled)."""
    if comm.size > 1:
        pytest.skip("one single-process job: the plain-pytest pass covers it")
    probe = (
        "import sys, json; sys.argv = ['x']; sys.path.insert(0, 'bench'); import nvrtc_check; "
        "broken = 'extern \"C\" __global__ void k() { undeclared = 1; }'; "
        "print(json.dumps(nvrtc_check.build('broken', broken, 'sm_90')))"
    )
    done, lines = run_gpu_tool("-c", probe)
    assert done.returncode == 0, done.stderr
    assert lines[-1]["ok"] is False and "undeclared" in lines[-1]["log"], done.stdout
