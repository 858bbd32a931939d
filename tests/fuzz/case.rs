//! One fuzz case and the invariants every case must hold, shared by the proptest driver
//! (`tests/fuzz/main.rs`) and the libFuzzer targets (`fuzz/fuzz_targets/`).
//!
//! A case is the text a user could give memest: an optional first line `#!memest <flags>`
//! (command-line flags, split on spaces), then the model description (TOML or JSON, sniffed as
//! for standard input). [`check`] runs it in-process exactly as the binary does: the flags
//! through `memest`'s own clap definition and [`Cli::into_request`], then
//! [`memest::command::execute`] with the case as the input, into buffers. It returns how the
//! case ended or which invariant broke:
//!
//! - no panic (the caller catches it);
//! - exit 0, 1 or 2 only: a usage error is clap's exit 2 (0 for `--help`, `--version`), a
//!   refusal is a typed [`memest::Error`] (exit 2) with a message, never `Error::Internal`, and
//!   the exit status is 1 exactly when a report is over its budget;
//! - `--format json` prints JSON that validates against `schema/report.schema.json` (or
//!   `schema/sweep.schema.json`), and so does every report's JSON in any format;
//! - an estimate's at-peak categories sum to its peak, the total equals the peak, no category at
//!   the peak exceeds its step maximum, the parameter bytes and counts by dtype sum to their
//!   totals, nothing in the JSON is negative, the budget verdict matches the figure it checks;
//! - on CUDA, the tensor peak ≤ `allocated` ≤ `reserved` and `device` = reserved + context +
//!   workspaces (+ NCCL's buffers under several GPUs; no allocator or device figure on the
//!   CPU); with `--gpu`, the budget defaults
//!   to its total and its usable bytes are the total less context and workspaces;
//! - under a multi-GPU plan, the report's model states are the per-GPU ones, none above its
//!   unsharded figure, and the world size is the plan's; with `--grad-accum`, `--paged`,
//!   `--ema` and `--mode generate`, their own figures are present exactly when asked for and
//!   agree with the peak;
//! - one more sample in the micro-batch never lowers the peak, the activations, the input or
//!   the KV cache (or it is refused because a tensor broadcasts against the batch dimension,
//!   as PyTorch would);
//! - `--print-model`'s output, read back, gives the same report.

use std::process::ExitCode;
use std::sync::OnceLock;

use clap::Parser;
use memest::cli::{Cli, Input, OutputFormat, Request};
use memest::hf::Head;
use memest::report::{Dimension, Report};
use memest::spec::{Format, LayerSpec, ModelSpec};
use memest::vocab::Device;
use memest::{Error, Query};

/// The first line of a case that carries flags.
pub const FLAGS_PREFIX: &str = "#!memest";

/// Unrolled layers above which a case is skipped: a large `count` multiplies the work
/// (issue 12, "Never slow, never big"), which the benchmarks cover, not the fuzzer.
pub const MAX_UNROLLED_LAYERS: u64 = 20_000;

/// The most times `--max-batch`/`--max-context` may be asked of a case with many layers (the
/// search runs dozens of estimates).
const MAX_SEARCH_LAYERS: u64 = 2_000;

/// How a case ended when every invariant held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Flags clap or [`Cli::into_request`] refuses (exit 2), or `--help`/`--version` (exit 0).
    Usage,
    /// A typed library error (exit 2).
    Refused,
    /// An estimate that fits the budget, or no budget (exit 0).
    Fits,
    /// An estimate over the budget (exit 1).
    Over,
    /// `--print-model` printed the model (exit 0).
    Printed,
    /// Too many unrolled layers to run quickly (see [`MAX_UNROLLED_LAYERS`]).
    Skipped,
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

/// The path the case's model stands at on the command line (never read: [`check`] gives the
/// case's text as the input).
const MODEL_ARG: &str = "case";

/// `memest case <words>`, resolved by the binary's own clap definition and
/// [`Cli::into_request`].
///
/// # Errors
/// What clap or `into_request` says, with the exit status clap gives it.
pub fn request(words: &[&str]) -> Result<Request, (i32, String)> {
    let argv = ["memest", MODEL_ARG]
        .into_iter()
        .chain(words.iter().copied());
    let cli = Cli::try_parse_from(argv).map_err(|e| (e.exit_code(), e.to_string()))?;
    cli.into_request().map_err(|e| (2, format!("{e:#}")))
}

