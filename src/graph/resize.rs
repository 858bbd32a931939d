//! `upsample` (`interpolate`), `pad`.

use super::keys::{KeyReader, key};
use crate::spec::{FillMode, Pair};

/// How `upsample` sizes its output: one of `scale_factor` or `size`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UpsampleTo {
    /// Each spatial size times this factor, rounded down (`F.interpolate(scale_factor=..)`:
    /// `upsample_compute_output_size` in ATen's `UpSample.h` truncates `size·scale`).
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
