//! DeBERTa-v2 and -v3 (`DebertaV2Model`, `DebertaV2ForMaskedLM`,
//! `DebertaV2ForSequenceClassification`; transformers 5, `models/deberta_v2/`), module by module
//! in `forward` order.

use super::Resolved;
use super::config::{Cfg, DebertaV2Config, prob};
use super::layers::{
    activation, add, cross_entropy, embedding, encoder_layer_tail, layer, layernorm, linear,
    module_path, push, push_dropout, repeat, with_inputs,
};
use crate::error::Error;
use crate::spec::{CombineKind, LayerKind as K, LayerSpec, Sizes, layer_spec};

/// Builds DeBERTa-v2 as `modeling_deberta_v2.py` does, with `DebertaV2Config`'s defaults for
/// the keys a config leaves out; returns the layers and `max_position_embeddings`.
///
/// With `conv_kernel_size > 0` (DeBERTa-v2-xlarge and -xxlarge) the encoder's `ConvLayer` runs
/// after layer 0. Refused: `relative_attention = false` (content-only attention with DeBERTa's
/// scaling is not modelled), a `pos_att_type` naming neither `c2p` nor `p2c`, and widths
/// transformers cannot run (`attention_head_size`, `pooler_hidden_size`).
#[allow(clippy::too_many_lines)] // the embeddings, the layer and the three heads, in order
pub(super) fn deberta_v2(cfg: &Cfg, head: Resolved) -> Result<(Vec<LayerSpec>, u64), Error> {
    let c: DebertaV2Config = cfg.read()?;
    let vocab = cfg.required("vocab_size", c.vocab_size.or(Some(128_100)))?;
    let hidden = cfg.required("hidden_size", c.hidden_size.or(Some(1536)))?;
    let n_layers = cfg.layers("num_hidden_layers", c.num_hidden_layers.or(Some(24)))?;
    let heads = cfg.required("num_attention_heads", c.num_attention_heads.or(Some(24)))?;
    let intermediate = cfg.required("intermediate_size", c.intermediate_size.or(Some(6144)))?;
    let positions = cfg.required(
        "max_position_embeddings",
        c.max_position_embeddings.or(Some(512)),
    )?;
    let embedding_size = cfg.required("embedding_size", c.embedding_size.or(Some(hidden)))?;
    let types = c.type_vocab_size.unwrap_or(0);
    let act_name = c.hidden_act.as_deref().unwrap_or("gelu");
    let hidden_p = prob!(cfg, c.hidden_dropout_prob, 0.1)?;
    let attn_p = prob!(cfg, c.attention_probs_dropout_prob, 0.1)?;
    let tie = cfg.tie(true);
    if !c.relative_attention.unwrap_or(false) {
        return Err(cfg.field_err(
            "relative_attention",
            "DeBERTa without relative attention (`relative_attention = false`) is not supported (every published DeBERTa-v2/v3 config sets it)".into(),
        ));
    }
    let conv = c.conv_kernel_size.filter(|&k| k > 0);
    let conv_groups = cfg.required("conv_groups", c.conv_groups.or(Some(1)))?;
    if conv.is_some() && !hidden.is_multiple_of(conv_groups) {
        return Err(cfg.field_err(
            "conv_groups",
            format!("`conv_groups` ({conv_groups}) must divide `hidden_size` ({hidden})"),
        ));
    }
    let types_of = c
        .pos_att_type
        .as_ref()
        .map(|t| t.entries())
        .unwrap_or_default();
    for t in &types_of {
        if t != "c2p" && t != "p2c" {
            return Err(cfg.field_err(
                "pos_att_type",
                format!(
                    "`pos_att_type` entry `{t}` is not supported (expected \"c2p\" or \"p2c\")"
                ),
            ));
        }
    }
    let c2p = types_of.iter().any(|t| t == "c2p");
    let p2c = types_of.iter().any(|t| t == "p2c");
    if !c2p && !p2c {
        return Err(cfg.field_err(
            "pos_att_type",
            "relative attention without `c2p` or `p2c` in `pos_att_type` is not supported".into(),
        ));
    }
    // DisentangledSelfAttention: pos_ebd_size = position_buckets when positive, else
    // max_relative_positions, which defaults to max_position_embeddings when below 1.
    let buckets = c.position_buckets.filter(|&b| b > 0).map(i64::unsigned_abs);
    let max_rel = c
        .max_relative_positions
        .filter(|&m| m >= 1)
        .map_or(positions, i64::unsigned_abs);
    let span = buckets.unwrap_or(max_rel);
    let norm_rel = c
        .norm_rel_ebd
        .as_deref()
        .unwrap_or("none")
        .to_lowercase()
        .split('|')
        .any(|s| s.trim() == "layer_norm");
    let head_dim = c.attention_head_size;
    if let Some(d) = head_dim
        && d.checked_mul(heads) != Some(hidden)
    {
        return Err(cfg.field_err(
            "attention_head_size",
            format!("`attention_head_size` ({d}) × `num_attention_heads` ({heads}) differs from `hidden_size` ({hidden}): the attention output's dense layer reads `hidden_size` features, transformers cannot run it"),
        ));
    }
    let pad = c.pad_token_id.unwrap_or(0);
    if pad >= vocab {
        return Err(cfg.field_err(
            "pad_token_id",
            format!("`pad_token_id` ({pad}) is not a token of the vocabulary (`vocab_size` {vocab}): it is the word embeddings' padding_idx, which must be below vocab_size"),
        ));
    }
    let position_biased = c.position_biased_input.unwrap_or(true);

    let p = module_path(head, "deberta");
    let mut out = Vec::new();
    let word = push(
        &mut out,
        embedding(&p("embeddings.word_embeddings"), vocab, embedding_size),
    );
    if position_biased {
        push(
            &mut out,
            layer_spec! {
                num_positions: Some(positions),
                ids_buffer: Some(positions),
                ..layer(K::PositionEmbedding, &p("embeddings.position_embeddings"))
            },
        );
    }
    if types > 0 {
        // DebertaV2Model.forward makes all-zero `token_type_ids` `[B, S]`.
        push(
            &mut out,
            layer_spec! {
                num_embeddings: Some(types),
                ..layer(
                    K::TokenTypeEmbedding,
                    &p("embeddings.token_type_embeddings"),
                )
            },
        );
    }
    if embedding_size != hidden {
        push(&mut out, linear(&p("embeddings.embed_proj"), hidden, false));
    }
    push(&mut out, layernorm(&p("embeddings.LayerNorm")));
    let prev = push(
        &mut out,
        layer_spec! {
            ids_buffer: (!position_biased).then_some(positions),
            note: Some("embeddings * the all-ones attention_mask".into()),
            ..layer(K::PaddingMask, &p("embeddings.mask"))
        },
    );
    let embedded = push_dropout(&mut out, &p("embeddings.dropout"), hidden_p, prev);
    push(
        &mut out,
        layer_spec! {
            num_positions: Some(span),
            num_buckets: buckets,
            norm: norm_rel.then_some(true),
            note: Some("rel_embeddings (and LayerNorm), relative positions, attention mask".into()),
            ..layer(K::RelativeEmbeddings, &p("encoder.rel_embeddings"))
        },
    );

    let mut body = Vec::new();
    let attn = push(
        &mut body,
        layer_spec! {
            heads: Some(heads),
            head_dim: head_dim,
            c2p: Some(c2p),
            p2c: Some(p2c),
            share_att_key: c.share_att_key.filter(|&s| s),
            num_positions: Some(span),
            dropout: (attn_p > 0.0).then_some(attn_p),
            pos_dropout: (hidden_p > 0.0).then_some(hidden_p),
            note: Some(
                "query_proj, key_proj, value_proj, the relative projections and attention.output.dense"
                    .into(),
            ),
            ..layer(K::DisentangledAttention, "attention.self")
        },
    );
    encoder_layer_tail(
        &mut body,
        cfg,
        attn,
        (hidden, intermediate),
        hidden_p,
        act_name,
    )?;
    match conv {
        None => {
            push(
                &mut out,
                repeat(&p("encoder.layer"), "num_hidden_layers", n_layers, body),
            );
        }
        Some(kernel) => {
            // DebertaV2Encoder runs ConvLayer after layer 0, on the embeddings' output, with
            // layer 0's output as the residual.
            let first = push(
                &mut out,
                repeat(&p("encoder.layer.0"), "num_hidden_layers", 1, body.clone()),
            );
            let act = c.conv_act.as_deref().unwrap_or("tanh");
            conv_layer(
                &mut out,
                cfg,
                &p,
                ConvLayer {
                    embedded: &embedded,
                    residual: &first,
                    hidden,
                    kernel,
                    groups: conv_groups,
                    act,
                    dropout: hidden_p,
                },
            )?;
            if n_layers > 1 {
                push(
                    &mut out,
                    repeat(
                        &p(&format!("encoder.layer.1-{}", n_layers - 1)),
                        "num_hidden_layers",
                        n_layers - 1,
                        body,
                    ),
                );
            }
        }
    }

    match head {
        Resolved::Bare => {}
        Resolved::Classification => {
            // ContextPooler on the first token, then the classifier.
            if let Some(w) = c.pooler_hidden_size.filter(|&w| w != hidden) {
                return Err(cfg.field_err(
                    "pooler_hidden_size",
                    format!("`pooler_hidden_size` ({w}) differs from `hidden_size` ({hidden}): ContextPooler's dense layer reads the hidden states, transformers cannot run it"),
                ));
            }
            let pooler_p = prob!(cfg, c.pooler_dropout, 0.0)?;
            let cls_p = cfg.prob("cls_dropout", c.cls_dropout.or(c.hidden_dropout_prob), 0.1)?;
            let prev = push(
                &mut out,
                layer_spec! {
                    dim: Some(1),
                    index: Some(0),
                    ..layer(K::Select, "pooler.first_token")
                },
            );
            push_dropout(&mut out, "pooler.dropout", pooler_p, prev);
            push(&mut out, linear("pooler.dense", hidden, true));
            let prev = push(
                &mut out,
                activation(
                    cfg,
                    "pooler_hidden_act",
                    c.pooler_hidden_act.as_deref().unwrap_or("gelu"),
                    "pooler.activation",
                )?,
            );
            push_dropout(&mut out, "dropout", cls_p, prev);
            push(&mut out, linear("classifier", cfg.num_labels()?, true));
            // `loss_fct(labeled_logits.view(-1, num_labels).float(), labels)`.
            push(&mut out, cross_entropy(false, true));
        }
        Resolved::Lm if c.legacy.unwrap_or(true) => {
            // LegacyDebertaV2LMPredictionHead: dense to embedding_size, act, LayerNorm, the
            // decoder tied to the word embeddings, its bias tied to `cls.predictions.bias`.
            push(
                &mut out,
                linear("cls.predictions.transform.dense", embedding_size, true),
            );
            push(
                &mut out,
                activation(
                    cfg,
                    "hidden_act",
                    act_name,
                    "cls.predictions.transform.transform_act_fn",
                )?,
            );
            push(&mut out, layernorm("cls.predictions.transform.LayerNorm"));
            let mut decoder = linear("cls.predictions.decoder", vocab, true);
            if tie {
                decoder.tie = Some(word);
                decoder.note = Some(
                    "weight tied to the word embeddings; its bias is cls.predictions.bias".into(),
                );
            } else {
                // Untied, `cls.predictions.bias` is a parameter of its own that forward never
                // reads.
                push(
                    &mut out,
                    layer_spec! {
                        shape: Some(vec![i64::try_from(vocab).unwrap_or(i64::MAX)]),
                        combine: Some(CombineKind::Unused),
                        ..layer(K::Parameter, "cls.predictions.bias")
                    },
                );
            }
            push(&mut out, decoder);
            push(&mut out, cross_entropy(false, false));
        }
        Resolved::Lm => {
            // DebertaV2LMPredictionHead (`legacy = false`): dense, act, LayerNorm, then
            // `torch.matmul(h, word_embeddings.weight.t()) + self.bias`.
            if embedding_size != hidden {
                return Err(cfg.field_err(
                    "legacy",
                    format!("`legacy = false` multiplies the hidden states ({hidden}) by the word embeddings ({embedding_size} wide): transformers cannot run it"),
                ));
            }
            push(
                &mut out,
                linear("lm_predictions.lm_head.dense", hidden, true),
            );
            push(
                &mut out,
                activation(
                    cfg,
                    "hidden_act",
                    act_name,
                    "lm_predictions.lm_head.transform_act_fn",
                )?,
            );
            push(&mut out, layernorm("lm_predictions.lm_head.LayerNorm"));
            let mut logits = linear("lm_predictions.lm_head.matmul", vocab, false);
            logits.tie = Some(word);
            logits.note = Some("h @ word_embeddings.weight.t()".into());
            push(&mut out, logits);
            push(
                &mut out,
                layer_spec! {
                    shape: Some(vec![i64::try_from(vocab).unwrap_or(i64::MAX)]),
                    combine: Some(CombineKind::Add),
                    ..layer(K::Parameter, "lm_predictions.lm_head.bias")
                },
            );
            push(&mut out, cross_entropy(false, false));
        }
    }
    Ok((out, positions))
}

