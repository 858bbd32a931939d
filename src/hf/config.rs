//! The fields memest reads from a `config.json`, one serde struct per config family.
//!
//! Every field is an `Option`: transformers writes `null` for many keys it leaves at their
//! default, and the default often depends on the family (see [`super::DECODERS`]). Unknown keys
//! are ignored (configs carry dozens memest has no use for). A field of the wrong type is an
//! [`Error::Hf`] with the field's path and the position serde_json reports, e.g.
//! `1:62: Hugging Face config (model_type gpt2): \`n_embd\`: expected a whole number (0 or more),
//! got the string "768"`; a missing or out-of-range value is an [`Error::Hf`] naming the field.

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::MAX_LAYERS;
use crate::error::{Error, HfError};

/// The fields every family reads: what the model is, its head, its dtype.
#[derive(Debug, Default, Deserialize)]
pub(super) struct Header {
    pub model_type: Option<String>,
    pub architectures: Option<Vec<String>>,
    /// transformers 4's name of `dtype`.
    pub torch_dtype: Option<String>,
    pub dtype: Option<String>,
    pub num_labels: Option<u64>,
    pub id2label: Option<Map<String, Value>>,
    pub tie_word_embeddings: Option<bool>,
    /// `PretrainedConfig.use_cache` (default true): whether the model keeps a KV cache.
    pub use_cache: Option<bool>,
}

/// Llama-style decoders (`LlamaConfig`, `MistralConfig`, `Qwen2MoeConfig`, `Olmo2Config`, …):
/// the union of the keys their builder reads (see [`super::decoder`]).
#[derive(Debug, Default, Deserialize)]
pub(super) struct DecoderConfig {
    pub vocab_size: Option<u64>,
    pub hidden_size: Option<u64>,
    pub intermediate_size: Option<u64>,
    pub num_hidden_layers: Option<u64>,
    pub num_attention_heads: Option<u64>,
    pub num_key_value_heads: Option<u64>,
    pub head_dim: Option<u64>,
    pub max_position_embeddings: Option<u64>,
    pub hidden_act: Option<String>,
    pub attention_bias: Option<bool>,
    /// Qwen2-MoE's switch for the Q/K/V biases.
    pub qkv_bias: Option<bool>,
    pub mlp_bias: Option<bool>,
    pub attention_dropout: Option<f64>,
    /// Phi-3's residual dropout.
    pub resid_pdrop: Option<f64>,
    pub sliding_window: Option<u64>,
    pub use_sliding_window: Option<bool>,
    pub max_window_layers: Option<u64>,
    /// Per layer, `"sliding_attention"` or `"full_attention"`.
    pub layer_types: Option<Vec<String>>,
    /// Gemma 3: every `sliding_window_pattern`-th layer attends globally, the others through
    /// the window (when `layer_types` is absent).
    pub sliding_window_pattern: Option<u64>,
    /// Mixtral's and GPT-OSS's experts.
    pub num_local_experts: Option<u64>,
    /// GPT-OSS: the clamp of its experts' SwiGLU (default 7.0).
    pub swiglu_limit: Option<f64>,
    /// Qwen2-MoE's experts.
    pub num_experts: Option<u64>,
    pub num_experts_per_tok: Option<u64>,
    pub moe_intermediate_size: Option<u64>,
    pub shared_expert_intermediate_size: Option<u64>,
    pub norm_topk_prob: Option<bool>,
    pub decoder_sparse_step: Option<u64>,
    pub mlp_only_layers: Option<Vec<u64>>,
    /// transformers 5's RoPE settings.
    pub rope_parameters: Option<RopeParameters>,
    /// transformers 4's place of `rope_parameters.partial_rotary_factor`.
    pub partial_rotary_factor: Option<f64>,
    /// Gemma 2's name of `hidden_act`.
    pub hidden_activation: Option<String>,
    /// Gemma 2's soft-capping (`null` turns it off: hence the double option).
    #[serde(default, deserialize_with = "nullable")]
    pub attn_logit_softcapping: Option<Option<f64>>,
    #[serde(default, deserialize_with = "nullable")]
    pub final_logit_softcapping: Option<Option<f64>>,
    /// DeepSeek's multi-head latent attention (`q_lora_rank: null`: one `q_proj`).
    #[serde(default, deserialize_with = "nullable")]
    pub q_lora_rank: Option<Option<u64>>,
    pub kv_lora_rank: Option<u64>,
    pub qk_nope_head_dim: Option<u64>,
    pub qk_rope_head_dim: Option<u64>,
    pub v_head_dim: Option<u64>,
    /// DeepSeek's experts.
    pub n_routed_experts: Option<u64>,
    pub n_shared_experts: Option<u64>,
    pub first_k_dense_replace: Option<u64>,
    pub n_group: Option<u64>,
    pub topk_group: Option<u64>,
    pub topk_method: Option<String>,
    /// OLMo's clamp of Q, K and V.
    pub clip_qkv: Option<f64>,
    /// Granite's multipliers.
    pub embedding_multiplier: Option<f64>,
    pub residual_multiplier: Option<f64>,
    pub logits_scaling: Option<f64>,
    /// Cohere's scale of the logits (`null`: none).
    #[serde(default, deserialize_with = "nullable")]
    pub logit_scale: Option<Option<f64>>,
    /// Cohere's LayerNorm on each head's queries and keys.
    pub use_qk_norm: Option<bool>,
}

