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

pub mod shard;

use serde::Serialize;

use crate::dtype::DType;

/// `--gpus N` and how the ranks share the step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Plan {
    /// GPUs (ranks) in all: `dp · tp · pp · cp`.
    pub gpus: u64,
    /// Tensor-parallel degree (1: not split; tensor parallelism is not modelled yet).
    pub tp: u64,
    /// Pipeline-parallel degree (1: one stage).
    pub pp: u64,
    /// Context-parallel degree (1: whole sequences per rank).
    pub cp: u64,
    /// How the data-parallel ranks share parameters, gradients and optimizer state.
    pub sharding: Sharding,
}

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

/// DDP's gradient buckets (`torch/nn/parallel/distributed.py`, `reducer.cpp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Ddp {
    /// `bucket_cap_mb` in bytes (default 25 MiB: `bucket_cap_mb = 25` is multiplied by
    /// `1024 * 1024` in `DistributedDataParallel.__init__`).
    pub bucket_cap_bytes: u64,
    /// The first bucket's cap (`dist._DEFAULT_FIRST_BUCKET_BYTES`, 1 MiB), so that the first
    /// all-reduce starts early.
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
        }
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
        match self.sharding {
            Sharding::Ddp(d) => format!(
                "DDP over {gpus} GPUs, {} MiB buckets{}",
                d.bucket_cap_bytes >> 20,
                if d.gradient_as_bucket_view {
                    " as gradient views"
                } else {
                    ""
                }
            ),
            Sharding::Zero(z) => format!("DeepSpeed ZeRO-{} over {gpus} GPUs", z.stage),
            Sharding::Fsdp(f) => format!("FSDP {} over {gpus} GPUs", f.strategy),
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
}

impl PlanFlags {
    /// The plan the flags ask for: `None` without `--gpus` and without any engine flag (one
    /// GPU, as before); `--gpus N` alone is DDP.
    ///
    /// # Errors
    /// [`Error::Setting`] ([`SettingKey::Parallel`]) for an engine flag without `--gpus`, a ZeRO
    /// stage past 3, an option of another engine (`--bucket-cap-mb` with `--zero`, …), or a
    /// bucket cap that is not a positive number.
    ///
    /// [`Error::Setting`]: crate::Error::Setting
    /// [`SettingKey::Parallel`]: crate::error::SettingKey::Parallel
    pub fn resolve(&self) -> Result<Option<Plan>, crate::Error> {
        use crate::error::SettingKey;
        let err = |m: String| crate::Error::setting(SettingKey::Parallel, m);
        let engine_given = self.ddp || self.zero.is_some() || self.fsdp.is_some();
        let ddp_options = self.bucket_cap_mb.is_some() || self.gradient_as_bucket_view;
        let Some(gpus) = self.gpus else {
            if engine_given
                || ddp_options
                || self.gpus_per_node.is_some()
                || self.reduce_bucket_size.is_some()
            {
                return Err(err(
                    "--ddp, --zero, --fsdp and their options need --gpus N (the number of GPUs)"
                        .into(),
                ));
            }
            return Ok(None);
        };
        if gpus == 0 {
            return Err(err("--gpus must be at least 1".into()));
        }
        if ddp_options && (self.zero.is_some() || self.fsdp.is_some()) {
            return Err(err(
                "--bucket-cap-mb and --gradient-as-bucket-view are DDP's options; drop them with --zero or --fsdp".into(),
            ));
        }
        if self.reduce_bucket_size.is_some() && self.zero.is_none() {
            return Err(err(
                "--reduce-bucket-size is DeepSpeed's option: it needs --zero".into(),
            ));
        }
        if self.gpus_per_node.is_some() && self.fsdp != Some(FsdpStrategy::HybridShard) {
            return Err(err(
                "--gpus-per-node sets the hybrid-shard group: it needs --fsdp hybrid-shard".into(),
            ));
        }
        let sharding = if let Some(stage) = self.zero {
            if stage > 3 {
                return Err(err(format!(
                    "--zero {stage}: DeepSpeed ZeRO has stages 0 to 3"
                )));
            }
            let mut z = Zero::stage(stage);
            if let Some(r) = self.reduce_bucket_size {
                z.reduce_bucket_elems = r;
            }
            Sharding::Zero(z)
        } else if let Some(strategy) = self.fsdp {
            Sharding::Fsdp(Fsdp::new(strategy, gpus, self.gpus_per_node.unwrap_or(8)))
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
            Sharding::Ddp(d)
        };
        Ok(Some(Plan::data_parallel_only(gpus, sharding)))
    }
}
