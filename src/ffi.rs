// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Raw declarations: bindgen's view of `nv-p2p.h` and `peer_mem.h` (generated
//! by the build from the installed driver's headers) and the C shim.
//!
//! Kernel types (`sg_table`, `device`, `pci_dev`) are `kernel::bindings`' own:
//! the generated code refers to them instead of redefining them.

use kernel::{
    bindings::{
        device,
        kobject,
        list_head,
        llist_node,
        module,
        pci_dev, //
    },
    ffi::{
        c_char,
        c_int,
        c_uint,
        c_ulong,
        c_void, //
    },
};

#[allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    missing_docs,
    unreachable_pub,
    clippy::all,
    clippy::pedantic,
    clippy::undocumented_unsafe_blocks,
    unsafe_op_in_unsafe_fn,
    improper_ctypes
)]
mod generated {
    use kernel::bindings::{
        device,
        pci_dev,
        sg_table, //
    };
    include!(env!("PEERMEM_BINDINGS"));
}

pub(crate) use generated::*;

// `device` holds `lockdep_map`s, zero-sized without lockdep; we only pass
// pointers to it. The shim's functions that take no pointer, or only
// references, are `safe`: any argument is sound.
#[allow(improper_ctypes)]
unsafe extern "C" {
    /// The PCI device behind `dev`, or NULL if `dev` is NULL or not PCI;
    /// then also its PCI address (as in [`PeermemHop`]) in `id` and its DMA
    /// segment limit (`dma_get_max_seg_size`) in `max_seg`.
    pub(crate) fn peermem_peer_of(
        dev: *mut device,
        id: *mut u32,
        max_seg: *mut c_uint,
    ) -> *mut pci_dev;
    /// Whether the module's dynamic-debug call site is enabled; prints `msg`
    /// (NUL-terminated, or NULL for none) through it if so.
    pub(crate) fn peermem_dbg(msg: *const c_char) -> bool;
    /// Whether the module's dynamic-debug call site is enabled.
    pub(crate) safe fn peermem_dbg_on() -> bool;
    /// Maps a run of GPU memory for `dev`: `dma_map_resource` of a peer's
    /// BAR range, or `dma_map_phys` of `coherent` (C2C) memory as memory,
    /// only without bounce buffers or cache maintenance
    /// (`DMA_ATTR_REQUIRE_COHERENT`). 0 and the DMA address in `dma`, -EIO,
    /// or -EOPNOTSUPP where the kernel has no such coherent mapping.
    pub(crate) fn peermem_map_run(
        dev: *mut device,
        phys: u64,
        len: u64,
        coherent: bool,
        dma: *mut u64,
    ) -> c_int;
    /// Undoes [`peermem_map_run`].
    pub(crate) fn peermem_unmap_run(dev: *mut device, dma: u64, len: u64, coherent: bool);
    /// Registers the bus notifier that calls `accounting`'s
    /// `peermem_device_unbound` when a PCI device loses its driver.
    pub(crate) safe fn peermem_watch_devices() -> c_int;
    /// Unregisters it; returns once no notification runs.
    pub(crate) safe fn peermem_unwatch_devices();
    /// Creates the module's cache of objects of `size` bytes aligned to
    /// `align`. 0 or -ENOMEM.
    pub(crate) safe fn peermem_reg_cache_create(size: usize, align: usize) -> c_int;
    /// Destroys it; every object must be back.
    pub(crate) fn peermem_reg_cache_destroy();
    /// An object of the module's cache (which exists while the core can
    /// call us), or NULL.
    pub(crate) safe fn peermem_reg_alloc() -> *mut c_void;
    /// Returns an object to the module's cache.
    pub(crate) fn peermem_reg_free(obj: *mut c_void);
    /// `llist_add` of `node` to the reap list, and queues the work that
    /// hands each node to `revoke::peermem_reap_one`.
    pub(crate) fn peermem_reap_defer(node: *mut llist_node);
    /// Returns once the reap work neither runs nor is queued.
    pub(crate) safe fn peermem_reap_flush();
    /// The PCI device whose memory BAR holds `phys`: its path up, and the
    /// BAR's first and last byte. 0 or -ENODEV.
    pub(crate) safe fn peermem_gpu_by_phys(
        phys: u64,
        out: &mut PeermemChain,
        bar_start: &mut u64,
        bar_end: &mut u64,
    ) -> c_int;
    /// The path up of the PCI device behind `dev`, and how an IOMMU treats
    /// its DMA: 0 none, 1 identity, 2 DMA, 3 DMA-FQ, 4 other; or -ENODEV.
    pub(crate) fn peermem_chain_of(dev: *mut device, out: *mut PeermemChain) -> c_int;
    /// The calling process's name into a 16-byte buffer.
    pub(crate) safe fn peermem_comm_of(tgid: u32, comm: &mut [c_char; 16]);
    /// The `skip`-th PCI device the GPU driver's topology gate can be asked
    /// about for the GPU whose BAR holds `gpu_phys`: an RDMA peer (a device
    /// an RDMA driver registered an RDMA device on, else one that was a
    /// registration's `dma_device`: `accounting::peermem_known_peer`), a
    /// bound bus master
    /// whose driver uses the DMA API, with (`near`) or without an upstream
    /// bridge in common with the GPU. Locked
    /// (so that it keeps its driver) and referenced, for
    /// [`peermem_gate_candidate_put`]; or NULL, with `busy` set when a
    /// device of the kind was passed over for its lock being held.
    pub(crate) safe fn peermem_gate_candidate(
        gpu_phys: u64,
        near: bool,
        skip: c_uint,
        busy: &mut bool,
    ) -> *mut pci_dev;
    /// What the GPU driver's topology rule reads of the platform, for the
    /// GPU whose BAR holds `gpu_phys`: [`PEERMEM_PASSTHROUGH`],
    /// [`PEERMEM_FLAGGED_CHIPSET`].
    pub(crate) safe fn peermem_platform(gpu_phys: u64) -> c_uint;
    /// `NVreg_GrdmaPciTopoCheckOverride` as the GPU driver shows it in
    /// `/proc/driver/nvidia/params`; -1 when it cannot be read.
    pub(crate) safe fn peermem_driver_override() -> c_int;
    /// Unlocks and drops a device from [`peermem_gate_candidate`].
    pub(crate) fn peermem_gate_candidate_put(dev: *mut pci_dev);
    /// Whether a warning about user-triggered events may be printed now
    /// (the kernel's default ratelimit: 10 lines per 5 s).
    pub(crate) safe fn peermem_ratelimit() -> bool;
    /// The value of the module parameter `which` (`params::Param`), -1 for
    /// none.
    pub(crate) safe fn peermem_param(which: c_uint) -> c_int;
    /// Adds the operator's files in sysfs and debugfs (`views`), then lets
    /// [`peermem_dirs_kick`] queue the directories' sync. 0 or an errno.
    pub(crate) safe fn peermem_views_add() -> c_int;
    /// Removes them, after the directories; returns once no read of one
    /// runs.
    pub(crate) safe fn peermem_views_remove();
    /// Queues `views::peermem_dirs_sync` (after [`peermem_views_add`] and
    /// until [`peermem_dirs_stop`]; any context).
    pub(crate) safe fn peermem_dirs_kick();
    /// Stops the sync: returns once none runs, and none is queued after.
    pub(crate) safe fn peermem_dirs_stop();
    /// A directory named `name` (copied) in `stats/gpus` (kind 2) or
    /// `stats/paths` (3), with the files of its kind; NULL on failure.
    /// `kobject_put` removes it.
    pub(crate) fn peermem_dir_add(kind: c_uint, name: *const c_char) -> *mut kobject;
    /// The address `module` (referenced) exports as `name`, or NULL.
    pub(crate) fn peermem_module_export(module: *mut module, name: *const c_char) -> *mut c_void;
    /// The live module, not this one, that exports `name`, with a reference
    /// for the caller; or NULL.
    pub(crate) fn peermem_exporter(name: *const c_char) -> *mut module;
    /// Registers the module notifier that offers each module going live to
    /// `binding::peermem_module_live`. 0 or an errno.
    pub(crate) safe fn peermem_watch_modules() -> c_int;
    /// Unregisters it; returns once no notification runs.
    pub(crate) safe fn peermem_unwatch_modules();
    /// Puts a registration's `node` on the drain's registry.
    pub(crate) fn peermem_registry_add(node: *mut list_head);
    /// Takes it off; returns how many are left.
    pub(crate) fn peermem_registry_del(node: *mut list_head) -> c_ulong;
    /// How many registrations are on the registry.
    pub(crate) safe fn peermem_registry_live() -> c_ulong;
    /// Calls `visit(node, arg)` for each node on the registry, under its
    /// spinlock.
    pub(crate) fn peermem_registry_walk(
        visit: unsafe extern "C" fn(node: *mut list_head, arg: *mut c_void),
        arg: *mut c_void,
    );
    /// `refcount_inc_not_zero` (a `Refcount` is a `refcount_t`).
    pub(crate) safe fn peermem_refcount_inc_not_zero(r: &kernel::sync::Refcount) -> bool;
    /// Queues the drain's completion (`drain::peermem_drain_run`).
    pub(crate) safe fn peermem_drain_kick();
    /// Cancels it; returns once it neither runs nor is queued.
    pub(crate) safe fn peermem_drain_cancel();
}

