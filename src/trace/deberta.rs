//! DeBERTa-v2 (transformers 5, `models/deberta_v2/modeling_deberta_v2.py`): the embeddings'
//! padding mask, the encoder's relative positions and disentangled self-attention.

#[allow(clippy::wildcard_imports)]
use super::*;
use crate::graph::{DisentangledAttentionCfg, LayerNormCfg, PaddingMaskCfg, RelativeEmbeddingsCfg};

/// What a `relative_embeddings` layer leaves for the `disentangled_attention` layers after it:
/// the encoder's locals `rel_embeddings`, `relative_pos` and `attention_mask`.
#[derive(Clone, Copy, Debug)]
pub(super) struct DebertaRel {
    /// The relative embeddings `[2·span, H]` (the table, or its LayerNorm).
    table: ValueId,
    /// The float32 attention mask `[B, 1, S, S]`.
    mask: StorageId,
    /// The span the table was built for.
    span: u64,
    /// Batch and sequence length they were built for.
    batch: u64,
    seq: u64,
}

impl Tracer<'_> {
    /// `DebertaV2Embeddings`' `embeddings * mask` with the all-ones float32 `[B, S]` mask that
    /// `DebertaV2Model.forward` makes (`torch.ones(input_shape)`, a local until the model
    /// returns; made by the first `padding_mask`, read by the others), unsqueezed to
    /// `[B, S, 1]` and cast to the activation dtype (`mask.to(dtype)`: a new tensor unless
    /// float32); `mul` keeps it for the embeddings' gradient. With `fill`, `ConvLayer`'s
    /// `masked_fill_` of `(1 - mask).bool()` in place, which keeps the bool mask. See
    /// [`PaddingMaskCfg`].
    pub(super) fn padding_mask(
        &mut self,
        c: &PaddingMaskCfg,
        x: ValueId,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let (b, s, _) = self.bsh(&xv)?;
        if !xv.dtype.is_float() {
            return Err(self.err(format!(
                "input is {} {}, expected float embeddings",
                xv.dtype, xv.shape
            )));
        }
        if c.ids_buffer > 0 {
            self.buffer(Shape::from([1, c.ids_buffer]), DType::Int64, "position ids")?;
        }
        let ones = match self.padding_ones {
            Some(ones) if self.tape.storages[ones].shape.dims() == [b, s] => ones,
            _ => {
                let ones = self.storage(
                    &Shape::from([b, s]),
                    DType::Float32,
                    StorageKind::Activation,
                    "all-ones attention mask",
                )?;
                self.call(Call::new(AtenOp::Ones, Vec::new(), Vec::new()).allocs(vec![ones]))?;
                self.tape.forward_held.push(ones);
                self.padding_ones = Some(ones);
                ones
            }
        };
        if c.fill {
            // `rmask = (1 - input_mask).bool()`, then `out.masked_fill_(rmask…, 0)`.
            let shape = Shape::from([b, s]);
            let ones_v = self.value(
                ones,
                shape.clone(),
                DType::Float32,
                Layout::Contiguous,
                false,
                false,
            );
            let diff = self.storage(&shape, DType::Float32, StorageKind::Activation, "1 - mask")?;
            let rmask = self.fresh(shape, DType::Bool, "inverted padding mask", false)?;
            self.call(
                Call::new(AtenOp::InvertPaddingMask, vec![ones_v], vec![rmask]).allocs(vec![diff]),
            )?;
            let y = self.view_of(x, xv.shape.clone(), Layout::Contiguous);
            let rmask = self.sid(rmask);
            self.call(Call::new(AtenOp::MaskedFillInplace, vec![x], vec![y]).aux(vec![rmask]))?;
            return Ok(y);
        }
        let shape = Shape::from([b, s, 1]);
        let mask = self.value(
            ones,
            shape.clone(),
            DType::Float32,
            Layout::Contiguous,
            false,
            false,
        );
        let mask = if xv.dtype == DType::Float32 {
            mask
        } else {
            let m = self.fresh(shape, xv.dtype, "padding mask copy", false)?;
            self.call(Call::new(AtenOp::ToCopy, vec![mask], vec![m]))?;
            m
        };
        self.mul(x, mask)
    }

    /// `DebertaV2Encoder`'s relative-position inputs, see [`RelativeEmbeddingsCfg`]: the float32
    /// `[B, 1, S, S]` attention mask (`get_attention_mask`), the int64 `[1, S, S]` relative
    /// positions (`build_relative_position`; bucketed, `make_log_bucket_position` computes an
    /// int64 difference and a float32 bucket matrix `[S, S]` before the final int64 cast), and
    /// the table `rel_embeddings.weight` `[2·span, H]`, layer-normalized with `norm`. All three
    /// are locals of the encoder's `forward` (held until the model returns). Passes `x`
    /// through.
    pub(super) fn relative_embeddings(
        &mut self,
        c: &RelativeEmbeddingsCfg,
        x: ValueId,
        train: bool,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let (b, s, h) = self.bsh(&xv)?;
        let rows = checked(c.span.checked_mul(2), "the relative embedding rows")?;
        let mask = self.storage(
            &Shape::from([b, 1, s, s]),
            DType::Float32,
            StorageKind::Activation,
            "attention mask",
        )?;
        self.call(Call::new(AtenOp::GetAttentionMask, Vec::new(), Vec::new()).allocs(vec![mask]))?;
        let square = Shape::from([s, s]);
        let mut allocs = Vec::new();
        if c.buckets {
            allocs.push(self.storage(
                &square,
                DType::Int64,
                StorageKind::Activation,
                "relative position difference",
            )?);
            allocs.push(self.storage(
                &square,
                DType::Float32,
                StorageKind::Activation,
                "log-bucketed positions",
            )?);
        }
        let positions = self.storage(
            &Shape::from([1, s, s]),
            DType::Int64,
            StorageKind::Activation,
            "relative positions",
        )?;
        allocs.push(positions);
        self.call(Call::new(AtenOp::BuildRelativePosition, Vec::new(), Vec::new()).allocs(allocs))?;
        let w = self.param(Shape::from([rows, h]), train)?;
        let table = if c.norm {
            let ln = LayerNormCfg {
                affine: true,
                bias: true,
                upcast: false,
                cohere: false,
            };
            self.layer_norm(&ln, w, train)?
        } else {
            w
        };
        self.tape
            .forward_held
            .extend([mask, positions, self.sid(table)]);
        self.deberta = Some(DebertaRel {
            table,
            mask,
            span: c.span,
            batch: b,
            seq: s,
        });
        Ok(x)
    }

    /// `DisentangledSelfAttention.forward` and `attention.output.dense`, see
    /// [`DisentangledAttentionCfg`]. Each projection is split into heads by
    /// `transpose_for_scores` (`view`, `permute`, a contiguous copy `[B·heads, S, head_dim]`).
    /// The content scores: `kᵀ / scale` (a new tensor; `div` keeps the 0-dim scale), `bmm`
    /// keeping `q` and it. The relative scores (`disentangled_attention_bias`): the dropped-out
    /// table is projected per head and `repeat`ed over the batch (`[B·heads, 2·span,
    /// head_dim]`); c2p: `bmm(q, pos_kᵀ)` `[B·heads, S, 2·span]`, `gather` of it at the clamped
    /// positions (keeping it and its int64 `[1, 1, S, S]` index), divided by the scale, added to
    /// 0 (a new tensor); p2c: `bmm(k, pos_qᵀ)`, its `gather` transposed, divided, added in
    /// place. The sum with the content scores is masked (`masked_fill` keeps the inverted bool
    /// mask `[B, 1, S, S]`), soft-maxed (keeping its output), dropped out and multiplied by the
    /// values (`bmm` keeping both); the heads are merged by a contiguous copy. The gathers'
    /// outputs live until the bias function returns; the relative scores, the masked scores and
    /// the bool mask until `forward` returns.
    #[allow(clippy::too_many_lines)] // the module's forward, in order
    pub(super) fn disentangled_attention(
        &mut self,
        x: ValueId,
        c: &DisentangledAttentionCfg,
        train: bool,
    ) -> Result<ValueId, Error> {
        let (xv, (b, s, h)) = self.hidden_states(x)?;
        let n = c.heads;
        let d = match c.head_dim {
            Some(d) => d,
            None if h.is_multiple_of(n) => h / n,
            None => {
                return Err(self.err(format!(
                    "hidden size {h} is not divisible by {n} heads; set head_dim"
                )));
            }
        };
        let width = checked(n.checked_mul(d), "the attention width")?;
        let bn = checked(b.checked_mul(n), "batch × heads")?;
        let rows = checked(c.span.checked_mul(2), "the relative embedding rows")?;
        let rel = self.deberta.ok_or_else(|| {
            self.err(
                "`disentangled_attention` needs a `relative_embeddings` layer earlier in the model"
                    .into(),
            )
        })?;
        if rel.span != c.span || rel.batch != b || rel.seq != s {
            return Err(self.err(format!(
                "the relative embeddings were built for span {} and input [{}, {}, ..], this layer has span {} and input {}",
                rel.span, rel.batch, rel.seq, c.span, xv.shape
            )));
        }
        let tv = self.val(rel.table).clone();
        if tv.shape.dims() != [rows, h] {
            return Err(self.err(format!(
                "the relative embeddings are {}, expected [{rows}, {h}]",
                tv.shape
            )));
        }
        // query_proj, key_proj, value_proj.
        let proj = |t: &mut Self, target: &str| -> Result<(ValueId, ValueId, ValueId), Error> {
            let quantize = t.quantizable(true, target);
            let w = t.weight(Shape::from([width, h]), train, quantize)?;
            let bias = t.param(Shape::from([width]), train)?;
            let y = t.base_projection(x, w, Some(bias), (h, width), target)?;
            Ok((t.per_head(y, n, d)?, w, bias))
        };
        let (q, wq, bq) = proj(self, "q")?;
        let (k, wk, bk) = proj(self, "k")?;
        let (v, _, _) = proj(self, "v")?;
        // Content scores.
        let kt = self.view_op(
            k,
            Shape::from([bn, d, s]),
            Layout::LastTwoSwapped,
            AtenOp::Transpose,
            true,
        );
        let ks = self.div_by_scale(kt)?;
        let qa = self.autocast_input(q)?;
        let ksa = self.autocast_input(ks)?;
        let scores = self.bmm_heads(qa, ksa, Shape::from([bn, s, s]), "scores")?;
        // Relative scores.
        let dropped = self.dropout(rel.table, c.pos_dropout, false)?;
        let table = self.view_op(
            dropped,
            Shape::from([1, rows, h]),
            Layout::Contiguous,
            AtenOp::View,
            true,
        );
        let own = |t: &mut Self| -> Result<(ValueId, ValueId), Error> {
            Ok((
                t.param(Shape::from([width, h]), train)?,
                t.param(Shape::from([width]), train)?,
            ))
        };
        let (pos_q, pos_k) = if c.share_att_key {
            let pq = self.relative_heads(table, (wq, bq), bn, n, d)?;
            let pk = self.relative_heads(table, (wk, bk), bn, n, d)?;
            (Some(pq), Some(pk))
        } else {
            let pk = if c.c2p {
                let wb = own(self)?;
                Some(self.relative_heads(table, wb, bn, n, d)?)
            } else {
                None
            };
            let pq = if c.p2c {
                let wb = own(self)?;
                Some(self.relative_heads(table, wb, bn, n, d)?)
            } else {
                None
            };
            (pq, pk)
        };
        let mut score: Option<ValueId> = None;
        let mut gathered = Vec::new();
        if let (true, Some(pk)) = (c.c2p, pos_k) {
            let pkt = self.view_op(
                pk,
                Shape::from([bn, d, rows]),
                Layout::LastTwoSwapped,
                AtenOp::Transpose,
                true,
            );
            let pkt = self.autocast_input(pkt)?;
            let att = self.bmm_heads(qa, pkt, Shape::from([bn, s, rows]), "c2p scores")?;
            let g = self.relative_gather(att, bn, s, 1)?;
            gathered.push(g);
            let scaled = self.div_by_scale(g)?;
            score = Some(self.unary(scaled, AtenOp::AddScalar)?);
        }
        if let (true, Some(pq)) = (c.p2c, pos_q) {
            let pqt = self.view_op(
                pq,
                Shape::from([bn, d, rows]),
                Layout::LastTwoSwapped,
                AtenOp::Transpose,
                true,
            );
            let ka = self.autocast_input(k)?;
            let pqt = self.autocast_input(pqt)?;
            let att = self.bmm_heads(ka, pqt, Shape::from([bn, s, rows]), "p2c scores")?;
            let g = self.relative_gather(att, bn, s, 2)?;
            gathered.push(g);
            let gt = self.view_op(
                g,
                Shape::from([bn, s, s]),
                Layout::LastTwoSwapped,
                AtenOp::Transpose,
                true,
            );
            let scaled = self.div_by_scale(gt)?;
            score = Some(match score {
                Some(acc) => self.add(&[acc, scaled], true)?,
                None => self.unary(scaled, AtenOp::AddScalar)?,
            });
        }
        // `c2p_att` and `p2c_att` (the gathers' outputs) are locals of the bias function.
        for g in gathered {
            self.keep_until_here(g);
        }
        let rel_att = score.ok_or(Error::Internal(
            "disentangled attention without c2p or p2c passed the graph check",
        ))?;
        let summed = self.add(&[scores, rel_att], false)?;
        let summed = self.view_op(
            summed,
            Shape::from([b, n, s, s]),
            Layout::Contiguous,
            AtenOp::View,
            true,
        );
        // `attention_mask.bool()`, then `masked_fill(~mask, min)`.
        let mask_shape = Shape::from([b, 1, s, s]);
        let mask = self.value(
            rel.mask,
            mask_shape.clone(),
            DType::Float32,
            Layout::Contiguous,
            false,
            false,
        );
        let bool_mask = self.fresh(
            mask_shape.clone(),
            DType::Bool,
            "bool attention mask",
            false,
        )?;
        self.call(Call::new(AtenOp::ToCopy, vec![mask], vec![bool_mask]))?;
        let inverted = self.fresh(mask_shape, DType::Bool, "inverted attention mask", false)?;
        self.call(Call::new(
            AtenOp::BitwiseNot,
            vec![bool_mask],
            vec![inverted],
        ))?;
        let sv = self.val(summed).clone();
        let masked = self.fresh(
            sv.shape.clone(),
            sv.dtype,
            "masked scores",
            sv.requires_grad,
        )?;
        let inverted_storage = self.sid(inverted);
        self.call(
            Call::new(AtenOp::MaskedFill, vec![summed], vec![masked]).aux(vec![inverted_storage]),
        )?;
        let probs_in = if self.autocast_f32_norms() {
            self.upcast_f32(masked)?
        } else {
            masked
        };
        let probs = self.unary(probs_in, AtenOp::Softmax)?;
        let probs = self.dropout(probs, c.dropout, false)?;
        let probs = self.view_op(
            probs,
            Shape::from([bn, s, s]),
            Layout::Contiguous,
            AtenOp::View,
            true,
        );
        let probs = self.autocast_input(probs)?;
        let va = self.autocast_input(v)?;
        let ctx = self.bmm_heads(probs, va, Shape::from([bn, s, d]), "context")?;
        // Merge the heads: `view`, `permute(0, 2, 1, 3)`, `contiguous`, `view`.
        let merged = self.swap_heads(
            ctx,
            [b, n, s, d],
            Layout::Strided,
            Shape::from([b, s, width]),
        )?;
        // `forward`'s locals: `rel_att`, `attention_scores` (masked), `attention_mask` (bool).
        for kept in [rel_att, masked, bool_mask] {
            self.keep_until_here(kept);
        }
        self.projection(merged, width, h, true, train, "o")
    }

    /// `transpose_for_scores` of a `[rows_batch, R, heads·head_dim]` projection: `view`
    /// `[.., heads, head_dim]`, `permute(0, 2, 1, 3)`, a contiguous copy, `view`
    /// `[rows_batch·heads, R, head_dim]`.
    fn per_head(&mut self, t: ValueId, n: u64, d: u64) -> Result<ValueId, Error> {
        let tv = self.val(t).clone();
        let &[bb, r, _] = tv.shape.dims() else {
            return Err(Error::Internal("a projection is rank 3"));
        };
        let rows = checked(bb.checked_mul(n), "batch × heads")?;
        self.swap_heads(
            t,
            [bb, r, n, d],
            Layout::HeadsTransposed,
            Shape::from([rows, r, d]),
        )
    }

    /// `t.view(split).permute(0, 2, 1, 3).contiguous().view(out)`: the head split of
    /// `transpose_for_scores` and the head merge after attention. The views copy nothing, the
    /// permuted view has `layout`, and `contiguous` makes the one copy.
    fn swap_heads(
        &mut self,
        t: ValueId,
        split: [u64; 4],
        layout: Layout,
        out: Shape,
    ) -> Result<ValueId, Error> {
        let [a, b, c, d] = split;
        let split = self.view_op(
            t,
            Shape::from(split),
            Layout::Contiguous,
            AtenOp::View,
            true,
        );
        let swapped = self.view_op(
            split,
            Shape::from([a, c, b, d]),
            layout,
            AtenOp::Permute,
            true,
        );
        let swapped = self.contiguous(swapped)?;
        Ok(self.view_op(swapped, out, Layout::Contiguous, AtenOp::View, true))
    }

    /// The relative embeddings `[1, 2·span, H]` projected by `(w, b)` (`pos_key_proj`,
    /// `pos_query_proj`, or the shared `key_proj`/`query_proj`), split into heads and
    /// `repeat`ed over the batch: `[B·heads, 2·span, head_dim]`.
    fn relative_heads(
        &mut self,
        table: ValueId,
        (w, bias): (ValueId, ValueId),
        bn: u64,
        n: u64,
        d: u64,
    ) -> Result<ValueId, Error> {
        let width = checked(n.checked_mul(d), "the attention width")?;
        let y = self.linear(table, w, Some(bias), width)?;
        let heads = self.per_head(y, n, d)?;
        let hv = self.val(heads).clone();
        let rows = hv.shape.dims()[1];
        let out = self.fresh(
            Shape::from([bn, rows, d]),
            hv.dtype,
            "repeated relative projection",
            hv.requires_grad,
        )?;
        self.call(Call::new(AtenOp::Repeat, vec![heads], vec![out]))?;
        Ok(out)
    }

    /// `torch.gather(att, -1, index)` of `[B·heads, S, 2·span]` scores at the clamped relative
    /// positions (`which`: 1 content-to-position, `clamp(relative_pos + span, ..)`; 2
    /// position-to-content, `clamp(-relative_pos + span, ..)`, one more temporary): a new int64
    /// `[1, 1, S, S]` index, expanded; the gather keeps the scores and the index.
    fn relative_gather(
        &mut self,
        att: ValueId,
        bn: u64,
        s: u64,
        which: usize,
    ) -> Result<ValueId, Error> {
        let shape = Shape::from([1, 1, s, s]);
        let mut allocs = Vec::new();
        for _ in 0..which {
            allocs.push(self.storage(
                &shape,
                DType::Int64,
                StorageKind::Activation,
                "relative position sum",
            )?);
        }
        let index = self.storage(
            &shape,
            DType::Int64,
            StorageKind::Activation,
            "gather index",
        )?;
        allocs.push(index);
        self.call(Call::new(AtenOp::RelativeIndex, Vec::new(), Vec::new()).allocs(allocs))?;
        let av = self.val(att).clone();
        let g = self.fresh(
            Shape::from([bn, s, s]),
            av.dtype,
            "gathered relative scores",
            av.requires_grad,
        )?;
        self.call(Call::new(AtenOp::Gather, vec![att], vec![g]).aux(vec![index]))?;
        Ok(g)
    }

    /// `t / scale.to(t.dtype)` with `scale = torch.sqrt(torch.tensor(head_dim, dtype=float) *
    /// factor)` (`scaled_size_sqrt`): a new 0-dim float32 tensor (and its 0-dim copy in a 16-bit
    /// dtype), which `div` keeps; the quotient is a new tensor with `t`'s dimension order.
    fn div_by_scale(&mut self, t: ValueId) -> Result<ValueId, Error> {
        let tv = self.val(t).clone();
        let scalar = Shape::from([]);
        let scale32 = self.storage(
            &scalar,
            DType::Float32,
            StorageKind::Activation,
            "attention scale",
        )?;
        let (scale, allocs) = if tv.dtype == DType::Float32 {
            (scale32, vec![scale32])
        } else {
            let cast = self.storage(
                &scalar,
                tv.dtype,
                StorageKind::Activation,
                "attention scale copy",
            )?;
            (cast, vec![scale32, cast])
        };
        let y = self.fresh(tv.shape.clone(), tv.dtype, "scaled", tv.requires_grad)?;
        self.tape.values[y].layout = match tv.layout {
            Layout::LastTwoSwapped => Layout::LastTwoSwapped,
            _ => Layout::Contiguous,
        };
        self.call(
            Call::new(AtenOp::Div, vec![t], vec![y])
                .aux(vec![scale])
                .allocs(allocs),
        )?;
        Ok(y)
    }

    /// `torch.bmm` of two `[B·heads, .., ..]` activations: keeps both.
    fn bmm_heads(
        &mut self,
        a: ValueId,
        b: ValueId,
        out: Shape,
        what: &'static str,
    ) -> Result<ValueId, Error> {
        let rg = self.rg(a) || self.rg(b);
        let dtype = self.val(a).dtype;
        let y = self.fresh(out, dtype, what, rg)?;
        self.call(Call::new(AtenOp::Bmm, vec![a, b], vec![y]))?;
        Ok(y)
    }
}
