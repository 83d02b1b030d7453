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

/// A family whose values are a message's lists together (a packer's or unpacker's), kept in
/// one box so the handle holding them is one pointer.
pub(crate) trait ListSet: Family {
    /// An empty set.
    fn empty<'b>() -> Self::At<'b>;
    /// Empty every list (their capacity stays).
    fn clear(set: &mut Self::At<'_>);
}

/// A boxed [`ListSet`] kept by a connection between messages, lent whole (see
/// [`Spare`]): allocated at a connection's first message that uses a list, then recycled.
pub(crate) struct SpareSet<F: ListSet> {
    b: Option<Box<F::At<'static>>>,
}

// SAFETY: as for `Spare`: the set is emptied before it is stored, so only empty allocations
// cross threads through it.
unsafe impl<F: ListSet> Send for SpareSet<F> {}

impl<F: ListSet> Default for SpareSet<F> {
    fn default() -> Self {
        SpareSet { b: None }
    }
}

impl<F: ListSet> SpareSet<F> {
    /// Make `slot` hold a lent set if it holds none yet, and return it.
    #[inline]
    pub(crate) fn lend_into<'s, 'b>(
        &mut self,
        slot: &'s mut Option<Box<F::At<'b>>>,
    ) -> &'s mut F::At<'b> {
        slot.get_or_insert_with(|| match self.b.take() {
            Some(b) => retype_box::<F>(b),
            None => Box::new(F::empty()),
        })
    }

    /// Take a set back for the next message (emptied first).
    #[inline]
    pub(crate) fn restore(&mut self, b: Box<F::At<'_>>) {
        self.b = Some(retype_box::<F>(b));
    }
}

/// The same set, emptied, retyped from lifetime `'a` to `'b` of its family.
#[inline]
fn retype_box<'a, 'b, F: ListSet>(mut b: Box<F::At<'a>>) -> Box<F::At<'b>> {
    F::clear(&mut b);
    let p = Box::into_raw(b);
    // SAFETY: `F::At<'a>` and `F::At<'b>` are one type at two lifetimes, so one layout; the
    // set was emptied, so no value borrowed for `'a` is reachable through the new type; the
    // box is rebuilt from the pointer `into_raw` gave up, so it keeps exactly one owner.
    unsafe { Box::from_raw(p.cast::<F::At<'b>>()) }
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

    /// Two lists of cells, the set of [`SpareSet`]'s test.
    struct CellLists;
    impl Family for CellLists {
        type At<'b> = (Vec<Later<'b>>, Vec<u8>);
    }
    impl ListSet for CellLists {
        fn empty<'b>() -> Self::At<'b> {
            (Vec::new(), Vec::new())
        }
        fn clear(set: &mut Self::At<'_>) {
            set.0.clear();
            set.1.clear();
        }
    }

    #[test]
    fn cells_and_slices_families() {
        let mut sets: SpareSet<CellLists> = SpareSet::default();
        let mut data = [1u8, 2, 3];
        let cells = Cell::from_mut(&mut data[..]).as_slice_of_cells();
        let mut slot = None;
        let l = sets.lend_into(&mut slot);
        l.0.push(Later::Cells(cells));
        l.1.push(4);
        cells[0].set(9);
        assert!(matches!(l.0[0], Later::Cells(c) if c[0].get() == 9 && l.0[0].len() == 3));
        let b = slot.take().expect("lent");
        let at = &*b as *const _ as usize;
        sets.restore(b);
        let mut slot = None;
        let l = sets.lend_into(&mut slot);
        assert!(l.0.is_empty() && l.1.is_empty() && l.0.capacity() >= 1);
        assert_eq!(l as *const _ as usize, at, "the same box is lent again");
        let mut s: Spare<Slices> = Spare::default();
        let mut l = s.lend();
        l.push(IoSlice::new(&data));
        assert_eq!(&*l[0], &[9, 2, 3]);
        s.restore(l);
        assert!(s.lend().is_empty());
    }
}
