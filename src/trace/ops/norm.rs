//! `batchnorm1d/2d`, `layernorm`, `rmsnorm`, `groupnorm`.

#[allow(clippy::wildcard_imports)]
use super::*;
use crate::graph::{BatchNormCfg, GroupNormCfg, LayerNormCfg, RmsNormCfg};

/// BatchNorm keeps the shape: `[B, C]` or `[B, C, L]` (1-D), `[B, C, H, W]` (2-D); checks
/// `num_features` when given.
pub(super) fn batch_norm_shape(c: &BatchNormCfg, x: &Shape) -> Result<Shape, ShapeError> {
    let rank = x.rank();
    let ok = if c.spatial == 1 {
        rank == 2 || rank == 3
    } else {
        rank == 4
    };
    if !ok {
        let expected = if c.spatial == 1 {
            "[batch, channels] or [batch, channels, length]"
        } else {
            "[batch, channels, height, width]"
        };
        return wrong_rank(x, expected);
    }
    let ch = x.dims()[1];
    if let Some(n) = c.num_features.filter(|&n| n != ch) {
        return wrong_size(x, "channels", ch, "num_features", n);
    }
    Ok(x.clone())
}

/// GroupNorm keeps the shape `[B, C, ..]`; `C` must divide into the groups.
pub(super) fn group_norm_shape(c: &GroupNormCfg, x: &Shape) -> Result<Shape, ShapeError> {
    if x.rank() < 2 {
        return wrong_rank(x, "at least [batch, channels]");
    }
    let ch = x.dims()[1];
    if !ch.is_multiple_of(c.groups) {
        return invalid(format!(
            "{ch} channels are not divisible into {} groups",
            c.groups
        ));
    }
    Ok(x.clone())
}

