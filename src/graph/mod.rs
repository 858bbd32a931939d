//! The resolved model: typed layer operations with validated keys and resolved inputs.
//!
//! [`build`] turns the raw [`ModelSpec`] into a [`Model`]. Everything a file can get wrong that
//! does not depend on the batch or sequence length is reported here, naming the layer; shape
//! checks happen when the model is traced with concrete settings ([`crate::trace`]).
//!
//! Each layer kind is declared once: a config struct in this module's family files (`linear`,
//! `conv`, `einsum`, `norm`, `embed`, `view`, `pool`, `resize`, `rnn`, `pointwise`, `attention`), which documents the kind,
//! reads its keys through a `KeyReader` (`keys`) (so the keys it reads are the keys it accepts)
//! and is what [`Op`] carries to the tracer.

mod attention;
mod conv;
mod einsum;
mod embed;
pub(crate) mod keys;
mod linear;
mod norm;
mod pointwise;
mod pool;
mod resize;
mod rnn;
mod view;

use std::collections::{HashMap, HashSet};

pub use attention::{
    AttentionCfg, AttnStyle, DisentangledAttentionCfg, MlaCfg, MoeCfg, QkNorm, SdpaCfg,
};
pub use conv::{ConvAxis, ConvCfg};
pub use einsum::{EinsumCfg, Subscript};
pub use embed::{
    EmbeddingCfg, PositionEmbeddingCfg, RelativeEmbeddingsCfg, RelativePositionBiasCfg, RotaryCfg,
    TokenTypeEmbeddingCfg,
};
pub use linear::LinearCfg;
pub use norm::{BatchNormCfg, GroupNormCfg, LayerNormCfg, RmsNormCfg, RmsStyle};
pub use pointwise::{
    Activation, AddCfg, Combine, ConcatCfg, CrossEntropyCfg, DropoutCfg, MseLossCfg,
    PaddingMaskCfg, ParameterCfg, ScaleCfg, SoftmaxCfg, StochasticDepthCfg,
};
pub use pool::{AdaptiveAvgPool2dCfg, AvgPool2dCfg, MaxPool2dCfg};
pub use resize::{PadCfg, UpsampleCfg, UpsampleTo};
pub use rnn::{RnnCell, RnnCfg};
pub use view::{FlattenCfg, NarrowCfg, PermuteCfg, ReshapeCfg, SelectCfg, TransposeCfg};

use crate::dtype::DType;
use crate::error::{Error, LayerAt, LayerErrorKind};
use crate::spec::{DefaultsSpec, DimSpec, LayerKind, LayerSpec, ModelSpec, layer_spec};
use keys::KeyReader;

/// A validated model.
#[derive(Clone, Debug)]
pub struct Model {
    /// Display name.
    pub name: String,
    /// Input dimensions after the batch.
    pub input_dims: Vec<DimSpec>,
    /// Input dtype when given (an integer type means token ids).
    pub input_dtype: Option<DType>,
    /// The further named inputs (`ModelSpec::inputs`), in name order: name, dimensions after
    /// the batch, dtype.
    pub extra_inputs: Vec<(String, Vec<DimSpec>, Option<DType>)>,
    /// The file's defaults for the run settings.
    pub defaults: DefaultsSpec,
    /// Top-level layers in forward order.
    pub layers: Vec<Layer>,
}

/// One layer: an operation or a repeated block.
#[derive(Clone, Debug)]
pub struct Layer {
    /// The layer's name (given, or `<kind><index>`).
    pub name: String,
    /// Where it is: its positions through blocks and its label, e.g. `layer #3 "fc2" (linear)`,
    /// used in errors.
    pub label: LayerAt,
    /// The kind as written.
    pub kind: LayerKind,
    /// Where the layer's inputs come from.
    pub inputs: Vec<InputRef>,
    /// Whether its parameters train (`trainable = false` freezes them).
    pub trainable: bool,
    /// `shares = "name"`: the earlier layer (same kind and config, checked) whose parameters
    /// this one uses instead of its own, as a module called twice in a PyTorch `forward` does.
    /// Looked up like `inputs`, innermost block first.
    pub shares: Option<String>,
    /// What it computes.
    pub node: Node,
}

