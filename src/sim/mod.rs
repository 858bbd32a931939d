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

mod heap;
mod liveness;
mod parallel;
pub(crate) mod periodic;
mod pipeline;
mod replay;

use std::collections::HashMap;

use serde::Serialize;
use typed_index_collections::{TiVec, ti_vec};

use crate::cost::OptimizerPlan;
use crate::dtype::DType;
use crate::error::Error;
use crate::settings::Settings;
use crate::shape::Shape;
use crate::trace::{AtenOp, LayerId, StorageId, Tape, ValueId};
use crate::vocab::Device;
use heap::Heap;
pub(crate) use heap::HeapOp;
use liveness::{Liveness, SavedBytes};
use replay::{Replay, Snapshot};

/// Categories of live memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, schemars::JsonSchema)]
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
    /// Several GPUs: communication buffers (DDP's gradient buckets, parameters gathered by
    /// FSDP or ZeRO-3, DeepSpeed's reduce buckets; see [`crate::parallel`]).
    CommBuffers,
}

impl Category {
    /// Number of categories.
    pub const COUNT: usize = 10;

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
        Category::CommBuffers,
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
            Category::CommBuffers => "Communication buffers",
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
            Category::CommBuffers => "comm_buffers_bytes",
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
    /// Float32 master weights of a `mixed-*` recipe, and DeepSpeed's float32 master partitions.
    pub master_weights_bytes: u64,
    /// Under a parallel plan, this rank's parameter bytes (its shards); `None` on one GPU (all
    /// of the tape's parameters).
    pub resident_parameter_bytes: Option<u64>,
    /// Under a parallel plan, the model states as one GPU would hold them whole (before
    /// sharding): parameters, gradients, optimizer state, master weights.
    pub unsharded: Option<[u64; 4]>,
    /// Under a parallel plan with offload, this rank's host (CPU) bytes, and of them the
    /// pinned ones ([`crate::parallel::Offload`]); 0 otherwise.
    pub cpu_bytes: [u64; 2],
    /// Optimizer-step temporaries (the `foreach` temporaries, plus the float32 copies of
    /// 16-bit gradients a `mixed-*` recipe hands the optimizer).
    pub optimizer_temp_bytes: u64,
    /// Optimizer state in bitsandbytes' paged memory (`--paged`), outside the allocator and the
    /// peak; 0 otherwise.
    pub paged_state_bytes: u64,
    /// The EMA copy of the weights (`--ema`), counted in [`Category::OptimizerState`].
    pub ema_bytes: u64,
    /// What is live between steps, after the forward pass, and an accumulating micro-batch's
    /// peak.
    pub held: Held,
    /// The step over time, when [`Observe::timeline`] asked for it.
    pub timeline: Option<Timeline>,
    /// Every tensor live at the peak, largest first, when [`Observe::explain`] asked for it
    /// (optimizer state, master weights and optimizer-step temporaries are not tensors of the
    /// tape and are not listed).
    pub live_at_peak: Option<Vec<LiveTensor>>,
    /// What the CUDA caching allocator reports for the step, on [`Device::Cuda`]: on one GPU, or
    /// on the worst rank of a DDP or FSDP plan from that rank's own stream (not under DeepSpeed
    /// ZeRO, tensor, pipeline, context or expert parallelism or offloading: `None` there).
    pub allocator: Option<AllocatorPeaks>,
    /// Pipeline parallelism: each pipeline rank's figures, first stage first (empty without
    /// `--pp`). The other figures are then the worst rank's.
    pub stages: Vec<StageFigures>,
    /// Under DDP, its gradient buckets' bytes, each in the Reducer's order: as constructed and
    /// as rebuilt at the second iteration (see `parallel::DdpBuckets`); `None` otherwise.
    pub ddp_buckets: Option<[Vec<u64>; 2]>,
}

/// What one pipeline rank holds ([`crate::parallel::Pipeline`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageFigures {
    /// The pipeline rank (`0..P`).
    pub stage: u64,
    /// Its repeated blocks, per model chunk (indices into the model's copies, `[first, end)`).
    pub blocks: Vec<(u64, u64)>,
    /// Per model chunk, the micro-batches whose activations it holds at once at most.
    pub in_flight: Vec<u64>,
    /// Its model states: parameters (its shard under ZeRO-3/FSDP), gradients, optimizer state,
    /// master weights.
    pub model_states: [u64; 4],
    /// What one micro-batch's forward saves for backward on this rank, received inputs that
    /// its operators save included (all chunks).
    pub saved_per_micro_batch_bytes: u64,
    /// What one micro-batch keeps from its forward to its backward on this rank: the saved
    /// tensors, the received input and what the step holds (all chunks).
    pub held_per_micro_batch_bytes: u64,
    /// Activations received and sent per micro-batch (one of each direction in flight).
    pub p2p_bytes: u64,
    /// Its peak.
    pub peak_bytes: u64,
    /// Its bytes per category at its peak (indexed like [`Category::ALL`]).
    pub at_peak: [u64; Category::COUNT],
}

