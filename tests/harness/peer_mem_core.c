// SPDX-License-Identifier: GPL-2.0 OR MIT
/*
 * peer_mem_core: an emulated RDMA peer-memory core for the peermem-rs testbed.
 *
 * Exports ib_register_peer_memory_client / ib_unregister_peer_memory_client
 * with the ABI of the real peer_mem.h and follows the OFED >= 5.5 algorithm
 * (peer_mem.c / umem.c): clients in registration order under one global
 * mutex, IB_PEER_MEM_INVAL_SUPP filtering, xarray ids as core_context, a
 * per-umem mapping_lock held from get_pages until the "HW driver" arms the
 * invalidation notifier, the first/last SGE fix-up from get_page_size, both
 * invalidation flows (with and without PEER_MEM_INVALIDATE_UNMAPS), OFED's
 * error unwinding, unregister blocking until every umem is gone, and the
 * /sys/kernel/mm/memory_peers/<name>/ statistics.
 *
 * User space registers through /dev/peer_mem_core ("ibv_reg_mr"): the core
 * first tries pin_user_pages_fast like ib_umem_get, then the peer clients.
 * The "HCA" is QEMU's edu device: it is the dma_device handed to clients, and
 * its DMA engine moves bytes through the DMA addresses of an MR, refusing once
 * the MR was invalidated or deregistered.
 *
 * Written in C: it exports C symbols by name, builds sysfs kobjects, and
 * uses xa_alloc_cyclic and pin_user_pages_fast, none of which the 7.3 Rust
 * kernel crate offers.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/delay.h>
#include <linux/dma-mapping.h>
#include <linux/kernfs.h>
#include <linux/kobject.h>
#include <linux/kref.h>
#include <linux/miscdevice.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/pci.h>
#include <linux/scatterlist.h>
#include <linux/slab.h>
#include <linux/sysfs.h>
#include <linux/uaccess.h>
#include <linux/wait.h>
#include <linux/xarray.h>

#include "peer_mem.h"
#include "uapi.h"

/* Time spent inside the client's callbacks, for make bench: minus the
 * provider's own time (nv_p2p_emu's provider_ns) it is the client's. */
static atomic64_t st_client_ns;

static int client_ns_get(char *buf, const struct kernel_param *kp)
{
	return sysfs_emit(buf, "%lld\n", atomic64_read(&st_client_ns));
}

static const struct kernel_param_ops client_ns_ops = { .get = client_ns_get };
module_param_cb(client_ns, &client_ns_ops, NULL, 0444);
MODULE_PARM_DESC(client_ns, "nanoseconds spent inside peer-memory client callbacks");

/* Opt-in: clock reads are slow under TCG. */
static bool bench_timing;
module_param(bench_timing, bool, 0644);
MODULE_PARM_DESC(bench_timing, "account the time spent inside client callbacks (client_ns)");

static u64 client_clock(void)
{
	return READ_ONCE(bench_timing) ? ktime_get_ns() : 0;
}

static void client_time(u64 t0)
{
	if (t0)
		atomic64_add(ktime_get_ns() - t0, &st_client_ns);
}

#define CLIENT_CALL(expr) ({						\
	u64 __t0 = client_clock();					\
	typeof(expr) __r = (expr);					\
	client_time(__t0);						\
	__r;								\
})
#define CLIENT_CALL_VOID(expr) do {					\
	u64 __t0 = client_clock();					\
	expr;								\
	client_time(__t0);						\
} while (0)

enum ib_peer_mem_flags {
	IB_PEER_MEM_ALLOW = 1 << 0,
	IB_PEER_MEM_INVAL_SUPP = 1 << 1,
};

#define PEER_NO_INVALIDATION_ID U32_MAX

enum umem_state {
	UMEM_NONE,
	UMEM_MAPPED = PMC_STATE_MAPPED,
	UMEM_INVALIDATED = PMC_STATE_INVALIDATED,
	UMEM_UNMAPPED = PMC_STATE_UNMAPPED,
};

struct peer_client {
	struct kobject kobj;		/* memory_peers/<name>; frees us */
	bool in_sysfs;
	struct list_head node;
	const struct peer_memory_client *ops;
	bool invalidation_required;
	bool unmaps;			/* extended with PEER_MEM_INVALIDATE_UNMAPS */
	atomic_t umems;
	wait_queue_head_t wq;
	struct xarray umem_xa;
	u32 xa_next;
	atomic64_t num_alloc_mrs, num_dealloc_mrs, num_reg_pages, num_dereg_pages;
	atomic64_t num_reg_bytes, num_dereg_bytes, num_free_callbacks;
};