/// Where an input comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InputRef {
    /// The previous layer's output (or the block's input for the first layer of a block).
    Previous,
    /// A named earlier layer, or `input` for the block's (or model's) input.
    Named(String),
}

/// A layer's computation.
#[derive(Clone, Debug)]
pub enum Node {
    /// A single operation.
    Op(Op),
    /// `count` copies of `body` applied in sequence, each with its own parameters. With more
    /// than one copy, the body's output must have its input's shape and dtype.
    Repeat {
        /// Number of copies.
        count: u64,
        /// The number of copies the file asks for: `count` as built. `symbolic` traces a block
        /// with a few copies (it changes `count`), while the tracer's operator limit
        /// ([`crate::trace::MAX_STEPS`]) counts the copies the file asks for, nested counts
        /// multiplied.
        written: u64,
        /// The key `count` was read from, for errors: `count`, or the Hugging Face config field
        /// it was translated from (`num_hidden_layers`).
        count_key: &'static str,
        /// The layers of one copy.
        body: Vec<Layer>,
    },
}

/// One operation: a layer kind with its config. Shapes use `B` for the batch; parameters are
/// counted per instance. Each config documents its kind.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// `linear`.
    Linear(LinearCfg),
    /// `conv1d`, `conv2d`, `conv3d`, `conv_transpose1d`, `conv_transpose2d`,
    /// `conv_transpose3d`.
    Conv(ConvCfg),
    /// `batchnorm1d`, `batchnorm2d`.
    BatchNorm(BatchNormCfg),
    /// `layernorm`.
    LayerNorm(LayerNormCfg),
    /// `rmsnorm`.
    RmsNorm(RmsNormCfg),
    /// `groupnorm`.
    GroupNorm(GroupNormCfg),
    /// `embedding`.
    Embedding(EmbeddingCfg),
    /// `position_embedding`.
    PositionEmbedding(PositionEmbeddingCfg),
    /// `token_type_embedding`.
    TokenTypeEmbedding(TokenTypeEmbeddingCfg),
    /// `rotary`.
    Rotary(RotaryCfg),
    /// `parameter`.
    Parameter(ParameterCfg),
    /// `dropout`.
    Dropout(DropoutCfg),
    /// An activation function (shape preserved).
    Activation(Activation),
    /// `softmax`.
    Softmax(SoftmaxCfg),
    /// Elementwise product of two inputs (gated MLPs): keeps each factor for the other's
    /// gradient.
    Mul,
    /// `add`.
    Add(AddCfg),
    /// `inputs_embeds.masked_scatter(input_ids == image_token_id, image_features)` (LLaVA,
    /// Qwen2-VL): three inputs, the token ids `[batch, seq]`, the text embeddings
    /// `[batch, seq, hidden]` and the image features `[batch, tokens, hidden]`; the output has
    /// the embeddings' shape, the image's rows written over the first `tokens` positions of each
    /// sample. Keeps the `[batch, seq]` bool mask for backward (`derivatives.yaml`:
    /// `grad.masked_fill(mask, 0)`, `masked_scatter_backward(grad, mask, ..)`).
    MaskedScatter,
    /// `concat`.
    Concat(ConcatCfg),
    /// `maxpool2d`.
    MaxPool2d(MaxPool2dCfg),
    /// `avgpool2d`.
    AvgPool2d(AvgPool2dCfg),
    /// `adaptive_avgpool2d`.
    AdaptiveAvgPool2d(AdaptiveAvgPool2dCfg),
    /// `upsample`.
    Upsample(UpsampleCfg),
    /// `pad`.
    Pad(PadCfg),
    /// `flatten`.
    Flatten(FlattenCfg),
    /// `reshape`.
    Reshape(ReshapeCfg),
    /// `transpose`.
    Transpose(TransposeCfg),
    /// `permute`.
    Permute(PermuteCfg),
    /// `narrow`.
    Narrow(NarrowCfg),
    /// `select`.
    Select(SelectCfg),
    /// `attention` (self-attention).
    Attention(AttentionCfg),
    /// `cross_attention`: two inputs, the queries' source and the encoder output.
    CrossAttention(AttentionCfg),
    /// `relative_position_bias`.
    RelativePositionBias(RelativePositionBiasCfg),
    /// `relative_embeddings` (DeBERTa-v2's encoder-level relative positions).
    RelativeEmbeddings(RelativeEmbeddingsCfg),
    /// `disentangled_attention` (DeBERTa-v2).
    DisentangledAttention(DisentangledAttentionCfg),
    /// `padding_mask` (DeBERTa-v2's embeddings times the all-ones mask).
    PaddingMask(PaddingMaskCfg),
    /// `moe`.
    Moe(MoeCfg),
    /// `mla` (multi-head latent attention).
    Mla(MlaCfg),
    /// `lstm`, `gru`.
    Rnn(RnnCfg),
    /// `einsum` of two inputs.
    Einsum(EinsumCfg),
    /// `sdpa` of three inputs.
    Sdpa(SdpaCfg),
    /// `stochastic_depth`.
    StochasticDepth(StochasticDepthCfg),
    /// T5's `_shift_right` of the labels: a new int64 tensor of the input's shape (the
    /// decoder's input ids).
    ShiftRight,
    /// `scale`.
    Scale(ScaleCfg),
    /// `cross_entropy`.
    CrossEntropy(CrossEntropyCfg),
    /// `mse_loss`.
    MseLoss(MseLossCfg),
}

