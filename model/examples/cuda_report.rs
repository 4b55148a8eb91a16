//! The CUDA check run on a GPU machine: parity of the CubeCL NF4 kernel and of the fixture
//! models on CUDA against the CPU path and `transformers`, then throughput figures (NF4 against
//! dense f32, one Qwen2.5-Coder-1.5B-shape forward pass, prefill and decode throughput of the
//! 0.5B shape, SmolLM2-135M's shape and the 1.5B shape in NF4) and the QLoRA
//! training step of `cargo xtask bench train-step` (1.5B shape, NF4 base, 1024 tokens, with and
//! without checkpointing: step time and the device memory the allocator reserved). Prints one
//! JSON line per check; exits non-zero if a parity check fails.
//!
//! `cargo run --release -p fathom-model --features cuda,bench --example cuda_report -- FIXTURES_DIR [OUT_DIR] [SECTIONS]`
//! (OUT_DIR receives a random Qwen2.5-0.5B-shape checkpoint for a peer to load; SECTIONS, a
//! comma-separated subset of `kernel,parity,matmul,forward,throughput,train` in the order to run
//! them, defaults to all six in that order).
//!
//! On CUDA, CubeCL runs f32 matmuls on the tensor cores in TF32 (10-bit mantissa, as PyTorch with
//! `allow_tf32`), so the fixture logits are held to TF32's tolerance (`TF32_LOGIT_TOLERANCE`)
//! with greedy decoding identical, not to the CPU path's 1e-4.

use std::path::{Path, PathBuf};

use fathom_model::backend::kernel_cache::keep_kernel_caches;
use fathom_model::bench::{
    Protocol, TrainStepBench, forward_pass, nf4_matmul, throughput, train_step_model, train_steps,
};
use fathom_model::checkpoint::Checkpoint;
use fathom_model::linear::Nf4Weight;
use fathom_model::save::SaveDtype;
use fathom_model::{
    Cpu, Cuda, GenerateConfig, LoadOptions, ModelType, Qwen2Config, Qwen2ForCausalLM, generate,
};
use serde_json::json;

type R = Result<(), Box<dyn std::error::Error>>;

fn i64_rows(ck: &Checkpoint, name: &str) -> Vec<Vec<i64>> {
    let raw = ck.raw(name).unwrap();
    let v: Vec<i64> = raw
        .data
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    v.chunks(raw.shape[1]).map(<[i64]>::to_vec).collect()
}

fn parity(
    fixtures: &Path,
    model_dir: &str,
    adapter: Option<&str>,
) -> Result<(f32, bool), Box<dyn std::error::Error>> {
    let device = Default::default();
    let mut model =
        Qwen2ForCausalLM::<Cuda>::load(&fixtures.join(model_dir), &device, LoadOptions::default())?;
    if let Some(a) = adapter {
        model = model.load_adapter(&fixtures.join(a), &device)?;
    }
    let refdir = fixtures.join(adapter.unwrap_or(model_dir));
    let ck = Checkpoint::open_files(&refdir, &[refdir.join("reference.safetensors")])?;
    let ids: Vec<Vec<u32>> = i64_rows(&ck, "input_ids")
        .into_iter()
        .map(|r| r.into_iter().map(|v| v as u32).collect())
        .collect();
    let mask: Vec<Vec<u8>> = i64_rows(&ck, "attention_mask")
        .into_iter()
        .map(|r| r.into_iter().map(|v| v as u8).collect())
        .collect();
    let greedy: Vec<Vec<u32>> = i64_rows(&ck, "greedy_ids")
        .into_iter()
        .map(|r| r.into_iter().map(|v| v as u32).collect())
        .collect();
    let shape = ck.shape("logits")?;
    let reference = ck.f32("logits", &shape)?;
    let logits: Vec<f32> = model
        .forward(&model.step_input(&ids, &mask, &device)?, None)
        .into_data()
        .to_vec()
        .unwrap();
    let (seq, vocab) = (shape[1], shape[2]);
    let mut max = 0f32;
    for (b, m) in mask.iter().enumerate() {
        for (t, &on) in m.iter().enumerate() {
            if on == 1 {
                let off = (b * seq + t) * vocab;
                for v in 0..vocab {
                    max = max.max((logits[off + v] - reference[off + v]).abs());
                }
            }
        }
    }
    let prompts: Vec<Vec<u32>> = ids
        .iter()
        .zip(&mask)
        .map(|(r, m)| {
            r.iter()
                .zip(m)
                .filter(|p| *p.1 == 1)
                .map(|p| *p.0)
                .collect()
        })
        .collect();
    let out = generate(
        &model,
        &prompts,
        &GenerateConfig::greedy(greedy[0].len()),
        None,
        &device,
    )?;
    Ok((max, out.tokens == greedy))
}

