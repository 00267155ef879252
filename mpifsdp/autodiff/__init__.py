"""A tiny reverse-mode autodiff engine: Tensor and Param (tensor.py), the tape with its scopes and
the backward sweep (tape.py), the primitive registry, activation recomputation (recompute.py) and
finite-difference checks (gradcheck.py).

May import: base. The primitives themselves are in ops/; layers in nn/.
"""

from .tape import no_grad, scope
from .tensor import PRIMITIVES, AbsentDataError, ArrayMeta, Param, Tensor, apply, graph_nbytes, primitive

__all__ = [
    "PRIMITIVES",
    "AbsentDataError",
    "ArrayMeta",
    "Param",
    "Tensor",
    "apply",
    "graph_nbytes",
    "no_grad",
    "primitive",
    "scope",
]
