// SPDX-License-Identifier: GPL-2.0 OR MIT

//! `nvidia_peermem`: lets RDMA devices DMA to and from NVIDIA GPU memory.
//!
//! A peer-memory client of the RDMA core (`ib_register_peer_memory_client`):
//! when `ibv_reg_mr()` is called on a `cudaMalloc()` pointer the core asks us
//! whether we own the range; we pin the GPU's BAR pages through NVIDIA's p2p
//! API, map them for the device, and hand back a DMA-mapped scatterlist. When
//! the GPU memory is freed under a live registration, NVIDIA's free callback
//! revokes it through the core's invalidate hook.

use kernel::{
    bindings,
    debugfs::{
        Dir,
        File, //
    },
    prelude::*,
};

mod access;
mod accounting;
mod atomics;
mod bar_map;
mod bar_window;
mod claim;
mod client;
mod coalesce;
mod compat;
mod core_link;
mod device_map;
mod ffi;
mod lifecycle;
mod liveness;
mod p2p;
mod path;
mod peer_device;
mod provider_map;
mod range;
mod reaper;
mod reg_lock;
mod reg_ref;
mod registration;
mod sg;
mod stats;
#[cfg(CONFIG_KUNIT = "y")]
mod tests;
mod topology;
mod waitq;

use client::{
    CoreRegistration,
    INVALIDATING_LINK,
    NV_MEM_INVALIDATING,
    NV_MEM_INVALIDATING_LEGACY,
    NV_MEM_NC,
    NV_MEM_PERSISTENT, //
};

