//! The free blocks of one pool of the caching allocator (`BlockPool::blocks` in PyTorch's
//! `CUDACachingAllocator.cpp`, a `std::set` ordered by `BlockComparatorSize`: size, then
//! address), kept for what the allocator asks of it: best fit (the smallest block of at least
//! a size, the lowest address among equals), filing a block and taking one out.
//!
//! A large model's step leaves thousands of free blocks in the large pool, most of them of a
//! few sizes (the holes its transients leave), while blocks of sizes seen once come and go at
//! every split and merge. So blocks are kept by exact size (a *bucket*: a heap by address),
//! and the sizes that have blocks by *class* (a size class of the TLSF allocator: a power of
//! two cut into 16 steps; Masmano et al., "TLSF: a new dynamic memory allocator for real-time
//! systems", 2004), one bit per class saying whether it has any: best fit reads the first
//! size at least as large in its class or the first class after it with a set bit. A bucket's
//! heap drops a block's entry lazily: taking a block out clears its stamp
//! ([`Pool::remove`]), and entries whose stamp is no longer the block's are skipped at the top
//! of the heap, or dropped when they outnumber the live ones.
//!
//! Costs: best fit, filing and taking out are a few steps of binary search within a class
//! and a heap operation; a size that comes or goes moves the sizes after it within its class
//! (few: a class spans a sixteenth of a power of two). With expandable segments the allocator
//! also reads blocks past the best fit in order, which [`Pool::with_order`] keeps in a B-tree
//! as well.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap};

/// Steps per power of two (the TLSF second level).
const STEPS_LOG2: u32 = 4;
/// Classes of sizes: 16 exact ones below 16 units of 512 B, then 16 per power of two up to
/// 2^64 bytes (51 more powers).
const CLASSES: usize = 16 + 51 * 16;
/// Words of the class bitmap.
const WORDS: usize = CLASSES.div_ceil(64);

/// A bucket's entry: the block's address, the stamp it was filed under, and its slot.
type Entry = Reverse<(u64, u64, usize)>;

/// The class of a size: monotone in the size (a larger size never has a smaller class).
fn class(size: u64) -> usize {
    let units = size >> 9;
    if units < 1 << STEPS_LOG2 {
        return units as usize;
    }
    let log = 63 - units.leading_zeros();
    let step = (units >> (log - STEPS_LOG2)) & ((1 << STEPS_LOG2) - 1);
    ((log - STEPS_LOG2 + 1) << STEPS_LOG2) as usize + step as usize
}

/// The blocks of one size: a heap by address (lowest first) and how many of its entries
/// stand for blocks still filed.
#[derive(Clone, Debug, Default)]
struct Bucket {
    heap: BinaryHeap<Entry>,
    live: usize,
}

/// The free blocks of one pool ([module docs](self)).
#[derive(Clone, Debug, Default)]
pub(super) struct Pool {
    /// Per class: the sizes that have blocks, ascending, each with its bucket.
    classes: Vec<Vec<(u64, usize)>>,
    /// Bit `c`: class `c` has sizes.
    bits: [u64; WORDS],
    buckets: Vec<Bucket>,
    /// Buckets no longer in use (their heaps empty, their allocations kept).
    spare: Vec<usize>,
    /// Every filed block by (size, address, slot), for [`Pool::ordered`] (expandable
    /// segments prefer a later block of the order to the best fit, `crate::alloc`).
    order: Option<BTreeSet<(u64, u64, usize)>>,
}

impl Pool {
    /// A pool that also keeps its blocks in best-fit order ([`Pool::ordered`]).
    pub(super) fn with_order() -> Pool {
        Pool {
            order: Some(BTreeSet::new()),
            ..Pool::default()
        }
    }

