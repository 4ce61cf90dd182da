//! What a person reads of an evaluation: the evidence (drafts, steps, load, acceptance by
//! position with its intervals), the step cost and where it came from, the table of draft
//! lengths, the comparison with a sweep, and the verdict; and the commit message of a proposal,
//! which carries the same. Pure: values in, text out.

use std::fmt::Write;

use crate::core::record::format_time;
use crate::core::tune::{self, CostSource, Interval, Row, Verdict, goal_words};

use super::{Evaluation, FromSweep};

fn num(v: Option<f64>, digits: usize) -> String {
    v.map_or("–".into(), |v| format!("{v:.digits$}"))
}

fn range(i: Option<Interval>, digits: usize) -> String {
    i.map_or(String::new(), |i| format!(" ({:.digits$}–{:.digits$})", i.low, i.high))
}

fn pct(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{:+.1} %", v * 100.0))
}

/// The evidence, in lines.
pub fn evidence(e: &Evaluation) -> String {
    let o = &e.observed;
    let mut s = String::new();
    let drafts = o.acceptance.as_ref().map_or(0, |a| a.drafts);
    let _ = write!(s, "evidence since the instance started: {drafts} drafts");
    if let Some(d) = o.decode {
        let ms = d.step_s().map_or(String::new(), |t| format!(" of {:.2} ms each", t * 1000.0));
        let _ = write!(s, ", {} decode steps{ms} giving {} tokens", d.steps, d.tokens);
    }
    let _ = writeln!(s);
    let l = &o.load;
    let mut load = Vec::new();
    if let Some(c) = l.concurrency {
        load.push(format!("{c:.2} requests in flight per step"));
    }
    if let Some(r) = l.request_rate {
        load.push(format!("{r:.3} requests/s"));
    }
    if let Some(n) = l.requests {
        load.push(format!("{n} requests finished"));
    }
    if !load.is_empty() {
        let _ = writeln!(s, "load served: {}", load.join(", "));
    }
    if let Some(a) = o.acceptance.as_ref().filter(|a| !a.per_pos.is_empty()) {
        let per: Vec<String> = a
            .per_pos
            .iter()
            .enumerate()
            .map(|(i, _)| format!("{}: {:.3}{}", i + 1, a.rate(i), range(tune::wilson(a.per_pos[i], a.drafts), 3)))
            .collect();
        let _ = writeln!(
            s,
            "accepted through each draft position (share of the drafts, 95 % interval): {}",
            per.join(", ")
        );
    }
    if let Some(why) = &o.by_position_unusable {
        let _ = writeln!(s, "not by position: {why}");
    }
    for n in &o.notes {
        let _ = writeln!(s, "note: {n}");
    }
    s
}

/// Where the step cost came from, in one line (`swept`: the step times of the sweep given).
pub fn cost(p: &tune::Prediction, swept: Option<&[(u32, f64)]>) -> String {
    let Some(c) = &p.cost else {
        return "step cost: unknown (the engine's step times were not read): no decode speed predicted\n".into();
    };
    let base = format!(
        "a target pass {:.2} ms, {:.3} ms more per draft position",
        c.target_s * 1000.0,
        c.per_draft_s * 1000.0
    );
    match &c.source {
        CostSource::Calibrated { points } => {
            let at: Vec<String> = points.iter().map(|(k, s)| format!("{k}: {:.2} ms", s * 1000.0)).collect();
            format!(
                "step cost: {base} (ratio {:.3}, calibrated on the sweep's step times at num_steps {})\n",
                c.ratio(),
                at.join(", ")
            )
        }
        CostSource::Assumed { per_position } => assumed(&base, *per_position, swept),
    }
}

/// The step cost's line when it is assumed: how to calibrate it, or, when a sweep's step times
/// (`swept`) were given, that they gave none.
fn assumed(base: &str, per_position: f64, swept: Option<&[(u32, f64)]>) -> String {
    let why = match swept {
        None => "calibrate with `specd sweep --calibrate`, then `specd tune --sweep`".to_string(),
        Some(points) if points.len() < 2 => {
            "the sweep measured the step time at fewer than two draft lengths: none to calibrate on".to_string()
        }
        Some(points) => {
            let at: Vec<String> = points.iter().map(|(k, s)| format!("{k}: {:.2} ms", s * 1000.0)).collect();
            format!(
                "the sweep's step times ({}) give no cost of a draft position (a longer draft stepped no slower: noise on the host); a calibration with more requests may",
                at.join(", ")
            )
        }
    };
    format!(
        "step cost: {base} (ASSUMED: a draft position costs {:.1} % of a target pass on the steps that draft; {why})\n",
        per_position * 100.0
    )
}

/// The table of draft lengths (Markdown).
pub fn table(rows: &[Row], concurrency: Option<f64>) -> String {
    let at = concurrency.map_or("the load served".into(), |c| format!("{c:.1} in flight"));
    let mut s = format!(
        "| num_steps | accept length (95 %) | tokens/step | step (ms) | tok/s per request (95 %) | tok/s at {at} |\n|--:|--:|--:|--:|--:|--:|\n"
    );
    for r in rows {
        let k = if r.running { format!("{} (running)", r.k) } else { r.k.to_string() };
        if let Some(why) = &r.not_predicted {
            let _ = writeln!(s, "| {k} | not predicted: {why} | | | | |");
            continue;
        }
        let _ = writeln!(
            s,
            "| {k} | {}{} | {} | {} | {}{} | {} |",
            num(r.accept_length, 2),
            range(r.accept_length_interval, 2),
            num(r.tokens_per_step, 2),
            num(r.step_ms, 2),
            num(r.tok_s_per_request, 1),
            range(r.tok_s_per_request_interval, 1),
            num(r.throughput, 1),
        );
    }
    s
}

