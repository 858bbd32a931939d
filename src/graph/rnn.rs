//! `lstm`, `gru`.

use super::keys::{KeyReader, key};
use crate::spec::LayerKind;

/// The recurrent cell of an [`RnnCfg`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RnnCell {
    /// `nn.LSTM`: four gates (input, forget, cell, output) and a cell state.
    Lstm,
    /// `nn.GRU`: three gates (reset, update, new), no cell state.
    Gru,
}

impl RnnCell {
    /// The kind's name: `lstm` or `gru`.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            RnnCell::Lstm => "lstm",
            RnnCell::Gru => "gru",
        }
    }

    /// Gates per hidden unit: 4 for the LSTM, 3 for the GRU (`torch.nn.LSTM`/`GRU`'s
    /// `weight_ih_l{k}` is `[gates·hidden_size, input]`).
    #[must_use]
    pub const fn gates(self) -> u64 {
        match self {
            RnnCell::Lstm => 4,
            RnnCell::Gru => 3,
        }
    }
}

/// `nn.LSTM` / `nn.GRU` (`kind = "lstm"` / `"gru"`), as `torch.nn.modules.rnn` builds them, called
/// without an initial state (it starts from zeros) and with its `output` passed on (`h_n` and
/// `c_n` are not exposed).
///
/// # Shapes
/// - input: `[batch, seq, input_size]` (`batch_first = true`, memest's default since the batch is
///   dimension 0 of every memest tensor), or `[seq, batch, input_size]` with
///   `batch_first = false` (PyTorch's default);
/// - output: `[batch, seq, D·R]` (or `[seq, batch, D·R]`), where `D` is 2 when bidirectional and
///   `R` is `proj_size`, or `hidden_size` without a projection.
///
/// # Parameters
/// Per layer `k` and direction, with `G` gates (4 for the LSTM, 3 for the GRU), `H` the hidden
/// size and `I_k` the layer's input (`input_size` for the first, `D·R` after):
/// `weight_ih [G·H, I_k]`, `weight_hh [G·H, R]`, with `bias` `bias_ih [G·H]` and `bias_hh [G·H]`,
/// with `proj_size` (LSTM only) `weight_hr [R, H]`.
///
/// What the step keeps depends on the kernel PyTorch runs (`aten/src/ATen/native/RNN.cpp`); see
/// the tracer (`trace/ops/rnn.rs`) for each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RnnCfg {
    /// LSTM or GRU.
    pub cell: RnnCell,
    /// Expected input features, checked when given.
    pub input_size: Option<u64>,
    /// Features of the hidden state `H`.
    pub hidden_size: u64,
    /// Stacked layers (default 1).
    pub num_layers: u64,
    /// Runs each layer forward and backward in time and concatenates the two outputs.
    pub bidirectional: bool,
    /// Whether the input is `[batch, seq, features]` (default true, see the shapes above).
    pub batch_first: bool,
    /// Has `bias_ih` and `bias_hh` (default true).
    pub bias: bool,
    /// The LSTM's output projection `R` (`proj_size`, 0 = none; below `hidden_size`).
    pub proj_size: u64,
}

impl RnnCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cell = if r.kind() == LayerKind::Lstm {
            RnnCell::Lstm
        } else {
            RnnCell::Gru
        };
        let input_size = r.pos_opt(key!(s.input_size));
        let hidden_size = r.pos(key!(s.hidden_size));
        let num_layers = r.pos_or(key!(s.num_layers), 1);
        let bidirectional = r.or(key!(s.bidirectional), false);
        let batch_first = r.or(key!(s.batch_first), true);
        let bias = r.or(key!(s.bias), true);
        let proj_size = if cell == RnnCell::Lstm {
            r.or(key!(s.proj_size), 0)
        } else {
            0
        };
        r.finish()?;
        // nn.LSTM: "proj_size has to be smaller than hidden_size".
        if proj_size >= hidden_size && proj_size > 0 {
            return Err(format!(
                "`proj_size` ({proj_size}) must be smaller than `hidden_size` ({hidden_size})"
            ));
        }
        Ok(RnnCfg {
            cell,
            input_size,
            hidden_size,
            num_layers,
            bidirectional,
            batch_first,
            bias,
            proj_size,
        })
    }

    /// `D`: 2 when bidirectional, else 1.
    #[must_use]
    pub const fn directions(&self) -> u64 {
        if self.bidirectional { 2 } else { 1 }
    }

    /// `R`: the features of each direction's output (`proj_size`, or `hidden_size`).
    #[must_use]
    pub const fn out_size(&self) -> u64 {
        if self.proj_size > 0 {
            self.proj_size
        } else {
            self.hidden_size
        }
    }
}
