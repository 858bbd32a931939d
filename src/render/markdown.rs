//! `--format markdown`: GitHub-flavoured markdown for a pull-request comment, with the same
//! rows as the terminal table.

use std::fmt::Write as _;

use super::{
    CATEGORY_HEADER, category_rows, min_gpus_line, parallel_rows, plan_line, run_line, sweep_rows,
};
use crate::report::Report;
use crate::sweep::Sweep;
use crate::units::{UnitSystem, format_bytes};

/// A table cell: `|` and `\\` escaped, control characters as spaces.
fn cell(s: &str) -> String {
    printable(s).replace('\\', "\\\\").replace('|', "\\|")
}

/// `s` with control characters (line breaks, terminal escapes) as spaces.
fn printable(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// Text in a code span: backticks replaced, so a name cannot end the span.
fn code(s: &str) -> String {
    format!("`{}`", printable(s).replace('`', "'"))
}

fn table(out: &mut String, header: &[String], right_from: usize, rows: &[Vec<String>]) {
    let line = |cells: Vec<String>| format!("| {} |\n", cells.join(" | "));
    out.push_str(&line(header.iter().map(|h| cell(h)).collect()));
    let align = (0..header.len())
        .map(|i| if i < right_from { "---" } else { "---:" }.to_string())
        .collect();
    out.push_str(&line(align));
    for row in rows {
        out.push_str(&line(row.iter().map(|c| cell(c)).collect()));
    }
}

/// The budget verdict, when there is a budget: what is left of it after the figure it checks
/// (`--budget-on`), as the terminal's budget line says.
fn verdict(r: &Report, units: UnitSystem) -> Option<String> {
    let fmt = |b: u64| format_bytes(b, units);
    r.budget.as_ref().map(|b| {
        // On a GPU the budget checks another figure than the peak: name it.
        let figure = if r.device_bytes.is_some() {
            format!("{} figure {}: ", b.on, fmt(b.checked_bytes))
        } else {
            String::new()
        };
        let verdict = if b.fits {
            format!(
                "**fits** the {} budget, {} to spare",
                fmt(b.budget_bytes),
                fmt(b.budget_bytes.saturating_sub(b.checked_bytes))
            )
        } else {
            format!(
                "**over** the {} budget by {}",
                fmt(b.budget_bytes),
                fmt(b.overshoot_bytes)
            )
        };
        format!("{figure}{verdict}")
    })
}

/// One estimate: a heading line, the run, the per-category table and the peak.
#[must_use]
pub fn summary(r: &Report, units: UnitSystem) -> String {
    let fmt = |b: u64| format_bytes(b, units);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "**memest** {}: **{}** at the peak",
        code(&r.model),
        fmt(r.peak_bytes)
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "input {}; {}",
        code(&r.input_shape.to_string()),
        cell(&run_line(r))
    );
    let _ = writeln!(out);
    if let Some(p) = &r.parallel {
        if let Some(m) = &p.min_gpus {
            let _ = writeln!(out, "{}", cell(&min_gpus_line(m, units)));
            let _ = writeln!(out);
        }
        let _ = writeln!(
            out,
            "{}; every figure below is one GPU's",
            cell(&plan_line(p))
        );
        let _ = writeln!(out);
    }
    let header: Vec<String> = CATEGORY_HEADER.iter().map(|h| (*h).to_string()).collect();
    let rows: Vec<Vec<String>> = category_rows(r, units)
        .into_iter()
        .map(|row| row.to_vec())
        .collect();
    table(&mut out, &header, 1, &rows);
    let _ = writeln!(out);
    let _ = write!(
        out,
        "peak: {} during the {}",
        fmt(r.peak_bytes),
        r.peak_phase.title()
    );
    if let Some(l) = &r.peak_layer {
        let _ = write!(out, " at {}", code(l));
    }
    if let Some(v) = verdict(r, units) {
        let _ = write!(out, "; {v}");
    }
    let _ = writeln!(out);
    if let Some(p) = &r.parallel {
        // The model states sharded by the plan, as the terminal's second table.
        let _ = writeln!(out);
        let header = ["Model state", "Whole model", "Per GPU"].map(String::from);
        let rows: Vec<Vec<String>> = parallel_rows(p, units)
            .into_iter()
            .map(|row| row.to_vec())
            .collect();
        table(&mut out, &header, 1, &rows);
    }
    out
}

/// A sweep: one row per value.
#[must_use]
pub fn sweep(reports: &[Report], sweep: &Sweep, units: UnitSystem) -> String {
    let mut out = String::new();
    if let Some(first) = reports.first() {
        let _ = writeln!(
            out,
            "**memest** {}: sweep over {}",
            code(&first.model),
            sweep.name()
        );
        let _ = writeln!(out);
        if let Some(p) = &first.parallel {
            let _ = writeln!(out, "{}; every figure is one GPU's", cell(&plan_line(p)));
            let _ = writeln!(out);
        }
    }
    let (header, rows) = sweep_rows(reports, sweep, units);
    table(&mut out, &header, 1, &rows);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_cannot_break_the_markdown() {
        assert_eq!(cell("a|b"), "a\\|b");
        assert_eq!(cell("a\\|b"), "a\\\\\\|b");
        assert_eq!(cell("x\ny\u{1b}[31m"), "x y [31m");
        assert_eq!(code("my`model`\n"), "`my'model' `");
    }
}
