//! `--format csv`: one header row, then one row per estimate (one, or one per `--sweep`
//! value). Byte counts are integers in `*_bytes` columns; an absent value is an empty field.
//! The parallel plan is named by `gpus` (ranks in all, 1 without a plan), `parallel` (the plan
//! in words, as the table's `per GPU:` line; empty on one GPU) and `data_parallel`; every byte
//! figure is then one GPU's.

use crate::report::Report;
use crate::settings::BudgetOn;
use crate::sim::Category;

/// The column names, in order: [`header`], then with a budget on a GPU the figure the budget
/// checks, named as in the JSON (`device_bytes`, `reserved_peak_bytes` or
/// `allocated_peak_bytes`, after `--budget-on`), so that `fits` can be read from the row.
#[must_use]
pub fn header_for(reports: &[Report]) -> Vec<String> {
    let mut cols = header();
    if let Some(on) = crate::render::checked_figure(reports) {
        cols.push(checked_column(on).into());
    }
    cols
}

/// The JSON field a budget figure is, as a CSV column.
const fn checked_column(on: BudgetOn) -> &'static str {
    match on {
        BudgetOn::Device => "device_bytes",
        BudgetOn::Reserved => "reserved_peak_bytes",
        BudgetOn::Allocated => "allocated_peak_bytes",
    }
}

/// The column names every output has, in order.
#[must_use]
pub fn header() -> Vec<String> {
    let mut cols: Vec<String> = [
        "model",
        "batch",
        "seq",
        "dtype",
        "mode",
        "optimizer",
        "recipe",
        "gpus",
        "parallel",
        "data_parallel",
        "param_count",
        "trainable_param_count",
        "parameters_bytes",
        "buffers_bytes",
        "gradients_bytes",
        "optimizer_state_bytes",
        "master_weights_bytes",
        "activations_bytes",
        "input_bytes",
        "kv_cache_bytes",
        "peak_activations_bytes",
        "optimizer_temporaries_bytes",
    ]
    .map(String::from)
    .to_vec();
    cols.extend(Category::ALL.iter().map(|c| format!("at_peak_{}", c.key())));
    cols.extend(
        [
            "total_bytes",
            "peak_phase",
            "peak_layer",
            "budget_bytes",
            "fits",
        ]
        .map(String::from),
    );
    cols
}

/// One estimate's fields, in [`header`]'s order.
#[must_use]
pub fn row(r: &Report) -> Vec<String> {
    let s = &r.settings;
    let opt = |v: Option<String>| v.unwrap_or_default();
    let mut row = vec![
        r.model.clone(),
        s.batch.to_string(),
        opt(s.seq.map(|v| v.to_string())),
        s.dtype.to_string(),
        s.mode.to_string(),
        opt(s.optimizer.map(|o| o.to_string())),
        r.recipe.name.clone(),
        // The parallel plan, as the JSON's `parallel`: one GPU without one.
        r.parallel.as_ref().map_or(1, |p| p.world_size).to_string(),
        opt(r.parallel.as_ref().map(|p| p.description.clone())),
        r.parallel
            .as_ref()
            .map_or(1, |p| p.data_parallel)
            .to_string(),
    ];
    row.extend(
        [
            r.param_count,
            r.trainable_param_count,
            r.parameters_bytes,
            r.buffers_bytes,
            r.gradients_bytes,
            r.optimizer_state_bytes,
            r.master_weights_bytes,
            r.activations_bytes,
            r.input_bytes,
            r.kv_cache_bytes,
            r.peak_activations_bytes,
            r.optimizer_temporaries_bytes,
        ]
        .map(|v| v.to_string()),
    );
    row.extend(Category::ALL.iter().map(|&c| r.at_peak.get(c).to_string()));
    row.extend([
        r.total_bytes.to_string(),
        serde_plain(&r.peak_phase),
        opt(r.peak_layer.clone()),
        opt(r.budget.as_ref().map(|b| b.budget_bytes.to_string())),
        opt(r.budget.as_ref().map(|b| b.fits.to_string())),
    ]);
    row
}

/// A unit enum's JSON name (`optimizer_step`).
fn serde_plain<T: serde::Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        _ => String::new(),
    }
}

/// The header and one row per report, quoted where a field needs it (RFC 4180).
#[must_use]
pub fn rows(reports: &[Report]) -> String {
    let mut w = ::csv::WriterBuilder::new()
        .terminator(::csv::Terminator::Any(b'\n'))
        .from_writer(Vec::new());
    // Writing to a `Vec` cannot fail, and every record has the header's length.
    let checked = crate::render::checked_figure(reports).is_some();
    let _ = w.write_record(header_for(reports));
    for r in reports {
        let mut fields = row(r);
        if checked {
            fields.push(
                r.budget
                    .as_ref()
                    .map(|b| b.checked_bytes.to_string())
                    .unwrap_or_default(),
            );
        }
        let _ = w.write_record(fields);
    }
    let bytes = w.into_inner().unwrap_or_default();
    String::from_utf8_lossy(&bytes).into_owned()
}
