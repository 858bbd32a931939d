//! Optimizers: state per parameter tensor, the temporaries of one step, bytes per parameter, and
//! the plan of one step under a precision recipe.

use clap::ValueEnum;

use super::TensorInfo;
use crate::dtype::DType;

/// The optimizer whose state and step temporaries are counted, with its default
/// hyperparameters. The `torch.optim` ones run as [`OptimizerImpl`] says (`foreach=True` by
/// default, the CUDA default); the others follow the implementation named on each.
///
/// State bytes per parameter tensor are [`Optimizer::state_bytes`] (plus
/// [`Optimizer::shared_state_bytes`] once per optimizer), temporaries of one step
/// [`OptimizerImpl::step_temporaries`]. Sources: PyTorch 2.15 `torch/optim/*.py`,
/// lion-pytorch 0.2.5, timm 1.0.31, bitsandbytes 0.50.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, schemars::JsonSchema)]
#[schemars(rename_all = "kebab-case")]
pub enum Optimizer {
    /// Plain SGD (`torch.optim.SGD`): no state.
    Sgd,
    /// SGD with momentum: one momentum buffer per parameter.
    #[value(alias = "momentum")]
    SgdMomentum,
    /// SGD with Nesterov momentum (`nesterov=True`): one momentum buffer per parameter.
    #[value(alias = "nesterov")]
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
    #[value(name = "adam-8bit", alias = "adam8bit")]
    #[schemars(rename = "adam-8bit")]
    Adam8bit,
}
crate::vocab!(Optimizer, "optimizer");

/// How a `torch.optim` optimizer loops over its tensors (`--optim-impl`, the constructor's
/// `foreach` and `fused` arguments), which decides how many temporaries of the step are alive
/// at once. It applies to the `torch.optim` optimizers ([`Optimizer::is_torch_optim`]); the
/// others have one implementation each.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, schemars::JsonSchema)]
#[schemars(rename_all = "kebab-case")]
pub enum OptimizerImpl {
    /// `foreach=True`, the CUDA default (`_multi_tensor_*`): each operation runs on all tensors
    /// at once, so every tensor's temporaries are alive together.
    #[default]
    Foreach,
    /// `foreach=False` (`_single_tensor_*`): a Python loop over the tensors; the step needs the
    /// temporaries of one tensor (plus what the loop's variables still hold of the previous one).
    #[value(alias = "single-tensor")]
    ForLoop,
    /// `fused=True` (`_fused_*`, one kernel per dtype and device that updates in place): no
    /// temporaries. `SGD`, `Adam`, `AdamW` and `Adagrad` only.
    Fused,
}
crate::vocab!(OptimizerImpl, "optimizer implementation");

/// Bytes of a float32 `step` tensor (`torch.tensor(0.0)`, `_get_scalar_dtype()`).
const STEP_BYTES: u64 = 4;
/// bitsandbytes' `min_8bit_size`: smaller tensors keep two float32 states.
const BNB_MIN_8BIT_SIZE: u64 = 4096;
/// bitsandbytes' blockwise quantization block of the 8-bit optimizers (0.44 and later).
const BNB_BLOCK: u64 = 256;

/// What one tensor's turn of a for-loop step allocates: `peak` bytes alive at its highest, of
/// which `held` stay referenced by the loop's variables until the next tensor rebinds them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct LoopTemps {
    peak: u64,
    held: u64,
}

impl Optimizer {
    /// Whether PyTorch implements it in `torch.optim` (so `foreach` and `fused` apply).
    #[must_use]
    pub const fn is_torch_optim(self) -> bool {
        !matches!(
            self,
            Optimizer::Lion | Optimizer::Lamb | Optimizer::Adam8bit
        )
    }

    /// Whether bitsandbytes has a paged version (`--paged`): `PagedAdam`, `PagedAdamW`,
    /// `PagedAdamW8bit` (for `adam-8bit`) and `PagedLion` (`bitsandbytes/optim/adamw.py`,
    /// `adam.py`, `lion.py`: the same classes with `is_paged=True`).
    #[must_use]
    pub const fn has_paged_version(self) -> bool {
        matches!(
            self,
            Optimizer::Adam | Optimizer::Adamw | Optimizer::Adam8bit | Optimizer::Lion
        )
    }

