//! The CPU projection kernels, in plain Rust over host slices: NF4 dequantization into a buffer,
//! a fused NF4 dequantize-and-multiply (decode a block, dot it with every input row; kept as the
//! measured alternative), and the tiled kernels the CPU backend uses — dequantize a tile of rows
//! into reused scratch (or take it from a dense weight) and multiply it with `gemm`.
//!
//! Codes arrive as little-endian `u32` words holding bitsandbytes' bytes in order (four bytes,
//! eight codes per word; element `e` is in byte `e / 2`, high nibble when `e` is even). Blocks of
//! 64 elements run over the flattened row-major weight, so a block may straddle two rows when the
//! row length is not a multiple of 64; both kernels handle that.

use rayon::prelude::*;

use super::format::BLOCK;

/// The code-table value of element `e`.
#[inline(always)]
fn code_at(words: &[u32], table: &[f32; 16], e: usize) -> f32 {
    let byte = (words[e / 8] >> (8 * ((e / 2) % 4))) & 0xff;
    let nibble = if e.is_multiple_of(2) {
        byte >> 4
    } else {
        byte & 0x0f
    };
    table[nibble as usize]
}

/// The pair of values a byte holds, for every byte value.
fn pair_table(table: &[f32; 16]) -> [[f32; 2]; 256] {
    let mut t = [[0f32; 2]; 256];
    for (b, slot) in t.iter_mut().enumerate() {
        *slot = [table[b >> 4], table[b & 0x0f]];
    }
    t
}

/// Writes the 64 scaled values of a whole, word-aligned block starting at element `e`.
#[inline(always)]
fn decode_block(words: &[u32], pairs: &[[f32; 2]; 256], scale: f32, e: usize, out: &mut [f32]) {
    let w0 = e / 8;
    for (k, chunk) in out.chunks_exact_mut(8).enumerate() {
        let word = words[w0 + k];
        for b in 0..4 {
            let [even, odd] = pairs[((word >> (8 * b)) & 0xff) as usize];
            chunk[2 * b] = even * scale;
            chunk[2 * b + 1] = odd * scale;
        }
    }
}

/// Writes the scaled values of elements `e .. e + out.len()` (any alignment).
#[inline(always)]
fn decode_run(
    words: &[u32],
    table: &[f32; 16],
    pairs: &[[f32; 2]; 256],
    absmax: &[f32],
    e: usize,
    out: &mut [f32],
) {
    if e.is_multiple_of(BLOCK) && out.len() == BLOCK {
        decode_block(words, pairs, absmax[e / BLOCK], e, out);
    } else {
        for (i, d) in out.iter_mut().enumerate() {
            *d = code_at(words, table, e + i) * absmax[(e + i) / BLOCK];
        }
    }
}

/// Dequantizes `rows * cols` elements into `out` (`code * absmax`, row-major).
pub fn dequantize_into(
    words: &[u32],
    absmax: &[f32],
    table: &[f32; 16],
    rows: usize,
    cols: usize,
    out: &mut [f32],
) {
    let n = rows * cols;
    assert_eq!(out.len(), n, "output buffer has the wrong size");
    let pairs = pair_table(table);
    // Chunks of whole blocks, so every run starts block- and word-aligned.
    out.par_chunks_mut(BLOCK * 256)
        .enumerate()
        .for_each(|(chunk, dst)| {
            let start = chunk * BLOCK * 256;
            for (i, blk) in dst.chunks_mut(BLOCK).enumerate() {
                decode_run(words, table, &pairs, absmax, start + i * BLOCK, blk);
            }
        });
}

/// Dequantizes into a new buffer.
pub fn dequantize(
    words: &[u32],
    absmax: &[f32],
    table: &[f32; 16],
    rows: usize,
    cols: usize,
) -> Vec<f32> {
    let mut out = vec![0f32; rows * cols];
    dequantize_into(words, absmax, table, rows, cols, &mut out);
    out
}

/// Dot product with eight independent accumulators (vectorises).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut total: f32 = acc.iter().sum();
    for (x, y) in ar.iter().zip(br) {
        total += x * y;
    }
    total
}