struct pmc_umem {
	struct kref kref;
	struct mutex mapping_lock;
	struct peer_client *client;
	void *ctx;
	u32 xa_id;
	enum umem_state state;
	bool hook_armed;		/* the "mkey" is live */
	bool revoked;			/* the device can no longer reach it */
	int source;
	struct sg_table sgt;
	unsigned long page_size;
	u64 addr, len;
	struct device *dma_dev;
	/* first/last SGE originals saved by the fix-up */
	struct scatterlist *first_sg, *last_sg;
	dma_addr_t first_dma_address;
	unsigned int first_dma_length, first_length, last_dma_length, last_length;
	/* host memory pinned by pin_user_pages_fast */
	struct page **pages;
	unsigned long npages;
};

struct pmc_file {
	struct xarray umems;
};

static LIST_HEAD(peer_clients);
static DEFINE_MUTEX(peer_memory_mutex);
static struct kobject *peers_kobj;
static int nclients;
static atomic64_t st_live_umems, st_invalidations, st_dma_bytes;

/* --- the "HCA": QEMU edu ---------------------------------------------- */

#define EDU_SRC		0x80
#define EDU_DST		0x88
#define EDU_CNT		0x90
#define EDU_CMD		0x98
#define EDU_CMD_START	0x1
#define EDU_CMD_TO_RAM	0x2
#define EDU_BUF		0x40000
#define EDU_BUF_SIZE	4096

static struct {
	struct pci_dev *pdev;
	void __iomem *regs;
	void *buf;
	dma_addr_t buf_dma;
	struct mutex lock;		/* one DMA engine */
} hca;

static struct miscdevice pmc_misc;

static int edu_dma(u64 src, u64 dst, u64 n, bool to_ram)
{
	int i;

	writeq(src, hca.regs + EDU_SRC);
	writeq(dst, hca.regs + EDU_DST);
	writeq(n, hca.regs + EDU_CNT);
	writeq(EDU_CMD_START | (to_ram ? EDU_CMD_TO_RAM : 0), hca.regs + EDU_CMD);
	for (i = 0; i < 3000; i++) {
		if (!(readq(hca.regs + EDU_CMD) & EDU_CMD_START))
			return 0;
		usleep_range(500, 1000);
	}
	pr_err("edu DMA timed out\n");
	return -ETIMEDOUT;
}

/* --- sysfs statistics (memory_peers/<name>/) -------------------------- */

#define PMC_STAT(field)								\
static ssize_t field##_show(struct kobject *kobj, struct kobj_attribute *attr,	\
			    char *buf)						\
{										\
	struct peer_client *c = container_of(kobj, struct peer_client, kobj);	\
	return sysfs_emit(buf, "%lld\n", atomic64_read(&c->field));		\
}										\
static struct kobj_attribute field##_attr = __ATTR_RO(field)

PMC_STAT(num_alloc_mrs);
PMC_STAT(num_dealloc_mrs);
PMC_STAT(num_reg_pages);
PMC_STAT(num_dereg_pages);
PMC_STAT(num_reg_bytes);
PMC_STAT(num_dereg_bytes);
PMC_STAT(num_free_callbacks);

static ssize_t version_show(struct kobject *kobj, struct kobj_attribute *attr, char *buf)
{
	struct peer_client *c = container_of(kobj, struct peer_client, kobj);

	return sysfs_emit(buf, "%.*s\n", IB_PEER_MEMORY_VER_MAX, c->ops->version);
}
static struct kobj_attribute version_attr = __ATTR_RO(version);

static struct attribute *peer_attrs[] = {
	&version_attr.attr,
	&num_alloc_mrs_attr.attr,
	&num_dealloc_mrs_attr.attr,
	&num_reg_pages_attr.attr,
	&num_dereg_pages_attr.attr,
	&num_reg_bytes_attr.attr,
	&num_dereg_bytes_attr.attr,
	&num_free_callbacks_attr.attr,
	NULL,
};
ATTRIBUTE_GROUPS(peer);

