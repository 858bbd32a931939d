//! Qwen2-VL (`Qwen2VLForConditionalGeneration`, `Qwen2VLModel`;
//! `models/qwen2_vl/modeling_qwen2_vl.py`): a ViT over flattened patches, the patch merger and a
//! Qwen2 language model.
//!
//! The processor hands the model `pixel_values` `[patches, channels · temporal_patch_size ·
//! patch_size²]` (an image is repeated `temporal_patch_size` times in time: one temporal patch)
//! and `image_grid_thw` `[1, H / patch_size, W / patch_size]`. `Qwen2VLModel.forward` embeds the
//! ids, then `Qwen2VisionTransformerPretrainedModel` runs: `PatchEmbed` (a `Conv3d` whose
//! kernel is the whole patch: a matmul of each patch row, here a `linear` without bias of the
//! same weight), the 2-D rotary tables (`Qwen2VLVisionRotaryEmbedding`, float32, applied to Q and
//! K in float32 and cast back), `depth` pre-LayerNorm blocks (fused `qkv` with a bias, attention
//! within each image, `proj`, an MLP of `embed_dim · mlp_ratio` with `hidden_act`), and
//! `PatchMerger` (`ln_q`, each `spatial_merge_size²` neighbouring patches joined,
//! `Linear`-`GELU`-`Linear` to the language model's width). The `(H / patch_size) · (W /
//! patch_size) / spatial_merge_size²` image features are written over the image tokens with
//! `masked_scatter`, and the Qwen2 language model (M-RoPE: three position rows, combined once per
//! forward into one `cos`/`sin` pair, the same size as Qwen2's) runs on the result.
//!
//! The tensors are the whole batch's patches as one sequence (`[batch · patches, embed_dim]`,
//! each image attending within itself): memest traces them per sample, `[batch, patches, ..]`,
//! which holds the same elements.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::config::Cfg;
use super::layers::{
    activation, add, layer, layernorm, linear, push, quick_gelu, repeat, rmsnorm, with_inputs,
};
use super::llava::{Multimodal, nested, splice};
use super::{ImageSize, Resolved};
use crate::error::Error;
use crate::spec::{DimSpec, InputSpec, LayerKind as K, layer_spec};

/// `--image` when none is given: 448 × 448 pixels (1024 patches of 14, 256 image tokens).
pub(super) const DEFAULT_IMAGE: u64 = 448;

/// The keys of `Qwen2VLVisionConfig` this builder reads.
#[derive(Debug, Default, Deserialize)]
struct VisionConfig {
    depth: Option<u64>,
    embed_dim: Option<u64>,
    hidden_size: Option<u64>,
    hidden_act: Option<String>,
    mlp_ratio: Option<u64>,
    num_heads: Option<u64>,
    in_channels: Option<u64>,
    /// The name older configs use for `in_channels`.
    in_chans: Option<u64>,
    patch_size: Option<u64>,
    spatial_merge_size: Option<u64>,
    temporal_patch_size: Option<u64>,
    /// Qwen2.5-VL: the SwiGLU MLP's width.
    intermediate_size: Option<u64>,
    /// Qwen2.5-VL: the merger's output width (`hidden_size` is the tower's own there).
    out_hidden_size: Option<u64>,
}

