//! Reading a TOML description's `[[layers]]` tables a few at a time.
//!
//! `toml` reads a document whole: it lexes every token into one vector, turns them into a
//! vector of events of the same length, builds the whole document as a tree of spanned
//! tables, and only then deserializes it. For 100,000 `[[layers]]` tables (2.5 MB of text)
//! that is about 130 MB touched at once, against 17 MB for the layers themselves, and on a
//! machine where fresh memory is zeroed page by page the touching is most of the time.
//!
//! The top level of a model file is a few tables (`[input]`, `[defaults]`, …) and one array
//! of tables, `[[layers]]`, each element with its own sub-tables (`[[layers.layers]]` for a
//! block's body). An element of an array of tables reads the same whatever precedes or
//! follows it, so the text of consecutive elements is read on its own, some 32 KiB at a time,
//! and the rest of the file (its keys and other tables, with the placeholder `layers = []`) on
//! its own. [`parse`] gives the same [`ModelSpec`] as reading the file whole, or `None` (and
//! the caller reads the file whole, which reports any error with its own line and column):
//! for a file that does not split plainly (a header whose first key is quoted, `layers`
//! written as a table, a sub-table of `layers` after another table), or any part that does not
//! read. Whatever the file writes about `layers` outside its `[[layers]]` elements meets the
//! placeholder and fails to read, so no such file is read differently in parts.

use serde::Deserialize;
use toml_parser::lexer::TokenKind;

use super::{LayerSpec, ModelSpec};

/// Bytes of `[[layers]]` text read at a time (whole elements; at least one).
const PART_BYTES: usize = 32 << 10;

/// What a table header (`[a.b]`, `[[a.b]]`) opens, by its first key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Header {
    /// `[[layers]]`: the next element of the layers.
    Layer,
    /// `[layers.…]` or `[[layers.…]]`: a sub-table of the element before it.
    WithinLayer,
    /// Any other table, whose first key is bare and not `layers`.
    Other,
}

/// A file cut into its `[[layers]]` text and the rest.
#[derive(Debug, Default, PartialEq, Eq)]
struct Split {
    /// Byte ranges of consecutive whole elements, in order, each about [`PART_BYTES`].
    parts: Vec<std::ops::Range<usize>>,
    /// How many elements in all.
    layers: usize,
    /// Byte ranges of everything else: the keys before the first table and the other tables.
    rest: Vec<std::ops::Range<usize>>,
}

/// Reads a TOML model description with its `[[layers]]` elements in parts (see the module's
/// documentation): the [`ModelSpec`] that reading it whole gives, or `None` when it is not cut
/// that way or some part does not read. `src` has no byte-order mark.
pub(super) fn parse(src: &str) -> Option<ModelSpec> {
    let split = split(src)?;
    if split.layers == 0 {
        return None;
    }
    let mut rest = String::from("layers = []\n");
    for r in &split.rest {
        rest.push_str(&src[r.clone()]);
    }
    let mut spec = ModelSpec::deserialize(toml::Deserializer::parse(&rest).ok()?).ok()?;
    drop(rest);
    if !spec.layers.is_empty() {
        return None;
    }
    /// One part: nothing but `[[layers]]` elements.
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Part {
        layers: Vec<LayerSpec>,
    }
    let mut layers = Vec::with_capacity(split.layers);
    for r in split.parts {
        let part = Part::deserialize(toml::Deserializer::parse(&src[r]).ok()?).ok()?;
        layers.extend(part.layers);
    }
    if layers.len() != split.layers {
        return None;
    }
    spec.layers = layers;
    Some(spec)
}

