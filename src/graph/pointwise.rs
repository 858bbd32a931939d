//! Activations, `dropout`, `softmax`, `add`, `mul`, `concat`, `parameter`, `stochastic_depth`,
//! `scale`, `cross_entropy`.

use super::keys::{KeyReader, key};
use crate::spec::{CombineKind, LayerKind, Pair};

/// Activation functions, with the tensors autograd keeps for each (see [`crate::trace`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `relu`: keeps its output. `inplace` writes into the input's memory.
    Relu {
        /// `nn.ReLU(inplace=True)`.
        inplace: bool,
    },
    /// `relu6` (`hardtanh(0, 6)`): keeps its input (its output when in place).
    Relu6 {
        /// `nn.ReLU6(inplace=True)`.
        inplace: bool,
    },
    /// `hardswish`: keeps its input (a clone of it when in place).
    Hardswish {
        /// `nn.Hardswish(inplace=True)`.
        inplace: bool,
    },
    /// `hardsigmoid`: keeps its input (a clone of it when in place).
    Hardsigmoid {
        /// `nn.Hardsigmoid(inplace=True)`.
        inplace: bool,
    },
    /// `leaky_relu`: keeps its input, or its output when in place (`leaky_relu_`).
    LeakyRelu {
        /// `nn.LeakyReLU(inplace=True)`.
        inplace: bool,
    },
    /// `gelu` (`F.gelu`, erf or `approximate="tanh"`): keeps its input.
    Gelu,
    /// `gelu_new`: the tanh approximation written out in Python (transformers'
    /// `NewGELUActivation`): keeps its input, `tanh(..)`, `0.5·x` and `1 + tanh(..)`.
    GeluNew,
    /// `bloom_gelu`: BLOOM's `BloomGelu` module (`GeLUFunction`, a custom autograd function):
    /// keeps its input; its forward and backward write the tanh approximation out op by op, a
    /// tensor of the input's size each.
    BloomGelu,
    /// `silu` (`F.silu`): keeps its input (a clone of it when in place).
    Silu {
        /// `nn.SiLU(inplace=True)`.
        inplace: bool,
    },
    /// `tanh`: keeps its output.
    Tanh,
    /// `sigmoid`: keeps its output.
    Sigmoid,
}

impl Activation {
    /// Reads an activation kind (`relu` … `sigmoid`).
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        use LayerKind as K;
        let s = r.spec();
        let act = match r.kind() {
            K::Gelu => {
                // Both forms keep the input: the value does not change the estimate.
                r.opt(key!(s.approximate));
                Activation::Gelu
            }
            K::GeluNew => Activation::GeluNew,
            K::BloomGelu => Activation::BloomGelu,
            K::Tanh => Activation::Tanh,
            K::Sigmoid => Activation::Sigmoid,
            kind => {
                let inplace = r.or(key!(s.inplace), false);
                match kind {
                    K::Relu => Activation::Relu { inplace },
                    K::Relu6 => Activation::Relu6 { inplace },
                    K::Hardswish => Activation::Hardswish { inplace },
                    K::Hardsigmoid => Activation::Hardsigmoid { inplace },
                    K::LeakyRelu => Activation::LeakyRelu { inplace },
                    K::Silu => Activation::Silu { inplace },
                    other => return Err(format!("`{other}` is not an activation")),
                }
            }
        };
        r.finish()?;
        Ok(act)
    }
}

/// `nn.Dropout(p)`: identity in inference or when `p = 0`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropoutCfg {
    /// Drop probability (default 0.5).
    pub p: f64,
    /// Writes into its input.
    pub inplace: bool,
}

impl DropoutCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = DropoutCfg {
            p: r.prob(key!(s.p), 0.5),
            inplace: r.or(key!(s.inplace), false),
        };
        r.finish()?;
        Ok(cfg)
    }
}

/// `softmax(dim)`: keeps its output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SoftmaxCfg {
    /// Dimension (default -1).
    pub dim: i64,
}

impl SoftmaxCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = SoftmaxCfg {
            dim: r.or(key!(s.dim), -1),
        };
        r.finish()?;
        Ok(cfg)
    }
}

/// Elementwise sum of two or more inputs (residuals).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddCfg {
    /// Writes into the first input (`out += identity`).
    pub inplace: bool,
    /// The inputs stay alive until the enclosing block returns (outside blocks: until the base
    /// model's forward returns): Python locals of the module's `forward`, e.g. GPT2Block's
    /// `attn_output` in `hidden_states = attn_output + residual`, which lives through the MLP.
    pub keep_inputs: bool,
}

