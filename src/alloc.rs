//! A model of PyTorch's CUDA caching allocator (`c10/cuda/CUDACachingAllocator.cpp`,
//! `DeviceCachingAllocator`), one device and one stream, fed an ordered stream of allocations
//! and frees. It answers what `torch.cuda.max_memory_allocated()` (the `allocated_bytes` stat:
//! the sizes of the blocks handed out) and `torch.cuda.max_memory_reserved()` (the
//! `reserved_bytes` stat: the segments taken from the driver) would report.
//!
//! What it follows, by function of the source:
//! - `round_size`: a request is rounded up to a multiple of 512 B (`kMinBlockSize`), at least
//!   512 B (`roundup_power2_divisions` is off by default and not modelled);
//! - `get_pool`: rounded sizes up to 1 MiB (`kSmallSize`) go to the small pool, larger ones to
//!   the large pool; each pool keeps its own free blocks;
//! - `get_allocation_size`: a new segment is 2 MiB (`kSmallBuffer`) for the small pool, 20 MiB
//!   (`kLargeBuffer`) for a large request under 10 MiB (`kMinLargeAlloc`), else the request
//!   rounded up to 2 MiB (`kRoundLarge`);
//! - `get_free_block`: best fit, the smallest free block of the pool at least as large, ties to
//!   the lowest address (`BlockComparatorSize`); with `max_split_size` set, a block at or over it
//!   is not given to a smaller request, nor to a larger one it exceeds by 20 MiB or more;
//! - `should_split`: the rest of a small-pool block is split off when it is at least 512 B, the
//!   rest of a large-pool block when it is over 1 MiB (and the request is under
//!   `max_split_size`); an unsplit rest stays in the block and counts as allocated;
//! - `free_block` / `try_merge_blocks`: a freed block merges with free neighbours of its
//!   segment;
//! - no segment is ever released: `empty_cache` is not called within a step, and the release
//!   paths of `malloc` run only when `cudaMalloc` fails, which is not modelled (no OOM);
//! - `expandable_segments:True` (`PYTORCH_CUDA_ALLOC_CONF`, Note [Expandable Segments]): one
//!   segment per pool whose virtual address space grows by mapping pages, 2 MiB for the small
//!   pool and 20 MiB for the large one (`find_expandable_block`, `map_block`,
//!   `try_allocate_expandable_block`); every rest of at least 512 B is split off; best fit
//!   prefers a block that cannot grow into the unmapped tail over one of the same fit that can
//!   (`get_free_block`'s `expandable_size`).
//!
//! Where the model chooses: `cudaMalloc`'s addresses are the driver's; here each new segment
//! lies above the previous ones, so that ties between free blocks of equal size go to the
//! older segment. The reserved address space of an expandable segment (PyTorch: 9/8 of the
//! device's memory) is unbounded here, as memory itself is.

use std::collections::{BTreeSet, HashMap};

use crate::error::Error;

mod pool;

/// Every request is rounded up to a multiple of this (`kMinBlockSize`, 512 B).
pub const MIN_BLOCK_BYTES: u64 = 512;
/// The largest rounded request of the small pool (`kSmallSize`, 1 MiB).
pub const SMALL_SIZE_BYTES: u64 = 1 << 20;
/// A small-pool segment, and an expandable small-pool page (`kSmallBuffer`, 2 MiB).
pub const SMALL_BUFFER_BYTES: u64 = 2 << 20;
/// A large-pool segment for requests under [`MIN_LARGE_ALLOC_BYTES`], and an expandable
/// large-pool page (`kLargeBuffer`, 20 MiB).
pub const LARGE_BUFFER_BYTES: u64 = 20 << 20;
/// Large requests from this size on get a segment of their own size (`kMinLargeAlloc`, 10 MiB).
pub const MIN_LARGE_ALLOC_BYTES: u64 = 10 << 20;
/// Such a segment is rounded up to a multiple of this (`kRoundLarge`, 2 MiB).
pub const ROUND_LARGE_BYTES: u64 = 2 << 20;

/// The address space given to one expandable segment. PyTorch reserves 9/8 of the device's
/// memory; memory is unbounded here, so the space is too (64 TiB).
const EXPANDABLE_SPACE_BYTES: u64 = 1 << 46;
/// Room left between two segments' addresses, so that no two segments touch.
const SEGMENT_GAP_BYTES: u64 = 1 << 30;

/// A request rounded as `round_size` does: up to a multiple of 512 B, at least 512 B.
/// `None` when the rounding passes 64 bits.
#[must_use]
pub fn round_size(bytes: u64) -> Option<u64> {
    if bytes < MIN_BLOCK_BYTES {
        Some(MIN_BLOCK_BYTES)
    } else {
        bytes.div_ceil(MIN_BLOCK_BYTES).checked_mul(MIN_BLOCK_BYTES)
    }
}

