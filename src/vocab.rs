//! Closed sets of names shared by the model file's `[defaults]` and the command line.
//!
//! Each set is an enum deriving clap's [`ValueEnum`]: its variants give the canonical names and
//! `#[value(alias = …)]` the aliases, once. The same table parses flags ([`VocabParser`]) and
//! file values (serde, through [`vocab!`](crate::vocab!)), prints names ([`std::fmt::Display`],
//! [`serde::Serialize`]) and lists the accepted values in errors, so the two front ends cannot
//! drift apart. Names match case-insensitively, with `_` read as `-` (`SGD_Nesterov`). The
//! JSON schema (`schemars`) spells the same names; `tests/it` checks the schema file.

use std::ffi::OsStr;
use std::marker::PhantomData;

use clap::ValueEnum;
use clap::builder::{PossibleValue, TypedValueParser};

/// A closed set of names (see the module docs).
pub trait Vocab: ValueEnum + Copy + Send + Sync + 'static {
    /// What one value is called in messages: `optimizer`, `mode`, …
    const WHAT: &'static str;

    /// The value for `name` (canonical or alias, any case, `_` for `-`), if there is one.
    fn parse(name: &str) -> Option<Self> {
        let name = name.trim().replace('_', "-");
        Self::value_variants().iter().copied().find(|v| {
            v.to_possible_value()
                .is_some_and(|p| p.matches(&name, true))
        })
    }

    /// The canonical names, in declaration order, comma-separated.
    #[must_use]
    fn names() -> String {
        Self::value_variants()
            .iter()
            .filter_map(ValueEnum::to_possible_value)
            .map(|p| p.get_name().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The message for a name outside the set: ``unknown optimizer `adamx` (did you mean
    /// `adam`?), expected one of …``.
    #[must_use]
    fn unknown(name: &str) -> String {
        let names: Vec<String> = Self::value_variants()
            .iter()
            .filter_map(ValueEnum::to_possible_value)
            .map(|p| p.get_name().to_string())
            .collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let hint = crate::error::nearest(&name.to_ascii_lowercase(), &refs)
            .map(|n| format!(" (did you mean `{n}`?)"))
            .unwrap_or_default();
        format!(
            "unknown {} `{name}`{hint}, expected one of {}",
            Self::WHAT,
            refs.join(", ")
        )
    }
}

/// Implements [`Vocab`], [`std::fmt::Display`], [`serde::Serialize`] and
/// [`serde::Deserialize`] for a [`ValueEnum`], all from its clap names.
#[macro_export]
macro_rules! vocab {
    ($ty:ty, $what:literal) => {
        impl $crate::vocab::Vocab for $ty {
            const WHAT: &'static str = $what;
        }

        impl ::std::fmt::Display for $ty {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                match ::clap::ValueEnum::to_possible_value(self) {
                    Some(p) => f.pad(p.get_name()),
                    None => Ok(()),
                }
            }
        }

        impl ::serde::Serialize for $ty {
            fn serialize<S: ::serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        impl<'de> ::serde::Deserialize<'de> for $ty {
            fn deserialize<D: ::serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let name = <::std::borrow::Cow<'de, str>>::deserialize(d)?;
                <$ty as $crate::vocab::Vocab>::parse(&name).ok_or_else(|| {
                    ::serde::de::Error::custom(<$ty as $crate::vocab::Vocab>::unknown(&name))
                })
            }
        }
    };
}

/// clap's parser for a [`Vocab`] flag: the file's rules (aliases, any case, `_` for `-`), and
/// clap's own error and `--help` listing for values outside the set.
#[derive(Clone, Copy, Debug)]
pub struct VocabParser<T>(PhantomData<T>);

impl<T: Vocab> VocabParser<T> {
    /// The parser.
    #[must_use]
    pub const fn new() -> Self {
        VocabParser(PhantomData)
    }
}

impl<T: Vocab> Default for VocabParser<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Vocab> TypedValueParser for VocabParser<T> {
    type Value = T;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<T, clap::Error> {
        match value.to_str().and_then(T::parse) {
            Some(v) => Ok(v),
            None => clap::builder::EnumValueParser::<T>::new().parse_ref(cmd, arg, value),
        }
    }

    fn possible_values(&self) -> Option<Box<dyn Iterator<Item = PossibleValue> + '_>> {
        Some(Box::new(
            T::value_variants()
                .iter()
                .filter_map(ValueEnum::to_possible_value),
        ))
    }
}

