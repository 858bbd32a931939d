//! Searching for the largest micro-batch or context that fits a budget (`--max-batch`,
//! `--max-context`), for the fewest GPUs a plan fits on (`--min-gpus`, over data-parallel
//! ranks and the model-parallel degrees of `parallel::auto`), and estimating and ranking the
//! plans on a number of GPUs (`--plan auto`).

pub use crate::report::Dimension;
use crate::report::Report;
use crate::settings::Overrides;
use crate::spec::ModelSpec;

/// The largest value of `dim` whose estimate fits `budget` bytes, with that estimate, searching
/// up from 1, or from `start` (the size asked for) when 1 is not a valid size for the model.
/// `None` when neither fits. `known`, when given, is the estimate at `start` with this
/// budget (the report already made at the size asked for): the search uses it instead of
/// estimating `start` again. See [`largest_fitting`].
#[must_use]
pub fn max_fitting(
    spec: &ModelSpec,
    name: &str,
    overrides: &Overrides,
    budget: u64,
    dim: Dimension,
    (start, known): (u64, Option<&Report>),
) -> Option<(u64, Report)> {
    let mut prober = Prober::new(spec, name, overrides, budget, dim);
    max_fitting_with(
        prober.as_mut(),
        (spec, name, overrides),
        budget,
        dim,
        (start, known),
    )
}

/// [`max_fitting`] with the estimates made by `prober` where there is one.
pub(crate) fn max_fitting_with(
    mut prober: Option<&mut Prober>,
    (spec, name, overrides): (&ModelSpec, &str, &Overrides),
    budget: u64,
    dim: Dimension,
    (start, known): (u64, Option<&Report>),
) -> Option<(u64, Report)> {
    largest_fitting(
        |v| {
            if let Some(r) = known.filter(|_| v == start) {
                return Some(r.clone());
            }
            if let Some(p) = prober.as_deref_mut() {
                return p.at(Some(v)).ok();
            }
            let mut o = overrides.clone();
            match dim {
                Dimension::Batch => o.batch = Some(v),
                Dimension::Context => o.seq = Some(v),
            }
            crate::estimate_spec(spec, name, &o, Some(budget)).ok()
        },
        start,
    )
}

/// The most layers, each copy of a repeated block counted, that a search's prober traces whole:
/// Llama-3.1-405B's config (126 decoder layers of 10 layers each, 1,266 in all) is below it,
/// a 100,000-copy repeat far above (it is extended from a few copies per estimate, as
/// [`crate::estimate_spec`] does).
pub const PROBER_LAYERS: u64 = 4096;

/// The second batch a search's prober traces the micro-batch at, after batch 1, to derive the
/// tapes of the others from (see [`crate::trace::derive`]): far enough that a size rounded up
/// to any multiple up to 65,536 (pages, padding, capacities) is not taken for a proportional
/// one.
pub const WITNESS_BATCH: u64 = 1 << 16;

/// The estimates of one model at the sizes a search tries (`--max-batch`, `--max-context`), as
/// [`crate::estimate_spec`] gives them, for less. The model is traced whole at each size
/// (every copy of a repeated block: on models of up to [`PROBER_LAYERS`] layers this costs
/// less than extending a few copies, which gives the same report to the byte, as
/// `tests/it/repeats.rs` checks). For the micro-batch, the tapes at batch 1 and at
/// [`WITNESS_BATCH`] are traced once, and the tape at any other batch is derived from them
/// ([`crate::trace::derive::at_batch`]: sizes proportional to the batch, everything else
/// equal), so that a probe costs the simulation and the report alone; where the two traces do
/// not allow it, every batch is traced. The caching allocator's replay is not linear in the
/// batch: it runs for every probe.
pub(crate) struct Prober<'a> {
    spec: &'a ModelSpec,
    name: &'a str,
    overrides: &'a Overrides,
    budget: u64,
    dim: Dimension,
    /// The tape at batch 1, once traced.
    base: Option<crate::trace::Tape>,
    /// The tapes at other batches, from batch 1's and [`WITNESS_BATCH`]'s traces.
    batched: Option<crate::trace::derive::Batched>,
    /// Cleared when tapes are not to be derived (the witness fails to trace, or the two traces
    /// are not batch-proportional): every batch is then traced.
    derive: bool,
}

