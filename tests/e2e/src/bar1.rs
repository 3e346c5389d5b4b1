// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The BAR1 guard (`bar1_limit_pct`): a pin that would take a GPU's BAR1
//! use past the limit is refused with `ENOMEM` and a line; the same memory
//! pinned again (registered on another HCA) costs nothing more; concurrent
//! registrations racing for the last bytes never pass the limit; the same
//! with `path_accounting=0`.

use crate::{
    dev::{Alloc, Core},
    hostile::LogMark,
    module,
    scenarios::{errno_name, stat},
    uapi::PMC_REG_INVAL_SUPP,
    Ctx,
};

const M: u64 = 1 << 20;
const PCT: &str = "/sys/module/nvidia_peermem/parameters/bar1_limit_pct";

macro_rules! ensure {
    ($c:expr, $($fmt:tt)*) => {
        if !$c {
            return Err(format!($($fmt)*));
        }
    };
}

/// `key` of the `stats/gpus` line of the GPU whose BAR is `size` bytes.
fn gpu_stat(size: u64, key: &str) -> Result<u64, String> {
    let text = crate::module::view("gpus")?;
    let line = text
        .lines()
        .find(|l| l.contains(&format!(" bar1_size={size} ")))
        .ok_or_else(|| format!("no GPU of a {size}-byte BAR in stats/gpus: {text}"))?;
    line.split(' ')
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("no {key} in {line}"))
}

/// Registers `len` bytes of `a` at `off`; the handle, or the errno.
fn reg(ctx: &Ctx, a: &Alloc, off: u64, len: u64) -> Result<u64, i32> {
    ctx.core.reg(a.va + off, len, PMC_REG_INVAL_SUPP)
}

/// Registers 4 MiB chunks of `b` from eight threads at once (each with its
/// own file of the core, returned to keep its MR): the outcomes.
fn race(b: &Alloc) -> Vec<(Option<Core>, Result<u64, i32>)> {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..8u64)
            .map(|i| {
                let va = b.va + i * 4 * M;
                s.spawn(move || match Core::open() {
                    Ok(c) => {
                        let r = c.reg(va, 4 * M, PMC_REG_INVAL_SUPP);
                        (Some(c), r)
                    }
                    Err(_) => (None, Err(-1)),
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or((None, Err(-1))))
            .collect()
    })
}

/// One GPU (the last, smallest) with the limit at half its BAR: a buffer
/// registered three times (as on three HCAs) counts once; a registration
/// past the limit is refused with ENOMEM and a line; eight threads racing
/// for what is left get exactly what fits. Returns the refusal line.
fn at_limit(ctx: &mut Ctx) -> Result<String, String> {
    let info = ctx.gpu().info();
    let gpu = info.gpus - 1;
    let size = info.bar_size[gpu as usize];
    let limit = size / 100 * 50;
    let base = 48 * M;
    std::fs::write(PCT, "50").map_err(|e| format!("{PCT}: {e}"))?;
    // Not listed before the module saw the GPU.
    ensure!(
        gpu_stat(size, "bar1_used").unwrap_or(0) == 0,
        "BAR1 in use before"
    );
    let a = ctx.gpu().alloc(gpu, base).map_err(errno_name)?;
    for _ in 0..3 {
        reg(ctx, &a, 0, base).map_err(|e| format!("multi-rail registration: {}", errno_name(e)))?;
    }
    let used = gpu_stat(size, "bar1_used")?;
    ensure!(used == base, "3 rails of one {base}-byte buffer use {used}");
    let (refused0, fails0) = (gpu_stat(size, "bar1_refused")?, stat("fail_bar1"));
    let mark = LogMark::new();
    let b = ctx.gpu().alloc(gpu, 32 * M).map_err(errno_name)?;
    match reg(ctx, &b, 0, 17 * M) {
        Err(libc::ENOMEM) => (),
        r => return Err(format!("past the limit: {r:?}, expected ENOMEM")),
    }
    let line = mark
        .since()
        .into_iter()
        .find(|l| l.contains("errno=ENOMEM") && l.contains("bar1_limit_pct=50"))
        .ok_or("no refusal line")?;
    ensure!(
        gpu_stat(size, "bar1_refused")? == refused0 + 1 && stat("fail_bar1") == fails0 + 1,
        "refusal not counted"
    );
    ensure!(
        gpu_stat(size, "bar1_used")? == base,
        "a refused pin left BAR1 use"
    );
    let outcomes = race(&b);
    let ok = outcomes.iter().filter(|o| o.1.is_ok()).count() as u64;
    let nomem = outcomes.iter().filter(|o| o.1 == Err(libc::ENOMEM)).count() as u64;
    let want = (limit - base) / (4 * M);
    ensure!(
        ok == want && nomem == 8 - want,
        "race for {} bytes: {ok} taken, {nomem} ENOMEM, want {want} taken",
        limit - base
    );
    let used = gpu_stat(size, "bar1_used")?;
    ensure!(
        used == base + want * 4 * M && used <= limit,
        "after the race: BAR1 use {used}, limit {limit}"
    );
    drop(outcomes);
    Ok(format!(
        "{line} | race: {ok} of 8 taken, BAR1 use {used} of limit {limit}"
    ))
}

/// The BAR1 guard, with path accounting and without.
pub(crate) fn bar1_guard(ctx: &mut Ctx) -> Result<String, String> {
    let r = at_limit(ctx);
    let _ = std::fs::write(PCT, "80");
    let with = r?;
    ctx.core = Core::open()?;
    let info = ctx.gpu().info();
    let size = info.bar_size[info.gpus as usize - 1];
    ensure!(
        gpu_stat(size, "bar1_used").unwrap_or(0) == 0,
        "BAR1 use left after the deregistrations"
    );
    ctx.unload()?;
    let mut params = ctx.mode.params();
    params.push("path_accounting=0");
    module::insmod(&ctx.opts.peermem, &params)?;
    let r = at_limit(ctx);
    let _ = std::fs::write(PCT, "80");
    ctx.core = Core::open()?;
    ctx.unload()?;
    ctx.load()?;
    let without = r?;
    Ok(format!(
        "path_accounting=1: {with}; path_accounting=0: {without}"
    ))
}
