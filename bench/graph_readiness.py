"""What a CUDA graph of the GPU step would freeze, found on a CPU (CuPy stood in by
tools/gpusim/cupy_standin.py). Two steady steps of bench/gpu_budget.py's step are recorded launch by
launch, each with what it takes from the host by value (its scalars, the bytes a host-to-device copy
reads); the lr changes every step (a schedule), the loss scale doubles every good step, and the
batch (its count of valid targets too) is another, as in training. A graph replays its captured
launches with the captured values, so:

- the two steps must launch the same sequence (else no one graph fits every step);
- a launch whose host values differ between the steps would replay stale ones: a per-step value a
  graph needs in device memory instead (the lr, bias corrections, the loss scale, ...);
- a host-to-device copy reads pageable host memory here, which a capture refuses;
- a host sync inside the step cannot be captured at all.

The step's verdict is read on the host (one sync, in the optimizer's step), so the part a graph
could take today is the forward and backward: `forward_backward_capturable` says whether it takes
no per-step value and syncs nothing, its host copies being the batch's (a graph's static inputs,
written before each replay). The optimizer's few launches stay eager.

One JSON line (each entry "phase kind at module:function": launches):

    python bench/graph_readiness.py
    {"launches": ..., "same_sequence": ..., "host_syncs_in_step": ..., "per_step_values": {...},
     "host_to_device_copies": {...}, "capturable": false, "forward_backward_capturable": ...}
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import gpusim  # noqa: E402
import numpy as np
from gpusim import cupy_standin  # noqa: E402

gpusim.install()
sys.path.insert(0, str(Path(__file__).parent))  # bench/gpu_budget.py, when imported from elsewhere
import gpu_budget  # noqa: E402

# where the batch (token ids, positions; targets with their valid count) is copied from the host: a
# graph's static inputs
BATCH_COPIES = ("cuda/fused.py:_embedding", "cuda/cross_entropy.py:targets_with_count")


def _batch_copy(launch) -> bool:
    phase, kind, _, where = launch
    return kind == "host-to-device copy" and where in BATCH_COPIES


def recorded_step(model, opt, scaler, x, y) -> list:
    """The step's launches as (phase, kind, host values, where), its syncs counted afresh."""
    cupy_standin.RECORD, cupy_standin.SYNCS = [], collections.Counter()
    gpu_budget.step(model, opt, scaler, x, y)
    record, cupy_standin.RECORD = cupy_standin.RECORD, None
    return record


def _named(entries) -> dict:
    return dict(collections.Counter(f"{phase} {kind} at {where}" for phase, kind, _, where in entries))


def main():
    model, opt, scaler, x, y = gpu_budget.steady_step(growth_interval=1)
    other_x, other_y = (np.random.default_rng(1).permutation(a.reshape(-1)).reshape(a.shape) for a in (x, y))
    other_y[0, :5] = -1  # ignored targets: another count of valid ones
    steps = []
    for lr, batch in ((1e-4, (x, y)), (2e-4, (other_x, other_y))):
        opt.lr = lr
        steps.append(recorded_step(model, opt, scaler, *batch))
    in_step = sum(n for (phase, _), n in cupy_standin.SYNCS.items() if phase != "logging")
    first, second = steps
    same = [(a[0], a[1], a[3]) for a in first] == [(b[0], b[1], b[3]) for b in second]
    changed = [a for a, b in zip(first, second) if a[2] != b[2] and not _batch_copy(a)] if same else []
    copies = [a for a in first if a[1] == "host-to-device copy"]
    passes = ("forward", "backward")
    synced = sum(n for (phase, _), n in cupy_standin.SYNCS.items() if phase in passes)
    batch_only = all(_batch_copy(a) for a in copies if a[0] in passes)
    print(json.dumps({
        "bench": "graph_readiness", "launches": len(first), "same_sequence": same,
        "host_syncs_in_step": in_step, "per_step_values": _named(changed),
        "host_to_device_copies": _named(copies),
        "capturable": same and not changed and not copies and in_step == 0,
        "forward_backward_capturable": same and synced == 0 and batch_only
        and not any(phase in passes for phase, *_ in changed),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
