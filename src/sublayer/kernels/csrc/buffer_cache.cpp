// A small cache of large CPU buffers for the fused Add & Norm (its output, its saved state, its input gradients).
//
// Why: under glibc's default malloc a multi-MB tensor that is freed at the end of a training step is often handed
// back to the kernel (heap trimming, or munmap above the mmap threshold), so the next step's buffer of the same size
// page-faults on every 4 KiB page it touches (a fault can cost more than the kernel's own work on the page). Blocks
// freed here are kept for the next request of the same size instead, up to a byte limit: the longest-idle blocks
// make room for a newly freed one (a block larger than the limit goes back to malloc), and a request takes the most
// recently freed block of its size. Tensors made here are ordinary resizable CPU tensors: only where their memory
// comes from (and goes to) differs.
//
// Limit: 256 MiB, or buffer_cache(limit_bytes) at any time (0 empties the cache and turns it off; sublayer.kernels
// sets $SUBLAYER_BUFFER_CACHE_MB's value when it loads the extension). Blocks under 256 KiB are not cached (malloc
// recycles those without page faults).
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <cstdlib>
#include <mutex>
#include <vector>

namespace sublayer_cache {

namespace {

constexpr size_t kMinBytes = size_t(1) << 18;   // smaller requests: not cached
constexpr size_t kRound = size_t(1) << 16;      // sizes are rounded up to 64 KiB (nearby shapes share blocks)
constexpr size_t kAlign = 64;

struct Block {
  void* ptr;
  size_t bytes;
};

struct Cache {
  std::mutex mu;
  std::vector<Block> free;  // blocks ready for reuse, longest idle first
  size_t cached = 0;        // bytes in `free`
  size_t limit = size_t(256) << 20;
  int64_t hits = 0, misses = 0;
  void trim_to(size_t cap) {  // caller holds mu
    while (cached > cap && !free.empty()) {
      const Block b = free.back();
      free.pop_back();
      cached -= b.bytes;
      std::free(b.ptr);
    }
  }
};

Cache& cache() {
  static Cache* c = new Cache();  // never destroyed: tensors may be freed after static destruction at exit
  return *c;
}

void release(void* ctx) {
  Block* b = static_cast<Block*>(ctx);
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> g(c.mu);
    if (b->bytes <= c.limit) {
      // room first: the longest-idle blocks go back to malloc, so the cache follows the sizes in use (blocks of
      // shapes no longer used would otherwise fill it and send every new size to malloc)
      size_t drop = 0, freed = 0;
      while (c.cached - freed + b->bytes > c.limit) freed += c.free[drop++].bytes;
      for (size_t i = 0; i < drop; ++i) std::free(c.free[i].ptr);
      c.free.erase(c.free.begin(), c.free.begin() + drop);
      c.cached -= freed;
      c.free.push_back(*b);
      c.cached += b->bytes;
      delete b;
      return;
    }
  }
  std::free(b->ptr);
  delete b;
}

struct CacheAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    if (n < kMinBytes) return c10::GetCPUAllocator()->allocate(n);
    const size_t bytes = (n + kRound - 1) / kRound * kRound;
    Cache& c = cache();
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> g(c.mu);
      for (size_t i = c.free.size(); i-- > 0;) {  // the most recently freed block of that size: likely still cached
        if (c.free[i].bytes == bytes) {
          p = c.free[i].ptr;
          c.free.erase(c.free.begin() + std::ptrdiff_t(i));
          c.cached -= bytes;
          ++c.hits;
          break;
        }
      }
      if (!p) ++c.misses;
    }
    if (!p && posix_memalign(&p, kAlign, bytes) != 0) p = nullptr;
    TORCH_CHECK(p, "sublayer buffer cache: out of memory allocating ", bytes, " bytes");
    return {p, new Block{p, bytes}, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};

CacheAllocator& allocator() {
  static CacheAllocator* a = new CacheAllocator();
  return *a;
}

// [limit, cached bytes, cached blocks, hits, misses]; limit >= 0 sets the limit first (0: off, cache emptied).
std::vector<int64_t> buffer_cache(int64_t limit) {
  Cache& c = cache();
  std::lock_guard<std::mutex> g(c.mu);
  if (limit >= 0) {
    c.limit = size_t(limit);
    c.trim_to(c.limit);
  }
  return {int64_t(c.limit), int64_t(c.cached), int64_t(c.free.size()), c.hits, c.misses};
}

}  // namespace

// An uninitialised contiguous CPU tensor whose memory comes from (and returns to) the cache.
at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  return at::detail::empty_generic(sizes, &allocator(), c10::DispatchKeySet(c10::DispatchKey::CPU), dtype,
                                   std::nullopt);
}

}  // namespace sublayer_cache

TORCH_LIBRARY_FRAGMENT(sublayer_kernels, m) { m.def("buffer_cache(int limit) -> int[]", &sublayer_cache::buffer_cache); }
