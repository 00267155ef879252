"""cuDNN's fused attention as mpifsdp wires it, checked on a CPU (run under `python -m gpusim`, which
puts cudnn_standin.py's twin in cudnn's place): a float16 attention_qkv forward and backward
on the GPU branch against float64 on the host, within the first-use check's bound; one launch each
way; the first-use check itself (a twin with the causal mask planted off must be refused by name);
and, with --no-cudnn, no silent slow path: attention refuses to run without cuDNN (SlowPathError
naming it and MPIFSDP_ALLOW_SLOW), and with MPIFSDP_ALLOW_SLOW=1 one line says why and the batched
passes compute the same.
Prints one JSON line; exits 1 on a failure.

    python -m gpusim tools/gpusim/standin_attention.py
    python -m gpusim --no-cudnn tools/gpusim/standin_attention.py
"""

from __future__ import annotations

import json
import logging
import os
import sys

import cupy
import numpy as np

import mpifsdp
from gpusim import cupy_standin
from mpifsdp.base import kernels
from mpifsdp.base.backend import to_numpy
from mpifsdp.base.checks import bfloat16
from mpifsdp.cuda import sdpa as gpu_attention

B, T, HEADS, HEAD = 2, 64, 4, 16


def _launches() -> dict:
    counted = {kind: n for (_, kind), n in cupy_standin.LAUNCHES.items()}
    cupy_standin.LAUNCHES.clear()
    return counted


def attention(qkv, g):
    """attention_qkv's output and gradient on the device branch, and the launches each way by kind."""
    x, g = mpifsdp.Tensor(cupy.asarray(qkv), requires_grad=True), cupy.asarray(g)
    _launches()
    y = mpifsdp.ops.attention_qkv(x, HEADS)
    forward = _launches()
    y.backward(g)
    return to_numpy(y.data), to_numpy(x.grad), forward, _launches()


def errors(qkv, g, out, gqkv, floor: float) -> dict:
    """Each result against float64, divided by the magnitude its terms sum to (gpu_attention.reference)
    and the floor of error_bound."""
    want, magnitude = gpu_attention.reference(qkv, g, HEADS, HEAD**-0.5)
    magnitude = {name: m + floor for name, m in magnitude.items()}
    got = dict(
        zip(
            ("out", "dq", "dk", "dv"),
            (gpu_attention._split(out, HEADS), *gpu_attention._split_qkv(gqkv, HEADS)),
        )
    )
    return {name: float(np.abs((got[name] - want[name]) / magnitude[name]).max()) for name in want}


def planted_fault_is_refused(qkv) -> str:
    """A fresh first use with the twin's causal mask off: the check must raise, naming the kernel."""
    from gpusim import cudnn_standin

    cudnn_standin.BROKEN["causal"] = True
    kernels._checked.clear()
    gpu_attention._LIBRARY.graphs.clear()
    try:
        mpifsdp.ops.attention_qkv(mpifsdp.Tensor(cupy.asarray(qkv)), HEADS)
        return ""
    except RuntimeError as exc:
        return str(exc)
    finally:
        cudnn_standin.BROKEN.clear()


def model_shape_checks() -> dict:
    """The first-use check at the 370M GPT's attention (16 heads of 64) in float16 and bfloat16:
    {dtype: (largest scaled error, bound)}. On an H200 its float16 dk (results under float16's
    normal range, rounded to its subnormal spacing) once broke a bound without a floor; the twin
    rounds as cuDNN does."""
    checks = {}
    for dtype in (np.dtype(np.float16), bfloat16()):
        found = gpu_attention._probe(cupy, dtype, 16, 64, gpu_attention.PROBE_POSITIONS, 64**-0.5)
        checks[dtype.name] = (max(float(np.abs(got - want).max()) for _, got, want, _ in found), found[0][3])
    return checks


def main() -> int:
    with_cudnn = "cudnn" in sys.modules
    said = []
    for name in ("mpifsdp.cuda.sdpa", "mpifsdp.base.kernels"):  # attention's lines, and a slow path's
        logging.getLogger(name).addHandler(logging.Handler())
        logging.getLogger(name).handlers[-1].emit = lambda r: said.append(r.getMessage())
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((B, T, 3 * HEADS * HEAD)).astype(np.float16)
    g = rng.standard_normal((B, T, HEADS * HEAD)).astype(np.float16)
    refused = ""
    if not with_cudnn:  # no silent slow path: refused until the user accepts it
        try:
            attention(qkv, g)
        except kernels.SlowPathError as exc:
            refused = str(exc)
        os.environ["MPIFSDP_ALLOW_SLOW"] = "1"
    attention(qkv, g)  # the first use builds the graphs and runs the check
    out, gqkv, forward, backward = attention(qkv, g)
    bound, floor = gpu_attention.error_bound(np.float16, T)
    result = {
        "check": "standin_attention",
        "cudnn": with_cudnn,
        "errors": errors(qkv, g, out, gqkv, floor),
        "bound": bound,
    }
    result.update(launches_forward=forward, launches_backward=backward, said=said)
    ok = all(e <= bound for e in result["errors"].values())
    if with_cudnn:
        refusal = planted_fault_is_refused(qkv)
        result["planted_fault"] = refusal
        launched = forward == {"cudnn sdpa": 1} and backward == {
            "cudnn sdpa": 1,
            "astype": 1,
        }  # x.grad's copy
        result["model_shape_checks"] = model_shape_checks()
        ok = ok and launched and "cudnn_sdpa" in refusal and not said
        ok = ok and all(e <= b for e, b in result["model_shape_checks"].values())
    else:
        result["refused"] = refused
        ok = ok and "cuDNN's fused attention cannot run" in refused and "MPIFSDP_ALLOW_SLOW=1" in refused
        ok = ok and len(said) == 1 and "cuDNN's fused attention unavailable" in said[0]
    print(json.dumps({**result, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
