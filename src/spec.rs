//! The model description as written in a file (TOML or JSON, one schema).
//!
//! These types mirror the file exactly and reject unknown keys, so that a typo is reported with
//! its line and column. [`crate::graph::build`] turns them into a validated [`crate::graph::Model`].

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::cost::{Optimizer, OptimizerImpl};
use crate::dtype::DType;
use crate::error::{Error, SpecError};
use crate::vocab::{AttentionImpl, Mode};

/// Which syntax a model description is written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// TOML (`.toml`).
    Toml,
    /// JSON (`.json`).
    Json,
}

impl Format {
    /// The format named by a file's extension, if it names one.
    #[must_use]
    pub fn from_extension(path: &std::path::Path) -> Option<Format> {
        match path.extension()?.to_str()?.to_ascii_lowercase().as_str() {
            "toml" => Some(Format::Toml),
            "json" => Some(Format::Json),
            _ => None,
        }
    }

    /// Guesses the format from the text: JSON starts with `{` (after whitespace), anything else
    /// is read as TOML.
    #[must_use]
    pub fn sniff(text: &str) -> Format {
        if text
            .trim_start_matches('\u{feff}')
            .trim_start()
            .starts_with('{')
        {
            Format::Json
        } else {
            Format::Toml
        }
    }
}

/// A whole model file.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Display name; defaults to the file name.
    pub name: Option<String>,
    /// Free text, ignored by the estimator.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The model's input, per sample (no batch dimension).
    pub input: InputSpec,
    /// Defaults for the run settings; command-line flags override them.
    #[serde(default)]
    pub defaults: DefaultsSpec,
    /// The layers, in forward order.
    pub layers: Vec<LayerSpec>,
}

#[allow(clippy::derivable_impls)] // the enum comes from a macro
impl Default for LayerKind {
    fn default() -> Self {
        LayerKind::Linear
    }
}

/// The input tensor, without its batch dimension.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct InputSpec {
    /// Dimensions after the batch, e.g. `[3, 224, 224]`; the string `"seq"` stands for the
    /// sequence length (`--seq`), e.g. `["seq"]` for token ids.
    pub shape: Vec<DimSpec>,
    /// Element type. An integer type (e.g. `int64`) makes the input token ids; a float input
    /// (the default) follows the model's dtype, as `model.to(dtype)` inputs do.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dtype: Option<DType>,
}

/// One input dimension: a number, or the sequence length.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DimSpec {
    /// A fixed size.
    Fixed(u64),
    /// The sequence length (`--seq`, or `defaults.seq`).
    Seq,
}

impl Serialize for DimSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            DimSpec::Fixed(v) => s.serialize_u64(*v),
            DimSpec::Seq => s.serialize_str("seq"),
        }
    }
}

