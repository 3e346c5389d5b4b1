// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The drain (`/sys/module/nvidia_peermem/drain`): new registrations
//! refused, live invalidating ones revoked through the core, the holders of
//! the rest named; once nothing lives, the module lets go of the core and
//! the GPU driver, which are then unloaded and loaded again under it, and
//! it registers again by itself. Also the upgrade of the module itself.

use crate::{
    dev::{Alloc, Core, Gpu},
    hostile::LogMark,
    module,
    scenarios::{errno_name, expect_err, pattern, reg_verify, stat},
    uapi::{PMC_REG_INVAL_SUPP, PMC_STATE_INVALIDATED, PMC_STATE_MAPPED, PMC_STATE_UNMAPPED},
    Ctx,
};

const DRAIN: &str = "/sys/module/nvidia_peermem/drain";
const WAITING: &str = "/sys/module/nvidia_peermem/stats/waiting_for";
const M2: u64 = 2 << 20;

macro_rules! ensure {
    ($c:expr, $($fmt:tt)*) => {
        if !$c {
            return Err(format!($($fmt)*));
        }
    };
}

fn read(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|e| format!("({path}: {e})"))
}

fn drain(on: bool) -> Result<(), String> {
    std::fs::write(DRAIN, if on { "1" } else { "0" }).map_err(|e| format!("write {DRAIN}: {e}"))
}

/// The first nvidia_peermem line since `mark` containing `what`.
fn logged(mark: &LogMark, what: &str) -> Result<String, String> {
    mark.since()
        .into_iter()
        .find(|l| l.contains("nvidia_peermem: ") && l.contains(what))
        .ok_or_else(|| format!("no log line with \"{what}\""))
}

