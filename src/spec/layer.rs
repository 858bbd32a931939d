//! One layer as written: [`LayerSpec`], its kind ([`LayerKind`]) and the closed sets its keys
//! take. Every kind-specific key is one optional field here; which keys a kind reads is decided
//! by its config in [`crate::graph`].

use std::fmt;
use std::ops::Deref;

use serde::{Deserialize, Serialize};

/// One layer as written. Every kind-specific key is optional here; `graph::build` checks which
/// are required or allowed for the kind and reports the layer when they are not.
///
/// The keys every layer may have (and a block's `count` and `layers`) are fields; the other
/// keys, each kind's own, live in [`LayerKeys`], read and written through `Deref` (`spec.heads`)
/// and boxed only when one of them is set, so that a layer without any (a `relu`, a
/// `dropout`) takes under 200 bytes rather than 1,288, a slot for every key of every kind.
/// The crate builds one with its `layer_spec!` macro (struct-literal syntax over both). The
/// file's schema is one flat table per layer, as before, read through one flat struct whose
/// field list is the one an unknown key is told.
#[derive(Clone, Debug, Default)]
#[allow(missing_docs)] // each key is documented per kind in the README's model-file reference
pub struct LayerSpec {
    pub kind: LayerKind,
    pub name: Option<String>,
    pub inputs: Option<Vec<String>>,
    pub trainable: Option<bool>,
    pub shares: Option<String>,
    // repeat
    pub count: Option<u64>,
    /// Where `count` comes from when it was not written as `count`: the Hugging Face config
    /// field (`num_hidden_layers`), so that errors name what the user wrote. Never read from or
    /// written to a file.
    pub count_key: Option<&'static str>,
    pub layers: Option<Vec<LayerSpec>>,
    // free-form notes
    pub note: Option<String>,
    /// The kind-specific keys, `None` when none is set.
    keys: Option<Box<LayerKeys>>,
}

impl std::ops::Deref for LayerSpec {
    type Target = LayerKeys;

    fn deref(&self) -> &LayerKeys {
        self.keys.as_deref().unwrap_or(&NO_KEYS)
    }
}

impl std::ops::DerefMut for LayerSpec {
    /// Boxes the keys on the first write.
    fn deref_mut(&mut self) -> &mut LayerKeys {
        self.keys.get_or_insert_with(Box::default)
    }
}

/// `layer_spec! { key: value, …, ..base }`: `base` (a [`LayerSpec`]) with the keys given, as a
/// struct literal with `..base` reads (the values are evaluated first, then `base`), for the
/// common fields and the kind's keys alike (`Some(..)` each, as the fields are).
macro_rules! layer_spec {
    ($($field:ident: $value:expr,)* ..$base:expr $(,)?) => {{
        #[allow(unused_parens)]
        let values = ($($value,)*);
        #[allow(unused_mut)]
        let mut spec: $crate::spec::LayerSpec = $base;
        #[allow(unused_parens)]
        let ($($field,)*) = values;
        $(spec.$field = $field;)*
        spec
    }};
}
pub(crate) use layer_spec;

