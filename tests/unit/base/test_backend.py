"""The GPU-facing parts of backend.py that can be checked without a GPU: a stand-in for CuPy records
what they ask of it (make gpu-check runs them on a real device)."""

import types

import pytest

from mpifsdp.base import backend


class FakeCupy:
    """The pieces of cupy that backend.py touches: Device(i).use(), runtime.eventQuery, streams."""

    def __init__(self, event_status=0):
        self.used, self.waited = [], []
        fake = self

        class Device:
            def __init__(self, index):
                self.index = index

            def use(self):
                fake.used.append(self.index)

        class Stream:
            def wait_event(self, event):
                fake.waited.append(event)

        self.cuda = types.SimpleNamespace(
            Device=Device,
            runtime=types.SimpleNamespace(eventQuery=lambda ptr: event_status, getDeviceCount=lambda: 2),
            get_current_stream=Stream,
        )


def test_plain_cuda_keeps_the_ranks_gpu_and_cuda_n_selects_n(monkeypatch):
    fake = FakeCupy()
    monkeypatch.setattr(backend, "_cupy", lambda: fake)
    assert backend.array_module("cuda") is fake and fake.used == []  # select_gpu's choice stays
    backend.array_module("cuda:1")
    assert fake.used == [1]


@pytest.mark.parametrize("status, done", [(0, True), (600, False)])
def test_an_event_is_done_or_not_ready(monkeypatch, status, done):
    monkeypatch.setattr(backend, "_cupy", lambda: FakeCupy(status))
    assert backend.event_done(types.SimpleNamespace(ptr=1)) is done


def test_a_cuda_error_while_waiting_raises_instead_of_spinning(monkeypatch):
    monkeypatch.setattr(backend, "_cupy", lambda: FakeCupy(700))  # cudaErrorIllegalAddress
    with pytest.raises(RuntimeError, match="CUDA error 700"):
        backend.event_done(types.SimpleNamespace(ptr=1))


def test_a_stream_request_raises_the_librarys_asynchronous_error(monkeypatch):
    monkeypatch.setattr(backend, "_cupy", lambda: FakeCupy(600))
    stream = types.SimpleNamespace(record=lambda: types.SimpleNamespace(ptr=1))
    assert backend.StreamRequest(stream).Test() is False

    def nccl_failed():
        raise RuntimeError("NCCL error: unhandled system error")

    with pytest.raises(RuntimeError, match="NCCL error"):
        backend.StreamRequest(stream, check=nccl_failed).Test()


def test_a_required_gpu_that_is_missing_raises_with_its_cause(monkeypatch):
    def no_cupy(name):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(backend.importlib, "import_module", no_cupy)
    monkeypatch.delenv("MPIFSDP_REQUIRE_GPU", raising=False)
    assert backend.gpu_available() is False
    for on in ("1", "true", "yes", "ON"):  # true, yes and on were read as off, silently
        monkeypatch.setenv("MPIFSDP_REQUIRE_GPU", on)
        with pytest.raises(RuntimeError, match="MPIFSDP_REQUIRE_GPU is on, but no GPU is usable.*cupy"):
            backend.gpu_available()
    monkeypatch.setenv("MPIFSDP_REQUIRE_GPU", "off")
    assert backend.gpu_available() is False
    monkeypatch.setenv("MPIFSDP_REQUIRE_GPU", "sure")
    with pytest.raises(ValueError, match="MPIFSDP_REQUIRE_GPU='sure': use 1/true/yes/on or 0/false/no/off"):
        backend.gpu_available()


def test_the_cublas_library_is_found_by_its_path_in_the_memory_map():
    """cuda/cublas_api.py calls the libcublas CuPy loaded, found in /proc/self/maps: its path alone,
    once, and not cuBLASLt's (whose name shares the prefix)."""
    maps = [
        "7f00-7f10 r--p 00000000 08:01 1 /site/nvidia/cublas/lib/libcublasLt.so.13\n",
        "7f10-7f20 r-xp 00000000 08:01 2 /site/nvidia/cublas/lib/libcublas.so.13\n",
        "7f20-7f30 r--p 00010000 08:01 2 /site/nvidia/cublas/lib/libcublas.so.13\n",
        "7f30-7f40 rw-p 00000000 00:00 0 \n",
    ]
    assert backend.mapped_paths(maps, "libcublas.so") == ["/site/nvidia/cublas/lib/libcublas.so.13"]
