/*
 * table.h - kvgate's native block table: block key -> which cache domains hold it, by tier.
 *
 * The same model as index/table.py (the pure-Python table, kept as the reference): per block
 * key, the parent, the first child and (branch points only) the other children; per cache
 * domain ("slot"), its held keys with their tiers in LRU order, tier counters and its orphans
 * per presence class (held blocks whose parent the slot does not hold in that class). With no
 * orphan of a slot on a query chain, each presence class is prefix-closed along the chain, so
 * the end of each run is found by bisection; otherwise the slot is walked block by block. The
 * two tables give the same answers to the same operations (tests/test_index_suite.py runs the
 * one suite and the property tests against both).
 *
 * Layout: one hash map key -> Link for every block (held, or kept because it has children);
 * per slot one hash map key -> Node (tiers, LRU neighbours by key, stamp). Everything is plain
 * C memory: nothing here is seen by Python's garbage collector.
 */
#ifndef KVGATE_TABLE_H
#define KVGATE_TABLE_H

#include <stdint.h>

#include "maps.h"

/* Presence classes: bit 0 GPU, bit 1 CPU-or-better, bit 2 any tier (index by a tier mask). */
static const uint8_t KV_CLASS_OF[8] = {0, 7, 6, 7, 4, 7, 6, 7};
#define KV_ALL_TIERS 7
#define KV_MAX_ORPHANS_CHECKED 64
#define KV_SECOND_CHANCES 64 /* index/table.py's SECOND_CHANCES */
#define KV_PREFETCH_AHEAD 8 /* blocks whose cells are on their way while one is stored */

enum { L_PARENT = 1, L_UNKNOWN = 2, L_CHILD = 4 };
enum { N_PREV = 1, N_NEXT = 2 };

typedef struct {
    uint64_t parent; /* valid with L_PARENT */
    uint64_t child;  /* first child, valid with L_CHILD */
    uint32_t more;   /* other children: index into Table.more (0: none) */
    uint32_t holders; /* slots holding the block in any tier (0: kept for its links) */
    uint8_t flags;
    uint8_t used; /* the map cell's own flag, kept in this struct's padding */
} Link;

typedef struct {
    uint64_t prev; /* older neighbour in the slot's LRU order, valid with N_PREV */
    uint64_t next; /* newer neighbour, valid with N_NEXT */
    double stamp;
    uint8_t tiers;
    uint8_t flags;
    uint8_t used; /* the map cell's own flag */
} Node;

typedef struct {
    char unused;
} Nothing;

MAP_DEFINE_PACKED(LinkMap, Link)
MAP_DEFINE_PACKED(NodeMap, Node)
MAP_DEFINE(DepthMap, int64_t)
MAP_DEFINE(KeySet, Nothing)

typedef struct {
    int used;
    NodeMap nodes;
    int has_lru;
    uint64_t head; /* least recently touched */
    uint64_t tail; /* most recently touched */
    int64_t counts[3];
    DepthMap orphans[3];
} Slot;

typedef struct {
    LinkMap links;
    Slot *slots;
    size_t nslots;
    KeySet *more; /* more[0] is never used */
    uint32_t nmore, cap_more;
    uint32_t *free_more;
    uint32_t nfree_more, cap_free_more;
    int64_t entries;
} Table;

/* ---------------------------------------------------------------- children sets */
static uint32_t more_new(Table *t)
{
    if (t->nfree_more)
        return t->free_more[--t->nfree_more];
    if (t->nmore == t->cap_more) {
        uint32_t cap = t->cap_more ? t->cap_more * 2 : 16;
        KeySet *grown = (KeySet *)KV_MALLOC(cap * sizeof(KeySet));
        if (grown == NULL)
            return 0;
        if (t->more != NULL)
            memcpy(grown, t->more, t->nmore * sizeof(KeySet));
        KV_FREE(t->more);
        t->more = grown;
        t->cap_more = cap;
        if (t->nmore == 0)
            t->nmore = 1; /* index 0 means "none" */
    }
    uint32_t id = t->nmore++;
    memset(&t->more[id], 0, sizeof(KeySet));
    return id;
}

