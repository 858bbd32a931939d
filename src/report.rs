//! The estimate as data: what the table and the JSON output show.

use std::collections::BTreeMap;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::Serialize;
use typed_index_collections::{TiVec, ti_vec};

use crate::cost::plan::StepUse;
pub use crate::cost::{BytesPerParam, RecipeReport};
use crate::dtype::DType;
use crate::error::Error;
use crate::gpu::DeviceTerms;
use crate::settings::{BudgetOn, Device, Settings};
use crate::shape::Shape;
use crate::sim::{Category, Phase, Simulation, Timeline};
use crate::spec::LayerKind;
use crate::trace::{LayerId, StorageId, StorageKind, Tape};
pub use crate::warning::Warning;

/// A complete estimate. Every `*_bytes` field is a byte count. The top-level keys from
/// `param_count` to `layers` are a stable contract for scripts.
#[derive(Clone, Debug, Serialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Report {
    /// Model name.
    pub model: String,
    /// Settings used.
    pub settings: Settings,
    /// The precision recipe in effect and the bytes per parameter it implies.
    pub recipe: RecipeReport,
    /// Shape of the input batch.
    pub input_shape: Shape,
    /// All parameters (tied weights once).
    pub param_count: u64,
    /// Parameters that train.
    pub trainable_param_count: u64,
    /// Parameter bytes.
    pub parameters_bytes: u64,
    /// Parameter bytes per storage format (`float32`, `bfloat16`, `nf4`, …), quantization
    /// metadata (scales, zero points) included in its format.
    pub parameters_by_dtype: BTreeMap<&'static str, u64>,
    /// Parameters per storage format.
    pub param_count_by_dtype: BTreeMap<&'static str, u64>,
    /// Buffer bytes (BatchNorm running statistics, id and rotary tables).
    pub buffers_bytes: u64,
    /// Gradient bytes (same shapes and dtypes as the trainable parameters).
    pub gradients_bytes: u64,
    /// Optimizer state bytes (moments, momentum buffers, float32 step counters, 8-bit states
    /// and their scales), in the dtype of the tensors the optimizer updates; the step counters
    /// of a non-fused `torch.optim` optimizer on CUDA are host tensors, in no GPU figure.
    pub optimizer_state_bytes: u64,
    /// Float32 master weights of a `mixed-*` recipe (0 otherwise, and in inference).
    pub master_weights_bytes: u64,
    /// Bytes autograd saves for backward during the forward pass, each storage once, leaving out
    /// parameters and the input batch (0 in inference, which keeps nothing).
    pub activations_bytes: u64,
    /// The input batch and labels.
    pub input_bytes: u64,
    /// KV cache bytes (inference of causal attention).
    pub kv_cache_bytes: u64,
    /// The largest total of live activations at any moment of the forward pass: the
    /// `activations_bytes` plus `temporaries_bytes` categories (saved, held or transient). The KV
    /// cache is never in it (`kv_cache_bytes`).
    pub peak_activations_bytes: u64,
    /// Temporaries of one optimizer step (`foreach` implementations), plus the float32 copies
    /// of 16-bit gradients under a `mixed-*` recipe.
    pub optimizer_temporaries_bytes: u64,
    /// What stays allocated between two steps: parameters, buffers, master weights, the optimizer
    /// state the allocator counts and an EMA copy. No gradients: `zero_grad(set_to_none=True)`
    /// (PyTorch's default since 2.0) frees them; no input batch. In inference: the parameters
    /// and buffers.
    pub held_between_steps_bytes: u64,
    /// What is live when the forward pass has returned (the loss computed, backward not begun):
    /// what is held between steps, the batch, the tensors saved for backward, the output and the
    /// loss (in inference: the output, and the KV cache).
    pub held_after_forward_bytes: u64,
    /// With `--grad-accum N` (N > 1): the peak of one of micro-batches 2..N, which run with the
    /// gradients of the earlier ones live (each backward adds into `.grad` in place); the
    /// step's peak (`peak_bytes`) is the largest of this, the first micro-batch's and the
    /// optimizer step's. Absent without accumulation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accumulating_peak_bytes: Option<u64>,
    /// With `--paged`: the optimizer state in bitsandbytes' paged (CUDA unified) memory. PyTorch's
    /// allocator does not count it, so it is in neither `peak_bytes` nor the budget check; the
    /// driver moves its pages to host memory when the GPU runs short. Absent without `--paged`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paged_optimizer_state_bytes: Option<u64>,
    /// With `--ema`: the EMA copy of the weights (and buffers), counted with the optimizer state
    /// in `at_peak` and `category_max`. Absent without `--ema`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ema_bytes: Option<u64>,
    /// The estimated memory needed: the peak of the simulated step. On CUDA it counts the
    /// device's tensors only, as `torch.cuda.max_memory_allocated` does: a non-fused
    /// `torch.optim` optimizer's `step` counters live on the host (`torch.tensor(0.0)`), so they
    /// are in `optimizer_state_bytes` but not here, and this never exceeds
    /// `allocated_peak_bytes`. On the CPU every tensor counts.
    pub total_bytes: u64,
    /// Same as `total_bytes`.
    pub peak_bytes: u64,
    /// With `--device cuda`: what `torch.cuda.max_memory_allocated()` reports for the step,
    /// the tensors as the CUDA caching allocator hands them out (each rounded up to 512 B, a
    /// large block's unsplit rest of up to 1 MiB included). Absent for the CPU and with `--gpus`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocated_peak_bytes: Option<u64>,
    /// With `--device cuda`: what `torch.cuda.max_memory_reserved()` reports for the step, the
    /// caching allocator's segments (2 MiB for requests up to 1 MiB, 20 MiB up to 10 MiB, larger
    /// ones rounded up to 2 MiB; best fit, split and merged, never released within a step; or
    /// its expandable segments with `--expandable-segments`), after a first step has created
    /// the optimizer state. Absent for the CPU and with `--gpus`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved_peak_bytes: Option<u64>,
    /// Phase of the peak.
    pub peak_phase: Phase,
    /// Layer running at the peak, when there is one.
    pub peak_layer: Option<String>,
    /// What the peak is made of, per category (bytes; they sum to `peak_bytes`).
    pub at_peak: CategoryBytes,
    /// Each category's own maximum during the step.
    pub category_max: CategoryBytes,
    /// `--gpu`: the card, its total and what PyTorch can use of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuReport>,
    /// On a GPU (`--device cuda`): the CUDA context and PyTorch's CUDA runtime (absent on the
    /// CPU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_context_bytes: Option<u64>,
    /// On a GPU: cuBLAS and cuBLASLt workspaces, one of each per cuBLAS handle
    /// ([`crate::gpu::DeviceTerms`]); absent on the CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace_bytes: Option<u64>,
    /// On a GPU: what `nvidia-smi` shows for the process, the reserved peak plus the context
    /// and the workspaces; absent on the CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_bytes: Option<u64>,
    /// The budget check, when `--budget` (or `--gpu`) was given.
    pub budget: Option<Budget>,
    /// `--mode generate`: each phase's peak. The rest of the report describes the phase that
    /// peaks (its forward pass), except `kv_cache_bytes`, the cache at the end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<GenerationReport>,
    /// One entry per layer (layers of repeated blocks once, with `repeat` copies).
    pub layers: Vec<LayerReport>,
    /// The `--max-batch`/`--max-context` search, when one ran: serialized as one top-level key,
    /// `max_batch` or `max_context`, whose value is the largest size that fits (0 when none does;
    /// the report is then at the size asked for).
    #[serde(flatten)]
    pub search: Option<SearchOutcome>,
    /// With `--explain`: the largest tensors live at the peak, largest first (at most
    /// [`EXPLAIN_TOP`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub explain: Option<Vec<ExplainedTensor>>,
    /// With `--timeline`: the step over time (not in the JSON).
    #[serde(skip)]
    #[schemars(skip)]
    pub timeline: Option<Timeline>,
    /// Flags or settings that had no effect (left out of the JSON when empty).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<Warning>,
    /// Several GPUs (`--gpus`): the plan and each model state before and after sharding. The
    /// other byte figures of the report are then per GPU (the worst rank). Left out on one GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel: Option<ParallelReport>,
}

