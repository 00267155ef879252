"""base/kernels.py's parts a CPU can check: no silent slow path."""

import logging

import pytest

from mpifsdp.base import kernels


class _NoCompiler:
    """A CuPy whose NVRTC cannot build anything (a toolkit without cuda_fp16.h, say)."""

    @staticmethod
    def RawModule(code, options):
        raise RuntimeError("catastrophic error: cannot open source file cuda_fp16.h")


def test_a_kernel_that_does_not_build_stops_the_run_unless_the_slow_path_is_accepted(monkeypatch, caplog):
    """Issue 50: a kernel NVRTC could not build logged one warning and the run trained 5-10x slower on
    the array passes. It raises now, naming the kernel, the cause and the setting that accepts the
    slower passes; with that setting, one warning (once per kernel) and None (the caller's passes)."""
    monkeypatch.delenv("MPIFSDP_ALLOW_SLOW", raising=False)
    monkeypatch.setenv("MPIFSDP_FUSED", "1")
    kernels.compiled.cache_clear()
    with pytest.raises(kernels.SlowPathError) as refused:
        kernels.compiled(_NoCompiler, "source", ("f",), "the GELU kernel")
    said = str(refused.value)
    assert "the GELU kernel cannot run" in said and "cuda_fp16.h" in said and "MPIFSDP_ALLOW_SLOW=1" in said
    monkeypatch.setenv("MPIFSDP_ALLOW_SLOW", "1")
    kernels._said_slow.discard("the GELU kernel")
    with caplog.at_level(logging.WARNING, logger="mpifsdp.base.kernels"):
        assert kernels.compiled(_NoCompiler, "source 2", ("f",), "the GELU kernel") is None
        assert kernels.compiled(_NoCompiler, "source 3", ("f",), "the GELU kernel") is None
    assert [r.getMessage().count("the GELU kernel unavailable") for r in caplog.records] == [1]
    kernels.compiled.cache_clear()
