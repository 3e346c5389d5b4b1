// SPDX-License-Identifier: GPL-2.0 OR MIT
/*
 * nv_p2p_emu: an emulated NVIDIA GPU driver for the peermem-rs testbed.
 *
 * Each QEMU ivshmem-plain device is one GPU; its RAM-backed BAR2 plays both
 * the frame buffer and BAR1. User space "cudaMalloc"s through ioctls + mmap
 * on /dev/nv_p2p_emu (a VM_IO|VM_PFNMAP mapping of BAR pages, which
 * pin_user_pages refuses exactly as it refuses a cudaMalloc range), and
 * "cudaFree"s by munmap, the FREE ioctl or process exit.
 *
 * It exports NVIDIA's kernel p2p API with the layouts of the real nv-p2p.h
 * and is as hostile as the real driver. Behaviours modelled, one a line, with
 * their source in NVIDIA open-gpu-kernel-modules 595.45.04 (K = kernel-open/nvidia,
 * RM = src/nvidia/src/kernel, OS = src/nvidia/arch/nvalloc/unix/src):
 *  - 64 KiB alignment; NULL free callback refused; FORCE_BAR1 tables refuse dma_map: K/nv-p2p.c
 *  - only the owning process may pin (token 0): RM/gpu/bus/p2p.c
 *  - one sleeping RM API lock (rw lock, write) in get/put_pages[_persistent], dma_map: OS/osapi.c
 *  - RM re-entered by the lock's holder (a free callback) -> -EIO, put WARNs: RM/rmapi/rmapi.c
 *  - dma_map reads the table before RM, links the mapping after; dma_unmap skips RM: K/nv-p2p.c
 *  - one dma_map_resource per 64 KiB page (independent IOVAs under an IOMMU): OS/osapi.c, K/nv-dma.c
 *    (coherent memory mapped as memory, page by page: RM/gpu/bus/p2p.c RmP2PDmaMapPages)
 *  - unknown GPU uuid -> -EINVAL; 580+ topology gate -> -ENOTSUPP: OS/osapi.c, K/nv-pci.c
 *  - non-persistent put looked up by current->tgid; not found -> 0, pin kept: RM/gpu/bus/p2p.c
 *  - the tgid is RM's process id: K/os-interface.c (os_get_current_process)
 *  - put after the callback -> 0; other put errors change nothing; -ENOMEM before RM: K/nv-p2p.c
 *  - persistent put finds the pin through the table; a stale put uses freed memory: K/nv-p2p.c
 *  - free callback under the RM lock at cudaFree and client teardown: RM/gpu/bus/third_party_p2p.c
 *  - client teardown deferred to the nv_queue kernel thread, owner gone: K/nv.c (nvidia_close)
 *  - table and its DMA mappings freed right after the callback returns: K/nv-p2p.c
 *  - a freed table's address is handed out again (no quarantine in production): K/nv-p2p.c
 *  - BAR1 space is finite; pins of one page share its BAR1 mapping: RM/gpu/bus/p2p.c
 *  - coherent (C2C) GPUs: memory is system RAM, v2 tables flag CPU_CACHEABLE, no
 *    topology gate: K/nv-p2p.c, K/nv-pci.c (nv_grdma_pci_topology_supported)
 *  - MIG/vGPU: persistent pins refused (NV_ERR_NOT_SUPPORTED, -ENOTSUPP): nv-p2p.h, K/nv-p2p.c
 *
 * Written in C: it exports C symbols by name (EXPORT_SYMBOL), maps BAR pages
 * into user space (io_remap_pfn_range) and maps resources for a peer device
 * (dma_map_resource) — none of which the 7.3 Rust kernel crate offers.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/bitmap.h>
#include <linux/debugfs.h>
#include <linux/delay.h>
#include <linux/dma-mapping.h>
#include <linux/hashtable.h>
#include <linux/jiffies.h>
#include <linux/kthread.h>
#include <linux/miscdevice.h>
#include <linux/mman.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/pci.h>
#include <linux/proc_fs.h>
#include <linux/seq_file.h>
#include <linux/rwsem.h>
#include <linux/sched.h>
#include <linux/sched/mm.h>
#include <linux/slab.h>
#include <linux/spinlock.h>
#include <linux/uaccess.h>
#include <linux/workqueue.h>

#include "nv-p2p.h"
#include "uapi.h"

#ifndef NVIDIA_P2P_FLAGS_FORCE_BAR1_MAPPING	/* 570+ headers */
#define NVIDIA_P2P_FLAGS_FORCE_BAR1_MAPPING 1
#endif
#ifndef NVIDIA_P2P_PAGE_TABLE_FLAGS_CPU_CACHEABLE	/* 580+ headers */
#define NVIDIA_P2P_PAGE_TABLE_FLAGS_CPU_CACHEABLE 1
#endif

#define GPU_PAGE	(64UL * 1024)

/*
 * GPU BAR pages are MMIO, not cached RAM: DMA-API debug's cacheline overlap
 * accounting (meant for kernel memory) does not apply, and many MRs on one
 * GPU buffer legitimately map the same BAR page many times.
 */
#ifdef DMA_ATTR_DEBUGGING_IGNORE_CACHELINES
#define EMU_DMA_ATTRS DMA_ATTR_DEBUGGING_IGNORE_CACHELINES
#else
#define EMU_DMA_ATTRS 0
#endif
#define MAX_GPUS	4

static unsigned int page_table_version = 0x00010002;
module_param(page_table_version, uint, 0444);
MODULE_PARM_DESC(page_table_version, "nvidia_p2p_page_table.version to report: 0x00010002 (<=575), 0x00020000 (580+), or anything to test refusals");

/*
 * nvidia.ko's MODULE_VERSION(NV_VERSION_STRING): nvidia_peermem checks it when
 * it binds (src/binding.rs). The headers the harness builds with are 550's.
 */
MODULE_VERSION("550.163.01");
static char *driver_version;
module_param(driver_version, charp, 0444);
MODULE_PARM_DESC(driver_version, "the version= to present instead of 550.163.01, to test nvidia_peermem's check of it; \"none\": no version");

static unsigned int dma_mapping_version = NVIDIA_P2P_DMA_MAPPING_VERSION;
module_param(dma_mapping_version, uint, 0444);
MODULE_PARM_DESC(dma_mapping_version, "nvidia_p2p_dma_mapping.version to report");

static unsigned int page_size_type = NVIDIA_P2P_PAGE_SIZE_64KB;
module_param(page_size_type, uint, 0444);
MODULE_PARM_DESC(page_size_type, "page_size of page tables (1 = 64 KiB, as every real GPU)");

static unsigned int bar1_size_mb;
module_param(bar1_size_mb, uint, 0444);
MODULE_PARM_DESC(bar1_size_mb, "usable BAR1 per GPU in MiB for pinning (0: the whole BAR)");

static bool coherent;
module_param(coherent, bool, 0444);
MODULE_PARM_DESC(coherent, "coherent (C2C) GPUs, as Grace Hopper: memory in system RAM, v2 tables with CPU_CACHEABLE, no topology gate");

static bool mig;
module_param(mig, bool, 0444);
MODULE_PARM_DESC(mig, "MIG (or vGPU) enabled: persistent pins refused as not supported");

static unsigned int pin_cost_us;
module_param(pin_cost_us, uint, 0644);
MODULE_PARM_DESC(pin_cost_us, "cost model: fixed delay per pin call, microseconds");

static int unpin_cost_us = -1;
module_param(unpin_cost_us, int, 0644);
MODULE_PARM_DESC(unpin_cost_us, "cost model: fixed delay per unpin call, microseconds (-1: pin_cost_us)");

static unsigned int page_cost_ns;
module_param(page_cost_ns, uint, 0644);
MODULE_PARM_DESC(page_cost_ns, "cost model: delay per pinned 64 KiB page, nanoseconds");

struct emu_gpu {
	struct pci_dev *pdev;
	int index;
	phys_addr_t bar;
	u64 size;
	u64 bar1_budget;
	u64 bar1_used;
	unsigned long nchunks;
	unsigned long *used;
	u32 *bar1_refs;		/* pins per 64 KiB page: pins of one page share its BAR1 mapping */
	u8 uuid[NVIDIA_P2P_GPU_UUID_LEN];
	bool gone;		/* unbound: no allocation, pin or mapping reaches it */
	u32 bdf;		/* domain << 16 | bus << 8 | devfn: its identity across rebinds */
	struct page **ram;	/* coherent: the RAM of each 64 KiB chunk, made on first use */
};

struct emu_alloc {
	struct list_head node;
	struct emu_gpu *gpu;
	struct file *file;	/* compared only */
	struct mm_struct *mm;	/* owner, compared only */
	u64 chunk;		/* first 64 KiB chunk in the BAR */
	u64 size;
	u64 offset;		/* mmap offset */
	u64 va;			/* 0 until mapped */
	bool mapped;		/* a VMA maps it */
	bool freed;		/* cudaFree'd: no new pins */
	bool released;		/* BAR space returned */
	bool deferred;		/* owner exited: teardown queued to nv_queue */
	int persistent_pins;
	int holds;		/* queued works that will still touch it */
	unsigned long defer_until;	/* jiffies: when nv_queue tears it down */
	struct list_head tables;
	struct work_struct race_work;
	struct kthread_work defer_work;
};

/* A page table as the driver allocates it: the public struct first, then the
 * 2.0 `flags` field at offset 32, then our bookkeeping. */
