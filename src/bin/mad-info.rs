//! `mad-info`: what this build of Madeleine can do on this host (like `ucx_info`).
//!
//! ```text
//! mad-info                  # version, drivers of this build and whether each can run here,
//!                           # the environment variables the project reads
//! mad-info --channel SPEC   # the selection table a channel of SPEC would use
//! ```
//!
//! Exits 0, or 2 on bad usage or a spec that does not name a usable configuration.

#![deny(unsafe_code)]

use std::path::Path;

use mad_core::bootstrap::SingleBootstrap;
use mad_core::cli::{self, Arg, Cli};
use mad_core::config::{ChannelConfig, ENV_VARS};

const USAGE: &str = "usage: mad-info [--channel SPEC] [--env] [--drivers]

Prints the version of this build, its drivers and whether each can run on this host (and why
not), and every environment variable Madeleine reads with its meaning.

  --channel SPEC   print the selection table a channel of SPEC would use (which TM and BMM
                   serve which sizes and modes), e.g. `--channel shm`, `--channel tcp,tm.small=4096`;
                   computed from the driver's TM table without opening a channel
  --drivers        print the drivers section only
  --env            print the environment variables section only
  -h, --help       this help
  -V, --version    the version

Options take their value as `--opt value` or `--opt=value`.

Logging of the library (tracing): MAD_LOG=mad_core=debug,mad_tcp=info (or RUST_LOG).";

enum Mode {
    All,
    Drivers,
    Env,
    Channel(String),
}

/// The command line.
const CLI: Cli = Cli::new("mad-info", env!("CARGO_PKG_VERSION"), USAGE);

fn parse() -> Mode {
    CLI.parse(|p| {
        let mut mode = Mode::All;
        while let Some(arg) = p.next()? {
            match arg {
                Arg::Long("channel") => mode = Mode::Channel(cli::string(p)?),
                Arg::Long("drivers") => mode = Mode::Drivers,
                Arg::Long("env") => mode = Mode::Env,
                other => CLI.other(other)?,
            }
        }
        Ok(mode)
    })
}

fn main() {
    madeleine::init_logging();
    match parse() {
        Mode::All => {
            println!(
                "madeleine {} (mad-info), Linux only",
                env!("CARGO_PKG_VERSION")
            );
            println!();
            drivers();
            println!();
            env_vars();
        }
        Mode::Drivers => drivers(),
        Mode::Env => env_vars(),
        Mode::Channel(spec) => {
            if let Err(e) = channel(&spec) {
                eprintln!("mad-info: --channel {spec}: {e}");
                std::process::exit(2);
            }
        }
    }
}

/// The selection table of `spec`, from a one-process session with every driver of this build.
fn channel(spec: &str) -> madeleine::Result<()> {
    let config = ChannelConfig::parse("info", spec)?;
    let session = madeleine::builder()
        .bootstrap(Box::new(SingleBootstrap::new()?))
        .build()?;
    print!("{}", session.selection_table_for(&config)?);
    println!(
        "  (computed without opening: what an open learns, such as whether CMA is permitted \
         between the ranks, is printed by MAD_PROTO_INFO=1 at open)"
    );
    Ok(())
}

/// One driver line: `name` `status` — `detail`.
fn line(name: &str, ok: Option<bool>, detail: &str) {
    let status = match ok {
        Some(true) => "yes",
        Some(false) => "no",
        None => "-",
    };
    println!("  {name:<15} {status:<4} {detail}");
}

fn drivers() {
    let built = |f: bool| if f { "built" } else { "not built" };
    println!(
        "features: tcp {}, shm {}, via {}, sisci {}, mpi {}, verbs {}",
        built(cfg!(feature = "tcp")),
        built(cfg!(feature = "shm")),
        built(cfg!(feature = "via")),
        built(cfg!(feature = "sisci")),
        built(cfg!(feature = "mpi")),
        built(cfg!(feature = "verbs")),
    );
    println!("drivers (can run here?):");
    line(
        "mem",
        Some(true),
        "in-process (one-process sessions and tests)",
    );
    tcp();
    shm();
    via();
    sisci();
    mpi();
}

fn tcp() {
    if !cfg!(feature = "tcp") {
        line("tcp", None, "not in this build (feature `tcp`)");
        return;
    }
    let lo = std::net::TcpListener::bind("127.0.0.1:0");
    let ifaces = interfaces();
    let detail = match &lo {
        Ok(_) => format!(
            "loopback listener ok; interfaces: {} (adapter: `tcp:<local address or interface>`)",
            if ifaces.is_empty() {
                "none found in /sys/class/net".to_string()
            } else {
                ifaces.join(", ")
            }
        ),
        Err(e) => format!("cannot listen on 127.0.0.1: {e}"),
    };
    line("tcp", Some(lo.is_ok()), &detail);
}

/// `name (state)` of every network interface in `/sys/class/net`.
fn interfaces() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/sys/class/net") else {
        return Vec::new();
    };
    let mut v: Vec<String> = dir
        .flatten()
        .map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let state = std::fs::read_to_string(e.path().join("operstate"))
                .map(|s| s.trim().to_string())
                .unwrap_or_else(|_| "?".into());
            format!("{name} ({state})")
        })
        .collect();
    v.sort();
    v
}

