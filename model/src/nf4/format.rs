//! The NF4 format exactly as bitsandbytes stores it, on the host: the code table, quantization
//! of a weight into packed nibbles and per-block absmax, double quantization of absmax, and
//! dequantization. These functions define the format; the backend kernels in
//! [`super::cpu`] and `super::kernel` compute the same numbers on device.
//!
//! Layout (bitsandbytes `quantize_4bit(blocksize=64, quant_type="nf4")`):
//! - the weight `[rows, cols]` is flattened row-major and cut into blocks of 64 elements
//!   (the last block may be short);
//! - each block stores `absmax = max |w|` as f32, and each element the index of the code-table
//!   entry nearest to `w / absmax` (bitsandbytes' decision tree: thresholds at the midpoints of
//!   adjacent entries, a value on a threshold goes down); an all-zero block stores code 7 (0.0);
//! - two codes per byte, the even element in the high nibble;
//! - with double quantization, absmax is stored as 8-bit codes of bitsandbytes' signed dynamic
//!   map, in blocks of 256 around `offset = mean(absmax)`, each block with its own f32 scale
//!   (`nested_absmax`); dequantized absmax is `dynamic[q] * nested_absmax[i / 256] + offset`.
//!   The 8-bit codes follow bitsandbytes' CPU kernel to the bit: its 65536-bin lookup table
//!   rather than the nearest entry, and torch's own summation order for the mean.

/// The 16 NF4 values, as bitsandbytes' `CODE["nf4"]` (f32).
// The literals are bitsandbytes' own, digit for digit, so they can be checked against its source.
#[allow(clippy::excessive_precision)]
pub const NF4_CODE: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// Elements per absmax block.
pub const BLOCK: usize = 64;
/// absmax values per nested block under double quantization.
pub const NESTED_BLOCK: usize = 256;

/// Decision thresholds of bitsandbytes' `dQuantizeNF4`, as the decimal literals in its kernels
/// (the shortest decimal forms of the f64 midpoints of adjacent code values) read as f32. Reading
/// the literal matters: the f64 midpoint of 0.72295684 and 1.0 is an exact f32 tie that rounds
/// up, while its printed literal rounds down.
#[allow(clippy::excessive_precision)]
const NF4_THRESHOLDS: [f32; 15] = [
    -0.848_096_400_499_343_9,
    -0.610_632_926_225_662_2,
    -0.459_995_269_775_390_6,
    -0.339_679_434_895_515_44,
    -0.234_607_405_960_559_84,
    -0.137_911_733_239_889_14,
    -0.045_525_018_125_772_476,
    0.039_790_149_778_127_67,
    0.120_255_250_483_751_3,
    0.203_521_251_678_466_8,
    0.292_013_771_831_989_3,
    0.389_312_535_524_368_3,
    0.501_663_416_624_069_2,
    0.642_786_920_070_648_2,
    0.861_478_418_111_801_1,
];

/// The NF4 code of a value already scaled to [-1, 1]: the number of thresholds it exceeds
/// (equivalent to bitsandbytes' decision tree; NaN compares false everywhere and maps to 0).
fn quantize_scaled(x: f32) -> u8 {
    NF4_THRESHOLDS.iter().take_while(|&&t| x > t).count() as u8
}

/// A weight quantized to NF4 with plain (f32) absmax.
#[derive(Clone, Debug, PartialEq)]
pub struct Nf4Quantized {
    /// Two codes per byte, even element in the high nibble; `ceil(n / 2)` bytes.
    pub packed: Vec<u8>,
    /// One f32 scale per block of [`BLOCK`] elements.
    pub absmax: Vec<f32>,
}

/// Quantizes a row-major flattened weight to NF4 exactly as bitsandbytes does.
pub fn quantize_nf4(weight: &[f32]) -> Nf4Quantized {
    let n = weight.len();
    let mut codes = Vec::with_capacity(n + 1);
    let mut absmax = Vec::with_capacity(n.div_ceil(BLOCK));
    for block in weight.chunks(BLOCK) {
        let max = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        absmax.push(max);
        if max == 0.0 {
            codes.extend(std::iter::repeat_n(7u8, block.len()));
        } else {
            let scale = 1.0 / max;
            codes.extend(
                block
                    .iter()
                    .map(|v| quantize_scaled((v * scale).clamp(-1.0, 1.0))),
            );
        }
    }
    if codes.len() % 2 == 1 {
        codes.push(0);
    }
    let packed = codes.chunks_exact(2).map(|p| (p[0] << 4) | p[1]).collect();
    Nf4Quantized { packed, absmax }
}

