// SPDX-License-Identifier: GPL-2.0 OR MIT

//! `peermem-stat doctor`: the known failure modes (the README's
//! "Troubleshooting by symptom") found on this node, one line each with what
//! to do. Judged on the live state (is the module loaded, what it waits for,
//! which modules export the core's and the GPU driver's entry points) and,
//! while the module is not loaded, the latest load attempt in the kernel log
//! (`attempts`): an earlier failure is history, not a finding.

use std::{
    fs,
    io::{self, Read, Write},
    os::unix::fs::OpenOptionsExt,
    path::Path,
};

use serde::Serialize;

use crate::{
    attempts::{self, Attempt, Kind},
    diag,
    snapshot::Snapshot,
    sysfs::{Sys, MODULE_DIR, PEERS_DIR},
};

pub const KMSG: &str = "/dev/kmsg";
const NV_MEM: &str = "/sys/kernel/mm/memory_peers/nv_mem";
/// What a loaded peermem-rs waits for before its clients register (late
/// binding): `nothing`, `core`, `gpu-driver`, `core,gpu-driver`, or
/// `core-refused`.
const WAITING_FOR: &str = "/sys/module/nvidia_peermem/stats/waiting_for";
const LOAD_CORE: &str = "load the peer-memory core (modprobe ib_uverbs, which loads ib_core; MLNX_OFED or \
     DOCA-OFED: /etc/init.d/openibd start): nvidia_peermem binds it and registers by itself when it goes \
     live; if the core has no peer-memory API (upstream or Debian kernel without OFED), install MLNX_OFED \
     or DOCA-OFED, use an Ubuntu kernel, or use dma-buf";
const LOAD_GPU: &str = "load the GPU driver (modprobe nvidia): nvidia_peermem binds it by itself when it goes \
     live; a driver it refused is named in the kernel log (\"refused the GPU driver\": R470 or later)";
const LOAD_BOTH: &str = "load the GPU driver (modprobe nvidia) and the peer-memory core (modprobe ib_uverbs; \
     MLNX_OFED or DOCA-OFED: /etc/init.d/openibd start): nvidia_peermem binds each and registers by itself \
     when both are live; the kernel log names a module it refused";
/// The kernel's lockdown state ("none [integrity] confidentiality").
const LOCKDOWN: &str = "/sys/kernel/security/lockdown";
/// Y when module signatures are enforced (module.sig_enforce=1).
const SIG_ENFORCE: &str = "/sys/module/module/parameters/sig_enforce";

/// What to do once a module is refused for its signature: the key DKMS signs
/// with (the distribution's own: Debian's dkms keeps it in /var/lib/dkms,
/// Ubuntu's in /var/lib/shim-signed/mok) enrolled as a Machine Owner Key.
macro_rules! enroll {
    () => {
        "enroll the key DKMS signs with as a Machine Owner Key, once per node: mokutil --import \
         /var/lib/dkms/mok.pub (Debian) or mokutil --import /var/lib/shim-signed/mok/MOK.der \
         (Ubuntu), choose a one-time password, reboot, and in MokManager (blue screen) choose \
         Enroll MOK, Continue, Yes, type the password, Reboot; then modprobe nvidia_peermem \
         (mokutil --test-key <that file> says whether it is enrolled; modinfo -F signer \
         nvidia_peermem names the key the module is signed with)"
    };
}

/// Which modules export which symbols: lines "ADDR T NAME\t[MODULE]".
const KALLSYMS: &str = "/proc/kallsyms";
/// The GPU driver's module.
const NVIDIA: &str = "/sys/module/nvidia";
/// Why an unknown symbol of the core's or the GPU driver's, and the fix.
const NO_CORE: &str =
    "the loaded ib_core has no peer-memory API (upstream or Debian kernel, or OFED not loaded)";
const FIX_CORE: &str = "install MLNX_OFED or DOCA-OFED, or use an Ubuntu kernel, or use dma-buf \
     (ibv_reg_dmabuf_mr) instead";
const NO_GPU: &str = "nvidia.ko is not loaded or not installed";
const FIX_GPU: &str =
    "modprobe nvidia (the softdep does this when the driver is installed), then modprobe nvidia_peermem";
