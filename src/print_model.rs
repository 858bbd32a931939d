//! `--print-model`: any model description (a memest file or an imported Hugging Face config)
//! written back as memest's TOML.

use crate::error::Error;
use crate::spec::ModelSpec;

/// A model description as TOML, laid out like the hand-written examples: one `[[layers]]`
/// table per layer, the bodies of blocks (`[[layers.layers]]`) indented two spaces per level.
/// Reading the text back gives the same description.
///
/// # Errors
/// [`Error::Model`] if the description cannot be written as TOML (it always can).
pub fn to_toml(spec: &ModelSpec) -> Result<String, Error> {
    let text = toml::to_string(spec)
        .map_err(|e| Error::Model(format!("cannot write the model as TOML: {e}")))?;
    // Multi-line strings would change if indented; leave such text as it is.
    if text.contains("\"\"\"") || text.contains("'''") {
        return Ok(text);
    }
    let mut out = String::with_capacity(text.len() + text.len() / 4);
    let mut indent = String::new();
    for line in text.lines() {
        if line.starts_with('[') {
            let depth = line
                .trim_matches(|c| c == '[' || c == ']')
                .split('.')
                .filter(|s| *s == "layers")
                .count()
                .saturating_sub(1);
            indent = "  ".repeat(depth);
        }
        if !line.is_empty() {
            out.push_str(&indent);
        }
        out.push_str(line);
        out.push('\n');
    }
    Ok(out)
}
