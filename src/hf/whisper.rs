//! Whisper (`WhisperForConditionalGeneration`, `WhisperModel`; transformers 5
//! `models/whisper/modeling_whisper.py`): an audio encoder on log-mel features and a text
//! decoder with cross-attention.
//!
//! `WhisperEncoder.forward` refuses any `input_features` but `[batch, num_mel_bins,
//! 2·max_source_positions]` (the feature extractor pads every clip to 30 s: 3000 frames for
//! `max_source_positions` 1500), so the audio length is fixed by the config and is no flag. It
//! runs `gelu(conv1(x))` (kernel 3, padding 1), `gelu(conv2(x))` (kernel 3, stride 2, padding 1:
//! `max_source_positions` frames), `permute(0, 2, 1)`, adds `embed_positions` (an
//! `nn.Embedding` whose sinusoidal weight is frozen: `requires_grad_(False)`, so the lookup is
//! not recorded and the table gets no gradient or optimizer state), then the pre-norm encoder
//! layers and `layer_norm`.
//!
//! The decoder reads `--seq` token ids (the main input, like T5's; at most
//! `max_target_positions`, which `WhisperForConditionalGeneration` checks): the labels,
//! shifted right into `decoder_input_ids` (`shift_tokens_right`), `embed_tokens` plus the
//! learned `embed_positions` gathered at `[batch, seq]` position ids (`weight[position_ids]`,
//! whose backward keeps the ids), the pre-norm decoder layers (causal self-attention, then
//! cross-attention on the encoder output, each keeping transformers' `EncoderDecoderCache`
//! copies of K and V under `use_cache`), `layer_norm`, `proj_out` (tied to `embed_tokens`) and
//! `CrossEntropyLoss` on the unshifted labels. `WhisperAttention` has no bias on `k_proj`.

use super::Resolved;
use super::config::{Cfg, WhisperConfig, layer_count, prob, required};
use super::layers::{
    activation, add, cross_entropy, embedding, layer, layernorm, linear, module_path, push,
    push_dropout, repeat, with_inputs,
};
use crate::error::Error;
use crate::spec::{DimSpec, InputSpec, LayerKind as K, LayerSpec, Sizes, layer_spec};

/// The name of the named input that holds the log-mel features.
pub(super) const FEATURES: &str = "input_features";

/// What [`whisper`] builds.
pub(super) struct Built {
    /// The layers, in forward order.
    pub layers: Vec<LayerSpec>,
    /// `max_target_positions`: the decoder's learned positions (the longest `--seq`).
    pub max_positions: u64,
    /// The named input `input_features`: `[num_mel_bins, 2·max_source_positions]` in the
    /// model's dtype.
    pub features: (String, InputSpec),
}