fn main() -> R {
    keep_cubecl_caches();
    let mut args = std::env::args().skip(1);
    let fixtures = PathBuf::from(
        args.next()
            .ok_or("usage: cuda_report FIXTURES_DIR [OUT_DIR] [SECTIONS]")?,
    );
    let out_dir = args
        .next()
        .map(PathBuf::from)
        .filter(|p| !p.as_os_str().is_empty());
    let sections: Vec<String> = args
        .next()
        .unwrap_or_else(|| "kernel,parity,matmul,forward,throughput,train".into())
        .split(',')
        .map(str::to_owned)
        .collect();
    let start = std::time::Instant::now();
    let mut ok = true;
    for section in &sections {
        println!(
            "{}",
            json!({"section": section, "elapsed_s": start.elapsed().as_secs_f64()})
        );
        match section.as_str() {
            "kernel" => ok &= kernel(),
            "parity" => ok &= parities(&fixtures)?,
            "matmul" => matmul(),
            "forward" => forward()?,
            "throughput" => throughputs(out_dir.as_deref())?,
            "train" => train()?,
            other => return Err(format!("unknown section `{other}`").into()),
        }
    }
    println!(
        "{}",
        json!({"done": true, "elapsed_s": start.elapsed().as_secs_f64()})
    );
    if !ok {
        return Err("a parity check failed".into());
    }
    Ok(())
}

/// With `FATHOM_CUBECL_CACHE=DIR`, CubeCL keeps the kernels it compiles (PTX) and the autotune
/// results in DIR ([`keep_kernel_caches`]): a later run given the same DIR (a later lease that
/// carries it) skips that compiling and timing. Without it CubeCL keeps its defaults (autotune
/// results under `target/`, no kernel cache).
fn keep_cubecl_caches() {
    if let Some(dir) = std::env::var_os("FATHOM_CUBECL_CACHE").filter(|d| !d.is_empty()) {
        keep_kernel_caches(Path::new(&dir));
    }
}

/// The CubeCL NF4 kernel against the CPU path, bit for bit.
fn kernel() -> bool {
    let mut ok = true;
    for (rows, cols) in [(64, 64), (96, 160), (7, 9), (8960, 1536)] {
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| (((i * 2654435761) % 10007) as f32 / 10007.0 - 0.5) * 0.1)
            .collect();
        let cpu: Vec<f32> = Nf4Weight::<Cpu>::quantize(&w, rows, cols, &Default::default())
            .dequantize()
            .into_data()
            .to_vec()
            .unwrap();
        let gpu: Vec<f32> = Nf4Weight::<Cuda>::quantize(&w, rows, cols, &Default::default())
            .dequantize()
            .into_data()
            .to_vec()
            .unwrap();
        let same = cpu
            .iter()
            .zip(&gpu)
            .all(|(a, b)| a.to_bits() == b.to_bits())
            && cpu.len() == gpu.len();
        ok &= same;
        println!(
            "{}",
            json!({"check": "nf4_kernel_bit_identical", "rows": rows, "cols": cols, "pass": same})
        );
    }
    ok
}

/// The largest logit difference TF32 matmuls are allowed against `transformers`' f32 logits on
/// the fixtures (the four models measured 0.013-0.021 on an H200, with greedy decoding identical).
const TF32_LOGIT_TOLERANCE: f32 = 0.05;

/// Fixture models on CUDA against transformers / bitsandbytes / peft.
fn parities(fixtures: &Path) -> Result<bool, Box<dyn std::error::Error>> {
    let mut ok = true;
    for (dir, adapter) in [
        ("tiny-qwen2", None),
        ("tiny-qwen2-nf4", None),
        ("tiny-qwen2-nf4-plain", None),
        ("tiny-qwen2", Some("tiny-qwen2-lora")),
    ] {
        let (diff, greedy) = parity(fixtures, dir, adapter)?;
        let pass = diff < TF32_LOGIT_TOLERANCE && greedy;
        ok &= pass;
        println!(
            "{}",
            json!({"check": "parity", "model": dir, "adapter": adapter, "max_logit_diff": diff, "greedy_identical": greedy, "pass": pass})
        );
    }
    Ok(ok)
}

/// NF4 matmul against dense f32 and bf16 on the 1.5B's projection shapes.
fn matmul() {
    let device = Default::default();
    let nf4 = nf4_matmul::<Cuda>(&[1, 8, 128, 512], 10, &device);
    println!(
        "{}",
        json!({"bench": "nf4_matmul", "backend": "cuda", "figures": nf4})
    );
}

