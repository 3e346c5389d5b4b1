// SPDX-License-Identifier: GPL-2.0 OR MIT

//! `release`: the unpin, and the pins the core let go of that this module
//! keeps (orphaned or stranded) until the GPU driver's free callback.

use kernel::{
    prelude::*,
    sync::atomic::Relaxed, //
};

use core::num::NonZeroU32;

use super::{
    Charges,
    Entered,
    Mode,
    Registration,
    Span, //
};
use crate::{
    compat, ffi,
    lifecycle::Unpinned,
    p2p::PageTable,
    stats::{
        fail,
        Cause,
        STATS, //
    },
};

impl Registration {
    /// `release`: undoes whatever the core left and unpins if this process
    /// may; the caller drops the core's reference after it. Returns only
    /// once no free callback of this registration is inside the core (the
    /// core may free what that callback uses once we return), unless the
    /// caller is that callback (OFED 4.x releases from inside its
    /// invalidate).
    pub(crate) fn release(&self) {
        self.undo();
        STATS.releases.add(1, Relaxed);
    }

    /// [`Registration::release`]'s work, uncounted: also what `acquire`
    /// undoes when a drain refuses a persistent pin it made.
    pub(super) fn undo(&self) {
        // No free callback is ever inside the core for a persistent
        // registration, and any process may unpin it: its release needs
        // neither the thread's nor the process's id.
        let ids = (self.mode == Mode::Invalidating).then(compat::current_ids);
        let (r, charge, owner) = {
            let mut g = self.enter();
            let tgid = ids.map_or(0, |ids| self.unpinner(&mut g, ids));
            self.holds_map.store(0, Relaxed);
            let owner = g.lc.owner().unwrap_or(0);
            let r = g.lc.release(tgid);
            // A persistent pin's life ends here, and its count with it
            // (released once the unpin returned).
            let charges = g.charges(r.ended);
            (r, charges, owner)
        };
        drop(r.map);
        if r.orphaned {
            STATS.foreign_releases.add(1, Relaxed);
            STATS.orphaned_pins.add(1, Relaxed);
            self.held_pin("released in another process than the pinning one", owner);
        }
        match r.unpin {
            Some(table) if r.ended => self.unpin_persistent(table, charge),
            Some(table) => self.unpin(table),
            None => (),
        }
    }

    /// Waits until no other thread's call into the core's invalidate for
    /// this registration runs; returns the process that may unpin: the
    /// caller's (`ids`), or none (0) for a release from inside our own call
    /// of the core's invalidate (a drain's, on OFED 4.x), which never
    /// unpins there: a free callback holding the GPU driver's lock may be
    /// waiting for that call. Its pin is left to the callback (orphaned).
    fn unpinner(&self, g: &mut Entered<'_>, (me, tgid): (NonZeroU32, u32)) -> u32 {
        while g.in_core.is_some_and(|t| t != me) {
            self.wait(g);
        }
        g.in_core.map_or(tgid, |_| 0)
    }

    /// Unpins a non-persistent pin at the provider and settles the
    /// callback's reference.
    pub(super) fn unpin(&self, table: PageTable) {
        // SAFETY: pinned by `pin` for `self.range` with a callback (the
        // lifecycle hands a table out without `ended` only for a pin with a
        // callback's token, which only `pin` gives), handed out once, and
        // only to the pinning process.
        let res = unsafe { table.put(&self.range()) };
        let (how, token, charges) = {
            let mut g = self.enter();
            let (how, token) = g.lc.unpinned(res.is_ok());
            // A stranded pin stays counted until its callback.
            let charges = g.charges(how != Unpinned::Stranded);
            (how, token, charges)
        };
        charges.release(self.range().len);
        match how {
            // Raced: the callback ended the pin first; it had no table to
            // count.
            Unpinned::Reclaim | Unpinned::Raced => {
                STATS.pinned_bytes.fetch_sub(self.range().len, Relaxed);
            }
            Unpinned::Stranded => self.stranded(res.err().unwrap_or(EIO)),
        }
        if let Some(cb) = token {
            // SAFETY: the lifecycle hands the token out only after a
            // successful unpin by the pinning process that its callback did
            // not race: the provider unlinked the pin under the lock it holds
            // across callbacks, so the callback never runs. Not the last
            // reference: our caller holds the core's.
            drop(unsafe { cb.reclaim(self) });
        }
    }

    /// The unpin failed with `err`: the pin and its callback stay armed until
    /// the GPU memory is freed.
    fn stranded(&self, err: Error) {
        STATS.stranded_pins.add(1, Relaxed);
        self.held_pin("nvidia_p2p_put_pages failed", compat::current_tgid());
        fail!(
            Cause::Unpin,
            err,
            "nvidia_p2p_put_pages failed for {}: the pin stays until the GPU memory is freed",
            Span(self.range())
        );
    }

    /// One line for each pin the core let go of that this module keeps (an
    /// orphaned or stranded pin): it holds the module, and nvidia.ko, loaded
    /// until the GPU driver's free callback ends it.
    #[cold]
    fn held_pin(&self, why: &str, owner: u32) {
        // A process can make many (fork, exit): the counters have them all.
        if !ffi::peermem_ratelimit() {
            return;
        }
        let (start, len) = (self.range().start, self.range().len);
        pr_warn!(
            "{why}: GPU memory {start:#x}+{len:#x} ({len} bytes) pinned by process {} stays pinned until that process frees it or exits; until then nvidia_peermem and nvidia cannot be unloaded (released by process {})\n",
            compat::Process(owner),
            compat::Process(compat::current_tgid())
        );
    }

    /// Unpins a persistent pin, whose lifecycle already ended, and releases
    /// its count.
    fn unpin_persistent(&self, table: PageTable, charges: Charges) {
        // SAFETY: a persistent pin made by `acquire` for `self.range` (the
        // lifecycle ends with `ended` only for a pin without a callback's
        // token, which only `get_pages_persistent` gives), handed out once.
        let res = unsafe { table.put_persistent(&self.range()) };
        charges.release(self.range().len);
        STATS.pinned_bytes.fetch_sub(self.range().len, Relaxed);
        if let Err(e) = res {
            STATS.leaked_pins.add(1, Relaxed);
            fail!(
                Cause::Unpin,
                e,
                "nvidia_p2p_put_pages_persistent failed for {}: the pin is lost",
                Span(self.range())
            );
        }
    }
}
