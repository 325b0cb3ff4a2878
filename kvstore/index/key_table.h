// The prefix index's key table: every key the index knows, in one flat open-addressing table.
//
// Why: the Python index kept three dicts of bytes objects (committed, pending, absent anchors with their
// waiting dependents) and a list of key objects per slot: ~150 bytes and three Python objects per indexed
// object. Here a key is an *entry* (38 bytes, packed): its bytes inline (up to INLINE_BYTES; longer keys, which
// only request tails and blobs may use, in a side map) and the slot of the object indexed under it (-1:
// none); how many live objects wait for it as their anchor while it is absent is in a side map too (rare:
// only explicit removal, expiry, node loss or an out-of-order put leave waiters). An entry lives while it
// names an object or has waiters, so an object's anchor is an entry id (4 bytes), and dropping an object
// that anchors others leaves its entry behind as the waiters' "orphan" record, found again when the key
// is put back.
//
// Layout: `buckets_` (power of two, load <= 3/4) holds one 32-bit word per bucket: the entry id + 1 in
// its low ENTRY_BITS (0: empty) and a 4-bit fingerprint of the key's hash above it. A key's home bucket
// is the high 32 bits of its hash modulo the table size. Entries live in chunks of CHUNK (allocated as
// the table grows, never moved: no 2x growth slack, no copy) and are reused through a free list. Lookup
// compares the fingerprint first (15 of 16 other keys skipped without reading their entry), then the key.
// Deletion shifts the following run back (no tombstones: probe lengths never degrade); growing re-places
// every entry from its key, walking the chunks in order.
//
// Why 4-byte buckets: at 10 M keys the table has 2^24 buckets, 13.4 bytes per key at 8 bytes a bucket
// (the hash's 32 bits kept to find a bucket's home without its entry); 6.7 at 4. The price is that a
// delete and a growth hash the keys they move again (33 bytes: five multiply rounds), and that a table
// holds at most MAX_ENTRIES keys (268 M: a master shard at ~100 bytes a key holds 27 GB before that).
//
// Errors: no function aborts or reads out of bounds on any input. An entry id from the caller is checked
// (`valid`); a key longer than MAX_KEY_BYTES or a table past MAX_ENTRIES keys throws std::length_error,
// an allocation failure std::bad_alloc (Cython turns both into Python exceptions, `except +`).
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace kvpool {

// A seed no one outside the process knows (std::random_device), mixed into a caller's constant: keys come
// from clients, and with a known seed a client could aim many keys at one bucket. Falls back to the
// constant where the platform has no random device.
inline std::uint64_t unpredictable_seed(std::uint64_t constant) {
  try {
    std::random_device rd;
    return constant ^ (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
  } catch (...) {
    return constant;
  }
}

class KeyTable {
 public:
  static constexpr std::size_t INLINE_BYTES = 33;  // a block key: 1-byte tag + 32-byte hash
  static constexpr std::size_t MAX_KEY_BYTES = 1024;
  static constexpr unsigned ENTRY_BITS = 28;
  static constexpr std::uint32_t ENTRY_MASK = (std::uint32_t{1} << ENTRY_BITS) - 1;
  static constexpr std::size_t MAX_ENTRIES = ENTRY_MASK;  // ids 0 .. ENTRY_MASK - 1, stored as id + 1

  explicit KeyTable(std::uint64_t seed) : seed_(seed | 1) { buckets_.assign(16, EMPTY); }

  std::size_t size() const { return live_; }

  bool valid(std::int32_t e) const {
    return e >= 0 && static_cast<std::size_t>(e) < n_entries_ && at(e).len != FREE;
  }

  // The entry of `key`, or -1.
  std::int32_t find(const std::uint8_t* key, std::size_t len) const {
    if (len == 0 || len > MAX_KEY_BYTES) return -1;
    return probe(hash(key, len), key, len);
  }

  // The entries of `n` keys of `len` bytes each, laid end to end in `keys`, into `out` (-1: absent). Why:
  // a prefix match probes a whole chain, and one probe is two dependent cache misses (bucket, entry);
  // hashing every key first and prefetching their buckets, then their entries, overlaps the misses of
  // all the chain's probes instead of paying them one after another.
  void find_many(const std::uint8_t* keys, std::size_t n, std::size_t len, std::int32_t* out) const {
    if (len == 0 || len > MAX_KEY_BYTES) {
      for (std::size_t k = 0; k < n; ++k) out[k] = -1;
      return;
    }
    std::vector<std::uint64_t> hashes(n);
    for (std::size_t k = 0; k < n; ++k) {
      hashes[k] = hash(keys + k * len, len);
      __builtin_prefetch(&buckets_[home(hashes[k])]);
    }
    for (std::size_t k = 0; k < n; ++k) {
      const std::uint32_t b = buckets_[home(hashes[k])];
      if (b != EMPTY) __builtin_prefetch(&at(entry_of(b)));
    }
    for (std::size_t k = 0; k < n; ++k) out[k] = probe(hashes[k], keys + k * len, len);
  }

  // The entry of `key`, added (slot -1, no waiters) if absent.
  std::int32_t intern(const std::uint8_t* key, std::size_t len) {
    if (len == 0 || len > MAX_KEY_BYTES) throw std::length_error("key length out of range");
    const std::uint64_t h = hash(key, len);
    std::int32_t e = probe(h, key, len);
    if (e >= 0) return e;
    if ((live_ + 1) * 4 > buckets_.size() * 3) rehash(buckets_.size() * 2);
    e = new_entry(key, len);
    place(h, e);
    ++live_;
    return e;
  }

  // Forget an entry (its key leaves the table; the id is reused). A no-op for an invalid id.
  void erase(std::int32_t e) {
    if (!valid(e)) return;
    const std::size_t mask = buckets_.size() - 1;
    std::size_t i = home(entry_hash(e));
    while (buckets_[i] == EMPTY || entry_of(buckets_[i]) != e) {
      if (buckets_[i] == EMPTY) return;  // not reachable: every valid entry has its bucket
      i = (i + 1) & mask;
    }
    // the run's entries are read for their homes below: fetch the first few together, not one by one
    for (std::size_t j = (i + 1) & mask, k = 0; k < 16 && buckets_[j] != EMPTY; j = (j + 1) & mask, ++k) {
      __builtin_prefetch(&at(entry_of(buckets_[j])));
    }
    // backward-shift deletion: move each following bucket of the run into the hole if its home allows
    for (std::size_t j = (i + 1) & mask;; j = (j + 1) & mask) {
      const std::uint32_t b = buckets_[j];
      if (b == EMPTY) break;
      const std::size_t h = home(entry_hash(entry_of(b)));
      // b may move to i iff i lies cyclically in [h, j)
      if (((j - h) & mask) >= ((j - i) & mask)) {
        buckets_[i] = b;
        i = j;
      }
    }
    buckets_[i] = EMPTY;
    Entry& en = at(e);
    if (en.len == LONG) long_keys_.erase(e);
    waiting_.erase(e);
    en.len = FREE;
    en.slot = -1;
    free_.push_back(e);
    --live_;
  }

  std::int32_t slot(std::int32_t e) const { return valid(e) ? at(e).slot : -1; }
  void set_slot(std::int32_t e, std::int32_t s) {
    if (valid(e)) at(e).slot = s;
  }
  std::uint32_t waiting(std::int32_t e) const {
    if (waiting_.empty()) return 0;
    auto it = waiting_.find(e);
    return it == waiting_.end() ? 0 : it->second;
  }
  void set_waiting(std::int32_t e, std::uint32_t n) {
    if (!valid(e)) return;
    if (n)
      waiting_[e] = n;
    else
      waiting_.erase(e);
  }

  std::size_t key_len(std::int32_t e) const {
    if (!valid(e)) return 0;
    const Entry& en = at(e);
    return en.len == LONG ? long_keys_.at(e).size() : en.len;
  }
  const std::uint8_t* key_data(std::int32_t e) const {
    if (!valid(e)) return nullptr;
    const Entry& en = at(e);
    if (en.len == LONG) return reinterpret_cast<const std::uint8_t*>(long_keys_.at(e).data());
    return en.bytes;
  }

  // Keys that can still be added (free ids and ids never handed out): an insert checks it before it sets
  // any of the new object's state, so a full table refuses the object instead of leaving it half indexed
  // (what ran before the check, the learners' hearing of the put and evictions, stands, as for any insert
  // refused for room).
  std::size_t room() const { return free_.size() + (MAX_ENTRIES - n_entries_); }
  static std::size_t max_entries() { return MAX_ENTRIES; }

  // Entry ids ever handed out (valid or free): the bound of a scan over `valid` ids.
  std::size_t id_bound() const { return n_entries_; }

  // Bytes held (the index's footprint report).
  std::size_t memory_bytes() const {
    std::size_t n = buckets_.capacity() * sizeof(std::uint32_t) + chunks_.size() * CHUNK * sizeof(Entry) +
                    chunks_.capacity() * sizeof(void*) + free_.capacity() * sizeof(std::int32_t) +
                    waiting_.size() * 32;
    for (const auto& kv : long_keys_) n += kv.second.capacity() + 64;
    return n;
  }

  // Drop everything and give the memory back (the index emptied).
  void clear() {
    std::vector<std::uint32_t>(16, EMPTY).swap(buckets_);
    std::vector<std::unique_ptr<Entry[]>>().swap(chunks_);
    n_entries_ = 0;
    std::vector<std::int32_t>().swap(free_);
    long_keys_.clear();
    waiting_.clear();
    live_ = 0;
  }

 private:
  static constexpr std::uint8_t FREE = 0xFF;
  static constexpr std::uint8_t LONG = 0xFE;

  static constexpr std::uint32_t EMPTY = 0;  // a bucket: (entry id + 1) | fingerprint << ENTRY_BITS

  // packed: 38 bytes, not 40 (the slot read unaligned, which x86-64 and AArch64 do in one load). Entries are
  // reached through `Entry&` (the packed struct's alignment is 1, so that is sound); their fields are only
  // read and written by value, never bound to a reference of their own.
#pragma pack(push, 1)
  struct Entry {
    std::int32_t slot;
    std::uint8_t len;  // INLINE bytes used, LONG (key in long_keys_) or FREE
    std::uint8_t bytes[INLINE_BYTES];
  };
#pragma pack(pop)
  static constexpr std::size_t CHUNK_BITS = 12;
  static constexpr std::size_t CHUNK = std::size_t{1} << CHUNK_BITS;

  Entry& at(std::int32_t e) { return chunks_[static_cast<std::size_t>(e) >> CHUNK_BITS][e & (CHUNK - 1)]; }
  const Entry& at(std::int32_t e) const {
    return chunks_[static_cast<std::size_t>(e) >> CHUNK_BITS][e & (CHUNK - 1)];
  }

  // 64 x 64 -> 128-bit multiply, halves folded: one multiply mixes every input bit into both halves
  static std::uint64_t fold(std::uint64_t a, std::uint64_t b) {
#if defined(__SIZEOF_INT128__)
    const unsigned __int128 r = static_cast<unsigned __int128>(a) * b;
    return static_cast<std::uint64_t>(r) ^ static_cast<std::uint64_t>(r >> 64);
#else  // the same product from 32-bit halves (compilers without a 128-bit integer)
    const std::uint64_t a0 = a & 0xFFFFFFFFu, a1 = a >> 32, b0 = b & 0xFFFFFFFFu, b1 = b >> 32;
    const std::uint64_t p00 = a0 * b0, p01 = a0 * b1, p10 = a1 * b0, p11 = a1 * b1;
    const std::uint64_t mid = (p00 >> 32) + (p01 & 0xFFFFFFFFu) + (p10 & 0xFFFFFFFFu);
    const std::uint64_t lo = (p00 & 0xFFFFFFFFu) | (mid << 32);
    const std::uint64_t hi = p11 + (p01 >> 32) + (p10 >> 32) + (mid >> 32);
    return lo ^ hi;
#endif
  }

  // Seeded (the index seeds its table from os.urandom, the learners' tables with `unpredictable_seed`: no
  // one outside can aim keys at one bucket), one folded multiply
  // per 8 bytes. Why not a multiply-xorshift finaliser per word, as before: a delete and a growth hash
  // again the keys they move, and at two multiplies and three shifts per word a 33-byte key cost ~60
  // cycles; here ~20.
  std::uint64_t hash(const std::uint8_t* key, std::size_t len) const {
    std::uint64_t h = seed_ ^ (len * 0x9e3779b97f4a7c15ULL);
    std::size_t i = 0;
    for (; i + 8 <= len; i += 8) {
      std::uint64_t w;
      std::memcpy(&w, key + i, 8);
      h = fold(h ^ w, 0xa0761d6478bd642fULL);
    }
    std::uint64_t last = 0;
    std::memcpy(&last, key + i, len - i);
    return fold(h ^ last ^ (static_cast<std::uint64_t>(len - i) << 56), 0xe7037ed1a0b428dbULL);
  }

  // a key's home bucket: the hash's high 32 bits modulo the table size (a power of two)
  std::size_t home(std::uint64_t h) const { return static_cast<std::size_t>(h >> 32) & (buckets_.size() - 1); }
  // 4 bits of the hash's low half, independent of the home bits
  static std::uint32_t fingerprint(std::uint64_t h) { return static_cast<std::uint32_t>(h & 0xF) << ENTRY_BITS; }
  static std::int32_t entry_of(std::uint32_t b) { return static_cast<std::int32_t>((b & ENTRY_MASK) - 1); }
  std::uint64_t entry_hash(std::int32_t e) const { return hash(key_data(e), key_len(e)); }

  // The entry of the key with hash `h`, or -1.
  std::int32_t probe(std::uint64_t h, const std::uint8_t* key, std::size_t len) const {
    const std::size_t mask = buckets_.size() - 1;
    const std::uint32_t fp = fingerprint(h);
    for (std::size_t i = home(h);; i = (i + 1) & mask) {
      const std::uint32_t b = buckets_[i];
      if (b == EMPTY) return -1;
      if ((b & ~ENTRY_MASK) == fp && same(entry_of(b), key, len)) return entry_of(b);
    }
  }

  bool same(std::int32_t e, const std::uint8_t* key, std::size_t len) const {
    return key_len(e) == len && std::memcmp(key_data(e), key, len) == 0;
  }

  std::int32_t new_entry(const std::uint8_t* key, std::size_t len) {
    std::string long_key;  // built before an id is taken: a failed allocation leaves the table as it was
    if (len > INLINE_BYTES) long_key.assign(reinterpret_cast<const char*>(key), len);
    if (free_.empty()) {
      if (n_entries_ >= MAX_ENTRIES) throw std::length_error("key table full");
      if (n_entries_ == chunks_.size() * CHUNK) chunks_.emplace_back(new Entry[CHUNK]);
      free_.push_back(static_cast<std::int32_t>(n_entries_++));
      at(free_.back()).len = FREE;
    }
    const std::int32_t e = free_.back();
    Entry& en = at(e);
    en.slot = -1;
    if (len <= INLINE_BYTES) {
      en.len = static_cast<std::uint8_t>(len);
      std::memcpy(en.bytes, key, len);
    } else {
      long_keys_[e] = std::move(long_key);  // may throw: the id stays free
      en.len = LONG;
    }
    free_.pop_back();
    return e;
  }

  void place(std::uint64_t h, std::int32_t e) {
    const std::size_t mask = buckets_.size() - 1;
    std::size_t i = home(h);
    while (buckets_[i] != EMPTY) i = (i + 1) & mask;
    buckets_[i] = (static_cast<std::uint32_t>(e) + 1) | fingerprint(h);
  }

  // Grow to `n` buckets: every live entry placed again from its key (chunks walked in order).
  void rehash(std::size_t n) {
    std::vector<std::uint32_t>(n, EMPTY).swap(buckets_);
    for (std::size_t e = 0; e < n_entries_; ++e) {
      const auto id = static_cast<std::int32_t>(e);
      if (at(id).len != FREE) place(entry_hash(id), id);
    }
  }

  std::uint64_t seed_;
  std::vector<std::uint32_t> buckets_;
  std::vector<std::unique_ptr<Entry[]>> chunks_;
  std::size_t n_entries_ = 0;
  std::unordered_map<std::int32_t, std::uint32_t> waiting_;  // entry -> live dependents waiting for it
  std::vector<std::int32_t> free_;
  std::unordered_map<std::int32_t, std::string> long_keys_;
  std::size_t live_ = 0;
};

}  // namespace kvpool
