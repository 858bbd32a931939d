//! diffusers' DiT-style transformers, read from their `config.json` (`_class_name`), module by
//! module in the order their `forward` runs them (diffusers 0.42):
//!
//! - `SD3Transformer2DModel` (Stable Diffusion 3, MMDiT: `models/transformers/transformer_sd3.py`,
//!   `attention.py`'s `JointTransformerBlock`, `attention_processor.py`'s
//!   `JointAttnProcessor2_0`, `normalization.py`'s `AdaLayerNormZero` and
//!   `AdaLayerNormContinuous`, `embeddings.py`'s `PatchEmbed` and
//!   `CombinedTimestepTextProjEmbeddings`), with Stable Diffusion 3.5's `qk_norm` (`RMSNorm`) and
//!   `dual_attention_layers` (`SD35AdaLayerNormZeroX` and the image-only `attn2`).
//! - `FluxTransformer2DModel` (FLUX.1: `transformer_flux.py`'s `FluxTransformerBlock`,
//!   `FluxSingleTransformerBlock`, `FluxAttnProcessor` with `attention_dispatch.py`'s native
//!   backend, `FluxPosEmbed`; `CombinedTimestepGuidanceTextProjEmbeddings`).
//!
//! The adaptive norms' modulation `norm(x) * (1 + scale[:, None]) + shift[:, None]` is written
//! out as diffusers runs it: the `[B, k·D]` projection of the conditioning is viewed as
//! `[B, 1, k·D]` and narrowed into its `k` chunks (`chunk(k, dim=1)` and `[:, None]` are views),
//! `1 + scale` is a new `[B, 1, D]` tensor (`scale` with an `offset`), the product keeps both
//! factors and the shift's sum keeps nothing.

use serde::Deserialize;

use super::config::Cfg;
use super::layers::{add, layer, linear, push, with_inputs};
use crate::error::Error;
use crate::spec::{Approximate, DimSpec, InputSpec, LayerKind as K, LayerSpec, Sizes, layer_spec};

/// `encoder_hidden_states`: the text encoders' states, `[seq, joint_attention_dim]`.
pub(super) const ENCODER_STATES: &str = "encoder_hidden_states";
/// `pooled_projections`: the pooled text embedding, `[pooled_projection_dim]`.
pub(super) const POOLED: &str = "pooled_projections";
/// The timestep's sinusoidal embedding (`Timesteps(256)`, made without gradient from the
/// timestep and cast to the model's dtype), `[256]`.
pub(super) const TIMESTEPS_PROJ: &str = "timesteps_proj";
/// The guidance scale's sinusoidal embedding (Flux with `guidance_embeds`), `[256]`.
pub(super) const GUIDANCE_PROJ: &str = "guidance_proj";
/// `Timesteps`' width in `CombinedTimestepTextProjEmbeddings` (`num_channels=256`).
const TIME_PROJ_DIM: u64 = 256;

/// The `SD3Transformer2DModel` config keys memest reads (`__init__`'s arguments); unknown keys
/// are ignored.
#[derive(Debug, Default, Deserialize)]
struct Sd3Config {
    sample_size: Option<u64>,
    patch_size: Option<u64>,
    in_channels: Option<u64>,
    num_layers: Option<u64>,
    attention_head_dim: Option<u64>,
    num_attention_heads: Option<u64>,
    joint_attention_dim: Option<u64>,
    caption_projection_dim: Option<u64>,
    pooled_projection_dim: Option<u64>,
    out_channels: Option<Option<u64>>,
    pos_embed_max_size: Option<Option<u64>>,
    dual_attention_layers: Option<Vec<u64>>,
    qk_norm: Option<Option<String>>,
}

/// A DiT's layers and the inputs it reads besides its latent.
pub(super) struct Dit {
    pub layers: Vec<LayerSpec>,
    /// The model input (the latent), after the batch.
    pub input: Vec<DimSpec>,
    /// The named inputs (`[inputs.NAME]`), in the model's dtype.
    pub inputs: std::collections::BTreeMap<String, InputSpec>,
    /// What the description says the input is.
    pub what: String,
    /// The default text length (`seq`): what diffusers' DreamBooth scripts feed the model.
    pub seq: u64,
}

fn named(entries: &[(&str, Vec<DimSpec>)]) -> std::collections::BTreeMap<String, InputSpec> {
    entries
        .iter()
        .map(|(k, shape)| {
            (
                (*k).to_string(),
                InputSpec {
                    shape: shape.clone(),
                    dtype: None,
                },
            )
        })
        .collect()
}

/// A size as a tensor dimension (`i64`), refused naming `key` past `i64::MAX`.
fn dim(cfg: &Cfg, key: &str, v: u64) -> Result<i64, Error> {
    i64::try_from(v).map_err(|_| {
        cfg.field_err(
            key,
            format!("`{key}` gives {v}, more than a tensor dimension holds"),
        )
    })
}

/// `a · b`, refused as an overflow of `what`.
fn mul(cfg: &Cfg, what: &str, a: u64, b: u64) -> Result<u64, Error> {
    a.checked_mul(b)
        .ok_or_else(|| cfg.err(format!("{what} overflows")))
}

fn reshape(name: &str, input: &str, shape: &[i64]) -> LayerSpec {
    layer_spec! {
        shape: Some(shape.to_vec()),
        ..with_inputs(layer(K::Reshape, name), &[input])
    }
}

fn narrow(name: &str, input: &str, dim: i64, start: i64, length: u64) -> LayerSpec {
    layer_spec! {
        dim: Some(dim),
        start: Some(start),
        length: Some(length),
        ..with_inputs(layer(K::Narrow, name), &[input])
    }
}

fn transpose(name: &str, input: &str) -> LayerSpec {
    layer_spec! {
        dims: Some(vec![1, 2]),
        ..with_inputs(layer(K::Transpose, name), &[input])
    }
}

/// `nn.LayerNorm(dim, elementwise_affine=False)`.
fn plain_norm(name: &str, input: &str) -> LayerSpec {
    layer_spec! {
        affine: Some(false),
        ..with_inputs(layer(K::LayerNorm, name), &[input])
    }
}

