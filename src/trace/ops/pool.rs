//! `maxpool2d`, `avgpool2d`, `adaptive_avgpool2d`.

#[allow(clippy::wildcard_imports)]
use super::*;
use crate::graph::{AdaptiveAvgPool2dCfg, AvgPool2dCfg, MaxPool2dCfg};

/// `[B, C, H, W] → [B, C, H', W']` for a pooling window (see `window_out`).
#[allow(clippy::too_many_arguments)]
fn pooled(
    x: &Shape,
    kernel: Pair,
    stride: Pair,
    padding: Pair,
    dilation: Pair,
    ceil: bool,
) -> Result<Shape, ShapeError> {
    let [b, c, h, w] = *x.dims() else {
        return wrong_rank(x, "[batch, channels, height, width]");
    };
    let oh = window_out(h, kernel.0, stride.0, padding.0, dilation.0, ceil, x)?;
    let ow = window_out(w, kernel.1, stride.1, padding.1, dilation.1, ceil, x)?;
    Ok(Shape::from([b, c, oh, ow]))
}

/// `nn.MaxPool2d`'s output shape.
pub(super) fn max_pool_shape(c: &MaxPool2dCfg, x: &Shape) -> Result<Shape, ShapeError> {
    pooled(x, c.kernel, c.stride, c.padding, c.dilation, c.ceil_mode)
}

/// `nn.AvgPool2d`'s output shape.
pub(super) fn avg_pool_shape(c: &AvgPool2dCfg, x: &Shape) -> Result<Shape, ShapeError> {
    pooled(x, c.kernel, c.stride, c.padding, Pair(1, 1), c.ceil_mode)
}

impl Tracer<'_> {
    /// `max_pool2d_with_indices`: keeps its input and the int64 indices.
    pub(super) fn max_pool2d(&mut self, c: &MaxPool2dCfg, x: ValueId) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        self.nchw(&xv)?;
        let shape = self.shaped(max_pool_shape(c, &xv.shape))?;
        let y = self.fresh(shape.clone(), xv.dtype, "output", xv.requires_grad)?;
        let idx = self.storage(&shape, DType::Int64, StorageKind::Activation, "indices")?;
        let call = Call::new(AtenOp::MaxPool2dWithIndices, vec![x], vec![y]);
        self.call(call.aux(vec![idx]).results(vec![idx]))?;
        Ok(y)
    }

    /// `avg_pool2d`: keeps its input.
    pub(super) fn avg_pool2d(&mut self, c: &AvgPool2dCfg, x: ValueId) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        self.nchw(&xv)?;
        let shape = self.shaped(avg_pool_shape(c, &xv.shape))?;
        let y = self.fresh(shape, xv.dtype, "output", xv.requires_grad)?;
        self.call(Call::new(AtenOp::AvgPool2d, vec![x], vec![y]))?;
        Ok(y)
    }

    /// `adaptive_avg_pool2d`: a 1×1 output runs as a mean.
    pub(super) fn adaptive_avg_pool2d(
        &mut self,
        c: &AdaptiveAvgPool2dCfg,
        x: ValueId,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let (b, ch, _, _) = self.nchw(&xv)?;
        let y = self.fresh(
            Shape::from([b, ch, c.output.0, c.output.1]),
            xv.dtype,
            "output",
            xv.requires_grad,
        )?;
        if c.output == Pair(1, 1) {
            // ATen's adaptive_avg_pool2d runs `mean(-1, -2, keepdim)` for a 1×1 output, whose
            // backward needs only sizes.
            self.call(Call::new(AtenOp::Mean, vec![x], vec![y]))?;
        } else {
            self.call(Call::new(AtenOp::AdaptiveAvgPool2d, vec![x], vec![y]))?;
        }
        Ok(y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_shapes() {
        let c = MaxPool2dCfg {
            kernel: Pair(3, 3),
            stride: Pair(2, 2),
            padding: Pair(1, 1),
            dilation: Pair(1, 1),
            ceil_mode: false,
        };
        // ResNet's stem pool: (112 + 2 − 3)/2 + 1 = 56.
        assert_eq!(
            max_pool_shape(&c, &Shape::from([2, 64, 112, 112])),
            Ok(Shape::from([2, 64, 56, 56]))
        );
        assert!(max_pool_shape(&c, &Shape::from([2, 64, 112])).is_err());
        let a = AvgPool2dCfg {
            kernel: Pair(2, 2),
            stride: Pair(2, 2),
            padding: Pair(0, 0),
            ceil_mode: true,
        };
        assert_eq!(
            avg_pool_shape(&a, &Shape::from([1, 3, 7, 7])),
            Ok(Shape::from([1, 3, 4, 4]))
        );
    }
}
