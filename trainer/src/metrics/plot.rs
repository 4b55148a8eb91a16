//! PNG plots of a metrics log: one line chart per metric, and an 8-panel summary.
//!
//! Drawn with `plotters`' bitmap backend. Text uses DejaVu Sans embedded from the `dejavu`
//! crate through plotters' `ab_glyph` renderer, so no system font is needed. plotters keeps
//! its fonts in a process-wide table; [`register_font`] puts ours there under the family name
//! [`FONT`] (the same bytes every time, so registering again changes nothing).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use plotters::prelude::*;
use plotters::style::{FontStyle, register_font as plotters_register_font};

use super::{MetricsError, StepMetrics};
use crate::checkpoint::Stage;

/// The font family plots use.
pub const FONT: &str = "fathom-sans";

/// The metrics of the summary image, in reading order (two rows of four).
pub const SUMMARY: [&str; 8] = [
    "reward",
    "solve_rate",
    "loss",
    "kl",
    "grad_norm",
    "completion_tokens",
    "llm_calls",
    "tool_tokens",
];

/// Size of a single-metric plot, in pixels.
pub const SIZE: (u32, u32) = (800, 480);

/// Registers the embedded font with plotters.
pub fn register_font() -> Result<(), MetricsError> {
    plotters_register_font(FONT, FontStyle::Normal, dejavu::sans::regular()).map_err(|_| {
        MetricsError::Plot {
            path: PathBuf::from(FONT),
            message: "the embedded DejaVu Sans font did not parse".into(),
        }
    })
}

/// The points of each metric of one stage, by name: `(step, value)`.
pub fn collect(records: &[StepMetrics], stage: Stage) -> BTreeMap<String, Vec<(f64, f64)>> {
    let mut out: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for m in records.iter().filter(|m| m.stage == stage) {
        for (name, v) in m.series() {
            if v.is_finite() {
                out.entry(name).or_default().push((m.step as f64, v));
            }
        }
    }
    out
}

/// A file name for a metric (`reward/correctness` → `reward_correctness.png`).
pub fn file_name(prefix: &str, metric: &str) -> String {
    let clean: String = metric
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{prefix}{clean}.png")
}

/// Writes `<dir>/<prefix><metric>.png` for every metric of `stage` and
/// `<dir>/<prefix>summary.png`; returns the files written. `prefix` separates stages
/// (e.g. `"sft_"`, `""`).
pub fn plot_stage(
    records: &[StepMetrics],
    stage: Stage,
    dir: &Path,
    prefix: &str,
) -> Result<Vec<PathBuf>, MetricsError> {
    register_font()?;
    std::fs::create_dir_all(dir).map_err(|source| MetricsError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let series = collect(records, stage);
    let mut written = Vec::new();
    for (name, points) in &series {
        let path = dir.join(file_name(prefix, name));
        let root = BitMapBackend::new(&path, SIZE).into_drawing_area();
        draw(&root, name, points).map_err(|message| MetricsError::Plot {
            path: path.clone(),
            message,
        })?;
        root.present().map_err(|e| MetricsError::Plot {
            path: path.clone(),
            message: e.to_string(),
        })?;
        drop(root);
        written.push(path);
    }
    let path = dir.join(format!("{prefix}summary.png"));
    let root = BitMapBackend::new(&path, (1600, 720)).into_drawing_area();
    let plot_err = |message: String| MetricsError::Plot {
        path: path.clone(),
        message,
    };
    root.fill(&WHITE).map_err(|e| plot_err(e.to_string()))?;
    for (area, name) in root.split_evenly((2, 4)).iter().zip(SUMMARY) {
        match series.get(name) {
            Some(points) => draw(area, name, points).map_err(plot_err)?,
            None => empty(area, name).map_err(plot_err)?,
        }
    }
    root.present().map_err(|e| plot_err(e.to_string()))?;
    drop(root);
    written.push(path);
    Ok(written)
}

/// A y range around the values with a margin (a flat series gets ±1 or ±10 %).
fn y_range(points: &[(f64, f64)]) -> (f64, f64) {
    let lo = points.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let hi = points.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    if hi - lo < 1e-12 {
        let pad = if lo.abs() < 1e-9 { 1.0 } else { lo.abs() * 0.1 };
        (lo - pad, hi + pad)
    } else {
        let pad = (hi - lo) * 0.08;
        (lo - pad, hi + pad)
    }
}

fn draw<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    name: &str,
    points: &[(f64, f64)],
) -> Result<(), String> {
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    area.fill(&WHITE).map_err(e)?;
    let x0 = points.first().map(|p| p.0).unwrap_or(0.0);
    let x1 = points.last().map(|p| p.0).unwrap_or(1.0).max(x0 + 1.0);
    let (y0, y1) = y_range(points);
    let mut chart = ChartBuilder::on(area)
        .caption(name, (FONT, 22))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 15))
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| short(*v))
        .draw()
        .map_err(e)?;
    let colour = RGBColor(31, 119, 180);
    chart
        .draw_series(LineSeries::new(
            points.iter().copied(),
            colour.stroke_width(2),
        ))
        .map_err(e)?;
    if points.len() <= 60 {
        chart
            .draw_series(points.iter().map(|p| Circle::new(*p, 3, colour.filled())))
            .map_err(e)?;
    }
    Ok(())
}

