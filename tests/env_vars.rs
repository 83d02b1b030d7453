//! `mad_core::config::ENV_VARS` (the table `mad-info` prints) lists every environment variable
//! the sources read by a literal name, and nothing they do not mention.

use std::path::{Path, PathBuf};

use madeleine::config::ENV_VARS;

/// Every `.rs` file under `dir` (no `target` directories).
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        let name = e.file_name();
        let name = name.to_string_lossy();
        if p.is_dir() {
            if !name.starts_with("target") && !name.starts_with('.') {
                sources(&p, out);
            }
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

/// The string literals that directly follow one of `calls` in `text`.
fn literal_args<'t>(text: &'t str, calls: &[&str]) -> Vec<&'t str> {
    let mut v = Vec::new();
    for call in calls {
        for (i, _) in text.match_indices(call) {
            let rest = &text[i + call.len()..];
            if let Some(lit) = rest.strip_prefix('"') {
                if let Some(end) = lit.find('"') {
                    v.push(&lit[..end]);
                }
            }
        }
    }
    v
}

#[test]
fn every_literal_variable_read_is_listed() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for d in ["src", "benches", "examples"] {
        sources(&root.join(d), &mut files);
    }
    for c in std::fs::read_dir(root).unwrap().flatten() {
        let n = c.file_name().to_string_lossy().into_owned();
        if n.starts_with("mad-") {
            for d in ["src", "benches", "examples"] {
                sources(&c.path().join(d), &mut files);
            }
        }
    }
    assert!(
        files.len() > 50,
        "sources not found under {}",
        root.display()
    );
    let listed: Vec<&str> = ENV_VARS.iter().map(|(k, _)| *k).collect();
    let mut all_text = String::new();
    let mut missing = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        // Reads by a literal name, and the `const X_ENV: &str = "..."` names of examples.
        let mut names = literal_args(
            &text,
            &[
                "env::var(",
                "env::var_os(",
                "env_var(",
                "num(env, ",
                "has(env, ",
            ],
        );
        names.extend(literal_args(&text, &["_ENV: &str = "]));
        for n in names {
            if !listed.contains(&n) && !n.contains('{') {
                missing.push(format!("{n} ({})", f.display()));
            }
        }
        all_text.push_str(&text);
    }
    assert!(missing.is_empty(), "read but not in ENV_VARS: {missing:?}");
    for (k, meaning) in ENV_VARS {
        assert!(!meaning.is_empty(), "{k}: no meaning");
        let name = k.replace("<NAME>", "");
        if k.contains('<') {
            continue;
        }
        assert!(
            all_text.contains(&format!("\"{name}\"")),
            "ENV_VARS lists {k}, which no source names"
        );
    }
}
