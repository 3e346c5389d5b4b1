// SPDX-License-Identifier: GPL-2.0
/*
 * peer_mem.c: peermem-rs's own implementation of the RDMA peer-memory
 * interface, built into ib_uverbs of a copy of Debian's drivers/infiniband
 * (scripts/build-verbs), as OFED >= 24.07 and NVIDIA's kernels place it.
 *
 * Written from the facts the project keeps on the OFED >= 5.5 algorithm
 * (client order under one global mutex, IB_PEER_MEM_INVAL_SUPP filtering,
 * xarray ids as core_context, the per-umem mapping_lock held for an
 * invalidating umem from before get_pages until the HCA driver arms the
 * notifier, the first/last SGE fix-up from get_page_size, both invalidation
 * flows, OFED's error unwinding, unregister blocking until every umem is
 * gone) and from the emulated core of the testbed
 * (tests/harness/peer_mem_core.c), whose logic it shares. No
 * /sys/kernel/mm/memory_peers statistics (OFED >= 24.04 has none); counters
 * are in /sys/module/ib_uverbs/parameters/peer_*.
 *
 * The client ABI (struct peer_memory_client[_ex]) is peer_mem.h's.
 */
#define pr_fmt(fmt) "ib_peer_mem: " fmt

#include <linux/export.h>
#include <linux/hashtable.h>
#include <linux/kref.h>
#include <linux/list.h>
#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/mutex.h>
#include <linux/sched/mm.h>
#include <linux/slab.h>
#include <linux/wait.h>
#include <linux/xarray.h>
#include <rdma/ib_verbs.h>

#include "peer_mem.h"
#include "ib_peer_mem.h"

#define PEER_NO_INVALIDATION_ID U32_MAX

struct ib_peer_client {
	struct list_head node;
	const struct peer_memory_client *ops;
	bool invalidation_required;
	bool unmaps;			/* extended with PEER_MEM_INVALIDATE_UNMAPS */
	atomic_t umems;			/* live umems, + 1 while registered */
	struct completion unused;	/* umems reached 0 */
	struct xarray umem_xa;		/* core_context -> umem */
	u32 xa_next;
};

enum peer_umem_state {
	PEER_UMEM_NONE,
	PEER_UMEM_MAPPED,
	PEER_UMEM_INVALIDATED,
	PEER_UMEM_UNMAPPED,
};

struct ib_umem_peer {
	struct ib_umem umem;		/* first: what drivers hold */
	struct hlist_node hnode;	/* peer_umems */
	struct kref kref;
	struct mutex mapping_lock;	/* state, the client's table, the hook */
	/* NULL once released: an invalidate still holding a kref reads it */
	struct ib_peer_client *client;
	struct ib_peer_client *owner;	/* the same, for the releasing path */
	void *ctx;
	u32 xa_id;			/* core_context */
	enum peer_umem_state state;
	bool activated;			/* the driver armed the notifier */
	bool stopped;			/* ... and stopped it */
	umem_invalidate_func_t invalidate;
	void *priv;
	struct device *dma_device;
	unsigned long page_size;
	/* first/last SGE originals saved by the fix-up */
	struct scatterlist *first_sg, *last_sg;
	dma_addr_t first_dma_address;
	unsigned int first_dma_length, first_length, last_dma_length, last_length;
};

/*
 * Lockdep classes of mapping_lock: one per kind of umem. A non-invalidating
 * (persistent) umem's mapping_lock is held while the client waits for the
 * GPU driver's lock (get_pages, dma_map); no free callback ever takes it (it
 * has no core_context to be found by). An invalidating umem's is taken by
 * the free callback, under the GPU driver's lock; held by us while a client
 * waits for that lock it is a real ABBA, and stays reported. With one class
 * lockdep would join the two across unrelated umems (a persistent run, then
 * an invalidating one in the same boot) and report an inversion that cannot
 * happen.
 */
static struct lock_class_key mapping_lock_inval_key;
static struct lock_class_key mapping_lock_persist_key;

