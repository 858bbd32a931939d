//! `lstm`, `gru`: the kernel PyTorch runs for `nn.LSTM`/`nn.GRU` and what it keeps.
//!
//! `at::lstm`/`at::gru` (`aten/src/ATen/native/RNN.cpp`) pick one of three programs:
//!
//! - **CUDA: cuDNN.** `_cudnn_rnn` runs every layer and direction in one call and keeps its
//!   input, `hx`, `cx`, its output and cuDNN's reserve buffer. The reserve's size comes from
//!   `cudnnGetRNNTempSpaceSizes`, inside the closed-source cuDNN: it cannot be derived from any
//!   public source, and PyTorch's meta kernel leaves it at 0 (`torch/_meta_registrations.py`,
//!   "TODO: Query cudnnGetRNNTrainingReserveSize"), so fake-tensor runs cannot show it either.
//!   memest sizes it as [`cudnn_reserve_elements`] says: what the backward of each time step
//!   needs, an approximation that no measurement has checked.
//! - **CPU, LSTM without `proj_size`, float32 or bfloat16 (any dtype without grad): oneDNN.**
//!   `mkldnn_rnn` calls `mkldnn_rnn_layer` once per layer and direction; each keeps its input,
//!   `hx`, `cx`, its output, `hy`, `cy` and under grad mode oneDNN's uint8 workspace, whose
//!   size [`onednn_lstm_workspace`] computes exactly as oneDNN v3.13 does.
//! - **CPU otherwise (every GRU; an LSTM with `proj_size`, or in float16 with grad):
//!   ATen's cells.** The input projection of the whole sequence at once (`linear_ih`, so a
//!   batch-first input is copied into sequence-major order by each direction's matmul), then one
//!   `GRUCell`/`LSTMCell` per time step (`AtenOp::GruCell`/`AtenOp::LstmCell` list what each
//!   keeps), the steps' outputs stacked.
//!
//! The initial states are the zeros `nn.LSTM.forward` makes (`[layers·D, batch, R]`, and the
//! LSTM's `[layers·D, batch, H]` cell state); they are kept by the first step that reads them.

#[allow(clippy::wildcard_imports)]
use super::*;
use crate::graph::{RnnCell, RnnCfg};

/// `[batch, seq, input]` (or `[seq, batch, input]` when not `batch_first`) →
/// `[batch, seq, D·R]` (or `[seq, batch, D·R]`); checks `input_size` when given.
pub(super) fn rnn_shape(c: &RnnCfg, x: &Shape) -> Result<Shape, ShapeError> {
    let &[a, b, features] = x.dims() else {
        return wrong_rank(
            x,
            if c.batch_first {
                "rank 3 [batch, seq, input_size]"
            } else {
                "rank 3 [seq, batch, input_size] (batch_first = false)"
            },
        );
    };
    if let Some(expected) = c.input_size.filter(|&e| e != features) {
        return wrong_size(x, "features", features, "input_size", expected);
    }
    let width = sized(
        c.directions().checked_mul(c.out_size()),
        "the output features",
    )?;
    Ok(Shape::from([a, b, width]))
}

/// `x` rounded up to a multiple of `to`.
fn round_up(x: u64, to: u64) -> Option<u64> {
    x.checked_add(to - 1).map(|v| v / to * to)
}

/// oneDNN's `rnn_utils::get_good_ld` (`src/cpu/rnn/rnn_utils.cpp`): a leading dimension of
/// `dim` elements of `size` bytes, rounded up to 64 bytes, plus 64 bytes when it is a multiple
/// of 256 elements (against 4K aliasing).
fn good_ld(dim: u64, size: u64) -> Option<u64> {
    let per = 64 / size;
    let ld = round_up(dim, per)?;
    Some(if ld % 256 == 0 { ld + per } else { ld })
}

