// Keys in least-recently-used order, one int64 value each: the bounded memories the index's learners keep
// beside it (the default policy's shadow LRU of keys and sizes).
//
// Why: those memories see every put and every writer's lookup, block by block. As Python OrderedDicts they
// cost a call chain and a dict operation per block, a fifth of a simulated point on the default policy;
// here a key is an entry of a KeyTable (the index's own open-addressing table, 38 bytes inline) and the
// order is a doubly linked list threaded through two int32 vectors indexed by entry id.
//
// Layout: `table_` maps a key to its entry id (ids are reused through the table's free list, so every
// vector below is sized to the table's id bound); `prev_`/`next_` link the entries oldest (`head_`) to
// newest (`tail_`), -1 ending the list; `value_` holds each entry's int64.
//
// Errors: every function taking an entry id checks it (`table_.valid`) and does nothing, or answers the
// neutral value, for an invalid one; a key longer than KeyTable::MAX_KEY_BYTES throws std::length_error,
// an allocation failure std::bad_alloc.
#pragma once

#include <cstdint>
#include <vector>

#include "key_table.h"

namespace kvpool {

class LruKeys {
 public:
  explicit LruKeys(std::uint64_t seed) : table_(unpredictable_seed(seed)) {}

  std::size_t size() const { return table_.size(); }

  // The entry of `key`, or -1.
  std::int32_t find(const std::uint8_t* key, std::size_t len) const { return table_.find(key, len); }

  // Add `key` as the newest entry with `value`; an existing key is left where it is, value unchanged.
  // Returns its entry; `added` says which.
  std::int32_t add(const std::uint8_t* key, std::size_t len, std::int64_t value, bool* added) {
    std::int32_t e = table_.find(key, len);
    *added = e < 0;
    if (e >= 0) return e;
    // the new id is a freed one or the next one: room for it first, so a failed allocation leaves no id
    // the vectors do not cover
    reserve_id(table_.id_bound());
    e = table_.intern(key, len);
    value_[e] = value;
    link_newest(e);
    return e;
  }

  // Make `e` the newest entry.
  void touch(std::int32_t e) {
    if (!table_.valid(e) || e == tail_) return;
    unlink(e);
    link_newest(e);
  }

  std::int64_t value(std::int32_t e) const { return table_.valid(e) ? value_[e] : 0; }
  void set_value(std::int32_t e, std::int64_t v) {
    if (table_.valid(e)) value_[e] = v;
  }

  // The oldest entry (-1: empty).
  std::int32_t oldest() const { return head_; }

  // Forget `e`.
  void erase(std::int32_t e) {
    if (!table_.valid(e)) return;
    unlink(e);
    table_.erase(e);
  }

  void clear() {
    table_.clear();
    std::vector<std::int32_t>().swap(prev_);
    std::vector<std::int32_t>().swap(next_);
    std::vector<std::int64_t>().swap(value_);
    head_ = tail_ = -1;
  }

  // Entries oldest first into `out` (tests compare the order with the oracle's).
  void order(std::vector<std::int32_t>* out) const {
    out->clear();
    for (std::int32_t e = head_; e >= 0; e = next_[e]) out->push_back(e);
  }

  // Entry ids ever handed out: every id is below it.
  std::size_t id_bound() const { return table_.id_bound(); }

  std::size_t key_len(std::int32_t e) const { return table_.key_len(e); }
  const std::uint8_t* key_data(std::int32_t e) const { return table_.key_data(e); }

 private:
  void reserve_id(std::size_t id) {
    if (id < value_.size()) return;
    prev_.resize(id + 1, -1);
    next_.resize(id + 1, -1);
    value_.resize(id + 1, 0);
  }

  void link_newest(std::int32_t e) {
    prev_[e] = tail_;
    next_[e] = -1;
    if (tail_ >= 0) {
      next_[tail_] = e;
    } else {
      head_ = e;
    }
    tail_ = e;
  }

  void unlink(std::int32_t e) {
    std::int32_t p = prev_[e], n = next_[e];
    if (p >= 0) {
      next_[p] = n;
    } else {
      head_ = n;
    }
    if (n >= 0) {
      prev_[n] = p;
    } else {
      tail_ = p;
    }
    prev_[e] = next_[e] = -1;
  }

  KeyTable table_;
  std::vector<std::int32_t> prev_, next_;
  std::vector<std::int64_t> value_;
  std::int32_t head_ = -1, tail_ = -1;
};

}  // namespace kvpool