/// The builder's state: the layers so far and the model's sizes.
struct Builder<'a> {
    cfg: &'a Cfg<'a>,
    out: Vec<LayerSpec>,
    /// The model width (`num_attention_heads · attention_head_dim`).
    dim: u64,
    heads: u64,
    head_dim: u64,
    /// The conditioning embedding every adaptive norm reads (`temb`).
    temb: String,
    /// SD3.5's `qk_norm = "rms_norm"`: diffusers' `RMSNorm` on each head's queries and keys
    /// (`T5LayerNorm`'s computation: `rmsnorm` with `style = "t5"`).
    qk_norm: bool,
}

impl Builder<'_> {
    fn push(&mut self, l: LayerSpec) -> String {
        push(&mut self.out, l)
    }

    /// `silu(temb)` then `linear` to `chunks · dim`, viewed as `[B, 1, chunks · dim]`: returns
    /// that view's name, whose chunk `i` is `narrow(-1, i · dim, dim)`.
    fn modulation(&mut self, p: &str, chunks: u64) -> Result<String, Error> {
        let temb = self.temb.clone();
        let act = self.push(with_inputs(layer(K::Silu, &format!("{p}.silu")), &[&temb]));
        let width = mul(self.cfg, "the modulation width", chunks, self.dim)?;
        let lin = self.push(with_inputs(
            linear(&format!("{p}.linear"), width, true),
            &[&act],
        ));
        let w = dim(self.cfg, "num_attention_heads", width)?;
        Ok(self.push(reshape(&format!("{p}.emb"), &lin, &[1, w])))
    }

    /// Chunk `i` of a modulation view.
    fn chunk(&mut self, p: &str, what: &str, emb: &str, i: u64) -> Result<String, Error> {
        let start = mul(self.cfg, "the modulation width", i, self.dim)?;
        let start = dim(self.cfg, "num_attention_heads", start)?;
        Ok(self.push(narrow(&format!("{p}.{what}"), emb, -1, start, self.dim)))
    }

    /// `x * (1 + scale) + shift` of a normalized `x`.
    fn modulate(&mut self, p: &str, x: &str, scale: &str, shift: &str) -> String {
        let one = self.push(layer_spec! {
            offset: Some(1.0),
            ..with_inputs(layer(K::Scale, &format!("{p}.one_plus_scale")), &[scale])
        });
        let m = self.push(with_inputs(
            layer(K::Mul, &format!("{p}.mul_scale")),
            &[x, &one],
        ));
        self.push(add(&format!("{p}.add_shift"), &m, shift))
    }

    /// `gate * y` then `x + ..`.
    fn gated_residual(&mut self, p: &str, x: &str, gate: &str, y: &str) -> String {
        let g = self.push(with_inputs(layer(K::Mul, &format!("{p}.gate")), &[gate, y]));
        self.push(add(&format!("{p}.residual"), x, &g))
    }

    /// `AdaLayerNormZero`: `linear(silu(temb))` to `6·dim`, chunked into shift, scale, gate of
    /// the attention and of the MLP; `norm(x) * (1 + scale_msa) + shift_msa`. Returns the
    /// modulated input and the view the other chunks come from.
    fn ada_norm_zero(&mut self, p: &str, x: &str) -> Result<(String, String), Error> {
        let emb = self.modulation(p, 6)?;
        let shift = self.chunk(p, "shift_msa", &emb, 0)?;
        let scale = self.chunk(p, "scale_msa", &emb, 1)?;
        let n = self.push(plain_norm(&format!("{p}.norm"), x));
        Ok((self.modulate(p, &n, &scale, &shift), emb))
    }

    /// `AdaLayerNormContinuous(dim, dim, elementwise_affine=False)`: `linear(silu(temb))` to
    /// `2·dim`, chunked into scale and shift; `norm(x) * (1 + scale) + shift`.
    fn ada_norm_continuous(&mut self, p: &str, x: &str) -> Result<String, Error> {
        let emb = self.modulation(p, 2)?;
        let scale = self.chunk(p, "scale", &emb, 0)?;
        let shift = self.chunk(p, "shift", &emb, 1)?;
        let n = self.push(plain_norm(&format!("{p}.norm"), x));
        Ok(self.modulate(p, &n, &scale, &shift))
    }

    /// `FeedForward(dim, dim_out=dim, activation_fn="gelu-approximate")`: `net.0.proj` to
    /// `4·dim`, tanh GELU, `net.2` back (its dropouts are `p = 0`).
    fn feed_forward(&mut self, p: &str, x: &str) -> Result<String, Error> {
        let inner = mul(self.cfg, "the feed-forward width", 4, self.dim)?;
        let h = self.push(with_inputs(
            linear(&format!("{p}.net.0.proj"), inner, true),
            &[x],
        ));
        let g = self.push(layer_spec! {
            approximate: Some(Approximate::Tanh),
            ..with_inputs(layer(K::Gelu, &format!("{p}.net.0.gelu")), &[&h])
        });
        Ok(self.push(with_inputs(
            linear(&format!("{p}.net.2"), self.dim, true),
            &[&g],
        )))
    }

    /// Q, K or V of one stream: `linear`, `view(B, -1, heads, head_dim)`, `transpose(1, 2)`.
    fn heads(&mut self, p: &str, proj: &str, x: &str) -> Result<String, Error> {
        let inner = mul(self.cfg, "the attention width", self.heads, self.head_dim)?;
        let l = self.push(with_inputs(
            linear(&format!("{p}.{proj}"), inner, true),
            &[x],
        ));
        let (h, d) = (
            dim(self.cfg, "num_attention_heads", self.heads)?,
            dim(self.cfg, "attention_head_dim", self.head_dim)?,
        );
        let v = self.push(reshape(&format!("{p}.{proj}.view"), &l, &[-1, h, d]));
        Ok(self.push(transpose(&format!("{p}.{proj}.heads"), &v)))
    }

    /// With `qk_norm`, diffusers' `RMSNorm(head_dim)` on the queries and keys (`names`).
    fn qk_norms(&mut self, p: &str, qkv: &mut [String], names: [&str; 2]) {
        if !self.qk_norm {
            return;
        }
        for (t, name) in qkv.iter_mut().zip(names) {
            *t = self.push(layer_spec! {
                style: Some(crate::spec::Style::T5),
                ..with_inputs(layer(K::RmsNorm, &format!("{p}.{name}")), &[t.as_str()])
            });
        }
    }

    /// SD3.5's second attention (`attn2`, `JointAttnProcessor2_0` without text): Q, K, V of
    /// the image stream, `view(B, -1, heads, head_dim)`, the optional norms, SDPA on the
    /// `transpose(1, 2)` views (`sdpa` with `dim = 2`: the output transposed back is laid out
    /// `[B, S, heads, head_dim]`, so the `reshape` that merges the heads is a view), `to_out.0`.
    fn self_attention(&mut self, p: &str, x: &str) -> Result<String, Error> {
        let inner = mul(self.cfg, "the attention width", self.heads, self.head_dim)?;
        let (h, d) = (
            dim(self.cfg, "num_attention_heads", self.heads)?,
            dim(self.cfg, "attention_head_dim", self.head_dim)?,
        );
        let mut qkv = Vec::new();
        for proj in ["to_q", "to_k", "to_v"] {
            let l = self.push(with_inputs(
                linear(&format!("{p}.{proj}"), inner, true),
                &[x],
            ));
            qkv.push(self.push(reshape(&format!("{p}.{proj}.view"), &l, &[-1, h, d])));
        }
        self.qk_norms(p, &mut qkv, ["norm_q", "norm_k"]);
        let o = self.push(layer_spec! {
            dim: Some(2),
            ..with_inputs(
                layer(K::Sdpa, &format!("{p}.sdpa")),
                &[&qkv[0], &qkv[1], &qkv[2]],
            )
        });
        let inner_d = dim(self.cfg, "num_attention_heads", inner)?;
        let merged = self.push(reshape(&format!("{p}.merged"), &o, &[-1, inner_d]));
        Ok(self.push(with_inputs(
            linear(&format!("{p}.to_out.0"), self.dim, true),
            &[&merged],
        )))
    }

    /// `JointAttnProcessor2_0` on the image stream `x` (`n` tokens) and the text stream `c`:
    /// Q, K, V of each, joined along the sequence (image first: `torch.cat(.., dim=2)`, new
    /// contiguous tensors), SDPA, `transpose(1, 2).reshape(B, -1, inner)` (a copy), split back
    /// into the two streams (views), `to_add_out` on the text part (unless
    /// `context_pre_only`), `to_out.0` on the image part. Returns the image and text outputs.
    fn joint_attention(
        &mut self,
        p: &str,
        x: &str,
        c: &str,
        n: u64,
        context_pre_only: bool,
    ) -> Result<(String, Option<String>), Error> {
        let mut img = Vec::new();
        for proj in ["to_q", "to_k", "to_v"] {
            img.push(self.heads(p, proj, x)?);
        }
        self.qk_norms(p, &mut img, ["norm_q", "norm_k"]);
        let mut txt = Vec::new();
        for proj in ["add_q_proj", "add_k_proj", "add_v_proj"] {
            txt.push(self.heads(p, proj, c)?);
        }
        self.qk_norms(p, &mut txt, ["norm_added_q", "norm_added_k"]);
        let mut qkv = Vec::new();
        for (i, what) in ["query", "key", "value"].iter().enumerate() {
            qkv.push(self.push(layer_spec! {
                dim: Some(2),
                ..with_inputs(
                    layer(K::Concat, &format!("{p}.cat_{what}")),
                    &[&img[i], &txt[i]],
                )
            }));
        }
        let o = self.push(with_inputs(
            layer(K::Sdpa, &format!("{p}.sdpa")),
            &[&qkv[0], &qkv[1], &qkv[2]],
        ));
        let t = self.push(transpose(&format!("{p}.merge_heads"), &o));
        let inner = mul(self.cfg, "the attention width", self.heads, self.head_dim)?;
        let inner_d = dim(self.cfg, "num_attention_heads", inner)?;
        let merged = self.push(reshape(&format!("{p}.merged"), &t, &[-1, inner_d]));
        let seq = self.push(layer_spec! {
            dim: Some(1),
            start: Some(dim(self.cfg, "sample_size", n)?),
            ..with_inputs(layer(K::Narrow, &format!("{p}.context_part")), &[&merged])
        });
        let ctx = if context_pre_only {
            None
        } else {
            Some(self.push(with_inputs(
                linear(&format!("{p}.to_add_out"), self.dim, true),
                &[&seq],
            )))
        };
        let part = self.push(narrow(&format!("{p}.sample_part"), &merged, 1, 0, n));
        let out = self.push(with_inputs(
            linear(&format!("{p}.to_out.0"), self.dim, true),
            &[&part],
        ));
        Ok((out, ctx))
    }

    /// `JointTransformerBlock`: returns the image and (unless `context_pre_only`) text
    /// streams.
    fn joint_block(
        &mut self,
        p: &str,
        x: &str,
        c: &str,
        n: u64,
        context_pre_only: bool,
        dual: bool,
    ) -> Result<(String, Option<String>), Error> {
        // `SD35AdaLayerNormZeroX` (`use_dual_attention`): nine chunks, the same normalized input
        // modulated a second time (`scale_msa2`, `shift_msa2`) for `attn2`.
        let (nx, emb, nx2) = if dual {
            let p1 = format!("{p}.norm1");
            let emb = self.modulation(&p1, 9)?;
            let shift = self.chunk(&p1, "shift_msa", &emb, 0)?;
            let scale = self.chunk(&p1, "scale_msa", &emb, 1)?;
            let n = self.push(plain_norm(&format!("{p1}.norm"), x));
            let m = self.modulate(&p1, &n, &scale, &shift);
            let shift2 = self.chunk(&p1, "shift_msa2", &emb, 6)?;
            let scale2 = self.chunk(&p1, "scale_msa2", &emb, 7)?;
            let m2 = self.modulate(&format!("{p1}.2"), &n, &scale2, &shift2);
            (m, emb, Some(m2))
        } else {
            let (m, emb) = self.ada_norm_zero(&format!("{p}.norm1"), x)?;
            (m, emb, None)
        };
        let (nc, c_emb) = if context_pre_only {
            (
                self.ada_norm_continuous(&format!("{p}.norm1_context"), c)?,
                None,
            )
        } else {
            let (nc, e) = self.ada_norm_zero(&format!("{p}.norm1_context"), c)?;
            (nc, Some(e))
        };
        let (a, ca) = self.joint_attention(&format!("{p}.attn"), &nx, &nc, n, context_pre_only)?;
        let n1 = format!("{p}.norm1");
        let gate = self.chunk(&n1, "gate_msa", &emb, 2)?;
        let mut x1 = self.gated_residual(&format!("{p}.attn_out"), x, &gate, &a);
        if let Some(nx2) = nx2 {
            let a2 = self.self_attention(&format!("{p}.attn2"), &nx2)?;
            let gate2 = self.chunk(&n1, "gate_msa2", &emb, 8)?;
            x1 = self.gated_residual(&format!("{p}.attn2_out"), &x1, &gate2, &a2);
        }
        let x2 = self.ff_half(p, false, &x1, &emb)?;
        let (Some(ca), Some(c_emb)) = (ca, c_emb) else {
            return Ok((x2, None));
        };
        let n1 = format!("{p}.norm1_context");
        let gate = self.chunk(&n1, "gate_msa", &c_emb, 2)?;
        let c1 = self.gated_residual(&format!("{p}.context_attn_out"), c, &gate, &ca);
        let c2 = self.ff_half(p, true, &c1, &c_emb)?;
        Ok((x2, Some(c2)))
    }

    /// The feed-forward half of a joint block on one stream (`JointTransformerBlock`,
    /// `FluxTransformerBlock`): `shift_mlp`, `scale_mlp` and `gate_mlp` (chunks 3, 4 and 5 of the
    /// stream's `AdaLayerNormZero` embedding `emb`), `norm2` (no affine) of `x1`, the modulation,
    /// `ff` and the gated residual onto `x1`. `context`: the text stream, whose modules diffusers
    /// names `norm1_context`, `norm2_context`, `ff_context`. Returns the stream `[B, tokens, dim]`.
    fn ff_half(&mut self, p: &str, context: bool, x1: &str, emb: &str) -> Result<String, Error> {
        let sfx = if context { "_context" } else { "" };
        let n1 = format!("{p}.norm1{sfx}");
        let shift = self.chunk(&n1, "shift_mlp", emb, 3)?;
        let scale = self.chunk(&n1, "scale_mlp", emb, 4)?;
        let gate = self.chunk(&n1, "gate_mlp", emb, 5)?;
        let norm2 = format!("{p}.norm2{sfx}");
        let n2 = self.push(plain_norm(&norm2, x1));
        let m = self.modulate(&norm2, &n2, &scale, &shift);
        let ff = self.feed_forward(&format!("{p}.ff{sfx}"), &m)?;
        let out = if context { "context_ff_out" } else { "ff_out" };
        Ok(self.gated_residual(&format!("{p}.{out}"), x1, &gate, &ff))
    }

    /// `TimestepEmbedding`/`PixArtAlphaTextProjection`: `linear_1`, SiLU, `linear_2`.
    fn embedder(&mut self, p: &str, act: &str, input: &str) -> String {
        let l1 = self.push(with_inputs(
            linear(&format!("{p}.linear_1"), self.dim, true),
            &[input],
        ));
        let a = self.push(with_inputs(layer(K::Silu, &format!("{p}.{act}")), &[&l1]));
        self.push(with_inputs(
            linear(&format!("{p}.linear_2"), self.dim, true),
            &[&a],
        ))
    }
}

