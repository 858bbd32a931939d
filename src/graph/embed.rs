//! `embedding`, `position_embedding`, `token_type_embedding`, `rotary`,
//! `relative_position_bias`.

use super::keys::{KeyReader, key};

/// `nn.Embedding`: ids `[B, ..] → [B, .., D]`; params `N·D`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmbeddingCfg {
    /// Vocabulary size N.
    pub num_embeddings: u64,
    /// Embedding size D.
    pub embedding_dim: u64,
    /// Name of an earlier embedding whose weight this one shares (T5's decoder `embed_tokens` is
    /// the shared table).
    pub tie: Option<String>,
}

impl EmbeddingCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = EmbeddingCfg {
            num_embeddings: r.pos(key!(s.num_embeddings)),
            embedding_dim: r.pos(key!(s.embedding_dim)),
            tie: r.opt(key!(s.tie)),
        };
        r.finish()?;
        Ok(cfg)
    }
}

/// A learned absolute position table added to `[B, S, D]`: params `positions·D`; with
/// `ids_buffer` the module holds an int64 `[1, ids_buffer]` id buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PositionEmbeddingCfg {
    /// Rows of the table.
    pub num_positions: u64,
    /// Length of a registered int64 id buffer (0 for none).
    pub ids_buffer: u64,
    /// The ids are computed from the input ids, an int64 `[B, S]` tensor per batch that the
    /// lookup keeps (RoBERTa's `create_position_ids_from_input_ids`: `cumsum` of the non-padding
    /// mask, plus `padding_idx`), instead of a slice of the buffer.
    pub ids_per_batch: bool,
    /// The model registers a boolean `[mask_buffer, mask_buffer]` lower-triangular mask buffer
    /// that its forward never reads (GPT-BigCode's `bias = torch.tril(torch.ones(n, n,
    /// dtype=torch.bool))`); 0 for none.
    pub mask_buffer: u64,
    /// The model's `forward` keeps the input (the token embeddings) and the looked-up position
    /// embeddings as locals until it returns (GPT2Model's and GPTBigCodeModel's
    /// `inputs_embeds` and `position_embeds`), instead of dropping them after the sum.
    pub model_locals: bool,
}

impl PositionEmbeddingCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = PositionEmbeddingCfg {
            num_positions: r.pos(key!(s.num_positions)),
            ids_buffer: r.or(key!(s.ids_buffer), 0),
            ids_per_batch: r.or(key!(s.ids_per_batch), false),
            mask_buffer: r.or(key!(s.mask_buffer), 0),
            model_locals: r.or(key!(s.model_locals), false),
        };
        r.finish()?;
        Ok(cfg)
    }
}

/// A learned token-type table (BERT's `token_type_embeddings`) looked up with all-zero ids and
/// added to `[B, S, D]`: params `types·D`; with `ids_buffer` the ids are an expanded view of an
/// int64 `[1, ids_buffer]` buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenTypeEmbeddingCfg {
    /// Rows of the table (key `num_embeddings`).
    pub num_types: u64,
    /// Length of the registered int64 id buffer (0 for none).
    pub ids_buffer: u64,
    /// The buffer is gathered at per-batch position ids, an int64 `[B, S]` tensor that the
    /// lookup keeps (RoBERTa: `torch.gather(buffer.expand(B, -1), 1, position_ids)`), instead
    /// of BERT's `[1, S]`.
    pub ids_per_batch: bool,
}

impl TokenTypeEmbeddingCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = TokenTypeEmbeddingCfg {
            num_types: r.pos(key!(s.num_embeddings)),
            ids_buffer: r.or(key!(s.ids_buffer), 0),
            ids_per_batch: r.or(key!(s.ids_per_batch), false),
        };
        r.finish()?;
        Ok(cfg)
    }
}

