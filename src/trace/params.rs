//! Parameters, buffers, quantized weights and LoRA adapters.

#[allow(clippy::wildcard_imports)]
use super::*;
use crate::settings::QloraStack;

impl Tracer<'_> {
    /// A new parameter tensor of this layer. With LoRA the base model is frozen.
    pub(super) fn param(&mut self, shape: Shape, trainable: bool) -> Result<ValueId, Error> {
        let trainable = trainable && self.s.lora.is_none();
        self.param_as(shape, trainable, None)
    }

    /// A LoRA adapter matrix: trains even though the base is frozen. PEFT keeps adapters in
    /// float32 when the base is 16-bit (`autocast_adapter_dtype=True`).
    /// `--lora-dtype` (or a stack's bfloat16) overrides it.
    pub(super) fn adapter_param(&mut self, shape: Shape) -> Result<ValueId, Error> {
        let dtype = match (self.s.lora_dtype, self.param_dtype()) {
            (Some(d), _) => d,
            (None, DType::Float16 | DType::Bfloat16) => DType::Float32,
            (None, d) => d,
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

    /// Whether a linear layer's weight is quantized under `--dtype nf4|…`: by its name
    /// (`quantize_by_name`: heads are not), as the stack decides: torchtune quantizes only the
    /// projections that get adapters, litgpt every linear layer, the head included.
    pub(super) fn quantizable(&mut self, quantize_by_name: bool, target: &str) -> bool {
        match self.s.qlora_stack {
            Some(QloraStack::Torchtune) => quantize_by_name && self.lora_targeted(target),
            Some(QloraStack::Litgpt) => true,
            _ => quantize_by_name,
        }
    }

    /// The dtype TRL leaves a weight in: `peft_module_casting_to_bf16` casts float32 modules
    /// named `lm_head`, `embed_tokens`, `wte`, `wpe` or `score` to bfloat16 (`trl/trainer/utils.py`);
    /// with `--qlora-stack trl` under autocast such a weight takes the autocast dtype.
    pub(super) fn stack_dtype(&self, name: &str) -> Option<DType> {
        let last = name.rsplit('.').next().unwrap_or(name);
        let cast = matches!(self.s.qlora_stack, Some(QloraStack::Trl))
            && ["lm_head", "embed_tokens", "wte", "wpe", "score"]
                .iter()
                .any(|n| last.contains(n));
        self.s.amp.map(crate::settings::Amp::dtype).filter(|_| cast)
    }

    /// A projection of the base model, `x @ w.T + b`, then its LoRA adapters when targeted. A
    /// quantized weight runs as bitsandbytes' `Linear4bit.forward`
    /// (`bitsandbytes/nn/modules.py`): the input cast to the compute dtype, `matmul_4bit`
    /// (`MatMul4Bit` saves no activation: the weight is frozen, `ctx.tensors = (None, B)` in
    /// `bitsandbytes/autograd/_functions.py`, and its backward dequantizes the weight again),
    /// and the output cast back to the input's dtype (`out.to(inp_dtype)`): a float32 input
    /// (peft's float32 norms) gives a float32 output.
    pub(super) fn base_projection(
        &mut self,
        x: ValueId,
        w: ValueId,
        b: Option<ValueId>,
        (in_f, out_f): (u64, u64),
        target: &str,
    ) -> Result<ValueId, Error> {
        let mut y = self.linear(x, w, b, out_f)?;
        let quantized = self.quantized.contains(&w);
        if quantized {
            let xd = self.val(x).dtype;
            y = self.cast(y, xd)?;
        }
        self.lora(x, y, (in_f, out_f), target, quantized)
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

    /// A new parameter, or, while a layer with `shares` is traced, the next of the shared
    /// layer's parameters (checked to have this shape).
    pub(super) fn param_typed(
        &mut self,
        shape: Shape,
        trainable: bool,
        quant: Option<Quant>,
        dtype: DType,
    ) -> Result<ValueId, Error> {
        if let Some(shared) = self.sharing.as_mut() {
            let v = shared.pop_front().ok_or(Error::Internal(
                "a shared layer made more parameters than its owner",
            ))?;
            let theirs = &self.tape.values[v];
            if theirs.shape != shape {
                return Err(self.err(format!(
                    "`shares`: the shared parameter has shape {}, this layer's input needs {shape}",
                    theirs.shape
                )));
            }
            return Ok(v);
        }
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

    /// PEFT's LoRA on a targeted projection: `y + B(A(dropout(x))) · scaling` with trainable
    /// `A: [rank, in]`, `B: [out, rank]` (`peft/tuners/lora/layer.py`, `Linear.forward`). Outside
    /// autocast the input is cast to the adapters' dtype first (a copy when they differ), which
    /// `A` keeps; under autocast it is not (`requires_conversion = not
    /// torch.is_autocast_enabled()`) and autocast's 16-bit copy is what `A` keeps. `--lora-dropout`
    /// drops the input first (it keeps its mask, and `A` keeps the dropped copy). `B` keeps `A`'s
    /// `[.., rank]` output; the sum is cast back to `y`'s dtype. Over a quantized base
    /// (`peft/tuners/lora/bnb.py`, `Linear4bit.forward`) the base output is cloned first
    /// ("for 4bit, we need to defensively clone here").
    pub(super) fn lora(
        &mut self,
        x: ValueId,
        y: ValueId,
        (in_f, out_f): (u64, u64),
        target: &str,
        quantized_base: bool,
    ) -> Result<ValueId, Error> {
        if !self.lora_targeted(target) {
            return Ok(y);
        }
        let y = if quantized_base {
            self.unary(y, AtenOp::Clone)?
        } else {
            y
        };
        let rank = self.s.lora.as_ref().map_or(0, |l| l.rank);
        let a = self.adapter_param(Shape::from([rank, in_f]))?;
        let b = self.adapter_param(Shape::from([out_f, rank]))?;
        let adt = self.val(a).dtype;
        let xc = if self.s.amp.is_some() {
            x
        } else {
            self.cast(x, adt)?
        };
        let xc = match self.s.lora_dropout {
            Some(p) => self.dropout(xc, p, false)?,
            None => xc,
        };
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
