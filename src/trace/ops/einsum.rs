//! `einsum`: ATen's `sumproduct_pair`, one `bmm` between permuted, reshaped operands.

use std::collections::HashMap;

#[allow(clippy::wildcard_imports)]
use super::*;
use crate::graph::{EinsumCfg, Subscript};

/// A dimension of the lined-up operands: a letter, or the `j`-th dimension under `...`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Dim {
    /// `...`'s `j`-th dimension.
    Ellipsis(usize),
    /// A letter (`Subscript::Label`).
    Label(u8),
}

/// What `sumproduct_pair` does for one equation on given operand shapes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Plan {
    /// The output shape, in the output's order.
    pub out: Shape,
    /// `[batch, left-only, contracted]` sizes of the left `bmm` operand.
    pub left3: [u64; 3],
    /// `[batch, contracted, right-only]` sizes of the right one.
    pub right3: [u64; 3],
    /// Whether each operand's reshape is a view (`false`: a copy).
    pub views: [bool; 2],
    /// Whether the output (a view of the `bmm` result) is contiguous.
    pub out_contiguous: bool,
}

/// Each subscript of `subs` as dimensions, `...` spread over the dimensions the operand has
/// beyond its letters (`rank`); `None` when the rank is too small.
fn dims_of(subs: &[Subscript], rank: usize) -> Option<Vec<Dim>> {
    let letters = subs.iter().filter(|s| **s != Subscript::Ellipsis).count();
    let mut out = Vec::with_capacity(rank);
    for &s in subs {
        match s {
            Subscript::Label(l) => out.push(Dim::Label(l)),
            Subscript::Ellipsis => {
                let n = rank.checked_sub(letters)?;
                out.extend((0..n).map(Dim::Ellipsis));
            }
        }
    }
    (out.len() == rank).then_some(out)
}

/// How an error names a dimension.
fn dim_name(d: Dim) -> String {
    match d {
        Dim::Label(l) => format!("subscript `{}`", Subscript::Label(l).text()),
        Dim::Ellipsis(j) => format!("`...` dimension {j}"),
    }
}

/// Whether the dimensions `group` (sizes `size`, strides `stride`) of a permuted operand merge
/// into one without a copy: after dropping size-1 dimensions, each one's stride is the next
/// one's stride times its size (ATen's `computeStride`, which `reshape` tries before copying).
fn mergeable(group: &[Dim], size: &HashMap<Dim, u64>, stride: &HashMap<Dim, u64>) -> bool {
    let dims: Vec<Dim> = group
        .iter()
        .copied()
        .filter(|d| size.get(d).copied().unwrap_or(1) != 1 && stride.contains_key(d))
        .collect();
    dims.windows(2)
        .all(|w| stride[&w[0]] == stride[&w[1]].saturating_mul(size[&w[1]]))
}

/// The strides of an operand whose dimensions are `dims` (shape `shape`), stored in `memory`
/// order (outermost first, as indices into `dims`).
fn strides(dims: &[Dim], shape: &[u64], memory: &[usize]) -> HashMap<Dim, u64> {
    let mut out = HashMap::new();
    let mut s = 1u64;
    for &i in memory.iter().rev() {
        out.insert(dims[i], s);
        s = s.saturating_mul(shape[i]);
    }
    out
}

/// The order in memory (outermost first) of a dense layout's dimensions, or `None` when the
/// layout is not known to be dense (memest then assumes `reshape` copies).
fn memory_order(layout: Layout, rank: usize) -> Option<Vec<usize>> {
    let mut order: Vec<usize> = (0..rank).collect();
    match layout {
        Layout::Contiguous => {}
        Layout::LastTwoSwapped if rank >= 2 => order.swap(rank - 2, rank - 1),
        Layout::HeadsTransposed if rank == 4 => order = vec![0, 2, 1, 3],
        Layout::SeqFirst if rank == 4 => order = vec![2, 0, 1, 3],
        _ => return None,
    }
    Some(order)
}