static LIST_HEAD(peer_clients);
static DEFINE_MUTEX(peer_memory_mutex);

/* Which umems are peer umems: ib_umem_release is given every kind. */
static DEFINE_SPINLOCK(peer_umems_lock);
static DEFINE_HASHTABLE(peer_umems, 8);

static atomic64_t st_clients, st_umems, st_alloc, st_dealloc, st_unclaimed, st_invalidations,
		  st_revoked, st_last_unclaimed_err;

static int stat_get(char *buf, const struct kernel_param *kp)
{
	return sysfs_emit(buf, "%lld\n", atomic64_read(kp->arg));
}

static const struct kernel_param_ops stat_ops = { .get = stat_get };
module_param_cb(peer_clients, &stat_ops, &st_clients, 0444);
MODULE_PARM_DESC(peer_clients, "registered peer-memory clients");
module_param_cb(peer_umems, &stat_ops, &st_umems, 0444);
MODULE_PARM_DESC(peer_umems, "live umems backed by a peer client");
module_param_cb(peer_alloc_mrs, &stat_ops, &st_alloc, 0444);
module_param_cb(peer_dealloc_mrs, &stat_ops, &st_dealloc, 0444);
module_param_cb(peer_unclaimed, &stat_ops, &st_unclaimed, 0444);
MODULE_PARM_DESC(peer_unclaimed, "registrations that pin_user_pages refused and no peer client claimed");
module_param_cb(peer_last_unclaimed_errno, &stat_ops, &st_last_unclaimed_err, 0444);
module_param_cb(peer_invalidations, &stat_ops, &st_invalidations, 0444);
MODULE_PARM_DESC(peer_invalidations, "invalidate calls that found their umem");
module_param_cb(peer_revoked, &stat_ops, &st_revoked, 0444);
MODULE_PARM_DESC(peer_revoked, "umems whose driver hook revoked the HW access on invalidation");

static int ib_invalidate_peer_memory(void *reg_handle, u64 core_context);

/* --- clients ------------------------------------------------------------ */

void *ib_register_peer_memory_client(const struct peer_memory_client *peer_client,
				     invalidate_peer_memory *invalidate_callback)
{
	struct ib_peer_client *c;

	if (!peer_client->acquire || !peer_client->get_pages || !peer_client->put_pages ||
	    !peer_client->dma_map || !peer_client->dma_unmap || !peer_client->get_page_size) {
		pr_err("client %.64s lacks a mandatory callback\n", peer_client->name);
		return NULL;
	}
	c = kzalloc(sizeof(*c), GFP_KERNEL);
	if (!c)
		return NULL;
	c->ops = peer_client;
	atomic_set(&c->umems, 1);
	init_completion(&c->unused);
	xa_init_flags(&c->umem_xa, XA_FLAGS_ALLOC);
	/* Extended only if the version's last byte is set and ex_size covers flags. */
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
	list_add_tail(&c->node, &peer_clients);
	atomic64_inc(&st_clients);
	mutex_unlock(&peer_memory_mutex);
	pr_info("registered client %.64s %.16s (%s%s)\n", peer_client->name, peer_client->version,
		c->invalidation_required ? "invalidating" : "non-invalidating",
		c->unmaps ? ", INVALIDATE_UNMAPS" : "");
	return c;
}
EXPORT_SYMBOL(ib_register_peer_memory_client);

static void client_put(struct ib_peer_client *c)
{
	if (atomic_dec_and_test(&c->umems))
		complete(&c->unused);
}

void ib_unregister_peer_memory_client(void *reg_handle)
{
	struct ib_peer_client *c = reg_handle;

	mutex_lock(&peer_memory_mutex);
	list_del(&c->node);
	atomic64_dec(&st_clients);
	mutex_unlock(&peer_memory_mutex);
	/*
	 * Blocks until every umem made through this client is released. A
	 * completion, as OFED's kref + unload_comp: the last put's complete()
	 * is done with the client once it drops the completion's lock, which
	 * the wait takes before returning; a wait_event on the count could
	 * return, and free the client, before that put's wake_up ran.
	 */
	client_put(c);
	wait_for_completion(&c->unused);
	pr_info("unregistered client %.64s\n", c->ops->name);
	xa_destroy(&c->umem_xa);
	kfree(c);
}
EXPORT_SYMBOL(ib_unregister_peer_memory_client);

