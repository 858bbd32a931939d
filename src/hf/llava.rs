//! LLaVA (`LlavaForConditionalGeneration`, `LlavaModel`; `models/llava/modeling_llava.py`): a
//! CLIP vision tower, the multi-modal projector and a decoder language model.
//!
//! `LlavaModel.forward` embeds the token ids first (`language_model.embed_tokens`), then
//! `get_image_features` runs the whole vision tower (every layer, and CLIP's pooled
//! `post_layernorm` branch) and takes `hidden_states[vision_feature_layer]` (default -2: the
//! input of the last layer), drops the CLS token under `vision_feature_select_strategy`
//! `"default"` (`[:, 1:]`, a view), and projects it (`linear_1`, `projector_hidden_act`,
//! `linear_2`); `torch.cat` of the per-image features is a copy, and `masked_scatter` writes them
//! over the image-token positions of the embeddings. The language model (`AutoModel` of
//! `text_config`, any [`super::DECODERS`] row) runs on the result, `lm_head` and the causal-LM
//! loss after it.
//!
//! One image per sample, of the vision config's `image_size` (transformers' CLIP refuses another
//! size without `interpolate_pos_encoding`): `(image_size / patch_size)²` image tokens (one more
//! under `"full"`), which `--seq` counts with the text tokens.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::clip::{self, Within};
use super::config::{Cfg, Header};
use super::layers::{activation, layer, linear, push, with_inputs};
use super::{ImageSize, Resolved};
use crate::error::Error;
use crate::spec::{DimSpec, InputSpec, LayerKind as K, LayerSpec, layer_spec};

/// The keys of `LlavaConfig` this builder reads.
#[derive(Debug, Default, Deserialize)]
struct LlavaConfig {
    vision_config: Option<Value>,
    text_config: Option<Value>,
    vision_feature_layer: Option<Value>,
    vision_feature_select_strategy: Option<String>,
    projector_hidden_act: Option<String>,
    multimodal_projector_bias: Option<bool>,
    tie_word_embeddings: Option<bool>,
}

/// What a multimodal builder returns.
pub(super) struct Multimodal {
    /// The layers, in forward order.
    pub layers: Vec<LayerSpec>,
    /// The language model's context length (`max_position_embeddings`).
    pub max_positions: u64,
    /// The named pixel input.
    pub pixels: (String, InputSpec),
}

/// `LlavaConfig`'s `vision_config` when the config has none (`sub_configs_defaults`).
const DEFAULT_VISION: &str = r#"{"model_type": "clip_vision_model", "intermediate_size": 4096, "hidden_size": 1024, "patch_size": 14, "image_size": 336, "num_hidden_layers": 24, "num_attention_heads": 16, "vocab_size": 32000, "projection_dim": 768}"#;

/// `LlamaConfig`'s defaults of the sizes the decoder builder requires, for a `text_config` of
/// `model_type` `llama` that leaves them out (llava-1.5's gives only its vocabulary and context).
const LLAMA_SIZES: [(&str, u64); 5] = [
    ("vocab_size", 32000),
    ("hidden_size", 4096),
    ("intermediate_size", 11008),
    ("num_hidden_layers", 32),
    ("num_attention_heads", 32),
];

