//! `Debug` for the handles of [`super`]: what they are (library, segment ids, sizes), never
//! the memory they map.

use super::{Desc, DmaQueue, LocalSegment, RemoteSegment, Sisci};
use std::fmt;
use std::sync::atomic::Ordering;

impl fmt::Debug for Sisci {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sisci")
            .field("path", &self.path)
            .field("family", &self.family)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for Desc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Desc")
            .field("sisci", &self.sisci)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for LocalSegment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalSegment")
            .field("id", &self.id)
            .field("adapter", &self.adapter)
            .field("len", &self.len)
            .field("available", &self.available.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for RemoteSegment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteSegment")
            .field("len", &self.len)
            .field("lost", &self.lost.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for DmaQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DmaQueue").finish_non_exhaustive()
    }
}
