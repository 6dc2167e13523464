/*
 * table.h - kvgate's native block table: block key -> which cache domains hold it, by tier.
 *
 * The same model as index/table/_table.py (the pure-Python table): per held block key, the parent,
 * the first child and (branch points only) the other children; per cache domain ("slot"), its
 * held keys with their tiers, LRU order, depth in the slot's own chains and a "contested" flag,
 * tier counters, and its orphans per presence class (held blocks whose parent the slot does not
 * hold in that class, and markers for blocks with many children it lost). With no orphan of a
 * slot on a query chain, each presence class is prefix-closed along the chain, so the end of
 * each run is found by bisection; otherwise the slot is walked block by block. The two tables
 * give the same answers to the same operations (tests/test_index_suite.py runs the one suite
 * and the property tests against both).
 *
 * Everything here is fed by publishers kvgate does not trust (docs/security-events.md). Block
 * keys are xxh3 over token ids, so a publisher can give a block any key, its own parent's
 * included. The structure stays sound and every operation bounded by construction:
 *
 *   - a record exists exactly while a slot holds its key, so records never outnumber entries;
 *     when its last holder goes, its children are detached (their ancestry becomes unknown);
 *   - a parent link is set only towards an existing record, never to the block itself, and on
 *     a record of unknown ancestry only if a bounded walk up from the new parent ends without
 *     meeting it: the links never form a cycle, so every walk up them ends;
 *   - depths are per slot, counted along the slot's own stores (no walk, no global answer a
 *     publisher could set for others); a slot that stores a block under another parent than the
 *     one on record marks it contested: an orphan for as long as the slot holds it;
 *   - per operation at most KV_MAX_CHILDREN_SCANNED children are looked at: a slot losing a
 *     block with more leaves one marker orphan for it instead of one per child.
 *
 * Layout: one hash map key -> Link per held block; per slot one hash map key -> Node (tiers,
 * LRU neighbours by key, stamp, depth). Everything is plain C memory: nothing here is seen by
 * Python's garbage collector.
 */
#ifndef KVGATE_TABLE_H
#define KVGATE_TABLE_H

#include <stdint.h>

#include "maps.h"

/* Presence classes: bit 0 GPU, bit 1 CPU-or-better, bit 2 any tier (index by a tier mask). */
static const uint8_t KV_CLASS_OF[8] = {0, 7, 6, 7, 4, 7, 6, 7};
#define KV_ALL_TIERS 7
#define KV_MAX_ORPHANS_CHECKED 64
#define KV_MAX_CHILDREN_SCANNED 64 /* index/table/_table.py's MAX_CHILDREN_SCANNED */
#define KV_MAX_ANCESTRY_CHECKED 64 /* index/table/_table.py's MAX_ANCESTRY_CHECKED */
#define KV_SECOND_CHANCES 64 /* index/table/_table.py's SECOND_CHANCES */
#define KV_PREFETCH_AHEAD 8 /* blocks whose cells are on their way while one is stored */
#define KV_NO_DEPTH (-1)

/* L_UNKNOWN: no parent link and the ancestry is unknown (an orphan wherever it is held).
 * L_MARKED: some slot may hold a marker orphan for this block. */
enum { L_PARENT = 1, L_UNKNOWN = 2, L_CHILD = 4, L_MARKED = 8 };
/* N_CONTESTED: the slot stored the block under another parent than the record's. */
enum { N_PREV = 1, N_NEXT = 2, N_CONTESTED = 4 };

typedef struct {
    uint64_t parent; /* valid with L_PARENT */
    uint64_t child;  /* first child, valid with L_CHILD */
    uint32_t more;   /* other children: index into Table.more (0: none) */
    uint32_t holders; /* slots holding the block in any tier */
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
    int32_t depth; /* position in the slot's own chain (0 = root), or KV_NO_DEPTH */
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
    uint64_t seed; /* the secret of every map's key mix */
} Table;

/* ---------------------------------------------------------------- children sets */
static KV_UNUSED uint32_t more_new(Table *t)
{
    if (t->nfree_more) {
        uint32_t id = t->free_more[--t->nfree_more];
        t->more[id].seed = t->seed;
        return id;
    }
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
    t->more[id].seed = t->seed;
    return id;
}

static KV_UNUSED void more_release(Table *t, uint32_t id)
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

/* How many children a record has. */
static inline size_t link_children(const Table *t, const Link *link)
{
    if (!(link->flags & L_CHILD))
        return 0;
    return 1 + (link->more ? t->more[link->more].len : 0);
}

/* The children of a record into ``out`` (room for KV_MAX_CHILDREN_SCANNED); how many, or
 * SIZE_MAX when there are more than that (then ``out`` is not filled). */