/// Earlier load attempts mentioned as history, at most.
const HISTORY: usize = 3;

/// The kernel log is read up to this size.
const MAX_LOG: usize = 16 << 20;

/// One problem and what to do about it.
#[derive(Debug, Serialize)]
pub struct Finding {
    /// A stable name, e.g. `symbol-version-mismatch`.
    pub id: &'static str,
    pub problem: String,
    pub fix: &'static str,
}

/// `doctor --json`, and the text lines.
#[derive(Debug, Serialize)]
pub struct Report {
    pub ok: bool,
    pub findings: Vec<Finding>,
    /// Checks that could not be made, with why.
    pub not_checked: Vec<String>,
    /// Earlier load attempts in the kernel log, no longer current.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<String>,
}

/// The modules that export the peer-memory core's and the GPU driver's
/// entry points now (None: not loaded).
#[derive(Debug)]
pub struct Live {
    pub core: Option<String>,
    pub gpu: Option<String>,
}

impl Live {
    /// From /proc/kallsyms; without it, the core by its sysfs directory and
    /// the GPU driver by its module's.
    pub fn read(sys: &Sys) -> Self {
        let (mut core, mut gpu) = (None, None);
        // Tens of MB on a distribution kernel, modules last: streamed.
        let syms = fs::File::open(sys.path(KALLSYMS)).map(io::BufReader::new);
        for line in syms.into_iter().flat_map(io::BufRead::lines) {
            let Ok(line) = line else { break };
            let mut f = line.split_whitespace();
            let (name, module) = (f.nth(2), f.next().and_then(|m| m.strip_prefix('[')));
            // No module: built into the kernel.
            let module = Some(
                module
                    .map_or("vmlinux", |m| m.trim_end_matches(']'))
                    .to_string(),
            );
            match name {
                Some("ib_register_peer_memory_client") => core = module,
                Some("nvidia_p2p_get_pages") => gpu = module,
                _ => continue,
            }
        }
        let dir = |abs: &str, what: &str| sys.exists(abs).then(|| what.to_string());
        Live {
            core: core.or_else(|| dir(PEERS_DIR, "ib_core")),
            gpu: gpu.or_else(|| dir(NVIDIA, "nvidia")),
        }
    }

    /// "the peer-memory core loaded (module M), the GPU driver not loaded".
    fn describe(&self) -> String {
        let one = |m: &Option<String>| match m {
            Some(m) => format!("loaded (module {m})"),
            None => "not loaded".to_string(),
        };
        format!(
            "the peer-memory core {}, the GPU driver {}",
            one(&self.core),
            one(&self.gpu)
        )
    }
}

impl Report {
    /// Examines the node under `sys`; `log` replaces /dev/kmsg.
    pub fn new(sys: &Sys, log: Option<&Path>) -> Self {
        let s = Snapshot::read(sys);
        let mut r = Report {
            ok: true,
            findings: Vec::new(),
            not_checked: Vec::new(),
            history: Vec::new(),
        };
        if s.module.loaded {
            r.loaded(sys, &s, log);
        } else {
            let text = read_log(sys, log);
            if let Err(why) = &text {
                let hint = if log.is_none() {
                    " (needs root, or give --log FILE)"
                } else {
                    ""
                };
                r.not_checked.push(format!("kernel log: {why}{hint}"));
            }
            let all = attempts::attempts(text.as_deref().unwrap_or(""));
            let earlier = all.len().saturating_sub(1);
            r.history = all[earlier.saturating_sub(HISTORY)..earlier]
                .iter()
                .map(|a| {
                    format!(
                        "an earlier load attempt, no longer current: {}",
                        a.summary()
                    )
                })
                .collect();
            r.not_loaded(sys, all.last().unwrap_or(&Attempt::default()));
        }
        r.ok = r.findings.is_empty();
        r
    }

    fn add(&mut self, id: &'static str, problem: String, fix: &'static str) {
        self.findings.push(Finding { id, problem, fix });
    }

