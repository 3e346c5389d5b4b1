// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Scenarios of the faithful testbed: what the real NVIDIA driver and the
//! real OFED core do that a kind emulator would not
//! (docs/driver-facts.md): the RM lock held across
//! free callbacks and taken by every p2p call, unpins found by the caller's
//! process, failing unpins, callbacks from a kernel thread after the owner
//! exited, page-table addresses reused at once, the core's mapping lock held
//! until the "mkey" exists, release clearing the core's client pointer, and
//! RLIMIT_MEMLOCK charged before any client is asked.

use std::{
    sync::mpsc,
    time::{Duration, Instant},
};

use crate::{
    dev::{Alloc, Core, Gpu},
    module,
    scenarios::{errno_name, expect_err, pattern, stat},
    uapi::*,
    Ctx, Mode,
};

const M: u64 = 1 << 20;
const EMU: &str = "/sys/kernel/debug/nv_p2p_emu";
const CORE_DBG: &str = "/sys/kernel/debug/peer_mem_core";
const CORE_PARAM: &str = "/sys/module/peer_mem_core/parameters";

macro_rules! ensure {
    ($c:expr, $($fmt:tt)*) => {
        if !$c {
            return Err(format!($($fmt)*));
        }
    };
}

/// A harness knob, put back to `restore` when dropped.
struct Knob {
    path: String,
    restore: String,
}

impl Knob {
    fn set(path: String, value: &str, restore: &str) -> Result<Self, String> {
        module::debugfs_write(&path, value)?;
        Ok(Self {
            path,
            restore: restore.into(),
        })
    }
    fn emu(name: &str, value: &str) -> Result<Self, String> {
        Self::set(format!("{EMU}/{name}"), value, "0")
    }
    fn core(name: &str, value: &str) -> Result<Self, String> {
        Self::set(format!("{CORE_PARAM}/{name}"), value, "0")
    }
}

impl Drop for Knob {
    fn drop(&mut self) {
        let _ = module::debugfs_write(&self.path, &self.restore);
    }
}

/// A child process, forked here; it runs `f` and exits with its status.
struct Child {
    pid: i32,
    to_child: i32,
    from_child: i32,
}

impl Child {
    /// Forks; the child runs `f(&child_side)` and `_exit`s with its return.
    fn fork(f: impl FnOnce(&ChildSide) -> i32) -> Result<Self, String> {
        let (mut a, mut b) = ([0i32; 2], [0i32; 2]);
        // SAFETY: pipes into local arrays.
        ensure!(
            unsafe { libc::pipe(a.as_mut_ptr()) == 0 && libc::pipe(b.as_mut_ptr()) == 0 },
            "pipe"
        );
        // SAFETY: the scenario runs no other thread now; the child uses its
        // own handles and syscalls, then `_exit`s without unwinding.
        let pid = unsafe { libc::fork() };
        ensure!(pid >= 0, "fork failed");
        if pid == 0 {
            let side = ChildSide { rx: a[0], tx: b[1] };
            let rc = f(&side);
            // SAFETY: leaving the child without running the parent's drops.
            unsafe { libc::_exit(rc) };
        }
        // SAFETY: closing the child's ends in the parent.
        unsafe {
            libc::close(a[0]);
            libc::close(b[1]);
        }
        Ok(Self {
            pid,
            to_child: a[1],
            from_child: b[0],
        })
    }

    /// Reads a u64 the child sent.
    fn recv(&self) -> Result<u64, String> {
        let mut v = [0u8; 8];
        // SAFETY: reading into a local buffer from our pipe.
        let n = unsafe { libc::read(self.from_child, v.as_mut_ptr().cast(), 8) };
        ensure!(n == 8, "the child sent nothing (it failed)");
        Ok(u64::from_ne_bytes(v))
    }

    /// Tells the child to go on.
    fn go(&self) {
        // SAFETY: one byte to our pipe.
        unsafe { libc::write(self.to_child, [1u8].as_ptr().cast(), 1) };
    }

    /// Waits for the child's exit; its exit status.
    fn wait(self) -> i32 {
        let mut st = 0;
        // SAFETY: our child; then our pipe ends.
        unsafe {
            libc::waitpid(self.pid, &mut st, 0);
            libc::close(self.to_child);
            libc::close(self.from_child);
        }
        if libc::WIFEXITED(st) {
            libc::WEXITSTATUS(st)
        } else {
            -1
        }
    }
}

/// The child's ends of the pipes.
struct ChildSide {
    rx: i32,
    tx: i32,
}

impl ChildSide {
    fn send(&self, v: u64) {
        // SAFETY: eight bytes to our pipe.
        unsafe { libc::write(self.tx, v.to_ne_bytes().as_ptr().cast(), 8) };
    }
    fn wait_go(&self) {
        let mut b = [0u8];
        // SAFETY: one byte from our pipe.
        unsafe { libc::read(self.rx, b.as_mut_ptr().cast(), 1) };
    }
}

/// Polls `f` for up to `secs` seconds.
fn wait_for(secs: u64, what: &str, mut f: impl FnMut() -> bool) -> Result<(), String> {
    let t = Instant::now();
    while !f() {
        ensure!(
            t.elapsed() < Duration::from_secs(secs),
            "{what}: not within {secs} s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// Runs `f` on a thread and waits at most `secs` for it: a registration that
/// does not come back is a deadlock (the GPU driver's lock against the core's
/// mapping lock), reported instead of hanging the run.
fn within<T: Send + 'static>(
    secs: u64,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs))
        .map_err(|_| format!("DEADLOCK: {what} did not return within {secs} s"))
}

fn ours(ctx: &Ctx) -> bool {
    !ctx.opts.reference
}

/// Pins made, unpins and callbacks between two provider snapshots.
fn pins_ended(a: &NvemuInfo, b: &NvemuInfo) -> (u64, u64, u64) {
    (
        (b.pins + b.persistent_pins) - (a.pins + a.persistent_pins),
        b.unpins - a.unpins,
        b.callbacks - a.callbacks,
    )
}

/// The GPU driver and the DMA mapping it would make for a persistent pin
/// give contiguous bus addresses only without a translating IOMMU, or when
/// it maps whole runs.
pub fn provider_contiguous() -> bool {
    let style = std::fs::read_to_string(format!("{EMU}/dma_map_style")).unwrap_or_default();
    style.trim() == "2" || !iommu_translates()
}

/// Whether the HCA's DMA goes through a translating IOMMU.
pub fn iommu_translates() -> bool {
    let dev = match hca_device() {
        Some(d) => d,
        None => return false,
    };
    let t = std::fs::read_to_string(format!("/sys/bus/pci/devices/{dev}/iommu_group/type"))
        .unwrap_or_default();
    matches!(t.trim(), "DMA" | "DMA-FQ")
}

/// The PCI name of the emulated HCA (edu).
pub fn hca_device() -> Option<String> {
    std::fs::read_dir("/sys/bus/pci/drivers/peer_mem_core_hca")
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.contains(':'))
}

