"""A unit's gather state, explicit: sharded, gathering (a collective in flight into `full`) or
gathered, and the moves between them (as fsdp/lifecycle.py's stages are a unit's place in a step).

A Unit moves through it at exactly four points (shard/unit.py): a gather starts (start_unshard), or
needs no collective (one rank on a GPU sends its cast as its full parameters); the gather finishes
(_finish_gather); the full parameters are dropped (reshard). Any other move is a broken order of
calls (a reshard racing a gather MPI still writes into, a second gather over a held one) and raises,
naming the unit, rather than leaving a buffer MPI writes into back in the pool.
"""

from __future__ import annotations

import enum


class Gathered(enum.Enum):
    SHARDED = "sharded"  # only the shard: `full` is None
    GATHERING = "gathering"  # a gather in flight into `full`
    UNSHARDED = "unsharded"  # `full` holds every rank's shard


MOVES = {
    Gathered.SHARDED: {Gathered.GATHERING, Gathered.UNSHARDED},
    Gathered.GATHERING: {Gathered.UNSHARDED},
    Gathered.UNSHARDED: {Gathered.SHARDED},
}


def moved(name: str, now: Gathered, to: Gathered) -> Gathered:
    """`to`, where MOVES allows it from `now`; else RuntimeError naming the unit."""
    if to not in MOVES[now]:
        raise RuntimeError(
            f"unit {name!r} cannot go from {now.value} to {to.value} (a gather or reshard out of "
            "order: please report it with the traceback)"
        )
    return to