    /// The module is not loaded: its latest load attempt `a`, judged on
    /// what is loaded now.
    fn not_loaded(&mut self, sys: &Sys, a: &Attempt) {
        let live = Live::read(sys);
        let stale = self.unknown_symbols(a, &live);
        self.build(a);
        self.parameters(a);
        self.signature(sys, a);
        if self.findings.is_empty() {
            let latest = match (a.loaded(), stale.is_empty()) {
                (Some(l), _) => {
                    format!("; it loaded last ({}) and was unloaded since", loaded_as(l))
                }
                (None, false) => {
                    format!("; its latest load attempt failed {}", stale.join(" and "))
                }
                (None, true) => String::new(),
            };
            self.add(
                "not-loaded",
                format!(
                    "nvidia_peermem is not loaded (no {MODULE_DIR}){latest}; now {}",
                    live.describe()
                ),
                "modprobe nvidia_peermem; if that fails, run peermem-stat doctor again to read why",
            );
        }
    }

    /// A latest attempt refused for how the module was built: symbol
    /// versions, or symbols no module has.
    fn build(&mut self, a: &Attempt) {
        let disagrees = symbols(a, |k| match k {
            Kind::Disagrees(s) => Some(s),
            _ => None,
        });
        if !disagrees.is_empty() {
            self.add(
                "symbol-version-mismatch",
                format!(
                    "nvidia_peermem failed to load: it disagrees about version of symbol {} \
                     (built against another OFED's, NVIDIA driver's or kernel's Module.symvers)",
                    disagrees.join(", ")
                ),
                "rebuild it: dkms autoinstall, or scripts/dkms-install again; on MLNX_OFED check that \
                 /usr/src/ofa_kernel/<arch>/<release>/Module.symvers is the installed OFED's",
            );
        }
        let [_, _, other] = unknown_groups(a);
        if !other.is_empty() {
            self.add(
                "unknown-symbol",
                format!(
                    "nvidia_peermem failed to load (Unknown symbol {}): built by another rustc or \
                     against another kernel build",
                    other.join(", ")
                ),
                "rebuild it with the kernel's rustc: scripts/prepare-kdir, then dkms autoinstall",
            );
        }
    }

    /// A latest attempt refused for its parameters.
    fn parameters(&mut self, a: &Attempt) {
        let params = a.of(|l| (l.kind == Kind::Parameter).then_some(l.text));
        if !params.is_empty() {
            self.add(
                "invalid-parameter",
                format!("nvidia_peermem refused its parameters (log: {})", quoted(&params)),
                "correct them where they are set (/etc/modprobe.d/*.conf, the modprobe command line; \
                 modinfo -p nvidia_peermem lists them), then modprobe nvidia_peermem",
            );
        }
    }

    /// The symbols the latest attempt found unknown: a finding for each
    /// group still missing now; what is loaded since, as text.
    fn unknown_symbols(&mut self, a: &Attempt, live: &Live) -> Vec<String> {
        let [peer_api, p2p, _] = unknown_groups(a);
        let mut stale = Vec::new();
        for (syms, now, what, id, problem, fix) in [
            (
                &peer_api,
                &live.core,
                "the peer-memory core",
                "peer-memory-core-absent",
                NO_CORE,
                FIX_CORE,
            ),
            (
                &p2p,
                &live.gpu,
                "the GPU driver",
                "gpu-driver-absent",
                NO_GPU,
                FIX_GPU,
            ),
        ] {
            let list = syms.join(", ");
            match (syms.is_empty(), now) {
                (true, _) => {}
                (false, None) => self.add(
                    id,
                    format!("nvidia_peermem failed to load (Unknown symbol {list}) and {what} is not loaded now: {problem}"),
                    fix,
                ),
                (false, Some(m)) => stale.push(format!(
                    "before {what} was loaded (Unknown symbol {list}), which is loaded now (module {m})"
                )),
            }
        }
        stale
    }

