"""base/checks.py: the package's one way to read a yes or a no, and to refuse settings."""

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from mpifsdp.base import kernels
from mpifsdp.base.checks import check_summable, finfo, float_dtype, refuse_below, refuse_invalid, yes_or_no


def test_yes_or_no_reads_the_usual_words_and_refuses_the_others():
    assert [yes_or_no(w) for w in ("1", "true", "Yes", "ON")] == [True] * 4
    assert [yes_or_no(w) for w in ("0", "False", "no", "off")] == [False] * 4
    for word in ("maybe", "", "2", "y"):  # read as False before, silently
        with pytest.raises(ValueError, match="is not a yes or a no"):
            yes_or_no(word)


def test_refusals_name_every_bad_value_at_once():
    with pytest.raises(ValueError, match=r"^SGD: invalid lr=-1 \(>= 0\), momentum=2 \(< 1\)$"):
        refuse_invalid("SGD", (False, "lr=-1 (>= 0)"), (True, "fine"), (False, "momentum=2 (< 1)"))
    refuse_invalid("SGD", (True, "fine"))
    with pytest.raises(ValueError, match=r"plan: invalid world_size=0 \(must be >= 1\), flops=nan"):
        refuse_below("plan", world_size=(0, 1), flops=(float("nan"), 0))
    with pytest.raises(ValueError, match=r"invalid batch=2.5 \(must be an integer >= 1\)"):
        refuse_below("data", integers=True, batch=(2.5, 1))


def test_bfloat16_is_a_floating_dtype_that_only_nccl_sums():
    """ "bfloat16" and ml_dtypes.bfloat16 are read as CuPy's bfloat16 (NumPy calls its kind "V", not
    "f"); an MPI transport cannot sum it, so a bfloat16 reduction there is refused by name."""
    assert float_dtype("param_dtype", "bfloat16") == float_dtype("param_dtype", ml_dtypes.bfloat16)
    assert float_dtype("param_dtype", "bfloat16").name == "bfloat16"
    with pytest.raises(ValueError, match=r"give a floating dtype \(float16, bfloat16, float32 or float64\)"):
        float_dtype("param_dtype", np.uint16)  # bfloat16's width, not a float
    check_summable("nccl", "bfloat16", "reduce_dtype")
    check_summable("mpi", np.float32, "reduce_dtype")
    with pytest.raises(
        ValueError, match=r"reduce_dtype=bfloat16 over the 'host' transport: MPI has no bfloat16 sum"
    ):
        check_summable("host", ml_dtypes.bfloat16, "reduce_dtype")


def test_bfloat16_limits_come_from_ml_dtypes_where_numpy_refuses_them(monkeypatch):
    """NumPy 2.5's finfo refuses ml_dtypes' types (2.4's took them): on an H200 with NumPy 2.5 every
    bfloat16 kernel's first-use check failed there. Here finfo refuses them as 2.5's does."""
    numpy_finfo = np.finfo

    def finfo_of_numpy_2_5(dtype):
        if np.dtype(dtype).kind == "V":
            raise ValueError(f"data type {np.dtype(dtype)!r} not compatible with finfo")
        return numpy_finfo(dtype)

    monkeypatch.setattr(np, "finfo", finfo_of_numpy_2_5)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert float(finfo(bf16).eps) == 2.0**-7 and float(finfo(np.float16).eps) == 2.0**-10
    assert kernels.error_bound(bf16, 4, 2.0) == (4 * 2.0**-23 + 2.0**-7) * 2.0


def test_importing_mpifsdp_leaves_ml_dtypes_unloaded(comm):
    """Importing ml_dtypes takes most of a second (measured here: 0.67 s of its extension): bfloat16
    is looked up only where a program asks for it, so every other `import mpifsdp` stays fast."""
    if comm.size > 1:
        pytest.skip("starts its own process: runs in the plain-pytest pass of make test")
    probe = (
        "import sys, mpifsdp, mpifsdp.ops, mpifsdp.optim, mpifsdp.models; print('ml_dtypes' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stdout + done.stderr
