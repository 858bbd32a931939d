//! Symbolic repeats: a block of many copies extended from traces of 4, 5 and 6 copies gives the
//! report of full unrolling, every JSON figure to the byte (`memest::estimate_symbolic` against
//! `memest::estimate_unrolled`), including where the peak moves between phases as the count
//! grows.

use memest::settings::{Device, Mode, Overrides};
use memest::spec::{Format, LayerKind, ModelSpec};
use proptest::prelude::*;
use proptest::test_runner::RngSeed;
use serde_json::Value;

use crate::common::spec;

/// Sets the count of the `which`-th top-level repeat (in order) to `count`; false if none.
fn set_count(spec: &mut ModelSpec, which: usize, count: u64) -> bool {
    let mut repeats = spec
        .layers
        .iter_mut()
        .filter(|l| l.kind == LayerKind::Repeat);
    match repeats.nth(which) {
        Some(l) => {
            l.count = Some(count);
            true
        }
        None => false,
    }
}

fn json(r: &memest::Report) -> Value {
    serde_json::to_value(r).expect("a report serializes")
}

/// The symbolic report (which must apply) and the unrolled one, as JSON.
fn both(spec: &ModelSpec, o: &Overrides) -> (Value, Value) {
    let symbolic = memest::estimate_symbolic(spec, "m", o, Some(1 << 40))
        .expect("estimates")
        .expect("the symbolic path applies");
    let unrolled = memest::estimate_unrolled(spec, "m", o, Some(1 << 40)).expect("estimates");
    (json(&symbolic), json(&unrolled))
}

/// Llama-tiny at 384 tokens: with 64 layers the peak is the optimizer step, where 4 layers peak
/// in backward (`properties::repeat_peak_is_not_affine_far_from_small_counts`); the symbolic
/// report is the unrolled one.
#[test]
fn llama_tiny_at_64_layers_peaks_in_the_optimizer_step_as_unrolled() {
    let mut s = spec("examples/hf/llama_tiny.json");
    assert!(set_count(&mut s, 0, 64));
    let o = Overrides {
        batch: Some(1),
        seq: Some(384),
        device: Some(Device::Cpu),
        optimizer_impl: Some(memest::settings::OptimizerImpl::Foreach),
        ..Overrides::default()
    };
    let (symbolic, unrolled) = both(&s, &o);
    assert_eq!(symbolic, unrolled);
    assert_eq!(symbolic["peak_bytes"], 2_169_058_704u64);
    assert_eq!(symbolic["peak_phase"], "optimizer_step");
    // With 4 layers, one of the counts traced, the peak is in backward.
    let mut four = s.clone();
    assert!(set_count(&mut four, 0, 4));
    let r = memest::estimate_unrolled(&four, "m", &o, None).unwrap();
    assert_eq!(r.peak_phase, memest::sim::Phase::Backward);
    // And through the public entry point, which takes the symbolic path.
    let r = memest::estimate_spec(&s, "m", &o, Some(1 << 40)).unwrap();
    assert_eq!(json(&r), unrolled);
}

/// The benchmark's shape: 100,000 copies of `linear(512) + relu` are far past what a test may
/// unroll; 2,000 copies are compared.
#[test]
fn a_deep_mlp_repeat_is_exact() {
    let src = "[input]\nshape = [512]\n[[layers]]\nkind = \"repeat\"\ncount = 2000\n[[layers.layers]]\nkind = \"linear\"\nout_features = 512\n[[layers.layers]]\nkind = \"relu\"\n";
    let s = memest::load_spec(src, Format::Toml, memest::hf::Head::Auto).unwrap();
    let cpu = Overrides {
        device: Some(Device::Cpu),
        ..Overrides::default()
    };
    for o in [
        cpu.clone(),
        Overrides {
            mode: Some(Mode::Infer),
            ..cpu.clone()
        },
        Overrides {
            checkpoint: true,
            batch: Some(8),
            ..cpu.clone()
        },
    ] {
        let (symbolic, unrolled) = both(&s, &o);
        assert_eq!(symbolic, unrolled, "{o:?}");
    }
}

