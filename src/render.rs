//! Tables for people (comfy-table). Pure functions of a [`Report`].

use comfy_table::{CellAlignment, Table, presets};

use crate::report::Report;
use crate::sim::Category;
use crate::units::{UnitSystem, format_bytes};

fn share(part: u64, total: u64) -> String {
    if total == 0 {
        return "-".into();
    }
    #[allow(clippy::cast_precision_loss)] // display only
    let pct = part as f64 * 100.0 / total as f64;
    format!("{pct:.1}%")
}

fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The header and the per-category table.
#[must_use]
pub fn summary(r: &Report, units: UnitSystem) -> String {
    let s = &r.settings;
    let fmt = |b: u64| format_bytes(b, units);
    let mut out = String::new();
    let mut run = format!("batch {}", s.batch);
    if let Some(seq) = s.seq {
        run.push_str(&format!(", seq {seq}"));
    }
    run.push_str(&format!(", {}", s.dtype));
    if let Some(amp) = s.amp {
        run.push_str(&format!(" (autocast {})", amp.dtype()));
    }
    match s.optimizer {
        Some(o) => run.push_str(&format!(", {o}, train")),
        None => run.push_str(&format!(
            ", {}",
            if s.training() {
                "train, no optimizer"
            } else {
                "infer"
            }
        )),
    }
    let attention = match s.attention {
        crate::settings::AttentionImpl::Eager => "eager",
        crate::settings::AttentionImpl::Flash => "flash",
    };
    let device = match s.device {
        crate::settings::Device::Cpu => "cpu",
        crate::settings::Device::Cuda => "cuda",
    };
    out.push_str(&format!("model: {}  input: {}\n", r.model, r.input_shape));
    let has_attention = r.layers.iter().any(|l| l.kind.ends_with("attention"));
    let attention = if has_attention {
        format!("{attention} attention, ")
    } else {
        String::new()
    };
    out.push_str(&format!(
        "run:   {run}; {attention}{device} kernels{}\n",
        if s.checkpoint {
            ", checkpointed blocks"
        } else {
            ""
        }
    ));
    if s.training() {
        out.push_str(&format!(
            "parameters: {} ({} trainable)\n",
            thousands(r.param_count),
            thousands(r.trainable_param_count)
        ));
    } else {
        out.push_str(&format!("parameters: {}\n", thousands(r.param_count)));
    }
    out.push_str(&recipe_line(r));
    if r.parameters_by_dtype.len() > 1 {
        let parts: Vec<String> = r
            .parameters_by_dtype
            .iter()
            .map(|(d, &b)| {
                let n = r.param_count_by_dtype.get(d).copied().unwrap_or(0);
                format!(
                    "{d} {} ({} parameters)",
                    format_bytes(b, units),
                    thousands(n)
                )
            })
            .collect();
        out.push_str(&format!("parameters by dtype: {}\n", parts.join(", ")));
    }
    if let Some(lora) = &r.settings.lora {
        out.push_str(&format!(
            "lora: rank {} on {}: the base is frozen; the {} trainable adapter parameters are float32 (PEFT), so gradients and optimizer state are theirs alone (the recipe line applies to the base weights)\n",
            lora.rank,
            lora.targets.join(","),
            thousands(r.trainable_param_count)
        ));
    }

    let mut table = Table::new();
    table.load_style(presets::UTF8_FULL_CONDENSED);
    table.set_header(vec!["Category", "At peak", "Share", "Step maximum"]);
    for c in Category::ALL {
        let at = r.at_peak.get(c.key()).copied().unwrap_or(0);
        let max = r.category_max.get(c.key()).copied().unwrap_or(0);
        let always = matches!(
            c,
            Category::Parameters
                | Category::Gradients
                | Category::OptimizerState
                | Category::Activations
        );
        if at == 0 && max == 0 && !always {
            continue;
        }
        table.add_row(vec![
            c.title().to_string(),
            fmt(at),
            share(at, r.peak_bytes),
            fmt(max),
        ]);
    }
    table.add_row(vec![
        "Total (peak)".to_string(),
        fmt(r.peak_bytes),
        share(r.peak_bytes, r.peak_bytes),
        String::new(),
    ]);
    for i in 1..4 {
        if let Some(col) = table.column_mut(i) {
            col.set_cell_alignment(CellAlignment::Right);
        }
    }
    out.push_str(&table.to_string());
    out.push('\n');
    let at = r
        .peak_layer
        .as_deref()
        .map(|l| format!(" at `{l}`"))
        .unwrap_or_default();
    out.push_str(&format!(
        "peak: {} during the {}{at}\n",
        fmt(r.peak_bytes),
        r.peak_phase.title()
    ));
    if s.training() {
        let master = if r.master_weights_bytes > 0 {
            format!("; master weights: {}", fmt(r.master_weights_bytes))
        } else {
            String::new()
        };
        out.push_str(&format!(
            "saved for backward: {}; gradients: {}; optimizer state: {}{master}\n",
            fmt(r.activations_bytes),
            fmt(r.gradients_bytes),
            fmt(r.optimizer_state_bytes)
        ));
    } else {
        out.push_str(&format!(
            "largest set of live activations: {}\n",
            fmt(r.peak_activations_bytes)
        ));
    }
    if let Some(b) = &r.budget {
        if b.fits {
            out.push_str(&format!(
                "budget: {}: fits, {} to spare\n",
                fmt(b.budget_bytes),
                fmt(b.budget_bytes - r.total_bytes)
            ));
        } else {
            out.push_str(&format!(
                "budget: {}: OVER by {}\n",
                fmt(b.budget_bytes),
                fmt(b.overshoot_bytes)
            ));
        }
    }
    out
}

