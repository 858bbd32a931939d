//! Issue 4's LLM features: the inference KV cache, context and batch search, LoRA and QLoRA,
//! quantized weights. Figures are computed by hand in the comments.

use crate::common::{code, memest, report, stderr, u};

const GIB: u64 = 1 << 30;

/// Llama-3-8B: 32 layers, 8 KV heads of 128: K and V per token per layer = 2·8·128·2 B = 4 KiB,
/// × 32 layers = 128 KiB per token; × 8192 tokens = 1 GiB per sequence.
#[test]
fn llama3_kv_cache_is_128_kib_per_token() {
    let r = report(&[
        "examples/hf/llama-3-8b.json",
        "--context",
        "8192",
        "--dtype",
        "bfloat16",
        "--batch",
        "1",
    ]);
    assert_eq!(u(&r, "kv_cache_bytes"), GIB);
    assert_eq!(r["settings"]["mode"], "infer");
    let r = report(&[
        "examples/hf/llama-3-8b.json",
        "--context",
        "1",
        "--dtype",
        "bfloat16",
        "--batch",
        "1",
    ]);
    assert_eq!(u(&r, "kv_cache_bytes"), 128 * 1024);
    // Two sequences, twice the cache.
    let r = report(&[
        "examples/hf/llama-3-8b.json",
        "--context",
        "8192",
        "--dtype",
        "bfloat16",
        "--batch",
        "2",
    ]);
    assert_eq!(u(&r, "kv_cache_bytes"), 2 * GIB);
}

/// Grouped-query attention is never charged for full-width K/V: Llama-2-7B (32 KV heads) caches
/// 4× what Llama-3-8B (8 KV heads, same layers and head_dim) does.
#[test]
fn gqa_caches_only_kv_heads() {
    let l2 = report(&[
        "examples/hf/llama-2-7b.json",
        "--context",
        "4096",
        "--dtype",
        "bfloat16",
    ]);
    let l3 = report(&[
        "examples/hf/llama-3-8b.json",
        "--context",
        "4096",
        "--dtype",
        "bfloat16",
    ]);
    // Llama-2-7B: 2·32 layers·32 heads·128·4096·2 B = 2 GiB.
    assert_eq!(u(&l2, "kv_cache_bytes"), 2 * GIB);
    assert_eq!(u(&l3, "kv_cache_bytes"), GIB / 2);
}

/// Mistral-7B's sliding window (4096) caps the cache: at 8192 tokens it holds 4096.
#[test]
fn sliding_window_caps_the_cache() {
    // 2·32 layers·8 KV heads·128·4096·2 B = 512 MiB.
    let r = report(&[
        "examples/hf/mistral-7b-v0.1.json",
        "--context",
        "8192",
        "--dtype",
        "bfloat16",
    ]);
    assert_eq!(u(&r, "kv_cache_bytes"), GIB / 2);
    let r = report(&[
        "examples/hf/mistral-7b-v0.1.json",
        "--context",
        "2048",
        "--dtype",
        "bfloat16",
    ]);
    assert_eq!(u(&r, "kv_cache_bytes"), GIB / 4);
}

/// `--kv-dtype fp8` stores one byte per element: half of bfloat16.
#[test]
fn kv_dtype_sets_the_cache_element_size() {
    let r = report(&[
        "examples/hf/llama-3-8b.json",
        "--context",
        "8192",
        "--dtype",
        "bfloat16",
        "--kv-dtype",
        "fp8",
    ]);
    assert_eq!(u(&r, "kv_cache_bytes"), GIB / 2);
}

/// `--max-context` finds the longest context whose estimate fits, and one more token does not.
#[test]
fn max_context_is_the_largest_that_fits() {
    let base = [
        "examples/hf/llama-3-8b.json",
        "--dtype",
        "bfloat16",
        "--mode",
        "infer",
        "--budget",
        "24GiB",
        "--allow-long-context",
    ];
    let r = report(&[&base[..], &["--max-context"]].concat());
    let n = u(&r, "max_context");
    assert!(n > 1000, "{n}");
    assert_eq!(u(&r["settings"], "seq"), n);
    assert!(u(&r, "total_bytes") <= 24 * GIB);
    let next = (n + 1).to_string();
    let over = memest(&[&base[..], &["--seq", &next, "--format", "json"]].concat());
    assert_eq!(code(&over), 1, "{} tokens should not fit", n + 1);
}