/// How a pipeline stage's replay differs from one GPU's: the other micro-batches in flight
/// and the other model chunks of the same GPU, added as bytes.
#[derive(Clone, Copy, Debug, Default)]
struct Pipelined {
    /// Bytes per category of the rank's other model chunks (their model states) and of the
    /// whole batch's other micro-batches (the input).
    extra: [u64; Category::COUNT],
    /// Activations of the other micro-batches in flight during the first micro-batch.
    others_first: u64,
    /// The same during a second micro-batch, run with the gradients live; `None`: one only.
    others_second: Option<u64>,
    /// The receive buffer of the output's gradient, during each backward.
    recv_grad: u64,
}

/// The CUDA caching allocator's figures for the measured step ([`crate::alloc`]), as
/// `torch.cuda.max_memory_allocated()` and `max_memory_reserved()` give them after
/// `reset_peak_memory_stats()` at the step's start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocatorPeaks {
    /// The largest sum of the blocks handed out: every tensor rounded up to 512 B, and a
    /// block's unsplit rest counted with it.
    pub allocated_peak_bytes: u64,
    /// The largest sum of the segments the allocator holds; nothing is released within a
    /// step, so it includes everything the first step left cached.
    pub reserved_peak_bytes: u64,
}

/// What to record beside the figures (none of which it changes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Observe {
    /// The live bytes per category after every event ([`Simulation::timeline`]).
    pub timeline: bool,
    /// The tensors live at the peak ([`Simulation::live_at_peak`]); replays the step twice.
    pub explain: bool,
}

/// The most points a [`Timeline`] keeps.
pub const TIMELINE_POINTS: usize = 2000;

/// The live bytes per category after one event of the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimePoint {
    /// The event's position in the step (0 is the state before the first operator).
    pub event: usize,
    /// Its phase.
    pub phase: Phase,
    /// Live bytes per category (indexed like [`Category::ALL`]); their sum is the total.
    pub bytes: [u64; Category::COUNT],
}

impl TimePoint {
    /// The live total (saturating).
    #[must_use]
    pub fn total(&self) -> u64 {
        self.bytes.iter().fold(0u64, |a, &b| a.saturating_add(b))
    }
}

/// The step over time: one point per event (each operator in forward, each operator's backward
/// and each recomputed operator, the optimizer step), downsampled to at most
/// [`TIMELINE_POINTS`] by keeping each run's largest total, so the peak is always a point.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Timeline {
    /// Events in the whole step (the x axis runs over `0..events`).
    pub events: usize,
    /// The points kept, in event order.
    pub points: Vec<TimePoint>,
    /// Index in `points` of the peak (its total is [`Simulation::peak_bytes`]).
    pub peak: usize,
    /// Each phase's first and one-past-last event, in order.
    pub phases: Vec<(Phase, usize, usize)>,
}

impl Timeline {
    fn new(all: Vec<TimePoint>, peak_event: usize) -> Timeline {
        let events = all.len();
        let mut phases: Vec<(Phase, usize, usize)> = Vec::new();
        for p in &all {
            match phases.last_mut() {
                Some(last) if last.0 == p.phase => last.2 = p.event + 1,
                _ => phases.push((p.phase, p.event, p.event + 1)),
            }
        }
        let run = events.div_ceil(TIMELINE_POINTS).max(1);
        let points: Vec<TimePoint> = all
            .chunks(run)
            .filter_map(|c| {
                // The event of the peak, else the first largest total of the run.
                c.iter()
                    .find(|p| p.event == peak_event)
                    .or_else(|| c.iter().rev().max_by_key(|p| p.total()))
            })
            .copied()
            .collect();
        let peak = points
            .iter()
            .position(|p| p.event == peak_event)
            .unwrap_or(0);
        Timeline {
            events,
            points,
            peak,
            phases,
        }
    }
}

/// Where an event of the step happens: the state before the first operator, a step's forward,
/// its backward, its recomputation (a checkpointed block), the optimizer step, an EMA update, or
/// a gather or reduction of several GPUs. Step indices are positions in [`Tape::steps`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum At {
    /// Before the first operator: parameters, buffers, input and optimizer state.
    Start,
    /// A step's forward.
    Forward(usize),
    /// A step's backward.
    Backward(usize),
    /// A step recomputed before its checkpointed block's backward.
    Recompute(usize),
    /// The optimizer step.
    OptimizerStep,
    /// The EMA update after the optimizer step.
    EmaUpdate,
    /// An all-gather or a reduce-scatter buffer (several GPUs).
    Communication,
}

/// One event of the step, every one kept (unlike a [`Timeline`]): where it is and the live bytes
/// per category after it (indexed like [`Category::ALL`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Event {
    /// Where it happens.
    pub at: At,
    /// Live bytes per category.
    pub bytes: [u64; Category::COUNT],
}

