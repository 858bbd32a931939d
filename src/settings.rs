//! Run settings: batch, sequence length, dtypes, optimizer, mode, and how kernels behave.
//! The file's `[defaults]` give the starting values; command-line flags override them.

use std::fmt;

use clap::ValueEnum;
use serde::Serialize;

use crate::dtype::DType;
use crate::error::Error;
use crate::spec::DefaultsSpec;

/// The optimizer whose state and step temporaries are counted (PyTorch `torch.optim`, with
/// `foreach=True`, the CUDA default).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Optimizer {
    /// Plain SGD: no state.
    Sgd,
    /// SGD with momentum: one momentum buffer per parameter.
    SgdMomentum,
    /// Adam: `exp_avg` and `exp_avg_sq` per parameter, plus a float32 `step` per tensor.
    Adam,
    /// AdamW: as Adam (weight decay is applied in place).
    Adamw,
}

impl Optimizer {
    /// Parameter-sized state tensors per trainable parameter tensor.
    #[must_use]
    pub const fn states_per_param(self) -> u64 {
        match self {
            Optimizer::Sgd => 0,
            Optimizer::SgdMomentum => 1,
            Optimizer::Adam | Optimizer::Adamw => 2,
        }
    }

    /// Bytes of scalar state per parameter tensor: Adam's float32 `step` (4 bytes).
    #[must_use]
    pub const fn scalar_state_bytes(self) -> u64 {
        match self {
            Optimizer::Sgd | Optimizer::SgdMomentum => 0,
            Optimizer::Adam | Optimizer::Adamw => 4,
        }
    }

    /// Parameter-sized temporaries of one `foreach` step: Adam's `_foreach_sqrt(exp_avg_sq)`
    /// allocates one copy of the parameters (`torch/optim/adam.py`, `_multi_tensor_adam`);
    /// SGD updates in place.
    #[must_use]
    pub const fn step_temporaries_per_param(self) -> u64 {
        match self {
            Optimizer::Sgd | Optimizer::SgdMomentum => 0,
            Optimizer::Adam | Optimizer::Adamw => 1,
        }
    }

    fn parse(s: &str) -> Option<Optimizer> {
        match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "sgd" => Some(Optimizer::Sgd),
            "sgd-momentum" | "momentum" => Some(Optimizer::SgdMomentum),
            "adam" => Some(Optimizer::Adam),
            "adamw" => Some(Optimizer::Adamw),
            _ => None,
        }
    }
}

/// Training step or inference forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// One training step: forward, backward, optimizer step.
    Train,
    /// A forward pass under `torch.no_grad()` in eval mode.
    Infer,
}

/// How attention is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionImpl {
    /// Matmul, softmax, dropout, matmul: keeps the `[B, heads, S, S]` probabilities.
    Eager,
    /// A fused kernel (`scaled_dot_product_attention`'s flash path): keeps Q, K, V, the output
    /// and a float32 log-sum-exp.
    Flash,
}

/// Autocast precision (`torch.autocast`) with float32 weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Amp {
    /// `torch.autocast(dtype=torch.bfloat16)`.
    Bf16,
    /// `torch.autocast(dtype=torch.float16)`.
    Fp16,
}

impl Amp {
    /// The lower-precision dtype.
    #[must_use]
    pub const fn dtype(self) -> DType {
        match self {
            Amp::Bf16 => DType::Bfloat16,
            Amp::Fp16 => DType::Float16,
        }
    }
}

/// Whose kernels' saved tensors to model. The measured reference figures are CPU runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    /// PyTorch's CPU kernels (dropout keeps a noise tensor in the input's dtype).
    Cpu,
    /// PyTorch's CUDA kernels (dropout keeps a 1-byte mask; autocast runs norms and softmax in
    /// float32).
    Cuda,
}

/// Command-line overrides; `None` keeps the file's default.
#[derive(Clone, Debug, Default)]
#[allow(missing_docs)] // each mirrors a field of Settings
pub struct Overrides {
    pub batch: Option<u64>,
    pub seq: Option<u64>,
    pub dtype: Option<DType>,
    pub optimizer: Option<Optimizer>,
    pub mode: Option<Mode>,
    pub attention: Option<AttentionImpl>,
    pub amp: Option<Amp>,
    pub checkpoint: bool,
    pub device: Option<Device>,
    pub lora: Option<Lora>,
    pub quant: Option<Quant>,
    pub kv_dtype: Option<DType>,
}

/// LoRA adapters (`--lora-rank`): the base model is frozen and every targeted linear projection
/// gets trainable `A: [rank, in]` and `B: [out, rank]` matrices (PEFT's `LoraLayer`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Lora {
    /// Adapter rank r.
    pub rank: u64,
    /// Target projections: `q`, `k`, `v`, `o` (attention) and linear-layer names or suffixes
    /// (`gate`, `up`, `down` match `*.gate_proj`, `*.up_proj`, `*.down_proj`).
    pub targets: Vec<String>,
}