/// `--max-batch` likewise, for the micro-batch.
#[test]
fn max_batch_is_the_largest_that_fits() {
    let base = [
        "examples/mlp.toml",
        "--optim",
        "adam",
        "--budget",
        "100MB",
        "--budget-on",
        "allocated",
    ];
    let r = report(&[&base[..], &["--max-batch"]].concat());
    let n = u(&r, "max_batch");
    assert!(n > 1, "{n}");
    assert_eq!(u(&r["settings"], "batch"), n);
    assert!(u(&r, "total_bytes") <= 100_000_000);
    let next = (n + 1).to_string();
    assert_eq!(code(&memest(&[&base[..], &["--batch", &next]].concat())), 1);
}

/// `--max-batch` against the device figure (the default on a GPU: the caching allocator's
/// reserve and the CUDA context, 3,477,078,016 B more per sequence for Llama-2-7B in inference
/// at 4,096 tokens, where the tensor peak grows by 2,485,157,888 B): the search's lines follow
/// the figure checked, so it takes four estimates (1, 2, the crossing, one past it). Batch 18
/// is 76,549,193,728 B, 19 is 80,026,271,744 B, over 80 GB (with the rotary's blocks made and
/// freed one operator at a time, as PyTorch does, the reserve is 864 MiB below the single
/// step's, which held its four at once: 77,455,163,392 and 80,982,573,056 B before). Along the tensor peak (whose line
/// first crosses 80 GB at batch 26) the search took twelve.
#[test]
fn max_batch_lines_follow_the_figure_checked() {
    let src = std::fs::read_to_string(crate::common::path("examples/hf/llama-2-7b.json")).unwrap();
    let spec = memest::load_spec(&src, memest::spec::Format::Json, memest::hf::Head::Auto).unwrap();
    let calls = std::cell::Cell::new(0u32);
    let at = |batch: u64| memest::settings::Overrides {
        batch: Some(batch),
        seq: Some(4096),
        mode: Some(memest::settings::Mode::Infer),
        ..memest::settings::Overrides::default()
    };
    let (v, r) = memest::search::largest_fitting(
        |b| {
            calls.set(calls.get() + 1);
            memest::estimate_spec(&spec, "llama-2-7b", &at(b), Some(80_000_000_000)).ok()
        },
        1,
    )
    .unwrap();
    assert_eq!(v, 18);
    assert_eq!(r.budget.unwrap().checked_bytes, 76_549_193_728);
    let over = memest::estimate_spec(&spec, "llama-2-7b", &at(19), Some(80_000_000_000)).unwrap();
    assert_eq!(over.budget.unwrap().checked_bytes, 80_026_271_744);
    assert_eq!(calls.get(), 4);
}

/// When even 1 does not fit, the search reports that and exits 1.
#[test]
fn max_batch_reports_when_nothing_fits() {
    let out = memest(&["examples/mlp.toml", "--budget", "1MB", "--max-batch"]);
    assert_eq!(code(&out), 1);
    assert!(
        crate::common::stdout(&out).contains("largest batch that fits"),
        "{}",
        crate::common::stdout(&out)
    );
    assert!(stderr(&out).contains("over budget"), "{}", stderr(&out));
}