static void peer_client_release(struct kobject *kobj)
{
	struct peer_client *c = container_of(kobj, struct peer_client, kobj);

	xa_destroy(&c->umem_xa);
	kfree(c);
}

static const struct kobj_type peer_ktype = {
	.release = peer_client_release,
	.sysfs_ops = &kobj_sysfs_ops,
	.default_groups = peer_groups,
};

/* --- client registration ----------------------------------------------- */

static int ib_invalidate_peer_memory(void *reg_handle, u64 core_context);

/*
 * /sys/kernel/mm: OFED and Ubuntu build the core into ib_core and use mm_kobj,
 * which the kernel does not export to modules. The directory's kernfs node
 * carries its kobject; /sys/kernel/mm lives as long as the kernel.
 */
static struct kobject *find_mm_kobj(void)
{
	struct kernfs_node *kn = kernfs_find_and_get(kernel_kobj->sd, "mm");
	struct kobject *kobj;

	if (!kn)
		return NULL;
	kobj = kn->priv;
	kernfs_put(kn);
	return kobj;
}

void *ib_register_peer_memory_client(const struct peer_memory_client *peer_client,
				     invalidate_peer_memory *invalidate_callback)
{
	struct peer_client *c;
	int err;

	if (!peer_client->acquire || !peer_client->get_pages || !peer_client->put_pages ||
	    !peer_client->dma_map || !peer_client->dma_unmap) {
		pr_err("client %.64s lacks a mandatory callback\n", peer_client->name);
		return NULL;
	}
	c = kzalloc(sizeof(*c), GFP_KERNEL);
	if (!c)
		return NULL;
	c->ops = peer_client;
	atomic_set(&c->umems, 0);
	init_waitqueue_head(&c->wq);
	xa_init_flags(&c->umem_xa, XA_FLAGS_ALLOC);
	if (peer_client->version[IB_PEER_MEMORY_VER_MAX - 1]) {
		const struct peer_memory_client_ex *ex =
			container_of(peer_client, const struct peer_memory_client_ex, client);

		if (ex->ex_size >= offsetofend(struct peer_memory_client_ex, flags) &&
		    (ex->flags & PEER_MEM_INVALIDATE_UNMAPS))
			c->unmaps = true;
	}
	if (invalidate_callback) {
		*invalidate_callback = ib_invalidate_peer_memory;
		c->invalidation_required = true;
	}

	mutex_lock(&peer_memory_mutex);
	if (!peers_kobj) {
		struct kobject *mm = find_mm_kobj();

		peers_kobj = mm ? kobject_create_and_add("memory_peers", mm) : NULL;
		if (!peers_kobj) {
			mutex_unlock(&peer_memory_mutex);
			kfree(c);
			return NULL;
		}
	}
	err = kobject_init_and_add(&c->kobj, &peer_ktype, peers_kobj, "%.64s", peer_client->name);
	if (err) {
		/* A client of that name is registered (OFED's sysfs cores fail too). */
		pr_err("cannot register client %.64s: %d\n", peer_client->name, err);
		kobject_put(&c->kobj);
		if (!nclients) {
			kobject_put(peers_kobj);
			peers_kobj = NULL;
		}
		mutex_unlock(&peer_memory_mutex);
		return NULL;
	}
	c->in_sysfs = true;
	list_add_tail(&c->node, &peer_clients);
	nclients++;
	mutex_unlock(&peer_memory_mutex);
	pr_info("registered client %.64s (%s%s)\n", peer_client->name,
		c->invalidation_required ? "invalidating" : "non-invalidating",
		c->unmaps ? ", INVALIDATE_UNMAPS" : "");
	return c;
}
EXPORT_SYMBOL(ib_register_peer_memory_client);

void ib_unregister_peer_memory_client(void *reg_handle)
{
	struct peer_client *c = reg_handle;

	mutex_lock(&peer_memory_mutex);
	list_del(&c->node);
	nclients--;
	mutex_unlock(&peer_memory_mutex);
	/* Blocks until every umem made through this client is released. */
	wait_event(c->wq, atomic_read(&c->umems) == 0);
	pr_info("unregistered client %.64s\n", c->ops->name);
	mutex_lock(&peer_memory_mutex);
	kobject_del(&c->kobj);
	kobject_put(&c->kobj);
	if (!nclients && peers_kobj) {
		kobject_put(peers_kobj);
		peers_kobj = NULL;
	}
	mutex_unlock(&peer_memory_mutex);
}
EXPORT_SYMBOL(ib_unregister_peer_memory_client);