impl AddCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = AddCfg {
            inplace: r.or(key!(s.inplace), false),
            keep_inputs: r.or(key!(s.keep_inputs), false),
        };
        r.finish()?;
        Ok(cfg)
    }
}

/// Concatenation of the inputs along a dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConcatCfg {
    /// Dimension (negative counts from the end; default 1).
    pub dim: i64,
}

impl ConcatCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = ConcatCfg {
            dim: r.or(key!(s.dim), 1),
        };
        r.finish()?;
        Ok(cfg)
    }
}

/// How a free parameter tensor joins the activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Combine {
    /// Expanded over the batch and concatenated along a dimension (ViT's class token).
    Concat(i64),
    /// Broadcast and added (ViT's position embedding).
    Add,
    /// Broadcast and multiplied (ConvNeXt's layer scale): keeps the input for the parameter's
    /// gradient.
    Mul,
    /// Not read by the forward (DINOv2's `mask_token`): the parameter is counted and gets no
    /// gradient; the input passes through.
    Unused,
}

/// A free parameter tensor of the given shape joined to the activations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParameterCfg {
    /// Parameter shape.
    pub shape: Vec<u64>,
    /// How it joins (`combine`, and `dim` for `concat`).
    pub combine: Combine,
    /// A float buffer of this shape instead of a parameter (no gradient, counted with the
    /// buffers); `combine = "add"` reads its leading `shape` elements, copied out when smaller
    /// (diffusers' `PatchEmbed.cropped_pos_embed`).
    pub buffer: Option<Vec<u64>>,
    /// `size = [h, w]`: the table, `[1, 1 + g², D]` (a class row, then a `g × g` grid of patch
    /// rows), is resized to an `h × w` grid before it is added, as transformers'
    /// `Dinov2Embeddings.interpolate_pos_encoding` does for an image of another size than the
    /// config's: the patch rows viewed as `[1, D, g, g]`, cast to float32, bicubic
    /// `F.interpolate` to `[1, D, h, w]`, cast back, and joined to the class row with
    /// `torch.cat` (`models/dinov2/modeling_dinov2.py`).
    pub interpolate: Option<Pair>,
}

impl ParameterCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let shape = r.req(key!(s.shape), " (the parameter's shape, e.g. [1, 1, 768])");
        let combine = r.opt(key!(s.combine));
        let dim = r.opt(key!(s.dim));
        let buffer = r.opt(key!(s.buffer));
        let interpolate = r.pair_opt(key!(s.size));
        r.finish()?;
        let positive = |key: &str, shape: &[i64]| -> Result<Vec<u64>, String> {
            shape
                .iter()
                .map(|&d| match u64::try_from(d) {
                    Ok(v) if v > 0 => Ok(v),
                    _ => Err(format!("`{key}` dimensions must be positive, got {d}")),
                })
                .collect()
        };
        let dims = positive("shape", &shape)?;
        let buffer = buffer.map(|b| positive("buffer", &b)).transpose()?;
        if let Some(b) = &buffer {
            let (n, m) = (
                dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d)),
                b.iter().try_fold(1u64, |a, &d| a.checked_mul(d)),
            );
            if combine.is_some_and(|c| c != CombineKind::Add) {
                return Err("`buffer` applies only with combine = \"add\"".into());
            }
            if n.zip(m).is_none_or(|(n, m)| n > m) {
                return Err(format!(
                    "`shape` {dims:?} holds more elements than the `buffer` {b:?} it is cropped from"
                ));
            }
        }
        if let Some(Pair(h, w)) = interpolate {
            if combine.is_some_and(|c| c != CombineKind::Add) || buffer.is_some() {
                return Err(
                    "`size` (an interpolated position table) applies only with combine = \"add\" and no `buffer`"
                        .into(),
                );
            }
            let grid = match dims.as_slice() {
                [1, n, _] => square_root(n - 1),
                _ => None,
            };
            if grid.is_none() {
                return Err(format!(
                    "`size` = [{h}, {w}] interpolates a position table of shape [1, 1 + g·g, D] (a class row and a square grid), got `shape` {dims:?}"
                ));
            }
        }
        let combine = match combine {
            Some(CombineKind::Concat) => Combine::Concat(dim.unwrap_or(1)),
            _ if dim.is_some() => {
                return Err("`dim` applies only with combine = \"concat\"".into());
            }
            Some(CombineKind::Mul) => Combine::Mul,
            Some(CombineKind::Unused) => Combine::Unused,
            Some(CombineKind::Add) | None => Combine::Add,
        };
        Ok(ParameterCfg {
            shape: dims,
            combine,
            buffer,
            interpolate,
        })
    }

    /// The side `g` of the square grid of patch rows in a `[1, 1 + g², D]` table read with
    /// `size` (checked when the config was read).
    #[must_use]
    pub fn grid_side(&self) -> Option<u64> {
        match self.shape.as_slice() {
            [1, n, _] => n.checked_sub(1).and_then(square_root),
            _ => None,
        }
    }
}

