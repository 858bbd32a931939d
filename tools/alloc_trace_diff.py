#!/usr/bin/env python3
"""Compare memest's caching-allocator stream with measure_fake_cuda.py's, event by event.

Inputs:
  REF.jsonl   measure_fake_cuda.py --trace DIR  (DIR/ID.jsonl: model load, warm-up step, ["reset"],
              the measured step; each event [a|f, block id, bytes, reserved after, phase, op])
  MEMEST.txt  MEMEST_ALLOC_TRACE=MEMEST.txt memest ... (src/sim/heap.rs: `a KEY BYTES RESERVED`,
              `f KEY` per block, `r FROM TO N` renames, `# F|B|R i OP LAYER` step marks, `# OPT`,
              `# RESET`)

Both streams are replayed through fakecuda.CachingAllocatorSim (the reference's own allocator model;
src/alloc.rs matches it to the byte on tools/allocator_streams.py's streams), so the figures printed
are the ones each side reports.

Usage: alloc_trace_diff.py REF.jsonl MEMEST.txt [growth|diff|state] [REF_OP MEMEST_OP]
  growth  (default) each side's max_allocated / max_reserved and every event that grew a segment
  diff    the measured step's allocations aligned by size (difflib), with each block's lifetime
          (allocations until its free) on both sides; `<<<` marks a lifetime that differs
  state   the segments (blocks: # used, . free, in KiB) just before the first allocation whose
          phase:op contains REF_OP (reference) / whose step mark contains MEMEST_OP (memest)
"""
import difflib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fakecuda import CachingAllocatorSim  # noqa: E402


def load_ref(path):
    ev = []
    for line in open(path):
        e = json.loads(line)
        if e[0] == "reset":
            ev.append(("reset", None, 0, ""))
        else:
            ev.append((e[0], ("ref", e[1]), e[2], f"{e[4]}:{e[5]}"))
    return ev


def load_memest(path):
    ev, ctx, count, live = [], "load", {}, {}
    for line in open(path):
        line = line.rstrip("\n")
        if line.startswith("# RESET"):
            ev.append(("reset", None, 0, ""))
            continue
        if line.startswith("#"):
            ctx = line[2:]
            continue
        p = line.split(" ")
        if p[0] == "a":
            if int(p[2]) == 0:  # no block (src/alloc.rs: malloc(0) is None)
                continue
            n = count.get(p[1], 0)
            count[p[1]] = n + 1
            live.setdefault(p[1], []).append((p[1], n))
            ev.append(("a", (p[1], n), int(p[2]), ctx))
        elif p[0] == "r":
            live.setdefault(p[2], []).extend(live.pop(p[1], []))
        elif p[0] == "f" and live.get(p[1]):
            ev.append(("f", live[p[1]].pop(0), 0, ctx))
    return ev


def replay(ev, stop=None):
    s = CachingAllocatorSim()
    growth, reset = [], False
    for i, (op, k, b, c) in enumerate(ev):
        if op == "reset":
            reset = True
            s.reset_peak()
            growth.append((i, "RESET", s.reserved))
            continue
        if stop is not None and reset and op == "a" and stop(c):
            return s, growth, i
        if op == "a":
            r = s.reserved
            s.malloc(k, b)
            if s.reserved != r:
                growth.append((i, c, b, s.reserved))
        else:
            s.free(k)
    return s, growth, None


def lifetimes(ev):
    out, idx, n = [], {}, 0
    for op, k, b, c in ev:
        if op == "reset":
            out.append(["RESET", "", 0, None])
        elif op == "a":
            idx[k] = len(out)
            out.append([b, c, n, None])
            n += 1
        elif k in idx:
            out[idx[k]][3] = n
    start = [x[0] for x in out].index("RESET")
    return out[start:]


def segments(s):
    firsts = {}
    for b in [x[3] for p in s.pools.values() for x in p] + list(s.live.values()):
        if b.prev is None:
            firsts[b.seg] = b
    for seg in sorted(firsts):
        b, row = firsts[seg], []
        while b is not None:
            row.append(("." if b.free else "#") + str(b.size // 1024))
            b = b.next
        yield seg, row


def main():
    ref, mem = load_ref(sys.argv[1]), load_memest(sys.argv[2])
    what = sys.argv[3] if len(sys.argv) > 3 else "growth"
    if what == "growth":
        for name, ev in (("reference", ref), ("memest", mem)):
            s, growth, _ = replay(ev)
            print(f"{name}: max_allocated {s.max_allocated} max_reserved {s.max_reserved}")
            for g in growth:
                print("   ", *g)
    elif what == "diff":
        a, b = lifetimes(ref), lifetimes(mem)
        sm = difflib.SequenceMatcher(None, [x[0] for x in a], [x[0] for x in b], autojunk=False)
        for tag, i1, i2, j1, j2 in sm.get_opcodes():
            if tag == "equal":
                for x, y in zip(a[i1:i2], b[j1:j2]):
                    lx = None if x[3] is None else x[3] - x[2]
                    ly = None if y[3] is None else y[3] - y[2]
                    mark = "" if lx == ly else "  <<<"
                    print(f"  {x[0]:>10} life {lx} / {ly}   {x[1][:55]:55} | {y[1][:50]}{mark}")
                continue
            print(tag)
            for x in a[i1:i2]:
                print("   reference", x)
            for y in b[j1:j2]:
                print("   memest   ", y)
    elif what == "state":
        for name, ev, pat in (("reference", ref, sys.argv[4]), ("memest", mem, sys.argv[5])):
            s, _, i = replay(ev, stop=lambda c, pat=pat: pat in c)
            print(f"{name}: before event {i}: allocated {s.allocated} reserved {s.reserved}")
            for seg, row in segments(s):
                print(f"  segment {seg}:", " ".join(row))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
