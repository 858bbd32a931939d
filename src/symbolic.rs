//! Symbolic repeats: the estimate of a block repeated `N` times from traces of a few copies.
//!
//! Identical copies of a block give a periodic step. The model is traced and simulated with the
//! block's count set to 4, 5 and 6 ([`TRACED`]), and every event of each step is placed by where
//! it happens ([`At`]): outside the block (before or after it), in its first copy, in its last
//! copy, or in a middle copy `k`, at an offset within the copy. Per place, each category's live
//! bytes (and the event's position in the step) must be affine: in the count `m` outside the
//! middle copies, and in `m` and `k` jointly in them. That is checked exactly on every event of
//! the three traces; then the values at `N` follow, and the maximum of an affine function over
//! the middle copies `1..=N-2` is at `k = 1` or `k = N-2`. So the peak (the first event with the
//! largest total, as the replay picks it), its phase, layer and categories, each category's
//! maximum and the largest live activations in forward are those of full unrolling, to the
//! byte, without replaying `N` copies. The peak may move between phases as `N` grows (at 4 to 6
//! copies Llama-tiny peaks in backward, at 64 in the optimizer step): the per-place maxima see
//! it, where a line through small counts' peaks would not.
//!
//! Every other figure (parameters, gradients, optimizer state, saved bytes, per-layer rows) must
//! be affine in the count over the three traces and is extended the same way. Finally the
//! report's JSON at `N` is checked against the three traced reports leaf by leaf: each number
//! must be the affine extension of theirs and everything else equal to theirs, except the
//! figures computed here from the events (the peak and what derives from it). Any check that
//! fails, any error in a small trace, and any figure near 64 bits gives `None`: the caller
//! unrolls, which is always exact (and reports the errors). A symbolic estimate is given only
//! for a model that unrolling accepts: the tracer's [`crate::trace::MAX_STEPS`] checks are
//! made on where the unrolled trace would place each block; past them, unrolling refuses the
//! model, as it always has.
//!
//! On CUDA the caching allocator's peaks (`allocated_peak_bytes`, `reserved_peak_bytes` and
//! what derives from them) depend on the whole history of the step, not on per-place sums: each
//! trace records every request and free the allocator would be fed (without running it),
//! named by owner and place relative to the block's copies; the three records must be one
//! program (the same operations outside the middle copies, one template per run of middle
//! copies), which must make each trace's own stream exactly; the program is then played at
//! `N` copies by
//! [`crate::sim::periodic`], which plays it by the allocator itself, and on runs long enough
//! extends the allocator's state where it is provably periodic, within a budget. Past the
//! budget, with expandable segments, or on any mismatch: `None`, and the caller unrolls.
//!
//! `--timeline` and `--explain` need every event or the live set, so they unroll
//! ([`crate::estimate_observed`]).

use std::collections::HashMap;

use serde_json::Value;

use crate::graph::{Layer, Model, Node};
use crate::report::Report;
use crate::settings::Settings;
use crate::sim::periodic::{self, CopyRef, Name, Op, Stretch};
use crate::sim::{AllocatorPeaks, At, Category, Event, HeapOp, Held, Phase, Simulation};
use crate::trace::{BlockCopies, LayerId, MAX_STEPS, Tape};

/// A hash map with foldhash's fast hasher: the places, sites and names hashed here are small
/// keys looked up once per event or operation, where std's SipHash showed in profiles.
type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// The counts a block is traced with: with a first and a last copy apart, the middle copies
/// `1..=m-2` give two, three and four points per place.
pub const TRACED: [u64; 3] = [4, 5, 6];

/// Blocks of fewer copies are unrolled (three traces of 4 to 6 copies cost about 15 copies).
pub const MIN_COUNT: u64 = 16;

/// The largest figure extended: with every live total below 2^62 no running total of the
/// unrolled replay can reach 64 bits (past it, unrolling reports the overflow).
const LIMIT: i128 = 1 << 62;

/// Components of an event's vector: the categories' bytes, then the event's position.
const WIDTH: usize = Category::COUNT + 1;

/// The estimate of `model` with its most-repeated block (traced once, at least [`MIN_COUNT`]
/// copies) extended from [`TRACED`] copies; `None` when the model has no such block or a check
/// fails (the caller then unrolls). `model` is left as it was given.
pub(crate) fn estimate(
    model: &mut Model,
    settings: &Settings,
    budget: Option<u64>,
) -> Option<Report> {
    let (positions, n) = most_repeated(&model.layers)?;
    // The step as `sim` runs it once: no second micro-batch, no optimizer inside backward, no
    // plan of several GPUs (these unroll). The CUDA caching allocator is extended by
    // `cuda_peaks`, with its default configuration (expandable segments unroll).
    let plain = settings.grad_accum <= 1
        && !settings.optim_in_backward
        && settings.parallel.is_none()
        && !(settings.device == crate::vocab::Device::Cuda && settings.expandable_segments);
    if n < MIN_COUNT || !plain {
        return None;
    }
    let mut traced = Vec::with_capacity(TRACED.len());
    for m in TRACED {
        *count_at(&mut model.layers, &positions)? = m;
        let one = trace_one(model, settings, budget, &positions);
        traced.push(one);
    }
    *count_at(&mut model.layers, &positions)? = n;
    let traced: Vec<Traced> = traced.into_iter().collect::<Option<_>>()?;
    extend(&traced, n, &model.name, settings, budget)
}

