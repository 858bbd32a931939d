#!/usr/bin/env python3
"""Measure one training (or inference) step as it would run on a CUDA GPU, on a machine without one.

Same case format and the same model/input/optimizer construction as
shared/groundtruth/measure.py (its build() and make_optimizer() are imported), but every tensor is
a FakeTensor on device 'cuda' (torch._subclasses.fake_tensor.FakeTensorMode): no memory is
allocated and no arithmetic is done, while every operator still runs its CUDA dispatch path, so
the kernels chosen are the CUDA ones (native_dropout with a bool mask, cudnn_batch_norm,
CUDA autocast cast lists, fused SDPA kernels as a real sm90 GPU would choose them).

Three things do not work out of the box on a CPU-only machine and are emulated (fakecuda.py):
  * torch.autocast('cuda') turns itself off -> the same thread-local state is set by hand;
  * SDPA's CUDA backend choice needs device properties -> select_sdp_backend is re-implemented
    for a chosen GPU (--sm, default 9.0 = H100/H200) and the installed cuDNN version;
  * the C++ autograd engine refuses cuda tensors without a CUDA context -> backward is run by a
    Python walk of the graph in the engine's order.

Printed/recorded fields, per case (bytes):
  params, buffers_bytes, grads_bytes, optimizer_state_bytes  as in measure.py (device tensors;
      optimizer_state_bytes_host counts Adam's CPU `step` tensors, which live on the host on CUDA)
  saved_activations_bytes  tensors autograd saved in the forward, once per storage, parameters and
      the batch left out (exactly measure.py's definition); *_rounded: each storage rounded up to the
      CUDA caching allocator's 512 B
  timeline.peak_total      largest sum of live device storages during the measured step (op outputs
      as seen by a TorchDispatchMode; kernel-internal scratch such as cuBLAS/cuDNN workspaces is not
      visible), with at_peak split into parameter, optimizer_state, input, gradient, activation
      (held by autograd), other (everything else: forward temporaries, activation gradients, optimizer
      temporaries); peak_rounded: same with 512 B rounding
  cuda_sim                 a replay of the same allocation/free sequence through a model of the CUDA
      caching allocator: allocated_before, max_allocated, max_reserved for the measured step, the
      quantities measure.py records with MEASURE_DEVICE=cuda
  sdpa                     which SDPA kernel each attention call would use

Usage: measure_fake_cuda.py CASES.json OUT.json [ID ...]
  --mode fake-cuda (default) | fake-cpu | cpu-real     (the latter two are for validation)
  --engine python (default) | cpp   (cpp = loss.backward(); only possible for CPU modes)
  --sm 9.0        GPU to emulate for SDPA (8.0 = A100, 9.0 = H100/H200, 10.0 = B200)
  --detail        also record the saved tensors node by node (saved_by_node); reads every node's
                  saved tensors after the forward, so do not combine with activation checkpointing
  --memtracker    also run torch.distributed._tools.mem_tracker.MemTracker over the measured step
As in measure.py, a warm-up step runs first, and the model output and loss stay alive until the
step ends (through the optimizer step).

memest's copy (tools/; the original is ../shared/groundtruth/measure_fake_cuda.py) changes:
  * measure.py is found in ../shared/groundtruth (MEMEST_GROUNDTRUTH or GROUNDTRUTH_DIR
    override it), as tools/measure_kind.py finds it;
  * torch.cuda.get_device_capability answers the emulated GPU (transformers' grouped_mm MoE
    experts ask it);
  * fakecuda.ValueShadow runs on top of the tracker in the fake modes: integer tensors with
    fixed values (position ids, one_hot classes, and for MoE models a fixed balanced routing)
    carry real values, so value-dependent code runs: Mixtral's eager expert loop (`nonzero`,
    `torch.where`, `if expert_idx == E`), and transformers' packed-sequence check, which on
    fake tensors otherwise builds a 4-D causal mask that a real run does not (the original's
    gpt2-b4-s256-fp32-adamw-ckpt was 262,144 B high; fake-cpu now gives reference.json's
    figure to the byte). MoE records say which routing was used (`moe_routing`);
  * cases with an `inputs` key get the named tensors tools/hf_inputs.py builds (images, audio,
    several inputs); their integer inputs (token ids with image tokens, image grids) are
    shadowed with their real values, which LLaVA's token check and Qwen2-VL's index
    arithmetic read;
  * fakecuda.SDPAEmulation chooses the attention kernel on the inputs as CUDA autocast casts
    them (bfloat16 q, k, v), not as the caller passed them (float32 after RoPE under autocast).
"""
import argparse
import collections
import contextlib
import importlib.util
import json
import os
import sys
import warnings

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fakecuda  # noqa: E402