static KV_UNUSED size_t children_upto(const Table *t, const Link *link, uint64_t *out)
{
    size_t n = link_children(t, link);
    if (n == 0 || n > KV_MAX_CHILDREN_SCANNED)
        return n == 0 ? 0 : SIZE_MAX;
    out[0] = link->child;
    size_t k = 1;
    if (link->more) {
        const KeySet *set = &t->more[link->more];
        for (size_t i = 0; i < set->cap && k < n; i++) {
            if (set->cells[i].used)
                out[k++] = set->cells[i].key;
        }
    }
    return k;
}

/* ---------------------------------------------------------------- basics */
static KV_UNUSED void table_init(Table *t)
{
    memset(t, 0, sizeof(*t));
    t->seed = kv_random_seed();
    t->links.seed = t->seed;
}

static KV_UNUSED void slot_free(Slot *s)
{
    NodeMap_free(&s->nodes);
    for (int c = 0; c < 3; c++)
        DepthMap_free(&s->orphans[c]);
    memset(s, 0, sizeof(*s));
}

static KV_UNUSED void table_free(Table *t)
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

static KV_UNUSED Slot *table_slot(Table *t, size_t index)
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
    if (!s->used) {
        s->used = 1;
        s->nodes.seed = t->seed;
        for (int c = 0; c < 3; c++)
            s->orphans[c].seed = t->seed;
    }
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

static inline int32_t slot_depth(const Slot *s, uint64_t key)
{
    const NodeMapCell *cell = NodeMap_find(&s->nodes, key);
    return cell ? cell->val.depth : KV_NO_DEPTH;
}

/* ---------------------------------------------------------------- LRU order */
static KV_UNUSED void lru_unlink(Slot *s, uint64_t key, Node *node)
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

static KV_UNUSED void lru_append(Slot *s, uint64_t key, Node *node)
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
static KV_UNUSED void lru_touch(Slot *s, uint64_t key, double stamp)
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
static KV_UNUSED int orphan_put(DepthMap *orphans, uint64_t key, int32_t depth)
{
    int created;
    DepthMapCell *cell = DepthMap_insert(orphans, key, &created);
    if (cell == NULL)
        return -1;
    cell->val = depth;
    return 0;
}

/* Is the held ``key`` an orphan of the slot in each class (bit per class)? */
static KV_UNUSED uint8_t orphan_classes(const Slot *s, const Link *link, const Node *node)
{
    if (node->flags & N_CONTESTED || link->flags & L_UNKNOWN)
        return 7;
    if (!(link->flags & L_PARENT))
        return 0; /* a root */
    return (uint8_t)(7 & ~KV_CLASS_OF[slot_tiers(s, link->parent)]);
}

/* ``key`` (held) is now in the classes ``gained``: its own orphan entry is set or cleared (a
 * marker of it goes either way), and its children held in those classes are orphans no more
 * (up to KV_MAX_CHILDREN_SCANNED children: past that they stay, which only costs walks). */
static KV_UNUSED int on_gain(Table *t, Slot *s, uint64_t key, const Link *link, const Node *node,
                             uint8_t gained)
{
    uint8_t orphaned = orphan_classes(s, link, node);
    int32_t depth = node->depth;
    uint64_t kids[KV_MAX_CHILDREN_SCANNED];
    size_t nkids = children_upto(t, link, kids);
    for (int cls = 0; cls < 3; cls++) {
        if (!(gained >> cls & 1))
            continue;
        DepthMap *orphans = &s->orphans[cls];
        if (orphaned >> cls & 1) {
            if (orphan_put(orphans, key, depth) < 0)
                return -1;
        } else {
            DepthMap_remove(orphans, key, NULL);
        }
        for (size_t i = 0; i < nkids && nkids != SIZE_MAX && orphans->len; i++) {
            const NodeMapCell *kid = NodeMap_find(&s->nodes, kids[i]);
            if (kid != NULL && KV_CLASS_OF[kid->val.tiers] >> cls & 1 &&
                !(kid->val.flags & N_CONTESTED))
                DepthMap_remove(orphans, kids[i], NULL);
        }
    }
    return 0;
}

/* A held ``key``'s node changed: ``contested`` now (an orphan in every class it is held in),
 * or only its depth (its orphan entries, if any, get the new one). Which entries exist never
 * depends on a depth: the two tables then agree on them whatever depths they keep. */
