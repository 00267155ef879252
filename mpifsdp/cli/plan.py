"""`python -m mpifsdp plan`: the planner's command line. Its arguments, their checks (a bad value
is an error that names it, never a table of plausible numbers), and the table it prints."""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from ..base.checks import yes_or_no
from ..planning.calibration import LINKS, Calibration, attention_flops, mfu
from ..planning.planner import (
    OFFLOADS,
    Link,
    block_flops,
    flops_per_step,
    gemm_flops,
    gpt_activation_bytes,
    gpt_loss_gradient_bytes,
    offloaded,
    plan,
    probe,
)


def add_arguments(parser):
    parser.add_argument("--gpt", nargs="*", default=[], metavar="KEY=VALUE", help="GPTConfig fields")
    parser.add_argument("--world", type=int, default=0, help="ranks (default: this job's size)")
    parser.add_argument("--ranks-per-node", type=int, default=0, help="default: this job's")
    parser.add_argument("--shard-size", default="", help="HSDP group size, or 'node' (default: every rank)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per micro-batch")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--no-sync", action="store_true", help="accumulate unreduced (no_sync)")
    parser.add_argument(
        "--recompute",
        "--checkpoint",
        action="store_true",
        help="activation recomputation (--checkpoint: its old name)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda: where the model computes")
    parser.add_argument("--dtype", default="float32", help="shards, gradient shards, optimizer state")
    parser.add_argument("--compute-bytes", type=int, default=0, help="per gathered element (2: bfloat16)")
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--keep-gathered", action="store_true", help="reshard_after_forward=False")
    links = ", ".join(LINKS)
    parser.add_argument(
        "--intra", default="10e-6,25e9", help=f"ALPHA_S,BYTES_PER_S inside a node, or {links}"
    )
    parser.add_argument(
        "--inter", default="10e-6,25e9", help=f"ALPHA_S,BYTES_PER_S between nodes, or {links}"
    )
    parser.add_argument("--flops", type=float, default=0.0, help="FLOP/s per rank")
    parser.add_argument(
        "--calibrate", default="", help="make gpu-check's log: the FLOP/s its last speed line measured"
    )
    parser.add_argument(
        "--calibrate-config", default=None, help="--calibrate: the last speed line of this config"
    )
    parser.add_argument("--overlap", type=float, default=1.0, help="share of compute collectives hide under")
    parser.add_argument("--memory", type=float, default=0.0, help="bytes per device: say whether it fits")
    parser.add_argument(
        "--offload", default=None, help="optimizer, optimizer+params or disk: the memory with it (host, disk)"
    )
    parser.add_argument("--probe", action="store_true", help="measure links and FLOP/s on this job first")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")


def table(result: dict) -> str:
    """The plan as a few readable lines (MiB, GiB/s, seconds)."""
    mem, t, tr = result["memory_bytes"], result["time_s"], result["traffic"]["bytes"]
    lines = [f"setup: {result['setup']}"]
    lines += [f"memory per rank  {k:22s} {v / 2**20:12.1f} MiB" for k, v in mem.items()]
    for level, ops in tr.items():
        lines += [f"bytes per step   {level:13s} {op:14s} {v / 2**20:12.1f} MiB" for op, v in ops.items()]
    lines += [f"time             {k:22s} {v:12.4f} s" for k, v in t.items()]
    if not result["setup"]["flops"]:  # no compute rate: the step is its communication alone
        lines[-5] = f"time             {'compute':22s}      unknown (give --flops FLOP_PER_S, or --probe)"
        lines[-1] = f"time             {'step':22s} >= {t['step']:9.4f} s (communication alone)"
    if "mfu" in result:  # --calibrate: a predicted MFU in both conventions, and what it rests on
        lines.append(
            f"mfu (predicted)  PaLM {result['mfu']['palm']:.1%}, causal {result['mfu']['causal']:.1%}"
        )
        lines.append(f"calibrated by    {result['setup']['calibration']}")
    if "offload" in result:  # --offload: the compute memory with it, and what went to the host or disk
        off = result["offload"]
        lines.append(f"with offload={off['kind']!r}: {OFFLOADS[off['kind']]}")
        lines += [f"  {where:15s} {off[where] / 2**20:12.1f} MiB" for where in ("host", "disk")]
        lines.append(f"  {'compute memory':15s} {off['device']['total'] / 2**20:12.1f} MiB")
    if "fits" in result:  # --memory: say whether it fits, not only in --json
        verdict = "fits" if result["fits"] else "DOES NOT FIT"
        lines.append(f"memory per rank  {verdict} in --memory ({mem['total'] / 2**20:.1f} MiB needed)")
        if "fits_with" in result:
            lines.append(f"memory per rank  {result['fits_with']}")
    return "\n".join(lines)


