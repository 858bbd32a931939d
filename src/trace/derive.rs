//! A tape at another micro-batch, derived from two traces rather than traced again.
//!
//! The micro-batch enters a trace only as the input batch's first dimension; every shape after
//! it is computed from shapes, so a dimension that carries the batch is normally the batch
//! times a factor that does not depend on it (the batch itself, `B·S` after a flatten, `B·heads`
//! in a batched matmul), and the operators, their order and what they save are the same at
//! every batch. [`at_batch`] checks exactly that on two traces at batches `b0 < b1`: everything
//! but the shapes and the sizes derived from them must be equal, and each dimension (and each
//! scratch size) must either be the same in both or be `k · b0` in the first and `k · b1` in the
//! second, for one whole `k`; then the tape at batch `b` is the first one with those dimensions
//! set to `k · b` and each storage's bytes recomputed from its shape, as the tracer computes
//! them. Sizes that are not of that form (a dimension added to the batch, a kernel chosen by
//! size, a staircase) fail the check, or are kept out by the caller ([`crate::search`] derives
//! only without a parallel plan, which is where an expert capacity factor lives). Two traces
//! cannot rule out every staircase, but a second batch far from the first rules out the usual
//! ones: a size rounded up to a multiple (`ceil(B·x / P)·P`: pages, padding; an expert
//! capacity `ceil(B·x)` with `x = p/q`) is proportional between batches 1 and `W` only when it
//! is proportional at every batch, for any `P` or `q` up to `W`; [`crate::search`] traces its
//! second batch at [`crate::search::WITNESS_BATCH`]. `tests/it/search.rs` compares derived
//! tapes with fresh traces over the bundled examples and Hugging Face configs.

use super::tape::{
    BlockCopies, LayerInfo, Param, RareList, Segment, Step, Storage, StorageId, Tape, Value,
    ValueId,
};
use crate::shape::Shape;

/// Why [`at_batch`] gives no tape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotDerived {
    /// The two traces differ other than by batch-proportional sizes: the batch must be traced.
    NotProportional,
    /// A size at the batch asked for (a dimension, a storage's element count or bytes, a
    /// scratch size) is [`LARGE`] or more: near 64 bits, where the tracer's own overflow checks
    /// decide whether the batch can be traced, the batch must be traced.
    Large,
}

/// The smallest size [`at_batch`] does not derive (2^48, 256 TiB as bytes).
pub const LARGE: u64 = 1 << 48;

/// How one size depends on the batch: the same at every batch, or `k` per sample.
#[derive(Clone, Copy)]
enum Size {
    Fixed(u64),
    PerSample(u64),
}

impl Size {
    /// The size given at `b0` (`x0`) and at `b1` (`x1`), `b0 < b1`.
    fn of(x0: u64, x1: u64, (b0, b1): (u64, u64)) -> Result<Size, NotDerived> {
        if x0 == x1 {
            return Ok(Size::Fixed(x0));
        }
        let k = x0 / b0;
        if x0.is_multiple_of(b0) && k.checked_mul(b1) == Some(x1) {
            Ok(Size::PerSample(k))
        } else {
            Err(NotDerived::NotProportional)
        }
    }

    fn at(self, b: u64) -> Result<u64, NotDerived> {
        match self {
            Size::Fixed(x) => Ok(x),
            Size::PerSample(k) => small(k.checked_mul(b)),
        }
    }
}

/// `x` when it is below [`LARGE`].
fn small(x: Option<u64>) -> Result<u64, NotDerived> {
    x.filter(|&x| x < LARGE).ok_or(NotDerived::Large)
}

/// The context of one derivation: the two batches traced and the one asked for.
#[derive(Clone, Copy)]
struct Batches {
    traced: (u64, u64),
    at: u64,
}

impl Batches {
    fn size(self, x0: u64, x1: u64) -> Result<u64, NotDerived> {
        Size::of(x0, x1, self.traced)?.at(self.at)
    }

    fn shape(self, s0: &Shape, s1: &Shape) -> Result<Shape, NotDerived> {
        let (d0, d1) = (s0.dims(), s1.dims());
        if d0.len() != d1.len() {
            return Err(NotDerived::NotProportional);
        }
        let dims = d0
            .iter()
            .zip(d1)
            .map(|(&x0, &x1)| self.size(x0, x1))
            .collect::<Result<Vec<u64>, NotDerived>>()?;
        Ok(Shape::new(dims))
    }
}