static void more_release(Table *t, uint32_t id)
{
    KeySet_free(&t->more[id]);
    if (t->nfree_more == t->cap_free_more) {
        uint32_t cap = t->cap_free_more ? t->cap_free_more * 2 : 16;
        uint32_t *grown = (uint32_t *)KV_MALLOC(cap * sizeof(uint32_t));
        if (grown == NULL)
            return; /* the id is leaked until the table goes; its set is already freed */
        if (t->free_more != NULL)
            memcpy(grown, t->free_more, t->nfree_more * sizeof(uint32_t));
        KV_FREE(t->free_more);
        t->free_more = grown;
        t->cap_free_more = cap;
    }
    t->free_more[t->nfree_more++] = id;
}

/* ---------------------------------------------------------------- basics */
static void table_init(Table *t) { memset(t, 0, sizeof(*t)); }

static void slot_free(Slot *s)
{
    NodeMap_free(&s->nodes);
    for (int c = 0; c < 3; c++)
        DepthMap_free(&s->orphans[c]);
    memset(s, 0, sizeof(*s));
}

static void table_free(Table *t)
{
    LinkMap_free(&t->links);
    for (size_t i = 0; i < t->nslots; i++)
        slot_free(&t->slots[i]);
    KV_FREE(t->slots);
    for (uint32_t i = 1; i < t->nmore; i++)
        KeySet_free(&t->more[i]);
    KV_FREE(t->more);
    KV_FREE(t->free_more);
    table_init(t);
}

static Slot *table_slot(Table *t, size_t index)
{
    if (index >= t->nslots) {
        size_t n = index + 1 > t->nslots * 2 ? index + 1 : t->nslots * 2;
        Slot *grown = (Slot *)KV_MALLOC(n * sizeof(Slot));
        if (grown == NULL)
            return NULL;
        memset(grown, 0, n * sizeof(Slot));
        if (t->slots != NULL)
            memcpy(grown, t->slots, t->nslots * sizeof(Slot));
        KV_FREE(t->slots);
        t->slots = grown;
        t->nslots = n;
    }
    Slot *s = &t->slots[index];
    s->used = 1;
    return s;
}

static inline const Slot *table_slot_if(const Table *t, size_t index)
{
    return index < t->nslots && t->slots[index].used ? &t->slots[index] : NULL;
}

static inline uint8_t slot_tiers(const Slot *s, uint64_t key)
{
    const NodeMapCell *cell = NodeMap_find(&s->nodes, key);
    return cell ? cell->val.tiers : 0;
}

/* Position of ``key`` in its chain (0 = root), or -1 when its ancestry is unknown. */
static int64_t table_depth(const Table *t, uint64_t key)
{
    int64_t depth = 0;
    const LinkMapCell *cell = LinkMap_find(&t->links, key);
    while (cell != NULL) {
        if (cell->val.flags & L_UNKNOWN)
            return -1;
        if (!(cell->val.flags & L_PARENT))
            return depth;
        depth++;
        cell = LinkMap_find(&t->links, cell->val.parent);
    }
    return depth;
}

/* ---------------------------------------------------------------- LRU order */
static void lru_unlink(Slot *s, uint64_t key, Node *node)
{
    uint8_t flags = node->flags;
    uint64_t prev = node->prev, next = node->next;
    if (flags & N_PREV) {
        Node *p = &NodeMap_find(&s->nodes, prev)->val;
        if (flags & N_NEXT) {
            p->next = next;
        } else {
            p->flags &= (uint8_t)~N_NEXT;
        }
    } else {
        s->head = next;
    }
    if (flags & N_NEXT) {
        Node *n = &NodeMap_find(&s->nodes, next)->val;
        if (flags & N_PREV) {
            n->prev = prev;
        } else {
            n->flags &= (uint8_t)~N_PREV;
        }
    } else {
        s->tail = prev;
    }
    if (!(flags & (N_PREV | N_NEXT)))
        s->has_lru = 0;
    node->flags &= (uint8_t)~(N_PREV | N_NEXT);
    (void)key;
}

static void lru_append(Slot *s, uint64_t key, Node *node)
{
    if (s->has_lru) {
        Node *last = &NodeMap_find(&s->nodes, s->tail)->val;
        last->next = key;
        last->flags |= N_NEXT;
        node->prev = s->tail;
        node->flags |= N_PREV;
    } else {
        s->head = key;
        s->has_lru = 1;
    }
    s->tail = key;
}

