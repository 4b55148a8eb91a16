//! GGUF import against the `gguf` Python package and `transformers`' GGUF loader
//! (`fixtures/gguf/`, made by `generate_gguf.py`): metadata of every value type, every
//! dequantized tensor type, and a tiny Llama written as llama.cpp writes one, converted and run.

mod common;

use std::path::Path;

use common::{Reference, check_tokenizer, fixture, max_masked_diff};
use fathom_model::checkpoint::Checkpoint;
use fathom_model::gguf::{GgufError, GgufFile, Value, convert_gguf};
use fathom_model::{Cpu, GenerateConfig, LoadOptions, Qwen2ForCausalLM, generate};
use serde_json::{Value as Json, json};

fn gguf_fixture(name: &str) -> std::path::PathBuf {
    fixture("gguf").join(name)
}

/// A metadata value in the fixture's JSON shape: `{"type": NAME, "value": …}`.
fn to_json(v: &Value) -> Json {
    let (t, value) = match v {
        Value::U8(x) => ("UINT8", json!(x)),
        Value::I8(x) => ("INT8", json!(x)),
        Value::U16(x) => ("UINT16", json!(x)),
        Value::I16(x) => ("INT16", json!(x)),
        Value::U32(x) => ("UINT32", json!(x)),
        Value::I32(x) => ("INT32", json!(x)),
        Value::U64(x) => ("UINT64", json!(x)),
        Value::I64(x) => ("INT64", json!(x)),
        Value::F32(x) => ("FLOAT32", json!(f64::from(*x))),
        Value::F64(x) => ("FLOAT64", json!(x)),
        Value::Bool(x) => ("BOOL", json!(x)),
        Value::String(x) => ("STRING", json!(x)),
        Value::Array(items) => ("ARRAY", Json::Array(items.iter().map(to_json).collect())),
    };
    json!({"type": t, "value": value})
}

#[test]
fn metadata_of_every_value_type_reads_as_the_gguf_package_reads_it() {
    let expected: Json = serde_json::from_str(
        &std::fs::read_to_string(gguf_fixture("vectors-metadata.json")).unwrap(),
    )
    .unwrap();
    let f = GgufFile::open(&gguf_fixture("vectors.gguf")).unwrap();
    assert_eq!(f.version, 3);
    assert_eq!(json!(f.alignment), expected["alignment"]);
    assert_eq!(json!(f.data_offset), expected["data_offset"]);
    let meta = expected["metadata"].as_array().unwrap();
    assert_eq!(f.metadata.len(), meta.len());
    for ((key, value), e) in f.metadata.iter().zip(meta) {
        assert_eq!(json!(key), e["key"]);
        assert_eq!(to_json(value), e["value"], "{key}");
    }
    let tensors = expected["tensors"].as_array().unwrap();
    assert_eq!(f.tensors.len(), tensors.len());
    for (t, e) in f.tensors.iter().zip(tensors) {
        assert_eq!(json!(t.name), e["name"]);
        assert_eq!(json!(t.dims), e["dims"], "{}", t.name);
        let ty = fathom_model::gguf::GgmlType::from_id(t.type_id).unwrap();
        assert_eq!(json!(ty.name()), e["type"], "{}", t.name);
        assert_eq!(json!(t.offset), e["offset"], "{}", t.name);
    }
}

#[test]
fn every_tensor_type_dequantizes_as_the_gguf_package_does() {
    let f = GgufFile::open(&gguf_fixture("vectors.gguf")).unwrap();
    let dir = fixture("gguf");
    let reference =
        Checkpoint::open_files(&dir, &[gguf_fixture("vectors-reference.safetensors")]).unwrap();
    let mut seen = std::collections::HashSet::new();
    for t in &f.tensors {
        let ours = f.dequantize(t).unwrap();
        let theirs = reference.f32(&t.name, &t.torch_shape()).unwrap();
        assert_eq!(ours.len(), theirs.len(), "{}", t.name);
        let mismatch = ours
            .iter()
            .zip(&theirs)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(
            mismatch,
            None,
            "{}: first differing element {:?}",
            t.name,
            mismatch.map(|i| (i, ours[i], theirs[i]))
        );
        seen.insert(fathom_model::gguf::GgmlType::from_id(t.type_id).unwrap());
    }
    // The fixture covers every type the crate claims to dequantize.
    assert_eq!(seen.len(), fathom_model::gguf::GgmlType::ALL.len());
}

