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
mod bar_map;
mod device_map;
mod peer_device;
mod provider_map;
mod topology;
// the core's link, the registration, the clients
mod client;
mod core_link;
mod registration;
// what operators read
#[cfg(CONFIG_KUNIT = "y")]
mod tests;
mod views;

use client::CoreRegistration;

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

/// The module: its core registrations and its files in sysfs.
///
/// Fields drop in declaration order: the clients unregister first (the core
/// waits for their registrations, which hold module references, so none is
/// left), then the free callbacks still returning are waited for (through the
/// GPU driver's lock, see [`p2p::CallbackFence`]), then the reap queue drains
/// (a free callback's last drop may still be returning from its work), then
/// the statistics go.
struct NvidiaPeermem {
    // First: the views read the tables and counters of everything below.
    _views: views::Views,
    _clients: KVec<CoreRegistration>,
    // After the clients: no callback can be armed; before the reaper: the
    // callbacks that handed it references have returned.
    _callbacks: Option<p2p::CallbackFence>,
    _reaper: registration::refs::ReapQueue,
    // After the clients and the reaper: no registration is charged any more.
    _watch: accounting::Watch,
    // After the clients and the reaper: no registration is left by then.
    _waitq: waitq::WaitQueue,
    _cache: registration::RegCache,
}

/// Registers the clients of the mode the parameters chose; returns them and
/// their description for the log.
fn clients(persistent: bool, legacy: bool) -> Result<(KVec<CoreRegistration>, &'static str)> {
    let (table, text) = match (persistent, legacy) {
        (true, _) => (&client::NV_MEM_PERSISTENT, "nv_mem (persistent)"),
        (false, true) => (
            &client::NV_MEM_INVALIDATING_LEGACY,
            "nv_mem (invalidating, legacy core), nv_mem_nc (persistent)",
        ),
        (false, false) => (
            &client::NV_MEM_INVALIDATING,
            "nv_mem (invalidating), nv_mem_nc (persistent)",
        ),
    };
    let link = (!persistent).then_some(&core_link::INVALIDATING);
    let mut clients = KVec::new();
    clients.push(CoreRegistration::new(table, link)?, GFP_KERNEL)?;
    if !persistent {
        clients.push(CoreRegistration::new(&client::NV_MEM_NC, None)?, GFP_KERNEL)?;
    }
    Ok((clients, text))
}

impl kernel::Module for NvidiaPeermem {
    fn init(_module: &'static ThisModule) -> Result<Self> {
        let (persistent, legacy) = params::load()?;
        let cache = registration::RegCache::new::<registration::Registration>()?;
        let reaper = registration::refs::ReapQueue::new()?;
        let waitq = waitq::WaitQueue::new()?;
        let watch = accounting::Watch::new()?;
        let views = views::Views::new()?;
        let (clients, text) = clients(persistent, legacy)?;
        pr_info!("version {} loaded: {text}\n", env!("PEERMEM_VERSION"));
        Ok(Self {
            _views: views,
            _clients: clients,
            _callbacks: (!persistent).then(p2p::CallbackFence::new),
            _reaper: reaper,
            _watch: watch,
            _waitq: waitq,
            _cache: cache,
        })
    }
}