fn empty<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    name: &str,
) -> Result<(), String> {
    area.fill(&WHITE).map_err(|e| e.to_string())?;
    let (w, h) = area.dim_in_pixel();
    area.draw(&Text::new(
        format!("{name}: no data"),
        (w as i32 / 2 - 70, h as i32 / 2),
        (FONT, 18).into_font().color(&RGBColor(120, 120, 120)),
    ))
    .map_err(|e| e.to_string())
}

/// Compact tick labels: 3 significant digits, scientific for very small or large values.
fn short(v: f64) -> String {
    // Tick positions computed in floating point land a hair off zero.
    let v = if v.abs() < 1e-12 { 0.0 } else { v };
    let a = v.abs();
    if a != 0.0 && !(1e-3..1e5).contains(&a) {
        format!("{v:.2e}")
    } else {
        let s = format!("{v:.4}");
        let s = s.trim_end_matches('0').trim_end_matches('.');
        if s == "-0" { "0".into() } else { s.to_string() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::tests::record;

    /// Counts the pixels that are not white and the distinct colours of a PNG.
    fn ink(path: &Path) -> (usize, usize, (u32, u32)) {
        let img = image::open(path).unwrap().to_rgb8();
        let mut colours = std::collections::BTreeSet::new();
        let mut n = 0;
        for p in img.pixels() {
            if p.0 != [255, 255, 255] {
                n += 1;
            }
            colours.insert(p.0);
        }
        (n, colours.len(), img.dimensions())
    }

    #[test]
    fn plots_are_written_and_non_trivial() {
        let dir = tempfile::tempdir().unwrap();
        let mut records: Vec<StepMetrics> = (1..=3).map(|s| record(Stage::Sft, s)).collect();
        records.extend((1..=12).map(|s| record(Stage::Grpo, s)));
        let files = plot_stage(&records, Stage::Grpo, dir.path(), "").unwrap();
        let names: Vec<String> = files
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        for want in [
            "reward.png",
            "reward_correctness.png",
            "loss.png",
            "summary.png",
        ] {
            assert!(names.iter().any(|n| n == want), "{want} in {names:?}");
        }
        for f in &files {
            let (inked, colours, dims) = ink(f);
            let total = (dims.0 * dims.1) as usize;
            // Axes, labels and the line: some ink, far from all of it; anti-aliased text
            // brings many shades.
            assert!(
                inked > total / 200,
                "{f:?}: {inked} of {total} pixels inked"
            );
            assert!(inked < total / 2, "{f:?}: {inked} of {total} pixels inked");
            assert!(colours > 20, "{f:?}: {colours} colours (no text rendered?)");
        }
        // The SFT stage has no rollout metrics: its summary still renders (panels say so).
        let sft = plot_stage(&records, Stage::Sft, dir.path(), "sft_").unwrap();
        assert!(sft.iter().any(|p| p.ends_with("sft_summary.png")));
        assert!(!sft.iter().any(|p| p.ends_with("sft_reward.png")));
    }

    #[test]
    fn tick_labels_are_short() {
        assert_eq!(short(0.5), "0.5");
        assert_eq!(short(5e-6), "5.00e-6");
        assert_eq!(short(0.0), "0");
        assert_eq!(short(1500.0), "1500");
        assert_eq!(short(1.39e-17), "0");
    }
}
