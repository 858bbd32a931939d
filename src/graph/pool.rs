//! `maxpool2d`, `avgpool2d`, `adaptive_avgpool2d`.

use super::keys::{KeyReader, key};
use crate::spec::Pair;

/// `nn.MaxPool2d`: keeps its input and int64 indices of the output's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaxPool2dCfg {
    /// Window.
    pub kernel: Pair,
    /// Stride (defaults to the window).
    pub stride: Pair,
    /// Padding (at most half the window).
    pub padding: Pair,
    /// Dilation.
    pub dilation: Pair,
    /// Round output sizes up.
    pub ceil_mode: bool,
}

impl MaxPool2dCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let kernel = r.win(key!(s.kernel));
        let cfg = MaxPool2dCfg {
            kernel,
            stride: r.win_or(key!(s.stride), kernel),
            padding: r.win0(key!(s.padding), Pair(0, 0)),
            dilation: r.win_or(key!(s.dilation), Pair(1, 1)),
            ceil_mode: r.or(key!(s.ceil_mode), false),
        };
        r.finish()?;
        pool_padding(cfg.kernel, cfg.padding)?;
        Ok(cfg)
    }
}

/// `nn.AvgPool2d`: keeps its input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AvgPool2dCfg {
    /// Window.
    pub kernel: Pair,
    /// Stride (defaults to the window).
    pub stride: Pair,
    /// Padding (at most half the window).
    pub padding: Pair,
    /// Round output sizes up.
    pub ceil_mode: bool,
}

impl AvgPool2dCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let kernel = r.win(key!(s.kernel));
        let cfg = AvgPool2dCfg {
            kernel,
            stride: r.win_or(key!(s.stride), kernel),
            padding: r.win0(key!(s.padding), Pair(0, 0)),
            ceil_mode: r.or(key!(s.ceil_mode), false),
        };
        r.finish()?;
        pool_padding(cfg.kernel, cfg.padding)?;
        Ok(cfg)
    }
}

/// `nn.AdaptiveAvgPool2d(output_size)`: `(1, 1)` runs as a mean and keeps nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdaptiveAvgPool2dCfg {
    /// Output `(h, w)` (key `output_size`, default 1).
    pub output: Pair,
}

impl AdaptiveAvgPool2dCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = AdaptiveAvgPool2dCfg {
            output: r.pair_or(key!(s.output_size), Pair(1, 1)),
        };
        r.finish()?;
        Ok(cfg)
    }
}

/// PyTorch's pooling requires `padding <= kernel / 2`.
fn pool_padding(kernel: Pair, p: Pair) -> Result<(), String> {
    if p.0 > kernel.0 / 2 || p.1 > kernel.1 / 2 {
        return Err(format!(
            "`padding` must be at most half the kernel (kernel [{}, {}], padding [{}, {}])",
            kernel.0, kernel.1, p.0, p.1
        ));
    }
    Ok(())
}
