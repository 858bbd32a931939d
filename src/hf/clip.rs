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
    activation, add, embedding, layer, layernorm, linear, push, quick_gelu, repeat,
};
use crate::error::Error;
use crate::spec::{CombineKind, LayerKind as K, LayerSpec, Sizes, layer_spec};

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

/// Where a vision tower sits inside a multimodal model (LLaVA's `vision_tower`).
pub(super) struct Within<'a> {
    /// The module path in front of the tower's own names (`model.vision_tower.vision_model.`).
    pub prefix: &'a str,
    /// The named model input the patch embedding reads (`pixel_values`).
    pub input: &'a str,
    /// `vision_feature_layer`: the index into `hidden_states` (the embeddings' output, then each
    /// layer's; negative counts from the end) that the model goes on with.
    pub feature_layer: i64,
}

/// What [`tower`] builds.
pub(super) struct Built {
    /// The layers, in forward order.
    pub layers: Vec<LayerSpec>,
    /// What the tower reads.
    pub reads: Reads,
    /// Within a multimodal model: the layer whose output is `hidden_states[feature_layer]`,
    /// `[batch, tokens, hidden]`, and `hidden_size`.
    pub feature: Option<(String, u64)>,
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
    let b = build(cfg, head, kind, tower, nested, None)?;
    Ok((b.layers, b.reads))
}

