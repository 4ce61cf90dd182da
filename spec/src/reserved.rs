//! Units a spec may never name: the host's own services, which specd must not stop, rewrite or
//! take over whatever a spec says. This is a fixed list of names and patterns; which of the other
//! units an agent may manage (the ones it created or adopted, a name pattern) is the agent's
//! configuration.

/// How a reserved name is matched against the full unit name (`name.type`).
enum Pattern {
    /// Exactly this unit.
    Exact(&'static str),
    /// Any unit whose name starts with this (whatever its type).
    Prefix(&'static str),
    /// This name with any unit type (`cron` matches `cron.service`, `cron.timer`…).
    Stem(&'static str),
}

use Pattern::{Exact, Prefix, Stem};

/// The reserved names, with why each is reserved.
const RESERVED: &[(Pattern, &str)] = &[
    (Prefix("systemd-"), "systemd's own units (journald, udevd, logind, networkd, resolved…)"),
    (Exact("init.scope"), "systemd itself (PID 1)"),
    (Exact("-.slice"), "the root slice"),
    (Exact("-.mount"), "the root file system"),
    (Prefix("dbus"), "the D-Bus message bus"),
    (Stem("specd"), "specd's own unit"),
    (Prefix("specd-"), "specd's own units"),
    (Prefix("specd@"), "specd's own units"),
    (Prefix("user@"), "systemd's per-user service managers"),
    (Prefix("user-runtime-dir@"), "systemd's per-user runtime directories"),
    (Prefix("getty@"), "login terminals"),
    (Prefix("serial-getty@"), "login terminals"),
    (Prefix("container-getty@"), "login terminals"),
    (Prefix("autovt@"), "login terminals"),
    (Stem("console-getty"), "login terminals"),
    (Prefix("ssh"), "remote access (OpenSSH)"),
    (Stem("cron"), "the cron daemon"),
    (Stem("crond"), "the cron daemon"),
    (Stem("anacron"), "the cron daemon"),
    (Prefix("polkit"), "the authorization daemon (polkit)"),
    (Prefix("NetworkManager"), "the network configuration (NetworkManager)"),
    (Stem("networking"), "the network configuration (ifupdown)"),
    (Stem("emergency"), "systemd's emergency shell"),
    (Stem("rescue"), "systemd's rescue shell"),
];

/// Why `unit` may not be managed by a spec, if it is one of the host's own units: systemd's
/// (`systemd-*`, `init.scope`, `-.slice`, `user@*`, `getty@*`…), D-Bus (`dbus*`), specd's own
/// (`specd.*`, `specd-*`, `specd@*`), remote access (`ssh*`), cron, polkit and the network
/// configuration (`NetworkManager*`, `networking.*`). `None` for any other name.
///
/// ```
/// assert!(specd_spec::reserved_unit("systemd-journald.service").is_some());
/// assert!(specd_spec::reserved_unit("dbus-broker.service").is_some());
/// assert_eq!(specd_spec::reserved_unit("sglang-qwen.service"), None);
/// ```
pub fn reserved_unit(unit: &str) -> Option<&'static str> {
    let stem = unit.rsplit_once('.').map_or(unit, |(s, _)| s);
    RESERVED
        .iter()
        .find(|(p, _)| match p {
            Exact(n) => unit == *n,
            Prefix(n) => unit.starts_with(n),
            Stem(n) => stem == *n,
        })
        .map(|(_, why)| *why)
}

#[cfg(test)]
mod tests {
    use super::reserved_unit;

    #[test]
    fn the_hosts_own_units_are_reserved() {
        for u in [
            "systemd-journald.service",
            "systemd-udevd.service",
            "systemd-logind.service",
            "systemd-networkd.service",
            "systemd-resolved.service",
            "dbus.service",
            "dbus-broker.service",
            "dbus.socket",
            "specd.service",
            "specd-agent.service",
            "init.scope",
            "-.slice",
            "user@1000.service",
            "getty@tty1.service",
            "serial-getty@ttyS0.service",
            "ssh.service",
            "sshd.service",
            "sshd@0-10.0.0.1:22-10.0.0.2:5000.service",
            "cron.service",
            "crond.service",
            "polkit.service",
            "NetworkManager.service",
            "NetworkManager-wait-online.service",
            "networking.service",
        ] {
            assert!(reserved_unit(u).is_some(), "{u} should be reserved");
        }
    }

    #[test]
    fn inference_units_are_not() {
        for u in [
            "sglang-qwen.service",
            "vllm@a.service",
            "llama-server.service",
            "my-systemd.service",
            "specdx.service",
            "cronjob-llm.service",
            "user.service",
        ] {
            assert_eq!(reserved_unit(u), None, "{u}");
        }
    }
}
