// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The registration's own counted reference, and the slab cache its objects
//! come from.
//!
//! A registration has at most three references: the core's (from `acquire`
//! to `release`), the GPU driver's while a free callback is armed, and the
//! one `acquire` holds while it pins. `Arc` would do, at a price paid on
//! every registration: its allocation goes through `krealloc` into
//! kmalloc-256, and each count operation is a call into a C helper. Here the
//! objects come from a cache of the module's, sized exactly, and the count is
//! an inline atomic.

use core::{
    ops::Deref,
    ptr::{
        self,
        NonNull, //
    },
    sync::atomic::fence,
};

use kernel::{
    bindings,
    ffi::c_void,
    prelude::*, //
};

use crate::{
    atomics::{
        Acquire,
        Atomic,
        Relaxed,
        Release, //
    },
    ffi,
    registration::Registration,
};

/// The cache, published while the module is loaded.
static CACHE: Atomic<*mut bindings::kmem_cache> = Atomic::new(ptr::null_mut());

/// Owns the module's cache of registration objects.
///
/// # Invariants
///
/// `CACHE` holds a cache of [`Registration`] objects from `new` until `drop`,
/// which destroys it.
pub(crate) struct RegCache(());

impl RegCache {
    /// Creates and publishes the cache.
    pub(crate) fn new() -> Result<Self> {
        // SAFETY: no preconditions; the size and alignment are a valid
        // layout's.
        let c = unsafe {
            ffi::peermem_reg_cache_create(
                core::mem::size_of::<Registration>(),
                core::mem::align_of::<Registration>(),
            )
        };
        if c.is_null() {
            return Err(ENOMEM);
        }
        CACHE.store(c, Release);
        // INVARIANT: published above.
        Ok(Self(()))
    }
}

impl Drop for RegCache {
    fn drop(&mut self) {
        let c = CACHE.xchg(ptr::null_mut(), Acquire);
        if !c.is_null() {
            // SAFETY: created in `new`, destroyed once. Every object is back:
            // each registration holds a module reference until it is freed,
            // and the module's exit runs this after the core's calls and the
            // reap queue (the places that drop the last reference) are done.
            unsafe { bindings::kmem_cache_destroy(c) };
        }
    }
}

/// The count of a registration's references, a field of the registration.
pub(crate) struct RefCount(Atomic<u32>);

impl RefCount {
    /// One reference: its creator's ([`Spare::init`]).
    pub(crate) const fn new() -> Self {
        Self(Atomic::new(1))
    }
}

/// A counted reference on a registration in the module's cache.
///
/// # Invariants
///
/// Points to a live, initialized, pinned [`Registration`] from the module's
/// cache, whose [`RefCount`] counts this reference; when the count drops to
/// zero the registration is dropped in place and the object returns to the
/// cache. The count never exceeds 3 (the core's reference, the GPU driver's
/// while a free callback is armed, and `acquire`'s while it pins), so it
/// cannot overflow.
pub(crate) struct RegRef(NonNull<Registration>);

// SAFETY: `Registration` is `Send + Sync` and the count is atomic: a
// reference may be dropped on any thread, like an `Arc`.
unsafe impl Send for RegRef {}
// SAFETY: as above.
unsafe impl Sync for RegRef {}

/// An object of the module's cache, allocated but not initialized yet: a
/// registration can claim its memory before it pins, and pin before it
/// exists. Goes back to the cache if dropped.
///
/// # Invariants
///
/// Points to memory of the module's cache, of a [`Registration`]'s size and
/// alignment, owned by this value and not initialized.
pub(crate) struct Spare(NonNull<Registration>);

impl Spare {
    /// Allocates an object from the module's cache.
    pub(crate) fn new() -> Result<Self> {
        let cache = CACHE.load(Acquire);
        if cache.is_null() {
            return Err(ENODEV);
        }
        // SAFETY: a live cache (published until the module's exit, which
        // cannot run while the core calls us).
        let obj = unsafe { bindings::kmem_cache_alloc_noprof(cache, bindings::GFP_KERNEL) };
        let obj = NonNull::new(obj.cast::<Registration>()).ok_or(ENOMEM)?;
        // INVARIANT: fresh memory of the cache, of the exact layout.
        Ok(Self(obj))
    }

