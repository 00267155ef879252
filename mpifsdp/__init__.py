"""mpifsdp: Fully Sharded Data Parallel (ZeRO-3) training on MPI with NumPy or CuPy, no PyTorch."""

from . import ops
from .autodiff import PRIMITIVES, Param, ShardedParameterError, Tensor, no_grad, scope
from .backend import array_module, available_devices, to_device, to_numpy
from .comm import CollectiveError, Comm
from .fsdp import full_state_dict, fully_shard
from .layers import deferred_init
from .optim import SGD, Adam, AdamW, NonFiniteError
from .scaler import LossScaler
from .unit import Unit, state_dict

__version__ = "0.1.0"

__all__ = [
    "Adam",
    "AdamW",
    "SGD",
    "CollectiveError",
    "NonFiniteError",
    "Comm",
    "LossScaler",
    "Unit",
    "deferred_init",
    "fully_shard",
    "full_state_dict",
    "PRIMITIVES",
    "Param",
    "ShardedParameterError",
    "Tensor",
    "array_module",
    "available_devices",
    "no_grad",
    "ops",
    "scope",
    "state_dict",
    "to_device",
    "to_numpy",
]