/// `waiting_for` becomes `want` within two seconds (the drain completes
/// from a work item once the last registration went).
fn wait_for(want: &str) -> Result<(), String> {
    let t = std::time::Instant::now();
    while read(WAITING) != want {
        ensure!(
            t.elapsed() < std::time::Duration::from_secs(2),
            "waiting_for {}, expected {want}",
            read(WAITING)
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    Ok(())
}

/// An MR on `a` with bytes DMA'd through it; its handle.
fn live_mr(ctx: &mut Ctx, a: &Alloc, flags: u64) -> Result<u64, String> {
    let seed = ctx.rand();
    let h = ctx
        .core
        .reg(a.va, M2, flags)
        .map_err(|e| format!("reg: {}", errno_name(e)))?;
    ctx.core
        .dma_write(h, 4096, &pattern(seed, 0, 256))
        .map_err(errno_name)?;
    ensure!(
        a.read(4096, 256) == pattern(seed, 0, 256),
        "bytes not DMA'd"
    );
    Ok(h)
}

/// Drains with two live MRs on GPU 0, an invalidating and (where the mode
/// has one) a persistent one: the invalidating one is revoked at once (its
/// DMA refused), the persistent one keeps working and its process is
/// named; a new registration is refused with a line; the drain completes
/// only once both are deregistered. Returns the lines shown.
fn drain_with_mrs(ctx: &mut Ctx) -> Result<Vec<String>, String> {
    let a = ctx.gpu().alloc(0, M2).map_err(errno_name)?;
    let b = ctx.gpu().alloc(0, M2).map_err(errno_name)?;
    let hi = live_mr(ctx, &a, PMC_REG_INVAL_SUPP)?;
    let hp = live_mr(ctx, &b, 0)?;
    let (revoked0, refused0) = (stat("drain_revoked"), stat("fail_draining"));
    let mark = LogMark::new();
    drain(true)?;
    ensure!(read(DRAIN) == "1", "drain reads {}", read(DRAIN));
    let mut lines = vec![logged(&mark, "drain: new registrations are refused")?];
    let qi = ctx.core.query(hi).map_err(errno_name)?;
    if ctx.mode.invalidating() {
        let want = if ctx.mode.legacy() {
            PMC_STATE_UNMAPPED
        } else {
            PMC_STATE_INVALIDATED
        };
        ensure!(
            qi.state == want && qi.revoked == 1,
            "invalidating MR after the drain: state {}",
            qi.state
        );
        expect_err(
            ctx.core.dma_read(hi, 4096, 64),
            libc::EACCES,
            "DMA through the drained MR",
        )?;
        ensure!(
            stat("drain_revoked") == revoked0 + 1,
            "drain_revoked {}",
            stat("drain_revoked") - revoked0
        );
        // OFED 4.x releases the registration from inside its invalidate:
        // its pin ends there; the others keep it until the deregistration.
        if ctx.mode != crate::Mode::Ofed4 {
            lines.push(logged(&mark, "pins of GPU memory")?);
        }
    } else {
        ensure!(
            qi.state == PMC_STATE_MAPPED,
            "persistent MR changed by the drain: {}",
            qi.state
        );
        ensure!(
            stat("drain_revoked") == revoked0,
            "a persistent MR was revoked"
        );
    }
    // The persistent registration (nv_mem_nc, or nv_mem persistent) works
    // on, and its holder is named.
    ctx.core
        .dma_read(hp, 4096, 64)
        .map_err(|e| format!("persistent MR after the drain: {}", errno_name(e)))?;
    let me = format!("process {} (", std::process::id());
    let named = logged(&mark, "persistent registrations")?;
    ensure!(named.contains(&me), "holder not named: {named}");
    lines.push(named);
    ensure!(
        read(WAITING) == "drain-holders",
        "waiting_for {}",
        read(WAITING)
    );
    let c = ctx.gpu().alloc(0, M2).map_err(errno_name)?;
    ensure!(
        ctx.core.reg(c.va, M2, PMC_REG_INVAL_SUPP).is_err(),
        "registered while draining"
    );
    ensure!(stat("fail_draining") > refused0, "refusal not counted");
    lines.push(logged(
        &mark,
        "nvidia_peermem is draining: registration of",
    )?);
    // Still held: the core cannot go.
    ensure!(
        !module::rmmod("peer_mem_core")?,
        "the core unloaded under live MRs"
    );
    ctx.core.dereg(hi).map_err(errno_name)?;
    // OFED 4.x released it from inside the drain's invalidate: its pin was
    // left to the free callback, which this free brings.
    drop(a);
    ensure!(
        read(WAITING) == "drain-holders",
        "completed with a persistent MR held"
    );
    ctx.core.dereg(hp).map_err(errno_name)?;
    wait_for("drained")?;
    lines.push(logged(&mark, "drained: the clients are unregistered")?);
    ensure!(
        module::peer_stat("nv_mem", "version").is_none(),
        "nv_mem still registered when drained"
    );
    Ok(lines)
}

/// Moves bytes through fresh MRs: an invalidating one on the first GPU, a
/// persistent one on the last (each DMA of the emulated HCA takes 100 ms of
/// guest time: few and short). A GPU the module sees anew (its driver
/// reloaded) is asked about its topology by its first invalidating
/// registration once the HCA is a known peer (a persistent pin of the
/// module's own): those are made first, as `Ctx::settle` does, so that the
/// checked ones count only their own pins.
fn traffic(ctx: &mut Ctx) -> Result<String, String> {
    let gpus = ctx.gpu().info().gpus;
    for gpu in std::iter::once(0).chain(0..gpus) {
        let a = ctx.gpu().alloc(gpu, 1 << 16).map_err(errno_name)?;
        let h = ctx
            .core
            .reg(a.va, 1 << 16, PMC_REG_INVAL_SUPP)
            .map_err(errno_name)?;
        ctx.core.dereg(h).map_err(errno_name)?;
    }
    let mut out = Vec::new();
    for (gpu, flags) in [(0, PMC_REG_INVAL_SUPP), (gpus - 1, 0)] {
        let a = ctx.gpu().alloc(gpu, M2).map_err(errno_name)?;
        let q = reg_verify(ctx, &a, 0x1000, 200, flags)?;
        out.push(format!("gpu{gpu}:{}sge", q.nmap));
    }
    Ok(out.join(" "))
}

/// Runs `f`; on a failure ends the drain, so that the next scenarios run.
fn ended(ctx: &mut Ctx, f: fn(&mut Ctx) -> Result<String, String>) -> Result<String, String> {
    let r = f(ctx);
    if r.is_err() {
        let _ = drain(false);
    }
    r
}

/// The core's module unloaded and loaded again under a drained module,
/// with traffic before and after: the module registers again by itself.
pub(crate) fn drain_core_restart(ctx: &mut Ctx) -> Result<String, String> {
    ended(ctx, core_restart)
}

fn core_restart(ctx: &mut Ctx) -> Result<String, String> {
    let before = traffic(ctx)?;
    let lines = drain_with_mrs(ctx)?;
    ctx.core = Core::placeholder()?;
    ensure!(
        module::rmmod("peer_mem_core")?,
        "rmmod peer_mem_core refused after the drain"
    );
    ensure!(module::loaded("nvidia_peermem"), "nvidia_peermem gone");
    let mark = LogMark::new();
    let variant = format!("variant={}", ctx.mode.core_variant());
    let core_ko = std::path::Path::new(&ctx.opts.emu).with_file_name("peer_mem_core.ko");
    module::insmod(&core_ko.to_string_lossy(), &[&variant])?;
    ctx.core = Core::open()?;
    came_back(ctx, &mark, "the core", before, lines)
}

/// The same for the GPU driver: unloaded and loaded again under a drained
/// module, which binds to it again by itself.
pub(crate) fn drain_gpu_restart(ctx: &mut Ctx) -> Result<String, String> {
    ended(ctx, gpu_restart)
}

fn gpu_restart(ctx: &mut Ctx) -> Result<String, String> {
    let before = traffic(ctx)?;
    let lines = drain_with_mrs(ctx)?;
    let style = read("/sys/kernel/debug/nv_p2p_emu/dma_map_style");
    ctx.gpu = None;
    ensure!(
        module::rmmod("nv_p2p_emu")?,
        "rmmod nv_p2p_emu refused after the drain"
    );
    let mark = LogMark::new();
    module::insmod(&ctx.opts.emu, &[])?;
    module::debugfs_write("/sys/kernel/debug/nv_p2p_emu/dma_map_style", &style)?;
    ctx.gpu = Some(Gpu::open()?);
    came_back(ctx, &mark, "the GPU driver", before, lines)
}

/// After `what` was loaded again under the drained module (since `mark`):
/// the drain ended by itself and the module registered; then traffic.
/// Returns the scenario's report.
fn came_back(
    ctx: &mut Ctx,
    mark: &LogMark,
    what: &str,
    before: String,
    mut lines: Vec<String>,
) -> Result<String, String> {
    ensure!(
        read(WAITING) == "nothing",
        "after {what} came back: waiting_for {}",
        read(WAITING)
    );
    ensure!(
        read(DRAIN) == "0",
        "drain reads {} after {what} came back",
        read(DRAIN)
    );
    lines.push(logged(
        mark,
        "drain ended (a module it binds to came back)",
    )?);
    let after = traffic(ctx)?;
    Ok(format!(
        "before {before}; \"{}\"; after {after}",
        lines.join("\" \"")
    ))
}

/// Writing 0 ends a drain: during it (a persistent MR held) the module takes
/// registrations again; after it completed, it registers again with the
/// core and driver that stayed loaded.
pub(crate) fn drain_resume(ctx: &mut Ctx) -> Result<String, String> {
    ended(ctx, resume)
}

fn resume(ctx: &mut Ctx) -> Result<String, String> {
    let b = ctx.gpu().alloc(0, M2).map_err(errno_name)?;
    let hp = live_mr(ctx, &b, 0)?;
    drain(true)?;
    ensure!(
        read(WAITING) == "drain-holders",
        "waiting_for {}",
        read(WAITING)
    );
    let mark = LogMark::new();
    drain(false)?;
    let mid = logged(
        &mark,
        "drain ended (drain set to 0): registrations are accepted again",
    )?;
    ensure!(
        read(WAITING) == "nothing",
        "after 0: waiting_for {}",
        read(WAITING)
    );
    let moved = traffic(ctx)?;
    ctx.core.dereg(hp).map_err(errno_name)?;
    drain(true)?;
    wait_for("drained")?;
    let mark = LogMark::new();
    drain(false)?;
    let again = logged(&mark, "drain ended (drain set to 0): nv_mem")?;
    ensure!(
        read(WAITING) == "nothing",
        "after 0: waiting_for {}",
        read(WAITING)
    );
    let after = traffic(ctx)?;
    Ok(format!("\"{mid}\" {moved}; \"{again}\" {after}"))
}

/// Upgrading the module itself on a live node: drain (live MRs revoked or
/// waited for), rmmod, insmod of the new build, traffic again.
pub(crate) fn self_upgrade(ctx: &mut Ctx) -> Result<String, String> {
    ended(ctx, upgrade)
}

fn upgrade(ctx: &mut Ctx) -> Result<String, String> {
    let lines = drain_with_mrs(ctx)?;
    ensure!(
        module::rmmod("nvidia_peermem")?,
        "rmmod nvidia_peermem refused after the drain"
    );
    let mark = LogMark::new();
    module::insmod(&ctx.opts.peermem, &ctx.mode.params())?;
    let loaded = logged(&mark, " loaded: nv_mem")?;
    ctx.settle()?;
    let after = traffic(ctx)?;
    Ok(format!(
        "\"{}\" \"{loaded}\" after {after}",
        lines.join("\" \"")
    ))
}
