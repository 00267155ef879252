"""The module paths of mpifsdp 0.1's flat layout, importable for one more release with a
DeprecationWarning that names the new path (CHANGELOG.md lists every move).

`import mpifsdp.consolidated` (and `python -m mpifsdp.pictures`) find the module at its new home
through a meta-path finder: the old name is bound to the same module object, so a user's patch or
isinstance check sees what the package uses. `mpifsdp.layers` was cut in two; its old path is a
module holding the names of both halves.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

MOVED = {
    "accounting": "base.accounting",
    "backend": "base.backend",
    "checks": "base.checks",
    "threads": "base.threads",
    "schedule": "comm.schedule",
    "transport": "comm.transport",
    "flat": "shard.flat",
    "pool": "shard.pool",
    "unit": "shard.unit",
    "tape": "autodiff.tape",
    "recompute": "autodiff.recompute",
    "gradcheck": "autodiff.gradcheck",
    "attention": "ops.causal_attention",
    "fused": "ops.fused",
    "gpu_kernels": "ops.gpu_kernels",
    "layers": "nn.module nn.layers",
    "partition": "fsdp.partition",
    "lifecycle": "fsdp.lifecycle",
    "flat_optimizer": "optim.flat_optimizer",
    "scaler": "optim.scaler",
    "manifest": "checkpoint.manifest",
    "publish": "checkpoint.publish",
    "consolidated": "checkpoint.consolidated",
    "metrics": "observe.metrics",
    "pictures": "observe.pictures",
    "planner": "planning.planner",
    "plan_cli": "cli.plan",
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `mpifsdp.<old>` for every old name in MOVED and loads it as its new module."""

    def find_spec(self, name, path=None, target=None):
        prefix, _, old = name.partition(".")
        if prefix != "mpifsdp" or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        homes = _homes(spec.name)
        modules = [importlib.import_module(home) for home in homes]
        if len(modules) == 1:
            return modules[0]
        merged = types.ModuleType(spec.name, f"{spec.name}: the names of {' and '.join(homes)}")
        for module in modules:
            merged.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
        return merged

    def exec_module(self, module):
        """Nothing to run: create_module returned the loaded module."""

    def get_code(self, name):
        """For `python -m mpifsdp.<old>`: the code of the new module."""
        home = _homes(name)[-1]
        return importlib.util.find_spec(home).loader.get_code(home)


def _homes(name: str) -> list[str]:
    """The new paths of the old module `name`, with the warning a user of the old path gets."""
    homes = [f"mpifsdp.{home}" for home in MOVED[name.partition(".")[2]].split()]
    message = f"{name} moved to {' and '.join(homes)}; the old path goes in the next release"
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    return homes


def install():
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
