// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The GPU driver's free callback: revoke through the core, then undo the
//! client's own mapping; its reference leaves through the reap work.

use kernel::{
    bindings,
    ffi::c_void,
    sync::atomic::Relaxed,
    types::Opaque, //
};

use super::{
    refs,
    Entered,
    Mode,
    RegRef,
    Registration,
    Span, //
};
use crate::{
    compat, core_link,
    device_map::DeviceMap,
    lifecycle::Invalidate,
    stats::{
        reg_dbg,
        STATS, //
    },
};

/// The free callback given to `nvidia_p2p_get_pages`.
///
/// # Safety
///
/// `data` is the reference that `pin` gave the provider; the provider calls
/// this at most once, and only while the pin is armed.
pub(super) unsafe extern "C" fn free_trampoline(data: *mut c_void) {
    // SAFETY: the provider hands back the reference given in `pin`; it is
    // consumed here (the registration's lifecycle then never reclaims it).
    let owner = unsafe { RegRef::from_raw(data) };
    if owner.mode == Mode::Invalidating {
        owner.revoke();
    }
    // The callback's reference can be the registration's last one, and its
    // drop drops a module reference: dropped from the shim's work, which the
    // module's exit flushes (see `refs`), never here.
    refs::defer(owner);
}

/// The module's reap work (called by the C shim's work item for each node
/// of its list): drops the reference a free callback left.
///
/// # Safety
///
/// `node` is the reap link of a registration that [`refs::defer`] put on the
/// list, taken off it once.
#[no_mangle]
unsafe extern "C" fn peermem_reap_one(node: *mut bindings::llist_node) {
    let reg = kernel::container_of!(
        node.cast::<Opaque<bindings::llist_node>>(),
        Registration,
        reap_link
    );
    // SAFETY: the reference `defer` handed to the list, on this object
    // (caller), taken back once.
    drop(unsafe { RegRef::from_raw(reg.cast()) });
}

impl Registration {
    /// The GPU driver revoked the pages: tell the core, which stops the
    /// device before we return (the provider frees everything right after),
    /// then undo our own mapping.
    fn revoke(&self) {
        STATS.invalidations.add(1, Relaxed);
        let (action, had_pin, charges) = {
            let mut g = self.enter();
            // The table comes back only to be forgotten: the provider frees
            // it once we return.
            let (action, table) = g.lc.invalidate();
            self.wait_for_users(&mut g, action);
            let ended = table.is_some() || matches!(action, Invalidate::Reaped { .. });
            (action, ended, g.charges(ended))
        };
        if had_pin {
            STATS.pinned_bytes.fetch_sub(self.range().len, Relaxed);
        }
        charges.release(self.range().len);
        self.revoked(action);
    }

    /// Waits, in the free callback, for what still uses the pages the
    /// provider frees as soon as the callback returns: a drain inside the
    /// core's invalidate for this registration (the only other thread that
    /// can be: one callback per pin), then, marked as inside the core
    /// itself when it is to notify it, a `dma_map` reading the table (it
    /// takes no lock of the provider's and sees the revoke when it
    /// finishes).
    fn wait_for_users(&self, g: &mut Entered<'_>, action: Invalidate) {
        while g.in_core.is_some() {
            self.wait(g);
        }
        if let Invalidate::NotifyCore(_) = action {
            // The calling thread, compared only.
            g.in_core = Some(compat::current_ids().0);
        }
        while g.mapper {
            self.wait(g);
        }
    }

    /// Does what the free callback must after the lifecycle decided.
    fn revoked(&self, action: Invalidate) {
        reg_dbg!("free callback for {}: {action:?}", Span(self.range()));
        match action {
            Invalidate::NotifyCore(ctx) => self.revoke_in_core(ctx),
            Invalidate::Reaped { orphaned: true } => {
                STATS.orphaned_pins.fetch_sub(1, Relaxed);
            }
            Invalidate::Reaped { orphaned: false } => {
                STATS.stranded_pins.fetch_sub(1, Relaxed);
            }
            Invalidate::Quiet => (),
        }
    }

    /// The module's drain: revokes this registration through the core as the
    /// free callback would, if it is an invalidating one the core holds; its
    /// pin stays until `release` or the callback (see
    /// [`crate::lifecycle::Lifecycle::drain`]). Whether it revoked.
    pub(crate) fn drain(&self) -> bool {
        let mut g = self.enter();
        let Some(ctx) = g.lc.drain() else {
            return false;
        };
        // `release` waits until the core's invalidate returned.
        g.in_core = Some(compat::current_ids().0);
        drop(g);
        STATS.drain_revoked.add(1, Relaxed);
        self.revoke_in_core(ctx);
        true
    }

    /// Who holds this registration's pin, its mode and length, while the
    /// pin lives.
    pub(crate) fn holder(&self) -> Option<(u32, Mode, u64)> {
        let owner = self.enter().lc.pin_owner()?;
        Some((owner, self.mode, self.range().len))
    }

    /// Asks the core to revoke the registration it knows as `ctx`, then
    /// undoes the device's access unless the core did from inside its
    /// invalidate (legacy cores). The scatterlist stays until the core unmaps
    /// or releases.
    fn revoke_in_core(&self, ctx: u64) {
        // The core's invalidate takes mutexes: the GPU driver must call us
        // from sleepable context (lockdep checks it), as the drain does.
        kernel::task::might_sleep();
        STATS.core_invalidations.add(1, Relaxed);
        core_link::INVALIDATING.invalidate(ctx);
        let access = self
            .enter()
            .lc
            .revoked_map_mut()
            .and_then(DeviceMap::take_device_access);
        drop(access);
        let mut g = self.enter();
        g.in_core = None;
        self.wake(&g);
    }
}