/* Make ``key`` (held by the slot) the most recent, with ``stamp``. */
static void lru_touch(Slot *s, uint64_t key, double stamp)
{
    Node *node = &NodeMap_find(&s->nodes, key)->val;
    node->stamp = stamp;
    if (s->has_lru && s->tail == key)
        return;
    if (node->flags & N_NEXT || node->flags & N_PREV || (s->has_lru && s->head == key))
        lru_unlink(s, key, node);
    lru_append(s, key, node);
}

/* ---------------------------------------------------------------- orphans */
/* Returns -1 on memory failure. */
static int on_gain(Table *t, Slot *s, uint64_t key, uint8_t gained)
{
    const Link *link = &LinkMap_find(&t->links, key)->val;
    uint8_t parent_classes = 7;
    if (link->flags & L_UNKNOWN)
        parent_classes = 0;
    else if (link->flags & L_PARENT)
        parent_classes = KV_CLASS_OF[slot_tiers(s, link->parent)];
    for (int cls = 0; cls < 3; cls++) {
        if (!(gained >> cls & 1))
            continue;
        DepthMap *orphans = &s->orphans[cls];
        if (!(parent_classes >> cls & 1)) {
            int created;
            DepthMapCell *cell = DepthMap_insert(orphans, key, &created);
            if (cell == NULL)
                return -1;
            cell->val = table_depth(t, key);
        }
        if (orphans->len && link->flags & L_CHILD) {
            DepthMap_remove(orphans, link->child, NULL);
            if (link->more) {
                const KeySet *set = &t->more[link->more];
                for (size_t i = 0; i < set->cap && orphans->len; i++) {
                    if (set->cells[i].used)
                        DepthMap_remove(orphans, set->cells[i].key, NULL);
                }
            }
        }
    }
    return 0;
}

static int orphan_child(Table *t, Slot *s, int cls, uint64_t child)
{
    if (!(KV_CLASS_OF[slot_tiers(s, child)] >> cls & 1))
        return 0;
    int created;
    DepthMapCell *cell = DepthMap_insert(&s->orphans[cls], child, &created);
    if (cell == NULL)
        return -1;
    cell->val = table_depth(t, child);
    return 0;
}