/// The case's model text as the binary's input.
fn input(src: &str) -> Input {
    Input {
        src: src.to_string(),
        origin: MODEL_ARG.to_string(),
        format: Format::sniff(src),
        name: MODEL_ARG.to_string(),
    }
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

/// A refusal must be typed (never `Error::Internal`), explained, and printed as the binary
/// prints it, with exit 2.
fn check_error(e: &anyhow::Error, what: &str) -> Result<Outcome, String> {
    let typed = e.chain().find_map(|c| {
        c.downcast_ref::<memest::Located>()
            .map(|l| &l.error)
            .or_else(|| c.downcast_ref::<Error>())
    });
    if let Some(Error::Internal(m)) = typed {
        return Err(format!("{what}: internal error: {m}"));
    }
    let mut stderr = Vec::new();
    let code = memest::command::report_error(e, &mut stderr);
    if code != ExitCode::from(2) {
        return Err(format!("{what}: exit {code:?} for the error {e:#}"));
    }
    let text = String::from_utf8_lossy(&stderr);
    let message = text
        .trim()
        .strip_prefix("error:")
        .unwrap_or_default()
        .trim();
    if message.is_empty() {
        return Err(format!("{what}: an error without a message: {e:?}"));
    }
    if std::env::var_os("MEMEST_FUZZ_STATS").is_some() {
        eprintln!("refused: {}", message.chars().take(70).collect::<String>());
    }
    Ok(Outcome::Refused)
}

/// A JSON Schema validator for one of the committed schemas.
fn validator(text: &str) -> jsonschema::Validator {
    let schema: serde_json::Value = serde_json::from_str(text).expect("a committed schema");
    jsonschema::validator_for(&schema).expect("a valid schema")
}

/// `schema/report.schema.json`, compiled once.
fn report_schema() -> &'static jsonschema::Validator {
    static V: OnceLock<jsonschema::Validator> = OnceLock::new();
    V.get_or_init(|| validator(include_str!("../../schema/report.schema.json")))
}

/// `schema/sweep.schema.json`, compiled once.
fn sweep_schema() -> &'static jsonschema::Validator {
    static V: OnceLock<jsonschema::Validator> = OnceLock::new();
    V.get_or_init(|| validator(include_str!("../../schema/sweep.schema.json")))
}

/// `schema/plans.schema.json` (`--plan auto`), compiled once.
fn plans_schema() -> &'static jsonschema::Validator {
    static V: OnceLock<jsonschema::Validator> = OnceLock::new();
    V.get_or_init(|| validator(include_str!("../../schema/plans.schema.json")))
}

fn validate(v: &jsonschema::Validator, what: &str, json: &serde_json::Value) -> Result<(), String> {
    let errors: Vec<String> = v
        .iter_errors(json)
        .take(5)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{what} does not validate against its schema:\n{}",
            errors.join("\n")
        ))
    }
}