fn same<T: PartialEq>(a: &T, b: &T) -> Result<(), NotDerived> {
    if a == b {
        Ok(())
    } else {
        Err(NotDerived::NotProportional)
    }
}

/// The tape at micro-batch `at`, from `t0` traced at batch `b0` and `t1` traced at batch `b1`
/// (`0 < b0 < b1`) with the same model and settings but for the batch: `t0` with every
/// batch-proportional size evaluated at `at` (see the module's documentation for the check).
///
/// # Errors
/// [`NotDerived::NotProportional`] when the traces differ otherwise, [`NotDerived::Large`]
/// when a size at `at` is [`LARGE`] or more: trace at `at` instead.
pub fn at_batch(
    (b0, t0): (u64, &Tape),
    (b1, t1): (u64, &Tape),
    at: u64,
) -> Result<Tape, NotDerived> {
    if b0 == 0 || b1 <= b0 || at == 0 {
        return Err(NotDerived::NotProportional);
    }
    let x = Batches {
        traced: (b0, b1),
        at,
    };
    // Every field is named, so that a field added to the tape must be placed here.
    let Tape {
        storages,
        values,
        params,
        steps,
        layers,
        held,
        forward_held,
        segments,
        blocks,
        input_shape,
        has_loss,
        repeats,
        grad_shapes,
        tp_split,
    } = t1;
    same(&t0.held, held)?;
    same(&t0.forward_held, forward_held)?;
    same(&t0.blocks, blocks)?;
    same(&t0.has_loss, has_loss)?;
    same(&t0.grad_shapes, grad_shapes)?;
    same(&t0.tp_split, tp_split)?;
    if t0.storages.len() != storages.len()
        || t0.values.len() != values.len()
        || t0.params.len() != params.len()
        || t0.steps.len() != steps.len()
        || t0.layers.len() != layers.len()
        || t0.segments.len() != segments.len()
        || t0.repeats.len() != repeats.len()
    {
        return Err(NotDerived::NotProportional);
    }
    for (a, b) in t0.params.iter().zip(params) {
        param_same(a, b)?;
    }
    for (a, b) in t0.segments.iter().zip(segments.iter()) {
        segment_same(a, b)?;
    }
    for (a, b) in t0.repeats.iter().zip(repeats) {
        copies_same(a, b)?;
    }
    let storages = t0
        .storages
        .iter()
        .zip(storages.iter())
        .map(|(a, b)| storage_at(a, b, x))
        .collect::<Result<_, _>>()?;
    let values = t0
        .values
        .iter()
        .zip(values.iter())
        .map(|(a, b)| value_at(a, b, x))
        .collect::<Result<_, _>>()?;
    let steps = t0
        .steps
        .iter()
        .zip(steps)
        .map(|(a, b)| step_at(a, b, x))
        .collect::<Result<_, _>>()?;
    let layers = t0
        .layers
        .iter()
        .zip(layers.iter())
        .map(|(a, b)| layer_at(a, b, x))
        .collect::<Result<_, _>>()?;
    Ok(Tape {
        storages,
        values,
        params: t0.params.clone(),
        steps,
        layers,
        held: t0.held.clone(),
        forward_held: t0.forward_held.clone(),
        segments: t0.segments.clone(),
        blocks: t0.blocks.clone(),
        input_shape: x.shape(&t0.input_shape, input_shape)?,
        has_loss: t0.has_loss,
        repeats: t0.repeats.clone(),
        grad_shapes: t0.grad_shapes.clone(),
        tp_split: t0.tp_split.clone(),
    })
}

/// Tapes at any batch from two traces, the check of [`at_batch`] made once: a copy of the
/// first trace whose batch-proportional sizes are rewritten in place for each batch asked for,
/// without rebuilding the tape (a probe of a search then costs its simulation alone).
pub struct Batched {
    tape: Tape,
    rules: Vec<Rule>,
}

/// The sizes of one shape (or one scratch size) that are `k` per sample: `(index, k)`.
struct Rule {
    target: Target,
    per_sample: Vec<(usize, u64)>,
}

/// What a [`Rule`] rewrites.
#[derive(Clone, Copy)]
enum Target {
    Storage(StorageId),
    Value(ValueId),
    Layer(super::tape::LayerId),
    Input,
    /// A step's scratch sizes, in forward (`false`) or backward (`true`).
    Scratch(usize, bool),
    /// A step's [`Step::reduced`] block sizes.
    Reduced(usize),
}

