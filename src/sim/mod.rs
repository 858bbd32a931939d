//! The simulated step: replays a [`Tape`] allocation by allocation to find the peak.
//!
//! ```text
//!  memory
//!    │            ╭─╮ peak (often: start of backward, or the optimizer step)
//!    │          ╭─╯ ╰╮
//!    │       ╭──╯    ╰──╮           ╭╮ optimizer temporaries
//!    │    ╭──╯ forward:  ╰──╮ backward: saved tensors freed,
//!    │ ╭──╯ saved tensors   ╰───── gradients allocated
//!    │─╯ accumulate
//!    │ parameters + buffers + optimizer state + input batch (always live)
//!    └──────────────────────────────────────────────────────────▶ time
//! ```
//!
//! Steady state is assumed: the optimizer state already exists and the previous step's
//! gradients were freed by `zero_grad(set_to_none=True)`. Forward: each operator allocates its
//! outputs and internals; a tensor is freed after its last use unless autograd saved it or the
//! caller holds it (the model output and the loss stay alive until the step ends, as the
//! measured training loop holds `out`). Backward, in reverse: each operator allocates the
//! gradients of its inputs (parameter gradients persist in `.grad`; activation gradients die when
//! consumed) and then frees what only it had saved. A checkpointed block keeps only its input
//! in forward and recomputes its operators just before its backward. The optimizer step adds
//! its temporaries ([`crate::cost::OptimizerPlan`]).
//!
//! Two parts: `liveness` computes, once and from the tape alone, the per-storage facts (last
//! use in forward, saved for backward, the step whose backward frees it, what each checkpointed
//! segment keeps) and the saved bytes; `replay` walks the step's phases with those facts,
//! tracking live bytes per [`Category`] with checked totals.

mod liveness;
mod replay;

use serde::Serialize;
use typed_index_collections::{TiVec, ti_vec};

use crate::cost::OptimizerPlan;
use crate::error::Error;
use crate::settings::Settings;
use crate::trace::{LayerId, Tape};
use liveness::{Liveness, SavedBytes};
use replay::Replay;

/// Categories of live memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    /// Parameters.
    Parameters,
    /// Buffers.
    Buffers,
    /// Parameter gradients (`.grad`).
    Gradients,
    /// Float32 master copies of 16-bit parameters (`mixed-*` recipes).
    MasterWeights,
    /// Optimizer state.
    OptimizerState,
    /// Tensors saved for backward, and the model output and loss held by the caller.
    Activations,
    /// Everything transient: unsaved intermediates, activation gradients, optimizer-step
    /// temporaries.
    Temporaries,
    /// The input batch and labels.
    Input,
    /// The KV cache of causal attention in inference.
    KvCache,
}

impl Category {
    /// Number of categories.
    pub const COUNT: usize = 9;

    /// All categories in report order.
    pub const ALL: [Category; Category::COUNT] = [
        Category::Parameters,
        Category::Buffers,
        Category::Gradients,
        Category::MasterWeights,
        Category::OptimizerState,
        Category::Activations,
        Category::Temporaries,
        Category::Input,
        Category::KvCache,
    ];

    /// Display name.
    #[must_use]
    pub const fn title(self) -> &'static str {
        match self {
            Category::Parameters => "Parameters",
            Category::Buffers => "Buffers",
            Category::OptimizerState => "Optimizer state",
            Category::MasterWeights => "Master weights",
            Category::Gradients => "Gradients",
            Category::Activations => "Activations",
            Category::Temporaries => "Temporaries",
            Category::Input => "Input batch",
            Category::KvCache => "KV cache",
        }
    }

    /// The key in the JSON report's `at_peak` and `category_max` maps.
    #[must_use]
    pub const fn key(self) -> &'static str {
        match self {
            Category::Parameters => "parameters_bytes",
            Category::Buffers => "buffers_bytes",
            Category::Gradients => "gradients_bytes",
            Category::MasterWeights => "master_weights_bytes",
            Category::OptimizerState => "optimizer_state_bytes",
            Category::Activations => "activations_bytes",
            Category::Temporaries => "temporaries_bytes",
            Category::Input => "input_bytes",
            Category::KvCache => "kv_cache_bytes",
        }
    }

    /// Position in [`Category::ALL`] (the declaration order).
    const fn index(self) -> usize {
        self as usize
    }
}

