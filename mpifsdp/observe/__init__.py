"""Observability: StepMetrics, one JSON line per step from the ledgers (metrics.py), and those lines
drawn as pictures (pictures.py: `python -m mpifsdp pictures RUN.jsonl`).

May import: fsdp, base. It reads the runtime; nothing below imports it.
"""

from .metrics import StepMetrics

__all__ = ["StepMetrics"]
