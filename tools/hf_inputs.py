"""Named model inputs for ../shared/groundtruth/measure.py's cases: images, audio, several inputs.

measure.py's `build()` gives a transformers model `input_ids` `[batch, seq]` only. A case with an
`inputs` key gets exactly the tensors it names instead, passed as keyword arguments:

    "inputs": {"pixel_values": {"float": [3, 32, 32]},            # randn, in the case's dtype
               "input_ids": {"ids": [16]},                          # randint(0, vocab_size)
               "labels": {"ids": [], "high": 10},                   # randint(0, 10), shape [batch]
               "return_loss": true}                                 # any other JSON value as is

Multimodal cases (LLaVA, Qwen2-VL) give image-token ids and labels equal to the ids:

    "input_ids": {"ids": [64], "high": 999, "image": {"id": 999, "at": 1, "count": 16}},
                 # random ids below 999, then positions 1..17 of every sample set to 999
                 # ("start"/"end": ids put just before and after them, Qwen2-VL's)
    "labels": {"same": "input_ids"},                                 # the same tensor (measure.py's LMs)
    "pixel_values": {"float_flat": [64, 1176]},                      # randn [64, 1176], no batch dim
    "image_grid_thw": {"grid": [1, 16, 16]},                         # int64 [[1, 16, 16]] * batch

A case with `"rope_index": true` also passes Qwen2-VL's M-RoPE `position_ids` `[3, batch, seq]`,
computed from the real ids by `model.model.compute_3d_position_ids` (the emulated CUDA run cannot
compute them on fake tensors).

`float_nobatch` is a float tensor of exactly the shape given, without the batch dimension (Flux's
`img_ids` `[N, 3]` and `txt_ids` `[T, 3]`, which the model reads once for the whole batch).

`float_flat` is Qwen2-VL's flattened patches: the shape as given, the batch's images already
concatenated along dim 0 (the caller multiplies by the batch). `grid` repeats one image's
`(t, h, w)` once per sample.

Every shape is the shape after the batch dimension. Float tensors are made in the case's dtype
(as a data loader hands a bfloat16 model bfloat16 pixels), so the model makes no cast copy of
them; they are the batch, left out of the saved activations like measure.py's own inputs. The
loss is `out.loss` when the model returns one, else `out[0].sum()`.

A case whose `model` is `diffusers:CLASS` builds `diffusers.CLASS.from_config(case["config"])`
(diffusers' UNet2DConditionModel: `sample`, `timestep`, `encoder_hidden_states`; SD3Transformer2DModel
and FluxTransformer2DModel: `hidden_states`, `encoder_hidden_states`, `pooled_projections`,
`timestep`, and Flux's `img_ids`, `txt_ids`, `guidance`; SDXL's
`added_cond_kwargs` entries `text_embeds` and `time_ids` are named at the top level of `inputs`
and passed on in that dict by a wrapper without parameters). Its loss is `out.sample.sum()`, or
with `"loss": "mse"` diffusers' training scripts' `F.mse_loss(out.sample.float(),
target.float())` against a `target` input of the output's shape (handed to the wrapper, which
ignores it, so that measure.py counts it as an input and not as a saved activation).

`extend(measure_module)` wraps the module's `build()`; cases without `inputs` are built as before.
Used by tools/measure_hf.py (CPU) and tools/measure_fake_cuda.py (emulated CUDA).
"""
import torch


def _vocab(cfg):
    for c in (cfg, getattr(cfg, "text_config", None), getattr(cfg, "decoder", None)):
        v = getattr(c, "vocab_size", None) if c is not None else None
        if v:
            return v
    raise ValueError("an `ids` input without `high` needs a config with vocab_size")


ADDED_COND = ("text_embeds", "time_ids")


class _Unet(torch.nn.Module):
    """Passes SDXL's `text_embeds` and `time_ids` to the UNet in `added_cond_kwargs`; takes the
    loss's `target` as an input it does not use."""

    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, target=None, **kwargs):
        self.target = target  # as measure.py moved it to the device: the loss reads this one
        added = {k: kwargs.pop(k) for k in ADDED_COND if k in kwargs}
        if added:
            kwargs["added_cond_kwargs"] = added
        return self.unet(**kwargs)


