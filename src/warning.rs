//! Warnings: flags or settings without effect, reported beside the estimate (JSON `warnings`,
//! `warning: …` lines on standard error). A leaf module, so that settings resolution and the report
//! can both name them without importing each other.

use schemars::JsonSchema;
use serde::Serialize;

/// A flag or setting without effect, reported beside the estimate.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Warning {
    /// `--seq` or `--context` on a model whose input has no `"seq"` dimension.
    SeqWithoutSeqDim,
    /// `--target-seq` on a model none of whose inputs has a `"target_seq"` dimension.
    TargetSeqWithoutDim,
    /// `--group-size` or `--double-quant` without `--dtype int4` or `nf4`.
    QuantFlagsWithoutQuant,
    /// `--checkpoint` on a model without repeated blocks.
    CheckpointWithoutBlocks,
    /// `--attention` on a model without attention layers.
    AttentionWithoutAttention,
    /// `--group-size` with a quantized format other than int4 (GPTQ groups).
    GroupSizeWithoutInt4,
    /// `--double-quant` with a quantized format other than nf4 (bitsandbytes).
    DoubleQuantWithoutNf4,
    /// A sequence longer than the model was trained for (`max_positions`, a config's
    /// `max_position_embeddings`), without `--allow-long-context`.
    SeqPastMaxPositions {
        /// The sequence length estimated.
        seq: u64,
        /// The model's trained limit.
        max_positions: u64,
    },
    /// `--max-context` stopped at the rows of a learned position table (`position_embedding`
    /// `num_positions`): a longer sequence cannot be run, whatever the budget.
    ContextAtPositionTable {
        /// The table's rows, the context reported.
        num_positions: u64,
    },
    /// `--max-context` stopped at the model's `max_positions` although a longer context fits
    /// the budget (`--allow-long-context` searches past it).
    ContextCappedAtMaxPositions {
        /// The model's trained limit, the context reported.
        max_positions: u64,
        /// The longest context that fits the budget.
        fits: u64,
    },
    /// `--expandable-segments` where the CUDA caching allocator is not modelled (`--device
    /// cpu`, or a multi-GPU plan other than DDP and FSDP alone).
    ExpandableSegmentsWithoutAllocator,
    /// `--cudnn-workspace` where no convolution takes it: the estimate is not on CUDA
    /// (`--device cpu`), or the model has no convolution layer.
    CudnnWorkspaceWithoutConvolutions {
        /// The estimate is on CUDA (so the model has no convolution).
        cuda: bool,
    },
    /// A key of a `--deepspeed` or `--accelerate` config that memest reads but does not model,
    /// or does not know.
    ConfigKey {
        /// The file as given on the command line.
        file: String,
        /// The key's path in it, e.g. `zero_optimization.sub_group_size`.
        key: String,
        /// What memest does with it.
        message: String,
    },
}

impl Warning {
    /// The message, naming the model file as `origin`.
    #[must_use]
    pub fn message(&self, origin: &str) -> String {
        match self {
            Warning::SeqWithoutSeqDim => format!(
                "--seq/--context set no length: the input of {origin} has no \"seq\" dimension"
            ),
            Warning::TargetSeqWithoutDim => format!(
                "--target-seq sets no length: no input of {origin} has a \"target_seq\" dimension"
            ),
            Warning::QuantFlagsWithoutQuant => {
                "--group-size and --double-quant apply only to --dtype int4 and nf4".to_string()
            }
            Warning::CheckpointWithoutBlocks => {
                format!("--checkpoint has no effect: {origin} has no repeated blocks to checkpoint")
            }
            Warning::AttentionWithoutAttention => {
                format!("--attention has no effect: {origin} has no attention layers")
            }
            Warning::GroupSizeWithoutInt4 => {
                "--group-size applies only to --dtype int4 (GPTQ groups); it has no effect here"
                    .to_string()
            }
            Warning::DoubleQuantWithoutNf4 => {
                "--double-quant applies only to --dtype nf4 (bitsandbytes); it has no effect here"
                    .to_string()
            }
            Warning::ContextAtPositionTable { num_positions } => format!(
                "--max-context stopped at the {num_positions} rows of {origin}'s learned position table (position_embedding num_positions): no longer sequence can run"
            ),
            Warning::SeqPastMaxPositions { seq, max_positions } => format!(
                "sequence length {seq} is past the {max_positions} positions {origin} was trained for (max_position_embeddings); --allow-long-context silences this"
            ),
            Warning::ContextCappedAtMaxPositions {
                max_positions,
                fits,
            } => format!(
                "--max-context stopped at the {max_positions} positions {origin} was trained for (max_position_embeddings); {fits} tokens would fit the budget (--allow-long-context searches past the limit)"
            ),
            Warning::ConfigKey { file, key, message } => format!("{file}: {key}: {message}"),
            Warning::CudnnWorkspaceWithoutConvolutions { cuda: false } => {
                "--cudnn-workspace has no effect: cuDNN's convolution workspace is taken on CUDA only, not with --device cpu"
                    .to_string()
            }
            Warning::CudnnWorkspaceWithoutConvolutions { cuda: true } => {
                format!("--cudnn-workspace has no effect: {origin} has no convolution layer (the workspace is taken by cuDNN's convolutions)")
            }
            Warning::ExpandableSegmentsWithoutAllocator => {
                "--expandable-segments has no effect: the CUDA caching allocator is modelled on CUDA for one GPU or each rank of DDP and FSDP (not --device cpu, DeepSpeed ZeRO, tensor, pipeline, context or expert parallelism, or offloading)"
                    .to_string()
            }
        }
    }
}
