//! What one GPU holds under a parallel plan ([`crate::parallel::Plan`]), as the replay needs
//! it: each parameter's resident (sharded) bytes, the units whose parameters are gathered
//! around their forward and backward, when gradients are reduced to their shard, and the
//! communication buffers. Built once from the tape; the replay ([`super::replay`]) applies it.
//!
//! The figures are those of the worst rank (rank 0, which gets the first, largest chunk of
//! every FSDP2 shard).

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use crate::cost::{OptimizerPlan, TensorInfo};
use crate::dtype::DType;
use crate::parallel::{FsdpStrategy, Plan, Sharding, TpStyle, shard};
use crate::settings::Settings;
use crate::trace::{AtenOp, StorageId, Tape, ValueId};

/// When each unit's gradients shrink to this rank's shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Reduce {
    /// Never: every rank keeps whole gradients (DDP, ZeRO-0, FSDP no-shard).
    Never,
    /// After each unit's backward (FSDP's reduce-scatter in its post-backward hook; ZeRO-2 and
    /// ZeRO-3 reduce each bucket as it fills). With `into_buffer` the shard lands in a
    /// gradient partition buffer that exists all step (ZeRO-3's `grad_partitions_flat_buffer`),
    /// so only the whole gradients are freed.
    PerUnit { into_buffer: bool },
    /// DeepSpeed ZeRO-1/2's reduce buckets, gradient by gradient ([`Buckets`]).
    Buckets,
}

/// DeepSpeed ZeRO-1/2 with `contiguous_gradients` and without `overlap_comm` (the defaults),
/// as `DeepSpeedZeroOptimizer` runs a backward (`deepspeed/runtime/zero/stage_1_and_2.py`):
///
/// - `reduce_independent_p_g_buckets_and_remove_grads`, per gradient as autograd makes it:
///   when it would overflow the reduce bucket (`reduce_bucket_size` elements, allocated whole
///   at the start of backward) the bucket is reduced first; a gradient larger than the bucket
///   is reduced on its own (`extra_large_param_to_reduce`), any other is copied into the bucket
///   and its own tensor freed;
/// - `reduce_ipg_grads`: each reduced gradient of a parameter in this rank's partition is
///   copied into `grads_in_partition`, allocated at the first such copy with the elements of
///   every parameter that overlaps the partition (`copy_grads_in_partition`); ZeRO-2 frees the
///   others (`clear_grad_attribute`), ZeRO-1 keeps them (as views of the bucket, or whole when
///   they were too large for it) until the step;
/// - `step`: the gradients outside the partition are freed (`free_grad_in_param_list`), the
///   partition is flattened into a float32 copy of the partition size, then
///   `grads_in_partition` is freed and the optimizer runs on the float32 partition.
#[derive(Clone, Debug)]
pub(super) struct Buckets {
    /// 1 or 2.
    pub stage: u8,
    /// `reduce_bucket_size`, in elements.
    pub cap: u64,
    /// Per trainable parameter value: its elements and whether it overlaps this rank's
    /// partition.
    pub params: HashMap<ValueId, (u64, bool)>,
    /// `grads_in_partition`'s bytes on this rank.
    pub in_partition_bytes: u64,
    /// The float32 gradient partition of the step (`partition_size` elements).
    pub flat_bytes: u64,
    /// The float64 copy the gradient norm makes of the largest part of a gradient in this
    /// rank's partition.
    pub norm_temp_bytes: u64,
}

/// A range of steps whose parameters are gathered together.
#[derive(Clone, Debug)]
pub(super) struct Unit {
    /// Its steps.
    pub steps: Range<usize>,
    /// Bytes of its whole (gathered) parameters.
    pub gathered_bytes: u64,
    /// Elements of its parameters.
    pub numel: u64,
    /// Its trainable parameter values: whole gradient bytes and this rank's shard of them.
    pub grads: Vec<(ValueId, u64, u64)>,
    /// Freed after its forward and gathered again for its backward.
    pub reshard_after_forward: bool,
    /// FSDP2: the all-gather lands in an output buffer of the gathered size, copied out into
    /// the unsharded parameters (`foreach_all_gather`, `foreach_all_gather_copy_out` in
    /// `torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`). In backward the buffer is
    /// freed right after the copy-out; in forward it is kept until the next unit's all-gather
    /// has been issued (`FSDPParamGroup.wait_for_unshard` saves it in `all_gather_state` "to
    /// allow for overlap of this copy-out with next all-gather collective").
    pub gather_buffer: bool,
    /// FSDP2: bytes of the reduce-scatter input the unit's whole gradients are copied into
    /// before they are freed (`foreach_reduce`: `reduce_scatter_input` of the padded
    /// unsharded size, `foreach_reduce_scatter_copy_in`); 0 when there is none.
    pub reduce_buffer_bytes: u64,
    /// FSDP2 under a mixed-precision policy: the largest of the unit's 16-bit gradients, the
    /// copy the copy-in makes of each before casting it into the float32 reduce-scatter input
    /// (see [`Dist::new`]); 0 when the gradients are in the reduce dtype already.
    pub reduce_cast_bytes: u64,
    /// FSDP2 with a `reduce_dtype` other than the sharded gradients' dtype: the reduce-scatter
    /// output in the reduce dtype (shard-sized), live while `_cast_and_view_sharded_grads`
    /// casts it into the sharded gradients' own buffer; 0 when the gradients view the output.
    pub reduce_output_cast_bytes: u64,
    /// Its parameters in the order its steps first read them: storage, whole elements and
    /// whole bytes.
    pub params: Vec<(StorageId, u64, u64)>,
}

/// DeepSpeed ZeRO-3's prefetch (`deepspeed/runtime/zero/partitioned_param_coordinator.py`,
/// `PartitionedParameterCoordinator.fetch_sub_module`). From the second step on, ZeRO-3 has
/// traced the order in which forward and backward fetch parameters (`__param_order`), and
/// after fetching a module's own parameters it pops the parameters that follow from that
/// queue and all-gathers those not available, until the elements it started gathering reach
/// `min(stage3_max_live_parameters - available, stage3_prefetch_bucket_size)`, where
/// `available` counts every gathered, unreleased element (`__n_available_params`); the queue
/// is never rewound within a step. DeepSpeed does this as every module starts, in forward and
/// in backward, with or without parameters of its own, so the gathered parameters run ahead
/// until `stage3_max_live_parameters` stops them. memest replays this as every layer starts,
/// over its units (the repeated blocks and the layers between them, each unit's parameters in
/// the order its steps read them, forward then backward), parameter by parameter, so a
/// prefetch can stop inside a unit; DeepSpeed's container modules (a decoder layer, its
/// attention and MLP) prefetch a few more times than memest's layers.
#[derive(Clone, Debug)]
pub(super) struct Prefetch {
    /// `stage3_prefetch_bucket_size`, elements.
    pub bucket_elems: u64,
    /// `stage3_max_live_parameters`, elements.
    pub max_live_elems: u64,
    /// Per unit, its gathered (not persistent) parameters in order: elements and bytes.
    pub params: Vec<Vec<(u64, u64)>>,
}

