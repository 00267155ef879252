"""fully_shard's settings that belong together, as policy objects (as FSDP2's MixedPrecisionPolicy):
one value carries a choice whole, and is checked where fully_shard takes it. The plain keywords
(param_dtype=, reduce_dtype=, deterministic=True, chunk_size=, chunk_threads=) stay; giving a
setting both ways is refused, naming both."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Parameters gathered and computed in param_dtype (e.g. float16), gradients reduce-scattered in
    reduce_dtype (default param_dtype); shards, gradient shards and optimizer state stay in the
    model's dtype (fp32 masters). Use a LossScaler with float16."""

    param_dtype: object = None
    reduce_dtype: object = None


@dataclasses.dataclass(frozen=True)
class Deterministic:
    """The same bits at any world size (docs/determinism.md): chunks of chunk_size samples whose
    gradients are summed exactly, each chunk's GEMMs on chunk_threads BLAS threads."""

    chunk_size: int = 1
    chunk_threads: int = 1


def resolved(mixed_precision, deterministic, param_dtype, reduce_dtype, chunk_size, chunk_threads) -> tuple:
    """(param_dtype, reduce_dtype, deterministic, chunk_size, chunk_threads) from the policies and the
    keywords; a setting given both ways, or a policy of the wrong type, raises."""
    if not isinstance(deterministic, (bool, int, np.bool_, Deterministic)):
        raise TypeError(
            f"fully_shard: deterministic must be True, False or a Deterministic, got {deterministic!r}"
        )
    out = dict(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, chunk_size=chunk_size, chunk_threads=chunk_threads
    )
    for policy, kind, fields in (
        (mixed_precision, MixedPrecision, ("param_dtype", "reduce_dtype")),
        (
            deterministic if isinstance(deterministic, Deterministic) else None,
            Deterministic,
            ("chunk_size", "chunk_threads"),
        ),
    ):
        if policy is None:
            continue
        if not isinstance(policy, kind):
            raise TypeError(f"fully_shard: expected a {kind.__name__}, got {type(policy).__name__}")
        defaults = {f.name: f.default for f in dataclasses.fields(kind)}
        both = [name for name in fields if out[name] != defaults[name]]
        if both:
            raise ValueError(
                f"fully_shard: {', '.join(both)} given both as a keyword and in {kind.__name__}(): "
                "give it once"
            )
        out.update(dataclasses.asdict(policy))
    if deterministic and out["chunk_size"] is None:  # it ran the normal mode, silently
        raise ValueError(
            "fully_shard: deterministic=True with chunk_size=None: give the samples per chunk (an "
            "integer >= 1; the bits depend on it), or deterministic=False"
        )
    return (
        out["param_dtype"],
        out["reduce_dtype"],
        bool(deterministic),
        out["chunk_size"],
        out["chunk_threads"],
    )
