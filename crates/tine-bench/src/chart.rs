//! The chart of `tine bench paper`: for each mechanism and workload, its
//! snapshot and restore times as bars on a log scale, written as SVG and
//! PNG (text in DejaVu Sans, read from the system: Debian's
//! fonts-dejavu-core).

use std::path::Path;

use plotters::prelude::*;

/// One mechanism on one workload.
#[derive(Debug, Clone)]
pub(crate) struct Bar {
    pub(crate) label: String,
    pub(crate) snapshot_s: f64,
    pub(crate) restore_s: f64,
    /// How long the program was paused, where the mechanism tells.
    pub(crate) paused_s: Option<f64>,
    pub(crate) stored_mib: f64,
}

const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// Registers the font once (plotters keeps it for the process).
fn font() -> Result<(), String> {
    static DONE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        let bytes =
            std::fs::read(FONT).map_err(|e| format!("{FONT}: {e} (install fonts-dejavu-core)"))?;
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| format!("{FONT}: not a font plotters can read"))
    })
    .clone()
}

fn plot<DB: DrawingBackend>(
    area: DrawingArea<DB, plotters::coord::Shift>,
    rows: &[Bar],
    mib: u64,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let e = |x: DrawingAreaErrorKind<DB::ErrorType>| x.to_string();
    area.fill(&WHITE).map_err(e)?;
    let n = rows.len().max(1) as f64;
    let lo = 0.001f64;
    let hi = rows
        .iter()
        .flat_map(|r| [r.snapshot_s, r.restore_s])
        .fold(1.0f64, f64::max)
        * 3.0;
    let mut chart = ChartBuilder::on(&area)
        .caption(
            format!(
                "snapshot and restore, {mib} MiB workloads (seconds, log scale; shorter is better)"
            ),
            ("sans-serif", 20),
        )
        .margin(16)
        .x_label_area_size(36)
        .y_label_area_size(8)
        .build_cartesian_2d((lo..hi).log_scale(), 0.0..n)
        .map_err(e)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .disable_y_axis()
        .x_desc("seconds")
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(e)?;
    let snap = RGBColor(0x2b, 0x6c, 0xb0);
    let rest = RGBColor(0xe0, 0x7b, 0x39);
    // Top row first.
    let y = |i: usize| n - 1.0 - i as f64;
    let paused = RGBColor(0x3a, 0x9a, 0x5b);
    chart
        .draw_series(rows.iter().enumerate().map(|(i, r)| {
            Rectangle::new(
                [(lo, y(i) + 0.54), (r.snapshot_s.max(lo), y(i) + 0.72)],
                snap.filled(),
            )
        }))
        .map_err(e)?
        .label("snapshot (whole command)")
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], snap.filled()));
    chart
        .draw_series(rows.iter().enumerate().filter_map(|(i, r)| {
            let p = r.paused_s?;
            Some(Rectangle::new(
                [(lo, y(i) + 0.34), (p.max(lo), y(i) + 0.52)],
                paused.filled(),
            ))
        }))
        .map_err(e)?
        .label("program paused (tine tells)")
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], paused.filled()));
    chart
        .draw_series(rows.iter().enumerate().map(|(i, r)| {
            Rectangle::new(
                [(lo, y(i) + 0.10), (r.restore_s.max(lo), y(i) + 0.32)],
                rest.filled(),
            )
        }))
        .map_err(e)?
        .label("restore")
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], rest.filled()));
    chart
        .draw_series(rows.iter().enumerate().map(|(i, r)| {
            let paused = r
                .paused_s
                .map(|p| format!(", paused {p:.3} s"))
                .unwrap_or_default();
            Text::new(
                format!(
                    "{}   snapshot {:.3} s{paused}, restore {:.3} s, stored {:.1} MiB",
                    r.label, r.snapshot_s, r.restore_s, r.stored_mib
                ),
                (lo * 1.15, y(i) + 0.95),
                ("sans-serif", 14).into_font(),
            )
        }))
        .map_err(e)?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(e)?;
    area.present().map_err(e)?;
    Ok(())
}

/// Writes `dir/paper.svg` and `dir/paper.png` of `rows`.
pub(crate) fn draw(rows: &[Bar], mib: u64, dir: &Path) -> Result<(), String> {
    font()?;
    let h = 120 + 64 * rows.len() as u32;
    let svg = dir.join("paper.svg");
    plot(
        SVGBackend::new(&svg, (1000, h)).into_drawing_area(),
        rows,
        mib,
    )?;
    let png = dir.join("paper.png");
    plot(
        BitMapBackend::new(&png, (1000, h)).into_drawing_area(),
        rows,
        mib,
    )?;
    Ok(())
}
