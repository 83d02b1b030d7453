//! Recycled lists for gather groups and deferred pieces.
//!
//! A packer or unpacker keeps its gather group, its LATER tail and its held pieces in `Vec`s
//! of borrows of the user's memory (`IoSlice<'b>`, ...). They are not allocated per message:
//! each connection direction keeps one empty [`Spare`] per list between messages and lends it
//! to the next message, retyped for that message's borrows; `end_packing` / `end_unpacking`
//! give it back emptied. Their capacity survives, so once a connection has carried a message
//! of `n` pieces, messages of up to `n` pieces allocate nothing (and a packer or unpacker is a
//! few words, not hundreds of bytes of inline slots copied around on every message). A message
//! abandoned by dropping its packer or unpacker just drops its lists: the next message
//! allocates them again.
//!
//! Why `Vec` and not an inline list: drop check. `Vec`'s `Drop` may dangle, so buffers may be
//! declared after the unpacker that borrows them (the paper's Figure 1: the array is allocated
//! once its size was unpacked).
//!
//! The one piece of unsafe code here turns an *empty* `Vec<T<'a>>` into a `Vec<T<'b>>`: the
//! same type at another lifetime, so the same layout; no item is ever reinterpreted.

#![allow(unsafe_code)]

use std::cell::Cell;
use std::io::{IoSlice, IoSliceMut};
use std::mem::ManuallyDrop;

/// A family of borrow-carrying item types: `At<'b>` is the same type at every lifetime.
pub(crate) trait Family {
    /// The item type at lifetime `'b`.
    type At<'b>;
}

/// Send-side gather slices.
pub(crate) struct Slices;
impl Family for Slices {
    type At<'b> = IoSlice<'b>;
}

/// Receive-side gather and deferred destinations.
pub(crate) struct MutSlices;
impl Family for MutSlices {
    type At<'b> = IoSliceMut<'b>;
}

/// LATER pieces, read at `end_packing`.
pub(crate) struct Cells;
impl Family for Cells {
    type At<'b> = Later<'b>;
}

/// A LATER piece: cells (one thread) or atomics (a packer that may cross threads).
#[derive(Clone, Copy)]
pub(crate) enum Later<'b> {
    Cells(&'b [Cell<u8>]),
    Atomics(&'b [std::sync::atomic::AtomicU8]),
}

impl Later<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            Later::Cells(c) => c.len(),
            Later::Atomics(a) => a.len(),
        }
    }
}

/// An empty list kept by a connection between messages (see the module documentation).
pub(crate) struct Spare<F: Family> {
    v: Vec<F::At<'static>>,
}

// SAFETY: a `Spare` holds no item: it is emptied (`retype` clears it) before it is stored, and
// only ever lent out retyped, so no value of `F::At` (which may be `!Send`: `&[Cell<u8>]`)
// crosses threads through it, only the empty allocation.
unsafe impl<F: Family> Send for Spare<F> {}

impl<F: Family> Default for Spare<F> {
    fn default() -> Self {
        Spare { v: Vec::new() }
    }
}

impl<F: Family> Spare<F> {
    /// Lend the list (empty, with its capacity) for one message's borrows.
    #[inline]
    pub(crate) fn lend<'b>(&mut self) -> Vec<F::At<'b>> {
        retype::<F>(std::mem::take(&mut self.v))
    }

    /// Make `v` the lent list if it has no room yet: a message borrows the list at its first
    /// push, not at its begin (most messages use none).
    #[inline]
    pub(crate) fn lend_into<'b>(&mut self, v: &mut Vec<F::At<'b>>) {
        if v.capacity() == 0 {
            *v = self.lend();
        }
    }

    /// Take a list back for the next message (its items are dropped first).
    #[inline]
    pub(crate) fn restore(&mut self, v: Vec<F::At<'_>>) {
        self.v = retype::<F>(v);
    }
}

/// The same vector, emptied, retyped from lifetime `'a` to `'b` of its item family.
#[inline]
fn retype<'a, 'b, F: Family>(mut v: Vec<F::At<'a>>) -> Vec<F::At<'b>> {
    v.clear();
    let mut v = ManuallyDrop::new(v);
    let (ptr, cap) = (v.as_mut_ptr(), v.capacity());
    // SAFETY: `F::At<'a>` and `F::At<'b>` are one type at two lifetimes, which never change a
    // layout: the allocation of capacity `cap` made for the first is valid for the second.
    // The length is 0, so no item is reinterpreted; the original vector is forgotten, so the
    // allocation keeps exactly one owner.
    unsafe { Vec::from_raw_parts(ptr.cast::<F::At<'b>>(), 0, cap) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spare_keeps_its_capacity_across_lifetimes() {
        let mut spare: Spare<MutSlices> = Spare::default();
        for round in 0..3u8 {
            let mut bufs: Vec<[u8; 2]> = (0..20u8).map(|i| [i; 2]).collect();
            let mut l = spare.lend();
            let cap_before = l.capacity();
            if round > 0 {
                assert!(cap_before >= 20, "the capacity came back");
            }
            for b in bufs.iter_mut() {
                l.push(IoSliceMut::new(b));
            }
            for (i, s) in l.iter_mut().enumerate() {
                assert_eq!(s[0], i as u8);
                s[1] = 100 + round;
            }
            let ptr = l.as_ptr() as usize;
            spare.restore(l);
            assert!(bufs.iter().all(|b| b[1] == 100 + round));
            let l = spare.lend();
            assert!(l.is_empty());
            assert_eq!(
                l.as_ptr() as usize,
                ptr,
                "the same allocation is lent again"
            );
            spare.restore(l);
        }
    }

    #[test]
    fn cells_and_slices_families() {
        let mut cells_spare: Spare<Cells> = Spare::default();
        let mut data = [1u8, 2, 3];
        let cells = Cell::from_mut(&mut data[..]).as_slice_of_cells();
        let mut l = cells_spare.lend();
        l.push(Later::Cells(cells));
        cells[0].set(9);
        assert!(matches!(l[0], Later::Cells(c) if c[0].get() == 9 && l[0].len() == 3));
        cells_spare.restore(l);
        let mut s: Spare<Slices> = Spare::default();
        let mut l = s.lend();
        l.push(IoSlice::new(&data));
        assert_eq!(&*l[0], &[9, 2, 3]);
        s.restore(l);
        assert!(s.lend().is_empty());
    }
}