struct emu_table {
	struct nvidia_p2p_page_table pt;
	u32 flags_v2;
	struct list_head node;		/* in alloc->tables (rm_api_lock) */
	struct hlist_node hnode;	/* in live_tables (rm_api_lock + table_lock) */
	struct emu_alloc *alloc;
	u64 first_chunk;		/* BAR page of entry 0 */
	pid_t tgid;			/* the pinning process, as RM's os_get_current_process() */
	bool persistent;
	bool force_bar1;
	bool dying;			/* its free callback is running (table_lock) */
	void (*cb)(void *data);
	void *data;
	struct list_head mappings;	/* table_lock */
	struct nvidia_p2p_page *page_structs;
};

struct emu_run {
	dma_addr_t dma;
	u64 len;
};

struct emu_mapping {
	struct nvidia_p2p_dma_mapping m;
	struct list_head node;
	struct emu_run *runs;
	unsigned int nruns;
};

static struct emu_gpu *gpus[MAX_GPUS];
static int ngpus;

/*
 * RM's API lock: one sleeping lock, always taken for write, held inside every
 * p2p call that enters RM, by the "cudaMalloc/cudaFree" paths, and across
 * every free callback. rm_owner lets a re-entry fail like RM's does instead
 * of deadlocking.
 */
static DECLARE_RWSEM(rm_api_lock);
static struct task_struct *rm_owner;
static LIST_HEAD(allocs);
/*
 * Page tables RM still knows (live, or their free callback running), by
 * address, like RM's tracker. Changed under rm_api_lock and table_lock; read
 * under either. table_lock also guards every table's mapping list, the
 * page-table reuse cache, and never covers a callback or a DMA (un)map.
 */
static DEFINE_SPINLOCK(table_lock);
static DEFINE_HASHTABLE(live_tables, 16);

#define TABLE_CACHE	8
static struct emu_table *table_cache[TABLE_CACHE];	/* LIFO, table_lock */
static unsigned int table_cached;

static struct kthread_worker *nv_queue;	/* RM's deferred-close kernel thread */
static struct workqueue_struct *race_wq;
static bool unloading;

static atomic64_t st_pins, st_ppins, st_unpins, st_callbacks, st_live_tables, st_live_maps, st_dma_maps;
static atomic64_t st_bytes;	/* memory of live tables and mappings, as slab holds it */
static atomic64_t st_ns;	/* time inside the exported calls (benchmark: client's own share) */
static atomic64_t st_map_ns;	/* the part of it inside dma_map_pages/dma_unmap_pages */
static atomic64_t st_foreign_puts, st_failed_unpins, st_stale, st_deferred_cbs, st_reused,
		  st_topo_refusals, st_reentries;

/* make bench only: clock reads are slow under TCG, so timing is opt-in. */
static bool bench_timing;
module_param(bench_timing, bool, 0644);
MODULE_PARM_DESC(bench_timing, "account the time spent inside the p2p calls (provider_ns)");

static u64 clock_start(void)
{
	return READ_ONCE(bench_timing) ? ktime_get_ns() : 0;
}

/* Accounts the time since @t0 (from clock_start()) to the provider; returns
 * @ret. The caller reads the clock into a variable first: argument order is
 * unspecified. */
static int timed(u64 t0, int ret)
{
	if (t0)
		atomic64_add(ktime_get_ns() - t0, &st_ns);
	return ret;
}

/* What slab (or vmalloc) holds for the @size-byte allocation at @p. */
static u64 held(const void *p, size_t size)
{
	if (!p)
		return 0;
	if (is_vmalloc_addr(p))
		return PAGE_ALIGN(size);
	return kmalloc_size_roundup(size);
}

static u64 table_bytes(struct emu_table *t)
{
	u64 n = t->pt.entries;

	return held(t, sizeof(*t)) + held(t->pt.pages, n * sizeof(void *)) +
	       held(t->page_structs, n * sizeof(struct nvidia_p2p_page)) +
	       held(t->pt.gpu_uuid, NVIDIA_P2P_GPU_UUID_LEN);
}

static u64 mapping_bytes(struct emu_mapping *em)
{
	u64 n = em->m.entries;

	return held(em, sizeof(*em)) + held(em->m.dma_addresses, n * sizeof(u64)) +
	       held(em->runs, n * sizeof(struct emu_run));
}

/* --- the RM API lock ------------------------------------------------------ */

static void rm_lock(void)
{
	down_write(&rm_api_lock);
	WRITE_ONCE(rm_owner, current);
}

static void rm_unlock(void)
{
	WRITE_ONCE(rm_owner, NULL);
	up_write(&rm_api_lock);
}

/*
 * An exported call entering RM. rmapiLockAcquire() refuses a thread that
 * already owns the lock (NV_ERR_INVALID_LOCK_STATE, which nv-p2p.c maps to
 * -EIO): that is what a client calling back into RM from its free callback
 * gets. Only the owner itself writes rm_owner == current, so the check is
 * exact.
 */
static int rm_enter(const char *fn)
{
	if (READ_ONCE(rm_owner) == current) {
		atomic64_inc(&st_reentries);
		pr_err("NVRM: %s: RM API lock already held by this thread (called from a free callback?): NV_ERR_INVALID_LOCK_STATE\n",
		       fn);
		return -EIO;
	}
	rm_lock();
	return 0;
}

/* --- debugfs: fault injection and behaviour knobs -------------------------- */

enum {
	INJ_GET_PAGES, INJ_GET_PAGES_PERSISTENT, INJ_DMA_MAP,
	INJ_PUT_PAGES, INJ_PUT_PAGES_PERSISTENT, INJ_DMA_UNMAP, INJ_COUNT
};
static const char *const inj_names[INJ_COUNT] = {
	"get_pages", "get_pages_persistent", "dma_map_pages",
	"put_pages", "put_pages_persistent", "dma_unmap_pages",
};
static atomic_t inj_left[INJ_COUNT];
static int inj_errno[INJ_COUNT];
static u32 free_delay_ms;
static atomic_t race_free_on_pin;

enum { DMA_MAP_PAGES, DMA_MAP_SHUFFLED, DMA_MAP_RUNS };
static u32 dma_map_style = DMA_MAP_PAGES;
static u32 deferred_teardown_ms;
static u32 reuse_tables;
static struct dentry *dbg_dir;

/*
 * A free callback's RM-locked section: RM runs the callback under its API
 * lock and keeps the lock while it frees the table afterwards (fact 2).
 * callback_hold_ms stretches what follows the callback, so that a client
 * whose exit does not wait for that section can be seen unloading inside it:
 * callbacks_running is non-zero from the call until the section ends.
 */
static u32 callback_hold_ms;
static atomic_t callbacks_running;

/*
 * The 580+ topology gate's inputs (K/nv-pci.c nv_grdma_pci_topology_supported):
 * - NV_FLAG_PCI_P2P_UNSUPPORTED_CHIPSET, which RM sets at adapter init when a
 *   device of the GPU's PCI domain is a Grace (TH500), Ampere Altra or
 *   AmpereOne root complex (RM/arch/nvalloc/unix/src/osinit.c
 *   _checkP2pChipsetSupport, RM/platform/chipset/chipset.c). Setting it
 *   presents the board as an Ampere Altra: the host bridge of domain 0
 *   shows that root complex's PCI ids (1def:e000) until it is cleared, so
 *   that a client observes what RM observes;
 * - NVreg_GrdmaPciTopoCheckOverride (0: check, 1: allow, 2: deny), a module
 *   parameter without a sysfs file that RM shows in /proc/driver/nvidia/params
 *   (K/nv-reg.h, K/nv-procfs.c);
 * - IS_PASSTHRU, per GPU (RM/gpu/gpu.c gpuDetermineVirtualMode: a hypervisor
 *   RM knows and a GPU that is no vGPU): bit i of passthrough_gpus for GPU i.
 */
static u32 p2p_unsupported_chipset;
static u32 topo_check_override;
module_param_named(NVreg_GrdmaPciTopoCheckOverride, topo_check_override, uint, 0);
static u32 passthrough_gpus;
static struct pci_dev *altra;		/* the host bridge showing Altra's ids */
static unsigned short altra_was[2];	/* its own vendor and device */
static DEFINE_MUTEX(altra_lock);

static int injected(int which)
{
	if (atomic_add_unless(&inj_left[which], -1, 0)) {
		pr_info("injecting %d into %s\n", inj_errno[which], inj_names[which]);
		return inj_errno[which];
	}
	return 0;
}

static ssize_t inject_write(struct file *f, const char __user *ubuf, size_t n, loff_t *pos)
{
	char buf[64], name[32];
	int count, err, i;

	if (n >= sizeof(buf))
		return -EINVAL;
	if (copy_from_user(buf, ubuf, n))
		return -EFAULT;
	buf[n] = 0;
	if (sscanf(buf, "%31s %d %d", name, &count, &err) != 3 || count < 0 || err > 0 || err < -4095)
		return -EINVAL;
	for (i = 0; i < INJ_COUNT; i++) {
		if (!strcmp(name, inj_names[i])) {
			inj_errno[i] = err;
			atomic_set(&inj_left[i], count);
			return n;
		}
	}
	return -EINVAL;
}

static const struct file_operations inject_fops = {
	.owner = THIS_MODULE,
	.write = inject_write,
};

/* nv_pci_has_common_pci_switch(): an upstream bridge above both devices. */
static bool common_upstream_bridge(struct pci_dev *gpu, struct pci_dev *peer)
{
	struct pci_dev *a, *b;

	for (a = pci_upstream_bridge(gpu); a; a = pci_upstream_bridge(a))
		for (b = pci_upstream_bridge(peer); b; b = pci_upstream_bridge(b))
			if (a == b)
				return true;
	return false;
}

