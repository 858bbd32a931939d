#!/usr/bin/env python3
"""Random allocation streams replayed through measure_fake_cuda.py's allocator model
(../shared/groundtruth/fakecuda.py, CachingAllocatorSim), with its figures: the test data of
src/alloc.rs's cross-check (tests/data/allocator-streams.json).

    python3 tools/allocator_streams.py ../shared/groundtruth tests/data/allocator-streams.json

Each stream: 1,500 events, allocations of every size class (small pool, 1-10 MiB, large, the
boundaries), frees of random live blocks, a reset of the peaks halfway.
"""
import json
import random
import sys

sys.path.insert(0, sys.argv[1])
from fakecuda import CachingAllocatorSim  # noqa: E402

MIB = 1 << 20
out = []
for seed in range(4):
    rnd = random.Random(seed)
    sim = CachingAllocatorSim()
    live, events, next_id = [], [], 0
    for step in range(1500):
        if live and rnd.random() < 0.45:
            k = live.pop(rnd.randrange(len(live)))
            sim.free(k)
            events.append(["f", k, 0])
        else:
            r = rnd.random()
            if r < 0.4:
                n = rnd.randint(1, MIB)
            elif r < 0.7:
                n = rnd.randint(MIB, 10 * MIB)
            elif r < 0.9:
                n = rnd.randint(10 * MIB, 200 * MIB)
            else:
                n = rnd.choice([512, MIB, MIB + 1, 2 * MIB, 10 * MIB, 20 * MIB, 20 * MIB - 512])
            next_id += 1
            sim.malloc(next_id, n)
            live.append(next_id)
            events.append(["a", next_id, n])
        if step == 750:
            sim.reset_peak()
            events.append(["r", 0, 0])
    out.append({"seed": seed, "events": events, "max_allocated": sim.max_allocated,
                "max_reserved": sim.max_reserved, "allocated": sim.allocated, "reserved": sim.reserved})
with open(sys.argv[2], "w") as f:
    json.dump(out, f, separators=(",", ":"))