    /// A load refused for the module's signature (Secure Boot nodes), in
    /// the latest attempt `a`. The kernel's lines do not name the module.
    fn signature(&mut self, sys: &Sys, a: &Attempt) {
        let refusals = signature_refusals(a);
        let now = enforcement(sys);
        let cases = [
            (&refusals.unsigned, "module-unsigned", "the kernel refused an unsigned module",
             "modprobe says \"Key was rejected by service\"", ": DKMS did not sign it",
             concat!(
                "DKMS signs what it builds when the kernel's config has CONFIG_MODULE_SIG_HASH and \
                 sign-file is installed (Debian: linux-kbuild-<series>, with linux-headers): rebuild \
                 it (dpkg-reconfigure nvidia-peermem-rs-dkms, or dkms install --force \
                 nvidia-peermem-rs/<version>), then ",
                enroll!()
             )),
            (&refusals.untrusted, "module-key-not-enrolled",
             "the kernel refused a module signed with a key it does not trust",
             "modprobe says \"Key was rejected by service\"", "", enroll!()),
            (&refusals.lockdown, "module-signature-lockdown",
             "the kernel, locked down, refused a module that is unsigned or signed with a key it does not trust",
             "modprobe says \"Operation not permitted\"", "",
             concat!(
                "if modinfo -F signer nvidia_peermem prints nothing, DKMS did not sign it: \
                 rebuild it (dpkg-reconfigure nvidia-peermem-rs-dkms); then ",
                enroll!()
             )),
        ];
        for (lines, id, what, says, tail, fix) in cases {
            if !lines.is_empty() {
                let problem = format!(
                    "nvidia_peermem is not loaded and {what} (log: {}; {says}){now}{tail}",
                    quoted(lines)
                );
                self.add(id, problem, fix);
            }
        }
    }

    fn loaded(&mut self, sys: &Sys, s: &Snapshot, log: Option<&Path>) {
        if let Err(why) = &s.stats {
            self.not_checked.push(format!("counters: {why}"));
        }
        // Our module registers its client at load or fails to load; a core
        // whose memory_peers is absent (no client at all, or no sysfs) says
        // nothing about another module's.
        let (core, nv_mem) = (sys.exists(PEERS_DIR), sys.exists(NV_MEM));
        let ours = s.implementation == Some("peermem-rs");
        if self.waiting(sys, log) {
            // Said: the module is not registered because it waits.
        } else if !nv_mem && (core || s.implementation == Some("other")) {
            self.add(
                "client-not-registered",
                format!(
                    "nvidia_peermem is loaded but its peer-memory client is not registered (no {NV_MEM}): \
                     Open MPI, UCX before 1.18 and nvidia-fs see no GPUDirect RDMA, NCCL may say \
                     \"GPU Direct RDMA Disabled\", ibv_reg_mr on GPU memory fails (EFAULT)"
                ),
                "reload it after ib_core (modprobe -r nvidia_peermem; modprobe nvidia_peermem) and read \
                 its messages in dmesg; NVIDIA's nvidia-peermem built without MLNX_OFED registers nothing: \
                 rebuild it against OFED, or install this module",
            );
        } else if !nv_mem && !ours {
            self.not_checked.push(format!(
                "client registration: no {PEERS_DIR}, and which module is loaded is unknown"
            ));
        }

        let stat = |n: &str| s.stat(n).unwrap_or(0);
        let paths = s.diag.paths.as_ref().map(|r| &r.records[..]).unwrap_or(&[]);
        let refused: Vec<String> = paths
            .iter()
            .filter(|p| p.policy_refusals > 0)
            .map(|p| {
                format!(
                    "GPU {} - HCA {} ({}) {}",
                    p.gpu, p.hca, p.class, p.policy_refusals
                )
            })
            .collect();
        let by_pair: u64 = paths.iter().map(|p| p.policy_refusals).sum();
        let n = stat("fail_path_policy").max(by_pair);
        if n > 0 {
            let policy = match diag::path_policy(&s.module) {
                Some(p) => format!(" (path_policy={p}: {})", diag::policy_meaning(p)),
                None => String::new(),
            };
            let pairs = if refused.is_empty() {
                String::new()
            } else {
                format!(": {}", refused.join(", "))
            };
            self.add(
                "path-policy-refusals",
                format!("{n} registrations refused by the path policy{policy}{pairs}"),
                "put the HCA behind the GPU's PCIe switch (peermem-stat paths shows each pair's class), \
                 or load nvidia_peermem with a larger path_policy (0 allows every path)",
            );
        }
        let n = stat("fail_topology");
        if n > 0 {
            self.add(
                "topology-refusals",
                format!("{n} registrations refused by the GPU driver's topology gate (fail_topology)"),
                "the kernel log names the pair: set NVreg_GrdmaPciTopoCheckOverride=1 for nvidia.ko, move \
                 the HCA behind the GPU's PCIe switch or disable ACS redirection; where the verdict could \
                 not be learnt, allow_unverified_paths=1",
            );
        }

        self.bar1(s);
        let (orphaned, stranded) = (stat("orphaned_pins"), stat("stranded_pins"));
        let procs = s
            .diag
            .processes
            .as_ref()
            .map(|r| &r.records[..])
            .unwrap_or(&[]);
        let exited: Vec<String> = procs
            .iter()
            .filter(|p| p.comm.is_empty())
            .map(|p| {
                format!(
                    "tgid {} ({} live, {} bytes)",
                    p.tgid, p.live, p.pinned_bytes
                )
            })
            .collect();
        if orphaned > 0 || stranded > 0 || !exited.is_empty() {
            let exited = if exited.is_empty() {
                String::new()
            } else {
                format!(
                    ", exited processes with live registrations: {}",
                    exited.join(", ")
                )
            };
            self.add(
                "pins-after-exit",
                format!(
                    "pins held for processes that released elsewhere or exited: \
                     orphaned_pins={orphaned} stranded_pins={stranded}{exited}"
                ),
                "they end when the GPU memory is freed (by the process that owns it, or when it exits; \
                 nvidia-smi lists the processes holding GPU memory); until then rmmod nvidia_peermem is refused",
            );
        }
    }