/// The latent `(height, width)` from `--image` pixels (÷ 8, Stable Diffusion 3's and Flux's VAE
/// scale factor), `sample_size` square when `None`.
fn latent_size(image: Option<(u64, u64)>, sample_size: u64) -> (u64, u64) {
    image.unwrap_or((sample_size, sample_size))
}

/// The widths SD3's and Flux's configs share: `attention_head_dim`, `num_attention_heads`,
/// `joint_attention_dim` and `pooled_projection_dim`, in that order, each the config's value
/// or the model's diffusers default (`SD3Transformer2DModel`: 64, 18, 4096, 2048;
/// `FluxTransformer2DModel`: 128, 24, 4096, 768), and each checked positive.
///
/// # Errors
/// [`Error::Hf`] naming the first field that is 0.
fn attention_dims(
    cfg: &Cfg,
    given: [Option<u64>; 4],
    defaults: [u64; 4],
) -> Result<[u64; 4], Error> {
    const KEYS: [&str; 4] = [
        "attention_head_dim",
        "num_attention_heads",
        "joint_attention_dim",
        "pooled_projection_dim",
    ];
    let mut out = [0; 4];
    for (i, key) in KEYS.into_iter().enumerate() {
        out[i] = cfg.required(key, Some(given[i].unwrap_or(defaults[i])))?;
    }
    Ok(out)
}

