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

/// oneDNN's channel block on the CPU: 16 `float32` lanes of an AVX-512 register, what the
/// x86 servers memest's CPU figures were measured on pick (PyTorch 2.15 with oneDNN 3.13.3 on
/// an AVX-512 AMD EPYC: `ONEDNN_VERBOSE=1` lists `aBcd16b` activations and `ABcd16b16a`
/// weights). Under AVX2 oneDNN picks 8-channel blocks (`aBcd8b`); a GPU has no such layouts.
/// The block decides how far a channel count is padded (8 output channels take 16 in a
/// 16-channel block); channel counts that are multiples of 16 are padded by neither.
pub const ONEDNN_BLOCK: u64 = 16;

/// One `aten::mkldnn_convolution` call as its reorders see it: sizes in elements, `dtype` for
/// the bytes of each. Built by [`OnednnConv::new`] for a plain (not transposed) convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OnednnConv {
    /// Batch.
    pub n: u64,
    /// Input channels.
    pub cin: u64,
    /// Output channels.
    pub cout: u64,
    /// Groups.
    pub groups: u64,
    /// Product of the input's spatial sizes.
    pub in_spatial: u64,
    /// Product of the output's spatial sizes.
    pub out_spatial: u64,
    /// Product of the kernel's sizes.
    pub kernel: u64,
    /// Every kernel size is at most 3.
    pub small_kernel: bool,
    /// Every kernel size is 1.
    pub one_by_one: bool,
    /// Any stride is not 1.
    pub strided: bool,
    /// Any dilation is not 1.
    pub dilated: bool,
    /// The last two kernel sizes both exceed 3.
    pub large_kernel: bool,
    /// The element type.
    pub dtype: DType,
    /// The input is channels-last ([`Layout::ChannelsLast`]): PyTorch then passes input and
    /// output to oneDNN as they are (`mkldnn_conv_use_channels_last`).
    pub channels_last: bool,
}

/// Which gradients a convolution's backward returns (`output_mask` of
/// `convolution_backward`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OnednnGrads {
    /// The input's.
    pub input: bool,
    /// The weight's.
    pub weight: bool,
    /// The bias's.
    pub bias: bool,
}

impl OnednnConv {
    /// From a convolution's config, its input and output shapes (`[B, C, spatial..]`) and its
    /// compute dtype; `None` when a product overflows.
    pub(crate) fn new(c: &ConvCfg, x: &Shape, y: &Shape, dtype: DType) -> Option<OnednnConv> {
        let (xd, yd) = (x.dims(), y.dims());
        let prod = |d: &[u64]| d.iter().try_fold(1u64, |a, &b| a.checked_mul(b));
        Some(OnednnConv {
            n: *xd.first()?,
            cin: *xd.get(1)?,
            cout: *yd.get(1)?,
            groups: c.groups,
            in_spatial: prod(xd.get(2..)?)?,
            out_spatial: prod(yd.get(2..)?)?,
            kernel: c
                .axes
                .iter()
                .try_fold(1u64, |a, x| a.checked_mul(x.kernel))?,
            small_kernel: c.axes.iter().all(|a| a.kernel <= 3),
            one_by_one: c.axes.iter().all(|a| a.kernel == 1),
            strided: c.axes.iter().any(|a| a.stride != 1),
            dilated: c.axes.iter().any(|a| a.dilation != 1),
            large_kernel: c.axes.len() >= 2 && c.axes.iter().rev().take(2).all(|a| a.kernel > 3),
            dtype,
            channels_last: false,
        })
    }

    /// Whether PyTorch runs it through oneDNN: `ConvParams::use_mkldnn`
    /// (`aten/src/ATen/native/Convolution.cpp`): bfloat16 always (on a CPU with AVX-512
    /// BF16 support, `mkldnn_bf16_device_check`); float32 when
    /// `(strided || dilated || batch ≥ 16 || kernel not 1×1 || threads > 1) && (groups > 1 ||
    /// both kernel sizes > 3 || batch > 1 || input elements > 20480)`, taking more than one
    /// thread (PyTorch's default on any multi-core CPU). Other dtypes take the native kernels,
    /// which make none of these copies.
    pub(crate) fn uses_onednn(&self) -> bool {
        let numel = self
            .n
            .checked_mul(self.cin)
            .and_then(|v| v.checked_mul(self.in_spatial));
        match self.dtype {
            DType::Bfloat16 => true,
            DType::Float32 => {
                let threads_gt_1 = true;
                (self.strided || self.dilated || self.n >= 16 || !self.one_by_one || threads_gt_1)
                    && (self.groups > 1
                        || self.large_kernel
                        || self.n > 1
                        || numel.is_none_or(|v| v > 20_480))
            }
            _ => false,
        }
    }
}

