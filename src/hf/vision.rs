//! The vision transformers: ViT (`ViTForImageClassification`, `ViTModel`;
//! `models/vit/modeling_vit.py`) and DINOv2 (`Dinov2Model`; `models/dinov2/modeling_dinov2.py`),
//! which read `pixel_values` `[batch, num_channels, image_size, image_size]`.
//!
//! Both embed the image the same way: a `patch_size` convolution with stride `patch_size`
//! (`patch_embeddings.projection`), `flatten(2).transpose(1, 2)` to `[batch, patches, hidden]`,
//! the `[1, 1, hidden]` CLS token expanded over the batch and concatenated in front, and the
//! learned `[1, patches + 1, hidden]` position embeddings added. At the config's image size
//! neither model interpolates them (`interpolate_pos_encoding` returns the table as it is). At
//! another size (`--image`) DINOv2 always interpolates the table to the image's patch grid
//! (`Dinov2Embeddings.forward` calls `interpolate_pos_encoding` unconditionally, and it resizes
//! unless the grid has as many patches as the table and the image is square), while ViT
//! refuses the size unless `interpolate_pos_encoding=True` is passed to its forward
//! (`ViTPatchEmbeddings.forward` raises `ValueError`), which memest does not model.

use super::config::{Cfg, VisionConfig, prob};
use super::layers::{
    activation, add, cross_entropy, layer, layernorm, linear, push, push_dropout, repeat,
};
use super::{ImageSize, Resolved};
use crate::error::Error;
use crate::spec::{CombineKind, LayerKind as K, LayerSpec, Pair, Sizes, layer_spec};

/// What a vision model reads: `[batch, channels, height, width]` pixels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Image {
    /// `num_channels`.
    pub channels: u64,
    /// Height in pixels (`image_size`, or DINOv2's `--image`).
    pub height: u64,
    /// Width in pixels.
    pub width: u64,
}

/// Which vision transformer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Vit,
    Dinov2,
}

/// A size that the config writes as one number or as `[height, width]`; memest takes square
/// images and patches.
fn square(cfg: &Cfg, key: &str, v: Option<&Vec<u64>>, default: u64) -> Result<u64, Error> {
    match v.map(Vec::as_slice) {
        None => Ok(default),
        Some([n]) => Ok(*n),
        Some([h, w]) if h == w => Ok(*h),
        Some(other) => Err(cfg.field_err(
            key,
            format!("`{key}` = {other:?}: only square sizes are supported"),
        )),
    }
}