/// A tensor live at the peak, for `--explain`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveTensor {
    /// What it is: the storage's name (`output`, `softmax output`, `weight`, …), or
    /// `gradient of …` for a gradient.
    pub what: String,
    /// The layer that made it.
    pub layer: LayerId,
    /// The operator that allocated it; `None` for parameters, buffers, the input batch and
    /// gradients.
    pub op: Option<AtenOp>,
    /// Its shape.
    pub shape: Shape,
    /// Its dtype.
    pub dtype: DType,
    /// Its bytes on this GPU: under a sharded plan a parameter's shard (its `what` then ends in
    /// `(shard)`; the shape stays the whole parameter's).
    pub bytes: u64,
    /// The category it counts in at the peak.
    pub category: Category,
}

/// The tensors of `snap`, largest first (ties in tape order).
fn live_tensors(tape: &Tape, snap: Snapshot) -> Vec<LiveTensor> {
    let mut made_by: std::collections::HashMap<StorageId, AtenOp> =
        std::collections::HashMap::new();
    for step in &tape.steps {
        for &s in &step.allocs {
            made_by.entry(s).or_insert(step.op);
        }
    }
    // A parameter sharded away from this GPU (offloaded, or another rank's) counts nothing
    // here; one with a shard counts the shard.
    let mut out: Vec<LiveTensor> = snap
        .storages
        .into_iter()
        .filter(|&(_, _, bytes)| bytes > 0)
        .map(|(s, category, bytes)| {
            let st = &tape.storages[s];
            LiveTensor {
                what: if bytes < st.bytes {
                    format!("{} (shard)", st.what)
                } else {
                    st.what.to_string()
                },
                layer: st.layer,
                op: made_by.get(&s).copied(),
                shape: st.shape.clone(),
                dtype: st.dtype,
                bytes,
                category,
            }
        })
        .collect();
    let grads = snap
        .param_grads
        .into_iter()
        .map(|g| (g, Category::Gradients))
        .chain(snap.grads.into_iter().map(|g| (g, Category::Temporaries)));
    for ((v, bytes), category) in grads {
        let val = &tape.values[v];
        let st = &tape.storages[val.storage];
        out.push(LiveTensor {
            what: if category == Category::Gradients {
                "parameter gradient".to_string()
            } else {
                format!("gradient of {}", st.what)
            },
            layer: st.layer,
            op: None,
            shape: val.shape.clone(),
            dtype: val.dtype,
            bytes,
            category,
        });
    }
    // Stable: equal sizes stay in tape order.
    out.sort_by_key(|t| std::cmp::Reverse(t.bytes));
    out
}

/// Simulates one step of the traced model.
///
/// # Errors
/// [`Error::Overflow`] when a memory total does not fit in 64 bits, [`Error::Internal`] when a
/// running total would go below zero (a bug).
pub fn simulate(tape: &Tape, settings: &Settings) -> Result<Simulation, Error> {
    simulate_observed(tape, settings, Observe::default())
}

/// [`simulate`], also recording what `observe` asks for ([`Simulation::timeline`],
/// [`Simulation::live_at_peak`]); the figures are the same.
///
/// # Errors
/// As [`simulate`].
pub fn simulate_observed(
    tape: &Tape,
    settings: &Settings,
    observe: Observe,
) -> Result<Simulation, Error> {
    simulate_inner(tape, settings, observe, false, None).map(|(sim, _, _)| sim)
}

/// [`simulate`], also returning every event of the step in order (what the symbolic treatment
/// of repeats extends from a few copies to many). On CUDA the caching allocator does not run:
/// its operations are returned in its place, and [`Simulation::allocator`] is `None` (the
/// symbolic treatment plays them itself, `crate::sim::periodic`).
///
/// # Errors
/// As [`simulate`].
pub(crate) fn simulate_events(tape: &Tape, settings: &Settings) -> Result<SimulatedEvents, Error> {
    let (sim, log, heap) = simulate_inner(tape, settings, Observe::default(), true, None)?;
    Ok((sim, log.unwrap_or_default(), heap))
}

/// What [`simulate_events`] returns: the simulation (without the allocator's figures), its
/// events and the caching allocator's operations (on CUDA).
pub(crate) type SimulatedEvents = (Simulation, Vec<Event>, Option<Vec<HeapOp>>);

/// What [`simulate_inner`] returns: the simulation, with `log` its events and the caching
/// allocator's operations in place of its figures (where it runs).
type Simulated = (Simulation, Option<Vec<Event>>, Option<Vec<HeapOp>>);

