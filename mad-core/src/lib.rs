//! # mad-core: the Madeleine II engine
//!
//! A program builds a message piece by piece and the receiver takes it apart in the same
//! order (Madeleine II, Aumage, Bougé and Namyst, 2000):
//!
//! ```no_run
//! # fn main() -> mad_core::Result<()> {
//! use mad_core::{RecvMode, SendMode, Session};
//! # let session = Session::builder().build()?;
//! let ch = session.open_channel("default")?;
//! if session.rank() == 0 {
//!     let array = vec![7u8; 1000];
//!     let mut p = ch.begin_packing(1)?;
//!     p.pack_value(&(array.len() as u64), RecvMode::Express)?; // the receiver needs it at once
//!     p.pack(&array, RecvMode::Cheaper)?;                      // may be deferred and batched
//!     p.end_packing()?;
//! } else {
//!     let mut u = ch.begin_unpacking()?;
//!     let n: u64 = u.unpack_value()?;
//!     let mut array = vec![0u8; n as usize];
//!     u.unpack(&mut array, SendMode::Cheaper)?;
//!     u.end_unpacking()?;
//! }
//! # Ok(()) }
//! ```
//!
//! ## Layers (file map)
//!
//! | Madeleine term | here |
//! |---|---|
//! | session, process rank | [`Session`] (`session.rs`), [`bootstrap`] |
//! | channel (one protocol, one adapter) | [`Channel`] (`channel.rs`), [`ChannelConfig`] (`config.rs`) |
//! | connection | a [`driver::LinkPair`] per peer inside a channel (`channel.rs`) |
//! | `begin_packing` / `pack` / `end_packing` | [`Packer`] (`pack.rs`) |
//! | `begin_unpacking` / `unpack` / `end_unpacking` | [`Unpacker`] (`unpack.rs`) |
//! | switch module | [`driver::TmTable::select`] (`driver.rs`) |
//! | transmission module (TM) | [`driver::TmSpec`], implemented by a driver's [`driver::TxLink`] / [`driver::RxLink`] |
//! | buffer-management modules (BMM) | [`driver::Bmm`]: `Copy` and `Gather`, run by `pack.rs` / `unpack.rs` |
//! | commit / checkout | [`driver::TxLink::commit`] / [`driver::RxLink::checkout`], called on TM change |
//! | progress (polling vs. blocking) | [`progress`] |
//!
//! With the `hostmem` feature, the module `hostmem` holds the shared-memory machinery of the
//! intra-host drivers (segment files, mapped windows, futex bells, peer liveness).
//!
//! The modes are enforced by the borrow checker: see [`Packer`] and [`Unpacker`].

#![deny(unsafe_code)]

pub mod accept;
#[doc(hidden)]
pub use tracing as __tracing;
pub mod auth;
pub mod bootstrap;
mod channel;
#[cfg(feature = "cli")]
pub mod cli;
pub mod config;
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod driver;
pub mod error;
pub mod events;
#[cfg(feature = "hostmem")]
pub mod hostmem;
pub mod launch;
mod lists;
pub mod liveness;
pub mod mem;
pub mod modes;
mod pack;
pub mod progress;
mod rxplan;
mod session;
pub mod tune;
mod unpack;
pub mod vchan;
pub mod wire;

pub use bytemuck;
pub use channel::{Channel, ChannelStats};
pub use config::ChannelConfig;
pub use driver::Armed;
pub use error::{Error, ErrorKind, Result};
pub use modes::{RecvMode, SendMode};
pub use pack::{Packer, SendPacker};
pub use session::{Session, SessionBuilder, DEFAULT_OPEN_TIMEOUT};
pub use unpack::Unpacker;
