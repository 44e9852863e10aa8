// Pieces shared by the asynchronous accelerator engines (CUDA, Ascend), so
// that the two read alike. Header-only: each engine is its own extension.
#pragma once

#include <ATen/core/Tensor.h>

#include <deque>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace kvswap {

// Keeps the host arrays of submitted batches alive until the device has
// consumed them. A batch API may read its descriptor arrays after the call
// returns, so the engine hands them here together with an event recorded on
// the copy's stream right after the submission; they are released (the
// descriptor table returns to the core's pool) once that event has completed.
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

  // Records an event on `stream` and holds `tensors` and `extra` until it
  // completes. Also retires earlier batches that have completed.
  void hold(Stream stream, std::vector<at::Tensor> tensors, std::shared_ptr<void> extra) {
    std::lock_guard<std::mutex> lock(mutex_);
    retire_locked();
    Event event = free_.empty() ? Runtime::create_event() : take_free();
    try {
      Runtime::record(event, stream);
    } catch (...) {
      free_.push_back(event);
      throw;
    }
    live_.push_back(Entry{event, std::move(tensors), std::move(extra)});
  }

  // Number of batches whose arrays are still held (for tests).
  size_t held() {
    std::lock_guard<std::mutex> lock(mutex_);
    retire_locked();
    return live_.size();
  }

 private:
  struct Entry {
    Event event;
    std::vector<at::Tensor> tensors;
    std::shared_ptr<void> extra;
  };

  Event take_free() {
    Event e = free_.back();
    free_.pop_back();
    return e;
  }

  // Batches complete in submission order per stream, but entries of several
  // streams interleave here, so scan all rather than stop at the first.
  void retire_locked() {
    for (auto it = live_.begin(); it != live_.end();) {
      if (Runtime::completed(it->event)) {
        free_.push_back(it->event);
        it = live_.erase(it);
      } else {
        ++it;
      }
    }
  }

  std::mutex mutex_;
  std::deque<Entry> live_;
  std::vector<Event> free_;
};

}  // namespace kvswap