/// Where in the step something happens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// The forward pass.
    Forward,
    /// The backward pass (including recomputation of checkpointed blocks).
    Backward,
    /// The optimizer step.
    OptimizerStep,
}

impl Phase {
    /// Display name.
    #[must_use]
    pub const fn title(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::OptimizerStep => "optimizer step",
        }
    }
}

/// Result of the simulation.
#[derive(Clone, Debug)]
pub struct Simulation {
    /// Largest total of live bytes.
    pub peak_bytes: u64,
    /// Phase of the peak.
    pub peak_phase: Phase,
    /// Layer (index into [`Tape::layers`]) running at the peak, if any.
    pub peak_layer: Option<LayerId>,
    /// Bytes per category at the peak (indexed like [`Category::ALL`]).
    pub at_peak: [u64; Category::COUNT],
    /// Each category's own maximum over the step.
    pub category_max: [u64; Category::COUNT],
    /// Bytes saved for backward, each storage once, parameters and the input batch excluded.
    pub saved_bytes: u64,
    /// Saved bytes attributed to the first layer that saves each storage.
    pub saved_by_layer: TiVec<LayerId, u64>,
    /// Largest total of live activations in forward, saved, held or transient
    /// ([`Category::Activations`] plus [`Category::Temporaries`]); the KV cache is never in it.
    pub peak_live_activations: u64,
    /// Parameter gradient bytes.
    pub gradient_bytes: u64,
    /// Optimizer state bytes (moments and scalar step counters).
    pub optimizer_state_bytes: u64,
    /// Float32 master weights of a `mixed-*` recipe.
    pub master_weights_bytes: u64,
    /// Optimizer-step temporaries (the `foreach` temporaries, plus the float32 copies of
    /// 16-bit gradients a `mixed-*` recipe hands the optimizer).
    pub optimizer_temp_bytes: u64,
}

/// Simulates one step of the traced model.
///
/// # Errors
/// [`Error::Overflow`] when a memory total does not fit in 64 bits, [`Error::Internal`] when a
/// running total would go below zero (a bug).
pub fn simulate(tape: &Tape, settings: &Settings) -> Result<Simulation, Error> {
    let training = settings.training();
    let facts = Liveness::of(tape);
    let saved = SavedBytes::of(tape, &facts);
    let plan = match settings.optimizer.filter(|_| training) {
        Some(opt) => OptimizerPlan::new(
            opt,
            settings.optimizer_impl,
            &settings.recipe,
            tape.params
                .iter()
                .filter(|p| p.trainable)
                .map(|p| (p.value, p.info(), tape.values[p.value].dtype)),
        ),
        None => OptimizerPlan::default(),
    };
    let mut replay = Replay::new(tape, &facts);
    replay.start(plan.state_bytes, plan.master_bytes);
    replay.forward(training);
    let (mut gradient_bytes, mut optimizer_temp_bytes) = (0, 0);
    if training {
        let param_grad = settings
            .grad_dtype_override()
            .map(|g| (settings.recipe.weights, g));
        let bwd = replay.backward(param_grad);
        gradient_bytes = bwd.gradient_bytes;
        optimizer_temp_bytes = replay.optimizer_step(&plan, &bwd);
    }
    if let Some(e) = replay.error() {
        return Err(e);
    }
    let sums = [
        saved.total,
        gradient_bytes,
        plan.state_bytes,
        plan.master_bytes,
        optimizer_temp_bytes,
    ];
    if sums.contains(&u64::MAX) {
        return Err(Error::Overflow("the memory total of the step".into()));
    }
    Ok(Simulation {
        peak_bytes: replay.peak,
        peak_phase: replay.peak_phase,
        peak_layer: replay.peak_layer,
        at_peak: replay.at_peak,
        category_max: replay.max,
        saved_bytes: if training { saved.total } else { 0 },
        saved_by_layer: if training {
            saved.by_layer
        } else {
            ti_vec![0; tape.layers.len()]
        },
        peak_live_activations: replay.live_act_max,
        gradient_bytes,
        optimizer_state_bytes: plan.state_bytes,
        master_weights_bytes: plan.master_bytes,
        optimizer_temp_bytes,
    })
}

#[cfg(test)]
mod tests;
