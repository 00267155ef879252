"""plan(): per-rank memory, bytes per step by level and collective, and a predicted step time, for
any model on any cluster, before a job is queued (`python -m mpifsdp plan`, docs/scaling.md).

Exact where the runtime is measurable: the shard, gradient and optimizer bytes, the gathered peaks
and every big collective's elements use the formulas the runtime's ledgers count
(tests/unit/planning/test_planner.py holds them equal at N = 1..4); the GPT activation bytes are the
tape's, term by term. A model where we cannot measure: the step time, from an alpha-beta model of
each collective (a ring: alpha per hop, bytes over the link's bandwidth) and a FLOP rate, with the
overlap the schedule allows.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from ..base.checks import refuse_below
from ..cuda import attention as gpu_attention
from ..cuda import fused as gpu_fused
from ..fsdp.partition import owned_params
from ..fsdp.policy import OFFLOADS
from ..nn.module import Module
from ..ops import causal_attention as attention


@dataclass(frozen=True)
class Link:
    """One level's links: the latency of one ring hop (s) and each rank's bandwidth (bytes/s)."""

    alpha: float = 10e-6
    bandwidth: float = 25e9

    def __post_init__(self):
        if not (self.alpha >= 0 and self.bandwidth > 0):  # NaN fails both
            raise ValueError(f"Link: alpha {self.alpha} s must be >= 0, bandwidth {self.bandwidth} B/s > 0")

    def ring(self, hops: int, nbytes: float) -> float:
        """Seconds for a ring collective of `hops` steps moving `nbytes` per rank."""
        return hops * self.alpha + nbytes / self.bandwidth if hops else 0.0


@dataclass(frozen=True)
class UnitSize:
    name: str
    numel: int
    trainable: bool = True
    kept: bool = False  # the root: gathered from forward to backward, its scope around the others


def unit_sizes(model: Module, units) -> list[UnitSize]:
    """The units fully_shard(model, units=units) makes, as sizes (the root last, kept): works on a
    model built under deferred_init (shapes only, any size). A GPT's: `mpifsdp.models.gpt_units`."""
    names = {id(m): n for n, m in model.named_modules()}
    ids = {id(u) for u in units}
    sizes = [UnitSize(names[id(u)], sum(p.size for _, p in owned_params(u, "", ids))) for u in units]
    root = sum(p.size for _, p in owned_params(model, "", ids))
    return sizes + [UnitSize("root", root, kept=True)]


def _padded(numel: int, shard_size: int) -> int:
    return -(-numel // shard_size) * shard_size


def gpt_activation_bytes(
    config, batch: int, itemsize: int, recompute: bool = False, device: str = "cpu"
) -> int:
    """Bytes the tape keeps after a GPT forward on `batch` sequences of config.block_size: per block 10 B·T·C
    values (no LayerNorm output on the CPU: layer_norm_linear recomputes it; a GPU keeps both, 12:
    cuda/fused.py, the first padded with a ones column where the qkv bias's gradient comes out of its
    weight's GEMM: folded_row_length there) and 4 per token (LayerNorm statistics: in float32 at least
    on a GPU, cuda/layer_norm.cu), and past the
    attention block (256 positions on the CPU, 1024 on a GPU: ops/causal_attention.py,
    cuda/attention.py) the attention's output and one log-sum-exp per head and token (the blocked path
    keeps them); outside them the final LayerNorm's input (and on a GPU its output), the logits, and per
    token two statistics and the log-sum-exp; on the CPU a one-byte mask per token, on a GPU the int64
    device copies of the host batch (token ids, and targets with their valid count) and positions.
    Checkpointed blocks keep only their input (B·T·C). Equal to autodiff.graph_nbytes
    (tests/unit/planning/test_planner.py; on a GPU's branches, sharded, tools/gpusim/standin_checks.py)."""
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"gpt_activation_bytes: device {device!r} is not 'cpu' or 'cuda[:N]'")
    refuse_below("gpt_activation_bytes", batch=(batch, 1), itemsize=(itemsize, 1))
    B, T, C, H = batch, config.block_size, config.n_embd, config.n_head
    gpu = device != "cpu"
    whole = gpu_attention.BLOCK if gpu else attention.ATTENTION_BLOCK
    norm_outputs = 2 * B * T * C if gpu else 0  # one a layer_norm_linear
    if gpu and config.bias:  # the qkv bias gradient from its weight GEMM: the LayerNorm output padded
        norm_outputs += B * T * (gpu_fused.folded_row_length(C) - C)
    stat = max(itemsize, 4) if gpu else itemsize  # a GPU keeps LayerNorm's statistics in float32 at least
    block = 10 * B * T * C + norm_outputs + (B * T * C + B * H * T if T > whole else 0)
    per_block = B * T * C * itemsize if recompute else block * itemsize + 4 * B * T * stat
    outside = B * T * C + (B * T * C if gpu else 0) + B * T * config.vocab_size + B * T
    indices = 8 * (2 * B * T + T + 1) if gpu else B * T  # the targets' copy ends with their count
    return config.n_layer * per_block + itemsize * outside + 2 * B * T * stat + indices