/// One small trace: its tape, simulation, events, report, the block's copies and the caching
/// allocator's operations (on CUDA).
struct Traced {
    tape: Tape,
    sim: Simulation,
    events: Vec<Event>,
    report: Report,
    block: BlockCopies,
    heap: Option<Vec<HeapOp>>,
}

fn trace_one(
    model: &Model,
    settings: &Settings,
    budget: Option<u64>,
    positions: &[usize],
) -> Option<Traced> {
    let tape = crate::trace::trace(model, settings).ok()?;
    let (sim, events, heap) = crate::sim::simulate_events(&tape, settings).ok()?;
    // On CUDA the allocator's figures come from its stream (`cuda_peaks`), not the trace.
    let cuda = settings.device == crate::vocab::Device::Cuda;
    if sim.allocator.is_some() || heap.is_some() != cuda || sim.held.accumulating_peak.is_some() {
        return None;
    }
    let report = Report::new(&model.name, settings, &tape, &sim, budget).ok()?;
    let block = tape
        .repeats
        .iter()
        .find(|b| b.positions == positions)?
        .clone();
    Some(Traced {
        tape,
        sim,
        events,
        report,
        block,
        heap,
    })
}

/// The block with the most copies among those traced once (at the top level, or inside blocks
/// of one copy): its positions and count. The first of equals.
fn most_repeated(layers: &[Layer]) -> Option<(Vec<usize>, u64)> {
    let mut best: Option<(Vec<usize>, u64)> = None;
    for layer in layers {
        if let Node::Repeat { count, body, .. } = &layer.node {
            if best.as_ref().is_none_or(|(_, b)| count > b) {
                best = Some((layer.label.positions.clone(), *count));
            }
            if *count == 1
                && let Some((p, c)) = most_repeated(body)
                && best.as_ref().is_none_or(|(_, b)| c > *b)
            {
                best = Some((p, c));
            }
        }
    }
    best
}

/// The count of the block at `positions` (1-based, through blocks).
fn count_at<'a>(layers: &'a mut [Layer], positions: &[usize]) -> Option<&'a mut u64> {
    let (&first, rest) = positions.split_first()?;
    let layer = layers.get_mut(first.checked_sub(1)?)?;
    match &mut layer.node {
        Node::Repeat { count, .. } if rest.is_empty() => Some(count),
        Node::Repeat { body, .. } => count_at(body, rest),
        Node::Op(_) => None,
    }
}

/// Where a step is relative to the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Region {
    Before,
    First,
    Middle,
    Last,
    After,
}

/// An event's place: its kind (forward, backward, recompute, start, optimizer step), the region
/// and the offset in it (within the copy for a copy).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Place {
    kind: u8,
    region: Region,
    offset: usize,
}

/// The events of one place in one trace: the middle copy (0 elsewhere), the event's vector and
/// its layer.
type Points = Vec<(u64, [i128; WIDTH], Option<LayerId>)>;

/// The events of one trace by place.
type Places = Map<Place, Points>;

fn places(t: &Traced, m: u64) -> Option<Places> {
    let b = &t.block;
    let first = *b.starts.first()?;
    let copies = u64::try_from(b.starts.len()).ok()?;
    if copies != m {
        return None;
    }
    let locate = |i: usize| -> (Region, u64) {
        if i < first {
            return (Region::Before, 0);
        }
        if i >= b.end {
            return (Region::After, 0);
        }
        let k = b.starts.partition_point(|&s| s <= i) - 1;
        match k {
            0 => (Region::First, 0),
            k if k + 1 == b.starts.len() => (Region::Last, 0),
            k => (Region::Middle, k as u64),
        }
    };
    let mut out: Places = Map::default();
    for (e, ev) in t.events.iter().enumerate() {
        let (kind, step) = match ev.at {
            At::Start => (0, None),
            At::Forward(i) => (1, Some(i)),
            At::Backward(i) => (2, Some(i)),
            At::Recompute(i) => (3, Some(i)),
            At::OptimizerStep => (4, None),
            At::EmaUpdate => (5, None),
            // Several GPUs' gathers and reductions are not placed: unroll.
            At::Communication => return None,
        };
        let (region, k, offset, layer) = match step {
            None => (Region::Before, 0, 0, None),
            Some(i) => {
                let (region, k) = locate(i);
                let start = match region {
                    Region::Before => 0,
                    Region::After => b.end,
                    Region::First => first,
                    Region::Last => *b.starts.last()?,
                    Region::Middle => b.starts[usize::try_from(k).ok()?],
                };
                (region, k, i - start, Some(t.tape.steps.get(i)?.layer))
            }
        };
        let mut v = [0i128; WIDTH];
        for (x, &y) in v.iter_mut().zip(&ev.bytes) {
            *x = i128::from(y);
        }
        v[Category::COUNT] = i128::try_from(e).ok()?;
        out.entry(Place {
            kind,
            region,
            offset,
        })
        .or_default()
        .push((k, v, layer));
    }
    Some(out)
}

