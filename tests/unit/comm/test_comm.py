"""Comm: closed-form results from rank, the adjoint identity, accounting, collective errors."""

import re

import numpy as np
import pytest

from mpifsdp import CollectiveError

from support import agree


def test_all_gather_places_each_rank_shard(comm):
    n = 5
    shard = np.full(n, comm.rank + 1.0)
    full = np.empty(n * comm.size)
    comm.all_gather(shard, full, unit="u", phase="forward")
    expect = np.repeat(np.arange(1.0, comm.size + 1), n)
    agree(comm, np.array_equal(full, expect), f"all_gather gave {full}")


def test_reduce_scatter_sums_slices(comm):
    n, N = 3, comm.size
    full = np.arange(n * N, dtype=np.float64) * (comm.rank + 1)  # rank r sends (r+1) * arange
    shard = np.empty(n)
    comm.reduce_scatter(full, shard, unit="u", phase="backward")
    expect = np.arange(comm.rank * n, (comm.rank + 1) * n) * (N * (N + 1) / 2)
    agree(comm, np.allclose(shard, expect), f"reduce_scatter gave {shard}, expected {expect}")


def test_adjoint_identity(comm):
    """<AG(x), y> summed over ranks == <x, RS(y)> summed over ranks: RS is AG's adjoint."""
    rng = np.random.default_rng(100 + comm.rank)
    n = 7
    x, y = rng.standard_normal(n), rng.standard_normal(n * comm.size)
    ag, rs = np.empty(n * comm.size), np.empty(n)
    comm.all_gather(x, ag)
    comm.reduce_scatter(y, rs)
    left = comm.all_reduce_scalar(float(ag @ y))
    right = comm.all_reduce_scalar(float(x @ rs))
    # Both sides sum the same N * n * N products in other orders; a sum of m terms in float64 is off
    # by at most (m - 1) * eps * sum |terms| (the a-priori bound of recursive summation), each side.
    terms = n * comm.size * comm.size
    bound = 2 * terms * np.finfo(np.float64).eps * comm.all_reduce_scalar(float(np.abs(ag) @ np.abs(y)))
    agree(comm, abs(left - right) <= bound, f"{left} != {right} (bound {bound:.1e})")


def test_ledger_counts_ring_volume(comm):
    comm.ledger.reset()
    shard, full = np.zeros(4, np.float32), np.zeros(4 * comm.size, np.float32)
    comm.all_gather(shard, full, unit="a", phase="forward")
    comm.reduce_scatter(full, shard, unit="a", phase="backward")
    N = comm.size
    assert comm.ledger.total("calls", unit="a") == 2
    assert comm.ledger.total("elements", op="all_gather") == (N - 1) * 4
    assert comm.ledger.total("bytes", phase="backward") == (N - 1) * 4 * 4
    comm.ledger.reset()


def test_bad_buffers_raise(comm):
    with pytest.raises(ValueError, match="must hold exactly"):
        comm.all_gather(np.zeros(3), np.zeros(3 * comm.size + 1))
    with pytest.raises(ValueError, match="contiguous 1-D"):
        comm.all_gather(np.zeros((2, 2)), np.zeros(4 * comm.size))


def test_raise_if_any_raises_everywhere(comm):
    error = "broken here" if comm.rank == comm.size - 1 else None
    with pytest.raises(CollectiveError, match=f"rank {comm.size - 1}: broken here"):
        comm.raise_if_any(error, "the check")
    comm.raise_if_any(None, "a passing check")  # no error anywhere: returns


def test_wraps_a_user_communicator(comm):
    """Comm(any communicator): here the even and the odd ranks each form their own world."""
    from mpi4py import MPI

    from mpifsdp import Comm

    color = MPI.COMM_WORLD.Get_rank() % 2
    sub = Comm(MPI.COMM_WORLD.Split(color=color, key=MPI.COMM_WORLD.Get_rank()))
    members = [r for r in range(MPI.COMM_WORLD.Get_size()) if r % 2 == color]
    full = np.empty(sub.size)
    sub.all_gather(np.array([float(MPI.COMM_WORLD.Get_rank())]), full)
    agree(comm, full.tolist() == members and sub.ledger is not comm.ledger, f"sub-world gathered {full}")


def test_host_staging_transport_gathers_and_reduces_like_mpi(comm):
    """The GPU fallback path (copy to host, MPI, copy back on completion), exercised on NumPy arrays."""
    from mpifsdp.comm.transport import HostStagingTransport

    staging = HostStagingTransport(comm.mpi)
    n = 3
    full = np.empty(n * comm.size)
    request = staging.iall_gather(np.full(n, comm.rank + 1.0), full)
    request.Wait()
    shard = np.empty(n)
    reduce = staging.ireduce_scatter(np.arange(n * comm.size, dtype=np.float64), shard)
    while not reduce.Test():
        pass
    ok = np.array_equal(full, np.repeat(np.arange(1.0, comm.size + 1), n))
    ok &= np.array_equal(shard, np.arange(comm.rank * n, (comm.rank + 1) * n) * comm.size)
    agree(comm, bool(ok), f"host staging gave {full} and {shard}")


