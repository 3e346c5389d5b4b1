// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Interleavings (loom, bounded by `PREEMPTIONS` preemptions each) of one
//! registration's life against the GPU driver's free callback and the
//! module's queue that drops the callback's reference.
//!
//! The decisions are the module's own `lifecycle.rs`; around it, this file
//! models what `registration.rs` does with them (lock, decide, drop the lock,
//! call the provider; `release` waits while the callback is inside the core,
//! the callback waits for a `dma_map` in flight) and what the real
//! components guarantee (docs/driver-facts.md):
//! - nvidia.ko takes its RM API lock in `get_pages`, `put_pages` and
//!   `dma_map` (persistent pins), and holds it across the free callback; it
//!   frees the page table right after the callback returns (facts 1-2).
//!   `put_pages` looks a non-persistent pin up by the caller's process: from
//!   another one it returns 0 and unpins nothing (fact 7); after the callback
//!   it returns 0; a failure leaves the pin and its callback armed (fact 8).
//! - the core (OFED >= 5.5) holds the registration's mapping lock across
//!   `get_pages` + `dma_map`, and its invalidate waits for it (facts 12-13);
//!   it calls `release` outside that lock and clears its client pointer once
//!   `release` returned, which an invalidate in flight reads (fact 14).
//! - in invalidating mode the client maps the BAR pages itself, without the
//!   RM lock (`device_map.rs`): taking it there deadlocks against a free
//!   callback waiting for the mapping lock (fact 3), which loom reports.
//!
//! Checked in every interleaving: the provider's objects are never used after
//! they are freed (a loom `UnsafeCell` also checks each access is ordered
//! after the free or before it), the pin ends exactly once (by unpin or by
//! the callback), the callback's reference is consumed exactly once, the
//! registration is freed exactly once and nothing leaks (loom checks its
//! `Arc`s), no mapping is left, and nothing deadlocks.
//!
//! Mutants (`Mutant`) re-introduce the bugs the lifecycle was fixed for;
//! each must make some interleaving fail.

use crate::lifecycle::{Invalidate, Lifecycle, Pin, Resources, Unpinned};
use loom::{
    cell::UnsafeCell,
    sync::{Arc, Condvar, Mutex, MutexGuard},
};
use std::{
    mem::ManuallyDrop,
    ops::{Deref, DerefMut},
    sync::atomic::{AtomicUsize as Counter, Ordering::Relaxed},
};

/// Owns a loom object held across a blocking call, and drops it except while
/// a failing model unwinds: loom cannot run destructors then (after a
/// deadlock it has no active thread, and a second panic aborts the test).
struct Kept<T>(ManuallyDrop<T>);

impl<T> Kept<T> {
    fn new(t: T) -> Self {
        Self(ManuallyDrop::new(t))
    }

    fn into_inner(self) -> T {
        let mut this = ManuallyDrop::new(self);
        // SAFETY: taken once; `this` is never dropped.
        unsafe { ManuallyDrop::take(&mut this.0) }
    }
}

impl<T> Deref for Kept<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> Drop for Kept<T> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            // SAFETY: dropped once, here.
            unsafe { ManuallyDrop::drop(&mut self.0) }
        }
    }
}

/// A bug re-introduced in the glue, to check that the model catches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mutant {
    /// The module as it is.
    None,
    /// Fix 1: the callback's reference is reclaimed although `put_pages`
    /// failed (the pin and its callback stay armed).
    ReclaimAfterFailedUnpin,
    /// Fix 2: a release in another process is taken for an unpin, and the
    /// reference reclaimed (the GPU driver unpinned nothing).
    ReclaimAfterForeignUnpin,
    /// Fix 3: the invalidating `dma_map` takes the RM lock (as
    /// `nvidia_p2p_dma_map_pages` does) under the core's mapping lock.
    RmLockInDmaMap,
    /// Fix 6: `release` returns while the free callback is inside the core.
    ReleaseWithoutWaiting,
}

