// SPDX-License-Identifier: GPL-2.0
/*
 * rxe_peer.c: MRs of peer (GPU) memory for rdma_rxe, peermem-rs's addition
 * to a copy of Debian's drivers/infiniband/sw/rxe (scripts/build-verbs).
 *
 * rxe is a software device: it has no DMA of its own and copies with the
 * CPU. To consume a peer client's scatterlist as an HCA does, it carries a
 * PCI DMA identity (peer_dma_device=, the testbed's emulated HCA): the peer
 * memory is DMA-mapped for that device by the client, and rxe reaches it
 * through those DMA addresses only. Behind a translating IOMMU each address
 * is an IOVA, translated back with the device's domain
 * (iommu_iova_to_phys); without one the DMA address is the bus address
 * (dma_to_phys). rxe copies through a write-combined CPU mapping of each
 * PCI BAR it reaches, as user space maps them: made the first time an MR
 * lies in that BAR and kept until rxe unloads, as an HCA reaches any bus
 * address without setting anything up per MR (a mapping made and torn
 * down per MR cost ioremap plus a vunmap's TLB flush on every
 * registration, paid by both peer clients alike in make bench). Whether an
 * MR may still be reached is its own state: the invalidation notifier revokes the MR before the
 * client unmaps: from then on every access is refused (the requester or the
 * responder completes with an error) and nothing touches the pages again.
 */
#define pr_fmt(fmt) "rdma_rxe: " fmt

#include <linux/dma-direct.h>
#include <linux/dma-mapping.h>
#include <linux/io.h>
#include <linux/iommu.h>
#include <linux/module.h>
#include <linux/pci.h>

#include "rxe.h"
#include "rxe_loc.h"
#include "ib_peer_mem.h"

static char *peer_dma_device;
module_param(peer_dma_device, charp, 0444);
MODULE_PARM_DESC(peer_dma_device,
		 "PCI device (domain:bus:dev.fn) that peer memory is DMA-mapped for; unset: no peer path");

static struct device *peer_dev;
static atomic64_t st_peer_mrs, st_peer_revoked, st_peer_refused;

static int stat_get(char *buf, const struct kernel_param *kp)
{
	return sysfs_emit(buf, "%lld\n", atomic64_read(kp->arg));
}

static const struct kernel_param_ops stat_ops = { .get = stat_get };
module_param_cb(peer_mrs, &stat_ops, &st_peer_mrs, 0444);
MODULE_PARM_DESC(peer_mrs, "MRs of peer memory registered");
module_param_cb(peer_revoked, &stat_ops, &st_peer_revoked, 0444);
MODULE_PARM_DESC(peer_revoked, "MRs of peer memory revoked by an invalidation");
module_param_cb(peer_refused, &stat_ops, &st_peer_refused, 0444);
MODULE_PARM_DESC(peer_refused, "accesses refused because their MR was revoked");

struct rxe_peer_seg {
	phys_addr_t phys;
	u64 len;
	void __iomem *va;	/* in its BAR's mapping */
};

/* The BARs reached so far, each mapped once until rxe unloads. */
static struct rxe_peer_bar {
	phys_addr_t start;
	resource_size_t len;
	void __iomem *va;
} bars[8];
static unsigned int nbars;
static DEFINE_MUTEX(bars_lock);

struct rxe_peer_mr {
	rwlock_t lock;			/* revoked vs. the copies */
	bool revoked;
	u64 skip;			/* MR byte 0 in the segments */
	unsigned int nsegs;
	struct rxe_peer_seg segs[];
};

int rxe_peer_init(void)
{
	struct iommu_domain *dom;
	int err;

	if (!peer_dma_device || !*peer_dma_device)
		return 0;
	peer_dev = bus_find_device_by_name(&pci_bus_type, NULL, peer_dma_device);
	if (!peer_dev) {
		pr_err("peer_dma_device %s: no such PCI device\n", peer_dma_device);
		return -ENODEV;
	}
	err = dma_set_mask_and_coherent(peer_dev, DMA_BIT_MASK(64));
	if (err)
		pr_warn("peer_dma_device %s: no 64-bit DMA (%d)\n", peer_dma_device, err);
	dom = iommu_get_domain_for_dev(peer_dev);
	pr_info("peer memory is DMA-mapped for %s (%s)\n", dev_name(peer_dev),
		dom && (dom->type & __IOMMU_DOMAIN_PAGING) ? "IOMMU-translated" : "untranslated");
	return 0;
}

void rxe_peer_exit(void)
{
	while (nbars)
		iounmap(bars[--nbars].va);
	put_device(peer_dev);
	peer_dev = NULL;
}

struct device *rxe_peer_dma_device(void)
{
	return peer_dev;
}

/* The BAR of some PCI device holding [phys, phys + len), mapped: its CPU address. */
static void __iomem *rxe_peer_va(phys_addr_t phys, u64 len)
{
	struct pci_dev *pdev = NULL;
	void __iomem *va = NULL;
	unsigned int i;
	int r;

	mutex_lock(&bars_lock);
	for (i = 0; i < nbars; i++)
		if (phys >= bars[i].start && phys - bars[i].start + len <= bars[i].len) {
			va = bars[i].va + (phys - bars[i].start);
			goto out;
		}
	for_each_pci_dev(pdev) {
		for (r = 0; r < PCI_STD_NUM_BARS; r++) {
			struct resource *res = &pdev->resource[r];

			if (resource_type(res) != IORESOURCE_MEM || phys < res->start ||
			    phys - res->start + len > resource_size(res))
				continue;
			if (nbars < ARRAY_SIZE(bars))
				bars[nbars].va = ioremap_wc(res->start, resource_size(res));
			if (nbars < ARRAY_SIZE(bars) && bars[nbars].va) {
				bars[nbars].start = res->start;
				bars[nbars].len = resource_size(res);
				va = bars[nbars++].va + (phys - res->start);
			}
			pci_dev_put(pdev);
			goto out;
		}
	}
out:
	mutex_unlock(&bars_lock);
	return va;
}

