//! `upsample` (`interpolate`), `pad`.

use super::keys::{KeyReader, key};
use crate::spec::{FillMode, Pair};

/// How `upsample` sizes its output: one of `scale_factor` or `size`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UpsampleTo {
    /// Each spatial size times this factor, rounded down (`F.interpolate(scale_factor=..)`:
    /// `at::native::upsample::compute_output_size` in `aten/src/ATen/native/UpSample.cpp`
    /// converts the double `size·scale` to an integer).
    Scale(f64),
    /// This output size: `[h, w]`, or one length for a `[B, C, L]` input (`F.interpolate(size=..)`).
    Size(Pair),
}

/// `nn.Upsample` / `F.interpolate`: `[B, C, L] → [B, C, L']` or `[B, C, H, W] → [B, C, H', W']`.
/// `nearest` runs `upsample_nearest1d/2d`, `linear` `upsample_linear1d` and `bilinear`
/// `upsample_bilinear2d`. No parameters. Each saves nothing but sizes: the `upsample_*` entries of
/// PyTorch's `tools/autograd/derivatives.yaml` read only `self.sym_sizes()`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UpsampleCfg {
    /// `nearest` (default), `linear` or `bilinear`.
    pub mode: FillMode,
    /// The output's spatial size.
    pub to: UpsampleTo,
    /// `align_corners` of the interpolating modes (it does not change what is saved).
    pub align_corners: bool,
}

impl UpsampleCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let mode = r.or(key!(s.mode), FillMode::Nearest);
        let scale = r.opt(key!(s.scale_factor));
        let size = r.pair_opt(key!(s.size));
        let align_corners = r.opt(key!(s.align_corners));
        r.finish()?;
        if !matches!(
            mode,
            FillMode::Nearest | FillMode::Linear | FillMode::Bilinear
        ) {
            return Err(format!(
                "`mode` \"{}\" is not an `upsample` mode; expected \"nearest\", \"linear\" or \"bilinear\"",
                mode.as_str()
            ));
        }
        // F.interpolate: "align_corners option can only be set with the interpolating modes".
        if mode == FillMode::Nearest && align_corners.is_some() {
            return Err(
                "`align_corners` applies only to `mode = \"linear\"` or \"bilinear\"".into(),
            );
        }
        let to = match (scale, size) {
            (Some(_), Some(_)) => {
                return Err("give one of `scale_factor` and `size`, not both".into());
            }
            (None, None) => {
                return Err(
                    "missing `scale_factor` or `size` (e.g. scale_factor = 2, or size = [64, 64])"
                        .into(),
                );
            }
            (Some(f), None) if !(f.is_finite() && f > 0.0) => {
                return Err(format!("`scale_factor` must be positive, got {f}"));
            }
            (Some(f), None) => UpsampleTo::Scale(f),
            (None, Some(p)) => UpsampleTo::Size(p),
        };
        Ok(UpsampleCfg {
            mode,
            to,
            align_corners: align_corners.unwrap_or(false),
        })
    }
}

/// `F.pad(x, pad, mode, value)` (`nn.ZeroPad2d`, `nn.ReflectionPad2d`, …): each pair of `pad`
/// widens one dimension, the last first (`[left, right, top, bottom, front, back]`), as `F.pad`
/// reads it. `constant` runs `constant_pad_nd`, which saves nothing; `reflect` and `replicate`
/// run `reflection_pad{1,2,3}d` / `replication_pad{1,2,3}d`, whose backward reads `self`, so
/// they keep their input; `circular` is ATen's composite `_pad_circular`, slices copied into a
/// new tensor, which keeps nothing. No parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct PadCfg {
    /// `constant` (default), `reflect`, `replicate` or `circular`.
    pub mode: FillMode,
    /// Widths, two per padded dimension, the last dimension first.
    pub pad: Vec<u64>,
}

impl PadCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let pad = r.req(
            key!(s.pad),
            " (e.g. pad = [1, 1, 2, 2]: left, right, top, bottom)",
        );
        let mode = r.or(key!(s.mode), FillMode::Constant);
        let value = r.opt(key!(s.value));
        r.finish()?;
        if !matches!(
            mode,
            FillMode::Constant | FillMode::Reflect | FillMode::Replicate | FillMode::Circular
        ) {
            return Err(format!(
                "`mode` \"{}\" is not a `pad` mode; expected \"constant\", \"reflect\", \"replicate\" or \"circular\"",
                mode.as_str()
            ));
        }
        // F.pad: "Padding mode \"..\" doesn't take in value argument".
        if mode != FillMode::Constant && value.is_some() {
            return Err("`value` applies only to `mode = \"constant\"`".into());
        }
        if pad.is_empty() || !pad.len().is_multiple_of(2) {
            return Err(format!(
                "`pad` needs two widths per padded dimension (last dimension first), got {}",
                crate::units::count(pad.len() as u64, "value")
            ));
        }
        if mode != FillMode::Constant && pad.len() > 6 {
            return Err(format!(
                "`mode = \"{}\"` pads at most 3 dimensions (6 widths), got {}",
                mode.as_str(),
                pad.len()
            ));
        }
        Ok(PadCfg { mode, pad })
    }
}
