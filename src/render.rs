//! Tables for people (comfy-table). Pure functions of a [`Report`].

use std::fmt::{self, Write as _};

use comfy_table::{CellAlignment, Table, presets};

use crate::report::Report;
use crate::settings::BudgetOn;
use crate::sim::Category;
use crate::spec::LayerKind;
use crate::sweep::Sweep;
use crate::units::{UnitSystem, format_bytes};

pub mod csv;
pub mod markdown;
pub mod svg;

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

/// `memest gpus`: one row per GPU (id, name, total memory as the driver reports it, compute
/// capability, and where the total comes from), then the aliases and the sources.
#[must_use]
pub fn gpus(all: &[crate::gpu::Gpu], units: UnitSystem) -> String {
    use crate::gpu::TotalFrom;
    let mut table = Table::new();
    table.load_style(presets::UTF8_FULL_CONDENSED);
    table.set_header([
        "GPU",
        "Name",
        "Memory",
        "Total",
        "Compute capability",
        "Aliases",
    ]);
    for g in all {
        let total = match g.total_from {
            TotalFrom::NvidiaSmi => format_bytes(g.total_bytes, units),
            TotalFrom::Datasheet => format!("{} *", format_bytes(g.total_bytes, units)),
        };
        table.add_row([
            g.id.clone(),
            g.name.clone(),
            g.memory.clone(),
            total,
            g.arch.to_string(),
            g.aliases.join(", "),
        ]);
    }
    if let Some(col) = table.column_mut(3) {
        col.set_cell_alignment(CellAlignment::Right);
    }
    let mut out = format!("{table}\n");
    out.push_str(
        "Total: what nvidia-smi reports as memory.total, from a published output; * the datasheet's\ncapacity (no published driver figure; the driver's total is at most this).\nSources: `memest gpus --format json` (source, total_source), or data/gpus.toml.\n",
    );
    out
}

/// The search's outcome (`--max-batch`, `--max-context`), the header and the per-category table.
#[must_use]
pub fn summary(r: &Report, units: UnitSystem) -> String {
    let mut out = String::new();
    // Writing to a `String` cannot fail.
    let _ = write_summary(&mut out, r, units);
    out
}

/// `--plan auto`: one row per plan, cheapest first: each GPU's checked figure, its tensor
/// peak, the host memory of offloaded state and the verdict.
#[must_use]
pub fn plans(p: &crate::report::PlansReport, units: UnitSystem) -> String {
    let fmt = |b: u64| format_bytes(b, units);
    let mut out = String::new();
    let budget = p.budget_bytes.map_or_else(
        || "no budget".to_string(),
        |b| format!("budget {} per GPU", fmt(b)),
    );
    let _ = writeln!(
        out,
        "plans for {} on {}, cheapest in memory first ({budget}):",
        p.model,
        crate::units::count(p.gpus, "GPU")
    );
    let mut table = Table::new();
    table.load_style(presets::UTF8_FULL_CONDENSED);
    table.set_header([
        "Plan",
        "Per GPU (checked)",
        "Tensor peak",
        "CPU memory",
        "Fits",
    ]);
    for row in &p.plans {
        table.add_row([
            row.description.clone(),
            fmt(row.checked_bytes),
            fmt(row.peak_bytes),
            if row.cpu_bytes > 0 {
                fmt(row.cpu_bytes)
            } else {
                String::new()
            },
            match row.fits {
                Some(true) => "yes".to_string(),
                Some(false) => "no".to_string(),
                None => String::new(),
            },
        ]);
    }
    for i in 1..4 {
        if let Some(col) = table.column_mut(i) {
            col.set_cell_alignment(CellAlignment::Right);
        }
    }
    let _ = writeln!(out, "{table}");
    out
}

fn write_summary(out: &mut String, r: &Report, units: UnitSystem) -> fmt::Result {
    write_header(out, r, units)?;
    write_categories(out, r, units)?;
    write_parallel(out, r, units)?;
    write_footer(out, r, units)
}

