#!/usr/bin/env python3
"""Measure a kinds fixture's PyTorch module the way ../shared/groundtruth/measure.py measures.

Runs measure.measure() (one warm-up step, then one step whose forward is recorded under
torch.autograd.graph.saved_tensors_hooks, every saved storage counted once by (data_ptr, nbytes),
parameters, buffers and inputs left out) on an nn.Sequential given as Python, backpropagated from
out.sum(), and prints the saved-activation bytes and the parameter count.

`First(m)` (in scope) wraps a module that returns a tuple (nn.LSTM, nn.GRU: output, state) and
passes its first element on. `--dtype bfloat16` converts the module and the input, as
measure.py's `dtype` does.

`--fake-cuda` measures the same step as a CUDA GPU runs it, without a GPU, through
tools/measure_fake_cuda.py's `measure()` (fake tensors on device `cuda` of an emulated H100, sm 9.0;
see tests/data/README.md): it prints the saved activations, the peak and the caching-allocator
replay's `max_allocated`/`max_reserved`, and with `--trace DIR` writes DIR/kind.jsonl.

`Einsum()` (in scope) is the einsum attention of tests/fixtures/kinds/einsum.toml.

Usage (with the ground-truth venv):
  measure_kind.py 'nn.Sequential(nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2), nn.ConvTranspose2d(6, 4, 3, dilation=2))' 4,5,5 [--batch 2]
  measure_kind.py 'Einsum()' 64,64 --batch 4 --fake-cuda
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


class Einsum(nn.Module):
    """tests/fixtures/kinds/einsum.toml: attention on [B, 64, 64] written with torch.einsum."""

    def __init__(self, d=64, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, s, d = x.shape
        split = lambda t: t.view(b, s, self.heads, d // self.heads)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        a = torch.einsum("bqhd,bkhd->bhqk", q, k).softmax(-1)
        o = torch.einsum("bhqk,bkhd->bqhd", a, v)
        return self.o(o.reshape(b, s, d))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("module", help="a Python expression building the module (torch and nn in scope)")
    ap.add_argument("shape", help="per-sample input shape, e.g. 4,5,5")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    ap.add_argument("--fake-cuda", action="store_true", help="measure CUDA kernels on fake tensors")
    ap.add_argument("--trace", metavar="DIR", help="with --fake-cuda: the allocator events to DIR/kind.jsonl")
    a = ap.parse_args()
    shape = tuple(int(d) for d in a.shape.split(","))
    build = measure.build

    def ours(case):
        if case["model"] != "kind":
            return build(case)
        model = eval(a.module)  # noqa: S307 - a developer's own expression
        x = torch.randn(case["batch"], *shape)
        return model, (lambda: ((x,), {})), (lambda out: out.sum())

    case = {"id": "kind", "model": "kind", "batch": a.batch, "dtype": a.dtype}
    if a.fake_cuda:
        sys.path.insert(0, HERE)
        import measure_fake_cuda  # noqa: E402

        gt = measure_fake_cuda.load_measure_module()
        build = gt.build
        gt.build = ours
        args = argparse.Namespace(mode="fake-cuda", engine="python", sm=(9, 0), detail=False,
                                  trace=a.trace, memtracker=False)
        if a.trace:
            os.makedirs(a.trace, exist_ok=True)
        r = measure_fake_cuda.measure(case, args, gt)
        print(f"torch {r['torch']} (fake cuda): saved activations {r['saved_activations_bytes']} B, "
              f"parameters {r['params']['count']}, peak {r['timeline']['peak_total']} B, "
              f"cuda_sim {r['cuda_sim']['max_allocated']} / {r['cuda_sim']['max_reserved']} B")
        return
    measure.build = ours
    r = measure.measure(case)
    print(f"torch {r['torch']}: saved activations {r['saved_activations_bytes']} B, "
          f"parameters {r['params']['count']}, peak {r['timeline']['peak_total']} B")


if __name__ == "__main__":
    main()