/// What each GPU holds under a parallel plan, beside what one GPU would hold alone.
#[derive(Clone, Debug, Serialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct ParallelReport {
    /// The plan.
    pub plan: crate::parallel::Plan,
    /// The plan in words, e.g. `FSDP full-shard over 8 GPUs`.
    pub description: String,
    /// Ranks in all (`--gpus`).
    pub world_size: u64,
    /// Data-parallel ranks: `gpus / (tp · pp · cp)`.
    pub data_parallel: u64,
    /// The model states of the whole model, as one GPU would hold them.
    pub unsharded: ModelStates,
    /// The model states on each GPU (the worst rank; every rank holds the same here).
    pub per_gpu: ModelStates,
    /// The communication buffers' own maximum during the step (DDP buckets, gathered
    /// parameters, reduce buckets), per GPU.
    pub comm_buffers_bytes: u64,
    /// Bytes on the host (CPU) per GPU, for offloaded state (0: no offload): optimizer state,
    /// master partitions, gradient partitions and parameter shards as the engine keeps them
    /// there, staging buffers included (see `parallel::Offload`). NVMe offload: 0 (the state is
    /// on disk; the host's swap buffers are not modelled).
    pub cpu_bytes: u64,
    /// Of `cpu_bytes`, the page-locked (pinned) bytes.
    pub cpu_pinned_bytes: u64,
    /// NCCL's own buffers on each GPU (`parallel::nccl`: an approximation of the default
    /// channels and protocol buffers, not a measurement); 0 on `--device cpu` (gloo). Counted
    /// in `device_bytes`.
    pub nccl_bytes: u64,
    /// `--min-gpus`: the search for the fewest GPUs the plan fits on (the report is at that
    /// world size when one was found).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_gpus: Option<MinGpus>,
    /// Pipeline parallelism (`--pp`): each pipeline stage's figures, first stage first (left
    /// out without a pipeline). The report's other figures are the worst stage's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<StageReport>,
    /// DDP's gradient buckets (left out under other engines).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ddp_buckets: Option<DdpBucketsReport>,
}

/// DDP's flat gradient buckets on each GPU, bytes of each in the Reducer's order (PyTorch
/// 2.15, `torch/nn/parallel/distributed.py` `_ddp_init_helper` and `reducer.cpp`
/// `Reducer::rebuild_buckets`). Without `gradient_as_bucket_view` they are a second copy of the
/// gradients that lives as long as the model; with it the gradients are views into them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct DdpBucketsReport {
    /// At construction: one bucket per gradient dtype (`find_unused_parameters=False` makes the
    /// limit `sys.maxsize`), last-registered parameters' bucket first.
    pub initial_bytes: Vec<u64>,
    /// From the second iteration on: rebuilt in the order the first backward made the
    /// gradients, the first bucket closing at 1 MiB (with the default `bucket_cap_mb`; at the
    /// cap when one is given) and the others at `bucket_cap_mb`.
    pub rebuilt_bytes: Vec<u64>,
}

/// The outcome of `--min-gpus`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct MinGpus {
    /// The budget per GPU, in bytes (`--budget`, or the `--gpu`'s memory).
    pub budget_bytes: u64,
    /// The fewest GPUs on which each GPU's figure fits the budget; `null` when none up to
    /// `searched_up_to` does (or the per-GPU figure stopped falling: nothing more is sharded).
    pub gpus: Option<u64>,
    /// The largest world size tried.
    pub searched_up_to: u64,
    /// When no number fits: the per-GPU figure where the search ended and the part of it that
    /// more GPUs cannot remove (the plan's most favourable tensor- and pipeline-parallel
    /// degree: the smallest such part). `null` when a number fits.
    pub fixed: Option<FixedCost>,
}

/// Where `--min-gpus` found no number of GPUs: the figure the budget checks at the largest
/// world size tried, and of it what no further sharding removes. Of a model state the plan
/// divides (its per-GPU figure below the whole model's), the per-GPU partition shrinks with
/// more ranks; everything else at the peak does not: the runtime beside the tensors, the
/// activations, temporaries, input and communication buffers, and the model states not
/// divided.
/// When `fixed_bytes` exceeds the budget, no number of GPUs can fit under this plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct FixedCost {
    /// The world size where the search ended.
    pub gpus: u64,
    /// The figure the budget checks there, per GPU.
    pub checked_bytes: u64,
    /// Of it, what more GPUs do not remove: the sum of the three parts below.
    pub fixed_bytes: u64,
    /// What the checked figure adds to the tensor peak: the CUDA context, cuBLAS workspaces,
    /// NCCL's buffers, and the caching allocator's reserve beyond the tensors (0 when the
    /// budget checks the tensor peak, as on the CPU).
    pub runtime_bytes: u64,
    /// Activations, temporaries (gathered parameters and optimizer temporaries among them),
    /// the input batch, the KV cache and communication buffers at the peak.
    pub activations_bytes: u64,
    /// Parameters, buffers, gradients, optimizer state and master weights at the peak that the
    /// plan does not divide: the states it keeps whole on every GPU (DDP's replicas), and what
    /// exceeds a divided state's per-GPU partition (a layer's whole gradients before their
    /// reduce-scatter).
    pub replicated_bytes: u64,
}