/// Builds `SD3Transformer2DModel` for a latent of `latent` `(height, width)` (`sample_size`
/// when `None`).
#[allow(clippy::too_many_lines)] // the model's forward, in order
pub(super) fn sd3(cfg: &Cfg, latent: Option<(u64, u64)>) -> Result<Dit, Error> {
    let c: Sd3Config = cfg.read()?;
    let refuse = |key: &str, what: &str| {
        Err(cfg.field_err(key, format!("`{key}`: {what} is not supported yet")))
    };
    let qk_norm = match c.qk_norm.as_ref().and_then(Option::as_deref) {
        None => false,
        Some("rms_norm") => true,
        Some(q) => {
            return refuse(
                "qk_norm",
                &format!("\"{q}\" (supported: \"rms_norm\", null)"),
            );
        }
    };
    let dual = c.dual_attention_layers.clone().unwrap_or_default();
    let sample = cfg.required("sample_size", Some(c.sample_size.unwrap_or(128)))?;
    let patch = cfg.required("patch_size", Some(c.patch_size.unwrap_or(2)))?;
    let in_ch = cfg.required("in_channels", Some(c.in_channels.unwrap_or(16)))?;
    let layers = cfg.layers("num_layers", Some(c.num_layers.unwrap_or(18)))?;
    let [head_dim, heads, joint, pooled] = attention_dims(
        cfg,
        [
            c.attention_head_dim,
            c.num_attention_heads,
            c.joint_attention_dim,
            c.pooled_projection_dim,
        ],
        [64, 18, 4096, 2048],
    )?;
    let out_ch = match c.out_channels {
        Some(Some(o)) => cfg.required("out_channels", Some(o))?,
        Some(None) => in_ch,
        None => 16,
    };
    let inner = mul(cfg, "the model width", heads, head_dim)?;
    let caption = cfg.required(
        "caption_projection_dim",
        Some(c.caption_projection_dim.unwrap_or(1152)),
    )?;
    if caption != inner {
        return Err(cfg.field_err(
            "caption_projection_dim",
            format!(
                "`caption_projection_dim` = {caption} differs from the model width {inner} (num_attention_heads · attention_head_dim): the text stream would not fit the blocks"
            ),
        ));
    }
    let (h, w) = latent_size(latent, sample);
    if !h.is_multiple_of(patch) || !w.is_multiple_of(patch) {
        return Err(cfg.field_err(
            "patch_size",
            format!("a {h}×{w} latent is not divisible into {patch}×{patch} patches"),
        ));
    }
    let (hp, wp) = (h / patch, w / patch);
    let n = mul(cfg, "the token count", hp, wp)?;
    // `PatchEmbed(pos_embed_max_size=..)`: a float buffer of `max²` positions, cropped to the
    // latent's patches around the centre; without one, a `sample_size²` table.
    let max = match c.pos_embed_max_size {
        None => Some(96),
        Some(m) => m,
    };
    let table_rows = match max {
        Some(m) => {
            let m = cfg.required("pos_embed_max_size", Some(m))?;
            if hp > m || wp > m {
                return Err(cfg.field_err(
                    "pos_embed_max_size",
                    format!(
                        "a {hp}×{wp}-patch latent exceeds `pos_embed_max_size` = {m} (diffusers refuses it)"
                    ),
                ));
            }
            mul(cfg, "the position table", m, m)?
        }
        None => {
            if (hp, wp) != (sample / patch, sample / patch) {
                return refuse(
                    "pos_embed_max_size",
                    "null with a latent other than `sample_size`",
                );
            }
            n
        }
    };
    for (key, v) in [
        ("sample_size", h),
        ("sample_size", w),
        ("patch_size", patch),
    ] {
        dim(cfg, key, v)?;
    }
    let mut b = Builder {
        cfg,
        out: Vec::new(),
        dim: inner,
        heads,
        head_dim,
        temb: String::new(),
        qk_norm,
    };
    let d = dim(cfg, "num_attention_heads", inner)?;
    // pos_embed: `proj` (a patch×patch conv), `flatten(2).transpose(1, 2)`, plus the cropped
    // position table (`(latent + pos_embed).to(latent.dtype)`).
    b.push(layer_spec! {
        out_channels: Some(inner),
        kernel: Some(Sizes(vec![patch])),
        stride: Some(Sizes(vec![patch])),
        ..with_inputs(layer(K::Conv2d, "pos_embed.proj"), &["input"])
    });
    b.push(layer_spec! {
        start_dim: Some(2),
        ..layer(K::Flatten, "pos_embed.flatten")
    });
    b.push(transpose("pos_embed.transpose", "pos_embed.flatten"));
    let x = b.push(layer_spec! {
        shape: Some(vec![dim(cfg, "sample_size", n)?, d]),
        buffer: Some(vec![1, dim(cfg, "pos_embed_max_size", table_rows)?, d]),
        ..layer(K::Parameter, "pos_embed.pos_embed")
    });
    // time_text_embed: the timestep's embedding plus the pooled text's.
    let t = b.embedder("time_text_embed.timestep_embedder", "act", TIMESTEPS_PROJ);
    let pe = b.embedder("time_text_embed.text_embedder", "act_1", POOLED);
    b.temb = b.push(add("time_text_embed", &t, &pe));
    let mut ctx = b.push(with_inputs(
        linear("context_embedder", caption, true),
        &[ENCODER_STATES],
    ));
    let mut x = x;
    for i in 0..layers {
        let last = i + 1 == layers;
        let (xo, co) = b.joint_block(
            &format!("transformer_blocks.{i}"),
            &x,
            &ctx,
            n,
            last,
            dual.contains(&i),
        )?;
        x = xo;
        if let Some(co) = co {
            ctx = co;
        }
    }
    let nx = b.ada_norm_continuous("norm_out", &x)?;
    let pp = mul(cfg, "the output width", patch * patch, out_ch)?;
    let proj = b.push(with_inputs(linear("proj_out", pp, true), &[&nx]));
    // Unpatchify: `reshape(B, h, w, p, p, c)`, `einsum("nhwpqc->nchpwq")` (a permuted view),
    // `reshape(B, c, h·p, w·p)` (a copy).
    let (hp_d, wp_d, p_d, c_d) = (
        dim(cfg, "sample_size", hp)?,
        dim(cfg, "sample_size", wp)?,
        dim(cfg, "patch_size", patch)?,
        dim(cfg, "out_channels", out_ch)?,
    );
    b.push(reshape("unpatchify", &proj, &[hp_d, wp_d, p_d, p_d, c_d]));
    b.push(layer_spec! {
        dims: Some(vec![0, 5, 1, 3, 2, 4]),
        ..layer(K::Permute, "unpatchify.einsum")
    });
    let (h_d, w_d) = (dim(cfg, "sample_size", h)?, dim(cfg, "sample_size", w)?);
    b.push(layer_spec! {
        shape: Some(vec![c_d, h_d, w_d]),
        ..layer(K::Reshape, "unpatchify.output")
    });
    Ok(Dit {
        layers: b.out,
        input: vec![DimSpec::Fixed(in_ch), DimSpec::Fixed(h), DimSpec::Fixed(w)],
        inputs: named(&[
            (ENCODER_STATES, vec![DimSpec::Seq, DimSpec::Fixed(joint)]),
            (POOLED, vec![DimSpec::Fixed(pooled)]),
            (TIMESTEPS_PROJ, vec![DimSpec::Fixed(TIME_PROJ_DIM)]),
        ]),
        what: format!("the velocity prediction for a latent of [{in_ch}, {h}, {w}]"),
        // `train_dreambooth_sd3.py`: CLIP's 77 tokens joined to T5's (`max_sequence_length` 77).
        seq: 154,
    })
}

