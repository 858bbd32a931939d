#!/usr/bin/env python3
"""Dev diagnostic: list every tensor autograd saves for backward, per module and per autograd node.

Builds a case exactly as the ground-truth measure.py does (its build() and make_optimizer() are
imported from ../../shared/groundtruth, or $MEMEST_GROUNDTRUTH), runs one warm-up step, then one
forward pass under torch.autograd.graph.saved_tensors_hooks and records each saved storage once,
keyed (data_ptr, nbytes) as measure.py does, parameters/buffers and model inputs left out.

Each storage is attributed to
  * the innermost nn.Module running when it was first saved (global forward pre/post hooks), and
  * the autograd node(s) holding it (found by walking loss.grad_fn's graph and reading every
    node's `_saved_*` attributes; nodes inside a non-reentrant checkpoint region are skipped,
    they hold the checkpoint's placeholders, not tensors).

Usage (with /opt/gt/bin/python):
  saved_tensors.py CASE_ID [--module REGEX] [--summary] [--json OUT] [--live]
  saved_tensors.py --spec '{"id": "x", "model": "tv:resnet18", "batch": 2}'
  saved_tensors.py --list
  saved_tensors.py --ops        (single-op experiments behind SAVED_TENSORS.md's op table)
CASE_ID is looked up in shared/groundtruth/cases.json and tools/extra_cases.json.
  --module REGEX   print details only for modules whose qualified name matches (e.g. 'h\\.0\\.')
  --summary        only the per-top-level-module totals and the grand total
  --src            also print the python frames (file:line) that made the saving call
  --set K=V        override a case field (batch=2, seq=64; JSON values accepted)
  --live           also run measure.measure() (profiler timeline) and print peak_total
  --json OUT       dump every storage record as JSON
"""
import argparse
import collections
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GT = os.environ.get("MEMEST_GROUNDTRUTH", os.path.join(HERE, "..", "..", "shared", "groundtruth"))
if not os.path.isdir(GT):
    GT = "/work/shared/groundtruth"
sys.path.insert(0, GT)

import torch  # noqa: E402
import torch.utils.checkpoint as _ckpt  # noqa: E402

import measure  # noqa: E402  (ground truth: build, make_optimizer, storage_key)

storage_key = measure.storage_key

# --- make checkpoint placeholders refuse to unpack while we walk the graph (no recompute) ------
_WALKING = [False]


class _InCheckpoint(Exception):
    pass


_orig_ckpt_init = _ckpt._checkpoint_hook.__init__


def _patched_ckpt_init(self, frame):
    _orig_ckpt_init(self, frame)
    inner = self.unpack_hook

    def guarded(holder):
        if _WALKING[0]:
            raise _InCheckpoint()
        return inner(holder)

    self.unpack_hook = guarded


_ckpt._checkpoint_hook.__init__ = _patched_ckpt_init


def load_cases():
    cases = {}
    for path in (os.path.join(GT, "cases.json"), os.path.join(HERE, "extra_cases.json")):
        if os.path.exists(path):
            for c in json.load(open(path)):
                cases[c["id"]] = c
    return cases


def fmt_shape(shape):
    return "[" + ",".join(str(s) for s in shape) + "]"


def dtype_name(dt):
    return str(dt).replace("torch.", "")


def walk_graph(root):
    """storage key -> list of (node name, saved attr); plus count of checkpointed nodes."""
    savers = collections.defaultdict(list)
    seen, stack, n_ckpt = set(), [root], 0
    _WALKING[0] = True
    try:
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            name = node.name()
            attrs = [a for a in dir(node) if a.startswith("_saved_")]
            if hasattr(node, "saved_tensors") and not attrs:  # python autograd.Function (ctx)
                attrs = ["saved_tensors"]
            for a in attrs:
                try:
                    v = getattr(node, a)
                except _InCheckpoint:
                    n_ckpt += 1
                    break
                except Exception:  # noqa: BLE001 - freed / undefined saved variable
                    continue
                vals = v if isinstance(v, (tuple, list)) else [v]
                for t in vals:
                    if torch.is_tensor(t):
                        savers[storage_key(t)].append((name, a.replace("_saved_", "")))
            for nxt, _ in node.next_functions:
                stack.append(nxt)
    finally:
        _WALKING[0] = False
    return savers, n_ckpt


_SKIP_FILES = ("torch/nn/modules/module.py", "saved_tensors.py", "torch/autograd/graph.py")


def caller(depth=2):
    """'file:line func' of the nearest python frames that did the saving op (module plumbing skipped)."""
    f, out = sys._getframe(2), []
    while f is not None and len(out) < depth:
        fn = f.f_code.co_filename
        if not any(fn.endswith(x) or x in fn for x in _SKIP_FILES):
            short = fn.split("site-packages/")[-1]
            out.append(f"{short}:{f.f_lineno} {f.f_code.co_name}")
        f = f.f_back
    return " <- ".join(out)


