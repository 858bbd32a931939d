//! The operators memest models, named as ATen names them.
//!
//! Each [`Step`](super::Step) of the tape is one [`AtenOp`]: an ATen operator as autograd records
//! it (`addmm`, `native_layer_norm`, `_softmax`, …), or, for a few module programs that PyTorch
//! runs as several small operators memest does not trace one by one, a composite named after the
//! Python code it stands for (`rotary`, `repeat_kv`). [`AtenOp::name`] gives the ATen name.
//!
//! [`AtenOp::spec`] is the one table of what each operator's backward reads, and so what autograd
//! saves: `Tracer::call` applies it. The rules follow PyTorch's
//! `tools/autograd/derivatives.yaml`: a tensor named by an input's gradient formula is saved, and
//! autograd's codegen saves it only when that input needs a gradient if it is the only formula
//! that names it ([`SaveRule::each_other`]). `tests/data/derivatives.json`, extracted from the
//! yaml by `tools/derivatives.py`, pins every rule here to upstream in a unit test.
//!
//! # Adding an operator
//!
//! 1. A variant of [`AtenOp`] with its ATen name in [`AtenOp::name`] (an in-place form is its own
//!    variant, listed in [`AtenOp::is_inplace`]).
//! 2. Its row in [`AtenOp::spec`]: the `derivatives.yaml` entry (`name.overload`, or `None` for a
//!    composite), ATen's names for the inputs, outputs and auxiliary tensors in the order the
//!    tracer passes them, and the [`SaveRule`] read off the entry's backward formulas.
//! 3. The tracer records it with `self.call(Call::new(op, inputs, outputs))`, adding `.aux(..)`
//!    for the tensors the rule names that are not values and `.allocs(..)` for what it
//!    allocates besides its outputs. Then run `tools/derivatives.py` on PyTorch's yaml to add the
//!    entry to `tests/data/derivatives.json`; the unit test checks the row against it.

