// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The peer-memory clients (`nv_mem`, `nv_mem_nc`): the C function tables the
//! core calls, and their trampolines from raw C arguments to
//! [`Registration`] methods and back to errno values. `acquire` is built for
//! its client's mode (`INV`: the invalidating client); the other calls
//! follow the registration's own mode: OFED's core calls a registration only
//! through the client whose `acquire` made it, as it keeps that client with
//! the umem (docs/driver-facts.md, facts 11 to 14).

use core::ptr::NonNull;

use kernel::{
    bindings,
    ffi::{
        c_char,
        c_int,
        c_ulong,
        c_void, //
    },
    prelude::*, //
};

use kernel::sync::atomic::{
    Atomic,
    Relaxed, //
};

use crate::{
    compat, core_link, exports, ffi,
    peer_device::PeerDevice,
    registration::{
        registry,
        Mode,
        RegRef,
        Registration, //
    },
    stats::{
        self,
        Cause,
        STATS, //
    },
};

/// The module version as the clients report it (at most 14 characters: the
/// core reads byte 15 of the field as the "extended struct" marker).
const VERSION: &str = env!("PEERMEM_VERSION");
const _: () = assert!(VERSION.len() <= ffi::IB_PEER_MEMORY_VER_MAX as usize - 2);

const fn c_array<const N: usize>(s: &str, marker: u8) -> [c_char; N] {
    let mut out = [0 as c_char; N];
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        out[i] = b[i] as c_char;
        i += 1;
    }
    out[N - 1] = marker as c_char;
    out
}

/// A client table handed to the core; it keeps the pointer until unregister.
#[repr(transparent)]
pub(crate) struct ClientTable(pub(crate) ffi::peer_memory_client_ex);

// SAFETY: the table is immutable after build time.
unsafe impl Sync for ClientTable {}

const fn table<const INV: bool>(name: &str, extended: bool) -> ClientTable {
    let client = ffi::peer_memory_client {
        name: c_array(name, 0),
        version: c_array(VERSION, extended as u8),
        acquire: Some(acquire::<INV>),
        get_pages: Some(get_pages),
        dma_map: Some(dma_map),
        dma_unmap: Some(dma_unmap),
        put_pages: Some(put_pages),
        get_page_size: Some(get_page_size),
        release: Some(release),
    };
    ClientTable(ffi::peer_memory_client_ex {
        client,
        ex_size: core::mem::size_of::<ffi::peer_memory_client_ex>(),
        flags: if extended {
            ffi::PEER_MEM_INVALIDATE_UNMAPS
        } else {
            0
        },
    })
}

/// `nv_mem` revoking through the core's hook, extended with
/// `PEER_MEM_INVALIDATE_UNMAPS` (the core never unmaps from its invalidate).
pub(crate) static NV_MEM_INVALIDATING: ClientTable = table::<true>("nv_mem", true);
/// `nv_mem` revoking through the core's hook, for old cores
/// (`peerdirect_support=1`): the core unmaps from inside its invalidate.
pub(crate) static NV_MEM_INVALIDATING_LEGACY: ClientTable = table::<true>("nv_mem", false);
/// `nv_mem` with persistent pages (`persistent_api_support=1`).
pub(crate) static NV_MEM_PERSISTENT: ClientTable = table::<false>("nv_mem", false);
/// `nv_mem_nc`: persistent pages, usable for CQ/QP umems too.
pub(crate) static NV_MEM_NC: ClientTable = table::<false>("nv_mem_nc", false);

/// A client registered with the core; unregisters on drop, which blocks until
/// the core released every registration made through it.
///
/// # Invariants
///
/// `handle` was returned by `ib_register_peer_memory_client` for `table`.
pub(crate) struct CoreRegistration {
    handle: NonNull<c_void>,
    link: Option<&'static core_link::CoreLink>,
}

// SAFETY: the handle is an opaque token of the core, usable from any thread.
unsafe impl Send for CoreRegistration {}
// SAFETY: as above; no interior state.
unsafe impl Sync for CoreRegistration {}

