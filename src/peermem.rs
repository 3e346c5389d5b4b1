// SPDX-License-Identifier: GPL-2.0 OR MIT

//! `nvidia_peermem`: lets RDMA devices DMA to and from NVIDIA GPU memory.
//!
//! A peer-memory client of the RDMA core (`ib_register_peer_memory_client`):
//! when `ibv_reg_mr()` is called on a `cudaMalloc()` pointer the core asks us
//! whether we own the range; we pin the GPU's BAR pages through NVIDIA's p2p
//! API, map them for the device, and hand back a DMA-mapped scatterlist. When
//! the GPU memory is freed under a live registration, NVIDIA's free callback
//! revokes it through the core's invalidate hook.

use kernel::prelude::*;

// Layers, each using only those above it in this list:
// pure logic, tested on the host as well
mod coalesce;
mod lifecycle;
mod path;
mod range;
// kernel glue
mod compat;
mod ffi;
mod params;
mod sg;
mod stats;
mod waitq;
// the GPU driver's p2p API
mod p2p;
// DMA: the peer, its path and accounting, the mappings
mod accounting;
mod device_map;
mod peer_device;
mod topology;
// the entry points bound at run time
mod exports;
// the core's link, the registration, the clients
mod client;
mod core_link;
mod registration;
// late binding to the core and the GPU driver, and the drain
mod binding;
mod drain;
// what operators read
#[cfg(CONFIG_KUNIT = "y")]
mod tests;
mod views;

module! {
    type: NvidiaPeermem,
    name: "nvidia_peermem",
    authors: ["peermem-rs developers"],
    description: "NVIDIA GPU memory plug-in for the RDMA peer-memory core (memory-safe Rust)",
    license: "Dual MIT/GPL",
}

/// `version=` in `.modinfo`, so that `/sys/module/nvidia_peermem/version`
/// exists: NCCL, UCX and others detect GPUDirect RDMA by that file. The
/// `module!` macro has no version key.
///
/// `used(compiler)`, as the kernel's own `module!` entries: a plain `#[used]`
/// means `used(linker)` on newer rustc (1.97 here), which puts the entry in a
/// second, SHF_GNU_RETAIN `.modinfo` section; the loader reads only the first
/// one, misses `vermagic` and refuses the module ("invalid module format").
#[cfg(MODULE)]
#[link_section = ".modinfo"]
#[used(compiler)]
static MODINFO_VERSION: [u8; MODINFO.len()] = *MODINFO.as_bytes().first_chunk().unwrap();

const MODINFO: &str = concat!("version=", env!("PEERMEM_VERSION"), "\0");

/// The module: its binding to the core and the GPU driver, its core
/// registrations and its files in sysfs.
///
/// Fields drop in declaration order: the module notifier goes, the clients
/// unregister (the core waits for their registrations, which hold module
/// references, so none is left), then the free callbacks still returning are
/// waited for (through the GPU driver's lock, see [`p2p::CallbackFence`]),
/// all in [`binding::Binding`]; then the reap work is flushed (a free
/// callback's last drop may still be returning from it) and the objects'
/// cache goes, then the statistics, and last the references to the core's
/// and the GPU driver's modules.
struct NvidiaPeermem {
    // First: the views read the tables and counters of everything below.
    _views: views::Views,
    // After the views: no callback can be armed once it is gone; before the
    // cache, which flushes the reap work: the callbacks that handed it
    // references have returned.
    _binding: binding::Binding,
    _cache: registration::RegCache,
    // After the clients and the reap work: no registration is charged any
    // more.
    _watch: accounting::Watch,
    // After the clients and the reap work: no registration is left by then.
    _waitq: waitq::WaitQueue,
    // Nothing calls the core or the GPU driver any more.
    _exporters: binding::Exporters,
    // Last: the line for the log.
    _farewell: Farewell,
}

impl kernel::Module for NvidiaPeermem {
    fn init(_module: &'static ThisModule) -> Result<Self> {
        // One line for a failed load (what `peermem-stat doctor` reads as
        // the outcome of the latest attempt), one at exit (`Farewell`).
        Self::load().inspect_err(|e| {
            pr_err!("version {} not loaded: {e:?}\n", env!("PEERMEM_VERSION"));
        })
    }
}

/// Says the module is unloaded: dropped after everything else.
struct Farewell;

impl Drop for Farewell {
    fn drop(&mut self) {
        pr_info!("version {} unloaded\n", env!("PEERMEM_VERSION"));
    }
}

impl NvidiaPeermem {
    fn load() -> Result<Self> {
        let (persistent, legacy) = params::load()?;
        // First: on a failed load, dropped last.
        let exporters = binding::Exporters::new(persistent, legacy);
        let cache = registration::RegCache::new::<registration::Registration>()?;
        let waitq = waitq::WaitQueue::new()?;
        let watch = accounting::Watch::new()?;
        let views = views::Views::new()?;
        // Binds what is loaded, registers if both are, says what it waits
        // for.
        let binding = binding::Binding::new()?;
        Ok(Self {
            _views: views,
            _binding: binding,
            _cache: cache,
            _watch: watch,
            _waitq: waitq,
            _exporters: exporters,
            _farewell: Farewell,
        })
    }
}
