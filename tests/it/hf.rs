//! Hugging Face `config.json` import (`examples/hf/`): exact parameter counts, heads, the measured
//! cases run from configs (through `reference.rs`'s harness), `--print-model` round trips, and
//! errors.

use memest::hf::Head;
use memest::settings::{Mode, Overrides};
use memest::spec::Format;
use serde_json::Value;

use crate::common::{TempModel, code, describe, memest, path, report, stderr, stdout, u};
use crate::reference::{
    EXTRA, HF, HF_CUDA, SHARED, Set, assert_all_ok, assert_medians, cases_in, compare_cases,
    compare_set, snapshot,
};

/// Every shipped config with its exact parameter count as transformers 5.24 builds the class its
/// `architectures` names (counted on the meta device; tied weights once).
const PARAM_COUNTS: &[(&str, u64)] = &[
    ("examples/hf/llama-2-7b.json", 6_738_415_616),
    // CohereForAI/c4ai-command-r-v01 (CohereForCausalLM): per layer q, k, v, o 4·8192² + MLP
    // 3·8192·22528 + one bias-free LayerNorm 8192 = 822_091_776, times 40; tied embedding
    // 256000·8192; final norm 8192 (transformers 5.24 on the meta device).
    ("examples/hf/c4ai-command-r-v01.json", 34_980_831_232),
    ("examples/hf/llama-3-8b.json", 8_030_261_248),
    ("examples/hf/mistral-7b-v0.1.json", 7_241_732_096),
    ("examples/hf/mixtral-8x7b.json", 46_702_792_704),
    ("examples/hf/gpt2.json", 124_439_808),
    ("examples/hf/bert-base-uncased.json", 109_514_298),
    ("examples/hf/qwen2-7b.json", 7_615_616_512),
    ("examples/hf/qwen3-8b.json", 8_190_735_360),
    ("examples/hf/gemma-7b.json", 8_537_680_896),
    ("examples/hf/phi-3-mini.json", 3_821_079_552),
    ("examples/hf/qwen1.5-moe-a2.7b.json", 14_315_784_192),
    ("examples/hf/t5-small.json", 60_506_624),
    ("examples/hf/llama_tiny.json", 44_044_800),
    ("examples/hf/bert_base_cls.json", 109_483_778),
    // OLMo-2-1124-7B: embeddings and untied head 2·100352·4096 = 822_083_584; per layer
    // q, k, v, o 4·4096² + q_norm, k_norm 2·4096 + MLP 3·4096·11008 + two norms 2·4096
    // = 202_391_552, times 32; final norm 4096.
    ("examples/hf/olmo-2-1124-7b.json", 7_298_617_344),
    // Llama-3.1-405B: embeddings and untied head 2·128256·16384 = 4_202_692_608; per layer
    // q, o 2·16384² + k, v 2·16384·1024 + MLP 3·16384·53248 + two norms 2·16384
    // = 3_187_703_808, times 126; final norm 16384.
    ("examples/hf/llama-3.1-405b.json", 405_853_388_800),
    // Falcon-7B: multi-query fused query_key_value 4544·(4544 + 2·64), tied head.
    ("examples/hf/falcon-7b.json", 6_921_720_704),
    // phi-2: q, k, v, dense and fc1, fc2 with biases, partial rotary; lm_head with a bias.
    ("examples/hf/phi-2.json", 2_779_683_840),
    // Pythia-1.4B (GPT-NeoX): parallel residual, untied embed_out.
    ("examples/hf/pythia-1.4b.json", 1_414_647_808),
    // bloom-560m: word_embeddings_layernorm, ALiBi (no position table), tied head.
    ("examples/hf/bloom-560m.json", 559_214_592),
    // roberta-base (masked LM): 514 positions, one token type, lm_head tied with its bias.
    ("examples/hf/roberta-base.json", 124_697_433),
    ("examples/hf/xlm-roberta-base.json", 278_295_186),
    // microsoft/deberta-v3-base as the Hub serves it (written from its published values: no
    // `architectures`, so the bare DebertaV2Model): 128100·768 word embeddings, 512 relative
    // embeddings (2·position_buckets) with their LayerNorm, 12 layers of disentangled attention
    // with shared relative keys (`share_att_key`); no position table (transformers 5.24 on the
    // meta device).
    ("examples/hf/deberta-v3-base.json", 183_831_552),
    // microsoft/deberta-v3-large: 24 layers of 1024, 16 heads, FFN 4096.
    ("examples/hf/deberta-v3-large.json", 434_012_160),
    // microsoft/deberta-v2-xlarge (written from its published values): 24 heads of
    // attention_head_size 64, and ConvLayer after layer 0 (Conv1d 1536 → 1536, kernel 3, with
    // its LayerNorm).
    ("examples/hf/deberta-v2-xlarge.json", 884_593_152),
    // StarCoder (GPT-BigCode): multi-query c_attn 6144·(6144 + 2·128) + bias, n_inner 24576.
    ("examples/hf/starcoder.json", 15_517_456_384),
    // mt5-small: transformers 5 ties its LM head to `shared` whatever the config says.
    ("examples/hf/mt5-small.json", 172_119_424),
    // openai/gpt-oss-20b (GptOssForCausalLM, config written from the Hub's values; the
    // checkpoint's MXFP4 `quantization_config` left out on the meta device): embeddings and
    // untied head 2·201088·2880 = 1_158_266_880; per layer q 2880·4096 + 4096, o 4096·2880 +
    // 2880, k, v 2·(2880·512 + 512), sinks 64, two norms 2·2880, router 32·2880 + 32, experts
    // 32·(2880·5760 + 5760 + 2880·2880 + 2880) = 796_538_880: 823_186_976, times 24; final
    // norm 2880 (transformers 5.24 on the meta device).
    ("examples/hf/gpt-oss-20b.json", 20_914_757_184),
    // openai/gpt-oss-120b: as 20b with 36 layers of 128 experts.
    ("examples/hf/gpt-oss-120b.json", 116_829_156_672),
    // Qwen3-30B-A3B: 128 experts of 768 per layer, top 8, q/k norms.
    ("examples/hf/qwen3-30b-a3b.json", 30_532_122_624),
    // stablelm-2-1.6b: LayerNorms with biases, Q/K/V biases, SiLU-gated MLP, untied head.
    ("examples/hf/stablelm-2-1_6b.json", 1_644_515_328),
    // StarCoder2-3B: biases everywhere, 2 K/V heads, tied head.
    ("examples/hf/starcoder2-3b.json", 3_030_371_328),
    // granite-3.0-2b-base: Llama's layers (the multipliers have no parameters), tied head.
    ("examples/hf/granite-3.0-2b-base.json", 2_533_531_648),
    // OLMo-1B-hf: LayerNorms without parameters, tied head.
    ("examples/hf/olmo-1b-hf.json", 1_176_764_416),
    // gemma-2-2b: four RMSNorms per layer, 8 heads of 256 over 4 K/V heads, tied head.
    ("examples/hf/gemma-2-2b.json", 2_614_341_888),
    // google/vit-base-patch16-224 (ViTForImageClassification): 16×16 patch convolution, CLS
    // token, 197 positions, 12 layers, 1000 classes (no pooler).
    ("examples/hf/vit-base-patch16-224.json", 86_567_656),
    // facebook/dinov2-base (Dinov2Model): 14×14 patches of 518×518 images (1370 positions),
    // two layer scales per layer, the unused mask token counted.
    ("examples/hf/dinov2-base.json", 86_580_480),
    // facebook/dinov2-giant: SwiGLU MLP of (int(1536·4·2/3) + 7) // 8 · 8 = 4096.
    ("examples/hf/dinov2-giant.json", 1_136_480_768),
    // The vision tower of openai/clip-vit-large-patch14-336 as LLaVA-1.5 loads it
    // (CLIPVisionModel): patch conv without bias, class embedding, 577 positions, pre- and
    // post-LayerNorm (the pooled branch's post_layernorm counted, without a gradient).
    (
        "examples/hf/clip-vit-large-patch14-336-vision.json",
        303_507_456,
    ),
    // The text tower of openai/clip-vit-base-patch32 (CLIPTextModel): 77 positions, causal.
    ("examples/hf/clip-vit-base-patch32-text.json", 63_165_952),
    // google/siglip-base-patch16-224's vision tower with `vision_use_head` set to false (the
    // attention-pooling head is not supported yet): no CLS token, 196 positions.
    (
        "examples/hf/siglip-base-patch16-224-vision-nohead.json",
        85_797_120,
    ),
    // google/siglip-base-patch16-224's text tower (SiglipTextModel), with its `head`.
    ("examples/hf/siglip-base-patch16-224-text.json", 110_271_744),
    // gemma-3-1b-pt: Gemma 2's layer with q_norm/k_norm, 4 heads of 256 over one K/V head.
    ("examples/hf/gemma-3-1b-pt.json", 999_885_952),
    // DeepSeek-V3: multi-head latent attention, 3 dense layers, 58 of 256 routed experts and
    // one shared (the multi-token-prediction layer 61 is not part of the transformers model).
    ("examples/hf/deepseek-v3.json", 671_026_404_352),
    // DeepSeek-V2-Lite: one q_proj (q_lora_rank null), 64 experts, 2 shared.
    ("examples/hf/deepseek-v2-lite.json", 15_706_484_224),
    // diffusers UNet2DConditionModel.from_config on the meta device (diffusers 0.42):
    // Stable Diffusion v1.5's UNet (8 heads, 768-wide CLIP states, 1×1 conv projections).
    ("examples/hf/stable-diffusion-v1-5-unet.json", 859_520_964),
    // Stable Diffusion 2.1: heads [5, 10, 20, 20] of 64, 1024-wide states, linear projections.
    ("examples/hf/stable-diffusion-2-1-unet.json", 865_910_724),
    // SDXL base 1.0: three levels, transformer_layers_per_block [1, 2, 10], the text_time
    // added embedding (2816 → 1280).
    (
        "examples/hf/stable-diffusion-xl-base-1.0-unet.json",
        2_567_463_684,
    ),
    // diffusers SD3Transformer2DModel.from_config on the meta device (diffusers 0.42.1):
    // stabilityai/stable-diffusion-3-medium's transformer (24 joint blocks of 1536, the last
    // context_pre_only; the 192² position table is a buffer, not counted).
    (
        "examples/hf/stable-diffusion-3-medium-transformer.json",
        2_028_328_000,
    ),
    // stabilityai/stable-diffusion-3.5-medium: 24 blocks, the first 13 with SD3.5's second
    // attention (`attn2`, a 9-chunk `SD35AdaLayerNormZeroX`), RMSNorm on every head's Q and K.
    (
        "examples/hf/stable-diffusion-3.5-medium-transformer.json",
        2_243_171_520,
    ),
    // stabilityai/stable-diffusion-3.5-large: 38 blocks of 38 heads (2432 wide), qk_norm.
    (
        "examples/hf/stable-diffusion-3.5-large-transformer.json",
        8_056_627_520,
    ),
    // black-forest-labs/FLUX.1-dev's transformer (FluxTransformer2DModel): 19 double-stream and
    // 38 single-stream blocks of 3072, the guidance embedder.
    ("examples/hf/flux.1-dev-transformer.json", 11_901_408_320),
    // llava-hf/llava-1.5-7b-hf (LlavaForConditionalGeneration): CLIP ViT-L/14-336 tower
    // 303_507_456 (post_layernorm included), projector 1024·4096 + 4096 + 4096² + 4096
    // = 20_979_712, Vicuna-7B (Llama) with a 32064-token vocabulary 6_607_605_760, untied
    // lm_head 32064·4096 = 131_334_144.
    ("examples/hf/llava-1.5-7b-hf.json", 7_063_427_072),
    // Qwen/Qwen2-VL-7B-Instruct: ViT of 32 blocks (1280 wide, patch embedding 1280·3·2·14·14
    // without bias, fused qkv, quick_gelu MLP of 5120), merger (LayerNorm, 5120 → 5120 →
    // 3584) 675_759_104; Qwen2-7B's layers with a 152064-token vocabulary 7_070_619_136; untied
    // lm_head 544_997_376.
    ("examples/hf/qwen2-vl-7b-instruct.json", 8_291_375_616),
    // Qwen/Qwen2.5-VL-7B-Instruct: RMSNorms and a biased SwiGLU MLP of 3420 in the 32 vision
    // blocks, merger 5120 → 5120 → 3584 (676_550_144 in all); the same language model and head.
    ("examples/hf/qwen2.5-vl-7b-instruct.json", 8_292_166_656),
    // openai/whisper-small (WhisperForConditionalGeneration): encoder conv1 80·768·3 + 768,
    // conv2 768·768·3 + 768, frozen embed_positions 1500·768, 12 layers of 7_087_104 (Q, V, O
    // with biases, K without: 4·768² + 3·768; two LayerNorms; fc1/fc2 of 3072), layer_norm:
    // 88_154_112; decoder embed_tokens 51865·768, embed_positions 448·768, 12 layers of
    // 9_450_240 (self and cross attention, three LayerNorms, the MLP), layer_norm:
    // 153_580_800; proj_out tied (transformers 5.24 on the meta device: 241_734_912).
    ("examples/hf/whisper-small.json", 241_734_912),
    // openai/whisper-large-v3: 128 mel bins, d_model 1280, 32 + 32 layers of 20 heads, FFN
    // 5120, vocabulary 51866 (transformers 5.24 on the meta device).
    ("examples/hf/whisper-large-v3.json", 1_543_490_560),
];

