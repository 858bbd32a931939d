//! The tape: what tracing records and the simulator replays.
//!
//! Storages are allocations; values are views of them as operators see them (a reshape or a
//! transpose makes a new value of the same storage). Steps are ATen-level operators in forward
//! order, each naming the storages it allocates, the storages autograd saves for its backward
//! and the inputs that receive a gradient. Everything is addressed by typed ids
//! ([`StorageId`], [`ValueId`], [`LayerId`], [`SegmentId`]) so that one kind of id cannot
//! index another's table.

use std::fmt;

use serde::Serialize;
use typed_index_collections::TiVec;

use crate::cost::TensorInfo;
use crate::dtype::DType;
use crate::shape::Shape;
use crate::spec::LayerKind;

use super::aten::AtenOp;

/// Declares a typed index: a 32-bit newtype that indexes one [`TiVec`] only. Four bytes
/// rather than a `usize`'s eight: a [`Step`] holds a dozen of them, and a tape of 100,000
/// layers 100,000 steps. A tape cannot reach 2^32 entries of any table ([`super::MAX_STEPS`]
/// operators, each making a few tensors; a billion storages would be 60 GB of tape first);
/// an index past `u32::MAX` would read as `u32::MAX`.
macro_rules! id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(u32);

        impl From<usize> for $name {
            fn from(i: usize) -> Self {
                debug_assert!(u32::try_from(i).is_ok(), "{i} entries in a tape table");
                $name(u32::try_from(i).unwrap_or(u32::MAX))
            }
        }

        impl From<$name> for usize {
            fn from(id: $name) -> usize {
                // Lossless: memest builds for 32- and 64-bit targets.
                id.0 as usize
            }
        }
    };
}

id! {
    /// Index of a storage in [`Tape::storages`].
    StorageId
}
id! {
    /// Index of a value in [`Tape::values`].
    ValueId
}
id! {
    /// Index of a layer in [`Tape::layers`] (index 0 is the input pseudo-layer).
    LayerId
}
id! {
    /// Index of a checkpointed segment in [`Tape::segments`].
    SegmentId
}

/// How many ids an [`IdList`] holds in place.
const INLINE_IDS: usize = 3;

/// A short list of typed ids ([`Step`]'s inputs, outputs, allocations, saves and gradients):
/// up to three in place, more on the heap. Nearly every operator reads, makes and saves one
/// to three tensors, so a step costs no allocation of its own (a model of 100,000 layers made
/// half a million small ones, each freed again when the tape is dropped). Reads as a slice.
/// Sixteen bytes for 32-bit ids (the longer lists, rare, behind one more pointer).
#[derive(Clone)]
pub struct IdList<T>(Ids<T>);

#[derive(Clone)]
enum Ids<T> {
    /// The first `.0` of `.1` (the rest are `T::default()`).
    Inline(u8, [T; INLINE_IDS]),
    /// More than [`INLINE_IDS`] at some point (boxed: a `Vec` in place would double the
    /// list's size).
    #[allow(clippy::box_collection)]
    Heap(Box<Vec<T>>),
}

impl<T: Copy + Default> Default for IdList<T> {
    fn default() -> Self {
        IdList(Ids::Inline(0, [T::default(); INLINE_IDS]))
    }
}

impl<T: Copy + Default> IdList<T> {
    /// An empty list.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `v`.
    pub fn push(&mut self, v: T) {
        match &mut self.0 {
            Ids::Inline(n, items) if usize::from(*n) < INLINE_IDS => {
                items[usize::from(*n)] = v;
                *n += 1;
            }
            Ids::Inline(_, items) => {
                let mut heap = Vec::with_capacity(2 * INLINE_IDS);
                heap.extend_from_slice(items);
                heap.push(v);
                self.0 = Ids::Heap(Box::new(heap));
            }
            Ids::Heap(heap) => heap.push(v),
        }
    }

