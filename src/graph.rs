//! The resolved model: typed layer operations with validated keys and resolved inputs.
//!
//! [`build`] turns the raw [`ModelSpec`] into a [`Model`]. Everything a file can get wrong that
//! does not depend on the batch or sequence length is reported here, naming the layer; shape
//! checks happen when the model is traced with concrete settings ([`crate::trace`]).

use std::collections::HashSet;

use crate::dtype::DType;
use crate::error::{Error, LayerErrorKind};
use crate::spec::{DefaultsSpec, DimSpec, LayerKind, LayerSpec, ModelSpec, Pair};

/// A validated model.
#[derive(Clone, Debug)]
pub struct Model {
    /// Display name.
    pub name: String,
    /// Input dimensions after the batch.
    pub input_dims: Vec<DimSpec>,
    /// Input dtype when given (an integer type means token ids).
    pub input_dtype: Option<DType>,
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
    /// Human-readable position, e.g. `layer #3 "fc2" (linear)`, used in errors.
    pub label: String,
    /// The kind as written.
    pub kind: LayerKind,
    /// Where the layer's inputs come from.
    pub inputs: Vec<InputRef>,
    /// Whether its parameters train (`trainable = false` freezes them).
    pub trainable: bool,
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
        /// The layers of one copy.
        body: Vec<Layer>,
    },
}

/// Activation functions, with the tensors autograd keeps for each (see [`crate::trace`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `relu`: keeps its output. `inplace` writes into the input's memory.
    Relu {
        /// `nn.ReLU(inplace=True)`.
        inplace: bool,
    },
    /// `relu6` (`hardtanh(0, 6)`): keeps its input (its output when in place).
    Relu6 {
        /// `nn.ReLU6(inplace=True)`.
        inplace: bool,
    },
    /// `hardswish`: keeps its input (a clone of it when in place).
    Hardswish {
        /// `nn.Hardswish(inplace=True)`.
        inplace: bool,
    },
    /// `hardsigmoid`: keeps its input (a clone of it when in place).
    Hardsigmoid {
        /// `nn.Hardsigmoid(inplace=True)`.
        inplace: bool,
    },
    /// `leaky_relu`: keeps its input, or its output when in place (`leaky_relu_`).
    LeakyRelu {
        /// `nn.LeakyReLU(inplace=True)`.
        inplace: bool,
    },
    /// `gelu` (`F.gelu`, erf or `approximate="tanh"`): keeps its input.
    Gelu,
    /// `gelu_new`: the tanh approximation written out in Python (transformers'
    /// `NewGELUActivation`): keeps its input, `tanh(..)`, `0.5·x` and `1 + tanh(..)`.
    GeluNew,
    /// `silu` (`F.silu`): keeps its input (a clone of it when in place).
    Silu {
        /// `nn.SiLU(inplace=True)`.
        inplace: bool,
    },
    /// `tanh`: keeps its output.
    Tanh,
    /// `sigmoid`: keeps its output.
    Sigmoid,
}

/// Whose attention module an `attention` layer follows; they lay tensors out differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnStyle {
    /// transformers' attention modules: `[B, S, H]` projections split into heads with
    /// `view` + `transpose(1, 2)`, merged back with `transpose(1, 2).contiguous()`.
    Transformers,
    /// `torch.nn.MultiheadAttention(batch_first=True)` (torchvision's ViT): a packed in-projection
    /// of the sequence-first input, always through `scaled_dot_product_attention`.
    TorchMha,
}

/// Which transformers RMSNorm an `rmsnorm` layer follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RmsStyle {
    /// `LlamaRMSNorm` (Llama, Mistral, Qwen, Phi-3, Mixtral).
    Llama,
    /// `T5LayerNorm`.
    T5,
    /// `GemmaRMSNorm`.
    Gemma,
    /// `Olmo2RMSNorm`: the weight times the float32 normalized input, then cast back
    /// (`(w * x.float() * rsqrt(mean(x²) + eps)).to(x.dtype)`).
    Olmo2,
}

/// Where an attention layer RMS-normalizes its queries and keys (`qk_norm`, `qk_norm_scope`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    /// Per head, over `head_dim`, on the `[B, S, heads, head_dim]` view (Qwen3's
    /// `q_norm`/`k_norm`, `LlamaRMSNorm`): params `2·head_dim`.
    Head,
    /// Over the whole projection `[B, S, heads·head_dim]` before the heads are split
    /// (OLMo-2's `q_norm`/`k_norm`, `Olmo2RMSNorm`): params `(heads + kv_heads)·head_dim`.
    Projection,
}

/// How a free parameter tensor joins the activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Combine {
    /// Expanded over the batch and concatenated along a dimension (ViT's class token).
    Concat(i64),
    /// Broadcast and added (ViT's position embedding).
    Add,
    /// Broadcast and multiplied (ConvNeXt's layer scale): keeps the input for the parameter's
    /// gradient.
    Mul,
}