/// A block of fewer than 16 copies is unrolled; on CUDA a block is extended with the caching
/// allocator's figures (`cuda_repeats_are_exact`).
#[test]
fn short_repeats_unroll() {
    let cpu = Overrides {
        device: Some(Device::Cpu),
        ..Overrides::default()
    };
    let s = spec("examples/gpt2.toml");
    assert!(
        memest::estimate_symbolic(&s, "m", &cpu, None)
            .unwrap()
            .is_none()
    );
    let mut s = spec("examples/hf/llama_tiny.json");
    assert!(set_count(&mut s, 0, 64));
    assert!(
        memest::estimate_symbolic(&s, "m", &cpu, None)
            .unwrap()
            .is_some()
    );
    let cuda = Overrides {
        device: Some(Device::Cuda),
        ..Overrides::default()
    };
    // On CUDA its 64 layers' allocator state does not turn periodic (and a run of 62 copies
    // is not worth encoding): the allocator plays the traced copies' program copy by copy,
    // the report unrolling gives.
    let (symbolic, unrolled) = both(&s, &cuda);
    assert_eq!(symbolic, unrolled);
    let (symbolic, unrolled) = both(&deep_mlp(64, 512), &cuda);
    assert_eq!(symbolic, unrolled);
}

/// The bundled examples with a top-level repeated block.
const WITH_REPEATS: [&str; 8] = [
    "examples/gpt2.toml",
    "examples/llama_tiny.toml",
    "examples/vit_b_16.toml",
    "examples/bert_base.toml",
    "examples/mobilenet_v2.toml",
    "examples/hf/llama_tiny.json",
    "examples/hf/t5-small.json",
    "examples/hf/qwen1.5-moe-a2.7b.json",
];

fn config() -> ProptestConfig {
    let mut c = ProptestConfig::default();
    if std::env::var_os("PROPTEST_CASES").is_none() {
        c.cases = 24;
    }
    if std::env::var_os("PROPTEST_RNG_SEED").is_none() {
        c.rng_seed = RngSeed::Fixed(20_261_201);
    }
    c.failure_persistence = None;
    c
}

/// Small sizes so that unrolling stays quick (the big configs at a few tokens).
fn overrides(
    file: &str,
    batch: u64,
    seq: u64,
    infer: bool,
    checkpoint: bool,
    amp: bool,
) -> Overrides {
    let hf = file.contains("/hf/");
    Overrides {
        batch: Some(batch),
        seq: Some(if hf { seq.min(16) } else { seq }),
        mode: infer.then_some(Mode::Infer),
        checkpoint: checkpoint && !infer,
        amp: (amp && !file.contains("/hf/")).then_some(memest::cost::Amp::Bf16),
        device: Some(Device::Cpu),
        ..Overrides::default()
    }
}

proptest! {
    #![proptest_config(config())]

    /// For random counts and settings, the symbolic report, when it applies, is the unrolled
    /// report; on these models it applies.
    #[test]
    fn symbolic_repeats_equal_unrolling(
        i in 0..WITH_REPEATS.len(),
        which in 0usize..3,
        count in 16u64..48,
        other in 1u64..5,
        batch in 1u64..4,
        seq in 1u64..64,
        infer in any::<bool>(),
        checkpoint in any::<bool>(),
        amp in any::<bool>(),
    ) {
        let file = WITH_REPEATS[i];
        let mut s = spec(file);
        // One block deep, and maybe another one short.
        let n = s.layers.iter().filter(|l| l.kind == LayerKind::Repeat).count();
        let deep = which % n;
        for j in 0..n {
            set_count(&mut s, j, if j == deep { count } else { other });
        }
        let o = overrides(file, batch, seq, infer, checkpoint, amp);
        let symbolic = memest::estimate_symbolic(&s, "m", &o, Some(1 << 30));
        let unrolled = memest::estimate_unrolled(&s, "m", &o, Some(1 << 30));
        match (symbolic, unrolled) {
            (Ok(Some(sym)), Ok(unr)) => prop_assert_eq!(json(&sym), json(&unr), "{} {:?}", file, o),
            (Ok(None), Ok(_)) => prop_assert!(false, "{file} {o:?}: the symbolic path did not apply"),
            (Ok(Some(_)), Err(e)) => prop_assert!(false, "{file} {o:?}: unrolled fails ({e}), symbolic does not"),
            (Ok(None) | Err(_), Err(_)) => {}
            (Err(e), Ok(_)) => prop_assert!(false, "{file} {o:?}: {e}"),
        }
    }
}

