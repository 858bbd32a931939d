//! Snapshots of the binary's whole output: exit status, stdout and stderr of each case, one file
//! per case under `tests/it/snapshots/` (insta).
//!
//! These pin today's behaviour byte for byte: the table and `--format json` of every bundled
//! example, the README's flag combinations, `--print-model`, `--help`, and every error message.
//! A change that alters any of them shows as a snapshot diff. When a change is intended, review
//! and accept it with `INSTA_UPDATE=always cargo test --test it snapshots` (or `cargo insta
//! review`), and say why in the commit message. Under `CI=true` insta never writes: a mismatch
//! fails.
//!
//! Every path handed to the binary is relative to the crate root, so the output does not depend
//! on where the repository is checked out; temporary files are written under a fixed name in a
//! temporary folder, which is replaced by `[TMP]` before comparing.

use std::process::Output;

use crate::common::{code, memest, memest_stdin, stderr, stdout};

/// Exit status, stdout and stderr of one run, as the snapshot text.
fn transcript(out: &Output) -> String {
    format!(
        "exit: {}\n--- stdout ---\n{}--- stderr ---\n{}",
        code(out),
        stdout(out),
        stderr(out)
    )
}

/// Compares `text` with the snapshot `name`; `command` is recorded in the snapshot's header.
fn compare(name: &str, command: &str, text: &str) {
    let mut settings = insta::Settings::clone_current();
    settings.set_prepend_module_to_snapshot(false);
    settings.set_omit_expression(true);
    settings.set_description(command);
    settings.bind(|| insta::assert_snapshot!(name, text));
}

/// Runs `memest ARGS` from the crate root and compares the whole transcript with snapshot `name`.
fn check(name: &str, args: &[&str]) {
    let out = memest(args);
    let shown = format!("memest {}", args.join(" "));
    compare(name, shown.trim_end(), &transcript(&out));
}

/// Like [`check`], with `stdin` as standard input.
fn check_stdin(name: &str, args: &[&str], stdin: &str) {
    let out = memest_stdin(args, stdin);
    compare(
        name,
        &format!("memest {} < {stdin:?}", args.join(" ")),
        &transcript(&out),
    );
}

/// Writes `contents` to `model.EXT` in a new temporary folder, runs `memest <file> ARGS` and
/// compares the transcript, with the folder's path shown as `[TMP]`.
fn check_temp(name: &str, ext: &str, contents: &[u8], args: &[&str]) {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let file = dir.path().join(format!("model.{ext}"));
    std::fs::write(&file, contents).expect("writing a temporary model file");
    let file = file.to_str().expect("temporary paths are UTF-8");
    let mut all = vec![file];
    all.extend_from_slice(args);
    let out = memest(&all);
    let dir = dir.path().to_str().expect("temporary paths are UTF-8");
    let text = transcript(&out).replace(dir, "[TMP]");
    let shown = format!("memest [TMP]/model.{ext} {}", args.join(" "));
    compare(name, shown.trim_end(), &text);
}

/// One test per bundled example: its table and its `--format json`, with default flags.
macro_rules! examples {
    ($($name:ident => $file:literal,)*) => {
        $(
            #[test]
            fn $name() {
                super::check(concat!("example_", stringify!($name), "_table"), &[$file]);
                super::check(
                    concat!("example_", stringify!($name), "_json"),
                    &[$file, "--format", "json"],
                );
            }
        )*
    };
}

/// One test per case: `name => [args…]`; the snapshot is named after the test.
macro_rules! cases {
    ($prefix:literal; $($name:ident => [$($arg:expr),* $(,)?],)*) => {
        $(
            #[test]
            fn $name() {
                super::check(concat!($prefix, stringify!($name)), &[$($arg),*]);
            }
        )*
    };
}