    /// Removes every id.
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// Removes consecutive repeated ids, as [`Vec::dedup`].
    pub fn dedup(&mut self)
    where
        T: PartialEq,
    {
        match &mut self.0 {
            Ids::Inline(n, items) => {
                let mut kept = 0;
                for i in 0..usize::from(*n) {
                    if kept == 0 || items[kept - 1] != items[i] {
                        items[kept] = items[i];
                        kept += 1;
                    }
                }
                items[kept..].fill(T::default());
                // At most INLINE_IDS.
                *n = u8::try_from(kept).unwrap_or(u8::MAX);
            }
            Ids::Heap(heap) => heap.dedup(),
        }
    }
}

impl<T> std::ops::Deref for IdList<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.0 {
            Ids::Inline(n, items) => &items[..usize::from(*n)],
            Ids::Heap(heap) => heap,
        }
    }
}

impl<T> std::ops::DerefMut for IdList<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.0 {
            Ids::Inline(n, items) => &mut items[..usize::from(*n)],
            Ids::Heap(heap) => heap,
        }
    }
}

impl<T: fmt::Debug> fmt::Debug for IdList<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T: PartialEq> PartialEq for IdList<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: Eq> Eq for IdList<T> {}

impl<T: Copy + Default> Extend<T> for IdList<T> {
    fn extend<I: IntoIterator<Item = T>>(&mut self, iter: I) {
        for v in iter {
            self.push(v);
        }
    }
}

impl<T: Copy + Default> FromIterator<T> for IdList<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        let mut list = Self::default();
        list.extend(iter);
        list
    }
}

impl<T: Copy + Default> From<Vec<T>> for IdList<T> {
    fn from(v: Vec<T>) -> Self {
        if v.len() <= INLINE_IDS {
            v.into_iter().collect()
        } else {
            IdList(Ids::Heap(Box::new(v)))
        }
    }
}

impl<T: Copy + Default, const N: usize> From<[T; N]> for IdList<T> {
    fn from(v: [T; N]) -> Self {
        v.into_iter().collect()
    }
}

impl<'a, T> IntoIterator for &'a IdList<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<'a, T> IntoIterator for &'a mut IdList<T> {
    type Item = &'a mut T;
    type IntoIter = std::slice::IterMut<'a, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter_mut()
    }
}

/// A list that is nearly always empty ([`Step::scratch`], [`Step::reduced`]): one null
/// pointer until an item is pushed (8 bytes in each step rather than a `Vec`'s 24). Reads as
/// a slice.
#[derive(Clone, Default, PartialEq, Eq)]
#[allow(clippy::box_collection)] // a thin pointer is the point
pub struct RareList<T>(Option<Box<Vec<T>>>);

impl<T> RareList<T> {
    /// An empty list.
    #[must_use]
    pub const fn new() -> Self {
        RareList(None)
    }

    /// Appends `v`.
    pub fn push(&mut self, v: T) {
        self.0.get_or_insert_with(Box::default).push(v);
    }
}

impl<T> From<Vec<T>> for RareList<T> {
    fn from(v: Vec<T>) -> Self {
        RareList((!v.is_empty()).then(|| Box::new(v)))
    }
}

impl<T> std::ops::Deref for RareList<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        self.0.as_deref().map_or(&[], Vec::as_slice)
    }
}

impl<T> std::ops::DerefMut for RareList<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.0.as_deref_mut().map_or(&mut [], Vec::as_mut_slice)
    }
}

impl<T: fmt::Debug> fmt::Debug for RareList<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T> FromIterator<T> for RareList<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        iter.into_iter().collect::<Vec<T>>().into()
    }
}

impl<'a, T> IntoIterator for &'a RareList<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// What a storage holds, for the breakdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StorageKind {
    /// A parameter.
    Parameter,
    /// A buffer (BatchNorm running statistics, position-id and rotary tables).
    Buffer,
    /// The input batch and its labels.
    Input,
    /// Anything the forward pass computes.
    Activation,
    /// Keys and values cached by causal attention in inference (transformers' `use_cache`).
    KvCache,
    /// A decode step's cache before the step: live from the start, freed once `torch.cat`
    /// has copied it into the grown cache ([`super::Pass::Decode`]).
    PastKvCache,
    /// Another tensor that exists before the forward pass and is freed after its last use
    /// (a decode step's previous logits).
    Carried,
}

