//! Pipeline parallelism: the model's repeated blocks cut into consecutive stages
//! ([`crate::parallel::Pipeline`]), each stage's own tape, and what a pipeline rank holds with
//! several micro-batches in flight.
//!
//! A stage is a slice of the traced step: its steps, the parameters they read, the storages
//! they make, and, received from the stage before, the activations they read but do not make
//! (the previous stage's output, and tensors made before the first block that every block
//! reads, e.g. rotary tables): those are [`StorageKind::Carried`], live from the start of the
//! stage's forward and kept until its backward (`torch.distributed.pipelining`'s
//! `_ForwardChunkState.input_values`; Megatron keeps `input_tensors` per micro-batch). The
//! stage's own output, sent on, dies after the send unless autograd saved it (PyTorch 2.9+
//! `release_fwd_send_outputs`; Megatron `deallocate_output_tensor`). In backward the gradient
//! of that output arrives in a receive buffer of its size.
//!
//! The replay of a stage runs one micro-batch's forward and backward with the other
//! micro-batches in flight counted as what one micro-batch keeps after its forward, then, as
//! in the schedule's steady state, a second micro-batch with the gradients already live. It
//! knows the tape and the plan; it never looks at layer kinds.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use typed_index_collections::TiVec;

use crate::error::{Error, SettingKey};
use crate::trace::{SegmentId, StorageId, StorageKind, Tape};

/// One pipeline stage (a model chunk): its steps and its blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct StageRange {
    /// Its steps in the whole tape.
    pub steps: Range<usize>,
    /// Its copies of the repeated block (indices into [`Tape::blocks`]).
    pub blocks: Range<usize>,
}

/// The tape's steps cut into `stages` consecutive stages by repeated block, balanced by count:
/// `n / stages` blocks each, the first `n mod stages` stages one more (Megatron-LM's even
/// `num_layers / pipeline_model_parallel_size`; `np.array_split`'s rule). Steps before the
/// first block go to the first stage, steps after the last to the last.
///
/// # Errors
/// [`Error::Setting`] when the model has fewer repeated blocks than stages.
pub(super) fn split(tape: &Tape, stages: u64) -> Result<Vec<StageRange>, Error> {
    let n = tape.blocks.len();
    let s = usize::try_from(stages).unwrap_or(usize::MAX);
    if s == 0 || n < s {
        return Err(Error::setting(
            SettingKey::Parallel,
            format!(
                "a pipeline of {stages} stages (--pp × --virtual-stages) needs at least {stages} repeated blocks (decoder layers) to split; this model has {n}"
            ),
        ));
    }
    let (q, r) = (n / s, n % s);
    let mut out = Vec::with_capacity(s);
    for i in 0..s {
        let lo = i * q + i.min(r);
        let hi = lo + q + usize::from(i < r);
        let start = if i == 0 { 0 } else { tape.blocks[lo].start };
        let end = if i + 1 == s {
            tape.steps.len()
        } else {
            tape.blocks[hi].start
        };
        out.push(StageRange {
            steps: start..end,
            blocks: lo..hi,
        });
    }
    Ok(out)
}

/// A stage's own tape, and the bytes it exchanges with its neighbours per micro-batch.
pub(super) struct StageTape {
    /// The stage as a tape of its own (storage, value and layer ids are the whole tape's).
    pub tape: Tape,
    /// Activations received from earlier stages (the stage's input), bytes.
    pub received_bytes: u64,
    /// Activations sent to later stages (the stage's output), bytes: also the size of the
    /// gradient received for them in backward.
    pub sent_bytes: u64,
    /// Received activations that the stage's own operators save for backward, bytes (they
    /// count as saved activations of this stage, as a saved-tensor hook sees them).
    pub received_saved_bytes: u64,
}

