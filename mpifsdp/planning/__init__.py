"""plan(): memory, traffic and step time of any model on any cluster, before a job runs; the probes
that measure this machine's links and FLOP rate; the step time calibrated by a device's measurements.

May import: fsdp (which parameters a unit owns), nn, cuda (what a GPU keeps), ops, autodiff, base.
It sizes a model it is given; a GPT's units come from `mpifsdp.models.gpt_units`.
"""

from .calibration import LINKS, Calibration
from .planner import Link, UnitSize, plan

__all__ = ["LINKS", "Calibration", "Link", "UnitSize", "plan"]
