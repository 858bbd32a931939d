#!/usr/bin/env python3
"""Measure a kinds fixture's PyTorch module the way ../shared/groundtruth/measure.py measures.

Runs measure.measure() (one warm-up step, then one step whose forward is recorded under
torch.autograd.graph.saved_tensors_hooks, every saved storage counted once by (data_ptr, nbytes),
parameters, buffers and inputs left out) on an nn.Sequential given as Python, backpropagated from
out.sum(), and prints the saved-activation bytes and the parameter count.

`First(m)` (in scope) wraps a module that returns a tuple (nn.LSTM, nn.GRU: output, state) and
passes its first element on. `--dtype bfloat16` converts the module and the input, as
measure.py's `dtype` does.

Usage (with the ground-truth venv):
  measure_kind.py 'nn.Sequential(nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2), nn.ConvTranspose2d(6, 4, 3, dilation=2))' 4,5,5 [--batch 2]
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GT = os.environ.get("MEMEST_GROUNDTRUTH", os.path.join(HERE, "..", "..", "shared", "groundtruth"))
if not os.path.isdir(GT):
    GT = "/work/shared/groundtruth"
sys.path.insert(0, GT)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402,F401  (used by the module expression)

import measure  # noqa: E402


class First(nn.Module):
    """`m(x)[0]`: the output of a module that returns (output, state), as nn.LSTM/nn.GRU do."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m(x)[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("module", help="a Python expression building the module (torch and nn in scope)")
    ap.add_argument("shape", help="per-sample input shape, e.g. 4,5,5")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    a = ap.parse_args()
    shape = tuple(int(d) for d in a.shape.split(","))
    build = measure.build

    def ours(case):
        if case["model"] != "kind":
            return build(case)
        model = eval(a.module)  # noqa: S307 - a developer's own expression
        x = torch.randn(case["batch"], *shape)
        return model, (lambda: ((x,), {})), (lambda out: out.sum())

    measure.build = ours
    r = measure.measure({"id": "kind", "model": "kind", "batch": a.batch, "dtype": a.dtype})
    print(f"torch {r['torch']}: saved activations {r['saved_activations_bytes']} B, "
          f"parameters {r['params']['count']}, peak {r['timeline']['peak_total']} B")


if __name__ == "__main__":
    main()
