//! bf16 matrix products on Intel AMX (Sapphire Rapids and later Xeons): the
//! products of a model computing in bf16 on the CPU. Each `tdpbf16ps` adds a
//! 16×32 by 32×16 bf16 product into a 16×16 f32 tile, sixteen times the
//! FLOPs of an AVX-512 FMA per cycle, so bf16 products run an order of
//! magnitude faster than candle's bf16 matmul (docs/PERFORMANCE.md). Sums are
//! f32 over the whole depth and rounded to bf16 once, as PyTorch's bf16
//! matmul on the same hardware (oneDNN) does.
//!
//! B is packed per call into VNNI tiles (16 rows of 16 column pairs); A's
//! tiles are loaded in place from whole rows, and only blocks at an edge (or
//! of a strided A) are packed, zero-padded to whole tiles, so any shape and
//! stride works. The tile instructions are written with `asm!` (their
//! intrinsics are not stable Rust).

use std::arch::asm;
use std::mem::MaybeUninit;

use ::half::bf16;
use rayon::prelude::*;

/// Depth of one tile product: 32 bf16 (64 bytes a tile row).
const KT: usize = 32;
/// Rows and columns of a tile.
const T: usize = 16;
/// Rows of a register block (two A tiles) and columns (two B tiles).
const RB: usize = 2 * T;
/// Row blocks (of RB rows) per task: their A rows (RB·k bf16 each) stay in
/// L2 while a column pair's B tiles are reused across them.
const ROW_BLOCKS: usize = 4;
/// Column pairs per task: its sums (ROW_BLOCKS × PAIRS blocks of 4 KiB) stay in L2.
const PAIRS: usize = 8;
/// Depth steps per pass over a task's blocks: one column pair's B tiles
/// for them (2 KiB a step) stay in L1 while the row blocks pass.
const DEPTH_STEPS: usize = 16;

/// Whether this CPU and OS can run the kernels: AMX-TILE and AMX-BF16
/// (cpuid), and Linux's permission for the tile data (asked for once, for
/// the whole process).
pub(crate) fn available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            // SAFETY: cpuid leaf 7 exists on every x86-64 CPU this checks further.
            #[allow(unused_unsafe)]
            let leaf7 = unsafe { std::arch::x86_64::__cpuid_count(7, 0) };
            let (amx_bf16, amx_tile) = (leaf7.edx & (1 << 22) != 0, leaf7.edx & (1 << 24) != 0);
            if !(amx_bf16 && amx_tile && is_x86_feature_detected!("avx512f")) {
                return false;
            }
            // ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA (arch/x86/include/uapi/asm/prctl.h).
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: a plain syscall with integer arguments.
            unsafe {
                libc::syscall(
                    libc::SYS_arch_prctl,
                    ARCH_REQ_XCOMP_PERM,
                    XFEATURE_XTILEDATA,
                ) == 0
            }
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        false
    })
}

/// The tile configuration (palette 1): eight tiles of 16 rows × 64 bytes.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

const CONFIG: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    colsb: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

/// An operand of bf16 values: element (i, j) at `ptr + i·rs + j·cs`.
#[derive(Clone, Copy)]
pub(crate) struct Operand {
    pub ptr: *const bf16,
    pub rs: usize,
    pub cs: usize,
}

// SAFETY: only read, inside `gemm`, whose contract keeps them valid.
unsafe impl Send for Operand {}
unsafe impl Sync for Operand {}

