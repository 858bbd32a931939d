//! Operators shared by many kinds: linear, reshapes, dropout, activations, elementwise
//! arithmetic, RMSNorm and the cross-entropy loss.

#[allow(clippy::wildcard_imports)]
use super::*;

impl Tracer<'_> {
    /// `F.linear` (addmm / mm): saves the input when the weight needs a gradient and the weight
    /// when the input needs one (`derivatives.yaml` `addmm`, `mm`). An input of rank > 2 is
    /// flattened to 2-D, which copies it when it is not contiguous.
    pub(super) fn linear(
        &mut self,
        x: ValueId,
        w: ValueId,
        b: Option<ValueId>,
        out_features: u64,
    ) -> Result<ValueId, Error> {
        let mut xc = self.autocast_input(x)?;
        if self.val(xc).shape.rank() > 2 && self.val(xc).layout != Layout::Contiguous {
            xc = self.contiguous(xc)?;
        }
        let wc = self.autocast_input(w)?;
        let bc = match b {
            Some(b) => Some(self.autocast_input(b)?),
            None => None,
        };
        let out_shape = self.val(xc).shape.with_last(out_features);
        let op = if b.is_some() {
            AtenOp::Addmm
        } else {
            AtenOp::Mm
        };
        self.weight_matmul(op, xc, w, wc, bc, out_shape, Vec::new())
    }

    /// A matmul of `x` by the weight `w`, read as `wc` (its autocast copy, or itself), with an
    /// optional bias and `op`'s auxiliary tensors (`_grouped_mm`'s offsets): `addmm`, `mm` and
    /// `_grouped_mm` keep `x` when the weight trains and the weight when `x` needs a gradient.
    /// A quantized weight is dequantized into a transient copy in the compute dtype, as
    /// bitsandbytes and GPTQ kernels do.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn weight_matmul(
        &mut self,
        op: AtenOp,
        x: ValueId,
        w: ValueId,
        wc: ValueId,
        bias: Option<ValueId>,
        out_shape: Shape,
        aux: Vec<StorageId>,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let rg = xv.requires_grad || self.rg(wc) || bias.is_some_and(|b| self.rg(b));
        let y = self.fresh(out_shape, xv.dtype, "output", rg)?;
        let mut allocs = Vec::new();
        if self.quantized.contains(&w) {
            let ws = self.val(w).shape.clone();
            allocs.push(self.storage(
                &ws,
                xv.dtype,
                StorageKind::Activation,
                "dequantized weight",
            )?);
        }
        let mut inputs = vec![x, wc];
        inputs.extend(bias);
        self.call(Call::new(op, inputs, vec![y]).aux(aux).allocs(allocs))?;
        Ok(y)
    }

    /// `reshape`: a view of a contiguous input, else a copy.
    pub(super) fn reshape(&mut self, x: ValueId, shape: Shape) -> Result<ValueId, Error> {
        let xc = self.contiguous(x)?;
        let y = self.view_op(xc, shape, Layout::Contiguous, AtenOp::View, true);
        Ok(y)
    }

    pub(super) fn dropout(&mut self, x: ValueId, p: f64, inplace: bool) -> Result<ValueId, Error> {
        if !self.training() || p == 0.0 {
            return Ok(x);
        }
        let xv = self.val(x).clone();
        // CUDA: `dropout` takes the fused `native_dropout`, which keeps a bool mask. CPU, and
        // the in-place `dropout_` on any device (`nn.Dropout(inplace=True)`: it never takes the
        // fused kernel): `_dropout_impl` multiplies by a noise tensor of the input's dtype and
        // keeps it (aten/src/ATen/native/Dropout.cpp, `dropout` and `dropout_`).
        let (mask_dtype, what) = match self.s.device {
            Device::Cuda if !inplace => (DType::Bool, "dropout mask"),
            Device::Cuda | Device::Cpu => (xv.dtype, "dropout noise"),
        };
        let mask = self.storage(&xv.shape, mask_dtype, StorageKind::Activation, what)?;
        let y = if inplace {
            self.view_of(x, xv.shape.clone(), Layout::Contiguous)
        } else {
            self.fresh(xv.shape.clone(), xv.dtype, "output", xv.requires_grad)?
        };
        let call = Call::new(AtenOp::Dropout, vec![x], vec![y]).aux(vec![mask]);
        // `native_dropout`'s mask is its second result; the noise is drawn before the product.
        self.call(if mask_dtype == DType::Bool {
            call.results(vec![mask])
        } else {
            call.allocs(vec![mask])
        })?;
        Ok(y)
    }

    /// A one-input operator: in place (`relu_`, a view of its input) or into a new tensor;
    /// what it keeps follows from `op`'s row of the table.
    pub(super) fn unary(&mut self, x: ValueId, op: AtenOp) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let y = if op.is_inplace() {
            self.view_of(x, xv.shape.clone(), Layout::Contiguous)
        } else {
            self.fresh(xv.shape.clone(), xv.dtype, "output", xv.requires_grad)?
        };
        let call = Call::new(op, vec![x], vec![y]);
        let call = if op == AtenOp::AddScalar {
            // `add.Scalar`'s backward is `self: grad` (derivatives.yaml): the input gets the
            // output's gradient block itself.
            call.view_grad()
        } else if matches!(op, AtenOp::Pow | AtenOp::Rsqrt) {
            // Backward formulas written as several operators make their intermediates before
            // the gradient and free them after (derivatives.yaml): `pow.Tensor_Scalar`'s
            // `pow_backward` is `grad * (exponent * self.pow(exponent - 1))` (`self.pow`, then
            // `mul.Scalar`), `rsqrt`'s `-0.5 * grad * result.pow(3)` (`result.pow`, then
            // `mul.Scalar`): two blocks of the input's size, then the gradient (a
            // `TorchDispatchMode` over LlamaRMSNorm's backward shows `pow`, `mul.Scalar`,
            // `mul`).
            let bytes = xv
                .shape
                .numel()
                .and_then(|n| xv.dtype.bytes_for(n))
                .ok_or_else(|| Error::Overflow("the size of a tensor".into()))?;
            call.scratch(Vec::new(), vec![bytes; 2])
        } else {
            call
        };
        self.call(call)?;
        Ok(y)
    }

    /// `_log_softmax` over the last dimension into a new tensor of the input's shape and dtype
    /// (`[.., classes]`); it keeps its output for backward.
    fn log_softmax(&mut self, x: ValueId) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let lp = self.fresh(xv.shape, xv.dtype, "log-probabilities", xv.requires_grad)?;
        self.call(Call::new(AtenOp::LogSoftmax, vec![x], vec![lp]))?;
        Ok(lp)
    }

    /// An activation module: its ATen operator (in place with `inplace = true`), or for
    /// `GeluNew` the tanh approximation written op by op. What each keeps is its row of the
    /// table ([`AtenOp::spec`]).
    pub(super) fn activation(&mut self, x: ValueId, act: Activation) -> Result<ValueId, Error> {
        let pick = |inplace: bool, out_of_place: AtenOp, in_place: AtenOp| {
            if inplace { in_place } else { out_of_place }
        };
        let op = match act {
            Activation::Relu { inplace } => pick(inplace, AtenOp::Relu, AtenOp::ReluInplace),
            Activation::Relu6 { inplace } => {
                pick(inplace, AtenOp::Hardtanh, AtenOp::HardtanhInplace)
            }
            Activation::Hardswish { inplace } => {
                pick(inplace, AtenOp::Hardswish, AtenOp::HardswishInplace)
            }
            Activation::Hardsigmoid { inplace } => {
                pick(inplace, AtenOp::Hardsigmoid, AtenOp::HardsigmoidInplace)
            }
            Activation::LeakyRelu { inplace } => {
                pick(inplace, AtenOp::LeakyRelu, AtenOp::LeakyReluInplace)
            }
            Activation::Gelu => AtenOp::Gelu,
            Activation::BloomGelu => return self.bloom_gelu(x),
            Activation::Silu { inplace } => pick(inplace, AtenOp::Silu, AtenOp::SiluInplace),
            Activation::Tanh => AtenOp::Tanh,
            Activation::Sigmoid => AtenOp::Sigmoid,
            Activation::GeluNew => {
                // 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), op by op. CUDA
                // autocast runs `pow` in float32 (its fp32 list, `autocast_mode.cpp`): the cube
                // reads a float32 copy of x, and type promotion carries float32 through the
                // sum, the tanh and the product.
                let base = if self.autocast_f32_norms() {
                    self.upcast_f32(x)?
                } else {
                    x
                };
                let cube = self.unary(base, AtenOp::Pow)?;
                let scaled = self.unary(cube, AtenOp::MulScalar)?;
                let inner = self.add(&[x, scaled], false)?;
                let arg = self.unary(inner, AtenOp::MulScalar)?;
                let t = self.unary(arg, AtenOp::Tanh)?;
                let one_plus = self.unary(t, AtenOp::AddScalar)?;
                let half = self.unary(x, AtenOp::MulScalar)?;
                return self.mul(half, one_plus);
            }
        };
        self.unary(x, op)
    }

    /// BLOOM's `GeLUFunction` (transformers `models/bloom/modeling_bloom.py`): saves its input;
    /// every Python operation of its forward and backward makes a tensor of the input's size
    /// (Python scalars do not promote). At the busiest moment of `bloom_gelu_forward`,
    /// `x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))`, four are live
    /// (`x*0.5`, `0.79788456*x`, `0.044715*x`, its product with `x`); the output comes when
    /// two remain (`x*0.5`, `1+tanh(..)`): three beside the output at the most. In
    /// `bloom_gelu_back`, five (`tanh_out`, `0.5*x`, `1 - tanh_out²`, `0.107*x`, its product
    /// with `x`), and the returned `ff * g` comes when two remain (`tanh_out`, `ff`): four
    /// beside the gradient at the most.
    fn bloom_gelu(&mut self, x: ValueId) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let bytes = xv
            .shape
            .numel()
            .and_then(|n| xv.dtype.bytes_for(n))
            .ok_or_else(|| Error::Overflow("the size of a tensor".into()))?;
        let y = self.fresh(xv.shape.clone(), xv.dtype, "output", xv.requires_grad)?;
        let call = Call::new(AtenOp::BloomGelu, vec![x], vec![y]);
        self.call(call.scratch(vec![bytes; 3], vec![bytes; 4]))?;
        Ok(y)
    }

    /// Elementwise product: each factor is kept for the other's gradient
    /// (`derivatives.yaml` `mul.Tensor`).
    pub(super) fn mul(&mut self, a: ValueId, b: ValueId) -> Result<ValueId, Error> {
        let (av, bv) = (self.val(a).clone(), self.val(b).clone());
        let shape = broadcast(&av.shape, &bv.shape).ok_or_else(|| {
            self.err(format!(
                "cannot multiply {} by {}: shapes do not broadcast",
                av.shape, bv.shape
            ))
        })?;
        let dtype = promote(av.dtype, bv.dtype);
        let layout = self.elementwise_layout(&[a, b], &shape);
        let y = self.fresh(shape, dtype, "output", av.requires_grad || bv.requires_grad)?;
        self.tape.values[y].layout = layout;
        self.call(Call::new(AtenOp::Mul, vec![a, b], vec![y]))?;
        Ok(y)
    }

    /// The layout `TensorIterator` gives an elementwise operator's fresh output: channels-last
    /// when the first input of the output's whole shape is (broadcast inputs, such as a `[C, 1,
    /// 1]` scale, do not decide), else contiguous.
    pub(super) fn elementwise_layout(&self, inputs: &[ValueId], shape: &Shape) -> Layout {
        match inputs
            .iter()
            .map(|&v| self.val(v))
            .find(|v| &v.shape == shape)
        {
            Some(v) if v.layout == Layout::ChannelsLast => Layout::ChannelsLast,
            _ => Layout::Contiguous,
        }
    }

    /// Elementwise sum: saves nothing. In place, the result lives in the first input's memory.
    pub(super) fn add(&mut self, inputs: &[ValueId], inplace: bool) -> Result<ValueId, Error> {
        let first = self.val(inputs[0]).clone();
        let mut shape = first.shape.clone();
        let mut dtype = first.dtype;
        let mut rg = first.requires_grad;
        for &v in &inputs[1..] {
            let vv = self.val(v).clone();
            shape = broadcast(&shape, &vv.shape).ok_or_else(|| {
                self.err(format!(
                    "cannot add {} and {}: shapes do not broadcast",
                    first.shape, vv.shape
                ))
            })?;
            dtype = promote(dtype, vv.dtype);
            rg |= vv.requires_grad;
        }
        if inplace && shape != first.shape {
            return Err(self.err(format!(
                "in-place add into {} cannot take the broadcast shape {shape}",
                first.shape
            )));
        }
        // `AddBackward0` returns `grad` itself for `self` and `maybe_multiply(grad, alpha)`,
        // the same tensor at `alpha = 1`, for `other` (derivatives.yaml `add.Tensor`): an
        // input of the output's shape and dtype gets the output's gradient block, nothing
        // allocated (a residual connection); a broadcast one or one of another dtype gets the
        // engine's `sum_to` or cast of it (`validate_outputs`: `Step::reduced`).
        let passes = inputs.iter().any(|&v| {
            let vv = self.val(v);
            vv.shape == shape && vv.dtype == dtype
        });
        let layout = self.elementwise_layout(inputs, &shape);
        let y = if inplace {
            let y = self.view_of(inputs[0], shape, layout);
            self.tape.values[y].requires_grad = rg;
            y
        } else {
            let y = self.fresh(shape, dtype, "output", rg)?;
            self.tape.values[y].layout = layout;
            y
        };
        let op = if inplace {
            AtenOp::AddInplace
        } else {
            AtenOp::Add
        };
        let call = Call::new(op, inputs.to_vec(), vec![y]);
        self.call(if passes { call.view_grad() } else { call })?;
        Ok(y)
    }

    /// `torch.cat`: saves only sizes; its backward hands the inputs views of the gradient.
    pub(super) fn concat(&mut self, inputs: &[ValueId], axis: usize) -> Result<ValueId, Error> {
        let first = self.val(inputs[0]).clone();
        let mut dims = first.shape.dims().to_vec();
        let mut rg = first.requires_grad;
        for &v in &inputs[1..] {
            let vv = self.val(v).clone();
            let ok = vv.shape.rank() == dims.len()
                && vv
                    .shape
                    .dims()
                    .iter()
                    .enumerate()
                    .all(|(i, &d)| i == axis || d == dims[i]);
            if !ok {
                return Err(self.err(format!(
                    "cannot concatenate {} and {} along dimension {axis}: other dimensions differ",
                    first.shape, vv.shape
                )));
            }
            dims[axis] = checked(
                dims[axis].checked_add(vv.shape.dims()[axis]),
                "a concatenated size",
            )?;
            rg |= vv.requires_grad;
        }
        let y = self.fresh(Shape::new(dims), first.dtype, "output", rg)?;
        // `CatBackward0` hands each input `grad.narrow(dim, offset, size)`
        // (`cat_tensors_backward`, derivatives.yaml `cat`): views of the output's gradient,
        // nothing allocated, when every input has the output's dtype.
        let call = Call::new(AtenOp::Cat, inputs.to_vec(), vec![y]);
        let same = inputs.iter().all(|&v| self.val(v).dtype == first.dtype);
        self.call(if same { call.view_grad() } else { call })?;
        Ok(y)
    }

    /// RMSNorm as transformers writes it. All three variants compute the statistic the same
    /// way: `h = x.to(float32)` (a copy for 16-bit input, kept by `pow`), `v = h.pow(2).mean(-1)`,
    /// `r = rsqrt(v + eps)` (kept, `[.., 1]`). Then:
    /// - `LlamaRMSNorm`: `n = h·r` (keeps `h` and `r`), `weight * n.to(input_dtype)` (keeps
    ///   the cast);
    /// - `T5LayerNorm`: `n = x·r` on the input itself (keeps `x` and `r`), cast to a 16-bit
    ///   weight's dtype, `weight * n` (keeps the cast);
    /// - `GemmaRMSNorm`: `n = h·r`, `n·(1 + w.float())` (keeps `n` and the `[H]` `1 + w`), cast
    ///   back to the input dtype.
    pub(super) fn rms_norm(
        &mut self,
        x: ValueId,
        w: ValueId,
        style: RmsStyle,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        if style == RmsStyle::Torch && self.s.device == Device::Cuda {
            // `_fused_rms_norm`: the output, and a float32 `rstd` `[.., 1]` it keeps with the
            // input and the weight.
            let rg = xv.requires_grad || self.rg(w);
            let y = self.fresh(xv.shape.clone(), xv.dtype, "output", rg)?;
            let rstd = self.storage(
                &xv.shape.with_last(1),
                DType::Float32,
                StorageKind::Activation,
                "rstd",
            )?;
            let call = Call::new(AtenOp::FusedRmsNorm, vec![x, w], vec![y]);
            self.call(call.aux(vec![rstd]).results(vec![rstd]))?;
            return Ok(y);
        }
        let h = self.upcast_f32(x)?;
        let hv = self.val(h).clone();
        let sq = self.unary(h, AtenOp::Pow)?;
        let var = self.fresh(
            xv.shape.with_last(1),
            hv.dtype,
            "variance",
            hv.requires_grad,
        )?;
        self.call(Call::new(AtenOp::Mean, vec![sq], vec![var]))?;
        let var_eps = self.unary(var, AtenOp::AddScalar)?;
        let r = self.unary(var_eps, AtenOp::Rsqrt)?;
        match style {
            RmsStyle::Llama => {
                let normed = self.mul(h, r)?;
                // Under autocast the input is float32 already.
                let back = if self.s.amp.is_some() {
                    normed
                } else {
                    self.cast(normed, xv.dtype)?
                };
                self.mul(w, back)
            }
            RmsStyle::T5 => {
                let normed = self.mul(x, r)?;
                let wdt = self.val(w).dtype;
                let back = if matches!(wdt, DType::Float16 | DType::Bfloat16) {
                    self.cast(normed, wdt)?
                } else {
                    normed
                };
                self.mul(w, back)
            }
            RmsStyle::Gemma => {
                let normed = self.mul(h, r)?;
                let wf = self.upcast_f32(w)?;
                let one_plus = self.unary(wf, AtenOp::AddScalar)?;
                let out = self.mul(normed, one_plus)?;
                self.cast(out, xv.dtype)
            }
            RmsStyle::Olmo2 | RmsStyle::Torch => {
                let normed = self.mul(h, r)?;
                let out = self.mul(w, normed)?;
                self.cast(out, xv.dtype)
            }
        }
    }

    /// transformers' `CohereLayerNorm` (`models/cohere/modeling_cohere.py`), op by op:
    /// `h = x.to(float32)` (a copy for 16-bit input, kept by nothing), `mean = h.mean(-1)`,
    /// `d = h - mean` (kept by `pow`), `var = d.pow(2).mean(-1)`, `r = rsqrt(var + eps)` (kept,
    /// `[.., 1]`), `n = (h - mean) * r` (a second difference, kept with `r` by `mul`),
    /// `w.to(float32) * n` (keeps both), cast back to the input dtype. `sub.Tensor` saves
    /// nothing (`derivatives.yaml`), as `add` does, so the differences are traced as `add`.
    pub(super) fn cohere_layer_norm(&mut self, x: ValueId, w: ValueId) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let h = self.upcast_f32(x)?;
        let hv = self.val(h).clone();
        let stat = |t: &mut Self, of: ValueId, what: &'static str| -> Result<ValueId, Error> {
            let m = t.fresh(xv.shape.with_last(1), hv.dtype, what, hv.requires_grad)?;
            t.call(Call::new(AtenOp::Mean, vec![of], vec![m]))?;
            Ok(m)
        };
        let mean = stat(self, h, "mean")?;
        let centred = self.add(&[h, mean], false)?;
        let sq = self.unary(centred, AtenOp::Pow)?;
        let var = stat(self, sq, "variance")?;
        let var_eps = self.unary(var, AtenOp::AddScalar)?;
        let r = self.unary(var_eps, AtenOp::Rsqrt)?;
        let centred2 = self.add(&[h, mean], false)?;
        let normed = self.mul(centred2, r)?;
        let wf = self.upcast_f32(w)?;
        let out = self.mul(wf, normed)?;
        self.cast(out, xv.dtype)
    }

    /// Cross-entropy: `log_softmax` keeps its result, `nll_loss` keeps the labels
    /// (`derivatives.yaml` `_log_softmax`, `nll_loss_forward`). Logits `[N, C]` have labels `[N]`
    /// and `[batch, seq, vocab]` labels `[batch, seq]` (transformers flattens them to
    /// `[batch·seq, vocab]`); from rank 4 on, `[B, C, d1, …]` (segmentation) has the classes on
    /// dimension 1 and labels `[B, d1, …]`, as `F.cross_entropy` (`nll_loss2d_forward`, which
    /// keeps the same tensors) reads them.
    pub(super) fn cross_entropy(
        &mut self,
        x: ValueId,
        shift: bool,
        upcast: bool,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        if xv.shape.rank() < 2 || !xv.dtype.is_float() {
            return Err(self.err(format!(
                "input {} {} is not float logits [batch, classes], [batch, seq, vocab] or [batch, classes, d1, ...]",
                xv.dtype, xv.shape
            )));
        }
        if shift && xv.shape.rank() != 3 {
            return Err(self.err(format!(
                "`shift` needs logits [batch, seq, vocab], got {}",
                xv.shape
            )));
        }
        self.tape.held.push(xv.storage);
        self.tape.has_loss = true;
        if !self.training() {
            return Ok(x);
        }
        let dims = xv.shape.dims();
        let label_shape = if dims.len() >= 4 {
            Shape::new([&dims[..1], &dims[2..]].concat())
        } else {
            Shape::new(dims[..dims.len() - 1].to_vec())
        };
        let labels = self.storage(&label_shape, DType::Int64, StorageKind::Input, "labels")?;
        let target = if shift {
            // transformers' ForCausalLMLoss pads and shifts the labels: a new int64 tensor.
            self.storage(
                &label_shape,
                DType::Int64,
                StorageKind::Activation,
                "shifted labels",
            )?
        } else {
            labels
        };
        // CPU autocast runs the whole loss in float32. CUDA autocast lists neither
        // `cross_entropy_loss` nor a `log_softmax` given a dtype (the loss passes the logits'
        // own), so the log-probabilities stay 16-bit and `nll_loss`, on its float32 list, reads
        // (and keeps) a float32 copy of them (`aten/src/ATen/autocast_mode.cpp`,
        // `aten/src/ATen/native/LossNLL.cpp` `cross_entropy_loss_label_smoothing`/`_prob_target`
        // and `cross_entropy_loss`).
        let cuda_amp = self.autocast_f32_norms();
        let xin = if upcast || (self.s.amp.is_some() && !cuda_amp) {
            self.upcast_f32(x)?
        } else {
            x
        };
        let lp = self.log_softmax(xin)?;
        let lp = if cuda_amp { self.upcast_f32(lp)? } else { lp };
        let inv = self.val(lp).clone();
        let loss = self.fresh(Shape::default(), inv.dtype, "loss", inv.requires_grad)?;
        // nll_loss_forward also returns `total_weight`, a float32 scalar its backward keeps.
        let total_weight = self.storage(
            &Shape::default(),
            DType::Float32,
            StorageKind::Activation,
            "total_weight",
        )?;
        let allocs = if target == labels {
            Vec::new()
        } else {
            vec![target]
        };
        self.call(
            Call::new(AtenOp::NllLoss, vec![lp], vec![loss])
                .aux(vec![target, total_weight])
                .allocs(allocs)
                .results(vec![total_weight]),
        )?;
        self.tape.held.push(self.sid(loss));
        Ok(loss)
    }

    /// `F.mse_loss(x, target)` with `reduction="mean"` (see [`crate::graph::MseLossCfg`]): the
    /// target is a batch input of `x`'s shape, in the model input's dtype (float32 under
    /// autocast); with `upcast`, or under autocast (`mse_loss` is on the float32 lists of CPU
    /// and CUDA autocast, `autocast_mode.cpp`), both are copied to float32 first. The kernel
    /// (`mse_loss_out`, `native/Loss.cpp`) writes the squared differences into a temporary of
    /// the input's size and takes its mean into the scalar loss; derivatives.yaml's
    /// `mse_loss_backward(grad, self, target, reduction)` keeps the input and the target.
    pub(super) fn mse_loss(&mut self, x: ValueId, upcast: bool) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        if !xv.dtype.is_float() {
            return Err(self.err(format!(
                "input {} {} is not a float prediction",
                xv.dtype, xv.shape
            )));
        }
        self.tape.held.push(xv.storage);
        self.tape.has_loss = true;
        if !self.training() {
            return Ok(x);
        }
        let target_dtype = if self.s.amp.is_some() {
            DType::Float32
        } else {
            xv.dtype
        };
        let target = self.storage(&xv.shape, target_dtype, StorageKind::Input, "target")?;
        let to_f32 = upcast || self.s.amp.is_some();
        let xin = if to_f32 { self.upcast_f32(x)? } else { x };
        let (target, copy) = if to_f32 && target_dtype != DType::Float32 {
            let t = self.storage(
                &xv.shape,
                DType::Float32,
                StorageKind::Activation,
                "float32 target",
            )?;
            (t, vec![t])
        } else {
            (target, Vec::new())
        };
        let dt = self.val(xin).dtype;
        let squares = xv
            .shape
            .numel()
            .and_then(|n| dt.bytes_for(n))
            .ok_or_else(|| Error::Overflow("the size of a tensor".into()))?;
        let rg = self.val(xin).requires_grad;
        let loss = self.fresh(Shape::default(), dt, "loss", rg)?;
        self.call(
            Call::new(AtenOp::MseLoss, vec![xin], vec![loss])
                .aux(vec![target])
                .allocs(copy)
                .scratch(vec![squares], Vec::new()),
        )?;
        self.tape.held.push(self.sid(loss));
        Ok(loss)
    }

    /// The LM head and its cross-entropy as torchtune runs them with `CEWithChunkedOutputLoss`
    /// ([`crate::settings::Loss::Chunked`]): the final hidden states `[B, S, H]` are split into
    /// `chunks` pieces along the sequence (`tensor_split`: the first `S mod chunks` pieces one
    /// token longer), the head (`linear`, its weight made once) runs on each piece, and each
    /// piece's logits are upcast to float32 and cross-entropied on their own
    /// (`F.cross_entropy(logits.float(), labels, reduction="sum")`, summed). Each piece of
    /// logits is held, as the whole logits are without chunking. A piece of a batch of more
    /// than one sequence is not contiguous, so `matmul` copies it for `mm` (which keeps the
    /// copy). Each piece's backward (`slice_backward`) makes a zero gradient of the whole
    /// hidden states, accumulated into one. The pieces' losses are summed (`total = total +
    /// loss`, from `0.0`) and divided by the count of labels, as the recipe's loss returns
    /// `total_loss / total_elements`; backward reaches every piece through that sum.
    #[allow(clippy::too_many_arguments)] // the head's and the loss's settings
    pub(super) fn chunked_head_loss(
        &mut self,
        head: &crate::graph::LinearCfg,
        ce: &crate::graph::CrossEntropyCfg,
        loss_layer: &Layer,
        x: ValueId,
        train: bool,
        chunks: u64,
        repeat: u64,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let &[b, s, h] = xv.shape.dims() else {
            return Err(self.err(format!(
                "--loss chunked-ce splits [batch, seq, hidden] states along the sequence; the head's input is {}",
                xv.shape
            )));
        };
        let weight = match &head.tie {
            Some(tied) => self.tied(tied, head.out_features, h)?,
            None => self.weight(Shape::from([head.out_features, h]), train, head.quantize)?,
        };
        let bias = if head.bias {
            Some(self.param(Shape::from([head.out_features]), train)?)
        } else {
            None
        };
        let head_layer = self.cur_layer;
        let chunks = chunks.min(s).max(1);
        let labels = self.storage(
            &Shape::from([b, s]),
            DType::Int64,
            StorageKind::Input,
            "labels",
        )?;
        let mut target = labels;
        let mut total = None;
        for i in 0..chunks {
            self.cur_layer = head_layer;
            let len = s / chunks + u64::from(i < s % chunks);
            let layout = if b == 1 {
                Layout::Contiguous
            } else {
                Layout::Strided
            };
            let piece = self.view_op(x, Shape::from([b, len, h]), layout, AtenOp::Narrow, false);
            let piece = if layout == Layout::Strided {
                self.contiguous(piece)?
            } else {
                piece
            };
            let logits = self.linear(piece, weight, bias, head.out_features)?;
            self.tape.held.push(self.sid(logits));
            self.enter_layer(loss_layer, &loss_layer.name, repeat);
            let up = self.upcast_f32(logits)?;
            let uv = self.val(up).clone();
            let lp = self.log_softmax(up)?;
            let piece_loss = self.fresh(Shape::default(), uv.dtype, "loss", uv.requires_grad)?;
            let total_weight = self.storage(
                &Shape::default(),
                DType::Float32,
                StorageKind::Activation,
                "total_weight",
            )?;
            let mut allocs = Vec::new();
            if ce.shift && i == 0 {
                // The recipe shifts the labels by `hstack` with an ignore column: a new tensor.
                target = self.storage(
                    &Shape::from([b, s]),
                    DType::Int64,
                    StorageKind::Activation,
                    "shifted labels",
                )?;
                allocs.push(target);
            }
            self.call(
                Call::new(AtenOp::NllLoss, vec![lp], vec![piece_loss])
                    .aux(vec![target, total_weight])
                    .allocs(allocs)
                    .results(vec![total_weight]),
            )?;
            self.tape.held.push(self.sid(piece_loss));
            // `total = total + piece_loss`, from `total = 0.0`: a new scalar each time, whose
            // backward hands the gradient to every piece's loss.
            total = Some(match total {
                None => self.unary(piece_loss, AtenOp::AddScalar)?,
                Some(t) => self.add(&[t, piece_loss], false)?,
            });
        }
        let total =
            total.ok_or_else(|| self.err("--loss chunked-ce needs at least one chunk".into()))?;
        // `total / (labels != ignore_index).sum()`: the count, an int64 scalar, is kept for
        // the division's backward.
        let count = self.storage(
            &Shape::default(),
            DType::Int64,
            StorageKind::Activation,
            "label count",
        )?;
        let tv = self.val(total).clone();
        let loss = self.fresh(Shape::default(), tv.dtype, "loss", tv.requires_grad)?;
        self.call(
            Call::new(AtenOp::Div, vec![total], vec![loss])
                .aux(vec![count])
                .allocs(vec![count]),
        )?;
        self.tape.held.push(self.sid(loss));
        self.tape.has_loss = true;
        Ok(loss)
    }
}