/// A place's extension to `n` copies: its vector at the copies where it peaks (one for a place
/// outside the middle copies, `k = 1` and `k = n-2` for a middle place), its phase and layer.
struct Extended {
    candidates: Vec<[i128; WIDTH]>,
    phase: Phase,
    layer: Option<LayerId>,
}

/// `a + b·s`, checked and within [`LIMIT`].
fn line(a: i128, b: i128, s: i128) -> Option<i128> {
    let v = a.checked_add(b.checked_mul(s)?)?;
    (0..=LIMIT).contains(&v).then_some(v)
}

fn extend_place(place: Place, per_trace: [&Points; 3], n: u64) -> Option<Extended> {
    let m0 = i128::from(TRACED[0]);
    let n = i128::from(n);
    let layer = per_trace[0].first()?.2;
    for t in per_trace {
        if t.iter().any(|(_, _, l)| *l != layer) {
            return None;
        }
    }
    let phase = match place.kind {
        0 | 1 => Phase::Forward,
        2 | 3 => Phase::Backward,
        _ => Phase::OptimizerStep,
    };
    let mut candidates = Vec::new();
    if place.region == Region::Middle {
        // v(m, k) = base + beta·(m - m0) + gamma·(k - 1), on every middle copy of every trace.
        for (t, &m) in per_trace.iter().zip(&TRACED) {
            let mut ks: Vec<u64> = t.iter().map(|(k, _, _)| *k).collect();
            ks.sort_unstable();
            if ks != (1..m - 1).collect::<Vec<_>>() {
                return None;
            }
        }
        let at = |t: usize, k: u64| per_trace[t].iter().find(|(kk, _, _)| *kk == k).map(|x| x.1);
        let base = at(0, 1)?;
        let (next_m, next_k) = (at(1, 1)?, at(0, 2)?);
        let mut lo = [0i128; WIDTH];
        let mut hi = [0i128; WIDTH];
        for c in 0..WIDTH {
            let beta = next_m[c].checked_sub(base[c])?;
            let gamma = next_k[c].checked_sub(base[c])?;
            for (t, &m) in per_trace.iter().zip(&TRACED) {
                for (k, v, _) in t.iter() {
                    let want = base[c]
                        .checked_add(beta.checked_mul(i128::from(m) - m0)?)?
                        .checked_add(gamma.checked_mul(i128::from(*k) - 1)?)?;
                    if v[c] != want {
                        return None;
                    }
                }
            }
            lo[c] = line(base[c], beta, n - m0)?;
            hi[c] = line(lo[c], gamma, n - 3)?;
        }
        candidates.push(lo);
        candidates.push(hi);
    } else {
        let mut v = [[0i128; WIDTH]; 3];
        for (slot, t) in v.iter_mut().zip(per_trace) {
            let [(_, x, _)] = t.as_slice() else {
                return None;
            };
            *slot = *x;
        }
        let mut out = [0i128; WIDTH];
        for c in 0..WIDTH {
            let d = v[1][c].checked_sub(v[0][c])?;
            if v[2][c].checked_sub(v[1][c])? != d {
                return None;
            }
            out[c] = line(v[0][c], d, n - m0)?;
        }
        candidates.push(out);
    }
    Some(Extended {
        candidates,
        phase,
        layer,
    })
}

/// `a, b, c` at 4, 5, 6 copies extended to `n`, when affine and within [`LIMIT`].
fn affine(a: u64, b: u64, c: u64, n: u64) -> Option<u64> {
    let (a, b, c) = (i128::from(a), i128::from(b), i128::from(c));
    let d = b - a;
    if c - b != d {
        return None;
    }
    let v = line(a, d, i128::from(n) - i128::from(TRACED[0]))?;
    u64::try_from(v).ok()
}

