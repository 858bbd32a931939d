#!/usr/bin/env python3
"""Measure what one distributed PyTorch training step holds in memory, per rank, on the CPU.

The distributed sibling of shared/groundtruth/measure.py. Each case is run as `world_size`
processes on this machine (torch.multiprocessing spawn, gloo backend, CPU tensors); every rank
builds the same model with the same seed and the same batch (`batch` is the per-rank micro-batch),
wraps it as the case's `parallel` spec says, runs `warmup` steps (default 2: DDP rebuilds its
buckets in the second step's forward) and then `repeat` measured steps (default 1), each under
torch.profiler (profile_memory=True, record_shapes=True, with_stack=True), as measure.py does.

Per rank it records, in bytes:

  params               this rank's parameter bytes: DTensor parameters (FSDP2, tensor parallel)
                       count their local shard, DeepSpeed ZeRO-3 its `ds_tensor` partition;
                       `storage_bytes` counts each storage once (FSDP2 pads shards, DDP with
                       gradient_as_bucket_view, DeepSpeed ZeRO-1/2 flatten)
  grads                this rank's .grad bytes after the step (local shards), and their storages
  optimizer_state      tensors in optimizer.state (local shards); DeepSpeed: the wrapped torch
                       optimizer's state, plus `master_params_bytes` (its fp32 partitions)
  saved_activations    tensors autograd saved for backward during the forward, one per storage,
                       leaving out parameters (sharded or unsharded: nn.Parameter or a view of one),
                       the batch, and counting a DTensor by its local tensor
  allocator            the primary figure: the c10 CPU allocator's own running total of live bytes
                       (FLAGS_caffe2_report_cpu_memory_usage is switched on through ctypes before
                       anything is allocated, so the total is exact from process start; the
                       profiler hands it over with every allocation event). `base` is the total when
                       the measured step starts, `peak` its maximum during the step (the CPU analogue
                       of torch.cuda.max_memory_allocated, without the caching allocator's rounding),
                       `by_phase` the peak inside zero_grad / forward / backward / optimizer, and
                       `peak_context` the ops and Python frames that made the peak allocation.
                       `base_known` splits `base` into the tensors the script can name; `base_other`
                       is the rest (DDP buckets when gradient_as_bucket_view=False, DeepSpeed's
                       buckets, FSDP state ...).
                       `at_peak` splits the peak by who allocated each live block: the allocation
                       events are replayed, each block named by the innermost telling frame of its
                       allocation (FSDP2 all-gather buffers / unsharded params / reduce-scatter
                       buffers, FSDP1, DeepSpeed and DTensor functions, backward temporaries,
                       optimizer temporaries, forward blocks saved for backward or not), blocks
                       alive before the step by what they are, blocks alive after it as grads /
                       optimizer state; it sums to `peak`. `label_max`: each name's own maximum.
                       `gloo collective scratch`: blocks gloo allocates inside all_gather_into_tensor
                       (an output-sized copy) and reduce_scatter_tensor (a clone of the input);
                       NCCL makes neither, so `peak_without_gloo_scratch` (max of the total less the
                       live scratch) is the figure to hold against a GPU run;
                       `at_peak_without_gloo_scratch` splits it as `at_peak` does (scratch left
                       out) and `peak_without_gloo_scratch_context` names the ops and frames of the
                       allocation that made it.
                       `off_thread`: frees (and allocations) that happened on another thread (gloo
                       drops a collective's tensors on its worker thread; intra-op threads): the
                       profiler records only the main thread, the total still shows them; the replay
                       matches each to a block by size, `unmatched_bytes` is what it could not.
  timeline             measure.py's figure: torch.profiler's memory timeline (categories at its own
                       peak, and each category's own maximum). Its peak can miss pre-existing tensors
                       that no op touched in the window, and it raises for some FSDP2
                       mixed-precision steps ("version mismatch"); `error` then says so.
  tracker              (fsdp2 by default, others with "tracker": true) the peak snapshot of
                       torch.distributed._tools' FSDPMemTracker / MemTracker, from one more step:
                       FSDP2 categories (sharded/unsharded param and grad, all-gather,
                       reduce-scatter, activation, temp, optimizer state). Tracks only tensors made
                       by ops it sees, so e.g. DDP's buckets are not in it; on the llama cases its
                       total came out 33-66 MB above the allocator's peak (it over-counts; exact
                       on the gpt2tiny case).
  losses               the loss of every step (warm-up, measured, tracker): the same on every rank
                       and, for DDP/FSDP/TP, the same as the single-process run, as a check that
                       the parallel run computes what the single one does.

Usage: measure_dist.py CASES.json OUT.json [ID ...]
A case is measure.py's (model, config_class, config, batch, seq, dtype, amp, optimizer, attn,
checkpointing, mode; also "model": "convnet" with "config": {"channels": [..], "kernel": k,
"size": s}: Conv2d layers with ReLU between, on [batch, channels[0], s, s], loss out.sum();
optimizers sgd, sgd_momentum, adam, adamw, adafactor) plus
  "world_size": int,
  "parallel": {"kind": "none"}                      (single process, world_size 1)
            | {"kind": "ddp", "gradient_as_bucket_view": bool, "bucket_cap_mb": float,
               "static_graph": bool}
            | {"kind": "fsdp2", "reshard_after_forward": bool|int,
               "mp": {"param_dtype": "bfloat16", "reduce_dtype": "float32"} | null,
               "blocks": [class names] (default: model._no_split_modules)}
            | {"kind": "fsdp1", "sharding_strategy": "FULL_SHARD|SHARD_GRAD_OP|NO_SHARD|...",
               "use_orig_params": bool, "mp": {...} | null, "blocks": [...]}
            | {"kind": "tp", "sp": bool, "shard_embed": bool (default true),
               "names": {...}}   (DTensor tensor parallel, tp size = world_size; module names are
               Llama's unless "names" overrides them: layers, embed, head, final_norm, colwise,
               rowwise, norms, gather; see wrap())
            | {"kind": "pp", "schedule": "gpipe|1f1b|interleaved", "micro_batches": int,
               "virtual_stages": int (interleaved only, default 2)}   (torch.distributed.pipelining:
               world_size pipeline ranks; ScheduleGPipe / Schedule1F1B run one PipelineStage per
               rank, ScheduleInterleaved1F1B `virtual_stages` per rank, stage i on rank
               i % world_size; the decoder layers split evenly over the stages with the earlier
               stages taking one more when they do not divide, embeddings on the first stage,
               final norm + LM head on the last, the causal-LM loss as the schedule's loss_fn;
               `batch` is the micro-batch, so each step runs batch * micro_batches sequences;
               schedule.step(..., return_outputs=False) as torchtitan calls it. Per rank also
               `pp`: the rank's stages and layers and the saved bytes per micro-batch)
  "grad_accum": int (default 1; not with pp): micro-batches per optimizer step, each a forward
               and a backward of `batch` sequences, gradients accumulated (FSDP2 and DDP
               reduce every micro-batch, as with no_sync / set_requires_gradient_sync left on);
               `saved_activations` is then the last micro-batch's
            | {"kind": "deepspeed", "stage": 0-3, "bf16": bool, "config": {...merged into the
               DeepSpeed config, e.g. zero_optimization bucket sizes}}
  "warmup": int, "repeat": int, "tracker": bool, "timeline": bool (default true)
Environment: MEASURE_THREADS (torch threads per rank; default cpu_count // world_size);
MEASURE_EVENTS=1 adds `events` to each step's allocator figures: every allocation and free of at
least MEASURE_EVENTS_MIN bytes (default 1 MiB) with the running total, its label and frames.
"""
import ctypes
import datetime
import json
import os
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.nn as nn

