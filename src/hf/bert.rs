//! BERT (`BertForMaskedLM`, `BertForSequenceClassification`, `BertModel`) and RoBERTa
//! (`RobertaForMaskedLM`, `XLMRobertaForMaskedLM`, their `…ForSequenceClassification` and bare
//! `…Model`; `models/roberta/modeling_roberta.py`, which `xlm_roberta` copies), which differs in
//! its embeddings' ids and its heads.

use super::Resolved;
use super::config::{BertConfig, Cfg, layer_count, prob, required};
use super::layers::{
    activation, cross_entropy, embedding, encoder_layer_tail, layer, layernorm, linear,
    module_path, push, push_dropout, repeat,
};
use crate::error::Error;
use crate::spec::{LayerKind as K, LayerSpec, layer_spec};

/// Builds BERT as transformers' `modeling_bert.py` does; returns the layers and
/// `max_position_embeddings`.
pub(super) fn bert(cfg: &Cfg, head: Resolved) -> Result<(Vec<LayerSpec>, u64), Error> {
    encoder(cfg, head, false)
}

/// Builds RoBERTa or XLM-RoBERTa as `modeling_roberta.py` does; returns the layers and the
/// longest sequence (`max_position_embeddings − pad_token_id − 1`: positions start after the
/// padding id).
pub(super) fn roberta(cfg: &Cfg, head: Resolved) -> Result<(Vec<LayerSpec>, u64), Error> {
    encoder(cfg, head, true)
}

