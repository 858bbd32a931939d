#!/usr/bin/env python3
"""Measure training-loop recipes on the CPU: gradient accumulation, the optimizer inside backward,
an EMA copy of the weights, and what stays allocated between steps and after the forward pass.

Models, inputs and optimizers come from ../shared/groundtruth/measure.py (`build`,
`make_optimizer`; the path is MEASURE_PY or that default). One warm-up step, then one measured
step under torch.profiler with the CPU allocator's exact running total switched on
(FLAGS_caffe2_report_cpu_memory_usage, as measure_dist.py does): every allocation event then
carries the allocator's total after it. Phases are marked with record_function("phase:...").

What a step is (the loop memest models):

    opt.zero_grad(set_to_none=True)
    for i in range(grad_accum - 1):      # micro-batches 1..N-1, in a function: HF Trainer's
        micro()                          # training_step drops the output and loss on return
    out = model(...); loss = ...; loss.backward()   # the last one holds them to the end
    opt.step()                           # (not with optim_in_backward: hooks stepped already)
    ema update                           # diffusers EMAModel.step (foreach=False)

Figures, in bytes, relative to `base`, the allocator's total when the step starts (what is held
between steps, the batch, and `base_other`: whatever else the process holds):
  held_between_steps   parameters + buffers + optimizer state + EMA copy, summed over tensors
  base_other           base - held_between_steps - input
  after_forward        total when the first micro-batch's loss is computed, minus base
  peak                 the step's largest total, minus base
  micro_peaks          each micro-batch's largest total, minus base
  optimizer_step_peak  the largest total during opt.step() (and the EMA update), minus base

Usage: measure_recipes.py CASES.json OUT.json [ID ...]
A case is measure.py's, plus "grad_accum": N, "optim_in_backward": bool, "ema": "weights"|"float32",
"checkpointing": bool, "lora": {"r", "targets", "dropout", "autocast_adapter_dtype"} (needs peft).
"""
import copy
import ctypes
import importlib.util
import json
import os
import sys

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

HERE = os.path.dirname(os.path.abspath(__file__))
MEASURE_PY = os.environ.get("MEASURE_PY", os.path.join(HERE, "..", "..", "..", "shared", "groundtruth", "measure.py"))
if not os.path.exists(MEASURE_PY):
    MEASURE_PY = "/work/shared/groundtruth/measure.py"
_spec = importlib.util.spec_from_file_location("measure", MEASURE_PY)
measure = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(measure)

C10 = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
ctypes.c_bool.in_dll(ctypes.CDLL(C10), "FLAGS_caffe2_report_cpu_memory_usage").value = True


def events(prof):
    """(time, size, total) of every CPU allocation event, and the phase ranges."""
    allocs, phases = [], []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        n = stack.pop()
        stack.extend(n.children)
        kind = str(n.typed[0])
        if kind.endswith("Allocation"):
            f = n.typed[1]
            if f.device.type == "cpu" and f.alloc_size != 0:
                allocs.append((n.start_time_ns, f.alloc_size, f.total_allocated))
        elif n.name.startswith("phase:"):
            phases.append((n.name[6:], n.start_time_ns, n.end_time_ns))
    allocs.sort(key=lambda e: e[0])
    # same-time events: chain them so that each total is the previous plus its size
    out, i = [], 0
    while i < len(allocs):
        j = i
        while j < len(allocs) and allocs[j][0] == allocs[i][0]:
            j += 1
        group = allocs[i:j]
        if len(group) > 1 and out:
            total, chained = out[-1][2], []
            while group:
                k = next((k for k, e in enumerate(group) if e[2] - e[1] == total), 0)
                e = group.pop(k)
                chained.append(e)
                total = e[2]
            group = chained
        out.extend(group)
        i = j
    return out, sorted(phases, key=lambda p: p[1])