/* No access from now on: a copy holding the lock has finished. */
static void rxe_peer_revoke(struct rxe_mr *mr)
{
	struct rxe_peer_mr *pm = mr->peer;

	write_lock_bh(&pm->lock);
	pm->revoked = true;
	WRITE_ONCE(mr->state, RXE_MR_STATE_INVALID);
	write_unlock_bh(&pm->lock);
}

/* The core's invalidation notifier: under the umem's mapping_lock. */
static void rxe_peer_invalidate(struct ib_umem *umem, void *priv)
{
	struct rxe_mr *mr = priv;

	rxe_peer_revoke(mr);
	atomic64_inc(&st_peer_revoked);
	pr_info("MR lkey %#x revoked: its peer memory is going away\n", mr->lkey);
}

int rxe_mr_init_peer(struct rxe_mr *mr, struct ib_umem *umem)
{
	struct sg_table *sgt = &umem->sgt_append.sgt;
	struct iommu_domain *dom = iommu_get_domain_for_dev(peer_dev);
	struct rxe_peer_mr *pm;
	struct scatterlist *sg;
	unsigned long pages = 0;
	dma_addr_t dma0;
	unsigned int i;

	if (dom && !(dom->type & __IOMMU_DOMAIN_PAGING))
		dom = NULL;	/* identity: DMA address = bus address */
	for_each_sgtable_dma_sg(sgt, sg, i) {
		if (!IS_ALIGNED(sg_dma_address(sg) | sg_dma_len(sg), PAGE_SIZE))
			return -EINVAL;
		pages += sg_dma_len(sg) >> PAGE_SHIFT;
	}
	pm = kvzalloc(struct_size(pm, segs, pages), GFP_KERNEL);
	if (!pm)
		return -ENOMEM;
	rwlock_init(&pm->lock);
	pm->skip = ib_umem_offset(umem);
	/* Page by page: IOVA-contiguous is not physically contiguous. */
	for_each_sgtable_dma_sg(sgt, sg, i) {
		u64 off;

		for (off = 0; off < sg_dma_len(sg); off += PAGE_SIZE) {
			dma_addr_t dma = sg_dma_address(sg) + off;
			phys_addr_t phys = dom ? iommu_iova_to_phys(dom, dma) :
						 dma_to_phys(peer_dev, dma);
			struct rxe_peer_seg *last = pm->nsegs ? &pm->segs[pm->nsegs - 1] : NULL;

			if (!phys) {
				pr_err("MR: DMA address %pad of %s translates to nothing\n",
				       &dma, dev_name(peer_dev));
				kvfree(pm);
				return -EFAULT;
			}
			if (last && last->phys + last->len == phys) {
				last->len += PAGE_SIZE;
			} else {
				pm->segs[pm->nsegs].phys = phys;
				pm->segs[pm->nsegs].len = PAGE_SIZE;
				pm->nsegs++;
			}
		}
	}
	for (i = 0; i < pm->nsegs; i++) {
		pm->segs[i].va = rxe_peer_va(pm->segs[i].phys, pm->segs[i].len);
		if (!pm->segs[i].va) {
			pr_err("MR: peer memory at %pa is in no PCI BAR rxe can map\n",
			       &pm->segs[i].phys);
			kvfree(pm);
			return -ENOMEM;
		}
	}
	mr->peer = pm;
	mr->umem = umem;
	mr->ibmr.type = IB_MR_TYPE_USER;
	mr->state = RXE_MR_STATE_VALID;
	atomic64_inc(&st_peer_mrs);
	dma0 = sg_dma_address(sgt->sgl);
	pr_debug("MR lkey %#x: %zu bytes of peer memory at %#lx, %u DMA entries (first %pad), %u BAR ranges (first %pa)\n",
		mr->lkey, umem->length, umem->address, sgt->nents, &dma0, pm->nsegs, &pm->segs[0].phys);
	ib_umem_activate_invalidation_notifier(umem, rxe_peer_invalidate, mr);
	return 0;
}

int rxe_peer_copy(struct rxe_mr *mr, u64 iova, void *addr,
		  unsigned int length, enum rxe_mr_copy_dir dir)
{
	struct rxe_peer_mr *pm = mr->peer;
	u64 pos = iova - mr->ibmr.iova + pm->skip;
	unsigned int i;

	read_lock_bh(&pm->lock);
	if (pm->revoked) {
		read_unlock_bh(&pm->lock);
		atomic64_inc(&st_peer_refused);
		return -EFAULT;
	}
	for (i = 0; i < pm->nsegs && length; i++) {
		struct rxe_peer_seg *s = &pm->segs[i];
		unsigned int n;

		if (pos >= s->len) {
			pos -= s->len;
			continue;
		}
		n = min_t(u64, length, s->len - pos);
		if (dir == RXE_TO_MR_OBJ)
			memcpy_toio(s->va + pos, addr, n);
		else
			memcpy_fromio(addr, s->va + pos, n);
		addr += n;
		length -= n;
		pos = 0;
	}
	read_unlock_bh(&pm->lock);
	return length ? -EFAULT : 0;
}

/* dereg: no invalidation after the notifier stops; then no access at all. */
void rxe_peer_cleanup(struct rxe_mr *mr)
{
	ib_umem_stop_invalidation_notifier(mr->umem);
	rxe_peer_revoke(mr);
	kvfree(mr->peer);
	mr->peer = NULL;
}
