"""Measures a torch.optim optimizer's state and step temporaries on torchvision's ViT-B/16.

Batch 1, CPU, random weights, cross-entropy on the logits, as the README's optimizer table:
one warm-up step (the state exists from then on), then a forward and backward pass and one
`optimizer.step()` under `torch.profiler.profile(profile_memory=True)`.

- state: the bytes of every tensor in `optimizer.state`, each storage once;
- temporaries: the peak of the bytes `step()` allocates above what was live when it started
  (the running sum of the profiler's `[memory]` allocation and free events, in time order).

    python3 tools/measure_optim.py adamw --foreach false [--fused] [--dtype bfloat16]
"""

import argparse
import json

import torch
import torchvision
from torch.profiler import ProfilerActivity, profile

OPTIMIZERS = {
    "sgd": lambda p, **k: torch.optim.SGD(p, lr=1e-3, **k),
    "sgd-momentum": lambda p, **k: torch.optim.SGD(p, lr=1e-3, momentum=0.9, **k),
    "sgd-nesterov": lambda p, **k: torch.optim.SGD(p, lr=1e-3, momentum=0.9, nesterov=True, **k),
    "adam": lambda p, **k: torch.optim.Adam(p, lr=1e-4, **k),
    "adamw": lambda p, **k: torch.optim.AdamW(p, lr=1e-4, **k),
    "adagrad": lambda p, **k: torch.optim.Adagrad(p, lr=1e-3, **k),
    "rmsprop": lambda p, **k: torch.optim.RMSprop(p, lr=1e-3, **k),
    "rmsprop-momentum": lambda p, **k: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9, **k),
    "adafactor": lambda p, **k: torch.optim.Adafactor(p, lr=1e-3, **k),
}


def state_bytes(opt):
    seen = {}
    for state in opt.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                s = v.untyped_storage()
                seen[(s.data_ptr(), s.nbytes())] = s.nbytes()
    return sum(seen.values())


def step_temporaries(prof):
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def measure(name, foreach, fused, dtype):
    torch.manual_seed(0)
    model = torchvision.models.vit_b_16().to(dtype)
    model.train()
    x = torch.randn(1, 3, 224, 224, dtype=dtype)
    y = torch.randint(0, 1000, (1,))
    kw = {"foreach": foreach}
    if fused:
        kw = {"fused": True}
    opt = OPTIMIZERS[name](list(model.parameters()), **kw)

    def fwd_bwd():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()

    fwd_bwd()
    opt.step()  # warm-up: the state exists from here on
    fwd_bwd()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step()
    return {
        "optimizer": name,
        "foreach": foreach,
        "fused": fused,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "state_bytes": state_bytes(opt),
        "temporaries_bytes": step_temporaries(prof),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("optimizers", nargs="+", choices=sorted(OPTIMIZERS))
    ap.add_argument("--foreach", choices=["true", "false"], default="true")
    ap.add_argument("--fused", action="store_true")
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    for name in a.optimizers:
        r = measure(name, a.foreach == "true", a.fused, getattr(torch, a.dtype))
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
