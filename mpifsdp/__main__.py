"""From the shell: `python -m mpifsdp inspect DIR` (or `mpifsdp inspect DIR`), `... export DIR OUT`,
`... plan` (cli/plan.py), `... pictures RUN.jsonl` (observe/pictures.py), `--version`.

inspect: units, sizes, world size, step, and an integrity check of every slice's checksum.
export: one consolidated .safetensors file from a checkpoint, in one process, a slice at a time.
DIR is a checkpoint, or a directory of step-N checkpoints (the newest is taken). Errors are one line
on stderr and exit status 1; an existing OUT is replaced only with --force.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from .checkpoint.consolidated import export_checkpoint
from .checkpoint.manifest import FORMAT, MANIFEST, CheckpointError, read_manifest, verify
from .checkpoint.sharded import checkpoints
from .cli import plan as plan_cli
from .observe import pictures


def _checkpoint_in(path) -> Path:
    """`path` itself if it holds a checkpoint, else the newest step-N checkpoint under it."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory" if path.exists() else f"{path} does not exist")
    if (path / MANIFEST).is_file():
        return path
    found = checkpoints(path)
    if not found:
        raise CheckpointError(f"{path} holds no checkpoint (no {MANIFEST}, and no step-N checkpoint in it)")
    return found[0]


def _export(directory, out, force: bool, form: str = "safetensors") -> Path:
    out = Path(out)
    if form == "hf-gpt2":
        return _export_hf_gpt2(_checkpoint_in(directory), out, force)
    if out.is_dir():
        raise CheckpointError(f"{out} is a directory: give the path of the .safetensors file to write")
    if not out.parent.is_dir():
        raise CheckpointError(f"{out.parent} does not exist: create it first")
    if out.exists() and not force:
        raise CheckpointError(f"{out} exists: pass --force to replace it")
    return export_checkpoint(_checkpoint_in(directory), out)


def _export_hf_gpt2(directory: Path, out: Path, force: bool) -> Path:
    """A train_gpt.py checkpoint (its config in `extra`) as a Hugging Face GPT-2 directory, in one process."""
    import numpy as np

    from .checkpoint.consolidated import load_params
    from .comm.communicator import Comm
    from .fsdp.build import fully_shard
    from .models import GPT, GPTConfig
    from .models.hf_gpt2 import export_hf_gpt2

    if out.exists() and not (force and out.is_dir()):
        raise CheckpointError(
            f"{out} exists: pass --force to replace its files" if out.is_dir() else f"{out} is a file"
        )
    manifest = read_manifest(directory)
    config = manifest["extra"].get("config")
    if not isinstance(config, dict):
        raise CheckpointError(f"{directory} records no model config in its extra (train_gpt.py saves one)")
    unknown = sorted(set(config) - {f.name for f in dataclasses.fields(GPTConfig)})
    if unknown:
        raise CheckpointError(f"{directory}: its model config has fields GPTConfig does not: {unknown}")
    model = GPT(GPTConfig(**config), dtype=np.dtype(manifest["units"][0]["dtype"]))
    fully_shard(model, Comm(threads=None), units=model.blocks)
    load_params(directory, model)
    return export_hf_gpt2(out, model)


def _inspect(directory) -> int:
    directory = _checkpoint_in(directory)
    manifest = read_manifest(directory)
    print(f"{directory}: {FORMAT} v{manifest['version']}, saved by {manifest['world_size']} rank(s)")
    opt = manifest["optimizer"]
    opt_text = f"step {opt['step']}" if opt else "not saved"
    print(f"step {manifest['extra'].get('step', '-')}, optimizer {opt_text}")
    total = 0
    for u in manifest["units"]:
        total += u["numel"]
        print(
            f"  unit {u['name']:<20} {len(u['tensors']):3d} tensors {u['numel']:>12,d} elements {u['dtype']}"
        )
    print(f"  total {total:,d} parameters in {len(manifest['units'])} units")
    try:
        verify(directory)
    except CheckpointError as exc:
        print(f"integrity: FAILED: {exc}")
        return 1
    print(f"integrity: OK ({sum(len(f['segments']) for f in manifest['files'])} checksummed slices)")
    return 0


def main(argv=None) -> int:
    import argparse

    import mpifsdp

    prog = "python -m mpifsdp" if sys.argv[0].endswith("__main__.py") else "mpifsdp"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"mpifsdp {mpifsdp.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("inspect", help="units, sizes, world size, step, integrity").add_argument("dir")
    export = sub.add_parser("export", help="one consolidated .safetensors file")
    export.add_argument("dir")
    export.add_argument("out")
    export.add_argument("--force", action="store_true", help="replace OUT if it exists")
    export.add_argument(
        "--format",
        default="safetensors",
        choices=["safetensors", "hf-gpt2"],
        help="one .safetensors file, or a Hugging Face GPT-2 directory (config.json + model.safetensors)",
    )
    plan_cli.add_arguments(sub.add_parser("plan", help="memory, traffic and step time of a GPT on a cluster"))
    pictures.add_arguments(sub.add_parser("pictures", help="a StepMetrics run's PNGs: loss, throughput, ..."))
    args = parser.parse_args(argv)
    try:
        if args.command == "plan":
            return plan_cli.run_cli(args)
        if args.command == "pictures":
            return pictures.run_cli(args)
        if args.command == "inspect":
            return _inspect(args.dir)
        print(f"wrote {_export(args.dir, args.out, args.force, args.format)}")
        return 0
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
