//! The plans `--plan auto` compares and the model-parallel degrees `--min-gpus` tries: which
//! engines, and which tensor- and pipeline-parallel degrees, a number of GPUs admits for a
//! model. Pure: the model enters only as [`Splits`] (its heads and its repeated blocks); the
//! estimates and the ranking are `search`'s.

use super::{FsdpStrategy, OffloadFlag, PipelineFlags, PlanFlags};

/// What a model allows of the model-parallel degrees.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Splits {
    /// The greatest common divisor of every attention layer's query and key/value heads: a
    /// tensor-parallel degree must divide it (Megatron-LM divides the heads; `--tp` refuses
    /// otherwise). `None` when the model has no attention or a layer whose split memest does
    /// not model (mixture of experts, cross-attention, latent attention): no tensor
    /// parallelism.
    pub heads: Option<u64>,
    /// Repeated blocks (decoder layers): a pipeline-parallel degree must divide them
    /// (Megatron-LM's `num_layers % pipeline_model_parallel_size == 0`).
    pub blocks: u64,
}

/// The largest tensor-parallel degree tried, when the flags do not fix one: tensor parallelism
/// all-reduces every block's activations, so Megatron-LM keeps it inside a node (NVLink), of
/// `--gpus-per-node` GPUs (default 8).
fn max_tp(flags: &PlanFlags) -> u64 {
    flags.gpus_per_node.unwrap_or(8)
}

/// The `(tp, pp)` pairs on `gpus` GPUs (with `cp` context-parallel ranks): `tp` dividing the
/// heads and at most a node, `pp` dividing the repeated blocks (none under ZeRO-2 or 3, which
/// DeepSpeed's pipeline engine refuses), `tp · pp · cp` dividing the GPUs; a degree the flags
/// give is kept. `(1, 1)` first, then by `tp · pp`, then `tp`.
#[must_use]
pub fn degrees(flags: &PlanFlags, gpus: u64, splits: Splits) -> Vec<(u64, u64)> {
    let cp = flags.cp.unwrap_or(1).max(1);
    let divisors = |n: u64| (1..=n).filter(move |d| n.is_multiple_of(*d));
    let tps: Vec<u64> = match flags.tp {
        Some(t) => vec![t],
        None => divisors(gpus)
            .filter(|&t| {
                t == 1 || (t <= max_tp(flags) && splits.heads.is_some_and(|h| h.is_multiple_of(t)))
            })
            .collect(),
    };
    // DeepSpeed's pipeline engine takes ZeRO-1 at most ("ZeRO-2 and ZeRO-3 are incompatible
    // with pipeline parallelism", `deepspeed/runtime/pipe/engine.py`).
    let stage = flags
        .zero
        .or(match flags.config.as_ref().and_then(|c| c.engine) {
            Some(super::ConfigEngine::Zero(z)) => Some(z.stage),
            _ => None,
        });
    let pps: Vec<u64> = match flags.pipeline.pp {
        Some(p) => vec![p],
        None if stage.is_some_and(|s| s >= 2) => vec![1],
        None => divisors(gpus)
            .filter(|&p| p == 1 || (p <= splits.blocks && splits.blocks.is_multiple_of(p)))
            .collect(),
    };
    let mut out = Vec::new();
    for &tp in &tps {
        for &pp in &pps {
            if tp
                .checked_mul(pp)
                .and_then(|m| m.checked_mul(cp))
                .is_some_and(|m| m > 0 && gpus.is_multiple_of(m))
            {
                out.push((tp, pp));
            }
        }
    }
    out.sort_by_key(|&(tp, pp)| (tp.saturating_mul(pp), tp));
    out
}

/// `flags` at tensor-parallel degree `tp` (with sequence parallelism, which keeps each
/// block's norms and residual stream at `seq / tp` positions: Korthikanti et al. 2022) and
/// pipeline degree `pp` (the flags' schedule and micro-batches, or `1f1b` with `pp`
/// micro-batches); `(1, 1)` leaves both off.
pub fn at_degrees(flags: &PlanFlags, tp: u64, pp: u64) -> PlanFlags {
    PlanFlags {
        tp: (tp > 1).then_some(tp),
        sp: tp > 1 && (flags.sp || flags.tp.is_none()),
        tp_style: flags.tp_style.filter(|_| tp > 1),
        pipeline: if pp > 1 {
            PipelineFlags {
                pp: Some(pp),
                ..flags.pipeline
            }
        } else {
            PipelineFlags::default()
        },
        ..flags.clone()
    }
}