fn extend(
    traced: &[Traced],
    n: u64,
    name: &str,
    settings: &Settings,
    budget: Option<u64>,
) -> Option<Report> {
    let [a, b, c] = traced else { return None };
    // The unrolled trace must be one the tracer accepts (else it refuses the model: unroll).
    // The tracer refuses a block of several copies when its first step plus its first copy's
    // steps times its count passes `MAX_STEPS` (`at_copy_1` for this block), and any copy that
    // starts past `MAX_STEPS`. Blocks before this one are as traced (their checks passed);
    // blocks inside it are checked within its copies; blocks after it are checked where the
    // `n - 6` added copies move them. Layers after the last block are not checked.
    // Every copy traces the same operators: the step count is affine in the count.
    affine(
        a.tape.steps.len() as u64,
        b.tape.steps.len() as u64,
        c.tape.steps.len() as u64,
        n,
    )?;
    let first_copy = (c.block.starts.get(1)? - c.block.starts[0]) as u64;
    let at_copy_1 = first_copy
        .checked_mul(n)?
        .checked_add(c.block.starts[0] as u64)?;
    let added = first_copy.checked_mul(n.checked_sub(TRACED[2])?)?;
    let max = MAX_STEPS as u64;
    for r in c
        .tape
        .repeats
        .iter()
        .filter(|r| r.starts.first() >= Some(&c.block.end))
    {
        let at = |i: usize| (*r.starts.get(i)? as u64).checked_add(added);
        let mut worst = at(r.starts.len() - 1)?;
        if r.starts.len() >= 2 {
            let per = (r.starts[1] - r.starts[0]) as u64;
            worst = worst.max(at(0)?.checked_add(per.checked_mul(r.starts.len() as u64)?)?);
        }
        if worst > max {
            return None;
        }
    }
    if at_copy_1 > max {
        return None;
    }
    let per: Vec<Places> = traced
        .iter()
        .zip(TRACED)
        .map(|(t, m)| places(t, m))
        .collect::<Option<_>>()?;
    if per[1].len() != per[0].len() || per[2].len() != per[0].len() {
        return None;
    }
    let (mut peak, mut peak_at) = (0i128, None::<(i128, Phase, Option<LayerId>, [i128; WIDTH])>);
    let mut max = [0i128; Category::COUNT];
    let mut live_act_max = 0i128;
    let (acts, temps) = (
        Category::Activations as usize,
        Category::Temporaries as usize,
    );
    for (place, first) in &per[0] {
        let ext = extend_place(*place, [first, per[1].get(place)?, per[2].get(place)?], n)?;
        for v in &ext.candidates {
            let total: i128 = v[..Category::COUNT].iter().sum();
            if total > LIMIT {
                return None;
            }
            for (m, x) in max.iter_mut().zip(v) {
                *m = (*m).max(*x);
            }
            if ext.phase == Phase::Forward {
                live_act_max = live_act_max.max(v[acts] + v[temps]);
            }
            let event = v[Category::COUNT];
            let earlier = peak_at.as_ref().is_none_or(|p| event < p.0);
            if total > peak || (total == peak && total > 0 && earlier) {
                peak = total;
                peak_at = Some((event, ext.phase, ext.layer, *v));
            }
        }
    }
    let to_u64 = |x: i128| u64::try_from(x).ok();
    let mut at_peak = [0u64; Category::COUNT];
    let (peak_phase, peak_layer) = match &peak_at {
        Some((_, phase, layer, v)) => {
            for (slot, x) in at_peak.iter_mut().zip(v) {
                *slot = to_u64(*x)?;
            }
            (*phase, *layer)
        }
        None => (Phase::Forward, None),
    };
    let mut category_max = [0u64; Category::COUNT];
    for (slot, x) in category_max.iter_mut().zip(max) {
        *slot = to_u64(x)?;
    }
    let ext = |f: fn(&Simulation) -> u64| affine(f(&a.sim), f(&b.sim), f(&c.sim), n);
    let mut saved_by_layer = c.sim.saved_by_layer.clone();
    if a.sim.saved_by_layer.len() != saved_by_layer.len()
        || b.sim.saved_by_layer.len() != saved_by_layer.len()
    {
        return None;
    }
    for (i, slot) in saved_by_layer.iter_mut_enumerated() {
        *slot = affine(a.sim.saved_by_layer[i], b.sim.saved_by_layer[i], *slot, n)?;
    }
    let sim = Simulation {
        peak_bytes: to_u64(peak)?,
        peak_phase,
        peak_layer,
        at_peak,
        category_max,
        saved_bytes: ext(|s| s.saved_bytes)?,
        saved_by_layer,
        peak_live_activations: to_u64(live_act_max)?,
        gradient_bytes: ext(|s| s.gradient_bytes)?,
        optimizer_state_bytes: ext(|s| s.optimizer_state_bytes)?,
        master_weights_bytes: ext(|s| s.master_weights_bytes)?,
        optimizer_temp_bytes: ext(|s| s.optimizer_temp_bytes)?,
        resident_parameter_bytes: None,
        unsharded: None,
        cpu_bytes: [0, 0],
        paged_state_bytes: ext(|s| s.paged_state_bytes)?,
        ema_bytes: ext(|s| s.ema_bytes)?,
        held: Held {
            between_steps: ext(|s| s.held.between_steps)?,
            after_forward: ext(|s| s.held.after_forward)?,
            accumulating_peak: None,
        },
        timeline: None,
        live_at_peak: None,
        allocator: if c.heap.is_some() {
            Some(cuda_peaks(traced, n)?)
        } else {
            None
        },
        stages: Vec::new(),
        ddp_buckets: None,
    };
    let report = extend_report(
        [&a.report, &b.report, &c.report],
        &c.tape,
        &sim,
        n,
        name,
        settings,
        budget,
    )?;
    agrees([&a.report, &b.report, &c.report], &report, n).then_some(report)
}

