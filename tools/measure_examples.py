#!/usr/bin/env python3
"""Measure the PyTorch modules behind examples/unet2d.toml and examples/lstm_classifier.toml.

Each model is measured the way ../shared/groundtruth/measure.py measures (its measure() runs one
warm-up step, then one step whose forward is recorded under saved_tensors_hooks, every saved
storage counted once, parameters, buffers and the batch (inputs and labels) left out), with
AdamW (foreach; `zero_grad(set_to_none=True)` before each step) unless `--optim` says otherwise, and prints the saved-activation bytes, the parameter count and the step's peak.

With `--fake-cuda` the step runs as on a CUDA GPU (H100/H200, sm 9.0) through
tools/measure_fake_cuda.py's fake tensors instead (the UNet; nn.LSTM's flattened weights do not
survive that script's parameter conversion, and PyTorch's meta kernel of `_cudnn_rnn` gives the
reserve buffer 0 bytes, so an LSTM cannot be measured that way).

Usage (with the ground-truth venv):
  measure_examples.py unet2d|lstm_classifier [--dtype bfloat16] [--optim adamw] [--fake-cuda]
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
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import measure  # noqa: E402


def conv_block(cin, cout):
    """Two 3×3 convolutions without bias, each followed by GroupNorm(8) and an in-place ReLU."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    """examples/unet2d.toml: a two-stage UNet, 3 → 5 classes."""

    def __init__(self, classes=5):
        super().__init__()
        self.enc1 = conv_block(3, 32)
        self.enc2 = conv_block(32, 64)
        self.mid = conv_block(64, 128)
        self.up2 = nn.ConvTranspose2d(128, 64, 2, stride=2)
        self.dec2 = conv_block(128, 64)
        self.dec1 = conv_block(96, 32)
        self.head = nn.Conv2d(32, classes, 1)

    def forward(self, x, labels=None):
        self.labels = labels
        s1 = self.enc1(x)
        s2 = self.enc2(F.max_pool2d(s1, 2, 2))
        m = self.mid(F.max_pool2d(s2, 2, 2))
        d2 = self.dec2(torch.cat([self.up2(m), s2], 1))
        up = F.interpolate(d2, scale_factor=2, mode="bilinear")
        d1 = self.dec1(torch.cat([up, s1], 1))
        return self.head(d1)


class LstmClassifier(nn.Module):
    """examples/lstm_classifier.toml: embedding, 2-layer bidirectional LSTM, last step, linear."""

    def __init__(self, vocab=20000, emb=128, hidden=256, classes=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, emb)
        self.lstm = nn.LSTM(emb, hidden, num_layers=2, bidirectional=True, batch_first=True)
        self.fc = nn.Linear(2 * hidden, classes)

    def forward(self, ids, labels=None):
        self.labels = labels
        out, _ = self.lstm(self.embed(ids))
        return self.fc(out[:, -1])


def build(name, batch):
    torch.manual_seed(0)
    if name == "unet2d":
        x = torch.randn(batch, 3, 128, 128)
        y = torch.randint(0, 5, (batch, 128, 128))
        return UNet(), x, y
    if name == "lstm_classifier":
        x = torch.randint(0, 20000, (batch, 128))
        y = torch.randint(0, 4, (batch,))
        return LstmClassifier(), x, y
    raise SystemExit(f"unknown example {name}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("example", choices=["unet2d", "lstm_classifier"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--optim", default="adamw", help="measure.py's optimizer names (adamw, sgd, ...)")
    ap.add_argument("--fake-cuda", action="store_true", help="measure_fake_cuda.py's fake CUDA tensors (sm 9.0)")
    a = ap.parse_args()
    batch = {"unet2d": 4, "lstm_classifier": 16}[a.example]
    original = measure.build

    def ours(case):
        if case["model"] != a.example:
            return original(case)
        model, x, y = build(a.example, case["batch"])
        # The labels go in as a keyword input (the forward only keeps a reference) so that
        # measure() leaves them out of the saved activations, as it leaves out the batch (memest
        # counts them as input bytes), and the loss reads them on the model's device.
        return model, (lambda: ((x,), {"labels": y})), (lambda out: F.cross_entropy(out, model.labels))

    case = {"id": a.example, "model": a.example, "batch": batch, "dtype": a.dtype, "optimizer": a.optim}
    if a.fake_cuda:
        sys.path.insert(0, HERE)
        import measure_fake_cuda as mfc

        gt = mfc.load_measure_module()
        gt.build = ours
        opts = argparse.Namespace(mode="fake-cuda", engine="python", sm=(9, 0), detail=False, memtracker=False)
        r = mfc.measure(case, opts, gt)
        print(f"fake CUDA (sm 9.0): saved activations {r['saved_activations_bytes']} B, "
              f"peak {r['timeline']['peak_total']} B, allocator model {r.get('cuda_sim')}")
        return
    measure.build = ours
    r = measure.measure(case)
    print(f"torch {r['torch']}: saved activations {r['saved_activations_bytes']} B, "
          f"parameters {r['params']['count']}, gradients {r['grads_bytes']} B, "
          f"optimizer state {r['optimizer_state_bytes']} B, peak {r['timeline']['peak_total']} B")
    print("at peak:", r["timeline"]["at_peak"])


if __name__ == "__main__":
    main()