def run_case(case):
    torch.manual_seed(0)
    dtype = getattr(torch, case.get("dtype", "float32"))
    model, make_inputs, loss_fn = measure.build(case)
    model = model.to(device="cpu", dtype=dtype)
    train = case.get("mode", "train") == "train"
    if not train:
        raise SystemExit("inference case: nothing is saved for backward")
    model.train(True)
    args, kwargs = make_inputs()
    if dtype != torch.float32:
        args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    amp = case.get("amp")
    opt = measure.make_optimizer(case, model)

    param_keys = {storage_key(p) for p in model.parameters()} | {storage_key(b) for b in model.buffers()}
    input_keys = {storage_key(a) for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)}

    names = {id(m): (n or "<root>") for n, m in model.named_modules()}
    mstack = []
    recording = [False]
    saved = {}  # key -> record (first save)
    order = []

    def pre(mod, inp):
        mstack.append(mod)

    def post(mod, inp, out):
        if mstack and mstack[-1] is mod:
            mstack.pop()
        elif mod in mstack:  # unbalanced (exception path): pop down to it
            while mstack and mstack.pop() is not mod:
                pass

    h1 = torch.nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = torch.nn.modules.module.register_module_forward_hook(post, always_call=True)

    def pack(t):
        if not recording[0]:
            return t
        key = storage_key(t)
        if key in param_keys or key in input_keys:
            return t
        mod = mstack[-1] if mstack else None
        where = names.get(id(mod), type(mod).__name__ if mod is not None else "<top>")
        if key not in saved:
            base = t._base
            saved[key] = {
                "key": key,
                "nbytes": key[1],
                "module": where,
                "module_class": type(mod).__name__ if mod is not None else "-",
                "shape": list(t.shape),
                "stride": list(t.stride()),
                "dtype": dtype_name(t.dtype),
                "tensor_bytes": t.numel() * t.element_size(),
                "view": key[1] != t.numel() * t.element_size(),
                "base_shape": list(base.shape) if base is not None else None,
                "also_saved_in": [],
                "src": caller(),
            }
            order.append(key)
        elif where != saved[key]["module"] and where not in saved[key]["also_saved_in"]:
            saved[key]["also_saved_in"].append(where)
        return t

    def step(record):
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        ctx_amp = torch.autocast("cpu", dtype=getattr(torch, amp)) if amp else torch.autocast("cpu", enabled=False)
        recording[0] = record
        with ctx_amp, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*args, **kwargs)
            loss = loss_fn(out)
        recording[0] = False
        savers, n_ckpt = ({}, 0)
        if record:
            savers, n_ckpt = walk_graph(loss.grad_fn)
        loss.backward()
        if opt is not None:
            opt.step()
        return savers, n_ckpt

    step(False)
    saved.clear()
    order.clear()
    savers, n_ckpt = step(True)
    h1.remove()
    h2.remove()
    for key in order:
        saved[key]["ops"] = sorted(set(f"{n}.{a}" for n, a in savers.get(key, [])))
    return model, [saved[k] for k in order], n_ckpt


def op_rules():
    """--ops: tiny single-op experiments behind the op-rule table of SAVED_TENSORS.md."""
    import torch.nn.functional as F

    def show(name, fn, *shapes, dtype=torch.float32):
        xs = [torch.randn(*sh, dtype=dtype, requires_grad=True) * 1 for sh in shapes]  # non-leaf inputs
        ins = {x.untyped_storage().data_ptr(): f"in{i}" for i, x in enumerate(xs)}
        rec = []

        def pack(t):
            rec.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(*xs)
        outs = out if isinstance(out, tuple) else (out,)
        optr = {o.untyped_storage().data_ptr(): f"out{i}" for i, o in enumerate(outs) if torch.is_tensor(o)}
        desc = []
        for t in rec:
            ptr = t.untyped_storage().data_ptr()
            who = ins.get(ptr) or optr.get(ptr) or "new"
            desc.append(f"{who}{fmt_shape(t.shape)}:{dtype_name(t.dtype)}")
        node = outs[0].grad_fn.name() if outs[0].grad_fn is not None else "-"
        same = any(o.untyped_storage().data_ptr() in ins for o in outs if torch.is_tensor(o))
        print(f"  {name:34} {node:46} saves: {' '.join(desc) or '-'}{'  (output IS the input)' if same else ''}")

    x = (4, 8)
    print("op-rule experiments (in = an input storage, out = the output storage, new = anything else):")
    show("dropout p=0.1 fp32", lambda a: F.dropout(a, 0.1, True), x)
    show("dropout p=0.1 bf16", lambda a: F.dropout(a, 0.1, True), x, dtype=torch.bfloat16)
    show("dropout p=0", lambda a: F.dropout(a, 0.0, True), x)
    show("gelu", F.gelu, x)
    show("gelu tanh", lambda a: F.gelu(a, approximate="tanh"), x)
    show("silu", F.silu, x)
    for n, f in [("relu_", F.relu), ("relu6_", F.relu6), ("silu_", F.silu), ("hardswish_", F.hardswish), ("leaky_relu_", F.leaky_relu)]:
        show(n, lambda a, f=f: f(a, inplace=True), x)
    show("sigmoid", torch.sigmoid, x)
    show("layer_norm", lambda a: F.layer_norm(a, (8,)), x)
    show("batch_norm train", lambda a: F.batch_norm(a, None, None, training=True), (2, 3, 4, 4))
    show("adaptive_avg_pool2d(1)", lambda a: F.adaptive_avg_pool2d(a, 1), (2, 3, 4, 4))
    show("adaptive_avg_pool2d(2)", lambda a: F.adaptive_avg_pool2d(a, 2), (2, 3, 4, 4))
    show("max_pool2d", lambda a: F.max_pool2d(a, 2), (2, 3, 4, 4))
    show("cross_entropy", lambda a: F.cross_entropy(a, torch.zeros(4, dtype=torch.long)), x)
    qkv = (2, 4, 16, 8)
    show("sdpa causal", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), qkv, qkv, qkv)
    show("sdpa causal dropout 0.1", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1), qkv, qkv, qkv)
    show("sdpa bool mask", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.bool).tril()), qkv, qkv, qkv)
    show("sdpa gqa (kv heads 2)", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), qkv, (2, 2, 16, 8), (2, 2, 16, 8))
    show("sdpa bf16", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), qkv, qkv, qkv, dtype=torch.bfloat16)


