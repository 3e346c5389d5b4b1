// SPDX-License-Identifier: GPL-2.0 OR MIT

//! End-to-end scenarios of nvidia_peermem, run inside the QEMU guest of the
//! testbed: emulated GPUs (nv_p2p_emu), emulated peer-memory core and HCA
//! (peer_mem_core). Every scenario asserts bytes moved by the device, states,
//! errnos and counters.
//!
//! Output: `E2E ok <mode>/<scenario> ...` or `E2E FAIL <mode>/<scenario>: why`,
//! then `E2E-SUMMARY: N passed, M failed`.

mod bar1;
mod bench;
mod demo;
mod dev;
mod drain;
mod hostile;
mod late;
mod module;
mod node;
mod paths;
mod pgsz;
mod profile;
mod scenarios;
mod statcheck;
mod stress;
mod uapi;

use std::time::Instant;

use dev::{Core, Gpu};

/// How the module under test is loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// persistent_api_support=1: one persistent client nv_mem.
    Persistent,
    /// persistent_api_support=0: nv_mem invalidating (extended), nv_mem_nc.
    Invalidating,
    /// persistent_api_support=0 peerdirect_support=1: legacy core flow.
    Legacy,
    /// As `Legacy`, on a core like OFED 4.x (the peer_mem_core `variant=1`):
    /// the HCA driver deregisters the MR inside the free callback.
    Ofed4,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Persistent => "persistent",
            Mode::Invalidating => "invalidating",
            Mode::Legacy => "legacy",
            Mode::Ofed4 => "ofed4",
        }
    }

    pub(crate) fn params(self) -> Vec<&'static str> {
        match self {
            Mode::Persistent => vec!["persistent_api_support=1"],
            Mode::Invalidating => vec!["persistent_api_support=0"],
            Mode::Legacy | Mode::Ofed4 => {
                vec!["persistent_api_support=0", "peerdirect_support=1"]
            }
        }
    }

    /// Whether an MR (IB_PEER_MEM_INVAL_SUPP) is backed by an invalidating pin.
    pub fn invalidating(self) -> bool {
        self != Mode::Persistent
    }

    /// Whether the client is the legacy one (the core unmaps it from inside
    /// its invalidate).
    pub fn legacy(self) -> bool {
        matches!(self, Mode::Legacy | Mode::Ofed4)
    }

    /// The peer_mem_core variant this mode runs on.
    pub(crate) fn core_variant(self) -> &'static str {
        if self == Mode::Ofed4 {
            "1"
        } else {
            "0"
        }
    }
}

/// Paths and options from the command line.
pub struct Opts {
    pub peermem: String,
    pub emu: String,
    pub reference: bool,
    pub quick: bool,
    pub filter: Option<String>,
    /// Operations of the stress run per mode (0: none).
    pub stress_ops: u64,
    /// Seconds of `hostile_caller_fuzz` per mode (`make test` 5, `make soak`
    /// longer).
    pub fuzz_secs: u64,
}

/// What a scenario works with.
pub struct Ctx {
    pub mode: Mode,
    pub opts: Opts,
    pub gpu: Option<Gpu>,
    pub core: Core,
    pub seed: u64,
    /// The emulated driver's count of stale unpins when the scenario began.
    pub stale_puts: u64,
    emu_args: Vec<String>,
}

impl Ctx {
    pub fn gpu(&self) -> &Gpu {
        self.gpu.as_ref().expect("GPU driver open")
    }

    /// A pseudo-random number (xorshift; the seed is printed at start).
    pub fn rand(&mut self) -> u64 {
        let mut x = self.seed;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.seed = x;
        x
    }

    pub fn load(&self) -> Result<(), String> {
        self.load_unsettled()?;
        self.settle()
    }

    /// Loads the module under test without [`Ctx::settle`]: the next
    /// registrations on each GPU are its first.
    pub fn load_unsettled(&self) -> Result<(), String> {
        module::debugfs_write(
            "/sys/module/peer_mem_core/parameters/variant",
            self.mode.core_variant(),
        )?;
        module::insmod(&self.opts.peermem, &self.mode.params())
    }

