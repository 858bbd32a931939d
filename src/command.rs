//! The `memest` command once its flags are read: a [`Request`] and its input in, the
//! estimate, sweep or printed model out, and the exit status. The binary's `main` and the
//! fuzzer (`tests/fuzz/`) both run it, so what the fuzzer checks is what users get.

use std::io::{self, Write};
use std::process::ExitCode;

use anyhow::{Context, Result};

use crate::cli::{Input, Request};
use crate::output::{self, shown};
use crate::report::Report;

/// What one request did.
#[derive(Debug)]
pub struct Executed {
    /// The exit status: 0 (printed, and within any budget) or 1 (over the budget).
    pub code: ExitCode,
    /// The reports printed: none for `--print-model`, one per value of a `--sweep`, else one.
    pub reports: Vec<Report>,
}

/// Answers `req` on `input`, as `memest` does: the estimate (or sweep, or `--print-model`'s
/// TOML) on `out`, warnings and the over-budget line on `err`, the `--timeline` SVG to its
/// file.
///
/// # Errors
/// A model the library refuses ([`crate::locate`]d in `input`), a timeline that cannot be
/// written, or a failed write to `out` or `err`; the binary prints it with [`report_error`]
/// and exits 2.
pub fn execute(
    req: &Request,
    input: &Input,
    out: &mut impl Write,
    err: &mut impl Write,
) -> Result<Executed> {
    let origin = input.origin.as_str();
    let located = |e| crate::locate(e, origin, &input.src, input.format);
    let mut spec =
        crate::load_spec_with(&input.src, input.format, req.head, req.image).map_err(located)?;
    if req.print_model {
        spec.name.get_or_insert_with(|| input.name.clone());
        let text = crate::print_model::to_toml(&spec).map_err(|e| e.at(origin))?;
        write!(out, "{text}")?;
        out.flush()?;
        return Ok(Executed {
            code: ExitCode::SUCCESS,
            reports: Vec::new(),
        });
    }
    if let Some(sweep) = &req.sweep {
        let swept = crate::run_sweep(&spec, &input.name, &req.query, sweep).map_err(located)?;
        let code = output::print_sweep(out, err, &swept, sweep, origin, &req.output)?;
        return Ok(Executed {
            code,
            reports: swept.sweep,
        });
    }
    if let Some(flags) = &req.plans {
        let plans =
            crate::search::run_plans(&spec, &input.name, &req.query, flags).map_err(located)?;
        for w in &req.query.warnings {
            writeln!(err, "warning: {}", shown(&w.message(origin)))?;
        }
        let code = output::print_plans(out, &plans, &req.output)?;
        return Ok(Executed {
            code,
            reports: Vec::new(),
        });
    }
    let report = crate::run(&spec, &input.name, &req.query).map_err(located)?;
    for w in &report.warnings {
        writeln!(err, "warning: {}", shown(&w.message(origin)))?;
    }
    let units = req.output.units;
    if let Some(path) = &req.output.timeline
        && let Some(svg) = crate::render::svg::timeline(&report, units)
    {
        std::fs::write(path, svg)
            .with_context(|| format!("failed to write the timeline to {}", path.display()))?;
    }
    let code = output::print_report(out, err, &report, &req.output)?;
    Ok(Executed {
        code,
        reports: vec![report],
    })
}

/// Prints a failed request's error on `err` as `error: <the chain>` (names from files
/// escaped) and gives its exit status: 2, or 0 when standard output was closed early
/// (`memest … | head`).
pub fn report_error(error: &anyhow::Error, err: &mut impl Write) -> ExitCode {
    let broken_pipe = error.chain().any(|c| {
        c.downcast_ref::<io::Error>()
            .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe)
    });
    if broken_pipe {
        return ExitCode::SUCCESS;
    }
    let _ = writeln!(err, "error: {}", shown(&format!("{error:#}")));
    ExitCode::from(2)
}
