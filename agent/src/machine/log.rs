//! specd's log: tracing events on stderr, written for where stderr goes.
//!
//! - stderr is the journal (systemd's `JOURNAL_STREAM` names stderr's device and inode): each
//!   line starts with its syslog priority, `<3>` error, `<4>` warning, `<6>` info, `<7>` debug
//!   (the sd-daemon prefix journald reads off a stream, `SyslogLevelPrefix=`, on by default), and
//!   carries no time (journald stamps it) nor colour; so `journalctl -p warning` finds warnings.
//! - a terminal: coloured (unless `NO_COLOR` is set and not empty).
//! - a pipe or a file (`specd run 2>file`): plain text, no escape codes.
//!
//! The agent writes every line with its time and level; a one-shot command (`apply`, `sweep`...)
//! only its warnings and errors by default, as its other lines do: `specd: warning: ...`.
//! `SPECD_LOG` (tracing's filter syntax) chooses otherwise.

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::{self, FormatEvent, FormatFields, Writer};
use tracing_subscriber::fmt::{FmtContext, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// Who writes: the agent (a line per event, with its time) or a one-shot command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Agent,
    Command,
}

/// Where stderr goes, as the log needs to know it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stderr {
    /// journald reads it: priority prefixes, no time, no colour.
    pub journal: bool,
    /// A terminal, and `NO_COLOR` unset or empty.
    pub colour: bool,
}

impl Stderr {
    /// This process's stderr.
    pub fn detect() -> Stderr {
        use std::io::IsTerminal;
        let journal = journal_stream(std::env::var("JOURNAL_STREAM").ok().as_deref(), std::io::stderr());
        let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
        Stderr { journal, colour: !journal && !no_color && std::io::stderr().is_terminal() }
    }
}

/// Whether `fd` is the stream `JOURNAL_STREAM` (`<device>:<inode>`, decimal) names: systemd's
/// documented test that a process's output goes to the journal. The variable alone is not
/// enough: a child inherits it while its stderr goes elsewhere (`specd run 2>file` in a shell of
/// a service).
pub fn journal_stream(var: Option<&str>, fd: impl std::os::fd::AsFd) -> bool {
    let Some((dev, ino)) = var.and_then(|v| v.split_once(':')) else { return false };
    let (Ok(dev), Ok(ino)) = (dev.parse::<u64>(), ino.parse::<u64>()) else { return false };
    nix::sys::stat::fstat(fd).is_ok_and(|st| st.st_dev == dev && st.st_ino == ino)
}

/// The syslog priority of a level (sd-daemon(3)): error 3, warning 4, info 6, debug 7.
pub fn priority(level: Level) -> u8 {
    match level {
        Level::ERROR => 3,
        Level::WARN => 4,
        Level::INFO => 6,
        Level::DEBUG | Level::TRACE => 7,
    }
}

/// The command's last words when it fails (`specd: error: ...`), whatever the log's filter; on
/// the journal at priority error.
pub fn fatal(message: &str) {
    use std::io::Write;
    let p = if Stderr::detect().journal { "<3>" } else { "" };
    let _ = writeln!(std::io::stderr().lock(), "{p}specd: error: {message}");
}

/// Set up the process's log (once; a second call changes nothing).
pub fn init(mode: Mode) {
    use tracing_subscriber::EnvFilter;
    let to = Stderr::detect();
    let default = match mode {
        Mode::Agent => "info",
        Mode::Command => "warn",
    };
    let filter = EnvFilter::try_from_env("SPECD_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    let b = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(to.colour);
    let fmt = format::Format::default().with_target(false).with_ansi(to.colour);
    let _ = match (mode, to.journal) {
        (Mode::Agent, false) => b.event_format(Lines { inner: fmt, journal: false }).try_init(),
        (Mode::Agent, true) => b.event_format(Lines { inner: fmt.without_time(), journal: true }).try_init(),
        (Mode::Command, journal) => b.event_format(Lines { inner: Said, journal }).try_init(),
    };
}

/// An event as `inner` formats it; on the journal, each of its lines after its priority.
struct Lines<F> {
    inner: F,
    journal: bool,
}

impl<S, N, F> FormatEvent<S, N> for Lines<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> std::fmt::Result {
        if !self.journal {
            return self.inner.format_event(ctx, writer, event);
        }
        let mut text = String::new();
        self.inner.format_event(ctx, Writer::new(&mut text), event)?;
        let p = priority(*event.metadata().level());
        // A message of several lines stays findable: every line has the event's priority.
        for line in text.lines() {
            writeln!(writer, "<{p}>{line}")?;
        }
        Ok(())
    }
}