mod example {
    examples! {
        alexnet => "examples/alexnet.toml",
        bert_base => "examples/bert_base.toml",
        convnext_tiny => "examples/convnext_tiny.toml",
        densenet121 => "examples/densenet121.toml",
        efficientnet_b0 => "examples/efficientnet_b0.toml",
        gpt2 => "examples/gpt2.toml",
        llama_tiny => "examples/llama_tiny.toml",
        lstm_classifier => "examples/lstm_classifier.toml",
        mlp => "examples/mlp.toml",
        mnasnet0_5 => "examples/mnasnet0_5.toml",
        mobilenet_v2 => "examples/mobilenet_v2.toml",
        mobilenet_v3_large => "examples/mobilenet_v3_large.toml",
        mobilenet_v3_small => "examples/mobilenet_v3_small.toml",
        regnet_y_400mf => "examples/regnet_y_400mf.toml",
        resnet101 => "examples/resnet101.toml",
        resnet18 => "examples/resnet18.toml",
        resnet34 => "examples/resnet34.toml",
        resnet50 => "examples/resnet50.toml",
        resnext50_32x4d => "examples/resnext50_32x4d.toml",
        shufflenet_v2_x1_0 => "examples/shufflenet_v2_x1_0.toml",
        squeezenet1_1 => "examples/squeezenet1_1.toml",
        unet2d => "examples/unet2d.toml",
        vgg11_bn => "examples/vgg11_bn.toml",
        vgg16 => "examples/vgg16.toml",
        vit_b_16 => "examples/vit_b_16.toml",
        wide_resnet50_2 => "examples/wide_resnet50_2.toml",
        hf_bert_base_uncased => "examples/hf/bert-base-uncased.json",
        hf_bert_base_cls => "examples/hf/bert_base_cls.json",
        hf_gemma_7b => "examples/hf/gemma-7b.json",
        hf_gpt2 => "examples/hf/gpt2.json",
        hf_llama_2_7b => "examples/hf/llama-2-7b.json",
        hf_llama_3_8b => "examples/hf/llama-3-8b.json",
        hf_llama_3_1_405b => "examples/hf/llama-3.1-405b.json",
        hf_llama_tiny => "examples/hf/llama_tiny.json",
        hf_mistral_7b_v0_1 => "examples/hf/mistral-7b-v0.1.json",
        hf_mixtral_8x7b => "examples/hf/mixtral-8x7b.json",
        hf_olmo_2_1124_7b => "examples/hf/olmo-2-1124-7b.json",
        hf_phi_3_mini => "examples/hf/phi-3-mini.json",
        hf_qwen1_5_moe_a2_7b => "examples/hf/qwen1.5-moe-a2.7b.json",
        hf_qwen2_7b => "examples/hf/qwen2-7b.json",
        hf_qwen3_8b => "examples/hf/qwen3-8b.json",
        hf_t5_small => "examples/hf/t5-small.json",
        hf_bloom_560m => "examples/hf/bloom-560m.json",
        hf_falcon_7b => "examples/hf/falcon-7b.json",
        hf_phi_2 => "examples/hf/phi-2.json",
        hf_pythia_1_4b => "examples/hf/pythia-1.4b.json",
        hf_roberta_base => "examples/hf/roberta-base.json",
        hf_xlm_roberta_base => "examples/hf/xlm-roberta-base.json",
        hf_deberta_v3_base => "examples/hf/deberta-v3-base.json",
        hf_deberta_v3_large => "examples/hf/deberta-v3-large.json",
        hf_deberta_v2_xlarge => "examples/hf/deberta-v2-xlarge.json",
        hf_starcoder => "examples/hf/starcoder.json",
        hf_mt5_small => "examples/hf/mt5-small.json",
        hf_qwen3_30b_a3b => "examples/hf/qwen3-30b-a3b.json",
        hf_stablelm_2_1_6b => "examples/hf/stablelm-2-1_6b.json",
        hf_starcoder2_3b => "examples/hf/starcoder2-3b.json",
        hf_granite_3_0_2b_base => "examples/hf/granite-3.0-2b-base.json",
        hf_olmo_1b_hf => "examples/hf/olmo-1b-hf.json",
        hf_gemma_2_2b => "examples/hf/gemma-2-2b.json",
        hf_vit_base_patch16_224 => "examples/hf/vit-base-patch16-224.json",
        hf_dinov2_base => "examples/hf/dinov2-base.json",
        hf_dinov2_giant => "examples/hf/dinov2-giant.json",
        hf_clip_vit_large_patch14_336_vision => "examples/hf/clip-vit-large-patch14-336-vision.json",
        hf_clip_vit_base_patch32_text => "examples/hf/clip-vit-base-patch32-text.json",
        hf_siglip_base_patch16_224_vision_nohead => "examples/hf/siglip-base-patch16-224-vision-nohead.json",
        hf_siglip_base_patch16_224_text => "examples/hf/siglip-base-patch16-224-text.json",
        hf_gemma_3_1b_pt => "examples/hf/gemma-3-1b-pt.json",
        hf_deepseek_v3 => "examples/hf/deepseek-v3.json",
        hf_gpt_oss_20b => "examples/hf/gpt-oss-20b.json",
        hf_gpt_oss_120b => "examples/hf/gpt-oss-120b.json",
        hf_c4ai_command_r_v01 => "examples/hf/c4ai-command-r-v01.json",
        hf_stable_diffusion_v1_5_unet => "examples/hf/stable-diffusion-v1-5-unet.json",
        hf_stable_diffusion_xl_base_1_0_unet => "examples/hf/stable-diffusion-xl-base-1.0-unet.json",
        hf_stable_diffusion_3_medium_transformer => "examples/hf/stable-diffusion-3-medium-transformer.json",
        hf_flux_1_dev_transformer => "examples/hf/flux.1-dev-transformer.json",
        hf_llava_1_5_7b_hf => "examples/hf/llava-1.5-7b-hf.json",
        hf_qwen2_vl_7b_instruct => "examples/hf/qwen2-vl-7b-instruct.json",
        hf_qwen2_5_vl_7b_instruct => "examples/hf/qwen2.5-vl-7b-instruct.json",
        hf_whisper_small => "examples/hf/whisper-small.json",
        hf_whisper_large_v3 => "examples/hf/whisper-large-v3.json",
    }
}

