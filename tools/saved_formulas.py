#!/usr/bin/env python3
"""Symbolic saved-activation formulas of tools/SAVED_TENSORS.md, checked against reference.json.

Pure python (no torch). Each function returns (per_block_bytes, n_blocks, rest_bytes) or a total,
written with the symbols of SAVED_TENSORS.md; main() prints formula vs measured.
Usage: saved_formulas.py [--reference PATH]
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def ce_loss(rows, classes, target_new=True):
    """cross_entropy = log_softmax (fp32 result, rows x classes) + nll_loss (target int64, total_weight fp32 scalar)."""
    return rows * classes * 4 + (8 * rows if target_new else 0) + 4


def mlp(B=32, dims=(1000, 2000, 1000, 100)):
    # ReLU result (shared with the next Linear's input) for every hidden layer; loss out.sum() saves nothing
    return sum(B * d * 4 for d in dims[1:-1])


def vgg16(B=4):
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
    H, C, tot = 224, 3, 0
    for v in cfg:
        if v == "M":
            H //= 2
            tot += B * C * H * H * 8  # max-pool indices int64
            tot += B * C * H * H * 4  # pool output, saved by next conv (or avgpool)
        else:
            C = v
            tot += B * C * H * H * 4  # ReLU(inplace) result = next conv / maxpool input
    tot += B * 25088 * 4  # flatten(avgpool out) saved by classifier.0
    tot += 2 * (B * 4096 * 4 * 3)  # per (ReLU result, Dropout noise fp32, next Linear input)
    return tot + ce_loss(B, 1000)


def resnet50(B=8, amp=False):
    e = 2 if amp else 4  # activation element size
    tot = 0
    # stem: conv1 (input = image; under autocast its bf16 copy counts), bn1, relu, maxpool
    if amp:
        tot += B * 3 * 224 * 224 * 2
    tot += B * 64 * 112 * 112 * e * 2 + 2 * 64 * 4  # bn1 input, relu result (= maxpool input), bn stats fp32
    tot += B * 64 * 56 * 56 * 8  # maxpool indices
    tot += B * 64 * 56 * 56 * e  # maxpool out = layer1.0.conv1/downsample input
    H, cin = 56, 64
    for width, n, stride in [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]:
        for i in range(n):
            s = stride if i == 0 else 1
            Ho = H // s
            ds = i == 0
            blk = 0
            blk += B * width * H * H * e * 2  # bn1 input, relu1 result (conv2 input)
            blk += B * width * Ho * Ho * e * 2  # bn2 input, relu2 result (conv3 input)
            blk += B * 4 * width * Ho * Ho * e * (3 if ds else 2)  # bn3 input, [downsample bn input], relu3 result
            blk += 4 * (2 * width + 2 * width + 8 * width + (8 * width if ds else 0))  # BN save_mean/invstd fp32
            tot += blk
            H, cin = Ho, 4 * width
    tot += B * 2048 * e  # fc input (avgpool to 1x1 is a mean: saves nothing)
    if amp:
        # every conv/linear weight cast to bf16 and saved (2 bytes per weight element; biases/BN not)
        conv_fc_weights = 25557032 - 53120 - 1000  # params - BN affine - fc bias
        tot += conv_fc_weights * 2
    return tot + ce_loss(B, 1000)


def mobilenet_v2(B=8):
    def cbr(C, H):  # Conv-BN-ReLU6(inplace): BN input, hardtanh_ clone of BN out, ReLU6 out (next conv input)
        return 3 * B * C * H * H * 4 + 2 * C * 4

    tot = cbr(32, 112)  # stem (its conv input is the image)
    H, cin = 112, 32
    for t, c, n, s in [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]:
        for i in range(n):
            st = s if i == 0 else 1
            hid = cin * t
            Ho = H // st
            if t != 1:
                tot += cbr(hid, H)  # expand 1x1
            tot += cbr(hid, Ho)  # depthwise 3x3
            tot += B * c * Ho * Ho * 4 + 2 * c * 4  # project BN input + stats
            tot += B * c * Ho * Ho * 4  # block output (BN out or residual sum) = next conv input
            H, cin = Ho, c
    tot += 2 * B * 1280 * 7 * 7 * 4 + 2 * 1280 * 4  # features.18: BN input, hardtanh_ clone (its output feeds mean-pool: not saved)
    tot += 2 * B * 1280 * 4  # dropout noise fp32, classifier Linear input
    return tot + ce_loss(B, 1000)


def vit_b_16(B=4, S=197, D=768, h=12, F=3072, L=12):
    blk = 4 * (B * S * D * (1 + 1 + 3 + 1 + 1 + 1) + 2 * B * S * F + 4 * B * S + B * h * S)
    # LN1 in, in_proj in, packed qkv (3BSD, via q/k/v views), SDPA out (= out_proj in), LN2 in, mlp.0 in,
    # GELU in + mlp.3 in (2 BSF), 2x LN mean/rstd (4 BS), logsumexp (B h S)
    rest = 4 * (B * S * D + 2 * B * S) + 4 * B * S * D + ce_loss(B, 1000)  # encoder.ln; head input = view of ln out
    return blk, L, rest


def bert_base(B=8, S=128, D=768, h=12, F=3072, L=12, labels=2):
    blk = 4 * (10 * B * S * D + 3 * B * h * S * S + 2 * B * S * F + 4 * B * S)
    rest = 8 * S  # token_type_ids gathered from the buffer: [1,S] int64
    rest += 4 * (B * S * D + 2 * B * S) + 4 * B * S * D  # embeddings LayerNorm, dropout noise
    rest += 4 * B * S * D  # pooler dense input = hidden[:,0] view of the last layer output (whole storage)
    rest += 3 * 4 * B * D  # pooler tanh result, classifier dropout noise, classifier input
    rest += ce_loss(B, labels, target_new=False)  # labels are a model input: not counted
    return blk, L, rest


def gpt2(B=4, S=256, D=768, h=12, F=3072, L=12, V=50257, attn="sdpa", ckpt=False):
    if ckpt:
        blk = 4 * B * S * D  # checkpoint keeps each block's input only
    elif attn == "sdpa":
        blk = 4 * (12 * B * S * D + 5 * B * S * F + 4 * B * S + B * h * S)
    else:
        blk = 4 * (10 * B * S * D + 3 * B * h * S * S + 5 * B * S * F + 4 * B * S)
    rest = 8 * S  # wpe position_ids [1,S] int64
    rest += 4 * B * S * D  # embedding dropout noise
    rest += 4 * (B * S * D + 2 * B * S)  # ln_f
    rest += 4 * B * S * D  # lm_head input
    rest += ce_loss(B * S, V)  # causal-LM loss over all B*S rows (labels padded then shifted)
    return blk, L, rest


def llama_tiny(B=4, S=256, D=512, H=8, KV=2, hd=64, F=1408, L=4, V=32000):
    blk = 20 * B * S * D  # 2x RMSNorm (fp32 x + bf16 normed), q/k/v in, q_embed, SDPA out, gate/up in
    blk += 2 * 2 * B * KV * S * hd  # K, V (DynamicCache cat copies) bf16, not repeated (enable_gqa)
    blk += 4 * B * H * S  # logsumexp fp32
    blk += 2 * 4 * B * S  # 2x rsqrt [B,S,1] fp32
    blk += 4 * 2 * B * S * F  # silu in, silu out, up out, down_proj in (bf16)
    rest = 2 * 2 * S * hd  # cos, sin [1,S,hd] bf16, shared by all layers
    rest += 6 * B * S * D + 4 * B * S  # final norm
    rest += 2 * B * S * D  # lm_head input
    rest += ce_loss(B * S, V)  # log_softmax of logits.float(): fp32
    return blk, L, rest


# ---------------- models outside reference.json (tools/extra_cases.json) ----------------
def resnet18(B=2):
    tot = B * 64 * 112 * 112 * 4 * 2 + 2 * 64 * 4 + B * 64 * 56 * 56 * (8 + 4)  # stem as resnet50
    H = 56
    for width, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
        for i in range(2):
            s = stride if i == 0 else 1
            Ho = H // s
            ds = i == 0 and width != 64
            # BasicBlock: bn1 in, relu1 result (conv2 in), bn2 in, [downsample bn in], relu2 result (block out)
            tot += B * width * Ho * Ho * 4 * (4 + (1 if ds else 0)) + 4 * 2 * width * (2 + (1 if ds else 0))
            H = Ho
    return tot + B * 512 * 4 + ce_loss(B, 1000)


def efficientnet_b0(B=2):
    def cbs(C, H):  # Conv-BN-SiLU(inplace): BN in, silu_ clone, SiLU out
        return 3 * B * C * H * H * 4 + 2 * C * 4

    tot = cbs(32, 112)
    H, cin, blk_id, n_blocks = 112, 32, 0, 16
    for t, k, s, c, n in [(1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3),
                          (6, 5, 1, 112, 3), (6, 5, 2, 192, 4), (6, 3, 1, 320, 1)]:
        for i in range(n):
            st = s if i == 0 else 1
            hid, Ho, sq = cin * t, H // st, max(1, cin // 4)
            if t != 1:
                tot += cbs(hid, H)  # expand 1x1
            tot += cbs(hid, Ho)  # depthwise
            tot += 4 * B * (hid + 2 * sq + hid)  # SE: fc1 in (pooled), silu clone + fc2 in, sigmoid result
            tot += B * hid * Ho * Ho * 4  # SE output = project conv input
            tot += B * c * Ho * Ho * 4 + 2 * c * 4  # project BN in + stats
            tot += B * c * Ho * Ho * 4  # block output = next conv input
            if st == 1 and cin == c and blk_id > 0:
                tot += B * 4  # stochastic-depth noise [B,1,1,1]
            H, cin, blk_id = Ho, c, blk_id + 1
    tot += 2 * B * 1280 * 7 * 7 * 4 + 2 * 1280 * 4  # head conv: BN in, silu_ clone (out goes to mean-pool)
    tot += 2 * B * 1280 * 4  # dropout noise, Linear input
    return tot + ce_loss(B, 1000)


def densenet121(B=2, k=32, bs=4):
    tot = B * 64 * 112 * 112 * 4 * 2 + 2 * 64 * 4 + B * 64 * 56 * 56 * (8 + 4)  # stem; pool0 out is block-1 layer-1 input
    H, C = 56, 64
    for bi, n in enumerate([6, 12, 24, 16]):
        for i in range(n):
            cin = C + i * k
            if i > 0:
                tot += B * cin * H * H * 4  # torch.cat of all previous features (norm1 input)
            tot += B * cin * H * H * 4 + 2 * cin * 4  # relu1 result (conv1 input); [norm1 input of layer 1 = pool out]
            tot += 2 * B * bs * k * H * H * 4 + 2 * bs * k * 4  # norm2 input, relu2 result (conv2 input)
        C = C + n * k
        tot += B * C * H * H * 4 * 2 + 2 * C * 4  # block cat (transition/norm5 input), relu result (conv input)
        if bi < 3:
            C //= 2
            tot += B * C * H * H * 4  # AvgPool2d input (transition conv output)
            H //= 2
            tot += B * C * H * H * 4  # pool output = next block layer-1 input
    # (block 4 has no transition: its 'block cat' is norm5's input, its 'relu result' the F.relu in DenseNet.forward)
    tot += B * C * 4  # classifier input
    return tot + ce_loss(B, 1000)


def t5_tiny(B=4, S=64, D=256, h=4, dk=64, F=512, V=1000, L=2, gated=False):
    I = h * dk
    ff = (8 if gated else 3) * B * S * F  # relu: relu result, dropout noise, wo input; gated-gelu: 4 gelu_new + 2 gate mul + noise + wo in
    attn = 2 * B * S * D + B * S + B * S * D + 4 * B * S * I + 3 * B * h * S * S + B * S * D  # LN(x,h,rsqrt), proj in, Q/K/V copies + o in, probs/noise/dropped, dropout
    enc = attn + (2 * B * S * D + B * S) + B * S * D + ff + B * S * D
    dec = attn + attn + (2 * B * S * D + B * S) + B * S * D + ff + B * S * D  # cross-attn: q input = its LN out; k/v input = shared encoder output (in rest)
    rest = (5 * B * S * D + B * S) * 2  # each stack: emb dropout, final LN (x,h,rsqrt), final dropout; + enc output (cross k/v in) + lm_head in
    rest *= 4
    rest += 2 * S * S * 8 + B * S * 8  # relative-position bucket ids (enc, dec), decoder_input_ids
    rest += ce_loss(B * S, V, target_new=False)
    return 4 * enc * L + 4 * dec * L + rest


def mixtral_tiny(B=4, S=64, D=256, H=4, KV=2, hd=64, F=512, E=4, k=2, L=2, V=1000):
    T, Tk = B * S, B * S * k
    attn = 4 * (2 * B * S * D + B * S) + 4 * B * S * D  # RMSNorm (x, h, rsqrt), q/k/v input
    attn += 4 * (B * S * H * hd + 2 * B * KV * S * hd + B * H * S + B * S * H * hd)  # q_embed, K/V cat copies, lse, out
    moe = 4 * (2 * B * S * D + B * S)  # post-attention RMSNorm
    moe += 4 * T * D + 4 * T * E + 8 * T * k + 4 * T + 4 * T * k  # router: input, softmax, topk idx, div other/self
    moe += 8 * Tk * 3 + 4 * E  # perm//k, perm, inv_perm (int64), offsets int32
    moe += 4 * (Tk * D + Tk * 2 * F + Tk * F + Tk * F + Tk + Tk * D)  # gathered x, gate_up out, silu out, act*up, weights, down out
    rest = 2 * 4 * S * hd + 4 * (2 * B * S * D + B * S) + 4 * B * S * D + ce_loss(B * S, V)
    return (attn + moe) * L + rest


# measured with tools/saved_tensors.py --live (identical to measure.measure()), torch 2.15 CPU
EXTRA = {
    "resnet18-b2-fp32-sgdm": (resnet18, 43201876),
    "efficientnet_b0-b2-fp32-sgdm": (efficientnet_b0, 175359964),
    "densenet121-b2-fp32-sgdm": (densenet121, 259861076),
    "t5-tiny-relu-b4-s64-fp32-adamw": (t5_tiny, 31512580),
    "t5-tiny-gatedgelu-b4-s64-fp32-adamw": (lambda: t5_tiny(gated=True), 41998340),
    "mixtral-tiny-b4-s64-fp32-adamw": (mixtral_tiny, 17114148),
}


def total(x):
    if isinstance(x, tuple):
        blk, n, rest = x
        return blk * n + rest
    return x


CASES = {
    "mlp-b32-fp32-adam": lambda: mlp(),
    "vgg16-b4-fp32-sgdm": lambda: vgg16(),
    "resnet50-b8-fp32-sgdm": lambda: resnet50(),
    "resnet50-b8-ampbf16-sgdm": lambda: resnet50(amp=True),
    "mobilenet_v2-b8-fp32-sgd": lambda: mobilenet_v2(),
    "vit_b_16-b4-fp32-adamw": lambda: vit_b_16(),
    "bert-base-b8-s128-fp32-adamw-eager": lambda: bert_base(),
    "gpt2-b4-s256-fp32-adamw-flash": lambda: gpt2(attn="sdpa"),
    "gpt2-b4-s256-fp32-adamw-eager": lambda: gpt2(attn="eager"),
    "gpt2-b4-s256-fp32-adamw-ckpt": lambda: gpt2(ckpt=True),
    "llama-tiny-b4-s256-bf16-adamw": lambda: llama_tiny(),
}


def main():
    ref_path = os.path.join(HERE, "..", "..", "shared", "groundtruth", "reference.json")
    if "--reference" in sys.argv:
        ref_path = sys.argv[sys.argv.index("--reference") + 1]
    if not os.path.exists(ref_path):
        ref_path = "/work/shared/groundtruth/reference.json"
    ref = {r["id"]: r["saved_activations_bytes"] for r in json.load(open(ref_path))}
    bad = 0
    for cid, f in CASES.items():
        est = total(f())
        m = ref[cid]
        err = 100.0 * (est - m) / m
        bad += abs(err) > 0.5
        print(f"{cid:38} formula {est:>14,}  measured {m:>14,}  err {err:+.4f}%")
    print("-- not in reference.json --")
    for cid, (f, m) in EXTRA.items():
        est = total(f())
        err = 100.0 * (est - m) / m
        bad += abs(err) > 0.5
        print(f"{cid:38} formula {est:>14,}  measured {m:>14,}  err {err:+.4f}%")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
