"""Mutants: each switches one safety mechanism off, so tests/failures/test_mutations.py can show that the test
named for it fails without it (a safety test that cannot fail proves nothing).

A mutant is applied at interpreter start by this folder's sitecustomize.py when MPIFSDP_MUTANT names
it, so it reaches every process of a run: pytest itself, and the mpiexec jobs tests start.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def _replace(owner, attribute: str, new):
    """Swap owner.attribute for `new`; refuses a name that no longer exists (a renamed mechanism
    must not turn its mutant into a silent no-op)."""
    if not hasattr(owner, attribute):
        raise AttributeError(f"mutant target {owner.__name__}.{attribute} does not exist")
    setattr(owner, attribute, new)


def _gather_moves_unchecked():
    """A unit's gather state takes any move (shard/gather.py's table not consulted)."""
    from mpifsdp.shard import unit

    _replace(unit, "moved", lambda name, now, to: to)


def _settings_not_compared():
    """Ranks' settings all digest alike (fsdp/model.py's `digest`)."""
    from mpifsdp.fsdp import model

    _replace(model, "digest", lambda *parts: 0)


def _saved_settings_not_compared():
    from mpifsdp.checkpoint import sharded

    _replace(sharded, "check_settings", lambda manifest, model, directory: None)


def _export_config_not_compared():
    from mpifsdp.models import hf_gpt2

    _replace(hf_gpt2, "_agrees_with_export", lambda config, directory: None)


def _torn_lines_kept():
    from mpifsdp.observe import metrics

    _replace(metrics, "_whole_lines", lambda path: [(line, 0) for line in path.read_bytes().splitlines(True)])


def _disposition_ignored():
    from mpifsdp.base import files

    _replace(files, "_ends_the_process", lambda handler: True)


def _levels_not_split():
    from mpifsdp.shard import exact

    _replace(exact, "SPLIT_LEVEL", 10**6)


def _manifests_not_compared():
    from mpifsdp.checkpoint import sharded

    _replace(sharded, "manifest_digest", lambda manifest: "")


def _sizes_in_int64():
    """A deferred parameter's size as an int64 product again (autodiff/tensor.py Param.size)."""
    import math

    import numpy as np

    _replace(math, "prod", lambda values, start=1: int(np.prod(list(values), dtype=np.int64)) * start)


def _launcher_not_checked():
    from mpifsdp.comm import launcher

    _replace(launcher, "launcher_problem", lambda rank, size: None)


def _slow_path_warned_only():
    import logging

    from mpifsdp.base import kernels

    say = logging.getLogger("mpifsdp").warning
    _replace(kernels, "slow_path", lambda what, why: say("%s: %s", what, why))


def _cuda_awareness_not_asked():
    from mpifsdp.comm import transport

    _replace(transport, "mpi_cuda_support", lambda: (None, "not asked"))


def _phantom_checkpoints_taken():
    from mpifsdp.comm import phantom

    _replace(phantom.PhantomComm, "stands_in", False)  # a phantom taken for a job of real ranks


def _nccl_version_not_asked():
    from mpifsdp.base import backend

    _replace(backend, "NCCL_SHARES_GPUS", 0)  # any NCCL taken to let ranks share a GPU when asked


def _graphed_skips_updated():
    """adamw_groups updates a step its verdict skipped (the stand-in runs the kernel's twin, given a
    skip flag of 0)."""
    import numpy as np

    from mpifsdp.base import kernels

    twin = kernels.TWINS["adamw_groups"]
    kernels.TWINS["adamw_groups"] = lambda grid, block, args, shared_mem=0: twin(
        grid, block, (*args[:-1], np.zeros(1, dtype=np.int32)), shared_mem
    )


def _graphed_stop_forgotten():
    from mpifsdp.optim import device_step

    _replace(device_step.DeviceStep, "_refuse_if_stopped", lambda self: None)


def _overflow_skipped_unread():
    from mpifsdp.optim import scaler

    _replace(scaler, "raise_found_first", lambda optimizer: None)


def _offload_owner_not_asked():
    import types

    from mpifsdp.optim import offload

    unlocked = types.SimpleNamespace(flock=lambda file, how: None, LOCK_EX=0, LOCK_NB=0)
    _replace(offload, "fcntl", unlocked)  # any owner file taken, held by a live process or not


def _job_warnings_on_every_rank():
    from mpifsdp.base import logs

    _replace(logs, "speaks", lambda rank: True)  # every rank takes itself for the one that speaks


def _slurm_job_not_recorded():
    from mpifsdp.checkpoint import lock

    _replace(lock, "_slurm_job", lambda: "")


def _no_schedule_check():
    from mpifsdp.comm.communicator import Comm

    _replace(Comm, "check_schedule", lambda self, **kw: None)


def _no_debug_check():
    from mpifsdp.comm.communicator import Comm

    _replace(Comm, "_announce", lambda self, *args: self.schedule.announce(*args))


def _unwatched_clone():
    from mpifsdp.comm.communicator import Comm

    _replace(Comm, "_clone", lambda self, base: base.Clone())


def _float_sum_of_chunks():
    """The chunks' gradients summed as floats (locally, then by a float reduce-scatter)."""
    import types

    import numpy as np

    from mpifsdp.shard.exact import ExactSum

    def add(self, chunk, weight=1):
        total = getattr(self, "floats", None)
        self.floats = chunk.astype(np.float64) * weight + (0 if total is None else total)
        self.weight += weight

    def start_reduce_scatter(self, comm, shard_numel, replicas=None, *, unit, phase):
        weight = sum(comm.allgather_object(self.weight, phase=phase))
        full = getattr(self, "floats", None)
        full = np.zeros(self.numel) if full is None else full
        part = np.empty(shard_numel)
        comm.reduce_scatter(full, part, unit=unit, phase=phase)
        self.floats, self.weight = None, 0
        return types.SimpleNamespace(finish=lambda: (part, weight))

    _replace(ExactSum, "add", add)
    _replace(ExactSum, "start_reduce_scatter", start_reduce_scatter)


def _blas_threads_free():
    import contextlib

    import mpifsdp.fsdp.deterministic

    _replace(mpifsdp.fsdp.deterministic, "blas_pinned", lambda threads=1: contextlib.nullcontext())


def _no_device_settle():
    from mpifsdp.comm.communicator import Comm

    _replace(Comm, "settle", lambda self, purpose="": None)


def _unwatched_device_read():
    import numpy as np

    from mpifsdp.comm.communicator import Comm

    _replace(Comm, "read", lambda self, arrays, purpose: [np.asarray(a) for a in arrays])


