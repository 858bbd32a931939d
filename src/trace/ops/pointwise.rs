//! `parameter`, `softmax`, `concat`, `stochastic_depth`, `shift_right` (activations, `add`,
//! `mul`, `dropout` and the loss are in `elementwise`).

#[allow(clippy::wildcard_imports)]
use super::*;
use crate::graph::{ConcatCfg, ParameterCfg, SoftmaxCfg, StochasticDepthCfg};

/// A `parameter` joined by `add` or `mul` broadcasts to the input's shape; by `concat` it is
/// expanded over the batch (the returned shape) and must have the input's rank.
pub(super) fn parameter_shape(c: &ParameterCfg, x: &Shape) -> Result<Shape, ShapeError> {
    let ps = match (c.interpolate, c.shape.as_slice()) {
        // The table as read: its class row and the `h × w` grid it is interpolated to.
        (Some(Pair(h, w)), &[1, _, d]) => Shape::new(vec![
            1,
            sized(
                h.checked_mul(w).and_then(|n| n.checked_add(1)),
                "an interpolated position table",
            )?,
            d,
        ]),
        _ => Shape::new(c.shape.clone()),
    };
    match c.combine {
        Combine::Add | Combine::Mul => {
            if broadcast(x, &ps).as_ref() != Some(x) {
                return invalid(format!(
                    "parameter of shape {ps} does not broadcast to the input {x}"
                ));
            }
            Ok(ps)
        }
        Combine::Unused => Ok(x.clone()),
        Combine::Concat(_) => {
            let rank = x.rank();
            if c.shape.len() != rank {
                return invalid(format!(
                    "parameter of shape {:?} has rank {}, expected rank {rank} like the input {x}",
                    c.shape,
                    c.shape.len()
                ));
            }
            let mut expanded = c.shape.clone();
            expanded[0] = x.dims()[0];
            Ok(Shape::new(expanded))
        }
    }
}