/// The 182-byte file, `count = 1000000` copies of `linear(512)`: two operators a copy
/// make 2,000,000, which the tracer accepts, so the block is extended (not unrolled) on the CPU;
/// every copy holds 512·512 + 512 parameters. One copy more is refused, as unrolling refuses it.
#[test]
fn a_million_copies_at_the_operator_cap_are_extended() {
    let file = |count: u64| {
        format!(
            "[input]\nshape = [512]\n[[layers]]\nkind = \"repeat\"\ncount = {count}\n[[layers.layers]]\nkind = \"linear\"\nout_features = 512\n"
        )
    };
    let cpu = Overrides {
        device: Some(Device::Cpu),
        ..Overrides::default()
    };
    let s = memest::load_spec(&file(1_000_000), Format::Toml, memest::hf::Head::Auto).unwrap();
    let r = memest::estimate_symbolic(&s, "m", &cpu, None)
        .unwrap()
        .expect("the symbolic path applies up to the cap");
    assert_eq!(r.param_count, 262_656 * 1_000_000);
    let s = memest::load_spec(&file(1_000_001), Format::Toml, memest::hf::Head::Auto).unwrap();
    assert!(
        memest::estimate_symbolic(&s, "m", &cpu, None)
            .unwrap()
            .is_none()
    );
    let e = memest::estimate_spec(&s, "m", &cpu, None).unwrap_err();
    assert!(e.to_string().contains("2000000 operators"), "{e}");
}

/// `linear(width) + relu` repeated `count` times (the benchmark's shape).
fn deep_mlp(count: u64, width: u64) -> ModelSpec {
    let src = format!(
        "[input]\nshape = [{width}]\n[[layers]]\nkind = \"repeat\"\ncount = {count}\n[[layers.layers]]\nkind = \"linear\"\nout_features = {width}\n[[layers.layers]]\nkind = \"relu\"\n"
    );
    memest::load_spec(&src, Format::Toml, memest::hf::Head::Auto).unwrap()
}

/// The three CUDA runs the repeat tests compare: float32 training at the file's batch,
/// inference at batch 3, and bf16 autocast training with checkpointing at batch 8.
fn cuda_runs() -> [Overrides; 3] {
    let cuda = Overrides {
        device: Some(Device::Cuda),
        ..Overrides::default()
    };
    [
        cuda.clone(),
        Overrides {
            mode: Some(Mode::Infer),
            batch: Some(3),
            ..cuda.clone()
        },
        Overrides {
            checkpoint: true,
            amp: Some(memest::cost::Amp::Bf16),
            batch: Some(8),
            ..cuda
        },
    ]
}

/// On CUDA the caching allocator's peaks (`allocated_peak_bytes`, `reserved_peak_bytes`,
/// `device_bytes`) of a symbolic repeat are the unrolled ones: widths whose weights fall in the
/// small pool (512: 1 MiB exactly, the largest small request), in 20 MiB large segments (513:
/// 1,052,676 B; 1,200: 5.5 MiB) and in segments of their own (1,700: 11 MiB, past 10 MiB), at
/// counts from 16 to 48, training (float32 and bf16 autocast, checkpointed) and inference.
#[test]
fn cuda_repeats_are_exact() {
    let mut figures = Vec::new();
    for (count, width) in [
        (16, 512),
        (17, 512),
        (40, 512),
        (48, 512),
        (33, 513),
        (24, 1200),
        (20, 1700),
    ] {
        for o in cuda_runs() {
            let (symbolic, unrolled) = both(&deep_mlp(count, width), &o);
            assert_eq!(symbolic, unrolled, "{count} x {width}: {o:?}");
            figures.push(unrolled["reserved_peak_bytes"].as_u64().unwrap());
        }
    }
    // 16 copies of linear(512): weights, gradients, Adam's two moments and the foreach step's
    // temporaries, 1 MiB each, two to a 2 MiB segment (80 MiB), and the small tensors (biases,
    // activations, their gradients and state) in one more 2 MiB segment: 82 MiB.
    assert_eq!(figures[0], 82 << 20);
}

