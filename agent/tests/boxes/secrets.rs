//! Secrets reach the server without being written anywhere specd writes: a spec's
//! `environment_files` and `credentials` render to `EnvironmentFile=` and `LoadCredential=`, a real
//! systemd loads the unit, and the process sees the variable and the credential file
//! (`$CREDENTIALS_DIRECTORY/NAME`), while the unit file holds neither secret.

use std::time::Duration;

use specd_e2e::{SystemdBox, wait_until};

const API_KEY: &str = "sk-env-file-secret-4d1c";
const HF_TOKEN: &str = "hf_credential_secret_9b7e";

#[test]
fn environment_files_and_credentials_reach_the_process_and_not_the_unit_file() {
    let b = SystemdBox::boot().expect("boot a private systemd (run the tests as root)");
    // systemd mounts a service's credentials in a helper's mount namespace, which reaches its own
    // only through a shared root mount. On a host systemd makes / shared at boot; as a container's
    // init (which the box's systemd believes it is) it leaves that to the container manager.
    b.sh_check("mount --make-rshared /").unwrap();
    // Root-only secret files, as an operator would leave them (the box's /run is private).
    b.write_file("/run/secrets/api.env", format!("VLLM_API_KEY={API_KEY}\n")).unwrap();
    b.write_file("/run/secrets/hf-token", HF_TOKEN).unwrap();
    b.sh_check("chmod 0700 /run/secrets && chmod 0600 /run/secrets/api.env /run/secrets/hf-token").unwrap();

    let script = r#"set -e; printf '%s' "$VLLM_API_KEY" > /run/out/env; cat "$CREDENTIALS_DIRECTORY/hf_token" > /run/out/cred; printf '%s' "$CREDENTIALS_DIRECTORY" > /run/out/dir"#;
    let q = |s: &str| serde_json::to_string(s).unwrap();
    let yaml = format!(
        "apiVersion: specd/v1
kind: InferenceService
metadata: {{name: secrets}}
spec:
  unit: secrets.service
  engine: llama-cpp
  model: /m
  command: [/bin/sh, -c, {}, sh]
  service:
    restart: \"no\"
    environment: {{HF_TOKEN_PATH: /run/credentials/secrets.service/hf_token}}
    environment_files: [/run/secrets/api.env, -/run/secrets/optional.env]
    credentials: {{hf_token: /run/secrets/hf-token}}
",
        q(script)
    );
    let diags = specd_spec::check("secrets.yaml", &yaml);
    assert!(diags.0.is_empty(), "{diags}");
    let spec = specd_spec::parse("secrets.yaml", &yaml).unwrap().resolve(None).unwrap();
    let unit = specd_spec::render(&spec);
    assert!(unit.text.contains("\nEnvironmentFile=/run/secrets/api.env\nEnvironmentFile=-/run/secrets/optional.env\n"));
    assert!(unit.text.contains("\nLoadCredential=hf_token:/run/secrets/hf-token\n"), "{}", unit.text);

    b.sh_check("mkdir -p /run/out").unwrap();
    b.write_file("/etc/systemd/system/secrets.service", &unit.text).unwrap();
    b.systemctl_check(&["daemon-reload"]).unwrap();
    b.systemctl_check(&["start", "secrets.service"]).unwrap();
    wait_until("the program to finish", Duration::from_secs(20), || {
        b.prop("secrets.service", "ActiveState").is_ok_and(|s| s == "inactive" || s == "failed")
    })
    .unwrap();
    assert_eq!(b.prop("secrets.service", "Result").unwrap(), "success", "{}", b.journal("secrets.service").unwrap());

    // The process saw both secrets.
    assert_eq!(b.read_to_string("/run/out/env").unwrap(), API_KEY);
    assert_eq!(b.read_to_string("/run/out/cred").unwrap(), HF_TOKEN);
    assert_eq!(b.read_to_string("/run/out/dir").unwrap(), "/run/credentials/secrets.service");
    // The unit file systemd loaded holds neither.
    let on_disk = b.read_to_string("/etc/systemd/system/secrets.service").unwrap();
    assert_eq!(on_disk, unit.text);
    for secret in [API_KEY, HF_TOKEN] {
        assert!(!on_disk.contains(secret), "the unit file leaks {secret}");
    }
    assert_eq!(b.prop("secrets.service", "FragmentPath").unwrap(), "/etc/systemd/system/secrets.service");
    b.shutdown().unwrap();
}