/// The plan applied to one tape.
#[derive(Clone, Debug)]
pub(super) struct Dist {
    /// Resident bytes of each parameter storage on this rank (its shard under ZeRO-3/FSDP).
    pub resident: HashMap<StorageId, u64>,
    /// Communication buffers that live the whole step (DDP buckets; ZeRO-3's reduce bucket and
    /// its persistent small parameters).
    pub comm_always: u64,
    /// A reduce bucket that lives through backward (ZeRO-1/2's `ipg` buffer).
    pub comm_backward: u64,
    /// Gradient bytes that exist before the step (DDP's `gradient_as_bucket_view` gradients;
    /// ZeRO-3's gradient partition buffer).
    pub grads_always: u64,
    /// Whether backward allocates parameter gradients itself (false when they are views of
    /// DDP's buckets, already counted in `grads_always`).
    pub grads_in_backward: bool,
    /// Units gathered around their steps (none without parameter sharding).
    pub units: Vec<Unit>,
    /// When gradients shrink to the shard.
    pub reduce: Reduce,
    /// A gradient partition buffer allocated at the first reduction and kept to the step
    /// (ZeRO-2's `grads_in_partition`); 0 when there is none.
    pub partition_buffer: u64,
    /// DeepSpeed ZeRO-1/2's reduce buckets ([`Reduce::Buckets`]).
    pub buckets: Option<Buckets>,
    /// DeepSpeed's float32 gradient partition of the step.
    pub step_grad_bytes: u64,
    /// The optimizer's plan over this rank's part of the parameters.
    pub optimizer: OptimizerPlan<ValueId>,
    /// DeepSpeed's float32 master partitions (0 for other engines: their master weights are
    /// in `optimizer`).
    pub master_partition_bytes: u64,
    /// The whole gradients (one GPU's).
    pub whole_gradient_bytes: u64,
    /// The optimizer's plan over the whole parameters (one GPU's).
    pub whole_optimizer: OptimizerPlan<ValueId>,
    /// Host (CPU) bytes of this rank's offloaded state ([`crate::parallel::Offload`]).
    pub cpu_bytes: u64,
    /// Of `cpu_bytes`, the page-locked (pinned) ones.
    pub cpu_pinned_bytes: u64,
    /// Expert parallelism: the expert weights' values, whose gradients this rank holds for
    /// its `1 / expert_ranks` of the experts only.
    pub expert_values: HashSet<ValueId>,
    /// Expert-parallel ranks (1 without expert parallelism).
    pub expert_ranks: u64,
    /// Expert parallelism: per step, the bytes of an all-to-all receive buffer live during it
    /// (the dispatch's in forward and backward).
    pub step_comm: HashMap<usize, u64>,
    /// DeepSpeed ZeRO-3's parameter prefetch over `units`.
    pub prefetch: Option<Prefetch>,
    /// DDP's bucket tensors as the caching allocator gets them ([`DdpBuckets`]); empty for
    /// other engines.
    pub ddp_buckets: DdpBuckets,
    /// Whether the caching allocator's replay models this plan ([`Dist::allocator_modelled`]).
    pub allocator: bool,
}

/// DDP's flat bucket tensors, bytes of each (`Reducer::initialize_buckets`: one
/// `at::empty` per bucket, in the buckets' order), at construction and after the rebuild.
///
/// PyTorch 2.15 (`torch/nn/parallel/distributed.py`,
/// `_BucketCapacityConfig.compute_bucket_size_limits` and `_ddp_init_helper`): at
/// construction, unless `find_unused_parameters=True` (memest models the default, `False`),
/// the limits are `[sys.maxsize]`, so `_compute_bucket_assignment_by_size` (`reducer.cpp`)
/// puts every trainable parameter of a dtype into one bucket; the Reducer gets the buckets
/// reversed. At the second iteration's forward (`Reducer::rebuild_buckets`, once) the
/// Reducer frees them and assigns again, in the order the gradients became ready in the first
/// backward (`autograd_hook` → `push_rebuilt_params`), under the limits
/// `[first_bucket_bytes_cap, bucket_bytes_cap]`: a dtype's first bucket closes once it
/// reaches the first limit, every later one at the cap. The first limit is
/// `dist._DEFAULT_FIRST_BUCKET_BYTES` (1 MiB) when `bucket_cap_mb` is left at its default and
/// the cap itself when it is given (`_BucketCapacityConfig.create`). The rebuilt buckets come
/// in the order they closed, the still open ones after them (no sort: the indices are in
/// ready order already), and are allocated in that order.
#[derive(Clone, Debug, Default)]
pub(super) struct DdpBuckets {
    /// At construction, in the Reducer's order.
    pub initial: Vec<u64>,
    /// After the rebuild at the second iteration, in order.
    pub rebuilt: Vec<u64>,
}

impl DdpBuckets {
    /// The buckets of `params` (bytes and dtype of each, in the order given) under `limits`
    /// (a dtype's first bucket closes at `limits[0]`, its next at `limits[1]`, and so on, the
    /// last limit holding for the rest): `_compute_bucket_assignment_by_size`. With `sort`
    /// (construction: the parameters in registration order) the buckets come sorted by the
    /// first parameter each holds; without (the rebuild: the parameters in ready order) the
    /// closed buckets come in closing order, then the open ones by their first parameter.
    fn assign(params: impl Iterator<Item = (u64, DType)>, limits: &[u64], sort: bool) -> Vec<u64> {
        // Open buckets per dtype: bytes, first parameter's index, limit index.
        let mut open: Vec<(DType, u64, usize, usize)> = Vec::new();
        let mut closed: Vec<(usize, u64)> = Vec::new();
        let last = limits.len().saturating_sub(1);
        for (i, (bytes, dtype)) in params.enumerate() {
            let at = match open.iter().position(|o| o.0 == dtype) {
                Some(at) => at,
                None => {
                    open.push((dtype, 0, usize::MAX, 0));
                    open.len() - 1
                }
            };
            let b = &mut open[at];
            b.1 = b.1.saturating_add(bytes);
            b.2 = b.2.min(i);
            if b.1 >= limits.get(b.3).copied().unwrap_or(u64::MAX) {
                closed.push((b.2, b.1));
                *b = (dtype, 0, usize::MAX, (b.3 + 1).min(last));
            }
        }
        let mut rest: Vec<(usize, u64)> = open
            .iter()
            .filter(|o| o.1 > 0)
            .map(|o| (o.2, o.1))
            .collect();
        rest.sort_unstable();
        closed.extend(rest);
        if sort {
            // Sorted by the smallest parameter index each holds.
            closed.sort_unstable();
        }
        closed.into_iter().map(|c| c.1).collect()
    }
}