module! {
    type: NvidiaPeermem,
    name: "nvidia_peermem",
    authors: ["peermem-rs developers"],
    description: "NVIDIA GPU memory plug-in for the RDMA peer-memory core (memory-safe Rust)",
    license: "Dual MIT/GPL",
    params: {
        persistent_api_support: i32 {
            default: 1,
            description: "1 [default]: one non-invalidating client nv_mem on persistent pins; 0: nv_mem invalidating on the free callback, plus nv_mem_nc non-invalidating",
        },
        peerdirect_support: i32 {
            default: 0,
            description: "0 [default]: extended client with PEER_MEM_INVALIDATE_UNMAPS; 1: legacy client for old cores (for example MLNX_OFED 4.9 LTS)",
        },
        path_policy: i32 {
            default: 0,
            description: "0 [default]: allow every GPU-peer PCIe path (paths through the root complex are logged as warnings); 1..5: refuse registrations whose path is worse than PIX, PXB, PHB, NODE, SYS (EPERM)",
        },
        allow_unverified_paths: i32 {
            default: 0,
            description: "0 [default]: the invalidating client refuses a GPU-peer pair with no PCIe switch in common when the GPU driver's topology verdict cannot be learnt (persistent pins refused: MIG, vGPU); 1: map for it",
        },
        pair_table_slots: i32 {
            default: 64,
            description: "GPU-peer pairs tracked (1..64, default 64): per-pair counts in debugfs paths and BAR windows; a pair without a slot is classified at each registration",
        },
        path_accounting: i32 {
            default: 1,
            description: "1 [default]: count live registrations and pinned bytes per GPU-peer pair, GPU and process (debugfs paths, gpus, processes); 0: do not (path classification, its log line and path_policy stay)",
        },
    },
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
static MODINFO_VERSION: [u8; MODINFO_VERSION_LEN] = modinfo_version();

const MODINFO_VERSION_LEN: usize = "version=".len() + env!("PEERMEM_VERSION").len() + 1;

const fn modinfo_version() -> [u8; MODINFO_VERSION_LEN] {
    let mut out = [0u8; MODINFO_VERSION_LEN];
    let (k, v) = (b"version=", env!("PEERMEM_VERSION").as_bytes());
    let mut i = 0;
    while i < k.len() {
        out[i] = k[i];
        i += 1;
    }
    while i < k.len() + v.len() {
        out[i] = v[i - k.len()];
        i += 1;
    }
    out
}

/// The path parameters, copied at load: they cannot change afterwards (no
/// sysfs write), and reading a module parameter is a call per read.
static PATH_POLICY: atomics::Atomic<u32> = atomics::Atomic::new(0);
static PATH_ACCOUNTING: atomics::Atomic<u32> = atomics::Atomic::new(1);
static ALLOW_UNVERIFIED: atomics::Atomic<u32> = atomics::Atomic::new(0);
static PAIR_SLOTS: atomics::Atomic<u32> = atomics::Atomic::new(accounting::PAIRS as u32);

/// The `pair_table_slots` parameter: how many pair slots are used.
pub(crate) fn pair_slots_parameter() -> usize {
    PAIR_SLOTS.load(atomics::Relaxed) as usize
}

/// The `allow_unverified_paths` parameter.
pub(crate) fn unverified_parameter() -> bool {
    ALLOW_UNVERIFIED.load(atomics::Relaxed) != 0
}

/// The `path_policy` parameter.
pub(crate) fn policy_parameter() -> i32 {
    PATH_POLICY.load(atomics::Relaxed) as i32
}

/// The `path_accounting` parameter: whether registrations are charged per
/// pair, GPU and process.
pub(crate) fn accounting_parameter() -> bool {
    PATH_ACCOUNTING.load(atomics::Relaxed) != 0
}

/// This module's `struct module`.
pub(crate) fn this_module() -> *mut bindings::module {
    compat::this_module()
}

/// The module: its core registrations and its debugfs files.
///
/// Fields drop in declaration order: the clients unregister first (the core
/// waits for their registrations, which hold module references, so none is
/// left), then the free callbacks still returning are waited for (through the
/// GPU driver's lock, see [`p2p::CallbackFence`]), then the reap queue drains
/// (a free callback's last drop may still be returning from its work), then
/// the statistics go.
struct NvidiaPeermem {
    _clients: KVec<CoreRegistration>,
    // After the clients: no callback can be armed; before the reaper: the
    // callbacks that handed it references have returned.
    _callbacks: Option<p2p::CallbackFence>,
    _reaper: reaper::ReapQueue,
    // After the clients and the reaper: no registration uses a window.
    _windows: bar_window::Windows,
    // After the clients and the reaper: no registration is left by then.
    _waitq: waitq::WaitQueue,
    _cache: reg_ref::RegCache,
    _stats: Pin<KBox<File<()>>>,
    _paths: Pin<KBox<File<()>>>,
    _gpus: Pin<KBox<File<()>>>,
    _processes: Pin<KBox<File<()>>>,
    _dir: Dir,
}

fn show_stats(_: &(), f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
    stats::STATS.show(f)?;
    // Rust module parameters have no /sys/module/*/parameters files (7.3):
    // tools read them here.
    writeln!(
        f,
        "param_persistent_api_support {}",
        compat::param::<i32>(module_parameters::persistent_api_support.value())
    )?;
    writeln!(
        f,
        "param_peerdirect_support {}",
        compat::param::<i32>(module_parameters::peerdirect_support.value())
    )?;
    writeln!(
        f,
        "param_path_policy {}",
        compat::param::<i32>(module_parameters::path_policy.value())
    )?;
    writeln!(
        f,
        "param_path_accounting {}",
        compat::param::<i32>(module_parameters::path_accounting.value())
    )?;
    writeln!(
        f,
        "param_allow_unverified_paths {}",
        compat::param::<i32>(module_parameters::allow_unverified_paths.value())
    )?;
    writeln!(
        f,
        "param_pair_table_slots {}",
        compat::param::<i32>(module_parameters::pair_table_slots.value())
    )
}

fn show_paths(_: &(), f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
    accounting::show_paths(f)
}

fn show_gpus(_: &(), f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
    accounting::show_gpus(f)
}

fn show_processes(_: &(), f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
    accounting::show_processes(f)
}

/// Reads and checks the path parameters and copies them where the
/// registrations read them; called at load, before any client is registered.
fn path_parameters() -> Result {
    let policy: i32 = compat::param(module_parameters::path_policy.value());
    if !(0..=5).contains(&policy) {
        pr_err!(
            "invalid parameter path_policy={policy} (0 to allow every path, 1..5 for PIX..SYS)\n"
        );
        return Err(EINVAL);
    }
    let accounting: i32 = compat::param(module_parameters::path_accounting.value());
    let unverified: i32 = compat::param(module_parameters::allow_unverified_paths.value());
    if !(0..=1).contains(&accounting) || !(0..=1).contains(&unverified) {
        pr_err!("invalid parameters path_accounting={accounting} allow_unverified_paths={unverified} (each 0 or 1)\n");
        return Err(EINVAL);
    }
    let slots: i32 = compat::param(module_parameters::pair_table_slots.value());
    if !(1..=accounting::PAIRS as i32).contains(&slots) {
        pr_err!(
            "invalid parameter pair_table_slots={slots} (1..{})\n",
            accounting::PAIRS
        );
        return Err(EINVAL);
    }
    // Before any client is registered (no registration can read them
    // earlier); validated above.
    PATH_POLICY.store(policy as u32, atomics::Relaxed);
    PATH_ACCOUNTING.store(accounting as u32, atomics::Relaxed);
    ALLOW_UNVERIFIED.store(unverified as u32, atomics::Relaxed);
    PAIR_SLOTS.store(slots as u32, atomics::Relaxed);
    Ok(())
}

impl kernel::Module for NvidiaPeermem {
    fn init(_module: &'static ThisModule) -> Result<Self> {
        let persistent: i32 = compat::param(module_parameters::persistent_api_support.value());
        let legacy: i32 = compat::param(module_parameters::peerdirect_support.value());
        if !(0..=1).contains(&persistent) || !(0..=1).contains(&legacy) {
            pr_err!("invalid parameters persistent_api_support={persistent} peerdirect_support={legacy} (each 0 or 1)\n");
            return Err(EINVAL);
        }
        path_parameters()?;
        let dir = Dir::new(c"nvidia_peermem");
        let stats = KBox::pin_init(
            dir.read_callback_file(c"stats", (), &show_stats),
            GFP_KERNEL,
        )?;
        let paths = KBox::pin_init(
            dir.read_callback_file(c"paths", (), &show_paths),
            GFP_KERNEL,
        )?;
        let gpus = KBox::pin_init(dir.read_callback_file(c"gpus", (), &show_gpus), GFP_KERNEL)?;
        let processes = KBox::pin_init(
            dir.read_callback_file(c"processes", (), &show_processes),
            GFP_KERNEL,
        )?;
        let cache = reg_ref::RegCache::new()?;
        let reaper = reaper::ReapQueue::new()?;
        let waitq = waitq::WaitQueue::new()?;
        let windows = bar_window::Windows::new()?;
        let mut clients = KVec::new();
        if persistent == 1 {
            clients.push(CoreRegistration::new(&NV_MEM_PERSISTENT, None)?, GFP_KERNEL)?;
        } else {
            let table = if legacy == 1 {
                &NV_MEM_INVALIDATING_LEGACY
            } else {
                &NV_MEM_INVALIDATING
            };
            clients.push(
                CoreRegistration::new(table, Some(&INVALIDATING_LINK))?,
                GFP_KERNEL,
            )?;
            clients.push(CoreRegistration::new(&NV_MEM_NC, None)?, GFP_KERNEL)?;
        }
        let clients_text = match (persistent, legacy) {
            (1, _) => "nv_mem (persistent)",
            (_, 1) => "nv_mem (invalidating, legacy core), nv_mem_nc (persistent)",
            _ => "nv_mem (invalidating), nv_mem_nc (persistent)",
        };
        pr_info!(
            "version {} loaded: {clients_text}\n",
            env!("PEERMEM_VERSION")
        );
        Ok(Self {
            _clients: clients,
            _callbacks: (persistent != 1).then(p2p::CallbackFence::new),
            _reaper: reaper,
            _windows: windows,
            _waitq: waitq,
            _cache: cache,
            _stats: stats,
            _paths: paths,
            _gpus: gpus,
            _processes: processes,
            _dir: dir,
        })
    }
}