/// Training step or inference forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, schemars::JsonSchema)]
#[schemars(rename_all = "lowercase")]
pub enum Mode {
    /// One training step: forward, backward, optimizer step.
    Train,
    /// A forward pass under `torch.no_grad()` in eval mode.
    #[value(alias = "inference", alias = "eval")]
    Infer,
    /// Text generation as transformers' `model.generate` runs it: a prefill over the prompt
    /// (`--prompt`), then one forward per new token (`--new-tokens`) as the KV cache grows.
    #[value(alias = "generation", alias = "serve")]
    Generate,
}
crate::vocab!(Mode, "mode");

/// How attention is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, schemars::JsonSchema)]
#[schemars(rename_all = "lowercase")]
pub enum AttentionImpl {
    /// Matmul, softmax, dropout, matmul: keeps the `[B, heads, S, S]` probabilities.
    Eager,
    /// A fused kernel (`scaled_dot_product_attention`'s flash path): keeps Q, K, V, the output
    /// and a float32 log-sum-exp.
    #[value(alias = "sdpa")]
    Flash,
}
crate::vocab!(AttentionImpl, "attention");

/// Whose kernels' saved tensors to model: CUDA by default (what a GPU runs); `cpu` models a CPU
/// run, as the measured CPU reference figures (`tests/data/reference.json`) ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, schemars::JsonSchema)]
#[schemars(rename_all = "lowercase")]
pub enum Device {
    /// PyTorch's CPU kernels (dropout keeps a noise tensor in the input's dtype).
    Cpu,
    /// PyTorch's CUDA kernels (dropout keeps a 1-byte mask; autocast runs norms and softmax in
    /// float32). Alias `gpu`.
    #[value(alias = "gpu")]
    Cuda,
}
crate::vocab!(Device, "device");

/// Which figure `--budget` and the `--max-batch`/`--max-context` search check on a GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, schemars::JsonSchema)]
#[schemars(rename_all = "lowercase")]
pub enum BudgetOn {
    /// The tensors' peak, what `torch.cuda.max_memory_allocated()` reports.
    Allocated,
    /// The caching allocator's reserve, what `torch.cuda.max_memory_reserved()` reports.
    Reserved,
    /// What `nvidia-smi` shows: the reserve plus the CUDA context and the cuBLAS workspaces.
    #[default]
    Device,
}
crate::vocab!(BudgetOn, "budget figure");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aliases_case_and_underscores() {
        assert_eq!(Mode::parse("inference"), Some(Mode::Infer));
        assert_eq!(Mode::parse("EVAL"), Some(Mode::Infer));
        assert_eq!(Mode::parse("generation"), Some(Mode::Generate));
        assert_eq!(AttentionImpl::parse("SDPA"), Some(AttentionImpl::Flash));
        assert_eq!(Device::parse("cuda"), Some(Device::Cuda));
        assert_eq!(Device::parse("GPU"), Some(Device::Cuda));
        assert_eq!(Mode::parse("trian"), None);
        assert_eq!(
            Mode::unknown("trian"),
            "unknown mode `trian` (did you mean `train`?), expected one of train, infer, generate"
        );
        assert_eq!(
            Mode::unknown("walk"),
            "unknown mode `walk`, expected one of train, infer, generate"
        );
    }

    #[test]
    fn serde_uses_the_clap_names() {
        assert_eq!(serde_json::to_string(&Mode::Infer).unwrap(), "\"infer\"");
        let m: Mode = serde_json::from_str("\"eval\"").unwrap();
        assert_eq!(m, Mode::Infer);
        let e = serde_json::from_str::<AttentionImpl>("\"quantum\"").unwrap_err();
        assert!(
            e.to_string()
                .starts_with("unknown attention `quantum`, expected one of eager, flash"),
            "{e}"
        );
    }

    #[test]
    fn the_flag_parser_takes_the_file_names() {
        let cmd = clap::Command::new("t");
        let p = VocabParser::<AttentionImpl>::new();
        assert_eq!(
            p.parse_ref(&cmd, None, OsStr::new("sdpa")).unwrap(),
            AttentionImpl::Flash
        );
        assert!(p.parse_ref(&cmd, None, OsStr::new("fast")).is_err());
        let names: Vec<String> = p
            .possible_values()
            .unwrap()
            .map(|v| v.get_name().to_string())
            .collect();
        assert_eq!(names, ["eager", "flash"]);
    }
}
