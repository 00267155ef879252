"""Every cuDNN graph mpifsdp would run on a GPU is built by cuDNN's own library on a machine with no
GPU (bench/cudnn_check.py, run with the tools `make test` installs in .venv-gpu-tools): the fused
attention's forward and backward, float16 and bfloat16, at the 370M GPT's shape and a test model's.
A graph cuDNN refuses fails here, not at a user's first step on a device."""

import pytest

from support import ROOT, run_gpu_tool

CHECK = ROOT / "bench" / "cudnn_check.py"


def test_every_cudnn_attention_graph_validates_and_lowers(comm):
    if comm.size > 1:
        pytest.skip("one single-process job: the plain-pytest pass covers it")
    done, lines = run_gpu_tool(CHECK)
    assert done.returncode == 0, lines or done.stderr[-2000:]
    built = {r["graph"] for r in lines if r.get("ok")}
    for shape in ("gpt370m", "test gpt"):
        assert {f"sdpa {shape} float16", f"sdpa {shape} bfloat16"} <= built, lines


def test_a_graph_cudnn_refuses_is_reported(comm):
    """The check fails on a shape cuDNN's SDPA cannot take (a head size not a multiple of 8): it
    would pass anything if it never asked the library."""
    if comm.size > 1:
        pytest.skip("one single-process job: the plain-pytest pass covers it")
    probe = (
        "import sys, json; sys.path.insert(0, 'bench'); import cudnn, cudnn_check; "
        "props = cudnn.create_device_properties(-1); "
        "print(json.dumps(cudnn_check.check('odd', (1, 2, 64, 12), 'float16', props)))"
    )
    done, lines = run_gpu_tool("-c", probe)
    assert done.returncode == 0, done.stderr[-2000:]
    result = lines[-1]
    assert not result["ok"] and "multiple of 8" in result["error"], result
