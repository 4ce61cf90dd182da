//! The results of a sweep and what a person reads of them: one record per point (a line of
//! `results.jsonl`), the winner under the objective, a Markdown table, a CSV, and an SVG plot
//! (throughput and accept length against the swept field, one line per concurrency, the points
//! that failed marked with their verdict). Pure: records in, text out.

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::sweep::loadgen::LevelResult;

/// How a point ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PointOutcome {
    /// Applied, verified and measured at every level.
    Measured,
    /// Its apply did not reach a verified server (rolled back, or left stopped).
    ApplyFailed,
    /// It was applied and verified, then its server died under the load.
    DiedUnderLoad,
}

impl PointOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            PointOutcome::Measured => "measured",
            PointOutcome::ApplyFailed => "apply failed",
            PointOutcome::DiedUnderLoad => "died under load",
        }
    }
}

/// One point of a sweep, as recorded (one line of `results.jsonl`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PointResult {
    /// 0-based, in the sweep's order.
    pub index: usize,
    pub label: String,
    /// The matrix values: (field path, value).
    pub values: Vec<(String, Value)>,
    /// The rendered unit's sha256: the point's identity (`--resume` skips a hash measured).
    pub unit_sha256: String,
    pub outcome: PointOutcome,
    /// The diagnosis verdict of a point that failed (`cuda-oom`, `oom-kill`, `crash`...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verdict: Option<String>,
    /// One line for a person: the diagnosis summary, or what the apply said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
    /// Seconds from the apply's start to a verified, ready server (the load time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub apply_s: Option<f64>,
    /// `max_running_requests` as the server reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_running_requests: Option<Value>,
    /// The apply's speculation proof, as `status` shows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proof: Option<String>,
    pub levels: Vec<LevelResult>,
    /// Unix seconds when the point finished.
    pub time: u64,
}

impl PointResult {
    pub fn level(&self, concurrency: u32) -> Option<&LevelResult> {
        self.levels.iter().find(|l| l.concurrency == concurrency)
    }
}

/// What the objective maximizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Goal {
    /// Aggregate output tok/s.
    Throughput,
    /// Median tok/s of one request.
    TokSPerRequest,
    AcceptLength,
}

impl Goal {
    fn of(self, l: &LevelResult) -> Option<f64> {
        match self {
            Goal::Throughput => Some(l.throughput),
            Goal::TokSPerRequest => l.tok_s_median,
            Goal::AcceptLength => l.accept_length,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Goal::Throughput => "throughput",
            Goal::TokSPerRequest => "tok/s per request",
            Goal::AcceptLength => "accept length",
        }
    }
}

/// The limit a level breaks, if any: `("ttft_p99_ms", 2000.0)` against its figures.
fn breaks(l: &LevelResult, limits: &[(&str, f64)]) -> Option<String> {
    limits.iter().find_map(|(name, max)| {
        let v = match *name {
            "ttft_p50_ms" => l.ttft_ms_p50,
            "ttft_p99_ms" => l.ttft_ms_p99,
            "itl_p50_ms" => l.itl_ms_p50,
            "itl_p99_ms" => l.itl_ms_p99,
            _ => None,
        };
        match v {
            Some(v) if v > *max => Some(format!("{name} {v:.0} > {max:.0}")),
            None => Some(format!("{name} not measured")),
            _ => None,
        }
    })
}

/// The winner: the measured point with the highest `goal` at concurrency `at` among those
/// whose level had no errors and meets every limit. Ties go to the earlier point.
pub fn best<'a>(results: &'a [PointResult], goal: Goal, at: u32, limits: &[(&str, f64)]) -> Option<&'a PointResult> {
    let mut win: Option<(&PointResult, f64)> = None;
    for r in results.iter().filter(|r| r.outcome == PointOutcome::Measured) {
        let Some(l) = r.level(at) else { continue };
        if l.errors > 0 || l.requests == 0 || breaks(l, limits).is_some() {
            continue;
        }
        let Some(v) = goal.of(l) else { continue };
        if win.is_none_or(|(_, w)| v > w) {
            win = Some((r, v));
        }
    }
    win.map(|(r, _)| r)
}