/// The order in which autograd hands the trainable parameters' gradients to DDP's Reducer in
/// backward (indices into `trainable`): the replay's backward order, steps last to first. A
/// parameter read by several steps (tied weights) is ready after its last gradient, at its
/// first use in forward; within one step the parameters are taken last input first, as
/// `addmm(bias, x, weight.t())`'s backward hands the bias to its `AccumulateGrad` at once and
/// the weight through `TBackward0` (the engine runs `AccumulateGrad`, whose sequence number is
/// the largest, as soon as it is ready: `torch/csrc/autograd/engine.cpp`,
/// `CompareNodeTaskTime`). Parameters that get no gradient come last, last registered first.
fn grad_ready_order(tape: &Tape, trainable: &[Trainable]) -> Vec<usize> {
    let index: HashMap<ValueId, usize> = trainable
        .iter()
        .enumerate()
        .map(|(i, t)| (t.value, i))
        .collect();
    let mut ready: Vec<Option<usize>> = vec![None; trainable.len()];
    let mut n = 0usize;
    for step in tape.steps.iter().rev() {
        for v in step.grads.iter().rev() {
            if let Some(&i) = index.get(v) {
                ready[i] = Some(n);
                n += 1;
            }
        }
    }
    let mut order: Vec<usize> = (0..trainable.len()).collect();
    order.sort_by_key(|&i| (ready[i].unwrap_or(usize::MAX), std::cmp::Reverse(i)));
    order
}

impl Dist {
    /// This rank's resident parameter bytes.
    pub(super) fn parameter_bytes(&self) -> u64 {
        self.resident
            .values()
            .fold(0u64, |a, &b| a.saturating_add(b))
    }

    /// This rank's gradient bytes once they are reduced, given the whole gradients' bytes.
    pub(super) fn gradient_bytes(&self, whole: u64) -> u64 {
        match self.reduce {
            // ZeRO-1 holds the whole gradients through backward (the paper's 2Ψ); its float32
            // partition exists only during the step.
            Reduce::Never => whole,
            Reduce::Buckets => match &self.buckets {
                Some(b) if b.stage >= 2 => self.partition_buffer,
                _ => whole,
            },
            Reduce::PerUnit { into_buffer: true } => {
                self.grads_always.saturating_add(self.partition_buffer)
            }
            Reduce::PerUnit { into_buffer: false } => {
                let (all, shard) = self
                    .units
                    .iter()
                    .flat_map(|u| &u.grads)
                    .fold((0u64, 0u64), |(a, s), g| {
                        (a.saturating_add(g.1), s.saturating_add(g.2))
                    });
                whole.saturating_sub(all).saturating_add(shard)
            }
        }
    }
}

/// The data-parallel degree of `plan` (1 when the degrees do not divide).
fn split_dp(plan: &Plan) -> u64 {
    plan.data_parallel().unwrap_or(1)
}

/// The trainable parameters: value, numel, shape, dtype, whole gradient bytes (after expert
/// parallelism: this rank's experts only).
struct Trainable {
    value: ValueId,
    shape: Vec<u64>,
    numel: u64,
    dtype: DType,
    grad_bytes: u64,
    /// An expert weight: sharded over the expert-data-parallel ranks (`dp / ep`).
    expert: bool,
}

/// The expert weights of `tape`'s mixture-of-experts layers: the 3-D `[experts, out, in]`
/// parameters `torch._grouped_mm` reads (`trace/moe.rs`), and the experts' `[experts, n]`
/// biases (GPT-OSS's `gate_up_proj_bias`, `down_proj_bias`: parameters an `index` step of the
/// same layer gathers rows of; transformers' expert-parallel plan divides them with the
/// weights), by storage.
pub(super) fn expert_weights(tape: &Tape) -> HashSet<StorageId> {
    let mut out = HashSet::new();
    let mut experts = std::collections::HashMap::new();
    for step in tape.steps.iter().filter(|s| s.op == AtenOp::GroupedMm) {
        for &v in &step.inputs {
            let val = &tape.values[v];
            if val.param && val.shape.dims().len() == 3 {
                out.insert(val.storage);
                experts.insert(step.layer, val.shape.dims()[0]);
            }
        }
    }
    for step in tape.steps.iter().filter(|s| s.op == AtenOp::Index) {
        let Some(&n) = experts.get(&step.layer) else {
            continue;
        };
        for &v in &step.inputs {
            let val = &tape.values[v];
            if val.param && val.shape.dims().len() == 2 && val.shape.dims()[0] == n {
                out.insert(val.storage);
            }
        }
    }
    out
}