/// `/dev/shm`: whether it is there and its free space.
fn dev_shm() -> (bool, String) {
    let p = Path::new("/dev/shm");
    if !p.is_dir() {
        return (false, "no /dev/shm".into());
    }
    match nix::sys::statvfs::statvfs(p) {
        // The statvfs counts are 32-bit on some targets.
        #[allow(clippy::unnecessary_cast)]
        Ok(s) => {
            let block = s.fragment_size() as u64;
            let free = s.blocks_available() as u64 * block;
            let total = s.blocks() as u64 * block;
            (
                free > 0,
                format!("/dev/shm {} free of {}", human(free), human(total)),
            )
        }
        Err(e) => (false, format!("/dev/shm: statvfs failed: {e}")),
    }
}

fn human(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < U.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

/// Yama's `ptrace_scope` and what it means for CMA between sibling ranks.
fn yama() -> String {
    match std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope") {
        Ok(s) => {
            let v = s.trim();
            let what = match v {
                "0" => "any process of the user may attach",
                "1" => "siblings may attach once allowed: shm with cma=on|always sets PR_SET_PTRACER_ANY, the default cma=auto falls back to the ring",
                "2" => "only with CAP_SYS_PTRACE: CMA between ranks is refused",
                "3" => "no attaching at all: CMA between ranks is refused",
                _ => "unknown value",
            };
            format!("Yama ptrace_scope {v} ({what})")
        }
        Err(_) => "no Yama ptrace_scope (not restricted by Yama)".into(),
    }
}

#[cfg(feature = "shm")]
fn cma() -> String {
    if madeleine::mad_shm::sys::cma_self_check() {
        "process_vm_readv permitted in this process".into()
    } else {
        "process_vm_readv refused in this process (seccomp?): cma=on fails, cma=auto streams through the ring".into()
    }
}

fn shm() {
    let (shm_ok, shm_text) = dev_shm();
    #[cfg(feature = "shm")]
    {
        line(
            "shm",
            Some(shm_ok),
            &format!(
                "{shm_text}; CMA (cma=auto, the default, for streams; on|always): {}; {}",
                cma(),
                yama()
            ),
        );
    }
    #[cfg(not(feature = "shm"))]
    {
        let _ = (shm_ok, shm_text, yama);
        line("shm", None, "not in this build (feature `shm`)");
    }
}

/// The RDMA devices in `/sys/class/infiniband`.
fn rdma_devices() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn via() {
    #[cfg(feature = "via")]
    {
        line(
            "via:soft",
            Some(true),
            "the software VIA provider over TCP (any host)",
        );
        let devs = rdma_devices();
        let sys = if devs.is_empty() {
            "no RDMA device in /sys/class/infiniband".to_string()
        } else {
            format!("/sys/class/infiniband: {}", devs.join(", "))
        };
        match madeleine::mad_via::verbs::probe() {
            Ok(dev) => line(
                "via:verbs",
                Some(true),
                &format!("device {dev} ({sys}); UNTESTED on hardware"),
            ),
            Err(e) => line("via:verbs", Some(false), &format!("{e} ({sys})")),
        }
    }
    #[cfg(not(feature = "via"))]
    {
        let _ = rdma_devices;
        line("via", None, "not in this build (feature `via`)");
    }
}

fn sisci() {
    #[cfg(feature = "sisci")]
    {
        use madeleine::mad_sisci::{sys::Sisci, DEFAULT_LIB};
        line(
            "sisci:local",
            Some(Path::new("/dev/shm").is_dir()),
            "SCI emulated in shared memory (one host)",
        );
        match Sisci::get(DEFAULT_LIB) {
            Ok(s) => line(
                "sisci:dolphin",
                Some(true),
                &format!(
                    "{} loaded (symbols {}*, DMA calls: {}); UNTESTED on hardware",
                    s.path(),
                    s.family(),
                    if s.has_dma() { "yes" } else { "no" }
                ),
            ),
            Err(e) => line(
                "sisci:dolphin",
                Some(false),
                &format!("cannot use {DEFAULT_LIB}: {e} (option lib=<path> names another)"),
            ),
        }
    }
    #[cfg(not(feature = "sisci"))]
    line("sisci", None, "not in this build (feature `sisci`)");
}

fn mpi() {
    let launcher = match mad_core::launch::mpi_env::detect_from_env() {
        Ok(Some(l)) => format!(
            "started by {} as rank {} of {}",
            l.kind.describe(),
            l.rank,
            l.size
        ),
        Ok(None) => "not started by an MPI launcher".into(),
        Err(e) => format!("MPI launcher variables malformed: {e}"),
    };
    if cfg!(feature = "mpi") {
        line(
            "mpi",
            Some(true),
            &format!("built with MPI (run under mpiexec/mpirun/srun); {launcher}"),
        );
    } else {
        line(
            "mpi",
            None,
            &format!("not in this build (feature `mpi`, needs an MPI and libclang); {launcher}"),
        );
    }
}

fn env_vars() {
    println!("environment variables read by Madeleine:");
    let w = ENV_VARS.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, meaning) in ENV_VARS {
        let set = if k.contains('<') {
            String::new()
        } else {
            match std::env::var(k) {
                Ok(v) if *k == "MAD_SECRET" => format!(" [set: {} chars]", v.len()),
                Ok(v) if v.chars().count() > 60 => {
                    format!(" [set: {}...]", v.chars().take(57).collect::<String>())
                }
                Ok(v) => format!(" [set: {v}]"),
                Err(_) => String::new(),
            }
        };
        println!("  {k:<w$}  {meaning}{set}");
    }
    let named: Vec<String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("MAD_CHANNEL_"))
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    if !named.is_empty() {
        println!("  channels set here: {}", named.join(", "));
    }
}
