"""Waiting for a GPU stream's collective (NCCL) on the device: the host does not wait per collective,
Comm.settle checks completion once, under the watchdog, and the host-sync ledger counts it. Tested
with a stand-in for backend.StreamRequest (no GPU needed: only the protocol matters here)."""

import numpy as np
import pytest
from mpi4py import MPI

from mpifsdp import Comm
from mpifsdp.base.accounting import HOST_SYNCS
from mpifsdp.comm.schedule import CollectiveTimeout


class DeviceRequest:
    """A stream's request: order_after() is the device-side wait; Test() polls its event."""

    def __init__(self, done_after: int | None = 0):
        self.ordered = self.polls = 0
        self.done_after = done_after  # polls until done; None: never

    def order_after(self):
        self.ordered += 1

    def Test(self):
        self.polls += 1
        return self.done_after is not None and self.polls > self.done_after


def _alone(**kwargs):
    return Comm(MPI.COMM_SELF, threads=None, **kwargs)


def test_the_host_waits_once_a_step_not_once_a_collective():
    comm = _alone()
    requests = [DeviceRequest(done_after=2) for _ in range(30)]
    HOST_SYNCS.reset()
    for request in requests:  # a step's gathers and reductions
        comm.schedule.announce("u", "backward", "all_gather", 8, np.dtype(np.float32))
        comm.wait(request)
    assert all(r.ordered == 1 and r.polls == 0 for r in requests)  # ordered on the device, not polled
    comm.settle()
    assert requests[-1].polls == 3 and all(r.polls == 0 for r in requests[:-1])  # one stream: in order
    assert HOST_SYNCS.counts == {"the collectives of a step": 1}
    comm.settle()  # nothing in flight: no wait
    assert HOST_SYNCS.total() == 1


def test_a_device_collective_that_never_completes_is_named_at_the_settle():
    comm = _alone(timeout=0.3, abort_on_timeout=False)
    comm.schedule.announce("blocks.3", "backward", "reduce_scatter", 8, np.dtype(np.float32))
    comm.wait(DeviceRequest(done_after=None))
    comm.schedule.announce("", "optimizer", "all_reduce", 1, np.dtype(np.float64))  # the host went on
    with pytest.raises(
        CollectiveTimeout, match=r"waited 0.3 s in backward reduce-scatter of unit 'blocks.3' \(8 x float32"
    ):
        comm.settle()


class DeviceLike:
    """NumPy under another name: code that asks `xp is not np` takes its GPU branch (the verdict
    kept on the device until the step's: shard/cast.py DeviceCasts), the arithmetic stays NumPy's."""

    def __getattr__(self, name):
        return getattr(np, name)


def test_a_gather_that_overflows_param_dtype_is_named_at_the_step_on_a_device(monkeypatch):
    """On a GPU the per-gather check would be a host sync each (49 a step): its flag stays on the
    device and the optimizer's step reads every unit's at once, naming the unit. (This stand-in
    device has no kernel compiler: its casts take the array passes, accepted as a slow path.)"""
    from mpifsdp import AdamW, Unit

    monkeypatch.setenv("MPIFSDP_ALLOW_SLOW", "1")

    comm = _alone()
    from mpifsdp.shard.cast import DeviceCasts

    unit = Unit("big", {"w": np.ones(6, np.float32)}, comm, param_dtype=np.float16)
    unit.xp, unit.casts = DeviceLike(), DeviceCasts(DeviceLike())  # a GPU's casts (shard/cast.py)
    unit.shard[:2] = 1e5  # beyond float16's 65504
    with unit.unsharded():  # no host sync here: no error yet
        pass
    unit.reduce_grad({"w": np.ones(6, np.float32)})
    with pytest.raises(FloatingPointError, match="unit 'big': parameter values no longer fit float16"):
        AdamW([unit], lr=1e-3).step()


