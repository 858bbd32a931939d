//! memest estimates the GPU memory of a PyTorch training step or inference pass from a plain
//! model description, before the job runs, with a breakdown a person can check.
//!
//! The pipeline runs one way:
//! file text → [`spec::parse`] (a Hugging Face `config.json`: [`hf::to_spec`]) →
//! [`graph::build`] (validated layers) → [`trace::trace`] (shapes and, per operator, the tensors
//! autograd saves) → [`sim::simulate`] (the step's peak) → [`report::Report`] → [`render`]
//! table, or [`report::Report::to_json`] (its schema: `schema/report.schema.json`).
//!
//! [`run`] answers a [`Query`] (flags, budget, `--max-batch`/`--max-context` search) with one
//! report that carries the search's outcome and the warnings; the `memest` binary only turns
//! its flags into a query and prints. Errors are typed ([`Error`]) and keep where they come
//! from; [`locate`] adds the file (and, for a layer of a TOML file, its line).
//!
//! ```
//! let src = r#"
//! [input]
//! shape = [1000]
//! [[layers]]
//! kind = "linear"
//! out_features = 10
//! "#;
//! let overrides = memest::settings::Overrides { batch: Some(4), ..Default::default() };
//! let report = memest::estimate(src, memest::spec::Format::Toml, "tiny", &overrides, None).unwrap();
//! assert_eq!(report.param_count, 1000 * 10 + 10);
//! assert_eq!(report.parameters_bytes, 4 * 10_010);
//! ```

// `cli.rs`, `output.rs` and `command.rs` name the library `memest::`, as the binary that held
// them did; this lets them keep doing so from inside it.
extern crate self as memest;

pub mod alloc;
pub mod cli;
pub mod command;
pub mod cost;
pub mod dtype;
pub mod error;
pub mod gpu;
pub mod graph;
pub mod hf;
pub mod output;
pub mod parallel;
pub mod print_model;
pub mod render;
pub mod report;
pub mod search;
pub mod settings;
pub mod shape;
pub mod sim;
pub mod spec;
pub mod sweep;
mod symbolic;
pub mod trace;
pub mod units;
pub mod vocab;
pub mod warning;

pub use error::{Error, Located};
pub use report::Report;

/// The largest model description the `memest` binary reads, in bytes (64 MiB): a file or
/// standard input over it is refused before it is read whole. The largest real descriptions
/// (a Hugging Face `config.json`, a flat TOML file of 100,000 layers) are a few MiB.
pub const MAX_INPUT_BYTES: u64 = 64 << 20;

/// `error` as found in `origin`, whose text is `src`: a layer error in a TOML description also
/// gets the line and column where the layer starts.
#[must_use]
pub fn locate(error: Error, origin: &str, src: &str, format: spec::Format) -> Located {
    let position = match (&error, format) {
        (Error::Layer(e), spec::Format::Toml) => spec::toml_layer_position(src, &e.layer.positions),
        _ => None,
    };
    Located {
        position,
        ..error.at(origin)
    }
}

/// What to estimate for a parsed model: the flags' overrides, a budget, and a search for the
/// largest size that fits it.
#[derive(Clone, Debug, Default)]
pub struct Query {
    /// Flags over the file's defaults.
    pub overrides: settings::Overrides,
    /// `--budget`, in bytes.
    pub budget: Option<u64>,
    /// `--max-batch` or `--max-context` (needs `budget`).
    pub search: Option<report::Dimension>,
    /// Warnings found while reading the flags (e.g. from [`settings::Quant::resolve`]); the
    /// report lists them first.
    pub warnings: Vec<report::Warning>,
    /// What to record beside the figures (`--timeline`, `--explain`), at the size reported.
    pub observe: sim::Observe,
    /// `--allow-long-context`: a sequence past the model's `max_positions` neither warns nor
    /// bounds `--max-context`.
    pub allow_long_context: bool,
    /// `--min-gpus`: the parallel flags to resolve at each world size tried (needs `budget`).
    pub min_gpus: Option<parallel::PlanFlags>,
}