fn simulate_inner(
    tape: &Tape,
    settings: &Settings,
    observe: Observe,
    log: bool,
    pipe: Option<&Pipelined>,
) -> Result<Simulated, Error> {
    let training = settings.training();
    if pipe.is_none()
        && training
        && let Some(p) = settings.parallel.as_ref().and_then(|p| p.pipeline)
    {
        return simulate_pipeline(tape, settings, observe, &p).map(|sim| (sim, None, None));
    }
    let facts = Liveness::of(tape);
    let saved = SavedBytes::of(tape, &facts);
    let param_grad = settings
        .grad_dtype_override()
        .map(|g| (settings.recipe.weights, g));
    if let Some(p) = settings.parallel.as_ref().filter(|_| training) {
        parallel::check_experts(tape, p)?;
        parallel::check_optimizer(tape, settings, p)?;
    }
    // Several GPUs: the rank with the largest peak, when ranks differ.
    let dist = settings.parallel.as_ref().filter(|_| training).map(|p| {
        let mut worst: Option<(u64, parallel::Dist)> = None;
        for rank in parallel::Dist::ranks(p) {
            let d = parallel::Dist::new(tape, settings, p, rank);
            let mut r = Replay::new(tape, &facts);
            r.distributed(&d);
            r.start(
                d.optimizer.state_bytes,
                d.optimizer
                    .master_bytes
                    .saturating_add(d.master_partition_bytes),
            );
            r.forward(true);
            let bwd = r.backward(param_grad, None, None);
            r.optimizer_step(&d.optimizer, &bwd);
            let peak = r.peak;
            if worst.as_ref().is_none_or(|w| peak > w.0) {
                worst = Some((peak, d));
            }
        }
        worst.map(|w| w.1)
    });
    let dist = dist.flatten();
    let trainable = || {
        tape.params
            .iter()
            .filter(|p| p.trainable)
            .map(|p| (p.value, p.info(), tape.values[p.value].dtype))
    };
    let plan = match settings.optimizer.filter(|_| training) {
        Some(_) if dist.is_some() => dist
            .as_ref()
            .map(|d| d.optimizer.clone())
            .unwrap_or_default(),
        Some(opt) if settings.paged => OptimizerPlan::paged(opt, trainable()).unwrap_or_default(),
        Some(opt) => {
            OptimizerPlan::new(opt, settings.optimizer_impl, &settings.recipe, trainable())
        }
        None => OptimizerPlan::default(),
    };
    // The optimizer state in the step's timeline: paged state lives outside the allocator;
    // on CUDA the timeline counts device tensors, as `torch.cuda.max_memory_allocated` does,
    // so the host `step` counters are left out of it (they stay in `optimizer_state_bytes`);
    // on the CPU every tensor is the process's.
    let counted_state = if plan.paged {
        0
    } else if settings.device == Device::Cuda {
        plan.state_bytes.saturating_sub(plan.host_state_bytes)
    } else {
        plan.state_bytes
    };
    let ema_bytes = if training {
        ema_bytes(tape, settings.ema)
    } else {
        0
    };
    // torchtune's `optimizer_in_bwd`: one optimizer per parameter, so each step's temporaries
    // are those of one tensor.
    let in_bwd_temps: HashMap<ValueId, u64> = match settings.optimizer {
        Some(opt) if training && settings.optim_in_backward && !settings.paged => trainable()
            .map(|(v, info, _)| (v, settings.optimizer_impl.step_temporaries(opt, &[info])))
            .collect(),
        _ => HashMap::new(),
    };
    let in_bwd = |v: ValueId| in_bwd_temps.get(&v).copied().unwrap_or(0);
    let in_backward: Option<&dyn Fn(ValueId) -> u64> = if settings.optim_in_backward && training {
        Some(&in_bwd)
    } else {
        None
    };
    // The step's phases; returns the gradient and optimizer-temporary bytes.
    let master_bytes = plan
        .master_bytes
        .saturating_add(dist.as_ref().map_or(0, |d| d.master_partition_bytes));
    let keep_grads = settings.keep_grads && training && in_backward.is_none();
    let steps = |replay: &mut Replay| {
        let mut held = Held::default();
        replay.start(counted_state.saturating_add(ema_bytes), master_bytes);
        if let Some(p) = pipe {
            for c in Category::ALL {
                replay.preload(c, p.extra[c.index()]);
            }
            replay.preload(Category::Activations, p.others_first);
            replay.recv_grad = p.recv_grad;
        }
        held.between_steps = replay.total().saturating_sub(replay.now(Category::Input));
        replay.forward(training);
        held.after_forward = replay.total();
        if !training {
            return (0, 0, held);
        }
        let mut bwd = replay.backward(param_grad, None, in_backward);
        let mut others = pipe.map_or(0, |p| p.others_first);
        let second = pipe.and_then(|p| p.others_second);
        if settings.grad_accum > 1 || second.is_some() {
            // Micro-batches 2..N are alike: gradients are live from their start and each
            // backward adds into them. In a pipeline, the next micro-batch runs with the
            // others in flight then.
            replay.end_micro_batch();
            if let Some(next) = second {
                replay.unload(Category::Activations, others);
                replay.preload(Category::Activations, next);
                others = next;
            }
            replay.open_window();
            replay.forward(training);
            let more = replay.backward(param_grad, Some(&bwd.has_grad), in_backward);
            bwd.has_grad = more.has_grad;
            held.accumulating_peak = Some(replay.window_peak);
        }
        if pipe.is_some() {
            // The step runs after the last micro-batch's backward: nothing is in flight.
            replay.unload(Category::Activations, others);
            replay.free_carried();
        }
        let mut temps = if in_backward.is_some() {
            0
        } else {
            replay.optimizer_step(&plan, &bwd)
        };
        if ema_bytes > 0 {
            replay.ema_update(ema_update_bytes(tape, settings.ema));
        }
        if keep_grads {
            // `zero_grad(set_to_none=False)`: the next step starts with the gradients, and its
            // backward adds into them (a further micro-batch of accumulation is that already).
            replay.end_micro_batch();
            held.between_steps = replay.total().saturating_sub(replay.now(Category::Input));
            if settings.grad_accum == 1 {
                replay.forward(training);
                let next = replay.backward(param_grad, Some(&bwd.has_grad), None);
                bwd.has_grad = next.has_grad;
                temps = replay.optimizer_step(&plan, &bwd);
                if ema_bytes > 0 {
                    replay.ema_update(ema_update_bytes(tape, settings.ema));
                }
            }
        }
        (bwd.gradient_bytes, temps, held)
    };
    let mut replay = Replay::new(tape, &facts);
    if let Some(d) = &dist {
        replay.distributed(d);
    }
    if observe.timeline {
        replay.record();
    }
    if log {
        replay.log();
    }
    let (gradient_bytes, optimizer_temp_bytes, held) = steps(&mut replay);
    if let Some(e) = replay.error() {
        return Err(e);
    }
    let timeline = replay
        .points
        .take()
        .map(|all| Timeline::new(all, replay.peak_event));
    // Several GPUs: the worst rank's own allocation stream, where the plan's engine is
    // modelled tensor by tensor (`Dist::allocator`: DDP, FSDP).
    let mut heap_log = None;
    let allocator = if settings.device == Device::Cuda && dist.as_ref().is_none_or(|d| d.allocator)
    {
        let config = crate::alloc::Config {
            expandable_segments: settings.expandable_segments,
            max_split_size: None,
        };
        let (peaks, ops) = allocator_peaks(
            tape,
            &facts,
            dist.as_ref(),
            &plan,
            training.then_some(param_grad),
            config,
            (settings.grad_accum, in_backward, keep_grads),
            (
                ema_tensors(tape, settings.ema.filter(|_| training)),
                &ema_update_tensors(tape, settings.ema.filter(|_| training)).collect::<Vec<_>>(),
            ),
            log,
        )?;
        heap_log = ops;
        peaks
    } else {
        None
    };
    let live_at_peak = if observe.explain {
        let mut again = Replay::new(tape, &facts);
        if let Some(d) = &dist {
            again.distributed(d);
        }
        again.snapshot_at(replay.peak_event);
        steps(&mut again);
        again.snapshot.take().map(|snap| live_tensors(tape, snap))
    } else {
        None
    };
    // Per GPU: the gradients each rank keeps once they are reduced.
    let gradient_bytes = dist
        .as_ref()
        .map_or(gradient_bytes, |d| d.gradient_bytes(gradient_bytes));
    let sums = [
        saved.total,
        gradient_bytes,
        plan.state_bytes,
        master_bytes,
        optimizer_temp_bytes,
    ];
    if sums.contains(&u64::MAX) {
        return Err(Error::Overflow("the memory total of the step".into()));
    }
    let sim = Simulation {
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
        master_weights_bytes: master_bytes,
        resident_parameter_bytes: dist.as_ref().map(parallel::Dist::parameter_bytes),
        unsharded: dist.as_ref().map(|d| {
            [
                tape.params
                    .iter()
                    .fold(0u64, |a, p| a.saturating_add(p.bytes)),
                d.whole_gradient_bytes,
                d.whole_optimizer.state_bytes,
                d.whole_optimizer.master_bytes,
            ]
        }),
        cpu_bytes: dist
            .as_ref()
            .map_or([0, 0], |d| [d.cpu_bytes, d.cpu_pinned_bytes]),
        optimizer_temp_bytes,
        paged_state_bytes: if plan.paged { plan.state_bytes } else { 0 },
        ema_bytes,
        held,
        timeline,
        live_at_peak,
        allocator,
        stages: Vec::new(),
        ddp_buckets: dist
            .as_ref()
            .filter(|d| !d.ddp_buckets.initial.is_empty())
            .map(|d| [d.ddp_buckets.initial.clone(), d.ddp_buckets.rebuilt.clone()]),
    };
    Ok((sim, replay.log, heap_log))
}