/// One model: how the registration is pinned and released.
#[derive(Clone, Copy, Debug)]
struct Scenario {
    name: &'static str,
    persistent: bool,
    /// `release` runs in another process than the pinning one.
    foreign_release: bool,
    /// `nvidia_p2p_put_pages` fails once (fact 8).
    unpin_fails: bool,
    /// A core without PEER_MEM_INVALIDATE_UNMAPS: its invalidate calls
    /// `dma_unmap` and `put_pages` from inside the free callback (fact 13).
    legacy_core: bool,
    mutant: Mutant,
}

/// The process that pins, and another one.
const OWNER: u32 = 100;
const OTHER: u32 = 200;
/// The core's id for the registration.
const CTX: u64 = 1;
/// Tasks, as `registration.rs` compares them (`in_core`).
const CORE_TASK: usize = 1;
const FREE_TASK: usize = 2;

/// Counters outside loom's view, for the final checks only (loom runs one
/// thread at a time, so they are exact per execution).
#[derive(Default)]
struct Counters {
    regs_freed: Counter,
    maps_made: Counter,
    maps_undone: Counter,
}

/// nvidia.ko's record of the pin, under the RM API lock.
struct Rm {
    linked: bool,
    owner: u32,
    /// Times the pin ended (unpin or callback).
    ended: usize,
    /// The next `put_pages` fails.
    fail_next_put: bool,
}

/// nvidia.ko.
struct Provider {
    persistent: bool,
    /// The RM API lock (fact 1).
    rm: Mutex<Rm>,
    /// The page table's memory: allocated while `true`. The client reads it
    /// under its own locks only; loom checks every read is ordered with the
    /// provider's writes.
    table: UnsafeCell<bool>,
    /// The `data` pointer given with the free callback: one reference on the
    /// registration, consumed once, by the callback or by a reclaim after a
    /// successful unpin (`ArmedCallback::reclaim`, `Arc::from_raw`).
    raw: UnsafeCell<Option<Arc<Reg>>>,
}

// SAFETY: the cells are loom's, which check that every access is ordered
// (a data race panics the model).
unsafe impl Sync for Provider {}

impl Provider {
    /// Reads the page table, as the client does to check or map it.
    fn read_table(&self, what: &str) {
        // SAFETY: loom checks the access.
        let live = self.table.with(|t| unsafe { *t });
        assert!(live, "{what} on a freed page table");
    }

    fn set_table(&self, live: bool) {
        // SAFETY: loom checks the access.
        self.table.with_mut(|t| unsafe { *t = live });
    }

    fn take_raw(&self) -> Option<Arc<Reg>> {
        // SAFETY: loom checks the access.
        self.raw.with_mut(|r| unsafe { (*r).take() })
    }

    /// `nvidia_p2p_get_pages[_persistent]`.
    fn get_pages(&self, owner: u32, cb: Option<Arc<Reg>>) {
        let mut rm = self.rm.lock().unwrap();
        rm.linked = true;
        rm.owner = owner;
        self.set_table(true);
        if cb.is_some() {
            // SAFETY: loom checks the access.
            self.raw.with_mut(|r| unsafe { *r = cb });
        }
    }

    /// `nvidia_p2p_put_pages[_persistent]` called by `tgid`.
    fn put_pages(&self, tgid: u32) -> Result<(), ()> {
        let mut rm = self.rm.lock().unwrap();
        if self.persistent {
            // The table is found through itself (fact 9): a put on a freed
            // table is a use after free in the driver.
            self.read_table("put_pages_persistent");
            rm.linked = false;
            rm.ended += 1;
            self.set_table(false);
            return Ok(());
        }
        if rm.fail_next_put {
            // WARN_ON and an error: the pin and the callback stay (fact 8).
            rm.fail_next_put = false;
            return Err(());
        }
        // Unlinked by the callback: 0 (fact 8). Looked up by the caller's
        // process: from another one, not found, 0 (fact 7).
        if rm.linked && rm.owner == tgid {
            rm.linked = false;
            rm.ended += 1;
            self.set_table(false);
        }
        Ok(())
    }