/// The part of `rope_parameters` that changes memory: the fraction of each head that rotates.
#[derive(Debug, Default, Deserialize)]
pub(super) struct RopeParameters {
    pub partial_rotary_factor: Option<f64>,
}

/// `GPT2Config` (its `attribute_map` names: `hidden_size` for `n_embd`, …).
#[derive(Debug, Default, Deserialize)]
pub(super) struct Gpt2Config {
    pub vocab_size: Option<u64>,
    #[serde(alias = "hidden_size")]
    pub n_embd: Option<u64>,
    #[serde(alias = "num_hidden_layers")]
    pub n_layer: Option<u64>,
    #[serde(alias = "num_attention_heads")]
    pub n_head: Option<u64>,
    #[serde(alias = "max_position_embeddings")]
    pub n_positions: Option<u64>,
    pub n_inner: Option<u64>,
    pub activation_function: Option<String>,
    pub embd_pdrop: Option<f64>,
    pub attn_pdrop: Option<f64>,
    pub resid_pdrop: Option<f64>,
    pub add_cross_attention: Option<bool>,
    /// GPT-BigCode's one shared key/value head.
    pub multi_query: Option<bool>,
}

/// `BertConfig`.
#[derive(Debug, Default, Deserialize)]
pub(super) struct BertConfig {
    pub vocab_size: Option<u64>,
    pub hidden_size: Option<u64>,
    pub num_hidden_layers: Option<u64>,
    pub num_attention_heads: Option<u64>,
    pub intermediate_size: Option<u64>,
    pub max_position_embeddings: Option<u64>,
    pub type_vocab_size: Option<u64>,
    pub hidden_act: Option<String>,
    pub hidden_dropout_prob: Option<f64>,
    pub attention_probs_dropout_prob: Option<f64>,
    pub classifier_dropout: Option<f64>,
    pub position_embedding_type: Option<String>,
    pub is_decoder: Option<bool>,
    pub add_cross_attention: Option<bool>,
    /// RoBERTa's padding id: its positions start after it.
    pub pad_token_id: Option<u64>,
}

/// `DebertaV2Config` (`models/deberta_v2/configuration_deberta_v2.py`) and the keys
/// `modeling_deberta_v2.py` reads with `getattr` (`position_buckets`, `norm_rel_ebd`,
/// `share_att_key`, `embedding_size`, `attention_head_size`, `conv_kernel_size`, `cls_dropout`).
#[derive(Debug, Default, Deserialize)]
pub(super) struct DebertaV2Config {
    pub vocab_size: Option<u64>,
    pub hidden_size: Option<u64>,
    pub num_hidden_layers: Option<u64>,
    pub num_attention_heads: Option<u64>,
    pub intermediate_size: Option<u64>,
    pub hidden_act: Option<String>,
    pub hidden_dropout_prob: Option<f64>,
    pub attention_probs_dropout_prob: Option<f64>,
    pub max_position_embeddings: Option<u64>,
    pub type_vocab_size: Option<u64>,
    pub relative_attention: Option<bool>,
    pub max_relative_positions: Option<i64>,
    pub position_buckets: Option<i64>,
    pub pad_token_id: Option<u64>,
    pub position_biased_input: Option<bool>,
    /// `"p2c|c2p"` or `["p2c", "c2p"]`.
    pub pos_att_type: Option<PosAttType>,
    pub norm_rel_ebd: Option<String>,
    pub share_att_key: Option<bool>,
    pub embedding_size: Option<u64>,
    pub attention_head_size: Option<u64>,
    pub conv_kernel_size: Option<u64>,
    pub conv_groups: Option<u64>,
    pub conv_act: Option<String>,
    pub pooler_dropout: Option<f64>,
    pub pooler_hidden_act: Option<String>,
    pub pooler_hidden_size: Option<u64>,
    pub cls_dropout: Option<f64>,
    pub legacy: Option<bool>,
}