/// `y = x · Wᵀ` with `x` `[m, cols]` and the NF4 weight `[rows, cols]`, without materialising
/// the weight: each block of a weight row is decoded once into a 64-value buffer and dotted with
/// every input row. Returns `[m, rows]` row-major.
pub fn linear(
    x: &[f32],
    m: usize,
    words: &[u32],
    absmax: &[f32],
    table: &[f32; 16],
    rows: usize,
    cols: usize,
) -> Vec<f32> {
    assert_eq!(x.len(), m * cols, "input has the wrong size");
    let pairs = pair_table(table);
    // out_t[r][i] = <x_i, W_r>; one weight row per task, transposed at the end.
    let mut out_t = vec![0f32; rows * m];
    out_t.par_chunks_mut(m).enumerate().for_each(|(r, dst)| {
        let mut buf = [0f32; BLOCK];
        let mut c = 0;
        while c < cols {
            let e = r * cols + c;
            let run = (((e / BLOCK) + 1) * BLOCK - e).min(cols - c);
            decode_run(words, table, &pairs, absmax, e, &mut buf[..run]);
            for (i, slot) in dst.iter_mut().enumerate() {
                *slot += dot(&buf[..run], &x[i * cols + c..i * cols + c + run]);
            }
            c += run;
        }
    });
    if m == 1 {
        return out_t;
    }
    let mut out = vec![0f32; m * rows];
    for r in 0..rows {
        for i in 0..m {
            out[i * rows + r] = out_t[r * m + i];
        }
    }
    out
}

/// Weight elements one tile of [`linear_tiled`] dequantizes (1 MiB of f32): large enough for
/// the matmul to run at speed, small enough to stay in cache between decode and use.
const TILE_ELEMS: usize = 256 * 1024;

/// Decodes elements `e .. e + out.len()` in runs that never cross a block.
fn decode_range(
    words: &[u32],
    table: &[f32; 16],
    pairs: &[[f32; 2]; 256],
    absmax: &[f32],
    e: usize,
    out: &mut [f32],
) {
    let mut done = 0;
    while done < out.len() {
        let at = e + done;
        let run = ((at / BLOCK + 1) * BLOCK - at).min(out.len() - done);
        decode_run(words, table, pairs, absmax, at, &mut out[done..done + run]);
        done += run;
    }
}

/// Where [`tiled_gemm`] gets a tile of weight rows from.
enum TileSource<'a> {
    /// A dense row-major f32 weight: tiles are slices of it.
    Dense(&'a [f32]),
    /// A dense row-major bf16 weight (raw bits): tiles are widened into per-thread scratch.
    Bf16(&'a [u16]),
    /// An NF4 weight: tiles are decoded into per-thread scratch.
    Nf4 {
        words: &'a [u32],
        absmax: &'a [f32],
        table: &'a [f32; 16],
        pairs: Box<[[f32; 2]; 256]>,
    },
}

impl TileSource<'_> {
    /// Weight rows `r0 .. r0 + n` as f32, borrowed or decoded into `scratch`.
    fn rows<'s>(
        &'s self,
        r0: usize,
        n: usize,
        cols: usize,
        scratch: &'s mut Vec<f32>,
    ) -> &'s [f32] {
        match self {
            TileSource::Dense(w) => &w[r0 * cols..(r0 + n) * cols],
            TileSource::Bf16(w) => {
                scratch.resize(n * cols, 0.0);
                let tile = &mut scratch[..n * cols];
                for (d, &b) in tile.iter_mut().zip(&w[r0 * cols..(r0 + n) * cols]) {
                    *d = f32::from_bits((b as u32) << 16);
                }
                tile
            }
            TileSource::Nf4 {
                words,
                absmax,
                table,
                pairs,
            } => {
                scratch.resize(n * cols, 0.0);
                let tile = &mut scratch[..n * cols];
                decode_range(words, table, pairs, absmax, r0 * cols, tile);
                tile
            }
        }
    }
}