impl<'a> Prober<'a> {
    /// A prober for `dim` around `overrides` (the size asked for), or `None` where each
    /// estimate is better made whole by [`crate::estimate_spec`]: generation (two passes),
    /// a multi-GPU plan (a second trace under tensor or context parallelism; an expert
    /// capacity factor), more than [`PROBER_LAYERS`] layers, or a model or settings that fail
    /// (the estimate reports why).
    pub(crate) fn new(
        spec: &'a ModelSpec,
        name: &'a str,
        overrides: &'a Overrides,
        budget: u64,
        dim: Dimension,
    ) -> Option<Self> {
        let (model, settings) = crate::prepare(spec, name, overrides).ok()?;
        let plain = settings.mode != crate::settings::Mode::Generate && settings.parallel.is_none();
        (plain && unrolled_layers(&model.layers) <= PROBER_LAYERS).then_some(Prober {
            spec,
            name,
            overrides,
            budget,
            dim,
            base: None,
            batched: None,
            derive: dim == Dimension::Batch,
        })
    }

    /// The estimate at `v` (`None`: at the size asked for), with the budget.
    ///
    /// # Errors
    /// As [`crate::estimate_spec`].
    pub(crate) fn at(&mut self, v: Option<u64>) -> Result<Report, crate::Error> {
        let (model, settings) = crate::prepare(self.spec, self.name, &self.overrides_at(v))?;
        let batch = settings.batch;
        let derived;
        let tape = match self.source(batch) {
            Source::Base => self.base.as_ref().ok_or(crate::Error::Internal(
                "the prober's tape at batch 1 is traced before it is used",
            ))?,
            Source::Derived => self
                .batched
                .as_ref()
                .map(crate::trace::derive::Batched::tape)
                .ok_or(crate::Error::Internal(
                    "the prober's tapes are derived once it has them",
                ))?,
            Source::Trace => {
                let t = crate::trace::trace(&model, &settings)?;
                if self.derive && batch == 1 {
                    &*self.base.insert(t)
                } else {
                    derived = t;
                    &derived
                }
            }
        };
        let sim = crate::sim::simulate(tape, &settings)?;
        Report::new(&model.name, &settings, tape, &sim, Some(self.budget))
    }

    fn overrides_at(&self, v: Option<u64>) -> Overrides {
        let mut o = self.overrides.clone();
        match (v, self.dim) {
            (Some(v), Dimension::Batch) => o.batch = Some(v),
            (Some(v), Dimension::Context) => o.seq = Some(v),
            (None, _) => {}
        }
        o
    }

    /// Where the tape at `batch` comes from: batch 1's as traced, or derived from batch 1's and
    /// the witness's (traced on first use), or traced.
    fn source(&mut self, batch: u64) -> Source {
        use crate::trace::derive::{Batched, NotDerived};
        if !self.derive {
            return Source::Trace;
        }
        let Some(base) = self.base.as_ref() else {
            return Source::Trace;
        };
        if batch == 1 {
            return Source::Base;
        }
        if self.batched.is_none() {
            let o = self.overrides_at(Some(WITNESS_BATCH));
            let batched = crate::prepare(self.spec, self.name, &o)
                .and_then(|(model, settings)| crate::trace::trace(&model, &settings))
                .ok()
                .and_then(|w| Batched::new((1, base), (WITNESS_BATCH, &w)).ok());
            match batched {
                Some(b) => self.batched = Some(b),
                None => {
                    self.derive = false;
                    return Source::Trace;
                }
            }
        }
        match self.batched.as_mut().map(|b| b.at(batch).map(|_| ())) {
            Some(Ok(())) => Source::Derived,
            Some(Err(NotDerived::NotProportional)) | None => {
                self.derive = false;
                self.batched = None;
                Source::Trace
            }
            Some(Err(NotDerived::Large)) => Source::Trace,
        }
    }
}

/// Where [`Prober::at`] takes a tape from.
enum Source {
    /// The tape at batch 1, as traced.
    Base,
    /// The prober's derived tape, rewritten for the batch asked for.
    Derived,
    /// A fresh trace.
    Trace,
}