/// The benchmark's shape on CUDA past the counts that fill 2 MiB small-pool segments: each
/// copy's 2 KiB activations (batch 1, float32) pile up 1,024 to a segment, so at 1,100 and
/// 2,051 copies segments fill in the middle of the forward and backward runs (and at 6 KiB,
/// batch 3 in inference, 341 to a segment); the symbolic report (which must apply) is the
/// unrolled one, every allocator figure to the byte, training (float32; bf16 autocast with
/// checkpointing) and inference. With expandable segments the estimate unrolls and is the
/// same as unrolling.
#[test]
fn cuda_small_pool_piles_extend_exactly() {
    let mut reserved = Vec::new();
    for count in [1100, 2051] {
        for o in cuda_runs() {
            let (symbolic, unrolled) = both(&deep_mlp(count, 512), &o);
            assert_eq!(symbolic, unrolled, "{count}: {o:?}");
            reserved.push(unrolled["reserved_peak_bytes"].as_u64().unwrap());
        }
    }
    // 1,100 copies of linear(512), training: 5,500 1 MiB tensors live at the peak (five a
    // copy: weight, gradient, Adam's two moments, a foreach temporary) two to a 2 MiB segment
    // (2,750 segments), and 6 more small-pool segments for the 2 KiB tensors: 2,756 · 2 MiB.
    assert_eq!(reserved[0], 2_756 * (2 << 20));
    let expandable = Overrides {
        expandable_segments: true,
        device: Some(Device::Cuda),
        ..Overrides::default()
    };
    let s = deep_mlp(1100, 512);
    assert!(
        memest::estimate_symbolic(&s, "m", &expandable, None)
            .unwrap()
            .is_none()
    );
    let r = memest::estimate_spec(&s, "m", &expandable, None).unwrap();
    let u = memest::estimate_unrolled(&s, "m", &expandable, None).unwrap();
    assert_eq!(json(&r), json(&u));
}

/// Expandable segments, several GPUs and gradient accumulation are not extended: the
/// symbolic path declines and the estimate is the unrolled one.
#[test]
fn cuda_plans_that_unroll() {
    let s = deep_mlp(20, 256);
    let cuda = Overrides {
        device: Some(Device::Cuda),
        ..Overrides::default()
    };
    let ddp = memest::parallel::PlanFlags {
        gpus: Some(2),
        ddp: true,
        ..memest::parallel::PlanFlags::default()
    };
    for o in [
        Overrides {
            expandable_segments: true,
            ..cuda.clone()
        },
        Overrides {
            grad_accum: Some(2),
            ..cuda.clone()
        },
        Overrides {
            parallel: ddp.resolve().unwrap(),
            ..cuda.clone()
        },
    ] {
        assert!(
            memest::estimate_symbolic(&s, "m", &o, None)
                .unwrap()
                .is_none(),
            "{o:?}"
        );
        let r = memest::estimate_spec(&s, "m", &o, None).unwrap();
        let u = memest::estimate_unrolled(&s, "m", &o, None).unwrap();
        assert_eq!(json(&r), json(&u), "{o:?}");
    }
}

proptest! {
    #![proptest_config(config())]

    /// On CUDA, for random counts and settings, the symbolic report, when it applies, is the
    /// unrolled report, every figure of the caching allocator included.
    #[test]
    fn cuda_symbolic_repeats_equal_unrolling(
        i in 0..WITH_REPEATS.len(),
        count in 16u64..40,
        batch in 1u64..4,
        seq in 1u64..48,
        infer in any::<bool>(),
        checkpoint in any::<bool>(),
        amp in any::<bool>(),
    ) {
        let file = WITH_REPEATS[i];
        let mut s = spec(file);
        let n = s.layers.iter().filter(|l| l.kind == LayerKind::Repeat).count();
        for j in 0..n {
            set_count(&mut s, j, if j == 0 { count } else { 1 });
        }
        let o = Overrides {
            device: Some(Device::Cuda),
            ..overrides(file, batch, seq, infer, checkpoint, amp)
        };
        let symbolic = memest::estimate_symbolic(&s, "m", &o, Some(1 << 30));
        let unrolled = memest::estimate_unrolled(&s, "m", &o, Some(1 << 30));
        match (symbolic, unrolled) {
            (Ok(Some(sym)), Ok(unr)) => prop_assert_eq!(json(&sym), json(&unr), "{} {:?}", file, o),
            (Ok(Some(_)), Err(e)) => prop_assert!(false, "{file} {o:?}: unrolled fails ({e}), symbolic does not"),
            (Ok(None), _) | (Err(_), Err(_)) => {}
            (Err(e), Ok(_)) => prop_assert!(false, "{file} {o:?}: {e}"),
        }
    }
}