def _tensors(case, dtype, vocab=None):
    batch = case["batch"]
    torch.manual_seed(1)
    kwargs = {}
    for name, spec in case["inputs"].items():
        if isinstance(spec, dict) and "float" in spec:
            kwargs[name] = torch.randn(batch, *spec["float"], dtype=dtype)
        elif isinstance(spec, dict) and "float_nobatch" in spec:
            kwargs[name] = torch.randn(*spec["float_nobatch"], dtype=dtype)
        elif isinstance(spec, dict) and "float_flat" in spec:
            rows, cols = spec["float_flat"]
            kwargs[name] = torch.randn(batch * rows, cols, dtype=dtype)
        elif isinstance(spec, dict) and "grid" in spec:
            kwargs[name] = torch.tensor([spec["grid"]] * batch, dtype=torch.long)
        elif isinstance(spec, dict) and "ids" in spec:
            high = spec.get("high") or vocab()
            ids = torch.randint(0, high, (batch, *spec["ids"]))
            if "image" in spec:
                img = spec["image"]
                ids[:, img["at"]:img["at"] + img["count"]] = img["id"]
                if "start" in img:  # Qwen2-VL's <|vision_start|> before the image tokens
                    ids[:, img["at"] - 1] = img["start"]
                if "end" in img:
                    ids[:, img["at"] + img["count"]] = img["end"]
            kwargs[name] = ids
        elif isinstance(spec, dict) and "same" in spec:
            kwargs[name] = kwargs[spec["same"]]
        else:
            kwargs[name] = spec
    return kwargs


def _diffusers(case):
    import diffusers

    cls = getattr(diffusers, case["model"].split(":", 1)[1])
    model = cls.from_config(case["config"])
    if case.get("checkpointing"):
        model.enable_gradient_checkpointing()
    dtype = getattr(torch, case.get("dtype", "float32"))
    kwargs = _tensors(case, dtype)
    model = _Unet(model)
    if case.get("mode", "train") == "infer":
        return model, (lambda: ((), kwargs)), (lambda out: None)
    if case.get("loss") == "mse":
        return model, (lambda: ((), kwargs)), (
            lambda out: torch.nn.functional.mse_loss(out.sample.float(), model.target.float()))
    return model, (lambda: ((), kwargs)), (lambda out: out.sample.sum())


def extend(gt):
    build = gt.build

    def ours(case):
        if case["model"].startswith("diffusers:"):
            return _diffusers(case)
        if "inputs" not in case:
            return build(case)
        import transformers

        kind = case["model"][3:]
        cfg = getattr(transformers, case["config_class"])(**case.get("config", {}))
        cfg._attn_implementation = case.get("attn", "sdpa")
        for sub in ("text_config", "vision_config", "audio_config"):
            c = getattr(cfg, sub, None)
            if c is not None:
                c._attn_implementation = cfg._attn_implementation
        model = getattr(transformers, kind)(cfg)
        if case.get("checkpointing"):
            model.gradient_checkpointing_enable()
        dtype = getattr(torch, case.get("dtype", "float32"))
        kwargs = _tensors(case, dtype, lambda: _vocab(cfg))
        if case.get("rope_index"):
            # Qwen2-VL's M-RoPE position ids, computed here on the real ids as the model would
            # (`compute_3d_position_ids`) and passed in, so that the emulated CUDA run need not
            # build them from fake tensors (its `torch.tensor` of per-sample deltas cannot)
            with torch.no_grad():
                kwargs["position_ids"] = model.model.compute_3d_position_ids(
                    input_ids=kwargs["input_ids"], inputs_embeds=None,
                    image_grid_thw=kwargs.get("image_grid_thw"), video_grid_thw=None,
                    attention_mask=None, cache=None,
                    mm_token_type_ids=kwargs.get("mm_token_type_ids"))
        if case.get("mode", "train") == "infer":
            for k in ("labels", "return_loss"):
                kwargs.pop(k, None)
            return model, (lambda: ((), kwargs)), (lambda out: None)
        return model, (lambda: ((), kwargs)), (
            lambda out: out.loss if getattr(out, "loss", None) is not None else out[0].sum())

    gt.build = ours
    return gt