/// What oneDNN's reorders hold at a convolution's busiest moments, in bytes beyond what the
/// step's own tensors count: `(forward, backward)`, where forward is beside the output and
/// backward beside the gradients returned (the replay's [`Step::scratch`] figures).
///
/// PyTorch hands oneDNN plain `NCHW` tensors and lets it pick its layouts
/// (`aten/src/ATen/native/mkldnn/Conv.cpp`, Note [MKLDNN Convolution Memory Formats]: input,
/// weight and output are reordered between `NCHW` and a blocked layout; ideep makes each
/// reordered tensor through PyTorch's CPU allocator). Measured with PyTorch 2.15's profiler
/// memory events (oneDNN 3.13.3, AVX-512), each call runs, in this order:
/// - forward (`mkldnn_convolution`): the input reordered (`x_b`; not for a first convolution
///   of at most 3 input channels and one group, which oneDNN reads plain), the weight (`w_b`)
///   and the blocked output (`y_b`) live together; then `x_b`, `w_b` go, the plain output is
///   made (`mkldnn_to_dense`) and `y_b` goes: `max(x_b + w_b + y_b, y_b + y)`;
/// - backward data (`mkldnn_convolution_backward_input`, when the input needs a gradient):
///   the output gradient reordered (`gy_b`), the weight, the blocked input gradient (`gx_b`);
///   then `gx_b` beside the plain input gradient `gx`: `max(gy_b + w_b + gx_b, gx_b + gx)`;
/// - backward weights (`mkldnn_convolution_backward_weights`), with `gx` held:
///   `gy_b + x_b + gw_b + gb` (reordered again), then the blocked weight and bias gradients
///   beside their plain copies: `gw_b + gb + gw + gb`. For a grouped convolution that is not
///   depthwise with kernels of at most 3, oneDNN computes the weight gradient on plain
///   tensors (an im2col GEMM): no reorders there, `gw_b` the weight's size.
///
/// Blocked sizes pad the channel counts to `block` ([`ONEDNN_BLOCK`]): `x_b` is
/// `B·pad(Cin)·spatial`, `y_b` and `gy_b` `B·pad(Cout)·spatial'`, the weight
/// `pad(Cout)·pad(Cin)·∏k` for one group (Cin unpadded for a first convolution), `pad(C)·∏k`
/// depthwise, and its own size for other groupings. Not modelled: oneDNN's scratchpads
/// (per-thread reduction buffers, im2col columns: e.g. 12,544 B in the backward weights of a
/// 32 → 8 channel 3×3 convolution on a 4×32×12×12 input with two threads), and the extra
/// input-gradient copy of strided backward data (`brgconv_strided`). Returns `None` on
/// overflow.
pub(crate) fn onednn_transients(
    c: &OnednnConv,
    block: u64,
    grads: OnednnGrads,
) -> Option<(u64, u64)> {
    let b = |elems: u64| c.dtype.bytes_for(elems);
    let pad = |ch: u64| ch.div_ceil(block.max(1)).checked_mul(block.max(1));
    let act = |ch: u64, sp: u64| c.n.checked_mul(ch)?.checked_mul(sp);
    let first = c.groups == 1 && c.cin <= 3;
    let depthwise = c.groups > 1 && c.groups == c.cin && c.cout == c.cin;
    let pcin = if first { c.cin } else { pad(c.cin)? };
    let x = b(act(c.cin, c.in_spatial)?)?;
    let y = b(act(c.cout, c.out_spatial)?)?;
    let x_b = if first {
        0
    } else {
        b(act(pcin, c.in_spatial)?)?
    };
    let gx_b = if first { x } else { x_b };
    let y_b = b(act(pad(c.cout)?, c.out_spatial)?)?;
    let w = b(c
        .cout
        .checked_mul(c.cin / c.groups.max(1))?
        .checked_mul(c.kernel)?)?;
    let w_b = if c.groups == 1 {
        b(pad(c.cout)?.checked_mul(pcin)?.checked_mul(c.kernel)?)?
    } else if depthwise {
        b(pad(c.cout)?.checked_mul(c.kernel)?)?
    } else {
        w
    };
    let gx = if grads.input { x } else { 0 };
    let gw = if grads.weight { w } else { 0 };
    let gb = if grads.bias { b(c.cout)? } else { 0 };
    if c.channels_last {
        return channels_last_transients(c, block, (w, w_b), (gx, gw, gb));
    }
    let fwd = x_b
        .checked_add(w_b)?
        .checked_add(y_b)?
        .max(y_b.checked_add(y)?)
        - y;
    let mut busiest = 0u64;
    if grads.input {
        busiest = y_b
            .checked_add(w_b)?
            .checked_add(gx_b)?
            .max(gx_b.checked_add(gx)?);
    }
    if grads.weight || grads.bias {
        let blocked = c.groups == 1 || (depthwise && c.small_kernel);
        let gw_b = if blocked { w_b } else { w };
        let reorders = if blocked { y_b.checked_add(x_b)? } else { 0 };
        let during = gx
            .checked_add(reorders)?
            .checked_add(gw_b)?
            .checked_add(gb)?;
        let after = gx
            .checked_add(gw_b)?
            .checked_add(gb)?
            .checked_add(gw)?
            .checked_add(gb)?;
        busiest = busiest.max(during).max(after);
    }
    let returned = gx.checked_add(gw)?.checked_add(gb)?;
    Some((fwd, busiest.saturating_sub(returned)))
}

