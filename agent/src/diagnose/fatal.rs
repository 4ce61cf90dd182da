//! The server's own account of its death: the fatal error in a failed instance's output, read by
//! the engine's own conventions rather than by words that look like errors. Pure.
//!
//! Why not the first and last lines with "error" or "failed" in them: a vLLM prints a WARNING
//! with "failed" at every start (its ulimit), and pydantic ends its exception with a link. The
//! engines say what killed them in a shape of their own:
//!
//! - Python servers (vLLM, SGLang) die of an exception: the last traceback's final exception,
//!   `module.ExceptionName: message`, with the lines of its message. A multi-process vLLM ends
//!   with a generic `RuntimeError: Engine core initialization failed. See root cause above.`
//!   raised after its engine core logged the real traceback: an exception that says "root cause
//!   above" points to the traceback before it.
//! - llama.cpp logs `E ` lines (after its elapsed-time stamp) from the loader, and plain
//!   `error…` lines for bad arguments: the first names the cause, the last how it ended.
//!
//! A line whose level, in the engine's log format, is a warning, info or debug is never the
//! fatal error, whatever words it holds.

use std::collections::BTreeMap;

use super::Line;

/// The most characters of a quoted error: one line a person reads in a summary, a webhook
/// notice or a quarantine reason. vLLM's error for a draft model it cannot find is 474 with a
/// short path, and names the file it looked for (`config.json`) after 410.
const MAX_CHARS: usize = 500;
/// The line that opens a Python traceback (alone, or at the end of a log record's message).
const TRACEBACK: &str = "Traceback (most recent call last):";

/// A log record's level, in the engine's log format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Level {
    Debug,
    Info,
    Warning,
    Error,
}

/// The server's fatal error, as it said it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Fatal<'a> {
    /// One line of at most [`MAX_CHARS`] characters: the exception and its message, or the
    /// first and last error lines joined by " … ", without the log headers.
    pub text: String,
    /// The journal lines quoted, in the order of the output.
    pub lines: Vec<&'a Line>,
}

/// The fatal error in `out`, a failed instance's own output in journal order: the exception
/// of its last traceback (a Python server dies of the last exception it printed), else the
/// error lines of its log. `None` when it said nothing of the kind (a server that printed
/// nothing, or only warnings and info).
pub(super) fn fatal<'a>(out: &[&'a Line]) -> Option<Fatal<'a>> {
    let records: Vec<Record<'a>> = out.iter().map(|l| Record::of(l)).collect();
    python(&records).or_else(|| logged(&records))
}

/// The level of a message in any of the engines' log formats, `None` when it has no header.
pub(super) fn level(m: &str) -> Option<Level> {
    Header::of(m).level
}

/// The header a log record of the engines starts with: its length, its level and, for vLLM,
/// the process that wrote it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Header<'a> {
    len: usize,
    level: Option<Level>,
    /// vLLM's `(EngineCore pid=7)`: its processes share one stdout.
    process: &'a str,
}

impl<'a> Header<'a> {
    fn of(m: &'a str) -> Header<'a> {
        vllm(m)
            .or_else(|| sglang(m))
            .or_else(|| python_logging(m))
            .or_else(|| python_warning(m))
            .or_else(|| c10(m))
            .or_else(|| llama(m))
            .unwrap_or_default()
    }
}

fn level_word(w: &str) -> Option<Level> {
    match w {
        "DEBUG" | "TRACE" => Some(Level::Debug),
        "INFO" => Some(Level::Info),
        "WARNING" | "WARN" => Some(Level::Warning),
        "ERROR" | "CRITICAL" | "FATAL" => Some(Level::Error),
        _ => None,
    }
}

/// Whether `s` starts with `pattern`, where `0` is any ASCII digit and anything else itself.
fn shaped(s: &str, pattern: &str) -> bool {
    s.len() >= pattern.len()
        && s.bytes().zip(pattern.bytes()).all(|(c, p)| if p == b'0' { c.is_ascii_digit() } else { c == p })
}

/// vLLM: `(APIServer pid=7) WARNING 12-03 20:00:00 [file.py:12] ` (older releases without the
/// process). Its formatter repeats the header on every line of a record, a traceback's too.
fn vllm(m: &str) -> Option<Header<'_>> {
    let (process, rest) = match m.strip_prefix('(') {
        Some(r) => {
            let end = r.find(") ")?;
            r[..end].contains(" pid=").then_some((&m[..end + 2], &r[end + 2..]))?
        }
        None => ("", m),
    };
    let (word, rest) = rest.split_once(' ')?;
    let level = level_word(word)?;
    if !shaped(rest, "00-00 00:00:00 [") {
        return None;
    }
    let end = rest.find("] ")? + 2;
    Some(Header { len: m.len() - rest.len() + end, level: Some(level), process })
}