/// `--min-gpus`'s outcome in words, for every format.
pub(crate) fn min_gpus_line(m: &crate::report::MinGpus, units: UnitSystem) -> String {
    let fmt = |b: u64| format_bytes(b, units);
    match m.gpus {
        Some(n) => format!(
            "fewest GPUs that fit {} each: {n} (the figures are at {n})",
            fmt(m.budget_bytes)
        ),
        None => {
            let mut line = format!(
                "no number of GPUs fits {} each (tried up to {})",
                fmt(m.budget_bytes),
                m.searched_up_to
            );
            match &m.fixed {
                Some(f) => {
                    let mut parts = Vec::new();
                    if f.runtime_bytes > 0 {
                        parts.push(format!(
                            "{} CUDA context, workspaces and NCCL buffers",
                            fmt(f.runtime_bytes)
                        ));
                    }
                    parts.push(format!(
                        "{} activations, temporaries, input and communication buffers",
                        fmt(f.activations_bytes)
                    ));
                    parts.push(format!(
                        "{} model states not divided among the GPUs",
                        fmt(f.replicated_bytes)
                    ));
                    let _ = write!(
                        line,
                        ": at {} GPUs each needs {}, of which {} no further sharding removes ({})",
                        f.gpus,
                        fmt(f.checked_bytes),
                        fmt(f.fixed_bytes),
                        parts.join(", ")
                    );
                    if f.fixed_bytes > m.budget_bytes {
                        let _ = write!(
                            line,
                            "; that fixed cost alone exceeds the budget by {}, so more GPUs cannot help this plan",
                            fmt(f.fixed_bytes - m.budget_bytes)
                        );
                    } else {
                        line.push_str("; the per-GPU figure stopped falling or the search ended");
                    }
                }
                None => line.push_str("; the per-GPU figure stopped falling or the search ended"),
            }
            line.push_str(": the figures are at the size asked for");
            line
        }
    }
}

/// The parallel plan in words, for every format: `per GPU: FSDP full-shard over 8 GPUs; data
/// parallel 8`.
pub(crate) fn plan_line(p: &crate::report::ParallelReport) -> String {
    format!(
        "per GPU: {}; data parallel {}",
        p.description, p.data_parallel
    )
}

/// The model-state rows of a parallel plan (name, whole model, per GPU; empty cells where a
/// row has no whole-model figure), for every format.
pub(crate) fn parallel_rows(
    p: &crate::report::ParallelReport,
    units: UnitSystem,
) -> Vec<[String; 3]> {
    let fmt = |b: u64| format_bytes(b, units);
    let (u, g) = (&p.unsharded, &p.per_gpu);
    let mut rows = Vec::new();
    for (name, whole, per) in [
        ("Parameters", u.parameters_bytes, g.parameters_bytes),
        ("Gradients", u.gradients_bytes, g.gradients_bytes),
        (
            "Optimizer state",
            u.optimizer_state_bytes,
            g.optimizer_state_bytes,
        ),
        (
            "Master weights",
            u.master_weights_bytes,
            g.master_weights_bytes,
        ),
    ] {
        if whole > 0 || per > 0 {
            rows.push([name.to_string(), fmt(whole), fmt(per)]);
        }
    }
    rows.push([
        "Communication buffers (max)".to_string(),
        String::new(),
        fmt(p.comm_buffers_bytes),
    ]);
    if p.nccl_bytes > 0 {
        rows.push([
            "NCCL buffers (approximate)".to_string(),
            String::new(),
            fmt(p.nccl_bytes),
        ]);
    }
    if p.cpu_bytes > 0 {
        rows.push([
            format!("CPU memory (offload; {} pinned)", fmt(p.cpu_pinned_bytes)),
            String::new(),
            fmt(p.cpu_bytes),
        ]);
    }
    rows
}

