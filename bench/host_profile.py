"""Where a GPU step's host time goes, on a CPU: a thread samples the main thread's stack every
0.5 ms while tools/gpusim/cupy_standin.py is not doing device work (its `on_device` depth is 0), with
Python's switch interval shortened so that samples fall anywhere, not only where the GIL is let go.
Each mpifsdp function's share is of the samples whose stack (innermost 12 frames) it is on. A sample
lands where the main thread lets the GIL go, so calls that release it (MPI's) weigh more than they
take: read the shares as where to look, not as exact times. Used by
`python bench/gpu_budget.py --host-profile 20`."""

from __future__ import annotations

import collections
import sys
import threading

from gpusim import cupy_standin

INTERVAL_S, DEPTH = 5e-4, 12


def sampled(run, top: int) -> list:
    """run() under the sampler; [[\"file:function\", percent of host samples], ...], the `top` most."""
    main, counts, samples, done = threading.get_ident(), collections.Counter(), [0], threading.Event()

    def sample():
        while not done.wait(INTERVAL_S):
            frame = sys._current_frames().get(main)
            if cupy_standin._DEPTH[0] or frame is None:
                continue
            names, depth = set(), 0
            while frame is not None and depth < DEPTH:
                path = frame.f_code.co_filename
                if "/mpifsdp/" in path:  # the library's frames (its models' too), not the harness's
                    names.add(f"{path.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")
                frame, depth = frame.f_back, depth + 1
            samples[0] += 1
            counts.update(names)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        run()
    finally:
        done.set()
        sampler.join()
        sys.setswitchinterval(interval)
    total = max(samples[0], 1)
    return [[name, round(100 * n / total, 1)] for name, n in counts.most_common(top)]


__all__ = ["sampled"]
