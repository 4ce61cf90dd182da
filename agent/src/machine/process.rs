//! A process by its pid: whether it runs, when it started (so that a later process that got the
//! same pid is not taken for it), and its exit, watched through a pidfd; and the unit this
//! process runs in. Below the host: the holds (a sweep's, a rollback's), the agent's wake-ups
//! and the pre-flight's tests use it.

use std::future::Future;

/// Whether process `pid` exists (signal 0; EPERM: it exists, owned by someone else).
pub fn pid_alive(pid: u32) -> bool {
    let Ok(p) = i32::try_from(pid) else { return false };
    if p <= 0 {
        return false;
    }
    match nix::sys::signal::kill(nix::unistd::Pid::from_raw(p), None) {
        Ok(()) => true,
        Err(e) => e == nix::errno::Errno::EPERM,
    }
}

/// The unit this process runs in (from `/proc/self/cgroup`), when it runs as a service.
pub fn own_unit() -> Option<String> {
    let cg = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    cg.lines()
        .filter_map(|l| l.rsplit(':').next())
        .flat_map(|p| p.rsplit('/'))
        .find(|c| c.ends_with(".service"))
        .map(str::to_string)
}

/// Process `pid`'s state letter and start time (clock ticks after boot), from `/proc/PID/stat`
/// (fields 3 and 22); `None` when it is gone.
fn stat_of(pid: u32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count after its end.
    let mut f = stat.rsplit_once(')')?.1.split_whitespace();
    let state = f.next()?.chars().next()?;
    Some((state, f.nth(18)?.parse().ok()?))
}

/// When process `pid` started, in clock ticks after boot; `None` when it is gone.
pub fn pid_start(pid: u32) -> Option<u64> {
    stat_of(pid).map(|(_, start)| start)
}

/// Process `pid` runs (an exited one not yet reaped does not), and is the one that started at
/// `start` (when known): a pid the kernel gave to a later process is not it.
pub fn same_process(pid: u32, start: Option<u64>) -> bool {
    match stat_of(pid) {
        Some((state, started)) => !matches!(state, 'Z' | 'X') && start.is_none_or(|s| s == started),
        // No /proc to read: the pid alone.
        None => pid_alive(pid) && start.is_none() && !std::path::Path::new("/proc/self/stat").exists(),
    }
}

/// A pidfd of process `pid` (readable once it has exited); `None` without one (a kernel before
/// 5.3, or no such process).
fn pidfd(pid: u32) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let p = libc::pid_t::try_from(pid).ok().filter(|p| *p > 0)?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, p, 0) };
    // SAFETY: a descriptor the kernel just returned, owned by nothing else.
    (fd >= 0).then(|| unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

/// Until process `pid`, started at `start` (when known), exits: a pidfd, readable then. Resolves
/// at once when that process is already gone (or the pid is another process's now); `None` when
/// it cannot be watched (no pidfds: the caller looks on a timer).
pub fn exited(pid: u32, start: Option<u64>) -> Option<std::pin::Pin<Box<dyn Future<Output = ()> + Send>>> {
    let Some(fd) = pidfd(pid) else {
        return (!same_process(pid, start)).then(|| Box::pin(std::future::ready(())) as _);
    };
    // The descriptor names whatever process has the pid now: is it still that one?
    if !same_process(pid, start) {
        return Some(Box::pin(std::future::ready(())));
    }
    // SAFETY: an OwnedFd, open and the same for as long as the AsyncFd owns it.
    let fd = unsafe { tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }.ok()?;
    Some(Box::pin(async move {
        let _ = fd.readable().await;
    }))
}

/// `CLOCK_MONOTONIC` in µs: the clock of systemd's `…TimestampMonotonic` properties and of the
/// journal's `__MONOTONIC_TIMESTAMP`.
pub fn monotonic_us() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into `t`.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    if r != 0 {
        return 0;
    }
    t.tv_sec as u64 * 1_000_000 + t.tv_nsec as u64 / 1000
}

#[cfg(test)]
mod pid_tests {
    use super::*;

    #[tokio::test]
    async fn a_process_s_exit_is_seen_at_once_without_a_timer() {
        let mut c = std::process::Command::new("sleep").arg("1000").spawn().unwrap();
        let pid = c.id();
        let start = pid_start(pid);
        let exit = exited(pid, start).expect("this kernel has pidfds");
        tokio::pin!(exit);
        // Not before it exits.
        assert!(futures_poll_once(&mut exit).await.is_pending());
        assert!(same_process(pid, start));
        c.kill().unwrap();
        // Readable once it has exited; not reaped yet, it does not run either.
        tokio::time::timeout(std::time::Duration::from_secs(10), exit).await.expect("the exit was seen");
        assert!(!same_process(pid, start) && !same_process(pid, None), "an exited process not yet reaped");
        c.wait().unwrap();
        // Gone already, or the pid is another process's: at once.
        tokio::time::timeout(std::time::Duration::from_secs(1), exited(pid, start).unwrap()).await.unwrap();
        let me = std::process::id();
        let other = exited(me, pid_start(me).map(|s| s + 1)).unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(1), other).await.unwrap();
    }

    /// Polls a future once.
    async fn futures_poll_once<F: Future + Unpin>(f: &mut F) -> std::task::Poll<F::Output> {
        std::future::poll_fn(|cx| std::task::Poll::Ready(std::pin::Pin::new(&mut *f).poll(cx))).await
    }

    #[test]
    fn a_process_is_known_by_its_pid_and_start_time() {
        let me = std::process::id();
        let start = pid_start(me).expect("this process's start time");
        assert!(same_process(me, Some(start)) && same_process(me, None));
        assert!(!same_process(me, Some(start + 1)), "the same pid, started at another time: a later process");
        let mut c = std::process::Command::new("true").spawn().unwrap();
        let pid = c.id();
        c.wait().unwrap();
        assert_eq!(pid_start(pid), None);
        assert!(!same_process(pid, None));
    }

    #[test]
    fn this_process_is_alive_and_a_reaped_child_is_not() {
        assert!(pid_alive(std::process::id()));
        let mut c = std::process::Command::new("true").spawn().unwrap();
        let pid = c.id();
        c.wait().unwrap();
        assert!(!pid_alive(pid));
        assert!(!pid_alive(0));
    }
}