/// Several GPUs: the plan, and each model state for the whole model (one GPU alone) beside
/// what each GPU holds, with the communication buffers' own maximum.
fn write_parallel(out: &mut String, r: &Report, units: UnitSystem) -> fmt::Result {
    let Some(p) = &r.parallel else {
        return Ok(());
    };
    if let Some(m) = &p.min_gpus {
        writeln!(out, "{}", min_gpus_line(m, units))?;
    }
    writeln!(out, "{}; every figure above is one GPU's", plan_line(p))?;
    let mut table = Table::new();
    table.load_style(presets::UTF8_FULL_CONDENSED);
    table.set_header(["Model state", "Whole model", "Per GPU"]);
    for row in parallel_rows(p, units) {
        table.add_row(row);
    }
    for i in 1..3 {
        if let Some(col) = table.column_mut(i) {
            col.set_cell_alignment(CellAlignment::Right);
        }
    }
    writeln!(out, "{table}")?;
    write_stages(out, p, units)
}

/// Pipeline parallelism: the stages side by side, when they differ (the table above is the
/// worst one's).
fn write_stages(
    out: &mut String,
    p: &crate::report::ParallelReport,
    units: UnitSystem,
) -> fmt::Result {
    let Some(first) = p.stages.first() else {
        return Ok(());
    };
    let fmt = |b: u64| format_bytes(b, units);
    let worst = p
        .stages
        .iter()
        .max_by_key(|s| s.peak_bytes)
        .unwrap_or(first);
    let differ = p
        .stages
        .iter()
        .any(|s| s.peak_bytes != first.peak_bytes || s.model_states != first.model_states);
    if !differ {
        return writeln!(
            out,
            "pipeline: all {} stages alike; the figures above are each one's",
            p.stages.len()
        );
    }
    writeln!(
        out,
        "pipeline stages (the figures above are stage {}'s, the largest):",
        worst.stage
    )?;
    let mut table = Table::new();
    table.load_style(presets::UTF8_FULL_CONDENSED);
    table.set_header([
        "Stage",
        "Blocks",
        "In flight",
        "Model states",
        "Saved / micro-batch",
        "Activations",
        "Peak",
    ]);
    for s in &p.stages {
        let m = &s.model_states;
        let states = m
            .parameters_bytes
            .saturating_add(m.gradients_bytes)
            .saturating_add(m.optimizer_state_bytes)
            .saturating_add(m.master_weights_bytes);
        let list = |v: Vec<String>| v.join(", ");
        table.add_row([
            s.stage.to_string(),
            list(
                s.blocks
                    .iter()
                    .map(|b| match b[1].saturating_sub(b[0]) {
                        1 => b[0].to_string(),
                        _ => format!("{}–{}", b[0], b[1].saturating_sub(1)),
                    })
                    .collect(),
            ),
            list(
                s.micro_batches_in_flight
                    .iter()
                    .map(u64::to_string)
                    .collect(),
            ),
            fmt(states),
            fmt(s.saved_per_micro_batch_bytes),
            fmt(s.activations_bytes),
            fmt(s.peak_bytes),
        ]);
    }
    for i in 3..7 {
        if let Some(col) = table.column_mut(i) {
            col.set_cell_alignment(CellAlignment::Right);
        }
    }
    writeln!(out, "{table}")
}

/// The search's outcome, the model, the run's settings, the parameters and the recipe.
fn write_header(out: &mut String, r: &Report, units: UnitSystem) -> fmt::Result {
    let s = &r.settings;
    let fmt = |b: u64| format_bytes(b, units);
    if let Some(found) = &r.search {
        let what = found.dimension.name();
        let budget = fmt(found.budget_bytes);
        match found.largest {
            Some(v) => writeln!(out, "largest {what} that fits {budget}: {v}")?,
            None => writeln!(
                out,
                "largest {what} that fits {budget}: none (the estimate below is at the size asked for)"
            )?,
        }
    }
    writeln!(out, "model: {}  input: {}", r.model, r.input_shape)?;
    writeln!(out, "run:   {}", run_line(r))?;
    if s.training() {
        writeln!(
            out,
            "parameters: {} ({} trainable)",
            thousands(r.param_count),
            thousands(r.trainable_param_count)
        )?;
    } else {
        writeln!(out, "parameters: {}", thousands(r.param_count))?;
    }
    out.write_str(&recipe_line(r))?;
    if r.parameters_by_dtype.len() > 1 {
        write!(out, "parameters by dtype: ")?;
        for (i, (d, &b)) in r.parameters_by_dtype.iter().enumerate() {
            let n = r.param_count_by_dtype.get(d).copied().unwrap_or(0);
            let comma = if i > 0 { ", " } else { "" };
            write!(out, "{comma}{d} {} ({} parameters)", fmt(b), thousands(n))?;
        }
        writeln!(out)?;
    }
    if let Some(lora) = &r.settings.lora {
        writeln!(
            out,
            "lora: rank {} on {}: the base is frozen; the {} trainable adapter parameters are float32 (PEFT), so gradients and optimizer state are theirs alone (the recipe line's gradients and optimizer state are the adapters')",
            lora.rank,
            lora.targets.join(","),
            thousands(r.trainable_param_count)
        )?;
    }
    Ok(())
}

