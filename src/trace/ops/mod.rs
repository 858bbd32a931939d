//! The per-kind tracers, one file per family: each kind's pure shape function
//! (`out_shape(&Cfg, &Shape)`, unit-tested without a tape) and the operators it runs.

mod conv;
mod einsum;
mod embed;
mod linear;
mod norm;
mod pointwise;
mod pool;
mod resize;
mod rnn;
mod view;

#[allow(clippy::wildcard_imports)]
use super::*;

/// Why a pure shape function refused its input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(in crate::trace) enum ShapeError {
    /// The input does not fit the layer: what the layer's error says.
    Invalid(LayerErrorKind),
    /// A size overflowed 64 bits: what was being computed.
    Overflow(&'static str),
}

/// A [`ShapeError::Invalid`] with this message.
fn invalid<T>(message: String) -> Result<T, ShapeError> {
    Err(ShapeError::Invalid(LayerErrorKind::Input(message)))
}

/// The input `x` has the wrong rank; the layer takes `expected` (e.g. `[batch, channels, height,
/// width]`).
fn wrong_rank<T>(x: &Shape, expected: impl Into<String>) -> Result<T, ShapeError> {
    Err(ShapeError::Invalid(LayerErrorKind::Rank {
        input: x.clone(),
        expected: expected.into(),
    }))
}

/// Dimension `what` of the input `x` is `got`, where the layer's `key` says `expected`.
fn wrong_size<T>(
    x: &Shape,
    what: &'static str,
    got: u64,
    key: &'static str,
    expected: u64,
) -> Result<T, ShapeError> {
    Err(ShapeError::Invalid(LayerErrorKind::Size {
        input: x.clone(),
        what,
        got,
        key,
        expected,
    }))
}

/// A checked size, or [`ShapeError::Overflow`] naming `what`.
fn sized(v: Option<u64>, what: &'static str) -> Result<u64, ShapeError> {
    v.ok_or(ShapeError::Overflow(what))
}