/// One Qwen2.5-Coder-1.5B-shape forward pass, dense and NF4.
fn forward() -> R {
    let device = Default::default();
    for nf4 in [false, true] {
        let f = forward_pass::<Cuda>(Qwen2Config::qwen2_5_1_5b(), 512, nf4, &device)?;
        println!(
            "{}",
            json!({"bench": "forward_qwen2.5-1.5b", "backend": "cuda", "figures": f})
        );
    }
    Ok(())
}

/// Prefill and decode throughput of the 0.5B, SmolLM2-135M and 1.5B-NF4 shapes.
fn throughputs(out_dir: Option<&Path>) -> R {
    let device = Default::default();
    let protocol = Protocol::default();
    let small = Qwen2ForCausalLM::<Cuda>::random(Qwen2Config::qwen2_5_0_5b(), 0, false, &device);
    if let Some(dir) = out_dir {
        Qwen2ForCausalLM::<Cpu>::random(Qwen2Config::qwen2_5_0_5b(), 0, false, &Default::default())
            .save_pretrained(dir, SaveDtype::Bf16)?;
    }
    let t = throughput(&small, &protocol, &device)?;
    println!(
        "{}",
        json!({"bench": "throughput_qwen2.5-0.5b", "backend": "cuda", "figures": t})
    );
    // The default base's shape, SmolLM2-135M-Instruct (Llama; random weights): the CUDA case of
    // docs/inference.md's `cargo xtask bench model` figures, with the 1.5B NF4 line below.
    let mut smol = Qwen2Config::with_shape(49_152, 576, 1536, 30, 9, 3);
    smol.model_type = Some(ModelType::Llama);
    smol.attention_bias = Some(false);
    smol.head_dim = Some(64);
    smol.rope_theta = Some(100_000.0);
    let smol = Qwen2ForCausalLM::<Cuda>::random(smol, 0, false, &device);
    let t = throughput(&smol, &protocol, &device)?;
    println!(
        "{}",
        json!({"bench": "throughput_smollm2-135m", "backend": "cuda", "figures": t})
    );
    drop(smol);
    let coder = Qwen2ForCausalLM::<Cuda>::random(Qwen2Config::qwen2_5_1_5b(), 0, true, &device);
    let t = throughput(
        &coder,
        &Protocol {
            batches: vec![1, 8],
            ..protocol
        },
        &device,
    )?;
    println!(
        "{}",
        json!({"bench": "throughput_qwen2.5-1.5b_nf4", "backend": "cuda", "figures": t})
    );
    Ok(())
}

/// One QLoRA training step, as `cargo xtask bench train-step --shape qwen1-5b --nf4
/// --tokens 1024 [--checkpointing]` runs it on the CPU, on one model built once (building the
/// random 1.5B on the host takes about a minute). The allocator keeps the pages it reserved, so
/// what it holds after the steps bounds the step's peak from above; it is asked to release its
/// free pages before each variant (the script also samples `nvidia-smi` for the whole process).
/// Each step's time goes to stderr as it ends: the warm-up step is where CubeCL compiles and
/// autotunes the kernels.
fn train() -> R {
    use cubecl::Runtime;
    let device = Default::default();
    let client = cubecl::cuda::CudaRuntime::client(&device);
    let t0 = std::time::Instant::now();
    let mut model = train_step_model::<Cuda>(Qwen2Config::qwen2_5_1_5b(), true, &device);
    let build_s = t0.elapsed().as_secs_f64();
    eprintln!("train: model built in {build_s:.1} s");
    for checkpointing in [false, true] {
        // Hand back the pages the previous variant reserved, so that what the allocator holds
        // after this one's steps is this variant's own.
        client.memory_cleanup();
        let bench = TrainStepBench {
            tokens: 1024,
            nf4: true,
            checkpointing,
            steps: 2,
            chunk: fathom_model::qwen2::DEFAULT_LOGPROB_CHUNK,
        };
        let (trained, mut f) = train_steps(model, &bench, &device, |step, s| {
            eprintln!(
                "train: checkpointing {checkpointing}, step {step} (0 = warm-up): {s:.2} s \
                 ({:.0} s into the section)",
                t0.elapsed().as_secs_f64()
            );
        })?;
        model = trained;
        f["build_s"] = build_s.into();
        if let Ok(usage) = client.memory_usage() {
            f["device_bytes_in_use"] = usage.bytes_in_use.into();
            f["device_bytes_reserved"] = usage.bytes_reserved.into();
        }
        println!(
            "{}",
            json!({"bench": "train_step_qwen2.5-1.5b_nf4", "backend": "cuda", "figures": f})
        );
    }
    Ok(())
}