impl Batched {
    /// As [`at_batch`]'s check, on `t0` at batch `b0` and `t1` at batch `b1`.
    ///
    /// # Errors
    /// [`NotDerived::NotProportional`] where [`at_batch`] gives it.
    pub fn new((b0, t0): (u64, &Tape), (b1, t1): (u64, &Tape)) -> Result<Batched, NotDerived> {
        let tape = at_batch((b0, t0), (b1, t1), b0).map_err(|_| NotDerived::NotProportional)?;
        // The check passed: a size that differs is `k · b0` in `t0`.
        let per = |s0: &[u64], s1: &[u64]| -> Vec<(usize, u64)> {
            s0.iter()
                .zip(s1)
                .enumerate()
                .filter(|(_, (x0, x1))| x0 != x1)
                .map(|(i, (x0, _))| (i, x0 / b0))
                .collect()
        };
        let mut rules = Vec::new();
        let mut push = |target, per_sample: Vec<(usize, u64)>| {
            if !per_sample.is_empty() {
                rules.push(Rule { target, per_sample });
            }
        };
        for (i, (a, b)) in t0.storages.iter().zip(t1.storages.iter()).enumerate() {
            push(
                Target::Storage(StorageId::from(i)),
                per(a.shape.dims(), b.shape.dims()),
            );
        }
        for (i, (a, b)) in t0.values.iter().zip(t1.values.iter()).enumerate() {
            push(
                Target::Value(ValueId::from(i)),
                per(a.shape.dims(), b.shape.dims()),
            );
        }
        for (i, (a, b)) in t0.layers.iter().zip(t1.layers.iter()).enumerate() {
            push(
                Target::Layer(super::tape::LayerId::from(i)),
                per(a.output_shape.dims(), b.output_shape.dims()),
            );
        }
        push(
            Target::Input,
            per(t0.input_shape.dims(), t1.input_shape.dims()),
        );
        for (i, (a, b)) in t0.steps.iter().zip(&t1.steps).enumerate() {
            push(Target::Scratch(i, false), per(&a.scratch.0, &b.scratch.0));
            push(Target::Scratch(i, true), per(&a.scratch.1, &b.scratch.1));
            let bytes = |s: &Step| s.reduced.iter().map(|&(_, n)| n).collect::<Vec<u64>>();
            push(Target::Reduced(i), per(&bytes(a), &bytes(b)));
        }
        Ok(Batched { tape, rules })
    }

    /// The tape as last rewritten by [`Batched::at`] (at first, the first trace's).
    #[must_use]
    pub fn tape(&self) -> &Tape {
        &self.tape
    }

    /// The tape at batch `at`: what [`at_batch`] gives, rewritten in place.
    ///
    /// # Errors
    /// [`NotDerived::Large`] as [`at_batch`] (the tape is then rewritten again on next use).
    pub fn at(&mut self, at: u64) -> Result<&Tape, NotDerived> {
        if at == 0 {
            return Err(NotDerived::NotProportional);
        }
        let reshape = |shape: &mut Shape, per_sample: &[(usize, u64)]| -> Result<(), NotDerived> {
            let mut dims = shape.dims().to_vec();
            for &(i, k) in per_sample {
                dims[i] = small(k.checked_mul(at))?;
            }
            *shape = Shape::from_slice(&dims);
            Ok(())
        };
        let t = &mut self.tape;
        for r in &self.rules {
            match r.target {
                Target::Storage(id) => {
                    let s = &mut t.storages[id];
                    reshape(&mut s.shape, &r.per_sample)?;
                    let numel = small(s.shape.numel())?;
                    s.bytes = small(s.dtype.bytes_for(numel))?;
                }
                Target::Value(id) => reshape(&mut t.values[id].shape, &r.per_sample)?,
                Target::Layer(id) => reshape(&mut t.layers[id].output_shape, &r.per_sample)?,
                Target::Input => reshape(&mut t.input_shape, &r.per_sample)?,
                Target::Scratch(step, backward) => {
                    let s = &mut t.steps[step].scratch;
                    let sizes = if backward { &mut s.1 } else { &mut s.0 };
                    for &(i, k) in &r.per_sample {
                        sizes[i] = small(k.checked_mul(at))?;
                    }
                }
                Target::Reduced(step) => {
                    let reduced = &mut t.steps[step].reduced;
                    for &(i, k) in &r.per_sample {
                        reduced[i].1 = small(k.checked_mul(at))?;
                    }
                }
            }
        }
        Ok(&self.tape)
    }
}

