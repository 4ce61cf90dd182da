//! A draining unit's door (`service.drain_refuse_new`): while an apply drains and stops the
//! serving instance, new TCP connections to its port are refused (a reset: clients fail at once
//! and retry elsewhere) and established ones go on, by one chain per unit in specd's own nftables
//! table (`inet specd`). What `nft -f -` is given to close and to open it (each one transaction,
//! and each may be given again: closing twice leaves one rule, opening an open door does
//! nothing), and what the apply says kept new requests away.

use crate::core::serving::Told;

/// specd's own table: nothing else of the host's rules is touched.
pub const TABLE: &str = "inet specd";

/// The mark (SO_MARK, "spcd") of the connections specd reads a draining server's requests in
/// flight over: they are let through a closed port, over IPv4 and IPv6 alike; every other new
/// connection, the host's own included, is refused.
pub const PROBE_MARK: u32 = 0x7370_6364;

/// The unit's chain: its name with every byte but a letter, a digit and `.` written `_xx` (an
/// nftables name, one per unit: no two units share one), prefixed `drain_`; a name longer than
/// nftables takes is cut and ended by a hash of the whole.
pub fn chain(unit: &str) -> String {
    let mut c = String::from("drain_");
    for b in unit.bytes() {
        if b.is_ascii_alphanumeric() || b == b'.' {
            c.push(b as char);
        } else {
            c.push_str(&format!("_{b:02x}"));
        }
    }
    if c.len() > MAX_CHAIN {
        let h = specd_spec::sha256_hex(unit.as_bytes());
        c.truncate(MAX_CHAIN - 17);
        c.push('_');
        c.push_str(&h[..16]);
    }
    c
}

/// At most this many bytes in a chain's name (nftables' limit is 255).
const MAX_CHAIN: usize = 200;

/// The script that closes the unit's door on `port`: its chain (a filter on input, before the
/// host's own filters) holding the rule that resets new connections to the port, over IPv4 and
/// IPv6, but those marked [`PROBE_MARK`].
pub fn close_script(unit: &str, port: u16) -> String {
    let c = chain(unit);
    // A comment is one quoted string: the unit's name without quotes or control characters.
    let who: String = unit.chars().filter(|ch| *ch != '"' && *ch != '\\' && !ch.is_control()).collect();
    format!(
        "add table {TABLE}\n\
         add chain {TABLE} {c} {{ type filter hook input priority filter - 10 ; policy accept ; }}\n\
         flush chain {TABLE} {c}\n\
         add rule {TABLE} {c} tcp dport {port} ct state new meta mark != {PROBE_MARK:#x} counter reject with tcp reset comment \"specd: {who} is draining\"\n"
    )
}

/// The script that opens it again: the unit's chain removed (made first when there is none, so
/// that the script is the same whatever is there).
pub fn open_script(unit: &str) -> String {
    let c = chain(unit);
    format!("add table {TABLE}\nadd chain {TABLE} {c}\nflush chain {TABLE} {c}\ndelete chain {TABLE} {c}\n")
}

/// The port of a server's base URL (`http://127.0.0.1:30000`, `http://[::1]:8000/`).
pub fn port_of(url: &str) -> Option<u16> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next()?;
    let (_, port) = authority.rsplit_once(':')?;
    port.parse().ok().filter(|p| *p != 0)
}

/// What became of a unit's door in an apply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Door {
    /// The spec does not ask for it (or nothing serving is stopped).
    Off,
    /// New connections to the port are refused.
    Closed { port: u16 },
    /// Asked for, and it could not be closed: the drain goes on as without it.
    Failed { port: Option<u16>, why: String },
}

/// The line the apply prints once its load balancers' wait is over, and whether it is a warning:
/// who keeps new requests away from the instance it stops (the load balancers, the door, both),
/// or that nothing does.
pub fn kept_away(told: &Told, door: &Door) -> (bool, String) {
    let nobody = told.saw.is_empty() && told.missed.is_empty();
    let lbs_ok = told.kept_away() || nobody;
    match door {
        Door::Off => (!lbs_ok, told.words()),
        Door::Closed { port } if nobody => (
            false,
            format!(
                "no load balancer polls this unit; new connections to port {port} are refused until it has stopped ({})",
                refused_by()
            ),
        ),
        Door::Closed { port } => (
            false,
            format!(
                "{}; new connections to port {port} are refused until it has stopped ({})",
                told.words(),
                refused_by()
            ),
        ),
        Door::Failed { port, why } => {
            let on = port.map_or(String::new(), |p| format!(" to port {p}"));
            (true, format!("{}; new connections{on} could not be refused ({why})", told.words()))
        }
    }
}