    /// GPUs whose BAR1 use is near the BAR1 guard's limit (90% of it), or
    /// whose pins it refused.
    fn bar1(&mut self, s: &Snapshot) {
        let pct = s
            .module
            .parameters
            .iter()
            .find(|(n, _)| n == "bar1_limit_pct")
            .and_then(|(_, v)| v.as_ref().ok()?.trim().parse::<u64>().ok());
        let (Some(pct), Ok(gpus)) = (pct.filter(|&p| p > 0), s.diag.gpus.as_ref()) else {
            return;
        };
        let near: Vec<String> = gpus
            .records
            .iter()
            .filter_map(|g| {
                let (size, used) = (g.bar1_size?, g.bar1_used?);
                let limit = size / 100 * pct;
                let refused = g.bar1_refused.unwrap_or(0);
                (used * 10 >= limit * 9 || refused > 0).then(|| {
                    format!(
                        "GPU {}: {used} of {limit} bytes ({refused} pins refused)",
                        g.gpu
                    )
                })
            })
            .collect();
        if !near.is_empty() {
            self.add(
                "bar1-near-limit",
                format!(
                    "BAR1 use near the limit (bar1_limit_pct={pct} of each GPU's BAR1): {}; pins past it fail with ENOMEM",
                    near.join(", ")
                ),
                "deregister GPU memory, raise the limit (as root: echo N > \
                 /sys/module/nvidia_peermem/parameters/bar1_limit_pct), or enable resizable BAR",
            );
        }
    }

    /// What a loaded peermem-rs waits for (`stats/waiting_for`); whether
    /// it waits for something (a finding, with the refusals its latest load
    /// logged). Nothing without the file (an older peermem-rs, or NVIDIA's
    /// module).
    fn waiting(&mut self, sys: &Sys, log: Option<&Path>) -> bool {
        let Ok(text) = Sys::read(&sys.path(WAITING_FOR)) else {
            return false;
        };
        let (id, what, fix) = match text.trim() {
            "nothing" => return false,
            "core" => ("waiting-for-core", "the peer-memory core", LOAD_CORE),
            "gpu-driver" => ("waiting-for-gpu-driver", "the GPU driver", LOAD_GPU),
            "core,gpu-driver" => (
                "waiting-for-core-and-gpu-driver",
                "the peer-memory core and the GPU driver",
                LOAD_BOTH,
            ),
            "drain-holders" => {
                self.add(
                    "draining",
                    format!(
                        "nvidia_peermem is draining (/sys/module/nvidia_peermem/drain): new registrations are \
                         refused, and it completes once the processes still holding GPU memory end their \
                         registrations{}",
                        drain_holders(sys, log)
                    ),
                    "let those processes deregister or exit (persistent registrations cannot be revoked), \
                     or echo 0 > /sys/module/nvidia_peermem/drain to take registrations again",
                );
                return true;
            }
            "drained" => {
                self.add(
                    "drained",
                    "nvidia_peermem is drained: it unregistered from the peer-memory core and holds neither \
                     the core's module nor nvidia; no stack sees GPUDirect RDMA through it"
                        .into(),
                    "restart OFED or the GPU driver now: it registers again when either is loaded again; \
                     or echo 0 > /sys/module/nvidia_peermem/drain",
                );
                return true;
            }
            "core-refused" => {
                self.add(
                    "core-refused-clients",
                    "nvidia_peermem is bound to the peer-memory core and the GPU driver, but the core \
                     refused its clients: ibv_reg_mr on GPU memory fails (EFAULT)"
                        .into(),
                    "the kernel log says why (another module registered nv_mem: unload NVIDIA's \
                     nvidia-peermem); then modprobe -r nvidia_peermem; modprobe nvidia_peermem",
                );
                return true;
            }
            other => ("waiting-for-unknown", other, LOAD_BOTH),
        };
        self.add(
            id,
            format!(
                "nvidia_peermem is loaded and waits for {what} before it registers its peer-memory \
                 clients: until then no stack sees GPUDirect RDMA through it{}",
                refused_since_load(sys, log)
            ),
            fix,
        );
        true
    }

