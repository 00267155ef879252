"""python -m mpifsdp pictures: a StepMetrics file drawn as PNGs, and clear errors for other files."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mpifsdp.observe.pictures import read_run

from support import require, train_with_metrics

# The viz extra; make test installs it (the test extra names it).
require(None if importlib.util.find_spec("matplotlib") else "matplotlib (the viz extra) is not installed")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_the_report_draws_four_pngs_from_a_run(comm, tmp_path):
    path, _ = train_with_metrics(comm, tmp_path, 3)
    run = read_run(path)
    assert len(run["steps"]) == 3 and len(run["notes"]) == 3 and run["timeline"]["timeline_step"] == 2
    if comm.rank == 0:  # drawing is one process's job
        out = tmp_path / "pictures"
        result = subprocess.run(
            [sys.executable, "-m", "mpifsdp", "pictures", path, "--out", str(out)],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stderr
        names = sorted(p.split("/")[-1] for p in result.stdout.split())
        assert names == ["comm.png", "loss.png", "memory.png", "throughput.png"]
        for name in names:
            data = (out / name).read_bytes()
            assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000  # a drawn image, not an empty one


STEP = {"step": 1, "loss": 3.2, "time_s": 0.5, "tokens_per_s": 100.0, "compute_s": 0.4, "exposed_comm_s": 0.1}


def _pictures(path, out=None):
    command = [sys.executable, "-m", "mpifsdp", "pictures", str(path), *(["--out", str(out)] if out else [])]
    return subprocess.run(command, capture_output=True, text=True)


def _jsonl(path, *lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize(
    "content, reason",
    [
        ("step 1 | loss 3.2\n", "f:1: not a JSON line"),
        (json.dumps({"step": 1, "val_loss": 2.0}) + "\n", "no step lines"),
        (b"\x89PNG\r\n\x1a\n\xff\xfe", "is not a text file"),  # garbage: was a bare UnicodeDecodeError
        ("3\n", "f:1: a JSON int, not an object"),  # scalars: was a TypeError traceback
        (
            json.dumps({**STEP, "loss": "3.2"}) + "\n",
            "f:1: loss='3.2' where a number",
        ),  # was a categorical axis
        (json.dumps({**STEP, "step": True}) + "\n", "f:1: step=True where a number"),
        (
            json.dumps(STEP) + "\n" + json.dumps({"timeline_step": 1, "memory_events": [[[0.1, "x"]]]}),
            "f:2: a timeline line needs",
        ),
    ],
)
def test_files_that_are_not_a_run_are_refused_with_the_reason(tmp_path, content, reason):
    path = tmp_path / "f"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    result = _pictures(path)
    assert result.returncode == 1 and reason in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_a_timeline_with_no_events_draws_what_there_is(tmp_path):
    for ranks in ([], [[], []]):  # no rank; ranks that recorded nothing
        timeline = {"timeline_step": 1, "memory_events": ranks, "bytes_by_unit_phase": {}}
        path = _jsonl(tmp_path / "run.jsonl", STEP, {**STEP, "step": 2, "loss": None}, timeline)
        result = _pictures(path, tmp_path / "out")
        assert result.returncode == 0, result.stderr
        drawn = sorted(Path(p).name for p in result.stdout.split())
        assert drawn == sorted(["loss.png", "throughput.png", "comm.png", *(["memory.png"] if ranks else [])])
