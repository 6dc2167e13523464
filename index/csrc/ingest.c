/*
 * ingest.c - a whole KV-event payload applied to one slot of a Table and its KeyMap in C, for
 * the shape engines send nearly always: GPU-tier BlockStored / BlockRemoved events without
 * LoRA or cache salt, for the domain's own data-parallel rank and block size. The batch is
 * parsed and checked in full first (wire.c); anything else (another tier, LoRA, a salt,
 * AllBlocksCleared, another rank or block size, a malformed payload) leaves everything
 * untouched and returns None: index/events/ then takes its general path, which gives the same
 * result (tests/test_native_ingest.py checks the two against each other). The table's cap is
 * kept by table.h's one pruning rule after every stored event, as on the general path.
 */
#include "native.h"
#include "wire.h"

/* Everything about one batch: counts reported back to Python. */
typedef struct {
    Table *table;
    size_t slot;
    U64Map *known;
    uint64_t block_size, root_seed;
    int64_t max_entries;
    size_t max_blocks;
    Py_ssize_t stored_events, stored_blocks, removed_events, removed_blocks;
    Py_ssize_t malformed, unknown_parent, pruned, pruned_parent;
} Batch;

static int apply_stored(Batch *b, const WireEvent *ev)
{
    uint64_t *hashes = NULL, *keys = NULL, prev = b->root_seed;
    uint8_t *packed = NULL;
    size_t n;
    int has_parent = !field_is_nil(ev, F_PARENT), rc;
    if (has_parent) {
        Reader r = {ev->field[F_PARENT], ev->field[F_PARENT] + ev->len[F_PARENT]};
        uint64_t parent_hash;
        read_hash(&r, &parent_hash); /* checked by event_supported */
        const U64MapCell *cell = U64Map_find(b->known, parent_hash);
        if (cell == NULL) {
            b->unknown_parent++;
            return 0;
        }
        prev = cell->val;
        const Slot *s = table_slot_if(b->table, b->slot);
        if (s == NULL || !slot_tiers(s, prev)) { /* the cap pruned it: skipped, counted */
            b->pruned_parent++;
            return 0;
        }
    }
    rc = read_hashes(ev->field[F_HASHES], ev->len[F_HASHES], &hashes, &n);
    if (rc == WIRE_OK)
        rc = read_tokens(ev->field[F_TOKENS], ev->len[F_TOKENS], n * b->block_size, &packed);
    if (rc == WIRE_OK && (keys = (uint64_t *)malloc(n * 8 + 8)) == NULL)
        rc = WIRE_NO_MEMORY;
    if (rc == WIRE_OK) {
        uint64_t parent = prev;
        chain_into(packed, n, b->block_size * 4, prev, keys);
        if (map_put_keys(b->known, hashes, keys, n) < 0)
            rc = WIRE_NO_MEMORY;
        if (rc == WIRE_OK &&
            table_store(b->table, b->slot, keys, n, 0, has_parent, parent, 0.0) < 0)
            rc = WIRE_NO_MEMORY;
        long pruned = rc == WIRE_OK ? table_prune_to(b->table, b->max_entries) : 0;
        if (pruned < 0)
            rc = WIRE_NO_MEMORY;
        else
            b->pruned += pruned;
        if (rc == WIRE_OK) {
            b->stored_events++;
            b->stored_blocks += (Py_ssize_t)n;
        }
    } else if (rc == WIRE_MALFORMED) {
        b->malformed++;
        rc = WIRE_OK;
    }
    free(hashes);
    free(packed);
    free(keys);
    return rc;
}

static int apply_removed(Batch *b, const WireEvent *ev)
{
    uint64_t *hashes;
    size_t n;
    int rc = read_hashes(ev->field[F_HASHES], ev->len[F_HASHES], &hashes, &n);
    if (rc != WIRE_OK)
        return rc; /* checked by event_supported: only memory can fail here */
    size_t gone = map_take_keys(b->known, hashes, n, hashes);
    if (gone && b->slot < b->table->nslots && b->table->slots[b->slot].used &&
        table_remove(b->table, &b->table->slots[b->slot], hashes, gone, 1) < 0)
        rc = WIRE_NO_MEMORY;
    b->removed_events++;
    b->removed_blocks += (Py_ssize_t)gone;
    free(hashes);
    return rc;
}