/// dst [m, n] (bf16, row-major, written, never read) = a [m, k] · b [k, n],
/// summed in f32 and rounded to bf16 once.
///
/// # Safety
/// The operands must address m×k and k×n valid elements, dst must hold m·n
/// writable elements overlapping neither, and [`available`] must be true.
pub(crate) unsafe fn gemm(
    (m, n, k): (usize, usize, usize),
    a: Operand,
    b: Operand,
    dst: &mut [MaybeUninit<bf16>],
) {
    assert!(dst.len() >= m * n);
    if m == 0 || n == 0 {
        return;
    }
    let steps = k.div_ceil(KT).max(1);
    let pairs = n.div_ceil(RB);
    // B: per column pair, per depth step, two VNNI tiles (16 rows of 16
    // columns × 2 depths): element (kk, j) at row kk/2, column j, half kk%2.
    let per_pair = steps * 2 * T * KT;
    let mut bp = Vec::<u16>::with_capacity(pairs * per_pair);
    bp.spare_capacity_mut()[..pairs * per_pair]
        .par_chunks_mut(per_pair)
        .enumerate()
        .for_each(|(p, panel)| pack_b(panel, b, (p * RB, n, k)));
    // SAFETY: pack_b wrote every element of each panel.
    unsafe { bp.set_len(pairs * per_pair) };
    let blocks = m.div_ceil(RB);
    let groups = blocks.div_ceil(ROW_BLOCKS);
    let chunks = pairs.div_ceil(PAIRS);
    // Rows read in place: whole depth steps, contiguous rows.
    let direct = k % KT == 0 && a.cs == 1;
    let out = OutPtr(dst.as_mut_ptr().cast());
    (0..groups * chunks).into_par_iter().for_each(|task| {
        let (g, ch) = (task / chunks, task % chunks);
        let first = g * ROW_BLOCKS;
        let count = ROW_BLOCKS.min(blocks - first);
        let (p0, np) = (ch * PAIRS, PAIRS.min(pairs - ch * PAIRS));
        // Row blocks that are not whole tiles of a are packed (zeros past m and k).
        let whole = |blk: usize| direct && (first + blk + 1) * RB <= m;
        let mut ap = vec![0u16; (0..count).filter(|&b| !whole(b)).count() * steps * RB * KT];
        let mut packed = 0;
        // Per row block: (A's first row tile, its second, elements per step, bytes per row).
        let a_tiles: Vec<(*const u16, *const u16, usize, usize)> = (0..count)
            .map(|blk| {
                let i0 = (first + blk) * RB;
                if whole(blk) {
                    // SAFETY: rows i0..i0 + RB < m of a.
                    let p = unsafe { a.ptr.add(i0 * a.rs) }.cast::<u16>();
                    (p, p.wrapping_add(T * a.rs), KT, 2 * a.rs)
                } else {
                    let part = &mut ap[packed * steps * RB * KT..(packed + 1) * steps * RB * KT];
                    pack_a(part, a, (i0, m, k));
                    packed += 1;
                    let p = part.as_ptr();
                    (p, p.wrapping_add(T * KT), RB * KT, 2 * KT)
                }
            })
            .collect();
        // The task's sums: per row block and column pair, an RB × RB f32 block.
        let mut c = vec![0f32; count * np * RB * RB];
        // SAFETY: the tiles are configured on this thread for this task; the
        // operands hold `steps` depth steps of whole tiles; rows first·RB..
        // and column pairs p0.. of dst belong to this task.
        unsafe {
            asm!("ldtilecfg [{}]", in(reg) &CONFIG as *const TileConfig, options(nostack));
            for s0 in (0..steps).step_by(DEPTH_STEPS) {
                let ds = DEPTH_STEPS.min(steps - s0);
                for p in 0..np {
                    let bt = bp.as_ptr().add((p0 + p) * per_pair + s0 * 2 * T * KT);
                    for (blk, &(a0, a1, step, stride)) in a_tiles.iter().enumerate() {
                        let cb = c.as_mut_ptr().add((blk * np + p) * RB * RB);
                        let off = s0 * step;
                        block(ds, (a0.add(off), a1.add(off), step, stride), bt, cb, s0 > 0);
                    }
                }
            }
            asm!("tilerelease", options(nostack));
            for blk in 0..count {
                let i0 = (first + blk) * RB;
                for p in 0..np {
                    let j0 = (p0 + p) * RB;
                    let cb = &c[(blk * np + p) * RB * RB..][..RB * RB];
                    for (r, row) in cb.chunks_exact(RB).take(RB.min(m - i0)).enumerate() {
                        let d = out.at((i0 + r) * n + j0);
                        for (s, &v) in row.iter().take(RB.min(n - j0)).enumerate() {
                            *d.add(s) = bf16::from_f32(v);
                        }
                    }
                }
            }
        }
    });
}

/// The output pointer shared by tasks that write disjoint rows.
#[derive(Clone, Copy)]
struct OutPtr(*mut bf16);
// SAFETY: each task writes its own rows.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Element i (a method, so closures capture the Send wrapper, not its field).
    ///
    /// # Safety
    /// i must be inside the output.
    unsafe fn at(self, i: usize) -> *mut bf16 {
        // SAFETY: the caller's contract.
        unsafe { self.0.add(i) }
    }
}

