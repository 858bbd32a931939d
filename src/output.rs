//! What the binary prints: a report or a sweep in the chosen format, the over-budget line and its
//! exit status, and names from files made safe for the terminal.

use std::io::{self, Write};
use std::process::ExitCode;

use anyhow::{Context, Result};

use crate::cli::{OutputFormat, OutputOpts};
use memest::units::format_bytes;

/// The buffer the JSON is streamed through (bytes).
const JSON_BUFFER: usize = 1 << 16;

/// Writes a JSON document (`write`: [`memest::Report::write_json`] or
/// [`memest::report::SweepReport::write_json`]) and a final newline to `out` as it is made
/// (25 MB for 100,000 layers), through a buffer: standard output is line-buffered, a write per
/// line. `what` names the document in the error.
fn write_json(
    out: &mut impl Write,
    what: &str,
    write: impl FnOnce(&mut io::BufWriter<&mut dyn Write>) -> serde_json::Result<()>,
) -> Result<()> {
    let mut w = io::BufWriter::with_capacity(JSON_BUFFER, out as &mut dyn Write);
    write(&mut w)
        .map_err(io::Error::from)
        .with_context(|| format!("failed to serialize the {what}"))?;
    writeln!(w)?;
    w.flush()?;
    Ok(())
}

/// Prints one report in the chosen format to `out`; exit 1 when it is over the budget (one line
/// on `err`, standard error: total, budget, overshoot).
///
/// # Errors
/// When writing fails.
pub fn print_report(
    out: &mut impl Write,
    err: &mut impl Write,
    report: &memest::Report,
    opts: &OutputOpts,
) -> Result<ExitCode> {
    let units = opts.units;
    match opts.format {
        OutputFormat::Json => {
            write_json(out, "report", |w| report.write_json(w))?;
        }
        OutputFormat::Markdown => {
            write!(
                out,
                "{}",
                shown(&memest::render::markdown::summary(report, units))
            )?;
        }
        OutputFormat::Csv => {
            write!(
                out,
                "{}",
                shown(&memest::render::csv::rows(std::slice::from_ref(report)))
            )?;
        }
        OutputFormat::Table => {
            write!(out, "{}", shown(&memest::render::summary(report, units)))?;
            if opts.per_layer {
                write!(out, "{}", shown(&memest::render::per_layer(report, units)))?;
            }
            if opts.explain {
                write!(out, "{}", shown(&memest::render::explain(report, units)))?;
            }
        }
    }
    out.flush()?;
    if let Some(b) = report.budget.as_ref().filter(|b| !b.fits) {
        writeln!(
            err,
            "memest: over budget: {} {} > budget {} (over by {})",
            b.on,
            format_bytes(b.checked_bytes, units),
            format_bytes(b.budget_bytes, units),
            format_bytes(b.overshoot_bytes, units)
        )?;
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

/// Text for the terminal: names come from files, so control characters in them (an ANSI escape
/// `\x1b[31m`, a carriage return) are shown escaped (`\u{1b}[31m`) rather than acted on; line
/// breaks and tabs stay.
pub fn shown(text: &str) -> std::borrow::Cow<'_, str> {
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

/// Prints a sweep in the chosen format to `out`, its warnings to `err` (standard error); exit 1
/// when some value is over the budget (one line on `err` naming them).
///
/// # Errors
/// When writing fails.
pub fn print_sweep(
    out: &mut impl Write,
    err: &mut impl Write,
    swept: &memest::report::SweepReport,
    sweep: &memest::sweep::Sweep,
    origin: &str,
    opts: &OutputOpts,
) -> Result<ExitCode> {
    let mut warned = Vec::new();
    for w in swept.sweep.iter().flat_map(|r| &r.warnings) {
        if !warned.contains(w) {
            warned.push(w.clone());
            writeln!(err, "warning: {}", shown(&w.message(origin)))?;
        }
    }
    let reports = &swept.sweep;
    let units = opts.units;
    match opts.format {
        OutputFormat::Json => {
            write_json(out, "sweep", |w| swept.write_json(w))?;
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
        writeln!(
            err,
            "memest: over budget {} at {} {}",
            format_bytes(b.budget_bytes, units),
            sweep.name(),
            over.join(", ")
        )?;
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

/// Prints `--plan auto`'s plans (JSON, or a table in the other formats); exit 1 when a budget
/// is given and no plan fits it.
pub fn print_plans(
    out: &mut impl Write,
    plans: &memest::report::PlansReport,
    opts: &OutputOpts,
) -> Result<ExitCode> {
    match opts.format {
        OutputFormat::Json => {
            let text = plans.to_json().context("failed to serialize the plans")?;
            writeln!(out, "{text}")?;
        }
        _ => write!(out, "{}", shown(&memest::render::plans(plans, opts.units)))?,
    }
    out.flush()?;
    let none_fits =
        plans.budget_bytes.is_some() && !plans.plans.iter().any(|p| p.fits == Some(true));
    Ok(if none_fits {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}
