//! Hugging Face `config.json` import.
//!
//! A transformers configuration (detected by a top-level `model_type` or `architectures` key, see
//! [`is_hf_config`]) becomes the same [`ModelSpec`] a memest file describes ([`to_spec`]): the
//! layers of the transformers model, module by module and in the order its `forward` runs them,
//! with transformers 5's defaults for every key the file leaves out. Repeated decoder (or encoder)
//! layers become one `repeat` block of `num_hidden_layers` copies; layers that differ (Qwen-MoE's
//! dense layers, sliding-window layers) split it into consecutive blocks.
//!
//! The head follows `architectures` (`…ForCausalLM` → LM head and causal-LM loss,
//! `BertForMaskedLM` → MLM head, `…ForSequenceClassification` → classifier and cross-entropy,
//! `…Model` → the bare model); [`Head`] picks another.
//!
//! Layout: `DECODERS` (here) holds one row per Llama-style decoder family, what its
//! transformers config class and modeling file do differently, and `decoder.rs` builds any of
//! them from its row; `gpt2.rs`, `bert.rs` and `t5.rs` build the three other families;
//! `config.rs` reads the config's fields with serde; `layers.rs` has the layer constructors.

use serde::Deserialize;
use serde_json::Value;

use crate::dtype::DType;
use crate::error::{Error, HfError};
use crate::spec::{DefaultsSpec, DimSpec, InputSpec, LayerKind, LayerSpec, ModelSpec};
use crate::vocab::AttentionImpl;

mod bert;
mod clip;
mod config;
mod deberta;
mod decoder;
mod diffusers;
mod dit;
mod gpt2;
mod layers;
mod llava;
mod ln_decoder;
mod qwen2_vl;
mod t5;
mod vision;
mod whisper;

use config::{Cfg, Header};
use decoder::{
    Bias, DecoderFamily, GateUp, KvHeads, Moe, Norm, NormPlacement, QkNorm, Qkv, Sliding, SoftCaps,
};

/// The most layers a config may declare: far beyond any real model, and small enough that
/// building the description cannot exhaust memory.
const MAX_LAYERS: u64 = 100_000;

/// The default sequence length: the model's context, capped at this.
const DEFAULT_MAX_SEQ: u64 = 2048;

/// A row with Llama's choices; the rows below state only what differs.
const LLAMA: DecoderFamily = DecoderFamily {
    model_type: "llama",
    arch_prefix: "llama",
    kv_heads: KvHeads::SameAsHeads,
    head_dim: None,
    max_positions: 2048,
    tie: false,
    act: "silu",
    act_rename: None,
    bias: Bias::AllFromKey,
    mlp_bias: true,
    resid_dropout: false,
    norm: Norm::Llama,
    placement: NormPlacement::Pre,
    qkv: Qkv::Separate,
    gate_up: GateUp::Separate,
    qk_norm: QkNorm::None,
    embed_scale: false,
    rotary_concat: false,
    rotary_f32: false,
    sliding: Sliding::None,
    moe: Moe::None,
    multipliers: false,
    softcap: None,
    rotary_local: false,
    mla: false,
    rotary_upcast: false,
    logit_scale: None,
    sinks: false,
    rotary_halves: false,
};