def reference_bytes(case_id):
    path = os.path.join(GT, "reference.json")
    if not os.path.exists(path):
        return None
    for r in json.load(open(path)):
        if r["id"] == case_id:
            return r["saved_activations_bytes"]
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", nargs="?")
    ap.add_argument("--spec", help="ad-hoc case as JSON (same fields as cases.json)")
    ap.add_argument("--set", action="append", default=[], metavar="K=V")
    ap.add_argument("--module", help="regex on module names to print in detail")
    ap.add_argument("--summary", action="store_true")
    ap.add_argument("--src", action="store_true", help="print the python source line that saved each storage")
    ap.add_argument("--json")
    ap.add_argument("--live", action="store_true")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--ops", action="store_true", help="run the single-op experiments and exit")
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.ops:
        op_rules()
        return
    cases = load_cases()
    if a.list:
        for cid, c in cases.items():
            print(cid, json.dumps({k: v for k, v in c.items() if k != "id"}))
        return
    if a.spec:
        case = json.loads(a.spec)
        case.setdefault("id", "adhoc")
    elif a.case in cases:
        case = dict(cases[a.case])
    else:
        raise SystemExit(f"unknown case {a.case!r}; --list shows the known ones")
    for kv in a.set:
        k, v = kv.split("=", 1)
        try:
            case[k] = json.loads(v)
        except json.JSONDecodeError:
            case[k] = v
    model, recs, n_ckpt = run_case(case)

    total = sum(r["nbytes"] for r in recs)
    mod_re = re.compile(a.module) if a.module else None
    if not a.summary:
        # chronological (order of first save); a header line whenever the module changes
        prev = None
        for r in recs:
            if mod_re and not mod_re.search(r["module"]):
                prev = None
                continue
            if r["module"] != prev:
                print(f"{r['module']}  ({r['module_class']})")
                prev = r["module"]
            view = f" VIEW of {fmt_shape(r['base_shape']) if r['base_shape'] else '?'} (tensor {r['tensor_bytes']:,} B)" if r["view"] else ""
            shared = f" | also saved in: {','.join(r['also_saved_in'])}" if r["also_saved_in"] else ""
            ops = " ".join(r["ops"]) if r["ops"] else "(node not reachable from loss.grad_fn)"
            print(f"   {fmt_shape(r['shape']):<22} {r['dtype']:<9} {r['nbytes']:>13,}  {ops}{view}{shared}")
            if a.src:
                print(f"{'':42}at {r['src']}")
    # per top-level child and per class totals
    top = collections.OrderedDict()
    for r in recs:
        k = []
        for p in r["module"].split("."):
            m = re.search(r"\d+$", p)
            k.append(p[: m.start()] + "*" if m else p)
            if m:
                break
        k = ".".join(k)
        top.setdefault(k, [0, 0])
        top[k][0] += r["nbytes"]
        top[k][1] += 1
    print("\n== totals by module group ==")
    for k, (b, n) in top.items():
        print(f"  {k:<50} {n:>5} storages {b:>15,} B")
    ref = reference_bytes(case["id"])
    print(f"\nTOTAL saved storages: {len(recs)}   bytes: {total:,}")
    if n_ckpt:
        print(f"(graph walk skipped {n_ckpt} nodes inside checkpoint regions)")
    if ref is not None:
        print(f"reference.json saved_activations_bytes: {ref:,}  -> {'EQUAL' if ref == total else f'DIFF {total - ref:+,}'}")
    if a.json:
        json.dump({"case": case, "total": total, "reference": ref, "storages": [dict(r, key=list(r["key"])) for r in recs]},
                  open(a.json, "w"), indent=1)
        print(f"wrote {a.json}")
    if a.live:
        r = measure.measure(case)
        print(f"\nlive peak (profiler timeline, as measure.py): {r['timeline']['peak_total']:,} B")
        print("  at peak:", json.dumps(r["timeline"]["at_peak"]))
        print(f"  measure.py saved_activations_bytes: {r['saved_activations_bytes']:,}")


if __name__ == "__main__":
    main()