/* nv_grdma_pci_topology_supported() for a non-coherent, non-passthrough GPU. */
static bool topo_supported(struct emu_gpu *g, struct pci_dev *peer)
{
	if (coherent)
		return true;	/* a coherent platform skips the gate */
	switch (READ_ONCE(topo_check_override)) {
	case 1:
		return true;
	case 2:
		return false;
	}
	if (READ_ONCE(passthrough_gpus) & BIT(g->index))
		return true;	/* "Allow RDMA by default on passthrough VMs" */
	if (READ_ONCE(p2p_unsupported_chipset))
		return common_upstream_bridge(g->pdev, peer);
	return true;
}

/* Shows (@on) or takes back Altra's ids on the host bridge of domain 0. */
static void present_altra(bool on)
{
	mutex_lock(&altra_lock);
	if (on && !altra) {
		/* The GPUs of the testbed are in domain 0. */
		altra = pci_get_domain_bus_and_slot(0, 0, PCI_DEVFN(0, 0));
		if (altra) {
			altra_was[0] = altra->vendor;
			altra_was[1] = altra->device;
			altra->vendor = 0x1def;
			altra->device = 0xe000;
		}
	} else if (!on && altra) {
		altra->vendor = altra_was[0];
		altra->device = altra_was[1];
		pci_dev_put(altra);
		altra = NULL;
	}
	mutex_unlock(&altra_lock);
}

static int chipset_get(void *data, u64 *val)
{
	*val = READ_ONCE(p2p_unsupported_chipset);
	return 0;
}

static int chipset_set(void *data, u64 val)
{
	present_altra(val);
	WRITE_ONCE(p2p_unsupported_chipset, !!val);
	return 0;
}
DEFINE_DEBUGFS_ATTRIBUTE(chipset_fops, chipset_get, chipset_set, "%llu\n");

/* /proc/driver/nvidia/params, as nv-procfs.c prints it (a few of its lines). */
static int params_show(struct seq_file *m, void *v)
{
	seq_puts(m, "ResmanDebugLevel: 4294967295\nRmLogonRC: 1\n");
	seq_printf(m, "GrdmaPciTopoCheckOverride: %u\n", READ_ONCE(topo_check_override));
	seq_puts(m, "EnableResizableBar: 0\n");
	return 0;
}

/* --- allocations ---------------------------------------------------------- */

static void cost(u64 pages, bool unpin)
{
	int u = READ_ONCE(unpin_cost_us);
	unsigned int us = (unpin && u >= 0) ? u : READ_ONCE(pin_cost_us);

	if (us)
		usleep_range(us, us + 1);
	if (page_cost_ns && pages)
		ndelay(min_t(u64, pages * page_cost_ns, 100000000ULL));
}

/* Where 64 KiB chunk @c of @g is: its BAR page, or (coherent) its RAM. */
static phys_addr_t chunk_phys(struct emu_gpu *g, u64 c)
{
	return coherent ? page_to_phys(g->ram[c]) : g->bar + c * GPU_PAGE;
}

/* Coherent memory for chunks [first, first + n) of @g. rm_api_lock held. */
static int coherent_ram(struct emu_gpu *g, u64 first, u64 n)
{
	u64 c;

	for (c = first; coherent && c < first + n; c++) {
		if (!g->ram[c])
			g->ram[c] = alloc_pages(GFP_KERNEL | __GFP_ZERO, get_order(GPU_PAGE));
		if (!g->ram[c])
			return -ENOMEM;
	}
	return 0;
}

/*
 * A DMA mapping of GPU memory for @dev: of BAR pages as MMIO (nv_dma_map_peer),
 * of coherent memory as memory (RmP2PDmaMapPages: dma_map_sg of its pages).
 */
static dma_addr_t emu_map(struct device *dev, phys_addr_t phys, u64 len)
{
	if (coherent)
		return dma_map_phys(dev, phys, len, DMA_BIDIRECTIONAL, EMU_DMA_ATTRS);
	return dma_map_resource(dev, phys, len, DMA_BIDIRECTIONAL, EMU_DMA_ATTRS);
}

static void emu_unmap(struct device *dev, dma_addr_t dma, u64 len)
{
	if (coherent)
		dma_unmap_phys(dev, dma, len, DMA_BIDIRECTIONAL, EMU_DMA_ATTRS);
	else
		dma_unmap_resource(dev, dma, len, DMA_BIDIRECTIONAL, EMU_DMA_ATTRS);
}

static void release_bar(struct emu_alloc *a)
{
	if (a->released)
		return;
	a->released = true;
	bitmap_clear(a->gpu->used, a->chunk, a->size / GPU_PAGE);
}

/* BAR1 space of the pages [first, first + n) of @g. rm_api_lock held. */
static u64 bar1_needed(struct emu_gpu *g, u64 first, u64 n)
{
	u64 i, need = 0;

	for (i = first; i < first + n; i++)
		if (!g->bar1_refs[i])
			need += GPU_PAGE;
	return need;
}

static void bar1_get(struct emu_gpu *g, u64 first, u64 n)
{
	u64 i;

	for (i = first; i < first + n; i++)
		if (!g->bar1_refs[i]++)
			g->bar1_used += GPU_PAGE;
}

static void bar1_put(struct emu_gpu *g, u64 first, u64 n)
{
	u64 i;

	for (i = first; i < first + n; i++)
		if (!--g->bar1_refs[i])
			g->bar1_used -= GPU_PAGE;
}

/* Frees the struct once nothing refers to it. rm_api_lock held. */
static void maybe_destroy(struct emu_alloc *a)
{
	if (a->mapped || !a->freed || !list_empty(&a->tables) || a->persistent_pins ||
	    a->holds || a->deferred)
		return;
	release_bar(a);
	list_del(&a->node);
	kfree(a);
}

/* A page-table struct: with reuse_tables on, the most recently freed one, so
 * a new pin gets the address of a just-freed table (as on a production
 * kernel, where the slab hands the hot object out again). */
static struct emu_table *table_alloc(void)
{
	struct emu_table *t = NULL;

	if (READ_ONCE(reuse_tables)) {
		spin_lock(&table_lock);
		if (table_cached)
			t = table_cache[--table_cached];
		spin_unlock(&table_lock);
		if (t) {
			memset(t, 0, sizeof(*t));
			atomic64_inc(&st_reused);
			return t;
		}
	}
	return kzalloc(sizeof(*t), GFP_KERNEL);
}

static void table_release(struct emu_table *t)
{
	if (READ_ONCE(reuse_tables)) {
		spin_lock(&table_lock);
		if (table_cached < TABLE_CACHE) {
			table_cache[table_cached++] = t;
			t = NULL;
		}
		spin_unlock(&table_lock);
	}
	kfree(t);
}

/* The table RM knows at @pt (live or in its callback), or NULL. Compares
 * addresses only, never dereferences @pt. table_lock or rm_api_lock held. */
static struct emu_table *find_table(struct nvidia_p2p_page_table *pt)
{
	struct emu_table *t;

	hash_for_each_possible(live_tables, t, hnode, (unsigned long)pt)
		if (&t->pt == pt)
			return t;
	return NULL;
}

/* RM forgets @t: no put, dma_map or dma_unmap reaches it any more. rm_api_lock held. */
static void unlink_table(struct emu_table *t)
{
	spin_lock(&table_lock);
	hash_del(&t->hnode);
	t->dying = false;
	spin_unlock(&table_lock);
}

static void free_mapping(struct emu_mapping *em)
{
	unsigned int i;
	struct device *dev = &em->m.pci_dev->dev;

	for (i = 0; i < em->nruns; i++)
		emu_unmap(dev, em->runs[i].dma, em->runs[i].len);
	atomic64_sub(mapping_bytes(em), &st_bytes);
	kvfree(em->m.dma_addresses);
	kfree(em->runs);
	kfree(em);
	atomic64_dec(&st_live_maps);
}

/* Unlinked table: free it and every DMA mapping made of it (nothing else
 * can reach its mapping list any more). rm_api_lock held. */
static void free_table(struct emu_table *t)
{
	struct emu_mapping *em, *tmp;

	list_for_each_entry_safe(em, tmp, &t->mappings, node) {
		list_del(&em->node);
		free_mapping(em);
	}
	bar1_put(t->alloc->gpu, t->first_chunk, t->pt.entries);
	atomic64_sub(table_bytes(t), &st_bytes);
	kvfree(t->pt.pages);
	kvfree(t->page_structs);
	kfree(t->pt.gpu_uuid);
	table_release(t);
	atomic64_dec(&st_live_tables);
}

/* cudaFree / client teardown: revoke every non-persistent pin (free
 * callbacks, synchronously, under the RM lock), freeing each table and its
 * mappings right after its callback returns. Returns the callbacks called.
 * rm_api_lock held. */
static unsigned int free_alloc(struct emu_alloc *a)
{
	struct emu_table *t, *tmp;
	unsigned int n = 0;

	if (a->freed)
		return 0;
	a->freed = true;
	list_for_each_entry_safe(t, tmp, &a->tables, node) {
		if (t->persistent)
			continue;
		list_del_init(&t->node);
		spin_lock(&table_lock);
		t->dying = true;
		spin_unlock(&table_lock);
		atomic64_inc(&st_callbacks);
		n++;
		if (free_delay_ms)
			msleep(free_delay_ms);
		if (READ_ONCE(unloading)) {
			/* Every client module is gone by now: its callback too. */
			pr_err("HARNESS FAILURE: free callback %ps(%p) still armed at unload (a leaked pin)\n",
			       t->cb, t->data);
			WARN(1, "nv_p2p_emu: pin leaked past its client's unload\n");
		} else {
			atomic_inc(&callbacks_running);
			t->cb(t->data);
			if (callback_hold_ms)
				msleep(callback_hold_ms);
			atomic_dec(&callbacks_running);
		}
		unlink_table(t);
		free_table(t);
	}
	if (!a->persistent_pins)
		release_bar(a);
	return n;
}

