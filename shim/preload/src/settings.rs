//! The configuration, read once from the environment by the library's constructor — before
//! `main`, and before PyTorch reads `PYTORCH_NO_CUDA_MEMORY_CACHING` — and never again.
//! Nothing CUDA happens here.

use std::sync::OnceLock;

use cachealloc_core::Config;
use cachealloc_core::config::TorchCaching;

use crate::log;

/// What the constructor read.
#[derive(Debug)]
pub struct Settings {
    /// The configuration in force (defaults when it could not be read).
    pub config: Config,
    /// Why pooling is off although `pool:on`: a configuration error. The shim then passes
    /// every call through.
    pub problem: Option<String>,
}

static SETTINGS: OnceLock<Settings> = OnceLock::new();

/// The settings; read now if the constructor did not run (e.g. the library was dlopened late).
pub fn get() -> &'static Settings {
    SETTINGS.get_or_init(read)
}

fn read() -> Settings {
    let cachealloc = std::env::var("CACHEALLOC_CONF").ok();
    let pytorch = std::env::var("PYTORCH_CUDA_ALLOC_CONF").ok();
    match Config::from_sources(cachealloc.as_deref(), pytorch.as_deref()) {
        Ok(resolved) => {
            log::set_level(resolved.config.log);
            for note in &resolved.ignored {
                log::debug!("{note}");
            }
            Settings {
                config: resolved.config,
                problem: None,
            }
        }
        Err(e) => Settings {
            config: Config::default(),
            problem: Some(e.to_string()),
        },
    }
}

/// Constructor work: read the settings and, in pool mode, turn PyTorch's own cache off so that
/// every tensor allocation reaches our pools — unless the user set the variable or asked for
/// `torch_caching:keep`.
pub fn on_load() {
    let settings = get();
    if let Some(problem) = &settings.problem {
        log::error!("{problem}; passing every CUDA call through unchanged");
        return;
    }
    let config = &settings.config;
    if config.pool
        && config.torch_caching == TorchCaching::Off
        && std::env::var_os("PYTORCH_NO_CUDA_MEMORY_CACHING").is_none()
    {
        // SAFETY: this runs in the library's constructor, before `main`, while the process has
        // no other threads that could read the environment concurrently.
        unsafe { std::env::set_var("PYTORCH_NO_CUDA_MEMORY_CACHING", "1") };
        log::debug!("set PYTORCH_NO_CUDA_MEMORY_CACHING=1 so that every tensor reaches the pool");
    }
}