/// The layers of `layers` with every copy of a block counted (at most `u64::MAX`).
fn unrolled_layers(layers: &[crate::graph::Layer]) -> u64 {
    layers.iter().fold(0u64, |n, l| match &l.node {
        crate::graph::Node::Repeat { count, body, .. } => {
            n.saturating_add(count.saturating_mul(unrolled_layers(body)))
        }
        crate::graph::Node::Op(_) => n.saturating_add(1),
    })
}

/// The largest `v ≥ 1` whose estimate fits its budget, from 1 or, when 1 does not fit or is
/// invalid, from `start`. Values whose estimate fails (an invalid shape, a size overflow) count
/// as not fitting; the search goes no higher than 2^40. Estimates grow with batch and context,
/// so the answer is the `v` that fits while `v + 1` does not: see [`bracket`] for how it is
/// found in a few estimates.
pub fn largest_fitting(
    mut estimate_at: impl FnMut(u64) -> Option<Report>,
    start: u64,
) -> Option<(u64, Report)> {
    bracket(
        |v| {
            estimate_at(v).map(|r| {
                let fits = r.budget.as_ref().is_some_and(|b| b.fits);
                let budget = r.budget.as_ref().map_or(0, |b| b.budget_bytes);
                // The lines follow the figure the budget checks (on a GPU the device bytes,
                // whose caching-allocator reserve grows faster with the batch than the tensor
                // peak), so that they cross the budget where the estimates do.
                let checked = r.budget.as_ref().map_or(r.total_bytes, |b| b.checked_bytes);
                (
                    Probe {
                        total: checked,
                        budget,
                        fits,
                    },
                    r,
                )
            })
        },
        start,
    )
}

/// The highest value [`bracket`] tries.
pub const SEARCH_LIMIT: u64 = 1 << 40;

/// One estimate as the search sees it.
#[derive(Clone, Copy, Debug)]
pub struct Probe {
    /// The figure compared with the budget (`Budget::checked_bytes`: the device, reserved or
    /// allocated bytes, or the tensor peak), in bytes.
    pub total: u64,
    /// The budget, in bytes.
    pub budget: u64,
    /// Whether that figure fits the budget.
    pub fits: bool,
}

/// The largest `v` in `1..=SEARCH_LIMIT` that fits, with its estimate, assuming that fitting is
/// monotone (every value below a fitting one fits): the answer is the `lo` of a bracket
/// `lo` fits, `hi = lo + 1` does not (or `lo` = [`SEARCH_LIMIT`]).
///
/// Estimates are nearly always affine in the batch, or piecewise affine and convex where the
/// peak moves from one phase to another, so the next value tried is where a line meets the
/// budget: after a fitting estimate, the line through the two highest fitting ones (for an
/// affine estimate, the answer); after a failing one, the chord from the highest fitting to
/// the lowest failing estimate (for a convex one, a value that fits). Lines only choose where to
/// look: the answer is always confirmed by real estimates at it and one past it. Going up, a
/// step multiplies the value by at most 1024; when three estimates have not halved the bracket,
/// the next one does. An affine estimate takes four estimates (1, 2, the crossing, one past it)
/// where doubling and bisection take about twice the answer's bit length.
pub fn bracket<T>(mut eval: impl FnMut(u64) -> Option<(Probe, T)>, start: u64) -> Option<(u64, T)> {
    let mut fits = |v: u64| eval(v).filter(|(p, _)| p.fits);
    let (mut lo, mut lo_probe, mut lo_value) = match fits(1) {
        Some((p, t)) => (1, p, t),
        None => {
            let (p, t) = fits(start)?;
            (start, p, t)
        }
    };
    // Another fitting estimate below `lo`, for the line through the two.
    let mut prev: Option<(u64, u64)> = None;
    // The lowest value known not to fit, with its total when it has one.
    let mut hi: Option<(u64, Option<u64>)> = None;
    // Whether the last estimate fitted, and the bracket's width three estimates ago.
    let mut last_fit = true;
    let (mut mark, mut since) = (u64::MAX, 0u32);
    loop {
        if lo >= SEARCH_LIMIT {
            return Some((lo, lo_value));
        }
        let budget = lo_probe.budget;
        let upper = prev.and_then(|p| crossing(p, (lo, lo_probe.total), budget));
        let next = match hi {
            Some((h, _)) if h - lo <= 1 => return Some((lo, lo_value)),
            Some((h, h_total)) => {
                // Halve the bracket when three estimates did not.
                since += 1;
                let stalled = since == 3 && h - lo > mark / 2;
                if since == 3 {
                    (mark, since) = (h - lo, 0);
                }
                let chord = h_total.and_then(|ht| crossing((lo, lo_probe.total), (h, ht), budget));
                let line = match (stalled, last_fit) {
                    (true, _) => None,
                    (false, true) => upper.or(chord),
                    (false, false) => chord,
                };
                line.map_or(lo + (h - lo) / 2, |g| g.clamp(lo + 1, h - 1))
            }
            // Upward, at most 1024 times `lo` per step (the line may be far too flat).
            None => upper
                .map_or(lo.saturating_mul(2), |g| {
                    g.clamp(lo + 1, lo.saturating_mul(1024))
                })
                .min(SEARCH_LIMIT),
        };
        match eval(next) {
            Some((p, t)) if p.fits => {
                prev = Some((lo, lo_probe.total));
                (lo, lo_probe, lo_value) = (next, p, t);
                last_fit = true;
            }
            Some((p, _)) => (hi, last_fit) = (Some((next, Some(p.total))), false),
            None => (hi, last_fit) = (Some((next, None)), false),
        }
    }
}