    /// Files the block in slot `b`, of `size` bytes at `addr`, under `stamp` (which the block
    /// keeps while it is filed); `filed` as for [`Pool::remove`].
    pub(super) fn insert(
        &mut self,
        size: u64,
        addr: u64,
        stamp: u64,
        b: usize,
        filed: impl Fn(usize, u64) -> bool,
    ) {
        let c = class(size);
        if self.classes.len() <= c {
            self.classes.resize_with(c + 1, Vec::new);
        }
        let sizes = &mut self.classes[c];
        let k = match sizes.binary_search_by_key(&size, |&(s, _)| s) {
            Ok(i) => sizes[i].1,
            Err(i) => {
                let k = self.spare.pop().unwrap_or_else(|| {
                    self.buckets.push(Bucket::default());
                    self.buckets.len() - 1
                });
                sizes.insert(i, (size, k));
                self.bits[c / 64] |= 1 << (c % 64);
                k
            }
        };
        let bucket = &mut self.buckets[k];
        let entry = Reverse((addr, stamp, b));
        // The entry at the top is often one best fit just took (a block freed soon after,
        // or another of its size): the new one takes its place, one sift instead of two.
        let stale = bucket
            .heap
            .peek()
            .is_some_and(|&Reverse((_, s, t))| !filed(t, s));
        if stale && let Some(mut top) = bucket.heap.peek_mut() {
            *top = entry;
        } else {
            bucket.heap.push(entry);
        }
        bucket.live += 1;
        if let Some(order) = &mut self.order {
            order.insert((size, addr, b));
        }
    }

    /// Takes out the block in slot `b`, of `size` bytes at `addr`, whose stamp was just
    /// cleared; `filed(slot, stamp)`: whether the block in `slot` is still filed under `stamp`.
    pub(super) fn remove(
        &mut self,
        size: u64,
        addr: u64,
        b: usize,
        filed: impl Fn(usize, u64) -> bool,
    ) {
        if let Some(order) = &mut self.order {
            order.remove(&(size, addr, b));
        }
        let c = class(size);
        let Some(sizes) = self.classes.get_mut(c) else {
            return;
        };
        let Ok(i) = sizes.binary_search_by_key(&size, |&(s, _)| s) else {
            return;
        };
        let k = sizes[i].1;
        let bucket = &mut self.buckets[k];
        bucket.live -= 1;
        if bucket.live == 0 {
            bucket.heap.clear();
            self.spare.push(k);
            sizes.remove(i);
            if sizes.is_empty() {
                self.bits[c / 64] &= !(1 << (c % 64));
            }
        } else if bucket.heap.len() > 2 * bucket.live + 16 {
            bucket.heap.retain(|&Reverse((_, s, b))| filed(b, s));
        }
    }

    /// The first class from `c` on that has sizes.
    fn next_class(&self, c: usize) -> Option<usize> {
        let (mut w, bit) = (c / 64, c % 64);
        let mut word = *self.bits.get(w)? & (u64::MAX << bit);
        loop {
            if word != 0 {
                return Some(w * 64 + word.trailing_zeros() as usize);
            }
            w += 1;
            word = *self.bits.get(w)?;
        }
    }

    /// The smallest filed block of at least `size` bytes, the lowest address among equals
    /// (its slot); `filed` as for [`Pool::remove`].
    pub(super) fn best(&mut self, size: u64, filed: impl Fn(usize, u64) -> bool) -> Option<usize> {
        let c = class(size);
        let in_class = self.classes.get(c).and_then(|sizes| {
            let i = sizes.partition_point(|&(s, _)| s < size);
            sizes.get(i)
        });
        let (_, k) = match in_class {
            Some(&first) => first,
            None => self.classes[self.next_class(c + 1)?][0],
        };
        let heap = &mut self.buckets[k].heap;
        while let Some(&Reverse((_, s, b))) = heap.peek() {
            if filed(b, s) {
                return Some(b);
            }
            heap.pop();
        }
        None
    }