fn num(v: Option<f64>, digits: usize) -> String {
    v.map_or("–".to_string(), |v| format!("{v:.digits$}"))
}

fn pct(v: Option<f64>) -> String {
    v.map_or("–".to_string(), |v| format!("{:.0}%", v * 100.0))
}

/// The Markdown table: one row per point and concurrency; a failed point is one row with its
/// outcome and verdict; the winner is marked.
pub fn table(results: &[PointResult], winner: Option<usize>, at: u32, limits: &[(&str, f64)]) -> String {
    let mut out = String::from(
        "| point | concurrency | tok/s (total) | tok/s per request (median / p10) | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | accept length | accept rate | errors | load (s) | outcome |\n\
         |---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|\n",
    );
    for r in results {
        let mark = if winner == Some(r.index) { " ★" } else { "" };
        let load = num(r.apply_s, 1);
        if r.levels.is_empty() {
            let verdict = r.verdict.as_deref().map_or(String::new(), |v| format!(": {v}"));
            out.push_str(&format!(
                "| {}{mark} | – | – | – | – | – | – | – | – | {load} | {}{verdict} |\n",
                r.label,
                r.outcome.as_str()
            ));
            continue;
        }
        for l in &r.levels {
            let outcome = match (r.outcome, &r.verdict) {
                (PointOutcome::Measured, _) => match breaks(l, limits).filter(|_| l.concurrency == at) {
                    Some(b) => format!("measured (over the limit: {b})"),
                    None => "measured".into(),
                },
                (o, Some(v)) => format!("{}: {v}", o.as_str()),
                (o, None) => o.as_str().into(),
            };
            out.push_str(&format!(
                "| {}{mark} | {} | {} | {} / {} | {} / {} | {} / {} | {} | {} | {} | {load} | {outcome} |\n",
                r.label,
                l.concurrency,
                num(Some(l.throughput), 1),
                num(l.tok_s_median, 1),
                num(l.tok_s_p10, 1),
                num(l.ttft_ms_p50, 0),
                num(l.ttft_ms_p99, 0),
                num(l.itl_ms_p50, 1),
                num(l.itl_ms_p99, 1),
                num(l.accept_length, 2),
                pct(l.accept_rate),
                l.errors,
            ));
        }
    }
    out
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s.to_string() }
}

fn show(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        v => v.to_string(),
    }
}

/// The CSV: one row per point and concurrency (a failed point without levels: one row with
/// empty figures), a column per swept field.
pub fn csv(results: &[PointResult]) -> String {
    let fields: Vec<String> =
        results.first().map(|r| r.values.iter().map(|(f, _)| f.clone()).collect()).unwrap_or_default();
    let mut head = vec!["index".to_string(), "label".into()];
    head.extend(fields.iter().cloned());
    head.extend(
        [
            "unit_sha256",
            "outcome",
            "verdict",
            "apply_s",
            "max_running_requests",
            "concurrency",
            "requests",
            "errors",
            "output_tokens",
            "wall_s",
            "throughput_tok_s",
            "tok_s_median",
            "tok_s_p10",
            "ttft_ms_p50",
            "ttft_ms_p99",
            "itl_ms_p50",
            "itl_ms_p99",
            "accept_length",
            "accept_rate",
        ]
        .map(String::from),
    );
    let mut out = head.join(",") + "\n";
    let f = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.3}"));
    for r in results {
        let mut common = vec![r.index.to_string(), csv_field(&r.label)];
        common.extend(
            fields
                .iter()
                .map(|k| r.values.iter().find(|(f, _)| f == k).map_or(String::new(), |(_, v)| csv_field(&show(v)))),
        );
        common.extend([
            r.unit_sha256.clone(),
            r.outcome.as_str().replace(' ', "-"),
            r.verdict.clone().unwrap_or_default(),
            f(r.apply_s),
            r.max_running_requests.as_ref().map(show).unwrap_or_default(),
        ]);
        if r.levels.is_empty() {
            out.push_str(&(common.join(",") + &",".repeat(14) + "\n"));
        }
        for l in &r.levels {
            let mut row = common.clone();
            row.extend([
                l.concurrency.to_string(),
                l.requests.to_string(),
                l.errors.to_string(),
                l.output_tokens.to_string(),
                f(Some(l.wall_s)),
                f(Some(l.throughput)),
                f(l.tok_s_median),
                f(l.tok_s_p10),
                f(l.ttft_ms_p50),
                f(l.ttft_ms_p99),
                f(l.itl_ms_p50),
                f(l.itl_ms_p99),
                f(l.accept_length),
                f(l.accept_rate),
            ]);
            out.push_str(&(row.join(",") + "\n"));
        }
    }
    out
}