/// An operator of the tape.
///
/// In-place variants (`relu_`, `add_`, …) are their own operators: autograd may save something
/// else for them than for the out-of-place form (`leaky_relu_` keeps its result, `leaky_relu`
/// its input).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(test, derive(strum::EnumIter))]
pub enum AtenOp {
    /// `addmm(bias, mat1, mat2)`: `F.linear` with a bias.
    Addmm,
    /// `mm(self, mat2)`: `F.linear` without a bias.
    Mm,
    /// `bmm(self, mat2)`: `matmul` of batched operands.
    Bmm,
    /// `_grouped_mm(self, mat2, offs)`: MoE experts' matmul over sorted token groups.
    GroupedMm,
    /// `convolution(input, weight, bias, …)`.
    Convolution,
    /// `native_batch_norm(input, weight, bias, running_mean, running_var, …)`.
    NativeBatchNorm,
    /// `native_layer_norm(input, normalized_shape, weight, bias, eps)`.
    NativeLayerNorm,
    /// `native_group_norm(input, weight, bias, N, C, HxW, group, eps)`.
    NativeGroupNorm,
    /// `_fused_rms_norm(input, normalized_shape, weight, eps)`: `F.rms_norm` on CUDA.
    FusedRmsNorm,
    /// `_softmax(self, dim, half_to_float)`.
    Softmax,
    /// `_log_softmax(self, dim, half_to_float)`.
    LogSoftmax,
    /// `nll_loss_forward(self, target, weight, reduction, ignore_index)`.
    NllLoss,
    /// `mse_loss(self, target, reduction)`.
    MseLoss,
    /// `relu(self)`.
    Relu,
    /// `relu_(self)`.
    ReluInplace,
    /// `hardtanh(self, min_val, max_val)` (`nn.ReLU6`).
    Hardtanh,
    /// `hardtanh_(self, min_val, max_val)`.
    HardtanhInplace,
    /// `hardswish(self)`.
    Hardswish,
    /// `hardswish_(self)`.
    HardswishInplace,
    /// `hardsigmoid(self)`.
    Hardsigmoid,
    /// `hardsigmoid_(self)`.
    HardsigmoidInplace,
    /// `leaky_relu(self, negative_slope)`.
    LeakyRelu,
    /// `leaky_relu_(self, negative_slope)`.
    LeakyReluInplace,
    /// `gelu(self, approximate)`.
    Gelu,
    /// BLOOM's `GeLUFunction` (transformers `models/bloom/modeling_bloom.py`), a custom
    /// `autograd.Function`: `ctx.save_for_backward(input)`, the tanh approximation written out
    /// in Python in forward (`bloom_gelu_forward`) and backward (`bloom_gelu_back`), each
    /// operation a tensor of the input's size ([`Step::scratch`](super::Step)).
    BloomGelu,
    /// `silu(self)`.
    Silu,
    /// `silu_(self)`.
    SiluInplace,
    /// `tanh(self)`.
    Tanh,
    /// `sigmoid(self)`.
    Sigmoid,
    /// `pow.Tensor_Scalar(self, exponent)`.
    Pow,
    /// `rsqrt(self)`.
    Rsqrt,
    /// `mul.Tensor(self, other)`.
    Mul,
    /// `mul.Scalar(self, other)`: a product by a Python number.
    MulScalar,
    /// `add.Tensor(self, other, alpha)`.
    Add,
    /// `add_.Tensor(self, other, alpha)`: the in-place residual sum.
    AddInplace,
    /// `add.Scalar(self, other, alpha)`: a sum with a Python number (or a mask constant).
    AddScalar,
    /// `sub.Tensor(self, other, alpha)`.
    Sub,
    /// `neg(self)` (`-x`): its backward is `grad.neg()`, keeping nothing.
    Neg,
    /// `clamp(self, min, max)` with Python-number bounds.
    Clamp,
    /// `max.dim(self, dim, keepdim)`: the maximum along a dimension and its int64 indices.
    MaxDim,
    /// `div_.Tensor(self, other)`.
    DivInplace,
    /// `div.Tensor(self, other)` by a tensor that needs no gradient (a loss divided by its count
    /// of labels).
    Div,
    /// `mean.dim(self, dim, keepdim)`.
    Mean,
    /// `sum(self)` / `sum.dim_IntList(self, dim, keepdim)`.
    Sum,
    /// `cat(tensors, dim)`.
    Cat,
    /// `stack(tensors, dim)`: its backward is `grad.unbind(dim)` (views), keeping nothing.
    Stack,
    /// `masked_scatter(self, mask, source)`: the image features written into the text
    /// embeddings (LLaVA, Qwen2-VL).
    MaskedScatter,
    /// `eq.Scalar(self, other)`: the image-token mask `input_ids == image_token_id`.
    EqScalar,
    /// `topk(self, k, dim)`.
    Topk,
    /// `view(self, size)` (also `reshape` of a contiguous tensor, `flatten`).
    View,
    /// `transpose.int(self, dim0, dim1)`.
    Transpose,
    /// `permute(self, dims)`.
    Permute,
    /// `narrow(self, dim, start, length)`.
    Narrow,
    /// `slice.Tensor(self, dim, start, end, step)`: basic indexing (`x[..., :-1]`,
    /// `x[..., ::2]`).
    Slice,
    /// `alias(self)`: what basic indexing records for a slice that spans the whole dimension
    /// (`x[..., :n]` with `n` the size: `applySlicing` returns an alias, whose backward hands
    /// the gradient on).
    Alias,
    /// `select.int(self, dim, index)`.
    Select,
    /// `expand(self, size)`.
    Expand,
    /// `unbind.int(self, dim)`.
    Unbind,
    /// `split.Tensor(self, split_size, dim)`.
    Split,
    /// `chunk(self, chunks, dim)`.
    Chunk,
    /// `clone(self)` (also `.contiguous()` of a non-contiguous tensor).
    Clone,
    /// `_to_copy(self, dtype)`: `.to(dtype)` and autocast's casts.
    ToCopy,
    /// `index.Tensor(self, indices)`.
    Index,
    /// `gather(self, dim, index)` (DeBERTa-v2's relative scores): `gather_backward(grad, self,
    /// dim, index, sparse_grad)` reads `self` and `index`, so autograd keeps both
    /// (`GatherBackward0`'s `self_` and `index_`).
    Gather,
    /// `masked_fill.Scalar(self, mask, value)`: its backward is `grad.masked_fill(mask, 0)`,
    /// keeping the mask.
    MaskedFill,
    /// `masked_fill_.Scalar(self, mask, value)`: in place, keeping the mask as `masked_fill`.
    MaskedFillInplace,
    /// Composite: `(1 - input_mask).bool()` of a float padding mask (DeBERTa-v2's
    /// `ConvLayer`): a float temporary and the bool result, never recorded.
    InvertPaddingMask,
    /// `repeat(self, repeats)`: its backward sums over the repeats (sizes only).
    Repeat,
    /// `bitwise_not(self)` of a boolean mask (`~mask`): integer, never recorded.
    BitwiseNot,
    /// `ones(size)`: a factory (the all-ones attention mask a model makes when given none).
    Ones,
    /// Composite: DeBERTa-v2's `build_relative_position` (`arange` of the query and key
    /// positions, their difference, `make_log_bucket_position` when bucketed): an int64
    /// `[1, S, S]` tensor.
    BuildRelativePosition,
    /// Composite: DeBERTa-v2's `get_attention_mask` (`mask.unsqueeze(1).unsqueeze(2)` times
    /// its transpose): a `[B, 1, S, S]` tensor.
    GetAttentionMask,
    /// Composite: DeBERTa-v2's gather index `torch.clamp(relative_pos + att_span, 0,
    /// 2·att_span − 1)` (content-to-position), or of `-relative_pos` (position-to-content):
    /// int64, never recorded.
    RelativeIndex,
    /// `embedding(weight, indices, …)`.
    Embedding,
    /// Dropout: `native_dropout(input, p, train)` on CUDA (a bool mask), `_dropout_impl`'s
    /// multiplication by a noise tensor on the CPU.
    Dropout,
    /// `max_pool2d_with_indices(self, kernel_size, stride, padding, dilation, ceil_mode)`.
    MaxPool2dWithIndices,
    /// `avg_pool2d(self, kernel_size, stride, padding, …)`.
    AvgPool2d,
    /// `_adaptive_avg_pool2d(self, output_size)`.
    AdaptiveAvgPool2d,
    /// `upsample_nearest1d(self, output_size, scales)`.
    UpsampleNearest1d,
    /// `upsample_nearest2d(self, output_size, scales_h, scales_w)`.
    UpsampleNearest2d,
    /// `upsample_linear1d(self, output_size, align_corners, scales)`.
    UpsampleLinear1d,
    /// `upsample_bilinear2d(self, output_size, align_corners, scales_h, scales_w)`.
    UpsampleBilinear2d,
    /// `upsample_bicubic2d(self, output_size, align_corners, scales_h, scales_w)`.
    UpsampleBicubic2d,
    /// `constant_pad_nd(self, pad, value)`.
    ConstantPadNd,
    /// `reflection_pad1d(self, padding)`.
    ReflectionPad1d,
    /// `reflection_pad2d(self, padding)`.
    ReflectionPad2d,
    /// `reflection_pad3d(self, padding)`.
    ReflectionPad3d,
    /// `replication_pad1d(self, padding)`.
    ReplicationPad1d,
    /// `replication_pad2d(self, padding)`.
    ReplicationPad2d,
    /// `replication_pad3d(self, padding)`.
    ReplicationPad3d,
    /// `_pad_circular(self, pad)`: composite (slices of the input copied into a new tensor).
    PadCircular,
    /// `_scaled_dot_product_flash_attention(query, key, value, …)` (and its `_for_cpu` form).
    FlashAttention,
    /// `_scaled_dot_product_cudnn_attention(query, key, value, attn_bias, …)`: cuDNN's fused
    /// attention (`aten/src/ATen/native/transformers/cuda/attention.cu`); results: output,
    /// log-sum-exp and the two one-element int64 dropout RNG tensors, `philox_seed` and
    /// `philox_offset`, which its backward reads.
    CudnnAttention,
    /// `mkldnn_rnn_layer(input, weight0, weight1, weight2, weight3, hx_, cx_, reverse, …)`: one
    /// layer and direction of an LSTM on the CPU through oneDNN (`aten/src/ATen/native/mkldnn/
    /// RNN.cpp`); results: output, `hy`, `cy` and, under grad mode, oneDNN's `workspace` (uint8).
    MkldnnRnnLayer,
    /// `_cudnn_rnn(input, weight, weight_stride0, weight_buf, hx, cx, …)` of a GRU (no `cx`):
    /// every layer and direction in one cuDNN call; results: output, `hy`, `cy`, the `reserve`
    /// buffer and the flat weight buffer.
    CudnnRnn,
    /// `_cudnn_rnn` of an LSTM, with its cell state `cx`.
    CudnnLstm,
    /// Composite: one time step of ATen's `GRUCell` on the CPU (`aten/src/ATen/native/RNN.cpp`,
    /// the input projection computed beforehand for the whole sequence): `linear_hh(hx)` into
    /// hidden gates, `sigmoid_` of the reset and update gates (in place, in the hidden gates),
    /// `mul_` of the new gate's hidden part by the reset gate (keeping a clone of it), `tanh_`
    /// of the new gate, `(hx − n).mul_(z)` (keeping a clone of the difference), `add_(n)`.
    GruCell,
    /// Composite: one time step of ATen's `LSTMCell` on the CPU: `linear_hh(hx).add_(input
    /// gates)`, the four gate activations in place, `cy = f·cx + i·g`, `hy = o·tanh(cy)`.
    LstmCell,
    /// Composite: MoE dispatch (`argsort` of the routed experts, the gather of the token rows
    /// and the group offsets), keeping the permutation, its `// k`, its inverse and the offsets.
    MoeDispatch,
    /// Composite: DeepSeek's expert choice after the router's scores (`DeepseekV2TopkRouter`,
    /// `DeepseekV3TopkRouter`): the group-limited mask (per-group top-2 or maximum, the group
    /// `topk`, `scatter_`, the expanded mask, `masked_fill`), then `topk` and, for V3, `gather`
    /// from the scores; keeps the int64 indices of each `topk`/`max` and the boolean mask.
    GroupLimitedTopk,
    /// Composite: the `cos`/`sin` tables of a rotary embedding module.
    RotaryTables,
    /// Composite: `q * cos + rotate_half(q) * sin` (transformers' `apply_rotary_pos_emb`).
    ApplyRotary,
    /// Composite: transformers' `repeat_kv` (`expand` then `reshape`).
    RepeatKv,
    /// Composite: a KV-cache update (`DynamicCache.update`).
    CacheUpdate,
    /// Composite: SDPA's `convert_boolean_attn_mask` of a materialized boolean mask.
    BoolMaskToFloat,
    /// Composite: T5's `_shift_right` of the decoder input ids.
    ShiftRight,
    /// Composite: T5's `_relative_position_bucket`.
    RelativePositionBucket,
    /// `_c10d_functional::all_reduce` (what DTensor's `Partial → Replicate` and Megatron's
    /// `reduce_from_tensor_model_parallel_region` run): the output is a new tensor (the C++
    /// functional op clones its input, then reduces in place,
    /// `torch/csrc/distributed/c10d/Functional.cpp`); its backward hands the gradient on
    /// unchanged (`Replicate → Partial` costs nothing). Saves nothing.
    AllReduce,
    /// `_c10d_functional::all_gather_into_tensor` (`Shard → Replicate`; Megatron's
    /// `gather_from_sequence_parallel_region`): a new tensor `tp` times the input along the
    /// gathered dimension; its backward reduce-scatters, allocating the input-sized gradient.
    AllGather,
    /// `_c10d_functional::reduce_scatter_tensor` (`Partial → Shard`; Megatron's
    /// `reduce_scatter_to_sequence_parallel_region`): a new tensor of one `tp`-th of the input;
    /// its backward all-gathers, allocating the whole-sized gradient.
    ReduceScatter,
    /// DTensor's `Replicate → Shard` (`Shard._replicate_to_shard`: this rank's chunk of the
    /// local tensor, cloned): a new tensor of one chunk; its backward all-gathers.
    ShardSlice,
    /// Context parallelism's ring exchange of a key/value chunk (`send`/`recv` into a buffer of
    /// the chunk's size). Saves nothing.
    RingExchange,
    /// Not an operator: a block's Python frame returning, which releases its input.
    Return,
}

