//! `einsum`.

use super::keys::{KeyReader, key};

/// A subscript of an einsum equation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Subscript {
    /// A letter, numbered as ATen's `einsum` numbers them (`label_to_subscript` in
    /// `aten/src/ATen/native/Linear.cpp`): `A`–`Z` are 0–25, `a`–`z` 26–51, so contracted
    /// labels are ordered with capitals first.
    Label(u8),
    /// `...`: the dimensions no letter names.
    Ellipsis,
}

impl Subscript {
    /// The letter (or `...`) as written.
    #[must_use]
    pub fn text(self) -> String {
        match self {
            Subscript::Label(i) if i < 26 => char::from(b'A' + i).to_string(),
            Subscript::Label(i) => char::from(b'a' + i - 26).to_string(),
            Subscript::Ellipsis => "...".into(),
        }
    }
}

/// `torch.einsum(equation, a, b)` of two inputs (`inputs = [a, b]`), in the forms attention and
/// batched products use: `bhqd,bhkd->bhqk`, `bhqk,bhkd->bhqd`, `bij,bjk->bik`,
/// `...ij,...jk->...ik`.
///
/// ATen's `einsum` (`aten/src/ATen/native/Linear.cpp`, CompositeImplicitAutograd) lines the
/// operands up (output labels first, in output order, then the contracted ones in subscript
/// order) and calls `sumproduct_pair`, which permutes the left operand to
/// `[batch, left-only, contracted]` and the right to `[batch, contracted, right-only]`, reshapes
/// each to three dimensions (a view when the permuted dimensions of each group are adjacent in
/// memory, else a copy), runs one `bmm` and views the result back in output order. The `bmm`
/// keeps both three-dimensional operands (`derivatives.yaml`: `bmm`), so an operand is kept as
/// it is when it could be viewed and as a copy when not. No parameters.
///
/// # Shapes
/// Each operand has one dimension per letter (and the `...` dimensions); the output has the
/// output letters' sizes, in their order.
///
/// # Errors
/// Equations outside these forms are refused, naming the layer: one or more than two operands,
/// no `->`, a letter repeated in an operand (a diagonal), a letter in one operand only that is
/// not in the output (ATen sums it first), no contracted letter (an elementwise or outer
/// product: use `mul`), `...` in some but not all of the three parts, and an equation that moves
/// the batch dimension (the output's first subscript must come first in each operand that has
/// it, and one operand must have it, as `transpose` keeps dimension 0).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EinsumCfg {
    /// The equation as written.
    pub equation: String,
    /// The left operand's subscripts.
    pub left: Vec<Subscript>,
    /// The right operand's subscripts.
    pub right: Vec<Subscript>,
    /// The output's subscripts.
    pub output: Vec<Subscript>,
}

impl EinsumCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let equation: String = r.req(key!(s.equation), " (e.g. equation = \"bhqd,bhkd->bhqk\")");
        r.finish()?;
        EinsumCfg::parse(&equation)
    }

    /// Parses and checks `equation` (the forms accepted are above).
    ///
    /// # Errors
    /// A message naming what is unsupported or malformed.
    pub fn parse(equation: &str) -> Result<Self, String> {
        parse(equation)
    }
}

/// The subscripts of one part of an equation.
fn subscripts(part: &str, what: &str, equation: &str) -> Result<Vec<Subscript>, String> {
    let mut out = Vec::new();
    let mut rest = part.trim();
    while let Some(c) = rest.chars().next() {
        if rest.starts_with("...") {
            if out.contains(&Subscript::Ellipsis) {
                return Err(format!(
                    "`equation` \"{equation}\": the {what} has two `...`"
                ));
            }
            out.push(Subscript::Ellipsis);
            rest = &rest[3..];
            continue;
        }
        let label = match c {
            'A'..='Z' => c as u8 - b'A',
            'a'..='z' => c as u8 - b'a' + 26,
            ' ' => {
                rest = &rest[1..];
                continue;
            }
            _ => {
                return Err(format!(
                    "`equation` \"{equation}\": `{c}` in the {what} is not a subscript; subscripts are letters a-z, A-Z and `...`"
                ));
            }
        };
        let s = Subscript::Label(label);
        if out.contains(&s) {
            return Err(format!(
                "`equation` \"{equation}\": `{c}` appears twice in the {what} (a diagonal), which memest does not model"
            ));
        }
        out.push(s);
        rest = &rest[c.len_utf8()..];
    }
    Ok(out)
}

