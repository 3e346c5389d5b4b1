// SPDX-License-Identifier: GPL-2.0 OR MIT

//! `peermem-stat doctor`: the known failure modes (the README's
//! "Troubleshooting by symptom") found on this node, one line each with what
//! to do. Load failures are read from the kernel log, only while the module
//! is not loaded (a loaded module makes earlier failures stale).

use std::{
    fs,
    io::{self, Read, Write},
    os::unix::fs::OpenOptionsExt,
    path::Path,
};

use serde::Serialize;

use crate::{
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
}

impl Report {
    /// Examines the node under `sys`; `log` replaces /dev/kmsg.
    pub fn new(sys: &Sys, log: Option<&Path>) -> Self {
        let s = Snapshot::read(sys);
        let mut r = Report {
            ok: true,
            findings: Vec::new(),
            not_checked: Vec::new(),
        };
        if s.module.loaded {
            r.loaded(sys, &s);
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
            r.not_loaded(sys, text.as_deref().unwrap_or(""));
        }
        r.ok = r.findings.is_empty();
        r
    }

    fn add(&mut self, id: &'static str, problem: String, fix: &'static str) {
        self.findings.push(Finding { id, problem, fix });
    }

    fn not_loaded(&mut self, sys: &Sys, log: &str) {
        let (unknown, disagrees) = load_failures(log);
        let (peer_api, other): (Vec<&str>, Vec<&str>) = unknown
            .iter()
            .partition(|s| s.starts_with("ib_") && s.contains("peer_memory"));
        let (p2p, other): (Vec<&str>, Vec<&str>) =
            other.iter().partition(|s| s.starts_with("nvidia_p2p_"));
        let core = sys.exists(PEERS_DIR);
        if !peer_api.is_empty() && !core {
            self.add(
                "peer-memory-core-absent",
                format!(
                    "nvidia_peermem failed to load (Unknown symbol {}) and there is no {PEERS_DIR}: \
                     the loaded ib_core has no peer-memory API (upstream or Debian kernel, or OFED not loaded)",
                    peer_api.join(", ")
                ),
                "install MLNX_OFED or DOCA-OFED, or use an Ubuntu kernel, or use dma-buf (ibv_reg_dmabuf_mr) instead",
            );
        }
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
        if !p2p.is_empty() {
            self.add(
                "gpu-driver-absent",
                format!(
                    "nvidia_peermem failed to load (Unknown symbol {}): nvidia.ko is not loaded or not installed",
                    p2p.join(", ")
                ),
                "modprobe nvidia (the softdep does this when the driver is installed), then modprobe nvidia_peermem",
            );
        }
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
        self.signature(sys, log);
        if self.findings.is_empty() {
            let earlier = if peer_api.is_empty() {
                String::new()
            } else {
                format!(
                    "; it failed to load before the peer-memory core was (Unknown symbol {})",
                    peer_api.join(", ")
                )
            };
            self.add(
                "not-loaded",
                format!("nvidia_peermem is not loaded (no {MODULE_DIR}){earlier}"),
                "modprobe nvidia_peermem; if that fails, run peermem-stat doctor again to read why",
            );
        }
    }