impl CoreRegistration {
    /// Registers `table`; with `link`, as an invalidating client.
    pub(crate) fn new(
        table: &'static ClientTable,
        link: Option<&'static core_link::CoreLink>,
    ) -> Result<Self> {
        let core = exports::CORE.get().ok_or(ENODEV)?;
        let register = core.register_client.ok_or(ENODEV)?;
        let slot = link.map_or(core::ptr::null_mut(), |l| l.hook_slot());
        // SAFETY: the core's bound entry point; `table` is 'static; `slot`
        // is NULL or a 'static slot.
        let handle = unsafe { register(&table.0.client, slot) };
        let handle = NonNull::new(handle).ok_or_else(|| {
            pr_err!("the peer-memory core refused a client (a client of this name already registered?)\n");
            EBUSY
        })?;
        // INVARIANT: returned by the core for `table`.
        let this = Self { handle, link };
        // A core that takes an invalidating client writes its hook; one that
        // did not cannot revoke: refused (and unregistered on drop).
        if link.is_some_and(|l| !l.publish(handle.as_ptr())) {
            pr_err!("the peer-memory core registered the invalidating client without an invalidate hook: refused; load with persistent_api_support=1\n");
            return Err(compat::eproto());
        }
        Ok(this)
    }
}

impl Drop for CoreRegistration {
    fn drop(&mut self) {
        // Bound before `new` registered, never unbound while registered.
        let Some(unregister) = exports::CORE.get().and_then(|c| c.unregister_client) else {
            return;
        };
        // SAFETY: the core's bound entry point; registered in `new` (type
        // invariant), unregistered once.
        unsafe { unregister(self.handle.as_ptr()) };
        if let Some(l) = self.link {
            l.retract();
        }
    }
}

/// `acquire`: claims the range if it is GPU memory the provider can pin.
///
/// # Safety
///
/// Called by the core with `client_context` NULL or a valid out-pointer.
unsafe extern "C" fn acquire<const INV: bool>(
    addr: c_ulong,
    size: usize,
    _peer_mem_private_data: *mut c_void,
    _peer_mem_name: *mut c_char,
    client_context: *mut *mut c_void,
) -> c_int {
    // The invalidating client's registrations use `INVALIDATING`, which is
    // ready once registration with the core returned.
    let ready = !INV || core_link::INVALIDATING.ready();
    if client_context.is_null() || !ready || refused_for_drain::<INV>(addr, size) {
        return 0;
    }
    let mode = if INV {
        Mode::Invalidating
    } else {
        Mode::Persistent
    };
    match Registration::acquire(addr as u64, size as u64, mode) {
        Ok(reg) => {
            STATS.acquired.add(1, Relaxed);
            // SAFETY: `client_context` is a valid out-pointer (checked above).
            unsafe { *client_context = reg.into_raw() };
            1
        }
        // EBUSY: only the drain's admission (a drain began meanwhile).
        Err(e) if e == EBUSY => {
            draining::<INV>(addr, size);
            0
        }
        Err(_) => {
            // Not GPU memory (or not pinnable): not ours; the core tries the
            // next client or returns its own error.
            STATS.declined.add(1, Relaxed);
            0
        }
    }
}

/// Whether a drain refuses this call: while one is requested, and for
/// `nv_mem_nc`, the call `nv_mem` refused for one (see [`DECLINED_BY`]).
fn refused_for_drain<const INV: bool>(addr: c_ulong, size: usize) -> bool {
    if INV {
        DECLINED_BY.store(0, Relaxed);
    } else if declined_for_drain(addr) {
        return true;
    }
    if registry::draining() {
        draining::<INV>(addr, size);
        return true;
    }
    false
}

/// A registration refused by a drain: not claimed (claiming is pinning), so
/// the core returns its own error; said and counted.
#[cold]
fn draining<const INV: bool>(addr: c_ulong, size: usize) {
    if INV {
        DECLINED_BY.store(compat::current_ids().0.get(), Relaxed);
        DECLINED_AT.store(addr as u64, Relaxed);
    }
    let _ = stats::fail!(
        Cause::Draining,
        EBUSY,
        "nvidia_peermem is draining: registration of {addr:#x}+{size:#x} refused"
    );
}

/// The thread and address of the last call `nv_mem` refused for a drain.
/// The core asks its clients in turn, in their order of registration
/// (`nv_mem` first), in the registering thread, under its own mutex
/// (docs/driver-facts.md, fact 11): `nv_mem_nc` refuses that same call, so
/// that a drain ending between the two questions cannot turn the
/// registration into a persistent one. Only those serialised calls use them.
static DECLINED_BY: Atomic<u32> = Atomic::new(0);
static DECLINED_AT: Atomic<u64> = Atomic::new(0);

