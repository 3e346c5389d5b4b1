// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Late binding to the peer-memory core and the GPU driver.
//!
//! The module loads whether or not they are loaded. It takes their entry
//! points by name from whichever live module exports them (`ib_core`,
//! `ib_uverbs`, an OFED build; `nvidia`): at load from the modules already
//! live, later from the module notifier when one goes live (the C shim finds
//! them, `exports` holds them). Once both are bound it registers its
//! clients. The references to both modules are held until the module's exit.
//!
//! Without symbol CRCs, what is checked before binding (docs/design.md,
//! "Late binding"): every entry point of an API comes from one module; the
//! GPU driver's `version=` is `MAJOR.MINOR[.PATCH]` with a major this module
//! knows (R470, the first with every entry point bound, or later); an
//! invalidating client is registered only with a core that writes its
//! invalidate hook (`client`); and, as before, every page table and DMA
//! mapping the driver hands out carries a structure version this module
//! knows (`p2p`). A refusal is one log line; the module keeps waiting.

use core::{
    fmt,
    ptr::NonNull, //
};

use kernel::{
    bindings,
    ffi::c_void,
    prelude::*, //
};

use crate::{
    client::{
        self,
        CoreRegistration, //
    },
    core_link,
    exports::{
        self,
        ModuleRef, //
    },
    ffi,
    p2p,
    registration::registry, //
};

/// The GPU driver's entry points, in `peermem_p2p_api`'s order.
const P2P_NAMES: [&CStr; 6] = [
    c"nvidia_p2p_get_pages",
    c"nvidia_p2p_get_pages_persistent",
    c"nvidia_p2p_put_pages",
    c"nvidia_p2p_put_pages_persistent",
    c"nvidia_p2p_dma_map_pages",
    c"nvidia_p2p_dma_unmap_pages",
];

/// The peer-memory core's entry points, in `peermem_core_api`'s order.
const CORE_NAMES: [&CStr; 2] = [
    c"ib_register_peer_memory_client",
    c"ib_unregister_peer_memory_client",
];

/// The oldest GPU driver major with every entry point bound here (R470:
/// `nvidia_p2p_get_pages_persistent`, and NVIDIA's own nvidia-peermem).
pub(crate) const DRIVER_MAJOR_MIN: u32 = 470;

/// What the module is bound to and what it registered.
struct State {
    persistent: bool,
    legacy: bool,
    core: Option<ModuleRef>,
    gpu: Option<ModuleRef>,
    clients: KVec<CoreRegistration>,
    fence: Option<p2p::CallbackFence>,
    /// A drain completed: the clients are unregistered and both modules let
    /// go of; nothing binds until the drain ends (`drain` = 0, or one of
    /// the modules going live again).
    drained: bool,
}

kernel::sync::global_lock! {
    /// The binding lock: the state, and the offers and drains it serialises.
    // SAFETY: initialized by `Exporters::new`, the first step of the
    // module's init, before the module notifier or anything else locks it.
    unsafe(uninit) static STATE: Mutex<State> = State {
        persistent: true,
        legacy: false,
        core: None,
        gpu: None,
        clients: KVec::new(),
        fence: None,
        drained: false,
    };
}

/// What the module waits for, as `stats/waiting_for` says it.
fn waiting_for(st: &State) -> &'static str {
    if st.drained {
        return "drained";
    }
    if registry::draining() {
        return "drain-holders";
    }
    match (st.core.is_some(), st.gpu.is_some(), !st.clients.is_empty()) {
        (_, _, true) => "nothing",
        (false, false, _) => "core,gpu-driver",
        (false, true, _) => "core",
        (true, false, _) => "gpu-driver",
        // Both bound, the core refused the clients (logged).
        (true, true, false) => "core-refused",
    }
}

/// The log's words for what is missing.
struct Missing<'a>(&'a State);