/// Reserved name for the input of the model or of the enclosing block.
pub const INPUT: &str = "input";

/// Validates a parsed description and resolves it into a [`Model`].
///
/// # Errors
/// [`Error::Layer`] naming the first layer with a missing, inapplicable or invalid key, a
/// duplicate name, or an input that names no earlier layer.
pub fn build(spec: &ModelSpec, default_name: &str) -> Result<Model, Error> {
    if spec.input.shape.is_empty() {
        return Err(Error::Model(
            "input.shape is empty: give the per-sample shape, e.g. [3, 224, 224] or [\"seq\"]"
                .into(),
        ));
    }
    for d in &spec.input.shape {
        if *d == DimSpec::Fixed(0) {
            return Err(Error::Model(
                "input.shape has a zero dimension: every dimension must be positive".into(),
            ));
        }
    }
    if spec.hidden_size == Some(0) {
        return Err(Error::Model(
            "hidden_size is 0: give the model's hidden size (it sizes DeepSpeed's \"auto\" buckets), or leave it out".into(),
        ));
    }
    for (name, input) in &spec.inputs {
        if name == INPUT || name.is_empty() {
            return Err(Error::Model(format!(
                "inputs.{name:?}: the name `{INPUT}` is the first input's (`[input]`); name the others differently"
            )));
        }
        if input.shape.is_empty() || input.shape.contains(&DimSpec::Fixed(0)) {
            return Err(Error::Model(format!(
                "inputs.{name}.shape must give positive dimensions after the batch, e.g. [\"seq\"]"
            )));
        }
        if spec
            .layers
            .iter()
            .any(|l| l.name.as_deref() == Some(name.as_str()))
        {
            return Err(Error::Model(format!(
                "`{name}` names both an input and a layer"
            )));
        }
    }
    if spec.layers.is_empty() {
        return Err(Error::Model(
            "the model has no layers: add at least one [[layers]] entry".into(),
        ));
    }
    // The named inputs are visible to every layer, as the outermost scope.
    let mut scopes: Vec<Scope> = vec![spec.inputs.keys().map(|k| (k.clone(), None)).collect()];
    let layers = build_layers(&spec.layers, &LayerAt::default(), &mut scopes, true)?;
    Ok(Model {
        name: spec
            .name
            .clone()
            .unwrap_or_else(|| default_name.to_string()),
        input_dims: spec.input.shape.clone(),
        input_dtype: spec.input.dtype,
        extra_inputs: spec
            .inputs
            .iter()
            .map(|(n, i)| (n.clone(), i.shape.clone(), i.dtype))
            .collect(),
        defaults: spec.defaults.clone(),
        layers,
    })
}