/// Plans `sumproduct_pair` for `c` on operands `a` and `b` (with their layouts).
pub(super) fn plan(
    c: &EinsumCfg,
    a: (&Shape, Layout),
    b: (&Shape, Layout),
) -> Result<Plan, ShapeError> {
    let (Some(ld), Some(rd)) = (dims_of(&c.left, a.0.rank()), dims_of(&c.right, b.0.rank())) else {
        let (shape, subs) = if dims_of(&c.left, a.0.rank()).is_none() {
            (a.0, &c.left)
        } else {
            (b.0, &c.right)
        };
        let names: String = subs.iter().map(|s| s.text()).collect();
        return wrong_rank(
            shape,
            format!(
                "one dimension per subscript of \"{names}\" in `equation` \"{}\"",
                c.equation
            ),
        );
    };
    let ell_left = ld.iter().filter(|d| matches!(d, Dim::Ellipsis(_))).count();
    let ell_right = rd.iter().filter(|d| matches!(d, Dim::Ellipsis(_))).count();
    if ell_left != ell_right {
        return invalid(format!(
            "`...` covers {ell_left} dimension(s) of the first operand {} and {ell_right} of the second {} in `equation` \"{}\"; memest needs the same number",
            a.0, b.0, c.equation
        ));
    }
    let mut size: HashMap<Dim, u64> = HashMap::new();
    for (dims, shape) in [(&ld, a.0), (&rd, b.0)] {
        for (d, &n) in dims.iter().zip(shape.dims()) {
            if let Some(&m) = size.get(d)
                && m != n
            {
                let name = dim_name(*d);
                return invalid(format!(
                    "{name} has size {m} in the first operand {} and {n} in the second {} (`equation` \"{}\")",
                    a.0, b.0, c.equation
                ));
            }
            size.insert(*d, n);
        }
    }
    let out_letters = c
        .output
        .iter()
        .filter(|s| **s != Subscript::Ellipsis)
        .count();
    let out_rank = out_letters
        + if c.output.contains(&Subscript::Ellipsis) {
            ell_left
        } else {
            0
        };
    let out_dims = dims_of(&c.output, out_rank).unwrap_or_default();
    // Contracted dimensions in ATen's subscript order (capitals first).
    let mut contracted: Vec<Dim> = ld
        .iter()
        .copied()
        .filter(|d| rd.contains(d) && !out_dims.contains(d))
        .collect();
    contracted.sort_unstable();
    let nontrivial = |dims: &[Dim], d: &Dim| dims.contains(d) && size[d] != 1;
    let (mut lro, mut lo, mut ro, mut sum) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for d in out_dims.iter().chain(&contracted) {
        let (sl, sr) = (nontrivial(&ld, d), nontrivial(&rd, d));
        if contracted.contains(d) {
            sum.push(*d);
        } else if sl && sr {
            lro.push(*d);
        } else if sl {
            lo.push(*d);
        } else {
            ro.push(*d);
        }
    }
    let product = |dims: &[Dim]| -> Result<u64, ShapeError> {
        dims.iter().try_fold(1u64, |p, d| {
            sized(p.checked_mul(size[d]), "an einsum operand size")
        })
    };
    let (b_n, m, k, n) = (product(&lro)?, product(&lo)?, product(&sum)?, product(&ro)?);
    let view = |dims: &[Dim], shape: &Shape, layout: Layout, groups: [&[Dim]; 3]| {
        memory_order(layout, dims.len()).is_some_and(|order| {
            let st = strides(dims, shape.dims(), &order);
            groups.iter().all(|g| mergeable(g, &size, &st))
        })
    };
    let views = [
        view(&ld, a.0, a.1, [&lro, &lo, &sum]),
        view(&rd, b.0, b.1, [&lro, &sum, &ro]),
    ];
    let memory: Vec<Dim> = lro.iter().chain(&lo).chain(&ro).copied().collect();
    let trivial = |d: &&Dim| size[*d] != 1;
    let out_contiguous = out_dims
        .iter()
        .filter(trivial)
        .eq(memory.iter().filter(trivial));
    Ok(Plan {
        out: Shape::new(out_dims.iter().map(|d| size[d]).collect()),
        left3: [b_n, m, k],
        right3: [b_n, k, n],
        views,
        out_contiguous,
    })
}

