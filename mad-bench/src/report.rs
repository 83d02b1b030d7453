//! Results: medians and spreads, the stdout table, the CSV file, Markdown tables and SVG plots.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;

use mad_core::{Error, Result};

/// One reported figure: the median of several runs of one (benchmark, implementation, size).
#[derive(Clone, Debug)]
pub struct Row {
    /// Benchmark (`latency`, `bw`, `bibw`, `latency_mt`, `rpc`, `mbw_mr`, `msg_rate`).
    pub bench: String,
    /// Implementation: a Madeleine channel spec or a raw baseline (`raw-tcp-poll`, ...).
    pub imp: String,
    /// Mode pair for Madeleine rows, `-` for baselines.
    pub mode: String,
    /// Message size in bytes.
    pub size: usize,
    /// Unit of the values (`us` or `MB/s` or `msg/s`).
    pub unit: String,
    /// Median over runs.
    pub median: f64,
    /// Smallest run.
    pub min: f64,
    /// Largest run.
    pub max: f64,
    /// Number of runs.
    pub runs: usize,
    /// Timed iterations per run.
    pub iters: usize,
    /// The baseline this row is compared with (empty for baselines).
    pub baseline: String,
    /// The baseline's median (NaN when none).
    pub base_median: f64,
}

/// The CSV header.
pub const CSV_HEADER: &str =
    "bench,impl,mode,size,unit,median,min,max,runs,iters,baseline,baseline_median,ratio";

impl Row {
    /// Whether smaller values are better (time units).
    pub fn lower_is_better(&self) -> bool {
        self.unit == "us"
    }

    /// Madeleine's cost over the baseline's: above 1 means Madeleine is slower
    /// (time ratio for latencies, inverse throughput ratio for bandwidths).
    pub fn ratio(&self) -> f64 {
        if self.lower_is_better() {
            self.median / self.base_median
        } else {
            self.base_median / self.median
        }
    }

    fn csv(&self) -> String {
        format!(
            "{},{},{},{},{},{:.4},{:.4},{:.4},{},{},{},{:.4},{:.3}",
            quote(&self.bench),
            quote(&self.imp),
            quote(&self.mode),
            self.size,
            self.unit,
            self.median,
            self.min,
            self.max,
            self.runs,
            self.iters,
            quote(&self.baseline),
            self.base_median,
            self.ratio()
        )
    }

    fn from_csv(line: &str) -> Option<Row> {
        let f = split_csv(line);
        if f.len() != 13 {
            return None;
        }
        Some(Row {
            bench: f[0].clone(),
            imp: f[1].clone(),
            mode: f[2].clone(),
            size: f[3].parse().ok()?,
            unit: f[4].clone(),
            median: f[5].parse().ok()?,
            min: f[6].parse().ok()?,
            max: f[7].parse().ok()?,
            runs: f[8].parse().ok()?,
            iters: f[9].parse().ok()?,
            baseline: f[10].clone(),
            base_median: f[11].parse().ok()?,
        })
    }
}

/// A CSV field, double-quoted when it holds a comma or a quote (channel specs do).
fn quote(s: &str) -> String {
    if s.contains([',', '"']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// Split one CSV line written by [`quote`].
fn split_csv(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                cur.push('"');
                chars.next();
            }
            ('"', _) => quoted = !quoted,
            (',', false) => out.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
    }
    out.push(cur);
    out
}