/// One operation. Shapes use `B` for the batch; parameters are counted per instance.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// `nn.Linear`: `[.., in] → [.., out]`; params `in·out (+ out)`. With `tie`, the weight is
    /// the named embedding's (counted once, as transformers ties GPT-2's head).
    Linear {
        /// Expected input features, checked when given.
        in_features: Option<u64>,
        /// Output features.
        out_features: u64,
        /// Has a bias.
        bias: bool,
        /// Name of an embedding whose weight this layer shares.
        tie: Option<String>,
    },
    /// `nn.Conv1d` / `nn.Conv2d`: `[B, Cin, (H,) W] → [B, Cout, (H',) W']` with
    /// `W' = floor((W + 2p − d(k − 1) − 1)/s) + 1`; params `Cout·Cin/groups·∏k (+ Cout)`.
    Conv {
        /// 1 or 2 spatial dimensions.
        spatial: usize,
        /// Expected input channels, checked when given.
        in_channels: Option<u64>,
        /// Output channels.
        out_channels: u64,
        /// Kernel size `(h, w)` (`h` ignored for 1-D).
        kernel: Pair,
        /// Stride.
        stride: Pair,
        /// Zero padding.
        padding: Pair,
        /// Dilation.
        dilation: Pair,
        /// Groups (`Cin` for depthwise).
        groups: u64,
        /// Has a bias.
        bias: bool,
    },
    /// `nn.BatchNorm1d/2d` over dimension 1: params `2C` (weight, bias), buffers running mean
    /// and variance (`2C`) and an int64 `num_batches_tracked`.
    BatchNorm {
        /// 1 (`batchnorm1d`: `[B, C]` or `[B, C, L]`) or 2 (`batchnorm2d`: `[B, C, H, W]`).
        spatial: usize,
        /// Expected channels, checked when given.
        num_features: Option<u64>,
        /// Has weight and bias.
        affine: bool,
        /// Keeps running statistics (buffers).
        track_running_stats: bool,
    },
    /// `nn.LayerNorm` over the last dimension: params `2·H` (or `H` without bias).
    LayerNorm {
        /// Has weight (and bias).
        affine: bool,
        /// Has a bias.
        bias: bool,
    },
    /// RMSNorm over the last dimension as transformers computes it; params `H`.
    /// `LlamaRMSNorm` (default): upcast to float32, `h·rsqrt(mean(h²)+ε)`, back to the input
    /// dtype, times weight. `T5LayerNorm` (`style = "t5"`): the variance from a float32 copy, but
    /// `x·rsqrt(..)` on the input itself, cast to a 16-bit weight's dtype, times weight.
    /// `GemmaRMSNorm` (`style = "gemma"`): all in float32, times `(1 + weight)`, cast back.
    RmsNorm {
        /// Which implementation.
        style: RmsStyle,
    },
    /// `nn.GroupNorm` over dimension 1: params `2C`.
    GroupNorm {
        /// Number of groups (must divide C).
        groups: u64,
        /// Has weight and bias.
        affine: bool,
    },
    /// `nn.Embedding`: ids `[B, ..] → [B, .., D]`; params `N·D`.
    Embedding {
        /// Vocabulary size N.
        num_embeddings: u64,
        /// Embedding size D.
        embedding_dim: u64,
        /// Name of an earlier embedding whose weight this one shares (T5's decoder `embed_tokens`
        /// is the shared table).
        tie: Option<String>,
    },
    /// A learned absolute position (or token-type) table added to `[B, S, D]`: params
    /// `positions·D`; with `ids_buffer` the module holds an int64 `[1, ids_buffer]` id buffer.
    PositionEmbedding {
        /// Rows of the table.
        num_positions: u64,
        /// Length of a registered int64 id buffer (0 for none).
        ids_buffer: u64,
    },
    /// A learned token-type table (BERT's `token_type_embeddings`) looked up with all-zero ids and
    /// added to `[B, S, D]`: params `types·D`; with `ids_buffer` the ids are an expanded view of
    /// an int64 `[1, ids_buffer]` buffer.
    TokenTypeEmbedding {
        /// Rows of the table.
        num_types: u64,
        /// Length of the registered int64 id buffer (0 for none).
        ids_buffer: u64,
    },
    /// Rotary position embedding tables for the attention layers that set `rotary`: buffers
    /// `inv_freq` and `original_inv_freq` (`head_dim/2` each); passes its input through.
    Rotary {
        /// Head dimension.
        head_dim: u64,
        /// The rotated part is joined to the pass-through part with `torch.cat` (Phi-3's and
        /// partial-rotary code), which makes Q and K contiguous `[B, heads, S, head_dim]`.
        concat: bool,
        /// `cos`/`sin` stay float32 whatever the activation dtype (OLMo-2's
        /// `Olmo2RotaryEmbedding` returns them uncast): `apply_rotary_pos_emb` then computes in
        /// float32 and casts Q and K back (`q_embed.to(q_type)`).
        tables_f32: bool,
    },
    /// A free parameter tensor of the given shape joined to the activations.
    Parameter {
        /// Parameter shape.
        shape: Vec<u64>,
        /// How it joins.
        combine: Combine,
    },
    /// `nn.Dropout(p)`: identity in inference or when `p = 0`.
    Dropout {
        /// Drop probability.
        p: f64,
        /// Writes into its input.
        inplace: bool,
    },
    /// An activation function (shape preserved).
    Activation(Activation),
    /// `softmax(dim)`: keeps its output.
    Softmax {
        /// Dimension.
        dim: i64,
    },
    /// Elementwise product of two inputs (gated MLPs): keeps each factor for the other's gradient.
    Mul,
    /// Elementwise sum of two or more inputs (residuals); `inplace` writes into the first
    /// (`out += identity`).
    Add {
        /// Writes into the first input.
        inplace: bool,
    },
    /// Concatenation along a dimension.
    Concat {
        /// Dimension (negative counts from the end).
        dim: i64,
    },
    /// `nn.MaxPool2d`: keeps its input and int64 indices of the output's shape.
    MaxPool2d {
        /// Window.
        kernel: Pair,
        /// Stride (defaults to the window).
        stride: Pair,
        /// Padding.
        padding: Pair,
        /// Dilation.
        dilation: Pair,
        /// Round output sizes up.
        ceil_mode: bool,
    },
    /// `nn.AvgPool2d`: keeps its input.
    AvgPool2d {
        /// Window.
        kernel: Pair,
        /// Stride.
        stride: Pair,
        /// Padding.
        padding: Pair,
        /// Round output sizes up.
        ceil_mode: bool,
    },
    /// `nn.AdaptiveAvgPool2d(output_size)`: `(1, 1)` runs as a mean and keeps nothing.
    AdaptiveAvgPool2d {
        /// Output `(h, w)`.
        output: Pair,
    },
    /// `torch.flatten(start_dim, end_dim)`: a view when the input is contiguous.
    Flatten {
        /// First dimension to merge.
        start: i64,
        /// Last dimension to merge.
        end: i64,
    },
    /// `reshape` to the given per-sample shape (batch kept; one `-1` allowed).
    Reshape {
        /// Dimensions after the batch.
        shape: Vec<i64>,
    },
    /// `transpose(a, b)`: a view.
    Transpose {
        /// First dimension.
        a: i64,
        /// Second dimension.
        b: i64,
    },
    /// `permute(dims)` (the batch stays first): a view.
    Permute {
        /// The new order of the dimensions, `dims[0] = 0`.
        dims: Vec<usize>,
    },
    /// `x.narrow(dim, start, length)` (a slice, e.g. one half of `chunk(2, dim)`): a view.
    Narrow {
        /// Dimension.
        dim: i64,
        /// First index.
        start: u64,
        /// Length.
        length: u64,
    },
    /// `x.select(dim, index)` (e.g. `x[:, 0]`): a view.
    Select {
        /// Dimension.
        dim: i64,
        /// Index (negative counts from the end).
        index: i64,
    },
    /// Multi-head self-attention on `[B, S, H]`: Q, K, V projections (`heads·head_dim`,
    /// `kv_heads·head_dim`, `kv_heads·head_dim` outputs, fused or not), attention, and the
    /// output projection back to `H`.
    Attention {
        /// Whose module is modelled.
        style: AttnStyle,
        /// Query heads.
        heads: u64,
        /// Key/value heads (grouped-query attention when fewer than `heads`).
        kv_heads: u64,
        /// Head dimension (default `H / heads`).
        head_dim: Option<u64>,
        /// Causal mask (decoders).
        causal: bool,
        /// Causal attention stores K and V in transformers' `DynamicCache` (`use_cache`), which
        /// copies them, in training too (default: true for causal attention).
        kv_cache: bool,
        /// Biases on the Q, K, V projections.
        bias: bool,
        /// Bias on the output projection.
        out_bias: bool,
        /// One fused QKV projection (GPT-2's `c_attn`, ViT's `in_proj`).
        fused_qkv: bool,
        /// Rotary embedding applied to Q and K.
        rotary: bool,
        /// Dropout on the attention probabilities (training only).
        dropout: f64,
        /// RMSNorm on Q and K (Qwen3 per head, OLMo-2 over the projection).
        qk_norm: Option<QkNorm>,
        /// Adds the shared relative position bias (T5) to the scores.
        position_bias: bool,
        /// Sliding-window attention (Mistral): the inference KV cache holds at most this many
        /// tokens.
        sliding_window: Option<u64>,
        /// Eager softmax in float32 (`softmax(.., dtype=torch.float32).to(query.dtype)`, as
        /// transformers' Llama-family and T5 attention do): in a 16-bit model it keeps a float32
        /// copy of the probabilities and a 16-bit one.
        softmax_f32: bool,
    },
    /// Cross-attention (T5's decoder): queries from the first input `[B, S, H]`, keys and values
    /// projected from the second (the encoder output `[B, S_enc, H]`); params as `attention`.
    CrossAttention {
        /// Heads.
        heads: u64,
        /// Head dimension (default `H / heads`).
        head_dim: Option<u64>,
        /// Biases on the Q, K, V projections.
        bias: bool,
        /// Bias on the output projection.
        out_bias: bool,
        /// Dropout on the attention probabilities (training only).
        dropout: f64,
    },
    /// T5's relative position bias: an embedding of `num_buckets × heads` looked up with an int64
    /// `[S, S]` bucket matrix, giving a `[1, heads, S, S]` bias that later `attention` layers with
    /// `position_bias = true` add to their scores; passes its input through.
    RelativePositionBias {
        /// Buckets (T5: 32).
        num_buckets: u64,
        /// Heads.
        heads: u64,
    },
    /// A sparse mixture-of-experts MLP on `[B, S, H]` (Mixtral, Qwen-MoE) as transformers 5 runs it
    /// (`grouped_mm` experts): a router `H → experts`, softmax, top-k, tokens gathered per expert,
    /// SiLU-gated experts of width `intermediate_size`, weighted and scattered back; with a shared
    /// expert (Qwen-MoE) of width `shared_intermediate_size` on every token, optionally gated.
    /// Params: `experts·H + experts·3·H·I (+ 3·H·I_shared + H)`. Routing is assumed balanced:
    /// each expert sees `B·S·top_k/experts` tokens.
    Moe {
        /// Experts.
        experts: u64,
        /// Experts per token.
        top_k: u64,
        /// Expert FFN width.
        intermediate_size: u64,
        /// Shared expert width (0: none).
        shared_intermediate_size: u64,
        /// Sigmoid gate on the shared expert.
        shared_gate: bool,
        /// Renormalize the top-k routing weights (Mixtral: yes; Qwen-MoE: `norm_topk_prob`).
        normalize_topk: bool,
    },
    /// torchvision's `StochasticDepth(p, "row")`: in training multiplies by a `[B, 1, ..]` noise
    /// tensor, which it keeps.
    StochasticDepth {
        /// Drop probability.
        p: f64,
    },
    /// T5's `_shift_right` of the labels: a new int64 tensor of the input's shape (the decoder's
    /// input ids).
    ShiftRight,
    /// Multiplication by a constant (T5's `sequence_output * d_model**-0.5`, Gemma's embedding
    /// normalizer): a new tensor, nothing kept.
    Scale {
        /// The factor (informational).
        factor: f64,
    },
    /// Cross-entropy loss on logits `[N, C]` or `[B, S, V]` against int64 labels; ends the
    /// forward pass. `shift` shifts labels for causal language modelling; `upcast` computes
    /// it on a float32 copy of the logits (transformers' `logits.float()`).
    CrossEntropy {
        /// Causal-LM label shift.
        shift: bool,
        /// Float32 upcast of the logits.
        upcast: bool,
    },
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
    if spec.layers.is_empty() {
        return Err(Error::Model(
            "the model has no layers: add at least one [[layers]] entry".into(),
        ));
    }
    let mut scopes: Vec<HashSet<String>> = Vec::new();
    let layers = build_layers(&spec.layers, "", &mut scopes, true)?;
    Ok(Model {
        name: spec
            .name
            .clone()
            .unwrap_or_else(|| default_name.to_string()),
        input_dims: spec.input.shape.clone(),
        input_dtype: spec.input.dtype,
        defaults: spec.defaults.clone(),
        layers,
    })
}