    /// The first invalidating registration on a GPU after a load that has
    /// an RDMA peer to ask about (the HCA, once it was a registration's
    /// `dma_device`) asks the GPU driver's topology gate with a persistent
    /// pin of its own (`topology_probes`): one registration to make the HCA
    /// a peer, then one per GPU here, so that each scenario counts only its
    /// own pins. `topology_gate` and `driver_verdicts` check the probe.
    pub(crate) fn settle(&self) -> Result<(), String> {
        let Some(g) = self.gpu.as_ref() else {
            return Ok(());
        };
        if self.opts.reference || !self.mode.invalidating() {
            return Ok(());
        }
        let gpus = g.info().gpus;
        for i in std::iter::once(0).chain(0..gpus) {
            let a = g
                .alloc(i, 1 << 16)
                .map_err(|e| format!("settle: alloc on GPU {i}: {e}"))?;
            let h = match self.core.reg(a.va, 1 << 16, uapi::PMC_REG_INVAL_SUPP) {
                Ok(h) => h,
                // A provider loaded to be refused (say, an unknown page-table
                // version): nothing is pinned to settle.
                Err(_) if !self.provider_is_default() => return Ok(()),
                Err(e) => return Err(format!("settle: registration on GPU {i}: {e}")),
            };
            self.core.dereg(h).map_err(|e| format!("settle: {e}"))?;
        }
        // Coherent memory has no gate to ask about; under MIG the probe's
        // persistent pin is refused (the verdict is then final, unasked).
        let unasked = self
            .emu_args
            .iter()
            .any(|a| a == "coherent=1" || a == "mig=1");
        let (probes, want) = (
            scenarios::stat("topology_probes"),
            gpus * u64::from(!unasked),
        );
        if probes != want {
            return Err(format!(
                "settle: {probes} topology probes for {gpus} GPUs, want {want}"
            ));
        }
        Ok(())
    }

    pub fn unload(&self) -> Result<(), String> {
        // A free callback's last reference is dropped by the module's own
        // queue, a moment after the callback returned.
        let t = Instant::now();
        while !module::rmmod("nvidia_peermem")? {
            if t.elapsed() > std::time::Duration::from_secs(2) {
                return Err("rmmod nvidia_peermem refused".into());
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        Ok(())
    }

    /// Reloads the emulated GPU driver with `args` (module under test too).
    pub fn reload_provider(&mut self, args: &[&str]) -> Result<(), String> {
        self.unload()?;
        // The new driver counts stale uses from 0: those of this scenario so
        // far are judged here, against the old driver's count.
        let stale = self
            .gpu
            .as_ref()
            .map_or(0, |g| g.info().stale_puts.saturating_sub(self.stale_puts));
        self.stale_puts = 0;
        self.gpu = None;
        if !module::rmmod("nv_p2p_emu")? {
            return Err("rmmod nv_p2p_emu refused".into());
        }
        module::insmod(&self.opts.emu, args)?;
        self.emu_args = args.iter().map(|s| s.to_string()).collect();
        self.gpu = Some(Gpu::open()?);
        self.load()?;
        match stale {
            0 => Ok(()),
            n => Err(format!(
                "HARNESS FAILURE: {n} uses of page tables the GPU driver had freed"
            )),
        }
    }

    pub fn provider_is_default(&self) -> bool {
        self.emu_args.is_empty()
    }
}

/// The guest kernel's page size (4 KiB on x86-64, 4, 16 or 64 KiB on arm64):
/// the core trims an MR's SG entries to it.
pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(n).unwrap_or(4096)
}

/// Exits with a bench subcommand's outcome (`BENCH-FAIL why` on failure).
fn exit_bench(r: Result<(), String>) -> ! {
    match r {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            println!("BENCH-FAIL {e}");
            std::process::exit(1);
        }
    }
}

