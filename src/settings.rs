//! Run settings: batch, sequence length, dtypes, optimizer, mode, and how kernels behave.
//! The file's `[defaults]` give the starting values; command-line flags override them.

use std::fmt;

use clap::ValueEnum;
use serde::Serialize;

use crate::dtype::DType;
use crate::error::{Error, SettingKey};
use crate::spec::DefaultsSpec;
use crate::trace::Param;

/// The optimizer whose state and step temporaries are counted, with its default
/// hyperparameters. The `torch.optim` ones run with `foreach=True`, the CUDA default, so every
/// temporary of the step is alive at once; the others follow the implementation named on each.
///
/// State bytes per parameter tensor are [`Optimizer::state_bytes`] (plus
/// [`Optimizer::shared_state_bytes`] once per optimizer), temporaries of one step are
/// [`Optimizer::temporaries_bytes`]. Sources: PyTorch 2.15 `torch/optim/*.py`,
/// lion-pytorch 0.2.5, timm 1.0.31, bitsandbytes 0.50.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Optimizer {
    /// Plain SGD (`torch.optim.SGD`): no state.
    Sgd,
    /// SGD with momentum: one momentum buffer per parameter.
    SgdMomentum,
    /// SGD with Nesterov momentum (`nesterov=True`): one momentum buffer per parameter.
    SgdNesterov,
    /// Adam: `exp_avg` and `exp_avg_sq` per parameter, plus a float32 `step` per tensor.
    Adam,
    /// AdamW: as Adam (weight decay is applied in place).
    Adamw,
    /// Adagrad (`torch.optim.Adagrad`): `sum` per parameter plus a float32 `step` per tensor.
    Adagrad,
    /// RMSprop (`torch.optim.RMSprop`): `square_avg` per parameter plus a float32 `step`.
    Rmsprop,
    /// RMSprop with `momentum > 0`: `square_avg` and `momentum_buffer` plus a float32 `step`.
    RmspropMomentum,
    /// Adafactor (`torch.optim.Adafactor`, PyTorch ≥ 2.5): factored second moments (a row and
    /// a column vector) for tensors of two or more dimensions, a full `variance` otherwise, plus
    /// a float32 `step`; no first moment.
    Adafactor,
    /// Lion (lucidrains' `lion_pytorch.foreach.Lion`): `exp_avg` per parameter.
    Lion,
    /// LAMB (timm's `timm.optim.Lamb`, foreach): `exp_avg` and `exp_avg_sq` per parameter.
    Lamb,
    /// bitsandbytes `Adam8bit`: two 8-bit states plus blockwise float32 absmax scales.
    #[value(name = "adam-8bit")]
    #[serde(rename = "adam-8bit")]
    Adam8bit,
}

/// Bytes of a float32 `step` tensor (`torch.tensor(0.0)`, `_get_scalar_dtype()`).
const STEP_BYTES: u64 = 4;
/// bitsandbytes' `min_8bit_size`: smaller tensors keep two float32 states.
const BNB_MIN_8BIT_SIZE: u64 = 4096;
/// bitsandbytes' blockwise quantization block of the 8-bit optimizers (0.44 and later).
const BNB_BLOCK: u64 = 256;

impl Optimizer {
    /// Every optimizer, in help order.
    pub const ALL: [Optimizer; 12] = [
        Optimizer::Sgd,
        Optimizer::SgdMomentum,
        Optimizer::SgdNesterov,
        Optimizer::Adam,
        Optimizer::Adamw,
        Optimizer::Adagrad,
        Optimizer::Rmsprop,
        Optimizer::RmspropMomentum,
        Optimizer::Adafactor,
        Optimizer::Lion,
        Optimizer::Lamb,
        Optimizer::Adam8bit,
    ];