impl Tracer<'_> {
    /// A free parameter added to, multiplied with or concatenated to the input.
    pub(super) fn parameter(
        &mut self,
        c: &ParameterCfg,
        x: ValueId,
        train: bool,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        if c.combine == Combine::Unused {
            // No operator reads it, so autograd never gives it a `.grad`.
            self.param(Shape::new(c.shape.clone()), false)?;
            return Ok(x);
        }
        if let Some(full) = &c.buffer {
            // A buffer (diffusers' `pos_embed`): the add reads it, or a crop copy of its
            // leading elements when it is larger than `shape`.
            self.shaped(parameter_shape(c, &xv.shape))?;
            let full = Shape::new(full.clone());
            let dt = self.param_dtype();
            let b = self.buffer(full.clone(), dt, "buffer")?;
            let bv = self.value(b, full.clone(), dt, Layout::Contiguous, false, false);
            let part = Shape::new(c.shape.clone());
            let read = if part.numel() == full.numel() {
                self.view_op(bv, part, Layout::Contiguous, AtenOp::View, false)
            } else {
                let crop = self.fresh(part, dt, "cropped buffer", false)?;
                self.call(Call::new(AtenOp::Clone, vec![bv], vec![crop]))?;
                crop
            };
            return self.add(&[x, read], false);
        }
        let p = self.param(Shape::new(c.shape.clone()), train)?;
        match c.combine {
            Combine::Add => {
                let read = self.shaped(parameter_shape(c, &xv.shape))?;
                let table = match (c.interpolate, c.grid_side()) {
                    (Some(Pair(h, w)), Some(g)) => self.interpolate_table(p, g, (h, w), &read)?,
                    _ => p,
                };
                self.add(&[x, table], false)
            }
            Combine::Mul => {
                self.shaped(parameter_shape(c, &xv.shape))?;
                self.mul(p, x)
            }
            Combine::Unused => Ok(x),
            Combine::Concat(dim) => {
                let a =
                    self.shaped(axis(dim, xv.shape.rank()).and_then(|a| batch_kept(a, "concat")))?;
                let expanded = self.shaped(parameter_shape(c, &xv.shape))?;
                let ev = self.view_of(p, expanded, Layout::Strided);
                self.tape.values[ev].param = false;
                self.call(Call::new(AtenOp::Expand, vec![p], vec![ev]).view_grad())?;
                self.concat(&[ev, x], a)
            }
        }
    }

    /// transformers' `Dinov2Embeddings.interpolate_pos_encoding` on the `[1, 1 + g², D]` table
    /// `p`, to the `[1, 1 + h·w, D]` table `read`: `p[:, :1]` and `p[:, 1:]` (slices, views),
    /// `reshape(1, g, g, D)` (a view: the slice is contiguous), `permute(0, 3, 1, 2)`,
    /// `.to(float32)` (a copy when 16-bit), bicubic `F.interpolate` to `[1, D, h, w]`
    /// (`upsample_bicubic2d`, which saves only sizes: `derivatives.yaml`), `.to(dtype)` back (a
    /// copy when 16-bit), `permute(0, 2, 3, 1).view(1, -1, D)` and `torch.cat` with the class
    /// row. `upsample_bicubic2d` gives its output its input's memory format
    /// (`suggest_memory_format`: channels-last here, from the permute), so the permute back is
    /// contiguous and `view` copies nothing. Nothing is kept for backward; the backward
    /// allocates the gradients of the casts, of the interpolation (`[1, D, g, g]` float32) and
    /// a zero `[1, 1 + g², D]` gradient for each slice.
    fn interpolate_table(
        &mut self,
        p: ValueId,
        g: u64,
        (h, w): (u64, u64),
        read: &Shape,
    ) -> Result<ValueId, Error> {
        let pv = self.val(p).clone();
        let &[_, n, d] = pv.shape.dims() else {
            return Err(self.err(format!(
                "a position table to interpolate must be [1, 1 + g·g, D], got {}",
                pv.shape
            )));
        };
        let cls = self.view_op(
            p,
            Shape::new(vec![1, 1, d]),
            Layout::Contiguous,
            AtenOp::Slice,
            false,
        );
        let patches = self.view_op(
            p,
            Shape::new(vec![1, n - 1, d]),
            Layout::Contiguous,
            AtenOp::Slice,
            false,
        );
        let grid = self.view_op(
            patches,
            Shape::new(vec![1, g, g, d]),
            Layout::Contiguous,
            AtenOp::View,
            true,
        );
        let channels = self.view_op(
            grid,
            Shape::new(vec![1, d, g, g]),
            Layout::Strided,
            AtenOp::Permute,
            true,
        );
        let f32 = self.upcast_f32(channels)?;
        let resized = self.fresh(
            Shape::new(vec![1, d, h, w]),
            DType::Float32,
            "interpolated position table",
            self.rg(f32),
        )?;
        self.call(Call::new(
            AtenOp::UpsampleBicubic2d,
            vec![f32],
            vec![resized],
        ))?;
        let back = if pv.dtype == DType::Float32 {
            resized
        } else {
            let out = self.fresh(
                Shape::new(vec![1, d, h, w]),
                pv.dtype,
                "interpolated position table",
                self.rg(resized),
            )?;
            self.call(Call::new(AtenOp::ToCopy, vec![resized], vec![out]))?;
            out
        };
        let hwd = self.view_op(
            back,
            Shape::new(vec![1, h, w, d]),
            Layout::Contiguous,
            AtenOp::Permute,
            true,
        );
        let rows = Shape::new(vec![1, read.dims()[1] - 1, d]);
        let flat = self.view_op(hwd, rows, Layout::Contiguous, AtenOp::View, true);
        self.concat(&[cls, flat], 1)
    }

    /// `_softmax`: keeps its output (in float32 under autocast).
    pub(super) fn softmax(&mut self, c: &SoftmaxCfg, x: ValueId) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        self.shaped(axis(c.dim, xv.shape.rank()))?;
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
        self.call(Call::new(AtenOp::Softmax, vec![xin], vec![y]))?;
        Ok(y)
    }

    /// `torch.cat` of the layer's inputs.
    pub(super) fn concat_layer(
        &mut self,
        c: &ConcatCfg,
        inputs: &[ValueId],
    ) -> Result<ValueId, Error> {
        let rank = self.val(inputs[0]).shape.rank();
        let a = self.shaped(axis(c.dim, rank).and_then(|a| batch_kept(a, "concat")))?;
        self.concat(inputs, a)
    }

    /// LLaVA's and Qwen2-VL's merge of the image features into the text embeddings
    /// (`LlavaModel.forward`, `Qwen2VLModel.forward`): `input_ids == image_token_id` (a new
    /// `[batch, seq]` bool tensor; `unsqueeze(-1)` is a view), `.sum()` (an int64 scalar), the
    /// per-image features (`get_image_features` returns them as a list of views, which the model
    /// output keeps until the step ends) concatenated with `torch.cat` (a copy) and cast to the
    /// embeddings' dtype when they differ (autocast), then
    /// `inputs_embeds.masked_scatter(mask, image_features)`: a new tensor of the embeddings'
    /// shape that keeps only the mask (`derivatives.yaml`).
    ///
    /// Each sample's `tokens` image rows take `tokens` of its `seq` positions: a sequence
    /// shorter than that is refused.
    pub(super) fn masked_scatter(
        &mut self,
        ids: ValueId,
        embeds: ValueId,
        features: ValueId,
    ) -> Result<ValueId, Error> {
        let iv = self.val(ids).clone();
        let ev = self.val(embeds).clone();
        let fv = self.val(features).clone();
        let (id, ed, fd) = (iv.shape.dims(), ev.shape.dims(), fv.shape.dims());
        if iv.dtype.is_float() || id.len() != 2 {
            return Err(self.err(format!(
                "first input is {} {}, expected the token ids [batch, seq]",
                iv.dtype, iv.shape
            )));
        }
        if ed.len() != 3 || ed[..2] != id[..] || !ev.dtype.is_float() {
            return Err(self.err(format!(
                "second input is {} {}, expected the text embeddings [batch, seq, hidden] of the ids {}",
                ev.dtype, ev.shape, iv.shape
            )));
        }
        if fd.len() != 3 || fd[0] != ed[0] || fd[2] != ed[2] {
            return Err(self.err(format!(
                "third input is {}, expected the image features [batch, tokens, hidden] with the embeddings' batch and hidden size {}",
                fv.shape, ev.shape
            )));
        }
        if fd[1] > ed[1] {
            return Err(self.err(format!(
                "the sequence has {} positions, fewer than the image's {} tokens: --seq counts the text and image tokens together",
                ed[1], fd[1]
            )));
        }
        let mask = self.fresh(iv.shape.clone(), DType::Bool, "image token mask", false)?;
        self.call(Call::new(AtenOp::EqScalar, vec![ids], vec![mask]))?;
        let count = self.fresh(Shape::from([1]), DType::Int64, "image token count", false)?;
        self.call(Call::new(AtenOp::Sum, vec![mask], vec![count]))?;
        // The per-image views stay in the model output (`image_outputs.pooler_output`,
        // `image_hidden_states`) until the step ends; `torch.cat` of them is a copy.
        self.tape.held.push(fv.storage);
        let features = self.concat(&[features], 1)?;
        let features = self.cast(features, ev.dtype)?;
        let y = self.fresh(
            ev.shape.clone(),
            ev.dtype,
            "output",
            ev.requires_grad || fv.requires_grad,
        )?;
        let mask_storage = self.val(mask).storage;
        self.call(
            Call::new(AtenOp::MaskedScatter, vec![embeds, features], vec![y])
                .aux(vec![mask_storage]),
        )?;
        Ok(y)
    }

    /// torchvision.ops.stochastic_depth, mode "row": `input * noise` with noise `[B, 1, ..]`
    /// (bernoulli, divided by the survival rate); mul keeps the noise.
    pub(super) fn stochastic_depth(
        &mut self,
        c: &StochasticDepthCfg,
        x: ValueId,
    ) -> Result<ValueId, Error> {
        if !self.training() || c.p == 0.0 {
            return Ok(x);
        }
        let xv = self.val(x).clone();
        let mut dims = vec![1; xv.shape.rank()];
        dims[0] = xv.shape.dims()[0];
        let noise_shape = Shape::new(dims);
        let noise = self.storage(
            &noise_shape,
            xv.dtype,
            StorageKind::Activation,
            "stochastic depth noise",
        )?;
        let noise_v = self.value(
            noise,
            noise_shape,
            xv.dtype,
            Layout::Contiguous,
            false,
            false,
        );
        let layout = self.elementwise_layout(&[x], &xv.shape);
        let y = self.fresh(xv.shape.clone(), xv.dtype, "output", xv.requires_grad)?;
        self.tape.values[y].layout = layout;
        let call = Call::new(AtenOp::Mul, vec![x, noise_v], vec![y]);
        self.call(call.allocs(vec![noise]))?;
        Ok(y)
    }

    /// T5's `_shift_right`: a new int64 tensor of the ids' shape.
    pub(super) fn shift_right(&mut self, x: ValueId) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        if xv.dtype.is_float() {
            return Err(self.err(format!(
                "input is {} {}, expected integer token ids",
                xv.dtype, xv.shape
            )));
        }
        let y = self.fresh(xv.shape.clone(), xv.dtype, "shifted ids", false)?;
        self.call(Call::new(AtenOp::ShiftRight, vec![x], vec![y]))?;
        Ok(y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_shapes() {
        let x = Shape::from([4, 197, 768]);
        let add = ParameterCfg {
            shape: vec![1, 197, 768],
            combine: Combine::Add,
            buffer: None,
            interpolate: None,
        };
        assert!(parameter_shape(&add, &x).is_ok());
        let cls = ParameterCfg {
            shape: vec![1, 1, 768],
            combine: Combine::Concat(1),
            buffer: None,
            interpolate: None,
        };
        assert_eq!(parameter_shape(&cls, &x), Ok(Shape::from([4, 1, 768])));
        let bad = ParameterCfg {
            shape: vec![2, 768],
            combine: Combine::Mul,
            buffer: None,
            interpolate: None,
        };
        assert!(parameter_shape(&bad, &x).is_err());
        // DINOv2's table of a 4×4 grid read at 5×6: [1, 31, D], which must broadcast to x.
        let grid = ParameterCfg {
            shape: vec![1, 17, 64],
            combine: Combine::Add,
            buffer: None,
            interpolate: Some(Pair(5, 6)),
        };
        assert_eq!(grid.grid_side(), Some(4));
        let x31 = Shape::from([2, 31, 64]);
        assert_eq!(parameter_shape(&grid, &x31), Ok(Shape::from([1, 31, 64])));
        assert!(parameter_shape(&grid, &Shape::from([2, 17, 64])).is_err());
    }
}
