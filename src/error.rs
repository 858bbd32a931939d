//! Typed errors of the library. The binary adds the file name and maps every error to exit 2.

use std::fmt;

/// Anything that stops an estimate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Error {
    /// The file could not be read as a model description (syntax, unknown key, wrong type).
    Spec(SpecError),
    /// A layer is invalid: a missing or inapplicable key, a zero size, an unknown input name,
    /// or a shape mismatch.
    Layer(LayerError),
    /// A setting (from the file's `[defaults]` or a flag) has an invalid value.
    Setting(String),
    /// A size computation overflowed 64 bits.
    Overflow(String),
}

/// A syntax or schema error, with its 1-based position when known.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecError {
    /// 1-based line.
    pub line: Option<usize>,
    /// 1-based column.
    pub column: Option<usize>,
    /// What was wrong.
    pub message: String,
}

/// An error in one layer, naming it by position, name and kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerError {
    /// Where the layer is, e.g. `layer #3 "fc2" (linear)` or `layer #5 "blocks" > #2 "attn" (attention)`.
    pub layer: String,
    /// What was wrong.
    pub message: String,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Spec(e) => match (e.line, e.column) {
                (Some(l), Some(c)) => write!(f, "{l}:{c}: {}", e.message),
                (Some(l), None) => write!(f, "{l}: {}", e.message),
                _ => f.write_str(&e.message),
            },
            Error::Layer(e) => write!(f, "{}: {}", e.layer, e.message),
            Error::Setting(m) => f.write_str(m),
            Error::Overflow(what) => write!(f, "size overflow: {what} does not fit in 64 bits"),
        }
    }
}

impl std::error::Error for Error {}

impl Error {
    /// The 1-based line and column this error points at, when it has a position.
    #[must_use]
    pub fn position(&self) -> Option<(usize, Option<usize>)> {
        match self {
            Error::Spec(SpecError {
                line: Some(l),
                column,
                ..
            }) => Some((*l, *column)),
            _ => None,
        }
    }

    /// This error as found in `origin` (a file name, `<stdin>`).
    #[must_use]
    pub fn at(self, origin: impl Into<String>) -> Located {
        Located {
            origin: origin.into(),
            error: self,
        }
    }
}

/// An error with the input it came from. Displays as `origin:line:col: message` when the error
/// has a position, else `origin: message`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Located {
    /// The file the error is in (`<stdin>` for standard input).
    pub origin: String,
    /// The error.
    pub error: Error,
}

impl fmt::Display for Located {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // A positioned error displays as `line:col: message` itself.
        let sep = if self.error.position().is_some() {
            ""
        } else {
            " "
        };
        write!(f, "{}:{sep}{}", self.origin, self.error)
    }
}

/// No `source`: the message already includes the error's (`{:#}` chains would repeat it).
impl std::error::Error for Located {}

/// How similar a candidate must be to be suggested: its normalized Damerau-Levenshtein
/// similarity (1 − edits / longer length, a transposition counting as one edit).
const MIN_SIMILARITY: f64 = 0.6;

/// The candidate most like `word` (the first of equals), if it is close enough to be a likely
/// typo: at most 2 edits in 5 characters, 4 in 10 (see [`MIN_SIMILARITY`]).
#[must_use]
pub fn nearest<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let mut best: Option<(f64, &'a str)> = None;
    for &c in candidates {
        let score = strsim::normalized_damerau_levenshtein(word, c);
        if score >= MIN_SIMILARITY && best.is_none_or(|(b, _)| score > b) {
            best = Some((score, c));
        }
    }
    best.map(|(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_finds_typos() {
        assert_eq!(nearest("lienar", &["linear", "relu"]), Some("linear"));
        assert_eq!(
            nearest("out_feature", &["out_features", "bias"]),
            Some("out_features")
        );
        assert_eq!(nearest("zzzzzz", &["linear", "relu"]), None);
        assert_eq!(
            nearest("fc", &["fc1", "fc2"]),
            Some("fc1"),
            "the first of equals"
        );
        assert_eq!(nearest("stide", &["stride", "kernel"]), Some("stride"));
    }

    #[test]
    fn nearest_stays_quiet_when_nothing_is_close() {
        // Levenshtein within max(len/3, 2) suggested all of these.
        assert_eq!(nearest("x", &["p", "dim"]), None);
        assert_eq!(nearest("eps", &["p", "tie"]), None);
        assert_eq!(nearest("gru", &["gelu", "relu"]), None);
        assert_eq!(nearest("mha", &["mul", "moe"]), None);
        assert_eq!(nearest("bn", &["ln", "fc1"]), None);
    }
}