/// SGLang: `[2025-12-03 20:00:00 TP0] `, then a level word where the format has one.
fn sglang(m: &str) -> Option<Header<'_>> {
    if !shaped(m, "[0000-00-00 00:00:00") {
        return None;
    }
    let end = m.find("] ")? + 2;
    let rest = &m[end..];
    let word = rest.split([' ', ':']).next().unwrap_or_default();
    match level_word(word) {
        Some(l) => {
            let after = rest[word.len()..].trim_start_matches(':').trim_start();
            Some(Header { len: m.len() - after.len(), level: Some(l), process: "" })
        }
        None => Some(Header { len: end, level: None, process: "" }),
    }
}

/// Python's logging without a format and uvicorn's: `WARNING:root:…`, `INFO:     …`.
fn python_logging(m: &str) -> Option<Header<'_>> {
    let (word, rest) = m.split_once(':')?;
    let level = level_word(word)?;
    Some(Header { len: m.len() - rest.trim_start().len(), level: Some(level), process: "" })
}

/// Python's warnings module: `/usr/lib/python3.11/x.py:224: UserWarning: …`.
fn python_warning(m: &str) -> Option<Header<'_>> {
    let (place, rest) = m.split_once(": ")?;
    let (file, line) = place.rsplit_once(':')?;
    let (kind, _) = rest.split_once(": ")?;
    let ok = file.ends_with(".py")
        && !line.is_empty()
        && line.bytes().all(|b| b.is_ascii_digit())
        && kind.ends_with("Warning")
        && kind.bytes().all(|b| b.is_ascii_alphanumeric());
    ok.then(|| Header { len: place.len() + 2 + kind.len() + 2, level: Some(Level::Warning), process: "" })
}

/// PyTorch's C++ (c10) logging: `[W1203 20:00:00.123 ProcessGroupNCCL.cpp:12] `.
fn c10(m: &str) -> Option<Header<'_>> {
    let b = m.as_bytes();
    if b.len() < 3 || b[0] != b'[' || !(b[2].is_ascii_digit() || b[2] == b' ') {
        return None;
    }
    let level = match b[1] {
        b'I' => Level::Info,
        b'W' => Level::Warning,
        b'E' | b'F' => Level::Error,
        _ => return None,
    };
    Some(Header { len: m.find("] ")? + 2, level: Some(level), process: "" })
}

/// llama.cpp: `0.00.123.456 E ` (its elapsed time, then the level letter), either part optional.
fn llama(m: &str) -> Option<Header<'_>> {
    let digits = m.bytes().take_while(u8::is_ascii_digit).count();
    let stamp = if digits > 0 && shaped(&m[digits..], ".00.000.000 ") { digits + 12 } else { 0 };
    let rest = &m[stamp..];
    let level = match rest.as_bytes() {
        [c, b' ', next, ..] if *next != b' ' || stamp > 0 => match c {
            b'D' => Some(Level::Debug),
            b'I' => Some(Level::Info),
            b'W' => Some(Level::Warning),
            b'E' => Some(Level::Error),
            _ => None,
        },
        _ => None,
    };
    match (stamp, level) {
        (0, None) => None,
        (_, None) => Some(Header { len: stamp, level: None, process: "" }),
        (_, Some(l)) => Some(Header { len: stamp + 2, level: Some(l), process: "" }),
    }
}

