//! Order statistics over samples.

use serde::Serialize;

/// Summary of a sample set (units are the caller's).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Summary {
    pub(crate) n: usize,
    pub(crate) min: f64,
    pub(crate) median: f64,
    pub(crate) p90: f64,
    pub(crate) p99: f64,
    pub(crate) max: f64,
    pub(crate) mean: f64,
}

/// The `q`-quantile (0..=1) of sorted `v`, by linear interpolation; NaN if empty.
pub(crate) fn quantile_sorted(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let pos = q.clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

pub(crate) fn sorted(v: &[f64]) -> Vec<f64> {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    s.sort_by(f64::total_cmp);
    s
}

pub(crate) fn median(v: &[f64]) -> f64 {
    quantile_sorted(&sorted(v), 0.5)
}

pub(crate) fn summary(v: &[f64]) -> Summary {
    let s = sorted(v);
    let mean = if s.is_empty() {
        f64::NAN
    } else {
        s.iter().sum::<f64>() / s.len() as f64
    };
    Summary {
        n: s.len(),
        min: s.first().copied().unwrap_or(f64::NAN),
        median: quantile_sorted(&s, 0.5),
        p90: quantile_sorted(&s, 0.9),
        p99: quantile_sorted(&s, 0.99),
        max: s.last().copied().unwrap_or(f64::NAN),
        mean,
    }
}

/// 101 points: the 0th, 1st, ..., 100th percentile (a CDF to plot).
pub(crate) fn percentiles(v: &[f64]) -> Vec<f64> {
    let s = sorted(v);
    (0..=100)
        .map(|p| quantile_sorted(&s, p as f64 / 100.0))
        .collect()
}

/// Jain's fairness index: 1 when all equal, 1/n when one takes everything.
pub(crate) fn jain(v: &[f64]) -> f64 {
    let sum: f64 = v.iter().sum();
    let sq: f64 = v.iter().map(|x| x * x).sum();
    if sq == 0.0 {
        return f64::NAN;
    }
    sum * sum / (v.len() as f64 * sq)
}

/// Least-squares line `y = a + b x`; returns `(a, b)`.
pub(crate) fn linear_fit(points: &[(f64, f64)]) -> (f64, f64) {
    let n = points.len() as f64;
    if points.len() < 2 {
        return (points.first().map_or(f64::NAN, |p| p.1), f64::NAN);
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = points.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
    let b = if sxx == 0.0 { f64::NAN } else { sxy / sxx };
    (my - b * mx, b)
}

/// `a / b`, or NaN when either is missing or `b` is zero.
pub(crate) fn ratio(a: f64, b: f64) -> f64 {
    if a.is_finite() && b.is_finite() && b != 0.0 {
        a / b
    } else {
        f64::NAN
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_and_fits() {
        let v = [5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(median(&v), 3.0);
        let s = summary(&v);
        assert_eq!((s.min, s.max, s.n), (1.0, 5.0, 5));
        assert!((s.p99 - 4.96).abs() < 1e-9);
        assert_eq!(percentiles(&v)[100], 5.0);
        assert!((jain(&[1.0, 1.0, 1.0]) - 1.0).abs() < 1e-12);
        assert!((jain(&[1.0, 0.0]) - 0.5).abs() < 1e-12);
        let (a, b) = linear_fit(&[(1.0, 2.15), (100.0, 56.6), (1000.0, 551.6)]);
        assert!((b - 0.55).abs() < 1e-3 && (a - 1.6).abs() < 0.1, "{a} {b}");
        assert!(ratio(1.0, 0.0).is_nan());
    }
}