static void client_put(struct peer_client *c)
{
	if (atomic_dec_and_test(&c->umems))
		wake_up(&c->wq);
}

/* --- umems ------------------------------------------------------------- */

static void umem_free(struct kref *kref)
{
	struct pmc_umem *u = container_of(kref, struct pmc_umem, kref);

	mutex_destroy(&u->mapping_lock);
	kfree(u);
	atomic64_dec(&st_live_umems);
}

static void fix_peer_sgls(struct pmc_umem *u)
{
	struct scatterlist *sg;
	unsigned int i;

	for_each_sgtable_dma_sg(&u->sgt, sg, i) {
		if (i == 0) {
			unsigned long off = ALIGN_DOWN(u->addr, PAGE_SIZE) -
					    ALIGN_DOWN(u->addr, u->page_size);

			u->first_sg = sg;
			u->first_dma_address = sg->dma_address;
			u->first_dma_length = sg_dma_len(sg);
			u->first_length = sg->length;
			sg->dma_address += off;
			sg_dma_len(sg) -= off;
			sg->length -= off;
		}
		if (i == u->sgt.nents - 1) {
			unsigned long trim = ALIGN(u->addr + u->len, u->page_size) -
					     ALIGN(u->addr + u->len, PAGE_SIZE);

			u->last_sg = sg;
			u->last_dma_length = sg_dma_len(sg);
			u->last_length = sg->length;
			sg_dma_len(sg) -= trim;
			sg->length -= trim;
		}
	}
}

/* The client always sees the table it built. */
static void unfix_peer_sgls(struct pmc_umem *u)
{
	if (u->last_sg) {
		sg_dma_len(u->last_sg) = u->last_dma_length;
		u->last_sg->length = u->last_length;
	}
	if (u->first_sg) {
		u->first_sg->dma_address = u->first_dma_address;
		sg_dma_len(u->first_sg) = u->first_dma_length;
		u->first_sg->length = u->first_length;
	}
	u->first_sg = u->last_sg = NULL;
}

static void unmap_client(struct pmc_umem *u)
{
	unfix_peer_sgls(u);
	CLIENT_CALL(u->client->ops->dma_unmap(&u->sgt, u->ctx, u->dma_dev));
	CLIENT_CALL_VOID(u->client->ops->put_pages(&u->sgt, u->ctx));
	memset(&u->sgt, 0, sizeof(u->sgt));
}

static int ib_invalidate_peer_memory(void *reg_handle, u64 core_context)
{
	struct peer_client *c = reg_handle;
	struct pmc_umem *u;

	atomic64_inc(&c->num_free_callbacks);
	xa_lock(&c->umem_xa);
	u = xa_load(&c->umem_xa, core_context);
	if (u)
		kref_get(&u->kref);
	xa_unlock(&c->umem_xa);
	if (!u)
		return 0;

	mutex_lock(&u->mapping_lock);
	if (u->state == UMEM_MAPPED) {
		if (u->hook_armed) {
			/* mlx5: UMR-revoke the mkey; the device loses access. */
			u->revoked = true;
			atomic64_inc(&st_invalidations);
		}
		if (c->unmaps)
			u->state = UMEM_INVALIDATED;
		else {
			unmap_client(u);
			u->state = UMEM_UNMAPPED;
		}
	}
	mutex_unlock(&u->mapping_lock);
	kref_put(&u->kref, umem_free);
	return 0;
}

static struct pmc_umem *peer_umem_get(u64 addr, u64 len, u64 flags, int gup_err)
{
	struct peer_client *c, *found = NULL;
	struct pmc_umem *u;
	void *ctx = NULL;
	int nmap = 0, err;

	mutex_lock(&peer_memory_mutex);
	list_for_each_entry(c, &peer_clients, node) {
		if (c->invalidation_required && !(flags & PMC_REG_INVAL_SUPP))
			continue;
		if (CLIENT_CALL(c->ops->acquire(addr, len, NULL, NULL, &ctx)) > 0) {
			found = c;
			atomic_inc(&c->umems);
			break;
		}
	}
	mutex_unlock(&peer_memory_mutex);
	if (!found)
		return ERR_PTR(gup_err);
	c = found;

