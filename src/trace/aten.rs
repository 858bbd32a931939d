//! The operators memest models, named as ATen names them.
//!
//! Each [`Step`](super::Step) of the tape is one [`AtenOp`]: an ATen operator as autograd records
//! it (`addmm`, `native_layer_norm`, `_softmax`, …), or, for a few module programs that PyTorch
//! runs as several small operators memest does not trace one by one, a composite named after the
//! Python code it stands for (`rotary`, `repeat_kv`). [`AtenOp::name`] gives the ATen name.

/// An operator of the tape.
///
/// In-place variants (`relu_`, `add_`, …) are their own operators: autograd may save something
/// else for them than for the out-of-place form (`leaky_relu_` keeps its result, `leaky_relu`
/// its input).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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
    /// `_softmax(self, dim, half_to_float)`.
    Softmax,
    /// `_log_softmax(self, dim, half_to_float)`.
    LogSoftmax,
    /// `nll_loss_forward(self, target, weight, reduction, ignore_index)`.
    NllLoss,
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
    /// `div_.Tensor(self, other)`.
    DivInplace,
    /// `mean.dim(self, dim, keepdim)`.
    Mean,
    /// `sum(self)` / `sum.dim_IntList(self, dim, keepdim)`.
    Sum,
    /// `cat(tensors, dim)`.
    Cat,
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
    /// `_scaled_dot_product_flash_attention(query, key, value, …)` (and its `_for_cpu` form).
    FlashAttention,
    /// Composite: the `cos`/`sin` tables of a rotary embedding module.
    RotaryTables,
    /// Composite: `q * cos + rotate_half(q) * sin` (transformers' `apply_rotary_pos_emb`).
    ApplyRotary,
    /// Composite: transformers' `repeat_kv` (`expand` then `reshape`).
    RepeatKv,
    /// Composite: a KV-cache update (`DynamicCache.update`).
    CacheUpdate,
    /// Composite: T5's `_shift_right` of the decoder input ids.
    ShiftRight,
    /// Composite: T5's `_relative_position_bucket`.
    RelativePositionBucket,
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
            AtenOp::Softmax => "_softmax",
            AtenOp::LogSoftmax => "_log_softmax",
            AtenOp::NllLoss => "nll_loss_forward",
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
            AtenOp::DivInplace => "div_.Tensor",
            AtenOp::Mean => "mean.dim",
            AtenOp::Sum => "sum",
            AtenOp::Cat => "cat",
            AtenOp::Topk => "topk",
            AtenOp::View => "view",
            AtenOp::Transpose => "transpose.int",
            AtenOp::Permute => "permute",
            AtenOp::Narrow => "narrow",
            AtenOp::Select => "select.int",
            AtenOp::Expand => "expand",
            AtenOp::Unbind => "unbind.int",
            AtenOp::Split => "split.Tensor",
            AtenOp::Chunk => "chunk",
            AtenOp::Clone => "clone",
            AtenOp::ToCopy => "_to_copy",
            AtenOp::Index => "index.Tensor",
            AtenOp::Embedding => "embedding",
            AtenOp::Dropout => "native_dropout",
            AtenOp::MaxPool2dWithIndices => "max_pool2d_with_indices",
            AtenOp::AvgPool2d => "avg_pool2d",
            AtenOp::AdaptiveAvgPool2d => "_adaptive_avg_pool2d",
            AtenOp::FlashAttention => "_scaled_dot_product_flash_attention",
            AtenOp::RotaryTables => "rotary_embedding",
            AtenOp::ApplyRotary => "apply_rotary_pos_emb",
            AtenOp::RepeatKv => "repeat_kv",
            AtenOp::CacheUpdate => "cache_update",
            AtenOp::ShiftRight => "_shift_right",
            AtenOp::RelativePositionBucket => "_relative_position_bucket",
            AtenOp::Return => "return",
        }
    }
}
