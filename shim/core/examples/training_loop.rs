//! A training-like allocation pattern driven through the allocator core over `SimDevice`:
//! weights allocated once, then per step activations allocated in the forward pass and freed in
//! the backward pass, with some temporaries. Prints what the caching saved.
//!
//! `cargo run --release -p cachealloc-core --example training_loop -- [steps] [conf]`

use cachealloc_core::{Allocator, Config, SimDevice, format_bytes};

const MIB: u64 = 1 << 20;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let steps: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(50);
    let conf = args.next().unwrap_or_default();
    let config = Config::parse(&conf, "conf")?;
    let alloc = Allocator::new(SimDevice::new(16 << 30), config.allocator.clone());

    let layers = 12u64;
    let weights: Vec<u64> = (0..layers)
        .map(|_| alloc.malloc(4 * MIB, 0).map(|a| a.address))
        .collect::<Result<_, _>>()?;
    let mut requests = 0u64;
    for step in 0..steps {
        let mut activations = Vec::new();
        for layer in 0..layers {
            let batch = 32 + (step % 3) * 8; // varying batch size, as with dynamic shapes
            activations.push(alloc.malloc(batch * 96 * 1024 + layer * 512, 0)?.address);
            let tmp = alloc.malloc(batch * 4096, 0)?;
            alloc.free(tmp.address)?;
            requests += 2;
        }
        while let Some(a) = activations.pop() {
            let grad = alloc.malloc(64 * 1024, 0)?;
            alloc.free(a)?;
            alloc.free(grad.address)?;
            requests += 1;
        }
    }
    alloc.check_invariants()?;
    let s = alloc.stats();
    println!("config: {}", alloc.config().to_conf_string());
    println!("steps: {steps}, allocation requests: {}", requests + layers);
    println!(
        "served from the cache: {}, device allocations: {}",
        s.num_cache_hits, s.num_device_alloc
    );
    println!(
        "peak allocated: {}, peak reserved: {}",
        format_bytes(s.allocated_bytes.all.peak as u64),
        format_bytes(s.reserved_bytes.all.peak as u64)
    );
    for w in weights {
        alloc.free(w)?;
    }
    Ok(())
}