impl FixedCost {
    /// The fixed part of `r`'s checked figure (a report of a multi-GPU plan at `gpus` ranks):
    /// the checked figure less, for each model state the plan divides (`ParallelReport`: its
    /// per-GPU figure below the whole model's), its per-GPU partition live at the peak.
    #[must_use]
    pub fn of(r: &Report, gpus: u64) -> FixedCost {
        use crate::sim::Category as C;
        let checked = r.budget.as_ref().map_or(r.peak_bytes, |b| b.checked_bytes);
        let runtime = checked.saturating_sub(r.peak_bytes);
        // Per model state: its per-GPU partition when the plan divides it (the part more
        // ranks shrink), else nothing.
        let (params, grads, optim, master) = r.parallel.as_ref().map_or((0, 0, 0, 0), |p| {
            let (u, g) = (&p.unsharded, &p.per_gpu);
            let part = |whole: u64, per: u64| if per < whole { per } else { 0 };
            let optim = part(u.optimizer_state_bytes, g.optimizer_state_bytes);
            (
                part(u.parameters_bytes, g.parameters_bytes),
                part(u.gradients_bytes, g.gradients_bytes),
                optim,
                // Master weights that only the plan creates (DeepSpeed's float32 partitions)
                // are divided as the optimizer state is.
                if u.master_weights_bytes == 0 && optim > 0 {
                    g.master_weights_bytes
                } else {
                    part(u.master_weights_bytes, g.master_weights_bytes)
                },
            )
        });
        let at = |c| r.at_peak.get(c);
        // At the peak, what exceeds a divided state's partition (a layer's whole gradients
        // before their reduce-scatter, gathered parameters) is not divided either.
        let replicated = [
            (C::Buffers, 0),
            (C::Parameters, params),
            (C::Gradients, grads),
            (C::OptimizerState, optim),
            (C::MasterWeights, master),
        ]
        .into_iter()
        .fold(0u64, |a, (c, part)| {
            a.saturating_add(at(c).saturating_sub(part))
        });
        let activations = [
            C::Activations,
            C::Temporaries,
            C::Input,
            C::KvCache,
            C::CommBuffers,
        ]
        .into_iter()
        .fold(0u64, |a, c| a.saturating_add(at(c)));
        FixedCost {
            gpus,
            checked_bytes: checked,
            fixed_bytes: runtime
                .saturating_add(activations)
                .saturating_add(replicated),
            runtime_bytes: runtime,
            activations_bytes: activations,
            replicated_bytes: replicated,
        }
    }
}

/// `--plan auto`: the plans on `--gpus N`, cheapest in memory first (the `--format json`
/// output, described by `schema/plans.schema.json`).
#[derive(Clone, Debug, Serialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct PlansReport {
    /// The model.
    pub model: String,
    /// GPUs in all.
    pub gpus: u64,
    /// The budget per GPU, if any.
    pub budget_bytes: Option<u64>,
    /// One row per plan that could be estimated, by `checked_bytes` then `cpu_bytes`.
    pub plans: Vec<PlanRow>,
}

impl PlansReport {
    /// Pretty-printed JSON, keys sorted at every level (as [`Report::to_json`]).
    ///
    /// # Errors
    /// None in practice: every field serializes.
    pub fn to_json(&self) -> Result<String, serde_json::Error> {
        let value = serde_json::to_value(self)?;
        serde_json::to_string_pretty(&value)
    }
}

/// The schema of `--plan auto`'s JSON output, published as `schema/plans.schema.json`.
#[must_use]
pub fn plans_json_schema() -> Schema {
    schemars::schema_for!(PlansReport)
}

/// One plan of `--plan auto`.
#[derive(Clone, Debug, Serialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct PlanRow {
    /// The plan in words.
    pub description: String,
    /// The plan.
    pub plan: crate::parallel::Plan,
    /// Each GPU's peak of tensors (the worst rank).
    pub peak_bytes: u64,
    /// The figure the budget checks (`device_bytes` on a GPU by default, else the peak).
    pub checked_bytes: u64,
    /// Host bytes per GPU for offloaded state.
    pub cpu_bytes: u64,
    /// Whether `checked_bytes` fits the budget (`null` without one).
    pub fits: Option<bool>,
}

/// One pipeline stage (pipeline rank): its blocks, its model states, the micro-batches it
/// holds in flight and its peak.
#[derive(Clone, Debug, Serialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct StageReport {
    /// The pipeline rank, from 0 (the first stage: embeddings).
    pub stage: u64,
    /// Its repeated blocks (e.g. decoder layers), per model chunk: `[first, end)` over the
    /// model's copies, counted from 0.
    pub blocks: Vec<[u64; 2]>,
    /// Per model chunk, the most micro-batches whose activations it holds at once.
    pub micro_batches_in_flight: Vec<u64>,
    /// Its model states.
    pub model_states: ModelStates,
    /// What one micro-batch's forward saves for backward on this stage (its received input
    /// included when its operators save it).
    pub saved_per_micro_batch_bytes: u64,
    /// What one micro-batch keeps from its forward to its backward on this stage (saved
    /// tensors, received input, and on the last stage the output and loss).
    pub held_per_micro_batch_bytes: u64,
    /// Activations received from the previous stage and sent to the next, per micro-batch:
    /// the point-to-point buffers (the gradients going back are the same size).
    pub p2p_bytes: u64,
    /// Its activations at its peak: its micro-batches in flight.
    pub activations_bytes: u64,
    /// Its peak.
    pub peak_bytes: u64,
}

/// Parameters, gradients, optimizer state and master weights, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct ModelStates {
    /// Parameters.
    pub parameters_bytes: u64,
    /// Gradients.
    pub gradients_bytes: u64,
    /// Optimizer state.
    pub optimizer_state_bytes: u64,
    /// Master weights (DeepSpeed's float32 partitions, or a `mixed-*` recipe's).
    pub master_weights_bytes: u64,
}

/// A `--sweep`: one report per value (the `--format json` output of a sweep, described by
/// `schema/sweep.schema.json`).
#[derive(Clone, Debug, Serialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct SweepReport {
    /// What varies: `batch` or `seq`.
    pub dimension: &'static str,
    /// The values, ascending.
    pub values: Vec<u64>,
    /// One report per value, in the same order.
    pub sweep: Vec<Report>,
}

impl SweepReport {
    /// Pretty-printed JSON, keys sorted at every level (as [`Report::to_json`]).
    ///
    /// # Errors
    /// None in practice: every field serializes.
    pub fn to_json(&self) -> Result<String, serde_json::Error> {
        json_text(|w| self.write_json(w))
    }

    /// Writes [`SweepReport::to_json`]'s text (without a final newline) to `w`, each report
    /// streamed as [`Report::write_json`] streams it.
    ///
    /// # Errors
    /// When writing to `w` fails (an I/O error inside the [`serde_json::Error`]).
    pub fn write_json(&self, w: impl std::io::Write) -> Result<(), serde_json::Error> {
        self.serialize_sorted(&mut serde_json::Serializer::pretty(w))
    }

    /// `{"dimension", "sweep", "values"}` in that (sorted) order, each report through
    /// [`SortedReport`]; the head of each is checked to hold every key the derived form has
    /// (a test compares the two).
    fn serialize_sorted<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(3))?;
        map.serialize_entry("dimension", self.dimension)?;
        map.serialize_entry("sweep", &SortedSeq(&self.sweep, SortedReport))?;
        map.serialize_entry("values", &self.values)?;
        map.end()
    }
}

/// The schema of a sweep's JSON output (draft 2020-12), published as
/// `schema/sweep.schema.json`.
#[must_use]
pub fn sweep_json_schema() -> Schema {
    schemars::schema_for!(SweepReport)
}

/// The two phases of `model.generate` ([`crate::trace::Pass`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum GenerationPhase {
    /// The prompt's forward pass.
    Prefill,
    /// The last decode step (the largest cache).
    Decode,
}