/// Builds Whisper as transformers 5's `modeling_whisper.py` runs it in a training step.
#[allow(clippy::too_many_lines)] // encoder, decoder and head, in forward order
pub(super) fn whisper(cfg: &Cfg, head: Resolved) -> Result<Built, Error> {
    if head == Resolved::Classification {
        return Err(cfg.err(
            "whisper is supported as WhisperForConditionalGeneration and the bare WhisperModel (pick --head lm or none); WhisperForAudioClassification is not supported yet".into(),
        ));
    }
    let c: WhisperConfig = cfg.read()?;
    let vocab = required!(cfg, c.vocab_size)?;
    let mels = required!(cfg, c.num_mel_bins)?;
    let d = required!(cfg, c.d_model)?;
    let enc_layers = layer_count!(cfg, c.encoder_layers)?;
    let dec_layers = layer_count!(cfg, c.decoder_layers)?;
    let enc_heads = required!(cfg, c.encoder_attention_heads)?;
    let dec_heads = required!(cfg, c.decoder_attention_heads)?;
    let enc_ffn = required!(cfg, c.encoder_ffn_dim)?;
    let dec_ffn = required!(cfg, c.decoder_ffn_dim)?;
    let sources = cfg.required(
        "max_source_positions",
        Some(c.max_source_positions.unwrap_or(1500)),
    )?;
    let targets = cfg.required(
        "max_target_positions",
        Some(c.max_target_positions.unwrap_or(448)),
    )?;
    for (key, heads) in [
        ("encoder_attention_heads", enc_heads),
        ("decoder_attention_heads", dec_heads),
    ] {
        // WhisperAttention: "embed_dim must be divisible by num_heads".
        if !d.is_multiple_of(heads) {
            return Err(cfg.field_err(
                key,
                format!("`d_model` ({d}) must be divisible by `{key}` ({heads})"),
            ));
        }
    }
    let frames = sources.checked_mul(2).ok_or_else(|| {
        cfg.field_err(
            "max_source_positions",
            format!("`max_source_positions` = {sources} is too large"),
        )
    })?;
    let p_drop = prob!(cfg, c.dropout, 0.0)?;
    let p_attn = prob!(cfg, c.attention_dropout, 0.0)?;
    let p_act = prob!(cfg, c.activation_dropout, 0.0)?;
    for (key, v) in [
        ("encoder_layerdrop", c.encoder_layerdrop),
        ("decoder_layerdrop", c.decoder_layerdrop),
    ] {
        let p = cfg.prob(key, v, 0.0)?;
        if p > 0.0 {
            return Err(cfg.field_err(
                key,
                format!("`{key}` = {p} (layers skipped at random in training) is not supported; set it to 0"),
            ));
        }
    }
    let act_name = c.activation_function.as_deref().unwrap_or("gelu");
    let p = module_path(head, "model");

    let attention = |name: &str, heads: u64, causal: bool| {
        layer_spec! {
            heads: Some(heads),
            causal: causal.then_some(true),
            k_bias: Some(false),
            scale_query: Some(true),
            contiguous_heads: Some(true),
            dropout: (p_attn > 0.0).then_some(p_attn),
            ..layer(K::Attention, name)
        }
    };
    // The MLP half of a layer, after the residual sum `residual`; the last sum is `sum`.
    let mlp =
        |body: &mut Vec<LayerSpec>, ffn: u64, residual: &str, sum: &str| -> Result<String, Error> {
            push(body, layernorm("final_layer_norm"));
            push(body, linear("fc1", ffn, true));
            let prev = push(
                body,
                activation(cfg, "activation_function", act_name, "activation_fn")?,
            );
            push_dropout(body, "activation_dropout", p_act, prev);
            let prev = push(body, linear("fc2", d, true));
            let prev = push_dropout(body, "fc2.dropout", p_drop, prev);
            Ok(push(body, add(sum, residual, &prev)))
        };

    let mut out = Vec::new();
    // Encoder.
    push(
        &mut out,
        with_inputs(
            layer_spec! {
                out_channels: Some(d),
                kernel: Some(Sizes(vec![3])),
                padding: Some(Sizes(vec![1])),
                ..layer(K::Conv1d, &p("encoder.conv1"))
            },
            &[FEATURES],
        ),
    );
    push(&mut out, layer(K::Gelu, &p("encoder.conv1.gelu")));
    push(
        &mut out,
        layer_spec! {
            out_channels: Some(d),
            kernel: Some(Sizes(vec![3])),
            stride: Some(Sizes(vec![2])),
            padding: Some(Sizes(vec![1])),
            ..layer(K::Conv1d, &p("encoder.conv2"))
        },
    );
    push(&mut out, layer(K::Gelu, &p("encoder.conv2.gelu")));
    push(
        &mut out,
        layer_spec! {
            dims: Some(vec![0, 2, 1]),
            ..layer(K::Permute, &p("encoder.permute"))
        },
    );
    let prev = push(
        &mut out,
        layer_spec! {
            num_positions: Some(sources),
            trainable: Some(false),
            note: Some("sinusoidal table, frozen (requires_grad_(False))".into()),
            ..layer(K::PositionEmbedding, &p("encoder.embed_positions"))
        },
    );
    push_dropout(&mut out, &p("encoder.dropout"), p_drop, prev);
    let mut body = Vec::new();
    push(&mut body, layernorm("self_attn_layer_norm"));
    push(&mut body, attention("self_attn", enc_heads, false));
    let prev = push_dropout(&mut body, "self_attn.dropout", p_drop, "self_attn".into());
    let r = push(&mut body, add("residual.1", "input", &prev));
    mlp(&mut body, enc_ffn, &r, "residual.2")?;
    push(
        &mut out,
        repeat(&p("encoder.layers"), "encoder_layers", enc_layers, body),
    );
    let encoder_out = push(&mut out, layernorm(&p("encoder.layer_norm")));

    // Decoder, on the labels shifted right (the bare model reads its decoder ids as given).
    let ids = if head == Resolved::Lm {
        push(
            &mut out,
            with_inputs(layer(K::ShiftRight, "shift_tokens_right"), &["input"]),
        )
    } else {
        "input".to_string()
    };
    let embed_tokens = p("decoder.embed_tokens");
    push(
        &mut out,
        with_inputs(embedding(&embed_tokens, vocab, d), &[&ids]),
    );
    let prev = push(
        &mut out,
        layer_spec! {
            num_positions: Some(targets),
            ids_per_batch: Some(true),
            note: Some("weight[position_ids], the [batch, seq] ids kept by its backward".into()),
            ..layer(K::PositionEmbedding, &p("decoder.embed_positions"))
        },
    );
    push_dropout(&mut out, &p("decoder.dropout"), p_drop, prev);
    let mut body = Vec::new();
    push(&mut body, layernorm("self_attn_layer_norm"));
    push(&mut body, attention("self_attn", dec_heads, true));
    let prev = push_dropout(&mut body, "self_attn.dropout", p_drop, "self_attn".into());
    let r = push(&mut body, add("residual.1", "input", &prev));
    let norm = push(&mut body, layernorm("encoder_attn_layer_norm"));
    push(
        &mut body,
        with_inputs(
            layer_spec! {
                heads: Some(dec_heads),
                k_bias: Some(false),
                scale_query: Some(true),
                contiguous_heads: Some(true),
                dropout: (p_attn > 0.0).then_some(p_attn),
                ..layer(K::CrossAttention, "encoder_attn")
            },
            &[&norm, &encoder_out],
        ),
    );
    let prev = push_dropout(
        &mut body,
        "encoder_attn.dropout",
        p_drop,
        "encoder_attn".into(),
    );
    let r = push(&mut body, add("residual.2", &r, &prev));
    mlp(&mut body, dec_ffn, &r, "residual.3")?;
    push(
        &mut out,
        repeat(&p("decoder.layers"), "decoder_layers", dec_layers, body),
    );
    push(&mut out, layernorm(&p("decoder.layer_norm")));
    if head == Resolved::Lm {
        let mut lm = linear("proj_out", vocab, false);
        // WhisperConfig ties `proj_out` to `embed_tokens` unless `tie_word_embeddings = false`.
        if cfg.tie(true) {
            lm.tie = Some(embed_tokens);
        }
        push(&mut out, lm);
        push(&mut out, cross_entropy(false, false));
    }
    Ok(Built {
        layers: out,
        max_positions: targets,
        features: (
            FEATURES.into(),
            InputSpec {
                shape: vec![DimSpec::Fixed(mels), DimSpec::Fixed(frames)],
                dtype: None,
            },
        ),
    })
}