impl<'de> Deserialize<'de> for DimSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = DimSpec;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a positive integer or the string \"seq\"")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<DimSpec, E> {
                Ok(DimSpec::Fixed(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<DimSpec, E> {
                u64::try_from(v).map(DimSpec::Fixed).map_err(|_| {
                    E::custom(format!(
                        "invalid dimension {v}, expected a positive integer or \"seq\""
                    ))
                })
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<DimSpec, E> {
                if v == "seq" {
                    Ok(DimSpec::Seq)
                } else {
                    Err(E::custom(format!(
                        "invalid dimension \"{v}\", expected a positive integer or \"seq\""
                    )))
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// Defaults for the run settings, overridden by flags.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DefaultsSpec {
    /// Micro-batch size.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch: Option<u64>,
    /// Sequence length for `"seq"` input dimensions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// dtype of parameters and activations.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dtype: Option<DType>,
    /// Optimizer: any `--optim` name or alias.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<Optimizer>,
    /// How a `torch.optim` optimizer loops over its tensors: any `--optim-impl` name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub optimizer_impl: Option<OptimizerImpl>,
    /// `train` or `infer` (aliases `inference`, `eval`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    /// `eager` or `flash` (alias `sdpa`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attention: Option<AttentionImpl>,
}

/// One layer as written. Every kind-specific key is optional here; `graph::build` checks which
/// are required or allowed for the kind and reports the layer when they are not.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)] // each key is documented per kind in the README's model-file reference
pub struct LayerSpec {
    pub kind: LayerKind,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inputs: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trainable: Option<bool>,
    // repeat
    #[serde(skip_serializing_if = "Option::is_none")]
    pub count: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layers: Option<Vec<LayerSpec>>,
    // linear / embeddings
    #[serde(skip_serializing_if = "Option::is_none")]
    pub in_features: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub out_features: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bias: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tie: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quantize: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_embeddings: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub embedding_dim: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_positions: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ids_buffer: Option<u64>,
    // conv / pooling
    #[serde(skip_serializing_if = "Option::is_none")]
    pub in_channels: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub out_channels: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel: Option<Pair>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stride: Option<Pair>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub padding: Option<Pair>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_padding: Option<Pair>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dilation: Option<Pair>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub groups: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_size: Option<Pair>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ceil_mode: Option<bool>,
    // norms
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_features: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_groups: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affine: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub track_running_stats: Option<bool>,
    // activations / dropout
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inplace: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub approximate: Option<Approximate>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p: Option<f64>,
    // shape ops
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dim: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub start_dim: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub end_dim: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shape: Option<Vec<i64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dims: Option<Vec<i64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub start: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub length: Option<u64>,
    // free parameter
    #[serde(skip_serializing_if = "Option::is_none")]
    pub combine: Option<CombineKind>,
    // norms and attention
    #[serde(skip_serializing_if = "Option::is_none")]
    pub style: Option<Style>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_cache: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub heads: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_heads: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub causal: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fused_qkv: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub out_bias: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rotary: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dropout: Option<f64>,
    // mixture of experts
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experts: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub intermediate_size: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shared_intermediate_size: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shared_gate: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub normalize_topk: Option<bool>,
    // attention extras
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qk_norm: Option<bool>,
    /// Where `qk_norm` normalizes: `"head"` (per head over `head_dim`, Qwen3; the default) or
    /// `"projection"` (over the whole `heads·head_dim` projection, OLMo-2).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qk_norm_scope: Option<QkNormScope>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub softmax_f32: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub position_bias: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_buckets: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<u64>,
    // rotary
    #[serde(skip_serializing_if = "Option::is_none")]
    pub concat: Option<bool>,
    /// The rotary `cos`/`sin` tables stay float32 (OLMo-2's rotary embedding does not cast them
    /// to the activation dtype): Q and K are rotated in float32 and cast back.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tables_f32: Option<bool>,
    // scale
    #[serde(skip_serializing_if = "Option::is_none")]
    pub factor: Option<f64>,
    // loss
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shift: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upcast: Option<bool>,
    // free-form notes
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// A size given as one number (used for both spatial dimensions) or as `[h, w]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pair(pub u64, pub u64);

impl Serialize for Pair {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0 == self.1 {
            s.serialize_u64(self.0)
        } else {
            [self.0, self.1].serialize(s)
        }
    }
}

impl<'de> Deserialize<'de> for Pair {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            One(u64),
            Two([u64; 2]),
        }
        match Raw::deserialize(d).map_err(|_| {
            serde::de::Error::custom("expected a non-negative integer or a pair [h, w]")
        })? {
            Raw::One(v) => Ok(Pair(v, v)),
            Raw::Two([a, b]) => Ok(Pair(a, b)),
        }
    }
}

/// `gelu`'s `approximate`: `F.gelu(x, approximate=..)`. Both keep the input, so the estimate
/// does not depend on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Approximate {
    /// The erf form (`approximate="none"`, the default).
    #[serde(rename = "none")]
    Exact,
    /// The tanh approximation.
    Tanh,
}

/// How a `parameter` layer joins its tensor to the activations (`combine`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CombineKind {
    /// Broadcast and added (the default).
    Add,
    /// Broadcast and multiplied.
    Mul,
    /// Expanded over the batch and concatenated along `dim`.
    Concat,
}

/// The `style` key: which implementation a layer follows. `rmsnorm` takes `llama` (default),
/// `t5`, `gemma` or `olmo2`; `attention` takes `transformers` (default) or `torch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Style {
    /// `LlamaRMSNorm`.
    Llama,
    /// `T5LayerNorm`.
    T5,
    /// `GemmaRMSNorm`.
    Gemma,
    /// `Olmo2RMSNorm`.
    Olmo2,
    /// transformers' attention modules.
    Transformers,
    /// `torch.nn.MultiheadAttention`.
    Torch,
}

