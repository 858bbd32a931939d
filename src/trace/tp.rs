//! Tensor, sequence and context parallelism, operator by operator: the shapes one rank holds.
//!
//! With `--tp T` every layer is traced with the shapes of one rank, so that saved activations,
//! temporaries and the peak follow from the same replay as on one GPU (nothing is divided
//! afterwards). The split follows Megatron-LM (Shoeybi et al. 2019, "Megatron-LM: Training
//! Multi-Billion Parameter Language Models Using Model Parallelism", §3) as PyTorch's DTensor
//! plans express it (`ColwiseParallel`, `RowwiseParallel`, `SequenceParallel` in
//! `torch/distributed/tensor/parallel/style.py`):
//!
//! - **Attention** (inside a repeated block): query and key/value heads are divided by `T`
//!   (the Q/K/V projections are column-parallel: `out_features / T`, so their outputs are
//!   `[B, S, heads/T · head_dim]`); the output projection is row-parallel (`in_features / T`);
//!   its partial output is all-reduced (a new `[B, S, H]` tensor).
//! - **Linear layers inside a block**: a linear that reads a replicated activation is
//!   column-parallel (`out_features / T`, bias divided) and its output is split along the
//!   features; elementwise layers (activations, dropout, scale, `mul` and `add` of split
//!   operands) keep that split; the linear that reads the split activation is row-parallel
//!   (`in_features / T`, bias whole) and its output is all-reduced. This is Megatron's MLP
//!   (`h → 4h` column, `4h → h` row) and the gated MLP (gate and up column, down row) without
//!   naming any layer. Any other layer that meets a split activation gets it all-gathered
//!   first (never the case in a transformer).
//! - **Embedding and LM head** (top level): the token embedding is vocab-parallel (rows
//!   `⌈V/T⌉`, DTensor `RowwiseParallel` on `nn.Embedding`, Megatron `VocabParallelEmbedding`);
//!   its partial output is all-reduced. The LM head (a top-level linear whose `out_features`
//!   is that vocabulary, tied or not) is column-parallel; DTensor all-gathers its logits
//!   (`output_layouts=Replicate()`), Megatron keeps them split into its vocab-parallel
//!   cross-entropy ([`TpStyle`]).
//! - **Everything else** (norms, residual adds, dropout outside the split regions, position
//!   embeddings) is replicated: whole shapes on every rank.
//! - **Sequence parallel** (`--sp`, Korthikanti et al. 2022, §4.2.2): norms, dropout, residual
//!   adds and activations between the split regions hold `S/T` positions. Each split region
//!   starts with an all-gather along the sequence (shared by the linears that read the same
//!   input) and ends in a reduce-scatter instead of the all-reduce. DTensor enters the first
//!   block by slicing the replicated embedding output (`PrepareModuleInput(desired_input_layouts
//!   =Shard(1))`: a chunk, cloned); Megatron reduce-scatters the embedding output.
//! - **Context parallel** (`--cp C`): the input sequence is divided by `C`, so every activation
//!   holds `S/C` positions; ring attention (Liu et al. 2023, "Ring Attention with Blockwise
//!   Transformers"; Megatron-Core/Transformer Engine's `AttnFuncWithCPAndKVP2P`) computes each
//!   rank's queries against every rank's key/value chunk passed around the ring, with a receive
//!   buffer beside the chunk in use for keys and values: two chunk-sized buffers in flight during
//!   each attention forward. What the backward's ring holds beside them (the chunks' gradients in
//!   flight) is not modelled.

use std::collections::{HashMap, HashSet};

#[allow(clippy::wildcard_imports)]
use super::*;
use crate::graph::{EmbeddingCfg, LinearCfg};
use crate::parallel::TpStyle;

/// The tracer's tensor-parallel state.
#[derive(Clone, Debug, Default)]
pub(super) struct Tp {
    /// Tensor-parallel degree.
    pub t: u64,
    /// Sequence parallel.
    pub sp: bool,
    /// Context-parallel degree.
    pub cp: u64,
    /// Whose implementation.
    pub style: TpStyle,
    /// Values split along their last dimension (column-parallel outputs and what elementwise
    /// layers make of them).
    col: HashSet<ValueId>,
    /// Values split along the sequence (dimension 1) under sequence parallel.
    seq: HashSet<ValueId>,
    /// Each value's all-gathered or sliced copy, made once and shared by its readers.
    copies: HashMap<(ValueId, AtenOp), ValueId>,
    /// The token vocabulary of the vocab-parallel embedding (whole).
    vocab: Option<u64>,
}

