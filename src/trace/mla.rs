//! Multi-head latent attention (DeepSeek-V2/V3).

#[allow(clippy::wildcard_imports)]
use super::*;

impl Tracer<'_> {
    /// `DeepseekV3Attention.forward` (transformers 5, `modeling_deepseek_v3.py`), see
    /// [`MlaCfg`]. The queries: `q_a_proj`, its `LlamaRMSNorm`-style RMSNorm and `q_b_proj` (or
    /// `q_proj`), viewed per head and split into the pass-through and rotary parts (views). The
    /// keys and values: `kv_a_proj_with_mqa`, split into the latent (RMS-normalized, a new
    /// `[B, 1, S, kv_lora_rank]` tensor) and the shared rotary key (a view). Rotary embedding on
    /// the rotary parts (new tensors joined by `torch.cat`, keeping only the tables). The cache
    /// copies the two compressed parts (`DynamicCache.update`); `torch.cat` joins the query
    /// parts; `kv_b_proj` expands the (cached) latent to `[B, heads, S, nope + v]` per head, split
    /// into the keys' pass-through part and the values (views); the keys are a new
    /// `[B, heads, S, nope + rope]` tensor written by two `copy_` (which keep nothing). Attention
    /// runs as [`Self::attention`]'s kernels do, with a value width that may differ from the
    /// query's (the CPU's flash kernel then declines: math path); the heads are merged and
    /// `o_proj` maps them back.
    #[allow(clippy::too_many_lines)] // the projections, cache and kernel read best in order
    pub(super) fn mla(&mut self, x: ValueId, c: &MlaCfg, train: bool) -> Result<ValueId, Error> {
        let (xv, (b, s, h)) = self.hidden_states(x)?;
        let n = c.heads;
        let (nope, rope_d, vd, kvr) = (
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            c.kv_lora_rank,
        );
        let qk = checked(nope.checked_add(rope_d), "the query/key head width")?;
        let q_width = checked(n.checked_mul(qk), "the query width")?;
        let kv_a_width = checked(kvr.checked_add(rope_d), "the compressed key/value width")?;
        let kv_b_width = checked(
            nope.checked_add(vd).and_then(|w| w.checked_mul(n)),
            "the expanded key/value width",
        )?;
        let o_width = checked(n.checked_mul(vd), "the value width")?;
        let rope = self.rope.ok_or_else(|| {
            self.err(
                "`mla` needs a `rotary` layer (head_dim = qk_rope_head_dim) earlier in the model"
                    .into(),
            )
        })?;
        // Queries.
        let q = match c.q_lora_rank {
            Some(r) => {
                let qa = self.projection(x, h, r, c.bias, train, "q_a")?;
                let w = self.param(Shape::from([r]), train)?;
                let qn = self.rms_norm(qa, w, RmsStyle::Llama)?;
                self.projection(qn, r, q_width, false, train, "q_b")?
            }
            None => self.projection(x, h, q_width, false, train, "q")?,
        };
        let qh = self.view_op(
            q,
            Shape::from([b, n, s, qk]),
            Layout::HeadsTransposed,
            AtenOp::View,
            true,
        );
        let q_pass = self.view_of(qh, Shape::from([b, n, s, nope]), Layout::Strided);
        let q_rot = self.view_of(qh, Shape::from([b, n, s, rope_d]), Layout::Strided);
        self.call(Call::new(AtenOp::Split, vec![qh], vec![q_pass, q_rot]))?;
        // Compressed keys and values.
        let ckv = self.projection(x, h, kv_a_width, c.bias, train, "kv_a")?;
        let kv_nope = self.view_of(ckv, Shape::from([b, s, kvr]), Layout::Strided);
        let k_rot = self.view_of(ckv, Shape::from([b, 1, s, rope_d]), Layout::Strided);
        self.call(Call::new(AtenOp::Split, vec![ckv], vec![kv_nope, k_rot]))?;
        let w = self.param(Shape::from([kvr]), train)?;
        let kv_nope = self.rms_norm(kv_nope, w, RmsStyle::Llama)?;
        let kv_nope = self.view_op(
            kv_nope,
            Shape::from([b, 1, s, kvr]),
            Layout::Contiguous,
            AtenOp::View,
            true,
        );
        let rope = Rope {
            concat: true,
            ..rope
        };
        let q_rot = self.rope_apply(q_rot, rope)?;
        let k_rot = self.rope_apply(k_rot, rope)?;
        // The cache holds the compressed latents.
        let (kv_nope, k_rot) = if c.kv_cache && !(self.training() && self.s.checkpoint) {
            self.kv_cache_copies(kv_nope, k_rot, None, false)?
        } else {
            (kv_nope, k_rot)
        };
        let rg = self.rg(q_pass) || self.rg(q_rot);
        let query = self.fresh(Shape::from([b, n, s, qk]), xv.dtype, "query states", rg)?;
        self.call(Call::new(AtenOp::Cat, vec![q_pass, q_rot], vec![query]))?;
        // Expand the latents per head.
        let s_kv = self.val(kv_nope).shape.dims()[2];
        let lat = self.view_op(
            kv_nope,
            Shape::from([b, s_kv, kvr]),
            Layout::Contiguous,
            AtenOp::View,
            true,
        );
        let kvb = self.projection(lat, kvr, kv_b_width, false, train, "kv_b")?;
        let kvh = self.view_op(
            kvb,
            Shape::from([b, n, s_kv, nope + vd]),
            Layout::HeadsTransposed,
            AtenOp::View,
            true,
        );
        let k_nope = self.view_of(kvh, Shape::from([b, n, s_kv, nope]), Layout::HeadsStrided);
        let value = self.view_of(kvh, Shape::from([b, n, s_kv, vd]), Layout::HeadsStrided);
        self.call(Call::new(AtenOp::Split, vec![kvh], vec![k_nope, value]))?;
        let rg = self.rg(k_nope) || self.rg(k_rot);
        let key = self.fresh(Shape::from([b, n, s_kv, qk]), xv.dtype, "key states", rg)?;
        self.call(Call::new(AtenOp::Cat, vec![k_nope, k_rot], vec![key]))?;
        // Attention, as `attention` runs it.
        let ac = AttentionCfg {
            style: AttnStyle::Transformers,
            heads: n,
            kv_heads: n,
            head_dim: Some(qk),
            causal: true,
            kv_cache: c.kv_cache,
            bias: c.bias,
            out_bias: c.bias,
            k_bias: c.bias,
            scale_query: false,
            contiguous_heads: false,
            fused_qkv: false,
            chunked: false,
            rotary: true,
            dropout: c.dropout,
            qk_norm_style: RmsStyle::Llama,
            qk_norm: None,
            position_bias: false,
            sliding_window: None,
            softmax_f32: true,
            bool_mask: false,
            expand_kv: false,
            softcap: None,
            sinks: false,
        };
        let fused = self.s.attention == AttentionImpl::Flash;
        let math = fused
            && !self.s.attention_forced
            && self.s.device == Device::Cpu
            && self.training()
            && c.dropout > 0.0;
        let ctx = if math {
            self.sdpa_math(query, key, value, &ac, None)?
        } else if fused {
            self.sdpa_fused(query, key, value, &ac, None)?
        } else {
            self.sdpa_eager(query, key, value, &ac, None, None)?
        };
        let cv = self.val(ctx).clone();
        let merged_shape = Shape::from([b, s, o_width]);
        let merged = if cv.layout == Layout::HeadsTransposed {
            self.view_op(ctx, merged_shape, Layout::Contiguous, AtenOp::View, true)
        } else {
            let m = self.fresh(merged_shape, cv.dtype, "merged heads", cv.requires_grad)?;
            self.call(Call::new(AtenOp::Clone, vec![ctx], vec![m]))?;
            m
        };
        self.projection(merged, o_width, h, c.bias, train, "o")
    }
}