/// Stage `range` of `tape` as a tape of its own.
pub(super) fn stage_tape(tape: &Tape, range: &StageRange) -> StageTape {
    let steps = &tape.steps[range.steps.clone()];
    let mut used: HashSet<StorageId> = HashSet::new();
    let mut made: HashSet<StorageId> = HashSet::new();
    let mut saved: HashSet<StorageId> = HashSet::new();
    for st in steps {
        made.extend(st.allocs.iter().copied());
        used.extend(st.allocs.iter().copied());
        used.extend(st.saves.iter().copied());
        saved.extend(st.saves.iter().copied());
        for &v in st.inputs.iter().chain(&st.outputs) {
            used.insert(tape.values[v].storage);
        }
    }
    // Storages the later stages read.
    let mut later: HashSet<StorageId> = HashSet::new();
    for st in &tape.steps[range.steps.end..] {
        for &v in &st.inputs {
            later.insert(tape.values[v].storage);
        }
    }
    let mut storages = tape.storages.clone();
    let (mut received_bytes, mut sent_bytes, mut received_saved_bytes) = (0u64, 0u64, 0u64);
    for (s, st) in storages.iter_mut_enumerated() {
        match st.kind {
            StorageKind::Parameter | StorageKind::Buffer | StorageKind::Input
                if !used.contains(&s) =>
            {
                st.bytes = 0;
            }
            StorageKind::Activation if used.contains(&s) && !made.contains(&s) => {
                st.kind = StorageKind::Carried;
                received_bytes = received_bytes.saturating_add(st.bytes);
                if saved.contains(&s) {
                    received_saved_bytes = received_saved_bytes.saturating_add(st.bytes);
                }
            }
            StorageKind::Activation if made.contains(&s) && later.contains(&s) => {
                sent_bytes = sent_bytes.saturating_add(st.bytes);
            }
            _ => {}
        }
    }
    // Checkpointed segments inside the stage, renumbered.
    let mut seg_map: HashMap<SegmentId, SegmentId> = HashMap::new();
    let mut segments = TiVec::new();
    for (g, seg) in tape.segments.iter_enumerated() {
        if seg.start >= range.steps.start && seg.end <= range.steps.end {
            let mut seg = seg.clone();
            seg.start -= range.steps.start;
            seg.end -= range.steps.start;
            seg_map.insert(g, segments.push_and_get_key(seg));
        }
    }
    let steps = steps
        .iter()
        .map(|st| {
            let mut st = st.clone();
            st.segment = st.segment.and_then(|g| seg_map.get(&g).copied());
            st
        })
        .collect();
    let blocks = tape.blocks[range.blocks.clone()]
        .iter()
        .map(|b| b.start - range.steps.start..b.end - range.steps.start)
        .collect();
    let stage = Tape {
        storages,
        values: tape.values.clone(),
        params: tape
            .params
            .iter()
            .filter(|p| used.contains(&tape.values[p.value].storage))
            .cloned()
            .collect(),
        steps,
        layers: tape.layers.clone(),
        held: tape
            .held
            .iter()
            .copied()
            .filter(|s| made.contains(s))
            .collect(),
        // The rotary tables a stage makes are its forward's locals (each stage's `forward`
        // computes its own); received ones are kept as any received input.
        forward_held: tape
            .forward_held
            .iter()
            .copied()
            .filter(|s| made.contains(s))
            .collect(),
        grad_shapes: tape.grad_shapes.clone(),
        tp_split: tape.tp_split.clone(),
        segments,
        blocks,
        input_shape: tape.input_shape.clone(),
        has_loss: tape.has_loss && range.steps.end == tape.steps.len(),
        repeats: Vec::new(),
    };
    StageTape {
        tape: stage,
        received_bytes,
        sent_bytes,
        received_saved_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tape_with_blocks(n: usize) -> Tape {
        let mut t = Tape::default();
        // 2 steps before, 3 per block, 2 after.
        let steps = 2 + 3 * n + 2;
        t.blocks = (0..n).map(|i| 2 + 3 * i..5 + 3 * i).collect();
        t.steps = (0..steps)
            .map(|_| crate::trace::Step {
                layer: crate::trace::LayerId::default(),
                op: crate::trace::AtenOp::Relu,
                inputs: crate::trace::IdList::new(),
                outputs: crate::trace::IdList::new(),
                allocs: crate::trace::IdList::new(),
                saves: crate::trace::IdList::new(),
                grads: crate::trace::IdList::new(),
                view_grad: false,
                segment: None,
                scratch: Default::default(),
                reduced: Default::default(),
            })
            .collect();
        t
    }

    #[test]
    fn split_is_balanced_first_stages_take_the_rest() {
        let t = tape_with_blocks(5);
        let s = split(&t, 2).unwrap();
        assert_eq!(s[0].blocks, 0..3);
        assert_eq!(s[1].blocks, 3..5);
        assert_eq!(s[0].steps, 0..11);
        assert_eq!(s[1].steps, 11..19);
        let s = split(&t, 5).unwrap();
        assert!(s.iter().all(|r| r.blocks.len() == 1));
        assert!(split(&t, 6).is_err());
    }
}