/// The names of a block's layers so far, for `inputs` and `shares`: each single layer as
/// written, or `None` for a repeat block or a named model input. `shares` rebuilds its owner's
/// config from it (a pure function of the layer and its name): keeping every layer's config
/// here would copy each `Op` once more for the rare layer that shares.
type Scope<'s> = HashMap<String, Option<&'s LayerSpec>, foldhash::fast::RandomState>;

fn build_layers<'s>(
    specs: &'s [LayerSpec],
    parent: &LayerAt,
    scopes: &mut Vec<Scope<'s>>,
    parent_trainable: bool,
) -> Result<Vec<Layer>, Error> {
    scopes.push(Scope::with_capacity_and_hasher(
        specs.len(),
        foldhash::fast::RandomState::default(),
    ));
    let mut out = Vec::with_capacity(specs.len());
    let prefix = if parent.positions.is_empty() {
        String::new()
    } else {
        format!("{} > ", parent.label)
    };
    // The names the block's layers are given, looked up once per unnamed layer (a set, so that
    // naming stays linear in the number of layers).
    let given: HashSet<&str, foldhash::fast::RandomState> =
        specs.iter().filter_map(|l| l.name.as_deref()).collect();
    for (i, spec) in specs.iter().enumerate() {
        let mut positions = parent.positions.clone();
        positions.push(i + 1);
        // An unnamed layer is `<kind><position>` (`relu2`), made unique against the names the
        // block's layers are given and the default names of the layers before it (`relu6` at
        // position 1 and `relu` at position 61 are both `relu61`: the second is `relu61_2`).
        let name = spec.name.clone().unwrap_or_else(|| {
            let base = format!("{}{}", spec.kind, i + 1);
            let scope = scopes.last().expect("a scope was pushed above");
            let taken = |n: &str| given.contains(n) || scope.contains_key(n);
            if !taken(&base) {
                return base;
            }
            let mut k = 2;
            let mut name = format!("{base}_{k}");
            while taken(&name) {
                k += 1;
                name = format!("{base}_{k}");
            }
            name
        });
        if name.is_empty() {
            return Err(Error::layer(
                LayerAt {
                    positions,
                    label: format!("{prefix}layer #{} ({})", i + 1, spec.kind),
                },
                LayerErrorKind::Invalid("`name` is empty".into()),
            ));
        }
        let label = LayerAt {
            positions,
            label: format!("{prefix}layer #{} \"{name}\" ({})", i + 1, spec.kind),
        };
        let fail = |message: String| Error::layer(label.clone(), LayerErrorKind::Invalid(message));
        if spec.name.as_deref() == Some(INPUT) {
            return Err(fail(format!(
                "the name `{INPUT}` is reserved for the block's input"
            )));
        }
        let inputs = match &spec.inputs {
            None => vec![InputRef::Previous],
            Some(list) if list.is_empty() => {
                return Err(fail(
                    "`inputs` is empty: name at least one earlier layer, or leave it out".into(),
                ));
            }
            Some(list) => {
                let mut refs = Vec::new();
                for n in list {
                    if n != INPUT && !scopes.iter().any(|s| s.contains_key(n)) {
                        let known: Vec<&str> = scopes
                            .iter()
                            .flat_map(|s| s.keys())
                            .map(String::as_str)
                            .collect();
                        let hint = crate::error::nearest(n, &known)
                            .map(|k| format!(" (did you mean `{k}`?)"))
                            .unwrap_or_default();
                        return Err(fail(format!(
                            "input `{n}` names no earlier layer{hint}; inputs may name earlier layers of this block or enclosing blocks, or `{INPUT}`"
                        )));
                    }
                    refs.push(InputRef::Named(n.clone()));
                }
                refs
            }
        };
        let trainable = parent_trainable && spec.trainable.unwrap_or(true);
        let node = if spec.kind == LayerKind::Repeat {
            let (count, body_specs) = read_repeat(spec, &name).map_err(&fail)?;
            // The same slice, borrowed for the scopes' lifetime rather than the name's.
            let body_specs: &'s [LayerSpec] = match spec.layers.as_deref() {
                Some(b) if b.len() == body_specs.len() => b,
                _ => &[],
            };
            if body_specs.is_empty() {
                return Err(fail(
                    "`layers` is empty: a block needs at least one layer".into(),
                ));
            }
            let body = build_layers(body_specs, &label, scopes, trainable)?;
            Node::Repeat {
                count,
                written: count,
                count_key: spec.count_key.unwrap_or("count"),
                body,
            }
        } else {
            Node::Op(build_op(spec, &name).map_err(&fail)?)
        };
        if let Node::Op(Op::MaskedScatter) = &node {
            if inputs.len() != 3 {
                return Err(fail("`masked_scatter` takes three `inputs`: the token ids, the text embeddings and the image features, e.g. inputs = [\"input\", \"embed_tokens\", \"projector\"]".into()));
            }
        } else if let Node::Op(Op::CrossAttention(_)) = &node {
            if inputs.len() != 2 {
                return Err(fail("`cross_attention` takes two `inputs`: the queries' source and the encoder output, e.g. inputs = [\"ln\", \"encoder\"]".into()));
            }
        } else if let Node::Op(Op::Sdpa(_)) = &node {
            if inputs.len() != 3 {
                return Err(fail("`sdpa` takes three `inputs`: queries, keys and values, e.g. inputs = [\"q\", \"k\", \"v\"]".into()));
            }
        } else if let Node::Op(Op::Einsum(c)) = &node {
            if inputs.len() != 2 {
                return Err(fail(format!(
                    "`einsum` takes two `inputs`, its equation's operands in order, e.g. inputs = [\"q\", \"k\"] for \"{}\"",
                    c.equation
                )));
            }
        } else if let Node::Op(Op::Add(_) | Op::Mul | Op::Concat(_)) = &node {
            if inputs.len() < 2 && !matches!(node, Node::Op(Op::Concat(_))) {
                return Err(fail(format!(
                    "`{}` needs at least two `inputs`, e.g. inputs = [\"{INPUT}\", \"conv3\"]",
                    spec.kind
                )));
            }
            if matches!(node, Node::Op(Op::Mul)) && inputs.len() != 2 {
                return Err(fail("`mul` takes exactly two `inputs`".into()));
            }
        } else if inputs.len() > 1 {
            return Err(fail(format!(
                "`{}` takes one input, got {}",
                spec.kind,
                inputs.len()
            )));
        }
        if let Some(owner) = &spec.shares {
            shared_op(owner, &name, spec, &node, scopes).map_err(&fail)?;
        }
        let scope = scopes.last_mut().expect("a scope was pushed above");
        let single = match &node {
            Node::Op(_) => Some(spec),
            Node::Repeat { .. } => None,
        };
        if scope.insert(name.clone(), single).is_some() {
            return Err(fail(format!("duplicate layer name `{name}` in this block")));
        }
        out.push(Layer {
            name,
            label,
            kind: spec.kind,
            inputs,
            trainable,
            shares: spec.shares.clone(),
            node,
        });
    }
    scopes.pop();
    Ok(out)
}

