"""python -m mpifsdp pictures: a StepMetrics file drawn as PNGs, and clear errors for other files."""

import json
import subprocess
import sys

import pytest

from mpifsdp.observe.pictures import read_run

from support import train_with_metrics

pytest.importorskip("matplotlib")  # the viz extra; make test installs it (the test extra names it)

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


def test_files_that_are_not_a_run_are_refused_with_the_reason(tmp_path):
    not_json = tmp_path / "log.txt"
    not_json.write_text("step 1 | loss 3.2\n")
    no_steps = tmp_path / "notes.jsonl"
    no_steps.write_text(json.dumps({"step": 1, "val_loss": 2.0}) + "\n")
    for path, reason in ((not_json, "log.txt:1: not a JSON line"), (no_steps, "no step lines")):
        result = subprocess.run(
            [sys.executable, "-m", "mpifsdp", "pictures", str(path)], capture_output=True, text=True
        )
        assert result.returncode != 0 and reason in result.stderr, result.stderr