    /// The findings, one line each, or one "ok" line; checks not made go
    /// to `err`.
    pub fn write(&self, out: &mut dyn Write, err: &mut dyn Write, json: bool) -> io::Result<()> {
        if json {
            return crate::json_line(out, self);
        }
        for why in &self.not_checked {
            let _ = writeln!(err, "peermem-stat doctor: not checked: {why}");
        }
        for h in &self.history {
            let _ = writeln!(err, "peermem-stat doctor: history: {h}");
        }
        if self.findings.is_empty() {
            writeln!(out, "ok")?;
        }
        for f in &self.findings {
            writeln!(out, "{}: {}. Fix: {}", f.id, f.problem, f.fix)?;
        }
        out.flush()
    }
}

/// The symbols the attempt `a` found unknown: the core's, the GPU
/// driver's, others.
fn unknown_groups<'a>(a: &Attempt<'a>) -> [Vec<&'a str>; 3] {
    let unknown = symbols(a, |k| match k {
        Kind::Unknown(s) => Some(s),
        _ => None,
    });
    let (peer_api, other): (Vec<&str>, Vec<&str>) = unknown
        .iter()
        .partition(|s| s.starts_with("ib_") && s.contains("peer_memory"));
    let (p2p, other) = other.iter().partition(|s| s.starts_with("nvidia_p2p_"));
    [peer_api, p2p, other]
}

/// "version V, at T s" of a load line.
fn loaded_as(l: &attempts::Line) -> String {
    let v = l
        .text
        .split_once("nvidia_peermem: ")
        .map_or(l.text, |(_, m)| m);
    let v = v.split_once(" loaded").map_or(v, |(v, _)| v);
    l.secs
        .map_or(v.to_string(), |t| format!("{v}, at {t:.1} s"))
}

/// Log lines, quoted: "\"a\", \"b\"".
fn quoted(lines: &[&str]) -> String {
    let q: Vec<String> = lines.iter().map(|l| format!("\"{l}\"")).collect();
    q.join(", ")
}

/// The symbols of the lines of `a` that `f` picks, each once.
fn symbols<'a>(a: &Attempt<'a>, f: impl Fn(Kind<'a>) -> Option<&'a str>) -> Vec<&'a str> {
    let mut v = a.of(|l| f(l.kind));
    let mut seen = Vec::new();
    v.retain(|s| {
        !seen.contains(s) && {
            seen.push(*s);
            true
        }
    });
    v
}

/// The kernel's refusals of module signatures in one load attempt, each
/// distinct line once (the text after the record's prefix).
#[derive(Debug, Default, PartialEq)]
pub struct SignatureRefusals<'a> {
    /// Enforced signatures, no signature: "Loading of unsigned module is
    /// rejected" (EKEYREJECTED).
    pub unsigned: Vec<&'a str>,
    /// Enforced signatures, a key the kernel does not trust or a hash it
    /// cannot check: "Loading of module with unavailable key is rejected"
    /// (EKEYREJECTED).
    pub untrusted: Vec<&'a str>,
    /// Lockdown without enforcement, either cause: "Lockdown: modprobe:
    /// unsigned module loading is restricted; see man kernel_lockdown.7"
    /// (EPERM).
    pub lockdown: Vec<&'a str>,
}