impl kernel::fmt::Display for Missing<'_> {
    fn fmt(&self, f: &mut kernel::fmt::Formatter<'_>) -> kernel::fmt::Result {
        const CORE: &str = "the peer-memory core (ib_register_peer_memory_client: ib_core, ib_uverbs or an OFED build)";
        const GPU: &str = "the GPU driver (nvidia_p2p_get_pages: nvidia)";
        match (self.0.core.is_some(), self.0.gpu.is_some()) {
            (false, false) => write!(f, "{CORE} and {GPU}"),
            (false, true) => f.write_str(CORE),
            (true, false) => f.write_str(GPU),
            (true, true) => f.write_str("nothing"),
        }
    }
}

/// `stats/waiting_for`: `nothing` once the clients registered.
pub(crate) fn waiting() -> &'static str {
    waiting_for(&STATE.lock())
}

/// A module's name, for the log.
fn name(m: &ModuleRef) -> &str {
    m.name().to_str().unwrap_or("?")
}

/// The entry points `m` exports under `names`: `None` if it exports none
/// of them (silently: not this API's module) or only some (refused, one
/// line).
fn addresses<const N: usize>(m: &ModuleRef, names: &[&CStr; N]) -> Option<[*mut c_void; N]> {
    let addrs = names.map(|n| m.export(n));
    let missing = addrs.iter().position(|a| a.is_null());
    match missing {
        None => Some(addrs),
        Some(_) if addrs.iter().all(|a| a.is_null()) => None,
        Some(i) => {
            pr_err!(
                "refused module {}: it exports {} but not {}, so its entry points are not one API\n",
                name(m),
                names[(i + 1) % N].to_str().unwrap_or("?"),
                names[i].to_str().unwrap_or("?"),
            );
            None
        }
    }
}

/// Publishes in `api` the table that the addresses `a`, in its fields'
/// order, make; `held` takes a reference to `m`, which exports them.
///
/// # Safety
///
/// `T` must be a `repr(C)` table of `N` entry points (each an `Option` of a
/// function pointer), and `a[i]` the function `m` exports with the type of
/// field `i`; called under the binding lock, with `held` (the state's) and
/// `api` unbound, before any client registered.
unsafe fn publish<T: Copy, const N: usize>(
    api: &exports::Api<T>,
    held: &mut Option<ModuleRef>,
    m: &ModuleRef,
    a: [*mut c_void; N],
) {
    const { assert!(core::mem::size_of::<T>() == N * core::mem::size_of::<*mut c_void>()) };
    // SAFETY: same size (above); each address is a function of its field's
    // type (caller), and a NULL-able function pointer has an address's
    // layout.
    let table = unsafe { core::mem::transmute_copy(&a) };
    // SAFETY: under the binding lock, unpublished (caller); `m` is held until
    // the table is retracted (`finish_drain`) or the module exits.
    unsafe { api.publish(table) };
    *held = Some(m.clone());
}

/// Whether the GPU driver's `version=` is one this module knows: its major
/// (`MAJOR.MINOR[.PATCH]`) is [`DRIVER_MAJOR_MIN`] or later.
pub(crate) fn driver_version_ok(v: &[u8]) -> bool {
    let major = v.split(|&b| b == b'.').next().unwrap_or(&[]);
    let parsed = core::str::from_utf8(major)
        .ok()
        .and_then(|s| s.parse::<u32>().ok());
    let rest_ok = v.len() > major.len() + 1 && v[major.len()] == b'.';
    rest_ok && parsed.is_some_and(|m| m >= DRIVER_MAJOR_MIN)
}

/// Binds the GPU driver's entry points from `m`, if it exports them and
/// passes the checks.
fn bind_gpu(st: &mut State, m: &ModuleRef) -> bool {
    let Some(a) = addresses(m, &P2P_NAMES) else {
        return false;
    };
    let version = m.version().map_or(&b""[..], |v| v.to_bytes());
    if !driver_version_ok(version) {
        pr_err!(
            "refused the GPU driver in module {}: version '{}' is not one this module knows (R{} or later, MAJOR.MINOR[.PATCH]); waiting for another\n",
            name(m),
            core::str::from_utf8(version).unwrap_or("?"),
            DRIVER_MAJOR_MIN,
        );
        return false;
    }
    // SAFETY: `peermem_p2p_api` is `nv-p2p.h`'s functions in `P2P_NAMES`'
    // order, each exported by `m` under its name; under the binding lock
    // (`st`), unbound (`st.gpu` was `None`), before any client registered.
    unsafe { publish(&exports::P2P, &mut st.gpu, m, a) };
    true
}

