//! Tracing: the model's forward pass as PyTorch runs it, operator by operator.
//!
//! [`trace`] walks the [`Model`] with concrete [`Settings`], infers every shape, and records a
//! [`Tape`]: the tensors (storages) each ATen-level operator allocates, which of them autograd
//! saves for backward, and which inputs receive gradients. The rules for what is saved follow
//! `tools/autograd/derivatives.yaml` in pytorch/pytorch and the module code of torchvision and
//! transformers; each rule cites its source where it is defined. The step simulation
//! ([`crate::sim`]) replays the tape to find the peak.
//!
//! Repeated blocks are traced once per copy, each copy with fresh storages and its own
//! parameters; the graph itself is never expanded.

pub mod aten;
mod attention;
mod call;
mod deberta;
pub mod derive;
mod elementwise;
mod mla;
mod moe;
mod ops;
mod params;
pub mod sdpa;
pub mod tape;
mod tp;

use std::collections::HashMap;

/// A hash map with foldhash's hasher: the tracer's per-layer maps (names in scope, each
/// layer's row) are hashed once or more per layer, and SipHash was a tenth of tracing 100,000
/// layers. foldhash seeds each map randomly, as std's does.
type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

use call::Call;

pub use aten::AtenOp;
pub use params::lora_entry_matches;
pub use tape::{
    BlockCopies, IdList, LayerId, LayerInfo, Layout, Param, RareList, Segment, SegmentId, Step,
    Storage, StorageId, StorageKind, Tape, Value, ValueId,
};

use crate::cost::Quant;
use crate::dtype::DType;
use crate::error::{Error, LayerAt, LayerErrorKind, SettingKey};
use crate::graph::{
    Activation, AttentionCfg, AttnStyle, Combine, INPUT, InputRef, Layer, MlaCfg, Model, MoeCfg,
    Node, Op, QkNorm, RmsStyle, SdpaCfg,
};
use crate::settings::{Loss, Settings};
use crate::shape::Shape;
use crate::spec::{DimSpec, Pair};
use crate::vocab::{AttentionImpl, Device};
use sdpa::{SdpaCall, SdpaKernel};

/// Upper bound on traced operators (after repeating blocks), so that an absurd `count` is an
/// error rather than a hang.
pub const MAX_STEPS: usize = 2_000_000;

/// Which forward pass to trace: the step `settings` describe, or one forward call of
/// transformers' `model.generate` (`GenerationMixin._sample` in `generation/utils.py`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Pass {
    /// The whole step: a training step or one inference forward pass.
    #[default]
    Step,
    /// `generate`'s prefill: the prompt (`seq` tokens) in one forward. `generate` passes
    /// `logits_to_keep = 1` when the model's forward takes it (`_supports_logits_to_keep`), so
    /// the LM head runs on the last position only (`hidden_states[:, -1:, :]`); the causal
    /// caches are filled with the prompt's keys and values; then `generate` takes a float32
    /// copy of the last logits (`outputs.logits[:, -1].to(copy=True, dtype=torch.float32)`).
    Prefill,
    /// One decode step: one token per sequence, with `past` tokens already in each causal
    /// layer's cache. `DynamicLayer.update` (`cache_utils.py`) grows the cache by
    /// `torch.cat([self.keys, key_states], dim=-2)`: a new tensor of `past + 1` tokens, the old
    /// one freed once replaced (so one layer's old keys or values are a transient copy). The
    /// previous step's logits and their float32 copy stay alive until this step's replace them
    /// (`outputs = model_forward(...)`, then `next_token_logits = ...`).
    Decode {
        /// Tokens in each cache before this step.
        past: u64,
    },
}

/// Traces `model` under `settings`.
///
/// # Errors
/// [`Error::Layer`] for a shape mismatch or a layer that cannot apply to its input (naming the
/// layer, the shapes and what was expected), [`Error::Setting`] for a `"seq"` input without a
/// sequence length, [`Error::Overflow`] when a size does not fit in 64 bits.
pub fn trace(model: &Model, settings: &Settings) -> Result<Tape, Error> {
    trace_pass(model, settings, Pass::Step)
}

