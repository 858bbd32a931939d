//! The replay on small hand-built tapes (3–6 steps), each with its exact peak and phase. Sizes
//! are float32 unless stated: `[n]` is `4n` bytes. Each step is its own layer (`L1`, `L2`, …), so
//! the peak's layer names its step.

use super::liveness::{Liveness, SavedBytes};
use super::replay::Replay;
use super::{Category, Phase};
use crate::cost::{Optimizer, OptimizerImpl, OptimizerPlan, RecipeName, TensorInfo};
use crate::dtype::DType;
use crate::shape::Shape;
use crate::trace::{
    AtenOp, LayerId, LayerInfo, Layout, Segment, SegmentId, Step, Storage, StorageId, StorageKind,
    Tape, Value, ValueId,
};

#[test]
fn category_index_is_its_position_in_all() {
    for (i, c) in Category::ALL.iter().enumerate() {
        assert_eq!(c.index(), i, "{c:?}");
    }
}

/// A tape written by hand.
struct Builder {
    tape: Tape,
}

/// One step: operator, inputs, outputs, what it saves (values), which inputs get a gradient.
struct S<'a> {
    op: AtenOp,
    inputs: &'a [ValueId],
    outputs: &'a [ValueId],
    saves: &'a [ValueId],
    grads: &'a [ValueId],
}

impl Builder {
    fn new() -> Builder {
        let mut tape = Tape::default();
        tape.layers.push(layer("<input>"));
        Builder { tape }
    }

    /// A new storage of `numel` elements of `dtype`, and its value.
    fn tensor(&mut self, kind: StorageKind, dtype: DType, numel: u64, rg: bool) -> ValueId {
        let shape = Shape::new(vec![numel]);
        let storage = self.tape.storages.push_and_get_key(Storage {
            bytes: dtype.bytes_for(numel).unwrap(),
            kind,
            what: "t",
            dtype,
            shape: shape.clone(),
            layer: LayerId::default(),
        });
        self.tape.values.push_and_get_key(Value {
            storage,
            shape,
            dtype,
            layout: Layout::Contiguous,
            requires_grad: rg,
            param: kind == StorageKind::Parameter,
        })
    }

    fn f32(&mut self, kind: StorageKind, numel: u64, rg: bool) -> ValueId {
        self.tensor(kind, DType::Float32, numel, rg)
    }

    /// A view of `v`'s storage.
    fn view(&mut self, v: ValueId) -> ValueId {
        let mut val = self.tape.values[v].clone();
        val.param = false;
        self.tape.values.push_and_get_key(val)
    }

    fn sid(&self, v: ValueId) -> StorageId {
        self.tape.values[v].storage
    }

    /// Appends a step in its own layer; it allocates the storages of its outputs that are not
    /// its inputs' (as the tracer records it).
    fn step(&mut self, s: &S<'_>, view_grad: bool, segment: Option<SegmentId>) -> usize {
        let layer = self
            .tape
            .layers
            .push_and_get_key(layer(&format!("L{}", self.tape.layers.len())));
        let ins: Vec<StorageId> = s.inputs.iter().map(|&v| self.sid(v)).collect();
        let mut allocs: Vec<StorageId> = Vec::new();
        for &o in s.outputs {
            let st = self.sid(o);
            if !ins.contains(&st) && !allocs.contains(&st) {
                allocs.push(st);
            }
        }
        self.tape.steps.push(Step {
            layer,
            op: s.op,
            inputs: s.inputs.iter().copied().collect(),
            outputs: s.outputs.iter().copied().collect(),
            allocs: allocs.into(),
            saves: s.saves.iter().map(|&v| self.sid(v)).collect(),
            grads: s.grads.iter().copied().collect(),
            view_grad,
            segment,
            scratch: Default::default(),
            reduced: Default::default(),
        });
        self.tape.steps.len() - 1
    }

    /// A step outside any segment with no view gradient: `op` reads `ins` and writes `outs`,
    /// keeps `saves` and gives `grads` a gradient.
    fn op(
        &mut self,
        op: AtenOp,
        (ins, outs): (&[ValueId], &[ValueId]),
        saves: &[ValueId],
        grads: &[ValueId],
    ) -> usize {
        let s = S {
            op,
            inputs: ins,
            outputs: outs,
            saves,
            grads,
        };
        self.step(&s, false, None)
    }

