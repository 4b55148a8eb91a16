//! Projections of a few input rows (decoding) on the host with AVX-512 or AVX2: `y = x · Wᵀ`
//! for `m` rows of `x` and an NF4, bf16, f32 or block-copy weight `W` `[rows, cols]`, reading
//! the weight once and multiplying it by every input row as it is decoded. Decoding is bound by the bytes of
//! weight read per token, so this is where NF4 (0.56 bytes per weight) beats f32 (4 bytes). (For
//! so few rows `gemm` would spend most of its time packing the weight into its own layout.)
//!
//! - **NF4**: each byte holds two 4-bit codes. Bytes widen to 32-bit lanes, one byte each, and
//!   the code table is looked up in registers: on AVX-512 `_mm512_permutexvar_ps` looks sixteen
//!   codes up at once in the 16-entry table, which holds one register; on AVX2 two
//!   `_mm256_permutevar8x32_ps` look eight codes up in the table's two halves and the code's
//!   fourth bit picks between them. The lanes shifted right by four give the even elements (high
//!   nibbles), the lanes as they are the odd ones (the lookup reads an index's low bits). The
//!   table is multiplied by the block's absmax once per 64 weights, so each weight is
//!   `table[code] · absmax` exactly as the format defines it ([`crate::nf4::format`]).
//! - **bf16**: two values are one 32-bit lane; the lanes shifted left by 16 are the even
//!   elements as f32, the lanes with their low half cleared the odd ones (exact, no shuffles).
//! - **f32**: read as they are.
//! - **Q4_1 / Q8_0 block copies** of f32 weights ([`crate::blocks`]): each block's codes widen
//!   to 32-bit lanes and become `q · d + m` (or `q · d`) in f32, the exact f32 values, in column
//!   order; since each lane then accumulates the same products in the same order as the f32
//!   kernel's, the results are the f32 kernel's to the bit, from a sixth (Q4_1) or a quarter
//!   (Q8_0) of the bytes.
//!
//! Since NF4 and bf16 weights come out as even then odd elements, the input rows are rearranged
//! once per call so that each group of 32 holds its 16 even elements, then its 16 odd ones (both
//! instruction sets decode into that order), and the dot products are unchanged.
//!
//! Output rows are split between threads; each weight row is multiplied by all `m` input rows
//! with independent accumulators. The kernels are compiled for AVX-512 F and for AVX2 with FMA
//! (the laptops and servers without AVX-512) and chosen at run time ([`Isa::detect`]); callers
//! fall back to the tiled `gemm` kernels of [`crate::nf4::cpu`] on other CPUs, and for more input
//! rows, where `gemm` is faster (docs/benchmarks.md).

use rayon::prelude::*;

use crate::blocks::{self, BlockFormat};
use crate::nf4::format::BLOCK;

/// The most input rows the kernels take: up to this many, reading the weight once and
/// multiplying it by every row beats `gemm`, which must first repack (or transpose) the whole
/// weight on every call (docs/benchmarks.md).
pub const MAX_ROWS: usize = 32;

/// The instruction sets the kernels are compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512 F: 16 lanes, 32 registers.
    Avx512,
    /// AVX2 with FMA: 8 lanes, 16 registers.
    Avx2,
}

impl Isa {
    /// The widest instruction set this CPU runs the kernels with (detected at run time), or
    /// `None` when it has neither.
    pub fn detect() -> Option<Isa> {
        [Isa::Avx512, Isa::Avx2].into_iter().find(|isa| isa.runs())
    }

    /// Every instruction set this CPU runs the kernels with, widest first.
    pub fn supported() -> Vec<Isa> {
        [Isa::Avx512, Isa::Avx2]
            .into_iter()
            .filter(|isa| isa.runs())
            .collect()
    }

