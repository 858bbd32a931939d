//! The towers of CLIP (`models/clip/modeling_clip.py`) and SigLIP
//! (`models/siglip/modeling_siglip.py`): `CLIPVisionModel`, `CLIPTextModel`, `SiglipVisionModel`,
//! `SiglipTextModel`, from a tower's own config (`clip_vision_model`, `siglip_text_model`, …) or
//! from the `vision_config` / `text_config` of a two-tower `clip` or `siglip` config.
//!
//! Each tower is a pre-norm encoder (`layer_norm1`, `self_attn`, residual, `layer_norm2`, `mlp`,
//! residual). The step's loss is measure.py's `out[0].sum()`: the tower's `last_hidden_state`;
//! the pooled branch (CLIP's `post_layernorm` of the CLS token, SigLIP's text `head`) still runs
//! and keeps what it saves, so it is traced as a side branch.

use serde_json::Value;

use super::Resolved;
use super::config::{Cfg, ClipTowerConfig, prob};
use super::layers::{
    activation, add, embedding, layer, layernorm, linear, push, repeat, with_inputs,
};
use crate::error::Error;
use crate::spec::{CombineKind, LayerKind as K, LayerSpec, Sizes};

/// Which model's towers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Clip,
    Siglip,
}

/// Which tower.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tower {
    Vision,
    Text,
}

/// What a tower reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Reads {
    /// `pixel_values` `[channels, size, size]`.
    Image { channels: u64, size: u64 },
    /// `input_ids` `[seq]`, at most this many positions.
    Tokens(u64),
}

/// The tower `tower` of a `clip`/`siglip` family config: `model_type` `clip` (or `siglip`)
/// reads the nested `vision_config`/`text_config`, the single-tower types read the top level.
pub(super) fn tower_of(model_type: &str, arch: Option<&str>) -> Option<(Kind, Tower, bool)> {
    let kind = if model_type.starts_with("siglip") {
        Kind::Siglip
    } else {
        Kind::Clip
    };
    match model_type {
        "clip_vision_model" | "siglip_vision_model" => Some((kind, Tower::Vision, false)),
        "clip_text_model" | "siglip_text_model" => Some((kind, Tower::Text, false)),
        "clip" | "siglip" => match arch {
            Some(a) if a.ends_with("VisionModel") => Some((kind, Tower::Vision, true)),
            Some(a) if a.ends_with("TextModel") => Some((kind, Tower::Text, true)),
            _ => None,
        },
        _ => None,
    }
}

