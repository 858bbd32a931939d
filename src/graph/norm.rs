//! `batchnorm1d/2d`, `layernorm`, `rmsnorm`, `groupnorm`.

use super::keys::{KeyReader, key};
use crate::spec::{LayerKind, Style};

/// `nn.BatchNorm1d/2d` over dimension 1: params `2C` (weight, bias), buffers running mean and
/// variance (`2C`) and an int64 `num_batches_tracked`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchNormCfg {
    /// 1 (`batchnorm1d`: `[B, C]` or `[B, C, L]`) or 2 (`batchnorm2d`: `[B, C, H, W]`).
    pub spatial: usize,
    /// Expected channels, checked when given.
    pub num_features: Option<u64>,
    /// Has weight and bias.
    pub affine: bool,
    /// Keeps running statistics (buffers).
    pub track_running_stats: bool,
}

impl BatchNormCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = BatchNormCfg {
            spatial: if r.kind() == LayerKind::BatchNorm1d {
                1
            } else {
                2
            },
            num_features: r.pos_opt(key!(s.num_features)),
            affine: r.or(key!(s.affine), true),
            track_running_stats: r.or(key!(s.track_running_stats), true),
        };
        r.finish()?;
        Ok(cfg)
    }
}

/// `nn.LayerNorm` over the last dimension: params `2·H` (or `H` without bias).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerNormCfg {
    /// Has weight (and bias).
    pub affine: bool,
    /// Has a bias.
    pub bias: bool,
    /// Normalizes a float32 copy of a 16-bit input and casts the result back (OLMo's
    /// `OlmoLayerNorm`: `F.layer_norm(x.to(torch.float32), ..).to(orig_dtype)`).
    pub upcast: bool,
    /// transformers' `CohereLayerNorm` (`style = "cohere"`, `models/cohere/modeling_cohere.py`):
    /// not `native_layer_norm` but its formula op by op on a float32 copy, `h - mean` (kept by
    /// `pow`), `rsqrt(var + eps)` (kept), `(h - mean) * rstd` (a second difference, kept with
    /// the rstd), times the float32 weight (both kept), cast back; a weight and no bias.
    pub cohere: bool,
}

impl LayerNormCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let style = r.opt(key!(s.style));
        let cohere = match style {
            None => false,
            Some(Style::Cohere) => true,
            Some(other) => {
                return Err(format!(
                    "`style` value `{}` does not apply to `layernorm`, expected \"cohere\"",
                    other.as_str()
                ));
            }
        };
        let cfg = LayerNormCfg {
            affine: r.or(key!(s.affine), true),
            bias: r.or(key!(s.bias), !cohere),
            upcast: r.or(key!(s.upcast), false),
            cohere,
        };
        r.finish()?;
        if cohere && (cfg.bias || !cfg.affine || cfg.upcast) {
            return Err(
                "`style = \"cohere\"` has a weight and no bias and always computes in float32: it takes neither `bias = true`, `affine = false` nor `upcast`"
                    .into(),
            );
        }
        Ok(cfg)
    }
}

/// Which transformers RMSNorm an `rmsnorm` layer follows (`style`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RmsStyle {
    /// `LlamaRMSNorm` (Llama, Mistral, Qwen, Phi-3, Mixtral).
    Llama,
    /// `T5LayerNorm`.
    T5,
    /// `GemmaRMSNorm`.
    Gemma,
    /// `Olmo2RMSNorm`: the weight times the float32 normalized input, then cast back
    /// (`(w * x.float() * rsqrt(mean(x²) + eps)).to(x.dtype)`).
    Olmo2,
    /// PyTorch's `nn.RMSNorm` (`F.rms_norm`, diffusers' Flux attention): on the CPU ATen's
    /// composite `rms_norm`, which computes as `Olmo2RMSNorm` does; on CUDA the fused
    /// `_fused_rms_norm` kernel, which keeps the input, the weight and a float32 `rstd`
    /// `[.., 1]` (`aten/src/ATen/native/layer_norm.cpp`, `derivatives.yaml`).
    Torch,
}

/// RMSNorm over the last dimension as transformers computes it; params `H`.
/// `LlamaRMSNorm` (default): upcast to float32, `h·rsqrt(mean(h²)+ε)`, back to the input dtype,
/// times weight. `T5LayerNorm` (`style = "t5"`): the variance from a float32 copy, but
/// `x·rsqrt(..)` on the input itself, cast to a 16-bit weight's dtype, times weight.
/// `GemmaRMSNorm` (`style = "gemma"`): all in float32, times `(1 + weight)`, cast back.
/// `Olmo2RMSNorm` (`style = "olmo2"`): the weight times the float32 normalized input, cast
/// back. `nn.RMSNorm` (`style = "torch"`): as `olmo2` on the CPU, one fused kernel on CUDA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RmsNormCfg {
    /// Which implementation.
    pub style: RmsStyle,
}

impl RmsNormCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let style = r.opt(key!(s.style));
        r.finish()?;
        let style = match style {
            None | Some(Style::Llama) => RmsStyle::Llama,
            Some(Style::T5) => RmsStyle::T5,
            Some(Style::Gemma) => RmsStyle::Gemma,
            Some(Style::Olmo2) => RmsStyle::Olmo2,
            Some(Style::Torch) => RmsStyle::Torch,
            Some(other) => {
                return Err(format!(
                    "`style` value `{}` does not apply to `rmsnorm`, expected \"llama\", \"t5\", \"gemma\", \"olmo2\" or \"torch\"",
                    other.as_str()
                ));
            }
        };
        Ok(RmsNormCfg { style })
    }
}

/// `nn.GroupNorm` over dimension 1: params `2C`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupNormCfg {
    /// Number of groups (must divide C; key `num_groups`).
    pub groups: u64,
    /// Has weight and bias.
    pub affine: bool,
}

impl GroupNormCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = GroupNormCfg {
            groups: r.pos(key!(s.num_groups)),
            affine: r.or(key!(s.affine), true),
        };
        r.finish()?;
        Ok(cfg)
    }
}