/// Median, min and max of `v` (NaN for an empty set).
pub fn stats(v: &[f64]) -> (f64, f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let m = if s.len() % 2 == 1 {
        s[s.len() / 2]
    } else {
        (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0
    };
    (m, s[0], s[s.len() - 1])
}

/// Human size: 0, 1, ..., 512, 1K, ..., 4M.
pub fn size_label(n: usize) -> String {
    if n >= 1 << 20 && n % (1 << 20) == 0 {
        format!("{}M", n >> 20)
    } else if n >= 1 << 10 && n % (1 << 10) == 0 {
        format!("{}K", n >> 10)
    } else {
        n.to_string()
    }
}

/// A figure with 3 or 4 significant digits, `-` for NaN.
pub fn num(v: f64) -> String {
    if v.is_nan() {
        "-".into()
    } else if v >= 1000.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

/// What a benchmark's figure is, for titles.
pub fn describe(bench: &str) -> &'static str {
    match bench {
        "latency" => "one-way latency (round trip / 2), µs",
        "latency_mt" => "one-way latency, 2 threads per side, µs",
        "rpc" => "RPC round trip (EXPRESS size header + CHEAPER body, empty reply), µs",
        "bw" => "bandwidth, window of 64 then 1-byte ack, MB/s",
        "bibw" => "bidirectional bandwidth, 2 threads per side, MB/s (both directions)",
        "mbw_mr" => "aggregate bandwidth of all pairs, window of 64, MB/s",
        "msg_rate" => "aggregate message rate of all pairs, messages/s",
        "cpu_send" => "processor time per send in a burst of 32, receiver not waited for, µs",
        "cpu_recv" => "processor time per receive of a burst of 32 already sent, µs",
        "poll" => "processor time of one poll that finds nothing, µs",
        _ => "",
    }
}

/// (bench, impl, mode)
type Key = (String, String, String);

/// Group rows by (bench, impl, mode), keeping first-seen order.
fn groups(rows: &[Row]) -> Vec<(Key, Vec<&Row>)> {
    let mut order: Vec<Key> = Vec::new();
    let mut m: BTreeMap<Key, Vec<&Row>> = BTreeMap::new();
    for r in rows {
        let k = (r.bench.clone(), r.imp.clone(), r.mode.clone());
        if !m.contains_key(&k) {
            order.push(k.clone());
        }
        m.entry(k).or_default().push(r);
    }
    order
        .into_iter()
        .map(|k| {
            let v = m.remove(&k).unwrap_or_default();
            (k, v)
        })
        .collect()
}

/// Plain-text table of one benchmark's rows (stdout).
pub fn text_table(rows: &[Row]) -> String {
    let mut out = String::new();
    for ((bench, imp, mode), rs) in groups(rows) {
        let base = rs.first().map(|r| r.baseline.clone()).unwrap_or_default();
        let _ = writeln!(
            out,
            "\n# {bench}: {imp} [{mode}] — {}{}",
            describe(&bench),
            if base.is_empty() {
                String::new()
            } else {
                format!(" — baseline {base}; ratio > 1 = Madeleine slower")
            }
        );
        let _ = writeln!(
            out,
            "{:>8} {:>12} {:>21} {:>12} {:>7} {:>7}",
            "size", "median", "min-max", "baseline", "ratio", "iters"
        );
        for r in rs {
            let _ = writeln!(
                out,
                "{:>8} {:>12} {:>21} {:>12} {:>7} {:>7}",
                size_label(r.size),
                num(r.median),
                format!("{}-{}", num(r.min), num(r.max)),
                num(r.base_median),
                if r.baseline.is_empty() {
                    "-".into()
                } else {
                    format!("{:.2}", r.ratio())
                },
                r.iters
            );
        }
    }
    out
}

/// The order benchmarks are reported in.
pub fn bench_rank(bench: &str) -> usize {
    const ORDER: [&str; 10] = [
        "latency",
        "latency_mt",
        "rpc",
        "cpu_send",
        "cpu_recv",
        "poll",
        "bw",
        "bibw",
        "mbw_mr",
        "msg_rate",
    ];
    ORDER
        .iter()
        .position(|b| *b == bench)
        .unwrap_or(ORDER.len())
}

/// Markdown tables: one per benchmark, a column per implementation (median, and ratio to the
/// baseline for Madeleine rows).
pub fn markdown(rows: &[Row]) -> String {
    let mut out = String::new();
    let mut benches: Vec<String> = Vec::new();
    for r in rows {
        if !benches.contains(&r.bench) {
            benches.push(r.bench.clone());
        }
    }
    benches.sort_by_key(|b| bench_rank(b));
    for b in benches {
        let rs: Vec<&Row> = rows.iter().filter(|r| r.bench == b).collect();
        let mut cols: Vec<(String, String)> = Vec::new();
        let mut sizes: Vec<usize> = Vec::new();
        for r in &rs {
            let k = (r.imp.clone(), r.mode.clone());
            if !cols.contains(&k) {
                cols.push(k);
            }
            if !sizes.contains(&r.size) {
                sizes.push(r.size);
            }
        }
        sizes.sort_unstable();
        let _ = writeln!(out, "\n#### `{b}`: {}\n", describe(&b));
        let _ = writeln!(
            out,
            "Median of {} runs (spread min–max in the CSV); `×r` = Madeleine cost / baseline cost \
             (above 1: slower than the baseline).\n",
            rs.first().map(|r| r.runs).unwrap_or(0)
        );
        let mut head = String::from("| size |");
        let mut sep = String::from("|---:|");
        for (imp, mode) in &cols {
            if mode == "-" {
                let _ = write!(head, " {imp} |");
            } else {
                let _ = write!(head, " {imp} [{mode}] |");
            }
            sep.push_str("---:|");
        }
        let _ = writeln!(out, "{head}\n{sep}");
        for s in sizes {
            let mut line = format!("| {} |", size_label(s));
            for (imp, mode) in &cols {
                match rs
                    .iter()
                    .find(|r| r.size == s && &r.imp == imp && &r.mode == mode)
                {
                    Some(r) if !r.baseline.is_empty() && r.base_median.is_finite() => {
                        let _ = write!(line, " {} (×{:.2}) |", num(r.median), r.ratio());
                    }
                    Some(r) => {
                        let _ = write!(line, " {} |", num(r.median));
                    }
                    None => line.push_str(" |"),
                }
            }
            let _ = writeln!(out, "{line}");
        }
    }
    out
}

/// Append rows to a CSV file (writing the header when the file is new or empty).
pub fn append_csv(path: &Path, rows: &[Row]) -> Result<()> {
    let new = std::fs::metadata(path)
        .map(|m| m.len() == 0)
        .unwrap_or(true);
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
    let mut s = String::new();
    if new {
        s.push_str(CSV_HEADER);
        s.push('\n');
    }
    for r in rows {
        s.push_str(&r.csv());
        s.push('\n');
    }
    f.write_all(s.as_bytes())
        .map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

/// Read rows back from CSV files written by [`append_csv`].
pub fn read_csv(path: &Path) -> Result<Vec<Row>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.is_empty() || line == CSV_HEADER {
            continue;
        }
        rows.push(Row::from_csv(line).ok_or_else(|| {
            Error::BadConfig(format!("{}:{}: not a mad-bench row", path.display(), i + 1))
        })?);
    }
    Ok(rows)
}

