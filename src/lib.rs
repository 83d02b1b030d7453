//! madeleine: see the README.
pub use mad_core::*;
