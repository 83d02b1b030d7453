//! Command-line parsing shared by the tools (`madrun`, `mad-bench`, `mad-info`, `rpc-bench`)
//! and every example (feature `cli`), over [`lexopt`].
//!
//! Every program built on it accepts `--opt value` and `--opt=value` alike, answers `-h` /
//! `--help` with its usage text and `-V` / `--version` with its name and version (both on
//! stdout, exit 0), and refuses an unknown option or a bad value with one line naming the
//! option and pointing to `--help` (on stderr, exit 2).
//!
//! ```no_run
//! use mad_core::cli::{self, Arg, Cli};
//! const CLI: Cli = Cli::new("demo", env!("CARGO_PKG_VERSION"), "usage: demo [--max SIZE]");
//! let max = CLI.parse(|p| {
//!     let mut max = 4 << 20;
//!     while let Some(arg) = p.next()? {
//!         match arg {
//!             Arg::Long("max") => max = cli::size(p, "--max")?,
//!             other => CLI.other(other)?,
//!         }
//!     }
//!     Ok(max)
//! });
//! # let _ = max;
//! ```
//!
//! A lone `--` is skipped by [`Cli::parser`]: `madrun -n 2 prog -- --quick` hands it to the
//! program, whose options follow it.

use std::ffi::OsString;
use std::fmt::Display;
use std::io::Write;
use std::str::FromStr;

pub use lexopt;
pub use lexopt::{Arg, Error, Parser, ValueExt};

/// Exit status of a refused command line.
pub const USAGE_EXIT: i32 = 2;

/// A program's name, version and usage text: the `--help`, `--version` and error output.
#[derive(Clone, Copy, Debug)]
pub struct Cli {
    name: &'static str,
    version: &'static str,
    usage: &'static str,
}

impl Cli {
    /// `name` as printed by `--version` and in errors, `version` (normally
    /// `env!("CARGO_PKG_VERSION")`), `usage` the full `--help` text.
    pub const fn new(name: &'static str, version: &'static str, usage: &'static str) -> Self {
        Cli {
            name,
            version,
            usage,
        }
    }

    /// The program's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The `--help` text.
    pub fn usage(&self) -> &'static str {
        self.usage
    }

    /// A parser over this process's arguments (without the program name), a lone `--` left
    /// out (see the module documentation).
    pub fn parser(&self) -> Parser {
        Parser::from_args(std::env::args_os().skip(1).filter(|a| a != "--"))
    }

    /// Run `f` over [`Cli::parser`]; on `Err`, [`Cli::fail`].
    pub fn parse<T>(&self, f: impl FnOnce(&mut Parser) -> Result<T, Error>) -> T {
        let mut p = self.parser();
        match f(&mut p) {
            Ok(t) => t,
            Err(e) => self.fail(e),
        }
    }

    /// The options every program has: `-h`/`--help` and `-V`/`--version` print and exit 0;
    /// anything else is refused (an unknown option, or a stray argument).
    ///
    /// # Errors
    ///
    /// A [`lexopt::Error`] for an unknown option or a stray argument.
    pub fn other(&self, arg: Arg<'_>) -> Result<(), Error> {
        match arg {
            Arg::Short('h') | Arg::Long("help") => self.help(),
            Arg::Short('V') | Arg::Long("version") => self.version(),
            a => Err(a.unexpected()),
        }
    }

    /// Print the usage text on stdout and exit 0.
    pub fn help(&self) -> ! {
        // Written, not `println!`: `prog --help | head -1` must not panic on the closed pipe.
        let _ = writeln!(std::io::stdout().lock(), "{}", self.usage.trim_end());
        std::process::exit(0)
    }

    /// Print `name version` on stdout and exit 0.
    pub fn version(&self) -> ! {
        let _ = writeln!(std::io::stdout().lock(), "{} {}", self.name, self.version);
        std::process::exit(0)
    }

    /// Print `name: why` and a pointer to `--help` on stderr and exit 2.
    pub fn fail(&self, why: impl Display) -> ! {
        let name = self.name;
        eprintln!("{name}: {why}\nTry `{name} --help` for the options.");
        std::process::exit(USAGE_EXIT)
    }
}

/// The value of the option just read, as a string.
///
/// # Errors
///
/// A [`lexopt::Error`] when the option has no value or it is not Unicode.
pub fn string(p: &mut Parser) -> Result<String, Error> {
    p.value()?.string()
}

/// The value of option `opt` converted by `f`; `None` from `f` becomes "`opt value`: expected
/// `what`".
///
/// # Errors
///
/// A [`lexopt::Error`] when the option has no value, or "`opt value`: expected `what`" when `f`
/// refuses it.
pub fn value_with<T>(
    p: &mut Parser,
    opt: &str,
    what: &str,
    f: impl FnOnce(&str) -> Option<T>,
) -> Result<T, Error> {
    let v = string(p)?;
    f(v.trim()).ok_or_else(|| Error::from(format!("{opt} {v}: expected {what}")))
}

/// A size: a number of bytes with an optional `k`, `m` or `g` suffix (`64k`, `4m`), as
/// [`crate::config::parse_size`] reads it.
///
/// # Errors
///
/// A [`lexopt::Error`] when the value is missing or not a size.
pub fn size(p: &mut Parser, opt: &str) -> Result<usize, Error> {
    value_with(
        p,
        opt,
        "a size (e.g. 4096, 64k, 4m)",
        crate::config::parse_size,
    )
}

/// A number of type `T` (`FromStr`).
///
/// # Errors
///
/// A [`lexopt::Error`] when the value is missing or does not parse.
pub fn number<T: FromStr>(p: &mut Parser, opt: &str) -> Result<T, Error> {
    value_with(p, opt, "a number", |v| v.parse().ok())
}

/// A number greater than zero.
///
/// # Errors
///
/// A [`lexopt::Error`] when the value is missing, does not parse or is not above zero.
pub fn positive<T: FromStr + PartialOrd + Default>(p: &mut Parser, opt: &str) -> Result<T, Error> {
    value_with(p, opt, "a number greater than 0", |v| {
        v.parse().ok().filter(|n| *n > T::default())
    })
}

/// Parse `args` (without the program name) with `f`, as [`Cli::parse`] does but returning the
/// error: for tests of a program's options.
///
/// # Errors
///
/// The first error of `f`, as it returns it.
pub fn parse_from<T>(
    args: impl IntoIterator<Item = impl Into<OsString>>,
    f: impl FnOnce(&mut Parser) -> Result<T, Error>,
) -> Result<T, Error> {
    let mut p = Parser::from_args(
        args.into_iter()
            .map(Into::into)
            .filter(|a: &OsString| a != "--"),
    );
    f(&mut p)
}
