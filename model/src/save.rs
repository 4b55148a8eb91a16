//! Saving a model as a Hugging Face checkpoint (`config.json` + `model.safetensors`), for
//! exporting a merged adapter or writing random benchmark models that `transformers` and candle
//! load. NF4 bases are dequantized; adapters must be merged first.

use std::collections::HashMap;
use std::path::Path;

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use safetensors::Dtype;

use crate::backend::ModelBackend;
use crate::checkpoint::{OutTensor, write_atomic, write_safetensors};
use crate::error::{ModelError, Result};
use crate::qwen2::Qwen2ForCausalLM;

/// Floating-point dtype of a saved checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaveDtype {
    /// float32.
    F32,
    /// bfloat16.
    Bf16,
}

fn out_tensor<B: Backend, const D: usize>(
    name: &str,
    t: Tensor<B, D>,
    dtype: SaveDtype,
) -> Result<OutTensor> {
    let shape = t.dims().to_vec();
    let values = t
        .into_data()
        .to_vec::<f32>()
        .map_err(|e| ModelError::Input(format!("reading `{name}`: {e:?}")))?;
    Ok(match dtype {
        SaveDtype::F32 => OutTensor::f32(name, shape, &values),
        SaveDtype::Bf16 => OutTensor {
            name: name.to_string(),
            dtype: Dtype::BF16,
            shape,
            data: values
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
        },
    })
}

impl<B: ModelBackend> Qwen2ForCausalLM<B> {
    /// Writes `config.json` and `model.safetensors` to `dir`. Fails if an adapter is attached
    /// (merge it first with [`Qwen2ForCausalLM::merge_adapters`]).
    pub fn save_pretrained(&self, dir: &Path, dtype: SaveDtype) -> Result<()> {
        if let Some((path, _)) = self
            .projections()
            .into_iter()
            .find(|(_, p)| p.lora.is_some())
        {
            return Err(ModelError::Input(format!(
                "`{path}` has an adapter: merge adapters before saving a checkpoint"
            )));
        }
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        let mut tensors = vec![out_tensor(
            "model.embed_tokens.weight",
            self.model.embed_tokens.weight(),
            dtype,
        )?];
        tensors.push(out_tensor(
            "model.norm.weight",
            self.model.norm.weight.val(),
            dtype,
        )?);
        for (i, layer) in self.model.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            tensors.push(out_tensor(
                &format!("{p}.input_layernorm.weight"),
                layer.input_layernorm.weight.val(),
                dtype,
            )?);
            tensors.push(out_tensor(
                &format!("{p}.post_attention_layernorm.weight"),
                layer.post_attention_layernorm.weight.val(),
                dtype,
            )?);
        }
        for (path, linear) in self.projections() {
            tensors.push(out_tensor(
                &format!("{path}.weight"),
                linear.dense_weight(),
                dtype,
            )?);
            if let Some(bias) = &linear.bias {
                tensors.push(out_tensor(&format!("{path}.bias"), bias.val(), dtype)?);
            }
        }
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        let mut meta = HashMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        write_safetensors(&dir.join("model.safetensors"), &tensors, Some(meta))?;
        let mut config =
            serde_json::to_value(&self.config).map_err(|e| ModelError::Input(e.to_string()))?;
        let obj = config
            .as_object_mut()
            .expect("config serialises to an object");
        obj.retain(|_, v| !v.is_null());
        obj.remove("quantization_config");
        let family = self.config.family();
        obj.insert(
            "architectures".into(),
            serde_json::json!([family.architecture()]),
        );
        obj.insert("model_type".into(), serde_json::json!(family.as_str()));
        obj.insert(
            "torch_dtype".into(),
            serde_json::json!(if dtype == SaveDtype::F32 {
                "float32"
            } else {
                "bfloat16"
            }),
        );
        obj.insert(
            "rope_theta".into(),
            serde_json::json!(self.config.rope_base()),
        );
        obj.remove("rope_parameters");
        let text =
            serde_json::to_string_pretty(&config).map_err(|e| ModelError::Input(e.to_string()))?;
        write_atomic(&dir.join("config.json"), text.as_bytes())
    }
}
