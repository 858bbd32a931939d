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
        // One axis from the first (height) or the second (width, or the only) size of each key.
        let axis = |pick: fn(Pair) -> u64| ConvAxis {
            kernel: pick(kernel),
            stride: pick(stride),
            padding: pick(padding),
            dilation: pick(dilation),
            output_padding: pick(output_padding),
        };
        let axes = if spatial == 1 {
            // One size: `kernel = 3` (or a pair of equal sizes).
            if let Some((name, p)) = named.iter().find(|(_, p)| p.0 != p.1) {
                return Err(format!(
                    "`{name}` [{}, {}] gives two sizes; `{kind}` takes one",
                    p.0, p.1
                ));
            }
            vec![axis(|p| p.1)]
        } else {
            vec![axis(|p| p.0), axis(|p| p.1)]
        };
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::LayerSpec;

    fn read(s: &LayerSpec) -> Result<ConvCfg, String> {
        ConvCfg::read(&mut KeyReader::new(s, "c"))
    }

    fn spec(kind: LayerKind) -> LayerSpec {
        LayerSpec {
            kind,
            out_channels: Some(6),
            kernel: Some(Pair(3, 3)),
            ..LayerSpec::default()
        }
    }

    #[test]
    fn one_axis_per_spatial_dimension() {
        assert_eq!(read(&spec(LayerKind::Conv1d)).unwrap().axes.len(), 1);
        let c = read(&LayerSpec {
            kernel: Some(Pair(3, 5)),
            ..spec(LayerKind::Conv2d)
        })
        .unwrap();
        assert_eq!((c.axes[0].kernel, c.axes[1].kernel), (3, 5));
        let e = read(&LayerSpec {
            kernel: Some(Pair(3, 5)),
            ..spec(LayerKind::Conv1d)
        })
        .unwrap_err();
        assert_eq!(e, "`kernel` [3, 5] gives two sizes; `conv1d` takes one");
    }

    #[test]
    fn output_padding_is_transposed_only_and_below_the_stride() {
        let e = read(&LayerSpec {
            output_padding: Some(Pair(1, 1)),
            ..spec(LayerKind::Conv2d)
        })
        .unwrap_err();
        assert!(
            e.starts_with("key `output_padding` does not apply to `conv2d`"),
            "{e}"
        );
        let ok = LayerSpec {
            stride: Some(Pair(2, 2)),
            output_padding: Some(Pair(1, 1)),
            ..spec(LayerKind::ConvTranspose2d)
        };
        let c = read(&ok).unwrap();
        assert!(c.transposed);
        assert_eq!(c.axes[0].output_padding, 1);
        let too_big = LayerSpec {
            output_padding: Some(Pair(2, 2)),
            ..ok
        };
        assert!(read(&too_big).is_err());
    }
}