/// Checks expert parallelism against `tape`: the model has expert weights, and every expert
/// count divides by the expert-parallel ranks (Megatron-Core: `num_moe_experts %
/// expert_model_parallel_size == 0`).
///
/// # Errors
/// [`crate::Error::Setting`] ([`crate::error::SettingKey::Parallel`]) otherwise.
pub(super) fn check_experts(tape: &Tape, plan: &Plan) -> Result<(), crate::Error> {
    use crate::error::SettingKey;
    let Some(e) = plan.experts else {
        return Ok(());
    };
    let experts = expert_weights(tape);
    if experts.is_empty() {
        return Err(crate::Error::setting(
            SettingKey::Parallel,
            "--ep divides mixture-of-experts layers' experts across GPUs: this model has none"
                .to_string(),
        ));
    }
    for p in &tape.params {
        let v = &tape.values[p.value];
        if experts.contains(&v.storage) {
            let n = p.shape.dims().first().copied().unwrap_or(1);
            if !n.is_multiple_of(e.ranks) {
                return Err(crate::Error::setting(
                    SettingKey::Parallel,
                    format!(
                        "--ep {}: a layer's {n} experts do not divide across {} GPUs",
                        e.ranks, e.ranks
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Whether `plan` makes parameters DTensors that PyTorch's `torch.optim.Adafactor` then sees:
/// FSDP2's `fully_shard` (any strategy but `no-shard`, which memest runs as DDP: a one-GPU
/// `hybrid-shard` group is still a 2-D mesh of DTensors) and DTensor tensor parallelism.
fn dtensor_params(plan: &Plan) -> (bool, bool) {
    let fsdp = matches!(plan.sharding, Sharding::Fsdp(f) if f.strategy != FsdpStrategy::NoShard);
    let tp = plan.tp > 1 && plan.tensor.style == TpStyle::Dtensor;
    (fsdp, tp)
}

/// Checks the optimizer against the DTensor parameters `plan` makes. PyTorch 2.15's
/// `torch.optim.Adafactor` cannot step a sharded 2-D DTensor: the factored second moment
/// reduces the gradient along both of its last two dimensions (`torch.norm(grad, dim=-1)`,
/// `dim=-2`; `torch/optim/_adafactor.py`), and along a sharded dimension the result is a
/// `_NormPartial` DTensor that the next in-place `square_`/`pow_` (for-loop) or
/// `_foreach_mul_` (foreach) cannot keep: "in-place operations that require placement changes
/// are not supported" (`torch/distributed/tensor/_dispatch.py`). FSDP2 shards every
/// parameter on dimension 0 (`Shard(0)`), so every 2-D parameter fails (also on a one-GPU
/// shard group); tensor parallelism shards a column-parallel weight on dimension 0, a
/// row-parallel weight and the vocab-parallel embedding on 1 and 0. Measured with gloo, two
/// CPU ranks: `nn.Linear` weights under `fully_shard`, `fully_shard` on a `(2, 1)` mesh, and
/// `ColwiseParallel`/`RowwiseParallel`, foreach and for-loop, all raise; vectors and a
/// `[4, 8, 3]` parameter under `fully_shard` step.
///
/// # Errors
/// [`crate::Error::Setting`] ([`crate::error::SettingKey::Optimizer`]) naming the parameter's
/// layer and the plan.
pub(super) fn check_optimizer(
    tape: &Tape,
    settings: &Settings,
    plan: &Plan,
) -> Result<(), crate::Error> {
    if settings.optimizer != Some(crate::cost::Optimizer::Adafactor) {
        return Ok(());
    }
    let (fsdp, tp) = dtensor_params(plan);
    let failing = tape.params.iter().find(|p| {
        p.trainable && p.shape.rank() == 2 && (fsdp || (tp && tape.tp_split.contains(&p.value)))
    });
    let Some(p) = failing else {
        return Ok(());
    };
    let layer = &tape.layers[tape.storages[tape.values[p.value].storage].layer];
    let (how, instead) = if fsdp {
        (
            "FSDP2 shards them on dimension 0",
            "use --ddp, --fsdp no-shard or DeepSpeed --zero, whose optimizer sees plain or flat tensors",
        )
    } else {
        (
            "tensor parallelism shards them",
            "use --tp-style megatron, whose ranks hold plain tensors",
        )
    };
    Err(crate::Error::setting(
        crate::error::SettingKey::Optimizer,
        format!(
            "adafactor cannot step the 2-D parameters of `{}` as DTensors ({how}): PyTorch's factored second moment reduces along the sharded dimension and raises; {instead}",
            layer.name()
        ),
    ))
}

impl Dist {
    /// The ranks whose figures can differ under `plan`: DeepSpeed ZeRO-1/2's first and last
    /// (the parameters that overlap a partition differ); rank 0 alone otherwise.
    pub(super) fn ranks(plan: &Plan) -> Vec<u64> {
        let dp = plan.data_parallel().unwrap_or(1).max(1);
        match plan.sharding {
            Sharding::Zero(z) if (1..=2).contains(&z.stage) && dp > 1 => vec![0, dp - 1],
            _ => vec![0],
        }
    }

    /// `plan` over `tape` under `settings` (training), as rank `rank` holds it.
    pub(super) fn new(tape: &Tape, settings: &Settings, plan: &Plan, rank: u64) -> Dist {
        let split = plan.split();
        let grad_dtype = |d: DType| match settings.grad_dtype_override() {
            Some(g) if d == settings.recipe.weights => g,
            _ => d,
        };
        // Expert parallelism: each rank keeps `experts / ep` of every expert weight (dim 0).
        let ep = plan.experts.map_or(1, |e| e.ranks.max(1));
        let experts = if ep > 1 {
            expert_weights(tape)
        } else {
            HashSet::new()
        };
        // A parameter's local shape, numel and stored bytes under expert parallelism.
        let local = |p: &crate::trace::Param| -> (Vec<u64>, u64, u64, bool) {
            let mut shape = p.shape.dims().to_vec();
            if experts.contains(&tape.values[p.value].storage)
                && let Some(d0) = shape.first_mut()
            {
                *d0 /= ep;
                return (shape, p.numel / ep, p.bytes / ep, true);
            }
            (shape, p.numel, p.bytes, false)
        };
        let trainable: Vec<Trainable> = tape
            .params
            .iter()
            .filter(|p| p.trainable)
            .map(|p| {
                let v = &tape.values[p.value];
                let (shape, numel, _, expert) = local(p);
                // Tensor parallelism can make a gradient larger than the local part.
                let grad_numel = if expert {
                    numel
                } else {
                    tape.grad_shapes
                        .get(&p.value)
                        .and_then(crate::shape::Shape::numel)
                        .unwrap_or(numel)
                };
                Trainable {
                    value: p.value,
                    shape,
                    numel,
                    dtype: v.dtype,
                    grad_bytes: grad_dtype(v.dtype)
                        .bytes_for(grad_numel)
                        .unwrap_or(u64::MAX),
                    expert,
                }
            })
            .collect();
        let total_grad: u64 = trainable
            .iter()
            .fold(0, |a, t| a.saturating_add(t.grad_bytes));
        let total_numel: u64 = trainable.iter().fold(0, |a, t| a.saturating_add(t.numel));
        // Each rank's part of one parameter's elements, as the engine cuts it: an expert weight
        // over the expert-data-parallel ranks only (Megatron-Core's `expert_data_parallel_size
        // = dp / ep`; DeepSpeed-MoE's expert data-parallel group).
        let part = |t: &Trainable, ranks: u64| -> u64 {
            let ranks = if t.expert { (ranks / ep).max(1) } else { ranks };
            if ranks <= 1 {
                return t.numel;
            }
            match plan.sharding {
                Sharding::Fsdp(_) => shard::fsdp_shard_numel(&t.shape, ranks),
                _ => shard::zero3_partition_numel(t.numel, ranks),
            }
        };
        let bytes_of = |d: DType, n: u64| d.bytes_for(n).unwrap_or(u64::MAX);
        let mut dist = Dist {
            resident: HashMap::new(),
            comm_always: 0,
            comm_backward: 0,
            grads_always: 0,
            grads_in_backward: true,
            units: Vec::new(),
            prefetch: None,
            reduce: Reduce::Never,
            partition_buffer: 0,
            buckets: None,
            step_grad_bytes: 0,
            optimizer: OptimizerPlan::default(),
            master_partition_bytes: 0,
            // One GPU's: every expert (`total_grad` is this rank's).
            whole_gradient_bytes: tape
                .params
                .iter()
                .filter(|p| p.trainable)
                .fold(0u64, |a, p| {
                    let d = grad_dtype(tape.values[p.value].dtype);
                    a.saturating_add(d.bytes_for(p.numel).unwrap_or(u64::MAX))
                }),
            expert_values: tape
                .params
                .iter()
                .filter(|p| experts.contains(&tape.values[p.value].storage))
                .map(|p| p.value)
                .collect(),
            expert_ranks: ep,
            // Each dispatch's all-to-all receives this rank's experts' rows (balanced routing:
            // as many as it sends, the dispatched `[rows, hidden]`) into a buffer of their size
            // beside the sent ones (Megatron-Core `MoEAlltoAllTokenDispatcher.token_dispatch`:
            // `all_to_all(permutated_local_input_tokens)`); its backward runs the reverse
            // all-to-all on the gradients. The combine's all-to-all moves as many rows back.
            step_comm: if ep > 1 {
                tape.steps
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.op == AtenOp::MoeDispatch)
                    .map(|(i, s)| {
                        let bytes = s.outputs.iter().fold(0u64, |a, &v| {
                            a.saturating_add(tape.storages[tape.values[v].storage].bytes)
                        });
                        (i, bytes)
                    })
                    .collect()
            } else {
                HashMap::new()
            },
            whole_optimizer: match settings.optimizer {
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
            },
            cpu_bytes: 0,
            cpu_pinned_bytes: 0,
            ddp_buckets: DdpBuckets::default(),
            allocator: false,
        };
        // FSDP with a `mixed-*` recipe is FSDP2's `MixedPrecisionPolicy(param_dtype=<16-bit>)`:
        // the sharded parameters stay in the master dtype (float32) and are the optimizer's
        // master weights; the all-gather casts them to the 16-bit dtype the step computes in
        // (the traced weights), and each unit's 16-bit gradients are reduced in float32 into
        // float32 shards, views of the reduce-scatter output (see the reduce-scatter input
        // below).
        let sharded_master = match plan.sharding {
            Sharding::Fsdp(f) if f.shard_group > 1 => settings
                .recipe
                .master_weights
                .filter(|&m| m != settings.recipe.weights),
            _ => None,
        };
        let at_rest = |d: DType| match sharded_master {
            Some(m) if d == settings.recipe.weights => m,
            _ => d,
        };
        // Resident parameters: the shard when parameters are split.
        for p in &tape.params {
            let v = &tape.values[p.value];
            let (shape, numel, stored, expert) = local(p);
            let t = Trainable {
                value: p.value,
                shape,
                numel,
                dtype: v.dtype,
                grad_bytes: 0,
                expert,
            };
            let bytes = if split.params > 1 && p.trainable && at_rest(v.dtype) != v.dtype {
                bytes_of(at_rest(v.dtype), part(&t, split.params))
            } else if split.params > 1 {
                let n = part(&t, split.params);
                // Bytes per element as stored (a quantized weight keeps its packing ratio).
                u64::try_from(u128::from(stored) * u128::from(n) / u128::from(numel.max(1)))
                    .unwrap_or(u64::MAX)
            } else {
                stored
            };
            dist.resident.insert(v.storage, bytes);
        }
        // Adafactor's factored state of a DTensor of rank 3 or more under FSDP2: `row_var`
        // and `col_var` are `grad.new_zeros(shape)` of a shape other than the gradient's, to
        // which DTensor's `new_factory_single_dim_strategy` gives a `Replicate` placement
        // (`torch/distributed/tensor/_ops/_tensor_ops.py`): the whole factored state on every
        // rank, as on one GPU, and its `var_estimate` (`row_var @ col_var`) whole too.
        // Measured with gloo on two CPU ranks, a `[4, 8, 3]` parameter under `fully_shard`:
        // `row_var` `[4, 8, 1]` and `col_var` `[4, 1, 3]` whole on each rank, its vector's
        // `variance` the rank's shard. (A 2-D one cannot step: `check_optimizer`.)
        let whole_factored = |t: &Trainable| {
            settings.optimizer == Some(crate::cost::Optimizer::Adafactor)
                && matches!(plan.sharding, Sharding::Fsdp(_))
                && t.shape.len() >= 3
        };
        // The optimizer's view of this rank's parameters.
        let shapes: Vec<Vec<u64>> = trainable
            .iter()
            .map(|t| {
                let n = part(t, split.optimizer);
                match plan.sharding {
                    _ if whole_factored(t) => t.shape.clone(),
                    Sharding::Fsdp(_) if split.optimizer > 1 => {
                        let ranks = if t.expert {
                            (split.optimizer / ep).max(1)
                        } else {
                            split.optimizer
                        };
                        let mut s = t.shape.clone();
                        if let Some(d0) = s.first_mut() {
                            *d0 = d0.div_ceil(ranks);
                        } else {
                            s.push(1);
                        }
                        s
                    }
                    // Not split: the optimizer sees each parameter as the module holds it (a
                    // tensor-parallel shard keeps its rank's shape), so Adafactor factors it as
                    // on one GPU.
                    _ if split.optimizer <= 1 => t.shape.clone(),
                    _ => vec![n],
                }
            })
            .collect();
        match plan.sharding {
            Sharding::Zero(z) if z.stage >= 1 => {
                // One flat float32 partition per parameter group (one group here): DeepSpeed's
                // master partition, which the wrapped optimizer updates.
                let ranks = split.optimizer;
                let partition = if z.stage >= 3 {
                    trainable
                        .iter()
                        .fold(0u64, |a, t| a.saturating_add(part(t, ranks)))
                } else {
                    shard::zero12_partition_numel(total_numel, ranks)
                };
                let shape = [partition];
                let info = TensorInfo {
                    shape: &shape,
                    numel: partition,
                    bytes: bytes_of(DType::Float32, partition),
                };
                let fp32 = crate::cost::Recipe::derived(DType::Float32, None);
                let id = trainable.first().map_or(ValueId::default(), |t| t.value);
                if let Some(opt) = settings.optimizer {
                    dist.optimizer = OptimizerPlan::new(
                        opt,
                        settings.optimizer_impl,
                        &fp32,
                        [(id, info, DType::Float32)],
                    );
                }
                dist.master_partition_bytes = info.bytes;
                dist.step_grad_bytes = info.bytes;
            }
            _ => {
                let infos = trainable.iter().zip(&shapes).map(|(t, s)| {
                    let n = if whole_factored(t) {
                        t.numel
                    } else {
                        part(t, split.optimizer)
                    };
                    (
                        t.value,
                        TensorInfo {
                            shape: s,
                            numel: n,
                            bytes: bytes_of(at_rest(t.dtype), n),
                        },
                        at_rest(t.dtype),
                    )
                });
                // Under FSDP mixed precision the float32 shards are the master weights: the
                // optimizer updates them in place, with no copy of its own.
                let recipe = match sharded_master {
                    Some(m) => crate::cost::Recipe::derived(m, None),
                    None => settings.recipe.clone(),
                };
                if let Some(opt) = settings.optimizer {
                    dist.optimizer =
                        OptimizerPlan::new(opt, settings.optimizer_impl, &recipe, infos);
                }
            }
        }
        // Engine by engine: buffers, reduction and units.
        let shard_grad = |t: &Trainable, ranks: u64| -> u64 {
            let n = part(t, ranks);
            if sharded_master.is_some() && ranks > 1 {
                return bytes_of(at_rest(t.dtype), n);
            }
            u64::try_from(u128::from(t.grad_bytes) * u128::from(n) / u128::from(t.numel.max(1)))
                .unwrap_or(u64::MAX)
        };
        match plan.sharding {
            // One rank per data-parallel group: no data-parallel engine runs.
            _ if plan.model_parallel_only() => {}
            // A pipeline without data parallelism has no DDP to bucket gradients for.
            Sharding::Ddp(_) if plan.pp > 1 && split_dp(plan) <= 1 => {}
            Sharding::Ddp(d) => {
                if d.gradient_as_bucket_view {
                    dist.grads_always = total_grad;
                    dist.grads_in_backward = false;
                } else {
                    dist.comm_always = total_grad;
                }
                let grad = |t: &Trainable| (t.grad_bytes, grad_dtype(t.dtype));
                let mut initial = DdpBuckets::assign(trainable.iter().map(grad), &[u64::MAX], true);
                initial.reverse();
                let rebuilt = DdpBuckets::assign(
                    grad_ready_order(tape, &trainable)
                        .into_iter()
                        .map(|i| grad(&trainable[i])),
                    &[d.first_bucket_bytes, d.bucket_cap_bytes],
                    false,
                );
                dist.ddp_buckets = DdpBuckets { initial, rebuilt };
            }
            Sharding::Fsdp(f) => {
                if f.strategy == FsdpStrategy::NoShard || f.shard_group <= 1 {
                    // All-reduced in place, like DDP with bucket views.
                } else {
                    dist.reduce = Reduce::PerUnit { into_buffer: false };
                    dist.units = units(
                        tape,
                        &trainable,
                        true,
                        f.reshard_after_forward,
                        |t| shard_grad(t, f.shard_group),
                        &|p| local(p).2,
                    );
                    // The reduce-scatter runs in the sharded parameters' dtype: PyTorch 2.15's
                    // FSDP2 with `reduce_dtype=None` promotes over the parameters'
                    // `unsharded_grad_dtype`, which without a `grad_dtype` override is their
                    // original dtype (`FSDPParamGroup._get_reduce_dtype`,
                    // `FSDPParam.unsharded_grad_dtype`; `MixedPrecisionPolicy`: "versionchanged::
                    // 2.15 ... gradients were previously reduced in param_dtype"): float32 under
                    // a 16-bit `param_dtype`. The unsharded gradients themselves stay in the
                    // 16-bit dtype (measured: the tiny Llama's LM head and embedding gradients
                    // are 32,768,000-byte bfloat16 blocks, although `unsharded_param.grad_dtype`
                    // reads float32), so the copy-in casts: `fsdp::chunk_cat_mixed_dtype`
                    // falls back to `torch._chunk_cat`, whose `cat` makes a contiguous copy of
                    // each gradient's padded chunks in its own dtype before writing it into the
                    // float32 input, one gradient at a time (measured: one block the size of
                    // each gradient, freed before the next).
                    //
                    // An explicit `reduce_dtype` (`--reduce-dtype`) replaces that promotion
                    // (`_get_reduce_dtype` returns it first): the reduce-scatter input and output
                    // are in it, and a gradient already in it is copied in without a cast
                    // (`foreach_reduce_scatter_copy_in`: a group of one dtype runs `_chunk_cat`
                    // straight into the input; not at the peak of the measured case, the tiny
                    // Llama under `mixed-bf16` with `reduce_dtype=bfloat16`, whose peak is the
                    // loss's backward). When it differs from the sharded gradients' dtype
                    // (bfloat16 against the float32 shards), `_cast_and_view_sharded_grads` casts
                    // the shard-sized output into a new buffer the sharded gradients view, and
                    // the output is freed after: both live at once.
                    let dtype_of: HashMap<ValueId, DType> =
                        trainable.iter().map(|t| (t.value, t.dtype)).collect();
                    for u in &mut dist.units {
                        u.gather_buffer = true;
                        let mut buffer = 0u64;
                        let mut cast = 0u64;
                        let mut output = 0u64;
                        for &(v, whole, shard) in &u.grads {
                            let d = dtype_of.get(&v).copied().unwrap_or(DType::Float32);
                            let (g, sharded) = (grad_dtype(d), at_rest(d));
                            let r = f.reduce_dtype.unwrap_or(sharded);
                            let numel = whole / g.bytes_for(1).unwrap_or(1).max(1);
                            buffer = buffer.saturating_add(bytes_of(r, numel));
                            if g != r {
                                cast = cast.max(whole);
                            }
                            if r != sharded {
                                let shard_numel = shard / sharded.bytes_for(1).unwrap_or(1).max(1);
                                output = output.saturating_add(bytes_of(r, shard_numel));
                            }
                        }
                        u.reduce_buffer_bytes = buffer;
                        u.reduce_cast_bytes = cast;
                        u.reduce_output_cast_bytes = output;
                    }
                }
            }
            Sharding::Zero(z) => {
                let ranks = split.optimizer;
                let grad_elem = trainable
                    .first()
                    .map_or(DType::Float32, |t| grad_dtype(t.dtype));
                // DeepSpeed allocates the whole `reduce_bucket_size` (`torch.empty(reduce_bucket_size)`).
                let bucket = if z.contiguous_gradients {
                    bytes_of(grad_elem, z.reduce_bucket_elems)
                } else {
                    0
                };
                match z.stage {
                    0 => {}
                    1 | 2 => {
                        // `overlap_comm`: a second bucket (`buf_1`) to fill while the first
                        // is reduced.
                        dist.comm_backward = if z.overlap_comm {
                            bucket.saturating_mul(2)
                        } else {
                            bucket
                        };
                        dist.reduce = Reduce::Buckets;
                        let partition = shard::zero12_partition_numel(total_numel, ranks);
                        // ZeRO-2's gradients per GPU: its partition, in the gradients' dtype.
                        if z.stage == 2 {
                            dist.partition_buffer = bytes_of(grad_elem, partition);
                        }
                        // This rank's part of the flat group (in `model.parameters()` order):
                        // [rank · partition, (rank + 1) · partition).
                        let (lo, hi) = (
                            partition.saturating_mul(rank),
                            partition.saturating_mul(rank.saturating_add(1)),
                        );
                        let mut at = 0u64;
                        let mut params = HashMap::new();
                        let mut in_partition = 0u64;
                        let mut largest = 0u64;
                        for t in &trainable {
                            let end = at.saturating_add(t.numel);
                            let overlaps = at < hi && end > lo;
                            if overlaps {
                                in_partition = in_partition.saturating_add(t.numel);
                                largest = largest.max(end.min(hi) - at.max(lo));
                            }
                            params.insert(t.value, (t.numel, overlaps));
                            at = end;
                        }
                        dist.buckets = Some(Buckets {
                            stage: z.stage,
                            cap: z.reduce_bucket_elems,
                            params,
                            in_partition_bytes: bytes_of(grad_elem, in_partition),
                            flat_bytes: bytes_of(DType::Float32, partition),
                            norm_temp_bytes: bytes_of(DType::Float64, largest),
                        });
                    }
                    _ => {
                        dist.comm_always = bucket;
                        dist.grads_always = trainable.iter().fold(0u64, |a, t| {
                            a.saturating_add(bytes_of(grad_dtype(t.dtype), part(t, ranks)))
                        });
                        dist.reduce = Reduce::PerUnit { into_buffer: true };
                        dist.units = units(
                            tape,
                            &trainable,
                            false,
                            true,
                            |t| shard_grad(t, ranks),
                            &|p| local(p).2,
                        );
                        // A unit's parameters are released after its forward only when more
                        // than `stage3_max_reuse_distance` elements are fetched before their
                        // next use, in its backward: the units after it, in forward and again in
                        // backward (`PartitionedParameterCoordinator.__params_to_release`). In
                        // backward the next use is the next step's: they are released.
                        let mut later = 0u64;
                        for u in dist.units.iter_mut().rev() {
                            u.reshard_after_forward =
                                later.saturating_mul(2) > z.max_reuse_distance_elems;
                            later = later.saturating_add(u.numel);
                        }
                        // Parameters at most `stage3_param_persistence_threshold` elements stay
                        // gathered all step (`DeepSpeedZeRoOffload.persistent_parameters`).
                        let mut persistent = HashSet::new();
                        for p in tape
                            .params
                            .iter()
                            .filter(|p| p.numel <= z.param_persistence_threshold)
                        {
                            dist.comm_always = dist.comm_always.saturating_add(p.bytes);
                            let s = tape.values[p.value].storage;
                            persistent.insert(s);
                            for u in &mut dist.units {
                                if u.grads.iter().any(|g| tape.values[g.0].storage == s) {
                                    u.gathered_bytes = u.gathered_bytes.saturating_sub(p.bytes);
                                }
                            }
                        }
                        dist.prefetch = Some(Prefetch {
                            bucket_elems: z.prefetch_bucket_elems,
                            max_live_elems: z.max_live_parameters,
                            params: dist
                                .units
                                .iter()
                                .map(|u| {
                                    u.params
                                        .iter()
                                        .filter(|(s, _, _)| !persistent.contains(s))
                                        .map(|&(_, n, b)| (n, b))
                                        .collect()
                                })
                                .collect(),
                        });
                    }
                }
            }
        }
        let largest_grad = trainable
            .iter()
            .fold(0u64, |a, t| a.max(bytes_of(grad_dtype(t.dtype), t.numel)));
        dist.offload(plan, tape, largest_grad, settings.grad_accum);
        dist.allocator = Dist::allocator_modelled(plan);
        dist
    }

    /// Whether the caching allocator's replay runs this plan rank by rank: DDP (its buckets,
    /// the gradients beside them or as their views) and FSDP2 (the shards, each unit's
    /// all-gather buffer and gathered parameters, its reduce-scatter input and gradient
    /// shards), data parallelism alone and nothing offloaded. Under DeepSpeed ZeRO, tensor,
    /// pipeline, context or expert parallelism and offloading the allocator figures are left
    /// out (the report then gives the tensor peak for them).
    fn allocator_modelled(plan: &Plan) -> bool {
        matches!(plan.sharding, Sharding::Ddp(_) | Sharding::Fsdp(_))
            && plan.tp <= 1
            && plan.pp <= 1
            && plan.cp <= 1
            && plan.experts.is_none()
            && !plan.offload.any()
    }

    /// Moves what `plan` offloads from this GPU to the host, after the engine's own figures are
    /// set. `largest_grad` is the bytes of the largest parameter's gradient (ZeRO-1/2's
    /// staging buffers); `grad_accum` the micro-batches per optimizer step.
    ///
    /// - DeepSpeed `offload_optimizer` (ZeRO-Offload): the optimizer state, the float32 master
    ///   partition and the float32 gradient partition (`single_partition_of_fp32_groups[i].grad`,
    ///   pinned with `pin_memory`) go to the host. ZeRO-1/2 pin the master partition whatever
    ///   `pin_memory` says (`get_accelerator().pin_memory(weights_partition)` in
    ///   `DeepSpeedZeroOptimizer.__init__`, DeepSpeed up to 0.16) and copy each reduced
    ///   gradient there through `temp_grad_buffer_for_gpu_offload` (on the GPU, the largest
    ///   parameter's numel in the 16-bit dtype, all run long) and `temp_grad_buffer_for_cpu_offload`
    ///   (its host twin), so `grads_in_partition`, the step's float32 partition and its float64
    ///   norm copies are never made on the GPU (`copy_grads_in_partition` returns early under
    ///   `cpu_offload`). With `gradient_accumulation_steps` above 1, `copy_grads_in_partition`
    ///   also accumulates each gradient of this rank's partition on the host
    ///   (`async_accumulate_grad_in_cpu_via_gpu`: `accumulated_grads_in_cpu`, one buffer of the
    ///   whole parameter's numel in its dtype per parameter overlapping the partition, pinned
    ///   with `pin_memory`). ZeRO-1/2 run any device other than `none` (NVMe included) as this
    ///   CPU offload (`cpu_offload = device != none`; [`Plan::check_offload`] makes it `cpu`).
    ///   ZeRO-3 puts its `grad_partitions_flat_buffer` on the host too (`stage3.py`:
    ///   `self.device` is `cpu` under `offload_optimizer`, pinned with `pin_memory`); its float32
    ///   master partitions are `.to(cpu, dtype).clone().detach()`, never pinned. ZeRO-3 to NVMe:
    ///   the state, master and float32 gradient partitions are on disk (the host's swap buffers
    ///   are not counted); the gradient partitions stay on the host.
    /// - DeepSpeed `offload_param` (ZeRO-3): the 16-bit partitions live in
    ///   `param_groups_fp16_flat_cpu_memory`, always pinned whatever `offload_param.pin_memory`
    ///   says; the GPU keeps only gathered units and the persistent small parameters. To NVMe
    ///   they are on disk: no host bytes counted.
    /// - FSDP2 `CPUOffloadPolicy`: parameter shards, gradient shards (the reduce-scatter output
    ///   is copied to the host) and optimizer state on the host; pinned: the parameter and
    ///   gradient shards (`pin_memory=True`).
    ///
    /// [`Plan::check_offload`]: crate::parallel::Plan::check_offload
    fn offload(&mut self, plan: &Plan, tape: &Tape, largest_grad: u64, grad_accum: u64) {
        use crate::parallel::OffloadTarget;
        let off = plan.offload;
        if !off.any() {
            return;
        }
        let pinned_if = |b: u64| if off.pin_memory { b } else { 0 };
        let mut host = 0u64;
        let mut pinned = 0u64;
        let resident: u64 = self.parameter_bytes();
        match plan.sharding {
            Sharding::Zero(z) => {
                if let Some(target) = off.optimizer {
                    let master = self.master_partition_bytes;
                    let fp32_grad = self.step_grad_bytes;
                    if target == OffloadTarget::Cpu {
                        host = host
                            .saturating_add(self.optimizer.state_bytes)
                            .saturating_add(master)
                            .saturating_add(fp32_grad);
                        pinned = pinned.saturating_add(pinned_if(fp32_grad));
                    }
                    if z.stage >= 3 {
                        let grads = std::mem::take(&mut self.grads_always);
                        host = host.saturating_add(grads);
                        pinned = pinned.saturating_add(pinned_if(grads));
                    } else {
                        pinned = pinned.saturating_add(master);
                        host = host.saturating_add(largest_grad);
                        pinned = pinned.saturating_add(pinned_if(largest_grad));
                        self.comm_always = self.comm_always.saturating_add(largest_grad);
                        self.partition_buffer = 0;
                        if let Some(b) = &mut self.buckets {
                            if grad_accum > 1 {
                                host = host.saturating_add(b.in_partition_bytes);
                                pinned = pinned.saturating_add(pinned_if(b.in_partition_bytes));
                            }
                            b.in_partition_bytes = 0;
                            b.flat_bytes = 0;
                            b.norm_temp_bytes = 0;
                        }
                    }
                    self.optimizer = OptimizerPlan::default();
                    self.master_partition_bytes = 0;
                    self.step_grad_bytes = 0;
                }
                if let Some(target) = off.params {
                    if target == OffloadTarget::Cpu {
                        host = host.saturating_add(resident);
                        pinned = pinned.saturating_add(resident);
                    }
                    for b in self.resident.values_mut() {
                        *b = 0;
                    }
                }
            }
            Sharding::Fsdp(_) => {
                let grads = self
                    .units
                    .iter()
                    .flat_map(|u| &u.grads)
                    .fold(0u64, |a, g| a.saturating_add(g.2));
                host = host
                    .saturating_add(resident)
                    .saturating_add(grads)
                    .saturating_add(self.optimizer.state_bytes)
                    .saturating_add(self.optimizer.master_bytes);
                pinned = pinned
                    .saturating_add(pinned_if(resident))
                    .saturating_add(pinned_if(grads));
                for b in self.resident.values_mut() {
                    *b = 0;
                }
                for u in &mut self.units {
                    for g in &mut u.grads {
                        g.2 = 0;
                    }
                }
                self.optimizer = OptimizerPlan::default();
            }
            Sharding::Ddp(_) => {}
        }
        let _ = tape;
        self.cpu_bytes = host;
        self.cpu_pinned_bytes = pinned;
    }
}

/// The units of a sharded run: each copy of an outermost repeated block (FSDP2 `fully_shard`
/// per decoder layer, DeepSpeed ZeRO-3's module hooks per block), and the parameters outside
/// them: with `root` one unit over the whole step, first in the list (FSDP2's root module:
/// gathered at its pre-forward, before the first layer, resharded after the whole forward,
/// gathered again when backward starts and reduced after the last gradient), else one unit per
/// run of steps that reads them (ZeRO-3 fetches each module's parameters around it). Each
/// parameter belongs to the unit of the first step that reads it.
fn units(
    tape: &Tape,
    trainable: &[Trainable],
    root: bool,
    reshard_after_forward: bool,
    shard_grad: impl Fn(&Trainable) -> u64,
    whole_bytes: &dyn Fn(&crate::trace::Param) -> u64,
) -> Vec<Unit> {
    let param_of: HashMap<StorageId, usize> = tape
        .params
        .iter()
        .enumerate()
        .map(|(i, p)| (tape.values[p.value].storage, i))
        .collect();
    let trainable_of: HashMap<ValueId, &Trainable> =
        trainable.iter().map(|t| (t.value, t)).collect();
    // Step ranges: the blocks, and the runs of steps between them.
    let mut ranges: Vec<(Range<usize>, bool)> = Vec::new();
    let mut at = 0;
    for b in &tape.blocks {
        if b.start > at {
            ranges.push((at..b.start, false));
        }
        ranges.push((b.clone(), true));
        at = b.end;
    }
    if at < tape.steps.len() {
        ranges.push((at..tape.steps.len(), false));
    }
    let mut seen = vec![false; tape.params.len()];
    let mut out: Vec<Unit> = Vec::new();
    let mut root_unit = Unit {
        steps: 0..tape.steps.len(),
        gathered_bytes: 0,
        numel: 0,
        grads: Vec::new(),
        reshard_after_forward,
        gather_buffer: false,
        reduce_buffer_bytes: 0,
        reduce_cast_bytes: 0,
        reduce_output_cast_bytes: 0,
        params: Vec::new(),
    };
    for (range, block) in ranges {
        // Outside blocks without a root: one unit per layer's run of steps.
        let mut pieces: Vec<Range<usize>> = Vec::new();
        if block || root {
            pieces.push(range);
        } else {
            let mut start = range.start;
            for i in range.clone() {
                if i + 1 == range.end || tape.steps[i + 1].layer != tape.steps[start].layer {
                    pieces.push(start..i + 1);
                    start = i + 1;
                }
            }
        }
        for piece in pieces {
            let mut unit = Unit {
                steps: piece.clone(),
                gathered_bytes: 0,
                numel: 0,
                grads: Vec::new(),
                reshard_after_forward,
                gather_buffer: false,
                reduce_buffer_bytes: 0,
                reduce_cast_bytes: 0,
                reduce_output_cast_bytes: 0,
                params: Vec::new(),
            };
            for i in piece {
                for &v in &tape.steps[i].inputs {
                    let Some(&pi) = param_of.get(&tape.values[v].storage) else {
                        continue;
                    };
                    if seen[pi] {
                        continue;
                    }
                    seen[pi] = true;
                    let p = &tape.params[pi];
                    let target = if block || !root {
                        &mut unit
                    } else {
                        &mut root_unit
                    };
                    target.gathered_bytes = target.gathered_bytes.saturating_add(whole_bytes(p));
                    target.numel = target.numel.saturating_add(p.numel);
                    target
                        .params
                        .push((tape.values[p.value].storage, p.numel, whole_bytes(p)));
                    if let Some(t) = trainable_of.get(&p.value) {
                        target.grads.push((t.value, t.grad_bytes, shard_grad(t)));
                    }
                }
            }
            if !unit.grads.is_empty() || unit.gathered_bytes > 0 {
                out.push(unit);
            }
        }
    }
    if root && (root_unit.gathered_bytes > 0 || !root_unit.grads.is_empty()) {
        out.insert(0, root_unit);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::DdpBuckets;
    use crate::dtype::DType;

    const MIB: u64 = 1 << 20;

    /// `_compute_bucket_assignment_by_size` with limits `[1 MiB, 25 MiB]`: the first bucket of
    /// each dtype closes at 1 MiB, the later ones at 25 MiB, a bucket closes on the parameter
    /// that reaches its limit (so it can exceed it), dtypes never share a bucket, and the
    /// buckets come sorted by the first parameter each holds.
    #[test]
    fn ddp_buckets_close_at_their_limits() {
        let f = DType::Float32;
        let h = DType::Bfloat16;
        let params = [
            (MIB / 2, f),
            (MIB / 2, f),  // f32 bucket 1 reaches 1 MiB: closed (params 0, 1)
            (3 * MIB, h),  // bf16 bucket 1: 3 MiB >= 1 MiB, closed (param 2)
            (20 * MIB, f), // f32 bucket 2 opens (limit 25 MiB)
            (10 * MIB, f), // 30 MiB: closed (params 3, 4)
            (MIB, h),      // bf16 bucket 2 (limit 25 MiB), left open
            (2 * MIB, f),  // f32 bucket 3, left open
        ];
        let buckets = DdpBuckets::assign(params.into_iter(), &[MIB, 25 * MIB], true);
        assert_eq!(buckets, vec![MIB, 3 * MIB, 30 * MIB, MIB, 2 * MIB]);
        // Construction in PyTorch 2.15: one limit, `sys.maxsize`: one bucket per dtype.
        let buckets = DdpBuckets::assign(params.into_iter(), &[u64::MAX], true);
        assert_eq!(buckets, vec![33 * MIB, 4 * MIB]);
        // The rebuild keeps the closing order: a bf16 bucket left open comes after a later
        // float32 one that closed.
        let params = [(2 * MIB, f), (MIB / 2, h), (30 * MIB, f)];
        let limits = [MIB, 25 * MIB];
        assert_eq!(
            DdpBuckets::assign(params.into_iter(), &limits, false),
            vec![2 * MIB, 30 * MIB, MIB / 2]
        );
        assert_eq!(
            DdpBuckets::assign(params.into_iter(), &limits, true),
            vec![2 * MIB, MIB / 2, 30 * MIB]
        );
    }
}
