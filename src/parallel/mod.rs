//! Several GPUs: the parallel plan of a training step ([`Plan`]) and what each GPU holds under
//! it.
//!
//! A plan names the world size (`--gpus N`) and how the data-parallel ranks share the model
//! states: plain replication with DDP's gradient buckets ([`Ddp`]), DeepSpeed's ZeRO stages
//! ([`Zero`]) or PyTorch FSDP ([`Fsdp`]). Tensor, pipeline and context parallelism have their
//! degrees in the plan already (`tp`, `pp`, `cp`, all 1 today), so that the data-parallel
//! degree is always `gpus / (tp · pp · cp)`.
//!
//! - [`shard`]: how one tensor or one flat buffer is split across ranks, with each engine's
//!   padding (FSDP2 dim-0 chunks, DeepSpeed's aligned flat partitions and per-parameter ZeRO-3
//!   partitions), and the ZeRO paper's model-state formulas.
//!
//! The step simulation ([`crate::sim`]) reads the plan to know which bytes are sharded: what
//! each rank keeps between steps, what it gathers around each block (FSDP unit), and what its
//! communication buffers hold. This module knows tensor facts and dtypes only, never the tape.

pub mod accelerate;
pub mod auto;
pub mod deepspeed;
pub mod nccl;
pub mod shard;

use serde::Serialize;

use crate::dtype::DType;

/// `--gpus N` and how the ranks share the step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Plan {
    /// GPUs (ranks) in all: `dp · tp · pp · cp`.
    pub gpus: u64,
    /// Tensor-parallel degree (`--tp`; 1: not split): attention heads and MLP columns/rows
    /// divided across `tp` ranks ([`Tensor`]).
    pub tp: u64,
    /// Pipeline-parallel degree (1: one stage).
    pub pp: u64,
    /// Context-parallel degree (1: whole sequences per rank).
    pub cp: u64,
    /// How the data-parallel ranks share parameters, gradients and optimizer state.
    pub sharding: Sharding,
    /// What lives in host memory instead of the GPU (`--offload`, DeepSpeed's
    /// `offload_optimizer`/`offload_param`, FSDP2's `CPUOffloadPolicy`).
    pub offload: Offload,
    /// How tensor and context parallelism run (`--sp`, `--tp-style`); inert when `tp` and `cp`
    /// are 1.
    pub tensor: Tensor,
    /// Pipeline parallelism (`--pp P` with `--schedule`, `--micro-batches`): left out when
    /// `pp` is 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<Pipeline>,
    /// Expert parallelism (`--ep E`): left out when every rank holds every expert.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<ExpertParallel>,
}

/// Tensor, sequence and context parallelism (Megatron-LM: Shoeybi et al. 2019; sequence
/// parallel: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
/// Models"; PyTorch: `torch.distributed.tensor.parallel`).
///
/// The tracer applies it per operator ([`crate::trace`]): inside each repeated block the
/// attention heads (query and key/value heads alike) are divided by `tp`, a linear reading a
/// replicated activation is column-parallel (its `out_features` divided) and the linear reading
/// that column-split activation is row-parallel (its `in_features` divided, its output
/// all-reduced, or reduce-scattered along the sequence under `sp`); the token embedding is
/// vocab-parallel (rows divided, output all-reduced) and the LM head (the top-level linear whose
/// `out_features` is the vocabulary) column-parallel. Norms, dropout, residual adds and
/// everything outside the blocks stay replicated unless `sp` divides them along the sequence.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Tensor {
    /// Sequence parallel (`--sp`): the regions outside the tensor-parallel ones (norms,
    /// dropout, residual adds) hold `seq / tp` positions; each column-parallel region starts
    /// with an all-gather along the sequence and each row-parallel one ends in a
    /// reduce-scatter.
    pub sp: bool,
    /// Whose implementation (`--tp-style`).
    pub style: TpStyle,
}

/// Which tensor-parallel implementation's memory behaviour is modelled. They differ in three
/// places, each cited where the tracer applies it.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    schemars::JsonSchema,
    clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum TpStyle {
    /// PyTorch DTensor (`parallelize_module` with `ColwiseParallel`, `RowwiseParallel`,
    /// `SequenceParallel`), as torchtitan and transformers' `tp_plan` run it: the
    /// vocab-parallel embedding's weight gradient is whole on every rank (DTensor has no
    /// row-wise strategy for `embedding_dense_backward`, `_embedding_ops.py`), the LM head's
    /// logits are all-gathered (`ColwiseParallel(output_layouts=Replicate())`), and under
    /// sequence parallel the column-parallel linears save the all-gathered input.
    #[default]
    Dtensor,
    /// Megatron-LM (`VocabParallelEmbedding`, `ColumnParallelLinear`, `RowParallelLinear`,
    /// `vocab_parallel_cross_entropy`): the embedding's gradient is the rank's rows, the logits
    /// stay split across the vocabulary into the loss, and under sequence parallel a
    /// column-parallel linear saves its sequence-sharded input and all-gathers it again in
    /// backward (`LinearWithGradAccumulationAndAsyncCommunication`).
    Megatron,
}

impl std::fmt::Display for TpStyle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TpStyle::Dtensor => "dtensor",
            TpStyle::Megatron => "megatron",
        })
    }
}

/// Where offloaded state goes (DeepSpeed's `OffloadDeviceEnum` in
/// `deepspeed/runtime/zero/offload_config.py`: `cpu` or `nvme`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OffloadTarget {
    /// Host memory (ZeRO-Offload).
    Cpu,
    /// An NVMe drive through host buffers (ZeRO-Infinity, ZeRO-3): the state is on disk; only
    /// the GPU side is modelled, and the host's swap buffers are not counted. ZeRO-1/2 treat it
    /// as [`OffloadTarget::Cpu`] (`stage_1_and_2.py`).
    Nvme,
}

/// What a plan keeps off the GPU.
///
/// - ZeRO-Offload (Ren et al. 2021; DeepSpeed `offload_optimizer`, ZeRO stages 1–3): the
///   float32 master partition, the optimizer state and the float32 gradient partition live in
///   host memory and the optimizer steps on the CPU (`DeepSpeedCPUAdam`); the GPU keeps its
///   16-bit parameters, the reduce bucket and a staging buffer of the largest parameter's size
///   (`temp_grad_buffer_for_gpu_offload` in `stage_1_and_2.py`).
/// - ZeRO-Infinity parameter offload (`offload_param`, stage 3 only): the 16-bit parameter
///   partitions live in (always pinned) host memory (`param_groups_fp16_flat_cpu_memory` in
///   `stage3.py`); the GPU holds only gathered units.
/// - FSDP2 `CPUOffloadPolicy`: parameter, gradient and optimizer-state shards all on the host;
///   the optimizer steps on the CPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Offload {
    /// Optimizer state, master partitions and the float32 gradient partition.
    pub optimizer: Option<OffloadTarget>,
    /// Parameter partitions (ZeRO-3) or shards (FSDP).
    pub params: Option<OffloadTarget>,
    /// `pin_memory`: page-locked host buffers. DeepSpeed: `offload_optimizer.pin_memory`
    /// (default false; `offload_param.pin_memory` is not this: ZeRO-3 pins its parameter
    /// partitions whatever it says); FSDP2's `CPUOffloadPolicy(pin_memory=True)` by default.
    /// Pinned or not, the bytes are host bytes; it only says which ones are page-locked.
    pub pin_memory: bool,
}