    /// `a = x·w`, keeping `x` for `w`'s gradient: the first step of every tape here.
    fn mul(&mut self, x: ValueId, w: ValueId, a: ValueId) {
        self.op(AtenOp::Mul, (&[x, w], &[a]), &[x], &[w]);
    }

    /// `out.sum()` as the loss, held to the end of the step; its backward hands a view of a
    /// scalar to `out` (no allocation).
    fn loss(&mut self, out: ValueId) {
        let loss = self.f32(StorageKind::Activation, 1, true);
        self.step(
            &S {
                op: AtenOp::Sum,
                inputs: &[out],
                outputs: &[loss],
                saves: &[],
                grads: &[out],
            },
            true,
            None,
        );
        let held = self.sid(loss);
        self.tape.held.push(held);
    }
}

fn layer(name: &str) -> LayerInfo {
    LayerInfo {
        path: name.into(),
        name_start: 0,
        kind: None,
        repeat: 1,
        output_shape: Shape::default(),
        params: 0,
        parameter_bytes: 0,
        buffer_bytes: 0,
    }
}

/// The replay's outcome: peak, phase, layer (`L<n>`), bytes per category at the peak.
struct Outcome {
    peak: u64,
    phase: Phase,
    layer: Option<String>,
    at_peak: [u64; Category::COUNT],
    max: [u64; Category::COUNT],
    optimizer_temp: u64,
}

impl Outcome {
    fn at(&self, c: Category) -> u64 {
        self.at_peak[c.index()]
    }
}

/// A training step of `tape` with `plan`'s optimizer figures.
fn train(tape: &Tape, plan: &OptimizerPlan<ValueId>) -> Outcome {
    let facts = Liveness::of(tape);
    let mut r = Replay::new(tape, &facts);
    r.start(plan.state_bytes, plan.master_bytes);
    r.forward(true);
    let bwd = r.backward(None, None, None);
    let optimizer_temp = r.optimizer_step(plan, &bwd);
    assert!(r.error().is_none());
    Outcome {
        peak: r.peak,
        phase: r.peak_phase,
        layer: r.peak_layer.map(|l| tape.layers[l].name().to_string()),
        at_peak: r.at_peak,
        max: r.max,
        optimizer_temp,
    }
}

use StorageKind::{Activation as Act, Input, Parameter};

/// `a = x·w`, `b = a.view(..)`, `c = relu(b)` (keeps `c`), `loss = c.sum()`. In backward, the
/// view hands `b`'s gradient to `a` as it is: no second `[100]` gradient.
///
/// Live: `x` 400 + `w` [200] 800. Forward: `a` 400, `c` 400 (peak 2,000 in L3; `a` freed).
/// Backward: L3 allocates `grad b` 400 (2,004 with the loss) and frees `c`; L2 moves it to `a`;
/// L1 adds `grad w` 800 to it: 400 + 800 + 4 + 400 + 800 = **2,404** in L1.
#[test]
fn view_gradient_is_handed_off() {
    let mut t = Builder::new();
    let x = t.f32(Input, 100, false);
    let w = t.f32(Parameter, 200, true);
    let a = t.f32(Act, 100, true);
    t.mul(x, w, a);
    let b = t.view(a);
    let view = S {
        op: AtenOp::View,
        inputs: &[a],
        outputs: &[b],
        saves: &[],
        grads: &[a],
    };
    t.step(&view, true, None);
    let c = t.f32(Act, 100, true);
    t.op(AtenOp::Relu, (&[b], &[c]), &[c], &[b]);
    t.loss(c);
    let o = train(&t.tape, &OptimizerPlan::default());
    assert_eq!(o.peak, 2_404);
    assert_eq!(o.phase, Phase::Backward);
    assert_eq!(o.layer.as_deref(), Some("L1"));
    assert_eq!(o.at(Category::Temporaries), 400, "one gradient for a and b");
    assert_eq!(o.at(Category::Gradients), 800);
    assert_eq!(o.at(Category::Activations), 4, "the loss; c freed in L3");
    assert_eq!(o.max[Category::Activations.index()], 404, "c and the loss");
}

