//! How much a sample of eval items can tell: the intervals of top-1 agreement and of
//! its change between two models on the same items. (The data itself, the user's or
//! the shipped samples, is read by [`tokenformer::source::data`].)

/// What a sample of `n` items with `agree` top-1 agreements can tell: the 95 %
/// Wilson interval of the agreement.
pub fn agreement_interval(agree: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let (z, nf) = (1.959_963_984_540_054_f64, n as f64);
    let p = agree as f64 / nf;
    let denom = 1.0 + z * z / nf;
    let centre = (p + z * z / (2.0 * nf)) / denom;
    let half = z * (p * (1.0 - p) / nf + z * z / (4.0 * nf * nf)).sqrt() / denom;
    ((centre - half).max(0.0), (centre + half).min(1.0))
}

/// The 95 % interval of the change in agreement between two models measured on
/// the same `n` items (paired outcomes): `both` items where both agree with the
/// source, `new_only` where only the new one does, `old_only` where only the old
/// one does, the rest neither. Newcombe's hybrid score interval for a difference
/// of paired proportions (Statistics in Medicine 17, 1998, method 10): it combines
/// the two Wilson intervals with the correlation φ of the paired outcomes, and
/// unlike the Wald interval stays sensible with few items or few discordant pairs.
pub fn change_interval(both: usize, new_only: usize, old_only: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (-1.0, 1.0);
    }
    let neither = n - both - new_only - old_only;
    let (p1, p2) = (
        (both + new_only) as f64 / n as f64,
        (both + old_only) as f64 / n as f64,
    );
    let ((l1, u1), (l2, u2)) = (
        agreement_interval(both + new_only, n),
        agreement_interval(both + old_only, n),
    );
    let (a, b, c, d) = (
        both as f64,
        new_only as f64,
        old_only as f64,
        neither as f64,
    );
    let denom = ((a + b) * (c + d) * (a + c) * (b + d)).sqrt();
    let phi = if denom > 0.0 {
        (a * d - b * c) / denom
    } else {
        0.0
    };
    let theta = p1 - p2;
    let delta = ((p1 - l1).powi(2) - 2.0 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2).powi(2))
        .max(0.0)
        .sqrt();
    let eps = ((u1 - p1).powi(2) - 2.0 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2).powi(2))
        .max(0.0)
        .sqrt();
    ((theta - delta).max(-1.0), (theta + eps).min(1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_paired_change_interval() {
        // Agresti's approval ratings (Categorical Data Analysis, 10.1): 794 both,
        // 150 and 86 discordant, 1600 in all; a change of 0.04 whose Wald interval,
        // 0.04 ± 1.96·√((150 + 86) − 64²/1600)/1600, the score interval must be
        // close to at this size.
        let (lo, hi) = change_interval(794, 150, 86, 1600);
        let half = 1.959_964 * (236.0f64 - 64.0 * 64.0 / 1600.0).sqrt() / 1600.0;
        assert!(lo < 0.04 && hi > 0.04);
        assert!(
            (lo - (0.04 - half)).abs() < 2e-3 && (hi - (0.04 + half)).abs() < 2e-3,
            "{lo} {hi}"
        );
        // No discordant pair: no change, an interval around 0 that shrinks with n.
        let (lo, hi) = change_interval(6, 0, 0, 8);
        assert!(lo < 0.0 && hi > 0.0 && hi - lo < 0.7, "{lo} {hi}");
        let (lo2, hi2) = change_interval(600, 0, 0, 800);
        assert!(
            lo2 < 0.0 && hi2 > 0.0 && hi2 - lo2 < (hi - lo) / 5.0,
            "{lo2} {hi2}"
        );
        // All discordant one way: a large change, within [−1, 1].
        let (lo, hi) = change_interval(0, 20, 0, 20);
        assert!(lo > 0.5 && hi == 1.0, "{lo} {hi}");
        assert_eq!(change_interval(0, 0, 0, 0), (-1.0, 1.0));
    }

    #[test]
    fn wilson_interval_matches_the_formula() {
        // 8 of 16: centre 0.5, half-width 1.96·sqrt(0.25/16 + 1.96²/(4·256)) / (1 + 1.96²/16).
        let (lo, hi) = agreement_interval(8, 16);
        assert!(
            (lo - 0.2800).abs() < 1e-3 && (hi - 0.7200).abs() < 1e-3,
            "{lo} {hi}"
        );
        let (lo, hi) = agreement_interval(16, 16);
        assert!(
            (lo - 0.8064).abs() < 1e-3 && (hi - 1.0).abs() < 1e-12,
            "{lo} {hi}"
        );
    }
}