    /// The command-line name.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Optimizer::Sgd => "sgd",
            Optimizer::SgdMomentum => "sgd-momentum",
            Optimizer::SgdNesterov => "sgd-nesterov",
            Optimizer::Adam => "adam",
            Optimizer::Adamw => "adamw",
            Optimizer::Adagrad => "adagrad",
            Optimizer::Rmsprop => "rmsprop",
            Optimizer::RmspropMomentum => "rmsprop-momentum",
            Optimizer::Adafactor => "adafactor",
            Optimizer::Lion => "lion",
            Optimizer::Lamb => "lamb",
            Optimizer::Adam8bit => "adam-8bit",
        }
    }

    /// Bytes of optimizer state kept for one trainable parameter tensor `param` (the tensor the
    /// optimizer updates: the float32 master copy under a `mixed-*` recipe). State tensors take
    /// the parameter's dtype (`torch.zeros_like(p)`), step counters are float32 scalars. With
    /// `P = param.bytes`, `n = param.numel`, `e = P / n` and the shape `[.., r, c]`:
    ///
    /// | optimizer | state | bytes |
    /// |---|---|---|
    /// | `sgd` | none | 0 |
    /// | `sgd-momentum`, `sgd-nesterov` | `momentum_buffer` (`torch/optim/sgd.py`, `_multi_tensor_sgd`: a clone of the first gradient) | `P` |
    /// | `adam`, `adamw` | `exp_avg`, `exp_avg_sq`, `step` (`torch/optim/adam.py`, `_init_group`) | `2P + 4` |
    /// | `adagrad` | `sum` (`torch.full_like(p, initial_accumulator_value)`), `step` (`torch/optim/adagrad.py`, `__init__`) | `P + 4` |
    /// | `rmsprop` | `square_avg`, `step` (`torch/optim/rmsprop.py`, `_init_group`) | `P + 4` |
    /// | `rmsprop-momentum` | `square_avg`, `momentum_buffer`, `step` | `2P + 4` |
    /// | `adafactor`, rank ≥ 2 | `row_var` (shape `[.., r, 1]`), `col_var` (shape `[.., 1, c]`), `step` (`torch/optim/_adafactor.py`, `_init_group`) | `(n/c + n/r)·e + 4` |
    /// | `adafactor`, rank ≤ 1 | `variance` (`zeros_like`), `step` | `P + 4` |
    /// | `lion` | `exp_avg` (`lion_pytorch/foreach.py`) | `P` |
    /// | `lamb` | `exp_avg`, `exp_avg_sq` (`timm/optim/lamb.py`; its `step` is one CPU scalar per group) | `2P` |
    /// | `adam-8bit`, `n ≥ 4096` | `state1`, `state2` uint8, `absmax1`, `absmax2` float32 per 256-element block (`bitsandbytes/optim/optimizer.py`, `Optimizer2State.init_state`; `step` is a Python int) | `2·(n + 4·⌈n/256⌉)` |
    /// | `adam-8bit`, `n < 4096` | `state1`, `state2` float32 (`min_8bit_size = 4096`) | `8n` |
    ///
    /// The result saturates instead of overflowing (parameter sizes are already checked).
    #[must_use]
    pub fn state_bytes(&self, param: &Param) -> u64 {
        let p = param.bytes;
        let n = param.numel;
        match self {
            Optimizer::Sgd => 0,
            Optimizer::SgdMomentum | Optimizer::SgdNesterov | Optimizer::Lion => p,
            Optimizer::Adam | Optimizer::Adamw | Optimizer::RmspropMomentum => {
                p.saturating_mul(2).saturating_add(STEP_BYTES)
            }
            Optimizer::Adagrad | Optimizer::Rmsprop => p.saturating_add(STEP_BYTES),
            Optimizer::Lamb => p.saturating_mul(2),
            Optimizer::Adafactor => {
                let dims = param.shape.dims();
                match dims {
                    [.., r, c] if n > 0 => {
                        let elem = p / n;
                        (n / c)
                            .saturating_add(n / r)
                            .saturating_mul(elem)
                            .saturating_add(STEP_BYTES)
                    }
                    _ => p.saturating_add(STEP_BYTES),
                }
            }
            Optimizer::Adam8bit => {
                if n < BNB_MIN_8BIT_SIZE {
                    n.saturating_mul(8)
                } else {
                    n.saturating_add(n.div_ceil(BNB_BLOCK).saturating_mul(4))
                        .saturating_mul(2)
                }
            }
        }
    }

    /// State shared by all parameter tensors, counted once per optimizer: bitsandbytes' two
    /// 256-entry float32 quantization maps (`qmap1` signed, `qmap2` unsigned, 2 KiB), present
    /// when some trainable tensor has 4096 or more elements. Zero for the others.
    #[must_use]
    pub fn shared_state_bytes(&self, params: &[Param]) -> u64 {
        match self {
            Optimizer::Adam8bit
                if params
                    .iter()
                    .any(|p| p.trainable && p.numel >= BNB_MIN_8BIT_SIZE) =>
            {
                2 * 256 * 4
            }
            _ => 0,
        }
    }

    /// Bytes of the temporaries one optimizer step allocates for `param` (the tensor the
    /// optimizer updates), with default hyperparameters (no weight decay on the `torch.optim`
    /// ones, no `maximize`). `foreach` steps keep every tensor's temporaries alive at once, so
    /// the step's total is the sum over tensors. With `P = param.bytes`:
    ///
    /// | optimizer | temporaries | bytes |
    /// |---|---|---|
    /// | `sgd`, `sgd-momentum`, `sgd-nesterov` | none: `_foreach_add_(grads, bufs, alpha=momentum)` is in place in 2.15 | 0 |
    /// | `adam`, `adamw` | `_foreach_sqrt(exp_avg_sq)` (`_multi_tensor_adam`) | `P` |
    /// | `adagrad` | `std = _foreach_sqrt(state_sums)` and `numerator = _foreach_mul(grads, minus_clr)` (`_multi_tensor_adagrad`) | `2P` |
    /// | `rmsprop`, `rmsprop-momentum` | `avg = _foreach_sqrt(square_avgs)` (`_multi_tensor_rmsprop`) | `P` |
    /// | `adafactor` | `var_estimates` (`row_var @ col_var`, or `variance.clone()`; `_multi_tensor_adafactor`) | `P` |
    /// | `lion` | `updates = [t.clone() for t in exp_avgs]` | `P` |
    /// | `lamb` | clipped gradients (`_foreach_div(grads, clip_grad_norm)`, `max_grad_norm=1.0`), `denom`, `updates` (`_multi_tensor_lamb`) | `3P` |
    /// | `adam-8bit` | none: one fused CUDA kernel updates in place | 0 |
    #[must_use]
    pub fn temporaries_bytes(&self, param: &Param) -> u64 {
        let p = param.bytes;
        match self {
            Optimizer::Sgd
            | Optimizer::SgdMomentum
            | Optimizer::SgdNesterov
            | Optimizer::Adam8bit => 0,
            Optimizer::Adam
            | Optimizer::Adamw
            | Optimizer::Rmsprop
            | Optimizer::RmspropMomentum
            | Optimizer::Adafactor
            | Optimizer::Lion => p,
            Optimizer::Adagrad => p.saturating_mul(2),
            Optimizer::Lamb => p.saturating_mul(3),
        }
    }

    /// State bytes per parameter element for large tensors whose optimizer copy has
    /// `elem_bytes` bytes per element, leaving out per-tensor step counters: what a recipe's
    /// "bytes per parameter" shows. `None` for Adafactor, whose factored state depends on the
    /// shapes.
    #[must_use]
    pub fn nominal_state_bytes_per_param(self, elem_bytes: f64) -> Option<f64> {
        match self {
            Optimizer::Sgd => Some(0.0),
            Optimizer::SgdMomentum
            | Optimizer::SgdNesterov
            | Optimizer::Adagrad
            | Optimizer::Rmsprop
            | Optimizer::Lion => Some(elem_bytes),
            Optimizer::Adam | Optimizer::Adamw | Optimizer::RmspropMomentum | Optimizer::Lamb => {
                Some(2.0 * elem_bytes)
            }
            // two 1-byte states plus two float32 scales per 256 elements
            Optimizer::Adam8bit => Some(2.0 + 8.0 / 256.0),
            Optimizer::Adafactor => None,
        }
    }

    /// The dtype of the optimizer's per-element state for a parameter copy of dtype `param`:
    /// `None` without state, uint8 for 8-bit Adam.
    #[must_use]
    pub const fn state_dtype(self, param: DType) -> Option<DType> {
        match self {
            Optimizer::Sgd => None,
            Optimizer::Adam8bit => Some(DType::Uint8),
            _ => Some(param),
        }
    }

    fn parse(s: &str) -> Option<Optimizer> {
        let s = s.to_ascii_lowercase().replace('_', "-");
        match s.as_str() {
            "momentum" => Some(Optimizer::SgdMomentum),
            "nesterov" => Some(Optimizer::SgdNesterov),
            "adam8bit" => Some(Optimizer::Adam8bit),
            _ => Optimizer::ALL.into_iter().find(|o| o.as_str() == s),
        }
    }
}