/// Binds the core's entry points from `m`, if it exports them.
fn bind_core(st: &mut State, m: &ModuleRef) -> bool {
    let Some(a) = addresses(m, &CORE_NAMES) else {
        return false;
    };
    // SAFETY: `peermem_core_api` is `peer_mem.h`'s functions in
    // `CORE_NAMES`' order, each exported by `m` under its name; under the
    // binding lock (`st`), unbound (`st.core` was `None`), before any client
    // registered.
    unsafe { publish(&exports::CORE, &mut st.core, m, a) };
    true
}

/// Offers `m` to what is not bound yet; whether it bound something.
fn offer(st: &mut State, m: &ModuleRef) -> bool {
    let gpu = st.gpu.is_none() && bind_gpu(st, m);
    let core = st.core.is_none() && bind_core(st, m);
    gpu || core
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

/// Registers the clients once both are bound; their description.
fn register(st: &mut State) -> Result<Option<&'static str>> {
    if st.core.is_none() || st.gpu.is_none() || !st.clients.is_empty() || st.drained {
        return Ok(None);
    }
    let (clients, text) = clients(st.persistent, st.legacy)?;
    st.clients = clients;
    // Free callbacks can be armed from now on: exit waits for them.
    st.fence = (!st.persistent).then(p2p::CallbackFence::new);
    Ok(Some(text))
}

/// A module went live (the module notifier, through the shim): binds what
/// it exports and registers once both are bound. The state's lock
/// serialises the offers (the notifier chain runs callbacks concurrently
/// for modules going live together).
///
/// # Safety
///
/// `module` must be a live module, valid for the call.
#[no_mangle]
unsafe extern "C" fn peermem_module_live(module: *mut bindings::module) {
    let st = &mut *STATE.lock();
    // SAFETY: valid for the call (caller).
    let Some(m) = NonNull::new(module).and_then(|module| unsafe { ModuleRef::get(module) }) else {
        return;
    };
    if st.drained {
        if exports_an_api(&m) {
            resume(st, "a module it binds to came back");
        }
        return;
    }
    if !offer(st, &m) {
        return;
    }
    let registered = register(st);
    let from = name(&m);
    match registered {
        Ok(Some(text)) => pr_info!("registered with the peer-memory core: {text} (bound to module {from})\n"),
        Ok(None) => pr_info!("bound to module {from}; waiting for {}\n", Missing(st)),
        // The core said why (client::CoreRegistration::new).
        Err(e) => pr_err!("bound to module {from}, but registering the clients failed ({e:?}); reload nvidia_peermem to try again\n"),
    }
}

/// Whether `m` exports the core's or the GPU driver's first entry point.
fn exports_an_api(m: &ModuleRef) -> bool {
    [P2P_NAMES[0], CORE_NAMES[0]]
        .iter()
        .any(|n| !m.export(n).is_null())
}

/// Binds what is live and registers if both are; says so (`why`: the
/// occasion, for the log).
fn bind_live(st: &mut State, why: fmt::Arguments<'_>) -> Result {
    for key in [P2P_NAMES[0], CORE_NAMES[0]] {
        if let Some(m) = ModuleRef::exporter(key) {
            offer(st, &m);
        }
    }
    match register(st)? {
        Some(text) => pr_info!("{why}: {text}\n"),
        None => pr_info!(
            "{why}, waiting for {}: its clients register once both are loaded\n",
            Missing(st)
        ),
    }
    Ok(())
}