/// Where the line through `a` and `b` (value, total) reaches `budget`: the largest value whose
/// point on the line is at most `budget`. `None` when the line does not rise.
fn crossing(a: (u64, u64), b: (u64, u64), budget: u64) -> Option<u64> {
    let ((x0, y0), (x1, y1)) = if a.0 <= b.0 { (a, b) } else { (b, a) };
    if x1 == x0 || y1 <= y0 {
        return None;
    }
    let (dx, dy) = (u128::from(x1 - x0), u128::from(y1 - y0));
    let x = if budget >= y0 {
        u128::from(x0) + u128::from(budget - y0) * dx / dy
    } else {
        u128::from(x0).saturating_sub((u128::from(y0 - budget) * dx).div_ceil(dy))
    };
    Some(u64::try_from(x).unwrap_or(u64::MAX))
}

/// The most GPUs `--min-gpus` tries.
pub const MIN_GPUS_LIMIT: u64 = 1 << 16;

/// What `spec` allows of the model-parallel degrees ([`crate::parallel::auto::Splits`]): the
/// greatest common divisor of its attention layers' query and key/value heads (none when it
/// has no attention, or a mixture-of-experts, cross-attention or latent-attention layer,
/// which `--tp` does not split), and its repeated blocks (every copy of each outermost
/// `repeat`, as the tracer counts pipeline blocks).
#[must_use]
pub fn splits(spec: &ModelSpec) -> crate::parallel::auto::Splits {
    use crate::spec::{LayerKind, LayerSpec};
    fn gcd(a: u64, b: u64) -> u64 {
        if b == 0 { a } else { gcd(b, a % b) }
    }
    fn heads(layers: &[LayerSpec], acc: &mut Option<Option<u64>>) {
        for l in layers {
            match l.kind {
                LayerKind::Moe | LayerKind::CrossAttention | LayerKind::Mla => {
                    *acc = Some(None);
                }
                LayerKind::Attention => {
                    let h = l.heads.unwrap_or(0);
                    let kv = l.kv_heads.unwrap_or(h);
                    let g = gcd(h, kv);
                    *acc = match *acc {
                        None => Some(Some(g)),
                        Some(Some(a)) => Some(Some(gcd(a, g))),
                        Some(None) => Some(None),
                    };
                }
                _ => {}
            }
            if let Some(body) = &l.layers {
                heads(body, acc);
            }
        }
    }
    let mut acc = None;
    heads(&spec.layers, &mut acc);
    let blocks = spec
        .layers
        .iter()
        .filter(|l| l.kind == LayerKind::Repeat)
        .fold(0u64, |a, l| a.saturating_add(l.count.unwrap_or(1)));
    crate::parallel::auto::Splits {
        heads: acc.flatten().filter(|&h| h > 0),
        blocks,
    }
}