    /// State bytes of bitsandbytes' paged version of this optimizer for `param`
    /// ([`Optimizer::has_paged_version`]). The 32-bit ones keep float32 state whatever the
    /// parameter's dtype (`Optimizer2State.init_state`/`Optimizer1State.init_state` with
    /// `optim_bits=32`: `get_state_buffer(p, dtype=torch.float32)`), and their `step` is a Python
    /// int: Adam and AdamW `8n`, Lion `4n`; 8-bit AdamW as [`Optimizer::Adam8bit`]. `None` for an
    /// optimizer without a paged version.
    #[must_use]
    pub fn paged_state_bytes(self, param: TensorInfo<'_>) -> Option<u64> {
        let n = param.numel;
        match self {
            Optimizer::Adam | Optimizer::Adamw => Some(n.saturating_mul(8)),
            Optimizer::Lion => Some(n.saturating_mul(4)),
            Optimizer::Adam8bit => Some(self.state_bytes(param)),
            _ => None,
        }
    }

    /// Whether `implementation` exists for this optimizer: `foreach` for every one (the others'
    /// own implementation), the for-loop for `torch.optim` ones, `fused` for SGD, Adam, AdamW
    /// and Adagrad (the `torch.optim` classes with a `fused` argument).
    #[must_use]
    pub const fn supports(self, implementation: OptimizerImpl) -> bool {
        match implementation {
            OptimizerImpl::Foreach => true,
            OptimizerImpl::ForLoop => self.is_torch_optim(),
            OptimizerImpl::Fused => matches!(
                self,
                Optimizer::Sgd
                    | Optimizer::SgdMomentum
                    | Optimizer::SgdNesterov
                    | Optimizer::Adam
                    | Optimizer::Adamw
                    | Optimizer::Adagrad
            ),
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
    /// The implementation ([`OptimizerImpl`]) does not change the state. The result saturates
    /// instead of overflowing (parameter sizes are already checked).
    #[must_use]
    pub fn state_bytes(self, param: TensorInfo<'_>) -> u64 {
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
            Optimizer::Adafactor => match param.shape {
                [.., r, c] if n > 0 => {
                    let elem = p / n;
                    (n / c)
                        .saturating_add(n / r)
                        .saturating_mul(elem)
                        .saturating_add(STEP_BYTES)
                }
                _ => p.saturating_add(STEP_BYTES),
            },
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

    /// State shared by all the trainable tensors `params`, counted once per optimizer:
    /// bitsandbytes' two 256-entry float32 quantization maps (`qmap1` signed, `qmap2` unsigned,
    /// 2 KiB), present when some tensor has 4096 or more elements. Zero for the others.
    #[must_use]
    pub fn shared_state_bytes(self, params: &[TensorInfo<'_>]) -> u64 {
        match self {
            Optimizer::Adam8bit if params.iter().any(|p| p.numel >= BNB_MIN_8BIT_SIZE) => {
                2 * 256 * 4
            }
            _ => 0,
        }
    }

    /// Bytes of the temporaries one `foreach` step allocates for `param` (the tensor the
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
    pub fn temporaries_bytes(self, param: TensorInfo<'_>) -> u64 {
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

    /// The tensors of [`Optimizer::state_bytes`] that live on the device, in the order the
    /// optimizer creates them, as the caching allocator sees them. The float32 `step` counter
    /// is a host tensor (`torch.tensor(0.0)`) unless `device_step` (PyTorch puts it on the
    /// parameter's device for `fused=True` or `capturable=True`: `_init_group`'s
    /// `torch.zeros((), device=p.device)`), where it comes first. The rest, as in
    /// [`Optimizer::state_bytes`]: `exp_avg` then `exp_avg_sq` (Adam, AdamW, LAMB),
    /// `square_avg` then `momentum_buffer` (RMSprop), `row_var` then `col_var` or `variance`
    /// (Adafactor), `state1`, `state2`, `absmax1`, `absmax2` (bitsandbytes,
    /// `Optimizer2State.init_state`).
    #[must_use]
    pub fn state_tensors(self, param: TensorInfo<'_>, device_step: bool) -> Vec<u64> {
        let p = param.bytes;
        let n = param.numel;
        let has_step = matches!(
            self,
            Optimizer::Adam
                | Optimizer::Adamw
                | Optimizer::Adagrad
                | Optimizer::Rmsprop
                | Optimizer::RmspropMomentum
                | Optimizer::Adafactor
        );
        let mut out = Vec::with_capacity(5);
        if has_step && device_step {
            out.push(STEP_BYTES);
        }
        match self {
            Optimizer::Sgd => {}
            Optimizer::SgdMomentum
            | Optimizer::SgdNesterov
            | Optimizer::Lion
            | Optimizer::Adagrad
            | Optimizer::Rmsprop => out.push(p),
            Optimizer::Adam | Optimizer::Adamw | Optimizer::RmspropMomentum | Optimizer::Lamb => {
                out.extend([p, p]);
            }
            Optimizer::Adafactor => match param.shape {
                [.., r, c] if n > 0 => {
                    let elem = p / n;
                    out.extend([(n / c).saturating_mul(elem), (n / r).saturating_mul(elem)]);
                }
                _ => out.push(p),
            },
            Optimizer::Adam8bit => {
                if n < BNB_MIN_8BIT_SIZE {
                    out.extend([n.saturating_mul(4), n.saturating_mul(4)]);
                } else {
                    let absmax = n.div_ceil(BNB_BLOCK).saturating_mul(4);
                    out.extend([n, n, absmax, absmax]);
                }
            }
        }
        out
    }

    /// Whether the state exists from the optimizer's construction rather than its first step:
    /// `torch.optim.Adagrad.__init__` fills `sum` at once; the others create their state lazily
    /// in the first `step()`.
    #[must_use]
    pub const fn eager_state(self) -> bool {
        matches!(self, Optimizer::Adagrad)
    }

    /// The temporaries of [`Optimizer::temporaries_bytes`] as tensors: one entry per
    /// `_foreach_*` result list, in the order the step makes them (Adagrad: `std` then
    /// `numerator`; LAMB: the clipped gradients, `denom`, `updates`); a step makes each list
    /// over all its tensors before the next.
    #[must_use]
    pub fn foreach_temporaries(self, param: TensorInfo<'_>) -> Vec<u64> {
        let p = param.bytes;
        match self {
            Optimizer::Sgd
            | Optimizer::SgdMomentum
            | Optimizer::SgdNesterov
            | Optimizer::Adam8bit => Vec::new(),
            Optimizer::Adam
            | Optimizer::Adamw
            | Optimizer::Rmsprop
            | Optimizer::RmspropMomentum
            | Optimizer::Adafactor
            | Optimizer::Lion => vec![p],
            Optimizer::Adagrad => vec![p, p],
            Optimizer::Lamb => vec![p, p, p],
        }
    }

    /// What one tensor's turn of a `foreach=False` step allocates (`_single_tensor_*` in
    /// PyTorch 2.15, default hyperparameters), with `P = param.bytes`. The loop's variables
    /// (`denom`, `std`, `avg`) keep the last tensor's result until the next turn rebinds them,
    /// after it has allocated its own:
    ///
    /// | optimizer | one turn | peak | held |
    /// |---|---|---|---|
    /// | `sgd`, `sgd-momentum` | in place (`buf.mul_(momentum).add_(grad)`) | 0 | 0 |
    /// | `sgd-nesterov` | `grad = grad.add(buf, alpha=momentum)`, rebound first thing next turn | `P` | 0 |
    /// | `adam`, `adamw` | `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`: the square root and the quotient | `2P` | `P` |
    /// | `adagrad` | `std = state_sum.sqrt().add_(eps)` | `P` | `P` |
    /// | `rmsprop`, `rmsprop-momentum` | `avg = square_avg.sqrt()` | `P` | `P` |
    ///
    /// `None` for Adafactor (see [`adafactor_loop`]) and the optimizers outside `torch.optim`.
    fn loop_temporaries(self, param: TensorInfo<'_>) -> Option<LoopTemps> {
        let p = param.bytes;
        let (peak, held) = match self {
            Optimizer::Sgd | Optimizer::SgdMomentum => (0, 0),
            Optimizer::SgdNesterov => (p, 0),
            Optimizer::Adam | Optimizer::Adamw => (p.saturating_mul(2), p),
            Optimizer::Adagrad | Optimizer::Rmsprop | Optimizer::RmspropMomentum => (p, p),
            Optimizer::Adafactor | Optimizer::Lion | Optimizer::Lamb | Optimizer::Adam8bit => {
                return None;
            }
        };
        Some(LoopTemps { peak, held })
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

    /// How the bytes-per-parameter figure of the state is labelled: the optimizer's name, or
    /// for one whose state depends on the shapes (Adafactor) a note that it is this model's
    /// average.
    #[must_use]
    pub fn per_param_label(self) -> String {
        match self.nominal_state_bytes_per_param(1.0) {
            Some(_) => self.to_string(),
            None => format!("{self}, factored: this model's average"),
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
}

impl OptimizerImpl {
    /// Whether this is the default, `foreach`.
    #[must_use]
    pub const fn is_foreach(&self) -> bool {
        matches!(self, OptimizerImpl::Foreach)
    }

    /// Bytes of the temporaries of one step of `optimizer` over `params` (the tensors it
    /// updates, in the order of `model.parameters()`), at their highest:
    /// - `foreach`: the sum of [`Optimizer::temporaries_bytes`] over the tensors
    ///   (`torch/optim/adam.py`, `_multi_tensor_adam`: `_foreach_sqrt` over the whole list);
    /// - for-loop: the largest, over the tensors, of one turn's peak plus what the loop still
    ///   holds of the previous turn (`_single_tensor_adam`; see `loop_temporaries`);
    /// - `fused`: none (`_fused_adam` calls `torch._fused_adam_`, which updates in place).
    ///
    /// Optimizers outside `torch.optim` have one implementation: theirs, as `foreach` gives.
    #[must_use]
    pub fn step_temporaries(self, optimizer: Optimizer, params: &[TensorInfo<'_>]) -> u64 {
        let foreach = || {
            params.iter().fold(0u64, |sum, &p| {
                sum.saturating_add(optimizer.temporaries_bytes(p))
            })
        };
        match self {
            OptimizerImpl::Foreach => foreach(),
            OptimizerImpl::Fused => 0,
            OptimizerImpl::ForLoop if optimizer == Optimizer::Adafactor => adafactor_loop(params),
            OptimizerImpl::ForLoop => {
                let mut held = 0u64;
                let mut peak = 0u64;
                for &p in params {
                    let Some(turn) = optimizer.loop_temporaries(p) else {
                        return foreach();
                    };
                    peak = peak.max(held.saturating_add(turn.peak));
                    held = turn.held;
                }
                peak
            }
        }
    }
}

/// The peak temporaries of `_single_tensor_adafactor` (PyTorch 2.15, `torch/optim/_adafactor.py`)
/// over `params` in order. Four loop variables outlive their turn until a later one rebinds
/// them: `row_mean` (`[.., r, 1]`) and `col_mean` (`[.., 1, c]`) of the last tensor of rank
/// ≥ 2, `grad_squared` (`grad * grad`) of the last vector, and `update` (`var_estimate`:
/// `row_var @ col_var`, or `variance.clone()`, then clamped and `rsqrt_` in place) of the last
/// tensor. Each new one is allocated while the old one is still bound.
fn adafactor_loop(params: &[TensorInfo<'_>]) -> u64 {
    let (mut row_mean, mut col_mean, mut grad_squared, mut update) = (0u64, 0u64, 0u64, 0u64);
    let mut peak = 0u64;
    let mut alloc = |live: u64, new: u64| {
        peak = peak.max(live.saturating_add(new));
        new
    };
    for p in params {
        let live = |a: u64, b: u64, c: u64, d: u64| {
            a.saturating_add(b).saturating_add(c).saturating_add(d)
        };
        match p.shape {
            [.., r, c] if p.numel > 0 => {
                let elem = p.bytes / p.numel;
                let row = (p.numel / c).saturating_mul(elem);
                let col = (p.numel / r).saturating_mul(elem);
                row_mean = alloc(live(row_mean, col_mean, grad_squared, update), row);
                col_mean = alloc(live(row_mean, col_mean, grad_squared, update), col);
            }
            _ => {
                grad_squared = alloc(live(row_mean, col_mean, grad_squared, update), p.bytes);
            }
        }
        update = alloc(live(row_mean, col_mean, grad_squared, update), p.bytes);
    }
    peak
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The trainable tensors of a small model, in `model.parameters()` order: a 3×3
    /// convolution ([8, 3, 3, 3] and [8]), a linear layer of 100,352 weights ([64, 1568] and
    /// [64]), a 3-D parameter ([1, 1, 64]), a layer norm ([64] twice) and a linear layer of 640
    /// weights ([10, 64] and [10]).
    const SMALL: [&[u64]; 9] = [
        &[8, 3, 3, 3],
        &[8],
        &[64, 1568],
        &[64],
        &[1, 1, 64],
        &[64],
        &[64],
        &[10, 64],
        &[10],
    ];

    fn small(elem_bytes: u64) -> Vec<TensorInfo<'static>> {
        SMALL
            .iter()
            .map(|&shape| {
                let numel = shape.iter().product();
                TensorInfo {
                    shape,
                    numel,
                    bytes: numel * elem_bytes,
                }
            })
            .collect()
    }

    fn by_shape<'a>(params: &[TensorInfo<'a>], dims: &[u64]) -> TensorInfo<'a> {
        *params
            .iter()
            .find(|p| p.shape == dims)
            .unwrap_or_else(|| panic!("no parameter of shape {dims:?}"))
    }

    /// Per-tensor state bytes measured on the same tensors in PyTorch 2.15 (CPU, float32):
    /// the sum of `nbytes` over `optimizer.state[p]` after one step (bitsandbytes 0.50.2,
    /// lion-pytorch 0.2.5, timm 1.0.31 for the others).
    #[test]
    fn state_bytes_match_measured_tensors() {
        let params = small(4);
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
        let total = |o: Optimizer, params: &[TensorInfo<'_>]| -> u64 {
            params.iter().map(|&p| o.state_bytes(p)).sum::<u64>() + o.shared_state_bytes(params)
        };
        let f32 = small(4);
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
        let bf16 = small(2);
        assert_eq!(total(Optimizer::Adam, &bf16), 405_928 + 9 * 4);
        assert_eq!(total(Optimizer::Adam8bit, &bf16), 214_928);
    }

    #[test]
    fn temporaries_follow_the_foreach_code() {
        let params = small(4);
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
        let sum: u64 = params.iter().map(|p| p.bytes).sum();
        assert_eq!(
            OptimizerImpl::Foreach.step_temporaries(Optimizer::Adam, &params),
            sum
        );
    }

    /// A for-loop step needs one tensor's temporaries at a time, plus what the loop still
    /// holds of the previous tensor; a fused one none.
    #[test]
    fn for_loop_and_fused_temporaries() {
        let params = small(4);
        let big = 64 * 1568 * 4;
        // Adam: `denom` of [8] (32 B) still held while [64, 1568]'s square root and quotient
        // are alive.
        assert_eq!(
            OptimizerImpl::ForLoop.step_temporaries(Optimizer::Adamw, &params),
            32 + 2 * big
        );
        // Adagrad and RMSprop: one tensor's `std` / `avg`, plus the previous one's: [64]'s
        // (256 B) while [64, 1568]'s is still bound.
        assert_eq!(
            OptimizerImpl::ForLoop.step_temporaries(Optimizer::Adagrad, &params),
            big + 256
        );
        // Adafactor: the next vector [64] allocates `grad_squared` and its `update` (256 B
        // each) while [64, 1568]'s `update`, `row_mean` [64, 1] and `col_mean` [1, 1568] are
        // still bound.
        assert_eq!(
            OptimizerImpl::ForLoop.step_temporaries(Optimizer::Adafactor, &params),
            big + 256 + 6_272 + 2 * 256
        );
        assert_eq!(
            OptimizerImpl::ForLoop.step_temporaries(Optimizer::SgdNesterov, &params),
            big
        );
        assert_eq!(
            OptimizerImpl::ForLoop.step_temporaries(Optimizer::SgdMomentum, &params),
            0
        );
        assert_eq!(
            OptimizerImpl::Fused.step_temporaries(Optimizer::Adam, &params),
            0
        );
        // outside torch.optim the optimizer's own implementation counts
        assert_eq!(
            OptimizerImpl::ForLoop.step_temporaries(Optimizer::Lion, &params),
            OptimizerImpl::Foreach.step_temporaries(Optimizer::Lion, &params)
        );
    }

    #[test]
    fn optimizer_names_round_trip() {
        use crate::vocab::Vocab;
        for &o in Optimizer::value_variants() {
            let name = o.to_string();
            assert_eq!(Optimizer::parse(&name), Some(o));
            assert_eq!(
                <Optimizer as ValueEnum>::from_str(&name, false),
                Ok(o),
                "clap name of {o}"
            );
            let json = serde_json::to_string(&o).unwrap();
            assert_eq!(json, format!("\"{name}\""));
        }
        assert_eq!(
            Optimizer::names(),
            "sgd, sgd-momentum, sgd-nesterov, adam, adamw, adagrad, rmsprop, rmsprop-momentum, adafactor, lion, lamb, adam-8bit"
        );
        assert_eq!(Optimizer::parse("adam8bit"), Some(Optimizer::Adam8bit));
        assert_eq!(Optimizer::parse("momentum"), Some(Optimizer::SgdMomentum));
        assert_eq!(
            Optimizer::parse("SGD_Nesterov"),
            Some(Optimizer::SgdNesterov)
        );
        assert_eq!(Optimizer::parse("adamax"), None);
        assert_eq!(
            OptimizerImpl::parse("for_loop"),
            Some(OptimizerImpl::ForLoop)
        );
        assert_eq!(OptimizerImpl::Fused.to_string(), "fused");
    }

    #[test]
    fn adafactor_is_labelled_as_an_average() {
        assert_eq!(
            Optimizer::Adafactor.per_param_label(),
            "adafactor, factored: this model's average"
        );
        assert_eq!(Optimizer::Adam8bit.per_param_label(), "adam-8bit");
    }

    /// The state's and the temporaries' tensors add up to [`Optimizer::state_bytes`] (less the
    /// host `step` counter) and [`Optimizer::temporaries_bytes`], for every optimizer.
    #[test]
    fn tensors_add_up_to_the_bytes() {
        for &opt in Optimizer::value_variants() {
            for p in small(4) {
                let host: u64 = opt.state_tensors(p, false).iter().sum();
                let device: u64 = opt.state_tensors(p, true).iter().sum();
                let step = device - host;
                assert!(step == 0 || step == STEP_BYTES, "{opt}");
                let lamb_or_bnb = matches!(opt, Optimizer::Lamb | Optimizer::Adam8bit);
                let counted = if lamb_or_bnb { host } else { device };
                assert_eq!(counted, opt.state_bytes(p), "{opt} {:?}", p.shape);
                let temps: u64 = opt.foreach_temporaries(p).iter().sum();
                assert_eq!(temps, opt.temporaries_bytes(p), "{opt}");
            }
        }
    }
}
