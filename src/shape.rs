//! Tensor shapes with checked element counts.

use std::fmt;

/// A tensor shape, outermost dimension first (e.g. `[batch, channels, height, width]`).
///
/// Up to [`INLINE_RANK`] dimensions are stored in place, with no allocation: the tracer makes
/// and copies several shapes per operator (each storage's, each value's, each layer's output),
/// so a 100,000-layer model of `[batch, features]` tensors would otherwise allocate them by the
/// hundred thousand.
#[derive(Clone)]
pub struct Shape(Dims);

/// The dimensions of a [`Shape`]: in place up to [`INLINE_RANK`] (the unused slots zero), on the
/// heap beyond (never for a rank that fits in place, so each shape has one representation).
#[derive(Clone)]
enum Dims {
    Inline { len: u8, dims: [u64; INLINE_RANK] },
    Heap(Box<[u64]>),
}

/// The largest rank a [`Shape`] stores without allocating. Two keeps a shape as small as the
/// `Vec` it replaced (24 bytes), so errors that carry shapes ([`crate::error::LayerErrorKind`])
/// do not grow; a model of `[batch, features]` layers allocates no shape.
pub const INLINE_RANK: usize = 2;

impl Default for Shape {
    fn default() -> Self {
        Shape(Dims::Inline {
            len: 0,
            dims: [0; INLINE_RANK],
        })
    }
}

impl PartialEq for Shape {
    fn eq(&self, other: &Self) -> bool {
        self.dims() == other.dims()
    }
}

impl Eq for Shape {}

impl std::hash::Hash for Shape {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.dims().hash(state);
    }
}

impl Shape {
    /// A shape from its dimensions.
    #[must_use]
    pub fn new(dims: Vec<u64>) -> Self {
        Shape::from_slice(&dims)
    }

    /// A shape from its dimensions, copied.
    #[must_use]
    pub fn from_slice(dims: &[u64]) -> Self {
        match u8::try_from(dims.len()) {
            Ok(len) if dims.len() <= INLINE_RANK => {
                let mut inline = [0; INLINE_RANK];
                inline[..dims.len()].copy_from_slice(dims);
                Shape(Dims::Inline { len, dims: inline })
            }
            _ => Shape(Dims::Heap(dims.into())),
        }
    }

    /// The dimensions.
    #[must_use]
    pub fn dims(&self) -> &[u64] {
        match &self.0 {
            Dims::Inline { len, dims } => &dims[..usize::from(*len)],
            Dims::Heap(dims) => dims,
        }
    }

    /// Number of dimensions.
    #[must_use]
    pub fn rank(&self) -> usize {
        self.dims().len()
    }

    /// Product of the dimensions (1 for a scalar); `None` on overflow.
    #[must_use]
    pub fn numel(&self) -> Option<u64> {
        self.dims()
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
    }

    /// The last dimension, if any.
    #[must_use]
    pub fn last(&self) -> Option<u64> {
        self.dims().last().copied()
    }

    /// A copy with the last dimension replaced.
    #[must_use]
    pub fn with_last(&self, last: u64) -> Shape {
        let mut shape = self.clone();
        let dims = match &mut shape.0 {
            Dims::Inline { len, dims } => &mut dims[..usize::from(*len)],
            Dims::Heap(dims) => &mut dims[..],
        };
        if let Some(d) = dims.last_mut() {
            *d = last;
        }
        shape
    }
}

impl From<Vec<u64>> for Shape {
    fn from(dims: Vec<u64>) -> Self {
        Shape::from_slice(&dims)
    }
}

impl<const N: usize> From<[u64; N]> for Shape {
    fn from(dims: [u64; N]) -> Self {
        Shape::from_slice(&dims)
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.dims().iter().map(u64::to_string).collect();
        f.pad(&format!("[{}]", parts.join(", ")))
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl serde::Serialize for Shape {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.dims().serialize(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numel_and_display() {
        let s = Shape::from([8, 3, 224, 224]);
        assert_eq!(s.numel(), Some(1_204_224));
        assert_eq!(s.to_string(), "[8, 3, 224, 224]");
        assert_eq!(Shape::default().numel(), Some(1));
        assert_eq!(Shape::from([u64::MAX, 2]).numel(), None);
    }

    #[test]
    fn inline_and_heap_shapes_compare_by_their_dimensions() {
        let long = Shape::from([1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(long.dims(), [1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(long.with_last(9).dims(), [1, 2, 3, 4, 5, 6, 9]);
        assert_eq!(long, Shape::new(vec![1, 2, 3, 4, 5, 6, 7]));
        let two = Shape::from([1, 2]);
        assert_eq!(two.with_last(0).dims(), [1, 0]);
        assert_eq!(Shape::from([5]).dims(), [5]);
        assert_eq!(std::mem::size_of::<Shape>(), 24);
        assert_ne!(Shape::from([2, 0]), Shape::from([2]));
        assert_eq!(Shape::default().dims(), [] as [u64; 0]);
        assert_eq!(format!("{long}"), "[1, 2, 3, 4, 5, 6, 7]");
    }
}
