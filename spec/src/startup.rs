//! A start, timed by phase from the engine's own log lines. Each engine's lines are an engine fact
//! ([`crate::EngineFacts::startup`]: which line begins which phase, which says it is ready),
//! checked against whole starts recorded from the real engines
//! (`tests/fixtures/engines/*/startup/`, SGLang's from its source); reading them is pure.
//!
//! A phase begins at the first line (after the previous phase began) that says one of its
//! markers, the first marker of its list that any such line says winning over the next (vLLM on
//! a GPU says `Model loading took` once its model and its draft are loaded; on a CPU only
//! `Loading weights took`). A phase whose lines never come is skipped (the draft's weights of a
//! spec without a draft); a phase may come twice (a draft model's weights after the model's
//! warm-up), its spans then add up. The first phase, `process`, begins when the process was
//! started; the last ends at the engine's ready line (or when the caller saw it ready, or died).
//!
//! ```
//! use specd_spec::{Engine, engine_facts, startup};
//! let lines = [(5_000, "I srv    load_model: loading model '/m.gguf'"),
//!              (160_000, "I cmn          init: llama threadpool init, n_threads = 2"),
//!              (197_000, "I srv  llama_server: model loaded"),
//!              (197_010, "I srv  llama_server: listening on http://127.0.0.1:8080")];
//! let t = startup::timeline(&engine_facts(Engine::LlamaCpp).startup, 2_000, lines);
//! let phases = t.phases(None);
//! assert_eq!(phases.iter().map(|p| p.0).collect::<Vec<_>>(), ["process", "weights", "warmup", "api"]);
//! assert_eq!(phases[1].1, 155_000);
//! assert_eq!(t.ready_us, Some(197_010));
//! ```

/// The phases a start is told in, across engines: the values of the metrics' `phase` label.
pub const PHASES: [(&str, &str); 5] = [
    ("process", "from the process's start to the engine's first line about the model (imports, config, its workers)"),
    ("weights", "the model's (and a draft's) weights read and placed"),
    ("engine", "the engine set up on the loaded model: profiling, KV cache, compilation, CUDA graphs"),
    ("warmup", "llama.cpp: the context's threads and an empty warm-up run"),
    ("api", "the HTTP server brought up (SGLang: its warm-up request) until the engine says it serves"),
];

/// The first phase, which no line begins: the process started.
pub const PROCESS: &str = "process";

/// How an engine's start reads in its own log.
#[derive(Debug)]
pub struct StartupLog {
    /// The phases after [`PROCESS`], in the order they come.
    pub phases: &'static [PhaseMark],
    /// The line that says the server serves (it ends the last phase).
    pub ready: &'static str,
}

/// One phase and the lines that begin it.
#[derive(Debug)]
pub struct PhaseMark {
    pub phase: &'static str,
    /// Text a line says, in the order of preference.
    pub markers: &'static [&'static str],
}

impl StartupLog {
    /// Whether a line means anything to the timing (begins a phase, or says ready): the lines to
    /// keep of an instance's output.
    pub fn marks(&self, line: &str) -> bool {
        line.contains(self.ready) || self.phases.iter().any(|p| p.markers.iter().any(|m| line.contains(m)))
    }
}

/// One span of a start: a phase and when it began (µs, the caller's clock).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Span {
    pub phase: &'static str,
    pub from_us: u64,
}

/// A start's spans as its lines tell them, and when it said it was ready.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Timeline {
    /// In order; the first is [`PROCESS`], from the start.
    pub spans: Vec<Span>,
    /// The ready line's time, once it came.
    pub ready_us: Option<u64>,
}

/// The spans of a start that began at `start_us`, from the instance's lines in order (`(µs,
/// text)`, the clock of `start_us`); a line before the start counts as at the start.
pub fn timeline<'a>(log: &StartupLog, start_us: u64, lines: impl IntoIterator<Item = (u64, &'a str)>) -> Timeline {
    let lines: Vec<(u64, &str)> = lines.into_iter().map(|(t, l)| (t.max(start_us), l)).collect();
    let mut spans = vec![Span { phase: PROCESS, from_us: start_us }];
    // Where the search for the next phase's line starts.
    let mut after = 0;
    for mark in log.phases {
        let found =
            mark.markers.iter().find_map(|m| lines[after..].iter().position(|(_, l)| l.contains(m)).map(|i| after + i));
        if let Some(i) = found {
            spans.push(Span { phase: mark.phase, from_us: lines[i].0 });
            after = i + 1;
        }
    }
    let ready_us = lines[after..].iter().find(|(_, l)| l.contains(log.ready)).map(|(t, _)| *t);
    Timeline { spans, ready_us }
}