/* --- umems -------------------------------------------------------------- */

static struct ib_umem_peer *to_peer(struct ib_umem *umem)
{
	return container_of(umem, struct ib_umem_peer, umem);
}

bool ib_umem_is_peer(struct ib_umem *umem)
{
	struct ib_umem_peer *p;
	bool found = false;

	spin_lock(&peer_umems_lock);
	hash_for_each_possible(peer_umems, p, hnode, (unsigned long)umem)
		if (&p->umem == umem)
			found = true;
	spin_unlock(&peer_umems_lock);
	return found;
}
EXPORT_SYMBOL(ib_umem_is_peer);

static void peer_umem_free(struct kref *kref)
{
	struct ib_umem_peer *p = container_of(kref, struct ib_umem_peer, kref);

	mutex_destroy(&p->mapping_lock);
	kfree(p);
}

static void fix_peer_sgls(struct ib_umem_peer *p)
{
	struct sg_table *sgt = &p->umem.sgt_append.sgt;
	unsigned long addr = p->umem.address, end = addr + p->umem.length;
	struct scatterlist *sg;
	unsigned int i;

	for_each_sgtable_dma_sg(sgt, sg, i) {
		if (i == 0) {
			unsigned long off = ALIGN_DOWN(addr, PAGE_SIZE) -
					    ALIGN_DOWN(addr, p->page_size);

			p->first_sg = sg;
			p->first_dma_address = sg->dma_address;
			p->first_dma_length = sg_dma_len(sg);
			p->first_length = sg->length;
			sg->dma_address += off;
			sg_dma_len(sg) -= off;
			sg->length -= off;
		}
		if (i == sgt->nents - 1) {
			unsigned long trim = ALIGN(end, p->page_size) - ALIGN(end, PAGE_SIZE);

			p->last_sg = sg;
			p->last_dma_length = sg_dma_len(sg);
			p->last_length = sg->length;
			sg_dma_len(sg) -= trim;
			sg->length -= trim;
		}
	}
}

/* The client always sees the table it built. */
static void unfix_peer_sgls(struct ib_umem_peer *p)
{
	if (p->last_sg) {
		sg_dma_len(p->last_sg) = p->last_dma_length;
		p->last_sg->length = p->last_length;
	}
	if (p->first_sg) {
		p->first_sg->dma_address = p->first_dma_address;
		sg_dma_len(p->first_sg) = p->first_dma_length;
		p->first_sg->length = p->first_length;
	}
	p->first_sg = p->last_sg = NULL;
}

static void unmap_client(struct ib_umem_peer *p, struct ib_peer_client *c)
{
	struct sg_table *sgt = &p->umem.sgt_append.sgt;

	unfix_peer_sgls(p);
	c->ops->dma_unmap(sgt, p->ctx, p->dma_device);
	c->ops->put_pages(sgt, p->ctx);
	memset(&p->umem.sgt_append, 0, sizeof(p->umem.sgt_append));
}

static void uncharge(struct ib_umem *umem)
{
	atomic64_sub(ib_umem_num_pages(umem), &umem->owning_mm->pinned_vm);
	mmdrop(umem->owning_mm);
}

/*
 * pin_user_pages_fast refused the range (old_ret) and the driver allows the
 * peer path: ask the clients. @old is charged to pinned_vm and holds an mm
 * reference; on failure both are dropped and @old freed, on success the new
 * umem owns them. For an invalidating client, mapping_lock stays held until
 * the driver activates (or stops) the notifier.
 */