/// The segment `cudaMalloc` is asked for when no free block fits a rounded request of `size`
/// bytes (`get_allocation_size`): 2 MiB up to 1 MiB, 20 MiB under 10 MiB, else `size` rounded
/// up to 2 MiB. `None` when the rounding passes 64 bits.
#[must_use]
pub fn allocation_size(size: u64) -> Option<u64> {
    if size <= SMALL_SIZE_BYTES {
        Some(SMALL_BUFFER_BYTES)
    } else if size < MIN_LARGE_ALLOC_BYTES {
        Some(LARGE_BUFFER_BYTES)
    } else {
        size.div_ceil(ROUND_LARGE_BYTES)
            .checked_mul(ROUND_LARGE_BYTES)
    }
}

/// The allocator's settings (`PYTORCH_CUDA_ALLOC_CONF`); the default is PyTorch's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Config {
    /// `expandable_segments:True`.
    pub expandable_segments: bool,
    /// `max_split_size_mb`, in bytes (`None`: unlimited, the default).
    pub max_split_size: Option<u64>,
}

impl Config {
    fn max_split(&self) -> u64 {
        self.max_split_size.unwrap_or(u64::MAX)
    }
}

/// A block handed out by [`CachingAllocator::malloc`], to give back to
/// [`CachingAllocator::free`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockId(usize);

impl BlockId {
    /// The block's slot: a small number, reused once the block is merged away or freed and
    /// taken again (a key for tables beside the allocator).
    pub(crate) fn index(self) -> usize {
        self.0
    }
}

/// One segment of [`CachingAllocator::segments`]: its pool and its blocks in address order,
/// each its size and, when handed out, its id.
pub(crate) struct SegmentBlocks {
    /// In the small pool.
    pub small: bool,
    /// (size, the block when handed out), in address order.
    pub blocks: Vec<(u64, Option<BlockId>)>,
}

/// One block of a segment: handed out, free (cached), or for an expandable segment unmapped.
#[derive(Clone, Copy, Debug)]
struct Block {
    addr: u64,
    size: u64,
    prev: Option<usize>,
    next: Option<usize>,
    allocated: bool,
    /// Backed by memory; only an expandable segment's tail is not.
    mapped: bool,
    /// In the small pool.
    small: bool,
    /// The expandable segment it belongs to (index into `CachingAllocator::segments`).
    expandable: Option<usize>,
    /// While in its pool's free blocks, the stamp it is filed under there ([`pool::Pool`]);
    /// 0 otherwise.
    stamp: u64,
}

/// An expandable segment: the page it maps at a time.
#[derive(Clone, Copy, Debug)]
struct Expandable {
    page: u64,
}

/// The allocator's state: its segments split into blocks, the free blocks of each pool, and
/// the `allocated_bytes` and `reserved_bytes` stats with their peaks.
#[derive(Clone, Debug, Default)]
pub struct CachingAllocator {
    config: Config,
    blocks: Vec<Block>,
    /// Slots of `blocks` no longer in use.
    spare: Vec<usize>,
    /// Free mapped blocks per pool (`[large, small]`): `BlockPool::blocks`.
    free: [pool::Pool; 2],
    /// The last stamp given to a block filed in a free pool.
    stamps: u64,
    /// Unmapped blocks per pool, by address: `BlockPool::unmapped`.
    unmapped: [BTreeSet<(u64, usize)>; 2],
    segments: Vec<Expandable>,
    next_addr: u64,
    allocated: u64,
    reserved: u64,
    max_allocated: u64,
    max_reserved: u64,
}

fn overflow() -> Error {
    Error::Overflow("the caching allocator's address space".into())
}

impl CachingAllocator {
    /// An allocator with nothing reserved.
    #[must_use]
    pub fn new(config: Config) -> CachingAllocator {
        // Expandable segments read the free blocks in best-fit order past the best fit.
        let free = if config.expandable_segments {
            [pool::Pool::with_order(), pool::Pool::with_order()]
        } else {
            Default::default()
        };
        CachingAllocator {
            config,
            free,
            next_addr: 1 << 40,
            ..CachingAllocator::default()
        }
    }

    /// Bytes of the blocks handed out now (`allocated_bytes.current`).
    #[must_use]
    pub fn allocated(&self) -> u64 {
        self.allocated
    }

    /// Bytes of the segments (or mapped pages) held now (`reserved_bytes.current`).
    #[must_use]
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// The largest [`CachingAllocator::allocated`] since the start or the last
    /// [`CachingAllocator::reset_peaks`] (`max_memory_allocated`).
    #[must_use]
    pub fn max_allocated(&self) -> u64 {
        self.max_allocated
    }

    /// The largest [`CachingAllocator::reserved`] since the start or the last
    /// [`CachingAllocator::reset_peaks`] (`max_memory_reserved`).
    #[must_use]
    pub fn max_reserved(&self) -> u64 {
        self.max_reserved
    }

    /// Sets the peaks to the current figures (`torch.cuda.reset_peak_memory_stats()`).
    pub fn reset_peaks(&mut self) {
        self.max_allocated = self.allocated;
        self.max_reserved = self.reserved;
    }