/// Training step or inference forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// One training step: forward, backward, optimizer step.
    Train,
    /// A forward pass under `torch.no_grad()` in eval mode.
    Infer,
}

/// How attention is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum AttentionImpl {
    /// Matmul, softmax, dropout, matmul: keeps the `[B, heads, S, S]` probabilities.
    Eager,
    /// A fused kernel (`scaled_dot_product_attention`'s flash path): keeps Q, K, V, the output
    /// and a float32 log-sum-exp.
    Flash,
}

/// Autocast precision (`torch.autocast`) with float32 weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, schemars::JsonSchema)]
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

/// A named precision recipe (`--recipe`): which dtype the weights, gradients, master weights and
/// optimizer state take, and whether autocast runs. Tools disagree on what "mixed precision"
/// costs, so memest names the recipe and prints its bytes per parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum RecipeName {
    /// Everything float32: 4 (weights) + 4 (gradients) + optimizer state in float32.
    #[value(name = "fp32")]
    Fp32,
    /// Pure bfloat16 (`model.to(torch.bfloat16)`): bfloat16 weights, gradients, optimizer state
    /// and activations; no master copy.
    #[value(name = "bf16")]
    Bf16,
    /// Pure float16 (`model.half()`), as `bf16` with float16.
    #[value(name = "fp16")]
    Fp16,
    /// `torch.autocast(dtype=torch.bfloat16)`: float32 weights, gradients and state; 16-bit
    /// copies for matmuls and convolutions (the same as `--amp bf16`).
    #[value(name = "amp-bf16")]
    AmpBf16,
    /// `torch.autocast(dtype=torch.float16)` (the same as `--amp fp16`).
    #[value(name = "amp-fp16")]
    AmpFp16,
    /// Megatron/DeepSpeed style: bfloat16 weights, gradients and activations, float32 master
    /// weights and float32 optimizer state (2 + 2 + 4 + 8 = 16 bytes per parameter with Adam).
    #[value(name = "mixed-bf16")]
    MixedBf16,
    /// As `mixed-bf16` with float16 (and loss scaling, which costs no memory).
    #[value(name = "mixed-fp16")]
    MixedFp16,
    /// bfloat16 weights and activations, a float32 gradient accumulation buffer (Megatron's
    /// `main_grad`), float32 master weights and state (2 + 4 + 4 + 8 = 18 with Adam).
    #[value(name = "mixed-bf16-fp32-grads")]
    MixedBf16Fp32Grads,
}

