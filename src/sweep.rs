//! `--sweep`: one estimate per value of the micro-batch or the sequence length.
//!
//! Syntax: `DIM=LIST`, where `DIM` is `batch` or `seq` (`context` is an alias of `seq`) and
//! `LIST` is comma-separated items, each a value `N`, a doubling range `A..B` (A, 2A, 4A, … below
//! B, then B) or a stepping range `A..B:S` (A, A+S, A+2S, … up to B). Values are positive; the list
//! is sorted and duplicates dropped; at most [`MAX_POINTS`] values.

use std::fmt;
use std::str::FromStr;

use crate::report::Dimension;

/// The most values one sweep may have.
pub const MAX_POINTS: usize = 64;

/// A parsed `--sweep`: what varies and its values (ascending, distinct).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sweep {
    /// The micro-batch or the sequence length.
    pub dimension: Dimension,
    /// The values, ascending and distinct, at most [`MAX_POINTS`].
    pub values: Vec<u64>,
}

impl Sweep {
    /// `batch` or `seq`, as the output names the swept column.
    #[must_use]
    pub const fn name(&self) -> &'static str {
        match self.dimension {
            Dimension::Batch => "batch",
            Dimension::Context => "seq",
        }
    }
}

/// Why a `--sweep` value was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SweepError(String);

impl fmt::Display for SweepError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (expected e.g. batch=1,2,4,8, batch=1..64 (doubling) or seq=128..1024:128 (stepping))",
            self.0
        )
    }
}

impl std::error::Error for SweepError {}

fn err(msg: impl Into<String>) -> SweepError {
    SweepError(msg.into())
}

fn number(s: &str) -> Result<u64, SweepError> {
    let s = s.trim();
    match s.parse::<u64>() {
        Ok(0) => Err(err("sweep values start at 1, not 0")),
        Ok(n) => Ok(n),
        Err(_) => Err(err(format!("`{s}` is not a positive whole number"))),
    }
}

/// The values of one item (`N`, `A..B`, `A..B:S`) appended to `out`; refuses more than
/// [`MAX_POINTS`] before generating them.
fn item(s: &str, out: &mut Vec<u64>) -> Result<(), SweepError> {
    let too_many = || err(format!("a sweep has at most {MAX_POINTS} values"));
    let Some((a, rest)) = s.split_once("..") else {
        out.push(number(s)?);
        return Ok(());
    };
    let (b, step) = match rest.split_once(':') {
        Some((b, step)) => (b, Some(number(step)?)),
        None => (rest, None),
    };
    let (a, b) = (number(a)?, number(b)?);
    if a > b {
        return Err(err(format!(
            "the range {a}..{b} is empty: its start is past its end"
        )));
    }
    match step {
        Some(step) => {
            let count = (b - a) / step + 1;
            if usize::try_from(count).map_or(true, |c| out.len() + c > MAX_POINTS) {
                return Err(too_many());
            }
            let mut v = a;
            while v <= b {
                out.push(v);
                let Some(next) = v.checked_add(step) else {
                    break;
                };
                v = next;
            }
        }
        None => {
            let mut v = a;
            while v <= b {
                if out.len() >= MAX_POINTS {
                    return Err(too_many());
                }
                out.push(v);
                let Some(next) = v.checked_mul(2) else { break };
                v = next;
            }
            // The end is a value too when doubling steps over it (3..20: 3, 6, 12, 20).
            if out.last() != Some(&b) {
                if out.len() >= MAX_POINTS {
                    return Err(too_many());
                }
                out.push(b);
            }
        }
    }
    Ok(())
}

impl FromStr for Sweep {
    type Err = SweepError;

    fn from_str(s: &str) -> Result<Sweep, SweepError> {
        let (dim, list) = s
            .split_once('=')
            .ok_or_else(|| err(format!("`{s}` has no `=`")))?;
        let dimension = match dim.trim().to_ascii_lowercase().as_str() {
            "batch" => Dimension::Batch,
            "seq" | "context" => Dimension::Context,
            other => {
                return Err(err(format!("`{other}` cannot be swept: batch or seq can")));
            }
        };
        let mut values = Vec::new();
        for part in list.split(',') {
            if part.trim().is_empty() {
                return Err(err("an empty value in the list"));
            }
            item(part.trim(), &mut values)?;
            if values.len() > MAX_POINTS {
                return Err(err(format!("a sweep has at most {MAX_POINTS} values")));
            }
        }
        values.sort_unstable();
        values.dedup();
        Ok(Sweep { dimension, values })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(s: &str) -> Vec<u64> {
        s.parse::<Sweep>().unwrap().values
    }

    #[test]
    fn lists_and_ranges() {
        assert_eq!(values("batch=1,2,4,8"), [1, 2, 4, 8]);
        assert_eq!(values("batch=1..8"), [1, 2, 4, 8]);
        assert_eq!(values("batch=3..20"), [3, 6, 12, 20]);
        assert_eq!(values("batch=1..8:1"), [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(values("seq=128..512:128"), [128, 256, 384, 512]);
        assert_eq!(values("batch=8, 1,2..4 ,8"), [1, 2, 4, 8]);
        assert_eq!(values("batch=5..5"), [5]);
        let s: Sweep = "context=16".parse().unwrap();
        assert_eq!(s.dimension, Dimension::Context);
        assert_eq!(
            "SEQ=1".parse::<Sweep>().unwrap().dimension,
            Dimension::Context
        );
        assert_eq!(values(&format!("batch=1..{}", 1u64 << 63)).len(), 64);
        // 1, 2, …, 2^63 and then the end: 65 values, one too many.
        assert!(format!("batch=1..{}", u64::MAX).parse::<Sweep>().is_err());
    }

    #[test]
    fn bad_sweeps_are_refused() {
        for bad in [
            "batch",
            "lr=1,2",
            "batch=",
            "batch=1,,2",
            "batch=0",
            "batch=x",
            "batch=-1",
            "batch=8..1",
            "batch=1..8:0",
            "batch=1..65:1",
            "batch=1..1000000000000:1",
            "batch=1.5",
        ] {
            assert!(bad.parse::<Sweep>().is_err(), "{bad}");
        }
        let e = "batch=1..100:1".parse::<Sweep>().unwrap_err().to_string();
        assert!(e.starts_with("a sweep has at most 64 values"), "{e}");
        assert_eq!(values("batch=1..64:1").len(), 64);
    }
}