impl AtenOp {
    /// The ATen name (`addmm`, `native_layer_norm`, `relu_`); for a composite, the Python
    /// function it stands for.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            AtenOp::Addmm => "addmm",
            AtenOp::Mm => "mm",
            AtenOp::Bmm => "bmm",
            AtenOp::GroupedMm => "_grouped_mm",
            AtenOp::Convolution => "convolution",
            AtenOp::NativeBatchNorm => "native_batch_norm",
            AtenOp::NativeLayerNorm => "native_layer_norm",
            AtenOp::NativeGroupNorm => "native_group_norm",
            AtenOp::FusedRmsNorm => "_fused_rms_norm",
            AtenOp::Softmax => "_softmax",
            AtenOp::LogSoftmax => "_log_softmax",
            AtenOp::NllLoss => "nll_loss_forward",
            AtenOp::MseLoss => "mse_loss",
            AtenOp::Relu => "relu",
            AtenOp::ReluInplace => "relu_",
            AtenOp::Hardtanh => "hardtanh",
            AtenOp::HardtanhInplace => "hardtanh_",
            AtenOp::Hardswish => "hardswish",
            AtenOp::HardswishInplace => "hardswish_",
            AtenOp::Hardsigmoid => "hardsigmoid",
            AtenOp::HardsigmoidInplace => "hardsigmoid_",
            AtenOp::LeakyRelu => "leaky_relu",
            AtenOp::LeakyReluInplace => "leaky_relu_",
            AtenOp::Gelu => "gelu",
            AtenOp::BloomGelu => "GeLUFunction",
            AtenOp::Silu => "silu",
            AtenOp::SiluInplace => "silu_",
            AtenOp::Tanh => "tanh",
            AtenOp::Sigmoid => "sigmoid",
            AtenOp::Pow => "pow.Tensor_Scalar",
            AtenOp::Rsqrt => "rsqrt",
            AtenOp::Mul => "mul.Tensor",
            AtenOp::MulScalar => "mul.Scalar",
            AtenOp::Add => "add.Tensor",
            AtenOp::AddInplace => "add_.Tensor",
            AtenOp::AddScalar => "add.Scalar",
            AtenOp::Sub => "sub.Tensor",
            AtenOp::Neg => "neg",
            AtenOp::Clamp => "clamp",
            AtenOp::MaxDim => "max.dim",
            AtenOp::DivInplace => "div_.Tensor",
            AtenOp::Div => "div.Tensor",
            AtenOp::Mean => "mean.dim",
            AtenOp::Sum => "sum",
            AtenOp::Cat => "cat",
            AtenOp::Stack => "stack",
            AtenOp::MaskedScatter => "masked_scatter",
            AtenOp::EqScalar => "eq.Scalar",
            AtenOp::Topk => "topk",
            AtenOp::View => "view",
            AtenOp::Transpose => "transpose.int",
            AtenOp::Permute => "permute",
            AtenOp::Narrow => "narrow",
            AtenOp::Slice => "slice.Tensor",
            AtenOp::Alias => "alias",
            AtenOp::Select => "select.int",
            AtenOp::Expand => "expand",
            AtenOp::Unbind => "unbind.int",
            AtenOp::Split => "split.Tensor",
            AtenOp::Chunk => "chunk",
            AtenOp::Clone => "clone",
            AtenOp::ToCopy => "_to_copy",
            AtenOp::Index => "index.Tensor",
            AtenOp::Gather => "gather",
            AtenOp::MaskedFill => "masked_fill.Scalar",
            AtenOp::MaskedFillInplace => "masked_fill_.Scalar",
            AtenOp::InvertPaddingMask => "invert_padding_mask",
            AtenOp::Repeat => "repeat",
            AtenOp::BitwiseNot => "bitwise_not",
            AtenOp::Ones => "ones",
            AtenOp::BuildRelativePosition => "build_relative_position",
            AtenOp::GetAttentionMask => "get_attention_mask",
            AtenOp::RelativeIndex => "relative_index",
            AtenOp::Embedding => "embedding",
            AtenOp::Dropout => "native_dropout",
            AtenOp::MaxPool2dWithIndices => "max_pool2d_with_indices",
            AtenOp::AvgPool2d => "avg_pool2d",
            AtenOp::AdaptiveAvgPool2d => "_adaptive_avg_pool2d",
            AtenOp::UpsampleNearest1d => "upsample_nearest1d",
            AtenOp::UpsampleNearest2d => "upsample_nearest2d",
            AtenOp::UpsampleLinear1d => "upsample_linear1d",
            AtenOp::UpsampleBilinear2d => "upsample_bilinear2d",
            AtenOp::UpsampleBicubic2d => "upsample_bicubic2d",
            AtenOp::ConstantPadNd => "constant_pad_nd",
            AtenOp::ReflectionPad1d => "reflection_pad1d",
            AtenOp::ReflectionPad2d => "reflection_pad2d",
            AtenOp::ReflectionPad3d => "reflection_pad3d",
            AtenOp::ReplicationPad1d => "replication_pad1d",
            AtenOp::ReplicationPad2d => "replication_pad2d",
            AtenOp::ReplicationPad3d => "replication_pad3d",
            AtenOp::PadCircular => "_pad_circular",
            AtenOp::FlashAttention => "_scaled_dot_product_flash_attention",
            AtenOp::CudnnAttention => "_scaled_dot_product_cudnn_attention",
            AtenOp::MkldnnRnnLayer => "mkldnn_rnn_layer",
            AtenOp::CudnnRnn | AtenOp::CudnnLstm => "_cudnn_rnn",
            AtenOp::GruCell => "GRUCell",
            AtenOp::LstmCell => "LSTMCell",
            AtenOp::MoeDispatch => "moe_dispatch",
            AtenOp::GroupLimitedTopk => "group_limited_topk",
            AtenOp::RotaryTables => "rotary_embedding",
            AtenOp::ApplyRotary => "apply_rotary_pos_emb",
            AtenOp::RepeatKv => "repeat_kv",
            AtenOp::CacheUpdate => "cache_update",
            AtenOp::BoolMaskToFloat => "convert_boolean_attn_mask",
            AtenOp::ShiftRight => "_shift_right",
            AtenOp::RelativePositionBucket => "_relative_position_bucket",
            AtenOp::AllReduce => "_c10d_functional::all_reduce",
            AtenOp::AllGather => "_c10d_functional::all_gather_into_tensor",
            AtenOp::ReduceScatter => "_c10d_functional::reduce_scatter_tensor",
            AtenOp::ShardSlice => "Shard._replicate_to_shard",
            AtenOp::RingExchange => "ring send/recv",
            AtenOp::Return => "return",
        }
    }
}