impl GenerationPhase {
    /// Display name.
    #[must_use]
    pub const fn title(self) -> &'static str {
        match self {
            GenerationPhase::Prefill => "prefill",
            GenerationPhase::Decode => "decode",
        }
    }
}

/// `--mode generate`: the prefill and the decode steps, each with its peak.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct GenerationReport {
    /// Prompt tokens per sequence (the `seq`).
    pub prompt_tokens: u64,
    /// Tokens generated per sequence (`max_new_tokens`): one from the prefill's logits, one
    /// from each of the `new_tokens - 1` decode steps.
    pub new_tokens: u64,
    /// Tokens in each layer's cache at the end: `prompt_tokens + new_tokens - 1` (the last
    /// token is never fed back), fewer in a sliding window.
    pub cached_tokens: u64,
    /// Peak of the prefill (the prompt's forward and its next-token logits).
    pub prefill_peak_bytes: u64,
    /// Peak of the last decode step, the largest (0 when `new_tokens` is 1: no decode step).
    pub decode_peak_bytes: u64,
    /// Which phase peaks (`peak_bytes` is its peak).
    pub peak_phase: GenerationPhase,
}

/// How many tensors `--explain` lists.
pub const EXPLAIN_TOP: usize = 10;

/// A tensor live at the peak, or alike ones (`--explain`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct ExplainedTensor {
    /// What it is (`output`, `softmax output`, `weight`, `gradient of output`, …); under a
    /// sharded plan a parameter's part on this GPU is `parameter (shard)`, with the whole
    /// parameter's shape and the shard's bytes.
    pub what: String,
    /// Dotted path of the layer that made it.
    pub layer: String,
    /// The ATen operator that allocated it (`addmm`, `_softmax`, …); null for parameters,
    /// buffers, the input batch and gradients.
    pub op: Option<&'static str>,
    /// Its shape.
    pub shape: Shape,
    /// Its dtype.
    pub dtype: DType,
    /// The size of one.
    pub bytes: u64,
    /// How many alike are live (the copies of a repeated block's tensor).
    pub count: u64,
    /// `bytes × count`, what the list is ordered by.
    pub total_bytes: u64,
    /// The category it counts in at the peak.
    pub category: Category,
}

/// The [`EXPLAIN_TOP`] largest of `live`, alike tensors (same name, layer, operator, shape,
/// dtype and category: the copies of a repeated block's) as one entry with their count,
/// ordered by their total, then by first appearance.
fn explained(tape: &Tape, live: &[crate::sim::LiveTensor]) -> Vec<ExplainedTensor> {
    let mut groups: Vec<ExplainedTensor> = Vec::new();
    let mut index: std::collections::HashMap<ExplainedTensor, usize> =
        std::collections::HashMap::new();
    for t in live {
        let key = ExplainedTensor {
            what: t.what.clone(),
            layer: tape.layers[t.layer].path.clone(),
            op: t.op.map(crate::trace::AtenOp::name),
            shape: t.shape.clone(),
            dtype: t.dtype,
            bytes: t.bytes,
            count: 0,
            total_bytes: 0,
            category: t.category,
        };
        let i = *index.entry(key.clone()).or_insert_with(|| {
            groups.push(key);
            groups.len() - 1
        });
        let g = &mut groups[i];
        g.count += 1;
        g.total_bytes = g.total_bytes.saturating_add(g.bytes);
    }
    groups.sort_by_key(|g| std::cmp::Reverse(g.total_bytes));
    groups.truncate(EXPLAIN_TOP);
    groups
}

/// What the budget search varies (`--max-batch`, `--max-context`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dimension {
    /// The micro-batch size (`--batch`).
    Batch,
    /// The sequence length (`--seq`), i.e. the context of an inference pass.
    Context,
}

impl Dimension {
    /// `batch` or `context`, as the output names it.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Dimension::Batch => "batch",
            Dimension::Context => "context",
        }
    }
}

/// The result of a budget search.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SearchOutcome {
    /// What was varied.
    pub dimension: Dimension,
    /// The budget searched against, in bytes.
    pub budget_bytes: u64,
    /// The largest size that fits, `None` when not even the smallest does.
    pub largest: Option<u64>,
}

impl Serialize for SearchOutcome {
    /// `{"max_batch": n}` or `{"max_context": n}`, with 0 when nothing fits.
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let key = match self.dimension {
            Dimension::Batch => "max_batch",
            Dimension::Context => "max_context",
        };
        let mut map = s.serialize_map(Some(1))?;
        map.serialize_entry(key, &self.largest.unwrap_or(0))?;
        map.end()
    }
}

impl JsonSchema for SearchOutcome {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "SearchOutcome".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        let size = json_schema!({"type": "integer", "format": "uint64", "minimum": 0});
        json_schema!({
            "description": "The largest size that fits the --budget (0 when none does); one of the two keys, with --max-batch or --max-context.",
            "type": "object",
            "properties": {"max_batch": size, "max_context": size}
        })
    }
}

/// The schema of a report as JSON Schema (draft 2020-12): what `--format json` prints, published
/// as `schema/report.schema.json`.
#[must_use]
pub fn json_schema() -> Schema {
    schemars::schema_for!(Report)
}

impl JsonSchema for DType {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "DType".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        let names: Vec<&str> = DType::ALL.iter().map(|d| d.as_str()).collect();
        json_schema!({"description": "A PyTorch dtype.", "type": "string", "enum": names})
    }
}

impl JsonSchema for LayerKind {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "LayerKind".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        let names: Vec<&str> = LayerKind::ALL.iter().map(|k| k.as_str()).collect();
        json_schema!({"description": "A layer kind.", "type": "string", "enum": names})
    }
}

impl JsonSchema for Shape {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Shape".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "A tensor shape, batch dimension first.",
            "type": "array",
            "items": {"type": "integer", "format": "uint64", "minimum": 0}
        })
    }
}

/// A budget check.
#[derive(Clone, Debug, Serialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Budget {
    /// The budget in bytes.
    pub budget_bytes: u64,
    /// Which figure is checked (`--budget-on`): `device` (`device_bytes`, the default on a
    /// GPU), `reserved` (`reserved_peak_bytes`) or `allocated` (`allocated_peak_bytes`; on the
    /// CPU always, as `total_bytes`). Where the allocator is not modelled (a multi-GPU plan
    /// other than DDP or FSDP alone: [`crate::sim::Simulation::allocator`]), reserved and
    /// allocated are `total_bytes`.
    pub on: BudgetOn,
    /// The figure checked, in bytes.
    pub checked_bytes: u64,
    /// Whether `checked_bytes <= budget_bytes`.
    pub fits: bool,
    /// `checked_bytes - budget_bytes` when over, else 0.
    pub overshoot_bytes: u64,
}

/// The GPU named with `--gpu`.
#[derive(Clone, Debug, Serialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct GpuReport {
    /// Its catalog id (`memest gpus`).
    pub name: String,
    /// Total device memory, as the driver reports it (`data/gpus.toml`).
    pub total_bytes: u64,
    /// The CUDA compute capability (`9.0`) or the AMD gfx target (`gfx942`).
    pub compute_capability: String,
    /// What PyTorch's caching allocator can use: the total less the CUDA context and the
    /// cuBLAS workspaces.
    pub usable_bytes: u64,
}