/// The Llama-style decoder families, one row each: the defaults of the transformers config
/// class (`models/<family>/configuration_<family>.py`) and what its modeling file builds
/// differently from Llama's. [`decoder`] builds every row; [`SUPPORTED`](supported), the
/// `model_type` lookup and the architecture-prefix inference derive from this table.
const DECODERS: &[DecoderFamily] = &[
    LLAMA,
    DecoderFamily {
        model_type: "mistral",
        arch_prefix: "mistral",
        kv_heads: KvHeads::Fixed(8),
        max_positions: 4096 * 32,
        bias: Bias::None,
        mlp_bias: false,
        sliding: Sliding::Always,
        ..LLAMA
    },
    DecoderFamily {
        model_type: "mixtral",
        arch_prefix: "mixtral",
        kv_heads: KvHeads::Fixed(8),
        max_positions: 4096 * 32,
        bias: Bias::None,
        mlp_bias: false,
        sliding: Sliding::Always,
        moe: Moe::Mixtral,
        ..LLAMA
    },
    DecoderFamily {
        model_type: "qwen2",
        arch_prefix: "qwen2",
        kv_heads: KvHeads::Fixed(32),
        max_positions: 32768,
        bias: Bias::Qkv,
        mlp_bias: false,
        sliding: Sliding::Qwen2,
        ..LLAMA
    },
    DecoderFamily {
        model_type: "qwen2_moe",
        arch_prefix: "qwen2moe",
        kv_heads: KvHeads::Fixed(16),
        max_positions: 32768,
        bias: Bias::QkvFromKey,
        mlp_bias: false,
        sliding: Sliding::Qwen2Moe,
        moe: Moe::Qwen2,
        ..LLAMA
    },
    DecoderFamily {
        model_type: "qwen3",
        arch_prefix: "qwen3",
        kv_heads: KvHeads::Fixed(32),
        head_dim: Some(128),
        max_positions: 32768,
        mlp_bias: false,
        qk_norm: QkNorm::Head,
        sliding: Sliding::Qwen2,
        ..LLAMA
    },
    DecoderFamily {
        model_type: "granite",
        arch_prefix: "granite",
        mlp_bias: true,
        multipliers: true,
        ..LLAMA
    },
    DecoderFamily {
        model_type: "qwen3_moe",
        arch_prefix: "qwen3moe",
        kv_heads: KvHeads::Fixed(4),
        head_dim: Some(128),
        max_positions: 32768,
        mlp_bias: false,
        qk_norm: QkNorm::Head,
        sliding: Sliding::Qwen2,
        moe: Moe::Qwen3,
        ..LLAMA
    },
    DecoderFamily {
        model_type: "gemma",
        arch_prefix: "gemma",
        kv_heads: KvHeads::Fixed(16),
        head_dim: Some(256),
        max_positions: 8192,
        tie: true,
        act: "gelu_pytorch_tanh",
        // GemmaConfig turns the legacy "gelu" of the official releases into the tanh
        // approximation.
        act_rename: Some(("gelu", "gelu_pytorch_tanh")),
        mlp_bias: false,
        norm: Norm::Gemma,
        embed_scale: true,
        ..LLAMA
    },
    DecoderFamily {
        model_type: "gemma2",
        arch_prefix: "gemma2",
        kv_heads: KvHeads::Fixed(4),
        head_dim: Some(256),
        max_positions: 8192,
        tie: true,
        act: "gelu_pytorch_tanh",
        mlp_bias: false,
        norm: Norm::Gemma,
        placement: NormPlacement::Sandwich,
        embed_scale: true,
        sliding: Sliding::Gemma2,
        softcap: Some(SoftCaps {
            attn: Some(50.0),
            logits: Some(30.0),
        }),
        ..LLAMA
    },
    // Gemma3TextConfig / modeling_gemma3.py (Gemma3ForCausalLM): Gemma 2's layer with
    // GemmaRMSNorm q_norm/k_norm per head, no soft-capping by default, five sliding-window
    // layers to one global (`sliding_window_pattern`), one rotary table per layer type, and the
    // embedding scale a buffer.
    DecoderFamily {
        model_type: "gemma3_text",
        arch_prefix: "gemma3",
        kv_heads: KvHeads::Fixed(4),
        head_dim: Some(256),
        max_positions: 131_072,
        tie: true,
        act: "gelu_pytorch_tanh",
        mlp_bias: false,
        norm: Norm::Gemma,
        placement: NormPlacement::Sandwich,
        qk_norm: QkNorm::Head,
        embed_scale: true,
        sliding: Sliding::Gemma3,
        softcap: Some(SoftCaps {
            attn: None,
            logits: None,
        }),
        rotary_local: true,
        ..LLAMA
    },
    // DeepseekV2Config / modeling_deepseek_v2.py: multi-head latent attention, dense layers
    // before `first_k_dense_replace` (default 0), softmax-routed experts with shared ones.
    DecoderFamily {
        model_type: "deepseek_v2",
        arch_prefix: "deepseekv2",
        max_positions: 2048,
        mlp_bias: false,
        mla: true,
        moe: Moe::Deepseek { v3: false },
        ..LLAMA
    },
    // DeepseekV3Config / modeling_deepseek_v3.py: as V2, sigmoid group-limited routing with a
    // correction bias, the first three layers dense by default.
    DecoderFamily {
        model_type: "deepseek_v3",
        arch_prefix: "deepseekv3",
        max_positions: 4096,
        mlp_bias: false,
        mla: true,
        moe: Moe::Deepseek { v3: true },
        ..LLAMA
    },
    // CohereConfig / modeling_cohere.py (Command-R): one bias-free `CohereLayerNorm` feeding
    // attention and MLP in parallel, rotary with interleaved halves on float32 Q and K, tied
    // embeddings, the logits times `logit_scale`.
    DecoderFamily {
        model_type: "cohere",
        arch_prefix: "cohere",
        max_positions: 8192,
        tie: true,
        mlp_bias: false,
        norm: Norm::Cohere,
        placement: NormPlacement::Parallel,
        rotary_upcast: true,
        logit_scale: Some(0.0625),
        ..LLAMA
    },
    // GptOssConfig / modeling_gpt_oss.py (GptOssForCausalLM): biased Q/K/V/O projections, a
    // learned sink logit per head (eager attention: SDPA cannot take sinks), sliding windows
    // of 128 on every other layer, half-width rotary tables (YaRN only changes their values),
    // `GptOssRMSNorm` (the weight times the float32 normalized tensor, as OLMo-2's), and on
    // every layer the experts with biases behind a biased top-k-then-softmax router.
    DecoderFamily {
        model_type: "gpt_oss",
        arch_prefix: "gptoss",
        kv_heads: KvHeads::Fixed(8),
        head_dim: Some(64),
        max_positions: 131_072,
        bias: Bias::AllFromKeyOn,
        mlp_bias: false,
        norm: Norm::Olmo2,
        sliding: Sliding::GptOss,
        moe: Moe::GptOss,
        sinks: true,
        rotary_halves: true,
        ..LLAMA
    },
    DecoderFamily {
        model_type: "phi3",
        arch_prefix: "phi3",
        max_positions: 4096,
        bias: Bias::None,
        mlp_bias: false,
        resid_dropout: true,
        qkv: Qkv::Fused,
        gate_up: GateUp::FusedChunk,
        rotary_concat: true,
        sliding: Sliding::Always,
        ..LLAMA
    },
    DecoderFamily {
        model_type: "olmo",
        arch_prefix: "olmo",
        max_positions: 2048,
        mlp_bias: false,
        norm: Norm::OlmoLayer,
        rotary_f32: true,
        ..LLAMA
    },
    DecoderFamily {
        model_type: "olmo2",
        arch_prefix: "olmo2",
        mlp_bias: false,
        norm: Norm::Olmo2,
        placement: NormPlacement::Post,
        qk_norm: QkNorm::Projection,
        rotary_f32: true,
        ..LLAMA
    },
];