impl RecipeName {
    /// The command-line name.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            RecipeName::Fp32 => "fp32",
            RecipeName::Bf16 => "bf16",
            RecipeName::Fp16 => "fp16",
            RecipeName::AmpBf16 => "amp-bf16",
            RecipeName::AmpFp16 => "amp-fp16",
            RecipeName::MixedBf16 => "mixed-bf16",
            RecipeName::MixedFp16 => "mixed-fp16",
            RecipeName::MixedBf16Fp32Grads => "mixed-bf16-fp32-grads",
        }
    }

    /// The dtypes this recipe fixes.
    #[must_use]
    pub fn recipe(self) -> Recipe {
        let (weights, gradients, master, amp) = match self {
            RecipeName::Fp32 => (DType::Float32, DType::Float32, None, None),
            RecipeName::Bf16 => (DType::Bfloat16, DType::Bfloat16, None, None),
            RecipeName::Fp16 => (DType::Float16, DType::Float16, None, None),
            RecipeName::AmpBf16 => (DType::Float32, DType::Float32, None, Some(Amp::Bf16)),
            RecipeName::AmpFp16 => (DType::Float32, DType::Float32, None, Some(Amp::Fp16)),
            RecipeName::MixedBf16 => (DType::Bfloat16, DType::Bfloat16, Some(DType::Float32), None),
            RecipeName::MixedFp16 => (DType::Float16, DType::Float16, Some(DType::Float32), None),
            RecipeName::MixedBf16Fp32Grads => {
                (DType::Bfloat16, DType::Float32, Some(DType::Float32), None)
            }
        };
        Recipe {
            name: self.as_str().to_string(),
            weights,
            gradients,
            master_weights: master,
            autocast: amp,
            explicit: true,
        }
    }
}