fn main() {
    match std::env::args().nth(1).as_deref() {
        Some("demo") => std::process::exit(if demo::run() { 0 } else { 1 }),
        Some("child-hold") => stress::child_hold(),
        Some("stat-check") => {
            // stat-check <path-to-peermem-stat>
            let a: Vec<String> = std::env::args().skip(2).collect();
            std::process::exit(statcheck::main(&a));
        }
        Some("paths") => {
            // paths <expect-file> [--policy N]
            let a: Vec<String> = std::env::args().skip(2).collect();
            std::process::exit(paths::run(&a));
        }
        Some("profile") => {
            // profile <module> <impl> <key> [registrations] [trace]
            let a: Vec<String> = std::env::args().skip(2).collect();
            std::process::exit(profile::run(&a));
        }
        Some("loop") => {
            // loop <bytes> <count> <invalidating|persistent>: registrations
            // and nothing else, for `make bench`'s profile.
            let a: Vec<String> = std::env::args().skip(2).collect();
            let n = |i: usize| a.get(i).and_then(|s| s.parse().ok()).unwrap_or(0);
            match bench::register_loop(n(0), n(1), a.get(2).map_or("invalidating", |s| s)) {
                Ok(()) => std::process::exit(0),
                Err(e) => {
                    println!("BENCH-FAIL {e}");
                    std::process::exit(1);
                }
            }
        }
        Some("bench-block") => {
            // bench-block <impl>: one block of the interleaved measurement.
            let imp = std::env::args().nth(2).unwrap_or_else(|| "ours".into());
            match bench::run_block(&imp) {
                Ok(()) => std::process::exit(0),
                Err(e) => {
                    println!("BENCH-FAIL {e}");
                    std::process::exit(1);
                }
            }
        }
        Some("bench-tpt") => {
            // bench-tpt <impl>: translation entries per registration.
            let imp = std::env::args().nth(2).unwrap_or_else(|| "ours".into());
            exit_bench(node::run_tpt(&imp));
        }
        Some("bench-scale") => {
            // bench-scale <impl> <live counts, comma-separated, ascending>
            let imp = std::env::args().nth(2).unwrap_or_else(|| "ours".into());
            let counts: Vec<u64> = std::env::args()
                .nth(3)
                .map(|s| s.split(',').filter_map(|n| n.parse().ok()).collect())
                .unwrap_or_default();
            exit_bench(node::run_scale(&imp, &counts));
        }
        Some("bench") => {
            // bench <impl> <cost> <live counts, comma-separated>
            let a: Vec<String> = std::env::args().skip(2).collect();
            let live: Vec<u64> = a
                .get(2)
                .map(|s| s.split(',').filter_map(|n| n.parse().ok()).collect())
                .unwrap_or_default();
            match bench::run(
                a.first().map_or("ours", |s| s),
                a.get(1).map_or("zero", |s| s),
                &live,
            ) {
                Ok(()) => std::process::exit(0),
                Err(e) => {
                    println!("BENCH-FAIL {e}");
                    std::process::exit(1);
                }
            }
        }
        _ => {}
    }
    let mut args = std::env::args().skip(1);
    let mut modes = vec![
        Mode::Persistent,
        Mode::Invalidating,
        Mode::Legacy,
        Mode::Ofed4,
    ];
    let mut opts = Opts {
        peermem: "/lib/peermem/nvidia_peermem.ko".into(),
        emu: "/lib/peermem/nv_p2p_emu.ko".into(),
        reference: false,
        quick: false,
        filter: None,
        stress_ops: 0,
        fuzz_secs: 5,
    };
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--modes" => {
                modes = args
                    .next()
                    .unwrap_or_default()
                    .split(',')
                    .map(|m| match m {
                        "persistent" => Mode::Persistent,
                        "invalidating" => Mode::Invalidating,
                        "legacy" => Mode::Legacy,
                        "ofed4" => Mode::Ofed4,
                        _ => panic!("unknown mode {m}"),
                    })
                    .collect()
            }
            "--module" => opts.peermem = args.next().unwrap_or_default(),
            "--emu" => opts.emu = args.next().unwrap_or_default(),
            "--reference" => opts.reference = true,
            "--quick" => opts.quick = true,
            "--filter" => opts.filter = args.next(),
            "--stress" => opts.stress_ops = args.next().and_then(|s| s.parse().ok()).unwrap_or(0),
            "--fuzz-secs" => opts.fuzz_secs = args.next().and_then(|s| s.parse().ok()).unwrap_or(5),
            "--seed" => seed = args.next().and_then(|s| s.parse().ok()).unwrap_or(seed),
            _ => panic!("unknown argument {a}"),
        }
    }
    println!("E2E seed {seed}");
    let (mut passed, mut failed) = (0u32, 0u32);
    let gpu = match Gpu::open() {
        Ok(g) => g,
        Err(e) => {
            println!("E2E FAIL setup: {e}");
            println!("E2E-SUMMARY: 0 passed, 1 failed");
            return;
        }
    };
    let core = Core::open().expect("peer_mem_core");
    let mut ctx = Ctx {
        mode: modes[0],
        opts,
        gpu: Some(gpu),
        core,
        seed,
        stale_puts: 0,
        emu_args: Vec::new(),
    };
    for mode in modes {
        ctx.mode = mode;
        if let Err(e) = ctx.load() {
            println!("E2E FAIL {}/load: {e}", mode.name());
            failed += 1;
            continue;
        }
        for s in scenarios::ALL {
            if let Some(f) = &ctx.opts.filter {
                if !f.split(',').any(|f| s.name.contains(f)) {
                    continue;
                }
            }
            if !(s.applies)(&ctx) {
                continue;
            }
            ctx.stale_puts = ctx.gpu.as_ref().map_or(0, |g| g.info().stale_puts);
            // A mark in the kernel log, so that a report there can be told
            // to its scenario.
            let _ = std::fs::write(
                "/dev/kmsg",
                format!("E2E start {}/{}\n", mode.name(), s.name),
            );
            let t = Instant::now();
            let r = (s.run)(&mut ctx).and_then(|detail| scenarios::quiescent(&ctx).map(|_| detail));
            let ms = t.elapsed().as_millis();
            match r {
                Ok(detail) => {
                    passed += 1;
                    println!("E2E ok {}/{} ({ms} ms) {detail}", mode.name(), s.name);
                }
                Err(e) => {
                    failed += 1;
                    println!("E2E FAIL {}/{}: {e}", mode.name(), s.name);
                    if e.starts_with("DEADLOCK") {
                        // Threads are stuck in the kernel holding the GPU
                        // driver's lock: nothing else can run. Report and go.
                        println!("E2E-SUMMARY: {passed} passed, {failed} failed");
                        use std::io::Write;
                        let _ = std::io::stdout().flush();
                        // SAFETY: leaving without unwinding; stuck threads
                        // cannot be joined.
                        unsafe { libc::_exit(1) };
                    }
                    // Start the next scenario clean: closing the core's file
                    // deregisters whatever this one left behind.
                    match Core::open() {
                        Ok(c) => ctx.core = c,
                        Err(e) => println!("E2E FAIL {}/reopen: {e}", mode.name()),
                    }
                    // Allocations never mapped go with the GPU driver's file.
                    ctx.gpu = None;
                    match Gpu::open() {
                        Ok(g) => ctx.gpu = Some(g),
                        Err(e) => println!("E2E FAIL {}/reopen: {e}", mode.name()),
                    }
                }
            }
            if !module::loaded("nvidia_peermem") {
                if let Err(e) = ctx.load() {
                    println!("E2E FAIL {}/reload: {e}", mode.name());
                    failed += 1;
                }
            }
            if !ctx.provider_is_default() {
                // The scenario is judged: its stale uses are not the reload's.
                ctx.stale_puts = ctx.gpu.as_ref().map_or(0, |g| g.info().stale_puts);
                if let Err(e) = ctx.reload_provider(&[]) {
                    println!("E2E FAIL {}/provider-reload: {e}", mode.name());
                    failed += 1;
                }
            }
        }
        if ctx.opts.stress_ops > 0 {
            // On a module just loaded: the threads' first registrations on
            // each GPU race to learn its topology verdicts.
            let r = ctx
                .unload()
                .and_then(|()| ctx.load_unsettled())
                .and_then(|()| {
                    stress::run(mode, ctx.opts.stress_ops, 4, ctx.seed, !ctx.opts.reference)
                })
                .and_then(|d| scenarios::quiescent(&ctx).map(|_| d));
            match r {
                Ok(d) => {
                    passed += 1;
                    println!("E2E ok {}/stress {d}", mode.name());
                }
                Err(e) => {
                    failed += 1;
                    println!("E2E FAIL {}/stress: {e}", mode.name());
                    if let Ok(c) = Core::open() {
                        ctx.core = c;
                    }
                }
            }
        }
        match ctx.unload() {
            Ok(()) => passed += 1,
            Err(e) => {
                println!("E2E FAIL {}/unload: {e}", mode.name());
                failed += 1;
            }
        }
    }
    println!("E2E-SUMMARY: {passed} passed, {failed} failed");
}
