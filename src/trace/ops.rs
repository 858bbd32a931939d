//! The per-kind dispatch: each layer kind's shape checks and the operators it runs.

#[allow(clippy::wildcard_imports)]
use super::*;

impl Tracer<'_> {
    #[allow(clippy::too_many_lines)] // one arm per operation
    pub(super) fn op_inner(
        &mut self,
        op: &Op,
        layer: &Layer,
        inputs: &[ValueId],
    ) -> Result<ValueId, Error> {
        let x = inputs[0];
        let xv = self.val(x).clone();
        let train = layer.trainable;
        match op {
            Op::Linear {
                in_features,
                out_features,
                bias,
                tie,
            } => {
                let in_f = self.last_dim(&xv, "linear")?;
                if let Some(expected) = in_features.filter(|&e| e != in_f) {
                    return Err(self.err(format!(
                        "input {} has {in_f} features, expected in_features = {expected}",
                        xv.shape
                    )));
                }
                let weight = match tie {
                    Some(name) => {
                        let w = *self.embeddings.get(name).ok_or_else(|| self.err(format!("`tie` names `{name}`, which is not an embedding traced before this layer")))?;
                        let ws = self.val(w).shape.clone();
                        if ws.dims() != [*out_features, in_f] {
                            return Err(self.err(format!("tied weight `{name}` has shape {ws}, expected [{out_features}, {in_f}]")));
                        }
                        w
                    }
                    None => {
                        let head = ["lm_head", "head", "classifier", "score", "pooler"]
                            .iter()
                            .any(|n| layer.name.rsplit('.').next().unwrap_or("").contains(n));
                        self.weight(Shape::from([*out_features, in_f]), train, !head)?
                    }
                };
                let b = if *bias {
                    Some(self.param(Shape::from([*out_features]), train)?)
                } else {
                    None
                };
                let y = self.linear(x, weight, b, *out_features)?;
                if tie.is_some() {
                    Ok(y)
                } else {
                    self.lora(x, y, in_f, *out_features, &layer.name)
                }
            }
            Op::Conv {
                spatial,
                in_channels,
                out_channels,
                kernel,
                stride,
                padding,
                dilation,
                groups,
                bias,
            } => {
                let d = xv.shape.dims().to_vec();
                if d.len() != spatial + 2 {
                    return Err(self.err(format!(
                        "input {} has rank {}, expected rank {} [batch, channels, {}]",
                        xv.shape,
                        d.len(),
                        spatial + 2,
                        if *spatial == 1 {
                            "length"
                        } else {
                            "height, width"
                        }
                    )));
                }
                let cin = d[1];
                if let Some(expected) = in_channels.filter(|&e| e != cin) {
                    return Err(self.err(format!(
                        "input {} has {cin} channels, expected in_channels = {expected}",
                        xv.shape
                    )));
                }
                if !cin.is_multiple_of(*groups) {
                    return Err(self.err(format!(
                        "input channels ({cin}) must be divisible by groups ({groups})"
                    )));
                }
                let mut out = vec![d[0], *out_channels];
                let mut wshape = vec![*out_channels, cin / groups];
                let axes: Vec<(u64, u64, u64, u64, u64)> = if *spatial == 1 {
                    vec![(d[2], kernel.1, stride.1, padding.1, dilation.1)]
                } else {
                    vec![
                        (d[2], kernel.0, stride.0, padding.0, dilation.0),
                        (d[3], kernel.1, stride.1, padding.1, dilation.1),
                    ]
                };
                for (len, k, s, p, dl) in axes {
                    out.push(self.window_out(len, k, s, p, dl, false, &xv.shape)?);
                    wshape.push(k);
                }
                let w = self.param(Shape::new(wshape), train)?;
                let b = if *bias {
                    Some(self.param(Shape::from([*out_channels]), train)?)
                } else {
                    None
                };
                let xc = self.autocast_input(x)?;
                let wc = self.autocast_input(w)?;
                let bc = match b {
                    Some(b) => Some(self.autocast_input(b)?),
                    None => None,
                };
                let dtype = self.val(xc).dtype;
                let rg = self.rg(xc) || self.rg(wc);
                let y = self.fresh(Shape::new(out), dtype, "output", rg)?;
                // derivatives.yaml `convolution`: saves input and weight.
                let saves = vec![self.sid(xc), self.sid(wc)];
                let mut ins = vec![xc, wc];
                ins.extend(bc);
                // The CPU kernels (oneDNN) reorder the input into a blocked layout: a transient
                // copy of it (measured: about one input's size for 1×1, 3×3, 7×7 and depthwise).
                let mut allocs = Vec::new();
                if self.s.device == Device::Cpu {
                    let xs = self.val(xc).shape.clone();
                    allocs.push(self.storage(
                        &xs,
                        dtype,
                        StorageKind::Activation,
                        "reordered input",
                    )?);
                }
                self.push(Step {
                    allocs,
                    op: AtenOp::Convolution,
                    inputs: ins,
                    outputs: vec![y],
                    saves,
                    ..self.blank()
                });
                Ok(y)
            }
            Op::BatchNorm {
                spatial,
                num_features,
                affine,
                track_running_stats,
            } => {
                let rank = xv.shape.rank();
                let ok = if *spatial == 1 {
                    rank == 2 || rank == 3
                } else {
                    rank == 4
                };
                if !ok {
                    let expected = if *spatial == 1 {
                        "[batch, channels] or [batch, channels, length]"
                    } else {
                        "[batch, channels, height, width]"
                    };
                    return Err(self.err(format!(
                        "input {} has rank {rank}, expected {expected}",
                        xv.shape
                    )));
                }
                let c = xv.shape.dims()[1];
                if let Some(n) = num_features.filter(|&n| n != c) {
                    return Err(self.err(format!(
                        "input {} has {c} channels, expected num_features = {n}",
                        xv.shape
                    )));
                }
                let mut ins = vec![x];
                if *affine {
                    ins.push(self.param(Shape::from([c]), train)?);
                    ins.push(self.param(Shape::from([c]), train)?);
                }
                if *track_running_stats {
                    let bdt = self.param_dtype();
                    self.buffer(Shape::from([c]), bdt, "running_mean")?;
                    self.buffer(Shape::from([c]), bdt, "running_var")?;
                    self.buffer(Shape::default(), DType::Int64, "num_batches_tracked")?;
                }
                let rg = ins.iter().any(|&v| self.rg(v));
                let y = self.fresh(xv.shape.clone(), xv.dtype, "output", rg)?;
                let mut step = Step {
                    op: AtenOp::NativeBatchNorm,
                    inputs: ins,
                    outputs: vec![y],
                    ..self.blank()
                };
                if self.training() {
                    // derivatives.yaml `native_batch_norm`: input, weight, running stats,
                    // save_mean and save_invstd ([C], in the statistics dtype).
                    let sdt = self.stats_dtype(xv.dtype);
                    let mean =
                        self.storage(&Shape::from([c]), sdt, StorageKind::Activation, "save_mean")?;
                    let invstd = self.storage(
                        &Shape::from([c]),
                        sdt,
                        StorageKind::Activation,
                        "save_invstd",
                    )?;
                    step.allocs.extend([mean, invstd]);
                    step.saves = vec![xv.storage, mean, invstd];
                }
                self.push(step);
                Ok(y)
            }
            Op::LayerNorm { affine, bias } => {
                let h = self.last_dim(&xv, "layernorm")?;
                let xin = if self.autocast_f32_norms() {
                    self.upcast_f32(x)?
                } else {
                    x
                };
                // native_layer_norm works on `input.contiguous()`.
                let xin = self.contiguous(xin)?;
                let mut ins = vec![xin];
                if *affine {
                    ins.push(self.param(Shape::from([h]), train)?);
                    if *bias {
                        ins.push(self.param(Shape::from([h]), train)?);
                    }
                }
                let rows = xv.shape.with_last(1);
                // derivatives.yaml `native_layer_norm`: input, weight, bias, mean, rstd.
                self.norm_with_stats(AtenOp::NativeLayerNorm, xin, ins, &xv.shape, rows)
            }
            Op::RmsNorm { style } => {
                let h = self.last_dim(&xv, "rmsnorm")?;
                let w = self.param(Shape::from([h]), train)?;
                self.rms_norm(x, w, *style)
            }
            Op::GroupNorm { groups, affine } => {
                if xv.shape.rank() < 2 {
                    return Err(self.err(format!(
                        "input {} has rank {}, expected at least [batch, channels]",
                        xv.shape,
                        xv.shape.rank()
                    )));
                }
                let (b, c) = (xv.shape.dims()[0], xv.shape.dims()[1]);
                if c % groups != 0 {
                    return Err(self.err(format!(
                        "{c} channels are not divisible into {groups} groups"
                    )));
                }
                let xin = if self.autocast_f32_norms() {
                    self.upcast_f32(x)?
                } else {
                    x
                };
                let mut ins = vec![xin];
                if *affine {
                    ins.push(self.param(Shape::from([c]), train)?);
                    ins.push(self.param(Shape::from([c]), train)?);
                }
                // derivatives.yaml `native_group_norm`: input, weight, mean, rstd.
                self.norm_with_stats(
                    AtenOp::NativeGroupNorm,
                    xin,
                    ins,
                    &xv.shape,
                    Shape::from([b, *groups]),
                )
            }
            Op::Embedding {
                num_embeddings,
                embedding_dim,
                tie,
            } => {
                if xv.dtype.is_float() {
                    return Err(self.err(format!(
                        "input is {} {}, expected integer token ids (set input.dtype = \"int64\")",
                        xv.dtype, xv.shape
                    )));
                }
                let w = match tie {
                    Some(name) => {
                        let w = *self.embeddings.get(name).ok_or_else(|| {
                            self.err(format!("`tie` names `{name}`, which is not an embedding traced before this layer"))
                        })?;
                        let ws = self.val(w).shape.clone();
                        if ws.dims() != [*num_embeddings, *embedding_dim] {
                            return Err(self.err(format!("tied weight `{name}` has shape {ws}, expected [{num_embeddings}, {embedding_dim}]")));
                        }
                        w
                    }
                    None => self.param(Shape::from([*num_embeddings, *embedding_dim]), train)?,
                };
                self.embeddings.insert(layer.name.clone(), w);
                let mut dims = xv.shape.dims().to_vec();
                dims.push(*embedding_dim);
                let dtype = self.param_dtype();
                let rg = self.rg(w);
                let y = self.fresh(Shape::new(dims), dtype, "output", rg)?;
                // derivatives.yaml `embedding`: saves the indices only.
                self.push(Step {
                    op: AtenOp::Embedding,
                    inputs: vec![w, x],
                    outputs: vec![y],
                    saves: vec![xv.storage],
                    ..self.blank()
                });
                Ok(y)
            }
            Op::PositionEmbedding {
                num_positions,
                ids_buffer,
            } => {
                let (_, s, h) = self.bsh(&xv)?;
                if s > *num_positions {
                    return Err(self.err(format!(
                        "sequence length {s} exceeds num_positions = {num_positions}"
                    )));
                }
                let w = self.param(Shape::from([*num_positions, h]), train)?;
                let ids = if *ids_buffer > 0 {
                    self.buffer(Shape::from([1, *ids_buffer]), DType::Int64, "position ids")?
                } else {
                    self.storage(
                        &Shape::from([1, s]),
                        DType::Int64,
                        StorageKind::Activation,
                        "position ids",
                    )?
                };
                self.add_lookup(
                    x,
                    w,
                    ids,
                    Shape::from([1, s]),
                    Shape::from([1, s, h]),
                    "position embeddings",
                )
            }
            Op::TokenTypeEmbedding {
                num_types,
                ids_buffer,
            } => {
                let (bsz, s, h) = self.bsh(&xv)?;
                if *ids_buffer > 0 && s > *ids_buffer {
                    return Err(self.err(format!(
                        "sequence length {s} exceeds the ids buffer ({ids_buffer})"
                    )));
                }
                let w = self.param(Shape::from([*num_types, h]), train)?;
                // All-zero type ids: an expanded view of the module's buffer, or a new tensor.
                let ids = if *ids_buffer > 0 {
                    // BertEmbeddings gathers `[1, S]` ids out of its buffer: a new tensor.
                    self.buffer(
                        Shape::from([1, *ids_buffer]),
                        DType::Int64,
                        "token type ids",
                    )?;
                    self.storage(
                        &Shape::from([1, s]),
                        DType::Int64,
                        StorageKind::Activation,
                        "gathered token type ids",
                    )?
                } else {
                    self.storage(
                        &Shape::from([bsz, s]),
                        DType::Int64,
                        StorageKind::Activation,
                        "token type ids",
                    )?
                };
                self.add_lookup(
                    x,
                    w,
                    ids,
                    Shape::from([bsz, s]),
                    Shape::from([bsz, s, h]),
                    "token type embeddings",
                )
            }
            Op::Rotary {
                head_dim,
                concat,
                tables_f32,
            } => {
                let (_, seq, _) = self.bsh(&xv)?;
                let half = head_dim / 2;
                let bdt = self.param_dtype();
                self.buffer(Shape::from([half]), bdt, "inv_freq")?;
                self.buffer(Shape::from([half]), bdt, "original_inv_freq")?;
                // cos and sin, [1, S, head_dim] in the activation dtype, shared by every layer.
                let table = Shape::from([1, seq, *head_dim]);
                let dt = if self.s.amp.is_some() || *tables_f32 {
                    DType::Float32
                } else {
                    self.act_dtype()
                };
                let cos = self.storage(&table, dt, StorageKind::Activation, "rope cos")?;
                let sin = self.storage(&table, dt, StorageKind::Activation, "rope sin")?;
                self.push(Step {
                    op: AtenOp::RotaryTables,
                    allocs: vec![cos, sin],
                    ..self.blank()
                });
                self.tape.held.extend([cos, sin]);
                self.rope = Some(Rope {
                    cos,
                    sin,
                    concat: *concat,
                    tables_f32: *tables_f32,
                });
                Ok(x)
            }
            Op::Parameter { shape, combine } => {
                let p = self.param(Shape::new(shape.clone()), train)?;
                match combine {
                    Combine::Add => {
                        let ps = Shape::new(shape.clone());
                        if broadcast(&xv.shape, &ps).as_ref() != Some(&xv.shape) {
                            return Err(self.err(format!(
                                "parameter of shape {ps} does not broadcast to the input {}",
                                xv.shape
                            )));
                        }
                        self.add(&[x, p], false)
                    }
                    Combine::Mul => {
                        let ps = Shape::new(shape.clone());
                        if broadcast(&xv.shape, &ps).as_ref() != Some(&xv.shape) {
                            return Err(self.err(format!(
                                "parameter of shape {ps} does not broadcast to the input {}",
                                xv.shape
                            )));
                        }
                        self.mul(p, x)
                    }
                    Combine::Concat(dim) => {
                        let rank = xv.shape.rank();
                        let axis = self.batch_kept(self.axis(*dim, rank)?, "concat")?;
                        let mut expanded = shape.clone();
                        if expanded.len() != rank {
                            return Err(self.err(format!("parameter of shape {:?} has rank {}, expected rank {rank} like the input {}", shape, expanded.len(), xv.shape)));
                        }
                        expanded[0] = xv.shape.dims()[0];
                        let ev = self.view_of(p, Shape::new(expanded), Layout::Strided);
                        self.tape.values[ev].param = false;
                        self.push(Step {
                            op: AtenOp::Expand,
                            inputs: vec![p],
                            outputs: vec![ev],
                            view_grad: true,
                            ..self.blank()
                        });
                        self.concat(&[ev, x], axis)
                    }
                }
            }
            Op::Dropout { p, inplace } => self.dropout(x, *p, *inplace),
            Op::Activation(act) => self.activation(x, *act),
            Op::Softmax { dim } => {
                self.axis(*dim, xv.shape.rank())?;
                let xin = if self.autocast_f32_norms() {
                    self.upcast_f32(x)?
                } else {
                    x
                };
                let y = self.fresh(
                    xv.shape.clone(),
                    self.val(xin).dtype,
                    "output",
                    self.rg(xin),
                )?;
                let saves = vec![self.sid(y)];
                self.push(Step {
                    op: AtenOp::Softmax,
                    inputs: vec![xin],
                    outputs: vec![y],
                    saves,
                    ..self.blank()
                });
                Ok(y)
            }
            Op::Mul => self.mul(inputs[0], inputs[1]),
            Op::Add { inplace } => self.add(inputs, *inplace),
            Op::Concat { dim } => {
                let rank = xv.shape.rank();
                let axis = self.batch_kept(self.axis(*dim, rank)?, "concat")?;
                self.concat(inputs, axis)
            }
            Op::MaxPool2d {
                kernel,
                stride,
                padding,
                dilation,
                ceil_mode,
            } => {
                let (b, c, h, w) = self.nchw(&xv)?;
                let oh = self.window_out(
                    h, kernel.0, stride.0, padding.0, dilation.0, *ceil_mode, &xv.shape,
                )?;
                let ow = self.window_out(
                    w, kernel.1, stride.1, padding.1, dilation.1, *ceil_mode, &xv.shape,
                )?;
                let shape = Shape::from([b, c, oh, ow]);
                let y = self.fresh(shape.clone(), xv.dtype, "output", xv.requires_grad)?;
                let mut step = Step {
                    op: AtenOp::MaxPool2dWithIndices,
                    inputs: vec![x],
                    outputs: vec![y],
                    ..self.blank()
                };
                // derivatives.yaml `max_pool2d_with_indices`: saves input and the int64 indices.
                let idx = self.storage(&shape, DType::Int64, StorageKind::Activation, "indices")?;
                step.allocs.push(idx);
                step.saves = vec![xv.storage, idx];
                self.push(step);
                Ok(y)
            }
            Op::AvgPool2d {
                kernel,
                stride,
                padding,
                ceil_mode,
            } => {
                let (b, c, h, w) = self.nchw(&xv)?;
                let oh =
                    self.window_out(h, kernel.0, stride.0, padding.0, 1, *ceil_mode, &xv.shape)?;
                let ow =
                    self.window_out(w, kernel.1, stride.1, padding.1, 1, *ceil_mode, &xv.shape)?;
                let y = self.fresh(
                    Shape::from([b, c, oh, ow]),
                    xv.dtype,
                    "output",
                    xv.requires_grad,
                )?;
                self.push(Step {
                    op: AtenOp::AvgPool2d,
                    inputs: vec![x],
                    outputs: vec![y],
                    saves: vec![xv.storage],
                    ..self.blank()
                });
                Ok(y)
            }
            Op::AdaptiveAvgPool2d { output } => {
                let (b, c, _, _) = self.nchw(&xv)?;
                let y = self.fresh(
                    Shape::from([b, c, output.0, output.1]),
                    xv.dtype,
                    "output",
                    xv.requires_grad,
                )?;
                if *output == Pair(1, 1) {
                    // ATen's adaptive_avg_pool2d runs `mean(-1, -2, keepdim)` for a 1×1 output,
                    // whose backward needs only sizes.
                    self.push(Step {
                        op: AtenOp::Mean,
                        inputs: vec![x],
                        outputs: vec![y],
                        ..self.blank()
                    });
                } else {
                    self.push(Step {
                        op: AtenOp::AdaptiveAvgPool2d,
                        inputs: vec![x],
                        outputs: vec![y],
                        saves: vec![xv.storage],
                        ..self.blank()
                    });
                }
                Ok(y)
            }
            Op::Flatten { start, end } => {
                let rank = xv.shape.rank();
                let (a, b) = (
                    self.batch_kept(self.axis(*start, rank)?, "flatten")?,
                    self.axis(*end, rank)?,
                );
                if a > b {
                    return Err(self.err(format!(
                        "start_dim {start} comes after end_dim {end} for input {}",
                        xv.shape
                    )));
                }
                let d = xv.shape.dims();
                let mut dims = d[..a].to_vec();
                dims.push(checked(
                    d[a..=b].iter().try_fold(1u64, |acc, &v| acc.checked_mul(v)),
                    "a flattened dimension",
                )?);
                dims.extend_from_slice(&d[b + 1..]);
                self.reshape(x, Shape::new(dims))
            }
            Op::Reshape { shape } => {
                let numel = checked(xv.shape.numel(), "an element count")?;
                let batch = xv.shape.dims()[0];
                let per = numel / batch;
                let known = shape
                    .iter()
                    .filter(|&&d| d > 0)
                    .try_fold(1u64, |acc, &d| acc.checked_mul(d.unsigned_abs()));
                let known = checked(known, "a reshape size")?;
                let mut dims = vec![batch];
                for &d in shape {
                    dims.push(if d == -1 {
                        if known == 0 || !per.is_multiple_of(known) {
                            return Err(self.err(format!("cannot reshape {} to [batch, {shape:?}]: {per} elements per sample do not divide by {known}", xv.shape)));
                        }
                        per / known
                    } else {
                        d.unsigned_abs()
                    });
                }
                let target = Shape::new(dims);
                if target.numel() != Some(numel) {
                    return Err(self.err(format!(
                        "cannot reshape {} ({numel} elements) to {target}",
                        xv.shape
                    )));
                }
                self.reshape(x, target)
            }
            Op::Permute { dims } => {
                let rank = xv.shape.rank();
                if dims.len() != rank {
                    return Err(self.err(format!(
                        "`dims` has {} entries for a rank-{rank} input {}",
                        dims.len(),
                        xv.shape
                    )));
                }
                let d = xv.shape.dims();
                let shape = Shape::new(dims.iter().map(|&i| d[i]).collect());
                let identity = dims.iter().enumerate().all(|(i, &j)| i == j);
                let layout = if identity { xv.layout } else { Layout::Strided };
                let y = self.view_op(x, shape, layout, AtenOp::Permute, true);
                Ok(y)
            }
            Op::Narrow { dim, start, length } => {
                let rank = xv.shape.rank();
                let axis = self.batch_kept(self.axis(*dim, rank)?, "narrow")?;
                let size = xv.shape.dims()[axis];
                if start.checked_add(*length).is_none_or(|end| end > size) {
                    return Err(self.err(format!("narrow {start}..{start}+{length} is out of range for dimension {dim} of size {size} (input {})", xv.shape)));
                }
                let mut dims = xv.shape.dims().to_vec();
                dims[axis] = *length;
                let layout = if *length == size {
                    xv.layout
                } else {
                    Layout::Strided
                };
                let y = self.view_op(x, Shape::new(dims), layout, AtenOp::Narrow, false);
                Ok(y)
            }
            Op::Transpose { a, b } => {
                let rank = xv.shape.rank();
                let (a, b) = (self.axis(*a, rank)?, self.axis(*b, rank)?);
                if a == 0 || b == 0 {
                    return Err(
                        self.err("transpose cannot move the batch dimension (dimension 0)".into())
                    );
                }
                let mut dims = xv.shape.dims().to_vec();
                dims.swap(a, b);
                let layout = if a == b {
                    xv.layout
                } else if xv.layout == Layout::Contiguous
                    && a.min(b) + 2 == rank
                    && a.max(b) + 1 == rank
                {
                    Layout::LastTwoSwapped
                } else if xv.layout == Layout::LastTwoSwapped
                    && a.min(b) + 2 == rank
                    && a.max(b) + 1 == rank
                {
                    Layout::Contiguous
                } else {
                    Layout::Strided
                };
                let y = self.view_op(x, Shape::new(dims), layout, AtenOp::Transpose, true);
                Ok(y)
            }
            Op::Select { dim, index } => {
                let rank = xv.shape.rank();
                let axis = self.axis(*dim, rank)?;
                if axis == 0 {
                    return Err(self.err("select on the batch dimension is not supported".into()));
                }
                let size = xv.shape.dims()[axis];
                let ok = if *index >= 0 {
                    index.unsigned_abs() < size
                } else {
                    index.unsigned_abs() <= size
                };
                if !ok {
                    return Err(self.err(format!("index {index} is out of range for dimension {dim} of size {size} (input {})", xv.shape)));
                }
                let mut dims = xv.shape.dims().to_vec();
                dims.remove(axis);
                let layout = if axis == 1 && rank == 2 {
                    Layout::Contiguous
                } else {
                    Layout::Strided
                };
                let y = self.view_op(x, Shape::new(dims), layout, AtenOp::Select, false);
                Ok(y)
            }
            Op::Attention {
                style,
                kv_cache,
                heads,
                kv_heads,
                head_dim,
                causal,
                bias,
                out_bias,
                fused_qkv,
                rotary,
                dropout,
                qk_norm,
                position_bias,
                sliding_window,
                softmax_f32,
            } => {
                let cfg = AttnCfg {
                    softmax_f32: *softmax_f32,
                    qk_norm: *qk_norm,
                    position_bias: *position_bias,
                    sliding_window: *sliding_window,
                    style: *style,
                    kv_cache: *kv_cache,
                    heads: *heads,
                    kv_heads: *kv_heads,
                    head_dim: *head_dim,
                    causal: *causal,
                    bias: *bias,
                    out_bias: *out_bias,
                    fused_qkv: *fused_qkv,
                    rotary: *rotary,
                    dropout: *dropout,
                };
                self.attention(x, x, &cfg, train)
            }
            Op::CrossEntropy { shift, upcast } => self.cross_entropy(x, *shift, *upcast),
            Op::CrossAttention {
                heads,
                head_dim,
                bias,
                out_bias,
                dropout,
            } => {
                let cfg = AttnCfg {
                    softmax_f32: false,
                    qk_norm: None,
                    position_bias: false,
                    sliding_window: None,
                    style: AttnStyle::Transformers,
                    kv_cache: true,
                    heads: *heads,
                    kv_heads: *heads,
                    head_dim: *head_dim,
                    causal: false,
                    bias: *bias,
                    out_bias: *out_bias,
                    fused_qkv: false,
                    rotary: false,
                    dropout: *dropout,
                };
                self.attention(inputs[0], inputs[1], &cfg, train)
            }
            Op::RelativePositionBias { num_buckets, heads } => {
                let (_, s, _) = self.bsh(&xv)?;
                // T5Attention.compute_bias: int64 bucket ids [S, S] (kept by the embedding
                // lookup), values [S, S, heads] permuted to a [1, heads, S, S] bias.
                let w = self.param(Shape::from([*num_buckets, *heads]), train)?;
                let buckets = self.storage(
                    &Shape::from([s, s]),
                    DType::Int64,
                    StorageKind::Activation,
                    "relative position buckets",
                )?;
                let ids = self.value(
                    buckets,
                    Shape::from([s, s]),
                    DType::Int64,
                    Layout::Contiguous,
                    false,
                    false,
                );
                self.push(Step {
                    op: AtenOp::RelativePositionBucket,
                    outputs: vec![ids],
                    ..self.blank()
                });
                let rg = self.rg(w);
                let bias = self.fresh(
                    Shape::from([1, *heads, s, s]),
                    self.act_dtype(),
                    "position bias",
                    rg,
                )?;
                self.push(Step {
                    op: AtenOp::Embedding,
                    inputs: vec![w, ids],
                    outputs: vec![bias],
                    saves: vec![buckets],
                    ..self.blank()
                });
                self.position_bias = Some(bias);
                Ok(x)
            }
            Op::Moe {
                experts,
                top_k,
                intermediate_size,
                shared_intermediate_size,
                shared_gate,
                normalize_topk,
            } => {
                let cfg = MoeCfg {
                    experts: *experts,
                    top_k: *top_k,
                    inter: *intermediate_size,
                    shared: *shared_intermediate_size,
                    shared_gate: *shared_gate,
                    normalize: *normalize_topk,
                };
                self.moe(x, &cfg, train)
            }
            Op::StochasticDepth { p } => {
                if !self.training() || *p == 0.0 {
                    return Ok(x);
                }
                // torchvision.ops.stochastic_depth, mode "row": `input * noise` with noise
                // [B, 1, ..] (bernoulli, divided by the survival rate); mul keeps the noise.
                let mut dims = vec![1; xv.shape.rank()];
                dims[0] = xv.shape.dims()[0];
                let noise = self.storage(
                    &Shape::new(dims),
                    xv.dtype,
                    StorageKind::Activation,
                    "stochastic depth noise",
                )?;
                let y = self.fresh(xv.shape.clone(), xv.dtype, "output", xv.requires_grad)?;
                self.push(Step {
                    op: AtenOp::Mul,
                    inputs: vec![x],
                    outputs: vec![y],
                    allocs: vec![noise],
                    saves: vec![noise],
                    ..self.blank()
                });
                Ok(y)
            }
            Op::ShiftRight => {
                if xv.dtype.is_float() {
                    return Err(self.err(format!(
                        "input is {} {}, expected integer token ids",
                        xv.dtype, xv.shape
                    )));
                }
                let y = self.fresh(xv.shape.clone(), xv.dtype, "shifted ids", false)?;
                self.push(Step {
                    op: AtenOp::ShiftRight,
                    inputs: vec![x],
                    outputs: vec![y],
                    ..self.blank()
                });
                Ok(y)
            }
            Op::Scale { .. } => self.unary(x, AtenOp::MulScalar, Keep::Nothing, false),
        }
    }

    pub(super) fn last_dim(&self, v: &Value, kind: &str) -> Result<u64, Error> {
        if v.shape.rank() < 2 {
            return Err(self.err(format!(
                "input {} has rank {}, expected [batch, .., features] for {kind}",
                v.shape,
                v.shape.rank()
            )));
        }
        if !v.dtype.is_float() {
            return Err(self.err(format!(
                "input is {} {}, expected a float tensor (token ids need an embedding first)",
                v.dtype, v.shape
            )));
        }
        Ok(v.shape.last().unwrap_or(0))
    }

    pub(super) fn nchw(&self, v: &Value) -> Result<(u64, u64, u64, u64), Error> {
        match *v.shape.dims() {
            [b, c, h, w] => Ok((b, c, h, w)),
            _ => Err(self.err(format!(
                "input {} has rank {}, expected [batch, channels, height, width]",
                v.shape,
                v.shape.rank()
            ))),
        }
    }

    /// The dimensions of a `[batch, seq, hidden]` input.
    pub(super) fn bsh(&self, v: &Value) -> Result<(u64, u64, u64), Error> {
        match *v.shape.dims() {
            [b, s, h] => Ok((b, s, h)),
            _ => Err(self.err(format!(
                "input {} has rank {}, expected [batch, seq, hidden]",
                v.shape,
                v.shape.rank()
            ))),
        }
    }

    /// `x + table[ids]` (learned position and token-type tables): the lookup keeps its ids,
    /// which are a new tensor unless they are a view of a buffer.
    fn add_lookup(
        &mut self,
        x: ValueId,
        w: ValueId,
        ids: StorageId,
        ids_shape: Shape,
        out_shape: Shape,
        what: &'static str,
    ) -> Result<ValueId, Error> {
        let ids_v = self.value(ids, ids_shape, DType::Int64, Layout::Strided, false, false);
        let rg = self.rg(w);
        let looked_up = self.fresh(out_shape, self.param_dtype(), what, rg)?;
        let allocs = if self.tape.storages[ids].kind == StorageKind::Activation {
            vec![ids]
        } else {
            Vec::new()
        };
        self.push(Step {
            op: AtenOp::Embedding,
            inputs: vec![w, ids_v],
            outputs: vec![looked_up],
            allocs,
            saves: vec![ids],
            ..self.blank()
        });
        self.add(&[x, looked_up], false)
    }

    /// A normalization that returns per-row (or per-group) `mean` and `rstd` in the statistics
    /// dtype and keeps them with its input (`native_layer_norm`, `native_group_norm`); `ins` is
    /// the input followed by the affine parameters.
    fn norm_with_stats(
        &mut self,
        op: AtenOp,
        xin: ValueId,
        ins: Vec<ValueId>,
        shape: &Shape,
        stats: Shape,
    ) -> Result<ValueId, Error> {
        let xd = self.val(xin).dtype;
        let rg = ins.iter().any(|&v| self.rg(v));
        let y = self.fresh(shape.clone(), xd, "output", rg)?;
        let sdt = self.stats_dtype(xd);
        let mean = self.storage(&stats, sdt, StorageKind::Activation, "mean")?;
        let rstd = self.storage(&stats, sdt, StorageKind::Activation, "rstd")?;
        let saves = vec![self.sid(xin), mean, rstd];
        self.push(Step {
            op,
            inputs: ins,
            outputs: vec![y],
            allocs: vec![mean, rstd],
            saves,
            ..self.blank()
        });
        Ok(y)
    }

    /// Rejects an axis that would merge or extend the batch dimension.
    pub(super) fn batch_kept(&self, axis: usize, what: &str) -> Result<usize, Error> {
        if axis == 0 {
            return Err(self.err(format!(
                "{what} cannot act on the batch dimension (dimension 0)"
            )));
        }
        Ok(axis)
    }

    pub(super) fn axis(&self, dim: i64, rank: usize) -> Result<usize, Error> {
        let r = i64::try_from(rank).unwrap_or(i64::MAX);
        let a = if dim < 0 { dim + r } else { dim };
        if (0..r).contains(&a) {
            Ok(usize::try_from(a).unwrap_or(0))
        } else {
            Err(self.err(format!(
                "dimension {dim} is out of range for a rank-{rank} input"
            )))
        }
    }

    /// Output length of a sliding window (conv, pooling), as `torch.nn` documents it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn window_out(
        &self,
        len: u64,
        k: u64,
        s: u64,
        p: u64,
        d: u64,
        ceil: bool,
        shape: &Shape,
    ) -> Result<u64, Error> {
        let padded = checked(len.checked_add(p.saturating_mul(2)), "a padded size")?;
        let span = checked(
            d.checked_mul(k - 1).and_then(|v| v.checked_add(1)),
            "a kernel span",
        )?;
        if padded < span {
            return Err(self.err(format!("input {shape} is too small: a window of {span} (kernel {k}, dilation {d}) does not fit in {len} + 2×{p} padding")));
        }
        let mut out = (padded - span) / s + 1;
        if ceil && (padded - span) % s != 0 {
            out += 1;
            if (out - 1) * s >= len + p {
                out -= 1;
            }
        }
        Ok(out)
    }

    /// Statistics dtype of norms: float32 for 16-bit inputs (ATen's `acc_type`), else the input's.
    pub(super) fn stats_dtype(&self, dtype: DType) -> DType {
        match dtype {
            DType::Float16 | DType::Bfloat16 => DType::Float32,
            d => d,
        }
    }
}