/// The families that are not built from [`DECODERS`]: `(model_type, architecture prefix)`.
const OTHERS: &[(&str, &str, Family)] = &[
    ("gpt2", "gpt2", Family::Gpt2),
    ("bert", "bert", Family::Bert),
    ("t5", "t5", Family::T5),
    ("mt5", "mt5", Family::T5),
    ("gpt_bigcode", "gptbigcode", Family::GptBigCode),
    ("gpt_neox", "gptneox", Family::GptNeox),
    ("phi", "phi", Family::Phi),
    ("falcon", "falcon", Family::Falcon),
    ("bloom", "bloom", Family::Bloom),
    ("stablelm", "stablelm", Family::StableLm),
    ("starcoder2", "starcoder2", Family::Starcoder2),
    ("roberta", "roberta", Family::Roberta),
    ("xlm-roberta", "xlmroberta", Family::Roberta),
    ("deberta-v2", "debertav2", Family::DebertaV2),
    ("vit", "vit", Family::Vision(vision::Kind::Vit)),
    ("dinov2", "dinov2", Family::Vision(vision::Kind::Dinov2)),
    ("clip", "clip", Family::Tower),
    ("clip_vision_model", "clipvision", Family::Tower),
    ("clip_text_model", "cliptext", Family::Tower),
    ("siglip", "siglip", Family::Tower),
    ("siglip_vision_model", "siglipvision", Family::Tower),
    ("siglip_text_model", "sigliptext", Family::Tower),
    ("llava", "llava", Family::Llava),
    ("qwen2_vl", "qwen2vl", Family::Qwen2Vl),
    ("qwen2_5_vl", "qwen2_5_vl", Family::Qwen2Vl),
    ("whisper", "whisper", Family::Whisper),
];

/// The `model_type`s memest can import, sorted.
#[must_use]
pub fn supported() -> Vec<&'static str> {
    let mut all: Vec<&str> = DECODERS
        .iter()
        .map(|d| d.model_type)
        .chain(OTHERS.iter().map(|o| o.0))
        .collect();
    all.sort_unstable();
    all
}

/// An image size in pixels (`--image`): `512` (square) or `HEIGHTxWIDTH` (`1024x768`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageSize {
    /// Height in pixels.
    pub height: u64,
    /// Width in pixels.
    pub width: u64,
}

impl std::str::FromStr for ImageSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let side = |t: &str| {
            t.trim()
                .parse::<u64>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("`{s}` is not an image size: give pixels as 512 or HEIGHTxWIDTH (1024x768), each at least 1"))
        };
        match s.split_once(['x', 'X']) {
            Some((h, w)) => Ok(ImageSize {
                height: side(h)?,
                width: side(w)?,
            }),
            None => {
                let n = side(s)?;
                Ok(ImageSize {
                    height: n,
                    width: n,
                })
            }
        }
    }
}

impl std::fmt::Display for ImageSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.height, self.width)
    }
}

/// The diffusers model classes memest imports (a config's `_class_name`), sorted.
#[must_use]
pub fn diffusers_classes() -> &'static [&'static str] {
    diffusers::CLASSES
}

/// Which head sits on the imported model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Head {
    /// The head the config's `architectures` names (the family's usual one when it names none).
    #[default]
    Auto,
    /// The bare model (`LlamaModel`, `BertModel` with its pooler, …), no loss: the training
    /// step backpropagates `out.sum()`.
    None,
    /// The language-model head and its loss: causal LM for decoders, masked LM for BERT,
    /// conditional generation for T5.
    Lm,
    /// Sequence classification (`num_labels`, default 2) with a cross-entropy loss.
    Classification,
}

/// An `--image` error.
fn image_error(message: String) -> Error {
    Error::setting(crate::error::SettingKey::Image, message)
}

/// Whether a parsed JSON document is a Hugging Face configuration: an object with a `model_type`
/// or `architectures` key (or another library's config, see [`other_library`]) and neither of
/// memest's own `layers` and `input`.
#[must_use]
pub fn is_hf_config(value: &Value) -> bool {
    value.as_object().is_some_and(|o| {
        (o.contains_key("model_type")
            || o.contains_key("architectures")
            || other_library(value).is_some())
            && !o.contains_key("layers")
            && !o.contains_key("input")
    })
}

/// What a config of another library is, worded for an error: a diffusers config (its
/// `ConfigMixin` writes `_class_name` and `_diffusers_version`: "a diffusers
/// UNet2DConditionModel config") or a timm `config.json` (`architecture` with `pretrained_cfg`,
/// `num_classes` or `num_features`: "a timm resnet50.a1_in1k config"); `None` for anything else.
#[must_use]
pub fn other_library(value: &Value) -> Option<String> {
    let o = value.as_object()?;
    if o.contains_key("model_type") {
        return None;
    }
    let text = |key: &str| o.get(key).and_then(Value::as_str);
    if o.contains_key("_diffusers_version") || o.contains_key("_class_name") {
        return Some(format!(
            "a diffusers {} config",
            text("_class_name").unwrap_or("model")
        ));
    }
    let arch = text("architecture")?;
    ["pretrained_cfg", "num_classes", "num_features"]
        .iter()
        .any(|k| o.contains_key(*k))
        .then(|| format!("a timm {arch} config"))
}