    /// cudaFree or the owner's exit: under the RM lock, the free callback,
    /// then the table is freed. Returns the callback's reference, which the
    /// module's queue drops later (`reaper.rs`).
    fn free(&self) -> Option<Arc<Reg>> {
        let mut rm = self.rm.lock().unwrap();
        if !rm.linked || self.persistent {
            return None;
        }
        rm.linked = false;
        let data = self.take_raw();
        let owner = Kept::new(
            data.expect("free callback on a reference already reclaimed (use after free)"),
        );
        // free_trampoline: the callback consumes the provider's reference.
        owner.revoke(FREE_TASK);
        self.set_table(false);
        rm.ended += 1;
        Some(owner.into_inner())
    }
}

/// The core's umem: its mapping lock and client pointer.
struct Umem {
    mapped: bool,
    invalidated: bool,
}

struct Core {
    legacy: bool,
    mapping: Mutex<Umem>,
    /// `umem->ib_peer_client`, cleared once `release` returned (fact 14).
    client: UnsafeCell<bool>,
}

// SAFETY: as for `Provider`.
unsafe impl Sync for Core {}

impl Core {
    /// `ib_invalidate_peer_memory`: waits for the mapping lock, reads the
    /// client, stops the device, marks the umem invalidated; a legacy core
    /// also unmaps the client there (`reg` is the client's context).
    fn invalidate(&self, ctx: u64, reg: &Reg) {
        assert_eq!(ctx, CTX);
        let mut u = self.mapping.lock().unwrap();
        // SAFETY: loom checks the access.
        let live = self.client.with(|c| unsafe { *c });
        assert!(live, "the core's invalidate used a released client");
        if self.legacy && u.mapped {
            reg.dma_unmap();
            reg.put_pages();
        }
        u.mapped = false;
        u.invalidated = true;
    }

    fn clear_client(&self) {
        // SAFETY: loom checks the access.
        self.client.with_mut(|c| unsafe { *c = false });
    }
}

/// A page-table handle: a pointer, used only through the provider.
struct TableH;

/// The provider's reference while the callback is armed (`ArmedCallback`).
struct Armed;

/// A DMA mapping for the device, undone on drop.
struct DevMap {
    /// Made by the GPU driver (persistent pins), else BAR pages mapped by the
    /// client itself.
    provider: Option<Arc<Provider>>,
    counters: std::sync::Arc<Counters>,
}

impl DevMap {
    /// The client's own BAR mapping loses the device's access.
    fn revoke_access(&mut self) {
        assert!(self.provider.is_none(), "revoke reached a provider mapping");
    }
}

impl Drop for DevMap {
    fn drop(&mut self) {
        if let Some(p) = &self.provider {
            // nvidia_p2p_dma_unmap_pages: under the RM lock, on the table.
            let _rm = p.rm.lock().unwrap();
            p.read_table("dma_unmap_pages");
        }
        self.counters.maps_undone.fetch_add(1, Relaxed);
    }
}

struct Model;

impl Resources for Model {
    type Table = TableH;
    type Token = Armed;
    type Map = DevMap;
}

struct Inner {
    lc: Lifecycle<Model>,
    in_core: Option<usize>,
    /// A `dma_map` reads the table; the callback waits for it.
    mapper: bool,
}

/// `registration.rs`.
struct Reg {
    sc: Scenario,
    inner: Mutex<Inner>,
    core_left: Condvar,
    provider: Arc<Provider>,
    core: Arc<Core>,
    counters: std::sync::Arc<Counters>,
}

/// A section under the registration's lock: it ends with the lifecycle's
/// invariant checked (the objects held match the phase).
struct Locked<'a>(Option<MutexGuard<'a, Inner>>);

impl Locked<'_> {
    fn check(&self) {
        if let Some(g) = &self.0 {
            if !std::thread::panicking() {
                assert!(
                    g.lc.consistent(),
                    "phase {:?} holds objects it must not",
                    g.lc.phase()
                );
            }
        }
    }
}

impl Deref for Locked<'_> {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        self.0.as_ref().unwrap()
    }
}

impl DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Inner {
        self.0.as_mut().unwrap()
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        self.check();
    }
}

