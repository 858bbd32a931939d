//! Constructors of the memest layers the families are built from.

use super::Resolved;
use super::config::Cfg;
use crate::error::Error;
use crate::spec::{Approximate, LayerKind as K, LayerSpec, Style, layer_spec};

pub(super) fn layer(kind: K, name: &str) -> LayerSpec {
    layer_spec! {
        kind: kind,
        name: Some(name.to_string()),
        ..Default::default()
    }
}

pub(super) fn with_inputs(mut l: LayerSpec, inputs: &[&str]) -> LayerSpec {
    l.inputs = Some(inputs.iter().map(|s| (*s).to_string()).collect());
    l
}

pub(super) fn with_note(mut l: LayerSpec, note: &str) -> LayerSpec {
    l.note = Some(note.to_string());
    l
}

pub(super) fn linear(name: &str, out: u64, bias: bool) -> LayerSpec {
    layer_spec! {
        out_features: Some(out),
        bias: (!bias).then_some(false),
        ..layer(K::Linear, name)
    }
}

pub(super) fn embedding(name: &str, num: u64, dim: u64) -> LayerSpec {
    layer_spec! {
        num_embeddings: Some(num),
        embedding_dim: Some(dim),
        ..layer(K::Embedding, name)
    }
}

pub(super) fn dropout(name: &str, p: f64) -> LayerSpec {
    layer_spec! {
        p: Some(p),
        ..layer(K::Dropout, name)
    }
}

pub(super) fn add(name: &str, a: &str, b: &str) -> LayerSpec {
    with_inputs(layer(K::Add, name), &[a, b])
}

pub(super) fn layernorm(name: &str) -> LayerSpec {
    layer(K::LayerNorm, name)
}

/// T5's `T5LayerNorm` (see `graph::Op::RmsNorm`).
pub(super) fn t5_norm(name: &str) -> LayerSpec {
    layer_spec! {
        style: Some(Style::T5),
        ..rmsnorm(name)
    }
}

pub(super) fn rmsnorm(name: &str) -> LayerSpec {
    layer(K::RmsNorm, name)
}

pub(super) fn cross_entropy(shift: bool, upcast: bool) -> LayerSpec {
    layer_spec! {
        shift: shift.then_some(true),
        upcast: upcast.then_some(true),
        ..layer(K::CrossEntropy, "loss")
    }
}

/// A `repeat` of `count` copies of `body`; `key` is the config field the count comes from
/// (errors name it).
pub(super) fn repeat(name: &str, key: &'static str, count: u64, body: Vec<LayerSpec>) -> LayerSpec {
    layer_spec! {
        count: Some(count),
        count_key: Some(key),
        layers: Some(body),
        ..layer(K::Repeat, name)
    }
}

/// The module-path namer of a model whose head wraps the base model in `base` (`model`,
/// `transformer`, `bert`): `embed_tokens` → `model.embed_tokens`, or `embed_tokens` as it is for
/// the bare model.
pub(super) fn module_path(head: Resolved, base: &'static str) -> impl Fn(&str) -> String {
    move |s: &str| {
        if head == Resolved::Bare {
            s.to_string()
        } else {
            format!("{base}.{s}")
        }
    }
}

/// Appends `layer` to `out` and returns its name (the next layer's input by default).
pub(super) fn push(out: &mut Vec<LayerSpec>, l: LayerSpec) -> String {
    let name = l.name.clone().expect("every imported layer is named");
    out.push(l);
    name
}

/// Appends a dropout when it drops anything (`nn.Dropout(0)` is the identity); returns the name
/// of the last layer.
pub(super) fn push_dropout(out: &mut Vec<LayerSpec>, name: &str, p: f64, prev: String) -> String {
    if p > 0.0 {
        push(out, dropout(name, p))
    } else {
        prev
    }
}

