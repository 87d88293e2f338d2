//! Scalar erf, exp and GELU written branch-free, so the row loops that call
//! them vectorise instead of calling libm once per element. Each comes in two
//! forms: `FMA = true` for loops compiled with the fma feature (the x86-64 v3
//! and v4 paths, where `mul_add` is one instruction and a third of the
//! arithmetic goes), `false` with plain `*`/`+` for the portable path (where
//! `mul_add` is a libm call). The two differ by rounding only.

/// a·b + c: fused (one rounding) when `FMA`, else two roundings.
#[inline(always)]
pub(crate) fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// erf(x) for f32 as a clamped odd rational function (max abs error ≈ 3e-7
/// on all of R, checked in the tests), branch-free so it vectorises.
#[inline(always)]
pub(crate) fn erf_f32_with<const FMA: bool>(x: f32) -> f32 {
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = -2.726_142_3e-10_f32;
    for c in [
        2.770_681_4e-8,
        -2.101_024e-6,
        -5.692_506_4e-5,
        -7.349_906_3e-4,
        -2.954_600_3e-3,
        -1.609_603_3e-2,
    ] {
        p = madd::<FMA>(p, x2, c);
    }
    let mut q = -1.456_607_2e-5_f32;
    for c in [-2.133_740_6e-4, -1.682_827e-3, -7.373_329e-3, -1.426_474e-2] {
        q = madd::<FMA>(q, x2, c);
    }
    x * p / q
}

/// ln 2 = LN2_HI + LN2_LO, the first exact in few bits, so that x − n·ln 2
/// loses nothing to rounding for the n of f32's range (Cephes' `expf`).
pub(crate) const LN2_HI: f32 = 0.693_359_4;
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes' `expf` polynomial for e^r on |r| ≤ ln 2 / 2, highest power first:
/// e^r ≈ 1 + r + r²·P(r).
pub(crate) const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// eˣ for f32 (Cephes' `expf` reduction and polynomial, ≈1 ulp), branch-free
/// so softmax rows vectorise instead of calling libm per element. Inputs are
/// clamped to [−87, 88]: below, the result is ~1e-38 rather than 0.
#[inline(always)]
pub(crate) fn exp_f32_with<const FMA: bool>(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    // Round x·log2(e) to the nearest integer n with the 1.5·2²³ trick: the
    // sum's low mantissa bits then hold n itself, so 2ⁿ is built with integer
    // ops on those bits (a float→int cast would not vectorise).
    let shifted = madd::<FMA>(x, std::f32::consts::LOG2_E, 12_582_912.0);
    let n = shifted - 12_582_912.0;
    let r = madd::<FMA>(n, -LN2_LO, madd::<FMA>(n, -LN2_HI, x));
    let mut p = EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        p = madd::<FMA>(p, r, *c);
    }
    let e = madd::<FMA>(p * r, r, r) + 1.0;
    e * f32::from_bits(shifted.to_bits().wrapping_sub(0x4B40_0000 - 127) << 23)
}

/// [`exp_f32_with`] in plain arithmetic.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    exp_f32_with::<false>(x)
}

/// Exact (erf) GELU.
#[inline(always)]
pub(crate) fn gelu_erf_f32_with<const FMA: bool>(x: f32) -> f32 {
    let (h, e) = (
        0.5 * x,
        erf_f32_with::<FMA>(x * std::f32::consts::FRAC_1_SQRT_2),
    );
    if FMA {
        h.mul_add(e, h)
    } else {
        h * (1.0 + e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// erf by its Taylor series in f64 (accurate to ~1e-9 for |x| ≤ 4.5) and 1 beyond.
    fn erf_ref(x: f64) -> f64 {
        if x.abs() > 4.5 {
            return x.signum();
        }
        let (mut term, mut sum, mut n) = (x, x, 0.0);
        while term.abs() > 1e-17 {
            n += 1.0;
            term *= -x * x / n;
            sum += term / (2.0 * n + 1.0);
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }

    /// Both forms, fused and plain (here `mul_add` is a libm call, which
    /// rounds once as the instruction does).
    #[test]
    fn erf_is_accurate() {
        for erf in [erf_f32_with::<false>, erf_f32_with::<true>] {
            let mut worst = 0f64;
            for i in -6000..=6000 {
                let x = i as f64 / 1000.0;
                worst = worst.max((erf(x as f32) as f64 - erf_ref(x)).abs());
            }
            assert!(worst < 5e-7, "max |erf error| {worst}");
        }
    }

    #[test]
    fn exp_is_accurate() {
        for exp in [exp_f32_with::<false>, exp_f32_with::<true>] {
            let mut worst = 0f64;
            for i in -87_000..=88_000 {
                let x = i as f64 / 1000.0;
                let e = (x as f32) as f64;
                worst = worst.max((exp(x as f32) as f64 / e.exp() - 1.0).abs());
            }
            assert!(worst < 3e-7, "max relative exp error {worst}");
        }
    }

    /// GELU(x) = x·Φ(x) against f64, in both forms.
    #[test]
    fn gelu_is_accurate() {
        for gelu in [gelu_erf_f32_with::<false>, gelu_erf_f32_with::<true>] {
            let mut worst = 0f64;
            for i in -8000..=8000 {
                let x = i as f64 / 1000.0;
                let want = 0.5 * x * (1.0 + erf_ref(x / std::f64::consts::SQRT_2));
                worst = worst.max((gelu(x as f32) as f64 - want).abs() / x.abs().max(1.0));
            }
            assert!(worst < 1e-6, "max GELU error {worst}");
        }
    }
}