/// `--plan auto`'s candidates on `gpus` GPUs. At every `(tp, pp)` of [`degrees`], with `dp =
/// gpus / (tp · pp · cp)` data-parallel ranks:
///
/// - tensor and pipeline parallelism off: DDP; ZeRO-1, 2, 3; FSDP full-shard and
///   shard-grad-op and, past one node, hybrid-shard; ZeRO-1/2/3 with the optimizer offloaded;
///   ZeRO-3 and FSDP full-shard with parameters offloaded too;
/// - otherwise (Megatron-style): the model-parallel plan alone when `dp = 1`, else with DDP,
///   ZeRO-1 (Megatron's distributed optimizer shards the optimizer state as ZeRO-1 does) and
///   FSDP full-shard.
///
/// `flags` keeps its non-engine options (`--gpus-per-node`, `--reduce-bucket-size`, a config's
/// ZeRO options, `--cp`, `--ep`, the pipeline schedule); a config file's engine, offload and
/// `train_batch_size` are dropped (the candidate gives the engine).
#[must_use]
pub fn candidates(flags: &PlanFlags, gpus: u64, splits: Splits) -> Vec<PlanFlags> {
    let base = PlanFlags {
        gpus: Some(gpus),
        gpus_per_node: None,
        ddp: false,
        zero: None,
        fsdp: None,
        bucket_cap_mb: None,
        gradient_as_bucket_view: false,
        offload: None,
        reduce_bucket_size: None,
        reduce_dtype: None,
        config: flags.config.clone().map(|mut cfg| {
            if !matches!(cfg.engine, Some(super::ConfigEngine::Zero(_))) {
                cfg.engine = None;
            }
            cfg.offload = super::Offload::none();
            cfg.train_batch = None;
            cfg
        }),
        ..flags.clone()
    };
    let per_node = flags.gpus_per_node.unwrap_or(8);
    let zero = |stage: u8, offload: Option<OffloadFlag>, b: &PlanFlags| PlanFlags {
        zero: Some(stage),
        reduce_bucket_size: flags.reduce_bucket_size,
        offload,
        ..b.clone()
    };
    let fsdp = |strategy: FsdpStrategy, offload: Option<OffloadFlag>, b: &PlanFlags| PlanFlags {
        fsdp: Some(strategy),
        reduce_dtype: flags.reduce_dtype,
        offload,
        ..b.clone()
    };
    let ddp = |b: &PlanFlags| PlanFlags {
        ddp: true,
        ..b.clone()
    };
    let cp = flags.cp.unwrap_or(1).max(1);
    let mut out = Vec::new();
    for (tp, pp) in degrees(flags, gpus, splits) {
        let b = at_degrees(&base, tp, pp);
        if (tp, pp) != (1, 1) {
            let dp = gpus / (tp * pp * cp);
            if dp == 1 {
                out.push(b);
            } else {
                out.push(ddp(&b));
                out.push(zero(1, None, &b));
                out.push(fsdp(FsdpStrategy::FullShard, None, &b));
            }
            continue;
        }
        out.push(ddp(&b));
        out.extend((1..=3).map(|s| zero(s, None, &b)));
        out.push(fsdp(FsdpStrategy::FullShard, None, &b));
        out.push(fsdp(FsdpStrategy::ShardGradOp, None, &b));
        if gpus > per_node {
            out.push(PlanFlags {
                gpus_per_node: Some(per_node),
                ..fsdp(FsdpStrategy::HybridShard, None, &b)
            });
        }
        out.extend((1..=3).map(|s| zero(s, Some(OffloadFlag::Optimizer), &b)));
        out.push(zero(3, Some(OffloadFlag::Both), &b));
        out.push(fsdp(FsdpStrategy::FullShard, Some(OffloadFlag::Both), &b));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 16 GPUs, 8 heads (2 key/value heads: gcd 2), 4 blocks: tp ∈ {1, 2}, pp ∈ {1, 2, 4}.
    #[test]
    fn degrees_divide_heads_blocks_and_gpus() {
        let flags = PlanFlags::default();
        let s = Splits {
            heads: Some(2),
            blocks: 4,
        };
        assert_eq!(
            degrees(&flags, 16, s),
            [(1, 1), (1, 2), (2, 1), (1, 4), (2, 2), (2, 4)]
        );
        // No splittable attention: no tensor parallelism; 6 GPUs: pp 2 (3 does not divide 4).
        let s = Splits {
            heads: None,
            blocks: 4,
        };
        assert_eq!(degrees(&flags, 6, s), [(1, 1), (1, 2)]);
        // 64 heads on 32 GPUs: tp stops at a node of 8.
        let s = Splits {
            heads: Some(64),
            blocks: 1,
        };
        assert_eq!(degrees(&flags, 32, s), [(1, 1), (2, 1), (4, 1), (8, 1)]);
        // A degree the flags give is kept.
        let fixed = PlanFlags {
            tp: Some(4),
            ..PlanFlags::default()
        };
        let s = Splits {
            heads: Some(8),
            blocks: 2,
        };
        assert_eq!(degrees(&fixed, 8, s), [(4, 1), (4, 2)]);
        // ZeRO-3: no pipeline.
        let zero3 = PlanFlags {
            zero: Some(3),
            ..PlanFlags::default()
        };
        assert_eq!(degrees(&zero3, 8, s), [(1, 1), (2, 1), (4, 1), (8, 1)]);
    }

    /// The data-parallel list at (1, 1), three engines where data parallelism remains, the
    /// model-parallel plan alone where it does not.
    #[test]
    fn candidates_per_degree() {
        let s = Splits {
            heads: Some(2),
            blocks: 4,
        };
        let c = candidates(&PlanFlags::default(), 4, s);
        // (1,1): 11 (no hybrid on 4 GPUs); (1,2), (2,1): 3 each; (1,4), (2,2): 1 each.
        assert_eq!(c.len(), 11 + 3 + 3 + 1 + 1);
        let alone: Vec<_> = c
            .iter()
            .filter(|f| !f.ddp && f.zero.is_none() && f.fsdp.is_none())
            .map(|f| (f.tp, f.pipeline.pp, f.sp))
            .collect();
        assert_eq!(alone, [(None, Some(4), false), (Some(2), Some(2), true)]);
    }
}
