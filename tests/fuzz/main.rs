//! The fuzz driver (`cargo test --test fuzz`): generated model files and flag sets run
//! in-process as the binary runs them (its clap definition, `memest::command::execute`), each
//! checked against the invariants of [`case::check`].
//!
//! - `generated_cases_hold_the_invariants`: proptest over decision bytes turned into cases by
//!   [`generate::case`] (seed models from `examples/`, `tests/fixtures/` and the corpus, mutated, or
//!   built from scratch out of every layer kind's keys; Hugging Face configs mutated; random
//!   flags). 64 cases by default; `MEMEST_FUZZ_CASES=<n>` runs more (`.ci/run` runs 1,000), and
//!   a failure is shrunk to a small case.
//! - `fuzz_loop` (ignored): a long run that keeps going after a finding and writes each
//!   failing case to `target/fuzz-findings/` (and each case slower than 5 s as `slow-…`): `MEMEST_FUZZ_CASES=1000000 cargo test --release
//!   --test fuzz fuzz_loop -- --ignored --nocapture` (`MEMEST_FUZZ_SEED=<n>` picks the stream).
//! - `corpus_holds_the_invariants`: every case in `tests/fuzz/corpus/` (a flags line
//!   `#!memest …`, then a model): minimized inputs kept from past runs. Files named `open_…`
//!   are findings not fixed yet; their (ignored) tests in `regressions` run them.
//! - `regressions`: each finding, as a test with the behaviour it should have.

mod case;
mod generate;
mod regressions;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use proptest::prelude::*;
use proptest::test_runner::RngSeed;

use case::Outcome;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn seeds() -> &'static generate::Seeds {
    static SEEDS: OnceLock<generate::Seeds> = OnceLock::new();
    SEEDS.get_or_init(|| generate::Seeds::load(root()))
}

/// Runs one case; a panic is a broken invariant too.
fn run(case: &str) -> Result<Outcome, String> {
    match catch_unwind(AssertUnwindSafe(|| case::check(case))) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_string()))
                .unwrap_or_default();
            Err(format!("panic: {msg}"))
        }
    }
}

fn cases() -> u32 {
    std::env::var("MEMEST_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

fn config() -> ProptestConfig {
    let mut c = ProptestConfig::with_cases(cases());
    if std::env::var_os("PROPTEST_RNG_SEED").is_none() {
        c.rng_seed = RngSeed::Fixed(20_261_201);
    }
    c.failure_persistence = None;
    c.max_shrink_iters = 4096;
    c
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn generated_cases_hold_the_invariants(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let case = generate::case(&bytes, seeds());
        if let Err(e) = run(&case) {
            return Err(TestCaseError::fail(format!("{e}\n--- case ---\n{case}")));
        }
    }
}

#[test]
fn corpus_holds_the_invariants() {
    // `MEMEST_FUZZ_CORPUS=target/fuzz-findings` replays a long run's findings.
    let dir = std::env::var_os("MEMEST_FUZZ_CORPUS")
        .map_or_else(|| root().join("tests/fuzz/corpus"), PathBuf::from);
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("tests/fuzz/corpus")
        .map(|e| e.expect("an entry").path())
        .filter(|p| p.extension().is_none_or(|e| e != "txt"))
        .filter(|p| !generate::is_open_finding(p))
        .collect();
    paths.sort();
    assert!(!paths.is_empty(), "the corpus is empty");
    let mut failures = Vec::new();
    for p in &paths {
        let text = std::fs::read_to_string(p).expect("a corpus case");
        if let Err(e) = run(&text) {
            failures.push(format!("{}: {e}", p.display()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// A case that takes longer than this in the long run is kept as `slow-s<seed>-<n>.case`.
const SLOW: std::time::Duration = std::time::Duration::from_secs(5);

/// A small deterministic generator (splitmix64) for the long run's decision bytes.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[test]
#[ignore = "a long run: MEMEST_FUZZ_CASES=<n> cargo test --release --test fuzz fuzz_loop -- --ignored --nocapture"]
fn fuzz_loop() {
    let total = u64::from(cases());
    let seed = std::env::var("MEMEST_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let findings = root().join("target/fuzz-findings");
    std::fs::create_dir_all(&findings).expect("target/fuzz-findings");
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if std::env::var_os("MEMEST_FUZZ_VERBOSE").is_some() {
            hook(info);
        }
    }));
    let mut state = seed;
    let mut counts = std::collections::BTreeMap::<String, u64>::new();
    let mut found = 0u64;
    let start = std::time::Instant::now();
    for i in 0..total {
        let len = usize::try_from(splitmix(&mut state) % 257).unwrap_or(0);
        let bytes: Vec<u8> = (0..len).map(|_| splitmix(&mut state) as u8).collect();
        let Ok(case) = catch_unwind(|| generate::case(&bytes, seeds())) else {
            eprintln!("the generator panicked at case {i} (a bug in tests/fuzz/generate.rs)");
            *counts.entry("GeneratorPanic".into()).or_default() += 1;
            continue;
        };
        let began = std::time::Instant::now();
        let outcome = run(&case);
        let took = began.elapsed();
        if took > SLOW {
            // Not a broken invariant, but worth a look (issue 12: "never slow").
            *counts.entry("Slow".into()).or_default() += 1;
            eprintln!("slow case {i}: {took:.1?}");
            let _ = std::fs::write(findings.join(format!("slow-s{seed}-{i}.case")), &case);
        }
        // Findings count by their broken invariant (the first line without its numbers), so
        // that one bug met many times reads as one.
        let key = match &outcome {
            Ok(o) => format!("{o:?}"),
            Err(e) => {
                let first = e.lines().next().unwrap_or("");
                let kind: String = first
                    .chars()
                    .filter(|c| !c.is_ascii_digit())
                    .take(60)
                    .collect();
                format!("Finding: {kind}")
            }
        };
        *counts.entry(key).or_default() += 1;
        if let Err(e) = outcome {
            found += 1;
            let first = e.lines().next().unwrap_or("").to_string();
            eprintln!("finding #{found} at case {i}: {first}");
            let _ = std::fs::write(findings.join(format!("s{seed}-{i}.case")), &case);
            let _ = std::fs::write(findings.join(format!("s{seed}-{i}.txt")), &e);
        }
        if (i + 1) % 10_000 == 0 {
            eprintln!("{} cases in {:.0?}: {counts:?}", i + 1, start.elapsed());
        }
    }
    eprintln!("done: {total} cases in {:.0?}: {counts:?}", start.elapsed());
}