    /// Whether this CPU runs the kernels of this instruction set (detected at run time; the
    /// standard library caches the answer).
    pub fn runs(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            match self {
                Isa::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
                Isa::Avx2 => {
                    std::arch::is_x86_feature_detected!("avx2")
                        && std::arch::is_x86_feature_detected!("fma")
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = self;
            false
        }
    }

    /// Input rows one pass of the kernel multiplies each weight row by (its accumulators fill
    /// the registers); more rows are taken in blocks of this many while the weight rows stay in
    /// cache.
    fn block_rows(self) -> usize {
        match self {
            Isa::Avx512 => 8,
            Isa::Avx2 => 6,
        }
    }
}

/// Whether this CPU runs the kernels (AVX-512 F, or AVX2 with FMA, detected at run time).
pub fn available() -> bool {
    Isa::detect().is_some()
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
    /// Raw bf16 bits, row-major. Needs `cols` to be a multiple of 32.
    Bf16(&'a [u16]),
    /// f32 values, row-major. Needs `cols` to be a multiple of 16.
    F32(&'a [f32]),
    /// An exact Q4_1 copy of an f32 weight, six words per 32 weights ([`crate::blocks`]).
    /// Needs `cols` to be a multiple of 32. Decoded in the f32 kernel's column order, so the
    /// results equal [`Weight::F32`]'s on the f32 values to the bit.
    Q4_1(&'a [u32]),
    /// An exact Q8_0 copy of an f32 weight, nine words per 32 weights; as [`Weight::Q4_1`].
    Q8_0(&'a [u32]),
}

impl Weight<'_> {
    /// Whether the kernel handles rows of `cols` weights.
    pub fn supports(&self, cols: usize) -> bool {
        match self {
            Weight::Nf4 { .. } => cols.is_multiple_of(BLOCK),
            Weight::Bf16(_) => cols.is_multiple_of(32),
            Weight::F32(_) => cols.is_multiple_of(16),
            Weight::Q4_1(_) | Weight::Q8_0(_) => cols.is_multiple_of(blocks::BLOCK),
        }
    }
}

/// `y = x · Wᵀ` for `x` `[m, cols]` (`1 <= m <= MAX_ROWS`) and `W` `[rows, cols]`; returns
/// `[m, rows]`. `None` when the CPU has neither instruction set or the shape is not one the
/// kernel takes (the caller then uses another kernel).
pub fn linear(
    x: &[f32],
    m: usize,
    weight: Weight<'_>,
    rows: usize,
    cols: usize,
) -> Option<Vec<f32>> {
    linear_with(Isa::detect()?, x, m, weight, rows, cols)
}

/// [`linear`] with the kernels of `isa`, which the CPU must run ([`Isa::runs`]).
fn linear_with(
    isa: Isa,
    x: &[f32],
    m: usize,
    weight: Weight<'_>,
    rows: usize,
    cols: usize,
) -> Option<Vec<f32>> {
    assert!(isa.runs(), "this CPU does not run the {isa:?} kernels");
    if m == 0 || m > MAX_ROWS || !weight.supports(cols) || cols == 0 {
        return None;
    }
    assert_eq!(x.len(), m * cols, "input has the wrong size");
    match weight {
        Weight::Nf4 { words, absmax, .. } => {
            assert!(words.len() * 8 >= rows * cols, "codes are too short");
            assert!(absmax.len() >= rows * cols / BLOCK, "absmax is too short");
        }
        Weight::Bf16(w) => assert_eq!(w.len(), rows * cols, "weight has the wrong size"),
        Weight::F32(w) => assert_eq!(w.len(), rows * cols, "weight has the wrong size"),
        Weight::Q4_1(w) => assert_eq!(
            w.len(),
            rows * cols / blocks::BLOCK * BlockFormat::Q4_1.words(),
            "weight has the wrong size"
        ),
        Weight::Q8_0(w) => assert_eq!(
            w.len(),
            rows * cols / blocks::BLOCK * BlockFormat::Q8_0.words(),
            "weight has the wrong size"
        ),
    }
    // NF4 and bf16 weights decode to the even then the odd elements of every 32: rearrange
    // the inputs to match (once per call, `m × cols` values).
    let deinterleaved: Vec<f32>;
    let x = match weight {
        Weight::F32(_) | Weight::Q4_1(_) | Weight::Q8_0(_) => x,
        Weight::Nf4 { .. } | Weight::Bf16(_) => {
            deinterleaved = x
                .chunks_exact(32)
                .flat_map(|c| (0..32).map(move |k| c[(2 * k) % 32 + k / 16]))
                .collect();
            &deinterleaved
        }
    };
    let mut out = vec![0f32; m * rows];
    // Rows per task: enough work per task to amortise scheduling, several tasks per thread.
    let chunk = (rows / (8 * rayon::current_num_threads().max(1))).clamp(4, 256);
    // Tasks write disjoint output columns; the address crosses threads as an integer.
    let dst = out.as_mut_ptr() as usize;
    (0..rows.div_ceil(chunk)).into_par_iter().for_each(|t| {
        let r0 = t * chunk;
        let r1 = (r0 + chunk).min(rows);
        // Input rows a block at a time over the same weight rows, which the first block
        // brought into cache: the weight is read from memory once per call whatever `m`.
        let block_rows = isa.block_rows();
        for i0 in (0..m).step_by(block_rows) {
            let mb = block_rows.min(m - i0);
            let x = &x[i0 * cols..(i0 + mb) * cols];
            // SAFETY: the CPU runs `isa` (asserted above); the kernel writes out[i * rows + r]
            // for i in i0..i0 + mb and r in r0..r1 only (rows no other task touches), inside
            // `out`, which lives for the whole call; every weight and input index was
            // bounds-checked above.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                let dst = (dst as *mut f32).add(i0 * rows);
                match isa {
                    Isa::Avx512 => avx512::rows(x, mb, weight, r0, r1, rows, cols, dst),
                    Isa::Avx2 => avx2::rows(x, mb, weight, r0, r1, rows, cols, dst),
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (r0, r1, dst, x);
        }
    });
    Some(out)
}

/// The entry point of one instruction set's module: `rows`, which runs `row_range::<M, R>` for
/// the input row count `M` (and the weight rows per step `R` listed for it), which walks the
/// output rows through the module's `group::<M, R>`. One instantiation per input row count, so
/// the accumulators live in registers.
#[cfg(target_arch = "x86_64")]
macro_rules! row_driver {
    ($feature:literal, $($m:literal => $r:literal),*) => {
        /// Output rows `r0 .. r1` for every input row, written at `dst[i * rows + r]`.
        ///
        /// # Safety
        /// The CPU must run this module's instruction set; `m` must be one the module
        /// instantiates (1 to [`super::Isa::block_rows`]); `dst` must hold `m * rows` values;
        /// the weight must cover `rows * cols` values and `x` `m * cols`.
        #[target_feature(enable = $feature)]
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
            match m {
                // SAFETY: forwarded from the caller.
                $($m => unsafe { row_range::<$m, $r>(x, weight, r0, r1, rows, cols, dst) },)*
                _ => unreachable!("{m} input rows in one block"),
            }
        }

        /// Output rows `r0 .. r1` for `M` input rows, `R` weight rows at a time (tail rows one
        /// at a time).
        #[target_feature(enable = $feature)]
        unsafe fn row_range<const M: usize, const R: usize>(
            x: &[f32],
            weight: Weight<'_>,
            r0: usize,
            r1: usize,
            rows: usize,
            cols: usize,
            dst: *mut f32,
        ) {
            let mut r = r0;
            while r + R <= r1 {
                // SAFETY: forwarded from the caller.
                unsafe { group::<M, R>(x, weight, r, rows, cols, dst) };
                r += R;
            }
            while r < r1 {
                // SAFETY: forwarded from the caller.
                unsafe { group::<M, 1>(x, weight, r, rows, cols, dst) };
                r += 1;
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{BLOCK, Weight};

    row_driver!("avx512f", 1 => 4, 2 => 4, 3 => 2, 4 => 2, 5 => 2, 6 => 2, 7 => 2, 8 => 2);

    /// Weight rows `r .. r + R` times `M` input rows: `M × R` accumulators, so each input
    /// vector loaded serves `R` weight rows and each weight vector `M` input rows, and there
    /// are always several independent chains of multiply-adds.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn group<const M: usize, const R: usize>(
        x: &[f32],
        weight: Weight<'_>,
        r: usize,
        rows: usize,
        cols: usize,
        dst: *mut f32,
    ) {
        let xp = x.as_ptr();
        let mut acc = [[_mm512_setzero_ps(); R]; M];
        // acc[i][j] += w[j] · x[i, c .. c + 16]
        let mut accumulate = |w: &[__m512; R], c: usize| {
            for (i, acc) in acc.iter_mut().enumerate() {
                // SAFETY: row i of x holds `cols` values and c + 16 <= cols.
                let xv = unsafe { _mm512_loadu_ps(xp.add(i * cols + c)) };
                for (a, w) in acc.iter_mut().zip(w) {
                    *a = _mm512_fmadd_ps(*w, xv, *a);
                }
            }
        };
        match weight {
            Weight::Nf4 {
                words,
                absmax,
                table,
            } => {
                // SAFETY: 16 floats.
                let table = unsafe { _mm512_loadu_ps(table.as_ptr()) };
                let bytes = words.as_ptr().cast::<u8>();
                let blocks = cols / BLOCK;
                for b in 0..blocks {
                    let block = |j: usize| (r + j) * blocks + b;
                    let scaled: [__m512; R] = std::array::from_fn(|j| {
                        _mm512_mul_ps(table, _mm512_set1_ps(absmax[block(j)]))
                    });
                    for half in 0..2 {
                        // SAFETY: block k is bytes 32k .. 32k + 32, inside the codes (checked
                        // by the caller).
                        let lanes: [__m512i; R] = std::array::from_fn(|j| unsafe {
                            _mm512_cvtepu8_epi32(_mm_loadu_si128(
                                bytes.add(block(j) * 32 + half * 16).cast(),
                            ))
                        });
                        let even: [__m512; R] = std::array::from_fn(|j| {
                            _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(lanes[j]), scaled[j])
                        });
                        let odd: [__m512; R] =
                            std::array::from_fn(|j| _mm512_permutexvar_ps(lanes[j], scaled[j]));
                        let c = b * BLOCK + half * 32;
                        accumulate(&even, c);
                        accumulate(&odd, c + 16);
                    }
                }
            }
            Weight::F32(w) => {
                let wp = w.as_ptr();
                for c in (0..cols).step_by(16) {
                    // SAFETY: rows r .. r + R hold `cols` values each, a multiple of 16.
                    let w: [__m512; R] = std::array::from_fn(|j| unsafe {
                        _mm512_loadu_ps(wp.add((r + j) * cols + c))
                    });
                    accumulate(&w, c);
                }
            }
            Weight::Q4_1(w) => {
                let per_row = cols / 32 * 6;
                let nibble = _mm512_set1_epi32(0x0f);
                for b in 0..cols / 32 {
                    let at = |j: usize| (r + j) * per_row + b * 6;
                    // SAFETY: block b of rows r .. r + R is six words inside the copy, whose
                    // size the caller checked.
                    let pairs: [(__m512, __m512); R] = std::array::from_fn(|j| {
                        let block = unsafe { w.as_ptr().add(at(j)) };
                        let (d, m) = unsafe {
                            (
                                _mm512_set1_ps(f32::from_bits(*block)),
                                _mm512_set1_ps(f32::from_bits(*block.add(1))),
                            )
                        };
                        let codes =
                            unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(block.add(2).cast())) };
                        let weights = |q: __m512i| _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d, m);
                        (
                            weights(_mm512_and_si512(codes, nibble)),
                            weights(_mm512_srli_epi32::<4>(codes)),
                        )
                    });
                    let lo: [__m512; R] = std::array::from_fn(|j| pairs[j].0);
                    let hi: [__m512; R] = std::array::from_fn(|j| pairs[j].1);
                    accumulate(&lo, b * 32);
                    accumulate(&hi, b * 32 + 16);
                }
            }
            Weight::Q8_0(w) => {
                let per_row = cols / 32 * 9;
                for b in 0..cols / 32 {
                    let at = |j: usize| (r + j) * per_row + b * 9;
                    // SAFETY: block b of rows r .. r + R is nine words inside the copy, whose
                    // size the caller checked.
                    let pairs: [(__m512, __m512); R] = std::array::from_fn(|j| {
                        let block = unsafe { w.as_ptr().add(at(j)) };
                        let d = unsafe { _mm512_set1_ps(f32::from_bits(*block)) };
                        let weights = |k: usize| {
                            let q = unsafe {
                                _mm512_cvtepi8_epi32(_mm_loadu_si128(block.add(1 + 4 * k).cast()))
                            };
                            _mm512_mul_ps(_mm512_cvtepi32_ps(q), d)
                        };
                        (weights(0), weights(1))
                    });
                    let lo: [__m512; R] = std::array::from_fn(|j| pairs[j].0);
                    let hi: [__m512; R] = std::array::from_fn(|j| pairs[j].1);
                    accumulate(&lo, b * 32);
                    accumulate(&hi, b * 32 + 16);
                }
            }
            Weight::Bf16(w) => {
                let wp = w.as_ptr();
                let high = _mm512_set1_epi32(0xffff_0000_u32 as i32);
                for c in (0..cols).step_by(32) {
                    // SAFETY: rows r .. r + R hold `cols` values each, a multiple of 32.
                    let lanes: [__m512i; R] = std::array::from_fn(|j| unsafe {
                        _mm512_loadu_si512(wp.add((r + j) * cols + c).cast())
                    });
                    let even: [__m512; R] = std::array::from_fn(|j| {
                        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(lanes[j]))
                    });
                    let odd: [__m512; R] = std::array::from_fn(|j| {
                        _mm512_castsi512_ps(_mm512_and_si512(lanes[j], high))
                    });
                    accumulate(&even, c);
                    accumulate(&odd, c + 16);
                }
            }
        }
        for (i, acc) in acc.iter().enumerate() {
            for (j, a) in acc.iter().enumerate() {
                // SAFETY: i < m and r + j < rows (caller's contract).
                unsafe { *dst.add(i * rows + r + j) = _mm512_reduce_add_ps(*a) };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{BLOCK, Weight};

    row_driver!("avx2,fma", 1 => 4, 2 => 4, 3 => 3, 4 => 2, 5 => 2, 6 => 2);

    /// The sum of a register's eight lanes.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn lane_sum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// Looks up eight 4-bit codes (the low four bits of each lane of `index`; higher bits are
    /// ignored) in a 16-entry table held as its two halves.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn lookup(index: __m256i, low: __m256, high: __m256) -> __m256 {
        // The permutes read an index's low three bits; its fourth bit, moved to the sign bit,
        // picks the half.
        let pick = _mm256_castsi256_ps(_mm256_slli_epi32::<28>(index));
        _mm256_blendv_ps(
            _mm256_permutevar8x32_ps(low, index),
            _mm256_permutevar8x32_ps(high, index),
            pick,
        )
    }

    /// Weight rows `r .. r + R` times `M` input rows: `M × R` accumulators, so each input
    /// vector loaded serves `R` weight rows and each weight vector `M` input rows, and there
    /// are always several independent chains of multiply-adds.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn group<const M: usize, const R: usize>(
        x: &[f32],
        weight: Weight<'_>,
        r: usize,
        rows: usize,
        cols: usize,
        dst: *mut f32,
    ) {
        let xp = x.as_ptr();
        let mut acc = [[_mm256_setzero_ps(); R]; M];
        // acc[i][j] += w[j] · x[i, c .. c + 8]
        let mut accumulate = |w: &[__m256; R], c: usize| {
            for (i, acc) in acc.iter_mut().enumerate() {
                // SAFETY: row i of x holds `cols` values and c + 8 <= cols.
                let xv = unsafe { _mm256_loadu_ps(xp.add(i * cols + c)) };
                for (a, w) in acc.iter_mut().zip(w) {
                    *a = _mm256_fmadd_ps(*w, xv, *a);
                }
            }
        };
        match weight {
            Weight::Nf4 {
                words,
                absmax,
                table,
            } => {
                // SAFETY: 16 floats.
                let (low, high) = unsafe {
                    (
                        _mm256_loadu_ps(table.as_ptr()),
                        _mm256_loadu_ps(table.as_ptr().add(8)),
                    )
                };
                let bytes = words.as_ptr().cast::<u8>();
                let blocks = cols / BLOCK;
                for b in 0..blocks {
                    let block = |j: usize| (r + j) * blocks + b;
                    let scale: [__m256; R] =
                        std::array::from_fn(|j| _mm256_set1_ps(absmax[block(j)]));
                    let low: [__m256; R] = std::array::from_fn(|j| _mm256_mul_ps(low, scale[j]));
                    let high: [__m256; R] = std::array::from_fn(|j| _mm256_mul_ps(high, scale[j]));
                    // Eight bytes (16 weights) at a time: quarter q of the block's 32 bytes is
                    // half q % 2 of its group of 32 weights q / 2.
                    for q in 0..4 {
                        // SAFETY: block k is bytes 32k .. 32k + 32, inside the codes (checked
                        // by the caller).
                        let lanes: [__m256i; R] = std::array::from_fn(|j| unsafe {
                            _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                bytes.add(block(j) * 32 + q * 8).cast(),
                            ))
                        });
                        let even: [__m256; R] = std::array::from_fn(|j| {
                            lookup(_mm256_srli_epi32::<4>(lanes[j]), low[j], high[j])
                        });
                        let odd: [__m256; R] =
                            std::array::from_fn(|j| lookup(lanes[j], low[j], high[j]));
                        let c = b * BLOCK + (q / 2) * 32 + (q % 2) * 8;
                        accumulate(&even, c);
                        accumulate(&odd, c + 16);
                    }
                }
            }
            Weight::F32(w) => {
                let wp = w.as_ptr();
                for c in (0..cols).step_by(8) {
                    // SAFETY: rows r .. r + R hold `cols` values each, a multiple of 16.
                    let w: [__m256; R] = std::array::from_fn(|j| unsafe {
                        _mm256_loadu_ps(wp.add((r + j) * cols + c))
                    });
                    accumulate(&w, c);
                }
            }
            Weight::Q4_1(w) => {
                let per_row = cols / 32 * 6;
                let nibble = _mm256_set1_epi32(0x0f);
                for b in 0..cols / 32 {
                    let at = |j: usize| (r + j) * per_row + b * 6;
                    // Eight weights at a time in column order: bytes 0..8 and 8..16 give
                    // weights 0..8 and 8..16 in their low nibbles, 16..24 and 24..32 in their
                    // high ones.
                    for k in 0..4 {
                        // SAFETY: block b of rows r .. r + R is six words inside the copy,
                        // whose size the caller checked.
                        let w: [__m256; R] = std::array::from_fn(|j| {
                            let block = unsafe { w.as_ptr().add(at(j)) };
                            let (d, m) = unsafe {
                                (
                                    _mm256_set1_ps(f32::from_bits(*block)),
                                    _mm256_set1_ps(f32::from_bits(*block.add(1))),
                                )
                            };
                            let bytes = unsafe { block.add(2 + 2 * (k % 2)) };
                            let codes =
                                unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(bytes.cast())) };
                            let q = if k < 2 {
                                _mm256_and_si256(codes, nibble)
                            } else {
                                _mm256_srli_epi32::<4>(codes)
                            };
                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m)
                        });
                        accumulate(&w, b * 32 + k * 8);
                    }
                }
            }
            Weight::Q8_0(w) => {
                let per_row = cols / 32 * 9;
                for b in 0..cols / 32 {
                    let at = |j: usize| (r + j) * per_row + b * 9;
                    for k in 0..4 {
                        // SAFETY: block b of rows r .. r + R is nine words inside the copy,
                        // whose size the caller checked.
                        let w: [__m256; R] = std::array::from_fn(|j| {
                            let block = unsafe { w.as_ptr().add(at(j)) };
                            let d = unsafe { _mm256_set1_ps(f32::from_bits(*block)) };
                            let q = unsafe {
                                _mm256_cvtepi8_epi32(_mm_loadl_epi64(block.add(1 + 2 * k).cast()))
                            };
                            _mm256_mul_ps(_mm256_cvtepi32_ps(q), d)
                        });
                        accumulate(&w, b * 32 + k * 8);
                    }
                }
            }
            Weight::Bf16(w) => {
                let wp = w.as_ptr();
                let high = _mm256_set1_epi32(0xffff_0000_u32 as i32);
                for c in (0..cols).step_by(32) {
                    // Each half of 16 values gives 8 even and 8 odd elements: the first half's
                    // go to positions 0..8 and 16..24 of the group's rearranged input, the
                    // second half's to 8..16 and 24..32.
                    for h in 0..2 {
                        // SAFETY: rows r .. r + R hold `cols` values each, a multiple of 32.
                        let lanes: [__m256i; R] = std::array::from_fn(|j| unsafe {
                            _mm256_loadu_si256(wp.add((r + j) * cols + c + h * 16).cast())
                        });
                        let even: [__m256; R] = std::array::from_fn(|j| {
                            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(lanes[j]))
                        });
                        let odd: [__m256; R] = std::array::from_fn(|j| {
                            _mm256_castsi256_ps(_mm256_and_si256(lanes[j], high))
                        });
                        accumulate(&even, c + h * 8);
                        accumulate(&odd, c + 16 + h * 8);
                    }
                }
            }
        }
        for (i, acc) in acc.iter().enumerate() {
            for (j, a) in acc.iter().enumerate() {
                // SAFETY: i < m and r + j < rows (caller's contract).
                unsafe { *dst.add(i * rows + r + j) = lane_sum(*a) };
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
    fn nf4_bf16_and_f32_kernels_match_the_dequantized_product() {
        let isas = Isa::supported();
        if isas.is_empty() {
            // No kernel on this CPU: `linear` must decline, so callers take the `gemm` path.
            let w = vec![0.5f32; 64];
            assert!(linear(&[1.0; 64], 1, Weight::F32(&w), 1, 64).is_none());
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
        // Every instruction set this CPU runs (an AVX-512 machine checks the AVX2 kernels too).
        for isa in isas {
            for m in 1..=MAX_ROWS {
                let x: Vec<f32> = (0..m * cols)
                    .map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0)
                    .collect();
                let nf4 = Weight::Nf4 {
                    words: &words,
                    absmax: &q.absmax,
                    table: &NF4_CODE,
                };
                let y = linear_with(isa, &x, m, nf4, rows, cols).unwrap();
                check(&y, &x, &dense, m, rows, cols);
                let y = linear_with(isa, &x, m, Weight::Bf16(&bf16), rows, cols).unwrap();
                check(&y, &x, &widened, m, rows, cols);
                let y = linear_with(isa, &x, m, Weight::F32(&w), rows, cols).unwrap();
                check(&y, &x, &w, m, rows, cols);
            }
        }
    }

    /// A block copy of `rows × cols` weights with codes, scales and minimums drawn from a
    /// simple generator, and its f32 values.
    fn block_copy(format: BlockFormat, rows: usize, cols: usize) -> (Vec<u32>, Vec<f32>) {
        let blocks = rows * cols / blocks::BLOCK;
        let mut s = 0x9e37_79b9_u32;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            s
        };
        let mut words = Vec::with_capacity(blocks * format.words());
        for b in 0..blocks {
            let d = half::f16::from_f32((1 + b % 7) as f32 * 1e-3).to_f32();
            words.push(d.to_bits());
            if format == BlockFormat::Q4_1 {
                let m = half::f16::from_f32(-((b % 5) as f32) * 4e-3).to_f32();
                words.push(m.to_bits());
            }
            for _ in 1 + (format == BlockFormat::Q4_1) as usize..format.words() {
                words.push(next());
            }
        }
        let dense = blocks::dequantize(format, &words, rows, cols);
        (words, dense)
    }

    #[test]
    fn block_copies_give_the_f32_kernels_results_to_the_bit() {
        let (rows, cols) = (21, 160);
        for format in [BlockFormat::Q4_1, BlockFormat::Q8_0] {
            let (words, dense) = block_copy(format, rows, cols);
            let copy = match format {
                BlockFormat::Q4_1 => Weight::Q4_1(&words),
                BlockFormat::Q8_0 => Weight::Q8_0(&words),
            };
            for isa in Isa::supported() {
                for m in 1..=MAX_ROWS {
                    let x: Vec<f32> = (0..m * cols)
                        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
                        .collect();
                    let want = linear_with(isa, &x, m, Weight::F32(&dense), rows, cols).unwrap();
                    check(&want, &x, &dense, m, rows, cols);
                    let got = linear_with(isa, &x, m, copy, rows, cols).unwrap();
                    let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{format:?} {isa:?} m={m}");
                }
            }
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
            linear(&vec![0.0; 64 * (MAX_ROWS + 1)], MAX_ROWS + 1, nf4, 1, 64).is_none(),
            "too many rows"
        );
        let words = [0u32; 6];
        assert!(
            linear(&[0.0; 48], 1, Weight::Q4_1(&words), 1, 48).is_none(),
            "cols not a multiple of 32"
        );
    }
}
