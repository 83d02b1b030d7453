//! Small inline lists for gather groups and deferred pieces.
//!
//! They replace `SmallVec` on the pack/unpack path for one reason: drop check. A `SmallVec`
//! has a `Drop` impl generic over its items, so a packer holding `SmallVec<[IoSlice<'b>; N]>`
//! would force every buffer to be declared *before* the packer, which rules out the paper's
//! Figure 1 (allocate the array after unpacking its size). These lists have no `Drop` impl
//! (inline slots of borrow-only items, plus a `Vec` for spills, whose `Drop` may dangle), so
//! buffers may be declared after the packer or unpacker that borrows them. Up to `N` items live
//! inline: no heap allocation for messages of up to 16 pieces.
//!
//! The inline slots are `MaybeUninit`: a packer or unpacker is created for every message, and
//! most messages never use their gather list, so the slots are not written until an item is
//! pushed (initialising them cost a 256-byte memset per list and message). Items are never
//! dropped, which a compile-time check restricts to types without drop glue (`IoSlice`,
//! `IoSliceMut`, shared slices).

#![allow(unsafe_code)]

use std::io::IoSliceMut;
use std::mem::MaybeUninit;

pub(crate) const INLINE: usize = 16;

/// A list of borrow-only items: the first `N` inline, the rest (all of them once it
/// overflows) in a `Vec`.
pub(crate) struct InlineList<T, const N: usize> {
    /// Slots `0..n` are initialised (while `spill` is empty).
    inline: [MaybeUninit<T>; N],
    n: usize,
    /// Every item, once more than `N` were pushed.
    spill: Vec<T>,
}

/// Send-side gather group.
pub(crate) type RefList<'b> = InlineList<std::io::IoSlice<'b>, INLINE>;

/// Receive-side gather group and deferred destinations.
pub(crate) type MutList<'b, const N: usize = INLINE> = InlineList<IoSliceMut<'b>, N>;

impl<T, const N: usize> InlineList<T, N> {
    /// Items are never dropped (taken out by copy, or forgotten by `clear`): only types
    /// without drop glue may be listed.
    const NO_DROP_GLUE: () = assert!(
        !std::mem::needs_drop::<T>(),
        "InlineList items must not need dropping"
    );

    #[inline]
    pub(crate) fn new() -> Self {
        #[allow(clippy::let_unit_value)]
        let () = Self::NO_DROP_GLUE;
        InlineList {
            inline: [const { MaybeUninit::uninit() }; N],
            n: 0,
            spill: Vec::new(),
        }
    }

    #[inline]
    pub(crate) fn len(&self) -> usize {
        if self.spill.is_empty() {
            self.n
        } else {
            self.spill.len()
        }
    }

    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    pub(crate) fn push(&mut self, s: T) {
        if self.spill.is_empty() && self.n < N {
            self.inline[self.n].write(s);
            self.n += 1;
        } else {
            if self.spill.is_empty() {
                let n = std::mem::take(&mut self.n);
                self.spill.reserve(n + 1);
                for slot in &self.inline[..n] {
                    // SAFETY: slots `0..n` are initialised, and `n` was reset first, so each
                    // is read (moved out) exactly once.
                    self.spill.push(unsafe { slot.assume_init_read() });
                }
            }
            self.spill.push(s);
        }
    }

    #[inline]
    pub(crate) fn as_slice(&self) -> &[T] {
        if self.spill.is_empty() {
            // SAFETY: slots `0..n` are initialised, and `MaybeUninit<T>` has the layout of `T`.
            unsafe { std::slice::from_raw_parts(self.inline.as_ptr().cast::<T>(), self.n) }
        } else {
            &self.spill
        }
    }

    #[inline]
    pub(crate) fn as_mut_slice(&mut self) -> &mut [T] {
        if self.spill.is_empty() {
            // SAFETY: as in `as_slice`; `&mut self` makes the borrow unique.
            unsafe { std::slice::from_raw_parts_mut(self.inline.as_mut_ptr().cast::<T>(), self.n) }
        } else {
            &mut self.spill
        }
    }

    /// Take every item out, in order, leaving the list empty.
    pub(crate) fn take_all(&mut self) -> impl Iterator<Item = T> + '_ {
        let n = std::mem::take(&mut self.n);
        let spill = std::mem::take(&mut self.spill);
        let inline = &self.inline;
        // SAFETY: slots `0..n` are initialised; `n` was reset first, so each is read once
        // (items not read because the iterator is dropped early are forgotten, which is fine
        // for types without drop glue).
        (0..n)
            .map(move |i| unsafe { inline[i].assume_init_read() })
            .chain(spill)
    }

    /// Forget every item (they need no dropping).
    #[inline]
    pub(crate) fn clear(&mut self) {
        self.n = 0;
        self.spill.clear();
    }
}

impl<'b, const N: usize> InlineList<IoSliceMut<'b>, N> {
    /// Move every item into `out` (which may have a shorter lifetime), leaving this empty.
    #[inline]
    pub(crate) fn drain_into<'s, const M: usize>(&mut self, out: &mut MutList<'s, M>)
    where
        'b: 's,
    {
        for x in self.take_all() {
            out.push(x);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::IoSlice;

    #[test]
    fn inline_then_spill_keeps_order() {
        let data: Vec<[u8; 3]> = (0..40u8).map(|i| [i; 3]).collect();
        let mut l: InlineList<IoSlice<'_>, 4> = InlineList::new();
        assert!(l.is_empty());
        for (k, d) in data.iter().enumerate() {
            l.push(IoSlice::new(d));
            assert_eq!(l.len(), k + 1);
            let got: Vec<u8> = l.as_slice().iter().map(|s| s[0]).collect();
            assert_eq!(got, (0..=k as u8).collect::<Vec<_>>());
        }
        l.clear();
        assert!(l.is_empty());
        l.push(IoSlice::new(&data[7]));
        assert_eq!(l.as_slice()[0][0], 7);
    }

    #[test]
    fn take_all_and_drain_move_every_item_once() {
        let mut bufs: Vec<[u8; 2]> = (0..20u8).map(|i| [i; 2]).collect();
        for cut in [0usize, 3, 5, 20] {
            let mut l: MutList<'_, 5> = InlineList::new();
            for b in bufs.iter_mut().take(cut) {
                l.push(IoSliceMut::new(b));
            }
            let mut out: MutList<'_, 8> = InlineList::new();
            l.drain_into(&mut out);
            assert!(l.is_empty());
            assert_eq!(out.len(), cut);
            for (i, s) in out.as_mut_slice().iter_mut().enumerate() {
                assert_eq!(s[0], i as u8);
                s[1] = 100 + i as u8;
            }
            let taken: Vec<u8> = out.take_all().map(|s| s[1]).collect();
            assert_eq!(taken, (0..cut as u8).map(|i| 100 + i).collect::<Vec<_>>());
            assert!(out.is_empty());
        }
    }
}
