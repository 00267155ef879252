"""A battery of misuse and faults, each a real `mpiexec` job with a time bound.

Every scenario asserts how the job ended (exit status, the error text it printed, within its time
bound), that no rank is left running, and, where files are involved, that nothing a user wrote was
lost (the scripts check their own data and print SCENARIO OK). Watchdog timeouts are short here
(MPIFSDP_TIMEOUT=5) so that a hang would fail the bound, not the whole suite.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field

import pytest

from support import run_job

PRELUDE = textwrap.dedent(
    """
    import os, signal, sys, json, shutil
    from pathlib import Path
    import numpy as np
    import mpifsdp
    from mpifsdp import AdamW, Comm, LossScaler, fully_shard, full_state_dict, ops
    from mpifsdp import checkpoint as ck
    from mpifsdp.checkpoint.consolidated import export_safetensors, load_safetensors
    from mpifsdp import sharded_model
    from mpifsdp.models import GPT, GPTConfig

    ROOT = Path(sys.argv[1])  # this scenario's directory, shared by its ranks
    comm = Comm()
    rank, size = comm.rank, comm.size
    CFG = GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2, n_embd=8)

    def make(seed=0, cfg=CFG, **options):
        model = GPT(cfg, seed=seed)
        fully_shard(model, comm, units=model.blocks, **options)
        return model, AdamW(model, lr=1e-2)

    def batch(step=0, rows=2):
        rng = np.random.default_rng(step)
        x, y = (rng.integers(0, 16, (rows * size, 4)) for _ in range(2))
        return x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]

    def train(model, opt, steps=1, first=0):
        for step in range(first, first + steps):
            model(*batch(step)).backward()
            opt.step()
            opt.zero_grad()

    def on_rank_0(action):  # once every rank is done reading the files, and seen by all after
        comm.barrier()
        if rank == 0:
            action()
        comm.barrier()

    def edit_manifest(path, change, redo_checksum=False):
        from mpifsdp.checkpoint.manifest import with_digest

        def edit():
            manifest = json.loads((path / "manifest.json").read_text())
            change(manifest)
            text = json.dumps(with_digest(manifest) if redo_checksum else manifest)
            (path / "manifest.json").write_text(text)

        on_rank_0(edit)

    def ok():
        comm.barrier()
        if rank == 0:
            print("SCENARIO OK", flush=True)

    def named_on_every_rank(action):  # each rank says what stopped it, then the job ends (exit 4)
        from mpifsdp import CollectiveError, ScheduleError

        try:
            action()
        except (ScheduleError, CollectiveError) as exc:
            print(f"rank {rank} named: {type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)
            sys.exit(4)
    """
)


def on_every_rank(ranks: int, what: str = "(ScheduleError|CollectiveError)") -> str:
    """A regex: every one of `ranks` ranks named the mismatch itself (no rank was left waiting)."""
    return "(?s)" + "".join(f"(?=.*rank {r} named: {what})" for r in range(ranks))


ONE_RANK_ONLY = {  # a collective-issuing call one rank makes and the others do not (then they train)
    "save": 'ck.save(ROOT / "c", model, opt)',
    "evaluation": "with mpifsdp.no_grad(): model(*batch())",
    "full-state-dict": "full_state_dict(model)",
    "optimizer-step": "opt.step()",
}


@dataclass
class Scenario:
    body: str
    expect: str  # a regex the output must hold; "SCENARIO OK" for a run that must succeed
    ranks: int = 2
    ok: bool = False  # exit status 0 expected (else non-zero)
    seconds: float = 30  # the job must end within this
    env: dict = field(default_factory=dict)
    launcher: str = "mpi4py"  # "plain": without -m mpi4py (an exception does not abort the job)


def good(body, **kw):
    return Scenario(body, "SCENARIO OK", ok=True, **kw)


def bad(body, expect, **kw):
    return Scenario(body, expect, **kw)


CLIP_ON_ONE_RANK = """
    model, opt = make()
    model(*batch()).backward()
    if rank == 0:
        opt.clip_grad_norm(1.0)  # a scalar all-reduce the other ranks do not make for this purpose
    opt.step()
"""

SCENARIOS = {
    # -- a collective one rank makes alone is named on every rank, without debug mode ----------------
    **{
        f"{name}-on-rank-0-only-at-{ranks}": bad(
            f"""
        model, opt = make()
        train(model, opt)
        def diverge():
            if rank == 0:
                {call}
            train(model, opt, first=1)
        named_on_every_rank(diverge)
        """,
            on_every_rank(ranks),
            ranks=ranks,
            seconds=20,
        )
        for name, call in ONE_RANK_ONLY.items()
        for ranks in (2, 4)
    },
    **{
        f"a-skipped-backward-at-{ranks}": bad(
            """
        model, opt = make()
        def diverge():
            loss = model(*batch())
            if rank != 1:
                loss.backward()
            opt.step()
        named_on_every_rank(diverge)
        """,
            on_every_rank(ranks),
            ranks=ranks,
            seconds=20,
        )
        for ranks in (2, 4)
    },
    # -- checkpoints never lose data ------------------------------------------------------------------
    "prune-spares-a-users-checkpoint": good("""
        model, opt = make()
        ck.save(ROOT / "best", model, opt)
        for step in range(1, 5):
            train(model, opt, first=step)
            ck.save_step(ROOT, step, model, opt, keep=2)
        assert (ROOT / "best" / "manifest.json").is_file()
        assert [p.name for p in ck.checkpoints(ROOT)] == ["step-00000004", "step-00000003"]
        ok()
    """),
    "latest-ignores-other-names": good("""
        model, opt = make()
        ck.save_step(ROOT, 4, model, opt)
        ck.save(ROOT / "warm-start", model, opt, {"step": 0})  # newer on disk, but not a step-N
        path, extra = ck.load_latest(ROOT, *make(seed=0))
        assert path.name == "step-00000004" and extra["step"] == 4
        ok()
    """),
    "overwrite-killed-between-renames-then-recovered": good("""
        model, opt = make()
        ck.save_step(ROOT, 1, model, opt, extra={"copy": "old"})
        ck.save(ROOT / "staged", model, opt, {"step": 1, "copy": "new"})
        on_rank_0(lambda: (os.replace(ROOT / "step-00000001", ROOT / "step-00000001.old-1"),
                           os.replace(ROOT / "staged", ROOT / "step-00000001.tmp-2")))
        path, extra = ck.load_latest(ROOT, *make())
        assert path.name == "step-00000001.tmp-2" and extra["copy"] == "new", (path, extra)
        ck.save_step(ROOT, 2, model, opt, keep=5)
        assert [p.name for p in ck.checkpoints(ROOT)] == ["step-00000002", "step-00000001"]
        ok()
    """),
    "latest-refuses-when-none-fits": bad(
        """
        model, opt = make()
        ck.save_step(ROOT, 1, model, opt)
        other = GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2, n_embd=12)
        try:
            ck.load_latest(ROOT, *make(cfg=other))
        finally:
            assert (ROOT / "step-00000001" / "manifest.json").is_file()  # still there
    """,
        r"no checkpoint under .* could be loaded:\s+step-00000001: .*does not fit this model",
    ),
    "latest-refuses-when-all-corrupt": bad(
        """
        model, opt = make()
        for step in (1, 2):
            ck.save_step(ROOT, step, model, opt)
        on_rank_0(lambda: [p.write_bytes(b"x") for p in ROOT.glob("step-*/rank-00000.bin")])
        ck.load_latest(ROOT, *make())
    """,
        r"no checkpoint under .* could be loaded:.*step-00000002: .*truncated.*step-00000001: .*truncated",
    ),
    "manifest-slice-removed": bad(
        """
        path = ck.save(ROOT / "c", *make())
        edit_manifest(path, lambda m: m["files"][0]["segments"].pop(0))
        ck.load(path, *make())
    """,
        r"not a valid checkpoint: .*the manifest's checksum does not match",
    ),
    "manifest-slice-removed-checksum-redone": bad(
        """
        path = ck.save(ROOT / "c", *make())
        edit_manifest(path, lambda m: m["files"][0]["segments"].pop(0), redo_checksum=True)
        ck.load(path, *make())
    """,
        r"slices do not cover it once",
    ),
    "manifest-ranges-swapped-checksum-redone": bad(
        """
        model, opt = make()
        train(model, opt)
        path = ck.save(ROOT / "c", model, opt)
        def swap(m):  # unit 0's parameters and first moments trade places
            seg = {s["kind"]: s for s in m["files"][0]["segments"] if s["unit"] == 0}
            a, b = seg["param"], seg["exp_avg"]
            a["offset"], b["offset"] = b["offset"], a["offset"]
        edit_manifest(path, swap, redo_checksum=True)
        ck.load(path, *make())
    """,
        r"is corrupted: the .* bytes of unit #0 do not match their checksum",
    ),
    "manifest-random-bytes": bad(
        """
        on_rank_0(lambda: ((ROOT / "c").mkdir(), (ROOT / "c" / "manifest.json").write_bytes(os.urandom(99))))
        ck.load(ROOT / "c", *make())
    """,
        r"not a valid checkpoint: .*/c \(its manifest is unreadable",
    ),
    "safetensors-huge-header": bad(
        """
        import struct
        on_rank_0(lambda: (ROOT / "m.safetensors").write_bytes(struct.pack("<Q", 2**62) + b"{}"))
        load_safetensors(ROOT / "m.safetensors", make()[0])
    """,
        r"not a valid safetensors file: .*m.safetensors \(a header of 4611686018427387904 bytes",
    ),
    "safetensors-empty": bad(
        """
        on_rank_0(lambda: (ROOT / "m.safetensors").write_bytes(b""))
        load_safetensors(ROOT / "m.safetensors", make()[0])
    """,
        r"not a valid safetensors file: .*\(0 bytes, shorter than the 8-byte header length\)",
    ),
    "safetensors-offsets-past-the-end": bad(
        """
        import struct
        header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
        raw = struct.pack("<Q", len(header)) + header + b"1234"
        on_rank_0(lambda: (ROOT / "m.safetensors").write_bytes(raw))
        load_safetensors(ROOT / "m.safetensors", make()[0])
    """,
        r"not a valid safetensors file: .*the tensors end at byte",
    ),
    "safetensors-extra-tensors": bad(
        """
        model, _ = make()
        on_rank_0(lambda: None)
        export_safetensors(ROOT / "m.safetensors", model)
        import safetensors.numpy as st
        def add():
            tensors = st.load_file(ROOT / "m.safetensors")
            st.save_file({**tensors, "extra": np.ones(2, np.float32)}, ROOT / "m.safetensors")
        on_rank_0(add)
        load_safetensors(ROOT / "m.safetensors", make()[0])
    """,
        r"unexpected extra \(strict=False ignores it\)",
    ),
    "save-onto-a-file": bad(
        """
        on_rank_0(lambda: (ROOT / "f").write_text("mine"))
        try:
            ck.save(ROOT / "f", *make())
        finally:
            assert (ROOT / "f").read_text() == "mine" and sorted(os.listdir(ROOT)) == ["f"]
    """,
        r"saving to .*/f failed on 1 of 2 ranks:\s+rank 0: cannot save to .*: it exists and is not a dir",
    ),
    "save-under-a-file": bad(
        """
        on_rank_0(lambda: (ROOT / "f").write_text("mine"))
        ck.save(ROOT / "f" / "c", *make())
    """,
        r"CheckpointError: .*Not a directory",
    ),
    "save-disk-full-on-one-rank": bad(
        """
        model, opt = make()
        ck.save(ROOT / "c", model, opt, {"v": 1})
        original = ck.sharded._write_rank_file
        def full(*args):
            if rank == 1:
                raise OSError(28, "No space left on device")
            return original(*args)
        ck.sharded._write_rank_file = full
        try:
            ck.save(ROOT / "c", model, opt, {"v": 2})
        finally:
            comm.barrier()
            assert sorted(os.listdir(ROOT)) == ["c"], os.listdir(ROOT)  # no staging directory left
            assert ck.load(ROOT / "c", *make())["v"] == 1  # the old checkpoint is intact
    """,
        r"writing .* failed on 1 of 2 ranks:\s+rank 1: \[Errno 28\] No space left on device",
    ),
    "save-into-a-folder-of-other-files": bad(
        """
        on_rank_0(lambda: ((ROOT / "notes").mkdir(), (ROOT / "notes" / "todo.txt").write_text("x")))
        try:
            ck.save(ROOT / "notes", *make())
        finally:
            assert os.listdir(ROOT / "notes") == ["todo.txt"]
    """,
        r"it holds files that are not a checkpoint.s",
    ),
    "checkpoint-error-on-one-rank-without-mpi4py": bad(
        """
        model, opt = make()
        def broken(*args):
            raise RuntimeError("a bug on rank 1")
        if rank == 1:
            ck.sharded._write_rank_file = broken  # an unexpected error: raised on rank 1 only
        ck.save(ROOT / "c", model, opt)
    """,
        # the exit handshake: rank 0 learns in seconds, not from its watchdog, that rank 1 is gone
        r"rank 1 left the job \(an exception ended it: RuntimeError: a bug on rank 1",
        launcher="plain",
        seconds=15,
    ),
    "exception-on-one-rank-while-another-computes-without-mpi4py": bad(
        """
        if rank == 1:
            raise RuntimeError("a bug on rank 1")
        import time
        time.sleep(60)  # at work, in no collective: only rank 1 itself can end the job in time
        comm.barrier()
    """,
        r"rank 1 left the job \(an exception ended it: RuntimeError: a bug on rank 1\) and no other rank",
        launcher="plain",
        seconds=15,
    ),
    # -- no rank may silently diverge -----------------------------------------------------------------
    "different-seeds": bad("make(seed=rank)", r"starts from different parameter values on different ranks"),
    "different-seeds-synced": good("""
        model, opt = make(seed=rank, sync_params=True)
        want = GPT(CFG, seed=0).state_dict()
        got = full_state_dict(model)
        assert all(np.array_equal(got[k], want[k]) for k in want)
        ok()
    """),
    "different-heads": bad(
        "make(cfg=GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2 if rank else 4, n_embd=8))",
        r"configuration differs between ranks.*n_head",
    ),
    "different-dropout": bad(
        "make(cfg=GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2, n_embd=8, dropout=0.1 * rank))",
        r"configuration differs between ranks.*dropout",
    ),
    "clip-on-one-rank": bad(
        CLIP_ON_ONE_RANK, r"ScheduleError: ranks disagree .*the gradient norm of clip_grad_norm"
    ),
    "clip-on-one-rank-debug": bad(
        CLIP_ON_ONE_RANK,
        r"ScheduleError: ranks disagree on the sequence of collectives \(before",
        env={"MPIFSDP_DEBUG": "1"},
    ),
    "loss-reduced-on-one-rank": bad(
        """
        model, opt = make()
        loss = model(*batch())
        loss.backward()
        if rank == 0:
            comm.all_reduce_scalar(loss.item(), what="the loss")
        opt.step()
    """,
        r"ScheduleError|mpifsdp watchdog",
        seconds=25,
    ),
    "units-swapped-on-one-rank": bad(
        """
        model, opt = make(prefetch=0)
        def forward(idx, targets):
            h = model.wte(idx) + model.wpe(np.arange(idx.shape[1]))
            for i in ([1, 0] if rank else [0, 1]):
                h = model.blocks[i](h)
            return ops.cross_entropy(ops.linear(model.ln_f(h), model.wte.weight, transpose_w=True), targets)
        model.forward = forward
        train(model, opt, steps=3)
        print("trained a mixture", flush=True)
    """,
        r"ScheduleError: ranks disagree .*\(at the start of a backward\)",
    ),
    "extra-forward-on-one-rank": bad(
        """
        model, opt = make()
        if rank == 0:
            model(*batch())
        train(model, opt)
    """,
        r"mpifsdp watchdog|ScheduleError",
        seconds=25,
    ),
    # -- settings -------------------------------------------------------------------------------------
    "timeout-nan": bad("", r"MPIFSDP_TIMEOUT='nan': give", env={"MPIFSDP_TIMEOUT": "nan"}),
    "timeout-zero": bad("", r"MPIFSDP_TIMEOUT='0': give", env={"MPIFSDP_TIMEOUT": "0"}),
    "timeout-negative": bad("", r"MPIFSDP_TIMEOUT='-1': give", env={"MPIFSDP_TIMEOUT": "-1"}),
    "timeout-words": bad("", r"MPIFSDP_TIMEOUT='abc': give", env={"MPIFSDP_TIMEOUT": "abc"}),
    "debug-unknown": bad("", r"MPIFSDP_DEBUG='maybe': use 1/true/yes/on", env={"MPIFSDP_DEBUG": "maybe"}),
    "debug-false-is-off": good("assert not comm.schedule.debug\nok()", env={"MPIFSDP_DEBUG": "false"}),
    # -- bad input, named on every rank ---------------------------------------------------------------
    "negative-target-on-one-rank": bad(
        """
        model, opt = make()
        x, y = batch()
        model(x, y if rank == 0 else -2 * np.ones_like(y))
    """,
        r"checking the inputs failed on 1 of 2 ranks:\s+rank 1: GPT: targets holds -2",
    ),
    "token-past-the-vocabulary": bad(
        """
        model, opt = make()
        x, y = batch()
        model(x if rank else x + 16, y)
    """,
        r"rank 0: GPT: idx \(token ids\) holds \d+, outside \[0, 16\)",
    ),
    "float-targets": bad(
        "model, opt = make(); x, y = batch(); model(x, y.astype(float))", r"targets must be an integer array"
    ),
    "one-dimensional-tokens": bad(
        "model, opt = make(); model(np.zeros(4, dtype=int))", r"must have 2 dimensions"
    ),
    "a-python-list": bad(
        "model, opt = make(); model([[1, 2, 3, 4]])", r"must be an integer array of ids, got a list"
    ),
    "too-long-a-sequence": bad(
        "model, opt = make(); model(np.zeros((1, 9), dtype=int))", r"sequence length 9 exceeds"
    ),
    "uneven-batches": bad(
        "model, opt = make(); model(*batch(rows=2 + rank))", r"ranks hold different batch sizes"
    ),
    "nan-gradient-on-one-rank": bad(
        """
        model, opt = make()
        model(*batch()).backward()
        if rank == 1:
            sharded_model(model).units[0].grad_shard[0] = np.nan
        opt.step()
    """,
        r"NonFiniteError: the gradient norm is nan",
    ),
    "lr-nan": bad(
        "model, opt = make(); opt.lr = float('nan'); model(*batch()).backward(); opt.step()",
        r"AdamW.lr is nan",
    ),
    "betas-out-of-range": bad("AdamW(make()[0], betas=(1.5, 0.9))", r"AdamW: invalid betas=\(1.5, 0.9\)"),
    "clip-max-norm-zero": bad(
        "model, opt = make(); model(*batch()).backward(); opt.clip_grad_norm(0.0)",
        r"max_norm must be a finite number > 0",
    ),
    "same-unit-twice": bad(
        "u = sharded_model(make()[0]).units[0]; AdamW([u, u])", r"AdamW got \['blocks.0'\] more than once"
    ),
    "step-without-gradients": good(
        "model, opt = make(); assert opt.step() is False and opt.step_count == 0\nok()"
    ),
    "float16-masters-overflow": bad(
        """
        model, opt = make(param_dtype=np.float16)
        sharded_model(model).units[0].shard[0] = 1e6
        model(*batch())
    """,
        r"parameter values no longer fit float16",
    ),
    "loss-scale-keeps-overflowing": bad(
        """
        model, opt = make(param_dtype=np.float16)
        scaler = LossScaler(init_scale=8.0, max_skips_in_a_row=3)
        for step in range(5):
            scaler.scale(model(*batch(step))).backward()
            sharded_model(model).units[0].grad_shard[0] = np.inf
            scaler.step(opt)
            opt.zero_grad()
    """,
        r"NonFiniteError: the gradients overflow at loss scale",
    ),
    # -- faults ---------------------------------------------------------------------------------------
    "exception-on-one-rank": bad(
        """
        model, opt = make()
        train(model, opt)
        if rank == 1:
            raise KeyError("injected")
        train(model, opt, steps=100)
    """,
        r"KeyError: 'injected'",
        seconds=20,
    ),
    "killed-rank": bad(
        """
        model, opt = make()
        train(model, opt)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        train(model, opt, steps=100)
    """,
        r"",
        seconds=20,
    ),
    "four-ranks-bad-target-on-rank-2": bad(
        """
        model, opt = make()
        x, y = batch()
        model(x, y if rank != 2 else y + 20)
    """,
        r"failed on 1 of 4 ranks:\s+rank 2: GPT: targets holds 2\d",
        ranks=4,
    ),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario(comm, tmp_path, name):
    if comm.size > 1:
        pytest.skip("drives its own mpiexec: runs in the plain-pytest pass of make test")
    scenario = SCENARIOS[name]
    script = tmp_path / f"{name}.py"
    script.write_text(PRELUDE + textwrap.dedent(scenario.body) + "\n")
    (tmp_path / "data").mkdir()
    env = {"OMP_NUM_THREADS": "1", "MPIFSDP_TIMEOUT": "5", **scenario.env}
    result, elapsed = run_job(
        script,
        scenario.ranks,
        tmp_path / "data",
        launcher=scenario.launcher,
        env=env,
        timeout=scenario.seconds + 60,
    )
    output = result.stdout + result.stderr
    assert elapsed < scenario.seconds, f"{name} took {elapsed:.1f} s (bound {scenario.seconds} s)"
    assert (result.returncode == 0) == scenario.ok, f"exit {result.returncode}:\n{output[-3000:]}"
    assert re.search(scenario.expect, output, re.S), f"{scenario.expect!r} not in:\n{output[-3000:]}"
    if not scenario.ok:
        assert "SCENARIO OK" not in output


def test_the_battery_is_large_enough():
    assert len(SCENARIOS) >= 40