/// The report at `n` copies: built from the last trace's tape and the extended simulation, with
/// the tape's sums (parameters, buffers, the input, the KV cache, the per-layer rows) extended
/// from the three traced reports.
fn extend_report(
    r: [&Report; 3],
    tape: &Tape,
    sim: &Simulation,
    n: u64,
    name: &str,
    settings: &Settings,
    budget: Option<u64>,
) -> Option<Report> {
    let ext = |f: fn(&Report) -> u64| affine(f(r[0]), f(r[1]), f(r[2]), n);
    let mut out = Report::new(name, settings, tape, sim, budget).ok()?;
    out.param_count = ext(|r| r.param_count)?;
    out.trainable_param_count = ext(|r| r.trainable_param_count)?;
    out.parameters_bytes = ext(|r| r.parameters_bytes)?;
    out.buffers_bytes = ext(|r| r.buffers_bytes)?;
    out.input_bytes = ext(|r| r.input_bytes)?;
    out.kv_cache_bytes = ext(|r| r.kv_cache_bytes)?;
    for (key, v) in &mut out.parameters_by_dtype {
        *v = affine(
            *r[0].parameters_by_dtype.get(key)?,
            *r[1].parameters_by_dtype.get(key)?,
            *v,
            n,
        )?;
    }
    for (key, v) in &mut out.param_count_by_dtype {
        *v = affine(
            *r[0].param_count_by_dtype.get(key)?,
            *r[1].param_count_by_dtype.get(key)?,
            *v,
            n,
        )?;
    }
    for (i, layer) in out.layers.iter_mut().enumerate() {
        let (la, lb) = (r[0].layers.get(i)?, r[1].layers.get(i)?);
        layer.repeat = affine(la.repeat, lb.repeat, layer.repeat, n)?;
        layer.params = affine(la.params, lb.params, layer.params, n)?;
        layer.parameter_bytes = affine(
            la.parameter_bytes,
            lb.parameter_bytes,
            layer.parameter_bytes,
            n,
        )?;
    }
    Some(out)
}

/// The report's top-level keys computed here from the events (and the budget check from the
/// peak), which need not be affine in the count.
const DERIVED: [&str; 11] = [
    "allocated_peak_bytes",
    "reserved_peak_bytes",
    "device_bytes",
    "total_bytes",
    "peak_bytes",
    "peak_phase",
    "peak_layer",
    "at_peak",
    "category_max",
    "peak_activations_bytes",
    "budget",
];

/// Whether `out`'s JSON is what the three traced reports say at `n` copies: every leaf outside
/// [`DERIVED`] is the affine extension of theirs (a number) or equal to theirs (anything else),
/// so a figure this module does not extend (a field added to the report later) cannot be
/// silently wrong: the caller unrolls instead.
fn agrees(r: [&Report; 3], out: &Report, n: u64) -> bool {
    let json = |r: &Report| serde_json::to_value(r).ok();
    let (Some(a), Some(b), Some(c), Some(o)) = (json(r[0]), json(r[1]), json(r[2]), json(out))
    else {
        return false;
    };
    let (Some(a), Some(b), Some(c), Some(o)) =
        (a.as_object(), b.as_object(), c.as_object(), o.as_object())
    else {
        return false;
    };
    // The traces have no allocator figures (`crate::sim::simulate_events`): derived keys may be
    // absent from them.
    let keys = |m: &serde_json::Map<String, Value>| {
        m.keys()
            .filter(|k| !DERIVED.contains(&k.as_str()))
            .cloned()
            .collect::<Vec<_>>()
    };
    if keys(a) != keys(o) || keys(b) != keys(o) || keys(c) != keys(o) {
        return false;
    }
    o.iter()
        .all(|(k, v)| DERIVED.contains(&k.as_str()) || leaf_agrees([&a[k], &b[k], &c[k]], v, n))
}

fn leaf_agrees(r: [&Value; 3], out: &Value, n: u64) -> bool {
    match (r[0], r[1], r[2], out) {
        (Value::Object(a), Value::Object(b), Value::Object(c), Value::Object(o)) => {
            a.len() == o.len()
                && b.len() == o.len()
                && c.len() == o.len()
                && o.iter().all(|(k, v)| match (a.get(k), b.get(k), c.get(k)) {
                    (Some(x), Some(y), Some(z)) => leaf_agrees([x, y, z], v, n),
                    _ => false,
                })
        }
        (Value::Array(a), Value::Array(b), Value::Array(c), Value::Array(o)) => {
            a.len() == o.len()
                && b.len() == o.len()
                && c.len() == o.len()
                && o.iter()
                    .enumerate()
                    .all(|(i, v)| leaf_agrees([&a[i], &b[i], &c[i]], v, n))
        }
        (Value::Number(a), Value::Number(b), Value::Number(c), Value::Number(o)) => {
            match (a.as_u64(), b.as_u64(), c.as_u64(), o.as_u64()) {
                (Some(a), Some(b), Some(c), Some(o)) => affine(a, b, c, n) == Some(o),
                _ => r[0] == out && r[1] == out && r[2] == out,
            }
        }
        _ => r[0] == out && r[1] == out && r[2] == out,
    }
}