/// A one-shot command's line: `specd: warning: message (field=value, ...)`, as its own
/// warnings read.
struct Said;

impl<S, N> FormatEvent<S, N> for Said
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> std::fmt::Result {
        let word = match *event.metadata().level() {
            Level::ERROR => "error",
            Level::WARN => "warning",
            Level::INFO => "info",
            Level::DEBUG => "debug",
            Level::TRACE => "trace",
        };
        let mut v = Fields::default();
        event.record(&mut v);
        write!(writer, "specd: {word}: {}", v.message)?;
        // The fields of the spans it is in (none today), then its own.
        let mut fields = v.fields;
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                if let Some(f) = span.extensions().get::<FormattedFields<N>>().filter(|f| !f.is_empty()) {
                    fields.insert(0, f.to_string());
                }
            }
        }
        if !fields.is_empty() {
            write!(writer, " ({})", fields.join(", "))?;
        }
        writeln!(writer)
    }
}

/// An event's message and its other fields as `name=value`.
#[derive(Default)]
struct Fields {
    message: String,
    fields: Vec<String>,
}

impl tracing::field::Visit for Fields {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        match field.name() {
            "message" => self.message = value.to_string(),
            name => self.fields.push(format!("{name}={value}")),
        }
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        match field.name() {
            "message" => self.message = format!("{value:?}"),
            name => self.fields.push(format!("{name}={value:?}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn the_journal_is_stderr_only_when_journal_stream_names_its_device_and_inode() {
        let dir = tempfile::tempdir().unwrap();
        let f = std::fs::File::create(dir.path().join("err")).unwrap();
        let m = f.metadata().unwrap();
        let named = format!("{}:{}", m.dev(), m.ino());
        assert!(journal_stream(Some(&named), &f));
        let other = std::fs::File::create(dir.path().join("other")).unwrap();
        assert!(!journal_stream(Some(&named), &other), "inherited, but stderr went elsewhere");
        for bad in [None, Some(""), Some("1"), Some("a:b"), Some(&format!("{}:", m.dev()))] {
            assert!(!journal_stream(bad, &f), "{bad:?}");
        }
    }

    #[test]
    fn warnings_and_errors_have_the_priorities_journalctl_filters_on() {
        assert_eq!(priority(Level::ERROR), 3);
        assert_eq!(priority(Level::WARN), 4);
        assert_eq!(priority(Level::INFO), 6);
        assert_eq!(priority(Level::DEBUG), 7);
    }

    /// What each format writes for one warning with a field, through a real subscriber.
    fn written(mode: Mode, journal: bool) -> String {
        #[derive(Clone, Default)]
        struct Buf(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let out = buf.clone();
        let b = tracing_subscriber::fmt().with_writer(move || out.clone()).with_ansi(false);
        let fmt = format::Format::default().with_target(false).with_ansi(false).without_time();
        let dispatch = match mode {
            Mode::Agent => tracing::Dispatch::new(b.event_format(Lines { inner: fmt, journal }).finish()),
            Mode::Command => tracing::Dispatch::new(b.event_format(Lines { inner: Said, journal }).finish()),
        };
        tracing::dispatcher::with_default(&dispatch, || {
            tracing::warn!(unit = "q.service", "RolledBack: q.service: the server exited\nits last line");
            tracing::info!("ready");
        });
        String::from_utf8(buf.0.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn each_line_on_the_journal_starts_with_its_priority_and_elsewhere_with_nothing() {
        assert_eq!(
            written(Mode::Agent, true),
            "<4> WARN RolledBack: q.service: the server exited\n<4>its last line unit=\"q.service\"\n<6> INFO ready\n"
        );
        assert_eq!(
            written(Mode::Agent, false),
            " WARN RolledBack: q.service: the server exited\nits last line unit=\"q.service\"\n INFO ready\n"
        );
        assert_eq!(
            written(Mode::Command, false),
            "specd: warning: RolledBack: q.service: the server exited\nits last line (unit=q.service)\nspecd: info: ready\n"
        );
        assert_eq!(
            written(Mode::Command, true),
            "<4>specd: warning: RolledBack: q.service: the server exited\n<4>its last line (unit=q.service)\n<6>specd: info: ready\n"
        );
    }
}
