"""BLAS threads per rank: the node's cores shared by its ranks, unless the user chose."""

import os
import subprocess
import sys

import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from mpifsdp import Comm
from mpifsdp.base import machine
from mpifsdp.base.threads import set_threads, threads_per_rank, usable_cores

from support import require


def _blas_threads():
    """This process's BLAS threads; skips where threadpoolctl can read or set none (support.require)."""
    require(machine.blas_threads_problem())
    return machine.blas()["num_threads"]


def test_a_user_setting_is_respected(comm):
    assert os.environ.get("OMP_NUM_THREADS") == "1"  # set by conftest, as a user would
    with threadpool_limits(1, user_api="blas"):
        assert set_threads("auto", comm.node_size) is None
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


def test_kernels_split_across_threads_match_one_thread():
    """The fused kernels and AdamW give the same bits whether their rows run on 1 or 3 threads
    (attention: its heads; BLAS on one thread throughout, as inside attention's threaded blocks)."""
    import numpy as np

    from mpifsdp.base.threads import row_blocks, set_elementwise_threads
    from mpifsdp.extend import PRIMITIVES
    from mpifsdp.optim.optimizers import adamw_update

    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 1100, 256))  # 3300 rows of 256: three blocks on three threads
    w, b = rng.standard_normal(256), rng.standard_normal(256)
    q, k, v = (rng.standard_normal((4, 6, 192, 16)) for _ in range(3))  # 6 heads: 3 blocks of 2
    cases = {
        "gelu": ((x,), {}),
        "layer_norm": ((x, w, b), {"eps": 1e-5}),
        "attention": ((q, k, v), {}),
        "cross_entropy": ((x,), {"targets": rng.integers(0, 256, (3, 1100))}),
    }
    results = {}
    for threads in (1, 3):
        set_elementwise_threads(threads)
        assert len(row_blocks(3300, 256)) == threads
        assert len(row_blocks(6, 4 * 192 * 192)) == threads
        for name, (arrays, settings) in cases.items():
            prim = PRIMITIVES[name]
            with threadpool_limits(1, user_api="blas"):
                out, saved = prim.forward(*arrays, **settings)
                cotangent = np.cos(np.arange(out.size)).reshape(out.shape)
                results[threads, name] = (out, prim.vjp(cotangent, saved, *arrays, **settings))
        p, m, s = (np.linspace(-1, 1, 300_001) for _ in range(3))
        adamw_update(p, x.reshape(-1)[:300_001], m, s**2, lr=0.1, beta1=0.9, beta2=0.95, eps=1e-8, step=2)
        results[threads, "adamw"] = (p, (m,))
    set_elementwise_threads(1)
    # Splitting rows across threads changes no arithmetic within a row, and LayerNorm's weight and
    # bias gradients, sums over rows, add partials of fixed groups of rows (fused.sum_group) in row
    # order: bit-identical results (deterministic mode relies on it: ranks have other thread counts).
    for name in list(cases) + ["adamw"]:
        (o1, g1), (o3, g3) = results[1, name], results[3, name]
        np.testing.assert_array_equal(o3, o1, err_msg=name)
        for a, c in zip(g1, g3):
            np.testing.assert_array_equal(c, a, err_msg=name)


def test_import_makes_openblas_threads_sleep_unless_the_user_chose(comm):
    """`import mpifsdp` sets OPENBLAS_THREAD_TIMEOUT for a NumPy loaded after it; a user's value stays."""
    if comm.size > 1:
        pytest.skip("runs its own processes: the plain-pytest pass of make test covers it")
    show = "import os, mpifsdp; print(os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    for given, want in ((None, "4"), ("10", "10")):
        run_env = env if given is None else {**env, "OPENBLAS_THREAD_TIMEOUT": given}
        done = subprocess.run([sys.executable, "-c", show], env=run_env, capture_output=True, text=True)
        assert done.stdout.strip() == want, done.stderr[-2000:]


def test_blocks_that_run_gemms_run_them_on_one_blas_thread_each():
    """Threaded blocks that call BLAS (blocked attention) run it single-threaded, then BLAS gets its
    threads back: BLAS's own threads on top of ours oversubscribe the cores (threads.one_blas_thread)."""
    from mpifsdp.base.threads import for_row_blocks, set_elementwise_threads

    def blas_threads():
        return [i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"]

    require(machine.blas_threads_problem())
    seen = []
    with threadpool_limits(2, user_api="blas"):
        set_elementwise_threads(2)
        try:
            for calls_blas in (False, True):
                seen.clear()
                blocks = for_row_blocks(1 << 12, 1 << 10, lambda i, lo, hi: seen.append(blas_threads()),
                                        calls_blas=calls_blas)  # fmt: skip
                assert blocks == 2 and len(seen) == 2
                assert all(set(t) == ({1} if calls_blas else {2}) for t in seen), (calls_blas, seen)
            assert set(blas_threads()) == {2}  # restored after the section (every BLAS loaded)
        finally:
            set_elementwise_threads(1)


@pytest.mark.parametrize("threads", [0, -2, 1.5, "many", True])
def test_an_invalid_thread_count_is_refused_before_anything_is_set(threads):
    with threadpool_limits(None, user_api="blas"):
        before = _blas_threads()
        with pytest.raises(ValueError, match=f"threads={threads!r}: give 'auto', an integer >= 1, or None"):
            set_threads(threads)
        assert _blas_threads() == before


@pytest.mark.parametrize("value", ["0", "lots", "-1", "2.5"])
def test_a_thread_variable_that_is_no_count_is_named(monkeypatch, value):
    """OMP_NUM_THREADS=0 or =lots was accepted without a word (BLAS ignores it, or takes 0 as all cores)."""
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    with pytest.raises(ValueError, match=f"OMP_NUM_THREADS={value!r} is not a thread count >= 1"):
        set_threads("auto")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert set_threads("auto") is None  # a count the user chose: left as it is