/// A tensor an operator's backward reads, by its place in the `Call`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Saved {
    /// Input `i`.
    Input(usize),
    /// Input `i` when the call passes it (an optional argument such as a norm's `weight`).
    OptionalInput(usize),
    /// Output `i`.
    Output(usize),
    /// A clone of input `i`, taken before the in-place operator overwrites it (autograd's codegen
    /// saves `self.clone()` for an in-place operator whose formula reads `self`).
    InputClone(usize),
    /// Auxiliary tensor `i`: a further result that is not a traced value (statistics, indices, a
    /// mask) or an argument that is not one (group offsets, labels, rotary tables).
    Aux(usize),
}

/// What an operator saves for its backward, whenever autograd records it (some input requires
/// a gradient, in training).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SaveRule {
    /// Saved unconditionally.
    pub always: &'static [Saved],
    /// Inputs 0 and 1 are each saved for the other's gradient only: input 0 when input 1 needs a
    /// gradient, input 1 when input 0 does (`mul.Tensor`, `mm`, `addmm`'s `mat1`/`mat2`).
    pub each_other: bool,
}

impl SaveRule {
    /// Saves nothing but sizes and scalars.
    pub const NOTHING: SaveRule = SaveRule::always(&[]);
    /// Saves each of two factors for the other's gradient.
    pub const EACH_OTHER: SaveRule = SaveRule {
        always: &[],
        each_other: true,
    };

