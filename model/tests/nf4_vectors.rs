//! NF4 quantization reproduces bitsandbytes' bytes exactly (`fixtures/nf4-vectors.safetensors`,
//! and `fixtures/nf4-double-quant.safetensors` for double quantization at scale).

use std::path::{Path, PathBuf};

use fathom_model::checkpoint::Checkpoint;
use fathom_model::nf4::format::{
    NF4_CODE, dequantize_absmax, dequantize_nf4, dynamic_map, quantize_absmax, quantize_nf4,
};

fn open_fixture(file: &str) -> Checkpoint {
    let path = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures")).join(file);
    Checkpoint::open_files(Path::new("fixtures"), &[path]).expect("fixture opens")
}

fn vectors() -> Checkpoint {
    open_fixture("nf4-vectors.safetensors")
}

/// Asserts two f32 slices are identical, reporting the first difference compactly.
fn assert_same(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        let max = got
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        panic!(
            "{what}: first difference at {i}: {} vs {} (max |diff| {max})",
            got[i], want[i]
        );
    }
}

fn f32s(ck: &Checkpoint, name: &str) -> Vec<f32> {
    let shape = ck.shape(name).unwrap();
    ck.f32(name, &shape).unwrap()
}

#[test]
fn code_table_matches_bitsandbytes() {
    let ck = vectors();
    assert_eq!(f32s(&ck, "plain.code"), NF4_CODE.to_vec());
    assert_eq!(f32s(&ck, "dq.code"), NF4_CODE.to_vec());
}

#[test]
fn plain_quantization_is_byte_exact() {
    let ck = vectors();
    let weight = f32s(&ck, "weight");
    let q = quantize_nf4(&weight);
    let (_, packed) = ck.u8("plain.packed").unwrap();
    let mismatches = q.packed.iter().zip(packed).filter(|(a, b)| a != b).count();
    assert_eq!(mismatches, 0, "packed bytes differ from bitsandbytes");
    assert_eq!(q.packed.len(), packed.len());
    assert_same("absmax", &q.absmax, &f32s(&ck, "plain.absmax"));
    check_dequantized(
        &dequantize_nf4(&q.packed, &q.absmax, weight.len()),
        &f32s(&ck, "plain.dequantized"),
        &q.packed,
        &q.absmax,
    );
}

/// bitsandbytes quantizes over flat 64-element blocks of the row-major weight (its packed bytes
/// and absmax above prove it), and its CUDA dequantizer reads them back the same way. Its 0.50.2
/// CPU dequantizer, which made `*.dequantized`, mis-indexes absmax when the row length (160 here)
/// is not a multiple of 64: row `r`, column `c` reads `absmax[r * (160 / 64) + c / 64]`
/// (two blocks per row by integer division, three used). So: our flat dequantization must equal
/// bitsandbytes' output exactly on row 0, where the two readings coincide (and on every row of a
/// real Qwen2 projection, whose widths are multiples of 64), and the fixture must be exactly the
/// mis-indexed reading of the same bytes everywhere — which pins the difference down to that.
fn check_dequantized(ours: &[f32], reference: &[f32], packed: &[u8], absmax: &[f32]) {
    const ROWS: usize = 96;
    const COLS: usize = 160;
    let code = |i: usize| {
        let b = packed[i / 2];
        NF4_CODE[if i % 2 == 0 { b >> 4 } else { b & 0x0f } as usize]
    };
    assert_same("dequantized row 0", &ours[..COLS], &reference[..COLS]);
    let misindexed: Vec<f32> = (0..ROWS * COLS)
        .map(|i| {
            let (r, c) = (i / COLS, i % COLS);
            code(i) * absmax[r * (COLS / 64) + c / 64]
        })
        .collect();
    assert_same("bitsandbytes' CPU reading", &misindexed, reference);
    assert_ne!(
        ours, reference,
        "the quirk should show on rows after the first"
    );
}