def run(case):
    torch.manual_seed(0)
    dtype = getattr(torch, case.get("dtype", "float32"))
    model, make_inputs, loss_fn = measure.build(case)
    model = model.to(dtype=dtype)
    if case.get("lora"):
        # peft's LoRA (pip install peft; PYTHONPATH works): r, target_modules, lora_dropout;
        # autocast_adapter_dtype=True (peft's default) keeps float32 adapters beside a 16-bit
        # base, False leaves them in the base's dtype.
        from peft import LoraConfig, get_peft_model

        lc = case["lora"]
        model = get_peft_model(
            model,
            LoraConfig(r=lc["r"], lora_alpha=lc.get("alpha", 16), target_modules=lc["targets"],
                       lora_dropout=lc.get("dropout", 0.0)),
            autocast_adapter_dtype=lc.get("autocast_adapter_dtype", True),
        )
    model.train(True)
    args, kwargs = make_inputs()
    if dtype != torch.float32:
        args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    n_accum = case.get("grad_accum", 1)
    in_bwd = case.get("optim_in_backward", False)
    if in_bwd:
        # torchtune's optimizer_in_bwd (torchtune/training/memory.py, OptimizerInBackwardWrapper
        # and register_optim_in_bwd_hooks): one optimizer per parameter, stepped and zeroed in
        # the parameter's post-accumulate-grad hook.
        cls, kw = _optimizer(case)
        optims = {p: cls([p], **kw) for p in model.parameters()}

        def hook(p):
            optims[p].step()
            optims[p].zero_grad(set_to_none=True)

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)
        opt = None
    else:
        opt = measure.make_optimizer(case, model)
    ema = None
    if case.get("ema"):
        ema = copy.deepcopy(model)
        if case["ema"] == "float32":
            ema = ema.to(torch.float32)
        for p in ema.parameters():
            p.requires_grad_(False)

    def ema_update():
        # diffusers EMAModel.step with foreach=False: s_param.sub_(one_minus_decay * (s_param - param))
        with torch.no_grad():
            for s, p in zip(ema.parameters(), model.parameters()):
                s.sub_(0.001 * (s - p.to(s.dtype)))

    def micro(i):
        with record_function(f"phase:micro{i}"):
            with record_function(f"phase:forward{i}"):
                out = model(*args, **kwargs)
                loss = loss_fn(out)
            loss.backward()

    def step():
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        for i in range(n_accum - 1):
            micro(i + 1)
        with record_function(f"phase:micro{n_accum}"):
            with record_function(f"phase:forward{n_accum}"):
                out = model(*args, **kwargs)
                loss = loss_fn(out)
            loss.backward()
        with record_function("phase:optimizer"):
            if opt is not None:
                opt.step()
            if ema is not None:
                ema_update()

    step()  # warm-up: optimizer state exists from here on
    if opt is not None:
        opt.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        step()
    allocs, phases = events(prof)
    base = allocs[0][2] - allocs[0][1]

    def peak_in(name):
        t0, t1 = next((a, b) for n, a, b in phases if n == name)
        inside = [e[2] for e in allocs if t0 <= e[0] <= t1]
        return max(inside) - base if inside else None

    def total_at_end(name):
        t1 = next(b for n, a, b in phases if n == name)
        before = [e[2] for e in allocs if e[0] <= t1]
        return before[-1] - base

    def nbytes(ts):
        seen = {}
        for t in ts:
            if torch.is_tensor(t):
                s = t.untyped_storage()
                seen[(s.data_ptr(), s.nbytes())] = s.nbytes()
        return sum(seen.values())

    params = nbytes(list(model.parameters()) + list(model.buffers()))
    state_tensors = []
    for o in (optims.values() if in_bwd else [opt] if opt else []):
        for st in o.state.values():
            state_tensors.extend(v for v in st.values() if torch.is_tensor(v))
    state = nbytes(state_tensors)
    ema_b = nbytes(list(ema.parameters()) + list(ema.buffers())) if ema is not None else 0
    inputs = nbytes(list(args) + list(kwargs.values()))
    held = params + state + ema_b
    return {
        "id": case["id"],
        "case": case,
        "torch": torch.__version__,
        "params_buffers_bytes": params,
        "optimizer_state_bytes": state,
        "ema_bytes": ema_b,
        "input_bytes": inputs,
        "held_between_steps": held,
        "base_other": base - held - inputs,
        "after_forward": total_at_end("forward1"),
        "peak": max(e[2] for e in allocs) - base,
        "micro_peaks": [peak_in(f"micro{i + 1}") for i in range(n_accum)],
        "optimizer_step_peak": peak_in("optimizer"),
    }


def _optimizer(case):
    """The class and arguments measure.py's make_optimizer uses for the case."""
    return {
        "sgd": (torch.optim.SGD, {"lr": 1e-3, "foreach": True}),
        "sgd_momentum": (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9, "foreach": True}),
        "adam": (torch.optim.Adam, {"lr": 1e-4, "foreach": True}),
        "adamw": (torch.optim.AdamW, {"lr": 1e-4, "foreach": True}),
    }[case["optimizer"]]


def main():
    cases = json.load(open(sys.argv[1]))
    only = set(sys.argv[3:])
    results = []
    for case in cases:
        if only and case["id"] not in only:
            continue
        print(f"measuring {case['id']} ...", file=sys.stderr, flush=True)
        results.append(run(case))
        json.dump(results, open(sys.argv[2], "w"), indent=1)
    print(f"wrote {len(results)} cases to {sys.argv[2]}", file=sys.stderr)


if __name__ == "__main__":
    main()