    /// The filed blocks of at least `size` bytes in best-fit order (size, then address), for a
    /// pool made [`Pool::with_order`] (else `None`).
    pub(super) fn ordered(&self, size: u64) -> Option<impl Iterator<Item = usize> + '_> {
        let order = self.order.as_ref()?;
        Some(order.range((size, 0, 0)..).map(|&(_, _, b)| b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::collections::BTreeSet;

    use proptest::prelude::*;

    /// Classes never decrease with the size, and every size has one.
    #[test]
    fn classes_are_monotone_and_in_range() {
        let mut sizes: Vec<u64> = (0..4096u64).map(|u| u << 9).collect();
        for l in 12..64 {
            sizes.extend([(1u64 << l) - 512, 1 << l, (1 << l) + 512]);
        }
        sizes.push(u64::MAX);
        sizes.sort_unstable();
        for w in sizes.windows(2) {
            assert!(class(w[0]) <= class(w[1]), "{} {}", w[0], w[1]);
        }
        assert_eq!(class(u64::MAX), CLASSES - 1);
        // Exact below 16 units; then 16 classes per power of two.
        assert_eq!(class(512 * 15), 15);
        assert_eq!(class(512 * 16), 16);
        assert_eq!(class(512 * 31), 31);
        assert_eq!(class(512 * 32), 32);
        assert_eq!(class(512 * 34), 33);
        assert_eq!(class(512 * 64), 48);
    }

    /// One step of a random workload: file a block, take one out, or ask for best fit.
    #[derive(Clone, Debug)]
    enum Step {
        Insert(u64),
        Remove(usize),
        Best(u64),
    }

    fn size() -> impl Strategy<Value = u64> {
        prop_oneof![
            (1u64..40).prop_map(|u| u << 9),
            (1u64..6).prop_map(|m| m << 28),
            any::<u64>().prop_map(|x| x & !511),
        ]
    }

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        prop::collection::vec(
            prop_oneof![
                3 => size().prop_map(Step::Insert),
                2 => any::<usize>().prop_map(Step::Remove),
                2 => size().prop_map(Step::Best),
            ],
            1..400,
        )
    }

    proptest! {
        /// Best fit, after any filing and taking out, is the first block of an ordered set by
        /// (size, address), as PyTorch's `std::set` gives it; best fit takes the block out.
        #[test]
        fn best_fit_is_the_ordered_sets(steps in steps()) {
            let mut pool = Pool::with_order();
            let mut want: BTreeSet<(u64, u64, usize)> = BTreeSet::new();
            // Per slot: its stamp (0: not filed) and its size and address.
            let mut slots: Vec<(u64, u64, u64)> = Vec::new();
            let mut stamps = 0;
            for step in steps {
                let filed = |slots: &Vec<(u64, u64, u64)>| {
                    let stamps: Vec<u64> = slots.iter().map(|s| s.0).collect();
                    move |b: usize, s: u64| stamps[b] == s
                };
                match step {
                    Step::Insert(size) => {
                        stamps += 1;
                        // Addresses unique, in no particular order.
                        let addr = (slots.len() as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                        slots.push((stamps, size, addr));
                        let b = slots.len() - 1;
                        pool.insert(size, addr, stamps, b, filed(&slots));
                        want.insert((size, addr, b));
                    }
                    Step::Remove(i) => {
                        let Some(&(size, addr, b)) = want.iter().nth(i % want.len().max(1)) else {
                            continue;
                        };
                        want.remove(&(size, addr, b));
                        slots[b].0 = 0;
                        pool.remove(size, addr, b, filed(&slots));
                    }
                    Step::Best(size) => {
                        let got = pool.best(size, filed(&slots));
                        let first = want.range((size, 0, 0)..).next().copied();
                        prop_assert_eq!(got, first.map(|(_, _, b)| b));
                        let order: Vec<usize> = pool.ordered(size).unwrap().collect();
                        let all: Vec<usize> = want.range((size, 0, 0)..).map(|x| x.2).collect();
                        prop_assert_eq!(order, all);
                        if let Some((s, addr, b)) = first {
                            want.remove(&(s, addr, b));
                            slots[b].0 = 0;
                            pool.remove(s, addr, b, filed(&slots));
                        }
                    }
                }
            }
        }
    }
}
