//! Which units specd may manage: never its own, systemd's or D-Bus's (whatever a spec says),
//! only names matching the agent's `manage_units` pattern, and a unit file it did not write
//! only when the spec adopts it. Pure checks; the callers refuse before touching the host.

/// Why specd never manages `unit`, if it may not: one of the host's own units (the spec's one
/// list, `specd_spec::reserved_unit`), or `own`, the unit this specd runs in whatever its name.
pub fn reserved(unit: &str, own: Option<&str>) -> Option<&'static str> {
    if own == Some(unit) {
        return Some("specd's own unit");
    }
    specd_spec::reserved_unit(unit)
}

use specd_spec::glob_match;

/// Whether the agent may manage `unit`: not reserved, and matching `pattern` (default: any).
pub fn may_manage(unit: &str, own: Option<&str>, pattern: Option<&str>) -> Result<(), String> {
    if let Some(why) = reserved(unit, own) {
        return Err(format!("specd never manages {unit}: {why}"));
    }
    match pattern {
        Some(p) if !glob_match(p, unit) => {
            Err(format!("{unit} does not match this agent's manage_units pattern {p:?}"))
        }
        _ => Ok(()),
    }
}

/// A unit file specd wrote starts with its header.
pub fn written_by_specd(text: &[u8]) -> bool {
    text.starts_with(specd_spec::HEADER.as_bytes())
}

/// Whose unit this is, when it is not specd's: a file at `path` (the unit dir) without specd's
/// header, or a unit systemd loads from a file elsewhere (a package's unit in
/// `/usr/lib/systemd/system`, a runtime unit in `/run`), which a file written at `path` would
/// shadow. `None` when there is no such unit or the file is specd's. `fragment_path` is the
/// file systemd loaded the unit from, empty when there is none or it is gone since (the caller
/// looks, through the host).
pub fn foreign(
    path: &std::path::Path,
    file: Option<&[u8]>,
    load_state: crate::core::unit_state::LoadState,
    fragment_path: &str,
) -> Option<String> {
    match file {
        Some(t) if !written_by_specd(t) => {
            Some(format!("{} was not written by specd (it has no specd header)", path.display()))
        }
        Some(_) => None,
        None if load_state != crate::core::unit_state::LoadState::NotFound
            && !fragment_path.is_empty()
            && fragment_path != "/dev/null"
            && std::path::Path::new(fragment_path) != path =>
        {
            Some(format!("systemd loads it from {fragment_path}, a unit file specd did not write"))
        }
        None => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specd_systemd_and_dbus_units_are_never_managed() {
        for u in [
            "specd.service",
            "systemd-journald.service",
            "systemd-logind.service",
            "dbus.service",
            "dbus-broker.service",
            "dbus.socket",
            "systemd-fsck@dev-sda1.service",
        ] {
            assert!(reserved(u, None).is_some(), "{u}");
        }
        assert_eq!(reserved("my-agent.service", Some("my-agent.service")), Some("specd's own unit"));
        for u in ["sglang-qwen.service", "systemdish.service", "vllm@a.service", "my-dbus.service"] {
            assert_eq!(reserved(u, Some("specd-agent.service")), None, "{u}");
        }
    }

    #[test]
    fn name_patterns() {
        assert!(glob_match("*", "x.service"));
        assert!(glob_match("sglang-*.service", "sglang-qwen.service"));
        assert!(!glob_match("sglang-*.service", "vllm-qwen.service"));
        assert!(glob_match("llm-?.service", "llm-a.service"));
        assert!(!glob_match("llm-?.service", "llm-ab.service"));
        assert!(glob_match("*-*.service", "a-b-c.service"));
        assert!(may_manage("sglang-a.service", None, Some("sglang-*")).is_ok());
        let e = may_manage("vllm-a.service", None, Some("sglang-*")).unwrap_err();
        assert!(e.contains("manage_units pattern \"sglang-*\""), "{e}");
        assert!(may_manage("systemd-journald.service", None, None).unwrap_err().contains("systemd's own units"));
    }

    #[test]
    fn a_unit_another_package_installed_is_foreign() {
        let p = std::path::Path::new("/etc/systemd/system/nginx.service");
        let ours = format!("{}\n[Unit]\n", specd_spec::HEADER);
        assert_eq!(foreign(p, None, crate::core::unit_state::LoadState::NotFound, ""), None, "no unit at all");
        assert_eq!(
            foreign(p, Some(ours.as_bytes()), crate::core::unit_state::LoadState::Loaded, p.to_str().unwrap()),
            None
        );
        let vendor = "/usr/lib/systemd/system/nginx.service";
        let e = foreign(p, None, crate::core::unit_state::LoadState::Loaded, vendor).unwrap();
        assert_eq!(e, format!("systemd loads it from {vendor}, a unit file specd did not write"));
        // specd's own file deleted before a daemon-reload, or a package removed: nothing to take over.
        assert_eq!(foreign(p, None, crate::core::unit_state::LoadState::Loaded, p.to_str().unwrap()), None);
        // A package removed since systemd loaded its file: the caller passes no fragment.
        assert_eq!(foreign(p, None, crate::core::unit_state::LoadState::Loaded, ""), None);
        let e = foreign(
            p,
            Some(b"[Service]\nExecStart=/bin/true\n"),
            crate::core::unit_state::LoadState::Loaded,
            p.to_str().unwrap(),
        )
        .unwrap();
        assert!(e.contains("was not written by specd"), "{e}");
    }

    #[test]
    fn specd_s_header_marks_its_own_files() {
        assert!(written_by_specd(format!("{}\n[Unit]\n", specd_spec::HEADER).as_bytes()));
        assert!(!written_by_specd(b"[Service]\nExecStart=/bin/true\n"));
    }
}
