"""BLAS threads per rank: the node's cores shared by its ranks, unless the user chose."""

import os

from threadpoolctl import threadpool_info, threadpool_limits

from mpifsdp import Comm
from mpifsdp.threads import configure_threads, threads_per_rank, usable_cores


def _blas_threads():
    return threadpool_info()[0]["num_threads"]


def test_a_user_setting_is_respected(comm):
    assert os.environ.get("OMP_NUM_THREADS") == "1"  # set by conftest, as a user would
    with threadpool_limits(1, user_api="blas"):
        assert configure_threads(comm.mpi, "auto") is None
        assert _blas_threads() == 1


def test_auto_shares_the_cores_between_ranks_on_the_node(comm, monkeypatch):
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    with threadpool_limits(None, user_api="blas"):
        chosen = Comm(threads="auto").threads
        assert chosen == max(1, usable_cores() // comm.size) == _blas_threads()
        assert Comm(threads=1).threads == 1 == _blas_threads()
        assert Comm(threads=None).threads is None


def test_threads_per_rank_never_below_one():
    assert threads_per_rank(10_000) == 1
    assert threads_per_rank(1) == usable_cores()
