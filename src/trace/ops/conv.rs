//! `conv1d`, `conv2d`, `conv_transpose1d`, `conv_transpose2d`.

#[allow(clippy::wildcard_imports)]
use super::*;
use crate::graph::{ConvAxis, ConvCfg};

/// `[B, Cin, (H,) W] → [B, Cout, (H',) W']`. Each spatial size follows `torch.nn.Conv*d`:
/// `H' = floor((H + 2p − d(k − 1) − 1)/s) + 1`, or for a transposed convolution
/// (`torch.nn.ConvTranspose*d`) `H' = (H − 1)·s − 2p + d(k − 1) + output_padding + 1`.
pub(super) fn out_shape(c: &ConvCfg, x: &Shape) -> Result<Shape, ShapeError> {
    let d = x.dims();
    let spatial = c.axes.len();
    if d.len() != spatial + 2 {
        return wrong_rank(
            x,
            format!(
                "rank {} [batch, channels, {}]",
                spatial + 2,
                match spatial {
                    1 => "length",
                    2 => "height, width",
                    _ => "depth, height, width",
                }
            ),
        );
    }
    let cin = d[1];
    if let Some(expected) = c.in_channels.filter(|&e| e != cin) {
        return wrong_size(x, "channels", cin, "in_channels", expected);
    }
    if !cin.is_multiple_of(c.groups) {
        return invalid(format!(
            "input channels ({cin}) must be divisible by groups ({})",
            c.groups
        ));
    }
    let mut out = vec![d[0], c.out_channels];
    for (&len, a) in d[2..].iter().zip(&c.axes) {
        out.push(if c.transposed {
            transposed_len(len, a, x)?
        } else {
            window_out(len, a.kernel, a.stride, a.padding, a.dilation, false, x)?
        });
    }
    Ok(Shape::new(out))
}

/// `(len − 1)·s − 2p + d(k − 1) + output_padding + 1` (`torch.nn.ConvTranspose2d`'s shape).
fn transposed_len(len: u64, a: &ConvAxis, x: &Shape) -> Result<u64, ShapeError> {
    let full = len
        .saturating_sub(1)
        .checked_mul(a.stride)
        .and_then(|v| v.checked_add(a.dilation.checked_mul(a.kernel.saturating_sub(1))?))
        .and_then(|v| v.checked_add(a.output_padding)?.checked_add(1));
    let full = sized(full, "a transposed convolution's size")?;
    let pad = sized(a.padding.checked_mul(2), "a padded size")?;
    if full <= pad {
        return invalid(format!(
            "input {x} is too small: the transposed convolution's output ({full} before padding) does not exceed 2×{} padding",
            a.padding
        ));
    }
    Ok(full - pad)
}

/// The weight: `[Cout, Cin/groups, k..]`, or `[Cin, Cout/groups, k..]` when transposed.
pub(super) fn weight_shape(c: &ConvCfg, cin: u64) -> Shape {
    let mut w = if c.transposed {
        vec![cin, c.out_channels / c.groups]
    } else {
        vec![c.out_channels, cin / c.groups]
    };
    w.extend(c.axes.iter().map(|a| a.kernel));
    Shape::new(w)
}

