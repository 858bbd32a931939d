#!/usr/bin/env python3
"""Extract, from PyTorch's tools/autograd/derivatives.yaml, which tensors each backward formula reads.

For every operator memest's table names (`src/trace/aten/mod.rs`: the `Some("...")` and `unary("...")`
yaml entries), writes to tests/data/derivatives.json the tensors (inputs, results) that its
backward formulas mention as tensors, not only for their sizes, dtype or options, and which
formula mentions each: that is what autograd's codegen saves. A tensor named by a single
formula that computes a single input's gradient is saved only when that input needs a gradient
(`guard_for` in torchgen's gen_variable_type.py). The unit test `aten::tests` compares this file
with `AtenOp::saves()`.

Standard library only. Usage:

    python3 tools/derivatives.py PATH/TO/derivatives.yaml [--source LABEL] [--out tests/data/derivatives.json]

With a PyTorch checkout: `git -C pytorch show HEAD:tools/autograd/derivatives.yaml > /tmp/d.yaml`.
"""
import argparse
import hashlib
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Uses of a tensor that read only its metadata: codegen saves the sizes/options, not the tensor.
META = (
    "sym_sizes|sizes|sym_size|size|sym_strides|strides|options|scalar_type|layout|dim|"
    "sym_numel|numel|device|dtype|suggest_memory_format|is_conj|is_neg|defined"
)
META_CALL = re.compile(r"\b([A-Za-z_]\w*)\s*(?:\.|->)\s*(?:%s)\b" % META)
META_WRAPPER = re.compile(r"\b(?:to_args_sizes_symint|to_args_sizes|to_args_scalartypes|TensorGeometry)\(\s*\w+\s*\)")


def split_top(s, sep=","):
    """Splits at `sep` outside brackets and parentheses."""
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == sep and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur)
    return [x.strip() for x in out]


def parse_signature(sig):
    """`name(args) -> returns` -> (name, tensor input names, result names with aliases)."""
    m = re.match(r"^([\w.]+)\((.*)\)\s*->\s*(.*)$", sig)
    if not m:
        raise ValueError(f"unreadable signature: {sig}")
    name, args, ret = m.groups()
    inputs = []
    for a in split_top(args):
        if a == "*":
            continue
        a = a.split("=", 1)[0].strip()
        typ, _, arg = a.rpartition(" ")
        if typ.startswith("Tensor"):
            inputs.append(arg)
    ret = ret.strip()
    # result name -> the names a formula may use for it
    if ret.startswith("("):
        parts = split_top(ret[1:-1])
        results = {}
        for i, p in enumerate(parts):
            words = p.split()
            canon = words[1] if len(words) > 1 else f"result{i}"
            results[canon] = {canon, f"result{i}"}
    else:
        results = {"result": {"result"}}
    return name, inputs, results


def parse_entries(text):
    """The yaml's entries as (signature, {key: formula}) using the `Default` dispatch."""
    entries = []
    for block in re.split(r"\n(?=- name: )", text):
        if not block.startswith("- name: "):
            continue
        lines = block.split("\n")
        sig = lines[0][len("- name: "):].strip()
        formulas, in_dispatch, key = {}, False, None
        skip_dispatch_key = False
        for line in lines[1:]:
            if not line.strip() or line.strip().startswith("#"):
                continue
            indent = len(line) - len(line.lstrip())
            body = line.strip()
            if indent == 2 and body == "dispatch:":
                in_dispatch = True
                continue
            if in_dispatch and indent == 4:
                skip_dispatch_key = body.rstrip(":") != "Default"
                continue
            if in_dispatch and skip_dispatch_key:
                continue
            m = re.match(r"^([\w ,]+):\s*(.*)$", body)
            if m and indent in (2, 6):
                key, value = m.group(1).strip(), m.group(2).strip()
                formulas[key] = value
            elif key is not None:
                formulas[key] += " " + body  # a continued formula
        entries.append((sig, formulas))
    return entries


def unquote(v):
    if len(v) >= 2 and v[0] == v[-1] and v[0] in "\"'":
        return v[1:-1]
    return v


def mentions(formula, names):
    """The names in `names` that `formula` reads as tensors."""
    f = META_WRAPPER.sub("", formula)
    f = META_CALL.sub(lambda m: "", f)
    found = set()
    for n in names:
        if re.search(r"(?<![\w.])%s(?!\w)" % re.escape(n), f):
            found.add(n)
    return found


def analyse(sig, formulas):
    name, inputs, results = parse_signature(sig)
    alias = {}
    for canon, names in results.items():
        for n in names:
            alias[n] = canon
    for i in inputs:
        alias[i] = i
    saved, differentiable = {}, []
    for key, value in formulas.items():
        targets = [k.strip() for k in key.split(",")]
        if not all(t in inputs for t in targets):
            continue  # a forward-mode formula, output_differentiability, …
        value = unquote(value)
        if value == "non_differentiable":
            continue
        differentiable.extend(targets)
        for n in mentions(value, list(alias)):
            saved.setdefault(alias[n], []).append(key)
    return {
        "signature": sig,
        "inputs": inputs,
        "results": list(results),
        "differentiable": differentiable,
        "saved": {k: sorted(set(v)) for k, v in sorted(saved.items())},
    }


def table_entries(aten_rs):
    text = open(aten_rs, encoding="utf-8").read()
    return sorted(set(re.findall(r'(?:Some|unary)\(\s*"([\w.]+)"', text)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("yaml", help="path to tools/autograd/derivatives.yaml")
    ap.add_argument("--source", default="pytorch/pytorch", help="where the yaml came from (recorded)")
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "data", "derivatives.json"))
    ap.add_argument("--aten", default=os.path.join(ROOT, "src", "trace", "aten", "mod.rs"))
    args = ap.parse_args()
    raw = open(args.yaml, "rb").read()
    by_name = {}
    for sig, formulas in parse_entries(raw.decode("utf-8")):
        by_name[sig.split("(", 1)[0]] = (sig, formulas)
    ops, missing = {}, []
    for entry in table_entries(args.aten):
        if entry not in by_name:
            missing.append(entry)
            continue
        ops[entry] = analyse(*by_name[entry])
    if missing:
        sys.exit(f"not in {args.yaml}: {', '.join(missing)}")
    out = {
        "_about": "Generated by tools/derivatives.py from PyTorch's tools/autograd/derivatives.yaml: for each "
        "operator of src/trace/aten.rs, the tensors its backward formulas read (keyed by the formula's "
        "input names). Do not edit; regenerate (see tools/derivatives.py).",
        "source": {"repository": args.source, "sha256": hashlib.sha256(raw).hexdigest()},
        "ops": ops,
    }
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1, sort_keys=False)
        fh.write("\n")
    print(f"{len(ops)} operators -> {os.path.relpath(args.out)}")


if __name__ == "__main__":
    main()