def _merge_past_headroom():
    from mpifsdp.shard import exact

    _replace(exact, "merged_level", lambda levels, chunks: levels[-1] if len(levels) > 1 else None)


def _offset_below_negatives():
    import numpy as np

    from mpifsdp.shard import exact

    _replace(exact, "ROUNDING_OFFSET", 2.0**52)
    _replace(exact, "OFFSET_BITS", int(np.float64(2.0**52).view(np.int64)))


def _sums_grouped_by_thread():
    """LayerNorm's weight and bias gradients summed by each thread's rows: the partials, and so the
    bits, then depend on how many threads split the rows."""
    from mpifsdp.base import threads
    from mpifsdp.ops import fused

    _replace(fused, "sum_group", lambda rows, row_elements: -(-rows // threads.elementwise_threads()))


def _single_block_blas_free():
    """Attention's heads, in one block, run their GEMMs at the rank's BLAS threads (in a
    deterministic chunk: chunk_threads), in several blocks at one thread each: their bits then depend
    on the elementwise thread count."""
    from mpifsdp.base import threads
    from mpifsdp.ops import fused

    def for_row_blocks(n_rows, row_elements, work, calls_blas=False, align=1):
        blocks = threads.row_blocks(n_rows, row_elements, align)
        if len(blocks) == 1:
            work(0, *blocks[0])
            return 1
        return threads.for_row_blocks(n_rows, row_elements, work, calls_blas, align)

    _replace(fused, "for_row_blocks", for_row_blocks)


def _no_step_verdict():
    from mpifsdp.optim.verdict import StepVerdict

    _replace(StepVerdict, "settle", lambda self: None)


def _random_state_not_saved():
    from mpifsdp.nn.module import Module

    _replace(Module, "random_state", lambda self: {})


def _no_watchdog():
    from mpifsdp.comm.schedule import Schedule

    _replace(Schedule, "wait", lambda self, request: request.Wait())


def _no_nonfinite_check():
    from mpifsdp.optim.optimizers import AdamW

    _replace(AdamW, "grad_norm", lambda self: 0.0)


def _no_uneven_batch_check():
    from mpifsdp.fsdp.model import ShardedModel

    _replace(ShardedModel, "check_inputs", lambda self, args, kwargs: None)


def _no_tied_weight_check():
    import mpifsdp.fsdp.partition

    _replace(mpifsdp.fsdp.partition, "shared_parameters", lambda owned: {})


def _nothing_cleaned_after_a_failed_backward():
    from mpifsdp.fsdp.model import ShardedModel

    _replace(ShardedModel, "backward_failed", lambda self: None)


def _generators_not_replayed():
    import mpifsdp.nn.layers

    _replace(mpifsdp.nn.layers, "_generators_in", lambda module: [])


def _no_draws_replay():
    import contextlib

    import mpifsdp.fsdp.lifecycle

    _replace(mpifsdp.fsdp.lifecycle, "draws_replay", lambda module: contextlib.nullcontext)


def _step_over_unreduced_gradients():
    from mpifsdp.shard.unit import Unit

    _replace(Unit, "flat_grad", lambda self: self.grad_shard if self.has_grad else None)


def _no_checksum():
    import mpifsdp.checkpoint.manifest

    _replace(mpifsdp.checkpoint.manifest, "_checksum_matches", lambda raw, segment, version: True)


def _no_manifest_checksum():
    import mpifsdp.checkpoint.manifest

    _replace(mpifsdp.checkpoint.manifest, "manifest_digest", lambda manifest: "0" * 64)


def _no_coverage_check():
    import mpifsdp.checkpoint.manifest

    _replace(mpifsdp.checkpoint.manifest, "_tiles", lambda ranges, numel: True)


def _no_recovery():
    import mpifsdp.checkpoint.publish

    _replace(mpifsdp.checkpoint.publish, "recover", lambda final: None)


def _readers_recover():
    import mpifsdp.checkpoint.publish as publish

    _replace(publish, "locate", publish.recover)


def _leftovers_not_seen():
    import mpifsdp.checkpoint.publish

    _replace(mpifsdp.checkpoint.publish, "named_by", lambda leftover: None)


def _termination_keeps_temporary_files():
    import signal

    import mpifsdp.base.files

    def end_at_once(number, frame):
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)

    _replace(mpifsdp.base.files, "_remove_then_end", end_at_once)


def _no_atomic_publish():
    """Write the checkpoint in place: no staging directory, no rename."""
    import mpifsdp.checkpoint.publish

    def in_place(final, comm):
        final.mkdir(parents=True, exist_ok=True)
        comm.barrier()
        return final

    _replace(mpifsdp.checkpoint.publish, "staging_dir", in_place)
    _replace(mpifsdp.checkpoint.publish, "move_into_place", lambda staging, final: None)


def _no_global_valid_count():
    from mpifsdp.fsdp.model import ShardedModel

    _replace(ShardedModel, "count_share", lambda self, local: local)


def _no_gradient_mean():
    """Reduce-scatter's sum kept, the 1/N dropped."""
    from mpifsdp.shard.unit import Unit

    finish = Unit.finish_reduce_grad

    def summed(self):
        if self._reducing is not None:
            request, receive, source, divisor = self._reducing
            self._reducing = (request, receive, source, 1)
        finish(self)

    _replace(Unit, "finish_reduce_grad", summed)


def _no_end_of_backward_sweep():
    from mpifsdp.fsdp.model import ShardedModel

    _replace(ShardedModel, "_sweep_unreached", lambda self: None)


def _any_file_name():
    import mpifsdp.checkpoint.manifest

    _replace(mpifsdp.checkpoint.manifest, "is_plain_name", lambda name: isinstance(name, str))


def _no_fence():
    import mpifsdp.checkpoint.manifest

    _replace(mpifsdp.checkpoint.manifest, "inside", lambda directory, name: directory / name)


def _prune_everything():
    import shutil

    import mpifsdp.checkpoint.publish

    _replace(
        mpifsdp.checkpoint.publish,
        "remove_ours",
        lambda directory: shutil.rmtree(directory, ignore_errors=True),
    )


def _errors_raised_where_they_happen():
    from mpifsdp.comm.communicator import Comm

    def local_only(self, error, what, error_type=None):
        if error:
            raise RuntimeError(f"{what} failed on rank {self.rank}: {error}")

    _replace(Comm, "raise_if_any", local_only)


def _no_initial_value_check():
    import mpifsdp.shard.flat

    _replace(mpifsdp.shard.flat, "bytes_digest", lambda arrays: "the same everywhere")


def _no_configuration_check():
    import mpifsdp.fsdp.build

    _replace(mpifsdp.fsdp.build, "configuration_differs", lambda model, comm: None)


def _no_schedule_check_in_the_optimizer_step():
    from mpifsdp.comm.communicator import Comm

    check = Comm.check_schedule
    _replace(
        Comm,
        "check_schedule",
        lambda self, phase="backward", **kw: None if phase == "optimizer" else check(self, phase=phase, **kw),
    )


def _no_input_check():
    from mpifsdp.fsdp.model import ShardedModel

    original = ShardedModel.check_inputs

    def sizes_only(self, args, kwargs):
        model = self._model()
        model.check_inputs = lambda *a, **k: None
        try:
            original(self, args, kwargs)
        finally:
            del model.check_inputs

    _replace(ShardedModel, "check_inputs", sizes_only)


def _no_writeback_agreement():
    import mpifsdp.shard.unit

    _replace(mpifsdp.shard.unit, "require_same_edit", lambda name, full, comm: None)


def _weights_checked_locally():
    from mpifsdp.shard.unit import Unit

    def local(self, weight, phase="backward"):  # the check before: on this rank, no exchange
        if weight is not None and not (isinstance(weight, (int, float)) and weight >= 0):
            raise ValueError(f"unit {self.name!r}: weight must be a finite number >= 0, got {weight!r}")
        return None if weight is None else [float(weight)] * self.comm.size

    _replace(Unit, "agreed_weights", local)


def _no_global_rng_replay():
    import contextlib

    import mpifsdp.autodiff.recompute

    _replace(mpifsdp.autodiff.recompute, "_global_rngs_at", lambda states: contextlib.nullcontext())


def _no_writer_lock():
    import mpifsdp.checkpoint.lock

    _replace(mpifsdp.checkpoint.lock, "hold", lambda lock: None)


def _no_exit_notices():
    import mpifsdp.comm.presence

    _replace(mpifsdp.comm.presence, "check", lambda request: None)


def _no_roll_call():
    import mpifsdp.comm.presence

    _replace(mpifsdp.comm.presence, "roll_call", lambda: "")


def _report_not_waited_for():
    import mpifsdp.comm.presence

    _replace(mpifsdp.comm.presence, "wait_until_read", lambda fd: None)


def _unreached_grads_left_unfilled():
    from mpifsdp.fsdp.lifecycle import UnitLifecycle

    _replace(UnitLifecycle, "_zero_unreached_grads", lambda self: None)


def _bias_sums_offered_to_any_use():
    """A producer's bias gradient offered to every use of its output, not only to the last one
    with every other use's gradient in hand."""
    from mpifsdp.autodiff import tape

    def bias_grad_of(self, t, adds_pending):
        bias = tape._bias_of(t._node)
        return bias.grad if bias is not None and tape._zeroed_grad(bias) else None

    _replace(tape._Sweep, "bias_grad_of", bias_grad_of)


def _overflow_verdict_not_agreed():
    """Each rank raises from its own shard's overflow flag alone."""
    from mpifsdp.optim.verdict import StepVerdict

    _replace(StepVerdict, "agreed", lambda self, overflowed, failed: (overflowed, failed))


def _zeroed_grads_always_fresh():
    from mpifsdp.shard.unit import Unit

    _replace(Unit, "holds_full_grad", lambda self: False)


def _grads_bound_ahead_kept():
    """A backward cut short keeps the gradient a unit had bound ahead of its backward."""
    from mpifsdp.fsdp.lifecycle import UnitLifecycle

    abandon = UnitLifecycle.abandon

    def keeps_grads_ahead(self):
        self._grads_ahead = False
        abandon(self)

    _replace(UnitLifecycle, "abandon", keeps_grads_ahead)


def _shard_handed_out_keeps_the_cast():
    """Taking `unit.shard` leaves the cast the optimizer wrote trusted as its cast."""
    from mpifsdp.shard.unit import Unit

    _replace(Unit, "shard", property(lambda self: self._shard))


def _written_cast_unchecked():
    """The cast the optimizer's kernel wrote (and flagged) is sent, its flag never read."""
    from mpifsdp.shard.unit import Unit

    def cast_written(self):
        self.casts._cast_current = True

    _replace(Unit, "cast_written", cast_written)


def _graph_leaves_the_host_as_it_finds_it():
    from mpifsdp.fsdp import graphed

    _replace(graphed, "_restore", lambda sharded, state: None)


def _graph_sends_the_optimizers_cast():
    from mpifsdp.shard.unit import Unit

    _replace(Unit, "cast_afresh", lambda self: None)


def _replayed_collectives_uncounted():
    from mpifsdp.comm.communicator import Comm

    _replace(Comm, "replayed", lambda self, collectives: None)


def _verdict_not_after_the_replay():
    from mpifsdp.comm.communicator import Comm

    _replace(Comm, "await_current", lambda self: None)


def _no_graph_self_check():
    from mpifsdp.fsdp import graphed

    _replace(graphed, "_compare", lambda reference, replayed, elements: None)


def _replay_over_unzeroed_gradients():
    from mpifsdp.fsdp import graphed

    _replace(graphed, "_require_zeroed", lambda sharded: None)


def _replayed_input_checks_dropped():
    from mpifsdp.fsdp import graphed

    _replace(graphed, "_defer_again", lambda checks: None)


def _device_memory_to_mpi():
    from mpi4py import MPI

    from mpifsdp.comm.communicator import Comm

    def iall_reduce(self, array, *, unit="", phase="other", hot=False):
        launch = lambda: self.mpi.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM)  # noqa: E731
        return self._start_all_reduce(launch, array, unit, phase, hot)

    _replace(Comm, "iall_reduce", iall_reduce)