/// Whether this call is the one `nv_mem` just refused for a drain (then
/// forgotten: the next is another registration).
fn declined_for_drain(addr: c_ulong) -> bool {
    let me = compat::current_ids().0.get();
    if DECLINED_BY.load(Relaxed) != me || DECLINED_AT.load(Relaxed) != addr as u64 {
        return false;
    }
    DECLINED_BY.store(0, Relaxed);
    true
}

/// `get_pages`: see [`Registration::get_pages`].
///
/// # Safety
///
/// `client_context` must be a live context returned by an `acquire` of this
/// module's clients.
unsafe extern "C" fn get_pages(
    addr: c_ulong,
    size: usize,
    _write: c_int,
    _force: c_int,
    _sg_head: *mut bindings::sg_table,
    client_context: *mut c_void,
    core_context: u64,
) -> c_int {
    // SAFETY: the core passes a context of this module's (caller).
    let reg = unsafe { RegRef::borrow(client_context) };
    reg.get_pages(addr as u64, size as u64, core_context)
        .map_or_else(|e| e.to_errno(), |()| 0)
}

/// `dma_map`: see [`Registration::dma_map`].
///
/// # Safety
///
/// `client_context` must be a live context returned by an `acquire` of this
/// module's clients; `sg_head` the core's table for it and `nmap` NULL or
/// valid; `dma_device` NULL or a device the core keeps alive while the
/// registration is mapped.
unsafe extern "C" fn dma_map(
    sg_head: *mut bindings::sg_table,
    client_context: *mut c_void,
    dma_device: *mut bindings::device,
    _dmasync: c_int,
    nmap: *mut c_int,
) -> c_int {
    // SAFETY: the core's arguments of `dma_map` (caller): its table for this
    // registration, NULL or a valid `nmap`, a context of this module's, and
    // NULL or a device it keeps alive while the registration is mapped.
    let (head, nmap, reg, peer) = unsafe {
        (
            sg_head.as_mut(),
            nmap.as_mut(),
            RegRef::borrow(client_context),
            PeerDevice::new(dma_device),
        )
    };
    let (Some(head), Some(nmap)) = (head, nmap) else {
        return EINVAL.to_errno();
    };
    match reg.dma_map(head, peer) {
        Ok(n) => {
            *nmap = n as c_int;
            0
        }
        Err(e) => e.to_errno(),
    }
}

/// `dma_unmap`: see [`Registration::dma_unmap`].
///
/// # Safety
///
/// `client_context` must be a live context returned by an `acquire` of this
/// module's clients.
unsafe extern "C" fn dma_unmap(
    _sg_head: *mut bindings::sg_table,
    client_context: *mut c_void,
    _dma_device: *mut bindings::device,
) -> c_int {
    // SAFETY: the core passes a context of this module's (caller).
    unsafe { RegRef::borrow(client_context) }.dma_unmap();
    0
}

/// `put_pages`: see [`Registration::put_pages`]; nothing to do without a
/// mapping, the core's usual order.
///
/// # Safety
///
/// `client_context` must be a live context returned by an `acquire` of this
/// module's clients.
unsafe extern "C" fn put_pages(_sg_head: *mut bindings::sg_table, client_context: *mut c_void) {
    // SAFETY: the core passes a context of this module's (caller).
    let reg = unsafe { RegRef::borrow(client_context) };
    if reg.put_pages_needed() {
        reg.put_pages();
    }
}

/// `get_page_size`: the granule of every entry we build.
///
/// # Safety
///
/// No requirement; `unsafe` only for the C function table's type.
unsafe extern "C" fn get_page_size(_client_context: *mut c_void) -> c_ulong {
    // Every entry we build starts and ends on a 64 KiB boundary; the core
    // trims the first and last to the user's range.
    crate::range::granule(bindings::PAGE_SIZE as u64) as c_ulong
}

/// `release`: see [`Registration::release`].
///
/// # Safety
///
/// `client_context` must be a live context returned by an `acquire` of this
/// module's clients, released once.
unsafe extern "C" fn release(client_context: *mut c_void) {
    // SAFETY: a context of this module's, passed to `release` once (caller):
    // the core's reference comes back, and goes once the registration is
    // released.
    let reg = unsafe { RegRef::from_raw(client_context) };
    reg.release();
}