fn storage_at(a: &Storage, b: &Storage, x: Batches) -> Result<Storage, NotDerived> {
    let Storage {
        bytes,
        kind,
        what,
        dtype,
        shape,
        layer,
    } = b;
    same(&a.kind, kind)?;
    same(&a.what, what)?;
    same(&a.dtype, dtype)?;
    same(&a.layer, layer)?;
    // Both traced sizes are the tracer's `bytes_for(numel)`, so the derived one is too.
    let bytes_of = |s: &Shape| s.numel().and_then(|n| a.dtype.bytes_for(n));
    if bytes_of(&a.shape) != Some(a.bytes) || bytes_of(shape) != Some(*bytes) {
        return Err(NotDerived::NotProportional);
    }
    let shape = x.shape(&a.shape, shape)?;
    Ok(Storage {
        bytes: small(bytes_of(&shape).filter(|_| small(shape.numel()).is_ok()))?,
        kind: a.kind,
        what: a.what,
        dtype: a.dtype,
        shape,
        layer: a.layer,
    })
}

fn value_at(a: &Value, b: &Value, x: Batches) -> Result<Value, NotDerived> {
    let Value {
        storage,
        shape,
        dtype,
        layout,
        requires_grad,
        param,
    } = b;
    same::<StorageId>(&a.storage, storage)?;
    same(&a.dtype, dtype)?;
    same(&a.layout, layout)?;
    same(&a.requires_grad, requires_grad)?;
    same(&a.param, param)?;
    Ok(Value {
        shape: x.shape(&a.shape, shape)?,
        ..a.clone()
    })
}

fn step_at(a: &Step, b: &Step, x: Batches) -> Result<Step, NotDerived> {
    let Step {
        layer,
        op,
        inputs,
        outputs,
        allocs,
        saves,
        grads,
        view_grad,
        segment,
        scratch,
        reduced,
    } = b;
    same(&a.layer, layer)?;
    same(&a.op, op)?;
    same(&a.inputs, inputs)?;
    same(&a.outputs, outputs)?;
    same(&a.allocs, allocs)?;
    same(&a.saves, saves)?;
    same(&a.grads, grads)?;
    same(&a.view_grad, view_grad)?;
    same(&a.segment, segment)?;
    let sizes = |s0: &[u64], s1: &[u64]| -> Result<Vec<u64>, NotDerived> {
        if s0.len() != s1.len() {
            return Err(NotDerived::NotProportional);
        }
        s0.iter().zip(s1).map(|(&p, &q)| x.size(p, q)).collect()
    };
    // `reduced`: the same inputs in both, each block sized at the output's shape.
    if a.reduced.len() != reduced.len() {
        return Err(NotDerived::NotProportional);
    }
    let reduced = a
        .reduced
        .iter()
        .zip(reduced)
        .map(|(&(v0, p), &(v1, q))| {
            same(&v0, &v1)?;
            Ok((v0, x.size(p, q)?))
        })
        .collect::<Result<RareList<_>, NotDerived>>()?;
    Ok(Step {
        reduced,
        scratch: (
            sizes(&a.scratch.0, &scratch.0)?.into(),
            sizes(&a.scratch.1, &scratch.1)?.into(),
        ),
        layer: a.layer,
        op: a.op,
        inputs: a.inputs.clone(),
        outputs: a.outputs.clone(),
        allocs: a.allocs.clone(),
        saves: a.saves.clone(),
        grads: a.grads.clone(),
        view_grad: a.view_grad,
        segment: a.segment,
    })
}

fn layer_at(a: &LayerInfo, b: &LayerInfo, x: Batches) -> Result<LayerInfo, NotDerived> {
    let LayerInfo {
        path,
        name_start,
        kind,
        repeat,
        output_shape,
        params,
        parameter_bytes,
        buffer_bytes,
    } = b;
    same(&a.path, path)?;
    same(&a.name_start, name_start)?;
    same(&a.kind, kind)?;
    same(&a.repeat, repeat)?;
    same(&a.params, params)?;
    same(&a.parameter_bytes, parameter_bytes)?;
    same(&a.buffer_bytes, buffer_bytes)?;
    Ok(LayerInfo {
        output_shape: x.shape(&a.output_shape, output_shape)?,
        ..a.clone()
    })
}