/// Declares [`LayerKeys`] (every key of a kind, `Option` each), the empty set, and the flat
/// form the file is read in: the common fields of [`LayerSpec`] and these keys in one table,
/// in the order the schema lists them.
macro_rules! layer_keys {
    ($($(#[doc = $doc:literal])* $field:ident: $ty:ty,)*) => {
        /// A layer's kind-specific keys (see [`LayerSpec`]): one optional field per key.
        #[derive(Clone, Debug, Default)]
        #[allow(missing_docs)] // each key is documented per kind in the README's model-file reference
        pub struct LayerKeys {
            $($(#[doc = $doc])* pub $field: Option<$ty>,)*
        }

        /// No key set: what a layer without kind-specific keys reads.
        static NO_KEYS: LayerKeys = LayerKeys { $($field: None,)* };

        impl LayerKeys {
            /// How many keys are set.
            fn len(&self) -> usize {
                0 $(+ usize::from(self.$field.is_some()))*
            }

            /// Serializes the keys that are set, in declaration order.
            fn serialize_fields<S: serde::ser::SerializeStruct>(
                &self,
                s: &mut S,
            ) -> Result<(), S::Error> {
                $(if let Some(v) = &self.$field {
                    s.serialize_field(stringify!($field), v)?;
                })*
                Ok(())
            }
        }

        /// The keys of a layer as the file writes them, one flat table, in the schema's order:
        /// the list an unknown key is told (serde's field list).
        const FIELDS: &[&str] = &[
            "kind", "name", "inputs", "trainable", "shares", "count", "layers",
            $(stringify!($field),)* "note",
        ];

        /// One key of [`FIELDS`], by position.
        #[derive(Clone, Copy)]
        #[allow(non_camel_case_types)]
        enum Field {
            __kind, __name, __inputs, __trainable, __shares, __count, __layers,
            $($field,)* __note,
        }

        /// Every [`Field`], in [`FIELDS`]' order.
        const ALL_FIELDS: &[Field] = &[
            Field::__kind, Field::__name, Field::__inputs, Field::__trainable, Field::__shares,
            Field::__count, Field::__layers, $(Field::$field,)* Field::__note,
        ];

        impl Field {
            /// The key named `s`, if the schema has one.
            fn named(s: &str) -> Option<Field> {
                Some(match s {
                    "kind" => Field::__kind,
                    "name" => Field::__name,
                    "inputs" => Field::__inputs,
                    "trainable" => Field::__trainable,
                    "shares" => Field::__shares,
                    "count" => Field::__count,
                    "layers" => Field::__layers,
                    $(stringify!($field) => Field::$field,)*
                    "note" => Field::__note,
                    _ => return None,
                })
            }
        }

        impl LayerSpec {
            /// Reads the value of `field` from `map` into `self` (`kind` into `kind`), boxing the
            /// kind-specific keys on the first one that is set.
            fn read_field<'de, A: serde::de::MapAccess<'de>>(
                &mut self,
                kind: &mut Option<LayerKind>,
                field: Field,
                map: &mut A,
            ) -> Result<(), A::Error> {
                match field {
                    Field::__kind => *kind = Some(map.next_value()?),
                    Field::__name => self.name = map.next_value()?,
                    Field::__inputs => self.inputs = map.next_value()?,
                    Field::__trainable => self.trainable = map.next_value()?,
                    Field::__shares => self.shares = map.next_value()?,
                    Field::__count => self.count = map.next_value()?,
                    Field::__layers => self.layers = map.next_value()?,
                    $(Field::$field => {
                        let value: Option<$ty> = map.next_value()?;
                        if value.is_some() {
                            self.keys.get_or_insert_with(Box::default).$field = value;
                        }
                    })*
                    Field::__note => self.note = map.next_value()?,
                }
                Ok(())
            }
        }
    };
}

/// Reads a layer straight into a [`LayerSpec`], as serde's derive of one flat struct of every
/// key would (`deny_unknown_fields`, the same messages for an unknown, duplicate or missing
/// key), without that struct: a slot for every key of every kind, 1,300 bytes, filled and
/// copied per layer, was a third of reading 100,000 plain layers. A layer written as a list
/// (serde's positional form of a struct) is refused: `expected a table of keys, got a list`.
impl<'de> Deserialize<'de> for LayerSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;

        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = LayerSpec;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("struct LayerSpec")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<LayerSpec, A::Error> {
                let mut spec = LayerSpec::default();
                let mut kind = None;
                let mut seen = [0u64; FIELDS.len().div_ceil(64)];
                while let Some(field) = map.next_key::<Field>()? {
                    let i = field as usize;
                    let bit = 1u64 << (i % 64);
                    if seen[i / 64] & bit != 0 {
                        return Err(A::Error::duplicate_field(FIELDS[i]));
                    }
                    seen[i / 64] |= bit;
                    spec.read_field(&mut kind, field, &mut map)?;
                }
                spec.kind = kind.ok_or_else(|| A::Error::missing_field("kind"))?;
                Ok(spec)
            }
        }
        d.deserialize_struct("LayerSpec", FIELDS, V)
    }
}

/// A key of a layer's table, by name (serde's field identifier).
impl<'de> Deserialize<'de> for Field {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Field;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("field identifier")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Field, E> {
                usize::try_from(v)
                    .ok()
                    .and_then(|i| ALL_FIELDS.get(i).copied())
                    .ok_or_else(|| {
                        E::invalid_value(
                            serde::de::Unexpected::Unsigned(v),
                            &format!("field index 0 <= i < {}", FIELDS.len()).as_str(),
                        )
                    })
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Field, E> {
                Field::named(v).ok_or_else(|| E::unknown_field(v, FIELDS))
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Field, E> {
                let s = String::from_utf8_lossy(v);
                Field::named(&s).ok_or_else(|| E::unknown_field(&s, FIELDS))
            }
        }
        d.deserialize_identifier(V)
    }
}

impl Serialize for LayerSpec {
    /// One flat table, the keys that are set in the schema's order.
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let keys = self.deref();
        let common = [
            self.name.is_some(),
            self.inputs.is_some(),
            self.trainable.is_some(),
            self.shares.is_some(),
            self.count.is_some(),
            self.layers.is_some(),
            self.note.is_some(),
        ];
        // serde_json closes a struct of length 0 at once: the length is the keys written.
        let len = 1 + common.iter().filter(|&&set| set).count() + keys.len();
        let mut st = s.serialize_struct("LayerSpec", len)?;
        st.serialize_field("kind", &self.kind)?;
        macro_rules! opt {
            ($($field:ident),*) => {
                $(if let Some(v) = &self.$field {
                    st.serialize_field(stringify!($field), v)?;
                })*
            };
        }
        opt!(name, inputs, trainable, shares, count, layers);
        keys.serialize_fields(&mut st)?;
        opt!(note);
        st.end()
    }
}

