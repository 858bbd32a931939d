//! Shape operations: `flatten`, `reshape`, `transpose`, `permute`, `narrow`, `select`.

use super::keys::{KeyReader, key};

/// `torch.flatten(start_dim, end_dim)`: a view when the input is contiguous.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlattenCfg {
    /// First dimension to merge (`start_dim`, default 1).
    pub start: i64,
    /// Last dimension to merge (`end_dim`, default -1).
    pub end: i64,
}

impl FlattenCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = FlattenCfg {
            start: r.or(key!(s.start_dim), 1),
            end: r.or(key!(s.end_dim), -1),
        };
        r.finish()?;
        Ok(cfg)
    }
}

/// `reshape` to the given per-sample shape (batch kept; one `-1` allowed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReshapeCfg {
    /// Dimensions after the batch.
    pub shape: Vec<i64>,
}

impl ReshapeCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let shape = r.req(
            key!(s.shape),
            " (dimensions after the batch; one may be -1)",
        );
        r.finish()?;
        if shape.iter().any(|&d| d == 0 || d < -1) || shape.iter().filter(|&&d| d == -1).count() > 1
        {
            return Err(format!(
                "invalid `shape` {shape:?}: dimensions must be positive, with at most one -1"
            ));
        }
        Ok(ReshapeCfg { shape })
    }
}

/// `transpose(a, b)` (key `dims = [a, b]`): a view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransposeCfg {
    /// First dimension.
    pub a: i64,
    /// Second dimension.
    pub b: i64,
}

impl TransposeCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let dims = r.opt(key!(s.dims));
        r.finish()?;
        match dims.as_deref() {
            Some(&[a, b]) => Ok(TransposeCfg { a, b }),
            _ => Err("`dims` must name two dimensions, e.g. dims = [1, 2]".into()),
        }
    }
}

/// `permute(dims)` (the batch stays first): a view.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PermuteCfg {
    /// The new order of the dimensions, `dims[0] = 0`.
    pub dims: Vec<usize>,
}

impl PermuteCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let dims = r.req(
            key!(s.dims),
            " (the new order of all dimensions, batch first, e.g. [0, 2, 3, 1])",
        );
        r.finish()?;
        let n = dims.len();
        let mut order = Vec::with_capacity(n);
        for &d in &dims {
            match usize::try_from(d) {
                Ok(d) if d < n && !order.contains(&d) => order.push(d),
                _ => return Err(format!("`dims` {dims:?} is not a permutation of 0..{n}")),
            }
        }
        if order.first() != Some(&0) {
            return Err("`dims` must keep the batch dimension first (dims[0] = 0)".into());
        }
        Ok(PermuteCfg { dims: order })
    }
}

/// `x.narrow(dim, start, length)` (a slice, e.g. one half of `chunk(2, dim)`): a view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NarrowCfg {
    /// Dimension (default 1).
    pub dim: i64,
    /// First index (default 0); negative counts from the end (`x[:, -n:]`).
    pub start: i64,
    /// Length; `None`: up to `end`, or to the end of the dimension (`x[:, start:]`).
    pub length: Option<u64>,
    /// The exclusive end instead of `length`; negative counts from the end (`x[:, :-n]`).
    pub end: Option<i64>,
}

impl NarrowCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = NarrowCfg {
            dim: r.or(key!(s.dim), 1),
            start: r.or(key!(s.start), 0),
            length: r.opt(key!(s.length)),
            end: r.opt(key!(s.end)),
        };
        r.finish()?;
        if cfg.length.is_some() && cfg.end.is_some() {
            return Err("give `length` or `end`, not both".into());
        }
        if cfg.length == Some(0) {
            return Err("`length` must be positive, got 0".into());
        }
        Ok(cfg)
    }
}

/// `x.select(dim, index)` (e.g. `x[:, 0]`): a view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SelectCfg {
    /// Dimension (default 1).
    pub dim: i64,
    /// Index (negative counts from the end; default 0).
    pub index: i64,
}

impl SelectCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = SelectCfg {
            dim: r.or(key!(s.dim), 1),
            index: r.or(key!(s.index), 0),
        };
        r.finish()?;
        Ok(cfg)
    }
}
