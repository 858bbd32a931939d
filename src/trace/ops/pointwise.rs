//! `parameter`, `softmax`, `concat`, `stochastic_depth`, `shift_right` (activations, `add`,
//! `mul`, `dropout` and the loss are in `elementwise`).

#[allow(clippy::wildcard_imports)]
use super::*;
use crate::graph::{ConcatCfg, ParameterCfg, SoftmaxCfg, StochasticDepthCfg};

/// A `parameter` joined by `add` or `mul` broadcasts to the input's shape; by `concat` it is
/// expanded over the batch (the returned shape) and must have the input's rank.
pub(super) fn parameter_shape(c: &ParameterCfg, x: &Shape) -> Result<Shape, ShapeError> {
    let ps = Shape::new(c.shape.clone());
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
        let p = self.param(Shape::new(c.shape.clone()), train)?;
        match c.combine {
            Combine::Add => {
                self.shaped(parameter_shape(c, &xv.shape))?;
                self.add(&[x, p], false)
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
        let y = self.fresh(xv.shape.clone(), xv.dtype, "output", xv.requires_grad)?;
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
        };
        assert!(parameter_shape(&add, &x).is_ok());
        let cls = ParameterCfg {
            shape: vec![1, 1, 768],
            combine: Combine::Concat(1),
        };
        assert_eq!(parameter_shape(&cls, &x), Ok(Shape::from([4, 1, 768])));
        let bad = ParameterCfg {
            shape: vec![2, 768],
            combine: Combine::Mul,
        };
        assert!(parameter_shape(&bad, &x).is_err());
    }
}
