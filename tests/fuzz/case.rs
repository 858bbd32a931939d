//! One fuzz case and the invariants every case must hold, shared by the proptest driver
//! (`tests/fuzz/main.rs`) and the libFuzzer target (`fuzz/fuzz_targets/pipeline.rs`).
//!
//! A case is the text a user could give memest: an optional first line `#!memest <flags>`
//! (command-line flags, split on spaces), then the model description (TOML or JSON, sniffed as
//! for standard input). [`check`] runs it in-process through the library, as the binary does
//! (`memest::load_spec`, then `memest::run`), and returns how it ended or which invariant broke:
//!
//! - no panic (the caller catches it);
//! - a refusal is a typed [`memest::Error`] (exit 2) with a message, never `Error::Internal`,
//!   and [`memest::locate`] places it without panicking;
//! - an estimate's at-peak categories sum to its peak, the total equals the peak, no category at
//!   the peak exceeds its step maximum, the JSON report has only non-negative numbers, the
//!   budget verdict (exit 0 or 1) matches the figures, and the table renders;
//! - one more sample in the micro-batch never lowers the peak, the activations, the input or
//!   the KV cache (or it is refused because a tensor broadcasts against the batch dimension,
//!   as PyTorch would);
//! - `--print-model` (`print_model::to_toml`), read back, gives the same report.

use memest::cost::{Amp, Optimizer, OptimizerImpl, Quant, RecipeName};
use memest::dtype::DType;
use memest::hf::Head;
use memest::report::{Dimension, Report};
use memest::settings::{Lora, Overrides};
use memest::spec::{Format, LayerSpec, ModelSpec};
use memest::units::UnitSystem;
use memest::vocab::{AttentionImpl, Device, Mode, Vocab};
use memest::{Error, Query};

/// The first line of a case that carries flags.
pub const FLAGS_PREFIX: &str = "#!memest";

/// Unrolled layers above which a case is skipped: repeats are unrolled today, so a large
/// `count` costs seconds and gigabytes (issue 12, "Never slow, never big").
pub const MAX_UNROLLED_LAYERS: u64 = 20_000;

/// The most times `--max-batch`/`--max-context` may be asked of a case with many layers (the
/// search runs dozens of estimates).
const MAX_SEARCH_LAYERS: u64 = 2_000;

/// How a case ended when every invariant held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A flag clap would refuse (exit 2).
    Usage,
    /// A typed library error (exit 2).
    Refused,
    /// An estimate that fits the budget, or no budget (exit 0).
    Fits,
    /// An estimate over the budget (exit 1).
    Over,
    /// `--print-model` printed the model (exit 0).
    Printed,
    /// Too many unrolled layers to run quickly today (see [`MAX_UNROLLED_LAYERS`]).
    Skipped,
}

/// The flags of a case, as the command line would resolve them.
#[derive(Clone, Debug, Default)]
pub struct Flags {
    /// Overrides, budget, search and warnings.
    pub query: Query,
    /// `--head`.
    pub head: Head,
    /// `--print-model`.
    pub print_model: bool,
    /// `--sweep`.
    pub sweep: Option<memest::sweep::Sweep>,
}

/// Splits a case into its flags (the words after [`FLAGS_PREFIX`]) and the model text.
#[must_use]
pub fn split(case: &str) -> (Vec<&str>, &str) {
    match case.strip_prefix(FLAGS_PREFIX) {
        Some(rest) => {
            let (line, model) = rest.split_once('\n').unwrap_or((rest, ""));
            (line.split_whitespace().collect(), model)
        }
        None => (Vec::new(), case),
    }
}

/// Joins flags and a model into one case text.
#[must_use]
pub fn join(flags: &[String], model: &str) -> String {
    if flags.is_empty() {
        model.to_string()
    } else {
        format!("{FLAGS_PREFIX} {}\n{model}", flags.join(" "))
    }
}

fn vocab<T: Vocab>(v: &str) -> Result<T, String> {
    T::parse(v).ok_or_else(|| T::unknown(v))
}

