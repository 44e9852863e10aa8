// The block-copy kernel's parameters and body, shared by the device build
// (copy_kernel.cu, nvcc) and the host build of the fake runtime's kernel
// launch (tests/fake_cuda/), so the logic CI runs is the logic the GPU runs.
// No torch and no CUDA headers: the host compiler builds it as plain C++.
//
// Work split: blockIdx.y picks the cache pair of the launch; blockIdx.x
// strides over work items, one item per (block id j, slice s), a slice being
// kSliceBytes of one block. A few large blocks therefore spread over many
// thread blocks (and SMs); a small block is one item.
//
// Ids come from device memory (a pointer, read when the kernel runs: a graph
// replay copies the ids the tensor holds then) or inline in the parameters
// (int32, copied into the launch: a replay copies the ids of capture time).
// An id out of range for its cache is skipped, never followed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVSWAP_HD __host__ __device__ __forceinline__
#else
#define KVSWAP_HD inline
#endif

namespace kvswap {
namespace cuda {

// One cache pair: addresses are device memory or mapped pinned host memory
// (the same pointer under unified addressing).
struct KernelPair {
  const char* src;
  char* dst;
  int64_t src_stride;
  int64_t dst_stride;
  int64_t block_bytes;
  int64_t src_blocks;
  int64_t dst_blocks;
};

constexpr int kCopyThreads = 256;
// Bytes one thread block copies per work item: 256 threads x 16 B x 4.
constexpr int64_t kSliceBytes = 16 * 1024;
// The parameter blob holds the launch's pairs, then its inline ids. Two
// sizes: one under the 4 KiB of kernel parameters that every architecture,
// runtime and driver accepts, and one under the 32,764 bytes that CUDA 12.1+
// accepts on Volta (sm_70) and newer ("CUDA 12.1 increases this parameter
// limit from 4,096 bytes to 32,764 bytes on all device architectures
// including NVIDIA Volta and above", NVIDIA technical blog "CUDA 12.1
// Supports Large Kernel Parameters"; CUDA C++ Programming Guide, "Function
// Parameters"). The engine picks one per device at run time.
constexpr int kSmallBlobBytes = 3968;
constexpr int kLargeBlobBytes = 32704;
constexpr int kSmallParamLimit = 4096;
constexpr int kLargeParamLimit = 32764;

template <int kBlobBytes>
struct CopyParamsN {
  static constexpr int kBlob = kBlobBytes;
  const int64_t* src_ids;  // in device memory; null: inline in blob
  const int64_t* dst_ids;  // in device memory; null: inline in blob
  int64_t n;               // id pairs of this launch
  int64_t slices;          // work items per id: max over pairs of ceil(block_bytes / kSliceBytes)
  int32_t num_pairs;
  int32_t reserved;
  // num_pairs KernelPair, then the inline src ids (int32, n of them, when
  // src_ids is null), then the inline dst ids (likewise).
  alignas(16) unsigned char blob[kBlobBytes];
};
using CopyParams = CopyParamsN<kSmallBlobBytes>;
using CopyParamsLarge = CopyParamsN<kLargeBlobBytes>;
static_assert(sizeof(CopyParams) <= kSmallParamLimit, "kernel parameters must fit in 4 KiB");
static_assert(sizeof(CopyParamsLarge) <= kLargeParamLimit,
              "large kernel parameters must fit in 32,764 bytes");
static_assert(sizeof(KernelPair) % 8 == 0, "inline ids follow the pairs aligned");

template <class P>
KVSWAP_HD const KernelPair& pair_at(const P& p, int i) {
  return reinterpret_cast<const KernelPair*>(p.blob)[i];
}

template <class P>
KVSWAP_HD const int32_t* inline_ids(const P& p) {
  return reinterpret_cast<const int32_t*>(p.blob + static_cast<size_t>(p.num_pairs) * sizeof(KernelPair));
}

template <class P>
KVSWAP_HD int64_t src_id(const P& p, int64_t j) {
  return p.src_ids != nullptr ? p.src_ids[j] : inline_ids(p)[j];
}

template <class P>
KVSWAP_HD int64_t dst_id(const P& p, int64_t j) {
  if (p.dst_ids != nullptr) return p.dst_ids[j];
  return inline_ids(p)[(p.src_ids == nullptr ? p.n : 0) + j];
}

#if defined(__CUDACC__)
using Vec16 = uint4;
#else
struct alignas(16) Vec16 {
  uint64_t lo, hi;
};
#endif

// Copies `bytes` from `from` to `to` with thread `tid` of `nthreads`, in
// words of Word: a head of fewer than sizeof(Word) bytes up to the
// destination's alignment, the word body, and a tail of fewer than
// sizeof(Word) bytes. The caller picks Word so both sides align alike.
#if defined(KVSWAP_COPY_KERNEL_STATS) && !defined(__CUDA_ARCH__)
// Host build in the fake runtime only: bytes copied per word width, so the
// tests can see that a size that is not a multiple of 16 still goes in
// 16-byte words, save a head and a tail of fewer than 16 bytes.
struct CopyStats {
  int64_t bytes[5] = {0, 0, 0, 0, 0};  // by log2(width)
};
inline CopyStats& copy_stats() {
  static CopyStats stats;
  return stats;
}
#define KVSWAP_COPY_STAT(width, n)                       \
  (::kvswap::cuda::copy_stats().bytes[(width) == 16  ? 4 \
                                      : (width) == 8 ? 3 \
                                      : (width) == 4 ? 2 \
                                      : (width) == 2 ? 1 \
                                                     : 0] += (n))
#else
#define KVSWAP_COPY_STAT(width, n) ((void)0)
#endif

template <class Word>
KVSWAP_HD void copy_words(const char* from, char* to, int64_t bytes, int tid, int nthreads) {
  constexpr int64_t W = static_cast<int64_t>(sizeof(Word));
  int64_t head = (W - static_cast<int64_t>(reinterpret_cast<uintptr_t>(to) % W)) % W;
  if (head > bytes) head = bytes;
  for (int64_t b = tid; b < head; b += nthreads) {
    to[b] = from[b];
    KVSWAP_COPY_STAT(1, 1);
  }
  const int64_t words = (bytes - head) / W;
  const Word* f = reinterpret_cast<const Word*>(from + head);
  Word* t = reinterpret_cast<Word*>(to + head);
  for (int64_t w = tid; w < words; w += nthreads) {
#if defined(__CUDA_ARCH__)
    t[w] = f[w];
#else
    std::memcpy(t + w, f + w, sizeof(Word));
#endif
    KVSWAP_COPY_STAT(W, W);
  }
  for (int64_t b = head + words * W + tid; b < bytes; b += nthreads) {
    to[b] = from[b];
    KVSWAP_COPY_STAT(1, 1);
  }
}

// The widest word both addresses share an alignment for: 16 bytes whenever
// source and destination agree modulo 16, whatever the size.
KVSWAP_HD void copy_bytes(const char* from, char* to, int64_t bytes, int tid, int nthreads) {
  const uintptr_t rel = reinterpret_cast<uintptr_t>(from) ^ reinterpret_cast<uintptr_t>(to);
  if ((rel & 15) == 0) {
    copy_words<Vec16>(from, to, bytes, tid, nthreads);
  } else if ((rel & 7) == 0) {
    copy_words<uint64_t>(from, to, bytes, tid, nthreads);
  } else if ((rel & 3) == 0) {
    copy_words<uint32_t>(from, to, bytes, tid, nthreads);
  } else if ((rel & 1) == 0) {
    copy_words<uint16_t>(from, to, bytes, tid, nthreads);
  } else {
    copy_words<uint8_t>(from, to, bytes, tid, nthreads);
  }
}

// Work item `item` of pair `pair`, as thread `tid` of `nthreads` sees it.
template <class P>
KVSWAP_HD void copy_item(const P& p, int pair, int64_t item, int tid, int nthreads) {
  const KernelPair& q = pair_at(p, pair);
  const int64_t j = item / p.slices;
  const int64_t begin = (item % p.slices) * kSliceBytes;
  if (begin >= q.block_bytes) return;  // this pair's blocks have fewer slices
  const int64_t s = src_id(p, j);
  const int64_t d = dst_id(p, j);
  if (s < 0 || s >= q.src_blocks || d < 0 || d >= q.dst_blocks) return;
  const int64_t rest = q.block_bytes - begin;
  copy_bytes(q.src + s * q.src_stride + begin, q.dst + d * q.dst_stride + begin,
             rest < kSliceBytes ? rest : kSliceBytes, tid, nthreads);
}

// Work items of a launch.
template <class P>
KVSWAP_HD int64_t work_items(const P& p) {
  return p.n * p.slices;
}

}  // namespace cuda
}  // namespace kvswap