impl Reg {
    fn lock(&self) -> Locked<'_> {
        Locked(Some(self.inner.lock().unwrap()))
    }

    /// Waits on `core_left`, the lock released meanwhile.
    fn wait<'a>(&'a self, mut l: Locked<'a>) -> Locked<'a> {
        l.check();
        let g = l.0.take().unwrap();
        Locked(Some(self.core_left.wait(g).unwrap()))
    }
}

impl Drop for Reg {
    fn drop(&mut self) {
        let mut g = self.lock();
        assert!(
            g.lc.map().is_none() && g.lc.revoked_map_mut().is_none(),
            "registration freed with a DMA mapping"
        );
        drop(g);
        self.counters.regs_freed.fetch_add(1, Relaxed);
    }
}

impl Reg {
    fn pin(this: &Arc<Self>, owner: u32) -> bool {
        this.lock().lc.start_pin().unwrap();
        let persistent = this.sc.persistent;
        let cb = (!persistent).then(|| Arc::clone(this));
        this.provider.get_pages(owner, cb);
        let pin = Pin {
            table: TableH,
            token: (!persistent).then_some(Armed),
            owner,
        };
        let took = this.lock().lc.pin_succeeded(pin);
        // Err: the callback consumed its reference; the handles are dropped.
        took.is_ok()
    }

    fn get_pages(&self, ctx: u64) -> bool {
        let mut g = self.lock();
        if g.lc.pinned_table().is_err() {
            return false;
        }
        // Checked under the lock: the callback must take it to revoke.
        self.provider.read_table("get_pages check");
        g.lc.bind(ctx).is_ok()
    }

    fn dma_map(&self) -> bool {
        {
            let mut g = self.lock();
            if g.lc.start_map().is_err() {
                return false;
            }
            g.mapper = true;
        }
        let map = self.map_pages();
        let mut g = self.lock();
        g.mapper = false;
        self.core_left.notify_all();
        if let Err(map) = g.lc.map_succeeded(map) {
            drop(g);
            drop(map);
            return false;
        }
        true
    }

    fn map_pages(&self) -> DevMap {
        let p = &self.provider;
        let by_provider = self.sc.persistent;
        // nvidia_p2p_dma_map_pages takes the RM lock; `DeviceMap::bar` does not.
        let rm =
            (by_provider || self.sc.mutant == Mutant::RmLockInDmaMap).then(|| p.rm.lock().unwrap());
        p.read_table("dma_map");
        drop(rm);
        self.counters.maps_made.fetch_add(1, Relaxed);
        DevMap {
            provider: by_provider.then(|| Arc::clone(p)),
            counters: std::sync::Arc::clone(&self.counters),
        }
    }

    fn dma_unmap(&self) {
        let map = self.lock().lc.unmap();
        drop(map);
    }

    fn put_pages(&self) {
        let map = self.lock().lc.put_pages();
        drop(map);
    }

    /// Consumes the core's reference.
    fn release(this: Kept<Arc<Self>>, tgid: u32, task: usize) {
        let r = {
            let mut g = this.lock();
            if this.sc.mutant != Mutant::ReleaseWithoutWaiting {
                while g.in_core.is_some_and(|t| t != task) {
                    g = this.wait(g);
                }
            }
            // The mutant takes any release for the pinning process's.
            let as_tgid = match this.sc.mutant {
                Mutant::ReclaimAfterForeignUnpin => OWNER,
                _ => tgid,
            };
            g.lc.release(as_tgid)
        };
        drop(r.map);
        match r.unpin {
            // A persistent pin: the lifecycle ended with the release.
            Some(_) if r.ended => {
                let _ = this.provider.put_pages(tgid);
            }
            Some(table) => this.unpin(table, tgid),
            None => (),
        }
    }

    fn unpin(&self, _table: TableH, tgid: u32) {
        let res = self.provider.put_pages(tgid);
        let (how, token) = self.lock().lc.unpinned(res.is_ok());
        let token = match (how, self.sc.mutant) {
            (Unpinned::Stranded, Mutant::ReclaimAfterFailedUnpin) => Some(Armed),
            _ => token,
        };
        if let Some(Armed) = token {
            // ArmedCallback::reclaim: Arc::from_raw of the provider's pointer.
            let r = self.provider.take_raw();
            drop(r.expect("reclaimed a reference the free callback consumed"));
        }
    }