/// The `FluxTransformer2DModel` config keys memest reads (`__init__`'s arguments); unknown keys
/// are ignored.
#[derive(Debug, Default, Deserialize)]
struct FluxConfig {
    patch_size: Option<u64>,
    in_channels: Option<u64>,
    out_channels: Option<Option<u64>>,
    num_layers: Option<u64>,
    num_single_layers: Option<u64>,
    attention_head_dim: Option<u64>,
    num_attention_heads: Option<u64>,
    joint_attention_dim: Option<u64>,
    pooled_projection_dim: Option<u64>,
    guidance_embeds: Option<bool>,
    axes_dims_rope: Option<Vec<u64>>,
}

impl Builder<'_> {
    /// One stream's Q, K or V in `FluxAttnProcessor`: `linear`, `unflatten(-1, (-1, head_dim))`
    /// (a view, `[B, S, heads, head_dim]`).
    fn flux_proj(&mut self, p: &str, proj: &str, x: &str) -> Result<String, Error> {
        let inner = mul(self.cfg, "the attention width", self.heads, self.head_dim)?;
        let l = self.push(with_inputs(
            linear(&format!("{p}.{proj}"), inner, true),
            &[x],
        ));
        let (h, d) = (
            dim(self.cfg, "num_attention_heads", self.heads)?,
            dim(self.cfg, "attention_head_dim", self.head_dim)?,
        );
        Ok(self.push(reshape(&format!("{p}.{proj}.unflatten"), &l, &[-1, h, d])))
    }

    /// `torch.nn.RMSNorm(head_dim)` on `[B, S, heads, head_dim]`.
    fn flux_norm(&mut self, name: &str, x: &str) -> String {
        self.push(layer_spec! {
            style: Some(crate::spec::Style::Torch),
            ..with_inputs(layer(K::RmsNorm, name), &[x])
        })
    }

    /// `FluxAttnProcessor` up to the joined heads: Q, K, V of the image stream `x` (and of the
    /// text stream `c` in a double block: `add_*_proj`, joined in front, `torch.cat(.., dim=1)`),
    /// RMS-normalized Q and K, rotary, SDPA through `dispatch_attention_fn` (heads-first
    /// views), `flatten(2, 3)`. Returns `[B, S, inner]`.
    fn flux_attention(&mut self, p: &str, x: &str, c: Option<&str>) -> Result<String, Error> {
        let mut img = Vec::new();
        for proj in ["to_q", "to_k", "to_v"] {
            img.push(self.flux_proj(p, proj, x)?);
        }
        let mut txt = Vec::new();
        if let Some(c) = c {
            for proj in ["add_q_proj", "add_k_proj", "add_v_proj"] {
                txt.push(self.flux_proj(p, proj, c)?);
            }
        }
        img[0] = self.flux_norm(&format!("{p}.norm_q"), &img[0]);
        img[1] = self.flux_norm(&format!("{p}.norm_k"), &img[1]);
        let qkv = if txt.is_empty() {
            img
        } else {
            txt[0] = self.flux_norm(&format!("{p}.norm_added_q"), &txt[0]);
            txt[1] = self.flux_norm(&format!("{p}.norm_added_k"), &txt[1]);
            let mut joined = Vec::new();
            for (i, what) in ["query", "key", "value"].iter().enumerate() {
                joined.push(self.push(with_inputs(
                    layer(K::Concat, &format!("{p}.cat_{what}")),
                    &[&txt[i], &img[i]],
                )));
            }
            joined
        };
        let o = self.push(layer_spec! {
            dim: Some(2),
            rotary: Some(true),
            ..with_inputs(
                layer(K::Sdpa, &format!("{p}.sdpa")),
                &[&qkv[0], &qkv[1], &qkv[2]],
            )
        });
        let inner = mul(self.cfg, "the attention width", self.heads, self.head_dim)?;
        let inner_d = dim(self.cfg, "num_attention_heads", inner)?;
        Ok(self.push(reshape(&format!("{p}.flatten"), &o, &[-1, inner_d])))
    }

    /// The text part `[:, :-n]` and the image part `[:, -n:]` of a joined sequence (views).
    fn split(&mut self, p: &str, x: &str, n: i64) -> (String, String) {
        let txt = self.push(layer_spec! {
            dim: Some(1),
            end: Some(-n),
            ..with_inputs(layer(K::Narrow, &format!("{p}.text_part")), &[x])
        });
        let img = self.push(layer_spec! {
            dim: Some(1),
            start: Some(-n),
            ..with_inputs(layer(K::Narrow, &format!("{p}.image_part")), &[x])
        });
        (txt, img)
    }

    /// `FluxTransformerBlock`: returns the image and text streams.
    fn flux_double(
        &mut self,
        p: &str,
        x: &str,
        c: &str,
        n: i64,
    ) -> Result<(String, String), Error> {
        let (nx, emb) = self.ada_norm_zero(&format!("{p}.norm1"), x)?;
        let (nc, c_emb) = self.ada_norm_zero(&format!("{p}.norm1_context"), c)?;
        let a = self.flux_attention(&format!("{p}.attn"), &nx, Some(&nc))?;
        let (ta, ia) = self.split(&format!("{p}.attn"), &a, n);
        // `to_out[0](hidden_states.contiguous())`, `to_add_out(encoder_hidden_states
        // .contiguous())`: linear copies the strided parts as `.contiguous()` does.
        let out = self.push(with_inputs(
            linear(&format!("{p}.attn.to_out.0"), self.dim, true),
            &[&ia],
        ));
        let ctx = self.push(with_inputs(
            linear(&format!("{p}.attn.to_add_out"), self.dim, true),
            &[&ta],
        ));
        let n1 = format!("{p}.norm1");
        let gate = self.chunk(&n1, "gate_msa", &emb, 2)?;
        let x1 = self.gated_residual(&format!("{p}.attn_out"), x, &gate, &out);
        let x2 = self.ff_half(p, false, &x1, &emb)?;
        let n1 = format!("{p}.norm1_context");
        let gate = self.chunk(&n1, "gate_msa", &c_emb, 2)?;
        let c1 = self.gated_residual(&format!("{p}.context_attn_out"), c, &gate, &ctx);
        let c2 = self.ff_half(p, true, &c1, &c_emb)?;
        Ok((x2, c2))
    }

    /// `FluxSingleTransformerBlock`: the text and image streams joined (`torch.cat(.., dim=1)`),
    /// `AdaLayerNormZeroSingle`, the MLP branch (`proj_mlp` to `4·dim`, tanh GELU) and the
    /// attention branch (no output projection) joined along the features, `proj_out`, the
    /// gated residual, and the two streams split again (views). Returns them.
    fn flux_single(
        &mut self,
        p: &str,
        x: &str,
        c: &str,
        n: i64,
    ) -> Result<(String, String), Error> {
        let hs = self.push(layer_spec! {
            dim: Some(1),
            ..with_inputs(layer(K::Concat, &format!("{p}.cat")), &[c, x])
        });
        let emb = self.modulation(&format!("{p}.norm"), 3)?;
        let shift = self.chunk(&format!("{p}.norm"), "shift_msa", &emb, 0)?;
        let scale = self.chunk(&format!("{p}.norm"), "scale_msa", &emb, 1)?;
        let gate = self.chunk(&format!("{p}.norm"), "gate_msa", &emb, 2)?;
        let nrm = self.push(plain_norm(&format!("{p}.norm.norm"), &hs));
        let m = self.modulate(&format!("{p}.norm"), &nrm, &scale, &shift);
        let mlp_w = mul(self.cfg, "the MLP width", 4, self.dim)?;
        let mlp = self.push(with_inputs(
            linear(&format!("{p}.proj_mlp"), mlp_w, true),
            &[&m],
        ));
        let act = self.push(layer_spec! {
            approximate: Some(Approximate::Tanh),
            ..with_inputs(layer(K::Gelu, &format!("{p}.act_mlp")), &[&mlp])
        });
        let a = self.flux_attention(&format!("{p}.attn"), &m, None)?;
        let joined = self.push(layer_spec! {
            dim: Some(2),
            ..with_inputs(layer(K::Concat, &format!("{p}.cat_mlp")), &[&a, &act])
        });
        let proj = self.push(with_inputs(
            linear(&format!("{p}.proj_out"), self.dim, true),
            &[&joined],
        ));
        let out = self.gated_residual(&format!("{p}.out"), &hs, &gate, &proj);
        let (t, i) = self.split(p, &out, n);
        Ok((i, t))
    }
}

