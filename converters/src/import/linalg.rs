//! Dense f64 linear algebra for the value fit (`fit.rs`): a Cholesky
//! factorisation and its triangular solves on row-major matrices, written here
//! because nothing in the workspace factorises matrices and the sizes are modest
//! (n up to a few thousand tokens). Both are blocked so that almost all the work is
//! matrix products, done by candle's f64 gemm (multi-threaded, cache-blocked);
//! only the small diagonal blocks are done element by element.

use anyhow::{bail, ensure, Result};
use candle_core::{Device, Tensor};

/// Rows and columns of the diagonal blocks.
const BLOCK: usize = 128;

/// a [r, k] · b [k, c], row-major, by candle's gemm.
pub fn matmul(a: &[f64], (r, k): (usize, usize), b: &[f64], c: usize) -> Result<Vec<f64>> {
    let ta = Tensor::from_slice(a, (r, k), &Device::Cpu)?;
    let tb = Tensor::from_slice(b, (k, c), &Device::Cpu)?;
    Ok(ta.matmul(&tb)?.flatten_all()?.to_vec1()?)
}

/// Σ aᵢbᵢ in eight independent sums, which the compiler can keep in vector
/// registers (one running sum cannot be reordered, so it would stay scalar).
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut acc = [0.0; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f64 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    acc.iter().sum::<f64>() + tail
}

/// Columns `cols` of rows `rows` of m [_, n], copied out row-major.
fn block(
    m: &[f64],
    n: usize,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
) -> Vec<f64> {
    rows.flat_map(|r| m[r * n + cols.start..r * n + cols.end].iter().copied())
        .collect()
}

/// The lower Cholesky factor L of a symmetric positive definite m [n, n]
/// (row-major), in place (L Lᵀ = m; above the diagonal is left undefined).
/// Right-looking by blocks: factor a diagonal block, solve the panel below it,
/// subtract the panel's outer product from the rest (a gemm).
pub fn cholesky(m: &mut [f64], n: usize) -> Result<()> {
    ensure!(
        m.len() == n * n,
        "cholesky: {} entries for n = {n}",
        m.len()
    );
    for k0 in (0..n).step_by(BLOCK) {
        let k1 = (k0 + BLOCK).min(n);
        // The diagonal block, and the panel below it, row by row: every inner
        // product runs over two contiguous row segments of this block's columns.
        for i in k0..n {
            for j in k0..k1.min(i + 1) {
                let (done, row_i) = m.split_at_mut(i * n);
                let row_j: &[f64] = if j < i {
                    &done[j * n + k0..j * n + j]
                } else {
                    &row_i[k0..j]
                };
                let s = row_i[j] - dot(&row_i[k0..j], row_j);
                if j == i {
                    if s.is_nan() || s <= 0.0 || s.is_infinite() {
                        bail!("the fit's normal equations are not positive definite (pivot {i} of {n} is {s:e}): are the calibration activations finite?");
                    }
                    row_i[i] = s.sqrt();
                } else {
                    row_i[j] = s / done[j * n + j];
                }
            }
        }
        if k1 < n {
            let rest = n - k1;
            let panel = block(m, n, k1..n, k0..k1);
            let t = Tensor::from_vec(panel, (rest, k1 - k0), &Device::Cpu)?;
            let outer: Vec<f64> = t.matmul(&t.t()?)?.flatten_all()?.to_vec1()?;
            for i in 0..rest {
                let row = &mut m[(k1 + i) * n + k1..(k1 + i) * n + k1 + i + 1];
                for (x, u) in row.iter_mut().zip(&outer[i * rest..i * rest + i + 1]) {
                    *x -= u;
                }
            }
        }
    }
    Ok(())
}