/// One allocation.
#[derive(Clone, Debug)]
pub struct Storage {
    /// Size in bytes: numel × element size.
    pub bytes: u64,
    /// Category.
    pub kind: StorageKind,
    /// What it is, e.g. `output`, `dropout noise`, `mean`.
    pub what: &'static str,
    /// Element type.
    pub dtype: DType,
    /// Shape at allocation.
    pub shape: Shape,
    /// Layer that allocated it (index into [`Tape::layers`]).
    pub layer: LayerId,
}

/// Memory layout of a value, which decides whether `reshape`/`matmul` must copy it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Row-major contiguous.
    Contiguous,
    /// Contiguous after swapping the last two dimensions (`k.transpose(-1, -2)`).
    LastTwoSwapped,
    /// `[B, heads, S, head_dim]` laid out as `[B, S, heads, head_dim]` (heads split out of a
    /// `[B, S, H]` projection by `view` + `transpose(1, 2)`): dense, but not contiguous.
    HeadsTransposed,
    /// `[B, heads, S, head_dim]` laid out as `[S, B, heads, head_dim]` (nn.MultiheadAttention's
    /// sequence-first packing): dense, but not contiguous.
    SeqFirst,
    /// `[B, heads, S, head_dim]` heads split out of a fused QKV projection `[B, S, 3H]`: the
    /// dimension order of [`Layout::HeadsTransposed`], with gaps between rows.
    HeadsStrided,
    /// `[B, C, H, W]` laid out as `[B, H, W, C]` (PyTorch's `channels_last` memory format): a
    /// contiguous `[B, H, W, C]` tensor permuted by `(0, 3, 1, 2)`, and what elementwise
    /// operators make from one (`TensorIterator` gives the output its input's layout).
    ChannelsLast,
    /// Any other strided view.
    Strided,
}

/// A tensor as an operator sees it: a view of a storage.
#[derive(Clone, Debug)]
pub struct Value {
    /// Backing storage.
    pub storage: StorageId,
    /// Shape of the view.
    pub shape: Shape,
    /// Element type.
    pub dtype: DType,
    /// Layout.
    pub layout: Layout,
    /// Whether autograd tracks it.
    pub requires_grad: bool,
    /// Set when the value is a parameter (its gradient goes to `.grad`).
    pub param: bool,
}

/// One operator in forward order.
#[derive(Clone, Debug)]
pub struct Step {
    /// Layer it belongs to (index into [`Tape::layers`]).
    pub layer: LayerId,
    /// The ATen-level operator, e.g. [`AtenOp::Addmm`], [`AtenOp::NativeLayerNorm`].
    pub op: AtenOp,
    /// Values read.
    pub inputs: IdList<ValueId>,
    /// Values produced.
    pub outputs: IdList<ValueId>,
    /// Storages allocated by this operator.
    pub allocs: IdList<StorageId>,
    /// Storages autograd saves for its backward.
    pub saves: IdList<StorageId>,
    /// Inputs that receive a gradient in backward.
    pub grads: IdList<ValueId>,
    /// The backward hands a view of the output's gradient to the input (views, reshapes).
    pub view_grad: bool,
    /// Checkpointed segment the step belongs to.
    pub segment: Option<SegmentId>,
    /// Tensors the operator makes and frees inside itself, beside its outputs, at its busiest
    /// moment (bytes of each block): `.0` in forward, `.1` in its backward, beside the
    /// gradients it returns. A function written out in Python (BLOOM's `GeLUFunction`) makes
    /// one tensor per operation; ATen kernels make none memest counts.
    pub scratch: (RareList<u64>, RareList<u64>),
    /// Inputs whose gradient the backward formula makes at the output's shape and dtype (the
    /// block's bytes) and autograd's engine then reduces to the input's (`validate_outputs`
    /// in `torch/csrc/autograd/engine.cpp`: `sum_to` a broadcast input's shape, `.to` its
    /// dtype): every formula's block is made first, in [`Step::grads`]' order, then each of
    /// these inputs' own gradient, in input order, while its formula block is still live.
    pub reduced: RareList<(ValueId, u64)>,
}