/// Release in another process (fact 7): the RDMA fd's last reference is in a
/// forked child, which exits; the GPU memory is freed after, or before.
pub fn foreign_release(ctx: &mut Ctx) -> Result<String, String> {
    let mut out = Vec::new();
    for free_first in [false, true] {
        let mark = LogMark::new();
        let gi0 = ctx.gpu().info();
        let (fr0, cb0) = (stat("foreign_releases"), gi0.callbacks);
        let mut a = ctx.gpu().alloc(0, 2 * M).map_err(errno_name)?;
        let core = Core::open()?;
        let h = core
            .reg(a.va + 4096, M, PMC_REG_INVAL_SUPP)
            .map_err(errno_name)?;
        let seed = ctx.rand();
        core.dma_write(h, 0, &pattern(seed, 0, 64))
            .map_err(errno_name)?;
        ensure!(
            a.read(4096, 64) == pattern(seed, 0, 64),
            "DMA before the fork"
        );
        let child = Child::fork(|c| {
            c.send(1);
            c.wait_go();
            0
        })?;
        child.recv()?;
        // The parent's descriptor goes: the child's copy is the last one.
        drop(core);
        if free_first {
            a.unmap();
        }
        child.go();
        let child_pid = child.pid;
        ensure!(child.wait() == 0, "child failed");
        let gi1 = ctx.gpu().info();
        if !free_first && ours(ctx) {
            // One line names the pinning process, the size and the releaser.
            let held = held_pin_lines(&mark, "released in another process");
            let me = std::process::id();
            ensure!(
                held.len() == 1
                    && held.last().is_some_and(|l| {
                        l.contains(&format!("pinned by process {me} ("))
                            && l.contains(&format!("({} bytes)", M + (64 << 10)))
                            && l.contains(&format!("released by process {child_pid} ("))
                    }),
                "the orphaned pin was not explained: {:?}",
                held.last()
            );
            ensure!(
                stat("foreign_releases") == fr0 + 1,
                "the release in the child was not recognised as foreign"
            );
            ensure!(stat("orphaned_pins") == 1, "orphaned pin not counted");
            ensure!(
                gi1.live_tables == gi0.live_tables + 1,
                "the pin must stay with the GPU driver until the memory is freed"
            );
            ensure!(
                gi1.foreign_puts == gi0.foreign_puts,
                "the module called nvidia_p2p_put_pages from another process"
            );
        }
        if !free_first {
            a.unmap();
        }
        let gi2 = ctx.gpu().info();
        ensure!(
            gi2.callbacks == cb0 + 1,
            "{} free callbacks, expected 1",
            gi2.callbacks - cb0
        );
        if ours(ctx) {
            ensure!(stat("orphaned_pins") == 0, "orphaned pin not reaped");
        }
        out.push(format!(
            "free {}: {} foreign unpins",
            if free_first { "first" } else { "after" },
            gi2.foreign_puts - gi0.foreign_puts
        ));
    }
    Ok(out.join(", "))
}

/// The kernel log's lines about pins kept after the core let go of them
/// (orphaned, stranded), of the given cause.
fn held_pin_lines(mark: &LogMark, why: &str) -> Vec<String> {
    mark.since()
        .into_iter()
        .filter(|l| l.contains(why) && l.contains("stays pinned until that process frees it"))
        .collect()
}

/// Deregisters `h` while the GPU driver's `func` fails once with EIO (the
/// deregistration itself must still succeed).
fn dereg_with_failing(ctx: &mut Ctx, h: u64, func: &str) -> Result<(), String> {
    module::inject(func, 1, libc::EIO)?;
    let r = ctx.core.dereg(h);
    module::inject(func, 0, libc::EIO)?;
    r.map_err(errno_name)
}

/// A failed unpin (fact 8) leaves the pin and its callback armed; the later
/// free must find the registration alive, and the pin must be reported.
pub fn unpin_failure_then_free(ctx: &mut Ctx) -> Result<String, String> {
    let mark = LogMark::new();
    let gi0 = ctx.gpu().info();
    let f0 = stat("fail_unpin");
    let mut a = ctx.gpu().alloc(0, M).map_err(errno_name)?;
    let h = ctx
        .core
        .reg(a.va, M, PMC_REG_INVAL_SUPP)
        .map_err(errno_name)?;
    dereg_with_failing(ctx, h, "put_pages")?;
    let gi1 = ctx.gpu().info();
    ensure!(
        gi1.failed_unpins == gi0.failed_unpins + 1,
        "no unpin failed"
    );
    if ours(ctx) {
        ensure!(stat("stranded_pins") == 1, "stranded pin not counted");
        let held = held_pin_lines(&mark, "nvidia_p2p_put_pages failed");
        let me = std::process::id();
        ensure!(
            held.len() == 1
                && held.last().is_some_and(|l| {
                    l.contains(&format!("pinned by process {me} ("))
                        && l.contains(&format!("({M} bytes)"))
                }),
            "the stranded pin was not explained: {:?}",
            held.last()
        );
        ensure!(stat("fail_unpin") == f0 + 1, "unpin failure not reported");
        ensure!(
            !module::rmmod("nvidia_peermem")?,
            "rmmod accepted while a free callback is armed with our code"
        );
    }
    ensure!(
        gi1.live_tables == gi0.live_tables + 1,
        "the failed unpin freed the table"
    );
    a.unmap();
    let gi2 = ctx.gpu().info();
    ensure!(
        gi2.callbacks == gi0.callbacks + 1,
        "the free did not call back"
    );
    if ours(ctx) {
        ensure!(stat("stranded_pins") == 0, "stranded pin not reaped");
    }
    Ok("unpin failed with EIO; the free callback ended the pin".into())
}

/// A failing nvidia_p2p_dma_unmap_pages of a persistent pin: counted, and
/// the unpin that follows still frees the table and its mappings.
pub fn dma_unmap_failure(ctx: &mut Ctx) -> Result<String, String> {
    let a = ctx.gpu().alloc(0, M).map_err(errno_name)?;
    // A CQ/QP umem: persistent in every mode.
    let h = ctx.core.reg(a.va, M, 0).map_err(errno_name)?;
    let f0 = stat("fail_unpin");
    dereg_with_failing(ctx, h, "dma_unmap_pages")?;
    if ours(ctx) {
        ensure!(
            stat("fail_unpin") == f0 + 1,
            "dma_unmap failure not reported"
        );
    }
    drop(a);
    Ok("dma_unmap failed with EIO; unpin freed the rest".into())
}

/// A failing nvidia_p2p_put_pages_persistent: the GPU driver keeps the pin,
/// which the client has lost (counted and logged), and every count the
/// registration held is returned all the same. The harness then ends the lost
/// pin, as unloading nvidia.ko would.
pub fn persistent_unpin_failure(ctx: &mut Ctx) -> Result<String, String> {
    let gi0 = ctx.gpu().info();
    let (f0, l0, p0) = (
        stat("fail_unpin"),
        stat("leaked_pins"),
        stat("pinned_bytes"),
    );
    let mut a = ctx.gpu().alloc(0, M).map_err(errno_name)?;
    // A CQ/QP umem: persistent in every mode.
    let h = ctx.core.reg(a.va, M, 0).map_err(errno_name)?;
    dereg_with_failing(ctx, h, "put_pages_persistent")?;
    let gi1 = ctx.gpu().info();
    ensure!(
        gi1.failed_unpins == gi0.failed_unpins + 1,
        "no unpin failed"
    );
    ensure!(
        gi1.live_tables == gi0.live_tables + 1,
        "the failed unpin freed the table"
    );
    if ours(ctx) {
        ensure!(stat("fail_unpin") == f0 + 1, "unpin failure not reported");
        ensure!(stat("leaked_pins") == l0 + 1, "the lost pin not counted");
        ensure!(
            stat("pinned_bytes") == p0,
            "pinned bytes still counted: {} (before: {p0})",
            stat("pinned_bytes")
        );
    }
    a.unmap();
    module::debugfs_write("/sys/kernel/debug/nv_p2p_emu/reclaim_lost_pins", "1")?;
    ensure!(
        ctx.gpu().info().live_tables == gi0.live_tables,
        "the lost pin was not ended"
    );
    Ok("put_pages_persistent failed with EIO; the pin was counted as lost".into())
}