	u = kzalloc(sizeof(*u), GFP_KERNEL);
	if (!u) {
		err = -ENOMEM;
		goto err_client;
	}
	atomic64_inc(&st_live_umems);
	kref_init(&u->kref);
	mutex_init(&u->mapping_lock);
	u->client = c;
	u->ctx = ctx;
	u->addr = addr;
	u->len = len;
	u->source = PMC_SRC_PEER;
	u->dma_dev = (flags & PMC_REG_NON_PCI_DEV) ? pmc_misc.this_device : &hca.pdev->dev;

	mutex_lock(&u->mapping_lock);
	if (c->invalidation_required) {
		err = xa_alloc_cyclic(&c->umem_xa, &u->xa_id, u,
				      XA_LIMIT(0, PEER_NO_INVALIDATION_ID - 1), &c->xa_next, GFP_KERNEL);
		if (err < 0)
			goto err_umem;
	} else {
		u->xa_id = PEER_NO_INVALIDATION_ID;
	}
	err = CLIENT_CALL(c->ops->get_pages(addr, len, 1, !!(flags & PMC_REG_READ_ONLY), NULL, ctx,
					    u->xa_id));
	if (err)
		goto err_xa;
	err = CLIENT_CALL(c->ops->dma_map(&u->sgt, ctx, u->dma_dev, 0, &nmap));
	if (err)
		goto err_pages;
	u->sgt.nents = nmap;
	u->page_size = c->ops->get_page_size ? c->ops->get_page_size(ctx) : PAGE_SIZE;
	if (u->page_size != PAGE_SIZE)
		fix_peer_sgls(u);
	u->state = UMEM_MAPPED;
	atomic64_inc(&c->num_alloc_mrs);
	atomic64_add(nmap, &c->num_reg_pages);
	atomic64_add(len, &c->num_reg_bytes);
	/* The "HW driver" creates the mkey, then arms the notifier: an
	 * invalidation that came meanwhile waited on mapping_lock. */
	u->hook_armed = c->invalidation_required;
	mutex_unlock(&u->mapping_lock);
	return u;

err_pages:
	c->ops->put_pages(&u->sgt, ctx);
err_xa:
	if (u->xa_id != PEER_NO_INVALIDATION_ID)
		xa_erase(&c->umem_xa, u->xa_id);
err_umem:
	mutex_unlock(&u->mapping_lock);
	kref_put(&u->kref, umem_free);
err_client:
	c->ops->release(ctx);
	client_put(c);
	return ERR_PTR(err);
}

static void umem_release(struct pmc_umem *u)
{
	struct peer_client *c = u->client;
	bool was_mapped;

	if (u->source == PMC_SRC_HOST) {
		unpin_user_pages(u->pages, u->npages);
		kvfree(u->pages);
		kref_put(&u->kref, umem_free);
		return;
	}
	/* The HW driver revokes the mkey first. */
	mutex_lock(&u->mapping_lock);
	u->revoked = true;
	mutex_unlock(&u->mapping_lock);

	/* ib_umem_stop_invalidation_notifier */
	if (c->invalidation_required) {
		mutex_lock(&u->mapping_lock);
		u->hook_armed = false;
		if (!c->unmaps) {
			if (u->state == UMEM_MAPPED)
				unmap_client(u);
			u->state = UMEM_UNMAPPED;
			mutex_unlock(&u->mapping_lock);
		} else {
			was_mapped = u->state == UMEM_MAPPED;
			if (was_mapped)
				u->state = UMEM_UNMAPPED;
			mutex_unlock(&u->mapping_lock);
			if (was_mapped)
				unmap_client(u);
		}
	}
	/* ib_peer_umem_release */
	if (u->state == UMEM_MAPPED) {
		unmap_client(u);
		u->state = UMEM_UNMAPPED;
	}
	if (u->xa_id != PEER_NO_INVALIDATION_ID)
		xa_erase(&c->umem_xa, u->xa_id);
	if (c->ops->release)
		CLIENT_CALL_VOID(c->ops->release(u->ctx));
	atomic64_inc(&c->num_dealloc_mrs);
	atomic64_add(u->sgt.nents, &c->num_dereg_pages);
	atomic64_add(u->len, &c->num_dereg_bytes);
	client_put(c);
	kref_put(&u->kref, umem_free);
}

