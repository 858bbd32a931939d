//! Run settings: batch, sequence length, dtypes, optimizer, mode, and how kernels behave.
//! The file's `[defaults]` give the starting values; command-line flags override them. This
//! module only resolves them: the closed sets of names are in [`mod@crate::vocab`] and
//! [`crate::cost`], what they cost in [`crate::cost`].

use serde::Serialize;

use crate::dtype::DType;
use crate::error::{Error, SettingKey};
use crate::spec::DefaultsSpec;

pub use crate::cost::{Amp, Optimizer, OptimizerImpl, Quant, Recipe, RecipeName};
pub use crate::gpu::Arch;
pub use crate::vocab::{AttentionImpl, BudgetOn, Device, Mode};

/// Command-line overrides; `None` keeps the file's default.
#[derive(Clone, Debug, Default)]
#[allow(missing_docs)] // each mirrors a field of Settings
pub struct Overrides {
    pub batch: Option<u64>,
    pub seq: Option<u64>,
    pub target_seq: Option<u64>,
    pub dtype: Option<DType>,
    pub optimizer: Option<Optimizer>,
    pub optimizer_impl: Option<OptimizerImpl>,
    pub mode: Option<Mode>,
    pub attention: Option<AttentionImpl>,
    pub amp: Option<Amp>,
    pub checkpoint: bool,
    /// `--selective-recompute`.
    pub selective_recompute: bool,
    pub device: Option<Device>,
    pub lora: Option<Lora>,
    pub quant: Option<Quant>,
    pub kv_dtype: Option<DType>,
    pub recipe: Option<RecipeName>,
    pub parallel: Option<crate::parallel::Plan>,
    /// `--expandable-segments`: the CUDA caching allocator runs with
    /// `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`.
    pub expandable_segments: bool,
    /// `--keep-grads`: `zero_grad(set_to_none=False)`, the gradients stay allocated.
    pub keep_grads: bool,
    pub grad_accum: Option<u64>,
    pub optim_in_backward: bool,
    pub paged: bool,
    pub ema: Option<EmaPrecision>,
    pub new_tokens: Option<u64>,
    pub loss: Option<Loss>,
    pub lora_dtype: Option<DType>,
    pub lora_dropout: Option<f64>,
    pub qlora_stack: Option<QloraStack>,
    /// `--gpu`: the card whose compute capability the kernels follow and whose size is the
    /// default budget.
    pub gpu: Option<&'static crate::gpu::Gpu>,
    /// `--cuda-context`, in bytes.
    pub cuda_context: Option<u64>,
    /// `--cudnn-workspace`, in bytes.
    pub cudnn_workspace: Option<u64>,
    /// `--budget-on`.
    pub budget_on: Option<BudgetOn>,
}

/// The library stack a QLoRA run goes through (`--qlora-stack`): what it quantizes and in which
/// dtype it keeps the weights it does not quantize. The flags it does not set (`--amp`,
/// `--checkpoint`, `--lora-dtype`, `--lora-dropout`) are the README's recipes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum QloraStack {
    /// peft with transformers and bitsandbytes (`prepare_model_for_kbit_training`, which casts
    /// every weight bitsandbytes did not quantize to float32: with `--amp` they are float32):
    /// every linear layer but the head in 4 bits (transformers' `get_keys_to_not_convert`
    /// keeps `lm_head`), each `Linear4bit` casting its input to the compute dtype and its output
    /// back to the input's dtype.
    Peft,
    /// TRL's `SFTTrainer` over peft: as `peft`, then `peft_module_casting_to_bf16` casts the
    /// embeddings and the head back to bfloat16 and keeps the norms float32
    /// (`trl/trainer/utils.py`).
    Trl,
    /// torchtune's QLoRA builders (`lora_llama2_7b(quantize_base=True)`): only the linear
    /// layers that get adapters are quantized (`LoRALinear(quantize_base=True)`, torchao's
    /// `NF4Tensor`); the model, adapters included, is bfloat16 (`--lora-dtype bfloat16`).
    Torchtune,
    /// litgpt (`--quantize bnb.nf4`): `BitsandbytesPrecision` replaces every `nn.Linear`,
    /// the head included, with a 4-bit layer; `bf16-true` keeps the rest, adapters included,
    /// in bfloat16.
    Litgpt,
}

/// The precision of an EMA copy of the weights (`--ema`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EmaPrecision {
    /// The weights' own dtype (`torch.optim.swa_utils.AveragedModel` deep-copies the model; timm's
    /// `ModelEmaV3` and diffusers' `EMAModel` copy each parameter as it is).
    Weights,
    /// float32 copies of 16-bit weights (diffusers' `EMAModel` after `.to(dtype=torch.float32)`,
    /// the usual way to keep an EMA of a bfloat16 model from rounding away its small updates).
    Float32,
}

