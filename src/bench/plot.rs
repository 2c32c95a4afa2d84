//! `--plot FILE.svg`: throughput against block size, one line per batch size.
//!
//! The SVG is written by hand: a log2 block-size axis, a linear GB/s axis from zero,
//! one polyline (with point markers) per batch size, dashed lines for the baselines,
//! axis labels and a legend. No dependency, and the file opens in any browser.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use te::{Error, ErrorKind, Result};

use super::plan::Plan;
use super::stats::Record;

const WIDTH: f64 = 900.0;
const HEIGHT: f64 = 540.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 190.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 70.0;

/// Line colours, one per batch size (cycled).
const COLOURS: [&str; 10] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

/// Refuses, before anything runs, a plot that could not be written at the end: an
/// empty path, a directory, or a file in a directory that does not exist.
///
/// # Errors
/// `InvalidRequest` naming the path and what to give instead.
pub(crate) fn check(path: &Path) -> Result<()> {
    let refuse = |why: String| {
        Err(Error::new(
            ErrorKind::InvalidRequest,
            format!("--plot {}: {why}", path.display()),
        )
        .with_operation("bench"))
    };
    if path.as_os_str().is_empty() {
        return refuse("the path is empty; name an SVG file, such as bench.svg".into());
    }
    if path.is_dir() {
        return refuse(format!(
            "is a directory; name a file in it, such as {}",
            path.join("bench.svg").display()
        ));
    }
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        let why = if dir.exists() {
            "is not a directory"
        } else {
            "does not exist"
        };
        return refuse(format!(
            "{} {why}; create it first or name a file in an existing directory",
            dir.display()
        ));
    }
    Ok(())
}

/// Writes the plot of `records` to `path`.
///
/// # Errors
/// `Io` if the file cannot be written; `InvalidRequest` if there is nothing to plot.
pub(crate) fn write(path: &Path, records: &[Record], backend: &str, plan: &Plan) -> Result<()> {
    let title = format!(
        "te bench: {backend} {}, {} thread{}",
        plan.op,
        plan.threads,
        if plan.threads == 1 { "" } else { "s" }
    );
    let svg = render(records, &title).ok_or_else(|| {
        Error::new(ErrorKind::InvalidRequest, "no results to plot").with_operation("bench")
    })?;
    std::fs::write(path, svg).map_err(|e| {
        Error::new(
            ErrorKind::Io,
            format!("cannot write the plot to {}", path.display()),
        )
        .with_operation("bench")
        .with_source(e)
    })
}

/// A series: its legend text, style, and (block size, GB/s) points by block size.
struct Series {
    /// Legend text.
    name: String,
    /// Stroke colour.
    colour: &'static str,
    /// Dash pattern, for baselines.
    dash: Option<&'static str>,
    /// GB/s by block size.
    points: BTreeMap<u64, f64>,
}

/// One series per batch size of te's results, then one per baseline.
fn series(records: &[Record]) -> Vec<Series> {
    let mut by_batch: BTreeMap<u64, BTreeMap<u64, f64>> = BTreeMap::new();
    let mut baselines: BTreeMap<String, BTreeMap<u64, f64>> = BTreeMap::new();
    for r in records {
        if r.is_baseline() {
            baselines
                .entry(r.backend.clone())
                .or_default()
                .insert(r.block_size, r.gb_per_s);
        } else {
            by_batch
                .entry(r.batch_size)
                .or_default()
                .insert(r.block_size, r.gb_per_s);
        }
    }
    let mut out: Vec<Series> = by_batch
        .into_iter()
        .enumerate()
        .map(|(i, (batch, points))| Series {
            name: format!("batch {batch}"),
            colour: COLOURS[i % COLOURS.len()],
            dash: None,
            points,
        })
        .collect();
    for (name, points) in baselines {
        let (colour, dash) = match name.as_str() {
            "baseline-memcpy" => ("#000000", "8 4"),
            "baseline-socket" => ("#555555", "4 4"),
            _ => ("#999999", "2 3"),
        };
        out.push(Series {
            name: name.trim_start_matches("baseline-").to_string(),
            colour,
            dash: Some(dash),
            points,
        });
    }
    out
}

/// A short size label for an axis tick: `4K`, `64K`, `1M`, `512`.
fn tick_label(n: u64) -> String {
    match n {
        n if n >= 1 << 30 && n % (1 << 30) == 0 => format!("{}G", n >> 30),
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{}M", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{}K", n >> 10),
        n => n.to_string(),
    }
}

/// A round upper bound for the y axis and its tick step.
fn nice_scale(max: f64) -> (f64, f64) {
    if max.is_nan() || max <= 0.0 {
        return (1.0, 0.2);
    }
    let raw = max / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * mag);
    ((max / step).ceil() * step, step)
}