/// Checks `shares = "owner"` on the layer `name`: `owner` is an earlier layer visible here
/// (innermost block first, as `inputs` are looked up), an operation rather than a block, of the
/// same kind and with the same config, so that the parameters it has are the ones this layer
/// would make.
fn shared_op(
    owner: &str,
    name: &str,
    spec: &LayerSpec,
    node: &Node,
    scopes: &[Scope<'_>],
) -> Result<(), String> {
    let kind = spec.kind;
    let Node::Op(op) = node else {
        return Err(format!(
            "`shares` applies to a single layer, not a block: share each of the block's layers instead (layer `{name}` shares `{owner}`)"
        ));
    };
    let Some(found) = scopes.iter().rev().find_map(|s| s.get(owner)) else {
        let known: Vec<&str> = scopes
            .iter()
            .flat_map(|s| s.keys())
            .map(String::as_str)
            .collect();
        let hint = crate::error::nearest(owner, &known)
            .map(|k| format!(" (did you mean `{k}`?)"))
            .unwrap_or_default();
        return Err(format!(
            "`shares` names `{owner}`, which is no earlier layer{hint}; a layer may share the parameters of an earlier layer of its block or of an enclosing block"
        ));
    };
    let Some(their_spec) = *found else {
        return Err(format!(
            "layer `{name}` shares `{owner}`, which is a block or a model input; `shares` names a single layer"
        ));
    };
    let their_kind = their_spec.kind;
    if their_kind != kind {
        return Err(format!(
            "layer `{name}` ({kind}) shares `{owner}`, which is a `{their_kind}`: a layer shares the parameters of a layer of its own kind"
        ));
    }
    // The owner built without error when it was read (its name is the key it was found by).
    let theirs = build_op(their_spec, owner)?;
    if theirs != *op {
        return Err(format!(
            "layer `{name}` shares `{owner}`, but their configs differ: write `{name}` with the keys of `{owner}` ({})",
            differing_keys(their_spec, owner, spec, name)
        ));
    }
    Ok(())
}

/// The keys on which two layers as written differ, in the file's terms: `out_features = 8 in
/// `a`, 16 in `b`` (an absent key reads `not set`). The keys that name or place a layer (`name`,
/// `inputs`, `shares`, `note`) are left out. Falls back to "their defaults differ" when the
/// written keys agree.
fn differing_keys(a: &LayerSpec, a_name: &str, b: &LayerSpec, b_name: &str) -> String {
    let as_map = |l: &LayerSpec| match serde_json::to_value(l) {
        Ok(serde_json::Value::Object(m)) => m,
        _ => serde_json::Map::new(),
    };
    let (ma, mb) = (as_map(a), as_map(b));
    let mut keys: Vec<&String> = ma.keys().chain(mb.keys()).collect();
    keys.sort();
    keys.dedup();
    let shown = |v: Option<&serde_json::Value>| match v {
        None | Some(serde_json::Value::Null) => "not set".to_string(),
        Some(v) => v.to_string(),
    };
    let diffs: Vec<String> = keys
        .into_iter()
        .filter(|k| !matches!(k.as_str(), "name" | "inputs" | "shares" | "note" | "layers"))
        .filter(|k| {
            let (x, y) = (ma.get(*k), mb.get(*k));
            let unset = |v: Option<&serde_json::Value>| v.is_none_or(serde_json::Value::is_null);
            !(x == y || unset(x) && unset(y))
        })
        .map(|k| {
            format!(
                "`{k}` = {} in `{a_name}`, {} in `{b_name}`",
                shown(ma.get(k)),
                shown(mb.get(k))
            )
        })
        .collect();
    if diffs.is_empty() {
        "their keys as written agree, but the values they leave to defaults differ".into()
    } else {
        diffs.join("; ")
    }
}

/// Reads a `repeat` block's keys: its copy count (at least 1) and its body.
fn read_repeat<'a>(s: &'a LayerSpec, name: &'a str) -> Result<(u64, &'a [LayerSpec]), String> {
    repeat_keys(&mut KeyReader::new(s, name))
}