/// A resolved precision recipe: named by `--recipe`, or derived from `--dtype` and `--amp`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Recipe {
    /// `fp32`, `bf16`, `amp-bf16`, `mixed-bf16`, … (`pure-<dtype>` for other model dtypes).
    pub name: String,
    /// dtype of the model's parameters.
    pub weights: DType,
    /// dtype of the parameters' gradients.
    pub gradients: DType,
    /// dtype of the master copy the optimizer updates, if any (`mixed-*`: float32).
    pub master_weights: Option<DType>,
    /// Autocast, if any.
    pub autocast: Option<Amp>,
    /// Whether `--recipe` named it; `false` when it follows from `--dtype` and `--amp`.
    pub explicit: bool,
}

impl Recipe {
    /// The recipe a model dtype and autocast setting imply: `fp32`, `bf16`, `fp16`,
    /// `amp-bf16`, `amp-fp16`, or `pure-<dtype>`.
    #[must_use]
    pub fn derived(dtype: DType, amp: Option<Amp>) -> Recipe {
        let recipe = match (dtype, amp) {
            (_, Some(Amp::Bf16)) => RecipeName::AmpBf16.recipe(),
            (_, Some(Amp::Fp16)) => RecipeName::AmpFp16.recipe(),
            (DType::Float32, None) => RecipeName::Fp32.recipe(),
            (DType::Bfloat16, None) => RecipeName::Bf16.recipe(),
            (DType::Float16, None) => RecipeName::Fp16.recipe(),
            (other, None) => Recipe {
                name: format!("pure-{other}"),
                weights: other,
                gradients: other,
                master_weights: None,
                autocast: None,
                explicit: false,
            },
        };
        Recipe {
            explicit: false,
            ..recipe
        }
    }

    /// dtype of the tensors the optimizer updates, and so of its state: the master copy when
    /// there is one, else the weights.
    #[must_use]
    pub fn optimizer_dtype(&self) -> DType {
        self.master_weights.unwrap_or(self.weights)
    }

    /// dtype activations are computed in outside autocast regions (the weights' dtype).
    #[must_use]
    pub fn activations(&self) -> DType {
        self.weights
    }
}

fn recipe_name<S: serde::Serializer>(r: &Recipe, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&r.name)
}

/// Whose kernels' saved tensors to model. The measured reference figures are CPU runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, schemars::JsonSchema)]
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
    pub recipe: Option<RecipeName>,
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
}

impl Quant {
    /// The format's name (`nf4`, `int8`, `int4`, `fp8`).
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Quant::Nf4 { .. } => "nf4",
            Quant::Int8 => "int8",
            Quant::Int4 { .. } => "int4",
            Quant::Fp8 => "fp8",
        }
    }

    /// Applies the format options `--group-size` (int4) and `--double-quant` (nf4) to `base` (as
    /// parsed, with the default options). Options that do not belong to the format are ignored;
    /// [`Warning::QuantFlagsWithoutQuant`] when some were given and there is no quantization.
    ///
    /// [`Warning::QuantFlagsWithoutQuant`]: crate::report::Warning::QuantFlagsWithoutQuant
    #[must_use]
    pub fn resolve(
        base: Option<Quant>,
        group_size: Option<u64>,
        double_quant: Option<bool>,
    ) -> (Option<Quant>, Option<crate::report::Warning>) {
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
        let warning =
            (given && quant.is_none()).then_some(crate::report::Warning::QuantFlagsWithoutQuant);
        (quant, warning)
    }
}

impl std::str::FromStr for Quant {
    type Err = String;

