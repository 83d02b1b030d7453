//! The workspace's `rust-version` (its MSRV) is true of the lockfile: at least the highest
//! `rust-version` any package of the build declares. No other toolchain can be fetched where
//! this runs, so the MSRV is derived from the dependencies instead of tried; `.cargo/config.toml`
//! makes resolution MSRV-aware so that `cargo update` keeps this true.

use std::process::Command;

fn version(s: &str) -> Vec<u32> {
    s.split('.').map(|p| p.parse().unwrap_or(0)).collect()
}

#[test]
fn declared_msrv_covers_every_package_of_the_lockfile() {
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--locked", "--offline"])
        .current_dir(root)
        .output()
        .expect("cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json = String::from_utf8(out.stdout).expect("UTF-8");
    // In each package object, `"manifest_path":"…"` comes before `"rust_version":…` (null or a
    // string); the manifest's directory names the package.
    let mut highest: Option<(Vec<u32>, String)> = None;
    let mut rest = json.as_str();
    while let Some(at) = rest.find("\"rust_version\":\"") {
        let before = &rest[..at];
        let name = before
            .rfind("\"manifest_path\":\"")
            .map(|i| &before[i + 17..])
            .and_then(|n| n.split('"').next())
            .and_then(|p| p.rsplit('/').nth(1))
            .unwrap_or("?");
        rest = &rest[at + 16..];
        let v = rest.split('"').next().unwrap_or("");
        if highest.as_ref().is_none_or(|(h, _)| version(v) > *h) {
            highest = Some((version(v), format!("{v} ({name})")));
        }
    }
    let (_, highest) = highest.expect("some package declares a rust-version");
    let manifest = std::fs::read_to_string(format!("{root}/Cargo.toml")).expect("Cargo.toml");
    let declared = manifest
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = \""))
        .and_then(|l| l.split('"').next())
        .expect("the workspace declares rust-version");
    assert!(
        version(declared) >= version(highest.split(' ').next().unwrap_or("")),
        "Cargo.toml says rust-version = {declared}, but a package of the lockfile needs {highest}"
    );
}
