//! Madeleine `via` driver. **Not yet implemented**: this crate is an empty workspace member; it is filled by its own issue.