/// `--min-gpus`: the fewest GPUs on which `flags`' plan fits the budget per GPU.
///
/// At each tensor- and pipeline-parallel degree the model allows, powers of two
/// ([`crate::parallel::auto::degrees`]; only the flags' own when they give `--tp` or `--pp`),
/// in order of `tp · pp`, `fewest_ranks` finds the fewest data-parallel ranks; the answer is
/// the fewest GPUs over all of them (the smaller per-GPU figure on a tie), and a degree whose
/// model-parallel GPUs alone are more than the best so far is not tried. A
/// degree the model or the plan refuses (a setting error) is passed over, except the flags'
/// own.
///
/// # Errors
/// As [`crate::run`]; [`crate::Error::Setting`] without a budget.
pub fn min_gpus(
    spec: &ModelSpec,
    name: &str,
    query: &crate::Query,
    flags: &crate::parallel::PlanFlags,
) -> Result<(crate::report::MinGpus, Option<Overrides>), crate::Error> {
    use crate::parallel::auto;
    let budget = query.budget.ok_or_else(|| {
        crate::Error::setting(
            crate::error::SettingKey::Parallel,
            "--min-gpus needs a --budget or a --gpu (the memory of one GPU)",
        )
    })?;
    let fixed = flags.tp.is_some() || flags.pipeline.pp.is_some();
    let pairs = if fixed {
        vec![(flags.tp.unwrap_or(1), flags.pipeline.pp.unwrap_or(1))]
    } else {
        // The powers of two the model allows (`degrees` on 4,096 GPUs).
        auto::degrees(flags, 1 << 12, splits(spec))
    };
    // The fewest GPUs, their checked figure, the flags there.
    let mut best: Option<(u64, u64, Overrides)> = None;
    let mut searched = 0u64;
    // Where a degree's search ended without an answer: the smallest fixed part.
    let mut floor: Option<crate::report::FixedCost> = None;
    for (tp, pp) in pairs {
        let f = if fixed {
            flags.clone()
        } else {
            auto::at_degrees(flags, tp, pp)
        };
        let cp = flags.cp.unwrap_or(1).max(1);
        let model_parallel = tp.saturating_mul(pp).saturating_mul(cp).max(1);
        if best.as_ref().is_some_and(|(g, _, _)| model_parallel > *g) {
            continue;
        }
        let found = match fewest_ranks(spec, name, query, &f, budget, model_parallel) {
            Ok(found) => found,
            Err(crate::Error::Setting(_)) if !fixed && (tp, pp) != (1, 1) => {
                continue;
            }
            Err(e) => return Err(e),
        };
        searched = searched.max(found.1);
        if let Some(f) = found.2
            && floor.is_none_or(|b| f.fixed_bytes < b.fixed_bytes)
        {
            floor = Some(f);
        }
        if let Some((gpus, checked, o)) = found.0
            && best
                .as_ref()
                .is_none_or(|&(g, c, _)| (gpus, checked) < (g, c))
        {
            best = Some((gpus, checked, o));
        }
    }
    let gpus = best.as_ref().map(|(g, _, _)| *g);
    Ok((
        crate::report::MinGpus {
            budget_bytes: budget,
            gpus,
            searched_up_to: searched,
            fixed: floor.filter(|_| gpus.is_none()),
        },
        best.map(|(_, _, o)| o),
    ))
}

/// What [`fewest_ranks`] found: the GPUs, the checked figure less NCCL's buffers, and the
/// estimate's overrides there.
type Fewest = (u64, u64, Overrides);