/// The JSON text with the non-finite numbers Python's `json` writes (`NaN`, `Infinity`,
/// `-Infinity`, outside strings) replaced by `null`, so that the keys holding them read as unset;
/// `None` when there are none. Python's `json.dump` writes them for `float('nan')` and
/// `float('inf')`; serde_json, following RFC 8259, does not read them.
#[must_use]
pub fn python_json(text: &str) -> Option<String> {
    const TOKENS: [&str; 3] = ["-Infinity", "Infinity", "NaN"];
    let mut out = String::with_capacity(text.len());
    let mut in_string = false;
    let mut escaped = false;
    let mut replaced = false;
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if in_string {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
        } else if c == '"' {
            in_string = true;
        } else if let Some(token) = TOKENS.iter().find(|t| rest.starts_with(**t)) {
            out.push_str("null");
            rest = &rest[token.len()..];
            replaced = true;
            continue;
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    replaced.then_some(out)
}

/// The model a Hugging Face config names in `_name_or_path` (what `save_pretrained` writes:
/// `meta-llama/Llama-2-7b-hf`, or a local folder, of which the last part is kept); `None` when
/// the text is not a JSON object or the key is missing or empty.
#[must_use]
pub fn name_or_path(text: &str) -> Option<String> {
    #[derive(Deserialize)]
    struct Named {
        #[serde(rename = "_name_or_path")]
        name_or_path: Option<String>,
    }
    let named: Named = serde_json::from_str(text)
        .ok()
        .or_else(|| serde_json::from_str(&python_json(text)?).ok())?;
    let name = named.name_or_path?;
    let name = name.trim().trim_end_matches(['/', '\\']);
    let name = if name.starts_with(['/', '.', '~']) || name.contains('\\') {
        name.rsplit(['/', '\\']).next().unwrap_or(name)
    } else {
        name
    };
    (!name.is_empty()).then(|| name.to_string())
}

/// An import error about `field` of a config whose `model_type` is not known yet.
fn field_error(field: &str, message: String) -> Error {
    Error::Hf(HfError {
        model_type: None,
        field: Some(field.to_string()),
        position: None,
        message,
    })
}

/// The hidden size the Hugging Face Trainer fills DeepSpeed's `"auto"` sizes from
/// (`trainer_config_finalize`, `transformers/integrations/deepspeed.py`): the config's
/// `hidden_size`, else the largest of its `hidden_sizes`, else the same in its `text_config`;
/// `None` when none is a whole number.
fn trainer_hidden_size(text: &str) -> Option<u64> {
    let v: Value = serde_json::from_str(text).ok()?;
    let of = |c: &Value| {
        c.get("hidden_size").and_then(Value::as_u64).or_else(|| {
            c.get("hidden_sizes")
                .and_then(Value::as_array)
                .and_then(|a| a.iter().filter_map(Value::as_u64).max())
        })
    };
    of(&v).or_else(|| v.get("text_config").and_then(of))
}

/// Builds the memest description of a Hugging Face configuration, given as its JSON text.
///
/// # Errors
/// [`Error::Hf`] for a field of the wrong type (with the field's path, line and column), an
/// unsupported `model_type` (listing the supported ones), an
/// architecture whose head memest does not know, a missing required field (named), an
/// out-of-range value, or an unsupported activation.
pub fn to_spec(text: &str, head: Head) -> Result<ModelSpec, Error> {
    to_spec_with(text, head, None)
}

/// As [`to_spec`], for an image of `image` pixels (`--image`): a diffusers UNet reads the latent
/// the VAE makes of it, `[in_channels, height / 8, width / 8]`, instead of `sample_size`.
///
/// # Errors
/// As [`to_spec`]; [`Error::Setting`] when `image` is not a multiple of 8 pixels for a
/// diffusers UNet, is given for a text-only config, or differs from a fixed-size vision tower's
/// `image_size` (ViT, CLIP, SigLIP, LLaVA's: transformers refuses another size there without
/// `interpolate_pos_encoding=True`); DINOv2 takes any image whose sides are at least its
/// `patch_size`, its position table interpolated to the image's patch grid.
pub fn to_spec_with(text: &str, head: Head, image: Option<ImageSize>) -> Result<ModelSpec, Error> {
    let value = serde_json::from_str::<Value>(text).ok();
    if let Some(class) = value
        .as_ref()
        .filter(|v| v.get("model_type").is_none())
        .and_then(|v| v.get("_class_name"))
        .and_then(Value::as_str)
        .filter(|c| diffusers::CLASSES.contains(c))
    {
        if matches!(head, Head::Lm | Head::Classification) {
            return Err(field_error(
                "_class_name",
                format!(
                    "{class} has no language-model or classification head; --head takes auto or none for a diffusers config"
                ),
            ));
        }
        return diffusers::to_spec(text, class, image, head == Head::Auto);
    }
    let asked_image = image;
    if let Some(what) = value.as_ref().and_then(other_library) {
        return Err(Error::Hf(HfError {
            model_type: None,
            field: None,
            position: None,
            message: format!(
                "{what}: not supported yet (memest reads diffusers configs of class {} and transformers configs, model types {}; describe the model in a memest file instead)",
                diffusers::CLASSES.join(", "),
                supported().join(", ")
            ),
        }));
    }
    let header: Header = config::read(text, None)?;
    let model_type = match &header.model_type {
        Some(t) => t.clone(),
        None => infer_model_type(header.architectures.as_deref())?,
    };
    let family = Family::from_model_type(&model_type).ok_or_else(|| {
        if model_type == "gemma3" {
            // transformers' Gemma3Config (Gemma3ForConditionalGeneration): a SigLIP vision
            // tower and a Gemma 3 text model, whose config is its `text_config`
            // (Gemma3TextConfig, model_type `gemma3_text`).
            return field_error(
                "model_type",
                "model_type `gemma3` is the multimodal Gemma 3 (Gemma3ForConditionalGeneration: a SigLIP vision tower and the text model), which memest does not read; it reads the text model, model_type `gemma3_text`: a Gemma3ForCausalLM config (gemma-3-1b), or this config's `text_config` saved as its own file"
                    .to_string(),
            );
        }
        let all = supported();
        let near = crate::error::nearest(&model_type, &all)
            .map(|n| format!(" (the nearest supported one is `{n}`)"))
            .unwrap_or_default();
        field_error(
            "model_type",
            format!(
                "model_type `{model_type}` is not supported{near}; supported: {}",
                all.join(", ")
            ),
        )
    })?;
    let arch = header
        .architectures
        .as_ref()
        .and_then(|a| a.first())
        .cloned();
    let cfg = Cfg {
        text,
        model_type: &model_type,
        header,
    };
    let head = resolve_head(head, arch.as_deref(), family, &model_type)?;
    let mut image = None;
    let mut pixels = None;
    let (mut layers, seq) = match family {
        Family::Llava => {
            let m = llava::llava(&cfg, head, asked_image)?;
            pixels = Some(m.pixels);
            (m.layers, m.max_positions)
        }
        Family::Qwen2Vl => {
            let m = qwen2_vl::qwen2_vl(&cfg, head, asked_image)?;
            pixels = Some(m.pixels);
            (m.layers, m.max_positions)
        }
        Family::Whisper => {
            if let Some(asked) = asked_image {
                return Err(image_error(format!(
                    "--image {asked}: model_type `whisper` reads no image (its log-mel `input_features` are fixed by the config: `num_mel_bins` × 2·`max_source_positions` frames)"
                )));
            }
            let m = whisper::whisper(&cfg, head)?;
            pixels = Some(m.features);
            (m.layers, m.max_positions)
        }
        Family::Tower => {
            let Some((kind, tower, nested)) = clip::tower_of(&model_type, arch.as_deref()) else {
                return Err(cfg.err(format!(
                    "{} with both towers and the contrastive loss is not supported yet; a config of one tower (…VisionModel, …TextModel) is",
                    arch.as_deref().unwrap_or(&model_type)
                )));
            };
            match clip::tower(&cfg, head, kind, tower, nested)? {
                (layers, clip::Reads::Image { channels, size }) => {
                    image = Some(vision::Image {
                        channels,
                        height: size,
                        width: size,
                    });
                    (layers, size)
                }
                (layers, clip::Reads::Tokens(n)) => (layers, n),
            }
        }
        Family::Vision(kind) => {
            let (layers, img) = vision::vision(&cfg, head, kind, asked_image)?;
            image = Some(img);
            (layers, img.height)
        }
        Family::Gpt2 => gpt2::gpt2(&cfg, head)?,
        Family::GptBigCode => gpt2::gpt_bigcode(&cfg, head)?,
        Family::Bert => bert::bert(&cfg, head)?,
        Family::T5 => t5::t5(&cfg, head)?,
        Family::Roberta => bert::roberta(&cfg, head)?,
        Family::DebertaV2 => deberta::deberta_v2(&cfg, head)?,
        Family::GptNeox => ln_decoder::gpt_neox(&cfg, head)?,
        Family::Phi => ln_decoder::phi(&cfg, head)?,
        Family::Falcon => ln_decoder::falcon(&cfg, head)?,
        Family::Bloom => ln_decoder::bloom(&cfg, head)?,
        Family::StableLm => ln_decoder::stablelm(&cfg, head)?,
        Family::Starcoder2 => ln_decoder::starcoder2(&cfg, head)?,
        Family::Decoder(row) => decoder::decoder(&cfg, row, head)?,
    };
    if let Some(asked) = asked_image {
        match image {
            None if pixels.is_none() => {
                return Err(image_error(format!(
                    "--image {asked}: model_type `{model_type}` reads no image"
                )));
            }
            Some(img) if (asked.height, asked.width) != (img.height, img.width) => {
                return Err(image_error(format!(
                    "--image {asked}: {model_type} reads {h}x{w} pixels (its `image_size`); transformers fails on another size unless the forward is called with interpolate_pos_encoding=True (ViT and CLIP raise a ValueError, SigLIP's position table does not broadcast), which memest does not model; DINOv2, which always interpolates, takes any size",
                    h = img.height,
                    w = img.width
                )));
            }
            _ => {}
        }
    }
    if cfg.header.use_cache == Some(false) {
        no_kv_cache(&mut layers);
    }
    let mut dtype = None;
    for (key, value) in [
        ("torch_dtype", &cfg.header.torch_dtype),
        ("dtype", &cfg.header.dtype),
    ] {
        match value.as_deref() {
            None | Some("auto") => {}
            Some(s) => {
                let d = s.parse::<DType>().ok().filter(|d| d.is_float()).ok_or_else(|| {
                    field_error(key, format!("`{key}` must name a floating-point dtype (e.g. \"bfloat16\"), got \"{s}\""))
                })?;
                dtype = Some(d);
                break;
            }
        }
    }
    let head_name = match head {
        Resolved::Bare => "bare model, no loss",
        Resolved::Lm => match family {
            Family::Bert | Family::Roberta | Family::DebertaV2 => "masked-LM head and loss",
            Family::T5 | Family::Whisper => "LM head and loss",
            _ => "causal-LM head and loss",
        },
        Resolved::Classification if image.is_some() => "image-classification head and loss",
        Resolved::Classification => "sequence-classification head and loss",
    };
    let description = format!(
        "{} (model_type {model_type}) from a Hugging Face config, as transformers 5 builds it: {head_name}",
        arch.as_deref().unwrap_or("no architectures")
    );
    // Relative position buckets (T5) and ALiBi (BLOOM) have no trained limit; RoPE and learned
    // tables do.
    let max_positions =
        (!matches!(family, Family::T5 | Family::Bloom) && image.is_none()).then_some(seq);
    // A vision model reads `pixel_values` `[batch, channels, size, size]` in the model's dtype.
    let input = match image {
        Some(img) => InputSpec {
            shape: vec![
                DimSpec::Fixed(img.channels),
                DimSpec::Fixed(img.height),
                DimSpec::Fixed(img.width),
            ],
            dtype: None,
        },
        None => InputSpec {
            shape: vec![DimSpec::Seq],
            dtype: Some(DType::Int64),
        },
    };
    Ok(ModelSpec {
        name: None,
        description: Some(description),
        max_positions,
        input,
        inputs: pixels.into_iter().collect(),
        defaults: DefaultsSpec {
            seq: image.is_none().then(|| seq.clamp(1, DEFAULT_MAX_SEQ)),
            dtype,
            // transformers 5 runs attention through `scaled_dot_product_attention` by default;
            // BLOOM's attention has only its eager form (`baddbmm` with the ALiBi bias).
            // Soft-capped attention scores (Gemma 2; Gemma 3 when a config sets
            // `attn_logit_softcapping`) are eager only: SDPA cannot soft-cap.
            // GPT-OSS's attention sinks are eager only too (`_supports_sdpa = False`).
            attention: Some(if matches!(family, Family::Bloom) || any_softcap(&layers) {
                AttentionImpl::Eager
            } else {
                AttentionImpl::Flash
            }),
            ..Default::default()
        },
        layers,
        hidden_size: trainer_hidden_size(text),
    })
}

/// Whether an attention layer soft-caps its scores or joins sink logits to them: eager only.
fn any_softcap(layers: &[LayerSpec]) -> bool {
    layers.iter().any(|l| {
        (l.kind == LayerKind::Attention && (l.softcap.is_some() || l.sinks == Some(true)))
            || l.layers.as_deref().is_some_and(any_softcap)
    })
}

/// `use_cache: false` (`PretrainedConfig.use_cache`, which the model's forward reads as its
/// default): no attention layer keeps a `DynamicCache`, and no cross-attention layer an
/// `EncoderDecoderCache` (T5's and Whisper's decoders build none), as a TOML model's
/// `kv_cache = false`.
fn no_kv_cache(layers: &mut [LayerSpec]) {
    for l in layers {
        if matches!(l.kind, LayerKind::Attention | LayerKind::CrossAttention) {
            l.kv_cache = Some(false);
        }
        if let Some(body) = &mut l.layers {
            no_kv_cache(body);
        }
    }
}

/// The `model_type` of the family whose architecture prefix starts the first of
/// `architectures` (`Qwen2MoeForCausalLM` → `qwen2_moe`); the longest prefix wins, and a prefix
/// must end where a capitalized word begins (`Gemma2…` is not `gemma`, `Olmoe…` not `olmo`).
fn infer_model_type(architectures: Option<&[String]>) -> Result<String, Error> {
    let arch = architectures
        .and_then(|a| a.first())
        .map_or("", String::as_str);
    let lower = arch.to_ascii_lowercase();
    DECODERS
        .iter()
        .map(|d| (d.arch_prefix, d.model_type))
        .chain(OTHERS.iter().map(|o| (o.1, o.0)))
        .filter(|(prefix, _)| {
            lower.starts_with(prefix)
                && arch
                    .get(prefix.len()..)
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with(|c: char| c.is_ascii_uppercase()))
        })
        .max_by_key(|(prefix, _)| prefix.len())
        .map(|(_, ty)| ty.to_string())
        .ok_or_else(|| {
            field_error("architectures", format!(
                "no `model_type`, and architecture `{arch}` names no supported family; supported model types: {}",
                supported().join(", ")
            ))
        })
}