/// The README's flag combinations and the other flags, on the examples.
mod flags {
    const MLP: &str = "examples/mlp.toml";
    const GPT2: &str = "examples/gpt2.toml";
    const RESNET50: &str = "examples/resnet50.toml";
    const LLAMA3: &str = "examples/hf/llama-3-8b.json";

    cases! { "flags_";
        resnet50_batch32_adam => [RESNET50, "--batch", "32", "--optim", "adam"],
        resnet50_batch32_adam_json => [RESNET50, "--batch", "32", "--optim", "adam", "--format", "json"],
        mlp_per_layer => [MLP, "--per-layer"],
        mlp_explain => [MLP, "--explain"],
        mlp_markdown_budget => [MLP, "--format", "markdown", "--budget", "80MiB"],
        mlp_csv => [MLP, "--format", "csv"],
        gpt2_sweep_batch_budget => [GPT2, "--sweep", "batch=1..8", "--budget", "4GiB"],
        gpt2_sweep_seq_markdown => [GPT2, "--sweep", "seq=64..256:64", "--format", "markdown"],
        mlp_sweep_csv => [MLP, "--sweep", "batch=1,2,4", "--format", "csv"],
        mlp_sweep_bad => [MLP, "--sweep", "batch=8..1"],
        gpt2_explain => [GPT2, "--batch", "4", "--explain"],
        // the file's aliases work on the command line too
        mlp_optim_adam8bit_alias => [MLP, "--optim", "adam8bit"],
        gpt2_attention_sdpa_alias => [GPT2, "--attention", "SDPA", "--mode", "eval"],
        mlp_optim_impl_for_loop => [MLP, "--optim", "adamw", "--optim-impl", "for-loop"],
        gpt2_per_layer => [GPT2, "--per-layer"],
        resnet50_per_layer => [RESNET50, "--per-layer"],
        hf_llama_tiny_per_layer => ["examples/hf/llama_tiny.json", "--per-layer"],
        mlp_si => [MLP, "--si"],
        vgg16_si => ["examples/vgg16.toml", "--si"],
        mlp_batch7_json => [MLP, "--batch", "7", "--format", "json"],
        mlp_optim_sgd_momentum_json => [MLP, "--optim", "sgd-momentum", "--format", "json"],
        mlp_dtype_bfloat16_json => [MLP, "--dtype", "bfloat16", "--format", "json"],
        mlp_infer => [MLP, "--mode", "infer"],
        gpt2_infer_json => [GPT2, "--mode", "infer", "--format", "json"],
        resnet50_infer_json => [RESNET50, "--mode", "infer", "--format", "json"],
        hf_mixtral_infer_batch8 => ["examples/hf/mixtral-8x7b.json", "--mode", "infer", "--batch", "8"],
        resnet50_amp_bf16_json => [RESNET50, "--amp", "bf16", "--format", "json"],
        gpt2_amp_fp16 => [GPT2, "--amp", "fp16"],
        gpt2_checkpoint_json => [GPT2, "--checkpoint", "--format", "json"],
        gpt2_seq128_json => [GPT2, "--seq", "128", "--format", "json"],
        gpt2_attention_eager_json => [GPT2, "--attention", "eager", "--format", "json"],
        gpt2_attention_flash_json => [GPT2, "--attention", "flash", "--format", "json"],
        gpt2_recipe_mixed_bf16_json => [GPT2, "--recipe", "mixed-bf16", "--optim", "adamw", "--format", "json"],
        gpt2_device_cuda_json => [GPT2, "--device", "cuda", "--format", "json"],
        gpus => ["gpus"],
        bert_base_b32_s512_gpu_rtx_4090 => ["examples/bert_base.toml", "--batch", "32", "--seq", "512", "--gpu", "rtx-4090"],
        bert_base_b32_s512_gpu_rtx_4090_json => ["examples/bert_base.toml", "--batch", "32", "--seq", "512", "--gpu", "rtx-4090", "--format", "json"],
        bert_base_b128_s512_gpu_rtx_4090_over => ["examples/bert_base.toml", "--batch", "128", "--seq", "512", "--gpu", "rtx-4090"],
        gpt2_gpu_a100_40gb_max_batch => [GPT2, "--gpu", "a100-40gb", "--max-batch"],
        hf_llama_2_7b_nf4_lora16 => ["examples/hf/llama-2-7b.json", "--lora-rank", "16", "--dtype", "nf4", "--optim", "adamw", "--batch", "1", "--seq", "2048"],
        hf_llama_2_7b_nf4_lora16_json => ["examples/hf/llama-2-7b.json", "--lora-rank", "16", "--dtype", "nf4", "--optim", "adamw", "--batch", "1", "--seq", "2048", "--format", "json"],
        hf_mixtral_int4_json => ["examples/hf/mixtral-8x7b.json", "--dtype", "int4", "--format", "json"],
        hf_mixtral_int8_json => ["examples/hf/mixtral-8x7b.json", "--dtype", "int8", "--format", "json"],
        hf_llama_3_8b_seq4096 => [LLAMA3, "--seq", "4096"],
        hf_bert_head_none => ["examples/hf/bert-base-uncased.json", "--head", "none"],
        hf_llama_3_8b_context8192_batch4 => [LLAMA3, "--context", "8192", "--batch", "4"],
        hf_mistral_context32768_kv_fp8 => ["examples/hf/mistral-7b-v0.1.json", "--context", "32768", "--kv-dtype", "fp8"],
        mlp_budget_under => [MLP, "--budget", "80GB"],
        mlp_budget_over => [MLP, "--budget", "1KiB"],
        mlp_budget_over_json => [MLP, "--budget", "1MiB", "--format", "json"],
        resnet50_budget_24gib_json => [RESNET50, "--budget", "24GiB", "--format", "json"],
        gpt2_max_batch => [GPT2, "--budget", "24GiB", "--max-batch"],
        gpt2_max_batch_json => [GPT2, "--budget", "24GiB", "--max-batch", "--format", "json"],
        mlp_max_batch_too_small => [MLP, "--budget", "1KiB", "--max-batch"],
        hf_llama_3_8b_max_context => [LLAMA3, "--mode", "infer", "--budget", "24GiB", "--max-context"],
        hf_llama_3_8b_max_context_json => [LLAMA3, "--mode", "infer", "--budget", "24GiB", "--max-context", "--format", "json"],
        fixture_mlp_json => ["tests/fixtures/mlp.json", "--format", "json"],
        seq_without_length_given_one => ["tests/fixtures/seq_without_length.toml", "--seq", "8", "--format", "json"],
        llama_tiny_gpus2_ddp => ["examples/llama_tiny.toml", "--gpus", "2"],
        llama_tiny_gpus2_fsdp_json => ["examples/llama_tiny.toml", "--gpus", "2", "--fsdp", "full-shard", "--format", "json"],
        hf_llama_3_8b_gpus8_zero3 => [LLAMA3, "--gpus", "8", "--zero", "3", "--recipe", "mixed-bf16", "--batch", "4", "--seq", "4096"],
        hf_llama_3_8b_gpus8_fsdp_max_batch => [LLAMA3, "--gpus", "8", "--fsdp", "full-shard", "--dtype", "bfloat16", "--seq", "4096", "--budget", "80GB", "--max-batch"],
        zero_without_gpus => [MLP, "--zero", "3"],
        zero_stage_past_3 => [MLP, "--gpus", "2", "--zero", "4"],
        llama_tiny_deepspeed_zero2_offload_h100 => ["examples/llama_tiny.toml", "--seq", "128", "--deepspeed", "tests/fixtures/parallel/ds_zero2_offload.json", "--gpu", "h100"],
        llama_tiny_deepspeed_unknown_keys => ["examples/llama_tiny.toml", "--seq", "128", "--deepspeed", "tests/fixtures/parallel/ds_unknown_keys.json", "--gpus", "2", "--device", "cpu"],
        llama_tiny_accelerate_fsdp_json => ["examples/llama_tiny.toml", "--seq", "128", "--batch", "2", "--optim", "adamw", "--accelerate", "tests/fixtures/parallel/accelerate_fsdp.yaml", "--format", "json"],
        llama_tiny_zero3_offload_both => ["examples/llama_tiny.toml", "--seq", "128", "--batch", "2", "--optim", "adamw", "--dtype", "bf16", "--gpus", "4", "--zero", "3", "--offload", "both"],
        llama_tiny_min_gpus_zero3 => ["examples/llama_tiny.toml", "--seq", "128", "--batch", "2", "--optim", "adamw", "--dtype", "bf16", "--device", "cpu", "--zero", "3", "--reduce-bucket-size", "5000000", "--min-gpus", "--budget", "400MiB"],
        llama_tiny_plan_auto_gpus16 => ["examples/llama_tiny.toml", "--seq", "128", "--batch", "2", "--optim", "adamw", "--dtype", "bf16", "--gpus", "16", "--plan", "auto", "--gpu", "h100"],
        offload_with_ddp => [MLP, "--gpus", "2", "--offload", "optimizer"],
        offload_without_gpus => [MLP, "--zero", "2", "--offload", "optimizer"],
        mlp_sweep_one_value => [MLP, "--sweep", "batch=4"],
        llama_tiny_zero1_on_one_gpu => ["examples/llama_tiny.toml", "--gpus", "1", "--zero", "1"],
        mlp_cudnn_workspace_without_convolutions => [MLP, "--cudnn-workspace", "64MiB"],
        resnet18_cudnn_workspace_on_cpu => ["examples/resnet18.toml", "--device", "cpu", "--cudnn-workspace", "64MiB"],
    }

