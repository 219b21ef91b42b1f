// The host caching allocator: size classes, cache reuse and its statistics.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "core/allocator.hpp"
#include "core/error.hpp"
#include "core/ops.hpp"
#include "core/tensor.hpp"

using namespace strata;

TEST(HostCachingAllocator, SizeClassesBoundWaste) {
  for (size_t bytes : {1ul, 63ul, 64ul, 65ul, 1000ul, 4096ul, 100000ul, (1ul << 20) + 1, 123456789ul}) {
    const size_t c = HostCachingAllocator::size_class(bytes);
    EXPECT_GE(c, bytes);
    EXPECT_EQ(c % 64, 0u);
    EXPECT_LE(c, std::max<size_t>(64, bytes + bytes / 8 + 64)) << bytes;
    EXPECT_EQ(HostCachingAllocator::size_class(c), c);  // classes are fixed points
  }
}

TEST(HostCachingAllocator, SecondAllocationOfSameSizeIsACacheHit) {
  HostCachingAllocator a;  // a private instance: stats are not shared with other tests
  void* p = a.allocate(10000);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  AllocatorStats s = a.stats();
  EXPECT_EQ(s.system_allocs, 1u);
  EXPECT_EQ(s.cache_hits, 0u);
  EXPECT_EQ(s.bytes_in_use, HostCachingAllocator::size_class(10000));
  a.deallocate(p, 10000);
  s = a.stats();
  EXPECT_EQ(s.bytes_in_use, 0u);
  EXPECT_EQ(s.bytes_cached, HostCachingAllocator::size_class(10000));

  void* q = a.allocate(9990);  // same size class
  EXPECT_EQ(q, p);
  s = a.stats();
  EXPECT_EQ(s.system_allocs, 1u);
  EXPECT_EQ(s.cache_hits, 1u);
  EXPECT_EQ(s.bytes_cached, 0u);

  void* r = a.allocate(10000);  // the cached block is taken: a new one
  EXPECT_NE(r, q);
  EXPECT_EQ(a.stats().system_allocs, 2u);
  EXPECT_EQ(a.stats().peak_in_use, 2 * HostCachingAllocator::size_class(10000));
  a.deallocate(q, 9990);
  a.deallocate(r, 10000);
  a.release_cached();
  EXPECT_EQ(a.stats().bytes_cached, 0u);
  EXPECT_EQ(a.stats().bytes_in_use, 0u);
}

// --device-memory on the CPU: past the limit an allocation is an Input error naming the sizes,
// freed memory counts again, and the peak is what was handed out at once.
TEST(HostCachingAllocator, LimitRefusesWhatWouldExceedIt) {
  HostCachingAllocator a;
  const size_t block = HostCachingAllocator::size_class(4096);
  a.set_limit(2 * block);
  void* p = a.allocate(4096);
  void* q = a.allocate(4096);
  try {
    a.allocate(4096);
    FAIL() << "a third block fitted under a limit of two";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Input);
    EXPECT_NE(std::string(e.what()).find("--device-memory"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::to_string(3 * block)), std::string::npos) << e.what();
  }
  a.deallocate(q, 4096);
  q = a.allocate(4096);  // back under the limit
  EXPECT_EQ(a.peak_in_use(), 2 * block);
  a.deallocate(p, 4096);
  a.deallocate(q, 4096);
  a.set_limit(0);  // no limit
  void* big = a.allocate(16 * block);
  a.deallocate(big, 16 * block);
}

TEST(HostCachingAllocator, AllocatorForCpu) {
  EXPECT_EQ(&allocator_for(Device::cpu()), &host_allocator());
  EXPECT_TRUE(allocator_for(Device::cpu()).device().is_cpu());
}

TEST(MetaAllocator, CountsSizeClassesAndHandsOutNoMemory) {
  MetaAllocator& meta = meta_allocator();
  const size_t before = meta.in_use();
  const size_t a_bytes = HostCachingAllocator::size_class(12000), b_bytes = HostCachingAllocator::size_class(20000);
  {
    const Tensor a = Tensor::empty({1000, 3}, DType::F32, Device::meta());
    EXPECT_EQ(meta.in_use() - before, a_bytes);
    meta.reset_peak();
    {
      const Tensor b = Tensor::zeros({5000}, DType::F32, Device::meta());  // no memset: nothing to write
      ops::gelu_forward(a, a);                                             // no kernel runs
      EXPECT_EQ(meta.peak_in_use() - before, a_bytes + b_bytes);
    }
    EXPECT_EQ(meta.in_use() - before, a_bytes);
  }
  EXPECT_EQ(meta.in_use(), before);
  EXPECT_TRUE(allocator_for(Device::meta()).device().is_meta());
}

TEST(MetaAllocator, CountsTheCpuKernelsF32StagingOfBf16WhenPlanningForTheCpu) {
  MetaAllocator& meta = meta_allocator();
  const Tensor x = Tensor::empty({256}, DType::BF16, Device::meta());
  const Tensor y = Tensor::empty({256}, DType::BF16, Device::meta());
  const size_t before = meta.in_use();
  for (const bool cpu : {true, false}) {
    meta.set_host_staging(cpu);
    meta.reset_peak();
    ops::gelu_tanh_forward(x, y);  // the CPU widens x and y into f32 scratch for the op
    EXPECT_EQ(meta.peak_in_use() - before, cpu ? 2 * HostCachingAllocator::size_class(256 * 4) : 0) << cpu;
    EXPECT_EQ(meta.in_use(), before);
  }
  meta.set_host_staging(true);
}
