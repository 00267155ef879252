"""Write docs/api.md from the code: every public name with its signature and the first paragraph of
its docstring. `python docs/make_api.py` rewrites the file; tests/project/test_docs.py fails when the
file is not what this script writes (a signature changed and api.md was not regenerated)."""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path

API = Path(__file__).resolve().parent / "api.md"
SECTIONS = [  # (heading, module, names: None = the module's __all__)
    ("import mpifsdp", "mpifsdp", None),
    ("mpifsdp.extend", "mpifsdp.extend", None),
    (
        "mpifsdp.checkpoint",
        "mpifsdp.checkpoint",
        ["save", "load", "save_step", "load_latest", "checkpoints", "verify", "recover"],
    ),
    (
        "mpifsdp.checkpoint.consolidated",
        "mpifsdp.checkpoint.consolidated",
        ["export_safetensors", "load_safetensors", "load_params", "saved_extra", "export_checkpoint"],
    ),
    ("mpifsdp.data", "mpifsdp.data", ["rank_slice", "TextData", "stdlib_corpus_path"]),
    ("mpifsdp.models", "mpifsdp.models", ["gpt_units"]),
    (
        "mpifsdp.planning.planner",
        "mpifsdp.planning.planner",
        ["unit_sizes", "gpt_activation_bytes", "UnitSize", "Link", "probe", "block_flops", "flops_per_step"],
    ),
]
HEAD = """# API reference

Every public name, with its signature and what it is for (the first paragraph of its docstring;
`help(name)` has the rest). Written by `python docs/make_api.py`; `tests/project/test_docs.py` checks
that this file is what the script writes, so every name of `mpifsdp.__all__` and
`mpifsdp.extend.__all__` is here with its current signature.
"""


def entry(name: str, obj) -> str:
    if inspect.ismodule(obj):
        signature, doc = "", f"(module) {inspect.getdoc(obj).split(chr(10) * 2)[0]}"
    else:
        kind = "class " if inspect.isclass(obj) else ""
        try:
            signature = f"`{kind}{name}{inspect.signature(obj, eval_str=True)}`\n\n"
        except (TypeError, ValueError):  # an exception class, a dict
            signature = f"`{kind}{name}`\n\n"
        signature = re.sub(r"<function (\S+) at 0x[0-9a-f]+>", r"<function \1>", signature)  # no addresses
        own = inspect.getdoc(obj) if (inspect.isclass(obj) or callable(obj)) else f"(a {type(obj).__name__})"
        doc = (own or "").split("\n\n")[0]
    return f"### `{name}`\n\n{signature}{' '.join(doc.split())}\n"


def render() -> str:
    parts = [HEAD]
    for heading, module_name, names in SECTIONS:
        module = importlib.import_module(module_name)
        parts.append(f"## `{heading}`\n")
        parts += [entry(name, getattr(module, name)) for name in (names or module.__all__)]
    return "\n".join(parts)


if __name__ == "__main__":
    API.write_text(render())
    sys.exit(0)
