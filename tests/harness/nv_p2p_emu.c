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
 * and reproduces the behaviour a client must cope with: 64 KiB alignment,
 * NULL free callbacks refused, only the owning process may pin, ranges must
 * lie in one allocation, BAR1 exhaustion, free callbacks run synchronously
 * under the driver's lock on free, and the page table with all its DMA
 * mappings is freed right after the callback returns (KASAN sees any later
 * use); put_pages after the callback returns 0.
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
#include <linux/miscdevice.h>
#include <linux/mman.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/pci.h>
#include <linux/sched/mm.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/workqueue.h>

#include "nv-p2p.h"
#include "uapi.h"

#ifndef NVIDIA_P2P_FLAGS_FORCE_BAR1_MAPPING	/* 570+ headers */
#define NVIDIA_P2P_FLAGS_FORCE_BAR1_MAPPING 1
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

static unsigned int dma_mapping_version = NVIDIA_P2P_DMA_MAPPING_VERSION;
module_param(dma_mapping_version, uint, 0444);
MODULE_PARM_DESC(dma_mapping_version, "nvidia_p2p_dma_mapping.version to report");

static unsigned int page_size_type = NVIDIA_P2P_PAGE_SIZE_64KB;
module_param(page_size_type, uint, 0444);
MODULE_PARM_DESC(page_size_type, "page_size of page tables (1 = 64 KiB, as every real GPU)");

static unsigned int bar1_size_mb;
module_param(bar1_size_mb, uint, 0444);
MODULE_PARM_DESC(bar1_size_mb, "usable BAR1 per GPU in MiB for pinning (0: the whole BAR)");

static unsigned int pin_cost_us;
module_param(pin_cost_us, uint, 0644);
MODULE_PARM_DESC(pin_cost_us, "cost model: fixed delay per pin/unpin call, microseconds");

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
};

struct emu_alloc {
	struct list_head node;
	struct emu_gpu *gpu;
	struct file *file;
	struct mm_struct *mm;	/* owner, compared only */
	u64 chunk;		/* first 64 KiB chunk in the BAR */
	u64 size;
	u64 offset;		/* mmap offset */
	u64 va;			/* 0 until mapped */
	bool mapped;		/* a VMA maps it */
	bool freed;		/* cudaFree'd: no new pins */
	bool released;		/* BAR space returned */
	int persistent_pins;
	struct list_head tables;
};

/* A page table as the driver allocates it: the public struct first, then the
 * 2.0 `flags` field at offset 32, then our bookkeeping. */