impl Tracer<'_> {
    /// Traces one operation (the layer `layer`, reading `inputs`) and returns its output.
    pub(super) fn op_inner(
        &mut self,
        op: &Op,
        layer: &Layer,
        inputs: &[ValueId],
    ) -> Result<ValueId, Error> {
        let x = inputs[0];
        let train = layer.trainable;
        match op {
            Op::Linear(c) => self.linear_layer(c, &layer.name, x, train),
            Op::Conv(c) => self.conv(c, x, train),
            Op::BatchNorm(c) => self.batch_norm(c, x, train),
            Op::LayerNorm(c) => self.layer_norm(c, x, train),
            Op::RmsNorm(c) => self.rms_norm_layer(c, x, train),
            Op::GroupNorm(c) => self.group_norm(c, x, train),
            Op::Embedding(c) => self.embedding(c, &layer.name, x, train),
            Op::PositionEmbedding(c) => self.position_embedding(c, x, train),
            Op::TokenTypeEmbedding(c) => self.token_type_embedding(c, x, train),
            Op::Rotary(c) => self.rotary(c, x),
            Op::RelativePositionBias(c) => self.relative_position_bias(c, x, train),
            Op::RelativeEmbeddings(c) => self.relative_embeddings(c, x, train),
            Op::DisentangledAttention(c) => self.disentangled_attention(x, c, train),
            Op::PaddingMask(c) => self.padding_mask(c, x),
            Op::Parameter(c) => self.parameter(c, x, train),
            Op::Dropout(c) => self.dropout(x, c.p, c.inplace),
            Op::Activation(act) => self.activation(x, *act),
            Op::Softmax(c) => self.softmax(c, x),
            Op::Mul => self.mul(inputs[0], inputs[1]),
            Op::Add(c) => {
                if c.keep_inputs {
                    self.keep_to_return(inputs);
                }
                self.add(inputs, c.inplace)
            }
            Op::Concat(c) => self.concat_layer(c, inputs),
            Op::MaskedScatter => self.masked_scatter(inputs[0], inputs[1], inputs[2]),
            Op::MaxPool2d(c) => self.max_pool2d(c, x),
            Op::AvgPool2d(c) => self.avg_pool2d(c, x),
            Op::AdaptiveAvgPool2d(c) => self.adaptive_avg_pool2d(c, x),
            Op::Upsample(c) => self.upsample(c, x),
            Op::Pad(c) => self.pad(c, x),
            Op::Flatten(c) => self.flatten(c, x),
            Op::Reshape(c) => self.reshape_layer(c, x),
            Op::Permute(c) => self.permute(c, x),
            Op::Narrow(c) => self.narrow(c, x),
            Op::Transpose(c) => self.transpose(c, x),
            Op::Select(c) => self.select(c, x),
            Op::Attention(c) => self.attention(x, x, c, train),
            Op::CrossAttention(c) => self.attention(inputs[0], inputs[1], c, train),
            Op::Moe(c) => self.moe(x, c, train),
            Op::Mla(c) => self.mla(x, c, train),
            Op::Rnn(c) => self.rnn(c, x, train),
            Op::Einsum(c) => self.einsum(c, inputs[0], inputs[1]),
            Op::Sdpa(c) => self.sdpa_layer(c, inputs[0], inputs[1], inputs[2]),
            Op::StochasticDepth(c) => self.stochastic_depth(c, x),
            Op::ShiftRight => self.shift_right(x),
            Op::Scale(c) => {
                let y = if c.factor.is_some() {
                    self.unary(x, AtenOp::MulScalar)?
                } else {
                    x
                };
                if c.offset.is_some() {
                    self.unary(y, AtenOp::AddScalar)
                } else {
                    Ok(y)
                }
            }
            Op::CrossEntropy(c) => self.cross_entropy(x, c.shift, c.upcast),
            Op::MseLoss(c) => self.mse_loss(x, c.upcast),
        }
    }

    /// A shape function's result as this layer's error.
    fn shaped<T>(&self, r: Result<T, ShapeError>) -> Result<T, Error> {
        r.map_err(|e| match e {
            ShapeError::Invalid(kind) => Error::layer(self.label.clone(), kind),
            ShapeError::Overflow(what) => Error::Overflow(what.to_string()),
        })
    }

    /// The feature (last) dimension of a float `[batch, .., features]` input.
    pub(in crate::trace) fn last_dim(&self, v: &Value, kind: &str) -> Result<u64, Error> {
        if v.shape.rank() < 2 {
            return self.shaped(wrong_rank(
                &v.shape,
                format!("[batch, .., features] for {kind}"),
            ));
        }
        if !v.dtype.is_float() {
            return Err(self.err(format!(
                "input is {} {}, expected a float tensor (token ids need an embedding first)",
                v.dtype, v.shape
            )));
        }
        Ok(v.shape.last().unwrap_or(0))
    }

    /// The dimensions of a `[batch, channels, height, width]` input.
    pub(in crate::trace) fn nchw(&self, v: &Value) -> Result<(u64, u64, u64, u64), Error> {
        match *v.shape.dims() {
            [b, c, h, w] => Ok((b, c, h, w)),
            _ => self.shaped(wrong_rank(&v.shape, "[batch, channels, height, width]")),
        }
    }

    /// The dimensions of a `[batch, seq, hidden]` input.
    pub(in crate::trace) fn bsh(&self, v: &Value) -> Result<(u64, u64, u64), Error> {
        match *v.shape.dims() {
            [b, s, h] => Ok((b, s, h)),
            _ => self.shaped(wrong_rank(&v.shape, "[batch, seq, hidden]")),
        }
    }

    /// The value of an attention layer's input and its `[batch, seq, hidden]` dimensions,
    /// checked to be floating-point hidden states (attention, DeBERTa's disentangled attention,
    /// MLA).
    pub(in crate::trace) fn hidden_states(
        &self,
        x: ValueId,
    ) -> Result<(Value, (u64, u64, u64)), Error> {
        let xv = self.val(x).clone();
        let bsh = self.bsh(&xv)?;
        if !xv.dtype.is_float() {
            return Err(self.err(format!(
                "input is {} {}, expected float hidden states",
                xv.dtype, xv.shape
            )));
        }
        Ok((xv, bsh))
    }

    /// The weight of the embedding called `name` (`tie`), checked to be `[rows, cols]`.
    pub(super) fn tied(&self, name: &str, rows: u64, cols: u64) -> Result<ValueId, Error> {
        let w = *self.embeddings.get(name).ok_or_else(|| {
            self.err(format!(
                "`tie` names `{name}`, which is not an embedding traced before this layer"
            ))
        })?;
        let ws = &self.val(w).shape;
        if ws.dims() != [rows, cols] {
            return Err(self.err(format!(
                "tied weight `{name}` has shape {ws}, expected [{rows}, {cols}]"
            )));
        }
        Ok(w)
    }
}