static struct emu_alloc *find_alloc(struct mm_struct *mm, u64 va, u64 len)
{
	struct emu_alloc *a;

	list_for_each_entry(a, &allocs, node) {
		if (!a->mapped || a->freed || a->mm != mm)
			continue;
		if (va >= a->va && va < a->va + a->size)
			return (va + len <= a->va + a->size) ? a : ERR_PTR(-EINVAL);
	}
	return NULL;
}

/* A cudaFree racing a pin (race_free_on_pin). */
static void race_free_fn(struct work_struct *w)
{
	struct emu_alloc *a = container_of(w, struct emu_alloc, race_work);

	rm_lock();
	a->holds--;
	free_alloc(a);
	maybe_destroy(a);
	rm_unlock();
}

/* RM's deferred client teardown on its nv_queue kernel thread: the owner has
 * exited; its allocations die (callbacks first) when the thread gets to them. */
static void deferred_teardown_fn(struct kthread_work *w)
{
	struct emu_alloc *a = container_of(w, struct emu_alloc, defer_work);
	long left = (long)(a->defer_until - jiffies);

	if (left > 0 && !READ_ONCE(unloading))
		schedule_timeout_uninterruptible(left);
	rm_lock();
	a->holds--;
	a->deferred = false;
	atomic64_add(free_alloc(a), &st_deferred_cbs);
	maybe_destroy(a);
	rm_unlock();
}

static int get_pages_common(u64 va, u64 len, struct nvidia_p2p_page_table **ptp,
			    void (*cb)(void *), void *data, bool persistent, u32 flags)
{
	struct emu_alloc *a;
	struct emu_table *t;
	u64 i, n;
	int err;

	if (!ptp)
		return -EINVAL;
	if (!len || !IS_ALIGNED(va, GPU_PAGE) || !IS_ALIGNED(len, GPU_PAGE)) {
		pr_info("NVRM: get_pages: va %#llx len %#llx not 64 KiB aligned\n", va, len);
		return -EINVAL;
	}
	err = injected(persistent ? INJ_GET_PAGES_PERSISTENT : INJ_GET_PAGES);
	if (err)
		return err;
	n = len / GPU_PAGE;
	cost(n, false);

	t = table_alloc();
	if (!t)
		return -ENOMEM;
	t->pt.pages = kvcalloc(n, sizeof(*t->pt.pages), GFP_KERNEL);
	t->page_structs = kvcalloc(n, sizeof(*t->page_structs), GFP_KERNEL);
	t->pt.gpu_uuid = kmalloc(NVIDIA_P2P_GPU_UUID_LEN, GFP_KERNEL);
	if (!t->pt.pages || !t->page_structs || !t->pt.gpu_uuid) {
		err = -ENOMEM;
		goto out_free;
	}

	err = rm_enter(persistent ? "nvidia_p2p_get_pages_persistent" : "nvidia_p2p_get_pages");
	if (err)
		goto out_free;
	a = find_alloc(current->mm, va, len);
	if (IS_ERR_OR_NULL(a)) {
		/* Not GPU memory of this process, or straddling an allocation. */
		err = -EINVAL;
		goto out_unlock;
	}
	t->first_chunk = a->chunk + (va - a->va) / GPU_PAGE;
	if (a->gpu->bar1_used + bar1_needed(a->gpu, t->first_chunk, n) > a->gpu->bar1_budget) {
		pr_info("NVRM: BAR1 exhausted on GPU %d (%llu of %llu bytes used)\n",
			a->gpu->index, a->gpu->bar1_used, a->gpu->bar1_budget);
		err = -ENOMEM;
		goto out_unlock;
	}
	if (persistent && mig) {
		pr_info_ratelimited("NVRM: persistent P2P mappings are not supported with MIG\n");
		err = -ENOTSUPP;
		goto out_unlock;
	}
	bar1_get(a->gpu, t->first_chunk, n);
	t->pt.version = page_table_version;
	t->pt.page_size = page_size_type;
	t->pt.entries = n;
	t->flags_v2 = coherent ? NVIDIA_P2P_PAGE_TABLE_FLAGS_CPU_CACHEABLE : 0;
	memcpy(t->pt.gpu_uuid, a->gpu->uuid, NVIDIA_P2P_GPU_UUID_LEN);
	for (i = 0; i < n; i++) {
		t->page_structs[i].physical_address = chunk_phys(a->gpu, t->first_chunk + i);
		t->pt.pages[i] = &t->page_structs[i];
	}
	t->alloc = a;
	t->tgid = current->tgid;
	t->persistent = persistent;
	t->force_bar1 = flags & NVIDIA_P2P_FLAGS_FORCE_BAR1_MAPPING;
	t->cb = cb;
	t->data = data;
	INIT_LIST_HEAD(&t->mappings);
	list_add_tail(&t->node, &a->tables);
	spin_lock(&table_lock);
	hash_add(live_tables, &t->hnode, (unsigned long)&t->pt);
	spin_unlock(&table_lock);
	if (persistent)
		a->persistent_pins++;
	atomic64_inc(persistent ? &st_ppins : &st_pins);
	atomic64_inc(&st_live_tables);
	atomic64_add(table_bytes(t), &st_bytes);
	*ptp = &t->pt;
	if (!persistent && atomic_add_unless(&race_free_on_pin, -1, 0)) {
		/* A cudaFree that arrives while this pin is in progress: it
		 * waits for the RM lock, then revokes right after we return. */
		if (queue_work(race_wq, &a->race_work))
			a->holds++;
	}
	rm_unlock();
	return 0;

out_unlock:
	rm_unlock();
out_free:
	kvfree(t->pt.pages);
	kvfree(t->page_structs);
	kfree(t->pt.gpu_uuid);
	table_release(t);
	return err;
}

int nvidia_p2p_get_pages(uint64_t p2p_token, uint32_t va_space, uint64_t virtual_address,
			 uint64_t length, struct nvidia_p2p_page_table **page_table,
			 void (*free_callback)(void *data), void *data)
{
	if (p2p_token || va_space)
		return -EINVAL;
	if (!free_callback)
		return -EINVAL;
	u64 t0 = clock_start();

	return timed(t0,
		     get_pages_common(virtual_address, length, page_table, free_callback, data, false, 0));
}
EXPORT_SYMBOL(nvidia_p2p_get_pages);

int nvidia_p2p_get_pages_persistent(uint64_t virtual_address, uint64_t length,
				    struct nvidia_p2p_page_table **page_table, uint32_t flags)
{
	if (flags & ~NVIDIA_P2P_FLAGS_FORCE_BAR1_MAPPING)
		return -EINVAL;
	u64 t0 = clock_start();

	return timed(t0,
		     get_pages_common(virtual_address, length, page_table, NULL, NULL, true, flags));
}
EXPORT_SYMBOL(nvidia_p2p_get_pages_persistent);

/* Unpins @t (found live by its put). rm_api_lock held. */
static void unpin(struct emu_table *t)
{
	struct emu_alloc *a = t->alloc;
	bool persistent = t->persistent;

	cost(t->pt.entries, true);
	list_del_init(&t->node);
	unlink_table(t);
	free_table(t);
	atomic64_inc(&st_unpins);
	if (persistent && --a->persistent_pins == 0 && a->freed)
		release_bar(a);
	maybe_destroy(a);
}

/*
 * Non-persistent unpin, as RmP2PGetInfoWithoutToken() finds it: among the
 * pins of the calling process only. From any other process it finds
 * nothing, and nv-p2p.c turns "not found" into success: 0, with the pin, its
 * BAR1 mapping and its armed callback all left in place.
 */
static int put_pages(struct nvidia_p2p_page_table *pt)
{
	struct emu_table *t;
	int err;

	/* Covers -ENOMEM before RM and RM's other errors: nothing changes. */
	err = injected(INJ_PUT_PAGES);
	if (err) {
		atomic64_inc(&st_failed_unpins);
		return err;
	}
	err = rm_enter("nvidia_p2p_put_pages");
	if (err) {
		WARN(1, "nv_p2p_emu: nvidia_p2p_put_pages(%p) re-entered RM\n", pt);
		return err;
	}
	t = find_table(pt);
	if (!t || t->dying || t->persistent) {
		/* The free callback already took it: fine. */
		rm_unlock();
		return 0;
	}
	if (t->tgid != current->tgid) {
		atomic64_inc(&st_foreign_puts);
		pr_info_ratelimited("NVRM: nvidia_p2p_put_pages(%p) from process %d (%s), pinned by process %d: not found, pin and callback kept\n",
				    pt, current->tgid, current->comm, t->tgid);
		rm_unlock();
		return 0;
	}
	unpin(t);
	rm_unlock();
	return 0;
}

int nvidia_p2p_put_pages(uint64_t p2p_token, uint32_t va_space, uint64_t virtual_address,
			 struct nvidia_p2p_page_table *page_table)
{
	if (!page_table)
		return 0;
	u64 t0 = clock_start();

	return timed(t0, put_pages(page_table));
}
EXPORT_SYMBOL(nvidia_p2p_put_pages);

/* The real driver dereferences the freed page table here: a client bug the
 * run must fail on. */
static void stale_use(const char *fn, struct nvidia_p2p_page_table *pt)
{
	atomic64_inc(&st_stale);
	pr_err("HARNESS FAILURE: stale %s(%p)\n", fn, pt);
	WARN(1, "nv_p2p_emu: %s on a page table that is not live (use after free in the real driver)\n", fn);
}