/// Builds `FluxTransformer2DModel` for a VAE latent of `latent` `(height, width)` (1024 × 1024
/// pixels, a 128 × 128 latent, when `None`): the pipeline packs its 2 × 2 patches into
/// `(h/2)·(w/2)` tokens of `in_channels` (`_pack_latents`, outside the model).
#[allow(clippy::too_many_lines)] // the model's forward, in order
pub(super) fn flux(cfg: &Cfg, latent: Option<(u64, u64)>) -> Result<Dit, Error> {
    let c: FluxConfig = cfg.read()?;
    let patch = cfg.required("patch_size", Some(c.patch_size.unwrap_or(1)))?;
    let in_ch = cfg.required("in_channels", Some(c.in_channels.unwrap_or(64)))?;
    let out_ch = match c.out_channels {
        Some(Some(o)) => cfg.required("out_channels", Some(o))?,
        _ => in_ch,
    };
    let layers = cfg.layers("num_layers", Some(c.num_layers.unwrap_or(19)))?;
    let singles = match c.num_single_layers {
        Some(0) => 0,
        v => cfg.layers("num_single_layers", Some(v.unwrap_or(38)))?,
    };
    let [head_dim, heads, joint, pooled] = attention_dims(
        cfg,
        [
            c.attention_head_dim,
            c.num_attention_heads,
            c.joint_attention_dim,
            c.pooled_projection_dim,
        ],
        [128, 24, 4096, 768],
    )?;
    let guidance = c.guidance_embeds.unwrap_or(false);
    let axes = c.axes_dims_rope.clone().unwrap_or_else(|| vec![16, 56, 56]);
    if axes.iter().sum::<u64>() != head_dim || axes.iter().any(|a| !a.is_multiple_of(2)) {
        return Err(cfg.field_err(
            "axes_dims_rope",
            format!(
                "`axes_dims_rope` {axes:?} must be even sizes adding up to `attention_head_dim` = {head_dim}"
            ),
        ));
    }
    let (h, w) = latent.unwrap_or((128, 128));
    if !h.is_multiple_of(2) || !w.is_multiple_of(2) {
        return Err(Error::setting(
            crate::error::SettingKey::Image,
            format!(
                "a {h}×{w} latent cannot be packed into 2×2 patches: Flux's image sides must be multiples of 16 pixels"
            ),
        ));
    }
    let n = mul(cfg, "the token count", h / 2, w / 2)?;
    let n_d = dim(cfg, "in_channels", n)?;
    let inner = mul(cfg, "the model width", heads, head_dim)?;
    let mut b = Builder {
        cfg,
        out: Vec::new(),
        dim: inner,
        heads,
        head_dim,
        temb: String::new(),
        qk_norm: false,
    };
    let mut x = b.push(with_inputs(linear("x_embedder", inner, true), &["input"]));
    // time_text_embed: the timestep's (and guidance's) embedding plus the pooled text's.
    let t = b.embedder("time_text_embed.timestep_embedder", "act", TIMESTEPS_PROJ);
    let t = if guidance {
        let g = b.embedder("time_text_embed.guidance_embedder", "act", GUIDANCE_PROJ);
        b.push(add("time_text_embed.time_guidance", &t, &g))
    } else {
        t
    };
    let pe = b.embedder("time_text_embed.text_embedder", "act_1", POOLED);
    b.temb = b.push(add("time_text_embed", &t, &pe));
    let mut ctx = b.push(with_inputs(
        linear("context_embedder", inner, true),
        &[ENCODER_STATES],
    ));
    // pos_embed: float32 cos/sin tables `[text + image tokens, head_dim]`, computed from the
    // ids without gradient and kept by every rotation.
    b.push(layer_spec! {
        head_dim: Some(head_dim),
        tables_f32: Some(true),
        inv_freq: Some(false),
        interleaved: Some(true),
        extra_positions: Some(n),
        ..with_inputs(layer(K::Rotary, "pos_embed"), &[&ctx])
    });
    for i in 0..layers {
        let (xo, co) = b.flux_double(&format!("transformer_blocks.{i}"), &x, &ctx, n_d)?;
        x = xo;
        ctx = co;
    }
    for i in 0..singles {
        let (xo, co) = b.flux_single(&format!("single_transformer_blocks.{i}"), &x, &ctx, n_d)?;
        x = xo;
        ctx = co;
    }
    let nx = b.ada_norm_continuous("norm_out", &x)?;
    let pp = mul(cfg, "the output width", patch * patch, out_ch)?;
    b.push(with_inputs(linear("proj_out", pp, true), &[&nx]));
    let mut named_inputs = vec![
        (ENCODER_STATES, vec![DimSpec::Seq, DimSpec::Fixed(joint)]),
        (POOLED, vec![DimSpec::Fixed(pooled)]),
        (TIMESTEPS_PROJ, vec![DimSpec::Fixed(TIME_PROJ_DIM)]),
    ];
    if guidance {
        named_inputs.push((GUIDANCE_PROJ, vec![DimSpec::Fixed(TIME_PROJ_DIM)]));
    }
    Ok(Dit {
        layers: b.out,
        input: vec![DimSpec::Fixed(n), DimSpec::Fixed(in_ch)],
        inputs: named(&named_inputs),
        what: format!(
            "the velocity prediction for {n} packed latent tokens of {in_ch} (a {h}×{w} latent)"
        ),
        // `train_dreambooth_flux.py`: T5's `max_sequence_length` 512.
        seq: 512,
    })
}