/// The most work (operations played by the allocator, blocks visited in the encoded state)
/// for one count ([`periodic::run`]'s budget; about 20 ms in a release build): past it the
/// caller unrolls.
const ALLOCATOR_BUDGET: u64 = 20_000_000;

/// The most blocks the allocator's extension visits per operation that unrolling would replay
/// (a state of a hundred segment groups played copy by copy).
const VISITS_PER_OPERATION: u64 = 128;

/// The extension's budget at least (about 1 ms).
const MIN_ALLOCATOR_BUDGET: u64 = 1_000_000;

/// The caching allocator's peaks at `n` copies: the three traces' recorded operations become
/// one program ([`periodic::Stretch`]: what happens outside the middle copies, and per run of
/// middle copies one template), which must make each trace's own stream exactly
/// ([`replays`]); then it is played at `n` copies ([`periodic::run`], extended where that
/// pays). `None` on any mismatch. The program is played with the allocator's default
/// configuration, the one the traces' streams are for: `estimate` unrolls with expandable
/// segments, and `max_split_size_mb` is not a setting of memest's.
fn cuda_peaks(traced: &[Traced], n: u64) -> Option<AllocatorPeaks> {
    let mut sites = Map::default();
    let raw: Vec<Vec<Raw>> = traced
        .iter()
        .zip(TRACED)
        .map(|(t, m)| raw_program(t, m, &mut sites))
        .collect::<Option<_>>()?;
    let program = unify(&raw)?;
    for (t, m) in traced.iter().zip(TRACED) {
        if !replays(&program, m, t.heap.as_ref()?) {
            return None;
        }
    }
    // What unrolling would replay: the budget is a few block visits per operation, so that a
    // state that does not turn periodic costs little more than unrolling at once.
    let ops = program.iter().try_fold(0u64, |a, st| match st {
        Stretch::Fixed(ops) => a.checked_add(ops.len() as u64),
        Stretch::Run { ops, .. } => a.checked_add((ops.len() as u64).checked_mul(n - 2)?),
    })?;
    let budget = ops
        .saturating_mul(VISITS_PER_OPERATION)
        .clamp(MIN_ALLOCATOR_BUDGET, ALLOCATOR_BUDGET);
    let p = periodic::run(&program, n, periodic::AUTO, budget)?;
    Some(AllocatorPeaks {
        allocated_peak_bytes: p.max_allocated,
        reserved_peak_bytes: p.max_reserved,
    })
}

/// Whether `program` played at `m` copies makes exactly the allocator stream `ops` of the trace
/// of `m` copies: the same requests (bytes) and frees in the same order, each free naming the
/// block its request made. The caching allocator is deterministic, so the program then gives
/// the trace's own figures at `m` without replaying it.
fn replays(program: &[Stretch], m: u64, ops: &[HeapOp]) -> bool {
    let mut stream = ops.iter();
    // The trace's serial number of each live block of the program, by site and copy.
    let mut serials: Map<(u32, i64), u64> = Map::default();
    let same = periodic::each_op(program, m, |op, block| match (op, stream.next()?) {
        (
            Op::Alloc { bytes, .. },
            HeapOp::Alloc {
                serial, bytes: b, ..
            },
        ) if bytes == b => serials.insert(block, *serial).is_none().then_some(()),
        (Op::Free(_), HeapOp::Free { serial, .. }) => {
            (serials.remove(&block)? == *serial).then_some(())
        }
        (Op::ResetPeaks, HeapOp::ResetPeaks) => Some(()),
        _ => None,
    });
    same.is_some() && stream.next().is_none()
}

/// Whose tensor a block holds, copy aside: a step before or after the block (by its place), a
/// step of a copy (by its offset in the copy), or nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum OwnerKey {
    Before(usize),
    InCopy(usize),
    After(usize),
    Nobody,
}

/// A block's site: its owner, the step being processed when it was requested, that step's copy
/// less the owner's (both in copies), the owner's copy where counting (else 0), and an ordinal.
type Site = (OwnerKey, OwnerKey, Option<i64>, i64, u32);

/// A stretch of one trace's operations: played once, or per middle copy (the copies' operations
/// in play order, with references relative to the copy).
enum Raw {
    Fixed(Vec<Op>),
    Run {
        copies: Vec<Vec<Op>>,
        descending: bool,
    },
}

