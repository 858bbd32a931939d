//! memest estimates the GPU memory of a PyTorch training step or inference pass from a plain
//! model description, before the job runs, with a breakdown a person can check.
//!
//! The pipeline runs one way:
//! file text → [`spec::parse`] → [`graph::build`] (validated layers) → [`trace::trace`]
//! (shapes and, per operator, the tensors autograd saves) → [`sim::simulate`] (the step's peak)
//! → [`report::Report`] → [`render`] table or JSON.
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
pub mod render;
pub mod report;
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
    let spec = spec::parse(src, format)?;
    let model = graph::build(&spec, name)?;
    let settings = settings::Settings::resolve(&model.defaults, overrides)?;
    let tape = trace::trace(&model, &settings)?;
    let sim = sim::simulate(&tape, &settings);
    Ok(Report::new(&model.name, &settings, &tape, &sim, budget))
}