    /// Hands out a block for a request of `bytes` (`malloc`, then `alloc_found_block`): `None`
    /// for zero bytes, which PyTorch answers with a null pointer and no block.
    ///
    /// # Errors
    /// [`Error::Overflow`] when a size or an address passes 64 bits.
    pub fn malloc(&mut self, bytes: u64) -> Result<Option<BlockId>, Error> {
        if bytes == 0 {
            return Ok(None);
        }
        let size = round_size(bytes).ok_or_else(overflow)?;
        let small = size <= SMALL_SIZE_BYTES;
        let b = match self.get_free_block(size, small) {
            Some(b) => b,
            None if self.config.expandable_segments => self.alloc_expandable(size, small)?,
            None => self.alloc_segment(size, small)?,
        };
        if self.should_split(b, size) {
            let rest = self.new_block(Block {
                addr: self.blocks[b].addr + size,
                size: self.blocks[b].size - size,
                prev: Some(b),
                next: self.blocks[b].next,
                stamp: 0,
                ..self.blocks[b]
            });
            if let Some(n) = self.blocks[b].next {
                self.blocks[n].prev = Some(rest);
            }
            self.blocks[b].next = Some(rest);
            self.blocks[b].size = size;
            self.insert_free(rest);
        }
        self.blocks[b].allocated = true;
        self.allocated = self
            .allocated
            .checked_add(self.blocks[b].size)
            .ok_or_else(overflow)?;
        self.max_allocated = self.max_allocated.max(self.allocated);
        Ok(Some(BlockId(b)))
    }

    /// Gives a block back (`free`, `free_block`): it merges with the free neighbours of its
    /// segment and returns to its pool. No memory goes back to the driver.
    ///
    /// # Errors
    /// [`Error::Internal`] when `id` is not a block handed out and not yet freed.
    pub fn free(&mut self, id: BlockId) -> Result<(), Error> {
        let b = id.0;
        match self.blocks.get(b) {
            Some(blk) if blk.allocated => {}
            _ => return Err(Error::Internal("a block freed twice or never handed out")),
        }
        self.blocks[b].allocated = false;
        self.allocated = self
            .allocated
            .checked_sub(self.blocks[b].size)
            .ok_or(Error::Internal("the allocated bytes went below zero"))?;
        if let Some(p) = self.blocks[b].prev {
            self.try_merge(b, p);
        }
        if let Some(n) = self.blocks[b].next {
            self.try_merge(b, n);
        }
        self.insert_free(b);
        Ok(())
    }

    /// The segments in address order, each with its blocks in address order (for a
    /// default configuration: no expandable segments, every block mapped).
    pub(crate) fn segments(&self) -> Vec<SegmentBlocks> {
        let mut dead = vec![false; self.blocks.len()];
        for &i in &self.spare {
            dead[i] = true;
        }
        let mut heads: Vec<usize> = (0..self.blocks.len())
            .filter(|&i| !dead[i] && self.blocks[i].prev.is_none())
            .collect();
        heads.sort_by_key(|&i| self.blocks[i].addr);
        heads
            .into_iter()
            .map(|h| {
                let mut blocks = Vec::new();
                let mut b = Some(h);
                while let Some(i) = b {
                    let blk = &self.blocks[i];
                    blocks.push((blk.size, blk.allocated.then_some(BlockId(i))));
                    b = blk.next;
                }
                SegmentBlocks {
                    small: self.blocks[h].small,
                    blocks,
                }
            })
            .collect()
    }

    /// Adds a segment above the others made of `blocks` in address order (size, handed
    /// out), as if it had been taken and split so (a default configuration only); its bytes
    /// count as reserved, and as allocated for the blocks handed out. Returns the handed-out
    /// blocks' ids in order.
    ///
    /// # Errors
    /// [`Error::Overflow`] when a size or an address passes 64 bits; [`Error::Internal`] for
    /// an empty segment, a block of no bytes, or two free blocks side by side (the allocator
    /// would have merged them).
    pub(crate) fn push_segment(
        &mut self,
        small: bool,
        blocks: &[(u64, bool)],
    ) -> Result<Vec<BlockId>, Error> {
        let bad = blocks.is_empty()
            || blocks.iter().any(|&(size, _)| size == 0)
            || blocks.windows(2).any(|w| !w[0].1 && !w[1].1);
        if bad {
            return Err(Error::Internal("a segment rebuilt from a bad layout"));
        }
        let total = blocks
            .iter()
            .try_fold(0u64, |a, &(size, _)| a.checked_add(size))
            .ok_or_else(overflow)?;
        let mut addr = self.next_addr;
        self.next_addr = addr
            .checked_add(total)
            .and_then(|a| a.checked_add(SEGMENT_GAP_BYTES))
            .ok_or_else(overflow)?;
        self.add_reserved(total)?;
        let mut ids = Vec::new();
        let mut prev = None;
        for &(size, allocated) in blocks {
            let b = self.new_block(Block {
                addr,
                size,
                prev,
                next: None,
                allocated,
                mapped: true,
                small,
                expandable: None,
                stamp: 0,
            });
            if let Some(p) = prev {
                self.blocks[p].next = Some(b);
            }
            if allocated {
                self.allocated = self.allocated.checked_add(size).ok_or_else(overflow)?;
                ids.push(BlockId(b));
            } else {
                self.insert_free(b);
            }
            addr += size;
            prev = Some(b);
        }
        self.max_allocated = self.max_allocated.max(self.allocated);
        Ok(ids)
    }