/// Rotary position embedding tables for the attention layers that set `rotary`: buffers
/// `inv_freq` and `original_inv_freq` (`head_dim/2` each); passes its input through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RotaryCfg {
    /// Head dimension (even).
    pub head_dim: u64,
    /// The rotated part is joined to the pass-through part with `torch.cat` (Phi-3's and
    /// partial-rotary code), which makes Q and K contiguous `[B, heads, S, head_dim]`.
    pub concat: bool,
    /// Like `concat`, but each of Q and K is joined right after its own rotation (Phi-3's
    /// `apply_rotary_pos_emb`), where GPT-NeoX's, Phi's and StableLM's code rotates both first.
    pub concat_each: bool,
    /// Each head's pairs are interleaved, `(x0, x1), (x2, x3), …`, and rotated by diffusers'
    /// `apply_rotary_emb` with `use_real_unbind_dim=-1` (Flux): `x.reshape(.., -1, 2)
    /// .unbind(-1)`, `torch.stack([-x_imag, x_real], -1)`, float32 products with the tables.
    pub interleaved: bool,
    /// `cos`/`sin` stay float32 whatever the activation dtype (OLMo-2's `Olmo2RotaryEmbedding`
    /// returns them uncast): `apply_rotary_pos_emb` then computes in float32 and casts Q and K
    /// back (`q_embed.to(q_type)`).
    pub tables_f32: bool,
    /// `[batch, S, head_dim]` tables, one row of positions per sample (Qwen2-VL's M-RoPE
    /// `position_ids` `[3, batch, S]`; its vision tower's patches of every image in one
    /// sequence), instead of `[1, S, head_dim]`.
    pub per_sample: bool,
    /// Q and K are cast to float32 and rotated there against tables in the activation dtype,
    /// then cast back (`upcast`; Cohere's `apply_rotary_pos_emb`: `q = q.float()`, ...,
    /// `q_embed.to(dtype=dtype)`).
    pub upcast: bool,
    /// The tables of the sliding-window layers (`local`): Gemma 3 computes a second pair of
    /// `cos`/`sin` with its local base frequency (`rope_local_base_freq`), which the
    /// attention layers with a `sliding_window` use; the others use the last table without
    /// this key.
    pub local: bool,
    /// `cos`/`sin` are `head_dim/2` wide (`half_tables`; GPT-OSS's `GptOssRotaryEmbedding`
    /// returns the frequencies uncatted) and `_apply_rotary_emb` rotates the two halves of each
    /// head against them (`x1·cos - x2·sin`, `x2·cos + x1·sin`), joined with `torch.cat`.
    pub half_tables: bool,
    /// Positions past the input's sequence that the tables also cover (Flux: the image tokens
    /// after the text's, `extra_positions`).
    pub extra_positions: u64,
    /// Whether the module registers transformers' `inv_freq` and `original_inv_freq` buffers
    /// (`inv_freq`, true); diffusers' `FluxPosEmbed` computes its tables from the position ids
    /// and registers none.
    pub inv_freq: bool,
}

impl RotaryCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = RotaryCfg {
            head_dim: r.pos(key!(s.head_dim)),
            concat: r.or(key!(s.concat), false),
            concat_each: r.or(key!(s.concat_each), false),
            interleaved: r.or(key!(s.interleaved), false),
            tables_f32: r.or(key!(s.tables_f32), false),
            per_sample: r.or(key!(s.per_sample), false),
            upcast: r.or(key!(s.upcast), false),
            local: r.or(key!(s.local), false),
            half_tables: r.or(key!(s.half_tables), false),
            extra_positions: r.or(key!(s.extra_positions), 0),
            inv_freq: r.or(key!(s.inv_freq), true),
        };
        r.finish()?;
        if !cfg.head_dim.is_multiple_of(2) {
            return Err(format!(
                "`head_dim` must be even for rotary embeddings, got {}",
                cfg.head_dim
            ));
        }
        Ok(cfg)
    }
}

/// T5's relative position bias: an embedding of `num_buckets × heads` looked up with an int64
/// `[S, S]` bucket matrix, giving a `[1, heads, S, S]` bias that later `attention` layers with
/// `position_bias = true` add to their scores; passes its input through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RelativePositionBiasCfg {
    /// Buckets (default 32, T5's).
    pub num_buckets: u64,
    /// Heads.
    pub heads: u64,
}

impl RelativePositionBiasCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = RelativePositionBiasCfg {
            num_buckets: r.pos_or(key!(s.num_buckets), 32),
            heads: r.pos(key!(s.heads)),
        };
        r.finish()?;
        Ok(cfg)
    }
}

/// DeBERTa-v2's encoder-level relative-position inputs (`DebertaV2Encoder`): the
/// `rel_embeddings` table `[2·num_positions, H]` (params `2·num_positions·H`), optionally
/// layer-normalized (`norm`: `norm_rel_ebd = "layer_norm"`, params `2·H`), the int64
/// `[1, S, S]` relative positions (`build_relative_position`, log-bucketed with
/// `num_buckets`) and the float32 `[B, 1, S, S]` attention mask built from the all-ones
/// `[B, S]` mask (`get_attention_mask`), which later `disentangled_attention` layers read. Passes
/// its input through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RelativeEmbeddingsCfg {
    /// Relative distance span (`position_buckets`, or `max_relative_positions`): the table has
    /// twice as many rows.
    pub span: u64,
    /// Log-bucketed positions (`position_buckets > 0`): `make_log_bucket_position`'s float
    /// temporaries while the positions are built.
    pub buckets: bool,
    /// A LayerNorm on the table.
    pub norm: bool,
}

impl RelativeEmbeddingsCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = RelativeEmbeddingsCfg {
            span: r.pos(key!(s.num_positions)),
            buckets: r.or(key!(s.num_buckets), 0) > 0,
            norm: r.or(key!(s.norm), false),
        };
        r.finish()?;
        Ok(cfg)
    }
}