static struct pmc_umem *umem_get(u64 addr, u64 len, u64 flags)
{
	unsigned long first = addr & PAGE_MASK, npages;
	struct page **pages;
	struct pmc_umem *u;
	long pinned;
	int gup_err;

	if (!len || addr + len < addr || len > (1ULL << 40))
		return ERR_PTR(-EINVAL);
	npages = (PAGE_ALIGN(addr + len) - first) >> PAGE_SHIFT;
	pages = kvmalloc_array(npages, sizeof(*pages), GFP_KERNEL);
	if (!pages)
		return ERR_PTR(-ENOMEM);
	pinned = pin_user_pages_fast(first, npages,
				     FOLL_LONGTERM | ((flags & PMC_REG_READ_ONLY) ? 0 : FOLL_WRITE),
				     pages);
	if (pinned == npages) {
		u = kzalloc(sizeof(*u), GFP_KERNEL);
		if (!u) {
			unpin_user_pages(pages, npages);
			kvfree(pages);
			return ERR_PTR(-ENOMEM);
		}
		atomic64_inc(&st_live_umems);
		kref_init(&u->kref);
		mutex_init(&u->mapping_lock);
		u->source = PMC_SRC_HOST;
		u->pages = pages;
		u->npages = npages;
		u->addr = addr;
		u->len = len;
		u->state = UMEM_MAPPED;
		return u;
	}
	if (pinned > 0)
		unpin_user_pages(pages, pinned);
	kvfree(pages);
	gup_err = pinned < 0 ? pinned : -EFAULT;
	return peer_umem_get(addr, len, flags, gup_err);
}

/* --- user interface ------------------------------------------------------ */

static struct pmc_umem *lookup(struct pmc_file *pf, u64 handle)
{
	struct pmc_umem *u;

	xa_lock(&pf->umems);
	u = xa_load(&pf->umems, handle);
	if (u)
		kref_get(&u->kref);
	xa_unlock(&pf->umems);
	return u;
}

static long pmc_reg(struct pmc_file *pf, struct pmc_reg __user *uarg)
{
	struct pmc_reg arg;
	struct pmc_umem *u;
	u32 id;
	int err;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if (arg.flags & ~(u64)(PMC_REG_INVAL_SUPP | PMC_REG_NON_PCI_DEV | PMC_REG_READ_ONLY))
		return -EINVAL;
	if (!hca.pdev && !(arg.flags & PMC_REG_NON_PCI_DEV))
		return -ENODEV;
	u = umem_get(arg.addr, arg.len, arg.flags);
	if (IS_ERR(u))
		return PTR_ERR(u);
	err = xa_alloc(&pf->umems, &id, u, xa_limit_31b, GFP_KERNEL);
	if (err) {
		umem_release(u);
		return err;
	}
	arg.handle = id;
	if (copy_to_user(uarg, &arg, sizeof(arg))) {
		/* Leave it registered; it goes with the file. */
		return -EFAULT;
	}
	return 0;
}

static long pmc_dereg(struct pmc_file *pf, u64 __user *uh)
{
	struct pmc_umem *u;
	u64 h;

	if (get_user(h, uh))
		return -EFAULT;
	u = xa_erase(&pf->umems, h);
	if (!u)
		return -EINVAL;
	umem_release(u);
	return 0;
}

static long pmc_query(struct pmc_file *pf, struct pmc_query __user *uarg)
{
	struct pmc_query q;
	struct pmc_umem *u;
	struct scatterlist *sg;
	unsigned int i;

	if (copy_from_user(&q.handle, &uarg->handle, sizeof(q.handle)))
		return -EFAULT;
	u = lookup(pf, q.handle);
	if (!u)
		return -EINVAL;
	memset(&q, 0, sizeof(q));
	mutex_lock(&u->mapping_lock);
	q.source = u->source;
	q.state = u->state;
	q.revoked = u->revoked;
	if (u->source == PMC_SRC_PEER) {
		strscpy(q.client, u->client->ops->name, sizeof(q.client));
		q.page_size = u->page_size;
		if (u->state == UMEM_MAPPED) {
			q.nmap = u->sgt.nents;
			for_each_sgtable_dma_sg(&u->sgt, sg, i) {
				if (i == 0) {
					q.first_dma = sg_dma_address(sg);
					q.first_len = sg_dma_len(sg);
				}
				q.last_len = sg_dma_len(sg);
				q.total_len += sg_dma_len(sg);
			}
		}
	}
	mutex_unlock(&u->mapping_lock);
	if (copy_from_user(&q.handle, &uarg->handle, sizeof(q.handle)))
		q.handle = 0;
	kref_put(&u->kref, umem_free);
	return copy_to_user(uarg, &q, sizeof(q)) ? -EFAULT : 0;
}