impl Tracer<'_> {
    /// `torch.einsum(equation, a, b)`: each operand copied into its `bmm` shape when a view
    /// cannot give it, one `bmm` (keeping both operands), the output a view of its result.
    pub(super) fn einsum(
        &mut self,
        c: &EinsumCfg,
        a: ValueId,
        b: ValueId,
    ) -> Result<ValueId, Error> {
        let a = self.autocast_input(a)?;
        let b = self.autocast_input(b)?;
        let (av, bv) = (self.val(a).clone(), self.val(b).clone());
        for v in [&av, &bv] {
            if !v.dtype.is_float() {
                return Err(self.err(format!(
                    "input is {} {}, expected a float tensor",
                    v.dtype, v.shape
                )));
            }
        }
        let p = self.shaped(plan(c, (&av.shape, av.layout), (&bv.shape, bv.layout)))?;
        let mut operands = Vec::new();
        for (v, val, dims, view) in [
            (a, &av, p.left3, p.views[0]),
            (b, &bv, p.right3, p.views[1]),
        ] {
            if view {
                operands.push(v);
            } else {
                let copy = self.fresh(
                    Shape::from(dims),
                    val.dtype,
                    "einsum operand copy",
                    val.requires_grad,
                )?;
                self.call(Call::new(AtenOp::Clone, vec![v], vec![copy]))?;
                operands.push(copy);
            }
        }
        let dtype = av.dtype;
        let rg = av.requires_grad || bv.requires_grad;
        let [batch, m, _] = p.left3;
        let y = self.fresh(Shape::from([batch, m, p.right3[2]]), dtype, "output", rg)?;
        self.call(Call::new(AtenOp::Bmm, operands, vec![y]))?;
        let layout = if p.out_contiguous {
            Layout::Contiguous
        } else {
            Layout::Strided
        };
        Ok(self.view_op(y, p.out, layout, AtenOp::Permute, true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(eq: &str) -> EinsumCfg {
        EinsumCfg::parse(eq).unwrap()
    }

    fn run(eq: &str, a: &[u64], b: &[u64]) -> Plan {
        plan(
            &cfg(eq),
            (&Shape::new(a.to_vec()), Layout::Contiguous),
            (&Shape::new(b.to_vec()), Layout::Contiguous),
        )
        .unwrap()
    }

    #[test]
    fn attention_scores_are_views() {
        // q·kᵀ: [6, 4, 5] × [6, 5, 6] (PyTorch 2.15: both operands views of the inputs).
        let p = run("bhqd,bhkd->bhqk", &[2, 3, 4, 5], &[2, 3, 6, 5]);
        assert_eq!(p.out, Shape::from([2, 3, 4, 6]));
        assert_eq!((p.left3, p.right3), ([6, 4, 5], [6, 5, 6]));
        assert_eq!(p.views, [true, true]);
        assert!(p.out_contiguous);
        let p = run("bhqk,bhkd->bhqd", &[2, 3, 4, 6], &[2, 3, 6, 5]);
        assert_eq!((p.left3, p.right3), ([6, 4, 6], [6, 6, 5]));
        assert_eq!(p.views, [true, true]);
    }

    #[test]
    fn heads_in_the_middle_are_copied() {
        // [b, q, h, d] → [b, h, q, d] cannot merge b and h: both operands are copied
        // (PyTorch 2.15: two `clone`s, then `_unsafe_view`).
        let p = run("bqhd,bkhd->bhqk", &[2, 4, 3, 5], &[2, 6, 3, 5]);
        assert_eq!(p.views, [false, false]);
        assert_eq!(p.out, Shape::from([2, 3, 4, 6]));
        assert!(p.out_contiguous);
    }

    #[test]
    fn ellipsis_and_shared_weights() {
        let p = run("...ij,...jk->...ik", &[2, 3, 4, 5], &[2, 3, 5, 6]);
        assert_eq!((p.left3, p.right3), ([6, 4, 5], [6, 5, 6]));
        let p = run("bij,jk->bik", &[2, 4, 5], &[5, 6]);
        assert_eq!((p.left3, p.right3), ([1, 8, 5], [1, 5, 6]));
        assert_eq!(p.views, [true, true]);
        // The output in another order than [batch, left, right] is a strided view.
        let p = run("bij,bjk->bki", &[2, 4, 5], &[2, 5, 6]);
        assert!(!p.out_contiguous);
    }

    #[test]
    fn sizes_and_ranks_are_checked() {
        let c = cfg("bij,bjk->bik");
        let s = |d: &[u64]| Shape::new(d.to_vec());
        assert!(
            plan(
                &c,
                (&s(&[2, 4, 5]), Layout::Contiguous),
                (&s(&[2, 6, 6]), Layout::Contiguous)
            )
            .is_err()
        );
        assert!(
            plan(
                &c,
                (&s(&[2, 4]), Layout::Contiguous),
                (&s(&[2, 5, 6]), Layout::Contiguous)
            )
            .is_err()
        );
    }
}