/// The bytes of the uint8 workspace `mkldnn_rnn_layer` allocates for one LSTM layer and
/// direction under grad mode: `pd.workspace_desc().get_size()` of oneDNN's LSTM forward
/// training primitive (oneDNN v3.13, the version PyTorch 2.15 links).
///
/// `set_offsets` (`src/cpu/rnn/rnn_utils.cpp`) lays out, each from a 4096-byte page boundary,
/// the parts `set_workspace_sizes` (`src/cpu/rnn/rnn_utils.hpp`) sizes for one layer
/// (`n_layer = 1`, as `mkldnn_rnn` calls it per layer and direction), `T` steps, batch `N`,
/// input `I`, hidden `H`, `E` bytes per element of the input's dtype and float32 (4 bytes) for
/// the accumulators:
/// - gates: `T·N·good_ld(4H, E)·E`; `ht`: `T·N·good_ld(H, E)·E`;
/// - states: `2·(T+1)·N·good_ld(max(H, I), E)·E`; cell states: `2·(T+1)·N·H·E`;
/// - their gradients: twice `2·(T+1)·N·good_ld(max(I, H), 4)·4`, and `2·(T+1)·N·H·4`;
/// - the LBR-GRU part, 0 for an LSTM.
///
/// Measured with PyTorch 2.15 (CPU, AVX-512) on 17 layer calls in 7 shapes, float32 and
/// bfloat16, 1–2 layers, uni- and bidirectional (28,672 B for `T = 3, N = 2, I = 5, H = 4`;
/// 3,141,632 B for `T = 50, N = 8, I = 64, H = 128`): equal to the byte. `None` on overflow.
#[must_use]
pub fn onednn_lstm_workspace(t: u64, n: u64, i: u64, h: u64, e: u64) -> Option<u64> {
    const PAGE: u64 = 4096;
    let states = t.checked_add(1)?.checked_mul(2)?.checked_mul(n)?;
    let wide = i.max(h);
    let parts = [
        t.checked_mul(n)?
            .checked_mul(good_ld(h.checked_mul(4)?, e)?)?
            .checked_mul(e)?,
        t.checked_mul(n)?
            .checked_mul(good_ld(h, e)?)?
            .checked_mul(e)?,
        states.checked_mul(good_ld(wide, e)?)?.checked_mul(e)?,
        states.checked_mul(h)?.checked_mul(e)?,
        states.checked_mul(good_ld(wide, 4)?)?.checked_mul(4)?,
        states.checked_mul(good_ld(wide, 4)?)?.checked_mul(4)?,
        states.checked_mul(h)?.checked_mul(4)?,
    ];
    parts
        .iter()
        .try_fold(0u64, |sum, &p| sum.checked_add(round_up(p, PAGE)?))
}

/// The elements memest gives cuDNN's reserve buffer per layer, direction, time step and batch
/// row: what the backward of one step reads and the forward has only there, for an LSTM the
/// four gate activations, the cell state and the output (`4H + H + R`), for a GRU the three
/// gates, the hidden part of the new gate (`W_hn·h + b_hn`, which the reset gate multiplies)
/// and the output (`5H`). An approximation: cuDNN's layout is not public (see the module
/// docs). One public report (pytorch/pytorch#2895, cuDNN 6 on a P100) gives a GRU's reserve as
/// 1.17 times an LSTM's of the same sizes, which this rule (5/6) does not reproduce.
#[must_use]
pub fn cudnn_reserve_elements(cell: RnnCell, hidden: u64, out: u64) -> Option<u64> {
    match cell {
        RnnCell::Lstm => hidden.checked_mul(5)?.checked_add(out),
        RnnCell::Gru => hidden.checked_mul(5),
    }
}

/// A checked size in the tracer, or [`Error::Overflow`] naming `what`.
fn checked(v: Option<u64>, what: &str) -> Result<u64, Error> {
    v.ok_or_else(|| Error::Overflow(what.to_string()))
}

/// One layer and direction's parameters.
struct Weights {
    ih: ValueId,
    hh: ValueId,
    biases: Option<(ValueId, ValueId)>,
    hr: Option<ValueId>,
}