def run_cli(args) -> int:
    config = _gpt_config(args.gpt)
    intra, inter = _link("--intra", args.intra), _link("--inter", args.inter)
    _check_flags(args)
    calibration = _calibration(args)
    world, per_node, rank, measured = _this_job(args, config)
    flops = calibration.flops if calibration else measured.get("flops", args.flops)
    if "all_gather" in measured:  # one machine here: both levels are its links
        intra = inter = Link(measured["all_gather"]["alpha"], measured["all_gather"]["bandwidth"])
    shard_size = per_node if args.shard_size == "node" else int(args.shard_size or 0) or None
    from mpifsdp.models import gpt_units

    units, model = gpt_units(config)
    itemsize = np.dtype(args.dtype).itemsize
    tokens, wire = args.grad_accum * args.batch * config.block_size, args.compute_bytes or itemsize
    result = plan(
        units,
        world,
        shard_size=shard_size,
        ranks_per_node=per_node,
        itemsize=itemsize,
        compute_itemsize=wire,
        gpu=args.device == "cuda",
        prefetch=args.prefetch,
        reshard_after_forward=not args.keep_gathered,
        grad_accum=args.grad_accum,
        no_sync=args.no_sync,
        flops=flops,
        intra=intra,
        inter=inter,
        overlap=args.overlap,
        **_beside_the_units(config, args, wire),
        flops_per_step=flops_per_step(model, config.block_size, tokens, args.recompute),
    )
    result["setup"]["gpt"] = dataclasses.asdict(config)
    if calibration:
        _predicted_mfu(result, calibration, config, model, tokens)
    result.update({"probe": measured} if measured else {})
    _offload_lines(result, args)
    if rank == 0:
        print(json.dumps(result) if args.json else table(result))
    return 0


def _offload_lines(result: dict, args):
    """--offload's memory, and with --memory whether it fits: where it does not, the first offload
    with which it would (a GPU's before a CPU's disk), said as such."""
    if args.offload:
        result["offload"] = {"kind": args.offload, **offloaded(result, args.offload)}
    if not args.memory:
        return
    result["fits"] = result["memory_bytes"]["total"] <= args.memory
    if result["fits"]:
        return
    kinds = _offloads_for(args.device)
    for kind in kinds:
        need = offloaded(result, kind)["device"]["total"]
        if need <= args.memory:
            would = "would fit" if args.device == "cuda" else "fits"  # a GPU's are not built yet
            result["fits_with"] = f"{would} with offload={kind!r} ({need / 2**20:.1f} MiB): {OFFLOADS[kind]}"
            return
    result["fits_with"] = f"does not fit even with offload={kinds[-1]!r} ({need / 2**20:.1f} MiB)"


def _offloads_for(device: str) -> tuple:
    """The offloads a device's model would take: a GPU's host memory, a CPU's disk."""
    return ("optimizer", "optimizer+params") if device == "cuda" else ("disk",)


def _this_job(args, config) -> tuple[int, int, int, dict]:
    """(ranks, ranks per node, this rank, what --probe measured): as given, else this MPI job's (a
    Comm is made only where something is not given, or --probe asks)."""
    world, per_node = args.world, args.ranks_per_node
    if world and per_node and not args.probe:
        return world, per_node, 0, {}
    from ..comm.communicator import Comm

    comm = Comm()
    measured = _probe(comm, config, args.batch) if args.probe else {}
    return world or comm.size, per_node or comm.node_size, comm.rank, measured


def _predicted_mfu(result: dict, calibration, config, model, tokens: int):
    """The step's model FLOPs over the calibrated peak, in both conventions, and what it rests on."""
    model_flops = flops_per_step(model, config.block_size, tokens)
    result["mfu"] = mfu(
        model_flops, attention_flops(config, tokens), result["time_s"]["step"], calibration.peak
    )
    result["setup"]["calibration"] = calibration.source


