// SPDX-License-Identifier: GPL-2.0 OR MIT

//! `peermem-e2e demo`: the module's main job, narrated for a person.

use crate::{dev::Core, dev::Gpu, module, uapi::*};

fn say(s: &str) {
    println!("DEMO | {s}");
}

fn errno(e: i32) -> String {
    std::io::Error::from_raw_os_error(e).to_string()
}

/// Runs the demonstration; returns false if a step did not do what it says.
pub fn run() -> bool {
    match steps() {
        Ok(()) => {
            say("done: every step behaved as described");
            true
        }
        Err(e) => {
            say(&format!("FAILED: {e}"));
            false
        }
    }
}

fn steps() -> Result<(), String> {
    let ver =
        std::fs::read_to_string("/sys/module/nvidia_peermem/version").map_err(|e| e.to_string())?;
    say(&format!("nvidia_peermem {} is loaded; /sys/module/nvidia_peermem/version exists (NCCL, UCX look for it)", ver.trim()));
    let gpu = Gpu::open()?;
    let core = Core::open()?;
    let info = gpu.info();
    say(&format!(
        "{} emulated GPU(s), BAR1 {} MiB on GPU 0; the HCA is QEMU's edu DMA engine",
        info.gpus,
        info.bar_size[0] >> 20
    ));

    say("");
    say("1. cudaMalloc(4 MiB) on GPU 0, and the CPU writes a greeting into it");
    let mut a = gpu.alloc(0, 4 << 20).map_err(errno)?;
    let hello = b"hello from the GPU";
    a.write(0x1000, hello);
    say(&format!("   GPU buffer at {:#x}", a.va));

    say("2. ibv_reg_mr(buffer + 0x1000, 1 MiB): the core asks the peer clients; nv_mem claims it");
    let g0 = gpu.info();
    let h = core
        .reg(a.va + 0x1000, 1 << 20, PMC_REG_INVAL_SUPP)
        .map_err(errno)?;
    let q = core.query(h).map_err(errno)?;
    let g1 = gpu.info();
    say(&format!(
        "   claimed by {}: {} scatterlist entry of {:#x} bytes at bus address {:#x}; GPU pages pinned {} time(s)",
        q.client_name(),
        q.nmap,
        q.first_len,
        q.first_dma,
        (g1.pins + g1.persistent_pins) - (g0.pins + g0.persistent_pins)
    ));

    say("3. the HCA reads the MR by DMA, then writes into it");
    let got = core.dma_read(h, 0, hello.len()).map_err(errno)?;
    say(&format!(
        "   HCA read:  {:?}",
        String::from_utf8_lossy(&got)
    ));
    if got != hello {
        return Err("the HCA read other bytes than the CPU wrote".into());
    }
    let reply = b"hello from the HCA";
    core.dma_write(h, 0x100, reply).map_err(errno)?;
    let seen = a.read(0x1100, reply.len());
    say(&format!(
        "   CPU reads GPU memory: {:?}",
        String::from_utf8_lossy(&seen)
    ));
    if seen != reply {
        return Err("GPU memory does not hold what the HCA wrote".into());
    }

    say("4. cudaFree while the MR is still registered: the GPU driver calls nvidia_peermem's free callback,");
    say("   which revokes the MR through the core before the memory goes away");
    a.unmap();
    let q = core.query(h).map_err(errno)?;
    say(&format!(
        "   MR state: {} (revoked: {})",
        if q.state == PMC_STATE_INVALIDATED {
            "invalidated"
        } else {
            "still mapped"
        },
        q.revoked == 1
    ));
    match core.dma_read(h, 0, 16) {
        Err(e) => say(&format!(
            "   HCA DMA through the MR is refused: {}",
            errno(e)
        )),
        Ok(_) => return Err("DMA through a revoked MR succeeded".into()),
    }

    say("5. ibv_dereg_mr: nothing left to unpin, nothing touched twice");
    core.dereg(h).map_err(errno)?;
    say("");
    say("nvidia_peermem statistics (/sys/module/nvidia_peermem/stats/counters/):");
    for (k, v) in module::stats() {
        if v != 0 || k == "live_registrations" || k == "pinned_bytes" {
            say(&format!("   {k:<22} {v}"));
        }
    }
    if module::stats().get("live_registrations") != Some(&0) {
        return Err("registrations left behind".into());
    }
    Ok(())
}
