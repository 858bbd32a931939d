//! One layer as written: [`LayerSpec`], its kind ([`LayerKind`]) and the closed sets its keys
//! take. Every kind-specific key is one optional field here; which keys a kind reads is decided
//! by its config in [`crate::graph`].

use std::fmt;

use serde::{Deserialize, Serialize};

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
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shares: Option<String>,
    // repeat
    #[serde(skip_serializing_if = "Option::is_none")]
    pub count: Option<u64>,
    /// Where `count` comes from when it was not written as `count`: the Hugging Face config
    /// field (`num_hidden_layers`), so that errors name what the user wrote. Never read from or
    /// written to a file.
    #[serde(skip)]
    pub count_key: Option<&'static str>,
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
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ids_per_batch: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mask_buffer: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_locals: Option<bool>,
    // conv / pooling
    #[serde(skip_serializing_if = "Option::is_none")]
    pub in_channels: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub out_channels: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel: Option<Sizes>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stride: Option<Sizes>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub padding: Option<Sizes>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_padding: Option<Sizes>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dilation: Option<Sizes>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub groups: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_size: Option<Pair>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ceil_mode: Option<bool>,
    // upsample / pad
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<FillMode>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scale_factor: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub size: Option<Pair>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub align_corners: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pad: Option<Vec<u64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<f64>,
    // einsum
    #[serde(skip_serializing_if = "Option::is_none")]
    pub equation: Option<String>,
    // recurrent layers (lstm, gru)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input_size: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hidden_size: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_layers: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bidirectional: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_first: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub proj_size: Option<u64>,
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
    pub keep_inputs: Option<bool>,
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
    pub start: Option<i64>,
    /// Narrow: the exclusive end (negative counts from the end: `x[:, :-n]`), instead of
    /// `length`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub end: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub length: Option<u64>,
    // free parameter
    #[serde(skip_serializing_if = "Option::is_none")]
    pub combine: Option<CombineKind>,
    /// Parameter: a float buffer of this shape (no gradient) from which `shape` is cropped
    /// (diffusers' `PatchEmbed.cropped_pos_embed`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub buffer: Option<Vec<i64>>,
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
    /// Attention: the heads are computed per image chunk and the outputs joined with
    /// `torch.cat` (Qwen2-VL's vision attention), so merging the heads is a copy whatever the
    /// kernel's output layout.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chunked: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub out_bias: Option<bool>,
    /// Attention: a bias on the K projection (default: `bias`; Whisper's `k_proj` has none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub k_bias: Option<bool>,
    /// Attention: the Q projection is multiplied by `head_dim^-0.5` into a new tensor before
    /// the heads are split (Whisper's `q_proj(x) * scaling`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scale_query: Option<bool>,
    /// Attention: Q, K and V are copied to contiguous `[B, heads, S, head_dim]` tensors before
    /// attention (Whisper's `.transpose(1, 2).contiguous()`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub contiguous_heads: Option<bool>,
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
    /// Which router picks the experts: `"softmax"` (the default) or DeepSeek's
    /// group-limited ones, `"deepseek_v2"` and `"deepseek_v3"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub router: Option<Router>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topk_groups: Option<u64>,
    /// Mixture of experts: the experts have biases (`gate_up_proj_bias`, `down_proj_bias`,
    /// GPT-OSS), gathered per routed row and added to the grouped products.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_bias: Option<bool>,
    /// Mixture of experts: GPT-OSS's clamped SwiGLU with this limit (`swiglu_limit`), on
    /// interleaved gate and up columns.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub swiglu_limit: Option<f64>,
    // multi-head latent attention
    #[serde(skip_serializing_if = "Option::is_none")]
    pub q_lora_rank: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_lora_rank: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qk_nope_head_dim: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qk_rope_head_dim: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub v_head_dim: Option<u64>,
    // attention extras
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qk_norm: Option<bool>,
    /// Where `qk_norm` normalizes: `"head"` (per head over `head_dim`, Qwen3; the default) or
    /// `"projection"` (over the whole `heads·head_dim` projection, OLMo-2).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qk_norm_scope: Option<QkNormScope>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qk_norm_style: Option<Style>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub softmax_f32: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bool_mask: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expand_kv: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub softcap: Option<f64>,
    /// Attention: a learned sink logit per head joins the eager scores (GPT-OSS's `sinks`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sinks: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub position_bias: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_buckets: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<u64>,
    // disentangled attention (DeBERTa-v2)
    /// Disentangled attention: content-to-position scores (`pos_att_type` has `c2p`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub c2p: Option<bool>,
    /// Disentangled attention: position-to-content scores (`pos_att_type` has `p2c`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p2c: Option<bool>,
    /// Disentangled attention: the relative embeddings are projected by the query and key
    /// projections (`share_att_key`) instead of their own `pos_query_proj`/`pos_key_proj`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub share_att_key: Option<bool>,
    /// Disentangled attention: dropout on the relative embeddings (`pos_dropout`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pos_dropout: Option<f64>,
    /// Relative embeddings: a LayerNorm on the table (`norm_rel_ebd = "layer_norm"`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub norm: Option<bool>,
    /// Padding mask: `masked_fill_` of the padded positions in place instead of the product.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fill: Option<bool>,
    // rotary
    #[serde(skip_serializing_if = "Option::is_none")]
    pub concat: Option<bool>,
    /// The rotary `cos`/`sin` tables stay float32 (OLMo-2's rotary embedding does not cast them
    /// to the activation dtype): Q and K are rotated in float32 and cast back.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tables_f32: Option<bool>,
    /// Rotary: the `cos`/`sin` tables are `[batch, S, head_dim]`, one row of positions per
    /// sample (Qwen2-VL's M-RoPE and its vision tower), instead of `[1, S, head_dim]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per_sample: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local: Option<bool>,
    /// Rotary: the `cos`/`sin` tables are `head_dim/2` wide and each half of a head is rotated
    /// against them, the halves joined with `torch.cat` (GPT-OSS's `_apply_rotary_emb`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub half_tables: Option<bool>,
    /// Rotary: positions past the input's sequence that the tables also cover (Flux's image
    /// tokens after the text).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub extra_positions: Option<u64>,
    /// Rotary: whether the module registers transformers' `inv_freq` buffers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inv_freq: Option<bool>,
    /// Rotary: Q and K are each joined with their pass-through part right after their own
    /// rotation (Phi-3's `apply_rotary_pos_emb`), not after both are rotated (`concat`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub concat_each: Option<bool>,
    /// Rotary: each head's pairs are interleaved and rotated by diffusers' `apply_rotary_emb`
    /// (Flux).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interleaved: Option<bool>,
    // scale
    #[serde(skip_serializing_if = "Option::is_none")]
    pub factor: Option<f64>,
    /// Scale: a constant added after the factor (`1 + t`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offset: Option<f64>,
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

