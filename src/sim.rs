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
//! its `foreach` temporaries.

use std::collections::HashMap;

use serde::Serialize;

use crate::settings::Settings;
use crate::trace::{StorageKind, Tape};

/// Categories of live memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    /// Parameters.
    Parameters,
    /// Buffers.
    Buffers,
    /// Optimizer state.
    OptimizerState,
    /// Parameter gradients (`.grad`).
    Gradients,
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
    /// All categories in report order.
    pub const ALL: [Category; 8] = [
        Category::Parameters,
        Category::Buffers,
        Category::Gradients,
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
            Category::Gradients => "Gradients",
            Category::Activations => "Activations",
            Category::Temporaries => "Temporaries",
            Category::Input => "Input batch",
            Category::KvCache => "KV cache",
        }
    }

    const fn index(self) -> usize {
        match self {
            Category::Parameters => 0,
            Category::Buffers => 1,
            Category::Gradients => 2,
            Category::OptimizerState => 3,
            Category::Activations => 4,
            Category::Temporaries => 5,
            Category::Input => 6,
            Category::KvCache => 7,
        }
    }
}

/// Where in the step something happens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
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
    pub peak_layer: Option<usize>,
    /// Bytes per category at the peak (indexed like [`Category::ALL`]).
    pub at_peak: [u64; 8],
    /// Each category's own maximum over the step.
    pub category_max: [u64; 8],
    /// Bytes saved for backward, each storage once, parameters and the input batch excluded.
    pub saved_bytes: u64,
    /// Saved bytes attributed to the first layer that saves each storage.
    pub saved_by_layer: Vec<u64>,
    /// Largest total of live activations (saved or not, KV cache included) at any moment.
    pub peak_live_activations: u64,
    /// Parameter gradient bytes.
    pub gradient_bytes: u64,
    /// Optimizer state bytes (moments and scalar step counters).
    pub optimizer_state_bytes: u64,
    /// Optimizer-step temporaries.
    pub optimizer_temp_bytes: u64,
}

struct State<'a> {
    tape: &'a Tape,
    live: Vec<bool>,
    cur: [u64; 8],
    peak: u64,
    peak_phase: Phase,
    peak_layer: Option<usize>,
    at_peak: [u64; 8],
    max: [u64; 8],
    live_act_max: u64,
    /// Category an Activation storage counts in while live.
    act_cat: Vec<Category>,
}

impl State<'_> {
    fn category(&self, s: usize) -> Category {
        match self.tape.storages[s].kind {
            StorageKind::Parameter => Category::Parameters,
            StorageKind::Buffer => Category::Buffers,
            StorageKind::Input => Category::Input,
            StorageKind::KvCache => Category::KvCache,
            StorageKind::Activation => self.act_cat[s],
        }
    }

    fn alloc(&mut self, s: usize) {
        if !self.live[s] {
            self.live[s] = true;
            let c = self.category(s).index();
            self.cur[c] += self.tape.storages[s].bytes;
        }
    }

    fn free(&mut self, s: usize) {
        if self.live[s] {
            self.live[s] = false;
            let c = self.category(s).index();
            self.cur[c] -= self.tape.storages[s].bytes;
        }
    }

    fn check(&mut self, phase: Phase, layer: Option<usize>) {
        let total: u64 = self.cur.iter().sum();
        for (m, c) in self.max.iter_mut().zip(self.cur) {
            *m = (*m).max(c);
        }
        if phase == Phase::Forward {
            let acts = self.cur[Category::Activations.index()]
                + self.cur[Category::Temporaries.index()]
                + self.cur[Category::KvCache.index()];
            self.live_act_max = self.live_act_max.max(acts);
        }
        if total > self.peak {
            self.peak = total;
            self.peak_phase = phase;
            self.peak_layer = layer;
            self.at_peak = self.cur;
        }
    }
}

