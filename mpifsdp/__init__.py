"""mpifsdp: Fully Sharded Data Parallel (ZeRO-3) training on MPI with NumPy or CuPy, no PyTorch.

`import mpifsdp` gives what a training loop is written with; `mpifsdp.extend` what the engine is
extended with (new primitives, scopes, gradient checks). Submodules with a job of their own:
`mpifsdp.ops` (the differentiable operations), `mpifsdp.checkpoint`, `mpifsdp.consolidated`
(.safetensors), `mpifsdp.data`, `mpifsdp.models`.
"""

from . import ops
from .autodiff import AbsentDataError, Param, Tensor
from .backend import array_module, to_device, to_numpy
from .comm import CollectiveError, Comm
from .fsdp import ShardedModel, full_state_dict, fully_shard, report, sharded_model
from .layers import Module, deferred_init
from .manifest import CheckpointError
from .optim import SGD, Adam, AdamW, NonFiniteError
from .scaler import LossScaler
from .schedule import CollectiveTimeout, ScheduleError
from .tape import no_grad
from .threads import set_threads
from .unit import Unit, state_dict

__version__ = "0.1.0"

__all__ = [
    # the model and its data
    "Module",
    "Param",
    "Tensor",
    "no_grad",
    "deferred_init",
    "ops",
    "array_module",
    "to_device",
    "to_numpy",
    # sharding
    "Comm",
    "set_threads",
    "fully_shard",
    "ShardedModel",
    "sharded_model",
    "report",
    "full_state_dict",
    "Unit",
    "state_dict",
    # optimizers
    "AdamW",
    "Adam",
    "SGD",
    "LossScaler",
    # errors
    "AbsentDataError",
    "CheckpointError",
    "CollectiveError",
    "CollectiveTimeout",
    "NonFiniteError",
    "ScheduleError",
]