/// LoRA adapters (`--lora-rank`): the base model is frozen and every targeted linear projection
/// gets trainable `A: [rank, in]` and `B: [out, rank]` matrices (PEFT's `LoraLayer`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct Lora {
    /// Adapter rank r.
    pub rank: u64,
    /// Target projections: `q`, `k`, `v`, `o` (attention) and linear-layer names or suffixes
    /// (`gate`, `up`, `down` match `*.gate_proj`, `*.up_proj`, `*.down_proj`).
    pub targets: Vec<String>,
    /// Whether every entry must match a projection (the targets were given): an entry that
    /// matches nothing is then an error. The default list need only match something.
    #[serde(skip)]
    #[schemars(skip)]
    pub strict: bool,
}

impl Lora {
    /// The targets when none are given: every attention and MLP projection of a Llama-style
    /// model (the list of most QLoRA recipes).
    pub const DEFAULT_TARGETS: [&'static str; 7] = ["q", "k", "v", "o", "gate", "up", "down"];
}

/// `--group-size` and `--double-quant` belong to the command line, so their resolution is here
/// rather than in [`crate::cost::quant`].
impl Quant {
    /// Applies the format options `--group-size` (int4) and `--double-quant` (nf4) to `base` (as
    /// parsed, with the default options). Options that do not belong to the format are ignored;
    /// [`Warning::QuantFlagsWithoutQuant`] when some were given and there is no quantization.
    ///
    /// [`Warning::QuantFlagsWithoutQuant`]: crate::warning::Warning::QuantFlagsWithoutQuant
    #[must_use]
    pub fn resolve(
        base: Option<Quant>,
        group_size: Option<u64>,
        double_quant: Option<bool>,
    ) -> (Option<Quant>, Vec<crate::warning::Warning>) {
        let given = group_size.is_some() || double_quant.is_some();
        let quant = base.map(|q| match q {
            Quant::Nf4 { double_quant: d } => Quant::Nf4 {
                double_quant: double_quant.unwrap_or(d),
            },
            Quant::Int4 { group_size: g } => Quant::Int4 {
                group_size: group_size.unwrap_or(g),
            },
            other => other,
        });
        use crate::warning::Warning;
        let warnings = match quant {
            None if given => vec![Warning::QuantFlagsWithoutQuant],
            None => Vec::new(),
            Some(q) => {
                let mut w = Vec::new();
                if group_size.is_some() && !matches!(q, Quant::Int4 { .. }) {
                    w.push(Warning::GroupSizeWithoutInt4);
                }
                if double_quant.is_some() && !matches!(q, Quant::Nf4 { .. }) {
                    w.push(Warning::DoubleQuantWithoutNf4);
                }
                w
            }
        };
        (quant, warnings)
    }
}

/// How the loss is computed (`--loss`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Loss {
    /// The model's own loss layer, as written (`ce`, the default).
    #[default]
    Model,
    /// No loss: the model's loss layer is left out and the step ends at its output (training
    /// backpropagates `out.sum()`, which keeps nothing), as when the loss runs outside the
    /// model or a fused kernel computes it.
    None,
    /// torchtune's chunked cross-entropy (`CEWithChunkedOutputLoss`, `torchtune/modules/loss/
    /// ce_chunked_output_loss.py`, with `TransformerDecoder.chunked_output`): the LM head runs
    /// on `chunks` pieces of the final hidden states (`h.tensor_split(chunks, dim=1)`), and each
    /// piece's logits are upcast (`logits.float()`) and cross-entropied on their own, so only
    /// one chunk's float32 copy and gradients exist at a time. torchtune's default is 8.
    Chunked {
        /// Number of chunks along the sequence.
        chunks: u64,
    },
}

impl Loss {
    /// torchtune's `num_output_chunks`.
    pub const DEFAULT_CHUNKS: u64 = 8;

    /// Whether this is the default ([`Loss::Model`]).
    #[must_use]
    pub fn is_model(&self) -> bool {
        *self == Loss::Model
    }
}

impl std::fmt::Display for Loss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Loss::Model => f.write_str("ce"),
            Loss::None => f.write_str("none"),
            Loss::Chunked { chunks } => write!(f, "chunked-ce:{chunks}"),
        }
    }
}

impl std::str::FromStr for Loss {
    type Err = String;

