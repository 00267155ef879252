"""The loss, and the one collective a forward issues besides the gathers.

`cross_entropy` divides by the number of valid targets. Under fully_shard that number is the global
batch's: ShardedModel.run_model installs `mean_over_ranks(count_share)` around the model's forward,
and count_share runs one small allgather of every rank's valid count (docs/design.md, invariant 3).
Outside fully_shard the count is the local one.
"""

from __future__ import annotations

import contextlib
import contextvars

from ..autodiff.tensor import Tensor, apply


def cross_entropy(logits, targets, ignore_index=-1) -> Tensor:
    """Mean over the targets that are not `ignore_index` of -log softmax(logits)[target].

    Under fully_shard the mean is the global batch's: each rank divides its sum by the valid count
    summed over ranks / N (see `mean_over_ranks`), so ranks holding different numbers of valid targets
    still average to the single-process loss and gradient."""
    targets = targets.data if isinstance(targets, Tensor) else targets
    share = _count_share.get()
    count = None if share is None else share(int((targets != ignore_index).sum()))
    return apply("cross_entropy", logits, targets=targets, ignore_index=ignore_index, count=count)


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