    /// `Revocable::revoke`, from the free callback.
    fn revoke(&self, task: usize) {
        let action = {
            let mut g = self.lock();
            // The table comes back only to be forgotten: the provider frees
            // it once the callback returns.
            let (action, _table) = g.lc.invalidate();
            if let Invalidate::NotifyCore(_) = action {
                g.in_core = Some(task);
            }
            while g.mapper {
                g = self.wait(g);
            }
            action
        };
        if let Invalidate::NotifyCore(ctx) = action {
            self.core.invalidate(ctx, self);
            // The device's access ends; the map stays for the core until
            // it unmaps or releases (`DeviceMap::take_device_access`).
            if let Some(m) = self.lock().lc.revoked_map_mut() {
                m.revoke_access();
            }
            self.lock().in_core = None;
            self.core_left.notify_all();
        }
    }
}

/// The core's thread (mlx5 + ib_core for one `ibv_reg_mr`/`ibv_dereg_mr`):
/// acquire (pin), get_pages + dma_map under the mapping lock, deregistration
/// (PEER_MEM_INVALIDATE_UNMAPS flow), release, then the client pointer goes.
fn core_thread(reg: Kept<Arc<Reg>>, core: &Core, sc: Scenario) {
    if !Reg::pin(&reg, OWNER) {
        drop(reg);
        core.clear_client();
        return;
    }
    let mapped = {
        let mut u = core.mapping.lock().unwrap();
        u.mapped = reg.get_pages(CTX) && reg.dma_map();
        u.mapped
    };
    if mapped {
        let mut u = core.mapping.lock().unwrap();
        if u.mapped && !u.invalidated {
            reg.dma_unmap();
            reg.put_pages();
            u.mapped = false;
        }
    }
    let tgid = if sc.foreign_release { OTHER } else { OWNER };
    Reg::release(reg, tgid, CORE_TASK);
    core.clear_client();
}

/// Interleavings explored by the current model (std atomics: outside loom's
/// view).
static EXPLORED: Counter = Counter::new(0);

fn model(sc: Scenario) -> usize {
    EXPLORED.store(0, Relaxed);
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(preemption_bound());
    b.check(move || {
        EXPLORED.fetch_add(1, Relaxed);
        let counters = std::sync::Arc::new(Counters::default());
        let provider = Kept::new(Arc::new(Provider {
            persistent: sc.persistent,
            rm: Mutex::new(Rm {
                linked: false,
                owner: 0,
                ended: 0,
                fail_next_put: sc.unpin_fails,
            }),
            table: UnsafeCell::new(false),
            raw: UnsafeCell::new(None),
        }));
        let core = Kept::new(Arc::new(Core {
            legacy: sc.legacy_core,
            mapping: Mutex::new(Umem {
                mapped: false,
                invalidated: false,
            }),
            client: UnsafeCell::new(true),
        }));
        let reg = Kept::new(Arc::new(Reg {
            sc,
            inner: Mutex::new(Inner {
                lc: Lifecycle::new(),
                in_core: None,
                mapper: false,
            }),
            core_left: Condvar::new(),
            provider: Arc::clone(&provider),
            core: Arc::clone(&core),
            counters: std::sync::Arc::clone(&counters),
        }));
        let p2 = Kept::new(Arc::clone(&provider));
        // cudaFree; the callback's reference goes to the module's queue,
        // whose worker drops it.
        let freer = loom::thread::spawn(move || {
            p2.free()
                .map(|r| loom::thread::spawn(move || drop(Kept::new(r))))
        });
        core_thread(reg, &core, sc);
        let reaper = freer.join().unwrap();
        // The memory is freed later if it was not yet (the owner's exit):
        // an armed callback fires now; the module's exit drains the queue.
        drop(provider.free());
        if let Some(w) = reaper {
            w.join().unwrap();
        }

        let rm = provider.rm.lock().unwrap();
        assert!(!rm.linked, "the pin outlived everything");
        assert_eq!(rm.ended, 1, "the pin ended {} times", rm.ended);
        drop(rm);
        assert!(
            provider.take_raw().is_none(),
            "the callback's reference was never consumed"
        );
        assert_eq!(
            counters.regs_freed.load(Relaxed),
            1,
            "registration freed {} times",
            counters.regs_freed.load(Relaxed)
        );
        assert_eq!(
            counters.maps_made.load(Relaxed),
            counters.maps_undone.load(Relaxed),
            "a DMA mapping was left or undone twice"
        );
    });
    EXPLORED.load(Relaxed)
}