impl Offload {
    /// Nothing offloaded.
    #[must_use]
    pub const fn none() -> Offload {
        Offload {
            optimizer: None,
            params: None,
            pin_memory: false,
        }
    }

    /// Whether anything is offloaded.
    #[must_use]
    pub const fn any(&self) -> bool {
        self.optimizer.is_some() || self.params.is_some()
    }
}

/// `--offload`: what to move to host memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OffloadFlag {
    /// Optimizer state and master weights (ZeRO-Offload; ZeRO stages 1-3).
    Optimizer,
    /// Parameters (ZeRO-3's partitions or FSDP's shards).
    Params,
    /// Both.
    Both,
}

/// A pipeline-parallel schedule: the order in which each stage runs the forward and backward
/// passes of the micro-batches, which decides how many micro-batches' activations a stage
/// holds at once.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, schemars::JsonSchema, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum Schedule {
    /// One forward, one backward (PipeDream-Flush; `Schedule1F1B`): stage `s` of `P` runs
    /// `P − s` forwards before its first backward, so it holds at most `min(M, P − s)`
    /// micro-batches.
    #[value(name = "1f1b")]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Megatron's interleaved 1F1B over `--virtual-stages V` model chunks per GPU
    /// (`ScheduleInterleaved1F1B`).
    Interleaved,
    /// All forwards, then all backwards (`ScheduleGPipe`): every stage holds all `M`.
    Gpipe,
}

impl std::fmt::Display for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Schedule::OneFOneB => "1F1B",
            Schedule::Interleaved => "interleaved 1F1B",
            Schedule::Gpipe => "GPipe",
        })
    }
}

/// Pipeline parallelism: the model's repeated blocks split into `stages · virtual_stages`
/// consecutive stages, stage `i` on pipeline rank `i mod stages`.
///
/// How the blocks are split: by count, balanced, the first `blocks mod S` stages taking one
/// more (Megatron's `num_layers / pipeline_model_parallel_size` per stage;
/// `torch.distributed.pipelining`'s even split by layer count), with everything before the
/// first block (embeddings, rotary tables) on the first stage and everything after the last
/// (final norm, head, loss) on the last.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Pipeline {
    /// Pipeline ranks `P` (`--pp`).
    pub stages: u64,
    /// The schedule (`--schedule`).
    pub schedule: Schedule,
    /// Micro-batches per step `M` (`--micro-batches`; each of `--batch` samples).
    pub micro_batches: u64,
    /// Model chunks per pipeline rank `V` (`--virtual-stages`, interleaved only; 1 otherwise).
    pub virtual_stages: u64,
}

impl Pipeline {
    /// How many micro-batches' activations model chunk `chunk` (0-based, `0..V`) of pipeline
    /// rank `rank` holds at most at once, in the schedule's steady state.
    ///
    /// - GPipe: all `M` (every forward runs before the first backward).
    /// - 1F1B: `min(M, P − rank)` (`Schedule1F1B`'s `warmup_chunks = min(M, P − rank)`;
    ///   Megatron's `num_warmup_microbatches = P − rank − 1`, plus the one in its steady
    ///   1F1B step; Narayanan et al. 2021, §2.2.1: "at most p in-flight microbatches").
    /// - Interleaved: Megatron-LM `forward_backward_pipelining_with_interleaving`: rank `r`
    ///   runs `(P − r − 1)·2 + (V − 1)·P` warm-up forwards (capped at `M·V`), then one more
    ///   before its first backward; forward `k` runs chunk `(k / P) mod V`. A chunk's count is
    ///   how many of those first forwards are its own. On rank 0 this holds
    ///   `L·(1 + (P − 1)/(P·V))` layers' worth of activations for `L/P` layers per rank, the
    ///   figure of Korthikanti et al. 2022, §4.2.3.
    #[must_use]
    pub fn in_flight(&self, rank: u64, chunk: u64) -> u64 {
        let (p, m, v) = (
            self.stages.max(1),
            self.micro_batches.max(1),
            self.virtual_stages.max(1),
        );
        match self.schedule {
            Schedule::Gpipe => m,
            Schedule::OneFOneB => m.min(p.saturating_sub(rank).max(1)),
            Schedule::Interleaved => {
                let warmup = p
                    .saturating_sub(rank)
                    .saturating_sub(1)
                    .saturating_mul(2)
                    .saturating_add((v - 1).saturating_mul(p));
                let total = m.saturating_mul(v);
                let n = warmup.saturating_add(1).min(total);
                // Forwards 0..n, forward k on chunk (k / P) mod V.
                let group = p.saturating_mul(v);
                let full = n / group;
                let rest = n % group;
                let here = rest.saturating_sub(chunk.saturating_mul(p)).min(p);
                full.saturating_mul(p).saturating_add(here).min(m)
            }
        }
    }
}

/// Expert parallelism (`--ep E`): each mixture-of-experts layer's experts divided across `E`
/// ranks, tokens sent to their experts' ranks and back by all-to-all (Megatron-Core MoE's
/// `MoEAlltoAllTokenDispatcher`; DeepSpeed-MoE, Rajbhandari et al. 2022). Every other
/// parameter is replicated as the data-parallel plan says.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, schemars::JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct ExpertParallel {
    /// Ranks the experts are divided across (`--ep`).
    pub ranks: u64,
    /// `--capacity-factor`: each expert takes at most `ceil(factor · tokens · top_k /
    /// experts)` tokens and its buffers are padded to that (GShard, Switch Transformer;
    /// Megatron-Core `moe_expert_capacity_factor` with `moe_pad_expert_input_to_capacity`);
    /// `None`: dropless, tokens per expert as routed (balanced routing assumed).
    pub capacity_factor: Option<f64>,
}

// The capacity factor is checked finite and positive when the flags are read: never NaN.
impl Eq for ExpertParallel {}

/// How the data-parallel ranks share the model states.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(tag = "engine", rename_all = "snake_case")]
pub enum Sharding {
    /// PyTorch `DistributedDataParallel`: every rank holds everything; gradients are
    /// all-reduced through buckets (`--ddp`, the default of `--gpus N`).
    Ddp(Ddp),
    /// DeepSpeed ZeRO (`--zero 0|1|2|3`).
    Zero(Zero),
    /// PyTorch FSDP (`--fsdp STRATEGY`), with FSDP2 `fully_shard` semantics.
    Fsdp(Fsdp),
}

/// `bytes` in MiB for the plan's description: whole MiB as an integer, else to two decimals
/// (`--bucket-cap-mb 0.25` reads "0.25 MiB", not "0 MiB").
fn mib(bytes: u64) -> String {
    let whole = bytes >> 20;
    let hundredths = ((bytes & ((1 << 20) - 1)) * 100 + (1 << 19)) >> 20;
    match hundredths {
        0 => whole.to_string(),
        100 => (whole + 1).to_string(),
        h => format!("{whole}.{h:02}").trim_end_matches('0').to_string(),
    }
}

