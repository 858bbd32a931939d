//! `--max-batch` and `--max-context` through `memest::run`, which estimates each probe with one
//! prober (models traced whole, the micro-batch's tapes derived from two traces), against the
//! search over `memest::estimate_spec` one estimate at a time; and every derived tape against
//! a fresh trace at its batch.

use memest::report::Dimension;
use memest::settings::{Device, Mode, Overrides, Settings};
use memest::spec::ModelSpec;
use memest::trace::Tape;
use memest::trace::derive::{Batched, NotDerived, at_batch};
use serde_json::Value;

use crate::common::{path, spec};

/// The bundled model files and Hugging Face configs, by path under the repository.
fn examples() -> Vec<String> {
    let mut out = Vec::new();
    for dir in ["examples", "examples/hf"] {
        let mut files: Vec<String> = std::fs::read_dir(path(dir))
            .expect("the examples")
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|f| f.ends_with(".toml") || f.ends_with(".json"))
            .map(|f| format!("{dir}/{f}"))
            .collect();
        files.sort();
        out.extend(files);
    }
    out
}

fn trace(spec: &ModelSpec, o: &Overrides, batch: u64) -> Option<(Settings, Tape)> {
    let model = memest::graph::build(spec, "m").ok()?;
    let o = Overrides {
        batch: Some(batch),
        ..o.clone()
    };
    let settings = Settings::resolve(&model.defaults, &o).ok()?;
    let tape = memest::trace::trace(&model, &settings).ok()?;
    Some((settings, tape))
}

/// The tape as text, its hashed tables sorted (their order is per map).
fn text(t: &Tape) -> String {
    let mut grads: Vec<String> = t
        .grad_shapes
        .iter()
        .map(|(v, s)| format!("{v:?}{s:?}"))
        .collect();
    grads.sort();
    let mut split: Vec<String> = t.tp_split.iter().map(|v| format!("{v:?}")).collect();
    split.sort();
    let mut rest = t.clone();
    rest.grad_shapes.clear();
    rest.tp_split.clear();
    format!("{rest:?} {grads:?} {split:?}")
}

