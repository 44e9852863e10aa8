// Pieces shared by the asynchronous accelerator engines (CUDA, Ascend), so
// that the two read alike. Header-only: each engine is its own extension.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kvswap.h"

namespace kvswap {

// "descriptor 3: src 0x... -> dst 0x..., 4096 bytes, device_to_host", for
// error messages that must say which copy failed.
inline std::string format_descriptor(const CopyBatch& b, int64_t i) {
  std::ostringstream out;
  out << "descriptor " << i << ": src 0x" << std::hex << b.src[i] << " -> dst 0x" << b.dst[i] << std::dec
      << ", " << b.size[i] << " bytes, " << direction_name(static_cast<int64_t>(b.direction));
  return out.str();
}

// The batch APIs take arrays of pointers and size_t. The core's int64 rows
// have exactly that layout here, so they are passed in place.
static_assert(sizeof(void*) == sizeof(int64_t) && sizeof(size_t) == sizeof(int64_t),
              "descriptor rows are passed as pointer and size_t arrays");
struct DescriptorArrays {
  void** dsts;
  void** srcs;
  size_t* sizes;
};
inline DescriptorArrays descriptor_arrays(const CopyBatch& b) {
  return {reinterpret_cast<void**>(const_cast<int64_t*>(b.dst)),
          reinterpret_cast<void**>(const_cast<int64_t*>(b.src)),
          reinterpret_cast<size_t*>(const_cast<int64_t*>(b.size))};
}

// The bytes a non-empty tensor's elements span, [first, end): from its first
// element to the end of its last (torch's strides are never negative).
inline std::pair<uintptr_t, uintptr_t> byte_range(const at::Tensor& t) {
  const auto first = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  int64_t last = 0;  // the last element's offset, in elements
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return {first, first + static_cast<uintptr_t>((last + 1) * static_cast<int64_t>(t.element_size()))};
}

// How an engine's own registrations meet a range of host bytes.
enum class Coverage {
  kNone,     // not at all: memory pinned by someone else, or pageable
  kPartial,  // some bytes inside, some not (a registered prefix, a gap)
  kFull,     // every byte, through one registration or several adjacent ones
};

// The host ranges an engine pinned in place (its runtime's HostRegister),
// so that "pinned" can mean every byte: the runtimes' pointer queries answer
// for one address and say nothing of how far a registration reaches.
class RegisteredRanges {
 public:
  void add(uintptr_t start, uint64_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    ranges_[start] = start + bytes;
  }
  void erase(uintptr_t start) {
    std::lock_guard<std::mutex> lock(mu_);
    ranges_.erase(start);
  }
  // How the ranges meet [lo, hi). When covered, `starts` receives where each
  // covering range begins within [lo, hi), for the runtime's second opinion.
  Coverage coverage(uintptr_t lo, uintptr_t hi, std::vector<uintptr_t>& starts) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ranges_.upper_bound(lo);
    if (it != ranges_.begin() && std::prev(it)->second > lo) --it;
    bool any = false;
    uintptr_t covered = lo;  // every byte of [lo, covered) is registered
    for (; it != ranges_.end() && it->first < hi; ++it) {
      if (it->second <= lo) continue;
      any = true;
      if (it->first > covered) return Coverage::kPartial;  // a gap before this one
      starts.push_back(std::max(it->first, lo));
      covered = std::max(covered, it->second);
      if (covered >= hi) return Coverage::kFull;
    }
    return any ? Coverage::kPartial : Coverage::kNone;
  }

 private:
  mutable std::mutex mu_;
  std::map<uintptr_t, uintptr_t> ranges_;  // start -> end
};

// Keeps the host arrays of submitted batches alive until the device has
// consumed them, for a batch API that may read its descriptor arrays after
// the call returns: the engine hands them here together with an event
// recorded on the copy's stream right after the submission; they are
// released (the descriptor table returns to the core's pool) once that event
// has completed. The CUDA engine uses it; the Ascend engine does not need it
// (CANN consumes the arrays during the call; csrc/ascend/ascend_engine.cpp).
//
// `Runtime` provides:
//   using Event = ...; using Stream = ...;
//   static Event create_event();              // throws on failure
//   static void record(Event, Stream);        // throws on failure
//   static bool completed(Event);             // non-blocking query
// Events are recycled for the life of the process, never destroyed.
template <class Runtime>
class InFlightArrays {
 public:
  using Event = typename Runtime::Event;
  using Stream = typename Runtime::Stream;

  // Holds `tensors` and `extra` until the copies submitted before this call
  // on `stream` are known to have finished: an event recorded on `stream`
  // right after the submission has completed. Also retires earlier batches
  // that have completed. The batch is held from the first line on, so that
  // whatever fails afterwards (creating or recording the event, polling
  // earlier batches) leaves it held: the copies are queued and may still read
  // the arrays. A batch whose event could not be recorded is released once an
  // event recorded later on the same stream has completed (stream order), or
  // never.
  void hold(Stream stream, std::vector<at::Tensor> tensors, std::shared_ptr<void> extra) {
    std::lock_guard<std::mutex> lock(mutex_);
    live_.push_back(Entry{Event{}, stream, false, std::move(tensors), std::move(extra)});
    Entry& entry = live_.back();  // deque: push_back keeps references valid
    const Event event = free_.empty() ? Runtime::create_event() : take_free();
    try {
      Runtime::record(event, stream);
    } catch (...) {
      free_.push_back(event);
      throw;
    }
    entry.event = event;
    entry.has_event = true;
    // Earlier batches only: this one was queued a moment ago.
    retire_locked(live_.size() - 1);
  }

  // Forgets every batch and event, for an engine bound to a new runtime (the
  // old one's events mean nothing to it).
  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    live_.clear();
    free_.clear();
  }

  // Number of batches whose arrays are still held (for tests).
  size_t held() {
    std::lock_guard<std::mutex> lock(mutex_);
    retire_locked(live_.size());
    return live_.size();
  }

 private:
  struct Entry {
    Event event;
    Stream stream;
    bool has_event;
    std::vector<at::Tensor> tensors;
    std::shared_ptr<void> extra;
  };

  Event take_free() {
    Event e = free_.back();
    free_.pop_back();
    return e;
  }

  // Batches complete in submission order per stream, but entries of several
  // streams interleave here, so scan all of the first `count` rather than
  // stop at the first. An entry without an event retires with a later entry
  // of its stream whose event has completed.
  void retire_locked(size_t count) {
    std::vector<Stream> finished;  // streams with a completed event later in the scan
    for (auto it = live_.begin() + static_cast<std::ptrdiff_t>(count); it != live_.begin();) {
      --it;
      bool done;
      if (it->has_event) {
        done = Runtime::completed(it->event);
        if (done) finished.push_back(it->stream);
      } else {
        done = std::find(finished.begin(), finished.end(), it->stream) != finished.end();
      }
      if (done) {
        if (it->has_event) free_.push_back(it->event);
        it = live_.erase(it);
      }
    }
  }

  std::mutex mutex_;
  std::deque<Entry> live_;
  std::vector<Event> free_;
};

}  // namespace kvswap
