"""One CUDA graph for the whole step (mpifsdp.GraphedPasses(..., optimizer=, scaler=, max_norm=)),
checked on a CPU (run under `python -m gpusim`: the stand-in captures and replays as a GPU does, and
refuses host syncs and host copies inside a capture):

- the graphed steps against eager ones (LossScaler.step with clipping, then zero_grad), the lr
  changing every step, a loss scale large enough that float16 gradients overflow (skipped steps, the
  scale halved, then grown again), a step whose loss is multiplied by inf, settings and the scale
  changed by the host mid-run: every loss, the parameters after the steps bit for bit, and the
  optimizer's and the scaler's counts and scale as a checkpoint reads them (no settle() called); the
  same at one rank with its shortcuts, one rank without them (NCCL's own collectives in the graph),
  rank 1 of a phantom 4, recomputed blocks, and without a scaler (plain clipping; nonfinite='skip');
- the host's work in a replayed step: one host sync (the last step's verdict, read before the next
  replay), and no launch but the graph's, the batch's copies and the lr's write;
- what must stop, stopped a step late with nothing updated after it: a bad device batch (named, as
  eagerly), a NaN master (its gather's cast flags it), a norm not finite under nonfinite='raise', an
  overflow at the scale's floor; a call after the stop refused;
- refused by name when built: another optimizer than AdamW, one stepping another model, a scaler
  without an optimizer, a max_norm that is not a finite number > 0; and the host's own step while
  a graph holds it;
- eagerly, a LossScaler's overflow caused by a master float16 cannot hold raises, naming the unit
  (its flag is read before the skip that would forget it).
One JSON line; exits 1 if a check fails.

    python -m gpusim tools/gpusim/standin_whole_step.py
"""

from __future__ import annotations

import json
import sys

import numpy as np

import mpifsdp
from gpusim import cupy_standin
from gpusim.standin_graphs import SMALL, _batches, _build, _passes, _raised
from mpifsdp.autodiff.tensor import Tensor

STEPS = 8


def _train(graphed: bool, scaled=True, max_norm=0.05, init_scale=2.0**19, **build):
    """(losses, shards, counts) of STEPS steps, eager or from one graph a step."""
    model, opt, scaler = _build(**build)
    scaler = mpifsdp.LossScaler(init_scale=init_scale, growth_interval=2) if scaled else None
    opt.nonfinite = "skip"
    weight = mpifsdp.array_module("cuda").ones((), dtype=np.float32)  # inf at step 4: a norm not finite
    passes = _weighted_passes(model, scaler, weight)
    whole = dict(optimizer=opt, scaler=scaler, max_norm=max_norm)
    run = mpifsdp.GraphedPasses(model, passes, **whole) if graphed else passes
    losses = []
    for step, batch in enumerate(_batches(STEPS, on_device=False)):
        opt.lr = 1e-3 * (1 + step)
        weight.fill(np.inf if step == 4 else 1.0)
        if step == 5:  # what the host changes between steps (a setting, a scale restored) takes effect
            opt.weight_decay, opt.beta2 = 0.05, 0.99
            if scaler is not None:
                scaler.load_state_dict({**scaler.state_dict(), "scale_value": 1024.0})
        loss = run(*batch)
        if not graphed:
            if scaler is not None:
                scaler.step(opt, max_norm=max_norm)
            else:
                opt.clip_grad_norm(max_norm)
                opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    units = mpifsdp.sharded_model(model).units
    summary = opt.summary()  # as a checkpoint reads them (a graph's last step read first)
    counts = [summary["step"], summary["group_steps"], opt.skipped_steps]
    if scaler is not None:
        counts += list(scaler.state_dict().values())
    return losses, [mpifsdp.to_numpy(u.shard) for u in units], counts


def _weighted_passes(model, scaler, weight):
    """passes whose loss is multiplied by `weight` (a device scalar the caller sets) for backward."""

    def passes(x, y):
        loss = model(x, y)
        weighted = loss * Tensor(weight)
        (weighted if scaler is None else scaler.scale(weighted)).backward()
        return loss

    return passes


