//! ggml's tensor types and their dequantization to f32, following ggml's reference C
//! (`dequantize_row_*` in `ggml-quants.c`) operation for operation, so results agree with it and
//! with the `gguf` Python package bit for bit.
//!
//! Every quantized type stores a row as independent blocks. The legacy types hold 32 weights per
//! block: Q4_0 / Q5_0 / Q8_0 a scale `d` (`x = d·q`), Q4_1 / Q5_1 also a minimum `m`
//! (`x = d·q + m`); Q5 types keep the fifth bit of each weight in a 32-bit mask. The k-quants hold
//! 256 weights per block in sub-blocks of 16 or 32 with 4- to 8-bit sub-scales of a block scale.

use half::{bf16, f16};

/// The ggml tensor types this crate dequantizes, with ggml's numeric ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// bfloat16.
    BF16,
    /// 4-bit, scale only, 32 per block.
    Q4_0,
    /// 4-bit, scale and minimum, 32 per block.
    Q4_1,
    /// 5-bit, scale only, 32 per block.
    Q5_0,
    /// 5-bit, scale and minimum, 32 per block.
    Q5_1,
    /// 8-bit, scale only, 32 per block.
    Q8_0,
    /// k-quant, 2-bit with 4-bit sub-scales and minimums.
    Q2_K,
    /// k-quant, 3-bit with 6-bit sub-scales.
    Q3_K,
    /// k-quant, 4-bit with 6-bit sub-scales and minimums.
    Q4_K,
    /// k-quant, 5-bit with 6-bit sub-scales and minimums.
    Q5_K,
    /// k-quant, 6-bit with 8-bit sub-scales.
    Q6_K,
}

/// ggml's name for a type id, for error messages (`unknown` for ids ggml does not define).
pub fn type_name(id: u32) -> &'static str {
    const NAMES: [&str; 40] = [
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2",
        "Q4_3",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "Q4_0_4_4",
        "Q4_0_4_8",
        "Q4_0_8_8",
        "TQ1_0",
        "TQ2_0",
        "IQ4_NL_4_4",
        "IQ4_NL_4_8",
        "IQ4_NL_8_8",
        "MXFP4",
    ];
    NAMES.get(id as usize).copied().unwrap_or("unknown")
}

const QK_K: usize = 256;

impl GgmlType {
    /// Every supported type.
    pub const ALL: [GgmlType; 13] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];

    /// The type with ggml id `id`, if supported.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2_K,
            11 => GgmlType::Q3_K,
            12 => GgmlType::Q4_K,
            13 => GgmlType::Q5_K,
            14 => GgmlType::Q6_K,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    /// ggml's numeric id.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2_K => 10,
            GgmlType::Q3_K => 11,
            GgmlType::Q4_K => 12,
            GgmlType::Q5_K => 13,
            GgmlType::Q6_K => 14,
            GgmlType::BF16 => 30,
        }
    }

    /// ggml's name (`Q4_1`).
    pub fn name(self) -> &'static str {
        type_name(self.id())
    }

    /// Weights per block.
    pub fn block_len(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
                32
            }
            _ => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 2 + 16,
            GgmlType::Q4_1 => 2 + 2 + 16,
            GgmlType::Q5_0 => 2 + 4 + 16,
            GgmlType::Q5_1 => 2 + 2 + 4 + 16,
            GgmlType::Q8_0 => 2 + 32,
            GgmlType::Q2_K => 16 + 64 + 2 + 2,
            GgmlType::Q3_K => 32 + 64 + 12 + 2,
            GgmlType::Q4_K => 2 + 2 + 12 + 128,
            GgmlType::Q5_K => 2 + 2 + 12 + 32 + 128,
            GgmlType::Q6_K => 128 + 64 + 16 + 2,
        }
    }

    /// Dequantizes whole blocks. `bytes.len()` must be a multiple of [`Self::block_bytes`]
    /// (the reader guarantees it); the result has `block_len` values per block.
    pub fn dequantize(self, bytes: &[u8]) -> Vec<f32> {
        let bb = self.block_bytes();
        assert!(
            bytes.len().is_multiple_of(bb),
            "{} bytes are not whole {} blocks",
            bytes.len(),
            self.name()
        );
        let mut out = vec![0f32; bytes.len() / bb * self.block_len()];
        let blocks = bytes
            .chunks_exact(bb)
            .zip(out.chunks_exact_mut(self.block_len()));
        match self {
            GgmlType::F32 => blocks.for_each(|(b, y)| y[0] = f32::from_le_bytes(arr(b, 0))),
            GgmlType::F16 => blocks.for_each(|(b, y)| y[0] = half16(b, 0)),
            GgmlType::BF16 => {
                blocks.for_each(|(b, y)| y[0] = bf16::from_le_bytes(arr(b, 0)).to_f32())
            }
            GgmlType::Q4_0 => blocks.for_each(|(b, y)| q4_0(b, y)),
            GgmlType::Q4_1 => blocks.for_each(|(b, y)| q4_1(b, y)),
            GgmlType::Q5_0 => blocks.for_each(|(b, y)| q5_0(b, y)),
            GgmlType::Q5_1 => blocks.for_each(|(b, y)| q5_1(b, y)),
            GgmlType::Q8_0 => blocks.for_each(|(b, y)| q8_0(b, y)),
            GgmlType::Q2_K => blocks.for_each(|(b, y)| q2_k(b, y)),
            GgmlType::Q3_K => blocks.for_each(|(b, y)| q3_k(b, y)),
            GgmlType::Q4_K => blocks.for_each(|(b, y)| q4_k(b, y)),
            GgmlType::Q5_K => blocks.for_each(|(b, y)| q5_k(b, y)),
            GgmlType::Q6_K => blocks.for_each(|(b, y)| q6_k(b, y)),
        }
        out
    }
}