/// Runs one case as the binary would and checks every invariant.
///
/// # Errors
/// The invariant that broke, with what the case did.
pub fn check(case: &str) -> Result<Outcome, String> {
    let (words, src) = split(case);
    let req = match request(&words) {
        Ok(req) => req,
        Err((code, message)) => {
            if std::env::var_os("MEMEST_FUZZ_STATS").is_some() {
                eprintln!("usage: {}", message.lines().next().unwrap_or(""));
            }
            return match code {
                0 | 2 => Ok(Outcome::Usage),
                _ => Err(format!("clap exits {code}: {message}")),
            };
        }
    };
    let input = input(src);
    if let Ok(spec) = memest::load_spec(src, input.format, req.head) {
        let layers = unrolled_layers(&spec.layers);
        let searching = req.query.search.is_some() || req.sweep.is_some();
        if layers > MAX_UNROLLED_LAYERS || (searching && layers > MAX_SEARCH_LAYERS) {
            return Ok(Outcome::Skipped);
        }
    }
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let done = match memest::command::execute(&req, &input, &mut stdout, &mut stderr) {
        Ok(done) => done,
        Err(e) => return check_error(&e, "execute"),
    };
    let over = done
        .reports
        .iter()
        .any(|r| r.budget.as_ref().is_some_and(|b| !b.fits));
    let expected = ExitCode::from(u8::from(over));
    let plans_exit = req.plans.is_some() && done.code == ExitCode::from(1);
    if done.code != expected && !plans_exit {
        return Err(format!(
            "exit {:?}, but {} report(s) over the budget",
            done.code,
            if over { "some" } else { "no" }
        ));
    }
    let stdout = String::from_utf8(stdout).map_err(|e| format!("stdout is not UTF-8: {e}"))?;
    String::from_utf8(stderr).map_err(|e| format!("stderr is not UTF-8: {e}"))?;
    if req.print_model {
        return check_printed(src, req.head, &stdout);
    }
    if req.output.format == OutputFormat::Json {
        let json: serde_json::Value = serde_json::from_str(&stdout)
            .map_err(|e| format!("--format json printed no JSON: {e}\n{stdout}"))?;
        if req.plans.is_some() {
            validate(plans_schema(), "--format json (--plan)", &json)?;
            // Exit 1 exactly when there is a budget and no plan fits it.
            let none_fits = !json["budget_bytes"].is_null()
                && !json["plans"]
                    .as_array()
                    .is_some_and(|ps| ps.iter().any(|p| p["fits"] == true));
            if done.code != ExitCode::from(u8::from(none_fits)) {
                return Err(format!(
                    "--plan exits {:?} (none fits: {none_fits})",
                    done.code
                ));
            }
        } else if req.sweep.is_some() {
            validate(sweep_schema(), "--format json (a sweep)", &json)?;
        } else {
            validate(report_schema(), "--format json", &json)?;
        }
    }
    if req.plans.is_some() {
        return Ok(if done.code == ExitCode::from(1) {
            Outcome::Over
        } else {
            Outcome::Fits
        });
    }
    let query = &req.query;
    if let Some(sweep) = &req.sweep {
        check_sweep(&done.reports, query, sweep)?;
    } else {
        let [report] = done.reports.as_slice() else {
            return Err(format!("{} reports for one estimate", done.reports.len()));
        };
        check_report(report, query)?;
        let spec = memest::load_spec(src, input.format, req.head)
            .map_err(|e| format!("the model estimated but does not load again: {e}"))?;
        if query.search.is_none() {
            check_monotone_in_batch(&spec, query, report)?;
        }
        check_round_trip(&spec, query, report)?;
    }
    Ok(if over { Outcome::Over } else { Outcome::Fits })
}

/// `--print-model`'s output reads back, and estimates as the model it came from.
fn check_printed(src: &str, head: Head, printed: &str) -> Result<Outcome, String> {
    let back = memest::load_spec(printed, Format::Toml, Head::Auto)
        .map_err(|e| format!("--print-model output does not read back: {e}\n{printed}"))?;
    let spec = memest::load_spec(src, Format::sniff(src), head)
        .map_err(|e| format!("the model printed but does not load again: {e}"))?;
    let query = Query::default();
    match (
        memest::run(&spec, MODEL_ARG, &query),
        memest::run(&back, MODEL_ARG, &query),
    ) {
        (Ok(a), Ok(b)) if a.to_json().ok() != b.to_json().ok() => Err(format!(
            "--print-model output estimates differently\n{printed}"
        )),
        (Ok(_), Err(e)) => Err(format!(
            "--print-model output does not estimate: {e}\n{printed}"
        )),
        (Err(e), Ok(_)) => Err(format!(
            "--print-model output estimates where the model is refused ({e})\n{printed}"
        )),
        _ => Ok(Outcome::Printed),
    }
}

/// Every report of a sweep holds the invariants, one per value, in order.
fn check_sweep(
    reports: &[Report],
    query: &Query,
    sweep: &memest::sweep::Sweep,
) -> Result<(), String> {
    if reports.len() != sweep.values.len() {
        return Err(format!(
            "{} reports for {} values",
            reports.len(),
            sweep.values.len()
        ));
    }
    for (r, &v) in reports.iter().zip(&sweep.values) {
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
        let mut q = query.clone();
        q.search = None;
        check_report(r, &q)?;
    }
    Ok(())
}

/// `a ≤ b`, or what broke.
fn at_most(a: (&str, u64), b: (&str, u64)) -> Result<(), String> {
    if a.1 <= b.1 {
        Ok(())
    } else {
        Err(format!("{} ({}) exceeds {} ({})", a.0, a.1, b.0, b.1))
    }
}