    /// `nf4` (with double quantization), `int8`, `int4` (groups of 128) or `fp8`,
    /// case-insensitively.
    fn from_str(s: &str) -> Result<Quant, String> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "nf4" => Quant::Nf4 { double_quant: true },
            "int8" => Quant::Int8,
            "int4" => Quant::Int4 { group_size: 128 },
            "fp8" => Quant::Fp8,
            _ => {
                return Err(format!(
                    "unknown quantization `{s}`, expected nf4, int8, int4 or fp8"
                ));
            }
        })
    }
}

/// Weight quantization of linear projections (norms, embeddings and the LM head keep the compute
/// dtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
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
#[derive(Clone, Debug, PartialEq, Serialize, schemars::JsonSchema)]
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
    /// The precision recipe: named with `--recipe`, else derived from `dtype` and `amp`.
    /// `dtype` and `amp` always agree with it. Serialized as its name.
    #[serde(serialize_with = "recipe_name")]
    #[schemars(with = "String")]
    pub recipe: Recipe,
}

impl Settings {
    /// Resolves flags over file defaults over built-in defaults (batch 1, float32, AdamW,
    /// train, eager attention, CPU kernels).
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
        let mode = match o.mode {
            Some(m) => m,
            None => match defaults.mode.as_deref() {
                None | Some("train") => Mode::Train,
                Some("infer" | "inference" | "eval") => Mode::Infer,
                Some(other) => {
                    return Err(Error::setting(
                        SettingKey::Mode,
                        format!(
                            "defaults.mode: unknown mode `{other}`, expected \"train\" or \"infer\""
                        ),
                    ));
                }
            },
        };
        let optimizer = match o.optimizer {
            Some(opt) => Some(opt),
            None => match defaults.optimizer.as_deref() {
                None => Some(Optimizer::Adamw),
                Some(name) => Some(Optimizer::parse(name).ok_or_else(|| {
                    Error::setting(
                        SettingKey::Optimizer,
                        format!(
                            "defaults.optimizer: unknown optimizer `{name}`, expected one of {}",
                            Optimizer::ALL.map(Optimizer::as_str).join(", ")
                        ),
                    )
                })?),
            },
        };
        let attention = match o.attention {
            Some(a) => a,
            None => match defaults.attention.as_deref() {
                None | Some("eager") => AttentionImpl::Eager,
                Some("flash" | "sdpa") => AttentionImpl::Flash,
                Some(other) => {
                    return Err(Error::setting(
                        SettingKey::Attention,
                        format!(
                            "defaults.attention: unknown attention `{other}`, expected \"eager\" or \"flash\""
                        ),
                    ));
                }
            },
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
        if o.kv_dtype.is_some() && mode == Mode::Train {
            return Err(Error::setting(
                SettingKey::KvDtype,
                "--kv-dtype sets the inference KV cache: use it with --mode infer or --context",
            ));
        }
        Ok(Settings {
            batch,
            seq,
            dtype,
            optimizer: if mode == Mode::Train { optimizer } else { None },
            mode,
            attention,
            amp: recipe.autocast,
            checkpoint: o.checkpoint,
            device: o.device.unwrap_or(Device::Cpu),
            lora: o.lora.clone(),
            quant: o.quant,
            kv_dtype: o.kv_dtype,
            recipe,
        })
    }

    /// The dtype parameter gradients take when the recipe says so (`mixed-bf16-fp32-grads`:
    /// float32 for bfloat16 weights); `None` when gradients have their parameter's dtype.
    #[must_use]
    pub fn grad_dtype_override(&self) -> Option<DType> {
        (self.recipe.gradients != self.recipe.weights).then_some(self.recipe.gradients)
    }

    /// Whether this is a training step.
    #[must_use]
    pub fn training(&self) -> bool {
        self.mode == Mode::Train
    }
}