    /// Sets the stats: bytes of blocks handed out and of segments held that the allocator
    /// does not keep as blocks (segments that can take no further part), and the peaks.
    pub(crate) fn set_stats(
        &mut self,
        allocated: u64,
        reserved: u64,
        max_allocated: u64,
        max_reserved: u64,
    ) {
        self.allocated = allocated;
        self.reserved = reserved;
        self.max_allocated = max_allocated;
        self.max_reserved = max_reserved;
    }

    fn pool(small: bool) -> usize {
        usize::from(small)
    }

    fn new_block(&mut self, block: Block) -> usize {
        if let Some(i) = self.spare.pop() {
            self.blocks[i] = block;
            i
        } else {
            self.blocks.push(block);
            self.blocks.len() - 1
        }
    }

    fn insert_free(&mut self, b: usize) {
        self.stamps += 1;
        let blk = &mut self.blocks[b];
        blk.stamp = self.stamps;
        let (pool, size, addr, stamp) = (Self::pool(blk.small), blk.size, blk.addr, blk.stamp);
        let blocks = &self.blocks;
        self.free[pool].insert(size, addr, stamp, b, |b, s| blocks[b].stamp == s);
    }

    fn remove_free(&mut self, b: usize) {
        let blk = &mut self.blocks[b];
        blk.stamp = 0;
        let (pool, size, addr) = (Self::pool(blk.small), blk.size, blk.addr);
        let blocks = &self.blocks;
        self.free[pool].remove(size, addr, b, |b, s| blocks[b].stamp == s);
    }

    /// `try_merge_blocks(dst, src)`: a free neighbour `src` with the same mapping joins `dst`.
    fn try_merge(&mut self, dst: usize, src: usize) {
        let s = self.blocks[src];
        if s.allocated || s.mapped != self.blocks[dst].mapped {
            return;
        }
        if s.mapped {
            self.remove_free(src);
        } else {
            self.unmapped[Self::pool(s.small)].remove(&(s.addr, src));
        }
        if self.blocks[dst].prev == Some(src) {
            self.blocks[dst].addr = s.addr;
            self.blocks[dst].prev = s.prev;
            if let Some(p) = s.prev {
                self.blocks[p].next = Some(dst);
            }
        } else {
            self.blocks[dst].next = s.next;
            if let Some(n) = s.next {
                self.blocks[n].prev = Some(dst);
            }
        }
        self.blocks[dst].size += s.size;
        self.spare.push(src);
    }

    /// `should_split`: whether the rest of block `b` past `size` becomes a free block.
    fn should_split(&self, b: usize, size: u64) -> bool {
        let blk = &self.blocks[b];
        let remaining = blk.size - size;
        if blk.small || self.config.expandable_segments {
            remaining >= MIN_BLOCK_BYTES
        } else {
            size < self.config.max_split() && remaining > SMALL_SIZE_BYTES
        }
    }

    /// `get_free_block`: the best-fitting free block of the pool, taken out of it.
    fn get_free_block(&mut self, size: u64, small: bool) -> Option<usize> {
        let pool = Self::pool(small);
        let blocks = &self.blocks;
        let mut found = self.free[pool].best(size, |b, s| blocks[b].stamp == s)?;
        if self.blocks[found].expandable.is_some() && self.config.expandable_segments {
            // A block followed by the unmapped tail counts as the size it can grow to: prefer
            // the next larger blocks while they grow less.
            let grows = |b: usize| {
                let blk = &self.blocks[b];
                let tail = blk
                    .next
                    .map(|n| &self.blocks[n])
                    .filter(|n| !n.mapped)
                    .map_or(0, |n| n.size);
                blk.size.saturating_add(tail)
            };
            let order = self.free[pool].ordered(size).into_iter().flatten();
            for next in order.skip(1) {
                if grows(next) < grows(found) {
                    found = next;
                } else {
                    break;
                }
            }
        }
        let max_split = self.config.max_split();
        let blk = &self.blocks[found];
        if size < max_split && blk.size >= max_split {
            return None;
        }
        if size >= max_split && blk.size >= size.saturating_add(LARGE_BUFFER_BYTES) {
            return None;
        }
        self.remove_free(found);
        Some(found)
    }

