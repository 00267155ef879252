"""mpifsdp: Fully Sharded Data Parallel (ZeRO-3) training on MPI with NumPy or CuPy, no PyTorch.

`import mpifsdp` gives what a training loop is written with; `mpifsdp.extend` what the engine is
extended with (new primitives, scopes, gradient checks). Submodules with a job of their own:
`mpifsdp.ops` (the differentiable operations), `mpifsdp.checkpoint` (and `.consolidated`: one
.safetensors file), `mpifsdp.data`, `mpifsdp.models`. docs/design.md draws the sub-packages.
"""

import os

# OpenBLAS's idle threads spin for 2**28 cycles after each GEMM, on the cores the elementwise kernels
# between GEMMs then run on (a few % of the peer-config step: bench/HISTORY.md). OpenBLAS reads this
# once, when NumPy loads it: it takes effect when mpifsdp is imported before NumPy, or set by the
# launcher (README, "Speed and memory knobs"). A value the user set is kept.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from . import cuda, ops  # noqa: E402, F401  (cuda: the GPU implementations, registered)
from .autodiff import AbsentDataError, Param, Tensor, no_grad  # noqa: E402
from .base.backend import array_module, to_device, to_numpy  # noqa: E402
from .base.kernels import SlowPathError  # noqa: E402
from .base.threads import set_threads  # noqa: E402
from .checkpoint import CheckpointError  # noqa: E402
from .comm import CollectiveError, Comm, PhantomComm  # noqa: E402
from .comm.schedule import CollectiveTimeout, ScheduleError  # noqa: E402
from .comm.stopping import StopRequest  # noqa: E402
from .fsdp import (  # noqa: E402
    Deterministic,
    GraphedPasses,
    MixedPrecision,
    Offload,
    ShardedModel,
    full_state_dict,
    fully_shard,
    no_sync,
    report,
    sharded_model,
)
from .nn import Module, deferred_init  # noqa: E402
from .observe import StepMetrics  # noqa: E402
from .optim import SGD, Adam, AdamW, LossScaler, NonFiniteError  # noqa: E402
from .planning import plan  # noqa: E402
from .shard import Unit  # noqa: E402

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
    "PhantomComm",
    "set_threads",
    "fully_shard",
    "MixedPrecision",
    "Deterministic",
    "Offload",
    "ShardedModel",
    "sharded_model",
    "GraphedPasses",
    "no_sync",
    "report",
    "StepMetrics",
    "StopRequest",
    "full_state_dict",
    "Unit",
    # optimizers
    "AdamW",
    "Adam",
    "SGD",
    "LossScaler",
    # planning a job: memory, traffic, step time (python -m mpifsdp plan)
    "plan",
    # errors
    "AbsentDataError",
    "CheckpointError",
    "CollectiveError",
    "CollectiveTimeout",
    "NonFiniteError",
    "ScheduleError",
    "SlowPathError",
]