impl Tracer<'_> {
    /// `native_batch_norm`: in training keeps the input and float32 (for 16-bit inputs)
    /// `save_mean` and `save_invstd` `[C]`.
    pub(super) fn batch_norm(
        &mut self,
        c: &BatchNormCfg,
        x: ValueId,
        train: bool,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let shape = self.shaped(batch_norm_shape(c, &xv.shape))?;
        let ch = shape.dims()[1];
        let mut ins = vec![x];
        if c.affine {
            ins.push(self.param(Shape::from([ch]), train)?);
            ins.push(self.param(Shape::from([ch]), train)?);
        }
        if c.track_running_stats {
            let bdt = self.param_dtype();
            self.buffer(Shape::from([ch]), bdt, "running_mean")?;
            self.buffer(Shape::from([ch]), bdt, "running_var")?;
            self.buffer(Shape::default(), DType::Int64, "num_batches_tracked")?;
        }
        let rg = ins.iter().any(|&v| self.rg(v));
        let y = self.fresh(shape, xv.dtype, "output", rg)?;
        let mut stats = Vec::new();
        if self.training() {
            // `native_batch_norm` returns save_mean and save_invstd ([C], in the statistics
            // dtype) for its backward.
            let sdt = stats_dtype(xv.dtype);
            let mean = self.storage(
                &Shape::from([ch]),
                sdt,
                StorageKind::Activation,
                "save_mean",
            )?;
            let invstd = self.storage(
                &Shape::from([ch]),
                sdt,
                StorageKind::Activation,
                "save_invstd",
            )?;
            stats = vec![mean, invstd];
        }
        let call = Call::new(AtenOp::NativeBatchNorm, ins, vec![y]);
        self.call(call.aux(stats.clone()).results(stats))?;
        Ok(y)
    }

    /// `native_layer_norm` over the last dimension.
    pub(in crate::trace) fn layer_norm(
        &mut self,
        c: &LayerNormCfg,
        x: ValueId,
        train: bool,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let h = self.last_dim(&xv, "layernorm")?;
        if c.cohere {
            let w = self.param(Shape::from([h]), train)?;
            return self.cohere_layer_norm(x, w);
        }
        let xin = if self.autocast_f32_norms() || c.upcast {
            self.upcast_f32(x)?
        } else {
            x
        };
        // `layer_norm_cpu`/`layer_norm_cuda` work on `input.expect_contiguous()`: a strided input
        // (CLIP's pooled `last_hidden_state[:, 0, :]`) is copied inside the kernel, and autograd
        // keeps the input as passed (ATen's `native/layer_norm.cpp`).
        let kernel_copy = if self.val(xin).layout == Layout::Contiguous {
            None
        } else {
            let v = self.val(xin).clone();
            Some(self.storage(
                &v.shape,
                v.dtype,
                StorageKind::Activation,
                "contiguous copy",
            )?)
        };
        let mut ins = vec![xin];
        if c.affine {
            ins.push(self.param(Shape::from([h]), train)?);
            if c.bias {
                ins.push(self.param(Shape::from([h]), train)?);
            }
        }
        let rows = xv.shape.with_last(1);
        // derivatives.yaml `native_layer_norm`: input, weight, bias, mean, rstd.
        let y = self.norm_with_stats(
            AtenOp::NativeLayerNorm,
            xin,
            ins,
            &xv.shape,
            rows,
            kernel_copy,
        )?;
        let yv = self.val(y).clone();
        if !c.upcast || yv.dtype == xv.dtype || self.s.amp.is_some() {
            return Ok(y);
        }
        // `.to(orig_dtype)`: a 16-bit copy of the float32 result.
        let back = self.fresh(yv.shape.clone(), xv.dtype, "cast back", yv.requires_grad)?;
        self.call(Call::new(AtenOp::ToCopy, vec![y], vec![back]))?;
        Ok(back)
    }

    /// RMSNorm over the last dimension (see [`RmsNormCfg`]).
    pub(super) fn rms_norm_layer(
        &mut self,
        c: &RmsNormCfg,
        x: ValueId,
        train: bool,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let h = self.last_dim(&xv, "rmsnorm")?;
        let w = self.param(Shape::from([h]), train)?;
        self.rms_norm(x, w, c.style)
    }

    /// `native_group_norm` over dimension 1.
    pub(super) fn group_norm(
        &mut self,
        c: &GroupNormCfg,
        x: ValueId,
        train: bool,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        self.shaped(group_norm_shape(c, &xv.shape))?;
        let (b, ch) = (xv.shape.dims()[0], xv.shape.dims()[1]);
        let xin = if self.autocast_f32_norms() {
            self.upcast_f32(x)?
        } else {
            x
        };
        let mut ins = vec![xin];
        if c.affine {
            ins.push(self.param(Shape::from([ch]), train)?);
            ins.push(self.param(Shape::from([ch]), train)?);
        }
        // derivatives.yaml `native_group_norm`: input, weight, mean, rstd.
        self.norm_with_stats(
            AtenOp::NativeGroupNorm,
            xin,
            ins,
            &xv.shape,
            Shape::from([b, c.groups]),
            None,
        )
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
        scratch: Option<StorageId>,
    ) -> Result<ValueId, Error> {
        let xd = self.val(xin).dtype;
        let rg = ins.iter().any(|&v| self.rg(v));
        let y = self.fresh(shape.clone(), xd, "output", rg)?;
        // CPU `layer_norm_cpu` allocates mean and rstd in `param_scalar_type`: the input's own
        // dtype unless the weights' differ (`is_mixed_type`); CUDA's `layer_norm_cuda` in the
        // accumulate type (float32 for 16-bit inputs). ATen's `native/layer_norm.cpp`.
        // `native_group_norm` (`native/group_norm.cpp`, the CPU and CUDA kernels' common entry)
        // allocates them in `param_scalar_type` on both devices.
        let same_dtype = ins[1..].iter().all(|&v| self.val(v).dtype == xd);
        let input_dtype = match op {
            AtenOp::NativeLayerNorm => self.s.device == Device::Cpu,
            AtenOp::NativeGroupNorm => true,
            _ => false,
        };
        let sdt = if input_dtype && same_dtype {
            xd
        } else {
            stats_dtype(xd)
        };
        let mean = self.storage(&stats, sdt, StorageKind::Activation, "mean")?;
        let rstd = self.storage(&stats, sdt, StorageKind::Activation, "rstd")?;
        debug_assert_eq!(ins[0], xin);
        let call = Call::new(op, ins, vec![y]);
        // The kernel's contiguous copy of a strided input comes before its output.
        self.call(
            call.aux(vec![mean, rstd])
                .allocs(scratch.into_iter().collect())
                .results(vec![mean, rstd]),
        )?;
        Ok(y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_norm_ranks() {
        let c = BatchNormCfg {
            spatial: 1,
            num_features: Some(6),
            affine: true,
            track_running_stats: true,
        };
        assert!(batch_norm_shape(&c, &Shape::from([4, 6])).is_ok());
        assert!(batch_norm_shape(&c, &Shape::from([4, 6, 3])).is_ok());
        assert!(batch_norm_shape(&c, &Shape::from([4, 6, 3, 3])).is_err());
        assert!(batch_norm_shape(&c, &Shape::from([4, 5])).is_err());
    }

    #[test]
    fn group_norm_groups_divide_channels() {
        let c = GroupNormCfg {
            groups: 3,
            affine: true,
        };
        assert!(group_norm_shape(&c, &Shape::from([2, 6, 3, 3])).is_ok());
        assert!(group_norm_shape(&c, &Shape::from([2, 4, 3, 3])).is_err());
    }
}