/// DDP's gradient buckets (`torch/nn/parallel/distributed.py`, `reducer.cpp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Ddp {
    /// `bucket_cap_mb` in bytes (default 25 MiB: `bucket_cap_mb = 25` is multiplied by
    /// `1024 * 1024` in `DistributedDataParallel.__init__`).
    pub bucket_cap_bytes: u64,
    /// The limit of the first bucket DDP rebuilds (the one whose gradients are ready first),
    /// so that the first all-reduce starts early: `dist._DEFAULT_FIRST_BUCKET_BYTES` (1 MiB)
    /// with the default cap, the cap itself when `bucket_cap_mb` is given (PyTorch 2.15,
    /// `torch/nn/parallel/distributed.py`, `_BucketCapacityConfig.create`).
    pub first_bucket_bytes: u64,
    /// `gradient_as_bucket_view`: the `.grad` tensors are views into the buckets, so the
    /// buckets cost nothing beyond the gradients; else the buckets are a second gradient-sized
    /// set of flat tensors that lives as long as the model (`Reducer::initialize_buckets`).
    pub gradient_as_bucket_view: bool,
}

impl Default for Ddp {
    fn default() -> Ddp {
        Ddp {
            bucket_cap_bytes: 25 << 20,
            first_bucket_bytes: 1 << 20,
            gradient_as_bucket_view: false,
        }
    }
}

/// DeepSpeed ZeRO (`zero_optimization` in a DeepSpeed config).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Zero {
    /// 0: replicated; 1: optimizer state partitioned; 2: gradients too; 3: parameters too
    /// (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
    /// Models", §5.1–5.3: P_os, P_os+g, P_os+g+p).
    pub stage: u8,
    /// `reduce_bucket_size`, in elements (DeepSpeed's default 5e8; `5e8` in
    /// `deepspeed/runtime/zero/config.py`).
    pub reduce_bucket_elems: u64,
    /// `allgather_bucket_size`, in elements (default 5e8).
    pub allgather_bucket_elems: u64,
    /// `stage3_param_persistence_threshold`, in elements (default 1e5): ZeRO-3 keeps parameters
    /// this small gathered for the whole step.
    pub param_persistence_threshold: u64,
    /// `stage3_max_reuse_distance`, in elements (default 1e9): ZeRO-3 does not release a
    /// parameter after its forward when it is used again within this many fetched elements.
    pub max_reuse_distance_elems: u64,
    /// `stage3_prefetch_bucket_size`, in elements (default 5e7): after each fetch, ZeRO-3
    /// all-gathers the next parameters of its traced order until this many elements are in
    /// flight (`PartitionedParameterCoordinator.fetch_sub_module`).
    pub prefetch_bucket_elems: u64,
    /// `stage3_max_live_parameters`, in elements (default 1e9): a prefetch stops at this many
    /// gathered elements (`max_params_to_prefetch = min(max_live - available, bucket)`); the
    /// parameters a layer needs are fetched whatever it says.
    pub max_live_parameters: u64,
    /// `overlap_comm` (DeepSpeed's default: true for stage 3 only, the `overlap_comm_valid`
    /// validator): ZeRO-1/2 then allocate a second reduce bucket (`ipg_buffer` `buf_1`,
    /// `stage_1_and_2.py` `backward`).
    pub overlap_comm: bool,
    /// `overlap_comm` as a config file set it (`None`: left out, so it follows the stage the
    /// plan resolves to, `--zero` included).
    #[serde(skip)]
    #[schemars(skip)]
    pub overlap_comm_in_file: Option<bool>,
    /// `contiguous_gradients` (default true): gradients are copied into the reduce bucket
    /// (`ipg_buffer` for stages 1-2, `__ipg_bucket_flat_buffer` for stage 3); false: no bucket
    /// is allocated.
    pub contiguous_gradients: bool,
    /// Sizes a Hugging Face Trainer config left `"auto"`, filled from the model's hidden size
    /// when the model is known ([`Plan::fill_auto`]).
    #[serde(skip)]
    #[schemars(skip)]
    pub auto_from_hidden: deepspeed::AutoFromHidden,
}

impl Zero {
    /// DeepSpeed's defaults for `stage` (`deepspeed/runtime/zero/config.py`).
    #[must_use]
    pub const fn stage(stage: u8) -> Zero {
        Zero {
            stage,
            reduce_bucket_elems: 500_000_000,
            allgather_bucket_elems: 500_000_000,
            param_persistence_threshold: 100_000,
            max_reuse_distance_elems: 1_000_000_000,
            prefetch_bucket_elems: 50_000_000,
            max_live_parameters: 1_000_000_000,
            overlap_comm: stage == 3,
            overlap_comm_in_file: None,
            contiguous_gradients: true,
            auto_from_hidden: deepspeed::AutoFromHidden {
                reduce_bucket: false,
                prefetch_bucket: false,
                persistence_threshold: false,
            },
        }
    }
}

/// FSDP (`torch.distributed.fsdp`): its sharding strategy, as FSDP2's `fully_shard` runs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Fsdp {
    /// The strategy named (`--fsdp`).
    pub strategy: FsdpStrategy,
    /// `reshard_after_forward`: each block's gathered parameters are freed after its forward
    /// and gathered again for its backward (`full-shard`, `hybrid-shard`); else they stay from
    /// forward to backward (`shard-grad-op`). The root module never reshards after forward
    /// (FSDP2 `FSDPState._lazy_init` sets the root's `post_forward_mesh_info` to `None`).
    pub reshard_after_forward: bool,
    /// Ranks one shard group spans: all data-parallel ranks, or the GPUs of one node under
    /// `hybrid-shard` (the rest replicate), or 1 under `no-shard`.
    pub shard_group: u64,
    /// `MixedPrecisionPolicy.reduce_dtype` (`--reduce-dtype`): the dtype of the
    /// reduce-scatter, or `None` for PyTorch's default. `FSDPParamGroup._get_reduce_dtype`
    /// (`torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py`) returns it when set, else
    /// promotes over the parameters' gradient accumulation dtype (their original dtype: float32
    /// under a 16-bit `param_dtype`). `foreach_reduce`
    /// (`torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`) allocates the
    /// reduce-scatter input and output in it, and `_cast_and_view_sharded_grads` casts the
    /// output to each parameter's sharded gradient dtype when they differ. Not in the JSON
    /// plan (the `mixed-*` recipe and the figures say it).
    #[serde(skip)]
    #[schemars(skip)]
    pub reduce_dtype: Option<DType>,
}

/// FSDP sharding strategies (FSDP1's `ShardingStrategy` names; FSDP2 expresses them with
/// `reshard_after_forward` and a 2-D mesh).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, schemars::JsonSchema, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum FsdpStrategy {
    /// Parameters, gradients and optimizer state sharded; parameters freed after each block's
    /// forward (ZeRO-3).
    FullShard,
    /// Gradients and optimizer state sharded; parameters gathered in forward stay until
    /// backward (ZeRO-2).
    ShardGradOp,
    /// Nothing sharded: DDP through FSDP.
    NoShard,
    /// Full shard within a node of `--gpus-per-node` GPUs, replicated across nodes.
    HybridShard,
}