/// Builds Qwen2-VL for images of `image` pixels (default [`DEFAULT_IMAGE`] square).
#[allow(clippy::too_many_lines)] // vision tower, merger, language model, in forward order
pub(super) fn qwen2_vl(
    cfg: &Cfg,
    head: Resolved,
    image: Option<ImageSize>,
) -> Result<Multimodal, Error> {
    // Qwen2.5-VL (`Qwen2_5_VisionTransformerPretrainedModel`): RMSNorms, a biased SwiGLU MLP,
    // `hidden_size` the tower's width and `out_hidden_size` the merger's; its window attention
    // (blocks outside `fullatt_block_indexes` attend within windows of `window_size` pixels)
    // keeps what full attention per image keeps under a fused kernel, and the patches' window
    // order (`permute_input_for_window_attn`, undone after the merger) is two gather copies
    // that replace the tensors they read; the two `[patches / merge²]` int64 indices their
    // backward keeps are not counted.
    let v25 = cfg.model_type == "qwen2_5_vl";
    if head == Resolved::Classification {
        return Err(cfg.err(format!(
            "{} is supported as …ForConditionalGeneration and the bare …Model (pick --head lm or none)",
            cfg.model_type
        )));
    }
    let whole: Map<String, Value> =
        serde_json::from_str(cfg.text).map_err(|e| cfg.err(format!("not a JSON object: {e}")))?;
    let vision_json = match whole.get("vision_config") {
        None | Some(Value::Null) => "{}".to_string(),
        Some(v @ Value::Object(_)) => v.to_string(),
        Some(other) => {
            return Err(cfg.field_err(
                "vision_config",
                format!("`vision_config` must be an object (a sub-config), got {other}"),
            ));
        }
    };
    let v: VisionConfig = super::config::read(&vision_json, Some(cfg.model_type))
        .map_err(|e| nested(e, "vision_config"))?;
    let size = |key: &str, value: Option<u64>, default: u64| {
        cfg.required(
            &format!("vision_config.{key}"),
            Some(value.unwrap_or(default)),
        )
    };
    let depth = cfg.layers("vision_config.depth", Some(v.depth.unwrap_or(32)))?;
    let (embed, out_hidden) = if v25 {
        (
            size("hidden_size", v.hidden_size, 1280)?,
            size("out_hidden_size", v.out_hidden_size, 3584)?,
        )
    } else {
        (
            size("embed_dim", v.embed_dim, 1280)?,
            size("hidden_size", v.hidden_size, 3584)?,
        )
    };
    let heads = size("num_heads", v.num_heads, 16)?;
    let ratio = size("mlp_ratio", v.mlp_ratio, 4)?;
    let channels = size("in_channels", v.in_channels.or(v.in_chans), 3)?;
    let patch = size("patch_size", v.patch_size, 14)?;
    let merge = size("spatial_merge_size", v.spatial_merge_size, 2)?;
    let temporal = size("temporal_patch_size", v.temporal_patch_size, 2)?;
    let act = v
        .hidden_act
        .as_deref()
        .unwrap_or(if v25 { "silu" } else { "quick_gelu" });
    let overflow = || Error::Overflow("the vision tower's sizes".into());
    let unit = patch.checked_mul(merge).ok_or_else(overflow)?;
    let img = image.unwrap_or(ImageSize {
        height: DEFAULT_IMAGE,
        width: DEFAULT_IMAGE,
    });
    if !img.height.is_multiple_of(unit) || !img.width.is_multiple_of(unit) {
        let round = |n: u64| (n / unit).max(1) * unit;
        return Err(super::image_error(format!(
            "--image {img}: {} reads images whose sides are multiples of patch_size · spatial_merge_size = {unit} pixels (its processor resizes to them); e.g. --image {}x{}",
            cfg.model_type,
            round(img.height),
            round(img.width)
        )));
    }
    let patches = (img.height / patch)
        .checked_mul(img.width / patch)
        .ok_or_else(overflow)?;
    let tokens = patches / (merge * merge);
    let patch_dim = channels
        .checked_mul(temporal)
        .and_then(|n| n.checked_mul(patch))
        .and_then(|n| n.checked_mul(patch))
        .ok_or_else(overflow)?;
    let merged = embed.checked_mul(merge * merge).ok_or_else(overflow)?;
    let inter = if v25 {
        size("intermediate_size", v.intermediate_size, 3420)?
    } else {
        embed.checked_mul(ratio).ok_or_else(overflow)?
    };
    if embed % heads != 0 {
        return Err(cfg.field_err(
            "vision_config.num_heads",
            format!("`embed_dim` {embed} is not a multiple of `num_heads` {heads}"),
        ));
    }
    let dim = |n: u64| i64::try_from(n).map_err(|_| overflow());

    // The language model: Qwen2's layers, from `text_config` (or, in the Hub's flat configs, the
    // top level).
    let mut text = match whole.get("text_config") {
        Some(Value::Object(m)) => m.clone(),
        _ => whole.clone(),
    };
    text.remove("vision_config");
    text.insert("model_type".into(), Value::from("qwen2"));
    let text_tie = text
        .get("tie_word_embeddings")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let tie = whole
        .get("tie_word_embeddings")
        .and_then(Value::as_bool)
        .unwrap_or(false)
        || text_tie;
    text.insert("tie_word_embeddings".into(), Value::Bool(tie));
    let text_json = Value::Object(text).to_string();
    let row = super::DECODERS
        .iter()
        .find(|d| d.model_type == "qwen2")
        .expect("the qwen2 row");
    let text_cfg = Cfg {
        text: &text_json,
        model_type: cfg.model_type,
        header: super::config::read(&text_json, Some(cfg.model_type))
            .map_err(|e| nested(e, "text_config"))?,
    };
    let base = if head == Resolved::Bare {
        "language_model"
    } else {
        "model.language_model"
    };
    let (mut lm, max_positions) = super::decoder::decoder_at(&text_cfg, row, head, base)?;
    // M-RoPE: `position_ids` `[3, batch, S]`, one `cos`/`sin` row per sample.
    for l in lm.iter_mut().filter(|l| l.kind == K::Rotary) {
        l.per_sample = Some(true);
    }

    let pre = if head == Resolved::Bare {
        "visual."
    } else {
        "model.visual."
    };
    let p = |s: &str| format!("{pre}{s}");
    let mut out = Vec::new();
    push(
        &mut out,
        with_inputs(
            linear(&p("patch_embed.proj"), embed, false),
            &["pixel_values"],
        ),
    );
    push(
        &mut out,
        layer_spec! {
            head_dim: Some(embed / heads),
            // `apply_rotary_pos_emb_vision`: Q and K to float32, float32 tables, cast back.
            tables_f32: Some(true),
            upcast: Some(true),
            per_sample: Some(true),
            ..layer(K::Rotary, &p("rotary_pos_emb"))
        },
    );
    let norm = |name: &str| {
        if v25 { rmsnorm(name) } else { layernorm(name) }
    };
    let mut body = Vec::new();
    push(&mut body, norm("norm1"));
    let attn = push(
        &mut body,
        layer_spec! {
            heads: Some(heads),
            fused_qkv: Some(true),
            rotary: Some(true),
            chunked: Some(true),
            note: Some("fused qkv (with a bias) and proj".into()),
            ..layer(K::Attention, "attn")
        },
    );
    let res = push(&mut body, add("residual1", "input", &attn));
    let n2 = push(&mut body, norm("norm2"));
    let mlp = if v25 {
        // Qwen2_5_VLMLP: `down_proj(act(gate_proj(x)) * up_proj(x))`, every projection biased.
        push(&mut body, linear("mlp.gate_proj", inter, true));
        let a = push(
            &mut body,
            activation(cfg, "vision_config.hidden_act", act, "mlp.act_fn")?,
        );
        let up = push(
            &mut body,
            with_inputs(linear("mlp.up_proj", inter, true), &[&n2]),
        );
        push(
            &mut body,
            with_inputs(layer(K::Mul, "mlp.gate_mul_up"), &[&a, &up]),
        );
        push(&mut body, linear("mlp.down_proj", embed, true))
    } else {
        let fc1 = push(&mut body, linear("mlp.fc1", inter, true));
        if act == "quick_gelu" {
            quick_gelu(&mut body, "mlp.act", &fc1);
        } else {
            push(
                &mut body,
                activation(cfg, "vision_config.hidden_act", act, "mlp.act")?,
            );
        }
        push(&mut body, linear("mlp.fc2", embed, true))
    };
    push(&mut body, add("residual2", &res, &mlp));
    push(&mut out, repeat(&p("blocks"), "depth", depth, body));
    push(&mut out, norm(&p("merger.ln_q")));
    push(
        &mut out,
        layer_spec! {
            shape: Some(vec![dim(tokens)?, dim(merged)?]),
            ..layer(K::Reshape, &p("merger.view"))
        },
    );
    push(&mut out, linear(&p("merger.mlp.0"), merged, true));
    push(&mut out, layer(K::Gelu, &p("merger.mlp.1")));
    let features = push(&mut out, linear(&p("merger.mlp.2"), out_hidden, true));
    let layers = splice(cfg, "qwen2", lm, out, &features)?;
    Ok(Multimodal {
        layers,
        max_positions,
        pixels: (
            "pixel_values".into(),
            InputSpec {
                shape: vec![DimSpec::Fixed(patches), DimSpec::Fixed(patch_dim)],
                dtype: None,
            },
        ),
    })
}
