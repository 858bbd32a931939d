//! libFuzzer target: the input bytes are the decisions of the proptest driver's generator
//! (`tests/fuzz/generate.rs`), so libFuzzer explores model files and flag sets built from the
//! real layer kinds and keys; each case is checked by `tests/fuzz/case.rs`.
#![no_main]

#[path = "../../tests/fuzz/case.rs"]
#[allow(dead_code)]
mod case;
#[path = "../../tests/fuzz/generate.rs"]
mod generate;

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

fn seeds() -> &'static generate::Seeds {
    static SEEDS: OnceLock<generate::Seeds> = OnceLock::new();
    SEEDS.get_or_init(|| {
        generate::Seeds::load(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
    })
}

fuzz_target!(|bytes: &[u8]| {
    let case = generate::case(bytes, seeds());
    if let Err(e) = case::check(&case) {
        panic!("{e}\n--- case ---\n{case}");
    }
});