/// One trace's allocator operations as stretches. A block is named by its owner (without the
/// copy) and the ordinal of its request among that owner's (in that copy): the same name in
/// every copy. An operation is in a run when the step being processed (or the block's owner)
/// is in a middle copy.
fn raw_program(t: &Traced, m: u64, sites: &mut Map<Site, u32>) -> Option<Vec<Raw>> {
    let ops = t.heap.as_ref()?;
    let b = &t.block;
    let first = *b.starts.first()?;
    if b.starts.len() as u64 != m {
        return None;
    }
    let class = |i: usize| -> (OwnerKey, Option<i64>) {
        if i < first {
            (OwnerKey::Before(i), None)
        } else if i >= b.end {
            (OwnerKey::After(i - b.end), None)
        } else {
            // Counted from the copy's end: autocast's casts of the block's input happen in
            // the first copy only, at its start.
            let c = b.starts.partition_point(|&s| s <= i) - 1;
            let end = b.starts.get(c + 1).copied().unwrap_or(b.end);
            (OwnerKey::InCopy(end - i), Some(c as i64))
        }
    };
    let last_middle = i64::try_from(m).ok()? - 2;
    let middle = |at: Option<usize>| -> Option<i64> {
        let c = class(at?).1?;
        (1..=last_middle).contains(&c).then_some(c)
    };
    let mut ordinals: Map<Site, u32> = Map::default();
    // By serial number (the stream's blocks are numbered from 0 in request order).
    let mut names: Vec<(u32, Option<i64>)> = Vec::with_capacity(ops.len());
    let mut out: Vec<Raw> = Vec::new();
    // The current run's operations with their copies.
    let mut run: Vec<(i64, Op)> = Vec::new();
    let mut fixed: Vec<Op> = Vec::new();
    let name = |(site, c): (u32, Option<i64>), k: Option<i64>| Name {
        site,
        copy: match (c, k) {
            (None, _) => CopyRef::None,
            (Some(c), Some(k)) => CopyRef::Rel(c - k),
            (Some(c), None) => CopyRef::Start(c),
        },
    };
    for op in ops {
        let (at, named) = match *op {
            HeapOp::Alloc {
                serial, owner, at, ..
            } => {
                let (key, c) = owner.map_or((OwnerKey::Nobody, None), class);
                let (when, tc) = at.map_or((OwnerKey::Nobody, None), class);
                let gap = match (c, tc) {
                    (Some(c), Some(t)) => Some(t - c),
                    _ => None,
                };
                // The site: the owner, the step being processed (relative to the owner's copy)
                // and the ordinal among the requests of that owner at that step, in that copy.
                let ord = ordinals
                    .entry((key, when, gap, c.unwrap_or(-1), 0))
                    .or_default();
                let site_key = (key, when, gap, 0, *ord);
                *ord += 1;
                let next = sites.len() as u32;
                let site = *sites.entry(site_key).or_insert(next);
                if serial != names.len() as u64 {
                    return None;
                }
                names.push((site, c));
                (at, Some((site, c)))
            }
            HeapOp::Free { serial, at } => (at, Some(*names.get(usize::try_from(serial).ok()?)?)),
            HeapOp::ResetPeaks => (None, None),
        };
        let k = middle(at);
        let made = |n: Option<(u32, Option<i64>)>| -> Option<Op> {
            Some(match *op {
                HeapOp::Alloc { bytes, .. } => Op::Alloc {
                    name: name(n?, k),
                    bytes,
                },
                HeapOp::Free { .. } => Op::Free(name(n?, k)),
                HeapOp::ResetPeaks => Op::ResetPeaks,
            })
        };
        let o = made(named).or(matches!(op, HeapOp::ResetPeaks).then_some(Op::ResetPeaks))?;
        match k {
            Some(k) => {
                if !fixed.is_empty() {
                    out.push(Raw::Fixed(std::mem::take(&mut fixed)));
                }
                run.push((k, o));
            }
            None => {
                if !run.is_empty() {
                    out.push(split_run(std::mem::take(&mut run), last_middle)?);
                }
                fixed.push(o);
            }
        }
    }
    if !run.is_empty() {
        out.push(split_run(run, last_middle)?);
    }
    if !fixed.is_empty() {
        out.push(Raw::Fixed(fixed));
    }
    Some(out)
}

/// A run's operations by copy: each middle copy `1..=last` once, contiguous, in ascending or
/// descending order.
fn split_run(ops: Vec<(i64, Op)>, last: i64) -> Option<Raw> {
    let mut copies: Vec<(i64, Vec<Op>)> = Vec::new();
    for (k, op) in ops {
        match copies.last_mut() {
            Some((c, v)) if *c == k => v.push(op),
            _ => copies.push((k, vec![op])),
        }
    }
    let order: Vec<i64> = copies.iter().map(|(k, _)| *k).collect();
    let up: Vec<i64> = (1..=last).collect();
    let down: Vec<i64> = (1..=last).rev().collect();
    let descending = if order == up {
        false
    } else if order == down {
        true
    } else {
        return None;
    };
    Some(Raw::Run {
        copies: copies.into_iter().map(|(_, v)| v).collect(),
        descending,
    })
}

