//! The port a server listens on: held by a process outside the unit's own cgroup is a problem.

use super::look::Found;
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// A listening TCP socket, from `/proc/net/tcp` or `tcp6`.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Listener {
    pub(super) addr: IpAddr,
    pub(super) uid: u32,
    pub(super) inode: u64,
}

pub(super) fn look_port(unit: &str, host: &str, port: u16, own_cgroup: &str) -> Vec<Found> {
    // A host name (not an address) may resolve to any address: every listener on the port counts.
    let ours = host.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>().ok();
    let mut listeners: Vec<Listener> = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .flat_map(|t| listening(&t, port))
        .filter(|l| collides(ours, l.addr))
        .collect();
    if listeners.is_empty() {
        return Vec::new();
    }
    listeners.sort_by_key(|l| l.inode);
    let holders = socket_holders(&listeners.iter().map(|l| l.inode).collect());
    // Each process outside the unit once, with the addresses it listens on.
    let mut outside: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    let mut unseen = Vec::new();
    for l in &listeners {
        let pids = holders.get(&l.inode).map(Vec::as_slice).unwrap_or_default();
        let at = std::net::SocketAddr::new(l.addr, port).to_string();
        if pids.is_empty() {
            unseen.push(format!(
                "not checked: a socket of uid {} listens on {at}, and specd cannot see its process: whether it is {unit}'s is not known",
                l.uid
            ));
            continue;
        }
        // A process gone since the look at its files (its cgroup file with it) holds nothing.
        let live: Vec<(u32, String)> = pids.iter().filter_map(|p| Some((*p, cgroup_of(*p)?))).collect();
        if let Some((pid, _)) = live.first().filter(|_| !live.iter().any(|(_, cg)| in_cgroup(cg, own_cgroup))) {
            outside.entry(*pid).or_default().push(at);
        }
    }
    let mut out: Vec<Found> = outside
        .into_iter()
        .map(|(pid, at)| {
            let cmd = crate::machine::cgroup::cmdline(pid)
                .map_or_else(|| "its command line is gone".to_string(), |c| c.join(" "));
            Found::Problem(format!(
                "port {port} is held by pid {pid} ({cmd}), which is not part of {unit} (it listens on {})",
                at.join(", ")
            ))
        })
        .collect();
    out.extend(unseen.into_iter().map(Found::Note));
    out
}

/// The LISTEN sockets on `port` in a `/proc/net/tcp` or `tcp6` text: `sl local_address
/// rem_address st tx:rx tr:when retrnsmt uid timeout inode`, addresses in hex as the kernel
/// stores them (32-bit words in the host's byte order), the port in hex, LISTEN is `0A`.
pub(super) fn listening(text: &str, port: u16) -> Vec<Listener> {
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (addr, p) = f.get(1)?.split_once(':')?;
            if *f.get(3)? != "0A" || u16::from_str_radix(p, 16).ok()? != port {
                return None;
            }
            Some(Listener { addr: hex_addr(addr)?, uid: f.get(7)?.parse().ok()?, inode: f.get(9)?.parse().ok()? })
        })
        .collect()
}

/// An address of `/proc/net/tcp` (8 hex digits) or `tcp6` (32); an IPv4-mapped one as IPv4.
pub(super) fn hex_addr(hex: &str) -> Option<IpAddr> {
    let word = |i: usize| hex.get(i * 8..i * 8 + 8).and_then(|w| u32::from_str_radix(w, 16).ok()).map(u32::to_ne_bytes);
    match hex.len() {
        8 => Some(IpAddr::V4(Ipv4Addr::from(word(0)?))),
        32 => {
            let mut b = [0u8; 16];
            for i in 0..4 {
                b[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
            }
            let a = Ipv6Addr::from(b);
            Some(a.to_ipv4_mapped().map_or(IpAddr::V6(a), IpAddr::V4))
        }
        _ => None,
    }
}

/// Whether binding `ours` (`None`: any address) fails on a port where `theirs` listens: the same
/// address, or a wildcard of the family. An IPv6 wildcard takes IPv4 too (Linux's default,
/// `net.ipv6.bindv6only = 0`).
pub(super) fn collides(ours: Option<IpAddr>, theirs: IpAddr) -> bool {
    let Some(ours) = ours else { return true };
    let covers = |a: IpAddr, b: IpAddr| a == b || (a.is_unspecified() && (a.is_ipv6() || b.is_ipv4()));
    covers(ours, theirs) || covers(theirs, ours)
}

/// The processes that have each socket inode open (`/proc/PID/fd/* -> socket:[INODE]`), by pid.
pub(super) fn socket_holders(inodes: &BTreeSet<u64>) -> BTreeMap<u64, Vec<u32>> {
    let mut out: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    let Ok(procs) = std::fs::read_dir("/proc") else { return out };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else { continue };
        for fd in fds.flatten() {
            let inode = std::fs::read_link(fd.path())
                .ok()
                .and_then(|l| l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.parse::<u64>().ok());
            if let Some(i) = inode.filter(|i| inodes.contains(i)) {
                out.entry(i).or_default().push(pid);
            }
        }
    }
    for pids in out.values_mut() {
        pids.sort_unstable();
        pids.dedup();
    }
    out
}

pub(super) fn cgroup_of(pid: u32) -> Option<String> {
    unit_cgroup(&std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?)
}

/// A process's cgroup as systemd names it, from `/proc/PID/cgroup`: the unified hierarchy's line
/// (`0::/system.slice/x.service`), else systemd's own v1 hierarchy (`N:name=systemd:/…`).
pub(super) fn unit_cgroup(text: &str) -> Option<String> {
    let mut v1 = None;
    for l in text.lines() {
        let mut f = l.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else { continue };
        if id == "0" && controllers.is_empty() {
            return Some(path.to_string());
        }
        if controllers == "name=systemd" {
            v1 = Some(path.to_string());
        }
    }
    v1
}

/// `cg` is the unit's cgroup `own` or below it (a unit may make child cgroups).
pub(super) fn in_cgroup(cg: &str, own: &str) -> bool {
    !own.is_empty() && (cg == own || cg.starts_with(&format!("{}/", own.trim_end_matches('/'))))
}