/// The families memest imports.
#[derive(Clone, Copy, Debug)]
enum Family {
    /// A Llama-style decoder, built from its row of [`DECODERS`].
    Decoder(&'static DecoderFamily),
    Gpt2,
    /// GPT-2 with multi-query attention (`gpt2.rs`).
    GptBigCode,
    Bert,
    T5,
    /// RoBERTa and XLM-RoBERTa (`bert.rs`).
    Roberta,
    /// DeBERTa-v2 and -v3 (`deberta.rs`): disentangled attention.
    DebertaV2,
    /// The LayerNorm decoders of `ln_decoder.rs`.
    GptNeox,
    Phi,
    Falcon,
    Bloom,
    StableLm,
    Starcoder2,
    /// ViT and DINOv2 (`vision.rs`), reading pixels.
    Vision(vision::Kind),
    /// One tower of CLIP or SigLIP (`clip.rs`).
    Tower,
    /// LLaVA: a CLIP vision tower, projector and decoder (`llava.rs`).
    Llava,
    /// Qwen2-VL: a ViT over flattened patches, patch merger and Qwen2 (`qwen2_vl.rs`).
    Qwen2Vl,
    /// Whisper: an audio encoder on log-mel features and a decoder (`whisper.rs`).
    Whisper,
}

impl Family {
    fn from_model_type(t: &str) -> Option<Family> {
        DECODERS
            .iter()
            .find(|d| d.model_type == t)
            .map(Family::Decoder)
            .or_else(|| OTHERS.iter().find(|o| o.0 == t).map(|o| o.2))
    }
}

/// The head after resolving [`Head::Auto`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Resolved {
    Bare,
    Lm,
    Classification,
}

