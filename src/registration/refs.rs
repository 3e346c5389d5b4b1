// SPDX-License-Identifier: GPL-2.0 OR MIT

//! A registration's counted references, the slab cache its objects come
//! from, the queue where a free callback leaves its last reference, and the
//! module reference each object holds.
//!
//! A registration has at most three references: the core's (from `acquire`
//! to `release`), the GPU driver's while a free callback is armed, and the
//! one `acquire` holds while it pins. The objects come from a cache of the
//! module's (the C shim's), sized exactly (`Arc` would put each in
//! kmalloc-256).
//!
//! The callback's reference can be a registration's last one (after a release
//! in another process, or a failed unpin, only the callback is left). Its drop
//! then drops the registration's module reference; done by the callback
//! itself, a concurrent `rmmod` could unload the module while the callback
//! still runs module code. So the callback puts the object on the kernel's
//! lock-free list (`llist_add`, through the shim) and the shim's work item
//! drops the reference; the module's exit flushes that work after the clients
//! are unregistered: the work (which holds the module reference until it
//! drops it) has returned before the module's memory goes.
//!
//! Generic over the object ([`Counted`]): this file knows nothing of what a
//! registration holds.

use core::{
    ops::Deref,
    ptr::{
        self,
        NonNull, //
    },
};

use kernel::{
    bindings,
    ffi::c_void,
    prelude::*,
    sync::Refcount,
    types::Opaque, //
};

use crate::{
    compat,
    ffi, //
};

/// An object with a count of references (the kernel's `refcount_t`,
/// saturating; created at 1, its creator's: [`Spare::init`]) and a reap link
/// of its own.
///
/// # Safety
///
/// Every value of the type is an object of the module's cache, initialized
/// by [`Spare::init`].
pub(crate) unsafe trait Counted: Sized {
    /// The count of references on this object.
    fn refs(&self) -> &Refcount;
    /// Its link on the reap list (see [`defer`]), not on it until then.
    fn reap_link(&self) -> &Opaque<bindings::llist_node>;
}

/// Owns the module's cache of objects (the shim's); flushes the reap work
/// before it destroys the cache.
///
/// # Invariants
///
/// The shim's cache holds objects of one [`Counted`] type from `new` until
/// `drop`, which destroys it.
pub(crate) struct ObjectCache(());

impl ObjectCache {
    /// Creates the cache for objects of type `T`.
    pub(crate) fn new<T: Counted>() -> Result<Self> {
        kernel::error::to_result(ffi::peermem_reg_cache_create(
            core::mem::size_of::<T>(),
            core::mem::align_of::<T>(),
        ))?;
        // INVARIANT: created above.
        Ok(Self(()))
    }
}

impl Drop for ObjectCache {
    fn drop(&mut self) {
        // First every reference a free callback handed over is dropped, and
        // the reap work has returned: the module's exit runs this once the
        // clients are unregistered and the callbacks in flight have returned,
        // so no callback hands one over any more.
        ffi::peermem_reap_flush();
        // SAFETY: created in `new`, destroyed once. Every object is back:
        // each holds a module reference until it is freed, and the core's
        // calls and the reap work (the places that drop the last reference)
        // are done (above).
        unsafe { ffi::peermem_reg_cache_destroy() };
    }
}

/// A counted reference on an object of the module's cache.
///
/// # Invariants
///
/// Points to a live, initialized, pinned `T` from the module's cache, whose
/// count counts this reference; when the count drops to zero the
/// object is dropped in place and returned to the cache. The count never
/// exceeds 4 (see the module, and the drain's one), so it cannot saturate.
pub(crate) struct Ref<T: Counted>(NonNull<T>);

// SAFETY: `T` is `Send + Sync` and the count is atomic: a reference may be
// dropped on any thread, like an `Arc`.
unsafe impl<T: Counted + Send + Sync> Send for Ref<T> {}
// SAFETY: as above.
unsafe impl<T: Counted + Send + Sync> Sync for Ref<T> {}

/// An object of the module's cache, allocated but not initialized yet: a
/// registration can claim its memory before it pins, and pin before it
/// exists. Goes back to the cache if dropped.
///
/// # Invariants
///
/// Points to memory of the module's cache, of a `T`'s size and alignment,
/// owned by this value and not initialized.
pub(crate) struct Spare<T: Counted>(NonNull<T>);

impl<T: Counted> Spare<T> {
    /// Allocates an object from the module's cache.
    pub(crate) fn new() -> Result<Self> {
        // The cache exists while the core can call us (`ObjectCache`).
        let obj = NonNull::new(ffi::peermem_reg_alloc().cast::<T>()).ok_or(ENOMEM)?;
        // INVARIANT: fresh memory of the cache, of the exact layout.
        Ok(Self(obj))
    }

    /// Initializes the object with `init`, whose count must be 1: the
    /// returned reference is the only one.
    pub(crate) fn init(self, init: impl PinInit<T>) -> Ref<T> {
        let obj = self.0;
        core::mem::forget(self);
        // SAFETY: `obj` is memory of the cache's exact size and alignment for
        // a `T`, owned by us (type invariant), never moved: freed in place.
        let Ok(()) = unsafe { compat::init_pinned(obj.as_ptr(), init) };
        // INVARIANT: initialized, one reference.
        Ref(obj)
    }
}

