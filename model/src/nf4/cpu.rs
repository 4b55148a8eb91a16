//! The CPU NF4 kernels, in plain Rust over host slices: dequantization into a buffer, and a fused
//! dequantize-and-multiply for the few-row inputs of decoding.
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
    let nibble = if e % 2 == 0 { byte >> 4 } else { byte & 0x0f };
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

/// Dequantizes `rows * cols` elements into `out` (`code * absmax`, row-major).
pub fn dequantize_into(words: &[u32], absmax: &[f32], table: &[f32; 16], rows: usize, cols: usize, out: &mut [f32]) {
    let n = rows * cols;
    assert_eq!(out.len(), n, "output buffer has the wrong size");
    let pairs = pair_table(table);
    out.par_chunks_mut(BLOCK * 64).enumerate().for_each(|(chunk, dst)| {
        let start = chunk * BLOCK * 64;
        if start % 2 == 0 && dst.len() % 2 == 0 {
            for (pair, d) in dst.chunks_exact_mut(2).enumerate() {
                let e = start + 2 * pair;
                let byte = (words[e / 8] >> (8 * ((e / 2) % 4))) & 0xff;
                let scale = absmax[e / BLOCK];
                let [a, b] = pairs[byte as usize];
                d[0] = a * scale;
                d[1] = b * scale;
            }
        } else {
            for (i, d) in dst.iter_mut().enumerate() {
                let e = start + i;
                *d = code_at(words, table, e) * absmax[e / BLOCK];
            }
        }
    });
}

/// Dequantizes into a new buffer.
pub fn dequantize(words: &[u32], absmax: &[f32], table: &[f32; 16], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows * cols];
    dequantize_into(words, absmax, table, rows, cols, &mut out);
    out
}

/// `y = x · Wᵀ` with `x` `[m, cols]` and the NF4 weight `[rows, cols]`, without materialising
/// the weight: each output row is a dot product over codes, with the block scale applied once
/// per block. Returns `[m, rows]` row-major.
pub fn linear(x: &[f32], m: usize, words: &[u32], absmax: &[f32], table: &[f32; 16], rows: usize, cols: usize) -> Vec<f32> {
    assert_eq!(x.len(), m * cols, "input has the wrong size");
    let pairs = pair_table(table);
    // out_t[r][i] = <x_i, W_r>; computed per weight row in parallel, transposed at the end.
    let mut out_t = vec![0f32; rows * m];
    out_t.par_chunks_mut(m).enumerate().for_each(|(r, dst)| {
        let mut acc = [0f32; 8];
        for (i, slot) in dst.iter_mut().enumerate() {
            let xi = &x[i * cols..(i + 1) * cols];
            let mut total = 0f32;
            let mut c = 0;
            while c < cols {
                let e = r * cols + c;
                let block_end = ((e / BLOCK) + 1) * BLOCK;
                let run = (block_end - e).min(cols - c);
                let scale = absmax[e / BLOCK];
                let mut partial = 0f32;
                if e % 8 == 0 && run % 16 == 0 {
                    // 16 elements = 8 bytes = 2 words per iteration, 8 accumulators.
                    acc.fill(0.0);
                    let mut k = 0;
                    while k < run {
                        let w0 = words[(e + k) / 8];
                        let w1 = words[(e + k) / 8 + 1];
                        for (j, word) in [w0, w1].into_iter().enumerate() {
                            for b in 0..4 {
                                let [a0, a1] = pairs[((word >> (8 * b)) & 0xff) as usize];
                                let base = c + k + j * 8 + 2 * b;
                                acc[2 * b] += a0 * xi[base];
                                acc[2 * b + 1] += a1 * xi[base + 1];
                            }
                        }
                        k += 16;
                    }
                    partial = acc.iter().sum();
                } else {
                    for k in 0..run {
                        partial += code_at(words, table, e + k) * xi[c + k];
                    }
                }
                total += partial * scale;
                c += run;
            }
            *slot = total;
        }
    });
    let mut out = vec![0f32; m * rows];
    for r in 0..rows {
        for i in 0..m {
            out[i * rows + r] = out_t[r * m + i];
        }
    }
    out
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
    use crate::nf4::format::{dequantize_nf4, quantize_nf4, NF4_CODE};

    fn weight(rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols).map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * (1.0 + (i / 64) as f32 * 0.01)).collect()
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
    fn fused_linear_matches_dequantize_then_matmul() {
        for (rows, cols, m) in [(6, 64, 1), (3, 160, 2), (5, 96, 3), (2, 7, 2)] {
            let w = weight(rows, cols);
            let q = quantize_nf4(&w);
            let words = pack_words(&q.packed);
            let dense = dequantize_nf4(&q.packed, &q.absmax, rows * cols);
            let x: Vec<f32> = (0..m * cols).map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0).collect();
            let y = linear(&x, m, &words, &q.absmax, &NF4_CODE, rows, cols);
            for i in 0..m {
                for r in 0..rows {
                    let want: f32 = (0..cols).map(|c| x[i * cols + c] * dense[r * cols + c]).sum();
                    assert!((y[i * rows + r] - want).abs() < 1e-4, "{rows}x{cols} m={m}: {} vs {want}", y[i * rows + r]);
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
