# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Mattson's LRU stack over a whole trace in one compiled pass: the tallies of every capacity at once.

Why compiled: the pass costs a Fenwick-tree query and two updates per block reference, tens of Python
operations each; a 1 M-request trace is 24 M references (minutes in Python, seconds here). The plain-Python
pass it must equal step for step is ``tests/oracle/lru_stack.py``; ``workloads/lru_curve.py`` prepares the
arrays and reads the tallies (docs/design/workloads.md §3b has the rule and a worked example).

The model (exact for the store's evict-to-fit pure-MLA LRU, whose puts refresh present blocks): a request's
blocks are looked up in chain order, then every block of its chain is re-referenced at once, deepest at the
oldest position. A block's distance is the capacity units of every tracked key referenced no earlier than
its last reference (itself included); it is cached at capacity C iff its distance <= C, and usable only if
every block before it is (the running maximum). Keys whose distance passes the largest capacity are
dropped from the stack (a miss at every capacity from then on, as a key never seen is): the positions are
then renumbered, so the tree stays about twice the largest cache and in the CPU's caches.

Bad input (lengths that disagree, a key id out of range, capacities out of order or past 2^62, sizes whose
sums could pass 2^63) is ``ValueError`` before any work; a request the model does not fit is
:class:`NotAStack`, naming it.
"""

from libc.stdint cimport int32_t, int64_t
from libc.stdlib cimport calloc, free

import numpy as np

cdef int64_t NEVER = 1LL << 62  # the distance of a key not on the stack: a miss at every capacity

TALLIES = ("hit_blocks", "run_blocks", "hit_tokens", "cached_tokens", "written_bytes", "written_objects")


class NotAStack(ValueError):
    """Request ``request`` (its index) breaks the stack model: its chain names one key twice, or it puts a
    key some capacity holds at another size or under another parent (the store keeps what it has; the
    capacities that lack the key would take the new one). ``why`` says which."""

    def __init__(self, request, why):
        super().__init__(f"request {request} {why}")
        self.request = request
        self.why = why


cdef class _Stack:
    """The recency order: a Fenwick tree of units by position (1 = oldest), the key and its tokens at each
    position, each key's position (0: not on the stack) and the units on it. C arrays of the sizes held
    here; every index into them is checked by ``stack_pass`` before the pass or follows from ``size``."""

    cdef int64_t* tree
    cdef int32_t* key_at
    cdef int32_t* tokens_at
    cdef int64_t* pos  # per key id 0..keys
    cdef int32_t* parent  # per key id: the key before it in the chain that last put it, + 1 (0: a root)
    cdef int64_t size  # positions 1..size
    cdef int64_t base  # the next position to hand out
    cdef int64_t total
    cdef int64_t bytes_per_token
    cdef bint unit_bytes

    def __cinit__(self, int64_t keys, int64_t size, int64_t bytes_per_token, bint unit_bytes):
        self.pos = <int64_t*>calloc(keys + 1, sizeof(int64_t))
        self.parent = <int32_t*>calloc(keys + 1, sizeof(int32_t))
        if self.pos == NULL or self.parent == NULL:
            raise MemoryError()
        self.bytes_per_token = bytes_per_token
        self.unit_bytes = unit_bytes
        self.base = 1
        self.total = 0
        self._allocate(size)

    def __dealloc__(self):
        free(self.pos)
        free(self.parent)
        free(self.tree)
        free(self.key_at)
        free(self.tokens_at)

    cdef int _allocate(self, int64_t size) except -1:
        """Fresh, zeroed position arrays for positions 1..``size`` (the old ones are the caller's to free)."""
        self.tree = <int64_t*>calloc(size + 1, sizeof(int64_t))
        self.key_at = <int32_t*>calloc(size + 1, sizeof(int32_t))
        self.tokens_at = <int32_t*>calloc(size + 1, sizeof(int32_t))
        if self.tree == NULL or self.key_at == NULL or self.tokens_at == NULL:
            raise MemoryError()
        self.size = size
        return 0

    cdef inline int64_t unit(self, int64_t tokens) noexcept nogil:
        return tokens * self.bytes_per_token if self.unit_bytes else 1

    cdef inline int64_t before(self, int64_t p) noexcept nogil:
        """Units at positions 1..p."""
        cdef int64_t s = 0
        while p > 0:
            s += self.tree[p]
            p &= p - 1
        return s

    cdef inline void add(self, int64_t p, int64_t w) noexcept nogil:
        while p <= self.size:
            self.tree[p] += w
            p += p & -p

    cdef int compact(self, int64_t limit, int64_t room) except -1:
        """Drop the keys past ``limit`` units from the newest, renumber the rest 1..L (order kept) and
        leave room for ``room`` more positions."""
        cdef int64_t p, k, acc = 0, live = 0, q, i, w, old_base = self.base
        cdef bint keep = True
        for p in range(old_base - 1, 0, -1):
            k = self.key_at[p]
            if k == 0:
                continue
            w = self.unit(self.tokens_at[p])
            keep = keep and acc + w <= limit  # once one is past the limit, every older one is too
            if keep:
                acc += w
                live += 1
            else:
                self.pos[k] = 0
                self.key_at[p] = 0
                self.total -= w
        cdef int64_t* old_tree = self.tree
        cdef int32_t* keys = self.key_at
        cdef int32_t* toks = self.tokens_at
        try:
            self._allocate(2 * live + 2 * room + 16)
        except MemoryError:
            free(self.tree)
            free(self.key_at)
            free(self.tokens_at)
            self.tree, self.key_at, self.tokens_at = old_tree, keys, toks
            raise
        free(old_tree)
        q = 0
        for p in range(1, old_base):
            k = keys[p]
            if k == 0:
                continue
            q += 1
            self.key_at[q] = <int32_t>k
            self.tokens_at[q] = toks[p]
            self.pos[k] = q
            self.tree[q] += self.unit(toks[p])
            i = q + (q & -q)  # linear-time build: push each node's sum to its parent
            if i <= self.size:
                self.tree[i] += self.tree[q]
        free(keys)
        free(toks)
        # positions q+1.. are empty, but the build above pushed sums only from filled nodes: finish it
        for p in range(q + 1, self.size + 1):
            i = p + (p & -p)
            if i <= self.size:
                self.tree[i] += self.tree[p]
        self.base = q + 1
        return 0


def stack_pass(
    const int64_t[::1] offsets,
    const int32_t[::1] keys,
    const int32_t[::1] tokens,
    const int32_t[::1] caps,
    const int32_t[::1] prompts,
    int64_t n_keys,
    const int64_t[::1] ceffs,
    int64_t bytes_per_token,
    bint unit_bytes,
    int64_t initial_positions=65536,
):
    """Tallies per capacity of one LRU pass over the requests ``r`` whose blocks are
    ``keys[offsets[r]:offsets[r + 1]]`` (key ids 1..``n_keys``, chain order, ``tokens`` each): the lookup
    reads blocks [0, ``caps[r]``), the first ``prompts[r]`` belong to the prompt. ``ceffs``: the capacities
    (units kept: blocks, or bytes when ``unit_bytes``), ascending. Returns ``{name: int64[len(ceffs)]}`` for
    :data:`TALLIES` plus ``held_bytes`` and ``held_objects`` (what each capacity holds at the end).
    ``initial_positions``: the tree's first size past twice the longest request (tests make it small, so
    that keys are dropped and renumbered often)."""
    cdef Py_ssize_t n_req = caps.shape[0], n_caps = ceffs.shape[0], r, j, c
    cdef int64_t n_refs = keys.shape[0]
    if offsets.shape[0] != n_req + 1 or prompts.shape[0] != n_req or tokens.shape[0] != n_refs:
        raise ValueError("offsets, caps, prompts and tokens do not describe the same requests and blocks")
    if n_req and (offsets[0] != 0 or offsets[n_req] != n_refs):
        raise ValueError(f"offsets must run from 0 to {n_refs}")
    if initial_positions < 0:
        raise ValueError("initial_positions must be >= 0")
    if bytes_per_token <= 0:
        raise ValueError("bytes_per_token must be positive")
    if not 0 <= n_keys < 2**31:
        raise ValueError(f"{n_keys} key ids: the stack takes up to 2^31 - 1")
    cdef int64_t longest = 0, n, k
    for r in range(n_req):
        n = offsets[r + 1] - offsets[r]
        if n < 0:
            raise ValueError(f"offsets go back at request {r}")
        if not 0 <= caps[r] <= prompts[r] <= n:
            raise ValueError(f"request {r}: need 0 <= cap <= prompt blocks <= blocks")
        longest = max(longest, n)
    cdef int64_t most_tokens = 0
    for j in range(n_refs):
        if not 1 <= keys[j] <= n_keys:
            raise ValueError(f"key id {keys[j]} out of 1..{n_keys}")
        if tokens[j] < 0:
            raise ValueError("a block's tokens are negative")
        most_tokens = max(most_tokens, tokens[j])
    if int(most_tokens) * int(bytes_per_token) * max(int(n_refs), 1) >= int(NEVER):  # Python ints: no overflow
        raise ValueError("the trace's bytes could pass 2^62: the tallies would overflow")
    for c in range(n_caps):
        if ceffs[c] < 0 or ceffs[c] >= NEVER or (c and ceffs[c] < ceffs[c - 1]):
            raise ValueError("capacities must be non-negative, below 2^62 and ascending")
    out = {name: np.zeros(n_caps, np.int64) for name in (*TALLIES, "held_bytes", "held_objects")}
    cdef int64_t[::1] hit_blocks = out["hit_blocks"], run_blocks = out["run_blocks"]
    cdef int64_t[::1] hit_tokens = out["hit_tokens"], cached_tokens = out["cached_tokens"]
    cdef int64_t[::1] written_bytes = out["written_bytes"], written_objects = out["written_objects"]
    if n_req == 0 or n_caps == 0:
        return out
    cdef int64_t limit = ceffs[n_caps - 1]
    cdef _Stack st = _Stack(n_keys, 2 * longest + initial_positions + 1, bytes_per_token, unit_bytes)
    run_max_a = np.zeros(longest + 1, np.int64)
    dist_a = np.zeros(longest + 1, np.int64)
    cum_a = np.zeros(longest + 1, np.int64)
    cdef int64_t[::1] run_max = run_max_a, dist = dist_a, cum = cum_a
    cdef int64_t a, p, d, m, held, run, extra, full, w, wold, base, cap, prompt, up
    for r in range(n_req):
        a = offsets[r]
        n = offsets[r + 1] - a
        if st.base + n > st.size + 1:
            st.compact(limit, n)
        # distances along the chain (before any of it moves), their running maximum, tokens so far
        m = 0
        cum[0] = 0
        for j in range(n):
            k = keys[a + j]
            p = st.pos[k]
            d = st.total - st.before(p - 1) if p else NEVER
            dist[j] = d
            if d > m:
                m = d
            run_max[j] = m
            cum[j + 1] = cum[j] + tokens[a + j]
        cap, prompt = caps[r], prompts[r]
        held = 0
        for c in range(n_caps):  # ascending capacities: ``held`` only grows
            while held < n and run_max[held] <= ceffs[c]:
                held += 1
            run = held if held < cap else cap
            extra = held - run  # > 0 only when the whole lookup hit
            full = run + (extra if extra < prompt - cap else prompt - cap)
            hit_blocks[c] += full
            run_blocks[c] += run
            hit_tokens[c] += cum[full]
            cached_tokens[c] += cum[run]
            written_bytes[c] += (cum[n] - cum[held]) * bytes_per_token
            written_objects[c] += n - held
        # every block re-referenced, the deepest at the oldest of the request's positions
        base = st.base
        for j in range(n):
            k = keys[a + j]
            w = st.unit(tokens[a + j])
            p = st.pos[k]
            if p >= base:
                raise NotAStack(r, "names one block twice in its chain")
            up = keys[a + j - 1] + 1 if j else 0
            if p and dist[j] <= limit:  # some capacity holds it: the store keeps its size and its parent
                if st.tokens_at[p] != tokens[a + j]:
                    raise NotAStack(r, f"puts a block held at {st.tokens_at[p]} tokens with {tokens[a + j]}")
                if st.parent[k] != up:
                    raise NotAStack(r, "puts a held block under another parent (its trace ids are not chained)")
            st.parent[k] = <int32_t>up
            if p:
                wold = st.unit(st.tokens_at[p])
                st.add(p, -wold)
                st.key_at[p] = 0
                st.total += w - wold
            else:
                st.total += w
            p = base + n - 1 - j
            st.pos[k] = p
            st.key_at[p] = <int32_t>k
            st.tokens_at[p] = tokens[a + j]
            st.add(p, w)
        st.base = base + n
    # what each capacity holds at the end: the newest keys whose units fit
    cdef int64_t[::1] held_bytes = out["held_bytes"], held_objects = out["held_objects"]
    cdef int64_t acc = 0, count = 0, real = 0
    c = 0
    for p in range(st.base - 1, 0, -1):
        if st.key_at[p] == 0:
            continue
        acc += st.unit(st.tokens_at[p])
        while c < n_caps and acc > ceffs[c]:
            held_bytes[c], held_objects[c] = real, count
            c += 1
        count += 1
        real += st.tokens_at[p] * bytes_per_token
    while c < n_caps:
        held_bytes[c], held_objects[c] = real, count
        c += 1
    return out