fn repeat_keys<'a>(r: &mut KeyReader<'a>) -> Result<(u64, &'a [LayerSpec]), String> {
    let s = r.spec();
    let count = r.or(keys::key!(s.count), 1);
    let body = r.opt(keys::key!(ref s.layers));
    r.finish()?;
    if count == 0 {
        return Err("`count` must be at least 1".into());
    }
    let body = body.ok_or("missing `layers` (the block's body)")?;
    Ok((count, body))
}

/// Reads a layer's keys into its kind's config (the kind's reader rejects keys it does not
/// read).
fn build_op(s: &LayerSpec, name: &str) -> Result<Op, String> {
    read_op(&mut KeyReader::new(s, name))
}

/// The keys a kind accepts, in the order its config reads them (the list its errors give).
#[must_use]
pub fn kind_keys(kind: LayerKind) -> Vec<&'static str> {
    let spec = layer_spec! {
        kind: kind,
        ..LayerSpec::default()
    };
    let mut r = KeyReader::new(&spec, "");
    // Every reader reads all its keys before it can fail (on the missing required ones here).
    let _ = if kind == LayerKind::Repeat {
        repeat_keys(&mut r).map(|_| ())
    } else {
        read_op(&mut r).map(|_| ())
    };
    r.keys().to_vec()
}