impl std::fmt::Display for FsdpStrategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FsdpStrategy::FullShard => "full-shard",
            FsdpStrategy::ShardGradOp => "shard-grad-op",
            FsdpStrategy::NoShard => "no-shard",
            FsdpStrategy::HybridShard => "hybrid-shard",
        })
    }
}

impl Fsdp {
    /// `strategy` over `dp` data-parallel ranks, `gpus_per_node` of them per node (the
    /// `hybrid-shard` group).
    #[must_use]
    pub fn new(strategy: FsdpStrategy, dp: u64, gpus_per_node: u64) -> Fsdp {
        let (reshard_after_forward, shard_group) = match strategy {
            FsdpStrategy::FullShard => (true, dp),
            FsdpStrategy::ShardGradOp => (false, dp),
            FsdpStrategy::NoShard => (false, 1),
            FsdpStrategy::HybridShard => (true, gpus_per_node.clamp(1, dp.max(1))),
        };
        Fsdp {
            strategy,
            reshard_after_forward,
            shard_group,
            reduce_dtype: None,
        }
    }
}

/// What a plan does to each model state, as ranks over which it is split (1: replicated).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    /// Ranks sharing the parameters.
    pub params: u64,
    /// Ranks sharing the gradients.
    pub grads: u64,
    /// Ranks sharing the optimizer state (and master weights).
    pub optimizer: u64,
}

impl Plan {
    /// A plan of `gpus` ranks, all data parallel, sharing the model states as `sharding` says.
    #[must_use]
    pub const fn data_parallel_only(gpus: u64, sharding: Sharding) -> Plan {
        Plan {
            gpus,
            tp: 1,
            pp: 1,
            cp: 1,
            sharding,
            offload: Offload::none(),
            tensor: Tensor {
                sp: false,
                style: TpStyle::Dtensor,
            },
            pipeline: None,
            experts: None,
        }
    }

    /// Whether every data-parallel group has one rank while the model is split (`--tp`,
    /// `--cp`): no data-parallel engine runs then (no buckets, nothing sharded).
    #[must_use]
    pub fn model_parallel_only(&self) -> bool {
        self.data_parallel() == Some(1) && self.tp.saturating_mul(self.cp) > 1
    }

    /// The data-parallel degree: `gpus / (tp · pp · cp)`; `None` when they do not divide.
    #[must_use]
    pub fn data_parallel(&self) -> Option<u64> {
        let model = self.tp.checked_mul(self.pp)?.checked_mul(self.cp)?;
        (model > 0 && self.gpus.is_multiple_of(model)).then(|| self.gpus / model)
    }

    /// Over how many ranks each model state is split.
    #[must_use]
    pub fn split(&self) -> Split {
        let dp = self.data_parallel().unwrap_or(1).max(1);
        match self.sharding {
            Sharding::Ddp(_) => Split {
                params: 1,
                grads: 1,
                optimizer: 1,
            },
            Sharding::Zero(z) => Split {
                params: if z.stage >= 3 { dp } else { 1 },
                grads: if z.stage >= 2 { dp } else { 1 },
                optimizer: if z.stage >= 1 { dp } else { 1 },
            },
            Sharding::Fsdp(f) => Split {
                // shard-grad-op shards parameters at rest too; it only keeps them gathered
                // from forward to backward.
                params: f.shard_group,
                grads: f.shard_group,
                optimizer: f.shard_group,
            },
        }
    }

    /// The engine and its options in a few words, e.g. `FSDP full-shard over 2 GPUs`.
    #[must_use]
    pub fn describe(&self) -> String {
        let gpus = self.gpus;
        let mut model = Vec::new();
        if self.tp > 1 {
            model.push(format!(
                "{} tensor parallel {}{}",
                self.tensor.style,
                self.tp,
                if self.tensor.sp {
                    " + sequence parallel"
                } else {
                    ""
                }
            ));
        }
        if self.cp > 1 {
            model.push(format!("context parallel {}", self.cp));
        }
        let model = model.join(", ");
        if self.model_parallel_only() && self.pipeline.is_none() {
            return format!("{model} over {}", crate::units::count(gpus, "GPU"))
                + &self.describe_offload();
        }
        // Under tensor, context or pipeline parallelism the engine spans the data-parallel
        // ranks, not every GPU.
        let over = if self.data_parallel().is_some_and(|dp| dp != gpus) {
            crate::units::count(self.data_parallel().unwrap_or(1), "data-parallel rank")
        } else {
            crate::units::count(gpus, "GPU")
        };
        let engine = match self.sharding {
            Sharding::Ddp(_) if self.pp > 1 && self.data_parallel() == Some(1) => {
                "no data parallelism".to_string()
            }
            Sharding::Ddp(d) => format!(
                "DDP over {over}, {} MiB buckets{}",
                mib(d.bucket_cap_bytes),
                if d.gradient_as_bucket_view {
                    " as gradient views"
                } else {
                    ""
                }
            ),
            Sharding::Zero(z) => format!("DeepSpeed ZeRO-{} over {over}", z.stage),
            Sharding::Fsdp(f) => format!("FSDP {} over {over}", f.strategy),
        };
        let mut out = engine + &self.describe_offload();
        if let Some(p) = &self.pipeline {
            out.push_str(&format!(
                "; pipeline of {} stages ({}{}, {} micro-batches)",
                p.stages,
                p.schedule,
                if p.virtual_stages > 1 {
                    format!(", {} chunks per GPU", p.virtual_stages)
                } else {
                    String::new()
                },
                p.micro_batches
            ));
        }
        if let Some(e) = &self.experts {
            out.push_str(&format!(
                "; experts over {} ranks ({})",
                e.ranks,
                e.capacity_factor.map_or_else(
                    || "dropless".to_string(),
                    |c| format!("capacity factor {c}")
                )
            ));
        }
        if model.is_empty() {
            out
        } else {
            format!("{model}; {out}")
        }
    }

    /// `, optimizer offloaded to the CPU`, or nothing.
    fn describe_offload(&self) -> String {
        let at = |t: OffloadTarget| match t {
            OffloadTarget::Cpu => "the CPU",
            OffloadTarget::Nvme => "NVMe",
        };
        match (self.offload.optimizer, self.offload.params) {
            (None, None) => String::new(),
            (Some(o), None) => format!(", optimizer offloaded to {}", at(o)),
            (None, Some(p)) => format!(", parameters offloaded to {}", at(p)),
            (Some(o), Some(p)) if o == p => {
                format!(", optimizer and parameters offloaded to {}", at(o))
            }
            (Some(o), Some(p)) => format!(
                ", optimizer offloaded to {}, parameters to {}",
                at(o),
                at(p)
            ),
        }
    }

