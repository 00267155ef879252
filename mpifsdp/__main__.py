"""Checkpoint tools from the shell: `python -m mpifsdp inspect DIR`, `python -m mpifsdp export DIR OUT`.

inspect: units, sizes, world size, step, and an integrity check of every slice's checksum.
export: one consolidated .safetensors file from a checkpoint, in one process, a slice at a time.
"""

from __future__ import annotations

from .checkpoint import FORMAT, CheckpointError, read_manifest, verify
from .consolidated import export_checkpoint


def _inspect(directory) -> int:
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

    parser = argparse.ArgumentParser(prog="python -m mpifsdp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("inspect", help="units, sizes, world size, step, integrity").add_argument("dir")
    export = sub.add_parser("export", help="one consolidated .safetensors file")
    export.add_argument("dir")
    export.add_argument("out")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            return _inspect(args.dir)
        print(f"wrote {export_checkpoint(args.dir, args.out)}")
        return 0
    except CheckpointError as exc:
        print(f"error: {exc}")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