impl Style {
    /// The name used in files.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Style::Llama => "llama",
            Style::T5 => "t5",
            Style::Gemma => "gemma",
            Style::Olmo2 => "olmo2",
            Style::Transformers => "transformers",
            Style::Torch => "torch",
        }
    }
}

/// `qk_norm_scope`: where an attention layer's `qk_norm` RMS-normalizes queries and keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum QkNormScope {
    /// Per head, over `head_dim` (Qwen3; the default).
    Head,
    /// Over the whole `heads·head_dim` projection before the head split (OLMo-2).
    Projection,
}

macro_rules! layer_kinds {
    ($($variant:ident => $name:literal $(| $alias:literal)*),* $(,)?) => {
        /// The kind of a layer, as named in the `kind` key.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[allow(missing_docs)] // documented per kind in graph::Op and the README
        pub enum LayerKind { $($variant),* }

        impl LayerKind {
            /// Every kind, for error messages that list the valid names.
            pub const ALL: &'static [LayerKind] = &[$(LayerKind::$variant),*];

            /// The canonical name used in files.
            #[must_use]
            pub const fn as_str(self) -> &'static str {
                match self { $(LayerKind::$variant => $name),* }
            }

            fn from_name(s: &str) -> Option<LayerKind> {
                match s { $($name $(| $alias)* => Some(LayerKind::$variant),)* _ => None }
            }
        }
    };
}

layer_kinds! {
    Repeat => "repeat" | "block",
    Linear => "linear",
    Conv1d => "conv1d",
    Conv2d => "conv2d",
    ConvTranspose1d => "conv_transpose1d" | "convtranspose1d",
    ConvTranspose2d => "conv_transpose2d" | "convtranspose2d",
    BatchNorm1d => "batchnorm1d" | "batch_norm1d",
    BatchNorm2d => "batchnorm2d" | "batch_norm2d",
    LayerNorm => "layernorm" | "layer_norm",
    RmsNorm => "rmsnorm" | "rms_norm",
    GroupNorm => "groupnorm" | "group_norm",
    Embedding => "embedding",
    PositionEmbedding => "position_embedding",
    TokenTypeEmbedding => "token_type_embedding",
    Rotary => "rotary" | "rotary_embedding" | "rope",
    Parameter => "parameter",
    Dropout => "dropout",
    Relu => "relu",
    Relu6 => "relu6",
    Hardswish => "hardswish",
    Hardsigmoid => "hardsigmoid",
    LeakyRelu => "leaky_relu",
    Gelu => "gelu",
    GeluNew => "gelu_new",
    Silu => "silu" | "swish",
    Tanh => "tanh",
    Sigmoid => "sigmoid",
    Softmax => "softmax",
    Mul => "mul",
    Add => "add",
    Concat => "concat" | "cat",
    MaxPool2d => "maxpool2d" | "max_pool2d",
    AvgPool2d => "avgpool2d" | "avg_pool2d",
    AdaptiveAvgPool2d => "adaptive_avgpool2d" | "adaptive_avg_pool2d",
    Flatten => "flatten",
    Reshape => "reshape" | "view",
    Transpose => "transpose",
    Permute => "permute",
    Narrow => "narrow" | "slice",
    Select => "select",
    Attention => "attention" | "self_attention" | "multihead_attention",
    CrossAttention => "cross_attention",
    RelativePositionBias => "relative_position_bias",
    Moe => "moe" | "mixture_of_experts",
    StochasticDepth => "stochastic_depth",
    ShiftRight => "shift_right",
    Scale => "scale",
    CrossEntropy => "cross_entropy" | "cross_entropy_loss",
}

