//! The replay's tensors as the CUDA caching allocator sees them: each tensor the replay makes
//! live or dead becomes a `malloc` or `free` of [`crate::alloc::CachingAllocator`], under a
//! key naming what the tensor is.
//!
//! A developer's aid: with the environment variable `MEMEST_ALLOC_TRACE` set to a file name, the
//! allocator replay writes its stream there when it ends (`a KEY BYTES RESERVED_AFTER` per
//! malloc, `f KEY` per block freed, `r FROM TO BLOCKS` when blocks change key, `# F|B|R STEP OP
//! LAYER` before each forward, backward and recomputed step, `# OPT` before the optimizer step,
//! `# RESET` where the peaks are reset). `tools/alloc_trace_diff.py` compares it with
//! `tools/measure_fake_cuda.py --trace`'s stream. It changes no figure. A [`Heap::recorder`]
//! (the symbolic treatment of repeats' traces) runs no allocator and writes nothing: to
//! trace a model with a repeated block, unroll it (`--timeline` does).

use std::collections::HashMap;

use foldhash::fast::RandomState;

use crate::alloc::{BlockId, CachingAllocator, Config};
use crate::error::Error;
use crate::trace::{StorageId, ValueId};

/// What a block holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum Key {
    /// A storage of the tape.
    Storage(StorageId),
    /// The gradient of an activation value, while backward holds it.
    Grad(ValueId),
    /// A gradient handed on as a view, between its output and its input.
    Moved,
    /// A parameter's `.grad`.
    ParamGrad(ValueId),
    /// The float32 copy of a parameter's 16-bit gradient (`mixed-*` recipes).
    MasterGrad(ValueId),
    /// A parameter's float32 master copy.
    Master(ValueId),
    /// A parameter's optimizer state.
    State(ValueId),
    /// State shared by all parameters.
    SharedState,
    /// Gradients made and summed away at one backward step.
    Transient,
    /// The optimizer step's temporaries.
    StepTemporaries,
    /// An EMA copy of the weights.
    Ema,
    /// DDP's flat bucket tensors.
    DdpBucket,
    /// A unit's gathered (unsharded) parameters, FSDP.
    Gathered(usize),
    /// A unit's all-gather output buffer, FSDP2.
    GatherBuffer(usize),
    /// A unit's reduce-scatter input, FSDP2.
    ReduceBuffer(usize),
    /// A unit's gradient shards (the reduce-scatter output), FSDP2.
    ShardGrads(usize),
}

/// One request or free the allocator was fed, as [`Heap::record`] keeps them: what the
/// symbolic treatment of repeats (`crate::symbolic`) extends from a few copies of a block to
/// many. Each block has a serial number (its allocation's order among the recorded ones). Steps
/// of the tape say where the operation happened (`at`: the operator being processed, or the
/// first operator that touches the parameter being processed, else the block's owner) and whose
/// tensor the block holds (`owner`: the first operator that touches its storage; for a
/// temporary, the operator being processed); `None` for what belongs to no operator (state
/// shared by all parameters, an EMA copy, several GPUs' buffers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HeapOp {
    /// A request of `bytes` (above zero) that became block `serial`.
    Alloc {
        /// The block's serial number.
        serial: u64,
        /// Bytes requested.
        bytes: u64,
        /// The step whose tensor it holds.
        owner: Option<usize>,
        /// The step being processed.
        at: Option<usize>,
    },
    /// The free of block `serial`.
    Free {
        /// The block's serial number.
        serial: u64,
        /// The step being processed.
        at: Option<usize>,
    },
    /// `torch.cuda.reset_peak_memory_stats()`.
    ResetPeaks,
}

/// A block handed out: the allocator's id (none for [`Heap::recorder`]), its serial number and
/// owner (for [`HeapOp`]).
#[derive(Clone, Copy, Debug)]
struct Held {
    block: Option<BlockId>,
    serial: u64,
    owner: Option<usize>,
}

/// The blocks under one key in request order: most keys hold one, kept inline (a `Vec` per
/// key was an allocation per tensor).
#[derive(Debug, Default)]
struct Holds {
    first: Option<Held>,
    rest: Vec<Held>,
}

impl Holds {
    fn push(&mut self, h: Held) {
        if self.first.is_none() {
            self.first = Some(h);
        } else {
            self.rest.push(h);
        }
    }

    fn len(&self) -> usize {
        usize::from(self.first.is_some()) + self.rest.len()
    }
}

impl IntoIterator for Holds {
    type Item = Held;
    type IntoIter = std::iter::Chain<std::option::IntoIter<Held>, std::vec::IntoIter<Held>>;

    fn into_iter(self) -> Self::IntoIter {
        self.first.into_iter().chain(self.rest)
    }
}

/// The allocator, the blocks under each key, and the first error met.
pub(super) struct Heap {
    /// `None` for [`Heap::recorder`].
    alloc: Option<CachingAllocator>,
    /// By key, hashed with foldhash: a step touches several keys, so std's SipHash showed in
    /// profiles of 100,000-layer models.
    blocks: HashMap<Key, Holds, RandomState>,
    error: Option<Error>,
    /// The stream, when `MEMEST_ALLOC_TRACE` names a file to write it to (module docs).
    trace: Option<Vec<String>>,
    /// The step being processed ([`Heap::at`]).
    at: Option<usize>,
    /// Blocks handed out so far (the next serial number).
    serials: u64,
    /// Every operation, when asked for ([`Heap::record`]).
    pub log: Option<Vec<HeapOp>>,
}

