"""StepMetrics: one JSON line per step on rank 0, with the ledgers' view of the step."""

import json

import numpy as np
import pytest

from mpifsdp import StepMetrics, fully_shard
from mpifsdp.models import GPT, GPTConfig

from support import TINY_GPT, on_rank_0, shared_dir, train_with_metrics


def test_one_line_per_step_with_memory_bytes_and_time(comm, tmp_path):
    path, returned = train_with_metrics(comm, tmp_path, 2, lr=float("nan"))
    assert all((line is None) == (comm.rank != 0) for line in returned)
    every = [json.loads(t) for t in open(path).read().splitlines()]
    lines = [m for m in every if "loss" in m]
    assert [m["step"] for m in lines] == [1, 2] and lines[1]["lr"] is None  # NaN is not JSON: null
    assert every[-1]["val_loss"] == 3.5 and every[-1]["time_s"] >= lines[1]["time_s"] > 0
    assert len(lines[1]["peak_bytes_per_rank"]) == comm.size
    assert lines[1]["peak_bytes_per_rank"][0]["param_shard"] > 0
    # What one rank moved in the step's gathers (forward) and reductions (backward): (N - 1) / N of
    # the units, so nothing at N = 1.
    assert (lines[1]["bytes_by_phase"].get("backward", 0) > 0) == (comm.size > 1)
    assert lines[1]["compute_s"] + lines[1]["exposed_comm_s"] == pytest.approx(0.5)


def test_the_second_step_records_every_ranks_memory_timeline_and_bytes_per_unit(comm, tmp_path):
    path, _ = train_with_metrics(comm, tmp_path, 3)
    every = [json.loads(t) for t in open(path).read().splitlines()]
    timelines = [m for m in every if "timeline_step" in m]
    assert [m["timeline_step"] for m in timelines] == [2]  # one step only: the second
    step2 = next(m for m in every if m.get("step") == 2 and "loss" in m)
    events = timelines[0]["memory_events"]
    assert len(events) == comm.size
    for rank, rank_events in enumerate(events):
        gathered = [b for _, category, b, _ in rank_events if category == "gathered_params"]
        times = [t for t, *_ in rank_events]
        assert times == sorted(times) and gathered[-1] == 0  # every gather was freed by the step's end
        assert max(gathered) == step2["peak_bytes_per_rank"][rank]["gathered_params"]  # the ledger's peak
    by_unit = timelines[0]["bytes_by_unit_phase"]
    for phase, nbytes in step2["bytes_by_phase"].items():
        assert sum(phases.get(phase, 0) for phases in by_unit.values()) == nbytes


def test_needs_a_sharded_model(tmp_path):
    with pytest.raises(ValueError, match="fully_shard"):
        StepMetrics(tmp_path / "m.jsonl", GPT(GPTConfig(n_layer=1, n_embd=8, n_head=2), seed=0))


def test_a_resumed_run_keeps_the_lines_of_the_steps_it_resumes_from(comm, tmp_path):
    """train_gpt --resume latest --metrics m.jsonl truncated the file: the resumed run's steps were lost."""
    path, _ = train_with_metrics(comm, tmp_path, 4)  # steps 1-4, a note for each, one timeline line
    model = GPT(TINY_GPT, seed=0)
    fully_shard(model, comm, units=model.blocks)
    before = open(path).read().splitlines() if comm.rank == 0 else []
    StepMetrics(path, model, resume_after=2)  # resumed from the checkpoint of step 2
    if comm.rank == 0:
        after = open(path).read().splitlines()
        steps = [json.loads(line).get("step", 0) for line in after]
        assert after == [line for line in before if json.loads(line).get("step", 0) <= 2] and max(steps) == 2
    StepMetrics(path, model)  # a new run starts the file afresh
    assert comm.rank != 0 or open(path).read() == ""


def test_a_torn_last_line_is_cut_on_resume_and_the_next_line_starts_whole(comm, tmp_path):
    """A crash while a line was written leaves a fragment; --resume glued the next line onto it (that
    step lost, the file no longer JSON lines) and drawing the finished run's pictures raised."""
    from mpifsdp.observe.pictures import read_run

    path, _ = train_with_metrics(comm, tmp_path, 3)
    torn = '{"step": 4, "loss": 3.1, "tok'
    on_rank_0(comm, lambda: open(path, "a").write(torn))
    if comm.rank == 0:
        assert len(read_run(path)["steps"]) == 3  # the pictures read past a torn tail
    model = GPT(TINY_GPT, seed=0)
    fully_shard(model, comm, units=model.blocks)
    metrics = StepMetrics(path, model, resume_after=3)
    metrics.start()
    x = np.zeros((2, 8), dtype=np.int64)
    model(x, x).backward()
    metrics.write(step=4, loss=1.0, seconds=0.5, tokens=16)
    if comm.rank == 0:
        lines = open(path).read().splitlines()
        assert all(isinstance(json.loads(line), dict) for line in lines) and torn not in open(path).read()
        assert [s["step"] for s in read_run(path)["steps"]] == [1, 2, 3, 4]


def test_numpy_scalars_are_numbers_and_a_bad_value_is_named_on_every_rank(comm, tmp_path):
    """StepMetrics refused NumPy scalars (checkpoint extra converts them), and failed on rank 0 only
    (the writer), leaving the others in their next collective."""
    import numpy as np

    model = GPT(TINY_GPT, seed=0)
    fully_shard(model, comm, units=model.blocks)
    path = f"{shared_dir(comm, tmp_path)}/m.jsonl"
    metrics = StepMetrics(path, model)
    metrics.start()
    line = metrics.write(step=1, loss=np.float32(2.5), seconds=1.0, tokens=8, lr=np.float64(1e-3))
    assert comm.rank != 0 or (line["loss"] == 2.5 and line["lr"] == 1e-3)
    metrics.start()
    bad = {"lr": np.ones(2)} if comm.rank == comm.size - 1 else {}
    with pytest.raises(
        ValueError, match=rf"rank {comm.size - 1}: StepMetrics.write holds a ndarray \(an array"
    ):
        metrics.write(step=2, loss=1.0, seconds=1.0, tokens=8, **bad)


def test_a_bad_resume_after_is_named_on_every_rank(comm, tmp_path):
    """resume_after="4" failed on rank 0 only (the reader), leaving the others in the next collective."""
    model = GPT(TINY_GPT, seed=0)
    fully_shard(model, comm, units=model.blocks)
    with pytest.raises(ValueError, match=r"resume_after='4' must be None or a step"):
        StepMetrics(f"{shared_dir(comm, tmp_path)}/m.jsonl", model, resume_after="4")
