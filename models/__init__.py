"""Reference models built only from mpifsdp's public API (installed as `mpifsdp.models`)."""

from .gpt import GPT, GPTConfig, gpt_units
from .mlp import MLPClassifier

__all__ = ["GPT", "GPTConfig", "MLPClassifier", "gpt_units"]
