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
    /// optional bias: keeps `x` when the weight trains and the weight when `x` needs a gradient
    /// (`derivatives.yaml` `addmm`, `mm`, `_grouped_mm`), plus `extra_saves`. A quantized weight
    /// is dequantized into a transient copy in the compute dtype, as bitsandbytes and GPTQ
    /// kernels do.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn weight_matmul(
        &mut self,
        op: AtenOp,
        x: ValueId,
        w: ValueId,
        wc: ValueId,
        bias: Option<ValueId>,
        out_shape: Shape,
        extra_saves: Vec<StorageId>,
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
        let mut saves = extra_saves;
        if self.rg(wc) {
            saves.push(xv.storage);
        }
        if xv.requires_grad {
            saves.push(self.sid(wc));
        }
        let mut inputs = vec![x, wc];
        inputs.extend(bias);
        self.push(Step {
            op,
            inputs,
            outputs: vec![y],
            allocs,
            saves,
            ..self.blank()
        });
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
        // CUDA: `native_dropout` keeps a bool mask. CPU: `_dropout_impl` multiplies by a noise
        // tensor of the input's dtype and keeps it (aten/src/ATen/native/Dropout.cpp).
        let (mask_dtype, what) = match self.s.device {
            Device::Cuda => (DType::Bool, "dropout mask"),
            Device::Cpu => (xv.dtype, "dropout noise"),
        };
        let mask = self.storage(&xv.shape, mask_dtype, StorageKind::Activation, what)?;
        let y = if inplace {
            self.view_of(x, xv.shape.clone(), Layout::Contiguous)
        } else {
            self.fresh(xv.shape.clone(), xv.dtype, "output", xv.requires_grad)?
        };
        self.push(Step {
            op: AtenOp::Dropout,
            inputs: vec![x],
            outputs: vec![y],
            allocs: vec![mask],
            saves: vec![mask],
            ..self.blank()
        });
        Ok(y)
    }

    pub(super) fn unary(
        &mut self,
        x: ValueId,
        op: AtenOp,
        keep: Keep,
        inplace: bool,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let y = if inplace {
            self.view_of(x, xv.shape.clone(), Layout::Contiguous)
        } else {
            self.fresh(xv.shape.clone(), xv.dtype, "output", xv.requires_grad)?
        };
        let mut allocs = Vec::new();
        let saves = match keep {
            Keep::Nothing => vec![],
            Keep::Input => vec![xv.storage],
            Keep::Output => vec![self.sid(y)],
            Keep::InputClone => {
                let c =
                    self.storage(&xv.shape, xv.dtype, StorageKind::Activation, "input clone")?;
                allocs.push(c);
                vec![c]
            }
        };
        self.push(Step {
            op,
            inputs: vec![x],
            outputs: vec![y],
            allocs,
            saves,
            ..self.blank()
        });
        Ok(y)
    }

    pub(super) fn activation(&mut self, x: ValueId, act: Activation) -> Result<ValueId, Error> {
        match act {
            // derivatives.yaml: relu/threshold keeps its result; hardtanh keeps its input
            // (its result when in place); gelu and silu keep their input; tanh and sigmoid
            // keep their result.
            Activation::Relu { inplace } => self.unary(
                x,
                if inplace {
                    AtenOp::ReluInplace
                } else {
                    AtenOp::Relu
                },
                Keep::Output,
                inplace,
            ),
            // An in-place op whose backward needs its input keeps a clone of it (autograd's
            // codegen saves `self.clone()` for `hardtanh_`).
            Activation::Relu6 { inplace } => self.unary(
                x,
                if inplace {
                    AtenOp::HardtanhInplace
                } else {
                    AtenOp::Hardtanh
                },
                if inplace {
                    Keep::InputClone
                } else {
                    Keep::Input
                },
                inplace,
            ),
            Activation::Hardswish { inplace } => self.unary(
                x,
                if inplace {
                    AtenOp::HardswishInplace
                } else {
                    AtenOp::Hardswish
                },
                if inplace {
                    Keep::InputClone
                } else {
                    Keep::Input
                },
                inplace,
            ),
            Activation::Hardsigmoid { inplace } => self.unary(
                x,
                if inplace {
                    AtenOp::HardsigmoidInplace
                } else {
                    AtenOp::Hardsigmoid
                },
                if inplace {
                    Keep::InputClone
                } else {
                    Keep::Input
                },
                inplace,
            ),
            // derivatives.yaml: leaky_relu keeps `self`; `leaky_relu_` keeps its result.
            Activation::LeakyRelu { inplace } => self.unary(
                x,
                if inplace {
                    AtenOp::LeakyReluInplace
                } else {
                    AtenOp::LeakyRelu
                },
                if inplace { Keep::Output } else { Keep::Input },
                inplace,
            ),
            Activation::Gelu => self.unary(x, AtenOp::Gelu, Keep::Input, false),
            Activation::Silu { inplace } => self.unary(
                x,
                if inplace {
                    AtenOp::SiluInplace
                } else {
                    AtenOp::Silu
                },
                if inplace {
                    Keep::InputClone
                } else {
                    Keep::Input
                },
                inplace,
            ),
            Activation::Tanh => self.unary(x, AtenOp::Tanh, Keep::Output, false),
            Activation::Sigmoid => self.unary(x, AtenOp::Sigmoid, Keep::Output, false),
            Activation::GeluNew => {
                // 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), op by op.
                let cube = self.unary(x, AtenOp::Pow, Keep::Input, false)?;
                let scaled = self.unary(cube, AtenOp::MulScalar, Keep::Nothing, false)?;
                let inner = self.add(&[x, scaled], false)?;
                let arg = self.unary(inner, AtenOp::MulScalar, Keep::Nothing, false)?;
                let t = self.unary(arg, AtenOp::Tanh, Keep::Output, false)?;
                let one_plus = self.unary(t, AtenOp::AddScalar, Keep::Nothing, false)?;
                let half = self.unary(x, AtenOp::MulScalar, Keep::Nothing, false)?;
                self.mul(half, one_plus)
            }
        }
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
        let y = self.fresh(shape, dtype, "output", av.requires_grad || bv.requires_grad)?;
        let mut saves = Vec::new();
        if av.requires_grad {
            saves.push(bv.storage);
        }
        if bv.requires_grad {
            saves.push(av.storage);
        }
        self.push(Step {
            op: AtenOp::Mul,
            inputs: vec![a, b],
            outputs: vec![y],
            saves,
            ..self.blank()
        });
        Ok(y)
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
        let y = if inplace {
            let y = self.view_of(inputs[0], shape, Layout::Contiguous);
            self.tape.values[y].requires_grad = rg;
            y
        } else {
            self.fresh(shape, dtype, "output", rg)?
        };
        self.push(Step {
            op: if inplace {
                AtenOp::AddInplace
            } else {
                AtenOp::Add
            },
            inputs: inputs.to_vec(),
            outputs: vec![y],
            ..self.blank()
        });
        Ok(y)
    }

    /// `torch.cat`: saves only sizes.
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
        self.push(Step {
            op: AtenOp::Cat,
            inputs: inputs.to_vec(),
            outputs: vec![y],
            ..self.blank()
        });
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
        let h = self.upcast_f32(x)?;
        let hv = self.val(h).clone();
        let sq = self.unary(h, AtenOp::Pow, Keep::Input, false)?;
        let var = self.fresh(
            xv.shape.with_last(1),
            hv.dtype,
            "variance",
            hv.requires_grad,
        )?;
        self.push(Step {
            op: AtenOp::Mean,
            inputs: vec![sq],
            outputs: vec![var],
            ..self.blank()
        });
        let var_eps = self.unary(var, AtenOp::AddScalar, Keep::Nothing, false)?;
        let r = self.unary(var_eps, AtenOp::Rsqrt, Keep::Output, false)?;
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
                let one_plus = self.unary(wf, AtenOp::AddScalar, Keep::Nothing, false)?;
                let out = self.mul(normed, one_plus)?;
                self.cast(out, xv.dtype)
            }
            RmsStyle::Olmo2 => {
                let normed = self.mul(h, r)?;
                let out = self.mul(w, normed)?;
                self.cast(out, xv.dtype)
            }
        }
    }

    /// Cross-entropy: `log_softmax` keeps its result, `nll_loss` keeps the labels
    /// (`derivatives.yaml` `_log_softmax`, `nll_loss_forward`).
    pub(super) fn cross_entropy(
        &mut self,
        x: ValueId,
        shift: bool,
        upcast: bool,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        if xv.shape.rank() < 2 || !xv.dtype.is_float() {
            return Err(self.err(format!(
                "input {} {} is not float logits [batch, classes] or [batch, seq, vocab]",
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
        let label_shape = Shape::new(dims[..dims.len() - 1].to_vec());
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
        let xin = if upcast || self.s.amp.is_some() {
            self.upcast_f32(x)?
        } else {
            x
        };
        let inv = self.val(xin).clone();
        let lp = self.fresh(
            inv.shape.clone(),
            inv.dtype,
            "log-probabilities",
            inv.requires_grad,
        )?;
        let saves = vec![self.sid(lp)];
        self.push(Step {
            op: AtenOp::LogSoftmax,
            inputs: vec![xin],
            outputs: vec![lp],
            saves,
            ..self.blank()
        });
        let loss = self.fresh(Shape::default(), inv.dtype, "loss", inv.requires_grad)?;
        // nll_loss_forward also returns `total_weight`, a float32 scalar its backward keeps.
        let total_weight = self.storage(
            &Shape::default(),
            DType::Float32,
            StorageKind::Activation,
            "total_weight",
        )?;
        let mut step = Step {
            op: AtenOp::NllLoss,
            inputs: vec![lp],
            outputs: vec![loss],
            allocs: vec![total_weight],
            saves: vec![target, total_weight],
            ..self.blank()
        };
        if target != labels {
            step.allocs.push(target);
        }
        self.push(step);
        self.tape.held.push(self.sid(loss));
        Ok(loss)
    }
}

/// What a one-input operator keeps for its backward.
#[derive(Clone, Copy)]
pub(super) enum Keep {
    /// Nothing (only sizes or Python scalars).
    Nothing,
    /// Its input (`gelu`, `silu`, `pow`).
    Input,
    /// Its output (`relu`, `tanh`, `sigmoid`, `softmax`).
    Output,
    /// A clone of its input, made because it runs in place (`hardtanh_`, `silu_`).
    InputClone,
}
