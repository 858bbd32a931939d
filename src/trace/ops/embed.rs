//! `embedding`, `position_embedding`, `token_type_embedding`, `rotary`,
//! `relative_position_bias`.

#[allow(clippy::wildcard_imports)]
use super::*;
use crate::graph::{
    EmbeddingCfg, PositionEmbeddingCfg, RelativePositionBiasCfg, RotaryCfg, TokenTypeEmbeddingCfg,
};

/// Ids `[B, ..] → [B, .., D]`.
pub(super) fn embedding_shape(c: &EmbeddingCfg, ids: &Shape) -> Shape {
    let mut dims = ids.dims().to_vec();
    dims.push(c.embedding_dim);
    Shape::new(dims)
}

/// A position table keeps `[B, S, D]`; `S` must not exceed the table.
pub(super) fn position_shape(c: &PositionEmbeddingCfg, x: &Shape) -> Result<Shape, ShapeError> {
    match *x.dims() {
        [_, s, _] if s > c.num_positions => invalid(format!(
            "sequence length {s} exceeds num_positions = {}",
            c.num_positions
        )),
        _ => Ok(x.clone()),
    }
}

impl Tracer<'_> {
    /// `nn.Embedding`: derivatives.yaml `embedding` saves the indices only.
    pub(in crate::trace) fn embedding(
        &mut self,
        c: &EmbeddingCfg,
        name: &str,
        x: ValueId,
        train: bool,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        if xv.dtype.is_float() {
            return Err(self.err(format!(
                "input is {} {}, expected integer token ids (set input.dtype = \"int64\")",
                xv.dtype, xv.shape
            )));
        }
        let shape = Shape::from([c.num_embeddings, c.embedding_dim]);
        let w = match (&c.tie, self.stack_dtype(name)) {
            (Some(tied), _) => self.tied(tied, c.num_embeddings, c.embedding_dim)?,
            (None, Some(d)) => {
                let trainable = train && self.s.lora.is_none();
                self.param_typed(shape, trainable, None, d)?
            }
            (None, None) => self.param(shape, train)?,
        };
        self.embeddings.insert(name.to_string(), w);
        let dtype = self.val(w).dtype;
        let rg = self.rg(w);
        let y = self.fresh(embedding_shape(c, &xv.shape), dtype, "output", rg)?;
        self.call(Call::new(AtenOp::Embedding, vec![w, x], vec![y]))?;
        Ok(y)
    }

    /// Keeps `values` alive as Python locals do: until the enclosing block returns, or outside
    /// blocks until the base model's forward returns ([`Tape::forward_held`]).
    pub(super) fn keep_to_return(&mut self, values: &[ValueId]) {
        if let Some(top) = self.block_kept.last_mut() {
            top.extend_from_slice(values);
        } else {
            let storages: Vec<StorageId> = values.iter().map(|&v| self.val(v).storage).collect();
            self.tape.forward_held.extend(storages);
        }
    }

    /// A learned position table added to `[B, S, D]`.
    pub(super) fn position_embedding(
        &mut self,
        c: &PositionEmbeddingCfg,
        x: ValueId,
        train: bool,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let (_, s, h) = self.bsh(&xv)?;
        self.shaped(position_shape(c, &xv.shape))?;
        let w = self.param(Shape::from([c.num_positions, h]), train)?;
        if c.mask_buffer > 0 {
            self.buffer(
                Shape::from([c.mask_buffer, c.mask_buffer]),
                DType::Bool,
                "causal mask buffer",
            )?;
        }
        let (bsz, ..) = self.bsh(&xv)?;
        if c.ids_per_batch {
            if c.ids_buffer > 0 {
                self.buffer(Shape::from([1, c.ids_buffer]), DType::Int64, "position ids")?;
            }
            let ids = self.storage(
                &Shape::from([bsz, s]),
                DType::Int64,
                StorageKind::Activation,
                "position ids from input ids",
            )?;
            return self.add_lookup(
                x,
                w,
                ids,
                Shape::from([bsz, s]),
                Shape::from([bsz, s, h]),
                "position embeddings",
            );
        }
        let ids = if c.ids_buffer > 0 {
            self.buffer(Shape::from([1, c.ids_buffer]), DType::Int64, "position ids")?
        } else {
            self.storage(
                &Shape::from([1, s]),
                DType::Int64,
                StorageKind::Activation,
                "position ids",
            )?
        };
        let y = self.add_lookup(
            x,
            w,
            ids,
            Shape::from([1, s]),
            Shape::from([1, s, h]),
            "position embeddings",
        )?;
        if c.model_locals {
            // `inputs_embeds` and `position_embeds`: the sum's two inputs.
            let summed = self
                .tape
                .steps
                .last()
                .map(|st| st.inputs.clone())
                .unwrap_or_default();
            self.keep_to_return(&summed);
        }
        Ok(y)
    }

    /// A learned token-type table looked up with all-zero ids and added to `[B, S, D]`.
    pub(super) fn token_type_embedding(
        &mut self,
        c: &TokenTypeEmbeddingCfg,
        x: ValueId,
        train: bool,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let (bsz, s, h) = self.bsh(&xv)?;
        if c.ids_buffer > 0 && s > c.ids_buffer {
            return Err(self.err(format!(
                "sequence length {s} exceeds the ids buffer ({})",
                c.ids_buffer
            )));
        }
        let w = self.param(Shape::from([c.num_types, h]), train)?;
        // All-zero type ids: an expanded view of the module's buffer, or a new tensor.
        let ids = if c.ids_per_batch {
            // RobertaEmbeddings gathers `[B, S]` ids at the position ids.
            if c.ids_buffer > 0 {
                self.buffer(
                    Shape::from([1, c.ids_buffer]),
                    DType::Int64,
                    "token type ids",
                )?;
            }
            self.storage(
                &Shape::from([bsz, s]),
                DType::Int64,
                StorageKind::Activation,
                "gathered token type ids",
            )?
        } else if c.ids_buffer > 0 {
            // BertEmbeddings gathers `[1, S]` ids out of its buffer: a new tensor.
            self.buffer(
                Shape::from([1, c.ids_buffer]),
                DType::Int64,
                "token type ids",
            )?;
            self.storage(
                &Shape::from([1, s]),
                DType::Int64,
                StorageKind::Activation,
                "gathered token type ids",
            )?
        } else {
            self.storage(
                &Shape::from([bsz, s]),
                DType::Int64,
                StorageKind::Activation,
                "token type ids",
            )?
        };
        self.add_lookup(
            x,
            w,
            ids,
            Shape::from([bsz, s]),
            Shape::from([bsz, s, h]),
            "token type embeddings",
        )
    }

    /// Rotary tables: buffers `inv_freq` and `original_inv_freq`, and `cos`/`sin`
    /// `[1, S, head_dim]` shared by every attention layer after it; passes `x` through.
    pub(super) fn rotary(&mut self, c: &RotaryCfg, x: ValueId) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let (batch, seq, _) = self.bsh(&xv)?;
        let half = c.head_dim / 2;
        let bdt = self.param_dtype();
        if c.inv_freq {
            self.buffer(Shape::from([half]), bdt, "inv_freq")?;
            self.buffer(Shape::from([half]), bdt, "original_inv_freq")?;
        }
        // cos and sin, [1, S, head_dim] (per sample: [B, S, head_dim]; GPT-OSS's half tables
        // [1, S, head_dim/2]) in the activation dtype, shared by every layer; S counts the
        // `extra_positions` too.
        let seq = seq
            .checked_add(c.extra_positions)
            .ok_or_else(|| Error::Overflow("the rotary table length".into()))?;
        let width = if c.half_tables { half } else { c.head_dim };
        let table = Shape::from([if c.per_sample { batch } else { 1 }, seq, width]);
        let dt = if self.s.amp.is_some() || c.tables_f32 {
            DType::Float32
        } else {
            self.act_dtype()
        };
        let cos = self.storage(&table, dt, StorageKind::Activation, "rope cos")?;
        let sin = self.storage(&table, dt, StorageKind::Activation, "rope sin")?;
        self.call(Call::new(AtenOp::RotaryTables, Vec::new(), Vec::new()).allocs(vec![cos, sin]))?;
        self.tape.forward_held.extend([cos, sin]);
        let rope = Some(Rope {
            cos,
            sin,
            concat: c.concat || c.concat_each,
            concat_each: c.concat_each,
            interleaved: c.interleaved,
            per_sample: c.per_sample,
            tables_f32: c.tables_f32,
            upcast: c.upcast,
            half: c.half_tables,
        });
        if c.local {
            self.rope_local = rope;
        } else {
            self.rope = rope;
        }
        Ok(x)
    }

    /// T5Attention.compute_bias: int64 bucket ids `[S, S]` (kept by the embedding lookup),
    /// values `[S, S, heads]` permuted to a `[1, heads, S, S]` bias; passes `x` through.
    pub(super) fn relative_position_bias(
        &mut self,
        c: &RelativePositionBiasCfg,
        x: ValueId,
        train: bool,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let (_, s, _) = self.bsh(&xv)?;
        let w = self.param(Shape::from([c.num_buckets, c.heads]), train)?;
        let buckets = self.storage(
            &Shape::from([s, s]),
            DType::Int64,
            StorageKind::Activation,
            "relative position buckets",
        )?;
        let ids = self.value(
            buckets,
            Shape::from([s, s]),
            DType::Int64,
            Layout::Contiguous,
            false,
            false,
        );
        self.call(Call::new(
            AtenOp::RelativePositionBucket,
            Vec::new(),
            vec![ids],
        ))?;
        let rg = self.rg(w);
        let bias = self.fresh(
            Shape::from([1, c.heads, s, s]),
            self.act_dtype(),
            "position bias",
            rg,
        )?;
        self.call(Call::new(AtenOp::Embedding, vec![w, ids], vec![bias]))?;
        self.position_bias = Some(bias);
        Ok(x)
    }

    /// `x + table[ids]` (learned position and token-type tables): the lookup keeps its ids,
    /// which are a new tensor unless they are a view of a buffer.
    fn add_lookup(
        &mut self,
        x: ValueId,
        w: ValueId,
        ids: StorageId,
        ids_shape: Shape,
        out_shape: Shape,
        what: &'static str,
    ) -> Result<ValueId, Error> {
        let ids_v = self.value(ids, ids_shape, DType::Int64, Layout::Strided, false, false);
        let rg = self.rg(w);
        let looked_up = self.fresh(out_shape, self.param_dtype(), what, rg)?;
        let allocs = if self.tape.storages[ids].kind == StorageKind::Activation {
            vec![ids]
        } else {
            Vec::new()
        };
        self.call(Call::new(AtenOp::Embedding, vec![w, ids_v], vec![looked_up]).allocs(allocs))?;
        self.add(&[x, looked_up], false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedding_appends_the_dimension() {
        let c = EmbeddingCfg {
            num_embeddings: 10,
            embedding_dim: 8,
            tie: None,
        };
        assert_eq!(
            embedding_shape(&c, &Shape::from([2, 5])),
            Shape::from([2, 5, 8])
        );
    }

    #[test]
    fn position_table_bounds_the_sequence() {
        let c = PositionEmbeddingCfg {
            num_positions: 4,
            ids_buffer: 0,
            ids_per_batch: false,
            mask_buffer: 0,
            model_locals: false,
        };
        assert!(position_shape(&c, &Shape::from([2, 4, 8])).is_ok());
        assert!(position_shape(&c, &Shape::from([2, 5, 8])).is_err());
    }
}
