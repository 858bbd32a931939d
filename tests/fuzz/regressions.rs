//! Each finding of the fuzzer, as a test of the behaviour it should have.

use crate::case::{Outcome, check};
use crate::root;

fn corpus(name: &str) -> String {
    std::fs::read_to_string(root().join("tests/fuzz/corpus").join(name)).expect("a corpus case")
}

/// With the flags line replaced by `flags`.
fn with_flags(case: &str, flags: &str) -> String {
    let (_, model) = crate::case::split(case);
    format!("{}{flags}\n{model}", crate::case::FLAGS_PREFIX)
}

/// Finding (seed 7, cases 195,113 and 376,320: a ViT and a ResNet whose residual `add` lost a
/// dimension): a tensor that broadcasts against the batch dimension makes the model valid at
/// some batch sizes only, as in PyTorch. memest is right to estimate batch 1 and refuse batch
/// 2; the fuzzer's monotonicity check accepts that refusal.
#[test]
fn broadcasting_against_the_batch_runs_at_some_batch_sizes_only() {
    let case = corpus("broadcast_against_batch.toml");
    assert_eq!(check(&with_flags(&case, " --batch 1")), Ok(Outcome::Fits));
    assert_eq!(check(&with_flags(&case, " --batch 3")), Ok(Outcome::Fits));
    assert_eq!(
        check(&with_flags(&case, " --batch 2")),
        Ok(Outcome::Refused)
    );
    let (_, model) = crate::case::split(&case);
    let o = memest::settings::Overrides {
        batch: Some(2),
        ..Default::default()
    };
    let err = memest::estimate(model, memest::spec::Format::Toml, "m", &o, None).unwrap_err();
    assert!(
        err.to_string()
            .contains("cannot add [2, 3, 4] and [2, 4]: shapes do not broadcast"),
        "{err}"
    );
}