def graphed_steps_equal_eager_ones(**build) -> dict:
    (eager_losses, eager, eager_counts), (losses, params, counts) = (
        _train(graphed, **build) for graphed in (False, True)
    )
    return {
        "losses_equal": losses == eager_losses,
        "params_equal": all(np.array_equal(a, b) for a, b in zip(params, eager)),
        "counts_equal": counts == eager_counts,
        "a_step_skipped": counts[2 if len(counts) == 3 else 5] > 0,
    }


CONFIGURATIONS = {
    "one_rank": {},
    "one_rank_without_shortcuts": dict(shortcuts=False),
    "phantom_rank_1_of_4": dict(phantom=(4, 1)),
    "recomputed_blocks": dict(recompute=True),
    "without_a_scaler_clipped": dict(scaled=False, max_norm=0.05),
}


def host_work_per_replayed_step() -> dict:
    """Host syncs and launches of steps 3..STEPS (replays), each: the verdict's one read, the graph's
    launch, the batch's two copies, the lr's write."""
    model, opt, scaler = _build()
    graphed = mpifsdp.GraphedPasses(model, _passes(model, scaler), optimizer=opt, scaler=scaler, max_norm=1.0)
    syncs, launches = [], []
    for step, batch in enumerate(_batches(STEPS, on_device=False)):
        opt.lr = 1e-3 * (1 + step)
        cupy_standin.SYNCS.clear()
        cupy_standin.LAUNCHES.clear()
        graphed(*batch)
        syncs.append(sum(cupy_standin.SYNCS.values()))
        launches.append(dict(collections_of(cupy_standin.LAUNCHES)))
    steady = launches[2:]
    return {
        "host_syncs_per_step": syncs[2:],
        "launches_per_step": steady[-1],
        "one_sync_a_step": syncs[2:] == [1] * (STEPS - 2),
        "only_the_graph_the_batch_and_the_lr": all(
            set(kinds) <= {"graph launch", "host-to-device copy"} and kinds.get("graph launch") == 1
            for kinds in steady
        ),
    }


def collections_of(counter) -> dict:
    """LAUNCHES by kind (phases merged)."""
    kinds: dict = {}
    for (_, kind), n in counter.items():
        kinds[kind] = kinds.get(kind, 0) + n
    return kinds


def _stopped_a_step_late(spoil, error, words: str, scaled=True, init_scale=256.0) -> bool:
    """spoil(model, weight, batch) spoils step 3 (weight: what the loss is multiplied by for
    backward): the call of step 4 raises `error` naming `words`, a call after that (a caller that
    caught it) is refused, and the parameters are those after step 2 (the bad step's update never
    ran, nor any after it)."""
    model, opt, _ = _build()
    scaler = mpifsdp.LossScaler(init_scale=init_scale, growth_interval=1000) if scaled else None
    weight = mpifsdp.array_module("cuda").ones((), dtype=np.float32)
    passes = _weighted_passes(model, scaler, weight)
    graphed = mpifsdp.GraphedPasses(model, passes, optimizer=opt, scaler=scaler)
    units = mpifsdp.sharded_model(model).units
    batches = _batches(5, on_device=True)
    for batch in batches[:3]:
        graphed(*batch)
    graphed.settle()
    spoil(model, weight, batches[3])
    before = [mpifsdp.to_numpy(u.shard).copy() for u in units]
    graphed(*batches[3])
    raised = _raised(lambda: graphed(*batches[4]), words, error)
    again = _raised(lambda: graphed(*batches[4]), "stopped at an earlier step")  # a caller that went on
    kept = all(np.array_equal(mpifsdp.to_numpy(u.shard), b, equal_nan=True) for u, b in zip(units, before))
    return raised and again and kept


def _token_beyond_the_vocabulary(model, weight, batch):
    batch[0][1, 3] = SMALL.vocab_size


def _infinite_weight(model, weight, batch):
    weight.fill(np.inf)