/// Reads a layer's config with `r` (any kind but `repeat`).
fn read_op(r: &mut KeyReader<'_>) -> Result<Op, String> {
    use LayerKind as K;
    Ok(match r.kind() {
        K::Repeat => return Err("`repeat` is a block, not an operation".into()),
        K::Linear => Op::Linear(LinearCfg::read(r)?),
        K::Conv1d
        | K::Conv2d
        | K::Conv3d
        | K::ConvTranspose1d
        | K::ConvTranspose2d
        | K::ConvTranspose3d => Op::Conv(ConvCfg::read(r)?),
        K::BatchNorm1d | K::BatchNorm2d => Op::BatchNorm(BatchNormCfg::read(r)?),
        K::LayerNorm => Op::LayerNorm(LayerNormCfg::read(r)?),
        K::RmsNorm => Op::RmsNorm(RmsNormCfg::read(r)?),
        K::GroupNorm => Op::GroupNorm(GroupNormCfg::read(r)?),
        K::Embedding => Op::Embedding(EmbeddingCfg::read(r)?),
        K::PositionEmbedding => Op::PositionEmbedding(PositionEmbeddingCfg::read(r)?),
        K::TokenTypeEmbedding => Op::TokenTypeEmbedding(TokenTypeEmbeddingCfg::read(r)?),
        K::Rotary => Op::Rotary(RotaryCfg::read(r)?),
        K::Parameter => Op::Parameter(ParameterCfg::read(r)?),
        K::Dropout => Op::Dropout(DropoutCfg::read(r)?),
        K::Relu
        | K::Relu6
        | K::Hardswish
        | K::Hardsigmoid
        | K::LeakyRelu
        | K::Gelu
        | K::GeluNew
        | K::BloomGelu
        | K::Silu
        | K::Tanh
        | K::Sigmoid => Op::Activation(Activation::read(r)?),
        K::Softmax => Op::Softmax(SoftmaxCfg::read(r)?),
        K::Mul => {
            r.finish()?;
            Op::Mul
        }
        K::Add => Op::Add(AddCfg::read(r)?),
        K::MaskedScatter => {
            r.finish()?;
            Op::MaskedScatter
        }
        K::Concat => Op::Concat(ConcatCfg::read(r)?),
        K::MaxPool2d => Op::MaxPool2d(MaxPool2dCfg::read(r)?),
        K::AvgPool2d => Op::AvgPool2d(AvgPool2dCfg::read(r)?),
        K::AdaptiveAvgPool2d => Op::AdaptiveAvgPool2d(AdaptiveAvgPool2dCfg::read(r)?),
        K::Upsample => Op::Upsample(UpsampleCfg::read(r)?),
        K::Pad => Op::Pad(PadCfg::read(r)?),
        K::Flatten => Op::Flatten(FlattenCfg::read(r)?),
        K::Reshape => Op::Reshape(ReshapeCfg::read(r)?),
        K::Transpose => Op::Transpose(TransposeCfg::read(r)?),
        K::Permute => Op::Permute(PermuteCfg::read(r)?),
        K::Narrow => Op::Narrow(NarrowCfg::read(r)?),
        K::Select => Op::Select(SelectCfg::read(r)?),
        K::Attention => Op::Attention(AttentionCfg::read(r)?),
        K::CrossAttention => Op::CrossAttention(AttentionCfg::read_cross(r)?),
        K::RelativePositionBias => Op::RelativePositionBias(RelativePositionBiasCfg::read(r)?),
        K::RelativeEmbeddings => Op::RelativeEmbeddings(RelativeEmbeddingsCfg::read(r)?),
        K::DisentangledAttention => Op::DisentangledAttention(DisentangledAttentionCfg::read(r)?),
        K::PaddingMask => Op::PaddingMask(PaddingMaskCfg::read(r)?),
        K::Moe => Op::Moe(MoeCfg::read(r)?),
        K::Mla => Op::Mla(MlaCfg::read(r)?),
        K::Lstm | K::Gru => Op::Rnn(RnnCfg::read(r)?),
        K::Einsum => Op::Einsum(EinsumCfg::read(r)?),
        K::Sdpa => Op::Sdpa(SdpaCfg::read(r)?),
        K::StochasticDepth => Op::StochasticDepth(StochasticDepthCfg::read(r)?),
        K::ShiftRight => {
            r.finish()?;
            Op::ShiftRight
        }
        K::Scale => Op::Scale(ScaleCfg::read(r)?),
        K::CrossEntropy => Op::CrossEntropy(CrossEntropyCfg::read(r)?),
        K::MseLoss => Op::MseLoss(MseLossCfg::read(r)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Default names are unique against the defaults before them too: `relu6` at position 1
    /// and `relu` at position 61 both make `relu61` (found by the flat-layer work: a valid file
    /// failed with "duplicate layer name").
    #[test]
    fn default_names_do_not_collide() {
        let mut src = String::from("[input]\nshape = [4]\n[[layers]]\nkind = \"relu6\"\n");
        for _ in 0..60 {
            src.push_str("[[layers]]\nkind = \"relu\"\n");
        }
        src.push_str("[[layers]]\nkind = \"relu\"\nname = \"relu62\"\n");
        src.push_str("[[layers]]\nkind = \"relu\"\n");
        let spec = crate::spec::parse(&src, crate::spec::Format::Toml, kind_keys).unwrap();
        let model = build(&spec, "m").unwrap();
        let names: Vec<&str> = model.layers.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names.len(), 63);
        assert_eq!(
            (names[0], names[1], names[60], names[61], names[62]),
            ("relu61", "relu2", "relu61_2", "relu62", "relu63")
        );
    }

    #[test]
    fn kind_keys_are_what_the_readers_read() {
        assert_eq!(
            kind_keys(LayerKind::Linear),
            ["in_features", "out_features", "bias", "tie", "quantize"]
        );
        assert_eq!(kind_keys(LayerKind::Repeat), ["count", "layers"]);
        assert!(kind_keys(LayerKind::ConvTranspose2d).contains(&"output_padding"));
        assert!(!kind_keys(LayerKind::Conv2d).contains(&"output_padding"));
        assert!(kind_keys(LayerKind::Tanh).is_empty());
        // Every kind reads each key once.
        for &kind in LayerKind::ALL {
            let keys = kind_keys(kind);
            let mut unique = keys.clone();
            unique.sort_unstable();
            unique.dedup();
            assert_eq!(unique.len(), keys.len(), "{kind}: {keys:?}");
        }
    }
}
