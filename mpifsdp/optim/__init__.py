"""Optimizers on flat groups (a Unit's shard, or one whole Param): the base with norms, clipping and
the non-finite policy (flat_optimizer.py), one step's arithmetic of AdamW, Adam and SGD
(optimizers.py), the float16 loss scaler (scaler.py), the step's verdict on a device's deferred
checks (verdict.py), the device seam a GPU's update and norm register in (device.py), and the whole
step decided on the device for a CUDA graph (device_step.py). Every update
is local to the rank's shards (the step exchanges a few numbers: the global gradient norm, the
schedule check, a GPU's verdict).

May import: autodiff, shard, base. Never the FSDP runtime: a sharded model is recognised by
`Module._sharded`, and a list of Units is taken as it is.
"""

from .flat_optimizer import NonFiniteError
from .optimizers import SGD, Adam, AdamW
from .scaler import LossScaler

__all__ = ["SGD", "Adam", "AdamW", "LossScaler", "NonFiniteError"]
