// SPDX-License-Identifier: GPL-2.0 OR MIT
/*
 * C shim of nvidia_peermem: only kernel static inlines that Rust cannot reach,
 * and compile-time checks that the NVIDIA and peer-memory structs this module
 * reads have the x86_64 layout the Rust side was written against.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/device.h>
#include <linux/dynamic_debug.h>
#include <linux/dma-mapping.h>
#include <linux/pci.h>
#include <linux/stddef.h>
#include <linux/workqueue.h>
#include "nv-p2p.h"
#include "peer_mem.h"

unsigned int peermem_dma_max_seg_size(struct device *dev);
struct pci_dev *peermem_to_pci_dev(struct device *dev);
bool peermem_dbg(const char *msg);
int peermem_map_bar(struct device *dev, u64 phys, u64 len, u64 *dma);
void peermem_unmap_bar(struct device *dev, u64 dma, u64 len);
struct workqueue_struct *peermem_wq_alloc(void);
void peermem_wq_destroy(struct workqueue_struct *wq);

/* The device's DMA segment limit (static inline in dma-mapping.h). */
unsigned int peermem_dma_max_seg_size(struct device *dev)
{
	return dma_get_max_seg_size(dev);
}

/* The PCI device behind @dev, or NULL when @dev is not a PCI device. */
struct pci_dev *peermem_to_pci_dev(struct device *dev)
{
	if (!dev || !dev_is_pci(dev))
		return NULL;
	return to_pci_dev(dev);
}

/*
 * GPU BAR pages are MMIO: DMA-API debug's cacheline overlap accounting (for
 * kernel memory) does not apply, and many MRs on one GPU buffer legitimately
 * map the same BAR page many times.
 */
#ifdef DMA_ATTR_DEBUGGING_IGNORE_CACHELINES
#define PEERMEM_BAR_ATTRS DMA_ATTR_DEBUGGING_IGNORE_CACHELINES
#else
#define PEERMEM_BAR_ATTRS 0
#endif

/*
 * Maps @len bytes of a peer's BAR at bus address @phys for DMA by @dev, as
 * the GPU driver's nv_dma_map_peer() does: an IOVA under a translating
 * IOMMU, the bus address otherwise. 0 or -EIO.
 */
int peermem_map_bar(struct device *dev, u64 phys, u64 len, u64 *dma)
{
	dma_addr_t a = dma_map_resource(dev, phys, len, DMA_BIDIRECTIONAL, PEERMEM_BAR_ATTRS);

	if (dma_mapping_error(dev, a))
		return -EIO;
	*dma = a;
	return 0;
}

void peermem_unmap_bar(struct device *dev, u64 dma, u64 len)
{
	dma_unmap_resource(dev, dma, len, DMA_BIDIRECTIONAL, PEERMEM_BAR_ATTRS);
}

/* The module's own queue for work that must finish before it unloads. */
struct workqueue_struct *peermem_wq_alloc(void)
{
	return alloc_workqueue("nvidia_peermem", WQ_UNBOUND | WQ_MEM_RECLAIM, 0);
}

/* Drains the queue (every queued item has run and returned), then frees it. */
void peermem_wq_destroy(struct workqueue_struct *wq)
{
	destroy_workqueue(wq);
}

/*
 * Per-registration detail goes through one dynamic-debug call site, so that
 * `echo 'module nvidia_peermem +p' > .../dynamic_debug/control` turns it on
 * (Rust's pr_debug! is compiled in only with debug assertions).
 */
#if defined(CONFIG_DYNAMIC_DEBUG) || \
	(defined(CONFIG_DYNAMIC_DEBUG_CORE) && defined(DYNAMIC_DEBUG_MODULE))
bool peermem_dbg(const char *msg)
{
	DEFINE_DYNAMIC_DEBUG_METADATA(site, "%s\n");

	if (!DYNAMIC_DEBUG_BRANCH(site))
		return false;
	if (msg)
		__dynamic_pr_debug(&site, pr_fmt("%s\n"), msg);
	return true;
}
#else
bool peermem_dbg(const char *msg)
{
	if (msg)
		pr_debug("%s\n", msg);
	return IS_ENABLED(DEBUG);
}
#endif

#define PEERMEM_LAYOUT(type, field, off) \
	static_assert(offsetof(type, field) == (off), #type "." #field " moved")

static_assert(sizeof(struct peer_memory_client) == 136);
PEERMEM_LAYOUT(struct peer_memory_client, version, 64);
PEERMEM_LAYOUT(struct peer_memory_client, acquire, 80);
PEERMEM_LAYOUT(struct peer_memory_client, get_pages, 88);
PEERMEM_LAYOUT(struct peer_memory_client, dma_map, 96);
PEERMEM_LAYOUT(struct peer_memory_client, dma_unmap, 104);
PEERMEM_LAYOUT(struct peer_memory_client, put_pages, 112);
PEERMEM_LAYOUT(struct peer_memory_client, get_page_size, 120);
PEERMEM_LAYOUT(struct peer_memory_client, release, 128);
static_assert(sizeof(struct peer_memory_client_ex) == 152);
PEERMEM_LAYOUT(struct peer_memory_client_ex, ex_size, 136);
PEERMEM_LAYOUT(struct peer_memory_client_ex, flags, 144);

static_assert(sizeof(struct nvidia_p2p_page) == 32);
PEERMEM_LAYOUT(struct nvidia_p2p_page, physical_address, 0);
PEERMEM_LAYOUT(struct nvidia_p2p_page_table, version, 0);
PEERMEM_LAYOUT(struct nvidia_p2p_page_table, page_size, 4);
PEERMEM_LAYOUT(struct nvidia_p2p_page_table, pages, 8);
PEERMEM_LAYOUT(struct nvidia_p2p_page_table, entries, 16);
PEERMEM_LAYOUT(struct nvidia_p2p_page_table, gpu_uuid, 24);
static_assert(sizeof(struct nvidia_p2p_dma_mapping) == 40);
PEERMEM_LAYOUT(struct nvidia_p2p_dma_mapping, version, 0);
PEERMEM_LAYOUT(struct nvidia_p2p_dma_mapping, page_size_type, 4);
PEERMEM_LAYOUT(struct nvidia_p2p_dma_mapping, entries, 8);
PEERMEM_LAYOUT(struct nvidia_p2p_dma_mapping, dma_addresses, 16);
PEERMEM_LAYOUT(struct nvidia_p2p_dma_mapping, pci_dev, 32);