/// A window size of a convolution or pooling key (`kernel`, `stride`, `padding`,
/// `output_padding`, `dilation`): one number for every spatial dimension, or one per dimension,
/// outermost first (`[h, w]`, or `[d, h, w]` for the 3-D kinds).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sizes(pub Vec<u64>);

impl From<Pair> for Sizes {
    fn from(p: Pair) -> Self {
        if p.0 == p.1 {
            Sizes(vec![p.0])
        } else {
            Sizes(vec![p.0, p.1])
        }
    }
}

impl Serialize for Sizes {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0.as_slice() {
            [one] => s.serialize_u64(*one),
            many => many.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Sizes {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            One(u64),
            Many(Vec<u64>),
        }
        let bad = || {
            serde::de::Error::custom(
                "expected a non-negative integer, a pair [h, w] or a triple [d, h, w]",
            )
        };
        match Raw::deserialize(d).map_err(|_| bad())? {
            Raw::One(v) => Ok(Sizes(vec![v])),
            Raw::Many(v) if (2..=3).contains(&v.len()) => Ok(Sizes(v)),
            Raw::Many(_) => Err(bad()),
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

/// The `mode` key: how `upsample` fills its output (`nearest`, `linear`, `bilinear`, as
/// `F.interpolate`'s `mode`) or how `pad` fills the border (`constant`, `reflect`, `replicate`,
/// `circular`, as `F.pad`'s `mode`). Each kind accepts its own modes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FillMode {
    /// `upsample`: copy the nearest input element (`upsample_nearest1d/2d`).
    Nearest,
    /// `upsample` of a `[B, C, L]` input: linear interpolation (`upsample_linear1d`).
    Linear,
    /// `upsample` of a `[B, C, H, W]` input: bilinear interpolation (`upsample_bilinear2d`).
    Bilinear,
    /// `pad`: a constant border (`constant_pad_nd`).
    Constant,
    /// `pad`: the input mirrored at its edge, edge excluded (`reflection_pad1d/2d/3d`).
    Reflect,
    /// `pad`: the edge element repeated (`replication_pad1d/2d/3d`).
    Replicate,
    /// `pad`: the input wrapped around (`F.pad`'s `_pad_circular`).
    Circular,
}

impl FillMode {
    /// The name used in files.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            FillMode::Nearest => "nearest",
            FillMode::Linear => "linear",
            FillMode::Bilinear => "bilinear",
            FillMode::Constant => "constant",
            FillMode::Reflect => "reflect",
            FillMode::Replicate => "replicate",
            FillMode::Circular => "circular",
        }
    }
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
    /// Held by the module but not read by this forward (DINOv2's `mask_token`, read only for
    /// masked image modelling): counted in the parameters, no gradient and so no optimizer
    /// state; the input passes through unchanged.
    Unused,
}