/// The fewest data-parallel ranks on which `flags`' plan fits `budget` per GPU, by doubling
/// from one, then bisection (the per-GPU figure falls as more ranks share the model states;
/// when it stops falling between two doublings from two ranks on, nothing more is sharded,
/// and the search ends without an answer; the figure compared leaves out NCCL's buffers,
/// which grow from one rank to two and from two to more). World sizes are data-parallel
/// ranks × `model_parallel` (`tp · pp · cp`). Returns the GPUs, the checked figure (less
/// NCCL's buffers) and the flags' estimate overrides there, if any fit, the largest world
/// size tried, and when none fits the fixed part of the figure there
/// ([`crate::report::FixedCost`]).
fn fewest_ranks(
    spec: &ModelSpec,
    name: &str,
    query: &crate::Query,
    flags: &crate::parallel::PlanFlags,
    budget: u64,
    model_parallel: u64,
) -> Result<(Option<Fewest>, u64, Option<crate::report::FixedCost>), crate::Error> {
    // A config's `train_batch_size` fixes the world size; the search varies it (the global
    // batch grows with the ranks, as it does when a job moves to more GPUs).
    let flags = &crate::parallel::PlanFlags {
        config: flags.config.clone().map(|c| crate::parallel::ConfigPlan {
            train_batch: None,
            ..c
        }),
        ..flags.clone()
    };
    let at = |dp: u64| -> Result<(bool, u64, Overrides, crate::report::FixedCost), crate::Error> {
        let mut f = flags.clone();
        f.gpus = Some(dp.saturating_mul(model_parallel));
        let overrides = Overrides {
            parallel: f.resolve()?,
            ..query.overrides.clone()
        };
        let r = crate::estimate_observed(
            spec,
            name,
            &overrides,
            Some(budget),
            crate::sim::Observe::default(),
        )?;
        let b = r
            .budget
            .as_ref()
            .map_or((false, r.peak_bytes), |b| (b.fits, b.checked_bytes));
        // NCCL's buffers grow with the ranks (none on one, fewer connections on two), so the
        // stop rule compares the figure without them.
        let nccl = r.parallel.as_ref().map_or(0, |p| p.nccl_bytes);
        let fixed = crate::report::FixedCost::of(&r, dp.saturating_mul(model_parallel));
        Ok((b.0, b.1.saturating_sub(nccl), overrides, fixed))
    };
    let mut lo = 0u64; // the largest known not to fit
    let mut dp = 1u64;
    let mut last: Option<u64> = None;
    let found = loop {
        let (fits, checked, o, fixed) = at(dp)?;
        if fits {
            break Ok((dp, checked, o));
        }
        if last.is_some_and(|l| checked >= l) || dp.saturating_mul(model_parallel) >= MIN_GPUS_LIMIT
        {
            break Err(fixed);
        }
        // From one rank to two the figure can rise (the data-parallel engine exists only from
        // two ranks on), so the stop rule compares doublings from two ranks onward.
        if dp >= 2 {
            last = Some(checked);
        }
        lo = dp;
        dp = dp.saturating_mul(2);
    };
    let searched = dp.saturating_mul(model_parallel);
    let (mut hi, mut checked, mut best) = match found {
        Ok(found) => found,
        Err(fixed) => return Ok((None, searched, Some(fixed))),
    };
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        let (fits, c, o, _) = at(mid)?;
        if fits {
            (hi, checked, best) = (mid, c, o);
        } else {
            lo = mid;
        }
    }
    Ok((
        Some((hi.saturating_mul(model_parallel), checked, best)),
        searched,
        None,
    ))
}