/// A training step under pipeline parallelism ([`crate::parallel::Pipeline`]): each pipeline
/// rank replayed with its model chunks ([`pipeline::split`]), the micro-batches the schedule
/// keeps in flight ([`crate::parallel::Pipeline::in_flight`]) and its send and receive
/// buffers; the figures are the worst rank's, with every rank's in [`Simulation::stages`].
///
/// Per rank and model chunk: one micro-batch keeps from its forward to its backward what the
/// chunk's replay holds at the end of its forward (saved tensors, its received input, the
/// output and loss on the last stage); the chunk is replayed with `n − 1` such micro-batches
/// beside it (`n` the chunk's count in flight), and again for a second micro-batch with its
/// gradients live (GPipe: `M − 2` beside it, as its backwards run after every forward). The
/// rank's other chunks add their model states and their micro-batches in flight; its peak is
/// the largest over its chunks. The optimizer step of a rank with several chunks is replayed
/// with one chunk's temporaries (the others' are not added).
fn simulate_pipeline(
    tape: &Tape,
    settings: &Settings,
    observe: Observe,
    p: &crate::parallel::Pipeline,
) -> Result<Simulation, Error> {
    use crate::parallel::Schedule;
    let ranks = p.stages.max(1);
    let chunks_per_rank = p.virtual_stages.max(1);
    let total = ranks
        .checked_mul(chunks_per_rank)
        .ok_or_else(|| Error::Overflow("the pipeline's stage count".into()))?;
    let ranges = pipeline::split(tape, total)?;
    let stage_tapes: Vec<pipeline::StageTape> = ranges
        .iter()
        .map(|r| pipeline::stage_tape(tape, r))
        .collect();
    // Per chunk: what one micro-batch holds after its forward, and the chunk's figures alone.
    let mut held_mb = Vec::with_capacity(stage_tapes.len());
    let mut solo = Vec::with_capacity(stage_tapes.len());
    let mut input_mb = Vec::with_capacity(stage_tapes.len());
    for st in &stage_tapes {
        let facts = Liveness::of(&st.tape);
        let mut r = Replay::new(&st.tape, &facts);
        r.start(0, 0);
        input_mb.push(r.now(Category::Input));
        r.forward(true);
        held_mb.push(
            r.now(Category::Activations)
                .saturating_add(r.now(Category::Temporaries)),
        );
        if let Some(e) = r.error() {
            return Err(e);
        }
        let (sim, _, _) = simulate_inner(
            &st.tape,
            settings,
            Observe::default(),
            false,
            Some(&Pipelined::default()),
        )?;
        solo.push(sim);
    }
    let m = p.micro_batches.max(1);
    let states = |s: &Simulation| {
        [
            s.resident_parameter_bytes.unwrap_or(0),
            s.gradient_bytes,
            s.optimizer_state_bytes,
            s.master_weights_bytes,
        ]
    };
    let mut worst: Option<Simulation> = None;
    let mut figures = Vec::new();
    for rank in 0..ranks {
        let mine: Vec<usize> = (0..chunks_per_rank)
            .filter_map(|k| usize::try_from(k * ranks + rank).ok())
            .collect();
        let in_flight: Vec<u64> = (0..chunks_per_rank).map(|k| p.in_flight(rank, k)).collect();
        let mut best: Option<Simulation> = None;
        for (k, &c) in mine.iter().enumerate() {
            let mut pipe = Pipelined::default();
            for (k2, &c2) in mine.iter().enumerate() {
                if k2 == k {
                    continue;
                }
                let s2 = states(&solo[c2]);
                for (cat, b) in [
                    Category::Parameters,
                    Category::Gradients,
                    Category::OptimizerState,
                    Category::MasterWeights,
                ]
                .into_iter()
                .zip(s2)
                {
                    pipe.extra[cat.index()] = pipe.extra[cat.index()].saturating_add(b);
                }
                pipe.others_first = pipe
                    .others_first
                    .saturating_add(in_flight[k2].saturating_mul(held_mb[c2]));
                pipe.extra[Category::Input.index()] = pipe.extra[Category::Input.index()]
                    .saturating_add(m.saturating_mul(input_mb[c2]));
            }
            let n = in_flight[k];
            let base = pipe.others_first;
            pipe.others_first = base.saturating_add(n.saturating_sub(1).saturating_mul(held_mb[c]));
            pipe.others_second = (m >= 2).then(|| match p.schedule {
                Schedule::Gpipe => {
                    base.saturating_add(m.saturating_sub(2).saturating_mul(held_mb[c]))
                }
                _ => pipe.others_first,
            });
            // The whole batch's input: every micro-batch's slice of it exists all step.
            pipe.extra[Category::Input.index()] = pipe.extra[Category::Input.index()]
                .saturating_add(m.saturating_sub(1).saturating_mul(input_mb[c]));
            pipe.recv_grad = stage_tapes[c].sent_bytes;
            let (sim, _, _) =
                simulate_inner(&stage_tapes[c].tape, settings, observe, false, Some(&pipe))?;
            if best.as_ref().is_none_or(|b| sim.peak_bytes > b.peak_bytes) {
                best = Some(sim);
            }
        }
        let Some(mut sim) = best else { continue };
        // The rank's model states: all its chunks'.
        let sum = mine.iter().fold([0u64; 4], |mut a, &c| {
            for (x, y) in a.iter_mut().zip(states(&solo[c])) {
                *x = x.saturating_add(y);
            }
            a
        });
        sim.resident_parameter_bytes = Some(sum[0]);
        sim.gradient_bytes = sum[1];
        sim.optimizer_state_bytes = sum[2];
        sim.master_weights_bytes = sum[3];
        sim.saved_bytes = mine.iter().fold(0u64, |a, &c| {
            a.saturating_add(solo[c].saved_bytes)
                .saturating_add(stage_tapes[c].received_saved_bytes)
        });
        let fig = StageFigures {
            stage: rank,
            blocks: mine
                .iter()
                .map(|&c| (ranges[c].blocks.start as u64, ranges[c].blocks.end as u64))
                .collect(),
            in_flight: in_flight.clone(),
            model_states: sum,
            saved_per_micro_batch_bytes: sim.saved_bytes,
            held_per_micro_batch_bytes: mine
                .iter()
                .fold(0u64, |a, &c| a.saturating_add(held_mb[c])),
            p2p_bytes: mine.iter().fold(0u64, |a, &c| {
                a.saturating_add(stage_tapes[c].received_bytes)
                    .saturating_add(stage_tapes[c].sent_bytes)
            }),
            peak_bytes: sim.peak_bytes,
            at_peak: sim.at_peak,
        };
        figures.push(fig);
        if worst.as_ref().is_none_or(|w| sim.peak_bytes > w.peak_bytes) {
            worst = Some(sim);
        }
    }
    let mut sim = worst.ok_or(Error::Internal("a pipeline without stages"))?;
    // Before sharding: the whole model on one GPU.
    if let Some(plan) = &settings.parallel {
        let whole = parallel::Dist::new(tape, settings, plan, 0);
        sim.unsharded = Some([
            tape.params
                .iter()
                .fold(0u64, |a, p| a.saturating_add(p.bytes)),
            whole.whole_gradient_bytes,
            whole.whole_optimizer.state_bytes,
            whole.whole_optimizer.master_bytes,
        ]);
    }
    sim.stages = figures;
    // The second micro-batch is the schedule's, not gradient accumulation's.
    if settings.grad_accum <= 1 {
        sim.held.accumulating_peak = None;
    }
    Ok(sim)
}

