// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Late binding: the module loads before the peer-memory core and the GPU
//! driver, says what it waits for, binds each when it goes live, registers
//! once both are bound, and refuses a GPU driver whose version it does not
//! know (the run-time check that replaces the symbol CRCs).

use std::path::Path;

use crate::{
    dev::{Core, Gpu},
    hostile::LogMark,
    module,
    scenarios::{errno_name, reg_verify},
    uapi::PMC_REG_INVAL_SUPP,
    Ctx,
};

const WAITING: &str = "/sys/module/nvidia_peermem/stats/waiting_for";
const MAP_STYLE: &str = "/sys/kernel/debug/nv_p2p_emu/dma_map_style";

macro_rules! ensure {
    ($c:expr, $($fmt:tt)*) => {
        if !$c {
            return Err(format!($($fmt)*));
        }
    };
}

/// What `stats/waiting_for` says.
fn waiting() -> String {
    std::fs::read_to_string(WAITING)
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|e| format!("({WAITING}: {e})"))
}

/// The first line since `mark` from nvidia_peermem that contains `what`.
fn logged(mark: &LogMark, what: &str) -> Result<String, String> {
    mark.since()
        .into_iter()
        .find(|l| l.contains("nvidia_peermem: ") && l.contains(what))
        .ok_or_else(|| format!("no log line with \"{what}\""))
}

/// The harness's core module, beside the GPU driver's.
fn core_ko(ctx: &Ctx) -> String {
    Path::new(&ctx.opts.emu)
        .with_file_name("peer_mem_core.ko")
        .to_string_lossy()
        .into_owned()
}

/// Runs `f` with the module under test, the core and the GPU driver
/// unloaded (their files closed), and the GPU driver's DMA mapping style;
/// on a failure, loads what is missing again so that the next scenarios
/// run (the runner reloads the module under test).
fn unloaded(
    ctx: &mut Ctx,
    f: fn(&mut Ctx, &str) -> Result<String, String>,
) -> Result<String, String> {
    ctx.unload()?;
    let style = std::fs::read_to_string(MAP_STYLE).map_err(|e| format!("{MAP_STYLE}: {e}"))?;
    let style = style.trim().to_string();
    ctx.gpu = None;
    ctx.core = Core::placeholder()?;
    let r = ["peer_mem_core", "nv_p2p_emu"]
        .into_iter()
        .try_for_each(|m| match module::rmmod(m)? {
            true => Ok(()),
            false => Err(format!("rmmod {m} refused")),
        })
        .and_then(|()| f(ctx, &style));
    if r.is_err() {
        let _ = module::rmmod("nvidia_peermem");
        if !module::loaded("nv_p2p_emu") {
            let _ = load_gpu_driver(ctx, &[], &style);
        }
        if !module::loaded("peer_mem_core") {
            let _ = load_core(ctx);
        }
    }
    r
}

/// Loads the GPU driver with `args`, its mapping style `style`.
fn load_gpu_driver(ctx: &Ctx, args: &[&str], style: &str) -> Result<(), String> {
    module::insmod(&ctx.opts.emu, args)?;
    module::debugfs_write(MAP_STYLE, style)
}

/// Loads the core in the variant of the mode, with `args`.
fn load_core_with(ctx: &Ctx, args: &[&str]) -> Result<(), String> {
    let variant = format!("variant={}", ctx.mode.core_variant());
    let mut all = vec![variant.as_str()];
    all.extend(args);
    module::insmod(&core_ko(ctx), &all)
}

/// Loads the core in the variant of the mode.
fn load_core(ctx: &Ctx) -> Result<(), String> {
    load_core_with(ctx, &[])
}

/// Opens both again, settles the module, and moves bytes through an MR
/// (and, where the mode has `nv_mem_nc`, a umem) on each GPU.
fn traffic(ctx: &mut Ctx) -> Result<String, String> {
    ctx.gpu = Some(Gpu::open()?);
    ctx.core = Core::open()?;
    ctx.settle()?;
    let mut out = Vec::new();
    for gpu in 0..ctx.gpu().info().gpus {
        let a = ctx
            .gpu()
            .alloc(gpu, 2 << 20)
            .map_err(|e| format!("alloc on GPU {gpu}: {}", errno_name(e)))?;
        for flags in [PMC_REG_INVAL_SUPP, 0] {
            let q = reg_verify(ctx, &a, 0x1000, (1 << 20) + 5, flags)?;
            out.push(format!("gpu{gpu}:{}sge", q.nmap));
        }
    }
    Ok(out.join(" "))
}

/// The module loaded before both, the one that arrives first bound and held
/// (its rmmod refused), the clients registered when the second arrives,
/// then traffic. The GPU driver arrives first in the persistent and legacy
/// modes, the core first in the others.
pub(crate) fn late_binding(ctx: &mut Ctx) -> Result<String, String> {
    unloaded(ctx, late_binding_run)
}