/// The run's settings: `batch 32, float32, adam, train; cpu kernels`.
#[must_use]
pub fn run_line(r: &Report) -> String {
    let mut out = String::new();
    // Writing to a `String` cannot fail.
    let _ = write_run(&mut out, r);
    out
}

fn write_run(out: &mut String, r: &Report) -> fmt::Result {
    let s = &r.settings;
    write!(out, "batch {}", s.batch)?;
    if let Some(seq) = s.seq {
        write!(out, ", seq {seq}")?;
    }
    write!(out, ", {}", s.dtype)?;
    if let Some(amp) = s.amp {
        write!(out, " (autocast {})", amp.dtype())?;
    }
    match s.optimizer {
        Some(o) if !s.optimizer_impl.is_foreach() => {
            write!(out, ", {o} ({}), train", s.optimizer_impl)?;
        }
        Some(o) => write!(out, ", {o}, train")?,
        None if s.training() => write!(out, ", train, no optimizer")?,
        None => match &r.generation {
            Some(g) => write!(
                out,
                ", generate {} new tokens after a {}-token prompt",
                g.new_tokens, g.prompt_tokens
            )?,
            None => write!(out, ", infer")?,
        },
    }
    write!(out, "; ")?;
    let attention = |k| {
        matches!(
            k,
            LayerKind::Attention | LayerKind::CrossAttention | LayerKind::Mla
        )
    };
    if r.layers.iter().any(|l| attention(l.kind)) {
        write!(out, "{} attention, ", s.attention)?;
    }
    write!(out, "{} kernels", s.device)?;
    if s.checkpoint {
        write!(out, ", checkpointed blocks")?;
    }
    Ok(())
}

/// Whether the table shows category `c`: always the four of every step, others when ever
/// non-zero.
fn shown(r: &Report, c: Category) -> bool {
    let always = matches!(
        c,
        Category::Parameters
            | Category::Gradients
            | Category::OptimizerState
            | Category::Activations
    );
    always || r.at_peak.get(c) > 0 || r.category_max.get(c) > 0
}

/// The per-category rows (category, at peak, share, step maximum), the total last: the
/// categories always shown and any other that is ever non-zero.
fn category_rows(r: &Report, units: UnitSystem) -> Vec<[String; 4]> {
    let fmt = |b: u64| format_bytes(b, units);
    let mut rows = Vec::new();
    for c in Category::ALL.into_iter().filter(|&c| shown(r, c)) {
        let at = r.at_peak.get(c);
        let max = r.category_max.get(c);
        rows.push([
            c.title().to_string(),
            fmt(at),
            share(at, r.peak_bytes),
            fmt(max),
        ]);
    }
    rows.push([
        "Total (peak)".to_string(),
        fmt(r.peak_bytes),
        share(r.peak_bytes, r.peak_bytes),
        String::new(),
    ]);
    rows
}

/// The header of the per-category table.
const CATEGORY_HEADER: [&str; 4] = ["Category", "At peak", "Share", "Step maximum"];

/// Cells of a [`bar`].
const BAR_WIDTH: u64 = 20;