/// Where a point stands on the plot's x axis: the swept value when the sweep has one numeric
/// field, else its position, labelled.
struct XAxis {
    name: String,
    numeric: bool,
    labels: Vec<String>,
}

impl XAxis {
    fn of(results: &[PointResult]) -> XAxis {
        let one_numeric = results.iter().all(|r| r.values.len() == 1 && r.values[0].1.is_number());
        if one_numeric && !results.is_empty() {
            XAxis { name: results[0].values[0].0.clone(), numeric: true, labels: vec![] }
        } else {
            XAxis { name: "point".into(), numeric: false, labels: results.iter().map(|r| r.label.clone()).collect() }
        }
    }

    fn x(&self, r: &PointResult, i: usize) -> f64 {
        if self.numeric { r.values[0].1.as_f64().unwrap_or(0.0) } else { i as f64 }
    }
}

/// Colours a person tells apart (Okabe–Ito), one per concurrency level.
const PALETTE: [RGBColor; 6] = [
    RGBColor(0, 114, 178),
    RGBColor(230, 159, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(86, 180, 233),
    RGBColor(213, 94, 0),
];
const FAILED: RGBColor = RGBColor(200, 30, 30);

/// The plot, as SVG text: throughput (top) and accept length (bottom; the accept rate when the
/// engine gives no length) against the swept field, one line per concurrency; a failed point is a
/// red cross at the bottom of both panels, labelled with its verdict. `title` heads it.
pub fn svg(results: &[PointResult], title: &str, winner: Option<usize>) -> Result<String, String> {
    let mut text = String::new();
    draw(&mut text, results, title, winner).map_err(|e| format!("drawing the plot: {e}"))?;
    Ok(text)
}

type DrawResult = Result<(), Box<dyn std::error::Error>>;

/// The plot's frame, from the records alone: where each point stands on the x axis, the
/// concurrency levels (one line each), and each panel's height.
struct Frame {
    xa: XAxis,
    xs: Vec<f64>,
    xr: std::ops::Range<f64>,
    levels: Vec<u32>,
    /// The lower panel shows the accept length (some engine gave one), else the accept rate.
    use_length: bool,
    ymax_throughput: f64,
    ymax_accept: f64,
}

impl Frame {
    fn of(results: &[PointResult]) -> Frame {
        let xa = XAxis::of(results);
        let mut levels: Vec<u32> = results.iter().flat_map(|r| r.levels.iter().map(|l| l.concurrency)).collect();
        levels.sort_unstable();
        levels.dedup();
        let xs: Vec<f64> = results.iter().enumerate().map(|(i, r)| xa.x(r, i)).collect();
        let (xmin, xmax) = xs.iter().fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(*x), b.max(*x)));
        let (xmin, xmax) = if xs.is_empty() { (0.0, 1.0) } else { (xmin, xmax) };
        let pad = ((xmax - xmin) * 0.06).max(0.5);
        let use_length = results.iter().flat_map(|r| &r.levels).any(|l| l.accept_length.is_some());
        let mut f = Frame {
            xa,
            xs,
            xr: (xmin - pad)..(xmax + pad),
            levels,
            use_length,
            ymax_throughput: 0.0,
            ymax_accept: 0.0,
        };
        let levels = || results.iter().flat_map(|r| &r.levels);
        f.ymax_throughput = levels().map(|l| l.throughput).fold(0.0, f64::max).max(1.0) * 1.12;
        let ymax_a = levels().filter_map(|l| f.accept(l)).fold(0.0, f64::max);
        f.ymax_accept = if use_length { ymax_a.max(1.0) * 1.15 } else { 105.0 };
        f
    }

    /// The lower panel's figure of a level: its accept length, or its accept rate in percent.
    fn accept(&self, l: &LevelResult) -> Option<f64> {
        if self.use_length { l.accept_length } else { l.accept_rate.map(|r| r * 100.0) }
    }

    /// A level's figure in the upper panel (throughput) or the lower one.
    fn y(&self, l: &LevelResult, is_throughput: bool) -> Option<f64> {
        if is_throughput { Some(l.throughput) } else { self.accept(l) }
    }
}

