//! Integration tests of the `memest` binary: one test binary (`cargo test --test it`).
//!
//! - `snapshots`: the binary's whole output (exit status, stdout, stderr) per case, pinned by
//!   insta under `tests/it/snapshots/`: every example's table and JSON, the README's flags,
//!   `--print-model`, `--help`, every error message, every fixture model. After an intended
//!   change: `INSTA_UPDATE=always cargo test --test it`, review `git diff tests/it/snapshots`,
//!   and say why in the commit message. Under `CI=true` insta never writes: a mismatch fails.
//! - `reference`: the measured cases of `tests/data/` (exact parameter, gradient and optimizer
//!   bytes; activations within 0.1 %; the peak within its allowance in
//!   `tests/data/peak-allowance.json`), and a snapshot of the whole comparison table.
//! - `kinds`, `llm`, `optim`, `hf`: exact figures derived by hand in comments, per layer kind,
//!   LLM feature (KV cache, LoRA, quantization), optimizer and recipe, and Hugging Face family.
//! - `gpu`: `memest gpus`, `--gpu`, `--budget-on`, `--cuda-context`, the verdict on a card, and
//!   the published V100 figure of transformers' model-memory-anatomy guide.
//! - `cli`, `errors`, `examples`: the command-line contract (flags over file defaults, exit
//!   statuses, units, stdin), the shape of every bad-input failure, every example running.
//! - `properties`: proptest invariants over the bundled examples (monotone in batch and
//!   sequence, sums, non-negative figures, size parsing, `--print-model` round trip).
//! - `allocator`: the CUDA caching allocator's figures (when they appear, bounds,
//!   `--expandable-segments`, an EMA copy).
//! - `pipeline`: pipeline stages against measured `torch.distributed.pipelining` runs, the
//!   schedules' micro-batches in flight, expert parallelism.
//! - `search`: `--max-batch`/`--max-context` through `memest::run` against the search one
//!   estimate at a time, and the micro-batch's derived tapes against fresh traces.
//! - `common`: running the binary (assert_cmd), temporary model files (tempfile), JSON helpers.

mod common;

mod allocator;
mod cli;
mod dist;
mod dist_config;
mod errors;
mod examples;
mod gpu;
mod hf;
mod kinds;
mod llm;
mod optim;
mod outputs;
mod pipeline;
mod properties;
mod recipes;
mod reference;
mod repeats;
mod schema;
mod search;
mod serve;
mod snapshots;
mod tp;