C10 = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")


def enable_allocator_accounting():
    """Make the CPU allocator keep an exact running total of live bytes from now on."""
    lib = ctypes.CDLL(C10)
    ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = True


# ----------------------------------------------------------------------------- model (from measure.py)
def build(case):
    """Return (model, make_inputs, loss_fn) for a case. Same as measure.py's build()."""
    name = case["model"]
    batch = case["batch"]
    if name.startswith("tv:"):
        import torchvision.models as tvm

        model = getattr(tvm, name[3:])(weights=None)
        size = case.get("image", 224)
        x = torch.randn(batch, 3, size, size)
        y = torch.randint(0, 1000, (batch,))
        return model, (lambda: ((x,), {})), (lambda out: nn.functional.cross_entropy(out, y.to(out.device)))
    if name == "mlp":
        dims = case["config"]["dims"]
        layers = []
        for i in range(len(dims) - 1):
            layers.append(nn.Linear(dims[i], dims[i + 1]))
            if i < len(dims) - 2:
                layers.append(nn.ReLU())
        model = nn.Sequential(*layers)
        x = torch.randn(batch, dims[0])
        return model, (lambda: ((x,), {})), (lambda out: out.sum())
    if name == "convnet":
        # Conv2d layers (kernel k, no padding) with ReLU between them: every weight 4-D, the
        # biases vectors (Adafactor's factored state on 4-D DTensor shards; see dist_cases.json).
        chans = case["config"]["channels"]
        k = case["config"]["kernel"]
        size = case["config"]["size"]
        layers = []
        for i in range(len(chans) - 1):
            layers.append(nn.Conv2d(chans[i], chans[i + 1], k))
            if i < len(chans) - 2:
                layers.append(nn.ReLU())
        model = nn.Sequential(*layers)
        x = torch.randn(batch, chans[0], size, size)
        return model, (lambda: ((x,), {})), (lambda out: out.sum())
    if name.startswith("hf:"):
        import transformers

        kind = name[3:]
        cfg_cls = getattr(transformers, case["config_class"])
        cfg = cfg_cls(**case.get("config", {}))
        cfg._attn_implementation = case.get("attn", "sdpa")
        model_cls = getattr(transformers, kind)
        model = model_cls(cfg)
        if case.get("checkpointing"):
            model.gradient_checkpointing_enable()
        seq = case["seq"]
        vocab = cfg.vocab_size
        ids = torch.randint(0, vocab, (batch, seq))
        kwargs = {"input_ids": ids}
        if "ForSequenceClassification" in kind:
            kwargs["labels"] = torch.randint(0, cfg.num_labels, (batch,))
        elif "ForConditionalGeneration" in kind:
            kwargs["labels"] = torch.randint(0, vocab, (batch, seq))
        elif "LMHead" in kind or "CausalLM" in kind or "MaskedLM" in kind:
            kwargs["labels"] = ids
        if case.get("mode", "train") == "infer":
            kwargs.pop("labels", None)
            return model, (lambda: ((), kwargs)), (lambda out: None)
        return model, (lambda: ((), kwargs)), (lambda out: out.loss if out.loss is not None else out[0].sum())
    raise ValueError(f"unknown model {name}")


def make_optimizer(case, params):
    kind = case.get("optimizer")
    params = [p for p in params if p.requires_grad]
    from torch.distributed.tensor import DTensor

    dt = [p for p in params if isinstance(p, DTensor)]
    if dt and len(dt) < len(params):
        # foreach kernels refuse a list mixing DTensor and plain tensors (tensor parallel leaves norms
        # plain): give each kind its own param group
        params = [{"params": dt}, {"params": [p for p in params if not isinstance(p, DTensor)]}]
    if kind is None:
        return None
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-3, foreach=True)
    if kind == "sgd_momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-4, foreach=True)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, foreach=True)
    if kind == "adafactor":
        return torch.optim.Adafactor(params, foreach=True)
    raise ValueError(f"unknown optimizer {kind}")