/// The peaks the caching allocator reports, `(max_memory_allocated, max_memory_reserved)`:
/// the allocator model's ([`Simulation::allocator`]); where it does not run (the CPU, a
/// multi-GPU plan other than DDP or FSDP alone) both are the tensor peak.
fn allocator_peaks(sim: &Simulation) -> (u64, u64) {
    sim.allocator.map_or((sim.peak_bytes, sim.peak_bytes), |a| {
        (a.allocated_peak_bytes, a.reserved_peak_bytes)
    })
}

/// One layer's figures, summed over its `repeat` copies.
#[derive(Clone, Debug, Serialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct LayerReport {
    /// Layer name.
    pub name: String,
    /// Dotted path through blocks.
    pub path: String,
    /// Kind, as named in model files (`linear`, `attention`, …).
    pub kind: LayerKind,
    /// Number of copies (product of enclosing repeat counts).
    pub repeat: u64,
    /// Output shape of one copy.
    pub output_shape: Shape,
    /// Parameters, all copies.
    pub params: u64,
    /// Parameter bytes, all copies.
    pub parameter_bytes: u64,
    /// Bytes saved for backward first by this layer, all copies.
    pub activation_bytes: u64,
    /// What one copy keeps, e.g. `input f32 [8, 64, 56, 56]`.
    pub kept: Vec<Kept>,
}

/// Bytes per memory category, in report order (the table's rows).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct CategoryBytes {
    /// [`Category::Parameters`].
    pub parameters_bytes: u64,
    /// [`Category::Buffers`].
    pub buffers_bytes: u64,
    /// [`Category::Gradients`].
    pub gradients_bytes: u64,
    /// [`Category::MasterWeights`].
    pub master_weights_bytes: u64,
    /// [`Category::OptimizerState`].
    pub optimizer_state_bytes: u64,
    /// [`Category::Activations`].
    pub activations_bytes: u64,
    /// [`Category::Temporaries`].
    pub temporaries_bytes: u64,
    /// [`Category::Input`].
    pub input_bytes: u64,
    /// [`Category::KvCache`].
    pub kv_cache_bytes: u64,
    /// [`Category::CommBuffers`] (only with `--gpus`; left out of the JSON when 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub comm_buffers_bytes: u64,
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's signature
fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl CategoryBytes {
    /// The bytes of one category.
    #[must_use]
    pub const fn get(&self, c: Category) -> u64 {
        match c {
            Category::Parameters => self.parameters_bytes,
            Category::Buffers => self.buffers_bytes,
            Category::Gradients => self.gradients_bytes,
            Category::MasterWeights => self.master_weights_bytes,
            Category::OptimizerState => self.optimizer_state_bytes,
            Category::Activations => self.activations_bytes,
            Category::Temporaries => self.temporaries_bytes,
            Category::Input => self.input_bytes,
            Category::KvCache => self.kv_cache_bytes,
            Category::CommBuffers => self.comm_buffers_bytes,
        }
    }

    const fn slot(&mut self, c: Category) -> &mut u64 {
        match c {
            Category::Parameters => &mut self.parameters_bytes,
            Category::Buffers => &mut self.buffers_bytes,
            Category::Gradients => &mut self.gradients_bytes,
            Category::MasterWeights => &mut self.master_weights_bytes,
            Category::OptimizerState => &mut self.optimizer_state_bytes,
            Category::Activations => &mut self.activations_bytes,
            Category::Temporaries => &mut self.temporaries_bytes,
            Category::Input => &mut self.input_bytes,
            Category::KvCache => &mut self.kv_cache_bytes,
            Category::CommBuffers => &mut self.comm_buffers_bytes,
        }
    }

    fn from_values(values: &[u64; Category::COUNT]) -> CategoryBytes {
        let mut bytes = CategoryBytes::default();
        for (c, &v) in Category::ALL.iter().zip(values) {
            *bytes.slot(*c) = v;
        }
        bytes
    }
}

