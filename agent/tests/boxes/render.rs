//! systemd itself reads back exactly what specd meant: a rendered unit with every awkward
//! character (quotes, backslashes, `%`, `$`, `;`, spaces, non-ASCII) in its argv and environment
//! is started by a real systemd, and the process receives those bytes unchanged.

use std::time::Duration;

use specd_e2e::{SystemdBox, wait_until};

const NASTY: &[&str] = &[
    "plain",
    "with space",
    "50%",
    "%n%i%%",
    "$HOME",
    "${HOME}",
    "$$",
    ";",
    "a;b",
    "\"double\"",
    "'single'",
    "back\\slash",
    "\\n",
    "ünïcödé",
    "{\"method\":\"eagle\"}",
    "",
    "--flag=x y",
];

#[test]
fn systemd_passes_rendered_argv_and_environment_through_unchanged() {
    let b = SystemdBox::boot().expect("boot a private systemd (run the tests as root)");
    // The program dumps its arguments and one variable, NUL-separated, then exits. Its own text
    // is full of `$`, `%` and quotes too.
    let script = r#"for a in "$@"; do printf '%s\0' "$a"; done > /run/argv.out; printf '%s' "$NASTY" > /run/env.out"#;
    let nasty_env = "a=b \"c\" $d %e \\f ;g";
    let mut yaml = String::from(
        "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {name: nasty}\nspec:\n  unit: nasty.service\n  engine: llama-cpp\n  model: /m\n",
    );
    let q = |s: &str| serde_json::to_string(s).unwrap();
    yaml.push_str(&format!("  command: [/bin/sh, -c, {}, sh]\n", q(script)));
    yaml.push_str("  server:\n    extra_args: [");
    yaml.push_str(&NASTY.iter().map(|s| q(s)).collect::<Vec<_>>().join(", "));
    yaml.push_str("]\n");
    yaml.push_str(&format!("  service:\n    restart: \"no\"\n    environment: {{NASTY: {}}}\n", q(nasty_env)));
    let spec = specd_spec::parse("nasty.yaml", &yaml).unwrap().resolve(None).unwrap();
    let unit = specd_spec::render(&spec);
    b.write_file("/etc/systemd/system/nasty.service", &unit.text).unwrap();
    b.systemctl_check(&["daemon-reload"]).unwrap();
    b.systemctl_check(&["start", "nasty.service"]).unwrap();
    wait_until("the program to finish", Duration::from_secs(20), || {
        b.prop("nasty.service", "ActiveState").is_ok_and(|s| s == "inactive" || s == "failed")
    })
    .unwrap();
    assert_eq!(b.prop("nasty.service", "Result").unwrap(), "success", "{}", b.journal("nasty.service").unwrap());
    let got = b.read_file("/run/argv.out").unwrap();
    let got: Vec<String> = got.split(|c| *c == 0).map(|w| String::from_utf8(w.to_vec()).unwrap()).collect();
    // $0 is "sh"; "$@" is everything after it in the spec's argv.
    let want: Vec<String> = spec.argv[4..].to_vec();
    assert_eq!(&got[..got.len() - 1], want.as_slice());
    assert!(want.iter().any(|w| w == "%n%i%%") && want.iter().any(|w| w == "${HOME}"));
    assert_eq!(b.read_to_string("/run/env.out").unwrap(), nasty_env);
    b.shutdown().unwrap();
}
