//! `upsample` (`interpolate`), `pad`.

#[allow(clippy::wildcard_imports)]
use super::*;
use crate::graph::{PadCfg, UpsampleCfg, UpsampleTo};
use crate::spec::FillMode;

/// `[B, C, L] → [B, C, L']` or `[B, C, H, W] → [B, C, H', W']`: each spatial size is `size`, or
/// `⌊len·scale_factor⌋` (`at::native::upsample::compute_output_size` converts the double
/// `len·scale` to an integer).
/// `linear` takes a `[B, C, L]` input, `bilinear` a `[B, C, H, W]` one.
pub(super) fn upsample_shape(c: &UpsampleCfg, x: &Shape) -> Result<Shape, ShapeError> {
    let d = x.dims();
    let expected = match c.mode {
        FillMode::Linear => "rank 3 [batch, channels, length] for `mode = \"linear\"`",
        FillMode::Bilinear => "rank 4 [batch, channels, height, width] for `mode = \"bilinear\"`",
        _ => "rank 3 [batch, channels, length] or rank 4 [batch, channels, height, width]",
    };
    let fits = match c.mode {
        FillMode::Linear => d.len() == 3,
        FillMode::Bilinear => d.len() == 4,
        _ => d.len() == 3 || d.len() == 4,
    };
    if !fits {
        return wrong_rank(x, expected);
    }
    let spatial = &d[2..];
    let sizes: Vec<u64> = match c.to {
        UpsampleTo::Size(Pair(h, w)) if spatial.len() == 1 => {
            if h != w {
                return invalid(format!(
                    "`size` [{h}, {w}] gives two sizes; a [batch, channels, length] input takes one"
                ));
            }
            vec![w]
        }
        UpsampleTo::Size(Pair(h, w)) => vec![h, w],
        UpsampleTo::Scale(f) => {
            let mut out = Vec::with_capacity(spatial.len());
            for &len in spatial {
                #[allow(clippy::cast_precision_loss)] // sizes are far below 2^52
                let scaled = (len as f64 * f).floor();
                if !(1.0..1.8e19).contains(&scaled) {
                    return invalid(format!(
                        "`scale_factor` {f} turns the size {len} of input {x} into {scaled}; it must be at least 1"
                    ));
                }
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // checked
                out.push(scaled as u64);
            }
            out
        }
    };
    let mut out = vec![d[0], d[1]];
    out.extend(sizes);
    Ok(Shape::new(out))
}

/// `F.pad`'s output: each pair of `pad` widens one dimension, the last first. `constant` pads
/// any dimension but the batch; the other modes pad exactly the spatial dimensions
/// (`[B, C, L]` takes 2 widths, `[B, C, H, W]` 4, `[B, C, D, H, W]` 6, as ATen's `_pad_enum`
/// requires). `reflect` needs each width below its dimension's size, `circular` at most that
/// size (`reflection_pad*d`, `_pad_circular`).
pub(super) fn pad_shape(c: &PadCfg, x: &Shape) -> Result<Shape, ShapeError> {
    let d = x.dims();
    let dims = c.pad.len() / 2;
    if c.mode == FillMode::Constant {
        if dims >= d.len() {
            return wrong_rank(
                x,
                format!(
                    "rank above {dims}: `pad` has {} widths and the batch dimension is not padded",
                    c.pad.len()
                ),
            );
        }
    } else if d.len() != dims + 2 {
        return wrong_rank(
            x,
            format!(
                "rank {} [batch, channels, ..] for {} `pad` widths with `mode = \"{}\"`",
                dims + 2,
                c.pad.len(),
                c.mode.as_str()
            ),
        );
    }
    let mut out = d.to_vec();
    for (i, w) in c.pad.chunks_exact(2).enumerate() {
        let at = d.len() - 1 - i;
        let len = d[at];
        let widest = w[0].max(w[1]);
        let fits = match c.mode {
            FillMode::Reflect => widest < len,
            FillMode::Circular => widest <= len,
            _ => true,
        };
        if !fits {
            return invalid(format!(
                "`pad` width {widest} does not fit dimension {at} (size {len}) of input {x} with `mode = \"{}\"` ({})",
                c.mode.as_str(),
                if c.mode == FillMode::Reflect {
                    "it must be smaller"
                } else {
                    "it must not be larger"
                }
            ));
        }
        out[at] = sized(
            len.checked_add(w[0]).and_then(|v| v.checked_add(w[1])),
            "a padded size",
        )?;
    }
    Ok(Shape::new(out))
}