static int on_loss(Table *t, Slot *s, uint64_t key, uint8_t lost)
{
    const Link *link = &LinkMap_find(&t->links, key)->val;
    for (int cls = 0; cls < 3; cls++) {
        if (!(lost >> cls & 1))
            continue;
        DepthMap_remove(&s->orphans[cls], key, NULL);
        if (!(link->flags & L_CHILD))
            continue;
        if (orphan_child(t, s, cls, link->child) < 0)
            return -1;
        if (link->more) {
            const KeySet *set = &t->more[link->more];
            for (size_t i = 0; i < set->cap; i++) {
                if (set->cells[i].used && orphan_child(t, s, cls, set->cells[i].key) < 0)
                    return -1;
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- links */
/* Record ``key`` as a child of ``parent`` (created as a link-only record if unknown). */
static int link_child(Table *t, uint64_t key, uint64_t parent)
{
    int created;
    LinkMapCell *cell = LinkMap_insert(&t->links, parent, &created);
    if (cell == NULL)
        return -1;
    Link *p = &cell->val;
    if (created)
        p->flags = L_UNKNOWN;
    if (!(p->flags & L_CHILD)) {
        p->child = key;
        p->flags |= L_CHILD;
        return 0;
    }
    if (p->child == key)
        return 0;
    if (!p->more) {
        uint32_t id = more_new(t);
        if (id == 0)
            return -1;
        p->more = id; /* ``p`` is still valid: more_new does not touch the links map */
    }
    return KeySet_insert(&t->more[p->more], key, &created) ? 0 : -1;
}

static void unlink_child(Table *t, uint64_t key, uint64_t parent)
{
    LinkMapCell *cell = LinkMap_find(&t->links, parent);
    if (cell == NULL)
        return;
    Link *p = &cell->val;
    KeySet *more = p->more ? &t->more[p->more] : NULL;
    if (p->flags & L_CHILD && p->child == key) {
        if (more != NULL && more->len) {
            for (size_t i = 0; i < more->cap; i++) {
                if (more->cells[i].used) {
                    p->child = more->cells[i].key;
                    break;
                }
            }
            KeySet_remove(more, p->child, NULL);
        } else {
            p->flags &= (uint8_t)~L_CHILD;
        }
    } else if (more != NULL) {
        KeySet_remove(more, key, NULL);
    }
    if (more != NULL && !more->len) {
        more_release(t, p->more);
        p->more = 0;
    }
}

/* Drop records nobody holds and nobody descends from, walking up the chain. */
static void collect(Table *t, uint64_t key)
{
    for (;;) {
        LinkMapCell *cell = LinkMap_find(&t->links, key);
        if (cell == NULL || cell->val.holders || cell->val.flags & L_CHILD)
            return;
        Link link = {0};
        LinkMap_remove(&t->links, key, &link);
        if (link.more)
            more_release(t, link.more);
        if (!(link.flags & L_PARENT))
            return;
        unlink_child(t, key, link.parent);
        key = link.parent;
    }
}

/* ---------------------------------------------------------------- store / drop */
/* Hold ``keys`` (a chain after ``parent`` when has_parent) in ``tier``; LRU-stamp them leaf
 * first so the chain's root is the most recent. Returns -1 on memory failure. */
static int table_store(Table *t, size_t slot, const uint64_t *keys, size_t n, int tier,
                       int has_parent, uint64_t parent, double stamp)
{
    if (n == 0)
        return 0;
    Slot *s = table_slot(t, slot);
    if (s == NULL)
        return -1;
    uint8_t bit = (uint8_t)(1u << tier);
    for (size_t i = 0; i < n && i < KV_PREFETCH_AHEAD; i++) {
        LinkMap_prefetch(&t->links, keys[i]);
        NodeMap_prefetch(&s->nodes, keys[i]);
    }
    int has_prev = has_parent;
    uint64_t prev = parent;
    for (size_t i = 0; i < n; i++) {
        if (i + KV_PREFETCH_AHEAD < n) { /* the cells of a block further down the chain */
            LinkMap_prefetch(&t->links, keys[i + KV_PREFETCH_AHEAD]);
            NodeMap_prefetch(&s->nodes, keys[i + KV_PREFETCH_AHEAD]);
        }
        uint64_t key = keys[i];
        int created;
        LinkMapCell *cell = LinkMap_insert(&t->links, key, &created);
        if (cell == NULL)
            return -1;
        if (created || cell->val.flags & L_UNKNOWN) {
            cell->val.flags &= (uint8_t)~(L_UNKNOWN | L_PARENT);
            if (has_prev) {
                cell->val.parent = prev;
                cell->val.flags |= L_PARENT;
                if (link_child(t, key, prev) < 0) /* may move ``cell`` */
                    return -1;
            }
        }
        NodeMapCell *node = NodeMap_insert(&s->nodes, key, &created);
        if (node == NULL)
            return -1;
        uint8_t tiers = node->val.tiers;
        if (!(tiers & bit)) {
            node->val.tiers = tiers | bit;
            s->counts[tier]++;
            if (!tiers) {
                t->entries++;
                LinkMap_find(&t->links, key)->val.holders++;
            }
            uint8_t gained = KV_CLASS_OF[tiers | bit] & (uint8_t)~KV_CLASS_OF[tiers];
            if (gained && on_gain(t, s, key, gained) < 0)
                return -1;
        }
        prev = key;
        has_prev = 1;
    }
    for (size_t i = n; i-- > 0;)
        lru_touch(s, keys[i], stamp);
    return 0;
}

/* ``key`` leaves ``tier_bits`` of the slot. Returns -1 on memory failure. */
static int table_drop(Table *t, Slot *s, uint64_t key, uint8_t tier_bits)
{
    NodeMapCell *cell = NodeMap_find(&s->nodes, key);
    if (cell == NULL)
        return 0;
    uint8_t tiers = cell->val.tiers;
    uint8_t dropped = tiers & tier_bits;
    if (!dropped)
        return 0;
    uint8_t left = tiers & (uint8_t)~dropped;
    for (int tier = 0; tier < 3; tier++) {
        if (dropped >> tier & 1)
            s->counts[tier]--;
    }
    if (left) {
        cell->val.tiers = left;
    } else {
        lru_unlink(s, key, &cell->val);
        NodeMap_remove(&s->nodes, key, NULL);
        t->entries--;
    }
    uint8_t lost = KV_CLASS_OF[tiers] & (uint8_t)~KV_CLASS_OF[left];
    if (lost && on_loss(t, s, key, lost) < 0)
        return -1;
    if (!left) {
        LinkMapCell *link = LinkMap_find(&t->links, key);
        if (link != NULL && --link->val.holders == 0)
            collect(t, key);
    }
    return 0;
}

/* ``keys`` leave ``tier_bits`` of the slot (cells of later keys are fetched ahead). */
static int table_remove(Table *t, Slot *s, const uint64_t *keys, size_t n, uint8_t tier_bits)
{
    for (size_t i = 0; i < n; i++) {
        if (i + KV_PREFETCH_AHEAD < n) {
            NodeMap_prefetch(&s->nodes, keys[i + KV_PREFETCH_AHEAD]);
            LinkMap_prefetch(&t->links, keys[i + KV_PREFETCH_AHEAD]);
        }
        if (table_drop(t, s, keys[i], tier_bits) < 0)
            return -1;
    }
    return 0;
}

/* Forget every block of a slot and release it. Returns -1 on memory failure. */
static int table_clear(Table *t, size_t slot)
{
    if (slot >= t->nslots || !t->slots[slot].used)
        return 0;
    Slot *s = &t->slots[slot];
    size_t n = s->nodes.len, ndead = 0;
    uint64_t *dead = n ? (uint64_t *)KV_MALLOC(n * sizeof(uint64_t)) : NULL;
    if (n && dead == NULL)
        return -1;
    for (size_t i = 0; i < s->nodes.cap; i++) {
        if (!s->nodes.cells[i].val.used)
            continue;
        uint64_t key = s->nodes.cells[i].key;
        LinkMapCell *link = LinkMap_find(&t->links, key);
        if (link != NULL && --link->val.holders == 0)
            dead[ndead++] = key;
    }
    t->entries -= (int64_t)n;
    slot_free(s);
    for (size_t i = 0; i < ndead; i++)
        collect(t, dead[i]);
    KV_FREE(dead);
    return 0;
}

static int has_held_child(const Table *t, const Slot *s, uint64_t key)
{
    const LinkMapCell *cell = LinkMap_find(&t->links, key);
    if (cell == NULL || !(cell->val.flags & L_CHILD))
        return 0;
    if (slot_tiers(s, cell->val.child))
        return 1;
    if (cell->val.more) {
        const KeySet *set = &t->more[cell->val.more];
        for (size_t i = 0; i < set->cap; i++) {
            if (set->cells[i].used && slot_tiers(s, set->cells[i].key))
                return 1;
        }
    }
    return 0;
}

/* Evict the least recently stored leaf of a slot (an entry with a held child goes back to
 * the recent end, up to ``second_chances`` times). 1: evicted, 0: empty, -1: no memory. */
static int table_prune_leaf(Table *t, size_t slot, long second_chances)
{
    if (slot >= t->nslots || !t->slots[slot].used)
        return 0;
    Slot *s = &t->slots[slot];
    uint64_t key = 0;
    for (long i = 0; i <= second_chances; i++) {
        if (!s->has_lru)
            return 0;
        key = s->head;
        if (!has_held_child(t, s, key))
            break;
        lru_touch(s, key, NodeMap_find(&s->nodes, key)->val.stamp);
    }
    return table_drop(t, s, key, KV_ALL_TIERS) < 0 ? -1 : 1;
}

/* The slot with the most entries (the lowest on ties); 0 when there is none. */
static int table_largest(const Table *t, size_t *slot)
{
    int found = 0;
    size_t best = 0;
    for (size_t i = 0; i < t->nslots; i++) {
        if (t->slots[i].used && (!found || t->slots[i].nodes.len > t->slots[best].nodes.len)) {
            best = i;
            found = 1;
        }
    }
    *slot = best;
    return found;
}

/* ---------------------------------------------------------------- matching */
/* Keys of a query, read on demand (a 50k-token prompt has 3k keys; bisection reads ~40). */
typedef struct {
    uint64_t (*at)(void *ctx, size_t i);
    void *ctx;
    size_t n;
} KeySource;

static int chain_has_orphan(const Slot *s, const KeySource *q)
{
    int any = 0;
    for (int c = 0; c < 3; c++) {
        if (s->orphans[c].len > KV_MAX_ORPHANS_CHECKED)
            return 1;
        any |= s->orphans[c].len != 0;
    }
    if (!any)
        return 0;
    for (int c = 0; c < 3; c++) {
        const DepthMap *o = &s->orphans[c];
        for (size_t i = 0; i < o->cap; i++) {
            if (!o->cells[i].used)
                continue;
            int64_t depth = o->cells[i].val;
            if (depth < 0 || ((size_t)depth < q->n && q->at(q->ctx, (size_t)depth) == o->cells[i].key))
                return 1;
        }
    }
    return 0;
}

/* ends[c]: index of the first block of the query not held in class c (n if all are). */
static void walk(const Slot *s, const KeySource *q, size_t ends[3])
{
    ends[0] = ends[1] = ends[2] = q->n;
    int open = 7;
    for (size_t i = 0; i < q->n && open; i++) {
        uint8_t classes = KV_CLASS_OF[slot_tiers(s, q->at(q->ctx, i))];
        for (int c = 0; c < 3; c++) {
            if (open >> c & 1 && !(classes >> c & 1)) {
                ends[c] = i;
                open &= ~(1 << c);
            }
        }
    }
}

/* One slot's search: [lo, hi) still open for the current class, ends found so far. */
typedef struct {
    const Slot *slot;
    size_t index;
    size_t lo, hi, mid;
    size_t ends[3];
    uint64_t mid_key;
    int active;
} Search;

/* Same result as walk() for every slot with no orphan on the query chain, all slots at once:
 * each round fetches every slot's probe cell together (one memory wait per round, not one
 * per slot). Per class (any tier, then CPU-or-better, then GPU: nested runs) the last block
 * of the run left open is probed first, so a fully held prefix costs one probe. */
static void bisect_all(Search *all, size_t count, const KeySource *q)
{
    for (int c = 2; c >= 0; c--) {
        size_t active = 0;
        for (size_t i = 0; i < count; i++) {
            Search *x = &all[i];
            x->lo = 0;
            x->hi = c == 2 ? q->n : x->ends[c + 1];
            x->mid = x->hi - 1; /* first probe: the last block */
            x->active = x->hi > 1;
            /* block 0 is held in class c, or the run is empty (slot_tiers of keys[0]) */
            if (x->hi > 0 && !(KV_CLASS_OF[slot_tiers(x->slot, q->at(q->ctx, 0))] >> c & 1)) {
                x->hi = 0;
                x->active = 0;
            }
            active += (size_t)x->active;
        }
        while (active) {
            for (size_t i = 0; i < count; i++) {
                Search *x = &all[i];
                if (x->active) {
                    x->mid_key = q->at(q->ctx, x->mid);
                    NodeMap_prefetch(&x->slot->nodes, x->mid_key);
                }
            }
            for (size_t i = 0; i < count; i++) {
                Search *x = &all[i];
                if (!x->active)
                    continue;
                if (KV_CLASS_OF[slot_tiers(x->slot, x->mid_key)] >> c & 1)
                    x->lo = x->mid;
                else
                    x->hi = x->mid;
                if (x->lo == x->hi - 1) {
                    x->active = 0;
                    active--;
                } else {
                    x->mid = x->lo + (x->hi - x->lo) / 2;
                }
            }
        }
        for (size_t i = 0; i < count; i++)
            all[i].ends[c] = all[i].hi;
    }
}

/* Every slot holding keys[0]: the ends of its runs (GPU, CPU-or-better, any) in ``out``,
 * which has room for t->nslots. Returns how many. */
static size_t table_find(const Table *t, const KeySource *q, Search *out)
{
    if (q->n == 0)
        return 0;
    uint64_t first = q->at(q->ctx, 0);
    for (size_t i = 0; i < t->nslots; i++) {
        if (t->slots[i].used)
            NodeMap_prefetch(&t->slots[i].nodes, first);
    }
    size_t count = 0, safe = 0;
    for (size_t i = 0; i < t->nslots; i++) {
        const Slot *s = &t->slots[i];
        if (!s->used || !slot_tiers(s, first))
            continue;
        Search x = {.slot = s, .index = i};
        if (chain_has_orphan(s, q)) {
            walk(s, q, x.ends);
            out[count++] = x; /* walked slots go last */
        } else {
            /* keep the safe slots first: move a walked one out of the way */
            if (count > safe)
                out[count] = out[safe];
            out[safe++] = x;
            count++;
        }
    }
    bisect_all(out, safe, q);
    return count;
}

#endif /* KVGATE_TABLE_H */