impl Report {
    /// Assembles the report from a traced tape and its simulation. On a GPU it adds the CUDA
    /// context and workspaces ([`DeviceTerms`]) and checks the budget against the figure
    /// `settings.budget_on` names; on the CPU against the tensor peak.
    ///
    /// # Errors
    /// [`Error::Overflow`] when the device figure does not fit in 64 bits.
    pub fn new(
        model: &str,
        settings: &Settings,
        tape: &Tape,
        sim: &Simulation,
        budget: Option<u64>,
    ) -> Result<Report, Error> {
        let bytes_of = |kind: StorageKind| -> u64 {
            tape.storages
                .iter()
                .filter(|s| s.kind == kind)
                .map(|s| s.bytes)
                .sum()
        };
        let layers = layer_reports(tape, sim);
        let total = sim.peak_bytes;
        let trainable_param_count = tape
            .params
            .iter()
            .filter(|p| p.trainable)
            .map(|p| p.numel)
            .sum();
        let (allocated, reserved) = allocator_peaks(sim);
        // NCCL's buffers: on CUDA under a plan of several GPUs (gloo on the CPU has none).
        let nccl = match (&settings.parallel, settings.device) {
            (Some(p), Device::Cuda) if sim.unsharded.is_some() => {
                crate::parallel::nccl::plan_bytes(p)
            }
            _ => 0,
        };
        let terms = match settings.device {
            Device::Cuda => Some(DeviceTerms::new(
                &settings.arch,
                settings.cuda_context,
                reserved,
                settings.training(),
            )?)
            .map(|mut t| {
                t.device_bytes = t.device_bytes.saturating_add(nccl);
                t
            }),
            Device::Cpu => None,
        };
        let (on, checked) = match (&terms, settings.budget_on) {
            (None, _) | (Some(_), BudgetOn::Allocated) => (BudgetOn::Allocated, allocated),
            (Some(_), BudgetOn::Reserved) => (BudgetOn::Reserved, reserved),
            (Some(t), BudgetOn::Device) => (BudgetOn::Device, t.device_bytes),
        };
        let gpu = match (settings.gpu, &terms) {
            (Some(g), Some(t)) => Some(GpuReport {
                name: g.id.clone(),
                total_bytes: g.total_bytes,
                compute_capability: g.arch.to_string(),
                usable_bytes: g
                    .total_bytes
                    .saturating_sub(t.cuda_context_bytes)
                    .saturating_sub(t.workspace_bytes),
            }),
            _ => None,
        };
        Ok(Report {
            model: model.to_string(),
            settings: settings.clone(),
            recipe: RecipeReport::new(
                &settings.recipe,
                StepUse {
                    training: settings.training(),
                    optimizer: settings.optimizer,
                    state_bytes: sim.optimizer_state_bytes,
                    trainable_params: trainable_param_count,
                    stored_bytes_per_param: settings.quant.map(|_| {
                        let (bytes, count) = tape.params.iter().fold((0u64, 0u64), |(b, n), p| {
                            (b.saturating_add(p.bytes), n.saturating_add(p.numel))
                        });
                        #[allow(clippy::cast_precision_loss)] // an average for display
                        let avg = bytes as f64 / count.max(1) as f64;
                        (avg * 1000.0).round() / 1000.0
                    }),
                    trainable_dtype: tape
                        .params
                        .iter()
                        .find(|p| p.trainable)
                        .map(|p| tape.values[p.value].dtype)
                        .filter(|&d| settings.lora.is_some() && d != settings.recipe.weights),
                },
            ),
            input_shape: tape.input_shape.clone(),
            param_count: tape.params.iter().map(|p| p.numel).sum(),
            trainable_param_count,
            parameters_bytes: sim
                .resident_parameter_bytes
                .unwrap_or_else(|| tape.params.iter().map(|p| p.bytes).sum()),
            parameters_by_dtype: tape.params.iter().fold(BTreeMap::new(), |mut m, p| {
                *m.entry(p.dtype_name).or_insert(0) += p.bytes;
                m
            }),
            param_count_by_dtype: tape.params.iter().fold(BTreeMap::new(), |mut m, p| {
                *m.entry(p.dtype_name).or_insert(0) += p.numel;
                m
            }),
            buffers_bytes: bytes_of(StorageKind::Buffer),
            gradients_bytes: sim.gradient_bytes,
            optimizer_state_bytes: sim.optimizer_state_bytes,
            master_weights_bytes: sim.master_weights_bytes,
            activations_bytes: sim.saved_bytes,
            input_bytes: bytes_of(StorageKind::Input),
            kv_cache_bytes: bytes_of(StorageKind::KvCache),
            peak_activations_bytes: sim.peak_live_activations,
            optimizer_temporaries_bytes: sim.optimizer_temp_bytes,
            held_between_steps_bytes: sim.held.between_steps,
            held_after_forward_bytes: sim.held.after_forward,
            accumulating_peak_bytes: sim.held.accumulating_peak,
            paged_optimizer_state_bytes: settings.paged.then_some(sim.paged_state_bytes),
            ema_bytes: settings.ema.map(|_| sim.ema_bytes),
            total_bytes: total,
            peak_bytes: total,
            allocated_peak_bytes: sim.allocator.map(|a| a.allocated_peak_bytes),
            reserved_peak_bytes: sim.allocator.map(|a| a.reserved_peak_bytes),
            peak_phase: sim.peak_phase,
            peak_layer: sim.peak_layer.map(|l| tape.layers[l].path.clone()),
            at_peak: CategoryBytes::from_values(&sim.at_peak),
            category_max: CategoryBytes::from_values(&sim.category_max),
            gpu,
            cuda_context_bytes: terms.as_ref().map(|t| t.cuda_context_bytes),
            workspace_bytes: terms.as_ref().map(|t| t.workspace_bytes),
            device_bytes: terms.as_ref().map(|t| t.device_bytes),
            budget: budget.map(|b| Budget {
                budget_bytes: b,
                on,
                checked_bytes: checked,
                fits: checked <= b,
                overshoot_bytes: checked.saturating_sub(b),
            }),
            generation: None,
            layers,
            search: None,
            explain: sim.live_at_peak.as_ref().map(|live| explained(tape, live)),
            timeline: sim.timeline.clone(),
            warnings: Vec::new(),
            parallel: settings
                .parallel
                .as_ref()
                .zip(sim.unsharded)
                .map(|(plan, u)| ParallelReport {
                    plan: plan.clone(),
                    description: plan.describe(),
                    world_size: plan.gpus,
                    data_parallel: plan.data_parallel().unwrap_or(1),
                    unsharded: ModelStates {
                        parameters_bytes: u[0],
                        gradients_bytes: u[1],
                        optimizer_state_bytes: u[2],
                        master_weights_bytes: u[3],
                    },
                    per_gpu: ModelStates {
                        parameters_bytes: sim.resident_parameter_bytes.unwrap_or(u[0]),
                        gradients_bytes: sim.gradient_bytes,
                        optimizer_state_bytes: sim.optimizer_state_bytes,
                        master_weights_bytes: sim.master_weights_bytes,
                    },
                    comm_buffers_bytes: sim.category_max[Category::CommBuffers as usize],
                    cpu_bytes: sim.cpu_bytes[0],
                    cpu_pinned_bytes: sim.cpu_bytes[1],
                    nccl_bytes: nccl,
                    min_gpus: None,
                    stages: sim
                        .stages
                        .iter()
                        .map(|f| StageReport {
                            stage: f.stage,
                            blocks: f.blocks.iter().map(|&(a, b)| [a, b]).collect(),
                            micro_batches_in_flight: f.in_flight.clone(),
                            model_states: ModelStates {
                                parameters_bytes: f.model_states[0],
                                gradients_bytes: f.model_states[1],
                                optimizer_state_bytes: f.model_states[2],
                                master_weights_bytes: f.model_states[3],
                            },
                            saved_per_micro_batch_bytes: f.saved_per_micro_batch_bytes,
                            held_per_micro_batch_bytes: f.held_per_micro_batch_bytes,
                            p2p_bytes: f.p2p_bytes,
                            activations_bytes: f.at_peak[Category::Activations as usize],
                            peak_bytes: f.peak_bytes,
                        })
                        .collect(),
                    ddp_buckets: sim.ddp_buckets.as_ref().map(|[i, r]| DdpBucketsReport {
                        initial_bytes: i.clone(),
                        rebuilt_bytes: r.clone(),
                    }),
                }),
        })
    }

    /// The report as pretty-printed JSON, keys sorted alphabetically at every level (the
    /// `--format json` output).
    ///
    /// # Errors
    /// None in practice: every field serializes.
    pub fn to_json(&self) -> Result<String, serde_json::Error> {
        json_text(|w| self.write_json(w))
    }

    /// Writes [`Report::to_json`]'s text (without a final newline) to `w` as it is made: the
    /// top-level keys through a [`serde_json::Value`] map (ordered by key), the per-layer
    /// rows, the bulk of a large model's report (25 MB for 100,000 layers), straight from
    /// [`Report::layers`], each row's keys written in sorted order. Give it a buffered
    /// writer.
    ///
    /// # Errors
    /// When writing to `w` fails (an I/O error inside the [`serde_json::Error`]).
    pub fn write_json(&self, w: impl std::io::Write) -> Result<(), serde_json::Error> {
        SortedReport(self).serialize(&mut serde_json::Serializer::pretty(w))
    }
}

/// The text `write` writes.
fn json_text(
    write: impl FnOnce(&mut Vec<u8>) -> Result<(), serde_json::Error>,
) -> Result<String, serde_json::Error> {
    let mut buf = Vec::new();
    write(&mut buf)?;
    // serde_json writes UTF-8 only.
    String::from_utf8(buf).map_err(serde::ser::Error::custom)
}

/// A report serialized as `serde_json::to_value` then `Value`'s serialization would write it
/// (keys sorted at every level), without building a `Value` for [`Report::layers`]: the
/// top-level entries are gathered by [`TopLevel`] (`layers` left as a placeholder), then
/// written in key order with `layers` streamed row by row ([`SortedLayer`]).
struct SortedReport<'a>(&'a Report);

