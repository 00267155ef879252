"""Build every cuDNN graph mpifsdp would run, with no GPU: the SDPA forward and backward of
cuda/sdpa.py (q, k and v read out of the fused projection by strides, dq, dk and dv written
into its gradient, causal), float16 and bfloat16, at the 370M GPT's shape and at a test model's,
validated and lowered by cuDNN's own library (validate + build_operation_graph, with no device: its
execution plans need one). One JSON line per graph, then a summary; exit 1 if one fails. Needs
nvidia-cudnn-frontend and libcudnn.so.9 (make test installs them in .venv-gpu-tools):

    .venv-gpu-tools/bin/python bench/cudnn_check.py
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cudnn  # noqa: E402

from mpifsdp.cuda import sdpa as gpu_attention  # noqa: E402

SHAPES = {"gpt370m": (8, 16, 1024, 64), "test gpt": (2, 4, 64, 16)}  # batch, heads, positions, head size


def check(name: str, shape, dtype_name: str, device_property) -> dict:
    try:
        gpu_attention.build_graphs(
            cudnn, shape, dtype_name, 1 / math.sqrt(shape[-1]), device_property=device_property
        )
        return {"graph": f"sdpa {name} {dtype_name}", "shape": shape, "ok": True}
    except Exception as exc:
        return {
            "graph": f"sdpa {name} {dtype_name}",
            "shape": shape,
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
        }


def main():
    device_property = cudnn.create_device_properties(-1)  # a description, not a device
    results = [check(n, s, d, device_property) for n, s in SHAPES.items() for d in gpu_attention.IO_TYPES]
    for r in results:
        print(json.dumps(r))
    print(
        json.dumps(
            {
                "cudnn_backend": cudnn.backend_version(),
                "graphs": len(results),
                "failed": sum(not r["ok"] for r in results),
            }
        )
    )
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
