//! Projections of a few input rows (decoding) on the host with AVX-512: `y = x · Wᵀ` for `m`
//! rows of `x` and an NF4 or bf16 weight `W` `[rows, cols]`, reading the weight once and
//! multiplying it by every input row as it is decoded. Decoding is bound by the bytes of weight
//! read per token, so this is where NF4 (0.56 bytes per weight) beats f32 (4 bytes).
//!
//! - **NF4**: eight bytes hold sixteen 4-bit codes. They are spread to sixteen 32-bit lanes
//!   (each byte twice, the even lane shifted right by four), and `_mm512_permutexvar_ps` looks
//!   all sixteen up at once in the 16-entry code table, which holds one register. The table is
//!   multiplied by the block's absmax once per 64 weights, so each weight is
//!   `table[code] · absmax` exactly as the format defines it ([`crate::nf4::format`]).
//! - **bf16**: sixteen values widen to f32 by a shift of their bits (exact).
//!
//! Output rows are split between threads; each weight row is multiplied by all `m` input rows
//! with independent accumulators. The kernels are compiled for AVX-512 and chosen at run time
//! ([`available`]); callers fall back to the tiled `gemm` kernels of [`crate::nf4::cpu`]
//! otherwise, and for more input rows, where `gemm` is faster (docs/benchmarks.md).

use rayon::prelude::*;

use crate::nf4::format::BLOCK;

/// The most input rows the kernels take.
pub const MAX_ROWS: usize = 8;

/// Whether this CPU runs the kernels (AVX-512 F, detected at run time).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Where the kernel reads weight rows from.
#[derive(Clone, Copy)]
pub enum Weight<'a> {
    /// NF4 codes as little-endian `u32` words (bitsandbytes' bytes), one f32 absmax per block of
    /// 64, and the code table. Needs `cols` to be a multiple of 64.
    Nf4 {
        /// Packed codes.
        words: &'a [u32],
        /// Block scales.
        absmax: &'a [f32],
        /// The 16 code values.
        table: &'a [f32; 16],
    },
    /// Raw bf16 bits, row-major. Needs `cols` to be a multiple of 16.
    Bf16(&'a [u16]),
}

impl Weight<'_> {
    /// Whether the kernel handles rows of `cols` weights.
    pub fn supports(&self, cols: usize) -> bool {
        match self {
            Weight::Nf4 { .. } => cols.is_multiple_of(BLOCK),
            Weight::Bf16(_) => cols.is_multiple_of(16),
        }
    }
}

