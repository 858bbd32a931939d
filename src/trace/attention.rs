//! Attention: projections, rotary embeddings, the KV cache, eager and fused kernels.

#[allow(clippy::wildcard_imports)]
use super::*;

impl Tracer<'_> {
    /// A projection inside an attention or MoE layer: `linear` with LoRA adapters when the
    /// projection is targeted.
    pub(super) fn projection(
        &mut self,
        x: ValueId,
        in_f: u64,
        out_f: u64,
        bias: bool,
        train: bool,
        target: &str,
    ) -> Result<ValueId, Error> {
        let quantize = self.quantizable(true, target);
        let w = self.weight(Shape::from([out_f, in_f]), train, quantize)?;
        let b = if bias {
            Some(self.param(Shape::from([out_f]), train)?)
        } else {
            None
        };
        self.base_projection(x, w, b, (in_f, out_f), target)
    }

    /// Self-attention (`kv_src == x`) or cross-attention (`kv_src` = the encoder output).
    #[allow(clippy::too_many_lines)] // the projections, cache and kernels read best in order
    pub(super) fn attention(
        &mut self,
        x: ValueId,
        kv_src: ValueId,
        c: &AttentionCfg,
        train: bool,
    ) -> Result<ValueId, Error> {
        let (xv, (b, s, h)) = self.hidden_states(x)?;
        let mv = self.val(kv_src).clone();
        let &[mb, s_kv, h_kv] = mv.shape.dims() else {
            return Err(self.err(format!(
                "key/value source {} has rank {}, expected [batch, seq, hidden]",
                mv.shape,
                mv.shape.rank()
            )));
        };
        if mb != b || !mv.dtype.is_float() {
            return Err(self.err(format!(
                "key/value source {} {} does not match the queries' batch {b}",
                mv.dtype, mv.shape
            )));
        }
        let hd = match c.head_dim {
            Some(d) => d,
            None => {
                if !h.is_multiple_of(c.heads) {
                    return Err(self.err(format!(
                        "hidden size {h} is not divisible by {} heads; set head_dim",
                        c.heads
                    )));
                }
                h / c.heads
            }
        };
        let qd = checked(c.heads.checked_mul(hd), "the query width")?;
        let kvd = checked(c.kv_heads.checked_mul(hd), "the key/value width")?;
        let torch_mha = c.style == AttnStyle::TorchMha;
        let cross = kv_src != x;
        if torch_mha && (c.kv_heads != c.heads || c.rotary || cross) {
            return Err(self.err("style = \"torch\" (nn.MultiheadAttention) supports neither kv_heads, rotary nor cross-attention".into()));
        }
        // Projections.
        let (q, k, v) = if torch_mha {
            // nn.MultiheadAttention(batch_first=True): the input is transposed to [S, B, E]
            // (so the packed in-projection copies it), and the projection is repacked into a
            // contiguous [3, S, B, E] tensor whose slices are Q, K and V.
            let xt = self.view_op(
                x,
                xv.shape.clone(),
                Layout::Strided,
                AtenOp::Transpose,
                true,
            );
            let qkv = super::checked(h.checked_mul(3), "the fused qkv width (3 × hidden)")?;
            let proj = self.projection(xt, h, qkv, c.bias, train, "qkv")?;
            let pv = self.val(proj).clone();
            let packed = self.fresh(pv.shape.clone(), pv.dtype, "packed qkv", pv.requires_grad)?;
            self.call(Call::new(AtenOp::Clone, vec![proj], vec![packed]))?;
            let q = self.view_of(packed, Shape::from([b, c.heads, s, hd]), Layout::SeqFirst);
            let k = self.view_of(packed, Shape::from([b, c.heads, s, hd]), Layout::SeqFirst);
            let v = self.view_of(packed, Shape::from([b, c.heads, s, hd]), Layout::SeqFirst);
            self.call(Call::new(AtenOp::Unbind, vec![packed], vec![q, k, v]))?;
            (q, k, v)
        } else if c.fused_qkv && !cross {
            let width = checked(
                kvd.checked_mul(2).and_then(|v| v.checked_add(qd)),
                "the fused QKV width",
            )?;
            let qkv = self.projection(x, h, width, c.bias, train, "qkv")?;
            let q = self.view_of(qkv, Shape::from([b, c.heads, s, hd]), Layout::HeadsStrided);
            let k = self.view_of(
                qkv,
                Shape::from([b, c.kv_heads, s, hd]),
                Layout::HeadsStrided,
            );
            let v = self.view_of(
                qkv,
                Shape::from([b, c.kv_heads, s, hd]),
                Layout::HeadsStrided,
            );
            // split's backward concatenates the three gradients into one of the full width.
            self.call(Call::new(AtenOp::Split, vec![qkv], vec![q, k, v]))?;
            (q, k, v)
        } else {
            let mut heads = Vec::new();
            for (src, in_f, width, n, len, bias, target) in [
                (x, h, qd, c.heads, s, c.bias, "q"),
                (kv_src, h_kv, kvd, c.kv_heads, s_kv, c.k_bias, "k"),
                (kv_src, h_kv, kvd, c.kv_heads, s_kv, c.bias, "v"),
            ] {
                let p = self.projection(src, in_f, width, bias, train, target)?;
                // Whisper scales the projection itself: `q_proj(x) * scaling`, a new tensor.
                let p = if c.scale_query && target == "q" {
                    self.unary(p, AtenOp::MulScalar)?
                } else {
                    p
                };
                let (split_src, op) = match c.qk_norm {
                    // Qwen3 first RMS-normalizes the [B, S, heads, head_dim] view over
                    // head_dim; the heads are then transposed out of that (new, contiguous)
                    // output.
                    Some(QkNorm::Head) if target != "v" => {
                        let split = self.view_op(
                            p,
                            Shape::from([b, len, n, hd]),
                            Layout::Contiguous,
                            AtenOp::View,
                            true,
                        );
                        let w = self.param(Shape::from([hd]), train)?;
                        (self.rms_norm(split, w, c.qk_norm_style)?, AtenOp::Transpose)
                    }
                    // OLMo-2 normalizes the whole [B, S, heads·head_dim] projection, then
                    // views the heads out of that output.
                    Some(QkNorm::Projection) if target != "v" => {
                        let w = self.param(Shape::from([width]), train)?;
                        (self.rms_norm(p, w, RmsStyle::Olmo2)?, AtenOp::View)
                    }
                    _ => (p, AtenOp::View),
                };
                let hv = self.view_op(
                    split_src,
                    Shape::from([b, n, len, hd]),
                    Layout::HeadsTransposed,
                    op,
                    true,
                );
                let hv = if c.contiguous_heads {
                    // `.transpose(1, 2).contiguous()`: a copy in heads-first order.
                    let hvv = self.val(hv).clone();
                    let copy =
                        self.fresh(hvv.shape, hvv.dtype, "contiguous heads", hvv.requires_grad)?;
                    self.call(Call::new(AtenOp::Clone, vec![hv], vec![copy]))?;
                    copy
                } else {
                    hv
                };
                heads.push(hv);
            }
            (heads[0], heads[1], heads[2])
        };
        // Falcon's new decoder architecture broadcasts K and V to every query head and copies
        // them (`flatten`): from here on they have `heads` heads.
        let expanded;
        let (k, v, c) = if c.expand_kv && c.kv_heads < c.heads && !cross {
            expanded = AttentionCfg {
                kv_heads: c.heads,
                ..*c
            };
            (
                self.repeat_kv(k, c.heads)?,
                self.repeat_kv(v, c.heads)?,
                &expanded,
            )
        } else {
            (k, v, c)
        };
        let (q, k) = if c.rotary {
            // Gemma 3's sliding-window layers rotate with the local tables.
            let local = self.rope_local.filter(|_| c.sliding_window.is_some());
            let rope = local.or(self.rope).ok_or_else(|| {
                self.err("`rotary = true` needs a `rotary` layer earlier in the model".into())
            })?;
            self.rope_pair(q, k, rope)?
        } else {
            (q, k)
        };
        // transformers' decoders run with `use_cache=True` (the config default), training
        // included unless gradient checkpointing turns it off: `DynamicCache.update` stores
        // `torch.cat`-ed copies of K and V, and attention reads those copies. In inference the
        // cache lives for the whole forward pass, in `--kv-dtype` if given, and a sliding window
        // keeps only the last `sliding_window` tokens. In a decode step ([`Pass::Decode`]) the
        // cat joins the `past` tokens already cached (freed once copied) and this step's.
        let (k, v) = if (c.causal || cross)
            && c.kv_cache
            && !torch_mha
            && !(self.training() && self.s.checkpoint)
        {
            self.kv_cache_copies(k, v, c.sliding_window, cross)?
        } else {
            (k, v)
        };
        // `flash` (SDPA) models the kernel SDPA picks: a fused one, which regenerates its dropout
        // mask instead of keeping it; on the CPU with attention dropout in training, the math
        // path (`sdp_utils_cpp.cpp`: flash's `check_for_dropout` fails, math is next), unless
        // `--attention flash` forces the fused kernel: its saved tensors (Q, K, V, output,
        // log-sum-exp) are those of the same run without attention dropout.
        let fused = torch_mha || self.s.attention == AttentionImpl::Flash;
        let bias = if c.position_bias {
            Some(self.position_bias.ok_or_else(|| self.err("`position_bias = true` needs a `relative_position_bias` layer earlier in the model".into()))?)
        } else if c.bool_mask && c.causal && fused {
            Some(self.converted_bool_mask(q, k)?)
        } else {
            None
        };
        let math = fused
            && !torch_mha
            && !self.s.attention_forced
            && self.s.device == Device::Cpu
            && self.training()
            && c.dropout > 0.0;
        // Selective recomputation: the core is a checkpointed segment that keeps its query
        // (and, read from outside it, its keys and values).
        let selective = self.s.selective_recompute && self.training() && self.segment.is_none();
        if selective {
            let start = self.tape.steps.len();
            let input = self.sid(q);
            self.segment = Some(self.tape.segments.push_and_get_key(Segment {
                start,
                end: start,
                input,
            }));
        }
        // GPT-OSS's `sinks`: one learned logit per head (a `[heads]` parameter).
        let sinks = if c.sinks {
            Some(self.param(Shape::from([c.heads]), train)?)
        } else {
            None
        };
        let core = |this: &mut Self, q, k, v| {
            if math {
                this.sdpa_math(q, k, v, c, bias)
            } else if fused {
                this.sdpa_fused(q, k, v, c, bias)
            } else {
                this.sdpa_eager(q, k, v, c, bias, sinks)
            }
        };
        let merged = if c.chunked && !torch_mha {
            // Qwen2-VL's vision attention: `torch.split` of Q, K and V per image along the
            // sequence, one attention call per image, each output's heads merged
            // (`transpose(1, 2).contiguous()`, free when the kernel lays it out so), then
            // `torch.cat` of the images (`VisionAttention.forward`, non-flash-attention-2
            // path). Here each image is one batch row.
            let row = |this: &mut Self, t: ValueId| {
                let tv = this.val(t).clone();
                let mut dims = tv.shape.dims().to_vec();
                dims[0] = 1;
                let views: Vec<ValueId> = (0..b)
                    .map(|_| this.view_of(t, Shape::new(dims.clone()), tv.layout))
                    .collect();
                this.call(Call::new(AtenOp::Split, vec![t], views.clone()))
                    .map(|()| views)
            };
            let (qs, ks, vs) = (row(self, q)?, row(self, k)?, row(self, v)?);
            let mut outs = Vec::new();
            for i in 0..qs.len() {
                let ctx = core(self, qs[i], ks[i], vs[i])?;
                outs.push(self.merge_heads(ctx, Shape::from([1, s, qd]), false)?);
            }
            let ov = self.val(outs[0]).clone();
            let m = self.fresh(
                Shape::from([b, s, qd]),
                ov.dtype,
                "merged heads",
                ov.requires_grad,
            )?;
            self.call(Call::new(AtenOp::Cat, outs, vec![m]))?;
            m
        } else {
            let ctx = core(self, q, k, v)?;
            self.merge_heads(ctx, Shape::from([b, s, qd]), torch_mha)?
        };
        if selective && let Some(seg) = self.segment.take() {
            self.tape.segments[seg].end = self.tape.steps.len();
        }
        let y = self.projection(merged, qd, h, c.out_bias, train, "o")?;
        if torch_mha {
            // The [S, B, E] result is transposed back to batch-first: a strided view.
            let yt = self.view_op(
                y,
                xv.shape.clone(),
                Layout::Strided,
                AtenOp::Transpose,
                true,
            );
            return Ok(yt);
        }
        Ok(y)
    }

    /// Merges an attention output's heads into `shape` (`[B, S, heads·head_dim]`): transformers
    /// `transpose(1, 2).contiguous()`, nn.MultiheadAttention (`torch_mha`)
    /// `permute(2, 0, 1, 3).contiguous()`; a view when the output is already laid out so, else a
    /// copy.
    fn merge_heads(
        &mut self,
        ctx: ValueId,
        shape: Shape,
        torch_mha: bool,
    ) -> Result<ValueId, Error> {
        let cv = self.val(ctx).clone();
        let free = if torch_mha {
            cv.layout == Layout::SeqFirst
        } else {
            cv.layout == Layout::HeadsTransposed
        };
        if free {
            return Ok(self.view_op(ctx, shape, Layout::Contiguous, AtenOp::View, true));
        }
        let m = self.fresh(shape, cv.dtype, "merged heads", cv.requires_grad)?;
        self.call(Call::new(AtenOp::Clone, vec![ctx], vec![m]))?;
        Ok(m)
    }

    /// transformers' `DynamicCache.update` for one layer: `torch.cat`-ed copies of `k` and `v`
    /// (`[B, heads, S, d]`, any widths), held until the step ends; in inference kept in
    /// `--kv-dtype`, capped at `sliding_window`, and in a decode step joined to the `past`
    /// tokens. Returns what attention reads. See [`Self::attention`].
    pub(super) fn kv_cache_copies(
        &mut self,
        k: ValueId,
        v: ValueId,
        sliding_window: Option<u64>,
        cross: bool,
    ) -> Result<(ValueId, ValueId), Error> {
        let past = if cross {
            0
        } else {
            sliding_window.map_or(self.past(), |w| self.past().min(w))
        };
        let mut copies = Vec::new();
        for (t, what) in [(k, "key cache"), (v, "value cache")] {
            let tv = self.val(t).clone();
            let mut full = tv.shape.dims().to_vec();
            full[2] = checked(full[2].checked_add(past), "the cached tokens")?;
            let full = Shape::new(full);
            let (kind, cache_shape, dt) = if self.training() {
                (StorageKind::Activation, tv.shape.clone(), tv.dtype)
            } else {
                let mut dims = full.dims().to_vec();
                if let Some(w) = sliding_window.filter(|_| past == 0) {
                    dims[2] = dims[2].min(w);
                }
                (
                    StorageKind::KvCache,
                    Shape::new(dims),
                    self.s.kv_dtype.unwrap_or(tv.dtype),
                )
            };
            let mut inputs = Vec::new();
            if past > 0 {
                let mut dims = tv.shape.dims().to_vec();
                dims[2] = past;
                let shape = Shape::new(dims);
                let old = self.storage(&shape, dt, StorageKind::PastKvCache, what)?;
                inputs.push(self.value(old, shape, dt, Layout::Contiguous, false, false));
            }
            inputs.push(t);
            let cache = self.storage(&cache_shape, dt, kind, what)?;
            // The cache is returned in the model's output (`past_key_values`), which the
            // training loop holds until the step ends (`out = model(..)`, `out.loss.backward()`,
            // `optimizer.step()`): in training too it outlives backward.
            self.tape.held.push(cache);
            let cv = if cache_shape == full && dt == tv.dtype {
                // Attention reads the cache itself.
                let cv = self.value(
                    cache,
                    full.clone(),
                    tv.dtype,
                    Layout::Contiguous,
                    tv.requires_grad,
                    false,
                );
                self.call(Call::new(AtenOp::Cat, inputs, vec![cv]))?;
                cv
            } else {
                // A windowed or re-typed cache is written; attention reads this pass's K/V
                // (with the past tokens, a joined copy in the activations' dtype).
                self.call(
                    Call::new(AtenOp::CacheUpdate, inputs.clone(), Vec::new()).allocs(vec![cache]),
                )?;
                if past > 0 {
                    let joined =
                        self.fresh(full.clone(), tv.dtype, "cached keys and values", false)?;
                    self.call(Call::new(AtenOp::Cat, inputs, vec![joined]))?;
                    joined
                } else {
                    t
                }
            };
            copies.push(cv);
        }
        Ok((copies[0], copies[1]))
    }

    /// transformers' `apply_rotary_pos_emb(q, k, cos, sin)` (`models/llama/modeling_llama.py`,
    /// and its copies), operator by operator as PyTorch runs it. Per rotated tensor `x`:
    /// `x * cos` (`mul`, keeping `cos`), `rotate_half(x)` (the halves `x[..., :d/2]` and
    /// `x[..., d/2:]` as `slice` views, `neg` of the second half, `torch.cat((-x2, x1))`),
    /// `* sin` (`mul`, keeping `sin`), and the sum (`add`): five tensors, each freed once the
    /// next operator has read it, so the caching allocator sees each as a block of its own.
    /// Backward runs the same operators in reverse: `add` and `cat` hand views of their
    /// output's gradient on (no new tensor), `mul` makes `grad * sin` and `grad * cos`, `neg`
    /// a half-width tensor, each `slice` a zero-filled full-width one (`slice_backward`).
    ///
    /// With `concat` (partial rotary: GPT-NeoX's `apply_rotary_pos_emb`, Phi's and StableLM's
    /// attention), `q[..., :rotary_dim]` and `q[..., rotary_dim:]` are taken from Q and K
    /// first (a whole-width first part is an `alias`, as basic indexing records a slice that
    /// spans the dimension), both rotated, then each joined with `torch.cat((rot, pass))`;
    /// with `concat_each` (Phi-3's `apply_rotary_pos_emb`, `models/phi3/modeling_phi3.py`
    /// lines 180-186) each is joined right after its own rotation.
    ///
    /// Float32 tables (OLMo, OLMo-2) are rotated the same way, by type promotion in float32,
    /// and cast back (`q_embed.to(q_type)`); Flux's interleaved pairs by
    /// [`Self::rotate_interleaved`]. Cohere's `upcast`, GPT-OSS's half tables and the
    /// per-sample tables of Qwen2-VL (whose M-RoPE rebuilds `cos`/`sin` with `torch.cat` in
    /// every call, `apply_multimodal_rotary_pos_emb`, and whose vision tower rotates float32
    /// copies, `apply_rotary_pos_emb_vision`) keep the single-step model
    /// ([`Self::rope_apply`]).
    pub(super) fn rope_pair(
        &mut self,
        q: ValueId,
        k: ValueId,
        rope: Rope,
    ) -> Result<(ValueId, ValueId), Error> {
        if rope.upcast || rope.half || rope.per_sample || (rope.tables_f32 && rope.concat) {
            return Ok((self.rope_apply(q, rope)?, self.rope_apply(k, rope)?));
        }
        let cos = self.table_value(rope.cos);
        let sin = self.table_value(rope.sin);
        if rope.interleaved {
            let qr = self.rotate_interleaved(q, cos, sin)?;
            let kr = self.rotate_interleaved(k, cos, sin)?;
            return Ok((qr, kr));
        }
        if rope.tables_f32 {
            // OLMo's and OLMo-2's `apply_rotary_pos_emb` (`models/olmo2/modeling_olmo2.py`
            // lines 172-177): both rotated against the float32 tables, then `return
            // q_embed.to(q_type), k_embed.to(k_type)`; the float32 sums are locals until then.
            let qr = self.rotate(q, (cos, sin), true)?;
            let kr = self.rotate(k, (cos, sin), true)?;
            let qc = self.cast_to(qr, self.val(q).dtype)?;
            let kc = self.cast_to(kr, self.val(k).dtype)?;
            self.keep_until_here(qr);
            self.keep_until_here(kr);
            return Ok((qc, kc));
        }
        if !rope.concat {
            let qr = self.rotate(q, (cos, sin), false)?;
            let kr = self.rotate(k, (cos, sin), false)?;
            return Ok((qr, kr));
        }
        let rotary_dim = self.val(cos).shape.dims().last().copied().unwrap_or(0);
        let (q_rot, q_pass) = self.rotary_parts(q, rotary_dim)?;
        let (k_rot, k_pass) = self.rotary_parts(k, rotary_dim)?;
        if rope.concat_each {
            let qr = self.rotate(q_rot, (cos, sin), false)?;
            let qr = self.pass_on(AtenOp::Cat, &[qr, q_pass], "rotated")?;
            let kr = self.rotate(k_rot, (cos, sin), false)?;
            let kr = self.pass_on(AtenOp::Cat, &[kr, k_pass], "rotated")?;
            Ok((qr, kr))
        } else {
            let qr = self.rotate(q_rot, (cos, sin), false)?;
            let kr = self.rotate(k_rot, (cos, sin), false)?;
            let qr = self.pass_on(AtenOp::Cat, &[qr, q_pass], "rotated")?;
            let kr = self.pass_on(AtenOp::Cat, &[kr, k_pass], "rotated")?;
            Ok((qr, kr))
        }
    }

    /// A rotary table (`cos` or `sin`, `[1 or B, S, rotary_dim]`) as a value the rotation's
    /// `mul` reads; it needs no gradient, so the product keeps it (`mul.Tensor`'s `self:
    /// mul_tensor_backward(grad, other, ..)`).
    fn table_value(&mut self, s: StorageId) -> ValueId {
        let st = &self.tape.storages[s];
        let (shape, dtype) = (st.shape.clone(), st.dtype);
        self.value(s, shape, dtype, Layout::Contiguous, false, false)
    }

    /// `x[..., :rotary_dim]` and `x[..., rotary_dim:]` (views; a first part spanning the whole
    /// width is an `alias`, whose backward hands the gradient on, where a `slice`'s makes a
    /// zero-filled tensor of `x`'s size).
    fn rotary_parts(&mut self, x: ValueId, rotary_dim: u64) -> Result<(ValueId, ValueId), Error> {
        let xv = self.val(x).clone();
        let mut dims = xv.shape.dims().to_vec();
        let last = dims
            .len()
            .checked_sub(1)
            .ok_or_else(|| self.err(format!("rotary embedding of a rank-0 tensor {}", xv.shape)))?;
        let width = dims[last];
        let Some(pass) = width.checked_sub(rotary_dim) else {
            return Err(self.err(format!(
                "rotary tables {rotary_dim} wide for heads {width} wide"
            )));
        };
        dims[last] = rotary_dim;
        let rot = if pass == 0 {
            self.view_op(x, xv.shape.clone(), xv.layout, AtenOp::Alias, true)
        } else {
            self.view_op(
                x,
                Shape::new(dims.clone()),
                Layout::Strided,
                AtenOp::Slice,
                false,
            )
        };
        dims[last] = pass;
        let pass = self.view_op(x, Shape::new(dims), Layout::Strided, AtenOp::Slice, false);
        Ok((rot, pass))
    }

    /// `shape` with its last dimension halved: each half of a rotated head (`rotate_half`'s
    /// `x1`/`x2`, the interleaved pairs' real and imaginary parts, GPT-OSS's `chunk(x, 2, -1)`),
    /// `[.., head_dim]` → `[.., head_dim / 2]`.
    ///
    /// # Errors
    /// A rank-0 shape, which has no last dimension to rotate.
    fn half_width(&self, shape: &Shape) -> Result<Shape, Error> {
        let mut dims = shape.dims().to_vec();
        let last = dims
            .last_mut()
            .ok_or_else(|| self.err(format!("rotary embedding of a rank-0 tensor {shape}")))?;
        *last /= 2;
        Ok(Shape::new(dims))
    }

    /// `(x * cos) + (rotate_half(x) * sin)` ([`Self::rope_pair`]), the result in `x`'s
    /// dimension order (`x * cos` comes first, and a sum's output follows its first operand's
    /// strides); with `wide` (float32 tables: OLMo, OLMo-2) the products and the sum are
    /// float32 by type promotion.
    fn rotate(
        &mut self,
        x: ValueId,
        (cos, sin): (ValueId, ValueId),
        wide: bool,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let a = self.rope_mul(x, cos, wide)?;
        let half = self.half_width(&xv.shape)?;
        let x1 = self.view_op(x, half.clone(), Layout::Strided, AtenOp::Slice, false);
        let x2 = self.view_op(x, half, Layout::Strided, AtenOp::Slice, false);
        let neg = self.unary(x2, AtenOp::Neg)?;
        let rotated = self.pass_on(AtenOp::Cat, &[neg, x1], "rotate_half")?;
        let d = self.rope_mul(rotated, sin, wide)?;
        let y = self.pass_on(AtenOp::Add, &[a, d], "rotated")?;
        self.tape.values[y].layout = dense_order(xv.layout);
        Ok(y)
    }

    /// diffusers' `apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1)`
    /// (`models/embeddings.py` lines 988-997, Flux's attention processors): each head's
    /// pairs are interleaved. `x.reshape(..., -1, 2).unbind(-1)` (views), `neg` of the odd
    /// elements (half width), `torch.stack([-x_imag, x_real], -1).flatten(3)` (a new
    /// tensor, held by the local `x_rotated` until the function returns), then `x.float() *
    /// cos + x_rotated.float() * sin` (a float32 copy of each for 16-bit activations, freed
    /// once multiplied) and `.to(x.dtype)`. In backward, `unbind`'s gradient is `torch.stack`
    /// of both halves' (a new full-width tensor), `stack`'s is views.
    fn rotate_interleaved(
        &mut self,
        x: ValueId,
        cos: ValueId,
        sin: ValueId,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let half = self.half_width(&xv.shape)?;
        let mut dims = half.dims().to_vec();
        dims.push(2);
        let pairs = self.view_op(x, Shape::new(dims), xv.layout, AtenOp::View, true);
        let real = self.view_of(pairs, half.clone(), Layout::Strided);
        let imag = self.view_of(pairs, half, Layout::Strided);
        self.call(Call::new(AtenOp::Unbind, vec![pairs], vec![real, imag]))?;
        let neg = self.unary(imag, AtenOp::Neg)?;
        let stacked = self.pass_on(AtenOp::Stack, &[neg, real], "stacked pair")?;
        let rotated = self.view_op(
            stacked,
            xv.shape.clone(),
            Layout::Contiguous,
            AtenOp::View,
            true,
        );
        let x32 = self.cast_to(x, DType::Float32)?;
        let a = self.rope_mul(x32, cos, true)?;
        let r32 = self.cast_to(rotated, DType::Float32)?;
        let d = self.rope_mul(r32, sin, true)?;
        let y = self.pass_on(AtenOp::Add, &[a, d], "rotated")?;
        let out = self.cast_to(y, xv.dtype)?;
        self.keep_until_here(stacked);
        Ok(out)
    }

    /// `t.to(dtype)`: `t` itself when it has that dtype already, else a copy (`_to_copy`),
    /// which keeps a dense tensor's dimension order (`memory_format=torch.preserve_format`).
    fn cast_to(&mut self, t: ValueId, dtype: DType) -> Result<ValueId, Error> {
        let tv = self.val(t).clone();
        if tv.dtype == dtype {
            return Ok(t);
        }
        let y = self.fresh(tv.shape, dtype, "cast", tv.requires_grad)?;
        self.tape.values[y].layout = dense_order(tv.layout);
        self.call(Call::new(AtenOp::ToCopy, vec![t], vec![y]))?;
        Ok(y)
    }

    /// `x * table`: `x`'s shape; keeps the table. With `wide`, the promoted dtype of the two
    /// (float32 tables); without, `x`'s: the tables then share the activations' dtype, as
    /// the measured autocast cases' saved bytes show (memest's tables under `--amp` are float32
    /// all the same; the single-step model this replaces computed in `x`'s dtype too).
    fn rope_mul(&mut self, x: ValueId, table: ValueId, wide: bool) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let dtype = if wide {
            promote(xv.dtype, self.val(table).dtype)
        } else {
            xv.dtype
        };
        let y = self.fresh(xv.shape, dtype, "x*table", xv.requires_grad)?;
        self.call(Call::new(AtenOp::Mul, vec![x, table], vec![y]))?;
        Ok(y)
    }

    /// `torch.cat` along the last dimension, `torch.stack` along a new last one, or `add` of
    /// same-shaped tensors: a new contiguous tensor (the inputs' promoted dtype) whose backward
    /// hands each input a view of the output's gradient (`cat_tensors_backward`'s `narrow`s,
    /// `stack_tensors_backward`'s `unbind`, `add`'s `grad` as it is).
    fn pass_on(
        &mut self,
        op: AtenOp,
        inputs: &[ValueId],
        what: &'static str,
    ) -> Result<ValueId, Error> {
        let first = self.val(inputs[0]).clone();
        let mut dims = first.shape.dims().to_vec();
        if op == AtenOp::Stack {
            dims.push(inputs.len() as u64);
        }
        let mut dtype = first.dtype;
        let mut rg = first.requires_grad;
        for &v in &inputs[1..] {
            let vv = self.val(v).clone();
            dtype = promote(dtype, vv.dtype);
            rg |= vv.requires_grad;
            if op == AtenOp::Cat
                && let (Some(l), Some(&w)) = (dims.last_mut(), vv.shape.dims().last())
            {
                *l = checked(l.checked_add(w), "a concatenated size")?;
            }
        }
        let y = self.fresh(Shape::new(dims), dtype, what, rg)?;
        self.call(Call::new(op, inputs.to_vec(), vec![y]).view_grad())?;
        Ok(y)
    }

    /// `q * cos + rotate_half(q) * sin` (transformers' `apply_rotary_pos_emb`): keeps only the
    /// shared `cos`/`sin` tables; the result is a new tensor in the input's (dense) layout.
    /// With float32 tables and a 16-bit `q` (OLMo-2) the products and their sum are float32
    /// temporaries, and the result is cast back to `q`'s dtype; with `upcast` (Cohere) `q` is
    /// first copied to float32 and everything up to the cast back is float32.
    pub(super) fn rope_apply(&mut self, t: ValueId, rope: Rope) -> Result<ValueId, Error> {
        let Rope {
            cos,
            sin,
            concat,
            tables_f32,
            upcast,
            half,
            ..
        } = rope;
        let tv = self.val(t).clone();
        if half {
            return self.rope_apply_halves(t, cos, sin);
        }
        let wide = if tables_f32 || upcast {
            promote(tv.dtype, DType::Float32)
        } else {
            tv.dtype
        };
        let mut allocs = Vec::new();
        if upcast && wide != tv.dtype {
            allocs.push(self.storage(&tv.shape, wide, StorageKind::Activation, "q.float()")?);
        }
        let half_dtype = if upcast { wide } else { tv.dtype };
        for (what, dt) in [
            ("q*cos", wide),
            ("rotate_half", half_dtype),
            ("rotate_half*sin", wide),
        ] {
            allocs.push(self.storage(&tv.shape, dt, StorageKind::Activation, what)?);
        }
        if wide != tv.dtype {
            allocs.push(self.storage(&tv.shape, wide, StorageKind::Activation, "rotated sum")?);
        }
        // Elementwise results keep a dense input's layout and the dimension order of a strided
        // one; `torch.cat` allocates a contiguous result.
        let layout = match tv.layout {
            _ if concat => Layout::Contiguous,
            Layout::HeadsStrided => Layout::HeadsTransposed,
            Layout::Strided | Layout::LastTwoSwapped => Layout::Contiguous,
            l => l,
        };
        let ys = self.storage(&tv.shape, tv.dtype, StorageKind::Activation, "rotated")?;
        let y = self.value(
            ys,
            tv.shape.clone(),
            tv.dtype,
            layout,
            tv.requires_grad,
            false,
        );
        let call = Call::new(AtenOp::ApplyRotary, vec![t], vec![y]);
        self.call(call.aux(vec![cos, sin]).allocs(allocs))?;
        Ok(y)
    }

    /// GPT-OSS's `_apply_rotary_emb`: `x1, x2 = chunk(x, 2, -1)` (views), `x1·cos - x2·sin`
    /// and `x2·cos + x1·sin` against `[1, 1, S, head_dim/2]` tables (four products and two
    /// sums, each `[B, heads, S, head_dim/2]` in the input's dtype, forward temporaries), joined
    /// by `torch.cat` into a new contiguous tensor. Each product keeps only its table (`mul`
    /// saves the factor the other one's gradient needs; the tables need none); `sub`, `add`
    /// and `cat` keep nothing.
    fn rope_apply_halves(
        &mut self,
        t: ValueId,
        cos: StorageId,
        sin: StorageId,
    ) -> Result<ValueId, Error> {
        let tv = self.val(t).clone();
        let half_shape = self.half_width(&tv.shape)?;
        let mut allocs = Vec::new();
        for what in [
            "x1*cos",
            "x2*sin",
            "x1*cos - x2*sin",
            "x2*cos",
            "x1*sin",
            "x2*cos + x1*sin",
        ] {
            allocs.push(self.storage(&half_shape, tv.dtype, StorageKind::Activation, what)?);
        }
        let ys = self.storage(&tv.shape, tv.dtype, StorageKind::Activation, "rotated")?;
        let y = self.value(
            ys,
            tv.shape.clone(),
            tv.dtype,
            Layout::Contiguous,
            tv.requires_grad,
            false,
        );
        let call = Call::new(AtenOp::ApplyRotary, vec![t], vec![y]);
        self.call(call.aux(vec![cos, sin]).allocs(allocs))?;
        Ok(y)
    }

    /// Scaled-dot-product attention through `F.scaled_dot_product_attention`. On CUDA the
    /// kernel is the one PyTorch picks for the GPU's compute capability ([`sdpa::select`]:
    /// cuDNN, flash, memory-efficient or math); the CPU runs its flash kernel
    /// (`_scaled_dot_product_flash_attention_for_cpu`). A fused kernel saves Q, K and V as
    /// passed, the output, and a float32 log-sum-exp `[B, heads, S]` (`derivatives.yaml`
    /// `_scaled_dot_product_{flash,efficient,cudnn}_attention`). On the CPU, and for cuDNN
    /// (`alloc_with_matching_layout`, `aten/src/ATen/native/cudnn/MHA.cpp`), the output is
    /// allocated with the query's dimension order; the flash and memory-efficient kernels lay it
    /// out `[B, S, heads, head_dim]`, and the memory-efficient one pads its log-sum-exp to
    /// `[B, heads, ⌈S/32⌉·32]` when it computes one for backward (`_efficient_attention_forward`,
    /// `aten/src/ATen/native/transformers/cuda/attention.cu`). The math kernel is
    /// [`Self::sdpa_math`]'s.
    pub(super) fn sdpa_fused(
        &mut self,
        q: ValueId,
        k: ValueId,
        v: ValueId,
        c: &AttentionCfg,
        bias: Option<ValueId>,
    ) -> Result<ValueId, Error> {
        let q = self.autocast_input(q)?;
        let k = self.autocast_input(k)?;
        let v = self.autocast_input(v)?;
        let qv = self.val(q).clone();
        let &[b, heads, s, hd] = qv.shape.dims() else {
            unreachable!("heads view is rank 4")
        };
        let rg = qv.requires_grad || self.rg(k) || self.rg(v);
        let hd_v = self.val(v).shape.dims().get(3).copied().unwrap_or(hd);
        let kernel = match self.s.device {
            // `check_head_dim_size_cpp` (sdp_utils_cpp.cpp): the CPU flash kernel needs equal
            // query, key and value widths (multi-head latent attention has a narrower value).
            Device::Cpu if hd_v != hd => SdpaKernel::Math,
            Device::Cpu => SdpaKernel::Flash,
            Device::Cuda => {
                let (kd, vd) = (self.val(k).shape.dims(), self.val(v).shape.dims());
                let call = SdpaCall {
                    dtype: qv.dtype,
                    head_dim_qk: hd,
                    head_dim_v: vd.get(3).copied().unwrap_or(hd),
                    s_q: s,
                    s_k: kd.get(2).copied().unwrap_or(s),
                    mask: bias.is_some(),
                    mask_requires_grad: bias.is_some_and(|m| self.rg(m)),
                    heads_q: heads,
                    heads_kv: kd.get(1).copied().unwrap_or(heads),
                    // transformers' SDPA path passes `enable_gqa`; a layer that calls
                    // `scaled_dot_product_attention` itself (Falcon's multi-query attention,
                    // the `bool_mask` layers) passes none.
                    enable_gqa: !c.bool_mask,
                    dropout: c.dropout,
                    causal: c.causal,
                    requires_grad: rg,
                };
                sdpa::select(&self.s.arch, &call)
            }
        };
        if kernel == SdpaKernel::Math {
            return self.sdpa_math(q, k, v, c, bias);
        }
        let query_order = self.s.device == Device::Cpu || kernel == SdpaKernel::Cudnn;
        let layout = match (query_order, qv.layout) {
            (false, _) => Layout::HeadsTransposed,
            (true, l @ (Layout::HeadsTransposed | Layout::SeqFirst | Layout::Contiguous)) => l,
            (true, Layout::HeadsStrided) => Layout::HeadsTransposed,
            (true, Layout::LastTwoSwapped | Layout::ChannelsLast | Layout::Strided) => {
                Layout::Contiguous
            }
        };
        let lse_len = if self.s.device == Device::Cuda && kernel == SdpaKernel::Efficient && rg {
            checked(
                s.div_ceil(32).checked_mul(32),
                "the padded log-sum-exp length",
            )?
        } else {
            s
        };
        let out_shape = Shape::from([b, heads, s, hd_v]);
        let out_s = self.storage(
            &out_shape,
            qv.dtype,
            StorageKind::Activation,
            "attention output",
        )?;
        let out = self.value(out_s, out_shape, qv.dtype, layout, rg, false);
        let lse = self.storage(
            &Shape::from([b, heads, lse_len]),
            DType::Float32,
            StorageKind::Activation,
            "logsumexp",
        )?;
        let mut inputs = vec![q, k, v];
        // A float attention mask is kept too.
        inputs.extend(bias);
        let call = if kernel == SdpaKernel::Cudnn {
            // cuDNN also returns the dropout RNG's seed and offset, one int64 each, on the
            // device, and its backward reads them (as `measure_fake_cuda.py` sees: 16 B per call
            // in the saved tensors). The flash and memory-efficient kernels make theirs on the
            // host unless a CUDA graph is being captured (`_efficient_attention_forward`,
            // Note [Seed and Offset Device]), so they have none here.
            let mut aux = vec![lse];
            for what in ["philox_seed", "philox_offset"] {
                aux.push(self.storage(
                    &Shape::from([1]),
                    DType::Int64,
                    StorageKind::Activation,
                    what,
                )?);
            }
            Call::new(AtenOp::CudnnAttention, inputs, vec![out])
                .aux(aux.clone())
                .results(aux)
        } else {
            Call::new(AtenOp::FlashAttention, inputs, vec![out])
                .aux(vec![lse])
                .results(vec![lse])
        };
        self.call(call)?;
        Ok(out)
    }

    /// Eager attention as transformers writes it: `matmul(q, k^T)` (matmul copies non-contiguous
    /// operands to `[B·heads, S, head_dim]` and `bmm` saves both), scale and mask, softmax (keeps
    /// its output), dropout (keeps its mask or noise), `matmul(p, v)` (saves `p` and `v`).
    /// With `sinks` (GPT-OSS's `eager_attention_forward`), the masked scores get one more
    /// column, the sink logit of each head, and the row maximum is subtracted before the
    /// softmax; the sink column is sliced off its output ([`AttentionCfg::sinks`]).
    pub(super) fn sdpa_eager(
        &mut self,
        q: ValueId,
        k: ValueId,
        v: ValueId,
        c: &AttentionCfg,
        bias: Option<ValueId>,
        sinks: Option<ValueId>,
    ) -> Result<ValueId, Error> {
        let q = self.autocast_input(q)?;
        let k = self.autocast_input(k)?;
        let v = self.autocast_input(v)?;
        let (k, v) = self.repeat_kv_heads(k, v, c)?;
        let qv = self.val(q).clone();
        let &[b, heads, s, _] = qv.shape.dims() else {
            unreachable!("heads view is rank 4")
        };
        let s_kv = self.val(k).shape.dims()[2];
        let qm = self.contiguous(q)?;
        let km = self.contiguous(k)?;
        let scores = self.bmm(qm, km, Shape::from([b, heads, s, s_kv]), qv.dtype, "scores")?;
        let scaled = self.unary(scores, AtenOp::MulScalar)?;
        // Gemma 2: `scores / cap`, `tanh` (keeps its output), `* cap`.
        let scaled = if c.softcap.is_some() {
            let d = self.unary(scaled, AtenOp::MulScalar)?;
            let t = self.unary(d, AtenOp::Tanh)?;
            self.unary(t, AtenOp::MulScalar)?
        } else {
            scaled
        };
        let masked = match bias {
            Some(bias) => self.add(&[scaled, bias], false)?,
            None if c.causal => self.unary(scaled, AtenOp::AddScalar)?,
            None => scaled,
        };
        let masked = match sinks {
            Some(w) => self.join_sinks(masked, w)?,
            None => masked,
        };
        // Llama-family code runs the softmax in float32 and casts the result back; CUDA
        // autocast runs it in float32 too.
        let probs = if c.softmax_f32 || self.autocast_f32_norms() {
            let back = self.val(masked).dtype;
            let up = self.upcast_f32(masked)?;
            let p = self.unary(up, AtenOp::Softmax)?;
            if c.softmax_f32 {
                self.cast(p, back)?
            } else {
                p
            }
        } else {
            self.unary(masked, AtenOp::Softmax)?
        };
        // `probs[..., :-1]`: the sink column dropped, a strided view (its backward pads the
        // gradient back to the full width).
        let probs = if sinks.is_some() {
            self.view_op(
                probs,
                Shape::from([b, heads, s, s_kv]),
                Layout::Strided,
                AtenOp::Slice,
                false,
            )
        } else {
            probs
        };
        let probs = self.dropout(probs, c.dropout, false)?;
        // Under autocast the second matmul reads (and keeps) a 16-bit copy of float32 weights
        // (T5 adds a float32 position bias, so its softmax runs in float32).
        let probs = self.autocast_input(probs)?;
        let vm = self.contiguous(v)?;
        let hd_v = self.val(vm).shape.dims()[3];
        self.bmm(
            probs,
            vm,
            Shape::from([b, heads, s, hd_v]),
            qv.dtype,
            "context",
        )
    }

    /// GPT-OSS's sink column: `sinks.reshape(1, -1, 1, 1).expand(B, -1, S, -1)` (a view of the
    /// `[heads]` parameter), `torch.cat([scores, sinks], dim=-1)` into a new
    /// `[B, heads, S, S_kv + 1]` tensor (keeps nothing), `combined.max(dim=-1, keepdim=True)`
    /// (`max.dim`: keeps its int64 `[B, heads, S, 1]` indices) and `combined - max` (a new
    /// tensor, keeps nothing). Returns the difference.
    fn join_sinks(&mut self, scores: ValueId, sinks: ValueId) -> Result<ValueId, Error> {
        let sv = self.val(scores).clone();
        let &[b, heads, s, s_kv] = sv.shape.dims() else {
            unreachable!("attention scores are rank 4")
        };
        let expanded = self.view_op(
            sinks,
            Shape::from([b, heads, s, 1]),
            Layout::Strided,
            AtenOp::Expand,
            false,
        );
        let width = checked(s_kv.checked_add(1), "the scores with their sink column")?;
        // `torch.cat` promotes to the wider dtype (float32 sinks beside 16-bit scores).
        let dtype = promote(sv.dtype, self.val(sinks).dtype);
        let rg = sv.requires_grad || self.rg(sinks);
        let combined = self.fresh(
            Shape::from([b, heads, s, width]),
            dtype,
            "scores and sinks",
            rg,
        )?;
        self.call(Call::new(
            AtenOp::Cat,
            vec![scores, expanded],
            vec![combined],
        ))?;
        let row = Shape::from([b, heads, s, 1]);
        let max = self.fresh(row.clone(), dtype, "row maximum", rg)?;
        let indices = self.storage(&row, DType::Int64, StorageKind::Activation, "max indices")?;
        let call = Call::new(AtenOp::MaxDim, vec![combined], vec![max]);
        self.call(call.aux(vec![indices]).results(vec![indices]))?;
        let shifted = self.fresh(Shape::from([b, heads, s, width]), dtype, "output", rg)?;
        self.call(Call::new(AtenOp::Sub, vec![combined, max], vec![shifted]))?;
        Ok(shifted)
    }

    /// SDPA's math path, `_scaled_dot_product_attention_math`
    /// (`aten/src/ATen/native/transformers/attention.cpp`), which CPU SDPA runs when flash
    /// cannot (`select_sdp_backend_cpp` in `sdp_utils_cpp.cpp`: attention dropout > 0 fails
    /// `check_for_dropout`). Under autocast SDPA takes 16-bit copies of Q, K and V, and the math
    /// path then computes in float32 whatever it was given in 16 bits (`query_acc =
    /// query_.to(at::kFloat)`, likewise key and value, unless
    /// `allowFP16BF16ReductionMathSDP`): Q and K^T are each scaled by √scale (new tensors,
    /// keeping the dimension order of their inputs), `matmul` copies them to
    /// `[B·heads, S, head_dim]` and `bmm` keeps both, `_safe_softmax` keeps its output, dropout
    /// keeps its noise, the second `bmm` keeps the dropped probabilities and V, and the result is
    /// cast back to the input's dtype. Grouped-query K and V are repeated first (transformers'
    /// `repeat_kv` when it passes a mask, the math path's own `repeat_interleave` under
    /// `enable_gqa`). Not modelled: the `[S, S_kv]` float causal mask built per call (`is_causal`),
    /// added in place.
    pub(super) fn sdpa_math(
        &mut self,
        q: ValueId,
        k: ValueId,
        v: ValueId,
        c: &AttentionCfg,
        bias: Option<ValueId>,
    ) -> Result<ValueId, Error> {
        let q = self.autocast_input(q)?;
        let k = self.autocast_input(k)?;
        let v = self.autocast_input(v)?;
        let origin = self.val(q).dtype;
        let q = self.upcast_keep_layout(q)?;
        let k = self.upcast_keep_layout(k)?;
        let v = self.upcast_keep_layout(v)?;
        let (k, v) = self.repeat_kv_heads(k, v, c)?;
        let qv = self.val(q).clone();
        let &[b, heads, s, hd] = qv.shape.dims() else {
            unreachable!("heads view is rank 4")
        };
        let kv = self.val(k).clone();
        let s_kv = kv.shape.dims()[2];
        let qs = self.scaled_like(q)?;
        let kt_layout = match kv.layout {
            Layout::Contiguous => Layout::LastTwoSwapped,
            _ => Layout::Strided,
        };
        let kt = self.view_op(
            k,
            Shape::from([b, heads, hd, s_kv]),
            kt_layout,
            AtenOp::Transpose,
            true,
        );
        let ks = self.scaled_like(kt)?;
        let qm = self.contiguous(qs)?;
        // `bmm` reads a transposed contiguous operand as it is; anything else is copied.
        let km = if self.val(ks).layout == Layout::LastTwoSwapped {
            ks
        } else {
            self.contiguous(ks)?
        };
        let scores = self.bmm(qm, km, Shape::from([b, heads, s, s_kv]), qv.dtype, "scores")?;
        let masked = match bias {
            Some(bias) => self.add(&[scores, bias], false)?,
            None => scores,
        };
        let probs = self.unary(masked, AtenOp::Softmax)?;
        let probs = self.dropout(probs, c.dropout, false)?;
        let vm = self.contiguous(v)?;
        let hd_v = self.val(vm).shape.dims()[3];
        let ctx = self.bmm(
            probs,
            vm,
            Shape::from([b, heads, s, hd_v]),
            qv.dtype,
            "context",
        )?;
        self.cast(ctx, origin)
    }

    /// `t.to(torch.float32)` of a 16-bit tensor, keeping its dimension order (`to` preserves
    /// the strides of a dense tensor); other dtypes pass through.
    fn upcast_keep_layout(&mut self, t: ValueId) -> Result<ValueId, Error> {
        let layout = self.val(t).layout;
        let up = self.upcast_f32(t)?;
        if up != t {
            self.tape.values[up].layout = layout;
        }
        Ok(up)
    }

    /// `t * scalar` into a new tensor that keeps the dimension order of a dense `t`
    /// (TensorIterator's output follows its input's strides).
    fn scaled_like(&mut self, t: ValueId) -> Result<ValueId, Error> {
        let layout = self.val(t).layout;
        let y = self.unary(t, AtenOp::MulScalar)?;
        self.tape.values[y].layout = match layout {
            Layout::HeadsStrided => Layout::HeadsTransposed,
            l => l,
        };
        Ok(y)
    }

    /// `bmm` of two activations (as `matmul` runs it on batched operands): keeps both.
    fn bmm(
        &mut self,
        a: ValueId,
        b: ValueId,
        out_shape: Shape,
        dtype: DType,
        what: &'static str,
    ) -> Result<ValueId, Error> {
        let rg = self.rg(a) || self.rg(b);
        let y = self.fresh(out_shape, dtype, what, rg)?;
        self.call(Call::new(AtenOp::Bmm, vec![a, b], vec![y]))?;
        Ok(y)
    }

    /// transformers' `repeat_kv`: `expand` then `reshape`, a copy at full head count.
    /// `convert_boolean_attn_mask`: SDPA turns a boolean `[B, 1, S, S_kv]` mask into a float one
    /// of the query's (autocast) dtype, `zeros_like` then `masked_fill_` of its `logical_not`;
    /// the float mask is an input of the kernel, which keeps it.
    fn converted_bool_mask(&mut self, q: ValueId, k: ValueId) -> Result<ValueId, Error> {
        let qv = self.val(q).clone();
        let &[b, _, s, _] = qv.shape.dims() else {
            unreachable!("heads view is rank 4")
        };
        let s_kv = self.val(k).shape.dims()[2];
        let dtype = match self.s.amp {
            Some(amp) if qv.dtype.is_float() => amp.dtype(),
            _ => qv.dtype,
        };
        let shape = Shape::from([b, 1, s, s_kv]);
        let not = self.storage(
            &shape,
            DType::Bool,
            StorageKind::Activation,
            "logical_not mask",
        )?;
        let mask = self.fresh(shape, dtype, "float attention mask", false)?;
        self.call(Call::new(AtenOp::BoolMaskToFloat, Vec::new(), vec![mask]).allocs(vec![not]))?;
        Ok(mask)
    }

    /// K and V with as many heads as Q: transformers' `repeat_kv` on each when the layer has
    /// fewer KV heads (grouped-query attention); unchanged otherwise.
    fn repeat_kv_heads(
        &mut self,
        k: ValueId,
        v: ValueId,
        c: &AttentionCfg,
    ) -> Result<(ValueId, ValueId), Error> {
        if c.kv_heads < c.heads {
            Ok((self.repeat_kv(k, c.heads)?, self.repeat_kv(v, c.heads)?))
        } else {
            Ok((k, v))
        }
    }

    pub(super) fn repeat_kv(&mut self, t: ValueId, heads: u64) -> Result<ValueId, Error> {
        let tv = self.val(t).clone();
        let &[b, _, s, hd] = tv.shape.dims() else {
            unreachable!("heads view is rank 4")
        };
        let y = self.fresh(
            Shape::from([b, heads, s, hd]),
            tv.dtype,
            "repeated kv",
            tv.requires_grad,
        )?;
        self.call(Call::new(AtenOp::RepeatKv, vec![t], vec![y]))?;
        Ok(y)
    }
}

