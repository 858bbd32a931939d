//! Llama-style decoders: llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, gemma, phi3.

use serde_json::Value;

use super::config::Cfg;
use super::layers::{
    activation, add, causal_head, embedding, family_norm, layer, linear, push, push_dropout,
    repeat, run_name, runs, with_inputs, with_note,
};
use super::{Family, Resolved};
use crate::error::Error;
use crate::spec::{LayerKind as K, LayerSpec};

/// The MLP of one decoder layer.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Mlp {
    /// Gated MLP (`gate_proj`, act, `up_proj`, mul, `down_proj`).
    Dense(u64),
    /// Sparse mixture of experts.
    Moe {
        experts: u64,
        top_k: u64,
        intermediate: u64,
        shared: u64,
        shared_gate: bool,
        normalize: bool,
    },
}

/// What may differ from one decoder layer to the next.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct LayerVariant {
    mlp: Mlp,
    sliding_window: Option<u64>,
}

#[allow(clippy::too_many_lines)] // one place that reads every family's keys
pub(super) fn decoder(
    cfg: &Cfg,
    family: Family,
    head: Resolved,
) -> Result<(Vec<LayerSpec>, u64), Error> {
    use Family as F;
    let vocab = cfg.req(&["vocab_size"])?;
    let hidden = cfg.req(&["hidden_size"])?;
    let n_layers = cfg.layers(&["num_hidden_layers"])?;
    let heads = cfg.req(&["num_attention_heads"])?;
    // transformers' config-class defaults where the file leaves the key out (or null).
    let kv_default = match family {
        F::Mistral | F::Mixtral => 8,
        F::Qwen2 | F::Qwen3 => 32,
        F::Gemma | F::Qwen2Moe => 16,
        _ => heads,
    };
    let kv_heads = cfg.u_or(&["num_key_value_heads"], kv_default)?;
    let head_dim_default = match family {
        F::Qwen3 => 128,
        F::Gemma => 256,
        _ => hidden / heads,
    };
    let head_dim = cfg.u_or(&["head_dim"], head_dim_default)?;
    let max_pos_default = match family {
        F::Mistral | F::Mixtral => 4096 * 32,
        F::Qwen2 | F::Qwen3 | F::Qwen2Moe => 32768,
        F::Gemma => 8192,
        F::Phi3 => 4096,
        _ => 2048,
    };
    let max_pos = cfg.u_or(&["max_position_embeddings"], max_pos_default)?;
    let tie = cfg.b_or("tie_word_embeddings", family == F::Gemma)?;
    let (qkv_bias, out_bias) = match family {
        F::Qwen2 => (true, false),
        F::Qwen2Moe => {
            let b = cfg.b_or("qkv_bias", true)?;
            (b, false)
        }
        F::Llama | F::Qwen3 | F::Gemma => {
            let b = cfg.b_or("attention_bias", false)?;
            (b, b)
        }
        _ => (false, false),
    };
    let mlp_bias = if family == F::Llama {
        cfg.b_or("mlp_bias", false)?
    } else {
        false
    };
    let act_name = cfg.s_or(
        &["hidden_act"],
        if family == F::Gemma {
            "gelu_pytorch_tanh"
        } else {
            "silu"
        },
    )?;
    // GemmaConfig turns the legacy "gelu" of the official releases into the tanh approximation.
    let act_name = if family == F::Gemma && act_name == "gelu" {
        "gelu_pytorch_tanh"
    } else {
        act_name
    };
    let attn_dropout = cfg.p_or(&["attention_dropout"], 0.0)?;
    let resid_dropout = if family == F::Phi3 {
        cfg.p_or(&["resid_pdrop"], 0.0)?
    } else {
        0.0
    };

    // Sliding windows, per layer.
    let window = cfg.opt_u(&["sliding_window"])?.filter(|&w| w > 0);
    let layer_types: Option<Vec<String>> = match cfg.get(&["layer_types"]) {
        Some((_, Value::Array(list))) => Some(
            list.iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| cfg.err(format!("`layer_types` must list strings, got {v}")))
                })
                .collect::<Result<_, _>>()?,
        ),
        Some((_, v)) => return Err(cfg.err(format!("`layer_types` must be a list, got {v}"))),
        None => None,
    };
    let max_window_layers = cfg.u_or(&["max_window_layers"], 28)?;
    let use_sliding = cfg.b_or("use_sliding_window", false)?;
    let sliding_at = |i: u64| -> Option<u64> {
        match family {
            F::Mistral | F::Mixtral | F::Phi3 => window,
            F::Qwen2 | F::Qwen3 | F::Qwen2Moe => {
                let w = window.filter(|_| use_sliding)?;
                let sliding = match &layer_types {
                    Some(types) => types
                        .get(i as usize)
                        .is_some_and(|t| t == "sliding_attention"),
                    None if family == F::Qwen2Moe => (i + 1) % 2 == 1 && i < max_window_layers,
                    None => i >= max_window_layers,
                };
                sliding.then_some(w)
            }
            _ => None,
        }
    };

    // The MLP, per layer.
    let moe = match family {
        F::Mixtral => Some(Mlp::Moe {
            experts: cfg.req(&["num_local_experts"])?,
            top_k: cfg.req(&["num_experts_per_tok"])?,
            intermediate: cfg.req(&["intermediate_size"])?,
            shared: 0,
            shared_gate: false,
            normalize: true,
        }),
        F::Qwen2Moe => {
            let experts = cfg.u_or(&["num_experts"], 60)?;
            (experts > 0)
                .then(|| -> Result<Mlp, Error> {
                    Ok(Mlp::Moe {
                        experts,
                        top_k: cfg.req(&["num_experts_per_tok"])?,
                        intermediate: cfg.req(&["moe_intermediate_size"])?,
                        shared: cfg.req(&["shared_expert_intermediate_size"])?,
                        shared_gate: true,
                        normalize: cfg.b_or("norm_topk_prob", false)?,
                    })
                })
                .transpose()?
        }
        _ => None,
    };
    let dense = || -> Result<Mlp, Error> { Ok(Mlp::Dense(cfg.req(&["intermediate_size"])?)) };
    let sparse_step = if family == F::Qwen2Moe {
        cfg.u_or(&["decoder_sparse_step"], 1)?
    } else {
        1
    };
    let mlp_only: Vec<u64> = match cfg.get(&["mlp_only_layers"]) {
        None => Vec::new(),
        Some((_, Value::Array(list))) => list
            .iter()
            .map(|v| {
                v.as_u64().ok_or_else(|| {
                    cfg.err(format!(
                        "`mlp_only_layers` must list layer indices, got {v}"
                    ))
                })
            })
            .collect::<Result<_, _>>()?,
        Some((_, v)) => return Err(cfg.err(format!("`mlp_only_layers` must be a list, got {v}"))),
    };
    let mut variants = Vec::new();
    for i in 0..n_layers {
        let mlp = match &moe {
            Some(m)
                if family == F::Mixtral
                    || (!mlp_only.contains(&i)
                        && sparse_step > 0
                        && (i + 1) % sparse_step == 0) =>
            {
                m.clone()
            }
            _ => dense()?,
        };
        variants.push(LayerVariant {
            mlp,
            sliding_window: sliding_at(i),
        });
    }

    // Rotary embedding (partial rotary: only part of each head rotates).
    let partial = match cfg.get(&["rope_parameters"]) {
        Some((_, Value::Object(m))) => m.get("partial_rotary_factor").and_then(Value::as_f64),
        _ => None,
    }
    .or(cfg
        .get(&["partial_rotary_factor"])
        .and_then(|(_, v)| v.as_f64()))
    .unwrap_or(1.0);
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let rotary_dim = ((head_dim as f64 * partial) as u64).max(2);

    let bare = head == Resolved::Bare;
    let p = |s: &str| {
        if bare {
            s.to_string()
        } else {
            format!("model.{s}")
        }
    };
    let mut out = Vec::new();
    let embed = p("embed_tokens");
    push(&mut out, embedding(&embed, vocab, hidden));
    if family == F::Gemma {
        #[allow(clippy::cast_precision_loss)]
        let factor = (hidden as f64).sqrt();
        push(
            &mut out,
            with_note(
                LayerSpec {
                    factor: Some(factor),
                    ..layer(K::Scale, &p("embed_tokens.embed_scale"))
                },
                "Gemma's scaled word embedding: times sqrt(hidden_size)",
            ),
        );
    }
    push(
        &mut out,
        LayerSpec {
            head_dim: Some(rotary_dim),
            // Phi-3's apply_rotary_pos_emb joins the rotated and pass-through parts with torch.cat.
            concat: (family == F::Phi3).then_some(true),
            ..layer(K::Rotary, &p("rotary_emb"))
        },
    );
    let all_runs = runs(&variants);
    for (first, count, v) in &all_runs {
        let body = decoder_layer(
            cfg,
            family,
            act_name,
            DecoderAttn {
                hidden,
                heads,
                kv_heads,
                head_dim,
                qkv_bias,
                out_bias,
                dropout: attn_dropout,
                sliding_window: v.sliding_window,
            },
            &v.mlp,
            mlp_bias,
            resid_dropout,
        )?;
        push(
            &mut out,
            repeat(
                &run_name(&p("layers"), all_runs.len(), *first, *count),
                *count,
                body,
            ),
        );
    }
    push(&mut out, family_norm(family, &p("norm")));
    causal_head(&mut out, cfg, head, vocab, tie.then_some(embed.as_str()))?;
    Ok((out, max_pos))
}