type Chart<'a, 'b> = ChartContext<
    'a,
    SVGBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

fn draw(out: &mut String, results: &[PointResult], title: &str, winner: Option<usize>) -> DrawResult {
    let frame = Frame::of(results);
    let root = SVGBackend::with_string(out, (900, 720)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 22).into_font().color(&RGBColor(30, 30, 30)))?;
    let (top, bottom) = root.split_vertically(360);
    let accept_label = if frame.use_length { "accept length (tokens per verify step)" } else { "accept rate (%)" };
    let panels = [
        (top, "aggregate throughput (output tok/s)", frame.ymax_throughput, true),
        (bottom, accept_label, frame.ymax_accept, false),
    ];
    for (area, ylabel, ymax, is_throughput) in panels {
        let mut chart = ChartBuilder::on(&area)
            .margin(12)
            .margin_right(28)
            .x_label_area_size(44)
            .y_label_area_size(70)
            .build_cartesian_2d(frame.xr.clone(), 0.0..ymax)?;
        mesh(&mut chart, &frame, results.len(), ylabel, is_throughput)?;
        level_lines(&mut chart, &frame, results, is_throughput)?;
        if let Some(w) = winner.and_then(|w| results.iter().position(|r| r.index == w)) {
            winner_ring(&mut chart, &frame, &results[w], frame.xs[w], is_throughput)?;
        }
        failed_points(&mut chart, &frame, results, ymax)?;
        if is_throughput && !frame.levels.is_empty() {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.9))
                .border_style(RGBColor(200, 200, 200))
                .label_font(("sans-serif", 14))
                .draw()?;
        }
    }
    root.present()?;
    Ok(())
}