/// Parses and checks an equation (see [`EinsumCfg`] for the forms accepted).
fn parse(equation: &str) -> Result<EinsumCfg, String> {
    let Some((lhs, rhs)) = equation.split_once("->") else {
        return Err(format!(
            "`equation` \"{equation}\" has no `->`: give the output subscripts, e.g. \"bhqd,bhkd->bhqk\""
        ));
    };
    let operands: Vec<&str> = lhs.split(',').collect();
    let [a, b] = operands.as_slice() else {
        return Err(format!(
            "`equation` \"{equation}\" has {} operand(s); `einsum` takes two (its two `inputs`)",
            operands.len()
        ));
    };
    let left = subscripts(a, "first operand", equation)?;
    let right = subscripts(b, "second operand", equation)?;
    let output = subscripts(rhs, "output", equation)?;
    let has = |v: &[Subscript], s| v.contains(&s);
    for &s in &output {
        if !has(&left, s) && !has(&right, s) {
            return Err(format!(
                "`equation` \"{equation}\": output subscript `{}` is in neither operand",
                s.text()
            ));
        }
    }
    let ellipses = [&left, &right, &output]
        .iter()
        .filter(|v| v.contains(&Subscript::Ellipsis))
        .count();
    if ellipses != 0 && ellipses != 3 {
        return Err(format!(
            "`equation` \"{equation}\": `...` must be in both operands and the output, or nowhere"
        ));
    }
    let mut contracted = 0;
    for (mine, theirs, what) in [
        (&left, &right, "first operand"),
        (&right, &left, "second operand"),
    ] {
        for &s in mine {
            let in_other = has(theirs, s);
            let in_out = has(&output, s);
            if !in_other && !in_out {
                return Err(format!(
                    "`equation` \"{equation}\": `{}` is only in the {what} and not in the output (ATen sums it before the product), which memest does not model",
                    s.text()
                ));
            }
            if in_other && !in_out {
                contracted += 1;
            }
        }
    }
    if contracted == 0 {
        return Err(format!(
            "`equation` \"{equation}\" contracts no subscript (an elementwise or outer product, which ATen runs as `mul`): use a `mul` layer"
        ));
    }
    // Every layer's output has the batch first (a model's shapes are `[B, ...]`); the tracer and
    // every later layer read dimension 0 as the batch, as `transpose` keeps it. The output's
    // first subscript is its batch: each operand that has it must have it first (an operand
    // without it is a weight shared by the batch, `bij,jk->bik`).
    let batch = output.first();
    let moved = |v: &[Subscript]| batch.is_some_and(|b| v.contains(b) && v.first() != Some(b));
    if batch.is_none() || moved(&left) || moved(&right) {
        return Err(format!(
            "`equation` \"{equation}\": einsum cannot move the batch dimension (dimension 0): the output's first subscript (the batch, or `...`) must come first in the operands, e.g. \"bhqd,bhkd->bhqk\""
        ));
    }
    Ok(EinsumCfg {
        equation: equation.to_string(),
        left,
        right,
        output,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_forms_parse() {
        let c = parse("bhqd,bhkd->bhqk").unwrap();
        assert_eq!(c.left.len(), 4);
        assert_eq!(c.output.len(), 4);
        assert!(parse("...ij,...jk->...ik").is_ok());
        assert!(parse("bij, bjk -> bik").is_ok());
    }

    #[test]
    fn unsupported_forms_are_refused() {
        for (eq, says) in [
            ("bij,bjk", "no `->`"),
            ("bij->bji", "1 operand"),
            ("ab,bc,cd->ad", "3 operand"),
            ("bii,bij->bj", "twice"),
            ("bij,bjk->bi", "only in the second operand"),
            ("bi,bj->bij", "contracts no subscript"),
            ("...ij,jk->...ik", "`...` must be"),
            ("bij,bj1->bi", "not a subscript"),
            ("bij,bjk->bix", "in neither operand"),
            ("bhqd,bhkd->qbhk", "cannot move the batch dimension"),
            ("bij,jbk->bik", "cannot move the batch dimension"),
            ("ij,jik->ik", "cannot move the batch dimension"),
        ] {
            let e = parse(eq).unwrap_err();
            assert!(e.contains(says), "{eq}: {e}");
        }
    }
}