/// cudaFree racing ibv_reg_mr while the core holds the mapping lock: between
/// get_pages and dma_map, and in the activation window after dma_map (mlx5
/// creating its mkey), optionally failing the activation. The free callback
/// holds the GPU driver's lock and waits for the mapping lock; a client that
/// takes the GPU driver's lock in dma_map deadlocks (facts 1-3, 12-13).
pub fn free_races_registration(ctx: &mut Ctx) -> Result<String, String> {
    let mut out = Vec::new();
    // (core knob held open 300 ms, what, fail the activation, the GPU
    // driver's free holds its lock this long before calling back). The last
    // step makes dma_map start while the free holds the GPU driver's lock
    // and calls back 200 ms later, into an invalidate that waits for the
    // mapping lock: a client whose dma_map takes the GPU driver's lock
    // deadlocks there (NVIDIA's C module does).
    let steps: [(&str, &str, bool, &str); 4] = [
        ("map_delay_ms", "get_pages..dma_map", false, "0"),
        ("activate_delay_ms", "dma_map..activation", false, "0"),
        ("activate_delay_ms", "failed activation", true, "0"),
        (
            "map_delay_ms",
            "dma_map under a free holding the RM lock",
            false,
            "400",
        ),
    ];
    for (knob, what, fail, hold) in steps {
        let _k = Knob::core(knob, "300")?;
        let _h = Knob::emu("free_delay_ms", hold)?;
        let _f = if fail {
            Some(Knob::set(
                format!("{CORE_DBG}/fail_after_map"),
                "1 -12",
                "0 -12",
            )?)
        } else {
            None
        };
        let cb0 = ctx.gpu().info().callbacks;
        let gpu = Gpu::open()?;
        let mut a = gpu.alloc(0, M).map_err(errno_name)?;
        let va = a.va;
        let core = std::sync::Arc::new(Core::open()?);
        let c2 = std::sync::Arc::clone(&core);
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(c2.reg(va, M, PMC_REG_INVAL_SUPP));
        });
        // The free lands inside the window the knob holds open.
        std::thread::sleep(Duration::from_millis(100));
        let freed = within(20, &format!("cudaFree during {what}"), move || {
            a.unmap();
            a
        })?;
        drop(freed);
        let r = rx
            .recv_timeout(Duration::from_secs(20))
            .map_err(|_| format!("DEADLOCK: ibv_reg_mr racing cudaFree during {what}"))?;
        let result = match r {
            Ok(h) => {
                let q = core.query(h).map_err(errno_name)?;
                ensure!(
                    q.revoked == 1,
                    "{what}: registered MR not revoked by the free"
                );
                expect_err(core.dma_read(h, 0, 16), libc::EACCES, "DMA after free")?;
                core.dereg(h).map_err(errno_name)?;
                "registered, then revoked".to_string()
            }
            Err(e) => {
                ensure!(e != 524, "{what}: ENOTSUPP (524) leaked to user space");
                ensure!(
                    !ours(ctx) || e == libc::EFAULT || (fail && e == libc::ENOMEM),
                    "{what}: registration failed with {}",
                    errno_name(e)
                );
                format!("refused {}", errno_name(e))
            }
        };
        ensure!(
            ctx.gpu().info().callbacks == cb0 + 1,
            "{what}: no free callback"
        );
        out.push(format!("{what}: {result}"));
    }
    Ok(out.join("; "))
}

/// How a child process ends with a live MR: which of its descriptors goes
/// first, and whether the GPU driver tears down from its kernel thread.
#[derive(Clone, Copy)]
enum ExitOrder {
    /// Plain exit: the GPU mapping goes first (callback in the exiting child),
    /// then the RDMA descriptor (release finds the MR revoked).
    GpuFirst,
    /// The GPU driver defers its teardown to its kernel thread: the RDMA
    /// descriptor goes first (release unpins in the owner), the callback
    /// never comes.
    RdmaFirst,
    /// The MR lives in the parent's RDMA descriptor: the callback comes from
    /// the GPU driver's kernel thread after the owner is gone.
    KernelThread,
    /// As `KernelThread`, but the parent deregisters first: a release in
    /// another process than the (dead) owner; the kernel thread's callback
    /// ends the pin.
    ParentDeregFirst,
}

fn exit_order(ctx: &mut Ctx, order: ExitOrder) -> Result<String, String> {
    let deferred = !matches!(order, ExitOrder::GpuFirst);
    let _k = if deferred {
        Some(Knob::emu("deferred_teardown_ms", "300")?)
    } else {
        None
    };
    let gi0 = ctx.gpu().info();
    let parent_core = Core::open()?;
    let shared = matches!(order, ExitOrder::KernelThread | ExitOrder::ParentDeregFirst);
    let pc = &parent_core;
    let child = Child::fork(move |c| {
        let run = || -> Option<u64> {
            let g = Gpu::open().ok()?;
            let a = g.alloc(0, M).ok()?;
            let own = if shared {
                None
            } else {
                Some(Core::open().ok()?)
            };
            let core = own.as_ref().unwrap_or(pc);
            let h = core.reg(a.va, M, PMC_REG_INVAL_SUPP).ok()?;
            core.dma_write(h, 0, &[0x5a; 16]).ok()?;
            // Everything stays open and mapped until the process exits.
            std::mem::forget((a, g, own));
            Some(h)
        };
        match run() {
            Some(h) => {
                c.send(h);
                c.wait_go();
                0
            }
            None => 1,
        }
    })?;
    let h = child.recv()?;
    let live0 = stat("live_registrations");
    if matches!(order, ExitOrder::ParentDeregFirst) {
        parent_core.dereg(h).map_err(errno_name)?;
    }
    child.go();
    ensure!(child.wait() == 0, "child failed");
    let gi1 = ctx.gpu().info();
    let detail = match order {
        ExitOrder::GpuFirst => {
            ensure!(gi1.callbacks == gi0.callbacks + 1, "no callback at exit");
            "callback in the exiting child, then release".to_string()
        }
        ExitOrder::RdmaFirst => {
            wait_for(5, "deferred GPU teardown", || {
                ctx.gpu().info().live_allocs == gi0.live_allocs
            })?;
            let gi = ctx.gpu().info();
            let (p, u, c) = pins_ended(&gi0, &gi);
            // Ours pins once per registration: exactly one pin, ended by one
            // unpin. NVIDIA's module pins and unpins once more in acquire.
            let exact = if ours(ctx) {
                p == 1 && u == 1 && c == 0
            } else {
                c == 0 && p == u && u >= 1
            };
            ensure!(
                exact,
                "release in the owner must unpin every pin: {p} pins, {u} unpins, {c} callbacks"
            );
            "release unpinned in the exiting owner, teardown found nothing".to_string()
        }
        ExitOrder::KernelThread | ExitOrder::ParentDeregFirst => {
            wait_for(5, "callback from the GPU driver's kernel thread", || {
                ctx.gpu().info().deferred_callbacks > gi0.deferred_callbacks
            })?;
            if matches!(order, ExitOrder::KernelThread) {
                let q = parent_core.query(h).map_err(errno_name)?;
                ensure!(q.revoked == 1, "MR not revoked by the kernel thread");
                expect_err(
                    parent_core.dma_read(h, 0, 16),
                    libc::EACCES,
                    "DMA after teardown",
                )?;
                parent_core.dereg(h).map_err(errno_name)?;
                "callback from the kernel thread revoked the parent's MR".to_string()
            } else {
                if ours(ctx) {
                    ensure!(stat("orphaned_pins") == 0, "orphan not reaped");
                }
                "parent's release left the pin; the kernel thread's callback ended it".to_string()
            }
        }
    };
    if ours(ctx) {
        ensure!(live0 >= 1, "the child's MR was not live ({live0})");
    }
    drop(parent_core);
    Ok(detail)
}

pub fn exit_gpu_first(ctx: &mut Ctx) -> Result<String, String> {
    exit_order(ctx, ExitOrder::GpuFirst)
}
pub fn exit_rdma_first(ctx: &mut Ctx) -> Result<String, String> {
    exit_order(ctx, ExitOrder::RdmaFirst)
}
pub fn callback_from_kernel_thread(ctx: &mut Ctx) -> Result<String, String> {
    exit_order(ctx, ExitOrder::KernelThread)
}
pub fn foreign_dereg_then_kernel_thread(ctx: &mut Ctx) -> Result<String, String> {
    exit_order(ctx, ExitOrder::ParentDeregFirst)
}