impl Timeline {
    /// Each phase's time (µs), in the order the phases first came (the spans of a phase that
    /// came twice added up), the last ending at the ready line, else at `end_us` (when the
    /// caller saw it ready, or it died; `None`: the last phase is left at 0, still under way).
    pub fn phases(&self, end_us: Option<u64>) -> Vec<(&'static str, u64)> {
        let end = self.ready_us.or(end_us);
        let mut out: Vec<(&'static str, u64)> = Vec::new();
        for (i, s) in self.spans.iter().enumerate() {
            let to = self.spans.get(i + 1).map(|n| n.from_us).or(end).unwrap_or(s.from_us);
            let d = to.saturating_sub(s.from_us);
            match out.iter_mut().find(|(p, _)| *p == s.phase) {
                Some(p) => p.1 += d,
                None => out.push((s.phase, d)),
            }
        }
        out
    }

    /// The phase under way last (where a start that died, died), and since when.
    pub fn current(&self) -> &Span {
        self.spans.last().expect("a timeline begins with the process")
    }

    /// How many phases past [`PROCESS`] its lines told.
    pub fn told(&self) -> usize {
        self.spans.len() - 1
    }
}

/// The start of an instance whose engine is not known (`specd diagnose` reads any unit's
/// journal): the timeline of the engine whose lines tell the most phases, when any tells one.
pub fn of_any_engine(start_us: u64, lines: &[(u64, &str)]) -> Option<(crate::Engine, Timeline)> {
    use crate::Engine;
    [Engine::Sglang, Engine::Vllm, Engine::LlamaCpp]
        .into_iter()
        .map(|e| (e, timeline(&crate::engine_facts(e).startup, start_us, lines.iter().copied())))
        .filter(|(_, t)| t.told() > 0)
        .max_by_key(|(_, t)| t.told())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: StartupLog = StartupLog {
        phases: &[
            PhaseMark { phase: "weights", markers: &["load begin"] },
            PhaseMark { phase: "engine", markers: &["all loaded", "weights loaded"] },
            PhaseMark { phase: "weights", markers: &["draft begin"] },
            PhaseMark { phase: "api", markers: &["http up"] },
        ],
        ready: "ready",
    };

    #[test]
    fn a_preferred_marker_wins_over_an_earlier_line_of_the_next() {
        let lines = [(10, "load begin"), (20, "weights loaded"), (30, "all loaded"), (40, "http up"), (50, "ready")];
        let t = timeline(&LOG, 0, lines);
        assert_eq!(t.phases(None), [("process", 10), ("weights", 20), ("engine", 10), ("api", 10)]);
        // Only the fallback: it begins the phase.
        let t = timeline(&LOG, 0, [(10, "load begin"), (20, "weights loaded"), (50, "ready")]);
        assert_eq!(t.phases(None), [("process", 10), ("weights", 10), ("engine", 30)]);
    }

    #[test]
    fn a_phase_that_comes_twice_adds_up_and_one_that_never_comes_is_skipped() {
        let lines =
            [(10, "load begin"), (20, "all loaded"), (30, "draft begin"), (45, "http up"), (50, "ready"), (60, "x")];
        let t = timeline(&LOG, 0, lines);
        assert_eq!(t.phases(Some(99)), [("process", 10), ("weights", 25), ("engine", 10), ("api", 5)]);
        let t = timeline(&LOG, 0, [(10, "load begin"), (20, "all loaded"), (45, "http up"), (50, "ready")]);
        assert_eq!(t.phases(None), [("process", 10), ("weights", 10), ("engine", 25), ("api", 5)]);
    }

    #[test]
    fn without_its_ready_line_a_start_ends_where_the_caller_says_or_is_under_way() {
        let t = timeline(&LOG, 100, [(90, "load begin"), (130, "all loaded")]);
        assert_eq!(t.spans[1].from_us, 100, "a line before the start counts at the start");
        assert_eq!(t.phases(Some(200)), [("process", 0), ("weights", 30), ("engine", 70)]);
        assert_eq!(t.phases(None), [("process", 0), ("weights", 30), ("engine", 0)]);
        assert_eq!((t.current().phase, t.told()), ("engine", 2));
        // Nothing said: all of it is the process's.
        let t = timeline(&LOG, 100, []);
        assert_eq!(t.phases(Some(250)), [("process", 150)]);
        assert_eq!(t.told(), 0);
    }

    #[test]
    fn a_ready_line_before_the_last_phase_does_not_end_it() {
        // "ready" is said by a line that begins nothing, after the last phase found only.
        let t = timeline(&LOG, 0, [(5, "not ready yet"), (10, "load begin"), (20, "ready")]);
        assert_eq!(t.ready_us, Some(20));
        let t = timeline(&LOG, 0, [(10, "load begin"), (20, "all loaded"), (30, "http up")]);
        assert_eq!(t.ready_us, None);
    }

    #[test]
    fn the_engine_is_the_one_whose_lines_tell_the_most() {
        let llama = [
            (5, "I srv    load_model: loading model '/m.gguf'"),
            (9, "I cmn  init: llama threadpool init, n_threads = 2"),
        ];
        let (e, t) = of_any_engine(0, &llama).unwrap();
        assert_eq!((e, t.current().phase, t.current().from_us), (crate::Engine::LlamaCpp, "warmup", 9));
        assert!(of_any_engine(0, &[(5, "hello")]).is_none());
    }

    #[test]
    fn only_the_lines_of_the_timing_are_marked() {
        assert!(LOG.marks("x load begin y") && LOG.marks("is ready") && !LOG.marks("loading"));
    }
}