fn build_layers(
    specs: &[LayerSpec],
    prefix: &str,
    scopes: &mut Vec<HashSet<String>>,
    parent_trainable: bool,
) -> Result<Vec<Layer>, Error> {
    scopes.push(HashSet::new());
    let mut out = Vec::with_capacity(specs.len());
    for (i, spec) in specs.iter().enumerate() {
        // An unnamed layer is `<kind><position>` (`relu2`), made unique against the names the
        // block's layers are given.
        let name = spec.name.clone().unwrap_or_else(|| {
            let base = format!("{}{}", spec.kind, i + 1);
            let taken = |n: &str| specs.iter().any(|l| l.name.as_deref() == Some(n));
            let mut name = base.clone();
            let mut k = 2;
            while taken(&name) {
                name = format!("{base}_{k}");
                k += 1;
            }
            name
        });
        if name.is_empty() {
            return Err(Error::layer(
                format!("{prefix}layer #{} ({})", i + 1, spec.kind),
                LayerErrorKind::Invalid("`name` is empty".into()),
            ));
        }
        let label = format!("{prefix}layer #{} \"{name}\" ({})", i + 1, spec.kind);
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
                    if n != INPUT && !scopes.iter().any(|s| s.contains(n)) {
                        let known: Vec<&str> =
                            scopes.iter().flatten().map(String::as_str).collect();
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
            check_keys(spec, &["count", "layers"]).map_err(&fail)?;
            let count = spec.count.unwrap_or(1);
            if count == 0 {
                return Err(fail("`count` must be at least 1".into()));
            }
            let body_specs = spec
                .layers
                .as_ref()
                .ok_or_else(|| fail("missing `layers` (the block's body)".into()))?;
            if body_specs.is_empty() {
                return Err(fail(
                    "`layers` is empty: a block needs at least one layer".into(),
                ));
            }
            let body = build_layers(body_specs, &format!("{label} > "), scopes, trainable)?;
            Node::Repeat { count, body }
        } else {
            Node::Op(build_op(spec).map_err(&fail)?)
        };
        if let Node::Op(Op::CrossAttention { .. }) = &node {
            if inputs.len() != 2 {
                return Err(fail("`cross_attention` takes two `inputs`: the queries' source and the encoder output, e.g. inputs = [\"ln\", \"encoder\"]".into()));
            }
        } else if let Node::Op(Op::Add { .. } | Op::Mul | Op::Concat { .. }) = &node {
            if inputs.len() < 2 && !matches!(node, Node::Op(Op::Concat { .. })) {
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
        let scope = scopes.last_mut().expect("a scope was pushed above");
        if !scope.insert(name.clone()) {
            return Err(fail(format!("duplicate layer name `{name}` in this block")));
        }
        out.push(Layer {
            name,
            label,
            kind: spec.kind,
            inputs,
            trainable,
            node,
        });
    }
    scopes.pop();
    Ok(out)
}

/// Rejects keys that do not apply to the kind.
fn check_keys(spec: &LayerSpec, allowed: &[&str]) -> Result<(), String> {
    for key in spec.set_keys() {
        if !allowed.contains(&key) {
            let valid = if allowed.is_empty() {
                "none".to_string()
            } else {
                allowed.join(", ")
            };
            return Err(format!(
                "key `{key}` does not apply to `{}` (its keys: {valid})",
                spec.kind
            ));
        }
    }
    Ok(())
}

fn positive(value: Option<u64>, key: &str) -> Result<u64, String> {
    match value {
        None => Err(format!("missing `{key}`")),
        Some(0) => Err(format!("`{key}` must be positive, got 0")),
        Some(v) => Ok(v),
    }
}

fn positive_opt(value: Option<u64>, key: &str) -> Result<Option<u64>, String> {
    value.map(|v| positive(Some(v), key)).transpose()
}

fn pair_positive(p: Pair, key: &str) -> Result<Pair, String> {
    if p.0 == 0 || p.1 == 0 {
        Err(format!("`{key}` must be positive, got [{}, {}]", p.0, p.1))
    } else {
        Ok(p)
    }
}

/// PyTorch's pooling requires `padding <= kernel / 2`.
fn pool_padding(kernel: Pair, padding: Option<Pair>) -> Result<(), String> {
    let p = padding.unwrap_or(Pair(0, 0));
    if p.0 > kernel.0 / 2 || p.1 > kernel.1 / 2 {
        return Err(format!(
            "`padding` must be at most half the kernel (kernel [{}, {}], padding [{}, {}])",
            kernel.0, kernel.1, p.0, p.1
        ));
    }
    Ok(())
}

fn probability(p: Option<f64>, key: &str) -> Result<f64, String> {
    let p = p.unwrap_or(0.0);
    if (0.0..1.0).contains(&p) {
        Ok(p)
    } else {
        Err(format!("`{key}` must be in [0, 1), got {p}"))
    }
}

#[allow(clippy::too_many_lines)] // one arm per kind, each short
fn build_op(s: &LayerSpec) -> Result<Op, String> {
    use LayerKind as K;
    let inplace = s.inplace.unwrap_or(false);
    Ok(match s.kind {
        K::Repeat => unreachable!("handled by the caller"),
        K::Linear => {
            check_keys(s, &["in_features", "out_features", "bias", "tie"])?;
            Op::Linear {
                in_features: positive_opt(s.in_features, "in_features")?,
                out_features: positive(s.out_features, "out_features")?,
                bias: s.bias.unwrap_or(true),
                tie: s.tie.clone(),
            }
        }
        K::Conv1d | K::Conv2d => {
            check_keys(
                s,
                &[
                    "in_channels",
                    "out_channels",
                    "kernel",
                    "stride",
                    "padding",
                    "dilation",
                    "groups",
                    "bias",
                ],
            )?;
            let spatial = if s.kind == K::Conv1d { 1 } else { 2 };
            let groups = positive(Some(s.groups.unwrap_or(1)), "groups")?;
            let out_channels = positive(s.out_channels, "out_channels")?;
            if out_channels % groups != 0 {
                return Err(format!(
                    "`out_channels` ({out_channels}) must be divisible by `groups` ({groups})"
                ));
            }
            Op::Conv {
                spatial,
                in_channels: positive_opt(s.in_channels, "in_channels")?,
                out_channels,
                kernel: pair_positive(s.kernel.ok_or("missing `kernel`")?, "kernel")?,
                stride: pair_positive(s.stride.unwrap_or(Pair(1, 1)), "stride")?,
                padding: s.padding.unwrap_or(Pair(0, 0)),
                dilation: pair_positive(s.dilation.unwrap_or(Pair(1, 1)), "dilation")?,
                groups,
                bias: s.bias.unwrap_or(true),
            }
        }
        K::BatchNorm1d | K::BatchNorm2d => {
            check_keys(s, &["num_features", "affine", "track_running_stats"])?;
            Op::BatchNorm {
                spatial: if s.kind == K::BatchNorm1d { 1 } else { 2 },
                num_features: positive_opt(s.num_features, "num_features")?,
                affine: s.affine.unwrap_or(true),
                track_running_stats: s.track_running_stats.unwrap_or(true),
            }
        }
        K::LayerNorm => {
            check_keys(s, &["affine", "bias"])?;
            Op::LayerNorm {
                affine: s.affine.unwrap_or(true),
                bias: s.bias.unwrap_or(true),
            }
        }
        K::RmsNorm => {
            check_keys(s, &["style"])?;
            let style = match s.style.as_deref() {
                None | Some("llama") => RmsStyle::Llama,
                Some("t5") => RmsStyle::T5,
                Some("gemma") => RmsStyle::Gemma,
                Some("olmo2") => RmsStyle::Olmo2,
                Some(other) => {
                    return Err(format!(
                        "unknown `style` value `{other}`, expected \"llama\", \"t5\", \"gemma\" or \"olmo2\""
                    ));
                }
            };
            Op::RmsNorm { style }
        }
        K::GroupNorm => {
            check_keys(s, &["num_groups", "affine"])?;
            Op::GroupNorm {
                groups: positive(s.num_groups, "num_groups")?,
                affine: s.affine.unwrap_or(true),
            }
        }
        K::Embedding => {
            check_keys(s, &["num_embeddings", "embedding_dim", "tie"])?;
            Op::Embedding {
                num_embeddings: positive(s.num_embeddings, "num_embeddings")?,
                embedding_dim: positive(s.embedding_dim, "embedding_dim")?,
                tie: s.tie.clone(),
            }
        }
        K::PositionEmbedding => {
            check_keys(s, &["num_positions", "ids_buffer"])?;
            Op::PositionEmbedding {
                num_positions: positive(s.num_positions, "num_positions")?,
                ids_buffer: s.ids_buffer.unwrap_or(0),
            }
        }
        K::TokenTypeEmbedding => {
            check_keys(s, &["num_embeddings", "ids_buffer"])?;
            Op::TokenTypeEmbedding {
                num_types: positive(s.num_embeddings, "num_embeddings")?,
                ids_buffer: s.ids_buffer.unwrap_or(0),
            }
        }
        K::Rotary => {
            check_keys(s, &["head_dim", "concat", "tables_f32"])?;
            let head_dim = positive(s.head_dim, "head_dim")?;
            if head_dim % 2 != 0 {
                return Err(format!(
                    "`head_dim` must be even for rotary embeddings, got {head_dim}"
                ));
            }
            Op::Rotary {
                head_dim,
                concat: s.concat.unwrap_or(false),
                tables_f32: s.tables_f32.unwrap_or(false),
            }
        }
        K::Parameter => {
            check_keys(s, &["shape", "combine", "dim"])?;
            let shape = s
                .shape
                .as_ref()
                .ok_or("missing `shape` (the parameter's shape, e.g. [1, 1, 768])")?;
            let mut dims = Vec::new();
            for &d in shape {
                match u64::try_from(d) {
                    Ok(v) if v > 0 => dims.push(v),
                    _ => return Err(format!("`shape` dimensions must be positive, got {d}")),
                }
            }
            let combine = match s.combine.as_deref() {
                Some("concat") => Combine::Concat(s.dim.unwrap_or(1)),
                Some("mul") => {
                    if s.dim.is_some() {
                        return Err("`dim` applies only with combine = \"concat\"".into());
                    }
                    Combine::Mul
                }
                Some("add") | None => {
                    if s.dim.is_some() {
                        return Err("`dim` applies only with combine = \"concat\"".into());
                    }
                    Combine::Add
                }
                Some(other) => {
                    return Err(format!(
                        "unknown `combine` value `{other}`, expected \"add\", \"mul\" or \"concat\""
                    ));
                }
            };
            Op::Parameter {
                shape: dims,
                combine,
            }
        }
        K::Dropout => {
            check_keys(s, &["p", "inplace"])?;
            Op::Dropout {
                p: probability(s.p.or(Some(0.5)), "p")?,
                inplace,
            }
        }
        K::Relu => {
            check_keys(s, &["inplace"])?;
            Op::Activation(Activation::Relu { inplace })
        }
        K::Hardswish => {
            check_keys(s, &["inplace"])?;
            Op::Activation(Activation::Hardswish { inplace })
        }
        K::Hardsigmoid => {
            check_keys(s, &["inplace"])?;
            Op::Activation(Activation::Hardsigmoid { inplace })
        }
        K::LeakyRelu => {
            check_keys(s, &["inplace"])?;
            Op::Activation(Activation::LeakyRelu { inplace })
        }
        K::Permute => {
            check_keys(s, &["dims"])?;
            let dims = s.dims.as_ref().ok_or(
                "missing `dims` (the new order of all dimensions, batch first, e.g. [0, 2, 3, 1])",
            )?;
            let n = dims.len();
            let mut order = Vec::with_capacity(n);
            for &d in dims {
                match usize::try_from(d) {
                    Ok(d) if d < n && !order.contains(&d) => order.push(d),
                    _ => return Err(format!("`dims` {dims:?} is not a permutation of 0..{n}")),
                }
            }
            if order.first() != Some(&0) {
                return Err("`dims` must keep the batch dimension first (dims[0] = 0)".into());
            }
            Op::Permute { dims: order }
        }
        K::Narrow => {
            check_keys(s, &["dim", "start", "length"])?;
            Op::Narrow {
                dim: s.dim.unwrap_or(1),
                start: s.start.unwrap_or(0),
                length: positive(s.length, "length")?,
            }
        }
        K::Relu6 => {
            check_keys(s, &["inplace"])?;
            Op::Activation(Activation::Relu6 { inplace })
        }
        K::Gelu => {
            check_keys(s, &["approximate"])?;
            match s.approximate.as_deref() {
                None | Some("none" | "tanh") => Op::Activation(Activation::Gelu),
                Some(other) => {
                    return Err(format!(
                        "unknown `approximate` value `{other}`, expected \"none\" or \"tanh\""
                    ));
                }
            }
        }
        K::GeluNew => {
            check_keys(s, &[])?;
            Op::Activation(Activation::GeluNew)
        }
        K::Silu => {
            check_keys(s, &["inplace"])?;
            Op::Activation(Activation::Silu { inplace })
        }
        K::Tanh => {
            check_keys(s, &[])?;
            Op::Activation(Activation::Tanh)
        }
        K::Sigmoid => {
            check_keys(s, &[])?;
            Op::Activation(Activation::Sigmoid)
        }
        K::Softmax => {
            check_keys(s, &["dim"])?;
            Op::Softmax {
                dim: s.dim.unwrap_or(-1),
            }
        }
        K::Mul => {
            check_keys(s, &[])?;
            Op::Mul
        }
        K::Add => {
            check_keys(s, &["inplace"])?;
            Op::Add { inplace }
        }
        K::Concat => {
            check_keys(s, &["dim"])?;
            Op::Concat {
                dim: s.dim.unwrap_or(1),
            }
        }
        K::MaxPool2d => {
            check_keys(s, &["kernel", "stride", "padding", "dilation", "ceil_mode"])?;
            let kernel = pair_positive(s.kernel.ok_or("missing `kernel`")?, "kernel")?;
            pool_padding(kernel, s.padding)?;
            Op::MaxPool2d {
                kernel,
                stride: pair_positive(s.stride.unwrap_or(kernel), "stride")?,
                padding: s.padding.unwrap_or(Pair(0, 0)),
                dilation: pair_positive(s.dilation.unwrap_or(Pair(1, 1)), "dilation")?,
                ceil_mode: s.ceil_mode.unwrap_or(false),
            }
        }
        K::AvgPool2d => {
            check_keys(s, &["kernel", "stride", "padding", "ceil_mode"])?;
            let kernel = pair_positive(s.kernel.ok_or("missing `kernel`")?, "kernel")?;
            pool_padding(kernel, s.padding)?;
            Op::AvgPool2d {
                kernel,
                stride: pair_positive(s.stride.unwrap_or(kernel), "stride")?,
                padding: s.padding.unwrap_or(Pair(0, 0)),
                ceil_mode: s.ceil_mode.unwrap_or(false),
            }
        }
        K::AdaptiveAvgPool2d => {
            check_keys(s, &["output_size"])?;
            Op::AdaptiveAvgPool2d {
                output: pair_positive(s.output_size.unwrap_or(Pair(1, 1)), "output_size")?,
            }
        }
        K::Flatten => {
            check_keys(s, &["start_dim", "end_dim"])?;
            Op::Flatten {
                start: s.start_dim.unwrap_or(1),
                end: s.end_dim.unwrap_or(-1),
            }
        }
        K::Reshape => {
            check_keys(s, &["shape"])?;
            let shape = s
                .shape
                .clone()
                .ok_or("missing `shape` (dimensions after the batch; one may be -1)")?;
            if shape.iter().any(|&d| d == 0 || d < -1)
                || shape.iter().filter(|&&d| d == -1).count() > 1
            {
                return Err(format!(
                    "invalid `shape` {shape:?}: dimensions must be positive, with at most one -1"
                ));
            }
            Op::Reshape { shape }
        }
        K::Transpose => {
            check_keys(s, &["dims"])?;
            match s.dims.as_deref() {
                Some(&[a, b]) => Op::Transpose { a, b },
                _ => return Err("`dims` must name two dimensions, e.g. dims = [1, 2]".into()),
            }
        }
        K::Select => {
            check_keys(s, &["dim", "index"])?;
            Op::Select {
                dim: s.dim.unwrap_or(1),
                index: s.index.unwrap_or(0),
            }
        }
        K::Attention => {
            check_keys(
                s,
                &[
                    "style",
                    "kv_cache",
                    "heads",
                    "kv_heads",
                    "head_dim",
                    "causal",
                    "bias",
                    "out_bias",
                    "fused_qkv",
                    "rotary",
                    "dropout",
                    "qk_norm",
                    "qk_norm_scope",
                    "position_bias",
                    "sliding_window",
                    "softmax_f32",
                ],
            )?;
            let style = match s.style.as_deref() {
                None | Some("transformers") => AttnStyle::Transformers,
                Some("torch") => AttnStyle::TorchMha,
                Some(other) => {
                    return Err(format!(
                        "unknown `style` value `{other}`, expected \"transformers\" or \"torch\""
                    ));
                }
            };
            let heads = positive(s.heads, "heads")?;
            let kv_heads = positive(Some(s.kv_heads.unwrap_or(heads)), "kv_heads")?;
            if heads % kv_heads != 0 {
                return Err(format!(
                    "`heads` ({heads}) must be a multiple of `kv_heads` ({kv_heads})"
                ));
            }
            if s.qk_norm == Some(true)
                && (s.fused_qkv == Some(true) || s.style.as_deref() == Some("torch"))
            {
                return Err("`qk_norm` needs separate Q and K projections (not `fused_qkv` or style = \"torch\")".into());
            }
            let qk_norm = match (s.qk_norm.unwrap_or(false), s.qk_norm_scope.as_deref()) {
                (false, None) => None,
                (false, Some(_)) => return Err("`qk_norm_scope` needs `qk_norm = true`".into()),
                (true, None | Some("head")) => Some(QkNorm::Head),
                (true, Some("projection")) => Some(QkNorm::Projection),
                (true, Some(other)) => {
                    return Err(format!(
                        "unknown `qk_norm_scope` value `{other}`, expected \"head\" or \"projection\""
                    ));
                }
            };
            let bias = s.bias.unwrap_or(true);
            Op::Attention {
                style,
                heads,
                kv_heads,
                head_dim: positive_opt(s.head_dim, "head_dim")?,
                causal: s.causal.unwrap_or(false),
                kv_cache: s.kv_cache.unwrap_or(true),
                bias,
                out_bias: s.out_bias.unwrap_or(bias),
                fused_qkv: s.fused_qkv.unwrap_or(false),
                rotary: s.rotary.unwrap_or(false),
                dropout: probability(s.dropout, "dropout")?,
                qk_norm,
                position_bias: s.position_bias.unwrap_or(false),
                sliding_window: positive_opt(s.sliding_window, "sliding_window")?,
                softmax_f32: s.softmax_f32.unwrap_or(false),
            }
        }
        K::CrossAttention => {
            check_keys(s, &["heads", "head_dim", "bias", "out_bias", "dropout"])?;
            let bias = s.bias.unwrap_or(true);
            Op::CrossAttention {
                heads: positive(s.heads, "heads")?,
                head_dim: positive_opt(s.head_dim, "head_dim")?,
                bias,
                out_bias: s.out_bias.unwrap_or(bias),
                dropout: probability(s.dropout, "dropout")?,
            }
        }
        K::RelativePositionBias => {
            check_keys(s, &["num_buckets", "heads"])?;
            Op::RelativePositionBias {
                num_buckets: positive(Some(s.num_buckets.unwrap_or(32)), "num_buckets")?,
                heads: positive(s.heads, "heads")?,
            }
        }
        K::Moe => {
            check_keys(
                s,
                &[
                    "experts",
                    "top_k",
                    "intermediate_size",
                    "shared_intermediate_size",
                    "shared_gate",
                    "normalize_topk",
                ],
            )?;
            let experts = positive(s.experts, "experts")?;
            let top_k = positive(s.top_k, "top_k")?;
            if top_k > experts {
                return Err(format!(
                    "`top_k` ({top_k}) cannot exceed `experts` ({experts})"
                ));
            }
            Op::Moe {
                experts,
                top_k,
                intermediate_size: positive(s.intermediate_size, "intermediate_size")?,
                shared_intermediate_size: s.shared_intermediate_size.unwrap_or(0),
                shared_gate: s.shared_gate.unwrap_or(false),
                normalize_topk: s.normalize_topk.unwrap_or(true),
            }
        }
        K::StochasticDepth => {
            check_keys(s, &["p"])?;
            Op::StochasticDepth {
                p: probability(s.p, "p")?,
            }
        }
        K::ShiftRight => {
            check_keys(s, &[])?;
            Op::ShiftRight
        }
        K::Scale => {
            check_keys(s, &["factor"])?;
            let factor = s.factor.ok_or("missing `factor`")?;
            if !factor.is_finite() {
                return Err(format!("`factor` must be a finite number, got {factor}"));
            }
            Op::Scale { factor }
        }
        K::CrossEntropy => {
            check_keys(s, &["shift", "upcast"])?;
            Op::CrossEntropy {
                shift: s.shift.unwrap_or(false),
                upcast: s.upcast.unwrap_or(false),
            }
        }
    })
}