/// DeBERTa's `pos_att_type`: a `|`-separated string (older configs) or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum PosAttType {
    /// `"p2c|c2p"`.
    Joined(String),
    /// `["p2c", "c2p"]`.
    List(Vec<String>),
}

impl PosAttType {
    /// The entries, trimmed and lower-cased as `DebertaV2Config.__post_init__` does.
    pub fn entries(&self) -> Vec<String> {
        match self {
            PosAttType::Joined(s) => s.split('|').map(|e| e.trim().to_lowercase()).collect(),
            PosAttType::List(v) => v.iter().map(|e| e.trim().to_lowercase()).collect(),
        }
    }
}

/// `T5Config` (its `attribute_map` names: `hidden_size` for `d_model`, …).
#[derive(Debug, Default, Deserialize)]
pub(super) struct T5Config {
    pub vocab_size: Option<u64>,
    #[serde(alias = "hidden_size")]
    pub d_model: Option<u64>,
    pub d_ff: Option<u64>,
    #[serde(alias = "num_hidden_layers")]
    pub num_layers: Option<u64>,
    pub num_decoder_layers: Option<u64>,
    #[serde(alias = "num_attention_heads")]
    pub num_heads: Option<u64>,
    pub d_kv: Option<u64>,
    pub relative_attention_num_buckets: Option<u64>,
    pub dropout_rate: Option<f64>,
    pub feed_forward_proj: Option<String>,
    pub n_positions: Option<u64>,
    pub classifier_dropout: Option<f64>,
}

/// `WhisperConfig` (`models/whisper/configuration_whisper.py`; its `attribute_map`:
/// `hidden_size` for `d_model`).
#[derive(Debug, Default, Deserialize)]
pub(super) struct WhisperConfig {
    pub vocab_size: Option<u64>,
    pub num_mel_bins: Option<u64>,
    #[serde(alias = "hidden_size")]
    pub d_model: Option<u64>,
    pub encoder_layers: Option<u64>,
    pub decoder_layers: Option<u64>,
    pub encoder_attention_heads: Option<u64>,
    pub decoder_attention_heads: Option<u64>,
    pub encoder_ffn_dim: Option<u64>,
    pub decoder_ffn_dim: Option<u64>,
    pub max_source_positions: Option<u64>,
    pub max_target_positions: Option<u64>,
    pub activation_function: Option<String>,
    pub dropout: Option<f64>,
    pub attention_dropout: Option<f64>,
    pub activation_dropout: Option<f64>,
    pub encoder_layerdrop: Option<f64>,
    pub decoder_layerdrop: Option<f64>,
}

