//! Sparse mixture-of-experts layers (`grouped_mm` experts).

#[allow(clippy::wildcard_imports)]
use super::*;
use crate::spec::Router;

impl Tracer<'_> {
    /// A sparse MoE block as transformers 5 runs it with `grouped_mm` experts
    /// (`MixtralSparseMoeBlock`, `integrations/moe.py`). With `T = B·S` tokens and `T·k` routed
    /// rows (routing assumed balanced), it keeps: the router input; the float32 softmax `[T, E]`;
    /// the top-k indices (int64 `[T, k]`); with renormalization the float32 sum `[T, 1]` and a
    /// clone of the top-k weights; the sort permutation, its `// k` and its inverse (int64
    /// `[T·k]` each); the gathered rows `[T·k, H]` and the int32 expert offsets `[E]`; the fused
    /// gate/up output `[T·k, 2I]`, the SiLU output and the gated product `[T·k, I]`; the down
    /// output `[T·k, H]` and the routing weights `[T·k, 1]`. A shared expert is a dense SiLU-gated
    /// MLP on every token, optionally scaled by `sigmoid(x·w_gate)`.
    pub(super) fn moe(&mut self, x: ValueId, c: &MoeCfg, train: bool) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let (b, s, h) = self.bsh(&xv)?;
        let a = xv.dtype;
        let t = checked(b.checked_mul(s), "the token count")?;
        let tk = checked(t.checked_mul(c.top_k), "the routed row count")?;
        // The rows the experts run on: as routed (dropless), or, with an expert capacity factor
        // (`--capacity-factor`), `capacity = ceil(factor · T·k / E)` rows per expert, padded to
        // it (Megatron-Core `moe_expert_capacity_factor` with `moe_pad_expert_input_to_capacity`;
        // GShard, Switch Transformer): `E · capacity` in all.
        let rows = match self
            .s
            .parallel
            .as_ref()
            .and_then(|p| p.experts)
            .and_then(|e| e.capacity_factor)
        {
            Some(f) => capacity_rows(tk, c.experts, f)?,
            None => tk,
        };
        let weights = match c.router {
            Router::Softmax => self.softmax_router(x, c, t, train)?,
            Router::DeepseekV2 | Router::DeepseekV3 => self.deepseek_router(x, c, t, train)?,
            Router::GptOss => self.gpt_oss_router(x, c, t, train)?,
        };
        // Float32 weights are cast to the activations' dtype (GPT-OSS's already are).
        let w_act = if self.val(weights).dtype == a {
            weights
        } else {
            let y = self.fresh(
                Shape::from([t, c.top_k]),
                a,
                "routing weights",
                self.rg(weights),
            )?;
            self.call(Call::new(AtenOp::ToCopy, vec![weights], vec![y]))?;
            y
        };
        // Dispatch: sort rows by expert, gather them.
        let mut index = Vec::new();
        for what in ["perm // k", "perm", "inverse perm"] {
            index.push(self.storage(
                &Shape::from([tk]),
                DType::Int64,
                StorageKind::Activation,
                what,
            )?);
        }
        let offsets = self.storage(
            &Shape::from([c.experts]),
            DType::Int32,
            StorageKind::Activation,
            "expert offsets",
        )?;
        // The sorted expert ids (`expert_ids_g`, the values `torch.sort` returns beside the
        // permutation): the per-row bias gathers keep them.
        let sorted_ids = if c.expert_bias {
            Some(self.storage(
                &Shape::from([tk]),
                DType::Int64,
                StorageKind::Activation,
                "sorted expert ids",
            )?)
        } else {
            None
        };
        let gathered = self.fresh(
            Shape::from([rows, h]),
            a,
            "gathered tokens",
            xv.requires_grad,
        )?;
        let dispatch = vec![index[0], index[1], index[2], offsets];
        let mut allocs = dispatch.clone();
        allocs.extend(sorted_ids);
        let call = Call::new(AtenOp::MoeDispatch, vec![x], vec![gathered]);
        self.call(call.aux(dispatch).allocs(allocs))?;
        let ws = self.fresh(
            Shape::from([rows, 1]),
            a,
            "sorted routing weights",
            self.rg(w_act),
        )?;
        // `index` keeps its indices: the permutation, kept by the dispatch already.
        self.call(Call::new(AtenOp::Index, vec![w_act], vec![ws]).aux(vec![index[1]]))?;
        let two_i = super::checked(
            c.intermediate_size.checked_mul(2),
            "the experts' gate and up width (2 × intermediate_size)",
        )?;
        // Experts: grouped_mm with [E, 2I, H] and [E, H, I] weights (GPT-OSS stores them
        // transposed, [E, H, 2I] and [E, I, H]: the same sizes), with `expert_bias` their
        // [E, 2I] and [E, H] biases.
        let w_gu = self.weight(Shape::from([c.experts, two_i, h]), train, true)?;
        let b_gu = if c.expert_bias {
            Some(self.param(Shape::from([c.experts, two_i]), train)?)
        } else {
            None
        };
        let w_down = self.weight(
            Shape::from([c.experts, h, c.intermediate_size]),
            train,
            true,
        )?;
        let b_down = if c.expert_bias {
            Some(self.param(Shape::from([c.experts, h]), train)?)
        } else {
            None
        };
        let gu = self.grouped_mm(gathered, w_gu, Shape::from([rows, two_i]), offsets)?;
        let gu = self.expert_bias(gu, b_gu, sorted_ids)?;
        let prod = match c.swiglu_limit {
            Some(_) => self.clamped_swiglu(gu, rows, c.intermediate_size)?,
            None => {
                let gate = self.view_of(
                    gu,
                    Shape::from([rows, c.intermediate_size]),
                    Layout::Strided,
                );
                let up = self.view_of(
                    gu,
                    Shape::from([rows, c.intermediate_size]),
                    Layout::Strided,
                );
                self.call(Call::new(AtenOp::Chunk, vec![gu], vec![gate, up]))?;
                let act = self.unary(gate, AtenOp::Silu)?;
                self.mul(act, up)?
            }
        };
        let down = self.grouped_mm(prod, w_down, Shape::from([rows, h]), offsets)?;
        let down = self.expert_bias(down, b_down, sorted_ids)?;
        let weighted = self.mul(down, ws)?;
        let scattered = self.fresh(Shape::from([tk, h]), a, "unsorted rows", self.rg(weighted))?;
        let call = Call::new(AtenOp::Index, vec![weighted], vec![scattered]);
        self.call(call.aux(vec![index[2]]))?;
        let rg = self.rg(scattered);
        let out = self.fresh(xv.shape.clone(), a, "output", rg)?;
        self.call(Call::new(AtenOp::Sum, vec![scattered], vec![out]))?;
        if c.shared_intermediate_size == 0 {
            return Ok(out);
        }
        // Shared expert (Qwen-MoE).
        let g = self.projection(
            x,
            h,
            c.shared_intermediate_size,
            false,
            train,
            "shared_expert.gate_proj",
        )?;
        let g = self.unary(g, AtenOp::Silu)?;
        let u = self.projection(
            x,
            h,
            c.shared_intermediate_size,
            false,
            train,
            "shared_expert.up_proj",
        )?;
        let p = self.mul(g, u)?;
        let mut shared = self.projection(
            p,
            c.shared_intermediate_size,
            h,
            false,
            train,
            "shared_expert.down_proj",
        )?;
        if c.shared_gate {
            let sg = self.projection(x, h, 1, false, train, "shared_expert_gate")?;
            let sg = self.unary(sg, AtenOp::Sigmoid)?;
            shared = self.mul(sg, shared)?;
        }
        self.add(&[out, shared], false)
    }

    /// The softmax router (`MixtralSparseMoeBlock`'s gate): logits in the activations' dtype,
    /// a float32 softmax, top-k and, with [`MoeCfg::normalize_topk`], renormalized; returns
    /// the float32 top-k weights `[T, k]`.
    fn softmax_router(
        &mut self,
        x: ValueId,
        c: &MoeCfg,
        t: u64,
        train: bool,
    ) -> Result<ValueId, Error> {
        let h = self.val(x).shape.dims()[2];
        let logits = self.projection(x, h, c.experts, false, train, "gate")?;
        let lf = self.upcast_f32(logits)?;
        let probs = self.unary(lf, AtenOp::Softmax)?;
        let rg = self.rg(probs);
        let topv = self.fresh(
            Shape::from([t, c.top_k]),
            DType::Float32,
            "top-k weights",
            rg,
        )?;
        let idx = self.storage(
            &Shape::from([t, c.top_k]),
            DType::Int64,
            StorageKind::Activation,
            "top-k indices",
        )?;
        let call = Call::new(AtenOp::Topk, vec![probs], vec![topv]);
        self.call(call.aux(vec![idx]).results(vec![idx]))?;
        let weights = if c.normalize_topk {
            let sum = self.storage(
                &Shape::from([t, 1]),
                DType::Float32,
                StorageKind::Activation,
                "top-k sum",
            )?;
            let clone = self.storage(
                &Shape::from([t, c.top_k]),
                DType::Float32,
                StorageKind::Activation,
                "top-k weights clone",
            )?;
            let y = self.view_of(topv, Shape::from([t, c.top_k]), Layout::Contiguous);
            let call = Call::new(AtenOp::DivInplace, vec![topv], vec![y]);
            self.call(call.aux(vec![sum, clone]).allocs(vec![sum, clone]))?;
            y
        } else {
            topv
        };
        Ok(weights)
    }

    /// GPT-OSS's router (`GptOssTopKRouter`): `F.linear(x, weight, bias)` on the `[T, H]`
    /// tokens (the raw `[E, H]` and `[E]` parameters: `addmm`, keeping the tokens and the
    /// weight), `topk` of the logits (keeps its int64 `[T, k]` indices), then
    /// `softmax(values, dtype=values.dtype)` over the k chosen (keeps its output). Returns
    /// those weights, `[T, k]` in the activations' dtype.
    fn gpt_oss_router(
        &mut self,
        x: ValueId,
        c: &MoeCfg,
        t: u64,
        train: bool,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let h = xv.shape.dims()[2];
        let w = self.param(Shape::from([c.experts, h]), train)?;
        let b = self.param(Shape::from([c.experts]), train)?;
        let logits = self.linear(x, w, Some(b), c.experts)?;
        let lv = self.val(logits).clone();
        let topv = self.fresh(
            Shape::from([t, c.top_k]),
            lv.dtype,
            "top-k logits",
            lv.requires_grad,
        )?;
        let idx = self.storage(
            &Shape::from([t, c.top_k]),
            DType::Int64,
            StorageKind::Activation,
            "top-k indices",
        )?;
        let call = Call::new(AtenOp::Topk, vec![logits], vec![topv]);
        self.call(call.aux(vec![idx]).results(vec![idx]))?;
        self.unary(topv, AtenOp::Softmax)
    }

    /// `out.add_(bias[expert_ids_g])` (`_grouped_linear` with a bias): the `[E, n]` bias
    /// gathered per routed row (`index`, keeping the sorted ids; the gathered rows are a
    /// forward temporary), added in place (keeps nothing). Without a bias, `out` itself.
    fn expert_bias(
        &mut self,
        out: ValueId,
        bias: Option<ValueId>,
        sorted_ids: Option<StorageId>,
    ) -> Result<ValueId, Error> {
        let (Some(bias), Some(ids)) = (bias, sorted_ids) else {
            return Ok(out);
        };
        let ov = self.val(out).clone();
        let gathered = self.fresh(
            ov.shape.clone(),
            self.val(bias).dtype,
            "gathered expert biases",
            self.rg(bias),
        )?;
        self.call(Call::new(AtenOp::Index, vec![bias], vec![gathered]).aux(vec![ids]))?;
        self.add(&[out, gathered], true)
    }

    /// GPT-OSS's clamped SwiGLU (`GptOssExperts._apply_gate`) on the `[rows, 2I]` grouped
    /// product: `gate, up = gate_up[..., ::2], gate_up[..., 1::2]` (strided views),
    /// `gate.clamp(max=limit)` and `up.clamp(-limit, limit)` (each keeps its input: the
    /// product), `glu = gate * sigmoid(gate * alpha)` (the scalar product keeps nothing,
    /// `sigmoid` its output, the product both factors), `(up + 1) * glu` (the sum keeps
    /// nothing, the product both factors). Returns the `[rows, I]` result.
    fn clamped_swiglu(&mut self, gu: ValueId, rows: u64, inter: u64) -> Result<ValueId, Error> {
        let half = Shape::from([rows, inter]);
        let gate = self.view_op(gu, half.clone(), Layout::Strided, AtenOp::Slice, false);
        let up = self.view_op(gu, half, Layout::Strided, AtenOp::Slice, false);
        let gate = self.unary(gate, AtenOp::Clamp)?;
        let up = self.unary(up, AtenOp::Clamp)?;
        let scaled = self.unary(gate, AtenOp::MulScalar)?;
        let sig = self.unary(scaled, AtenOp::Sigmoid)?;
        let glu = self.mul(gate, sig)?;
        let up1 = self.unary(up, AtenOp::AddScalar)?;
        self.mul(up1, glu)
    }

    /// DeepSeek's routers (`DeepseekV2TopkRouter`, `DeepseekV3TopkRouter`): float32 logits from
    /// float32 copies of the tokens and the `[E, H]` weight (`F.linear(x.type(float32),
    /// weight.type(float32))`, which keeps both), then V2 a softmax, V3 a sigmoid (each keeps
    /// its output) plus the `e_score_correction_bias` buffer. With groups, the group-limited
    /// choice (one composite step: the per-group top-2 (V3) or maximum (V2) keeps its int64
    /// indices, the group `topk` its indices, the inverted boolean `[T, E]` mask that
    /// `masked_fill` keeps), then `topk` (keeps its indices); V3 gathers the weights from the
    /// sigmoid scores and renormalizes them as `norm_topk_prob` says; both scale them by
    /// `routed_scaling_factor` (a new tensor). Returns the float32 weights `[T, k]`.
    fn deepseek_router(
        &mut self,
        x: ValueId,
        c: &MoeCfg,
        t: u64,
        train: bool,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let h = xv.shape.dims()[2];
        let e = c.experts;
        let w = self.param(Shape::from([e, h]), train)?;
        if c.router == Router::DeepseekV3 {
            self.buffer(Shape::from([e]), DType::Float32, "e_score_correction_bias")?;
        }
        let xf = self.upcast_f32(x)?;
        let wf = self.upcast_f32(w)?;
        let logits = self.linear(xf, wf, None, e)?;
        let v3 = c.router == Router::DeepseekV3;
        let scores = self.unary(logits, if v3 { AtenOp::Sigmoid } else { AtenOp::Softmax })?;
        let rg = self.rg(scores);
        let f32 = |n: u64| Shape::from([t, n]);
        let idx = self.storage(
            &f32(c.top_k),
            DType::Int64,
            StorageKind::Activation,
            "top-k indices",
        )?;
        let topv = self.fresh(f32(c.top_k), DType::Float32, "top-k weights", rg)?;
        if v3 || c.groups > 1 {
            // V3 always ranks groups (one group included); V2 with `group_limited_greedy`.
            let per_group = if v3 { 2 } else { 1 };
            let g = c.groups;
            let mut saved = Vec::new();
            for (what, shape, dt) in [
                (
                    "group top indices",
                    Shape::from([t, g, per_group]),
                    DType::Int64,
                ),
                ("group indices", f32(c.topk_groups), DType::Int64),
                ("inverted score mask", f32(e), DType::Bool),
            ] {
                saved.push(self.storage(&shape, dt, StorageKind::Activation, what)?);
            }
            saved.push(idx);
            let mut allocs = saved.clone();
            if v3 {
                // `scores + e_score_correction_bias`
                allocs.push(self.storage(
                    &f32(e),
                    DType::Float32,
                    StorageKind::Activation,
                    "scores for choice",
                )?);
            }
            for (what, shape, dt) in [
                (
                    "group top values",
                    Shape::from([t, g, per_group]),
                    DType::Float32,
                ),
                ("group scores", f32(g), DType::Float32),
                ("group top-k values", f32(c.topk_groups), DType::Float32),
                ("group mask", f32(g), DType::Float32),
                ("score mask", f32(e), DType::Float32),
                ("score mask (bool)", f32(e), DType::Bool),
                ("masked scores", f32(e), DType::Float32),
            ] {
                allocs.push(self.storage(&shape, dt, StorageKind::Activation, what)?);
            }
            let call = Call::new(AtenOp::GroupLimitedTopk, vec![scores], vec![topv]);
            self.call(call.aux(saved).allocs(allocs))?;
        } else {
            let call = Call::new(AtenOp::Topk, vec![scores], vec![topv]);
            self.call(call.aux(vec![idx]).results(vec![idx]))?;
        }
        let weights = if v3 && c.normalize_topk {
            // `denominator = topk_weights.sum(-1, keepdim=True) + 1e-20; topk_weights /= ..`
            let sum = self.storage(
                &f32(1),
                DType::Float32,
                StorageKind::Activation,
                "top-k sum",
            )?;
            let den = self.storage(
                &f32(1),
                DType::Float32,
                StorageKind::Activation,
                "denominator",
            )?;
            let clone = self.storage(
                &f32(c.top_k),
                DType::Float32,
                StorageKind::Activation,
                "top-k weights clone",
            )?;
            let y = self.view_of(topv, f32(c.top_k), Layout::Contiguous);
            let call = Call::new(AtenOp::DivInplace, vec![topv], vec![y]);
            self.call(call.aux(vec![den, clone]).allocs(vec![sum, den, clone]))?;
            y
        } else {
            topv
        };
        // `topk_weights * self.routed_scaling_factor`
        self.unary(weights, AtenOp::MulScalar)
    }

    /// `torch._grouped_mm(rows, weights, offs)`: keeps its input rows and the offsets (and the
    /// weights, which are parameters). It is not on autocast's lists: it runs in its inputs'
    /// dtype (measured: a tiny Mixtral under bfloat16 autocast keeps float32 rows and no weight
    /// copies).
    pub(super) fn grouped_mm(
        &mut self,
        rows: ValueId,
        w: ValueId,
        out_shape: Shape,
        offsets: StorageId,
    ) -> Result<ValueId, Error> {
        self.weight_matmul(
            AtenOp::GroupedMm,
            rows,
            w,
            w,
            None,
            out_shape,
            vec![offsets],
        )
    }
}