/// A bytes-per-parameter figure: whole numbers plain, others with up to three decimals.
fn per_param(v: f64) -> String {
    let s = format!("{v:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_string()
}

/// `recipe: mixed-bf16: 2 (weights) + 2 (grads) + 4 (master) + 8 (adam) = 16 bytes/parameter`.
fn recipe_line(r: &Report) -> String {
    let rec = &r.recipe;
    let b = rec.bytes_per_param;
    let mut terms = vec![format!("{} (weights)", per_param(b.weights))];
    let note = if r.settings.training() {
        terms.push(format!("{} (grads)", per_param(b.gradients)));
        if rec.master_weights_dtype.is_some() {
            terms.push(format!("{} (master)", per_param(b.master_weights)));
        }
        if let Some(o) = r.settings.optimizer {
            let what = if o == crate::settings::Optimizer::Adafactor {
                "adafactor, factored: this model's average".to_string()
            } else {
                o.to_string()
            };
            terms.push(format!("{} ({what})", per_param(b.optimizer_state)));
        }
        String::new()
    } else {
        " (inference: no gradients or optimizer state)".to_string()
    };
    let mut dtypes = Vec::new();
    if let Some(a) = rec.autocast_dtype {
        dtypes.push(format!("autocast to {a}"));
    } else if rec.activations_dtype != crate::dtype::DType::Float32 {
        dtypes.push(format!("{} activations", rec.activations_dtype));
    }
    if let Some(m) = rec.master_weights_dtype {
        dtypes.push(format!("{m} master weights and optimizer state"));
    }
    let dtypes = if dtypes.is_empty() {
        String::new()
    } else {
        format!("; {}", dtypes.join(", "))
    };
    format!(
        "recipe: {}: {} = {} bytes/parameter{note}{dtypes}\n",
        rec.name,
        terms.join(" + "),
        per_param(b.total)
    )
}

/// The per-layer table (`--per-layer`).
#[must_use]
pub fn per_layer(r: &Report, units: UnitSystem) -> String {
    let mut table = Table::new();
    table.load_style(presets::UTF8_FULL_CONDENSED);
    table.set_header(vec![
        "Layer",
        "Kind",
        "×",
        "Output shape",
        "Params",
        "Saved",
        "Kept (one copy)",
    ]);
    for l in &r.layers {
        table.add_row(vec![
            l.path.clone(),
            l.kind.clone(),
            l.repeat.to_string(),
            l.output_shape.to_string(),
            thousands(l.params),
            format_bytes(l.activation_bytes, units),
            l.kept.join("\n"),
        ]);
    }
    for i in [2, 4, 5] {
        if let Some(col) = table.column_mut(i) {
            col.set_cell_alignment(CellAlignment::Right);
        }
    }
    format!("{table}\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_param_figures_drop_trailing_zeros() {
        assert_eq!(per_param(16.0), "16");
        assert_eq!(per_param(0.0), "0");
        assert_eq!(per_param(2.03125), "2.031");
        assert_eq!(per_param(0.5), "0.5");
        assert_eq!(per_param(10.0 + 1.0 / 3.0), "10.333");
    }
}