/// Traces one [`Pass`] of `model` under `settings` ([`trace`] is [`Pass::Step`]). A
/// [`Pass::Decode`] has one token per sequence, whatever `settings.seq` says.
///
/// # Errors
/// As [`trace`]; [`Error::Setting`] when a generation pass's model does not end in
/// `[batch, seq, vocab]` logits.
pub fn trace_pass(model: &Model, settings: &Settings, pass: Pass) -> Result<Tape, Error> {
    let mut t = Tracer {
        s: settings,
        pass,
        tape: Tape::default(),
        layer_index: FastMap::default(),
        cast_cache: HashMap::new(),
        embeddings: HashMap::new(),
        rope: None,
        rope_local: None,
        cur_layer: LayerId::default(),
        segment: None,
        in_block: false,
        written_copies: 1,
        block_kept: Vec::new(),
        label: &NO_LAYER,
        quantized: std::collections::HashSet::new(),
        position_bias: None,
        deberta: None,
        padding_ones: None,
        lora_matched: Vec::new(),
        lora_modules: Vec::new(),
        tp: tp::Tp::of(settings.parallel.as_ref()),
        layer_params: Vec::new(),
        shares_used: any_shares(&model.layers),
        sharing: None,
        referenced: std::collections::HashSet::default(),
    };
    referenced(&model.layers, &mut t.referenced);
    // Every layer makes a row and, but for a few views, a step, a storage and a value: sized
    // up front (twice the layers, room for the loss and a second operator per layer; capacity
    // never written takes no memory), these tables do not grow by copying. A model's layers
    // count each block's once.
    let layers = layer_count(&model.layers);
    let ops = layers.saturating_mul(2).saturating_add(16);
    t.layer_index.reserve(layers);
    t.tape.layers.reserve(layers.saturating_add(1));
    t.tape.steps.reserve(ops);
    t.tape.storages.reserve(ops);
    t.tape.values.reserve(ops);
    // Context parallelism: each rank holds `seq / cp` positions of every sequence.
    let cp = settings.parallel.as_ref().map_or(1, |p| p.cp.max(1));
    let input_shape = |dims_spec: &[DimSpec]| -> Result<Shape, Error> {
        let mut dims = vec![settings.batch];
        for d in dims_spec {
            dims.push(match d {
                DimSpec::Fixed(v) => *v,
                DimSpec::Seq if matches!(pass, Pass::Decode { .. }) => 1,
                DimSpec::Seq => settings
                    .seq
                    .ok_or_else(|| {
                        Error::setting(SettingKey::Seq, "the input has a \"seq\" dimension: give a sequence length with --seq or defaults.seq")
                    })?
                    .div_ceil(cp),
                DimSpec::TargetSeq => settings.target_seq.ok_or_else(|| {
                    Error::setting(SettingKey::Seq, "an input has a \"target_seq\" dimension: give its length with --target-seq or defaults.target_seq")
                })?,
            });
        }
        Ok(Shape::new(dims))
    };
    // FSDP2 under a mixed-precision policy (FSDP with a `mixed-*` recipe): the batch stays in
    // the dtype the sharded parameters keep (float32), and the root's pre-forward casts each
    // floating-point input to `param_dtype` (`MixedPrecisionPolicy.cast_forward_inputs`, True by
    // default; `FSDPState._pre_forward` → `_cast_fp_tensor`,
    // `torch/distributed/fsdp/_fully_shard/_fsdp_state.py`): a copy the model reads, and its
    // first layer saves. Measured (gloo, 2 ranks, the MLP of `examples/mlp.toml`): the float32
    // batch (128,000 B) and a saved 64,000-B bfloat16 copy.
    let fsdp_cast = settings.amp.is_none()
        && settings.parallel.as_ref().is_some_and(|p| {
            matches!(p.sharding, crate::parallel::Sharding::Fsdp(f) if f.shard_group > 1)
                && !p.model_parallel_only()
        })
        && settings
            .recipe
            .master_weights
            .is_some_and(|m| m != settings.recipe.weights);
    // A float input follows the model's dtype (float32 under autocast), as `model.to(dtype)`
    // inputs do; an integer one (token ids) keeps its own.
    let input_dtype = |d: Option<DType>| match d {
        Some(d) if !d.is_float() => d,
        _ if fsdp_cast => settings.recipe.master_weights.unwrap_or(settings.dtype),
        _ => settings.amp.map_or(settings.dtype, |_| DType::Float32),
    };
    let shape = input_shape(&model.input_dims)?;
    let dtype = input_dtype(model.input_dtype);
    t.tape.input_shape = shape.clone();
    t.tape.layers.push(LayerInfo {
        path: INPUT.into(),
        name_start: 0,
        kind: None,
        repeat: 1,
        output_shape: shape.clone(),
        params: 0,
        parameter_bytes: 0,
        buffer_bytes: 0,
    });
    let storage = t.storage(&shape, dtype, StorageKind::Input, "input batch")?;
    let mut input = t.value(storage, shape, dtype, Layout::Contiguous, false, false);
    if fsdp_cast && dtype.is_float() {
        input = t.cast(input, settings.dtype)?;
    }
    let mut top: FastMap<&str, ValueId> = FastMap::with_capacity_and_hasher(
        t.referenced.len() + model.extra_inputs.len() + 1,
        Default::default(),
    );
    top.insert(INPUT, input);
    for (name, dims, d) in &model.extra_inputs {
        let shape = input_shape(dims)?;
        let dtype = input_dtype(*d);
        let storage = t.storage(&shape, dtype, StorageKind::Input, "input batch")?;
        let mut v = t.value(storage, shape, dtype, Layout::Contiguous, false, false);
        if fsdp_cast && dtype.is_float() {
            v = t.cast(v, settings.dtype)?;
        }
        top.insert(name.as_str(), v);
    }
    let mut scopes = vec![top];
    let out = t.layers(&model.layers, input, &mut scopes, "", 1)?;
    if let Some(lora) = &settings.lora {
        // PEFT refuses target modules that match nothing; so does memest, entry by entry.
        let unmatched: Vec<&str> = lora
            .targets
            .iter()
            .enumerate()
            .filter(|(i, _)| !t.lora_matched.get(*i).copied().unwrap_or(false))
            .map(|(_, e)| e.as_str())
            .collect();
        let refused = if lora.strict {
            !unmatched.is_empty()
        } else {
            unmatched.len() == lora.targets.len()
        };
        if refused {
            let names = if t.lora_modules.is_empty() {
                "this model has no linear layers".to_string()
            } else {
                format!(
                    "the names in this model are {} (a trailing _proj is optional: q_proj is q)",
                    t.lora_modules.join(", ")
                )
            };
            return Err(Error::setting(
                SettingKey::Lora,
                format!(
                    "--lora-targets {} matched no projection; {names}",
                    unmatched
                        .iter()
                        .map(|e| format!("`{e}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
    }
    if pass != Pass::Step {
        t.next_token_logits(out)?;
        return Ok(t.tape);
    }
    if !t.tape.has_loss {
        let v = &t.tape.values[out];
        t.tape.held.push(v.storage);
        if settings.training() {
            // `out.sum()`: its backward expands a scalar gradient, allocating nothing.
            let loss = t.fresh(Shape::default(), v.dtype, "loss", true)?;
            t.call(Call::new(AtenOp::Sum, vec![out], vec![loss]).view_grad())?;
            t.tape.held.push(t.tape.values[loss].storage);
        }
    }
    if settings.training() {
        prune_unreached(&mut t.tape);
    }
    Ok(t.tape)
}

/// Backward runs only the operators on a path to the loss (the last step's outputs): an
/// operator whose outputs reach it through no later operator (a side branch such as CLIP's
/// pooled `post_layernorm`, which `last_hidden_state.sum()` does not read) computes no
/// gradient, and a parameter that only such operators read gets no `.grad` and so no optimizer
/// state (it stays counted). What those operators saved is still kept, as autograd kept it.
fn prune_unreached(tape: &mut Tape) {
    let Some(last) = tape.steps.last() else {
        return;
    };
    // Values are dense ids: one flag each, rather than a hashed set.
    let mut reached = vec![false; tape.values.len()];
    for &o in &last.outputs {
        reached[usize::from(o)] = true;
    }
    let mut live = vec![false; tape.steps.len()];
    for (i, step) in tape.steps.iter().enumerate().rev() {
        if step.outputs.iter().any(|&o| reached[usize::from(o)]) {
            live[i] = true;
            for &v in &step.inputs {
                reached[usize::from(v)] = true;
            }
        }
    }
    let mut kept = Vec::new();
    for (step, live) in tape.steps.iter_mut().zip(live) {
        if !live {
            step.grads.clear();
            kept.extend(step.saves.iter().copied());
        }
    }
    // No backward frees them: the branch's graph lives as long as its output, which the model
    // output holds (CLIP's `pooler_output`, LLaVA's `image_outputs.last_hidden_state`).
    for s in kept {
        if !tape.held.contains(&s) {
            tape.held.push(s);
        }
    }
    for p in &mut tape.params {
        if p.trainable && !reached[usize::from(p.value)] {
            p.trainable = false;
        }
    }
}

/// [`Tracer::label`] before the first layer.
static NO_LAYER: LayerAt = LayerAt {
    positions: Vec::new(),
    label: String::new(),
};

struct Tracer<'a> {
    s: &'a Settings,
    /// The forward pass traced.
    pass: Pass,
    tape: Tape,
    /// Each graph layer's row in `tape.layers`, by the layer's address in the [`Model`] (every
    /// copy of a repeated block shares its layers' rows).
    layer_index: FastMap<usize, LayerId>,
    /// Autocast's cache of lower-precision weight copies, one per parameter per forward.
    cast_cache: HashMap<ValueId, ValueId>,
    /// Embedding weights by layer name, for `tie`.
    embeddings: HashMap<String, ValueId>,
    /// `cos` and `sin` tables from the last rotary layer.
    rope: Option<Rope>,
    /// `cos` and `sin` tables from the last `local` rotary layer (Gemma 3's sliding-window
    /// layers).
    rope_local: Option<Rope>,
    cur_layer: LayerId,
    segment: Option<SegmentId>,
    /// Inside a copy of an outermost repeated block (see [`Tape::blocks`]).
    in_block: bool,
    /// The copies of the layers traced now as the file asks for them: the product of the
    /// enclosing blocks' `written` counts (1 outside blocks), for the operator limit.
    written_copies: u64,
    /// Per enclosing block, innermost last: values a Python local keeps until the block returns
    /// (`add`'s `keep_inputs`), read by the block's closing [`AtenOp::Return`] step.
    block_kept: Vec<Vec<ValueId>>,
    /// The layer traced now, for errors (borrowed from the model: copying it was two
    /// allocations per layer).
    label: &'a LayerAt,
    /// Quantized weight values (their matmuls dequantize a transient copy).
    quantized: std::collections::HashSet<ValueId>,
    /// The relative position bias of the current stack (T5).
    position_bias: Option<ValueId>,
    /// DeBERTa-v2's relative embeddings, positions and mask (the last `relative_embeddings`).
    deberta: Option<deberta::DebertaRel>,
    /// DeBERTa-v2's all-ones `[B, S]` attention mask, made by the first `padding_mask`.
    padding_ones: Option<StorageId>,
    /// Per `--lora-targets` entry, whether it matched a projection so far.
    lora_matched: Vec<bool>,
    /// The projections and linear layers seen (last name segment; `q`, `k`, `v`, `o` for
    /// attention), in order: the names an unmatched LoRA target is told about.
    lora_modules: Vec<String>,
    /// Tensor, sequence and context parallelism (`--tp`, `--sp`, `--cp`): see [`tp`].
    tp: Option<tp::Tp>,
    /// Per block being traced (the model's layers, then each copy of each nested block), each
    /// traced layer's parameters by name, in the order the layer made them: what a later layer
    /// with `shares` reuses.
    layer_params: Vec<HashMap<String, Vec<ValueId>>>,
    /// Whether any layer of the model has `shares`: only then are [`Tracer::layer_params`]
    /// recorded (a name and a list per layer otherwise unused).
    shares_used: bool,
    /// While a layer with `shares` is traced, the parameters it takes (in order) instead of
    /// making its own ([`Tracer::param_typed`]).
    sharing: Option<std::collections::VecDeque<ValueId>>,
    /// The names some layer's `inputs` give (inside blocks too): only these layers' outputs
    /// are put in scope, so a model whose layers each read the previous one hashes no name.
    referenced: std::collections::HashSet<String, foldhash::fast::RandomState>,
}

/// The names `layers`' `inputs` give, inside blocks too.
fn referenced(
    layers: &[Layer],
    into: &mut std::collections::HashSet<String, foldhash::fast::RandomState>,
) {
    for l in layers {
        for r in &l.inputs {
            if let InputRef::Named(n) = r
                && !into.contains(n)
            {
                into.insert(n.clone());
            }
        }
        if let Node::Repeat { body, .. } = &l.node {
            referenced(body, into);
        }
    }
}

/// The number of layers of `layers` as written, inside blocks too (each block's body once).
fn layer_count(layers: &[Layer]) -> usize {
    layers.iter().fold(0usize, |n, l| match &l.node {
        Node::Repeat { body, .. } => n.saturating_add(1).saturating_add(layer_count(body)),
        Node::Op(_) => n.saturating_add(1),
    })
}

/// Whether a layer of `layers` (inside blocks too) has `shares`.
fn any_shares(layers: &[Layer]) -> bool {
    layers.iter().any(|l| {
        l.shares.is_some() || matches!(&l.node, Node::Repeat { body, .. } if any_shares(body))
    })
}

fn checked(v: Option<u64>, what: &str) -> Result<u64, Error> {
    v.ok_or_else(|| Error::Overflow(what.to_string()))
}

impl<'a> Tracer<'a> {
    fn blank(&self) -> Step {
        Step {
            layer: self.cur_layer,
            op: AtenOp::Return,
            inputs: IdList::new(),
            outputs: IdList::new(),
            allocs: IdList::new(),
            saves: IdList::new(),
            grads: IdList::new(),
            view_grad: false,
            segment: self.segment,
            scratch: Default::default(),
            reduced: RareList::new(),
        }
    }

    /// Tokens already in each causal cache ([`Pass::Decode`]), else 0.
    fn past(&self) -> u64 {
        match self.pass {
            Pass::Decode { past } => past,
            _ => 0,
        }
    }

    /// What `generate` does with a forward's logits `[B, S, V]`: a float32 copy of the last
    /// position, `[B, V]`, kept to pick the next token. In a decode step the previous step's
    /// logits (`[B, 1, V]`, in the logits' dtype) live until this forward returns and their
    /// float32 copy until the new one is made.
    fn next_token_logits(&mut self, out: ValueId) -> Result<(), Error> {
        let ov = self.val(out).clone();
        let &[b, _, vocab] = ov.shape.dims() else {
            return Err(Error::setting(
                SettingKey::Mode,
                format!(
                    "--mode generate needs a model that ends in [batch, seq, vocab] logits (a causal-LM head); this one ends in {} {}",
                    ov.dtype, ov.shape
                ),
            ));
        };
        let decode = matches!(self.pass, Pass::Decode { .. });
        if decode {
            let old = self.carried(ov.shape.clone(), ov.dtype, "previous logits")?;
            self.keep_until_here(old);
        }
        let last = self.fresh(
            Shape::from([b, vocab]),
            DType::Float32,
            "next-token logits",
            false,
        )?;
        self.call(Call::new(AtenOp::ToCopy, vec![out], vec![last]))?;
        self.tape.held.push(self.sid(last));
        if decode {
            let old = self.carried(
                Shape::from([b, vocab]),
                DType::Float32,
                "previous next-token logits",
            )?;
            self.keep_until_here(old);
        }
        Ok(())
    }

    /// A tensor that exists before this forward and is freed after its last use
    /// ([`StorageKind::Carried`]).
    fn carried(
        &mut self,
        shape: Shape,
        dtype: DType,
        what: &'static str,
    ) -> Result<ValueId, Error> {
        let s = self.storage(&shape, dtype, StorageKind::Carried, what)?;
        Ok(self.value(s, shape, dtype, Layout::Contiguous, false, false))
    }

    /// Keeps `v` alive up to this point (a step that reads it and computes nothing).
    fn keep_until_here(&mut self, v: ValueId) {
        let keep = Step {
            op: AtenOp::Return,
            inputs: [v].into(),
            ..self.blank()
        };
        self.tape.steps.push(keep);
    }

    fn err(&self, message: String) -> Error {
        Error::layer(self.label.clone(), LayerErrorKind::Input(message))
    }

    fn training(&self) -> bool {
        self.s.training()
    }

    /// The dtype activations are computed in outside autocast regions.
    fn act_dtype(&self) -> DType {
        self.s.dtype
    }

    /// The dtype of parameters: float32 under autocast, else the model dtype.
    fn param_dtype(&self) -> DType {
        if self.s.amp.is_some() {
            DType::Float32
        } else {
            self.s.dtype
        }
    }

    fn storage(
        &mut self,
        shape: &Shape,
        dtype: DType,
        kind: StorageKind,
        what: &'static str,
    ) -> Result<StorageId, Error> {
        // The messages are built only on overflow: this runs for every storage traced.
        let numel = shape
            .numel()
            .ok_or_else(|| Error::Overflow(format!("the element count of {shape}")))?;
        let bytes = dtype.bytes_for(numel).ok_or_else(|| {
            Error::Overflow(format!("the bytes of a {dtype} tensor of shape {shape}"))
        })?;
        Ok(self.tape.storages.push_and_get_key(Storage {
            bytes,
            kind,
            what,
            dtype,
            shape: shape.clone(),
            layer: self.cur_layer,
        }))
    }

    fn value(
        &mut self,
        storage: StorageId,
        shape: Shape,
        dtype: DType,
        layout: Layout,
        requires_grad: bool,
        param: bool,
    ) -> ValueId {
        self.tape.values.push_and_get_key(Value {
            storage,
            shape,
            dtype,
            layout,
            requires_grad,
            param,
        })
    }

    /// A new contiguous activation.
    fn fresh(
        &mut self,
        shape: Shape,
        dtype: DType,
        what: &'static str,
        requires_grad: bool,
    ) -> Result<ValueId, Error> {
        let s = self.storage(&shape, dtype, StorageKind::Activation, what)?;
        Ok(self.value(s, shape, dtype, Layout::Contiguous, requires_grad, false))
    }

    /// A view of `v` (same storage).
    fn view_of(&mut self, v: ValueId, shape: Shape, layout: Layout) -> ValueId {
        let src = self.tape.values[v].clone();
        self.value(
            src.storage,
            shape,
            src.dtype,
            layout,
            src.requires_grad,
            false,
        )
    }

    /// A view of `x` made by the operator `op`, recorded as a step. With `view_grad` its
    /// backward hands a view of the output's gradient back (reshape, transpose, permute);
    /// without, it allocates a zero gradient of the input's full shape (select, narrow).
    fn view_op(
        &mut self,
        x: ValueId,
        shape: Shape,
        layout: Layout,
        op: AtenOp,
        view_grad: bool,
    ) -> ValueId {
        // A view saves nothing (its row in the table says so), so recording it cannot fail.
        debug_assert_eq!(op.saves(), aten::SaveRule::NOTHING, "{op:?}");
        let y = self.view_of(x, shape, layout);
        self.push(Step {
            op,
            inputs: [x].into(),
            outputs: [y].into(),
            view_grad,
            ..self.blank()
        });
        y
    }

    fn val(&self, v: ValueId) -> &Value {
        &self.tape.values[v]
    }

    fn sid(&self, v: ValueId) -> StorageId {
        self.tape.values[v].storage
    }

    fn rg(&self, v: ValueId) -> bool {
        self.tape.values[v].requires_grad
    }

    /// Under autocast, a lower-precision op reads a 16-bit copy of a float32 input
    /// (`aten::_to_copy`); the copy is a new tensor that the op may save.
    fn autocast_input(&mut self, v: ValueId) -> Result<ValueId, Error> {
        let Some(amp) = self.s.amp else { return Ok(v) };
        let val = self.val(v).clone();
        if !val.dtype.is_float() || val.dtype == amp.dtype() {
            return Ok(v);
        }
        if let Some(&c) = self.cast_cache.get(&v).filter(|_| val.param) {
            return Ok(c);
        }
        let out = self.fresh(
            val.shape.clone(),
            amp.dtype(),
            if val.param {
                "weight copy"
            } else {
                "input copy"
            },
            val.requires_grad,
        )?;
        self.call(Call::new(AtenOp::ToCopy, vec![v], vec![out]))?;
        if val.param {
            self.cast_cache.insert(v, out);
        }
        Ok(out)
    }

    /// Casts to float32 for autocast's float32 ops and transformers' `.float()` upcasts.
    fn upcast_f32(&mut self, v: ValueId) -> Result<ValueId, Error> {
        let val = self.val(v).clone();
        if val.dtype == DType::Float32 || !val.dtype.is_float() {
            return Ok(v);
        }
        let out = self.fresh(
            val.shape.clone(),
            DType::Float32,
            "float32 copy",
            val.requires_grad,
        )?;
        self.call(Call::new(AtenOp::ToCopy, vec![v], vec![out]))?;
        Ok(out)
    }

    /// Whether autocast runs norms and softmax in float32 here (CUDA's autocast lists them;
    /// CPU autocast lets them run in the input's dtype).
    fn autocast_f32_norms(&self) -> bool {
        self.s.amp.is_some() && self.s.device == Device::Cuda
    }

    /// A copy made contiguous (by `reshape`, `matmul` or `.contiguous()`).
    fn contiguous(&mut self, v: ValueId) -> Result<ValueId, Error> {
        let val = self.val(v).clone();
        if val.layout == Layout::Contiguous {
            return Ok(v);
        }
        let out = self.fresh(
            val.shape.clone(),
            val.dtype,
            "contiguous copy",
            val.requires_grad,
        )?;
        self.call(Call::new(AtenOp::Clone, vec![v], vec![out]))?;
        Ok(out)
    }

    /// Traces `layers` from `input`. `scopes` maps the names visible to them to their outputs,
    /// borrowing the names from the model (nothing is copied per layer).
    fn layers(
        &mut self,
        layers: &'a [Layer],
        input: ValueId,
        scopes: &mut Vec<FastMap<&'a str, ValueId>>,
        prefix: &str,
        repeat: u64,
    ) -> Result<ValueId, Error> {
        let mut prev = input;
        let mut chunked_loss_done = false;
        self.layer_params.push(HashMap::new());
        for (i, layer) in layers.iter().enumerate() {
            self.label = &layer.label;
            if chunked_loss_done {
                // The loss layer ran with the chunked head.
                self.in_scope(scopes, &layer.name, prev);
                continue;
            }
            if self.s.loss == Loss::None
                && matches!(layer.node, Node::Op(Op::CrossEntropy(_) | Op::MseLoss(_)))
            {
                // `--loss none`: the step ends at the model's output.
                self.in_scope(scopes, &layer.name, prev);
                continue;
            }
            let mut inputs: Vec<ValueId> = layer
                .inputs
                .iter()
                .map(|r| match r {
                    InputRef::Previous => prev,
                    InputRef::Named(n) => scopes
                        .iter()
                        .rev()
                        .find_map(|s| s.get(n.as_str()))
                        .copied()
                        .expect("graph::build checked input names"),
                })
                .collect();
            if self.tape.has_loss {
                return Err(
                    self.err("a layer follows the loss: the loss must be the last layer".into())
                );
            }
            if self.pass == Pass::Prefill
                && prefix.is_empty()
                && matches!(layer.node, Node::Op(Op::Linear(_)))
                && layers
                    .get(i + 1)
                    .is_none_or(|next| matches!(next.node, Node::Op(Op::CrossEntropy(_))))
            {
                inputs[0] = self.last_position(inputs[0]);
            }
            let chunked = match (&layer.node, layers.get(i + 1).map(|n| &n.node), self.s.loss) {
                (
                    Node::Op(Op::Linear(head)),
                    Some(Node::Op(Op::CrossEntropy(ce))),
                    Loss::Chunked { chunks },
                ) if prefix.is_empty() && self.training() => Some((head, ce, chunks)),
                _ => None,
            };
            let out = match &layer.node {
                Node::Op(_) if let Some((head, ce, chunks)) = chunked => {
                    self.enter_layer(layer, prefix, repeat);
                    let first_param = self.tape.params.len();
                    let first_storage = self.tape.storages.next_key();
                    let loss_layer = &layers[i + 1];
                    let out = self.chunked_head_loss(
                        head,
                        ce,
                        loss_layer,
                        inputs[0],
                        layer.trainable,
                        chunks,
                        repeat,
                    )?;
                    let head_layer = self.layer_index[&std::ptr::from_ref(layer).addr()];
                    let loss_layer_id = self.cur_layer;
                    self.cur_layer = head_layer;
                    self.note_params(first_param, first_storage);
                    self.tape.layers[head_layer].output_shape = self.val(inputs[0]).shape.clone();
                    self.cur_layer = loss_layer_id;
                    chunked_loss_done = true;
                    out
                }
                Node::Op(op) => {
                    self.enter_layer(layer, prefix, repeat);
                    let out = self.op(op, layer, &inputs)?;
                    self.tape.layers[self.cur_layer].output_shape = self.val(out).shape.clone();
                    out
                }
                Node::Repeat {
                    count,
                    written,
                    count_key,
                    body,
                } => {
                    self.enter_layer(layer, prefix, repeat);
                    let path = self.tape.layers[self.cur_layer].path.clone();
                    let copies =
                        checked(repeat.checked_mul(*count), "the number of repeated copies")?;
                    let mut x = inputs[0];
                    let first_step = self.tape.steps.len();
                    // A block traced once records where its copies are (`sim` extends a few
                    // copies to many from them).
                    let mut starts = Vec::new();
                    for copy in 0..*count {
                        if copy == 1 {
                            // Every copy traces the same operators: refuse before tracing the
                            // others when they would pass the cap. The copies counted are those
                            // the file asks for, this block's and the enclosing blocks' counts
                            // multiplied (the unrolled model holds at least that many), so a
                            // nested block is refused in the first copy of its enclosing
                            // blocks, and `symbolic`'s few-copy traces are refused as well.
                            let per_copy = self.tape.steps.len() - first_step;
                            let total = u64::try_from(per_copy)
                                .ok()
                                .and_then(|p| p.checked_mul(*written))
                                .and_then(|p| p.checked_mul(self.written_copies))
                                .and_then(|t| t.checked_add(first_step as u64));
                            if total.is_none_or(|t| t > MAX_STEPS as u64) {
                                self.label = &layer.label;
                                return Err(Error::layer(
                                    self.label.clone(),
                                    LayerErrorKind::TooManyOperators {
                                        key: count_key,
                                        count: *written,
                                        enclosing: self.written_copies,
                                        per_copy: per_copy as u64,
                                        limit: MAX_STEPS,
                                    },
                                ));
                            }
                        }
                        if self.tape.steps.len() > MAX_STEPS {
                            self.label = &layer.label;
                            return Err(self.err(format!("the model traces to more than {MAX_STEPS} operators after repeating blocks; lower `count`")));
                        }
                        x = self.tp_block_input(x)?;
                        let before = self.val(x).clone();
                        let seg_start = self.tape.steps.len();
                        if repeat == 1 {
                            starts.push(seg_start);
                        }
                        let checkpoint =
                            self.s.checkpoint && self.training() && self.segment.is_none();
                        if checkpoint {
                            self.segment = Some(self.tape.segments.push_and_get_key(Segment {
                                start: seg_start,
                                end: seg_start,
                                input: before.storage,
                            }));
                        }
                        let mut scope =
                            FastMap::with_capacity_and_hasher(body.len() + 1, Default::default());
                        scope.insert(INPUT, x);
                        scopes.push(scope);
                        let outermost = !self.in_block;
                        self.in_block = true;
                        self.block_kept.push(Vec::new());
                        let enclosing = self.written_copies;
                        self.written_copies = enclosing.saturating_mul(*written);
                        let y = self.layers(body, x, scopes, &path, copies);
                        self.written_copies = enclosing;
                        self.in_block = !outermost;
                        let kept = self.block_kept.pop().unwrap_or_default();
                        scopes.pop();
                        let y = y?;
                        // The block's Python frame holds its input (`identity = x`) until it
                        // returns, and the locals `keep_inputs` names: keep them alive to the
                        // end of the block.
                        let mut inputs = IdList::from([x]);
                        inputs.extend(kept);
                        let keep = Step {
                            op: AtenOp::Return,
                            inputs,
                            ..self.blank()
                        };
                        self.tape.steps.push(keep);
                        if checkpoint {
                            let seg = self.segment.take().expect("set above");
                            self.tape.segments[seg].end = self.tape.steps.len();
                        }
                        if outermost {
                            self.tape.blocks.push(seg_start..self.tape.steps.len());
                        }
                        let after = self.val(y);
                        // Autocast may change the dtype once, in the first copy; from then on each
                        // copy must return what it was given.
                        if *count > 1
                            && (after.shape != before.shape
                                || (copy > 0 && after.dtype != before.dtype))
                        {
                            let (s2, d2) = (after.shape.clone(), after.dtype);
                            self.label = &layer.label;
                            return Err(self.err(format!(
                                "a repeated block must keep its input's shape and dtype: input {} {}, output {s2} {d2}",
                                before.shape, before.dtype
                            )));
                        }
                        x = y;
                    }
                    if repeat == 1 {
                        self.tape.repeats.push(BlockCopies {
                            positions: layer.label.positions.clone(),
                            starts,
                            end: self.tape.steps.len(),
                        });
                    }
                    self.label = &layer.label;
                    let idx = self.layer_index[&std::ptr::from_ref(layer).addr()];
                    self.tape.layers[idx].output_shape = self.val(x).shape.clone();
                    x
                }
            };
            self.in_scope(scopes, &layer.name, out);
            prev = out;
        }
        self.layer_params.pop();
        if prefix.is_empty()
            && !chunked_loss_done
            && self.training()
            && matches!(self.s.loss, Loss::Chunked { .. })
        {
            return Err(self.chunked_loss_blocked(layers));
        }
        Ok(prev)
    }

    /// Puts the layer `name`'s output `out` in the innermost scope, when a layer's `inputs`
    /// name it (no other name is ever looked up).
    fn in_scope<'m>(&self, scopes: &mut [FastMap<&'m str, ValueId>], name: &'m str, out: ValueId) {
        if self.referenced.contains(name)
            && let Some(scope) = scopes.last_mut()
        {
            scope.insert(name, out);
        }
    }

    /// Why `--loss chunked-ce` found no LM head `linear` directly followed by a `cross_entropy`
    /// among the top-level `layers`: the layer between them (a logit scale or soft-cap), the
    /// model's other loss, or no loss; located at that layer (the last layer when none).
    fn chunked_loss_blocked(&mut self, layers: &'a [Layer]) -> Error {
        const WHAT: &str = "--loss chunked-ce runs the LM head (a `linear`) chunk by chunk straight into `cross_entropy` (torchtune's CEWithChunkedOutputLoss)";
        let ce = layers
            .iter()
            .position(|l| matches!(l.node, Node::Op(Op::CrossEntropy(_))));
        let other = layers
            .iter()
            .find(|l| matches!(l.node, Node::Op(Op::MseLoss(_))));
        let (at, message) = match (ce, other) {
            (Some(i), _) if i > 0 => {
                let before = &layers[i - 1];
                (
                    &before.label,
                    format!(
                        "{WHAT}, and this layer sits between the head and the loss (it changes the logits, which the chunked loss does not do); use --loss ce"
                    ),
                )
            }
            (Some(i), _) => (
                &layers[i].label,
                format!("{WHAT}; no `linear` head comes before this loss; use --loss ce"),
            ),
            (None, Some(mse)) => (
                &mse.label,
                format!(
                    "{WHAT}; this model's loss is `mse_loss`, not a cross-entropy; use --loss ce"
                ),
            ),
            (None, None) => match layers.last() {
                Some(last) => (
                    &last.label,
                    format!("{WHAT}; the model has no `cross_entropy` layer; use --loss ce"),
                ),
                None => return self.err(format!("{WHAT}; the model has no layers")),
            },
        };
        self.label = at;
        self.err(message)
    }

    /// `hidden_states[:, -1:, :]`, the LM head's input under `logits_to_keep = 1`
    /// (`LlamaForCausalLM.forward`: `slice_indices = slice(-logits_to_keep, None)`): a view of
    /// one position per sequence, which `linear` reads without a copy. Other ranks pass through.
    fn last_position(&mut self, x: ValueId) -> ValueId {
        let xv = self.val(x).clone();
        match *xv.shape.dims() {
            [b, s, h] if s > 1 => self.view_op(
                x,
                Shape::from([b, 1, h]),
                Layout::Contiguous,
                AtenOp::Narrow,
                false,
            ),
            _ => x,
        }
    }

    /// Makes `layer`, inside the block at dotted path `prefix` (empty at the top level), the
    /// current layer; its row (and its path) is made the first time it is traced.
    fn enter_layer(&mut self, layer: &Layer, prefix: &str, repeat: u64) {
        let key = std::ptr::from_ref(layer).addr();
        // One hash per layer: its row is found or made through the entry.
        self.cur_layer = match self.layer_index.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => *e.get(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let path = if prefix.is_empty() {
                    layer.name.clone()
                } else {
                    let mut path = String::with_capacity(prefix.len() + 1 + layer.name.len());
                    path.push_str(prefix);
                    path.push('.');
                    path.push_str(&layer.name);
                    path
                };
                let i = self.tape.layers.push_and_get_key(LayerInfo {
                    name_start: path.len().saturating_sub(layer.name.len()),
                    path,
                    kind: Some(layer.kind),
                    repeat,
                    output_shape: Shape::default(),
                    params: 0,
                    parameter_bytes: 0,
                    buffer_bytes: 0,
                });
                *e.insert(i)
            }
        };
    }

    /// Records this layer's parameter and buffer figures for one copy (every copy traces the
    /// same figures).
    fn note_params(&mut self, first_param: usize, first_storage: StorageId) {
        let params = &self.tape.params[first_param..];
        let numel: u64 = params.iter().map(|p| p.numel).sum();
        let bytes: u64 = params.iter().map(|p| p.bytes).sum();
        let buffers: u64 = self.tape.storages[first_storage..]
            .iter()
            .filter(|s| s.kind == StorageKind::Buffer)
            .map(|s| s.bytes)
            .sum();
        let info = &mut self.tape.layers[self.cur_layer];
        info.params = numel;
        info.parameter_bytes = bytes;
        info.buffer_bytes = buffers;
    }

    fn op(&mut self, op: &Op, layer: &Layer, inputs: &[ValueId]) -> Result<ValueId, Error> {
        let first_param = self.tape.params.len();
        let first_storage = self.tape.storages.next_key();
        if let Some(owner) = &layer.shares {
            let theirs = self
                .layer_params
                .iter()
                .rev()
                .find_map(|s| s.get(owner))
                .ok_or_else(|| {
                    self.err(format!(
                        "`shares` names `{owner}`, which has not been traced before this layer"
                    ))
                })?;
            self.sharing = Some(theirs.iter().copied().collect());
        }
        let out = self.tp_op(op, layer, inputs);
        let left = self.sharing.take();
        let out = out?;
        if left.is_some_and(|l| !l.is_empty()) {
            return Err(Error::Internal(
                "a shared layer made fewer parameters than its owner",
            ));
        }
        self.note_params(first_param, first_storage);
        if !self.shares_used {
            return Ok(out);
        }
        let params: Vec<ValueId> = match &layer.shares {
            Some(owner) => self
                .layer_params
                .iter()
                .rev()
                .find_map(|s| s.get(owner))
                .cloned()
                .unwrap_or_default(),
            None => self.tape.params[first_param..]
                .iter()
                .map(|p| p.value)
                .collect(),
        };
        if let Some(scope) = self.layer_params.last_mut() {
            scope.insert(layer.name.clone(), params);
        }
        Ok(out)
    }
}

/// NumPy-style broadcast of two shapes.
fn broadcast(a: &Shape, b: &Shape) -> Option<Shape> {
    let (a, b) = (a.dims(), b.dims());
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let db = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return None;
        };
    }
    Some(Shape::new(out))
}