/// `a = b`, or what broke.
fn equal<T: PartialEq + std::fmt::Debug>(a: (&str, T), b: (&str, T)) -> Result<(), String> {
    if a.1 == b.1 {
        Ok(())
    } else {
        Err(format!(
            "{} ({:?}) differs from {} ({:?})",
            a.0, a.1, b.0, b.1
        ))
    }
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
        at.comm_buffers_bytes,
    ];
    let sum = parts.iter().try_fold(0u64, |s, &p| s.checked_add(p));
    if sum != Some(r.peak_bytes) {
        return Err(format!(
            "the at-peak categories {parts:?} sum to {sum:?}, not the peak {}",
            r.peak_bytes
        ));
    }
    equal(("total_bytes", r.total_bytes), ("peak_bytes", r.peak_bytes))?;
    let by_dtype = r
        .parameters_by_dtype
        .values()
        .try_fold(0u64, |s, &b| s.checked_add(b));
    let count_by_dtype = r
        .param_count_by_dtype
        .values()
        .try_fold(0u64, |s, &b| s.checked_add(b));
    equal(
        ("param_count_by_dtype's sum", count_by_dtype),
        ("param_count", Some(r.param_count)),
    )?;
    if r.parallel.is_none() {
        equal(
            ("parameters_by_dtype's sum", by_dtype),
            ("parameters_bytes", Some(r.parameters_bytes)),
        )?;
    }
    at_most(
        ("trainable_param_count", r.trainable_param_count),
        ("param_count", r.param_count),
    )?;
    at_most(
        ("held_between_steps_bytes", r.held_between_steps_bytes),
        ("peak_bytes", r.peak_bytes),
    )?;
    at_most(
        ("held_after_forward_bytes", r.held_after_forward_bytes),
        ("peak_bytes", r.peak_bytes),
    )?;
    let json = r.to_json().map_err(|e| format!("to_json: {e}"))?;
    let value: serde_json::Value =
        serde_json::from_str(&json).map_err(|e| format!("the JSON report does not parse: {e}"))?;
    validate(report_schema(), "the report's JSON", &value)?;
    for (key, bytes) in value["at_peak"].as_object().ok_or("no at_peak object")? {
        let max = value["category_max"][key].as_u64();
        if bytes.as_u64() > max {
            return Err(format!(
                "{key} at the peak ({bytes}) exceeds its step maximum ({max:?})"
            ));
        }
    }
    non_negative(&value, "")?;
    check_device(r, query)?;
    check_training_loop(r)?;
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
        if query.search.is_none() {
            equal(
                ("the budget", Some(b.budget_bytes)),
                ("the one asked for", query.budget),
            )?;
        }
    } else if query.budget.is_some() {
        return Err("a budget was given and the report has no verdict".into());
    }
    if let (Some(s), Some(budget)) = (&r.search, query.budget) {
        if s.budget_bytes != budget {
            return Err(format!(
                "the search ran under {} not {budget}",
                s.budget_bytes
            ));
        }
        let checked = r.budget.as_ref().map_or(r.total_bytes, |b| b.checked_bytes);
        if s.largest.is_some() && checked > budget {
            return Err(format!(
                "the search's answer {:?} does not fit: {checked} > {budget}",
                s.largest
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
        let svg = memest::render::svg::timeline(r, memest::units::UnitSystem::Iec)
            .ok_or("a timeline without its SVG")?;
        roxmltree::Document::parse(&svg).map_err(|e| format!("the timeline SVG: {e}"))?;
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
    for units in [
        memest::units::UnitSystem::Iec,
        memest::units::UnitSystem::Si,
    ] {
        let _ = memest::render::summary(r, units);
        let _ = memest::render::per_layer(r, units);
        let _ = memest::render::explain(r, units);
        let _ = memest::render::markdown::summary(r, units);
    }
    let _ = memest::render::csv::rows(std::slice::from_ref(r));
    Ok(())
}

/// The allocator and device figures: on CUDA, tensor peak ≤ allocated ≤ reserved and device =
/// reserved + context + workspaces (+ NCCL's buffers under a multi-GPU plan; where the plan's
/// allocator is not modelled, reserved is the tensor peak); none of them on the CPU; `--gpu`'s
/// card.
fn check_device(r: &Report, query: &Query) -> Result<(), String> {
    match r.settings.device {
        Device::Cpu => {
            let any = [
                r.allocated_peak_bytes,
                r.reserved_peak_bytes,
                r.device_bytes,
                r.cuda_context_bytes,
                r.workspace_bytes,
            ];
            if any.iter().any(Option::is_some) || r.gpu.is_some() {
                return Err(format!("a CPU report with GPU figures: {any:?}"));
            }
        }
        Device::Cuda => {
            let (Some(device), Some(context), Some(workspace)) =
                (r.device_bytes, r.cuda_context_bytes, r.workspace_bytes)
            else {
                return Err("a CUDA report without its device figures".into());
            };
            let reserved = match (r.allocated_peak_bytes, r.reserved_peak_bytes) {
                (Some(allocated), Some(reserved)) => {
                    // Every tensor is a block of at least its size, so the allocator's peak
                    // is at least the tensor peak: on CUDA both count device tensors only (a
                    // torch.optim optimizer's host `step` counters are in neither).
                    at_most(
                        ("peak_bytes", r.peak_bytes),
                        ("allocated_peak_bytes", allocated),
                    )?;
                    at_most(
                        ("allocated_peak_bytes", allocated),
                        ("reserved_peak_bytes", reserved),
                    )?;
                    // Segments and pages are whole 2 MiB units (kSmallBuffer, kRoundLarge).
                    if reserved % (2 << 20) != 0 {
                        return Err(format!(
                            "reserved_peak_bytes {reserved} is not in 2 MiB units"
                        ));
                    }
                    reserved
                }
                (None, None) if r.parallel.is_some() => r.peak_bytes,
                other => return Err(format!("allocated and reserved peaks {other:?}")),
            };
            // Under a plan of several GPUs, NCCL's buffers too.
            let nccl = r.parallel.as_ref().map_or(0, |p| p.nccl_bytes);
            let sum = reserved
                .checked_add(context)
                .and_then(|b| b.checked_add(workspace))
                .and_then(|b| b.checked_add(nccl));
            equal(
                ("device_bytes", Some(device)),
                ("reserved + context + workspaces + NCCL", sum),
            )?;
            if let Some(c) = query.overrides.cuda_context {
                equal(("cuda_context_bytes", context), ("--cuda-context", c))?;
            }
            if let Some(g) = &r.gpu {
                let usable = g
                    .total_bytes
                    .saturating_sub(context)
                    .saturating_sub(workspace);
                equal(
                    ("the GPU's usable bytes", g.usable_bytes),
                    ("total - context - workspaces", usable),
                )?;
            }
        }
    }
    equal(
        (
            "the GPU in the report",
            r.gpu.as_ref().map(|g| g.name.as_str()),
        ),
        ("--gpu", query.overrides.gpu.map(|g| g.id.as_str())),
    )?;
    Ok(())
}

/// The training loop's own figures (multi-GPU plan, `--grad-accum`, `--paged`, `--ema`,
/// `--mode generate`) are present exactly when asked for and agree with the rest.
fn check_training_loop(r: &Report) -> Result<(), String> {
    let s = &r.settings;
    if let Some(p) = &r.parallel {
        let plan = s
            .parallel
            .as_ref()
            .ok_or("a parallel report without a plan")?;
        equal(("world_size", p.world_size), ("--gpus", plan.gpus))?;
        let ranks = p
            .data_parallel
            .checked_mul(plan.tp)
            .and_then(|n| n.checked_mul(plan.pp))
            .and_then(|n| n.checked_mul(plan.cp));
        equal(("dp · tp · pp · cp", ranks), ("--gpus", Some(plan.gpus)))?;
        let (u, g) = (&p.unsharded, &p.per_gpu);
        // DeepSpeed keeps float32 optimizer state and gradient partitions under a 16-bit
        // recipe (and float32 master partitions even of 16-bit trainable weights), so only its
        // parameters are bounded by one GPU's figures. FSDP2 under a `mixed-*` recipe keeps
        // float32 shards that are the parameters and the master weights at once
        // (`MixedPrecisionPolicy`), and casts their gradients to float32 after the
        // reduce-scatter: its parameters and master weights are bounded together, and only they.
        let zero = matches!(plan.sharding, memest::parallel::Sharding::Zero(_));
        let fsdp_float32_shards = matches!(plan.sharding, memest::parallel::Sharding::Fsdp(_))
            && u.master_weights_bytes > 0
            && g.master_weights_bytes == 0;
        let states = [
            if fsdp_float32_shards {
                (
                    "parameters and master weights",
                    g.parameters_bytes.saturating_add(g.master_weights_bytes),
                    u.parameters_bytes.saturating_add(u.master_weights_bytes),
                )
            } else {
                ("parameters", g.parameters_bytes, u.parameters_bytes)
            },
            ("gradients", g.gradients_bytes, u.gradients_bytes),
            (
                "optimizer state",
                g.optimizer_state_bytes,
                u.optimizer_state_bytes,
            ),
        ];
        for (name, per_gpu, whole) in
            states
                .into_iter()
                .take(if zero || fsdp_float32_shards { 1 } else { 3 })
        {
            at_most(
                (&format!("per-GPU {name}"), per_gpu),
                (&format!("unsharded {name}"), whole),
            )?;
        }
        equal(
            ("per-GPU parameters", g.parameters_bytes),
            ("parameters_bytes", r.parameters_bytes),
        )?;
        equal(
            ("per-GPU gradients", g.gradients_bytes),
            ("gradients_bytes", r.gradients_bytes),
        )?;
        equal(
            ("per-GPU optimizer state", g.optimizer_state_bytes),
            ("optimizer_state_bytes", r.optimizer_state_bytes),
        )?;
        equal(
            ("per-GPU master weights", g.master_weights_bytes),
            ("master_weights_bytes", r.master_weights_bytes),
        )?;
        equal(
            ("comm_buffers_bytes", p.comm_buffers_bytes),
            (
                "category_max.comm_buffers_bytes",
                r.category_max.comm_buffers_bytes,
            ),
        )?;
    } else if s.parallel.is_some() || r.at_peak.comm_buffers_bytes != 0 {
        return Err("a multi-GPU plan (or its buffers) without its parallel report".into());
    }
    match (s.grad_accum > 1 && s.training(), r.accumulating_peak_bytes) {
        (true, Some(a)) => at_most(("accumulating_peak_bytes", a), ("peak_bytes", r.peak_bytes))?,
        (false, None) => {}
        (asked, got) => {
            return Err(format!(
                "--grad-accum {} (training: {}) gives accumulating_peak_bytes {got:?} ({asked})",
                s.grad_accum,
                s.training()
            ));
        }
    }
    equal(
        (
            "paged_optimizer_state_bytes present",
            r.paged_optimizer_state_bytes.is_some(),
        ),
        ("--paged", s.paged),
    )?;
    equal(
        ("ema_bytes present", r.ema_bytes.is_some()),
        ("--ema", s.ema.is_some()),
    )?;
    if let Some(g) = &r.generation {
        let peak = g.prefill_peak_bytes.max(g.decode_peak_bytes);
        equal(
            ("the generation's larger peak", peak),
            ("peak_bytes", r.peak_bytes),
        )?;
        equal(("prompt_tokens", Some(g.prompt_tokens)), ("seq", s.seq))?;
        equal(
            ("new_tokens", Some(g.new_tokens)),
            ("--new-tokens", s.new_tokens.or(Some(g.new_tokens))),
        )?;
        let most = g
            .prompt_tokens
            .saturating_add(g.new_tokens)
            .saturating_sub(1);
        at_most(
            ("cached_tokens", g.cached_tokens),
            ("prompt + new - 1", most),
        )?;
        equal(
            ("no decode step", g.decode_peak_bytes == 0),
            ("new_tokens = 1", g.new_tokens == 1),
        )?;
    }
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
    // Under `--mode generate` the report is the peaking phase's (prefill or the last decode
    // step), and which one peaks may change with the batch: then only the peak, and each
    // phase's own peak, are compared.
    let phase = |r: &Report| r.generation.as_ref().map(|g| g.peak_phase);
    let compared = if phase(small) == phase(&large) { 5 } else { 1 };
    let phases = |r: &Report| {
        r.generation
            .as_ref()
            .map_or([0, 0], |g| [g.prefill_peak_bytes, g.decode_peak_bytes])
    };
    for (key, a, b) in [
        ("prefill_peak_bytes", phases(small)[0], phases(&large)[0]),
        ("decode_peak_bytes", phases(small)[1], phases(&large)[1]),
    ] {
        if b < a {
            return Err(format!(
                "{key} went down from {a} at batch {} to {b} at batch {batch}",
                batch - 1
            ));
        }
    }
    for ((key, a), (_, b)) in figures(small)
        .into_iter()
        .zip(figures(&large))
        .take(compared)
    {
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
