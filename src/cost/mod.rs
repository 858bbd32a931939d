//! The cost model: the bytes that follow from plain tensor facts and the run's choices, apart
//! from tracing and replay.
//!
//! - [`optim`]: optimizer state, step temporaries ([`OptimizerImpl`]: `foreach`, for-loop,
//!   fused) and nominal state bytes per parameter.
//! - [`plan`]: the [`OptimizerPlan`] of one step under a recipe (master weights, float32
//!   gradient copies), and the recipe as reported ([`RecipeReport`], [`BytesPerParam`]).
//! - [`recipe`]: precision recipes ([`RecipeName`], [`Recipe`], [`Amp`]) and the bytes per
//!   parameter they imply.
//! - [`quant`]: quantized-weight layouts ([`Quant`]).
//!
//! Everything here takes [`TensorInfo`] (shape, elements, bytes), dtypes and recipes; it knows
//! nothing of the tape, the tracer or the resolved settings, so `trace` and `sim` can depend on
//! it without a cycle.

pub mod optim;
pub mod plan;
pub mod quant;
pub mod recipe;

pub use optim::{Optimizer, OptimizerImpl};
pub use plan::{BytesPerParam, OptimizerPlan, PlanTensor, RecipeReport};
pub use quant::Quant;
pub use recipe::{Amp, Recipe, RecipeId, RecipeName};

/// Plain facts about one tensor, as the cost model needs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorInfo<'a> {
    /// Dimensions, e.g. `[out_features, in_features]`.
    pub shape: &'a [u64],
    /// Elements: the product of `shape`.
    pub numel: u64,
    /// Bytes as stored.
    pub bytes: u64,
}