/// Weight rows transposed at a time by [`TileSource::rows_transposed`]: one cache line of each
/// output column.
const TRANSPOSE_ROWS: usize = 16;

impl TileSource<'_> {
    /// Weight rows `r0 .. r0 + n` as f32, transposed into `out` (`[cols, n]` row-major: element
    /// `(c, j)` of the tile at `out[c * n + j]`), `TRANSPOSE_ROWS` rows at a time through
    /// `rows_buf`.
    fn rows_transposed(
        &self,
        r0: usize,
        n: usize,
        cols: usize,
        rows_buf: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        let mut j0 = 0;
        while j0 < n {
            let h = TRANSPOSE_ROWS.min(n - j0);
            let src = self.rows(r0 + j0, h, cols, rows_buf);
            transpose(src, h, cols, &mut out[j0..], n);
            j0 += h;
        }
    }
}

/// Writes the transpose of `src` (`h × w`, row-major) into `dst`: element `(i, j)` of `src` to
/// `dst[j * dst_stride + i]`. Full 16 × 16 blocks go through registers on AVX-512 CPUs, full
/// 8 × 8 blocks on AVX ones.
fn transpose(src: &[f32], h: usize, w: usize, dst: &mut [f32], dst_stride: usize) {
    assert!(src.len() >= h * w, "source too short");
    assert!(
        h == 0 || w == 0 || dst.len() >= (w - 1) * dst_stride + h,
        "destination too short"
    );
    let mut c0 = 0;
    #[cfg(target_arch = "x86_64")]
    if h == 16 && std::arch::is_x86_feature_detected!("avx512f") {
        while c0 + 16 <= w {
            // SAFETY: AVX-512 F detected; rows 0..16 of src hold columns c0..c0+16 (src is
            // h × w), and dst rows c0..c0+16 hold 16 values (checked above).
            unsafe {
                transpose16(
                    src.as_ptr().add(c0),
                    w,
                    dst.as_mut_ptr().add(c0 * dst_stride),
                    dst_stride,
                )
            };
            c0 += 16;
        }
    }
    #[cfg(target_arch = "x86_64")]
    if c0 == 0 && h.is_multiple_of(8) && std::arch::is_x86_feature_detected!("avx") {
        while c0 + 8 <= w {
            for i0 in (0..h).step_by(8) {
                // SAFETY: AVX detected; rows i0..i0+8 of src hold columns c0..c0+8 (src is
                // h × w), and dst rows c0..c0+8 hold values i0..i0+8 (checked above).
                unsafe {
                    transpose8(
                        src.as_ptr().add(i0 * w + c0),
                        w,
                        dst.as_mut_ptr().add(c0 * dst_stride + i0),
                        dst_stride,
                    )
                };
            }
            c0 += 8;
        }
    }
    for c in c0..w {
        for (i, d) in dst[c * dst_stride..c * dst_stride + h]
            .iter_mut()
            .enumerate()
        {
            *d = src[i * w + c];
        }
    }
}

/// Transposes the 16 × 16 block at `src` (row stride `src_stride`) into `dst` (row stride
/// `dst_stride`): interleave pairs of rows, then pairs of pairs, then 128-bit lanes twice.
///
/// # Safety
/// AVX-512 F must be available; both blocks must be readable/writable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose16(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize) {
    use std::arch::x86_64::*;
    let mut r = [_mm512_setzero_ps(); 16];
    for (i, row) in r.iter_mut().enumerate() {
        // SAFETY: the caller's block.
        *row = unsafe { _mm512_loadu_ps(src.add(i * src_stride)) };
    }
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    let pd = _mm512_castps_pd;
    for q in 0..4 {
        let b = 4 * q;
        r[b] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[b]), pd(t[b + 2])));
        r[b + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[b]), pd(t[b + 2])));
        r[b + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[b + 1]), pd(t[b + 3])));
        r[b + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[b + 1]), pd(t[b + 3])));
    }
    for half in 0..2 {
        let b = 8 * half;
        for i in 0..4 {
            t[b + i] = _mm512_shuffle_f32x4::<0x88>(r[b + i], r[b + 4 + i]);
            t[b + 4 + i] = _mm512_shuffle_f32x4::<0xdd>(r[b + i], r[b + 4 + i]);
        }
    }
    for i in 0..8 {
        r[i] = _mm512_shuffle_f32x4::<0x88>(t[i], t[8 + i]);
        r[8 + i] = _mm512_shuffle_f32x4::<0xdd>(t[i], t[8 + i]);
    }
    for (i, row) in r.iter().enumerate() {
        // SAFETY: the caller's block.
        unsafe { _mm512_storeu_ps(dst.add(i * dst_stride), *row) };
    }
}