/// `part` of `scale` as a bar of [`BAR_WIDTH`] ASCII cells: `#` filled, `.` empty, rounded to
/// the nearest cell (a non-zero part shows at least one); past the scale, all filled and `>`.
fn bar(part: u64, scale: u64) -> String {
    let w = BAR_WIDTH;
    if part > scale {
        return format!("{}>", "#".repeat(w as usize));
    }
    let n = if scale == 0 {
        0
    } else {
        let n =
            (u128::from(part) * u128::from(w) * 2 + u128::from(scale)) / (2 * u128::from(scale));
        let n = u64::try_from(n).unwrap_or(w).min(w);
        if part > 0 { n.max(1) } else { n }
    };
    format!("{}{}", "#".repeat(n as usize), ".".repeat((w - n) as usize))
}

/// The per-category table: at the peak, its share, each category's own maximum; with a
/// budget, a bar of each row's share of it.
fn write_categories(out: &mut String, r: &Report, units: UnitSystem) -> fmt::Result {
    let mut table = Table::new();
    table.load_style(presets::UTF8_FULL_CONDENSED);
    let mut header = CATEGORY_HEADER.to_vec();
    let budget = r.budget.as_ref().map(|b| b.budget_bytes);
    if budget.is_some() {
        header.push("Of the budget");
    }
    table.set_header(header);
    let mut parts: Vec<u64> = Category::ALL
        .into_iter()
        .filter(|&c| shown(r, c))
        .map(|c| r.at_peak.get(c))
        .collect();
    parts.push(r.peak_bytes);
    for (row, part) in category_rows(r, units).into_iter().zip(parts) {
        let mut row = row.to_vec();
        if let Some(b) = budget {
            row.push(bar(part, b));
        }
        table.add_row(row);
    }
    for i in 1..4 {
        if let Some(col) = table.column_mut(i) {
            col.set_cell_alignment(CellAlignment::Right);
        }
    }
    writeln!(out, "{table}")
}

/// The figure a budget checks, where it is not the tensor peak: on a GPU (`device_bytes`
/// present) the one `--budget-on` names; `None` without a budget or on the CPU, where the
/// budget checks `total_bytes` itself. Sweep outputs show it beside the total so that a row's
/// verdict can be read from the row, as the single report's budget line does.
pub(crate) fn checked_figure(reports: &[Report]) -> Option<BudgetOn> {
    reports
        .iter()
        .find(|r| r.device_bytes.is_some())
        .and_then(|_| reports.iter().find_map(|r| r.budget.as_ref()))
        .map(|b| b.on)
}

/// The table heading of the figure a budget checks: `Device figure`, as the budget line
/// words it (`budget: 4.00 GiB, device figure 4.21 GiB: OVER by …`).
pub(crate) fn checked_heading(on: BudgetOn) -> String {
    let name = on.to_string();
    let mut chars = name.chars();
    chars.next().map_or_else(String::new, |c| {
        format!("{}{} figure", c.to_ascii_uppercase(), chars.as_str())
    })
}

/// A sweep's header and rows: the swept value, each category at the peak (those non-zero in
/// some row, and the four always shown), the total, on a GPU with a budget the figure the
/// budget checks ([`checked_figure`]), and with a budget whether it fits.
pub(crate) fn sweep_rows(
    reports: &[Report],
    sweep: &Sweep,
    units: UnitSystem,
) -> (Vec<String>, Vec<Vec<String>>) {
    let shown: Vec<Category> = Category::ALL
        .into_iter()
        .filter(|&c| {
            matches!(
                c,
                Category::Parameters
                    | Category::Gradients
                    | Category::OptimizerState
                    | Category::Activations
            ) || reports.iter().any(|r| r.at_peak.get(c) > 0)
        })
        .collect();
    let budget = reports.iter().any(|r| r.budget.is_some());
    let mut header = vec![sweep.name().to_string()];
    header.extend(shown.iter().map(|c| c.title().to_string()));
    header.push("Total (peak)".into());
    let checked = checked_figure(reports);
    if let Some(on) = checked {
        header.push(checked_heading(on));
    }
    if budget {
        header.push("Fits".into());
    }
    let rows = reports
        .iter()
        .zip(&sweep.values)
        .map(|(r, v)| {
            let mut row = vec![v.to_string()];
            row.extend(shown.iter().map(|&c| format_bytes(r.at_peak.get(c), units)));
            row.push(format_bytes(r.peak_bytes, units));
            if checked.is_some() {
                row.push(
                    r.budget
                        .as_ref()
                        .map(|b| format_bytes(b.checked_bytes, units))
                        .unwrap_or_default(),
                );
            }
            if budget {
                row.push(match &r.budget {
                    Some(b) if b.fits => "yes".into(),
                    Some(_) => "NO".into(),
                    None => String::new(),
                });
            }
            row
        })
        .collect();
    (header, rows)
}