fn late_binding_run(ctx: &mut Ctx, style: &str) -> Result<String, String> {
    let mark = LogMark::new();
    module::insmod(&ctx.opts.peermem, &ctx.mode.params())
        .map_err(|e| format!("load before the core and the GPU driver: {e}"))?;
    ensure!(waiting() == "core,gpu-driver", "waiting_for: {}", waiting());
    let first = logged(&mark, "waiting for the peer-memory core")?;
    ensure!(
        first.contains("and the GPU driver") && first.contains(" loaded, waiting for "),
        "load line: {first}"
    );
    ensure!(
        module::peer_stat("nv_mem", "version").is_none(),
        "nv_mem registered before the core and the GPU driver were loaded"
    );
    let gpu_first = !matches!(ctx.mode, crate::Mode::Invalidating | crate::Mode::Ofed4);
    let (held, want) = if gpu_first {
        load_gpu_driver(ctx, &[], style)?;
        ("nv_p2p_emu", "core")
    } else {
        load_core(ctx)?;
        ("peer_mem_core", "gpu-driver")
    };
    ensure!(waiting() == want, "after {held}: waiting_for {}", waiting());
    let bound = logged(&mark, &format!("bound to module {held}; waiting for "))?;
    ensure!(
        !module::rmmod(held)?,
        "rmmod {held} allowed while bound to it"
    );
    if gpu_first {
        load_core(ctx)?;
    } else {
        load_gpu_driver(ctx, &[], style)?;
    }
    ensure!(
        waiting() == "nothing",
        "after both: waiting_for {}",
        waiting()
    );
    let registered = logged(&mark, "registered with the peer-memory core: nv_mem")?;
    let v = module::peer_stat("nv_mem", "version");
    ensure!(
        v.is_some(),
        "memory_peers/nv_mem/version missing after both arrived"
    );
    let moved = traffic(ctx)?;
    Ok(format!("\"{first}\" \"{bound}\" \"{registered}\" {moved}"))
}

/// A GPU driver whose `version=` the module does not know (older than R470,
/// or none) is refused with one line and not held; the module binds the
/// next one that passes.
pub(crate) fn late_binding_driver_check(ctx: &mut Ctx) -> Result<String, String> {
    unloaded(ctx, driver_check_run)
}

fn driver_check_run(ctx: &mut Ctx, style: &str) -> Result<String, String> {
    load_core(ctx)?;
    let mut lines = Vec::new();
    for (i, bad) in ["460.91.03", "none"].into_iter().enumerate() {
        let mark = LogMark::new();
        load_gpu_driver(ctx, &[&format!("driver_version={bad}")], style)?;
        if i == 0 {
            module::insmod(&ctx.opts.peermem, &ctx.mode.params())?;
        }
        let shown = if bad == "none" { "" } else { bad };
        lines.push(logged(
            &mark,
            &format!("refused the GPU driver in module nv_p2p_emu: version '{shown}'"),
        )?);
        ensure!(
            waiting() == "gpu-driver",
            "{bad}: waiting_for {}",
            waiting()
        );
        ensure!(
            module::peer_stat("nv_mem", "version").is_none(),
            "{bad}: nv_mem registered"
        );
        ensure!(
            module::rmmod("nv_p2p_emu")?,
            "{bad}: the refused driver is held"
        );
    }
    let mark = LogMark::new();
    load_gpu_driver(ctx, &[], style)?;
    ensure!(
        waiting() == "nothing",
        "after 550: waiting_for {}",
        waiting()
    );
    lines.push(logged(
        &mark,
        "registered with the peer-memory core: nv_mem",
    )?);
    let moved = traffic(ctx)?;
    Ok(format!("\"{}\" {moved}", lines.join("\" \"")))
}

/// A core that takes the invalidating client without writing its
/// invalidate hook (it could never revoke) is refused: arriving late, the
/// clients are unregistered and `waiting_for` says `core-refused`; present at
/// load, the load fails with `EPROTO`; once the core writes its hook, the
/// module registers.
pub(crate) fn late_binding_core_check(ctx: &mut Ctx) -> Result<String, String> {
    unloaded(ctx, core_check_run)
}