/* Persistent unpin: found through the page table itself, whatever the process. */
static int put_pages_persistent(struct nvidia_p2p_page_table *pt)
{
	struct emu_table *t;
	int err;

	err = injected(INJ_PUT_PAGES_PERSISTENT);
	if (err) {
		atomic64_inc(&st_failed_unpins);
		return err;
	}
	err = rm_enter("nvidia_p2p_put_pages_persistent");
	if (err) {
		WARN(1, "nv_p2p_emu: nvidia_p2p_put_pages_persistent(%p) re-entered RM\n", pt);
		return err;
	}
	t = find_table(pt);
	if (!t || !t->persistent) {
		rm_unlock();
		stale_use("nvidia_p2p_put_pages_persistent", pt);
		return -EINVAL;
	}
	unpin(t);
	rm_unlock();
	return 0;
}

int nvidia_p2p_put_pages_persistent(uint64_t virtual_address,
				    struct nvidia_p2p_page_table *page_table, uint32_t flags)
{
	if (flags)
		return -EINVAL;
	if (!page_table)
		return 0;
	u64 t0 = clock_start();

	return timed(t0, put_pages_persistent(page_table));
}
EXPORT_SYMBOL(nvidia_p2p_put_pages_persistent);

static u32 xorshift32(u32 *s)
{
	u32 x = *s;

	x ^= x << 13;
	x ^= x >> 17;
	x ^= x << 5;
	return *s = x;
}

/*
 * The mapping itself (RM's part): dma_addresses[] holds the physical
 * addresses on entry and the DMA addresses on success. rm_api_lock held.
 */
static int map_pages(struct emu_mapping *em, struct pci_dev *peer, u32 n, u32 style)
{
	u64 *addr = em->m.dma_addresses;
	u32 *order = NULL;
	u32 i, k, r;

	if (style == DMA_MAP_RUNS) {
		/* One dma_map_resource per physically contiguous run:
		 * contiguous bus addresses, as without translation. */
		for (i = 0; i < n; i = r) {
			phys_addr_t start = addr[i];
			dma_addr_t dma;
			u64 len;

			for (r = i + 1; r < n; r++)
				if (addr[r] != start + (u64)(r - i) * GPU_PAGE)
					break;
			len = (u64)(r - i) * GPU_PAGE;
			dma = emu_map(&peer->dev, start, len);
			if (dma_mapping_error(&peer->dev, dma))
				return -EIO;
			em->runs[em->nruns].dma = dma;
			em->runs[em->nruns].len = len;
			em->nruns++;
			for (k = i; k < r; k++)
				addr[k] = dma + (u64)(k - i) * GPU_PAGE;
		}
		return 0;
	}
	if (style == DMA_MAP_SHUFFLED && n > 1) {
		/* A seeded permutation: under a translating IOMMU consecutive
		 * pages then get scattered IOVAs. */
		static atomic_t seed;
		u32 s = (u32)atomic_inc_return(&seed) * 2654435761u | 1;

		order = kvmalloc_array(n, sizeof(*order), GFP_KERNEL);
		if (!order)
			return -ENOMEM;
		for (i = 0; i < n; i++)
			order[i] = i;
		for (i = n - 1; i > 0; i--) {
			k = xorshift32(&s) % (i + 1);
			swap(order[i], order[k]);
		}
	}
	/* RM's way: one mapping per 64 KiB page (nv_dma_map_peer). */
	for (k = 0; k < n; k++) {
		dma_addr_t dma;

		i = order ? order[k] : k;
		dma = emu_map(&peer->dev, addr[i], GPU_PAGE);
		if (dma_mapping_error(&peer->dev, dma)) {
			kvfree(order);
			return -EIO;
		}
		em->runs[em->nruns].dma = dma;
		em->runs[em->nruns].len = GPU_PAGE;
		em->nruns++;
		addr[i] = dma;
	}
	kvfree(order);
	return 0;
}

static struct emu_gpu *gpu_by_uuid(const u8 *uuid)
{
	int i;

	for (i = 0; i < ngpus; i++)
		if (!gpus[i]->gone && !memcmp(gpus[i]->uuid, uuid, NVIDIA_P2P_GPU_UUID_LEN))
			return gpus[i];
	return NULL;
}

static int dma_map_pages(struct pci_dev *peer, struct nvidia_p2p_page_table *page_table,
			 struct nvidia_p2p_dma_mapping **dma_mapping)
{
	u8 uuid[NVIDIA_P2P_GPU_UUID_LEN];
	struct emu_table *t;
	struct emu_mapping *em;
	struct emu_gpu *g;
	u32 i, n, ps;
	int err;

	if (!peer || !page_table || !dma_mapping || !page_table->gpu_uuid)
		return -EINVAL;
	/* Like the real driver: trust the pointer and read the table before
	 * entering RM (KASAN flags a freed one; a reused one is silently read). */
	t = container_of(page_table, struct emu_table, pt);
	if (t->force_bar1)
		return -ENOTSUPP;
	(void)READ_ONCE(page_table->version);
	ps = READ_ONCE(page_table->page_size);
	if (WARN_ON(ps != NVIDIA_P2P_PAGE_SIZE_64KB))
		return -EINVAL;
	n = READ_ONCE(page_table->entries);
	em = kzalloc(sizeof(*em), GFP_KERNEL);
	if (!em)
		return -ENOMEM;
	em->m.dma_addresses = kvcalloc(n, sizeof(u64), GFP_KERNEL);
	em->runs = kcalloc(n, sizeof(*em->runs), GFP_KERNEL);
	if (!em->m.dma_addresses || !em->runs) {
		err = -ENOMEM;
		goto fail;
	}
	memcpy(uuid, page_table->gpu_uuid, sizeof(uuid));
	for (i = 0; i < n; i++)
		em->m.dma_addresses[i] = page_table->pages[i]->physical_address;

	/* rm_p2p_dma_map_pages(): under the RM lock. */
	err = rm_enter("nvidia_p2p_dma_map_pages");
	if (err)
		goto fail;
	err = injected(INJ_DMA_MAP);
	if (err)
		goto unlock;
	g = gpu_by_uuid(uuid);
	if (!g) {
		err = -EINVAL;
		goto unlock;
	}
	if (!topo_supported(g, peer)) {
		atomic64_inc(&st_topo_refusals);
		pr_info_ratelimited("NVRM: GPU %d (%s) and peer %s: GPUDirect RDMA not supported by topology (no common PCIe switch)\n",
				    g->index, pci_name(g->pdev), pci_name(peer));
		err = -ENOTSUPP;
		goto unlock;
	}
	err = map_pages(em, peer, n, READ_ONCE(dma_map_style));
unlock:
	rm_unlock();
	if (err)
		goto fail;

	em->m.version = dma_mapping_version;
	em->m.page_size_type = ps;
	em->m.entries = n;
	em->m.pci_dev = peer;
	/* Linked to the table after leaving RM, like nv_p2p_insert_dma_mapping(). */
	spin_lock(&table_lock);
	if (find_table(page_table) != t) {
		spin_unlock(&table_lock);
		stale_use("nvidia_p2p_dma_map_pages", page_table);
		err = -EINVAL;
		goto fail;
	}
	list_add_tail(&em->node, &t->mappings);
	spin_unlock(&table_lock);
	atomic64_inc(&st_live_maps);
	atomic64_inc(&st_dma_maps);
	atomic64_add(mapping_bytes(em), &st_bytes);
	*dma_mapping = &em->m;
	return 0;

fail:
	for (i = 0; i < em->nruns; i++)
		emu_unmap(&peer->dev, em->runs[i].dma, em->runs[i].len);
	kvfree(em->m.dma_addresses);
	kfree(em->runs);
	kfree(em);
	return err;
}

/*
 * The peers a client asked dma_map_pages to map for (mapped_for in debugfs:
 * their PCI names, at most 16; writing empties the list): a client must ask
 * only about devices that are its RDMA peers.
 */
static struct pci_dev *asked_for[16];
static DEFINE_SPINLOCK(asked_lock);

static void note_asked(struct pci_dev *peer)
{
	int i;

	spin_lock(&asked_lock);
	for (i = 0; i < ARRAY_SIZE(asked_for) && asked_for[i] != peer; i++) {
		if (!asked_for[i]) {
			asked_for[i] = pci_dev_get(peer);
			break;
		}
	}
	spin_unlock(&asked_lock);
}

static void forget_asked(void)
{
	struct pci_dev *gone[ARRAY_SIZE(asked_for)];
	int i;

	spin_lock(&asked_lock);
	memcpy(gone, asked_for, sizeof(gone));
	memset(asked_for, 0, sizeof(asked_for));
	spin_unlock(&asked_lock);
	for (i = 0; i < ARRAY_SIZE(gone); i++)
		pci_dev_put(gone[i]);
}

static int mapped_for_show(struct seq_file *m, void *v)
{
	int i;

	spin_lock(&asked_lock);
	for (i = 0; i < ARRAY_SIZE(asked_for) && asked_for[i]; i++)
		seq_printf(m, "%s\n", pci_name(asked_for[i]));
	spin_unlock(&asked_lock);
	return 0;
}

static int mapped_for_open(struct inode *inode, struct file *f)
{
	return single_open(f, mapped_for_show, NULL);
}

static ssize_t mapped_for_write(struct file *f, const char __user *ubuf, size_t n, loff_t *pos)
{
	forget_asked();
	return n;
}

static const struct file_operations mapped_for_fops = {
	.owner = THIS_MODULE,
	.open = mapped_for_open,
	.read = seq_read,
	.llseek = seq_lseek,
	.release = single_release,
	.write = mapped_for_write,
};

int nvidia_p2p_dma_map_pages(struct pci_dev *peer, struct nvidia_p2p_page_table *page_table,
			     struct nvidia_p2p_dma_mapping **dma_mapping)
{
	u64 t0 = clock_start();
	int ret;

	if (peer)
		note_asked(peer);
	ret = dma_map_pages(peer, page_table, dma_mapping);