    /// `ce` (alias `cross-entropy`, `model`), `none`, `chunked-ce` or `chunked-ce:N` (N ≥ 1),
    /// any case, `_` for `-`.
    fn from_str(s: &str) -> Result<Loss, String> {
        let t = s.trim().to_ascii_lowercase().replace('_', "-");
        let (name, chunks) = match t.split_once(':') {
            Some((n, c)) => (n.to_string(), Some(c.trim().to_string())),
            None => (t.clone(), None),
        };
        let loss = match name.as_str() {
            "ce" | "cross-entropy" | "model" if chunks.is_none() => Loss::Model,
            "none" if chunks.is_none() => Loss::None,
            "chunked-ce" | "chunked-cross-entropy" => {
                let chunks = match chunks {
                    None => Loss::DEFAULT_CHUNKS,
                    Some(c) => match c.parse::<u64>() {
                        Ok(n) if n >= 1 => n,
                        _ => {
                            return Err(format!(
                                "`{s}`: the chunk count after `chunked-ce:` must be a whole number of at least 1"
                            ));
                        }
                    },
                };
                Loss::Chunked { chunks }
            }
            _ => {
                return Err(format!(
                    "unknown loss `{s}`, expected one of ce, none, chunked-ce, chunked-ce:N"
                ));
            }
        };
        Ok(loss)
    }
}

impl Serialize for Loss {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl schemars::JsonSchema for Loss {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Loss".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "`--loss`: ce (the model's own), none, or chunked-ce:N (torchtune's chunked cross-entropy).",
            "type": "string",
            "pattern": "^(ce|none|chunked-ce:[1-9][0-9]*)$"
        })
    }
}

/// Fully resolved settings for one estimate.
#[derive(Clone, Debug, PartialEq, Serialize, schemars::JsonSchema)]
pub struct Settings {
    /// Micro-batch size.
    pub batch: u64,
    /// Sequence length, when the input has a `"seq"` dimension.
    pub seq: Option<u64>,
    /// Target sequence length, when an input has a `"target_seq"` dimension (an
    /// encoder-decoder's decoder input).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target_seq: Option<u64>,
    /// dtype of parameters (and of activations unless `amp` is set).
    pub dtype: DType,
    /// Optimizer (training only).
    pub optimizer: Option<Optimizer>,
    /// How a `torch.optim` optimizer loops over its tensors; serialized only when it is not
    /// the default `foreach`.
    #[serde(default, skip_serializing_if = "OptimizerImpl::is_foreach")]
    pub optimizer_impl: OptimizerImpl,
    /// Training or inference.
    pub mode: Mode,
    /// Attention implementation (default: SDPA, `flash`, for every model).
    pub attention: AttentionImpl,
    /// Whether `--attention flash` was given on the command line. It forces the fused kernel, as
    /// `torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION)` does; otherwise (the default,
    /// or a file's `defaults.attention`) SDPA's own choice applies, which on the CPU with
    /// attention dropout in training is the math path.
    #[serde(skip)]
    pub attention_forced: bool,
    /// Autocast precision, if any.
    pub amp: Option<Amp>,
    /// Activation checkpointing of every repeated block.
    pub checkpoint: bool,
    /// Selective activation recomputation (Korthikanti et al. 2022, §5; Megatron-LM
    /// `--recompute-granularity selective`): each attention's core (`QKᵀ`, softmax, its dropout,
    /// attention over values) is recomputed in backward; only its query, key and value inputs
    /// are kept. Left out of the JSON when off.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub selective_recompute: bool,
    /// Kernel behaviour modelled.
    pub device: Device,
    /// LoRA adapters, if any.
    pub lora: Option<Lora>,
    /// Weight quantization of linear projections, if any.
    pub quant: Option<Quant>,
    /// dtype of the inference KV cache (default: the activation dtype).
    pub kv_dtype: Option<DType>,
    /// How the loss is computed (`--loss`); serialized only when not the model's own (`ce`).
    #[serde(default, skip_serializing_if = "Loss::is_model")]
    pub loss: Loss,
    /// `--mode generate`: the tokens generated after the prompt (the prompt is `seq` tokens).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_tokens: Option<u64>,
    /// The precision recipe: named with `--recipe`, else derived from `dtype` and `amp`.
    /// `dtype` and `amp` always agree with it. Serialized as its name.
    #[serde(serialize_with = "recipe_name")]
    #[schemars(with = "String")]
    pub recipe: Recipe,
    /// Several GPUs (`--gpus`): the parallel plan; every byte figure is then per GPU. Left out
    /// of the JSON on one GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel: Option<crate::parallel::Plan>,
    /// The CUDA caching allocator's expandable segments
    /// (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`); serialized only when on.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub expandable_segments: bool,
    /// The gradients stay allocated between steps, zeroed in place
    /// (`optimizer.zero_grad(set_to_none=False)`, PyTorch's default before 2.0): every step
    /// starts with them and each backward adds into them (`AccumulateGrad`); training only,
    /// serialized only when on.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub keep_grads: bool,
    /// Micro-batches per optimizer step (gradient accumulation); serialized when above 1.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub grad_accum: u64,
    /// torchtune's `optimizer_in_bwd`: each parameter is updated, and its gradient freed, as
    /// soon as its gradient is ready; serialized when on.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub optim_in_backward: bool,
    /// The optimizer's state lives in bitsandbytes' paged (CUDA unified) memory; serialized
    /// when on.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paged: bool,
    /// The dtype of an EMA copy of the weights, when one is kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ema: Option<DType>,
    /// The LoRA adapters' dtype when `--lora-dtype` sets it (else PEFT's: float32 beside a
    /// 16-bit base, the base's otherwise; bfloat16 for the torchtune and litgpt stacks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_dtype: Option<DType>,
    /// LoRA dropout on each adapter's input (`lora_dropout`), when above 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_dropout: Option<f64>,
    /// The QLoRA library stack, when one is named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qlora_stack: Option<QloraStack>,
    /// The GPU architecture CUDA kernels are chosen for: `--gpu`'s, else [`Arch::DEFAULT`]
    /// (sm 9.0). The report's `gpu` names the card.
    #[serde(skip)]
    #[schemars(skip)]
    pub arch: Arch,
    /// `--gpu`, when given.
    #[serde(skip)]
    #[schemars(skip)]
    pub gpu: Option<&'static crate::gpu::Gpu>,
    /// `--cuda-context`, in bytes.
    #[serde(skip)]
    #[schemars(skip)]
    pub cuda_context: Option<u64>,
    /// `--cudnn-workspace`: the bytes of the workspace each cuDNN convolution call takes from
    /// the caching allocator (on CUDA; `None`: not counted). PyTorch's `run_conv_plan`
    /// (`aten/src/ATen/native/cudnn/Conv_v8.cpp`) allocates the chosen engine's
    /// `getWorkspaceSize()` bytes for the call and frees them after; the size is the user's
    /// (e.g. the `CUDNN_CONV_WSCAP_DBG` cap), not measured.
    #[serde(skip)]
    #[schemars(skip)]
    pub cudnn_workspace: Option<u64>,
    /// Which figure the budget checks (`--budget-on`; on the CPU always the tensors' peak).
    #[serde(skip)]
    #[schemars(skip)]
    pub budget_on: BudgetOn,
}

