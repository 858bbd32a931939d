//! `linear`.

#[allow(clippy::wildcard_imports)]
use super::*;
use crate::graph::LinearCfg;

/// `[.., in] → [.., out]`; checks `in_features` when given.
pub(super) fn out_shape(c: &LinearCfg, x: &Shape) -> Result<Shape, ShapeError> {
    let Some(in_f) = x.last().filter(|_| x.rank() >= 2) else {
        return wrong_rank(x, "[batch, .., features] for linear");
    };
    if let Some(expected) = c.in_features.filter(|&e| e != in_f) {
        return wrong_size(x, "features", in_f, "in_features", expected);
    }
    Ok(x.with_last(c.out_features))
}

impl Tracer<'_> {
    /// `nn.Linear` (with LoRA adapters when targeted): the weight is the tied embedding's, or
    /// a new one, quantized when [`LinearCfg::quantize`].
    pub(in crate::trace) fn linear_layer(
        &mut self,
        c: &LinearCfg,
        name: &str,
        x: ValueId,
        train: bool,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let in_f = self.last_dim(&xv, "linear")?;
        self.shaped(out_shape(c, &xv.shape))?;
        let quantize = self.quantizable(c.quantize, name);
        let shape = Shape::from([c.out_features, in_f]);
        let weight = match (&c.tie, self.stack_dtype(name)) {
            (Some(tied), _) => self.tied(tied, c.out_features, in_f)?,
            (None, Some(d)) if !quantize => {
                let trainable = train && self.s.lora.is_none();
                self.param_typed(shape, trainable, None, d)?
            }
            (None, _) => self.weight(shape, train, quantize)?,
        };
        let b = if c.bias {
            Some(self.param(Shape::from([c.out_features]), train)?)
        } else {
            None
        };
        if c.tie.is_some() {
            self.linear(x, weight, b, c.out_features)
        } else {
            self.base_projection(x, weight, b, (in_f, c.out_features), name)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(in_features: Option<u64>) -> LinearCfg {
        LinearCfg {
            in_features,
            out_features: 4,
            bias: true,
            tie: None,
            quantize: true,
        }
    }

    #[test]
    fn shapes() {
        assert_eq!(
            out_shape(&cfg(None), &Shape::from([2, 3, 8])),
            Ok(Shape::from([2, 3, 4]))
        );
        assert!(out_shape(&cfg(Some(7)), &Shape::from([2, 8])).is_err());
        assert!(out_shape(&cfg(None), &Shape::from([8])).is_err());
    }
}