/// One RB × RB block over `steps` depth steps into `c` (f32, rows RB
/// apart), added to c's sums when `accumulate`: tiles 0–3 accumulate, 4–5
/// hold A's two row tiles, 6–7 B's two column tiles. A's tiles are
/// (first, second, elements per step, bytes per row).
///
/// # Safety
/// The tiles must be configured; A's tiles and `b` must hold `steps` depth
/// steps (two 16 × 32 bf16 tiles each).
#[inline]
unsafe fn block(
    steps: usize,
    (a0, a1, a_step, a_stride): (*const u16, *const u16, usize, usize),
    b: *const u16,
    c: *mut f32,
    accumulate: bool,
) {
    // Bytes per row of a B tile and of c.
    let (row, cs) = (2 * KT, RB * 4);
    // SAFETY: the caller's contract; every tile load reads 16 rows of 64 bytes.
    unsafe {
        if accumulate {
            asm!(
                "tileloadd tmm0, [{c0} + {st}*1]",
                "tileloadd tmm1, [{c1} + {st}*1]",
                "tileloadd tmm2, [{c2} + {st}*1]",
                "tileloadd tmm3, [{c3} + {st}*1]",
                c0 = in(reg) c,
                c1 = in(reg) c.add(T),
                c2 = in(reg) c.add(T * RB),
                c3 = in(reg) c.add(T * RB + T),
                st = in(reg) cs,
                options(nostack)
            );
        } else {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack)
            );
        }
        for s in 0..steps {
            let tb = b.add(s * 2 * T * KT);
            asm!(
                // Each load just before its first product: tile loads
                // overlap the products only so (docs/PERFORMANCE.md).
                "tileloadd tmm4, [{a0} + {sa}*1]",
                "tileloadd tmm6, [{b0} + {st}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tileloadd tmm7, [{b1} + {st}*1]",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm5, [{a1} + {sa}*1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a0 = in(reg) a0.add(s * a_step),
                a1 = in(reg) a1.add(s * a_step),
                sa = in(reg) a_stride,
                b0 = in(reg) tb,
                b1 = in(reg) tb.add(T * KT),
                st = in(reg) row,
                options(nostack)
            );
        }
        asm!(
            "tilestored [{c0} + {st}*1], tmm0",
            "tilestored [{c1} + {st}*1], tmm1",
            "tilestored [{c2} + {st}*1], tmm2",
            "tilestored [{c3} + {st}*1], tmm3",
            c0 = in(reg) c,
            c1 = in(reg) c.add(T),
            c2 = in(reg) c.add(T * RB),
            c3 = in(reg) c.add(T * RB + T),
            st = in(reg) cs,
            options(nostack)
        );
    }
}

/// Rows i0..i0 + RB of a (zeros past m) as `steps` pairs of A tiles:
/// element (r, kk) of step s at s·RB·KT + r·KT + kk%KT.
fn pack_a(part: &mut [u16], a: Operand, (i0, m, k): (usize, usize, usize)) {
    for r in 0..RB.min(m - i0) {
        for kk in 0..k {
            // SAFETY: row i0 + r < m, column kk < k of a.
            let v = unsafe { *a.ptr.add((i0 + r) * a.rs + kk * a.cs) };
            part[(kk / KT) * RB * KT + r * KT + kk % KT] = v.to_bits();
        }
    }
}

/// Columns j0..j0 + RB of b (zeros past n and k) as the panel's depth steps
/// of two VNNI B tiles: element (kk, j) of step s, tile t at
/// (s·2 + t)·T·KT + (kk%KT / 2)·KT + (j % T)·2 + kk % 2. Every element is written.
fn pack_b(panel: &mut [MaybeUninit<u16>], b: Operand, (j0, n, k): (usize, usize, usize)) {
    let steps = panel.len() / (2 * T * KT);
    if b.cs == 1 && j0 + RB <= n {
        // SAFETY: rows < k, columns j0..j0 + RB ≤ n of b; `available` (the
        // caller's contract) implies AVX-512F.
        return unsafe { pack_b_rows(panel, b, j0, k, steps) };
    }
    for s in 0..steps {
        for t in 0..2 {
            for r in 0..T {
                for c in 0..T {
                    for e in 0..2 {
                        let (kk, j) = (s * KT + 2 * r + e, j0 + t * T + c);
                        let v = if kk < k && j < n {
                            // SAFETY: row kk < k, column j < n of b.
                            unsafe { *b.ptr.add(kk * b.rs + j * b.cs) }.to_bits()
                        } else {
                            0
                        };
                        panel[(s * 2 + t) * T * KT + r * KT + c * 2 + e].write(v);
                    }
                }
            }
        }
    }
}