/// A sweep as a table: one row per value (`--sweep`).
#[must_use]
pub fn sweep(reports: &[Report], sweep: &Sweep, units: UnitSystem) -> String {
    let mut out = String::new();
    if let Some(first) = reports.first() {
        let _ = writeln!(out, "model: {}  input: {}", first.model, first.input_shape);
        let _ = writeln!(out, "run:   {} (first row)", run_line(first));
        let _ = writeln!(
            out,
            "sweep over {}: {}",
            sweep.name(),
            crate::units::count(sweep.values.len() as u64, "value")
        );
    }
    let (header, rows) = sweep_rows(reports, sweep, units);
    let mut table = Table::new();
    table.load_style(presets::UTF8_FULL_CONDENSED);
    let n = header.len();
    table.set_header(header);
    for row in rows {
        table.add_row(row);
    }
    for i in 0..n {
        if let Some(col) = table.column_mut(i) {
            col.set_cell_alignment(CellAlignment::Right);
        }
    }
    let _ = writeln!(out, "{table}");
    out
}

/// Where the peak is, what training keeps, and the budget check.
fn write_footer(out: &mut String, r: &Report, units: UnitSystem) -> fmt::Result {
    let s = &r.settings;
    let fmt = |b: u64| format_bytes(b, units);
    write!(
        out,
        "peak: {} during the {}",
        fmt(r.peak_bytes),
        r.peak_phase.title()
    )?;
    if let Some(l) = &r.peak_layer {
        write!(out, " at `{l}`")?;
    }
    writeln!(out)?;
    if let Some(a) = r.allocated_peak_bytes {
        writeln!(
            out,
            "allocated peak: {} (torch.cuda.max_memory_allocated: each tensor rounded up to 512 B)",
            fmt(a)
        )?;
    }
    if let Some(res) = r.reserved_peak_bytes {
        let how = if s.expandable_segments {
            "expandable segments"
        } else {
            "segments"
        };
        writeln!(
            out,
            "reserved peak: {} (torch.cuda.max_memory_reserved: the caching allocator's {how})",
            fmt(res)
        )?;
    }
    if s.training() {
        write!(
            out,
            "saved for backward: {}; gradients: {}; optimizer state: {}",
            fmt(r.activations_bytes),
            fmt(r.gradients_bytes),
            fmt(r.optimizer_state_bytes)
        )?;
        if r.master_weights_bytes > 0 {
            write!(out, "; master weights: {}", fmt(r.master_weights_bytes))?;
        }
        writeln!(out)?;
        let grads = if s.keep_grads {
            "gradients kept by zero_grad(set_to_none=False)"
        } else {
            "gradients freed by zero_grad"
        };
        writeln!(
            out,
            "held between steps: {} (weights, buffers, optimizer state; {grads}); after forward: {}",
            fmt(r.held_between_steps_bytes),
            fmt(r.held_after_forward_bytes)
        )?;
        if let Some(p) = r.accumulating_peak_bytes {
            writeln!(
                out,
                "gradient accumulation: {} micro-batches; micro-batches 2..{} peak at {} with the gradients live",
                s.grad_accum,
                s.grad_accum,
                fmt(p)
            )?;
        }
        if let Some(p) = r.paged_optimizer_state_bytes {
            writeln!(
                out,
                "paged optimizer state: {} in CUDA unified memory (bitsandbytes), outside PyTorch's allocator: not in the peak{}",
                fmt(p),
                if r.budget.is_some() {
                    " nor the budget"
                } else {
                    ""
                }
            )?;
        }
        if let Some(e) = r.ema_bytes {
            writeln!(
                out,
                "EMA copy of the weights: {} (counted with the optimizer state)",
                fmt(e)
            )?;
        }
    } else {
        write!(
            out,
            "live activations at most: {} (activations + temporaries in forward",
            fmt(r.peak_activations_bytes)
        )?;
        if r.kv_cache_bytes > 0 {
            write!(out, "; KV cache apart: {}", fmt(r.kv_cache_bytes))?;
        }
        writeln!(out, ")")?;
    }
    if let Some(g) = &r.generation {
        write!(
            out,
            "generation: prefill peak {}; decode peak {}",
            fmt(g.prefill_peak_bytes),
            fmt(g.decode_peak_bytes)
        )?;
        writeln!(
            out,
            " (last step, {} cached tokens); the {} peaks",
            g.cached_tokens,
            g.peak_phase.title()
        )?;
    }
    write_device(out, r, units)?;
    if let Some(b) = &r.budget {
        let mut what = fmt(b.budget_bytes);
        if let Some(g) = r.gpu.as_ref().filter(|g| g.total_bytes == b.budget_bytes) {
            write!(what, " ({})", g.name)?;
        }
        if r.device_bytes.is_some() {
            write!(what, ", {} figure {}", b.on, fmt(b.checked_bytes))?;
        }
        if b.fits {
            writeln!(
                out,
                "budget: {what}: fits, {} to spare",
                fmt(b.budget_bytes.saturating_sub(b.checked_bytes))
            )?;
        } else {
            write!(out, "budget: {what}: OVER by {}", fmt(b.overshoot_bytes))?;
            if r.search.is_none() {
                write!(
                    out,
                    "; --max-batch finds the largest batch that fits; --checkpoint or a 16-bit --recipe keep less"
                )?;
            }
            writeln!(out)?;
        }
    }
    Ok(())
}