/// Builds one tower; returns the layers and what the tower reads.
#[allow(clippy::too_many_lines)] // embeddings, the layer, the pooled branch, in forward order
pub(super) fn tower(
    cfg: &Cfg,
    head: Resolved,
    kind: Kind,
    tower: Tower,
    nested: bool,
) -> Result<(Vec<LayerSpec>, Reads), Error> {
    if head != Resolved::Bare {
        return Err(cfg.err(format!(
            "{} is supported as one bare tower ({}VisionModel or {}TextModel; pick --head none)",
            cfg.model_type,
            name(kind),
            name(kind)
        )));
    }
    let key = match tower {
        Tower::Vision => "vision_config",
        Tower::Text => "text_config",
    };
    let c: ClipTowerConfig = if nested {
        let whole: Value = serde_json::from_str(cfg.text)
            .map_err(|e| cfg.err(format!("not a JSON object: {e}")))?;
        let sub = whole.get(key).cloned().unwrap_or(Value::Null);
        let sub = if sub.is_null() {
            "{}".to_string()
        } else {
            sub.to_string()
        };
        super::config::read(&sub, Some(cfg.model_type)).map_err(|e| match e {
            Error::Hf(mut h) => {
                h.field = Some(format!("{key}.{}", h.field.unwrap_or_default()));
                h.position = None;
                Error::Hf(h)
            }
            other => other,
        })?
    } else {
        cfg.read()?
    };
    // CLIPVisionConfig / CLIPTextConfig / SiglipVisionConfig / SiglipTextConfig defaults.
    let (hidden, inter, heads, act) = match (kind, tower) {
        (Kind::Clip, Tower::Vision) => (768, 3072, 12, "quick_gelu"),
        (Kind::Clip, Tower::Text) => (512, 2048, 8, "quick_gelu"),
        (Kind::Siglip, _) => (768, 3072, 12, "gelu_pytorch_tanh"),
    };
    let hidden = cfg.required("hidden_size", Some(c.hidden_size.unwrap_or(hidden)))?;
    let inter = cfg.required(
        "intermediate_size",
        Some(c.intermediate_size.unwrap_or(inter)),
    )?;
    let heads = cfg.required(
        "num_attention_heads",
        Some(c.num_attention_heads.unwrap_or(heads)),
    )?;
    let n_layers = cfg.layers("num_hidden_layers", Some(c.num_hidden_layers.unwrap_or(12)))?;
    let act = c.hidden_act.clone().unwrap_or_else(|| act.to_string());
    let attn_p = prob!(cfg, c.attention_dropout, 0.0)?;
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
    // The image tower's token count (patches, and CLIP's class token), checked once.
    let mut image_tokens = 0i64;

    let mut out = Vec::new();
    let reads = match tower {
        Tower::Vision => {
            let channels = cfg.required("num_channels", Some(c.num_channels.unwrap_or(3)))?;
            let (image, patch) = match kind {
                Kind::Clip => (224, 32),
                Kind::Siglip => (224, 16),
            };
            let image = cfg.required("image_size", Some(c.image_size.unwrap_or(image)))?;
            let patch = cfg.required("patch_size", Some(c.patch_size.unwrap_or(patch)))?;
            if image < patch {
                return Err(cfg.field_err(
                    "patch_size",
                    format!("`patch_size` ({patch}) is larger than `image_size` ({image})"),
                ));
            }
            let side = image / patch;
            let patches = side
                .checked_mul(side)
                .ok_or_else(|| cfg.err("the patch count overflows".into()))?;
            let positions = patches
                .checked_add(u64::from(kind == Kind::Clip))
                .ok_or_else(|| cfg.err("the patch count overflows".into()))?;
            image_tokens = dim("image_size", positions)?;
            // CLIP's patch convolution has no bias; SigLIP's has one.
            push(
                &mut out,
                LayerSpec {
                    out_channels: Some(hidden),
                    kernel: Some(Sizes(vec![patch])),
                    stride: Some(Sizes(vec![patch])),
                    bias: (kind == Kind::Clip).then_some(false),
                    ..layer(K::Conv2d, "embeddings.patch_embedding")
                },
            );
            push(
                &mut out,
                LayerSpec {
                    start_dim: Some(2),
                    ..layer(K::Flatten, "embeddings.flatten")
                },
            );
            push(
                &mut out,
                LayerSpec {
                    dims: Some(vec![1, 2]),
                    ..layer(K::Transpose, "embeddings.transpose")
                },
            );
            if kind == Kind::Clip {
                // `class_embedding` `[hidden]`, expanded to `[batch, 1, hidden]` and
                // concatenated in front.
                push(
                    &mut out,
                    LayerSpec {
                        shape: Some(vec![1, 1, hidden_dim]),
                        combine: Some(CombineKind::Concat),
                        dim: Some(1),
                        ..layer(K::Parameter, "embeddings.class_embedding")
                    },
                );
            }
            // `position_embedding(position_ids)`: an `nn.Embedding` over the registered
            // `[1, positions]` ids, added.
            push(
                &mut out,
                LayerSpec {
                    num_positions: Some(positions),
                    ids_buffer: Some(positions),
                    ..layer(K::PositionEmbedding, "embeddings.position_embedding")
                },
            );
            if kind == Kind::Clip {
                push(&mut out, layernorm("pre_layrnorm"));
            }
            Reads::Image {
                channels,
                size: image,
            }
        }
        Tower::Text => {
            let vocab = cfg.required(
                "vocab_size",
                Some(c.vocab_size.unwrap_or(match kind {
                    Kind::Clip => 49408,
                    Kind::Siglip => 32000,
                })),
            )?;
            let positions = cfg.required(
                "max_position_embeddings",
                Some(c.max_position_embeddings.unwrap_or(match kind {
                    Kind::Clip => 77,
                    Kind::Siglip => 64,
                })),
            )?;
            push(
                &mut out,
                embedding("embeddings.token_embedding", vocab, hidden),
            );
            push(
                &mut out,
                LayerSpec {
                    num_positions: Some(positions),
                    ids_buffer: Some(positions),
                    ..layer(K::PositionEmbedding, "embeddings.position_embedding")
                },
            );
            Reads::Tokens(positions)
        }
    };

    let mut body = Vec::new();
    push(&mut body, layernorm("layer_norm1"));
    // CLIP's text tower is causal (`create_causal_mask`, no cache); the others attend both ways.
    let causal = kind == Kind::Clip && tower == Tower::Text;
    let attn = push(
        &mut body,
        LayerSpec {
            heads: Some(heads),
            causal: causal.then_some(true),
            kv_cache: causal.then_some(false),
            dropout: (attn_p > 0.0).then_some(attn_p),
            note: Some("q_proj, k_proj, v_proj and out_proj".into()),
            ..layer(K::Attention, "self_attn")
        },
    );
    let res = push(&mut body, add("residual1", "input", &attn));
    push(&mut body, layernorm("layer_norm2"));
    let fc1 = push(&mut body, linear("mlp.fc1", inter, true));
    if act == "quick_gelu" {
        // QuickGELUActivation: `input * torch.sigmoid(1.702 * input)`.
        push(
            &mut body,
            LayerSpec {
                factor: Some(1.702),
                ..layer(K::Scale, "mlp.activation_fn.scale")
            },
        );
        let sig = push(&mut body, layer(K::Sigmoid, "mlp.activation_fn.sigmoid"));
        push(
            &mut body,
            with_inputs(layer(K::Mul, "mlp.activation_fn"), &[&fc1, &sig]),
        );
    } else {
        push(
            &mut body,
            activation(cfg, "hidden_act", &act, "mlp.activation_fn")?,
        );
    }
    let mlp = push(&mut body, linear("mlp.fc2", hidden, true));
    push(&mut body, add("residual2", &res, &mlp));
    let encoder = push(
        &mut out,
        repeat("encoder.layers", "num_hidden_layers", n_layers, body),
    );

    let last = match (kind, tower) {
        (Kind::Clip, Tower::Vision) => {
            // `post_layernorm(last_hidden_state[:, 0, :])`: the pooled output, beside the
            // returned `last_hidden_state`.
            push(
                &mut out,
                LayerSpec {
                    dim: Some(1),
                    index: Some(0),
                    ..layer(K::Select, "pooled.first_token")
                },
            );
            push(&mut out, layernorm("post_layernorm"));
            encoder
        }
        (Kind::Siglip, Tower::Vision) => {
            if c.vision_use_head.unwrap_or(true) {
                return Err(cfg.field_err(
                    "vision_use_head",
                    "SigLIP's attention-pooling head (`vision_use_head`, default true) is not supported yet; set it to false for the tower without its head".into(),
                ));
            }
            push(&mut out, layernorm("post_layernorm"))
        }
        (_, Tower::Text) => {
            let last = push(&mut out, layernorm("final_layer_norm"));
            // The pooled token: CLIP gathers the EOS position (`argmax` of the ids, an index
            // that keeps two `[batch]` int64 index tensors, not counted), SigLIP takes the last
            // one; SigLIP projects it with `head`.
            push(
                &mut out,
                LayerSpec {
                    dim: Some(1),
                    index: Some(-1),
                    ..layer(K::Select, "pooled.token")
                },
            );
            if kind == Kind::Siglip {
                let proj = c.projection_size.unwrap_or(hidden);
                push(&mut out, linear("head", proj, true));
            }
            last
        }
    };
    // The step backpropagates `last_hidden_state.sum()`: a view of it ends the description.
    let dims = match reads {
        Reads::Image { .. } => vec![image_tokens, hidden_dim],
        Reads::Tokens(_) => vec![-1, hidden_dim],
    };
    push(
        &mut out,
        LayerSpec {
            inputs: Some(vec![last]),
            shape: Some(dims),
            ..layer(K::Reshape, "last_hidden_state")
        },
    );
    Ok((out, reads))
}

fn name(kind: Kind) -> &'static str {
    match kind {
        Kind::Clip => "CLIP",
        Kind::Siglip => "Siglip",
    }
}
