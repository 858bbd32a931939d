//! Tensor shapes with checked element counts.

use std::fmt;

/// A tensor shape, outermost dimension first (e.g. `[batch, channels, height, width]`).
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(Vec<u64>);

impl Shape {
    /// A shape from its dimensions.
    #[must_use]
    pub fn new(dims: Vec<u64>) -> Self {
        Shape(dims)
    }

    /// The dimensions.
    #[must_use]
    pub fn dims(&self) -> &[u64] {
        &self.0
    }

    /// Number of dimensions.
    #[must_use]
    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// Product of the dimensions (1 for a scalar); `None` on overflow.
    #[must_use]
    pub fn numel(&self) -> Option<u64> {
        self.0.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))
    }

    /// The last dimension, if any.
    #[must_use]
    pub fn last(&self) -> Option<u64> {
        self.0.last().copied()
    }

    /// A copy with the last dimension replaced.
    #[must_use]
    pub fn with_last(&self, last: u64) -> Shape {
        let mut dims = self.0.clone();
        if let Some(d) = dims.last_mut() {
            *d = last;
        }
        Shape(dims)
    }
}

impl From<Vec<u64>> for Shape {
    fn from(dims: Vec<u64>) -> Self {
        Shape(dims)
    }
}

impl<const N: usize> From<[u64; N]> for Shape {
    fn from(dims: [u64; N]) -> Self {
        Shape(dims.to_vec())
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.0.iter().map(u64::to_string).collect();
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
        self.0.serialize(s)
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
}
