// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Exhaustive interleavings (loom) of one registration's teardown against the
//! GPU driver's free callback.
//!
//! The decisions are the module's own `lifecycle.rs`; around it, this file
//! models what `registration.rs` does with them (lock, decide, drop the lock,
//! call the provider) and what the real components guarantee:
//! - the provider (nvidia.ko) holds its lock across the free callback, frees
//!   the page table and its mappings right after the callback returns, and its
//!   unpin looks the table up under that lock (0 if the callback took it);
//!   its DMA map/unmap use the table's own lock (nv-p2p.c's mapping list),
//!   not the one held across the callback — if they did, the core's mapping
//!   lock (held around dma_map, taken by invalidate) would deadlock against
//!   any client: loom finds that interleaving at once;
//! - the core (OFED >= 5.5) holds the registration's mapping lock from
//!   get_pages until the notifier is armed, and its invalidate takes it.
//!
//! Checked in every interleaving: the provider's objects are never used after
//! they are freed, the pin is undone exactly once (by unpin or by the
//! callback), the callback's reference is dropped exactly once, the
//! registration is freed exactly once and not leaked, and nothing deadlocks.

use crate::lifecycle::{Invalidate, Lifecycle, Outcome, Teardown};
use loom::sync::{
    atomic::{AtomicUsize, Ordering::SeqCst},
    Arc, Mutex,
};

/// nvidia.ko's tracker of one page table (under the driver's lock).
#[derive(Default)]
struct Tracker {
    /// Pinned without a callback (nvidia_p2p_get_pages_persistent).
    persistent: bool,
    /// The table is linked (pinned, callback armed if any).
    linked: bool,
    /// Times the table was released (unpin or callback).
    released: usize,
    /// The callback's reference, while armed.
    callback_ref: Option<Arc<Reg>>,
}

/// The table's own memory and mapping list (nv-p2p.c keeps the mappings
/// under a per-table lock, not the driver's).
#[derive(Default)]
struct Table {
    allocated: bool,
    mapped: bool,
}

struct Provider {
    /// The driver's lock, held across the free callback.
    rm: Mutex<Tracker>,
    table: Mutex<Table>,
}

impl Provider {
    fn new() -> Self {
        Self {
            rm: Mutex::new(Tracker::default()),
            table: Mutex::new(Table::default()),
        }
    }

    fn get_pages(&self, cb: Option<Arc<Reg>>) {
        let mut s = self.rm.lock().unwrap();
        s.linked = true;
        s.persistent = cb.is_none();
        s.callback_ref = cb;
        self.table.lock().unwrap().allocated = true;
    }

    /// Dereferences the table, like nvidia_p2p_dma_map_pages.
    fn dma_map(&self) {
        let mut t = self.table.lock().unwrap();
        assert!(t.allocated, "dma_map on a freed page table");
        t.mapped = true;
    }

    /// Dereferences the table, like nvidia_p2p_dma_unmap_pages.
    fn dma_unmap(&self) {
        let mut t = self.table.lock().unwrap();
        assert!(t.allocated, "dma_unmap on a freed page table");
        t.mapped = false;
    }

    fn free_table(&self) {
        let mut t = self.table.lock().unwrap();
        t.allocated = false;
        t.mapped = false;
    }

    /// nvidia_p2p_put_pages: looks the table up; 0 if the callback took it.
    fn put_pages(&self) -> Option<Arc<Reg>> {
        let mut s = self.rm.lock().unwrap();
        if s.linked {
            s.linked = false;
            s.released += 1;
            self.free_table();
            // The provider forgets the callback; the client reclaims the ref.
            return s.callback_ref.take();
        }
        None
    }

    /// cudaFree: under the driver's lock, the callback, then the table and
    /// its mappings are freed.
    fn free(&self, core: &Core) {
        let mut s = self.rm.lock().unwrap();
        // A persistent pin keeps the memory until it is unpinned.
        if !s.linked || s.persistent {
            return;
        }
        s.linked = false;
        if let Some(reg) = s.callback_ref.take() {
            free_callback(reg, core);
        }
        self.free_table();
        s.released += 1;
    }
}

/// The peer-memory core's side of one umem.
struct Core {
    /// The umem's mapping lock.
    mapping: Mutex<()>,
    /// Invalidate calls that found the umem.
    invalidations: AtomicUsize,
}