static KV_UNUSED int refresh_orphan(Slot *s, uint64_t key, int contested)
{
    const Node *node = &NodeMap_find(&s->nodes, key)->val;
    uint8_t held = KV_CLASS_OF[node->tiers];
    int32_t depth = node->depth;
    for (int cls = 0; cls < 3; cls++) {
        if (!(held >> cls & 1))
            continue;
        DepthMapCell *cell = DepthMap_find(&s->orphans[cls], key);
        if (cell != NULL)
            cell->val = depth;
        else if (contested && orphan_put(&s->orphans[cls], key, depth) < 0)
            return -1;
    }
    return 0;
}

/* ``key`` (``depth`` in this slot) left the classes ``lost``: its children held in them are
 * orphans now, or, past KV_MAX_CHILDREN_SCANNED children, ``key`` stays as a marker orphan
 * (not held: it only says "walk queries through here"). */
static KV_UNUSED int on_loss(Table *t, Slot *s, uint64_t key, int32_t depth, uint8_t lost)
{
    Link *link = &LinkMap_find(&t->links, key)->val;
    uint64_t kids[KV_MAX_CHILDREN_SCANNED];
    size_t nkids = children_upto(t, link, kids);
    if (nkids == SIZE_MAX)
        link->flags |= L_MARKED;
    for (int cls = 0; cls < 3; cls++) {
        if (!(lost >> cls & 1))
            continue;
        DepthMap *orphans = &s->orphans[cls];
        DepthMap_remove(orphans, key, NULL);
        if (nkids == SIZE_MAX) {
            if (orphan_put(orphans, key, depth) < 0)
                return -1;
            continue;
        }
        for (size_t i = 0; i < nkids; i++) {
            const NodeMapCell *kid = NodeMap_find(&s->nodes, kids[i]);
            if (kid != NULL && KV_CLASS_OF[kid->val.tiers] >> cls & 1 &&
                orphan_put(orphans, kids[i], kid->val.depth) < 0)
                return -1;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- links */
/* Record ``key`` as a child of ``parent`` (an existing record). */
static KV_UNUSED int link_child(Table *t, uint64_t key, uint64_t parent)
{
    Link *p = &LinkMap_find(&t->links, parent)->val;
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
    int created;
    return KeySet_insert(&t->more[p->more], key, &created) ? 0 : -1;
}

static KV_UNUSED void unlink_child(Table *t, uint64_t key, uint64_t parent)
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

/* Does ``ancestor`` lie on the chain up from ``key`` (``key`` itself included)? Only the first
 * KV_MAX_ANCESTRY_CHECKED links are followed: past them the answer is yes (unproven). */
static KV_UNUSED int may_descend(const Table *t, uint64_t key, uint64_t ancestor)
{
    for (int steps = 0; steps <= KV_MAX_ANCESTRY_CHECKED; steps++) {
        if (key == ancestor)
            return 1;
        const LinkMapCell *cell = LinkMap_find(&t->links, key);
        if (cell == NULL || !(cell->val.flags & L_PARENT))
            return 0;
        key = cell->val.parent;
    }
    return 1;
}

/* ``key`` is stored after ``prev`` (``has_prev``; else as a chain's root): set its links if
 * its record is new or of unknown ancestry and that cannot close a cycle. *contested tells
 * whether the record's parent differs from ``prev`` after that. */
static KV_UNUSED int link_stored(Table *t, uint64_t key, Link *link, int created, int has_prev,
                                 uint64_t prev, int prev_exists, int *contested)
{
    if (created || link->flags & L_UNKNOWN) {
        *contested = 0;
        if (!has_prev) {
            link->flags &= (uint8_t)~L_UNKNOWN; /* known now: a root */
            return 0;
        }
        /* a new record has no children, so only the block itself could close a cycle */
        if ((prev_exists || LinkMap_find(&t->links, prev) != NULL) &&
            (created ? prev != key : !may_descend(t, prev, key))) {
            link->flags = (uint8_t)((link->flags & ~L_UNKNOWN) | L_PARENT);
            link->parent = prev;
            return link_child(t, key, prev);
        }
        link->flags |= L_UNKNOWN;
        *contested = 1;
        return 0;
    }
    if (!has_prev)
        *contested = (link->flags & L_PARENT) != 0;
    else
        *contested = !(link->flags & L_PARENT) || link->parent != prev;
    return 0;
}

/* Slots holding a marker of ``key`` (whose record goes): each becomes orphans of the
 * children the slot holds in the marker's class. */
static KV_UNUSED int unmark(Table *t, const Link *link, uint64_t key)
{
    for (size_t i = 0; i < t->nslots; i++) {
        Slot *s = &t->slots[i];
        for (int cls = 0; s->used && cls < 3; cls++) {
            DepthMap *orphans = &s->orphans[cls];
            if (!DepthMap_remove(orphans, key, NULL) || !(link->flags & L_CHILD))
                continue;
            const KeySet *more = link->more ? &t->more[link->more] : NULL;
            for (size_t j = 0; j <= (more ? more->cap : 0); j++) {
                uint64_t kid = link->child;
                if (j > 0) {
                    if (!more->cells[j - 1].used)
                        continue;
                    kid = more->cells[j - 1].key;
                }
                const NodeMapCell *node = NodeMap_find(&s->nodes, kid);
                if (node != NULL && KV_CLASS_OF[node->val.tiers] >> cls & 1 &&
                    orphan_put(orphans, kid, node->val.depth) < 0)
                    return -1;
            }
        }
    }
    return 0;
}

static KV_UNUSED void detach(Table *t, uint64_t kid)
{
    LinkMapCell *cell = LinkMap_find(&t->links, kid);
    if (cell != NULL)
        cell->val.flags = (uint8_t)((cell->val.flags & ~L_PARENT) | L_UNKNOWN);
}

/* The last holder of ``key`` is gone: its record goes, its children lose their parent. */
static KV_UNUSED int drop_record(Table *t, uint64_t key)
{
    Link link = LinkMap_find(&t->links, key)->val;
    if (link.flags & L_MARKED && unmark(t, &link, key) < 0)
        return -1;
    if (link.flags & L_CHILD) {
        detach(t, link.child);
        const KeySet *more = link.more ? &t->more[link.more] : NULL;
        for (size_t i = 0; more != NULL && i < more->cap; i++) {
            if (more->cells[i].used)
                detach(t, more->cells[i].key);
        }
    }
    LinkMap_remove(&t->links, key, NULL);
    if (link.more)
        more_release(t, link.more);
    if (link.flags & L_PARENT)
        unlink_child(t, key, link.parent);
    return 0;
}

/* ---------------------------------------------------------------- store / drop */
/* The node of a block the slot stores: a new one gets the depth and contested flag; an
 * existing one becomes contested if this store is, and loses its depth if this store gives
 * another. Returns what changed on an existing node: NODE_CONTESTED, NODE_DEPTH. */
enum { NODE_CONTESTED = 1, NODE_DEPTH = 2 };

static KV_UNUSED int node_stored(NodeMapCell *node, int created, int32_t depth, int contested)
{
    if (created) {
        node->val.depth = depth;
        node->val.flags = contested ? N_CONTESTED : 0;
        return 0;
    }
    int changed = 0;
    if (contested && !(node->val.flags & N_CONTESTED)) {
        node->val.flags |= N_CONTESTED;
        changed |= NODE_CONTESTED;
    }
    if (depth != KV_NO_DEPTH && node->val.depth != depth) {
        node->val.depth = node->val.depth == KV_NO_DEPTH ? depth : KV_NO_DEPTH;
        changed |= NODE_DEPTH;
    }
    return changed;
}

/* Depth of the block after ``parent`` in the slot (KV_NO_DEPTH when not known there). */
static KV_UNUSED int32_t first_depth(const Slot *s, int has_parent, uint64_t parent)
{
    if (!has_parent)
        return 0;
    int32_t depth = slot_depth(s, parent);
    return depth == KV_NO_DEPTH || depth == INT32_MAX ? KV_NO_DEPTH : depth + 1;
}

/* Hold ``keys`` (a chain after ``parent`` when has_parent) in ``tier``; LRU-stamp them leaf
 * first so the chain's root is the most recent. Returns -1 on memory failure. */
static KV_UNUSED int table_store(Table *t, size_t slot, const uint64_t *keys, size_t n, int tier,
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
    int32_t depth = first_depth(s, has_parent, parent);
    int has_prev = has_parent;
    uint64_t prev = parent;
    for (size_t i = 0; i < n; i++) {
        if (i + KV_PREFETCH_AHEAD < n) { /* the cells of a block further down the chain */
            LinkMap_prefetch(&t->links, keys[i + KV_PREFETCH_AHEAD]);
            NodeMap_prefetch(&s->nodes, keys[i + KV_PREFETCH_AHEAD]);
        }
        uint64_t key = keys[i];
        int created, contested;
        LinkMapCell *cell = LinkMap_insert(&t->links, key, &created);
        if (cell == NULL ||
            link_stored(t, key, &cell->val, created, has_prev, prev, i > 0, &contested) < 0)
            return -1;
        NodeMapCell *node = NodeMap_insert(&s->nodes, key, &created);
        if (node == NULL)
            return -1;
        int changed = node_stored(node, created, depth, contested);
        uint8_t tiers = node->val.tiers;
        if (!(tiers & bit)) {
            node->val.tiers = tiers | bit;
            s->counts[tier]++;
            Link *link = &cell->val; /* no insertion into the links map since */
            if (!tiers) {
                t->entries++;
                link->holders++;
            }
            uint8_t gained = KV_CLASS_OF[tiers | bit] & (uint8_t)~KV_CLASS_OF[tiers];
            if (gained && on_gain(t, s, key, link, &node->val, gained) < 0)
                return -1;
        }
        if (changed && refresh_orphan(s, key, changed & NODE_CONTESTED) < 0)
            return -1;
        prev = key;
        has_prev = 1;
        if (depth != KV_NO_DEPTH)
            depth = depth == INT32_MAX ? KV_NO_DEPTH : depth + 1;
    }
    for (size_t i = n; i-- > 0;)
        lru_touch(s, keys[i], stamp);
    return 0;
}

/* ``key`` leaves ``tier_bits`` of the slot. Returns -1 on memory failure. */
static KV_UNUSED int table_drop(Table *t, Slot *s, uint64_t key, uint8_t tier_bits)
{
    NodeMapCell *cell = NodeMap_find(&s->nodes, key);
    if (cell == NULL)
        return 0;
    uint8_t tiers = cell->val.tiers;
    uint8_t dropped = tiers & tier_bits;
    if (!dropped)
        return 0;
    uint8_t left = tiers & (uint8_t)~dropped;
    int32_t depth = cell->val.depth;
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
    if (lost && on_loss(t, s, key, depth, lost) < 0)
        return -1;
    if (!left) {
        LinkMapCell *link = LinkMap_find(&t->links, key);
        if (link != NULL && --link->val.holders == 0)
            return drop_record(t, key);
    }
    return 0;
}

/* ``keys`` leave ``tier_bits`` of the slot (cells of later keys are fetched ahead). */
static KV_UNUSED int table_remove(Table *t, Slot *s, const uint64_t *keys, size_t n,
                                  uint8_t tier_bits)
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
static KV_UNUSED int table_clear(Table *t, size_t slot)
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
    int rc = 0;
    for (size_t i = 0; i < ndead && rc == 0; i++)
        rc = drop_record(t, dead[i]);
    KV_FREE(dead);
    return rc;
}

static KV_UNUSED int has_held_child(const Table *t, const Slot *s, uint64_t key)
{
    const LinkMapCell *cell = LinkMap_find(&t->links, key);
    if (cell == NULL)
        return 0;
    uint64_t kids[KV_MAX_CHILDREN_SCANNED];
    size_t nkids = children_upto(t, &cell->val, kids);
    if (nkids == SIZE_MAX)
        return 1; /* too many to look at: taken as held */
    for (size_t i = 0; i < nkids; i++) {
        if (slot_tiers(s, kids[i]))
            return 1;
    }
    return 0;
}

/* Evict the least recently stored leaf of a slot (an entry with a held child goes back to
 * the recent end, up to ``second_chances`` times). 1: evicted, 0: empty, -1: no memory. */
static KV_UNUSED int table_prune_leaf(Table *t, size_t slot, long second_chances)
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
static KV_UNUSED int table_largest(const Table *t, size_t *slot)
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

/* The cap of an event-fed table (IndexConfig.max_entries): while it holds more entries than
 * ``cap``, evict the least recently stored leaf of the largest slot (the lowest on ties). The
 * one pruning rule; index/table/_table.py's BlockTable.prune_to is the same rule in Python
 * (tests/test_native_ingest.py holds the two to the same answers). Returns how many entries
 * went; -1: no memory. */
static KV_UNUSED long table_prune_to(Table *t, int64_t cap)
{
    long pruned = 0;
    size_t slot;
    while (t->entries > cap && table_largest(t, &slot)) {
        int rc = table_prune_leaf(t, slot, KV_SECOND_CHANCES);
        if (rc <= 0)
            return rc < 0 ? -1 : pruned;
        pruned++;
    }
    return pruned;
}

/* ---------------------------------------------------------------- matching */
/* Keys of a query, read on demand (a 50k-token prompt has 3k keys; bisection reads ~40). */
typedef struct {
    uint64_t (*at)(void *ctx, size_t i);
    void *ctx;
    size_t n;
} KeySource;

static KV_UNUSED int chain_has_orphan(const Slot *s, const KeySource *q)
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
static KV_UNUSED void walk(const Slot *s, const KeySource *q, size_t ends[3])
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
static KV_UNUSED void bisect_all(Search *all, size_t count, const KeySource *q)
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
static KV_UNUSED size_t table_find(const Table *t, const KeySource *q, Search *out)
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