/// The rest of a BERT-style encoder layer after its self-attention `attn` (transformers'
/// `BertLayer` after `BertSelfAttention`; RoBERTa's and DeBERTa-v2's `DebertaV2Layer` are the
/// same): `attention.output`'s dropout, the residual onto the layer's `input` and its LayerNorm,
/// `intermediate.dense` `[B, S, hidden] → [B, S, intermediate]` with `hidden_act`,
/// `output.dense` back to `[B, S, hidden]`, its dropout, the residual and `output.LayerNorm`.
/// Dropouts are left out at probability 0 (`hidden_p`). Errors: an unknown `hidden_act`.
pub(super) fn encoder_layer_tail(
    body: &mut Vec<LayerSpec>,
    cfg: &Cfg,
    attn: String,
    (hidden, intermediate): (u64, u64),
    hidden_p: f64,
    act_name: &str,
) -> Result<(), Error> {
    let prev = push_dropout(body, "attention.output.dropout", hidden_p, attn);
    push(body, add("attention.residual", "input", &prev));
    let attn_ln = push(body, layernorm("attention.output.LayerNorm"));
    push(body, linear("intermediate.dense", intermediate, true));
    push(
        body,
        activation(
            cfg,
            "hidden_act",
            act_name,
            "intermediate.intermediate_act_fn",
        )?,
    );
    let prev = push(body, linear("output.dense", hidden, true));
    let prev = push_dropout(body, "output.dropout", hidden_p, prev);
    push(body, add("output.residual", &attn_ln, &prev));
    push(body, layernorm("output.LayerNorm"));
    Ok(())
}

/// transformers' `QuickGELUActivation` (`quick_gelu`: CLIP, Qwen2-VL's vision MLP) after the
/// layer `x`: `x * torch.sigmoid(1.702 * x)`, as `scale`, `sigmoid` and `mul`; returns the
/// name of the last.
pub(super) fn quick_gelu(out: &mut Vec<LayerSpec>, name: &str, x: &str) -> String {
    push(
        out,
        layer_spec! {
            factor: Some(1.702),
            ..layer(K::Scale, &format!("{name}.scale"))
        },
    );
    let sig = push(out, layer(K::Sigmoid, &format!("{name}.sigmoid")));
    push(out, with_inputs(layer(K::Mul, name), &[x, &sig]))
}

/// transformers' `ACT2FN[name]` as a memest layer.
pub(super) fn activation(cfg: &Cfg, key: &str, act: &str, name: &str) -> Result<LayerSpec, Error> {
    Ok(match act {
        "silu" | "swish" => layer(K::Silu, name),
        "gelu" => layer(K::Gelu, name),
        "gelu_pytorch_tanh" => layer_spec! {
            approximate: Some(Approximate::Tanh),
            ..layer(K::Gelu, name)
        },
        "gelu_new" => layer(K::GeluNew, name),
        "relu" => layer(K::Relu, name),
        "relu6" => layer(K::Relu6, name),
        "tanh" => layer(K::Tanh, name),
        "sigmoid" => layer(K::Sigmoid, name),
        other => {
            return Err(cfg.err(format!(
                "activation `{other}` in `{key}` is not supported (supported: silu, swish, gelu, gelu_pytorch_tanh, gelu_new, relu, relu6, tanh, sigmoid)"
            )));
        }
    })
}

/// The decoder's head: LM head and causal-LM loss, a last-token classifier, or nothing.
pub(super) fn causal_head(
    out: &mut Vec<LayerSpec>,
    cfg: &Cfg,
    head: Resolved,
    vocab: u64,
    tie: Option<&str>,
) -> Result<(), Error> {
    match head {
        Resolved::Bare => {}
        Resolved::Lm => {
            let mut lm = linear("lm_head", vocab, false);
            lm.tie = tie.map(str::to_string);
            out.push(lm);
            out.push(cross_entropy(true, true));
        }
        Resolved::Classification => {
            // transformers' GenericForSequenceClassification: `score` on every position, then
            // the logits of the last token.
            out.push(linear("score", cfg.num_labels()?, false));
            out.push(layer_spec! {
                dim: Some(1),
                index: Some(-1),
                ..layer(K::Select, "pooled_logits")
            });
            out.push(cross_entropy(false, false));
        }
    }
    Ok(())
}

/// Consecutive equal items as `(first index, count, item)` runs.
pub(super) fn runs<T: PartialEq + Clone>(items: &[T]) -> Vec<(usize, u64, T)> {
    let mut out: Vec<(usize, u64, T)> = Vec::new();
    for (i, it) in items.iter().enumerate() {
        match out.last_mut() {
            Some((_, n, last)) if last == it => *n += 1,
            _ => out.push((i, 1, it.clone())),
        }
    }
    out
}

/// The name of a run of repeated layers: the module list's name for a single run, with the
/// index range when the layers split into several runs.
pub(super) fn run_name(base: &str, all: usize, first: usize, count: u64) -> String {
    if all == 1 {
        base.to_string()
    } else if count == 1 {
        format!("{base}.{first}")
    } else {
        format!("{base}.{first}-{}", first as u64 + count - 1)
    }
}