impl Serialize for SortedReport<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let head = self
            .0
            .serialize(TopLevel)
            .map_err(serde::ser::Error::custom)?;
        let mut map = s.serialize_map(Some(head.len()))?;
        for (k, v) in &head {
            if k == LAYERS_KEY {
                map.serialize_entry(k, &SortedSeq(&self.0.layers, SortedLayer))?;
            } else {
                map.serialize_entry(k, v)?;
            }
        }
        map.end()
    }
}

/// [`Report::layers`]' key in the JSON.
const LAYERS_KEY: &str = "layers";

/// A slice serialized as a sequence, each item wrapped by `.1` (a constructor such as
/// [`SortedLayer`]).
struct SortedSeq<'a, T, W>(&'a [T], fn(&'a T) -> W);

impl<'a, T, W: Serialize> Serialize for SortedSeq<'a, T, W> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(self.1))
    }
}

/// One [`LayerReport`] with its keys in sorted order, as a `Value` map writes them (the
/// derived `Serialize` writes them in declaration order, which the schema's `required` list
/// follows). A test checks that both give the same text.
struct SortedLayer<'a>(&'a LayerReport);

impl Serialize for SortedLayer<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let l = self.0;
        let mut row = s.serialize_struct("LayerReport", 9)?;
        row.serialize_field("activation_bytes", &l.activation_bytes)?;
        row.serialize_field("kept", &l.kept)?;
        row.serialize_field("kind", &l.kind)?;
        row.serialize_field("name", &l.name)?;
        row.serialize_field("output_shape", &l.output_shape)?;
        row.serialize_field("parameter_bytes", &l.parameter_bytes)?;
        row.serialize_field("params", &l.params)?;
        row.serialize_field("path", &l.path)?;
        row.serialize_field("repeat", &l.repeat)?;
        row.end()
    }
}

/// A serializer that takes a report's top level (a struct, or a map: `#[serde(flatten)]`
/// makes the derived code write one) and gives its entries as a key-ordered
/// [`serde_json::Map`], each value as `serde_json::to_value` makes it but `layers`, left
/// `null` for [`SortedReport`] to stream. Anything but a map or a struct is an error.
struct TopLevel;

/// The entries [`TopLevel`] gathers so far, and the key whose value comes next.
struct TopLevelMap {
    map: serde_json::Map<String, serde_json::Value>,
    key: Option<String>,
}

impl TopLevelMap {
    fn entry<T: Serialize + ?Sized>(
        &mut self,
        key: String,
        value: &T,
    ) -> Result<(), serde_json::Error> {
        let value = if key == LAYERS_KEY {
            serde_json::Value::Null
        } else {
            serde_json::to_value(value)?
        };
        self.map.insert(key, value);
        Ok(())
    }
}

impl serde::ser::SerializeMap for TopLevelMap {
    type Ok = serde_json::Map<String, serde_json::Value>;
    type Error = serde_json::Error;

    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), Self::Error> {
        match serde_json::to_value(key)? {
            serde_json::Value::String(k) => {
                self.key = Some(k);
                Ok(())
            }
            _ => Err(serde::ser::Error::custom("a report key is not a string")),
        }
    }

    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Self::Error> {
        let key = self
            .key
            .take()
            .ok_or_else(|| serde::ser::Error::custom("a report value without its key"))?;
        self.entry(key, value)
    }

    fn end(self) -> Result<Self::Ok, Self::Error> {
        Ok(self.map)
    }
}

impl serde::ser::SerializeStruct for TopLevelMap {
    type Ok = serde_json::Map<String, serde_json::Value>;
    type Error = serde_json::Error;

    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), Self::Error> {
        self.entry(key.to_string(), value)
    }

    fn end(self) -> Result<Self::Ok, Self::Error> {
        Ok(self.map)
    }
}

/// [`TopLevel`]'s answer to anything but a map or a struct.
fn not_a_map<T>() -> Result<T, serde_json::Error> {
    Err(serde::ser::Error::custom("a report serializes as a map"))
}

impl serde::Serializer for TopLevel {
    type Ok = serde_json::Map<String, serde_json::Value>;
    type Error = serde_json::Error;
    type SerializeSeq = serde::ser::Impossible<Self::Ok, Self::Error>;
    type SerializeTuple = serde::ser::Impossible<Self::Ok, Self::Error>;
    type SerializeTupleStruct = serde::ser::Impossible<Self::Ok, Self::Error>;
    type SerializeTupleVariant = serde::ser::Impossible<Self::Ok, Self::Error>;
    type SerializeMap = TopLevelMap;
    type SerializeStruct = TopLevelMap;
    type SerializeStructVariant = serde::ser::Impossible<Self::Ok, Self::Error>;

    fn serialize_map(self, _: Option<usize>) -> Result<TopLevelMap, Self::Error> {
        Ok(TopLevelMap {
            map: serde_json::Map::new(),
            key: None,
        })
    }

    fn serialize_struct(self, _: &'static str, len: usize) -> Result<TopLevelMap, Self::Error> {
        self.serialize_map(Some(len))
    }

    fn serialize_bool(self, _: bool) -> Result<Self::Ok, Self::Error> {
        not_a_map()
    }
    fn serialize_i8(self, _: i8) -> Result<Self::Ok, Self::Error> {
        not_a_map()
    }
    fn serialize_i16(self, _: i16) -> Result<Self::Ok, Self::Error> {
        not_a_map()
    }
    fn serialize_i32(self, _: i32) -> Result<Self::Ok, Self::Error> {
        not_a_map()
    }
    fn serialize_i64(self, _: i64) -> Result<Self::Ok, Self::Error> {
        not_a_map()
    }
    fn serialize_u8(self, _: u8) -> Result<Self::Ok, Self::Error> {
        not_a_map()
    }
    fn serialize_u16(self, _: u16) -> Result<Self::Ok, Self::Error> {
        not_a_map()
    }
    fn serialize_u32(self, _: u32) -> Result<Self::Ok, Self::Error> {
        not_a_map()
    }
    fn serialize_u64(self, _: u64) -> Result<Self::Ok, Self::Error> {
        not_a_map()
    }
    fn serialize_f32(self, _: f32) -> Result<Self::Ok, Self::Error> {
        not_a_map()
    }
    fn serialize_f64(self, _: f64) -> Result<Self::Ok, Self::Error> {
        not_a_map()
    }
    fn serialize_char(self, _: char) -> Result<Self::Ok, Self::Error> {
        not_a_map()
    }
    fn serialize_str(self, _: &str) -> Result<Self::Ok, Self::Error> {
        not_a_map()
    }
    fn serialize_bytes(self, _: &[u8]) -> Result<Self::Ok, Self::Error> {
        not_a_map()
    }
    fn serialize_none(self) -> Result<Self::Ok, Self::Error> {
        not_a_map()
    }
    fn serialize_some<T: Serialize + ?Sized>(self, _: &T) -> Result<Self::Ok, Self::Error> {
        not_a_map()
    }
    fn serialize_unit(self) -> Result<Self::Ok, Self::Error> {
        not_a_map()
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<Self::Ok, Self::Error> {
        not_a_map()
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
    ) -> Result<Self::Ok, Self::Error> {
        not_a_map()
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: &T,
    ) -> Result<Self::Ok, Self::Error> {
        not_a_map()
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: &T,
    ) -> Result<Self::Ok, Self::Error> {
        not_a_map()
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Self::SerializeSeq, Self::Error> {
        not_a_map()
    }
    fn serialize_tuple(self, _: usize) -> Result<Self::SerializeTuple, Self::Error> {
        not_a_map()
    }
    fn serialize_tuple_struct(
        self,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleStruct, Self::Error> {
        not_a_map()
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleVariant, Self::Error> {
        not_a_map()
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStructVariant, Self::Error> {
        not_a_map()
    }
}

/// A tensor one copy of a layer keeps for backward. Serialized as its `Display` text,
/// e.g. `input f32 [8, 64, 56, 56] ×2`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kept {
    /// What it is: `input` (the layer's input), `checkpointed block input`, or the operator
    /// output's name (`softmax output`, `dropout mask`, …).
    pub what: &'static str,
    /// Its dtype.
    pub dtype: DType,
    /// Its shape.
    pub shape: Shape,
    /// How many such tensors one copy keeps.
    pub copies: u64,
}

impl std::fmt::Display for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {}", self.what, self.dtype.short(), self.shape)?;
        if self.copies > 1 {
            write!(f, " ×{}", self.copies)?;
        }
        Ok(())
    }
}

impl Serialize for Kept {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl JsonSchema for Kept {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Kept".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "A tensor one copy of the layer keeps: what it is, its dtype and shape, and ×N when it keeps N alike, e.g. `input f32 [8, 64, 56, 56] ×2`.",
            "type": "string"
        })
    }
}