/// `a = x·w` read by two operators (`b = f(a)` [100], `c = g(a)` [50], each keeping `a`), then
/// `d = b + c`. In backward `g` allocates `grad a`; `f`'s contribution is a transient added into
/// it: x 400 + w 400 + a 400 + loss 4 + grad b 400 + grad a 400 + transient 400 = **2,404** in
/// L2 (without the accumulation the peak would be 2,204 in L3).
#[test]
fn gradient_accumulates_into_an_input_used_twice() {
    let mut t = Builder::new();
    let x = t.f32(Input, 100, false);
    let w = t.f32(Parameter, 100, true);
    let a = t.f32(Act, 100, true);
    let (b, c, d) = (
        t.f32(Act, 100, true),
        t.f32(Act, 50, true),
        t.f32(Act, 100, true),
    );
    t.mul(x, w, a);
    t.op(AtenOp::Gelu, (&[a], &[b]), &[a], &[a]);
    t.op(AtenOp::Silu, (&[a], &[c]), &[a], &[a]);
    t.op(AtenOp::Add, (&[b, c], &[d]), &[], &[b, c]);
    t.loss(d);
    let o = train(&t.tape, &OptimizerPlan::default());
    assert_eq!(o.peak, 2_404);
    assert_eq!(o.phase, Phase::Backward);
    assert_eq!(o.layer.as_deref(), Some("L2"));
    assert_eq!(o.at(Category::Temporaries), 1_200);
    assert_eq!(o.at(Category::Activations), 404, "a and the loss");
    assert_eq!(o.max[Category::Temporaries.index()], 1_200);
}

/// A backward that passes its gradient on to two inputs (`add`, `cat`: `view_grad` with two
/// inputs) hands both a view of one tensor, which lives until the second is consumed; neither
/// input gets a copy. `a = x·w1`, `b = gelu(a)`, `z = x·w2`, `c = silu(z)` (each keeps its
/// input), `d = b + c`, `e = gelu(d)`, `loss = e.sum()`, every tensor `[100]`.
///
/// Forward peaks in L5 with x, w1, w2 1,200 + a, b, z, c, d 2,000 = **3,200**. In backward,
/// L6 makes `grad d` (400); L5 shares it with `b` and `c`; L4 adds `grad z`: the activation
/// gradients peak at 800 (a copy for `c` would make them 1,200 and the step's peak 3,204 in
/// L4's backward).
#[test]
fn a_gradient_passed_to_two_inputs_is_one_tensor() {
    let mut t = Builder::new();
    let x = t.f32(Input, 100, false);
    let (w1, w2) = (t.f32(Parameter, 100, true), t.f32(Parameter, 100, true));
    let [a, b, z, c, d, e] = [(); 6].map(|()| t.f32(Act, 100, true));
    t.mul(x, w1, a);
    t.op(AtenOp::Gelu, (&[a], &[b]), &[a], &[a]);
    t.mul(x, w2, z);
    t.op(AtenOp::Silu, (&[z], &[c]), &[z], &[z]);
    let add = S {
        op: AtenOp::Add,
        inputs: &[b, c],
        outputs: &[d],
        saves: &[],
        grads: &[b, c],
    };
    t.step(&add, true, None);
    t.op(AtenOp::Gelu, (&[d], &[e]), &[d], &[d]);
    t.loss(e);
    let o = train(&t.tape, &OptimizerPlan::default());
    assert_eq!(o.peak, 3_200);
    assert_eq!(o.phase, Phase::Forward);
    assert_eq!(o.layer.as_deref(), Some("L5"));
    assert_eq!(
        o.max[Category::Temporaries.index()],
        800,
        "grad d shared, grad z"
    );
}