/// Predicted against measured (Markdown).
pub fn compared(c: &[tune::Compared], sweep: &FromSweep) -> String {
    let mut s = format!(
        "compared with what the sweep measured ({}, concurrency {}):\n| num_steps | accept length predicted / measured | error | tok/s per request predicted / measured | error |\n|--:|--:|--:|--:|--:|\n",
        sweep.results, sweep.concurrency
    );
    for x in c {
        let _ = writeln!(
            s,
            "| {} | {} / {} | {} | {} / {} | {} |",
            x.k,
            num(x.predicted_accept_length, 2),
            num(x.measured_accept_length, 2),
            pct(x.accept_length_error),
            num(x.predicted_tok_s, 1),
            num(x.measured_tok_s, 1),
            pct(x.tok_s_error),
        );
    }
    s
}

/// The verdict in one line.
pub fn verdict(p: &tune::Prediction) -> String {
    match &p.verdict {
        Verdict::CannotTell { why } => format!("cannot tell yet: {why}; nothing is proposed"),
        Verdict::Keep { k } => format!(
            "keep num_steps {k}: no other length is predicted to give {} more {}",
            pct_plain(tune::MIN_GAIN),
            goal_words(p.goal)
        ),
        Verdict::Change { from, to, gain } => {
            format!("change num_steps {from} → {to}: {} more {} predicted", pct_plain(*gain), goal_words(p.goal))
        }
    }
}

fn pct_plain(v: f64) -> String {
    format!("{:.1} %", v * 100.0)
}

/// Everything, for the terminal.
pub fn report(unit: &str, e: &Evaluation, sweep: Option<&FromSweep>) -> String {
    let mut s = head(unit, e);
    s.push_str(&evidence(e));
    let swept = sweep.map(FromSweep::step_times);
    s.push_str(&cost(&e.prediction, swept.as_deref()));
    if let Some(sw) = sweep {
        let _ = writeln!(s, "objective ({}): maximize {}", sw.file, goal_words(sw.goal()));
        for n in &sw.notes {
            let _ = writeln!(s, "sweep: {n}");
        }
    }
    s.push('\n');
    s.push_str(&table(&e.prediction.rows, e.observed.load.concurrency));
    if let Some(sw) = sweep.filter(|_| !e.compared.is_empty()) {
        s.push('\n');
        s.push_str(&compared(&e.compared, sw));
    }
    let _ = writeln!(s, "\n{}", verdict(&e.prediction));
    s
}

fn head(unit: &str, e: &Evaluation) -> String {
    let sp = e.spec.speculative.as_ref();
    let algorithm = sp.and_then(|s| s.algorithm.as_deref()).unwrap_or("?");
    format!(
        "{unit}: {} {algorithm}, num_steps {} (unit {}, applied {}{})\n",
        e.spec.engine.as_str(),
        e.observed.running_k,
        specd_spec::short(&e.sha256),
        format_time(e.since),
        e.source.as_ref().map_or(String::new(), |s| format!(" from {s}")),
    )
}

/// A proposal's commit message: the summary line, then the evidence it rests on.
pub fn message(unit: &str, host: &str, e: &Evaluation, sweep: Option<&FromSweep>) -> String {
    let Verdict::Change { from, to, gain } = e.prediction.verdict else {
        return format!("tune: {unit}: nothing to change\n");
    };
    let mut s = format!(
        "tune: {unit}: speculative.num_steps {from} → {to} ({} more {})\n\n",
        pct_plain(gain),
        goal_words(e.prediction.goal)
    );
    let _ = writeln!(s, "Proposed by `specd tune --propose` on host {host}, from the running instance's own counts.");
    let _ = writeln!(s, "It changes nothing by itself: merge it, and the agents deploy it like any commit.\n");
    s.push_str(&report(unit, e, sweep));
    s
}

#[cfg(test)]
mod tests {
    use super::assumed;

    /// An assumed step cost says how to calibrate it, or why the sweep given did not.
    #[test]
    fn an_assumed_step_cost_says_why_it_is_assumed() {
        let base = "a target pass 40.00 ms, 2.000 ms more per draft position";
        assert!(assumed(base, 0.05, None).contains("calibrate with `specd sweep --calibrate`"));
        let noisy = assumed(base, 0.05, Some(&[(3, 0.04029), (4, 0.03341)]));
        assert!(noisy.contains("the sweep's step times (3: 40.29 ms, 4: 33.41 ms) give no cost"), "{noisy}");
        assert!(!noisy.contains("sweep --calibrate"), "{noisy}");
        let one = assumed(base, 0.05, Some(&[(4, 0.03341)]));
        assert!(one.contains("fewer than two draft lengths"), "{one}");
    }
}
