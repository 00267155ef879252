"""The package's layering as docs/design.md lists it: every module is listed, each imports only modules
listed above it, and none is longer than 400 lines (one job each)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mpifsdp"


def documented_layers() -> list[str]:
    design = (ROOT / "docs" / "design.md").read_text()
    section = design.split("## Layers", 1)[1]
    block = section.split("```text\n", 1)[1].split("```", 1)[0]
    return [re.match(r"(\S+)\.py\s", line)[1] for line in block.splitlines() if line.strip()]


def package_imports(path: Path) -> set[str]:
    """The package modules `path` imports, wherever in the file (lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mpifsdp."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("mpifsdp."))
    return found


def test_every_module_is_in_the_documented_order():
    layers = documented_layers()
    modules = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert sorted(layers) == modules, "docs/design.md's Layers list and mpifsdp/ differ"


def test_no_module_imports_one_below_it_in_the_layers():
    position = {name: i for i, name in enumerate(documented_layers())}
    upward = [
        f"{path.stem} imports {other}"
        for path in PACKAGE.glob("*.py")
        for other in package_imports(path)
        if other in position and position[other] >= position[path.stem]
    ]
    assert not upward, f"imports against the layering of docs/design.md: {sorted(upward)}"


def test_the_layering_check_sees_an_upward_import(tmp_path):
    module = tmp_path / "tape.py"
    module.write_text("def f():\n    from .fsdp import fully_shard\n")
    assert package_imports(module) == {"fsdp"}


def test_modules_stay_small():
    long = {p.name: n for p in PACKAGE.glob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"modules over 400 lines (split them by job): {long}"


def test_the_public_surface_names_every_error_class():
    """`import mpifsdp` gives every exception the package raises of its own, and nothing unresolved."""
    import mpifsdp
    import mpifsdp.extend

    for module in (mpifsdp, mpifsdp.extend):
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert not missing, f"{module.__name__}.__all__ names {missing}, which do not exist"
    defined = {
        node.name
        for path in PACKAGE.glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.name.endswith(("Error", "Timeout"))
    }
    assert defined and defined <= set(mpifsdp.__all__), f"not exported: {defined - set(mpifsdp.__all__)}"