fn arr<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    b[at..at + N].try_into().expect("in-block slice")
}

fn half16(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes(arr(b, at)).to_f32()
}

/// `{f16 d; u8 qs[16]}`: low nibbles are weights 0..16, high nibbles 16..32, offset by 8.
fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = half16(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

/// `{f16 d; f16 m; u8 qs[16]}`: `x = q·d + m`.
fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (half16(b, 0), half16(b, 2));
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0F) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// The fifth bits of Q5 weights j and j + 16, from the 32-bit mask `qh`.
fn high_bits(qh: u32, j: usize) -> (u8, u8) {
    (
        (((qh >> j) << 4) & 0x10) as u8,
        ((qh >> (j + 12)) & 0x10) as u8,
    )
}

/// `{f16 d; u8 qh[4]; u8 qs[16]}`: 5-bit weights offset by 16.
fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = half16(b, 0);
    let qh = u32::from_le_bytes(arr(b, 2));
    let qs = &b[6..22];
    for j in 0..16 {
        let (h0, h1) = high_bits(qh, j);
        y[j] = (((qs[j] & 0x0F) | h0) as i32 - 16) as f32 * d;
        y[j + 16] = (((qs[j] >> 4) | h1) as i32 - 16) as f32 * d;
    }
}

/// `{f16 d; f16 m; u8 qh[4]; u8 qs[16]}`: `x = q·d + m` with 5-bit `q`.
fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (half16(b, 0), half16(b, 2));
    let qh = u32::from_le_bytes(arr(b, 4));
    let qs = &b[8..24];
    for j in 0..16 {
        let (h0, h1) = high_bits(qh, j);
        y[j] = ((qs[j] & 0x0F) | h0) as f32 * d + m;
        y[j + 16] = ((qs[j] >> 4) | h1) as f32 * d + m;
    }
}

/// `{f16 d; i8 qs[32]}`.
fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = half16(b, 0);
    for (j, &q) in b[2..34].iter().enumerate() {
        y[j] = q as i8 as f32 * d;
    }
}

/// `{u8 scales[16]; u8 qs[64]; f16 d; f16 dmin}`: 2-bit weights, each sub-block of 16 with a
/// 4-bit scale (low nibble) and a 4-bit minimum (high nibble).
fn q2_k(b: &[u8], y: &mut [f32]) {
    let scales = &b[0..16];
    let (d, min) = (half16(b, 80), half16(b, 82));
    let mut is = 0;
    let mut out = 0;
    for half in 0..2 {
        let q = &b[16 + 32 * half..16 + 32 * half + 32];
        for shift in [0, 2, 4, 6] {
            for part in 0..2 {
                let sc = scales[is];
                is += 1;
                let (dl, ml) = (d * (sc & 0x0F) as f32, min * (sc >> 4) as f32);
                for l in 0..16 {
                    y[out] = dl * ((q[l + 16 * part] >> shift) & 3) as f32 - ml;
                    out += 1;
                }
            }
        }
    }
}