/* The bus address of MR byte @off and how many bytes follow it in its SGE. */
static int mr_dma_addr(struct pmc_umem *u, u64 off, dma_addr_t *dma, u64 *room)
{
	u64 pos = (u->addr + off) - ALIGN_DOWN(u->addr, PAGE_SIZE);
	struct scatterlist *sg;
	unsigned int i;

	for_each_sgtable_dma_sg(&u->sgt, sg, i) {
		if (pos < sg_dma_len(sg)) {
			*dma = sg_dma_address(sg) + pos;
			*room = sg_dma_len(sg) - pos;
			return 0;
		}
		pos -= sg_dma_len(sg);
	}
	return -EINVAL;
}

static long pmc_dma(struct pmc_file *pf, struct pmc_dma __user *uarg)
{
	struct pmc_dma arg;
	struct pmc_umem *u;
	u8 *tmp;
	u64 done = 0;
	long err = 0;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if (!arg.len || arg.len > SZ_1M || (arg.dir != PMC_DMA_TO_MR && arg.dir != PMC_DMA_FROM_MR))
		return -EINVAL;
	if (!hca.pdev)
		return -ENODEV;
	u = lookup(pf, arg.handle);
	if (!u)
		return -EINVAL;
	if (arg.offset >= u->len || arg.len > u->len - arg.offset) {
		err = -EINVAL;
		goto out_put;
	}
	tmp = kvmalloc(arg.len, GFP_KERNEL);
	if (!tmp) {
		err = -ENOMEM;
		goto out_put;
	}
	/* User copies stay outside mapping_lock (no mmap_lock under it). */
	if (arg.dir == PMC_DMA_TO_MR && copy_from_user(tmp, u64_to_user_ptr(arg.buf), arg.len)) {
		err = -EFAULT;
		goto out_free;
	}
	mutex_lock(&u->mapping_lock);
	if (u->source != PMC_SRC_PEER) {
		err = -EOPNOTSUPP;
	} else if (u->state != UMEM_MAPPED || u->revoked) {
		err = -EACCES;	/* the mkey is gone: the device gets an error CQE */
	} else {
		mutex_lock(&hca.lock);
		while (done < arg.len && !err) {
			dma_addr_t mr;
			u64 room, n;

			err = mr_dma_addr(u, arg.offset + done, &mr, &room);
			if (err)
				break;
			n = min3(room, arg.len - done, (u64)EDU_BUF_SIZE);
			if (arg.dir == PMC_DMA_TO_MR) {
				memcpy(hca.buf, tmp + done, n);
				err = edu_dma(hca.buf_dma, EDU_BUF, n, false);
				if (!err)
					err = edu_dma(EDU_BUF, mr, n, true);
			} else {
				err = edu_dma(mr, EDU_BUF, n, false);
				if (!err)
					err = edu_dma(EDU_BUF, hca.buf_dma, n, true);
				if (!err)
					memcpy(tmp + done, hca.buf, n);
			}
			done += n;
		}
		mutex_unlock(&hca.lock);
	}
	mutex_unlock(&u->mapping_lock);
	if (!err) {
		atomic64_add(arg.len, &st_dma_bytes);
		if (arg.dir == PMC_DMA_FROM_MR && copy_to_user(u64_to_user_ptr(arg.buf), tmp, arg.len))
			err = -EFAULT;
	}
out_free:
	kvfree(tmp);
out_put:
	kref_put(&u->kref, umem_free);
	return err;
}

static long pmc_info(struct pmc_info __user *uarg)
{
	struct pmc_info info = {
		.hca_present = !!hca.pdev,
		.live_umems = atomic64_read(&st_live_umems),
		.invalidations = atomic64_read(&st_invalidations),
		.dma_bytes = atomic64_read(&st_dma_bytes),
	};

	mutex_lock(&peer_memory_mutex);
	info.clients = nclients;
	mutex_unlock(&peer_memory_mutex);
	return copy_to_user(uarg, &info, sizeof(info)) ? -EFAULT : 0;
}