/// Estimates `spec` as `query` asks: at the requested size, then, with a search, at the largest
/// size that fits the budget (the report stays at the requested size when nothing fits). The
/// report carries the search's outcome and every warning.
///
/// # Errors
/// As [`estimate_spec`] at the requested size; [`Error::Setting`] for `--max-context` on a model
/// without a `"seq"` input dimension, or a search without a budget.
pub fn run(spec: &spec::ModelSpec, name: &str, query: &Query) -> Result<Report, Error> {
    if let Some(flags) = &query.min_gpus {
        let (outcome, at) = search::min_gpus(spec, name, query, flags)?;
        let q = Query {
            min_gpus: None,
            overrides: at.unwrap_or_else(|| query.overrides.clone()),
            ..query.clone()
        };
        let mut report = run(spec, name, &q)?;
        if let Some(p) = &mut report.parallel {
            p.min_gpus = Some(outcome);
        }
        return Ok(report);
    }
    let o = &query.overrides;
    let observe = if query.search.is_some() {
        sim::Observe::default()
    } else {
        query.observe
    };
    // A search's estimates, the one at the size asked for included, share one prober (the
    // micro-batch's tapes derived from two traces).
    let mut prober = match (query.search, query.budget) {
        (Some(dimension), Some(budget)) => search::Prober::new(spec, name, o, budget, dimension),
        _ => None,
    };
    let mut report = match &mut prober {
        Some(p) => p.at(None)?,
        None => estimate_observed(spec, name, o, query.budget, observe)?,
    };
    let mut search_warnings = Vec::new();
    if let Some(dimension) = query.search {
        let budget = query.budget.ok_or_else(|| {
            Error::setting(
                error::SettingKey::Search,
                "--max-batch and --max-context need a --budget",
            )
        })?;
        let start = match dimension {
            report::Dimension::Batch => report.settings.batch,
            report::Dimension::Context => report.settings.seq.ok_or_else(|| {
                Error::setting(
                    error::SettingKey::Search,
                    "--max-context needs a model with a \"seq\" input dimension",
                )
            })?,
        };
        // The report at the size asked for is the search's estimate at `start`.
        let found = search::max_fitting_with(
            prober.as_mut(),
            (spec, name, o),
            budget,
            dimension,
            (start, Some(&report)),
        );
        let mut largest = found.as_ref().map(|(v, _)| *v);
        if let Some((v, r)) = found {
            report = r;
            if query.observe != sim::Observe::default() {
                let mut at = o.clone();
                match dimension {
                    report::Dimension::Batch => at.batch = Some(v),
                    report::Dimension::Context => at.seq = Some(v),
                }
                report = estimate_observed(spec, name, &at, query.budget, query.observe)?;
            }
        }
        // The search is bounded by the budget alone; the model's trained context caps it after.
        if dimension == report::Dimension::Context
            && !query.allow_long_context
            && let (Some(limit), Some(fits)) = (spec.max_positions, largest)
            && fits > limit
        {
            let at_limit = settings::Overrides {
                seq: Some(limit),
                ..o.clone()
            };
            report = estimate_observed(spec, name, &at_limit, Some(budget), query.observe)?;
            largest = Some(limit);
            search_warnings.push(report::Warning::ContextCappedAtMaxPositions {
                max_positions: limit,
                fits,
            });
        }
        if dimension == report::Dimension::Context
            && let Some(rows) = position_table_rows(&spec.layers)
            && largest == Some(rows)
        {
            search_warnings.push(report::Warning::ContextAtPositionTable {
                num_positions: rows,
            });
        }
        report.search = Some(report::SearchOutcome {
            dimension,
            budget_bytes: budget,
            largest,
        });
    }
    report.warnings.clone_from(&query.warnings);
    report.warnings.extend(search_warnings);
    if let (Some(seq), Some(max_positions)) = (report.settings.seq, spec.max_positions)
        && seq > max_positions
        && !query.allow_long_context
    {
        report
            .warnings
            .push(report::Warning::SeqPastMaxPositions { seq, max_positions });
    }
    if o.attention.is_some() && !has_attention(&spec.layers) {
        report
            .warnings
            .push(report::Warning::AttentionWithoutAttention);
    }
    if o.seq.is_some() && !spec_has_dim(spec, &spec::DimSpec::Seq) {
        report.warnings.insert(0, report::Warning::SeqWithoutSeqDim);
    }
    if o.target_seq.is_some() && !spec_has_dim(spec, &spec::DimSpec::TargetSeq) {
        report.warnings.push(report::Warning::TargetSeqWithoutDim);
    }
    if o.expandable_segments && report.reserved_peak_bytes.is_none() {
        report
            .warnings
            .push(report::Warning::ExpandableSegmentsWithoutAllocator);
    }
    if o.cudnn_workspace.is_some() {
        let cuda = report.settings.device == vocab::Device::Cuda;
        let conv = [
            spec::LayerKind::Conv1d,
            spec::LayerKind::Conv2d,
            spec::LayerKind::Conv3d,
            spec::LayerKind::ConvTranspose1d,
            spec::LayerKind::ConvTranspose2d,
            spec::LayerKind::ConvTranspose3d,
        ]
        .into_iter()
        .any(|k| has_kind(&spec.layers, k));
        if !cuda || !conv {
            report
                .warnings
                .push(report::Warning::CudnnWorkspaceWithoutConvolutions { cuda });
        }
    }
    if o.checkpoint
        && !spec
            .layers
            .iter()
            .any(|l| l.kind == spec::LayerKind::Repeat)
    {
        report
            .warnings
            .push(report::Warning::CheckpointWithoutBlocks);
    }
    Ok(report)
}

