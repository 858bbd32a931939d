//! The `memest` command line: flags → [`cli::Request`] → [`memest::run`] → table or JSON.
//!
//! Exit status: 0 = estimate printed (and it fits the `--budget`), 1 = over the budget,
//! 2 = bad input or usage. A closed pipe on standard output counts as success.

mod cli;

use std::io::{self, Write};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;

use cli::{OutputFormat, Request};
use memest::units::format_bytes;

fn main() -> ExitCode {
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
        return print_sweep(&mut out, &swept, sweep, origin, &req.output);
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
    match req.output.format {
        OutputFormat::Json => {
            let text = report.to_json().context("failed to serialize the report")?;
            writeln!(out, "{text}")?;
        }
        OutputFormat::Markdown => {
            write!(
                out,
                "{}",
                shown(&memest::render::markdown::summary(&report, units))
            )?;
        }
        OutputFormat::Csv => {
            write!(
                out,
                "{}",
                shown(&memest::render::csv::rows(std::slice::from_ref(&report)))
            )?;
        }
        OutputFormat::Table => {
            write!(out, "{}", shown(&memest::render::summary(&report, units)))?;
            if req.output.per_layer {
                write!(out, "{}", shown(&memest::render::per_layer(&report, units)))?;
            }
            if req.output.explain {
                write!(out, "{}", shown(&memest::render::explain(&report, units)))?;
            }
        }
    }
    out.flush()?;
    if let Some(b) = report.budget.as_ref().filter(|b| !b.fits) {
        eprintln!(
            "memest: over budget: total {} > budget {} (over by {})",
            format_bytes(report.total_bytes, units),
            format_bytes(b.budget_bytes, units),
            format_bytes(b.overshoot_bytes, units)
        );
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

/// Text for the terminal: names come from files, so control characters in them (an ANSI escape
/// `\x1b[31m`, a carriage return) are shown escaped (`\u{1b}[31m`) rather than acted on; line
/// breaks and tabs stay.
fn shown(text: &str) -> std::borrow::Cow<'_, str> {
    if !text
        .chars()
        .any(|c| c.is_control() && c != '\n' && c != '\t')
    {
        return text.into();
    }
    text.chars()
        .map(|c| {
            if c.is_control() && c != '\n' && c != '\t' {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect::<String>()
        .into()
}

/// Prints a sweep in the chosen format; exit 1 when some value is over the budget (one line on
/// stderr naming them).
fn print_sweep(
    out: &mut impl Write,
    swept: &memest::report::SweepReport,
    sweep: &memest::sweep::Sweep,
    origin: &str,
    opts: &cli::OutputOpts,
) -> Result<ExitCode> {
    let mut warned = Vec::new();
    for w in swept.sweep.iter().flat_map(|r| &r.warnings) {
        if !warned.contains(w) {
            warned.push(*w);
            eprintln!("warning: {}", shown(&w.message(origin)));
        }
    }
    let reports = &swept.sweep;
    let units = opts.units;
    match opts.format {
        OutputFormat::Json => {
            let text = swept.to_json().context("failed to serialize the sweep")?;
            writeln!(out, "{text}")?;
        }
        OutputFormat::Markdown => {
            write!(
                out,
                "{}",
                shown(&memest::render::markdown::sweep(reports, sweep, units))
            )?;
        }
        OutputFormat::Csv => write!(out, "{}", shown(&memest::render::csv::rows(reports)))?,
        OutputFormat::Table => write!(
            out,
            "{}",
            shown(&memest::render::sweep(reports, sweep, units))
        )?,
    }
    out.flush()?;
    let over: Vec<String> = reports
        .iter()
        .zip(&sweep.values)
        .filter(|(r, _)| r.budget.as_ref().is_some_and(|b| !b.fits))
        .map(|(_, v)| v.to_string())
        .collect();
    if let (false, Some(b)) = (
        over.is_empty(),
        reports.iter().find_map(|r| r.budget.as_ref()),
    ) {
        eprintln!(
            "memest: over budget {} at {} {}",
            format_bytes(b.budget_bytes, units),
            sweep.name(),
            over.join(", ")
        );
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}