    /// Initializes the object with `init`, whose count must be
    /// [`RefCount::new`]: the returned reference is the only one.
    // Inlined: the initializer is then written in place, with what its
    // caller knows (a registration is made on every `acquire`).
    #[inline(always)]
    pub(crate) fn init(self, init: impl PinInit<Registration>) -> RegRef {
        let obj = self.0;
        core::mem::forget(self);
        // SAFETY: `obj` is memory of the cache's exact size and alignment
        // for a `Registration`, owned by us (type invariant), never moved:
        // it is freed in place.
        let Ok(()) = unsafe { crate::compat::init_pinned(obj.as_ptr(), init) };
        // INVARIANT: initialized, one reference.
        RegRef(obj)
    }
}

impl Drop for Spare {
    fn drop(&mut self) {
        // SAFETY: memory of the module's cache, never initialized and owned
        // by us (type invariant); the cache lives while the core calls us.
        unsafe { bindings::kmem_cache_free(CACHE.load(Relaxed), self.0.as_ptr().cast()) };
    }
}

impl RegRef {
    /// Hands the reference to C as an opaque pointer.
    pub(crate) fn into_raw(self) -> *mut c_void {
        let p = self.0.as_ptr();
        core::mem::forget(self);
        p.cast()
    }

    /// Takes back a reference given by [`RegRef::into_raw`].
    ///
    /// # Safety
    ///
    /// `p` must come from `into_raw`, and that reference must not have been
    /// taken back before.
    pub(crate) unsafe fn from_raw(p: *mut c_void) -> Self {
        // SAFETY: from `into_raw`, so non-null (caller).
        Self(unsafe { NonNull::new_unchecked(p.cast()) })
    }

    /// The registration behind a reference given by [`RegRef::into_raw`].
    ///
    /// # Safety
    ///
    /// `p` must come from `into_raw`, and that reference must not be taken
    /// back for `'a`.
    pub(crate) unsafe fn borrow<'a>(p: *mut c_void) -> &'a Registration {
        // SAFETY: the reference keeps the object alive for `'a` (caller).
        unsafe { &*p.cast::<Registration>() }
    }

    /// Takes over a reference that `reg`'s count already counts, held by
    /// someone who hands it over (the GPU driver's, after an unpin).
    ///
    /// # Safety
    ///
    /// `reg` must be a registration of the module's cache (every one is),
    /// and the caller must own one of its counted references, which it gives
    /// up.
    pub(crate) unsafe fn adopt(reg: &Registration) -> Self {
        // INVARIANT: a live registration of the cache, and the reference is
        // counted (caller).
        Self(NonNull::from(reg))
    }

    fn count(&self) -> &Atomic<u32> {
        // SAFETY: live (type invariant).
        &unsafe { self.0.as_ref() }.refs().0
    }
}

impl Deref for RegRef {
    type Target = Registration;

    fn deref(&self) -> &Registration {
        // SAFETY: live while this reference is (type invariant).
        unsafe { self.0.as_ref() }
    }
}

impl Clone for RegRef {
    fn clone(&self) -> Self {
        self.count().add(1, Relaxed);
        // INVARIANT: counted above.
        Self(self.0)
    }
}

impl Drop for RegRef {
    fn drop(&mut self) {
        // Release: this thread's uses of the object happen before the free.
        if self.count().fetch_sub(1, Release) != 1 {
            return;
        }
        // Acquire: every other thread's uses happen before the free.
        fence(core::sync::atomic::Ordering::Acquire);
        let p = self.0.as_ptr();
        // SAFETY: the last reference: nobody else can reach the object. It
        // is dropped in place (it is pinned) and returned to the cache it
        // came from, which lives while any registration does (see
        // `RegCache`).
        unsafe {
            ptr::drop_in_place(p);
            bindings::kmem_cache_free(CACHE.load(Relaxed), p.cast());
        }
    }
}