def _beside_the_units(config, args, wire: int) -> dict:
    """What a GPT step holds beside its units: the activations its tape keeps, and the loss's gradient
    beside them as backward starts."""
    return {
        "activation_bytes": gpt_activation_bytes(config, args.batch, wire, args.recompute, args.device),
        "loss_gradient_bytes": gpt_loss_gradient_bytes(config, args.batch, wire),
    }


_KINDS = {"int": "an integer", "float": "a number", "bool": "a yes or a no (true/false, 1/0, yes/no, on/off)"}


def _probe(comm, config, batch: int) -> dict:
    """This machine's links (all_gather's fit), a block's FLOP rate and a GEMM's, measured."""
    measured = probe(comm)
    measured["flops"] = block_flops(config, batch)
    measured["gemm_flops"] = gemm_flops()
    return measured


def _gpt_config(pairs):
    """The GPTConfig of --gpt KEY=VALUE pairs, each field parsed as its type."""
    from mpifsdp.models import GPTConfig

    fields = {f.name: f.type for f in dataclasses.fields(GPTConfig)}
    malformed = [item for item in pairs if "=" not in item]
    if malformed:
        raise ValueError(f"--gpt {' '.join(malformed)}: give KEY=VALUE pairs (--gpt n_layer=12 n_embd=768)")
    values = dict(item.split("=", 1) for item in pairs)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"--gpt: unknown fields {unknown}; GPTConfig has {sorted(fields)}")
    return GPTConfig(**{k: _parse(k, fields[k], v) for k, v in values.items()})


def _check_flags(args):
    """Every flag is checked before --probe measures anything."""
    if args.offload is not None and args.offload not in _offloads_for(args.device):
        raise ValueError(
            f"--offload {args.offload}: on --device {args.device}, one of {_offloads_for(args.device)} "
            "(a GPU offloads to host memory, a CPU to disk)"
        )
    if not args.memory >= 0:
        raise ValueError(f"--memory {args.memory}: give the device's bytes (0: do not check the fit)")
    if args.shard_size not in ("", "node") and not (args.shard_size.isdigit() and int(args.shard_size) >= 1):
        raise ValueError(f"--shard-size {args.shard_size}: give a group size (ranks, >= 1) or 'node'")
    if args.dtype not in ("float16", "float32", "float64"):
        raise ValueError(f"--dtype {args.dtype}: the shards' dtype is float16, float32 or float64")
    if args.batch < 1:  # before --probe times a block on it
        raise ValueError(f"--batch {args.batch}: sequences per rank per micro-batch, >= 1")
    if args.compute_bytes < 0:
        raise ValueError(
            f"--compute-bytes {args.compute_bytes}: bytes per gathered element (2, 4; 0: --dtype's)"
        )
    if not 0 <= args.overlap <= 1:
        raise ValueError(f"--overlap {args.overlap}: the share of compute collectives hide under, 0 to 1")
    if args.calibrate and (args.flops or args.probe):
        raise ValueError("--calibrate gives the FLOP rate: give it without --flops and --probe")
    if args.grad_accum < 1 or args.prefetch < 0:
        raise ValueError(f"--grad-accum {args.grad_accum} (>= 1), --prefetch {args.prefetch} (>= 0)")


def _parse(name: str, kind, text: str):
    """A GPTConfig field's value from its text (its annotations are strings: postponed evaluation)."""
    kind = getattr(kind, "__name__", kind)
    try:
        if kind == "bool":
            return yes_or_no(text)
        return float(text) if kind == "float" else int(text)
    except ValueError:
        raise ValueError(f"--gpt {name}={text}: {name} takes {_KINDS.get(kind, kind)}") from None


def _calibration(args) -> Calibration | None:
    """The measured rate --calibrate names (with --overlap), or None."""
    if not args.calibrate:
        return None
    with open(args.calibrate) as log:
        return Calibration.from_lines(log, overlap=args.overlap, config=args.calibrate_config)


def _link(flag: str, spec: str) -> Link:
    """A Link from ALPHA_S,BYTES_PER_S, or one of NCCL's published figures by name (LINKS)."""
    if spec in LINKS:
        return LINKS[spec]
    try:
        alpha, bandwidth = (float(part) for part in spec.split(","))
    except ValueError:
        raise ValueError(
            f"{flag} {spec}: give ALPHA_S,BYTES_PER_S, e.g. 10e-6,25e9, or one of {list(LINKS)}"
        ) from None
    return Link(alpha, bandwidth)