def _cublas_on_its_own_workspaces():
    """cublasSetStream with no workspace of ours after it: cuBLAS allocates its own at a stream's
    first GEMM, which a capturing stream refuses."""
    import ctypes

    from mpifsdp.cuda import cublas_api

    def on_current_stream(self):
        stream = self.xp.cuda.get_current_stream().ptr
        if stream != self.stream:
            self.lib.cublasSetStream_v2(self.ptr, ctypes.c_void_p(stream))
            self.stream = stream
        return self.ptr

    _replace(cublas_api._Handle, "on_current_stream", on_current_stream)


def _gemms_through_cupys_matmul():
    from mpifsdp.cuda import gemm as gpu_gemm

    _replace(gpu_gemm, "matmul", lambda a, b: a @ b)


def _attention_check_without_its_floor():
    import numpy as np

    from mpifsdp.base.checks import finfo
    from mpifsdp.cuda import sdpa as gpu_attention

    def error_bound(dtype, T):
        return 8 * float(finfo(dtype).eps) + 2 * T * float(np.finfo(np.float32).eps), 0.0

    _replace(gpu_attention, "error_bound", error_bound)


def _bfloat16_limits_from_numpy():
    import numpy as np

    from mpifsdp.base import kernels

    _replace(kernels, "finfo", lambda dtype: np.finfo(dtype))


