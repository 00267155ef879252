"""Train a GPT on byte-level text, sharded over MPI ranks with mpifsdp. Reads top to bottom.

    mpiexec -n 2 python -m mpi4py examples/train_gpt.py              # the stdlib corpus, 2 ranks
    mpiexec -n 4 python -m mpi4py examples/train_gpt.py --max_steps 2000 --n_layer 6 --data my.txt
    python examples/train_gpt.py --device cuda                        # one process on a GPU
    mpiexec -n 2 python -m mpi4py examples/train_gpt.py --grad_accum 4 --accum_sync no_sync

Any TrainConfig field is a flag. Rank 0 prints, with a tqdm progress bar on stderr where tqdm is
installed (also under mpiexec, where stdout is no TTY); the last line of stdout is one JSON object with
the results. --metrics run.jsonl writes a line per step; `python -m mpifsdp pictures run.jsonl` draws it.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import logging
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import mpifsdp
from mpifsdp import checkpoint, sharded_model
from mpifsdp.base.accounting import mib, peak_rss_bytes
from mpifsdp.base.checks import yes_or_no
from mpifsdp.data import TextData, rank_slice
from mpifsdp.models import GPT, GPTConfig
from mpifsdp.observe import pictures


@dataclass
class TrainConfig(GPTConfig):
    """The model's GPTConfig fields (byte tokens: vocab 256; a smaller context), then training's own."""

    block_size: int = 64  # the longest context, in tokens
    data: str = ""  # a text file; empty: the Python standard library's sources
    # optimization
    batch_size: int = 32  # global, per micro-batch: split evenly over the ranks
    grad_accum: int = 1  # micro-batches per step: a step sees grad_accum * batch_size sequences
    accum_sync: str = "reduce"  # "reduce": reduce-scatter each micro-batch; "no_sync": only the last
    recompute: bool = False  # activation checkpointing: each block re-runs its forward in backward
    max_steps: int = 1000  # the run's last step (a resumed run continues to it)
    lr: float = 3e-3  # AdamW's peak learning rate, after warmup
    min_lr: float = 3e-4  # the learning rate the cosine decay ends at, at max_steps
    warmup_steps: int = 100  # steps of linear warmup from 0 to lr
    weight_decay: float = 0.1  # AdamW's decoupled weight decay, on matrices only
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    grad_clip: float = 1.0  # the global gradient norm is clipped to this
    # evaluation and logging
    eval_every: int = 200  # steps between validation losses
    eval_batches: int = 8  # batches a validation loss averages
    log_every: int = 10  # steps between progress lines
    metrics: str = ""  # a file for one JSON line per step (loss, lr, norm, time split, memory, bytes)
    sample_tokens: int = 200  # tokens sampled from the model at the end
    # checkpoints
    save_every: int = 0  # steps between checkpoints; 0: none
    save_dir: str = "out/checkpoints"  # the root of the step-N checkpoints (shared by every rank)
    keep: int = 3  # complete checkpoints kept
    resume: str = ""  # a checkpoint directory, or "latest" (the newest intact one in save_dir)
    fresh: bool = False  # start over although save_dir holds checkpoints (they will be replaced)
    # system
    seed: int = 1337  # the model's initial values and the batches' order
    device: str = "cpu"  # "cpu" or "cuda" (each rank takes GPU node-rank mod GPUs)
    transport: str = ""  # GPU collectives: "nccl", "cuda-aware-mpi" or "host"; empty: mpifsdp chooses
    dtype: str = "float32"  # the parameters', gradients' and AdamW's: float32 or float64
    param_dtype: str = ""  # compute in float16 (with a loss scaler) or bfloat16; empty: in --dtype
    graphs: bool = False  # each step's forward and backward replayed from one CUDA graph (cuda, NCCL)
    log_level: str = "warning"  # mpifsdp's log lines shown: debug, info, warning or error


def field_help() -> dict:
    """Each config field's help: the comment after it in TrainConfig or GPTConfig (one text, read
    where it is written)."""
    found = {}
    for kind in (GPTConfig, TrainConfig):  # TrainConfig's own words last: they win
        for line in inspect.getsource(kind).splitlines():
            if match := re.match(r"\s+(\w+): [\w\[\]| ]+ = [^#]+#\s*(.+)$", line):
                found[match[1]] = match[2].strip()
    return found


def parse_config() -> TrainConfig:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    helps = field_help()
    for f in dataclasses.fields(TrainConfig):
        kind = yes_or_no if f.type in (bool, "bool") else type(f.default)
        flags = {f"--{f.name}", f"--{f.name.replace('_', '-')}"}
        words = f"{helps[f.name]} " if f.name in helps else ""
        parser.add_argument(
            *sorted(flags), dest=f.name, type=kind, default=f.default, help=f"{words}(default: {f.default})"
        )
    try:
        cfg = TrainConfig(**vars(parser.parse_args()))  # GPTConfig checks the model's fields
    except ValueError as error:
        parser.error(str(error))
    least = dict(batch_size=1, grad_accum=1, log_every=1, eval_every=1, eval_batches=1, max_steps=0,
                 warmup_steps=0, save_every=0, keep=0, sample_tokens=0)  # fmt: skip
    wrong = [f"--{k} {getattr(cfg, k)} (must be >= {v})" for k, v in least.items() if getattr(cfg, k) < v]
    if cfg.accum_sync not in ("reduce", "no_sync"):
        wrong.append(f"--accum_sync {cfg.accum_sync!r} (reduce or no_sync)")
    if not cfg.grad_clip > 0:
        wrong.append(f"--grad_clip {cfg.grad_clip} (must be > 0)")
    if cfg.dtype not in ("float32", "float64"):
        wrong.append(f"--dtype {cfg.dtype!r} (float32 or float64: the parameters', gradients' and AdamW's)")
    if cfg.seed < 0:
        wrong.append(f"--seed {cfg.seed} (must be >= 0)")
    if cfg.param_dtype not in ("", "float16", "bfloat16"):
        wrong.append(f"--param_dtype {cfg.param_dtype!r} (float16 or bfloat16; the masters stay in --dtype)")
    wrong += graphs_problems(cfg) if cfg.graphs else []
    if cfg.log_level.lower() not in ("debug", "info", "warning", "error"):
        wrong.append(f"--log_level {cfg.log_level!r} (debug, info, warning or error)")
    wrong += save_dir_problems(cfg.save_dir) if cfg.save_every or cfg.resume == "latest" else []
    if wrong:
        parser.error("; ".join(wrong))
    return cfg


def graphs_problems(cfg: TrainConfig) -> list[str]:
    """What --graphs cannot replay, named before training (mpifsdp.GraphedPasses would refuse it later)."""
    wrong = []
    if cfg.device != "cuda":
        wrong.append(f"--graphs with --device {cfg.device} (CUDA graphs need --device cuda)")
    if cfg.transport not in ("", "nccl"):
        wrong.append(
            f"--graphs with --transport {cfg.transport} (a graph holds NCCL's collectives, not MPI's)"
        )
    if cfg.dropout > 0:
        wrong.append(f"--graphs with --dropout {cfg.dropout} (a graph would replay the same dropout masks)")
    if cfg.param_dtype not in ("float16", "bfloat16"):
        wrong.append("--graphs without --param_dtype float16 or bfloat16 (float32 attention is not captured)")
    if cfg.accum_sync == "no_sync" and cfg.grad_accum > 1:
        wrong.append("--graphs with --accum_sync no_sync (a graph replays every micro-batch's reduction)")
    return wrong


def save_dir_problems(save_dir: str) -> list[str]:
    """A save_dir that can never take a checkpoint, found before training: a dangling symbolic link
    was taken for a first run and failed at the first save, the steps before it lost."""
    path = Path(save_dir)
    if path.is_symlink() and not path.exists():
        return [f"--save_dir {save_dir} (a symbolic link to {os.readlink(path)}, which does not exist)"]
    if path.exists() and not path.is_dir():
        return [f"--save_dir {save_dir} (exists and is not a directory)"]
    return []


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))) * (cfg.lr - cfg.min_lr)


def resume(cfg: TrainConfig, comm, model, opt, model_config: dict, scaler=None) -> tuple[str | None, int]:
    """(checkpoint, step) to start from: a checkpoint's (--resume), or (None, 0); the loss scaler
    (--param_dtype float16) goes on from its saved scale.

    Never discards an earlier run silently: checkpoints that exist but do not load, or a fresh start
    into a save_dir holding checkpoints (its saves would replace them), are errors unless --fresh
    says to start over."""
    if not cfg.resume:
        earlier = comm.broadcast_object([p.name for p in checkpoint.checkpoints(cfg.save_dir)][:3])
        if cfg.save_every and earlier and not cfg.fresh:
            raise checkpoint.CheckpointError(
                f"{cfg.save_dir} holds checkpoints of an earlier run ({', '.join(earlier)}, ...): pass "
                "--resume latest to continue it, --save_dir to keep both, or --fresh true to start over "
                "(its checkpoints will then be replaced)"
            )
        return None, 0
    if cfg.resume == "latest":
        # raises if none of them loads; a save_dir not made yet is a first run
        path, extra = checkpoint.load_latest(cfg.save_dir, model, opt, missing_ok=True)
        if path is None:
            return None, 0  # a first run: nothing saved yet
    else:
        path, extra = cfg.resume, checkpoint.load(cfg.resume, model, opt)
    saved = extra.get("config", model_config)
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}  # fields newer than the checkpoint
    changed = {
        k: (saved.get(k, defaults[k]), v) for k, v in model_config.items() if saved.get(k, defaults[k]) != v
    }
    if changed:
        raise checkpoint.CheckpointError(
            f"{path} was saved by a model with another configuration (saved, now): {changed}"
        )
    if scaler is not None and "loss_scale" in extra:
        scaler.load_state_dict(extra["loss_scale"])
    return path, extra["step"]


def progress_bar(total: int, done: int, rank: int):
    """tqdm on rank 0 where it is installed (it draws without a TTY as well: under mpiexec rank 0's
    output is a pipe); None otherwise, and the log lines are the only progress. Not in a Slurm batch
    job (sbatch sets ENVIRONMENT=BATCH): its output is a log file, where a bar is a line of noise."""
    if rank != 0 or os.environ.get("ENVIRONMENT") == "BATCH":
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=done, unit="step", mininterval=1.0, file=sys.stderr, dynamic_ncols=True)


def draw_pictures(metrics_path: str) -> str:
    """The run's PNGs beside its metrics file (mpifsdp.observe.pictures), where matplotlib is installed."""
    try:
        paths = pictures.draw(metrics_path)
    except ImportError:  # no matplotlib: say how to get the pictures later
        return f"pictures: pip install 'mpifsdp[viz]', then python -m mpifsdp pictures {metrics_path}"
    except Exception as exc:  # optional: a finished run must not fail over its pictures
        return f"pictures not drawn ({type(exc).__name__}: {exc}); python -m mpifsdp pictures {metrics_path}"
    return "pictures: " + ", ".join(str(p) for p in paths)