    /// The dtype DeepSpeed keeps its optimizer's master partitions in: always float32 (ZeRO-1/2
    /// `single_partition_of_fp32_groups`, ZeRO-3 `fp32_partitioned_groups_flat`), even for a
    /// float32 model, where it is a second copy. `None` for engines without master partitions.
    #[must_use]
    pub fn master_partition_dtype(&self) -> Option<DType> {
        match self.sharding {
            Sharding::Zero(z) if z.stage >= 1 => Some(DType::Float32),
            _ => None,
        }
    }
}

/// A plan as a configuration file states it (a DeepSpeed JSON config, [`deepspeed::read`], or
/// an accelerate YAML config, [`accelerate::read`]), before the flags override it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ConfigPlan {
    /// World size, when the file says it (accelerate's `num_processes`).
    pub gpus: Option<u64>,
    /// The engine, when the file names one.
    pub engine: Option<ConfigEngine>,
    /// What the file offloads.
    pub offload: Offload,
    /// Micro-batch per GPU (`train_micro_batch_size_per_gpu`).
    pub micro_batch: Option<u64>,
    /// Micro-batches per optimizer step (`gradient_accumulation_steps`).
    pub grad_accum: Option<u64>,
    /// Samples per optimizer step over all GPUs (`train_batch_size` = micro-batch ×
    /// accumulation × data-parallel ranks).
    pub train_batch: Option<u64>,
    /// The dtype the engine casts the model to (DeepSpeed's `bf16`/`fp16` sections:
    /// `DeepSpeedEngine._configure_distributed_model` calls `module.bfloat16()`/`half()`).
    pub dtype: Option<DType>,
    /// A precision recipe (accelerate's `mixed_precision` under FSDP: a
    /// `MixedPrecisionPolicy` over float32 shards, memest's `mixed-bf16`/`mixed-fp16`).
    pub recipe: Option<crate::cost::RecipeName>,
    /// Autocast (accelerate's `mixed_precision` under DDP).
    pub amp: Option<crate::cost::Amp>,
    /// FSDP's `MixedPrecisionPolicy.reduce_dtype` as the file implies it: accelerate's
    /// `mixed_precision: bf16|fp16` under FSDP builds
    /// `MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype, output_dtype=dtype)`
    /// (`FullyShardedDataParallelPlugin.set_mixed_precision` in
    /// `accelerate/utils/dataclasses.py`, accelerate 1.15). `--reduce-dtype` overrides it.
    pub fsdp_reduce_dtype: Option<DType>,
    /// DeepSpeed's `data_types.grad_accum_dtype` is `fp32` (with `bf16` at ZeRO-1 it selects
    /// `BF16_Optimizer`, which memest does not model: [`PlanFlags::resolve`] refuses it).
    pub grad_accum_fp32: bool,
    /// Activation checkpointing of every block (accelerate's `fsdp_activation_checkpointing`).
    pub checkpoint: Option<bool>,
    /// The optimizer (DeepSpeed's `optimizer.type`).
    pub optimizer: Option<crate::cost::Optimizer>,
    /// Keys read but not modelled, or unknown, each with its path in the file.
    pub notes: Vec<ConfigNote>,
}

/// The engine a configuration file names.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ConfigEngine {
    /// Plain data parallelism (accelerate `MULTI_GPU`).
    Ddp,
    /// DeepSpeed ZeRO with its options.
    Zero(Zero),
    /// FSDP: a strategy, and `reshard_after_forward` when the file sets it apart from the
    /// strategy (FSDP2's `fsdp_reshard_after_forward`).
    Fsdp(FsdpStrategy, Option<bool>),
}

/// One key of a configuration file that memest reads but does not model, or does not know.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct ConfigNote {
    /// The key's path, e.g. `zero_optimization.sub_group_size`.
    pub key: String,
    /// What memest does with it.
    pub message: String,
}

impl ConfigNote {
    /// The path of `key` inside the object at `at` (`""` for the top level).
    pub(crate) fn path(at: &str, key: &str) -> String {
        if at.is_empty() {
            key.to_owned()
        } else {
            format!("{at}.{key}")
        }
    }

    /// A key memest reads but whose memory effect it does not count.
    pub(crate) fn not_modelled(key: String) -> Self {
        Self {
            key,
            message: "read, not modelled: it may change memory in a way memest does not count"
                .into(),
        }
    }

    /// A key `engine`'s table (`known`) does not list, with the nearest known key.
    pub(crate) fn unknown(key: String, name: &str, known: &[&str], engine: &str) -> Self {
        let hint = crate::error::nearest(name, known)
            .map(|n| format!(" (did you mean {n}?)"))
            .unwrap_or_default();
        Self {
            key,
            message: format!("not {engine} key memest knows; ignored{hint}"),
        }
    }
}

/// `--reduce-dtype`: the dtype FSDP2 reduces gradients in (`MixedPrecisionPolicy.reduce_dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum ReduceDtype {
    /// `torch.float32`.
    Fp32,
    /// `torch.bfloat16`: half the reduce-scatter of float32.
    Bf16,
    /// `torch.float16`.
    Fp16,
}

impl ReduceDtype {
    /// The element type.
    #[must_use]
    pub fn dtype(self) -> DType {
        match self {
            ReduceDtype::Fp32 => DType::Float32,
            ReduceDtype::Bf16 => DType::Bfloat16,
            ReduceDtype::Fp16 => DType::Float16,
        }
    }
}

impl std::fmt::Display for ReduceDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ReduceDtype::Fp32 => "fp32",
            ReduceDtype::Bf16 => "bf16",
            ReduceDtype::Fp16 => "fp16",
        })
    }
}

/// The parallel flags as given (`--gpus`, `--ddp`, `--zero`, `--fsdp` and their options),
/// before they are checked and made a [`Plan`].
#[derive(Clone, Debug, Default)]
pub struct PlanFlags {
    /// `--gpus N`.
    pub gpus: Option<u64>,
    /// `--ddp`.
    pub ddp: bool,
    /// `--zero STAGE`.
    pub zero: Option<u8>,
    /// `--fsdp STRATEGY`.
    pub fsdp: Option<FsdpStrategy>,
    /// `--bucket-cap-mb` (DDP's `bucket_cap_mb`, MiB).
    pub bucket_cap_mb: Option<f64>,
    /// `--gradient-as-bucket-view`.
    pub gradient_as_bucket_view: bool,
    /// `--gpus-per-node` (the `hybrid-shard` group; default 8).
    pub gpus_per_node: Option<u64>,
    /// `--reduce-bucket-size` (DeepSpeed `reduce_bucket_size`, elements).
    pub reduce_bucket_size: Option<u64>,
    /// `--reduce-dtype` (FSDP2 `MixedPrecisionPolicy.reduce_dtype`; needs `--fsdp`).
    pub reduce_dtype: Option<ReduceDtype>,
    /// `--offload`.
    pub offload: Option<OffloadFlag>,
    /// `--deepspeed FILE` or `--accelerate FILE`, read; the flags above override it.
    pub config: Option<ConfigPlan>,
    /// The micro-batch and accumulation steps in effect (flags over the config), to check the
    /// config's `train_batch_size` and to derive the world size from it.
    pub batch_and_accum: (Option<u64>, Option<u64>),
    /// `--tp T` (tensor-parallel degree).
    pub tp: Option<u64>,
    /// `--sp` (sequence parallel; needs `--tp`).
    pub sp: bool,
    /// `--cp C` (context-parallel degree).
    pub cp: Option<u64>,
    /// `--tp-style` (default DTensor).
    pub tp_style: Option<TpStyle>,
    /// `--pp` (pipeline ranks), `--schedule`, `--micro-batches`, `--virtual-stages`.
    pub pipeline: PipelineFlags,
    /// `--ep` (expert-parallel ranks).
    pub ep: Option<u64>,
    /// `--capacity-factor`.
    pub capacity_factor: Option<f64>,
}