/// `add`'s backward hands the output's gradient to an input of the output's shape; a broadcast
/// input gets the engine's `sum_to` of it, a block of its own shape ([`Step::reduced`]), even when
/// it comes first in the backward's order (`other` before `self`). `z = y·v` [10],
/// `a = x·w` [100], `b = gelu(a)`, `d = b + z` (broadcast), `e = gelu(d)`, `loss = e.sum()`.
///
/// L5 makes `grad d` (400); L4 hands it to `b` and makes `grad z` (40); L3 makes `grad a`
/// (400) beside them: the activation gradients peak at **840** B (with `z` taking the 400-B
/// block and `b` a view of it, 800).
#[test]
fn a_broadcast_input_of_add_gets_its_reduced_gradient() {
    let mut t = Builder::new();
    let (x, y) = (t.f32(Input, 100, false), t.f32(Input, 10, false));
    let (w, v) = (t.f32(Parameter, 100, true), t.f32(Parameter, 10, true));
    let z = t.f32(Act, 10, true);
    let [a, b, d, e] = [(); 4].map(|()| t.f32(Act, 100, true));
    t.mul(y, v, z);
    t.mul(x, w, a);
    t.op(AtenOp::Gelu, (&[a], &[b]), &[a], &[a]);
    let add = S {
        op: AtenOp::Add,
        inputs: &[b, z],
        outputs: &[d],
        saves: &[],
        grads: &[z, b],
    };
    let at = t.step(&add, true, None);
    t.tape.steps[at].reduced.push((z, 0));
    t.op(AtenOp::Gelu, (&[d], &[e]), &[d], &[d]);
    t.loss(e);
    let o = train(&t.tape, &OptimizerPlan::default());
    assert_eq!(
        o.max[Category::Temporaries.index()],
        840,
        "grad d for b, grad z, grad a"
    );
}

/// Non-reentrant checkpointing stops recomputing at the block's last operator that saves
/// something (`torch.utils.checkpoint`'s early stop, `_StopRecomputationError`): a block
/// `b = gelu(a)` [150] (keeps `a`), `c = b + b` [1,000] (keeps nothing) recomputes `b` alone.
/// Forward peaks at L3 with `b` and `c` live: x 400 + w 400 + a 400 + b 600 + c 4,000 =
/// **5,800**; recomputing `c` too would have made backward's 5,804 (with the loss) the peak.
#[test]
fn recomputation_stops_at_the_last_saving_operator() {
    let mut t = Builder::new();
    let x = t.f32(Input, 100, false);
    let w = t.f32(Parameter, 100, true);
    let (a, b, c) = (
        t.f32(Act, 100, true),
        t.f32(Act, 150, true),
        t.f32(Act, 1_000, true),
    );
    t.mul(x, w, a);
    let seg = t.tape.segments.push_and_get_key(Segment {
        start: 1,
        end: 3,
        input: t.sid(a),
    });
    for s in [
        S {
            op: AtenOp::Gelu,
            inputs: &[a],
            outputs: &[b],
            saves: &[a],
            grads: &[a],
        },
        S {
            op: AtenOp::Add,
            inputs: &[b, b],
            outputs: &[c],
            saves: &[],
            grads: &[b],
        },
    ] {
        t.step(&s, false, Some(seg));
    }
    t.loss(c);
    let o = train(&t.tape, &OptimizerPlan::default());
    assert_eq!(o.peak, 5_800);
    assert_eq!(o.phase, Phase::Forward);
    assert_eq!(o.layer.as_deref(), Some("L3"));
}

/// A checkpointed block `b = f(a)` [150] (keeps `a`), `c = g(b)` [50] (keeps `b`), then the
/// frame's `return`. Forward keeps only the block input `a`: peak 2,000 (a, b, c live in L3).
/// Backward recomputes the block (b kept, c dropped after it), then L3 allocates `grad b` 600
/// with `b` still kept: x 400 + w 400 + a 400 + b 600 + loss 4 + 600 = **2,404** in L3.
#[test]
fn checkpointed_segment_keeps_its_input_and_recomputes() {
    let mut t = Builder::new();
    let x = t.f32(Input, 100, false);
    let w = t.f32(Parameter, 100, true);
    let (a, b, c) = (
        t.f32(Act, 100, true),
        t.f32(Act, 150, true),
        t.f32(Act, 50, true),
    );
    t.mul(x, w, a);
    let seg = t.tape.segments.push_and_get_key(Segment {
        start: 1,
        end: 4,
        input: t.sid(a),
    });
    for s in [
        S {
            op: AtenOp::Gelu,
            inputs: &[a],
            outputs: &[b],
            saves: &[a],
            grads: &[a],
        },
        S {
            op: AtenOp::Gelu,
            inputs: &[b],
            outputs: &[c],
            saves: &[b],
            grads: &[b],
        },
        S {
            op: AtenOp::Return,
            inputs: &[a],
            outputs: &[],
            saves: &[],
            grads: &[],
        },
    ] {
        t.step(&s, false, Some(seg));
    }
    t.loss(c);
    let facts = Liveness::of(&t.tape);
    assert_eq!(facts.seg_inputs[seg], vec![t.sid(a)]);
    assert_eq!(
        SavedBytes::of(&t.tape, &facts).total,
        400,
        "only the block input (x is the input batch)"
    );
    let o = train(&t.tape, &OptimizerPlan::default());
    assert_eq!(o.peak, 2_404);
    assert_eq!(o.phase, Phase::Backward);
    assert_eq!(o.layer.as_deref(), Some("L3"));
    assert_eq!(
        o.at(Category::Activations),
        1_004,
        "a, recomputed b, the loss"
    );
    assert_eq!(o.at(Category::Temporaries), 600, "grad b");
    assert_eq!(o.max[Category::Activations.index()], 1_004);
}

