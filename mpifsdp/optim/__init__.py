"""Optimizers on flat groups (a Unit's shard, or one whole Param): the base with norms, clipping and
the non-finite policy (flat_optimizer.py), one step's arithmetic of AdamW, Adam and SGD
(optimizers.py), and the float16 loss scaler (scaler.py). Every update is local to the rank's shards
(the step exchanges a few numbers: the global gradient norm, the schedule check, a GPU's verdict).

May import: cuda (the GPU update and norm: cuda/adamw.py, cuda/norm.py), autodiff, shard, base. Never the FSDP
runtime: a sharded model is recognised by `Module._sharded`, and a list of Units is taken as it is.
"""

from .flat_optimizer import NonFiniteError
from .optimizers import SGD, Adam, AdamW
from .scaler import LossScaler

__all__ = ["SGD", "Adam", "AdamW", "LossScaler", "NonFiniteError"]