static long pmc_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	struct pmc_file *pf = file->private_data;

	switch (cmd) {
	case PMC_IOC_REG:
		return pmc_reg(pf, (void __user *)arg);
	case PMC_IOC_DEREG:
		return pmc_dereg(pf, (u64 __user *)arg);
	case PMC_IOC_QUERY:
		return pmc_query(pf, (void __user *)arg);
	case PMC_IOC_DMA:
		return pmc_dma(pf, (void __user *)arg);
	case PMC_IOC_INFO:
		return pmc_info((void __user *)arg);
	}
	return -ENOTTY;
}

static int pmc_open(struct inode *inode, struct file *file)
{
	struct pmc_file *pf = kzalloc(sizeof(*pf), GFP_KERNEL);

	if (!pf)
		return -ENOMEM;
	xa_init_flags(&pf->umems, XA_FLAGS_ALLOC1);
	file->private_data = pf;
	return 0;
}

/* Process exit or close: every MR goes, like ib_uverbs' cleanup. */
static int pmc_release(struct inode *inode, struct file *file)
{
	struct pmc_file *pf = file->private_data;
	struct pmc_umem *u;
	unsigned long id;

	xa_for_each(&pf->umems, id, u) {
		xa_erase(&pf->umems, id);
		umem_release(u);
	}
	xa_destroy(&pf->umems);
	kfree(pf);
	return 0;
}

static const struct file_operations pmc_fops = {
	.owner = THIS_MODULE,
	.open = pmc_open,
	.release = pmc_release,
	.unlocked_ioctl = pmc_ioctl,
};

static struct miscdevice pmc_misc = {
	.minor = MISC_DYNAMIC_MINOR,
	.name = "peer_mem_core",
	.fops = &pmc_fops,
	.mode = 0666,
};

static int edu_probe(struct pci_dev *pdev, const struct pci_device_id *id)
{
	int err;

	if (hca.pdev)
		return -EBUSY;
	err = pcim_enable_device(pdev);
	if (err)
		return err;
	pci_set_master(pdev);
	err = dma_set_mask_and_coherent(&pdev->dev, DMA_BIT_MASK(64));
	if (err)
		return err;
	/* Like mlx5: segments up to 2 GiB. */
	dma_set_max_seg_size(&pdev->dev, SZ_2G);
	hca.regs = pcim_iomap(pdev, 0, 0);
	if (!hca.regs)
		return -ENOMEM;
	hca.buf = dmam_alloc_coherent(&pdev->dev, EDU_BUF_SIZE, &hca.buf_dma, GFP_KERNEL);
	if (!hca.buf)
		return -ENOMEM;
	if ((readl(hca.regs) & 0xff) != 0xed) {
		dev_err(&pdev->dev, "not an edu device (id %#x)\n", readl(hca.regs));
		return -ENODEV;
	}
	hca.pdev = pdev;
	dev_info(&pdev->dev, "edu DMA engine is the emulated HCA\n");
	return 0;
}

static void edu_remove(struct pci_dev *pdev)
{
	hca.pdev = NULL;
}

static const struct pci_device_id edu_ids[] = {
	{ PCI_DEVICE(0x1234, 0x11e8) },
	{ }
};
MODULE_DEVICE_TABLE(pci, edu_ids);

static struct pci_driver edu_driver = {
	.name = "peer_mem_core_hca",
	.id_table = edu_ids,
	.probe = edu_probe,
	.remove = edu_remove,
};

static int __init pmc_init(void)
{
	int err;

	mutex_init(&hca.lock);
	err = pci_register_driver(&edu_driver);
	if (err)
		return err;
	err = misc_register(&pmc_misc);
	if (err)
		pci_unregister_driver(&edu_driver);
	return err;
}

static void __exit pmc_exit(void)
{
	misc_deregister(&pmc_misc);
	pci_unregister_driver(&edu_driver);
}

module_init(pmc_init);
module_exit(pmc_exit);
MODULE_DESCRIPTION("peermem-rs testbed: emulated OFED peer-memory core with an edu-based HCA");
MODULE_LICENSE("Dual MIT/GPL");
