//! The `memest` command line: flags → [`cli::Request`] → [`memest::run`] → table or JSON.
//!
//! Exit status: 0 = estimate printed (and it fits the `--budget`), 1 = over the budget,
//! 2 = bad input or usage. A closed pipe on standard output counts as success.

mod cli;
mod output;

use std::io::{self, Write};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;

use cli::Request;
use output::shown;

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
    match cli::Cli::parse().into_request().and_then(run) {
        Ok(code) => code,
        Err(err) => {
            let broken_pipe = err.chain().any(|c| {
                c.downcast_ref::<io::Error>()
                    .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe)
            });
            if broken_pipe {
                return ExitCode::SUCCESS;
            }
            eprintln!("error: {}", shown(&format!("{err:#}")));
            ExitCode::from(2)
        }
    }
}

fn run(req: Request) -> Result<ExitCode> {
    let input = req.input.read()?;
    let origin = input.origin.as_str();
    let located = |e| memest::locate(e, origin, &input.src, input.format);
    let mut spec = memest::load_spec(&input.src, input.format, req.head).map_err(located)?;
    let mut out = io::stdout().lock();
    if req.print_model {
        spec.name.get_or_insert(input.name);
        let text = memest::print_model::to_toml(&spec).map_err(|e| e.at(origin))?;
        write!(out, "{text}")?;
        out.flush()?;
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(sweep) = &req.sweep {
        let swept = memest::run_sweep(&spec, &input.name, &req.query, sweep).map_err(located)?;
        return output::print_sweep(&mut out, &swept, sweep, origin, &req.output);
    }
    let report = memest::run(&spec, &input.name, &req.query).map_err(located)?;
    for w in &report.warnings {
        eprintln!("warning: {}", shown(&w.message(origin)));
    }
    let units = req.output.units;
    if let Some(path) = &req.output.timeline
        && let Some(svg) = memest::render::svg::timeline(&report, units)
    {
        std::fs::write(path, svg)
            .with_context(|| format!("failed to write the timeline to {}", path.display()))?;
    }
    output::print_report(&mut out, &report, &req.output)
}