/// [`onednn_transients`] for a channels-last input (`mkldnn_conv_use_channels_last`): input,
/// output and their gradients are handed to oneDNN as they are, so only the weight moves.
/// Measured (PyTorch 2.15, oneDNN 3.13.3, AVX-512), in order:
/// - forward: the weight made channels-last (`weight.contiguous(ChannelsLast)`, a copy `w_cl`
///   unless it already is one: one input channel per group or a 1×1 kernel) beside the output,
///   then reordered (`w_b`): `w_cl + w_b` beside the output;
/// - backward: `w_cl` for the whole call; data: the input gradient (made channels-last) and
///   `w_b`; weights: the blocked weight gradient `gw_b`, the bias gradient, then the plain
///   weight gradient and its channels-last copy (`.to(ChannelsLast)`, the one returned):
///   `w_cl + gx + gw_b + 2·gb + 2·gw`.
///
/// `gw_b` is `w_b`, except for a depthwise convolution with a kernel over 3, whose weight
/// gradient oneDNN computes with the grouped direct kernel (`jit:avx512_core`, weights
/// `aBCde16c16b`): each group's one input and one output channel padded to the block,
/// `G·block²·∏k` (38,535,168 B for a 768-channel 7×7 one, as ConvNeXt's last stage has).
/// Scratchpads are not modelled.
fn channels_last_transients(
    c: &OnednnConv,
    block: u64,
    (w, w_b): (u64, u64),
    (gx, gw, gb): (u64, u64, u64),
) -> Option<(u64, u64)> {
    let per_group_in = c.cin / c.groups.max(1);
    let w_cl = if per_group_in == 1 || c.one_by_one {
        0
    } else {
        w
    };
    let fwd = w_cl.checked_add(w_b)?;
    let depthwise = c.groups > 1 && c.groups == c.cin && c.cout == c.cin;
    let gw_b = if depthwise && !c.small_kernel {
        c.dtype.bytes_for(
            c.groups
                .checked_mul(block)?
                .checked_mul(block)?
                .checked_mul(c.kernel)?,
        )?
    } else if c.groups == 1 || depthwise {
        w_b
    } else {
        w
    };
    let mut busiest = 0u64;
    if gx > 0 {
        busiest = w_cl.checked_add(gx)?.checked_add(w_b)?;
    }
    if gw > 0 || gb > 0 {
        let after = w_cl
            .checked_add(gx)?
            .checked_add(gw_b)?
            .checked_add(gb.checked_mul(2)?)?
            .checked_add(gw.checked_mul(2)?)?;
        busiest = busiest.max(after);
    }
    let returned = gx.checked_add(gw)?.checked_add(gb)?;
    Some((fwd, busiest.saturating_sub(returned)))
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
        // On the CPU, oneDNN's reorders into and out of its blocked layouts: transients beside
        // the outputs in forward and beside the gradients in backward ([`onednn_transients`]).
        let mut allocs = Vec::new();
        let mut cpu_scratch = (Vec::new(), Vec::new());
        if self.s.device == Device::Cpu {
            let xs = self.val(xc).shape.clone();
            if c.transposed {
                // Transposed ones reorder the input too (measured with PyTorch 2.15 on
                // [2, 64, 32, 32] into ConvTranspose2d(64, 32, 3, stride=2): a 524,288-byte input
                // copy) and also take a scratchpad (618,672 bytes there; about one output's
                // size), which is not modelled.
                allocs.push(self.storage(
                    &xs,
                    dtype,
                    StorageKind::Activation,
                    "reordered input",
                )?);
            } else {
                let ys = self.val(y).shape.clone();
                let channels_last = self.val(xc).layout == Layout::ChannelsLast;
                let conv =
                    OnednnConv::new(c, &xs, &ys, dtype).map(|k| OnednnConv { channels_last, ..k });
                let training = self.training();
                let grads = OnednnGrads {
                    input: training && self.rg(xc),
                    weight: training && self.rg(wc),
                    bias: training && bc.is_some_and(|b| self.rg(b)),
                };
                if let Some(conv) = conv.filter(|k| k.uses_onednn()) {
                    if conv.channels_last {
                        // oneDNN writes the output in the input's channels-last layout.
                        self.tape.values[y].layout = Layout::ChannelsLast;
                    }
                    let (fwd, bwd) = onednn_transients(&conv, ONEDNN_BLOCK, grads)
                        .ok_or_else(|| Error::Overflow("a oneDNN reorder's size".into()))?;
                    cpu_scratch = (vec![fwd], if bwd > 0 { vec![bwd] } else { Vec::new() });
                }
            }
        }
        // On CUDA, with `--cudnn-workspace`: cuDNN's workspace, taken from the caching allocator
        // for the call and freed after it (`run_conv_plan`, Conv_v8.cpp), in the forward and in
        // each of the backward's data and weight convolutions, which run one after the other.
        let scratch = match self.s.cudnn_workspace {
            Some(ws) if self.s.device == Device::Cuda => (vec![ws], vec![ws]),
            _ => cpu_scratch,
        };
        self.call(
            Call::new(AtenOp::Convolution, ins, vec![y])
                .allocs(allocs)
                .scratch(scratch.0, scratch.1),
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

    fn onednn(
        (n, cin, cout, groups): (u64, u64, u64, u64),
        (hw, k, stride, padding): (u64, u64, u64, u64),
        bias: bool,
    ) -> OnednnConv {
        let mut c = cfg(
            false,
            groups,
            &[(k, stride, padding, 1, 0), (k, stride, padding, 1, 0)],
        );
        c.out_channels = cout;
        c.bias = bias;
        let x = Shape::from([n, cin, hw, hw]);
        let y = out_shape(&c, &x).expect("shape");
        OnednnConv::new(&c, &x, &y, DType::Float32).expect("sizes")
    }

    const ALL: OnednnGrads = OnednnGrads {
        input: true,
        weight: true,
        bias: true,
    };

    #[test]
    fn onednn_reorders_of_a_padded_convolution() {
        // tools/measure_dist.py's convnet, last layer: Conv2d(32, 8, 3) on [4, 32, 12, 12]
        // (x = 73,728 B, y = [4, 8, 10, 10] = 12,800 B, w = 9,216 B). Measured with PyTorch
        // 2.15's profiler memory events (oneDNN 3.13.3, AVX-512):
        // forward   +73,728 x_b +18,432 w_b (8 → 16 output channels) +25,600 y_b (padded),
        //           then x_b, w_b go, +12,800 y, and y_b goes: busiest 117,760 = y + 104,960;
        // backward  +25,600 gy_b +18,432 w_b +73,728 gx_b, then +73,728 gx;
        //           +25,600 gy_b +73,728 x_b +18,432 gw_b +32 gb (and a 12,544 B scratchpad,
        //           not modelled): 73,728 + 25,600 + 73,728 + 18,432 + 32 = 191,520,
        //           the returned 73,728 + 9,216 + 32 beside 108,544.
        let c = onednn((4, 32, 8, 1), (12, 3, 1, 0), true);
        assert!(c.uses_onednn());
        assert_eq!(onednn_transients(&c, 16, ALL), Some((104_960, 108_544)));
        // Under AVX2's 8-channel blocks nothing is padded: 73,728 + 9,216 + 12,800 in forward.
        assert_eq!(onednn_transients(&c, 8, ALL).map(|t| t.0), Some(82_944));
    }

    #[test]
    fn onednn_first_convolution_reads_the_input_plain() {
        // Conv2d(3, 16, 3) on [4, 3, 16, 16], input without a gradient: forward +1,728 w_b
        // +50,176 y_b, then +50,176 y (busiest 100,352 = y + 50,176); backward weights +50,176
        // gy_b +1,728 gw_b +64 gb, no input reorder: 50,176 + 1,728 + 64 beside gw + gb.
        let c = onednn((4, 3, 16, 1), (16, 3, 1, 0), true);
        let grads = OnednnGrads {
            input: false,
            ..ALL
        };
        assert_eq!(onednn_transients(&c, 16, grads), Some((50_176, 50_176)));
    }

    #[test]
    fn onednn_depthwise_and_grouped_weights() {
        // Depthwise 3×3 over 40 channels on [2, 40, 28, 28] (x = y = 250,880 B): blocks of 48
        // channels, 301,056 B each, the weight 48·9·4 = 1,728 B: forward 301,056 + 1,728 +
        // 301,056 = 603,840 = y + 352,960; backward weights reorder both (jit depthwise).
        let dw = onednn((2, 40, 40, 40), (28, 3, 1, 1), false);
        let no_bias = OnednnGrads { bias: false, ..ALL };
        // 250,880 + 301,056 + 301,056 + 1,728 = 854,720, less 250,880 + 1,440.
        assert_eq!(
            onednn_transients(&dw, 16, no_bias),
            Some((352_960, 602_400))
        );
        // A 7×7 depthwise weight gradient is computed on plain tensors: the busiest moment is
        // backward data's gy_b + w_b + gx_b (measured: +602,112 +18,816 +602,112).
        let dw7 = onednn((2, 96, 96, 96), (28, 7, 1, 3), false);
        // 1,223,040 less the returned 602,112 + 18,816.
        assert_eq!(
            onednn_transients(&dw7, 16, no_bias).map(|t| t.1),
            Some(602_112)
        );
    }

    #[test]
    fn onednn_channels_last_moves_only_the_weight() {
        // ConvNeXt's downsampling: Conv2d(96, 192, 2, stride=2) on a channels-last [2, 96, 28,
        // 28] (x = 602,112 B, y = 301,056 B, w = 294,912 B). Measured: forward +294,912 w_cl
        // +301,056 y (+12,336 scratchpad) +294,912 w_b; backward +294,912 w_cl +602,112 gx
        // +294,912 w_b (+356,400 scratchpad), then +294,912 gw_b +768 gb +768 gb +294,912 gw
        // +294,912 gw_cl: 1,783,296 B, the returned 602,112 + 294,912 + 768 beside 885,504.
        let mut down = onednn((2, 96, 192, 1), (28, 2, 2, 0), true);
        down.channels_last = true;
        assert_eq!(onednn_transients(&down, 16, ALL), Some((589_824, 885_504)));
        // ConvNeXt's depthwise 7×7 over 96 channels on a channels-last [2, 96, 14, 14]: forward
        // +18,816 w_b beside the output; backward +150,528 gx, then the padded weight gradient
        // 96·16·16·49·4 = 4,816,896 B, +384 +384 gb, +18,816 gw, +18,816 gw_cl.
        let mut dw = onednn((2, 96, 96, 96), (14, 7, 1, 3), true);
        dw.channels_last = true;
        // 4,816,896 + 384 + 18,816 beside the returned gradients.
        assert_eq!(onednn_transients(&dw, 16, ALL), Some((18_816, 4_836_096)));
    }

    #[test]
    fn onednn_only_where_pytorch_uses_it() {
        // Batch 1, one group, 3×3, 16·8·8 = 1,024 input elements: the native kernel.
        let mut c = onednn((1, 16, 16, 1), (8, 3, 1, 1), true);
        assert!(!c.uses_onednn());
        c.dtype = DType::Bfloat16;
        assert!(c.uses_onednn());
        c.dtype = DType::Float16;
        assert!(!c.uses_onednn());
    }
}
