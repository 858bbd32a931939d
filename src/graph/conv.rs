//! `conv1d`, `conv2d`, `conv_transpose1d`, `conv_transpose2d`.

use super::keys::{KeyReader, key};
use crate::spec::{LayerKind, Pair};

/// `nn.Conv1d`/`nn.Conv2d` and `nn.ConvTranspose1d`/`nn.ConvTranspose2d`:
/// `[B, Cin, (H,) W] → [B, Cout, (H',) W']`, each spatial size from [`ConvAxis`] (the shapes
/// `torch/nn/modules/conv.py` documents). Params `Cout·Cin/groups·∏k (+ Cout)`: the weight is
/// `[Cout, Cin/groups, k..]`, or `[Cin, Cout/groups, k..]` when transposed (`_ConvNd` with
/// `transposed=True`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConvCfg {
    /// A transposed convolution (`conv_transpose1d/2d`).
    pub transposed: bool,
    /// Expected input channels, checked when given.
    pub in_channels: Option<u64>,
    /// Output channels.
    pub out_channels: u64,
    /// One entry per spatial dimension, outermost first (`[h, w]` for 2-D).
    pub axes: Vec<ConvAxis>,
    /// Groups (`Cin` for depthwise).
    pub groups: u64,
    /// Has a bias.
    pub bias: bool,
}

/// The window along one spatial dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvAxis {
    /// Kernel size k.
    pub kernel: u64,
    /// Stride s.
    pub stride: u64,
    /// Zero padding p on each side.
    pub padding: u64,
    /// Dilation d.
    pub dilation: u64,
    /// Extra size on one side of a transposed convolution's output (0 otherwise).
    pub output_padding: u64,
}

impl ConvCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let kind = r.kind();
        let transposed = matches!(
            kind,
            LayerKind::ConvTranspose1d | LayerKind::ConvTranspose2d
        );
        let spatial = if matches!(kind, LayerKind::Conv1d | LayerKind::ConvTranspose1d) {
            1
        } else {
            2
        };
        let in_channels = r.pos_opt(key!(s.in_channels));
        let out_channels = r.pos(key!(s.out_channels));
        let kernel = r.pair(key!(s.kernel));
        let stride = r.pair_or(key!(s.stride), Pair(1, 1));
        let padding = r.or(key!(s.padding), Pair(0, 0));
        let output_padding = if transposed {
            r.or(key!(s.output_padding), Pair(0, 0))
        } else {
            Pair(0, 0)
        };
        let dilation = r.pair_or(key!(s.dilation), Pair(1, 1));
        let groups = r.pos_or(key!(s.groups), 1);
        let bias = r.or(key!(s.bias), true);
        r.finish()?;
        let named = [
            ("kernel", kernel),
            ("stride", stride),
            ("padding", padding),
            ("output_padding", output_padding),
            ("dilation", dilation),
        ];
        let mut axes = Vec::with_capacity(spatial);
        if spatial == 1 {
            // One size: `kernel = 3` (or a pair of equal sizes).
            if let Some((name, p)) = named.iter().find(|(_, p)| p.0 != p.1) {
                return Err(format!(
                    "`{name}` [{}, {}] gives two sizes; `{kind}` takes one",
                    p.0, p.1
                ));
            }
            axes.push(axis(
                kernel.1,
                stride.1,
                padding.1,
                dilation.1,
                output_padding.1,
            ));
        } else {
            axes.push(axis(
                kernel.0,
                stride.0,
                padding.0,
                dilation.0,
                output_padding.0,
            ));
            axes.push(axis(
                kernel.1,
                stride.1,
                padding.1,
                dilation.1,
                output_padding.1,
            ));
        }
        if !out_channels.is_multiple_of(groups) {
            return Err(format!(
                "`out_channels` ({out_channels}) must be divisible by `groups` ({groups})"
            ));
        }
        // torch.nn.modules.conv._ConvTransposeNd._output_padding.
        if axes
            .iter()
            .any(|a| a.output_padding >= a.stride.max(a.dilation))
        {
            return Err(format!(
                "`output_padding` [{}, {}] must be smaller than `stride` or `dilation`",
                output_padding.0, output_padding.1
            ));
        }
        Ok(ConvCfg {
            transposed,
            in_channels,
            out_channels,
            axes,
            groups,
            bias,
        })
    }
}

fn axis(kernel: u64, stride: u64, padding: u64, dilation: u64, output_padding: u64) -> ConvAxis {
    ConvAxis {
        kernel,
        stride,
        padding,
        dilation,
        output_padding,
    }
}