/// Transposes the 8 × 8 block at `src` (row stride `src_stride`) into `dst` (row stride
/// `dst_stride`): interleave pairs of rows, then pairs of pairs, then swap 128-bit lanes.
///
/// # Safety
/// AVX must be available; both blocks must be readable/writable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn transpose8(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize) {
    use std::arch::x86_64::*;
    let mut r = [_mm256_setzero_ps(); 8];
    for (i, row) in r.iter_mut().enumerate() {
        // SAFETY: the caller's block.
        *row = unsafe { _mm256_loadu_ps(src.add(i * src_stride)) };
    }
    let mut t = [_mm256_setzero_ps(); 8];
    for i in 0..4 {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for q in 0..2 {
        let b = 4 * q;
        r[b] = _mm256_shuffle_ps::<0x44>(t[b], t[b + 2]);
        r[b + 1] = _mm256_shuffle_ps::<0xee>(t[b], t[b + 2]);
        r[b + 2] = _mm256_shuffle_ps::<0x44>(t[b + 1], t[b + 3]);
        r[b + 3] = _mm256_shuffle_ps::<0xee>(t[b + 1], t[b + 3]);
    }
    for i in 0..4 {
        t[i] = _mm256_permute2f128_ps::<0x20>(r[i], r[4 + i]);
        t[4 + i] = _mm256_permute2f128_ps::<0x31>(r[i], r[4 + i]);
    }
    for (i, row) in t.iter().enumerate() {
        // SAFETY: the caller's block.
        unsafe { _mm256_storeu_ps(dst.add(i * dst_stride), *row) };
    }
}

/// Height of `gemm`'s f32 AVX-512 micro-kernel (four vectors of 16). `gemm` runs
/// [`tiled_gemm`]'s products transposed (its output is row-major), so a tile's weight rows are
/// the micro-kernel's rows: a tile of 29 rows (a 1 MiB tile of an 8960-wide weight) ran every
/// block through the half-height kernel.
const KERNEL_ROWS: usize = 64;

/// Rows of one [`tiled_gemm`] tile of a `[rows, cols]` weight: about [`TILE_ELEMS`] elements
/// and at most `per_thread` rows (so that every thread gets a tile), rounded down to a multiple
/// of [`KERNEL_ROWS`] where a thread's share allows one, and never under 16 rows.
fn tile_height(rows: usize, cols: usize, per_thread: usize) -> usize {
    let by_size = (TILE_ELEMS / cols.max(1)).min(per_thread);
    let rounded = if by_size >= KERNEL_ROWS {
        by_size / KERNEL_ROWS * KERNEL_ROWS
    } else if per_thread >= KERNEL_ROWS {
        KERNEL_ROWS
    } else {
        by_size.max(16)
    };
    rounded.min(rows).max(1)
}

/// Input rows from which [`tiled_gemm`] hands `gemm` transposed tiles: `gemm` then reads both
/// operands with unit stride, while a row-major tile costs it a scalar gather while packing
/// (measured at 28 % of a 0.5B prefill's time). Below it the transposition is not paid back.
const TRANSPOSED_TILES_FROM: usize = 9;