/// One line of output with its header read.
#[derive(Clone, Copy, Debug)]
struct Record<'a> {
    line: &'a Line,
    header: Header<'a>,
    /// The header's text: a vLLM record's lines all start with the same one.
    head: &'a str,
    /// The message after the header, without trailing whitespace (vLLM ends lines with `\r`).
    body: &'a str,
}

impl<'a> Record<'a> {
    fn of(line: &'a Line) -> Record<'a> {
        let m = line.message.trim_end();
        let header = Header::of(m);
        Record { line, header, head: &m[..header.len], body: &m[header.len..] }
    }

    /// Said below error level: never the fatal error.
    fn quiet(&self) -> bool {
        matches!(self.header.level, Some(Level::Debug | Level::Info | Level::Warning))
    }

    /// Which process wrote it: the journal's pid, and vLLM's process name.
    fn stream(&self) -> (u32, &'a str) {
        (self.line.pid, self.header.process)
    }
}

/// A Python exception as the interpreter (or `logger.exception`) printed it after a traceback.
struct Raised<'a> {
    /// Its place in the output, for "the traceback before it".
    at: usize,
    /// The exception line, then its message lines.
    records: Vec<Record<'a>>,
}

/// Where one process's output stands while it is read.
enum State<'a> {
    Outside,
    Frames,
    Message(Raised<'a>),
}

/// The final exception of the last traceback, or of the one before it while an exception
/// points to "the root cause above".
fn python<'a>(records: &[Record<'a>]) -> Option<Fatal<'a>> {
    let mut raised: Vec<Raised<'a>> = Vec::new();
    let mut streams: BTreeMap<(u32, &str), State<'a>> = BTreeMap::new();
    for (at, r) in records.iter().enumerate() {
        let state = streams.entry(r.stream()).or_insert(State::Outside);
        let was = std::mem::replace(state, State::Outside);
        *state = match was {
            was if r.body.ends_with(TRACEBACK) => {
                if let State::Message(e) = was {
                    raised.push(e);
                }
                State::Frames
            }
            State::Outside => State::Outside,
            // A frame, its source line, a caret line; or another process's record in between.
            State::Frames if r.body.is_empty() || r.body.starts_with(char::is_whitespace) || r.quiet() => State::Frames,
            State::Frames => State::Message(Raised { at, records: vec![*r] }),
            State::Message(mut e) if continues(&e, r) => {
                e.records.push(*r);
                State::Message(e)
            }
            State::Message(e) => {
                raised.push(e);
                State::Outside
            }
        };
    }
    for (_, mut s) in streams {
        close(&mut s, &mut raised);
    }
    raised.retain(|e| !e.records[0].quiet());
    raised.sort_by_key(|e| e.at);
    let mut i = raised.len().checked_sub(1)?;
    while i > 0 && points_above(&exception_text(&raised[i]).0) {
        i -= 1;
    }
    let (text, lines) = exception_text(&raised[i]);
    Some(Fatal { text, lines })
}

/// An exception that sends the reader to the traceback before it: vLLM's API server about its
/// engine core ("Engine core initialization failed. See root cause above.", "EngineCore
/// encountered an issue. See stack trace (above) for the root cause.").
fn points_above(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    t.contains("root cause") && t.contains("above")
}

/// Ends a stream's exception at the end of its message.
fn close<'a>(state: &mut State<'a>, raised: &mut Vec<Raised<'a>>) {
    if let State::Message(e) = std::mem::replace(state, State::Outside) {
        raised.push(e);
    }
}

