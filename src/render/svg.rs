//! `--timeline PATH`: the simulated step as an SVG chart, written by hand: live memory over
//! the step's events, stacked by category, the phases shaded and named, the peak marked with
//! its size, phase and layer, the y axis in the unit that fits the peak (KiB, MiB, GiB, …).
//!
//! The peak marker is `<g id="peak" data-peak-bytes="N">`, `N` the report's `peak_bytes`, so a
//! script (or a test) can read it back.

use std::fmt::Write as _;

use crate::report::Report;
use crate::sim::{Category, Phase, TimePoint, Timeline};
use crate::units::{UnitSystem, format_bytes};

const WIDTH: f64 = 1000.0;
const HEIGHT: f64 = 560.0;
const LEFT: f64 = 78.0;
const RIGHT: f64 = 240.0;
const TOP: f64 = 78.0;
const BOTTOM: f64 = 56.0;
const FONT: &str = "system-ui, -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif";

/// Bottom to top: what lives all step first, then what grows and shrinks.
const STACK: [Category; Category::COUNT] = [
    Category::Parameters,
    Category::Buffers,
    Category::MasterWeights,
    Category::OptimizerState,
    Category::Input,
    Category::KvCache,
    Category::CommBuffers,
    Category::Gradients,
    Category::Activations,
    Category::Temporaries,
];

/// Fill colours (Okabe–Ito, readable by people with colour-blindness).
const fn colour(c: Category) -> &'static str {
    match c {
        Category::Parameters => "#0072B2",
        Category::Buffers => "#56B4E9",
        Category::MasterWeights => "#CC79A7",
        Category::OptimizerState => "#009E73",
        Category::Input => "#999999",
        Category::KvCache => "#F0E442",
        Category::CommBuffers => "#000000",
        Category::Gradients => "#D55E00",
        Category::Activations => "#E69F00",
        Category::Temporaries => "#B8A3D9",
    }
}

/// Text for XML: `&`, `<`, `>`, quotes escaped, control characters dropped.
fn xml(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out
}

/// The axis unit for a maximum: the largest power of the base not above it, with its name.
fn axis_unit(max: u64, units: UnitSystem) -> (f64, &'static str) {
    let (base, names): (f64, [&str; 6]) = match units {
        UnitSystem::Iec => (1024.0, ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]),
        UnitSystem::Si => (1000.0, ["B", "kB", "MB", "GB", "TB", "PB"]),
    };
    #[allow(clippy::cast_precision_loss)] // display only
    let max = max as f64;
    let mut scale = 1.0;
    let mut name = names[0];
    for n in &names[1..] {
        if max < scale * base {
            break;
        }
        scale *= base;
        name = n;
    }
    (scale, name)
}

/// A tick step of 1, 2 or 5 × 10^k (in axis units) giving at most about six ticks up to `top`.
fn tick_step(top: f64) -> f64 {
    if top <= 0.0 {
        return 1.0;
    }
    let raw = top / 6.0;
    let mag = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag)
}