/// Per-layer facts for reports.
#[derive(Clone, Debug, Serialize)]
pub struct LayerInfo {
    /// Dotted path, e.g. `blocks.attn`: the enclosing blocks' names, then the layer's.
    pub path: String,
    /// Where the layer's own name starts in `path` (a byte offset; 0 outside blocks): see
    /// [`LayerInfo::name`]. The name is not stored twice.
    pub name_start: usize,
    /// Kind; `None` for the input pseudo-layer (index 0).
    pub kind: Option<LayerKind>,
    /// Copies (product of enclosing repeat counts).
    pub repeat: u64,
    /// Output shape (of one copy).
    pub output_shape: Shape,
    /// Parameters of one copy.
    pub params: u64,
    /// Parameter bytes of one copy.
    pub parameter_bytes: u64,
    /// Buffer bytes of one copy.
    pub buffer_bytes: u64,
}

impl LayerInfo {
    /// The layer's name: the end of its path (the whole path outside blocks).
    #[must_use]
    pub fn name(&self) -> &str {
        self.path.get(self.name_start..).unwrap_or(&self.path)
    }
}

/// A parameter tensor.
#[derive(Clone, Debug)]
pub struct Param {
    /// Shape, e.g. `[out_features, in_features]`.
    pub shape: Shape,
    /// Elements (the parameter count).
    pub numel: u64,
    /// Bytes as stored: numel × element size, or for a quantized weight its packed values plus
    /// scales and zero points (its value's `dtype` is then the compute dtype).
    pub bytes: u64,
    /// Trains (has a gradient and optimizer state).
    pub trainable: bool,
    /// Its value.
    pub value: ValueId,
    /// Storage dtype name: a dtype, or a quantization format (`nf4`, `int8`, `int4`, `fp8`).
    pub dtype_name: &'static str,
}

impl Param {
    /// The facts the cost model sizes it by.
    #[must_use]
    pub fn info(&self) -> TensorInfo<'_> {
        TensorInfo {
            shape: self.shape.dims(),
            numel: self.numel,
            bytes: self.bytes,
        }
    }
}

/// A checkpointed range of steps (one copy of a repeated block under `--checkpoint`).
#[derive(Clone, Debug)]
pub struct Segment {
    /// First step index.
    pub start: usize,
    /// One past the last step index.
    pub end: usize,
    /// The block input the checkpoint saves.
    pub input: StorageId,
}

/// The traced forward pass.
#[derive(Clone, Debug, Default)]
pub struct Tape {
    /// Every storage.
    pub storages: TiVec<StorageId, Storage>,
    /// Every value.
    pub values: TiVec<ValueId, Value>,
    /// Parameter tensors (tied weights once).
    pub params: Vec<Param>,
    /// Operators in forward order.
    pub steps: Vec<Step>,
    /// Layers, in the order first traced.
    pub layers: TiVec<LayerId, LayerInfo>,
    /// Storages the caller keeps until the step ends: the model output and the loss.
    pub held: Vec<StorageId>,
    /// Storages a local variable of the model's `forward` keeps until the forward pass ends
    /// (transformers' `position_embeddings`: the rotary `cos`/`sin`, computed once in the base
    /// model's `forward` and passed to every layer); after that, only autograd's saves keep
    /// them, and backward frees them as any saved tensor.
    pub forward_held: Vec<StorageId>,
    /// Checkpointed segments.
    pub segments: TiVec<SegmentId, Segment>,
    /// The step ranges of each copy of an outermost repeated block, in order: the units an
    /// FSDP or ZeRO-3 run gathers parameters for (`fully_shard` per decoder layer).
    pub blocks: Vec<std::ops::Range<usize>>,
    /// Shape of the input batch.
    pub input_shape: Shape,
    /// Whether the model ends in a loss layer.
    pub has_loss: bool,
    /// The repeated blocks traced once (not inside a block of several copies), in trace order:
    /// where each copy's steps are.
    pub repeats: Vec<BlockCopies>,
    /// Tensor parallelism: the parameters whose gradient is larger than their local part,
    /// with the gradient's shape (DTensor's vocab-parallel embedding gets a whole, replicated
    /// weight gradient: see [`crate::parallel::TpStyle::Dtensor`]).
    pub grad_shapes: std::collections::HashMap<ValueId, Shape>,
    /// Tensor parallelism: the parameters of the layers split across the ranks (the
    /// vocab-parallel embedding, the LM head, column- and row-parallel linears, attention
    /// projections). Under `--tp-style dtensor` they are DTensors: `Shard` placements, but
    /// `Replicate` for a row-parallel linear's bias, which is whole. The other parameters are
    /// plain tensors, whole on every rank.
    pub tp_split: std::collections::HashSet<ValueId>,
}

