"""The FSDP runtime: fully_shard builds units from a Module (build.py, with partition.py's checks),
each unit's stages in a step are a UnitLifecycle (lifecycle.py), and the ShardedModel (model.py) is
the outermost scope of every step: input check, prefetch, end of backward. GraphedPasses
(graphed.py) replays a step's forward and backward from one CUDA graph. fully_shard's grouped
settings: MixedPrecision, Deterministic and Offload (policy.py).

May import: nn, cuda (cuDNN's workspace, cuBLAS's streams: graphed.py), optim (a whole-step
graph's DeviceStep: graphed.py), ops, autodiff, shard, comm, base.
"""

from .build import full_state_dict, fully_shard, no_sync, report, sharded_model
from .graphed import GraphedPasses
from .model import ShardedModel
from .policy import Deterministic, MixedPrecision, Offload

__all__ = [
    "Deterministic",
    "GraphedPasses",
    "MixedPrecision",
    "Offload",
    "ShardedModel",
    "full_state_dict",
    "fully_shard",
    "no_sync",
    "report",
    "sharded_model",
]
