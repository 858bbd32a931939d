//! BERT (`BertForMaskedLM`, `BertForSequenceClassification`, `BertModel`).

use super::Resolved;
use super::config::Cfg;
use super::layers::{
    activation, add, cross_entropy, embedding, layer, layernorm, linear, push, push_dropout, repeat,
};
use crate::error::Error;
use crate::spec::{LayerKind as K, LayerSpec};

pub(super) fn bert(cfg: &Cfg, head: Resolved) -> Result<(Vec<LayerSpec>, u64), Error> {
    let vocab = cfg.req(&["vocab_size"])?;
    let hidden = cfg.req(&["hidden_size"])?;
    let n_layers = cfg.layers(&["num_hidden_layers"])?;
    let heads = cfg.req(&["num_attention_heads"])?;
    let intermediate = cfg.req(&["intermediate_size"])?;
    let positions = cfg.u_or(&["max_position_embeddings"], 512)?;
    let types = cfg.u_or(&["type_vocab_size"], 2)?;
    let act_name = cfg.s_or(&["hidden_act"], "gelu")?;
    let hidden_p = cfg.p_or(&["hidden_dropout_prob"], 0.1)?;
    let attn_p = cfg.p_or(&["attention_probs_dropout_prob"], 0.1)?;
    let tie = cfg.b_or("tie_word_embeddings", true)?;
    let position_type = cfg.s_or(&["position_embedding_type"], "absolute")?;
    if position_type != "absolute" {
        return Err(cfg.err(format!(
            "`position_embedding_type = \"{position_type}\"` is not supported (only \"absolute\")"
        )));
    }
    if cfg.b_or("is_decoder", false)? || cfg.b_or("add_cross_attention", false)? {
        return Err(cfg.err(
            "BERT as a decoder (`is_decoder` or `add_cross_attention`) is not supported".into(),
        ));
    }

    let bare = head == Resolved::Bare;
    let p = |s: &str| {
        if bare {
            s.to_string()
        } else {
            format!("bert.{s}")
        }
    };
    let mut out = Vec::new();
    let word = push(
        &mut out,
        embedding(&p("embeddings.word_embeddings"), vocab, hidden),
    );
    push(
        &mut out,
        LayerSpec {
            num_embeddings: Some(types),
            ids_buffer: Some(positions),
            ..layer(
                K::TokenTypeEmbedding,
                &p("embeddings.token_type_embeddings"),
            )
        },
    );
    push(
        &mut out,
        LayerSpec {
            num_positions: Some(positions),
            ids_buffer: Some(positions),
            ..layer(K::PositionEmbedding, &p("embeddings.position_embeddings"))
        },
    );
    let prev = push(&mut out, layernorm(&p("embeddings.LayerNorm")));
    push_dropout(&mut out, &p("embeddings.dropout"), hidden_p, prev);

    let mut body = Vec::new();
    let attn = push(
        &mut body,
        LayerSpec {
            heads: Some(heads),
            dropout: (attn_p > 0.0).then_some(attn_p),
            note: Some("query, key, value and attention.output.dense".into()),
            ..layer(K::Attention, "attention.self")
        },
    );
    let prev = push_dropout(&mut body, "attention.output.dropout", hidden_p, attn);
    push(&mut body, add("attention.residual", "input", &prev));
    let attn_ln = push(&mut body, layernorm("attention.output.LayerNorm"));
    push(&mut body, linear("intermediate.dense", intermediate, true));
    push(
        &mut body,
        activation(
            cfg,
            "hidden_act",
            act_name,
            "intermediate.intermediate_act_fn",
        )?,
    );
    let prev = push(&mut body, linear("output.dense", hidden, true));
    let prev = push_dropout(&mut body, "output.dropout", hidden_p, prev);
    push(&mut body, add("output.residual", &attn_ln, &prev));
    push(&mut body, layernorm("output.LayerNorm"));
    push(&mut out, repeat(&p("encoder.layer"), n_layers, body));

    let pooler = |out: &mut Vec<LayerSpec>| {
        push(
            out,
            LayerSpec {
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
        Resolved::Classification => {
            let prev = pooler(&mut out);
            let classifier_p = cfg.p_or(&["classifier_dropout", "hidden_dropout_prob"], 0.1)?;
            push_dropout(&mut out, "dropout", classifier_p, prev);
            push(&mut out, linear("classifier", cfg.num_labels()?, true));
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
    Ok((out, positions))
}