impl fmt::Display for LayerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

impl Serialize for LayerKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for LayerKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        LayerKind::from_name(&s).ok_or_else(|| {
            let names: Vec<&str> = LayerKind::ALL.iter().map(|k| k.as_str()).collect();
            let hint = crate::error::nearest(&s, &names)
                .map(|n| format!(" (did you mean `{n}`?)"))
                .unwrap_or_default();
            serde::de::Error::custom(format!(
                "unknown layer kind `{s}`{hint}; expected one of {}",
                names.join(", ")
            ))
        })
    }
}

/// Parses a model description.
///
/// # Errors
/// [`Error::Spec`] with the line and column of the first syntax or schema error; an empty file
/// is reported as such.
pub fn parse(src: &str, format: Format) -> Result<ModelSpec, Error> {
    // A UTF-8 byte-order mark is not part of the document.
    let src = src.strip_prefix('\u{feff}').unwrap_or(src);
    if src.trim().is_empty() {
        return Err(Error::Spec(SpecError {
            line: None,
            column: None,
            message: "the model description is empty (expected `[input]` and `[[layers]]`)".into(),
        }));
    }
    match format {
        Format::Toml => toml::from_str::<ModelSpec>(src).map_err(|e| {
            let (line, column) = match e.span() {
                Some(span) => line_col(src, span.start),
                None => (None, None),
            };
            Error::Spec(SpecError {
                line,
                column,
                message: improve(e.message()),
            })
        }),
        Format::Json if !src.trim_start().starts_with('{') => Err(Error::Spec(SpecError {
            line: Some(1),
            column: Some(1),
            message: "the top level must be a JSON object with `input` and `layers`".into(),
        })),
        Format::Json => serde_json::from_str::<ModelSpec>(src).map_err(|e| {
            let text = e.to_string();
            let suffix = format!(" at line {} column {}", e.line(), e.column());
            let message = text.strip_suffix(&suffix).unwrap_or(&text).to_string();
            Error::Spec(SpecError {
                line: (e.line() > 0).then_some(e.line()),
                column: (e.column() > 0).then_some(e.column()),
                message: improve(&message),
            })
        }),
    }
}

/// Adds a "did you mean" hint to serde's unknown-field and unknown-variant messages (a key, or
/// a value of a closed set such as `style`).
fn improve(message: &str) -> String {
    let message = message.trim_end();
    let (what, rest) = if let Some(rest) = message.strip_prefix("unknown field `") {
        ("key", rest)
    } else if let Some(rest) = message.strip_prefix("unknown variant `") {
        ("value", rest)
    } else {
        return message.to_string();
    };
    let Some((field, expected)) = rest.split_once('`') else {
        return message.to_string();
    };
    let names: Vec<&str> = expected
        .split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, s)| s)
        .collect();
    match crate::error::nearest(field, &names) {
        Some(n) => format!(
            "unknown {what} `{field}` (did you mean `{n}`?){}",
            &expected.replacen(',', ";", 1)
        ),
        None => format!(
            "unknown {what} `{field}`{}",
            &expected.replacen(',', ";", 1)
        ),
    }
}

/// 1-based line and column of a byte offset.
fn line_col(src: &str, offset: usize) -> (Option<usize>, Option<usize>) {
    let offset = offset.min(src.len());
    let before = &src[..offset];
    let line = before.matches('\n').count() + 1;
    let column = before.rfind('\n').map_or(offset, |i| offset - i - 1) + 1;
    (Some(line), Some(column))
}

