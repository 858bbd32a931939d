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
    // `memest gpus`: the GPU catalog (likewise, a file named `gpus` is still read as a model).
    let result =
        if args.first().is_some_and(|a| a == "gpus") && !std::path::Path::new("gpus").exists() {
            gpus(cli::GpusCli::parse_from(std::env::args_os().skip(1)))
        } else {
            cli::Cli::parse().into_request().and_then(run)
        };
    match result {
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