/// The pipeline flags as given.
#[derive(Clone, Copy, Debug, Default)]
pub struct PipelineFlags {
    /// `--pp P`.
    pub pp: Option<u64>,
    /// `--schedule`.
    pub schedule: Option<Schedule>,
    /// `--micro-batches M`.
    pub micro_batches: Option<u64>,
    /// `--virtual-stages V`.
    pub virtual_stages: Option<u64>,
}

impl PipelineFlags {
    /// Whether any pipeline flag is given.
    #[must_use]
    pub const fn given(&self) -> bool {
        self.pp.is_some()
            || self.schedule.is_some()
            || self.micro_batches.is_some()
            || self.virtual_stages.is_some()
    }

    /// The pipeline the flags ask for: `None` for `--pp 1` or none; the schedule defaults to
    /// 1F1B, the micro-batches to `P` (the fewest that fill the pipeline), the virtual stages
    /// to 2 under `interleaved` and 1 otherwise.
    ///
    /// # Errors
    /// A message for a schedule option without `--pp`, `--virtual-stages` without
    /// `interleaved`, or zero micro-batches or virtual stages.
    pub fn resolve(&self) -> Result<Option<Pipeline>, String> {
        let pp = self.pp.unwrap_or(1);
        if pp <= 1 {
            if self.schedule.is_some()
                || self.micro_batches.is_some()
                || self.virtual_stages.is_some()
            {
                return Err(
                    "--schedule, --micro-batches and --virtual-stages need --pp P (P ≥ 2)".into(),
                );
            }
            return Ok(None);
        }
        let schedule = self.schedule.unwrap_or(Schedule::OneFOneB);
        let virtual_stages = match (schedule, self.virtual_stages) {
            (Schedule::Interleaved, v) => v.unwrap_or(2),
            (_, None | Some(1)) => 1,
            (_, Some(_)) => {
                return Err(
                    "--virtual-stages is the interleaved schedule's: add --schedule interleaved"
                        .into(),
                );
            }
        };
        let micro_batches = self.micro_batches.unwrap_or(pp);
        if micro_batches == 0 || virtual_stages == 0 {
            return Err("--micro-batches and --virtual-stages must be at least 1".into());
        }
        Ok(Some(Pipeline {
            stages: pp,
            schedule,
            micro_batches,
            virtual_stages,
        }))
    }
}