struct ib_umem *ib_peer_umem_get(struct ib_umem *old, struct device *dma_device,
				 int old_ret, unsigned long flags)
{
	struct ib_peer_client *c, *found = NULL;
	struct ib_umem_peer *p;
	void *ctx = NULL;
	int nmap = 0, err;

	if (!dma_device) {
		err = old_ret;
		goto err_old;
	}
	mutex_lock(&peer_memory_mutex);
	list_for_each_entry(c, &peer_clients, node) {
		if (c->invalidation_required && !(flags & IB_PEER_MEM_INVAL_SUPP))
			continue;
		if (c->ops->acquire(old->address, old->length, NULL, NULL, &ctx) > 0) {
			found = c;
			atomic_inc(&c->umems);
			break;
		}
	}
	mutex_unlock(&peer_memory_mutex);
	if (!found) {
		/* As OFED: the user sees the pin's error. */
		atomic64_inc(&st_unclaimed);
		atomic64_set(&st_last_unclaimed_err, old_ret);
		pr_info_ratelimited("no peer client claimed [%#lx, +%#zx) of pid %d: %d\n",
				    old->address, old->length, task_pid_nr(current), old_ret);
		err = old_ret;
		goto err_old;
	}
	c = found;
	p = kzalloc(sizeof(*p), GFP_KERNEL);
	if (!p) {
		err = -ENOMEM;
		goto err_client;
	}
	p->umem = *old;
	memset(&p->umem.sgt_append, 0, sizeof(p->umem.sgt_append));
	kfree(old);
	old = NULL;
	kref_init(&p->kref);
	mutex_init(&p->mapping_lock);
	lockdep_set_class(&p->mapping_lock, c->invalidation_required ?
			  &mapping_lock_inval_key : &mapping_lock_persist_key);
	p->client = p->owner = c;
	p->ctx = ctx;
	p->dma_device = dma_device;

	mutex_lock(&p->mapping_lock);
	if (c->invalidation_required) {
		err = xa_alloc_cyclic(&c->umem_xa, &p->xa_id, p,
				      XA_LIMIT(0, PEER_NO_INVALIDATION_ID - 1), &c->xa_next, GFP_KERNEL);
		if (err < 0)
			goto err_lock;
	} else {
		p->xa_id = PEER_NO_INVALIDATION_ID;
	}
	err = c->ops->get_pages(p->umem.address, p->umem.length, 1, !p->umem.writable, NULL, ctx,
				p->xa_id);
	if (err)
		goto err_xa;
	err = c->ops->dma_map(&p->umem.sgt_append.sgt, ctx, dma_device, 0, &nmap);
	if (err)
		goto err_pages;
	p->umem.sgt_append.sgt.nents = nmap;
	p->page_size = c->ops->get_page_size(ctx);
	if (p->page_size != PAGE_SIZE)
		fix_peer_sgls(p);
	p->state = PEER_UMEM_MAPPED;
	spin_lock(&peer_umems_lock);
	hash_add(peer_umems, &p->hnode, (unsigned long)&p->umem);
	spin_unlock(&peer_umems_lock);
	atomic64_inc(&st_umems);
	atomic64_inc(&st_alloc);
	if (p->xa_id == PEER_NO_INVALIDATION_ID)
		mutex_unlock(&p->mapping_lock);
	return &p->umem;

err_pages:
	c->ops->put_pages(&p->umem.sgt_append.sgt, ctx);
err_xa:
	if (p->xa_id != PEER_NO_INVALIDATION_ID)
		xa_erase(&c->umem_xa, p->xa_id);
err_lock:
	mutex_unlock(&p->mapping_lock);
	uncharge(&p->umem);
	kref_put(&p->kref, peer_umem_free);
err_client:
	if (c->ops->release)
		c->ops->release(ctx);
	client_put(c);
err_old:
	if (old) {
		uncharge(old);
		kfree(old);
	}
	return ERR_PTR(err);
}

void ib_umem_activate_invalidation_notifier(struct ib_umem *umem,
					    umem_invalidate_func_t func, void *priv)
{
	struct ib_umem_peer *p = to_peer(umem);

	if (p->xa_id == PEER_NO_INVALIDATION_ID)
		return;
	p->invalidate = func;
	p->priv = priv;
	p->activated = true;
	/* Pairs with the lock in ib_peer_umem_get(). */
	mutex_unlock(&p->mapping_lock);
}
EXPORT_SYMBOL(ib_umem_activate_invalidation_notifier);