/// [`pack_b`] for rows of b with contiguous columns (the weights as the
/// Intel layout keeps them): a tile row is two rows of b interleaved, each
/// 16 bf16 widened to 32 bits, the second shifted into the high halves.
///
/// # Safety
/// b's rows < k must hold columns j0..j0 + RB; the CPU must have AVX-512F.
#[target_feature(enable = "avx512f")]
unsafe fn pack_b_rows(
    panel: &mut [MaybeUninit<u16>],
    b: Operand,
    j0: usize,
    k: usize,
    steps: usize,
) {
    use std::arch::x86_64::*;
    let out = panel.as_mut_ptr().cast::<u16>();
    let row = |kk: usize, t: usize| {
        if kk < k {
            // SAFETY: row kk < k, columns j0 + t·T.. + 16 ≤ j0 + RB of b.
            unsafe {
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(b.ptr.add(kk * b.rs + j0 + t * T).cast()))
            }
        } else {
            _mm512_setzero_si512()
        }
    };
    for s in 0..steps {
        for t in 0..2 {
            for r in 0..T {
                let kk = s * KT + 2 * r;
                let v = _mm512_or_si512(row(kk, t), _mm512_slli_epi32::<16>(row(kk + 1, t)));
                // SAFETY: 32 u16 of step s, tile t, row r: inside the panel.
                unsafe { _mm512_storeu_si512(out.add((s * 2 + t) * T * KT + r * KT).cast(), v) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Products of several shapes (tile and block edges, both layouts of b)
    /// against f64 sums of the same bf16 values: within the f32 sum's and
    /// the final bf16 rounding's error.
    #[test]
    fn products_match_f64_sums_of_the_bf16_values() {
        if !available() {
            eprintln!("no AMX here: skipped");
            return;
        }
        for (m, n, k) in [
            (1, 1, 1),
            (17, 33, 31),
            (32, 32, 64),
            (130, 70, 100),
            // Whole 32-row blocks read in place beside an edge block packed.
            (40, 70, 96),
            (300, 45, 777),
        ] {
            for transposed in [false, true] {
                let val = |i: usize, salt: f32| {
                    bf16::from_f32(((i as f32 * 0.754_877_7 + salt).fract() - 0.5) * 3.0)
                };
                let a: Vec<bf16> = (0..m * k).map(|i| val(i, 0.1)).collect();
                let b: Vec<bf16> = (0..k * n).map(|i| val(i, 0.6)).collect();
                let bop = if transposed {
                    Operand {
                        ptr: b.as_ptr(),
                        rs: 1,
                        cs: k,
                    }
                } else {
                    Operand {
                        ptr: b.as_ptr(),
                        rs: n,
                        cs: 1,
                    }
                };
                let mut out = vec![MaybeUninit::<bf16>::uninit(); m * n];
                // SAFETY: the operands cover m×k and k×n elements; AMX checked above.
                unsafe {
                    gemm(
                        (m, n, k),
                        Operand {
                            ptr: a.as_ptr(),
                            rs: k,
                            cs: 1,
                        },
                        bop,
                        &mut out,
                    )
                };
                for i in 0..m {
                    for j in 0..n {
                        let (mut want, mut size) = (0f64, 0f64);
                        for p in 0..k {
                            let bv = if transposed {
                                b[j * k + p]
                            } else {
                                b[p * n + j]
                            };
                            let t = a[i * k + p].to_f64() * bv.to_f64();
                            want += t;
                            size += t.abs();
                        }
                        // SAFETY: gemm wrote every element.
                        let got = unsafe { out[i * n + j].assume_init() }.to_f64();
                        let tol = want.abs() / 256.0 + 1e-6 * size.max(1.0);
                        assert!(
                            (got - want).abs() <= tol,
                            "{m}×{n}×{k} t={transposed} ({i}, {j}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
