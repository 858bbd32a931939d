//! T5 (`T5ForConditionalGeneration`, `T5ForSequenceClassification`, `T5Model`).

use super::Resolved;
use super::config::{Cfg, T5Config, layer_count, prob, required};
use super::layers::{
    activation, add, cross_entropy, embedding, layer, linear, push, push_dropout, repeat, t5_norm,
    with_inputs, with_note,
};
use crate::error::Error;
use crate::spec::{LayerKind as K, LayerSpec, layer_spec};

#[allow(clippy::too_many_lines)] // encoder, decoder and heads, in forward order
/// Builds T5 as transformers' `modeling_t5.py` does; returns the layers and `n_positions`.
pub(super) fn t5(cfg: &Cfg, head: Resolved) -> Result<(Vec<LayerSpec>, u64), Error> {
    let c: T5Config = cfg.read()?;
    let vocab = required!(cfg, c.vocab_size)?;
    let d_model = required!(cfg, c.d_model)?;
    let d_ff = required!(cfg, c.d_ff)?;
    let enc_layers = layer_count!(cfg, c.num_layers)?;
    let dec_layers = match c.num_decoder_layers {
        None => enc_layers,
        Some(_) => layer_count!(cfg, c.num_decoder_layers)?,
    };
    let heads = required!(cfg, c.num_heads)?;
    let d_kv = c.d_kv.unwrap_or(64);
    let buckets = c.relative_attention_num_buckets.unwrap_or(32);
    let p_drop = prob!(cfg, c.dropout_rate, 0.1)?;
    let ff_proj = c.feed_forward_proj.as_deref().unwrap_or("relu");
    let parts: Vec<&str> = ff_proj.split('-').collect();
    let (gated, act_name) = match parts.as_slice() {
        [act] => (false, *act),
        ["gated", act] => (true, *act),
        _ => {
            return Err(cfg.err(format!(
                "`feed_forward_proj = \"{ff_proj}\"` is not valid (expected e.g. \"relu\" or \"gated-gelu\")"
            )));
        }
    };
    // T5Config: "gated-gelu" means the tanh approximation written out (gelu_new).
    let act_name = if ff_proj == "gated-gelu" {
        "gelu_new"
    } else {
        act_name
    };
    // T5Config always ties the LM head; a config that says `tie_word_embeddings = false`
    // (T5 v1.1) only turns off the decoder-output scaling.
    // mT5 ties always too, but its `MT5ForConditionalGeneration` never scales.
    let scale_outputs = cfg.model_type != "mt5" && cfg.tie(true);
    let seq = c.n_positions.unwrap_or(512);
    let head_dim = (heads.checked_mul(d_kv) != Some(d_model)).then_some(d_kv);

    let ff = |body: &mut Vec<LayerSpec>, idx: usize, residual: &str| -> Result<String, Error> {
        let n = |s: &str| format!("layer.{idx}.{s}");
        let norm = push(body, t5_norm(&n("layer_norm")));
        if gated {
            push(body, linear(&n("DenseReluDense.wi_0"), d_ff, false));
            let act = push(
                body,
                activation(cfg, "feed_forward_proj", act_name, &n("DenseReluDense.act"))?,
            );
            let lin = push(
                body,
                with_inputs(linear(&n("DenseReluDense.wi_1"), d_ff, false), &[&norm]),
            );
            let prev = push(
                body,
                with_inputs(
                    layer(K::Mul, &n("DenseReluDense.gelu_mul_linear")),
                    &[&act, &lin],
                ),
            );
            push_dropout(body, &n("DenseReluDense.dropout"), p_drop, prev);
        } else {
            push(body, linear(&n("DenseReluDense.wi"), d_ff, false));
            let prev = push(
                body,
                activation(cfg, "feed_forward_proj", act_name, &n("DenseReluDense.act"))?,
            );
            push_dropout(body, &n("DenseReluDense.dropout"), p_drop, prev);
        }
        push(body, linear(&n("DenseReluDense.wo"), d_model, false));
        let prev = n("DenseReluDense.wo");
        let prev = push_dropout(body, &n("dropout"), p_drop, prev);
        Ok(push(body, add(&n("residual"), residual, &prev)))
    };
    let self_attn = |body: &mut Vec<LayerSpec>, causal: bool| -> String {
        push(body, t5_norm("layer.0.layer_norm"));
        let prev = push(
            body,
            layer_spec! {
                heads: Some(heads),
                head_dim: head_dim,
                causal: causal.then_some(true),
                bias: Some(false),
                position_bias: Some(true),
                dropout: (p_drop > 0.0).then_some(p_drop),
                ..layer(K::Attention, "layer.0.SelfAttention")
            },
        );
        let prev = push_dropout(body, "layer.0.dropout", p_drop, prev);
        push(body, add("layer.0.residual", "input", &prev))
    };
    let rpb = |name: &str| {
        layer_spec! {
            num_buckets: Some(buckets),
            heads: Some(heads),
            note: Some("block 0's relative_attention_bias, shared by every block".into()),
            ..layer(K::RelativePositionBias, name)
        }
    };

    let mut out = Vec::new();
    let shared = push(&mut out, embedding("shared", vocab, d_model));
    // Encoder.
    let prev = shared.clone();
    push_dropout(&mut out, "encoder.dropout", p_drop, prev);
    push(
        &mut out,
        rpb("encoder.block.0.layer.0.SelfAttention.relative_attention_bias"),
    );
    let mut body = Vec::new();
    let r = self_attn(&mut body, false);
    ff(&mut body, 1, &r)?;
    push(
        &mut out,
        repeat("encoder.block", "num_layers", enc_layers, body),
    );
    let prev = push(&mut out, t5_norm("encoder.final_layer_norm"));
    let encoder_out = push_dropout(&mut out, "encoder.dropout.final", p_drop, prev);
    // Decoder, on the labels shifted right.
    push(
        &mut out,
        with_inputs(layer(K::ShiftRight, "decoder.shift_right"), &["input"]),
    );
    push(
        &mut out,
        layer_spec! {
            tie: Some(shared.clone()),
            ..embedding("decoder.embed_tokens", vocab, d_model)
        },
    );
    let prev = "decoder.embed_tokens".to_string();
    push_dropout(&mut out, "decoder.dropout", p_drop, prev);
    push(
        &mut out,
        rpb("decoder.block.0.layer.0.SelfAttention.relative_attention_bias"),
    );
    let mut body = Vec::new();
    let r = self_attn(&mut body, true);
    let norm = push(&mut body, t5_norm("layer.1.layer_norm"));
    let prev = push(
        &mut body,
        with_inputs(
            layer_spec! {
                heads: Some(heads),
                head_dim: head_dim,
                bias: Some(false),
                dropout: (p_drop > 0.0).then_some(p_drop),
                ..layer(K::CrossAttention, "layer.1.EncDecAttention")
            },
            &[&norm, &encoder_out],
        ),
    );
    let prev = push_dropout(&mut body, "layer.1.dropout", p_drop, prev);
    let r = push(&mut body, add("layer.1.residual", &r, &prev));
    ff(&mut body, 2, &r)?;
    push(
        &mut out,
        repeat(
            "decoder.block",
            if c.num_decoder_layers.is_some() {
                "num_decoder_layers"
            } else {
                "num_layers"
            },
            dec_layers,
            body,
        ),
    );
    let prev = push(&mut out, t5_norm("decoder.final_layer_norm"));
    push_dropout(&mut out, "decoder.dropout.final", p_drop, prev);
    match head {
        Resolved::Bare => {}
        Resolved::Lm => {
            if scale_outputs {
                #[allow(clippy::cast_precision_loss)]
                let factor = (d_model as f64).powf(-0.5);
                push(
                    &mut out,
                    with_note(
                        layer_spec! {
                            factor: Some(factor),
                            ..layer(K::Scale, "decoder_output_scale")
                        },
                        "sequence_output * d_model**-0.5 before the tied head",
                    ),
                );
            }
            let mut lm = linear("lm_head", vocab, false);
            lm.tie = Some(shared);
            push(&mut out, lm);
            push(&mut out, cross_entropy(false, false));
        }
        Resolved::Classification => {
            // T5ForSequenceClassification: the decoder's last (EOS) position, then
            // dropout, dense, tanh, dropout, out_proj.
            push(
                &mut out,
                layer_spec! {
                    dim: Some(1),
                    index: Some(-1),
                    ..layer(K::Select, "eos_representation")
                },
            );
            let classifier_p = prob!(cfg, c.classifier_dropout, 0.0)?;
            let prev = "eos_representation".to_string();
            push_dropout(&mut out, "classification_head.dropout", classifier_p, prev);
            push(&mut out, linear("classification_head.dense", d_model, true));
            let prev = push(&mut out, layer(K::Tanh, "classification_head.tanh"));
            push_dropout(
                &mut out,
                "classification_head.dropout.2",
                classifier_p,
                prev,
            );
            push(
                &mut out,
                linear("classification_head.out_proj", cfg.num_labels()?, true),
            );
            push(&mut out, cross_entropy(false, false));
        }
    }
    Ok((out, seq))
}
