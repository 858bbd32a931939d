//! `conv1d`, `conv2d`, `conv3d`, `conv_transpose1d`, `conv_transpose2d`, `conv_transpose3d`.

use super::keys::{KeyReader, key};
use crate::spec::{LayerKind, Sizes};

/// `nn.Conv1d`/`2d`/`3d` and `nn.ConvTranspose1d`/`2d`/`3d`:
/// `[B, Cin, (D, H,) W] → [B, Cout, (D', H',) W']`, each spatial size from [`ConvAxis`] (the shapes
/// `torch/nn/modules/conv.py` documents). Params `Cout·Cin/groups·∏k (+ Cout)`: the weight is
/// `[Cout, Cin/groups, k..]`, or `[Cin, Cout/groups, k..]` when transposed (`_ConvNd` with
/// `transposed=True`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConvCfg {
    /// A transposed convolution (`conv_transpose1d/2d/3d`).
    pub transposed: bool,
    /// Expected input channels, checked when given.
    pub in_channels: Option<u64>,
    /// Output channels.
    pub out_channels: u64,
    /// One entry per spatial dimension, outermost first (`[h, w]` for 2-D, `[d, h, w]` for 3-D).
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
            LayerKind::ConvTranspose1d | LayerKind::ConvTranspose2d | LayerKind::ConvTranspose3d
        );
        let spatial = match kind {
            LayerKind::Conv1d | LayerKind::ConvTranspose1d => 1,
            LayerKind::Conv3d | LayerKind::ConvTranspose3d => 3,
            _ => 2,
        };
        let in_channels = r.pos_opt(key!(s.in_channels));
        let out_channels = r.pos(key!(s.out_channels));
        let kernel = r.opt(key!(s.kernel));
        if kernel.is_none() {
            r.fail("missing `kernel`".into());
        }
        let stride = r.opt(key!(s.stride));
        let padding = r.opt(key!(s.padding));
        let output_padding = if transposed {
            r.opt(key!(s.output_padding))
        } else {
            None
        };
        let dilation = r.opt(key!(s.dilation));
        let groups = r.pos_or(key!(s.groups), 1);
        let bias = r.or(key!(s.bias), true);
        r.finish()?;
        // Each key as one size per spatial dimension: one number is every dimension's.
        let per_axis = |name: &str,
                        v: Option<Sizes>,
                        default: u64,
                        positive: bool|
         -> Result<Vec<u64>, String> {
            let v = v.map_or_else(|| vec![default], |s| s.0);
            let out = match v.as_slice() {
                [one] => vec![*one; spatial],
                // `conv1d` accepts a pair of equal sizes.
                [a, b] if spatial == 1 && a == b => vec![*a],
                many if many.len() == spatial => many.to_vec(),
                many => {
                    let takes = match spatial {
                        1 => "one",
                        2 => "one or [h, w]",
                        _ => "one or [d, h, w]",
                    };
                    let list: Vec<String> = many.iter().map(u64::to_string).collect();
                    return Err(format!(
                        "`{name}` [{}] gives {} sizes; `{kind}` takes {takes}",
                        list.join(", "),
                        if many.len() == 2 { "two" } else { "three" }
                    ));
                }
            };
            if positive && out.contains(&0) {
                let list: Vec<String> = v.iter().map(u64::to_string).collect();
                return Err(format!(
                    "`{name}` must be positive, got [{}]",
                    list.join(", ")
                ));
            }
            Ok(out)
        };
        let kernel = per_axis("kernel", kernel, 1, true)?;
        let stride = per_axis("stride", stride, 1, true)?;
        let padding = per_axis("padding", padding, 0, false)?;
        let output_padding = per_axis("output_padding", output_padding, 0, false)?;
        let dilation = per_axis("dilation", dilation, 1, true)?;
        let axes: Vec<ConvAxis> = (0..spatial)
            .map(|i| ConvAxis {
                kernel: kernel[i],
                stride: stride[i],
                padding: padding[i],
                dilation: dilation[i],
                output_padding: output_padding[i],
            })
            .collect();
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
            let list: Vec<String> = output_padding.iter().map(u64::to_string).collect();
            return Err(format!(
                "`output_padding` [{}] must be smaller than `stride` or `dilation`",
                list.join(", ")
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
    use crate::spec::layer_spec;
    use crate::spec::{LayerSpec, Pair};

    fn read(s: &LayerSpec) -> Result<ConvCfg, String> {
        ConvCfg::read(&mut KeyReader::new(s, "c"))
    }

    fn spec(kind: LayerKind) -> LayerSpec {
        layer_spec! {
            kind: kind,
            out_channels: Some(6),
            kernel: Some(Pair(3, 3).into()),
            ..LayerSpec::default()
        }
    }

    #[test]
    fn one_axis_per_spatial_dimension() {
        assert_eq!(read(&spec(LayerKind::Conv1d)).unwrap().axes.len(), 1);
        let c = read(&layer_spec! {
            kernel: Some(Pair(3, 5).into()),
            ..spec(LayerKind::Conv2d)
        })
        .unwrap();
        assert_eq!((c.axes[0].kernel, c.axes[1].kernel), (3, 5));
        let e = read(&layer_spec! {
            kernel: Some(Pair(3, 5).into()),
            ..spec(LayerKind::Conv1d)
        })
        .unwrap_err();
        assert_eq!(e, "`kernel` [3, 5] gives two sizes; `conv1d` takes one");
    }

    #[test]
    fn output_padding_is_transposed_only_and_below_the_stride() {
        let e = read(&layer_spec! {
            output_padding: Some(Pair(1, 1).into()),
            ..spec(LayerKind::Conv2d)
        })
        .unwrap_err();
        assert!(
            e.starts_with("key `output_padding` does not apply to `conv2d`"),
            "{e}"
        );
        let ok = layer_spec! {
            stride: Some(Pair(2, 2).into()),
            output_padding: Some(Pair(1, 1).into()),
            ..spec(LayerKind::ConvTranspose2d)
        };
        let c = read(&ok).unwrap();
        assert!(c.transposed);
        assert_eq!(c.axes[0].output_padding, 1);
        let too_big = layer_spec! {
            output_padding: Some(Pair(2, 2).into()),
            ..ok
        };
        assert!(read(&too_big).is_err());
    }
}