    #[test]
    fn stdin_toml_json() {
        let src = std::fs::read_to_string(crate::common::path(MLP)).unwrap();
        super::check_stdin("flags_stdin_toml_json", &["-", "--format", "json"], &src);
    }

    #[test]
    fn file_name_is_the_model_name() {
        super::check_temp(
            "flags_file_name_is_the_model_name",
            "txt",
            b"[input]\nshape = [4]\n[[layers]]\nkind = \"relu\"\n",
            &[],
        );
    }
}

/// `--print-model` of every Hugging Face example and two memest files.
mod print_model {
    cases! { "print_model_";
        mlp => ["--print-model", "examples/mlp.toml"],
        gpt2 => ["--print-model", "examples/gpt2.toml"],
        hf_bert_base_uncased => ["--print-model", "examples/hf/bert-base-uncased.json"],
        hf_bert_base_uncased_head_none => ["--print-model", "examples/hf/bert-base-uncased.json", "--head", "none"],
        hf_bert_base_cls => ["--print-model", "examples/hf/bert_base_cls.json"],
        hf_gemma_7b => ["--print-model", "examples/hf/gemma-7b.json"],
        hf_gpt2 => ["--print-model", "examples/hf/gpt2.json"],
        hf_llama_2_7b => ["--print-model", "examples/hf/llama-2-7b.json"],
        hf_llama_3_8b => ["--print-model", "examples/hf/llama-3-8b.json"],
        hf_llama_tiny => ["--print-model", "examples/hf/llama_tiny.json"],
        hf_mistral_7b_v0_1 => ["--print-model", "examples/hf/mistral-7b-v0.1.json"],
        hf_mixtral_8x7b => ["--print-model", "examples/hf/mixtral-8x7b.json"],
        hf_olmo_2_1124_7b => ["--print-model", "examples/hf/olmo-2-1124-7b.json"],
        hf_phi_3_mini => ["--print-model", "examples/hf/phi-3-mini.json"],
        hf_qwen1_5_moe_a2_7b => ["--print-model", "examples/hf/qwen1.5-moe-a2.7b.json"],
        hf_qwen2_7b => ["--print-model", "examples/hf/qwen2-7b.json"],
        hf_qwen3_8b => ["--print-model", "examples/hf/qwen3-8b.json"],
        hf_bloom_560m => ["--print-model", "examples/hf/bloom-560m.json"],
        hf_falcon_7b => ["--print-model", "examples/hf/falcon-7b.json"],
        hf_phi_2 => ["--print-model", "examples/hf/phi-2.json"],
        hf_pythia_1_4b => ["--print-model", "examples/hf/pythia-1.4b.json"],
        hf_roberta_base => ["--print-model", "examples/hf/roberta-base.json"],
        hf_deberta_v3_base => ["--print-model", "examples/hf/deberta-v3-base.json"],
        hf_starcoder => ["--print-model", "examples/hf/starcoder.json"],
        hf_gemma_2_2b => ["--print-model", "examples/hf/gemma-2-2b.json"],
        hf_gpt_oss_20b => ["--print-model", "examples/hf/gpt-oss-20b.json"],
        hf_qwen3_30b_a3b => ["--print-model", "examples/hf/qwen3-30b-a3b.json"],
        hf_t5_small => ["--print-model", "examples/hf/t5-small.json"],
        hf_whisper_small => ["--print-model", "examples/hf/whisper-small.json"],
        hf_c4ai_command_r_v01 => ["--print-model", "examples/hf/c4ai-command-r-v01.json"],
    }
}

