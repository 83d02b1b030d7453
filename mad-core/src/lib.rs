//! # mad-core: the Madeleine II engine
//!
//! (Crate documentation is completed with the engine.)

#![deny(unsafe_code)]

pub mod auth;
pub mod bootstrap;
pub mod config;
pub mod driver;
pub mod error;
pub mod launch;
pub mod modes;
pub mod progress;

pub use config::ChannelConfig;
#[doc(hidden)]
pub struct SessionBuilder;
pub use error::{Error, Result};
pub use modes::{RecvMode, SendMode};