impl PlanFlags {
    /// The plan the flags ask for: `None` without `--gpus` and without any engine flag (one
    /// GPU, as before); `--gpus N` alone is DDP. A configuration file (`config`) gives the
    /// engine, its options and the world size where the flags do not.
    ///
    /// # Errors
    /// [`Error::Setting`] ([`SettingKey::Parallel`]) for an engine flag without `--gpus`, a ZeRO
    /// stage past 3, an option of another engine (`--bucket-cap-mb` with `--zero`, …), a
    /// bucket cap that is not a positive number, an offload the engine cannot do (DDP, ZeRO-0,
    /// parameters below ZeRO-3), or a config's `train_batch_size` that disagrees with
    /// micro-batch × accumulation × data-parallel ranks.
    ///
    /// [`Error::Setting`]: crate::Error::Setting
    /// [`SettingKey::Parallel`]: crate::error::SettingKey::Parallel
    pub fn resolve(&self) -> Result<Option<Plan>, crate::Error> {
        use crate::error::SettingKey;
        let err = |m: String| crate::Error::setting(SettingKey::Parallel, m);
        let cfg = self.config.as_ref();
        let cfg_engine = cfg.and_then(|c| c.engine);
        let engine_given = self.ddp || self.zero.is_some() || self.fsdp.is_some();
        let ddp_options = self.bucket_cap_mb.is_some() || self.gradient_as_bucket_view;
        let (micro, accum) = self.batch_and_accum;
        // `train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps *
        // world_size` (DeepSpeedConfig._batch_assertion).
        let from_train_batch = cfg.and_then(|c| c.train_batch).and_then(|t| {
            let per = micro.unwrap_or(1).checked_mul(accum.unwrap_or(1))?;
            (micro.is_some() && per > 0 && t % per == 0).then(|| t / per)
        });
        let tp = self.tp.unwrap_or(1);
        let cp = self.cp.unwrap_or(1);
        if tp == 0 || cp == 0 {
            return Err(err("--tp and --cp must be at least 1".into()));
        }
        if (self.sp || self.tp_style.is_some()) && tp == 1 {
            return Err(err(
                "--sp and --tp-style apply to tensor parallelism: they need --tp 2 or more".into(),
            ));
        }
        // `--tp`/`--cp` alone: one model-parallel group, as many GPUs as it spans.
        let model_parallel = tp
            .checked_mul(cp)
            .ok_or_else(|| err("--tp × --cp is too large".into()))?;
        let pipeline = self.pipeline.resolve().map_err(err)?;
        if self.capacity_factor.is_some() && self.ep.is_none() {
            return Err(err(
                "--capacity-factor is expert parallelism's: it needs --ep E".into(),
            ));
        }
        // Pipeline or expert parallelism alone: as many GPUs as they need.
        // `--tp`/`--cp`/`--pp`/`--ep` alone: as many GPUs as they span.
        let gpus = self
            .gpus
            .or(cfg.and_then(|c| c.gpus))
            .or(from_train_batch)
            .or_else(|| {
                let all = model_parallel
                    .saturating_mul(pipeline.map_or(1, |p| p.stages))
                    .saturating_mul(self.ep.unwrap_or(1));
                (all > 1).then_some(all)
            });
        let Some(gpus) = gpus else {
            if engine_given
                || ddp_options
                || self.gpus_per_node.is_some()
                || self.reduce_bucket_size.is_some()
                || self.offload.is_some()
                || cfg.is_some()
            {
                return Err(err(
                    "--ddp, --zero, --fsdp, --offload, --deepspeed, --accelerate and their options need --gpus N (the number of GPUs)"
                        .into(),
                ));
            }
            return Ok(None);
        };
        if gpus == 0 {
            return Err(err("--gpus must be at least 1".into()));
        }
        let zero_engine = self.zero.is_some()
            || (!engine_given && matches!(cfg_engine, Some(ConfigEngine::Zero(_))));
        let fsdp_engine = self.fsdp.is_some()
            || (!engine_given && matches!(cfg_engine, Some(ConfigEngine::Fsdp(..))));
        if ddp_options && (zero_engine || fsdp_engine) {
            return Err(err(
                "--bucket-cap-mb and --gradient-as-bucket-view are DDP's options; drop them with --zero or --fsdp".into(),
            ));
        }
        if self.reduce_bucket_size.is_some() && !zero_engine {
            return Err(err(
                "--reduce-bucket-size is DeepSpeed's option: it needs --zero".into(),
            ));
        }
        let fsdp_strategy = self.fsdp.or(match cfg_engine {
            Some(ConfigEngine::Fsdp(s, _)) if !engine_given => Some(s),
            _ => None,
        });
        if let (Some(r), None) = (self.reduce_dtype, fsdp_strategy) {
            return Err(err(format!(
                "--reduce-dtype {r} is FSDP's MixedPrecisionPolicy.reduce_dtype: it needs --fsdp"
            )));
        }
        if self.gpus_per_node.is_some() && fsdp_strategy != Some(FsdpStrategy::HybridShard) {
            return Err(err(
                "--gpus-per-node sets the hybrid-shard group: it needs --fsdp hybrid-shard".into(),
            ));
        }
        let config_zero = match cfg_engine {
            Some(ConfigEngine::Zero(z)) => Some(z),
            _ => None,
        };
        let pp = pipeline.map_or(1, |p| p.stages);
        let all = model_parallel.saturating_mul(pp);
        // (Without a pipeline, the tensor/context check below words it.)
        if pp > 1 && !gpus.is_multiple_of(all) {
            return Err(err(format!(
                "--gpus {gpus} is not a multiple of --pp {pp} × --tp {tp} × --cp {cp}: data parallel = gpus / (tp · pp · cp)"
            )));
        }
        let dp = (gpus / all.max(1)).max(1);
        let experts = match self.ep {
            None | Some(1) => None,
            Some(0) => return Err(err("--ep must be at least 1".into())),
            Some(ep) => {
                // Megatron-Core draws the expert-parallel group from the data-parallel ranks.
                if !dp.is_multiple_of(ep) {
                    return Err(err(format!(
                        "--ep {ep} must divide the data-parallel ranks ({dp} = gpus / (tp · pp · cp)): the expert-parallel group is drawn from them"
                    )));
                }
                if let Some(c) = self.capacity_factor
                    && !(c.is_finite() && c > 0.0 && c < 1.0e6)
                {
                    return Err(err(format!(
                        "--capacity-factor {c}: expected a positive number"
                    )));
                }
                if matches!(self.zero.or(config_zero.map(|z| z.stage)), Some(1 | 2)) {
                    return Err(err(
                        "--ep with --zero 1 or 2 is not modelled yet (DeepSpeed-MoE's separate expert parameter groups): use --zero 0 or 3, --fsdp or DDP".into(),
                    ));
                }
                Some(ExpertParallel {
                    ranks: ep,
                    capacity_factor: self.capacity_factor,
                })
            }
        };
        let sharding = if zero_engine {
            let stage = self.zero.or(config_zero.map(|z| z.stage)).unwrap_or(0);
            if stage > 3 {
                return Err(err(format!(
                    "--zero {stage}: DeepSpeed ZeRO has stages 0 to 3"
                )));
            }
            let mut z = match config_zero {
                // The config's options, at the stage the flag asks for; DeepSpeed's
                // `overlap_comm` default (true for stage 3 only, `overlap_comm_valid` in
                // `deepspeed/runtime/zero/config.py`) follows that stage unless the file set it.
                Some(c) => Zero {
                    stage,
                    overlap_comm: c.overlap_comm_in_file.unwrap_or(stage == 3),
                    ..c
                },
                None => Zero::stage(stage),
            };
            if let Some(r) = self.reduce_bucket_size {
                // The flag wins over the file's `"auto"` too (filled later from the model).
                z.reduce_bucket_elems = r;
                z.auto_from_hidden.reduce_bucket = false;
            }
            Sharding::Zero(z)
        } else if let Some(strategy) = fsdp_strategy {
            let mut f = Fsdp::new(strategy, dp, self.gpus_per_node.unwrap_or(8));
            if let (None, Some(ConfigEngine::Fsdp(s, Some(r)))) = (self.fsdp, cfg_engine)
                && s == strategy
                && f.shard_group > 1
            {
                f.reshard_after_forward = r;
            }
            f.reduce_dtype = self
                .reduce_dtype
                .map(ReduceDtype::dtype)
                .or(match cfg_engine {
                    Some(ConfigEngine::Fsdp(s, _)) if s == strategy => {
                        cfg.and_then(|c| c.fsdp_reduce_dtype)
                    }
                    _ => None,
                });
            Sharding::Fsdp(f)
        } else {
            let mut d = Ddp::default();
            if let Some(mb) = self.bucket_cap_mb {
                if !(mb.is_finite() && mb > 0.0 && mb < 1.0e12) {
                    return Err(err(format!(
                        "--bucket-cap-mb {mb}: expected a positive number of MiB"
                    )));
                }
                // DDP: `bucket_bytes_cap = int(bucket_cap_mb * 1024 * 1024)`.
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // checked range
                let bytes = (mb * 1_048_576.0) as u64;
                d.bucket_cap_bytes = bytes;
            }
            d.gradient_as_bucket_view = self.gradient_as_bucket_view;
            if self.bucket_cap_mb.is_some() {
                // An explicit `bucket_cap_mb` is the first bucket's limit too
                // (`_BucketCapacityConfig.create`: `first_bucket_bytes_cap` is
                // `dist._DEFAULT_FIRST_BUCKET_BYTES` only when `bucket_cap_mb` is `None`).
                d.first_bucket_bytes = d.bucket_cap_bytes;
            }
            Sharding::Ddp(d)
        };
        if !gpus.is_multiple_of(model_parallel) {
            return Err(err(format!(
                "--gpus {gpus} is not a multiple of --tp {tp} × --cp {cp}: data parallel = gpus / (tp · pp · cp)"
            )));
        }
        let mut plan = Plan::data_parallel_only(gpus, sharding);
        plan.pp = pp;
        plan.pipeline = pipeline;
        plan.experts = experts;
        plan.tp = tp;
        plan.cp = cp;
        plan.tensor = Tensor {
            sp: self.sp,
            style: self.tp_style.unwrap_or_default(),
        };
        let dp = plan.data_parallel().unwrap_or(1);
        if let Sharding::Fsdp(f) = &mut plan.sharding
            && model_parallel > 1
        {
            // The shard group spans data-parallel ranks only.
            let mut g = Fsdp::new(f.strategy, dp, self.gpus_per_node.unwrap_or(8));
            g.reshard_after_forward = f.reshard_after_forward;
            g.reduce_dtype = f.reduce_dtype;
            *f = g;
        }
        plan.offload = match self.offload {
            Some(flag) => {
                let cpu = Some(OffloadTarget::Cpu);
                let pin = cfg.is_some_and(|c| c.offload.pin_memory);
                match flag {
                    OffloadFlag::Optimizer => Offload {
                        optimizer: cpu,
                        params: None,
                        pin_memory: pin,
                    },
                    OffloadFlag::Params => Offload {
                        optimizer: None,
                        params: cpu,
                        pin_memory: pin,
                    },
                    OffloadFlag::Both => Offload {
                        optimizer: cpu,
                        params: cpu,
                        pin_memory: pin,
                    },
                }
            }
            None => cfg.map_or(Offload::none(), |c| c.offload),
        };
        plan.check_offload()?;
        plan.check_deepspeed_precision(cfg)?;
        if let (Some(t), Some(dp)) = (cfg.and_then(|c| c.train_batch), plan.data_parallel())
            && let (Some(m), a) = (micro, accum.unwrap_or(1))
            && m.checked_mul(a).and_then(|x| x.checked_mul(dp)) != Some(t)
        {
            return Err(err(format!(
                "train_batch_size {t} is not train_micro_batch_size_per_gpu {m} × gradient_accumulation_steps {a} × {dp} data-parallel GPUs (DeepSpeed requires it to be)"
            )));
        }
        Ok(Some(plan))
    }
}