/// `{u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d}`: 2 low bits in `qs`, the third (inverted,
/// worth −4 when clear) in `hmask`; sixteen 6-bit scales offset by 32, packed in 12 bytes.
fn q3_k(b: &[u8], y: &mut [f32]) {
    let hmask = &b[0..32];
    let d = half16(b, 108);
    let a: [u32; 3] = std::array::from_fn(|i| u32::from_le_bytes(arr(b, 96 + 4 * i)));
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let aux = [
        (a[0] & KMASK2) | ((a[2] & KMASK1) << 4),
        (a[1] & KMASK2) | (((a[2] >> 2) & KMASK1) << 4),
        ((a[0] >> 4) & KMASK2) | (((a[2] >> 4) & KMASK1) << 4),
        ((a[1] >> 4) & KMASK2) | (((a[2] >> 6) & KMASK1) << 4),
    ];
    let scales: Vec<i8> = aux
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .map(|v| v as i8)
        .collect();
    let mut is = 0;
    let mut out = 0;
    let mut m = 1u8;
    for half in 0..2 {
        let q = &b[32 + 32 * half..32 + 32 * half + 32];
        for shift in [0, 2, 4, 6] {
            for part in 0..2 {
                let dl = d * (scales[is] as i32 - 32) as f32;
                is += 1;
                for l in 0..16 {
                    let i = l + 16 * part;
                    let low = ((q[i] >> shift) & 3) as i32;
                    let high = if hmask[i] & m != 0 { 0 } else { 4 };
                    y[out] = dl * (low - high) as f32;
                    out += 1;
                }
            }
            m <<= 1;
        }
    }
}

/// Scale and minimum `j` (0..8) of a Q4_K / Q5_K block: eight 6-bit pairs packed in 12 bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// `{f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}`: eight sub-blocks of 32, `x = d·sc·q − dmin·m`.
fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, min) = (half16(b, 0), half16(b, 2));
    let scales = &b[4..16];
    for chunk in 0..4 {
        let q = &b[16 + 32 * chunk..16 + 32 * chunk + 32];
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        let y = &mut y[64 * chunk..64 * chunk + 64];
        for l in 0..32 {
            y[l] = d1 * (q[l] & 0x0F) as f32 - m1;
            y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

/// `{f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}`: Q4_K with a fifth bit per weight.
fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, min) = (half16(b, 0), half16(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    for chunk in 0..4 {
        let ql = &b[48 + 32 * chunk..48 + 32 * chunk + 32];
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        let (u1, u2) = (1u8 << (2 * chunk), 2u8 << (2 * chunk));
        let y = &mut y[64 * chunk..64 * chunk + 64];
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[l] = d1 * ((ql[l] & 0x0F) + h1) as f32 - m1;
            y[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
        }
    }
}

/// `{u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}`: 6-bit weights offset by 32, sixteen
/// sub-blocks of 16 with 8-bit signed scales.
fn q6_k(b: &[u8], y: &mut [f32]) {
    let d = half16(b, 208);
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let sc = &b[192 + 8 * half..192 + 8 * half + 8];
        let y = &mut y[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |k: usize| d * sc[is + k] as i8 as f32;
            y[l] = s(0) * q1 as f32;
            y[l + 32] = s(2) * q2 as f32;
            y[l + 64] = s(4) * q3 as f32;
            y[l + 96] = s(6) * q4 as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_sizes_match_ggml() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
        }
        // ggml's type_traits: bytes per block.
        let sizes = [
            (GgmlType::Q4_K, 144),
            (GgmlType::Q5_K, 176),
            (GgmlType::Q6_K, 210),
        ];
        for (t, n) in sizes {
            assert_eq!(t.block_bytes(), n, "{}", t.name());
        }
        assert_eq!(GgmlType::Q2_K.block_bytes(), 84);
        assert_eq!(GgmlType::Q3_K.block_bytes(), 110);
        assert_eq!(type_name(16), "IQ2_XXS");
        assert_eq!(type_name(999), "unknown");
    }

    #[test]
    fn q4_1_by_hand() {
        // d = 0.5, m = -1: nibble q gives 0.5·q − 1.
        let mut b = Vec::new();
        b.extend(f16::from_f32(0.5).to_le_bytes());
        b.extend(f16::from_f32(-1.0).to_le_bytes());
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = GgmlType::Q4_1.dequantize(&b);
        assert_eq!(y[0], -1.0);
        assert_eq!(y[15], 6.5);
        assert_eq!(y[16], 6.5);
        assert_eq!(y[31], -1.0);
    }
}
