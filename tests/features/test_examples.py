"""The examples run under mpiexec as a user would run them, and do what they claim."""

import json
import math
import os
import subprocess
import sys
import time

import pytest

from support import ROOT, mpiexec, run_job, run_launched, step_losses


def run_example(comm, ranks, *args, timeout=300, returncode=0, progress=None):
    """The example's stdout (and stderr when it failed); progress: a list that receives its stderr."""
    if comm.size > 1:
        pytest.skip("drives its own mpiexec: runs in the plain-pytest pass of make test")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [*mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpi4py", *map(str, args)]
    result = run_launched(cmd, timeout=timeout, env=env, cwd=ROOT)
    assert result.returncode == returncode, result.stdout[-2000:] + result.stderr[-3000:]
    if progress is not None:
        progress.append(result.stderr)
    return result.stdout + (result.stderr if returncode else "")


def test_sharded_numpy_example_fits_the_oscillators(comm):
    out = run_example(comm, 3, ROOT / "examples" / "sharded_numpy.py")
    final = float(out.strip().splitlines()[-1].split()[2])
    assert "3 ranks, each holding 88 of 264 parameters" in out
    assert final < 3e-4, out  # the noise floor is 1e-4; the start is ~2


def test_train_gpt_example_runs_sharded_and_reports(comm):
    stderr = []
    out = run_example(
        comm, 2, ROOT / "examples" / "train_gpt.py",
        "--max_steps", 30, "--eval_every", 15, "--n_layer", 2, "--n_embd", 32, "--block_size", 32,
        "--batch_size", 8, "--sample_tokens", 20, "--warmup_steps", 5, progress=stderr,
    )  # fmt: skip
    result = json.loads(out.strip().splitlines()[-1])
    assert result["world_size"] == 2 and result["steps"] == 30
    assert result["val_loss"] < 4.0  # from ln(256) = 5.55 at the start
    assert "one training step moved" in out and "plan per rank" in out
    # tqdm's bar (the test extra installs it) is drawn although stderr is a pipe here, as under mpiexec
    assert "30/30" in stderr[0] and "tok/s" in stderr[0], stderr[0][-500:]


def test_train_gpt_names_flags_it_cannot_run_with(comm):
    if comm.size > 1:
        pytest.skip("one single-process command: the plain-pytest pass covers it")
    script = ROOT / "examples" / "train_gpt.py"
    for flags, message in [
        # each was a traceback (x % 0, a division by zero) or an error far from the flag
        (["--log_every", "0", "--eval_every", "0"], "--log_every 0 (must be >= 1); --eval_every 0"),
        (["--eval_batches", "0"], "--eval_batches 0 (must be >= 1)"),
        (["--n_layer", "0"], "GPTConfig: n_layer=0: sizes are integers >= 1"),
        (["--grad_clip", "0"], "--grad_clip 0.0 (must be > 0)"),
        (["--fresh", "maybe"], "argument --fresh: invalid yes_or_no value: 'maybe'"),  # was read as False
    ]:
        done = subprocess.run([sys.executable, str(script), *flags], capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 2 and message in done.stderr, done.stderr[-1000:]


def test_inputs_found_late_are_refused_before_training(comm, tmp_path):
    """Each was found only after the work it spoils: the export path after the whole fine-tune (the
    adapters saved nowhere), a too-short validation split at the first evaluation (200 steps in)."""
    if comm.size > 1:
        pytest.skip("single-process commands: the plain-pytest pass covers it")
    (tmp_path / "a_file").write_text("")
    (tmp_path / "short.txt").write_bytes(b"0123456789" * 40)  # 360 train, 40 val tokens
    finetune, train = ROOT / "examples" / "finetune_lora.py", ROOT / "examples" / "train_gpt.py"
    for command, message in [
        ([finetune, "--export", tmp_path], "--export: " + f"{tmp_path} is a directory"),
        ([finetune, "--export", tmp_path / "a_file" / "x.safetensors"], "a_file is not a directory"),
        ([train, "--data", tmp_path / "short.txt", "--block_size", 64], "its val split has 40 tokens"),
        ([train, "--data", tmp_path / "missing.txt"], "missing.txt does not exist"),
    ]:
        start = time.monotonic()
        done = subprocess.run([sys.executable, *map(str, command)], capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 2 and message in done.stderr, done.stderr[-1000:]
        assert "Traceback" not in done.stderr and time.monotonic() - start < 60


def test_train_gpt_accumulates_gradients_without_sync_and_recomputes_activations(comm, tmp_path):
    out = run_example(
        comm, 2, ROOT / "examples" / "train_gpt.py",
        "--max_steps", 6, "--eval_every", 100, "--n_layer", 2, "--n_embd", 32, "--block_size", 32,
        "--batch_size", 4, "--grad_accum", 3, "--accum_sync", "no_sync", "--sample_tokens", 5,
        "--recompute", "true", "--dropout", 0.1, "--metrics", tmp_path / "metrics.jsonl",
    )  # fmt: skip
    result = json.loads(out.strip().splitlines()[-1])
    assert result["sequences_per_step"] == 12 and result["val_loss"] < 5.55  # ln(256) at the start
    every = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lines = [m for m in every if "tokens" in m]
    assert [m["step"] for m in lines] == list(range(1, 7))
    assert [m["timeline_step"] for m in every if "timeline_step" in m] == [2]
    assert [m["step"] for m in every if "val_loss" in m] == [6]  # the last step evaluates
    for name in ("loss.png", "throughput.png", "memory.png", "comm.png"):  # drawn beside the metrics
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG"), name
    first = lines[0]
    assert first["tokens"] == 12 * 32 and first["loss"] > 0 and len(first["peak_bytes_per_rank"]) == 2
    assert 0 <= first["exposed_comm_s"] <= first["seconds"] and first["compute_s"] > 0
    assert first["bytes_by_phase"]["backward"] > 0  # no_sync: the third micro-batch reduces


def test_finetune_lora_beats_the_base_on_new_text_and_exports_a_plain_gpt(comm, tmp_path):
    """The base trains at N=2; the adapters train at N=3 on the email package (checkpoint loaded by
    tensor name into another unit division); the merged export loads into a plain GPT."""
    run_example(
        comm, 2, ROOT / "examples" / "train_gpt.py", "--max_steps", 150, "--save_every", 150,
        "--save_dir", tmp_path / "ck", "--n_layer", 2, "--n_embd", 48, "--block_size", 48,
        "--batch_size", 12, "--eval_every", 1000, "--sample_tokens", 5,
    )  # fmt: skip
    out = run_example(
        comm, 3, ROOT / "examples" / "finetune_lora.py", "--base", tmp_path / "ck", "--package", "email",
        "--max_steps", 120, "--batch_size", 12, "--export", tmp_path / "ft.safetensors",
    )  # fmt: skip
    result = json.loads(out.strip().splitlines()[-1])
    assert result["finetuned_val_loss"] < result["base_val_loss"] - 0.02, result
    assert abs(result["exported_val_loss"] - result["finetuned_val_loss"]) < 1e-3, result  # float32 merge
    # rank 8 adapters, C = 48: A and B of c_attn r(C + 3C), attn.c_proj r(2C), c_fc and mlp.c_proj r(5C) each
    assert result["trainable_params"] == 2 * 16 * 8 * 48  # 2 blocks


def test_train_gpt_saves_and_resumes_at_another_world_size(comm, tmp_path):
    small = ["--n_layer", 2, "--n_embd", 32, "--block_size", 32, "--batch_size", 6, "--sample_tokens", 5]
    script = ROOT / "examples" / "train_gpt.py"
    ckpt = ["--save-every", 10, "--save-dir", tmp_path / "ck", "--eval_every", 100]
    run_example(comm, 2, script, "--max-steps", 20, *ckpt, *small)
    out = run_example(comm, 3, script, "--max-steps", 30, "--resume", "latest", *ckpt, *small)
    assert f"resumed from {tmp_path / 'ck' / 'step-00000020'} at step 20" in out
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 30
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [f"step-000000{n}0" for n in (1, 2, 3)]


def test_train_gpt_never_discards_an_earlier_run(comm, tmp_path):
    small = ["--n_layer", 2, "--n_embd", 32, "--block_size", 32, "--batch_size", 4, "--sample_tokens", 5]
    script = ROOT / "examples" / "train_gpt.py"
    ckpt = ["--save-every", 5, "--save-dir", tmp_path / "ck", "--eval_every", 100, *small]
    run_example(comm, 2, script, "--max-steps", 10, *ckpt)
    saved = sorted(p.name for p in (tmp_path / "ck").iterdir())

    out = run_example(comm, 2, script, "--max-steps", 10, "--resume", "latest", *ckpt)
    assert "nothing to do: the checkpoint is at step 10, and max_steps is 10" in out
    out = run_example(comm, 2, script, "--max-steps", 20, *ckpt, returncode=2)  # a fresh start into it
    assert "holds checkpoints of an earlier run" in out and "--resume latest" in out
    resume = ["--max-steps", 20, "--resume", "latest", *ckpt]
    out = run_example(comm, 2, script, *resume, "--n_head", 2, returncode=2)
    assert "saved from a model with other settings (blocks.0.attn.n_head: saved 4, the model's 2" in out
    out = run_example(comm, 2, script, *resume, "--n_embd", 16, returncode=2)
    assert "no checkpoint under" in out and "does not fit this model" in out
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == saved  # nothing replaced or deleted
    for path in (tmp_path / "ck").glob("*/rank-00000.bin"):
        path.write_bytes(b"corrupt")
    out = run_example(comm, 2, script, *resume, returncode=2)
    assert "no checkpoint under" in out and "rank-00000.bin is truncated" in out
    run_example(comm, 2, script, "--max-steps", 5, *ckpt, "--fresh", "true")  # asked for: starts over


def test_heat_source_example_matches_numpy_across_uneven_splits_and_a_resume(comm, tmp_path):
    script, save = ROOT / "examples" / "heat_source.py", ["--save", tmp_path / "heat"]
    runs = [run_example(comm, 3, script, "--steps", 150, *save)]
    runs.append(run_example(comm, 2, script, "--steps", 300, *save, "--resume"))  # another world size
    assert "3 ranks with [333, 332, 332] sensor rows" in runs[0] and "steps 150..300" in runs[1]
    for out in runs:
        difference = float(out.split("max difference from plain NumPy: ")[1].split()[0])
        assert difference < 1e-12, out  # float64, the same sums in other orders: ~1e-16 measured
    assert float(runs[1].split("misfit to the true source ")[1].split()[0]) < 0.1


def test_heat_source_deterministic_has_the_same_bits_on_1_to_4_ranks(comm):
    """12 chunks of sensor rows summed exactly (Unit.add_chunk_grad): one hash at every N."""
    script = ROOT / "examples" / "heat_source.py"
    bits = set()
    for ranks in (1, 2, 3, 4):
        out = run_example(comm, ranks, script, "--deterministic", "--steps", 60)
        assert "from plain NumPy" in out and float(out.split("from plain NumPy ")[1].split()[0]) < 1e-12
        bits.add(out.split("bits of the source: ")[1].split()[0])
    assert len(bits) == 1, bits


def test_heat_source_with_scipys_lbfgs_on_a_unit(comm):
    out = run_example(comm, 3, ROOT / "examples" / "heat_source.py", "--lbfgs")
    difference = float(out.split("max difference from plain NumPy: ")[1].split()[0])
    # the same iterations up to rounding (measured 2e-13 to 6e-13): far from a wrong gradient's O(1)
    assert difference < 1e-9, out
    assert float(out.split("misfit to the true source ")[1].split()[0]) < 0.1


def test_heat_source_lbfgs_refuses_ranks_whose_settings_differ(comm, tmp_path):
    """One rank's smoothness weight 1 % higher: the ranks ran the same number of evaluations, no check
    fired, and the final writeback kept a mixture (4.9e-4 off). Each evaluation now checks that every
    rank is at the same point, bit for bit, and the run stops at the first that is not."""
    if comm.size > 1:
        pytest.skip("drives its own mpiexec: runs in the plain-pytest pass of make test")
    script = tmp_path / "differs.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT / 'examples')!r})\n"
        "import heat_source\n"
        "from mpi4py import MPI\n"
        "if MPI.COMM_WORLD.Get_rank() == 1:\n"
        "    heat_source.SMOOTH *= 1.01\n"
        "sys.argv = ['heat_source.py', '--lbfgs']\n"
        "heat_source.main()\n"
    )
    result, elapsed = run_job(script, 3, env={"OMP_NUM_THREADS": "1"}, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode != 0 and elapsed < 60, out[-2000:]
    assert "the L-BFGS iterates differ between ranks (ranks [1] differ from rank 0, bit for bit)" in out, out[
        -2000:
    ]


def test_the_slurm_scripts_parse_and_their_command_lines_are_train_gpts(comm, tmp_path):
    """examples/slurm/*.sbatch: bash runs them (srun a stand-in that writes down its arguments), and
    the flags they give train_gpt.py, with their variables expanded as bash expands them, are ones its
    parser accepts with these values (a renamed flag must not rot in a cluster script). A real Slurm
    runs cpu.sbatch in test_slurm.py where there is one."""
    if comm.size > 1:
        pytest.skip("single-process commands: the plain-pytest pass covers it")
    scripts = sorted((ROOT / "examples" / "slurm").glob("*.sbatch"))
    assert [s.name for s in scripts] == ["cpu.sbatch", "gpu.sbatch"]
    (tmp_path / "srun").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$SRUN_ARGS"\n')
    (tmp_path / "srun").chmod(0o755)
    for script in scripts:
        env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SRUN_ARGS": str(tmp_path / "args"),
               "OUT": str(tmp_path / "out")}  # fmt: skip
        ran = subprocess.run(["bash", str(script)], env=env, cwd=ROOT, capture_output=True, text=True)
        assert ran.returncode == 0, f"{script.name}: {ran.stderr[-1500:]}"
        args = (tmp_path / "args").read_text().splitlines()
        flags = args[args.index("examples/train_gpt.py") + 1 :]
        assert "--resume" in flags and "--save_dir" in flags and "--save_every" in flags, flags
        check = (
            "import sys; sys.path.insert(0, 'examples'); import train_gpt; "
            f"sys.argv = ['train_gpt.py', *{flags!r}]; print(train_gpt.parse_config().device)"
        )
        done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 0, f"{script.name}: {done.stderr[-1500:]}"


def test_train_gpt_never_fails_a_finished_run_over_its_pictures(tmp_path, monkeypatch):
    """Drawing the pictures is optional: a failure there (a file they cannot read, a plotting error)
    is said in one line, and the run goes on to its sample and final line (it ended rc 1 on rank 0)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_gpt_example", ROOT / "examples" / "train_gpt.py")
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, example)
    spec.loader.exec_module(example)

    def fails(path):
        raise RuntimeError("a plotting error")

    monkeypatch.setattr(example.pictures, "draw", fails)
    said = example.draw_pictures(str(tmp_path / "m.jsonl"))
    assert said.startswith("pictures not drawn (RuntimeError: a plotting error)"), said


def test_heat_source_refuses_flags_its_deterministic_mode_would_ignore(comm):
    out = run_example(
        comm, 1, ROOT / "examples" / "heat_source.py", "--deterministic", "--lbfgs", returncode=2
    )
    assert "--deterministic runs momentum SGD without checkpoints: drop --lbfgs" in out


def test_train_gpt_names_a_bad_flag_before_it_trains(comm, tmp_path):
    """--dtype bogus, --seed -1: tracebacks not naming the flag; --save_dir a dangling symbolic link:
    taken for a first run, failing at the first save with the steps before it lost."""
    (tmp_path / "ck").symlink_to(tmp_path / "gone")
    flags = ["--dtype", "bogus", "--seed", -1, "--save_every", 5, "--save_dir", tmp_path / "ck"]
    out = run_example(
        comm, 1, ROOT / "examples" / "train_gpt.py", *flags, "--log_level", "loud", returncode=2
    )
    assert "--dtype 'bogus' (float32 or float64" in out and "--seed -1 (must be >= 0)" in out, out
    assert "--log_level 'loud' (debug, info, warning or error)" in out
    link = f"--save_dir {tmp_path / 'ck'} (a symbolic link to {tmp_path / 'gone'}, which does not exist)"
    assert link in out, out


def test_train_gpt_saves_and_exits_0_when_the_scheduler_warns_one_rank(comm, tmp_path):
    """sbatch --signal=USR1@120: the warning before a time limit or preemption. train_gpt had no
    handler (the signal ended it, the steps since its last checkpoint lost). Every rank stops after the
    same step, it is saved, the job ends with status 0, and --resume latest continues from it."""
    if comm.size > 1:
        pytest.skip("drives its own mpiexec: runs in the plain-pytest pass of make test")
    import signal
    import subprocess
    import time

    from mpifsdp.checkpoint import checkpoints

    from support import processes_running

    small = ["--n_layer", 1, "--n_embd", 16, "--n_head", 2, "--block_size", 16, "--batch_size", 4,
             "--sample_tokens", 2, "--eval_every", 100000, "--log_every", 1]  # fmt: skip
    script = tmp_path / "train_gpt.py"  # its own path, to find its ranks by
    script.write_text((ROOT / "examples" / "train_gpt.py").read_text())
    ckpt = ["--save_dir", tmp_path / "ck", "--save_every", 100000, "--metrics", tmp_path / "m.jsonl"]
    cmd = [
        *mpiexec(),
        "-n",
        "2",
        sys.executable,
        "-m",
        "mpi4py",
        script,
        "--max_steps",
        100000,
        *ckpt,
        *small,
    ]
    job = subprocess.Popen(list(map(str, cmd)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)  # fmt: skip
    try:
        for _ in range(600):  # until it has trained a few steps
            lines = (tmp_path / "m.jsonl").read_text().count("\n") if (tmp_path / "m.jsonl").exists() else 0
            if lines >= 3:
                break
            time.sleep(0.1)
        ranks = sorted(int(p) for p in processes_running(str(script)))
        os.kill(ranks[-1], signal.SIGUSR1)  # one rank's warning: the other learns it at the step's end
        out, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out[-3000:]
    step = int(out.split("stopped after step ")[1].split()[0])
    assert [p.name for p in checkpoints(tmp_path / "ck")] == [f"step-{step:08d}"], out[-2000:]
    resumed = run_example(comm, 2, script, "--max_steps", step + 2, *ckpt, "--resume", "latest", *small)
    assert f"resumed from {tmp_path / 'ck' / f'step-{step:08d}'} at step {step}" in resumed


def test_train_gpt_trains_the_fast_gpu_way_on_the_standin_gpus(comm, tmp_path):
    """gpu.sbatch's flags, run on 2 stand-in GPUs (tools/gpusim: CuPy and NCCL on NumPy, CUDA graphs
    captured and replayed as a device does): float16 with the loss scaler, eagerly and from one CUDA
    graph a step, with the same loss at every step; bfloat16 with recompute and 2 micro-batches, the
    same again. What the graphs cannot replay is named before training."""
    small = ["--n_layer", 2, "--n_embd", 32, "--n_head", 2, "--block_size", 16, "--batch_size", 4,
             "--max_steps", 6, "--sample_tokens", 2, "--eval_every", 100, "--device", "cuda",
             "--transport", "nccl"]  # fmt: skip
    gpus = ["-m", "gpusim", "--gpus", 2, ROOT / "examples" / "train_gpt.py", *small]

    def losses(*flags) -> tuple[list[float], dict]:
        """The run's loss at every step, and its closing JSON line."""
        metrics = tmp_path / f"m{len(list(tmp_path.iterdir()))}.jsonl"
        out = run_example(comm, 2, *gpus, *flags, "--metrics", metrics)
        return step_losses(metrics), json.loads(out.strip().splitlines()[-1])

    for flags in (["--param_dtype", "float16"], ["--param_dtype", "bfloat16", "--recompute", "true",
                                                  "--grad_accum", 2]):  # fmt: skip
        eager, said = losses(*flags)
        assert len(eager) == 6 and all(math.isfinite(v) for v in eager), eager
        assert ("loss_scale" in said) == (flags[1] == "float16") and "graph_replays" not in said, said
        graphed, said = losses(*flags, "--graphs", "true")
        assert graphed == eager and said["graph_replays"] == 4, (flags, said)  # 6 steps: eager, capture, 4
    script = ROOT / "examples" / "train_gpt.py"
    out = run_example(comm, 1, script, "--graphs", "true", "--dropout", 0.1, returncode=2)
    assert "--graphs with --device cpu (CUDA graphs need --device cuda)" in out
    assert "--graphs with --dropout 0.1" in out and "--graphs without --param_dtype" in out


def test_every_train_gpt_flag_says_what_it_does():
    """38 flags, most with no help text: each field's comment in TrainConfig or GPTConfig is its help."""
    import dataclasses
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_gpt_help", ROOT / "examples" / "train_gpt.py")
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example
    try:
        spec.loader.exec_module(example)
        helps = example.field_help()
        fields = [f.name for f in dataclasses.fields(example.TrainConfig)]
    finally:
        del sys.modules[spec.name]
    assert len(fields) >= 38 and [f for f in fields if len(helps.get(f, "")) < 8] == []
    assert helps["beta1"] == "AdamW's first-moment decay" and helps["block_size"].startswith("the longest")
