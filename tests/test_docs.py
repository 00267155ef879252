"""Every ```python block of the README and the docs runs as written, on 1 rank and on 2.

The blocks of one file run in order in one script (later blocks use what earlier ones defined, as a
reader would), in a fresh directory, as a user would run them: `python script.py` and
`mpiexec -n 2 python -m mpi4py script.py`.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_abort import mpiexec

ROOT = Path(__file__).resolve().parent.parent
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
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


def test_every_public_name_is_in_the_api_reference():
    import mpifsdp
    import mpifsdp.extend

    text = (ROOT / "docs" / "api.md").read_text()
    missing = [n for n in [*mpifsdp.__all__, *mpifsdp.extend.__all__] if f"### `{n}`" not in text]
    assert not missing, f"docs/api.md lacks {missing}: add each with its signature and purpose"