/// Dequantizes NF4 codes with f32 absmax back to `n` f32 values (`code * absmax`).
pub fn dequantize_nf4(packed: &[u8], absmax: &[f32], n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let byte = packed[i / 2];
        let code = if i % 2 == 0 { byte >> 4 } else { byte & 0x0f };
        out.push(NF4_CODE[code as usize] * absmax[i / BLOCK]);
    }
    out
}

/// bitsandbytes' signed dynamic 8-bit map (`create_dynamic_map(signed=True)`, the
/// `nested_quant_map` of every double-quantized checkpoint), as f32 bit patterns copied from
/// bitsandbytes 0.50.2's output (`fixtures/nf4-vectors.safetensors`, `dq.nested_code`). It is
/// data, like [`NF4_CODE`]: bitsandbytes builds it with torch's vectorised `linspace`, whose
/// rounding depends on the CPU's vector width, so it is not recomputed here.
const DYNAMIC_MAP_BITS: [u32; 256] = [
    0xbf7e3333, 0xbf7a999a, 0xbf770000, 0xbf736666, 0xbf6fcccd, 0xbf6c3333, 0xbf68999a, 0xbf650000,
    0xbf616666, 0xbf5dcccd, 0xbf5a3333, 0xbf56999a, 0xbf530000, 0xbf4f6666, 0xbf4bcccd, 0xbf483333,
    0xbf44999a, 0xbf410000, 0xbf3d6666, 0xbf39cccd, 0xbf363334, 0xbf32999a, 0xbf2f0000, 0xbf2b6666,
    0xbf27cccd, 0xbf243334, 0xbf20999a, 0xbf1d0000, 0xbf196666, 0xbf15cccd, 0xbf123334, 0xbf0e999a,
    0xbf0b0000, 0xbf076666, 0xbf03cccc, 0xbf003333, 0xbef93332, 0xbef20000, 0xbeeacccc, 0xbee3999a,
    0xbedc6666, 0xbed53333, 0xbece0000, 0xbec6cccc, 0xbebf999a, 0xbeb86666, 0xbeb13333, 0xbeaa0000,
    0xbea2cccc, 0xbe9b999a, 0xbe946666, 0xbe8d3334, 0xbe860000, 0xbe7d9999, 0xbe6f3333, 0xbe60cccd,
    0xbe526666, 0xbe440000, 0xbe35999a, 0xbe273333, 0xbe18cccd, 0xbe0a6666, 0xbdf80000, 0xbddb3334,
    0xbdc9eb85, 0xbdc428f7, 0xbdbe6667, 0xbdb8a3d7, 0xbdb2e148, 0xbdad1eb8, 0xbda75c2a, 0xbda1999a,
    0xbd9bd70a, 0xbd96147b, 0xbd9051eb, 0xbd8a8f5d, 0xbd84cccd, 0xbd7e147b, 0xbd728f5d, 0xbd670a3d,
    0xbd5b851f, 0xbd500000, 0xbd447ae1, 0xbd38f5c3, 0xbd2d70a3, 0xbd21eb85, 0xbd166667, 0xbd0ae148,
    0xbcfeb852, 0xbce7ae15, 0xbcd0a3d7, 0xbcb9999a, 0xbca28f5d, 0xbc8b851f, 0xbc68f5c3, 0xbc3ae148,
    0xbc1f3b64, 0xbc160418, 0xbc0ccccd, 0xbc039581, 0xbbf4bc6a, 0xbbe24dd3, 0xbbcfdf3b, 0xbbbd70a4,
    0xbbab020d, 0xbb989374, 0xbb8624dd, 0xbb676c8a, 0xbb428f5c, 0xbb1db22d, 0xbaf1a9fc, 0xbaa7ef9d,
    0xba7765ff, 0xba59e83e, 0xba3c6a80, 0xba1eecc1, 0xba016f01, 0xb9c7e283, 0xb98ce705, 0xb923d70b,
    0xb8ba1f4b, 0xb88aefb3, 0xb8378034, 0xb7b24206, 0xb70205ff, 0xb65a1a94, 0xb513a3b7, 0x00000000,
    0x3513a3b7, 0x365a1a94, 0x370205ff, 0x37b24206, 0x38378034, 0x388aefb3, 0x38ba1f4b, 0x3923d70b,
    0x398ce705, 0x39c7e283, 0x3a016f01, 0x3a1eecc1, 0x3a3c6a80, 0x3a59e83e, 0x3a7765ff, 0x3aa7ef9d,
    0x3af1a9fc, 0x3b1db22d, 0x3b428f5c, 0x3b676c8a, 0x3b8624dd, 0x3b989374, 0x3bab020d, 0x3bbd70a4,
    0x3bcfdf3b, 0x3be24dd3, 0x3bf4bc6a, 0x3c039581, 0x3c0ccccd, 0x3c160418, 0x3c1f3b64, 0x3c3ae148,
    0x3c68f5c3, 0x3c8b851f, 0x3ca28f5d, 0x3cb9999a, 0x3cd0a3d7, 0x3ce7ae15, 0x3cfeb852, 0x3d0ae148,
    0x3d166667, 0x3d21eb85, 0x3d2d70a3, 0x3d38f5c3, 0x3d447ae1, 0x3d500000, 0x3d5b851f, 0x3d670a3d,
    0x3d728f5d, 0x3d7e147b, 0x3d84cccd, 0x3d8a8f5d, 0x3d9051eb, 0x3d96147b, 0x3d9bd70a, 0x3da1999a,
    0x3da75c2a, 0x3dad1eb8, 0x3db2e148, 0x3db8a3d7, 0x3dbe6667, 0x3dc428f7, 0x3dc9eb85, 0x3ddb3334,
    0x3df80000, 0x3e0a6666, 0x3e18cccd, 0x3e273333, 0x3e35999a, 0x3e440000, 0x3e526666, 0x3e60cccd,
    0x3e6f3333, 0x3e7d9999, 0x3e860000, 0x3e8d3334, 0x3e946666, 0x3e9b999a, 0x3ea2cccc, 0x3eaa0000,
    0x3eb13333, 0x3eb86666, 0x3ebf999a, 0x3ec6cccc, 0x3ece0000, 0x3ed53333, 0x3edc6666, 0x3ee3999a,
    0x3eeacccc, 0x3ef20000, 0x3ef93332, 0x3f003333, 0x3f03cccc, 0x3f076666, 0x3f0b0000, 0x3f0e999a,
    0x3f123334, 0x3f15cccd, 0x3f196666, 0x3f1d0000, 0x3f20999a, 0x3f243334, 0x3f27cccd, 0x3f2b6666,
    0x3f2f0000, 0x3f32999a, 0x3f363334, 0x3f39cccd, 0x3f3d6666, 0x3f410000, 0x3f44999a, 0x3f483333,
    0x3f4bcccd, 0x3f4f6666, 0x3f530000, 0x3f56999a, 0x3f5a3333, 0x3f5dcccd, 0x3f616666, 0x3f650000,
    0x3f68999a, 0x3f6c3333, 0x3f6fcccd, 0x3f736666, 0x3f770000, 0x3f7a999a, 0x3f7e3333, 0x3f800000,
];