fn refused_by() -> String {
    format!("nftables table {TABLE}")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn each_unit_has_its_own_chain_whose_name_nftables_takes() {
        let cases = [
            ("llm-a.service", "drain_llm_2da.service"),
            ("llm_a.service", "drain_llm_5fa.service"),
            ("vllm@0.service", "drain_vllm_400.service"),
            ("a\\x2db.service", "drain_a_5cx2db.service"),
        ];
        for (unit, want) in cases {
            assert_eq!(chain(unit), want, "{unit}");
        }
        let long = format!("{}.service", "a".repeat(250));
        let (c, other) = (chain(&long), chain(&format!("{}b.service", "a".repeat(249))));
        assert!(c.len() <= MAX_CHAIN && c.starts_with("drain_aaa"), "{c}");
        assert_ne!(c, other);
        for unit in ["x-y.service", "x_y.service", "x_2dy.service"] {
            assert!(chain(unit).bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.'), "{unit}");
        }
        assert_ne!(chain("x-y.service"), chain("x_2dy.service"));
    }

    #[test]
    fn the_scripts_close_one_port_to_new_connections_and_open_it_whatever_is_there() {
        assert_eq!(
            close_script("llm-a.service", 30000),
            "add table inet specd\n\
             add chain inet specd drain_llm_2da.service { type filter hook input priority filter - 10 ; policy accept ; }\n\
             flush chain inet specd drain_llm_2da.service\n\
             add rule inet specd drain_llm_2da.service tcp dport 30000 ct state new meta mark != 0x73706364 counter reject with tcp reset comment \"specd: llm-a.service is draining\"\n"
        );
        assert_eq!(
            open_script("llm-a.service"),
            "add table inet specd\nadd chain inet specd drain_llm_2da.service\nflush chain inet specd drain_llm_2da.service\ndelete chain inet specd drain_llm_2da.service\n"
        );
        assert!(close_script("a\"b.service", 1).contains("comment \"specd: ab.service is draining\"\n"));
    }

    #[test]
    fn the_port_is_read_from_the_server_s_url() {
        let cases = [
            ("http://127.0.0.1:30000", Some(30000)),
            ("http://[::1]:8000/", Some(8000)),
            ("http://0.0.0.0:8080/v1", Some(8080)),
            ("http://localhost", None),
            ("http://[::1]", None),
            ("http://h:0", None),
            ("http://h:99999", None),
        ];
        for (url, want) in cases {
            assert_eq!(port_of(url), want, "{url}");
        }
    }

    fn told(saw: &[&str], missed: &[&str]) -> Told {
        Told {
            saw: saw.iter().map(|s| s.to_string()).collect(),
            missed: missed.iter().map(|s| s.to_string()).collect(),
            after: Duration::from_millis(1500),
            settled: Duration::ZERO,
            listened: None,
            budget: Duration::from_secs(30),
        }
    }

    #[test]
    fn the_apply_says_what_kept_new_requests_away() {
        let closed = Door::Closed { port: 30000 };
        let failed = Door::Failed { port: Some(30000), why: "nft: command not found".into() };
        let cases: [(Told, Door, bool, &str); 6] = [
            (
                told(&[], &[]),
                Door::Off,
                false,
                "no load balancer polls this unit: nothing keeps traffic away during the stop",
            ),
            (
                told(&[], &[]),
                closed.clone(),
                false,
                "no load balancer polls this unit; new connections to port 30000 are refused until it has stopped (nftables table inet specd)",
            ),
            (
                told(&[], &[]),
                failed.clone(),
                true,
                "no load balancer polls this unit: nothing keeps traffic away during the stop; new connections to port 30000 could not be refused (nft: command not found)",
            ),
            (told(&["10.0.0.5"], &[]), Door::Off, false, "1 load balancer (10.0.0.5) saw drain after 1.5 s"),
            (
                told(&[], &["10.0.0.5"]),
                closed,
                false,
                "1 of 1 load balancer (10.0.0.5) did not see drain within 1.5 s (drain_timeout_sec 30 s): they may still send new requests during the stop; new connections to port 30000 are refused until it has stopped (nftables table inet specd)",
            ),
            (
                told(&["10.0.0.5"], &[]),
                failed,
                true,
                "1 load balancer (10.0.0.5) saw drain after 1.5 s; new connections to port 30000 could not be refused (nft: command not found)",
            ),
        ];
        for (t, door, warn, line) in cases {
            assert_eq!(kept_away(&t, &door), (warn, line.to_string()), "{door:?}");
        }
    }
}