/// Runs a report with a short sequence (the counts do not depend on it); a vision config
/// (`image_size`) reads no sequence.
fn params(args: &[&str]) -> u64 {
    let mut all = args.to_vec();
    let text = std::fs::read_to_string(path(args[0])).unwrap_or_default();
    if !text.contains("\"image_size\"") && !text.contains("\"vision_config\"") {
        all.extend(["--seq", "64"]);
    }
    u(&report(&all), "param_count")
}

/// Every `.json` file in `examples/hf/`, sorted, relative to the crate root.
fn bundled_configs() -> Vec<String> {
    let mut files: Vec<String> = std::fs::read_dir(path("examples/hf"))
        .unwrap()
        .map(|e| format!("examples/hf/{}", e.unwrap().file_name().to_string_lossy()))
        .filter(|f| f.ends_with(".json"))
        .collect();
    files.sort();
    files
}

#[test]
fn parameter_counts_are_exact() {
    let mut wrong = Vec::new();
    for &(file, expected) in PARAM_COUNTS {
        let got = params(&[file]);
        if got != expected {
            wrong.push(format!("{file}: memest {got}, transformers {expected}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn every_shipped_config_is_counted() {
    for f in &bundled_configs() {
        assert!(
            PARAM_COUNTS.iter().any(|(p, _)| p == f),
            "{f} has no exact parameter count in PARAM_COUNTS"
        );
    }
}

#[test]
fn head_flag_picks_another_head() {
    let cases: &[(&[&str], u64)] = &[
        // bare BertModel, pooler included
        (
            &["examples/hf/bert-base-uncased.json", "--head", "none"],
            109_482_240,
        ),
        (
            &[
                "examples/hf/bert-base-uncased.json",
                "--head",
                "classification",
            ],
            109_483_778,
        ),
        (
            &["examples/hf/bert_base_cls.json", "--head", "lm"],
            109_514_298,
        ),
        // GPT-2's head is tied: the bare model has as many parameters
        (&["examples/hf/gpt2.json", "--head", "none"], 124_439_808),
        (
            &["examples/hf/gpt2.json", "--head", "classification"],
            124_441_344,
        ),
        (
            &["examples/hf/llama_tiny.json", "--head", "none"],
            27_660_800,
        ),
        (
            &["examples/hf/llama_tiny.json", "--head", "classification"],
            27_661_824,
        ),
        (
            &["examples/hf/llama_tiny.json", "--head", "auto"],
            44_044_800,
        ),
        (
            &["examples/hf/qwen3-8b.json", "--head", "classification"],
            7_568_413_696,
        ),
        (&["examples/hf/t5-small.json", "--head", "none"], 60_506_624),
        // DebertaV2ForMaskedLM: the legacy `cls.predictions` head (dense, LayerNorm, decoder
        // tied to the word embeddings, one [vocab] bias); …ForSequenceClassification: the
        // ContextPooler's dense and the classifier (transformers 5.24 on the meta device).
        (
            &["examples/hf/deberta-v3-base.json", "--head", "lm"],
            184_551_780,
        ),
        (
            &[
                "examples/hf/deberta-v3-base.json",
                "--head",
                "classification",
            ],
            184_423_682,
        ),
        (
            &["examples/hf/deberta-v3-large.json", "--head", "lm"],
            435_191_908,
        ),
        (
            &["examples/hf/deberta-v2-xlarge.json", "--head", "lm"],
            887_085_156,
        ),
        (
            &["examples/hf/t5-small.json", "--head", "classification"],
            60_770_306,
        ),
    ];
    for (args, expected) in cases {
        assert_eq!(params(args), *expected, "memest {}", args.join(" "));
    }
}

#[test]
fn bare_model_has_no_loss() {
    let v = report(&[
        "examples/hf/llama_tiny.json",
        "--head",
        "none",
        "--seq",
        "32",
    ]);
    let layers = v["layers"].as_array().unwrap();
    assert!(
        layers.iter().all(|l| l["kind"] != "cross_entropy"),
        "{layers:#?}"
    );
    let v = report(&["examples/hf/llama_tiny.json", "--seq", "32"]);
    let last = v["layers"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["kind"], "cross_entropy");
}

/// What the model description of a config looks like, through `--print-model`.
fn printed(args: &[&str]) -> toml::Table {
    let mut all = vec!["--print-model"];
    all.extend_from_slice(args);
    let out = memest(&all);
    assert_eq!(code(&out), 0, "{}", describe(&out));
    stdout(&out)
        .parse::<toml::Table>()
        .unwrap_or_else(|e| panic!("--print-model is not TOML: {e}\n{}", describe(&out)))
}

fn layers(t: &toml::Table) -> Vec<toml::Table> {
    t["layers"]
        .as_array()
        .expect("layers")
        .iter()
        .map(|l| l.as_table().unwrap().clone())
        .collect()
}

#[test]
fn decoder_layers_are_one_repeat_block() {
    for (file, count) in [
        ("examples/hf/llama-2-7b.json", 32),
        ("examples/hf/mixtral-8x7b.json", 32),
        ("examples/hf/qwen3-8b.json", 36),
        ("examples/hf/gemma-7b.json", 28),
    ] {
        let t = printed(&[file]);
        let repeats: Vec<_> = layers(&t)
            .into_iter()
            .filter(|l| l["kind"].as_str() == Some("repeat"))
            .collect();
        assert_eq!(repeats.len(), 1, "{file}");
        assert_eq!(repeats[0]["count"].as_integer(), Some(count), "{file}");
    }
}

/// The attention layer of the (first) repeated block.
fn attention(file: &str) -> toml::Table {
    let t = printed(&[file]);
    let block = layers(&t)
        .into_iter()
        .find(|l| l["kind"].as_str() == Some("repeat"))
        .expect("a repeat block");
    block["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_table().unwrap().clone())
        .find(|l| l["kind"].as_str() == Some("attention"))
        .expect("an attention layer")
}

#[test]
fn family_attention_keys() {
    let a = attention("examples/hf/llama-3-8b.json");
    assert_eq!(a["kv_heads"].as_integer(), Some(8));
    assert_eq!(a["bias"].as_bool(), Some(false));
    assert_eq!(a["rotary"].as_bool(), Some(true));
    let a = attention("examples/hf/mistral-7b-v0.1.json");
    assert_eq!(a["sliding_window"].as_integer(), Some(4096));
    let a = attention("examples/hf/qwen2-7b.json");
    assert!(a.get("bias").is_none(), "qwen2 has q/k/v biases: {a:?}");
    assert_eq!(a["out_bias"].as_bool(), Some(false));
    assert!(
        a.get("sliding_window").is_none(),
        "use_sliding_window is false"
    );
    let a = attention("examples/hf/qwen3-8b.json");
    assert_eq!(a["qk_norm"].as_bool(), Some(true));
    let a = attention("examples/hf/gemma-7b.json");
    assert_eq!(a["head_dim"].as_integer(), Some(256));
    let a = attention("examples/hf/phi-3-mini.json");
    assert_eq!(a["fused_qkv"].as_bool(), Some(true));
    let t = printed(&["examples/hf/gemma-7b.json"]);
    let l = layers(&t);
    assert_eq!(l[1]["kind"].as_str(), Some("scale"));
    let lm = l
        .iter()
        .find(|l| l["name"].as_str() == Some("lm_head"))
        .unwrap();
    assert_eq!(lm["tie"].as_str(), Some("model.embed_tokens"));
}

#[test]
fn defaults_come_from_the_config() {
    let t = printed(&["examples/hf/llama-2-7b.json"]);
    assert_eq!(t["defaults"]["dtype"].as_str(), Some("float16"));
    assert_eq!(t["defaults"]["seq"].as_integer(), Some(2048));
    assert_eq!(
        t["input"]["shape"].as_array().unwrap()[0].as_str(),
        Some("seq")
    );
    assert_eq!(t["input"]["dtype"].as_str(), Some("int64"));
    let t = printed(&["examples/hf/bert-base-uncased.json"]);
    assert_eq!(t["defaults"]["seq"].as_integer(), Some(512));
    assert!(t["defaults"].get("dtype").is_none());
    let v = report(&["examples/hf/llama-3-8b.json"]);
    assert_eq!(v["settings"]["dtype"], "bfloat16");
    assert_eq!(v["settings"]["seq"], 2048);
}

#[test]
fn olmo2_normalizes_after_attention_and_mlp_and_over_the_whole_projection() {
    let a = attention("examples/hf/olmo-2-1124-7b.json");
    assert_eq!(a["qk_norm"].as_bool(), Some(true));
    assert_eq!(a["qk_norm_scope"].as_str(), Some("projection"));
    assert_eq!(a["bias"].as_bool(), Some(false));
    let t = printed(&["examples/hf/olmo-2-1124-7b.json"]);
    let l = layers(&t);
    assert_eq!(l[1]["tables_f32"].as_bool(), Some(true), "{:?}", l[1]);
    let block = l
        .iter()
        .find(|l| l["kind"].as_str() == Some("repeat"))
        .unwrap();
    let names: Vec<&str> = block["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "self_attn",
            "post_attention_layernorm",
            "residual1",
            "mlp.gate_proj",
            "mlp.act_fn",
            "mlp.up_proj",
            "mlp.gate_mul_up",
            "mlp.down_proj",
            "post_feedforward_layernorm",
            "residual2"
        ]
    );
    let lm = l
        .iter()
        .find(|l| l["name"].as_str() == Some("lm_head"))
        .unwrap();
    assert!(lm.get("tie").is_none(), "OLMo-2's head is untied: {lm:?}");
}

/// Hand-written descriptions whose measured cases also run from a Hugging Face config:
/// (the file a case names, the config that replaces it).
const FROM_CONFIG: &[(&str, &str)] = &[
    ("examples/llama_tiny.toml", "examples/hf/llama_tiny.json"),
    ("examples/gpt2.toml", "examples/hf/gpt2.json"),
    (
        "tests/fixtures/gpt2_attn_pdrop0.toml",
        "tests/fixtures/hf/gpt2_attn_pdrop0.json",
    ),
    ("examples/bert_base.toml", "examples/hf/bert_base_cls.json"),
    (
        "tests/fixtures/extra/t5_tiny_relu.toml",
        "tests/fixtures/extra/t5_tiny_relu.json",
    ),
    (
        "tests/fixtures/extra/t5_tiny_gatedgelu.toml",
        "tests/fixtures/extra/t5_tiny_gatedgelu.json",
    ),
    (
        "tests/fixtures/extra/mixtral_tiny.toml",
        "tests/fixtures/extra/mixtral_tiny.json",
    ),
];

/// The measured cases of `set` whose model has a config in [`FROM_CONFIG`]: (id, arguments
/// with the hand-written file, arguments with the config, reference record).
fn config_cases(set: &Set) -> Vec<(String, Vec<String>, Vec<String>, Value)> {
    cases_in(set)
        .into_iter()
        .filter_map(|(id, args, record)| {
            let &(_, config) = FROM_CONFIG.iter().find(|(f, _)| *f == args[0])?;
            let mut hf_args = args.clone();
            hf_args[0] = config.to_string();
            Some((id, args, hf_args, record))
        })
        .collect()
}

#[test]
fn reference_cases_from_configs_match_the_measurements() {
    for (set, at_least) in [(&SHARED, 6), (&EXTRA, 3)] {
        let cases: Vec<(String, Vec<String>, Value)> = config_cases(set)
            .into_iter()
            .map(|(id, _, hf_args, record)| (id, hf_args, record))
            .collect();
        assert!(cases.len() >= at_least, "{} config cases", cases.len());
        assert_all_ok(&compare_cases(&cases));
    }
}

#[test]
fn configs_give_the_hand_written_estimates() {
    for set in [&SHARED, &EXTRA] {
        for (id, args, hf_args, _) in config_cases(set) {
            let a: Vec<&str> = args.iter().map(String::as_str).collect();
            let b: Vec<&str> = hf_args.iter().map(String::as_str).collect();
            let (hand, config) = (report(&a), report(&b));
            for field in [
                "param_count",
                "parameters_bytes",
                "buffers_bytes",
                "gradients_bytes",
                "optimizer_state_bytes",
                "activations_bytes",
                "peak_bytes",
            ] {
                assert_eq!(
                    u(&hand, field),
                    u(&config, field),
                    "{id}: {field} differs between {} and {}",
                    args[0],
                    hf_args[0]
                );
            }
        }
    }
}

/// Tiny configs of each family (`tests/fixtures/hf/`, measured cases in `tests/data/hf-*.json`,
/// defined in `tools/hf_cases.json`): the same harness and tolerances as `reference.rs`.
#[test]
fn tiny_configs_of_each_family_match_measurements() {
    let rows = compare_set(&HF);
    assert_all_ok(&rows);
    assert_medians(&rows);
    snapshot("reference_hf", &rows);
}

/// The same tiny configs on CUDA kernels (emulated H100, `tools/measure_fake_cuda.py`).
#[test]
fn tiny_configs_of_each_family_match_cuda_measurements() {
    let rows = compare_set(&HF_CUDA);
    assert_all_ok(&rows);
    assert_medians(&rows);
    snapshot("reference_hf_cuda", &rows);
}

/// Estimates of a description under a grid of settings, in-process.
fn estimates(spec: &memest::spec::ModelSpec) -> Vec<Value> {
    let mut out = Vec::new();
    // A multimodal model's sequence holds its image tokens too (576 for llava-1.5).
    // (Whisper's named input is its audio features: no tokens.)
    let image_tokens = if spec.inputs.contains_key("pixel_values") {
        1024
    } else {
        0
    };
    for (batch, seq, mode, checkpoint) in [
        (1, 1, Mode::Train, false),
        (3, 17, Mode::Train, true),
        (2, 64, Mode::Infer, false),
    ] {
        let overrides = Overrides {
            batch: Some(batch),
            seq: Some(seq + image_tokens),
            mode: Some(mode),
            checkpoint,
            ..Overrides::default()
        };
        let r = memest::estimate_spec(spec, "m", &overrides, None)
            .unwrap_or_else(|e| panic!("estimate failed: {e}"));
        out.push(serde_json::to_value(&r).unwrap());
    }
    out
}

/// For every bundled config (and every head of the small ones), `--print-model`'s TOML read
/// back gives the same estimate under every setting of a grid.
#[test]
fn print_model_round_trips_every_bundled_config() {
    const SMALL: &[&str] = &[
        "examples/hf/bert_base_cls.json",
        "examples/hf/gpt2.json",
        "examples/hf/llama_tiny.json",
        "examples/hf/t5-small.json",
    ];
    for file in bundled_configs() {
        let text = std::fs::read_to_string(path(&file)).unwrap();
        let heads: &[Head] = if SMALL.contains(&file.as_str()) {
            &[Head::Auto, Head::None, Head::Lm, Head::Classification]
        } else {
            &[Head::Auto]
        };
        for &head in heads {
            let spec = memest::load_spec(&text, Format::Json, head)
                .unwrap_or_else(|e| panic!("{file}: {e}"));
            let toml = memest::print_model::to_toml(&spec).unwrap();
            let back = memest::load_spec(&toml, Format::Toml, Head::Auto)
                .unwrap_or_else(|e| panic!("{file}: the printed TOML does not parse: {e}\n{toml}"));
            assert_eq!(
                estimates(&spec),
                estimates(&back),
                "{file} (--head {head:?}): the printed TOML gives another estimate"
            );
        }
    }
}

#[test]
fn print_model_round_trips_through_the_binary() {
    for file in ["examples/hf/llama_tiny.json", "examples/hf/t5-small.json"] {
        let out = memest(&["--print-model", file]);
        assert_eq!(code(&out), 0, "{}", describe(&out));
        let toml = TempModel::new("toml", &stdout(&out));
        assert_eq!(
            report(&[file, "--seq", "64"]),
            report(&[toml.arg(), "--seq", "64"]),
            "{file}: the printed TOML gives another estimate"
        );
    }
}

#[test]
fn print_model_round_trips_memest_files() {
    for file in [
        "examples/gpt2.toml",
        "examples/resnet50.toml",
        "examples/vit_b_16.toml",
        "tests/fixtures/mlp.json",
    ] {
        let out = memest(&["--print-model", file]);
        assert_eq!(code(&out), 0, "{}", describe(&out));
        let toml = TempModel::new("toml", &stdout(&out));
        assert_eq!(
            report(&[file]),
            report(&[toml.arg()]),
            "{file}: the printed TOML gives another estimate"
        );
    }
}

#[test]
fn print_model_of_a_memest_file_is_toml_too() {
    let t = printed(&["examples/mlp.toml"]);
    assert_eq!(t["name"].as_str(), Some("mlp"));
    assert_eq!(layers(&t).len(), 5);
}

/// Runs memest expecting a usage/input error; returns stderr.
fn fails(args: &[&str]) -> String {
    let out = memest(args);
    assert_eq!(code(&out), 2, "expected exit status 2\n{}", describe(&out));
    assert!(out.stdout.is_empty(), "{}", describe(&out));
    let err = stderr(&out);
    assert!(
        err.starts_with("error:") && !err.contains("panicked"),
        "{err}"
    );
    err
}

#[test]
fn unsupported_model_type_lists_the_supported_ones() {
    let f = TempModel::new(
        "json",
        r#"{"model_type": "mamba", "architectures": ["MambaForCausalLM"], "hidden_size": 64}"#,
    );
    let err = fails(&[f.arg()]);
    for needle in [
        "mamba",
        "not supported",
        "falcon",
        "llama",
        "mixtral",
        "qwen2_moe",
        "t5",
    ] {
        assert!(err.contains(needle), "missing {needle:?} in {err}");
    }
}

#[test]
fn missing_field_is_named() {
    let f = TempModel::new(
        "json",
        r#"{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 100,
            "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}"#,
    );
    let err = fails(&[f.arg()]);
    assert!(err.contains("`hidden_size`"), "{err}");
    assert!(err.contains(f.arg()), "the message names the file: {err}");
}

#[test]
fn cohere_parallel_block_and_refusals() {
    // One bias-free CohereLayerNorm feeding attention and the MLP; the logits scaled.
    let t = printed(&["tests/fixtures/hf/cohere_tiny.json"]);
    let top = layers(&t);
    let body: Vec<toml::Table> = top
        .iter()
        .find(|l| l["kind"].as_str() == Some("repeat"))
        .and_then(|l| l["layers"].as_array())
        .unwrap()
        .iter()
        .map(|v| v.as_table().unwrap().clone())
        .collect();
    let norms: Vec<&toml::Table> = body
        .iter()
        .filter(|l| l["kind"].as_str() == Some("layernorm"))
        .collect();
    assert_eq!(norms.len(), 1);
    assert_eq!(norms[0]["style"].as_str(), Some("cohere"));
    let gate = body
        .iter()
        .find(|l| l["name"].as_str() == Some("mlp.gate_proj"))
        .unwrap();
    assert_eq!(
        gate["inputs"].as_array().unwrap()[0].as_str(),
        Some("input_layernorm")
    );
    let scale = top
        .iter()
        .find(|l| l["name"].as_str() == Some("logit_scale"))
        .unwrap();
    assert_eq!(scale["factor"].as_float(), Some(0.0625));

    let f = TempModel::new(
        "json",
        r#"{"model_type": "cohere", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "use_qk_norm": true}"#,
    );
    let err = fails(&[f.arg()]);
    assert!(err.contains("`use_qk_norm = true`"), "{err}");
    let f = TempModel::new(
        "toml",
        "[input]\nshape = [8]\n[[layers]]\nkind = \"layernorm\"\nstyle = \"cohere\"\nbias = true\n",
    );
    let err = fails(&[f.arg()]);
    assert!(
        err.contains("`style = \"cohere\"` has a weight and no bias"),
        "{err}"
    );
}

/// DeBERTa-v2: the encoder's relative embeddings before the layers, ConvLayer after layer 0
/// when `conv_kernel_size` is set, and the configs transformers cannot run refused by field.
#[test]
fn deberta_v2_layout_and_refusals() {
    let t = printed(&["examples/hf/deberta-v2-xlarge.json"]);
    let top = layers(&t);
    let names: Vec<&str> = top.iter().filter_map(|l| l["name"].as_str()).collect();
    let at = |n: &str| names.iter().position(|&m| m == n).unwrap();
    assert!(at("encoder.rel_embeddings") < at("encoder.layer.0"));
    assert!(at("encoder.layer.0") < at("encoder.conv.conv"));
    assert!(at("encoder.conv.output_mask") < at("encoder.layer.1-23"));
    let conv = &top[at("encoder.conv.permute")];
    assert_eq!(
        conv["inputs"].as_array().unwrap()[0].as_str(),
        Some("embeddings.dropout")
    );
    let residual = &top[at("encoder.conv.residual")];
    assert_eq!(
        residual["inputs"].as_array().unwrap()[0].as_str(),
        Some("encoder.layer.0")
    );
    let rel = &top[at("encoder.rel_embeddings")];
    assert_eq!(rel["num_positions"].as_integer(), Some(256));
    assert_eq!(rel["norm"].as_bool(), Some(true));

    let base = r#""model_type": "deberta-v2", "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4"#;
    for (extra, said) in [
        (
            r#""relative_attention": false"#,
            "`relative_attention = false`",
        ),
        (
            r#""relative_attention": true, "pos_att_type": "p2p""#,
            "`pos_att_type` entry `p2p`",
        ),
        (
            r#""relative_attention": true, "pos_att_type": ["c2p"], "attention_head_size": 8"#,
            "`attention_head_size` (8)",
        ),
    ] {
        let f = TempModel::new("json", &format!("{{{base}, {extra}}}"));
        let err = fails(&[f.arg()]);
        assert!(err.contains(said), "{extra}: {err}");
    }
}

#[test]
fn wrong_field_type_is_named() {
    let f = TempModel::new(
        "json",
        r#"{"model_type": "gpt2", "vocab_size": 100, "n_embd": "768", "n_layer": 2, "n_head": 4}"#,
    );
    let err = fails(&[f.arg()]);
    assert!(err.contains("`n_embd`"), "{err}");
}

#[test]
fn unknown_architecture_suggests_the_head_flag() {
    let f = TempModel::new(
        "json",
        r#"{"model_type": "bert", "architectures": ["BertForQuestionAnswering"], "vocab_size": 100,
            "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128}"#,
    );
    let err = fails(&[f.arg()]);
    assert!(
        err.contains("BertForQuestionAnswering") && err.contains("--head"),
        "{err}"
    );
    let v = report(&[f.arg(), "--head", "none", "--seq", "16"]);
    assert!(u(&v, "param_count") > 0);
}

#[test]
fn head_flag_needs_a_hugging_face_config() {
    let err = fails(&["examples/mlp.toml", "--head", "lm"]);
    assert!(err.contains("--head"), "{err}");
}

#[test]
fn config_on_standard_input() {
    let text = std::fs::read_to_string(path("examples/hf/gpt2.json")).unwrap();
    let out = crate::common::memest_stdin(&["-", "--format", "json", "--seq", "32"], &text);
    assert_eq!(code(&out), 0, "{}", describe(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(u(&v, "param_count"), 124_439_808);
}

/// A config Python's `json` wrote with `NaN`, `Infinity` and `-Infinity` (unquoted, as
/// `json.dump` writes `float('nan')` and `float('inf')`) is read, those values as unset: Llama-2-7B
/// keeps its 6,738,415,616 parameters. Before, it was read as a memest file ("unknown key
/// `model_type`").
#[test]
fn config_with_python_nan_and_infinity_is_read() {
    let text = std::fs::read_to_string(path("examples/hf/llama-2-7b.json")).unwrap();
    let text = text.replacen(
        '{',
        "{\n  \"logit_cap\": Infinity,\n  \"router_jitter\": NaN,\n  \"floor\": -Infinity,\n  \"note\": \"NaN and Infinity in a string stay\",",
        1,
    );
    let m = TempModel::new("json", &text);
    let r = report(&[m.arg()]);
    assert_eq!(u(&r, "param_count"), 6_738_415_616);
}

/// A downloaded `config.json` is named by its `_name_or_path`, else by its folder (the Hugging
/// Face cache's `models--org--name/snapshots/<hash>/` is `org/name`), not "config".
#[test]
fn a_downloaded_config_is_named_by_its_model() {
    let with_name = std::fs::read_to_string(path("examples/hf/llama-2-7b.json")).unwrap();
    let without: String = with_name
        .lines()
        .filter(|l| !l.contains("_name_or_path"))
        .collect::<Vec<_>>()
        .join("\n");
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join(
        "models--meta-llama--Llama-2-7b-hf/snapshots/8cca527612d856d7d32bd94f8103728d614eb852",
    );
    let plain = dir.path().join("my-llama");
    for (folder, text) in [
        (&cache, &without),
        (&plain, &without),
        (&dir.path().to_path_buf(), &with_name),
    ] {
        std::fs::create_dir_all(folder).unwrap();
        std::fs::write(folder.join("config.json"), text).unwrap();
    }
    let name = |folder: &std::path::Path| {
        let file = folder.join("config.json");
        report(&[file.to_str().unwrap()])["model"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(name(dir.path()), "meta-llama/Llama-2-7b-hf");
    assert_eq!(name(&cache), "meta-llama/Llama-2-7b-hf");
    assert_eq!(name(&plain), "my-llama");
}

/// A diffusers config (Stable Diffusion's UNet) is named as such, not read as a memest file
/// ("unknown key `_class_name`" before).
#[test]
fn a_diffusers_config_is_recognised() {
    let f = TempModel::new(
        "json",
        r#"{"_class_name": "UNet2DConditionModel", "_diffusers_version": "0.6.0",
            "in_channels": 4, "out_channels": 4, "block_out_channels": [320, 640],
            "down_block_types": ["AttnDownBlock2D", "DownBlock2D"]}"#,
    );
    let err = fails(&[f.arg()]);
    assert!(
        err.contains("`down_block_types`: block `AttnDownBlock2D` is not supported yet (supported: CrossAttnDownBlock2D, DownBlock2D)"),
        "{err}"
    );
    let f = TempModel::new(
        "json",
        r#"{"_class_name": "AutoencoderKL", "_diffusers_version": "0.6.0", "in_channels": 3}"#,
    );
    let err = fails(&[f.arg()]);
    assert!(
        err.contains("a diffusers AutoencoderKL config: not supported yet (memest reads diffusers configs of class FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel and"),
        "{err}"
    );
}

/// A misspelled `model_type` gets the nearest supported name.
#[test]
fn unsupported_model_type_names_the_nearest() {
    let f = TempModel::new(
        "json",
        r#"{"model_type": "gpt-neox", "vocab_size": 100, "hidden_size": 64}"#,
    );
    let err = fails(&[f.arg()]);
    assert!(
        err.contains("the nearest supported one is `gpt_neox`"),
        "{err}"
    );
}

/// The backticked names in the first column of the README table that starts after `heading`
/// (its rows up to the first line that is not a row).
fn readme_first_column(heading: &str) -> std::collections::BTreeSet<String> {
    let readme = std::fs::read_to_string(path("README.md")).unwrap();
    let after = &readme[readme.find(heading).expect("the README section")..];
    after
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .flat_map(|row| {
            let first = row.split('|').nth(1).unwrap_or_default();
            first
                .split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// `memest models` lists the model types and layer kinds, and the README's tables say the same.
#[test]
fn memest_models_matches_the_readme() {
    let out = memest(&["models"]);
    assert_eq!(code(&out), 0, "{}", describe(&out));
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 6, "{text}");
    let names = |line: &str| -> std::collections::BTreeSet<String> {
        line.trim().split(", ").map(str::to_string).collect()
    };
    let types = names(lines[1]);
    for t in [
        "falcon",
        "gpt_neox",
        "phi",
        "bloom",
        "roberta",
        "xlm-roberta",
        "deberta-v2",
        "llama",
    ] {
        assert!(types.contains(t), "{t} missing from {text}");
    }
    assert_eq!(
        types,
        readme_first_column("| `model_type` | what is built |")
    );
    assert_eq!(
        names(lines[3]),
        readme_first_column("| `_class_name` | what is built |")
    );
    let mut kinds = names(lines[5]);
    // `repeat` has its own README section rather than a row of the kinds table.
    assert!(kinds.remove("repeat"), "{text}");
    assert_eq!(kinds, readme_first_column("### Layer kinds"));
}

/// Gemma 2: four norms around attention and MLP, soft-capped attention, soft-capped logits
/// before the loss, eager attention by default, sliding windows on every other layer.
#[test]
fn gemma2_sandwich_norms_and_soft_capping() {
    let t = printed(&["examples/hf/gemma-2-2b.json"]);
    assert_eq!(t["defaults"]["attention"].as_str(), Some("eager"));
    let l = layers(&t);
    let blocks: Vec<&toml::Table> = l
        .iter()
        .filter(|l| l["kind"].as_str() == Some("repeat"))
        .collect();
    assert_eq!(blocks.len(), 26, "one block per layer: windows alternate");
    let body = blocks[0]["layers"].as_array().unwrap();
    let names: Vec<&str> = body.iter().map(|l| l["name"].as_str().unwrap()).collect();
    for norm in [
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ] {
        assert!(names.contains(&norm), "{names:?}");
    }
    let attn = body
        .iter()
        .find(|l| l["kind"].as_str() == Some("attention"))
        .unwrap();
    assert_eq!(attn["softcap"].as_float(), Some(50.0));
    assert_eq!(attn["sliding_window"].as_integer(), Some(4096));
    let second = blocks[1]["layers"].as_array().unwrap();
    let attn2 = second
        .iter()
        .find(|l| l["kind"].as_str() == Some("attention"))
        .unwrap();
    assert!(attn2.get("sliding_window").is_none(), "{attn2:?}");
    let tail: Vec<&str> = l[l.len() - 5..]
        .iter()
        .map(|l| l["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        tail,
        [
            "lm_head",
            "final_logit_softcapping.div",
            "final_logit_softcapping.tanh",
            "final_logit_softcapping.mul",
            "loss"
        ]
    );
}

/// Gemma 3: five sliding-window layers to one global (`sliding_window_pattern` 6), Gemma-style
/// q/k norms, one rotary table per layer type, no soft-capping, SDPA by default.
#[test]
fn gemma3_sliding_pattern_qk_norms_and_two_rotary_tables() {
    let t = printed(&["examples/hf/gemma-3-1b-pt.json"]);
    assert_eq!(t["defaults"]["attention"].as_str(), Some("flash"));
    let l = layers(&t);
    let rotary: Vec<(&str, bool)> = l
        .iter()
        .filter(|l| l["kind"].as_str() == Some("rotary"))
        .map(|l| {
            (
                l["name"].as_str().unwrap(),
                l.get("local").and_then(toml::Value::as_bool) == Some(true),
            )
        })
        .collect();
    assert_eq!(
        rotary,
        [
            ("model.rotary_emb.full_attention", false),
            ("model.rotary_emb.sliding_attention", true)
        ]
    );
    // 26 layers: 0-4 slide, 5 global, ... 23 global, 24-25 slide.
    let blocks: Vec<(u64, bool)> = l
        .iter()
        .filter(|l| l["kind"].as_str() == Some("repeat"))
        .map(|b| {
            let attn = b["layers"]
                .as_array()
                .unwrap()
                .iter()
                .find(|l| l["kind"].as_str() == Some("attention"))
                .unwrap();
            assert_eq!(attn["qk_norm_style"].as_str(), Some("gemma"));
            assert!(attn.get("softcap").is_none(), "{attn:?}");
            (
                u64::try_from(b["count"].as_integer().unwrap()).unwrap(),
                attn.get("sliding_window").is_some(),
            )
        })
        .collect();
    let mut expected = Vec::new();
    for _ in 0..4 {
        expected.extend([(5, true), (1, false)]);
    }
    expected.push((2, true));
    assert_eq!(blocks, expected);
    assert_eq!(l.last().unwrap()["name"].as_str(), Some("loss"));
}

/// DeepSeek-V3: multi-head latent attention on every layer, three dense layers then the
/// sigmoid-routed experts over 8 groups with one shared expert; a decoder `--mode generate`
/// accepts, its cache holding the compressed latents.
#[test]
fn deepseek_v3_latent_attention_dense_then_grouped_experts() {
    let t = printed(&["examples/hf/deepseek-v3.json"]);
    let l = layers(&t);
    let blocks: Vec<&toml::Table> = l
        .iter()
        .filter(|l| l["kind"].as_str() == Some("repeat"))
        .collect();
    let counts: Vec<i64> = blocks
        .iter()
        .map(|b| b["count"].as_integer().unwrap())
        .collect();
    assert_eq!(counts, [3, 58]);
    let find = |b: &toml::Table, kind: &str| {
        b["layers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["kind"].as_str() == Some(kind))
            .cloned()
    };
    let mla = find(blocks[0], "mla").unwrap();
    assert_eq!(mla["q_lora_rank"].as_integer(), Some(1536));
    assert_eq!(mla["kv_lora_rank"].as_integer(), Some(512));
    assert!(find(blocks[0], "moe").is_none());
    let moe = find(blocks[1], "moe").unwrap();
    assert_eq!(moe["router"].as_str(), Some("deepseek_v3"));
    assert_eq!(moe["groups"].as_integer(), Some(8));
    assert_eq!(moe["topk_groups"].as_integer(), Some(4));
    assert_eq!(moe["shared_intermediate_size"].as_integer(), Some(2048));
    let rotary = l
        .iter()
        .find(|l| l["kind"].as_str() == Some("rotary"))
        .unwrap();
    assert_eq!(rotary["head_dim"].as_integer(), Some(64));
    // Serving: the cache holds kv_lora_rank + qk_rope_head_dim per token and layer.
    let r = report(&[
        "tests/fixtures/hf/deepseek_v3_tiny.json",
        "--mode",
        "generate",
        "--new-tokens",
        "16",
        "--batch",
        "2",
        "--seq",
        "64",
    ]);
    // 3 layers × batch 2 × 79 cached tokens × (64 + 16) × 4 B at the last decode step.
    assert_eq!(r["kv_cache_bytes"].as_u64(), Some(3 * 2 * 79 * 80 * 4));
}

/// DINOv2's `mlp_ratio` must be finite and above 0, and `int(hidden_size · mlp_ratio)` (64 ·
/// ratio here) a width of at least one feature (the SwiGLU FFN's `int(2/3 ·)` rounded up to 8
/// too); sizes past `i64::MAX` are refused naming their field (they wrapped to negative dims).
/// A valid ratio still builds: 2.5 gives `mlp.fc1` 64 · 2.5 = 160 features.
#[test]
fn vision_sizes_are_checked() {
    let dinov2 = |extra: &str| {
        format!(
            r#"{{"model_type": "dinov2", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "image_size": 28, "patch_size": 7{extra}}}"#
        )
    };
    for (extra, message) in [
        (
            r#", "mlp_ratio": -1"#,
            "`mlp_ratio` = -1: expected a finite number above 0",
        ),
        (
            r#", "mlp_ratio": 0"#,
            "`mlp_ratio` = 0: expected a finite number above 0",
        ),
        (
            r#", "mlp_ratio": 1e30"#,
            "hidden_size 64 × mlp_ratio gives 64000000000000000000000000000000 MLP features",
        ),
        (
            r#", "mlp_ratio": 0.001"#,
            "hidden_size 64 × mlp_ratio gives 0 MLP features",
        ),
        (
            r#", "mlp_ratio": 0.02, "use_swiglu_ffn": true"#,
            "`mlp_ratio`: 1 MLP features leave the SwiGLU FFN none",
        ),
    ] {
        let m = TempModel::new("json", &dinov2(extra));
        let out = memest(&[m.arg()]);
        assert_eq!(code(&out), 2, "{extra}: {}", stderr(&out));
        assert!(stderr(&out).contains(message), "{extra}: {}", stderr(&out));
    }
    let m = TempModel::new("json", &dinov2(r#", "mlp_ratio": 2.5"#));
    let out = memest(&[m.arg(), "--print-model"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(
        stdout(&out).contains("out_features = 160"),
        "{}",
        stdout(&out)
    );
    let clip = TempModel::new(
        "json",
        r#"{"model_type": "clip_vision_model", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "image_size": 3037000500, "patch_size": 1}"#,
    );
    let out = memest(&[clip.arg()]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert!(
        stderr(&out)
            .contains("`image_size` gives 9223372037000250001, more than a tensor dimension holds"),
        "{}",
        stderr(&out)
    );
    let vit = TempModel::new(
        "json",
        r#"{"model_type": "vit", "hidden_size": 9223372036854775808, "num_hidden_layers": 1,
        "num_attention_heads": 1, "image_size": 28, "patch_size": 7}"#,
    );
    let out = memest(&[vit.arg()]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert!(
        stderr(&out).contains(
            "`hidden_size` gives 9223372036854775808, more than a tensor dimension holds"
        ),
        "{}",
        stderr(&out)
    );
}

/// `--image` builds a diffusers UNet for the VAE latent of that many pixels (÷ 8): SD v1.5's
/// default `sample_size` 64 is `--image 512`; other sizes change the latent and the activations,
/// never the parameters; sizes that are not multiples of 8 and models without an image size are
/// refused (exit 2).
#[test]
fn image_flag_sizes_the_unet_latent() {
    const SD15: &str = "examples/hf/stable-diffusion-v1-5-unet.json";
    let dflt = report(&[SD15]);
    let same = report(&[SD15, "--image", "512"]);
    assert_eq!(dflt["input_shape"], same["input_shape"]);
    assert_eq!(u(&dflt, "activations_bytes"), u(&same, "activations_bytes"));
    let tall = report(&[SD15, "--image", "768x512"]);
    assert_eq!(tall["input_shape"], serde_json::json!([1, 4, 96, 64]));
    assert_eq!(u(&tall, "param_count"), 859_520_964);
    assert!(u(&tall, "activations_bytes") > u(&dflt, "activations_bytes"));
    // 1000 pixels: a latent of 125, upsampled to the skip connections' 63 and 125.
    let odd = report(&[
        "examples/hf/stable-diffusion-xl-base-1.0-unet.json",
        "--image",
        "1000",
    ]);
    assert_eq!(odd["input_shape"], serde_json::json!([1, 4, 125, 125]));
    for (args, want) in [
        (
            &[SD15, "--image", "500"][..],
            "--image 500x500: height and width must be multiples of 8 pixels",
        ),
        (
            &["examples/hf/gpt2.json", "--image", "512"][..],
            "--image 512x512: model_type `gpt2` reads no image",
        ),
        (
            &["examples/mlp.toml", "--image", "512"][..],
            "--image applies only to Hugging Face configs",
        ),
        (&[SD15, "--image", "0x8"][..], "`0x8` is not an image size"),
    ] {
        let err = fails(args);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}
/// The DiT transformers: SD3 reads the latent `[16, H/8, W/8]` (its `sample_size` 128 by
/// default: 1024 pixels) and refuses one past its position table (`pos_embed_max_size` 192
/// patches: 3072 pixels); Flux reads `(H/16)·(W/16)` packed tokens of 64 channels (1024 × 1024
/// by default) and refuses sides that do not pack. Both default to the text length their
/// DreamBooth scripts feed (154 for SD3, 512 for Flux) and take the pooled projections and the
/// timestep embedding as inputs.
#[test]
fn image_flag_sizes_the_dit_latent() {
    const SD3: &str = "examples/hf/stable-diffusion-3-medium-transformer.json";
    const FLUX: &str = "examples/hf/flux.1-dev-transformer.json";
    let sd3 = report(&[SD3]);
    assert_eq!(sd3["input_shape"], serde_json::json!([1, 16, 128, 128]));
    assert_eq!(sd3["settings"]["seq"], 154);
    let wide = report(&[SD3, "--image", "512x768"]);
    assert_eq!(wide["input_shape"], serde_json::json!([1, 16, 64, 96]));
    // The 192² float32 position table is a buffer whatever the image: 192²·1536·4.
    assert_eq!(u(&wide, "buffers_bytes"), 226_492_416);
    assert!(u(&wide, "activations_bytes") < u(&sd3, "activations_bytes"));
    let flux = report(&[FLUX]);
    assert_eq!(flux["input_shape"], serde_json::json!([1, 4096, 64]));
    assert_eq!(flux["settings"]["seq"], 512);
    let small = report(&[FLUX, "--image", "512", "--seq", "256"]);
    assert_eq!(small["input_shape"], serde_json::json!([1, 1024, 64]));
    for (args, want) in [
        (
            &[SD3, "--image", "3088"][..],
            "a 193×193-patch latent exceeds `pos_embed_max_size` = 192",
        ),
        (
            &[FLUX, "--image", "520"][..],
            "a 65×65 latent cannot be packed into 2×2 patches",
        ),
    ] {
        let err = fails(args);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// DINOv2 reads any image size: transformers' `Dinov2Embeddings.interpolate_pos_encoding`
/// resizes the position table to the image's patch grid (measured at 42 × 42 and 35 × 49 in
/// `hf-reference*.json`). The tiny config reads 28 × 28 pixels in 7-pixel patches (a 4 × 4
/// grid): at 30 × 30 the grid is the same and square, so the table is used as it is and only
/// the pixels differ; at 14 × 56 (a 2 × 8 grid, the same 17 tokens) the table is
/// interpolated, which saves nothing for backward (`upsample_bicubic2d` reads only sizes, the
/// slices, casts and `torch.cat` none), so the saved activations stay those of the default.
/// ViT refuses another size (transformers raises unless `interpolate_pos_encoding=True`), and
/// a side below the patch is refused.
#[test]
fn dinov2_interpolates_its_position_table_to_any_image() {
    let dino = "tests/fixtures/hf/dinov2_tiny.json";
    let args =
        |image: &'static str| vec![dino, "--image", image, "--batch", "4", "--device", "cpu"];
    let plain = report(&[dino, "--batch", "4", "--device", "cpu"]);
    let same_grid = report(&args("30"));
    assert_eq!(same_grid["input_shape"], serde_json::json!([4, 3, 30, 30]));
    for key in ["activations_bytes", "param_count"] {
        assert_eq!(u(&same_grid, key), u(&plain, key), "{key}");
    }
    // Only the larger batch of pixels differs: 4·3·(30² − 28²) float32 = 5,568 B.
    assert_eq!(u(&same_grid, "peak_bytes"), u(&plain, "peak_bytes") + 5_568);
    let wide = report(&args("14x56"));
    assert_eq!(wide["input_shape"], serde_json::json!([4, 3, 14, 56]));
    assert_eq!(u(&wide, "param_count"), 111_040);
    assert_eq!(
        u(&wide, "activations_bytes"),
        u(&plain, "activations_bytes")
    );
    assert_eq!(u(&plain, "activations_bytes"), 648_992);
    // 42 × 42: a 6 × 6 grid, 37 tokens (measured: 1,412,512 B saved on the CPU).
    let big = report(&args("42"));
    assert_eq!(u(&big, "activations_bytes"), 1_412_512);
    // The full-size model (518 pixels, 37 × 37 patches) at 224: 16 × 16 patches.
    let base = report(&["examples/hf/dinov2-base.json", "--image", "224"]);
    assert_eq!(base["input_shape"], serde_json::json!([1, 3, 224, 224]));
    assert_eq!(u(&base, "param_count"), 86_580_480);
    for (args, want) in [
        (
            &[dino, "--image", "6x28"][..],
            "--image 6x28: a side is smaller than DINOv2's `patch_size` (7)",
        ),
        (
            &["tests/fixtures/hf/vit_tiny.json", "--image", "64"][..],
            "unless the forward is called with interpolate_pos_encoding=True",
        ),
    ] {
        let err = fails(args);
        assert!(err.contains(want), "{args:?}: {err}");
    }
    // The `parameter` key behind it takes a class row and a square grid only.
    let m = TempModel::new(
        "toml",
        "[input]\nshape = [18, 8]\n[[layers]]\nkind = \"parameter\"\nname = \"pos\"\nshape = [1, 18, 8]\nsize = [4, 4]\n",
    );
    let err = fails(&[m.arg()]);
    assert!(
        err.contains("interpolates a position table of shape [1, 1 + g·g, D] (a class row and a square grid), got `shape` [1, 18, 8]"),
        "{err}"
    );
}

/// `--image`: multimodal and vision configs read it; a fixed-size tower refuses another size,
/// a text-only config and a memest file refuse it (exit 2, naming the flag).
#[test]
fn image_flag_sets_or_checks_the_pixel_input() {
    let llava = "tests/fixtures/hf/llava_tiny.json";
    // The tiny LLaVA's tower reads 32×32 pixels: 16 patches, 16 image tokens of 64 positions.
    let same = report(&[llava, "--image", "32", "--seq", "64"]);
    let plain = report(&[llava, "--seq", "64"]);
    assert_eq!(u(&same, "peak_bytes"), u(&plain, "peak_bytes"));
    let err = fails(&[llava, "--image", "64x32", "--seq", "64"]);
    assert!(
        err.contains("--image 64x32") && err.contains("32x32 pixels"),
        "{err}"
    );
    let err = fails(&[
        "examples/hf/clip-vit-large-patch14-336-vision.json",
        "--image",
        "224",
    ]);
    assert!(err.contains("336x336 pixels"), "{err}");
    let ok = report(&[
        "examples/hf/clip-vit-large-patch14-336-vision.json",
        "--image",
        "336x336",
    ]);
    assert_eq!(u(&ok, "param_count"), 303_507_456);
    let err = fails(&["examples/hf/gpt2.json", "--image", "336"]);
    assert!(err.contains("reads no image"), "{err}");
    let err = fails(&["examples/mlp.toml", "--image", "336"]);
    assert!(err.contains("--image applies only"), "{err}");
    for bad in ["0", "33x", "x4", "big"] {
        let out = memest(&[llava, "--image", bad]);
        assert_eq!(code(&out), 2, "{bad}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("is not an image size"),
            "{bad}: {}",
            stderr(&out)
        );
    }
}

/// LLaVA: `--seq` counts the image's tokens with the text's; fewer positions than the image
/// has tokens is refused. The vision tower's last layer and `post_layernorm` run but feed no
/// loss (`hidden_states[-2]`): their parameters get no gradient.
#[test]
fn llava_counts_image_tokens_in_the_sequence() {
    let llava = "tests/fixtures/hf/llava_tiny.json";
    let err = fails(&[llava, "--seq", "15"]);
    assert!(
        err.contains("15 positions, fewer than the image's 16 tokens"),
        "{err}"
    );
    let v = report(&[llava, "--seq", "16"]);
    // 657_024 parameters; the last CLIP layer (2·64 + 4·(64·64 + 64) + 2·64 + 64·128 + 128 +
    // 128·64 + 64 = 33_472) and post_layernorm (128) have no gradient.
    assert_eq!(u(&v, "param_count"), 657_024);
    assert_eq!(u(&v, "trainable_param_count"), 657_024 - 33_472 - 128);
    assert_eq!(u(&v, "gradients_bytes"), (657_024 - 33_472 - 128) * 4);
}

/// Qwen2-VL: `--image` gives the image tokens, `(H / 14) · (W / 14) / 4` for the 7B config
/// (default 448 × 448: 256); sides that are not multiples of patch_size · spatial_merge_size
/// are refused with the nearest ones.
#[test]
fn qwen2_vl_image_tokens_follow_the_image_size() {
    let q = "examples/hf/qwen2-vl-7b-instruct.json";
    let err = fails(&[q, "--seq", "255"]);
    assert!(
        err.contains("255 positions, fewer than the image's 256 tokens"),
        "{err}"
    );
    // 336 × 672: 24 · 48 = 1152 patches, 288 tokens.
    let err = fails(&[q, "--image", "336x672", "--seq", "287"]);
    assert!(err.contains("fewer than the image's 288 tokens"), "{err}");
    let v = report(&[q, "--image", "336x672", "--seq", "288"]);
    assert_eq!(u(&v, "param_count"), 8_291_375_616);
    // pixel_values [1152, 3 · 2 · 14 · 14] in bfloat16, the ids and labels [288] in int64.
    assert_eq!(u(&v, "input_bytes"), 1152 * 1176 * 2 + 2 * 288 * 8);
    let err = fails(&[q, "--image", "500"]);
    assert!(
        err.contains("multiples of patch_size · spatial_merge_size = 28")
            && err.contains("476x476"),
        "{err}"
    );
}

/// Phi-3 joins each rotated tensor to its pass-through part right after rotating it
/// (`concat_each`, `apply_rotary_pos_emb` in `models/phi3/modeling_phi3.py`); GPT-NeoX rotates
/// both, then joins them (`concat`).
#[test]
fn phi3_and_gpt_neox_join_their_rotated_parts_in_their_own_order() {
    let rotary = |file: &str| {
        let t = printed(&[file]);
        layers(&t)
            .iter()
            .find(|l| l["kind"].as_str() == Some("rotary"))
            .cloned()
            .unwrap()
    };
    let phi3 = rotary("tests/fixtures/hf/phi3_tiny.json");
    assert_eq!(phi3["concat_each"].as_bool(), Some(true));
    assert_eq!(phi3.get("concat"), None);
    let neox = rotary("tests/fixtures/hf/gpt_neox_tiny.json");
    assert_eq!(neox["concat"].as_bool(), Some(true));
    assert_eq!(neox.get("concat_each"), None);
}

/// GPT-OSS: sliding windows of 128 on the even layers, attention sinks (eager by default),
/// half-width rotary tables, and on every layer the biased top-k-then-softmax router and the
/// experts with biases and the clamped SwiGLU.
#[test]
fn gpt_oss_sinks_alternating_windows_and_biased_experts() {
    let t = printed(&["examples/hf/gpt-oss-20b.json"]);
    assert_eq!(t["defaults"]["attention"].as_str(), Some("eager"));
    let l = layers(&t);
    let rotary = l
        .iter()
        .find(|l| l["kind"].as_str() == Some("rotary"))
        .unwrap();
    assert_eq!(rotary["half_tables"].as_bool(), Some(true));
    let blocks: Vec<&toml::Table> = l
        .iter()
        .filter(|l| l["kind"].as_str() == Some("repeat"))
        .collect();
    assert_eq!(blocks.len(), 24);
    for (i, b) in blocks.iter().enumerate() {
        let body = b["layers"].as_array().unwrap();
        let find = |kind: &str| {
            body.iter()
                .find(|l| l["kind"].as_str() == Some(kind))
                .unwrap()
        };
        let attn = find("attention");
        assert_eq!(attn["sinks"].as_bool(), Some(true));
        assert_eq!(attn.get("bias"), None, "biased Q/K/V/O");
        let window = attn.get("sliding_window").and_then(toml::Value::as_integer);
        assert_eq!(window, (i % 2 == 0).then_some(128), "layer {i}");
        let moe = find("moe");
        assert_eq!(moe["router"].as_str(), Some("gpt_oss"));
        assert_eq!(moe["experts"].as_integer(), Some(32));
        assert_eq!(moe["top_k"].as_integer(), Some(4));
        assert_eq!(moe["expert_bias"].as_bool(), Some(true));
        assert_eq!(moe["swiglu_limit"].as_float(), Some(7.0));
    }
    // The tiny fixture, by hand: embeddings and head 2·1000·256 = 512_000; per layer q, o
    // 2·(256·256 + 256) + k, v 2·(256·128 + 128) + sinks 4 = 197_380, two norms 512, router
    // 4·256 + 4, experts 4·(256·256 + 256) + 4·(128·256 + 256) = 396_292; 2 layers; final
    // norm 256 (transformers 5.24 counts the same, tests/data/hf-reference.json).
    let r = report(&["tests/fixtures/hf/gpt_oss_tiny.json", "--seq", "64"]);
    assert_eq!(u(&r, "param_count"), 1_700_624);
}

/// The sink column of GPT-OSS's eager attention, by hand: the softmax keeps `[B, heads, S,
/// S + 1]` instead of `[B, heads, S, S]` and `max.dim` its int64 `[B, heads, S, 1]` indices:
/// `B·heads·S·(4 + 8)` bytes more in float32 (B 2, 4 heads, S 16: 1_536), and `heads`
/// parameters more.
#[test]
fn attention_sinks_keep_one_more_column_and_the_max_indices() {
    let model = |sinks: bool| {
        TempModel::new(
            "toml",
            &format!(
                "[input]\nshape = [\"seq\", 32]\n\n[[layers]]\nkind = \"attention\"\nheads = 4\ncausal = true\nkv_cache = false\nsinks = {sinks}\n"
            ),
        )
    };
    let (with, without) = (model(true), model(false));
    let args = ["--batch", "2", "--seq", "16", "--attention", "eager"];
    let run = |m: &TempModel| {
        let mut a = vec![m.arg()];
        a.extend(args);
        report(&a)
    };
    let (a, b) = (run(&with), run(&without));
    assert_eq!(
        u(&a, "activations_bytes") - u(&b, "activations_bytes"),
        2 * 4 * 16 * (4 + 8)
    );
    assert_eq!(u(&a, "param_count") - u(&b, "param_count"), 4);
}

/// Whisper: the log-mel `input_features` are a named input fixed by the config
/// (`[num_mel_bins, 2·max_source_positions]`), `--seq` is the decoder's (the labels'),
/// at most `max_target_positions`; the encoder's sinusoidal `embed_positions` is frozen.
#[test]
fn whisper_reads_fixed_mel_features_and_seq_labels() {
    let small = "examples/hf/whisper-small.json";
    let t = printed(&[small]);
    let features = &t["inputs"]["input_features"]["shape"];
    assert_eq!(
        features.as_array().map(|a| a
            .iter()
            .map(|v| v.as_integer().unwrap_or(0))
            .collect::<Vec<_>>()),
        Some(vec![80, 3000]),
        "{t:?}"
    );
    let v = report(&[small, "--seq", "448", "--batch", "1"]);
    // 1500·768 position rows get no gradient and no AdamW state.
    assert_eq!(u(&v, "param_count"), 241_734_912);
    assert_eq!(u(&v, "trainable_param_count"), 241_734_912 - 1_152_000);
    let err = fails(&[small, "--seq", "449"]);
    assert!(err.contains("449"), "{err}");
    let err = fails(&[small, "--image", "224"]);
    assert!(err.contains("reads no image"), "{err}");
    let err = fails(&[small, "--head", "classification"]);
    assert!(err.contains("WhisperForAudioClassification"), "{err}");
    // K has no bias; Q is scaled and Q, K, V copied per head, as WhisperAttention does.
    let a = attention(small);
    assert_eq!(a["k_bias"].as_bool(), Some(false));
    assert_eq!(a["scale_query"].as_bool(), Some(true));
    assert_eq!(a["contiguous_heads"].as_bool(), Some(true));
    // The bare WhisperModel reads its decoder ids as given: no shift, no head, no loss.
    let bare = printed(&[small, "--head", "none"]);
    let names: Vec<String> = layers(&bare)
        .iter()
        .filter_map(|l| l["name"].as_str().map(str::to_string))
        .collect();
    assert!(
        names
            .iter()
            .all(|n| n != "shift_tokens_right" && n != "proj_out" && n != "loss")
    );
    assert!(names.iter().any(|n| n == "encoder.conv1"), "{names:?}");
}