/// Rows the experts run on under an expert capacity factor: `experts · ceil(factor · routed /
/// experts)` (each expert padded to its capacity; Megatron-Core `moe_utils.get_capacity`:
/// `ceil((num_tokens / num_experts) * capacity_factor)` over the `T·k` routed token slots).
///
/// # Errors
/// [`Error::Overflow`] when the count does not fit in 64 bits.
pub(super) fn capacity_rows(routed: u64, experts: u64, factor: f64) -> Result<u64, Error> {
    let experts = experts.max(1);
    #[allow(clippy::cast_precision_loss)] // token counts far below 2^52
    let per = (routed as f64 / experts as f64 * factor).ceil();
    if !(0.0..9.0e15).contains(&per) {
        return Err(Error::Overflow("the experts' capacity".into()));
    }
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // checked range
    let per = per as u64;
    per.checked_mul(experts)
        .ok_or_else(|| Error::Overflow("the experts' capacity".into()))
}

#[cfg(test)]
mod tests {
    use super::capacity_rows;

    #[test]
    fn capacity_pads_each_expert() {
        // 4096 tokens, top-2, 8 experts, factor 1.25: ceil(8192 / 8 · 1.25) = 1280 per expert.
        assert_eq!(capacity_rows(8192, 8, 1.25).unwrap(), 10_240);
        // Rounding up per expert: ceil(10 / 3 · 1.0) = 4.
        assert_eq!(capacity_rows(10, 3, 1.0).unwrap(), 12);
    }
}