/// `y = x · Wᵀ` (`x` `[m, cols]`, `W` `[rows, cols]`), a tile of weight rows at a time: the
/// tiles run in parallel, each multiplied by a single-threaded `gemm` (the matmul kernel burn's
/// Flex uses) into its own columns of the output. From [`TRANSPOSED_TILES_FROM`] input rows a
/// tile is first transposed (or decoded transposed) into per-thread scratch. Returns `[m, rows]`
/// row-major.
fn tiled_gemm(x: &[f32], m: usize, rows: usize, cols: usize, source: TileSource) -> Vec<f32> {
    assert_eq!(x.len(), m * cols, "input has the wrong size");
    let mut out = vec![0f32; m * rows];
    if m == 0 || rows == 0 || cols == 0 {
        return out;
    }
    let per_thread = rows.div_ceil(rayon::current_num_threads().max(1));
    let tile_rows = tile_height(rows, cols, per_thread);
    let tiles = rows.div_ceil(tile_rows);
    let transposed = m >= TRANSPOSED_TILES_FROM;
    // Tiles write disjoint column ranges of `out`; the address crosses threads as an integer.
    let dst = out.as_mut_ptr() as usize;
    (0..tiles).into_par_iter().for_each_init(
        || (Vec::new(), Vec::new()),
        |(scratch, rows_buf): &mut (Vec<f32>, Vec<f32>), t| {
            let r0 = t * tile_rows;
            let n = tile_rows.min(rows - r0);
            // The tile as rhs `[cols, n]` of the product: element (k, j) at
            // tile[k * rhs_rs + j * rhs_cs].
            let (tile, rhs_cs, rhs_rs): (&[f32], isize, isize) = if transposed {
                scratch.resize(n * cols, 0.0);
                source.rows_transposed(r0, n, cols, rows_buf, &mut scratch[..n * cols]);
                (&scratch[..n * cols], 1, n as isize)
            } else {
                (source.rows(r0, n, cols, scratch), cols as isize, 1)
            };
            // SAFETY: dst (m × n, row stride `rows`) is the columns r0..r0+n of `out`, which
            // lives for the whole call and which no other tile touches; lhs is `x` (m × cols,
            // row-major) and rhs the tile (cols × n with the strides above); every index stays
            // inside its slice.
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    cols,
                    (dst as *mut f32).add(r0),
                    1,
                    rows as isize,
                    false,
                    x.as_ptr(),
                    1,
                    cols as isize,
                    tile.as_ptr(),
                    rhs_cs,
                    rhs_rs,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
        },
    );
    out
}

/// `y = x · Wᵀ` like [`linear`]: the weight is dequantized a tile of rows at a time into a
/// per-thread scratch buffer that is reused for every tile, and each tile is multiplied with
/// `gemm`. Nothing weight-sized is ever allocated, so there are no page faults for a fresh
/// full-size temporary on every call. Returns `[m, rows]` row-major.
pub fn linear_tiled(
    x: &[f32],
    m: usize,
    words: &[u32],
    absmax: &[f32],
    table: &[f32; 16],
    rows: usize,
    cols: usize,
) -> Vec<f32> {
    let source = TileSource::Nf4 {
        words,
        absmax,
        table,
        pairs: Box::new(pair_table(table)),
    };
    tiled_gemm(x, m, rows, cols, source)
}

/// `y = x · Wᵀ` for a dense row-major f32 weight `w` `[rows, cols]`, with the same tiling as
/// [`linear_tiled`]. Returns `[m, rows]` row-major.
pub fn dense_linear(x: &[f32], m: usize, w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    assert_eq!(w.len(), rows * cols, "weight has the wrong size");
    tiled_gemm(x, m, rows, cols, TileSource::Dense(w))
}

/// `y = x · Wᵀ` for a row-major bf16 weight (raw bits) `[rows, cols]`, widened a tile at a
/// time. Returns `[m, rows]` row-major.
pub fn bf16_linear(x: &[f32], m: usize, w: &[u16], rows: usize, cols: usize) -> Vec<f32> {
    assert_eq!(w.len(), rows * cols, "weight has the wrong size");
    tiled_gemm(x, m, rows, cols, TileSource::Bf16(w))
}

/// Weight rows one step of [`tiled_gemm_transposed`] decodes: enough for the matmul's inner
/// dimension to run at speed.
const TRANSPOSED_TILE_ROWS: usize = 256;

