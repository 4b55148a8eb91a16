//! Checking that a backend can start before burn's runtime is touched, and naming what it runs
//! on. burn's wgpu runtime panics when wgpu finds no adapter; here the same request it makes
//! (the platform's graphics API, high-performance preference) is made first, through wgpu
//! itself, and a missing adapter becomes an error that suggests `--backend cpu`.

use anyhow::Result;

use crate::backend::BackendKind;

/// Checks that `kind` can run here; returns what it runs on (e.g. the wgpu adapter's name).
pub fn check(kind: BackendKind) -> Result<String> {
    match kind {
        BackendKind::Cpu => Ok(format!(
            "CPU, {} threads",
            std::thread::available_parallelism().map_or(1, |n| n.get())
        )),
        #[cfg(feature = "wgpu")]
        BackendKind::Wgpu => wgpu_adapter(),
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => cuda_device(),
        #[allow(unreachable_patterns)]
        other => Ok(format!("{other:?}").to_lowercase()),
    }
}

/// As [`check`], for a recipe's device (`train`, `eval`): a GPU backend that cannot start is an
/// error before anything is loaded. A backend not compiled in passes; the caller names it.
pub fn check_recipe(backend: fathom_trainer::recipe::Backend) -> Result<()> {
    use fathom_trainer::recipe::Backend;
    match backend {
        #[cfg(feature = "wgpu")]
        Backend::Wgpu => check(BackendKind::Wgpu).map(drop),
        #[cfg(feature = "cuda")]
        Backend::Cuda => check(BackendKind::Cuda).map(drop),
        _ => Ok(()),
    }
}

/// The adapter burn's wgpu runtime will pick, or an error saying there is none.
#[cfg(feature = "wgpu")]
fn wgpu_adapter() -> Result<String> {
    use burn::backend::wgpu::graphics::{AutoGraphicsApi, GraphicsApi};

    let api = AutoGraphicsApi::backend();
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: api.into(),
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let adapter =
        futures_lite::future::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            force_fallback_adapter: false,
            compatible_surface: None,
        }));
    match adapter {
        Ok(adapter) => {
            let info = adapter.get_info();
            let kind = match info.device_type {
                wgpu::DeviceType::Cpu => "software, runs on the CPU",
                wgpu::DeviceType::DiscreteGpu => "discrete GPU",
                wgpu::DeviceType::IntegratedGpu => "integrated GPU",
                wgpu::DeviceType::VirtualGpu => "virtual GPU",
                wgpu::DeviceType::Other => "other",
            };
            Ok(format!("{}, {kind}, {:?}", info.name, info.backend))
        }
        Err(e) => anyhow::bail!(
            "no wgpu adapter found: wgpu's {api:?} backend reports no usable device ({e}). \
             Install a {api:?} driver for your GPU (on Linux without a GPU, Mesa's lavapipe: \
             `apt install mesa-vulkan-drivers`), or run on the CPU with `--backend cpu`."
        ),
    }
}

/// Starts the CUDA runtime on a tiny tensor, turning its panic (no driver, no device) into an
/// error.
#[cfg(feature = "cuda")]
fn cuda_device() -> Result<String> {
    let started = std::panic::catch_unwind(|| {
        let device: burn::tensor::Device<fathom_model::Cuda> = Default::default();
        burn::tensor::Tensor::<fathom_model::Cuda, 1>::zeros([1], &device).into_data()
    });
    match started {
        Ok(_) => Ok("CUDA device 0".into()),
        Err(_) => anyhow::bail!(
            "the CUDA runtime could not start (no driver or no device; see the message above); \
             run on the CPU with `--backend cpu`"
        ),
    }
}
