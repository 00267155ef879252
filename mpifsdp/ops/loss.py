"""The loss, and the one collective a forward issues besides the gathers.

`cross_entropy` divides by the number of valid targets. Under fully_shard that number is the global
batch's: ShardedModel.run_model installs `mean_over_ranks(count_share)` around the model's forward,
and count_share runs one small allgather of every rank's valid count (docs/design.md, invariant 3).
Outside fully_shard the count is the local one.
"""

from __future__ import annotations

import contextlib
import contextvars

import numpy as np

from ..autodiff.tensor import Tensor, apply, as_tensor, fusion
from ..base.backend import array_module_of


def cross_entropy(logits, targets, ignore_index=-1) -> Tensor:
    """Mean over the targets that are not `ignore_index` of -log softmax(logits)[target], in at least
    float32 (float16 logits are widened, or read as they are by the GPU's kernel).

    Under fully_shard the mean is the global batch's: each rank divides its sum by the valid count
    summed over ranks / N (see `mean_over_ranks`), so ranks holding different numbers of valid targets
    still average to the single-process loss and gradient."""
    targets = targets.data if isinstance(targets, Tensor) else targets
    logits = as_tensor(logits)
    wide = np.promote_types(logits.dtype, np.float32)
    if logits.dtype != wide and not _read_as_they_are(logits.data, targets):
        logits = logits.astype(wide)  # float16 logits: the loss in float32
    share = _count_share.get()
    count = None if share is None else share(_valid_count(targets, ignore_index))
    return apply("cross_entropy", logits, targets=targets, ignore_index=ignore_index, count=count)


def _valid_count(targets, ignore_index: int):
    """How many targets are not ignore_index: an int for host targets, a device scalar for device
    ones (no host sync in the forward; fsdp's count_share sums it on the device where it can)."""
    count = (targets != ignore_index).sum()
    return int(count) if array_module_of(targets) is np else count


def _read_as_they_are(logits, targets) -> bool:
    """Whether the device's cross-entropy takes these 16-bit logits directly (a GPU's kernel computes
    in float32: a float32 copy of the step's largest array is not needed)."""
    reads = fusion("cross_entropy", "16-bit logits", logits)
    return reads is not None and reads(logits, targets)


_count_share = contextvars.ContextVar("count_share", default=None)


@contextlib.contextmanager
def mean_over_ranks(count_share):
    """Inside, mean-reducing losses divide by `count_share(local count)` instead of the local count.

    [Note: gradient averaging] (docs/design.md, invariant 3) The runtime averages the ranks' gradients
    with equal weights (reduce-scatter, then 1/N). That is the global batch's mean only if each rank's
    loss is its sum divided by (global count / N); fully_shard's root forward installs a
    `count_share` that returns exactly that (one small allgather of the counts)."""
    token = _count_share.set(count_share)
    try:
        yield
    finally:
        _count_share.reset(token)
