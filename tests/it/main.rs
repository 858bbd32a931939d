//! Integration tests of the `memest` binary: one test binary (`cargo test --test it`).

mod common;

mod cli;
mod errors;
mod examples;
mod hf;
mod kinds;
mod llm;
mod optim;
mod properties;
mod reference;
mod schema;
mod snapshots;