/// The caching allocator's run: the model and the batch loaded, the optimizer's constructor,
/// a first step (which creates the optimizer state where it runs, inside `step()`), the peaks
/// reset, then the measured step. This is how a training loop reaches its steady state, and
/// how `measure_fake_cuda.py` measures (a warm-up step, `reset_peak_memory_stats`, the step).
/// Each step starts with `zero_grad(set_to_none=True)` and ends when the caller drops the
/// output and the loss. `training` carries the backward pass's parameter-gradient dtypes, as
/// [`simulate`] passes them; the last argument the micro-batches per step and the in-backward
/// optimizer's per-parameter temporaries and whether `zero_grad` keeps the gradients (the
/// measured step then adds into the warm-up step's), as [`simulate`] runs them; `ema` the
/// tensors of an EMA copy, made after the model is loaded, and each parameter's update
/// temporary (two at once, after the optimizer step: [`ema_update_bytes`]). Under a parallel
/// plan (`dist`), the stream is that rank's: its parameter shards, its engine's buffers
/// ([`Replay::load`], [`Replay::rebuild_ddp_buckets`]), gathers and reductions, and its
/// optimizer's part (`plan` is then the rank's). `record`: the allocator's operations are
/// recorded and returned instead of the peaks ([`HeapOp`], [`Heap::recorder`]: no allocator
/// runs).
#[allow(clippy::too_many_arguments)]
fn allocator_peaks(
    tape: &Tape,
    facts: &Liveness,
    dist: Option<&parallel::Dist>,
    plan: &OptimizerPlan<ValueId>,
    training: Option<Option<(DType, DType)>>,
    config: crate::alloc::Config,
    (grad_accum, in_backward, keep_grads): (u64, Option<&dyn Fn(ValueId) -> u64>, bool),
    (ema, ema_update): (impl Iterator<Item = u64>, &[u64]),
    record: bool,
) -> Result<(Option<AllocatorPeaks>, Option<Vec<HeapOp>>), Error> {
    let heap = if record {
        Heap::recorder()
    } else {
        Heap::new(config)
    };
    let mut r = Replay::new(tape, facts).with_heap(heap);
    if record {
        r.record_heap();
    }
    if let Some(d) = dist {
        r.distributed(d);
    }
    r.load();
    r.ema_copy(ema);
    r.optimizer_init(plan);
    let mut kept: Option<TiVec<ValueId, bool>> = None;
    for first in [true, false] {
        if !first && let Some(h) = &mut r.heap {
            h.reset_peaks();
        }
        if kept.is_none() {
            r.zero_grad();
        }
        if !first {
            r.rebuild_ddp_buckets();
        }
        r.load_past();
        r.forward(training.is_some());
        if let Some(param_grad) = training {
            let mut bwd = r.backward(param_grad, kept.as_ref(), in_backward);
            if grad_accum > 1 {
                r.end_micro_batch();
                r.forward(true);
                bwd.has_grad = r
                    .backward(param_grad, Some(&bwd.has_grad), in_backward)
                    .has_grad;
            }
            // Inside backward the optimizer ran already; the warm-up step still creates its
            // state.
            if in_backward.is_none() || first {
                r.optimizer_step_heap(plan, &bwd, first);
            }
            r.ema_update_heap(ema_update);
            if keep_grads {
                kept = Some(bwd.has_grad);
            }
        }
        r.end_step();
    }
    let heap = r
        .heap
        .as_mut()
        .ok_or(Error::Internal("the allocator's replay lost its allocator"))?;
    let peaks = heap.peaks()?.map(
        |(allocated_peak_bytes, reserved_peak_bytes)| AllocatorPeaks {
            allocated_peak_bytes,
            reserved_peak_bytes,
        },
    );
    Ok((peaks, heap.log.take()))
}