/// Okabe–Ito's colour-blind-safe palette (its yellow left out: too pale on white). Beyond
/// seven lines the colours repeat with another marker shape.
const COLORS: [&str; 7] = [
    "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000",
];
/// Marker shapes, one per round of [`COLORS`].
const MARKERS: [Marker; 4] = [
    Marker::Circle,
    Marker::Square,
    Marker::Triangle,
    Marker::Diamond,
];

#[derive(Clone, Copy)]
enum Marker {
    Circle,
    Square,
    Triangle,
    Diamond,
}

impl Marker {
    /// The SVG element of this marker at (x, y).
    fn svg(self, x: f64, y: f64, color: &str) -> String {
        let r = 3.2;
        match self {
            Marker::Circle => {
                format!(r#"<circle cx="{x:.1}" cy="{y:.1}" r="{r}" fill="{color}"/>"#)
            }
            Marker::Square => format!(
                r#"<rect x="{:.1}" y="{:.1}" width="{w:.1}" height="{w:.1}" fill="{color}"/>"#,
                x - r,
                y - r,
                w = 2.0 * r
            ),
            Marker::Triangle => format!(
                r#"<polygon points="{:.1},{:.1} {:.1},{:.1} {:.1},{:.1}" fill="{color}"/>"#,
                x,
                y - 1.2 * r,
                x - 1.1 * r,
                y + 0.8 * r,
                x + 1.1 * r,
                y + 0.8 * r
            ),
            Marker::Diamond => format!(
                r#"<polygon points="{:.1},{:.1} {:.1},{:.1} {:.1},{:.1} {:.1},{:.1}" fill="{color}"/>"#,
                x,
                y - 1.3 * r,
                x + 1.3 * r,
                y,
                x,
                y + 1.3 * r,
                x - 1.3 * r,
                y
            ),
        }
    }
}

/// An SVG line plot of one benchmark (see [`svg_plot`]).
pub fn svg(bench: &str, rows: &[Row]) -> Option<String> {
    let rs: Vec<Row> = rows.iter().filter(|r| r.bench == bench).cloned().collect();
    svg_plot(&format!("{bench}: {}", describe(bench)), &rs)
}

/// The y axis' name for a unit.
fn axis_name(unit: &str) -> String {
    match unit {
        "us" => "time (µs)".into(),
        "MB/s" => "bandwidth (MB/s)".into(),
        "msg/s" => "message rate (messages/s)".into(),
        u => u.to_string(),
    }
}

/// A tick label: 0.001 .. 999 as is, then 1k, 10k, 1M.
fn tick_label(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if a >= 1e6 {
        format!("{}M", trim_num(v / 1e6))
    } else if a >= 1e3 {
        format!("{}k", trim_num(v / 1e3))
    } else {
        trim_num(v)
    }
}

fn trim_num(v: f64) -> String {
    let s = format!("{v:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_string()
}

/// Escape text for SVG.
fn esc(t: &str) -> String {
    t.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Approximate width in pixels of `t` at `px` pixels (sans-serif).
fn text_width(t: &str, px: f64) -> f64 {
    t.chars().count() as f64 * px * 0.6
}

/// An SVG line plot of `rows` (one benchmark's worth, or rows renamed for a comparison): message
/// size on a log2 x axis, the median on a y axis that is logarithmic when the values span more
/// than a factor of 20 (linear from 0 otherwise), the min–max of the runs as a band around each
/// line, a line per (implementation, mode): solid for Madeleine rows, dashed for mode `-`
/// (baselines); colours from a colour-blind-safe palette, with a marker shape per line; the
/// whole legend beside the plot (its width follows the longest label); both axes labelled with
/// their units.
pub fn svg_plot(title: &str, rows: &[Row]) -> Option<String> {
    let rs: Vec<Row> = rows
        .iter()
        .filter(|r| r.median.is_finite() && r.median > 0.0)
        .cloned()
        .collect();
    if rs.is_empty() {
        return None;
    }
    let series = groups(&rs);
    let label_of = |imp: &str, mode: &str| {
        if mode == "-" || mode.is_empty() {
            imp.to_string()
        } else {
            format!("{imp} [{mode}]")
        }
    };
    let labels: Vec<String> = series
        .iter()
        .map(|((_, imp, mode), _)| label_of(imp, mode))
        .collect();
    let band = |r: &Row| -> (f64, f64) {
        let lo = if r.min.is_finite() && r.min > 0.0 {
            r.min.min(r.median)
        } else {
            r.median
        };
        let hi = if r.max.is_finite() && r.max > 0.0 {
            r.max.max(r.median)
        } else {
            r.median
        };
        (lo, hi)
    };
    // Layout: plot area, then the legend to its right, as wide as its longest label.
    let font = 12.0;
    let legend_w = labels.iter().map(|l| text_width(l, font)).fold(
        text_width("solid: Madeleine; dashed: baseline", 11.0),
        f64::max,
    ) + 50.0;
    let (pw, ph): (f64, f64) = (620.0, 400.0);
    let (l, t): (f64, f64) = (80.0, 50.0);
    let title_w = text_width(title, 15.0) + l;
    let w = (l + pw + 20.0 + legend_w).max(title_w + 20.0).ceil();
    let legend_h = 18.0 * labels.len() as f64 + 60.0;
    let h = (t + ph + 60.0).max(t + legend_h).ceil();
    let (x0, x1, y0, y1) = (l, l + pw, t + ph, t);

    // x: log2 of the size (0 drawn at 1).
    let xs = |s: usize| ((s.max(1)) as f64).log2();
    let (xmin, xmax) = rs.iter().fold((f64::MAX, f64::MIN), |(a, z), r| {
        (a.min(xs(r.size)), z.max(xs(r.size)))
    });
    let xmax = if xmax > xmin { xmax } else { xmin + 1.0 };
    // y: every median and band edge.
    let (vmin, vmax) = rs.iter().fold((f64::MAX, f64::MIN), |(a, z), r| {
        let (lo, hi) = band(r);
        (a.min(lo), z.max(hi))
    });
    let log_y = vmax / vmin > 20.0;
    let (ymin, ymax, ticks): (f64, f64, Vec<(f64, bool)>) = if log_y {
        let (a, z) = (
            vmin.log10().floor(),
            vmax.log10().ceil().max(vmin.log10().floor() + 1.0),
        );
        let mut ticks = Vec::new();
        for d in (a as i32)..=(z as i32) {
            for (m, major) in [(1.0, true), (2.0, false), (5.0, false)] {
                let v = m * 10f64.powi(d);
                if v.log10() <= z + 1e-9 {
                    ticks.push((v, major));
                }
            }
        }
        (a, z, ticks)
    } else {
        // Linear from 0 with a 1-2-5 step giving about 6 intervals.
        let raw = vmax / 6.0;
        let p = 10f64.powf(raw.log10().floor());
        let step = [1.0, 2.0, 5.0, 10.0]
            .iter()
            .map(|m| m * p)
            .find(|s| *s >= raw)
            .unwrap_or(10.0 * p);
        let top = (vmax / step).ceil() * step;
        let n = (top / step).round() as usize;
        (0.0, top, (0..=n).map(|i| (i as f64 * step, true)).collect())
    };
    let yv = |v: f64| if log_y { v.log10() } else { v };
    let px = |x: f64| x0 + (x - xmin) / (xmax - xmin) * pw;
    let py = |v: f64| y0 - (yv(v) - ymin) / (ymax - ymin) * ph;

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="DejaVu Sans, Verdana, sans-serif" font-size="{font}">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{l}" y="26" font-size="15" font-weight="bold">{}</text>"#,
        esc(title)
    );
    // Grid and y ticks.
    for &(v, major) in &ticks {
        let y = py(v);
        if !(y1 - 0.5..=y0 + 0.5).contains(&y) {
            continue;
        }
        let stroke = if major { "#cccccc" } else { "#eeeeee" };
        let _ = writeln!(
            s,
            r#"<line x1="{x0}" x2="{x1}" y1="{y:.1}" y2="{y:.1}" stroke="{stroke}"/>"#
        );
        if major || (ymax - ymin) <= 2.0 {
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
                x0 - 6.0,
                y + 4.0,
                tick_label(v)
            );
        }
    }
    // x ticks: every power of 2, labelled every other one (every one when few).
    let every = if xmax - xmin > 12.0 { 2 } else { 1 };
    let mut x = xmin.ceil() as i32;
    while x as f64 <= xmax {
        let xp = px(x as f64);
        let _ = writeln!(
            s,
            r##"<line x1="{xp:.1}" x2="{xp:.1}" y1="{y1}" y2="{y0}" stroke="#f0f0f0"/>"##
        );
        if (x - xmin.ceil() as i32) % every == 0 {
            let _ = writeln!(
                s,
                r##"<line x1="{xp:.1}" x2="{xp:.1}" y1="{y0}" y2="{}" stroke="#333"/><text x="{xp:.1}" y="{}" text-anchor="middle">{}</text>"##,
                y0 + 5.0,
                y0 + 18.0,
                size_label(1usize << x.clamp(0, 40))
            );
        }
        x += 1;
    }
    // Axes and their names.
    let _ = writeln!(
        s,
        r##"<path d="M{x0},{y1} V{y0} H{x1}" fill="none" stroke="#333"/>"##
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">message size (bytes, log scale)</text>"#,
        (x0 + x1) / 2.0,
        y0 + 40.0
    );
    let unit = rs.first().map(|r| r.unit.as_str()).unwrap_or("");
    let yname = format!(
        "{}{}",
        axis_name(unit),
        if log_y { ", log scale" } else { "" }
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate(18,{:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
        (y0 + y1) / 2.0,
        esc(&yname)
    );
    // Bands first (under every line), then lines and markers.
    let style = |i: usize| {
        (
            COLORS[i % COLORS.len()],
            MARKERS[(i / COLORS.len()) % MARKERS.len()],
        )
    };
    for (i, (_, g)) in series.iter().enumerate() {
        let (color, _) = style(i);
        if g.len() < 2 || g.iter().all(|r| band(r).0 == band(r).1) {
            continue;
        }
        let mut pts: Vec<String> = g
            .iter()
            .map(|r| format!("{:.1},{:.1}", px(xs(r.size)), py(band(r).1)))
            .collect();
        pts.extend(
            g.iter()
                .rev()
                .map(|r| format!("{:.1},{:.1}", px(xs(r.size)), py(band(r).0))),
        );
        let _ = writeln!(
            s,
            r#"<polygon points="{}" fill="{color}" fill-opacity="0.15" stroke="none"/>"#,
            pts.join(" ")
        );
    }
    for (i, ((_, _, mode), g)) in series.iter().enumerate() {
        let (color, marker) = style(i);
        let dash = if mode == "-" {
            r#" stroke-dasharray="7 4""#
        } else {
            ""
        };
        let pts: Vec<(f64, f64)> = g.iter().map(|r| (px(xs(r.size)), py(r.median))).collect();
        let line: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.8"{dash} points="{}"/>"#,
            line.join(" ")
        );
        for &(x, y) in &pts {
            s.push_str(&marker.svg(x, y, color));
        }
        s.push('\n');
    }
    // Legend.
    let lx = x1 + 20.0;
    // A title that says what its dashes mean (Figure 4: fixed methods) overrides the default.
    if !title.contains("dashed") {
        let _ = writeln!(
            s,
            r##"<text x="{lx}" y="{}" font-size="11" fill="#444">solid: Madeleine; dashed: baseline</text>"##,
            t + 4.0
        );
    }
    let _ = writeln!(
        s,
        r##"<text x="{lx}" y="{}" font-size="11" fill="#444">band: min–max of the runs; line: median</text>"##,
        t + 18.0
    );
    for (i, (((_, _, mode), _), label)) in series.iter().zip(&labels).enumerate() {
        let (color, marker) = style(i);
        let dash = if mode == "-" {
            r#" stroke-dasharray="7 4""#
        } else {
            ""
        };
        let ly = t + 40.0 + 18.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" x2="{}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="1.8"{dash}/>{}<text x="{}" y="{}">{}</text>"#,
            lx + 28.0,
            marker.svg(lx + 14.0, ly, color),
            lx + 36.0,
            ly + 4.0,
            esc(label)
        );
    }
    s.push_str("</svg>\n");
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_round_trip_with_commas_in_specs() {
        let r = Row {
            bench: "latency".into(),
            imp: "tcp,progress=poll".into(),
            mode: "cheaper/cheaper".into(),
            size: 8,
            unit: "us".into(),
            median: 4.5,
            min: 4.0,
            max: 5.0,
            runs: 3,
            iters: 100,
            baseline: "raw-tcp-poll".into(),
            base_median: 3.0,
        };
        let back = Row::from_csv(&r.csv()).expect("parses");
        assert_eq!(back.imp, r.imp);
        assert_eq!(back.size, 8);
        assert!((back.ratio() - 1.5).abs() < 1e-9);
    }

    #[test]
    fn median_and_spread() {
        assert_eq!(stats(&[3.0, 1.0, 2.0]), (2.0, 1.0, 3.0));
        assert_eq!(stats(&[4.0, 1.0]), (2.5, 1.0, 4.0));
        assert!(stats(&[]).0.is_nan());
    }

    #[test]
    fn svg_and_markdown_render() {
        let mk = |imp: &str, mode: &str, size, v| Row {
            bench: "bw".into(),
            imp: imp.into(),
            mode: mode.into(),
            size,
            unit: "MB/s".into(),
            median: v,
            min: v,
            max: v,
            runs: 1,
            iters: 1,
            baseline: if mode == "-" {
                String::new()
            } else {
                "raw-shm".into()
            },
            base_median: 2.0 * v,
        };
        let rows = vec![
            mk("shm", "cheaper/cheaper", 1, 10.0),
            mk("shm", "cheaper/cheaper", 1024, 1000.0),
            mk("raw-shm", "-", 1, 20.0),
            mk("raw-shm", "-", 1024, 2000.0),
        ];
        let svg = svg("bw", &rows).expect("plot");
        assert!(svg.contains("<polyline") && svg.ends_with("</svg>\n"));
        // Full legend, y axis named with its unit, log where the values span decades.
        assert!(svg.contains(">shm [cheaper/cheaper]</text>"), "{svg}");
        assert!(svg.contains(">bandwidth (MB/s), log scale</text>"), "{svg}");
        assert!(!svg.contains("fill-opacity"), "no band where min = max");
        // A min-max band where the runs differ; a linear y axis over a narrow range.
        let mut spread = rows.clone();
        for r in &mut spread {
            r.median = 1.0 + r.size as f64 / 4096.0;
            r.min = r.median * 0.9;
            r.max = r.median * 1.1;
        }
        let svg = svg_plot("narrow", &spread).expect("plot");
        assert!(svg.contains(r#"fill-opacity="0.15""#), "{svg}");
        assert!(svg.contains(">bandwidth (MB/s)</text>"), "{svg}");
        let md = markdown(&rows);
        assert!(md.contains("| 1K | 1000 (×2.00) | 2000 |"), "{md}");
    }
}