/// Solves L Lᵀ X = B in place, B [n, cols] row-major, L from [`cholesky`].
pub fn cholesky_solve(l: &[f64], n: usize, b: &mut [f64], cols: usize) -> Result<()> {
    ensure!(
        b.len() == n * cols,
        "cholesky_solve: B is not [{n}, {cols}]"
    );
    // L Z = B, by blocks: B_k −= L_k,<k · Z_<k, then the block's own rows:
    // Z_i = (B_i − Σ_{k0≤j<i} L_ij Z_j) / L_ii.
    for k0 in (0..n).step_by(BLOCK) {
        let k1 = (k0 + BLOCK).min(n);
        if k0 > 0 {
            let lk = block(l, n, k0..k1, 0..k0);
            let upd = matmul(&lk, (k1 - k0, k0), &b[..k0 * cols], cols)?;
            for (x, u) in b[k0 * cols..k1 * cols].iter_mut().zip(&upd) {
                *x -= u;
            }
        }
        for i in k0..k1 {
            let (done, rest) = b.split_at_mut(i * cols);
            let row = &mut rest[..cols];
            for j in k0..i {
                let lij = l[i * n + j];
                for (x, z) in row.iter_mut().zip(&done[j * cols..(j + 1) * cols]) {
                    *x -= lij * z;
                }
            }
            let d = l[i * n + i];
            row.iter_mut().for_each(|x| *x /= d);
        }
    }
    // Lᵀ X = Z, by blocks from the last: Z_k −= (L_>k,k)ᵀ · X_>k, then
    // X_i = (Z_i − Σ_{i<j<k1} L_ji X_j) / L_ii from the block's last row.
    let starts: Vec<usize> = (0..n).step_by(BLOCK).collect();
    for &k0 in starts.iter().rev() {
        let k1 = (k0 + BLOCK).min(n);
        if k1 < n {
            // (L_>k,k)ᵀ [kb, rest], copied out transposed.
            let kb = k1 - k0;
            let rest = n - k1;
            let mut lt = vec![0.0; kb * rest];
            for r in 0..rest {
                for c in 0..kb {
                    lt[c * rest + r] = l[(k1 + r) * n + k0 + c];
                }
            }
            let upd = matmul(&lt, (kb, rest), &b[k1 * cols..], cols)?;
            for (x, u) in b[k0 * cols..k1 * cols].iter_mut().zip(&upd) {
                *x -= u;
            }
        }
        for i in (k0..k1).rev() {
            let (head, tail) = b.split_at_mut((i + 1) * cols);
            let row = &mut head[i * cols..];
            for j in i + 1..k1 {
                let lji = l[j * n + i];
                let xj = &tail[(j - i - 1) * cols..(j - i) * cols];
                for (x, z) in row.iter_mut().zip(xj) {
                    *x -= lji * z;
                }
            }
            let d = l[i * n + i];
            row.iter_mut().for_each(|x| *x /= d);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A symmetric positive definite [n, n] and its product with X [n, c].
    fn system(n: usize, c: usize) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let f = |i: usize, s: f64| ((i as f64 * 0.754_877_666 + s).fract() - 0.5) * 2.0;
        let a: Vec<f64> = (0..n * n).map(|i| f(i, 0.1)).collect();
        // m = a·aᵀ/n + I.
        let at: Vec<f64> = (0..n * n).map(|i| a[(i % n) * n + i / n]).collect();
        let mut m = matmul(&a, (n, n), &at, n).unwrap();
        for i in 0..n {
            for j in 0..n {
                m[i * n + j] /= n as f64;
            }
            m[i * n + i] += 1.0;
        }
        let x: Vec<f64> = (0..n * c).map(|i| f(i, 0.6)).collect();
        let b = matmul(&m, (n, n), &x, c).unwrap();
        (m, x, b)
    }

    #[test]
    fn blocked_cholesky_and_solves_recover_x_across_block_edges() {
        // Sizes below, at and across the block size.
        for n in [1, 7, BLOCK, BLOCK + 1, 2 * BLOCK + 37] {
            let (m, x, mut b) = system(n, 3);
            let mut l = m.clone();
            cholesky(&mut l, n).unwrap();
            // L Lᵀ = m on and below the diagonal.
            for i in 0..n {
                for j in 0..=i {
                    let s: f64 = (0..=j).map(|k| l[i * n + k] * l[j * n + k]).sum();
                    assert!((s - m[i * n + j]).abs() < 1e-10, "n {n} ({i}, {j})");
                }
            }
            cholesky_solve(&l, n, &mut b, 3).unwrap();
            for (g, w) in b.iter().zip(&x) {
                assert!((g - w).abs() < 1e-9, "n {n}: {g} vs {w}");
            }
        }
    }

    #[test]
    fn cholesky_factors_and_refuses_what_is_not_positive_definite() {
        let mut m = vec![4.0, 2.0, 2.0, 3.0];
        cholesky(&mut m, 2).unwrap();
        assert_eq!([m[0], m[2], m[3]], [2.0, 1.0, 2f64.sqrt()]);
        let mut bad = vec![1.0, 2.0, 2.0, 1.0];
        let e = cholesky(&mut bad, 2).unwrap_err().to_string();
        assert!(e.contains("not positive definite"), "{e}");
        assert!(cholesky(&mut [f64::NAN], 1).is_err());
        assert!(cholesky(&mut [1.0; 3], 2).is_err());
    }
}