	if (t0)
		atomic64_add(ktime_get_ns() - t0, &st_map_ns);
	return timed(t0, ret);
}
EXPORT_SYMBOL(nvidia_p2p_dma_map_pages);

/*
 * Never enters RM (nv-p2p.c unlinks the mapping from the table's own list),
 * so it works from inside a free callback. The table must still be one RM
 * knows: on a freed one the real driver takes a freed semaphore.
 */
static int dma_unmap_pages(struct pci_dev *peer, struct nvidia_p2p_page_table *page_table,
			   struct nvidia_p2p_dma_mapping *dma_mapping)
{
	struct emu_table *t;
	struct emu_mapping *em, *found = NULL;
	int err;

	if (!peer || !page_table || !dma_mapping)
		return -EINVAL;
	err = injected(INJ_DMA_UNMAP);
	if (err)
		return err;
	spin_lock(&table_lock);
	t = find_table(page_table);
	if (!t) {
		spin_unlock(&table_lock);
		stale_use("nvidia_p2p_dma_unmap_pages", page_table);
		return 0;
	}
	list_for_each_entry(em, &t->mappings, node) {
		if (&em->m == dma_mapping) {
			list_del(&em->node);
			found = em;
			break;
		}
	}
	spin_unlock(&table_lock);
	if (!found)
		return 0;
	WARN_ON(peer != found->m.pci_dev);
	free_mapping(found);
	return 0;
}

int nvidia_p2p_dma_unmap_pages(struct pci_dev *peer, struct nvidia_p2p_page_table *page_table,
			       struct nvidia_p2p_dma_mapping *dma_mapping)
{
	u64 t0 = clock_start();
	int ret = dma_unmap_pages(peer, page_table, dma_mapping);

	if (t0)
		atomic64_add(ktime_get_ns() - t0, &st_map_ns);
	return timed(t0, ret);
}
EXPORT_SYMBOL(nvidia_p2p_dma_unmap_pages);

int nvidia_p2p_free_page_table(struct nvidia_p2p_page_table *page_table)
{
	return 0;
}
EXPORT_SYMBOL(nvidia_p2p_free_page_table);

int nvidia_p2p_free_dma_mapping(struct nvidia_p2p_dma_mapping *dma_mapping)
{
	return 0;
}
EXPORT_SYMBOL(nvidia_p2p_free_dma_mapping);

int nvidia_p2p_init_mapping(uint64_t p2p_token, struct nvidia_p2p_params *params,
			    void (*destroy_callback)(void *data), void *data)
{
	return -ENOTSUPP;
}
EXPORT_SYMBOL(nvidia_p2p_init_mapping);

int nvidia_p2p_destroy_mapping(uint64_t p2p_token)
{
	return -ENOTSUPP;
}
EXPORT_SYMBOL(nvidia_p2p_destroy_mapping);

/* --- user interface: "cudaMalloc/cudaFree" -------------------------------- */

/*
 * The allocations made by mmap (NVEMU_MMAP_ALLOC), newest last, for the
 * harness to find an unmodified program's GPU buffers: debugfs mmap_allocs,
 * one line each: "pid <tgid> gpu <i> bar_offset <bytes> size <bytes> va <hex>".
 */
#define MMAP_LOG 32
static struct {
	pid_t pid;
	int gpu;
	u64 bar_offset, size, va;
} mmap_log[MMAP_LOG];
static unsigned int mmap_log_n;	/* entries ever made; rm_api_lock */

static void mmap_log_add(struct emu_alloc *a, u64 size)
{
	unsigned int i = mmap_log_n++ % MMAP_LOG;

	mmap_log[i].pid = current->tgid;
	mmap_log[i].gpu = a->gpu->index;
	mmap_log[i].bar_offset = a->chunk * GPU_PAGE;
	mmap_log[i].size = size;
}