def _plan_without_the_loss_gradient():
    from mpifsdp.planning import planner

    _replace(planner, "gpt_loss_gradient_bytes", lambda config, batch, itemsize: 0)


def _column_sums_without_the_last_block():
    """add_rows' CUDA source leaves the last row out (of a group's blocks, or of the groups): its
    NumPy twins (what the stand-in runs by default) do not, so only a run of the source can see it."""
    from mpifsdp.base import kernels

    complete = "for (; k < count; ++k) {"
    assert kernels.BLOCK_REDUCE.count(complete) == 1, "the mutant's target changed: update it"
    short = kernels.BLOCK_REDUCE.replace(complete, "for (; k + 1 < count; ++k) {")
    _replace(kernels, "BLOCK_REDUCE", short)


def _support():
    """tests/support.py, for a mutant of the suite's own safety checks (tests/ is not yet on sys.path
    when this runs at interpreter start)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import support

    return support


def _machine_not_asked():
    """support.require lets every test run: one that needs a kernel this CPU lacks dies of SIGILL."""
    _replace(_support(), "require", lambda problem: None)


def _kernels_not_asked_for():
    """Every OpenBLAS kernel taken to run here: a test under one this CPU lacks dies of SIGILL."""
    import functools

    from mpifsdp.base import machine

    _replace(machine, "openblas_kernel_problem", functools.cache(lambda kernel: None))


def _shared_dir_not_asked_for():
    """Rank 0's directory handed to every rank unasked: across nodes, a rank that cannot see it fails."""
    support = _support()
    _replace(support, "shared_dir", lambda comm, tmp_path: comm.broadcast_object(str(tmp_path)))


def _staged_pyproject_edited(text: str, replacement: str):
    """The wheel test builds a copy of the source whose pyproject.toml has `text` replaced."""
    support = _support()
    staged = support.stage_source

    def stage_edited(dest):
        pyproject = staged(dest) / "pyproject.toml"
        assert text in pyproject.read_text(), "the mutant's target changed: update it"
        pyproject.write_text(pyproject.read_text().replace(text, replacement))
        return dest

    _replace(support, "stage_source", stage_edited)


def _a_subpackage_left_out_of_the_wheel():
    """The package list as it once was: setuptools' discovery told to leave mpifsdp.optim out, in the
    copy of the source the wheel test builds (the wheel then lacks it, as it lacked 12 packages)."""
    find = '[tool.setuptools.packages.find]\ninclude = ["mpifsdp*"]\n'
    _staged_pyproject_edited(find, find + 'exclude = ["mpifsdp.optim"]\n')


def _cuda_files_left_out_of_the_wheel():
    """No package-data: the wheel ships the Python alone, and every raw kernel's .cu file is missing."""
    _staged_pyproject_edited('[tool.setuptools.package-data]\n"*" = ["*.cu"]\n', "")


@dataclass
class Mutant:
    switch_off: callable
    mechanism: str
    tests: list  # pytest node ids that must fail with the mechanism off
    ranks: int = 1  # run them under mpiexec -n ranks when > 1


