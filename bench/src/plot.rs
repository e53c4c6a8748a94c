//! PNG plots with `plotters` (bitmap backend; text through `ab_glyph` from a
//! TrueType font found on the system, e.g. Debian's `fonts-dejavu-core`).

use std::io;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::prelude::*;

use crate::report::Results;

const FONT: &str = "sans-serif";
/// Fonts tried first; any `.ttf` under the font directories after them.
const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/noto/NotoSans-Regular.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];
const FONT_DIRS: &[&str] = &["/usr/share/fonts", "/usr/local/share/fonts"];

fn find_ttf(dir: &Path, depth: u32) -> Option<PathBuf> {
    let rd = std::fs::read_dir(dir).ok()?;
    let mut subdirs = Vec::new();
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            subdirs.push(p);
        } else if p.extension().is_some_and(|x| x.eq_ignore_ascii_case("ttf")) {
            return Some(p);
        }
    }
    if depth == 0 {
        return None;
    }
    subdirs.into_iter().find_map(|d| find_ttf(&d, depth - 1))
}

/// Registers a system font once; the error says how to get one.
fn font() -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        let path = FONT_CANDIDATES
            .iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
            .or_else(|| FONT_DIRS.iter().find_map(|d| find_ttf(Path::new(d), 4)))
            .ok_or("no TrueType font found (apt-get install fonts-dejavu-core)")?;
        let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        // plotters keeps a 'static reference; one font per process.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font(FONT, FontStyle::Normal, bytes)
            .map_err(|_| format!("{}: not a usable font", path.display()))
    })
    .clone()
}

fn color(peer: &str) -> RGBColor {
    match peer {
        "direct" => RGBColor(40, 40, 40),
        "socat" => RGBColor(31, 119, 180),
        "ssh-L" => RGBColor(44, 160, 44),
        "roam-forward" => RGBColor(214, 39, 40),
        "roam-pipe" => RGBColor(255, 127, 14),
        _ => RGBColor(148, 103, 189),
    }
}

fn err<E: std::fmt::Display>(e: E) -> io::Error {
    io::Error::other(e.to_string())
}

/// Positive finite bounds of `vals`, widened a little for log axes.
fn log_range(vals: impl Iterator<Item = f64>) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, 0.0f64);
    for v in vals.filter(|v| v.is_finite() && *v > 0.0) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return (0.1, 1.0);
    }
    (lo / 1.5, hi * 1.5)
}