/// Estimates `spec` once per value of `sweep`, each as [`run`] with that value as the micro-batch
/// or the sequence length (and no budget search).
///
/// # Errors
/// As [`run`], for the first value that fails.
pub fn run_sweep(
    spec: &spec::ModelSpec,
    name: &str,
    query: &Query,
    sweep: &sweep::Sweep,
) -> Result<report::SweepReport, Error> {
    let reports = sweep
        .values
        .iter()
        .map(|&v| {
            let mut q = query.clone();
            q.search = None;
            q.observe = sim::Observe::default();
            match sweep.dimension {
                report::Dimension::Batch => q.overrides.batch = Some(v),
                report::Dimension::Context => q.overrides.seq = Some(v),
            }
            run(spec, name, &q)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(report::SweepReport {
        dimension: sweep.name(),
        values: sweep.values.clone(),
        sweep: reports,
    })
}

/// The fewest rows of the model's learned position tables (`position_embedding`, inside blocks
/// too), which bound its sequence length; `None` without one.
fn position_table_rows(layers: &[spec::LayerSpec]) -> Option<u64> {
    layers
        .iter()
        .filter_map(|l| {
            let own = (l.kind == spec::LayerKind::PositionEmbedding)
                .then_some(l.num_positions)
                .flatten();
            let inner = l.layers.as_deref().and_then(position_table_rows);
            own.into_iter().chain(inner).min()
        })
        .min()
}

/// Whether any layer (inside blocks too) is of `kind`.
/// A memest file's stand-in for the `hidden_size` the Hugging Face Trainer reads (a config's
/// own is [`spec::ModelSpec::hidden_size`]): the width of its first token embedding, for
/// DeepSpeed sizes left `"auto"`; `None` without one.
fn hidden_size(layers: &[spec::LayerSpec]) -> Option<u64> {
    layers.iter().find_map(|l| {
        if l.kind == spec::LayerKind::Embedding {
            l.embedding_dim
        } else {
            l.layers.as_deref().and_then(hidden_size)
        }
    })
}

fn has_kind(layers: &[spec::LayerSpec], kind: spec::LayerKind) -> bool {
    layers
        .iter()
        .any(|l| l.kind == kind || l.layers.as_deref().is_some_and(|b| has_kind(b, kind)))
}

/// Whether any attention layer (inside blocks too) is causal, as a decoder's are.
fn has_causal_attention(layers: &[spec::LayerSpec]) -> bool {
    layers.iter().any(|l| {
        (l.kind == spec::LayerKind::Attention && l.causal == Some(true))
            || l.kind == spec::LayerKind::Mla
            || l.layers.as_deref().is_some_and(has_causal_attention)
    })
}

/// Whether any layer (inside blocks too) is an attention layer, which `--attention` acts on.
fn has_attention(layers: &[spec::LayerSpec]) -> bool {
    layers.iter().any(|l| {
        matches!(
            l.kind,
            spec::LayerKind::Attention | spec::LayerKind::CrossAttention | spec::LayerKind::Mla
        ) || l.layers.as_deref().is_some_and(has_attention)
    })
}

/// Parses, traces and simulates a model description in one call.
///
/// `name` is the model's name when the file gives none; `budget` (bytes) adds a budget check.
///
/// # Errors
/// Any [`Error`]: a syntax or schema error with its line and column, an invalid layer or shape
/// mismatch naming the layer, an invalid setting, or a size overflow.
pub fn estimate(
    src: &str,
    format: spec::Format,
    name: &str,
    overrides: &settings::Overrides,
    budget: Option<u64>,
) -> Result<Report, Error> {
    let spec = load_spec(src, format, hf::Head::Auto)?;
    estimate_spec(&spec, name, overrides, budget)
}

/// What `memest models` prints: the Hugging Face `model_type`s a `config.json` may name
/// ([`hf::supported`]) and the layer kinds of memest files ([`spec::LayerKind::ALL`]), one
/// comma-separated line each under a heading.
#[must_use]
pub fn models_text() -> String {
    let kinds: Vec<&str> = spec::LayerKind::ALL.iter().map(|k| k.as_str()).collect();
    format!(
        "Hugging Face configs (config.json `model_type`):\n  {}\ndiffusers configs (config.json `_class_name`):\n  {}\nLayer kinds of memest files:\n  {}\n",
        hf::supported().join(", "),
        hf::diffusers_classes().join(", "),
        kinds.join(", ")
    )
}

/// Reads a model description: memest's own file, or a Hugging Face `config.json` (JSON with a
/// top-level `model_type` or `architectures` and no `layers`/`input`, see [`hf::is_hf_config`])
/// translated by [`hf::to_spec`] with the given `head`. A config with Python's `NaN` or
/// `Infinity` is read with those values as `null` ([`hf::python_json`]).
///
/// # Errors
/// A syntax or schema error with its line and column; for a Hugging Face config, an unsupported
/// `model_type` or a missing field; [`Error::Setting`] when `head` is not [`hf::Head::Auto`]
/// and the file is not a Hugging Face config.
pub fn load_spec(
    src: &str,
    format: spec::Format,
    head: hf::Head,
) -> Result<spec::ModelSpec, Error> {
    load_spec_with(src, format, head, None)
}

/// As [`load_spec`], with the image size of `--image` (see [`hf::to_spec_with`]).
///
/// # Errors
/// As [`load_spec`]; [`Error::Setting`] when `image` is given for a memest file or a config
/// that does not read an image size.
pub fn load_spec_with(
    src: &str,
    format: spec::Format,
    head: hf::Head,
    image: Option<hf::ImageSize>,
) -> Result<spec::ModelSpec, Error> {
    let src = src.strip_prefix('\u{feff}').unwrap_or(src);
    if format == spec::Format::Json && !memest_json(src) {
        if let Ok(value) = serde_json::from_str::<serde_json::Value>(src)
            && hf::is_hf_config(&value)
        {
            return hf::to_spec_with(src, head, image);
        }
        // A config Python wrote with `NaN`/`Infinity`: those values read as unset.
        if let Some(text) = hf::python_json(src)
            && let Ok(value) = serde_json::from_str::<serde_json::Value>(&text)
            && hf::is_hf_config(&value)
        {
            return hf::to_spec_with(&text, head, image);
        }
    }
    if image.is_some() {
        return Err(Error::setting(
            error::SettingKey::Image,
            "--image applies only to Hugging Face configs (diffusers UNets, vision and multimodal transformers configs); in a memest model file the input shape gives the image size",
        ));
    }
    if head != hf::Head::Auto {
        return Err(Error::setting(
            error::SettingKey::Head,
            "--head applies only to Hugging Face configs (config.json with `model_type`); this is a memest model file",
        ));
    }
    spec::parse(src, format, graph::kind_keys)
}

/// Whether a JSON document's top level has memest's own `layers` or `input` key, which no
/// Hugging Face config has ([`hf::is_hf_config`]). The values are skipped, not built: a
/// memest file is then parsed once, straight into its spec, rather than first as a whole
/// document (a 100,000-layer file is 100,000 maps). `false` when the text does not read as
/// one JSON object (the full reading then reports why).
fn memest_json(src: &str) -> bool {
    serde_json::from_str::<std::collections::HashMap<String, serde::de::IgnoredAny>>(src)
        .is_ok_and(|top| top.contains_key("layers") || top.contains_key("input"))
}

/// Traces and simulates a parsed description (see [`estimate`]).
///
/// # Errors
/// As [`estimate`], less the syntax errors.
pub fn estimate_spec(
    spec: &spec::ModelSpec,
    name: &str,
    overrides: &settings::Overrides,
    budget: Option<u64>,
) -> Result<Report, Error> {
    estimate_observed(spec, name, overrides, budget, sim::Observe::default())
}

/// [`estimate_spec`], also recording what `observe` asks for ([`Report::timeline`],
/// [`Report::explain`]).
///
/// # Errors
/// As [`estimate_spec`].
pub fn estimate_observed(
    spec: &spec::ModelSpec,
    name: &str,
    overrides: &settings::Overrides,
    budget: Option<u64>,
    observe: sim::Observe,
) -> Result<Report, Error> {
    // `--timeline` and `--explain` need every event of the step: they unroll.
    let repeats = if observe == sim::Observe::default() {
        Repeats::Symbolic
    } else {
        Repeats::Unrolled
    };
    estimate_with(spec, name, overrides, budget, observe, repeats)?.ok_or(Error::Internal(
        "an unrolled estimate always gives a report",
    ))
}

/// How [`estimate_with`] treats a repeated block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Repeats {
    /// Extended from a few copies when it can be ([`symbolic`]), else unrolled.
    Symbolic,
    /// Only extended from a few copies: `None` when that does not apply.
    SymbolicOnly,
    /// Every copy traced and replayed.
    Unrolled,
}

/// Whether the model's first input or one of its named inputs has the dimension `d`.
fn spec_has_dim(spec: &spec::ModelSpec, d: &spec::DimSpec) -> bool {
    spec.input.shape.contains(d) || spec.inputs.values().any(|i| i.shape.contains(d))
}

/// The model and the settings an estimate traces with, as [`estimate_spec`] checks them before
/// tracing (a sequence length without a `"seq"` dimension set to none, `--mode generate`
/// refused for models it does not model).
pub(crate) fn prepare(
    spec: &spec::ModelSpec,
    name: &str,
    overrides: &settings::Overrides,
) -> Result<(graph::Model, settings::Settings), Error> {
    let model = graph::build(spec, name)?;
    let mut settings = settings::Settings::resolve(&model.defaults, overrides)?;
    if let Some(plan) = &mut settings.parallel {
        plan.fill_auto(spec.hidden_size.or_else(|| hidden_size(&spec.layers)))?;
    }
    if !spec_has_dim(spec, &spec::DimSpec::Seq) {
        // Without a "seq" dimension a sequence length sets nothing (a warning says so).
        settings.seq = None;
    }
    if !spec_has_dim(spec, &spec::DimSpec::TargetSeq) {
        settings.target_seq = None;
    }
    if settings.mode == settings::Mode::Generate {
        if has_kind(&spec.layers, spec::LayerKind::CrossAttention)
            || !has_causal_attention(&spec.layers)
        {
            return Err(Error::setting(
                error::SettingKey::Mode,
                "--mode generate models a decoder-only causal LM (causal self-attention, no cross-attention); this model is not one",
            ));
        }
        if has_kind(&spec.layers, spec::LayerKind::MaskedScatter) {
            // transformers runs the vision tower and splices its features in the prefill only
            // (`LlavaForConditionalGeneration.prepare_inputs_for_generation` passes
            // `pixel_values` on the first step); the decode steps read text tokens alone.
            return Err(Error::setting(
                error::SettingKey::Mode,
                "--mode generate is not modelled for image+text models (this one splices image features into the text with `masked_scatter`: LLaVA, Qwen2-VL); estimate the prefill as one inference pass with --mode infer",
            ));
        }
    }
    Ok((model, settings))
}

fn estimate_with(
    spec: &spec::ModelSpec,
    name: &str,
    overrides: &settings::Overrides,
    budget: Option<u64>,
    observe: sim::Observe,
    repeats: Repeats,
) -> Result<Option<Report>, Error> {
    let (mut model, settings) = prepare(spec, name, overrides)?;
    if settings.mode == settings::Mode::Generate {
        // Generation is not extended symbolically.
        if repeats == Repeats::SymbolicOnly {
            return Ok(None);
        }
        return estimate_generate(&model, &settings, budget, observe).map(Some);
    }
    if repeats != Repeats::Unrolled {
        let report = symbolic::estimate(&mut model, &settings, budget);
        if report.is_some() || repeats == Repeats::SymbolicOnly {
            return Ok(report);
        }
    }
    let tape = trace::trace(&model, &settings)?;
    let whole = unsplit(&settings);
    let name = std::mem::take(&mut model.name);
    if whole.is_none() {
        // Nothing reads the layers after the trace: their memory serves the replay's.
        model.layers = Vec::new();
    }
    let mut sim = sim::simulate_observed(&tape, &settings, observe)?;
    if let Some(whole) = whole {
        // Tensor or context parallelism traces one rank's shapes: the model states "before
        // sharding" are those of the model traced whole.
        let tape = trace::trace(&model, &whole)?;
        sim.unsharded = sim::simulate(&tape, &whole)?.unsharded;
    }
    Ok(Some(Report::new(&name, &settings, &tape, &sim, budget)?))
}

/// `settings` without tensor and context parallelism (the data-parallel plan alone), or `None`
/// when they split nothing.
fn unsplit(settings: &settings::Settings) -> Option<settings::Settings> {
    let plan = settings.parallel.as_ref()?;
    if plan.tp <= 1 && plan.cp <= 1 {
        return None;
    }
    let mut whole = settings.clone();
    if let Some(p) = &mut whole.parallel {
        p.gpus = p.data_parallel().unwrap_or(1).saturating_mul(p.pp).max(1);
        p.tp = 1;
        p.cp = 1;
    }
    Some(whole)
}

/// [`estimate_spec`] with every copy of every repeated block traced and replayed: the reference
/// the symbolic treatment of repeats is tested against (the same figures, slower).
///
/// # Errors
/// As [`estimate_spec`].
pub fn estimate_unrolled(
    spec: &spec::ModelSpec,
    name: &str,
    overrides: &settings::Overrides,
    budget: Option<u64>,
) -> Result<Report, Error> {
    estimate_with(
        spec,
        name,
        overrides,
        budget,
        sim::Observe::default(),
        Repeats::Unrolled,
    )?
    .ok_or(Error::Internal(
        "an unrolled estimate always gives a report",
    ))
}

/// The estimate of [`estimate_spec`] extended from a few copies of the model's most repeated
/// block (at least 16 copies), or `None` when that does not apply or its checks fail, where
/// [`estimate_spec`] unrolls. For tests and benchmarks of the symbolic path.
///
/// # Errors
/// A model or setting error found before tracing (as [`estimate_spec`]).
pub fn estimate_symbolic(
    spec: &spec::ModelSpec,
    name: &str,
    overrides: &settings::Overrides,
    budget: Option<u64>,
) -> Result<Option<Report>, Error> {
    estimate_with(
        spec,
        name,
        overrides,
        budget,
        sim::Observe::default(),
        Repeats::SymbolicOnly,
    )
}

/// `--mode generate`: `model.generate` as transformers runs it (`GenerationMixin._sample`): the
/// prefill over the `seq`-token prompt, then `new_tokens - 1` decode steps, of which the last
/// holds the largest cache (`seq + new_tokens - 2` tokens before it, one more after) and so is
/// the decode phase's peak. Each is traced ([`trace::Pass`]) and simulated on its own; the report
/// is the peaking phase's, with both peaks in [`Report::generation`].
fn estimate_generate(
    model: &graph::Model,
    settings: &settings::Settings,
    budget: Option<u64>,
    observe: sim::Observe,
) -> Result<Report, Error> {
    let prompt = settings.seq.ok_or_else(|| {
        Error::setting(
            error::SettingKey::Mode,
            "--mode generate needs a model with a \"seq\" input dimension (token ids)",
        )
    })?;
    let new_tokens = settings.new_tokens.unwrap_or(1);
    let overflow = || Error::Overflow("the generated sequence length".into());
    let cached = prompt
        .checked_add(new_tokens)
        .and_then(|t| t.checked_sub(1))
        .ok_or_else(overflow)?;
    let prefill = trace::trace_pass(model, settings, trace::Pass::Prefill)?;
    let prefill_sim = sim::simulate_observed(&prefill, settings, observe)?;
    let decode = if new_tokens >= 2 {
        let past = cached.checked_sub(1).ok_or_else(overflow)?;
        let tape = trace::trace_pass(model, settings, trace::Pass::Decode { past })?;
        let sim = sim::simulate_observed(&tape, settings, observe)?;
        Some((tape, sim))
    } else {
        None
    };
    let decode_peak = decode.as_ref().map_or(0, |(_, s)| s.peak_bytes);
    let (phase, tape, sim) = match &decode {
        Some((tape, sim)) if decode_peak > prefill_sim.peak_bytes => {
            (report::GenerationPhase::Decode, tape, sim)
        }
        _ => (report::GenerationPhase::Prefill, &prefill, &prefill_sim),
    };
    let mut report = Report::new(&model.name, settings, tape, sim, budget)?;
    let final_tape = decode.as_ref().map_or(&prefill, |(t, _)| t);
    report.kv_cache_bytes = final_tape
        .storages
        .iter()
        .filter(|s| s.kind == trace::StorageKind::KvCache)
        .map(|s| s.bytes)
        .sum();
    report.generation = Some(report::GenerationReport {
        prompt_tokens: prompt,
        new_tokens,
        cached_tokens: cached,
        prefill_peak_bytes: prefill_sim.peak_bytes,
        decode_peak_bytes: decode_peak,
        peak_phase: phase,
    });
    Ok(report)
}
