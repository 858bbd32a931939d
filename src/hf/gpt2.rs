//! GPT-2 (`GPT2LMHeadModel`, `GPT2ForSequenceClassification`, `GPT2Model`) and GPT-BigCode
//! (StarCoder, SantaCoder: `GPTBigCodeForCausalLM`, `models/gpt_bigcode/modeling_gpt_bigcode.py`),
//! GPT-2 with multi-query attention: `c_attn` projects `hidden + 2·head_dim` (one key and one
//! value head shared by every query head) when `multi_query` (default true).

use super::Resolved;
use super::config::{Cfg, Gpt2Config, layer_count, prob, required};
use super::layers::{
    activation, add, causal_head, embedding, layer, layernorm, linear, module_path, push,
    push_dropout, repeat,
};
use crate::error::Error;
use crate::spec::{LayerKind as K, LayerSpec, layer_spec};

/// Builds GPT-2 as transformers' `modeling_gpt2.py` does; returns the layers and `n_positions`.
pub(super) fn gpt2(cfg: &Cfg, head: Resolved) -> Result<(Vec<LayerSpec>, u64), Error> {
    build(cfg, head, false)
}

/// Builds GPT-BigCode as `modeling_gpt_bigcode.py` does; returns the layers and `n_positions`.
pub(super) fn gpt_bigcode(cfg: &Cfg, head: Resolved) -> Result<(Vec<LayerSpec>, u64), Error> {
    build(cfg, head, true)
}

/// GPT-2, or GPT-BigCode when `bigcode`.
fn build(cfg: &Cfg, head: Resolved, bigcode: bool) -> Result<(Vec<LayerSpec>, u64), Error> {
    let c: Gpt2Config = cfg.read()?;
    let vocab = required!(cfg, c.vocab_size)?;
    let hidden = required!(cfg, c.n_embd)?;
    let n_layers = layer_count!(cfg, c.n_layer)?;
    let heads = required!(cfg, c.n_head)?;
    let positions = c.n_positions.unwrap_or(1024);
    let inner = match c.n_inner {
        Some(n) => n,
        None => hidden
            .checked_mul(4)
            .ok_or_else(|| Error::Overflow("GPT-2's MLP width (4 × n_embd)".into()))?,
    };
    let act_name = c.activation_function.as_deref().unwrap_or(if bigcode {
        "gelu_pytorch_tanh"
    } else {
        "gelu_new"
    });
    // GPTBigCodeAttention: `kv_heads = 1 if multi_query else num_heads`.
    let kv_heads = (bigcode && c.multi_query.unwrap_or(true)).then_some(1);
    let embd_p = prob!(cfg, c.embd_pdrop, 0.1)?;
    let attn_p = prob!(cfg, c.attn_pdrop, 0.1)?;
    let resid_p = prob!(cfg, c.resid_pdrop, 0.1)?;
    let tie = cfg.tie(true);
    if c.add_cross_attention.unwrap_or(false) {
        return Err(cfg.err("`add_cross_attention = true` (GPT-2 as a decoder with cross-attention) is not supported".into()));
    }

    let p = module_path(head, "transformer");
    let mut out = Vec::new();
    let wte = push(&mut out, embedding(&p("wte"), vocab, hidden));
    push(
        &mut out,
        layer_spec! {
            num_positions: Some(positions),
            // GPTBigCodeModel registers `bias`, a [n_positions, n_positions] bool tril buffer.
            mask_buffer: bigcode.then_some(positions),
            // `inputs_embeds` and `position_embeds` are locals of GPT2Model.forward and
            // GPTBigCodeModel.forward until they return.
            model_locals: Some(true),
            ..layer(K::PositionEmbedding, &p("wpe"))
        },
    );
    let prev = p("wpe");
    push_dropout(&mut out, &p("drop"), embd_p, prev);

    let mut body = Vec::new();
    push(&mut body, layernorm("ln_1"));
    let attn = push(
        &mut body,
        layer_spec! {
            heads: Some(heads),
            kv_heads: kv_heads,
            fused_qkv: Some(true),
            causal: Some(true),
            dropout: (attn_p > 0.0).then_some(attn_p),
            note: Some(if kv_heads.is_some() {
                "c_attn (fused: all query heads, one shared key and one value head) and c_proj"
                    .into()
            } else {
                "c_attn (fused QKV) and c_proj".into()
            }),
            ..layer(K::Attention, "attn")
        },
    );
    let prev = push_dropout(&mut body, "attn.resid_dropout", resid_p, attn);
    // GPT2Block/GPTBigCodeBlock: `hidden_states = attn_output + residual`; the local
    // `attn_output` lives until the block returns, through the MLP.
    let residual1 = push(
        &mut body,
        layer_spec! {
            keep_inputs: Some(true),
            ..add("residual1", "input", &prev)
        },
    );
    push(&mut body, layernorm("ln_2"));
    push(&mut body, linear("mlp.c_fc", inner, true));
    push(
        &mut body,
        activation(cfg, "activation_function", act_name, "mlp.act")?,
    );
    let prev = push(&mut body, linear("mlp.c_proj", hidden, true));
    let prev = push_dropout(&mut body, "mlp.dropout", resid_p, prev);
    push(&mut body, add("residual2", &residual1, &prev));
    push(&mut out, repeat(&p("h"), "n_layer", n_layers, body));
    push(&mut out, layernorm(&p("ln_f")));
    causal_head(&mut out, cfg, head, vocab, tie.then_some(wte.as_str()))?;
    Ok((out, positions))
}
