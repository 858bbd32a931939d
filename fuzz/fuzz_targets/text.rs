//! libFuzzer target: the input is a case as written in `tests/fuzz/corpus/` (an optional
//! `#!memest <flags>` line, then a TOML or JSON model), mutated byte by byte; each case is
//! checked by `tests/fuzz/case.rs`.
#![no_main]

#[path = "../../tests/fuzz/case.rs"]
#[allow(dead_code)]
mod case;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let Ok(text) = std::str::from_utf8(bytes) else {
        return;
    };
    if let Err(e) = case::check(text) {
        panic!("{e}\n--- case ---\n{text}");
    }
});