fn number(v: &str) -> Result<u64, String> {
    match v.parse::<u64>() {
        Ok(0) => Err("0 is not in 1..".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn dtype(v: &str) -> Result<DType, String> {
    v.parse()
        .map_err(|e: memest::dtype::DTypeParseError| e.to_string())
}

/// Resolves flags as `memest`'s command line does (`src/cli.rs`), or says why clap would
/// refuse them (exit 2).
///
/// # Errors
/// An unknown flag, a missing or invalid value, or a combination clap refuses.
pub fn parse_flags(words: &[&str]) -> Result<Flags, String> {
    let mut o = Overrides::default();
    let mut flags = Flags::default();
    let (mut dtype_flag, mut quant, mut group_size, mut double_quant) = (None, None, None, None);
    let (mut lora_rank, mut lora_targets, mut context) = (None, None, None);
    let (mut max_batch, mut max_context) = (false, false);
    let mut it = words.iter();
    while let Some(&flag) = it.next() {
        let mut value = || it.next().copied().ok_or(format!("{flag} needs a value"));
        match flag {
            "--batch" => o.batch = Some(number(value()?)?),
            "--seq" => o.seq = Some(number(value()?)?),
            "--context" => context = Some(number(value()?)?),
            "--optim" => o.optimizer = Some(vocab::<Optimizer>(value()?)?),
            "--optim-impl" => o.optimizer_impl = Some(vocab::<OptimizerImpl>(value()?)?),
            "--mode" => o.mode = Some(vocab::<Mode>(value()?)?),
            "--attention" => o.attention = Some(vocab::<AttentionImpl>(value()?)?),
            "--amp" => o.amp = Some(vocab::<Amp>(value()?)?),
            "--recipe" => o.recipe = Some(vocab::<RecipeName>(value()?)?),
            "--device" => o.device = Some(vocab::<Device>(value()?)?),
            "--checkpoint" => o.checkpoint = true,
            "--dtype" => {
                let v = value()?;
                match v.parse::<Quant>() {
                    Ok(q) => quant = Some(q),
                    Err(_) => dtype_flag = Some(dtype(v)?),
                }
            }
            "--kv-dtype" => o.kv_dtype = Some(dtype(value()?)?),
            "--group-size" => group_size = Some(number(value()?)?),
            "--double-quant" => {
                double_quant = Some(match value()? {
                    "true" => true,
                    "false" => false,
                    v => return Err(format!("invalid value `{v}` for --double-quant")),
                });
            }
            "--lora-rank" => lora_rank = Some(number(value()?)?),
            "--lora-targets" => {
                lora_targets = Some(value()?.split(',').map(|t| t.trim().to_string()).collect());
            }
            "--budget" => {
                flags.query.budget =
                    Some(memest::units::parse_size(value()?).map_err(|e| e.to_string())?);
            }
            "--max-batch" => max_batch = true,
            "--max-context" => max_context = true,
            "--head" => {
                flags.head = match value()?.to_ascii_lowercase().as_str() {
                    "auto" => Head::Auto,
                    "none" => Head::None,
                    "lm" => Head::Lm,
                    "classification" => Head::Classification,
                    v => return Err(format!("invalid value `{v}` for --head")),
                };
            }
            "--print-model" => flags.print_model = true,
            "--allow-long-context" => flags.query.allow_long_context = true,
            "--explain" => flags.query.observe.explain = true,
            "--timeline" => flags.query.observe.timeline = true,
            "--sweep" => flags.sweep = Some(value()?.parse().map_err(|e| format!("{e}"))?),
            other => return Err(format!("unexpected argument `{other}`")),
        }
    }
    if context.is_some() && (o.mode.is_some() || o.seq.is_some()) {
        return Err("--context conflicts with --mode and --seq".into());
    }
    if (max_batch || max_context) && flags.query.budget.is_none() {
        return Err("--max-batch and --max-context require --budget".into());
    }
    if max_batch && max_context {
        return Err("--max-batch conflicts with --max-context".into());
    }
    if lora_targets.is_some() && lora_rank.is_none() {
        return Err("--lora-targets requires --lora-rank".into());
    }
    if let Some(n) = context {
        o.seq = Some(n);
        o.mode = Some(Mode::Infer);
    }
    if let Some(rank) = lora_rank {
        let strict = lora_targets.is_some();
        let targets =
            lora_targets.unwrap_or_else(|| Lora::DEFAULT_TARGETS.map(String::from).to_vec());
        o.lora = Some(Lora {
            rank,
            targets,
            strict,
        });
    }
    if quant.is_some() {
        dtype_flag = Some(DType::Bfloat16);
    }
    o.dtype = dtype_flag;
    let (q, warning) = Quant::resolve(quant, group_size, double_quant);
    o.quant = q;
    flags.query.warnings = warning.into_iter().collect();
    flags.query.search = if max_batch {
        Some(Dimension::Batch)
    } else if max_context {
        Some(Dimension::Context)
    } else {
        None
    };
    flags.query.overrides = o;
    Ok(flags)
}

/// The layers `spec` unrolls to (repeats multiplied out), saturating.
#[must_use]
pub fn unrolled_layers(layers: &[LayerSpec]) -> u64 {
    layers.iter().fold(0u64, |n, l| {
        let one = match &l.layers {
            Some(body) => l
                .count
                .unwrap_or(1)
                .saturating_mul(unrolled_layers(body).max(1)),
            None => 1u64.saturating_add(l.experts.unwrap_or(0).saturating_mul(3)),
        };
        n.saturating_add(one)
    })
}

/// A refusal must be typed, explained, and placeable in the file.
fn check_error(e: Error, what: &str, src: &str, format: Format) -> Result<Outcome, String> {
    if let Error::Internal(m) = e {
        return Err(format!("{what}: internal error: {m}"));
    }
    if e.to_string().trim().is_empty() {
        return Err(format!("{what}: an error without a message: {e:?}"));
    }
    if std::env::var_os("MEMEST_FUZZ_STATS").is_some() {
        eprintln!(
            "refused: {}",
            e.to_string().chars().take(70).collect::<String>()
        );
    }
    let located = memest::locate(e, "case", src, format);
    if located.to_string().trim().is_empty() {
        return Err(format!("{what}: a located error without a message"));
    }
    Ok(Outcome::Refused)
}

/// Runs one case through the library and checks every invariant.
///
/// # Errors
/// The invariant that broke, with what the case did.
pub fn check(case: &str) -> Result<Outcome, String> {
    let (words, src) = split(case);
    let flags = match parse_flags(&words) {
        Ok(flags) => flags,
        Err(e) => {
            if std::env::var_os("MEMEST_FUZZ_STATS").is_some() {
                eprintln!("usage: {e}");
            }
            return Ok(Outcome::Usage);
        }
    };
    let format = Format::sniff(src);
    let spec = match memest::load_spec(src, format, flags.head) {
        Ok(spec) => spec,
        Err(e) => return check_error(e, "load_spec", src, format),
    };
    let layers = unrolled_layers(&spec.layers);
    if layers > MAX_UNROLLED_LAYERS || (flags.query.search.is_some() && layers > MAX_SEARCH_LAYERS)
    {
        return Ok(Outcome::Skipped);
    }
    if flags.print_model {
        let printed = memest::print_model::to_toml(&spec)
            .map_err(|e| format!("print_model::to_toml: {e}"))?;
        memest::load_spec(&printed, Format::Toml, Head::Auto)
            .map_err(|e| format!("--print-model output does not read back: {e}\n{printed}"))?;
        return Ok(Outcome::Printed);
    }
    let query = &flags.query;
    if let Some(sweep) = &flags.sweep {
        return check_sweep(&spec, query, sweep, src, format);
    }
    let report = match memest::run(&spec, "case", query) {
        Ok(r) => r,
        Err(e) => return check_error(e, "run", src, format),
    };
    check_report(&report, query)?;
    if query.search.is_none() {
        check_monotone_in_batch(&spec, query, &report)?;
    }
    check_round_trip(&spec, query, &report)?;
    Ok(match &report.budget {
        Some(b) if !b.fits => Outcome::Over,
        _ => Outcome::Fits,
    })
}

/// Every report of a sweep holds the invariants, one per value, in order.
fn check_sweep(
    spec: &ModelSpec,
    query: &Query,
    sweep: &memest::sweep::Sweep,
    src: &str,
    format: Format,
) -> Result<Outcome, String> {
    let swept = match memest::run_sweep(spec, "case", query, sweep) {
        Ok(s) => s,
        Err(e) => return check_error(e, "run_sweep", src, format),
    };
    if swept.sweep.len() != sweep.values.len() {
        return Err(format!(
            "{} reports for {} values",
            swept.sweep.len(),
            sweep.values.len()
        ));
    }
    for (r, &v) in swept.sweep.iter().zip(&sweep.values) {
        let at = match sweep.dimension {
            Dimension::Batch => Some(r.settings.batch),
            Dimension::Context => r.settings.seq,
        };
        // A sequence sweep of a model without a "seq" dimension sets no length, and says so.
        let warned = r
            .warnings
            .contains(&memest::report::Warning::SeqWithoutSeqDim);
        if at != Some(v) && !(at.is_none() && warned) {
            return Err(format!("the sweep's report for {v} is at {at:?}"));
        }
        check_report(r, query)?;
    }
    swept.to_json().map_err(|e| format!("sweep to_json: {e}"))?;
    for units in [UnitSystem::Iec, UnitSystem::Si] {
        let _ = memest::render::sweep(&swept.sweep, sweep, units);
        let _ = memest::render::markdown::sweep(&swept.sweep, sweep, units);
    }
    let _ = memest::render::csv::rows(&swept.sweep);
    let over = swept
        .sweep
        .iter()
        .any(|r| r.budget.as_ref().is_some_and(|b| !b.fits));
    Ok(if over { Outcome::Over } else { Outcome::Fits })
}

/// The figures of one report agree with each other.
fn check_report(r: &Report, query: &Query) -> Result<(), String> {
    let at = &r.at_peak;
    let parts = [
        at.parameters_bytes,
        at.buffers_bytes,
        at.gradients_bytes,
        at.master_weights_bytes,
        at.optimizer_state_bytes,
        at.activations_bytes,
        at.temporaries_bytes,
        at.input_bytes,
        at.kv_cache_bytes,
    ];
    let sum = parts.iter().try_fold(0u64, |s, &p| s.checked_add(p));
    if sum != Some(r.peak_bytes) {
        return Err(format!(
            "the at-peak categories {parts:?} sum to {sum:?}, not the peak {}",
            r.peak_bytes
        ));
    }
    if r.total_bytes != r.peak_bytes {
        return Err(format!(
            "total {} differs from peak {}",
            r.total_bytes, r.peak_bytes
        ));
    }
    let json = r.to_json().map_err(|e| format!("to_json: {e}"))?;
    let value: serde_json::Value =
        serde_json::from_str(&json).map_err(|e| format!("the JSON report does not parse: {e}"))?;
    for (key, bytes) in value["at_peak"].as_object().ok_or("no at_peak object")? {
        let max = value["category_max"][key].as_u64();
        if bytes.as_u64() > max {
            return Err(format!(
                "{key} at the peak ({bytes}) exceeds its step maximum ({max:?})"
            ));
        }
    }
    non_negative(&value, "")?;
    if let Some(b) = &r.budget {
        // The figure checked: the tensor peak (allocated), what nvidia-smi shows (device), or
        // the allocator's reserve between the two.
        use memest::settings::BudgetOn;
        let figure_ok = match b.on {
            BudgetOn::Allocated => {
                b.checked_bytes == r.allocated_peak_bytes.unwrap_or(r.total_bytes)
            }
            BudgetOn::Reserved => b.checked_bytes == r.reserved_peak_bytes.unwrap_or(r.total_bytes),
            BudgetOn::Device => Some(b.checked_bytes) == r.device_bytes,
        };
        let over = b.checked_bytes.saturating_sub(b.budget_bytes);
        if !figure_ok || b.fits != (b.checked_bytes <= b.budget_bytes) || b.overshoot_bytes != over
        {
            return Err(format!(
                "budget verdict {b:?} disagrees with the total {} or the device figure {:?}",
                r.total_bytes, r.device_bytes
            ));
        }
    }
    if let (Some(s), Some(budget)) = (&r.search, query.budget) {
        if s.budget_bytes != budget {
            return Err(format!(
                "the search ran under {} not {budget}",
                s.budget_bytes
            ));
        }
        if s.largest.is_some() && r.total_bytes > budget {
            return Err(format!(
                "the search's answer {:?} does not fit: {} > {budget}",
                s.largest, r.total_bytes
            ));
        }
    }
    if let Some(t) = &r.timeline {
        let peak = t.points.get(t.peak).map(memest::sim::TimePoint::total);
        if peak != Some(r.peak_bytes) {
            return Err(format!(
                "the timeline's peak point {peak:?} is not the peak {}",
                r.peak_bytes
            ));
        }
        if let Some(p) = t.points.iter().find(|p| p.total() > r.peak_bytes) {
            return Err(format!(
                "a timeline point {p:?} is above the peak {}",
                r.peak_bytes
            ));
        }
    }
    if let Some(tensors) = &r.explain {
        let sum = tensors
            .iter()
            .try_fold(0u64, |s, t| s.checked_add(t.total_bytes));
        if sum.is_none_or(|s| s > r.peak_bytes) {
            return Err(format!(
                "--explain lists {sum:?} bytes live at a peak of {}",
                r.peak_bytes
            ));
        }
    }
    for units in [UnitSystem::Iec, UnitSystem::Si] {
        let _ = memest::render::summary(r, units);
        let _ = memest::render::per_layer(r, units);
        let _ = memest::render::explain(r, units);
        let _ = memest::render::markdown::summary(r, units);
    }
    let _ = memest::render::csv::rows(std::slice::from_ref(r));
    Ok(())
}

fn non_negative(v: &serde_json::Value, at: &str) -> Result<(), String> {
    match v {
        serde_json::Value::Number(n) if n.as_f64().is_none_or(|x| x.is_nan() || x < 0.0) => {
            Err(format!("{at} = {n} is negative or not a number"))
        }
        serde_json::Value::Array(xs) => xs
            .iter()
            .enumerate()
            .try_for_each(|(i, x)| non_negative(x, &format!("{at}[{i}]"))),
        serde_json::Value::Object(m) => m
            .iter()
            .try_for_each(|(k, x)| non_negative(x, &format!("{at}.{k}"))),
        _ => Ok(()),
    }
}

/// One more sample never lowers a figure that grows with the batch.
fn check_monotone_in_batch(spec: &ModelSpec, query: &Query, small: &Report) -> Result<(), String> {
    let Some(batch) = small.settings.batch.checked_add(1) else {
        return Ok(());
    };
    let mut q = query.clone();
    q.overrides.batch = Some(batch);
    let large = match memest::run(spec, "case", &q) {
        Ok(r) => r,
        Err(Error::Overflow(_)) => return Ok(()),
        // As in PyTorch, a model that broadcasts a tensor (or a `parameter`) against the
        // batch dimension runs at some batch sizes only (`[1, 3, 4] + [1, 4]` adds,
        // `[2, 3, 4] + [2, 4]` does not).
        Err(Error::Layer(e)) if e.kind.to_string().contains("broadcast") => return Ok(()),
        Err(e) => return Err(format!("batch {batch} fails where {} ran: {e}", batch - 1)),
    };
    let figures = |r: &Report| {
        [
            ("peak_bytes", r.peak_bytes),
            ("activations_bytes", r.activations_bytes),
            ("peak_activations_bytes", r.peak_activations_bytes),
            ("input_bytes", r.input_bytes),
            ("kv_cache_bytes", r.kv_cache_bytes),
        ]
    };
    for ((key, a), (_, b)) in figures(small).into_iter().zip(figures(&large)) {
        if b < a {
            return Err(format!(
                "{key} went down from {a} at batch {} to {b} at batch {batch}",
                batch - 1
            ));
        }
    }
    Ok(())
}

/// `--print-model`'s TOML, read back, estimates the same.
fn check_round_trip(spec: &ModelSpec, query: &Query, report: &Report) -> Result<(), String> {
    let printed =
        memest::print_model::to_toml(spec).map_err(|e| format!("print_model::to_toml: {e}"))?;
    let back = memest::load_spec(&printed, Format::Toml, Head::Auto)
        .map_err(|e| format!("--print-model output does not read back: {e}\n{printed}"))?;
    let again = memest::run(&back, "case", query)
        .map_err(|e| format!("--print-model output does not estimate: {e}\n{printed}"))?;
    let (a, b) = (report.to_json(), again.to_json());
    if a.as_ref().ok() != b.as_ref().ok() {
        return Err(format!(
            "--print-model output estimates differently\n{printed}"
        ));
    }
    Ok(())
}