#[test]
fn double_quantization_is_byte_exact() {
    let ck = vectors();
    let weight = f32s(&ck, "weight");
    let q = quantize_nf4(&weight);
    let (_, packed) = ck.u8("dq.packed").unwrap();
    assert_eq!(q.packed, packed);
    assert_same("dynamic map", &dynamic_map(), &f32s(&ck, "dq.nested_code"));
    let nested = quantize_absmax(&q.absmax, 1);
    assert_same("offset", &[nested.offset], &f32s(&ck, "dq.offset"));
    assert_same(
        "nested absmax",
        &nested.nested_absmax,
        &f32s(&ck, "dq.nested_absmax"),
    );
    let (_, expected) = ck.u8("dq.absmax_quantized").unwrap();
    assert_eq!(nested.quantized, expected, "8-bit absmax codes differ");
    let absmax = dequantize_absmax(
        &nested.quantized,
        &nested.nested_absmax,
        &nested.nested_code,
        nested.offset,
    );
    check_dequantized(
        &dequantize_nf4(&q.packed, &absmax, weight.len()),
        &f32s(&ck, "dq.dequantized"),
        &q.packed,
        &absmax,
    );
}

/// A 24-bit uniform f32 in [0, 1) hashed from `i`, as `fixtures/nf4_double_quant.py` computes it.
fn uniform(i: u64, seed: u64) -> f32 {
    let h = ((i + seed).wrapping_mul(2_654_435_761)) % (1 << 32);
    let h = ((h ^ (h >> 15)).wrapping_mul(2_246_822_519)) % (1 << 32);
    (h >> 8) as f32 / (1u32 << 24) as f32
}

/// The 3072 × 1024 weight of `fixtures/nf4_double_quant.py`, in the same f32 operations.
fn large_weight() -> Vec<f32> {
    const SEED: u64 = 12346;
    (0..3072u64 * 1024)
        .map(|i| {
            let scale = 0.005f32 + 0.05f32 * uniform(i / 64, SEED + 7919);
            let w = (uniform(i, SEED) - 0.5) * scale;
            if i % 997 == 0 { w * 8.0 } else { w }
        })
        .collect()
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// 49,152 absmax blocks: bitsandbytes' lookup-table quantizer (whose bins put some values one
/// code away from the nearest entry) and torch's chunked mean (whose last bit depends on the
/// thread count here) are both reproduced to the byte.
#[test]
fn double_quantization_of_a_large_weight_is_byte_exact() {
    let ck = open_fixture("nf4-double-quant.safetensors");
    let q = quantize_nf4(&large_weight());
    let want_hash = u64::from_le_bytes(ck.raw("packed_fnv1a").unwrap().data.try_into().unwrap());
    assert_eq!(fnv1a(&q.packed), want_hash, "packed codes differ");
    assert_same("absmax", &q.absmax, &f32s(&ck, "plain.absmax"));
    let offsets: Vec<f32> = [1, 2]
        .iter()
        .map(|t| f32s(&ck, &format!("t{t}.offset"))[0])
        .collect();
    assert_ne!(
        offsets[0], offsets[1],
        "the fixture should show the thread count's effect"
    );
    for threads in [1, 2] {
        let nested = quantize_absmax(&q.absmax, threads);
        let what = |s: &str| format!("{threads} thread(s): {s}");
        assert_same(
            &what("offset"),
            &[nested.offset],
            &f32s(&ck, &format!("t{threads}.offset")),
        );
        assert_same(
            &what("nested absmax"),
            &nested.nested_absmax,
            &f32s(&ck, &format!("t{threads}.nested_absmax")),
        );
        let (_, expected) = ck.u8(&format!("t{threads}.absmax_quantized")).unwrap();
        let differing = nested
            .quantized
            .iter()
            .zip(expected)
            .filter(|(a, b)| a != b)
            .count();
        assert_eq!(differing, 0, "{}", what("8-bit absmax codes differ"));
        assert_eq!(nested.quantized.len(), expected.len());
    }
}
