//! The replay: the step's three phases over a tape, allocation by allocation, tracking the live
//! bytes of every [`Category`] and the peak.
//!
//! Running totals are checked: a sum past 64 bits saturates and is reported as
//! [`Error::Overflow`]; a subtraction below zero is a bug in memest, reported as
//! [`Error::Internal`], never a wrapped number.

use std::collections::hash_map::Entry;

/// Maps and sets with foldhash's fast hasher: the replay's keys are small ids, hashed at every
/// step (std's SipHash showed in profiles of the symbolic path's traces).
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
type HashSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

use typed_index_collections::{TiVec, ti_vec};

use super::heap::{Heap, Key};
use super::liveness::{Liveness, touched};
use super::parallel::{Dist, Reduce};
use super::{At, Category, Event, Phase, TimePoint};
use crate::cost::OptimizerPlan;
use crate::dtype::DType;
use crate::error::Error;
use crate::trace::{LayerId, SegmentId, StorageId, StorageKind, Tape, ValueId};

/// Live bytes per category, and the peak so far.
pub(super) struct Replay<'a> {
    tape: &'a Tape,
    facts: &'a Liveness,
    live: TiVec<StorageId, bool>,
    /// Category an Activation storage counts in while live.
    act_cat: TiVec<StorageId, Category>,
    cur: [u64; Category::COUNT],
    /// The largest total so far, its phase, its layer and the categories then.
    pub peak: u64,
    pub peak_phase: Phase,
    pub peak_layer: Option<LayerId>,
    pub at_peak: [u64; Category::COUNT],
    /// Each category's own maximum.
    pub max: [u64; Category::COUNT],
    /// Largest total of live activations in forward: kept plus transient, the KV cache left
    /// out (it is its own category).
    pub live_act_max: u64,
    /// The largest total since [`Replay::open_window`] (an accumulating micro-batch's peak).
    pub window_peak: u64,
    /// The category each activation storage starts in (recomputation re-files some).
    act_cat_start: TiVec<StorageId, Category>,
    /// A running total overflowed 64 bits.
    overflow: bool,
    /// A running total would have gone below zero.
    underflow: bool,
    /// Totals recorded so far (the number of [`Replay::check`] calls): each is one event.
    pub events: usize,
    /// The event of the peak.
    pub peak_event: usize,
    /// Every event's totals, when asked for ([`Replay::record`]).
    pub points: Option<Vec<TimePoint>>,
    /// The event at which to take [`Replay::snapshot`], when asked for.
    snap_at: Option<usize>,
    /// Parameter gradients allocated so far, while a snapshot is pending.
    param_grads: Vec<(ValueId, u64)>,
    /// What was live at event `snap_at`.
    pub snapshot: Option<Snapshot>,
    /// The parallel plan applied to the tape, if any.
    dist: Option<&'a Dist>,
    /// Per unit of `dist`: whether its parameters are gathered now.
    gathered: Vec<bool>,
    /// ZeRO-3 prefetch ([`super::parallel::Prefetch`]), per unit: how many of its parameters
    /// (in order), elements and bytes are gathered before its own fetch.
    prefetched: Vec<(usize, u64, u64)>,
    /// ZeRO-3: gathered, unreleased elements (`__n_available_params`), and where its prefetch
    /// queue stands: position in the fetch order (units forward, then backward) and parameter.
    available: u64,
    queue: (usize, usize),
    /// The caching allocator fed every tensor, when asked for ([`Replay::with_heap`]).
    pub heap: Option<Heap>,
    /// FSDP2's last all-gather output in forward, kept until the next all-gather: its bytes
    /// and unit.
    pending_gather: u64,
    pending_unit: Option<usize>,
    /// Whether DeepSpeed's gradient partition buffer exists yet.
    partition_buffer: bool,
    /// Every event's place in the step and totals, when asked for ([`Replay::log`]).
    pub log: Option<Vec<Event>>,
    /// DeepSpeed ZeRO-1/2: the gradients in the current reduce bucket, their elements, the one
    /// too large for the bucket (value, bytes), and the bytes of whole gradients kept outside
    /// the partition (ZeRO-1).
    bucket: Vec<ValueId>,
    bucket_elems: u64,
    bucket_extra: Option<(ValueId, u64)>,
    bucket_kept: u64,
    /// Pipeline parallelism: the receive buffer of the gradient of the stage's output, live
    /// through each backward pass.
    pub recv_grad: u64,
    /// The first step that touches each storage, while the allocator's operations are
    /// recorded ([`Replay::record_heap`]); empty otherwise.
    storage_steps: TiVec<StorageId, Option<usize>>,
}

/// The live set at one event: storages (with the category each counts in then and the bytes
/// it counts on this GPU), activation gradients and parameter gradients (value, bytes).
#[derive(Clone, Debug, Default)]
pub(super) struct Snapshot {
    pub storages: Vec<(StorageId, Category, u64)>,
    pub grads: Vec<(ValueId, u64)>,
    pub param_grads: Vec<(ValueId, u64)>,
}

/// Activation gradients that several values hold views of. A backward that passes the output's
/// gradient on unchanged to more than one input hands each a view of the same tensor: `add`'s
/// (`derivatives.yaml` `add.Tensor`: `self: grad`, `other: maybe_multiply(grad, alpha)`) and
/// `cat`'s (`cat_tensors_backward`: a `narrow` of `grad` per input). The block lives until
/// the last of them is consumed (a [`crate::trace::Step`] with `view_grad` and several
/// inputs).
///
/// In the backward's gradient map the first member carries the block's bytes and the others
/// count 0, so the map's sum stays the live activation-gradient bytes; when the bearer is
/// consumed first, the bytes pass to the next member.
#[derive(Debug, Default)]
struct Shared {
    /// Value → the block it holds a view of, named by the value whose `Key::Grad` the
    /// allocator knows it under.
    of: HashMap<ValueId, ValueId>,
    /// Block → the values that still hold it, the bearer first.
    members: HashMap<ValueId, Vec<ValueId>>,
}

impl Shared {
    /// `v` (which has no gradient yet) takes a view of `holder`'s gradient: a plain gradient
    /// becomes a shared block, or `v` joins the block `holder` shares.
    fn join(&mut self, grads: &mut HashMap<ValueId, u64>, holder: ValueId, v: ValueId) {
        let block = *self.of.entry(holder).or_insert(holder);
        let members = self.members.entry(block).or_insert_with(|| vec![holder]);
        members.push(v);
        self.of.insert(v, block);
        grads.insert(v, 0);
    }

    /// `v`'s view is gone; returns the block and its bytes when it was the last holder (the
    /// caller frees it). `None` when `v` shares no block or others still hold it.
    fn leave(&mut self, grads: &mut HashMap<ValueId, u64>, v: ValueId) -> Option<(ValueId, u64)> {
        let block = self.of.remove(&v)?;
        let bytes = grads.remove(&v).unwrap_or(0);
        let members = self.members.get_mut(&block)?;
        members.retain(|&m| m != v);
        if let Some(&next) = members.first() {
            if let Some(b) = grads.get_mut(&next) {
                *b = b.saturating_add(bytes);
            }
            None
        } else {
            self.members.remove(&block);
            Some((block, bytes))
        }
    }
}