/// On a GPU: what nvidia-smi shows (reserve + CUDA context + cuBLAS workspaces), the card and
/// what PyTorch can use of it, and what the device figure leaves out. Nothing on the CPU.
fn write_device(out: &mut String, r: &Report, units: UnitSystem) -> fmt::Result {
    let fmt = |b: u64| format_bytes(b, units);
    let (Some(device), Some(context), Some(workspace)) =
        (r.device_bytes, r.cuda_context_bytes, r.workspace_bytes)
    else {
        return Ok(());
    };
    let nccl = r.parallel.as_ref().map_or(0, |p| p.nccl_bytes);
    let reserved = device
        .saturating_sub(context)
        .saturating_sub(workspace)
        .saturating_sub(nccl);
    let nccl_term = if nccl > 0 {
        format!(" + {} NCCL buffers (approximate)", fmt(nccl))
    } else {
        String::new()
    };
    writeln!(
        out,
        "on the device (nvidia-smi): {} = {} reserved + {} CUDA context + {} cuBLAS workspaces{nccl_term}",
        fmt(device),
        fmt(reserved),
        fmt(context),
        fmt(workspace)
    )?;
    if let Some(g) = &r.gpu {
        writeln!(
            out,
            "gpu: {} (compute capability {}): {} total, {} usable by PyTorch after the context and workspaces",
            g.name,
            g.compute_capability,
            fmt(g.total_bytes),
            fmt(g.usable_bytes)
        )?;
    }
    let reserve = if r.reserved_peak_bytes.is_some() {
        "the caching allocator's reserve"
    } else {
        "the tensors (the caching allocator is not modelled here: reserved is the tensor peak)"
    };
    // cuDNN's convolution workspaces: counted in the reserve with `--cudnn-workspace`; where the
    // model has convolutions and the flag is not given, the line says how to count them.
    let convs = r.layers.iter().any(|l| {
        matches!(
            l.kind,
            LayerKind::Conv1d
                | LayerKind::Conv2d
                | LayerKind::Conv3d
                | LayerKind::ConvTranspose1d
                | LayerKind::ConvTranspose2d
                | LayerKind::ConvTranspose3d
        )
    });
    let (reserve, cudnn) = match r.settings.cudnn_workspace {
        Some(ws) if convs => (
            format!(
                "{reserve} (with a {} cuDNN workspace at each convolution, as --cudnn-workspace gives it)",
                fmt(ws)
            ),
            "",
        ),
        Some(_) => (reserve.to_string(), ""),
        None if convs => (
            reserve.to_string(),
            "cuDNN convolution workspaces (--cudnn-workspace SIZE counts them), ",
        ),
        None => (reserve.to_string(), "cuDNN convolution workspaces, "),
    };
    if nccl > 0 {
        writeln!(
            out,
            "the device figure counts {reserve}, the CUDA context, cuBLAS workspaces and NCCL's default channel buffers; it leaves out {cudnn}more NCCL channels or communicators than the default, kernels loaded after the context's first use and other processes"
        )
    } else {
        writeln!(
            out,
            "the device figure counts {reserve}, the CUDA context and cuBLAS workspaces; it leaves out {cudnn}NCCL buffers, kernels loaded after the context's first use and other processes"
        )
    }
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
    let weights = match r.settings.quant {
        Some(q) => format!(
            "{} (weights: {} projections, {} elsewhere, averaged over all parameters)",
            per_param(b.weights),
            q.name(),
            rec.weights_dtype
        ),
        None => format!("{} (weights)", per_param(b.weights)),
    };
    let mut terms = vec![weights];
    let note = if r.settings.training() {
        terms.push(format!("{} (grads)", per_param(b.gradients)));
        if rec.master_weights_dtype.is_some() {
            terms.push(format!("{} (master)", per_param(b.master_weights)));
        }
        if let Some(o) = r.settings.optimizer {
            terms.push(format!(
                "{} ({})",
                per_param(b.optimizer_state),
                o.per_param_label()
            ));
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
    let name = match r.settings.quant {
        Some(q) => format!("{} with {} projections", rec.name, q.name()),
        None => rec.name.clone(),
    };
    format!(
        "recipe: {name}: {} = {} bytes/parameter{note}{dtypes}\n",
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
            l.kind.to_string(),
            l.repeat.to_string(),
            l.output_shape.to_string(),
            thousands(l.params),
            format_bytes(l.activation_bytes, units),
            l.kept
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("\n"),
        ]);
    }
    for i in [2, 4, 5] {
        if let Some(col) = table.column_mut(i) {
            col.set_cell_alignment(CellAlignment::Right);
        }
    }
    format!("{table}\n")
}