    /// A load refused for the module's signature (Secure Boot nodes). The
    /// kernel's lines do not name the module; they count while nvidia_peermem
    /// is not loaded and has not loaded since.
    fn signature(&mut self, sys: &Sys, log: &str) {
        let refusals = signature_refusals(log);
        let state = |abs: &str| sys.text(abs).and_then(Result::ok);
        // "none [integrity] confidentiality": the bracketed one is in force.
        let lockdown = state(LOCKDOWN).and_then(|s| {
            let mode = s.split_once('[')?.1.split_once(']')?.0.to_string();
            (mode != "none").then_some(mode)
        });
        let enforced = state(SIG_ENFORCE).is_some_and(|s| s == "Y");
        let mut now = Vec::new();
        if let Some(mode) = &lockdown {
            now.push(format!("the kernel is locked down ({mode})"));
        }
        if enforced {
            now.push("module signatures are enforced (sig_enforce=Y)".to_string());
        }
        let now = if now.is_empty() {
            String::new()
        } else {
            format!("; {}", now.join(", "))
        };
        let quoted = |r: &[&str]| {
            r.iter()
                .map(|l| format!("\"{l}\""))
                .collect::<Vec<_>>()
                .join(", ")
        };
        if !refusals.unsigned.is_empty() {
            self.add(
                "module-unsigned",
                format!(
                    "nvidia_peermem is not loaded and the kernel refused an unsigned module (log: {}; \
                     modprobe says \"Key was rejected by service\"){now}: DKMS did not sign it",
                    quoted(&refusals.unsigned)
                ),
                concat!(
                    "DKMS signs what it builds when the kernel's config has CONFIG_MODULE_SIG_HASH and \
                     sign-file is installed (Debian: linux-kbuild-<series>, with linux-headers): rebuild \
                     it (dpkg-reconfigure nvidia-peermem-rs-dkms, or dkms install --force \
                     nvidia-peermem-rs/<version>), then ",
                    enroll!()
                ),
            );
        }
        if !refusals.untrusted.is_empty() {
            self.add(
                "module-key-not-enrolled",
                format!(
                    "nvidia_peermem is not loaded and the kernel refused a module signed with a key it \
                     does not trust (log: {}; modprobe says \"Key was rejected by service\"){now}",
                    quoted(&refusals.untrusted)
                ),
                enroll!(),
            );
        }
        if !refusals.lockdown.is_empty() {
            self.add(
                "module-signature-lockdown",
                format!(
                    "nvidia_peermem is not loaded and the kernel, locked down, refused \
                     a module that is unsigned or signed with a key it does not trust (log: {}; \
                     modprobe says \"Operation not permitted\"){now}",
                    quoted(&refusals.lockdown)
                ),
                concat!(
                    "if modinfo -F signer nvidia_peermem prints nothing, DKMS did not sign it: \
                     rebuild it (dpkg-reconfigure nvidia-peermem-rs-dkms); then ",
                    enroll!()
                ),
            );
        }
    }

