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


@dataclasses.dataclass(frozen=True)
class Offload:
    """Where a rank's optimizer states live when not beside its compute. kind "disk": in files under
    `directory` (node-local scratch), one unit's in memory at a time at each step (optim/offload.py):
    a model whose states exceed the node's memory trains, to the same bits."""

    kind: str
    directory: str | None = None


OFFLOADS = {  # what each offload moves off the device (or, "disk", out of memory), and whether it is built
    "disk": "AdamW's moments in files, two buffers a moment in memory (a CPU model)",
    "optimizer": "fp32 masters, moments and a gradient copy in host memory (not built yet on a GPU)",
    "optimizer+params": "as 'optimizer', and the param_dtype shards too (not built yet on a GPU)",
}


def offload_policy(offload, offload_dir, device: str) -> Offload | None:
    """fully_shard's offload= (a kind or an Offload) and offload_dir= as one Offload, or None; what
    this build cannot do is refused by name."""
    if isinstance(offload, Offload):
        if offload_dir is not None:
            raise ValueError("fully_shard: give the directory in Offload(...) or offload_dir=, not both")
        offload, offload_dir = offload.kind, offload.directory
    if offload is None:
        if offload_dir is not None:
            raise ValueError(
                "fully_shard: offload_dir= names where offload='disk' puts its files: give offload too"
            )
        return None
    if offload not in OFFLOADS:
        raise ValueError(f"fully_shard: offload must be one of {tuple(OFFLOADS)} or None, got {offload!r}")
    if device != "cpu":
        raise ValueError(
            f"fully_shard: offload={offload!r} on a GPU is not built yet (the optimizer's states stay on "
            "the device): train without offload, or see issue 51"
        )
    if offload != "disk":
        raise ValueError(
            f"fully_shard: offload={offload!r} on a CPU: the optimizer's states are in host memory "
            "already; offload='disk' with offload_dir= moves them to files"
        )
    if offload_dir is None:
        raise ValueError("fully_shard: offload='disk' needs offload_dir= (a directory on a local disk)")
    return Offload("disk", str(offload_dir))


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
