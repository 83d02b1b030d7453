//! Small inline lists for gather groups and deferred pieces.
//!
//! They replace `SmallVec` on the pack/unpack path for one reason: drop check. A `SmallVec`
//! has a `Drop` impl generic over its items, so a packer holding `SmallVec<[IoSlice<'b>; N]>`
//! would force every buffer to be declared *before* the packer, which rules out the paper's
//! Figure 1 (allocate the array after unpacking its size). These lists have no `Drop` impl
//! (inline arrays of borrow-only items, plus a `Vec` for spills, whose `Drop` may dangle), so
//! buffers may be declared after the packer or unpacker that borrows them. Up to `N` items live
//! inline: no heap allocation for messages of up to 16 pieces.

use std::io::{IoSlice, IoSliceMut};

pub(crate) const INLINE: usize = 16;

/// A list of `Copy` borrow-only items (send-side gather group, deferred LATER pieces).
pub(crate) struct InlineList<T: Copy, const N: usize> {
    inline: [T; N],
    n: usize,
    spill: Vec<T>,
}

impl<T: Copy, const N: usize> InlineList<T, N> {
    pub(crate) fn new(empty: T) -> Self {
        InlineList {
            inline: [empty; N],
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
            self.inline[self.n] = s;
            self.n += 1;
        } else {
            if self.spill.is_empty() {
                self.spill.extend_from_slice(&self.inline[..self.n]);
                self.n = 0;
            }
            self.spill.push(s);
        }
    }
    #[inline]
    pub(crate) fn as_slice(&self) -> &[T] {
        if self.spill.is_empty() {
            &self.inline[..self.n]
        } else {
            &self.spill
        }
    }
    #[inline]
    pub(crate) fn clear(&mut self) {
        self.n = 0;
        self.spill.clear();
    }
}

/// Send-side gather group.
pub(crate) type RefList<'b> = InlineList<IoSlice<'b>, INLINE>;

/// A list of `IoSliceMut`s (receive-side gather group).
pub(crate) struct MutList<'b, const N: usize = INLINE> {
    inline: [IoSliceMut<'b>; N],
    n: usize,
    spill: Vec<IoSliceMut<'b>>,
}

impl<'b, const N: usize> MutList<'b, N> {
    pub(crate) fn new() -> Self {
        MutList {
            inline: std::array::from_fn(|_| IoSliceMut::new(&mut [])),
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
    pub(crate) fn push(&mut self, s: IoSliceMut<'b>) {
        if self.spill.is_empty() && self.n < N {
            self.inline[self.n] = s;
            self.n += 1;
        } else {
            if self.spill.is_empty() {
                for i in 0..self.n {
                    let x = std::mem::replace(&mut self.inline[i], IoSliceMut::new(&mut []));
                    self.spill.push(x);
                }
                self.n = 0;
            }
            self.spill.push(s);
        }
    }
    #[inline]
    pub(crate) fn as_mut_slice(&mut self) -> &mut [IoSliceMut<'b>] {
        if self.spill.is_empty() {
            &mut self.inline[..self.n]
        } else {
            &mut self.spill
        }
    }
    /// Move every item into `out` (which may have a shorter lifetime), leaving this empty.
    #[inline]
    pub(crate) fn drain_into<'s, const M: usize>(&mut self, out: &mut MutList<'s, M>)
    where
        'b: 's,
    {
        if self.spill.is_empty() {
            for i in 0..self.n {
                out.push(std::mem::replace(
                    &mut self.inline[i],
                    IoSliceMut::new(&mut []),
                ));
            }
        } else {
            for x in self.spill.drain(..) {
                out.push(x);
            }
        }
        self.n = 0;
    }
    /// Take every item out, in order.
    pub(crate) fn take_all(&mut self) -> impl Iterator<Item = IoSliceMut<'b>> + '_ {
        let n = std::mem::take(&mut self.n);
        let inline = &mut self.inline;
        let spill = std::mem::take(&mut self.spill);
        (0..n)
            .map(move |i| std::mem::replace(&mut inline[i], IoSliceMut::new(&mut [])))
            .chain(spill)
    }
    #[inline]
    pub(crate) fn clear(&mut self) {
        for i in 0..self.n {
            self.inline[i] = IoSliceMut::new(&mut []);
        }
        self.n = 0;
        self.spill.clear();
    }
}