/// Bytes of an EMA copy of the weights in `dtype` (`None`: no EMA): every parameter and buffer,
/// as `copy.deepcopy(model)` makes them (`torch.optim.swa_utils.AveragedModel`, timm's
/// `ModelEmaV3`), each floating-point one in `dtype` (a quantized weight as stored).
fn ema_bytes(tape: &Tape, dtype: Option<DType>) -> u64 {
    ema_tensors(tape, dtype).fold(0u64, u64::saturating_add)
}

/// The tensors of [`ema_bytes`], parameters then buffers, each one's bytes.
fn ema_tensors(tape: &Tape, dtype: Option<DType>) -> impl Iterator<Item = u64> + '_ {
    let params = tape.params.iter().filter_map(move |p| {
        let dtype = dtype?;
        let stored = tape.values[p.value].dtype;
        Some(
            if stored == dtype
                || !stored.is_float()
                || p.bytes != stored.bytes_for(p.numel).unwrap_or(0)
            {
                p.bytes
            } else {
                dtype.bytes_for(p.numel).unwrap_or(u64::MAX)
            },
        )
    });
    // Floating-point buffers follow the copy's dtype too (`ema.to(torch.float32)` casts them).
    let buffers = tape
        .storages
        .iter()
        .filter(move |s| dtype.is_some() && s.kind == crate::trace::StorageKind::Buffer)
        .map(move |s| match dtype {
            Some(d) if s.dtype.is_float() => s
                .shape
                .numel()
                .and_then(|n| d.bytes_for(n))
                .unwrap_or(u64::MAX),
            _ => s.bytes,
        });
    params.chain(buffers)
}