MUTANTS = {
    "no_silent_slow_path": Mutant(
        _slow_path_warned_only,
        "a GPU fast path that cannot run stops the run unless the slower one is accepted (base/kernels.py)",
        [
            "tests/unit/base/test_kernels.py::"
            "test_a_kernel_that_does_not_build_stops_the_run_unless_the_slow_path_is_accepted",
            "tests/project/test_gpu_budget.py::test_the_gpu_attention_computes_causal_attention[no-cudnn]",
        ],
    ),
    "cuda_awareness_asked": Mutant(
        _cuda_awareness_not_asked,
        "the MPI is asked whether it takes device buffers before it gets any (comm/transport.py)",
        ["tests/unit/comm/test_comm.py::test_the_mpi_is_asked_whether_it_takes_device_buffers"],
    ),
    "phantom_checkpoints_refused": Mutant(
        _phantom_checkpoints_taken,
        "a checkpoint of one phantom rank (its peers' files missing) is refused (checkpoint/sharded.py)",
        [
            "tests/unit/comm/test_phantom.py::"
            "test_a_phantom_refuses_checkpoints_and_what_another_rank_alone_computed"
        ],
    ),
    "nccl_shares_gpus_by_version": Mutant(
        _nccl_version_not_asked,
        "ranks share a GPU over NCCL only where its version allows it, when asked (base/backend.py)",
        ["tests/unit/comm/test_comm.py::test_ranks_share_a_gpu_over_nccl_only_where_its_version_allows"],
    ),
    "graphed_skip_honoured": Mutant(
        _graphed_skips_updated,
        "a whole-step graph's update does not run where its verdict skips the step (cuda/adamw.cu)",
        [
            "tests/project/test_gpu_budget.py::test_the_whole_step_in_one_graph_equals_eager_steps_and_stops_a_step_late"
        ],
    ),
    "graphed_stop_final": Mutant(
        _graphed_stop_forgotten,
        "after a whole-step graph's step stopped the job, every later call is refused (optim/device_step.py)",
        [
            "tests/project/test_gpu_budget.py::test_the_whole_step_in_one_graph_equals_eager_steps_and_stops_a_step_late"
        ],
    ),
    "overflow_checks_read_before_a_skip": Mutant(
        _overflow_skipped_unread,
        "a LossScaler's overflow raises what the step's checks found before it skips (optim/scaler.py)",
        [
            "tests/project/test_gpu_budget.py::test_the_whole_step_in_one_graph_equals_eager_steps_and_stops_a_step_late"
        ],
    ),
    "offload_dir_one_job": Mutant(
        _offload_owner_not_asked,
        "an offload directory another live job holds for this rank is refused (optim/offload.py)",
        ["tests/unit/optim/test_offload.py::test_what_disk_offload_cannot_do_is_refused_by_name"],
    ),
    "job_warnings_once": Mutant(
        _job_warnings_on_every_rank,
        "a warning every rank agrees on is said once for the job, by rank 0 (base/logs.py)",
        ["tests/unit/comm/test_comm.py::test_a_warning_every_rank_agrees_on_is_said_once_for_the_job"],
        ranks=2,
    ),
    "requeued_job_takes_its_lock": Mutant(
        _slurm_job_not_recorded,
        "a lock naming this Slurm job (its preempted run, elsewhere) is taken at once (checkpoint/lock.py)",
        [
            "tests/failures/test_checkpoint_safety.py::test_a_preempted_job_requeued_on_another_node_saves_at_once"
        ],
    ),
    "launcher_checked": Mutant(
        _launcher_not_checked,
        "tasks that did not join one MPI job are refused at the first Comm (comm/launcher.py)",
        ["tests/failures/test_launcher.py::test_tasks_that_did_not_join_one_job_are_refused_on_every_task"],
    ),
    "exact_sizes": Mutant(
        _sizes_in_int64,
        "sizes are Python integers, exact at any size (autodiff/tensor.py Param.size)",
        ["tests/unit/planning/test_planner.py::test_a_model_of_any_size_is_counted_in_exact_integers"],
    ),
    "manifest_agreed": Mutant(
        _manifests_not_compared,
        "every rank loads the same version of a checkpoint (checkpoint/sharded.py agreed_manifest)",
        ["tests/failures/test_readers.py::test_ranks_never_load_two_versions_of_one_checkpoint"],
        ranks=2,
    ),
    "exact_sum_any_magnitude": Mutant(
        _levels_not_split,
        "an exact sum scales a chunk near float64's smallest in two products (shard/exact.py SPLIT_LEVEL)",
        ["tests/unit/shard/test_exact.py::test_chunks_at_the_edges_of_float64s_range_add_exactly"],
    ),
    "signal_disposition_respected": Mutant(
        _disposition_ignored,
        "a write's SIGTERM clean-up runs only where the signal ends the process (base/files.py)",
        [
            "tests/failures/test_checkpoint_safety.py::test_a_sigterm_that_does_not_end_the_process_leaves_the_write_going_on"
        ],
    ),
    "torn_lines_cut": Mutant(
        _torn_lines_kept,
        "a resumed metrics file is cut back to its last whole line (observe/metrics.py _whole_lines)",
        [
            "tests/unit/observe/test_metrics.py::test_a_torn_last_line_is_cut_on_resume_and_the_next_line_starts_whole"
        ],
    ),
    "settings_compared": Mutant(
        _settings_not_compared,
        "the ranks' settings that change the mathematics (train/eval, dropout rate, heads) are compared "
        "at each forward (fsdp/model.py `ShardedModel._settings`)",
        [
            "tests/failures/test_faults.py::test_a_setting_that_changes_the_mathematics_on_one_rank_is_named_on_every_rank"
        ],
        ranks=2,
    ),
    "saved_settings_compared": Mutant(
        _saved_settings_not_compared,
        "a checkpoint's settings are the model's it is loaded into (checkpoint/sharded.py check_settings)",
        [
            "tests/failures/test_checkpoint_safety.py::test_weights_loaded_into_a_model_with_other_settings_are_refused"
        ],
    ),
    "export_config_compared": Mutant(
        _export_config_not_compared,
        "config.json agrees with the config the weights were exported with (models/hf_gpt2.py)",
        [
            "tests/unit/models/test_hf_gpt2.py::test_a_config_that_fits_the_shapes_but_not_the_exported_model_is_refused"
        ],
    ),
    "shared_dir_asked": Mutant(
        _shared_dir_not_asked_for,
        "every rank is asked whether it sees the shared test directory before a test uses it (support.py)",
        ["tests/project/test_support.py::test_a_directory_some_rank_cannot_see_skips_the_test_on_every_rank"],
        ranks=2,
    ),
    "wheel_data": Mutant(
        _cuda_files_left_out_of_the_wheel,
        "the package's data files (the kernels' .cu) ship in the wheel (tests/project/test_wheel.py)",
        ["tests/project/test_wheel.py::test_the_wheel_ships_every_file_of_the_package_and_one_version"],
    ),
    "wheel_complete": Mutant(
        _a_subpackage_left_out_of_the_wheel,
        "the built wheel is compared with the package's source tree (tests/project/test_wheel.py)",
        ["tests/project/test_wheel.py::test_the_wheel_ships_every_file_of_the_package_and_one_version"],
    ),
    "machine_asked": Mutant(
        _machine_not_asked,
        "a test that needs a part of the machine asks first and skips where it lacks it (support.require)",
        ["tests/unit/base/test_machine.py::test_the_tests_that_need_a_kernel_skip_where_the_cpu_lacks_it"],
    ),
    "kernels_asked_for": Mutant(
        _kernels_not_asked_for,
        "a test asks whether this CPU runs an OpenBLAS kernel before it runs one (base/machine.py)",
        [
            "tests/unit/base/test_machine.py::"
            "test_a_kernel_whose_instructions_the_cpu_lacks_is_refused_without_running_it"
        ],
    ),
    "exit_notices": Mutant(
        _no_exit_notices,
        "a rank that left is named by the others (comm/presence.py check)",
        ["tests/failures/test_abort.py::test_a_rank_that_leaves_early_is_named_within_seconds[exit]"],
    ),
    "roll_call": Mutant(
        _no_roll_call,
        "the watchdog's roll call names the missing rank (comm/presence.py roll_call)",
        [
            "tests/failures/test_abort.py::test_a_frozen_rank_is_named_by_the_watchdog_and_the_running_ones_are_not_blamed"
        ],
    ),
    "report_read": Mutant(
        _report_not_waited_for,
        "the abort waits until the launcher has read the report (comm/presence.py wait_until_read)",
        [
            "tests/unit/comm/test_presence.py::test_the_abort_comes_only_after_the_launcher_has_read_the_report"
        ],
    ),
    "bias_sums_last_use": Mutant(
        _bias_sums_offered_to_any_use,
        "a VJP writes its input's producer's bias gradient only as its input's last use, with the "
        "input's whole gradient (autodiff/tape.py)",
        [
            "tests/unit/autodiff/test_autodiff.py::"
            "test_a_vjp_writes_its_producers_bias_gradient_as_the_last_use_only"
        ],
    ),
    "overflow_agreed": Mutant(
        _overflow_verdict_not_agreed,
        "the ranks agree on a GPU step's overflow verdict, each having checked its own shard "
        "(flat_optimizer.py)",
        ["tests/project/test_gpu_budget.py::test_an_overflow_in_one_ranks_shard_is_raised_on_every_rank"],
    ),
    "fresh_zeroed_grads": Mutant(
        _zeroed_grads_always_fresh,
        "a VJP writes over a parameter's gradient only while it is fresh, not no_sync's sum (lifecycle.py)",
        ["tests/features/test_accumulation.py::test_k_micro_batches_equal_one_global_batch[no_sync]"],
    ),
    "grads_ahead_dropped": Mutant(
        _grads_bound_ahead_kept,
        "a backward cut short drops the gradient bound ahead for the next unit (fsdp/lifecycle.py)",
        ["tests/project/test_gpu_budget.py::test_the_gpu_paths_gradients_and_scaled_steps_are_the_cpus"],
    ),
    "shard_handout_recasts": Mutant(
        _shard_handed_out_keeps_the_cast,
        "a shard handed out (and maybe written) is cast afresh by the next gather, not sent as the "
        "cast the optimizer wrote (shard/unit.py)",
        ["tests/project/test_gpu_budget.py::test_the_gpu_paths_gradients_and_scaled_steps_are_the_cpus"],
    ),
    "written_cast_checked": Mutant(
        _written_cast_unchecked,
        "the step's verdict reads the overflow flag of the cast the optimizer wrote (shard/unit.py)",
        ["tests/project/test_gpu_budget.py::test_the_gpu_paths_gradients_and_scaled_steps_are_the_cpus"],
    ),
    "unreached_grads": Mutant(
        _unreached_grads_left_unfilled,
        "a parameter backward never reached gets zeros in the unfilled GPU gradient buffer (lifecycle.py)",
        ["tests/project/test_gpu_budget.py::test_the_gpu_paths_gradients_and_scaled_steps_are_the_cpus"],
    ),
    "writer_lock": Mutant(
        _no_writer_lock,
        "one writer per checkpoint root (checkpoint/lock.py hold)",
        [
            "tests/failures/test_checkpoint_safety.py::"
            "test_a_second_job_saving_into_the_same_root_is_refused_at_its_first_save"
        ],
    ),
    "global_rng_replay": Mutant(
        _no_global_rng_replay,
        "the global generators' replay in a recomputed forward (recompute._global_rngs_at)",
        [
            "tests/features/test_recompute.py::test_the_re_run_draws_the_same_numbers_from_the_global_generators"
        ],
    ),
    "weights_agreed": Mutant(
        _weights_checked_locally,
        "every rank's weight exchanged and checked on every rank (Unit.agreed_weights)",
        ["tests/unit/shard/test_unit.py::test_a_weight_that_one_rank_gets_wrong_is_named_on_every_rank"],
        ranks=2,
    ),
    "writeback_agreement": Mutant(
        _no_writeback_agreement,
        "exact agreement of writeback edits across ranks (flat.require_same_edit)",
        [
            "tests/unit/shard/test_unit.py::test_writeback_edits_that_differ_between_ranks_are_refused_on_every_rank"
        ],
        ranks=2,
    ),
    "schedule_check": Mutant(
        _no_schedule_check,
        "per-step schedule check (Comm.check_schedule)",
        ["tests/failures/test_faults.py::test_units_swapped_on_one_rank_are_caught_by_the_per_step_check"],
    ),
    "debug_check": Mutant(
        _no_debug_check,
        "debug-mode check before every collective (Comm._announce)",
        ["tests/failures/test_faults.py::test_a_skipped_unit_is_named_on_every_rank_in_debug_mode"],
    ),
    "watchdog": Mutant(
        _no_watchdog,
        "watchdog on every wait (Schedule.wait)",
        ["tests/failures/test_faults.py::test_a_stalled_rank_trips_the_watchdog_which_names_the_collective"],
    ),
    "nonfinite": Mutant(
        _no_nonfinite_check,
        "NaN/Inf policy of AdamW (global gradient norm)",
        ["tests/failures/test_faults.py::test_a_nan_on_one_rank_is_seen_by_every_rank"],
        ranks=2,
    ),
    "uneven_batch": Mutant(
        _no_uneven_batch_check,
        "uneven-batch refusal (ShardedModel.check_inputs)",
        ["tests/failures/test_faults.py::test_uneven_batches_are_refused_on_every_rank"],
        ranks=2,
    ),
    "initial_value_check": Mutant(
        _no_initial_value_check,
        "identical initial values on every rank (flat: bytes_digest of the initial values)",
        ["tests/failures/test_misuse.py::test_ranks_built_from_different_seeds_are_refused_or_synced"],
        ranks=2,
    ),
    "configuration_check": Mutant(
        _no_configuration_check,
        "identical model configuration on every rank (partition.configuration_differs, called by fsdp/build)",
        [
            "tests/failures/test_misuse.py::test_a_configuration_that_differs_without_changing_shapes_is_refused"
        ],
        ranks=2,
    ),
    "optimizer_step_schedule_check": Mutant(
        _no_schedule_check_in_the_optimizer_step,
        "schedule check in AdamW.step",
        [
            "tests/failures/test_misuse.py::test_units_reduced_in_another_order_on_one_rank_are_caught_at_the_step"
        ],
        ranks=2,
    ),
    "input_check": Mutant(
        _no_input_check,
        "model input checks, exchanged with the batch sizes (Module.check_inputs, ShardedModel.check_inputs)",
        ["tests/failures/test_misuse.py::test_bad_input_on_one_rank_is_named_on_every_rank"],
        ranks=2,
    ),
    "tied_weights": Mutant(
        _no_tied_weight_check,
        "tied-weight check (partition.shared_parameters)",
        ["tests/failures/test_misuse.py::test_tied_weights_split_across_units_are_refused"],
    ),
    "checksum": Mutant(
        _no_checksum,
        "checkpoint slice checksums (manifest._checksum_matches)",
        [
            "tests/unit/checkpoint/test_checkpoint.py::test_truncated_missing_and_corrupted_files_are_refused_by_name",
            "tests/unit/checkpoint/test_checkpoint.py::test_keep_last_k_and_latest_falls_back_past_a_corrupted_one",
        ],
    ),
    "manifest_checksum": Mutant(
        _no_manifest_checksum,
        "the manifest's own checksum (manifest.manifest_digest)",
        ["tests/failures/test_checkpoint_safety.py::test_an_edited_manifest_is_refused"],
    ),
    "slice_coverage": Mutant(
        _no_coverage_check,
        "each unit's slices tile it exactly once (manifest._tiles)",
        ["tests/failures/test_checkpoint_safety.py::test_an_edited_manifest_is_refused"],
    ),
    "overwrite_recovery": Mutant(
        _no_recovery,
        "recovery of a checkpoint left nameless by an interrupted overwrite (publish.recover)",
        [
            "tests/failures/test_checkpoint_safety.py::test_an_overwrite_interrupted_between_its_renames_is_recovered"
        ],
    ),
    "readers_change_nothing": Mutant(
        _readers_recover,
        "loading reads an unfinished save where it lies, never renaming a live writer's (publish.locate)",
        [
            "tests/failures/test_readers.py::test_a_live_saves_complete_staging_is_read_where_it_lies_and_left_to_its_writer",
            "tests/failures/test_checkpoint_safety.py::test_a_read_only_archive_holding_an_interrupted_overwrite_still_loads",
        ],
    ),
    "leftover_pruning": Mutant(
        _leftovers_not_seen,
        "save_step finishes interrupted saves, so a superseded .old-* copy goes (publish.named_by)",
        [
            "tests/failures/test_checkpoint_safety.py::test_a_superseded_copy_left_by_a_killed_overwrite_is_pruned"
        ],
    ),
    "removed_on_sigterm": Mutant(
        _termination_keeps_temporary_files,
        "SIGTERM during a write removes the temporary file (base/files.removed_if_terminated)",
        ["tests/failures/test_checkpoint_safety.py::test_a_write_killed_by_sigterm_leaves_no_temporary_file"],
    ),
    "watched_clone": Mutant(
        _unwatched_clone,
        "a Comm() some ranks never make is reported by the watchdog (Comm._clone: Idup, watched)",
        [
            "tests/failures/test_abort.py::test_a_comm_made_on_some_ranks_or_over_a_group_ends_in_seconds"
            "[comm-on-one-rank]"
        ],
    ),
    "exact_chunk_sum": Mutant(
        _float_sum_of_chunks,
        "deterministic mode sums the chunks' gradients exactly, as integers (shard/exact.py ExactSum)",
        ["tests/features/test_deterministic.py::test_training_has_the_same_bits_at_every_world_size"],
        ranks=3,
    ),
    "blas_pinned": Mutant(
        _blas_threads_free,
        "deterministic mode's chunks run BLAS at one thread (base/threads.blas_pinned)",
        ["tests/features/test_deterministic.py::test_blas_threads_do_not_change_the_bits"],
    ),
    "device_settle": Mutant(
        _no_device_settle,
        "collectives waited for on the GPU are checked, under the watchdog, once a step (Comm.settle)",
        [
            "tests/unit/comm/test_device_waits.py::test_a_device_collective_that_never_completes_is_named_at_the_settle"
        ],
    ),
    "watched_device_read": Mutant(
        _unwatched_device_read,
        "the step's one read on a GPU waits for the collectives before it under the watchdog (Comm.read)",
        [
            "tests/unit/comm/test_device_waits.py::test_a_device_collective_that_never_completes_is_named_at_the_steps_read"
        ],
    ),
    "merge_headroom": Mutant(
        _merge_past_headroom,
        "an exact sum's levels are merged only while the int64 headroom allows the shift",
        ["tests/unit/shard/test_exact.py::test_levels_are_not_merged_past_the_int64_headroom"],
    ),
    "rounding_offset": Mutant(
        _offset_below_negatives,
        "an exact sum turns int64 through an offset whose binade (spacing 1) holds negative values too",
        [
            "tests/unit/shard/test_exact.py::"
            "test_chunks_of_either_sign_at_the_top_of_a_level_add_exactly_in_any_order"
        ],
    ),
    "fixed_sum_groups": Mutant(
        _sums_grouped_by_thread,
        "a LayerNorm's weight and bias gradients add partials of fixed groups of rows (fused.sum_group)",
        [
            "tests/unit/base/test_threads.py::test_kernels_split_across_threads_match_one_thread",
            "tests/features/test_deterministic.py::test_blas_threads_do_not_change_the_bits",
        ],
    ),
    "single_block_blas": Mutant(
        _single_block_blas_free,
        "work that calls BLAS from the row blocks runs it at one thread, in a single block too",
        ["tests/features/test_deterministic.py::test_blas_threads_do_not_change_the_bits"],
    ),
    "step_verdict": Mutant(
        _no_step_verdict,
        "the step reads every unit's device overflow flag at once (StepVerdict.settle)",
        [
            "tests/unit/comm/test_device_waits.py::"
            "test_a_gather_that_overflows_param_dtype_is_named_at_the_step_on_a_device"
        ],
    ),
    "random_state_saved": Mutant(
        _random_state_not_saved,
        "checkpoints carry each Dropout's position in its masks (Module.random_state)",
        ["tests/features/test_deterministic.py::test_resuming_at_another_world_size_stays_on_the_same_bits"],
    ),
    "atomic_publish": Mutant(
        _no_atomic_publish,
        "atomic publish of checkpoints (staging directory + rename)",
        [
            "tests/unit/checkpoint/test_checkpoint.py::test_a_rank_killed_while_overwriting_a_checkpoint_leaves_the_old_one",
            "tests/unit/checkpoint/test_checkpoint.py::test_a_rank_killed_during_save_leaves_the_previous_checkpoint",
        ],
    ),
    "global_valid_count": Mutant(
        _no_global_valid_count,
        "global count of valid targets (ShardedModel.count_share)",
        [
            "tests/features/test_parity.py::test_sharded_training_matches_single_process[prefetch1-gpt-ignored-f64]"
        ],
        ranks=2,
    ),
    "gradient_mean": Mutant(
        _no_gradient_mean,
        "1/N of the gradient reduce-scatter (Unit.finish_reduce_grad)",
        ["tests/features/test_parity.py::test_sharded_training_matches_single_process[prefetch1-mlp-f64]"],
        ranks=2,
    ),
    "end_of_backward_sweep": Mutant(
        _no_end_of_backward_sweep,
        "end-of-backward sweep of unreached units (ShardedModel._sweep_unreached)",
        ["tests/unit/fsdp/test_fsdp.py::test_units_backward_never_reached_are_still_reduced"],
    ),
    "plain_file_names": Mutant(
        _any_file_name,
        "a manifest names plain file names only (manifest.is_plain_name)",
        ["tests/failures/test_untrusted.py::test_a_manifest_names_only_plain_files_in_its_checkpoint"],
    ),
    "realpath_fence": Mutant(
        _no_fence,
        "every file a checkpoint opens resolves inside it (manifest.inside)",
        [
            "tests/failures/test_untrusted.py::test_a_link_out_of_the_checkpoint_is_refused_and_one_inside_is_followed",
            "tests/failures/test_untrusted.py::test_a_linked_manifest_is_refused",
        ],
    ),
    "delete_only_ours": Mutant(
        _prune_everything,
        "pruning deletes only a checkpoint's own files (publish.remove_ours)",
        [
            "tests/failures/test_untrusted.py::test_pruning_deletes_only_what_a_checkpoint_is_made_of_and_follows_no_link"
        ],
    ),
    "failed_backward_cleanup": Mutant(
        _nothing_cleaned_after_a_failed_backward,
        "a backward that raised leaves nothing gathered or in flight (ShardedModel.backward_failed)",
        ["tests/features/test_frozen.py::test_unfreezing_after_fully_shard_is_refused"],
    ),
    "draws_replay": Mutant(
        _no_draws_replay,
        "a checkpointed unit's re-run draws the same dropout masks (layers.draws_replay)",
        ["tests/features/test_recompute.py::test_checkpointed_units_train_bit_identically"],
    ),
    "generators_replayed": Mutant(
        _generators_not_replayed,
        "a checkpointed unit's re-run draws the same numbers from its generators (layers._generators_in)",
        [
            "tests/features/test_recompute.py::test_generators_a_unit_holds_draw_the_same_numbers_in_the_re_run"
        ],
    ),
    "unreduced_gradients": Mutant(
        _step_over_unreduced_gradients,
        "no optimizer step over gradients no_sync kept unreduced (Unit.flat_grad)",
        ["tests/features/test_accumulation.py::test_no_sync_holds_full_gradients_and_reduces_their_sum_once"],
    ),
    "device_memory_through_the_transport": Mutant(
        _device_memory_to_mpi,
        "device arrays' all-reduce goes through the transport, never to MPI itself (Comm.iall_reduce)",
        ["tests/project/test_gpu_budget.py::test_an_overflow_in_one_ranks_shard_is_raised_on_every_rank"],
    ),
    "gather_moves_checked": Mutant(
        _gather_moves_unchecked,
        "a unit's gather state moves only along its table (shard/gather.py MOVES)",
        ["tests/unit/shard/test_unit.py::test_the_gather_state_moves_only_along_its_table"],
    ),
    "graph_host_state": Mutant(
        _graph_leaves_the_host_as_it_finds_it,
        "a CUDA graph's replay puts the host back as its captured pass left it (graphed._restore)",
        [
            "tests/project/test_gpu_budget.py::test_graphed_passes_replay_the_eager_steps_and_refuse_what_a_graph_cannot_hold[cudnn]"
        ],
    ),
    "graph_casts_afresh": Mutant(
        _graph_sends_the_optimizers_cast,
        "a captured gather casts its shard afresh (Unit.cast_afresh)",
        [
            "tests/project/test_gpu_budget.py::test_graphed_passes_replay_the_eager_steps_and_refuse_what_a_graph_cannot_hold[cudnn]"
        ],
    ),
    "graph_collectives_counted": Mutant(
        _replayed_collectives_uncounted,
        "a replay's collectives in the schedule and ledger (Comm.replayed)",
        [
            "tests/project/test_gpu_budget.py::test_graphed_passes_replay_the_eager_steps_and_refuse_what_a_graph_cannot_hold[cudnn]"
        ],
    ),
    "graph_verdict_after_replay": Mutant(
        _verdict_not_after_the_replay,
        "the step's settle waits for the replay, not a captured event (Comm.await_current)",
        [
            "tests/project/test_gpu_budget.py::test_graphed_passes_replay_the_eager_steps_and_refuse_what_a_graph_cannot_hold[cudnn]"
        ],
    ),
    "graph_self_check": Mutant(
        _no_graph_self_check,
        "a capture's replay compared with an eager pass (graphed._compare)",
        [
            "tests/project/test_gpu_budget.py::test_graphed_passes_replay_the_eager_steps_and_refuse_what_a_graph_cannot_hold[cudnn]"
        ],
    ),
    "graph_zeroed_gradients": Mutant(
        _replay_over_unzeroed_gradients,
        "no replay over gradients not zeroed, nor inside no_sync (graphed._require_zeroed)",
        [
            "tests/project/test_gpu_budget.py::test_graphed_passes_replay_the_eager_steps_and_refuse_what_a_graph_cannot_hold[cudnn]"
        ],
    ),
    "graph_input_checks": Mutant(
        _replayed_input_checks_dropped,
        "a replay's input checks read with the verdict (graphed._defer_again)",
        [
            "tests/project/test_gpu_budget.py::test_graphed_passes_replay_the_eager_steps_and_refuse_what_a_graph_cannot_hold[cudnn]"
        ],
    ),
    "cublas_workspace_per_stream": Mutant(
        _cublas_on_its_own_workspaces,
        "cuBLAS runs on a workspace of ours on every stream, set after each cublasSetStream (cublas_api)",
        [
            "tests/unit/ops/test_gpu_gemm.py::test_every_stream_runs_cublas_on_a_workspace_of_ours",
            "tests/project/test_gpu_budget.py::test_graphed_passes_replay_the_eager_steps_and_refuse_what_a_graph_cannot_hold[cudnn]",
        ],
    ),
    "gemms_through_the_c_api": Mutant(
        _gemms_through_cupys_matmul,
        "a GPU's 2-D GEMMs through cuBLAS's C API, which a graph captures (gpu_gemm.matmul)",
        [
            "tests/project/test_gpu_budget.py::test_graphed_passes_replay_the_eager_steps_and_refuse_what_a_graph_cannot_hold[cudnn]"
        ],
    ),
    "attention_check_floor": Mutant(
        _attention_check_without_its_floor,
        "cuDNN attention's first-use check bounds results under the normal range by their spacing",
        ["tests/project/test_gpu_budget.py::test_the_gpu_attention_computes_causal_attention[cudnn]"],
    ),
    "bfloat16_limits": Mutant(
        _bfloat16_limits_from_numpy,
        "bfloat16's limits from ml_dtypes, which NumPy 2.5's finfo refuses (checks.finfo)",
        ["tests/unit/base/test_checks.py::test_bfloat16_limits_come_from_ml_dtypes_where_numpy_refuses_them"],
    ),
    "plan_counts_the_loss_gradient": Mutant(
        _plan_without_the_loss_gradient,
        "the plan counts the loss's gradient beside the activations (planner.gpt_loss_gradient_bytes)",
        ["tests/project/test_gpu_budget.py::test_the_gpu_paths_gradients_and_scaled_steps_are_the_cpus"],
    ),
    "kernel_sources_run_on_the_cpu": Mutant(
        _column_sums_without_the_last_block,
        "raw kernels' CUDA source run on the CPU against their twins (tools/gpusim/kernel_emulator.py)",
        [
            "tests/project/test_kernel_emulator.py::"
            "test_every_kernels_source_passes_its_first_use_check_in_every_dtype[layer_norm]"
        ],
    ),
    "errors_on_every_rank": Mutant(
        _errors_raised_where_they_happen,
        "collective checks raise on every rank (Comm.raise_if_any)",
        ["tests/unit/comm/test_comm.py::test_raise_if_any_raises_everywhere"],
        ranks=2,
    ),
}


def apply_from_environment():
    name = os.environ.get("MPIFSDP_MUTANT")
    if name:
        MUTANTS[name].switch_off()
