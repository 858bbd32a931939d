//! Per-storage facts of a tape, computed once before the replay: when each storage is last
//! used in forward, whether autograd keeps it for backward, which step's backward frees it, and
//! what each checkpointed segment keeps. Pure functions of the [`Tape`].

use std::collections::HashSet;

use typed_index_collections::{TiVec, ti_vec};

use crate::trace::{LayerId, SegmentId, StorageId, StorageKind, Tape};

/// When each storage lives, as far as the tape alone says.
#[derive(Clone, Debug)]
pub(super) struct Liveness {
    /// The last step (forward order) that allocates, reads or writes the storage.
    pub last_use: TiVec<StorageId, usize>,
    /// Saved for backward in forward: by a step outside any checkpointed segment, or as the
    /// input of a checkpointed segment.
    pub saved_fwd: TiVec<StorageId, bool>,
    /// The step whose backward frees it: the earliest step that saves it (or the start of the
    /// segment whose input it is), `None` when nothing saves it.
    pub bwd_free_at: TiVec<StorageId, Option<usize>>,
    /// Held by the caller until the step ends (the model output and the loss).
    pub held: TiVec<StorageId, bool>,
    /// The forward step after which the base model's `forward` has returned and its locals
    /// ([`Tape::forward_held`]) are gone.
    pub returns: usize,
    /// For each checkpointed segment, the activations it reads from outside, its input first:
    /// reentrant checkpointing saves the block's tensor arguments (the input, and e.g. the
    /// encoder output or a position bias) until its backward. After them come the tensors
    /// its operators keep that are no value it reads, and the base model's locals it reads
    /// (the rotary `cos`/`sin` passed to each layer in a tuple): the checkpoint keeps them
    /// alive too, but `saved_tensors_hooks` never sees them.
    pub seg_inputs: TiVec<SegmentId, Vec<StorageId>>,
    /// For each checkpointed segment, how many of [`Liveness::seg_inputs`] are read as values
    /// (the ones counted as saved activations).
    pub seg_values: TiVec<SegmentId, usize>,
}

impl Liveness {
    /// The facts of `tape`.
    pub(super) fn of(tape: &Tape) -> Liveness {
        let n = tape.storages.len();
        let mut last_use: TiVec<StorageId, usize> = ti_vec![0; n];
        let mut saved_fwd: TiVec<StorageId, bool> = ti_vec![false; n];
        let mut bwd_free_at: TiVec<StorageId, Option<usize>> = ti_vec![None; n];
        let mut held: TiVec<StorageId, bool> = ti_vec![false; n];
        let earliest = |at: &mut Option<usize>, i: usize| {
            *at = Some(at.map_or(i, |b| b.min(i)));
        };
        for &s in &tape.held {
            held[s] = true;
        }
        for (i, step) in tape.steps.iter().enumerate() {
            for s in touched(tape, i) {
                last_use[s] = last_use[s].max(i);
            }
            for &s in &step.saves {
                if step.segment.is_none() {
                    saved_fwd[s] = true;
                }
                earliest(&mut bwd_free_at[s], i);
            }
        }
        // The base model's forward returns after its layer stack (and its final norm, the
        // step after the last block); without a repeated stack, at the end of forward.
        let returns = tape
            .blocks
            .last()
            .map_or(tape.steps.len(), |b| b.end.saturating_add(1))
            .min(tape.steps.len())
            .saturating_sub(1);
        for &s in &tape.forward_held {
            last_use[s] = last_use[s].max(returns);
        }
        let seg_inputs: Vec<(Vec<StorageId>, usize)> = tape
            .segments
            .iter()
            .map(|seg| {
                let steps = &tape.steps[seg.start..seg.end];
                let inside: HashSet<StorageId> = steps
                    .iter()
                    .flat_map(|st| st.allocs.iter().copied())
                    .collect();
                let mut outside = vec![seg.input];
                let add = |outside: &mut Vec<StorageId>, s: StorageId| {
                    if tape.storages[s].kind == StorageKind::Activation
                        && !inside.contains(&s)
                        && !outside.contains(&s)
                    {
                        outside.push(s);
                    }
                };
                // What it reads as values, then what it keeps that is no value. The base
                // model's locals (`Tape::forward_held`: the rotary tables) reach the block
                // inside a tuple (`position_embeddings`), which the checkpoint does not save
                // as a tensor argument, even where an operator reads them as values.
                let local = |s: &StorageId| tape.forward_held.contains(s);
                for st in steps {
                    for &v in &st.inputs {
                        let s = tape.values[v].storage;
                        if !local(&s) {
                            add(&mut outside, s);
                        }
                    }
                }
                let values = outside.len();
                for st in steps {
                    for &s in &st.saves {
                        add(&mut outside, s);
                    }
                    for &v in &st.inputs {
                        let s = tape.values[v].storage;
                        if local(&s) {
                            add(&mut outside, s);
                        }
                    }
                }
                (outside, values)
            })
            .collect();
        let (seg_inputs, seg_values): (TiVec<SegmentId, _>, TiVec<SegmentId, _>) =
            seg_inputs.into_iter().unzip();
        for (seg, inputs) in tape.segments.iter().zip(&seg_inputs) {
            for &s in inputs {
                saved_fwd[s] = true;
                earliest(&mut bwd_free_at[s], seg.start);
            }
        }
        Liveness {
            last_use,
            saved_fwd,
            bwd_free_at,
            held,
            returns,
            seg_inputs,
            seg_values,
        }
    }