/// Cuts `src` at its table headers, by the lexer `toml` reads it with (so a header-like line
/// inside a multi-line string or array is none). `None` when a header's first key is quoted or
/// not a bare key, `layers` is a plain table (`[layers]`), or a sub-table of `layers` follows
/// anything but an element or another such sub-table.
fn split(src: &str) -> Option<Split> {
    let mut out = Split::default();
    let mut tokens = toml_parser::Source::new(src).lex().peekable();
    // Where the current section started and what its header was (`None`: the keys before any).
    let mut section: (usize, Option<Header>) = (0, None);
    // Where the element text not yet in a part starts.
    let mut part_start: Option<usize> = None;
    // Brackets open inside a value; at depth 0 a newline ends the expression.
    let mut depth = 0usize;
    let mut line_start = true;
    while let Some(token) = tokens.next() {
        let kind = token.kind();
        match kind {
            TokenKind::Whitespace | TokenKind::Comment => continue,
            TokenKind::Newline => {
                line_start = depth == 0;
                continue;
            }
            TokenKind::Eof => break,
            _ => {}
        }
        if line_start && kind == TokenKind::LeftSquareBracket {
            let start = token.span().start();
            let array = tokens
                .next_if(|t| t.kind() == TokenKind::LeftSquareBracket)
                .is_some();
            let key_start = tokens.peek()?.span().start();
            let key_end = loop {
                let t = tokens.next()?;
                match t.kind() {
                    TokenKind::RightSquareBracket => break t.span().start(),
                    TokenKind::Newline | TokenKind::Eof => return None,
                    _ => {}
                }
            };
            if array {
                tokens.next_if(|t| t.kind() == TokenKind::RightSquareBracket);
            }
            let header = classify(&src[key_start..key_end], array)?;
            let follows_layer = matches!(section.1, Some(Header::Layer | Header::WithinLayer));
            if header == Header::WithinLayer && !follows_layer {
                return None;
            }
            if header == Header::Layer {
                out.layers += 1;
            }
            end_section(&mut out, &mut part_start, section, start);
            // A part ends before an element (when long enough) or another table, never
            // between an element and its sub-tables.
            if let Some(from) = part_start
                && (header == Header::Other
                    || header == Header::Layer && start - from >= PART_BYTES)
            {
                out.parts.push(from..start);
                part_start = None;
            }
            section = (start, Some(header));
            line_start = false;
            continue;
        }
        line_start = false;
        match kind {
            TokenKind::LeftSquareBracket | TokenKind::LeftCurlyBracket => depth += 1,
            TokenKind::RightSquareBracket | TokenKind::RightCurlyBracket => {
                depth = depth.saturating_sub(1);
            }
            _ => {}
        }
    }
    end_section(&mut out, &mut part_start, section, src.len());
    if let Some(from) = part_start {
        out.parts.push(from..src.len());
    }
    Some(out)
}

/// Files the section that started at `section.0` with the header `section.1` and ends at `end`:
/// an element's text joins the part under way, any other section the rest.
fn end_section(
    out: &mut Split,
    part_start: &mut Option<usize>,
    section: (usize, Option<Header>),
    end: usize,
) {
    match section.1 {
        Some(Header::Layer | Header::WithinLayer) => {
            part_start.get_or_insert(section.0);
        }
        None | Some(Header::Other) => {
            if end > section.0 {
                out.rest.push(section.0..end);
            }
        }
    }
}

