//! Recording an operator: [`Call`] says what it reads, returns and allocates;
//! [`Tracer::call`] adds what autograd saves, from the operator's row of the table
//! ([`AtenOp::spec`]), and which inputs receive a gradient.

use super::aten::{SaveRule, Saved};
use super::{AtenOp, Error, IdList, Step, StorageId, StorageKind, Tracer, ValueId};

/// One operator as the tracer records it. What it saves is not written here: it follows from
/// [`AtenOp::saves`].
#[derive(Debug)]
pub(super) struct Call {
    /// The operator.
    pub op: AtenOp,
    /// Values read, in the order of the operator's [`OpSpec::inputs`](super::aten::OpSpec).
    pub inputs: Vec<ValueId>,
    /// Values produced.
    pub outputs: Vec<ValueId>,
    /// Tensors the rule may name that are not values ([`Saved::Aux`]): further results
    /// (statistics, indices, masks) and arguments such as group offsets or labels.
    pub aux: Vec<StorageId>,
    /// Storages the operator allocates before its outputs (a copy or mask it computes from,
    /// workspace).
    pub allocs: Vec<StorageId>,
    /// Its further results (statistics, indices, masks, log-sum-exp), allocated after its
    /// outputs, as the CUDA kernels allocate them in the order of the operator's schema (e.g.
    /// `layer_norm_cuda`: `Y`, then `mean`, `rstd`; `dropout_cuda`: the output, then the mask).
    /// The order places the tensors in the caching allocator's blocks ([`crate::alloc`]).
    pub results: Vec<StorageId>,
    /// The backward hands a view of the output's gradient to the input (views, reshapes).
    pub view_grad: bool,
    /// What it makes and frees inside itself ([`Step::scratch`]).
    pub scratch: (Vec<u64>, Vec<u64>),
}

impl Call {
    /// `op` reading `inputs` and producing `outputs`, with no auxiliary tensors.
    pub(super) fn new(op: AtenOp, inputs: Vec<ValueId>, outputs: Vec<ValueId>) -> Call {
        Call {
            op,
            inputs,
            outputs,
            aux: Vec::new(),
            allocs: Vec::new(),
            results: Vec::new(),
            view_grad: false,
            scratch: (Vec::new(), Vec::new()),
        }
    }

    /// With auxiliary tensors ([`Saved::Aux`]).
    pub(super) fn aux(mut self, aux: Vec<StorageId>) -> Call {
        self.aux = aux;
        self
    }

    /// With storages it allocates before its outputs.
    pub(super) fn allocs(mut self, allocs: Vec<StorageId>) -> Call {
        self.allocs = allocs;
        self
    }

    /// With further results, allocated after its outputs.
    pub(super) fn results(mut self, results: Vec<StorageId>) -> Call {
        self.results = results;
        self
    }

    /// With tensors made and freed inside it, in forward and in backward ([`Step::scratch`]).
    pub(super) fn scratch(mut self, forward: Vec<u64>, backward: Vec<u64>) -> Call {
        self.scratch = (forward, backward);
        self
    }

    /// With a backward that hands the output's gradient to the input as a view.
    pub(super) fn view_grad(mut self) -> Call {
        self.view_grad = true;
        self
    }
}

