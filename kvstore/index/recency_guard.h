// The default policy's safety net: a shadow LRU cache of keys only, and the weight `w` the policy gives its
// predictions against plain recency, learned from how the two caches do on the same lookups. The
// mechanism, its reasons and its Python face are in recency_guard.pyx; the plain-Python original is the
// oracle (tests/oracle/recency_guard.py), and tests/test_index_core_guard.py holds this to its answers.
//
// Arithmetic is IEEE double throughout, in the oracle's order of operations, so `w` and `lead` are the
// oracle's bit for bit. Byte counts are int64: the oracle's comparison of held bytes with fill x capacity
// is exact, this one converts the held bytes to double first, the same below 2^53 bytes (8 PiB).
//
// Errors: `lookup` reads only `n` hashes and `n_held` sizes, and refuses (returns false, nothing changed)
// an `ours` above `n` or `n_held` above `n`: the Python face turns that into ValueError.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "lru_keys.h"

namespace kvpool {

class RecencyGuard {
 public:
  static constexpr double RECENT = 0.002;  // weight of one lookup in the moving sums behind `lead`
  static constexpr std::uint8_t MLA = 'M';  // kvstore/keys.py MLA_TAG (recency_guard.pyx checks both)
  static constexpr std::uint8_t KDA = 'K';  // kvstore/keys.py KDA_TAG

  RecencyGuard(double initial, double step, double fill)
      : w(initial), step(step), fill(fill), lru_(0x9E3779B97F4A7C15ull) {}

  // A writer puts `key` (whether or not the real cache admits it): LRU would store it.
  void put(const std::uint8_t* key, std::size_t len, std::int64_t size, std::int64_t capacity) {
    capacity_ = capacity;
    bool added = false;
    std::int32_t e = lru_.add(key, len, size, &added);
    if (!added) {  // EXISTS: the store refreshes a present object a writer puts again, and so does LRU
      lru_.touch(e);
      return;
    }
    bytes_ = sat_add(bytes_, size);
    if (capacity > 0 && static_cast<double>(bytes_) > fill * static_cast<double>(capacity)) trim();
  }

  // A writer's lookup of the `n` block hashes at `hashes` (32 bytes each, end to end) served `ours` blocks
  // from the real cache; `held`: sizes of the MLA blocks the real cache holds on the chain, `ck_size` of
  // the checkpoint it served (recency_guard.pyx says why the shadow takes them).
  bool lookup(const std::uint8_t* hashes, std::size_t n, std::int64_t ours, bool joint, const std::int64_t* held,
              std::size_t n_held, std::int64_t ck_size) {
    if (ours < 0 || static_cast<std::size_t>(ours) > n || n_held > n) return false;
    std::uint8_t key[33];
    std::size_t run = 0;
    while (run < n && find(MLA, hashes + 32 * run, key) >= 0) ++run;
    std::size_t usable = joint ? 0 : run;
    if (joint) {
      for (std::size_t i = run; i > 0; --i) {
        if (find(KDA, hashes + 32 * (i - 1), key) >= 0) {
          usable = i;
          break;
        }
      }
    }
    // the whole run, not only what it serves: a chain's inner blocks live as long as its newest leaf
    for (std::size_t i = 0; i < run; ++i) lru_.touch(find(MLA, hashes + 32 * i, key));
    if (usable && joint) lru_.touch(find(KDA, hashes + 32 * (usable - 1), key));
    this->ours += ours;
    shadow += static_cast<std::int64_t>(usable);
    mean_n_ += 0.01 * (static_cast<double>(n) - mean_n_);
    recent_[0] += RECENT * (static_cast<double>(ours) - recent_[0]);
    recent_[1] += RECENT * (static_cast<double>(usable) - recent_[1]);
    if (recent_[1] > 0) {
      lead = recent_[0] / recent_[1];
    } else if (recent_[0] > 0) {
      lead = std::numeric_limits<double>::infinity();
    }
    const std::int64_t diff = ours - static_cast<std::int64_t>(usable);
    if (diff != 0) {
      w = std::min(1.0, std::max(0.0, w + step * static_cast<double>(diff) / std::max(mean_n_, 1.0)));
    }
    const bool take_ck = ck_size && diff > 0;
    if (n_held > run || take_ck) {
      for (std::size_t j = run; j < n_held; ++j) add(MLA, hashes + 32 * j, held[j], key);
      if (take_ck) add(KDA, hashes + 32 * (ours - 1), ck_size, key);
      trim();
    }
    return true;
  }

  std::size_t size() const { return lru_.size(); }
  std::int64_t held_bytes() const { return bytes_; }
  std::int64_t capacity() const { return capacity_; }
  double mean_n() const { return mean_n_; }
  double recent(int i) const { return recent_[i & 1]; }
  const LruKeys& keys() const { return lru_; }

  double w, step, fill;
  double lead = std::numeric_limits<double>::infinity();  // ours / shadow over the recent lookups
  std::int64_t ours = 0;    // blocks served by the real cache over the lookups scored
  std::int64_t shadow = 0;  // blocks the shadow LRU would have served

 private:
  // a + b, held within int64 (no signed overflow whatever the caller passes)
  static std::int64_t sat_add(std::int64_t a, std::int64_t b) {
    if (b > 0 && a > std::numeric_limits<std::int64_t>::max() - b) return std::numeric_limits<std::int64_t>::max();
    if (b < 0 && a < std::numeric_limits<std::int64_t>::min() - b) return std::numeric_limits<std::int64_t>::min();
    return a + b;
  }

  std::int32_t find(std::uint8_t tag, const std::uint8_t* hash, std::uint8_t* key) const {
    key[0] = tag;
    std::memcpy(key + 1, hash, 32);
    return lru_.find(key, 33);
  }

  void add(std::uint8_t tag, const std::uint8_t* hash, std::int64_t size, std::uint8_t* key) {
    key[0] = tag;
    std::memcpy(key + 1, hash, 32);
    bool added = false;
    lru_.add(key, 33, size, &added);
    if (added) bytes_ = sat_add(bytes_, size);
  }

  void trim() {
    const double limit =
        capacity_ > 0 ? fill * static_cast<double>(capacity_) : std::numeric_limits<double>::infinity();
    while (static_cast<double>(bytes_) > limit && lru_.size()) {
      std::int32_t e = lru_.oldest();
      bytes_ -= lru_.value(e);
      lru_.erase(e);
    }
  }

  LruKeys lru_;
  std::int64_t bytes_ = 0;
  std::int64_t capacity_ = 0;  // the real cache's, as of the last put
  double mean_n_ = 0.0;        // moving mean of the blocks a lookup covers
  double recent_[2] = {0.0, 0.0};
};

}  // namespace kvpool