/// A panel's axes and grid: the swept field's values (or the points' labels) below, `ylabel`
/// beside; the field's name under the lower panel only.
fn mesh(chart: &mut Chart, frame: &Frame, points: usize, ylabel: &str, is_throughput: bool) -> DrawResult {
    let labels = frame.xa.labels.clone();
    let numeric = frame.xa.numeric;
    let xfmt = move |x: &f64| {
        if numeric {
            if (x - x.round()).abs() < 1e-9 { format!("{x:.0}") } else { format!("{x:.2}") }
        } else {
            let i = x.round();
            if (x - i).abs() < 1e-9 && i >= 0.0 {
                labels.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        }
    };
    let n_ticks = if numeric { 12 } else { points.max(1) * 2 + 1 };
    chart
        .configure_mesh()
        .x_desc(if is_throughput { "" } else { frame.xa.name.as_str() })
        .y_desc(ylabel)
        .x_labels(n_ticks)
        .x_label_formatter(&xfmt)
        .y_label_formatter(&|y| if is_throughput { format!("{y:.0}") } else { format!("{y:.1}") })
        .light_line_style(RGBColor(247, 247, 247))
        .bold_line_style(RGBColor(215, 215, 215))
        .axis_desc_style(("sans-serif", 15))
        .label_style(("sans-serif", 13))
        .draw()?;
    Ok(())
}

/// One line per concurrency level, through the points measured at it, each in its colour.
fn level_lines(chart: &mut Chart, frame: &Frame, results: &[PointResult], is_throughput: bool) -> DrawResult {
    for (k, c) in frame.levels.iter().enumerate() {
        let colour = PALETTE[k % PALETTE.len()];
        let pts: Vec<(f64, f64)> = results
            .iter()
            .zip(&frame.xs)
            .filter_map(|(r, x)| {
                let l = r.level(*c).filter(|l| l.requests > 0)?;
                Some((*x, frame.y(l, is_throughput)?))
            })
            .collect();
        if pts.is_empty() {
            continue;
        }
        chart
            .draw_series(LineSeries::new(pts.clone(), colour.stroke_width(3)))?
            .label(format!("concurrency {c}"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 22, y)], colour.stroke_width(3)));
        chart.draw_series(pts.iter().map(|p| Circle::new(*p, 5, colour.filled())))?;
    }
    Ok(())
}

/// The winner `r`, at `x`: a ring around its points (in the legend of the upper panel).
fn winner_ring(chart: &mut Chart, frame: &Frame, r: &PointResult, x: f64, is_throughput: bool) -> DrawResult {
    let ring: Vec<(f64, f64)> = r.levels.iter().filter_map(|l| frame.y(l, is_throughput)).map(|y| (x, y)).collect();
    let series = chart.draw_series(ring.iter().map(|p| Circle::new(*p, 10, RGBColor(30, 30, 30).stroke_width(2))))?;
    if is_throughput {
        series
            .label(format!("best: {}", r.label))
            .legend(|(x, y)| Circle::new((x + 11, y), 7, RGBColor(30, 30, 30).stroke_width(2)));
    }
    Ok(())
}