/// `--help`, `-h`, `--version`. Help is not wrapped to the terminal (clap's `wrap_help` is off),
/// and stdout is not a terminal, so the text has no colour; the width is the fixed default.
mod help {
    cases! { "help_";
        long => ["--help"],
        short => ["-h"],
        version => ["--version"],
    }
}

/// Every bad input of `errors.rs` and `tests/fixtures/`, and the usage errors.
mod error {
    cases! { "error_";
        fixture_syntax_error_toml => ["tests/fixtures/syntax_error.toml"],
        fixture_syntax_error_json => ["tests/fixtures/syntax_error.json"],
        fixture_unknown_key_toml => ["tests/fixtures/unknown_key.toml"],
        fixture_unknown_key_json => ["tests/fixtures/unknown_key.json"],
        fixture_unknown_kind => ["tests/fixtures/unknown_kind.toml"],
        fixture_missing_field => ["tests/fixtures/missing_field.toml"],
        fixture_conv_on_rank2 => ["tests/fixtures/conv_on_rank2.toml"],
        fixture_in_features_mismatch => ["tests/fixtures/in_features_mismatch.toml"],
        fixture_zero_size => ["tests/fixtures/zero_size.toml"],
        fixture_negative_size => ["tests/fixtures/negative_size.toml"],
        fixture_empty => ["tests/fixtures/empty.toml"],
        fixture_unknown_input => ["tests/fixtures/unknown_input.toml"],
        fixture_repeat_changes_shape => ["tests/fixtures/repeat_changes_shape.toml"],
        fixture_seq_without_length => ["tests/fixtures/seq_without_length.toml"],
        fixture_batchnorm2d_on_rank2 => ["tests/fixtures/batchnorm2d_on_rank2.toml"],
        fixture_batchnorm1d_on_rank4 => ["tests/fixtures/batchnorm1d_on_rank4.toml"],
        fixture_batchnorm_num_features_mismatch => ["tests/fixtures/batchnorm_num_features_mismatch.toml"],
        fixture_pool_padding_too_large => ["tests/fixtures/pool_padding_too_large.toml"],
        fixture_top_level_array => ["tests/fixtures/top_level_array.json"],
        missing_file => ["tests/fixtures/no-such-model.toml"],
        directory => ["tests/fixtures"],
        no_arguments => [],
        batch_zero => ["examples/mlp.toml", "--batch", "0"],
        seq_zero => ["examples/gpt2.toml", "--seq", "0"],
        batch_overflow => ["examples/mlp.toml", "--batch", "18446744073709551615"],
        unknown_optim => ["examples/mlp.toml", "--optim", "adamm"],
        optim_impl_for_lion => ["examples/mlp.toml", "--optim", "lion", "--optim-impl", "fused"],
        unknown_optim_impl => ["examples/mlp.toml", "--optim-impl", "single"],
        bad_budget => ["examples/mlp.toml", "--budget", "12XB"],
        amp_with_bfloat16 => ["examples/mlp.toml", "--amp", "bf16", "--dtype", "bfloat16"],
        head_on_a_memest_file => ["examples/mlp.toml", "--head", "none"],
        max_batch_without_budget => ["examples/mlp.toml", "--max-batch"],
        max_batch_and_max_context => ["examples/mlp.toml", "--budget", "1GiB", "--max-batch", "--max-context"],
        context_with_mode => ["examples/hf/llama_tiny.json", "--context", "16", "--mode", "train"],
        lora_targets_without_rank => ["examples/mlp.toml", "--lora-targets", "q"],
        unknown_flag => ["examples/mlp.toml", "--bach", "4"],
        adafactor_on_fsdp2_shards => ["examples/mlp.toml", "--optim", "adafactor", "--gpus", "2", "--fsdp", "full-shard"],
        chunked_ce_after_logit_scale => ["tests/fixtures/hf/granite_tiny.json", "--loss", "chunked-ce"],
        chunked_ce_after_softcap => ["tests/fixtures/hf/gemma2_tiny.json", "--loss", "chunked-ce"],
        chunked_ce_with_mse_loss => ["tests/fixtures/hf/unet_tiny.json", "--loss", "chunked-ce"],
        chunked_ce_without_loss => ["examples/mlp.toml", "--loss", "chunked-ce"],
        chunked_ce_on_a_classifier => ["examples/resnet50.toml", "--loss", "chunked-ce"],
        budget_zero => ["examples/mlp.toml", "--budget", "0"],
        budget_zero_bytes_with_unit => ["examples/mlp.toml", "--budget", "0GiB"],
        gemma3_multimodal_config => ["tests/fixtures/hf/gemma3_multimodal.json"],
        generate_on_llava => ["tests/fixtures/hf/llava_tiny.json", "--prompt", "700", "--new-tokens", "4"],
        generate_on_qwen2_vl => ["tests/fixtures/hf/qwen2_vl_tiny.json", "--prompt", "700", "--new-tokens", "4"],
        plan_auto_with_csv => ["examples/llama_tiny.toml", "--gpus", "2", "--plan", "auto", "--format", "csv"],
        plan_auto_with_markdown => ["examples/llama_tiny.toml", "--gpus", "2", "--plan", "auto", "--format", "markdown"],
        plan_auto_with_per_layer => ["examples/llama_tiny.toml", "--gpus", "2", "--plan", "auto", "--per-layer"],
        plan_auto_with_explain => ["examples/llama_tiny.toml", "--gpus", "2", "--plan", "auto", "--explain"],
        plan_auto_with_timeline => ["examples/llama_tiny.toml", "--gpus", "2", "--plan", "auto", "--timeline", "t.svg"],
    }

