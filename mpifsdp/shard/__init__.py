"""The sharding core, usable without our autodiff: a flat layout of named arrays (names, shapes,
offsets, padding, shard ranges), the reused buffers gathered parameters and gradients live in, and
`Unit`, one flat-sharded parameter group with its two state machines (docs/design.md).

May import: base. Never the autodiff engine, the layers or the FSDP runtime: a scientist's own NumPy
code shards its arrays with this package alone (examples/sharded_numpy.py).
"""

from .unit import Unit, gathered_params

__all__ = ["Unit", "gathered_params"]