/* The first hash an event looks up: a removal's first block, a store's parent. */
static int first_lookup(const WireEvent *ev, uint64_t *hash)
{
    if (ev->kind == EV_REMOVED) {
        Reader r = {ev->field[F_HASHES], ev->field[F_HASHES] + ev->len[F_HASHES]};
        size_t n;
        return mp_array(&r, &n) == 0 && n > 0 && read_hash(&r, hash) == 0;
    }
    if (field_is_nil(ev, F_PARENT))
        return 0;
    Reader r = {ev->field[F_PARENT], ev->field[F_PARENT] + ev->len[F_PARENT]};
    return read_hash(&r, hash) == 0;
}

/* Software pipeline over a batch of small events (removals come one block per event): the
 * engine-hash cell of event i+4 is fetched, then the block cells of event i+2. */
static void prefetch_hash(const Batch *b, const WireEvent *ev)
{
    uint64_t hash;
    if (first_lookup(ev, &hash))
        U64Map_prefetch(b->known, hash);
}

static void prefetch_blocks(const Batch *b, const WireEvent *ev)
{
    uint64_t hash;
    if (ev->kind != EV_REMOVED || !first_lookup(ev, &hash) || b->slot >= b->table->nslots)
        return;
    const U64MapCell *cell = U64Map_find(b->known, hash);
    if (cell != NULL) {
        NodeMap_prefetch(&b->table->slots[b->slot].nodes, cell->val);
        LinkMap_prefetch(&b->table->links, cell->val);
    }
}

/* Table.ingest(slot, payload, keymap, rank, block_size, root_seed, max_entries, max_blocks)
 *   -> (ts, events, stored_events, stored_blocks, removed_events, removed_blocks, malformed,
 *       unknown_parent, pruned, pruned_parent), or None when the payload is not for this
 *   path. */
PyObject *ingest_payload(Table *table, PyObject *args)
{
    Py_buffer view;
    PyObject *keymap_obj, *seed_obj;
    Py_ssize_t slot, rank, block_size, max_entries, max_blocks;
    if (!PyArg_ParseTuple(args, "ny*O!nnOnn", &slot, &view, &KeyMapType, &keymap_obj, &rank,
                          &block_size, &seed_obj, &max_entries, &max_blocks))
        return NULL;
    Batch b = {0};
    b.table = table;
    b.known = &((KeyMapObject *)keymap_obj)->m;
    b.slot = (size_t)slot;
    b.block_size = (uint64_t)block_size;
    b.max_entries = max_entries;
    b.max_blocks = max_blocks < 0 ? 0 : (size_t)max_blocks;
    PyObject *out = NULL;
    WireEvent *events = NULL;
    size_t count = 0;
    double ts = 0;
    if (slot < 0) {
        PyErr_SetString(PyExc_ValueError, "slot must not be negative");
        goto done;
    }
    if (block_size_arg(block_size) < 0 || as_u64(seed_obj, &b.root_seed) < 0)
        goto done;
    if (parse_batch((const uint8_t *)view.buf, (size_t)view.len, rank, b.block_size,
                    b.max_blocks, &ts, &events, &count) < 0) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    for (size_t i = 0; i < count; i++) {
        if (i + 4 < count)
            prefetch_hash(&b, &events[i + 4]);
        if (i + 2 < count)
            prefetch_blocks(&b, &events[i + 2]);
        int rc = events[i].kind == EV_STORED ? apply_stored(&b, &events[i])
                                             : apply_removed(&b, &events[i]);
        if (rc == WIRE_NO_MEMORY) {
            PyErr_NoMemory();
            goto done;
        }
    }
    out = Py_BuildValue("(dnnnnnnnnn)", ts, (Py_ssize_t)count, b.stored_events,
                        b.stored_blocks, b.removed_events, b.removed_blocks, b.malformed,
                        b.unknown_parent, b.pruned, b.pruned_parent);
done:
    free(events);
    PyBuffer_Release(&view);
    return out;
}