#[cfg(test)]
mod tests {
    use super::super::config::Header;
    use super::*;
    use serde_json::json;

    fn build(v: &serde_json::Value, class: &str) -> Result<Dit, Error> {
        let text = v.to_string();
        let cfg = Cfg {
            text: &text,
            model_type: class,
            header: Header::default(),
        };
        if class == "SD3Transformer2DModel" {
            sd3(&cfg, None)
        } else {
            flux(&cfg, None)
        }
    }

    fn message(v: &serde_json::Value, class: &str) -> String {
        match build(v, class) {
            Err(Error::Hf(e)) => e.message,
            Err(other) => panic!("expected an import error, got {other:?}"),
            Ok(_) => panic!("expected an import error"),
        }
    }

    fn tiny_sd3() -> serde_json::Value {
        json!({"sample_size": 8, "patch_size": 2, "in_channels": 4, "num_layers": 2,
               "attention_head_dim": 8, "num_attention_heads": 2, "joint_attention_dim": 12,
               "caption_projection_dim": 16, "pooled_projection_dim": 10, "out_channels": 4,
               "pos_embed_max_size": 6})
    }

    #[test]
    fn sd3_inputs_and_the_last_block_are_context_pre_only() {
        let d = build(&tiny_sd3(), "SD3Transformer2DModel").unwrap();
        assert_eq!(
            d.input,
            [DimSpec::Fixed(4), DimSpec::Fixed(8), DimSpec::Fixed(8)]
        );
        let names: Vec<&str> = d.inputs.keys().map(String::as_str).collect();
        assert_eq!(names, [ENCODER_STATES, POOLED, TIMESTEPS_PROJ]);
        let has = |n: &str| d.layers.iter().any(|l| l.name.as_deref() == Some(n));
        assert!(has("transformer_blocks.0.attn.to_add_out"));
        assert!(has("transformer_blocks.0.ff_context.net.2"));
        // The last block leaves the text stream: no `to_add_out`, no `ff_context`, and its
        // text norm is `AdaLayerNormContinuous` (two chunks).
        assert!(!has("transformer_blocks.1.attn.to_add_out"));
        assert!(!has("transformer_blocks.1.ff_context.net.2"));
        assert!(has("transformer_blocks.1.norm1_context.scale"));
        // A 4×4-patch latent reads a crop of the 6×6 table.
        let pos = d
            .layers
            .iter()
            .find(|l| l.name.as_deref() == Some("pos_embed.pos_embed"))
            .unwrap();
        assert_eq!(pos.shape, Some(vec![16, 16]));
        assert_eq!(pos.buffer, Some(vec![1, 36, 16]));
    }

