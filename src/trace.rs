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

use std::collections::HashMap;

use serde::Serialize;

use crate::dtype::DType;
use crate::error::{Error, LayerError};
use crate::graph::{Activation, AttnStyle, Combine, INPUT, InputRef, Layer, Model, Node, Op};
use crate::settings::{AttentionImpl, Device, Quant, Settings};
use crate::shape::Shape;
use crate::spec::{DimSpec, Pair};

/// Index of a storage in [`Tape::storages`].
pub type StorageId = usize;
/// Index of a value in [`Tape::values`].
pub type ValueId = usize;

/// Upper bound on traced operators (after repeating blocks), so that an absurd `count` is an
/// error rather than a hang.
pub const MAX_STEPS: usize = 2_000_000;

/// What a storage holds, for the breakdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StorageKind {
    /// A parameter.
    Parameter,
    /// A buffer (BatchNorm running statistics, position-id and rotary tables).
    Buffer,
    /// The input batch and its labels.
    Input,
    /// Anything the forward pass computes.
    Activation,
    /// Keys and values cached by causal attention in inference (transformers' `use_cache`).
    KvCache,
}

/// One allocation.
#[derive(Clone, Debug)]
pub struct Storage {
    /// Size in bytes: numel × element size.
    pub bytes: u64,
    /// Category.
    pub kind: StorageKind,
    /// What it is, e.g. `output`, `dropout noise`, `mean`.
    pub what: &'static str,
    /// Element type.
    pub dtype: DType,
    /// Shape at allocation.
    pub shape: Shape,
    /// Layer that allocated it (index into [`Tape::layers`]).
    pub layer: usize,
}

/// Memory layout of a value, which decides whether `reshape`/`matmul` must copy it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Row-major contiguous.
    Contiguous,
    /// Contiguous after swapping the last two dimensions (`k.transpose(-1, -2)`).
    LastTwoSwapped,
    /// `[B, heads, S, head_dim]` laid out as `[B, S, heads, head_dim]` (heads split out of a
    /// `[B, S, H]` projection by `view` + `transpose(1, 2)`): dense, but not contiguous.
    HeadsTransposed,
    /// `[B, heads, S, head_dim]` laid out as `[S, B, heads, head_dim]` (nn.MultiheadAttention's
    /// sequence-first packing): dense, but not contiguous.
    SeqFirst,
    /// `[B, heads, S, head_dim]` heads split out of a fused QKV projection `[B, S, 3H]`: the
    /// dimension order of [`Layout::HeadsTransposed`], with gaps between rows.
    HeadsStrided,
    /// Any other strided view.
    Strided,
}

/// A tensor as an operator sees it: a view of a storage.
#[derive(Clone, Debug)]
pub struct Value {
    /// Backing storage.
    pub storage: StorageId,
    /// Shape of the view.
    pub shape: Shape,
    /// Element type.
    pub dtype: DType,
    /// Layout.
    pub layout: Layout,
    /// Whether autograd tracks it.
    pub requires_grad: bool,
    /// Set when the value is a parameter (its gradient goes to `.grad`).
    pub param: bool,
}

/// One operator in forward order.
#[derive(Clone, Debug)]
pub struct Step {
    /// Layer it belongs to (index into [`Tape::layers`]).
    pub layer: usize,
    /// ATen-level name, e.g. `addmm`, `native_layer_norm`.
    pub op: &'static str,
    /// Values read.
    pub inputs: Vec<ValueId>,
    /// Values produced.
    pub outputs: Vec<ValueId>,
    /// Storages allocated by this operator.
    pub allocs: Vec<StorageId>,
    /// Storages autograd saves for its backward.
    pub saves: Vec<StorageId>,
    /// Inputs that receive a gradient in backward.
    pub grads: Vec<ValueId>,
    /// The backward hands a view of the output's gradient to the input (views, reshapes).
    pub view_grad: bool,
    /// Checkpointed segment the step belongs to.
    pub segment: Option<usize>,
}

/// Per-layer facts for reports.
#[derive(Clone, Debug, Serialize)]
pub struct LayerInfo {
    /// Dotted path, e.g. `blocks.attn`.
    pub path: String,
    /// Layer name.
    pub name: String,
    /// Kind.
    pub kind: String,
    /// Copies (product of enclosing repeat counts).
    pub repeat: u64,
    /// Output shape (of one copy).
    pub output_shape: Shape,
    /// Parameters of one copy.
    pub params: u64,
    /// Parameter bytes of one copy.
    pub parameter_bytes: u64,
    /// Buffer bytes of one copy.
    pub buffer_bytes: u64,
}

/// A parameter tensor.
#[derive(Clone, Debug)]
pub struct Param {
    /// Shape.
    pub shape: Shape,
    /// Elements.
    pub numel: u64,
    /// Bytes.
    pub bytes: u64,
    /// Trains (has a gradient and optimizer state).
    pub trainable: bool,
    /// Its value.
    pub value: ValueId,
    /// Storage dtype name: a dtype, or a quantization format (`nf4`, `int8`, `int4`, `fp8`).
    pub dtype_name: &'static str,
}

/// A checkpointed range of steps (one copy of a repeated block under `--checkpoint`).
#[derive(Clone, Debug)]
pub struct Segment {
    /// First step index.
    pub start: usize,
    /// One past the last step index.
    pub end: usize,
    /// The block input the checkpoint saves.
    pub input: StorageId,
}

/// The traced forward pass.
#[derive(Clone, Debug, Default)]
pub struct Tape {
    /// Every storage.
    pub storages: Vec<Storage>,
    /// Every value.
    pub values: Vec<Value>,
    /// Parameter tensors (tied weights once).
    pub params: Vec<Param>,
    /// Operators in forward order.
    pub steps: Vec<Step>,
    /// Layers, in the order first traced.
    pub layers: Vec<LayerInfo>,
    /// Storages the caller keeps until the step ends: the model output and the loss.
    pub held: Vec<StorageId>,
    /// Checkpointed segments.
    pub segments: Vec<Segment>,
    /// Shape of the input batch.
    pub input_shape: Shape,
    /// Whether the model ends in a loss layer.
    pub has_loss: bool,
}

/// Traces `model` under `settings`.
///
/// # Errors
/// [`Error::Layer`] for a shape mismatch or a layer that cannot apply to its input (naming the
/// layer, the shapes and what was expected), [`Error::Setting`] for a `"seq"` input without a
/// sequence length, [`Error::Overflow`] when a size does not fit in 64 bits.
pub fn trace(model: &Model, settings: &Settings) -> Result<Tape, Error> {
    let mut t = Tracer {
        s: settings,
        tape: Tape::default(),
        layer_index: HashMap::new(),
        cast_cache: HashMap::new(),
        embeddings: HashMap::new(),
        rope: None,
        cur_layer: 0,
        segment: None,
        label: String::new(),
        quantized: std::collections::HashSet::new(),
        position_bias: None,
    };
    let mut dims = vec![settings.batch];
    for d in &model.input_dims {
        dims.push(match d {
            DimSpec::Fixed(v) => *v,
            DimSpec::Seq => settings.seq.ok_or_else(|| {
                Error::Setting("the input has a \"seq\" dimension: give a sequence length with --seq or defaults.seq".into())
            })?,
        });
    }
    let shape = Shape::new(dims);
    let dtype = match model.input_dtype {
        Some(d) if !d.is_float() => d,
        _ => settings.amp.map_or(settings.dtype, |_| DType::Float32),
    };
    t.tape.input_shape = shape.clone();
    t.layer_index.insert(String::from("<input>"), 0);
    t.tape.layers.push(LayerInfo {
        path: INPUT.into(),
        name: INPUT.into(),
        kind: "input".into(),
        repeat: 1,
        output_shape: shape.clone(),
        params: 0,
        parameter_bytes: 0,
        buffer_bytes: 0,
    });
    let storage = t.storage(&shape, dtype, StorageKind::Input, "input batch")?;
    let input = t.value(storage, shape, dtype, Layout::Contiguous, false, false);
    let mut scopes = vec![HashMap::from([(INPUT.to_string(), input)])];
    let out = t.layers(&model.layers, input, &mut scopes, "", 1)?;
    if !t.tape.has_loss {
        let v = &t.tape.values[out];
        t.tape.held.push(v.storage);
        if settings.training() {
            // `out.sum()`: its backward expands a scalar gradient, allocating nothing.
            let loss = t.fresh(Shape::default(), v.dtype, "loss", true)?;
            t.push(Step {
                op: "sum",
                inputs: vec![out],
                outputs: vec![loss],
                view_grad: true,
                ..t.blank()
            });
            t.tape.held.push(t.tape.values[loss].storage);
        }
    }
    Ok(t.tape)
}

struct Tracer<'a> {
    s: &'a Settings,
    tape: Tape,
    layer_index: HashMap<String, usize>,
    /// Autocast's cache of lower-precision weight copies, one per parameter per forward.
    cast_cache: HashMap<ValueId, ValueId>,
    /// Embedding weights by layer name, for `tie`.
    embeddings: HashMap<String, ValueId>,
    /// `cos` and `sin` tables from the last rotary layer.
    rope: Option<(StorageId, StorageId, bool)>,
    cur_layer: usize,
    segment: Option<usize>,
    label: String,
    /// Quantized weight values (their matmuls dequantize a transient copy).
    quantized: std::collections::HashSet<ValueId>,
    /// The relative position bias of the current stack (T5).
    position_bias: Option<ValueId>,
}

fn checked(v: Option<u64>, what: &str) -> Result<u64, Error> {
    v.ok_or_else(|| Error::Overflow(what.to_string()))
}