class DeviceCopy(DeviceRequest):
    """backend.DeviceRead's protocol: the values land in `host` once Test() says the copy is done."""

    made: list = []

    def __init__(self, array, done_after: int | None = 0):
        super().__init__(done_after)
        self.host = np.asarray(array)
        DeviceCopy.made.append(self)


def _device_reads(monkeypatch, done_after):
    from mpifsdp.comm import communicator

    DeviceCopy.made = []
    monkeypatch.setattr(communicator, "array_module_of", lambda a: None)  # every array "on a device"
    monkeypatch.setattr(communicator.backend, "DeviceRead", lambda a: DeviceCopy(a, done_after))


def test_the_steps_read_is_one_host_sync_that_settles_the_collectives(monkeypatch):
    """Comm.read (the optimizer's verdict: the norm's dots and the overflow flags): the copies are
    queued behind the collectives, so polling the last one settles them; one sync for all."""
    comm = _alone()
    request = DeviceRequest(done_after=5)
    comm.schedule.announce("u", "backward", "reduce_scatter", 8, np.dtype(np.float32))
    comm.wait(request)
    _device_reads(monkeypatch, done_after=2)
    HOST_SYNCS.reset()
    dots, flags = comm.read([np.arange(3.0), np.zeros(2, np.int32)], "the step's verdict")
    assert dots.tolist() == [0.0, 1.0, 2.0] and flags.tolist() == [0, 0]
    assert [c.polls for c in DeviceCopy.made] == [0, 3] and request.polls == 0  # the last copy only
    assert HOST_SYNCS.counts == {"the step's verdict": 1}
    comm.settle()  # read settled what was in flight: nothing left to wait for
    assert HOST_SYNCS.total() == 1


def test_a_device_collective_that_never_completes_is_named_at_the_steps_read(monkeypatch):
    comm = _alone(timeout=0.3, abort_on_timeout=False)
    comm.schedule.announce("blocks.3", "backward", "reduce_scatter", 8, np.dtype(np.float32))
    comm.wait(DeviceRequest(done_after=None))
    comm.schedule.announce("", "optimizer", "all_reduce", 1, np.dtype(np.float64))  # the host went on
    _device_reads(monkeypatch, done_after=None)  # the copy waits behind the stalled collective
    with pytest.raises(
        CollectiveTimeout, match=r"waited 0.3 s in backward reduce-scatter of unit 'blocks.3' \(8 x float32"
    ):
        comm.read([np.zeros(1)], "the step's verdict")


def test_timed_waits_count_each_units_stall_once_its_events_are_done(monkeypatch):
    """Comm.time_waits: each device wait is bracketed by two events on the compute stream; a stall is
    counted under its unit and phase once its second event is done (a settle, a read, or a call after
    the device synchronized: count_stalls), never before, and never twice; off, nothing is recorded."""
    from mpifsdp.base import backend

    clock, done = iter(range(100)), set()

    class Event:
        def __init__(self):
            self.at = next(clock)

    monkeypatch.setattr(backend, "record_event", Event)
    monkeypatch.setattr(backend, "event_done", lambda event: event.at in done)
    monkeypatch.setattr(backend, "elapsed_s", lambda start, end: float(end.at - start.at))
    comm = _alone()
    comm.time_waits = True
    for unit in ("blocks.0", "blocks.1"):
        request = DeviceRequest()
        comm._note_start(request, unit, "backward")
        comm.wait(request)
    comm.count_stalls()
    assert not comm.ledger.waits and len(comm._stalls) == 2  # the compute stream has not got there yet
    done.update({1})  # blocks.0's second event
    comm.count_stalls()
    assert dict(comm.ledger.waits) == {("blocks.0", "backward"): 1.0} and len(comm._stalls) == 1
    done.update({3})
    comm.count_stalls()
    comm.count_stalls()
    assert comm.ledger.exposed_by_unit() == {"blocks.0": 1.0, "blocks.1": 1.0} and not comm._stalls
    comm.time_waits = False
    comm.wait(DeviceRequest())
    assert not comm._stalls
