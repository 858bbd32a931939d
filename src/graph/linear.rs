//! `linear`.

use super::keys::{KeyReader, key};

/// `nn.Linear`: `[.., in] → [.., out]`; params `in·out (+ out)`. With `tie`, the weight is the
/// named embedding's (counted once, as transformers ties GPT-2's head).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinearCfg {
    /// Expected input features, checked when given.
    pub in_features: Option<u64>,
    /// Output features.
    pub out_features: u64,
    /// Has a bias.
    pub bias: bool,
    /// Name of an embedding whose weight this layer shares.
    pub tie: Option<String>,
    /// Whether a quantized `--dtype` (`int8`, `int4`, `nf4`) stores this weight quantized
    /// (key `quantize`). Default: yes, except for output heads, which quantizing loaders
    /// (bitsandbytes through transformers) keep in 16 bits: layers whose name (its last dotted
    /// part) contains `lm_head`, `head`, `classifier`, `score` or `pooler`.
    pub quantize: bool,
}

/// Name parts of the output heads that are not quantized by default (see
/// [`LinearCfg::quantize`]).
const HEAD_NAMES: [&str; 5] = ["lm_head", "head", "classifier", "score", "pooler"];

/// Whether a layer called `name` is an output head by its name.
fn is_head(name: &str) -> bool {
    let last = name.rsplit('.').next().unwrap_or("");
    HEAD_NAMES.iter().any(|n| last.contains(n))
}

impl LinearCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = LinearCfg {
            in_features: r.pos_opt(key!(s.in_features)),
            out_features: r.pos(key!(s.out_features)),
            bias: r.or(key!(s.bias), true),
            tie: r.opt(key!(s.tie)),
            quantize: r.or(key!(s.quantize), !is_head(r.name())),
        };
        r.finish()?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_are_recognized_by_the_last_name_part() {
        for name in [
            "lm_head",
            "model.score",
            "classifier",
            "head",
            "pooler.dense",
        ] {
            assert_eq!(is_head(name), !name.ends_with("dense"), "{name}");
        }
        assert!(!is_head("model.head_mixer.fc"));
        assert!(!is_head("fc1"));
    }

    #[test]
    fn quantize_defaults_from_the_name_and_can_be_set() {
        let spec = |quantize| {
            crate::spec::layer_spec! {
                kind: crate::spec::LayerKind::Linear,
                out_features: Some(4),
                quantize: quantize,
                ..crate::spec::LayerSpec::default()
            }
        };
        let read = |s: &crate::spec::LayerSpec, name| {
            LinearCfg::read(&mut KeyReader::new(s, name))
                .unwrap()
                .quantize
        };
        assert!(read(&spec(None), "fc1"));
        assert!(!read(&spec(None), "lm_head"));
        // A layer whose name merely contains `head` is not quantized unless it says so.
        assert!(!read(&spec(None), "ahead"));
        assert!(read(&spec(Some(true)), "ahead"));
        assert!(!read(&spec(Some(false)), "fc1"));
    }
}