/// Whether `r` is one more line of exception `e`'s message: the same header (none, or vLLM's
/// repeated one), not blank, not the start of a chained exception's story.
fn continues(e: &Raised, r: &Record) -> bool {
    let first = &e.records[0];
    r.head == first.head
        && !r.body.trim().is_empty()
        && !r.body.starts_with("During handling of the above exception")
        && !r.body.starts_with("The above exception was the direct cause")
}

/// A message line without pydantic's tail of a validation error: the error's type and the
/// input it got (`[type=value_error, input_value=ArgsKwargs((), {…}), …]`, at the end of a line
/// or alone) and where its docs are: what the engine was given, not what went wrong.
fn without_pydantic_tail(s: &str) -> &str {
    if s.starts_with("For further information visit https://errors.pydantic.dev/") {
        return "";
    }
    match s.rfind("[type=") {
        Some(i) if s.ends_with(']') && s.contains("input_type=") => s[..i].trim_end(),
        _ => s,
    }
}

/// The exception line and its message lines as one line, and the lines it quotes.
fn exception_text<'a>(e: &Raised<'a>) -> (String, Vec<&'a Line>) {
    let mut text = String::new();
    let mut lines = Vec::new();
    for r in &e.records {
        let part = r.body.split_whitespace().collect::<Vec<_>>().join(" ");
        let part = without_pydantic_tail(&part);
        if part.is_empty() || text.chars().count() >= MAX_CHARS {
            continue;
        }
        if !text.is_empty() {
            text.push(' ');
        }
        text.push_str(part);
        lines.push(r.line);
    }
    (clip(text), lines)
}

/// At most [`MAX_CHARS`] characters, an ellipsis where it was cut.
fn clip(s: String) -> String {
    if s.chars().count() <= MAX_CHARS {
        return s;
    }
    let mut cut: String = s.chars().take(MAX_CHARS - 1).collect();
    cut.push('…');
    cut
}

/// Without a traceback: the lines the engine logged at error level, or without a level, the
/// loader's and the argument parser's `error…`/`failed to …` and a bare Python exception line.
/// The first names the cause, the last how it ended.
fn logged<'a>(records: &[Record<'a>]) -> Option<Fatal<'a>> {
    let errors: Vec<&Record<'a>> = records
        .iter()
        .filter(|r| match r.header.level {
            Some(l) => l == Level::Error,
            None => reads_as_error(r.body),
        })
        .collect();
    let (first, last) = (errors.first()?, errors.last()?);
    let say = |r: &Record| r.body.split_whitespace().collect::<Vec<_>>().join(" ");
    let (mut text, mut lines) = match (say(first), say(last)) {
        _ if errors.len() == 1 => (say(first), vec![first.line]),
        (a, b) if a == b => (a, vec![first.line, last.line]),
        (a, b) => (format!("{a} … {b}"), vec![first.line, last.line]),
    };
    // The loader's first error may not name its file ("tensor … is not within the file
    // bounds"): the server's own line that says which model it was (the model or the draft)
    // goes between the first and the last, unless the first already names that file.
    if let Some(w) = errors.iter().rev().find(|r| names_the_model(r.body))
        && !std::ptr::eq(*w, *first)
        && !std::ptr::eq(*w, *last)
        && quoted_path(w.body).is_some_and(|p| !first.body.contains(p))
    {
        let (a, b) = text.split_once(" … ").map_or((text.as_str(), None), |(a, b)| (a, Some(b)));
        text = match b {
            Some(b) => format!("{a} … {} … {b}", say(w)),
            None => format!("{a} … {}", say(w)),
        };
        lines.insert(1, w.line);
    }
    Some(Fatal { text: clip(text), lines })
}

/// llama-server's line that names the model it could not load: `load_model: failed to load
/// model, '<path>'` or `… failed to load draft model, '<path>'` (tools/server).
fn names_the_model(body: &str) -> bool {
    body.contains("load_model: failed to load model, '") || body.contains("load_model: failed to load draft model, '")
}

/// The path between the first pair of single quotes.
fn quoted_path(body: &str) -> Option<&str> {
    let (_, rest) = body.split_once('\'')?;
    Some(rest.split_once('\'')?.0)
}