/// `y = x · Wᵀ` for `x` `[m, cols]` (`1 <= m <= MAX_ROWS`) and `W` `[rows, cols]`; returns
/// `[m, rows]`. `None` when the CPU lacks AVX-512 or the shape is not one the kernel takes
/// (the caller then uses another kernel).
pub fn linear(
    x: &[f32],
    m: usize,
    weight: Weight<'_>,
    rows: usize,
    cols: usize,
) -> Option<Vec<f32>> {
    if !available() || m == 0 || m > MAX_ROWS || !weight.supports(cols) || cols == 0 {
        return None;
    }
    assert_eq!(x.len(), m * cols, "input has the wrong size");
    match weight {
        Weight::Nf4 { words, absmax, .. } => {
            assert!(words.len() * 8 >= rows * cols, "codes are too short");
            assert!(absmax.len() >= rows * cols / BLOCK, "absmax is too short");
        }
        Weight::Bf16(w) => assert_eq!(w.len(), rows * cols, "weight has the wrong size"),
    }
    let mut out = vec![0f32; m * rows];
    // Rows per task: enough work per task to amortise scheduling, several tasks per thread.
    let chunk = (rows / (8 * rayon::current_num_threads().max(1))).clamp(4, 256);
    // Tasks write disjoint output columns; the address crosses threads as an integer.
    let dst = out.as_mut_ptr() as usize;
    (0..rows.div_ceil(chunk)).into_par_iter().for_each(|t| {
        let r0 = t * chunk;
        let r1 = (r0 + chunk).min(rows);
        // SAFETY: AVX-512 F was detected above; the kernel writes out[i * rows + r] for
        // i < m and r in r0..r1 only (rows no other task touches), inside `out`, which lives
        // for the whole call; every weight and input index was bounds-checked above.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            avx512::rows(x, m, weight, r0, r1, rows, cols, dst as *mut f32)
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (r0, r1, dst);
    });
    Some(out)
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{BLOCK, MAX_ROWS, Weight};

    /// Output rows `r0 .. r1` for every input row, written at `dst[i * rows + r]`.
    ///
    /// # Safety
    /// AVX-512 F must be available; `dst` must hold `m * rows` values; the weight must cover
    /// `rows * cols` values and `x` `m * cols`.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn rows(
        x: &[f32],
        m: usize,
        weight: Weight<'_>,
        r0: usize,
        r1: usize,
        rows: usize,
        cols: usize,
        dst: *mut f32,
    ) {
        // One instantiation per row count: the accumulators live in registers.
        macro_rules! dispatch {
            ($($m:literal => $a:literal),*) => {
                match m {
                    $($m => row_range::<$m, $a>(x, weight, r0, r1, rows, cols, dst),)*
                    _ => unreachable!("1 <= m <= {MAX_ROWS}"),
                }
            };
        }
        // SAFETY: forwarded from the caller.
        unsafe { dispatch!(1 => 4, 2 => 4, 3 => 2, 4 => 2, 5 => 1, 6 => 1, 7 => 1, 8 => 1) }
    }

    /// Sixteen NF4 weights `table[code] · absmax` from eight bytes (sixteen codes, the even
    /// element in the high nibble), given the table already scaled by the block's absmax.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn nf4_16(bytes: u64, scaled_table: __m512) -> __m512 {
        // [b0, b0, b1, b1, …, b7, b7] as 32-bit lanes; the even lanes take the high nibble.
        let doubled = _mm_unpacklo_epi8(
            _mm_cvtsi64_si128(bytes as i64),
            _mm_cvtsi64_si128(bytes as i64),
        );
        let lanes = _mm512_cvtepu8_epi32(doubled);
        let shift = _mm512_set_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
        // permutexvar reads the index's low four bits: the odd lanes need no mask.
        _mm512_permutexvar_ps(_mm512_srlv_epi32(lanes, shift), scaled_table)
    }

    /// Sixteen bf16 values widened to f32.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn bf16_16(ptr: *const u16) -> __m512 {
        // SAFETY: the caller passes 16 readable values.
        let raw = unsafe { _mm256_loadu_si256(ptr.cast()) };
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))
    }

    /// `M` input rows, `A` accumulators per input row (independent chains for few rows).
    #[target_feature(enable = "avx512f")]
    unsafe fn row_range<const M: usize, const A: usize>(
        x: &[f32],
        weight: Weight<'_>,
        r0: usize,
        r1: usize,
        rows: usize,
        cols: usize,
        dst: *mut f32,
    ) {
        let xp = x.as_ptr();
        for r in r0..r1 {
            let mut acc = [[_mm512_setzero_ps(); A]; M];
            match weight {
                Weight::Nf4 {
                    words,
                    absmax,
                    table,
                } => {
                    // SAFETY: 16 floats.
                    let table = unsafe { _mm512_loadu_ps(table.as_ptr()) };
                    let bytes = words.as_ptr().cast::<u64>();
                    let first = r * cols / BLOCK;
                    for b in 0..cols / BLOCK {
                        let scaled = _mm512_mul_ps(table, _mm512_set1_ps(absmax[first + b]));
                        for g in 0..4 {
                            // SAFETY: block `first + b` is words 8·(first + b) .. + 8, inside
                            // the codes (checked by the caller); eight bytes per group.
                            let w = unsafe {
                                nf4_16(bytes.add((first + b) * 4 + g).read_unaligned(), scaled)
                            };
                            let c = b * BLOCK + g * 16;
                            for (i, acc) in acc.iter_mut().enumerate() {
                                // SAFETY: row i of x holds `cols` values.
                                let xv = unsafe { _mm512_loadu_ps(xp.add(i * cols + c)) };
                                acc[g % A] = _mm512_fmadd_ps(w, xv, acc[g % A]);
                            }
                        }
                    }
                }
                Weight::Bf16(w) => {
                    let wp = w.as_ptr();
                    for (k, c) in (0..cols).step_by(16).enumerate() {
                        // SAFETY: row r holds `cols` values, a multiple of 16.
                        let wv = unsafe { bf16_16(wp.add(r * cols + c)) };
                        for (i, acc) in acc.iter_mut().enumerate() {
                            // SAFETY: row i of x holds `cols` values.
                            let xv = unsafe { _mm512_loadu_ps(xp.add(i * cols + c)) };
                            acc[k % A] = _mm512_fmadd_ps(wv, xv, acc[k % A]);
                        }
                    }
                }
            }
            for (i, acc) in acc.iter().enumerate() {
                let mut sum = acc[0];
                for a in &acc[1..] {
                    sum = _mm512_add_ps(sum, *a);
                }
                // SAFETY: i < m and r < rows (caller's contract).
                unsafe { *dst.add(i * rows + r) = _mm512_reduce_add_ps(sum) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nf4::cpu::pack_words;
    use crate::nf4::format::{NF4_CODE, dequantize_nf4, quantize_nf4};

    fn check(y: &[f32], x: &[f32], dense: &[f32], m: usize, rows: usize, cols: usize) {
        for i in 0..m {
            for r in 0..rows {
                let terms = (0..cols).map(|c| x[i * cols + c] * dense[r * cols + c]);
                let want: f32 = terms.clone().sum();
                let scale = terms.map(f32::abs).sum::<f32>().max(1.0);
                let got = y[i * rows + r];
                assert!(
                    (got - want).abs() < 1e-5 * scale,
                    "m={m} [{i},{r}]: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn nf4_and_bf16_kernels_match_the_dequantized_product() {
        if !available() {
            eprintln!("no AVX-512 on this CPU: the kernels are not used, nothing to compare");
            return;
        }
        let (rows, cols) = (37, 192);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * (1.0 + (i / 64) as f32 * 0.01))
            .collect();
        let q = quantize_nf4(&w);
        let words = pack_words(&q.packed);
        let dense = dequantize_nf4(&q.packed, &q.absmax, rows * cols);
        let bf16: Vec<u16> = w
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_bits())
            .collect();
        let widened: Vec<f32> = bf16
            .iter()
            .map(|b| half::bf16::from_bits(*b).to_f32())
            .collect();
        for m in 1..=MAX_ROWS {
            let x: Vec<f32> = (0..m * cols)
                .map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0)
                .collect();
            let nf4 = Weight::Nf4 {
                words: &words,
                absmax: &q.absmax,
                table: &NF4_CODE,
            };
            check(
                &linear(&x, m, nf4, rows, cols).unwrap(),
                &x,
                &dense,
                m,
                rows,
                cols,
            );
            let y = linear(&x, m, Weight::Bf16(&bf16), rows, cols).unwrap();
            check(&y, &x, &widened, m, rows, cols);
        }
    }

    #[test]
    fn unsupported_shapes_are_declined() {
        let words = [0u32; 16];
        let absmax = [1.0f32; 2];
        let nf4 = Weight::Nf4 {
            words: &words,
            absmax: &absmax,
            table: &NF4_CODE,
        };
        assert!(
            linear(&[0.0; 100], 1, nf4, 1, 100).is_none(),
            "cols not a multiple of 64"
        );
        assert!(
            linear(&[0.0; 64 * 9], 9, nf4, 1, 64).is_none(),
            "too many rows"
        );
    }
}