impl Tracer<'_> {
    /// `nn.LSTM` / `nn.GRU`: see the module docs for the program each device runs.
    pub(super) fn rnn(&mut self, c: &RnnCfg, x: ValueId, train: bool) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        self.last_dim(&xv, c.cell.name())?;
        let out = self.shaped(rnn_shape(c, &xv.shape))?;
        let [d0, d1, input] = *xv.shape.dims() else {
            unreachable!("rnn_shape checked the rank")
        };
        let (t, n) = if c.batch_first { (d1, d0) } else { (d0, d1) };
        let dtype = xv.dtype;
        let (h, r, dirs) = (c.hidden_size, c.out_size(), c.directions());
        let gh = c.cell.gates() * h;
        // Parameters in nn.RNNBase's order: per layer, per direction.
        let mut weights = Vec::new();
        for layer in 0..c.num_layers {
            let in_l = if layer == 0 { input } else { dirs * r };
            for _ in 0..dirs {
                let ih = self.param(Shape::from([gh, in_l]), train)?;
                let hh = self.param(Shape::from([gh, r]), train)?;
                let biases = if c.bias {
                    Some((
                        self.param(Shape::from([gh]), train)?,
                        self.param(Shape::from([gh]), train)?,
                    ))
                } else {
                    None
                };
                let hr = if c.proj_size > 0 {
                    Some(self.param(Shape::from([r, h]), train)?)
                } else {
                    None
                };
                weights.push(Weights { ih, hh, biases, hr });
            }
        }
        let states = checked(c.num_layers.checked_mul(dirs), "the state count")?;
        let h0 = self.fresh(
            Shape::from([states, n, r]),
            dtype,
            "initial hidden state",
            false,
        )?;
        let c0 = match c.cell {
            RnnCell::Lstm => Some(self.fresh(
                Shape::from([states, n, h]),
                dtype,
                "initial cell state",
                false,
            )?),
            RnnCell::Gru => None,
        };
        // The sequence-major view of the input (`input.transpose(0, 1)`).
        let seq_major = if c.batch_first {
            let layout = if t > 1 && n > 1 {
                Layout::Strided
            } else {
                Layout::Contiguous
            };
            self.view_op(
                x,
                Shape::from([t, n, input]),
                layout,
                AtenOp::Transpose,
                true,
            )
        } else {
            x
        };
        let onednn = c.cell == RnnCell::Lstm
            && c.proj_size == 0
            && (matches!(dtype, DType::Float32 | DType::Bfloat16) || !self.training());
        let y = match self.s.device {
            Device::Cuda => self.cudnn_rnn(c, x, (t, n, input), h0, c0, &weights)?,
            Device::Cpu if onednn => {
                self.onednn_lstm(c, seq_major, (t, n, input), h0, c0, &weights)?
            }
            Device::Cpu => self.aten_rnn(c, seq_major, (t, n), h0, c0, &weights)?,
        };
        if !c.batch_first {
            return Ok(y);
        }
        let layout = if t > 1 && n > 1 {
            Layout::Strided
        } else {
            Layout::Contiguous
        };
        Ok(self.view_op(y, out, layout, AtenOp::Transpose, true))
    }

    /// `_cudnn_rnn`: one call; returns the sequence-major output `[T, N, D·R]`.
    fn cudnn_rnn(
        &mut self,
        c: &RnnCfg,
        x: ValueId,
        (t, n, input): (u64, u64, u64),
        h0: ValueId,
        c0: Option<ValueId>,
        weights: &[Weights],
    ) -> Result<ValueId, Error> {
        let (h, r, dirs) = (c.hidden_size, c.out_size(), c.directions());
        let mut flat = Vec::new();
        for w in weights {
            flat.extend([w.ih, w.hh]);
            if let Some((bi, bh)) = w.biases {
                flat.extend([bi, bh]);
            }
            flat.extend(w.hr);
        }
        let (x, h0, c0) = if self.s.amp.is_some() {
            self.cudnn_rnn_autocast(x, h0, c0, &mut flat)?
        } else {
            (x, h0, c0)
        };
        let dtype = self.val(x).dtype;
        let rg = self.rg(x) || flat.iter().any(|&w| self.rg(w));
        let y = self.fresh(Shape::from([t, n, dirs * r]), dtype, "output", rg)?;
        let mut inputs = vec![x, h0];
        inputs.extend(c0);
        inputs.extend(flat);
        // `x = input.contiguous()` of the transposed batch-first input: a transient copy.
        let mut allocs = Vec::new();
        if c.batch_first && t > 1 && n > 1 {
            allocs.push(self.storage(
                &Shape::from([t, n, input]),
                dtype,
                StorageKind::Activation,
                "contiguous input",
            )?);
        }
        let states = self.val(h0).shape.dims()[0];
        let mut results = vec![self.storage(
            &Shape::from([states, n, r]),
            dtype,
            StorageKind::Activation,
            "final hidden state",
        )?];
        if c0.is_some() {
            results.push(self.storage(
                &Shape::from([states, n, h]),
                dtype,
                StorageKind::Activation,
                "final cell state",
            )?);
        }
        let mut aux = Vec::new();
        if self.training() {
            let per_row = checked(
                cudnn_reserve_elements(c.cell, h, r),
                "the cuDNN reserve size",
            )?;
            let elements = checked(
                states
                    .checked_mul(t)
                    .and_then(|v| v.checked_mul(n))
                    .and_then(|v| v.checked_mul(per_row)),
                "the cuDNN reserve size",
            )?;
            let bytes = checked(dtype.bytes_for(elements), "the cuDNN reserve size")?;
            let reserve = self.storage(
                &Shape::from([bytes]),
                DType::Uint8,
                StorageKind::Activation,
                "cuDNN reserve",
            )?;
            aux.push(reserve);
            results.push(reserve);
        }
        let op = match c.cell {
            RnnCell::Lstm => AtenOp::CudnnLstm,
            RnnCell::Gru => AtenOp::CudnnRnn,
        };
        self.call(
            Call::new(op, inputs, vec![y])
                .aux(aux)
                .allocs(allocs)
                .results(results),
        )?;
        Ok(y)
    }

    /// CUDA autocast's `_cudnn_rnn` (`aten/src/ATen/cudnn/AutocastRNN.cpp`,
    /// `_cudnn_rnn_cast_reflatten`): float16 whatever the autocast dtype (`cached_cast(kHalf,
    /// ..)`): the input, `hx` and `cx` cast to float16 copies, and every weight copied into one
    /// new float16 flat buffer (`copy_weights_to_flat_buf_views`, autograd-exposed), which
    /// `_cudnn_rnn` then keeps as its weights. Returns the cast input and states; `flat` becomes
    /// the one buffer. From the source; not measured (no GPU, and fake tensors cannot run it).
    fn cudnn_rnn_autocast(
        &mut self,
        x: ValueId,
        h0: ValueId,
        c0: Option<ValueId>,
        flat: &mut Vec<ValueId>,
    ) -> Result<(ValueId, ValueId, Option<ValueId>), Error> {
        let half = |t: &mut Self, v: ValueId| -> Result<ValueId, Error> {
            let val = t.val(v).clone();
            if val.dtype == DType::Float16 {
                return Ok(v);
            }
            let out = t.fresh(val.shape, DType::Float16, "float16 copy", val.requires_grad)?;
            t.call(Call::new(AtenOp::ToCopy, vec![v], vec![out]))?;
            Ok(out)
        };
        let x = half(self, x)?;
        let h0 = half(self, h0)?;
        let c0 = match c0 {
            Some(c0) => Some(half(self, c0)?),
            None => None,
        };
        if flat.iter().any(|&w| self.val(w).dtype != DType::Float16) {
            let mut numel = 0u64;
            for &w in flat.iter() {
                numel = checked(
                    self.val(w).shape.numel().and_then(|n| numel.checked_add(n)),
                    "the flat weight buffer",
                )?;
            }
            let rg = flat.iter().any(|&w| self.rg(w));
            let buf = self.fresh(
                Shape::from([numel]),
                DType::Float16,
                "float16 flat weights",
                rg,
            )?;
            self.call(Call::new(AtenOp::ToCopy, flat.clone(), vec![buf]))?;
            *flat = vec![buf];
        }
        Ok((x, h0, c0))
    }

    /// `mkldnn_rnn`: `mkldnn_rnn_layer` per layer and direction, the directions' outputs
    /// concatenated between layers; returns the sequence-major output.
    fn onednn_lstm(
        &mut self,
        c: &RnnCfg,
        seq_major: ValueId,
        (t, n, input): (u64, u64, u64),
        h0: ValueId,
        c0: Option<ValueId>,
        weights: &[Weights],
    ) -> Result<ValueId, Error> {
        let c0 = c0.expect("an LSTM has a cell state");
        let dtype = self.val(seq_major).dtype;
        let e = dtype.bytes_for(1).unwrap_or(4);
        let (h, dirs) = (c.hidden_size, c.directions());
        // `input.contiguous()`: a copy of a transposed batch-first input.
        let mut layer_in = self.contiguous(seq_major)?;
        let mut index = 0;
        for layer in 0..c.num_layers {
            let in_l = if layer == 0 { input } else { dirs * h };
            let mut outs = Vec::new();
            for _ in 0..dirs {
                let w = &weights[index];
                let (b_ih, b_hh) = match w.biases {
                    Some(b) => b,
                    // `mkldnn_rnn` passes zeros shaped like the weights instead of biases.
                    None => (
                        self.fresh(Shape::from([4 * h, in_l]), dtype, "zero bias", false)?,
                        self.fresh(Shape::from([4 * h, h]), dtype, "zero bias", false)?,
                    ),
                };
                let hx = self.view_of(h0, Shape::from([n, h]), Layout::Contiguous);
                let cx = self.view_of(c0, Shape::from([n, h]), Layout::Contiguous);
                let rg = self.rg(layer_in) || self.rg(w.ih);
                let y = self.fresh(Shape::from([t, n, h]), dtype, "output", rg)?;
                let state = Shape::from([n, h]);
                let hy = self.storage(&state, dtype, StorageKind::Activation, "hy")?;
                let cy = self.storage(&state, dtype, StorageKind::Activation, "cy")?;
                let mut aux = vec![hy, cy];
                if self.training() {
                    let bytes = checked(
                        onednn_lstm_workspace(t, n, in_l, h, e),
                        "the oneDNN workspace size",
                    )?;
                    aux.push(self.storage(
                        &Shape::from([bytes]),
                        DType::Uint8,
                        StorageKind::Activation,
                        "oneDNN workspace",
                    )?);
                }
                let inputs = vec![layer_in, w.ih, w.hh, b_ih, b_hh, hx, cx];
                self.call(
                    Call::new(AtenOp::MkldnnRnnLayer, inputs, vec![y])
                        .aux(aux.clone())
                        .results(aux),
                )?;
                outs.push(y);
                index += 1;
            }
            layer_in = self.cat_last(&outs, t, n)?;
        }
        Ok(layer_in)
    }

    /// ATen's cells on the CPU (`_rnn_impl_with_concat`): per layer and direction the input
    /// projection of the whole sequence, then one cell per step, the outputs stacked (and the
    /// directions concatenated). Returns the sequence-major output.
    fn aten_rnn(
        &mut self,
        c: &RnnCfg,
        seq_major: ValueId,
        (t, n): (u64, u64),
        h0: ValueId,
        c0: Option<ValueId>,
        weights: &[Weights],
    ) -> Result<ValueId, Error> {
        let dtype = self.val(seq_major).dtype;
        let (h, r, dirs) = (c.hidden_size, c.out_size(), c.directions());
        let gh = c.cell.gates() * h;
        let len = usize::try_from(t).map_err(|_| Error::Overflow("the sequence length".into()))?;
        let mut layer_in = seq_major;
        let mut index = 0;
        for _ in 0..c.num_layers {
            let mut outs = Vec::new();
            for dir in 0..dirs {
                let w = &weights[index];
                index += 1;
                // `params.linear_ih(inputs)`: one matmul over the sequence, `unbind(0)` into
                // the steps.
                let gates = self.linear(layer_in, w.ih, w.biases.map(|b| b.0), gh)?;
                let steps: Vec<ValueId> = (0..len)
                    .map(|_| self.view_of(gates, Shape::from([n, gh]), Layout::Contiguous))
                    .collect();
                self.call(Call::new(AtenOp::Unbind, vec![gates], steps.clone()))?;
                let mut hx = self.view_of(h0, Shape::from([n, r]), Layout::Contiguous);
                let mut cx = c0.map(|c0| self.view_of(c0, Shape::from([n, h]), Layout::Contiguous));
                let mut outputs = vec![hx; len];
                let order: Vec<usize> = if dir == 0 {
                    (0..len).collect()
                } else {
                    (0..len).rev().collect()
                };
                for step in order {
                    let (hy, cy) = self.cell(c.cell, hx, cx, steps[step], w, (n, h))?;
                    outputs[step] = hy;
                    hx = hy;
                    cx = cy;
                }
                // `at::stack(outputs, 0)`.
                let stacked = self.fresh(
                    Shape::from([t, n, r]),
                    dtype,
                    "stacked output",
                    outputs.iter().any(|&o| self.rg(o)),
                )?;
                self.call(Call::new(AtenOp::Cat, outputs, vec![stacked]))?;
                outs.push(stacked);
            }
            layer_in = self.cat_last(&outs, t, n)?;
        }
        Ok(layer_in)
    }

    /// One `GRUCell`/`LSTMCell` step (with the LSTM's projection `matmul_hr`): returns `hy`
    /// and, for the LSTM, `cy`.
    fn cell(
        &mut self,
        cell: RnnCell,
        hx: ValueId,
        cx: Option<ValueId>,
        input_gates: ValueId,
        w: &Weights,
        (n, h): (u64, u64),
    ) -> Result<(ValueId, Option<ValueId>), Error> {
        let dtype = self.val(hx).dtype;
        let gh = cell.gates() * h;
        let state = Shape::from([n, h]);
        let gates = self.storage(
            &Shape::from([n, gh]),
            dtype,
            StorageKind::Activation,
            "gates",
        )?;
        let mut inputs = vec![hx];
        inputs.extend(cx);
        inputs.extend([input_gates, w.hh]);
        inputs.extend(w.biases.map(|b| b.1));
        let rg = inputs.iter().any(|&v| self.rg(v));
        match cell {
            RnnCell::Gru => {
                let clone = self.storage(&state, dtype, StorageKind::Activation, "gate clone")?;
                let new_gate = self.storage(&state, dtype, StorageKind::Activation, "new gate")?;
                let hy = self.fresh(state.clone(), dtype, "hidden state", rg)?;
                let difference =
                    self.storage(&state, dtype, StorageKind::Activation, "difference clone")?;
                self.call(
                    Call::new(AtenOp::GruCell, inputs, vec![hy])
                        .aux(vec![gates, clone, new_gate, difference])
                        .allocs(vec![gates, clone, new_gate])
                        .results(vec![difference]),
                )?;
                Ok((hy, None))
            }
            RnnCell::Lstm => {
                let cy = self.fresh(state.clone(), dtype, "cell state", rg)?;
                let hy = self.fresh(state.clone(), dtype, "hidden state", rg)?;
                let tanh = self.storage(&state, dtype, StorageKind::Activation, "tanh(cy)")?;
                let product = dtype
                    .bytes_for(n.saturating_mul(h))
                    .ok_or_else(|| Error::Overflow("the i·g product".into()))?;
                self.call(
                    Call::new(AtenOp::LstmCell, inputs, vec![cy, hy])
                        .aux(vec![gates, tanh])
                        .allocs(vec![gates])
                        .results(vec![tanh])
                        .scratch(vec![product], Vec::new()),
                )?;
                // `params.matmul_hr(hy)`: `mm` keeps `hy`.
                let hy = match w.hr {
                    Some(hr) => {
                        let r = self.val(hr).shape.dims()[0];
                        self.weight_matmul(
                            AtenOp::Mm,
                            hy,
                            hr,
                            hr,
                            None,
                            Shape::from([n, r]),
                            Vec::new(),
                        )?
                    }
                    None => hy,
                };
                Ok((hy, Some(cy)))
            }
        }
    }

    /// The directions' `[T, N, ·]` outputs concatenated on the features (`at::cat(.., -1)`), or
    /// the one output of a unidirectional layer.
    fn cat_last(&mut self, outs: &[ValueId], t: u64, n: u64) -> Result<ValueId, Error> {
        if let [one] = outs {
            return Ok(*one);
        }
        let dtype = self.val(outs[0]).dtype;
        let mut width = 0u64;
        for &o in outs {
            width = width
                .checked_add(self.val(o).shape.last().unwrap_or(0))
                .ok_or_else(|| Error::Overflow("the concatenated features".into()))?;
        }
        let rg = outs.iter().any(|&o| self.rg(o));
        let y = self.fresh(Shape::from([t, n, width]), dtype, "output", rg)?;
        self.call(Call::new(AtenOp::Cat, outs.to_vec(), vec![y]))?;
        Ok(y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(cell: RnnCell, layers: u64, bidirectional: bool, proj_size: u64) -> RnnCfg {
        RnnCfg {
            cell,
            input_size: None,
            hidden_size: 4,
            num_layers: layers,
            bidirectional,
            batch_first: true,
            bias: true,
            proj_size,
        }
    }

    #[test]
    fn shapes() {
        let x = Shape::from([2, 3, 5]);
        assert_eq!(
            rnn_shape(&cfg(RnnCell::Lstm, 2, true, 0), &x),
            Ok(Shape::from([2, 3, 8]))
        );
        assert_eq!(
            rnn_shape(&cfg(RnnCell::Lstm, 1, true, 3), &x),
            Ok(Shape::from([2, 3, 6]))
        );
        assert_eq!(
            rnn_shape(&cfg(RnnCell::Gru, 1, false, 0), &x),
            Ok(Shape::from([2, 3, 4]))
        );
        assert!(rnn_shape(&cfg(RnnCell::Gru, 1, false, 0), &Shape::from([2, 5])).is_err());
        let checked = RnnCfg {
            input_size: Some(6),
            ..cfg(RnnCell::Gru, 1, false, 0)
        };
        assert!(rnn_shape(&checked, &x).is_err());
    }

    #[test]
    fn good_leading_dimensions() {
        // float32: rounded up to 16 elements (64 bytes); 256 becomes 272.
        assert_eq!(good_ld(5, 4), Some(16));
        assert_eq!(good_ld(33, 4), Some(48));
        assert_eq!(good_ld(256, 4), Some(272));
        // bfloat16: 32 elements.
        assert_eq!(good_ld(40, 2), Some(64));
    }

    #[test]
    fn onednn_workspace_is_what_pytorch_allocated() {
        // Measured with PyTorch 2.15 (oneDNN v3.13.3): the uint8 `result3` of
        // `mkldnn_rnn_layer`. T = 3, N = 2, I = 5, H = 4, float32: seven parts of at most one
        // page each, 7·4096 = 28,672.
        assert_eq!(onednn_lstm_workspace(3, 2, 5, 4, 4), Some(28_672));
        assert_eq!(onednn_lstm_workspace(7, 3, 10, 33, 4), Some(69_632));
        assert_eq!(onednn_lstm_workspace(20, 4, 100, 64, 4), Some(434_176));
        // A bidirectional 2-layer LSTM, T = 50, N = 8, I = 64, H = 128: layer 1 reads 256.
        assert_eq!(onednn_lstm_workspace(50, 8, 64, 128, 4), Some(3_141_632));
        assert_eq!(onednn_lstm_workspace(50, 8, 256, 128, 4), Some(4_554_752));
        // bfloat16 (states in 2 bytes, accumulators in 4).
        assert_eq!(onednn_lstm_workspace(9, 5, 70, 40, 2), Some(135_168));
        assert_eq!(onednn_lstm_workspace(u64::MAX, 2, 5, 4, 4), None);
    }
}