    /// Whether an activation counts as kept (saved or held: [`Category::Activations`]) rather
    /// than transient ([`Category::Temporaries`]) while live in forward.
    ///
    /// [`Category::Activations`]: super::Category::Activations
    /// [`Category::Temporaries`]: super::Category::Temporaries
    pub(super) fn kept(&self, s: StorageId) -> bool {
        self.saved_fwd[s] || self.held[s]
    }
}

/// The storages step `i` allocates, reads or writes.
pub(super) fn touched(tape: &Tape, i: usize) -> impl Iterator<Item = StorageId> + '_ {
    let step = &tape.steps[i];
    step.allocs.iter().copied().chain(
        step.inputs
            .iter()
            .chain(&step.outputs)
            .map(|&v| tape.values[v].storage),
    )
}

/// Activation bytes saved for backward, each storage once, and the same attributed to the first
/// layer that saves each (a segment's inputs to the layer that allocated them).
#[derive(Clone, Debug)]
pub(super) struct SavedBytes {
    /// The total.
    pub total: u64,
    /// Per layer.
    pub by_layer: TiVec<LayerId, u64>,
}

impl SavedBytes {
    /// What `tape` saves, with `live`'s segment inputs. A sum over 64 bits saturates at
    /// `u64::MAX`, which the caller reports as an overflow.
    pub(super) fn of(tape: &Tape, live: &Liveness) -> SavedBytes {
        let mut by_layer: TiVec<LayerId, u64> = ti_vec![0; tape.layers.len()];
        let mut counted: TiVec<StorageId, bool> = ti_vec![false; tape.storages.len()];
        let mut total = 0u64;
        let mut count = |s: StorageId, layer: LayerId| {
            let st = &tape.storages[s];
            if st.kind == StorageKind::Activation && !counted[s] {
                counted[s] = true;
                total = total.saturating_add(st.bytes);
                by_layer[layer] = by_layer[layer].saturating_add(st.bytes);
            }
        };
        for step in tape.steps.iter().filter(|s| s.segment.is_none()) {
            for &s in &step.saves {
                count(s, step.layer);
            }
        }
        // Checkpoint inputs saved outside any step's own saves.
        for (inputs, &n) in live.seg_inputs.iter().zip(&live.seg_values) {
            for &s in &inputs[..n] {
                count(s, tape.storages[s].layer);
            }
        }
        SavedBytes { total, by_layer }
    }
}