/// The signed dynamic 8-bit map used for double quantization (see [`DYNAMIC_MAP_BITS`]).
pub fn dynamic_map() -> [f32; 256] {
    DYNAMIC_MAP_BITS.map(f32::from_bits)
}

/// absmax quantized to 8 bits (double quantization).
#[derive(Clone, Debug, PartialEq)]
pub struct NestedAbsmax {
    /// One 8-bit code per absmax value.
    pub quantized: Vec<u8>,
    /// One f32 scale per block of [`NESTED_BLOCK`] absmax values.
    pub nested_absmax: Vec<f32>,
    /// The 256-entry code table (`nested_quant_map`).
    pub nested_code: Vec<f32>,
    /// The mean subtracted before quantizing.
    pub offset: f32,
}

/// Double-quantizes absmax as bitsandbytes 0.50's CPU path does
/// (`quantize_4bit(compress_statistics=True)` on a CPU tensor): subtract `offset =
/// absmax.mean()` (torch's CPU sum, see [`torch_sum`]; `torch_threads` is the intra-op thread
/// count torch ran with, which changes the sum once there are 32768 or more absmax values), then
/// `quantize_blockwise` in blocks of 256 with the dynamic map ([`quantize_blockwise_cpu`]).
pub fn quantize_absmax(absmax: &[f32], torch_threads: usize) -> NestedAbsmax {
    let code = dynamic_map();
    let offset = if absmax.is_empty() {
        0.0
    } else {
        torch_sum(absmax, torch_threads) / absmax.len() as f32
    };
    let centred: Vec<f32> = absmax.iter().map(|a| a - offset).collect();
    let (quantized, nested) = quantize_blockwise_cpu(&centred, &code, NESTED_BLOCK);
    NestedAbsmax {
        quantized,
        nested_absmax: nested,
        nested_code: code.to_vec(),
        offset,
    }
}