/// The program of the three traces' stretches: the same stretches in each; a run's copies all
/// one template; a fixed stretch's references to copies the same counted from the first copy
/// in all three, or from the last.
fn unify(raw: &[Vec<Raw>]) -> Option<Vec<Stretch>> {
    let [a, b, c] = raw else { return None };
    if a.len() != b.len() || a.len() != c.len() {
        return None;
    }
    let counts = TRACED.map(|m| i64::try_from(m).ok());
    let mut out = Vec::with_capacity(a.len());
    for ((x, y), z) in a.iter().zip(b).zip(c) {
        match (x, y, z) {
            (
                Raw::Run {
                    copies: cx,
                    descending: dx,
                },
                Raw::Run {
                    copies: cy,
                    descending: dy,
                },
                Raw::Run {
                    copies: cz,
                    descending: dz,
                },
            ) => {
                let template = cx.first()?;
                if dx != dy || dx != dz || cx.iter().chain(cy).chain(cz).any(|t| t != template) {
                    return None;
                }
                out.push(Stretch::Run {
                    ops: template.clone(),
                    descending: *dx,
                });
            }
            (Raw::Fixed(fx), Raw::Fixed(fy), Raw::Fixed(fz)) => {
                if fx.len() != fy.len() || fx.len() != fz.len() {
                    return None;
                }
                let mut ops = Vec::with_capacity(fx.len());
                for ((p, q), r) in fx.iter().zip(fy).zip(fz) {
                    ops.push(unify_op([p, q, r], counts)?);
                }
                out.push(Stretch::Fixed(ops));
            }
            _ => return None,
        }
    }
    Some(out)
}

/// One operation of a fixed stretch in the three traces: equal, a copy counted from the first
/// (`Start`) or from the count (`End`).
fn unify_op(ops: [&Op; 3], counts: [Option<i64>; 3]) -> Option<Op> {
    let parts = |op: &Op| -> (u8, Option<u64>, Option<Name>) {
        match *op {
            Op::Alloc { name, bytes } => (0, Some(bytes), Some(name)),
            Op::Free(name) => (1, None, Some(name)),
            Op::ResetPeaks => (2, None, None),
        }
    };
    let [p, q, r] = ops.map(parts);
    if p.0 != q.0 || p.0 != r.0 || p.1 != q.1 || p.1 != r.1 {
        return None;
    }
    let name = match (p.2, q.2, r.2) {
        (None, None, None) => None,
        (Some(x), Some(y), Some(z)) => {
            if x.site != y.site || x.site != z.site {
                return None;
            }
            let copy = if x.copy == y.copy && x.copy == z.copy {
                x.copy
            } else {
                let end = |n: Name, m: Option<i64>| match n.copy {
                    CopyRef::Start(c) => Some(c - m?),
                    _ => None,
                };
                let e = [end(x, counts[0]), end(y, counts[1]), end(z, counts[2])];
                match e {
                    [Some(d), Some(d2), Some(d3)] if d == d2 && d == d3 => CopyRef::End(d),
                    _ => return None,
                }
            };
            Some(Name { site: x.site, copy })
        }
        _ => return None,
    };
    Some(match (p.0, name) {
        (0, Some(name)) => Op::Alloc { name, bytes: p.1? },
        (1, Some(name)) => Op::Free(name),
        (2, None) => Op::ResetPeaks,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(serial: u64, bytes: u64) -> HeapOp {
        HeapOp::Alloc {
            serial,
            bytes,
            owner: None,
            at: None,
        }
    }

    fn free(serial: u64) -> HeapOp {
        HeapOp::Free { serial, at: None }
    }

    /// A block kept across the copies and a temporary per middle copy: at 4 copies, the
    /// temporaries of copies 1 and 2 between the kept block's request and free.
    #[test]
    fn replays_checks_the_whole_stream() {
        let kept = Name {
            site: 0,
            copy: CopyRef::None,
        };
        let temp = Name {
            site: 1,
            copy: CopyRef::Rel(0),
        };
        let program = vec![
            Stretch::Fixed(vec![Op::Alloc {
                name: kept,
                bytes: 100,
            }]),
            Stretch::Run {
                ops: vec![
                    Op::Alloc {
                        name: temp,
                        bytes: 10,
                    },
                    Op::Free(temp),
                ],
                descending: false,
            },
            Stretch::Fixed(vec![Op::Free(kept)]),
        ];
        let stream = [
            alloc(0, 100),
            alloc(1, 10),
            free(1),
            alloc(2, 10),
            free(2),
            free(0),
        ];
        assert!(replays(&program, 4, &stream));
        // One copy more, or less, is another stream.
        assert!(!replays(&program, 5, &stream));
        assert!(!replays(&program, 4, &stream[..5]));
        // Another size, a free of another block, a reset of the peaks where none is.
        let mut bytes = stream;
        bytes[3] = alloc(2, 11);
        assert!(!replays(&program, 4, &bytes));
        let mut swapped = stream;
        swapped.swap(4, 5);
        assert!(!replays(&program, 4, &swapped));
        let mut reset = stream;
        reset[2] = HeapOp::ResetPeaks;
        assert!(!replays(&program, 4, &reset));
    }
}