/// Builds LLaVA.
#[allow(clippy::too_many_lines)] // tower, projector, merge and language model, in forward order
pub(super) fn llava(
    cfg: &Cfg,
    head: Resolved,
    image: Option<ImageSize>,
) -> Result<Multimodal, Error> {
    if head == Resolved::Classification {
        return Err(cfg.err(
            "llava is supported as LlavaForConditionalGeneration and the bare LlavaModel (pick --head lm or none)".into(),
        ));
    }
    let c: LlavaConfig = cfg.read()?;
    let object = |key: &str,
                  v: Option<Value>,
                  default: &str|
     -> Result<Map<String, Value>, Error> {
        match v {
            None | Some(Value::Null) => Ok(serde_json::from_str(default).expect("a JSON object")),
            Some(Value::Object(m)) => Ok(m),
            Some(other) => Err(cfg.field_err(
                key,
                format!("`{key}` must be an object (a sub-config), got {other}"),
            )),
        }
    };
    let vision = object("vision_config", c.vision_config, DEFAULT_VISION)?;
    let mut text = object("text_config", c.text_config, r#"{"model_type": "llama"}"#)?;

    // The vision tower: CLIP's (`clip_vision_model`).
    let vision_type = vision
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("clip_vision_model");
    if vision_type != "clip_vision_model" {
        return Err(cfg.field_err(
            "vision_config.model_type",
            format!("a `{vision_type}` vision tower is not supported yet for llava (supported: clip_vision_model)"),
        ));
    }
    let feature_layer = match c.vision_feature_layer {
        None | Some(Value::Null) => -2,
        Some(Value::Number(n)) if n.as_i64().is_some() => n.as_i64().unwrap_or(-2),
        Some(Value::Array(_)) => {
            return Err(cfg.field_err(
                "vision_feature_layer",
                "several `vision_feature_layer`s (their hidden states concatenated) are not supported yet; give one index".into(),
            ));
        }
        Some(other) => {
            return Err(cfg.field_err(
                "vision_feature_layer",
                format!("`vision_feature_layer` must be a whole number, got {other}"),
            ));
        }
    };
    let drop_cls = match c.vision_feature_select_strategy.as_deref() {
        None | Some("default") => true,
        Some("full") => false,
        Some(other) => {
            return Err(cfg.field_err(
                "vision_feature_select_strategy",
                format!(
                    "`vision_feature_select_strategy` is \"default\" or \"full\", got \"{other}\""
                ),
            ));
        }
    };
    // The tower reads `vision_config` as a nested CLIP vision config.
    let mut whole: Map<String, Value> = Map::new();
    whole.insert("vision_config".into(), Value::Object(vision));
    let vision_text = Value::Object(whole).to_string();
    let vision_cfg = Cfg {
        text: &vision_text,
        model_type: cfg.model_type,
        header: Header::default(),
    };
    let prefix = if head == Resolved::Bare {
        "vision_tower.vision_model."
    } else {
        "model.vision_tower.vision_model."
    };
    let built = clip::build(
        &vision_cfg,
        Resolved::Bare,
        clip::Kind::Clip,
        clip::Tower::Vision,
        true,
        Some(&Within {
            prefix,
            input: "pixel_values",
            feature_layer,
        }),
    )?;
    let clip::Reads::Image { channels, size } = built.reads else {
        unreachable!("a vision tower reads pixels")
    };
    if let Some(asked) = image
        && (asked.height, asked.width) != (size, size)
    {
        return Err(super::image_error(format!(
            "--image {asked}: llava's CLIP vision tower reads {size}x{size} pixels (vision_config.image_size); transformers refuses another size without interpolate_pos_encoding"
        )));
    }
    let (feature, vision_hidden) = built
        .feature
        .expect("a tower within a model names its feature");
    let mut vision_layers = built.layers;

    // The language model: a decoder family's row, from `text_config`.
    let text_type = text
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("llama")
        .to_string();
    let Some(row) = super::DECODERS.iter().find(|d| d.model_type == text_type) else {
        return Err(cfg.field_err(
            "text_config.model_type",
            format!(
                "a `{text_type}` language model is not supported for llava (supported: {})",
                super::DECODERS
                    .iter()
                    .map(|d| d.model_type)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    };
    if text_type == "llama" {
        for (key, v) in LLAMA_SIZES {
            text.entry(key).or_insert(Value::from(v));
        }
    }
    // LlavaConfig ties the head when it or its text config says so (`__post_init__`).
    let text_tie = text
        .get("tie_word_embeddings")
        .and_then(Value::as_bool)
        .unwrap_or(row.tie);
    let tie = c.tie_word_embeddings.unwrap_or(false) || text_tie;
    text.insert("tie_word_embeddings".into(), Value::Bool(tie));
    let text_hidden = text.get("hidden_size").and_then(Value::as_u64);
    let text_json = Value::Object(text).to_string();
    let text_cfg = Cfg {
        text: &text_json,
        model_type: &text_type,
        header: super::config::read(&text_json, Some(&text_type))
            .map_err(|e| nested(e, "text_config"))?,
    };
    let base = if head == Resolved::Bare {
        "language_model"
    } else {
        "model.language_model"
    };
    let (lm, max_positions) = super::decoder::decoder_at(&text_cfg, row, head, base)
        .map_err(|e| nested(e, "text_config"))?;
    let text_hidden = cfg.required("text_config.hidden_size", text_hidden)?;

    // `hidden_states[k][:, 1:]`, projected.
    let side = size / built_patch(&vision_layers);
    let patches = side * side;
    if drop_cls {
        push(
            &mut vision_layers,
            with_inputs(
                layer_spec! {
                    dim: Some(1),
                    start: Some(1),
                    length: Some(patches),
                    ..layer(K::Narrow, &format!("{prefix}selected_image_feature"))
                },
                &[&feature],
            ),
        );
    }
    let _ = vision_hidden;
    let proj = if head == Resolved::Bare {
        "multi_modal_projector"
    } else {
        "model.multi_modal_projector"
    };
    let bias = c.multimodal_projector_bias.unwrap_or(true);
    let mut l1 = linear(&format!("{proj}.linear_1"), text_hidden, bias);
    if !drop_cls {
        l1.inputs = Some(vec![feature]);
    }
    push(&mut vision_layers, l1);
    let act = c.projector_hidden_act.as_deref().unwrap_or("gelu");
    push(
        &mut vision_layers,
        activation(cfg, "projector_hidden_act", act, &format!("{proj}.act"))?,
    );
    let features = push(
        &mut vision_layers,
        linear(&format!("{proj}.linear_2"), text_hidden, bias),
    );

    let layers = splice(cfg, &text_type, lm, vision_layers, &features)?;
    Ok(Multimodal {
        layers,
        max_positions,
        pixels: (
            "pixel_values".into(),
            InputSpec {
                shape: vec![
                    DimSpec::Fixed(channels),
                    DimSpec::Fixed(size),
                    DimSpec::Fixed(size),
                ],
                dtype: None,
            },
        ),
    })
}

/// The language model's layers `lm` with the image path `vision` and the merge put between its
/// token embedding and its rotary embedding (`LlavaModel.forward`, `Qwen2VLModel.forward`: the
/// ids are embedded first, then the image is encoded, then `masked_scatter` writes the image
/// features `features` into the embeddings, then the language model runs).
pub(super) fn splice(
    cfg: &Cfg,
    text_type: &str,
    mut lm: Vec<LayerSpec>,
    vision: Vec<LayerSpec>,
    features: &str,
) -> Result<Vec<LayerSpec>, Error> {
    let Some(at) = lm
        .iter()
        .position(|l| l.kind == K::Rotary)
        .filter(|&at| at > 0)
    else {
        return Err(cfg.field_err(
            "text_config.model_type",
            format!(
                "a `{text_type}` language model without a rotary embedding is not supported for {}",
                cfg.model_type
            ),
        ));
    };
    let embeds = lm[at - 1].name.clone().expect("imported layers are named");
    let rest = lm.split_off(at);
    let mut layers = lm;
    layers.extend(vision);
    push(
        &mut layers,
        with_inputs(
            layer(K::MaskedScatter, "inputs_embeds.masked_scatter"),
            &["input", &embeds, features],
        ),
    );
    layers.extend(rest);
    Ok(layers)
}

/// The patch size of a tower's patch convolution (its kernel).
fn built_patch(layers: &[LayerSpec]) -> u64 {
    layers
        .iter()
        .find(|l| l.kind == K::Conv2d)
        .and_then(|l| l.kernel.as_ref())
        .and_then(|k| k.0.first().copied())
        .unwrap_or(1)
}

/// An error of a sub-config, its field path under `key`.
pub(super) fn nested(e: Error, key: &str) -> Error {
    match e {
        Error::Hf(mut h) => {
            h.field = Some(match h.field {
                Some(f) => format!("{key}.{f}"),
                None => key.to_string(),
            });
            h.position = None;
            h.message = format!("{key}: {}", h.message);
            Error::Hf(h)
        }
        other => other,
    }
}