impl Tracer<'_> {
    /// `aten::convolution` (plain or transposed; `F.conv_transpose2d` runs it with
    /// `transposed=True`): the `convolution` entry of PyTorch's
    /// `tools/autograd/derivatives.yaml` computes all three gradients with
    /// `convolution_backward(grad, input, weight, ..)`, so it saves the input and the weight.
    pub(super) fn conv(&mut self, c: &ConvCfg, x: ValueId, train: bool) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let out = self.shaped(out_shape(c, &xv.shape))?;
        let w = self.param(weight_shape(c, xv.shape.dims()[1]), train)?;
        let b = if c.bias {
            Some(self.param(Shape::from([c.out_channels]), train)?)
        } else {
            None
        };
        let xc = self.autocast_input(x)?;
        let wc = self.autocast_input(w)?;
        let bc = match b {
            Some(b) => Some(self.autocast_input(b)?),
            None => None,
        };
        let dtype = self.val(xc).dtype;
        let rg = self.rg(xc) || self.rg(wc);
        let y = self.fresh(out, dtype, "output", rg)?;
        let mut ins = vec![xc, wc];
        ins.extend(bc);
        // The CPU kernels (oneDNN) reorder the input into a blocked layout: a transient copy of
        // it (measured: about one input's size for 1×1, 3×3, 7×7 and depthwise convolutions).
        // Transposed ones do the same (measured with PyTorch 2.15 on [2, 64, 32, 32] into
        // ConvTranspose2d(64, 32, 3, stride=2): a 524,288-byte input copy) and also take a
        // scratchpad (618,672 bytes there; about one output's size), which is not modelled.
        let mut allocs = Vec::new();
        if self.s.device == Device::Cpu {
            let xs = self.val(xc).shape.clone();
            allocs.push(self.storage(&xs, dtype, StorageKind::Activation, "reordered input")?);
        }
        // On CUDA, with `--cudnn-workspace`: cuDNN's workspace, taken from the caching allocator
        // for the call and freed after it (`run_conv_plan`, Conv_v8.cpp), in the forward and in
        // each of the backward's data and weight convolutions, which run one after the other.
        let workspace = match self.s.cudnn_workspace {
            Some(ws) if self.s.device == Device::Cuda => vec![ws],
            _ => Vec::new(),
        };
        self.call(
            Call::new(AtenOp::Convolution, ins, vec![y])
                .allocs(allocs)
                .scratch(workspace.clone(), workspace),
        )?;
        Ok(y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(transposed: bool, groups: u64, axes: &[(u64, u64, u64, u64, u64)]) -> ConvCfg {
        ConvCfg {
            transposed,
            in_channels: None,
            out_channels: 6,
            axes: axes
                .iter()
                .map(
                    |&(kernel, stride, padding, dilation, output_padding)| ConvAxis {
                        kernel,
                        stride,
                        padding,
                        dilation,
                        output_padding,
                    },
                )
                .collect(),
            groups,
            bias: true,
        }
    }

    #[test]
    fn conv2d_shape() {
        // (8 + 2·2 − 2·2 − 1)/1 + 1 = 8.
        let c = cfg(false, 2, &[(3, 1, 2, 2, 0), (3, 1, 2, 2, 0)]);
        let x = Shape::from([2, 4, 8, 8]);
        assert_eq!(out_shape(&c, &x), Ok(Shape::from([2, 6, 8, 8])));
        assert_eq!(weight_shape(&c, 4), Shape::from([6, 2, 3, 3]));
    }

    #[test]
    fn conv_transpose2d_shape() {
        // (5 − 1)·2 − 2·1 + 1·(3 − 1) + 1 + 1 = 10.
        let c = cfg(true, 2, &[(3, 2, 1, 1, 1), (3, 2, 1, 1, 1)]);
        let x = Shape::from([2, 4, 5, 5]);
        assert_eq!(out_shape(&c, &x), Ok(Shape::from([2, 6, 10, 10])));
        assert_eq!(weight_shape(&c, 4), Shape::from([4, 3, 3, 3]));
    }

    #[test]
    fn conv_transpose1d_shape() {
        // (8 − 1)·1 + 2·(4 − 1) + 1 = 14; with padding 7 nothing is left.
        let x = Shape::from([2, 4, 8]);
        assert_eq!(
            out_shape(&cfg(true, 1, &[(4, 1, 0, 2, 0)]), &x),
            Ok(Shape::from([2, 6, 14]))
        );
        assert!(out_shape(&cfg(true, 1, &[(4, 1, 7, 2, 0)]), &x).is_err());
    }

    #[test]
    fn rank_channels_and_groups_are_checked() {
        let c = cfg(false, 4, &[(3, 1, 0, 1, 0)]);
        assert!(out_shape(&c, &Shape::from([2, 4, 8, 8])).is_err());
        assert!(out_shape(&c, &Shape::from([2, 6, 8])).is_err());
        assert_eq!(
            out_shape(&c, &Shape::from([2, 8, 8])),
            Ok(Shape::from([2, 6, 6]))
        );
    }
}
