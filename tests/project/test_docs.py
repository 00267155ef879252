"""Every ```python block of the README and the docs runs as written, on 1 rank and on 2.

The blocks of one file run in order in one script (later blocks use what earlier ones defined, as a
reader would), in a fresh directory, as a user would run them: with `python`, and with
`mpiexec -n 2 python -m mpi4py`. And every file the docs, docstrings and comments cite exists.
"""

import ast
import io
import os
import re
import sys
import tokenize
from pathlib import Path

import pytest

from support import ROOT, mpiexec, repository_files, run_launched

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text())


def test_the_readme_has_python_blocks_to_run():
    assert len(python_blocks(ROOT / "README.md")) >= 3


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("document", [d for d in DOCUMENTS if python_blocks(d)], ids=lambda d: d.name)
def test_python_blocks_run_as_written(comm, tmp_path, document, ranks):
    if comm.size > 1:
        pytest.skip("runs its own processes: the plain-pytest pass of make test covers it")
    script = tmp_path / "blocks.py"
    script.write_text("\n".join(python_blocks(document)))
    command = [sys.executable, str(script)]
    if ranks > 1:
        command = [*mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpi4py", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = run_launched(command, cwd=tmp_path, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


def test_every_public_name_is_in_the_api_reference():
    import mpifsdp
    import mpifsdp.extend

    text = (ROOT / "docs" / "api.md").read_text()
    missing = [n for n in [*mpifsdp.__all__, *mpifsdp.extend.__all__] if f"### `{n}`" not in text]
    assert not missing, f"docs/api.md lacks {missing}: add each with its signature and purpose"


DESIGN = ROOT / "docs" / "design.md"
CITED_SYMBOL = re.compile(r"(?<![\w/.])([\w/]+\.py) (?:\*\*)?`([A-Za-z_][\w.]*)`")  # **bold**: a route's hop


def _cited(path: str) -> Path:
    """A path as design.md writes it: from the repository root, or inside mpifsdp/."""
    return ROOT / path if (ROOT / path).exists() else ROOT / "mpifsdp" / path


def _defined(path: str, symbol: str):
    """The ast node of `symbol` ("Class.method" or "function") in design.md's `path`."""
    scope = ast.parse(_cited(path).read_text()).body
    for part in symbol.split("."):
        [node] = [n for n in scope if getattr(n, "name", None) == part]
        scope = getattr(node, "body", [])
    return node


def test_each_function_the_reading_routes_open_fits_on_a_screen():
    """design.md's two routes open one function a hop (in bold): each ≤ 50 lines with its docstring, so
    that reading a hop is reading one function, and the route's minutes can be counted."""
    text = DESIGN.read_text()
    routes = text[text.index("## Reading one training step") : text.index("## Invariants")]
    opened = re.findall(r"([\w/]+\.py) \*\*`([\w.]+)`\*\*", routes)
    assert len(opened) == 12 + 7, opened  # a hop each
    long = [f"{p} {s}: {n.end_lineno - n.lineno + 1} lines" for p, s in opened
            if (n := _defined(p, s)).end_lineno - n.lineno + 1 > 50]  # fmt: skip
    assert not long, f"a route's hop opens more than a screen: {long}"


def test_every_function_the_design_names_after_a_file_is_in_that_file():
    """'fsdp/model.py `ShardedModel.run_model`': the class, and its method, are defined there."""
    pairs = set(CITED_SYMBOL.findall(DESIGN.read_text()))
    assert len(pairs) > 15
    wrong = []
    for path, symbol in sorted(pairs):
        tree = ast.parse(_cited(path).read_text())
        scope = tree.body
        for part in symbol.split("."):
            found = [n for n in scope if getattr(n, "name", None) == part or _assigns(n, part)]
            if not found:
                wrong.append(f"{path} `{symbol}`")
                break
            scope = getattr(found[0], "body", [])
    assert not wrong, f"docs/design.md names what is not there: {wrong}"


def _assigns(node, name: str) -> bool:
    targets = node.targets if isinstance(node, ast.Assign) else []
    return any(getattr(t, "id", None) == name for t in targets)


def test_the_design_lists_the_public_surface_exactly():
    import mpifsdp
    import mpifsdp.extend

    section = DESIGN.read_text().split("## Public surface", 1)[1].split("\n\n")
    for paragraph, module in zip(section[1:3], (mpifsdp, mpifsdp.extend)):
        listed = re.findall(r"`(\w+)`", paragraph.split(":", 1)[1])
        assert sorted(listed) == sorted(module.__all__), (
            f"docs/design.md's list for {module.__name__} differs"
        )


def test_the_api_reference_is_what_make_api_writes():
    """docs/api.md is generated (docs/make_api.py): a changed signature or docstring shows up here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_api", ROOT / "docs" / "make_api.py")
    make_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_api)
    assert (ROOT / "docs" / "api.md").read_text() == make_api.render(), "run python docs/make_api.py"


# A file named in prose: a path (from the repository root, inside mpifsdp/, or beside the citing file)
# or a bare file name (any file of the repository of that name).
NAMED_FILE = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[A-Za-z_][\w-]*\.(?:py|md|sh|cu|sbatch))\b")
HISTORY = ("CHANGELOG.md", "HISTORY.md")  # they name what was, on purpose


def missing_citations(texts: dict[Path, str], files: list[Path]) -> list[str]:
    """'where: name' for every file named in `texts` ({the citing file: its prose}) that is not there."""
    names = {f.name for f in files}
    missing = []
    for where, text in texts.items():
        for name in NAMED_FILE.findall(text):
            there = _cited(name).is_file() or (where.parent / name).is_file()
            if not (there if "/" in name else name in names):
                missing.append(f"{where.relative_to(ROOT)}: {name}")
    return missing


def prose_of(path: Path) -> str:
    """A Python file's docstrings and comments; a Markdown file whole."""
    if path.suffix != ".py":
        return path.read_text()
    source = path.read_text()
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = [ast.get_docstring(n) or "" for n in ast.walk(ast.parse(source)) if isinstance(n, kinds)]
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return "\n".join(docs + [t.string for t in tokens if t.type == tokenize.COMMENT])


def test_every_file_the_docs_docstrings_and_comments_cite_exists():
    """A renamed or moved module leaves no prose pointing at the old file (the fsdp module's after the
    package split, the models' after they moved into mpifsdp/)."""
    files = [ROOT / f for f in repository_files()]
    cited = [p for p in files if p.suffix in (".py", ".md") and p.name not in HISTORY]
    assert len(cited) > 150, len(cited)
    missing = missing_citations({p: prose_of(p) for p in cited}, files)
    assert not missing, "prose cites files that do not exist:\n" + "\n".join(missing)


def test_a_citation_of_a_file_that_is_gone_is_found():
    planted = {
        ROOT / "mpifsdp" / "fsdp" / "model.py": "the ShardedModel (fsdp.py); ../shard/unit.py; ops/nope.py"
    }
    assert missing_citations(planted, [ROOT / f for f in repository_files()]) == [
        "mpifsdp/fsdp/model.py: fsdp.py",
        "mpifsdp/fsdp/model.py: ops/nope.py",
    ]