/// `y = g · W` (`g` `[m, rows]`, `W` `[rows, cols]`): the input gradient of a projection. The
/// sum runs over weight rows, so tiles of rows are decoded one after another (each decode and
/// each matmul using every thread) and accumulated into the output. Returns `[m, cols]`.
fn tiled_gemm_transposed(
    g: &[f32],
    m: usize,
    rows: usize,
    cols: usize,
    source: TileSource,
) -> Vec<f32> {
    assert_eq!(g.len(), m * rows, "gradient has the wrong size");
    let mut out = vec![0f32; m * cols];
    if m == 0 || rows == 0 || cols == 0 {
        return out;
    }
    let threads = rayon::current_num_threads().max(1);
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    let mut scratch = Vec::new();
    let mut r0 = 0;
    while r0 < rows {
        let n = TRANSPOSED_TILE_ROWS.min(rows - r0);
        let tile: &[f32] = match &source {
            TileSource::Dense(w) => &w[r0 * cols..(r0 + n) * cols],
            _ => {
                // Decode the tile's rows in parallel chunks.
                scratch.resize(n * cols, 0.0);
                let per = n.div_ceil(threads);
                scratch[..n * cols]
                    .par_chunks_mut(per * cols)
                    .enumerate()
                    .for_each(|(i, dst)| {
                        let mut local = Vec::new();
                        let rows_here = dst.len() / cols;
                        let src = source.rows(r0 + i * per, rows_here, cols, &mut local);
                        dst.copy_from_slice(src);
                    });
                &scratch[..n * cols]
            }
        };
        // SAFETY: dst is `out` (m × cols, row-major); lhs is columns r0..r0+n of `g`
        // (m × n, row stride `rows`); rhs is the tile (n × cols, row-major); every index
        // stays inside its slice.
        unsafe {
            gemm::gemm(
                m,
                cols,
                n,
                out.as_mut_ptr(),
                1,
                cols as isize,
                r0 > 0,
                g.as_ptr().add(r0),
                1,
                rows as isize,
                tile.as_ptr(),
                1,
                cols as isize,
                1.0,
                1.0,
                false,
                false,
                false,
                parallelism,
            );
        }
        r0 += n;
    }
    out
}

/// `y = g · W` for an NF4 weight `[rows, cols]`; returns `[m, cols]` row-major.
pub fn linear_transposed_nf4(
    g: &[f32],
    m: usize,
    words: &[u32],
    absmax: &[f32],
    table: &[f32; 16],
    rows: usize,
    cols: usize,
) -> Vec<f32> {
    let source = TileSource::Nf4 {
        words,
        absmax,
        table,
        pairs: Box::new(pair_table(table)),
    };
    tiled_gemm_transposed(g, m, rows, cols, source)
}

/// `y = g · W` for a dense f32 weight `[rows, cols]`; returns `[m, cols]` row-major.
pub fn linear_transposed_dense(
    g: &[f32],
    m: usize,
    w: &[f32],
    rows: usize,
    cols: usize,
) -> Vec<f32> {
    assert_eq!(w.len(), rows * cols, "weight has the wrong size");
    tiled_gemm_transposed(g, m, rows, cols, TileSource::Dense(w))
}

/// `y = g · W` for a bf16 weight (raw bits) `[rows, cols]`; returns `[m, cols]` row-major.
pub fn linear_transposed_bf16(
    g: &[f32],
    m: usize,
    w: &[u16],
    rows: usize,
    cols: usize,
) -> Vec<f32> {
    assert_eq!(w.len(), rows * cols, "weight has the wrong size");
    tiled_gemm_transposed(g, m, rows, cols, TileSource::Bf16(w))
}