impl Tracer<'_> {
    /// Records `c`, saving what [`AtenOp::saves`] says. An in-place operator that saves a clone
    /// of its input allocates it here ("input clone").
    ///
    /// # Errors
    /// [`Error::Overflow`] when the clone's size does not fit in 64 bits.
    pub(super) fn call(&mut self, c: Call) -> Result<(), Error> {
        let SaveRule { always, each_other } = c.op.saves();
        let mut allocs = IdList::from(c.allocs);
        let mut saves = IdList::new();
        // Outside training, or when nothing it reads requires a gradient, autograd records no
        // node and saves nothing ([`Tracer::push`]); an auxiliary tensor made only for backward
        // (a norm's statistics) may then be absent. The clone of an in-place operator is still
        // allocated then, as memest always has (PyTorch makes none under `no_grad`).
        let records = self.records(&c.inputs);
        for saved in always {
            if !records && !matches!(saved, Saved::InputClone(_)) {
                continue;
            }
            match *saved {
                Saved::Input(i) => saves.push(self.sid(c.inputs[i])),
                Saved::OptionalInput(i) => saves.extend(c.inputs.get(i).map(|&v| self.sid(v))),
                Saved::Output(i) => saves.push(self.sid(c.outputs[i])),
                Saved::Aux(i) => saves.push(c.aux[i]),
                Saved::InputClone(i) => {
                    let x = self.val(c.inputs[i]).clone();
                    let clone =
                        self.storage(&x.shape, x.dtype, StorageKind::Activation, "input clone")?;
                    allocs.push(clone);
                    saves.push(clone);
                }
            }
        }
        if each_other && records {
            let (a, b) = (c.inputs[0], c.inputs[1]);
            if self.rg(b) {
                saves.push(self.sid(a));
            }
            if self.rg(a) {
                saves.push(self.sid(b));
            }
        }
        self.push_with(
            Step {
                op: c.op,
                inputs: c.inputs.into(),
                outputs: c.outputs.into(),
                allocs,
                saves,
                view_grad: c.view_grad,
                scratch: (c.scratch.0.into(), c.scratch.1.into()),
                ..self.blank()
            },
            c.results,
        );
        Ok(())
    }

    /// Records a step. Outside training, or when nothing it reads requires a gradient, autograd
    /// records no node: nothing is saved and no gradient flows.
    pub(super) fn push(&mut self, step: Step) {
        self.push_with(step, Vec::new());
    }

    /// [`Tracer::push`], with further results allocated after the outputs.
    fn push_with(&mut self, mut step: Step, results: Vec<StorageId>) {
        let records = self.records(&step.inputs);
        if records {
            step.grads = step
                .inputs
                .iter()
                .copied()
                .filter(|&v| self.rg(v) && self.val(v).dtype.is_float())
                .collect();
            if step.op.grads_by_name() {
                // The backward's order ([`AtenOp::grads_by_name`]): by ATen name; inputs past
                // the named ones (an `add` of several: `(a + b) + c`) are further `other`s,
                // the later computed first, as the outer `add`'s backward runs first.
                let names = step.op.spec().inputs;
                let key = |v: ValueId| {
                    let i = step.inputs.iter().position(|&x| x == v).unwrap_or(0);
                    let name = names.get(i.min(names.len().saturating_sub(1))).copied();
                    (name, std::cmp::Reverse(i))
                };
                step.grads.sort_by_key(|&v| key(v));
            }
            step.grads.dedup();
            // `add.Tensor`'s formulas are `grad` itself (no block of their own); an input of
            // another shape or dtype than the output gets the engine's reduction of it
            // ([`Step::reduced`]), the others the output's gradient block (`view_grad`).
            if matches!(step.op, AtenOp::Add | AtenOp::AddInplace)
                && let Some(&o) = step.outputs.first()
            {
                let out = &self.tape.values[o];
                for &v in &step.grads {
                    let vv = &self.tape.values[v];
                    if vv.shape != out.shape || vv.dtype != out.dtype {
                        step.reduced.push((v, 0));
                    }
                }
            }
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
        for s in results {
            if !step.allocs.contains(&s) {
                step.allocs.push(s);
            }
        }
        step.saves.sort_unstable();
        step.saves.dedup();
        self.tape.steps.push(step);
    }

    /// Whether autograd records an operator reading `inputs`: in training, when one of them
    /// requires a gradient.
    fn records(&self, inputs: &[ValueId]) -> bool {
        self.training() && inputs.iter().any(|&v| self.rg(v))
    }
}