/// Bins of bitsandbytes' quantization lookup table.
const LUT_SIZE: usize = 65536;

/// bitsandbytes' CPU lookup table from a normalised value's bin to the code-table index
/// (`build_quantize_lut` in `csrc/cpu_ops.cpp`): bin `i` stands for
/// `(2i as f32) / 65535 - 1`, and takes the first entry whose midpoint with the next entry is not
/// below it. Values near a midpoint can land one entry away from the nearest one; that is the
/// rule bitsandbytes' bytes follow, so it is the rule here.
fn quantize_lut(code: &[f32; 256]) -> Vec<u8> {
    let mids: Vec<f32> = code.windows(2).map(|p| 0.5 * (p[0] + p[1])).collect();
    let mut lut = vec![0u8; LUT_SIZE];
    let mut idx = 0;
    for (i, slot) in lut.iter_mut().enumerate() {
        let val = (i as f32 + i as f32) / (LUT_SIZE - 1) as f32 - 1.0;
        while idx < mids.len() && mids[idx] < val {
            idx += 1;
        }
        *slot = idx as u8;
    }
    lut
}

/// The lookup-table bin of a normalised value, as bitsandbytes' `norm_to_lut_index` computes it
/// in its x86-64 build: clamp to [-1, 1], `(v + 1) * 0.5`, then one fused multiply-add
/// `· 65535 + 0.5` (the compiler contracts it; a separate multiply and add can differ in the
/// last bit and change the bin) and truncation. NaN lands in bin 0, as there.
fn lut_bin(v: f32) -> usize {
    let half = (v.clamp(-1.0, 1.0) + 1.0) * 0.5;
    half.mul_add((LUT_SIZE - 1) as f32, 0.5) as u16 as usize
}

/// bitsandbytes' CPU `quantize_blockwise` (`quantize_cpu` in `csrc/cpu_ops.cpp`, 0.50): per
/// block of `blocksize` values, `absmax = max |v|`, each value multiplied by `1 / absmax` and
/// mapped to an 8-bit index of `code` through the lookup table; an all-zero block stores index 0.
/// Returns the indices and one absmax per block.
pub fn quantize_blockwise_cpu(
    values: &[f32],
    code: &[f32; 256],
    blocksize: usize,
) -> (Vec<u8>, Vec<f32>) {
    let lut = quantize_lut(code);
    let mut out = Vec::with_capacity(values.len());
    let mut absmax = Vec::with_capacity(values.len().div_ceil(blocksize.max(1)));
    for block in values.chunks(blocksize.max(1)) {
        let max = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        absmax.push(max);
        if max == 0.0 {
            out.extend(std::iter::repeat_n(0u8, block.len()));
            continue;
        }
        let inv = 1.0 / max;
        out.extend(block.iter().map(|v| lut[lut_bin(v * inv)]));
    }
    (out, absmax)
}

/// Dequantizes double-quantized absmax: `code[q] * nested_absmax[i / 256] + offset`.
pub fn dequantize_absmax(
    quantized: &[u8],
    nested_absmax: &[f32],
    nested_code: &[f32],
    offset: f32,
) -> Vec<f32> {
    quantized
        .iter()
        .enumerate()
        .map(|(i, &q)| nested_code[q as usize] * nested_absmax[i / NESTED_BLOCK] + offset)
        .collect()
}

/// Elements below which torch sums on one thread whatever its thread count
/// (`at::internal::GRAIN_SIZE`).
const TORCH_GRAIN: usize = 32768;

