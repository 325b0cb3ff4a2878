// Admission control for a hybrid cache: which new chains are worth their bytes, learned from ghosts. The
// mechanism, its reasons and its Python face are in admission.pyx; the plain-Python original is the oracle
// (tests/oracle/admission.py), and the index's differential test (tests/test_index_core_differential.py),
// whose oracle index runs on it, holds this to its answers.
//
// State: `ghosts_`, block hashes in LRU order with the bytes they held (> 0 refused, < 0 evicted), at most
// `ghost_entries`; `tickets_`, the verdict of a writer's lookup per missing block hash with the time it
// lapses, and `expiry_`, those times in order (a ticket rewritten by a later lookup is dropped only by its
// own latest time). Times are seconds on the index's clock, passed in by the caller.
//
// Arithmetic is IEEE double in the oracle's order of operations, so `rate` is the oracle's bit for bit.
// Byte sums are int64 (the oracle's are unbounded): the same below 2^63 bytes.
//
// Errors: hashes are read as 32 bytes from the pointers given (the Python face and the index check
// lengths); nothing here aborts on any value.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <utility>
#include <vector>

#include "lru_keys.h"

namespace kvpool {

struct AdmissionParams {
  double continuation_fraction, initial_rate, min_rate, step;
  std::int64_t ghost_entries;
  double ticket_s;
};

class Admission {
 public:
  explicit Admission(const AdmissionParams& p)
      : rate(p.initial_rate), p_(p), ghosts_(0xC2B2AE3D27D4EB4Full), tickets_(0x165667B19E3779F9ull) {}

  // Add a block hash to the ghosts (`size` bytes refused, or evicted), oldest forgotten first.
  void remember(const std::uint8_t* h, std::int64_t size, bool refused) {
    std::int32_t e = ghosts_.find(h, 32);
    std::int64_t old = 0;
    if (e >= 0) {
      old = ghosts_.value(e);
      ghosts_.erase(e);
    }
    std::int64_t held = std::max(old < 0 ? -old : old, size);
    bool added = false;
    ghosts_.add(h, 32, refused ? held : -held, &added);
    if (static_cast<std::int64_t>(ghosts_.size()) > p_.ghost_entries) ghosts_.erase(ghosts_.oldest());
  }

  // An MLA block or checkpoint left the cache by pressure; `unread`: never read after its write.
  void evicted(const std::uint8_t* h, std::int64_t size, std::int64_t capacity, bool unread) {
    remember(h, size, false);
    if (unread) shrink(size, capacity);
  }

  // A writer's lookup of `n` hashes (`run` MLA blocks cached) at `now`: learn from its ghost run, then
  // ticket the blocks it will write.
  void on_lookup(const std::uint8_t* hashes, std::size_t n, std::size_t run, std::int64_t capacity, double now) {
    if (run >= n) return;
    std::size_t end = run;
    std::int64_t refused_bytes = 0, evicted_bytes = 0;
    for (; end < n; ++end) {
      std::int32_t e = ghosts_.find(hashes + 32 * end, 32);
      if (e < 0) break;
      std::int64_t v = ghosts_.value(e);
      if (v > 0) {
        refused_bytes = sat_add(refused_bytes, v);
      } else {
        evicted_bytes = sat_add(evicted_bytes, -v);
      }
    }
    if (refused_bytes && capacity > 0) {  // a chain admission turned away came back: it would have hit
      rate = std::min(1.0, rate + p_.step * static_cast<double>(refused_bytes) / static_cast<double>(capacity));
    }
    if (evicted_bytes) shrink(evicted_bytes, capacity);  // it came back too late for what was admitted since
    const double q = std::max(rate, floor);
    const bool verdict = static_cast<double>(end) >= p_.continuation_fraction * static_cast<double>(n) ||
                         unit(hashes + 32 * run) < q;
    expire(now);
    const double until = now + p_.ticket_s;
    for (std::size_t i = run; i < n; ++i) {
      const std::uint8_t* h = hashes + 32 * i;
      if (until_.size() <= tickets_.id_bound()) until_.resize(tickets_.id_bound() + 1);  // before the id exists
      bool added = false;
      std::int32_t e = tickets_.add(h, 32, verdict, &added);
      tickets_.set_value(e, verdict);
      until_[e] = until;
      std::array<std::uint8_t, 32> key;
      std::memcpy(key.data(), h, 32);
      expiry_.emplace_back(until, key);
    }
  }

