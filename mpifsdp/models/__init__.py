"""Reference models (GPT, an MLP classifier, the Hugging Face GPT-2 bridge), built on the library and
above it: inside mpifsdp only the command lines (cli/, __main__.py) import them."""

from .gpt import GPT, GPTConfig, gpt_units
from .mlp import MLPClassifier

__all__ = ["GPT", "GPTConfig", "MLPClassifier", "gpt_units"]
