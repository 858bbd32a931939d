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

use crate::Error;
use crate::settings::Settings;
use typed_index_collections::{TiVec, ti_vec};

use crate::cost::OptimizerPlan;
use crate::trace::{LayerId, SegmentId, StorageId, StorageKind, Tape, ValueId};

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
    /// Largest total of live activations (saved or not, KV cache included) at any moment.
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

struct State<'a> {
    tape: &'a Tape,
    live: TiVec<StorageId, bool>,
    cur: [u64; Category::COUNT],
    peak: u64,
    peak_phase: Phase,
    peak_layer: Option<LayerId>,
    at_peak: [u64; Category::COUNT],
    max: [u64; Category::COUNT],
    live_act_max: u64,
    /// Category an Activation storage counts in while live.
    act_cat: TiVec<StorageId, Category>,
    /// A running total overflowed 64 bits.
    overflow: bool,
}

impl State<'_> {
    fn category(&self, s: StorageId) -> Category {
        match self.tape.storages[s].kind {
            StorageKind::Parameter => Category::Parameters,
            StorageKind::Buffer => Category::Buffers,
            StorageKind::Input => Category::Input,
            StorageKind::KvCache => Category::KvCache,
            StorageKind::Activation => self.act_cat[s],
        }
    }

    fn alloc(&mut self, s: StorageId) {
        if !self.live[s] {
            self.live[s] = true;
            let c = self.category(s).index();
            self.add(c, self.tape.storages[s].bytes);
        }
    }

    /// Adds to a category's running total; an overflow saturates and is reported at the end.
    fn add(&mut self, c: usize, bytes: u64) {
        match self.cur[c].checked_add(bytes) {
            Some(v) => self.cur[c] = v,
            None => {
                self.cur[c] = u64::MAX;
                self.overflow = true;
            }
        }
    }

    fn free(&mut self, s: StorageId) {
        if self.live[s] {
            self.live[s] = false;
            let c = self.category(s).index();
            self.cur[c] -= self.tape.storages[s].bytes;
        }
    }

    fn check(&mut self, phase: Phase, layer: Option<LayerId>) {
        let total = self
            .cur
            .iter()
            .try_fold(0u64, |a, &c| a.checked_add(c))
            .unwrap_or_else(|| {
                self.overflow = true;
                u64::MAX
            });
        for (m, c) in self.max.iter_mut().zip(self.cur) {
            *m = (*m).max(c);
        }
        if phase == Phase::Forward {
            let acts = self.cur[Category::Activations.index()]
                .saturating_add(self.cur[Category::Temporaries.index()])
                .saturating_add(self.cur[Category::KvCache.index()]);
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
///
/// # Errors
/// [`Error::Overflow`] when a memory total does not fit in 64 bits.
#[allow(clippy::too_many_lines)] // the three phases read best in one place
pub fn simulate(tape: &Tape, settings: &Settings) -> Result<Simulation, Error> {
    let n_storages = tape.storages.len();
    let training = settings.training();
    // Liveness facts per storage.
    let mut last_use: TiVec<StorageId, usize> = ti_vec![0; n_storages];
    let mut saved_fwd: TiVec<StorageId, bool> = ti_vec![false; n_storages];
    let mut bwd_free_at: TiVec<StorageId, usize> = ti_vec![usize::MAX; n_storages];
    let mut held: TiVec<StorageId, bool> = ti_vec![false; n_storages];
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
            if step.segment.is_none() {
                saved_fwd[s] = true;
            }
            bwd_free_at[s] = bwd_free_at[s].min(i);
        }
    }
    // A checkpointed block keeps the tensors it reads from outside (its input, and e.g. the
    // encoder output or a position bias) until its backward: reentrant checkpointing saves the
    // block's tensor arguments.
    let seg_inputs: TiVec<SegmentId, Vec<StorageId>> = tape
        .segments
        .iter()
        .map(|seg| {
            let steps = &tape.steps[seg.start..seg.end];
            let inside: std::collections::HashSet<StorageId> = steps
                .iter()
                .flat_map(|st| st.allocs.iter().copied())
                .collect();
            let mut outside = vec![seg.input];
            for st in steps {
                for &v in &st.inputs {
                    let s = tape.values[v].storage;
                    if tape.storages[s].kind == StorageKind::Activation
                        && !inside.contains(&s)
                        && !outside.contains(&s)
                    {
                        outside.push(s);
                    }
                }
            }
            outside
        })
        .collect();
    for (seg, inputs) in tape.segments.iter().zip(&seg_inputs) {
        for &s in inputs {
            saved_fwd[s] = true;
            bwd_free_at[s] = bwd_free_at[s].min(seg.start);
        }
    }
    let act_cat: TiVec<StorageId, Category> = saved_fwd
        .keys()
        .map(|s| {
            if saved_fwd[s] || held[s] {
                Category::Activations
            } else {
                Category::Temporaries
            }
        })
        .collect();

    // Saved bytes, each storage once, attributed to the first layer that saves it.
    let mut saved_by_layer: TiVec<LayerId, u64> = ti_vec![0; tape.layers.len()];
    let mut counted: TiVec<StorageId, bool> = ti_vec![false; n_storages];
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
                saved_bytes = saved_bytes.saturating_add(st.bytes);
                saved_by_layer[step.layer] = saved_by_layer[step.layer].saturating_add(st.bytes);
            }
        }
    }
    // Checkpoint inputs saved outside any step's own saves.
    for s in seg_inputs.iter().flatten().copied() {
        if tape.storages[s].kind == StorageKind::Activation && !counted[s] {
            counted[s] = true;
            saved_bytes = saved_bytes.saturating_add(tape.storages[s].bytes);
            saved_by_layer[tape.storages[s].layer] =
                saved_by_layer[tape.storages[s].layer].saturating_add(tape.storages[s].bytes);
        }
    }

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
    let optimizer_state_bytes = plan.state_bytes;
    let master_weights_bytes = plan.master_bytes;

    let mut st = State {
        tape,
        live: ti_vec![false; n_storages],
        cur: [0; Category::COUNT],
        peak: 0,
        peak_phase: Phase::Forward,
        peak_layer: None,
        at_peak: [0; Category::COUNT],
        max: [0; Category::COUNT],
        live_act_max: 0,
        overflow: false,
        act_cat,
    };
    // Parameters, buffers, the input batch and its labels exist before the step starts.
    for (s, storage) in tape.storages.iter_enumerated() {
        if matches!(
            storage.kind,
            StorageKind::Parameter | StorageKind::Buffer | StorageKind::Input
        ) {
            st.alloc(s);
        }
    }
    st.cur[Category::OptimizerState.index()] = optimizer_state_bytes;
    st.cur[Category::MasterWeights.index()] = master_weights_bytes;
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
    let mut optimizer_temp_bytes = 0u64;
    let grad_override = settings.grad_dtype_override();
    if training {
        // Backward.
        let mut grads: HashMap<ValueId, u64> = HashMap::new();
        let mut param_done: TiVec<ValueId, bool> = ti_vec![false; tape.values.len()];
        let seg_by_end: HashMap<usize, SegmentId> = tape
            .segments
            .iter_enumerated()
            .map(|(i, s)| (s.end, i))
            .collect();
        let seg_by_start: HashMap<usize, SegmentId> = tape
            .segments
            .iter_enumerated()
            .map(|(i, s)| (s.start, i))
            .collect();
        for i in (0..tape.steps.len()).rev() {
            if let Some(&g) = seg_by_end.get(&(i + 1)) {
                // Recompute the checkpointed block: what its own operators save stays for their
                // backward; everything else (the recomputed block output included) is dropped
                // after its last use inside the block.
                let seg = &tape.segments[g];
                let kept: std::collections::HashSet<StorageId> = tape.steps[seg.start..seg.end]
                    .iter()
                    .flat_map(|s| s.saves.iter().copied())
                    .collect();
                let mut replayed = Vec::new();
                for j in seg.start..seg.end {
                    let step = &tape.steps[j];
                    for &s in &step.allocs {
                        if !st.live[s] {
                            st.act_cat[s] = if kept.contains(&s) {
                                Category::Activations
                            } else {
                                Category::Temporaries
                            };
                            st.alloc(s);
                            replayed.push(s);
                        }
                    }
                    st.check(Phase::Backward, Some(step.layer));
                    for &s in &replayed {
                        if st.live[s] && !kept.contains(&s) && last_use[s].min(seg.end - 1) <= j {
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
                // Parameter gradients take the recipe's gradient dtype (a float32 accumulation
                // buffer under `mixed-bf16-fp32-grads`); activation gradients their value's.
                let grad_dtype = match grad_override {
                    Some(g) if val.param && val.dtype == settings.recipe.weights => g,
                    _ => val.dtype,
                };
                let bytes = grad_dtype.bytes_for(numel).unwrap_or(0);
                if val.param {
                    if param_done[v] {
                        transient = transient.saturating_add(bytes);
                    } else {
                        param_done[v] = true;
                        gradient_bytes = gradient_bytes.saturating_add(bytes);
                        st.add(Category::Gradients.index(), bytes);
                    }
                } else if let Some(m) = moved.take() {
                    // The input's gradient is a view of the output's; when the input already has
                    // one, autograd adds this one into it and it dies.
                    match grads.entry(v) {
                        std::collections::hash_map::Entry::Vacant(e) => {
                            e.insert(m);
                        }
                        std::collections::hash_map::Entry::Occupied(_) => {
                            st.cur[temp] -= m;
                            transient += m;
                        }
                    }
                } else if let std::collections::hash_map::Entry::Vacant(e) = grads.entry(v) {
                    e.insert(bytes);
                    st.add(temp, bytes);
                } else {
                    transient = transient.saturating_add(bytes);
                }
            }
            if let Some(m) = moved {
                // Nothing took the view: the gradient dies here.
                st.cur[temp] -= m;
            }
            st.add(temp, transient);
            st.check(Phase::Backward, Some(step.layer));
            st.cur[temp] = st.cur[temp].saturating_sub(transient);
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
            if let Some(&g) = seg_by_start.get(&i) {
                for &s in &seg_inputs[g] {
                    if bwd_free_at[s] == i && !held[s] {
                        st.free(s);
                    }
                }
            }
        }
        let leftover: u64 = grads.values().sum();
        st.cur[Category::Temporaries.index()] -= leftover;
        // Optimizer step. Under a `mixed-*` recipe with 16-bit gradients the optimizer first
        // gets float32 copies of them and the 16-bit ones are freed (Megatron's
        // `_copy_model_grads_to_main_grads`: `main_param.grad = model_param.grad.float()`,
        // `model_param.grad = None`); then the step's temporaries.
        let (copies, freed) =
            plan.master_grad_copies(|v| param_done.get(v).copied().unwrap_or(false));
        optimizer_temp_bytes = copies.saturating_add(plan.temp_bytes);
        let (g, t) = (Category::Gradients.index(), Category::Temporaries.index());
        let freed = freed.min(st.cur[g]);
        st.cur[g] -= freed;
        st.add(t, optimizer_temp_bytes);
        st.check(Phase::OptimizerStep, None);
        st.cur[t] = st.cur[t].saturating_sub(optimizer_temp_bytes);
        st.cur[g] = st.cur[g].saturating_add(freed);
    }
    let overflowed = st.overflow
        || [
            saved_bytes,
            gradient_bytes,
            optimizer_state_bytes,
            master_weights_bytes,
            optimizer_temp_bytes,
        ]
        .contains(&u64::MAX);
    if overflowed {
        return Err(Error::Overflow("the memory total of the step".into()));
    }

    Ok(Simulation {
        peak_bytes: st.peak,
        peak_phase: st.peak_phase,
        peak_layer: st.peak_layer,
        at_peak: st.at_peak,
        category_max: st.max,
        saved_bytes: if training { saved_bytes } else { 0 },
        saved_by_layer: if training {
            saved_by_layer
        } else {
            ti_vec![0; tape.layers.len()]
        },
        peak_live_activations: st.live_act_max,
        gradient_bytes,
        optimizer_state_bytes,
        master_weights_bytes,
        optimizer_temp_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn category_index_is_its_position_in_all() {
        for (i, c) in Category::ALL.iter().enumerate() {
            assert_eq!(c.index(), i, "{c:?}");
        }
    }
}
