"""The step-time model calibrated by a device's measurements (planning/calibration.py): the rate read
from make gpu-check's JSON lines with its source, the overlap share in plan(), MFU in both
conventions, the command line's --calibrate and named links, and bench/scaling_table.py's
calibrated predictions as JSON lines."""

import json
import subprocess
import sys

import pytest

from mpifsdp.models import GPTConfig, gpt_units
from mpifsdp.planning.calibration import H200_370M, LINKS, Calibration, mfu
from mpifsdp.planning.planner import flops_per_step, plan

from support import ROOT

SPEED = {
    "check": "speed", "config": "gpu13b", "dtype": "bfloat16", "ranks": 8, "phantom": True,
    "recompute": True, "mfu": 0.33, "mfu_peak_tflops": {"bfloat16": 989.4, "float32": 60.0},
    "gpu": "NVIDIA H200", "provenance": {"commit": "0123abc"},
}  # fmt: skip


def _log(*rows) -> list[str]:
    return ["== [0s] a step's header", *(json.dumps(r) for r in rows), "gpu-check passed in 1s"]


def test_a_calibration_reads_the_last_speed_line_and_its_graphed_rate_with_its_source():
    """The graphed step's MFU when a speed_graphed line follows its speed line, times 4/3 where the
    blocks were recomputed (the hardware's FLOPs, which plan's flops_per_step counts)."""
    graphed = Calibration.from_lines(_log(SPEED, {"check": "speed_graphed", "mfu": 0.36}))
    assert graphed.flops == pytest.approx(0.36 * 4 / 3 * 989.4e12) and graphed.peak == 989.4e12
    assert graphed.source == "NVIDIA H200, gpu13b bfloat16 from one CUDA graph, 8 ranks (phantom), at 0123abc"
    eager = Calibration.from_lines(_log({**SPEED, "recompute": False, "phantom": False, "ranks": 1}))
    assert eager.flops == pytest.approx(0.33 * 989.4e12) and "eager, 1 ranks, at" in eager.source
    other = {**SPEED, "config": "gpu350m", "mfu": 0.4, "recompute": False}
    assert Calibration.from_lines(_log(SPEED, other), config="gpu13b").flops == pytest.approx(
        0.33 * 4 / 3 * 989.4e12
    )
    assert Calibration.from_lines(_log(SPEED, other)).flops == pytest.approx(0.4 * 989.4e12)
    # a config's graphed line, not the next config's: the 13B's 0.36, though the 370M's 0.5 comes later
    lines = _log(
        SPEED, {"check": "speed_graphed", "mfu": 0.36}, other, {"check": "speed_graphed", "mfu": 0.5}
    )
    assert Calibration.from_lines(lines, config="gpu13b").flops == pytest.approx(graphed.flops)
    assert Calibration.from_lines(lines).flops == pytest.approx(0.5 * 989.4e12)


@pytest.mark.parametrize(
    "rows, named",
    [
        ([], "no device speed line"),
        ([{**SPEED, "mfu_peak_tflops": None}], "no device speed line"),  # the CPU dry run's line
        ([{**SPEED, "mfu": 1.2}], "above the peak"),
        ([{**SPEED, "mfu": 0.0}], "flops 0.0 > 0"),
        ([{k: v for k, v in SPEED.items() if k != "dtype"}], r"lacks \['dtype'\]"),
    ],
)
def test_a_calibration_refuses_what_it_cannot_rest_on(rows, named):
    with pytest.raises(ValueError, match=named):
        Calibration.from_lines(_log(*rows))


def test_mfu_in_both_conventions_and_the_overlap_share_of_the_step():
    """PaLM's MFU counts attention's products whole, the causal one half of them; overlap 0 hides no
    communication under compute, 1 all the schedule allows; a share outside [0, 1] is refused."""
    assert mfu(600.0, 120.0, 2.0, 1000.0) == {"palm": 0.3, "causal": 0.27}
    config = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=64)
    units, model = gpt_units(config)
    work = flops_per_step(model, config.block_size, 64)
    comm = plan(units, 64, ranks_per_node=8)["time_s"]["comm_in_group"]
    rate = work / comm  # compute as long as the communication: how much hides is the overlap's to say
    times = {
        overlap: plan(units, 64, ranks_per_node=8, flops=rate, flops_per_step=work, overlap=overlap)["time_s"]
        for overlap in (0.0, 0.5, 1.0)
    }
    assert times[0.0]["exposed_comm"] == pytest.approx(comm)  # nothing hidden
    assert times[1.0]["exposed_comm"] < times[0.5]["exposed_comm"] < comm
    assert times[0.5]["exposed_comm"] == pytest.approx(comm / 2)  # the unhideable part, then half the rest
    with pytest.raises(ValueError, match="invalid overlap=1.5"):
        plan(units, 8, overlap=1.5)


def test_the_command_line_takes_a_calibration_and_named_links(tmp_path):
    log = tmp_path / "gpu-check.log"
    log.write_text("\n".join(_log(SPEED, {"check": "speed_graphed", "mfu": 0.36})) + "\n")
    command = [sys.executable, "-m", "mpifsdp", "plan", "--gpt", "n_layer=4", "n_embd=64", "--world", "16",
               "--ranks-per-node", "8", "--device", "cuda", "--compute-bytes", "2", "--intra", "nvlink-h100",
               "--inter", "ib-400g"]  # fmt: skip
    done = subprocess.run([*command, "--calibrate", str(log), "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["setup"]["flops"] == pytest.approx(0.36 * 4 / 3 * 989.4e12)
    assert result["setup"]["group_link"]["bandwidth"] == LINKS["ib-400g"].bandwidth  # 16 ranks span nodes
    assert 0 < result["mfu"]["causal"] < result["mfu"]["palm"] < 0.48
    table = subprocess.run([*command, "--calibrate", str(log)], capture_output=True, text=True).stdout
    assert "mfu (predicted)  PaLM" in table and "calibrated by    NVIDIA H200, gpu13b" in table
    both = subprocess.run(
        [*command, "--calibrate", str(log), "--flops", "1e12"], capture_output=True, text=True
    )
    assert both.returncode == 1 and "without --flops" in both.stderr


def test_the_calibrated_predictions_name_the_comm_bound_cases():
    """bench/scaling_table.py --calibrated --json: a line per model, GPU count (8, 64, 512) and
    sharding; where the communication hides, the predicted MFU is the measured one; flat FSDP of
    GPT-2 1.5B over 64 GPUs at one sequence a GPU is comm-bound, HSDP over one node is not."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scaling_table.py"), "--calibrated", "--json"],
        capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = {
        (r["model"], r["gpus"], r["sharding"], r["batch_per_gpu"]): r
        for r in map(json.loads, done.stdout.splitlines())
    }
    assert {gpus for _, gpus, _, _ in rows} == {8, 64, 512}
    assert rows["GPT-2 1.5B (T=1024)", 64, "FSDP", 1]["comm_bound"]
    assert not rows["GPT-2 1.5B (T=1024)", 64, "HSDP 8", 8]["comm_bound"]
    hidden = rows["13B (T=2048)", 8, "FSDP", 4]
    assert hidden["exposed_comm_share"] < 0.01 and not hidden["recompute"]
    assert hidden["mfu"] == pytest.approx(H200_370M.flops / H200_370M.peak, rel=0.01)
    assert all(r["calibration"] == H200_370M.source for r in rows.values())