# measure.py (build(), make_optimizer()) stays in ../shared/groundtruth, as for measure_kind.py
HERE = os.path.dirname(os.path.abspath(__file__))
GROUNDTRUTH = os.environ.get("GROUNDTRUTH_DIR", os.environ.get(
    "MEMEST_GROUNDTRUTH", os.path.join(HERE, "..", "..", "shared", "groundtruth")))
if not os.path.isfile(os.path.join(GROUNDTRUTH, "measure.py")):
    GROUNDTRUTH = "/work/shared/groundtruth"


def load_measure_module():
    spec = importlib.util.spec_from_file_location("gt_measure", os.path.join(GROUNDTRUTH, "measure.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    import hf_inputs  # named inputs (images, audio, several inputs): tools/hf_inputs.py
    return hf_inputs.extend(mod)


def convert_module(module, fn, memo):
    """nn.Module._apply's order (children first, then own parameters, then buffers), building new
    Parameters: _apply itself tries swap_tensors between a real and a fake tensor and fails."""
    for child in module.children():
        convert_module(child, fn, memo)
    for name, p in list(module._parameters.items()):
        if p is None:
            continue
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(fn(p.detach()), requires_grad=p.requires_grad)
        module._parameters[name] = memo[id(p)]
    for name, b in list(module._buffers.items()):
        if b is None:
            continue
        if id(b) not in memo:
            memo[id(b)] = fn(b)
        module._buffers[name] = memo[id(b)]
    return module


def storage_key(t):
    return t.untyped_storage()._cdata


def aggregate_saved(rows, exclude):
    """rows from fakecuda.saved_by_node -> {node: {'bytes', 'count', 'what'}}, each storage once."""
    seen = set()
    agg = collections.OrderedDict()
    for node, attr, shape, dtype, key, nbytes in rows:
        if key in exclude or key in seen:
            continue
        seen.add(key)
        a = agg.setdefault(node, {"bytes": 0, "count": 0, "what": collections.Counter()})
        a["bytes"] += nbytes
        a["count"] += 1
        a["what"][f"{attr}:{dtype}"] += nbytes
    out = {}
    for node, a in sorted(agg.items(), key=lambda kv: -kv[1]["bytes"]):
        out[node] = {"bytes": a["bytes"], "count": a["count"], "what": dict(a["what"].most_common())}
    return out


def measure(case, args, gt):
    mode = args.mode
    fake = mode.startswith("fake")
    dev = "cuda" if mode == "fake-cuda" else "cpu"
    torch.manual_seed(0)
    dtype = getattr(torch, case.get("dtype", "float32"))
    model, make_inputs, loss_fn = gt.build(case)
    train = case.get("mode", "train") == "train"
    amp = case.get("amp")

    stack = contextlib.ExitStack()
    fake_mode = None
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        stack.enter_context(fake_mode)
    tracker = fakecuda.AllocTracker(device_type=dev)
    if args.trace and tracker.sim is not None:
        tracker.sim.events = []
        tracker.sim.where = lambda: (tracker.phase, tracker.last_op)
    stack.enter_context(tracker)
    sdpa_log = []
    routing = None
    if dev == "cuda":
        stack.enter_context(fakecuda.SDPAEmulation(sm=tuple(args.sm), log=sdpa_log))
        stack.enter_context(fakecuda.device_capability(args.sm))
        stack.enter_context(fakecuda.fake_item_patch())
    elif fake:
        stack.enter_context(fakecuda.fake_item_patch())
    cfg = getattr(model, "config", None)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if fake:
        # on top of the tracker: it answers the ops that read values (see ValueShadow)
        shadow = fakecuda.ValueShadow(experts, getattr(cfg, "num_experts_per_tok", None) if experts else None)
        stack.enter_context(shadow)
        stack.enter_context(fakecuda.transformers_value_checks(shadow))
        if experts:
            routing = shadow

    with stack:
        tracker.phase = "model.to"
        if fake:
            # on the fake 'cpu' device .to('cpu') would return the real tensor itself, so make it
            # fake first (from_tensor is memoized: a tensor shared by two inputs stays shared)
            to_fake = (lambda t: fake_mode.from_tensor(t)) if dev == "cpu" else (lambda t: t)
            memo = {}
            model = convert_module(model, lambda t: to_fake(t).to(device=dev, dtype=dtype) if t.is_floating_point()
                                   else to_fake(t).to(device=dev), memo)
        else:
            to_fake = lambda t: t  # noqa: E731
            model = model.to(device=dev, dtype=dtype)
        model.train(train)
        a0, kw0 = make_inputs()
        tracker.phase = "inputs"
        a = tuple(to_fake(x).to(dev) for x in a0)
        kw = {k: to_fake(v).to(dev) for k, v in kw0.items()}
        if fake:
            # integer inputs (token ids with image tokens, image grids) keep their values as
            # shadows: LLaVA's and Qwen2-VL's checks and index arithmetic read them
            for k, v in kw0.items():
                if torch.is_tensor(v) and not v.is_floating_point() and v.numel() <= 1 << 20:
                    shadow.shadow[kw[k]] = v
        if dtype != torch.float32:
            a = tuple(x.to(dtype) if x.is_floating_point() else x for x in a)
        opt = gt.make_optimizer(case, model)

        params = list(model.parameters())
        buffers = list(model.buffers())
        for p in params + buffers:
            tracker.track(p, "parameter")
        inputs = [x for x in list(a) + list(kw.values()) if torch.is_tensor(x)]
        for x in inputs:
            tracker.track(x, "input")
        exclude = {storage_key(p) for p in params + buffers} | {storage_key(x) for x in inputs}
        recorder = fakecuda.SavedRecorder(tracker=tracker, exclude_keys=exclude)
        detail = {}

        def amp_ctx():
            if not amp:
                return contextlib.nullcontext()
            if dev == "cuda":
                return fakecuda.FakeCudaAutocast(dtype=getattr(torch, amp))
            return torch.autocast("cpu", dtype=getattr(torch, amp))

        def step(record):
            tracker.phase = "zero_grad"
            if opt is not None:
                opt.zero_grad(set_to_none=True)
            if train:
                tracker.phase = "forward"
                recorder.recording = record
                with amp_ctx(), recorder.hooks():
                    out = model(*a, **kw)
                    loss = loss_fn(out)
                recorder.recording = False
                if record and args.detail:
                    detail["rows"] = fakecuda.saved_by_node(loss, recorder)
                tracker.phase = "backward"
                if args.engine == "cpp":
                    loss.backward()
                    for p in params:
                        if p.grad is not None:
                            tracker.mark_grad(p.grad)
                else:
                    fakecuda.run_backward(loss, tracker=tracker, recorder=recorder)
                if opt is not None:
                    tracker.phase = "optimizer"
                    opt.step()
                # as in measure.py, the model output and the loss (and the graph they hold) live
                # until step() returns, through the optimizer step
                del out, loss
            else:
                tracker.phase = "forward"
                with torch.no_grad(), amp_ctx():
                    model(*a, **kw)
            tracker.phase = "end"

        step(False)  # warm-up: optimizer state exists from here on
        if opt is not None:
            for st in opt.state.values():
                for v in st.values():
                    if torch.is_tensor(v):
                        tracker.track(v, "optimizer_state")
        recorder.saved.clear()
        before = tracker.cur
        before_sim = tracker.sim.allocated if tracker.sim else None
        tracker.reset_peak()
        if args.trace and tracker.sim is not None:
            tracker.sim.events.append(["reset"])
        if args.memtracker:
            from torch.distributed._tools.mem_tracker import MemTracker
            mt = MemTracker()
            mt.track_external(model, *( [opt] if opt is not None else []), *inputs)
            with mt:
                step(True)
            mt_peak = mt.get_tracker_snapshot("peak")
        else:
            step(True)

        grads = sum(p.grad.nbytes for p in params if p.grad is not None)
        opt_state = opt_state_host = 0
        if opt is not None:
            for st in opt.state.values():
                for v in st.values():
                    if torch.is_tensor(v):
                        if v.device.type == dev:
                            opt_state += v.nbytes
                        else:
                            opt_state_host += v.nbytes
        saved_all = sum(n for n, _ in recorder.saved.values()) if train else 0
        saved_dev = sum(n for n, d in recorder.saved.values() if d == dev) if train else 0
        saved_rounded = sum(fakecuda.CachingAllocatorSim.round_size(n) for n, d in recorder.saved.values()
                            if d == dev and n) if train else 0
        rec = {
            "id": case["id"],
            "case": case,
            "torch": torch.__version__,
            "device": dev,
            "mode": mode,
            "engine": args.engine,
            "emulated_gpu_sm": list(args.sm) if dev == "cuda" else None,
            "cudnn_version": torch.backends.cudnn.version() if dev == "cuda" else None,
            "params": {
                "count": sum(p.numel() for p in params),
                "trainable": sum(p.numel() for p in params if p.requires_grad),
                "bytes": sum(p.nbytes for p in params),
            },
            "buffers_bytes": sum(b.nbytes for b in buffers),
            "grads_bytes": grads,
            "optimizer_state_bytes": opt_state,
            "optimizer_state_bytes_host": opt_state_host,
            "saved_activations_bytes": saved_all,
            "saved_activations_bytes_on_device": saved_dev,
            "saved_activations_bytes_rounded": saved_rounded,
            "timeline": {
                "live_before": before,
                "peak_total": tracker.peak,
                "peak_rounded": tracker.peak_rounded,
                "at_peak": tracker.peak_cats,
                "peak_at": {"phase": tracker.peak_where[0], "op_index": tracker.peak_where[1],
                            "after_op": tracker.peak_where[2]},
            },
        }
        if dev == "cuda" and tracker.sim is not None:
            rec["cuda_sim"] = {
                "allocated_before": before_sim,
                "max_allocated": tracker.sim.max_allocated,
                "max_reserved": tracker.sim.max_reserved,
                "note": "model of CUDACachingAllocator fed with op-level allocations; no kernel workspaces",
            }
        if args.trace and tracker.sim is not None:
            os.makedirs(args.trace, exist_ok=True)
            with open(os.path.join(args.trace, case["id"] + ".jsonl"), "w") as f:
                for e in tracker.sim.events:
                    f.write(json.dumps(e) + "\n")
            tracker.sim.events = None
        if routing is not None:
            rec["moe_routing"] = {
                "rule": "balanced: routed slot j of token t -> expert (t*k + j) mod E (ValueShadow)",
                "experts": routing.experts, "top_k": routing.top_k,
                "answered_from_shadow_all_steps": dict(routing.answered)}
        if sdpa_log:
            cnt = collections.Counter(e[0] for e in sdpa_log)
            rec["sdpa"] = {"calls_per_backend_all_steps": dict(cnt), "first_call": {
                "backend": sdpa_log[0][0], "q": sdpa_log[0][1], "k": sdpa_log[0][2], "dtype": sdpa_log[0][3],
                "dropout_p": sdpa_log[0][4], "is_causal": sdpa_log[0][5], "mask": sdpa_log[0][6],
                "enable_gqa": sdpa_log[0][7]}}
        if args.memtracker:
            rec["memtracker_peak"] = {str(d): {(k.value if hasattr(k, "value") else str(k)): v for k, v in snap.items()}
                                      for d, snap in mt_peak.items()}
        if "rows" in detail:
            rec["saved_by_node"] = aggregate_saved(detail["rows"], exclude)
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases")
    ap.add_argument("out")
    ap.add_argument("ids", nargs="*")
    ap.add_argument("--mode", default="fake-cuda", choices=["fake-cuda", "fake-cpu", "cpu-real"])
    ap.add_argument("--engine", default="python", choices=["python", "cpp"])
    ap.add_argument("--sm", default="9.0", type=lambda s: tuple(int(x) for x in s.split(".")))
    ap.add_argument("--detail", action="store_true")
    ap.add_argument("--trace", metavar="DIR", help="write the allocator events (model load, warm-up step, [\"reset\"] before the measured step, "
                    "the measured step) to DIR/ID.jsonl: [\"a\"|\"f\", block id, bytes (requested; freed: the "
                    "block's), reserved after, phase, op]")
    ap.add_argument("--memtracker", action="store_true", help="also run torch.distributed._tools.mem_tracker.MemTracker")
    args = ap.parse_args()
    if args.engine == "cpp" and args.mode == "fake-cuda":
        ap.error("the C++ engine cannot run fake cuda tensors without a GPU")
    warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
    gt = load_measure_module()
    cases = json.load(open(args.cases))
    only = set(args.ids)
    results = []
    for case in cases:
        if only and case["id"] not in only:
            continue
        print(f"measuring {case['id']} [{args.mode}] ...", file=sys.stderr, flush=True)
        r = measure(case, args, gt)
        results.append(r)
        tl = r["timeline"]
        print(json.dumps({"id": r["id"], "saved_activations_bytes": r["saved_activations_bytes"],
                          "peak_total": tl["peak_total"], "at_peak": tl["at_peak"],
                          "cuda_sim": r.get("cuda_sim"), "sdpa": r.get("sdpa", {}).get("calls_per_backend_all_steps")}))
        json.dump(results, open(args.out, "w"), indent=1)
    print(f"wrote {len(results)} cases to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