#[test]
fn tiny_llama_gguf_converts_to_what_transformers_loads_from_it() {
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("tiny-llama");
    let report = convert_gguf(&gguf_fixture("tiny-llama.gguf"), &dir).unwrap();
    assert_eq!(report.architecture, "llama");
    for ty in ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16", "F32"] {
        assert!(report.tensor_types.contains_key(ty), "{ty}: {report:?}");
    }
    let device = Default::default();
    let model = Qwen2ForCausalLM::<Cpu>::load(&dir, &device, LoadOptions::default()).unwrap();
    let r = Reference::read_file(&gguf_fixture("tiny-llama-reference.safetensors"));
    let input = model
        .step_input(&r.input_ids, &r.attention_mask, &device)
        .unwrap();
    let logits = model
        .forward(&input, None)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    let diff = max_masked_diff(&logits, &r);
    assert!(diff < 1e-4, "max |logit diff| {diff}");
    let prompts: Vec<Vec<u32>> = r
        .input_ids
        .iter()
        .zip(&r.attention_mask)
        .map(|(ids, m)| {
            ids.iter()
                .zip(m)
                .filter(|p| *p.1 == 1)
                .map(|p| *p.0)
                .collect()
        })
        .collect();
    let config = GenerateConfig::greedy(r.greedy[0].len());
    let generated = generate(&model, &prompts, &config, None, &device).unwrap();
    assert_eq!(generated.tokens, r.greedy);
    check_tokenizer(&dir, &gguf_fixture("tiny-llama-tokenizer.json"));
}

#[test]
fn conversion_undoes_the_row_permutation_of_q() {
    // Guards the Q/K unpermutation: the converted rows are the stored ones reordered (the
    // parity test above fails if the order is wrong).
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("m");
    convert_gguf(&gguf_fixture("tiny-llama.gguf"), &dir).unwrap();
    let f = GgufFile::open(&gguf_fixture("tiny-llama.gguf")).unwrap();
    let q = f.tensor("blk.0.attn_q.weight").unwrap();
    let stored = f.dequantize(q).unwrap();
    let ck = Checkpoint::open_dir(&dir).unwrap();
    let converted = ck
        .f32("model.layers.0.self_attn.q_proj.weight", &q.torch_shape())
        .unwrap();
    assert_ne!(stored, converted);
    let mut sorted_a = stored.clone();
    let mut sorted_b = converted.clone();
    sorted_a.sort_by(f32::total_cmp);
    sorted_b.sort_by(f32::total_cmp);
    assert_eq!(sorted_a, sorted_b, "a permutation of the same values");
}

fn copy_with(src: &Path, dst: &Path, patch: impl FnOnce(&mut Vec<u8>)) {
    let mut bytes = std::fs::read(src).unwrap();
    patch(&mut bytes);
    std::fs::write(dst, bytes).unwrap();
}

fn find(bytes: &[u8], needle: &[u8]) -> usize {
    bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("present")
}

#[test]
fn failed_conversions_leave_nothing_behind() {
    let tmp = tempfile::tempdir().unwrap();
    let assert_clean = |out: &Path| {
        assert!(!out.exists());
        let left: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with('.'))
            .collect();
        assert!(left.is_empty(), "left behind: {left:?}");
    };
    // An unsupported tensor type: change the type id of `blk.0.attn_v.weight` (Q5_0 = 6) to
    // IQ4_NL (20).
    let bad = tmp.path().join("bad-type.gguf");
    copy_with(&gguf_fixture("tiny-llama.gguf"), &bad, |b| {
        let name = b"blk.0.attn_v.weight";
        let at = find(b, name) + name.len() + 4 + 2 * 8;
        assert_eq!(b[at..at + 4], 6u32.to_le_bytes());
        b[at..at + 4].copy_from_slice(&20u32.to_le_bytes());
    });
    let out = tmp.path().join("out");
    let err = convert_gguf(&bad, &out).unwrap_err();
    assert!(matches!(err, GgufError::UnsupportedType { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("IQ4_NL") && msg.contains("blk.0.attn_v.weight"),
        "{msg}"
    );
    assert_clean(&out);
    // An architecture that is not Llama.
    let other = tmp.path().join("other-arch.gguf");
    copy_with(&gguf_fixture("tiny-llama.gguf"), &other, |b| {
        let at = find(b, b"general.architecture") + "general.architecture".len() + 4 + 8;
        b[at..at + 5].copy_from_slice(b"llamb");
    });
    let err = convert_gguf(&other, &out).unwrap_err().to_string();
    assert!(err.contains("llamb"), "{err}");
    assert_clean(&out);
    // A truncated file.
    let short = tmp.path().join("short.gguf");
    copy_with(&gguf_fixture("tiny-llama.gguf"), &short, |b| {
        b.truncate(b.len() - 100)
    });
    let err = convert_gguf(&short, &out).unwrap_err().to_string();
    assert!(err.contains("past the end"), "{err}");
    assert_clean(&out);
    // An existing destination is never overwritten.
    std::fs::create_dir(&out).unwrap();
    let err = convert_gguf(&gguf_fixture("tiny-llama.gguf"), &out)
        .unwrap_err()
        .to_string();
    assert!(err.contains("already exists"), "{err}");
}