/// LoRA rank 16 on Llama-2-7B's q, k, v, o, gate, up, down: per layer
/// 16·((4096+4096)·4 + (4096+11008)·3) = 1,249,280 adapter parameters, × 32 layers = 39,976,960;
/// the 6,738,415,616 base parameters are frozen.
#[test]
fn lora_adapters_train_and_the_base_is_frozen() {
    let r = report(&[
        "examples/hf/llama-2-7b.json",
        "--lora-rank",
        "16",
        "--seq",
        "256",
    ]);
    assert_eq!(u(&r, "trainable_param_count"), 39_976_960);
    assert_eq!(u(&r, "param_count"), 6_738_415_616 + 39_976_960);
    // PEFT keeps the adapters in float32: gradients 4 B and AdamW moments 8 B per adapter
    // parameter, plus a 4-byte step for each of the 7·2·32 = 448 adapter tensors.
    assert_eq!(u(&r, "gradients_bytes"), 4 * 39_976_960);
    assert_eq!(u(&r, "optimizer_state_bytes"), 8 * 39_976_960 + 4 * 448);
    // Only attention targets: 16·(4096+4096)·4·32 = 16,777,216.
    let r = report(&[
        "examples/hf/llama-2-7b.json",
        "--lora-rank",
        "16",
        "--lora-targets",
        "q,k,v,o",
        "--seq",
        "256",
    ]);
    assert_eq!(u(&r, "trainable_param_count"), 16_777_216);
}

/// PEFT's spelling of the same seven targets (the list in most QLoRA recipes) trains the same
/// 39,976,960 parameters; spaces after commas are trimmed (`q, v`: 16·8192·2·32 = 8,388,608).
#[test]
fn lora_targets_in_peft_spelling_and_with_spaces() {
    let r = report(&[
        "examples/hf/llama-2-7b.json",
        "--lora-rank",
        "16",
        "--lora-targets",
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        "--seq",
        "256",
    ]);
    assert_eq!(u(&r, "trainable_param_count"), 39_976_960);
    let r = report(&[
        "examples/hf/llama-2-7b.json",
        "--lora-rank",
        "16",
        "--lora-targets",
        "q, v",
        "--seq",
        "256",
    ]);
    assert_eq!(u(&r, "trainable_param_count"), 8_388_608);
}

/// The default targets need only match something: GPT-2 (fused c_attn, c_proj; no gate/up/down)
/// trains q, k, v and o: 16·(768+2304) + 16·(768+768) = 73,728 per layer × 12 = 884,736. On
/// Mixtral `gate` is the router (as the default has always read it) and PEFT's `gate_proj`,
/// given explicitly, is not: an error naming it, as PEFT matches it to no module there.
#[test]
fn lora_default_targets_on_models_without_an_mlp_projection() {
    let r = report(&["examples/hf/gpt2.json", "--lora-rank", "16"]);
    assert_eq!(u(&r, "trainable_param_count"), 884_736);
    let out = memest(&[
        "examples/hf/mixtral-8x7b.json",
        "--lora-rank",
        "16",
        "--lora-targets",
        "q_proj,gate_proj",
    ]);
    assert_eq!(code(&out), 2);
    assert!(
        stderr(&out).contains("--lora-targets `gate_proj` matched no projection"),
        "{}",
        stderr(&out)
    );
}

/// A LoRA target that matches nothing is refused (exit 2), naming it and the model's names,
/// even when the other entries match.
#[test]
fn lora_target_matching_nothing_is_an_error() {
    let out = memest(&[
        "examples/hf/llama-2-7b.json",
        "--lora-rank",
        "16",
        "--lora-targets",
        "q,foo",
    ]);
    assert_eq!(code(&out), 2);
    assert_eq!(
        stderr(&out),
        "error: examples/hf/llama-2-7b.json: --lora-targets `foo` matched no projection; the names \
         in this model are q, k, v, o, gate_proj, up_proj, down_proj, lm_head (a trailing _proj is \
         optional: q_proj is q)\n"
    );
}