/// [`peermem_platform`]: the GPU is passed through to a virtual machine as
/// the GPU driver sees it (a hypervisor it knows: KVM, Xen, Hyper-V,
/// VMware).
pub(crate) const PEERMEM_PASSTHROUGH: c_uint = 1;
/// [`peermem_platform`]: the GPU's PCI domain holds a root complex the GPU
/// driver flags as unable to forward peer-to-peer traffic.
pub(crate) const PEERMEM_FLAGGED_CHIPSET: c_uint = 2;

/// `struct peermem_hop` of the C shim.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct PeermemHop {
    pub(crate) id: u32,
    pub(crate) kind: u8,
    pub(crate) acs_redirect: u8,
    pub(crate) pad: u16,
}

/// `struct peermem_chain` of the C shim.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct PeermemChain {
    pub(crate) id: u32,
    pub(crate) root: u32,
    pub(crate) numa: i32,
    pub(crate) nhops: u32,
    pub(crate) hops: [PeermemHop; 16],
}

// Compile-time layout checks: the x86_64 ABI of every struct this module
// reads or hands to the core (the C shim asserts the same offsets in C).
macro_rules! layout {
    ($t:ty $(: size $s:expr)? $(, $f:ident @ $o:expr)* $(,)?) => {
        $(const _: () = assert!(core::mem::size_of::<$t>() == $s);)?
        $(const _: () = assert!(core::mem::offset_of!($t, $f) == $o);)*
    };
}

layout!(PeermemHop: size 8, id @ 0, kind @ 4, acs_redirect @ 5);
layout!(PeermemChain: size 144, id @ 0, root @ 4, numa @ 8, nhops @ 12, hops @ 16);
layout!(peer_memory_client: size 136, name @ 0, version @ 64, acquire @ 80, get_pages @ 88,
    dma_map @ 96, dma_unmap @ 104, put_pages @ 112, get_page_size @ 120, release @ 128);
layout!(peer_memory_client_ex: size 152, client @ 0, ex_size @ 136, flags @ 144);
layout!(nvidia_p2p_page: size 32, physical_address @ 0);
layout!(nvidia_p2p_page_table, version @ 0, page_size @ 4, pages @ 8, entries @ 16, gpu_uuid @ 24);
layout!(nvidia_p2p_dma_mapping: size 40, version @ 0, page_size_type @ 4, entries @ 8,
    dma_addresses @ 16, private @ 24, pci_dev @ 32);
