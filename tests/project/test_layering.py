"""The package's layering as docs/design.md draws it: every module is listed under its package, each
package imports only the packages its line names, an import the layering does not know fails, and no
function's body is longer than MAX_FUNCTION_LINES (one job each)."""

import ast
import re
from pathlib import Path

from support import ROOT

PACKAGE = ROOT / "mpifsdp"
MAX_FUNCTION_LINES = 45  # a function's body, below its signature and docstring
ABOVE_THE_LIBRARY = "models"  # mpifsdp.models: built on the library; only command lines import it
GROUP = re.compile(r"^(?P<name>\S+?)(?P<kind>/|\.py)\s+imports (?P<deps>[^;]+?)(?:;.*)?$")
MEMBER = re.compile(r"^  (?P<name>\S+)\.py\s")


def documented_layers(text: str | None = None) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """({group: the groups it may import}, {package: its modules}) from design.md's Layers block. A
    group is a sub-package ('fsdp') or a top-level module ('data', '__init__')."""
    text = text or (ROOT / "docs" / "design.md").read_text()
    block = text.split("## Layers", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    allowed, members, current = {}, {}, None
    for line in filter(str.strip, block.splitlines()):
        if group := GROUP.match(line):
            deps = group["deps"].strip()
            current = group["name"]
            allowed[current] = set() if deps == "nothing of mpifsdp" else set(deps.split(", "))
            if group["kind"] == "/":
                members[current] = set()
        elif (member := MEMBER.match(line)) and current in members:
            members[current].add(member["name"])
        else:
            raise AssertionError(f"docs/design.md's Layers block has a line it cannot read: {line!r}")
    return allowed, members


def imported_groups(path: Path, package: Path = PACKAGE) -> set[str]:
    """The first component below `mpifsdp` of everything `path` imports, wherever in the file (lazy
    imports count too), relative or absolute; its own group's modules excluded."""
    inside = list(path.relative_to(package).parent.parts)  # the package path of `path`, under mpifsdp
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.ImportFrom) and node.level:
            base = inside[: len(inside) - (node.level - 1)]
            if node.level - 1 > len(inside):
                targets.append(["<above mpifsdp>"])
            elif node.module:
                targets.append(base + node.module.split("."))
            else:
                targets += [base + [alias.name] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mpifsdp":
            below = node.module.split(".")[1:]
            targets += [below] if below else [[alias.name] for alias in node.names]
        elif isinstance(node, ast.Import):
            targets += [a.name.split(".")[1:] for a in node.names if a.name.split(".")[0] == "mpifsdp"]
        found.update(t[0] for t in targets if t)
    found.discard(inside[0] if inside else path.stem)
    return found


def layering_problems(package: Path, allowed: dict, members: dict) -> list[str]:
    known = set(allowed) | {ABOVE_THE_LIBRARY}
    problems = []
    for path in sorted(package.rglob("*.py")):
        group, where = group_of(path, package), path.relative_to(package)
        if group == ABOVE_THE_LIBRARY:  # mpifsdp/models/: a user of the library, not a layer of it
            continue
        if group not in allowed:
            problems.append(f"{where}: its group {group!r} is not in the layering")
            continue
        for other in sorted(imported_groups(path, package)):
            if other not in known:
                problems.append(f"{where} imports {other!r}, which the layering does not know")
            elif other not in allowed[group]:
                problems.append(f"{where} imports {other}, not on {group}'s line")
    return problems


def unused_edges(package: Path, allowed: dict) -> list[str]:
    """'group: other' for every import the layering allows that no module of the group makes: an edge
    on paper only tells a reader of a dependency that is not there."""
    used = {}
    for path in package.rglob("*.py"):
        group = group_of(path, package)
        used.setdefault(group, set()).update(imported_groups(path, package))
    return [f"{g}: {other}" for g in sorted(allowed) for other in sorted(allowed[g] - used.get(g, set()))]


def group_of(path: Path, package: Path) -> str:
    """The group a file of the package belongs to: its sub-package, or its own name at the top."""
    parts = path.relative_to(package).parts
    return parts[0] if len(parts) > 1 else path.stem


def test_every_module_is_listed_under_its_package():
    allowed, members = documented_layers()
    actual = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        if parts[0] == ABOVE_THE_LIBRARY:
            continue
        if len(parts) > 1 and path.name != "__init__.py":
            actual.setdefault(parts[0], set()).add(path.stem)
        elif len(parts) == 1:
            assert path.stem in allowed, f"mpifsdp/{path.name} has no line in docs/design.md's Layers"
    assert actual == members, "docs/design.md's Layers block and the packages' modules differ"
    assert all((PACKAGE / name / "__init__.py").exists() for name in members)


def test_every_import_follows_the_layering():
    allowed, members = documented_layers()
    problems = layering_problems(PACKAGE, allowed, members)
    assert not problems, "imports against docs/design.md's Layers:\n" + "\n".join(problems)


def test_every_import_the_layering_allows_is_made():
    allowed, _ = documented_layers()
    unused = unused_edges(PACKAGE, allowed)
    assert not unused, "docs/design.md's Layers allows imports no module makes (drop them):\n" + "\n".join(
        unused
    )


def test_an_allowed_import_no_module_makes_is_found(tmp_path):
    package = tmp_path / "mpifsdp"
    (package / "nn").mkdir(parents=True)
    (package / "nn" / "layers.py").write_text("from ..ops import gelu\n")
    assert unused_edges(package, {"nn": {"ops", "autodiff"}}) == ["nn: autodiff"]


def test_the_layering_has_no_cycle():
    allowed, _ = documented_layers()
    levels, left = {}, dict(allowed)
    while left:
        ready = [g for g, deps in left.items() if deps - {ABOVE_THE_LIBRARY} <= set(levels)]
        assert ready, f"the layering has a cycle among {sorted(left)}"
        for g in ready:
            levels[g] = 1 + max((levels[d] for d in left[g] if d in levels), default=-1)
            del left[g]


def test_the_edges_that_keep_the_parts_apart():
    """Whatever the document says: the sharding core runs without the autodiff engine, optimizers
    without the FSDP runtime, the ledgers below everything, and the library below its models."""
    allowed, _ = documented_layers()
    assert allowed["base"] == set()
    assert not allowed["shard"] & {"autodiff", "ops", "nn", "fsdp"}
    assert not allowed["optim"] & {"fsdp", "nn", "checkpoint"}
    library = set(allowed) - {"cli", "__main__"}
    assert all(ABOVE_THE_LIBRARY not in allowed[g] for g in library)


def test_the_layering_check_fails_on_an_unknown_or_upward_import(tmp_path):
    package = tmp_path / "mpifsdp"
    for name, text in {
        "shard/unit.py": "from ..autodiff.tape import no_grad\n",  # a package edge that is not allowed
        "optim/adamw.py": "def f():\n    from mpifsdp.fsdp import sharded_model\n",  # lazy, absolute
        "planning/planner.py": "from mpifsdp.models import GPT\n",  # the library importing its models
        "ops/loss.py": "from ..frobnicate import x\n",  # a package the layering does not know
        "nn/module.py": "from . import layers\nfrom .. import ops\n",  # its own package; an allowed edge
    }.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    allowed, members = documented_layers()
    problems = layering_problems(package, allowed, members)
    assert problems == [
        "ops/loss.py imports 'frobnicate', which the layering does not know",
        "optim/adamw.py imports fsdp, not on optim's line",
        "planning/planner.py imports models, not on planning's line",
        "shard/unit.py imports autodiff, not on shard's line",
    ], problems


def body_lines(function: ast.FunctionDef) -> int:
    """Lines of a function's body below its signature and docstring: the code a reader follows."""
    body = function.body
    has_docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    first = body[1] if has_docstring and len(body) > 1 else body[0]
    return function.end_lineno - first.lineno + 1


def long_functions(paths) -> dict[str, int]:
    """{file:function: lines} for every function (methods and nested ones too) over the cap."""
    found = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = body_lines(node)
                if length > MAX_FUNCTION_LINES:
                    found[f"{path.relative_to(ROOT)}:{node.name}"] = length
    return found


def test_functions_stay_short():
    paths = list(PACKAGE.rglob("*.py"))  # the models in mpifsdp/models/ too
    assert "fmt: skip" not in "".join(p.read_text() for p in paths), "no `# fmt: skip` in the library"
    long = long_functions(paths)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them by job): {long}"


def test_the_public_surface_names_every_error_class():
    """`import mpifsdp` gives every exception the package raises of its own, and nothing unresolved."""
    import mpifsdp
    import mpifsdp.extend

    for module in (mpifsdp, mpifsdp.extend):
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert not missing, f"{module.__name__}.__all__ names {missing}, which do not exist"
    defined = {
        node.name
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.name.endswith(("Error", "Timeout"))
    }
    assert defined and defined <= set(mpifsdp.__all__), f"not exported: {defined - set(mpifsdp.__all__)}"


def test_only_the_backend_imports_cupy():
    """docs/design.md, Layers: base/backend.py is the one module that imports cupy or cupyx (by name
    or through importlib); every other module reaches CuPy through it."""
    mention = re.compile(r"^\s*(import|from)\s+cupy|import_module\(\s*[\"']cupy", re.M)
    found = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if mention.search(p.read_text())]
    assert found == ["base/backend.py"], found