/*
 * The driver revoked its HW access and takes no more invalidations. Before
 * activation (the HW object could not be made) mapping_lock is still held.
 */
void ib_umem_stop_invalidation_notifier(struct ib_umem *umem)
{
	struct ib_umem_peer *p = to_peer(umem);
	struct ib_peer_client *c = p->owner;
	enum peer_umem_state cur;

	if (p->xa_id == PEER_NO_INVALIDATION_ID || p->stopped)
		return;		/* unmapped by ib_peer_umem_release */
	p->stopped = true;
	if (p->activated)
		mutex_lock(&p->mapping_lock);
	p->invalidate = NULL;
	if (!c->unmaps) {
		if (p->state == PEER_UMEM_MAPPED)
			unmap_client(p, c);
		p->state = PEER_UMEM_UNMAPPED;
		mutex_unlock(&p->mapping_lock);
	} else {
		/* Blocks ib_invalidate_peer_memory; unmap outside the lock. */
		cur = p->state;
		p->state = PEER_UMEM_UNMAPPED;
		mutex_unlock(&p->mapping_lock);
		if (cur == PEER_UMEM_MAPPED)
			unmap_client(p, c);
	}
}
EXPORT_SYMBOL(ib_umem_stop_invalidation_notifier);

/* From ib_umem_release. Never under mapping_lock. */
void ib_peer_umem_release(struct ib_umem *umem)
{
	struct ib_umem_peer *p = to_peer(umem);
	struct ib_peer_client *c = p->owner;
	bool was_mapped;

	spin_lock(&peer_umems_lock);
	hash_del(&p->hnode);
	spin_unlock(&peer_umems_lock);
	/* A driver that did not stop the notifier: stop it here. */
	ib_umem_stop_invalidation_notifier(umem);
	mutex_lock(&p->mapping_lock);
	was_mapped = p->state == PEER_UMEM_MAPPED;
	if (was_mapped)
		p->state = PEER_UMEM_UNMAPPED;
	mutex_unlock(&p->mapping_lock);
	if (was_mapped)
		unmap_client(p, c);
	if (p->xa_id != PEER_NO_INVALIDATION_ID)
		xa_erase(&c->umem_xa, p->xa_id);
	if (c->ops->release)
		c->ops->release(p->ctx);
	WRITE_ONCE(p->client, NULL);
	client_put(c);
	atomic64_dec(&st_umems);
	atomic64_inc(&st_dealloc);
	uncharge(umem);
	kref_put(&p->kref, peer_umem_free);
}

/*
 * The function handed to invalidating clients: the peer memory is going
 * away (cudaFree, the owner's exit). Sleeps (mapping_lock).
 */
static int ib_invalidate_peer_memory(void *reg_handle, u64 core_context)
{
	struct ib_peer_client *c = reg_handle, *uc;
	struct ib_umem_peer *p;

	xa_lock(&c->umem_xa);
	p = xa_load(&c->umem_xa, core_context);
	if (p)
		kref_get(&p->kref);
	xa_unlock(&c->umem_xa);
	if (!p)
		return 0;
	atomic64_inc(&st_invalidations);
	mutex_lock(&p->mapping_lock);
	uc = READ_ONCE(p->client);
	if (uc && p->state == PEER_UMEM_MAPPED) {
		if (p->invalidate) {
			/* The HW access goes first: "any access will generate CQEs". */
			p->invalidate(&p->umem, p->priv);
			atomic64_inc(&st_revoked);
		}
		if (uc->unmaps) {
			unfix_peer_sgls(p);
			p->state = PEER_UMEM_INVALIDATED;
		} else {
			unmap_client(p, uc);
			p->state = PEER_UMEM_UNMAPPED;
		}
	}
	mutex_unlock(&p->mapping_lock);
	kref_put(&p->kref, peer_umem_free);
	return 0;
}