/// Every bundled model and config, in training and in inference on CUDA (the model files also
/// in training on the CPU), traced at batch 1 and at the search's witness batch (65,536): the
/// tape derived at 3 and 1,000 (by `at_batch`, and rewritten in place by `Batched` as the
/// search's prober does) is the tape traced there, to the last field, or the derivation is
/// refused.
#[test]
fn derived_tapes_equal_fresh_traces() {
    let w = memest::search::WITNESS_BATCH;
    let (mut cases, mut derived, mut refused, mut untraced) = (0, 0, Vec::new(), Vec::new());
    for file in examples() {
        let spec = spec(&file);
        let cpu = file
            .ends_with(".toml")
            .then_some((Mode::Train, Device::Cpu));
        for (mode, device) in [(Mode::Train, Device::Cuda), (Mode::Infer, Device::Cuda)]
            .into_iter()
            .chain(cpu)
        {
            // 64 tokens, or 640 where the sequence holds LLaVA's 576 image tokens.
            let traced = [64, 640].into_iter().find_map(|seq| {
                let o = Overrides {
                    seq: Some(seq),
                    mode: Some(mode),
                    device: Some(device),
                    ..Overrides::default()
                };
                Some((trace(&spec, &o, 1)?.1, o))
            });
            let case = format!("{file} {mode:?} {device:?}");
            let Some((t1, o)) = traced else {
                untraced.push(case);
                continue;
            };
            cases += 1;
            let Some((_, tw)) = trace(&spec, &o, w) else {
                refused.push(case);
                continue;
            };
            // The prober's form: checked once, rewritten in place per batch.
            let mut batched = Batched::new((1, &t1), (w, &tw)).ok();
            for b in [3, 1000] {
                let d = match at_batch((1, &t1), (w, &tw), b) {
                    Ok(d) => d,
                    Err(NotDerived::NotProportional) => {
                        refused.push(case);
                        break;
                    }
                    Err(e) => panic!("{case} at {b}: {e:?}"),
                };
                let (_, fresh) = trace(&spec, &o, b).expect("traces where 1 and 65,536 do");
                assert!(text(&d) == text(&fresh), "{case} at {b}");
                let rewritten = batched
                    .as_mut()
                    .expect("checked as at_batch")
                    .at(b)
                    .unwrap();
                assert!(text(rewritten) == text(&fresh), "{case} at {b}, rewritten");
                derived += 1;
            }
        }
    }
    // Not derived (every batch traced): the LSTM's input and output are laid out differently
    // at batch 1 (`t > 1 && n > 1` in `trace/ops/rnn.rs`: another program), and on the CPU
    // oneDNN's workspace is rounded up to 4 KiB pages (a staircase in the batch); Qwen2-VL's
    // vision tower attends per image, so its operators grow with the batch (at 65,536 past the
    // operator cap). In training, the models that add learned position embeddings `[1, S, H]`
    // to the batch's (BERT, GPT-2, ViT, CLIP, DINOv2, SigLIP, StarCoder, LLaVA's CLIP tower):
    // that `add` passes its gradient on as a view at batch 1, where nothing is broadcast, and
    // reduces it (`Step::reduced`) at 65,536: another program at batch 1. On the CPU, every
    // model with a convolution: PyTorch sends a float32 convolution to oneDNN only with a
    // batch over 1 (`ConvParams::use_mkldnn`, `trace/ops/conv.rs`), whose reorders are another
    // program again. All refused (exact; it costs a trace per probe).
    assert_eq!(
        refused,
        [
            "examples/alexnet.toml Train Cpu",
            "examples/bert_base.toml Train Cuda",
            "examples/bert_base.toml Train Cpu",
            "examples/densenet121.toml Train Cpu",
            "examples/efficientnet_b0.toml Train Cpu",
            "examples/gpt2.toml Train Cuda",
            "examples/gpt2.toml Train Cpu",
            "examples/lstm_classifier.toml Train Cuda",
            "examples/lstm_classifier.toml Infer Cuda",
            "examples/lstm_classifier.toml Train Cpu",
            "examples/mnasnet0_5.toml Train Cpu",
            "examples/mobilenet_v2.toml Train Cpu",
            "examples/mobilenet_v3_large.toml Train Cpu",
            "examples/mobilenet_v3_small.toml Train Cpu",
            "examples/regnet_y_400mf.toml Train Cpu",
            "examples/resnet101.toml Train Cpu",
            "examples/resnet18.toml Train Cpu",
            "examples/resnet34.toml Train Cpu",
            "examples/resnet50.toml Train Cpu",
            "examples/resnext50_32x4d.toml Train Cpu",
            "examples/shufflenet_v2_x1_0.toml Train Cpu",
            "examples/squeezenet1_1.toml Train Cpu",
            "examples/unet2d.toml Train Cpu",
            "examples/vgg11_bn.toml Train Cpu",
            "examples/vgg16.toml Train Cpu",
            "examples/vit_b_16.toml Train Cuda",
            "examples/vit_b_16.toml Train Cpu",
            "examples/wide_resnet50_2.toml Train Cpu",
            "examples/hf/bert-base-uncased.json Train Cuda",
            "examples/hf/bert_base_cls.json Train Cuda",
            "examples/hf/clip-vit-base-patch32-text.json Train Cuda",
            "examples/hf/clip-vit-large-patch14-336-vision.json Train Cuda",
            "examples/hf/dinov2-base.json Train Cuda",
            "examples/hf/dinov2-giant.json Train Cuda",
            "examples/hf/gpt2.json Train Cuda",
            "examples/hf/llava-1.5-7b-hf.json Train Cuda",
            "examples/hf/qwen2-vl-7b-instruct.json Train Cuda",
            "examples/hf/qwen2-vl-7b-instruct.json Infer Cuda",
            "examples/hf/qwen2.5-vl-7b-instruct.json Train Cuda",
            "examples/hf/qwen2.5-vl-7b-instruct.json Infer Cuda",
            "examples/hf/siglip-base-patch16-224-text.json Train Cuda",
            "examples/hf/siglip-base-patch16-224-vision-nohead.json Train Cuda",
            "examples/hf/starcoder.json Train Cuda",
            "examples/hf/vit-base-patch16-224.json Train Cuda",
        ]
    );
    assert_eq!(untraced, Vec::<String>::new());
    assert_eq!((cases, derived), (194, 2 * (194 - 44)));
}