/// The LayerNorm decoders built by [`super::ln_decoder`]: `GPTNeoXConfig`, `PhiConfig`,
/// `FalconConfig` and `BloomConfig` (its `attribute_map`: `n_layer`, `n_head`), the union of the
/// keys their builders read.
#[derive(Debug, Default, Deserialize)]
pub(super) struct LnDecoderConfig {
    pub vocab_size: Option<u64>,
    pub hidden_size: Option<u64>,
    #[serde(alias = "n_layer")]
    pub num_hidden_layers: Option<u64>,
    #[serde(alias = "n_head")]
    pub num_attention_heads: Option<u64>,
    pub num_key_value_heads: Option<u64>,
    pub intermediate_size: Option<u64>,
    pub max_position_embeddings: Option<u64>,
    pub hidden_act: Option<String>,
    pub attention_dropout: Option<f64>,
    pub hidden_dropout: Option<f64>,
    /// GPT-NeoX's switch between the parallel and the sequential residual.
    pub use_parallel_residual: Option<bool>,
    /// GPT-NeoX's biases on its attention projections.
    pub attention_bias: Option<bool>,
    /// GPT-NeoX's transformers 4 name of `partial_rotary_factor`.
    pub rotary_pct: Option<f64>,
    pub partial_rotary_factor: Option<f64>,
    pub rope_parameters: Option<RopeParameters>,
    /// Phi's dropouts.
    pub resid_pdrop: Option<f64>,
    pub embd_pdrop: Option<f64>,
    /// Phi's LayerNorm on the queries and keys.
    pub qk_layernorm: Option<bool>,
    /// Falcon's keys.
    pub num_kv_heads: Option<u64>,
    pub multi_query: Option<bool>,
    pub new_decoder_architecture: Option<bool>,
    pub parallel_attn: Option<bool>,
    pub num_ln_in_parallel_attn: Option<u64>,
    pub alibi: Option<bool>,
    pub bias: Option<bool>,
    pub ffn_hidden_size: Option<u64>,
    pub activation: Option<String>,
    /// Falcon's and BLOOM's residual from the LayerNorm's output instead of its input.
    pub apply_residual_connection_post_layernorm: Option<bool>,
    /// BLOOM's tensor-parallel slicing of its linears (`pretraining_tp > 1` with
    /// `slow_but_exact`).
    pub pretraining_tp: Option<u64>,
    pub slow_but_exact: Option<bool>,
    /// StableLM's biases on Q, K and V.
    pub use_qkv_bias: Option<bool>,
    /// StarCoder2's biases on every linear, its dropouts and its sliding window.
    pub use_bias: Option<bool>,
    pub residual_dropout: Option<f64>,
    pub embedding_dropout: Option<f64>,
    pub sliding_window: Option<u64>,
}

/// `ViTConfig` and `Dinov2Config` (and a CLIP or SigLIP `vision_config`): the union of the keys
/// [`super::vision`] reads.
#[derive(Debug, Default, Deserialize)]
pub(super) struct VisionConfig {
    pub hidden_size: Option<u64>,
    pub num_hidden_layers: Option<u64>,
    pub num_attention_heads: Option<u64>,
    pub intermediate_size: Option<u64>,
    pub hidden_act: Option<String>,
    pub hidden_dropout_prob: Option<f64>,
    pub attention_probs_dropout_prob: Option<f64>,
    pub image_size: Option<OneOrTwo>,
    pub patch_size: Option<OneOrTwo>,
    pub num_channels: Option<u64>,
    pub qkv_bias: Option<bool>,
    pub pooler_output_size: Option<u64>,
    pub pooler_act: Option<String>,
    /// DINOv2's keys.
    pub mlp_ratio: Option<f64>,
    pub use_swiglu_ffn: Option<bool>,
    pub use_mask_token: Option<bool>,
    pub drop_path_rate: Option<f64>,
}

/// `CLIPVisionConfig`, `CLIPTextConfig`, `SiglipVisionConfig`, `SiglipTextConfig` (a tower's own
/// config, or the `vision_config`/`text_config` of a two-tower one): the keys [`super::clip`]
/// reads.
#[derive(Debug, Default, Deserialize)]
pub(super) struct ClipTowerConfig {
    pub vocab_size: Option<u64>,
    pub hidden_size: Option<u64>,
    pub intermediate_size: Option<u64>,
    pub num_hidden_layers: Option<u64>,
    pub num_attention_heads: Option<u64>,
    pub max_position_embeddings: Option<u64>,
    pub hidden_act: Option<String>,
    pub attention_dropout: Option<f64>,
    pub image_size: Option<u64>,
    pub patch_size: Option<u64>,
    pub num_channels: Option<u64>,
    /// SigLIP's text `head` width (default `hidden_size`).
    pub projection_size: Option<u64>,
    /// SigLIP's attention-pooling vision head.
    pub vision_use_head: Option<bool>,
}

/// A size written as one number or as a list (`image_size: 224` or `[224, 224]`); also a flag
/// or value given once or per block (diffusers' `only_cross_attention: [true, false]`).
#[derive(Debug, Default)]
pub(super) struct OneOrTwo<T = u64>(pub Vec<T>);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for OneOrTwo<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Either<T> {
            One(T),
            Many(Vec<T>),
        }
        Ok(match Either::deserialize(d)? {
            Either::One(n) => OneOrTwo(vec![n]),
            Either::Many(v) => OneOrTwo(v),
        })
    }
}

/// A key that may be absent (`None`), `null` (`Some(None)`) or a value.
fn nullable<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