/// Packs bitsandbytes' bytes into little-endian `u32` words (zero-padded to a whole word).
pub fn pack_words(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks(4)
        .map(|c| {
            let mut b = [0u8; 4];
            b[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(b)
        })
        .collect()
}

/// Unpacks words back into `len` bytes.
pub fn unpack_words(words: &[u32], len: usize) -> Vec<u8> {
    let mut bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    bytes.truncate(len);
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nf4::format::{NF4_CODE, dequantize_nf4, quantize_nf4};

    fn weight(rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols)
            .map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * (1.0 + (i / 64) as f32 * 0.01))
            .collect()
    }

    #[test]
    fn dequantize_matches_format_definition() {
        for (rows, cols) in [(4, 64), (3, 160), (5, 7), (1, 1)] {
            let w = weight(rows, cols);
            let q = quantize_nf4(&w);
            let words = pack_words(&q.packed);
            assert_eq!(
                dequantize(&words, &q.absmax, &NF4_CODE, rows, cols),
                dequantize_nf4(&q.packed, &q.absmax, rows * cols),
                "{rows}x{cols}"
            );
        }
    }

    #[test]
    fn fused_and_tiled_kernels_match_dequantize_then_matmul() {
        for (rows, cols, m) in [
            (6, 64, 1),
            (3, 160, 2),
            (5, 96, 3),
            (2, 7, 2),
            (40, 96, 19),
            (37, 100, 17),
            (300, 1000, 9),
            (300, 1000, 33),
        ] {
            let w = weight(rows, cols);
            let q = quantize_nf4(&w);
            let words = pack_words(&q.packed);
            let dense = dequantize_nf4(&q.packed, &q.absmax, rows * cols);
            let x: Vec<f32> = (0..m * cols)
                .map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0)
                .collect();
            let fused = linear(&x, m, &words, &q.absmax, &NF4_CODE, rows, cols);
            let tiled = linear_tiled(&x, m, &words, &q.absmax, &NF4_CODE, rows, cols);
            let dense_tiled = dense_linear(&x, m, &dense, rows, cols);
            for y in [fused, tiled, dense_tiled] {
                for i in 0..m {
                    for r in 0..rows {
                        let terms = (0..cols).map(|c| x[i * cols + c] * dense[r * cols + c]);
                        let want: f32 = terms.clone().sum();
                        // Summation order differs between kernels: bound by the magnitudes.
                        let scale = terms.map(f32::abs).sum::<f32>().max(1.0);
                        assert!(
                            (y[i * rows + r] - want).abs() < 1e-5 * scale,
                            "{rows}x{cols} m={m}: {} vs {want}",
                            y[i * rows + r]
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn tiles_are_whole_kernel_heights_where_a_share_allows() {
        // The 1.5B shape on two threads: q/o/gate/up (1536 wide), down (8960 wide), k/v.
        assert_eq!(tile_height(1536, 1536, 768), 128);
        assert_eq!(tile_height(8960, 1536, 4480), 128);
        assert_eq!(tile_height(1536, 8960, 768), 64);
        assert_eq!(tile_height(256, 1536, 128), 128);
        // SmolLM2's 576-wide projections, a tiny model, and a weight of fewer rows than 16.
        assert_eq!(tile_height(1536, 576, 768), 448);
        assert_eq!(tile_height(64, 64, 32), 32);
        assert_eq!(tile_height(24, 64, 12), 16);
        assert_eq!(tile_height(8, 64, 4), 8);
    }

    #[test]
    fn transpose_matches_the_definition() {
        for (h, w) in [
            (16, 48),
            (16, 37),
            (5, 20),
            (16, 16),
            (1, 1),
            (8, 19),
            (24, 8),
        ] {
            let src: Vec<f32> = (0..h * w).map(|i| i as f32).collect();
            let stride = h + 3;
            let mut dst = vec![-1f32; w * stride];
            transpose(&src, h, w, &mut dst, stride);
            for i in 0..h {
                for j in 0..w {
                    assert_eq!(dst[j * stride + i], src[i * w + j], "{h}x{w} ({i}, {j})");
                }
            }
        }
    }

    #[test]
    fn words_round_trip() {
        let bytes: Vec<u8> = (0..11).collect();
        assert_eq!(unpack_words(&pack_words(&bytes), 11), bytes);
    }
}