def test_host_staging_keeps_what_it_sends_until_the_request_completes(comm, monkeypatch):
    """MPI reads a nonblocking collective's send buffer while the request is in flight, and mpi4py
    keeps no reference to it: host staging's host copy of the device array (CuPy's asnumpy makes a
    new one) must stay alive until the request completes, or MPI reads freed memory (Open MPI
    reduced garbage into the gradients). An MPI stand-in checks, when tested, that it still lives."""
    import weakref

    from mpifsdp.base import backend
    from mpifsdp.comm.transport import HostStagingTransport

    class Request:
        def __init__(self, sent):
            self.sent = weakref.ref(sent)

        def Test(self):
            assert self.sent() is not None, "the send buffer was freed while the request was in flight"
            return True

    class MPI:
        def Iallgather(self, send, recv):
            return Request(send)

        def Ireduce_scatter_block(self, send, recv, op):
            return Request(send)

    monkeypatch.setattr(backend, "to_numpy", lambda array: np.array(array))  # a copy, as CuPy's
    staging = HostStagingTransport(MPI())
    for request in (
        staging.iall_gather(np.ones(3), np.empty(3)),
        staging.ireduce_scatter(np.ones(3), np.empty(3)),
    ):
        assert request.Test()


def test_transport_choices_are_checked(comm):
    from mpifsdp.comm.transport import choose_transport

    with pytest.raises(ValueError, match="transport 'nccl' needs a GPU device"):
        choose_transport(comm.mpi, "cpu", "nccl")
    assert comm.transport.name == "mpi" and comm.device == "cpu"


def test_the_mpi_is_asked_whether_it_takes_device_buffers(comm, monkeypatch):
    """Issue 49: CUDA awareness was the user's word alone; an MPI that is not CUDA-aware, handed device
    memory, crashes or sends garbage. The library answers where it can (the wheels' MPICH 5 and Open
    MPI 5 both export MPIX_Query_cuda_support, and neither is CUDA-aware); Cray's and MVAPICH2's
    switches answer otherwise; a no turns the user's 'cuda-aware-mpi' into host staging, said."""
    from mpifsdp.comm import transport

    aware, how = transport.mpi_cuda_support()
    if comm.library.startswith(("MPICH Version: 5", "Open MPI v5")):
        assert (aware, how) == (False, "MPIX_Query_cuda_support")
    import ctypes

    monkeypatch.setattr(ctypes, "CDLL", lambda *_: object())  # a library without the query
    monkeypatch.setenv("MPICH_GPU_SUPPORT_ENABLED", "1")
    assert transport.mpi_cuda_support() == (True, "MPICH_GPU_SUPPORT_ENABLED")
    monkeypatch.delenv("MPICH_GPU_SUPPORT_ENABLED")
    monkeypatch.setenv("MV2_USE_CUDA", "0")
    assert transport.mpi_cuda_support() == (False, "MV2_USE_CUDA")
    monkeypatch.delenv("MV2_USE_CUDA")
    assert transport.mpi_cuda_support()[0] is None
    name = transport.transport_name
    assert name("cuda-aware-mpi", 1, True, True, "q") == ("cuda-aware-mpi", None)
    chosen, said = name("cuda-aware-mpi", 1, True, False, "MPIX_Query_cuda_support")
    assert chosen == "host" and "says it is not CUDA-aware (MPIX_Query_cuda_support)" in said
    assert name("cuda-aware-mpi", 1, True, None, "cannot say") == ("cuda-aware-mpi", None)  # the user's word
    assert name(None, 1, True, False, "q") == ("nccl", None)
    assert name(None, 1, False, True, "q") == ("cuda-aware-mpi", None)
    assert name(None, 1, False, None, "q") == ("host", None)
    assert name(None, 2, True, True, "q")[0] == "cuda-aware-mpi"
    with pytest.raises(ValueError, match="NCCL needs one rank per GPU.*NCCL_MULTI_RANK_GPU_ENABLE=1"):
        name("nccl", 2, True, True, "q")
    # an NCCL that lets ranks share a GPU (2.30 and later, asked for): chosen, and taken when named
    assert name(None, 2, True, True, "q", shares_gpus=True) == ("nccl", None)
    assert name("nccl", 2, True, None, "q", shares_gpus=True) == ("nccl", None)


def test_ranks_share_a_gpu_over_nccl_only_where_its_version_allows(monkeypatch):
    """NCCL_MULTI_RANK_GPU_ENABLE=1 lets ranks share a GPU over NCCL only from 2.30 (ncclGetVersion's
    23000): an older NCCL hangs or fails there; unasked, never (backend.nccl_shares_gpus)."""
    import types

    from mpifsdp.base import backend

    version = {"code": 22809}
    fake = types.SimpleNamespace(available=True, get_version=lambda: version["code"])
    monkeypatch.setattr(backend, "nccl", lambda: fake)
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    assert not backend.nccl_shares_gpus()  # 2.28.9
    version["code"] = 23000
    assert backend.nccl_shares_gpus()
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "0")
    assert not backend.nccl_shares_gpus()