/// The environment variable naming the file [`Heap`] writes its stream to.
const TRACE_VAR: &str = "MEMEST_ALLOC_TRACE";

impl Drop for Heap {
    /// Writes the stream (a developer's aid: a file that cannot be written is skipped).
    fn drop(&mut self) {
        if let (Some(t), Some(p)) = (&self.trace, std::env::var_os(TRACE_VAR)) {
            let _ = std::fs::write(p, t.join("\n") + "\n");
        }
    }
}

impl Heap {
    /// An allocator with nothing reserved.
    pub(super) fn new(config: Config) -> Heap {
        Heap {
            alloc: Some(CachingAllocator::new(config)),
            blocks: HashMap::default(),
            error: None,
            trace: std::env::var_os(TRACE_VAR).map(|_| Vec::new()),
            at: None,
            serials: 0,
            log: None,
        }
    }

    /// A heap that only records the stream ([`Heap::log`], from the start): no allocator runs,
    /// and [`Heap::peaks`] has no figures. The symbolic treatment of repeats checks a trace's
    /// stream against its program and plays the program itself (`crate::symbolic`).
    pub(super) fn recorder() -> Heap {
        let mut heap = Heap::new(Config::default());
        heap.alloc = None;
        heap.trace = None;
        heap.record();
        heap
    }

    /// Keeps every operation from now on in [`Heap::log`].
    pub(super) fn record(&mut self) {
        self.log = Some(Vec::new());
    }

    /// Whether operations are being recorded.
    pub(super) fn recording(&self) -> bool {
        self.log.is_some()
    }

    /// Sets the step being processed (`None`: none, a block's owner then stands for it).
    pub(super) fn at(&mut self, step: Option<usize>) {
        self.at = step;
    }

    /// The step being processed, if set.
    pub(super) fn at_step(&self) -> Option<usize> {
        self.at
    }

    /// A block of `bytes` under `key` (a key may hold several), holding a tensor of step
    /// `owner`.
    pub(super) fn alloc(&mut self, key: Key, bytes: u64, owner: Option<usize>) {
        // PyTorch's allocator answers zero bytes with no block (`CachingAllocator::malloc`).
        let r = match &mut self.alloc {
            Some(a) => a.malloc(bytes).map(|b| b.map(Some)),
            None => Ok((bytes > 0).then_some(None)),
        };
        if let (Some(t), Some(a)) = (&mut self.trace, &self.alloc) {
            t.push(format!("a {key:?} {bytes} {}", a.reserved()));
        }
        match r {
            Ok(Some(block)) => {
                let serial = self.serials;
                self.serials += 1;
                if let Some(log) = &mut self.log {
                    log.push(HeapOp::Alloc {
                        serial,
                        bytes,
                        owner,
                        at: self.at.or(owner),
                    });
                }
                self.blocks.entry(key).or_default().push(Held {
                    block,
                    serial,
                    owner,
                });
            }
            Ok(None) => {}
            Err(e) => {
                self.error.get_or_insert(e);
            }
        }
    }

    /// Frees every block under `key` (none: nothing).
    pub(super) fn free(&mut self, key: Key) {
        for h in self.blocks.remove(&key).unwrap_or_default() {
            if let Some(t) = &mut self.trace {
                t.push(format!("f {key:?}"));
            }
            if let Some(log) = &mut self.log {
                log.push(HeapOp::Free {
                    serial: h.serial,
                    at: self.at.or(h.owner),
                });
            }
            if let (Some(a), Some(b)) = (&mut self.alloc, h.block)
                && let Err(e) = a.free(b)
            {
                self.error.get_or_insert(e);
            }
        }
    }

    /// A mark in the stream, when it is written (module docs).
    pub(super) fn note(&mut self, f: impl FnOnce() -> String) {
        if let Some(t) = &mut self.trace {
            t.push(f());
        }
    }

    /// Frees every block whose key `pick` selects, in the keys' order (the allocator's state
    /// after a run of frees does not depend on their order: freed neighbours always merge).
    pub(super) fn free_all(&mut self, pick: impl Fn(&Key) -> bool) {
        let mut keys: Vec<Key> = self.blocks.keys().filter(|k| pick(k)).copied().collect();
        keys.sort_unstable();
        for k in keys {
            self.free(k);
        }
    }

    /// Moves the blocks under `from` to `to` (the same tensors under a new name).
    pub(super) fn rename(&mut self, from: Key, to: Key) {
        if let Some(bs) = self.blocks.remove(&from) {
            if let Some(t) = &mut self.trace {
                t.push(format!("r {from:?} {to:?} {}", bs.len()));
            }
            let holds = self.blocks.entry(to).or_default();
            for h in bs {
                holds.push(h);
            }
        }
    }

    /// Restarts the peaks from now (`torch.cuda.reset_peak_memory_stats()`).
    pub(super) fn reset_peaks(&mut self) {
        if let Some(t) = &mut self.trace {
            t.push("# RESET".to_string());
        }
        if let Some(log) = &mut self.log {
            log.push(HeapOp::ResetPeaks);
        }
        if let Some(a) = &mut self.alloc {
            a.reset_peaks();
        }
    }

    /// The peaks since the last reset: (`max_memory_allocated`, `max_memory_reserved`), none
    /// for a [`Heap::recorder`], or the first error met.
    pub(super) fn peaks(&self) -> Result<Option<(u64, u64)>, Error> {
        match &self.error {
            Some(e) => Err(e.clone()),
            None => Ok(self
                .alloc
                .as_ref()
                .map(|a| (a.max_allocated(), a.max_reserved()))),
        }
    }
}