/// Keys that every kind accepts; [`LayerSpec::set_keys`] leaves them out.
const COMMON_KEYS: [&str; 5] = ["kind", "name", "inputs", "trainable", "note"];

impl LayerSpec {
    /// Names of the kind-specific keys that are set (everything but `kind`, `name`, `inputs`,
    /// `trainable`, `note`), in alphabetical order. They are the keys `self` serializes to
    /// (unset keys are skipped), so a new field needs no second list.
    #[must_use]
    pub fn set_keys(&self) -> Vec<String> {
        match serde_json::to_value(self) {
            Ok(serde_json::Value::Object(map)) => map
                .into_iter()
                .map(|(k, _)| k)
                .filter(|k| !COMMON_KEYS.contains(&k.as_str()))
                .collect(),
            // A struct of plain fields always serializes to an object.
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_error_has_line_and_column() {
        let src = "[input]\nshape = [4]\n\n[[layers]]\nkind = \"linear\"\nout_feature = 3\n";
        let Err(Error::Spec(e)) = parse(src, Format::Toml) else {
            panic!("expected a spec error")
        };
        assert_eq!(e.line, Some(6));
        assert_eq!(e.column, Some(1));
        assert!(
            e.message.contains("did you mean `out_features`"),
            "{}",
            e.message
        );
    }

    #[test]
    fn unknown_kind_suggests_nearest() {
        let src = "[input]\nshape = [4]\n[[layers]]\nkind = \"lienar\"\n";
        let Err(Error::Spec(e)) = parse(src, Format::Toml) else {
            panic!("expected a spec error")
        };
        assert_eq!(e.line, Some(4));
        assert!(e.message.contains("did you mean `linear`"), "{}", e.message);
    }

    #[test]
    fn json_error_has_line_and_column() {
        let src = "{\n \"input\": {\"shape\": [4]},\n \"layers\": [{\"kind\": \"linear\", \"out_features\": \"x\"}]\n}";
        let Err(Error::Spec(e)) = parse(src, Format::Json) else {
            panic!("expected a spec error")
        };
        assert_eq!(e.line, Some(3));
        assert!(e.message.contains("expected u64"), "{}", e.message);
    }

    #[test]
    fn unknown_style_has_position_and_suggestion() {
        let src = "[input]\nshape = [4]\n[[layers]]\nkind = \"rmsnorm\"\nstyle = \"lama\"\n";
        let Err(Error::Spec(e)) = parse(src, Format::Toml) else {
            panic!("expected a spec error")
        };
        assert_eq!((e.line, e.column), (Some(5), Some(9)));
        assert!(
            e.message
                .starts_with("unknown value `lama` (did you mean `llama`?); expected one of"),
            "{}",
            e.message
        );
    }

    #[test]
    fn set_keys_are_the_serialized_keys() {
        let l = LayerSpec {
            kind: LayerKind::Conv2d,
            name: Some("c".into()),
            out_channels: Some(3),
            kernel: Some(Pair(3, 3)),
            approximate: Some(Approximate::Tanh),
            ..LayerSpec::default()
        };
        assert_eq!(l.set_keys(), ["approximate", "kernel", "out_channels"]);
    }

    #[test]
    fn empty_file_is_an_error() {
        assert!(matches!(parse("  \n", Format::Toml), Err(Error::Spec(_))));
    }

    #[test]
    fn seq_dimension_and_pairs() {
        let src = "[input]\nshape = [\"seq\"]\ndtype = \"int64\"\n[[layers]]\nkind = \"conv2d\"\nkernel = [3, 5]\nstride = 2\n";
        let spec = parse(src, Format::Toml).unwrap();
        assert_eq!(spec.input.shape, vec![DimSpec::Seq]);
        assert_eq!(spec.layers[0].kernel, Some(Pair(3, 5)));
        assert_eq!(spec.layers[0].stride, Some(Pair(2, 2)));
    }
}