/// The temporaries of one EMA update: diffusers' `EMAModel.step` (`foreach=False`, its default)
/// runs `s_param.sub_(one_minus_decay * (s_param - param))` one parameter at a time, two
/// temporaries of the largest parameter in the EMA's dtype at once. (timm's `ModelEmaV3` runs
/// `torch._foreach_lerp_` in place, without temporaries, when the dtypes agree.)
fn ema_update_bytes(tape: &Tape, dtype: Option<DType>) -> u64 {
    ema_update_tensors(tape, dtype)
        .map(|b| b.saturating_mul(2))
        .max()
        .unwrap_or(0)
}

/// One temporary of each parameter's EMA update ([`ema_update_bytes`]), in update order.
fn ema_update_tensors(tape: &Tape, dtype: Option<DType>) -> impl Iterator<Item = u64> + '_ {
    tape.params
        .iter()
        .filter(move |p| dtype.is_some() && tape.values[p.value].dtype.is_float())
        .map(move |p| dtype.and_then(|d| d.bytes_for(p.numel)).unwrap_or(u64::MAX))
}

/// What stays live at the quiet moments of a step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// Between two steps: parameters, buffers, master weights, the optimizer state the
    /// allocator counts and the EMA copy; no gradients (`zero_grad(set_to_none=True)`, the
    /// default since PyTorch 2.0) and no batch.
    pub between_steps: u64,
    /// At the end of the (first micro-batch's) forward pass, the loss computed: what is held
    /// between steps, the batch, the tensors saved for backward and the output and loss.
    pub after_forward: u64,
    /// With gradient accumulation: the peak of one of micro-batches 2..N, whose forward and
    /// backward run with the gradients already live.
    pub accumulating_peak: Option<u64>,
}

#[cfg(test)]
mod tests;