    /// `alloc_block` with `cudaMalloc`: a new segment of [`allocation_size`], one block.
    fn alloc_segment(&mut self, size: u64, small: bool) -> Result<usize, Error> {
        let seg = allocation_size(size).ok_or_else(overflow)?;
        let addr = self.next_addr;
        self.next_addr = addr
            .checked_add(seg)
            .and_then(|a| a.checked_add(SEGMENT_GAP_BYTES))
            .ok_or_else(overflow)?;
        self.add_reserved(seg)?;
        Ok(self.new_block(Block {
            addr,
            size: seg,
            prev: None,
            next: None,
            allocated: false,
            mapped: true,
            small,
            expandable: None,
            stamp: 0,
        }))
    }

    fn add_reserved(&mut self, bytes: u64) -> Result<(), Error> {
        self.reserved = self.reserved.checked_add(bytes).ok_or_else(overflow)?;
        self.max_reserved = self.max_reserved.max(self.reserved);
        Ok(())
    }

    /// `try_allocate_expandable_block`: maps pages at the lowest place of the pool's segment
    /// where a free block and the unmapped space after it hold `size`, and returns that block
    /// (out of the free pool).
    fn alloc_expandable(&mut self, size: u64, small: bool) -> Result<usize, Error> {
        let mut cand = self.find_expandable(size, small)?;
        if !self.blocks[cand].mapped {
            let want = self.blocks[cand].size.min(size);
            cand = self.map_block(cand, want);
        }
        while self.blocks[cand].size < size {
            let remaining = size - self.blocks[cand].size;
            let next = self.blocks[cand]
                .next
                .ok_or(Error::Internal("an expandable segment ran out of space"))?;
            let want = self.blocks[next].size.min(remaining);
            cand = self.map_block(next, want);
        }
        self.remove_free(cand);
        Ok(cand)
    }

    /// `find_expandable_block`: the lowest unmapped block (with the free block just before it)
    /// whose run of free space holds `size`; a new segment when none does.
    fn find_expandable(&mut self, size: u64, small: bool) -> Result<usize, Error> {
        let free = |blocks: &[Block], b: Option<usize>| b.filter(|&b| !blocks[b].allocated);
        for &(_, u) in &self.unmapped[Self::pool(small)] {
            let mut c = u;
            if let Some(p) = free(&self.blocks, self.blocks[u].prev) {
                c = p;
            }
            let mut bytes = 0u64;
            let mut b = Some(c);
            while bytes < size {
                let Some(x) = free(&self.blocks, b) else {
                    break;
                };
                bytes = bytes.saturating_add(self.blocks[x].size);
                b = self.blocks[x].next;
            }
            if bytes >= size {
                return Ok(c);
            }
        }
        let page = if small {
            SMALL_BUFFER_BYTES
        } else {
            LARGE_BUFFER_BYTES
        };
        // A request past the usual space gets a segment that holds it (memory is unbounded
        // here; PyTorch would be out of memory long before).
        let space = size
            .div_ceil(page)
            .checked_mul(page)
            .ok_or_else(overflow)?
            .max(EXPANDABLE_SPACE_BYTES);
        let base = self.next_addr;
        self.next_addr = base
            .checked_add(space)
            .and_then(|a| a.checked_add(SEGMENT_GAP_BYTES))
            .ok_or_else(overflow)?;
        self.segments.push(Expandable { page });
        let b = self.new_block(Block {
            addr: base,
            size: space,
            prev: None,
            next: None,
            allocated: false,
            mapped: false,
            small,
            expandable: Some(self.segments.len() - 1),
            stamp: 0,
        });
        self.unmapped[Self::pool(small)].insert((base, b));
        Ok(b)
    }

    /// `map_block`: backs the pages of unmapped block `b` covering its first `size` bytes,
    /// leaves the rest unmapped, merges the mapped part with free neighbours and returns it
    /// (in the free pool). Reserved bytes grow by whole pages.
    fn map_block(&mut self, b: usize, size: u64) -> usize {
        let blk = self.blocks[b];
        let seg = blk.expandable.map(|s| self.segments[s]);
        let page = seg.map_or(MIN_BLOCK_BYTES, |s| s.page);
        // The block starts on a page (unmapped blocks are page-aligned): map whole pages.
        let mapped = size.div_ceil(page).saturating_mul(page).min(blk.size);
        self.unmapped[Self::pool(blk.small)].remove(&(blk.addr, b));
        self.blocks[b].mapped = true;
        if mapped < blk.size {
            let rest = self.new_block(Block {
                addr: blk.addr + mapped,
                size: blk.size - mapped,
                prev: Some(b),
                next: blk.next,
                mapped: false,
                stamp: 0,
                ..blk
            });
            if let Some(n) = blk.next {
                self.blocks[n].prev = Some(rest);
            }
            self.blocks[b].next = Some(rest);
            self.blocks[b].size = mapped;
            self.unmapped[Self::pool(blk.small)].insert((self.blocks[rest].addr, rest));
        }
        if let Some(p) = self.blocks[b].prev {
            self.try_merge(b, p);
        }
        if let Some(n) = self.blocks[b].next {
            self.try_merge(b, n);
        }
        self.insert_free(b);
        // Pages are far below 2^64 bytes in any run that fits a device; saturate, never wrap.
        self.reserved = self.reserved.saturating_add(mapped);
        self.max_reserved = self.max_reserved.max(self.reserved);
        b
    }
}