static int mmap_allocs_show(struct seq_file *m, void *v)
{
	unsigned int i;

	rm_lock();
	i = mmap_log_n > MMAP_LOG ? mmap_log_n - MMAP_LOG : 0;
	for (; i < mmap_log_n; i++)
		seq_printf(m, "pid %d gpu %d bar_offset %llu size %llu\n", mmap_log[i % MMAP_LOG].pid,
			   mmap_log[i % MMAP_LOG].gpu, mmap_log[i % MMAP_LOG].bar_offset,
			   mmap_log[i % MMAP_LOG].size);
	rm_unlock();
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(mmap_allocs);

/*
 * debugfs gpu<i>_mem: the GPU's memory (its BAR) as a file, read and
 * written by the CPU at any offset, whoever owns it: how the harness checks
 * the bytes a device moved into an unmodified program's buffer, also after
 * that program has exited (freed memory keeps its bytes until reused).
 */
static ssize_t gpu_mem_rw(struct file *f, char __user *ubuf, size_t n, loff_t *pos, bool wr)
{
	struct emu_gpu *g = f->private_data;
	void __iomem *p;
	phys_addr_t base;
	void *tmp;
	ssize_t ret = n;

	if (coherent)
		return -EOPNOTSUPP;
	if (*pos < 0 || *pos >= g->size)
		return 0;
	n = min_t(u64, n, min_t(u64, g->size - *pos, GPU_PAGE));
	base = g->bar + ALIGN_DOWN(*pos, PAGE_SIZE);
	tmp = kmalloc(n, GFP_KERNEL);
	p = ioremap_wc(base, PAGE_ALIGN(*pos - ALIGN_DOWN(*pos, PAGE_SIZE) + n));
	if (!tmp || !p) {
		ret = -ENOMEM;
		goto out;
	}
	if (wr) {
		if (copy_from_user(tmp, (const char __user *)ubuf, n)) {
			ret = -EFAULT;
			goto out;
		}
		memcpy_toio(p + (*pos - ALIGN_DOWN(*pos, PAGE_SIZE)), tmp, n);
	} else {
		memcpy_fromio(tmp, p + (*pos - ALIGN_DOWN(*pos, PAGE_SIZE)), n);
		if (copy_to_user(ubuf, tmp, n)) {
			ret = -EFAULT;
			goto out;
		}
	}
	*pos += n;
	ret = n;
out:
	if (p)
		iounmap(p);
	kfree(tmp);
	return ret;
}

static ssize_t gpu_mem_read(struct file *f, char __user *ubuf, size_t n, loff_t *pos)
{
	return gpu_mem_rw(f, ubuf, n, pos, false);
}

static ssize_t gpu_mem_write(struct file *f, const char __user *ubuf, size_t n, loff_t *pos)
{
	return gpu_mem_rw(f, (char __user *)ubuf, n, pos, true);
}

static const struct file_operations gpu_mem_fops = {
	.owner = THIS_MODULE,
	.open = simple_open,
	.read = gpu_mem_read,
	.write = gpu_mem_write,
	.llseek = default_llseek,
};

/*
 * debugfs cudafree: "<gpu> <bar_offset>" frees the allocation that starts
 * there, as its owner's cudaFree would (free callbacks now, under the RM
 * lock; persistent pins keep the memory); its mapping stays, as after the
 * FREE ioctl. For programs the harness cannot change (perftest).
 */
static ssize_t cudafree_write(struct file *f, const char __user *ubuf, size_t n, loff_t *pos)
{
	char buf[64];
	unsigned int gpu;
	u64 off;
	struct emu_alloc *a, *found = NULL;
	unsigned int cbs = 0;

	if (n >= sizeof(buf) || copy_from_user(buf, ubuf, n))
		return -EINVAL;
	buf[n] = 0;
	if (sscanf(buf, "%u %llu", &gpu, &off) != 2 || gpu >= ngpus)
		return -EINVAL;
	rm_lock();
	list_for_each_entry(a, &allocs, node) {
		if (a->gpu == gpus[gpu] && a->chunk * GPU_PAGE == off && !a->freed) {
			found = a;
			break;
		}
	}
	if (found)
		cbs = free_alloc(found);
	rm_unlock();
	if (!found)
		return -ENOENT;
	pr_info("cudaFree of GPU %u offset %llu by the harness: %u free callback(s)\n", gpu, off, cbs);
	return n;
}

static const struct file_operations cudafree_fops = {
	.owner = THIS_MODULE,
	.write = cudafree_write,
};

/*
 * munmap, or the owner's exit. With deferred_teardown_ms set, an exit's
 * teardown goes to the nv_queue kernel thread instead (RM's deferred fd
 * close): the callbacks then come from a kernel thread after the owner is
 * gone, and after the owner's other files (its RDMA fd) were closed.
 */
static void emu_vma_close(struct vm_area_struct *vma)
{
	struct emu_alloc *a = vma->vm_private_data;
	u32 ms = READ_ONCE(deferred_teardown_ms);

	rm_lock();
	a->mapped = false;
	if (ms && (current->flags & PF_EXITING) && !a->freed) {
		a->deferred = true;
		a->defer_until = jiffies + msecs_to_jiffies(ms);
		a->holds++;
		kthread_queue_work(nv_queue, &a->defer_work);
		rm_unlock();
		return;
	}
	free_alloc(a);
	maybe_destroy(a);
	rm_unlock();
}

static int emu_vma_may_split(struct vm_area_struct *vma, unsigned long addr)
{
	return -EINVAL;	/* an allocation is freed whole */
}

static int emu_vma_mremap(struct vm_area_struct *vma)
{
	return -EINVAL;
}

static const struct vm_operations_struct emu_vm_ops = {
	.close = emu_vma_close,
	.may_split = emu_vma_may_split,
	.mremap = emu_vma_mremap,
};

static struct emu_alloc *alloc_on(u64 gpu, u64 size, struct file *file);

static int emu_mmap(struct file *file, struct vm_area_struct *vma)
{
	u64 off = (u64)vma->vm_pgoff << PAGE_SHIFT;
	u64 size = vma->vm_end - vma->vm_start;
	struct emu_alloc *a, *found = NULL;
	u64 i;
	int err;

	rm_lock();
	if (off < NVEMU_MMAP_ALLOC_END) {
		/*
		 * Allocate on mmap (NVEMU_MMAP_ALLOC): an unmodified program
		 * (perftest --mmap=/dev/nv_p2p_emu) gets GPU memory from a
		 * plain mmap of the file; the VMA owns the allocation.
		 */
		if ((off & 0xffffffffULL) || !IS_ALIGNED(vma->vm_start, GPU_PAGE)) {
			rm_unlock();
			return -EINVAL;
		}
		found = alloc_on(off >> 32, size, file);
		if (IS_ERR(found)) {
			rm_unlock();
			return PTR_ERR(found);
		}
		mmap_log_add(found, size);
	} else {
		list_for_each_entry(a, &allocs, node) {
			if (a->offset == off && a->file == file && !a->mapped && !a->freed &&
			    !a->deferred) {
				found = a;
				break;
			}
		}
		if (!found || found->size != size || !IS_ALIGNED(vma->vm_start, GPU_PAGE)) {
			rm_unlock();
			return -EINVAL;
		}
	}
	vm_flags_set(vma, VM_IO | VM_PFNMAP | VM_DONTEXPAND | VM_DONTCOPY | VM_DONTDUMP);
	if (coherent) {
		/* Cacheable RAM, chunk by chunk: still no struct page for GUP. */
		for (i = 0, err = 0; i < DIV_ROUND_UP(size, GPU_PAGE) && !err; i++)
			err = remap_pfn_range(vma, vma->vm_start + i * GPU_PAGE,
					      chunk_phys(found->gpu, found->chunk + i) >> PAGE_SHIFT,
					      min_t(u64, GPU_PAGE, size - i * GPU_PAGE),
					      vma->vm_page_prot);
	} else {
		vma->vm_page_prot = pgprot_writecombine(vma->vm_page_prot);
		err = io_remap_pfn_range(vma, vma->vm_start,
					 chunk_phys(found->gpu, found->chunk) >> PAGE_SHIFT,
					 size, vma->vm_page_prot);
	}
	if (err) {
		if (off < NVEMU_MMAP_ALLOC_END) {
			found->freed = true;
			maybe_destroy(found);
		}
		rm_unlock();
		return err;
	}
	found->va = vma->vm_start;
	found->mapped = true;
	if (off < NVEMU_MMAP_ALLOC_END)
		mmap_log[(mmap_log_n - 1) % MMAP_LOG].va = vma->vm_start;
	vma->vm_private_data = found;
	vma->vm_ops = &emu_vm_ops;
	rm_unlock();
	return 0;
}

/* 64 KiB-aligned placement for the mapping, like the CUDA VA allocator. */
static unsigned long emu_get_unmapped_area(struct file *file, unsigned long addr,
					   unsigned long len, unsigned long pgoff, unsigned long flags)
{
	unsigned long a;

	if (flags & MAP_FIXED)
		return IS_ALIGNED(addr, GPU_PAGE) ? addr : -EINVAL;
	a = mm_get_unmapped_area(file, 0, len + GPU_PAGE, 0, flags);

	if (IS_ERR_VALUE(a))
		return a;
	return ALIGN(a, GPU_PAGE);
}

/* "cudaMalloc" of @size bytes on GPU @gpu for @file. rm_api_lock held. */
static struct emu_alloc *alloc_on(u64 gpu, u64 size, struct file *file)
{
	struct emu_alloc *a;
	struct emu_gpu *g;
	unsigned long chunks, start;

	if (gpu >= ngpus || !size || size > (1ULL << 40))
		return ERR_PTR(-EINVAL);
	g = gpus[gpu];
	if (g->gone)
		return ERR_PTR(-ENODEV);
	chunks = DIV_ROUND_UP(size, GPU_PAGE);
	a = kzalloc(sizeof(*a), GFP_KERNEL);
	if (!a)
		return ERR_PTR(-ENOMEM);
	INIT_LIST_HEAD(&a->tables);
	INIT_WORK(&a->race_work, race_free_fn);
	kthread_init_work(&a->defer_work, deferred_teardown_fn);
	start = bitmap_find_next_zero_area(g->used, g->nchunks, 0, chunks, 0);
	if (start >= g->nchunks || coherent_ram(g, start, chunks)) {
		kfree(a);
		return ERR_PTR(-ENOMEM);
	}
	bitmap_set(g->used, start, chunks);
	a->gpu = g;
	a->file = file;
	a->mm = current->mm;
	a->chunk = start;
	a->size = (u64)chunks * GPU_PAGE;
	a->offset = ((u64)(g->index + 1) << 40) + (u64)start * GPU_PAGE;
	list_add_tail(&a->node, &allocs);
	return a;
}

static long emu_alloc_ioctl(struct file *file, struct nvemu_alloc __user *uarg)
{
	struct nvemu_alloc arg;
	struct emu_alloc *a;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	rm_lock();
	a = alloc_on(arg.gpu, arg.size, file);
	if (IS_ERR(a)) {
		rm_unlock();
		return PTR_ERR(a);
	}
	arg.offset = a->offset;
	arg.size = a->size;
	rm_unlock();
	if (copy_to_user(uarg, &arg, sizeof(arg)))
		return -EFAULT;	/* freed when the file closes */
	return 0;
}

static long emu_free_ioctl(u64 __user *uva)
{
	struct emu_alloc *a, *found = NULL;
	u64 va;

	if (get_user(va, uva))
		return -EFAULT;
	rm_lock();
	list_for_each_entry(a, &allocs, node) {
		if (a->mapped && !a->freed && a->mm == current->mm && a->va == va) {
			found = a;
			break;
		}
	}
	if (found)
		free_alloc(found);
	rm_unlock();
	return found ? 0 : -EINVAL;
}

static long emu_info_ioctl(struct nvemu_info __user *uarg)
{
	struct nvemu_info info = {};
	struct emu_alloc *a;
	int i;

	rm_lock();
	info.gpus = ngpus;
	for (i = 0; i < ngpus; i++) {
		if (gpus[i]->gone)
			continue;
		info.bar_size[i] = gpus[i]->bar1_budget;
		info.bar_free[i] = gpus[i]->bar1_budget - gpus[i]->bar1_used;
	}
	list_for_each_entry(a, &allocs, node)
		if (!a->released)
			info.live_allocs++;
	rm_unlock();
	info.pins = atomic64_read(&st_pins);
	info.persistent_pins = atomic64_read(&st_ppins);
	info.unpins = atomic64_read(&st_unpins);
	info.callbacks = atomic64_read(&st_callbacks);
	info.live_tables = atomic64_read(&st_live_tables);
	info.live_mappings = atomic64_read(&st_live_maps);
	info.dma_maps = atomic64_read(&st_dma_maps);
	info.provider_bytes = atomic64_read(&st_bytes);
	info.provider_ns = atomic64_read(&st_ns);
	info.provider_map_ns = atomic64_read(&st_map_ns);
	info.foreign_puts = atomic64_read(&st_foreign_puts);
	info.failed_unpins = atomic64_read(&st_failed_unpins);
	info.stale_puts = atomic64_read(&st_stale);
	info.deferred_callbacks = atomic64_read(&st_deferred_cbs);
	info.reused_tables = atomic64_read(&st_reused);
	info.topo_refusals = atomic64_read(&st_topo_refusals);
	info.rm_reentries = atomic64_read(&st_reentries);
	return copy_to_user(uarg, &info, sizeof(info)) ? -EFAULT : 0;
}

static long emu_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	switch (cmd) {
	case NVEMU_IOC_ALLOC:
		return emu_alloc_ioctl(file, (void __user *)arg);
	case NVEMU_IOC_FREE:
		return emu_free_ioctl((u64 __user *)arg);
	case NVEMU_IOC_INFO:
		return emu_info_ioctl((void __user *)arg);
	}
	return -ENOTTY;
}

/* Allocations never mapped die with the file (mapped ones die with the VMA,
 * which holds the file open; deferred ones on nv_queue). */
static int emu_release(struct inode *inode, struct file *file)
{
	struct emu_alloc *a, *tmp;

	rm_lock();
	list_for_each_entry_safe(a, tmp, &allocs, node) {
		if (a->file == file && !a->mapped && !a->deferred) {
			free_alloc(a);
			maybe_destroy(a);
		}
	}
	rm_unlock();
	return 0;
}

static const struct file_operations emu_fops = {
	.owner = THIS_MODULE,
	.unlocked_ioctl = emu_ioctl,
	.mmap = emu_mmap,
	.get_unmapped_area = emu_get_unmapped_area,
	.release = emu_release,
};

static struct miscdevice emu_misc = {
	.minor = MISC_DYNAMIC_MINOR,
	.name = "nv_p2p_emu",
	.fops = &emu_fops,
	.mode = 0666,
};

/* --- the "GPUs" ---------------------------------------------------------- */

/*
 * A GPU keeps its index (and uuid) across unbind and rebind, as a GPU keeps
 * its identity; its BAR is read anew at each bind (a resize needs an unbind).
 */
static struct emu_gpu *gpu_of_pdev(struct pci_dev *pdev)
{
	u32 bdf = (u32)pci_domain_nr(pdev->bus) << 16 | pci_dev_id(pdev);
	int i;

	for (i = 0; i < ngpus; i++) {
		if (gpus[i]->bdf == bdf) {
			gpus[i]->pdev = pdev;	/* a new pci_dev after a rescan */
			return gpus[i];
		}
	}
	if (ngpus >= MAX_GPUS)
		return NULL;
	gpus[ngpus] = kzalloc(sizeof(*gpus[ngpus]), GFP_KERNEL);
	if (!gpus[ngpus])
		return NULL;
	gpus[ngpus]->pdev = pdev;
	gpus[ngpus]->bdf = bdf;
	gpus[ngpus]->index = ngpus;
	gpus[ngpus]->gone = true;
	return gpus[ngpus++];
}