/// What the header whose key is written `key` (between its brackets) opens; `array` for
/// `[[…]]`. `None` for a first key that is quoted or not a bare key, and for `[layers]`.
fn classify(key: &str, array: bool) -> Option<Header> {
    let key = key.trim_matches([' ', '\t']);
    let bare = key
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
        .unwrap_or(key.len());
    let (first, after) = key.split_at(bare);
    let after = after.trim_start_matches([' ', '\t']);
    if first.is_empty() || !(after.is_empty() || after.starts_with('.')) {
        return None;
    }
    match (first == "layers", after.is_empty(), array) {
        (true, true, true) => Some(Header::Layer),
        (true, true, false) => None,
        (true, false, _) => Some(Header::WithinLayer),
        (false, ..) => Some(Header::Other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The spec read in parts, written back, equals the spec read whole.
    fn same(src: &str) {
        let parts = parse(src).expect("reads in parts");
        let whole: ModelSpec = toml::from_str(src).expect("reads whole");
        assert_eq!(
            serde_json::to_string(&parts).unwrap(),
            serde_json::to_string(&whole).unwrap()
        );
    }

    #[test]
    fn elements_and_the_rest_read_apart() {
        same(
            "name = \"m\"\n[input]\nshape = [\"seq\"]\n[[layers]]\nkind = \"embedding\"\nnum_embeddings = 10\nembedding_dim = 4\n[defaults]\nbatch = 2\n[[layers]]\nkind = \"repeat\"\ncount = 2\n  [[layers.layers]]\n  kind = \"relu\"\n  [[layers.layers]]\n  kind = \"linear\"\n  out_features = 4 # [[layers]]\n[[layers]]\nkind = \"relu\"\nnote = \"\"\"\n[[layers]]\nkind = 'x'\n\"\"\"\n[inputs.t]\nshape = [\n4,\n]\n",
        );
        // A line of a multi-line array that starts with `[` is no header.
        let cut = split("a = [\n[1]\n]\n[[layers]]\nkind = 'relu'\n").unwrap();
        assert_eq!((cut.layers, cut.rest.len(), cut.parts.len()), (1, 1, 1));
        assert_eq!((cut.rest[0].clone(), cut.parts[0].clone()), (0..12, 12..37));
        let mut big = String::from("[input]\nshape = [4]\n");
        for i in 0..5000 {
            big.push_str(&format!("[[layers]]\nkind = \"relu\"\nname = \"r{i}\"\n"));
        }
        big.push_str("[defaults]\nbatch = 3");
        let split = split(&big).unwrap();
        assert_eq!(split.layers, 5000);
        assert!(split.parts.len() > 2, "{}", split.parts.len());
        same(&big);
    }

    #[test]
    fn files_that_do_not_cut_plainly_read_whole() {
        for src in [
            // No elements.
            "[input]\nshape = [4]\nlayers = [{kind = \"relu\"}]\n",
            // `layers` outside its elements.
            "layers = []\n[input]\nshape = [4]\n[[layers]]\nkind = \"relu\"\n",
            "[input]\nshape = [4]\n[layers]\nkind = \"relu\"\n",
            "[input]\nshape = [4]\n[[\"layers\"]]\nkind = \"relu\"\n",
            "[input]\nshape = [4]\n[[layers]]\nkind = \"repeat\"\n[defaults]\n[[layers.layers]]\nkind = \"relu\"\n",
            // A part that does not read.
            "[input]\nshape = [4]\n[[layers]]\nkind = \"relu\"\nbogus = 1\n",
            "[input]\nshape = [4]\n[[layers]]\nkind = \"relu\n",
            "[input]\nshape = [4]\n[input]\n[[layers]]\nkind = \"relu\"\n",
        ] {
            assert!(parse(src).is_none(), "{src}");
        }
    }

    /// Every TOML model the project ships or keeps (examples, test fixtures, the fuzz corpus),
    /// as written and with each of its lines a header (`[[layers]]`, a sub-table of an element,
    /// another table) moved, doubled or dropped: wherever reading in parts gives a spec, reading
    /// whole gives the same one; wherever reading whole fails, reading in parts gives none.
    #[test]
    fn parts_read_as_the_whole_file_reads() {
        use proptest::prelude::*;
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut seeds = Vec::new();
        for dir in [
            "examples",
            "tests/fixtures",
            "tests/fixtures/extra",
            "tests/fuzz/corpus",
        ] {
            for entry in std::fs::read_dir(root.join(dir)).expect("dir") {
                let path = entry.expect("entry").path();
                if path.extension().is_some_and(|e| e == "toml") {
                    let text = std::fs::read_to_string(&path).expect("reads");
                    // The corpus's first line is its flags (`#!memest …`): a TOML comment.
                    seeds.push(text);
                }
            }
        }
        assert!(seeds.len() > 40, "{} seed files", seeds.len());
        let check = |src: &str| -> Result<(), TestCaseError> {
            let whole = toml::from_str::<ModelSpec>(src);
            match (parse(src), whole) {
                (Some(parts), Ok(whole)) => prop_assert_eq!(
                    serde_json::to_string(&parts).unwrap(),
                    serde_json::to_string(&whole).unwrap()
                ),
                (Some(_), Err(e)) => prop_assert!(false, "read in parts, not whole ({e}):\n{src}"),
                (None, _) => {}
            }
            Ok(())
        };
        let mut cut = 0;
        for seed in &seeds {
            check(seed).unwrap();
            cut += usize::from(parse(seed).is_some());
        }
        // Most shipped files cut plainly; the property is not vacuous.
        assert!(cut * 2 > seeds.len(), "{cut} of {} cut", seeds.len());
        const HEADERS: [&str; 7] = [
            "[[layers]]",
            "[[layers.layers]]",
            "[layers.inputs]",
            "[defaults]",
            "[input]",
            "[inputs.x]",
            "layers = []",
        ];
        let edit = (
            0..seeds.len(),
            proptest::collection::vec((0..4u8, any::<usize>(), any::<usize>()), 1..6),
        );
        proptest!(ProptestConfig::with_cases(512), |((which, edits) in edit)| {
            let mut lines: Vec<String> = seeds[which].lines().map(String::from).collect();
            for (op, a, b) in edits {
                let n = lines.len().max(1);
                let (a, b) = (a % n, b % n);
                match op {
                    0 if !lines.is_empty() => { let l = lines.remove(a); lines.insert(b.min(lines.len()), l); }
                    1 if !lines.is_empty() => { let l = lines[a].clone(); lines.insert(b, l); }
                    2 if !lines.is_empty() => { lines.remove(a); }
                    _ => lines.insert(a.min(lines.len()), HEADERS[b % HEADERS.len()].to_string()),
                }
            }
            check(&(lines.join("\n") + "\n"))?;
        });
    }
}