fn layer_reports(tape: &Tape, sim: &Simulation) -> Vec<LayerReport> {
    // What each layer keeps, from the storages it is the first to save (first copy's labels),
    // ordered by their text, with how many of each all copies keep.
    let mut kept: TiVec<LayerId, BTreeMap<String, (Kept, u64)>> =
        ti_vec![BTreeMap::new(); tape.layers.len()];
    let mut keep = |layer: LayerId, what: &'static str, dtype: DType, shape: &Shape| {
        let k = Kept {
            what,
            dtype,
            shape: shape.clone(),
            copies: 1,
        };
        kept[layer].entry(k.to_string()).or_insert((k, 0)).1 += 1;
    };
    let mut seen: TiVec<StorageId, bool> = ti_vec![false; tape.storages.len()];
    if sim.saved_bytes > 0 {
        for step in tape.steps.iter().filter(|s| s.segment.is_none()) {
            for &s in &step.saves {
                let st = &tape.storages[s];
                if st.kind != StorageKind::Activation || seen[s] {
                    continue;
                }
                seen[s] = true;
                let what = if st.layer == step.layer {
                    st.what
                } else {
                    "input"
                };
                keep(step.layer, what, st.dtype, &st.shape);
            }
        }
        for seg in &tape.segments {
            let st = &tape.storages[seg.input];
            if !seen[seg.input] {
                seen[seg.input] = true;
                keep(st.layer, "checkpointed block input", st.dtype, &st.shape);
            }
        }
    }
    tape.layers
        .iter_enumerated()
        // Every layer but the input pseudo-layer, which has no kind.
        .filter_map(|(i, l)| l.kind.map(|kind| (i, l, kind)))
        .map(|(i, l, kind)| LayerReport {
            name: l.name().to_string(),
            path: l.path.clone(),
            kind,
            repeat: l.repeat,
            output_shape: l.output_shape.clone(),
            params: l.params.saturating_mul(l.repeat),
            parameter_bytes: l.parameter_bytes.saturating_mul(l.repeat),
            activation_bytes: sim.saved_by_layer[i],
            kept: kept[i]
                .values()
                .map(|(k, n)| Kept {
                    copies: (n / l.repeat.max(1)).max(1),
                    ..k.clone()
                })
                .collect(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The JSON as it was made before it was streamed: through a `Value`, whose maps are
    /// ordered by key.
    fn through_value(v: &impl Serialize) -> String {
        serde_json::to_string_pretty(&serde_json::to_value(v).unwrap()).unwrap()
    }

    /// A report with rows that keep several tensors (`kept`), a search outcome (flattened), a
    /// budget and warnings: the streamed JSON is the `Value` one, byte for byte.
    #[test]
    fn streamed_json_is_the_sorted_value_json() {
        let src = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/examples/llama_tiny.toml"
        ))
        .unwrap();
        let mut report = crate::estimate(
            &src,
            crate::spec::Format::Toml,
            "llama_tiny",
            &crate::settings::Overrides::default(),
            Some(1 << 30),
        )
        .unwrap();
        assert!(report.layers.iter().any(|l| l.kept.len() > 1));
        assert!(
            report
                .layers
                .iter()
                .any(|l| l.kept.iter().any(|k| k.copies > 1))
        );
        report.search = Some(SearchOutcome {
            dimension: Dimension::Batch,
            budget_bytes: 1 << 30,
            largest: Some(12),
        });
        report.warnings.push(Warning::CheckpointWithoutBlocks);
        let text = report.to_json().unwrap();
        assert_eq!(text, through_value(&report));
        assert!(text.contains("\"max_batch\": 12"));
        for l in &report.layers {
            assert_eq!(
                serde_json::to_string_pretty(&SortedLayer(l)).unwrap(),
                through_value(l)
            );
        }
        let sweep = SweepReport {
            dimension: "batch",
            values: vec![1, 2],
            sweep: vec![report.clone(), report],
        };
        assert_eq!(sweep.to_json().unwrap(), through_value(&sweep));
    }

    /// A failed write is the writer's I/O error (a closed pipe stays one, which the binary
    /// exits 0 on).
    #[test]
    fn a_failed_write_is_an_io_error() {
        struct Closed;
        impl std::io::Write for Closed {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::ErrorKind::BrokenPipe.into())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let report = crate::estimate(
            "[input]\nshape = [4]\n[[layers]]\nkind = \"relu\"\n",
            crate::spec::Format::Toml,
            "relu",
            &crate::settings::Overrides::default(),
            None,
        )
        .unwrap();
        let e = report.write_json(Closed).unwrap_err();
        assert_eq!(
            std::io::Error::from(e).kind(),
            std::io::ErrorKind::BrokenPipe
        );
    }

    #[test]
    fn category_bytes_keys_are_the_categories_keys() {
        let mut values = [0; Category::COUNT];
        for (i, v) in values.iter_mut().enumerate() {
            *v = i as u64 + 1;
        }
        let bytes = CategoryBytes::from_values(&values);
        let json = serde_json::to_value(bytes).unwrap();
        for (i, c) in Category::ALL.iter().enumerate() {
            assert_eq!(bytes.get(*c), i as u64 + 1);
            assert_eq!(json[c.key()], i as u64 + 1, "{}", c.key());
        }
        assert_eq!(json.as_object().unwrap().len(), Category::COUNT);
    }
}