/// The `style` key: which implementation a layer follows. `rmsnorm` takes `llama` (default),
/// `t5`, `gemma` or `olmo2`; `layernorm` takes `cohere`; `attention` takes `transformers`
/// (default) or `torch`.
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
    /// `CohereLayerNorm` (a `layernorm` written out in float32, weight only).
    Cohere,
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
            Style::Cohere => "cohere",
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

/// `router`: how a `moe` layer picks its experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Router {
    /// A float32 softmax over the router logits, then top-k (Mixtral, Qwen-MoE; the default).
    Softmax,
    /// DeepSeek-V2's `DeepseekV2TopkRouter`: float32 logits from float32 copies of the input
    /// and weight, softmax, and with `groups > 1` the best `topk_groups` groups by their
    /// maximum (`group_limited_greedy`) before the top-k; weights times a scale.
    DeepseekV2,
    /// DeepSeek-V3's `DeepseekV3TopkRouter`: float32 logits as V2, sigmoid, a correction bias
    /// (a buffer), the best `topk_groups` groups by their two best scores, the top-k gathered
    /// from the sigmoid scores, renormalized and scaled.
    DeepseekV3,
    /// GPT-OSS's `GptOssTopKRouter`: logits with a bias `[experts]` in the activation dtype,
    /// top-k of the logits, then a softmax over the k chosen (activation dtype, already summing
    /// to one: `normalize_topk` is not read).
    GptOss,
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
    Conv3d => "conv3d",
    ConvTranspose1d => "conv_transpose1d" | "convtranspose1d",
    ConvTranspose2d => "conv_transpose2d" | "convtranspose2d",
    ConvTranspose3d => "conv_transpose3d" | "convtranspose3d",
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
    BloomGelu => "bloom_gelu",
    Silu => "silu" | "swish",
    Tanh => "tanh",
    Sigmoid => "sigmoid",
    Softmax => "softmax",
    Mul => "mul",
    Add => "add",
    Concat => "concat" | "cat",
    MaskedScatter => "masked_scatter",
    MaxPool2d => "maxpool2d" | "max_pool2d",
    AvgPool2d => "avgpool2d" | "avg_pool2d",
    AdaptiveAvgPool2d => "adaptive_avgpool2d" | "adaptive_avg_pool2d",
    Upsample => "upsample" | "interpolate",
    Pad => "pad",
    Flatten => "flatten",
    Reshape => "reshape" | "view",
    Transpose => "transpose",
    Permute => "permute",
    Narrow => "narrow" | "slice",
    Select => "select",
    Attention => "attention" | "self_attention" | "multihead_attention",
    CrossAttention => "cross_attention",
    RelativePositionBias => "relative_position_bias",
    RelativeEmbeddings => "relative_embeddings",
    DisentangledAttention => "disentangled_attention",
    PaddingMask => "padding_mask",
    Moe => "moe" | "mixture_of_experts",
    Mla => "mla" | "latent_attention",
    Lstm => "lstm",
    Gru => "gru",
    Einsum => "einsum",
    Sdpa => "sdpa" | "scaled_dot_product_attention",
    StochasticDepth => "stochastic_depth",
    ShiftRight => "shift_right",
    Scale => "scale",
    CrossEntropy => "cross_entropy" | "cross_entropy_loss",
    MseLoss => "mse_loss",
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
        LayerKind::parse_name(&s).ok_or_else(|| serde::de::Error::custom(unknown_kind(&s)))
    }
}

impl LayerKind {
    /// The kind a file's `kind` value names (its canonical name or an alias, in any case:
    /// `Linear` is `linear`, as flags and closed-set values read them).
    #[must_use]
    pub fn parse_name(s: &str) -> Option<LayerKind> {
        LayerKind::from_name(s).or_else(|| LayerKind::from_name(&s.to_ascii_lowercase()))
    }
}

/// The message for a `kind` value that names no layer kind: a suggestion when one is close, and
/// the kinds.
pub(crate) fn unknown_kind(s: &str) -> String {
    let names: Vec<&str> = LayerKind::ALL.iter().map(|k| k.as_str()).collect();
    let hint = crate::error::nearest(s, &names)
        .map(|n| format!(" (did you mean `{n}`?)"))
        .unwrap_or_default();
    format!(
        "unknown layer kind `{s}`{hint}; expected one of {}",
        names.join(", ")
    )
}

#[allow(clippy::derivable_impls)] // the enum comes from a macro
impl Default for LayerKind {
    fn default() -> Self {
        LayerKind::Linear
    }
}

/// Keys that every kind accepts; [`LayerSpec::set_keys`] leaves them out.
const COMMON_KEYS: [&str; 6] = ["kind", "name", "inputs", "trainable", "shares", "note"];