impl Tracer<'_> {
    fn blank(&self) -> Step {
        Step {
            layer: self.cur_layer,
            op: "",
            inputs: Vec::new(),
            outputs: Vec::new(),
            allocs: Vec::new(),
            saves: Vec::new(),
            grads: Vec::new(),
            view_grad: false,
            segment: self.segment,
        }
    }

    fn err(&self, message: String) -> Error {
        Error::Layer(LayerError {
            layer: self.label.clone(),
            message,
        })
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
        let numel = checked(shape.numel(), &format!("the element count of {shape}"))?;
        let bytes = checked(
            dtype.bytes_for(numel),
            &format!("the bytes of a {dtype} tensor of shape {shape}"),
        )?;
        self.tape.storages.push(Storage {
            bytes,
            kind,
            what,
            dtype,
            shape: shape.clone(),
            layer: self.cur_layer,
        });
        Ok(self.tape.storages.len() - 1)
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
        self.tape.values.push(Value {
            storage,
            shape,
            dtype,
            layout,
            requires_grad,
            param,
        });
        self.tape.values.len() - 1
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

    fn val(&self, v: ValueId) -> &Value {
        &self.tape.values[v]
    }

    fn sid(&self, v: ValueId) -> StorageId {
        self.tape.values[v].storage
    }

    fn rg(&self, v: ValueId) -> bool {
        self.tape.values[v].requires_grad
    }

    /// Records a step. Outside training, or when nothing it reads requires a gradient, autograd
    /// records no node: nothing is saved and no gradient flows.
    fn push(&mut self, mut step: Step) {
        let records = self.training() && step.inputs.iter().any(|&v| self.rg(v));
        if records {
            step.grads = step
                .inputs
                .iter()
                .copied()
                .filter(|&v| self.rg(v) && self.val(v).dtype.is_float())
                .collect();
            step.grads.dedup();
        } else {
            step.saves.clear();
            step.grads.clear();
        }
        for &o in &step.outputs {
            let s = self.tape.values[o].storage;
            let fresh = !step
                .inputs
                .iter()
                .any(|&i| self.tape.values[i].storage == s);
            if fresh && !step.allocs.contains(&s) {
                step.allocs.push(s);
            }
        }
        step.saves.sort_unstable();
        step.saves.dedup();
        self.tape.steps.push(step);
    }

    /// A new parameter tensor of this layer.
    /// A new parameter tensor of this layer. With LoRA the base model is frozen.
    fn param(&mut self, shape: Shape, trainable: bool) -> Result<ValueId, Error> {
        let trainable = trainable && self.s.lora.is_none();
        self.param_as(shape, trainable, None)
    }

    /// A LoRA adapter matrix: trains even though the base is frozen. PEFT keeps adapters in
    /// float32 when the base is 16-bit (`autocast_adapter_dtype=True`).
    fn adapter_param(&mut self, shape: Shape) -> Result<ValueId, Error> {
        let dtype = match self.param_dtype() {
            DType::Float16 | DType::Bfloat16 => DType::Float32,
            d => d,
        };
        self.param_typed(shape, true, None, dtype)
    }

    /// A linear projection's weight `[out, in]`: quantized under `--dtype nf4|int8|int4|fp8`
    /// when `quantizable` (quantized weights are frozen, as bitsandbytes' `Params4bit` are).
    fn weight(
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

    fn param_as(
        &mut self,
        shape: Shape,
        trainable: bool,
        quant: Option<Quant>,
    ) -> Result<ValueId, Error> {
        let dtype = self.param_dtype();
        self.param_typed(shape, trainable, quant, dtype)
    }

    fn param_typed(
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
                checked(quantized_bytes(q, &shape), "quantized weight bytes")?,
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
    /// layer by name: a target matches the name's last segment, or that segment minus `_proj`.
    fn lora_targeted(&self, target: &str) -> bool {
        let Some(lora) = &self.s.lora else {
            return false;
        };
        let last = target.rsplit('.').next().unwrap_or(target);
        lora.targets.iter().any(|t| {
            t == target
                || t == last
                || last.strip_suffix("_proj") == Some(t.as_str())
                || (target == "qkv"
                    && matches!(
                        t.as_str(),
                        "q" | "k" | "v" | "c_attn" | "in_proj" | "qkv_proj"
                    ))
        })
    }

    /// PEFT's LoRA on a targeted projection: `y + B(A(x)) · scaling` with trainable
    /// `A: [rank, in]`, `B: [out, rank]` (lora_dropout 0). The input is cast to the adapters'
    /// dtype first (a copy when the model is 16-bit), which `A` keeps; `B` keeps `A`'s
    /// `[.., rank]` output; the sum is cast back to `y`'s dtype.
    fn lora(
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
        let scaled = self.unary(xb, "mul", Keep::Nothing, false)?;
        let sum = self.add(&[y, scaled], false)?;
        let ydt = self.val(y).dtype;
        self.cast(sum, ydt)
    }

    /// `x.to(dtype)`: a copy when the dtype differs.
    fn cast(&mut self, x: ValueId, dtype: DType) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        if xv.dtype == dtype {
            return Ok(x);
        }
        let y = self.fresh(xv.shape.clone(), dtype, "cast", xv.requires_grad)?;
        self.push(Step {
            op: "_to_copy",
            inputs: vec![x],
            outputs: vec![y],
            ..self.blank()
        });
        Ok(y)
    }

    fn buffer(
        &mut self,
        shape: Shape,
        dtype: DType,
        what: &'static str,
    ) -> Result<StorageId, Error> {
        self.storage(&shape, dtype, StorageKind::Buffer, what)
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
        self.push(Step {
            op: "_to_copy",
            inputs: vec![v],
            outputs: vec![out],
            ..self.blank()
        });
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
        self.push(Step {
            op: "_to_copy",
            inputs: vec![v],
            outputs: vec![out],
            ..self.blank()
        });
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
        self.push(Step {
            op: "clone",
            inputs: vec![v],
            outputs: vec![out],
            ..self.blank()
        });
        Ok(out)
    }

    fn layers(
        &mut self,
        layers: &[Layer],
        input: ValueId,
        scopes: &mut Vec<HashMap<String, ValueId>>,
        prefix: &str,
        repeat: u64,
    ) -> Result<ValueId, Error> {
        let mut prev = input;
        for (i, layer) in layers.iter().enumerate() {
            self.label.clone_from(&layer.label);
            let inputs: Vec<ValueId> = layer
                .inputs
                .iter()
                .map(|r| match r {
                    InputRef::Previous => prev,
                    InputRef::Named(n) => scopes
                        .iter()
                        .rev()
                        .find_map(|s| s.get(n))
                        .copied()
                        .expect("graph::build checked input names"),
                })
                .collect();
            if self.tape.has_loss {
                return Err(
                    self.err("a layer follows the loss: the loss must be the last layer".into())
                );
            }
            let path = if prefix.is_empty() {
                layer.name.clone()
            } else {
                format!("{prefix}.{}", layer.name)
            };
            let out = match &layer.node {
                Node::Op(op) => {
                    self.enter_layer(layer, &path, repeat);
                    let out = self.op(op, layer, &inputs)?;
                    self.tape.layers[self.cur_layer].output_shape = self.val(out).shape.clone();
                    out
                }
                Node::Repeat { count, body } => {
                    self.enter_layer(layer, &path, repeat);
                    let copies =
                        checked(repeat.checked_mul(*count), "the number of repeated copies")?;
                    let mut x = inputs[0];
                    for _ in 0..*count {
                        if self.tape.steps.len() > MAX_STEPS {
                            self.label.clone_from(&layer.label);
                            return Err(self.err(format!("the model traces to more than {MAX_STEPS} operators after repeating blocks; lower `count`")));
                        }
                        let before = self.val(x).clone();
                        let seg_start = self.tape.steps.len();
                        let checkpoint =
                            self.s.checkpoint && self.training() && self.segment.is_none();
                        if checkpoint {
                            self.segment = Some(self.tape.segments.len());
                            self.tape.segments.push(Segment {
                                start: seg_start,
                                end: seg_start,
                                input: before.storage,
                            });
                        }
                        scopes.push(HashMap::from([(INPUT.to_string(), x)]));
                        let y = self.layers(body, x, scopes, &path, copies);
                        scopes.pop();
                        let y = y?;
                        // The block's Python frame holds its input (`identity = x`) until it
                        // returns: keep it alive to the end of the block.
                        let keep = Step {
                            op: "return",
                            inputs: vec![x],
                            ..self.blank()
                        };
                        self.tape.steps.push(keep);
                        if checkpoint {
                            let seg = self.segment.take().expect("set above");
                            self.tape.segments[seg].end = self.tape.steps.len();
                        }
                        let after = self.val(y);
                        if *count > 1
                            && (after.shape != before.shape || after.dtype != before.dtype)
                        {
                            let (s2, d2) = (after.shape.clone(), after.dtype);
                            self.label.clone_from(&layer.label);
                            return Err(self.err(format!(
                                "a repeated block must keep its input's shape and dtype: input {} {}, output {s2} {d2}",
                                before.shape, before.dtype
                            )));
                        }
                        x = y;
                    }
                    self.label.clone_from(&layer.label);
                    let idx = self.layer_index[&layer.label];
                    self.tape.layers[idx].output_shape = self.val(x).shape.clone();
                    x
                }
            };
            let _ = i;
            scopes
                .last_mut()
                .expect("scope")
                .insert(layer.name.clone(), out);
            prev = out;
        }
        Ok(prev)
    }

    fn enter_layer(&mut self, layer: &Layer, path: &str, repeat: u64) {
        let key = layer.label.clone();
        self.cur_layer = match self.layer_index.get(&key) {
            Some(&i) => i,
            None => {
                self.tape.layers.push(LayerInfo {
                    path: path.to_string(),
                    name: layer.name.clone(),
                    kind: layer.kind.as_str().to_string(),
                    repeat,
                    output_shape: Shape::default(),
                    params: 0,
                    parameter_bytes: 0,
                    buffer_bytes: 0,
                });
                let i = self.tape.layers.len() - 1;
                self.layer_index.insert(key, i);
                i
            }
        };
    }

    /// Records this layer's parameter and buffer figures (for one copy) the first time it is
    /// traced.
    fn note_params(&mut self, first_param: usize, first_storage: usize) {
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
        let first_storage = self.tape.storages.len();
        let out = self.op_inner(op, layer, inputs)?;
        self.note_params(first_param, first_storage);
        Ok(out)
    }

    #[allow(clippy::too_many_lines)] // one arm per operation
    fn op_inner(&mut self, op: &Op, layer: &Layer, inputs: &[ValueId]) -> Result<ValueId, Error> {
        let x = inputs[0];
        let xv = self.val(x).clone();
        let train = layer.trainable;
        match op {
            Op::Linear {
                in_features,
                out_features,
                bias,
                tie,
            } => {
                let in_f = self.last_dim(&xv, "linear")?;
                if let Some(expected) = in_features.filter(|&e| e != in_f) {
                    return Err(self.err(format!(
                        "input {} has {in_f} features, expected in_features = {expected}",
                        xv.shape
                    )));
                }
                let weight = match tie {
                    Some(name) => {
                        let w = *self.embeddings.get(name).ok_or_else(|| self.err(format!("`tie` names `{name}`, which is not an embedding traced before this layer")))?;
                        let ws = self.val(w).shape.clone();
                        if ws.dims() != [*out_features, in_f] {
                            return Err(self.err(format!("tied weight `{name}` has shape {ws}, expected [{out_features}, {in_f}]")));
                        }
                        w
                    }
                    None => {
                        let head = ["lm_head", "head", "classifier", "score", "pooler"]
                            .iter()
                            .any(|n| layer.name.rsplit('.').next().unwrap_or("").contains(n));
                        self.weight(Shape::from([*out_features, in_f]), train, !head)?
                    }
                };
                let b = if *bias {
                    Some(self.param(Shape::from([*out_features]), train)?)
                } else {
                    None
                };
                let y = self.linear(x, weight, b, *out_features)?;
                if tie.is_some() {
                    Ok(y)
                } else {
                    self.lora(x, y, in_f, *out_features, &layer.name)
                }
            }
            Op::Conv {
                spatial,
                in_channels,
                out_channels,
                kernel,
                stride,
                padding,
                dilation,
                groups,
                bias,
            } => {
                let d = xv.shape.dims().to_vec();
                if d.len() != spatial + 2 {
                    return Err(self.err(format!(
                        "input {} has rank {}, expected rank {} [batch, channels, {}]",
                        xv.shape,
                        d.len(),
                        spatial + 2,
                        if *spatial == 1 {
                            "length"
                        } else {
                            "height, width"
                        }
                    )));
                }
                let cin = d[1];
                if let Some(expected) = in_channels.filter(|&e| e != cin) {
                    return Err(self.err(format!(
                        "input {} has {cin} channels, expected in_channels = {expected}",
                        xv.shape
                    )));
                }
                if !cin.is_multiple_of(*groups) {
                    return Err(self.err(format!(
                        "input channels ({cin}) must be divisible by groups ({groups})"
                    )));
                }
                let mut out = vec![d[0], *out_channels];
                let mut wshape = vec![*out_channels, cin / groups];
                let axes: Vec<(u64, u64, u64, u64, u64)> = if *spatial == 1 {
                    vec![(d[2], kernel.1, stride.1, padding.1, dilation.1)]
                } else {
                    vec![
                        (d[2], kernel.0, stride.0, padding.0, dilation.0),
                        (d[3], kernel.1, stride.1, padding.1, dilation.1),
                    ]
                };
                for (len, k, s, p, dl) in axes {
                    out.push(self.window_out(len, k, s, p, dl, false, &xv.shape)?);
                    wshape.push(k);
                }
                let w = self.param(Shape::new(wshape), train)?;
                let b = if *bias {
                    Some(self.param(Shape::from([*out_channels]), train)?)
                } else {
                    None
                };
                let xc = self.autocast_input(x)?;
                let wc = self.autocast_input(w)?;
                let bc = match b {
                    Some(b) => Some(self.autocast_input(b)?),
                    None => None,
                };
                let dtype = self.val(xc).dtype;
                let rg = self.rg(xc) || self.rg(wc);
                let y = self.fresh(Shape::new(out), dtype, "output", rg)?;
                // derivatives.yaml `convolution`: saves input and weight.
                let saves = vec![self.sid(xc), self.sid(wc)];
                let mut ins = vec![xc, wc];
                ins.extend(bc);
                // The CPU kernels (oneDNN) reorder the input into a blocked layout: a transient
                // copy of it (measured: about one input's size for 1×1, 3×3, 7×7 and depthwise).
                let mut allocs = Vec::new();
                if self.s.device == Device::Cpu {
                    let xs = self.val(xc).shape.clone();
                    allocs.push(self.storage(
                        &xs,
                        dtype,
                        StorageKind::Activation,
                        "reordered input",
                    )?);
                }
                self.push(Step {
                    allocs,
                    op: "convolution",
                    inputs: ins,
                    outputs: vec![y],
                    saves,
                    ..self.blank()
                });
                Ok(y)
            }
            Op::BatchNorm {
                spatial,
                num_features,
                affine,
                track_running_stats,
            } => {
                let rank = xv.shape.rank();
                let ok = if *spatial == 1 {
                    rank == 2 || rank == 3
                } else {
                    rank == 4
                };
                if !ok {
                    let expected = if *spatial == 1 {
                        "[batch, channels] or [batch, channels, length]"
                    } else {
                        "[batch, channels, height, width]"
                    };
                    return Err(self.err(format!(
                        "input {} has rank {rank}, expected {expected}",
                        xv.shape
                    )));
                }
                let c = xv.shape.dims()[1];
                if let Some(n) = num_features.filter(|&n| n != c) {
                    return Err(self.err(format!(
                        "input {} has {c} channels, expected num_features = {n}",
                        xv.shape
                    )));
                }
                let mut ins = vec![x];
                if *affine {
                    ins.push(self.param(Shape::from([c]), train)?);
                    ins.push(self.param(Shape::from([c]), train)?);
                }
                if *track_running_stats {
                    let bdt = self.param_dtype();
                    self.buffer(Shape::from([c]), bdt, "running_mean")?;
                    self.buffer(Shape::from([c]), bdt, "running_var")?;
                    self.buffer(Shape::default(), DType::Int64, "num_batches_tracked")?;
                }
                let rg = ins.iter().any(|&v| self.rg(v));
                let y = self.fresh(xv.shape.clone(), xv.dtype, "output", rg)?;
                let mut step = Step {
                    op: "native_batch_norm",
                    inputs: ins,
                    outputs: vec![y],
                    ..self.blank()
                };
                if self.training() {
                    // derivatives.yaml `native_batch_norm`: input, weight, running stats,
                    // save_mean and save_invstd ([C], in the statistics dtype).
                    let sdt = self.stats_dtype(xv.dtype);
                    let mean =
                        self.storage(&Shape::from([c]), sdt, StorageKind::Activation, "save_mean")?;
                    let invstd = self.storage(
                        &Shape::from([c]),
                        sdt,
                        StorageKind::Activation,
                        "save_invstd",
                    )?;
                    step.allocs.extend([mean, invstd]);
                    step.saves = vec![xv.storage, mean, invstd];
                }
                self.push(step);
                Ok(y)
            }
            Op::LayerNorm { affine, bias } => {
                let h = self.last_dim(&xv, "layernorm")?;
                let xin = if self.autocast_f32_norms() {
                    self.upcast_f32(x)?
                } else {
                    x
                };
                // native_layer_norm works on `input.contiguous()`.
                let xin = self.contiguous(xin)?;
                let xd = self.val(xin).dtype;
                let mut ins = vec![xin];
                if *affine {
                    ins.push(self.param(Shape::from([h]), train)?);
                    if *bias {
                        ins.push(self.param(Shape::from([h]), train)?);
                    }
                }
                let rows = xv.shape.with_last(1);
                let rg = ins.iter().any(|&v| self.rg(v));
                let y = self.fresh(xv.shape.clone(), xd, "output", rg)?;
                let sdt = self.stats_dtype(xd);
                let mean = self.storage(&rows, sdt, StorageKind::Activation, "mean")?;
                let rstd = self.storage(&rows, sdt, StorageKind::Activation, "rstd")?;
                // derivatives.yaml `native_layer_norm`: input, weight, bias, mean, rstd.
                let saves = vec![self.sid(xin), mean, rstd];
                self.push(Step {
                    op: "native_layer_norm",
                    inputs: ins,
                    outputs: vec![y],
                    allocs: vec![mean, rstd],
                    saves,
                    ..self.blank()
                });
                Ok(y)
            }
            Op::RmsNorm => {
                let h = self.last_dim(&xv, "rmsnorm")?;
                let w = self.param(Shape::from([h]), train)?;
                self.rms_norm(x, w)
            }
            Op::GroupNorm { groups, affine } => {
                if xv.shape.rank() < 2 {
                    return Err(self.err(format!(
                        "input {} has rank {}, expected at least [batch, channels]",
                        xv.shape,
                        xv.shape.rank()
                    )));
                }
                let (b, c) = (xv.shape.dims()[0], xv.shape.dims()[1]);
                if c % groups != 0 {
                    return Err(self.err(format!(
                        "{c} channels are not divisible into {groups} groups"
                    )));
                }
                let xin = if self.autocast_f32_norms() {
                    self.upcast_f32(x)?
                } else {
                    x
                };
                let xd = self.val(xin).dtype;
                let mut ins = vec![xin];
                if *affine {
                    ins.push(self.param(Shape::from([c]), train)?);
                    ins.push(self.param(Shape::from([c]), train)?);
                }
                let rg = ins.iter().any(|&v| self.rg(v));
                let y = self.fresh(xv.shape.clone(), xd, "output", rg)?;
                let sdt = self.stats_dtype(xd);
                let mean = self.storage(
                    &Shape::from([b, *groups]),
                    sdt,
                    StorageKind::Activation,
                    "mean",
                )?;
                let rstd = self.storage(
                    &Shape::from([b, *groups]),
                    sdt,
                    StorageKind::Activation,
                    "rstd",
                )?;
                // derivatives.yaml `native_group_norm`: input, weight, mean, rstd.
                let saves = vec![self.sid(xin), mean, rstd];
                self.push(Step {
                    op: "native_group_norm",
                    inputs: ins,
                    outputs: vec![y],
                    allocs: vec![mean, rstd],
                    saves,
                    ..self.blank()
                });
                Ok(y)
            }
            Op::Embedding {
                num_embeddings,
                embedding_dim,
                tie,
            } => {
                if xv.dtype.is_float() {
                    return Err(self.err(format!(
                        "input is {} {}, expected integer token ids (set input.dtype = \"int64\")",
                        xv.dtype, xv.shape
                    )));
                }
                let w = match tie {
                    Some(name) => {
                        let w = *self.embeddings.get(name).ok_or_else(|| {
                            self.err(format!("`tie` names `{name}`, which is not an embedding traced before this layer"))
                        })?;
                        let ws = self.val(w).shape.clone();
                        if ws.dims() != [*num_embeddings, *embedding_dim] {
                            return Err(self.err(format!("tied weight `{name}` has shape {ws}, expected [{num_embeddings}, {embedding_dim}]")));
                        }
                        w
                    }
                    None => self.param(Shape::from([*num_embeddings, *embedding_dim]), train)?,
                };
                self.embeddings.insert(layer.name.clone(), w);
                let mut dims = xv.shape.dims().to_vec();
                dims.push(*embedding_dim);
                let dtype = self.param_dtype();
                let rg = self.rg(w);
                let y = self.fresh(Shape::new(dims), dtype, "output", rg)?;
                // derivatives.yaml `embedding`: saves the indices only.
                self.push(Step {
                    op: "embedding",
                    inputs: vec![w, x],
                    outputs: vec![y],
                    saves: vec![xv.storage],
                    ..self.blank()
                });
                Ok(y)
            }
            Op::PositionEmbedding {
                num_positions,
                ids_buffer,
            } => {
                let d = xv.shape.dims().to_vec();
                if d.len() != 3 {
                    return Err(self.err(format!(
                        "input {} has rank {}, expected [batch, seq, hidden]",
                        xv.shape,
                        d.len()
                    )));
                }
                let (s, h) = (d[1], d[2]);
                if s > *num_positions {
                    return Err(self.err(format!(
                        "sequence length {s} exceeds num_positions = {num_positions}"
                    )));
                }
                let w = self.param(Shape::from([*num_positions, h]), train)?;
                let ids = if *ids_buffer > 0 {
                    self.buffer(Shape::from([1, *ids_buffer]), DType::Int64, "position ids")?
                } else {
                    self.storage(
                        &Shape::from([1, s]),
                        DType::Int64,
                        StorageKind::Activation,
                        "position ids",
                    )?
                };
                let ids_v = self.value(
                    ids,
                    Shape::from([1, s]),
                    DType::Int64,
                    Layout::Contiguous,
                    false,
                    false,
                );
                let rg = self.rg(w);
                let pos = self.fresh(
                    Shape::from([1, s, h]),
                    self.param_dtype(),
                    "position embeddings",
                    rg,
                )?;
                let allocs = if self.tape.storages[ids].kind == StorageKind::Activation {
                    vec![ids]
                } else {
                    Vec::new()
                };
                self.push(Step {
                    op: "embedding",
                    inputs: vec![w, ids_v],
                    outputs: vec![pos],
                    allocs,
                    saves: vec![ids],
                    ..self.blank()
                });
                self.add(&[x, pos], false)
            }
            Op::TokenTypeEmbedding {
                num_types,
                ids_buffer,
            } => {
                let d = xv.shape.dims().to_vec();
                if d.len() != 3 {
                    return Err(self.err(format!(
                        "input {} has rank {}, expected [batch, seq, hidden]",
                        xv.shape,
                        d.len()
                    )));
                }
                let (bsz, s, h) = (d[0], d[1], d[2]);
                if *ids_buffer > 0 && s > *ids_buffer {
                    return Err(self.err(format!(
                        "sequence length {s} exceeds the ids buffer ({ids_buffer})"
                    )));
                }
                let w = self.param(Shape::from([*num_types, h]), train)?;
                // All-zero type ids: an expanded view of the module's buffer, or a new tensor.
                let ids = if *ids_buffer > 0 {
                    // BertEmbeddings gathers `[1, S]` ids out of its buffer: a new tensor.
                    self.buffer(
                        Shape::from([1, *ids_buffer]),
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
                let ids_v = self.value(
                    ids,
                    Shape::from([bsz, s]),
                    DType::Int64,
                    Layout::Strided,
                    false,
                    false,
                );
                let rg = self.rg(w);
                let emb = self.fresh(
                    Shape::from([bsz, s, h]),
                    self.param_dtype(),
                    "token type embeddings",
                    rg,
                )?;
                let allocs = if self.tape.storages[ids].kind == StorageKind::Activation {
                    vec![ids]
                } else {
                    Vec::new()
                };
                self.push(Step {
                    op: "embedding",
                    inputs: vec![w, ids_v],
                    outputs: vec![emb],
                    allocs,
                    saves: vec![ids],
                    ..self.blank()
                });
                self.add(&[x, emb], false)
            }
            Op::Rotary { head_dim, concat } => {
                let d = xv.shape.dims().to_vec();
                if d.len() != 3 {
                    return Err(self.err(format!(
                        "input {} has rank {}, expected [batch, seq, hidden]",
                        xv.shape,
                        d.len()
                    )));
                }
                let half = head_dim / 2;
                let bdt = self.param_dtype();
                self.buffer(Shape::from([half]), bdt, "inv_freq")?;
                self.buffer(Shape::from([half]), bdt, "original_inv_freq")?;
                // cos and sin, [1, S, head_dim] in the activation dtype, shared by every layer.
                let table = Shape::from([1, d[1], *head_dim]);
                let dt = if self.s.amp.is_some() {
                    DType::Float32
                } else {
                    self.act_dtype()
                };
                let cos = self.storage(&table, dt, StorageKind::Activation, "rope cos")?;
                let sin = self.storage(&table, dt, StorageKind::Activation, "rope sin")?;
                self.push(Step {
                    op: "rotary_embedding",
                    allocs: vec![cos, sin],
                    ..self.blank()
                });
                self.tape.held.extend([cos, sin]);
                self.rope = Some((cos, sin, *concat));
                Ok(x)
            }
            Op::Parameter { shape, combine } => {
                let p = self.param(Shape::new(shape.clone()), train)?;
                match combine {
                    Combine::Add => {
                        let ps = Shape::new(shape.clone());
                        if broadcast(&xv.shape, &ps).as_ref() != Some(&xv.shape) {
                            return Err(self.err(format!(
                                "parameter of shape {ps} does not broadcast to the input {}",
                                xv.shape
                            )));
                        }
                        self.add(&[x, p], false)
                    }
                    Combine::Concat(dim) => {
                        let rank = xv.shape.rank();
                        let axis = self.axis(*dim, rank)?;
                        let mut expanded = shape.clone();
                        if expanded.len() != rank {
                            return Err(self.err(format!("parameter of shape {:?} has rank {}, expected rank {rank} like the input {}", shape, expanded.len(), xv.shape)));
                        }
                        expanded[0] = xv.shape.dims()[0];
                        let ev = self.view_of(p, Shape::new(expanded), Layout::Strided);
                        self.tape.values[ev].param = false;
                        self.push(Step {
                            op: "expand",
                            inputs: vec![p],
                            outputs: vec![ev],
                            view_grad: true,
                            ..self.blank()
                        });
                        self.concat(&[ev, x], axis)
                    }
                }
            }
            Op::Dropout { p, inplace } => self.dropout(x, *p, *inplace),
            Op::Activation(act) => self.activation(x, *act),
            Op::Softmax { dim } => {
                self.axis(*dim, xv.shape.rank())?;
                let xin = if self.autocast_f32_norms() {
                    self.upcast_f32(x)?
                } else {
                    x
                };
                let y = self.fresh(
                    xv.shape.clone(),
                    self.val(xin).dtype,
                    "output",
                    self.rg(xin),
                )?;
                let saves = vec![self.sid(y)];
                self.push(Step {
                    op: "_softmax",
                    inputs: vec![xin],
                    outputs: vec![y],
                    saves,
                    ..self.blank()
                });
                Ok(y)
            }
            Op::Mul => self.mul(inputs[0], inputs[1]),
            Op::Add { inplace } => self.add(inputs, *inplace),
            Op::Concat { dim } => {
                let rank = xv.shape.rank();
                let axis = self.axis(*dim, rank)?;
                self.concat(inputs, axis)
            }
            Op::MaxPool2d {
                kernel,
                stride,
                padding,
                dilation,
                ceil_mode,
            } => {
                let (b, c, h, w) = self.nchw(&xv)?;
                let oh = self.window_out(
                    h, kernel.0, stride.0, padding.0, dilation.0, *ceil_mode, &xv.shape,
                )?;
                let ow = self.window_out(
                    w, kernel.1, stride.1, padding.1, dilation.1, *ceil_mode, &xv.shape,
                )?;
                let shape = Shape::from([b, c, oh, ow]);
                let y = self.fresh(shape.clone(), xv.dtype, "output", xv.requires_grad)?;
                let mut step = Step {
                    op: "max_pool2d_with_indices",
                    inputs: vec![x],
                    outputs: vec![y],
                    ..self.blank()
                };
                // derivatives.yaml `max_pool2d_with_indices`: saves input and the int64 indices.
                let idx = self.storage(&shape, DType::Int64, StorageKind::Activation, "indices")?;
                step.allocs.push(idx);
                step.saves = vec![xv.storage, idx];
                self.push(step);
                Ok(y)
            }
            Op::AvgPool2d {
                kernel,
                stride,
                padding,
                ceil_mode,
            } => {
                let (b, c, h, w) = self.nchw(&xv)?;
                let oh =
                    self.window_out(h, kernel.0, stride.0, padding.0, 1, *ceil_mode, &xv.shape)?;
                let ow =
                    self.window_out(w, kernel.1, stride.1, padding.1, 1, *ceil_mode, &xv.shape)?;
                let y = self.fresh(
                    Shape::from([b, c, oh, ow]),
                    xv.dtype,
                    "output",
                    xv.requires_grad,
                )?;
                self.push(Step {
                    op: "avg_pool2d",
                    inputs: vec![x],
                    outputs: vec![y],
                    saves: vec![xv.storage],
                    ..self.blank()
                });
                Ok(y)
            }
            Op::AdaptiveAvgPool2d { output } => {
                let (b, c, _, _) = self.nchw(&xv)?;
                let y = self.fresh(
                    Shape::from([b, c, output.0, output.1]),
                    xv.dtype,
                    "output",
                    xv.requires_grad,
                )?;
                if *output == Pair(1, 1) {
                    // ATen's adaptive_avg_pool2d runs `mean(-1, -2, keepdim)` for a 1×1 output,
                    // whose backward needs only sizes.
                    self.push(Step {
                        op: "mean",
                        inputs: vec![x],
                        outputs: vec![y],
                        ..self.blank()
                    });
                } else {
                    self.push(Step {
                        op: "_adaptive_avg_pool2d",
                        inputs: vec![x],
                        outputs: vec![y],
                        saves: vec![xv.storage],
                        ..self.blank()
                    });
                }
                Ok(y)
            }
            Op::Flatten { start, end } => {
                let rank = xv.shape.rank();
                let (a, b) = (self.axis(*start, rank)?, self.axis(*end, rank)?);
                if a > b {
                    return Err(self.err(format!(
                        "start_dim {start} comes after end_dim {end} for input {}",
                        xv.shape
                    )));
                }
                let d = xv.shape.dims();
                let mut dims = d[..a].to_vec();
                dims.push(checked(
                    d[a..=b].iter().try_fold(1u64, |acc, &v| acc.checked_mul(v)),
                    "a flattened dimension",
                )?);
                dims.extend_from_slice(&d[b + 1..]);
                self.reshape(x, Shape::new(dims))
            }
            Op::Reshape { shape } => {
                let numel = checked(xv.shape.numel(), "an element count")?;
                let batch = xv.shape.dims()[0];
                let per = numel / batch;
                let known = shape
                    .iter()
                    .filter(|&&d| d > 0)
                    .try_fold(1u64, |acc, &d| acc.checked_mul(d.unsigned_abs()));
                let known = checked(known, "a reshape size")?;
                let mut dims = vec![batch];
                for &d in shape {
                    dims.push(if d == -1 {
                        if known == 0 || !per.is_multiple_of(known) {
                            return Err(self.err(format!("cannot reshape {} to [batch, {shape:?}]: {per} elements per sample do not divide by {known}", xv.shape)));
                        }
                        per / known
                    } else {
                        d.unsigned_abs()
                    });
                }
                let target = Shape::new(dims);
                if target.numel() != Some(numel) {
                    return Err(self.err(format!(
                        "cannot reshape {} ({numel} elements) to {target}",
                        xv.shape
                    )));
                }
                self.reshape(x, target)
            }
            Op::Transpose { a, b } => {
                let rank = xv.shape.rank();
                let (a, b) = (self.axis(*a, rank)?, self.axis(*b, rank)?);
                let mut dims = xv.shape.dims().to_vec();
                dims.swap(a, b);
                let layout = if a == b {
                    xv.layout
                } else if xv.layout == Layout::Contiguous
                    && a.min(b) + 2 == rank
                    && a.max(b) + 1 == rank
                {
                    Layout::LastTwoSwapped
                } else if xv.layout == Layout::LastTwoSwapped
                    && a.min(b) + 2 == rank
                    && a.max(b) + 1 == rank
                {
                    Layout::Contiguous
                } else {
                    Layout::Strided
                };
                let y = self.view_of(x, Shape::new(dims), layout);
                self.push(Step {
                    op: "transpose",
                    inputs: vec![x],
                    outputs: vec![y],
                    view_grad: true,
                    ..self.blank()
                });
                Ok(y)
            }
            Op::Select { dim, index } => {
                let rank = xv.shape.rank();
                let axis = self.axis(*dim, rank)?;
                if axis == 0 {
                    return Err(self.err("select on the batch dimension is not supported".into()));
                }
                let size = xv.shape.dims()[axis];
                let ok = if *index >= 0 {
                    index.unsigned_abs() < size
                } else {
                    index.unsigned_abs() <= size
                };
                if !ok {
                    return Err(self.err(format!("index {index} is out of range for dimension {dim} of size {size} (input {})", xv.shape)));
                }
                let mut dims = xv.shape.dims().to_vec();
                dims.remove(axis);
                let layout = if axis == 1 && rank == 2 {
                    Layout::Contiguous
                } else {
                    Layout::Strided
                };
                let y = self.view_of(x, Shape::new(dims), layout);
                // select_backward allocates a zero gradient of the input's full shape.
                self.push(Step {
                    op: "select",
                    inputs: vec![x],
                    outputs: vec![y],
                    ..self.blank()
                });
                Ok(y)
            }
            Op::Attention {
                style,
                kv_cache,
                heads,
                kv_heads,
                head_dim,
                causal,
                bias,
                out_bias,
                fused_qkv,
                rotary,
                dropout,
                qk_norm,
                position_bias,
                sliding_window,
            } => {
                let cfg = AttnCfg {
                    qk_norm: *qk_norm,
                    position_bias: *position_bias,
                    sliding_window: *sliding_window,
                    style: *style,
                    kv_cache: *kv_cache,
                    heads: *heads,
                    kv_heads: *kv_heads,
                    head_dim: *head_dim,
                    causal: *causal,
                    bias: *bias,
                    out_bias: *out_bias,
                    fused_qkv: *fused_qkv,
                    rotary: *rotary,
                    dropout: *dropout,
                };
                self.attention(x, x, &cfg, train)
            }
            Op::CrossEntropy { shift, upcast } => self.cross_entropy(x, *shift, *upcast),
            Op::CrossAttention {
                heads,
                head_dim,
                bias,
                out_bias,
                dropout,
            } => {
                let cfg = AttnCfg {
                    qk_norm: false,
                    position_bias: false,
                    sliding_window: None,
                    style: AttnStyle::Transformers,
                    kv_cache: true,
                    heads: *heads,
                    kv_heads: *heads,
                    head_dim: *head_dim,
                    causal: false,
                    bias: *bias,
                    out_bias: *out_bias,
                    fused_qkv: false,
                    rotary: false,
                    dropout: *dropout,
                };
                self.attention(inputs[0], inputs[1], &cfg, train)
            }
            Op::RelativePositionBias { num_buckets, heads } => {
                let &[_, s, _] = xv.shape.dims() else {
                    return Err(self.err(format!(
                        "input {} has rank {}, expected [batch, seq, hidden]",
                        xv.shape,
                        xv.shape.rank()
                    )));
                };
                // T5Attention.compute_bias: int64 bucket ids [S, S] (kept by the embedding
                // lookup), values [S, S, heads] permuted to a [1, heads, S, S] bias.
                let w = self.param(Shape::from([*num_buckets, *heads]), train)?;
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
                self.push(Step {
                    op: "_relative_position_bucket",
                    outputs: vec![ids],
                    ..self.blank()
                });
                let rg = self.rg(w);
                let bias = self.fresh(
                    Shape::from([1, *heads, s, s]),
                    self.act_dtype(),
                    "position bias",
                    rg,
                )?;
                self.push(Step {
                    op: "embedding",
                    inputs: vec![w, ids],
                    outputs: vec![bias],
                    saves: vec![buckets],
                    ..self.blank()
                });
                self.position_bias = Some(bias);
                Ok(x)
            }
            Op::Moe {
                experts,
                top_k,
                intermediate_size,
                shared_intermediate_size,
                shared_gate,
                normalize_topk,
            } => {
                let cfg = MoeCfg {
                    experts: *experts,
                    top_k: *top_k,
                    inter: *intermediate_size,
                    shared: *shared_intermediate_size,
                    shared_gate: *shared_gate,
                    normalize: *normalize_topk,
                };
                self.moe(x, &cfg, train)
            }
            Op::StochasticDepth { p } => {
                if !self.training() || *p == 0.0 {
                    return Ok(x);
                }
                // torchvision.ops.stochastic_depth, mode "row": `input * noise` with noise
                // [B, 1, ..] (bernoulli, divided by the survival rate); mul keeps the noise.
                let mut dims = vec![1; xv.shape.rank()];
                dims[0] = xv.shape.dims()[0];
                let noise = self.storage(
                    &Shape::new(dims),
                    xv.dtype,
                    StorageKind::Activation,
                    "stochastic depth noise",
                )?;
                let y = self.fresh(xv.shape.clone(), xv.dtype, "output", xv.requires_grad)?;
                self.push(Step {
                    op: "mul",
                    inputs: vec![x],
                    outputs: vec![y],
                    allocs: vec![noise],
                    saves: vec![noise],
                    ..self.blank()
                });
                Ok(y)
            }
            Op::ShiftRight => {
                if xv.dtype.is_float() {
                    return Err(self.err(format!(
                        "input is {} {}, expected integer token ids",
                        xv.dtype, xv.shape
                    )));
                }
                let y = self.fresh(xv.shape.clone(), xv.dtype, "shifted ids", false)?;
                self.push(Step {
                    op: "_shift_right",
                    inputs: vec![x],
                    outputs: vec![y],
                    ..self.blank()
                });
                Ok(y)
            }
            Op::Scale { .. } => self.unary(x, "mul", Keep::Nothing, false),
        }
    }

    fn last_dim(&self, v: &Value, kind: &str) -> Result<u64, Error> {
        if v.shape.rank() < 2 {
            return Err(self.err(format!(
                "input {} has rank {}, expected [batch, .., features] for {kind}",
                v.shape,
                v.shape.rank()
            )));
        }
        if !v.dtype.is_float() {
            return Err(self.err(format!(
                "input is {} {}, expected a float tensor (token ids need an embedding first)",
                v.dtype, v.shape
            )));
        }
        Ok(v.shape.last().unwrap_or(0))
    }

    fn nchw(&self, v: &Value) -> Result<(u64, u64, u64, u64), Error> {
        match *v.shape.dims() {
            [b, c, h, w] => Ok((b, c, h, w)),
            _ => Err(self.err(format!(
                "input {} has rank {}, expected [batch, channels, height, width]",
                v.shape,
                v.shape.rank()
            ))),
        }
    }

    fn axis(&self, dim: i64, rank: usize) -> Result<usize, Error> {
        let r = i64::try_from(rank).unwrap_or(i64::MAX);
        let a = if dim < 0 { dim + r } else { dim };
        if (0..r).contains(&a) {
            Ok(usize::try_from(a).unwrap_or(0))
        } else {
            Err(self.err(format!(
                "dimension {dim} is out of range for a rank-{rank} input"
            )))
        }
    }

    /// Output length of a sliding window (conv, pooling), as `torch.nn` documents it.
    #[allow(clippy::too_many_arguments)]
    fn window_out(
        &self,
        len: u64,
        k: u64,
        s: u64,
        p: u64,
        d: u64,
        ceil: bool,
        shape: &Shape,
    ) -> Result<u64, Error> {
        let padded = checked(len.checked_add(p.saturating_mul(2)), "a padded size")?;
        let span = checked(
            d.checked_mul(k - 1).and_then(|v| v.checked_add(1)),
            "a kernel span",
        )?;
        if padded < span {
            return Err(self.err(format!("input {shape} is too small: a window of {span} (kernel {k}, dilation {d}) does not fit in {len} + 2×{p} padding")));
        }
        let mut out = (padded - span) / s + 1;
        if ceil && (padded - span) % s != 0 {
            out += 1;
            if (out - 1) * s >= len + p {
                out -= 1;
            }
        }
        Ok(out)
    }

    /// Statistics dtype of norms: float32 for 16-bit inputs (ATen's `acc_type`), else the input's.
    fn stats_dtype(&self, dtype: DType) -> DType {
        match dtype {
            DType::Float16 | DType::Bfloat16 => DType::Float32,
            d => d,
        }
    }

    /// `F.linear` (addmm / mm): saves the input when the weight needs a gradient and the weight
    /// when the input needs one (`derivatives.yaml` `addmm`, `mm`). An input of rank > 2 is
    /// flattened to 2-D, which copies it when it is not contiguous.
    fn linear(
        &mut self,
        x: ValueId,
        w: ValueId,
        b: Option<ValueId>,
        out_features: u64,
    ) -> Result<ValueId, Error> {
        let mut xc = self.autocast_input(x)?;
        if self.val(xc).shape.rank() > 2 && self.val(xc).layout != Layout::Contiguous {
            xc = self.contiguous(xc)?;
        }
        let wc = self.autocast_input(w)?;
        let bc = match b {
            Some(b) => Some(self.autocast_input(b)?),
            None => None,
        };
        let xv = self.val(xc).clone();
        let rg = xv.requires_grad || self.rg(wc) || bc.is_some_and(|b| self.rg(b));
        let y = self.fresh(xv.shape.with_last(out_features), xv.dtype, "output", rg)?;
        let mut allocs = Vec::new();
        if self.quantized.contains(&w) {
            // bitsandbytes/GPTQ kernels dequantize the weight to the compute dtype for the matmul.
            let ws = self.val(w).shape.clone();
            allocs.push(self.storage(
                &ws,
                xv.dtype,
                StorageKind::Activation,
                "dequantized weight",
            )?);
        }
        let mut saves = Vec::new();
        if self.rg(wc) {
            saves.push(xv.storage);
        }
        if xv.requires_grad {
            saves.push(self.sid(wc));
        }
        let mut ins = vec![xc, wc];
        ins.extend(bc);
        self.push(Step {
            op: if b.is_some() { "addmm" } else { "mm" },
            inputs: ins,
            outputs: vec![y],
            allocs,
            saves,
            ..self.blank()
        });
        Ok(y)
    }

    /// `reshape`: a view of a contiguous input, else a copy.
    fn reshape(&mut self, x: ValueId, shape: Shape) -> Result<ValueId, Error> {
        let xc = self.contiguous(x)?;
        let y = self.view_of(xc, shape, Layout::Contiguous);
        self.push(Step {
            op: "view",
            inputs: vec![xc],
            outputs: vec![y],
            view_grad: true,
            ..self.blank()
        });
        Ok(y)
    }

    fn dropout(&mut self, x: ValueId, p: f64, inplace: bool) -> Result<ValueId, Error> {
        if !self.training() || p == 0.0 {
            return Ok(x);
        }
        let xv = self.val(x).clone();
        // CUDA: `native_dropout` keeps a bool mask. CPU: `_dropout_impl` multiplies by a noise
        // tensor of the input's dtype and keeps it (aten/src/ATen/native/Dropout.cpp).
        let (mask_dtype, what) = match self.s.device {
            Device::Cuda => (DType::Bool, "dropout mask"),
            Device::Cpu => (xv.dtype, "dropout noise"),
        };
        let mask = self.storage(&xv.shape, mask_dtype, StorageKind::Activation, what)?;
        let y = if inplace {
            self.view_of(x, xv.shape.clone(), Layout::Contiguous)
        } else {
            self.fresh(xv.shape.clone(), xv.dtype, "output", xv.requires_grad)?
        };
        self.push(Step {
            op: "dropout",
            inputs: vec![x],
            outputs: vec![y],
            allocs: vec![mask],
            saves: vec![mask],
            ..self.blank()
        });
        Ok(y)
    }

    fn unary(
        &mut self,
        x: ValueId,
        op: &'static str,
        keep: Keep,
        inplace: bool,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let y = if inplace {
            self.view_of(x, xv.shape.clone(), Layout::Contiguous)
        } else {
            self.fresh(xv.shape.clone(), xv.dtype, "output", xv.requires_grad)?
        };
        let mut allocs = Vec::new();
        let saves = match keep {
            Keep::Nothing => vec![],
            Keep::Input => vec![xv.storage],
            Keep::Output => vec![self.sid(y)],
            Keep::InputClone => {
                let c =
                    self.storage(&xv.shape, xv.dtype, StorageKind::Activation, "input clone")?;
                allocs.push(c);
                vec![c]
            }
        };
        self.push(Step {
            op,
            inputs: vec![x],
            outputs: vec![y],
            allocs,
            saves,
            ..self.blank()
        });
        Ok(y)
    }

    fn activation(&mut self, x: ValueId, act: Activation) -> Result<ValueId, Error> {
        match act {
            // derivatives.yaml: relu/threshold keeps its result; hardtanh keeps its input
            // (its result when in place); gelu and silu keep their input; tanh and sigmoid
            // keep their result.
            Activation::Relu { inplace } => self.unary(x, "relu", Keep::Output, inplace),
            // An in-place op whose backward needs its input keeps a clone of it (autograd's
            // codegen saves `self.clone()` for `hardtanh_`).
            Activation::Relu6 { inplace } => self.unary(
                x,
                "hardtanh",
                if inplace {
                    Keep::InputClone
                } else {
                    Keep::Input
                },
                inplace,
            ),
            Activation::Gelu => self.unary(x, "gelu", Keep::Input, false),
            Activation::Silu { inplace } => self.unary(
                x,
                "silu",
                if inplace {
                    Keep::InputClone
                } else {
                    Keep::Input
                },
                inplace,
            ),
            Activation::Tanh => self.unary(x, "tanh", Keep::Output, false),
            Activation::Sigmoid => self.unary(x, "sigmoid", Keep::Output, false),
            Activation::GeluNew => {
                // 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), op by op.
                let cube = self.unary(x, "pow", Keep::Input, false)?;
                let scaled = self.unary(cube, "mul", Keep::Nothing, false)?;
                let inner = self.add(&[x, scaled], false)?;
                let arg = self.unary(inner, "mul", Keep::Nothing, false)?;
                let t = self.unary(arg, "tanh", Keep::Output, false)?;
                let one_plus = self.unary(t, "add", Keep::Nothing, false)?;
                let half = self.unary(x, "mul", Keep::Nothing, false)?;
                self.mul(half, one_plus)
            }
        }
    }

    /// Elementwise product: each factor is kept for the other's gradient
    /// (`derivatives.yaml` `mul.Tensor`).
    fn mul(&mut self, a: ValueId, b: ValueId) -> Result<ValueId, Error> {
        let (av, bv) = (self.val(a).clone(), self.val(b).clone());
        let shape = broadcast(&av.shape, &bv.shape).ok_or_else(|| {
            self.err(format!(
                "cannot multiply {} by {}: shapes do not broadcast",
                av.shape, bv.shape
            ))
        })?;
        let dtype = promote(av.dtype, bv.dtype);
        let y = self.fresh(shape, dtype, "output", av.requires_grad || bv.requires_grad)?;
        let mut saves = Vec::new();
        if av.requires_grad {
            saves.push(bv.storage);
        }
        if bv.requires_grad {
            saves.push(av.storage);
        }
        self.push(Step {
            op: "mul",
            inputs: vec![a, b],
            outputs: vec![y],
            saves,
            ..self.blank()
        });
        Ok(y)
    }

    /// Elementwise sum: saves nothing. In place, the result lives in the first input's memory.
    fn add(&mut self, inputs: &[ValueId], inplace: bool) -> Result<ValueId, Error> {
        let first = self.val(inputs[0]).clone();
        let mut shape = first.shape.clone();
        let mut dtype = first.dtype;
        let mut rg = first.requires_grad;
        for &v in &inputs[1..] {
            let vv = self.val(v).clone();
            shape = broadcast(&shape, &vv.shape).ok_or_else(|| {
                self.err(format!(
                    "cannot add {} and {}: shapes do not broadcast",
                    first.shape, vv.shape
                ))
            })?;
            dtype = promote(dtype, vv.dtype);
            rg |= vv.requires_grad;
        }
        if inplace && shape != first.shape {
            return Err(self.err(format!(
                "in-place add into {} cannot take the broadcast shape {shape}",
                first.shape
            )));
        }
        let y = if inplace {
            let y = self.view_of(inputs[0], shape, Layout::Contiguous);
            self.tape.values[y].requires_grad = rg;
            y
        } else {
            self.fresh(shape, dtype, "output", rg)?
        };
        self.push(Step {
            op: "add",
            inputs: inputs.to_vec(),
            outputs: vec![y],
            ..self.blank()
        });
        Ok(y)
    }

    /// `torch.cat`: saves only sizes.
    fn concat(&mut self, inputs: &[ValueId], axis: usize) -> Result<ValueId, Error> {
        let first = self.val(inputs[0]).clone();
        let mut dims = first.shape.dims().to_vec();
        let mut rg = first.requires_grad;
        for &v in &inputs[1..] {
            let vv = self.val(v).clone();
            let ok = vv.shape.rank() == dims.len()
                && vv
                    .shape
                    .dims()
                    .iter()
                    .enumerate()
                    .all(|(i, &d)| i == axis || d == dims[i]);
            if !ok {
                return Err(self.err(format!(
                    "cannot concatenate {} and {} along dimension {axis}: other dimensions differ",
                    first.shape, vv.shape
                )));
            }
            dims[axis] = checked(
                dims[axis].checked_add(vv.shape.dims()[axis]),
                "a concatenated size",
            )?;
            rg |= vv.requires_grad;
        }
        let y = self.fresh(Shape::new(dims), first.dtype, "output", rg)?;
        self.push(Step {
            op: "cat",
            inputs: inputs.to_vec(),
            outputs: vec![y],
            ..self.blank()
        });
        Ok(y)
    }

    /// transformers' `LlamaRMSNorm.forward`: `h = x.to(float32)`; `v = h.pow(2).mean(-1)`;
    /// `h = h * rsqrt(v + eps)`; `weight * h.to(input_dtype)`. Saves the float32 input (for
    /// `pow` and `mul`), the `[.., 1]` rsqrt, and the normalized tensor in the input dtype.
    fn rms_norm(&mut self, x: ValueId, w: ValueId) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let h = self.upcast_f32(x)?;
        let hv = self.val(h).clone();
        let rows = xv.shape.with_last(1);
        let sq = self.unary(h, "pow", Keep::Input, false)?;
        let var = self.fresh(rows.clone(), hv.dtype, "variance", hv.requires_grad)?;
        self.push(Step {
            op: "mean",
            inputs: vec![sq],
            outputs: vec![var],
            ..self.blank()
        });
        let var_eps = self.unary(var, "add", Keep::Nothing, false)?;
        let r = self.unary(var_eps, "rsqrt", Keep::Output, false)?;
        let normed = self.mul(h, r)?;
        let back = if xv.dtype == DType::Float32 || self.s.amp.is_some() {
            normed
        } else {
            let b = self.fresh(xv.shape.clone(), xv.dtype, "normalized", hv.requires_grad)?;
            self.push(Step {
                op: "_to_copy",
                inputs: vec![normed],
                outputs: vec![b],
                ..self.blank()
            });
            b
        };
        self.mul(w, back)
    }

    /// A projection inside an attention or MoE layer: `linear` with LoRA adapters when the
    /// projection is targeted.
    fn projection(
        &mut self,
        x: ValueId,
        in_f: u64,
        out_f: u64,
        bias: bool,
        train: bool,
        target: &str,
    ) -> Result<ValueId, Error> {
        let w = self.weight(Shape::from([out_f, in_f]), train, true)?;
        let b = if bias {
            Some(self.param(Shape::from([out_f]), train)?)
        } else {
            None
        };
        let y = self.linear(x, w, b, out_f)?;
        self.lora(x, y, in_f, out_f, target)
    }

    /// Self-attention (`kv_src == x`) or cross-attention (`kv_src` = the encoder output).
    #[allow(clippy::too_many_lines)] // the projections, cache and kernels read best in order
    fn attention(
        &mut self,
        x: ValueId,
        kv_src: ValueId,
        c: &AttnCfg,
        train: bool,
    ) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let &[b, s, h] = xv.shape.dims() else {
            return Err(self.err(format!(
                "input {} has rank {}, expected [batch, seq, hidden]",
                xv.shape,
                xv.shape.rank()
            )));
        };
        if !xv.dtype.is_float() {
            return Err(self.err(format!(
                "input is {} {}, expected float hidden states",
                xv.dtype, xv.shape
            )));
        }
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
            let xt = self.view_of(x, xv.shape.clone(), Layout::Strided);
            self.push(Step {
                op: "transpose",
                inputs: vec![x],
                outputs: vec![xt],
                view_grad: true,
                ..self.blank()
            });
            let proj = self.projection(xt, h, 3 * h, c.bias, train, "qkv")?;
            let pv = self.val(proj).clone();
            let packed = self.fresh(pv.shape.clone(), pv.dtype, "packed qkv", pv.requires_grad)?;
            self.push(Step {
                op: "clone",
                inputs: vec![proj],
                outputs: vec![packed],
                ..self.blank()
            });
            let q = self.view_of(packed, Shape::from([b, c.heads, s, hd]), Layout::SeqFirst);
            let k = self.view_of(packed, Shape::from([b, c.heads, s, hd]), Layout::SeqFirst);
            let v = self.view_of(packed, Shape::from([b, c.heads, s, hd]), Layout::SeqFirst);
            self.push(Step {
                op: "unbind",
                inputs: vec![packed],
                outputs: vec![q, k, v],
                ..self.blank()
            });
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
            self.push(Step {
                op: "split",
                inputs: vec![qkv],
                outputs: vec![q, k, v],
                ..self.blank()
            });
            (q, k, v)
        } else {
            let mut heads = Vec::new();
            for (src, in_f, width, n, len, target) in [
                (x, h, qd, c.heads, s, "q"),
                (kv_src, h_kv, kvd, c.kv_heads, s_kv, "k"),
                (kv_src, h_kv, kvd, c.kv_heads, s_kv, "v"),
            ] {
                let p = self.projection(src, in_f, width, c.bias, train, target)?;
                let hv = if c.qk_norm && target != "v" {
                    // Qwen3: RMSNorm over head_dim on the [B, S, heads, head_dim] view, then the
                    // head transpose of its (new, contiguous) output.
                    let pv = self.val(p).clone();
                    let split = self.view_of(p, Shape::from([b, len, n, hd]), Layout::Contiguous);
                    self.push(Step {
                        op: "view",
                        inputs: vec![p],
                        outputs: vec![split],
                        view_grad: true,
                        ..self.blank()
                    });
                    let w = self.param(Shape::from([hd]), train)?;
                    let normed = self.rms_norm(split, w)?;
                    let _ = pv;
                    let t = self.view_of(
                        normed,
                        Shape::from([b, n, len, hd]),
                        Layout::HeadsTransposed,
                    );
                    self.push(Step {
                        op: "transpose",
                        inputs: vec![normed],
                        outputs: vec![t],
                        view_grad: true,
                        ..self.blank()
                    });
                    t
                } else {
                    let t = self.view_of(p, Shape::from([b, n, len, hd]), Layout::HeadsTransposed);
                    self.push(Step {
                        op: "view",
                        inputs: vec![p],
                        outputs: vec![t],
                        view_grad: true,
                        ..self.blank()
                    });
                    t
                };
                heads.push(hv);
            }
            (heads[0], heads[1], heads[2])
        };
        let (q, k) = if c.rotary {
            let (cos, sin, concat) = self.rope.ok_or_else(|| {
                self.err("`rotary = true` needs a `rotary` layer earlier in the model".into())
            })?;
            (
                self.rope_apply(q, cos, sin, concat)?,
                self.rope_apply(k, cos, sin, concat)?,
            )
        } else {
            (q, k)
        };
        // transformers' decoders run with `use_cache=True` (the config default), training
        // included unless gradient checkpointing turns it off: `DynamicCache.update` stores
        // `torch.cat`-ed copies of K and V, and attention reads those copies. In inference the
        // cache lives for the whole forward pass, in `--kv-dtype` if given, and a sliding window
        // keeps only the last `sliding_window` tokens.
        let (k, v) = if (c.causal || cross)
            && c.kv_cache
            && !torch_mha
            && !(self.training() && self.s.checkpoint)
        {
            let mut copies = Vec::new();
            for (t, what) in [(k, "key cache"), (v, "value cache")] {
                let tv = self.val(t).clone();
                let cv = if self.training() {
                    let cache = self.storage(&tv.shape, tv.dtype, StorageKind::Activation, what)?;
                    let cv = self.value(
                        cache,
                        tv.shape.clone(),
                        tv.dtype,
                        Layout::Contiguous,
                        tv.requires_grad,
                        false,
                    );
                    self.push(Step {
                        op: "cat",
                        inputs: vec![t],
                        outputs: vec![cv],
                        ..self.blank()
                    });
                    cv
                } else {
                    let mut dims = tv.shape.dims().to_vec();
                    if let Some(w) = c.sliding_window {
                        dims[2] = dims[2].min(w);
                    }
                    let dt = self.s.kv_dtype.unwrap_or(tv.dtype);
                    let cache_shape = Shape::new(dims);
                    let cache = self.storage(&cache_shape, dt, StorageKind::KvCache, what)?;
                    self.tape.held.push(cache);
                    if cache_shape == tv.shape && dt == tv.dtype {
                        // Attention reads the cache itself.
                        let cv = self.value(
                            cache,
                            tv.shape.clone(),
                            tv.dtype,
                            Layout::Contiguous,
                            false,
                            false,
                        );
                        self.push(Step {
                            op: "cat",
                            inputs: vec![t],
                            outputs: vec![cv],
                            ..self.blank()
                        });
                        cv
                    } else {
                        // A windowed or re-typed cache is written; attention reads this pass's K/V.
                        self.push(Step {
                            op: "cache_update",
                            inputs: vec![t],
                            allocs: vec![cache],
                            ..self.blank()
                        });
                        t
                    }
                };
                copies.push(cv);
            }
            (copies[0], copies[1])
        } else {
            (k, v)
        };
        let bias = if c.position_bias {
            Some(self.position_bias.ok_or_else(|| self.err("`position_bias = true` needs a `relative_position_bias` layer earlier in the model".into()))?)
        } else {
            None
        };
        // `flash` models the fused kernel, which regenerates its dropout mask instead of keeping
        // it. (PyTorch's CPU SDPA falls back to the math path, costing what eager does, when
        // dropout is on: give such layers `--attention eager`.)
        let fused = torch_mha || self.s.attention == AttentionImpl::Flash;
        let ctx = if fused {
            self.sdpa_flash(q, k, v, bias)?
        } else {
            self.sdpa_eager(q, k, v, c, bias)?
        };
        // Merge heads: transformers `transpose(1, 2).contiguous()`, nn.MultiheadAttention
        // `permute(2, 0, 1, 3).contiguous()`; free when the output is already laid out so.
        let cv = self.val(ctx).clone();
        let free = if torch_mha {
            cv.layout == Layout::SeqFirst
        } else {
            cv.layout == Layout::HeadsTransposed
        };
        let merged_shape = Shape::from([b, s, qd]);
        let merged = if free {
            let m = self.view_of(ctx, merged_shape, Layout::Contiguous);
            self.push(Step {
                op: "view",
                inputs: vec![ctx],
                outputs: vec![m],
                view_grad: true,
                ..self.blank()
            });
            m
        } else {
            let m = self.fresh(merged_shape, cv.dtype, "merged heads", cv.requires_grad)?;
            self.push(Step {
                op: "clone",
                inputs: vec![ctx],
                outputs: vec![m],
                ..self.blank()
            });
            m
        };
        let y = self.projection(merged, qd, h, c.out_bias, train, "o")?;
        if torch_mha {
            // The [S, B, E] result is transposed back to batch-first: a strided view.
            let yt = self.view_of(y, xv.shape.clone(), Layout::Strided);
            self.push(Step {
                op: "transpose",
                inputs: vec![y],
                outputs: vec![yt],
                view_grad: true,
                ..self.blank()
            });
            return Ok(yt);
        }
        Ok(y)
    }

    /// `q * cos + rotate_half(q) * sin` (transformers' `apply_rotary_pos_emb`): keeps only the
    /// shared `cos`/`sin` tables; the result is a new tensor in the input's (dense) layout.
    fn rope_apply(
        &mut self,
        t: ValueId,
        cos: StorageId,
        sin: StorageId,
        concat: bool,
    ) -> Result<ValueId, Error> {
        let tv = self.val(t).clone();
        let mut allocs = Vec::new();
        for what in ["q*cos", "rotate_half", "rotate_half*sin"] {
            allocs.push(self.storage(&tv.shape, tv.dtype, StorageKind::Activation, what)?);
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
        self.push(Step {
            op: "rotary",
            inputs: vec![t],
            outputs: vec![y],
            allocs,
            saves: vec![cos, sin],
            ..self.blank()
        });
        Ok(y)
    }

    /// Scaled-dot-product attention through a fused kernel (flash): saves Q, K and V as passed,
    /// the output, and a float32 log-sum-exp `[B, heads, S]`
    /// (`derivatives.yaml` `_scaled_dot_product_flash_attention(_for_cpu)`). On the CPU the
    /// output is allocated with the query's dimension order (`empty_like`); CUDA's kernels lay it
    /// out `[B, S, heads, head_dim]`.
    fn sdpa_flash(
        &mut self,
        q: ValueId,
        k: ValueId,
        v: ValueId,
        bias: Option<ValueId>,
    ) -> Result<ValueId, Error> {
        let q = self.autocast_input(q)?;
        let k = self.autocast_input(k)?;
        let v = self.autocast_input(v)?;
        let qv = self.val(q).clone();
        let &[b, heads, s, _] = qv.shape.dims() else {
            unreachable!("heads view is rank 4")
        };
        let rg = qv.requires_grad || self.rg(k) || self.rg(v);
        let layout = match (self.s.device, qv.layout) {
            (Device::Cuda, _) => Layout::HeadsTransposed,
            (
                Device::Cpu,
                l @ (Layout::HeadsTransposed | Layout::SeqFirst | Layout::Contiguous),
            ) => l,
            (Device::Cpu, Layout::HeadsStrided) => Layout::HeadsTransposed,
            (Device::Cpu, Layout::LastTwoSwapped | Layout::Strided) => Layout::Contiguous,
        };
        let out_s = self.storage(
            &qv.shape,
            qv.dtype,
            StorageKind::Activation,
            "attention output",
        )?;
        let out = self.value(out_s, qv.shape.clone(), qv.dtype, layout, rg, false);
        let lse = self.storage(
            &Shape::from([b, heads, s]),
            DType::Float32,
            StorageKind::Activation,
            "logsumexp",
        )?;
        let mut saves = vec![qv.storage, self.sid(k), self.sid(v), out_s, lse];
        let mut inputs = vec![q, k, v];
        if let Some(bias) = bias {
            // A float attention mask is kept too.
            saves.push(self.sid(bias));
            inputs.push(bias);
        }
        self.push(Step {
            op: "scaled_dot_product_flash_attention",
            inputs,
            outputs: vec![out],
            allocs: vec![lse],
            saves,
            ..self.blank()
        });
        Ok(out)
    }

    /// Eager attention as transformers writes it: `matmul(q, k^T)` (matmul copies non-contiguous
    /// operands to `[B·heads, S, head_dim]` and `bmm` saves both), scale and mask, softmax (keeps
    /// its output), dropout (keeps its mask or noise), `matmul(p, v)` (saves `p` and `v`).
    fn sdpa_eager(
        &mut self,
        q: ValueId,
        k: ValueId,
        v: ValueId,
        c: &AttnCfg,
        bias: Option<ValueId>,
    ) -> Result<ValueId, Error> {
        let q = self.autocast_input(q)?;
        let k = self.autocast_input(k)?;
        let v = self.autocast_input(v)?;
        let (k, v) = if c.kv_heads < c.heads {
            (self.repeat_kv(k, c.heads)?, self.repeat_kv(v, c.heads)?)
        } else {
            (k, v)
        };
        let qv = self.val(q).clone();
        let &[b, heads, s, hd] = qv.shape.dims() else {
            unreachable!("heads view is rank 4")
        };
        let s_kv = self.val(k).shape.dims()[2];
        let qm = self.contiguous(q)?;
        let km = self.contiguous(k)?;
        let rg = self.rg(qm) || self.rg(km);
        let scores = self.fresh(Shape::from([b, heads, s, s_kv]), qv.dtype, "scores", rg)?;
        let saves = vec![self.sid(qm), self.sid(km)];
        self.push(Step {
            op: "bmm",
            inputs: vec![qm, km],
            outputs: vec![scores],
            saves,
            ..self.blank()
        });
        let scaled = self.unary(scores, "mul", Keep::Nothing, false)?;
        let masked = match bias {
            Some(bias) => self.add(&[scaled, bias], false)?,
            None if c.causal => self.unary(scaled, "add", Keep::Nothing, false)?,
            None => scaled,
        };
        let probs = self.unary(masked, "_softmax", Keep::Output, false)?;
        let probs = self.dropout(probs, c.dropout, false)?;
        let vm = self.contiguous(v)?;
        let rg = self.rg(probs) || self.rg(vm);
        let ctx = self.fresh(Shape::from([b, heads, s, hd]), qv.dtype, "context", rg)?;
        let saves = vec![self.sid(probs), self.sid(vm)];
        self.push(Step {
            op: "bmm",
            inputs: vec![probs, vm],
            outputs: vec![ctx],
            saves,
            ..self.blank()
        });
        Ok(ctx)
    }

    /// A sparse MoE block as transformers 5 runs it with `grouped_mm` experts
    /// (`MixtralSparseMoeBlock`, `integrations/moe.py`). With `T = B·S` tokens and `T·k` routed
    /// rows (routing assumed balanced), it keeps: the router input; the float32 softmax `[T, E]`;
    /// the top-k indices (int64 `[T, k]`); with renormalization the float32 sum `[T, 1]` and a
    /// clone of the top-k weights; the sort permutation, its `// k` and its inverse (int64
    /// `[T·k]` each); the gathered rows `[T·k, H]` and the int32 expert offsets `[E]`; the fused
    /// gate/up output `[T·k, 2I]`, the SiLU output and the gated product `[T·k, I]`; the down
    /// output `[T·k, H]` and the routing weights `[T·k, 1]`. A shared expert is a dense SiLU-gated
    /// MLP on every token, optionally scaled by `sigmoid(x·w_gate)`.
    fn moe(&mut self, x: ValueId, c: &MoeCfg, train: bool) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        let &[b, s, h] = xv.shape.dims() else {
            return Err(self.err(format!(
                "input {} has rank {}, expected [batch, seq, hidden]",
                xv.shape,
                xv.shape.rank()
            )));
        };
        let a = xv.dtype;
        let t = checked(b.checked_mul(s), "the token count")?;
        let tk = checked(t.checked_mul(c.top_k), "the routed row count")?;
        // Router.
        let logits = self.projection(x, h, c.experts, false, train, "gate")?;
        let lf = self.upcast_f32(logits)?;
        let probs = self.unary(lf, "_softmax", Keep::Output, false)?;
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
        self.push(Step {
            op: "topk",
            inputs: vec![probs],
            outputs: vec![topv],
            allocs: vec![idx],
            saves: vec![idx],
            ..self.blank()
        });
        let weights = if c.normalize {
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
            self.push(Step {
                op: "div_",
                inputs: vec![topv],
                outputs: vec![y],
                allocs: vec![sum, clone],
                saves: vec![sum, clone],
                ..self.blank()
            });
            y
        } else {
            topv
        };
        let w_act = if a == DType::Float32 {
            weights
        } else {
            let y = self.fresh(
                Shape::from([t, c.top_k]),
                a,
                "routing weights",
                self.rg(weights),
            )?;
            self.push(Step {
                op: "_to_copy",
                inputs: vec![weights],
                outputs: vec![y],
                ..self.blank()
            });
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
        let gathered = self.fresh(Shape::from([tk, h]), a, "gathered tokens", xv.requires_grad)?;
        self.push(Step {
            op: "index",
            inputs: vec![x],
            outputs: vec![gathered],
            allocs: vec![index[0], index[1], index[2], offsets],
            saves: vec![index[0], index[1], index[2], offsets],
            ..self.blank()
        });
        let ws = self.fresh(
            Shape::from([tk, 1]),
            a,
            "sorted routing weights",
            self.rg(w_act),
        )?;
        self.push(Step {
            op: "index",
            inputs: vec![w_act],
            outputs: vec![ws],
            ..self.blank()
        });
        // Experts: grouped_mm with [E, 2I, H] and [E, H, I] weights.
        let w_gu = self.weight(Shape::from([c.experts, 2 * c.inter, h]), train, true)?;
        let w_down = self.weight(Shape::from([c.experts, h, c.inter]), train, true)?;
        let gu = self.grouped_mm(gathered, w_gu, Shape::from([tk, 2 * c.inter]), offsets)?;
        let gate = self.view_of(gu, Shape::from([tk, c.inter]), Layout::Strided);
        let up = self.view_of(gu, Shape::from([tk, c.inter]), Layout::Strided);
        self.push(Step {
            op: "chunk",
            inputs: vec![gu],
            outputs: vec![gate, up],
            ..self.blank()
        });
        let act = self.unary(gate, "silu", Keep::Input, false)?;
        let prod = self.mul(act, up)?;
        let down = self.grouped_mm(prod, w_down, Shape::from([tk, h]), offsets)?;
        let weighted = self.mul(down, ws)?;
        let scattered = self.fresh(Shape::from([tk, h]), a, "unsorted rows", self.rg(weighted))?;
        self.push(Step {
            op: "index",
            inputs: vec![weighted],
            outputs: vec![scattered],
            saves: vec![index[2]],
            ..self.blank()
        });
        let rg = self.rg(scattered);
        let out = self.fresh(xv.shape.clone(), a, "output", rg)?;
        self.push(Step {
            op: "sum",
            inputs: vec![scattered],
            outputs: vec![out],
            ..self.blank()
        });
        if c.shared == 0 {
            return Ok(out);
        }
        // Shared expert (Qwen-MoE).
        let g = self.projection(x, h, c.shared, false, train, "shared_expert.gate_proj")?;
        let g = self.unary(g, "silu", Keep::Input, false)?;
        let u = self.projection(x, h, c.shared, false, train, "shared_expert.up_proj")?;
        let p = self.mul(g, u)?;
        let mut shared =
            self.projection(p, c.shared, h, false, train, "shared_expert.down_proj")?;
        if c.shared_gate {
            let sg = self.projection(x, h, 1, false, train, "shared_expert_gate")?;
            let sg = self.unary(sg, "sigmoid", Keep::Output, false)?;
            shared = self.mul(sg, shared)?;
        }
        self.add(&[out, shared], false)
    }

    /// `torch._grouped_mm(rows, weights, offs)`: keeps its input rows and the offsets (and the
    /// weights, which are parameters).
    fn grouped_mm(
        &mut self,
        rows: ValueId,
        w: ValueId,
        out_shape: Shape,
        offsets: StorageId,
    ) -> Result<ValueId, Error> {
        let rows = self.autocast_input(rows)?;
        let wc = self.autocast_input(w)?;
        let rv = self.val(rows).clone();
        let rg = rv.requires_grad || self.rg(wc);
        let y = self.fresh(out_shape, rv.dtype, "output", rg)?;
        let mut saves = vec![offsets];
        if self.rg(wc) {
            saves.push(rv.storage);
        }
        if rv.requires_grad {
            saves.push(self.sid(wc));
        }
        let mut allocs = Vec::new();
        if self.quantized.contains(&w) {
            let ws = self.val(w).shape.clone();
            allocs.push(self.storage(
                &ws,
                rv.dtype,
                StorageKind::Activation,
                "dequantized weight",
            )?);
        }
        self.push(Step {
            op: "_grouped_mm",
            inputs: vec![rows, wc],
            outputs: vec![y],
            allocs,
            saves,
            ..self.blank()
        });
        Ok(y)
    }

    /// transformers' `repeat_kv`: `expand` then `reshape`, a copy at full head count.
    fn repeat_kv(&mut self, t: ValueId, heads: u64) -> Result<ValueId, Error> {
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
        self.push(Step {
            op: "repeat_kv",
            inputs: vec![t],
            outputs: vec![y],
            ..self.blank()
        });
        Ok(y)
    }

    /// Cross-entropy: `log_softmax` keeps its result, `nll_loss` keeps the labels
    /// (`derivatives.yaml` `_log_softmax`, `nll_loss_forward`).
    fn cross_entropy(&mut self, x: ValueId, shift: bool, upcast: bool) -> Result<ValueId, Error> {
        let xv = self.val(x).clone();
        if xv.shape.rank() < 2 || !xv.dtype.is_float() {
            return Err(self.err(format!(
                "input {} {} is not float logits [batch, classes] or [batch, seq, vocab]",
                xv.dtype, xv.shape
            )));
        }
        if shift && xv.shape.rank() != 3 {
            return Err(self.err(format!(
                "`shift` needs logits [batch, seq, vocab], got {}",
                xv.shape
            )));
        }
        self.tape.held.push(xv.storage);
        self.tape.has_loss = true;
        if !self.training() {
            return Ok(x);
        }
        let dims = xv.shape.dims();
        let label_shape = Shape::new(dims[..dims.len() - 1].to_vec());
        let labels = self.storage(&label_shape, DType::Int64, StorageKind::Input, "labels")?;
        let target = if shift {
            // transformers' ForCausalLMLoss pads and shifts the labels: a new int64 tensor.
            self.storage(
                &label_shape,
                DType::Int64,
                StorageKind::Activation,
                "shifted labels",
            )?
        } else {
            labels
        };
        let xin = if upcast || self.s.amp.is_some() {
            self.upcast_f32(x)?
        } else {
            x
        };
        let inv = self.val(xin).clone();
        let lp = self.fresh(
            inv.shape.clone(),
            inv.dtype,
            "log-probabilities",
            inv.requires_grad,
        )?;
        let saves = vec![self.sid(lp)];
        self.push(Step {
            op: "_log_softmax",
            inputs: vec![xin],
            outputs: vec![lp],
            saves,
            ..self.blank()
        });
        let loss = self.fresh(Shape::default(), inv.dtype, "loss", inv.requires_grad)?;
        // nll_loss_forward also returns `total_weight`, a float32 scalar its backward keeps.
        let total_weight = self.storage(
            &Shape::default(),
            DType::Float32,
            StorageKind::Activation,
            "total_weight",
        )?;
        let mut step = Step {
            op: "nll_loss",
            inputs: vec![lp],
            outputs: vec![loss],
            allocs: vec![total_weight],
            saves: vec![target, total_weight],
            ..self.blank()
        };
        if target != labels {
            step.allocs.push(target);
        }
        self.push(step);
        self.tape.held.push(self.sid(loss));
        Ok(loss)
    }
}

#[derive(Clone, Copy)]
enum Keep {
    Nothing,
    Input,
    Output,
    InputClone,
}

struct MoeCfg {
    experts: u64,
    top_k: u64,
    inter: u64,
    shared: u64,
    shared_gate: bool,
    normalize: bool,
}

struct AttnCfg {
    qk_norm: bool,
    position_bias: bool,
    sliding_window: Option<u64>,
    style: AttnStyle,
    kv_cache: bool,
    heads: u64,
    kv_heads: u64,
    head_dim: Option<u64>,
    causal: bool,
    bias: bool,
    out_bias: bool,
    fused_qkv: bool,
    rotary: bool,
    dropout: f64,
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

/// Type promotion of two float dtypes (the wider wins).
fn promote(a: DType, b: DType) -> DType {
    if a == b {
        a
    } else if a.is_float() && b.is_float() {
        if a.bits() >= b.bits() { a } else { b }
    } else if a.is_float() {
        a
    } else {
        b
    }
}

/// Bytes of a quantized `[out, in]` weight with its metadata:
/// - NF4 (bitsandbytes `Params4bit`, blocksize 64): `ceil(n/2)` + a float32 absmax per 64
///   weights, or with double quantization an int8 absmax per 64 plus a float32 scale per 256
///   blocks;
/// - int8 (LLM.int8()): `n` + a float32 scale per output row;
/// - int4 (GPTQ/AWQ): `ceil(n/2)` + per group of `group_size` input weights a float16 scale and a
///   packed 4-bit zero point;
/// - fp8: `n` + one float32 scale.
fn quantized_bytes(q: Quant, shape: &Shape) -> Option<u64> {
    let n = shape.numel()?;
    let rows = shape.dims().first().copied().unwrap_or(1);
    let cols = shape.dims().get(1).copied().unwrap_or(1);
    match q {
        Quant::Nf4 { double_quant } => {
            let blocks = n.div_ceil(64);
            let meta = if double_quant {
                blocks.checked_add(blocks.div_ceil(256).checked_mul(4)?)?
            } else {
                blocks.checked_mul(4)?
            };
            n.div_ceil(2).checked_add(meta)
        }
        Quant::Int8 => n.checked_add(rows.checked_mul(4)?),
        Quant::Int4 { group_size } => {
            let groups = rows.checked_mul(cols.div_ceil(group_size.max(1)))?;
            n.div_ceil(2)
                .checked_add(groups.checked_mul(2)?)?
                .checked_add(groups.div_ceil(2))
        }
        Quant::Fp8 => n.checked_add(4),
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
}