fn param_same(a: &Param, b: &Param) -> Result<(), NotDerived> {
    let Param {
        shape,
        numel,
        bytes,
        trainable,
        value,
        dtype_name,
    } = b;
    same(&a.shape, shape)?;
    same(&a.numel, numel)?;
    same(&a.bytes, bytes)?;
    same(&a.trainable, trainable)?;
    same(&a.value, value)?;
    same(&a.dtype_name, dtype_name)
}

fn segment_same(a: &Segment, b: &Segment) -> Result<(), NotDerived> {
    let Segment { start, end, input } = b;
    same(&a.start, start)?;
    same(&a.end, end)?;
    same(&a.input, input)
}

fn copies_same(a: &BlockCopies, b: &BlockCopies) -> Result<(), NotDerived> {
    let BlockCopies {
        positions,
        starts,
        end,
    } = b;
    same(&a.positions, positions)?;
    same(&a.starts, starts)?;
    same(&a.end, end)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::trace::StorageKind;

    /// A tape of one float32 storage `[batch, width(batch)]`.
    fn tape(batch: u64, width: impl Fn(u64) -> u64) -> Tape {
        let mut t = Tape::default();
        let shape = Shape::new(vec![batch, width(batch)]);
        t.storages.push(Storage {
            bytes: DType::Float32.bytes_for(shape.numel().unwrap()).unwrap(),
            kind: StorageKind::Input,
            what: "input batch",
            dtype: DType::Float32,
            shape: shape.clone(),
            layer: crate::trace::LayerId::default(),
        });
        t.input_shape = shape;
        t
    }

    #[test]
    fn proportional_sizes_are_evaluated() {
        let sixteen = |_| 16;
        let t = at_batch((2, &tape(2, sixteen)), (3, &tape(3, sixteen)), 7).unwrap();
        assert_eq!(t.input_shape.dims(), &[7, 16]);
        assert_eq!(t.storages[StorageId::from(0)].bytes, 7 * 16 * 4);
        // A dimension proportional to the batch (a flattened `[B·S]`).
        let t = at_batch((1, &tape(1, |b| 5 * b)), (9, &tape(9, |b| 5 * b)), 4).unwrap();
        assert_eq!(t.input_shape.dims(), &[4, 20]);
    }

    #[test]
    fn batched_rewrites_as_at_batch_derives() {
        let width = |b: u64| 5 * b;
        let (t1, t9) = (tape(1, width), tape(9, width));
        let mut batched = Batched::new((1, &t1), (9, &t9)).unwrap();
        for b in [4, 2, 1000, 1] {
            let once = at_batch((1, &t1), (9, &t9), b).unwrap();
            assert_eq!(format!("{:?}", batched.at(b).unwrap()), format!("{once:?}"));
        }
        assert_eq!(batched.at(LARGE).unwrap_err(), NotDerived::Large);
        assert_eq!(
            format!("{:?}", batched.at(3).unwrap()),
            format!("{:?}", tape(3, width))
        );
    }

    #[test]
    fn other_sizes_are_refused() {
        let refused = |width: fn(u64) -> u64, b1: u64| {
            at_batch((1, &tape(1, width)), (b1, &tape(b1, width)), 5).unwrap_err()
        };
        // 16 + batch is affine but not proportional.
        assert_eq!(refused(|b| 16 + b, 2), NotDerived::NotProportional);
        // A staircase, 3,000 bytes per sample rounded up to 4 KiB pages: proportional between
        // batches 1 and 2 (4,096 and 8,192), not at 4 (12,288); a far second batch sees it.
        let pages = |b: u64| (b * 3000).div_ceil(4096) * 4096;
        assert!(at_batch((1, &tape(1, pages)), (2, &tape(2, pages)), 3).is_ok());
        assert_eq!(refused(pages, 1 << 16), NotDerived::NotProportional);
        // Traces said to be at other batches than they are.
        let sixteen = |_| 16;
        let e = at_batch((1, &tape(1, sixteen)), (3, &tape(2, sixteen)), 5).unwrap_err();
        assert_eq!(e, NotDerived::NotProportional);
        let (t1, t2) = (tape(1, sixteen), tape(2, sixteen));
        assert_eq!(
            at_batch((1, &t1), (2, &t2), u64::MAX).unwrap_err(),
            NotDerived::Large
        );
        assert_eq!(
            at_batch((1, &t1), (2, &t2), LARGE / 16).unwrap_err(),
            NotDerived::Large
        );
        assert!(at_batch((1, &t1), (2, &t2), LARGE / 128).is_ok());
    }
}