/// The attention of a llama-style decoder layer.
pub(super) struct DecoderAttn {
    hidden: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    qkv_bias: bool,
    out_bias: bool,
    dropout: f64,
    sliding_window: Option<u64>,
}

pub(super) fn decoder_layer(
    cfg: &Cfg,
    family: Family,
    act_name: &str,
    a: DecoderAttn,
    mlp: &Mlp,
    mlp_bias: bool,
    resid_dropout: f64,
) -> Result<Vec<LayerSpec>, Error> {
    let mut body = Vec::new();
    push(&mut body, family_norm(family, "input_layernorm"));
    let mut attn = LayerSpec {
        heads: Some(a.heads),
        kv_heads: (a.kv_heads != a.heads).then_some(a.kv_heads),
        head_dim: (a.heads * a.head_dim != a.hidden).then_some(a.head_dim),
        causal: Some(true),
        bias: (!a.qkv_bias).then_some(false),
        out_bias: (a.out_bias != a.qkv_bias).then_some(a.out_bias),
        rotary: Some(true),
        dropout: (a.dropout > 0.0).then_some(a.dropout),
        qk_norm: (family == Family::Qwen3).then_some(true),
        sliding_window: a.sliding_window,
        // Their eager_attention_forward: softmax(.., dtype=torch.float32).to(query.dtype).
        softmax_f32: Some(true),
        ..layer(K::Attention, "self_attn")
    };
    if family == Family::Phi3 {
        attn.fused_qkv = Some(true);
        attn.note = Some("Phi-3's fused qkv_proj".into());
    }
    let prev = push(&mut body, attn);
    let prev = push_dropout(&mut body, "resid_attn_dropout", resid_dropout, prev);
    let residual1 = push(&mut body, add("residual1", "input", &prev));
    let norm2 = push(&mut body, family_norm(family, "post_attention_layernorm"));
    let prev = match mlp {
        Mlp::Dense(intermediate) if family == Family::Phi3 => {
            // Phi3MLP: one fused gate_up_proj, `chunk(2, dim=-1)` into two views of its output,
            // `up * act(gate)`.
            push(
                &mut body,
                linear("mlp.gate_up_proj", 2 * intermediate, mlp_bias),
            );
            let chunks = push(
                &mut body,
                with_note(
                    LayerSpec {
                        shape: Some(vec![
                            -1,
                            2,
                            i64::try_from(*intermediate).map_err(|_| {
                                cfg.err(format!("`intermediate_size` {intermediate} is too large"))
                            })?,
                        ]),
                        ..layer(K::Reshape, "mlp.gate_up_proj.chunk")
                    },
                    "chunk(2, dim=-1) as views: [.., 0, :] is the gate, [.., 1, :] the up states",
                ),
            );
            push(
                &mut body,
                LayerSpec {
                    dim: Some(2),
                    index: Some(0),
                    ..layer(K::Select, "mlp.gate")
                },
            );
            let act = push(
                &mut body,
                activation(cfg, "hidden_act", act_name, "mlp.activation_fn")?,
            );
            let up = push(
                &mut body,
                with_inputs(
                    LayerSpec {
                        dim: Some(2),
                        index: Some(1),
                        ..layer(K::Select, "mlp.up")
                    },
                    &[&chunks],
                ),
            );
            push(
                &mut body,
                with_inputs(layer(K::Mul, "mlp.up_mul_act"), &[&up, &act]),
            );
            push(&mut body, linear("mlp.down_proj", a.hidden, mlp_bias))
        }
        Mlp::Dense(intermediate) => {
            push(&mut body, linear("mlp.gate_proj", *intermediate, mlp_bias));
            let act = push(
                &mut body,
                activation(cfg, "hidden_act", act_name, "mlp.act_fn")?,
            );
            let up = push(
                &mut body,
                with_inputs(linear("mlp.up_proj", *intermediate, mlp_bias), &[&norm2]),
            );
            push(
                &mut body,
                with_inputs(layer(K::Mul, "mlp.gate_mul_up"), &[&act, &up]),
            );
            push(&mut body, linear("mlp.down_proj", a.hidden, mlp_bias))
        }
        Mlp::Moe {
            experts,
            top_k,
            intermediate,
            shared,
            shared_gate,
            normalize,
        } => {
            if act_name != "silu" && act_name != "swish" {
                return Err(cfg.err(format!(
                    "activation `{act_name}` in `hidden_act` is not supported for mixture-of-experts layers (their experts are SiLU-gated)"
                )));
            }
            push(
                &mut body,
                LayerSpec {
                    experts: Some(*experts),
                    top_k: Some(*top_k),
                    intermediate_size: Some(*intermediate),
                    shared_intermediate_size: (*shared > 0).then_some(*shared),
                    shared_gate: shared_gate.then_some(true),
                    normalize_topk: Some(*normalize),
                    ..layer(K::Moe, "mlp")
                },
            )
        }
    };
    let prev = push_dropout(&mut body, "resid_mlp_dropout", resid_dropout, prev);
    push(&mut body, add("residual2", &residual1, &prev));
    Ok(body)
}
