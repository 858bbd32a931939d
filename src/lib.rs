//! memest estimates the GPU memory of a PyTorch training step or inference pass from a plain
//! model description, before the job runs, with a breakdown a person can check.
//!
//! The pipeline runs one way:
//! file text → [`spec::parse`] (a Hugging Face `config.json`: [`hf::to_spec`]) →
//! [`graph::build`] (validated layers) → [`trace::trace`] (shapes and, per operator, the tensors
//! autograd saves) → [`sim::simulate`] (the step's peak) → [`report::Report`] → [`render`]
//! table or JSON.
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

pub mod dtype;
pub mod error;
pub mod graph;
pub mod hf;
pub mod print_model;
pub mod render;
pub mod report;
pub mod search;
pub mod settings;
pub mod shape;
pub mod sim;
pub mod spec;
pub mod trace;
pub mod units;

pub use error::Error;
pub use report::Report;

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

/// Reads a model description: memest's own file, or a Hugging Face `config.json` (JSON with a
/// top-level `model_type` or `architectures` and no `layers`/`input`, see [`hf::is_hf_config`])
/// translated by [`hf::to_spec`] with the given `head`.
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
    let src = src.strip_prefix('\u{feff}').unwrap_or(src);
    if format == spec::Format::Json
        && let Ok(value) = serde_json::from_str::<serde_json::Value>(src)
        && hf::is_hf_config(&value)
    {
        return hf::to_spec(&value, head);
    }
    if head != hf::Head::Auto {
        return Err(Error::Setting(
            "--head applies only to Hugging Face configs (config.json with `model_type`); this is a memest model file".into(),
        ));
    }
    spec::parse(src, format)
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
    let model = graph::build(spec, name)?;
    let settings = settings::Settings::resolve(&model.defaults, overrides)?;
    let tape = trace::trace(&model, &settings)?;
    let sim = sim::simulate(&tape, &settings)?;
    Ok(Report::new(&model.name, &settings, &tape, &sim, budget))
}