/// Lanes of torch's `Vectorized<float>` in the sum kernel this torch build dispatches to on
/// x86-64 (8: its AVX2 kernel, measured on an AVX-512 machine as well).
const TORCH_LANES: usize = 8;

/// The f32 sum torch computes for a contiguous CPU tensor (`x.sum()`, hence `x.mean()` =
/// sum / n): with `threads` intra-op threads and at least [`TORCH_GRAIN`] values, the values
/// are cut into `min(threads, ceil(n / GRAIN))` equal chunks summed separately and then added
/// up; each chunk is summed by [`torch_chunk_sum`]. Matches torch 2.15 bit for bit (tested
/// against it for 16 to 400,000 values and 1 to 8 threads when this was written).
pub fn torch_sum(values: &[f32], threads: usize) -> f32 {
    let n = values.len();
    if n < TORCH_GRAIN || threads <= 1 {
        return torch_chunk_sum(values);
    }
    let chunks = threads.min(n.div_ceil(TORCH_GRAIN));
    let size = n.div_ceil(chunks);
    // One slot per thread (zero where a thread had no chunk), then summed like any tensor.
    let mut partials = vec![0f32; threads];
    for (slot, chunk) in partials.iter_mut().zip(values.chunks(size)) {
        *slot = torch_chunk_sum(chunk);
    }
    torch_chunk_sum(&partials)
}

/// torch's `cascade_sum` over one contiguous range (`SumKernel.cpp`): vectors of
/// [`TORCH_LANES`] values, taken four at a time into four vector accumulators
/// ([`torch_multi_row_sum`]), leftover vectors added to the first, the four added in order, then
/// the scalar tail and finally the lanes added one by one to zero. Under [`TORCH_LANES`] values
/// the same scheme runs on scalars: four accumulators take values `0..4`, the rest go to the
/// first, then the four are added in order.
fn torch_chunk_sum(values: &[f32]) -> f32 {
    const ILP: usize = 4;
    let n = values.len();
    if n < TORCH_LANES {
        let mut partial = [0f32; ILP];
        let head = n / ILP * ILP;
        for (p, v) in partial.iter_mut().zip(&values[..head]) {
            *p += v;
        }
        for v in &values[head..] {
            partial[0] += v;
        }
        return partial[1..].iter().fold(partial[0], |s, p| s + p);
    }
    let vectors = n / TORCH_LANES;
    let rows = vectors / ILP;
    let mut partial = torch_multi_row_sum(&values[..rows * ILP * TORCH_LANES], rows);
    for v in rows * ILP..vectors {
        let vector = &values[v * TORCH_LANES..(v + 1) * TORCH_LANES];
        for (a, x) in partial[0].iter_mut().zip(vector) {
            *a += x;
        }
    }
    for k in 1..ILP {
        let row = partial[k];
        for (a, x) in partial[0].iter_mut().zip(row) {
            *a += x;
        }
    }
    let mut total = 0f32;
    for v in &values[vectors * TORCH_LANES..] {
        total += v;
    }
    for lane in partial[0] {
        total += lane;
    }
    total
}