/// Builds ViT or DINOv2; returns the layers and the image they read: the config's
/// `image_size`, or for DINOv2 the `asked` image (`--image`), whose patch grid the position
/// table is interpolated to.
///
/// # Errors
/// As the config readers; for DINOv2, an `asked` side smaller than `patch_size`.
#[allow(clippy::too_many_lines)] // embeddings, the layer and the heads, in forward order
pub(super) fn vision(
    cfg: &Cfg,
    head: Resolved,
    kind: Kind,
    asked: Option<ImageSize>,
) -> Result<(Vec<LayerSpec>, Image), Error> {
    let c: VisionConfig = cfg.read()?;
    let hidden = c.hidden_size.unwrap_or(768);
    let n_layers = cfg.layers("num_hidden_layers", Some(c.num_hidden_layers.unwrap_or(12)))?;
    let heads = c.num_attention_heads.unwrap_or(12);
    let channels = c.num_channels.unwrap_or(3);
    let default_patch = match kind {
        Kind::Vit => 16,
        Kind::Dinov2 => 14,
    };
    let image = square(cfg, "image_size", c.image_size.as_ref().map(|s| &s.0), 224)?;
    let patch = square(
        cfg,
        "patch_size",
        c.patch_size.as_ref().map(|s| &s.0),
        default_patch,
    )?;
    for (key, v) in [
        ("hidden_size", hidden),
        ("num_attention_heads", heads),
        ("num_channels", channels),
        ("image_size", image),
        ("patch_size", patch),
    ] {
        cfg.required(key, Some(v))?;
    }
    if image < patch {
        return Err(cfg.field_err(
            "patch_size",
            format!("`patch_size` ({patch}) is larger than `image_size` ({image})"),
        ));
    }
    let side = image / patch;
    let patches = side
        .checked_mul(side)
        .and_then(|n| n.checked_add(1))
        .ok_or_else(|| cfg.err("the patch count overflows".into()))?;
    // DINOv2 at another image size: the patch convolution (stride `patch_size`) gives
    // `⌊height / patch⌋ × ⌊width / patch⌋` patches, and `interpolate_pos_encoding` resizes the
    // table to that grid unless it has `side²` patches and the image is square.
    let (height, width) = match asked {
        Some(a) if kind == Kind::Dinov2 => {
            if a.height < patch || a.width < patch {
                return Err(super::image_error(format!(
                    "--image {a}: a side is smaller than DINOv2's `patch_size` ({patch}), so the patch convolution has no output"
                )));
            }
            (a.height, a.width)
        }
        _ => (image, image),
    };
    let grid = (height / patch, width / patch);
    let interpolate = (grid.0.checked_mul(grid.1) != Some(side * side) || height != width)
        .then_some(Pair(grid.0, grid.1));
    // Shapes are `i64`: a size past `i64::MAX` is refused, naming its field.
    let dim = |key: &str, v: u64| {
        i64::try_from(v).map_err(|_| {
            cfg.field_err(
                key,
                format!("`{key}` gives {v}, more than a tensor dimension holds"),
            )
        })
    };
    let hidden_dim = dim("hidden_size", hidden)?;
    let patches_dim = dim("image_size", patches)?;
    // DINOv2's MLP width `int(hidden_size · mlp_ratio)` (`Dinov2MLP`, `Dinov2SwiGLUFFN`).
    let mlp = if kind == Kind::Dinov2 {
        let ratio = c.mlp_ratio.unwrap_or(4.0);
        if !(ratio.is_finite() && ratio > 0.0) {
            return Err(cfg.field_err(
                "mlp_ratio",
                format!("`mlp_ratio` = {ratio}: expected a finite number above 0"),
            ));
        }
        #[allow(clippy::cast_precision_loss)] // a width, far below 2^53
        let width = (hidden as f64 * ratio).floor();
        // Below 2^53 the float is a whole number that converts exactly.
        if !(1.0..9_007_199_254_740_992.0).contains(&width) {
            return Err(cfg.field_err(
                "mlp_ratio",
                format!(
                    "`mlp_ratio` = {ratio}: hidden_size {hidden} × mlp_ratio gives {width} MLP features"
                ),
            ));
        }
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // checked range
        let width = width as u64;
        width
    } else {
        0
    };
    let act_name = c.hidden_act.as_deref().unwrap_or("gelu");
    let hidden_p = prob!(cfg, c.hidden_dropout_prob, 0.0)?;
    let attn_p = prob!(cfg, c.attention_probs_dropout_prob, 0.0)?;
    let qkv_bias = c.qkv_bias.unwrap_or(true);
    if c.drop_path_rate.unwrap_or(0.0) > 0.0 {
        return Err(cfg.field_err(
            "drop_path_rate",
            "`drop_path_rate` > 0 (stochastic depth on the residual branches) is not supported yet"
                .into(),
        ));
    }

    let base = match kind {
        Kind::Vit => "vit",
        Kind::Dinov2 => "dinov2",
    };
    let p = |s: &str| {
        if head == Resolved::Bare {
            s.to_string()
        } else {
            format!("{base}.{s}")
        }
    };
    let mut out = Vec::new();
    if kind == Kind::Dinov2 && c.use_mask_token.unwrap_or(true) {
        // `Dinov2Embeddings.mask_token` `[1, hidden]`: a parameter that only masked image
        // modelling (`bool_masked_pos`) reads; no gradient, so no optimizer state either.
        push(
            &mut out,
            layer_spec! {
                shape: Some(vec![1, hidden_dim]),
                combine: Some(CombineKind::Unused),
                ..layer(K::Parameter, &p("embeddings.mask_token"))
            },
        );
    }
    push(
        &mut out,
        layer_spec! {
            out_channels: Some(hidden),
            kernel: Some(Sizes(vec![patch])),
            stride: Some(Sizes(vec![patch])),
            ..layer(K::Conv2d, &p("embeddings.patch_embeddings.projection"))
        },
    );
    push(
        &mut out,
        layer_spec! {
            start_dim: Some(2),
            ..layer(K::Flatten, &p("embeddings.patch_embeddings.flatten"))
        },
    );
    push(
        &mut out,
        layer_spec! {
            dims: Some(vec![1, 2]),
            ..layer(K::Transpose, &p("embeddings.patch_embeddings.transpose"))
        },
    );
    push(
        &mut out,
        layer_spec! {
            shape: Some(vec![1, 1, hidden_dim]),
            combine: Some(CombineKind::Concat),
            dim: Some(1),
            ..layer(K::Parameter, &p("embeddings.cls_token"))
        },
    );
    let prev = push(
        &mut out,
        layer_spec! {
            shape: Some(vec![1, patches_dim, hidden_dim]),
            size: interpolate,
            ..layer(K::Parameter, &p("embeddings.position_embeddings"))
        },
    );
    push_dropout(&mut out, &p("embeddings.dropout"), hidden_p, prev);

    let mut body = Vec::new();
    let (norm1, norm2, layers_path) = match kind {
        Kind::Vit => ("layernorm_before", "layernorm_after", "layers"),
        Kind::Dinov2 => ("norm1", "norm2", "encoder.layer"),
    };
    push(&mut body, layernorm(norm1));
    let mut prev = push(
        &mut body,
        layer_spec! {
            heads: Some(heads),
            bias: (!qkv_bias).then_some(false),
            out_bias: (!qkv_bias).then_some(true),
            dropout: (attn_p > 0.0).then_some(attn_p),
            note: Some("q_proj, k_proj, v_proj and o_proj".into()),
            ..layer(K::Attention, "attention")
        },
    );
    if kind == Kind::Dinov2 {
        prev = push(&mut body, layer_scale("layer_scale1", hidden_dim));
    } else {
        prev = push_dropout(&mut body, "attention.dropout", hidden_p, prev);
    }
    let attn_res = push(&mut body, add("attention.residual", "input", &prev));
    push(&mut body, layernorm(norm2));
    let mut prev = if kind == Kind::Dinov2 && c.use_swiglu_ffn.unwrap_or(false) {
        // Dinov2SwiGLUFFN: `int(hidden · mlp_ratio)` rounded to 2/3 and up to a multiple of 8.
        // `mlp` < 2^53: the products below fit.
        let f = (mlp * 2 / 3).div_ceil(8) * 8;
        if f == 0 {
            return Err(cfg.field_err(
                "mlp_ratio",
                format!("`mlp_ratio`: {mlp} MLP features leave the SwiGLU FFN none"),
            ));
        }
        let x = "norm2";
        let gate = push(&mut body, linear("mlp.gate_proj", f, true));
        let act = push(
            &mut body,
            super::layers::with_inputs(layer(K::Silu, "mlp.act_fn"), &[&gate]),
        );
        let up = push(
            &mut body,
            super::layers::with_inputs(linear("mlp.up_proj", f, true), &[x]),
        );
        push(
            &mut body,
            super::layers::with_inputs(layer(K::Mul, "mlp.gate_up"), &[&act, &up]),
        );
        push(&mut body, linear("mlp.down_proj", hidden, true))
    } else {
        let inter = match kind {
            Kind::Vit => c.intermediate_size.unwrap_or(3072),
            Kind::Dinov2 => mlp,
        };
        push(&mut body, linear("mlp.fc1", inter, true));
        push(
            &mut body,
            activation(cfg, "hidden_act", act_name, "mlp.activation_fn")?,
        );
        push(&mut body, linear("mlp.fc2", hidden, true))
    };
    if kind == Kind::Dinov2 {
        prev = push(&mut body, layer_scale("layer_scale2", hidden_dim));
    } else {
        prev = push_dropout(&mut body, "dropout", hidden_p, prev);
    }
    push(&mut body, add("residual", &attn_res, &prev));
    push(
        &mut out,
        repeat(&p(layers_path), "num_hidden_layers", n_layers, body),
    );
    let prev = push(&mut out, layernorm(&p("layernorm")));

    match head {
        Resolved::Bare => {
            if kind == Kind::Vit {
                // ViTModel's pooler (`add_pooling_layer=True`): the first token, dense, tanh.
                push(
                    &mut out,
                    layer_spec! {
                        dim: Some(1),
                        index: Some(0),
                        ..layer(K::Select, "pooler.first_token")
                    },
                );
                push(
                    &mut out,
                    linear("pooler.dense", c.pooler_output_size.unwrap_or(hidden), true),
                );
                let act = c.pooler_act.as_deref().unwrap_or("tanh");
                push(
                    &mut out,
                    activation(cfg, "pooler_act", act, "pooler.activation")?,
                );
            }
            let _ = prev;
        }
        Resolved::Classification if kind == Kind::Vit => {
            push(
                &mut out,
                layer_spec! {
                    dim: Some(1),
                    index: Some(0),
                    ..layer(K::Select, "pooled_output")
                },
            );
            push(&mut out, linear("classifier", cfg.num_labels()?, true));
            push(&mut out, cross_entropy(false, false));
        }
        Resolved::Classification | Resolved::Lm => {
            return Err(cfg.err(format!(
                "{} is supported as the bare {} (pick --head none)",
                cfg.model_type,
                match kind {
                    Kind::Vit => "ViTModel or ViTForImageClassification",
                    Kind::Dinov2 => "Dinov2Model",
                }
            )));
        }
    }
    Ok((
        out,
        Image {
            channels,
            height,
            width,
        },
    ))
}

/// DINOv2's `Dinov2LayerScale`: `hidden_state * lambda1`, a `[hidden]` parameter.
fn layer_scale(name: &str, hidden: i64) -> LayerSpec {
    layer_spec! {
        shape: Some(vec![hidden]),
        combine: Some(CombineKind::Mul),
        ..layer(K::Parameter, &format!("{name}.lambda1"))
    }
}
