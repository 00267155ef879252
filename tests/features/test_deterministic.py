"""Deterministic mode: the same bits at any world size (docs/determinism.md).

make test runs this file at N = 1, 2, 3, 4; each run trains on its world Comm and compares the hash of
parameters, AdamW moments and losses with the same training on one rank (Comm over MPI.COMM_SELF,
all 12 chunks local), which every rank runs for itself: equal hashes at every N means equal bytes."""

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

from mpifsdp import AdamW, CollectiveError, Comm, Unit, full_state_dict, fully_shard, sharded_model
from mpifsdp.base import machine
from mpifsdp.checkpoint import load, save
from mpifsdp.data import rank_slice
from mpifsdp.models import GPT, GPTConfig

from support import agree, require, run_job, shared_dir
from tolerance import bound, rel_err

SAMPLES, BLOCK, VOCAB = 12, 8, 37  # a global batch of 12 sequences: 12 chunks of 1, 3 of 4


def _alone():
    return Comm(MPI.COMM_SELF, threads=None)


def _model(comm, dtype=np.float32, tie=True, dropout=0.1, frozen=False, **options):
    config = GPTConfig(VOCAB, BLOCK, n_layer=2, n_head=2, n_embd=12, dropout=dropout, tie_weights=tie)
    model = GPT(config, seed=0, dtype=dtype)
    if frozen:
        model.wpe.weight.requires_grad = False
    options = {"deterministic": True, **options}
    fully_shard(model, comm, units=model.blocks, **options)
    return model, AdamW(model, lr=1e-2, weight_decay=0.1)


def _batch(step: int, micro: int = 0, ignore: bool = True):
    rng = np.random.default_rng([step, micro])
    x = rng.integers(0, VOCAB, (SAMPLES, BLOCK))
    y = rng.integers(0, VOCAB, (SAMPLES, BLOCK))
    if ignore:
        y[0, :3] = -1  # ignored targets: the chunks weigh unequally
    return x, y


def _train(model, opt, comm, steps=3, first=0, accumulate=1, rows=None, ignore=True):
    sharded, losses = sharded_model(model), []
    for step in range(first, first + steps):
        for micro in range(accumulate):
            x, y = (a[rows] if rows is not None else a for a in _batch(step, micro, ignore))
            local = [rank_slice(a, comm.rank, comm.size) for a in (x, y)]
            if sharded.deterministic:
                sharded.set_requires_gradient_sync(micro == accumulate - 1)
                chunks = sharded.chunks(*local)
                for chunk in chunks:
                    model(*chunk).backward()
                losses.append(chunks.mean_loss())
            else:
                loss = model(*local)
                loss.backward()
                losses.append(comm.all_reduce_scalar(loss.item()) / comm.size)
        opt.clip_grad_norm(0.5)
        opt.step()
        opt.zero_grad()
    return losses


def _state(model, opt, losses) -> tuple[str, np.ndarray]:
    """(hash of parameters, moments and losses; the parameters as one float64 vector)."""
    params = full_state_dict(model)
    moments = []
    for unit in sharded_model(model).trainable_units:
        for _, shard in sorted(opt.state_of(unit).items()):
            moments += [v for _, v in sorted(unit.gather(shard).items())]
    raw = b"".join(params[k].tobytes() for k in sorted(params)) + b"".join(
        np.asarray(m).tobytes() for m in moments
    )
    digest = hashlib.sha256(raw + np.array(losses, dtype=np.float64).tobytes()).hexdigest()
    return digest, np.concatenate([params[k].ravel().astype(np.float64) for k in sorted(params)])