def main():
    cfg = parse_config()
    logging.basicConfig(level=cfg.log_level.upper(), format="%(message)s")  # "[rank k]" where several
    # on a GPU: this rank's GPU, and how collectives move
    comm = mpifsdp.Comm(device=cfg.device, transport=cfg.transport or None)
    rank, world = comm.rank, comm.size
    say = print if rank == 0 else (lambda *a, **k: None)
    xp = mpifsdp.array_module(comm.device)

    try:
        data = TextData(cfg.data or None)
        data.check_fits(cfg.block_size)  # now, not at the first evaluation
    except (OSError, ValueError) as exc:  # every rank reads the same file: every rank stops
        say(f"error: --data: {exc}", file=sys.stderr)
        sys.exit(2)
    tokens = f"{len(data.tokens) / 1e6:.1f} M byte tokens"
    say(f"data: {data.path} ({tokens}), {world} rank(s) on {cfg.device} over {comm.library}")

    model_config = GPTConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(GPTConfig)})
    with mpifsdp.deferred_init():  # no rank ever holds the whole model: fully_shard makes it unit by unit
        model = GPT(model_config, seed=cfg.seed, dtype=np.dtype(cfg.dtype), device=comm.device)
    n_params = model.num_params()
    low = cfg.param_dtype or None  # the masters stay in --dtype; gradients are reduced in it too
    mpifsdp.fully_shard(model, comm, units=model.blocks, recompute=cfg.recompute, param_dtype=low,
                        reduce_dtype=cfg.dtype if low else None)  # fmt: skip
    scaler = mpifsdp.LossScaler() if cfg.param_dtype == "float16" else None  # bfloat16: float32's range
    sharded = sharded_model(model)
    plan = sharded.plan()
    say(
        f"model: {n_params / 1e6:.2f} M parameters in {plan['units']} units; plan per rank: "
        f"{mib(plan['persistent'])} MiB persistent (16 B x shard) + gathered at most "
        f"{mib((1 + plan['prefetch']) * plan['largest_unit'])} MiB ({1 + plan['prefetch']} units, prefetch "
        f"{plan['prefetch']}) + {mib(plan['root_unit'])} MiB root unit, and their gradients as much"
    )
    opt = mpifsdp.AdamW(
        model, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay, decay="matrices"
    )  # nanoGPT's choices: decay on matrices only

    def batch(split, index):
        x, y = data.global_batch(split, index, cfg.batch_size, cfg.block_size, seed=cfg.seed)
        return xp.asarray(rank_slice(x, rank, world)), xp.asarray(rank_slice(y, rank, world))

    counts = {}  # grad_accum as a 0-d device array, by the loss's dtype

    def passes(*pairs):
        """The step's forwards and backwards, over its grad_accum micro-batches (x0, y0, x1, y1, ...);
        each loss weighs 1/k, so their summed gradients are those of the mean over all k * batch_size
        sequences. With --graphs, captured once and replayed."""
        k, losses = cfg.grad_accum, []
        for j in range(k):
            if cfg.accum_sync == "no_sync":  # reduce only the last one
                sharded.set_requires_gradient_sync(j == k - 1)
            loss = model(pairs[2 * j], pairs[2 * j + 1])
            if k > 1:  # / k, by a device number made in the first (eager) call: a graph copies nothing in
                if loss.dtype not in counts:
                    counts[loss.dtype] = mpifsdp.Tensor(xp.full((), k, dtype=loss.dtype))
                loss = loss / counts[loss.dtype]
            (scaler.scale(loss) if scaler else loss).backward()
            losses.append(loss)
        return tuple(losses)

    run = mpifsdp.GraphedPasses(model, passes) if cfg.graphs else passes

    def accumulate_gradients(step) -> float:
        """Backward over the step's micro-batches; the mean loss."""
        k = cfg.grad_accum
        return sum(loss.item() for loss in run(*(a for j in range(k) for a in batch("train", step * k + j))))

    def optimizer_step() -> float:
        """Clip and step (a step whose float16 gradients overflowed is skipped); the gradient norm."""
        if scaler:
            scaler.step(opt, max_norm=cfg.grad_clip)
            return scaler.last_grad_norm
        grad_norm = opt.clip_grad_norm(cfg.grad_clip)
        opt.step()
        return grad_norm

    def evaluate() -> float:  # in evaluation mode: no dropout, so the loss depends on the parameters alone
        model.eval()
        with mpifsdp.no_grad():
            local = sum(model(*batch("val", i)).item() for i in range(cfg.eval_batches))
        model.train()
        return comm.all_reduce_scalar(local) / (world * cfg.eval_batches)

    try:
        path, first_step = resume(cfg, comm, model, opt, dataclasses.asdict(model_config), scaler)
    except checkpoint.CheckpointError as exc:  # raised on every rank alike: every rank stops
        say(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    if first_step >= cfg.max_steps:
        say(f"nothing to do: the checkpoint is at step {first_step}, and max_steps is {cfg.max_steps}")
        return
    say(f"resumed from {path} at step {first_step}" if path else "starting at step 0")

    tokens_per_step = cfg.grad_accum * cfg.batch_size * cfg.block_size
    val_loss, train_loss = float("nan"), float("nan")
    comm.barrier()
    t_start = time.perf_counter()
    # a resumed run continues its metrics file: the lines up to its checkpoint's step are kept
    resumed = first_step if path else None
    metrics = mpifsdp.StepMetrics(cfg.metrics, model, resume_after=resumed) if cfg.metrics else None
    bar = progress_bar(cfg.max_steps, first_step, rank)
    stop = mpifsdp.StopRequest()  # a scheduler's warning (SIGUSR1, SIGTERM): save at a step's end, exit 0

    def log(text: str):  # rank 0's lines, above the bar, flushed: stdout is a pipe under mpiexec
        (bar.write if bar else say)(text, file=sys.stdout)
        sys.stdout.flush()

    for step in range(first_step, cfg.max_steps):
        last = step == cfg.max_steps - 1
        if last:  # measure one training step's communication exactly (evaluation excluded)
            comm.ledger.reset()
        if metrics:
            metrics.start()
        began = time.perf_counter()
        opt.lr = lr_at(step, cfg)
        loss = accumulate_gradients(step)
        grad_norm = optimizer_step()
        opt.zero_grad()
        if last:
            step_comm = comm.ledger.report()
        if metrics:
            seconds = time.perf_counter() - began
            metrics.write(step=step + 1, loss=loss, seconds=seconds, tokens=tokens_per_step, lr=opt.lr,
                          grad_norm=grad_norm)  # fmt: skip
        if step % cfg.log_every == 0 or last:
            train_loss = comm.all_reduce_scalar(loss) / world
            tok_s = tokens_per_step * (step + 1 - first_step) / (time.perf_counter() - t_start)
            if bar:
                bar.set_postfix_str(f"loss {train_loss:.4f}, {tok_s:,.0f} tok/s", refresh=False)
            if step % (cfg.log_every * 10) == 0 or last:
                log(
                    f"step {step + 1:5d}/{cfg.max_steps} | loss {train_loss:.4f} | norm {grad_norm:.2f} "
                    f"| lr {opt.lr:.2e} | {tok_s:,.0f} tok/s | peak RSS {mib(peak_rss_bytes()):.0f} MiB"
                )
        if bar:
            bar.update(1)
        if (step > 0 and step % cfg.eval_every == 0) or last:
            val_loss = evaluate()
            log(f"step {step + 1}: val loss {val_loss:.4f}")
            if metrics:
                metrics.note(step=step + 1, val_loss=val_loss)
        stopping = stop.agreed(comm)  # every rank the same answer: all stop after this step
        if cfg.save_every and ((step + 1) % cfg.save_every == 0 or last or stopping):
            # the data position is the step: batches are a pure function of (seed, step)
            extra = {"config": dataclasses.asdict(model_config)}
            if scaler:
                extra["loss_scale"] = scaler.state_dict()
            path = checkpoint.save_step(cfg.save_dir, step + 1, model, opt, extra, keep=cfg.keep)
            log(f"saved {path}")
        if stopping:
            why = f"{stop.received} here" if stop.received else "a signal on another rank"
            log(f"stopped after step {step + 1} ({why}): --resume latest continues from its checkpoint")
            if bar:
                bar.close()
            return
    elapsed = time.perf_counter() - t_start
    if bar:
        bar.close()
    if metrics and rank == 0:
        say(f"metrics: {cfg.metrics}; " + draw_pictures(cfg.metrics))

    prompt = np.frombuffer(b"def ", dtype=np.uint8)[None, :].astype(np.int64)
    sample = model.generate(
        prompt, cfg.sample_tokens, temperature=0.8, top_k=40, rng=np.random.default_rng(0)
    )
    say("sample:\n" + bytes(sample[0].astype(np.uint8)).decode("utf-8", errors="replace"))

    memory = sharded.report()  # every rank's ledgers, gathered
    peak_rss = max(comm.allgather_object(peak_rss_bytes()))
    if rank == 0:
        mem = memory[0]["memory"]
        print(
            f"measured on rank 0: persistent {mib(mem['persistent'])} MiB, peak gathered params "
            f"{mib(mem['peak']['gathered_params'])} MiB, peak gathered grads "
            f"{mib(mem['peak']['gathered_grads'])} MiB; one training step moved "
            f"{mib(step_comm['bytes'])} MiB in {step_comm['calls']} collectives, by phase "
            + json.dumps({k: mib(v) for k, v in step_comm["bytes_by_phase"].items()})
        )
        print(
            json.dumps(
                {
                    "train_loss": round(train_loss, 4),
                    "val_loss": round(val_loss, 4),
                    "steps": cfg.max_steps,
                    "world_size": world,
                    "sequences_per_step": cfg.grad_accum * cfg.batch_size,
                    "tokens_per_s": round(tokens_per_step * (cfg.max_steps - first_step) / elapsed, 1),
                    "peak_rss_mib": mib(peak_rss),
                    # the fast way's own evidence: the scale a float16 run ended at, the graph's replays
                    **({"loss_scale": scaler.scale_value} if scaler else {}),
                    **({"graph_replays": run.replays} if cfg.graphs else {}),
                }
            )
        )


if __name__ == "__main__":
    main()
