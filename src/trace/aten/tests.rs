//! The table against PyTorch's derivatives.yaml, and its internal consistency.

use std::collections::{BTreeMap, BTreeSet};

use super::*;

/// Every operator.
fn all() -> impl Iterator<Item = AtenOp> {
    <AtenOp as strum::IntoEnumIterator>::iter()
}

/// Where memest's table knowingly differs from derivatives.yaml: (operator, tensor, why).
const KNOWN: &[(AtenOp, &str, &str)] = &[
    (
        AtenOp::CudnnAttention,
        "cum_seq_q",
        "undefined for dense (not nested) inputs: no tensor",
    ),
    (
        AtenOp::CudnnAttention,
        "cum_seq_k",
        "undefined for dense (not nested) inputs: no tensor",
    ),
    (
        AtenOp::CudnnAttention,
        "max_q",
        "a SymInt (the longest query sequence), not a tensor",
    ),
    (
        AtenOp::CudnnAttention,
        "max_k",
        "a SymInt (the longest key sequence), not a tensor",
    ),
    (
        AtenOp::CudnnRnn,
        "cx",
        "a GRU has no cell state: `_cudnn_rnn` gets no `cx`",
    ),
    (
        AtenOp::CudnnRnn,
        "result4",
        "the flat weight buffer: `nn.GRU` on CUDA passes its parameters' own buffer (`flatten_parameters`)",
    ),
    (
        AtenOp::CudnnLstm,
        "result4",
        "the flat weight buffer: `nn.LSTM` on CUDA passes its parameters' own buffer (`flatten_parameters`)",
    ),
    (
        AtenOp::CudnnRnn,
        "dropout_state",
        "no dropout between layers (memest's `gru` has no `dropout` key): undefined",
    ),
    (
        AtenOp::CudnnLstm,
        "dropout_state",
        "no dropout between layers (memest's `lstm` has no `dropout` key): undefined",
    ),
    (
        AtenOp::NativeBatchNorm,
        "running_mean",
        "a buffer, alive all step: memest does not pass it",
    ),
    (
        AtenOp::NativeBatchNorm,
        "running_var",
        "a buffer, alive all step: memest does not pass it",
    ),
    (
        AtenOp::NllLoss,
        "weight",
        "no class weights (`F.cross_entropy(weight=None)`)",
    ),
    (
        AtenOp::Bmm,
        "self",
        "codegen saves it only when `mat2` needs a gradient; memest keeps both operands",
    ),
    (
        AtenOp::Bmm,
        "mat2",
        "codegen saves it only when `self` needs a gradient; memest keeps both operands",
    ),
];

/// A saved tensor by name, with the input whose gradient alone needs it (`None`: saved
/// whenever autograd records the operator).
type Saves = BTreeSet<(String, Option<String>)>;

/// What `op`'s row says it saves, by ATen name.
fn table_saves(op: AtenOp) -> Saves {
    let s = op.spec();
    let mut out = Saves::new();
    for saved in s.saves.always {
        let name = match *saved {
            Input(i) | OptionalInput(i) | InputClone(i) => s.inputs[i],
            Output(i) => s.outputs[i],
            Aux(i) => s.aux[i],
        };
        out.insert((name.to_string(), None));
    }
    if s.saves.each_other {
        let (a, b) = (s.inputs[0], s.inputs[1]);
        out.insert((a.to_string(), Some(b.to_string())));
        out.insert((b.to_string(), Some(a.to_string())));
    }
    out
}

/// What derivatives.json says `entry` saves. A tensor named by one formula for one input is
/// saved only when that input needs a gradient, unless it is the only differentiable input
/// (then autograd records the operator only when it does).
fn upstream_saves(entry: &serde_json::Value) -> Saves {
    let differentiable = entry["differentiable"].as_array().unwrap().len();
    let mut out = Saves::new();
    for (name, formulas) in entry["saved"].as_object().unwrap() {
        let formulas: Vec<&str> = formulas
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f.as_str().unwrap())
            .collect();
        let guard = match formulas.as_slice() {
            [one] if !one.contains(',') && differentiable > 1 => Some((*one).to_string()),
            _ => None,
        };
        out.insert((name.clone(), guard));
    }
    out
}

#[test]
fn every_rule_names_tensors_its_row_declares() {
    for op in all() {
        let s = op.spec();
        for saved in s.saves.always {
            let ok = match *saved {
                Input(i) | OptionalInput(i) | InputClone(i) => i < s.inputs.len(),
                Output(i) => i < s.outputs.len(),
                Aux(i) => i < s.aux.len(),
            };
            assert!(ok, "{op:?}: {saved:?}");
        }
        assert!(!s.saves.each_other || s.inputs.len() >= 2, "{op:?}");
        let clones = s.saves.always.iter().any(|s| matches!(s, InputClone(_)));
        assert!(
            !clones || op.is_inplace(),
            "{op:?} clones but is not in place"
        );
    }
}

/// The table agrees with PyTorch's derivatives.yaml (tests/data/derivatives.json, made by
/// tools/derivatives.py), but for the differences listed in `KNOWN`.
#[test]
fn saves_match_derivatives_yaml() {
    let data: serde_json::Value =
        serde_json::from_str(include_str!("../../../tests/data/derivatives.json")).unwrap();
    let ops = data["ops"].as_object().unwrap();
    let mut checked = BTreeMap::new();
    for op in all() {
        let Some(yaml) = op.spec().yaml else { continue };
        let entry = ops.get(yaml).unwrap_or_else(|| {
            panic!("{op:?}: {yaml} is not in derivatives.json; run tools/derivatives.py")
        });
        let known = |name: &str| KNOWN.iter().any(|&(o, n, _)| o == op && n == name);
        let ours: Saves = table_saves(op)
            .into_iter()
            .filter(|(n, _)| !known(n))
            .collect();
        let theirs: Saves = upstream_saves(entry)
            .into_iter()
            .filter(|(n, _)| !known(n))
            .collect();
        assert_eq!(ours, theirs, "{op:?} ({yaml})");
        checked.insert(yaml, op);
    }
    // Every entry of the data is a row of the table (no stale data).
    for yaml in ops.keys() {
        assert!(checked.contains_key(yaml.as_str()), "{yaml} is in no row");
    }
}

#[test]
fn in_place_rows_are_in_place() {
    for op in all() {
        let ends = op.name().split('.').next().unwrap().ends_with('_');
        assert_eq!(op.is_inplace(), ends, "{op:?}");
    }
}

/// [`AtenOp::grads_by_name`] holds exactly for the operators whose entry in derivatives.yaml
/// has two or more differentiable inputs, each with its own formula (none of the saved tensors'
/// formulas is keyed by several names, as `input, weight, bias` is), and whose row names them.
#[test]
fn grads_by_name_matches_separate_formulas() {
    let data: serde_json::Value =
        serde_json::from_str(include_str!("../../../tests/data/derivatives.json")).unwrap();
    let ops = data["ops"].as_object().unwrap();
    for op in all() {
        let s = op.spec();
        let separate = s.yaml.is_some_and(|yaml| {
            let entry = &ops[yaml];
            let grouped = entry["saved"]
                .as_object()
                .unwrap()
                .values()
                .flat_map(|f| f.as_array().unwrap())
                .any(|f| f.as_str().unwrap().contains(','));
            let differentiable = entry["differentiable"].as_array().unwrap().len();
            !grouped && differentiable > 1 && s.inputs.len() > 1
        });
        assert_eq!(op.grads_by_name(), separate, "{op:?}");
    }
}
