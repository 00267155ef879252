"""The planner's step time, calibrated by what a device measured: its achieved FLOP rate on a model's
step (bench/gpu_check.py speed, one rank or rank 0 of N alone), the share of compute collectives hide
under, and the link figures NCCL publishes. What plan() then predicts are predictions: a rate
measured on one model at one N, carried to other sizes and counts (docs/scaling.md says which).

Why here and not in plan()'s arguments alone: a figure without its source cannot be checked, so a
Calibration carries where it came from, and reads it from the device check's own JSON lines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .planner import RECOMPUTE, Link

# Per GPU, as NCCL's bus bandwidth (a ring moves (S - 1) / S of a collective's bytes per rank at this
# rate): all_gather on 8 H100 SXM over NVLink 4 reaches ~360 GB/s (nccl-tests), one 400 Gb/s
# InfiniBand NIC per GPU 46-48 GB/s. The latencies per ring hop are assumptions, not measured here.
LINKS = {
    "nvlink-h100": Link(2e-6, 360e9),
    "ib-400g": Link(8e-6, 47e9),
}


@dataclass(frozen=True)
class Calibration:
    """A GPU's measured rates. flops: achieved FLOP/s on the step, recomputed forwards counted (the
    hardware's, which plan()'s flops_per_step is in); peak: the dense peak an MFU divides by;
    overlap: the share of compute time collectives hide under (1: all, the schedule's ideal; measured
    only where several GPUs exchange over real links); source: where the figures come from."""

    flops: float
    peak: float
    overlap: float = 1.0
    source: str = ""

    def __post_init__(self):
        if not (self.flops > 0 and self.peak >= self.flops and 0 <= self.overlap <= 1):
            raise ValueError(
                f"Calibration: flops {self.flops} > 0, peak {self.peak} >= flops and overlap "
                f"{self.overlap} in [0, 1] (a rate above the peak is a measurement of something else)"
            )

    @classmethod
    def from_lines(cls, lines, overlap: float = 1.0, config: str | None = None) -> Calibration:
        """From make gpu-check's JSON lines (its log, other lines skipped): the last `speed` line (of
        `config` if given: gpu13b, rank 0 of the 8-way job, is the one that stands for big models)
        and, where a `speed_graphed` line follows that one, the graphed step's rate."""
        speed, graphed, chosen = None, None, False
        for line in lines:
            row = _json_row(line)
            if row.get("check") == "speed":
                chosen = config in (None, row.get("config"))
                speed, graphed = (row, None) if chosen else (speed, graphed)
            elif row.get("check") == "speed_graphed" and chosen:
                graphed = row
        if speed is None or not speed.get("mfu_peak_tflops"):
            raise ValueError(
                "no device speed line to calibrate from (gpu_check.py speed's JSON line, with the GPU's "
                f"peak{f', config {config!r}' if config else ''}): give make gpu-check's log"
            )
        missing = [key for key in ("config", "dtype", "mfu") if key not in speed]
        if missing or "mfu" not in (graphed or speed):
            raise ValueError(f"the speed line to calibrate from lacks {missing or ['mfu']}: {speed}")
        peak = float(speed["mfu_peak_tflops"][speed["dtype"]]) * 1e12
        mfu = float((graphed or speed)["mfu"]) * (RECOMPUTE if speed.get("recompute") else 1.0)
        where = (speed.get("provenance") or {}).get("commit") or "unknown commit"
        run = "from one CUDA graph" if graphed else "eager"
        source = (
            f"{speed.get('gpu', 'a GPU')}, {speed['config']} {speed['dtype']} {run}, "
            f"{speed.get('ranks', 1)} ranks{' (phantom)' if speed.get('phantom') else ''}, at {where}"
        )
        return cls(flops=mfu * peak, peak=peak, overlap=overlap, source=source)


def _json_row(line: str) -> dict:
    """A JSON object's line as a dict; {} for any other line of a log."""
    line = line.strip()
    if not line.startswith("{"):
        return {}
    try:
        row = json.loads(line)
    except ValueError:
        return {}
    return row if isinstance(row, dict) else {}


# The one device measurement there is (no raw line was kept of it): the 370M GPT (d 1024, 24 layers,
# T 1024, batch 8) at 41.9 % of an H200's 989.4 TFLOP/s dense float16 peak, one rank, from one CUDA
# graph, no recompute.
H200_370M = Calibration(
    flops=0.419 * 989.4e12,
    peak=989.4e12,
    source="one H200, 2026-12-04: the 370M GPT at 41.9 % MFU, float16 from one CUDA graph "
    "(bench/HISTORY.md, sixth session)",
)


def attention_flops(config, tokens: int) -> float:
    """The FLOPs of attention's two T x T products in a training step of `tokens` tokens (forward
    and backward, counted whole: 12·L·C·T a token), the share the causal convention halves."""
    return 12 * config.n_layer * config.n_embd * config.block_size * tokens


def mfu(model_flops_per_step: float, attention_flops_per_step: float, step_s: float, peak: float) -> dict:
    """A step's model FLOPs utilisation in both conventions: PaLM's (attention's products counted
    whole, what flops_per_token gives) and the causal one llm.c uses (half of them: a causal mask
    skips the upper triangle). Recomputed forwards are not model FLOPs in either."""
    if not (step_s > 0 and peak > 0):
        return {"palm": None, "causal": None}
    whole = model_flops_per_step / (step_s * peak)
    return {"palm": whole, "causal": whole - attention_flops_per_step / 2 / (step_s * peak)}


__all__ = ["Calibration", "H200_370M", "LINKS", "attention_flops", "mfu"]