impl Tracer<'_> {
    /// The `sdpa` kind: `F.scaled_dot_product_attention(q, k, v)` on inputs a diffusers
    /// processor built (see [`crate::graph::SdpaCfg`]). With `dim = 2` the inputs are
    /// `[B, S, heads, head_dim]` and are transposed to heads-first views (a contiguous input
    /// becomes the `[B, heads, S, head_dim]` view of a `[B, S, heads, head_dim]` tensor, as
    /// `dispatch_attention_fn`'s `permute(0, 2, 1, 3)` makes it), and the output is transposed
    /// back. With `rotary`, Q and K are rotated first ([`Self::rope_apply`]), in their layout as
    /// given. The kernel is [`Self::sdpa_fused`]'s choice (the CPU's flash kernel, or on CUDA
    /// the one `sdp_utils.cpp` picks).
    pub(super) fn sdpa_layer(
        &mut self,
        c: &SdpaCfg,
        q: ValueId,
        k: ValueId,
        v: ValueId,
    ) -> Result<ValueId, Error> {
        let shape4 = |t: &Self, v: ValueId, what: &str| -> Result<[u64; 4], Error> {
            let tv = t.val(v);
            match (tv.shape.dims(), tv.dtype.is_float()) {
                (&[a, b, c, d], true) => Ok([a, b, c, d]),
                _ => Err(t.err(format!(
                    "{what} is {} {}, expected a float rank-4 tensor ({})",
                    tv.dtype,
                    tv.shape,
                    if c.heads_dim == 1 {
                        "[B, heads, S, head_dim]"
                    } else {
                        "[B, S, heads, head_dim]"
                    }
                ))),
            }
        };
        let (qs, ks, vs) = (
            shape4(self, q, "the queries")?,
            shape4(self, k, "the keys")?,
            shape4(self, v, "the values")?,
        );
        let (h, s) = if c.heads_dim == 1 { (1, 2) } else { (2, 1) };
        if qs[0] != ks[0]
            || qs[0] != vs[0]
            || qs[h] != ks[h]
            || ks[h] != vs[h]
            || qs[3] != ks[3]
            || ks[s] != vs[s]
        {
            return Err(self.err(format!(
                "queries {}, keys {} and values {} do not fit: one batch and head count, equal query and key widths, as many keys as values",
                self.val(q).shape,
                self.val(k).shape,
                self.val(v).shape
            )));
        }
        let (q, k) = if c.rotary {
            let rope = self.rope.ok_or_else(|| {
                self.err("`rotary = true` needs a `rotary` layer earlier in the model".into())
            })?;
            self.rope_pair(q, k, rope)?
        } else {
            (q, k)
        };
        let heads_first = |t: &mut Self, x: ValueId| -> ValueId {
            if c.heads_dim == 1 {
                return x;
            }
            let xv = t.val(x).clone();
            let d = xv.shape.dims();
            let layout = match xv.layout {
                Layout::Contiguous => Layout::HeadsTransposed,
                Layout::HeadsTransposed => Layout::Contiguous,
                _ => Layout::Strided,
            };
            t.view_op(
                x,
                Shape::from([d[0], d[2], d[1], d[3]]),
                layout,
                AtenOp::Transpose,
                true,
            )
        };
        let (q, k, v) = (
            heads_first(self, q),
            heads_first(self, k),
            heads_first(self, v),
        );
        let cfg = AttentionCfg {
            style: AttnStyle::Transformers,
            heads: qs[h],
            kv_heads: ks[h],
            head_dim: Some(qs[3]),
            causal: c.causal,
            kv_cache: false,
            bias: false,
            out_bias: false,
            k_bias: false,
            scale_query: false,
            contiguous_heads: false,
            fused_qkv: false,
            chunked: false,
            rotary: false,
            dropout: 0.0,
            qk_norm_style: RmsStyle::Llama,
            qk_norm: None,
            position_bias: false,
            sliding_window: None,
            softmax_f32: false,
            // `enable_gqa` is not passed.
            bool_mask: true,
            expand_kv: false,
            softcap: None,
            sinks: false,
        };
        let out = self.sdpa_fused(q, k, v, &cfg, None)?;
        Ok(heads_first(self, out))
    }
}

/// The layout of a new tensor computed elementwise from one of layout `l` (TensorIterator
/// keeps a dense input's dimension order): heads split out of a fused projection come out
/// dense in that order; any other strided view, contiguous.
fn dense_order(l: Layout) -> Layout {
    match l {
        Layout::HeadsStrided => Layout::HeadsTransposed,
        Layout::Strided | Layout::LastTwoSwapped => Layout::Contiguous,
        l => l,
    }
}
