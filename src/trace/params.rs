//! Parameters, buffers, quantized weights and LoRA adapters.

#[allow(clippy::wildcard_imports)]
use super::*;

impl Tracer<'_> {
    /// A new parameter tensor of this layer. With LoRA the base model is frozen.
    pub(super) fn param(&mut self, shape: Shape, trainable: bool) -> Result<ValueId, Error> {
        let trainable = trainable && self.s.lora.is_none();
        self.param_as(shape, trainable, None)
    }

    /// A LoRA adapter matrix: trains even though the base is frozen. PEFT keeps adapters in
    /// float32 when the base is 16-bit (`autocast_adapter_dtype=True`).
    pub(super) fn adapter_param(&mut self, shape: Shape) -> Result<ValueId, Error> {
        let dtype = match self.param_dtype() {
            DType::Float16 | DType::Bfloat16 => DType::Float32,
            d => d,
        };
        self.param_typed(shape, true, None, dtype)
    }

    /// A linear projection's weight `[out, in]` (or MoE experts' `[experts, out, in]`): quantized under `--dtype nf4|int8|int4|fp8`
    /// when `quantizable` (quantized weights are frozen, as bitsandbytes' `Params4bit` are).
    pub(super) fn weight(
        &mut self,
        shape: Shape,
        trainable: bool,
        quantizable: bool,
    ) -> Result<ValueId, Error> {
        match self.s.quant.filter(|_| quantizable) {
            Some(q) => {
                let v = self.param_as(shape, false, Some(q))?;
                self.quantized.insert(v);
                Ok(v)
            }
            None => self.param(shape, trainable),
        }
    }

    pub(super) fn param_as(
        &mut self,
        shape: Shape,
        trainable: bool,
        quant: Option<Quant>,
    ) -> Result<ValueId, Error> {
        let dtype = self.param_dtype();
        self.param_typed(shape, trainable, quant, dtype)
    }

    pub(super) fn param_typed(
        &mut self,
        shape: Shape,
        trainable: bool,
        quant: Option<Quant>,
        dtype: DType,
    ) -> Result<ValueId, Error> {
        let numel = checked(shape.numel(), "a parameter's element count")?;
        let s = self.storage(&shape, dtype, StorageKind::Parameter, "parameter")?;
        let (bytes, dtype_name) = match quant {
            None => (self.tape.storages[s].bytes, dtype.as_str()),
            Some(q) => (
                checked(q.bytes(shape.dims()), "quantized weight bytes")?,
                q.name(),
            ),
        };
        self.tape.storages[s].bytes = bytes;
        let v = self.value(s, shape.clone(), dtype, Layout::Contiguous, trainable, true);
        self.tape.params.push(Param {
            shape,
            numel,
            bytes,
            trainable,
            value: v,
            dtype_name,
        });
        Ok(v)
    }

    /// Whether LoRA targets a projection (`q`, `k`, `v`, `o`, `qkv` for fused ones) or a linear
    /// layer by name, and marks the `--lora-targets` entries that match it (see
    /// [`lora_entry_matches`]). Every module seen is remembered for the error that names an
    /// entry matching nothing.
    pub(super) fn lora_targeted(&mut self, target: &str) -> bool {
        let Some(lora) = &self.s.lora else {
            return false;
        };
        let shown: &[&str] = if target == "qkv" {
            &["q", "k", "v"]
        } else {
            &[target.rsplit('.').next().unwrap_or(target)]
        };
        for name in shown {
            if !self.lora_modules.iter().any(|m| m == name) {
                self.lora_modules.push((*name).to_string());
            }
        }
        if self.lora_matched.len() != lora.targets.len() {
            self.lora_matched = vec![false; lora.targets.len()];
        }
        let mut any = false;
        for (entry, matched) in lora.targets.iter().zip(self.lora_matched.iter_mut()) {
            if lora_entry_matches(entry, target) {
                *matched = true;
                any = true;
            }
        }
        any
    }

    /// PEFT's LoRA on a targeted projection: `y + B(A(x)) · scaling` with trainable
    /// `A: [rank, in]`, `B: [out, rank]` (lora_dropout 0). The input is cast to the adapters'
    /// dtype first (a copy when the model is 16-bit), which `A` keeps; `B` keeps `A`'s
    /// `[.., rank]` output; the sum is cast back to `y`'s dtype.
    pub(super) fn lora(
        &mut self,
        x: ValueId,
        y: ValueId,
        in_f: u64,
        out_f: u64,
        target: &str,
    ) -> Result<ValueId, Error> {
        if !self.lora_targeted(target) {
            return Ok(y);
        }
        let rank = self.s.lora.as_ref().map_or(0, |l| l.rank);
        let a = self.adapter_param(Shape::from([rank, in_f]))?;
        let b = self.adapter_param(Shape::from([out_f, rank]))?;
        let adt = self.val(a).dtype;
        let xc = self.cast(x, adt)?;
        let xa = self.linear(xc, a, None, rank)?;
        let xb = self.linear(xa, b, None, out_f)?;
        let scaled = self.unary(xb, AtenOp::MulScalar)?;
        let sum = self.add(&[y, scaled], false)?;
        let ydt = self.val(y).dtype;
        self.cast(sum, ydt)
    }

    /// `x.to(dtype)`: a copy when the dtype differs.
    pub(super) fn cast(&mut self, x: ValueId, dtype: DType) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        if xv.dtype == dtype {
            return Ok(x);
        }
        let y = self.fresh(xv.shape.clone(), dtype, "cast", xv.requires_grad)?;
        self.call(Call::new(AtenOp::ToCopy, vec![x], vec![y]))?;
        Ok(y)
    }

    pub(super) fn buffer(
        &mut self,
        shape: Shape,
        dtype: DType,
        what: &'static str,
    ) -> Result<StorageId, Error> {
        self.storage(&shape, dtype, StorageKind::Buffer, what)
    }
}

/// Whether one `--lora-targets` entry matches a projection: PEFT's spelling (`q_proj`,
/// `gate_proj`: the module name's last segment, exactly) or memest's short one (`q`, `gate`: that
/// segment less `_proj`), or a dotted suffix of the module's name (`mlp.down_proj`). Attention
/// projections are the tags `q`, `k`, `v`, `o` (PEFT: `q_proj`, …); a fused `qkv` projection is
/// matched by `q`, `k`, `v`, `qkv`, `c_attn` (GPT-2) and `in_proj` (`nn.MultiheadAttention`),
/// with or without `_proj`. An MoE router (`gate`) is matched by `gate` but not by `gate_proj`,
/// as in PEFT.
#[must_use]
pub fn lora_entry_matches(entry: &str, target: &str) -> bool {
    let entry = entry.trim();
    if entry.is_empty() {
        return false;
    }
    let last = target.rsplit('.').next().unwrap_or(target);
    let stem = entry.strip_suffix("_proj");
    entry == target
        || target
            .strip_suffix(entry)
            .is_some_and(|head| head.ends_with('.'))
        || entry == last
        || last.strip_suffix("_proj") == Some(entry)
        || (matches!(target, "q" | "k" | "v" | "o") && stem == Some(target))
        || (target == "qkv"
            && matches!(
                stem.unwrap_or(entry),
                "q" | "k" | "v" | "qkv" | "c_attn" | "in"
            ))
}