def test_no_module_but_comm_and_transport_calls_mpi_collectives():
    """docs/design.md, invariant 5: every collective goes through Comm (announced, watched, counted)."""
    from pathlib import Path

    import mpifsdp

    collectives = re.compile(
        r"^\s*(?:from|import) mpi4py\b"  # the module itself (imported; a message may name it)
        r"|\.(I?Allgatherv?|I?Allreduce|I?Bcast|I?Barrier|I?Reduce_scatter(_block)?|I?Gatherv?|I?Scatterv?"
        r"|I?Alltoallv?|I?Reduce|Split(_type)?|Clone|Dup|Create\w*)\("  # mpi4py's buffer collectives
        r"|\.mpi\.(?!Get_rank|Get_size)\w+\("  # anything else on a Comm's MPI communicator (pickled ones)
    )
    package = Path(mpifsdp.__file__).parent
    offenders = [
        f"{path.relative_to(package.parent)}:{number}: {line.strip()}"
        for path in sorted(package.rglob("*.py"))
        if path.name not in ("communicator.py", "transport.py", "presence.py")  # presence: its side channel
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if collectives.search(line)
    ]
    assert not offenders, "MPI collectives outside comm/ (communicator, transport, presence):\n" + "\n".join(
        offenders
    )


def test_object_collectives_barrier_and_agreement_are_announced_and_counted(comm):
    comm.ledger.reset()
    before = comm.schedule.position()[0]
    assert comm.broadcast_object({"name": "x"} if comm.rank == 0 else None) == {"name": "x"}
    assert comm.allgather_object(comm.rank * 10) == [r * 10 for r in range(comm.size)]
    comm.barrier()
    assert comm.run_everywhere(lambda: comm.rank, "a harmless action") == comm.rank

    def fails_on_last_rank():
        if comm.rank == comm.size - 1:
            raise OSError("disk full")

    with pytest.raises(
        CollectiveError, match=rf"a write failed on 1 of {comm.size} ranks:\n  rank {comm.size - 1}: disk"
    ):
        comm.run_everywhere(fails_on_last_rank, "a write")
    with pytest.raises(KeyError):  # not in `catch`: raised where it happens, as any bug
        comm.run_everywhere(lambda: {}["missing"], "a lookup", catch=(OSError,))
    # 2 broadcasts (length, bytes), 1 + 1 + 1 object exchanges (raise_if_any inside each
    # run_everywhere), 1 barrier; each announced to the schedule and counted in the ledger
    for op, calls in (("broadcast", 2), ("allgather_object", 3), ("barrier", 1)):
        assert comm.ledger.total("calls", op=op) == calls, op
    assert comm.schedule.position()[0] - before == 6


def test_mpifsdp_log_lines_say_which_rank_wrote_them(comm, caplog):
    """A warning every rank gave was a wall of identical lines: where several ranks print, each of
    mpifsdp's log records starts with its rank; other loggers' records are left as they are."""
    import logging

    with caplog.at_level("WARNING"):
        logging.getLogger("mpifsdp.checkpoint").warning("a warning from %s", "mpifsdp")
        logging.getLogger("someone.else").warning("not ours")
    said = [r.getMessage() for r in caplog.records]
    label = f"[rank {comm.rank}] " if comm.size > 1 else ""
    assert said == [f"{label}a warning from mpifsdp", "not ours"], said


def test_a_warning_every_rank_agrees_on_is_said_once_for_the_job(comm, caplog):
    """Issue 49: a skipped step (its norm all-reduced) was N identical lines in a Slurm log. A warning
    whose condition the ranks agree on is said by rank 0 alone, unlabelled; here a real one: float16
    gradients that overflow, skipped by the loss scaler."""
    from mpifsdp import AdamW, LossScaler, fully_shard, sharded_model
    from mpifsdp.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=16, block_size=4, n_layer=1, n_head=1, n_embd=8), seed=0)
    fully_shard(model, comm, units=model.blocks, param_dtype=np.float16, reduce_dtype=np.float32)
    opt, scaler = AdamW(model, lr=1e-3), LossScaler(init_scale=2.0**8)
    x = np.zeros((1, 4), dtype=np.int64)
    scaler.scale(model(x, x)).backward()
    sharded_model(model).units[0].grad_shard[0] = np.inf  # on every rank: the norm is Inf on all
    with caplog.at_level("WARNING"):
        assert scaler.step(opt) is False
    said = [r.getMessage() for r in caplog.records if r.name.startswith("mpifsdp")]
    assert said == (["loss scale overflow: skipped the step, scale now 128"] if comm.rank == 0 else []), said