def gpt_loss_gradient_bytes(config, batch: int, itemsize: int) -> int:
    """The loss's gradient as backward starts, the logits' (B·T·vocab): alive beside every activation
    the tape keeps, and the largest of backward's temporaries (bench/HISTORY.md: the 370M GPT's)."""
    refuse_below("gpt_loss_gradient_bytes", batch=(batch, 1), itemsize=(itemsize, 1))
    return batch * config.block_size * config.vocab_size * itemsize


def plan(
    units: list[UnitSize],
    world_size: int,
    *,
    shard_size: int | None = None,
    ranks_per_node: int | None = None,
    itemsize: int = 4,
    compute_itemsize: int | None = None,
    gpu: bool = False,
    prefetch: int = 1,
    reshard_after_forward: bool = True,
    grad_accum: int = 1,
    no_sync: bool = False,
    activation_bytes: int = 0,
    loss_gradient_bytes: int = 0,
    flops_per_step: float = 0.0,
    flops: float = 0.0,
    intra: Link = Link(),
    inter: Link = Link(),
    overlap: float = 1.0,
) -> dict:
    """Per-rank memory (bytes), elements and bytes per optimizer step by level and collective, and
    the predicted step time, for `units` sharded over `world_size` ranks (see the module docstring).

    itemsize: of the shards, gradient shards and AdamW state (fp32 masters: 4); compute_itemsize: of
    what is gathered and communicated (fully_shard's param_dtype = reduce_dtype, e.g. 2 for
    bfloat16; default itemsize). gpu: the GPU's runtime, which gathers 16-bit parameters' gradients
    in float32 (Unit.full_grad_dtype), binds the next unit's gradient before its backward (one
    more alive, UnitLifecycle.bind_grads_ahead) and keeps each resharded unit's param_dtype cast
    of its shard (Unit.cast_target); reduced in float32 there, on one rank a unit's full gradient
    is its gradient shard and a block's gathered parameters its kept cast (Unit._grad_is_whole,
    Unit._gathers_nothing). Exact against the ledgers with one dtype, and on a GPU with
    param_dtype narrower than the masters (tools/gpusim/standin_checks.py).
    shard_size: HSDP groups (None: every rank); ranks_per_node decides which links a level crosses.
    flops_per_step: this rank's training FLOPs per step (all micro-batches); flops: its FLOP/s.
    activation_bytes: what the tape keeps (gpt_activation_bytes); loss_gradient_bytes: what backward
    holds beside it at its start (gpt_loss_gradient_bytes).
    overlap: the share of the compute time collectives can hide under (1: all of it, as the schedule
    allows; a measured share from planning/calibration.py).
    """
    _refuse(locals())
    S = shard_size or world_size
    if world_size % S:
        raise ValueError(f"shard_size {S} must divide world_size {world_size}")
    node, wire = ranks_per_node or world_size, compute_itemsize or itemsize
    sizes = _Sizes(units, S, world_size // S, wire, reshard_after_forward, grad_accum, no_sync, gpu)
    group_link = intra if S <= node else inter  # a group within a node, or spanning nodes
    replica_link = inter if world_size > node else intra
    setup = {
        "world_size": world_size,
        "shard_size": S,
        "replicas": world_size // S,
        "ranks_per_node": node,
        "units": len(units),
        "params": sum(u.numel for u in units),
        "itemsize": itemsize,
        "compute_itemsize": wire,
        "grad_itemsize": sizes.grad_itemsize,
        "prefetch": prefetch,
        "reshard_after_forward": reshard_after_forward,
        "grad_accum": grad_accum,
        "no_sync": no_sync,
        "flops": flops,
        "overlap": overlap,
        "group_link": dataclasses.asdict(group_link),
        "replica_link": dataclasses.asdict(replica_link),
        "largest_shard": max(sizes.shard, default=0),  # elements: offload="disk"'s buffers are this size
    }
    return {
        "setup": setup,
        "memory_bytes": sizes.memory(itemsize, prefetch, activation_bytes, loss_gradient_bytes),
        "traffic": sizes.traffic(),
        "time_s": sizes.seconds(group_link, replica_link, flops_per_step / flops if flops else 0.0, overlap),
    }


def offloaded(result: dict, kind: str) -> dict:
    """plan()'s memory with `kind` of offload (OFFLOADS): {"device": categories and total, "host":
    bytes, "disk": bytes}. "device" is the rank's compute memory (a CPU's own for "disk")."""
    memory, setup = dict(result["memory_bytes"]), result["setup"]
    itemsize, wire = setup["itemsize"], setup["compute_itemsize"]
    shard_elements, moments = memory["param_shards"] // itemsize, memory["optimizer"]
    host = disk = 0
    if kind == "disk":
        memory["optimizer"], disk = 2 * 2 * setup["largest_shard"] * itemsize, moments
    elif kind in ("optimizer", "optimizer+params"):
        host = memory["param_shards"] + moments + memory["grad_shards"]  # masters, moments, the grads' copy
        memory["param_shards"], memory["optimizer"] = wire * shard_elements, 0
        if kind == "optimizer+params":
            host, memory["param_shards"] = host + memory["param_shards"], 0
    else:
        raise ValueError(f"offload must be one of {tuple(OFFLOADS)}, got {kind!r}")
    memory["total"] = sum(v for k, v in memory.items() if k != "total")
    return {"device": memory, "host": host, "disk": disk}


def _refuse(given: dict):
    """plan()'s arguments it cannot plan for, named (before anything is computed)."""
    at_least = dict(world_size=1, shard_size=1, ranks_per_node=1, itemsize=1, compute_itemsize=1, prefetch=0)
    at_least.update(grad_accum=1, activation_bytes=0, loss_gradient_bytes=0, flops_per_step=0, flops=0)
    optional = ("shard_size", "ranks_per_node", "compute_itemsize")  # None: the default
    refuse_below(
        "plan", **{k: ((given[k] or 1) if k in optional else given[k], v) for k, v in at_least.items()}
    )
    if not 0 <= given["overlap"] <= 1:  # NaN fails too
        raise ValueError(
            f"plan: invalid overlap={given['overlap']!r} (the share of compute collectives hide under, 0-1)"
        )


class _Sizes:
    """One plan's units as padded sizes and shards over groups of S ranks (R groups), and what they
    hold, move and cost: plan()'s three parts."""

    def __init__(self, units, S, R, wire, reshard_after_forward, grad_accum, no_sync, gpu):
        self.S, self.R, self.wire, self.gpu = S, R, wire, gpu
        # a GPU: gradients of 16-bit parameters gathered in float32, three units' alive at once
        self.grad_itemsize, self.grads_alive = (4 if wire == 2 else wire, 3) if gpu else (wire, 2)
        self.kept = [u.kept or not reshard_after_forward for u in units]
        self.outer = [u.kept for u in units]  # the root: its scope spans every other unit's backward
        self.padded = [_padded(u.numel, S) for u in units]
        self.shard = [p // S for p in self.padded]
        self.trainable = [u.trainable for u in units]
        self.gathers = [1 if k else 2 for k in self.kept]  # a kept unit skips its backward gather
        self.grad_accum, self.no_sync = grad_accum, no_sync
        self.reductions = grad_accum if not no_sync else 1

    def memory(self, itemsize: int, prefetch: int, activation_bytes: int, loss_gradient_bytes: int) -> dict:
        padded, kept, trainable = self.padded, self.kept, self.trainable
        blocks = [p for p, k in zip(padded, kept) if not k]
        accumulating = self.grad_accum > 1 and not self.no_sync
        trained = sum(s for s, t in zip(self.shard, trainable) if t)
        # a GPU keeps each resharded unit's param_dtype cast of its shard from gather to gather (the
        # optimizer writes the next one there: Unit.cast_target)
        casts = sum(s for s, k in zip(self.shard, kept) if not k) if self.gpu and self.wire != itemsize else 0
        # one rank's gathered parameters are that cast itself (Unit._gathers_nothing)
        live = 0 if casts and self.S == 1 else _live(blocks, prefetch)
        # one GPU rank: a unit's full gradient is its gradient shard while that holds no earlier
        # micro-batch's (Unit._grad_is_whole)
        whole = self.gpu and self.S == self.R == 1 and self.grad_itemsize == itemsize and not accumulating
        grads = (
            0
            if whole
            else _grads_peak(
                padded, self.shard, self.outer, trainable, accumulating, self.no_sync, self.grads_alive
            )
        )
        memory = {
            "param_shards": itemsize * sum(self.shard),
            "grad_shards": itemsize * trained,
            "optimizer": 2 * itemsize * trained,  # AdamW: m and v
            "gathered_params_peak": self.wire * (sum(p for p, k in zip(padded, kept) if k) + live + casts),
            "gathered_grads_peak": self.grad_itemsize * grads,
            "activations": activation_bytes,
            "loss_gradient": loss_gradient_bytes,
        }
        memory["total"] = sum(memory.values())
        return memory

    def traffic(self) -> dict:
        S, R, trained = self.S, self.R, [s for s, t in zip(self.shard, self.trainable) if t]
        in_group = {
            "all_gather": self.grad_accum * sum(g * (S - 1) * s for g, s in zip(self.gathers, self.shard)),
            "reduce_scatter": self.reductions * sum((S - 1) * s for s in trained),
        }
        across = {"all_reduce": self.reductions * sum(2 * (R - 1) * s // R for s in trained)}
        return {
            "elements": {"in_group": in_group, "across_groups": across},
            "bytes": {
                "in_group": {k: v * self.wire for k, v in in_group.items()},
                "across_groups": {k: v * self.wire for k, v in across.items()},
            },
        }

    def seconds(self, group_link: Link, replica_link: Link, compute: float, overlap: float = 1.0) -> dict:
        S, R, wire = self.S, self.R, self.wire

        def gather_s(p):  # one all_gather or reduce_scatter of a unit padded to p, inside the group
            return group_link.ring(S - 1, wire * (S - 1) * (p // S))

        def all_reduce_s(p):  # one all-reduce of its gradient shard across the groups
            return replica_link.ring(2 * (R - 1), wire * (2 * (R - 1) * (p // S) // R)) if R > 1 else 0.0

        trained = [p for p, t in zip(self.padded, self.trainable) if t]
        comm_group = self.grad_accum * sum(g * gather_s(p) for g, p in zip(self.gathers, self.padded))
        comm_group += self.reductions * sum(gather_s(p) for p in trained)
        comm_across = self.reductions * sum(all_reduce_s(p) for p in trained)
        # Overlap: each unit's gathers, reduce-scatter and all-reduce across groups run while other units
        # compute (the `overlap` share of it), except the first unit's gather of each micro-batch and
        # the last reduction of a step.
        largest = max(self.padded, default=0)
        fixed = self.grad_accum * gather_s(largest) + self.reductions * (
            gather_s(largest) + all_reduce_s(largest)
        )
        total = comm_group + comm_across
        exposed = min(fixed, total) + max(0.0, total - fixed - overlap * compute)
        return {
            "compute": compute,
            "comm_in_group": comm_group,
            "comm_across_groups": comm_across,
            "exposed_comm": exposed,
            "step": compute + exposed,
        }


def _live(blocks: list[int], prefetch: int) -> int:
    """Resharded units gathered at once: the running one and up to `prefetch` ahead (largest first)."""
    return sum(sorted(blocks, reverse=True)[: 1 + prefetch])


def _grads_peak(padded, shard, outer, trainable, accumulating: bool, no_sync: bool, alive: int) -> int:
    """Full gradients at once in backward: the outer units' (the root: its scope spans the others),
    the unit running and the one whose reduce-scatter is still in flight (`alive` = 2; 3 on a GPU:
    the next unit's, bound ahead); with no_sync, every unit's. A reduce-scatter into a shard that
    already holds a gradient (accumulating micro-batches) receives into a shard-sized temporary
    first: two of those are alive, the running unit's and the one in flight."""
    full = [p for p, t in zip(padded, trainable) if t]
    if no_sync:
        return sum(full)
    enclosing = sum(p for p, o, t in zip(padded, outer, trainable) if o and t)
    inner = sorted(
        ((p, s) for p, s, o, t in zip(padded, shard, outer, trainable) if t and not o), reverse=True
    )
    temporaries = sum(s for _, s in inner[:2]) if accumulating else 0
    return enclosing + sum(p for p, _ in inner[:alive]) + temporaries


def probe(comm, sizes=(1 << 12, 1 << 16, 1 << 20, 1 << 22), repeats: int = 5) -> dict:
    """alpha and bandwidth of Allgather and Reduce_scatter on `comm` (collective), from the median
    time at several sizes fitted to t = hops * alpha + bytes moved / bandwidth."""
    if comm.size == 1:
        return {}
    fits = {}
    for op in ("all_gather", "reduce_scatter"):
        rows = [(comm.size - 1, (comm.size - 1) * n, _median_seconds(comm, op, n, repeats)) for n in sizes]
        hops, moved, seconds = (np.array(c, dtype=float) for c in zip(*rows))
        (alpha, inverse_bw), *_ = np.linalg.lstsq(np.stack([hops, moved], axis=1), seconds, rcond=None)
        fits[op] = {"alpha": max(float(alpha), 0.0), "bandwidth": 1.0 / max(float(inverse_bw), 1e-15)}
    return fits


def _median_seconds(comm, op: str, nbytes: int, repeats: int) -> float:
    shard = np.ones(max(1, nbytes // 4), dtype=np.float32)
    full = np.empty(shard.size * comm.size, dtype=np.float32)
    times = []
    for _ in range(repeats):
        comm.barrier()
        start = time.perf_counter()
        if op == "all_gather":
            comm.all_gather(shard, full, phase="probe")
        else:
            comm.reduce_scatter(full, shard, phase="probe")
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def gemm_flops(repeats: int = 3, n: int = 1024) -> float:
    """This process's fp32 GEMM rate (FLOP/s), for --probe: the compute side of a step."""
    a = np.ones((n, n), dtype=np.float32)
    a @ a  # warm
    start = time.perf_counter()
    for _ in range(repeats):
        a @ a
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def block_flops(config, batch: int, repeats: int = 2) -> float:
    """The FLOP rate one transformer block's forward and backward achieves here (training FLOPs per
    second, as flops_per_token counts them): what a step runs at, elementwise passes and all, where
    gemm_flops is only its GEMMs' ceiling. For --probe; builds one block of the config's width."""
    from ..autodiff.tensor import Tensor
    from ..nn.layers import Block

    rng = np.random.default_rng(0)
    block = Block(config.n_embd, config.n_head, rng=rng, dtype=np.float32, device="cpu")
    x = Tensor(rng.standard_normal((batch, config.block_size, config.n_embd), dtype=np.float32), True)
    params = sum(p.size for p in block.parameters())
    tokens = batch * config.block_size
    work = (6 * params + 12 * config.n_embd * config.block_size) * tokens
    (block(x) * 1.0).sum().backward()  # warm
    start = time.perf_counter()
    for _ in range(repeats):
        (block(x) * 1.0).sum().backward()
    return work * repeats / (time.perf_counter() - start)


RECOMPUTE = 4 / 3  # a training step's FLOPs with every block's forward run again: one forward (1/3) more


def flops_per_step(model, block_size: int, tokens: int, recompute: bool = False) -> float:
    """Training FLOPs of `tokens` tokens (GPT.flops_per_token); recomputing adds one forward (1/3)."""
    per_token = model.flops_per_token(block_size)
    return per_token * tokens * (RECOMPUTE if recompute else 1)