/// Builds one tower, alone or (`within`) as a multimodal model's vision tower: there its names
/// carry the prefix, the patch embedding reads the named input, the encoder layers split where
/// the selected hidden state is taken, and no `last_hidden_state` view ends it (the model's
/// loss does not read it).
#[allow(clippy::too_many_lines)] // embeddings, the layer, the pooled branch, in forward order
pub(super) fn build(
    cfg: &Cfg,
    head: Resolved,
    kind: Kind,
    tower: Tower,
    nested: bool,
    within: Option<&Within<'_>>,
) -> Result<Built, Error> {
    let pre = |s: &str| match within {
        Some(w) => format!("{}{s}", w.prefix),
        None => s.to_string(),
    };
    if head != Resolved::Bare && within.is_none() {
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
                layer_spec! {
                    inputs: within.map(|w| vec![w.input.to_string()]),
                    out_channels: Some(hidden),
                    kernel: Some(Sizes(vec![patch])),
                    stride: Some(Sizes(vec![patch])),
                    bias: (kind == Kind::Clip).then_some(false),
                    ..layer(K::Conv2d, &pre("embeddings.patch_embedding"))
                },
            );
            push(
                &mut out,
                layer_spec! {
                    start_dim: Some(2),
                    ..layer(K::Flatten, &pre("embeddings.flatten"))
                },
            );
            push(
                &mut out,
                layer_spec! {
                    dims: Some(vec![1, 2]),
                    ..layer(K::Transpose, &pre("embeddings.transpose"))
                },
            );
            if kind == Kind::Clip {
                // `class_embedding` `[hidden]`, expanded to `[batch, 1, hidden]` and
                // concatenated in front.
                push(
                    &mut out,
                    layer_spec! {
                        shape: Some(vec![1, 1, hidden_dim]),
                        combine: Some(CombineKind::Concat),
                        dim: Some(1),
                        ..layer(K::Parameter, &pre("embeddings.class_embedding"))
                    },
                );
            }
            // `position_embedding(position_ids)`: an `nn.Embedding` over the registered
            // `[1, positions]` ids, added.
            push(
                &mut out,
                layer_spec! {
                    num_positions: Some(positions),
                    ids_buffer: Some(positions),
                    ..layer(K::PositionEmbedding, &pre("embeddings.position_embedding"))
                },
            );
            if kind == Kind::Clip {
                push(&mut out, layernorm(&pre("pre_layrnorm")));
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
                layer_spec! {
                    num_positions: Some(positions),
                    ids_buffer: Some(positions),
                    ..layer(K::PositionEmbedding, &pre("embeddings.position_embedding"))
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
        layer_spec! {
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
        quick_gelu(&mut body, "mlp.activation_fn", &fc1);
    } else {
        push(
            &mut body,
            activation(cfg, "hidden_act", &act, "mlp.activation_fn")?,
        );
    }
    let mlp = push(&mut body, linear("mlp.fc2", hidden, true));
    push(&mut body, add("residual2", &res, &mlp));
    // Within a multimodal model the encoder splits after the selected hidden state's layer
    // (`hidden_states[k]` is the output of the first `k` layers, `hidden_states[0]` the
    // embeddings'); every layer still runs.
    let mut feature = None;
    let encoder = match within {
        None => push(
            &mut out,
            repeat("encoder.layers", "num_hidden_layers", n_layers, body),
        ),
        Some(w) => {
            let states =
                i64::try_from(n_layers).map_err(|_| cfg.err("too many layers".into()))? + 1;
            let k = if w.feature_layer < 0 {
                states + w.feature_layer
            } else {
                w.feature_layer
            };
            if !(0..states).contains(&k) {
                return Err(cfg.field_err(
                    "vision_feature_layer",
                    format!(
                        "`vision_feature_layer` = {} selects no hidden state of a {n_layers}-layer vision tower (it has {states}: -{states} to {})",
                        w.feature_layer,
                        states - 1
                    ),
                ));
            }
            let k = u64::try_from(k).expect("checked to be in 0..states");
            let mut last = out.last().and_then(|l| l.name.clone()).unwrap_or_default();
            if k == 0 {
                feature = Some((last.clone(), hidden));
            }
            for (first, count) in [(0, k), (k, n_layers - k)] {
                if count == 0 {
                    continue;
                }
                let name = super::layers::run_name(
                    &pre("encoder.layers"),
                    usize::from(k > 0 && k < n_layers) + 1,
                    usize::try_from(first).unwrap_or(usize::MAX),
                    count,
                );
                last = push(
                    &mut out,
                    repeat(&name, "num_hidden_layers", count, body.clone()),
                );
                if first + count == k {
                    feature = Some((last.clone(), hidden));
                }
            }
            last
        }
    };

    let last = match (kind, tower) {
        (Kind::Clip, Tower::Vision) => {
            // `post_layernorm(last_hidden_state[:, 0, :])`: the pooled output, beside the
            // returned `last_hidden_state`.
            push(
                &mut out,
                layer_spec! {
                    dim: Some(1),
                    index: Some(0),
                    ..layer(K::Select, &pre("pooled.first_token"))
                },
            );
            push(&mut out, layernorm(&pre("post_layernorm")));
            encoder
        }
        (Kind::Siglip, Tower::Vision) => {
            if c.vision_use_head.unwrap_or(true) {
                return Err(cfg.field_err(
                    "vision_use_head",
                    "SigLIP's attention-pooling head (`vision_use_head`, default true) is not supported yet; set it to false for the tower without its head".into(),
                ));
            }
            push(&mut out, layernorm(&pre("post_layernorm")))
        }
        (_, Tower::Text) => {
            let last = push(&mut out, layernorm("final_layer_norm"));
            // The pooled token: CLIP gathers the EOS position (`argmax` of the ids, an index
            // that keeps two `[batch]` int64 index tensors, not counted), SigLIP takes the last
            // one; SigLIP projects it with `head`.
            push(
                &mut out,
                layer_spec! {
                    dim: Some(1),
                    index: Some(-1),
                    ..layer(K::Select, &pre("pooled.token"))
                },
            );
            if kind == Kind::Siglip {
                let proj = c.projection_size.unwrap_or(hidden);
                push(&mut out, linear("head", proj, true));
            }
            last
        }
    };
    if within.is_some() {
        let _ = last;
        return Ok(Built {
            layers: out,
            reads,
            feature,
        });
    }
    // The step backpropagates `last_hidden_state.sum()`: a view of it ends the description.
    let dims = match reads {
        Reads::Image { .. } => vec![image_tokens, hidden_dim],
        Reads::Tokens(_) => vec![-1, hidden_dim],
    };
    push(
        &mut out,
        layer_spec! {
            inputs: Some(vec![last]),
            shape: Some(dims),
            ..layer(K::Reshape, &pre("last_hidden_state"))
        },
    );
    Ok(Built {
        layers: out,
        reads,
        feature: None,
    })
}

fn name(kind: Kind) -> &'static str {
    match kind {
        Kind::Clip => "CLIP",
        Kind::Siglip => "Siglip",
    }
}