/// Traces at batches the caller misnames, or sizes near 64 bits, are not derived.
#[test]
fn derivation_refuses_what_it_cannot_prove() {
    let spec = spec("examples/llama_tiny.toml");
    let o = Overrides {
        seq: Some(64),
        ..Overrides::default()
    };
    let (_, t1) = trace(&spec, &o, 1).unwrap();
    let (_, t3) = trace(&spec, &o, 3).unwrap();
    // Batch 3 given as batch 2: the sizes are 3 times batch 1's, not twice.
    assert_eq!(
        at_batch((1, &t1), (2, &t3), 5).unwrap_err(),
        NotDerived::NotProportional
    );
    assert_eq!(
        at_batch((1, &t1), (3, &t3), 1 << 40).unwrap_err(),
        NotDerived::Large
    );
    assert!(at_batch((1, &t1), (3, &t3), 2).is_ok());
}

/// The search one estimate at a time (`memest::estimate_spec`, whole or extended from a few
/// copies), as `memest::run` searched before it probed with derived tapes.
fn searched_one_by_one(
    spec: &ModelSpec,
    o: &Overrides,
    budget: u64,
    dim: Dimension,
    start: u64,
) -> Option<(u64, memest::Report)> {
    memest::search::largest_fitting(
        |v| {
            let mut o = o.clone();
            match dim {
                Dimension::Batch => o.batch = Some(v),
                Dimension::Context => o.seq = Some(v),
            }
            memest::estimate_spec(spec, "m", &o, Some(budget)).ok()
        },
        start,
    )
}

/// The report of `run` less what `run` adds to the search's (the outcome, the warnings).
fn found(r: &memest::Report) -> Value {
    let mut r = r.clone();
    r.search = None;
    r.warnings.clear();
    serde_json::to_value(&r).unwrap()
}

/// `--max-batch` and `--max-context` on the examples, training and inference, on CUDA and the
/// CPU: the answer and its whole report are those of the search one estimate at a time.
#[test]
fn searches_answer_as_one_estimate_at_a_time() {
    for (file, dim, mode, device, budget) in [
        (
            "examples/mlp.toml",
            Dimension::Batch,
            Mode::Train,
            Device::Cuda,
            3u64 << 30,
        ),
        (
            "examples/resnet18.toml",
            Dimension::Batch,
            Mode::Train,
            Device::Cuda,
            5 << 30,
        ),
        (
            "examples/resnet18.toml",
            Dimension::Batch,
            Mode::Infer,
            Device::Cpu,
            5 << 30,
        ),
        (
            "examples/llama_tiny.toml",
            Dimension::Batch,
            Mode::Train,
            Device::Cuda,
            1 << 30,
        ),
        (
            "examples/llama_tiny.toml",
            Dimension::Batch,
            Mode::Infer,
            Device::Cpu,
            1 << 30,
        ),
        (
            "examples/llama_tiny.toml",
            Dimension::Context,
            Mode::Infer,
            Device::Cuda,
            1 << 30,
        ),
        (
            "examples/gpt2.toml",
            Dimension::Context,
            Mode::Train,
            Device::Cuda,
            8 << 30,
        ),
        (
            "examples/hf/llama-2-7b.json",
            Dimension::Batch,
            Mode::Infer,
            Device::Cuda,
            80_000_000_000,
        ),
    ] {
        let o = Overrides {
            seq: Some(256),
            mode: Some(mode),
            device: Some(device),
            ..Overrides::default()
        };
        let spec = spec(file);
        let query = memest::Query {
            overrides: o.clone(),
            budget: Some(budget),
            search: Some(dim),
            // The answer as searched, not capped at the model's trained context.
            allow_long_context: true,
            ..memest::Query::default()
        };
        let r = memest::run(&spec, "m", &query).expect("searches");
        let (v, expected) = searched_one_by_one(&spec, &o, budget, dim, 1).expect("fits");
        let outcome = r.search.as_ref().expect("a search outcome");
        let what = format!("{file} {dim:?} {mode:?} {device:?}");
        assert_eq!(outcome.largest, Some(v), "{what}");
        assert!(found(&r) == found(&expected), "{what}");
    }
}