    use super::{check_stdin, check_temp};

    #[test]
    fn stdin_syntax_error() {
        check_stdin("error_stdin_syntax_error", &["-"], "[input]\nshape = [4\n");
    }

    #[test]
    fn stdin_empty() {
        check_stdin("error_stdin_empty", &["-"], "");
    }

    #[test]
    fn missing_field_inside_a_block() {
        check_temp(
            "error_missing_field_inside_a_block",
            "toml",
            b"[input]\nshape = [4]\n[[layers]]\nkind = \"repeat\"\nname = \"blk\"\ncount = 2\n  [[layers.layers]]\n  kind = \"relu\"\n  [[layers.layers]]\n  kind = \"linear\"\n  name = \"x\"\n",
            &[],
        );
    }

    /// A bad name in `[defaults]` points at its line and column and lists the accepted names.
    #[test]
    fn unknown_file_defaults() {
        check_temp(
            "error_file_default_optimizer",
            "toml",
            b"[input]\nshape = [8]\n[defaults]\noptimizer = \"adamx\"\n[[layers]]\nkind = \"relu\"\n",
            &[],
        );
        check_temp(
            "error_file_default_mode",
            "json",
            br#"{"input": {"shape": [8]}, "defaults": {"mode": "evaluate"}, "layers": [{"kind": "relu"}]}"#,
            &[],
        );
    }