/// The largest tensors live at the peak (`--explain`); empty without them.
#[must_use]
pub fn explain(r: &Report, units: UnitSystem) -> String {
    let Some(tensors) = &r.explain else {
        return String::new();
    };
    let mut table = Table::new();
    table.load_style(presets::UTF8_FULL_CONDENSED);
    table.set_header(vec![
        "Live at the peak",
        "Layer",
        "Operator",
        "Shape",
        "dtype",
        "Size",
        "×",
        "Total",
        "Category",
    ]);
    for t in tensors {
        table.add_row(vec![
            t.what.clone(),
            t.layer.clone(),
            t.op.unwrap_or("-").to_string(),
            t.shape.to_string(),
            t.dtype.short().to_string(),
            format_bytes(t.bytes, units),
            t.count.to_string(),
            format_bytes(t.total_bytes, units),
            t.category.title().to_string(),
        ]);
    }
    for i in 5..8 {
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
    fn bars_are_ascii_and_scaled() {
        assert_eq!(bar(0, 100), "....................");
        assert_eq!(bar(1, 100), "#...................");
        assert_eq!(bar(50, 100), "##########..........");
        assert_eq!(bar(100, 100), "####################");
        assert_eq!(bar(101, 100), "####################>");
        assert_eq!(bar(0, 0), "....................");
        assert!(bar(u64::MAX - 1, u64::MAX).is_ascii());
    }

    #[test]
    fn per_param_figures_drop_trailing_zeros() {
        assert_eq!(per_param(16.0), "16");
        assert_eq!(per_param(0.0), "0");
        assert_eq!(per_param(2.03125), "2.031");
        assert_eq!(per_param(0.5), "0.5");
        assert_eq!(per_param(10.0 + 1.0 / 3.0), "10.333");
    }
}