struct emu_table {
	struct nvidia_p2p_page_table pt;
	u32 flags_v2;
	struct list_head node;		/* in alloc->tables */
	struct hlist_node hnode;	/* in live_tables, by address */
	struct emu_alloc *alloc;
	u64 first_chunk;		/* BAR page of entry 0 */
	bool persistent;
	bool force_bar1;
	void (*cb)(void *data);
	void *data;
	spinlock_t lock;		/* mappings */
	struct list_head mappings;
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

/* The driver's lock: held by every pin/unpin and by frees, across free callbacks. */
static DEFINE_MUTEX(rm_lock);
static LIST_HEAD(allocs);
/* Live page tables by address, like RM's tracker (O(1) lookups at any scale). */
static DEFINE_HASHTABLE(live_tables, 16);

static atomic64_t st_pins, st_ppins, st_unpins, st_callbacks, st_live_tables, st_live_maps, st_dma_maps;
static atomic64_t st_bytes;	/* memory of live tables and mappings, as kmalloc rounds it */
static atomic64_t st_ns;	/* time inside the exported calls (benchmark: client's own share) */

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

static u64 kbytes(size_t n)
{
	return n <= 8 ? 8 : roundup_pow_of_two(n);
}

static u64 table_bytes(u64 n)
{
	return kbytes(sizeof(struct emu_table)) + kbytes(n * sizeof(void *)) +
	       kbytes(n * sizeof(struct nvidia_p2p_page)) + kbytes(NVIDIA_P2P_GPU_UUID_LEN);
}

static u64 mapping_bytes(u64 n)
{
	return kbytes(sizeof(struct emu_mapping)) + kbytes(n * sizeof(u64)) +
	       kbytes(n * sizeof(struct emu_run));
}

/* --- fault injection (debugfs) ------------------------------------------ */

enum { INJ_GET_PAGES, INJ_GET_PAGES_PERSISTENT, INJ_DMA_MAP, INJ_COUNT };
static const char *const inj_names[INJ_COUNT] = { "get_pages", "get_pages_persistent", "dma_map_pages" };
static atomic_t inj_left[INJ_COUNT];
static int inj_errno[INJ_COUNT];
static u32 free_delay_ms;
static atomic_t race_free_on_pin;
static struct dentry *dbg_dir;

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

/* --- allocations ---------------------------------------------------------- */

static void cost(u64 pages)
{
	if (pin_cost_us)
		usleep_range(pin_cost_us, pin_cost_us + 1);
	if (page_cost_ns && pages)
		ndelay(min_t(u64, pages * page_cost_ns, 100000000ULL));
}

static void release_bar(struct emu_alloc *a)
{
	if (a->released)
		return;
	a->released = true;
	bitmap_clear(a->gpu->used, a->chunk, a->size / GPU_PAGE);
}

/* BAR1 space of the pages [first, first + n) of @g. rm_lock held. */
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

/* Frees the struct once nothing refers to it. rm_lock held. */
static void maybe_destroy(struct emu_alloc *a)
{
	if (a->mapped || !a->freed || !list_empty(&a->tables) || a->persistent_pins)
		return;
	release_bar(a);
	list_del(&a->node);
	kfree(a);
}

static void free_mapping(struct emu_mapping *em)
{
	unsigned int i;
	struct device *dev = &em->m.pci_dev->dev;

	for (i = 0; i < em->nruns; i++)
		dma_unmap_resource(dev, em->runs[i].dma, em->runs[i].len, DMA_BIDIRECTIONAL, EMU_DMA_ATTRS);
	atomic64_sub(mapping_bytes(em->m.entries), &st_bytes);
	kvfree(em->m.dma_addresses);
	kfree(em->runs);
	kfree(em);
	atomic64_dec(&st_live_maps);
}

/* Unlinked table: free it and every DMA mapping made of it. */
static void free_table(struct emu_table *t)
{
	struct emu_mapping *em, *tmp;
	LIST_HEAD(doomed);

	spin_lock(&t->lock);
	list_splice_init(&t->mappings, &doomed);
	spin_unlock(&t->lock);
	list_for_each_entry_safe(em, tmp, &doomed, node)
		free_mapping(em);
	bar1_put(t->alloc->gpu, t->first_chunk, t->pt.entries);
	atomic64_sub(table_bytes(t->pt.entries), &st_bytes);
	kvfree(t->pt.pages);
	kvfree(t->page_structs);
	kfree(t->pt.gpu_uuid);
	kfree(t);
	atomic64_dec(&st_live_tables);
}

/* cudaFree: revoke every non-persistent pin (free callbacks, synchronously,
 * under the driver's lock), then free their tables. rm_lock held. */
static void free_alloc(struct emu_alloc *a)
{
	struct emu_table *t, *tmp;

	if (a->freed)
		return;
	a->freed = true;
	list_for_each_entry_safe(t, tmp, &a->tables, node) {
		if (t->persistent)
			continue;
		list_del_init(&t->node);
		hash_del(&t->hnode);
		atomic64_inc(&st_callbacks);
		if (free_delay_ms)
			msleep(free_delay_ms);
		t->cb(t->data);
		free_table(t);
	}
	if (!a->persistent_pins)
		release_bar(a);
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

struct race_work {
	struct work_struct work;
	struct emu_alloc *a;
};

static void race_free_fn(struct work_struct *w)
{
	struct race_work *rw = container_of(w, struct race_work, work);

	mutex_lock(&rm_lock);
	free_alloc(rw->a);
	maybe_destroy(rw->a);
	mutex_unlock(&rm_lock);
	kfree(rw);
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
	cost(n);

	t = kzalloc(sizeof(*t), GFP_KERNEL);
	if (!t)
		return -ENOMEM;
	t->pt.pages = kvcalloc(n, sizeof(*t->pt.pages), GFP_KERNEL);
	t->page_structs = kvcalloc(n, sizeof(*t->page_structs), GFP_KERNEL);
	t->pt.gpu_uuid = kmalloc(NVIDIA_P2P_GPU_UUID_LEN, GFP_KERNEL);
	if (!t->pt.pages || !t->page_structs || !t->pt.gpu_uuid) {
		err = -ENOMEM;
		goto out_free;
	}

	mutex_lock(&rm_lock);
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
	bar1_get(a->gpu, t->first_chunk, n);
	t->pt.version = page_table_version;
	t->pt.page_size = page_size_type;
	t->pt.entries = n;
	t->flags_v2 = 0;
	memcpy(t->pt.gpu_uuid, a->gpu->uuid, NVIDIA_P2P_GPU_UUID_LEN);
	for (i = 0; i < n; i++) {
		t->page_structs[i].physical_address =
			a->gpu->bar + (a->chunk * GPU_PAGE) + (va - a->va) + i * GPU_PAGE;
		t->pt.pages[i] = &t->page_structs[i];
	}
	t->alloc = a;
	t->persistent = persistent;
	t->force_bar1 = flags & NVIDIA_P2P_FLAGS_FORCE_BAR1_MAPPING;
	t->cb = cb;
	t->data = data;
	spin_lock_init(&t->lock);
	INIT_LIST_HEAD(&t->mappings);
	list_add_tail(&t->node, &a->tables);
	hash_add(live_tables, &t->hnode, (unsigned long)&t->pt);
	if (persistent)
		a->persistent_pins++;
	atomic64_inc(persistent ? &st_ppins : &st_pins);
	atomic64_inc(&st_live_tables);
	atomic64_add(table_bytes(n), &st_bytes);
	*ptp = &t->pt;
	if (!persistent && atomic_add_unless(&race_free_on_pin, -1, 0)) {
		/* A cudaFree that arrives while this pin is in progress: it
		 * waits for our lock, then revokes right after we return. */
		struct race_work *rw = kzalloc(sizeof(*rw), GFP_KERNEL);

		if (rw) {
			INIT_WORK(&rw->work, race_free_fn);
			rw->a = a;
			schedule_work(&rw->work);
		}
	}
	mutex_unlock(&rm_lock);
	return 0;

out_unlock:
	mutex_unlock(&rm_lock);
out_free:
	kvfree(t->pt.pages);
	kvfree(t->page_structs);
	kfree(t->pt.gpu_uuid);
	kfree(t);
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

/* Is @pt a live table? Compares pointers only (like RM's tracker). */
static struct emu_table *lookup_table(struct nvidia_p2p_page_table *pt, bool persistent)
{
	struct emu_table *t;

	hash_for_each_possible(live_tables, t, hnode, (unsigned long)pt)
		if (&t->pt == pt && t->persistent == persistent)
			return t;
	return NULL;
}

static int put_common(struct nvidia_p2p_page_table *pt, bool persistent)
{
	struct emu_table *t;
	struct emu_alloc *a;

	mutex_lock(&rm_lock);
	t = lookup_table(pt, persistent);
	if (!t) {
		mutex_unlock(&rm_lock);
		/* The free callback already took it (non-persistent): fine. */
		return persistent ? -EINVAL : 0;
	}
	cost(t->pt.entries);
	a = t->alloc;
	list_del_init(&t->node);
	hash_del(&t->hnode);
	free_table(t);
	atomic64_inc(&st_unpins);
	if (persistent && --a->persistent_pins == 0 && a->freed)
		release_bar(a);
	maybe_destroy(a);
	mutex_unlock(&rm_lock);
	return 0;
}

int nvidia_p2p_put_pages(uint64_t p2p_token, uint32_t va_space, uint64_t virtual_address,
			 struct nvidia_p2p_page_table *page_table)
{
	if (!page_table)
		return 0;
	u64 t0 = clock_start();

	return timed(t0, put_common(page_table, false));
}
EXPORT_SYMBOL(nvidia_p2p_put_pages);

int nvidia_p2p_put_pages_persistent(uint64_t virtual_address,
				    struct nvidia_p2p_page_table *page_table, uint32_t flags)
{
	if (flags || !page_table)
		return -EINVAL;
	u64 t0 = clock_start();

	return timed(t0, put_common(page_table, true));
}
EXPORT_SYMBOL(nvidia_p2p_put_pages_persistent);

static int dma_map_pages(struct pci_dev *peer, struct nvidia_p2p_page_table *page_table,
			 struct nvidia_p2p_dma_mapping **dma_mapping)
{
	struct emu_table *t;
	struct emu_mapping *em;
	u32 i, n, r;
	int err;

	if (!peer || !page_table || !dma_mapping || !page_table->gpu_uuid)
		return -EINVAL;
	/* Like the real driver: trust the pointer (KASAN flags a stale one). */
	t = container_of(page_table, struct emu_table, pt);
	if (WARN_ON(page_table->page_size != NVIDIA_P2P_PAGE_SIZE_64KB))
		return -EINVAL;
	if (t->force_bar1)
		return -ENOTSUPP;
	err = injected(INJ_DMA_MAP);
	if (err)
		return err;
	n = page_table->entries;
	em = kzalloc(sizeof(*em), GFP_KERNEL);
	if (!em)
		return -ENOMEM;
	em->m.dma_addresses = kvcalloc(n, sizeof(u64), GFP_KERNEL);
	em->runs = kcalloc(n, sizeof(*em->runs), GFP_KERNEL);
	if (!em->m.dma_addresses || !em->runs) {
		err = -ENOMEM;
		goto fail;
	}
	/* One dma_map_resource per physically contiguous run: contiguous bus
	 * addresses with or without an IOMMU. */
	for (i = 0; i < n; i = r) {
		phys_addr_t start = page_table->pages[i]->physical_address;
		dma_addr_t dma;
		u64 len;
		u32 k;

		for (r = i + 1; r < n; r++)
			if (page_table->pages[r]->physical_address != start + (u64)(r - i) * GPU_PAGE)
				break;
		len = (u64)(r - i) * GPU_PAGE;
		dma = dma_map_resource(&peer->dev, start, len, DMA_BIDIRECTIONAL, EMU_DMA_ATTRS);
		if (dma_mapping_error(&peer->dev, dma)) {
			err = -EIO;
			goto fail;
		}
		em->runs[em->nruns].dma = dma;
		em->runs[em->nruns].len = len;
		em->nruns++;
		for (k = i; k < r; k++)
			em->m.dma_addresses[k] = dma + (u64)(k - i) * GPU_PAGE;
	}
	em->m.version = dma_mapping_version;
	em->m.page_size_type = page_table->page_size;
	em->m.entries = n;
	em->m.pci_dev = peer;
	spin_lock(&t->lock);
	list_add_tail(&em->node, &t->mappings);
	spin_unlock(&t->lock);
	atomic64_inc(&st_live_maps);
	atomic64_inc(&st_dma_maps);
	atomic64_add(mapping_bytes(n), &st_bytes);
	*dma_mapping = &em->m;
	return 0;

fail:
	for (i = 0; i < em->nruns; i++)
		dma_unmap_resource(&peer->dev, em->runs[i].dma, em->runs[i].len, DMA_BIDIRECTIONAL, EMU_DMA_ATTRS);
	kvfree(em->m.dma_addresses);
	kfree(em->runs);
	kfree(em);
	return err;
}

int nvidia_p2p_dma_map_pages(struct pci_dev *peer, struct nvidia_p2p_page_table *page_table,
			     struct nvidia_p2p_dma_mapping **dma_mapping)
{
	u64 t0 = clock_start();

	return timed(t0, dma_map_pages(peer, page_table, dma_mapping));
}
EXPORT_SYMBOL(nvidia_p2p_dma_map_pages);

static int dma_unmap_pages(struct pci_dev *peer, struct nvidia_p2p_page_table *page_table,
			   struct nvidia_p2p_dma_mapping *dma_mapping)
{
	struct emu_table *t;
	struct emu_mapping *em, *found = NULL;

	if (!peer || !page_table || !dma_mapping)
		return -EINVAL;
	/* Like the real driver: dereferences the table (KASAN flags a stale one). */
	t = container_of(page_table, struct emu_table, pt);
	spin_lock(&t->lock);
	list_for_each_entry(em, &t->mappings, node) {
		if (&em->m == dma_mapping) {
			list_del(&em->node);
			found = em;
			break;
		}
	}
	spin_unlock(&t->lock);
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

	return timed(t0, dma_unmap_pages(peer, page_table, dma_mapping));
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

static void emu_vma_close(struct vm_area_struct *vma)
{
	struct emu_alloc *a = vma->vm_private_data;

	mutex_lock(&rm_lock);
	free_alloc(a);
	a->mapped = false;
	maybe_destroy(a);
	mutex_unlock(&rm_lock);
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

static int emu_mmap(struct file *file, struct vm_area_struct *vma)
{
	u64 off = (u64)vma->vm_pgoff << PAGE_SHIFT;
	u64 size = vma->vm_end - vma->vm_start;
	struct emu_alloc *a, *found = NULL;
	int err;

	mutex_lock(&rm_lock);
	list_for_each_entry(a, &allocs, node) {
		if (a->offset == off && a->file == file && !a->mapped && !a->freed) {
			found = a;
			break;
		}
	}
	if (!found || found->size != size || !IS_ALIGNED(vma->vm_start, GPU_PAGE)) {
		mutex_unlock(&rm_lock);
		return -EINVAL;
	}
	vm_flags_set(vma, VM_IO | VM_PFNMAP | VM_DONTEXPAND | VM_DONTCOPY | VM_DONTDUMP);
	vma->vm_page_prot = pgprot_writecombine(vma->vm_page_prot);
	err = io_remap_pfn_range(vma, vma->vm_start,
				 (found->gpu->bar + found->chunk * GPU_PAGE) >> PAGE_SHIFT,
				 size, vma->vm_page_prot);
	if (err) {
		mutex_unlock(&rm_lock);
		return err;
	}
	found->va = vma->vm_start;
	found->mapped = true;
	vma->vm_private_data = found;
	vma->vm_ops = &emu_vm_ops;
	mutex_unlock(&rm_lock);
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

static long emu_alloc_ioctl(struct file *file, struct nvemu_alloc __user *uarg)
{
	struct nvemu_alloc arg;
	struct emu_alloc *a;
	struct emu_gpu *g;
	unsigned long chunks, start;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if (arg.gpu >= ngpus || !arg.size || arg.size > (1ULL << 40))
		return -EINVAL;
	g = gpus[arg.gpu];
	chunks = DIV_ROUND_UP(arg.size, GPU_PAGE);
	a = kzalloc(sizeof(*a), GFP_KERNEL);
	if (!a)
		return -ENOMEM;
	mutex_lock(&rm_lock);
	start = bitmap_find_next_zero_area(g->used, g->nchunks, 0, chunks, 0);
	if (start >= g->nchunks) {
		mutex_unlock(&rm_lock);
		kfree(a);
		return -ENOMEM;
	}
	bitmap_set(g->used, start, chunks);
	a->gpu = g;
	a->file = file;
	a->mm = current->mm;
	a->chunk = start;
	a->size = (u64)chunks * GPU_PAGE;
	a->offset = ((u64)(g->index + 1) << 40) + (u64)start * GPU_PAGE;
	INIT_LIST_HEAD(&a->tables);
	list_add_tail(&a->node, &allocs);
	mutex_unlock(&rm_lock);
	arg.offset = a->offset;
	arg.size = a->size;
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
	mutex_lock(&rm_lock);
	list_for_each_entry(a, &allocs, node) {
		if (a->mapped && !a->freed && a->mm == current->mm && a->va == va) {
			found = a;
			break;
		}
	}
	if (found)
		free_alloc(found);
	mutex_unlock(&rm_lock);
	return found ? 0 : -EINVAL;
}

static long emu_info_ioctl(struct nvemu_info __user *uarg)
{
	struct nvemu_info info = {};
	struct emu_alloc *a;
	int i;

	mutex_lock(&rm_lock);
	info.gpus = ngpus;
	for (i = 0; i < ngpus; i++) {
		info.bar_size[i] = gpus[i]->bar1_budget;
		info.bar_free[i] = gpus[i]->bar1_budget - gpus[i]->bar1_used;
	}
	list_for_each_entry(a, &allocs, node)
		if (!a->released)
			info.live_allocs++;
	mutex_unlock(&rm_lock);
	info.pins = atomic64_read(&st_pins);
	info.persistent_pins = atomic64_read(&st_ppins);
	info.unpins = atomic64_read(&st_unpins);
	info.callbacks = atomic64_read(&st_callbacks);
	info.live_tables = atomic64_read(&st_live_tables);
	info.live_mappings = atomic64_read(&st_live_maps);
	info.dma_maps = atomic64_read(&st_dma_maps);
	info.provider_bytes = atomic64_read(&st_bytes);
	info.provider_ns = atomic64_read(&st_ns);
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
 * which holds the file open). */
static int emu_release(struct inode *inode, struct file *file)
{
	struct emu_alloc *a, *tmp;

	mutex_lock(&rm_lock);
	list_for_each_entry_safe(a, tmp, &allocs, node) {
		if (a->file == file && !a->mapped) {
			free_alloc(a);
			maybe_destroy(a);
		}
	}
	mutex_unlock(&rm_lock);
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

static int emu_probe(struct pci_dev *pdev, const struct pci_device_id *id)
{
	struct emu_gpu *g;
	int err;

	if (ngpus >= MAX_GPUS)
		return -ENOSPC;
	err = pcim_enable_device(pdev);
	if (err)
		return err;
	g = devm_kzalloc(&pdev->dev, sizeof(*g), GFP_KERNEL);
	if (!g)
		return -ENOMEM;
	g->pdev = pdev;
	g->index = ngpus;
	g->bar = pci_resource_start(pdev, 2);
	g->size = pci_resource_len(pdev, 2) & ~(GPU_PAGE - 1);
	if (!g->bar || g->size < GPU_PAGE)
		return -ENODEV;
	g->bar1_budget = bar1_size_mb ? min_t(u64, (u64)bar1_size_mb << 20, g->size) : g->size;
	g->nchunks = g->size / GPU_PAGE;
	g->used = devm_bitmap_zalloc(&pdev->dev, g->nchunks, GFP_KERNEL);
	g->bar1_refs = devm_kcalloc(&pdev->dev, g->nchunks, sizeof(*g->bar1_refs), GFP_KERNEL);
	if (!g->used || !g->bar1_refs)
		return -ENOMEM;
	memset(g->uuid, 0x60 + g->index, sizeof(g->uuid));
	gpus[ngpus++] = g;
	pci_set_drvdata(pdev, g);
	dev_info(&pdev->dev, "emulated GPU %d: BAR %pa, %llu MiB, BAR1 budget %llu MiB\n",
		 g->index, &g->bar, g->size >> 20, g->bar1_budget >> 20);
	return 0;
}

static void emu_remove(struct pci_dev *pdev)
{
	/* The module cannot go while a file (and so an allocation) is open. */
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

static int __init emu_init(void)
{
	int err, i;

	err = pci_register_driver(&emu_driver);
	if (err)
		return err;
	err = misc_register(&emu_misc);
	if (err) {
		pci_unregister_driver(&emu_driver);
		return err;
	}
	dbg_dir = debugfs_create_dir("nv_p2p_emu", NULL);
	debugfs_create_file("inject", 0200, dbg_dir, NULL, &inject_fops);
	debugfs_create_u32("free_delay_ms", 0600, dbg_dir, &free_delay_ms);
	debugfs_create_atomic_t("race_free_on_pin", 0600, dbg_dir, &race_free_on_pin);
	for (i = 0; i < INJ_COUNT; i++)
		atomic_set(&inj_left[i], 0);
	pr_info("%d emulated GPU(s), page table version %#x\n", ngpus, page_table_version);
	return 0;
}

static void __exit emu_exit(void)
{
	debugfs_remove_recursive(dbg_dir);
	misc_deregister(&emu_misc);
	pci_unregister_driver(&emu_driver);
}

module_init(emu_init);
module_exit(emu_exit);
MODULE_DESCRIPTION("peermem-rs testbed: emulated NVIDIA GPUs and p2p API over ivshmem");
MODULE_LICENSE("Dual MIT/GPL");
