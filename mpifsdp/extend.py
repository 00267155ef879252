"""What the engine is extended with: new primitives (a forward and its VJP), scopes around recorded
nodes (the hooks FSDP itself uses), finite-difference checks of both, and recompute (activation
checkpointing of any function; fully_shard(recompute=...) applies it per unit).

    from mpifsdp.extend import primitive, check_vjp

    def _cube_vjp(g, saved, x):
        return (3 * x * x * g,)

    @primitive("cube", _cube_vjp)
    def _cube(x):
        return x**3, None

    check_vjp("cube", [np.random.default_rng(0).standard_normal(5)])  # raises if the VJP is wrong

Use it as `mpifsdp.extend.apply("cube", tensor)`, or wrap that in a function of your own.
"""

from .autodiff.gradcheck import check_grad, check_vjp
from .autodiff.recompute import recompute
from .autodiff.tape import scope
from .autodiff.tensor import PRIMITIVES, ArrayMeta, apply, primitive

__all__ = ["PRIMITIVES", "ArrayMeta", "apply", "check_grad", "check_vjp", "primitive", "recompute", "scope"]
