// SPDX-License-Identifier: GPL-2.0 OR MIT

//! How a registration's state is entered: under its spinlock, or under a
//! claim, chosen by its mode for its whole life.
//!
//! - An invalidating registration is called by the core and, concurrently,
//!   by the GPU driver's free callback, and its calls wait for each other (a
//!   `release` for a callback inside the core, a callback for a `dma_map`
//!   reading the page table). Its state is under a kernel spinlock, which
//!   the module's wait queue releases while it sleeps; lockdep sees it.
//! - A persistent registration has no free callback: only the core calls
//!   it, and the core makes one call of a registration at a time (it calls
//!   `get_pages` and `dma_map` in the thread that creates the umem, and
//!   `dma_unmap`, `put_pages` and `release` in the one that destroys it,
//!   after the last use: real-driver-behaviour.md, facts 12 to 14). Nothing
//!   ever waits there, so its state is under a [`Claim`] (`claim.rs`):
//!   one atomic exchange to enter, one store to leave, no call into the
//!   kernel. The claim is still a lock: a call that finds it taken (a core
//!   breaking that order) spins until it is free, and is counted in
//!   `claim_waits`, which the stress scenarios check stays 0. A claimed
//!   section is one the spinlock would cover, so it never sleeps; unlike
//!   under the spinlock, its holder can be preempted, which only makes such
//!   a contender spin longer.
//!
//! The choice is made by type: [`Locked`] or [`Claimed`]. A registration
//! is entered only through its mode's (see `registration::Called`), so the
//! two never meet on one state.

use core::{
    cell::UnsafeCell,
    marker::PhantomData,
    ops::{
        Deref,
        DerefMut, //
    },
};

use kernel::{
    prelude::*,
    sync::{
        lock::Guard,
        CondVar,
        LockClassKey, //
    },
};

use crate::{
    atomics::Relaxed,
    claim::{
        Claim,
        ClaimGuard, //
    },
    reg_lock::{
        RegLock,
        RegLockBackend, //
    },
    registration::Mode,
    stats::STATS,
};

/// Takes a claim another holder has, counted (see the module).
#[cold]
#[inline(never)]
fn contended(claim: &Claim) -> ClaimGuard<'_> {
    STATS.claim_waits.add(1, Relaxed);
    claim.hold_contended()
}

/// A way to enter a [`RegState`]: [`Locked`] or [`Claimed`].
pub(crate) trait Access {
    /// The registrations entered this way.
    const MODE: Mode;
    /// The way of the other mode.
    type Other: Access;
    /// What is held while inside.
    type Held<'a>;
    /// Enters by `lock` or by `claim`.
    fn hold<'a>(lock: &'a RegLock<()>, claim: &'a Claim) -> Self::Held<'a>;
    /// Gives up what `held` holds until woken on `q` (or spuriously), then
    /// takes it again. Callers wait in a loop on their condition.
    fn wait(held: &mut Self::Held<'_>, q: &CondVar);
}

/// Entered under the spinlock: invalidating registrations.
pub(crate) enum Locked {}

/// Entered under the claim: persistent registrations.
pub(crate) enum Claimed {}

impl Access for Locked {
    const MODE: Mode = Mode::Invalidating;
    type Other = Claimed;
    type Held<'a> = Guard<'a, (), RegLockBackend>;

    #[inline(always)]
    fn hold<'a>(lock: &'a RegLock<()>, _claim: &'a Claim) -> Self::Held<'a> {
        lock.lock()
    }

    fn wait(held: &mut Self::Held<'_>, q: &CondVar) {
        q.wait(held);
    }
}

impl Access for Claimed {
    const MODE: Mode = Mode::Persistent;
    type Other = Locked;
    type Held<'a> = ClaimGuard<'a>;

    #[inline(always)]
    fn hold<'a>(_lock: &'a RegLock<()>, claim: &'a Claim) -> Self::Held<'a> {
        match claim.try_hold() {
            Some(g) => g,
            None => contended(claim),
        }
    }

    /// Nothing wakes a claim's holder (persistent registrations never
    /// wait: no free callback), so this only lets go for a moment: the
    /// caller's loop rechecks its condition.
    fn wait(held: &mut Self::Held<'_>, _q: &CondVar) {
        held.yield_once();
    }
}

/// A registration's state with its spinlock and its claim.
///
/// # Invariants
///
/// `data` is accessed only through an [`Entered`], and all of a state's
/// `Entered` are made with one [`Access`] (the callers of `enter` promise
/// it), so that each excludes every other.
#[pin_data]
pub(crate) struct RegState<T> {
    #[pin]
    lock: RegLock<()>,
    claim: Claim,
    data: UnsafeCell<T>,
}

// SAFETY: `data` is reached only by one holder of the lock or the claim at a
// time (type invariant), which hands it between threads as a lock does.
unsafe impl<T: Send> Send for RegState<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for RegState<T> {}

impl<T> RegState<T> {
    /// A state holding `data`; `name` and `key` are the spinlock's, for
    /// lockdep.
    pub(crate) fn new(
        data: T,
        name: &'static CStr,
        key: Pin<&'static LockClassKey>,
    ) -> impl PinInit<Self> {
        pin_init!(Self {
            lock <- RegLock::new((), name, key),
            claim: Claim::new(),
            data: UnsafeCell::new(data),
        })
    }

    /// Enters the state the `A` way.
    ///
    /// # Safety
    ///
    /// Every `enter` of this state uses the same `A`.
    #[inline(always)]
    pub(crate) unsafe fn enter<A: Access>(&self) -> Entered<'_, T, A> {
        Entered {
            held: A::hold(&self.lock, &self.claim),
            data: &self.data,
            _access: PhantomData,
        }
    }

    /// The claim (for tests).
    #[allow(dead_code)]
    pub(crate) fn claim(&self) -> &Claim {
        &self.claim
    }
}

/// Inside a [`RegState`], entered the `A` way: the data is ours until drop.
pub(crate) struct Entered<'a, T, A: Access> {
    held: A::Held<'a>,
    data: &'a UnsafeCell<T>,
    _access: PhantomData<A>,
}

impl<T, A: Access> Deref for Entered<'_, T, A> {
    type Target = T;

    #[inline(always)]
    fn deref(&self) -> &T {
        // SAFETY: `held` excludes every other `Entered` of this state (the
        // `RegState` invariant) for as long as `self` lives.
        unsafe { &*self.data.get() }
    }
}

impl<T, A: Access> DerefMut for Entered<'_, T, A> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as for `deref`; `&mut self` makes this the only reference
        // made through `self`.
        unsafe { &mut *self.data.get() }
    }
}

impl<T, A: Access> Entered<'_, T, A> {
    /// Waits on the module's queue `q` (see [`Access::wait`]); no reference
    /// to the data is held across it, since this borrows `self` mutably.
    pub(crate) fn wait(&mut self, q: &CondVar) {
        A::wait(&mut self.held, q);
    }
}
