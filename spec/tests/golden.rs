//! Golden renders of every example (base spec and each host overlay), and the checked-in schema.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn examples() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(root().join("examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        // Sweep documents (`kind: Sweep`) are checked by `sweep.rs`, the fleet file by `fleet.rs`.
        .filter(|p| !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("sweep-")))
        .filter(|p| p.file_name().is_none_or(|n| n != "fleet.yaml"))
        .collect();
    v.sort();
    assert!(v.len() >= 3, "the examples are missing");
    v
}

#[test]
fn every_example_validates_without_warnings() {
    for p in examples() {
        let text = std::fs::read_to_string(&p).unwrap();
        let d = specd_spec::check(&p.display().to_string(), &text);
        assert!(d.0.is_empty(), "{d}");
    }
}

#[test]
fn every_example_renders_as_recorded() {
    for p in examples() {
        let text = std::fs::read_to_string(&p).unwrap();
        let parsed = specd_spec::parse("x.yaml", &text).unwrap();
        let stem = p.file_stem().unwrap().to_string_lossy().to_string();
        let mut hosts: Vec<Option<String>> = vec![None];
        hosts.extend(parsed.document.hosts.keys().cloned().map(Some));
        for h in hosts {
            let spec = parsed.resolve(h.as_deref()).unwrap();
            let unit = specd_spec::render(&spec);
            let name = match &h {
                None => stem.clone(),
                Some(h) => format!("{stem}@{h}"),
            };
            insta::assert_snapshot!(name, format!("# sha256 {}\n{}", unit.sha256, unit.text));
        }
    }
}

#[test]
fn the_seed_overlay_changes_only_the_speculative_steps() {
    let text = std::fs::read_to_string(root().join("examples/qwen35-122b-mtp.yaml")).unwrap();
    let parsed = specd_spec::parse("qwen.yaml", &text).unwrap();
    let base = parsed.resolve(Some("gpu-01")).unwrap();
    let gpu02 = parsed.resolve(Some("gpu-02")).unwrap();
    assert_eq!(base.overlay, None, "gpu-01 has no overlay");
    let (a, b) = (specd_spec::render(&base), specd_spec::render(&gpu02));
    assert_ne!(a.sha256, b.sha256);
    assert!(b.text.contains("\n# specd: host overlay gpu-02\n"));
    let b_lines = b.text.lines().filter(|l| !l.starts_with("# specd: host overlay"));
    let changed: Vec<(&str, &str)> = a.text.lines().zip(b_lines).filter(|(x, y)| x != y).collect();
    assert_eq!(changed.len(), 1, "{changed:#?}");
    assert!(
        changed[0]
            .0
            .contains("--speculative-num-steps 10 --speculative-eagle-topk 1 --speculative-num-draft-tokens 11")
    );
    assert!(
        changed[0].1.contains("--speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6")
    );
    assert_eq!(b.text.lines().count(), a.text.lines().count() + 1, "plus the overlay comment");
}

#[test]
fn checked_in_schema_is_current() {
    let path = root().join("schemas/specd.schema.json");
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        on_disk == specd_spec::json_schema(),
        "schemas/specd.schema.json is stale: regenerate it with `cargo run -p specd -- schema > schemas/specd.schema.json`"
    );
}

#[test]
fn enabled_is_not_in_the_unit_file() {
    let text = std::fs::read_to_string(root().join("examples/llama-cpp-qwen-draft.yaml")).unwrap();
    let on = specd_spec::parse("x.yaml", &text).unwrap().resolve(None).unwrap();
    assert!(on.service.enabled, "enabled by default");
    let off_text = text.replace("  service:\n", "  service:\n    enabled: false\n");
    assert_ne!(off_text, text);
    let off = specd_spec::parse("x.yaml", &off_text).unwrap().resolve(None).unwrap();
    assert!(!off.service.enabled);
    // Starting at boot or not is systemctl enable/disable: no unit file changes, nothing restarts.
    assert_eq!(specd_spec::render(&on).sha256, specd_spec::render(&off).sha256);
}
