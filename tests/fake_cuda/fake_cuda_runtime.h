// A fake CUDA runtime on host memory, for tests only: the CUDA engine's host
// logic (csrc/cuda/cuda_engine.cpp) runs against it in CPU CI through the
// engine's runtime table. What it models, and the source of each rule, is in
// fake_cuda_runtime.cpp; docs/cuda.md says what it verifies and what only
// hardware can.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "../../csrc/cuda/cuda_engine.h"

namespace fake_cuda {

// Tables to bind the engine to: the fake runtime, or one whose every call
// succeeds at once and does nothing (for measuring the engine's own cost).
const kvswap::cuda::CudaApi* fake_table();
const kvswap::cuda::CudaApi* noop_table();

// Forgets streams' queued work, captures, the call log and every fault;
// keeps allocations. `devices` is the device count.
void reset(int devices);

// Memory. Device memory and pinned memory are host memory that the registry
// marks as such; anything else is pageable host memory.
void* device_malloc(size_t bytes, int device);
void device_free(void* ptr);
void* host_alloc(size_t bytes);  // pinned and mapped (cudaHostAlloc, default flags under UVA)
void host_free(void* ptr);

// Streams: handles of the runtime. 0 is the legacy default stream.
cudaStream_t stream_create(int device, bool blocking);
void set_current_stream(int device, cudaStream_t stream);
cudaStream_t current_stream(int device);
int current_device();
void set_device(int device);  // torch's exchangeDevice: raises for a device cudaSetDevice refuses
// Work queued on a stream so far, and whether the stream has run it (for the
// fake pinned host allocator: a block is reused once its streams ran past).
uint64_t stream_position(cudaStream_t stream);
bool stream_reached(cudaStream_t stream, uint64_t position);

// The runtime functions the tests drive directly (same contracts as CUDA's).
cudaError_t stream_synchronize(cudaStream_t stream);
cudaError_t memcpy_sync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t memcpy_async(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream);
cudaError_t begin_capture(cudaStream_t stream, cudaStreamCaptureMode mode);
cudaError_t end_capture(cudaStream_t stream, cudaGraph_t* graph);
cudaError_t graph_instantiate(cudaGraphExec_t* exec, cudaGraph_t graph);
cudaError_t graph_launch(cudaGraphExec_t exec, cudaStream_t stream);
// The nodes of an instantiated graph (for tests: what a capture recorded).
size_t graph_node_count(cudaGraphExec_t exec);
cudaError_t exchange_capture_mode(cudaStreamCaptureMode* mode);
cudaError_t get_last_error(bool peek);
const char* error_name(cudaError_t err);

// Injectable faults and versions.
struct Faults {
  bool batch_absent = false;              // the table has no batch entry
  cudaError_t batch_error = cudaSuccess;  // the batch call answers this
  int64_t batch_fail_at = -1;             // a batch with more descriptors fails (invalid value)
  int64_t batch_fail_call = -1;           // the k-th cudaMemcpyBatchAsync since reset fails
                                          // (invalid value), queuing nothing
  int64_t memcpy_fail_at = -1;            // the k-th cudaMemcpyAsync since reset fails
  int64_t launch_fail_at = -1;            // the k-th kernel launch since reset fails
  cudaError_t host_register_error = cudaSuccess;
  // cudaHostRegister of more bytes fails with cudaErrorMemoryAllocation: the
  // runtime documents no limit, but one call of 512 GiB or more fails on
  // H200 hosts (vLLM issues #45850, #51081), so callers register in chunks.
  int64_t host_register_max_bytes = -1;
  int runtime_version = 13000;
  int driver_version = 13000;
  bool stalled = false;                     // queued work does not progress until a sync
  bool scribble_arrays = false;             // batch: copy the pointer arrays during the call,
                                            // then overwrite them too (const or not)
  int compute_major = 9;                    // cudaDevAttrComputeCapabilityMajor of every device
  bool large_params_absent = false;         // the table has no large-parameter launcher
  bool pointer_query_unsafe = false;        // cudaPointerGetAttributes is "potentially unsafe"
                                            // under capture (illegal in global mode)
  bool reports_fail_index = false;          // the batch call sets failIdx (CUDA 12.8/12.9)
  int refuse_device = -1;                   // cudaSetDevice of this device fails
  std::map<std::string, cudaError_t> fail;  // runtime function name -> error it answers
};
Faults& faults();

// What happened: one line per runtime call ("api device=D stream=S
// capturing=C -> error"), kernel launch shapes, and rule violations that no
// error code reports (descriptor arrays changed while the runtime may still
// read them; a kernel that touched pageable memory).
std::vector<std::string> call_log();
int64_t count_calls(const std::string& api);
// Bytes page-locked by cudaHostRegister since reset: the cost clock (page-locking
// costs time per byte, about 0.1 s per GB on H200 hosts, vLLM issue #45850).
int64_t host_register_bytes();
std::vector<std::string> violations();
struct LaunchRecord {
  unsigned grid_x, grid_y;
  int64_t n, slices;
  int num_pairs;
  bool inline_src, inline_dst;
  int param_bytes;  // sizeof the launch's parameter block
};
std::vector<LaunchRecord> launches();
struct BatchRecord {
  size_t count, num_attrs, first_index;
  int src_access_order;
};
std::vector<BatchRecord> batches();
// Bytes the kernel body copied, by word width (1, 2, 4, 8, 16 bytes).
std::vector<int64_t> copy_widths();

}  // namespace fake_cuda