/// Simulates one step of the traced model.
#[must_use]
#[allow(clippy::too_many_lines)] // the three phases read best in one place
pub fn simulate(tape: &Tape, settings: &Settings) -> Simulation {
    let n_storages = tape.storages.len();
    let training = settings.training();
    // Liveness facts per storage.
    let mut last_use = vec![0usize; n_storages];
    let mut saved_fwd = vec![false; n_storages];
    let mut saved_any = vec![false; n_storages];
    let mut bwd_free_at = vec![usize::MAX; n_storages];
    let mut held = vec![false; n_storages];
    for &s in &tape.held {
        held[s] = true;
    }
    for (i, step) in tape.steps.iter().enumerate() {
        let touched = step.allocs.iter().copied().chain(
            step.inputs
                .iter()
                .chain(&step.outputs)
                .map(|&v| tape.values[v].storage),
        );
        for s in touched {
            last_use[s] = last_use[s].max(i);
        }
        for &s in &step.saves {
            saved_any[s] = true;
            if step.segment.is_none() {
                saved_fwd[s] = true;
            }
            bwd_free_at[s] = bwd_free_at[s].min(i);
        }
    }
    for seg in &tape.segments {
        saved_fwd[seg.input] = true;
        saved_any[seg.input] = true;
        bwd_free_at[seg.input] = bwd_free_at[seg.input].min(seg.start);
    }
    let act_cat: Vec<Category> = (0..n_storages)
        .map(|s| {
            if saved_fwd[s] || held[s] {
                Category::Activations
            } else {
                Category::Temporaries
            }
        })
        .collect();

    // Saved bytes, each storage once, attributed to the first layer that saves it.
    let mut saved_by_layer = vec![0u64; tape.layers.len()];
    let mut counted = vec![false; n_storages];
    let mut saved_bytes = 0u64;
    for step in &tape.steps {
        let keep = step
            .saves
            .iter()
            .copied()
            .filter(|_| step.segment.is_none());
        for s in keep {
            let st = &tape.storages[s];
            if st.kind == StorageKind::Activation && !counted[s] {
                counted[s] = true;
                saved_bytes += st.bytes;
                saved_by_layer[step.layer] += st.bytes;
            }
        }
    }
    // Checkpoint inputs saved outside any step's own saves.
    for seg in &tape.segments {
        let s = seg.input;
        if tape.storages[s].kind == StorageKind::Activation && !counted[s] {
            counted[s] = true;
            saved_bytes += tape.storages[s].bytes;
            saved_by_layer[tape.storages[s].layer] += tape.storages[s].bytes;
        }
    }

    let trainable_bytes: u64 = tape
        .params
        .iter()
        .filter(|p| p.trainable)
        .map(|p| p.bytes)
        .sum();
    let trainable_tensors = tape.params.iter().filter(|p| p.trainable).count() as u64;
    let (optimizer_state_bytes, optimizer_temp_bytes) = match settings.optimizer {
        Some(o) if training => (
            o.states_per_param() * trainable_bytes + o.scalar_state_bytes() * trainable_tensors,
            o.step_temporaries_per_param() * trainable_bytes,
        ),
        _ => (0, 0),
    };

    let mut st = State {
        tape,
        live: vec![false; n_storages],
        cur: [0; 8],
        peak: 0,
        peak_phase: Phase::Forward,
        peak_layer: None,
        at_peak: [0; 8],
        max: [0; 8],
        live_act_max: 0,
        act_cat,
    };
    for (s, storage) in tape.storages.iter().enumerate() {
        if matches!(storage.kind, StorageKind::Parameter | StorageKind::Buffer)
            || (storage.kind == StorageKind::Input && storage.what == "input batch")
        {
            st.alloc(s);
        }
    }
    // Labels exist from the start of the step too.
    for (s, storage) in tape.storages.iter().enumerate() {
        if storage.kind == StorageKind::Input {
            st.alloc(s);
        }
    }
    st.cur[Category::OptimizerState.index()] = optimizer_state_bytes;
    st.check(Phase::Forward, None);

    // Forward.
    for (i, step) in tape.steps.iter().enumerate() {
        for &s in &step.allocs {
            st.alloc(s);
        }
        st.check(Phase::Forward, Some(step.layer));
        let candidates = step.allocs.iter().copied().chain(
            step.inputs
                .iter()
                .chain(&step.outputs)
                .map(|&v| tape.values[v].storage),
        );
        for s in candidates.collect::<Vec<_>>() {
            let free = tape.storages[s].kind == StorageKind::Activation
                && last_use[s] <= i
                && !(training && saved_fwd[s])
                && !held[s];
            if free {
                st.free(s);
            }
        }
    }

    let mut gradient_bytes = 0u64;
    if training {
        // Backward.
        let mut grads: HashMap<usize, u64> = HashMap::new();
        let mut param_done = vec![false; tape.values.len()];
        let seg_by_end: HashMap<usize, usize> = tape
            .segments
            .iter()
            .enumerate()
            .map(|(i, s)| (s.end, i))
            .collect();
        for i in (0..tape.steps.len()).rev() {
            if let Some(&g) = seg_by_end.get(&(i + 1)) {
                let seg = &tape.segments[g];
                for j in seg.start..seg.end {
                    let step = &tape.steps[j];
                    for &s in &step.allocs {
                        if !st.live[s] {
                            st.act_cat[s] = if saved_any[s] {
                                Category::Activations
                            } else {
                                Category::Temporaries
                            };
                            st.alloc(s);
                        }
                    }
                    st.check(Phase::Backward, Some(step.layer));
                    let candidates: Vec<usize> = step
                        .allocs
                        .iter()
                        .copied()
                        .chain(
                            step.inputs
                                .iter()
                                .chain(&step.outputs)
                                .map(|&v| tape.values[v].storage),
                        )
                        .collect();
                    for s in candidates {
                        if tape.storages[s].kind == StorageKind::Activation
                            && last_use[s] <= j
                            && !saved_any[s]
                            && !held[s]
                            && !saved_fwd[s]
                        {
                            st.free(s);
                        }
                    }
                }
            }
            let step = &tape.steps[i];
            let mut transient = 0u64;
            let mut moved: Option<u64> = None;
            if step.view_grad {
                moved = Some(step.outputs.iter().filter_map(|o| grads.remove(o)).sum());
            }
            let temp = Category::Temporaries.index();
            for &v in &step.grads {
                let val = &tape.values[v];
                let numel = val.shape.numel().unwrap_or(0);
                let bytes = val.dtype.bytes_for(numel).unwrap_or(0);
                if val.param {
                    if param_done[v] {
                        transient += bytes;
                    } else {
                        param_done[v] = true;
                        gradient_bytes += bytes;
                        st.cur[Category::Gradients.index()] += bytes;
                    }
                } else if let Some(m) = moved.take() {
                    *grads.entry(v).or_insert(0) += m;
                } else if let std::collections::hash_map::Entry::Vacant(e) = grads.entry(v) {
                    e.insert(bytes);
                    st.cur[temp] += bytes;
                } else {
                    transient += bytes;
                }
            }
            if let Some(m) = moved {
                // Nothing took the view: the gradient dies here.
                st.cur[temp] -= m;
            }
            st.cur[temp] += transient;
            st.check(Phase::Backward, Some(step.layer));
            st.cur[temp] -= transient;
            if !step.view_grad {
                for o in &step.outputs {
                    if let Some(b) = grads.remove(o) {
                        st.cur[temp] -= b;
                    }
                }
            }
            for &s in &step.saves {
                if bwd_free_at[s] == i
                    && !held[s]
                    && tape.storages[s].kind == StorageKind::Activation
                {
                    st.free(s);
                }
            }
            if let Some(seg) = tape.segments.iter().find(|seg| seg.start == i) {
                let s = seg.input;
                if bwd_free_at[s] == i
                    && !held[s]
                    && tape.storages[s].kind == StorageKind::Activation
                {
                    st.free(s);
                }
            }
        }
        let leftover: u64 = grads.values().sum();
        st.cur[Category::Temporaries.index()] -= leftover;
        // Optimizer step.
        if optimizer_temp_bytes > 0 {
            st.cur[Category::Temporaries.index()] += optimizer_temp_bytes;
            st.check(Phase::OptimizerStep, None);
            st.cur[Category::Temporaries.index()] -= optimizer_temp_bytes;
        } else {
            st.check(Phase::OptimizerStep, None);
        }
    }

    Simulation {
        peak_bytes: st.peak,
        peak_phase: st.peak_phase,
        peak_layer: st.peak_layer,
        at_peak: st.at_peak,
        category_max: st.max,
        saved_bytes: if training { saved_bytes } else { 0 },
        saved_by_layer: if training {
            saved_by_layer
        } else {
            vec![0; tape.layers.len()]
        },
        peak_live_activations: st.live_act_max,
        gradient_bytes,
        optimizer_state_bytes,
        optimizer_temp_bytes,
    }
}