/// NF4 with double quantization (bitsandbytes, blocksize 64): 4 bits per weight, an int8 absmax
/// per 64 weights and a float32 scale per 256 absmax blocks. A [512, 1000] linear:
/// 512,000/2 = 256,000 + 8,000 absmax + 4·32 (ceil(8000/256) = 32) = 264,128 bytes.
#[test]
fn nf4_weights_carry_their_scales() {
    let src = "[input]\nshape = [1000]\n[[layers]]\nkind = \"linear\"\nname = \"proj\"\nout_features = 512\nbias = false\n";
    let m = crate::common::TempModel::new("toml", src);
    let r = report(&[m.arg(), "--dtype", "nf4"]);
    assert_eq!(u(&r, "parameters_bytes"), 264_128);
    assert_eq!(u(&r["parameters_by_dtype"], "nf4"), 264_128);
    // Quantized weights are frozen.
    assert_eq!(u(&r, "trainable_param_count"), 0);
    // int8 (LLM.int8()): 512,000 + a float32 scale per output row (512·4) = 514,048.
    let r = report(&[m.arg(), "--dtype", "int8"]);
    assert_eq!(u(&r, "parameters_bytes"), 514_048);
    // int4 (GPTQ, groups of 128): 256,000 + 512·8 groups·(2 B scale) + 4096/2 B zeros = 266,240.
    let r = report(&[m.arg(), "--dtype", "int4"]);
    assert_eq!(u(&r, "parameters_bytes"), 266_240);
    // Groups of 64: 256,000 + 512·16·2 + 8192/2 = 276,480.
    let r = report(&[m.arg(), "--dtype", "int4", "--group-size", "64"]);
    assert_eq!(u(&r, "parameters_bytes"), 276_480);
    // NF4 without double quantization: 256,000 + 8,000 float32 absmax = 288,000.
    let r = report(&[m.arg(), "--dtype", "nf4", "--double-quant", "false"]);
    assert_eq!(u(&r, "parameters_bytes"), 288_000);
}

/// Quantized MoE experts are a batch of `[out, in]` matrices, each with its own scales
/// (`examples/hf/mixtral-8x7b.json`, `--mode infer`: 32 layers of 8 experts with w1, w3
/// `[14336, 4096]` and w2 `[4096, 14336]`, attention q, o `[4096, 4096]` and k, v `[1024, 4096]`,
/// a router `[8, 4096]`; embeddings, norms and head stay bfloat16). Metadata = bytes − n/2 (int4)
/// or − n (int8), with n = 46,440,382,464 quantized weights.
///
/// int4 (groups of 128 input weights; a float16 scale and a 4-bit zero point = 2.5 B a group):
/// - one expert's w1, w3: 14,336 rows · 32 groups = 458,752 groups; w2: 4,096 · 112 = 458,752;
///   × 3 × 8 experts × 2.5 B = 27,525,120 per layer;
/// - attention: (4,096 + 1,024 + 1,024 + 4,096) rows · 32 groups · 2.5 B = 819,200 per layer;
/// - router: 8 · 32 · 2.5 = 640 per layer;
/// - × 32 layers: 907,038,720 (sized as one `[8, 14336]` matrix per weight, it was 26,398,720).
///
/// int8 (a float32 scale per output row): (14,336 · 2 + 4,096) · 8 · 4 = 1,048,576 per layer for
/// the experts, 40,960 for attention, 32 for the router; × 32 = 34,866,176 (was 1,313,792).
#[test]
fn quantized_experts_are_sized_per_expert() {
    const N: u64 = 46_440_382_464;
    for (dtype, meta, packed) in [("int4", 907_038_720, N / 2), ("int8", 34_866_176, N)] {
        let r = report(&[
            "examples/hf/mixtral-8x7b.json",
            "--mode",
            "infer",
            "--dtype",
            dtype,
        ]);
        assert_eq!(u(&r["param_count_by_dtype"], dtype), N, "{dtype}");
        assert_eq!(
            u(&r["parameters_by_dtype"], dtype),
            packed + meta,
            "{dtype}"
        );
    }
}

/// The QLoRA command runs and splits the parameters by dtype: the quantized projections
/// in nf4, embeddings, norms and head in bfloat16, the adapters in float32.
#[test]
fn qlora_command_runs() {
    let r = report(&[
        "examples/hf/llama-2-7b.json",
        "--lora-rank",
        "16",
        "--dtype",
        "nf4",
        "--optim",
        "adamw",
        "--batch",
        "1",
        "--seq",
        "2048",
    ]);
    let by = &r["parameters_by_dtype"];
    assert!(u(by, "nf4") > 3 * GIB, "{by}");
    // Embedding and head: 2·32000·4096 = 262,144,000, norms 65·4096 = 266,240, in bfloat16.
    assert_eq!(
        u(&r["param_count_by_dtype"], "bfloat16"),
        262_144_000 + 266_240
    );
    assert_eq!(u(&r["param_count_by_dtype"], "float32"), 39_976_960);
    assert!(u(&r, "total_bytes") < 40 * GIB);
}