/// What `ConvLayer` reads: the embeddings' output, layer 0's output, its sizes.
struct ConvLayer<'a> {
    embedded: &'a str,
    residual: &'a str,
    hidden: u64,
    kernel: u64,
    groups: u64,
    act: &'a str,
    dropout: f64,
}

/// `ConvLayer.forward`: `conv(hidden_states.permute(0, 2, 1).contiguous())` (a `Conv1d` of
/// `kernel`, padding `(kernel − 1) // 2`, `groups`), `.permute(0, 2, 1).contiguous()`,
/// `masked_fill_` of the padded positions, dropout, `conv_act`, the residual sum with layer 0's
/// output, LayerNorm, and the product with the padding mask.
fn conv_layer(
    out: &mut Vec<LayerSpec>,
    cfg: &Cfg,
    p: &impl Fn(&str) -> String,
    c: ConvLayer<'_>,
) -> Result<(), Error> {
    let hidden = i64::try_from(c.hidden).unwrap_or(i64::MAX);
    push(
        out,
        with_inputs(
            layer_spec! {
                dims: Some(vec![0, 2, 1]),
                ..layer(K::Permute, &p("encoder.conv.permute"))
            },
            &[c.embedded],
        ),
    );
    push(
        out,
        layer_spec! {
            shape: Some(vec![hidden, -1]),
            note: Some(".contiguous()".into()),
            ..layer(K::Reshape, &p("encoder.conv.contiguous"))
        },
    );
    push(
        out,
        layer_spec! {
            out_channels: Some(c.hidden),
            kernel: Some(Sizes(vec![c.kernel])),
            padding: Some(Sizes(vec![(c.kernel - 1) / 2])),
            groups: (c.groups > 1).then_some(c.groups),
            ..layer(K::Conv1d, &p("encoder.conv.conv"))
        },
    );
    push(
        out,
        layer_spec! {
            dims: Some(vec![0, 2, 1]),
            ..layer(K::Permute, &p("encoder.conv.permute_back"))
        },
    );
    push(
        out,
        layer_spec! {
            shape: Some(vec![-1, hidden]),
            note: Some(".contiguous()".into()),
            ..layer(K::Reshape, &p("encoder.conv.contiguous_back"))
        },
    );
    let prev = push(
        out,
        layer_spec! {
            fill: Some(true),
            note: Some("out.masked_fill_((1 - input_mask).bool(), 0)".into()),
            ..layer(K::PaddingMask, &p("encoder.conv.mask"))
        },
    );
    push_dropout(out, &p("encoder.conv.dropout"), c.dropout, prev);
    let act = push(
        out,
        activation(cfg, "conv_act", c.act, &p("encoder.conv.conv_act"))?,
    );
    push(out, add(&p("encoder.conv.residual"), c.residual, &act));
    push(out, layernorm(&p("encoder.conv.LayerNorm")));
    push(
        out,
        layer_spec! {
            note: Some("output * input_mask".into()),
            ..layer(K::PaddingMask, &p("encoder.conv.output_mask"))
        },
    );
    Ok(())
}