/// A line without a level that says it failed: llama.cpp's loader (`error loading model`,
/// `failed to open GGUF file`), its argument parser (`error: invalid argument`,
/// `error while handling argument`), or a Python exception line without its traceback.
fn reads_as_error(body: &str) -> bool {
    let b = body.trim_start();
    let lower = b.to_ascii_lowercase();
    lower.starts_with("error") || lower.contains(" error:") || lower.contains("failed to ") || exception_line(b)
}

/// `module.SomeError: message` (or `…Exception`), as Python prints the exception it dies of.
fn exception_line(s: &str) -> bool {
    let name = s.split_once(':').map_or(s, |(n, _)| n);
    !name.is_empty()
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.')
        && (name.ends_with("Error") || name.ends_with("Exception"))
}

#[cfg(test)]
mod tests {
    use super::super::Origin;
    use super::*;

    /// The output lines of one process (journal pid 77), in order.
    fn out(text: &str) -> Vec<Line> {
        text.lines().map(|m| Line { origin: Origin::Service, pid: 77, message: m.into(), ..Line::default() }).collect()
    }

    fn read(lines: &[Line]) -> Option<Fatal<'_>> {
        let refs: Vec<&Line> = lines.iter().collect();
        fatal(&refs)
    }

    #[track_caller]
    fn quotes(text: &str, want: &str) {
        let lines = out(text);
        let f = read(&lines).unwrap_or_else(|| panic!("no fatal error in {text}"));
        assert_eq!(f.text, want);
    }

    /// The cited lines' messages.
    fn cited(f: &Fatal) -> Vec<String> {
        f.lines.iter().map(|l| l.message.clone()).collect()
    }

    const ULIMIT: &str = "(APIServer pid=26325) WARNING 12-03 21:00:39 [system_utils.py:255] Found ulimit of 1024 and failed to automatically increase with error current limit exceeds maximum limit.";

    #[test]
    fn levels_are_read_in_each_engine_s_log_format() {
        let cases = [
            (ULIMIT, Some(Level::Warning)),
            (
                "(EngineCore_DP0 pid=2411) ERROR 12-02 11:18:40 [core.py:843] EngineCore failed to start.",
                Some(Level::Error),
            ),
            ("(APIServer pid=7) INFO 12-03 21:00:39 [api_utils.py:347] ", Some(Level::Info)),
            ("(APIServer pid=7) DEBUG 12-03 21:00:39 [a.py:1] x", Some(Level::Debug)),
            ("ERROR 12-02 11:18:40 [core.py:843] EngineCore failed to start.", Some(Level::Error)),
            ("WARNING 12-02 11:18:40 [x.py:1] failed", Some(Level::Warning)),
            ("[2025-12-03 20:00:00] WARNING failed to do a thing", Some(Level::Warning)),
            ("[2025-12-03 20:00:00 TP0] ERROR: boom", Some(Level::Error)),
            ("[2025-12-03 20:00:00] Load weight end.", None),
            ("INFO:     127.0.0.1:41634 - \"GET /health HTTP/1.1\" 200 OK", Some(Level::Info)),
            ("WARNING:root:failed to import triton", Some(Level::Warning)),
            ("ERROR:    Exception in ASGI application", Some(Level::Error)),
            (
                "/usr/lib/python3.11/multiprocessing/resource_tracker.py:224: UserWarning: resource_tracker: There appear to be 1 leaked semaphore objects",
                Some(Level::Warning),
            ),
            ("/x/y.py:3: FutureWarning: `x` is deprecated and failed", Some(Level::Warning)),
            ("[W1203 20:00:00.123456 ProcessGroupNCCL.cpp:12] Warning: failed to x", Some(Level::Warning)),
            ("[E socket.cpp:860] [c10d] The client socket has failed to connect", Some(Level::Error)),
            ("0.00.000.000 W operator(): failed to measure the memory of the extra model", Some(Level::Warning)),
            ("0.01.234.567 E gguf_init_from_file: failed to open GGUF file '/x.gguf'", Some(Level::Error)),
            ("12.01.234.567 I srv  llama_server: initializing ...", Some(Level::Info)),
            ("E srv    load_model: failed to load draft model", Some(Level::Error)),
            ("0.00.000.000 continued", None),
            ("Traceback (most recent call last):", None),
            ("ValueError: Unknown speculative algorithm name: EAGLE4", None),
            ("1. Provide a valid Hugging Face repository ID.", None),
            ("  Value error, Invalid repository ID or local directory specified: '/m'.", None),
            ("error while handling argument \"-c\": stoi", None),
        ];
        for (m, want) in cases {
            assert_eq!(level(m), want, "{m:?}");
        }
    }

    /// The problem this module exists for: vLLM's ulimit warning first, pydantic's link last,
    /// the cause in between.
    #[test]
    fn a_python_server_s_fatal_error_is_its_last_exception_with_its_message() {
        let text = format!(
            "{ULIMIT}
Traceback (most recent call last):
  File \"/opt/vllm/bin/vllm\", line 8, in <module>
    sys.exit(main())
             ^^^^^^
  File \"/opt/vllm/lib/python3.11/site-packages/pydantic/_internal/_dataclasses.py\", line 121, in __init__
    s.__pydantic_validator__.validate_python(ArgsKwargs(args, kwargs), self_instance=s)
pydantic_core._pydantic_core.ValidationError: 1 validation error for SpeculativeConfig
  Value error, Invalid repository ID or local directory specified: '/models/no-such-draft'.
Please verify the following requirements:
1. Provide a valid Hugging Face repository ID.
 [type=value_error, input_value=ArgsKwargs((), {{'model': ...config_format': 'auto'}}), input_type=ArgsKwargs]
    For further information visit https://errors.pydantic.dev/2.14/v/value_error"
        );
        let lines = out(&text);
        let f = read(&lines).unwrap();
        assert_eq!(
            f.text,
            "pydantic_core._pydantic_core.ValidationError: 1 validation error for SpeculativeConfig Value error, Invalid repository ID or local directory specified: '/models/no-such-draft'. Please verify the following requirements: 1. Provide a valid Hugging Face repository ID."
        );
        // The exception and its message are cited; not the frames, not pydantic's tail.
        assert_eq!(cited(&f), lines[7..11].iter().map(|l| l.message.clone()).collect::<Vec<_>>());
    }

    #[test]
    fn a_field_error_keeps_the_field_and_drops_pydantic_s_type_and_input() {
        quotes(
            "Traceback (most recent call last):
  File \"x.py\", line 1, in <module>
pydantic_core._pydantic_core.ValidationError: 1 validation error for SpeculativeConfig
num_speculative_tokens
  Input should be greater than 0 [type=greater_than, input_value=-1, input_type=int]
    For further information visit https://errors.pydantic.dev/2.14/v/greater_than",
            "pydantic_core._pydantic_core.ValidationError: 1 validation error for SpeculativeConfig num_speculative_tokens Input should be greater than 0",
        );
    }

    #[test]
    fn of_chained_exceptions_the_last_raised_is_the_fatal_one() {
        quotes(
            "Traceback (most recent call last):
  File \"a.py\", line 1, in f
KeyError: 'model'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File \"a.py\", line 3, in g
ValueError: no model named x",
            "ValueError: no model named x",
        );
        quotes(
            "Traceback (most recent call last):
  File \"a.py\", line 1, in f
OSError: [Errno 2] No such file or directory: '/m/config.json'

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File \"a.py\", line 3, in g
RuntimeError: cannot load /m",
            "RuntimeError: cannot load /m",
        );
    }

    /// vLLM's engine core logs its traceback (every line under the log header), then the API
    /// server dies of a generic exception that points up to it.
    #[test]
    fn an_exception_that_points_to_the_root_cause_above_yields_to_the_traceback_before_it() {
        let core = "(EngineCore_DP0 pid=2411) ERROR 12-02 11:18:40 [core.py:843]";
        let text = format!(
            "{core} EngineCore failed to start.
{core} Traceback (most recent call last):
{core}   File \"/v/core.py\", line 834, in run_engine_core
{core}     engine_core = EngineCoreProc(*args, **kwargs)
(APIServer pid=2300) INFO 12-02 11:18:40 [x.py:1] interleaved
{core} ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`.
(APIServer pid=2300) INFO 12-02 11:18:41 [x.py:1] shutting down
Traceback (most recent call last):
  File \"/opt/vllm/bin/vllm\", line 8, in <module>
    sys.exit(main())
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {{}}
/usr/lib/python3.11/multiprocessing/resource_tracker.py:224: UserWarning: resource_tracker: leaked
  warnings.warn('resource_tracker: There appear to be %d '"
        );
        let lines = out(&text);
        let f = read(&lines).unwrap();
        assert_eq!(
            f.text,
            "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`."
        );
        assert_eq!(cited(&f), [lines[5].message.clone()]);
        // Alone, the generic exception is all there is.
        quotes(
            "Traceback (most recent call last):
  File \"/opt/vllm/bin/vllm\", line 8, in <module>
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
        );
    }

    #[test]
    fn a_message_ends_where_the_next_record_or_a_warning_begins() {
        // SGLang: the traceback opens at the end of a log record; the next record ends it.
        quotes(
            "[2026-12-02 11:18:02] Scheduler hit an exception: Traceback (most recent call last):
  File \"/s/scheduler.py\", line 2893, in run_scheduler_process
    scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.
[2026-12-02 11:18:02] Received sigquit from a child process. It usually means the child failed.",
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
        );
        // A warning of Python's warnings module after the exception is not its message.
        quotes(
            "Traceback (most recent call last):
  File \"a.py\", line 1, in f
RuntimeError: boom
/usr/lib/python3.11/multiprocessing/resource_tracker.py:224: UserWarning: resource_tracker: leaked
  warnings.warn('resource_tracker: There appear to be %d '",
            "RuntimeError: boom",
        );
        // A vLLM record's lines share its header; the next record has another.
        let h = "(APIServer pid=1) ERROR 12-03 21:03:52 [async_llm.py:906]";
        quotes(
            &format!(
                "{h} Traceback (most recent call last):
{h}   File \"/v/core_client.py\", line 1235, in get_output_async
{h} vllm.v1.engine.exceptions.EngineDeadError: EngineCore died.
(APIServer pid=1) INFO 12-03 21:03:52 [launcher.py:279] [shutdown] API server: engine client stopped"
            ),
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore died.",
        );
    }

    #[test]
    fn a_warning_is_never_the_fatal_error() {
        // vLLM's warning at every start, and llama.cpp's: nothing fatal.
        let lines =
            out(&format!("{ULIMIT}\n0.00.000.000 W operator(): failed to measure the memory of the extra model"));
        assert_eq!(read(&lines), None);
        // A traceback logged as a warning (logger.warning(..., exc_info=True)) is not it either.
        let h = "(APIServer pid=1) WARNING 12-03 21:03:52 [x.py:9]";
        let lines = out(&format!(
            "Traceback (most recent call last):
  File \"a.py\", line 1, in f
OSError: [Errno 24] Too many open files
{h} retrying, failed once
{h} Traceback (most recent call last):
{h}   File \"b.py\", line 2, in g
{h} TimeoutError: failed to reach the hub"
        ));
        assert_eq!(read(&lines).unwrap().text, "OSError: [Errno 24] Too many open files");
        assert_eq!(read(&lines[3..]), None);
    }

    /// A draft GGUF cut short: the loader's error names a tensor, not the file; llama-server's
    /// own line says it was the draft, and which file.
    #[test]
    fn a_load_error_that_names_no_file_is_quoted_with_the_line_that_names_the_model() {
        let lines = out("0.00.000.000 I srv    load_model: loading model '/m/a.gguf'
0.00.000.000 I common_speculative_init_result: loading draft model '/m/draft.gguf'
0.00.000.000 E llama_model_load: error loading model: tensor 'blk.3.ffn_up.weight' data is not within the file bounds, model is corrupted or incomplete
0.00.000.000 E llama_model_load_from_file_impl: failed to load model
0.00.000.000 E common_speculative_init_result: failed to load draft model, '/m/draft.gguf'
0.00.000.000 E srv    load_model: failed to load draft model, '/m/draft.gguf'
0.00.000.000 E srv  llama_server: exiting due to model loading error");
        let f = read(&lines).unwrap();
        assert_eq!(
            f.text,
            "llama_model_load: error loading model: tensor 'blk.3.ffn_up.weight' data is not within the file bounds, model is corrupted or incomplete … srv load_model: failed to load draft model, '/m/draft.gguf' … srv llama_server: exiting due to model loading error"
        );
        assert_eq!(cited(&f), [lines[2].message.clone(), lines[5].message.clone(), lines[6].message.clone()]);
    }

    /// llama.cpp: the first error line names the cause, the last says how it ended; its warning
    /// with "failed" in it is not one of them.
    #[test]
    fn llama_cpp_s_fatal_error_is_its_first_and_last_error_lines() {
        let lines = out("0.00.000.000 I srv    load_model: loading model '/m/a.gguf'
0.00.000.000 E gguf_init_from_file: failed to open GGUF file '/nonexistent.gguf' (No such file or directory)
0.00.000.000 W operator(): failed to measure the memory of the extra model, fitting without it: failed to load model
0.00.000.000 E srv    load_model: failed to load draft model, '/nonexistent.gguf'
0.00.000.000 I srv    operator(): operator(): cleaning up before exit...
0.00.000.000 E srv  llama_server: exiting due to model loading error");
        let f = read(&lines).unwrap();
        assert_eq!(
            f.text,
            "gguf_init_from_file: failed to open GGUF file '/nonexistent.gguf' (No such file or directory) … srv llama_server: exiting due to model loading error"
        );
        assert_eq!(cited(&f), [lines[1].message.clone(), lines[5].message.clone()]);
        // One error line is quoted once; without a level, the argument parser's error counts.
        quotes("0.00.000.000 E main: exiting", "main: exiting");
        quotes(
            "error while handling argument \"--spec-draft-n-max\": stoi\n\nusage:",
            "error while handling argument \"--spec-draft-n-max\": stoi",
        );
    }

    #[test]
    fn without_a_traceback_error_level_lines_and_bare_exception_lines_are_quoted() {
        quotes(
            "(EngineCore_DP0 pid=2411) ERROR 12-02 11:18:40 [core.py:843] EngineCore failed to start.
(EngineCore_DP0 pid=2411) INFO 12-02 11:18:40 [core.py:1] bye
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
            "EngineCore failed to start. … RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
        );
    }

    #[test]
    fn nothing_fatal_in_silence_or_info() {
        assert_eq!(read(&[]), None);
        assert_eq!(read(&out("[2026-12-02 11:18:00] Load weight end.\nINFO:     Shutting down")), None);
    }

    #[test]
    fn a_quote_is_one_line_of_at_most_500_characters() {
        let long = "x".repeat(400);
        let lines = out(&format!(
            "Traceback (most recent call last):\n  File \"a.py\", line 1, in f\nValueError: {long}\n{long}\n{long}"
        ));
        let f = read(&lines).unwrap();
        assert_eq!(f.text.chars().count(), MAX_CHARS);
        assert!(f.text.starts_with("ValueError: xxx") && f.text.ends_with("x…"), "{}", f.text);
        assert!(!f.text.contains('\n'));
        // The lines quoted, not the ones cut off entirely.
        assert_eq!(f.lines.len(), 2);
    }
}