/// The free callback's reference is the registration's last (the unpin
/// failed), and rmmod races the free: the module must not go while its code
/// runs, and must go once it can. The harness holds RM's lock a while after
/// each callback returns (`callback_hold_ms`): an exit that does not wait for
/// the callback's locked section unloads inside it, which the unloader sees
/// as `callbacks_running` above 0 the moment `delete_module` returns.
pub fn rmmod_races_last_callback(ctx: &mut Ctx) -> Result<String, String> {
    let rounds = if ctx.opts.quick { 3 } else { 12 };
    let name = std::ffi::CString::new("nvidia_peermem").map_err(|e| e.to_string())?;
    let _hold = Knob::emu("callback_hold_ms", "200")?;
    let running = format!("{EMU}/callbacks_running");
    for i in 0..rounds {
        let mut a = ctx.gpu().alloc(0, M).map_err(errno_name)?;
        let h = ctx
            .core
            .reg(a.va, M, PMC_REG_INVAL_SUPP)
            .map_err(errno_name)?;
        dereg_with_failing(ctx, h, "put_pages")?;
        ensure!(stat("stranded_pins") == 1, "round {i}: pin not stranded");
        let (tx, rx) = mpsc::channel();
        let (armed_tx, armed_rx) = mpsc::channel();
        let (n, running) = (name.clone(), running.clone());
        let unloader = std::thread::spawn(move || {
            let t = Instant::now();
            let mut tries = 0u64;
            loop {
                tries += 1;
                // SAFETY: a NUL-terminated name; O_NONBLOCK: refuse instead
                // of waiting while the module is in use.
                let rc =
                    unsafe { libc::syscall(libc::SYS_delete_module, n.as_ptr(), libc::O_NONBLOCK) };
                if rc == 0 || t.elapsed() > Duration::from_secs(10) {
                    let inside = std::fs::read_to_string(&running).unwrap_or_default();
                    let _ = tx.send((if rc == 0 { tries } else { 0 }, inside));
                    return;
                }
                if tries == 1 {
                    let _ = armed_tx.send(());
                }
                std::hint::spin_loop();
            }
        });
        // The first attempt must be refused: the armed callback holds the
        // module. Then the free races the unloader's next attempts.
        let refused_first = armed_rx.recv_timeout(Duration::from_secs(5)).is_ok();
        std::thread::sleep(Duration::from_millis(i % 3));
        a.unmap();
        let (tries, inside) = rx
            .recv_timeout(Duration::from_secs(15))
            .map_err(|_| "unloader hung".to_string())?;
        let _ = unloader.join();
        ensure!(
            refused_first,
            "round {i}: rmmod succeeded while a free callback was armed"
        );
        ensure!(
            tries > 0,
            "round {i}: the module never unloaded after its last callback"
        );
        ensure!(
            inside.trim() == "0",
            "round {i}: unloaded while {} free callback(s) had not returned to the GPU driver",
            inside.trim()
        );
        ctx.load()?;
    }
    Ok(format!(
        "{rounds} rounds: unloaded right after the last free callback"
    ))
}

/// The GPU driver hands a freed page table's address to the next pin at once
/// (fact 10): a client that touched a revoked registration's table would
/// now hit another registration's.
pub fn table_address_reuse(ctx: &mut Ctx) -> Result<String, String> {
    let _k = Knob::emu("reuse_tables", "1")?;
    let gi0 = ctx.gpu().info();
    let rounds = if ctx.opts.quick { 4 } else { 16 };
    for i in 0..rounds {
        let mut a = ctx.gpu().alloc(0, M).map_err(errno_name)?;
        let b = ctx.gpu().alloc(1, M).map_err(errno_name)?;
        let ha = ctx
            .core
            .reg(a.va, M, PMC_REG_INVAL_SUPP)
            .map_err(errno_name)?;
        // Revoke A: its table is freed and handed to B's pin right away.
        a.unmap();
        let hb = ctx
            .core
            .reg(b.va, M, PMC_REG_INVAL_SUPP)
            .map_err(errno_name)?;
        let seed = ctx.rand();
        // A's teardown must not touch B's pin (same table address).
        if i % 2 == 0 {
            ctx.core.dereg(ha).map_err(errno_name)?;
        }
        ctx.core
            .dma_write(hb, 0, &pattern(seed, 0, 64))
            .map_err(|e| format!("round {i}: B lost its pin: {}", errno_name(e)))?;
        ensure!(
            b.read(0, 64) == pattern(seed, 0, 64),
            "round {i}: B's DMA went elsewhere"
        );
        if i % 2 == 1 {
            ctx.core.dereg(ha).map_err(errno_name)?;
        }
        ctx.core.dereg(hb).map_err(errno_name)?;
    }
    let gi = ctx.gpu().info();
    let (p, u, c) = pins_ended(&gi0, &gi);
    // Every pin ends exactly once, and each revoked registration by its
    // callback only. Ours pins once per registration: A's pin ends by its
    // callback, B's by one unpin. NVIDIA's module pins and unpins once more
    // in each acquire.
    let exact = if ours(ctx) {
        p == 2 * rounds && u == rounds && c == rounds
    } else {
        p == u + c && c == rounds
    };
    ensure!(
        exact,
        "{rounds} rounds: {p} pins, {u} unpins, {c} callbacks"
    );
    Ok(format!(
        "{rounds} rounds, {} table addresses reused",
        gi.reused_tables - gi0.reused_tables
    ))
}

/// RLIMIT_MEMLOCK is charged before any peer client is asked (fact 16).
pub fn memlock_charged_first(ctx: &mut Ctx) -> Result<String, String> {
    let _k = Knob::core("memlock_ignore_cap", "1")?;
    let a = ctx.gpu().alloc(0, 2 * M).map_err(errno_name)?;
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: reading and setting our own limit.
    unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut old) };
    let low = libc::rlimit {
        rlim_cur: M,
        rlim_max: old.rlim_max,
    };
    let acq0 = stat("acquired");
    let gi0 = ctx.gpu().info();
    // SAFETY: as above.
    unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &low) };
    let big = ctx.core.reg(a.va, 2 * M, PMC_REG_INVAL_SUPP);
    let gi1 = ctx.gpu().info();
    let small = ctx.core.reg(a.va, M / 2, PMC_REG_INVAL_SUPP);
    // SAFETY: as above.
    unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &old) };
    expect_err(big, libc::ENOMEM, "2 MiB over a 1 MiB RLIMIT_MEMLOCK")?;
    let h = small.map_err(|e| format!("512 KiB under the limit: {}", errno_name(e)))?;
    ctx.core.dereg(h).map_err(errno_name)?;
    if ours(ctx) {
        ensure!(
            stat("acquired") == acq0 + 1,
            "the client was asked about a registration over the limit"
        );
    }
    ensure!(
        pins_ended(&gi0, &gi1).0 == 0,
        "a pin was made for a registration over the limit"
    );
    Ok("over the limit: ENOMEM before any client; under: registered".into())
}

/// The PCI bridges above a device, from the root down (its sysfs path).
fn bridges_above(bdf: &str) -> Vec<String> {
    let path = std::fs::canonicalize(format!("/sys/bus/pci/devices/{bdf}")).unwrap_or_default();
    let mut parts: Vec<String> = path
        .iter()
        .map(|c| c.to_string_lossy().into_owned())
        .skip_while(|c| !c.starts_with("pci"))
        .skip(1)
        .collect();
    parts.pop();
    parts
}

/// Whether the GPUs and the HCA sit below an upstream bridge in common (what
/// the GPU driver's gate asks); the layouts this runs in agree for all GPUs.
fn gpus_share_bridge_with(hca: &str) -> Result<bool, String> {
    let up = bridges_above(hca);
    let shares: Vec<bool> = std::fs::read_dir("/sys/bus/pci/drivers/nv_p2p_emu")
        .map_err(|e| format!("GPU devices: {e}"))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(':'))
        .map(|g| bridges_above(&g).iter().zip(&up).any(|(a, b)| a == b))
        .collect();
    ensure!(!shares.is_empty(), "no GPU bound");
    ensure!(
        shares.iter().all(|&s| s == shares[0]),
        "the GPUs differ in sharing a bridge with the HCA"
    );
    Ok(shares[0])
}

