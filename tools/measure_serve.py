#!/usr/bin/env python3
"""Measured cases for serving and loss recipes: `model.generate`, chunked cross-entropy, SDPA's
math path under autocast. Same method as ../shared/groundtruth/measure.py (whose build(),
make_optimizer() and measure() it imports): random weights, the CPU, torch.profiler's memory
timeline for the peak (parameters included), saved_tensors_hooks for what autograd keeps.

Case kinds (the "kind" key; without one a case is measure.py's own):

  generate     `model.generate(input_ids, max_new_tokens=M, min_new_tokens=M, do_sample=False)` of a
               causal LM under torch.no_grad(), after one warm-up call. Each forward call is wrapped in
               a record_function range; the prefill phase runs from the start of generate to the start
               of the second forward, decode from there to the end. Records, besides measure.py's
               params: `prefill_peak` and `decode_peak` (largest live total of each phase, parameters
               included), `peak_total`, and `cache_bytes` (the DynamicCache's keys and values at the
               end: prompt + new tokens - 1, the last token is never fed back).
  chunked_ce   a causal LM trained as torchtune's recipes run it with `CEWithChunkedOutputLoss`:
               `model.model(ids)` gives the final hidden states, the LM head runs on
               `h.tensor_split(N, dim=1)` chunks (`TransformerDecoder.chunked_output`), labels are
               shifted by `hstack` with an ignore column, and each chunk's loss is
               `F.cross_entropy(chunk.float().reshape(-1, V), labels, reduction="sum")`, summed and
               divided by the count of labels. The chunk logits are held, as measure.py holds `out`.

Usage: measure_serve.py CASES.json OUT.json [ID ...]   (GROUNDTRUTH_DIR: where measure.py is)
"""
import functools
import importlib.util
import json
import os
import sys

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile, record_function
from torch.profiler._memory_profiler import MemoryProfileTimeline

HERE = os.path.dirname(os.path.abspath(__file__))
GROUNDTRUTH = os.environ.get("GROUNDTRUTH_DIR", os.path.join(HERE, "..", "..", "..", "shared", "groundtruth"))
if not os.path.exists(os.path.join(GROUNDTRUTH, "measure.py")):
    GROUNDTRUTH = "/work/shared/groundtruth"


def load_measure():
    spec = importlib.util.spec_from_file_location("gt_measure", os.path.join(GROUNDTRUTH, "measure.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


M = load_measure()


def hf_model(case):
    import transformers

    cfg = getattr(transformers, case["config_class"])(**case.get("config", {}))
    cfg._attn_implementation = case.get("attn", "sdpa")
    return getattr(transformers, case["model"][3:])(cfg)


def measure_generate(case):
    torch.manual_seed(0)
    dtype = getattr(torch, case.get("dtype", "float32"))
    model = hf_model(case).to(dtype=dtype).eval()
    batch, prompt, new = case["batch"], case["prompt"], case["new_tokens"]
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt))
    calls = {"n": 0}
    inner = model.forward

    @functools.wraps(inner)  # keeps the signature: generate checks it for `logits_to_keep`
    def forward(*a, **k):
        calls["n"] += 1
        with record_function(f"serve::forward{calls['n']}"):
            return inner(*a, **k)

    model.forward = forward
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, **kwargs)  # warm-up
    calls["n"] = 0
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        with torch.no_grad(), record_function("serve::generate"):
            out = model.generate(ids, **kwargs, return_dict_in_generate=True)
    cache = out.past_key_values
    cache_bytes = 0
    for layer in cache.layers:
        cache_bytes += layer.keys.nbytes + layer.values.nbytes
    mp = prof._memory_profile()
    ranges = {}
    for e in mp._op_tree.dfs():
        if e.name.startswith("serve::"):
            ranges[e.name] = (e.start_time_ns // 1000, e.end_time_ns // 1000)
    times, sizes = MemoryProfileTimeline(mp)._coalesce_timeline("cpu")
    totals = [sum(row[1:]) for row in sizes]
    start, end = ranges["serve::generate"]
    decode_start = ranges["serve::forward2"][0]
    prefill = [tot for t, tot in zip(times, totals) if t <= decode_start]
    decode = [tot for t, tot in zip(times, totals) if decode_start <= t]
    return {
        "id": case["id"],
        "case": case,
        "torch": torch.__version__,
        "device": "cpu",
        "forward_calls": calls["n"],
        "params": {
            "count": sum(p.numel() for p in model.parameters()),
            "bytes": sum(p.nbytes for p in model.parameters()),
        },
        "buffers_bytes": sum(b.nbytes for b in model.buffers()),
        "cache_bytes": cache_bytes,
        "prefill_peak": max(prefill),
        "decode_peak": max(decode),
        "peak_total": max(totals),
    }


class ChunkedHead(nn.Module):
    """torchtune's `TransformerDecoder` with `num_output_chunks`: the LM head on hidden-state chunks."""

    def __init__(self, model, chunks):
        super().__init__()
        self.model = model
        self.chunks = chunks

    def forward(self, input_ids):
        h = self.model.model(input_ids=input_ids).last_hidden_state
        return [self.model.lm_head(c) for c in h.tensor_split(self.chunks, dim=1)]


def build_chunked(case):
    chunks = case["chunks"]
    model = ChunkedHead(hf_model(case), chunks)
    vocab = model.model.config.vocab_size
    ids = torch.randint(0, vocab, (case["batch"], case["seq"]))

    def loss_fn(logits):
        # torchtune's recipes: labels shifted with an ignore column (hstack), then the loss.
        labels = torch.hstack((ids[..., 1:], torch.full((ids.shape[0], 1), -100)))
        total = 0.0
        for chunk, lab in zip(logits, labels.tensor_split(chunks, dim=1)):
            total = total + nn.functional.cross_entropy(
                chunk.float().reshape(-1, chunk.size(-1)), lab.reshape(-1), ignore_index=-100, reduction="sum"
            )
        return total / (labels != -100).sum()

    return model, (lambda: ((), {"input_ids": ids})), loss_fn


def main():
    cases = json.load(open(sys.argv[1]))
    only = set(sys.argv[3:])
    results = []
    build = M.build
    for case in cases:
        if only and case["id"] not in only:
            continue
        print(f"measuring {case['id']} ...", file=sys.stderr, flush=True)
        kind = case.get("kind")
        if kind == "generate":
            results.append(measure_generate(case))
        else:
            M.build = build_chunked if kind == "chunked_ce" else build
            results.append(M.measure(case))
        json.dump(results, open(sys.argv[2], "w"), indent=1)
    print(f"wrote {len(results)} cases to {sys.argv[2]}", file=sys.stderr)


if __name__ == "__main__":
    main()