fn resolve_head(
    head: Head,
    arch: Option<&str>,
    family: Family,
    model_type: &str,
) -> Result<Resolved, Error> {
    match head {
        Head::None => return Ok(Resolved::Bare),
        Head::Lm => return Ok(Resolved::Lm),
        Head::Classification => return Ok(Resolved::Classification),
        Head::Auto => {}
    }
    let Some(arch) = arch else {
        // No `architectures`: the family's usual head.
        return Ok(
            if matches!(
                family,
                Family::Bert
                    | Family::Roberta
                    | Family::DebertaV2
                    | Family::Vision(_)
                    | Family::Tower
            ) {
                Resolved::Bare
            } else {
                Resolved::Lm
            },
        );
    };
    let lm_suffixes: &[&str] = match family {
        Family::Bert | Family::Roberta | Family::DebertaV2 => &["ForMaskedLM"],
        Family::T5 => &["ForConditionalGeneration"],
        Family::Gpt2 | Family::GptBigCode => &["LMHeadModel", "ForCausalLM"],
        Family::Decoder(_)
        | Family::GptNeox
        | Family::Phi
        | Family::Falcon
        | Family::Bloom
        | Family::StableLm
        | Family::Starcoder2 => &["ForCausalLM"],
        Family::Vision(_) | Family::Tower => &[],
        Family::Llava | Family::Qwen2Vl | Family::Whisper => &["ForConditionalGeneration"],
    };
    if lm_suffixes.iter().any(|s| arch.ends_with(s)) {
        Ok(Resolved::Lm)
    } else if arch.ends_with("ForSequenceClassification")
        || (matches!(family, Family::Vision(_)) && arch.ends_with("ForImageClassification"))
    {
        Ok(Resolved::Classification)
    } else if arch.ends_with("Model") && !arch.contains("For") && !arch.contains("Head") {
        Ok(Resolved::Bare)
    } else {
        Err(field_error(
            "architectures",
            format!(
                "architecture `{arch}` is not supported for model_type `{model_type}` (known heads: {}, …ForSequenceClassification and the bare …Model); pick a head with --head none|lm|classification",
                lm_suffixes
                    .iter()
                    .map(|s| format!("…{s}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::LayerKind as K;
    use serde_json::json;

    fn spec_of(config: &Value, head: Head) -> Result<ModelSpec, Error> {
        to_spec(&config.to_string(), head)
    }

    fn llama_tiny() -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 512,
            "intermediate_size": 1408,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "vocab_size": 32000,
            "torch_dtype": "bfloat16"
        })
    }

    #[test]
    fn detects_hf_configs() {
        assert!(is_hf_config(&json!({"model_type": "llama"})));
        assert_eq!(
            python_json(r#"{"a": NaN, "b": [Infinity, -Infinity], "c": "NaN \" Infinity"}"#)
                .as_deref(),
            Some(r#"{"a": null, "b": [null, null], "c": "NaN \" Infinity"}"#)
        );
        assert_eq!(python_json(r#"{"a": 1e5, "b": "Infinity"}"#), None);
        assert!(is_hf_config(&json!({"architectures": ["BertModel"]})));
        assert!(!is_hf_config(&json!({"model_type": "x", "layers": []})));
        assert!(!is_hf_config(
            &json!({"input": {"shape": [4]}, "layers": []})
        ));
        assert!(!is_hf_config(&json!([1, 2])));
    }

    #[test]
    fn llama_has_one_repeat_block_and_a_tied_or_untied_head() {
        let spec = spec_of(&llama_tiny(), Head::Auto).unwrap();
        let kinds: Vec<K> = spec.layers.iter().map(|l| l.kind).collect();
        assert_eq!(
            kinds,
            [
                K::Embedding,
                K::Rotary,
                K::Repeat,
                K::RmsNorm,
                K::Linear,
                K::CrossEntropy
            ]
        );
        assert_eq!(spec.layers[2].count, Some(4));
        assert_eq!(spec.layers[4].tie, None);
        assert_eq!(spec.defaults.dtype, Some(DType::Bfloat16));
        assert_eq!(spec.defaults.seq, Some(2048));
        let body = spec.layers[2].layers.as_ref().unwrap();
        let attn = body.iter().find(|l| l.kind == K::Attention).unwrap();
        assert_eq!((attn.heads, attn.kv_heads), (Some(8), Some(2)));
        assert_eq!(attn.bias, Some(false));

        let mut tied = llama_tiny();
        tied["tie_word_embeddings"] = json!(true);
        let spec = spec_of(&tied, Head::Auto).unwrap();
        assert_eq!(spec.layers[4].tie.as_deref(), Some("model.embed_tokens"));
    }

    #[test]
    fn head_override() {
        let spec = spec_of(&llama_tiny(), Head::None).unwrap();
        assert_eq!(spec.layers.last().unwrap().kind, K::RmsNorm);
        assert_eq!(spec.layers[0].name.as_deref(), Some("embed_tokens"));
        let spec = spec_of(&llama_tiny(), Head::Classification).unwrap();
        let score = spec
            .layers
            .iter()
            .find(|l| l.name.as_deref() == Some("score"))
            .unwrap();
        assert_eq!(score.out_features, Some(2));
    }

    #[test]
    fn multimodal_gemma3_points_to_the_text_config() {
        let Err(Error::Hf(HfError { message: m, .. })) =
            spec_of(&json!({"model_type": "gemma3"}), Head::Auto)
        else {
            panic!("expected an import error")
        };
        assert!(
            m.contains("model_type `gemma3` is the multimodal Gemma 3")
                && m.contains("model_type `gemma3_text`")
                && !m.contains("nearest supported one is `gemma`"),
            "{m}"
        );
    }

    #[test]
    fn unsupported_model_type_lists_the_supported_ones() {
        let Err(Error::Hf(HfError { message: m, .. })) =
            spec_of(&json!({"model_type": "gpt-neox"}), Head::Auto)
        else {
            panic!("expected an import error")
        };
        assert!(
            m.contains("`gpt-neox` is not supported (the nearest supported one is `gpt_neox`)")
                && m.contains("llama")
                && m.contains("qwen2_moe"),
            "{m}"
        );
        let Err(Error::Hf(HfError { message: m, .. })) = spec_of(
            &json!({"_class_name": "AutoencoderKL", "_diffusers_version": "0.6.0", "in_channels": 3}),
            Head::Auto,
        ) else {
            panic!("expected an import error")
        };
        assert!(
            m.starts_with("a diffusers AutoencoderKL config: not supported yet (memest reads diffusers configs of class FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel and"),
            "{m}"
        );
        let timm =
            json!({"architecture": "resnet50.a1_in1k", "num_classes": 1000, "pretrained_cfg": {}});
        assert!(is_hf_config(&timm));
        let Err(Error::Hf(HfError { message: m, .. })) = spec_of(&timm, Head::Auto) else {
            panic!("expected an import error")
        };
        assert!(
            m.starts_with("a timm resnet50.a1_in1k config: not supported yet"),
            "{m}"
        );
    }

    #[test]
    fn missing_field_is_named() {
        let mut c = llama_tiny();
        c.as_object_mut().unwrap().remove("hidden_size");
        let Err(Error::Hf(HfError { message: m, .. })) = spec_of(&c, Head::Auto) else {
            panic!("expected an import error")
        };
        assert!(m.contains("`hidden_size`"), "{m}");
    }

    #[test]
    fn qwen2_moe_dense_layers_split_the_blocks() {
        let c = json!({
            "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"],
            "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64, "mlp_only_layers": [0]
        });
        let spec = spec_of(&c, Head::Auto).unwrap();
        let blocks: Vec<(&str, Option<u64>)> = spec
            .layers
            .iter()
            .filter(|l| l.kind == K::Repeat)
            .map(|l| (l.name.as_deref().unwrap(), l.count))
            .collect();
        assert_eq!(
            blocks,
            [("model.layers.0", Some(1)), ("model.layers.1-3", Some(3))]
        );
    }

    #[test]
    fn architecture_without_model_type() {
        let mut c = llama_tiny();
        c.as_object_mut().unwrap().remove("model_type");
        assert!(spec_of(&c, Head::Auto).is_ok());
        let Err(Error::Hf(HfError { message: m, .. })) =
            spec_of(&json!({"architectures": ["MambaForCausalLM"]}), Head::Auto)
        else {
            panic!("expected an import error")
        };
        assert!(m.contains("MambaForCausalLM"), "{m}");
    }

    #[test]
    fn unknown_architecture_suggests_head() {
        let mut c = llama_tiny();
        c["architectures"] = json!(["LlamaForTokenClassification"]);
        let Err(Error::Hf(HfError { message: m, .. })) = spec_of(&c, Head::Auto) else {
            panic!("expected an import error")
        };
        assert!(m.contains("--head"), "{m}");
        assert!(spec_of(&c, Head::Lm).is_ok());
    }

    #[test]
    fn the_family_table_names_each_family_once() {
        let types = supported();
        let mut unique = types.clone();
        unique.dedup();
        assert_eq!(types, unique);
        assert_eq!(types.len(), DECODERS.len() + OTHERS.len());
        for d in DECODERS {
            assert_eq!(
                infer_model_type(Some(&[format!("{}ForCausalLM", d.arch_prefix)])).unwrap(),
                d.model_type
            );
        }
    }

    #[test]
    fn architecture_prefixes_take_the_longest_match_and_no_digit_after_it() {
        let infer = |arch: &str| infer_model_type(Some(&[arch.to_string()])).ok();
        assert_eq!(infer("Qwen2MoeForCausalLM").as_deref(), Some("qwen2_moe"));
        assert_eq!(infer("Qwen2ForCausalLM").as_deref(), Some("qwen2"));
        assert_eq!(infer("Olmo2ForCausalLM").as_deref(), Some("olmo2"));
        assert_eq!(infer("T5ForConditionalGeneration").as_deref(), Some("t5"));
        assert_eq!(infer("Gemma2ForCausalLM").as_deref(), Some("gemma2"));
        assert_eq!(infer("GemmaForCausalLM").as_deref(), Some("gemma"));
        assert_eq!(infer("Gemma3ForCausalLM").as_deref(), Some("gemma3_text"));
        assert_eq!(infer("OlmoForCausalLM").as_deref(), Some("olmo"));
        assert_eq!(infer("OlmoeForCausalLM"), None);
    }

    #[test]
    fn a_field_of_the_wrong_type_names_its_path_and_position() {
        let text = "{\n  \"model_type\": \"llama\",\n  \"hidden_size\": \"x\"\n}";
        let Err(Error::Hf(e)) = to_spec(text, Head::Auto) else {
            panic!("expected a Hugging Face config error")
        };
        assert_eq!(e.position, Some((3, 20)));
        assert_eq!(e.field.as_deref(), Some("hidden_size"));
        assert_eq!(
            e.message,
            "`hidden_size`: expected a whole number (0 or more), got the string \"x\""
        );
    }
}