/// The rotary tables of the model's `rotary` layer, as its attention layers use them.
#[derive(Clone, Copy, Debug)]
struct Rope {
    cos: StorageId,
    sin: StorageId,
    /// Joined with `torch.cat` (see `Op::Rotary`).
    concat: bool,
    /// Each rotated tensor joined right after its rotation (Phi-3), not after both.
    concat_each: bool,
    /// Pairs interleaved in each head, rotated by diffusers' `apply_rotary_emb` (Flux).
    interleaved: bool,
    /// `[batch, S, head_dim]` tables (Qwen2-VL's M-RoPE and its vision tower).
    per_sample: bool,
    /// Float32 tables whatever the activation dtype (OLMo-2): rotated in float32, cast back.
    tables_f32: bool,
    /// Q and K rotated in float32 against tables in the activation dtype (Cohere).
    upcast: bool,
    /// `head_dim/2`-wide tables, each half of a head rotated against them (GPT-OSS).
    half: bool,
}

/// Type promotion of the operands of a binary elementwise operator (`torch.result_type` for
/// two tensors of the same dimensionality): a float beats an integer, the wider float wins, and
/// `bfloat16` with `float16` gives `float32` (c10's `promoteTypes` table: neither holds the
/// other's range and precision).
fn promote(a: DType, b: DType) -> DType {
    if a == b {
        a
    } else if a.is_float() && b.is_float() {
        if a.bits() == 16 && b.bits() == 16 {
            DType::Float32
        } else if a.bits() >= b.bits() {
            a
        } else {
            b
        }
    } else if a.is_float() {
        a
    } else {
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_rules() {
        assert_eq!(
            broadcast(&Shape::from([4, 197, 768]), &Shape::from([1, 197, 768])),
            Some(Shape::from([4, 197, 768]))
        );
        assert_eq!(
            broadcast(&Shape::from([4, 3]), &Shape::from([3])),
            Some(Shape::from([4, 3]))
        );
        assert_eq!(broadcast(&Shape::from([4, 3]), &Shape::from([2])), None);
    }

    #[test]
    fn promotion_follows_pytorch() {
        use DType::{Bfloat16, Float16, Float32, Float64, Int64};
        // torch.result_type(torch.ones(1, dtype=a), torch.ones(1, dtype=b))
        assert_eq!(promote(Bfloat16, Float16), Float32);
        assert_eq!(promote(Float16, Bfloat16), Float32);
        assert_eq!(promote(Bfloat16, Bfloat16), Bfloat16);
        assert_eq!(promote(Bfloat16, Float32), Float32);
        assert_eq!(promote(Float64, Float16), Float64);
        assert_eq!(promote(Int64, Float16), Float16);
        assert_eq!(promote(Bfloat16, Int64), Bfloat16);
    }
}