fn one() -> u64 {
    1
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's signature
fn is_one(n: &u64) -> bool {
    *n == 1
}

impl Settings {
    /// Resolves flags over file defaults over built-in defaults (batch 1, float32, AdamW,
    /// train, SDPA attention, CUDA kernels). Attention defaults to `scaled_dot_product_attention`
    /// ([`AttentionImpl::Flash`]) for every model, hand-written or a Hugging Face config, as
    /// transformers 5 picks `sdpa` when `attn_implementation` is not given
    /// (`PreTrainedModel._check_and_adjust_attn_implementation`); the kernel SDPA then runs
    /// is the tracer's choice (e.g. the math path on the CPU with attention dropout).
    ///
    /// # Errors
    /// [`Error::Setting`] for an unknown optimizer, mode or attention name in the file, a zero
    /// batch or sequence length, `amp` with a non-float32 dtype, or a `recipe` that contradicts
    /// `--dtype` or `--amp`.
    pub fn resolve(defaults: &DefaultsSpec, o: &Overrides) -> Result<Settings, Error> {
        let batch = o.batch.or(defaults.batch).unwrap_or(1);
        if batch == 0 {
            return Err(Error::setting(
                SettingKey::Batch,
                "batch size must be at least 1",
            ));
        }
        let seq = o.seq.or(defaults.seq);
        if seq == Some(0) {
            return Err(Error::setting(
                SettingKey::Seq,
                "sequence length must be at least 1",
            ));
        }
        let target_seq = o.target_seq.or(defaults.target_seq);
        if target_seq == Some(0) {
            return Err(Error::setting(
                SettingKey::Seq,
                "target sequence length must be at least 1",
            ));
        }
        let mode = o.mode.or(defaults.mode).unwrap_or(Mode::Train);
        let optimizer = o
            .optimizer
            .or(defaults.optimizer)
            .unwrap_or(Optimizer::Adamw);
        let attention = o
            .attention
            .or(defaults.attention)
            .unwrap_or(AttentionImpl::Flash);
        let optimizer_impl = match o.optimizer_impl.or(defaults.optimizer_impl) {
            Some(_) if mode != Mode::Train => OptimizerImpl::Foreach,
            Some(i) if !optimizer.is_torch_optim() => {
                return Err(Error::setting(
                    SettingKey::OptimizerImpl,
                    format!(
                        "--optim-impl {i} applies to the torch.optim optimizers; {optimizer} has one implementation of its own (drop --optim-impl or defaults.optimizer_impl)"
                    ),
                ));
            }
            Some(i) if !optimizer.supports(i) => {
                return Err(Error::setting(
                    SettingKey::OptimizerImpl,
                    format!(
                        "--optim-impl {i}: torch.optim has no {i} {optimizer} (fused: sgd, sgd-momentum, sgd-nesterov, adam, adamw, adagrad)"
                    ),
                ));
            }
            Some(i) => i,
            // foreach unless asked otherwise, on either device. On CUDA this is what torch.optim
            // picks when neither `foreach` nor `fused` is given (`torch/optim/optimizer.py`,
            // `_default_to_fused_or_foreach`). On the CPU torch.optim would pick the for-loop,
            // but memest's CPU mode exists to reproduce the project's CPU measurements, which run
            // `foreach=True` (`measure.py`) so that only the kernels differ from a GPU run; a plain
            // CPU run is `--optim-impl for-loop`.
            None => OptimizerImpl::Foreach,
        };
        let recipe = match o.recipe {
            Some(name) => resolve_recipe(name, o)?,
            None => {
                // `--amp` keeps float32 weights: a file's default dtype gives way to it.
                let file_dtype = if o.amp.is_some() {
                    None
                } else {
                    defaults.dtype
                };
                let dtype = o.dtype.or(file_dtype).unwrap_or(DType::Float32);
                if !dtype.is_float() {
                    return Err(Error::setting(
                        SettingKey::Dtype,
                        format!(
                            "dtype `{dtype}` is not a floating-point type; parameters need one (e.g. float32, bfloat16)"
                        ),
                    ));
                }
                if o.amp.is_some() && dtype != DType::Float32 {
                    return Err(Error::setting(
                        SettingKey::Amp,
                        format!(
                            "--amp keeps float32 weights under autocast; it cannot be combined with --dtype {dtype}"
                        ),
                    ));
                }
                Recipe::derived(dtype, o.amp)
            }
        };
        let dtype = recipe.weights;
        let training = mode == Mode::Train;
        let grad_accum = o.grad_accum.or(defaults.grad_accum).unwrap_or(1);
        if grad_accum == 0 {
            return Err(Error::setting(
                SettingKey::GradAccum,
                "gradient accumulation needs at least 1 micro-batch per step",
            ));
        }
        let grad_accum = if training { grad_accum } else { 1 };
        let optim_in_backward = o.optim_in_backward && training;
        if optim_in_backward && grad_accum > 1 {
            // torchtune's recipes refuse it: "Gradient accumulation is not supported with
            // optimizer in bwd" (recipes/full_finetune_single_device.py, `_setup_optimizer`).
            return Err(Error::setting(
                SettingKey::OptimizerRun,
                format!(
                    "--optim-in-backward frees each gradient as soon as it is applied, so it cannot accumulate --grad-accum {grad_accum} micro-batches (torchtune refuses the pair too)"
                ),
            ));
        }
        let paged = o.paged && training;
        if paged && !optimizer.has_paged_version() {
            return Err(Error::setting(
                SettingKey::OptimizerRun,
                format!(
                    "--paged: bitsandbytes has paged versions of adam, adamw, adam-8bit and lion only, not of {optimizer}"
                ),
            ));
        }
        if paged && o.optimizer_impl.is_some() {
            return Err(Error::setting(
                SettingKey::OptimizerRun,
                format!(
                    "--paged runs bitsandbytes' own optimizer, which has one implementation; it cannot be combined with --optim-impl {}",
                    optimizer_impl
                ),
            ));
        }
        let ema = o.ema.filter(|_| training).map(|p| match p {
            EmaPrecision::Weights => dtype,
            EmaPrecision::Float32 => DType::Float32,
        });
        let new_tokens = match (mode, o.new_tokens.or(defaults.new_tokens)) {
            (Mode::Generate, Some(0)) => {
                return Err(Error::setting(
                    SettingKey::Mode,
                    "--new-tokens must be at least 1",
                ));
            }
            (Mode::Generate, Some(n)) => Some(n),
            (Mode::Generate, None) => {
                return Err(Error::setting(
                    SettingKey::Mode,
                    "--mode generate needs the number of tokens to generate: give --new-tokens (or defaults.new_tokens)",
                ));
            }
            (_, _) => None,
        };
        if o.kv_dtype.is_some() && mode == Mode::Train {
            return Err(Error::setting(
                SettingKey::KvDtype,
                "--kv-dtype sets the inference KV cache: use it with --mode infer, --context or --mode generate",
            ));
        }
        let device = o.device.or(defaults.device).unwrap_or(Device::Cuda);
        if let Some(g) = o.gpu
            && device == Device::Cpu
        {
            return Err(Error::setting(
                SettingKey::Device,
                format!(
                    "--gpu {} models that GPU's CUDA kernels; it cannot be combined with --device cpu (or the file's device = \"cpu\")",
                    g.id
                ),
            ));
        }
        // LoRA adapters train: autograd gives gradients to floating-point tensors only.
        if let Some(d) = o.lora_dtype.filter(|d| !d.is_float()) {
            return Err(Error::setting(
                SettingKey::Lora,
                format!(
                    "--lora-dtype {d} is not a floating-point type; the adapters train, so they need one (e.g. float32, bfloat16)"
                ),
            ));
        }
        Ok(Settings {
            batch,
            seq,
            target_seq,
            dtype,
            optimizer: (mode == Mode::Train).then_some(optimizer),
            optimizer_impl,
            mode,
            attention,
            attention_forced: o.attention == Some(AttentionImpl::Flash),
            amp: recipe.autocast,
            checkpoint: o.checkpoint,
            selective_recompute: o.selective_recompute,
            device,
            arch: o.gpu.map_or(Arch::DEFAULT, |g| g.arch.clone()),
            gpu: o.gpu,
            cuda_context: o.cuda_context,
            cudnn_workspace: o.cudnn_workspace.filter(|_| device == Device::Cuda),
            budget_on: o.budget_on.unwrap_or_default(),
            lora: o.lora.clone(),
            quant: o.quant,
            kv_dtype: o.kv_dtype,
            new_tokens,
            loss: o.loss.unwrap_or_default(),
            recipe,
            parallel: o.parallel.clone().filter(|_| mode == Mode::Train),
            expandable_segments: o.expandable_segments,
            keep_grads: o.keep_grads && mode == Mode::Train,
            grad_accum,
            optim_in_backward,
            paged,
            ema,
            lora_dtype: o.lora_dtype.or_else(|| {
                matches!(
                    o.qlora_stack,
                    Some(QloraStack::Torchtune | QloraStack::Litgpt)
                )
                .then_some(DType::Bfloat16)
            }),
            lora_dropout: o.lora_dropout.filter(|&p| p > 0.0),
            qlora_stack: o.qlora_stack,
        })
    }

    /// The dtype parameter gradients take when the recipe says so (`mixed-bf16-fp32-grads`:
    /// float32 for bfloat16 weights); `None` when gradients have their parameter's dtype.
    #[must_use]
    pub fn grad_dtype_override(&self) -> Option<DType> {
        self.recipe.grad_dtype_override()
    }

    /// Whether this is a training step.
    #[must_use]
    pub fn training(&self) -> bool {
        self.mode == Mode::Train
    }
}

fn recipe_name<S: serde::Serializer>(r: &Recipe, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&r.name)
}