    fn loaded(&mut self, sys: &Sys, s: &Snapshot) {
        if let Err(why) = &s.stats {
            self.not_checked.push(format!("counters: {why}"));
        }
        // Our module registers its client at load or fails to load; a core
        // whose memory_peers is absent (no client at all, or no sysfs) says
        // nothing about another module's.
        let (core, nv_mem) = (sys.exists(PEERS_DIR), sys.exists(NV_MEM));
        let ours = s.implementation == Some("peermem-rs");
        if self.waiting(sys) {
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

    /// What a loaded peermem-rs waits for (`stats/waiting_for`); whether
    /// it waits for something (a finding). Nothing without the file (an
    /// older peermem-rs, or NVIDIA's module).
    fn waiting(&mut self, sys: &Sys) -> bool {
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
                 clients: until then no stack sees GPUDirect RDMA through it"
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
        if self.findings.is_empty() {
            writeln!(out, "ok")?;
        }
        for f in &self.findings {
            writeln!(out, "{}: {}. Fix: {}", f.id, f.problem, f.fix)?;
        }
        out.flush()
    }
}

/// What the kernel log says about failed loads of nvidia_peermem since its
/// last successful one: the symbols it found unknown, and those whose
/// version disagrees, each once.
pub fn load_failures(log: &str) -> (Vec<&str>, Vec<&str>) {
    let (mut unknown, mut disagrees) = (Vec::new(), Vec::new());
    for line in log.lines() {
        let Some((_, msg)) = line.split_once("nvidia_peermem: ") else {
            continue;
        };
        // This module's "version 0.1.0 loaded: nv_mem ...".
        if msg.starts_with("version ") && msg.contains(" loaded") {
            unknown.clear();
            disagrees.clear();
            continue;
        }
        let (list, rest) = if let Some(r) = msg.strip_prefix("Unknown symbol ") {
            (&mut unknown, r)
        } else if let Some(r) = msg.strip_prefix("disagrees about version of symbol ") {
            (&mut disagrees, r)
        } else {
            continue;
        };
        if let Some(sym) = rest.split_whitespace().next() {
            if !list.contains(&sym) {
                list.push(sym);
            }
        }
    }
    (unknown, disagrees)
}

/// The kernel's refusals of module signatures since nvidia_peermem last
/// loaded, each distinct line once (the text after the record's prefix).
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

pub fn signature_refusals(log: &str) -> SignatureRefusals<'_> {
    let mut r = SignatureRefusals::default();
    for line in log.lines() {
        if let Some((_, msg)) = line.split_once("nvidia_peermem: ") {
            if msg.starts_with("version ") && msg.contains(" loaded") {
                r = SignatureRefusals::default();
            }
            continue;
        }
        // /dev/kmsg's "6,812,5123,-;" or dmesg's "[   12.5] ".
        let msg = match line.split_once(';') {
            Some((head, rest)) if !head.contains(' ') && head.contains(',') => rest,
            _ => line.split_once("] ").map_or(line, |(_, rest)| rest),
        }
        .trim();
        let list = if msg.starts_with("Loading of unsigned module is rejected") {
            &mut r.unsigned
        } else if msg.starts_with("Loading of module with ") && msg.contains(" is rejected") {
            &mut r.untrusted
        } else if msg.starts_with("Lockdown: ")
            && msg.contains(": unsigned module loading is restricted")
        {
            &mut r.lockdown
        } else {
            continue;
        };
        if !list.contains(&msg) {
            list.push(msg);
        }
    }
    r
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_lines() {
        let log = "\
3,812,5123,-;nvidia_peermem: disagrees about version of symbol ib_register_peer_memory_client
4,813,5124,-;nvidia_peermem: Unknown symbol ib_register_peer_memory_client (err -22)
[   12.5] nvidia_peermem: Unknown symbol nvidia_p2p_get_pages (err -2)
[   12.6] nvidia_peermem: Unknown symbol nvidia_p2p_get_pages (err -2)
[   12.7] other_mod: Unknown symbol foo (err -2)
 SUBSYSTEM=pci
";
        let (unknown, disagrees) = load_failures(log);
        assert_eq!(
            unknown,
            ["ib_register_peer_memory_client", "nvidia_p2p_get_pages"]
        );
        assert_eq!(disagrees, ["ib_register_peer_memory_client"]);
        assert_eq!(load_failures(""), (vec![], vec![]));
        // A successful load since makes them stale.
        let later = format!(
            "{log}6,900,9000,-;nvidia_peermem: version 0.1.0 loaded: nv_mem (persistent)\n"
        );
        assert_eq!(load_failures(&later), (vec![], vec![]));
    }

    #[test]
    fn signature_lines() {
        let log = "\
5,700,100,-;Lockdown: insmod: unsigned module loading is restricted; see man kernel_lockdown.7
5,701,101,-;Lockdown: insmod: unsigned module loading is restricted; see man kernel_lockdown.7
[   12.5] Loading of unsigned module is rejected
[   12.6] Loading of module with unavailable key is rejected
[   12.7] Loading of module with unsupported crypto is rejected
[   12.8] other: Loading of unsigned module is rejected later
";
        let r = signature_refusals(log);
        assert_eq!(
            r.lockdown,
            ["Lockdown: insmod: unsigned module loading is restricted; see man kernel_lockdown.7"]
        );
        assert_eq!(r.unsigned, ["Loading of unsigned module is rejected"]);
        assert_eq!(
            r.untrusted,
            [
                "Loading of module with unavailable key is rejected",
                "Loading of module with unsupported crypto is rejected"
            ]
        );
        assert_eq!(signature_refusals(""), SignatureRefusals::default());
        let later = format!(
            "{log}6,900,9000,-;nvidia_peermem: version 0.1.0 loaded: nv_mem (persistent)\n"
        );
        assert_eq!(signature_refusals(&later), SignatureRefusals::default());
    }
}