    #[test]
    fn sd3_options_not_built_are_refused_by_name() {
        for (key, value, want) in [
            (
                "qk_norm",
                json!("layer_norm"),
                "`qk_norm`: \"layer_norm\" (supported: \"rms_norm\", null) is not supported yet",
            ),
            (
                "caption_projection_dim",
                json!(12),
                "`caption_projection_dim` = 12 differs from the model width 16",
            ),
            (
                "pos_embed_max_size",
                json!(3),
                "a 4×4-patch latent exceeds `pos_embed_max_size` = 3",
            ),
            (
                "patch_size",
                json!(3),
                "a 8×8 latent is not divisible into 3×3 patches",
            ),
        ] {
            let mut c = tiny_sd3();
            c[key] = value;
            let m = message(&c, "SD3Transformer2DModel");
            assert!(m.contains(want), "{key}: {m}");
        }
        let mut c = tiny_sd3();
        c["qk_norm"] = json!(null);
        c["dual_attention_layers"] = json!([]);
        assert!(build(&c, "SD3Transformer2DModel").is_ok());
        // SD3.5: a second attention in the listed blocks, RMSNorm on Q and K of both streams.
        c["qk_norm"] = json!("rms_norm");
        c["dual_attention_layers"] = json!([0]);
        let d = build(&c, "SD3Transformer2DModel").unwrap();
        let has = |n: &str| d.layers.iter().any(|l| l.name.as_deref() == Some(n));
        assert!(has("transformer_blocks.0.attn2.to_out.0"));
        assert!(has("transformer_blocks.0.norm1.gate_msa2"));
        assert!(!has("transformer_blocks.1.attn2.to_out.0"));
        for n in ["norm_q", "norm_k", "norm_added_q", "norm_added_k"] {
            assert!(has(&format!("transformer_blocks.1.attn.{n}")), "{n}");
        }
    }

    #[test]
    fn flux_tokens_guidance_and_rotary_axes() {
        let c = json!({"in_channels": 16, "num_layers": 1, "num_single_layers": 2,
                       "attention_head_dim": 16, "num_attention_heads": 2,
                       "joint_attention_dim": 24, "pooled_projection_dim": 20,
                       "guidance_embeds": true, "axes_dims_rope": [4, 6, 6]});
        let d = build(&c, "FluxTransformer2DModel").unwrap();
        // 1024 × 1024 pixels: a 128 × 128 latent, 64 × 64 packed tokens.
        assert_eq!(d.input, [DimSpec::Fixed(4096), DimSpec::Fixed(16)]);
        assert!(d.inputs.contains_key(GUIDANCE_PROJ));
        let rotary = d.layers.iter().find(|l| l.kind == K::Rotary).unwrap();
        assert_eq!(rotary.extra_positions, Some(4096));
        // diffusers' apply_rotary_emb(.., use_real_unbind_dim=-1): interleaved pairs.
        assert_eq!(rotary.interleaved, Some(true));
        let sdpa = d.layers.iter().filter(|l| l.kind == K::Sdpa).count();
        assert_eq!(sdpa, 3);
        let mut bad = c.clone();
        bad["axes_dims_rope"] = json!([4, 6, 8]);
        let m = message(&bad, "FluxTransformer2DModel");
        assert!(
            m.contains("must be even sizes adding up to `attention_head_dim` = 16"),
            "{m}"
        );
        let mut plain = c;
        plain["guidance_embeds"] = json!(false);
        let d = build(&plain, "FluxTransformer2DModel").unwrap();
        assert!(!d.inputs.contains_key(GUIDANCE_PROJ));
    }
}