/// The registration (registration.rs): a lifecycle under a lock.
struct Reg {
    lc: Mutex<Lifecycle>,
    provider: Arc<Provider>,
    drops: Arc<AtomicUsize>,
}

impl Drop for Reg {
    fn drop(&mut self) {
        self.drops.fetch_add(1, SeqCst);
    }
}

fn free_callback(reg: Arc<Reg>, core: &Core) {
    let action = reg.lc.lock().unwrap().invalidate();
    if action == Invalidate::NotifyCore {
        let _g = core.mapping.lock().unwrap();
        core.invalidations.fetch_add(1, SeqCst);
    }
    drop(reg); // the callback's reference
}

fn teardown(reg: &Reg, t: Teardown, invalidating: bool) -> Option<Arc<Reg>> {
    if t.unmap_provider {
        reg.provider.dma_unmap();
    }
    if t.unpin_provider {
        let provider_ref = reg.provider.put_pages();
        if invalidating && reg.lc.lock().unwrap().unpinned() {
            // registration.rs drops the reference the provider held.
            return Some(provider_ref.expect("provider still held the callback's reference"));
        }
        assert!(provider_ref.is_none() || !invalidating);
    }
    None
}

/// The core's thread: acquire (pin), get_pages + dma_map under the mapping
/// lock, then deregistration (UNMAPS flow) and release.
fn core_thread(reg: Arc<Reg>, core: &Core, invalidating: bool) {
    // acquire: pin, with the callback's own reference.
    reg.lc.lock().unwrap().start_pin().unwrap();
    let cb = if invalidating {
        Some(Arc::clone(&reg))
    } else {
        None
    };
    reg.provider.get_pages(cb);
    let pinned = reg.lc.lock().unwrap().pin_succeeded() == Outcome::Done;
    let mut mapped = false;
    if pinned {
        let _m = core.mapping.lock().unwrap();
        // get_pages: nothing to do but check; dma_map:
        if reg.lc.lock().unwrap().start_map().is_ok() {
            reg.provider.dma_map();
            mapped = reg.lc.lock().unwrap().map_succeeded() == Outcome::Done;
        }
    }
    if mapped {
        // dereg: the core unmaps after dropping its mapping lock.
        let t = reg.lc.lock().unwrap().unmap();
        assert!(teardown(&reg, t, invalidating).is_none());
        let t = reg.lc.lock().unwrap().put_pages();
        assert!(teardown(&reg, t, invalidating).is_none());
    }
    // release
    let t = reg.lc.lock().unwrap().release();
    let reclaimed = teardown(&reg, t, invalidating);
    reg.lc.lock().unwrap().released();
    drop(reclaimed);
    drop(reg); // the core's reference
}

/// Interleavings explored by each model (std atomics: outside loom's view).
static EXPLORED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn model(invalidating: bool) -> usize {
    EXPLORED.store(0, std::sync::atomic::Ordering::SeqCst);
    loom::model(move || {
        EXPLORED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let drops = Arc::new(AtomicUsize::new(0));
        let provider = Arc::new(Provider::new());
        let core = Arc::new(Core {
            mapping: Mutex::new(()),
            invalidations: AtomicUsize::new(0),
        });
        let reg = Arc::new(Reg {
            lc: Mutex::new(Lifecycle::new(invalidating)),
            provider: Arc::clone(&provider),
            drops: Arc::clone(&drops),
        });
        let (p2, c2) = (Arc::clone(&provider), Arc::clone(&core));
        let freer = loom::thread::spawn(move || p2.free(&c2));
        core_thread(reg, &core, invalidating);
        freer.join().unwrap();
        let s = provider.rm.lock().unwrap();
        assert!(
            !s.linked && !provider.table.lock().unwrap().allocated,
            "the pin outlived everything"
        );
        assert!(
            s.released <= 1,
            "the page table was released {} times",
            s.released
        );
        assert!(s.callback_ref.is_none());
        assert_eq!(
            drops.load(SeqCst),
            1,
            "registration freed {} times",
            drops.load(SeqCst)
        );
    });
    EXPLORED.load(std::sync::atomic::Ordering::SeqCst)
}

// One test function, so the two models never share EXPLORED concurrently.
#[test]
fn free_callback_against_registration_and_teardown() {
    let inv = model(true);
    let per = model(false);
    println!("loom: explored {inv} interleavings (invalidating), {per} (persistent)");
    assert!(
        inv > 10 && per > 1,
        "the models explored too little: {inv}, {per}"
    );
}