def _nan_master(model, weight, batch):
    """A NaN in a master: the gather's cast flags it (a value param_dtype cannot hold)."""
    master = mpifsdp.sharded_model(model).units[1].shard
    master[0] = np.nan


def stops() -> dict:
    return {
        "a_bad_device_batch": _stopped_a_step_late(_token_beyond_the_vocabulary, ValueError, "outside [0,"),
        "a_nan_master": _stopped_a_step_late(_nan_master, FloatingPointError, "no longer fit"),
        "a_norm_not_finite_without_a_scaler": _stopped_a_step_late(
            _infinite_weight, mpifsdp.NonFiniteError, "the graph's update did not run", scaled=False
        ),
        "an_overflow_at_the_scales_floor": _stopped_a_step_late(
            _infinite_weight, mpifsdp.NonFiniteError, "overflow at loss scale 1", init_scale=1.0
        ),
    }


def a_host_step_while_the_graph_holds_it_is_refused() -> bool:
    """opt.step() and scaler.step(opt) after the capture: refused by name (they would count a step
    the device never took)."""
    model, opt, scaler = _build()
    graphed = mpifsdp.GraphedPasses(model, _passes(model, scaler), optimizer=opt, scaler=scaler)
    for batch in _batches(3, on_device=False):
        graphed(*batch)
    words = "takes this optimizer's steps"
    return _raised(opt.step, words) and _raised(lambda: scaler.step(opt), words)


def an_eager_overflow_of_a_bad_master_is_named_not_skipped() -> bool:
    """Eagerly, through a LossScaler: a master float16 cannot hold (its gathers' cast flags it on
    the device, the loss overflows) raises at that step naming the unit, not a skip that forgets
    the flag with the step's gradients."""
    model, opt, scaler = _build()
    passes = _passes(model, scaler)
    for step, batch in enumerate(_batches(3, on_device=False)):
        if step == 2:
            mpifsdp.sharded_model(model).units[1].shard[0] = 1e6
        passes(*batch)
        try:
            scaler.step(opt)
        except FloatingPointError as exc:
            return step == 2 and "no longer fit" in str(exc) and scaler.skipped_steps == 0
        opt.zero_grad()
    return False


def refusals() -> dict:
    def refused(words: str, **whole) -> bool:
        model, opt, scaler = _build()
        whole = {"optimizer": opt, **whole}
        return _raised(lambda: mpifsdp.GraphedPasses(model, _passes(model, None), **whole), words, ValueError)

    other, _, _ = _build()
    return {
        "adam": refused("AdamW's update kernel", optimizer=mpifsdp.Adam(_build()[0])),
        "another_models_optimizer": refused("exactly the model's", optimizer=mpifsdp.AdamW(other)),
        "a_scaler_alone": refused("need optimizer=", optimizer=None, scaler=mpifsdp.LossScaler()),
        "max_norm_negative": refused("max_norm must be", max_norm=-1.0),
        "a_host_step_while_the_graph_holds_it": a_host_step_while_the_graph_holds_it_is_refused(),
    }


def main() -> int:
    result = {"check": "standin_whole_step"}
    result["graphed_steps_equal_eager_ones"] = {
        name: graphed_steps_equal_eager_ones(**build) for name, build in CONFIGURATIONS.items()
    }
    result["host_work"] = host_work_per_replayed_step()
    result["stopped_a_step_late"] = stops()
    result["refused_by_name"] = refusals()
    result["an_eager_overflow_of_a_bad_master_is_named"] = (
        an_eager_overflow_of_a_bad_master_is_named_not_skipped()
    )
    verdicts = [v for r in result["graphed_steps_equal_eager_ones"].values() for v in r.values()]
    work = result["host_work"]
    verdicts += [work["one_sync_a_step"], work["only_the_graph_the_batch_and_the_lr"]]
    verdicts += [*result["stopped_a_step_late"].values(), *result["refused_by_name"].values()]
    verdicts += [result["an_eager_overflow_of_a_bad_master_is_named"]]
    ok = all(verdicts)
    print(json.dumps({**result, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