/// Checks a named recipe against `--dtype` and `--amp`, which it fixes itself.
fn resolve_recipe(name: RecipeName, o: &Overrides) -> Result<Recipe, Error> {
    let recipe = name.recipe();
    let r = name;
    if let Some(amp) = o.amp
        && recipe.autocast != Some(amp)
    {
        let why = match recipe.autocast {
            Some(a) => format!("runs autocast in {}", a.dtype()),
            None if recipe.master_weights.is_some() => format!(
                "casts the model to {} and keeps float32 master weights, without autocast",
                recipe.weights
            ),
            None => format!(
                "runs the whole model in {}, without autocast",
                recipe.weights
            ),
        };
        return Err(Error::setting(
            SettingKey::Recipe,
            format!(
                "--recipe {r} {why}; it cannot be combined with --amp {amp} (drop one of them)"
            ),
        ));
    }
    if let Some(dtype) = o.dtype
        && dtype != recipe.weights
    {
        return Err(Error::setting(
            SettingKey::Recipe,
            format!(
                "--recipe {r} keeps {} weights; it cannot be combined with --dtype {dtype} (drop one of them)",
                recipe.weights
            ),
        ));
    }
    Ok(recipe)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::recipe::RecipeId;

    /// A bad name in the file's `[defaults]` is a serde error: it gets the file's position
    /// and the accepted names.
    #[test]
    fn unknown_file_optimizer_lists_all() {
        let err = crate::spec::parse(
            "[input]\nshape = [8]\n[defaults]\noptimizer = \"adamax\"\n[[layers]]\nkind = \"relu\"\n",
            crate::spec::Format::Toml,
            crate::graph::kind_keys,
        )
        .unwrap_err();
        let Error::Spec(e) = err else {
            panic!("{err:?}")
        };
        assert_eq!((e.line, e.column), (Some(4), Some(13)));
        assert!(
            e.message.starts_with("unknown optimizer `adamax` (did you mean `adam`?), expected one of sgd, sgd-momentum,")
                && e.message.contains("adam-8bit"),
            "{}",
            e.message
        );
    }

    #[test]
    fn loss_names() {
        assert_eq!("ce".parse(), Ok(Loss::Model));
        assert_eq!("None".parse(), Ok(Loss::None));
        assert_eq!("chunked_ce".parse(), Ok(Loss::Chunked { chunks: 8 }));
        assert_eq!("chunked-ce:16".parse(), Ok(Loss::Chunked { chunks: 16 }));
        assert!(
            "chunked-ce:0"
                .parse::<Loss>()
                .unwrap_err()
                .contains("at least 1")
        );
        assert!("ce:4".parse::<Loss>().is_err());
        assert_eq!(
            "fused".parse::<Loss>().unwrap_err(),
            "unknown loss `fused`, expected one of ce, none, chunked-ce, chunked-ce:N"
        );
        assert_eq!(Loss::Chunked { chunks: 4 }.to_string(), "chunked-ce:4");
    }

    #[test]
    fn file_aliases_resolve() {
        let defaults: DefaultsSpec = toml::from_str(
            "optimizer = \"adam8bit\"\nmode = \"eval\"\nattention = \"sdpa\"\noptimizer_impl = \"for_loop\"",
        )
        .unwrap();
        assert_eq!(defaults.optimizer, Some(Optimizer::Adam8bit));
        assert_eq!(defaults.mode, Some(Mode::Infer));
        assert_eq!(defaults.attention, Some(AttentionImpl::Flash));
        assert_eq!(defaults.optimizer_impl, Some(OptimizerImpl::ForLoop));
    }

    #[test]
    fn optimizer_impl_applies_to_torch_optim_only() {
        let train = |optimizer, optimizer_impl| {
            resolve(&Overrides {
                optimizer: Some(optimizer),
                optimizer_impl: Some(optimizer_impl),
                ..Overrides::default()
            })
        };
        let s = train(Optimizer::Adamw, OptimizerImpl::ForLoop).unwrap();
        assert_eq!(s.optimizer_impl, OptimizerImpl::ForLoop);
        assert!(train(Optimizer::Adagrad, OptimizerImpl::Fused).is_ok());
        for (opt, imp, needle) in [
            (
                Optimizer::Lion,
                OptimizerImpl::ForLoop,
                "lion has one implementation",
            ),
            (
                Optimizer::Adam8bit,
                OptimizerImpl::Foreach,
                "adam-8bit has one",
            ),
            (Optimizer::Rmsprop, OptimizerImpl::Fused, "no fused rmsprop"),
            (
                Optimizer::Adafactor,
                OptimizerImpl::Fused,
                "no fused adafactor",
            ),
        ] {
            let Err(Error::Setting(e)) = train(opt, imp) else {
                panic!("{opt} {imp} accepted")
            };
            assert_eq!(e.key, SettingKey::OptimizerImpl);
            assert!(e.message.contains(needle), "{}", e.message);
        }
        // the default stays foreach, and inference has no optimizer to run
        assert_eq!(
            resolve(&Overrides::default()).unwrap().optimizer_impl,
            OptimizerImpl::Foreach
        );
        let s = resolve(&Overrides {
            optimizer: Some(Optimizer::Lion),
            optimizer_impl: Some(OptimizerImpl::Fused),
            mode: Some(Mode::Infer),
            ..Overrides::default()
        })
        .unwrap();
        assert_eq!(s.optimizer, None);
    }

    /// foreach by default on both devices (torch.optim's CUDA default; the CPU mode follows the
    /// measured CPU runs, which use `foreach=True`); optimizers outside torch.optim keep their one
    /// implementation.
    #[test]
    fn optimizer_impl_defaults_to_foreach_on_both_devices() {
        let on = |device, optimizer| {
            resolve(&Overrides {
                device: Some(device),
                optimizer: Some(optimizer),
                ..Overrides::default()
            })
            .unwrap()
            .optimizer_impl
        };
        assert_eq!(on(Device::Cuda, Optimizer::Adamw), OptimizerImpl::Foreach);
        assert_eq!(on(Device::Cpu, Optimizer::Adamw), OptimizerImpl::Foreach);
        assert_eq!(on(Device::Cpu, Optimizer::Lion), OptimizerImpl::Foreach);
        let s = resolve(&Overrides {
            device: Some(Device::Cpu),
            optimizer_impl: Some(OptimizerImpl::Foreach),
            ..Overrides::default()
        })
        .unwrap();
        assert_eq!(s.optimizer_impl, OptimizerImpl::Foreach);
    }

    fn resolve(o: &Overrides) -> Result<Settings, Error> {
        Settings::resolve(&DefaultsSpec::default(), o)
    }

    #[test]
    fn recipes_fix_dtypes() {
        for (name, weights, grads, master, amp) in [
            (RecipeName::Fp32, DType::Float32, DType::Float32, None, None),
            (
                RecipeName::Bf16,
                DType::Bfloat16,
                DType::Bfloat16,
                None,
                None,
            ),
            (RecipeName::Fp16, DType::Float16, DType::Float16, None, None),
            (
                RecipeName::AmpBf16,
                DType::Float32,
                DType::Float32,
                None,
                Some(Amp::Bf16),
            ),
            (
                RecipeName::AmpFp16,
                DType::Float32,
                DType::Float32,
                None,
                Some(Amp::Fp16),
            ),
            (
                RecipeName::MixedBf16,
                DType::Bfloat16,
                DType::Bfloat16,
                Some(DType::Float32),
                None,
            ),
            (
                RecipeName::MixedFp16,
                DType::Float16,
                DType::Float16,
                Some(DType::Float32),
                None,
            ),
            (
                RecipeName::MixedBf16Fp32Grads,
                DType::Bfloat16,
                DType::Float32,
                Some(DType::Float32),
                None,
            ),
        ] {
            let s = resolve(&Overrides {
                recipe: Some(name),
                ..Overrides::default()
            })
            .unwrap();
            assert_eq!(s.recipe.name, RecipeId::Named(name));
            assert!(s.recipe.explicit);
            assert_eq!((s.dtype, s.amp), (weights, amp), "{}", name);
            assert_eq!(s.recipe.gradients, grads, "{}", name);
            assert_eq!(s.recipe.master_weights, master, "{}", name);
            assert_eq!(
                s.grad_dtype_override(),
                (grads != weights).then_some(grads),
                "{}",
                name
            );
        }
    }

    #[test]
    fn recipe_is_derived_without_the_flag() {
        let derived = |dtype, amp| {
            let s = resolve(&Overrides {
                dtype,
                amp,
                ..Overrides::default()
            })
            .unwrap();
            assert!(!s.recipe.explicit);
            s.recipe.name.to_string()
        };
        assert_eq!(derived(None, None), "fp32");
        assert_eq!(derived(Some(DType::Bfloat16), None), "bf16");
        assert_eq!(derived(Some(DType::Float16), None), "fp16");
        assert_eq!(derived(Some(DType::Float64), None), "pure-float64");
        assert_eq!(derived(None, Some(Amp::Bf16)), "amp-bf16");
        assert_eq!(derived(Some(DType::Float32), Some(Amp::Fp16)), "amp-fp16");
        // the file's default dtype counts too
        let defaults = DefaultsSpec {
            dtype: Some(DType::Bfloat16),
            ..DefaultsSpec::default()
        };
        let s = Settings::resolve(&defaults, &Overrides::default()).unwrap();
        assert_eq!(s.recipe.name, RecipeId::Named(RecipeName::Bf16));
    }

    #[test]
    fn contradictory_recipes_are_rejected() {
        let err = |recipe, dtype, amp| {
            let e = resolve(&Overrides {
                recipe: Some(recipe),
                dtype,
                amp,
                ..Overrides::default()
            })
            .unwrap_err();
            match e {
                Error::Setting(e) if e.key == SettingKey::Recipe => e.message,
                other => panic!("{other:?}"),
            }
        };
        let m = err(RecipeName::MixedBf16, None, Some(Amp::Fp16));
        assert!(
            m.contains("--recipe mixed-bf16") && m.contains("--amp fp16"),
            "{m}"
        );
        let m = err(RecipeName::MixedBf16, None, Some(Amp::Bf16));
        assert!(m.contains("without autocast"), "{m}");
        let m = err(RecipeName::AmpBf16, None, Some(Amp::Fp16));
        assert!(m.contains("autocast in bfloat16"), "{m}");
        let m = err(RecipeName::Bf16, Some(DType::Float16), None);
        assert!(
            m.contains("--dtype float16") && m.contains("bfloat16 weights"),
            "{m}"
        );
        let m = err(RecipeName::AmpFp16, Some(DType::Bfloat16), None);
        assert!(m.contains("float32 weights"), "{m}");
        // agreeing flags are fine; the recipe wins over the file's default dtype
        for (recipe, dtype, amp) in [
            (RecipeName::AmpBf16, Some(DType::Float32), Some(Amp::Bf16)),
            (RecipeName::Bf16, Some(DType::Bfloat16), None),
            (RecipeName::MixedBf16, Some(DType::Bfloat16), None),
        ] {
            let o = Overrides {
                recipe: Some(recipe),
                dtype,
                amp,
                ..Overrides::default()
            };
            assert!(resolve(&o).is_ok(), "{}", recipe);
        }
        let defaults = DefaultsSpec {
            dtype: Some(DType::Bfloat16),
            ..DefaultsSpec::default()
        };
        let o = Overrides {
            recipe: Some(RecipeName::AmpFp16),
            ..Overrides::default()
        };
        let s = Settings::resolve(&defaults, &o).unwrap();
        assert_eq!((s.dtype, s.amp), (DType::Float32, Some(Amp::Fp16)));
    }
}