/// `--plan auto`: the plans on `gpus` GPUs ([`crate::parallel::auto::candidates`]: the
/// data-parallel engines, and the tensor- and pipeline-parallel degrees the model allows),
/// each estimated as [`crate::run`] would, sorted by the figure the budget checks, then by
/// host memory. A model-parallel candidate the model refuses (a setting error: a sequence
/// that sequence parallelism cannot divide, expert parallelism that the data-parallel ranks
/// left do not divide) is left out, as is any candidate the optimizer cannot run under
/// (Adafactor on FSDP2's DTensors); other errors of the data-parallel ones are not.
///
/// # Errors
/// As [`crate::run`]; [`crate::Error::Setting`] without `--gpus`.
pub fn run_plans(
    spec: &ModelSpec,
    name: &str,
    query: &crate::Query,
    flags: &crate::parallel::PlanFlags,
) -> Result<crate::report::PlansReport, crate::Error> {
    let gpus = flags.gpus.ok_or_else(|| {
        crate::Error::setting(
            crate::error::SettingKey::Parallel,
            "--plan auto needs --gpus N (the GPUs to plan for)",
        )
    })?;
    let mut plans = Vec::new();
    for c in crate::parallel::auto::candidates(flags, gpus, splits(spec)) {
        let model_parallel = c.tp.is_some() || c.pipeline.pp.is_some();
        let estimate = c.resolve().and_then(|plan| {
            let Some(plan) = plan else { return Ok(None) };
            let overrides = Overrides {
                parallel: Some(plan.clone()),
                ..query.overrides.clone()
            };
            crate::estimate_observed(
                spec,
                name,
                &overrides,
                query.budget,
                crate::sim::Observe::default(),
            )
            .map(|r| Some((plan, r)))
        });
        let (plan, r) = match estimate {
            Ok(Some(x)) => x,
            Ok(None) => continue,
            Err(crate::Error::Setting(_)) if model_parallel => continue,
            // An engine the optimizer cannot run under (Adafactor on FSDP2's DTensors).
            Err(crate::Error::Setting(crate::error::SettingError {
                key: crate::error::SettingKey::Optimizer,
                ..
            })) => continue,
            Err(e) => return Err(e),
        };
        let (checked, fits) = r
            .budget
            .as_ref()
            .map_or((r.device_bytes.unwrap_or(r.peak_bytes), None), |b| {
                (b.checked_bytes, Some(b.fits))
            });
        plans.push(crate::report::PlanRow {
            description: plan.describe(),
            plan,
            peak_bytes: r.peak_bytes,
            checked_bytes: checked,
            cpu_bytes: r.parallel.as_ref().map_or(0, |p| p.cpu_bytes),
            fits,
        });
    }
    plans.sort_by_key(|p| (p.checked_bytes, p.cpu_bytes));
    Ok(crate::report::PlansReport {
        model: name.to_string(),
        gpus,
        budget_bytes: query.budget,
        plans,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::Overrides;
    use crate::spec::Format;

    const MLP: &str =
        "[input]\nshape = [1000]\n[[layers]]\nkind = \"linear\"\nout_features = 1000\n";

    fn spec() -> ModelSpec {
        crate::spec::parse(MLP, Format::Toml, crate::graph::kind_keys).unwrap()
    }

    #[test]
    fn finds_the_boundary() {
        // On the CPU the budget checks the tensor peak, `total_bytes`.
        let o = Overrides {
            device: Some(crate::settings::Device::Cpu),
            ..Overrides::default()
        };
        let at = |b: u64| {
            crate::estimate_spec(
                &spec(),
                "m",
                &Overrides {
                    batch: Some(b),
                    ..o.clone()
                },
                None,
            )
            .unwrap()
            .total_bytes
        };
        let budget = at(37) + (at(38) - at(37)) / 2; // between batch 37 and 38
        let (n, r) = max_fitting(&spec(), "m", &o, budget, Dimension::Batch, (1, None)).unwrap();
        assert_eq!(n, 37);
        assert_eq!(r.settings.batch, 37);
        assert!(r.total_bytes <= budget);
    }

    /// The search as it was (doubling, then bisection), the reference for [`bracket`].
    fn doubling_then_bisection(fits: impl Fn(u64) -> bool, start: u64) -> Option<u64> {
        let mut best = if fits(1) {
            1
        } else if fits(start) {
            start
        } else {
            return None;
        };
        let mut hi = best * 2;
        loop {
            if fits(hi) {
                if hi >= SEARCH_LIMIT {
                    return Some(hi);
                }
                best = hi;
                hi *= 2;
            } else {
                break;
            }
        }
        let mut lo = best;
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if fits(mid) {
                best = mid;
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Some(best)
    }

    /// Runs [`bracket`] on `total` (`None`: the estimate fails) against `budget`; returns the
    /// answer and the number of estimates.
    fn run_bracket(
        total: &dyn Fn(u64) -> Option<u64>,
        budget: u64,
        start: u64,
    ) -> (Option<u64>, usize) {
        let calls = std::cell::Cell::new(0);
        let found = bracket(
            |v| {
                calls.set(calls.get() + 1);
                total(v).map(|t| {
                    (
                        Probe {
                            total: t,
                            budget,
                            fits: t <= budget,
                        },
                        v,
                    )
                })
            },
            start,
        );
        if let Some((v, t)) = found {
            assert_eq!(v, t, "the estimate returned is the answer's");
        }
        (found.map(|(v, _)| v), calls.get())
    }

    #[test]
    fn affine_takes_four_estimates() {
        for budget in [1000, 1099, 1100, 5000, 123_456_789, 1 << 45] {
            let total = |v: u64| Some(1000 + 100 * v);
            let (found, calls) = run_bracket(&total, budget, 1);
            let expected = doubling_then_bisection(|v| total(v).unwrap() <= budget, 1);
            assert_eq!(
                found,
                expected.map(|e| e.min(SEARCH_LIMIT)),
                "budget {budget}"
            );
            // 1, 2, the crossing and one past it (one more step per factor of 1024).
            if expected.is_some_and(|e| e < 2048) {
                assert!(calls <= 4, "budget {budget}: {calls} estimates");
            } else {
                assert!(calls <= 8, "budget {budget}: {calls} estimates");
            }
        }
    }

    proptest::proptest! {
        /// On any monotone estimate (the maximum of a few increasing affine pieces, failing
        /// past a size), the search finds what doubling and bisection find, in at most about
        /// three times their estimates.
        #[test]
        fn bracket_agrees_with_bisection(
            pieces in proptest::collection::vec((0u64..1 << 40, 0u64..1 << 30), 1..4),
            budget in 0u64..1 << 50,
            fails_from in proptest::option::of(1u64..1 << 42),
            start in 1u64..1000,
            step in proptest::option::of(1u64..1 << 20),
        ) {
            let total = |v: u64| -> Option<u64> {
                if fails_from.is_some_and(|f| v >= f) {
                    return None;
                }
                let v = step.map_or(v, |s| v.div_ceil(s) * s); // a staircase: not affine
                pieces
                    .iter()
                    .map(|&(a, b)| a.checked_add(b.checked_mul(v)?))
                    .try_fold(0u64, |m, t| t.map(|t| m.max(t)))
            };
            let (found, calls) = run_bracket(&total, budget, start);
            let expected = doubling_then_bisection(|v| total(v).is_some_and(|t| t <= budget), start);
            proptest::prop_assert_eq!(found, expected.map(|e| e.min(SEARCH_LIMIT)));
            proptest::prop_assert!(calls <= 3 * 84 + 8, "{} estimates", calls);
        }
    }

    #[test]
    fn examples_agree_with_bisection() {
        // Real estimates, training (peaks that move between backward and the optimizer step)
        // and inference, against the old search's answer.
        for (file, dim, mode, budget) in [
            (
                "mlp.toml",
                Dimension::Batch,
                crate::settings::Mode::Train,
                3 << 30,
            ),
            (
                "resnet18.toml",
                Dimension::Batch,
                crate::settings::Mode::Train,
                5 << 30,
            ),
            (
                "llama_tiny.toml",
                Dimension::Batch,
                crate::settings::Mode::Train,
                1 << 30,
            ),
            (
                "llama_tiny.toml",
                Dimension::Context,
                crate::settings::Mode::Infer,
                1 << 30,
            ),
        ] {
            let path = format!("{}/examples/{file}", env!("CARGO_MANIFEST_DIR"));
            let src = std::fs::read_to_string(path).unwrap();
            let spec = crate::spec::parse(&src, Format::Toml, crate::graph::kind_keys).unwrap();
            let at = |v: u64| {
                let mut o = Overrides {
                    mode: Some(mode),
                    ..Overrides::default()
                };
                match dim {
                    Dimension::Batch => o.batch = Some(v),
                    Dimension::Context => o.seq = Some(v),
                }
                crate::estimate_spec(&spec, "m", &o, Some(budget))
                    .ok()
                    .map(|r| r.total_bytes)
            };
            let (found, calls) = run_bracket(&at, budget, 1);
            let expected = doubling_then_bisection(|v| at(v).is_some_and(|t| t <= budget), 1);
            assert_eq!(found, expected, "{file}");
            assert!(calls <= 6, "{file}: {calls} estimates for {found:?}");
        }
    }

    #[test]
    fn nothing_fits() {
        assert!(
            max_fitting(
                &spec(),
                "m",
                &Overrides::default(),
                1000,
                Dimension::Batch,
                (1, None)
            )
            .is_none()
        );
    }
}