# ----------------------------------------------------------------------------- tensor helpers
def local(t):
    """The plain tensor that holds a (possibly wrapped) tensor's bytes on this rank."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    while True:
        if isinstance(t, DTensor):
            t = t._local_tensor
        elif isinstance(t, AsyncCollectiveTensor):  # what to_local() can hand out after a redistribute
            t = t.elem
        else:
            return t


def storage_key(t):
    s = local(t).untyped_storage()
    return (s.data_ptr(), s.nbytes())


def is_param_like(t):
    if isinstance(t, nn.Parameter):
        return True
    base = getattr(t, "_base", None)
    return base is not None and isinstance(base, nn.Parameter)


def block_classes(model, spec):
    names = spec.get("blocks") or list(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names], set(names)


# ----------------------------------------------------------------------------- wrapping
def mp_dtypes(mp):
    if not mp:
        return None
    return {k: getattr(torch, v) for k, v in mp.items() if v}


def wrap(case, model, rank, world):
    """Return (module to call, parameters for the optimizer, info dict)."""
    spec = case.get("parallel", {"kind": "none"})
    kind = spec["kind"]
    info = {}
    if kind == "none":
        return model, list(model.parameters()), info
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        kw = {"gradient_as_bucket_view": spec.get("gradient_as_bucket_view", False)}
        for k in ("bucket_cap_mb", "static_graph", "find_unused_parameters", "broadcast_buffers"):
            if k in spec:
                kw[k] = spec[k]
        ddp = DDP(model, **kw)
        info["ddp_kwargs"] = kw
        return ddp, list(ddp.parameters()), info
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        kw = {"mesh": mesh, "reshard_after_forward": spec.get("reshard_after_forward", True)}
        mp = mp_dtypes(spec.get("mp"))
        if mp:
            kw["mp_policy"] = MixedPrecisionPolicy(**mp)
        blocks, names = block_classes(model, spec)
        for b in blocks:
            fully_shard(b, **kw)
        fully_shard(model, **kw)
        info["fsdp2_units"] = len(blocks) + 1
        info["block_classes"] = sorted(names)
        return model, list(model.parameters()), info
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        blocks, names = block_classes(model, spec)
        classes = {type(b) for b in blocks}
        mp = mp_dtypes(spec.get("mp"))
        fsdp = FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy(classes) if classes else None,
            sharding_strategy=getattr(ShardingStrategy, spec.get("sharding_strategy", "FULL_SHARD")),
            device_id=torch.device("cpu"),
            use_orig_params=spec.get("use_orig_params", True),
            mixed_precision=MixedPrecision(**mp) if mp else None,
        )
        info["block_classes"] = sorted(names)
        return fsdp, list(fsdp.parameters()), info
    if kind == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        if spec.get("size", world) != world:
            raise ValueError("tp size must equal world_size here")
        mesh = init_device_mesh("cpu", (world,))
        sp = spec.get("sp", False)
        # Module names (Llama's unless the case names others): the decoder layers, the embedding,
        # the LM head, the column- and row-parallel projections (relative to a layer), the norms
        # that run sequence parallel, the modules whose input is all-gathered under SP.
        names = {"layers": "model.layers", "embed": "model.embed_tokens", "head": "lm_head",
                 "final_norm": "model.norm",
                 "colwise": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                             "mlp.gate_proj", "mlp.up_proj"],
                 "rowwise": ["self_attn.o_proj", "mlp.down_proj"],
                 "norms": ["input_layernorm", "post_attention_layernorm"],
                 "gather": {"self_attn": "hidden_states", "mlp": 0}}
        names.update(spec.get("names", {}))
        base = names["layers"] + ".*"
        plan = {}
        if spec.get("shard_embed", True):
            plan[names["embed"]] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
            plan[names["head"]] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate())
        if sp:
            # embeddings stay replicated (transformers builds the mask and RoPE from their shape);
            # the first block slices its input along the sequence, the rest of the residual stream
            # stays sequence-sharded, norms run as SequenceParallel.
            plan[names["layers"] + ".0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True)
            for n in names["norms"]:
                plan[f"{base}.{n}"] = SequenceParallel()
            plan[names["final_norm"]] = SequenceParallel()
            for mod, arg in names["gather"].items():
                if isinstance(arg, str):
                    plan[f"{base}.{mod}"] = PrepareModuleInput(
                        input_kwarg_layouts={arg: Shard(1)}, desired_input_kwarg_layouts={arg: Replicate()})
                else:
                    plan[f"{base}.{mod}"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            if not spec.get("shard_embed", True):
                raise ValueError("sp needs shard_embed (lm_head gathers the sequence)")
        out_layout = {"output_layouts": Shard(1)} if sp else {}
        for n in names["colwise"]:
            plan[f"{base}.{n}"] = ColwiseParallel()
        for n in names["rowwise"]:
            plan[f"{base}.{n}"] = RowwiseParallel(**out_layout)
        parallelize_module(model, mesh, plan)
        info["tp_plan"] = {k: type(v).__name__ for k, v in plan.items()}
        return model, list(model.parameters()), info
    raise ValueError(f"unknown parallel kind {kind}")


# ----------------------------------------------------------------------------- pipeline parallel
# The micro-batch being forwarded (pipeline cases): a storage freed after one micro-batch's
# backward can come back at the same address for a later one (1F1B), so saved tensors are keyed
# by micro-batch as well as by storage.
MICRO_BATCH = [0]


class LlamaStage(nn.Module):
    """One pipeline stage of an HF Llama-style causal LM: what LlamaModel.forward runs for the
    layers [lo, hi), with the embeddings on the first stage and the final norm + LM head on the
    last (the loss is the schedule's loss_fn). Each stage builds its own rotary tables and runs
    attention without a mask (SDPA's causal path, as LlamaModel does without padding)."""

    def __init__(self, model, lo, hi, first, last):
        super().__init__()
        self.first, self.last = first, last
        self.embed_tokens = model.model.embed_tokens if first else None
        self.rotary_emb = model.model.rotary_emb
        self.layers = nn.ModuleList(model.model.layers[lo:hi])
        self.norm = model.model.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x):
        # a new micro-batch: saved tensors are told apart per micro-batch (see `pack`)
        MICRO_BATCH[0] += 1
        h = self.embed_tokens(x) if self.first else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        pe = self.rotary_emb(h, position_ids=pos)
        for layer in self.layers:
            h = layer(h, attention_mask=None, position_embeddings=pe, position_ids=pos, use_cache=False)
        if self.last:
            h = self.lm_head(self.norm(h))
        return h


def stage_bounds(n_layers, stages, s):
    """Layers [lo, hi) of stage s: n_layers split evenly, the first n_layers % stages stages one more."""
    q, r = divmod(n_layers, stages)
    lo = s * q + min(s, r)
    return lo, lo + q + (1 if s < r else 0)


def pipeline(case, model, rank, world):
    """The rank's pipeline stages (one, or `virtual_stages` under the interleaved schedule: stage
    k·world + rank for k in 0..V) and the schedule that runs them."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)
    from transformers.loss.loss_utils import ForCausalLMLoss

    spec = case["parallel"]
    schedule = spec.get("schedule", "1f1b")
    v = spec.get("virtual_stages", 2) if schedule == "interleaved" else 1
    n_stages = world * v
    n = model.config.num_hidden_layers
    vocab = model.config.vocab_size
    m = spec["micro_batches"]
    loss = lambda out, y: ForCausalLMLoss(out, y, vocab)
    mods, stages, chunks = [], [], []
    for k in range(v):
        idx = k * world + rank
        lo, hi = stage_bounds(n, n_stages, idx)
        first, last = idx == 0, idx == n_stages - 1
        mod = LlamaStage(model, lo, hi, first, last)
        mods.append(mod)
        stages.append(PipelineStage(mod, idx, n_stages, torch.device("cpu")))
        chunks.append({"stage": idx, "layers": [lo, hi], "first": first, "last": last})
    if schedule == "interleaved":
        sched = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss)
    else:
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        sched = kind(stages[0], n_microbatches=m, loss_fn=loss)
    module = mods[0] if v == 1 else nn.ModuleList(mods)
    info = {"pp": dict(chunks[0], schedule=schedule, micro_batches=m)}
    if v > 1:
        info["pp"] = {"stage": rank, "layers": [c["layers"] for c in chunks], "chunks": chunks,
                      "first": chunks[0]["first"], "last": chunks[-1]["last"], "schedule": schedule,
                      "micro_batches": m, "virtual_stages": v}
    return module, sched, info


def deepspeed_engine(case, model, batch):
    spec = case["parallel"]
    import deepspeed

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # CPU inference all-reduce op: needs a JIT build, not used in training
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": spec.get("stage", 0)},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if spec.get("bf16"):
        cfg["bf16"] = {"enabled": True}
    for k, v in spec.get("config", {}).items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k].update(v)
        else:
            cfg[k] = v
    opt = make_optimizer(case, model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine, {"deepspeed_config": cfg, "deepspeed_version": deepspeed.__version__,
                    "deepspeed_optimizer": type(engine.optimizer).__name__}


# ----------------------------------------------------------------------------- profiler analysis
def _dfs(prof):
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children)


# Python frames that wrap everything and say nothing about who allocated
_GENERIC_FRAMES = ("torch/nn/modules/module.py", "torch/utils/_contextlib.py", "torch/_tensor.py",
                   "torch/autograd/__init__.py", "torch/autograd/graph.py", "torch/optim/optimizer.py",
                   "torch/profiler/", "<built-in", "torch/_compile.py", "torch/_dynamo/", "typing.py",
                   "contextlib.py", "functools.py", "measure_dist.py", "torch/utils/_python_dispatch.py",
                   "torch/distributed/tensor/_dispatch.py", "torch/distributed/tensor/_api.py",
                   "torch/distributed/tensor/_ops/", "torch/distributed/tensor/_sharding_prop.py",
                   "torch/_ops.py", "torch/overrides.py", "torch/_library/", "torch/utils/hooks.py",
                   "torch/distributed/c10d_logger.py", "torch/distributed/distributed_c10d.py",
                   "torch/utils/_device.py", "torch/_jit_internal.py", "threading.py")
# the innermost telling frame decides; model code (and anything unmatched) falls back to the phase
_LIBS = [
    (r"fsdp/_fully_shard/", "fsdp2"),
    (r"torch/distributed/fsdp/", "fsdp1"),
    (r"deepspeed/", "deepspeed"),
    (r"nn/parallel/distributed\.py", "ddp"),
    (r"torch/distributed/tensor/|torch/distributed/_functional_collectives", "dtensor"),
]
_FSDP2_KEYS = [("foreach_all_gather_copy_out", "fsdp2: unsharded params (all-gather copy-out)"),
               ("foreach_all_gather", "fsdp2: all-gather buffers"),
               ("foreach_reduce", "fsdp2: reduce-scatter buffers / new sharded grads")]


GLOO_TEMP = "gloo collective scratch (NCCL has none): "
# MEASURE_EVENTS=1: each rank's measured step also lists its allocation events of at least this
# many bytes (size, total, total less gloo scratch, phase, label, innermost frames), in order.
EVENTS_MIN = int(os.environ.get("MEASURE_EVENTS_MIN", 1 << 20))


def _fn(frame):
    return frame.split(": ", 1)[-1] if ".py(" in frame else frame


def _label(node, phase, saved_ptrs, ptr):
    import re

    frames = []
    p = node.parent
    while p is not None and len(frames) < 200:
        frames.append(p.name)
        p = p.parent
    for nm in frames:  # made inside a c10d/gloo collective itself: gloo's own scratch copy
        if nm.startswith(("c10d::", "gloo:")):
            return GLOO_TEMP + nm
        if ".py(" in nm or nm.startswith("_c10d_functional::"):
            break
    for i, nm in enumerate(frames):
        if nm.startswith("autograd::engine::evaluate_function: "):
            return "backward: temporaries (activation grads, grads not kept)"
        if ".py(" not in nm or any(g in nm for g in _GENERIC_FRAMES) or "__torch_dispatch__" in nm:
            continue
        for pat, lib in _LIBS:
            if re.search(pat, nm):
                run = [f for f in frames[i:] if re.search(pat, f)]
                if lib == "fsdp2":
                    for key, lab in _FSDP2_KEYS:
                        if any(_fn(f) == key for f in run):
                            return lab
                outer, inner = _fn(run[-1]), _fn(run[0])
                return f"{lib}: {outer}" + (f" > {inner}" if inner != outer else "")
        if "torch/optim/" in nm:
            return "optimizer step: temporaries"
        break  # model code, nn.functional, ...: named by the phase below
    if phase == "forward":
        return "forward: saved for backward" if ptr in saved_ptrs else "forward: not saved (outputs, temporaries)"
    return f"{phase}: other"


def _order(allocs):
    """Sort allocation events by time; events with the same timestamp are put in the one order in
    which the allocator's running total chains (total = previous total + size)."""
    allocs = sorted(allocs, key=lambda e: e[0])
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
    return out


def allocator_figures(prof, pre_ptrs=None, saved_ptrs=(), post_ptrs=None):
    """Exact live-bytes curve of the CPU allocator over the profiled step, and what is live at its peak.

    pre_ptrs: storage data pointer -> category for the tensors alive before the step;
    post_ptrs: the same for tensors alive after it (an allocation made in the step and still alive at
    its end under such a pointer takes that category); saved_ptrs: storages saved for backward."""
    allocs, phases = [], []
    for n in _dfs(prof):
        kind = str(n.typed[0])
        if kind.endswith("Allocation"):
            f = n.typed[1]
            if f.device.type == "cpu" and f.alloc_size != 0:
                allocs.append((n.start_time_ns, f.alloc_size, f.total_allocated, n, f.ptr))
        elif n.name.startswith("phase:"):
            phases.append((n.name[6:], n.start_time_ns, n.end_time_ns))
    if not allocs:
        return None
    allocs = _order(allocs)
    base = allocs[0][2] - allocs[0][1]
    peak_i = max(range(len(allocs)), key=lambda i: allocs[i][2])
    t_peak, _, peak, node, _ = allocs[peak_i]
    phases.sort(key=lambda p: p[1])
    by_phase = {}
    for name, t0, t1 in phases:
        inside = [e for e in allocs if t0 <= e[0] <= t1]
        before = [e for e in allocs if e[0] < t0]
        start = before[-1][2] if before else base
        by_phase[name] = {"start": int(start), "peak": int(max([start] + [e[2] for e in inside]))}

    def phase_of(t):
        return next((name for name, t0, t1 in phases if t0 <= t <= t1), "between phases")

    phase_at_peak = phase_of(t_peak)

    def context(node):
        ctx = []
        p = node.parent
        while p is not None and len(ctx) < 12:
            nm = p.name
            if not any(g in nm for g in _GENERIC_FRAMES) and not nm.startswith("phase:"):
                ctx.append(nm)
            p = p.parent
        return ctx

    ctx = context(node)

    # replay: which allocations are alive at the end (to name kept grads / new optimizer state), and
    # which never get a recorded free: gloo drops a collective's tensors on its worker thread when the
    # work object dies there, the profiler records only this thread's events, so such frees show only
    # as a drop in the allocator's total ("ghosts")
    pre_ptrs = pre_ptrs or {}
    post_ptrs = post_ptrs or {}
    live = {}
    freed = set()
    for i, (t, size, total, n, ptr) in enumerate(allocs):
        if size > 0:
            live[ptr] = i
        elif ptr in live:
            freed.add(live.pop(ptr))
    kept = {i: post_ptrs[ptr][0] for ptr, i in live.items() if ptr in post_ptrs}
    ghosts = {i for i, e in enumerate(allocs) if e[1] > 0 and i not in freed and i not in kept}
    labels = {}

    def label(i):
        if i not in labels:
            t, size, total, n, ptr = allocs[i]
            labels[i] = ("kept after step: " + kept[i]) if i in kept else _label(n, phase_of(t), saved_ptrs, ptr)
        return labels[i]

    # replay again, by label, keeping the sum equal to the allocator's total at every event;
    # pre-step blocks keep their category until freed
    pre_cat = {}
    for ptr, (cat, nb) in pre_ptrs.items():
        pre_cat["before step: " + cat] = pre_cat.get("before step: " + cat, 0) + nb
    pre_cat["before step: not named"] = base - sum(nb for _, nb in pre_ptrs.values())
    cur = dict(pre_cat)
    label_max = dict(cur)
    live = {}
    at_peak = None
    off_thread = {"frees": 0, "freed_bytes": 0, "unmatched_bytes": 0, "allocated_bytes": 0}
    OTHER = "freed/allocated on another thread, not matched to a block"
    peak_nccl = [0, None, None]
    at_peak_nccl = None
    events = [] if os.environ.get("MEASURE_EVENTS") else None
    scratch_max = 0

    def drop(ptr):
        j, sz = live.pop(ptr)
        cur[label(j)] -= sz

    for i, (t, size, total, n, ptr) in enumerate(allocs):
        excess = sum(cur.values()) - (total - size)
        if excess > 0:  # frees that happened on another thread since the last event
            off_thread["frees"] += 1
            off_thread["freed_bytes"] += excess
            cand = sorted((j, p, sz) for p, (j, sz) in live.items() if j in ghosts)
            pick = next(([c] for c in cand if c[2] == excess), None)
            if pick is None:
                pick = next(([a, b] for x, a in enumerate(cand) for b in cand[x + 1:] if a[2] + b[2] == excess), None)
            if pick is None:
                pick, acc = [], 0
                for c in cand:
                    if acc + c[2] <= excess:
                        pick.append(c)
                        acc += c[2]
            for _, p, _ in pick:
                drop(p)
            rest = excess - sum(c[2] for c in pick)
            if rest:
                off_thread["unmatched_bytes"] += rest
                cur[OTHER] = cur.get(OTHER, 0) - rest
        elif excess < 0:
            off_thread["allocated_bytes"] -= excess
            cur[OTHER] = cur.get(OTHER, 0) - excess
        if size > 0:
            if ptr in live:  # the block that had this address went away unrecorded
                drop(ptr)
            live[ptr] = (i, size)
            lab = label(i)
            cur[lab] = cur.get(lab, 0) + size
        elif ptr in live:
            j, sz = live[ptr]
            lab = label(j)
            drop(ptr)
        else:
            lab = "before step: " + pre_ptrs[ptr][0] if ptr in pre_ptrs else "before step: not named"
            cur[lab] = cur.get(lab, 0) + size
        label_max[lab] = max(label_max.get(lab, 0), cur[lab])
        scratch = sum(v for k, v in cur.items() if k.startswith(GLOO_TEMP))
        scratch_max = max(scratch_max, scratch)
        if total - scratch > peak_nccl[0]:
            peak_nccl[:] = [total - scratch, i, phase_of(t)]
            at_peak_nccl = {k: int(v) for k, v in sorted(cur.items(), key=lambda kv: -kv[1])
                            if v and not k.startswith(GLOO_TEMP)}
        if i == peak_i:
            at_peak = {k: int(v) for k, v in sorted(cur.items(), key=lambda kv: -kv[1]) if v}
        if events is not None and abs(size) >= EVENTS_MIN:
            events.append([int(size), int(total), int(total - scratch), phase_of(t), lab,
                           " < ".join(_fn(f) for f in context(n)[:6])])
    return {
        "base": int(base),
        "peak": int(peak),
        "end": int(allocs[-1][2]),
        "peak_minus_base": int(peak - base),
        "phase_at_peak": phase_at_peak,
        "by_phase": by_phase,
        "peak_alloc_bytes": int(allocs[peak_i][1]),
        "peak_context": ctx,
        "at_peak": at_peak,
        "label_max": {k: int(v) for k, v in sorted(label_max.items(), key=lambda kv: -kv[1]) if v},
        "off_thread": off_thread,
        "peak_without_gloo_scratch": int(peak_nccl[0]),
        "peak_without_gloo_scratch_phase": peak_nccl[2],
        "peak_without_gloo_scratch_context": context(allocs[peak_nccl[1]][3]) if peak_nccl[1] is not None else None,
        "at_peak_without_gloo_scratch": at_peak_nccl,
        "gloo_scratch_max": int(scratch_max),
        **({"events": events} if events is not None else {}),
        "n_events": len(allocs),
    }


def timeline_figures(prof):
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfileTimeline

    names = ["_"] + [("unknown" if c is None else c.name.lower()) for c in _CATEGORY_TO_INDEX]
    try:
        tl = MemoryProfileTimeline(prof._memory_profile())
        _, sizes = tl._coalesce_timeline("cpu")
    except Exception as e:  # the data-flow pass asserts on some FSDP2 mixed-precision steps
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    totals = [sum(r[1:]) for r in sizes]
    i = max(range(len(totals)), key=totals.__getitem__)
    return {
        "peak_total": int(totals[i]),
        "at_peak": {names[j]: int(sizes[i][j]) for j in range(1, len(names))},
        "category_max": {names[j]: int(max(r[j] for r in sizes)) for j in range(1, len(names))},
    }


# ----------------------------------------------------------------------------- per-rank worker
def worker(rank, case, world, port, outdir):
    enable_allocator_accounting()
    t_start = time.time()
    threads = int(os.environ.get("MEASURE_THREADS", max(1, (os.cpu_count() or 1) // world)))
    torch.set_num_threads(threads)
    spec = case.get("parallel", {"kind": "none"})
    kind = spec["kind"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    if kind != "deepspeed" and (world > 1 or kind != "none"):
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=15))
    torch.manual_seed(0)
    dtype = getattr(torch, case.get("dtype", "float32"))
    model, make_inputs, loss_fn = build(case)
    model = model.to(dtype=dtype)
    train = case.get("mode", "train") == "train"
    model.train(train)
    args, kwargs = make_inputs()
    if dtype != torch.float32:
        args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    amp = case.get("amp")
    n_full = sum(p.numel() for p in model.parameters())
    t_build = time.time()

    engine = None
    sched = None
    if kind == "pp":
        # the whole step's batch: `batch` sequences per micro-batch
        m = spec["micro_batches"]
        ids = kwargs["input_ids"].repeat(m, 1)
        labels = ids.clone()
        module, sched, info = pipeline(case, model, rank, world)
        del model
        args = (ids,) if rank == 0 else ()
        kwargs = {"labels": labels} if rank == world - 1 else {}
        if rank != 0:
            del ids
        opt = make_optimizer(case, module.parameters())
        inner_opt = opt
        params_module = module
    elif kind == "deepspeed":
        engine, info = deepspeed_engine(case, model, case["batch"])
        module, opt = engine, None
        inner_opt = getattr(engine.optimizer, "optimizer", engine.optimizer)
        params_module = engine.module
    else:
        module, opt_params, info = wrap(case, model, rank, world)
        opt = make_optimizer(case, opt_params)
        inner_opt = opt
        params_module = model
    t_wrap = time.time()

    def all_params():
        return list(params_module.parameters())

    param_keys = set()
    for p in all_params():
        param_keys.add(storage_key(p))
        if hasattr(p, "ds_tensor"):
            param_keys.add(storage_key(p.ds_tensor))
    param_keys |= {storage_key(b) for b in params_module.buffers()}
    input_keys = {storage_key(a) for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)}

    saved = {}
    saved_params = {}

    def pack(t):
        key = storage_key(t)
        if key in param_keys or is_param_like(t):
            saved_params[key] = key[1]
        elif key not in input_keys:
            saved[(MICRO_BATCH[0],) + key] = key[1]
        return t

    def step(record):
        hooks = (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if record
                 else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
        ctx_amp = torch.autocast("cpu", dtype=getattr(torch, amp)) if amp else torch.autocast("cpu", enabled=False)
        if not train:
            with record_function("phase:forward"), torch.no_grad(), ctx_amp:
                module(*args, **kwargs)
            return
        if opt is not None:
            with record_function("phase:zero_grad"):
                opt.zero_grad(set_to_none=True)
        if sched is not None:
            # forward and backward interleave inside the schedule: one phase for both
            with record_function("phase:pipeline"), ctx_amp, hooks:
                pl = []
                if rank == world - 1:
                    sched.step(*args, target=kwargs["labels"], losses=pl, return_outputs=False)
                else:
                    sched.step(*args, return_outputs=False)
            if pl:
                losses.append(float(sum(x.detach().float() for x in pl) / len(pl)))
            with record_function("phase:optimizer"):
                opt.step()
            return
        for mb in range(accum):
            if record and mb == accum - 1:
                saved.clear()  # the last micro-batch's saved tensors
            with record_function("phase:forward" if mb == accum - 1 else f"phase:forward{mb}"), ctx_amp, hooks:
                out = module(*args, **kwargs)
                loss = loss_fn(out)
                if accum > 1:
                    loss = loss / accum
            losses.append(float(local(loss).detach().float()))
            with record_function("phase:backward" if mb == accum - 1 else f"phase:backward{mb}"):
                if engine is not None:
                    engine.backward(loss)
                else:
                    loss.backward()
            if mb < accum - 1:  # the loop drops a micro-batch's output and loss before the next
                del out, loss
        with record_function("phase:optimizer"):
            if engine is not None:
                engine.step()
            elif opt is not None:
                opt.step()

    accum = case.get("grad_accum", 1)
    if accum > 1 and kind in ("pp", "deepspeed"):
        raise ValueError("grad_accum is for the torch engines (pp has micro_batches)")
    warm_times = []
    losses = []
    for _ in range(case.get("warmup", 2)):
        t0 = time.time()
        step(False)
        warm_times.append(time.time() - t0)
    if dist.is_initialized():
        dist.barrier()

    # what is alive right before the measured step, by name
    def known_live():
        seen = {}

        def add(cat, t):
            if t is None or not torch.is_tensor(t):
                return
            lt = local(t)
            if lt.device.type != "cpu":
                return
            s = lt.untyped_storage()
            if s.data_ptr() == 0 or s.data_ptr() in seen:
                return
            seen[s.data_ptr()] = (cat, s.nbytes())

        for p in all_params():
            add("params", p)
            add("params", getattr(p, "ds_tensor", None))
        for b in params_module.buffers():
            add("buffers", b)
        if inner_opt is not None:
            for g in inner_opt.param_groups:
                for p in g["params"]:
                    add("master_params", p)
            for st in inner_opt.state.values():
                for v in st.values():
                    add("optimizer_state", v)
        for p in all_params():
            add("grads", p.grad)
        if inner_opt is not None:
            for g in inner_opt.param_groups:
                for p in g["params"]:
                    add("grads", p.grad)
        for a in list(args) + list(kwargs.values()):
            add("input", a)
        out = {}
        for cat, n in seen.values():
            out[cat] = out.get(cat, 0) + n
        return out, seen

    base_known, pre_ptrs = known_live()
    steps = []
    profiles_t = []
    for rep in range(case.get("repeat", 1)):
        saved.clear()
        saved_params.clear()
        t0 = time.time()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
            step(True)
        t1 = time.time()
        _, post_ptrs = known_live()
        saved_ptrs = {k[-2] for k in saved} | {k[0] for k in saved_params}
        rec = {"allocator": allocator_figures(prof, pre_ptrs, saved_ptrs, post_ptrs)}
        pre_ptrs = post_ptrs
        if case.get("timeline", True) and rep == 0:
            rec["timeline"] = timeline_figures(prof)
        rec["saved_activations_bytes"] = sum(saved.values())
        rec["saved_param_bytes"] = sum(saved_params.values())
        steps.append(rec)
        profiles_t.append({"step_s": round(t1 - t0, 3), "analysis_s": round(time.time() - t1, 3)})
        del prof

    tracker = None
    if case.get("tracker", kind == "fsdp2") and train:
        try:
            if kind == "fsdp2":
                from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

                mt = FSDPMemTracker(module, opt)
            else:
                from torch.distributed._tools.mem_tracker import MemTracker

                mt = MemTracker()
                mt.track_external(params_module, inner_opt)
            mt.track_inputs(tuple(a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)))
            t0 = time.time()
            with mt:
                step(False)
            snap = mt.get_tracker_snapshot("peak")
            tracker = {str(d): {k: int(v) for k, v in s.items()} for d, s in snap.items()}
            tracker["seconds"] = round(time.time() - t0, 3)
        except Exception as e:
            tracker = {"error": f"{type(e).__name__}: {str(e)[:300]}"}

    # static figures after the last measured step
    def uniq_bytes(ts):
        seen = {}
        for t in ts:
            if t is None:
                continue
            s = local(t).untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values()), len(seen)

    ps = all_params()
    p_local = [getattr(p, "ds_tensor", None) if hasattr(p, "ds_tensor") else local(p) for p in ps]
    p_local = [t for t in p_local if t is not None]
    # ZeRO-3 keeps small ("persistent") parameters whole: count them from the parameter itself
    if engine is not None:
        p_local += [p for p in ps if hasattr(p, "ds_tensor") and p.numel() > 0 and p.ds_tensor.numel() == 0]
    p_storage, p_nstor = uniq_bytes(p_local)
    grads = [local(p.grad) for p in ps if p.grad is not None]
    g_storage, g_nstor = uniq_bytes(grads)
    opt_state = 0
    master = 0
    if inner_opt is not None:
        for st in inner_opt.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    opt_state += local(v).nbytes
        if engine is not None:
            mkeys = {storage_key(t) for t in p_local}
            mp_ = {}
            for g in inner_opt.param_groups:
                for p in g["params"]:
                    k = storage_key(p)
                    if k not in mkeys:
                        mp_[k] = k[1]
            master = sum(mp_.values())
    mismatch = []
    for name, p in params_module.named_parameters():
        g = p.grad
        if g is not None and local(g).nbytes != local(p).nbytes:
            mismatch.append({"name": name, "param": [str(x) for x in getattr(p, "placements", [])],
                             "grad": [str(x) for x in getattr(g, "placements", [])],
                             "param_local_bytes": local(p).nbytes, "grad_local_bytes": local(g).nbytes})
    ds_buffers = None
    if engine is not None:
        # every tensor the DeepSpeed optimizer object reaches (3 levels of attributes, lists, dicts),
        # each storage once, under the first attribute path that reaches it, leaving out the
        # parameters and the wrapped optimizer's state
        known = {storage_key(t)[0] for t in p_local}
        for st in inner_opt.state.values():
            known |= {storage_key(v)[0] for v in st.values() if torch.is_tensor(v)}
        found, seen_obj = {}, set()

        def scan(obj, path, depth):
            if torch.is_tensor(obj):
                lt = local(obj)
                if lt.device.type == "cpu":
                    st = lt.untyped_storage()
                    if st.data_ptr() and st.data_ptr() not in known and st.data_ptr() not in found:
                        found[st.data_ptr()] = (path.split(".")[0].split("[")[0], st.nbytes())
                return
            if depth == 0 or id(obj) in seen_obj or isinstance(obj, (nn.Module, torch.optim.Optimizer, str, bytes, int, float)):
                return
            seen_obj.add(id(obj))
            if isinstance(obj, dict):
                for k, v in list(obj.items())[:100000]:
                    scan(v, f"{path}[{k!r}]", depth - 1)
            elif isinstance(obj, (list, tuple)):
                for i, v in enumerate(obj):
                    scan(v, f"{path}[{i}]", depth - 1)
            elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("deepspeed"):
                for k, v in vars(obj).items():
                    scan(v, f"{path}.{k}" if path else k, depth - 1)

        for k, v in vars(engine.optimizer).items():
            if k != "optimizer":
                scan(v, k, 3)
        ds_buffers = {}
        for name, n in found.values():
            ds_buffers[name] = ds_buffers.get(name, 0) + n
    a0 = steps[0]["allocator"]
    rec = {
        "rank": rank,
        "world_size": world,
        "threads": threads,
        "params": {
            "count_full": n_full,
            "count_local": sum(t.numel() for t in p_local),
            "bytes": sum(t.nbytes for t in p_local),
            "storage_bytes": p_storage,
            "storages": p_nstor,
        },
        "buffers_bytes": sum(local(b).nbytes for b in params_module.buffers()),
        "grads_bytes": sum(g.nbytes for g in grads),
        "grads_storage_bytes": g_storage,
        "grads_storages": g_nstor,
        "optimizer_state_bytes": opt_state,
        "master_params_bytes": master,
        "saved_activations_bytes": steps[0]["saved_activations_bytes"],
        "saved_param_bytes": steps[0]["saved_param_bytes"],
        "peak_allocated": a0["peak"] if a0 else None,
        "peak_without_gloo_scratch": a0["peak_without_gloo_scratch"] if a0 else None,
        "base_allocated": a0["base"] if a0 else None,
        "base_known": base_known,
        "base_other": (a0["base"] - sum(base_known.values())) if a0 else None,
        "deepspeed_optimizer_tensors": ds_buffers,
        "losses": losses,
        "grads_unlike_params": mismatch,
        "steps": steps,
        "tracker": tracker,
        "info": info,
        "seconds": {"build": round(t_build - t_start, 3), "wrap": round(t_wrap - t_build, 3),
                    "warmup_steps": [round(x, 3) for x in warm_times], "measured": profiles_t,
                    "total": round(time.time() - t_start, 3)},
    }
    if kind == "pp":
        rec["pp"] = info["pp"]
        rec["pp"]["saved_activations_bytes_per_micro_batch"] = steps[0]["saved_activations_bytes"] // spec["micro_batches"]
    if kind == "ddp":
        try:
            ld = module._get_ddp_logging_data()
            rec["ddp_buckets"] = {k: ld[k] for k in ("bucket_sizes", "rebuilt_bucket_sizes", "bucket_cap_bytes",
                                                     "gradient_as_bucket_view") if k in ld}
        except Exception as e:
            rec["ddp_buckets"] = {"error": repr(e)}
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f, indent=1)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def measure(case):
    import torch.multiprocessing as mp

    world = case.get("world_size", 1)
    with tempfile.TemporaryDirectory(prefix="measure_dist_", dir=os.environ.get("MEASURE_TMP")) as d:
        t0 = time.time()
        mp.spawn(worker, args=(case, world, free_port(), d), nprocs=world, join=True)
        ranks = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(world)]
    peaks = [r["peak_allocated"] for r in ranks]
    strip = lambda r: {k: v for k, v in r.items() if k not in ("rank", "seconds", "steps", "tracker", "losses")}
    same = all(json.dumps(strip(r), sort_keys=True) == json.dumps(strip(ranks[0]), sort_keys=True) for r in ranks)
    return {
        "id": case["id"],
        "case": case,
        "torch": torch.__version__,
        "world_size": world,
        "wall_seconds": round(time.time() - t0, 2),
        "peak_allocated_max": max(peaks),
        "peak_allocated_min": min(peaks),
        "ranks_identical": same,
        "ranks": ranks,
    }


def main():
    cases = json.load(open(sys.argv[1]))
    only = set(sys.argv[3:])
    results = []
    if os.path.exists(sys.argv[2]):
        results = [r for r in json.load(open(sys.argv[2])) if r["id"] not in {c["id"] for c in cases if not only or c["id"] in only}]
    for case in cases:
        if only and case["id"] not in only:
            continue
        print(f"measuring {case['id']} (world {case.get('world_size', 1)}) ...", file=sys.stderr, flush=True)
        try:
            results.append(measure(case))
        except Exception as e:
            traceback.print_exc()
            results.append({"id": case["id"], "case": case, "error": f"{type(e).__name__}: {str(e)[-2000:]}"})
        json.dump(results, open(sys.argv[2], "w"), indent=1)
    print(f"wrote {len(results)} cases to {sys.argv[2]}", file=sys.stderr)


if __name__ == "__main__":
    main()