    /// Saves `saved` unconditionally.
    #[must_use]
    pub const fn always(saved: &'static [Saved]) -> SaveRule {
        SaveRule {
            always: saved,
            each_other: false,
        }
    }
}

/// An operator's calling convention in the tracer and its save rule: one row of the table.
#[derive(Clone, Copy, Debug)]
pub struct OpSpec {
    /// The `derivatives.yaml` entry the rule is checked against (`name.overload`), or `None` for
    /// a composite or an operator without one.
    pub yaml: Option<&'static str>,
    /// ATen's name for each input, in the order the tracer passes them.
    pub inputs: &'static [&'static str],
    /// ATen's name for each output value (`result`, or `result0`, … for a tuple).
    pub outputs: &'static [&'static str],
    /// ATen's name for each auxiliary tensor ([`Saved::Aux`]).
    pub aux: &'static [&'static str],
    /// What it saves.
    pub saves: SaveRule,
}

const fn spec(
    yaml: Option<&'static str>,
    inputs: &'static [&'static str],
    outputs: &'static [&'static str],
    aux: &'static [&'static str],
    saves: SaveRule,
) -> OpSpec {
    OpSpec {
        yaml,
        inputs,
        outputs,
        aux,
        saves,
    }
}

/// One input, one output, saving `saves` (`relu`, `gelu`, `clone`, …).
const fn unary(yaml: &'static str, saves: SaveRule) -> OpSpec {
    spec(Some(yaml), &["self"], &["result"], &[], saves)
}

/// A view or copy with no entry to check (composite in ATen, or a composite of memest's).
const fn plain(inputs: &'static [&'static str]) -> OpSpec {
    spec(None, inputs, &["result"], &[], SaveRule::NOTHING)
}

use Saved::{Aux, Input, InputClone, OptionalInput, Output};

impl AtenOp {
    /// Whether the operator writes into its first input (`relu_`, `add_`).
    #[must_use]
    pub const fn is_inplace(self) -> bool {
        matches!(
            self,
            AtenOp::ReluInplace
                | AtenOp::HardtanhInplace
                | AtenOp::HardswishInplace
                | AtenOp::HardsigmoidInplace
                | AtenOp::LeakyReluInplace
                | AtenOp::SiluInplace
                | AtenOp::AddInplace
                | AtenOp::DivInplace
                | AtenOp::MaskedFillInplace
        )
    }

    /// Whether the backward computes its inputs' gradients one formula per input, in the order
    /// of the inputs' names (`mm`: `mat2`'s, then `self`'s; `mul.Tensor`: `other`'s, then
    /// `self`'s; `addmm`: `mat1`, `mat2`, `self`). PyTorch's autograd codegen reads each
    /// `derivatives.yaml` entry's formulas in sorted order of their keys
    /// (`tools/autograd/load_derivatives.py`, `set_up_derivatives`:
    /// `for raw_names in sorted(defn.keys())`), and the generated `MmBackward0::apply` computes
    /// them in that order; a `TorchDispatchMode` over `nn.Linear(8, 5, bias=False)`'s backward
    /// shows the weight's `mm` before the input's. `false` for one formula over several inputs
    /// (`native_layer_norm`'s `input, weight, bias`: the kernel's order) and for the composites.
    #[must_use]
    pub const fn grads_by_name(self) -> bool {
        matches!(
            self,
            AtenOp::Addmm
                | AtenOp::Mm
                | AtenOp::Bmm
                | AtenOp::GroupedMm
                | AtenOp::Mul
                | AtenOp::Add
                | AtenOp::AddInplace
                | AtenOp::Sub
                | AtenOp::MaskedScatter
        )
    }

    /// What autograd saves for this operator's backward.
    #[must_use]
    pub const fn saves(self) -> SaveRule {
        self.spec().saves
    }