/// Weight quantization of linear projections (norms, embeddings and the LM head keep the compute
/// dtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Quant {
    /// bitsandbytes NF4: 4 bits per weight plus a float32 absmax per 64 weights; with double
    /// quantization the absmax values are 8-bit with a float32 scale per 256 of them.
    Nf4 {
        /// Double quantization of the absmax scales.
        double_quant: bool,
    },
    /// bitsandbytes LLM.int8(): 1 byte per weight plus a float32 scale per output row.
    Int8,
    /// GPTQ/AWQ-style int4: 4 bits per weight plus, per group, a float16 scale and a 4-bit zero point.
    Int4 {
        /// Weights per group (128 by default).
        group_size: u64,
    },
    /// FP8 weights (e4m3 or e5m2): 1 byte per weight plus one float32 scale per tensor.
    Fp8,
}

/// Fully resolved settings for one estimate.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Settings {
    /// Micro-batch size.
    pub batch: u64,
    /// Sequence length, when the input has a `"seq"` dimension.
    pub seq: Option<u64>,
    /// dtype of parameters (and of activations unless `amp` is set).
    pub dtype: DType,
    /// Optimizer (training only).
    pub optimizer: Option<Optimizer>,
    /// Training or inference.
    pub mode: Mode,
    /// Attention implementation.
    pub attention: AttentionImpl,
    /// Autocast precision, if any.
    pub amp: Option<Amp>,
    /// Activation checkpointing of every repeated block.
    pub checkpoint: bool,
    /// Kernel behaviour modelled.
    pub device: Device,
    /// LoRA adapters, if any.
    pub lora: Option<Lora>,
    /// Weight quantization of linear projections, if any.
    pub quant: Option<Quant>,
    /// dtype of the inference KV cache (default: the activation dtype).
    pub kv_dtype: Option<DType>,
}

impl Settings {
    /// Resolves flags over file defaults over built-in defaults (batch 1, float32, AdamW,
    /// train, eager attention, CPU kernels).
    ///
    /// # Errors
    /// [`Error::Setting`] for an unknown optimizer, mode or attention name in the file, a zero
    /// batch or sequence length, or `amp` with a non-float32 dtype.
    pub fn resolve(defaults: &DefaultsSpec, o: &Overrides) -> Result<Settings, Error> {
        let batch = o.batch.or(defaults.batch).unwrap_or(1);
        if batch == 0 {
            return Err(Error::Setting("batch size must be at least 1".into()));
        }
        let seq = o.seq.or(defaults.seq);
        if seq == Some(0) {
            return Err(Error::Setting("sequence length must be at least 1".into()));
        }
        let mode = match o.mode {
            Some(m) => m,
            None => match defaults.mode.as_deref() {
                None | Some("train") => Mode::Train,
                Some("infer" | "inference" | "eval") => Mode::Infer,
                Some(other) => {
                    return Err(Error::Setting(format!(
                        "defaults.mode: unknown mode `{other}`, expected \"train\" or \"infer\""
                    )));
                }
            },
        };
        let optimizer = match o.optimizer {
            Some(opt) => Some(opt),
            None => match defaults.optimizer.as_deref() {
                None => Some(Optimizer::Adamw),
                Some(name) => Some(Optimizer::parse(name).ok_or_else(|| {
                    Error::Setting(format!("defaults.optimizer: unknown optimizer `{name}`, expected one of sgd, sgd-momentum, adam, adamw"))
                })?),
            },
        };
        let attention = match o.attention {
            Some(a) => a,
            None => match defaults.attention.as_deref() {
                None | Some("eager") => AttentionImpl::Eager,
                Some("flash" | "sdpa") => AttentionImpl::Flash,
                Some(other) => {
                    return Err(Error::Setting(format!(
                        "defaults.attention: unknown attention `{other}`, expected \"eager\" or \"flash\""
                    )));
                }
            },
        };
        let dtype = o.dtype.or(defaults.dtype).unwrap_or(DType::Float32);
        if !dtype.is_float() {
            return Err(Error::Setting(format!(
                "dtype `{dtype}` is not a floating-point type; parameters need one (e.g. float32, bfloat16)"
            )));
        }
        if o.amp.is_some() && dtype != DType::Float32 {
            return Err(Error::Setting(format!(
                "--amp keeps float32 weights under autocast; it cannot be combined with --dtype {dtype}"
            )));
        }
        Ok(Settings {
            batch,
            seq,
            dtype,
            optimizer: if mode == Mode::Train { optimizer } else { None },
            mode,
            attention,
            amp: o.amp,
            checkpoint: o.checkpoint,
            device: o.device.unwrap_or(Device::Cpu),
            lora: o.lora.clone(),
            quant: o.quant,
            kv_dtype: o.kv_dtype,
        })
    }

    /// Whether this is a training step.
    #[must_use]
    pub fn training(&self) -> bool {
        self.mode == Mode::Train
    }
}

impl fmt::Display for Optimizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Optimizer::Sgd => "sgd",
            Optimizer::SgdMomentum => "sgd-momentum",
            Optimizer::Adam => "adam",
            Optimizer::Adamw => "adamw",
        })
    }
}