/// Axis labels: plain integers from 1 up, two decimals below.
fn num_label(v: &f64) -> String {
    if *v >= 1.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

/// Draws every plot whose scenario has data; one result per plot.
pub(crate) fn all(r: &Results, out: &Path) -> Vec<io::Result<PathBuf>> {
    let mut v = Vec::new();
    if let Err(e) = font() {
        v.push(Err(io::Error::other(e)));
        return v;
    }
    if let Some(t) = r.scenarios.throughput.ok() {
        v.push(throughput(t, &out.join("throughput.png")));
    }
    if let Some(l) = r.scenarios.latency.ok() {
        v.push(latency(l, &out.join("latency_cdf.png")));
    }
    if let Some(x) = r.scenarios.resume.ok() {
        v.push(resume(x, &out.join("resume.png")));
    }
    if let Some(x) = r.scenarios.cluster.ok() {
        v.push(cluster(x, &out.join("cluster.png")));
    }
    v
}

fn throughput(t: &crate::scenarios::throughput::Throughput, path: &Path) -> io::Result<PathBuf> {
    let root = BitMapBackend::new(path, (1400, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root
        .titled(
            "Bulk throughput vs write block size (median MB/s, log-log)",
            (FONT, 24),
        )
        .map_err(err)?;
    let panels = root.split_evenly((1, 2));
    let (ylo, yhi) = log_range(t.rows.iter().map(|r| r.median_mbps));
    let xmax = t.rows.iter().map(|r| r.block_bytes).max().unwrap_or(65536) as f64 * 1.5;
    for (panel, dir) in panels.iter().zip(crate::scenarios::throughput::DIRECTIONS) {
        let mut chart = ChartBuilder::on(panel)
            .caption(dir, (FONT, 20))
            .margin(12)
            .x_label_area_size(45)
            .y_label_area_size(65)
            .build_cartesian_2d((0.7f64..xmax).log_scale(), (ylo..yhi).log_scale())
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("write block size (bytes)")
            .y_desc("MB/s")
            .x_label_formatter(&num_label)
            .y_label_formatter(&num_label)
            .label_style((FONT, 14))
            .draw()
            .map_err(err)?;
        let peers: Vec<&str> = {
            let mut p: Vec<&str> = Vec::new();
            for r in &t.rows {
                if !p.contains(&r.peer) {
                    p.push(r.peer);
                }
            }
            p
        };
        for peer in peers {
            let c = color(peer);
            let pts: Vec<(f64, f64)> = t
                .rows
                .iter()
                .filter(|r| r.direction == dir && r.peer == peer && r.median_mbps > 0.0)
                .map(|r| (r.block_bytes as f64, r.median_mbps))
                .collect();
            chart
                .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
                .map_err(err)?
                .label(peer)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                });
            chart
                .draw_series(pts.into_iter().map(|p| Circle::new(p, 4, c.filled())))
                .map_err(err)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font((FONT, 15))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(path.to_path_buf())
}

fn latency(l: &crate::scenarios::latency::Latency, path: &Path) -> io::Result<PathBuf> {
    let root = BitMapBackend::new(path, (1400, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root
        .titled(
            "Request/response latency CDF (round-trip time, µs, log scale)",
            (FONT, 24),
        )
        .map_err(err)?;
    let panels = root.split_evenly((1, 2));
    for (panel, size) in panels.iter().zip(crate::scenarios::latency::SIZES) {
        let rows: Vec<_> = l.rows.iter().filter(|r| r.size_bytes == size).collect();
        let (xlo, xhi) = log_range(rows.iter().flat_map(|r| r.cdf_us.iter().copied()));
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("{size} B ping-pong"), (FONT, 20))
            .margin(12)
            .x_label_area_size(45)
            .y_label_area_size(55)
            .build_cartesian_2d((xlo..xhi).log_scale(), 0f64..1f64)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("round-trip time (µs)")
            .y_desc("fraction of round trips")
            .x_label_formatter(&num_label)
            .label_style((FONT, 14))
            .draw()
            .map_err(err)?;
        for r in rows {
            let c = color(r.peer);
            // The exact CDF from every sample (thinned to at most ~2,000 points).
            let mut s = crate::stats::sorted(&r.samples_us);
            let step = (s.len() / 2000).max(1);
            let n = s.len().max(1) as f64;
            let pts: Vec<(f64, f64)> = s
                .drain(..)
                .enumerate()
                .filter(|(i, _)| i % step == 0)
                .map(|(i, v)| (v, (i + 1) as f64 / n))
                .collect();
            chart
                .draw_series(LineSeries::new(pts, c.stroke_width(2)))
                .map_err(err)?
                .label(r.peer)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .label_font((FONT, 15))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(path.to_path_buf())
}

/// A named, coloured line.
type Series = (&'static str, RGBColor, Vec<(f64, f64)>);

fn resume(t: &crate::scenarios::resume::Resume, path: &Path) -> io::Result<PathBuf> {
    let root = BitMapBackend::new(path, (1000, 620)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let xmax = t.rows.iter().map(|r| r.streams).max().unwrap_or(1) as f64 * 2.0;
    let paper =
        |n: f64| crate::scenarios::resume::PAPER_MS.0 + crate::scenarios::resume::PAPER_MS.1 * n;
    let series: [Series; 4] = [
        (
            "roam: connectivity back -> first echo",
            color("roam-forward"),
            t.rows
                .iter()
                .map(|r| (r.streams as f64, r.first_echo_ms.median))
                .collect(),
        ),
        (
            "roam: connectivity back -> Resumed event",
            color("roam-pipe"),
            t.rows
                .iter()
                .map(|r| (r.streams as f64, r.resumed_event_ms.median))
                .collect(),
        ),
        (
            "roam: failure detection (client, idle session)",
            color("socat"),
            t.rows
                .iter()
                .map(|r| (r.streams as f64, r.detect_client_ms.median))
                .collect(),
        ),
        (
            "rocks (2002): resume 1.6 + 0.55 n ms",
            RGBColor(120, 120, 120),
            t.rows
                .iter()
                .map(|r| (r.streams as f64, paper(r.streams as f64)))
                .collect(),
        ),
    ];
    let (ylo, yhi) = log_range(series.iter().flat_map(|s| s.2.iter().map(|p| p.1)));
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Failure detection and resume time vs open streams (median, log-log)",
            (FONT, 22),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(65)
        .build_cartesian_2d(
            (0.7f64..xmax).log_scale(),
            ((ylo / 10.0).min(0.1)..yhi * 3.0).log_scale(),
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("open streams in the session")
        .y_desc("milliseconds")
        .x_label_formatter(&num_label)
        .y_label_formatter(&num_label)
        .label_style((FONT, 14))
        .draw()
        .map_err(err)?;
    for (name, c, pts) in series {
        let pts: Vec<(f64, f64)> = pts
            .into_iter()
            .filter(|p| p.1.is_finite() && p.1 > 0.0)
            .collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
            .map_err(err)?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 4, c.filled())))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font((FONT, 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(path.to_path_buf())
}

/// Scenario 7: client-visible stall of a move against the session's state
/// size, with and without the pre-copy (log-log; a 0-byte state is drawn
/// at 100 bytes).
fn cluster(t: &crate::scenarios::cluster::Cluster, path: &Path) -> io::Result<PathBuf> {
    let root = BitMapBackend::new(path, (1000, 620)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let pts = |precopy: bool, get: &dyn Fn(&crate::scenarios::cluster::StallRow) -> f64| {
        t.stall
            .iter()
            .filter(|r| r.precopy == precopy && r.refused.is_none())
            .map(|r| ((r.state_bytes as f64).max(100.0), get(r)))
            .collect::<Vec<_>>()
    };
    let stall = |r: &crate::scenarios::cluster::StallRow| {
        r.stall_ms.as_ref().map_or(f64::NAN, |s| s.median)
    };
    let frozen = |r: &crate::scenarios::cluster::StallRow| {
        r.frozen_ms.as_ref().map_or(f64::NAN, |s| s.median)
    };
    let series: [Series; 4] = [
        (
            "client-visible stall, pre-copy",
            color("roam-forward"),
            pts(true, &stall),
        ),
        (
            "client-visible stall, no pre-copy",
            color("roam-pipe"),
            pts(false, &stall),
        ),
        ("host: frozen, pre-copy", color("socat"), pts(true, &frozen)),
        (
            "host: frozen, no pre-copy",
            color("ssh-L"),
            pts(false, &frozen),
        ),
    ];
    let (ylo, yhi) = log_range(series.iter().flat_map(|s| s.2.iter().map(|p| p.1)));
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Moving a session between hosts: stall vs state size (median, log-log)",
            (FONT, 22),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(65)
        .build_cartesian_2d(
            (50f64..3e7).log_scale(),
            ((ylo / 2.0).min(0.5)..yhi * 2.0).log_scale(),
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("bytes of attributes (0 drawn at 100)")
        .y_desc("milliseconds")
        .x_label_formatter(&|v| format!("{v:.0e}"))
        .y_label_formatter(&num_label)
        .label_style((FONT, 14))
        .draw()
        .map_err(err)?;
    for (name, c, pts) in series {
        let pts: Vec<(f64, f64)> = pts
            .into_iter()
            .filter(|p| p.1.is_finite() && p.1 > 0.0)
            .collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
            .map_err(err)?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 4, c.filled())))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font((FONT, 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(path.to_path_buf())
}