    #[test]
    fn non_utf8_file() {
        check_temp(
            "error_non_utf8_file",
            "toml",
            b"[input]\nshape = [\xff\xfe]\n",
            &[],
        );
    }

    #[test]
    fn out_features_overflow() {
        check_temp(
            "error_out_features_overflow",
            "toml",
            b"[input]\nshape = [4]\n[[layers]]\nkind = \"linear\"\nout_features = 18446744073709551615\n",
            &[],
        );
    }

    #[test]
    fn nested_repeats_past_the_operator_cap() {
        check_temp(
            "error_nested_repeats_past_the_operator_cap",
            "toml",
            b"[input]\nshape = [1000]\n[[layers]]\nname = \"outer\"\nkind = \"repeat\"\ncount = 100\n  [[layers.layers]]\n  name = \"inner\"\n  kind = \"repeat\"\n  count = 100000\n    [[layers.layers.layers]]\n    kind = \"linear\"\n    out_features = 1000\n",
            &[],
        );
    }

    #[test]
    fn shares_with_another_config() {
        check_temp(
            "error_shares_with_another_config",
            "toml",
            b"[input]\nshape = [4]\n[[layers]]\nkind = \"linear\"\nname = \"a\"\nout_features = 4\n[[layers]]\nkind = \"linear\"\nname = \"x\"\nout_features = 8\nbias = false\nshares = \"a\"\n",
            &[],
        );
    }

