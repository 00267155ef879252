"""Unit on plain arrays, without autodiff: shard, unshard, reduce_grad, AdamW, errors."""

import numpy as np
import pytest

from mpifsdp import AdamW, CollectiveError, Tensor, Unit, full_state_dict, fully_shard
from mpifsdp.data import rank_slice
from mpifsdp.nn.layers import Linear

from support import agree


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((7, 3)), "b": rng.standard_normal(2)}  # 23 elements: pads for N=2,3,4


def test_unshard_returns_the_original_arrays(comm):
    arrays = _arrays()
    unit = Unit("u", arrays, comm)
    assert unit.shard.size == -(-23 // comm.size) and unit.state == "sharded"
    with unit.unsharded() as full:
        ok = all(np.array_equal(full[k], arrays[k]) for k in arrays)
    views = unit.unshard()  # FSDP's pooled path: the unit's own state machine
    ok &= unit.state == "unsharded" and all(np.array_equal(views[k], arrays[k]) for k in arrays)
    unit.reshard()
    agree(comm, ok and unit.state == "sharded" and unit.full is None, "unshard/reshard round trip")


def test_reduce_grad_averages_over_ranks_and_accumulates(comm):
    unit = Unit("u", _arrays(), comm)
    grads = {"w": np.full((7, 3), comm.rank + 1.0), "b": np.full(2, comm.rank + 1.0)}
    unit.reduce_grad(grads)
    unit.reduce_grad(grads)  # accumulates until zeroed
    mean = (comm.size + 1) / 2
    views = unit.gather(unit.grad_shard)
    ok = np.allclose(views["w"], 2 * mean) and np.allclose(views["b"], 2 * mean)
    agree(comm, ok, f"grad mean {views}")
    unit.zero_grad()
    assert unit.flat_grad() is None and not unit.grad_shard.any()


def _least_squares_data(comm, n_global=12, seed=5):
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal((n_global, 7)), rng.standard_normal((n_global, 2))
    return rank_slice(x, comm.rank, comm.size), rank_slice(y, comm.rank, comm.size)


def test_unit_api_matches_the_autodiff_path(comm):
    """Hand-written least-squares gradients through Unit == autodiff through fully_shard."""
    x, y = _least_squares_data(comm)
    init = Linear(7, 2, rng=np.random.default_rng(0), dtype=np.float64)
    unit = Unit("model", {"weight": init.weight.data, "bias": init.bias.data}, comm)
    model = Linear(7, 2, rng=np.random.default_rng(0), dtype=np.float64)
    fully_shard(model, comm)
    opt_unit = AdamW([unit], lr=0.05, weight_decay=0.1)
    opt_auto = AdamW(model, lr=0.05, weight_decay=0.1)
    for _ in range(5):
        with unit.unsharded() as p:
            r = x @ p["weight"] + p["bias"] - y  # loss = mean(r^2) / 2 over this rank's rows
            grads = {"weight": x.T @ r / r.size, "bias": r.sum(axis=0) / r.size}
        unit.reduce_grad(grads)
        opt_unit.step()
        opt_unit.zero_grad()

        diff = model(Tensor(x)) - y
        ((diff * diff).mean() * 0.5).backward()
        opt_auto.step()
        opt_auto.zero_grad()
    got = {k: v.copy() for k, v in unit.gather(unit.shard).items()}
    want = full_state_dict(model)
    err = max(np.abs(got[k] - want[k]).max() for k in got)
    # float64, the same arithmetic in other orders: last-bit differences (measured <= 1.4e-16 at N = 1..4
    # under the Haswell, Sandybridge and Prescott kernels) that five AdamW steps may magnify; 1e-12 is
    # still 10^6 below what a wrong gradient or a missing 1/N gives (O(lr) = 1e-2 per step).
    agree(comm, err < 1e-12, f"Unit vs autodiff differ by {err}")


def test_padding_stays_zero_through_adamw(comm):
    unit = Unit("u", _arrays(), comm)
    opt = AdamW([unit], lr=0.1, weight_decay=0.5)
    for step in range(3):
        unit.reduce_grad({"w": np.full((7, 3), step + 1.0), "b": np.ones(2)})
        opt.step()
        opt.zero_grad()
    full = np.empty(unit.layout.padded_numel)
    comm.all_gather(unit.shard, full)
    agree(comm, not full[unit.layout.numel :].any(), f"padding became {full[unit.layout.numel :]}")


def test_unit_errors(comm):
    unit = Unit("u", _arrays(), comm)
    with pytest.raises(KeyError, match=r"missing gradients for \['b'\]"):
        unit.reduce_grad({"w": np.zeros((7, 3))})
    with pytest.raises(ValueError, match=r"gradient 'w' has shape \(3, 7\), expected \(7, 3\)"):
        unit.reduce_grad({"w": np.zeros((3, 7)), "b": np.zeros(2)})
    with pytest.raises(TypeError, match=r"gradient 'b' is NoneType, not an array; .* shape \(2,\)"):
        unit.reduce_grad({"w": np.zeros((7, 3)), "b": None})
    with pytest.raises(TypeError, match=r"gradient 'b' is list, not an array"):
        unit.reduce_grad({"w": np.zeros((7, 3)), "b": [0.0, 0.0]})
    with pytest.raises(CollectiveError, match="unit 'empty' has no parameters"):
        Unit("empty", {}, comm)
    with pytest.raises(CollectiveError, match="one dtype"):
        Unit("mixed", {"a": np.zeros(2, np.float32), "b": np.zeros(2)}, comm)


@pytest.mark.mpi(min_size=2)
def test_layouts_that_differ_between_ranks_raise_everywhere(comm):
    shape = (3, 2) if comm.rank == 0 else (2, 3)
    with pytest.raises(CollectiveError, match="layout differs between ranks"):
        Unit("odd", {"w": np.zeros(shape)}, comm)


def test_parameters_must_be_floating_arrays(comm):
    with pytest.raises(CollectiveError, match="parameter 'a' is a float, not an array: pass np.asarray"):
        Unit("u", {"a": 1.5}, comm)
    with pytest.raises(CollectiveError, match="parameter 'w' is a int64 array: parameters must be floating"):
        Unit("u", {"w": np.arange(4)}, comm)
    unit = Unit("u", {"a": np.asarray(1.5), "w": np.ones(3)}, comm)  # a 0-d array is a scalar parameter
    with unit.unsharded() as p:
        assert p["a"].shape == () and p["a"] == 1.5


def test_uneven_rows_weighted_give_the_global_mean_and_sum(comm):
    """37 rows over N ranks (uneven for N = 2..4): each rank's mean gradient weighted by its row count
    is the full-batch mean gradient; reduce="sum" of per-rank sums is the full-batch sum."""
    rng = np.random.default_rng(7)
    X, Y, W = rng.standard_normal((37, 4)), rng.standard_normal((37, 2)), rng.standard_normal((4, 2))
    x, y = rank_slice(X, comm.rank, comm.size, even=False), rank_slice(Y, comm.rank, comm.size, even=False)
    unit = Unit("fit", {"w": W}, comm)
    with unit.unsharded() as p:
        r = x @ p["w"] - y
    unit.reduce_grad({"w": x.T @ r / len(x)}, weight=len(x))
    mean = unit.gather(unit.grad_shard)["w"]
    unit.zero_grad()
    unit.reduce_grad({"w": x.T @ r}, reduce="sum")
    total = unit.gather(unit.grad_shard)["w"]
    R = X @ W - Y
    # float64 sums of at most 37 terms of size O(1) in another order: a few ulps
    agree(
        comm,
        np.allclose(mean, X.T @ R / 37, rtol=0, atol=1e-13),
        f"weighted mean off by {abs(mean - X.T @ R / 37).max()}",
    )
    agree(comm, np.allclose(total, X.T @ R, rtol=0, atol=1e-12), "sum differs")
    with pytest.raises(ValueError, match="do not divide over"):
        rank_slice(X, 0, 2)  # even=True: refused, with the remedy in the message
    sizes = [len(rank_slice(X, r, comm.size, even=False)) for r in range(comm.size)]
    assert sum(sizes) == 37 and max(sizes) - min(sizes) <= 1


def test_weights_that_sum_to_zero_or_are_not_numbers_are_refused(comm):
    unit = Unit("fit", {"w": np.zeros(5)}, comm)
    with pytest.raises(ValueError, match="the weights sum to 0 over the ranks"):  # was 0 / 0: NaN gradients
        unit.reduce_grad({"w": np.ones(5)}, weight=0)
    with pytest.raises(ValueError, match=r"weight must be a finite number >= 0 \(rank 0: weight '3'"):
        unit.reduce_grad({"w": np.ones(5)}, weight="3")
    unit.zero_grad()
    unit.reduce_grad({"w": np.full(5, 2.0)}, weight=1e300)  # huge but summable: the mean of equal gradients
    agree(comm, np.array_equal(unit.gather(unit.grad_shard)["w"], np.full(5, 2.0)), "a huge weight's mean")
    unit.zero_grad()
    k = comm.rank + 1
    unit.reduce_grad({"w": np.full(5, float(k))}, weight=np.array(k))  # a 0-d count (CuPy's sum gives one)
    got = unit.gather(unit.grad_shard)["w"]
    ks = np.arange(1, comm.size + 1)
    want = (ks * ks).sum() / ks.sum()
    agree(comm, np.allclose(got, want, rtol=1e-15, atol=0), f"weighted mean {got}, want {want}")


@pytest.mark.mpi(min_size=2)
def test_a_rank_without_samples_contributes_zeros_even_where_its_gradient_is_nan(comm):
    """A rank with 0 rows passes weight=0 and a gradient of nothing, a NaN where it is a mean over no
    rows: 0 * NaN made every rank's mean NaN. Weight 0 means no part in the mean."""
    unit = Unit("fit", {"w": np.zeros(5)}, comm)
    empty = comm.rank == comm.size - 1
    unit.reduce_grad({"w": np.full(5, np.nan if empty else 3.0)}, weight=0 if empty else 2)
    got = unit.gather(unit.grad_shard)["w"]
    agree(comm, np.array_equal(got, np.full(5, 3.0)), f"mean {got}, want 3")


@pytest.mark.mpi(min_size=2)
def test_a_weight_that_one_rank_gets_wrong_is_named_on_every_rank(comm):
    """A NaN weight, or a weight on one rank and none on the others (a scalar exchange paired with a
    reduce-scatter: garbage gradients), raised on the bad rank only and left the others waiting."""
    unit = Unit("fit", {"w": np.zeros(5)}, comm)
    with pytest.raises(ValueError, match=r"weight must be a finite number >= 0 \(rank 1: weight nan\)"):
        unit.reduce_grad({"w": np.ones(5)}, weight=float("nan") if comm.rank == 1 else 1.0)
    with pytest.raises(ValueError, match=r"ranks \[0\] gave a weight and the others none"):
        unit.reduce_grad({"w": np.ones(5)}, weight=3.0 if comm.rank == 0 else None)
    # the sum overflowed to inf and every gradient became -0.0, silently; now refused on every rank
    with pytest.raises(ValueError, match="the weights sum to inf over the ranks: scale them down"):
        unit.reduce_grad({"w": np.ones(5)}, weight=1.7e308)
    unit.zero_grad()
    unit.reduce_grad({"w": np.ones(5)})  # and the unit still works
    agree(comm, np.array_equal(unit.gather(unit.grad_shard)["w"], np.ones(5)), "the unit after a refusal")


def test_unsharded_views_are_read_only_unless_written_back(comm):
    unit = Unit("u", {"w": np.arange(6.0).reshape(2, 3), "b": np.zeros(2)}, comm)
    with unit.unsharded() as p:
        with pytest.raises(ValueError, match="read-only"):
            p["w"][0, 0] = 100.0  # an edit that would be silently dropped is refused
        kept = p["w"]
    with pytest.raises(RuntimeError, match="used after its `unsharded\\(\\)` block"):
        p["w"]  # params is closed after the block
    other = Unit("other", {"w": np.full((2, 3), 9.0)}, comm)
    with other.unsharded():
        pass
    assert np.array_equal(kept, np.arange(6.0).reshape(2, 3))  # kept arrays never see another unit's data
    with unit.unsharded(writeback=True) as p:
        np.clip(p["w"], 0.0, 2.0, out=p["w"])  # e.g. a projection onto constraints
    with unit.unsharded() as p:
        assert np.array_equal(p["w"], np.clip(np.arange(6.0), 0, 2).reshape(2, 3))


@pytest.mark.mpi(min_size=2)
def test_writeback_edits_that_differ_between_ranks_are_refused_on_every_rank(comm):
    unit = Unit("u", {"w": np.zeros(8)}, comm)
    with pytest.raises(ValueError, match=r"writeback edits differ between ranks \(ranks \[1"):
        with unit.unsharded(writeback=True) as p:
            if comm.rank == 0:
                p["w"][:] = 3.0  # the others keep 0: each rank's slice was written back, a mixture
    with unit.unsharded() as p:
        agree(comm, not p["w"].any(), f"the shards took the edits: {p['w']}")

    # the agreement is exact: a difference of one ulp, a permutation and a NaN on one rank are refused
    # (a tolerance on sums let the first two through, and a NaN made every comparison False)
    def one_ulp(w):
        w[:] = 1.0 + comm.rank * np.finfo(np.float64).eps

    def permuted(w):
        w[:] = np.roll(np.arange(8.0), comm.rank)

    def nan(w):
        w[0] = np.nan if comm.rank == 1 else 0.0

    for edit in (one_ulp, permuted, nan):
        with pytest.raises(ValueError, match="differ from rank 0, bit for bit"):
            with unit.unsharded(writeback=True) as p:
                edit(p["w"])
        with unit.unsharded() as p:
            agree(comm, not p["w"].any(), f"the shards took the edits: {p['w']}")
    with unit.unsharded(writeback=True) as p:  # the same edit everywhere, NaN included: kept
        p["w"][:] = np.arange(8.0)
        p["w"][3] = np.nan
    want = np.where(np.arange(8) == 3, np.nan, np.arange(8.0))
    with unit.unsharded() as p:
        agree(comm, np.array_equal(p["w"], want, equal_nan=True), f"edit kept as {p['w']}")


def test_state_dict_of_units_is_full_host_copies(comm):
    import mpifsdp

    a = Unit("a", {"w": np.arange(6.0).reshape(2, 3)}, comm)
    b = Unit("b", {"v": np.ones(5)}, comm)
    state = mpifsdp.full_state_dict([a, b])
    with a.unsharded(), b.unsharded():  # reuse every buffer: the copies must not change
        pass
    assert np.array_equal(state["w"], np.arange(6.0).reshape(2, 3)) and np.array_equal(state["v"], np.ones(5))
    with pytest.raises(ValueError, match="tensor 'w' is in units 'a' and 'c'"):
        mpifsdp.full_state_dict([a, Unit("c", {"w": np.zeros(2)}, comm)])


def test_full_state_dict_takes_a_unit_and_names_what_it_takes(comm):
    """One name for a whole state: a Unit, a list of Units or a model."""
    import mpifsdp

    a = Unit("a", {"w": np.arange(4.0)}, comm)
    assert np.array_equal(mpifsdp.full_state_dict(a)["w"], np.arange(4.0))
    assert np.array_equal(mpifsdp.full_state_dict([a])["w"], np.arange(4.0))
    with pytest.raises(TypeError, match="takes a Module, a Unit or a list of Units, not a dict"):
        mpifsdp.full_state_dict({"w": a})


def test_the_gather_state_moves_only_along_its_table(comm):
    """shard/gather.py: sharded -> gathering -> unsharded -> sharded (or sharded -> unsharded where
    nothing is gathered); a move the table lacks raises, naming the unit, and leaves the state."""
    from mpifsdp.shard.gather import MOVES, Gathered, moved

    unit = Unit("u", {"w": np.arange(5.0)}, comm)
    seen = [unit.state]
    unit.start_unshard()
    seen.append(unit.state)
    unit.unshard()
    seen.append(unit.state)
    unit.reshard()
    seen.append(unit.state)
    assert seen == ["sharded", "gathering", "unsharded", "sharded"]
    for now in Gathered:
        for to in Gathered:
            if to in MOVES[now]:
                assert moved("u", now, to) is to
            else:
                with pytest.raises(RuntimeError, match=f"unit 'u' cannot go from {now.value} to {to.value}"):
                    moved("u", now, to)
    unit.unshard()
    with pytest.raises(RuntimeError, match="cannot go from unsharded to gathering"):
        unit._move(Gathered.GATHERING)  # a second gather over held parameters
    assert unit.state == "unsharded"
    unit.reshard()


def test_a_gather_refused_before_it_starts_leaves_the_unit_sharded(comm, monkeypatch):
    """A gather whose collective refuses to start (a check, a full device) leaves the unit sharded,
    its buffer back in the pool: the next gather runs, and a reshard is no illegal move."""
    unit = Unit("u", {"w": np.arange(5.0)}, comm)
    real = unit.comm.iall_gather

    def refuses(*args, **kwargs):
        raise ValueError("refused")

    monkeypatch.setattr(unit.comm, "iall_gather", refuses)
    with pytest.raises(ValueError, match="refused"):
        unit.start_unshard()
    assert unit.state == "sharded" and unit.full is None
    unit.reshard()
    monkeypatch.setattr(unit.comm, "iall_gather", real)
    assert np.array_equal(unit.unshard()["w"], np.arange(5.0))
    unit.reshard()