  // Whether an MLA block or checkpoint of hash `h` (`size` bytes) may be written at `now`. An unticketed
  // object follows its chain: refused when `hangs_on` (the hash of its parent block, or of a checkpoint's
  // own block; nullptr for none) was refused and is not cached (`hangs_on_cached`).
  bool admit(const std::uint8_t* h, std::int64_t size, double now, const std::uint8_t* hangs_on, bool hangs_on_cached) {
    std::int32_t t = tickets_.find(h, 32);
    bool ok;
    if (t >= 0 && until_[t] >= now) {
      ok = tickets_.value(t) != 0;
    } else {
      ok = !(hangs_on != nullptr && !hangs_on_cached && was_refused(hangs_on));
    }
    if (ok) {
      ++admitted;
    } else {
      ++refused;
      remember(h, size, true);
    }
    return ok;
  }

  // Whether the latest ghost of `h` is a refusal.
  bool was_refused(const std::uint8_t* h) const {
    std::int32_t e = ghosts_.find(h, 32);
    return e >= 0 && ghosts_.value(e) > 0;
  }

  // The ticket of `h`: 1 admitted, 0 refused, -1 none; its lapse time in `until`.
  int ticket(const std::uint8_t* h, double* until) const {
    std::int32_t t = tickets_.find(h, 32);
    if (t < 0) return -1;
    *until = until_[t];
    return tickets_.value(t) != 0;
  }

  std::size_t ghost_count() const { return ghosts_.size(); }
  const LruKeys& ghosts() const { return ghosts_; }
  const LruKeys& tickets() const { return tickets_; }

  double rate;
  double floor = 0.0;  // the sampling rate in force is at least this (the default policy's, 1 - w)
  std::int64_t refused = 0;   // objects refused since start
  std::int64_t admitted = 0;  // ticketed objects admitted since start

 private:
  // a + b, held within int64 (no signed overflow whatever the caller passes)
  static std::int64_t sat_add(std::int64_t a, std::int64_t b) {
    if (b > 0 && a > std::numeric_limits<std::int64_t>::max() - b) return std::numeric_limits<std::int64_t>::max();
    if (b < 0 && a < std::numeric_limits<std::int64_t>::min() - b) return std::numeric_limits<std::int64_t>::min();
    return a + b;
  }

  // A block hash read as a number in [0, 1): SHA-256 output, so uniform and the same on every master.
  static double unit(const std::uint8_t* h) {
    std::uint64_t x = 0;
    for (int i = 0; i < 8; ++i) x = (x << 8) | h[i];
    return static_cast<double>(x) / 18446744073709551616.0;
  }

  void shrink(std::int64_t size, std::int64_t capacity) {
    if (capacity > 0) {
      double cut = std::min(1.0, p_.step * static_cast<double>(size) / static_cast<double>(capacity));
      rate = std::max(p_.min_rate, rate * (1.0 - cut));
    }
  }

  void expire(double now) {
    while (!expiry_.empty() && expiry_.front().first < now) {
      const auto& front = expiry_.front();
      std::int32_t t = tickets_.find(front.second.data(), 32);
      if (t >= 0 && until_[t] == front.first) tickets_.erase(t);
      expiry_.pop_front();
    }
  }

  AdmissionParams p_;
  LruKeys ghosts_;   // value: bytes held, > 0 refused, < 0 evicted
  LruKeys tickets_;  // value: the verdict (1 admit, 0 refuse); its order is unused
  std::vector<double> until_;  // per ticket entry: when it lapses
  std::deque<std::pair<double, std::array<std::uint8_t, 32>>> expiry_;
};

}  // namespace kvpool