    #[test]
    fn upsample_unknown_mode() {
        check_temp(
            "error_upsample_unknown_mode",
            "toml",
            b"[input]\nshape = [3, 8, 8]\n[[layers]]\nkind = \"upsample\"\nscale_factor = 2\nmode = \"bicubic\"\n",
            &[],
        );
        check_temp(
            "error_pad_unknown_mode",
            "json",
            br#"{"input": {"shape": [3, 8, 8]}, "layers": [{"kind": "pad", "pad": [1, 1], "mode": "reflection"}]}"#,
            &[],
        );
    }

    #[test]
    fn pad_with_one_value() {
        check_temp(
            "error_pad_with_one_value",
            "toml",
            b"[input]\nshape = [3, 8, 8]\n[[layers]]\nkind = \"pad\"\npad = [1]\n",
            &[],
        );
    }

    #[test]
    fn einsum_moving_the_batch() {
        check_temp(
            "error_einsum_moving_the_batch",
            "toml",
            b"[input]\nshape = [4, 64, 32]\n[[layers]]\nkind = \"linear\"\nname = \"q\"\nout_features = 32\n[[layers]]\nkind = \"einsum\"\nname = \"s\"\ninputs = [\"q\", \"input\"]\nequation = \"bqd,bkd->qbk\"\n",
            &[],
        );
    }

    #[test]
    fn key_that_does_not_apply_to_the_kind() {
        check_temp(
            "error_key_that_does_not_apply_to_the_kind",
            "toml",
            b"[input]\nshape = [4]\n[[layers]]\nkind = \"linear\"\nout_features = 3\nkernel = 3\n",
            &[],
        );
    }
}

/// `--format json` of every tiny model in `tests/fixtures/kinds/` (one per layer kind) and
/// `tests/fixtures/extra/` (the extra measured families; its memest files at batch 4 and
/// sequence 64): one snapshot per file,
/// `fixture_models@<folder>__<file>.snap`. insta reports every mismatching file, not only the
/// first.
#[test]
fn fixture_models() {
    let mut settings = insta::Settings::clone_current();
    settings.set_prepend_module_to_snapshot(false);
    settings.set_omit_expression(true);
    settings.bind(|| {
        insta::glob!("../fixtures", "{kinds,extra}/*.{toml,json}", |file| {
            let rel = file
                .strip_prefix(crate::common::root())
                .expect("fixtures lie under the crate root")
                .to_str()
                .expect("fixture paths are UTF-8");
            // The extra memest files leave the sequence length to the command line; use the
            // measured cases' (tests/data/extra-cases-cli.json).
            let mut args = vec![rel];
            if rel.starts_with("tests/fixtures/extra/") && rel.ends_with(".toml") {
                args.extend(["--batch", "4", "--seq", "64"]);
            }
            args.extend(["--format", "json"]);
            let out = memest(&args);
            let mut inner = insta::Settings::clone_current();
            inner.set_description(format!("memest {}", args.join(" ")));
            inner.bind(|| insta::assert_snapshot!(transcript(&out)));
        });
    });
}
