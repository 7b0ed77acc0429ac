//! The configuration, read once from the environment by the library's constructor — before
//! `main`, and before PyTorch reads its allocator settings — and never again.
//! Nothing CUDA happens here.

use std::sync::OnceLock;

use cachealloc_core::Config;
use cachealloc_core::config::Expandable;
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
            let mut config = resolved.config;
            let registers_all = std::env::var("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK")
                .is_ok_and(|v| ["1", "true", "yes", "y"].contains(&v.to_lowercase().as_str()));
            if let Some(message) = config.for_nccl_registration(
                registers_all,
                cachealloc.as_deref(),
                pytorch.as_deref(),
            ) {
                if config.allocator.expandable_segments == Expandable::Off {
                    log::info!("{message}");
                } else {
                    log::error!("{message}");
                }
            }
            Settings {
                config,
                problem: None,
            }
        }
        Err(e) => Settings {
            config: Config::default(),
            problem: Some(e.to_string()),
        },
    }
}

/// Constructor work: read the settings and, in pool mode, route PyTorch's tensors to our pools
/// as `torch_caching` says (see [`TorchCaching`]), unless the user already chose for PyTorch.
pub fn on_load() {
    let settings = get();
    if let Some(problem) = &settings.problem {
        log::error!("{problem}; passing every CUDA call through unchanged");
        undo_inherited_torch_backend();
        return;
    }
    let config = &settings.config;
    if !config.pool {
        return;
    }
    if config.python {
        crate::python_integration::on_load();
    }
    match config.torch_caching {
        TorchCaching::Async => select_torch_async_backend(),
        TorchCaching::Uncached => {
            if std::env::var_os("PYTORCH_NO_CUDA_MEMORY_CACHING").is_none() {
                // SAFETY: this runs in the library's constructor, before `main`, while the
                // process has no other threads that could read the environment concurrently.
                unsafe { std::env::set_var("PYTORCH_NO_CUDA_MEMORY_CACHING", "1") };
                log::debug!(
                    "set PYTORCH_NO_CUDA_MEMORY_CACHING=1 so that every tensor reaches the pool"
                );
            }
        }
        TorchCaching::Keep => {}
    }
}

/// The variable PyTorch reads its allocator settings from: the first of these that is set.
const TORCH_ALLOC_VARS: [&str; 3] = [
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_HIP_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
];

/// Set in the environment when the shim added PyTorch's backend to its settings, so that a child
/// process (which inherits both) can tell the backend was not the user's choice.
const ADDED_BACKEND_MARK: &str = "CACHEALLOC_ADDED_TORCH_BACKEND";

/// Add `backend:cudaMallocAsync` to PyTorch's allocator settings, unless the user chose a
/// backend or turned PyTorch's caching off themselves.
fn select_torch_async_backend() {
    if std::env::var_os("PYTORCH_NO_CUDA_MEMORY_CACHING").is_some() {
        log::debug!(
            "PYTORCH_NO_CUDA_MEMORY_CACHING is set: PyTorch's tensors reach the pool uncached"
        );
        return;
    }
    let current = TORCH_ALLOC_VARS
        .iter()
        .find_map(|&var| std::env::var(var).ok().map(|value| (var, value)));
    let (var, value) = match current {
        Some((var, value)) => match torch_with_async_backend(&value) {
            Some(with_backend) => (var, with_backend),
            None => {
                log::debug!("{var} chooses PyTorch's backend ({value}): left as it is");
                return;
            }
        },
        None => (TORCH_ALLOC_VARS[0], "backend:cudaMallocAsync".to_string()),
    };
    // SAFETY: this runs in the library's constructor, before `main`, while the process has no
    // other threads that could read the environment concurrently.
    unsafe {
        std::env::set_var(var, &value);
        std::env::set_var(ADDED_BACKEND_MARK, var);
    };
    log::debug!("set {var}={value} so that every tensor reaches the pool with its stream");
}

/// In a process where the shim passes everything through (its settings are bad), take back the
/// backend a parent's shim added to PyTorch's settings: PyTorch then runs as without the shim
/// (its native allocator, which also checks the settings and names what is wrong), not on a
/// `cudaMallocAsync` backend that nothing serves.
fn undo_inherited_torch_backend() {
    let Ok(var) = std::env::var(ADDED_BACKEND_MARK) else {
        return;
    };
    let Some(value) = std::env::var(&var).ok() else {
        return;
    };
    let restored = torch_without_added_backend(&value);
    // SAFETY: this runs in the library's constructor, before `main`, while the process has no
    // other threads that could read the environment concurrently.
    unsafe {
        match &restored {
            Some(conf) => std::env::set_var(&var, conf),
            None => std::env::remove_var(&var),
        }
        std::env::remove_var(ADDED_BACKEND_MARK);
    };
    log::debug!("took back the backend:cudaMallocAsync a parent process added to {var}");
}

/// `conf` without the `backend:cudaMallocAsync` entry that [`torch_with_async_backend`] added;
/// `None` when nothing else is left.
fn torch_without_added_backend(conf: &str) -> Option<String> {
    let rest: Vec<&str> = conf
        .split(',')
        .filter(|item| {
            let mut kv = item.splitn(2, ':');
            let key = kv.next().unwrap_or("").trim();
            let value = kv.next().unwrap_or("").trim();
            let added = key == "backend" && value == "cudaMallocAsync";
            !(added || item.trim().is_empty())
        })
        .collect();
    (!rest.is_empty()).then(|| rest.join(","))
}

/// `conf` (a `PYTORCH_CUDA_ALLOC_CONF` value) with `backend:cudaMallocAsync` added, or `None`
/// when it names a backend already.
fn torch_with_async_backend(conf: &str) -> Option<String> {
    let names_backend = conf.split(',').any(|item| {
        item.split(':')
            .next()
            .is_some_and(|k| k.trim() == "backend")
    });
    if names_backend {
        return None;
    }
    let conf = conf.trim().trim_end_matches(',');
    Some(if conf.is_empty() {
        "backend:cudaMallocAsync".to_string()
    } else {
        format!("{conf},backend:cudaMallocAsync")
    })
}

#[cfg(test)]
mod tests {
    use super::{torch_with_async_backend, torch_without_added_backend};

    #[test]
    fn the_async_backend_joins_the_users_settings_unless_a_backend_is_named() {
        assert_eq!(
            torch_with_async_backend("").as_deref(),
            Some("backend:cudaMallocAsync")
        );
        assert_eq!(
            torch_with_async_backend("max_split_size_mb:256,").as_deref(),
            Some("max_split_size_mb:256,backend:cudaMallocAsync")
        );
        assert_eq!(
            torch_with_async_backend("expandable_segments:True, backend:native"),
            None
        );
        assert_eq!(torch_with_async_backend("backend:cudaMallocAsync"), None);
    }

    #[test]
    fn the_added_backend_is_taken_back_and_the_users_settings_kept() {
        assert_eq!(torch_without_added_backend("backend:cudaMallocAsync"), None);
        assert_eq!(
            torch_without_added_backend(
                "max_split_size_mb:256,backend:cudaMallocAsync,per_process_memory_fraction:-0.1"
            )
            .as_deref(),
            Some("max_split_size_mb:256,per_process_memory_fraction:-0.1")
        );
        for conf in ["max_split_size_mb:256", "backend:native"] {
            assert_eq!(torch_without_added_backend(conf).as_deref(), Some(conf));
        }
    }
}