/// One meaning for the inference activation figures: `peak_activations_bytes` is the largest
/// kept-plus-transient total of the forward pass and never holds the KV cache. Llama-3-8B, 512
/// tokens, bfloat16: at the peak (the `lm_head`) the logits `[1, 512, 128256]` bf16
/// (131,334,144 B) are kept and one `[1, 512, 4096]` bf16 hidden state (4 MiB) is transient:
/// 135,528,448 B; the rotary `cos`/`sin` (2 × 131,072 B) died when the base model's forward
/// returned; the cache (64 MiB: 128 KiB × 512) is apart.
#[test]
fn inference_activation_figures_leave_the_kv_cache_out() {
    let args = ["examples/hf/llama-3-8b.json", "--context", "512"];
    let r = report(&args);
    assert_eq!(u(&r, "kv_cache_bytes"), 64 << 20);
    assert_eq!(u(&r, "activations_bytes"), 0);
    assert_eq!(u(&r["at_peak"], "activations_bytes"), 131_334_144);
    assert_eq!(u(&r["at_peak"], "temporaries_bytes"), 4 << 20);
    assert_eq!(u(&r, "peak_activations_bytes"), 131_334_144 + (4 << 20));
    let out = memest(&args);
    assert_eq!(code(&out), 0);
    assert!(
        crate::common::stdout(&out).contains(
            "live activations at most: 129.2 MiB (activations + temporaries in forward; KV cache apart: 64.00 MiB)"
        ),
        "{}",
        crate::common::stdout(&out)
    );
}

/// Llama-3-8B was trained for 8,192 positions (`max_position_embeddings`): `--max-context` on
/// 24 GiB (of allocated bytes) stops there with a warning that 24,521 tokens would fit; `--allow-long-context`
/// searches past it. A `--seq` past the limit warns; learned position tables refuse it.
#[test]
fn context_past_max_position_embeddings() {
    let args = [
        "examples/hf/llama-3-8b.json",
        "--mode",
        "infer",
        "--budget-on",
        "allocated",
        "--budget",
        "24GiB",
        "--max-context",
        "--format",
        "json",
    ];
    let out = memest(&args);
    assert_eq!(code(&out), 0);
    assert_eq!(
        stderr(&out),
        "warning: --max-context stopped at the 8192 positions examples/hf/llama-3-8b.json was \
         trained for (max_position_embeddings); 24521 tokens would fit the budget \
         (--allow-long-context searches past the limit)\n"
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(u(&r, "max_context"), 8192);
    assert_eq!(
        r["warnings"],
        serde_json::json!([{"context_capped_at_max_positions": {"max_positions": 8192, "fits": 24_521}}])
    );
    let r = report(&[&args[..8], &["--allow-long-context"]].concat());
    assert_eq!(u(&r, "max_context"), 24_521);
    assert!(r.get("warnings").is_none());

    let out = memest(&["examples/hf/llama-3-8b.json", "--seq", "10000"]);
    assert_eq!(code(&out), 0);
    assert_eq!(
        stderr(&out),
        "warning: sequence length 10000 is past the 8192 positions examples/hf/llama-3-8b.json \
         was trained for (max_position_embeddings); --allow-long-context silences this\n"
    );
    // GPT-2's learned position table has 1,024 rows: --max-context says it stopped there, not
    // at the budget, and 1,025 is an error.
    let out = memest(&[
        "examples/gpt2.toml",
        "--mode",
        "infer",
        "--budget",
        "80GiB",
        "--max-context",
    ]);
    assert_eq!(code(&out), 0);
    assert_eq!(
        stderr(&out),
        "warning: --max-context stopped at the 1024 rows of examples/gpt2.toml's learned position \
         table (position_embedding num_positions): no longer sequence can run\n"
    );
    let out = memest(&["examples/hf/gpt2.json", "--seq", "1025"]);
    assert_eq!(code(&out), 2);
    assert!(stderr(&out).contains("sequence length 1025 exceeds num_positions = 1024"));
}
