"""How a collective's bytes move: MPI on host arrays, MPI on device arrays, host staging, or NCCL.

Comm keeps the schedule, the ledger and the checks; a transport only starts the data movement and
returns a request with Test()/Wait(). Chosen explicitly (Comm(transport=...)) or by `choose_transport`:
  "mpi"             NumPy arrays, MPI directly (the CPU path).
  "cuda-aware-mpi"  CuPy arrays handed to MPI directly; only where the MPI is CUDA-aware (asked of it:
                    mpi_cuda_support; one that says no gets host staging). The producing stream is
                    synchronized first (MPI does not see streams).
  "host"            CuPy arrays copied to host buffers, MPI on those, copied back on completion:
                    works with any MPI, and with several ranks sharing one GPU.
  "nccl"            cupy.cuda.nccl on a stream of its own at the device's highest priority (a gather
                    queued behind compute starts as soon as its input is ready), its unique id
                    broadcast over MPI; one rank per GPU (several with NCCL 2.30 or later and
                    NCCL_MULTI_RANK_GPU_ENABLE=1: backend.nccl_shares_gpus). Completion is a CUDA
                    event, so waiting orders the compute stream after it. Gathers and reductions
                    share the one stream and communicator: NCCL runs a communicator's collectives in
                    the order issued, and two communicators' kernels waiting on each other across
                    ranks can deadlock.
Only "mpi" and "host" (on NumPy arrays) are exercised by the CPU test suite; the device paths are checked
by `make gpu-check` on a GPU machine.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from ..base import backend
from ..base.checks import check_summable, is_bfloat16
from ..base.logs import job_warning

log = logging.getLogger(__name__)


class CopyBack:
    """An MPI request on host buffers whose result is copied to the device once it completes.
    `sent`, the host copy of what is sent, is kept until then: MPI reads it while the request is in
    flight, and mpi4py keeps no reference to a nonblocking call's buffers (a temporary freed at
    once had Open MPI reduce freed memory: garbage gradients over host staging)."""

    def __init__(self, request, host, device, sent):
        self.request, self.host, self.device, self.sent, self.finished = request, host, device, sent, False

    def Test(self):
        if not self.finished and self.request.Test():
            self.device[...] = backend.to_device(self.host, backend.device_of(self.device))
            self.finished, self.sent = True, None
        return self.finished

    def Wait(self):
        self.request.Wait()
        self.Test()


def words(array):
    """A bfloat16 array as its 16-bit words (MPI has no bfloat16 type; a gather only copies bits);
    any other array as it is."""
    return array.view(np.uint16) if is_bfloat16(array.dtype) else array


class MPITransport:
    name = "mpi"
    device_ordered = False  # whether its collectives queue on a device stream, the host not waiting

    def __init__(self, mpi):
        self.mpi = mpi

    def iall_gather(self, send, recv):
        return self.mpi.Iallgather(words(self._ready(send)), words(self._ready(recv)))

    def ireduce_scatter(self, send, recv):
        from mpi4py import MPI

        check_summable(self.name, send.dtype, "reduce_dtype")
        return self.mpi.Ireduce_scatter_block(self._ready(send), self._ready(recv), op=MPI.SUM)

    def iall_reduce(self, array):
        """array summed over ranks in place (HSDP's gradient shards across groups)."""
        from mpi4py import MPI

        check_summable(self.name, array.dtype, "reduce_dtype")
        return self.mpi.Iallreduce(MPI.IN_PLACE, self._ready(array), op=MPI.SUM)

    def ibroadcast(self, array, root: int):
        """array, in place, as rank `root` holds it (sync_params)."""
        return self.mpi.Ibcast(words(self._ready(array)), root=root)

    def _ready(self, array):
        return array


class CudaAwareMPITransport(MPITransport):
    name = "cuda-aware-mpi"

    def _ready(self, array):
        backend.synchronize(array)  # MPI reads device memory directly: the kernels writing it must be done
        return array


class HostStagingTransport(MPITransport):
    name = "host"

    def iall_gather(self, send, recv):
        backend.synchronize(send)
        host, sent = np.empty(recv.shape, dtype=recv.dtype), backend.to_numpy(send)
        return CopyBack(self.mpi.Iallgather(words(sent), words(host)), host, recv, sent)

    def ireduce_scatter(self, send, recv):
        from mpi4py import MPI

        check_summable(self.name, send.dtype, "reduce_dtype")
        backend.synchronize(send)
        host, sent = np.empty(recv.shape, dtype=recv.dtype), backend.to_numpy(send)
        return CopyBack(self.mpi.Ireduce_scatter_block(sent, host, op=MPI.SUM), host, recv, sent)

    def iall_reduce(self, array):
        from mpi4py import MPI

        check_summable(self.name, array.dtype, "reduce_dtype")
        return self._in_place(array, lambda host: self.mpi.Iallreduce(MPI.IN_PLACE, host, op=MPI.SUM))

    def ibroadcast(self, array, root: int):
        return self._in_place(array, lambda host: self.mpi.Ibcast(words(host), root=root))

    def _in_place(self, array, start):
        """An in-place collective on `array` through a host copy: start(host) gives its request, and
        the copy goes back to `array` when it completes (kept until then: sent and received there)."""
        backend.synchronize(array)
        host = backend.to_numpy(array)
        return CopyBack(start(host), host, array, host)


class NCCLTransport:
    name = "nccl"
    device_ordered = True

    def __init__(self, mpi):
        nccl = backend.nccl()
        uid = mpi.bcast(nccl.get_unique_id() if mpi.Get_rank() == 0 else None)
        self.nccl = nccl
        self.size = mpi.Get_size()
        self.comm = nccl.NcclCommunicator(self.size, uid, mpi.Get_rank())
        self.stream = backend.collective_stream()

    def iall_gather(self, send, recv):
        backend.stream_wait_current(self.stream)  # the comm stream waits for what produced `send`
        self.comm.allGather(
            send.data.ptr, recv.data.ptr, send.size, backend.nccl_dtype(send.dtype), self.stream.ptr
        )
        return backend.StreamRequest(self.stream, self.comm.check_async_error)

    def ireduce_scatter(self, send, recv):
        backend.stream_wait_current(self.stream)
        dtype = backend.nccl_dtype(send.dtype)
        self.comm.reduceScatter(
            send.data.ptr, recv.data.ptr, recv.size, dtype, self.nccl.NCCL_SUM, self.stream.ptr
        )
        return backend.StreamRequest(self.stream, self.comm.check_async_error)

    def request_after_current(self):
        """Completion of all work queued so far on the current stream, as a request (a replayed
        graph's collectives are in it: fsdp/graphed.py)."""
        return backend.StreamRequest(backend.current_stream(), self.comm.check_async_error)

    def iall_reduce(self, array):
        """array summed over ranks in place (a count, HSDP's gradient shards), on the comm stream."""
        backend.stream_wait_current(self.stream)
        dtype = backend.nccl_dtype(array.dtype)
        self.comm.allReduce(
            array.data.ptr, array.data.ptr, array.size, dtype, self.nccl.NCCL_SUM, self.stream.ptr
        )
        return backend.StreamRequest(self.stream, self.comm.check_async_error)

    def ibroadcast(self, array, root: int):
        backend.stream_wait_current(self.stream)
        dtype = backend.nccl_dtype(array.dtype)
        self.comm.broadcast(array.data.ptr, array.data.ptr, array.size, dtype, root, self.stream.ptr)
        return backend.StreamRequest(self.stream, self.comm.check_async_error)


def choose_transport(mpi, device: str, transport: str | None, ranks_on_node: int = 1, wait=None):
    """The transport for `device`: the user's explicit choice, else NCCL with one rank per GPU, else MPI
    on device buffers where the MPI says it is CUDA-aware, else host staging (transport_name). What
    the choice rests on is exchanged first (`wait`: the request's wait, under the watchdog), so every
    rank chooses alike, or every rank raises, naming what differs."""
    if device == "cpu":
        if transport not in (None, "mpi"):
            raise ValueError(f"transport {transport!r} needs a GPU device; on the CPU only 'mpi' applies")
        return MPITransport(mpi)
    choices = {"nccl": NCCLTransport, "cuda-aware-mpi": CudaAwareMPITransport, "host": HostStagingTransport}
    if transport not in (None, *choices):
        raise ValueError(f"unknown transport {transport!r}: choose one of {sorted(choices)}")
    aware, how = mpi_cuda_support()
    codes = {False: 0, None: 1, True: 2}  # the least any rank's MPI says wins: no < cannot say < yes
    mine = np.array(
        [
            codes[aware],
            backend.nccl_available() + backend.nccl_shares_gpus(),
            backend.ranks_sharing_gpu(ranks_on_node),
        ],
        np.int64,
    )
    every = np.empty((mpi.Get_size(), 3), np.int64)
    request = mpi.Iallgather(mine, every)
    wait(request) if wait else request.Wait()
    nccl_words = (
        "NCCL (0: none, 1: one rank a GPU, 2: several, NCCL_MULTI_RANK_GPU_ENABLE=1 and NCCL >= 2.30)"
    )
    for column, what in ((1, nccl_words), (2, "ranks sharing a GPU")):
        if len(set(every[:, column].tolist())) > 1:
            raise RuntimeError(
                f"the ranks differ in {what} ({dict(enumerate(every[:, column].tolist()))}): a transport "
                "for all of them cannot be chosen; pass Comm(transport=...) or make the nodes alike"
            )
    aware = {0: False, 1: None, 2: True}[int(every[:, 0].min())]
    nccl, shares = bool(every[0, 1]), int(every[0, 1]) == 2
    name, warning = transport_name(transport, int(every[0, 2]), nccl, aware, how, shares_gpus=shares)
    if warning:  # said once for this communicator: every rank chose alike
        job_warning(mpi, log, warning)
    log.info("collectives on %s use %s", device, name)
    return choices[name](mpi)


def transport_name(
    transport, ranks_per_gpu: int, nccl: bool, aware: bool | None, how: str, shares_gpus: bool = False
):
    """(the transport's name, a warning or None): NCCL needs one rank per GPU unless it lets ranks share
    one (shares_gpus: backend.nccl_shares_gpus); device buffers go to MPI only where it is CUDA-aware
    (an MPI that says it is not would crash or send garbage: host staging instead, said); an MPI that
    cannot say is taken at the user's word."""
    if transport == "nccl" and ranks_per_gpu > 1 and not shares_gpus:
        raise ValueError(
            f"NCCL needs one rank per GPU, but {ranks_per_gpu} ranks share one: use 'host' (or NCCL 2.30 "
            "or later with NCCL_MULTI_RANK_GPU_ENABLE=1 on every rank)"
        )
    warning = None
    if transport is None:
        if nccl and (ranks_per_gpu == 1 or shares_gpus):
            return "nccl", None
        transport = "cuda-aware-mpi" if aware else "host"
        if ranks_per_gpu > 1:
            warning = (
                f"{ranks_per_gpu} ranks share one GPU: NCCL needs one rank per GPU, so collectives use MPI"
            )
    if transport == "cuda-aware-mpi" and aware is False:
        return "host", (
            f"transport 'cuda-aware-mpi': this MPI says it is not CUDA-aware ({how}), so collectives stage "
            "through host memory instead; build the MPI with CUDA (or set its switch) for device buffers"
        )
    return transport, warning


def mpi_cuda_support() -> tuple[bool | None, str]:
    """Whether this process's MPI takes device buffers, and who said so: the library itself where it
    can answer (MPIX_Query_cuda_support: Open MPI, MPICH 4 and later), else the switch of an MPI that
    has one (Cray MPICH's MPICH_GPU_SUPPORT_ENABLED, MVAPICH2's MV2_USE_CUDA); (None, why) where
    nothing says. Handing device memory to an MPI that is not CUDA-aware crashes it or sends garbage."""
    import ctypes

    from mpi4py import MPI

    try:  # the MPI extension module's handle reaches the libmpi it was linked with
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        query = None
    if query is not None:
        query.restype = ctypes.c_int
        return bool(query()), "MPIX_Query_cuda_support"
    for variable in ("MPICH_GPU_SUPPORT_ENABLED", "MV2_USE_CUDA"):
        if variable in os.environ:
            return os.environ[variable] == "1", variable
    return None, "this MPI library cannot say"