/// The whole square root of `n`, when `n` is a positive square.
fn square_root(n: u64) -> Option<u64> {
    // `isqrt` is exact on integers.
    let r = n.isqrt();
    (r > 0 && r.checked_mul(r) == Some(n)).then_some(r)
}

/// torchvision's `StochasticDepth(p, "row")`: in training multiplies by a `[B, 1, ..]` noise
/// tensor, which it keeps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StochasticDepthCfg {
    /// Drop probability.
    pub p: f64,
}

impl StochasticDepthCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = StochasticDepthCfg {
            p: r.prob(key!(s.p), 0.0),
        };
        r.finish()?;
        Ok(cfg)
    }
}

/// Multiplication by a constant (T5's `sequence_output * d_model**-0.5`, Gemma's embedding
/// normalizer), then the addition of one (`1 + scale`, diffusers' adaptive norms): a new tensor
/// per operation (`mul.Scalar`, `add.Scalar`), nothing kept.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScaleCfg {
    /// The factor (informational; finite); `None` when only `offset` is given.
    pub factor: Option<f64>,
    /// The constant added after the factor (informational; finite).
    pub offset: Option<f64>,
}

impl ScaleCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let offset = r.opt(key!(s.offset));
        let factor = if offset.is_some() {
            r.opt(key!(s.factor))
        } else {
            Some(r.req(key!(s.factor), ""))
        };
        r.finish()?;
        for (name, v) in [("factor", factor), ("offset", offset)] {
            if let Some(v) = v.filter(|v| !v.is_finite()) {
                return Err(format!("`{name}` must be a finite number, got {v}"));
            }
        }
        Ok(ScaleCfg { factor, offset })
    }
}

/// Cross-entropy loss on logits `[N, C]`, `[B, S, V]` or `[B, C, d1, …]` (classes on dimension 1,
/// as PyTorch reads rank 4 and up) against int64 labels; ends the forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CrossEntropyCfg {
    /// Shifts the labels for causal language modelling.
    pub shift: bool,
    /// Computes it on a float32 copy of the logits (transformers' `logits.float()`).
    pub upcast: bool,
}

/// Mean squared error of the input against a target of its shape
/// (`F.mse_loss(pred, target)`, `reduction="mean"`), the denoising loss of diffusion training;
/// ends the forward pass. The target is a batch input of the prediction's shape, in the model's
/// input dtype (float32 under `--amp`), as `noise = torch.randn_like(latents)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MseLossCfg {
    /// Computes it on float32 copies of a 16-bit prediction and target (diffusers' training
    /// scripts: `F.mse_loss(model_pred.float(), target.float())`).
    pub upcast: bool,
}

impl MseLossCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = MseLossCfg {
            upcast: r.or(key!(s.upcast), false),
        };
        r.finish()?;
        Ok(cfg)
    }
}

impl CrossEntropyCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = CrossEntropyCfg {
            shift: r.or(key!(s.shift), false),
            upcast: r.or(key!(s.upcast), false),
        };
        r.finish()?;
        Ok(cfg)
    }
}

/// The all-ones padding mask a DeBERTa-v2 model makes when it is given none
/// (`DebertaV2Model.forward`: `attention_mask = torch.ones(input_shape)`, float32 `[B, S]`, held
/// until the model returns) multiplied into `[B, S, H]` (`DebertaV2Embeddings`: `embeddings *
/// mask.unsqueeze(2).to(embeddings.dtype)`): the product keeps the mask (a copy in the
/// activation dtype when that is not float32). With `ids_buffer` the module also holds an int64
/// `[1, ids_buffer]` `position_ids` buffer that no position table reads
/// (`position_biased_input = false`). With `fill` the padded positions are zeroed in place
/// instead (`ConvLayer`: `out.masked_fill_(rmask.unsqueeze(-1).expand(out.size()), 0)` with
/// `rmask = (1 - input_mask).bool()`), which keeps the bool `[B, S]` mask. Every use reads the
/// same all-ones tensor. No params.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PaddingMaskCfg {
    /// Length of the unread int64 id buffer (0 for none).
    pub ids_buffer: u64,
    /// Zero the padded positions in place (`masked_fill_`) instead of multiplying.
    pub fill: bool,
}

impl PaddingMaskCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = PaddingMaskCfg {
            ids_buffer: r.or(key!(s.ids_buffer), 0),
            fill: r.or(key!(s.fill), false),
        };
        r.finish()?;
        Ok(cfg)
    }
}