/// Ends a drain: new registrations are taken again, and a drained module
/// binds and registers again.
fn resume(st: &mut State, why: &str) {
    registry::set_draining(false);
    if !core::mem::take(&mut st.drained) {
        pr_info!("drain ended ({why}): registrations are accepted again\n");
        return;
    }
    if let Err(e) = bind_live(st, format_args!("drain ended ({why})")) {
        pr_err!("drain ended ({why}), but registering the clients failed ({e:?}); write 1 then 0 to drain to try again\n");
    }
}

/// `drain` = 0: ends a drain.
pub(crate) fn end_drain() {
    resume(&mut STATE.lock(), "drain set to 0");
}

/// `drain` = 1: from now on new registrations are refused. Whether the
/// module was draining already.
pub(crate) fn start_drain() -> bool {
    let _g = STATE.lock();
    let was = registry::draining();
    registry::set_draining(true);
    was
}

/// Completes a drain once no registration lives: unregisters the clients,
/// waits for the free callbacks still returning, and lets go of the core's
/// and the GPU driver's modules, which can then be unloaded. Whether the
/// module is drained.
pub(crate) fn finish_drain() -> bool {
    let st = &mut *STATE.lock();
    if st.drained || !registry::draining() || registry::live_count() != 0 {
        return st.drained;
    }
    st.drained = true;
    // Unregistering returns at once: the core holds no registration.
    drop(core::mem::take(&mut st.clients));
    drop(st.fence.take());
    // Nothing calls through the tables any more: the clients are
    // unregistered, no registration lives, and no free callback runs (the
    // fence).
    exports::P2P.retract();
    exports::CORE.retract();
    let (core, gpu) = (st.core.take(), st.gpu.take());
    pr_info!(
        "drained: the clients are unregistered from the peer-memory core, and modules {} and {} can be unloaded; nvidia_peermem registers again when one of them is loaded again, or on writing 0 to /sys/module/nvidia_peermem/drain\n",
        core.as_ref().map_or("-", name),
        gpu.as_ref().map_or("-", name),
    );
    true
}

/// The binding from load to exit: the module notifier, the clients and the
/// free-callback fence. Dropped first at exit.
///
/// # Invariants
///
/// The shim's module notifier is registered from `new` until `drop`.
pub(crate) struct Binding(());

impl Binding {
    /// Watches for modules going live, binds those already live, and
    /// registers the clients if both are. A core present at load that
    /// refuses the clients fails the load, as before late binding.
    pub(crate) fn new() -> Result<Self> {
        kernel::error::to_result(ffi::peermem_watch_modules())?;
        // INVARIANT: registered just above.
        let this = Self(());
        let version = env!("PEERMEM_VERSION");
        bind_live(&mut STATE.lock(), format_args!("version {version} loaded"))?;
        Ok(this)
    }
}

impl Drop for Binding {
    fn drop(&mut self) {
        // Returns once no offer runs; none starts after; then no drain
        // completes any more.
        ffi::peermem_unwatch_modules();
        ffi::peermem_drain_cancel();
        let (clients, fence) = {
            let st = &mut *STATE.lock();
            (core::mem::take(&mut st.clients), st.fence.take())
        };
        // The clients unregister (the core waits for their registrations),
        // then the free callbacks still returning are waited for.
        drop(clients);
        drop(fence);
    }
}

/// The references to the core's and the GPU driver's modules: made first at
/// load, dropped last at exit, after everything that may call them.
pub(crate) struct Exporters(());

impl Exporters {
    /// Initializes the state's lock; records the mode the clients will
    /// register in.
    pub(crate) fn new(persistent: bool, legacy: bool) -> Self {
        // SAFETY: once, at the module's init, before anything locks it.
        unsafe { STATE.init() };
        let st = &mut *STATE.lock();
        st.persistent = persistent;
        st.legacy = legacy;
        Self(())
    }
}

impl Drop for Exporters {
    fn drop(&mut self) {
        let st = &mut *STATE.lock();
        drop(st.gpu.take());
        drop(st.core.take());
    }
}
