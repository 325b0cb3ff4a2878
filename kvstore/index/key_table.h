// The prefix index's key table: every key the index knows, in one flat open-addressing table.
//
// Why: the Python index kept three dicts of bytes objects (committed, pending, absent anchors with their
// waiting dependents) and a list of key objects per slot: ~150 bytes and three Python objects per indexed
// object. Here a key is an *entry* (40 bytes): its bytes inline (up to INLINE_BYTES; longer keys, which
// only request tails and blobs may use, in a side map) and the slot of the object indexed under it (-1:
// none); how many live objects wait for it as their anchor while it is absent is in a side map too (rare:
// only explicit removal, expiry, node loss or an out-of-order put leave waiters). An entry lives while it
// names an object or has waiters, so an object's anchor is an entry id (4 bytes), and dropping an object
// that anchors others leaves its entry behind as the waiters' "orphan" record, found again when the key
// is put back.
//
// Layout: `buckets_` (power of two, load <= 3/4) holds {the high 32 bits of the key's hash, entry id}; a
// key's home bucket is those bits modulo the table size, so growing and deleting never rehash a key.
// Entries live in chunks of CHUNK (allocated as the table grows, never moved: no 2x growth slack, no
// copy) and are reused through a free list. Lookup compares the stored hash bits first,
// then the key. Deletion shifts the following run back (no tombstones: probe lengths never degrade).
//
// Errors: no function aborts or reads out of bounds on any input. An entry id from the caller is checked
// (`valid`); a key longer than MAX_KEY_BYTES or a table past INT32 entries throws std::length_error, an
// allocation failure std::bad_alloc (Cython turns both into Python exceptions, `except +`).
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace kvpool {

class KeyTable {
 public:
  static constexpr std::size_t INLINE_BYTES = 33;  // a block key: 1-byte tag + 32-byte hash
  static constexpr std::size_t MAX_KEY_BYTES = 1024;

  explicit KeyTable(std::uint64_t seed) : seed_(seed | 1) { buckets_.assign(16, Bucket{0, -1}); }

  std::size_t size() const { return live_; }

  bool valid(std::int32_t e) const {
    return e >= 0 && static_cast<std::size_t>(e) < n_entries_ && at(e).len != FREE;
  }

  // The entry of `key`, or -1.
  std::int32_t find(const std::uint8_t* key, std::size_t len) const {
    if (len == 0 || len > MAX_KEY_BYTES) return -1;
    const std::uint32_t tag = tag_of(key, len);
    std::size_t mask = buckets_.size() - 1;
    for (std::size_t i = tag & mask;; i = (i + 1) & mask) {
      const Bucket& b = buckets_[i];
      if (b.entry < 0) return -1;
      if (b.tag == tag && same(b.entry, key, len)) return b.entry;
    }
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
    const std::size_t mask = buckets_.size() - 1;
    std::vector<std::uint32_t> tags(n);
    for (std::size_t k = 0; k < n; ++k) {
      tags[k] = tag_of(keys + k * len, len);
      __builtin_prefetch(&buckets_[tags[k] & mask]);
    }
    for (std::size_t k = 0; k < n; ++k) {
      const Bucket& b = buckets_[tags[k] & mask];
      if (b.entry >= 0) __builtin_prefetch(&at(b.entry));
    }
    for (std::size_t k = 0; k < n; ++k) {
      const std::uint8_t* key = keys + k * len;
      out[k] = -1;
      for (std::size_t i = tags[k] & mask;; i = (i + 1) & mask) {
        const Bucket& b = buckets_[i];
        if (b.entry < 0) break;
        if (b.tag == tags[k] && same(b.entry, key, len)) {
          out[k] = b.entry;
          break;
        }
      }
    }
  }

  // The entry of `key`, added (slot -1, no waiters) if absent.
  std::int32_t intern(const std::uint8_t* key, std::size_t len) {
    if (len == 0 || len > MAX_KEY_BYTES) throw std::length_error("key length out of range");
    std::int32_t e = find(key, len);
    if (e >= 0) return e;
    if ((live_ + 1) * 4 > buckets_.size() * 3) rehash(buckets_.size() * 2);
    e = new_entry(key, len);
    place(Bucket{tag_of(key, len), e});
    ++live_;
    return e;
  }

  // Forget an entry (its key leaves the table; the id is reused). A no-op for an invalid id.
  void erase(std::int32_t e) {
    if (!valid(e)) return;
    std::size_t mask = buckets_.size() - 1;
    std::size_t i = tag_of(key_data(e), key_len(e)) & mask;
    while (buckets_[i].entry != e) {
      if (buckets_[i].entry < 0) return;  // not reachable: every valid entry has its bucket
      i = (i + 1) & mask;
    }
    // backward-shift deletion: move each following bucket of the run into the hole if its home allows
    for (std::size_t j = (i + 1) & mask;; j = (j + 1) & mask) {
      Bucket& b = buckets_[j];
      if (b.entry < 0) break;
      std::size_t home = b.tag & mask;
      // b may move to i iff i lies cyclically in [home, j)
      if (((j - home) & mask) >= ((j - i) & mask)) {
        buckets_[i] = b;
        i = j;
      }
    }
    buckets_[i] = Bucket{0, -1};
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

  // Entry ids ever handed out (valid or free): the bound of a scan over `valid` ids.
  std::size_t id_bound() const { return n_entries_; }

  // Bytes held (the index's footprint report).
  std::size_t memory_bytes() const {
    std::size_t n = buckets_.capacity() * sizeof(Bucket) + chunks_.size() * CHUNK * sizeof(Entry) +
                    chunks_.capacity() * sizeof(void*) + free_.capacity() * sizeof(std::int32_t) +
                    waiting_.size() * 32;
    for (const auto& kv : long_keys_) n += kv.second.capacity() + 64;
    return n;
  }

  // Drop everything and give the memory back (the index emptied).
  void clear() {
    std::vector<Bucket>(16, Bucket{0, -1}).swap(buckets_);
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

  struct Bucket {
    std::uint32_t tag;
    std::int32_t entry;  // -1: empty
  };
  struct Entry {
    std::uint8_t len;  // INLINE bytes used, LONG (key in long_keys_) or FREE
    std::uint8_t bytes[INLINE_BYTES];
    std::int32_t slot;
  };
  static constexpr std::size_t CHUNK_BITS = 12;
  static constexpr std::size_t CHUNK = std::size_t{1} << CHUNK_BITS;

  Entry& at(std::int32_t e) { return chunks_[static_cast<std::size_t>(e) >> CHUNK_BITS][e & (CHUNK - 1)]; }
  const Entry& at(std::int32_t e) const {
    return chunks_[static_cast<std::size_t>(e) >> CHUNK_BITS][e & (CHUNK - 1)];
  }

  static std::uint64_t mix(std::uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
  }

  std::uint32_t tag_of(const std::uint8_t* key, std::size_t len) const {
    return static_cast<std::uint32_t>(hash(key, len) >> 32);
  }

  std::uint64_t hash(const std::uint8_t* key, std::size_t len) const {
    std::uint64_t h = seed_ ^ (len * 0x9e3779b97f4a7c15ULL);
    std::size_t i = 0;
    for (; i + 8 <= len; i += 8) {
      std::uint64_t w;
      std::memcpy(&w, key + i, 8);
      h = mix(h ^ w) + 0x9e3779b97f4a7c15ULL;
    }
    std::uint64_t last = 0;
    std::memcpy(&last, key + i, len - i);
    return mix(h ^ last ^ (static_cast<std::uint64_t>(len - i) << 56));
  }

  bool same(std::int32_t e, const std::uint8_t* key, std::size_t len) const {
    return key_len(e) == len && std::memcmp(key_data(e), key, len) == 0;
  }

  std::int32_t new_entry(const std::uint8_t* key, std::size_t len) {
    std::string long_key;  // built before an id is taken: a failed allocation leaves the table as it was
    if (len > INLINE_BYTES) long_key.assign(reinterpret_cast<const char*>(key), len);
    if (free_.empty()) {
      if (n_entries_ >= static_cast<std::size_t>(INT32_MAX)) throw std::length_error("key table full");
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

  void place(Bucket b) {
    std::size_t mask = buckets_.size() - 1;
    std::size_t i = b.tag & mask;
    while (buckets_[i].entry >= 0) i = (i + 1) & mask;
    buckets_[i] = b;
  }

  void rehash(std::size_t n) {
    std::vector<Bucket> old(n, Bucket{0, -1});
    old.swap(buckets_);
    for (const Bucket& b : old) {
      if (b.entry >= 0) place(b);
    }
  }

  std::uint64_t seed_;
  std::vector<Bucket> buckets_;
  std::vector<std::unique_ptr<Entry[]>> chunks_;
  std::size_t n_entries_ = 0;
  std::unordered_map<std::int32_t, std::uint32_t> waiting_;  // entry -> live dependents waiting for it
  std::vector<std::int32_t> free_;
  std::unordered_map<std::int32_t, std::string> long_keys_;
  std::size_t live_ = 0;
};

}  // namespace kvpool
