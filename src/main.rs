//! The `memest` command line: flags → [`cli::Request`] → [`memest::run`] → table or JSON.
//!
//! Exit status: 0 = estimate printed (and it fits the `--budget`), 1 = over the budget,
//! 2 = bad input or usage. A closed pipe on standard output counts as success.

use std::io::{self, Write};
use std::process::ExitCode;

use anyhow::Result;
use clap::Parser;

use memest::cli;

/// mimalloc as the process's allocator: an estimate makes many small, short-lived allocations
/// (one layer's spec, name and traced step at a time), where glibc's malloc spent a third of
/// the time of 100,000 flat layers (`malloc_consolidate`, `_int_malloc`, `unlink_chunk`).
/// Measured 2026-12-02 (release binary, `perf stat` task-clock, 7 runs, min/median, load ~1.5):
/// 100,000 unnamed relu layers 482/637 -> 376/405 ms, named 565/588 -> 289/321 ms, the
/// 100,000-copy CUDA repeat 179/225 -> 168/216 ms; max RSS 156 -> 212 MB and 16 -> 27 MB.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // `memest models`: the supported Hugging Face model types and layer kinds (a file named
    // `models` in the working directory is still read as a model).
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    if args.len() == 1 && args[0] == "models" && !std::path::Path::new("models").exists() {
        return match write!(io::stdout().lock(), "{}", memest::models_text()) {
            Err(e) if e.kind() != io::ErrorKind::BrokenPipe => {
                eprintln!("error: {e}");
                ExitCode::from(2)
            }
            _ => ExitCode::SUCCESS,
        };
    }
    // `memest gpus`: the GPU catalog (likewise, a file named `gpus` is still read as a model).
    let result =
        if args.first().is_some_and(|a| a == "gpus") && !std::path::Path::new("gpus").exists() {
            gpus(cli::GpusCli::parse_from(std::env::args_os().skip(1)))
        } else {
            cli::Cli::parse().into_request().and_then(|req| {
                let input = req.input.read()?;
                let mut err = io::stderr().lock();
                memest::command::execute(&req, &input, &mut io::stdout().lock(), &mut err)
                    .map(|done| done.code)
            })
        };
    result.unwrap_or_else(|e| memest::command::report_error(&e, &mut io::stderr().lock()))
}

/// `memest gpus`: the catalog as a table or JSON.
fn gpus(args: cli::GpusCli) -> Result<ExitCode> {
    let all = memest::gpu::catalog()?;
    let mut out = io::stdout().lock();
    match args.format {
        cli::GpusFormat::Table => {
            let units = if args.si {
                memest::units::UnitSystem::Si
            } else {
                memest::units::UnitSystem::Iec
            };
            write!(out, "{}", memest::render::gpus(all, units))?;
        }
        cli::GpusFormat::Json => writeln!(out, "{}", serde_json::to_string_pretty(all)?)?,
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}