impl LayerSpec {
    /// Names of the kind-specific keys that are set (everything but `kind`, `name`, `inputs`,
    /// `trainable`, `shares`, `note`), in alphabetical order. They are the keys `self` serializes to
    /// (unset keys are skipped), so a new field needs no second list.
    #[must_use]
    pub fn set_keys(&self) -> Vec<&'static str> {
        let mut names = KeyNames(Vec::new());
        // Only a struct serializes into `KeyNames`, and `LayerSpec` is one: this cannot fail.
        let _ = self.serialize(&mut names);
        let mut keys = names.0;
        keys.retain(|k| !COMMON_KEYS.contains(k));
        keys.sort_unstable();
        keys
    }
}

/// Collects the names of the fields a struct serializes (serde's derive skips the unset ones,
/// `skip_serializing_if`) without serializing their values: [`LayerSpec::set_keys`] runs for
/// every layer, so it allocates one small list and nothing else.
struct KeyNames(Vec<&'static str>);

impl serde::ser::SerializeStruct for &mut KeyNames {
    type Ok = ();
    type Error = fmt::Error;

    fn serialize_field<T: ?Sized + Serialize>(
        &mut self,
        key: &'static str,
        _: &T,
    ) -> Result<(), fmt::Error> {
        self.0.push(key);
        Ok(())
    }

    fn end(self) -> Result<(), fmt::Error> {
        Ok(())
    }
}

/// Every serializer method but `serialize_struct` refuses: `KeyNames` only reads a struct's
/// field names.
macro_rules! refuse {
    ($($name:ident($($t:ty),*) -> $ret:ty;)*) => {
        $(fn $name(self $(, _: $t)*) -> Result<$ret, fmt::Error> { Err(fmt::Error) })*
    };
}

impl serde::Serializer for &mut KeyNames {
    type Ok = ();
    type Error = fmt::Error;
    type SerializeSeq = serde::ser::Impossible<(), fmt::Error>;
    type SerializeTuple = serde::ser::Impossible<(), fmt::Error>;
    type SerializeTupleStruct = serde::ser::Impossible<(), fmt::Error>;
    type SerializeTupleVariant = serde::ser::Impossible<(), fmt::Error>;
    type SerializeMap = serde::ser::Impossible<(), fmt::Error>;
    type SerializeStruct = Self;
    type SerializeStructVariant = serde::ser::Impossible<(), fmt::Error>;

    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Self, fmt::Error> {
        Ok(self)
    }

    refuse! {
        serialize_bool(bool) -> ();
        serialize_i8(i8) -> ();
        serialize_i16(i16) -> ();
        serialize_i32(i32) -> ();
        serialize_i64(i64) -> ();
        serialize_u8(u8) -> ();
        serialize_u16(u16) -> ();
        serialize_u32(u32) -> ();
        serialize_u64(u64) -> ();
        serialize_f32(f32) -> ();
        serialize_f64(f64) -> ();
        serialize_char(char) -> ();
        serialize_str(&str) -> ();
        serialize_bytes(&[u8]) -> ();
        serialize_none() -> ();
        serialize_unit() -> ();
        serialize_unit_struct(&'static str) -> ();
        serialize_unit_variant(&'static str, u32, &'static str) -> ();
        serialize_seq(Option<usize>) -> Self::SerializeSeq;
        serialize_tuple(usize) -> Self::SerializeTuple;
        serialize_tuple_struct(&'static str, usize) -> Self::SerializeTupleStruct;
        serialize_tuple_variant(&'static str, u32, &'static str, usize) -> Self::SerializeTupleVariant;
        serialize_map(Option<usize>) -> Self::SerializeMap;
        serialize_struct_variant(&'static str, u32, &'static str, usize) -> Self::SerializeStructVariant;
    }

    fn serialize_some<T: ?Sized + Serialize>(self, _: &T) -> Result<(), fmt::Error> {
        Err(fmt::Error)
    }

    fn serialize_newtype_struct<T: ?Sized + Serialize>(
        self,
        _: &'static str,
        _: &T,
    ) -> Result<(), fmt::Error> {
        Err(fmt::Error)
    }

    fn serialize_newtype_variant<T: ?Sized + Serialize>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: &T,
    ) -> Result<(), fmt::Error> {
        Err(fmt::Error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_keys_are_the_serialized_keys() {
        let l = LayerSpec {
            kind: LayerKind::Conv2d,
            name: Some("c".into()),
            out_channels: Some(3),
            kernel: Some(Pair(3, 3).into()),
            approximate: Some(Approximate::Tanh),
            ..LayerSpec::default()
        };
        assert_eq!(l.set_keys(), ["approximate", "kernel", "out_channels"]);
    }
}
