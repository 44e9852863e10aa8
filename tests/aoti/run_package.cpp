// A C++ program with no Python: it opens torch_kvswap's libraries with
// dlopen, loads an AOTInductor package whose graph calls kvswap::swap_blocks
// (tests/test_aoti_cpp.py makes it), runs it and checks the bytes against a
// plain reference copy.
//
//   run_package PACKAGE MODE [LIBRARY...]
//
// MODE "cpu": host caches on both sides, the host engine copies. MODE
// "fake_cuda": the destinations are device memory of the fake CUDA runtime
// (LIBRARY is then the test extension, which links the core): the CUDA
// engine built against that runtime copies on its current stream, and the
// bytes are read after the stream is synchronized. MODE "cpu-control":
// as "cpu", but the reference takes other blocks, so the check must fail.
//
// Prints "ok MODE BYTES CALLS" (CALLS: the fake runtime's calls, 0 on the
// host) and exits 0 when every destination byte equals the
// reference; otherwise names the first differing block and exits 1. Any
// failure (a library that does not load, an op the package cannot find)
// is printed and exits 2.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <dlfcn.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

namespace {

constexpr int64_t kBlocks = 8;
constexpr int64_t kBlockElems = 16;

c10::OperatorHandle op(const char* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); }

// The fake CUDA runtime's ops (tests/fake_cuda/fake_cuda_module.cpp).
at::Tensor to_fake_device(const at::Tensor& cpu) {
  return op("kvswap_fake_cuda::device_copy").typed<at::Tensor(const at::Tensor&, int64_t)>().call(cpu, 0);
}

at::Tensor bytes_of(const at::Tensor& t) {
  if (t.is_cpu()) return t;
  auto stream = op("kvswap_fake_cuda::current_stream").typed<int64_t(int64_t)>().call(0);
  const std::string status = op("kvswap_fake_cuda::synchronize").typed<std::string(int64_t)>().call(stream);
  TORCH_CHECK(status == "cudaSuccess", "synchronizing the fake stream: ", status);
  return op("kvswap_fake_cuda::host_view").typed<at::Tensor(const at::Tensor&)>().call(t).clone();
}

int run(const std::string& package, const std::string& mode) {
  const bool device = mode == "fake_cuda";
  if (device) op("kvswap_fake_cuda::install").typed<void()>().call();
  const auto src_k = at::arange(kBlocks * kBlockElems, at::kFloat).view({kBlocks, kBlockElems});
  const auto src_v = -src_k - 1;
  const auto src_ids = at::tensor(std::vector<int64_t>{1, 3, 6});
  const auto dst_ids = at::tensor(std::vector<int64_t>{0, 5, 2});
  auto dst_k = at::zeros({kBlocks, kBlockElems});
  auto dst_v = at::zeros({kBlocks, kBlockElems});
  if (device) {
    dst_k = to_fake_device(dst_k);
    dst_v = to_fake_device(dst_v);
  }

  torch::inductor::AOTIModelPackageLoader loader(package);
  loader.run({src_k, src_v, dst_k, dst_v, src_ids, dst_ids});

  // The reference: a plain row copy.
  const auto ref_src = mode == "cpu-control" ? at::tensor(std::vector<int64_t>{1, 3, 7}) : src_ids;
  const at::Tensor sources[] = {src_k, src_v};
  const at::Tensor results[] = {bytes_of(dst_k), bytes_of(dst_v)};
  int64_t bytes = 0;
  for (int pair = 0; pair < 2; ++pair) {
    auto want = at::zeros({kBlocks, kBlockElems});
    want.index_copy_(0, dst_ids, sources[pair].index_select(0, ref_src));
    for (int64_t b = 0; b < kBlocks; ++b) {
      if (!at::equal(results[pair][b], want[b])) {
        std::printf("mismatch %s pair %d block %lld\n", mode.c_str(), pair, static_cast<long long>(b));
        return 1;
      }
    }
    bytes += dst_ids.numel() * kBlockElems * static_cast<int64_t>(sizeof(float));
  }
  // How many calls the copies made into the fake runtime (none on the host).
  int64_t runtime_calls = 0;
  if (device) {
    runtime_calls = static_cast<int64_t>(
        op("kvswap_fake_cuda::call_log").typed<std::vector<std::string>()>().call().size());
    op("kvswap_fake_cuda::uninstall").typed<void()>().call();
  }
  std::printf("ok %s %lld %lld\n", mode.c_str(), static_cast<long long>(bytes),
              static_cast<long long>(runtime_calls));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s PACKAGE MODE [LIBRARY...]\n", argv[0]);
    return 2;
  }
  for (int i = 3; i < argc; ++i) {
    // Lazy binding: the libraries' Python module inits are never called here.
    if (dlopen(argv[i], RTLD_LAZY | RTLD_GLOBAL) == nullptr) {
      std::fprintf(stderr, "dlopen %s: %s\n", argv[i], dlerror());
      return 2;
    }
  }
  try {
    return run(argv[1], argv[2]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