/// The module under test loaded anew with its mode's parameters and `extra`:
/// the GPU driver's chipset flag and override are read when nvidia.ko loads,
/// and every client loads after it.
/// No registration is made before the scenario's own (see `Ctx::settle`).
pub(crate) fn reload_with(ctx: &mut Ctx, extra: &[&str]) -> Result<(), String> {
    ctx.unload()?;
    let mut params = ctx.mode.params();
    params.extend_from_slice(extra);
    module::insmod(&ctx.opts.peermem, &params)
}

fn kernel_log() -> String {
    std::process::Command::new("dmesg")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// A mark in the kernel log: [`LogMark::since`] gives the lines after it
/// (not lines of earlier loads, and whatever the ring buffer dropped before
/// it).
pub(crate) struct LogMark(String);

impl LogMark {
    pub(crate) fn new() -> Self {
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mark = format!("E2E mark {}.{n}", std::process::id());
        let _ = std::fs::write("/dev/kmsg", format!("{mark}\n"));
        Self(mark)
    }

    pub(crate) fn since(&self) -> Vec<String> {
        let log = kernel_log();
        let mut after: Vec<String> = Vec::new();
        for l in log.lines() {
            if l.ends_with(&self.0) {
                after.clear();
            } else {
                after.push(l.to_string());
            }
        }
        after
    }
}

/// An MR on `a` as the module under test answers it: the errno, or the bytes
/// of a DMA write through it checked and the MR deregistered.
fn mr_outcome(ctx: &mut Ctx, a: &Alloc) -> Result<Result<(), i32>, String> {
    let h = match ctx.core.reg(a.va, M, PMC_REG_INVAL_SUPP) {
        Ok(h) => h,
        Err(e) => return Ok(Err(e)),
    };
    dma_and_dereg(ctx, a, h, 4096).map(Ok)
}

/// Writes a pattern through MR `h` at `off` of `a`, deregisters the MR and
/// checks that the bytes landed there.
fn dma_and_dereg(ctx: &mut Ctx, a: &Alloc, h: u64, off: u64) -> Result<(), String> {
    let seed = ctx.rand();
    let moved = ctx.core.dma_write(h, off, &pattern(seed, 0, 256));
    ctx.core.dereg(h).map_err(errno_name)?;
    moved.map_err(|e| format!("DMA through the MR: {}", errno_name(e)))?;
    ensure!(
        a.read(off, 256) == pattern(seed, 0, 256),
        "DMA went elsewhere"
    );
    Ok(())
}

/// What the GPU driver's topology verdicts for GPU 0 read in `gpus`.
fn gate_of_gpus() -> String {
    module::view("gpus")
        .unwrap_or_default()
        .split_whitespace()
        .filter(|w| w.starts_with("gate_"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The 580+ topology gate (fact 5) on a chipset flagged as unsafe for
/// peer-to-peer: the GPU driver refuses a peer with no upstream bridge in
/// common with the GPU. User space gets EOPNOTSUPP (never 524) from every
/// client: the persistent ones ask the driver, the invalidating one (which
/// maps BAR pages itself) learns the driver's verdict in `acquire` and
/// applies it. NVreg_GrdmaPciTopoCheckOverride=1 lets the pair map; where
/// the driver cannot be asked (persistent pins refused, as under MIG) the
/// pair is refused unless `allow_unverified_paths=1`.
pub fn topology_gate(ctx: &mut Ctx) -> Result<String, String> {
    let r = topology_gate_steps(ctx);
    // The knobs are back: the next scenarios get a module that learns anew.
    let reloaded = ctx.unload().and_then(|()| ctx.load());
    r.and_then(|d| reloaded.map(|()| d))
}

fn topology_gate_steps(ctx: &mut Ctx) -> Result<String, String> {
    let mark = LogMark::new();
    let hca = hca_device().ok_or("no HCA bound")?;
    let shares = gpus_share_bridge_with(&hca)?;
    let a = ctx.gpu().alloc(0, M).map_err(errno_name)?;
    let flag = Knob::emu("p2p_unsupported_chipset", "1")?;
    reload_with(ctx, &[])?;
    let gi0 = ctx.gpu().info();
    if !shares && refusal_lines_checked(ctx) {
        // Refusal lines are rate-limited (10 per 5 s): let the earlier
        // scenarios' window pass, so that this one's lines are all printed.
        std::thread::sleep(std::time::Duration::from_millis(5100));
    }
    // A CQ/QP umem is persistent in every mode: the GPU driver maps it.
    let cq = ctx.core.reg(a.va, M, 0);
    let gi1 = ctx.gpu().info();
    let mr = mr_outcome(ctx, &a)?;
    let mut detail = format!(
        "shared bridge: {shares}; flagged chipset: CQ {}, MR {}",
        cq.as_ref()
            .map_or_else(|e| errno_name(*e), |_| "mapped".into()),
        mr.map_or_else(errno_name, |()| "mapped".into())
    );
    if let Ok(h) = cq {
        ctx.core.dereg(h).map_err(errno_name)?;
    }
    if shares {
        ensure!(
            cq.is_ok() && mr.is_ok(),
            "a pair below a common bridge was refused: {detail}"
        );
        return Ok(detail);
    }
    ensure!(
        gi1.topo_refusals == gi0.topo_refusals + 1,
        "the gate refused {} times",
        gi1.topo_refusals - gi0.topo_refusals
    );
    let cq = cq
        .err()
        .ok_or("the topology gate was not applied to the CQ umem")?;
    let mr = mr
        .err()
        .ok_or("the MR was mapped on a path the GPU driver refuses")?;
    ensure!(
        cq != 524 && mr != 524,
        "ENOTSUPP (524) leaked to user space"
    );
    if ours(ctx) {
        ensure!(
            cq == libc::EOPNOTSUPP && mr == libc::EOPNOTSUPP,
            "gated mappings: user got {} and {}, expected EOPNOTSUPP",
            errno_name(cq),
            errno_name(mr)
        );
        topology_explained(ctx, &hca, &mark)?;
    }
    let over = Knob::emu("topo_check_override", "1")?;
    reload_with(ctx, &[])?;
    mr_outcome(ctx, &a)?
        .map_err(|e| format!("NVreg_GrdmaPciTopoCheckOverride=1: MR {}", errno_name(e)))?;
    drop(over);
    detail.push_str("; override: mapped");
    if ours(ctx) && ctx.mode.invalidating() {
        detail.push_str(&unverified_paths(ctx, &a)?);
    }
    drop(flag);
    Ok(detail)
}

/// Ours on a flagged chipset: the refusal explained once per pair, counted on
/// the pair, and (invalidating) learnt with one persistent pin at load.
/// Whether `topology_gate` checks the refusal lines' fields: ours, in the
/// persistent mode (the GPU driver's refusal) and the invalidating one (the
/// client's own gate; legacy and ofed4 refuse through the same code). Each
/// check waits out the log's rate limit first.
fn refusal_lines_checked(ctx: &Ctx) -> bool {
    ours(ctx) && matches!(ctx.mode, Mode::Persistent | Mode::Invalidating)
}

fn topology_explained(ctx: &Ctx, hca: &str, mark: &LogMark) -> Result<(), String> {
    let log = mark.since();
    ensure!(
        log.iter()
            .any(|l| l.contains("NVreg_GrdmaPciTopoCheckOverride") && l.contains(hca)),
        "the topology refusal was not explained in the log"
    );
    if refusal_lines_checked(ctx) {
        // One line per refusal, naming the process, the GPU, the HCA and the
        // errno in the kernel's words.
        let who = format!("refused pid={} comm=peermem-e2e gpu=", std::process::id());
        let refusals: Vec<&String> = log
            .iter()
            .filter(|l| l.contains(&who) && l.contains(&format!(" hca={hca} errno=EOPNOTSUPP: ")))
            .collect();
        ensure!(
            refusals.len() == 2 && refusals.iter().all(|l| !l.contains("gpu=- ")),
            "expected 2 refusal lines (CQ, MR) naming this process, the GPU and HCA {hca}: {refusals:?}"
        );
    }
    let paths = module::view("paths")?;
    ensure!(
        paths.lines().any(|l| l.contains(&format!("hca={hca}"))
            && l.contains(" last_failure=EOPNOTSUPP ")
            && !l.contains(" failures=0 ")),
        "the refusal is not counted on the pair: {paths}"
    );
    if ctx.mode.invalidating() {
        let gates = gate_of_gpus();
        ensure!(gates.contains("gate_other=refused"), "gpus: {gates}");
        ensure!(
            stat("fail_topology") >= 1,
            "the invalidating client's refusal is not counted"
        );
    }
    Ok(())
}

/// Ours, invalidating, flagged chipset, the driver's persistent pins refused
/// (as under MIG): the pair is refused with a line naming the parameter, and
/// maps with `allow_unverified_paths=1`.
fn unverified_paths(ctx: &mut Ctx, a: &Alloc) -> Result<String, String> {
    let mark = LogMark::new();
    reload_with(ctx, &[])?;
    // The first registration makes the HCA an RDMA peer to ask about (no
    // pin: decided by the rule on the platform observed); the second asks.
    let first = mr_outcome(ctx, a)?;
    expect_err(
        first.map(|()| 0),
        libc::EOPNOTSUPP,
        "a pair not asked about yet",
    )?;
    module::inject("get_pages_persistent", 1, 524)?;
    let mr = mr_outcome(ctx, a)?;
    module::inject("get_pages_persistent", 0, 524)?;
    let gates = gate_of_gpus();
    expect_err(mr.map(|()| 0), libc::EOPNOTSUPP, "an unverifiable pair")?;
    ensure!(gates.contains("gate_other=unverified"), "gpus: {gates}");
    ensure!(
        stat("topology_probes") == 0,
        "a probe was counted without its pin"
    );
    ensure!(
        mark.since()
            .iter()
            .any(|l| l.contains("allow_unverified_paths=1")),
        "the refusal does not name allow_unverified_paths"
    );
    reload_with(ctx, &["allow_unverified_paths=1"])?;
    let first = mr_outcome(ctx, a)?;
    module::inject("get_pages_persistent", 1, 524)?;
    let mr = mr_outcome(ctx, a)?;
    module::inject("get_pages_persistent", 0, 524)?;
    first.map_err(|e| format!("allow_unverified_paths=1: first MR {}", errno_name(e)))?;
    mr.map_err(|e| format!("allow_unverified_paths=1: MR {}", errno_name(e)))?;
    Ok("; unverifiable: EOPNOTSUPP, mapped with allow_unverified_paths=1".into())
}

/// Coherent (C2C) GPUs, as on Grace Hopper and Grace Blackwell (fact 6):
/// page tables v2 flagged `CPU_CACHEABLE`, memory in system RAM rather than
/// behind a BAR, no topology gate. Under MIG (fact 9) the GPU driver refuses
/// persistent pins, so the invalidating client is the only working mode: it
/// maps the memory itself, byte-exact, on a chipset flagged for the gate,
/// and revokes on a free. Then without MIG, where every mode maps.
pub fn coherent_gpu(ctx: &mut Ctx) -> Result<String, String> {
    let r = coherent_gpu_steps(ctx);
    let back = ctx.reload_provider(&[]);
    r.and_then(|d| back.map(|()| d))
}

fn coherent_gpu_steps(ctx: &mut Ctx) -> Result<String, String> {
    const V2: &str = "page_table_version=0x00020000";
    let mut out = Vec::new();
    for args in [&["coherent=1", "mig=1", V2][..], &["coherent=1", V2][..]] {
        let mig = args.contains(&"mig=1");
        ctx.reload_provider(args)?;
        // The driver skips its gate on coherent platforms: so must we.
        let _flag = Knob::emu("p2p_unsupported_chipset", "1")?;
        let refusals0 = (stat("fail_topology"), ctx.gpu().info().topo_refusals);
        let mut a = ctx.gpu().alloc(0, 4 * M).map_err(errno_name)?;
        // Unaligned, over many 64 KiB chunks of RAM that need not follow
        // each other.
        let mr = coherent_mr(ctx, &a, M + 100, 2 * M, PMC_REG_INVAL_SUPP)?;
        let cq = coherent_mr(ctx, &a, 0, M - 1000, 0)?;
        let name = if mig { "MIG" } else { "no MIG" };
        out.push(format!(
            "{name}: MR {}, CQ {}",
            mr.as_ref().map_or_else(|e| errno_name(*e), |s| s.clone()),
            cq.as_ref().map_or_else(|e| errno_name(*e), |s| s.clone())
        ));
        if ctx.opts.reference {
            continue;
        }
        // A persistent pin: refused under MIG, in every mode, with the
        // errno of "not supported" (never 524).
        let want_mr = if mig && !ctx.mode.invalidating() {
            Err(libc::EOPNOTSUPP)
        } else {
            Ok(())
        };
        let want_cq = if mig { Err(libc::EOPNOTSUPP) } else { Ok(()) };
        ensure!(
            mr.as_ref().map(|_| ()).map_err(|e| *e) == want_mr
                && cq.as_ref().map(|_| ()).map_err(|e| *e) == want_cq,
            "coherent GPU, {}",
            out.last().unwrap()
        );
        let refusals = (stat("fail_topology"), ctx.gpu().info().topo_refusals);
        ensure!(
            refusals == refusals0,
            "coherent memory went through the topology gate: {refusals0:?} -> {refusals:?}"
        );
        if ctx.mode.invalidating() {
            coherent_free(ctx, &mut a)?;
        }
        let gi = ctx.gpu().info();
        ensure!(
            gi.live_tables == 0 && gi.live_mappings == 0,
            "coherent GPU, {name}: {} tables and {} mappings left",
            gi.live_tables,
            gi.live_mappings
        );
    }
    Ok(out.join("; "))
}

/// Registers `len` bytes at `off` of `a` with `flags` and moves bytes both
/// ways through the MR: the SG entries, the pins and the GPU driver's DMA
/// mappings checked for this module. `Ok(Err(errno))` if refused.
fn coherent_mr(
    ctx: &mut Ctx,
    a: &Alloc,
    off: u64,
    len: u64,
    flags: u64,
) -> Result<Result<String, i32>, String> {
    let (page, gpu_page) = (crate::page_size(), 64u64 << 10);
    let seed = ctx.rand();
    let n = 256usize;
    let offs = [0, len / 2, len - n as u64];
    for &s in &offs {
        a.write(off + s, &pattern(seed, s, n));
    }
    let gi0 = ctx.gpu().info();
    let h = match ctx.core.reg(a.va + off, len, flags) {
        Ok(h) => h,
        Err(e) => return Ok(Err(e)),
    };
    let gi1 = ctx.gpu().info();
    let q = ctx.core.query(h).map_err(errno_name)?;
    let (start, end) = (a.va + off, a.va + off + len);
    let span = end.div_ceil(page) * page - start / page * page;
    let chunks = end.div_ceil(gpu_page) - start / gpu_page;
    let callback = ctx.mode.invalidating() && flags & PMC_REG_INVAL_SUPP != 0;
    let moved = (|| {
        for &s in &offs {
            let got = ctx.core.dma_read(h, s, n).map_err(errno_name)?;
            ensure!(
                got == pattern(seed, s, n),
                "DMA read other bytes at MR+{s:#x}"
            );
        }
        let seed2 = ctx.rand();
        for &s in &offs {
            ctx.core
                .dma_write(h, s, &pattern(seed2, s, n))
                .map_err(errno_name)?;
            ensure!(
                a.read(off + s, n) == pattern(seed2, s, n),
                "the CPU sees other bytes than the HCA wrote at MR+{s:#x}"
            );
        }
        Ok(())
    })();
    ctx.core.dereg(h).map_err(errno_name)?;
    moved?;
    ensure!(
        q.state == PMC_STATE_MAPPED && q.page_size == gpu_page && q.total_len == span,
        "state {}, page size {:#x}, SG entries over {:#x} bytes (want {span:#x})",
        q.state,
        q.page_size,
        q.total_len
    );
    if !ctx.opts.reference {
        let pins = (
            gi1.pins - gi0.pins,
            gi1.persistent_pins - gi0.persistent_pins,
            gi1.dma_maps - gi0.dma_maps,
        );
        let want = if callback { (1, 0, 0) } else { (0, 1, 1) };
        ensure!(
            pins == want,
            "pins with callback, persistent pins, GPU driver mappings: {pins:?}, want {want:?}"
        );
        ensure!(
            q.nmap >= 1 && q.nmap <= chunks,
            "{} SG entries over {chunks} GPU pages",
            q.nmap
        );
    }
    Ok(Ok(format!("mapped ({} entries)", q.nmap)))
}

/// A free under a live invalidating MR on coherent memory: revoked, the
/// HCA refused, one callback, nothing left pinned.
fn coherent_free(ctx: &mut Ctx, a: &mut Alloc) -> Result<(), String> {
    let cb0 = ctx.gpu().info().callbacks;
    let h = ctx
        .core
        .reg(a.va, M, PMC_REG_INVAL_SUPP)
        .map_err(|e| format!("coherent MR before the free: {}", errno_name(e)))?;
    a.unmap();
    let q = ctx.core.query(h).map_err(errno_name)?;
    let dma = ctx.core.dma_read(h, 0, 64);
    ctx.core.dereg(h).map_err(errno_name)?;
    let want = if ctx.mode.legacy() {
        PMC_STATE_UNMAPPED
    } else {
        PMC_STATE_INVALIDATED
    };
    ensure!(
        q.state == want && q.revoked == 1,
        "coherent MR after the free: state {} revoked {}",
        q.state,
        q.revoked
    );
    expect_err(dma, libc::EACCES, "DMA through the revoked coherent MR")?;
    ensure!(
        ctx.gpu().info().callbacks == cb0 + 1 && stat("pinned_bytes") == 0,
        "coherent free: {} callbacks, {} bytes pinned",
        ctx.gpu().info().callbacks - cb0,
        stat("pinned_bytes")
    );
    Ok(())
}

/// The invalidating client's verdict against the GPU driver's rule (fact 5,
/// `nv_grdma_pci_topology_supported`), row by row: MIG (the driver cannot be
/// asked: the rule on the platform observed) or not (the first registration
/// after a load decides by the platform observed, for want of an RDMA peer
/// to ask about; the second asks the driver about the HCA with a persistent
/// pin), `NVreg_GrdmaPciTopoCheckOverride` 0/1/2, the GPUs passed through to
/// a VM or not (presented to the module through its `present_vm` file: QEMU
/// under TCG shows no hypervisor RM knows), the chipset flagged (the board
/// shows Ampere Altra's root complex) or not, on this boot's path between
/// the GPUs and the HCA. Ours must equal the driver's row by row, user space
/// never sees 524, and the driver is asked about no device but the HCA.
/// NVIDIA's C module's rows are reported beside, for information.
pub fn driver_verdicts(ctx: &mut Ctx) -> Result<String, String> {
    let (mut rows, mut asked) = (Vec::new(), String::new());
    let r = [false, true].into_iter().try_for_each(|mig| {
        // A fresh provider: it lists the devices it is asked to map for.
        ctx.reload_provider(if mig { &["mig=1"] } else { &[] })?;
        let r = verdict_rows(ctx, mig, &mut rows);
        asked += &std::fs::read_to_string(format!("{EMU}/mapped_for")).unwrap_or_default();
        r
    });
    let back = ctx.reload_provider(&[]);
    r?;
    back?;
    let hca = hca_device().ok_or("no HCA bound")?;
    let wrong: Vec<&String> = rows.iter().filter(|r| r.contains("differs")).collect();
    let detail = format!(
        "{} rows, {} mapped, {} refused{}; the driver was asked about {:?}",
        rows.len(),
        rows.iter().filter(|r| r.contains("driver maps")).count(),
        rows.iter().filter(|r| r.contains("driver refuses")).count(),
        if wrong.is_empty() {
            ", every one as the driver's".to_string()
        } else {
            format!("; differ: {wrong:?}")
        },
        asked.split_whitespace().collect::<Vec<_>>()
    );
    ensure!(ctx.opts.reference || wrong.is_empty(), "{detail}");
    ensure!(
        ctx.opts.reference || asked.split_whitespace().all(|d| d == hca),
        "the GPU driver was asked to map for a device that is not the RDMA peer: {detail}"
    );
    Ok(detail)
}

fn verdict_rows(ctx: &mut Ctx, mig: bool, rows: &mut Vec<String>) -> Result<(), String> {
    let hca = hca_device().ok_or("no HCA bound")?;
    let shares = gpus_share_bridge_with(&hca)?;
    let a = ctx.gpu().alloc(0, M).map_err(errno_name)?;
    for over in [0u32, 1, 2] {
        for vm in [false, true] {
            for flagged in [false, true] {
                let _o = Knob::emu("topo_check_override", &over.to_string())?;
                let _v = Knob::emu("passthrough_gpus", if vm { "4294967295" } else { "0" })?;
                let _f = Knob::emu("p2p_unsupported_chipset", if flagged { "1" } else { "0" })?;
                reload_with(ctx, &[])?;
                if ours(ctx) && vm {
                    module::debugfs_write("/sys/kernel/debug/nvidia_peermem/present_vm", "2")?;
                }
                let maps = match over {
                    1 => true,
                    2 => false,
                    _ => vm || !flagged || shares,
                };
                let got = [mr_outcome(ctx, &a)?, mr_outcome(ctx, &a)?];
                ensure!(
                    !got.contains(&Err(524)),
                    "ENOTSUPP (524) leaked to user space"
                );
                let want = if maps { Ok(()) } else { Err(libc::EOPNOTSUPP) };
                let learnt = gate_of_gpus();
                let kind = if shares {
                    "gate_shared_bridge="
                } else {
                    "gate_other="
                };
                let verdict = match (mig, maps) {
                    (true, _) => "unverified",
                    (false, true) => "open",
                    (false, false) => "refused",
                };
                let as_driver = got == [want, want]
                    && (!ours(ctx) || learnt.contains(&format!("{kind}{verdict}")));
                rows.push(format!(
                    "MIG {mig} override {over} VM {vm} flagged {flagged} bridge {shares}: driver {}, {}{:?} ({learnt})",
                    if maps { "maps" } else { "refuses" },
                    if as_driver { "ours " } else { "ours differs: " },
                    got.map(|r| r.map_or_else(errno_name, |()| "mapped".into()))
                ));
            }
        }
    }
    Ok(())
}

/// The GPU driver's verdict is asked with a persistent pin in an
/// invalidating registration's `acquire`, about an RDMA peer (here the HCA,
/// once it was a registration's `dma_device`). A failure on the way (no
/// BAR1 at that moment: the harness shares one BAR1 mapping among pins of
/// one page, so the probe's pin is failed by injection; the HCA's device
/// lock held) gives the registrations that need the verdict the real error
/// (ENOMEM, EBUSY; not EOPNOTSUPP) and is asked again, fewer registrations
/// asking after each failure in a row. Never a final verdict from a failure.
pub fn probe_failures(ctx: &mut Ctx) -> Result<String, String> {
    let r = probe_failure_steps(ctx);
    let reloaded = ctx.unload().and_then(|()| ctx.load());
    r.and_then(|d| reloaded.map(|()| d))
}

fn probe_failure_steps(ctx: &mut Ctx) -> Result<String, String> {
    let hca = hca_device().ok_or("no HCA bound")?;
    let shares = gpus_share_bridge_with(&hca)?;
    let a = ctx.gpu().alloc(0, M).map_err(errno_name)?;
    let _flag = Knob::emu("p2p_unsupported_chipset", "1")?;
    let verdict = if shares {
        Ok(())
    } else {
        Err(libc::EOPNOTSUPP)
    };
    let name = |r: &Result<(), i32>| r.map_or_else(errno_name, |()| "mapped".into());
    module::debugfs_write(&format!("{EMU}/mapped_for"), "0")?;
    reload_with(ctx, &[])?;
    // The first registration finds no RDMA peer to ask about (no pin: the
    // rule on the platform observed decides) and makes the HCA one. The
    // second asks and fails: ENOMEM. The third does not ask (two questions
    // in a row came back without a verdict; asking now would have got it)
    // and is told the last error; the fourth asks and gets the verdict.
    let mut got = vec![mr_outcome(ctx, &a)?];
    module::inject("get_pages_persistent", 1, libc::ENOMEM)?;
    for _ in 0..3 {
        got.push(mr_outcome(ctx, &a)?);
    }
    module::inject("get_pages_persistent", 0, libc::ENOMEM)?;
    let e = Err(libc::ENOMEM);
    ensure!(
        got == [verdict, e, e, verdict],
        "registrations around a failed question: {got:?}, expected {verdict:?}, ENOMEM x2, {verdict:?}"
    );
    let kind = if shares {
        "gate_shared_bridge=open"
    } else {
        "gate_other=refused"
    };
    ensure!(gate_of_gpus().contains(kind), "gpus: {}", gate_of_gpus());
    // The HCA's device lock held by another thread while a registration
    // asks about it: EBUSY, and a later registration asks again.
    reload_with(ctx, &[])?;
    let first = mr_outcome(ctx, &a)?;
    ensure!(first == verdict, "before the HCA was a peer: {first:?}");
    let lock = std::thread::spawn(|| {
        module::debugfs_write(&format!("{CORE_DBG}/hold_hca_lock_ms"), "2000")
    });
    std::thread::sleep(Duration::from_millis(300));
    let va = a.va;
    let locked = within(10, "a registration under the HCA's held lock", move || {
        let core = Core::open()?;
        match core.reg(va, M, PMC_REG_INVAL_SUPP) {
            Ok(h) => core.dereg(h).map(|_| Ok(())).map_err(errno_name),
            Err(e) => Ok(Err(e)),
        }
    })??;
    lock.join().map_err(|_| "lock holder panicked")??;
    ensure!(
        locked == Err(libc::EBUSY),
        "under the held lock: {locked:?}"
    );
    let mut after = Vec::new();
    while after.last() != Some(&verdict) && after.len() < 3 {
        after.push(mr_outcome(ctx, &a)?);
    }
    ensure!(
        after.last() == Some(&verdict)
            && after[..after.len() - 1]
                .iter()
                .all(|r| *r == Err(libc::EBUSY)),
        "after the lock: {after:?}, expected EBUSY until {verdict:?}"
    );
    // Never another device in the HCA's stead (the other GPU is a bus
    // master too, but no RDMA peer).
    let asked = std::fs::read_to_string(format!("{EMU}/mapped_for")).unwrap_or_default();
    ensure!(
        asked.split_whitespace().all(|d| d == hca),
        "the GPU driver was asked to map for a device that is not the RDMA peer: {asked:?}"
    );
    Ok(format!(
        "path shares a bridge: {shares}; {} x2 then {}; the HCA's lock held: {}, then {:?}",
        name(&e),
        name(&verdict),
        name(&locked),
        after.iter().map(name).collect::<Vec<_>>()
    ))
}

/// A core that unmaps and maps a pin again before use (PMC_REG_REMAP): the
/// registration is counted once on its GPU, and nothing is left counted
/// after it ends.
pub fn remap_counts_once(ctx: &mut Ctx) -> Result<String, String> {
    let live = || -> Result<(u64, u64), String> {
        let t = module::view("gpus")?;
        let sum = |k: &str| {
            t.split_whitespace()
                .filter_map(|w| w.strip_prefix(k))
                .filter_map(|v| v.parse::<u64>().ok())
                .sum::<u64>()
        };
        Ok((sum("live="), sum("pinned_bytes=")))
    };
    let a = ctx.gpu().alloc(0, M).map_err(errno_name)?;
    let before = live()?;
    let flags = if ctx.mode.invalidating() {
        PMC_REG_INVAL_SUPP
    } else {
        0
    };
    let h = ctx
        .core
        .reg(a.va, M, flags | PMC_REG_REMAP)
        .map_err(errno_name)?;
    let during = live()?;
    dma_and_dereg(ctx, &a, h, 0).map_err(|e| format!("after the remap: {e}"))?;
    let after = live()?;
    ensure!(
        during == (before.0 + 1, before.1 + M) && after == before,
        "GPU counts (live, pinned bytes): before {before:?}, remapped {during:?}, after {after:?}"
    );
    Ok(format!("counted once: {during:?}, back to {after:?}"))
}

/// A sysfs view longer than one read (sysfs hands out 4 KiB per call) is
/// one snapshot, however the tables change between the reads: 100
/// processes each holding a registration make `processes` over 5 KiB;
/// after the first 4 KiB are read, a process listed in them ends; the rest
/// of the file continues the same snapshot (every line whole, no process
/// twice, the ended one still there).
pub fn views_read_whole(ctx: &mut Ctx) -> Result<String, String> {
    use std::io::Read;
    const N: usize = 100;
    let mut kids = Vec::new();
    for _ in 0..N {
        let kid = Child::fork(|side| {
            let held = (|| {
                let (g, core) = (Gpu::open().ok()?, Core::open().ok()?);
                let a = g.alloc(0, 1 << 16).ok()?;
                core.reg(a.va, 1 << 16, 0).ok()?;
                Some((g, core, a))
            })();
            side.send(u64::from(held.is_some()));
            side.wait_go();
            0
        })?;
        ensure!(kid.recv()? == 1, "a child could not register");
        kids.push(kid);
    }
    let path = module::PROCESSES;
    // Nothing changes until the first part is read: the snapshot is this.
    let before = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let mut f = std::fs::File::open(path).map_err(|e| format!("{path}: {e}"))?;
    let mut text = vec![0u8; 4096];
    let n = f.read(&mut text).map_err(|e| format!("{path}: {e}"))?;
    text.truncate(n);
    let head = String::from_utf8_lossy(&text).into_owned();
    let listed = |t: &str, pid: i32| t.lines().any(|l| l.starts_with(&format!("tgid={pid} ")));
    let i = kids
        .iter()
        .position(|k| listed(&head, k.pid))
        .ok_or("no child in the first 4 KiB")?;
    let gone = kids.swap_remove(i);
    let pid = gone.pid;
    gone.go();
    gone.wait();
    wait_for(5, "the ended process's line", || {
        !listed(&std::fs::read_to_string(path).unwrap_or_default(), pid)
    })?;
    f.read_to_end(&mut text)
        .map_err(|e| format!("{path}: {e}"))?;
    for k in kids {
        k.go();
        k.wait();
    }
    let all = String::from_utf8_lossy(&text).into_owned();
    let tgids: Vec<&str> = all.lines().filter_map(|l| l.split(' ').next()).collect();
    let mut unique = tgids.clone();
    unique.sort_unstable();
    unique.dedup();
    let whole = all.lines().all(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        let num = |f: &str, k: &str| f.strip_prefix(k).is_some_and(|v| v.parse::<u64>().is_ok());
        f.len() == 4
            && num(f[0], "tgid=")
            && f[1].starts_with("comm=")
            && num(f[2], "live=")
            && num(f[3], "pinned_bytes=")
    });
    ensure!(
        n == 4096 && whole && unique.len() == tgids.len() && all == before,
        "a {}-byte view read in two parts ({n} bytes first) is no one snapshot of the {} bytes before ({} lines, {} processes, every line whole: {whole}, the ended one {}): {:?}",
        all.len(),
        before.len(),
        tgids.len(),
        unique.len(),
        if listed(&all, pid) { "listed" } else { "missing" },
        all.lines().zip(before.lines()).find(|(a, b)| a != b)
    );
    let _ = ctx;
    Ok(format!(
        "{} bytes, {} processes, one snapshot",
        all.len(),
        tgids.len()
    ))
}
