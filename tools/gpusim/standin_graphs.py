"""CUDA graphs of a sharded model's forward and backward (mpifsdp.GraphedPasses), checked on a CPU
(run under `python -m gpusim`: tools/gpusim/cupy_standin.py captures and replays as a GPU does, and
refuses what a capture refuses: host syncs, host copies, collectives a capture does not reach):

- replayed steps against eager ones, float16 gathers, an lr changing every step, 5 batches: host
  arrays through a LossScaler whose scale doubles every step, with an eager evaluation between
  steps; device arrays, their gradients read after Comm.settle (which waits for the replay), AdamW's
  plain step, a write into every shard between steps (the next replay must gather it): every loss
  (and gradient sum) and the parameters after the steps, bit for bit;
- the same in other configurations: checkpointed blocks, units kept gathered for backward, prefetch
  0 and 2, bfloat16 gathers, an untied GPT without biases;
- the ledger counts each replay's gathers and reduce-scatters (the eager run's, plus the one
  reference pass the capture runs);
- a bad device batch replayed is named at the step's verdict, and the next good one steps: by the
  model's check_inputs (captured in the graph), or by the embedding's own check in the graph where
  the model's sees nothing;
- passes that take a host number changing at every call fail the capture's self-check;
- passes that read the device from the host fail the capture by name, and leave no graph;
- a replay without zero_grad, or inside no_sync, or of a batch of another shape, refused by name;
- dropout, MPI transports, deterministic mode: refused by name when built; float32 attention (batched
  GEMMs through CuPy's matmul, which CuPy cannot capture) by name at the capture;
- the host's work per step with and without the graph (and with the whole step in one graph), 24
  narrow layers: launches the host issues and its time (wall time less the stand-in's NumPy work,
  which a GPU would do).
Without cuDNN (--no-cudnn) attention runs batched GEMMs through CuPy's matmul, which CuPy cannot
capture: then only that refusal is checked. One JSON line; exits 1 if a check fails.

    python -m gpusim tools/gpusim/standin_graphs.py
    python -m gpusim --no-cudnn tools/gpusim/standin_graphs.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

import mpifsdp
from gpusim import cupy_standin
from mpifsdp.base.checks import bfloat16
from mpifsdp.models import GPT, GPTConfig

SMALL = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
STEPS = 5


def _build(config=SMALL, transport="nccl", model_class=GPT, phantom=None, shortcuts=None, **shard):
    """phantom=(N, k): rank k of N stood in for (PhantomComm); shortcuts=False: one rank's
    gathers and reductions run (Comm's one_rank_shortcuts)."""
    if phantom is not None:
        comm = mpifsdp.PhantomComm(*phantom, device="cuda", threads=None)
    else:
        comm = mpifsdp.Comm(device="cuda", transport=transport, threads=None, one_rank_shortcuts=shortcuts)
    model = model_class(config, seed=0, device=comm.device)
    shard = {"param_dtype": np.float16, "reduce_dtype": np.float32, **shard}
    mpifsdp.fully_shard(model, comm, units=model.blocks, **shard)
    return model, mpifsdp.AdamW(model, lr=1e-3), mpifsdp.LossScaler(init_scale=256.0, growth_interval=1)


def _passes(model, scaler):
    def passes(x, y):
        loss = model(x, y)
        (loss if scaler is None else scaler.scale(loss)).backward()
        return loss

    return passes


def _batches(n: int, on_device: bool, config=SMALL) -> list:
    rng = np.random.default_rng(1)
    xp = mpifsdp.array_module("cuda") if on_device else np
    shape = (2, config.block_size)
    return [tuple(xp.asarray(rng.integers(0, config.vocab_size, shape)) for _ in range(2)) for _ in range(n)]


def _evaluate(model, units, step: int) -> list:
    """An eager forward under no_grad between steps: its loss."""
    with mpifsdp.no_grad():
        return [model(*_batches(1, on_device=False)[0]).item()]


def _edit_shards(model, units, step: int) -> list:
    """A write into every shard between steps (a user's weight clamp), from the second step on: the
    capture saw the cast the optimizer wrote, and the replays must gather the shard as written."""
    for unit in units if step else ():
        unit.shard[:1] = 0.25 * step
    return []


def _train(graphed: bool, on_device: bool, scaled: bool, between, **build) -> tuple[list, list, tuple]:
    """(losses, parameter shards after the steps, (the ledgers' gathers, reduce-scatters and
    all-reduces in backward, the schedule checks in forward)) of STEPS steps; scaled: through the LossScaler,
    clipped (else the gradients read first, after Comm.settle, and AdamW's plain step);
    between(model, units, step) after every step; build: _build's arguments."""
    model, opt, scaler = _build(**build)
    scaler = scaler if scaled else None
    run = _passes(model, scaler)
    if graphed:
        run = mpifsdp.GraphedPasses(model, run)
    units = mpifsdp.sharded_model(model).units
    losses = []
    for step, batch in enumerate(_batches(STEPS, on_device)):
        opt.lr = 1e-3 * (1 + step)
        loss = run(*batch)
        if not scaled:  # as code that reads the gradients itself does first: the replay's work is waited for
            mpifsdp.sharded_model(model).comm.settle()
            losses.append(sum(float(abs(mpifsdp.to_numpy(u.flat_grad())).sum()) for u in units))
        scaler.step(opt, max_norm=1.0) if scaled else opt.step()
        opt.zero_grad()
        losses.append(loss.item())  # read after the step (a read before settles the step's collectives)
        losses += between(model, units, step)
    params = [mpifsdp.to_numpy(unit.shard) for unit in units]
    levels = mpifsdp.sharded_model(model).levels()  # the world, and HSDP's two levels
    ops = ("all_gather", "reduce_scatter", "all_reduce")
    calls = sum(level.ledger.total("calls", op=op, phase="backward") for level in levels for op in ops)
    return losses, params, (calls, levels[0].ledger.total("calls", op="schedule_check", phase="forward"))


def replays_equal_eager_steps(on_device: bool, scaled: bool, between, **build) -> dict:
    """Every loss and the parameters after the steps, bit for bit; the ledger counts each replay's
    collectives (the eager steps', and the capture's one reference pass) and the schedule check
    before each replay (the one exchange that keeps the ranks in step: the rest is in the graph)."""
    (eager_losses, eager, (eager_calls, _)), (losses, params, (calls, checks)) = (
        _train(graphed, on_device, scaled, between, **build) for graphed in (False, True)
    )
    return {
        "losses_equal": losses == eager_losses,
        "params_equal": all(np.array_equal(a, b) for a, b in zip(params, eager)),
        "collectives_counted": calls == eager_calls + eager_calls // STEPS,
        "ranks_compared_before_each_replay": checks == STEPS - 2,
    }


class _Unchecked(GPT):
    """A GPT whose own input check sees nothing: only the checks inside its passes remain."""

    def check_inputs(self, idx, targets=None):
        return None


def a_bad_device_batch_replayed_is_named(model_checks: bool) -> bool:
    """A token id beyond the vocabulary in a replayed device batch: named at the step's verdict, and
    the next good batch steps. model_checks: by the model's check_inputs, else by the embedding's
    own check: both captured in the graph, their flags deferred again by each replay."""
    model, opt, scaler = _build(model_class=GPT if model_checks else _Unchecked)
    graphed = mpifsdp.GraphedPasses(model, _passes(model, scaler))
    outcomes, words = (
        [],
        f"outside [0, {SMALL.vocab_size})" if model_checks else "embedding index out of range",
    )
    for step, (x, y) in enumerate(_batches(4, on_device=True)):
        if step == 2:
            x[1, 3] = SMALL.vocab_size
        graphed(x, y)
        try:
            scaler.step(opt)
            outcomes.append("stepped")
        except (ValueError, IndexError) as exc:
            outcomes.append("named" if words in str(exc) else str(exc))
        opt.zero_grad()
    return outcomes == ["stepped", "stepped", "named", "stepped"]


def graphed_after_capture(batches: int):
    """(model, opt, scaler, GraphedPasses, batches): its first two steps taken (eager, captured)."""
    model, opt, scaler = _build()
    graphed = mpifsdp.GraphedPasses(model, _passes(model, scaler))
    batches = _batches(batches, on_device=False)
    for batch in batches[:2]:
        graphed(*batch)
        scaler.step(opt)
        opt.zero_grad()
    return model, opt, scaler, graphed, batches


def _no_steps_between(model, units, step) -> list:
    return []


# sharding and model options the replays must follow too (each against its own eager steps)
CONFIGURATIONS = {
    "checkpointed_blocks": dict(recompute=True),
    "kept_gathered_for_backward": dict(reshard_after_forward=False),
    "prefetch_0": dict(prefetch=0),
    "prefetch_2": dict(prefetch=2),
    "bfloat16_gathers": dict(param_dtype=bfloat16()),
    # one rank reduces a float32 gradient with no collective (it is the gradient shard): a float16
    # reduction keeps reduce-scatters in the graph for the ledger to count
    "float16_reduce": dict(reduce_dtype=np.float16),
    # N's gathers and reduce-scatters, as a phantom rank's copies on its own stream, in the graph
    "phantom_rank_1_of_4": dict(phantom=(4, 1)),
    # one rank's own gathers and reductions (no shortcuts): NCCL's collectives in the graph again
    "one_rank_without_shortcuts": dict(shortcuts=False),
    "untied_without_biases": dict(
        config=GPTConfig(**{**SMALL.__dict__, "tie_weights": False, "bias": False})
    ),
}


def replays_equal_eager_steps_in_every_configuration() -> dict:
    return {
        name: all(replays_equal_eager_steps(False, True, _no_steps_between, **build).values())
        for name, build in CONFIGURATIONS.items()
    }


def a_replay_without_zero_grad_is_refused() -> bool:
    """A step that forgot zero_grad: the replay (whose backward writes gradients, never adds) names it."""
    _, opt, scaler, graphed, batches = graphed_after_capture(4)
    graphed(*batches[2])
    scaler.step(opt)  # zero_grad forgotten
    return _raised(lambda: graphed(*batches[3]), "zero_grad()")


def a_batch_of_another_shape_is_refused() -> bool:
    """A last, shorter batch: refused by name, before any collective (a graph's shapes are fixed)."""
    _, _, _, graphed, batches = graphed_after_capture(2)
    x, y = batches[0]
    return _raised(lambda: graphed(x[:1], y[:1]), "a graph's shapes are fixed", ValueError)


def a_replay_inside_no_sync_is_refused() -> bool:
    """A replay inside no_sync() (whose backward would keep its gradients unreduced) names it."""
    model, _, _, graphed, batches = graphed_after_capture(3)
    with mpifsdp.no_sync(model):
        return _raised(lambda: graphed(*batches[2]), "no_sync()")


def _raised(call, words: str, error=RuntimeError) -> bool:
    """Whether call() raises `error` with `words` in its message."""
    try:
        call()
    except error as exc:
        return words in str(exc)
    return False


def a_value_frozen_differently_fails_the_self_check() -> bool:
    """passes that raise the loss to a host number changing at every call (a kernel's argument: a
    graph freezes it): the capture's reference pass and its replay differ, and the second call
    raises, naming the check."""
    model, opt, scaler = _build()
    calls = []

    def passes(x, y):
        calls.append(None)
        loss = model(x, y)
        (loss ** float(len(calls))).backward()
        return loss

    graphed = mpifsdp.GraphedPasses(model, passes)
    batches = _batches(2, on_device=False)
    graphed(*batches[0])
    opt.step()
    opt.zero_grad()
    return _raised(lambda: graphed(*batches[1]), "CUDA graph self-check")


def a_host_read_inside_the_passes_fails_the_capture_by_name() -> bool:
    """passes that read the loss on the host (a sync a capture refuses): the second call raises,
    saying what a graph cannot hold, and leaves no graph: the third raises the same."""
    model, opt, scaler = _build()

    def passes(x, y):
        loss = model(x, y)
        loss.backward()
        return loss.item()

    graphed, messages = mpifsdp.GraphedPasses(model, passes), []
    for batch in _batches(3, on_device=False):
        try:
            graphed(*batch)
        except RuntimeError as exc:
            messages.append(str(exc))
        opt.zero_grad()
    return len(messages) == 2 and all("raised while captured" in m and ".item()" in m for m in messages)


def batched_attention_is_refused_at_capture(**shard) -> bool:
    """Attention that cuDNN's fused kernel does not take (float32, or no cuDNN) runs batched GEMMs
    through CuPy's matmul, which CuPy refuses while a stream captures: the capture names it and says
    what to do."""
    model, opt, scaler = _build(**shard)
    graphed = mpifsdp.GraphedPasses(model, _passes(model, scaler))
    batches = _batches(2, on_device=False)
    graphed(*batches[0])
    scaler.step(opt)
    opt.zero_grad()
    return _raised(lambda: graphed(*batches[1]), "CuPy's matmul cannot be captured")


def refusals() -> dict:
    def refused(build, words: str) -> bool:
        def graph():
            model, _, scaler = build()
            mpifsdp.GraphedPasses(model, _passes(model, scaler))

        return _raised(graph, words, ValueError)

    dropout = GPTConfig(**{**SMALL.__dict__, "dropout": 0.1})
    return {
        "a_replay_without_zero_grad": a_replay_without_zero_grad_is_refused(),
        "a_replay_inside_no_sync": a_replay_inside_no_sync_is_refused(),
        "a_batch_of_another_shape": a_batch_of_another_shape_is_refused(),
        "dropout": refused(lambda: _build(dropout), "dropout"),
        "host_staged_mpi": refused(lambda: _build(transport="host"), "'host'"),
        "deterministic_mode": refused(lambda: _build(deterministic=True), "deterministic mode"),
        "float32_batched_attention_at_capture": batched_attention_is_refused_at_capture(
            param_dtype=None, reduce_dtype=None
        ),
    }


def host_work(how: str, layers: int = 24) -> dict:
    """Launches the host issues in one steady step and its Python time (median of 5), eager,
    replayed ("graphed": the passes from a graph, the optimizer's step eager) or from one graph of
    the whole step ("whole_step"), for a narrow model of `layers` layers with the 370M model's
    structure."""
    config = GPTConfig(vocab_size=2048, block_size=64, n_layer=layers, n_head=16, n_embd=64)
    model, opt, scaler = _build(config)
    run = _passes(model, scaler)
    whole = dict(optimizer=opt, scaler=scaler, max_norm=1.0) if how == "whole_step" else {}
    run = run if how == "eager" else mpifsdp.GraphedPasses(model, run, **whole)
    batch, host_s = _batches(1, on_device=False, config=config)[0], []
    for _ in range(3 + 5):
        cupy_standin.LAUNCHES.clear()
        cupy_standin.DEVICE_S[0], start = 0.0, time.perf_counter()
        run(*batch)
        if not whole:
            scaler.step(opt, max_norm=1.0)
            opt.zero_grad()
        host_s.append(time.perf_counter() - start - cupy_standin.DEVICE_S[0])
    return {
        "launches": sum(cupy_standin.LAUNCHES.values()),
        "host_ms": round(1000 * statistics.median(host_s[3:]), 1),
    }


def main() -> int:
    if "cudnn" not in sys.modules:  # a GPU without cuDNN: attention runs CuPy's batched matmul
        refused = batched_attention_is_refused_at_capture()
        print(
            json.dumps(
                {"check": "standin_graphs", "cudnn": False, "refused_at_capture": refused, "ok": refused}
            )
        )
        return 0 if refused else 1
    result = {"check": "standin_graphs", "cudnn": True}
    result["replays_equal_eager_steps_host_batches_scaled_with_evaluations"] = replays_equal_eager_steps(
        False, True, _evaluate
    )
    result["replays_equal_eager_steps_device_batches_plain_with_shard_writes"] = replays_equal_eager_steps(
        True, False, _edit_shards
    )
    result["replays_equal_eager_steps_in"] = replays_equal_eager_steps_in_every_configuration()
    for model_checks, by in ((True, "the_models_check"), (False, "the_graphs_own_check")):
        result[f"a_bad_device_batch_replayed_is_named_by_{by}"] = a_bad_device_batch_replayed_is_named(
            model_checks
        )
    result["a_value_frozen_differently_fails_the_self_check"] = (
        a_value_frozen_differently_fails_the_self_check()
    )
    result["a_host_read_inside_the_passes_fails_the_capture_by_name"] = (
        a_host_read_inside_the_passes_fails_the_capture_by_name()
    )
    result["refused_by_name"] = refusals()
    verdicts = [v for v in result.values() if isinstance(v, bool)]
    verdicts += [v for r in result.values() if isinstance(r, dict) for v in r.values()]
    result["host_work_per_step"] = {how: host_work(how) for how in ("eager", "graphed", "whole_step")}
    ok = all(verdicts)
    print(json.dumps({**result, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