/// What the backward pass leaves for the optimizer step.
pub(super) struct Backward {
    /// Parameter gradient bytes (`.grad`, each parameter once).
    pub gradient_bytes: u64,
    /// The parameter values that received a gradient.
    pub has_grad: TiVec<ValueId, bool>,
}

impl<'a> Replay<'a> {
    /// A replay of `tape` with nothing live yet.
    pub(super) fn new(tape: &'a Tape, facts: &'a Liveness) -> Replay<'a> {
        let act_cat: TiVec<StorageId, Category> = facts
            .saved_fwd
            .keys()
            .map(|s| {
                if facts.kept(s) {
                    Category::Activations
                } else {
                    Category::Temporaries
                }
            })
            .collect();
        Replay {
            tape,
            facts,
            live: ti_vec![false; tape.storages.len()],
            act_cat_start: act_cat.clone(),
            act_cat,
            window_peak: 0,
            cur: [0; Category::COUNT],
            peak: 0,
            peak_phase: Phase::Forward,
            peak_layer: None,
            at_peak: [0; Category::COUNT],
            max: [0; Category::COUNT],
            live_act_max: 0,
            overflow: false,
            underflow: false,
            events: 0,
            peak_event: 0,
            points: None,
            snap_at: None,
            param_grads: Vec::new(),
            snapshot: None,
            dist: None,
            gathered: Vec::new(),
            prefetched: Vec::new(),
            available: 0,
            queue: (0, 0),
            heap: None,
            pending_gather: 0,
            pending_unit: None,
            partition_buffer: false,
            log: None,
            bucket: Vec::new(),
            bucket_elems: 0,
            bucket_extra: None,
            bucket_kept: 0,
            recv_grad: 0,
            storage_steps: TiVec::new(),
        }
    }

    /// Records every event's place and totals in [`Replay::log`].
    pub(super) fn log(&mut self) {
        self.log = Some(Vec::new());
    }

    /// Replays the step as one rank of `dist`'s plan.
    pub(super) fn distributed(&mut self, dist: &'a Dist) {
        self.gathered = vec![false; dist.units.len()];
        self.prefetched = vec![(0, 0, 0); dist.units.len()];
        self.dist = Some(dist);
    }

    /// Gathers unit `u`'s parameters (a communication buffer) unless they are, during
    /// `phase` in `layer`: with an all-gather output buffer, that buffer and the unsharded
    /// parameters are live together (an event of its own), then the buffer is freed (in
    /// backward) or kept until the next gather (in forward).
    fn gather(&mut self, u: usize, phase: Phase, layer: Option<LayerId>) {
        let Some(d) = self.dist else { return };
        if self.gathered[u] {
            return;
        }
        self.gathered[u] = true;
        let unit = &d.units[u];
        // What a prefetch already gathered is counted.
        let (_, numel, bytes) = std::mem::take(&mut self.prefetched[u]);
        let w = unit.gathered_bytes.saturating_sub(bytes);
        if let Some(pf) = &d.prefetch {
            let all = pf.params[u].iter().fold(0u64, |a, p| a.saturating_add(p.0));
            self.available = self.available.saturating_add(all.saturating_sub(numel));
        }
        // The all-gather output first, then the unsharded parameters it is copied out into.
        if unit.gather_buffer {
            self.heap_alloc(Key::GatherBuffer(u), w);
        }
        self.heap_alloc(Key::Gathered(u), w);
        self.add(Category::CommBuffers, w);
        if unit.gather_buffer {
            self.add(Category::CommBuffers, w);
            self.check(phase, layer, At::Communication);
            if phase == Phase::Forward {
                let previous = std::mem::replace(&mut self.pending_gather, w);
                self.sub(Category::CommBuffers, previous);
                if let Some(p) = self.pending_unit.replace(u) {
                    self.heap_free(Key::GatherBuffer(p));
                }
            } else {
                self.sub(Category::CommBuffers, w);
                self.heap_free(Key::GatherBuffer(u));
            }
        }
    }

    /// Frees unit `u`'s gathered parameters if they are.
    fn release(&mut self, u: usize) {
        if let Some(d) = self.dist
            && self.gathered[u]
        {
            self.gathered[u] = false;
            self.sub(Category::CommBuffers, d.units[u].gathered_bytes);
            self.heap_free(Key::Gathered(u));
            if let Some(pf) = &d.prefetch {
                let all = pf.params[u].iter().fold(0u64, |a, p| a.saturating_add(p.0));
                self.available = self.available.saturating_sub(all);
            }
        }
    }

    /// ZeRO-3's prefetch as a layer of unit `u` (or of none) starts in `phase`
    /// ([`super::parallel::Prefetch`]; DeepSpeed runs `fetch_sub_module` for every module,
    /// parameters or not): the queue moves past `u`, then its next parameters are gathered,
    /// those not available, until the elements started reach `min(max_live - available,
    /// bucket)` (checked before each parameter, so the last one may pass it).
    fn prefetch(&mut self, u: Option<usize>, phase: Phase) {
        let Some(d) = self.dist else { return };
        let Some(pf) = &d.prefetch else { return };
        let n = pf.params.len();
        if let Some(u) = u {
            let at = if phase == Phase::Forward {
                u
            } else {
                2 * n - 1 - u
            };
            if self.queue.0 <= at {
                self.queue = (at + 1, 0);
            }
        }
        let limit = pf
            .max_live_elems
            .saturating_sub(self.available)
            .min(pf.bucket_elems);
        let mut started = 0u64;
        while started < limit && self.queue.0 < 2 * n {
            let (k, j) = self.queue;
            let v = if k < n { k } else { 2 * n - 1 - k };
            let Some(&(numel, bytes)) = pf.params[v].get(j) else {
                self.queue = (k + 1, 0);
                continue;
            };
            self.queue.1 += 1;
            // Available: gathered whole, or this parameter already prefetched.
            if self.gathered[v] || j < self.prefetched[v].0 {
                continue;
            }
            let p = &mut self.prefetched[v];
            *p = (j + 1, p.1.saturating_add(numel), p.2.saturating_add(bytes));
            self.available = self.available.saturating_add(numel);
            started = started.saturating_add(numel);
            self.add(Category::CommBuffers, bytes);
        }
    }

    /// Reduces unit `u`'s gradients to this rank's shard: the whole ones are freed, the shard
    /// stays (unless it lands in a buffer counted from the start). `fresh`: the parameters whose
    /// `.grad` this backward created and still holds whole; `sharded`: those of them whose
    /// shard a previous micro-batch left (gradient accumulation), which the reduced shard is
    /// added into (FSDP2 `foreach_reduce`: `sharded_param.grad += new_sharded_grad`; the
    /// reduce-scatter output is shard-sized, smaller than the whole gradients freed before it,
    /// so it makes no new peak), so no shard is added. A gradient applied in backward
    /// (`--optim-in-backward`) was a transient at its step.
    fn reduce_unit(
        &mut self,
        u: usize,
        (fresh, sharded): (&TiVec<ValueId, bool>, &TiVec<ValueId, bool>),
        layer: Option<LayerId>,
    ) {
        let Some(d) = self.dist else { return };
        let Reduce::PerUnit { into_buffer } = d.reduce else {
            return;
        };
        if d.partition_buffer > 0 && !self.partition_buffer {
            self.partition_buffer = true;
            self.add(Category::Gradients, d.partition_buffer);
        }
        let buffer = d.units[u].reduce_buffer_bytes;
        if buffer > 0 {
            // The whole gradients are copied into the reduce-scatter input, then freed; a
            // gradient cast on the way is first copied in its own dtype (the largest such copy).
            let cast = d.units[u].reduce_cast_bytes;
            self.add(Category::CommBuffers, buffer);
            self.heap_alloc(Key::ReduceBuffer(u), buffer);
            self.add(Category::Temporaries, cast);
            if cast > 0 {
                self.heap_alloc(Key::Transient, cast);
            }
            self.check(Phase::Backward, layer, At::Communication);
            self.sub(Category::Temporaries, cast);
            if cast > 0 {
                self.heap_free(Key::Transient);
            }
        }
        let mut shards = 0u64;
        for &(v, whole, shard) in &d.units[u].grads {
            if fresh.get(v).copied().unwrap_or(false) {
                self.sub(Category::Gradients, whole);
                self.heap_free(Key::ParamGrad(v));
                if !into_buffer && !sharded.get(v).copied().unwrap_or(false) {
                    self.add(Category::Gradients, shard);
                    shards = shards.saturating_add(shard);
                }
            }
        }
        // The reduce-scatter output holds the unit's gradient shards (views of one tensor), or,
        // in a reduce dtype of its own, is cast into the tensor they view and then freed.
        let output = d.units[u].reduce_output_cast_bytes;
        if output > 0 {
            self.add(Category::CommBuffers, output);
            self.heap_alloc(Key::Transient, output);
        }
        self.heap_alloc(Key::ShardGrads(u), shards);
        if output > 0 {
            self.check(Phase::Backward, layer, At::Communication);
            self.sub(Category::CommBuffers, output);
            self.heap_free(Key::Transient);
        }
        self.sub(Category::CommBuffers, buffer);
        self.heap_free(Key::ReduceBuffer(u));
    }

    /// Makes a step's scratch blocks ([`crate::trace::Step::scratch`]) live as temporaries
    /// (the allocator's [`Key::Transient`]); returns their bytes, for the caller to free.
    fn scratch(&mut self, blocks: &[u64]) -> u64 {
        let mut sum = 0u64;
        for &b in blocks {
            sum = sum.checked_add(b).unwrap_or_else(|| {
                self.overflow = true;
                u64::MAX
            });
            self.heap_alloc(Key::Transient, b);
        }
        self.add(Category::Temporaries, sum);
        sum
    }

    /// Feeds every tensor made live or dead to `heap`.
    pub(super) fn with_heap(mut self, heap: Heap) -> Replay<'a> {
        self.heap = Some(heap);
        self
    }

    fn heap_alloc(&mut self, key: Key, bytes: u64) {
        let tape = self.tape;
        let steps = &self.storage_steps;
        let of_storage = |s: StorageId| steps.get(s).copied().flatten();
        let of_value = |v: ValueId| tape.values.get(v).and_then(|val| of_storage(val.storage));
        if let Some(h) = &mut self.heap {
            // The step whose tensor the block holds (only recorded): a temporary belongs to
            // the step being processed; state shared by all parameters, an EMA copy and the
            // buffers of several GPUs' engines to none.
            let owner = if h.recording() {
                match key {
                    Key::Storage(s) => of_storage(s),
                    Key::Grad(v)
                    | Key::ParamGrad(v)
                    | Key::MasterGrad(v)
                    | Key::Master(v)
                    | Key::State(v) => of_value(v),
                    Key::Moved | Key::Transient | Key::StepTemporaries => h.at_step(),
                    Key::SharedState
                    | Key::Ema
                    | Key::DdpBucket
                    | Key::Gathered(_)
                    | Key::GatherBuffer(_)
                    | Key::ReduceBuffer(_)
                    | Key::ShardGrads(_) => None,
                }
            } else {
                None
            };
            h.alloc(key, bytes, owner);
        }
    }

    /// Records every operation of the allocator ([`Heap::record`]), each with the steps it
    /// belongs to.
    pub(super) fn record_heap(&mut self) {
        let tape = self.tape;
        let mut steps: TiVec<StorageId, Option<usize>> = ti_vec![None; tape.storages.len()];
        for i in 0..tape.steps.len() {
            for s in touched(tape, i) {
                if let Some(slot) = steps.get_mut(s) {
                    slot.get_or_insert(i);
                }
            }
        }
        self.storage_steps = steps;
        if let Some(h) = &mut self.heap {
            h.record();
        }
    }

    /// Tells the allocator's record which step is being processed ([`Heap::at`]).
    fn heap_at(&mut self, step: Option<usize>) {
        if let Some(h) = &mut self.heap {
            h.at(step);
        }
    }

    /// The first step that touches parameter value `v`'s storage (when recording).
    fn value_step(&self, v: ValueId) -> Option<usize> {
        let val = self.tape.values.get(v)?;
        self.storage_steps.get(val.storage).copied().flatten()
    }

    fn heap_free(&mut self, key: Key) {
        if let Some(h) = &mut self.heap {
            h.free(key);
        }
    }

    fn heap_rename(&mut self, from: Key, to: Key) {
        if let Some(h) = &mut self.heap {
            h.rename(from, to);
        }
    }

    /// Records every event's totals in [`Replay::points`].
    pub(super) fn record(&mut self) {
        self.points = Some(Vec::new());
    }

    /// Takes a [`Snapshot`] of the live set at `event` (a replay of the same tape finds its
    /// peak at the same event).
    pub(super) fn snapshot_at(&mut self, event: usize) {
        self.snap_at = Some(event);
    }

    /// Whether the next [`Replay::check`] is the snapshot's event.
    fn snapshot_due(&self) -> bool {
        self.snap_at == Some(self.events)
    }

    /// At the snapshot's event, the activation gradients live then (the backward pass holds
    /// them).
    fn snapshot_grads(&mut self, grads: &HashMap<ValueId, u64>) {
        if self.snapshot_due() {
            let mut live: Vec<(ValueId, u64)> = grads.iter().map(|(&v, &b)| (v, b)).collect();
            live.sort_unstable();
            self.snapshot.get_or_insert_with(Snapshot::default).grads = live;
        }
    }

    /// Takes the snapshot of the storages and parameter gradients (activation gradients are
    /// added by the backward pass, which holds them).
    fn take_snapshot(&mut self) {
        let storages = self
            .live
            .iter_enumerated()
            .filter(|&(_, &l)| l)
            .map(|(s, _)| (s, self.category(s), self.counted_bytes(s)))
            .collect();
        let snap = self.snapshot.get_or_insert_with(Snapshot::default);
        snap.storages = storages;
        snap.param_grads.clone_from(&self.param_grads);
    }

    /// The error the running totals met, if any. An overflow comes first: a total saturated
    /// at `u64::MAX` then goes below zero when its tensors are freed, so an underflow after an
    /// overflow is the overflow's doing, not a bug.
    pub(super) fn error(&self) -> Option<Error> {
        if self.overflow {
            Some(Error::Overflow("the memory total of the step".into()))
        } else if self.underflow {
            Some(Error::Internal(
                "a memory total of the step went below zero",
            ))
        } else {
            None
        }
    }

    /// The bytes a live storage counts on this GPU: a parameter's shard under a sharded plan
    /// ([`Replay::start`]), else the whole storage.
    fn counted_bytes(&self, s: StorageId) -> u64 {
        let storage = &self.tape.storages[s];
        match self.dist.and_then(|d| d.resident.get(&s)) {
            Some(&bytes) if storage.kind == StorageKind::Parameter => bytes,
            _ => storage.bytes,
        }
    }

    fn category(&self, s: StorageId) -> Category {
        match self.tape.storages[s].kind {
            StorageKind::Parameter => Category::Parameters,
            StorageKind::Buffer => Category::Buffers,
            StorageKind::Input => Category::Input,
            StorageKind::KvCache | StorageKind::PastKvCache => Category::KvCache,
            StorageKind::Carried => Category::Activations,
            StorageKind::Activation => self.act_cat[s],
        }
    }

    /// Adds to a category's running total; an overflow saturates and is reported at the end.
    fn add(&mut self, c: Category, bytes: u64) {
        let cur = &mut self.cur[c.index()];
        *cur = cur.checked_add(bytes).unwrap_or_else(|| {
            self.overflow = true;
            u64::MAX
        });
    }

    /// Takes from a category's running total; going below zero is a bug, reported at the end.
    fn sub(&mut self, c: Category, bytes: u64) {
        let cur = &mut self.cur[c.index()];
        *cur = cur.checked_sub(bytes).unwrap_or_else(|| {
            self.underflow = true;
            0
        });
    }

    fn alloc(&mut self, s: StorageId) {
        if !self.live[s] {
            self.live[s] = true;
            let bytes = self.tape.storages[s].bytes;
            self.add(self.category(s), bytes);
            self.heap_alloc(Key::Storage(s), bytes);
        }
    }

    fn free(&mut self, s: StorageId) {
        if self.live[s] {
            self.live[s] = false;
            self.sub(self.category(s), self.tape.storages[s].bytes);
            self.heap_free(Key::Storage(s));
        }
    }

    /// Records the totals now, during `phase` in `layer`, at `at`.
    fn check(&mut self, phase: Phase, layer: Option<LayerId>, at: At) {
        let total = self
            .cur
            .iter()
            .try_fold(0u64, |a, &c| a.checked_add(c))
            .unwrap_or_else(|| {
                self.overflow = true;
                u64::MAX
            });
        for (m, c) in self.max.iter_mut().zip(self.cur) {
            *m = (*m).max(c);
        }
        self.window_peak = self.window_peak.max(total);
        if phase == Phase::Forward {
            let acts = self.cur[Category::Activations.index()]
                .saturating_add(self.cur[Category::Temporaries.index()]);
            self.live_act_max = self.live_act_max.max(acts);
        }
        if let Some(points) = &mut self.points {
            points.push(TimePoint {
                event: self.events,
                phase,
                bytes: self.cur,
            });
        }
        if let Some(log) = &mut self.log {
            log.push(Event {
                at,
                bytes: self.cur,
            });
        }
        if self.snapshot_due() {
            self.take_snapshot();
        }
        if total > self.peak {
            self.peak = total;
            self.peak_phase = phase;
            self.peak_layer = layer;
            self.at_peak = self.cur;
            self.peak_event = self.events;
        }
        self.events += 1;
    }

    /// The live total now (saturating).
    pub(super) fn total(&self) -> u64 {
        self.cur.iter().fold(0u64, |a, &b| a.saturating_add(b))
    }

    /// Live bytes of one category now.
    pub(super) fn now(&self, c: Category) -> u64 {
        self.cur[c.index()]
    }

    /// Adds bytes that the tape does not hold to a category (pipeline parallelism: other
    /// micro-batches in flight, other model chunks of the same GPU).
    pub(super) fn preload(&mut self, c: Category, bytes: u64) {
        self.add(c, bytes);
    }

    /// Takes back bytes added by [`Replay::preload`].
    pub(super) fn unload(&mut self, c: Category, bytes: u64) {
        self.sub(c, bytes);
    }

    /// Frees the tensors received before the pass ([`StorageKind::Carried`]): a pipeline
    /// stage drops a micro-batch's received input after its backward.
    pub(super) fn free_carried(&mut self) {
        let tape = self.tape;
        for (s, storage) in tape.storages.iter_enumerated() {
            if storage.kind == StorageKind::Carried && self.live[s] {
                self.free(s);
            }
        }
    }

    /// Starts a new window for [`Replay::window_peak`].
    pub(super) fn open_window(&mut self) {
        self.window_peak = 0;
    }

    /// Between two micro-batches of gradient accumulation: the training loop drops the
    /// micro-batch's output and loss (HF Trainer's `training_step` returns `loss.detach()`), so
    /// every activation still live is freed; the parameters' `.grad` stay.
    pub(super) fn end_micro_batch(&mut self) {
        let tape = self.tape;
        for (s, storage) in tape.storages.iter_enumerated() {
            if storage.kind == StorageKind::Activation && self.live[s] {
                self.free(s);
            }
        }
        self.act_cat.clone_from(&self.act_cat_start);
    }

    /// Before the step: parameters, buffers, the input batch and its labels, the optimizer
    /// state and master weights exist, and so do a decode step's past caches and carried
    /// tensors ([`StorageKind::PastKvCache`], [`StorageKind::Carried`]).
    pub(super) fn start(&mut self, state_bytes: u64, master_bytes: u64) {
        for (s, storage) in self.tape.storages.iter_enumerated() {
            if matches!(
                storage.kind,
                StorageKind::Parameter
                    | StorageKind::Buffer
                    | StorageKind::Input
                    | StorageKind::PastKvCache
                    | StorageKind::Carried
            ) {
                match self.dist.and_then(|d| d.resident.get(&s)) {
                    // A parameter on one rank of a sharded plan: its shard.
                    Some(&bytes) if storage.kind == StorageKind::Parameter => {
                        self.live[s] = true;
                        self.add(Category::Parameters, bytes);
                    }
                    _ => self.alloc(s),
                }
            }
        }
        self.add(Category::OptimizerState, state_bytes);
        self.add(Category::MasterWeights, master_bytes);
        if let Some(d) = self.dist {
            self.add(Category::CommBuffers, d.comm_always);
            self.add(Category::Gradients, d.grads_always);
        }
        self.check(Phase::Forward, None, At::Start);
    }

    /// The forward pass: each step allocates, then frees the activations it used last, unless
    /// autograd keeps them for backward (in training) or the caller holds them.
    pub(super) fn forward(&mut self, training: bool) {
        let (tape, facts) = (self.tape, self.facts);
        let units = self.dist.map_or(&[][..], |d| &d.units[..]);
        // ZeRO-3 starts each forward with a fresh prefetch queue (`reset_step`, from the
        // module's forward pre-hook).
        self.queue = (0, 0);
        for (i, step) in tape.steps.iter().enumerate() {
            if let Some(h) = &mut self.heap {
                h.note(|| format!("# F {i} {:?} {}", step.op, tape.layers[step.layer].path));
            }
            self.heap_at(Some(i));
            for (u, unit) in units.iter().enumerate() {
                if unit.steps.start == i {
                    self.gather(u, Phase::Forward, Some(step.layer));
                }
            }
            // ZeRO-3 prefetches as each module's forward starts: here each layer's.
            if i == 0 || tape.steps[i - 1].layer != step.layer {
                self.prefetch(
                    units.iter().position(|u| u.steps.contains(&i)),
                    Phase::Forward,
                );
            }
            let scratch = self.scratch(&step.scratch.0);
            for &s in &step.allocs {
                self.alloc(s);
            }
            let a2a = self
                .dist
                .and_then(|d| d.step_comm.get(&i).copied())
                .unwrap_or(0);
            self.add(Category::CommBuffers, a2a);
            self.check(Phase::Forward, Some(step.layer), At::Forward(i));
            self.sub(Category::CommBuffers, a2a);
            self.sub(Category::Temporaries, scratch);
            self.heap_free(Key::Transient);
            let locals = if i == facts.returns {
                &tape.forward_held[..]
            } else {
                &[]
            };
            for s in touched(tape, i).chain(locals.iter().copied()) {
                let free = match tape.storages[s].kind {
                    StorageKind::Activation => true,
                    // Tensors from before the pass die at their last use; nothing saves them.
                    StorageKind::PastKvCache | StorageKind::Carried => !training,
                    _ => false,
                } && facts.last_use[s] <= i
                    && !(training && facts.saved_fwd[s])
                    && !facts.held[s];
                if free {
                    self.free(s);
                }
            }
            for (u, unit) in units.iter().enumerate() {
                if unit.steps.end == i + 1 && unit.reshard_after_forward {
                    self.release(u);
                }
            }
        }
        self.heap_at(None);
        let last = std::mem::take(&mut self.pending_gather);
        self.sub(Category::CommBuffers, last);
        if let Some(p) = self.pending_unit.take() {
            self.heap_free(Key::GatherBuffer(p));
        }
    }

    /// The backward pass, steps in reverse: a checkpointed segment is recomputed before its
    /// last step's backward; each step allocates its inputs' gradients (a parameter's persists
    /// in `.grad` in `param_grad` dtype when given, an activation's dies when consumed), then
    /// frees what only it had saved.
    ///
    /// `accumulate`: the `.grad` a previous micro-batch left (gradient accumulation): a parameter
    /// that has one gets the new gradient added into it in place (autograd's `AccumulateGrad`:
    /// `variable_grad += new_grad` outside grad mode), so the new one is transient.
    /// `in_backward`: the optimizer runs inside backward (torchtune's `optimizer_in_bwd`): each
    /// parameter gradient is applied as soon as it is accumulated, with that parameter's step
    /// temporaries (the function's bytes for it), and freed (`zero_grad(set_to_none=True)` in
    /// the post-accumulate-grad hook), so gradients never pile up.
    pub(super) fn backward(
        &mut self,
        param_grad: Option<(DType, DType)>,
        accumulate: Option<&TiVec<ValueId, bool>>,
        in_backward: Option<&dyn Fn(ValueId) -> u64>,
    ) -> Backward {
        let tape = self.tape;
        let facts = self.facts;
        let mut grads: HashMap<ValueId, u64> = HashMap::default();
        let mut shared = Shared::default();
        let mut has_grad: TiVec<ValueId, bool> =
            accumulate.map_or_else(|| ti_vec![false; tape.values.len()], Clone::clone);
        let mut fresh: TiVec<ValueId, bool> = ti_vec![false; tape.values.len()];
        // Parameters whose gradient is reduced to a shard with their unit (FSDP2, ZeRO-3):
        // after the reduction the whole `.grad` is gone (FSDP2 `FSDPParam.reduce_scatter_grad`
        // ... `unsharded_param.grad = None`; ZeRO-3 `partition_grads` frees `param.grad`), so a
        // later micro-batch makes it whole again, kept until the unit's reduction.
        let mut sharded: TiVec<ValueId, bool> = ti_vec![false; tape.values.len()];
        let per_unit: HashSet<ValueId> = match self.dist {
            Some(d) if matches!(d.reduce, Reduce::PerUnit { .. }) => d
                .units
                .iter()
                .flat_map(|u| u.grads.iter().map(|&(v, _, _)| v))
                .collect(),
            _ => HashSet::default(),
        };
        let mut gradient_bytes = 0u64;
        let mut applied = 0u64;
        let seg_by_end: HashMap<usize, SegmentId> = tape
            .segments
            .iter_enumerated()
            .map(|(g, s)| (s.end, g))
            .collect();
        let seg_by_start: HashMap<usize, SegmentId> = tape
            .segments
            .iter_enumerated()
            .map(|(g, s)| (s.start, g))
            .collect();
        let temp = Category::Temporaries;
        let dist = self.dist;
        let units = dist.map_or(&[][..], |d| &d.units[..]);
        let comm_backward = dist.map_or(0, |d| d.comm_backward);
        let grads_in_backward = dist.is_none_or(|d| d.grads_in_backward);
        self.add(Category::CommBuffers, comm_backward);
        let recv_grad = self.recv_grad;
        self.add(Category::CommBuffers, recv_grad);
        for i in (0..tape.steps.len()).rev() {
            for (u, unit) in units.iter().enumerate() {
                if unit.steps.end == i + 1 {
                    self.gather(u, Phase::Backward, Some(tape.steps[i].layer));
                }
            }
            // ... and as each module's backward starts.
            if tape
                .steps
                .get(i + 1)
                .is_none_or(|s| s.layer != tape.steps[i].layer)
            {
                self.prefetch(
                    units.iter().position(|u| u.steps.contains(&i)),
                    Phase::Backward,
                );
            }
            if let Some(&g) = seg_by_end.get(&(i + 1)) {
                self.recompute(g, &grads);
            }
            let step = &tape.steps[i];
            if let Some(h) = &mut self.heap {
                h.note(|| format!("# B {i} {:?} {}", step.op, tape.layers[step.layer].path));
            }
            self.heap_at(Some(i));
            let mut transient = 0u64;
            let mut moved: Option<u64> = None;
            // A view of a shared block handed on (its first output that holds one): the
            // inputs join the block, then the output's view goes.
            let mut handed: Option<ValueId> = None;
            // The input that took the moved gradient: later inputs take views of it.
            let mut taker: Option<ValueId> = None;
            if step.view_grad {
                handed = step
                    .outputs
                    .iter()
                    .copied()
                    .find(|o| shared.of.contains_key(o));
                let mut sum = Some(0u64);
                let mut any = false;
                for o in &step.outputs {
                    if shared.of.contains_key(o) {
                        continue;
                    }
                    if let Some(b) = grads.remove(o) {
                        any = true;
                        sum = sum.and_then(|s| s.checked_add(b));
                        self.heap_rename(Key::Grad(*o), Key::Moved);
                    }
                }
                if any || handed.is_none() {
                    moved = Some(sum.unwrap_or_else(|| {
                        self.overflow = true;
                        u64::MAX
                    }));
                }
            }
            if !step.grads.is_empty() {
                transient = self.scratch(&step.scratch.1);
                self.sub(temp, transient);
            }
            // Each input's formula, then the engine's reductions ([`Step::reduced`]): a reduced
            // input's formula block first (a transient, freed with the step), its own
            // gradient after every formula, in input order.
            let reduced_in_order = step
                .inputs
                .iter()
                .filter(|&&v| step.reduced.iter().any(|&(r, _)| r == v));
            let formulas = step.grads.iter().map(|&v| {
                let block = step.reduced.iter().find(|&&(r, _)| r == v).map(|&(_, b)| b);
                (v, block)
            });
            let mut seen_reduced: Vec<ValueId> = Vec::new();
            let order: Vec<(ValueId, Option<u64>)> = formulas
                .chain(reduced_in_order.filter_map(|&v| {
                    if seen_reduced.contains(&v) {
                        None
                    } else {
                        seen_reduced.push(v);
                        Some((v, None))
                    }
                }))
                .collect();
            for (v, formula) in order {
                if let Some(b) = formula {
                    if b > 0 {
                        transient = transient.saturating_add(b);
                        self.heap_alloc(Key::Transient, b);
                    }
                    continue;
                }
                // A reduced input gets a block of its own, never a view of the output's.
                let own = step.reduced.iter().any(|&(r, _)| r == v);
                let val = &tape.values[v];
                // Parameter gradients take the recipe's gradient dtype (a float32 accumulation
                // buffer under `mixed-bf16-fp32-grads`); activation gradients their value's.
                let dtype = match param_grad {
                    Some((weights, grad)) if val.param && val.dtype == weights => grad,
                    _ => val.dtype,
                };
                // A parameter's gradient can be larger than its local part (tensor parallelism:
                // `Tape::grad_shapes`).
                let shape = tape.grad_shapes.get(&v).unwrap_or(&val.shape);
                let Some(mut bytes) = shape.numel().and_then(|n| dtype.bytes_for(n)) else {
                    self.overflow = true;
                    continue;
                };
                // Expert parallelism: the gradient of this rank's experts only.
                if let Some(d) = dist
                    && d.expert_values.contains(&v)
                {
                    bytes /= d.expert_ranks.max(1);
                }
                if val.param
                    && let Some(temps) = in_backward
                {
                    // Applied and freed at once: the gradient and its step's temporaries are
                    // live at this step only.
                    if !has_grad[v] {
                        has_grad[v] = true;
                        gradient_bytes = gradient_bytes.saturating_add(bytes);
                    }
                    self.add(Category::Gradients, bytes);
                    applied = applied.saturating_add(bytes);
                    self.heap_alloc(Key::Transient, bytes);
                    let t = temps(v);
                    transient = transient.saturating_add(t);
                    if t > 0 {
                        self.heap_alloc(Key::Transient, t);
                    }
                } else if val.param {
                    if has_grad[v] && (fresh[v] || !per_unit.contains(&v)) {
                        transient = transient.saturating_add(bytes);
                        self.heap_alloc(Key::Transient, bytes);
                    } else {
                        if has_grad[v] {
                            // A carried shard: this micro-batch's whole gradient is new.
                            sharded[v] = true;
                        } else {
                            gradient_bytes = gradient_bytes.saturating_add(bytes);
                        }
                        has_grad[v] = true;
                        fresh[v] = true;
                        if grads_in_backward {
                            self.add(Category::Gradients, bytes);
                            self.heap_alloc(Key::ParamGrad(v), bytes);
                        }
                        if self.snap_at.is_some() {
                            self.param_grads.push((v, bytes));
                        }
                        self.bucket_grad(v, bytes, step.layer);
                    }
                } else if !own && let Some(m) = moved.take() {
                    // The input's gradient is a view of the output's; when the input already has
                    // one, autograd adds this one into it and it dies.
                    match grads.entry(v) {
                        Entry::Vacant(e) => {
                            e.insert(m);
                            self.heap_rename(Key::Moved, Key::Grad(v));
                            taker = Some(v);
                        }
                        Entry::Occupied(_) => {
                            self.sub(temp, m);
                            transient = transient.saturating_add(m);
                            self.heap_rename(Key::Moved, Key::Transient);
                        }
                    }
                } else if !own && let Some(holder) = handed.or(taker).filter(|_| step.view_grad) {
                    // Another input of a backward that passes the gradient on: a view of the
                    // same block, or, when the input has a gradient already, added into it
                    // in place (autograd's `InputBuffer::accumulate`): nothing is allocated.
                    if !grads.contains_key(&v) {
                        shared.join(&mut grads, holder, v);
                    }
                } else if let Entry::Vacant(e) = grads.entry(v) {
                    e.insert(bytes);
                    self.add(temp, bytes);
                    self.heap_alloc(Key::Grad(v), bytes);
                } else {
                    transient = transient.saturating_add(bytes);
                    self.heap_alloc(Key::Transient, bytes);
                }
            }
            if let Some(m) = moved {
                // Nothing took the view: the gradient dies here.
                self.sub(temp, m);
                self.heap_free(Key::Moved);
            }
            self.add(temp, transient);
            let a2a = dist.and_then(|d| d.step_comm.get(&i).copied()).unwrap_or(0);
            self.add(Category::CommBuffers, a2a);
            self.snapshot_grads(&grads);
            self.check(Phase::Backward, Some(step.layer), At::Backward(i));
            self.sub(Category::CommBuffers, a2a);
            self.sub(temp, transient);
            self.heap_free(Key::Transient);
            self.sub(Category::Gradients, applied);
            applied = 0;
            if let Some(o) = handed {
                self.release_grad(&mut grads, &mut shared, o);
            }
            if !step.view_grad {
                for &o in &step.outputs {
                    self.release_grad(&mut grads, &mut shared, o);
                }
            }
            let frees = |s: StorageId| facts.bwd_free_at[s] == Some(i) && !facts.held[s];
            for &s in &step.saves {
                if frees(s) && tape.storages[s].kind == StorageKind::Activation {
                    self.free(s);
                }
            }
            if let Some(&g) = seg_by_start.get(&i) {
                for &s in &facts.seg_inputs[g] {
                    // A checkpointed block's inputs go with its backward (a pipeline stage's
                    // received activations too), but not the input batch, parameters or
                    // buffers, which the training loop and the module hold (a block that reads
                    // the input batch directly).
                    let owned = matches!(
                        tape.storages[s].kind,
                        StorageKind::Input | StorageKind::Parameter | StorageKind::Buffer
                    );
                    if frees(s) && !owned {
                        self.free(s);
                    }
                }
            }
            // Units end in reverse order of their start (the root, which spans the step,
            // last): its parameters are resharded, then its gradients reduced.
            for (u, unit) in units.iter().enumerate().rev() {
                if unit.steps.start == i {
                    self.release(u);
                    self.reduce_unit(u, (&fresh, &sharded), Some(tape.steps[i].layer));
                }
            }
        }
        self.heap_at(None);
        // DeepSpeed's backward epilogue reduces the last bucket, then releases the bucket
        // (`_release_ipg_buffers`).
        self.reduce_bucket(None);
        self.sub(Category::CommBuffers, comm_backward);
        self.sub(Category::CommBuffers, recv_grad);
        let leftover = grads
            .values()
            .try_fold(0u64, |a, &b| a.checked_add(b))
            .unwrap_or_else(|| {
                self.overflow = true;
                u64::MAX
            });
        self.sub(temp, leftover);
        let mut left: Vec<ValueId> = grads
            .keys()
            .map(|v| shared.of.get(v).copied().unwrap_or(*v))
            .collect();
        left.sort_unstable();
        left.dedup();
        for v in left {
            self.heap_free(Key::Grad(v));
        }
        Backward {
            gradient_bytes,
            has_grad,
        }
    }

    /// Drops `o`'s activation gradient once its consumer has run: frees it, or, when it is a
    /// view of a shared block, frees the block with its last holder.
    fn release_grad(&mut self, grads: &mut HashMap<ValueId, u64>, shared: &mut Shared, o: ValueId) {
        if shared.of.contains_key(&o) {
            if let Some((block, b)) = shared.leave(grads, o) {
                self.sub(Category::Temporaries, b);
                self.heap_free(Key::Grad(block));
            }
        } else if let Some(b) = grads.remove(&o) {
            self.sub(Category::Temporaries, b);
            self.heap_free(Key::Grad(o));
        }
    }

    /// Recomputes checkpointed segment `g`: what its own operators save stays for their
    /// backward; everything else (the recomputed block output included) is dropped after its
    /// last use inside the block. The recomputation stops after the last operator that saves
    /// something, as non-reentrant `torch.utils.checkpoint` does by default (early stop:
    /// `_StopRecomputationError` once every saved tensor is recomputed).
    fn recompute(&mut self, g: SegmentId, grads: &HashMap<ValueId, u64>) {
        let (tape, facts) = (self.tape, self.facts);
        let seg = &tape.segments[g];
        let kept: HashSet<StorageId> = tape.steps[seg.start..seg.end]
            .iter()
            .flat_map(|s| s.saves.iter().copied())
            .collect();
        let mut replayed = Vec::new();
        // Early stop: the recomputation ends with the last operator that saves something.
        let stop = (seg.start..seg.end)
            .rev()
            .find(|&j| !tape.steps[j].saves.is_empty())
            .map_or(seg.start, |j| j + 1);
        for j in seg.start..stop {
            let step = &tape.steps[j];
            if let Some(h) = &mut self.heap {
                h.note(|| format!("# R {j} {:?} {}", step.op, tape.layers[step.layer].path));
            }
            self.heap_at(Some(j));
            for &s in &step.allocs {
                if !self.live[s] {
                    self.act_cat[s] = if kept.contains(&s) {
                        Category::Activations
                    } else {
                        Category::Temporaries
                    };
                    self.alloc(s);
                    replayed.push(s);
                }
            }
            self.snapshot_grads(grads);
            self.check(Phase::Backward, Some(step.layer), At::Recompute(j));
            for &s in &replayed {
                let last = facts.last_use[s].min(seg.end - 1);
                if self.live[s] && !kept.contains(&s) && (last <= j || j + 1 == stop) {
                    self.free(s);
                }
            }
        }
    }

    /// An EMA update after the optimizer step: its temporaries (`bytes`) on top of what the
    /// step leaves.
    pub(super) fn ema_update(&mut self, bytes: u64) {
        self.add(Category::Temporaries, bytes);
        self.check(Phase::OptimizerStep, None, At::EmaUpdate);
        self.sub(Category::Temporaries, bytes);
    }

    /// The optimizer step. Under a `mixed-*` recipe with 16-bit gradients the optimizer first
    /// gets float32 copies of them and the 16-bit ones are freed (Megatron's
    /// `_copy_model_grads_to_main_grads`: `main_param.grad = model_param.grad.float()`,
    /// `model_param.grad = None`); then the step's temporaries. Returns the step's temporaries
    /// (copies included).
    pub(super) fn optimizer_step(&mut self, plan: &OptimizerPlan<ValueId>, bwd: &Backward) -> u64 {
        let (copies, freed) =
            plan.master_grad_copies(|v| bwd.has_grad.get(v).copied().unwrap_or(false));
        let temp_bytes = copies.saturating_add(plan.temp_bytes);
        // DeepSpeed ZeRO-1/2: the gradients outside the partition are freed, the partition is
        // flattened into float32 beside `grads_in_partition`, which is then freed.
        let mut flat = 0;
        if let Some(b) = self.dist.and_then(|d| d.buckets.as_ref()) {
            // `scaled_global_norm`: `get_grad_norm_direct` takes each partition gradient's norm
            // through a float64 copy (`g.data.double()`), one at a time.
            self.add(Category::Temporaries, b.norm_temp_bytes);
            self.check(Phase::OptimizerStep, None, At::OptimizerStep);
            self.sub(Category::Temporaries, b.norm_temp_bytes);
            let outside = std::mem::take(&mut self.bucket_kept);
            self.sub(Category::Gradients, outside);
            flat = b.flat_bytes;
            self.add(Category::Gradients, flat);
            self.check(Phase::OptimizerStep, None, At::OptimizerStep);
            if std::mem::take(&mut self.partition_buffer) {
                self.sub(Category::Gradients, b.in_partition_bytes);
            }
        }
        let _ = bwd;
        self.sub(Category::Gradients, freed);
        self.add(Category::Temporaries, temp_bytes);
        self.check(Phase::OptimizerStep, None, At::OptimizerStep);
        self.sub(Category::Temporaries, temp_bytes);
        self.add(Category::Gradients, freed);
        // The float32 gradient partition is dropped after the step.
        self.sub(Category::Gradients, flat);
        temp_bytes
    }

    /// DeepSpeed ZeRO-1/2's hook on a parameter gradient just made ([`super::parallel::Buckets`]).
    fn bucket_grad(&mut self, v: ValueId, bytes: u64, layer: LayerId) {
        let Some(b) = self.dist.and_then(|d| d.buckets.as_ref()) else {
            return;
        };
        let Some(&(numel, _)) = b.params.get(&v) else {
            return;
        };
        if self.bucket_elems.saturating_add(numel) > b.cap {
            self.check(Phase::Backward, Some(layer), At::Communication);
            self.reduce_bucket(Some(layer));
        }
        if numel > b.cap {
            // Reduced on its own, from its own tensor.
            self.bucket_extra = Some((v, bytes));
        } else {
            // Copied into the bucket; its own tensor is freed.
            self.sub(Category::Gradients, bytes);
        }
        self.bucket.push(v);
        self.bucket_elems = self.bucket_elems.saturating_add(numel);
    }

    /// DeepSpeed's `reduce_ipg_grads` on the current bucket.
    fn reduce_bucket(&mut self, layer: Option<LayerId>) {
        let Some(b) = self.dist.and_then(|d| d.buckets.as_ref()) else {
            return;
        };
        let extra = self.bucket_extra.take();
        for v in std::mem::take(&mut self.bucket) {
            let in_partition = b.params.get(&v).is_some_and(|p| p.1);
            let own = extra.filter(|e| e.0 == v).map(|e| e.1);
            if in_partition {
                if !self.partition_buffer {
                    self.partition_buffer = true;
                    self.add(Category::Gradients, b.in_partition_bytes);
                }
                if let Some(bytes) = own {
                    // Copied into the partition buffer, then its own tensor is freed.
                    self.check(Phase::Backward, layer, At::Communication);
                    self.sub(Category::Gradients, bytes);
                }
            } else if let Some(bytes) = own {
                if b.stage >= 2 {
                    self.sub(Category::Gradients, bytes);
                } else {
                    self.bucket_kept = self.bucket_kept.saturating_add(bytes);
                }
            }
        }
        self.bucket_elems = 0;
    }
}

