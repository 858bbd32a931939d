//! Shape operations: `flatten`, `reshape`, `permute`, `narrow`, `transpose`, `select`.

#[allow(clippy::wildcard_imports)]
use super::*;
use crate::graph::{FlattenCfg, NarrowCfg, PermuteCfg, ReshapeCfg, SelectCfg, TransposeCfg};

/// `flatten(start_dim, end_dim)`: the dimensions `start..=end` merged into one.
pub(super) fn flatten_shape(c: &FlattenCfg, x: &Shape) -> Result<Shape, ShapeError> {
    let rank = x.rank();
    let (a, b) = (
        batch_kept(axis(c.start, rank)?, "flatten")?,
        axis(c.end, rank)?,
    );
    if a > b {
        return invalid(format!(
            "start_dim {} comes after end_dim {} for input {x}",
            c.start, c.end
        ));
    }
    let d = x.dims();
    let mut dims = d[..a].to_vec();
    dims.push(sized(
        d[a..=b].iter().try_fold(1u64, |acc, &v| acc.checked_mul(v)),
        "a flattened dimension",
    )?);
    dims.extend_from_slice(&d[b + 1..]);
    Ok(Shape::new(dims))
}

/// `reshape` to `[B, shape..]`, resolving one `-1`.
pub(super) fn reshape_shape(c: &ReshapeCfg, x: &Shape) -> Result<Shape, ShapeError> {
    let shape = &c.shape;
    let numel = sized(x.numel(), "an element count")?;
    let batch = x.dims()[0];
    let per = numel / batch;
    let known = shape
        .iter()
        .filter(|&&d| d > 0)
        .try_fold(1u64, |acc, &d| acc.checked_mul(d.unsigned_abs()));
    let known = sized(known, "a reshape size")?;
    let mut dims = vec![batch];
    for &d in shape {
        dims.push(if d == -1 {
            if known == 0 || !per.is_multiple_of(known) {
                return invalid(format!("cannot reshape {x} to [batch, {shape:?}]: {per} elements per sample do not divide by {known}"));
            }
            per / known
        } else {
            d.unsigned_abs()
        });
    }
    let target = Shape::new(dims);
    if target.numel() != Some(numel) {
        return invalid(format!("cannot reshape {x} ({numel} elements) to {target}"));
    }
    Ok(target)
}

/// `permute(dims)`.
pub(super) fn permute_shape(c: &PermuteCfg, x: &Shape) -> Result<Shape, ShapeError> {
    let rank = x.rank();
    if c.dims.len() != rank {
        return invalid(format!(
            "`dims` has {} entries for a rank-{rank} input {x}",
            c.dims.len()
        ));
    }
    let d = x.dims();
    Ok(Shape::new(c.dims.iter().map(|&i| d[i]).collect()))
}

/// `narrow(dim, start, length)`: the axis and the output shape.
pub(super) fn narrow_shape(c: &NarrowCfg, x: &Shape) -> Result<(usize, Shape), ShapeError> {
    let a = batch_kept(axis(c.dim, x.rank())?, "narrow")?;
    let size = x.dims()[a];
    let start = if c.start >= 0 {
        Some(c.start.unsigned_abs())
    } else {
        size.checked_sub(c.start.unsigned_abs())
    };
    let Some(start) = start else {
        return invalid(format!(
            "narrow from {} is out of range for dimension {} of size {size} (input {x})",
            c.start, c.dim
        ));
    };
    let end = match c.end {
        None => Some(size),
        Some(e) if e >= 0 => Some(e.unsigned_abs()),
        Some(e) => size.checked_sub(e.unsigned_abs()),
    };
    let rest = end.and_then(|e| e.checked_sub(start)).filter(|&l| l > 0);
    let Some(length) = c.length.or(rest) else {
        return invalid(format!(
            "narrow from {start} leaves nothing of dimension {} of size {size} (input {x})",
            c.dim
        ));
    };
    if start.checked_add(length).is_none_or(|end| end > size) {
        return invalid(format!(
            "narrow {start}..{start}+{length} is out of range for dimension {} of size {size} (input {x})",
            c.dim
        ));
    }
    let mut dims = x.dims().to_vec();
    dims[a] = length;
    Ok((a, Shape::new(dims)))
}

/// `transpose(a, b)`: the two axes and the output shape.
pub(super) fn transpose_shape(
    c: &TransposeCfg,
    x: &Shape,
) -> Result<(usize, usize, Shape), ShapeError> {
    let rank = x.rank();
    let (a, b) = (axis(c.a, rank)?, axis(c.b, rank)?);
    if a == 0 || b == 0 {
        return invalid("transpose cannot move the batch dimension (dimension 0)".into());
    }
    let mut dims = x.dims().to_vec();
    dims.swap(a, b);
    Ok((a, b, Shape::new(dims)))
}

/// `select(dim, index)`: the axis and the output shape.
pub(super) fn select_shape(c: &SelectCfg, x: &Shape) -> Result<(usize, Shape), ShapeError> {
    let a = axis(c.dim, x.rank())?;
    if a == 0 {
        return invalid("select on the batch dimension is not supported".into());
    }
    let size = x.dims()[a];
    let index = c.index;
    let ok = if index >= 0 {
        index.unsigned_abs() < size
    } else {
        index.unsigned_abs() <= size
    };
    if !ok {
        return invalid(format!(
            "index {index} is out of range for dimension {} of size {size} (input {x})",
            c.dim
        ));
    }
    let mut dims = x.dims().to_vec();
    dims.remove(a);
    Ok((a, Shape::new(dims)))
}