/// Where the copies of a repeated block are on the tape: copy `k` is the steps
/// `starts[k]..starts[k + 1]` (the last one `..end`).
#[derive(Clone, Debug, Default)]
pub struct BlockCopies {
    /// The block's positions through blocks (as in [`crate::error::LayerAt::positions`]).
    pub positions: Vec<usize>,
    /// The first step of each copy.
    pub starts: Vec<usize>,
    /// One past the last step of the last copy.
    pub end: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[usize]) -> Vec<ValueId> {
        v.iter().map(|&i| ValueId::from(i)).collect()
    }

    #[test]
    fn id_list_reads_as_a_vec() {
        let mut list = IdList::from(ids(&[3, 3, 1]));
        assert_eq!(list.len(), 3);
        list.dedup();
        assert_eq!(&list[..], ids(&[3, 1]));
        list.extend(ids(&[1, 7, 7]));
        // Past three on the heap, the same list.
        assert_eq!(&list[..], ids(&[3, 1, 1, 7, 7]));
        list.sort_unstable();
        list.dedup();
        assert_eq!(&list[..], ids(&[1, 3, 7]));
        assert_eq!(list, IdList::from([1, 3, 7].map(ValueId::from)));
        assert_eq!(format!("{list:?}"), "[ValueId(1), ValueId(3), ValueId(7)]");
        list.clear();
        assert!(list.is_empty());
        assert_eq!(list, IdList::new());
        let mut rare = RareList::new();
        assert!(rare.is_empty());
        rare.push(3u64);
        rare.push(4);
        rare[1] = 5;
        assert_eq!(&rare[..], [3, 5]);
        assert_eq!(rare, RareList::from(vec![3, 5]));
        assert_eq!(RareList::<u64>::from(Vec::new()), RareList::new());
        assert_eq!(format!("{rare:?}"), "[3, 5]");
    }

    #[test]
    fn a_layer_name_is_the_end_of_its_path() {
        let mut info = LayerInfo {
            path: "blocks.attn".into(),
            name_start: 7,
            kind: None,
            repeat: 1,
            output_shape: Shape::default(),
            params: 0,
            parameter_bytes: 0,
            buffer_bytes: 0,
        };
        assert_eq!(info.name(), "attn");
        info.name_start = 0;
        assert_eq!(info.name(), "blocks.attn");
        // Not on a character boundary or past the end: the whole path, no panic.
        info.path = "é.x".into();
        info.name_start = 1;
        assert_eq!(info.name(), "é.x");
        info.name_start = 9;
        assert_eq!(info.name(), "é.x");
    }

    /// What a 100,000-layer tape is made of: these sizes are its bytes per operator.
    #[test]
    fn tape_rows_stay_small() {
        assert_eq!(size_of::<StorageId>(), 4);
        assert_eq!(size_of::<IdList<ValueId>>(), 16);
        assert_eq!(size_of::<IdList<StorageId>>(), 16);
        assert_eq!(size_of::<RareList<u64>>(), 8);
        assert_eq!(size_of::<Step>(), 120);
        assert_eq!(size_of::<Storage>(), 56);
        assert_eq!(size_of::<Value>(), 32);
    }
}