def _same_bits_as_one_rank(comm, train_kwargs=(), **model_kwargs):
    here = _model(comm, **model_kwargs)
    mine = _state(*here, _train(*here, comm, **dict(train_kwargs)))[0]
    alone_comm = _alone()
    alone = _model(alone_comm, **{k: v for k, v in model_kwargs.items() if k != "shard_size"})
    reference = _state(*alone, _train(*alone, alone_comm, **dict(train_kwargs)))[0]
    agree(
        comm,
        mine == reference,
        f"N={comm.size} {model_kwargs} {dict(train_kwargs)}: {mine[:12]} vs {reference[:12]}",
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_training_has_the_same_bits_at_every_world_size(comm, dtype, tie):
    _same_bits_as_one_rank(comm, dtype=dtype, tie=tie)


@pytest.mark.parametrize(
    "model_kwargs, train_kwargs",
    [
        ({"chunk_size": 4}, {}),  # 3 chunks: N = 2 and 4 do not divide them (skipped there)
        ({}, {"accumulate": 2}),  # two micro-batches, one reduction
        ({"recompute": True}, {}),  # dropout replayed per chunk in the re-run
        ({"frozen": True}, {}),
        ({"param_dtype": np.float16, "reduce_dtype": np.float32, "dropout": 0.0}, {}),
        ({"chunk_threads": 2}, {}),  # BLAS at 2 threads in every chunk, at every N
    ],
    ids=["chunks-of-4", "accumulation", "recompute", "frozen", "mixed-precision", "chunk-threads-2"],
)
def test_every_feature_keeps_the_same_bits(comm, model_kwargs, train_kwargs):
    if (SAMPLES // model_kwargs.get("chunk_size", 1)) % comm.size:
        pytest.skip(f"N={comm.size} does not divide the {SAMPLES // model_kwargs['chunk_size']} chunks")
    _same_bits_as_one_rank(comm, train_kwargs, **model_kwargs)


def test_hybrid_sharding_keeps_the_same_bits_for_every_group_shape(comm):
    for shard_size in [s for s in range(1, comm.size + 1) if comm.size % s == 0]:
        _same_bits_as_one_rank(comm, shard_size=shard_size)


def test_resuming_at_another_world_size_stays_on_the_same_bits(comm, tmp_path):
    """N ranks train 2 steps and save; one rank loads and trains a third: the bits of 3 steps on one,
    dropout included (each Dropout's position in its masks travels in the checkpoint)."""
    root = shared_dir(comm, tmp_path)
    model, opt = _model(comm)
    _train(model, opt, comm, steps=2)
    save(f"{root}/ck", model, opt)
    alone_comm = _alone()
    resumed = _model(alone_comm)
    if comm.rank == 0:  # one rank's job now; the file is complete on disk (save returned everywhere)
        load(f"{root}/ck", *resumed)
        _train(*resumed, alone_comm, steps=1, first=2)
        straight = _model(alone_comm)
        _train(*straight, alone_comm, steps=3)
        resumed_state, straight_state = (_state(*m, [])[0] for m in (resumed, straight))
    agree(comm, comm.rank != 0 or resumed_state == straight_state, "resumed run left the trajectory")


RESUMED_STAGE = """
import sys
sys.path[:0] = [{tests!r}, {here!r}]
import test_deterministic as td
from mpifsdp import Comm
from mpifsdp.checkpoint import load, save
first, steps, source, target = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
comm = Comm()
model, opt = td._model(comm)
if source != "-":
    load(source, model, opt)
td._train(model, opt, comm, steps=steps, first=first)
if target != "-":
    save(target, model, opt)
digest = td._state(model, opt, [])[0]
if comm.rank == 0:
    print("state", digest)
"""


def test_a_run_resumed_on_4_then_3_then_1_ranks_has_the_bits_of_one_straight_run(comm, tmp_path):
    """Three jobs in turn, each resuming the last one's checkpoint: 2 steps on 4 ranks, 1 on 3, 1 on
    1 (dropout on): the parameters and moments of 4 steps on one rank, bit for bit."""
    if comm.size > 1:
        pytest.skip("starts its own jobs: the plain-pytest pass runs it")
    here = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "stage.py"
    script.write_text(RESUMED_STAGE.format(tests=os.path.dirname(here), here=here))
    stages = [(4, 0, 2, "-", tmp_path / "after-2"), (3, 2, 1, tmp_path / "after-2", tmp_path / "after-3")]
    stages.append((1, 3, 1, tmp_path / "after-3", "-"))
    for ranks, first, steps, source, target in stages:
        result, _ = run_job(script, ranks, first, steps, source, target, timeout=240)
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    resumed = result.stdout.split("state ")[-1].strip()
    straight = _model(_alone())
    _train(*straight, _alone(), steps=4)
    assert resumed == _state(*straight, [])[0]


def _normal_in_micro_batches(comm, rows=1):
    """The normal mode with each rank's batch in micro-batches of `rows` sequences (no_sync, each
    loss weighing 1/k): its sums are grouped as deterministic mode's, in floats."""
    model, opt = _model(comm, dtype=np.float64, dropout=0.0, deterministic=False)
    sharded = sharded_model(model)
    for step in range(3):
        x, y = (rank_slice(a, comm.rank, comm.size) for a in _batch(step, ignore=False))
        k = len(x) // rows
        for j in range(k):
            sharded.set_requires_gradient_sync(j == k - 1)
            (model(x[j * rows : (j + 1) * rows], y[j * rows : (j + 1) * rows]) / k).backward()
        opt.clip_grad_norm(0.5)
        opt.step()
        opt.zero_grad()
    return _state(model, opt, [])[1]


def test_the_result_is_the_normal_modes_within_the_parity_bound(comm):
    """The same mathematics as the normal mode, within its parity bound (tests/tolerance.py). The
    probes: the normal mode with the batch's rows reversed, and in micro-batches of one sequence
    (deterministic mode groups its sums that way; the float sum of the groups is what it makes exact)."""
    runs = {}
    for name, deterministic, rows in [
        ("normal", False, None),
        ("reversed", False, slice(None, None, -1)),
        ("exact", True, None),
    ]:
        model, opt = _model(comm, dtype=np.float64, dropout=0.0, deterministic=deterministic)
        _train(model, opt, comm, rows=rows, ignore=False)
        runs[name] = _state(model, opt, [])[1]
    runs["micro"] = _normal_in_micro_batches(comm)
    probe = max(rel_err(runs[name], runs["normal"]) for name in ("reversed", "micro"))
    error = rel_err(runs["exact"], runs["normal"])
    agree(comm, error <= bound(probe, np.float64), f"{error:.2e} > bound {bound(probe, np.float64):.2e}")


def test_a_unit_users_chunks_have_the_same_bits_at_every_world_size(comm):
    """Uneven chunks weighted by their rows, without our autodiff: hand-written gradients of a least
    squares fit, each chunk added with add_chunk_grad and reduced exactly."""
    rng = np.random.default_rng(0)
    rows = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]  # 12 chunks of uneven sizes
    data = [(rng.standard_normal((r, 5)), rng.standard_normal(r)) for r in rows]

    def fitted(c):
        unit = Unit("fit", {"w": np.zeros(5)}, c, deterministic=True)
        opt = AdamW([unit], lr=0.1)
        per = len(data) // c.size
        for _ in range(3):
            with unit.unsharded() as p:
                for a, b in data[c.rank * per : (c.rank + 1) * per]:
                    grad = a.T @ (a @ p["w"] - b) / len(b)  # the chunk's mean, weighed by its rows
                    unit.add_chunk_grad({"w": grad}, weight=len(b))
            unit.reduce_chunk_grads()
            opt.clip_grad_norm(1.0)
            opt.step()
            opt.zero_grad()
        return unit.gather(unit.shard)["w"].tobytes()

    agree(comm, fitted(comm) == fitted(_alone()), "the Unit path's bits differ from one rank's")


def test_misuse_is_named(comm):
    model, _ = _model(comm)
    x, y = (rank_slice(a, comm.rank, comm.size) for a in _batch(0))
    with pytest.raises(RuntimeError, match="deterministic mode trains chunk by chunk"):
        model(x, y)
    with pytest.raises(ValueError, match="must be one batch size, a multiple of chunk_size=5"):
        sharded_model(_model(comm, chunk_size=5)[0]).chunks(x, y)
    plain, _ = _model(comm, deterministic=False)
    with pytest.raises(RuntimeError, match="chunks\\(\\) is the deterministic mode's"):
        sharded_model(plain).chunks(x, y)
    with pytest.raises(ValueError, match="a chunk's weight is an integer >= 0"):
        Unit("u", {"w": np.zeros(3)}, comm).add_chunk_grad({"w": np.zeros(3)}, weight=0.5)
    with pytest.raises(ValueError, match="chunk_threads must be an integer >= 1"):
        _model(comm, chunk_threads=0)
    with pytest.raises(ValueError, match="chunk_threads=2 is deterministic mode's"):
        _model(comm, deterministic=False, chunk_threads=2)
    with pytest.raises(ValueError, match="deterministic=True with chunk_size=None: give the samples per"):
        _model(comm, chunk_size=None)  # it ran the normal mode, silently
    if comm.size > 1:  # each rank's chunks would round as its own settings do: refused on every rank
        for option in ("chunk_threads", "chunk_size"):
            said = f"fully_shard's {option} differs between ranks: {{0: 1, 1: 2"
            with pytest.raises(CollectiveError, match=said):
                _model(comm, **{option: 1 + comm.rank % 2})


def test_a_chunk_loop_left_halfway_is_refused_by_the_step_not_added_to_the_next(comm):
    """A chunks() loop abandoned after its first chunk (an exception caught outside it) left that
    chunk's sums pending: step() only warned, and the next step silently included them."""
    model, opt = _model(comm)
    for chunk in sharded_model(model).chunks(*(rank_slice(a, comm.rank, comm.size) for a in _batch(0))):
        model(*chunk).backward()
        break
    with pytest.raises(RuntimeError, match=r"holds the gradients of 1 chunk\(s\) never reduced"):
        opt.step()
    opt.zero_grad()  # dropped
    before = full_state_dict(model)
    opt.step()  # nothing pending, nothing to step
    after = full_state_dict(model)
    assert all(np.array_equal(before[k], after[k]) for k in before)


THREADS = """
import hashlib, numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_info
from mpifsdp import AdamW, Comm, full_state_dict, fully_shard, set_threads, sharded_model
from mpifsdp.models import GPT, GPTConfig
digests, pinned = {}, set()
for chunk_threads in (1, 2):
    for threads in (1, 2):
        set_threads(threads)
        comm = Comm(MPI.COMM_SELF, threads=None)
        model = GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=1, n_head=4, n_embd=256), seed=0)
        options = dict(deterministic=True, chunk_size=8, chunk_threads=chunk_threads)
        fully_shard(model, comm, units=model.blocks, **options)
        opt = AdamW(model, lr=1e-3)
        x = np.random.default_rng(0).integers(0, 256, (2, 16, 256))  # 2 chunks of 8 x 256 rows of 256
        for chunk in sharded_model(model).chunks(x[0], x[1]):
            blas = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
            pinned.add((chunk_threads, tuple(blas)))
            model(*chunk).backward()
        opt.step()
        state = full_state_dict(model)
        raw = b"".join(state[k].tobytes() for k in sorted(state))
        digests.setdefault(chunk_threads, set()).add(hashlib.sha256(raw).hexdigest())
same = all(len(d) == 1 for d in digests.values())
print("same" if same and pinned == {(1, (1,)), (2, (2,))} else f"differ {pinned} {digests}")
"""


@pytest.mark.parametrize("kernel", machine.OTHER_KERNELS)
def test_blas_threads_do_not_change_the_bits(comm, tmp_path, kernel):
    """OpenBLAS's Haswell kernel (and Zen's) computes these GEMMs with other bits at 2 threads than
    at 1 (measured): chunks pin BLAS to chunk_threads (1 or 2 here), so a rank's own thread count
    (the world size's split of the cores) does not show, under each kernel bench/parity_kernels.py
    runs.
    A chunk's LayerNorms (2**19 elements) split their rows across the elementwise threads too, and
    sum their weight and bias gradients by fixed groups of rows (fused.sum_group)."""
    if comm.size > 1:
        pytest.skip("one single-process job: the plain-pytest pass covers it")
    require(machine.blas_threads_problem() or machine.openblas_kernel_problem(kernel))
    script = tmp_path / "threads.py"
    script.write_text(THREADS)
    launcher = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_")  # a job of its own, under mpiexec too
    threads = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher) and k not in threads}
    env["OPENBLAS_CORETYPE"] = kernel
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "same", done.stdout + done.stderr[-2000:]


def test_disk_offload_keeps_the_same_bits_at_every_world_size(comm, tmp_path):
    """offload="disk" (the moments in files, a unit at a time in memory) at N ranks: the bits of one
    rank training in memory."""
    (tmp_path / "here").mkdir()
    here = _model(comm, offload="disk", offload_dir=tmp_path / "here")
    assert here[1].on_disk is not None  # the moments are in files
    mine = _state(*here, _train(*here, comm))[0]
    alone_comm = _alone()
    alone = _model(alone_comm)
    reference = _state(*alone, _train(*alone, alone_comm))[0]
    agree(comm, mine == reference, f"N={comm.size} with disk offload: {mine[:12]} vs {reference[:12]}")