pub fn signature_refusals<'a>(a: &Attempt<'a>) -> SignatureRefusals<'a> {
    let mut r = SignatureRefusals::default();
    for msg in a.of(|l| (l.kind == Kind::Signature).then_some(l.text)) {
        let list = if msg.starts_with("Lockdown: ") {
            &mut r.lockdown
        } else if msg.starts_with("Loading of unsigned") {
            &mut r.unsigned
        } else {
            &mut r.untrusted
        };
        if !list.contains(&msg) {
            list.push(msg);
        }
    }
    r
}

/// "; the kernel is locked down (M), module signatures are enforced
/// (sig_enforce=Y)", as far as each holds.
fn enforcement(sys: &Sys) -> String {
    let state = |abs: &str| sys.text(abs).and_then(Result::ok);
    // "none [integrity] confidentiality": the bracketed one is in force.
    let lockdown = state(LOCKDOWN).and_then(|s| {
        let mode = s.split_once('[')?.1.split_once(']')?.0.to_string();
        (mode != "none").then_some(mode)
    });
    let mut now = Vec::new();
    if let Some(mode) = &lockdown {
        now.push(format!("the kernel is locked down ({mode})"));
    }
    if state(SIG_ENFORCE).is_some_and(|s| s == "Y") {
        now.push("module signatures are enforced (sig_enforce=Y)".to_string());
    }
    if now.is_empty() {
        String::new()
    } else {
        format!("; {}", now.join(", "))
    }
}

/// "; the drain named: \"...\"" (the holders its latest drain logged), or
/// nothing (the log unreadable: root reads it).
fn drain_holders(sys: &Sys, log: Option<&Path>) -> String {
    let Ok(text) = read_log(sys, log) else {
        return String::new();
    };
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.iter().rposition(|l| {
        l.contains("nvidia_peermem: drain") && l.contains("new registrations are refused")
    });
    let named: Vec<&str> = start.map_or(Vec::new(), |i| {
        lines[i..]
            .iter()
            .filter_map(|l| {
                l.split_once("nvidia_peermem: drain: process ")
                    .map(|(_, t)| t)
            })
            .collect()
    });
    if named.is_empty() {
        return String::new();
    }
    format!(
        "; its latest drain named: process {}",
        named.join("; process ")
    )
}

/// "; its latest load logged: \"...refused...\"" from the kernel log, or
/// nothing (no such line, or the log unreadable: the finding stands without).
fn refused_since_load(sys: &Sys, log: Option<&Path>) -> String {
    let Ok(text) = read_log(sys, log) else {
        return String::new();
    };
    let all = attempts::attempts(&text);
    let refused = all.last().map_or(Vec::new(), |a| {
        a.of(|l| {
            let binding = [": refused module ", ": refused the GPU driver "];
            binding.iter().any(|r| l.text.contains(r)).then_some(l.text)
        })
    });
    match refused.get(refused.len().saturating_sub(2)..) {
        Some(r) if !r.is_empty() => format!("; its latest load logged: \"{}\"", r.join("\", \"")),
        _ => String::new(),
    }
}

/// The kernel log: `file` (under the root when absolute), or /dev/kmsg
/// under the root, read without blocking at its end.
fn read_log(sys: &Sys, file: Option<&Path>) -> Result<String, String> {
    let path = file.map_or_else(|| sys.path(KMSG), |f| sys.resolve(f));
    let why = |e: io::Error| format!("{}: {e}", path.display());
    let mut f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&path)
        .map_err(why)?;
    // /dev/kmsg gives one record per read, into a buffer that holds it.
    let (mut text, mut buf) = (Vec::new(), vec![0u8; 16 << 10]);
    while text.len() < MAX_LOG {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => text.extend_from_slice(&buf[..n]),
            // The end of /dev/kmsg.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            // EPIPE: records overwritten while reading; go on with the next.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::BrokenPipe | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(why(e)),
        }
    }
    Ok(String::from_utf8_lossy(&text).into_owned())
}