/// Reads `text` (a whole `config.json`) as `T`, naming the field path and position on error
/// (with `model_type` once it is known).
pub(super) fn read<T: DeserializeOwned>(text: &str, model_type: Option<&str>) -> Result<T, Error> {
    let mut de = serde_json::Deserializer::from_str(text);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let (line, column) = (inner.line(), inner.column());
        let full = inner.to_string();
        let message = crate::error::humane(
            full.strip_suffix(&format!(" at line {line} column {column}"))
                .unwrap_or(&full),
        );
        let field = (path != ".").then_some(path);
        Error::Hf(HfError {
            model_type: model_type.map(str::to_string),
            message: match &field {
                Some(path) => format!("`{path}`: {message}"),
                None => message.to_string(),
            },
            field,
            position: (line > 0 && column > 0).then_some((line, column)),
        })
    })
}

/// One config being imported: its text, its `model_type` and its [`Header`]; checks values and
/// words errors.
pub(super) struct Cfg<'a> {
    pub text: &'a str,
    pub model_type: &'a str,
    pub header: Header,
}

impl Cfg<'_> {
    /// An error about this config.
    pub fn err(&self, message: String) -> Error {
        Error::Hf(HfError {
            model_type: Some(self.model_type.to_string()),
            field: None,
            position: None,
            message,
        })
    }

    /// An error about one field of this config.
    pub fn field_err(&self, field: &str, message: String) -> Error {
        Error::Hf(HfError {
            model_type: Some(self.model_type.to_string()),
            field: Some(field.to_string()),
            position: None,
            message,
        })
    }

    /// The config's fields for one family.
    pub fn read<T: DeserializeOwned>(&self) -> Result<T, Error> {
        read(self.text, Some(self.model_type))
    }

    /// A required size: present and positive.
    pub fn required(&self, key: &str, value: Option<u64>) -> Result<u64, Error> {
        match value {
            Some(0) => Err(self.field_err(key, format!("`{key}` must be positive, got 0"))),
            Some(n) => Ok(n),
            None => Err(self.field_err(
                key,
                format!("missing `{key}` (required to build the model)"),
            )),
        }
    }

    /// A layer count: required, positive, and at most [`MAX_LAYERS`] (checked before any layer
    /// is built).
    pub fn layers(&self, key: &str, value: Option<u64>) -> Result<u64, Error> {
        let n = self.required(key, value)?;
        if n > MAX_LAYERS {
            return Err(self.field_err(
                key,
                format!("`{key}` = {n} is more layers than memest traces (at most {MAX_LAYERS})"),
            ));
        }
        Ok(n)
    }

    /// A probability (dropout rate) in `[0, 1)`, `default` when absent.
    pub fn prob(&self, key: &str, value: Option<f64>, default: f64) -> Result<f64, Error> {
        let p = value.unwrap_or(default);
        if (0.0..1.0).contains(&p) {
            Ok(p)
        } else {
            Err(self.field_err(key, format!("`{key}` must be in [0, 1), got {p}")))
        }
    }

    /// `num_labels`, else the length of `id2label`, else transformers' default 2.
    pub fn num_labels(&self) -> Result<u64, Error> {
        match (self.header.num_labels, &self.header.id2label) {
            (Some(0), _) => {
                Err(self.field_err("num_labels", "`num_labels` must be positive, got 0".into()))
            }
            (Some(n), _) => Ok(n),
            (None, Some(m)) if !m.is_empty() => Ok(m.len() as u64),
            (None, _) => Ok(2),
        }
    }

    /// `tie_word_embeddings`, else the family's default.
    pub fn tie(&self, default: bool) -> bool {
        self.header.tie_word_embeddings.unwrap_or(default)
    }
}

/// `cfg.required("field", c.field)` without spelling the field twice.
macro_rules! required {
    ($cfg:expr, $c:ident . $field:ident) => {
        $cfg.required(stringify!($field), $c.$field)
    };
}

/// `cfg.layers("field", c.field)` without spelling the field twice.
macro_rules! layer_count {
    ($cfg:expr, $c:ident . $field:ident) => {
        $cfg.layers(stringify!($field), $c.$field)
    };
}

/// `cfg.prob("field", c.field, default)` without spelling the field twice.
macro_rules! prob {
    ($cfg:expr, $c:ident . $field:ident, $default:expr) => {
        $cfg.prob(stringify!($field), $c.$field, $default)
    };
}

pub(super) use {layer_count, prob, required};