/// A tick label: no trailing zeros.
fn tick_label(v: f64) -> String {
    let s = format!("{v:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// The chart, or `None` when the report has no timeline.
#[must_use]
pub fn timeline(r: &Report, units: UnitSystem) -> Option<String> {
    let t = r.timeline.as_ref()?;
    let mut out = String::new();
    // Writing to a `String` cannot fail.
    let _ = write_chart(&mut out, r, t, units);
    Some(out)
}

#[allow(clippy::cast_precision_loss)] // coordinates only
fn write_chart(out: &mut String, r: &Report, t: &Timeline, units: UnitSystem) -> std::fmt::Result {
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let budget = r.budget.as_ref().map(|b| b.budget_bytes);
    let top_bytes = r.peak_bytes.max(budget.unwrap_or(0)).max(1);
    let (scale, unit) = axis_unit(top_bytes, units);
    let top_units = top_bytes as f64 / scale;
    let step = tick_step(top_units);
    let y_max = (top_units / step).ceil().max(1.0) * step;
    // Each phase gets a width in proportion to its events, at least a twentieth of the plot
    // (the optimizer step is one event).
    let events = t.events.max(1) as f64;
    let widths: Vec<f64> = t
        .phases
        .iter()
        .map(|&(_, a, b)| ((b - a) as f64 / events).max(0.05))
        .collect();
    let sum: f64 = widths.iter().sum::<f64>().max(f64::MIN_POSITIVE);
    let mut spans = Vec::new();
    let mut at = LEFT;
    for (&(_, a, b), w) in t.phases.iter().zip(&widths) {
        let w = w / sum * plot_w;
        spans.push((a, b, at, w));
        at += w;
    }
    let x = |event: usize| {
        spans
            .iter()
            .find(|&&(a, b, _, _)| event >= a && event < b)
            .map_or(LEFT + plot_w, |&(a, b, x0, w)| {
                x0 + (event - a) as f64 / (b - a).max(1) as f64 * w
            })
    };
    let y = |bytes: u64| TOP + plot_h - (bytes as f64 / scale) / y_max * plot_h;
    let fmt = |b: u64| format_bytes(b, units);

    writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="{FONT}" font-size="12">"#
    )?;
    writeln!(
        out,
        "<title>memest: {} — live memory over one step</title>",
        xml(&r.model)
    )?;
    writeln!(
        out,
        r##"<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/>"##
    )?;
    // Title and the run.
    writeln!(
        out,
        r##"<text x="{LEFT}" y="26" font-size="17" font-weight="600" fill="#222">{} — live memory over one {}</text>"##,
        xml(&r.model),
        if r.settings.training() {
            "training step"
        } else {
            "inference pass"
        }
    )?;
    writeln!(
        out,
        r##"<text x="{LEFT}" y="46" fill="#555">{}</text>"##,
        xml(&super::run_line(r))
    )?;

    // Phase bands and their names.
    for (i, &(phase, start, end)) in t.phases.iter().enumerate() {
        let (x0, x1) = (x(start), x(end));
        let fill = if i % 2 == 0 { "#f4f6f8" } else { "#e9edf1" };
        writeln!(
            out,
            r#"<rect class="phase" data-phase="{}" x="{x0:.2}" y="{TOP}" width="{:.2}" height="{plot_h}" fill="{fill}"/>"#,
            phase_key(phase),
            (x1 - x0).max(0.5)
        )?;
        let label = phase.title();
        // A name only where it fits; a one-event optimizer step gets its name above the plot.
        let fits = x1 - x0 >= 7.0 * label.len() as f64;
        let (lx, anchor) = if fits {
            ((x0 + x1) / 2.0, "middle")
        } else {
            (x1, "end")
        };
        let ly = if fits { TOP - 8.0 } else { TOP - 22.0 };
        writeln!(
            out,
            r##"<text x="{lx:.2}" y="{ly}" text-anchor="{anchor}" fill="#444" font-weight="600">{label}</text>"##
        )?;
        if i > 0 {
            writeln!(
                out,
                r##"<line x1="{x0:.2}" y1="{}" x2="{x0:.2}" y2="{}" stroke="#8a949e" stroke-width="1"/>"##,
                TOP - 4.0,
                TOP + plot_h
            )?;
        }
    }

    // Horizontal grid and y labels.
    let mut v = 0.0;
    while v <= y_max + step / 2.0 {
        let py = TOP + plot_h - v / y_max * plot_h;
        writeln!(
            out,
            r##"<line x1="{LEFT}" y1="{py:.2}" x2="{:.2}" y2="{py:.2}" stroke="#d0d5da" stroke-width="1"/>"##,
            LEFT + plot_w
        )?;
        writeln!(
            out,
            r##"<text x="{:.2}" y="{:.2}" text-anchor="end" fill="#444">{} {unit}</text>"##,
            LEFT - 8.0,
            py + 4.0,
            tick_label(v)
        )?;
        v += step;
    }

    // The stacked areas: each category's band, as a step curve over the events.
    let shown: Vec<Category> = STACK
        .into_iter()
        .filter(|&c| r.category_max.get(c) > 0)
        .collect();
    let mut below: Vec<u64> = vec![0; t.points.len()];
    for &c in &shown {
        let ci = Category::ALL.iter().position(|&a| a == c).unwrap_or(0);
        let above: Vec<u64> = t
            .points
            .iter()
            .zip(&below)
            .map(|(p, b)| b.saturating_add(p.bytes[ci]))
            .collect();
        let mut d = String::new();
        let ends = |i: usize, p: &TimePoint| {
            let next = t.points.get(i + 1).map_or(t.events, |n| n.event);
            (x(p.event), x(next))
        };
        for (i, p) in t.points.iter().enumerate() {
            let (x0, x1) = ends(i, p);
            let cmd = if i == 0 { 'M' } else { 'L' };
            let _ = write!(
                d,
                "{cmd}{x0:.2},{:.2}L{x1:.2},{:.2}",
                y(above[i]),
                y(above[i])
            );
        }
        for (i, p) in t.points.iter().enumerate().rev() {
            let (x0, x1) = ends(i, p);
            let _ = write!(d, "L{x1:.2},{:.2}L{x0:.2},{:.2}", y(below[i]), y(below[i]));
        }
        writeln!(
            out,
            r#"<path class="area" data-category="{}" d="{d}Z" fill="{}" fill-opacity="0.9" stroke="none"/>"#,
            c.key().trim_end_matches("_bytes"),
            colour(c)
        )?;
        below = above;
    }

    // The total's outline, so that a one-event spike shows.
    let mut d = String::new();
    for (i, p) in t.points.iter().enumerate() {
        let next = t.points.get(i + 1).map_or(t.events, |n| n.event);
        let cmd = if i == 0 { 'M' } else { 'L' };
        let ty = y(below[i]);
        let _ = write!(d, "{cmd}{:.2},{ty:.2}L{:.2},{ty:.2}", x(p.event), x(next));
    }
    writeln!(
        out,
        r##"<path class="total" d="{d}" fill="none" stroke="#222" stroke-width="1.2" stroke-linejoin="round"/>"##
    )?;

    // Axes.
    writeln!(
        out,
        r##"<line x1="{LEFT}" y1="{:.2}" x2="{:.2}" y2="{:.2}" stroke="#333" stroke-width="1"/>"##,
        TOP + plot_h,
        LEFT + plot_w,
        TOP + plot_h
    )?;
    writeln!(
        out,
        r##"<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{:.2}" stroke="#333" stroke-width="1"/>"##,
        TOP + plot_h
    )?;
    writeln!(
        out,
        r##"<text x="{:.2}" y="{:.2}" text-anchor="middle" fill="#444">operators in execution order ({} events{})</text>"##,
        LEFT + plot_w / 2.0,
        HEIGHT - 18.0,
        t.events,
        if r.settings.training() {
            ": forward, then backward in reverse, then the optimizer step"
        } else {
            ": the forward pass"
        }
    )?;
    writeln!(
        out,
        r##"<text transform="translate(18 {:.2}) rotate(-90)" text-anchor="middle" fill="#444">live memory ({unit})</text>"##,
        TOP + plot_h / 2.0
    )?;

    // The budget.
    if let Some(b) = budget {
        let by = y(b);
        writeln!(
            out,
            r##"<g id="budget" data-budget-bytes="{b}"><line x1="{LEFT}" y1="{by:.2}" x2="{:.2}" y2="{by:.2}" stroke="#c0392b" stroke-width="1.5" stroke-dasharray="6 4"/><text x="{:.2}" y="{:.2}" fill="#c0392b">budget {}</text></g>"##,
            LEFT + plot_w,
            LEFT + 6.0,
            by + 15.0,
            xml(&fmt(b))
        )?;
    }

    // The peak.
    if let Some(p) = t.points.get(t.peak) {
        let next = t.points.get(t.peak + 1).map_or(t.events, |n| n.event);
        let px = (x(p.event) + x(next)) / 2.0;
        let py = y(p.total());
        let mut label = format!("peak {} · {}", fmt(r.peak_bytes), r.peak_phase.title());
        if let Some(l) = &r.peak_layer {
            let _ = write!(label, " · {l}");
        }
        let right_half = px > LEFT + plot_w * 0.55;
        let (lx, anchor) = if right_half {
            (px - 8.0, "end")
        } else {
            (px + 8.0, "start")
        };
        let ly = (py - 10.0).max(TOP + 14.0);
        writeln!(
            out,
            r##"<g id="peak" data-peak-bytes="{}" data-event="{}"><line x1="{px:.2}" y1="{TOP}" x2="{px:.2}" y2="{:.2}" stroke="#111" stroke-width="1" stroke-dasharray="3 3"/><circle cx="{px:.2}" cy="{py:.2}" r="4" fill="#111"/><text x="{lx:.2}" y="{ly:.2}" text-anchor="{anchor}" font-weight="600" fill="#111" stroke="#ffffff" stroke-width="3" paint-order="stroke">{}</text></g>"##,
            p.total(),
            p.event,
            TOP + plot_h,
            xml(&label)
        )?;
    }

    // The legend, top category first as in the stack, with its bytes at the peak.
    let lx = LEFT + plot_w + 20.0;
    writeln!(
        out,
        r##"<text x="{lx:.2}" y="{TOP}" font-weight="600" fill="#222">at the peak</text>"##
    )?;
    for (i, &c) in shown.iter().rev().enumerate() {
        let ly = TOP + 14.0 + 22.0 * i as f64;
        writeln!(
            out,
            r##"<rect x="{lx:.2}" y="{ly:.2}" width="14" height="14" fill="{}"/><text x="{:.2}" y="{:.2}" fill="#222">{}</text><text x="{:.2}" y="{:.2}" text-anchor="end" fill="#222">{}</text>"##,
            colour(c),
            lx + 20.0,
            ly + 11.0,
            c.title(),
            WIDTH - 12.0,
            ly + 11.0,
            xml(&fmt(r.at_peak.get(c)))
        )?;
    }
    let ty = TOP + 14.0 + 22.0 * shown.len() as f64 + 6.0;
    writeln!(
        out,
        r##"<line x1="{lx:.2}" y1="{ty:.2}" x2="{:.2}" y2="{ty:.2}" stroke="#999"/><text x="{:.2}" y="{:.2}" font-weight="600" fill="#222">Total</text><text x="{:.2}" y="{:.2}" text-anchor="end" font-weight="600" fill="#222">{}</text>"##,
        WIDTH - 12.0,
        lx + 20.0,
        ty + 16.0,
        WIDTH - 12.0,
        ty + 16.0,
        xml(&fmt(r.peak_bytes))
    )?;
    writeln!(out, "</svg>")
}

/// The phase's JSON name.
const fn phase_key(p: Phase) -> &'static str {
    match p {
        Phase::Forward => "forward",
        Phase::Backward => "backward",
        Phase::OptimizerStep => "optimizer_step",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_units_and_ticks() {
        assert_eq!(
            axis_unit(3 << 30, UnitSystem::Iec),
            (1_073_741_824.0, "GiB")
        );
        assert_eq!(axis_unit(1000, UnitSystem::Iec), (1.0, "B"));
        assert_eq!(axis_unit(82_202_828, UnitSystem::Si), (1_000_000.0, "MB"));
        assert!((tick_step(3.64) - 1.0).abs() < 1e-9);
        assert!((tick_step(78.4) - 20.0).abs() < 1e-9);
        assert!((tick_step(15.15) - 5.0).abs() < 1e-9);
        assert_eq!(tick_label(0.5), "0.5");
        assert_eq!(tick_label(20.0), "20");
        assert_eq!(
            xml("a<b>&\"c'\u{1b}[31m"),
            "a&lt;b&gt;&amp;&quot;c&apos;[31m"
        );
    }
}