/// Failed points: a red cross on the axis of a panel `ymax` high, with the verdict.
fn failed_points(chart: &mut Chart, frame: &Frame, results: &[PointResult], ymax: f64) -> DrawResult {
    let failed: Vec<(f64, String)> = results
        .iter()
        .zip(&frame.xs)
        .filter(|(r, _)| r.outcome != PointOutcome::Measured)
        .map(|(r, x)| (*x, r.verdict.clone().unwrap_or_else(|| r.outcome.as_str().into())))
        .collect();
    let y0 = ymax * 0.04;
    chart.draw_series(failed.iter().map(|(x, _)| Cross::new((*x, y0), 8, FAILED.stroke_width(3))))?;
    chart.draw_series(failed.iter().map(|(x, v)| {
        Text::new(
            v.clone(),
            (*x, ymax * 0.11),
            ("sans-serif", 14).into_font().color(&FAILED).pos(Pos::new(HPos::Center, VPos::Center)),
        )
    }))?;
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    fn level(c: u32, tput: f64, ttft99: f64, al: Option<f64>) -> LevelResult {
        LevelResult {
            concurrency: c,
            requests: 8,
            errors: 0,
            first_error: None,
            output_tokens: 512,
            wall_s: 512.0 / tput,
            throughput: tput,
            tok_s_median: Some(tput / c as f64),
            tok_s_p10: Some(tput / c as f64 * 0.9),
            ttft_ms_p50: Some(ttft99 / 2.0),
            ttft_ms_p99: Some(ttft99),
            itl_ms_p50: Some(1000.0 / (tput / c as f64)),
            itl_ms_p99: Some(2000.0 / (tput / c as f64)),
            accept_length: al,
            accept_rate: al.map(|a| (a - 1.0) / 4.0),
            evidence: vec![],
            acceptance: None,
            decode: None,
        }
    }

    /// Steps 1..6 at concurrency 1 and 4, the way a campaign goes: more steps help, then
    /// plateau; step 5 dies of a CUDA OOM under load.
    pub(crate) fn campaign() -> Vec<PointResult> {
        let t1 = [123.0, 186.0, 234.0, 277.0, 0.0, 282.0];
        let al = [1.9, 2.7, 3.4, 4.0, 0.0, 4.5];
        (0..6)
            .map(|i| {
                let steps = i + 1;
                let oom = steps == 5;
                PointResult {
                    index: i,
                    label: format!("num_steps={steps}"),
                    values: vec![("speculative.num_steps".into(), json!(steps))],
                    unit_sha256: format!("{:064x}", i + 1),
                    outcome: if oom { PointOutcome::DiedUnderLoad } else { PointOutcome::Measured },
                    verdict: oom.then(|| "cuda-oom".to_string()),
                    summary: oom.then(|| "CUDA out of memory".to_string()),
                    apply_s: Some(4.0 + i as f64 * 0.1),
                    max_running_requests: Some(json!(48)),
                    proof: None,
                    levels: if oom {
                        vec![]
                    } else {
                        vec![
                            level(1, t1[i], 40.0, Some(al[i])),
                            level(4, t1[i] * 3.1, 90.0 + 200.0 * i as f64, Some(al[i])),
                        ]
                    },
                    time: 1_800_000_000 + i as u64,
                }
            })
            .collect()
    }

    #[test]
    fn the_winner_is_the_best_measured_point_within_the_limits() {
        let r = campaign();
        assert_eq!(best(&r, Goal::Throughput, 4, &[]).unwrap().label, "num_steps=6");
        // TTFT p99 at 4: 90, 290, 490, 690, -, 1090: a 700 ms limit leaves steps 1..4.
        assert_eq!(best(&r, Goal::Throughput, 4, &[("ttft_p99_ms", 700.0)]).unwrap().label, "num_steps=4");
        assert_eq!(best(&r, Goal::AcceptLength, 1, &[]).unwrap().label, "num_steps=6");
        assert!(best(&r, Goal::Throughput, 16, &[]).is_none(), "no point measured at 16");
        assert!(best(&r, Goal::Throughput, 4, &[("ttft_p99_ms", 10.0)]).is_none());
    }

    #[test]
    fn table_marks_the_winner_the_limit_breakers_and_the_failed_point() {
        let r = campaign();
        insta::assert_snapshot!(table(&r, Some(3), 4, &[("ttft_p99_ms", 700.0)]));
    }

    #[test]
    fn csv_has_a_row_per_point_and_level() {
        insta::assert_snapshot!(csv(&campaign()));
    }

    #[test]
    fn the_plot_has_a_line_per_concurrency_and_the_failed_point_marked() {
        let r = campaign();
        let s = svg(&r, "qwen-mtp-steps: speculative.num_steps", Some(5)).unwrap();
        assert!(s.starts_with("<svg"), "{}", &s[..100]);
        assert!(s.contains("concurrency 1") && s.contains("concurrency 4"));
        assert!(s.contains("cuda-oom"));
        assert!(s.contains("speculative.num_steps"));
        assert!(s.contains("accept length"));
        assert!(s.contains("best: num_steps=6"));
    }

    #[test]
    fn a_result_line_reads_back_as_written() {
        for r in campaign() {
            let line = serde_json::to_string(&r).unwrap();
            assert!(!line.contains('\n'));
            let back: PointResult = serde_json::from_str(&line).unwrap();
            // serde_json reads floats to within one unit in the last place.
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * a.abs().max(1.0);
            assert_eq!(
                (&back.label, back.outcome, &back.verdict, &back.values),
                (&r.label, r.outcome, &r.verdict, &r.values)
            );
            assert_eq!(back.levels.len(), r.levels.len());
            for (a, b) in back.levels.iter().zip(&r.levels) {
                assert!(close(a.throughput, b.throughput) && close(a.accept_length.unwrap(), b.accept_length.unwrap()));
            }
        }
    }
}