layer_keys! {
    // linear / embeddings
    in_features: u64,
    out_features: u64,
    bias: bool,
    tie: String,
    quantize: bool,
    num_embeddings: u64,
    embedding_dim: u64,
    num_positions: u64,
    ids_buffer: u64,
    ids_per_batch: bool,
    mask_buffer: u64,
    model_locals: bool,
    // conv / pooling
    in_channels: u64,
    out_channels: u64,
    kernel: Sizes,
    stride: Sizes,
    padding: Sizes,
    output_padding: Sizes,
    dilation: Sizes,
    groups: u64,
    output_size: Pair,
    ceil_mode: bool,
    // upsample / pad
    mode: FillMode,
    scale_factor: f64,
    size: Pair,
    align_corners: bool,
    pad: Vec<u64>,
    value: f64,
    // einsum
    equation: String,
    // recurrent layers (lstm, gru)
    input_size: u64,
    hidden_size: u64,
    num_layers: u64,
    bidirectional: bool,
    batch_first: bool,
    proj_size: u64,
    // norms
    num_features: u64,
    num_groups: u64,
    affine: bool,
    track_running_stats: bool,
    // activations / dropout
    inplace: bool,
    keep_inputs: bool,
    approximate: Approximate,
    p: f64,
    // shape ops
    dim: i64,
    start_dim: i64,
    end_dim: i64,
    shape: Vec<i64>,
    dims: Vec<i64>,
    index: i64,
    start: i64,
    /// Narrow: the exclusive end (negative counts from the end: `x[:, :-n]`), instead of
    /// `length`.
    end: i64,
    length: u64,
    // free parameter
    combine: CombineKind,
    /// Parameter: a float buffer of this shape (no gradient) from which `shape` is cropped
    /// (diffusers' `PatchEmbed.cropped_pos_embed`).
    buffer: Vec<i64>,
    // norms and attention
    style: Style,
    kv_cache: bool,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    causal: bool,
    fused_qkv: bool,
    /// Attention: the heads are computed per image chunk and the outputs joined with
    /// `torch.cat` (Qwen2-VL's vision attention), so merging the heads is a copy whatever the
    /// kernel's output layout.
    chunked: bool,
    out_bias: bool,
    /// Attention: a bias on the K projection (default: `bias`; Whisper's `k_proj` has none).
    k_bias: bool,
    /// Attention: the Q projection is multiplied by `head_dim^-0.5` into a new tensor before
    /// the heads are split (Whisper's `q_proj(x) * scaling`).
    scale_query: bool,
    /// Attention: Q, K and V are copied to contiguous `[B, heads, S, head_dim]` tensors before
    /// attention (Whisper's `.transpose(1, 2).contiguous()`).
    contiguous_heads: bool,
    rotary: bool,
    dropout: f64,
    // mixture of experts
    experts: u64,
    top_k: u64,
    intermediate_size: u64,
    shared_intermediate_size: u64,
    shared_gate: bool,
    normalize_topk: bool,
    /// Which router picks the experts: `"softmax"` (the default) or DeepSeek's
    /// group-limited ones, `"deepseek_v2"` and `"deepseek_v3"`.
    router: Router,
    topk_groups: u64,
    /// Mixture of experts: the experts have biases (`gate_up_proj_bias`, `down_proj_bias`,
    /// GPT-OSS), gathered per routed row and added to the grouped products.
    expert_bias: bool,
    /// Mixture of experts: GPT-OSS's clamped SwiGLU with this limit (`swiglu_limit`), on
    /// interleaved gate and up columns.
    swiglu_limit: f64,
    // multi-head latent attention
    q_lora_rank: u64,
    kv_lora_rank: u64,
    qk_nope_head_dim: u64,
    qk_rope_head_dim: u64,
    v_head_dim: u64,
    // attention extras
    qk_norm: bool,
    /// Where `qk_norm` normalizes: `"head"` (per head over `head_dim`, Qwen3; the default) or
    /// `"projection"` (over the whole `heads·head_dim` projection, OLMo-2).
    qk_norm_scope: QkNormScope,
    qk_norm_style: Style,
    softmax_f32: bool,
    bool_mask: bool,
    expand_kv: bool,
    softcap: f64,
    /// Attention: a learned sink logit per head joins the eager scores (GPT-OSS's `sinks`).
    sinks: bool,
    position_bias: bool,
    num_buckets: u64,
    sliding_window: u64,
    // disentangled attention (DeBERTa-v2)
    /// Disentangled attention: content-to-position scores (`pos_att_type` has `c2p`).
    c2p: bool,
    /// Disentangled attention: position-to-content scores (`pos_att_type` has `p2c`).
    p2c: bool,
    /// Disentangled attention: the relative embeddings are projected by the query and key
    /// projections (`share_att_key`) instead of their own `pos_query_proj`/`pos_key_proj`.
    share_att_key: bool,
    /// Disentangled attention: dropout on the relative embeddings (`pos_dropout`).
    pos_dropout: f64,
    /// Relative embeddings: a LayerNorm on the table (`norm_rel_ebd = "layer_norm"`).
    norm: bool,
    /// Padding mask: `masked_fill_` of the padded positions in place instead of the product.
    fill: bool,
    // rotary
    concat: bool,
    /// The rotary `cos`/`sin` tables stay float32 (OLMo-2's rotary embedding does not cast them
    /// to the activation dtype): Q and K are rotated in float32 and cast back.
    tables_f32: bool,
    /// Rotary: the `cos`/`sin` tables are `[batch, S, head_dim]`, one row of positions per
    /// sample (Qwen2-VL's M-RoPE and its vision tower), instead of `[1, S, head_dim]`.
    per_sample: bool,
    local: bool,
    /// Rotary: the `cos`/`sin` tables are `head_dim/2` wide and each half of a head is rotated
    /// against them, the halves joined with `torch.cat` (GPT-OSS's `_apply_rotary_emb`).
    half_tables: bool,
    /// Rotary: positions past the input's sequence that the tables also cover (Flux's image
    /// tokens after the text).
    extra_positions: u64,
    /// Rotary: whether the module registers transformers' `inv_freq` buffers.
    inv_freq: bool,
    /// Rotary: Q and K are each joined with their pass-through part right after their own
    /// rotation (Phi-3's `apply_rotary_pos_emb`), not after both are rotated (`concat`).
    concat_each: bool,
    /// Rotary: each head's pairs are interleaved and rotated by diffusers' `apply_rotary_emb`
    /// (Flux).
    interleaved: bool,
    // scale
    factor: f64,
    /// Scale: a constant added after the factor (`1 + t`).
    offset: f64,
    // loss
    shift: bool,
    upcast: bool,
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
        if self.keys.is_none() && self.count.is_none() && self.layers.is_none() {
            return Vec::new();
        }
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
        let l = layer_spec! {
            kind: LayerKind::Conv2d,
            name: Some("c".into()),
            out_channels: Some(3),
            kernel: Some(Pair(3, 3).into()),
            approximate: Some(Approximate::Tanh),
            ..LayerSpec::default()
        };
        assert_eq!(l.set_keys(), ["approximate", "kernel", "out_channels"]);
    }

    #[test]
    fn kind_keys_are_boxed_only_when_set() {
        // The common fields and one pointer: 100,000 plain layers take 17 MB, not 129 MB.
        assert!(std::mem::size_of::<LayerSpec>() <= 200);
        let doc = r#"[{"kind": "relu"}, {"kind": "linear", "out_features": 3, "note": "x"}]"#;
        let layers: Vec<LayerSpec> = serde_json::from_str(doc).unwrap();
        assert!(layers[0].keys.is_none());
        assert_eq!(layers[0].out_features, None);
        assert!(layers[0].set_keys().is_empty());
        assert_eq!(layers[1].out_features, Some(3));
        // Written back flat, in the schema's order.
        assert_eq!(
            serde_json::to_string(&layers).unwrap(),
            r#"[{"kind":"relu"},{"kind":"linear","out_features":3,"note":"x"}]"#
        );
        let mut l = layer_spec! { name: Some("a".into()), heads: Some(2), ..LayerSpec::default() };
        l.bias = Some(true);
        assert_eq!(
            (l.name.as_deref(), l.heads, l.bias),
            (Some("a"), Some(2), Some(true))
        );
    }
}