/// The caching allocator's run of the step: what exists before it, in the order PyTorch makes
/// it, a first step that creates the optimizer state, and the measured step.
impl Replay<'_> {
    /// `model.to("cuda")`, then the batch moved to the device: parameters and buffers in tape
    /// order (the order their layers run, which is their modules' order), then the input
    /// batch and its labels.
    ///
    /// On one rank of a data-parallel plan ([`Replay::distributed`]): each parameter's resident
    /// bytes (its FSDP shard, made as `fully_shard` makes it from a model built on the meta
    /// device or loaded shard by shard), then DDP's buckets (the wrapper is built after the
    /// model is on the device), then the batch.
    pub(super) fn load(&mut self) {
        let tape = self.tape;
        for (s, storage) in tape.storages.iter_enumerated() {
            if matches!(storage.kind, StorageKind::Parameter | StorageKind::Buffer) {
                match self.dist.and_then(|d| d.resident.get(&s)) {
                    Some(&bytes) if storage.kind == StorageKind::Parameter => {
                        if !self.live[s] {
                            self.live[s] = true;
                            self.add(Category::Parameters, bytes);
                            self.heap_alloc(Key::Storage(s), bytes);
                        }
                    }
                    _ => self.alloc(s),
                }
            }
        }
        if let Some(d) = self.dist {
            for &b in &d.ddp_buckets.initial {
                self.heap_alloc(Key::DdpBucket, b);
            }
        }
        for (s, storage) in tape.storages.iter_enumerated() {
            if storage.kind == StorageKind::Input {
                self.alloc(s);
            }
        }
    }

    /// DDP's bucket rebuild at the second iteration's forward ([`super::parallel::DdpBuckets`]):
    /// the construction's buckets are freed, the rebuilt ones allocated.
    pub(super) fn rebuild_ddp_buckets(&mut self) {
        if let Some(d) = self.dist
            && !d.ddp_buckets.initial.is_empty()
        {
            self.heap_free(Key::DdpBucket);
            for &b in &d.ddp_buckets.rebuilt {
                self.heap_alloc(Key::DdpBucket, b);
            }
        }
    }

    /// What exists before a decode step of `generate`: the past caches and the tensors carried
    /// from the previous step ([`StorageKind::PastKvCache`], [`StorageKind::Carried`]), as
    /// [`Replay::start`] has them; none outside generation.
    pub(super) fn load_past(&mut self) {
        let tape = self.tape;
        for (s, storage) in tape.storages.iter_enumerated() {
            if matches!(
                storage.kind,
                StorageKind::PastKvCache | StorageKind::Carried
            ) {
                self.alloc(s);
            }
        }
    }

    /// An EMA copy of the weights (`copy.deepcopy(model)`), tensor by tensor.
    pub(super) fn ema_copy(&mut self, tensors: impl Iterator<Item = u64>) {
        for bytes in tensors {
            self.heap_alloc(Key::Ema, bytes);
        }
    }

    /// The EMA update after the optimizer step, parameter by parameter: two temporaries of
    /// each (`s_param - param`, then its product with `1 - decay`), freed before the next
    /// ([`Replay::ema_update`] counts the largest pair).
    pub(super) fn ema_update_heap(&mut self, temporaries: &[u64]) {
        for &bytes in temporaries {
            self.heap_alloc(Key::StepTemporaries, bytes);
            self.heap_alloc(Key::StepTemporaries, bytes);
            self.heap_free(Key::StepTemporaries);
        }
    }

    /// What the optimizer makes before its first step: the float32 master copies of a
    /// `mixed-*` recipe, and state that its constructor fills (Adagrad's `sum`).
    pub(super) fn optimizer_init(&mut self, plan: &OptimizerPlan<ValueId>) {
        for t in &plan.tensors {
            self.heap_alloc(Key::Master(t.id), t.master_bytes);
        }
        if plan.eager_state {
            self.optimizer_state(plan);
        }
    }

    fn optimizer_state(&mut self, plan: &OptimizerPlan<ValueId>) {
        self.heap_alloc(Key::SharedState, plan.shared_state_bytes);
        for t in &plan.tensors {
            for &bytes in &t.state {
                self.heap_alloc(Key::State(t.id), bytes);
            }
        }
    }

    /// `optimizer.step()` tensor by tensor: the float32 gradient copies replace the 16-bit
    /// gradients; on the `first` step the state is created (`_init_group`: each parameter's
    /// tensors in turn), unless it exists already; then the temporaries, each `foreach` list
    /// over all the parameters with a gradient before the next (a for-loop step: its largest
    /// moment as one block), freed when the step ends.
    pub(super) fn optimizer_step_heap(
        &mut self,
        plan: &OptimizerPlan<ValueId>,
        bwd: &Backward,
        first: bool,
    ) {
        let has = |v: ValueId| bwd.has_grad.get(v).copied().unwrap_or(false);
        if let Some(h) = &mut self.heap {
            h.note(|| "# OPT".to_string());
        }
        for t in plan.tensors.iter().filter(|t| has(t.id)) {
            if let Some(copy) = t.grad_copy_bytes {
                self.heap_alloc(Key::MasterGrad(t.id), copy);
                self.heap_free(Key::ParamGrad(t.id));
            }
        }
        if first && !plan.eager_state {
            self.optimizer_state(plan);
        }
        if plan.foreach {
            let lists = plan.tensors.iter().map(|t| t.temporaries.len()).max();
            for j in 0..lists.unwrap_or(0) {
                for t in plan.tensors.iter().filter(|t| has(t.id)) {
                    if let Some(&bytes) = t.temporaries.get(j) {
                        let step = self.value_step(t.id);
                        self.heap_at(step);
                        self.heap_alloc(Key::StepTemporaries, bytes);
                    }
                }
            }
            self.heap_at(None);
        } else {
            self.heap_alloc(Key::StepTemporaries, plan.temp_bytes);
        }
        self.heap_free(Key::StepTemporaries);
    }

    /// The end of a step: the caller drops the output and the loss, and with them every
    /// activation still alive (and an inference pass's KV cache).
    pub(super) fn end_step(&mut self) {
        let tape = self.tape;
        for (s, storage) in tape.storages.iter_enumerated() {
            if matches!(storage.kind, StorageKind::Activation | StorageKind::KvCache) {
                self.free(s);
            }
        }
    }

    /// `optimizer.zero_grad(set_to_none=True)`: the gradients (and their float32 copies) go.
    pub(super) fn zero_grad(&mut self) {
        if let Some(h) = &mut self.heap {
            h.free_all(|k| {
                matches!(
                    k,
                    Key::ParamGrad(_) | Key::MasterGrad(_) | Key::ShardGrads(_)
                )
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A total that would go below zero is an internal error, not a wrapped number.
    #[test]
    fn underflow_is_an_internal_error() {
        let tape = Tape::default();
        let facts = Liveness::of(&tape);
        let mut r = Replay::new(&tape, &facts);
        r.add(Category::Temporaries, 10);
        r.sub(Category::Temporaries, 11);
        assert!(matches!(r.error(), Some(Error::Internal(_))));
        assert_eq!(r.cur[Category::Temporaries.index()], 0);
    }

    #[test]
    fn overflow_is_an_overflow_error() {
        let tape = Tape::default();
        let facts = Liveness::of(&tape);
        let mut r = Replay::new(&tape, &facts);
        r.add(Category::Temporaries, u64::MAX);
        r.add(Category::Temporaries, 1);
        assert!(matches!(r.error(), Some(Error::Overflow(_))));
    }
}
