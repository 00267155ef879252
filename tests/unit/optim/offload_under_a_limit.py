"""A job for test_offload.py: train an MLP whose AdamW moments are most of its states, with them in
memory or on disk (offload="disk"), under an address-space limit (RLIMIT_AS) or none; print one JSON
line: the shards' digest, the process's peak address space, or the MemoryError it met.

    python offload_under_a_limit.py memory|disk DIRECTORY LIMIT_BYTES(0: none)
"""

import json
import resource
import sys

import numpy as np

import mpifsdp
from mpifsdp.base.backend import bytes_digest
from mpifsdp.models.mlp import MLPClassifier

WIDTH, LAYERS, STEPS = 2048, 12, 2


def peak_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmPeak:"):
            return int(line.split()[1]) * 1024
    return 0


def main(where: str, directory: str, limit: int):
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    comm = mpifsdp.Comm()
    model = MLPClassifier([WIDTH] * (LAYERS + 1) + [10], seed=0)
    offload = dict(offload="disk", offload_dir=directory) if where == "disk" else {}
    mpifsdp.fully_shard(model, comm, units=model.layers[:-1], **offload)
    opt = mpifsdp.AdamW(model, lr=1e-3)
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        x, y = rng.standard_normal((4, WIDTH)).astype(np.float32), rng.integers(0, 10, 4)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    shards = [unit.shard for unit in mpifsdp.sharded_model(model).units]
    print(json.dumps({"digest": bytes_digest(shards), "peak_bytes": peak_bytes()}))


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    except MemoryError as exc:
        print(json.dumps({"memory_error": str(exc) or "MemoryError"}))