impl<T: Counted> Drop for Spare<T> {
    fn drop(&mut self) {
        // SAFETY: memory of the module's cache, never initialized and owned
        // by us (type invariant); the cache lives while the core calls us.
        unsafe { ffi::peermem_reg_free(self.0.as_ptr().cast()) };
    }
}

impl<T: Counted> Ref<T> {
    /// Hands the reference to C as an opaque pointer.
    pub(crate) fn into_raw(self) -> *mut c_void {
        let p = self.0.as_ptr();
        core::mem::forget(self);
        p.cast()
    }

    /// Takes back a reference given by [`Ref::into_raw`].
    ///
    /// # Safety
    ///
    /// `p` must come from `into_raw` of a `Ref<T>`, and that reference must
    /// not have been taken back before.
    pub(crate) unsafe fn from_raw(p: *mut c_void) -> Self {
        // SAFETY: from `into_raw`, so non-null (caller).
        Self(unsafe { NonNull::new_unchecked(p.cast()) })
    }

    /// The object behind a reference given by [`Ref::into_raw`].
    ///
    /// # Safety
    ///
    /// `p` must come from `into_raw` of a `Ref<T>`, and that reference must
    /// not be taken back for `'a`.
    pub(crate) unsafe fn borrow<'a>(p: *mut c_void) -> &'a T {
        // SAFETY: the reference keeps the object alive for `'a` (caller).
        unsafe { &*p.cast::<T>() }
    }

    /// Takes over a reference that `obj`'s count already counts, held by
    /// someone who hands it over (the GPU driver's, after an unpin).
    ///
    /// # Safety
    ///
    /// The caller must own one of `obj`'s counted references, which it gives
    /// up.
    pub(crate) unsafe fn adopt(obj: &T) -> Self {
        // INVARIANT: an object of the cache (`Counted`), and the reference is
        // counted (caller).
        Self(NonNull::from(obj))
    }
}

impl<T: Counted> Deref for Ref<T> {
    type Target = T;

    fn deref(&self) -> &T {
        // SAFETY: live while this reference is (type invariant).
        unsafe { self.0.as_ref() }
    }
}

impl<T: Counted> Ref<T> {
    /// A new reference on `obj`, unless its last one is being dropped (the
    /// drain finds objects whose count may have reached zero: it takes a
    /// reference only on those that live on).
    pub(crate) fn get_unless_zero(obj: &T) -> Option<Self> {
        // INVARIANT: counted, on a live object of the cache (`Counted`).
        ffi::peermem_refcount_inc_not_zero(obj.refs()).then(|| Self(NonNull::from(obj)))
    }
}

impl<T: Counted> Clone for Ref<T> {
    fn clone(&self) -> Self {
        self.refs().inc();
        // INVARIANT: counted above.
        Self(self.0)
    }
}

impl<T: Counted> Drop for Ref<T> {
    fn drop(&mut self) {
        // refcount_dec_and_test orders this thread's uses of the object
        // before the free, and every other thread's before this one's free.
        if !self.refs().dec_and_test() {
            return;
        }
        let p = self.0.as_ptr();
        // SAFETY: the last reference: nobody else can reach the object. It
        // is dropped in place (it is pinned) and returned to the cache it
        // came from, which lives while any object does (see `ObjectCache`).
        unsafe {
            ptr::drop_in_place(p);
            ffi::peermem_reg_free(p.cast());
        }
    }
}

/// Drops `owner` (a free callback's reference) from the shim's work, not
/// here (see the module).
pub(crate) fn defer<T: Counted>(owner: Ref<T>) {
    let link = owner.reap_link().get();
    // The reference is the list's from here on: the shim's work takes it
    // back with [`Ref::from_raw`] and drops it.
    let _ = owner.into_raw();
    // SAFETY: the object is live (the reference forgotten above is now the
    // list's) and not on the list: a pin's callback runs once, and a
    // registration has one pin.
    unsafe { ffi::peermem_reap_defer(link) };
}

/// Holds a reference on this module for as long as it lives: `rmmod` is
/// refused while any registration (or a free callback's reference on one)
/// lives.
///
/// # Invariants
///
/// A reference on this module was taken by `try_module_get` and is dropped
/// exactly once, in `Drop`.
pub(crate) struct Liveness(());

impl Liveness {
    /// Takes a module reference; fails while the module is being removed
    /// (a registration then must not start: its callback could outlive the
    /// module's code).
    pub(crate) fn new() -> Result<Self> {
        // SAFETY: THIS_MODULE is a valid module (we are running its code);
        // `try_module_get` refuses once it is going.
        if !unsafe { bindings::try_module_get(compat::this_module()) } {
            return Err(ENODEV);
        }
        // INVARIANT: the reference was taken above.
        Ok(Liveness(()))
    }
}

impl Drop for Liveness {
    fn drop(&mut self) {
        // SAFETY: taken in `new` (type invariant). When this is the last
        // reference, the caller is the module's reap work or a core call,
        // both of which the module's exit waits for (see the module).
        unsafe { bindings::module_put(compat::this_module()) };
    }
}