fn core_check_run(ctx: &mut Ctx, style: &str) -> Result<String, String> {
    const NO_HOOK: &str = "/sys/module/peer_mem_core/parameters/no_invalidate_hook";
    const REFUSED: &str = "registered the invalidating client without an invalidate hook: refused";
    load_gpu_driver(ctx, &[], style)?;
    let mark = LogMark::new();
    module::insmod(&ctx.opts.peermem, &ctx.mode.params())?;
    load_core_with(ctx, &["no_invalidate_hook=1"])?;
    let late = logged(&mark, REFUSED)?;
    logged(
        &mark,
        "bound to module peer_mem_core, but registering the clients failed",
    )?;
    ensure!(
        waiting() == "core-refused",
        "late: waiting_for {}",
        waiting()
    );
    ensure!(
        module::peer_stat("nv_mem", "version").is_none(),
        "late: nv_mem left registered"
    );
    ensure!(
        module::rmmod("nvidia_peermem")?,
        "rmmod nvidia_peermem refused"
    );
    let mark = LogMark::new();
    match module::insmod(&ctx.opts.peermem, &ctx.mode.params()) {
        Ok(()) => return Err("loaded on a core that wrote no invalidate hook".into()),
        Err(e) => ensure!(e.contains("Protocol error"), "load: {e}, expected EPROTO"),
    }
    let at_load = logged(&mark, REFUSED)?;
    module::debugfs_write(NO_HOOK, "0")?;
    let mark = LogMark::new();
    module::insmod(&ctx.opts.peermem, &ctx.mode.params())?;
    let registered = logged(&mark, "loaded: nv_mem")?;
    ensure!(waiting() == "nothing", "waiting_for {}", waiting());
    let moved = traffic(ctx)?;
    Ok(format!("\"{late}\" \"{at_load}\" \"{registered}\" {moved}"))
}

/// Where the boots that carry it put the operator tool.
pub(crate) const STAT: &str = "/bin/peermem-stat";

/// `peermem-stat doctor --json`: its findings as "id: problem" lines.
fn doctor() -> Result<Vec<String>, String> {
    let out = std::process::Command::new(STAT)
        .args(["doctor", "--json"])
        .output()
        .map_err(|e| format!("{STAT}: {e}"))?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("doctor --json ({}): {e}", out.status))?;
    let found = v["findings"].as_array().cloned().unwrap_or_default();
    Ok(found
        .iter()
        .map(|f| format!("{}: {}", f["id"].as_str().unwrap_or("?"), f["problem"]))
        .collect())
}

/// `doctor` names `want` (a finding id, and words of its problem) and no
/// finding about the core.
fn doctor_says(when: &str, id: &str, words: &str) -> Result<String, String> {
    let found = doctor()?;
    ensure!(
        found.len() == 1 && found[0].starts_with(&format!("{id}: ")) && found[0].contains(words),
        "{when}: doctor found {found:?}, expected {id} with \"{words}\""
    );
    ensure!(
        !found[0].contains("core is not loaded") && !found[0].contains("core not loaded"),
        "{when}: doctor blames the core: {}",
        found[0]
    );
    Ok(found[0].clone())
}

/// The new user's sequence of issue 41: the module loaded before the core
/// (it waits for it), the core loaded, the module and the GPU driver
/// unloaded, the module loaded again: `peermem-stat doctor` names the GPU
/// driver (not loaded, then waited for), never the core.
pub(crate) fn late_binding_doctor(ctx: &mut Ctx) -> Result<String, String> {
    unloaded(ctx, doctor_run)
}

/// `waiting_for` says `want`, and doctor finds nothing when it is `nothing`.
fn waits(when: &str, want: &str) -> Result<(), String> {
    ensure!(waiting() == want, "{when}: waiting_for {}", waiting());
    let found = if want == "nothing" {
        doctor()?
    } else {
        Vec::new()
    };
    ensure!(found.is_empty(), "{when}: doctor found {found:?}");
    Ok(())
}

fn doctor_run(ctx: &mut Ctx, style: &str) -> Result<String, String> {
    load_gpu_driver(ctx, &[], style)?;
    module::insmod(&ctx.opts.peermem, &ctx.mode.params())?;
    let core = "waits for the peer-memory core";
    let mut seen = vec![doctor_says("before the core", "waiting-for-core", core)?];
    load_core(ctx)?;
    waits("after the core", "nothing")?;
    for m in ["nvidia_peermem", "nv_p2p_emu"] {
        ensure!(module::rmmod(m)?, "rmmod {m} refused");
    }
    let now = "now the peer-memory core loaded (module peer_mem_core), the GPU driver not loaded";
    seen.push(doctor_says("unloaded", "not-loaded", now)?);
    module::insmod(&ctx.opts.peermem, &ctx.mode.params())?;
    waits("again", "gpu-driver")?;
    let gpu = "waits for the GPU driver";
    seen.push(doctor_says("again", "waiting-for-gpu-driver", gpu)?);
    load_gpu_driver(ctx, &[], style)?;
    waits("the GPU driver again", "nothing")?;
    let moved = traffic(ctx)?;
    Ok(format!("doctor: {} | then ok; {moved}", seen.join(" | ")))
}