static void gpu_free_pages(struct emu_gpu *g)
{
	unsigned long c;

	for (c = 0; g->ram && c < g->nchunks; c++)
		if (g->ram[c])
			__free_pages(g->ram[c], get_order(GPU_PAGE));
	kvfree(g->ram);
	g->ram = NULL;
	bitmap_free(g->used);
	kvfree(g->bar1_refs);
	g->used = NULL;
	g->bar1_refs = NULL;
}

static int emu_probe(struct pci_dev *pdev, const struct pci_device_id *id)
{
	struct emu_gpu *g;
	int err;

	err = pcim_enable_device(pdev);
	if (err)
		return err;
	/* A GPU is a bus master, as nvidia.ko makes it (K/nv-pci.c nv_pci_probe). */
	pci_set_master(pdev);
	rm_lock();
	g = gpu_of_pdev(pdev);
	err = g ? 0 : -ENOSPC;
	if (err)
		goto out;
	g->bar = pci_resource_start(pdev, 2);
	g->size = pci_resource_len(pdev, 2) & ~(GPU_PAGE - 1);
	err = -ENODEV;
	if (!g->bar || g->size < GPU_PAGE)
		goto out;
	g->bar1_budget = bar1_size_mb ? min_t(u64, (u64)bar1_size_mb << 20, g->size) : g->size;
	g->bar1_used = 0;
	g->nchunks = g->size / GPU_PAGE;
	g->used = bitmap_zalloc(g->nchunks, GFP_KERNEL);
	g->bar1_refs = kvcalloc(g->nchunks, sizeof(*g->bar1_refs), GFP_KERNEL);
	g->ram = coherent ? kvcalloc(g->nchunks, sizeof(*g->ram), GFP_KERNEL) : NULL;
	err = -ENOMEM;
	if (!g->used || !g->bar1_refs || (coherent && !g->ram)) {
		gpu_free_pages(g);
		goto out;
	}
	memset(g->uuid, 0x60 + g->index, sizeof(g->uuid));
	WRITE_ONCE(g->gone, false);
	err = 0;
out:
	rm_unlock();
	if (err)
		return err;
	pci_set_drvdata(pdev, g);
	dev_info(&pdev->dev, "emulated GPU %d: BAR %pa, %llu MiB, BAR1 budget %llu MiB\n",
		 g->index, &g->bar, g->size >> 20, g->bar1_budget >> 20);
	return 0;
}

/*
 * nv_pci_remove() waits while the GPU is in use ("Attempting to remove
 * device ... with non-zero usage count"): here, until no allocation on it is
 * left, so every pin of its memory ended (free callbacks included) first.
 */
static void emu_remove(struct pci_dev *pdev)
{
	struct emu_gpu *g = pci_get_drvdata(pdev);
	struct emu_alloc *a;
	bool busy, said = false;

	for (;;) {
		busy = false;
		rm_lock();
		list_for_each_entry(a, &allocs, node)
			busy |= a->gpu == g;
		/* Unloading: no file is open, nothing of the GPU is used again. */
		if (READ_ONCE(unloading))
			busy = false;
		if (!busy) {
			WRITE_ONCE(g->gone, true);
			gpu_free_pages(g);
		}
		rm_unlock();
		if (!busy)
			break;
		if (!said)
			pr_info("NVRM: Attempting to remove device %s with non-zero usage count!\n",
				pci_name(pdev));
		said = true;
		msleep(20);
	}
	dev_info(&pdev->dev, "emulated GPU %d removed\n", g->index);
}

static const struct pci_device_id emu_ids[] = {
	{ PCI_DEVICE(0x1af4, 0x1110) },	/* ivshmem */
	{ }
};
MODULE_DEVICE_TABLE(pci, emu_ids);

static struct pci_driver emu_driver = {
	.name = "nv_p2p_emu",
	.id_table = emu_ids,
	.probe = emu_probe,
	.remove = emu_remove,
};

/*
 * Test cleanup: ends the persistent pins of memory its owner has freed,
 * which their client gave up after a failed nvidia_p2p_put_pages_persistent
 * (nvidia.ko keeps such a pin, and the memory's BAR1 space, until it
 * unloads). Any write does it.
 */
static ssize_t lost_write(struct file *f, const char __user *ubuf, size_t n, loff_t *pos)
{
	struct emu_alloc *a, *atmp;
	struct emu_table *t, *tmp;
	int err = rm_enter("reclaim_lost_pins");

	if (err)
		return err;
	list_for_each_entry_safe(a, atmp, &allocs, node) {
		int left = a->persistent_pins;

		if (!a->freed)
			continue;
		list_for_each_entry_safe(t, tmp, &a->tables, node) {
			if (!t->persistent || left <= 0)
				continue;
			/* The last one may free @a: nothing of it is used after. */
			if (--left == 0) {
				unpin(t);
				break;
			}
			unpin(t);
		}
	}
	rm_unlock();
	return n;
}

static const struct file_operations lost_fops = {
	.owner = THIS_MODULE,
	.write = lost_write,
};

static int __init emu_init(void)
{
	int err, i;

	if (coherent && page_table_version >> 16 < 2) {
		pr_err("coherent GPUs need page table version 2 (580+), not %#x\n", page_table_version);
		return -EINVAL;
	}
	/* Before the module goes live, when nvidia_peermem reads it. */
	if (driver_version) {
		const char *v = strcmp(driver_version, "none") ? kstrdup(driver_version, GFP_KERNEL) : NULL;

		kfree(THIS_MODULE->version);
		THIS_MODULE->version = v;
	}
	race_wq = alloc_workqueue("nv_p2p_emu_race", WQ_UNBOUND, 0);
	if (!race_wq)
		return -ENOMEM;
	nv_queue = kthread_run_worker(0, "nv_queue");
	if (IS_ERR(nv_queue)) {
		destroy_workqueue(race_wq);
		return PTR_ERR(nv_queue);
	}
	err = pci_register_driver(&emu_driver);
	if (err)
		goto out_workers;
	err = misc_register(&emu_misc);
	if (err) {
		pci_unregister_driver(&emu_driver);
		goto out_workers;
	}
	dbg_dir = debugfs_create_dir("nv_p2p_emu", NULL);
	debugfs_create_file("inject", 0200, dbg_dir, NULL, &inject_fops);
	debugfs_create_u32("free_delay_ms", 0600, dbg_dir, &free_delay_ms);
	debugfs_create_atomic_t("race_free_on_pin", 0600, dbg_dir, &race_free_on_pin);
	debugfs_create_u32("dma_map_style", 0600, dbg_dir, &dma_map_style);
	debugfs_create_u32("deferred_teardown_ms", 0600, dbg_dir, &deferred_teardown_ms);
	debugfs_create_u32("reuse_tables", 0600, dbg_dir, &reuse_tables);
	debugfs_create_u32("callback_hold_ms", 0600, dbg_dir, &callback_hold_ms);
	debugfs_create_atomic_t("callbacks_running", 0400, dbg_dir, &callbacks_running);
	debugfs_create_file_unsafe("p2p_unsupported_chipset", 0600, dbg_dir, NULL, &chipset_fops);
	debugfs_create_u32("topo_check_override", 0600, dbg_dir, &topo_check_override);
	debugfs_create_u32("passthrough_gpus", 0600, dbg_dir, &passthrough_gpus);
	debugfs_create_file("mapped_for", 0600, dbg_dir, NULL, &mapped_for_fops);
	if (proc_mkdir("driver/nvidia", NULL))
		proc_create_single("driver/nvidia/params", 0444, NULL, params_show);
	debugfs_create_file("reclaim_lost_pins", 0200, dbg_dir, NULL, &lost_fops);
	debugfs_create_file("mmap_allocs", 0400, dbg_dir, NULL, &mmap_allocs_fops);
	debugfs_create_file("cudafree", 0200, dbg_dir, NULL, &cudafree_fops);
	for (i = 0; i < ngpus; i++) {
		char name[16];

		snprintf(name, sizeof(name), "gpu%d_mem", i);
		debugfs_create_file(name, 0600, dbg_dir, gpus[i], &gpu_mem_fops);
	}
	for (i = 0; i < INJ_COUNT; i++)
		atomic_set(&inj_left[i], 0);
	pr_info("%d emulated GPU(s), page table version %#x%s%s\n", ngpus, page_table_version,
		coherent ? ", coherent" : "", mig ? ", MIG" : "");
	return 0;

out_workers:
	kthread_destroy_worker(nv_queue);
	destroy_workqueue(race_wq);
	return err;
}

static void __exit emu_exit(void)
{
	debugfs_remove_recursive(dbg_dir);
	remove_proc_subtree("driver/nvidia", NULL);
	present_altra(false);
	forget_asked();
	misc_deregister(&emu_misc);
	/* No file is open and every client module is gone; queued teardowns
	 * still run (now, and without calling into unloaded clients) before
	 * the GPUs go away. */
	WRITE_ONCE(unloading, true);
	destroy_workqueue(race_wq);
	kthread_destroy_worker(nv_queue);
	while (table_cached)
		kfree(table_cache[--table_cached]);
	pci_unregister_driver(&emu_driver);
	while (ngpus)
		kfree(gpus[--ngpus]);
}

module_init(emu_init);
module_exit(emu_exit);
MODULE_DESCRIPTION("peermem-rs testbed: emulated NVIDIA GPUs and p2p API over ivshmem");
MODULE_LICENSE("Dual MIT/GPL");