    /// The operator's row of the table: its calling convention and what it saves.
    #[must_use]
    #[allow(clippy::too_many_lines)] // one arm per operator: the table
    pub const fn spec(self) -> OpSpec {
        const IN: SaveRule = SaveRule::always(&[Input(0)]);
        const OUT: SaveRule = SaveRule::always(&[Output(0)]);
        const CLONE: SaveRule = SaveRule::always(&[InputClone(0)]);
        const NORM: SaveRule =
            SaveRule::always(&[Input(0), OptionalInput(1), OptionalInput(2), Aux(0), Aux(1)]);
        match self {
            AtenOp::Addmm => spec(
                Some("addmm"),
                &["mat1", "mat2", "self"],
                &["result"],
                &[],
                SaveRule::EACH_OTHER,
            ),
            AtenOp::Mm => spec(
                Some("mm"),
                &["self", "mat2"],
                &["result"],
                &[],
                SaveRule::EACH_OTHER,
            ),
            // derivatives.yaml guards each save by the other's requires_grad; memest keeps both
            // (attention's operands always both need a gradient, except under LoRA on `v` only).
            AtenOp::Bmm => spec(
                Some("bmm"),
                &["self", "mat2"],
                &["result"],
                &[],
                SaveRule::always(&[Input(0), Input(1)]),
            ),
            AtenOp::GroupedMm => spec(
                Some("_grouped_mm"),
                &["self", "mat2"],
                &["result"],
                &["offs"],
                SaveRule {
                    always: &[Aux(0)],
                    each_other: true,
                },
            ),
            AtenOp::Convolution => spec(
                Some("convolution"),
                &["input", "weight", "bias"],
                &["result"],
                &[],
                SaveRule::always(&[Input(0), Input(1)]),
            ),
            // The running statistics are buffers, alive all step: memest does not pass them.
            AtenOp::NativeBatchNorm => spec(
                Some("native_batch_norm"),
                &["input", "weight", "bias"],
                &["result0"],
                &["result1", "result2"],
                SaveRule::always(&[Input(0), OptionalInput(1), Aux(0), Aux(1)]),
            ),
            AtenOp::NativeLayerNorm => spec(
                Some("native_layer_norm"),
                &["input", "weight", "bias"],
                &["result0"],
                &["result1", "result2"],
                NORM,
            ),
            AtenOp::FusedRmsNorm => spec(
                Some("_fused_rms_norm"),
                &["input", "weight"],
                &["result0"],
                &["result1"],
                SaveRule::always(&[Input(0), OptionalInput(1), Aux(0)]),
            ),
            AtenOp::NativeGroupNorm => spec(
                Some("native_group_norm"),
                &["input", "weight", "bias"],
                &["result0"],
                &["result1", "result2"],
                SaveRule::always(&[Input(0), OptionalInput(1), Aux(0), Aux(1)]),
            ),
            AtenOp::Softmax => unary("_softmax", OUT),
            AtenOp::LogSoftmax => unary("_log_softmax", OUT),
            AtenOp::NllLoss => spec(
                Some("nll_loss_forward"),
                &["self"],
                &["output"],
                &["target", "total_weight"],
                SaveRule::always(&[Input(0), Aux(0), Aux(1)]),
            ),
            AtenOp::MseLoss => spec(
                Some("mse_loss"),
                &["self"],
                &["result"],
                &["target"],
                SaveRule::always(&[Input(0), Aux(0)]),
            ),
            AtenOp::Relu | AtenOp::ReluInplace => unary("relu", OUT),
            AtenOp::Hardtanh => unary("hardtanh", IN),
            AtenOp::HardtanhInplace => unary("hardtanh", CLONE),
            AtenOp::Hardswish => unary("hardswish", IN),
            AtenOp::HardswishInplace => unary("hardswish", CLONE),
            AtenOp::Hardsigmoid => unary("hardsigmoid", IN),
            AtenOp::HardsigmoidInplace => unary("hardsigmoid", CLONE),
            AtenOp::LeakyRelu => unary("leaky_relu", IN),
            AtenOp::LeakyReluInplace => unary("leaky_relu_", OUT),
            AtenOp::Gelu => unary("gelu", IN),
            AtenOp::BloomGelu => spec(None, &["input"], &["result"], &[], IN),
            AtenOp::Silu => unary("silu", IN),
            AtenOp::SiluInplace => unary("silu", CLONE),
            AtenOp::Tanh => unary("tanh", OUT),
            AtenOp::Sigmoid => unary("sigmoid", OUT),
            AtenOp::Pow => unary("pow.Tensor_Scalar", IN),
            AtenOp::Rsqrt => unary("rsqrt", OUT),
            AtenOp::Mul => spec(
                Some("mul.Tensor"),
                &["self", "other"],
                &["result"],
                &[],
                SaveRule::EACH_OTHER,
            ),
            AtenOp::MulScalar => unary("mul.Scalar", SaveRule::NOTHING),
            AtenOp::Add | AtenOp::AddInplace => spec(
                Some("add.Tensor"),
                &["self", "other"],
                &["result"],
                &[],
                SaveRule::NOTHING,
            ),
            AtenOp::AddScalar => unary("add.Scalar", SaveRule::NOTHING),
            AtenOp::Sub => spec(
                Some("sub.Tensor"),
                &["self", "other"],
                &["result"],
                &[],
                SaveRule::NOTHING,
            ),
            // `clamp_backward(grad, self, min, max)`: the input.
            AtenOp::Clamp => unary("clamp", IN),
            // `value_selecting_reduction_backward_symint(grad, dim, indices, self.sym_sizes(),
            // keepdim)`: the indices only.
            AtenOp::MaxDim => spec(
                Some("max.dim"),
                &["self"],
                &["values"],
                &["indices"],
                SaveRule::always(&[Aux(0)]),
            ),
            // `topv /= topv.sum(-1, keepdim=True)` (MoE routing): `div_.Tensor` saves `other`
            // and a clone of `self`; the sum is computed inside the step, so both are auxiliaries.
            AtenOp::DivInplace => spec(
                None,
                &["self"],
                &["result"],
                &["other", "self_clone"],
                SaveRule::always(&[Aux(0), Aux(1)]),
            ),
            // `div.Tensor` saves `other` for `self`'s gradient (`self` only for `other`'s, which
            // a count of labels does not need); the divisor is not a traced value: an auxiliary.
            AtenOp::Div => spec(
                None,
                &["self"],
                &["result"],
                &["other"],
                SaveRule::always(&[Aux(0)]),
            ),
            AtenOp::Mean => unary("mean.dim", SaveRule::NOTHING),
            AtenOp::Sum => unary("sum", SaveRule::NOTHING),
            AtenOp::Cat => spec(
                Some("cat"),
                &["tensors"],
                &["result"],
                &[],
                SaveRule::NOTHING,
            ),
            // Backward: `grad.masked_fill(mask, 0)` for `self`, `masked_scatter_backward(grad,
            // mask, source.sizes())` for `source`: the mask is kept, not the tensors.
            AtenOp::MaskedScatter => spec(
                Some("masked_scatter"),
                &["self", "source"],
                &["result"],
                &["mask"],
                SaveRule::always(&[Aux(0)]),
            ),
            // Integer input: autograd does not record it.
            AtenOp::EqScalar => plain(&["self"]),
            AtenOp::Topk => spec(
                Some("topk"),
                &["self"],
                &["values"],
                &["indices"],
                SaveRule::always(&[Aux(0)]),
            ),
            AtenOp::View => unary("view", SaveRule::NOTHING),
            AtenOp::Transpose => unary("transpose.int", SaveRule::NOTHING),
            AtenOp::Permute => unary("permute", SaveRule::NOTHING),
            AtenOp::Select => unary("select.int", SaveRule::NOTHING),
            AtenOp::Slice => unary("slice.Tensor", SaveRule::NOTHING),
            AtenOp::Alias => unary("alias", SaveRule::NOTHING),
            AtenOp::Stack => spec(
                Some("stack"),
                &["tensors"],
                &["result"],
                &[],
                SaveRule::NOTHING,
            ),
            AtenOp::Neg => unary("neg", SaveRule::NOTHING),
            AtenOp::Expand => unary("expand", SaveRule::NOTHING),
            AtenOp::Unbind => unary("unbind.int", SaveRule::NOTHING),
            AtenOp::Split => unary("split.Tensor", SaveRule::NOTHING),
            AtenOp::Clone => unary("clone", SaveRule::NOTHING),
            AtenOp::ToCopy => unary("_to_copy", SaveRule::NOTHING),
            AtenOp::Narrow | AtenOp::Chunk => plain(&["self"]),
            AtenOp::Index => spec(
                Some("index.Tensor"),
                &["self"],
                &["result"],
                &["indices"],
                SaveRule::always(&[Aux(0)]),
            ),
            AtenOp::Gather => spec(
                Some("gather"),
                &["self"],
                &["result"],
                &["index"],
                SaveRule::always(&[Input(0), Aux(0)]),
            ),
            AtenOp::MaskedFill | AtenOp::MaskedFillInplace => spec(
                Some("masked_fill.Scalar"),
                &["self"],
                &["result"],
                &["mask"],
                SaveRule::always(&[Aux(0)]),
            ),
            AtenOp::Repeat => unary("repeat", SaveRule::NOTHING),
            // Integer and factory operators: autograd does not record them.
            AtenOp::BitwiseNot
            | AtenOp::Ones
            | AtenOp::BuildRelativePosition
            | AtenOp::GetAttentionMask
            | AtenOp::RelativeIndex
            | AtenOp::InvertPaddingMask => plain(&["self"]),
            AtenOp::Embedding => spec(
                Some("embedding"),
                &["weight", "indices"],
                &["result"],
                &[],
                SaveRule::always(&[Input(1)]),
            ),
            AtenOp::Dropout => spec(
                Some("native_dropout"),
                &["input"],
                &["result0"],
                &["result1"],
                SaveRule::always(&[Aux(0)]),
            ),
            AtenOp::MaxPool2dWithIndices => spec(
                Some("max_pool2d_with_indices"),
                &["self"],
                &["result0"],
                &["result1"],
                SaveRule::always(&[Input(0), Aux(0)]),
            ),
            AtenOp::AvgPool2d => unary("avg_pool2d", IN),
            AtenOp::AdaptiveAvgPool2d => unary("_adaptive_avg_pool2d", IN),
            // Their backward reads only `self.sym_sizes()`.
            AtenOp::UpsampleNearest1d => unary("upsample_nearest1d", SaveRule::NOTHING),
            AtenOp::UpsampleNearest2d => unary("upsample_nearest2d", SaveRule::NOTHING),
            AtenOp::UpsampleLinear1d => unary("upsample_linear1d", SaveRule::NOTHING),
            AtenOp::UpsampleBilinear2d => unary("upsample_bilinear2d", SaveRule::NOTHING),
            AtenOp::UpsampleBicubic2d => unary("upsample_bicubic2d", SaveRule::NOTHING),
            AtenOp::ConstantPadNd => unary("constant_pad_nd", SaveRule::NOTHING),
            // `reflection_pad2d_backward(grad, self, padding)` reads the input.
            AtenOp::ReflectionPad1d => unary("reflection_pad1d", IN),
            AtenOp::ReflectionPad2d => unary("reflection_pad2d", IN),
            AtenOp::ReflectionPad3d => unary("reflection_pad3d", IN),
            AtenOp::ReplicationPad1d => unary("replication_pad1d", IN),
            AtenOp::ReplicationPad2d => unary("replication_pad2d", IN),
            AtenOp::ReplicationPad3d => unary("replication_pad3d", IN),
            // CompositeImplicitAutograd: its slices and copies save only sizes.
            AtenOp::PadCircular => plain(&["self"]),
            AtenOp::FlashAttention => spec(
                Some("_scaled_dot_product_flash_attention_for_cpu"),
                &["query", "key", "value", "attn_mask"],
                &["output"],
                &["logsumexp"],
                SaveRule::always(&[
                    Input(0),
                    Input(1),
                    Input(2),
                    OptionalInput(3),
                    Output(0),
                    Aux(0),
                ]),
            ),
            // `_scaled_dot_product_cudnn_attention_backward(grad, query, key, value, output,
            // logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k, …)`.
            AtenOp::CudnnAttention => spec(
                Some("_scaled_dot_product_cudnn_attention"),
                &["query", "key", "value", "attn_bias"],
                &["output"],
                &["logsumexp", "philox_seed", "philox_offset"],
                SaveRule::always(&[
                    Input(0),
                    Input(1),
                    Input(2),
                    OptionalInput(3),
                    Output(0),
                    Aux(0),
                    Aux(1),
                    Aux(2),
                ]),
            ),
            // Every input and result but `hy`/`cy` is passed to the backward
            // (`mkldnn_rnn_layer_backward`): the input, the four weights (the biases, or the
            // zeros `mkldnn_rnn` passes instead of them), `hx_`, `cx_`, output, `hy`, `cy` and
            // the workspace.
            AtenOp::MkldnnRnnLayer => spec(
                Some("mkldnn_rnn_layer"),
                &[
                    "input", "weight0", "weight1", "weight2", "weight3", "hx_", "cx_",
                ],
                &["result0"],
                &["result1", "result2", "result3"],
                SaveRule::always(&[
                    Input(0),
                    Input(1),
                    Input(2),
                    Input(3),
                    Input(4),
                    Input(5),
                    Input(6),
                    Output(0),
                    Aux(0),
                    Aux(1),
                    Aux(2),
                ]),
            ),
            // `_cudnn_rnn_backward(input, weight, .., result4, hx, cx, result0, .., result3)`:
            // the weights from position 2 (`hx`, `cx` first), the reserve as auxiliary 0.
            AtenOp::CudnnRnn => spec(
                Some("_cudnn_rnn"),
                &["input", "hx", "weight"],
                &["result0"],
                &["result3"],
                SaveRule::always(&[Input(0), Input(1), Input(2), Output(0), Aux(0)]),
            ),
            AtenOp::CudnnLstm => spec(
                Some("_cudnn_rnn"),
                &["input", "hx", "cx", "weight"],
                &["result0"],
                &["result3"],
                SaveRule::always(&[Input(0), Input(1), Input(2), Input(3), Output(0), Aux(0)]),
            ),
            // `addmm` keeps `hx`; `sigmoid_` keeps the hidden gates (their storage holds r and
            // z); `mul_` keeps r and a clone of the new gate's hidden part; `tanh_` keeps n;
            // the second `mul_` keeps z and a clone of `hx − n`.
            AtenOp::GruCell => spec(
                None,
                &["hx", "input_gates", "weight_hh", "bias_hh"],
                &["hy"],
                &[
                    "hidden_gates",
                    "hidden_new_clone",
                    "new_gate",
                    "difference_clone",
                ],
                SaveRule::always(&[Input(0), Aux(0), Aux(1), Aux(2), Aux(3)]),
            ),
            // `addmm` keeps `hx`; the in-place activations keep the gates (one storage);
            // `f·cx` keeps `cx`; `tanh(cy)` keeps its result (`o·tanh(cy)` reads it and o).
            AtenOp::LstmCell => spec(
                None,
                &["hx", "cx", "input_gates", "weight_hh", "bias_hh"],
                &["cy", "hy"],
                &["gates", "tanh_cy"],
                SaveRule::always(&[Input(0), Input(1), Aux(0), Aux(1)]),
            ),
            AtenOp::MoeDispatch => spec(
                None,
                &["hidden_states"],
                &["result"],
                &["perm_div_k", "perm", "inverse_perm", "offs"],
                SaveRule::always(&[Aux(0), Aux(1), Aux(2), Aux(3)]),
            ),
            // Every auxiliary (indices, the inverted mask) is kept.
            AtenOp::GroupLimitedTopk => spec(
                None,
                &["scores"],
                &["topk_weights"],
                &[
                    "group_top_indices",
                    "group_indices",
                    "inverted_mask",
                    "indices",
                ],
                SaveRule::always(&[Aux(0), Aux(1), Aux(2), Aux(3)]),
            ),
            AtenOp::ApplyRotary => spec(
                None,
                &["q"],
                &["result"],
                &["cos", "sin"],
                SaveRule::always(&[Aux(0), Aux(1)]),
            ),
            AtenOp::RotaryTables
            | AtenOp::RepeatKv
            | AtenOp::CacheUpdate
            | AtenOp::ShiftRight
            | AtenOp::BoolMaskToFloat
            | AtenOp::RelativePositionBucket
            | AtenOp::AllReduce
            | AtenOp::AllGather
            | AtenOp::ReduceScatter
            | AtenOp::ShardSlice
            | AtenOp::RingExchange
            | AtenOp::Return => plain(&["self"]),
        }
    }
}

#[cfg(test)]
mod tests;