/// The index of dimension `dim` (negative counts from the end) of a rank-`rank` input.
fn axis(dim: i64, rank: usize) -> Result<usize, ShapeError> {
    let r = i64::try_from(rank).unwrap_or(i64::MAX);
    let a = if dim < 0 { dim + r } else { dim };
    if (0..r).contains(&a) {
        Ok(usize::try_from(a).unwrap_or(0))
    } else {
        invalid(format!(
            "dimension {dim} is out of range for a rank-{rank} input"
        ))
    }
}

/// Rejects an axis that would merge or extend the batch dimension.
fn batch_kept(axis: usize, what: &str) -> Result<usize, ShapeError> {
    if axis == 0 {
        return invalid(format!(
            "{what} cannot act on the batch dimension (dimension 0)"
        ));
    }
    Ok(axis)
}

/// Output length of a sliding window (conv, pooling) over `len` with kernel `k`, stride `s`,
/// padding `p` and dilation `d`, as `torch.nn` documents it:
/// `floor((len + 2p − d(k − 1) − 1)/s) + 1`, rounded up with `ceil` (a window that starts in
/// the right padding is dropped). `shape` is the input, for the error.
#[allow(clippy::too_many_arguments)]
fn window_out(
    len: u64,
    k: u64,
    s: u64,
    p: u64,
    d: u64,
    ceil: bool,
    shape: &Shape,
) -> Result<u64, ShapeError> {
    let padded = sized(len.checked_add(p.saturating_mul(2)), "a padded size")?;
    let span = sized(
        d.checked_mul(k - 1).and_then(|v| v.checked_add(1)),
        "a kernel span",
    )?;
    if padded < span {
        return invalid(format!(
            "input {shape} is too small: a window of {span} (kernel {k}, dilation {d}) does not fit in {len} + 2×{p} padding"
        ));
    }
    let mut out = (padded - span) / s + 1;
    if ceil && (padded - span) % s != 0 {
        out += 1;
        // PyTorch drops a last window that would start in the right padding; a product past
        // 64 bits starts past it too.
        if (out - 1)
            .checked_mul(s)
            .is_none_or(|start| start >= len + p)
        {
            out -= 1;
        }
    }
    Ok(out)
}

/// Statistics dtype of norms: float32 for 16-bit inputs (ATen's `acc_type`), else the input's.
fn stats_dtype(dtype: DType) -> DType {
    match dtype {
        DType::Float16 | DType::Bfloat16 => DType::Float32,
        d => d,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_lengths() {
        let x = Shape::from([1, 1, 8]);
        // (8 + 2 − 3)/1 + 1 = 8; (8 + 0 − 2·2 − 1)/2 + 1 = 2.
        assert_eq!(window_out(8, 3, 1, 1, 1, false, &x), Ok(8));
        assert_eq!(window_out(8, 3, 2, 0, 2, false, &x), Ok(2));
        // ceil_mode: (7 − 2)/2 + 1 = 3.5 → 4.
        assert_eq!(window_out(7, 2, 2, 0, 1, true, &x), Ok(4));
        assert!(matches!(
            window_out(2, 5, 1, 0, 1, false, &x),
            Err(ShapeError::Invalid(_))
        ));
    }

    #[test]
    fn axes() {
        assert_eq!(axis(-1, 3), Ok(2));
        assert_eq!(axis(1, 3), Ok(1));
        assert!(axis(3, 3).is_err());
        assert!(batch_kept(0, "flatten").is_err());
    }
}