/// Checks a named recipe against `--dtype` and `--amp`, which it fixes itself.
fn resolve_recipe(name: RecipeName, o: &Overrides) -> Result<Recipe, Error> {
    let recipe = name.recipe();
    let r = name.as_str();
    if let Some(amp) = o.amp
        && recipe.autocast != Some(amp)
    {
        let amp = match amp {
            Amp::Bf16 => "bf16",
            Amp::Fp16 => "fp16",
        };
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

impl fmt::Display for Optimizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::SettingError;

    /// The parameters of a small model traced under `o`: a 3×3 convolution ([8, 3, 3, 3] and
    /// [8]), a linear layer of 100,352 weights ([64, 1568] and [64]), a 3-D parameter
    /// ([1, 1, 64]), a layer norm ([64] twice) and a linear layer of 640 weights ([10, 64] and
    /// [10]).
    fn small_params(o: &Overrides) -> Vec<Param> {
        let src = r#"
            [input]
            shape = [3, 16, 16]
            [[layers]]
            kind = "conv2d"
            out_channels = 8
            kernel = 3
            [[layers]]
            kind = "flatten"
            [[layers]]
            kind = "linear"
            out_features = 64
            [[layers]]
            kind = "reshape"
            shape = [1, 64]
            [[layers]]
            kind = "parameter"
            shape = [1, 1, 64]
            combine = "add"
            [[layers]]
            kind = "layernorm"
            [[layers]]
            kind = "linear"
            out_features = 10
        "#;
        let spec = crate::spec::parse(src, crate::spec::Format::Toml).unwrap();
        let model = crate::graph::build(&spec, "small").unwrap();
        let settings = Settings::resolve(&model.defaults, o).unwrap();
        crate::trace::trace(&model, &settings).unwrap().params
    }

    fn by_shape<'a>(params: &'a [Param], dims: &[u64]) -> &'a Param {
        params
            .iter()
            .find(|p| p.shape.dims() == dims)
            .unwrap_or_else(|| panic!("no parameter of shape {dims:?}"))
    }

    /// Per-tensor state bytes measured on the same tensors in PyTorch 2.15 (CPU, float32):
    /// the sum of `nbytes` over `optimizer.state[p]` after one step (bitsandbytes 0.50.2,
    /// lion-pytorch 0.2.5, timm 1.0.31 for the others).
    #[test]
    fn state_bytes_match_measured_tensors() {
        let params = small_params(&Overrides::default());
        let measured: [(&[u64], Optimizer, u64); 16] = [
            (&[64, 1568], Optimizer::Adam, 802_820),
            (&[64, 1568], Optimizer::SgdNesterov, 401_408),
            (&[64, 1568], Optimizer::Adagrad, 401_412),
            (&[64, 1568], Optimizer::Rmsprop, 401_412),
            (&[64, 1568], Optimizer::RmspropMomentum, 802_820),
            (&[64, 1568], Optimizer::Lion, 401_408),
            (&[64, 1568], Optimizer::Lamb, 802_816),
            // row_var [64, 1] + col_var [1, 1568] + step
            (&[64, 1568], Optimizer::Adafactor, 6_532),
            // row_var [8, 3, 3, 1] + col_var [8, 3, 1, 3] + step
            (&[8, 3, 3, 3], Optimizer::Adafactor, 580),
            // row_var [1, 1, 1] + col_var [1, 1, 64] + step
            (&[1, 1, 64], Optimizer::Adafactor, 264),
            (&[10, 64], Optimizer::Adafactor, 300),
            // variance [10] + step
            (&[10], Optimizer::Adafactor, 44),
            // 2 × 100,352 uint8 + 2 × 392 float32 absmax (the shared qmaps counted apart)
            (&[64, 1568], Optimizer::Adam8bit, 205_888 - 2_048),
            // below min_8bit_size: two float32 states
            (&[10, 64], Optimizer::Adam8bit, 5_120),
            (&[8], Optimizer::Adam8bit, 64),
            (&[10], Optimizer::Sgd, 0),
        ];
        for (dims, opt, bytes) in measured {
            assert_eq!(
                opt.state_bytes(by_shape(&params, dims)),
                bytes,
                "{opt} on {dims:?}"
            );
        }
        assert_eq!(Optimizer::Adam8bit.shared_state_bytes(&params), 2_048);
        assert_eq!(Optimizer::Adam.shared_state_bytes(&params), 0);
    }

    /// The whole small model, float32 and bfloat16, against the measured totals.
    #[test]
    fn state_totals_match_measured_small_model() {
        let total = |o: Optimizer, params: &[Param]| -> u64 {
            params.iter().map(|p| o.state_bytes(p)).sum::<u64>() + o.shared_state_bytes(params)
        };
        let f32 = small_params(&Overrides::default());
        assert_eq!(f32.iter().map(|p| p.bytes).sum::<u64>(), 405_928);
        for (opt, bytes) in [
            (Optimizer::Adam, 811_892),
            (Optimizer::SgdMomentum, 405_928),
            (Optimizer::SgdNesterov, 405_928),
            (Optimizer::Adagrad, 405_964),
            (Optimizer::Rmsprop, 405_964),
            (Optimizer::RmspropMomentum, 811_892),
            (Optimizer::Adafactor, 8_536),
            (Optimizer::Lion, 405_928),
            (Optimizer::Lamb, 811_856),
            (Optimizer::Adam8bit, 214_928),
        ] {
            assert_eq!(total(opt, &f32), bytes, "{opt}");
        }
        // bfloat16 weights: states in bfloat16, steps and 8-bit scales as before.
        let bf16 = small_params(&Overrides {
            dtype: Some(DType::Bfloat16),
            ..Overrides::default()
        });
        assert_eq!(total(Optimizer::Adam, &bf16), 405_928 + 9 * 4);
        assert_eq!(total(Optimizer::Adam8bit, &bf16), 214_928);
    }

    #[test]
    fn temporaries_follow_the_foreach_code() {
        let params = small_params(&Overrides::default());
        let p = by_shape(&params, &[64, 1568]);
        for (opt, k) in [
            (Optimizer::Sgd, 0),
            (Optimizer::SgdMomentum, 0),
            (Optimizer::SgdNesterov, 0),
            (Optimizer::Adam, 1),
            (Optimizer::Adamw, 1),
            (Optimizer::Adagrad, 2),
            (Optimizer::Rmsprop, 1),
            (Optimizer::RmspropMomentum, 1),
            (Optimizer::Adafactor, 1),
            (Optimizer::Lion, 1),
            (Optimizer::Lamb, 3),
            (Optimizer::Adam8bit, 0),
        ] {
            assert_eq!(opt.temporaries_bytes(p), k * p.bytes, "{opt}");
        }
    }

    #[test]
    fn optimizer_names_round_trip() {
        for o in Optimizer::ALL {
            assert_eq!(Optimizer::parse(o.as_str()), Some(o));
            assert_eq!(
                <Optimizer as ValueEnum>::from_str(o.as_str(), false),
                Ok(o),
                "clap name of {o}"
            );
            let json = serde_json::to_string(&o).unwrap();
            assert_eq!(json, format!("\"{}\"", o.as_str()));
        }
        assert_eq!(Optimizer::parse("adam8bit"), Some(Optimizer::Adam8bit));
        assert_eq!(
            Optimizer::parse("SGD_Nesterov"),
            Some(Optimizer::SgdNesterov)
        );
        assert_eq!(Optimizer::parse("adamax"), None);
    }

    #[test]
    fn unknown_file_optimizer_lists_all() {
        let defaults = DefaultsSpec {
            optimizer: Some("adamax".into()),
            ..DefaultsSpec::default()
        };
        let err = Settings::resolve(&defaults, &Overrides::default()).unwrap_err();
        let Error::Setting(SettingError {
            key: SettingKey::Optimizer,
            message: msg,
        }) = err
        else {
            panic!("{err:?}")
        };
        assert!(
            msg.contains("sgd-nesterov") && msg.contains("adam-8bit"),
            "{msg}"
        );
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
            assert_eq!(s.recipe.name, name.as_str());
            assert!(s.recipe.explicit);
            assert_eq!((s.dtype, s.amp), (weights, amp), "{}", name.as_str());
            assert_eq!(s.recipe.gradients, grads, "{}", name.as_str());
            assert_eq!(s.recipe.master_weights, master, "{}", name.as_str());
            assert_eq!(
                s.grad_dtype_override(),
                (grads != weights).then_some(grads),
                "{}",
                name.as_str()
            );
            assert_eq!(
                <RecipeName as ValueEnum>::from_str(name.as_str(), false),
                Ok(name)
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
            s.recipe.name
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
        assert_eq!(s.recipe.name, "bf16");
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
            assert!(resolve(&o).is_ok(), "{}", recipe.as_str());
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
