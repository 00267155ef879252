"""The GPU step's launches and host syncs, counted on a CPU (bench/gpu_budget.py, CuPy replaced by a
NumPy stand-in). Issue 30's budgets are met: host syncs (none in forward and backward, the step's
verdict and the loss: 2 a step) and launches (<= 25 per layer). This holds today's figures, so that
they only go down: a change that adds a host sync or a launch per layer fails here."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT, mpiexec, require, run_job

GPUSIM = ROOT / "tools" / "gpusim"  # the stand-in GPU, installed in the venv (make install)
STANDIN = GPUSIM / "__main__.py"  # `python -m gpusim`: runs a script with CuPy (and cuDNN) stood in for
BENCH = ROOT / "bench"


def _last_json_line(*command, env=None) -> dict:
    """The last JSON line of `python *command` (with `env` added to the environment), once it exited 0."""
    done = subprocess.run([sys.executable, *map(str, command)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_gpu_steps_host_syncs_and_launches_do_not_grow(comm):
    if comm.size > 1:
        pytest.skip("one single-process job: the plain-pytest pass covers it")
    budget = _last_json_line(BENCH / "gpu_budget.py")
    syncs = budget["syncs"]
    # backward: no wait for its collectives (was 49 + 24, then one Comm.settle): the step's read waits
    assert "backward" not in syncs, syncs
    # the step: its verdict, the gradient norm's dots and the overflow flags in one read, behind the
    # collectives on the stream, polled under the watchdog (was 25 norms, then 2 reads)
    assert syncs.get("optimizer") == {"eventQuery": 1}, syncs
    assert budget["host_syncs_per_step"] <= 2 and budget["host_syncs_in_step"] <= 1, budget  # + the loss
    # forward: no collective waits (was 25), and with the batch on the host its checks read nothing
    # back from the device (was 9, then 6 with a device batch)
    assert "forward" not in syncs, syncs
    # a batch already on the device: its ids and targets checked there, the verdict read with the
    # step's, and its valid count summed there (was 5: two id checks, the embedding's range, the
    # targets' range, the count)
    assert budget["device_batch_syncs_in_passes"] == 0, budget
    # raw kernels for LayerNorm, cross-entropy, AdamW (decay, unscale and clip in it) and the NaN flag;
    # the norm's dots read at once; VJPs writing into zeroed gradients: 167.5 -> 62.7; cuDNN's fused
    # attention (one launch each way): 50.7; the host batch's positions copied, not made: 49.8; the
    # residual stream's gradient added inside LayerNorm's backward kernel: 47.8; the projections' bias
    # and residual added in one pass (linear_add): 45.8; the backward's gathers send the float16 cast
    # their forward kept, checked then: 43.8; every group's sum of squares in two launches: 42.8; the
    # overflow flags never zeroed (a new token a step): 41.8; LayerNorm's backward adds the blocks'
    # partial sums in its last block (no second kernel): 39.7; zero_grad's fill left to a reader (the
    # next reduce-scatter writes over the shard): 38.6; the stand-in counts ndarray.fill too (the
    # pool's zeroed gradient buffer, one a unit, had gone uncounted): 39.7; that buffer left unfilled
    # (the first gradient is written, not added; a parameter backward never reaches gets zeros): 38.6;
    # every group's AdamW in one launch (a table of the groups, their hyperparameters copied): 37.7;
    # layer_norm_linear keeps its LayerNorm's output on a GPU (no recompute in backward): 35.6;
    # the second LayerNorm's backward kernel writes the attention projection's bias gradient, the
    # column sums of the residual stream's gradient it forms (tape.SumsWritten): 34.6; and the MLP's
    # backward GELU kernel the first linear's, the column sums of the gradient it forms: 33.6; a
    # gather's cast and its overflow check in one kernel, on this rank's shard (the ranks' flags
    # agree at the step's verdict): 32.6; a unit's gradient gathered in float32, the weight
    # gradients' GEMMs writing it through cuBLAS's gemmEx and the kernels their column sums in
    # float32 (no cast before the reduce-scatter): 31.5; the next unit's gradient bound before its
    # backward, so the LayerNorm that last uses a block's output writes that block's projection bias
    # gradient: 30.5; the MLP's first bias added inside its GELU: 29.5; AdamW's update kernel
    # writing the next forward's float16 casts (no cast launch in the forward's gathers): 28.6;
    # the qkv bias folded into its GEMM as one more row of the weight, against a ones column the
    # first LayerNorm pads its output with (no add forward, no column sum backward: the weight
    # gradient's GEMM gives it), and each branch's closing projection accumulating into the residual
    # plus its bias, which the branch's LayerNorm kernel wrote on its way (cuda/fused.py Seed): 24.6; the
    # stand-in's asarray returning a device array of the asked dtype as it is, as CuPy's does (it
    # counted a copy): 24.5; the loss scale a device scalar (no copy of it a step) and the overflow
    # flags' tokens a constant (their device array copied once): 24.4 (budget: 25)
    assert budget["launches_per_layer"] <= 24.4, budget
    # the step's host share (wall time less the stand-in's device work): a figure, not a target here,
    # but the accounting must leave a positive remainder
    assert budget["host_ms_per_step"] > 0, budget


def test_what_a_cuda_graph_of_the_step_would_freeze_is_found_and_does_not_grow(comm):
    """bench/graph_readiness.py: two recorded steps launch the same sequence (one graph could fit
    every step), and the launches that take a per-step value from the host are found by name: the
    AdamW groups table (lr, bias corrections), and the loss scale's rewrite when it changes, both in
    the optimizer's step. The forward and backward take none, the two steps' batches differing
    (their valid-target counts too): the loss scale is a device scalar, the overflow flags' token a
    constant, the count read on the device from the end of the targets' copy (were 3); they sync
    nothing, and their host copies are the batch's, so a graph could capture them. These counts
    only go down."""
    if comm.size > 1:
        pytest.skip("one single-process job: the plain-pytest pass covers it")
    ready = _last_json_line(BENCH / "graph_readiness.py")
    assert ready["same_sequence"] and ready["launches"] > 0, ready
    per_step = ready["per_step_values"]
    assert "optimizer host-to-device copy at cuda/adamw.py:_launch_groups" in per_step, per_step
    assert sum(per_step.values()) <= 2 and sum(ready["host_to_device_copies"].values()) <= 4, ready
    assert not [name for name in per_step if not name.startswith("optimizer ")], per_step
    assert ready["host_syncs_in_step"] <= 1 and ready["forward_backward_capturable"], ready


def test_the_host_profile_names_the_librarys_functions(comm):
    """gpu_budget.py --host-profile: where the step's host time goes, by mpifsdp function, sampled
    while the stand-in does no device work (a share per function, of the host's samples)."""
    if comm.size > 1:
        pytest.skip("one single-process job: the plain-pytest pass covers it")
    profile = _last_json_line(BENCH / "gpu_budget.py", "--host-profile", "30")["host_profile"]
    assert len(profile) == 30 and all(0 < share <= 100 for _, share in profile), profile
    assert all(name.split(":")[0].endswith(".py") for name, _ in profile), profile
    # the backward sweep runs most of a step on an idle machine (~55 %); under load the sampler
    # over-weighs the forward (a CI rehearsal beside other work: 24 %, eleventh), so among the 30
    assert "tape.py:backward" in dict(profile), profile


@pytest.mark.parametrize("sharded", [[], ["--sharded", "--transport", "nccl"]], ids=["whole", "sharded-nccl"])
def test_the_gpu_path_computes_what_the_cpu_path_does(comm, sharded):
    """gpu_check.py's parity check (3 training steps, float64 and float32, CPU against "GPU") run with
    the stand-in: the GPU branches and every raw kernel's twin, wired as on a device."""
    if comm.size > 1:
        pytest.skip("one single-process job: the plain-pytest pass covers it")
    assert _last_json_line(STANDIN, BENCH / "gpu_check.py", "parity", *sharded)["ok"]


def test_the_gpu_paths_gradients_and_scaled_steps_are_the_cpus(comm):
    """tools/gpusim/standin_checks.py: a sharded float64 GPT, GPU branches (stand-in) against the CPU: its
    gradient shards after one backward (the VJPs write into the zeroed gradients) and after three
    no_sync micro-batches (the later ones must add, not write) and through checkpointed blocks (the
    re-run forward keeps its LayerNorm outputs on a GPU too), and its parameters after three
    LossScaler steps that clip (a GPU folds the unscale and the clip into AdamW's kernel); a host batch
    and float16 gathers reusing their forward's casts give the same bits as a device batch and fresh
    casts; float16 and bfloat16 gathers (the raw kernels in that type) give float32's gradients within
    the 16-bit type's rounding; bfloat16 over host-staged MPI gathers as 16-bit words; a parameter
    a unit's backward never reaches gets zeros in the unfilled (NaN on the stand-in) gradient buffer;
    the most device memory alive in a step is the plan's total (the loss's gradient in it) within 5 %."""
    if comm.size > 1:
        pytest.skip("one single-process job: the plain-pytest pass covers it")
    assert _last_json_line(STANDIN, GPUSIM / "standin_checks.py")["ok"]


def test_a_phantom_rank_of_n_on_the_gpu_branches_is_one_ranks_first_step_and_the_plans_memory(comm):
    """tools/gpusim/standin_phantom.py: mpifsdp.PhantomComm on the GPU branches (stand-in) as rank k of
    2, 4 and 8: its first step equals one rank's bit for bit (float64), its ledgers (shards, gathered
    peaks, gathered and reduce-scattered elements) are plan(gpu=True)'s for rank k of N, the device
    memory alive at its peak is within 1.15 times the plan's total; and one rank with its shortcuts
    off runs its gathers and reduce-scatters through the transport to the same bits."""
    if comm.size > 1:
        pytest.skip("one single-process job: the plain-pytest pass covers it")
    result = _last_json_line(STANDIN, GPUSIM / "standin_phantom.py")
    assert result["ok"], result


@pytest.mark.parametrize("cudnn", [[], ["--no-cudnn"]], ids=["cudnn", "no-cudnn"])
def test_graphed_passes_replay_the_eager_steps_and_refuse_what_a_graph_cannot_hold(comm, cudnn):
    """tools/gpusim/standin_graphs.py: a sharded GPT's forward and backward captured in a CUDA graph and
    replayed (the stand-in records launches as a capture does and refuses host syncs, host copies
    and collectives it does not reach): float16 gathers, a loss scale and an lr changing every step,
    host or device batches, eager evaluations in between, several sharding configurations, with
    cuDNN's attention: every loss and parameter of the eager steps, bit for bit. A bad
    device batch is named at the verdict; a host value that changes per call fails the capture's
    self-check; a phantom rank of 4 (its copies on its own stream) and one rank with its shortcuts
    off (NCCL's own gathers) replay too; a forgotten zero_grad, dropout, MPI transports and
    deterministic mode are refused by name; the host issues a few launches a step, not hundreds.
    Without cuDNN, attention's batched GEMMs go through CuPy's matmul, which CuPy cannot capture:
    refused by name at the capture."""
    if comm.size > 1:
        pytest.skip("one single-process job: the plain-pytest pass covers it")
    accept = {"MPIFSDP_ALLOW_SLOW": "1"} if cudnn else {}  # no cuDNN: its slow path, accepted
    result = _last_json_line(STANDIN, *cudnn, GPUSIM / "standin_graphs.py", env=accept)
    assert result["ok"] and result["cudnn"] == (not cudnn), result
    if cudnn:  # no cuDNN: attention's batched GEMMs through CuPy's matmul, refused by name at capture
        assert result["refused_at_capture"], result
        return
    work = result["host_work_per_step"]
    assert work["graphed"]["launches"] * 10 < work["eager"]["launches"], work
    assert work["whole_step"]["launches"] == 3, work  # the graph and the batch's two copies


def test_the_whole_step_in_one_graph_equals_eager_steps_and_stops_a_step_late(comm):
    """tools/gpusim/standin_whole_step.py: GraphedPasses(..., optimizer=, scaler=, max_norm=) holds the
    optimizer's step too (the norm, its verdict, the loss scale, the step counts and AdamW on the
    device): the eager steps' losses, parameters and counts bit for bit through skipped and clipped
    steps and a growing scale, at one rank with and without its shortcuts, a phantom rank of 4,
    recomputed blocks and without a scaler; one host sync a replayed step and no launch but the
    graph's, the batch's and the lr's; a bad batch, a NaN master, a norm not finite and an overflow
    at the scale's floor raise a step late with nothing updated, and a call after that is refused;
    another optimizer, another model's, a scaler alone, a bad max_norm refused by name."""
    if comm.size > 1:
        pytest.skip("one single-process job: the plain-pytest pass covers it")
    result = _last_json_line(STANDIN, GPUSIM / "standin_whole_step.py")
    assert result["ok"], result
    assert result["host_work"]["launches_per_step"] == {"graph launch": 1, "host-to-device copy": 3}, result


def test_an_overflow_in_one_ranks_shard_is_raised_on_every_rank(comm):
    """tools/gpusim/standin_ranks.py on 2 ranks (MPI with host staging): a GPU's gathers check each rank's
    own shard as they cast it (one kernel), so a master beyond float16 on the last rank only is
    raised at the optimizer's verdict on both, naming the unit, and the next step, back in range,
    steps on both. Over the stand-in's NCCL, forward and backward replayed from a CUDA graph equal
    the eager steps on both ranks, and a rank that ran an evaluation alone is named on both by the
    schedule check before the replay (without it the graph's collectives would hang). HSDP's
    all-reduce across groups and sync_params' broadcast run on NCCL there (device memory is never
    handed to MPI, which need not be CUDA-aware), with the CPU's losses."""
    if comm.size > 1:
        pytest.skip("starts its own 2-rank job: the plain-pytest pass covers it")
    result, _ = run_job(STANDIN, 2, GPUSIM / "standin_ranks.py")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["ranks"] == 2, report


def test_the_gpu_paths_training_over_nccl_at_two_ranks_is_the_cpus(comm):
    """bench/gpu_check.py parity on 2 ranks over the stand-in's NCCL (through MPI): the sharded GPT's
    losses over 3 steps on the GPU branches equal the CPU's at N = 2 (float64 within 1e-10)."""
    if comm.size > 1:
        pytest.skip("starts its own 2-rank job: the plain-pytest pass covers it")
    check = ["--gpus", "2", BENCH / "gpu_check.py", "parity", "--sharded", "--transport", "nccl"]
    result, _ = run_job(STANDIN, 2, *check)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["ranks"] == 2 and report["transport"] == "nccl", report


def test_two_ranks_share_one_gpu_over_nccl_only_where_its_version_lets_them(comm):
    """bench/gpu_check.py parity on 2 ranks and one stand-in GPU, NCCL_MULTI_RANK_GPU_ENABLE=1: over
    an NCCL reporting 2.30 the ranks choose NCCL and train to the CPU's losses; over 2.28 transport
    'nccl' is refused on every rank, naming the version and the variable (no hang)."""
    if comm.size > 1:
        pytest.skip("starts its own 2-rank jobs: the plain-pytest pass covers it")
    asked = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    parity = [BENCH / "gpu_check.py", "parity", "--sharded", "--transport", "nccl"]
    result, _ = run_job(STANDIN, 2, "--gpus", "1", "--nccl-version", "23000", *parity, env=asked)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["ranks"] == 2 and report["transport"] == "nccl", report
    old, _ = run_job(STANDIN, 2, "--gpus", "1", "--nccl-version", "22800", *parity, env=asked)
    said = old.stdout + old.stderr
    assert old.returncode != 0 and "NCCL needs one rank per GPU" in said and "2.30" in said, said[-2000:]


@pytest.mark.parametrize("cudnn", [[], ["--no-cudnn"]], ids=["cudnn", "no-cudnn"])
def test_the_gpu_attention_computes_causal_attention(comm, cudnn):
    """tools/gpusim/standin_attention.py: float16 attention_qkv forward and backward on the GPU branch against
    float64, within the first-use check's bound. With cuDNN (its twin): one launch each way, and a
    planted fault in it refused by the first-use check, naming it; without: refused (issue 50: no
    silent slow path) naming cuDNN and MPIFSDP_ALLOW_SLOW, and with that set, one line says why and
    the batched passes compute the same."""
    if comm.size > 1:
        pytest.skip("one single-process job: the plain-pytest pass covers it")
    result = _last_json_line(STANDIN, *cudnn, GPUSIM / "standin_attention.py")
    assert result["ok"] and result["cudnn"] == (not cudnn), result


@pytest.mark.parametrize(
    "check",
    [
        ["attention"],
        ["roofline"],
        ["columns"],
        ["speed", "--dtype", "bfloat16", "--steps", "1"],
        ["speed", "--dtype", "bfloat16", "--steps", "1", "--graph", "--transport", "nccl"],
        ["speed", "--dtype", "bfloat16", "--steps", "1", "--graph", "--phantom", "8", "--recompute", "yes"],
        ["preflight"],
        ["replay", "--transport", "nccl"],
    ],
    ids=" ".join,
)
def test_the_device_scripts_new_checks_run_through_on_the_stand_in(comm, check):
    """make gpu-check's attention, roofline, columns, preflight, replay (graphed steps against eager
    ones, bit for bit, and the whole step's) and bfloat16 speed checks (eager, replayed from a CUDA
    graph of the passes and then of the whole step, whose line comes last and reads its verdict once
    a step, and as rank 0 of 8 alone) run to their JSON line with the stand-in
    (a crash would cost a lent device's minutes; their figures mean something on a device only)."""
    if comm.size > 1:
        pytest.skip("one single-process job: the plain-pytest pass covers it")
    result = _last_json_line(STANDIN, BENCH / "gpu_check.py", *check, "--config", "tiny")
    assert result["check"] == check[0] + ("_whole_step" if "--graph" in check else "")
    if "--graph" in check:
        assert result["host_syncs_per_step"] == 1.0, result


def test_the_preflight_finds_every_libnccl_and_its_version(comm, tmp_path):
    """gpu_check.py's preflight lists each libnccl on the library path with the version it reports
    (ncclGetVersion's code: 23001 is 2.30.1), so a device run says which NCCL may let ranks share a
    GPU; a file that does not load is listed with no version. Two stand-ins built here by the C
    compiler (asked first)."""
    if comm.size > 1:
        pytest.skip("one single-process job: the plain-pytest pass covers it")
    compiler = shutil.which("cc") or shutil.which("gcc")
    require(None if compiler else "no C compiler (cc, gcc) to build a stand-in libnccl")
    lib = tmp_path / "nvidia" / "nccl" / "lib"
    lib.mkdir(parents=True)
    source = tmp_path / "nccl.c"
    source.write_text("int ncclGetVersion(int *version) { *version = 23001; return 0; }\n")
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(lib / "libnccl.so.2"), str(source)], check=True)
    (tmp_path / "libnccl.so.1").write_text("not a library")
    script = (
        "import sys, json; sys.path.insert(0, 'bench'); import gpu_check; "
        "print(json.dumps(gpu_check.every_libnccl()))"
    )
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    found = {Path(row["path"]).name: row["version"] for row in json.loads(done.stdout)
             if row["path"].startswith(str(tmp_path))}  # fmt: skip
    assert found == {"libnccl.so.2": "2.30.1", "libnccl.so.1": None}, found


def test_the_device_script_runs_through_without_a_device(comm, tmp_path):
    """make gpu-check's own script, dry (GPU_CHECK_DEVICE=cpu: every step on the CPU, the small
    models): each step runs and passes, so a lent device's minutes are not spent on a broken script
    (its float16 step on a GPT too wide for NumPy's float16 GEMMs once timed out here); each JSON
    line carries its provenance."""
    if comm.size > 1:
        pytest.skip("one single-process job: the plain-pytest pass covers it")
    env = {
        **os.environ,
        "GPU_CHECK_DEVICE": "cpu",
        "OUT": str(tmp_path),
        "PYTHON": sys.executable,
        "MPIEXEC": " ".join(mpiexec()),
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(["bash", str(BENCH / "gpu_check.sh")], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "gpu-check passed" in done.stdout, (
        done.stdout[-3000:] + done.stderr[-2000:]
    )
    # every figure says what it stands on (issue 50): the commit, the source that ran, the libraries
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"check"')]
    assert len(rows) >= 3, done.stdout[-3000:]
    for row in rows:
        assert {"commit", "dirty", "source", "mpi", "numpy"} <= set(row["provenance"]), row
    assert len({row["provenance"]["source"] for row in rows}) == 1