const fn scenario(name: &'static str) -> Scenario {
    Scenario {
        name,
        persistent: false,
        foreign_release: false,
        unpin_fails: false,
        legacy_core: false,
        mutant: Mutant::None,
    }
}

const OWNER_RELEASE: Scenario = scenario("invalidating");
const FOREIGN_RELEASE: Scenario = Scenario {
    foreign_release: true,
    ..scenario("invalidating, foreign release")
};
const FAILED_UNPIN: Scenario = Scenario {
    unpin_fails: true,
    ..scenario("invalidating, failed unpin")
};
const LEGACY_CORE: Scenario = Scenario {
    legacy_core: true,
    ..scenario("invalidating, legacy core")
};
/// Persistent pins are not process-keyed (fact 9): the release unpins.
const PERSISTENT: Scenario = Scenario {
    persistent: true,
    foreign_release: true,
    ..scenario("persistent, foreign release")
};

/// Preemptions per interleaving, unless LOOM_MAX_PREEMPTIONS says otherwise
/// (the three-thread models take about a minute without a bound).
const PREEMPTIONS: usize = 5;

fn preemption_bound() -> usize {
    std::env::var("LOOM_MAX_PREEMPTIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(PREEMPTIONS)
}

/// Runs `sc` with `m`; the panic message if an interleaving failed.
fn catch(sc: Scenario, m: Mutant) -> Result<usize, String> {
    let sc = Scenario { mutant: m, ..sc };
    crate::mutants::caught(move || model(sc))
}

// One test function: the models share EXPLORED and the panic hook.
#[test]
fn free_callback_against_registration_and_teardown() {
    let start = std::time::Instant::now();
    for sc in [
        OWNER_RELEASE,
        FOREIGN_RELEASE,
        FAILED_UNPIN,
        LEGACY_CORE,
        PERSISTENT,
    ] {
        let t = std::time::Instant::now();
        let n = model(sc);
        println!(
            "loom: {}: explored {n} interleavings (preemption bound {}) in {:.1} s",
            sc.name,
            preemption_bound(),
            t.elapsed().as_secs_f64()
        );
        assert!(n > 10, "{}: the model explored too little: {n}", sc.name);
    }

    // Every mutant must fail some interleaving, for the reason expected
    // (their panics silenced: `mutants::quietly`).
    // A second consumption of the callback's reference races with the first
    // (loom: causality violation) or finds it gone.
    let twice: &[&str] = &["Causality violation", "reference"];
    let mutants = [
        (FAILED_UNPIN, Mutant::ReclaimAfterFailedUnpin, twice),
        (FOREIGN_RELEASE, Mutant::ReclaimAfterForeignUnpin, twice),
        (OWNER_RELEASE, Mutant::RmLockInDmaMap, &["deadlock"][..]),
        (
            OWNER_RELEASE,
            Mutant::ReleaseWithoutWaiting,
            &["Causality violation", "released client"][..],
        ),
    ];
    let mut caught = 0;
    let mut report = Vec::new();
    crate::mutants::quietly(|| {
        for (sc, m, why) in mutants {
            let r = catch(sc, m);
            let line = crate::mutants::outcome(&r, EXPLORED.load(Relaxed));
            report.push(format!("{m:?} ({}): {line}", sc.name));
            caught += usize::from(r.is_err_and(|e| why.iter().any(|w| e.contains(w))));
        }
    });
    for line in &report {
        println!("loom: mutant {line}");
    }
    println!(
        "loom: mutants caught: {caught}/{} (total {:.1} s)",
        mutants.len(),
        start.elapsed().as_secs_f64()
    );
    assert_eq!(caught, mutants.len(), "mutants not caught: {report:?}");
}