/// One event of an allocation stream: a request of `bytes` named `id`, or the free of the
/// request named `id`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// `malloc(bytes)`; `id` names the block until it is freed.
    Alloc {
        /// The caller's name for the block.
        id: u64,
        /// Bytes requested (before rounding).
        bytes: u64,
    },
    /// `free` of the block named `id`.
    Free {
        /// The name given at its allocation.
        id: u64,
    },
    /// `torch.cuda.reset_peak_memory_stats()`: the peaks restart from the current figures.
    ResetPeaks,
}

/// What an allocation stream leaves and reaches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Peaks {
    /// `max_memory_allocated()`: the largest sum of handed-out block sizes.
    pub max_allocated: u64,
    /// `max_memory_reserved()`: the largest sum of segment sizes (mapped pages).
    pub max_reserved: u64,
    /// Allocated bytes at the end.
    pub allocated: u64,
    /// Reserved bytes at the end.
    pub reserved: u64,
}

/// Runs `events` through a fresh allocator with `config`.
///
/// # Errors
/// [`Error::Overflow`] when a size or an address passes 64 bits; [`Error::Internal`] when an
/// event frees an id that is not live, or allocates an id that is.
pub fn replay(events: impl IntoIterator<Item = Event>, config: Config) -> Result<Peaks, Error> {
    let mut a = CachingAllocator::new(config);
    let mut live: HashMap<u64, Option<BlockId>> = HashMap::new();
    for e in events {
        match e {
            Event::Alloc { id, bytes } => {
                let b = a.malloc(bytes)?;
                if live.insert(id, b).is_some() {
                    return Err(Error::Internal("an allocation id was reused while live"));
                }
            }
            Event::Free { id } => match live.remove(&id) {
                Some(Some(b)) => a.free(b)?,
                Some(None) => {}
                None => return Err(Error::Internal("a free of an id that is not live")),
            },
            Event::ResetPeaks => a.reset_peaks(),
        }
    }
    Ok(Peaks {
        max_allocated: a.max_allocated(),
        max_reserved: a.max_reserved(),
        allocated: a.allocated(),
        reserved: a.reserved(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;

    fn run(events: &[Event], config: Config) -> Peaks {
        replay(events.iter().copied(), config).unwrap()
    }

    fn alloc(id: u64, bytes: u64) -> Event {
        Event::Alloc { id, bytes }
    }

    fn free(id: u64) -> Event {
        Event::Free { id }
    }

    const DEFAULT: Config = Config {
        expandable_segments: false,
        max_split_size: None,
    };
    const EXPANDABLE: Config = Config {
        expandable_segments: true,
        max_split_size: None,
    };

    #[test]
    fn rounding_and_segment_sizes() {
        assert_eq!(round_size(1), Some(512));
        assert_eq!(round_size(512), Some(512));
        assert_eq!(round_size(513), Some(1024));
        assert_eq!(round_size(u64::MAX), None);
        assert_eq!(allocation_size(MIB), Some(2 * MIB));
        assert_eq!(allocation_size(MIB + 512), Some(20 * MIB));
        assert_eq!(allocation_size(10 * MIB - 512), Some(20 * MIB));
        // From 10 MiB on, the request rounded up to 2 MiB: 15 MiB → 16 MiB.
        assert_eq!(allocation_size(10 * MIB), Some(10 * MIB));
        assert_eq!(allocation_size(15 * MIB), Some(16 * MIB));
    }

    /// 1 KiB: a 1,024-byte block out of a fresh 2 MiB small-pool segment.
    #[test]
    fn a_small_request_takes_a_small_segment() {
        let p = run(&[alloc(1, KIB)], DEFAULT);
        assert_eq!((p.max_allocated, p.max_reserved), (KIB, 2 * MIB));
        // 100 bytes round to 512; the rest of the segment serves the next request.
        let p = run(&[alloc(1, 100), alloc(2, 100)], DEFAULT);
        assert_eq!((p.max_allocated, p.max_reserved), (1024, 2 * MIB));
    }

    /// A zero-byte request takes no block.
    #[test]
    fn zero_bytes_take_nothing() {
        let p = run(&[alloc(1, 0), free(1)], DEFAULT);
        assert_eq!(p, Peaks::default());
    }

    /// 15 MiB: its own segment, 16 MiB; the 1 MiB rest is not split off (not over 1 MiB), so
    /// the block, and the allocated bytes, are 16 MiB.
    #[test]
    fn a_large_request_keeps_a_rest_of_one_mib() {
        let p = run(&[alloc(1, 15 * MIB)], DEFAULT);
        assert_eq!((p.max_allocated, p.max_reserved), (16 * MIB, 16 * MIB));
        // 5 MiB: a 20 MiB segment, split (15 MiB left); a second 5 MiB request uses the rest.
        let p = run(&[alloc(1, 5 * MIB), alloc(2, 5 * MIB)], DEFAULT);
        assert_eq!((p.max_allocated, p.max_reserved), (10 * MIB, 20 * MIB));
    }

    /// A 19.5 MiB request in a 20 MiB segment keeps the 0.5 MiB rest; 18 MiB leaves 2 MiB,
    /// which is split off.
    #[test]
    fn large_split_needs_more_than_one_mib() {
        let p = run(
            &[alloc(1, 5 * MIB), free(1), alloc(2, 19 * MIB + 512 * KIB)],
            DEFAULT,
        );
        assert_eq!(p.allocated, 20 * MIB);
        let p = run(&[alloc(1, 5 * MIB), free(1), alloc(2, 18 * MIB)], DEFAULT);
        assert_eq!(p.allocated, 18 * MIB);
        assert_eq!(p.reserved, 20 * MIB);
    }

    /// Freed blocks merge: two 8 MiB halves of a 20 MiB segment, freed, serve a 20 MiB request
    /// without a new segment.
    #[test]
    fn freed_neighbours_merge() {
        let events = [
            alloc(1, 8 * MIB),
            alloc(2, 8 * MIB),
            free(1),
            free(2),
            alloc(3, 20 * MIB),
        ];
        let p = run(&events, DEFAULT);
        assert_eq!((p.max_allocated, p.reserved), (20 * MIB, 20 * MIB));
        // While block 2 lives, the free 8 and 4 MiB around it cannot merge: 20 MiB needs a
        // segment of its own.
        let events = [
            alloc(1, 8 * MIB),
            alloc(2, 8 * MIB),
            free(1),
            alloc(3, 20 * MIB),
        ];
        let p = run(&events, DEFAULT);
        assert_eq!(p.reserved, 40 * MIB);
    }

    /// Best fit: the smallest free block that holds the request, not the first.
    #[test]
    fn best_fit_takes_the_smallest_block() {
        // Segments of 12 and 16 MiB, both freed; a 12 MiB request takes the 12 MiB one, so the
        // 16 MiB one still holds a 16 MiB request.
        let events = [
            alloc(1, 16 * MIB),
            alloc(2, 12 * MIB),
            free(1),
            free(2),
            alloc(3, 12 * MIB),
            alloc(4, 16 * MIB),
        ];
        let p = run(&events, DEFAULT);
        assert_eq!((p.allocated, p.reserved), (28 * MIB, 28 * MIB));
    }

    /// Small and large requests never share a pool: a freed 2 MiB small segment does not
    /// serve a 1.5 MiB request.
    #[test]
    fn pools_are_separate() {
        let p = run(
            &[alloc(1, MIB), free(1), alloc(2, MIB + 512 * KIB)],
            DEFAULT,
        );
        assert_eq!(p.reserved, 22 * MIB);
    }

    /// Small blocks split down to 512 B: 4,096 requests of 512 B fill one 2 MiB segment, the
    /// next takes a second one.
    #[test]
    fn small_segments_fill_up() {
        let mut events: Vec<Event> = (0..4096).map(|i| alloc(i, 512)).collect();
        assert_eq!(run(&events, DEFAULT).reserved, 2 * MIB);
        events.push(alloc(4096, 1));
        assert_eq!(run(&events, DEFAULT).reserved, 4 * MIB);
    }

    /// `max_split_size_mb`: a block at or over the limit is not given to a request under it,
    /// and is not split for a request at or over it (unless it exceeds it by 20 MiB).
    #[test]
    fn max_split_size_keeps_oversize_blocks_whole() {
        let cfg = Config {
            expandable_segments: false,
            max_split_size: Some(32 * MIB),
        };
        // A freed 40 MiB segment does not serve 12 MiB: a new 12 MiB segment.
        let p = run(&[alloc(1, 40 * MIB), free(1), alloc(2, 12 * MIB)], cfg);
        assert_eq!(p.reserved, 52 * MIB);
        // It serves 36 MiB whole (not split: 4 MiB rest stays, 40 MiB allocated).
        let p = run(&[alloc(1, 40 * MIB), free(1), alloc(2, 36 * MIB)], cfg);
        assert_eq!((p.allocated, p.reserved), (40 * MIB, 40 * MIB));
        // A 64 MiB block does not serve 40 MiB (64 ≥ 40 + 20).
        let p = run(&[alloc(1, 64 * MIB), free(1), alloc(2, 40 * MIB)], cfg);
        assert_eq!(p.reserved, 104 * MIB);
    }

    /// The peaks restart at `ResetPeaks`; reserved memory never goes back.
    #[test]
    fn reset_peaks_restarts_from_now() {
        let events = [
            alloc(1, 30 * MIB),
            free(1),
            Event::ResetPeaks,
            alloc(2, 4 * MIB),
        ];
        let p = run(&events, DEFAULT);
        assert_eq!(p.max_allocated, 4 * MIB);
        assert_eq!(p.max_reserved, 30 * MIB);
        assert_eq!(p.reserved, 30 * MIB);
    }

    /// Expandable segments: the large pool grows by 20 MiB pages, the small pool by 2 MiB
    /// pages, and every rest is split off, so allocated bytes are the rounded requests.
    #[test]
    fn expandable_segments_grow_by_pages() {
        let p = run(&[alloc(1, 15 * MIB)], EXPANDABLE);
        assert_eq!((p.allocated, p.reserved), (15 * MIB, 20 * MIB));
        // 15 + 15 MiB: the 5 MiB free tail grows by one page to hold the second.
        let p = run(&[alloc(1, 15 * MIB), alloc(2, 15 * MIB)], EXPANDABLE);
        assert_eq!((p.allocated, p.reserved), (30 * MIB, 40 * MIB));
        // Without expandable segments: 16 + 16 MiB in two segments.
        let p = run(&[alloc(1, 15 * MIB), alloc(2, 15 * MIB)], DEFAULT);
        assert_eq!((p.allocated, p.reserved), (32 * MIB, 32 * MIB));
        let p = run(&[alloc(1, 3 * KIB), alloc(2, MIB)], EXPANDABLE);
        assert_eq!((p.allocated, p.reserved), (MIB + 3 * KIB, 2 * MIB));
    }

    /// An expandable segment's freed middle is reused before the tail grows, and best fit
    /// prefers a block that cannot grow over the growable tail block of the same fit.
    #[test]
    fn expandable_segments_reuse_before_growing() {
        let events = [
            alloc(1, 30 * MIB),
            alloc(2, 10 * MIB),
            free(1),
            alloc(3, 30 * MIB),
        ];
        let p = run(&events, EXPANDABLE);
        assert_eq!((p.allocated, p.reserved), (40 * MIB, 40 * MIB));
        // A freed 10 MiB block at the start and an 8 MiB free block before the unmapped tail:
        // an 8 MiB request takes the 10 MiB block (it cannot grow), not the tail's 8 MiB,
        // whose growth would be counted as unbounded; a 10 MiB request then maps a page.
        let events = [
            alloc(1, 10 * MIB),
            alloc(2, 2 * MIB),
            free(1),
            alloc(3, 8 * MIB),
            alloc(4, 10 * MIB),
        ];
        let p = run(&events, EXPANDABLE);
        assert_eq!((p.allocated, p.reserved), (20 * MIB, 40 * MIB));
    }

    /// A request larger than an expandable segment's usual space (64 TiB) gets a segment that
    /// holds it, not an internal error (fuzz finding: `--batch 1048576 --expandable-segments`
    /// on a Granite config).
    #[test]
    fn expandable_segments_hold_a_request_past_their_space() {
        let huge = (1u64 << 46) + 3 * MIB;
        let p = run(&[alloc(1, MIB), alloc(2, huge)], EXPANDABLE);
        // 1 MiB in the small pool (a 2 MiB page); the huge request in a large segment of its
        // own, mapped in whole 20 MiB pages (2^46 + 3 MiB maps 2^46 + 16 MiB).
        assert_eq!(p.allocated, MIB + huge);
        assert_eq!(p.reserved, 2 * MIB + huge.div_ceil(20 * MIB) * 20 * MIB);
    }

    #[test]
    fn bad_streams_are_internal_errors() {
        let e = replay([free(1)], DEFAULT).unwrap_err();
        assert!(matches!(e, Error::Internal(_)));
        let e = replay([alloc(1, 5), alloc(1, 5)], DEFAULT).unwrap_err();
        assert!(matches!(e, Error::Internal(_)));
    }

    /// Random streams of 1,500 events (every size class, frees of random live blocks, a reset
    /// halfway) give, to the byte, the figures of `measure_fake_cuda.py`'s own allocator model
    /// (`fakecuda.CachingAllocatorSim`), made by `tools/allocator_streams.py`.
    #[test]
    fn random_streams_match_the_reference_replay() {
        let text = include_str!("../tests/data/allocator-streams.json");
        let streams: serde_json::Value = serde_json::from_str(text).unwrap();
        let streams = streams.as_array().unwrap();
        assert_eq!(streams.len(), 4);
        for s in streams {
            let events: Vec<Event> = s["events"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| {
                    let id = e[1].as_u64().unwrap();
                    match e[0].as_str().unwrap() {
                        "a" => alloc(id, e[2].as_u64().unwrap()),
                        "f" => free(id),
                        _ => Event::ResetPeaks,
                    }
                })
                .collect();
            let p = run(&events, DEFAULT);
            let want = |k: &str| s[k].as_u64().unwrap();
            assert_eq!(
                (p.max_allocated, p.max_reserved, p.allocated, p.reserved),
                (
                    want("max_allocated"),
                    want("max_reserved"),
                    want("allocated"),
                    want("reserved")
                ),
                "seed {}",
                s["seed"]
            );
        }
    }
}