impl Plan {
    /// Fills the DeepSpeed sizes a config left `"auto"` from the model's `hidden_size`, as the
    /// Hugging Face Trainer does.
    ///
    /// # Errors
    /// [`Error::Setting`](crate::Error::Setting) naming the `"auto"` keys when `hidden` is
    /// `None` (the Trainer's `ValueError`: the config has neither `hidden_size` nor
    /// `hidden_sizes`).
    pub fn fill_auto(&mut self, hidden: Option<u64>) -> Result<(), crate::Error> {
        let Sharding::Zero(z) = &mut self.sharding else {
            return Ok(());
        };
        let auto = z.auto_from_hidden;
        if !auto.any() {
            return Ok(());
        }
        let Some(h) = hidden else {
            let keys: Vec<&str> = [
                (auto.reduce_bucket, "zero_optimization.reduce_bucket_size"),
                (
                    auto.prefetch_bucket,
                    "zero_optimization.stage3_prefetch_bucket_size",
                ),
                (
                    auto.persistence_threshold,
                    "zero_optimization.stage3_param_persistence_threshold",
                ),
            ]
            .into_iter()
            .filter_map(|(on, k)| on.then_some(k))
            .collect();
            return Err(crate::Error::setting(
                crate::error::SettingKey::Parallel,
                format!(
                    "the model has no hidden size to fill the DeepSpeed config's \"auto\" {} from (as the Hugging Face Trainer, which reads the config's hidden_size or hidden_sizes): give {} a number (or --reduce-bucket-size)",
                    keys.join(", "),
                    if keys.len() == 1 { "it" } else { "them" }
                ),
            ));
        };
        auto.fill(z, h);
        z.auto_from_hidden = deepspeed::AutoFromHidden::default();
        Ok(())
    }

    /// Refuses the DeepSpeed precision wrappers memest does not model. Outside ZeRO, or at
    /// ZeRO-1 with `bf16` and `data_types.grad_accum_dtype: fp32` (without optimizer offload),
    /// `DeepSpeedEngine._do_optimizer_sanity_check` (`deepspeed/runtime/engine.py`) wraps the
    /// optimizer in `FP16_Optimizer`/`FP16_UnfusedOptimizer` (`fp16`; `bf16` too in recent
    /// DeepSpeed, its `DDP_BFLOAT16`: float32 master copies of every parameter) or
    /// `BF16_Optimizer` (`bf16` with float32 gradient accumulation: float32 master partitions
    /// and a float32 gradient accumulation buffer of every parameter). memest would model these
    /// as pure 16-bit training, so it refuses them.
    ///
    /// # Errors
    /// [`Error::Setting`](crate::Error::Setting) for those plans, naming the wrapper.
    fn check_deepspeed_precision(&self, cfg: Option<&ConfigPlan>) -> Result<(), crate::Error> {
        let (Sharding::Zero(z), Some(c)) = (self.sharding, cfg) else {
            return Ok(());
        };
        let section = match c.dtype {
            Some(DType::Bfloat16) => "bf16",
            Some(DType::Float16) => "fp16",
            _ => return Ok(()),
        };
        let wrapper = if z.stage == 0 {
            if section == "fp16" {
                "FP16_Optimizer (FP16_UnfusedOptimizer for unfused optimizers)"
            } else if c.grad_accum_fp32 {
                "BF16_Optimizer"
            } else {
                "BF16_Optimizer (older DeepSpeed) or FP16_Optimizer over bfloat16 (recent DeepSpeed's DDP_BFLOAT16)"
            }
        } else if z.stage == 1
            && section == "bf16"
            && c.grad_accum_fp32
            && self.offload.optimizer.is_none()
        {
            "BF16_Optimizer"
        } else {
            return Ok(());
        };
        Err(crate::Error::setting(
            crate::error::SettingKey::Parallel,
            format!(
                "DeepSpeed ZeRO-{} with {section} runs {wrapper}, with float32 master weights (and gradient buffers) that memest does not model; use ZeRO stage {} or more, or leave {section} off",
                z.stage,
                z.stage + 1
            ),
        ))
    }

    /// Checks that the engine can offload what the plan offloads, and puts FSDP's offload in
    /// its one form (FSDP2's `CPUOffloadPolicy` moves parameters, gradients and optimizer state
    /// together).
    ///
    /// # Errors
    /// [`Error::Setting`](crate::Error::Setting) for offload under DDP or ZeRO-0, parameter
    /// offload below ZeRO-3 (`offload_param` is "valid only with stage 3",
    /// `DeepSpeedZeroConfig`), or optimizer-only offload under FSDP.
    pub fn check_offload(&mut self) -> Result<(), crate::Error> {
        use crate::error::SettingKey;
        let err = |m: &str| Err(crate::Error::setting(SettingKey::Parallel, m));
        if !self.offload.any() {
            return Ok(());
        }
        match self.sharding {
            Sharding::Ddp(_) => err(
                "offload needs DeepSpeed ZeRO (--zero 1-3) or FSDP (--fsdp): DDP keeps everything on each GPU",
            ),
            Sharding::Zero(z) if z.stage == 0 => err(
                "offload needs ZeRO stage 1 or more (offload_optimizer is valid for stages 1, 2 and 3)",
            ),
            Sharding::Zero(z) if z.stage < 3 && self.offload.params.is_some() => err(
                "parameter offload (offload_param) is valid only with ZeRO stage 3; use --offload optimizer or --zero 3",
            ),
            Sharding::Zero(z) => {
                // `stage_1_and_2.py`: `cpu_offload = offload_optimizer.device != none`; NVMe is
                // host offload at ZeRO-1/2 (only ZeRO-3 swaps to NVMe).
                if z.stage < 3 && self.offload.optimizer == Some(OffloadTarget::Nvme) {
                    self.offload.optimizer = Some(OffloadTarget::Cpu);
                }
                Ok(())
            }
            Sharding::Fsdp(_) => {
                if self.offload.params.is_none() {
                    return err(
                        "FSDP offloads parameters, gradients and optimizer state together (CPUOffloadPolicy): use --offload params or both",
                    );
                }
                let to = self.offload.params;
                self.offload = Offload {
                    optimizer: to,
                    params: to,
                    pin_memory: true,
                };
                Ok(())
            }
        }
    }
}
