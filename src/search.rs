//! Searching for the largest micro-batch or context that fits a budget (`--max-batch`,
//! `--max-context`).

pub use crate::report::Dimension;
use crate::report::Report;
use crate::settings::Overrides;
use crate::spec::ModelSpec;

/// The largest value of `dim` whose estimate fits `budget` bytes, with that estimate, searching
/// up from 1, or from `start` (the size asked for) when 1 is not a valid size for the model.
/// `None` when neither fits. See [`largest_fitting`].
#[must_use]
pub fn max_fitting(
    spec: &ModelSpec,
    name: &str,
    overrides: &Overrides,
    budget: u64,
    dim: Dimension,
    start: u64,
) -> Option<(u64, Report)> {
    largest_fitting(
        |v| {
            let mut o = overrides.clone();
            match dim {
                Dimension::Batch => o.batch = Some(v),
                Dimension::Context => o.seq = Some(v),
            }
            crate::estimate_spec(spec, name, &o, Some(budget)).ok()
        },
        start,
    )
}

/// The largest `v ≥ 1` whose estimate fits its budget: doubling, then bisection (estimates grow
/// with batch and context), from 1 or, when 1 does not fit or is invalid, from `start`. Values
/// whose estimate fails (an invalid shape, a size overflow) count as not fitting; the search
/// stops doubling at 2^40.
pub fn largest_fitting(
    estimate_at: impl Fn(u64) -> Option<Report>,
    start: u64,
) -> Option<(u64, Report)> {
    let fits = |v: u64| estimate_at(v).filter(|r| r.budget.as_ref().is_some_and(|b| b.fits));
    let mut best = match fits(1) {
        Some(r) => (1, r),
        None => (start, fits(start)?),
    };
    let mut hi = best.0.saturating_mul(2);
    loop {
        match fits(hi) {
            Some(r) if hi < (1 << 40) => {
                best = (hi, r);
                hi *= 2;
            }
            Some(r) => return Some((hi, r)),
            None => break,
        }
    }
    let mut lo = best.0;
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        match fits(mid) {
            Some(r) => {
                best = (mid, r);
                lo = mid;
            }
            None => hi = mid,
        }
    }
    Some(best)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::Overrides;
    use crate::spec::Format;

    const MLP: &str =
        "[input]\nshape = [1000]\n[[layers]]\nkind = \"linear\"\nout_features = 1000\n";

    fn spec() -> ModelSpec {
        crate::spec::parse(MLP, Format::Toml).unwrap()
    }

    #[test]
    fn finds_the_boundary() {
        let o = Overrides::default();
        let at = |b: u64| {
            crate::estimate_spec(
                &spec(),
                "m",
                &Overrides {
                    batch: Some(b),
                    ..Overrides::default()
                },
                None,
            )
            .unwrap()
            .total_bytes
        };
        let budget = at(37) + (at(38) - at(37)) / 2; // between batch 37 and 38
        let (n, r) = max_fitting(&spec(), "m", &o, budget, Dimension::Batch, 1).unwrap();
        assert_eq!(n, 37);
        assert_eq!(r.settings.batch, 37);
        assert!(r.total_bytes <= budget);
    }

    #[test]
    fn nothing_fits() {
        assert!(
            max_fitting(
                &spec(),
                "m",
                &Overrides::default(),
                1000,
                Dimension::Batch,
                1
            )
            .is_none()
        );
    }
}