/// torch's `multi_row_sum` of `size` rows of four [`TORCH_LANES`]-wide vectors: four levels of
/// accumulators, each level receiving the one below every `2^level_power` rows
/// (`level_power = max(4, ceil(log2(size)) / 4)`).
fn torch_multi_row_sum(values: &[f32], size: usize) -> [[f32; TORCH_LANES]; 4] {
    const LEVELS: usize = 4;
    const ROW: usize = 4 * TORCH_LANES;
    let ceil_log2 = if size <= 1 {
        0
    } else {
        (usize::BITS - (size - 1).leading_zeros()) as usize
    };
    let power = (ceil_log2 / LEVELS).max(4);
    let step = 1usize << power;
    let mask = step - 1;
    let mut acc = [[0f32; ROW]; LEVELS];
    let add_row = |acc: &mut [f32; ROW], i: usize| {
        for (a, x) in acc.iter_mut().zip(&values[i * ROW..(i + 1) * ROW]) {
            *a += x;
        }
    };
    let mut i = 0;
    while i + step <= size {
        for _ in 0..step {
            add_row(&mut acc[0], i);
            i += 1;
        }
        for j in 1..LEVELS {
            let below = acc[j - 1];
            for (a, x) in acc[j].iter_mut().zip(below) {
                *a += x;
            }
            acc[j - 1] = [0.0; ROW];
            if i & (mask << (j * power)) != 0 {
                break;
            }
        }
    }
    while i < size {
        add_row(&mut acc[0], i);
        i += 1;
    }
    for j in 1..LEVELS {
        let level = acc[j];
        for (a, x) in acc[0].iter_mut().zip(level) {
            *a += x;
        }
    }
    let mut out = [[0f32; TORCH_LANES]; 4];
    for (k, row) in out.iter_mut().enumerate() {
        row.copy_from_slice(&acc[0][k * TORCH_LANES..(k + 1) * TORCH_LANES]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thresholds_are_the_midpoints_of_the_code_table() {
        for (i, t) in NF4_THRESHOLDS.iter().enumerate() {
            let mid = (NF4_CODE[i] as f64 + NF4_CODE[i + 1] as f64) / 2.0;
            assert!((*t as f64 - mid).abs() < 1e-7, "threshold {i}");
            assert_eq!(
                quantize_scaled(*t),
                i as u8,
                "a value on threshold {i} goes down"
            );
            // the next f32 above the threshold goes up
            let above = if *t > 0.0 {
                t.to_bits() + 1
            } else {
                t.to_bits() - 1
            };
            assert_eq!(quantize_scaled(f32::from_bits(above)), i as u8 + 1);
        }
        assert_eq!(quantize_scaled(f32::NAN), 0);
    }

    #[test]
    fn round_trip_is_close_and_codes_are_exact_on_table_values() {
        let w: Vec<f32> = NF4_CODE.iter().map(|c| c * 0.5).collect();
        let q = quantize_nf4(&w);
        let back = dequantize_nf4(&q.packed, &q.absmax, w.len());
        assert_eq!(back, w);
    }

    #[test]
    fn zero_block_quantizes_to_zero() {
        let q = quantize_nf4(&[0.0; 64]);
        assert!(q.packed.iter().all(|&b| b == 0x77));
        assert_eq!(dequantize_nf4(&q.packed, &q.absmax, 64), vec![0.0; 64]);
    }

    #[test]
    fn odd_length_pads_the_last_nibble() {
        let q = quantize_nf4(&[1.0, -1.0, 0.5]);
        assert_eq!(q.packed.len(), 2);
        assert_eq!(q.packed[0], 0xf0);
    }

    #[test]
    fn torch_sum_follows_torch_order() {
        // Under 8 values: four accumulators, the fifth value joins the first (torch gives 3).
        assert_eq!(torch_sum(&[1e8, 1.0, 1.0, 1.0, -1e8], 1), 3.0);
        // Two vectors of 8 lanes added lane-wise, then the lanes in order (torch gives 3).
        let mut v = vec![1e8, 1.0, 1.0, 1.0, -1e8, 0.0, 0.0, 0.0];
        v.extend([1.0; 8]);
        assert_eq!(torch_sum(&v, 1), 3.0);
        assert_eq!(torch_sum(&[], 4), 0.0);
    }

    #[test]
    fn lookup_table_is_monotone_and_spans_the_code() {
        let lut = quantize_lut(&dynamic_map());
        assert!(lut.windows(2).all(|p| p[0] <= p[1]));
        assert_eq!((lut[0], lut[LUT_SIZE - 1]), (0, 255));
        assert_eq!(lut_bin(-1.0), 0);
        assert_eq!(lut_bin(1.0), LUT_SIZE - 1);
        assert_eq!(lut_bin(7.0), LUT_SIZE - 1);
        assert_eq!(lut_bin(f32::NAN), 0);
    }

    #[test]
    fn blockwise_quantization_scales_each_block() {
        let code = dynamic_map();
        let (q, absmax) = quantize_blockwise_cpu(&[0.0, 0.0, -2.0, 1.0, 2.0], &code, 2);
        assert_eq!(absmax, vec![0.0, 2.0, 2.0]);
        // an all-zero block stores index 0; -1 and 1 are the code's ends
        assert_eq!(q[..2], [0, 0]);
        assert_eq!((q[2], q[4]), (0, 255));
        assert_eq!(code[q[3] as usize], code[q[3] as usize].clamp(0.49, 0.51));
    }
}