/// A bfloat16 model under `mixed-bf16` with fused SGD with momentum: `w` [100] bf16 (200 B)
/// with a float32 master copy (400 B) and a float32 momentum buffer (400 B); fused, the step has
/// no temporaries. At the optimizer step the 16-bit gradient (200 B) is replaced by a float32
/// copy (400 B): x 200 + w 200 + state 400 + master 400 + loss 2 + copy 400 = **1,602** in the
/// optimizer step (backward ends at 1,402 with the 16-bit gradient).
#[test]
fn master_gradient_copies_replace_16_bit_gradients() {
    let mut t = Builder::new();
    let x = t.tensor(Input, DType::Bfloat16, 100, false);
    let w = t.tensor(Parameter, DType::Bfloat16, 100, true);
    let a = t.tensor(Act, DType::Bfloat16, 100, true);
    t.mul(x, w, a);
    let loss = t.tensor(Act, DType::Bfloat16, 1, true);
    let sum = S {
        op: AtenOp::Sum,
        inputs: &[a],
        outputs: &[loss],
        saves: &[],
        grads: &[a],
    };
    t.step(&sum, true, None);
    let held = t.sid(loss);
    t.tape.held.push(held);
    let w_info = TensorInfo {
        shape: &[100],
        numel: 100,
        bytes: 200,
    };
    let plan = OptimizerPlan::new(
        Optimizer::SgdMomentum,
        OptimizerImpl::Fused,
        &RecipeName::MixedBf16.recipe(),
        [(w, w_info, DType::Bfloat16)],
    );
    assert_eq!(
        (plan.state_bytes, plan.master_bytes, plan.temp_bytes),
        (400, 400, 0)
    );
    let o = train(&t.tape, &plan);
    assert_eq!(o.peak, 1_602);
    assert_eq!(o.phase, Phase::OptimizerStep);
    assert_eq!(o.layer, None);
    assert_eq!(
        o.at(Category::Gradients),
        0,
        "the bf16 gradient was replaced"
    );
    assert_eq!(o.at(Category::Temporaries), 400);
    assert_eq!(o.at(Category::MasterWeights), 400);
    assert_eq!(o.at(Category::OptimizerState), 400);
    assert_eq!(o.optimizer_temp, 400);
    assert_eq!(o.max[Category::Gradients.index()], 200);
}

/// `a = x·w`, then `relu_(a)` writes into `a` and keeps its result (`a` itself): no new
/// storage. x 400 + w [10] 40 + a 400 + loss 4 + grad a 400 = **1,244** in L2 (a separate
/// output would add 400).
#[test]
fn in_place_op_allocates_nothing() {
    let mut t = Builder::new();
    let x = t.f32(Input, 100, false);
    let w = t.f32(Parameter, 10, true);
    let a = t.f32(Act, 100, true);
    t.mul(x, w, a);
    let b = t.view(a);
    let i = t.op(AtenOp::ReluInplace, (&[a], &[b]), &[b], &[a]);
    assert!(t.tape.steps[i].allocs.is_empty());
    t.loss(b);
    let o = train(&t.tape, &OptimizerPlan::default());
    assert_eq!(o.peak, 1_244);
    assert_eq!(o.phase, Phase::Backward);
    assert_eq!(o.layer.as_deref(), Some("L2"));
    assert_eq!(o.at(Category::Activations), 404);
    assert_eq!(o.max[Category::Activations.index()], 404);
}