impl Tp {
    /// The state for `plan`, or `None` when it splits nothing (`tp = cp = 1`).
    pub(super) fn of(plan: Option<&crate::parallel::Plan>) -> Option<Tp> {
        let p = plan?;
        (p.tp > 1 || p.cp > 1).then(|| Tp {
            t: p.tp.max(1),
            sp: p.tensor.sp && p.tp > 1,
            cp: p.cp.max(1),
            style: p.tensor.style,
            ..Tp::default()
        })
    }
}

/// How a value is laid out across the tensor-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lay {
    /// Whole on every rank.
    Whole,
    /// Split along the last dimension.
    Col,
    /// Split along the sequence.
    Seq,
}

impl Tracer<'_> {
    fn lay(&self, v: ValueId) -> Lay {
        match &self.tp {
            Some(tp) if tp.col.contains(&v) => Lay::Col,
            Some(tp) if tp.seq.contains(&v) => Lay::Seq,
            _ => Lay::Whole,
        }
    }

    /// Records the parameters made since the `first`-th as split across the tensor-parallel
    /// ranks ([`Tape::tp_split`]).
    fn mark_split(&mut self, first: usize) {
        let made = self.tape.params.get(first..).unwrap_or_default();
        let values: Vec<ValueId> = made.iter().map(|p| p.value).collect();
        self.tape.tp_split.extend(values);
    }

    fn mark(&mut self, v: ValueId, lay: Lay) {
        if let Some(tp) = &mut self.tp {
            match lay {
                Lay::Col => {
                    tp.col.insert(v);
                }
                Lay::Seq => {
                    tp.seq.insert(v);
                }
                Lay::Whole => {}
            }
        }
    }

    fn tp_cfg(&self) -> (u64, bool, TpStyle) {
        self.tp
            .as_ref()
            .map_or((1, false, TpStyle::Dtensor), |tp| (tp.t, tp.sp, tp.style))
    }

    /// A collective `op` from `x` to a new tensor of `shape` (see the [`AtenOp`] rows for what
    /// each does in backward). `AllReduce` hands its gradient on as a view.
    fn collective(
        &mut self,
        x: ValueId,
        op: AtenOp,
        shape: Shape,
        what: &'static str,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let y = self.fresh(shape, xv.dtype, what, xv.requires_grad)?;
        let call = Call::new(op, vec![x], vec![y]);
        self.call(if op == AtenOp::AllReduce {
            call.view_grad()
        } else {
            call
        })?;
        Ok(y)
    }

    /// `x` with dimension `dim` multiplied (`grow`) or divided by `T`.
    fn scaled(&self, x: ValueId, dim: usize, grow: bool) -> Result<Shape, Error> {
        let (t, ..) = self.tp_cfg();
        let mut dims = self.val(x).shape.dims().to_vec();
        let d = dims
            .get_mut(dim)
            .ok_or_else(|| self.err("tensor parallelism needs a [batch, seq, ..] input".into()))?;
        *d = if grow {
            checked(d.checked_mul(t), "an all-gathered size")?
        } else {
            d.div_ceil(t)
        };
        Ok(Shape::new(dims))
    }

    /// A row-parallel output (partial sums) made whole: all-reduced, or under sequence
    /// parallel reduce-scattered along the sequence.
    fn tp_reduce(&mut self, y: ValueId) -> Result<ValueId, Error> {
        let (_, sp, _) = self.tp_cfg();
        if sp {
            let shape = self.scaled(y, 1, false)?;
            let out = self.collective(y, AtenOp::ReduceScatter, shape, "reduce-scatter output")?;
            self.mark(out, Lay::Seq);
            Ok(out)
        } else {
            let shape = self.val(y).shape.clone();
            self.collective(y, AtenOp::AllReduce, shape, "all-reduce output")
        }
    }

    /// `x` made whole: all-gathered along the sequence or the features, once per value.
    fn tp_whole(&mut self, x: ValueId) -> Result<ValueId, Error> {
        let (op, dim, what) = match self.lay(x) {
            Lay::Whole => return Ok(x),
            Lay::Seq => (AtenOp::AllGather, 1, "all-gathered sequence"),
            Lay::Col => {
                let rank = self.val(x).shape.rank();
                (
                    AtenOp::AllGather,
                    rank.saturating_sub(1),
                    "all-gathered features",
                )
            }
        };
        let key = (x, op);
        if let Some(&c) = self.tp.as_ref().and_then(|tp| tp.copies.get(&key)) {
            return Ok(c);
        }
        let shape = self.scaled(x, dim, true)?;
        let y = self.collective(x, op, shape, what)?;
        if let Some(tp) = &mut self.tp {
            tp.copies.insert(key, y);
        }
        Ok(y)
    }

    /// Under sequence parallel, a whole `[B, S, H]` float activation sliced to this rank's
    /// `S/T` positions (DTensor's `Replicate → Shard(1)`), once per value; others as they are.
    fn tp_slice(&mut self, x: ValueId) -> Result<ValueId, Error> {
        let (_, sp, _) = self.tp_cfg();
        let xv = self.val(x);
        if !sp || self.lay(x) != Lay::Whole || xv.shape.rank() != 3 || !xv.dtype.is_float() {
            return Ok(x);
        }
        let key = (x, AtenOp::ShardSlice);
        if let Some(&c) = self.tp.as_ref().and_then(|tp| tp.copies.get(&key)) {
            return Ok(c);
        }
        let shape = self.scaled(x, 1, false)?;
        let y = self.collective(x, AtenOp::ShardSlice, shape, "sequence shard")?;
        self.mark(y, Lay::Seq);
        if let Some(tp) = &mut self.tp {
            tp.copies.insert(key, y);
        }
        Ok(y)
    }

    /// A repeated block's input under sequence parallel: this rank's positions (the first
    /// block's `PrepareModuleInput`; later blocks get them already).
    pub(super) fn tp_block_input(&mut self, x: ValueId) -> Result<ValueId, Error> {
        if self.tp.is_some() {
            self.tp_slice(x)
        } else {
            Ok(x)
        }
    }

    /// Megatron's sequence-parallel linears save their sequence-sharded input, not the
    /// all-gathered one, and gather it again in backward
    /// (`LinearWithGradAccumulationAndAsyncCommunication.forward`: `ctx.save_for_backward(input,
    /// weight)` before `_gather_along_first_dim`): the steps since `from` save `local` where they
    /// saved `gathered`.
    fn save_sharded(&mut self, from: usize, gathered: ValueId, local: ValueId) {
        let (_, sp, style) = self.tp_cfg();
        if !sp || style != TpStyle::Megatron || gathered == local {
            return;
        }
        let (g, l) = (self.sid(gathered), self.sid(local));
        for step in &mut self.tape.steps[from..] {
            for s in &mut step.saves {
                if *s == g {
                    *s = l;
                }
            }
            step.saves.sort_unstable();
            step.saves.dedup();
        }
    }

    /// Traces one layer on this rank's shapes (see the module documentation).
    #[allow(clippy::too_many_lines)] // one arm per kind of split, in the order of a block
    pub(super) fn tp_op(
        &mut self,
        op: &Op,
        layer: &Layer,
        inputs: &[ValueId],
    ) -> Result<ValueId, Error> {
        let Some(tp) = &self.tp else {
            return self.op_inner(op, layer, inputs);
        };
        let (t, sp, style, cp, vocab) = (tp.t, tp.sp, tp.style, tp.cp, tp.vocab);
        let x = inputs[0];
        let train = layer.trainable;
        let in_block = self.in_block;
        match op {
            Op::Embedding(c) if t > 1 && !in_block => {
                let local = EmbeddingCfg {
                    num_embeddings: c.num_embeddings.div_ceil(t),
                    embedding_dim: c.embedding_dim,
                    tie: c.tie.clone(),
                };
                if let Some(tp) = &mut self.tp {
                    tp.vocab.get_or_insert(c.num_embeddings);
                }
                let first = self.tape.params.len();
                let y = self.embedding(&local, &layer.name, x, train)?;
                self.mark_split(first);
                if style == TpStyle::Dtensor
                    && let Some(&w) = self.embeddings.get(&layer.name)
                {
                    // `embedding_dense_backward` has no row-wise strategy: its output is
                    // Replicate, the whole table, and AccumulateGrad keeps it as `.grad`.
                    let whole = Shape::from([c.num_embeddings, c.embedding_dim]);
                    self.tape.grad_shapes.insert(w, whole);
                }
                if sp && style == TpStyle::Megatron {
                    // `VocabParallelEmbedding`: `reduce_scatter_to_sequence_parallel_region`.
                    let shape = self.scaled(y, 1, false)?;
                    let out =
                        self.collective(y, AtenOp::ReduceScatter, shape, "reduce-scatter output")?;
                    self.mark(out, Lay::Seq);
                    Ok(out)
                } else {
                    let shape = self.val(y).shape.clone();
                    self.collective(y, AtenOp::AllReduce, shape, "all-reduce output")
                }
            }
            Op::Linear(c) if t > 1 && !in_block && vocab == Some(c.out_features) => {
                // The LM head: column-parallel over the vocabulary.
                let xw = self.tp_whole(x)?;
                let from = self.tape.steps.len();
                let local = LinearCfg {
                    out_features: c.out_features.div_ceil(t),
                    ..c.clone()
                };
                let first = self.tape.params.len();
                let y = self.linear_layer(&local, &layer.name, xw, train)?;
                self.mark_split(first);
                self.save_sharded(from, xw, x);
                if style == TpStyle::Megatron {
                    self.mark(y, Lay::Col);
                    return Ok(y);
                }
                // `funcol.all_gather_tensor(gather_dim=-1)`: all-gathered along dimension 0
                // into a buffer, then `torch.cat` of its chunks along the vocabulary.
                let mut buffer = self.val(y).shape.dims().to_vec();
                buffer[0] = checked(buffer[0].checked_mul(t), "the all-gather buffer")?;
                let dtype = self.val(y).dtype;
                let buffer = self.storage(
                    &Shape::new(buffer),
                    dtype,
                    StorageKind::Activation,
                    "all-gather buffer",
                )?;
                let rank = self.val(y).shape.rank();
                let shape = self.scaled(y, rank.saturating_sub(1), true)?;
                let rg = self.rg(y);
                let out = self.fresh(shape, dtype, "all-gathered logits", rg)?;
                self.call(Call::new(AtenOp::AllGather, vec![y], vec![out]).allocs(vec![buffer]))?;
                Ok(out)
            }
            Op::CrossEntropy(_) if self.lay(x) == Lay::Col && style == TpStyle::Megatron => {
                // `vocab_parallel_cross_entropy` on the rank's logits.
                self.op_inner(op, layer, inputs)
            }
            Op::Linear(c) if t > 1 && in_block => {
                if self.lay(x) == Lay::Col {
                    // Row-parallel: the input is the rank's features.
                    let local = LinearCfg {
                        in_features: None,
                        ..c.clone()
                    };
                    let first = self.tape.params.len();
                    let y = self.linear_layer(&local, &layer.name, x, train)?;
                    self.mark_split(first);
                    return self.tp_reduce(y);
                }
                if !c.out_features.is_multiple_of(t) || c.tie.is_some() {
                    let xw = self.tp_whole(x)?;
                    return self.op_inner(op, layer, &[xw]);
                }
                let xw = self.tp_whole(x)?;
                let from = self.tape.steps.len();
                let local = LinearCfg {
                    out_features: c.out_features / t,
                    ..c.clone()
                };
                let first = self.tape.params.len();
                let y = self.linear_layer(&local, &layer.name, xw, train)?;
                self.mark_split(first);
                self.save_sharded(from, xw, x);
                self.mark(y, Lay::Col);
                Ok(y)
            }
            Op::Attention(c) if (t > 1 && in_block) || cp > 1 => {
                let xw = self.tp_whole(x)?;
                let h = self.last_dim(&self.val(xw).clone(), "attention")?;
                let hd = match c.head_dim {
                    Some(d) => d,
                    None if h.is_multiple_of(c.heads) => h / c.heads,
                    None => {
                        return Err(self.err(format!(
                            "hidden size {h} is not divisible by {} heads; set head_dim",
                            c.heads
                        )));
                    }
                };
                let split = t > 1 && in_block;
                let tt = if split { t } else { 1 };
                if !c.heads.is_multiple_of(tt) || !c.kv_heads.is_multiple_of(tt) {
                    return Err(Error::setting(
                        crate::error::SettingKey::Parallel,
                        format!(
                            "--tp {t} must divide the attention heads ({}) and key/value heads ({}) of `{}`",
                            c.heads, c.kv_heads, layer.name
                        ),
                    ));
                }
                let local = crate::graph::AttentionCfg {
                    heads: c.heads / tt,
                    kv_heads: c.kv_heads / tt,
                    head_dim: Some(hd),
                    ..*c
                };
                let from = self.tape.steps.len();
                let first = self.tape.params.len();
                let y = self.attention(xw, xw, &local, train)?;
                if split {
                    self.mark_split(first);
                }
                self.save_sharded(from, xw, x);
                if cp > 1 {
                    // Ring attention: the key and value chunks received while the current
                    // ones are in use.
                    let (b, s, _) = self.bsh(&self.val(xw).clone())?;
                    let kv = self.val(y).dtype;
                    let shape = Shape::from([2, b, local.kv_heads, s, hd]);
                    let buf = self.storage(
                        &shape,
                        kv,
                        StorageKind::Activation,
                        "ring key/value buffers",
                    )?;
                    self.call(
                        Call::new(AtenOp::RingExchange, vec![y], Vec::new()).allocs(vec![buf]),
                    )?;
                }
                if split { self.tp_reduce(y) } else { Ok(y) }
            }
            Op::CrossAttention(_) | Op::Moe(_) | Op::Mla(_) | Op::DisentangledAttention(_)
                if t > 1 =>
            {
                // Megatron splits these too (below); memest does not model their split, and
                // tracing them whole on every rank would be a silently wrong figure.
                let (what, how) = match op {
                    Op::Moe(_) => (
                        "a mixture-of-experts layer",
                        "Megatron-Core's expert tensor parallelism, `expert_tensor_parallel_size`, splits each expert's MLP columns and rows as a dense MLP's; --ep divides the experts across GPUs instead",
                    ),
                    Op::DisentangledAttention(_) => (
                        "a disentangled attention layer",
                        "Megatron-style splitting would divide its heads and its relative projections column-parallel",
                    ),
                    Op::Mla(_) => (
                        "a multi-head latent attention layer",
                        "Megatron-Core's `MLASelfAttention` divides its heads: query and key/value up-projections column-parallel, output projection row-parallel, the low-rank down-projections whole",
                    ),
                    _ => (
                        "a cross-attention layer",
                        "Megatron-LM divides its heads as self-attention's, the encoder output's key/value projections column-parallel",
                    ),
                };
                Err(Error::setting(
                    crate::error::SettingKey::Parallel,
                    format!(
                        "--tp {t}: `{}` is {what}, whose tensor-parallel split memest does not model yet ({how}); estimate without --tp",
                        layer.name
                    ),
                ))
            }
            Op::CrossAttention(_) | Op::Moe(_) => {
                // Context parallel: whole inputs (their split is not modelled).
                let whole = inputs
                    .iter()
                    .map(|&v| self.tp_whole(v))
                    .collect::<Result<Vec<_>, _>>()?;
                self.op_inner(op, layer, &whole)
            }
            Op::Activation(_) | Op::Dropout(_) | Op::Scale(_) | Op::Mul | Op::Add(_)
                if inputs.iter().all(|&v| self.lay(v) == Lay::Col) =>
            {
                let y = self.op_inner(op, layer, inputs)?;
                self.mark(y, Lay::Col);
                Ok(y)
            }
            Op::Activation(_)
            | Op::Dropout(_)
            | Op::Scale(_)
            | Op::Mul
            | Op::Add(_)
            | Op::LayerNorm(_)
            | Op::RmsNorm(_)
                if sp
                    && inputs.iter().any(|&v| self.lay(v) == Lay::Seq)
                    && inputs.iter().all(|&v| self.lay(v) != Lay::Col) =>
            {
                // The sequence-parallel region.
                let local = inputs
                    .iter()
                    .map(|&v| self.tp_slice(v))
                    .collect::<Result<Vec<_>, _>>()?;
                let y = self.op_inner(op, layer, &local)?;
                self.mark(y, Lay::Seq);
                Ok(y)
            }
            _ => {
                let whole = inputs
                    .iter()
                    .map(|&v| self.tp_whole(v))
                    .collect::<Result<Vec<_>, _>>()?;
                self.op_inner(op, layer, &whole)
            }
        }
    }
}