impl Tracer<'_> {
    /// `torch.flatten`: a view when the input is contiguous, else a copy.
    pub(super) fn flatten(&mut self, c: &FlattenCfg, x: ValueId) -> Result<ValueId, Error> {
        let shape = self.shaped(flatten_shape(c, &self.val(x).shape))?;
        self.reshape(x, shape)
    }

    /// `reshape`: a view when the input is contiguous, else a copy.
    pub(super) fn reshape_layer(&mut self, c: &ReshapeCfg, x: ValueId) -> Result<ValueId, Error> {
        let shape = self.shaped(reshape_shape(c, &self.val(x).shape))?;
        self.reshape(x, shape)
    }

    /// `permute`: a view.
    pub(super) fn permute(&mut self, c: &PermuteCfg, x: ValueId) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let shape = self.shaped(permute_shape(c, &xv.shape))?;
        let identity = c.dims.iter().enumerate().all(|(i, &j)| i == j);
        // `[B, H, W, C]` contiguous, permuted to `[B, C, H, W]`, is channels-last, and
        // permuted back it is contiguous again (ConvNeXt's `Permute` around its LayerNorm).
        let layout = match (xv.layout, c.dims.as_slice()) {
            _ if identity => xv.layout,
            (Layout::Contiguous, [0, 3, 1, 2]) => Layout::ChannelsLast,
            (Layout::ChannelsLast, [0, 2, 3, 1]) => Layout::Contiguous,
            _ => Layout::Strided,
        };
        Ok(self.view_op(x, shape, layout, AtenOp::Permute, true))
    }

    /// `narrow`: a view.
    pub(super) fn narrow(&mut self, c: &NarrowCfg, x: ValueId) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let (a, shape) = self.shaped(narrow_shape(c, &xv.shape))?;
        let layout = if shape.dims()[a] == xv.shape.dims()[a] {
            xv.layout
        } else {
            Layout::Strided
        };
        Ok(self.view_op(x, shape, layout, AtenOp::Narrow, false))
    }

    /// `transpose`: a view; swapping the last two dimensions of a contiguous tensor is a layout
    /// `matmul` reads without a copy.
    pub(super) fn transpose(&mut self, c: &TransposeCfg, x: ValueId) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let (a, b, shape) = self.shaped(transpose_shape(c, &xv.shape))?;
        let rank = xv.shape.rank();
        let last_two = a.min(b) + 2 == rank && a.max(b) + 1 == rank;
        let layout = if a == b {
            xv.layout
        } else if xv.layout == Layout::Contiguous && last_two {
            Layout::LastTwoSwapped
        } else if xv.layout == Layout::LastTwoSwapped && last_two {
            Layout::Contiguous
        } else {
            Layout::Strided
        };
        Ok(self.view_op(x, shape, layout, AtenOp::Transpose, true))
    }

    /// `select`: a view.
    pub(super) fn select(&mut self, c: &SelectCfg, x: ValueId) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let (a, shape) = self.shaped(select_shape(c, &xv.shape))?;
        let layout = if a == 1 && xv.shape.rank() == 2 {
            Layout::Contiguous
        } else {
            Layout::Strided
        };
        Ok(self.view_op(x, shape, layout, AtenOp::Select, false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flatten_and_reshape() {
        let x = Shape::from([2, 3, 4, 5]);
        let f = FlattenCfg { start: 1, end: -1 };
        assert_eq!(flatten_shape(&f, &x), Ok(Shape::from([2, 60])));
        let f = FlattenCfg { start: 0, end: 1 };
        assert!(flatten_shape(&f, &x).is_err());
        let r = ReshapeCfg {
            shape: vec![-1, 10],
        };
        assert_eq!(reshape_shape(&r, &x), Ok(Shape::from([2, 6, 10])));
        let r = ReshapeCfg { shape: vec![-1, 7] };
        assert!(reshape_shape(&r, &x).is_err());
    }

    #[test]
    fn views() {
        let x = Shape::from([2, 3, 4]);
        let p = PermuteCfg {
            dims: vec![0, 2, 1],
        };
        assert_eq!(permute_shape(&p, &x), Ok(Shape::from([2, 4, 3])));
        let n = NarrowCfg {
            dim: -1,
            start: 1,
            length: Some(2),
            end: None,
        };
        assert_eq!(narrow_shape(&n, &x), Ok((2, Shape::from([2, 3, 2]))));
        let t = TransposeCfg { a: 1, b: 2 };
        assert_eq!(transpose_shape(&t, &x), Ok((1, 2, Shape::from([2, 4, 3]))));
        let s = SelectCfg { dim: 1, index: -3 };
        assert_eq!(select_shape(&s, &x), Ok((1, Shape::from([2, 4]))));
        let s = SelectCfg { dim: 1, index: 3 };
        assert!(select_shape(&s, &x).is_err());
    }
}
