"""The device seam: the CPU/GPU choice is made in one place (autodiff/tensor.py's `implementation`
picks a primitive's implementation by its input's device; mpifsdp/cuda/ registers the GPU's). The
reference operations, the layers, the autodiff core and the models hold no device branch and import
nothing of mpifsdp/cuda/, and the branches left elsewhere are counted: their number only goes down."""

import re
from pathlib import Path

import numpy as np
import pytest

from mpifsdp.autodiff.tensor import FUSIONS, ON_DEVICE, PRIMITIVES, implement, implementation

from support import ROOT

PACKAGE = ROOT / "mpifsdp"
# A line that asks which device an array is on (issue 47's count: 61 such lines in 19 files before).
DEVICE_BRANCH = re.compile(r"xp is (not )?np|is (not )?np\b|is_gpu|on_gpu|xp is cp|is_cupy")
MOST = 10  # the count now (was 61, then 37, 23, 14); lower it as branches go behind the seam, never raise it
# What a reader of one CPU step opens: none of it may ask for the device or reach into cuda/.
DEVICE_FREE = (
    "ops/fused.py",
    "ops/causal_attention.py",
    "ops/primitives.py",
    "ops/functional.py",
    "nn/layers.py",
    "autodiff",
    "models",
)


def device_branches(package: Path) -> dict[str, int]:
    """{file relative to the package: how many of its lines ask for the device}."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        hits = sum(1 for line in path.read_text().splitlines() if DEVICE_BRANCH.search(line))
        if hits:
            found[str(path.relative_to(package))] = hits
    return found


def _device_free(relative: str) -> bool:
    return any(relative == part or relative.startswith(part + "/") for part in DEVICE_FREE)


def test_device_branches_are_few_and_only_where_the_device_is_the_job():
    found = device_branches(PACKAGE)
    in_cpu_route = {f: n for f, n in found.items() if _device_free(f)}
    assert not in_cpu_route, f"device branches in the CPU reader's route: {in_cpu_route}"
    assert sum(found.values()) <= MOST, f"{sum(found.values())} device branches (at most {MOST}): {found}"


def test_the_cpu_route_imports_nothing_of_the_gpus_home():
    cuda_import = re.compile(r"^\s*(from|import)\s+(\.\.cuda|mpifsdp\.cuda|\.\.\.cuda)\b", re.M)
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if _device_free(str(path.relative_to(PACKAGE))) and cuda_import.search(path.read_text())
    ]
    assert not offenders, f"these files of the CPU route import mpifsdp/cuda/: {offenders}"


def test_a_planted_branch_is_counted(tmp_path):
    (tmp_path / "ops").mkdir()
    (tmp_path / "ops" / "fused.py").write_text("if xp is not np:\n    pass\n")
    assert device_branches(tmp_path) == {"ops/fused.py": 1}
    assert _device_free("ops/fused.py") and not _device_free("cuda/fused.py")


def test_a_cpu_array_runs_the_reference_and_each_gpu_implementation_is_of_a_primitive():
    assert ON_DEVICE, "mpifsdp/cuda/ registered no GPU implementation"
    for name, device in ON_DEVICE:
        assert device == "cuda" and name in PRIMITIVES
        assert implementation(name, np.zeros(1)) is PRIMITIVES[name]
        assert ON_DEVICE[name, device].name == name and (name, device) in FUSIONS


def test_a_second_implementation_for_one_device_is_refused():
    name, device = next(iter(ON_DEVICE))
    with pytest.raises(ValueError, match="already"):
        implement(name, device)(lambda *a: None)


def test_every_kernel_family_is_declared_with_a_twin_for_each_kernel_and_named_flags():
    """base/kernels.py `family`: one declaration per family of raw kernels (its source, entry
    points, NumPy twins); every entry point has its twin (what the stand-in GPU runs), and no .cu
    file tests a flag by a bare number (each bit has one name, defined from Python)."""
    from mpifsdp.base import kernels

    assert len(kernels.RAW_FAMILIES) >= 8
    for name, declared in kernels.RAW_FAMILIES.items():
        assert set(declared.kernels) <= set(kernels.TWINS), f"{name}: kernels without a twin"
        assert declared.source(np.float32).count("__global__") >= len(declared.kernels), name
    bare = [
        f"{path.relative_to(PACKAGE)}:{n}"
        for path in PACKAGE.rglob("*.cu")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"flags & \d", line)
    ]
    assert not bare, f"flags tested by number: {bare}"


def test_a_family_twice_or_a_twin_of_no_kernel_is_refused_and_flags_are_defined_by_name():
    import enum

    from mpifsdp.base import kernels

    with pytest.raises(ValueError, match="declared twice"):
        kernels.family(next(iter(kernels.RAW_FAMILIES)), lambda d: "", ("k",), {})
    with pytest.raises(ValueError, match="of no kernel"):
        kernels.family("a new family", lambda d: "", ("k",), {"other": None})

    class Bits(enum.IntFlag):
        ONE = 1
        FOUR = 4

    assert kernels.flag_defines(Bits, "X_") == "#define X_ONE 1\n#define X_FOUR 4\n"