/// BERT, or RoBERTa when `roberta`.
#[allow(clippy::too_many_lines)] // the embeddings, the layer and the three heads, in order
fn encoder(cfg: &Cfg, head: Resolved, roberta: bool) -> Result<(Vec<LayerSpec>, u64), Error> {
    let c: BertConfig = cfg.read()?;
    let vocab = required!(cfg, c.vocab_size)?;
    let hidden = required!(cfg, c.hidden_size)?;
    let n_layers = layer_count!(cfg, c.num_hidden_layers)?;
    let heads = required!(cfg, c.num_attention_heads)?;
    let intermediate = required!(cfg, c.intermediate_size)?;
    let positions = c.max_position_embeddings.unwrap_or(512);
    let types = c.type_vocab_size.unwrap_or(2);
    let act_name = c.hidden_act.as_deref().unwrap_or("gelu");
    let hidden_p = prob!(cfg, c.hidden_dropout_prob, 0.1)?;
    let attn_p = prob!(cfg, c.attention_probs_dropout_prob, 0.1)?;
    let tie = cfg.tie(true);
    let position_type = c.position_embedding_type.as_deref().unwrap_or("absolute");
    if position_type != "absolute" {
        return Err(cfg.err(format!(
            "`position_embedding_type = \"{position_type}\"` is not supported (only \"absolute\")"
        )));
    }
    if c.is_decoder.unwrap_or(false) || c.add_cross_attention.unwrap_or(false) {
        return Err(cfg.err(
            "BERT as a decoder (`is_decoder` or `add_cross_attention`) is not supported".into(),
        ));
    }

    // The word embeddings' `padding_idx` (`nn.Embedding` asserts it is below
    // `num_embeddings`). RobertaEmbeddings: positions count from `padding_idx + 1`.
    let pad = c.pad_token_id.unwrap_or(if roberta { 1 } else { 0 });
    if pad >= vocab {
        return Err(cfg.err(format!(
            "`pad_token_id` ({pad}) is not a token of the vocabulary (`vocab_size` {vocab}): it is the word embeddings' padding_idx, which must be below vocab_size"
        )));
    }
    let max_seq = if roberta {
        pad.checked_add(1)
            .and_then(|first| positions.checked_sub(first))
            .filter(|&n| n > 0)
            .ok_or_else(|| {
            cfg.err(format!(
                "`max_position_embeddings` ({positions}) leaves no position after `pad_token_id` ({pad})"
            ))
        })?
    } else {
        positions
    };
    let p = module_path(head, if roberta { "roberta" } else { "bert" });
    let mut out = Vec::new();
    let word = push(
        &mut out,
        embedding(&p("embeddings.word_embeddings"), vocab, hidden),
    );
    push(
        &mut out,
        layer_spec! {
            num_embeddings: Some(types),
            ids_buffer: Some(positions),
            ids_per_batch: roberta.then_some(true),
            ..layer(
                K::TokenTypeEmbedding,
                &p("embeddings.token_type_embeddings"),
            )
        },
    );
    push(
        &mut out,
        layer_spec! {
            num_positions: Some(positions),
            ids_buffer: Some(positions),
            ids_per_batch: roberta.then_some(true),
            ..layer(K::PositionEmbedding, &p("embeddings.position_embeddings"))
        },
    );
    let prev = push(&mut out, layernorm(&p("embeddings.LayerNorm")));
    push_dropout(&mut out, &p("embeddings.dropout"), hidden_p, prev);

    let mut body = Vec::new();
    let attn = push(
        &mut body,
        layer_spec! {
            heads: Some(heads),
            dropout: (attn_p > 0.0).then_some(attn_p),
            note: Some("query, key, value and attention.output.dense".into()),
            ..layer(K::Attention, "attention.self")
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
    push(
        &mut out,
        repeat(&p("encoder.layer"), "num_hidden_layers", n_layers, body),
    );

    let pooler = |out: &mut Vec<LayerSpec>| {
        push(
            out,
            layer_spec! {
                dim: Some(1),
                index: Some(0),
                ..layer(K::Select, &p("pooler.first_token"))
            },
        );
        push(out, linear(&p("pooler.dense"), hidden, true));
        push(out, layer(K::Tanh, &p("pooler.activation")))
    };
    match head {
        Resolved::Bare => {
            pooler(&mut out);
        }
        Resolved::Classification if roberta => {
            // RobertaClassificationHead on the first token; RobertaModel without its pooler.
            let classifier_p = cfg.prob(
                "classifier_dropout",
                c.classifier_dropout.or(c.hidden_dropout_prob),
                0.1,
            )?;
            let prev = push(
                &mut out,
                layer_spec! {
                    dim: Some(1),
                    index: Some(0),
                    ..layer(K::Select, "classifier.first_token")
                },
            );
            push_dropout(&mut out, "classifier.dropout", classifier_p, prev);
            push(&mut out, linear("classifier.dense", hidden, true));
            let prev = push(&mut out, layer(K::Tanh, "classifier.tanh"));
            push_dropout(&mut out, "classifier.dropout_2", classifier_p, prev);
            push(
                &mut out,
                linear("classifier.out_proj", cfg.num_labels()?, true),
            );
            push(&mut out, cross_entropy(false, false));
        }
        Resolved::Classification => {
            let prev = pooler(&mut out);
            let classifier_p = cfg.prob(
                "classifier_dropout",
                c.classifier_dropout.or(c.hidden_dropout_prob),
                0.1,
            )?;
            push_dropout(&mut out, "dropout", classifier_p, prev);
            push(&mut out, linear("classifier", cfg.num_labels()?, true));
            push(&mut out, cross_entropy(false, false));
        }
        Resolved::Lm if roberta => {
            // RobertaLMHead: dense, `gelu` (exact, whatever `hidden_act` says), layer_norm,
            // decoder tied to the word embeddings with its own bias.
            push(&mut out, linear("lm_head.dense", hidden, true));
            push(&mut out, layer(K::Gelu, "lm_head.gelu"));
            push(&mut out, layernorm("lm_head.layer_norm"));
            let mut decoder = linear("lm_head.decoder", vocab, true);
            if tie {
                decoder.tie = Some(word);
                decoder.note =
                    Some("weight tied to the word embeddings; its own [vocab] bias".into());
            }
            push(&mut out, decoder);
            push(&mut out, cross_entropy(false, false));
        }
        Resolved::Lm => {
            push(
                &mut out,
                linear("cls.predictions.transform.dense", hidden, true),
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
                decoder.note =
                    Some("weight tied to the word embeddings; its own [vocab] bias".into());
            }
            push(&mut out, decoder);
            push(&mut out, cross_entropy(false, false));
        }
    }
    Ok((out, max_seq))
}