impl Tracer<'_> {
    /// `F.pad`: `constant_pad_nd` (keeps nothing), `reflection_pad*d` / `replication_pad*d`
    /// (keep their input) or `_pad_circular` (keeps nothing); a new output each.
    pub(super) fn pad(&mut self, c: &PadCfg, x: ValueId) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let shape = self.shaped(pad_shape(c, &xv.shape))?;
        let dims = c.pad.len() / 2;
        let op = match (c.mode, dims) {
            (FillMode::Reflect, 1) => AtenOp::ReflectionPad1d,
            (FillMode::Reflect, 2) => AtenOp::ReflectionPad2d,
            (FillMode::Reflect, _) => AtenOp::ReflectionPad3d,
            (FillMode::Replicate, 1) => AtenOp::ReplicationPad1d,
            (FillMode::Replicate, 2) => AtenOp::ReplicationPad2d,
            (FillMode::Replicate, _) => AtenOp::ReplicationPad3d,
            (FillMode::Circular, _) => AtenOp::PadCircular,
            _ => AtenOp::ConstantPadNd,
        };
        let y = self.fresh(shape, xv.dtype, "output", xv.requires_grad)?;
        self.call(Call::new(op, vec![x], vec![y]))?;
        Ok(y)
    }

    /// `upsample_nearest1d/2d`, `upsample_linear1d`, `upsample_bilinear2d`: a new output; each
    /// saves nothing but sizes (`derivatives.yaml`).
    pub(super) fn upsample(&mut self, c: &UpsampleCfg, x: ValueId) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let shape = self.shaped(upsample_shape(c, &xv.shape))?;
        let op = match (c.mode, xv.shape.rank()) {
            (FillMode::Nearest, 3) => AtenOp::UpsampleNearest1d,
            (FillMode::Linear, _) => AtenOp::UpsampleLinear1d,
            (FillMode::Bilinear, _) => AtenOp::UpsampleBilinear2d,
            _ => AtenOp::UpsampleNearest2d,
        };
        let y = self.fresh(shape, xv.dtype, "output", xv.requires_grad)?;
        self.call(Call::new(op, vec![x], vec![y]))?;
        Ok(y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(mode: FillMode, to: UpsampleTo) -> UpsampleCfg {
        UpsampleCfg {
            mode,
            to,
            align_corners: false,
        }
    }

    #[test]
    fn pad_shapes() {
        let pad = |mode, pad: &[u64]| PadCfg {
            mode,
            pad: pad.to_vec(),
        };
        let x = Shape::from([2, 3, 4, 4]);
        // Last dimension first: W 4 + 2 + 1 = 7, H 4 + 1 + 2 = 7.
        assert_eq!(
            pad_shape(&pad(FillMode::Replicate, &[2, 1, 1, 2]), &x),
            Ok(Shape::from([2, 3, 7, 7]))
        );
        // Constant pads any dimension but the batch.
        assert_eq!(
            pad_shape(&pad(FillMode::Constant, &[1, 1]), &x),
            Ok(Shape::from([2, 3, 4, 6]))
        );
        assert_eq!(
            pad_shape(&pad(FillMode::Constant, &[0, 0, 0, 0, 1, 0]), &x),
            Ok(Shape::from([2, 4, 4, 4]))
        );
        assert!(pad_shape(&pad(FillMode::Constant, &[0; 8]), &x).is_err());
        // Reflect pads exactly the spatial dimensions, by less than their size.
        assert!(pad_shape(&pad(FillMode::Reflect, &[1, 1]), &x).is_err());
        assert!(pad_shape(&pad(FillMode::Reflect, &[4, 0, 0, 0]), &x).is_err());
        assert!(pad_shape(&pad(FillMode::Circular, &[4, 0, 0, 0]), &x).is_ok());
        assert!(pad_shape(&pad(FillMode::Circular, &[5, 0, 0, 0]), &x).is_err());
    }

    #[test]
    fn upsample_shapes() {
        // ⌊5·1.5⌋ = 7.
        let c = cfg(FillMode::Nearest, UpsampleTo::Scale(1.5));
        assert_eq!(
            upsample_shape(&c, &Shape::from([2, 3, 5, 5])),
            Ok(Shape::from([2, 3, 7, 7]))
        );
        assert_eq!(
            upsample_shape(&c, &Shape::from([2, 3, 5])),
            Ok(Shape::from([2, 3, 7]))
        );
        let b = cfg(FillMode::Bilinear, UpsampleTo::Size(Pair(10, 12)));
        assert_eq!(
            upsample_shape(&b, &Shape::from([2, 2, 7, 7])),
            Ok(Shape::from([2, 2, 10, 12]))
        );
        assert!(upsample_shape(&b, &Shape::from([2, 2, 7])).is_err());
        let l = cfg(FillMode::Linear, UpsampleTo::Size(Pair(10, 12)));
        assert!(upsample_shape(&l, &Shape::from([2, 2, 7])).is_err());
        // ⌊1·0.5⌋ = 0: no output.
        let small = cfg(FillMode::Nearest, UpsampleTo::Scale(0.5));
        assert!(upsample_shape(&small, &Shape::from([2, 2, 1, 4])).is_err());
    }
}