/// Escapes text for SVG.
fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The SVG text, or `None` if there are no results.
pub(crate) fn render(records: &[Record], title: &str) -> Option<String> {
    let series = series(records);
    let blocks: Vec<u64> = {
        let mut b: Vec<u64> = records.iter().map(|r| r.block_size).collect();
        b.sort_unstable();
        b.dedup();
        b
    };
    let (&lo, &hi) = (blocks.first()?, blocks.last()?);
    let (x0, x1) = ((lo as f64).log2(), (hi as f64).log2());
    let (x0, x1) = if x1 - x0 < 1e-9 {
        (x0 - 1.0, x1 + 1.0)
    } else {
        (x0, x1)
    };
    let ymax_data = records.iter().map(|r| r.gb_per_s).fold(0.0, f64::max);
    let (ymax, ystep) = nice_scale(ymax_data);
    let pw = WIDTH - LEFT - RIGHT;
    let ph = HEIGHT - TOP - BOTTOM;
    let x = |block: u64| LEFT + ((block as f64).log2() - x0) / (x1 - x0) * pw;
    let y = |g: f64| TOP + ph - g / ymax * ph;

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="28" text-anchor="middle" font-size="16">{}</text>"#,
        LEFT + pw / 2.0,
        escape(title)
    );
    // Grid and ticks.
    let mut g = 0.0;
    while g <= ymax + ystep / 2.0 {
        let yy = y(g);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#e0e0e0"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT + pw,
            LEFT - 8.0,
            yy + 4.0,
            trim_number(g)
        );
        g += ystep;
    }
    for &b in &blocks {
        let xx = x(b);
        let _ = writeln!(
            s,
            r##"<line x1="{xx:.1}" y1="{TOP}" x2="{xx:.1}" y2="{:.1}" stroke="#f0f0f0"/><text x="{xx:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            TOP + ph,
            TOP + ph + 18.0,
            tick_label(b)
        );
    }
    // Axes and their labels.
    let _ = writeln!(
        s,
        r##"<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{:.1}" stroke="black"/><line x1="{LEFT}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="black"/>"##,
        TOP + ph,
        TOP + ph,
        LEFT + pw,
        TOP + ph
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">block size (bytes, log2 scale)</text>"#,
        LEFT + pw / 2.0,
        HEIGHT - 20.0
    );
    let _ = writeln!(
        s,
        r#"<text x="20" y="{:.1}" text-anchor="middle" transform="rotate(-90 20 {:.1})">throughput (GB/s, decimal)</text>"#,
        TOP + ph / 2.0,
        TOP + ph / 2.0
    );
    // Series and legend.
    for (i, se) in series.iter().enumerate() {
        let pts: Vec<String> = se
            .points
            .iter()
            .map(|(&b, &g)| format!("{:.1},{:.1}", x(b), y(g)))
            .collect();
        let dash = se
            .dash
            .map(|d| format!(r#" stroke-dasharray="{d}""#))
            .unwrap_or_default();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{}" stroke-width="2"{dash} points="{}"><title>{}</title></polyline>"#,
            se.colour,
            pts.join(" "),
            escape(&se.name)
        );
        if se.dash.is_none() {
            for (&b, &g) in &se.points {
                let _ = writeln!(
                    s,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{}"><title>{}: {} bytes, {:.3} GB/s</title></circle>"#,
                    x(b),
                    y(g),
                    se.colour,
                    escape(&se.name),
                    b,
                    g
                );
            }
        }
        let ly = TOP + 10.0 + 20.0 * i as f64;
        let lx = WIDTH - RIGHT + 20.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{}" stroke-width="2"{dash}/><text x="{:.1}" y="{:.1}">{}</text>"#,
            lx + 28.0,
            se.colour,
            lx + 36.0,
            ly + 4.0,
            escape(&se.name)
        );
    }
    s.push_str("</svg>\n");
    Some(s)
}

/// An axis number without trailing zeros: `2.5`, `10`.
fn trim_number(v: f64) -> String {
    let t = format!("{v:.2}");
    t.trim_end_matches('0').trim_end_matches('.').to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(backend: &str, block: u64, batch: u64, gbps: f64) -> Record {
        let mut r = Record::measured(backend, te::Op::Write, block, batch, 1, 1, 1.0, None);
        r.gb_per_s = gbps;
        r
    }

    #[test]
    fn one_polyline_per_batch_size_and_per_baseline_with_a_legend() {
        let records = vec![
            rec("stub", 4096, 1, 1.0),
            rec("stub", 8192, 1, 2.0),
            rec("stub", 4096, 8, 3.0),
            rec("stub", 8192, 8, 4.5),
            rec("baseline-memcpy", 4096, 8, 6.0),
            rec("baseline-memcpy", 8192, 8, 7.0),
        ];
        let svg = render(&records, "t <&>").unwrap();
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 3);
        assert!(svg.contains(">batch 1<") && svg.contains(">batch 8<") && svg.contains(">memcpy<"));
        assert!(svg.contains("block size") && svg.contains("GB/s"));
        assert!(svg.contains("t &lt;&amp;&gt;"));
        assert!(svg.contains(">4K<") && svg.contains(">8K<"));
    }

    #[test]
    fn a_single_block_size_still_plots_and_nothing_does_not() {
        let svg = render(&[rec("stub", 1 << 20, 64, 9.0)], "t").unwrap();
        assert!(svg.contains(">1M<"));
        assert!(render(&[], "t").is_none());
    }

    #[test]
    fn the_y_axis_ends_on_a_round_number_above_the_data() {
        assert_eq!(nice_scale(9.3), (10.0, 2.0));
        assert_eq!(nice_scale(0.7), (0.8, 0.2));
        assert_eq!(nice_scale(0.0), (1.0, 0.2));
    }
}
