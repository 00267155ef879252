"""The communicator: every collective of the package (docs/design.md, invariant 5), each announced to
the schedule (fingerprints, rolling hash, watchdog), waited on under the watchdog and counted; and the
transports that move a big collective's bytes (MPI, CUDA-aware MPI, host staging, NCCL); PhantomComm,
one rank of an N-way job run alone.

May import: base.
"""

from .communicator import CollectiveError, Comm
from .phantom import PhantomComm

__all__ = ["CollectiveError", "Comm", "PhantomComm"]
