// safetensors: what the writer writes the reader reads back (F32 exactly, BF16/F16 rounded to
// nearest even and widened exactly), the header as the format defines it, and damaged files
// refused with one line; the GPT-2 map's shapes and transpose.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/dtype.hpp"
#include "expect_error.hpp"
#include "io/hf_gpt2.hpp"
#include "io/safetensors.hpp"

namespace strata::io {
namespace {

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("strata_test_st_" + name)).string();
}

Tensor iota(Shape shape, float scale) {
  Tensor t = Tensor::empty(std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = scale * static_cast<float>(i) - 1.0f;
  return t;
}

std::string write_two(const std::string& name) {
  const std::string path = temp_path(name);
  SafetensorsWriter w(path, {{"a", "F32", {2, 3}}, {"b.weight", "BF16", {5}}, {"c", "F16", {4}}}, {{"format", "pt"}});
  w.write(iota({2, 3}, 0.5f));
  w.write(iota({5}, 0.3333f));
  w.write(iota({4}, 0.1f));
  w.close();
  return path;
}

TEST(Safetensors, RoundTrip) {
  const std::string path = write_two("roundtrip");
  const SafetensorsReader r(path);
  ASSERT_EQ(r.tensors().size(), 3u);
  EXPECT_EQ(r.metadata().at("format"), "pt");
  const SafetensorInfo* a = r.find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->shape, (Shape{2, 3}));
  EXPECT_EQ(a->begin, 0u);
  EXPECT_EQ(a->end, 24u);
  const Tensor va = r.read_f32(*a), want = iota({2, 3}, 0.5f);
  EXPECT_EQ(std::memcmp(va.raw(), want.raw(), want.nbytes()), 0);
  const Tensor vb = r.read_f32(*r.find("b.weight")), wb = iota({5}, 0.3333f);
  for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(vb.data<float>()[i], bf16::from_float(wb.data<float>()[i]).to_float());
  const Tensor vc = r.read_f32(*r.find("c")), wc = iota({4}, 0.1f);
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(vc.data<float>()[i], f16::from_float(wc.data<float>()[i]).to_float());
  // The data starts 8-byte aligned after the little-endian header length.
  std::ifstream in(path, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(std::filesystem::file_size(path), 8 + n + 24 + 10 + 8);
}

TEST(Safetensors, DamagedFilesAreOneLine) {
  const std::string path = write_two("damaged");
  const auto size = std::filesystem::file_size(path);
  std::filesystem::resize_file(path, size - 1);
  test::expect_input_error([&] { SafetensorsReader r(path); }, {"tensor 'c'", "truncated"});
  std::filesystem::resize_file(path, 20);
  test::expect_input_error([&] { SafetensorsReader r(path); }, {"declares a header of", "holds only 12"});
  std::filesystem::resize_file(path, 3);
  test::expect_input_error([&] { SafetensorsReader r(path); }, {"shorter than its 8-byte header length"});
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    const std::string header = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})";
    const uint64_t n = header.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << header << "12345678";
  }
  test::expect_input_error([&] { SafetensorsReader r(path); }, {"tensor 'x'", "data_offsets [0, 4]", "8 bytes"});
}

TEST(HfGpt2, MapAndTranspose) {
  Gpt2Options o;
  o.vocab = 10;
  o.positions = 4;
  o.embed = 8;
  o.layers = 2;
  o.heads = 2;
  const std::vector<Gpt2Tensor> tied = gpt2_tensor_map(o);
  EXPECT_EQ(tied.size(), 2u + 2 * 12 + 2);
  o.tie_embeddings = false;
  const std::vector<Gpt2Tensor> untied = gpt2_tensor_map(o);
  EXPECT_EQ(untied.back().hf, "lm_head.weight");
  EXPECT_EQ(untied[4].hf, "transformer.h.0.attn.c_attn.weight");
  EXPECT_EQ(untied[4].strata, "h0/attn/c_attn/weight");
  EXPECT_EQ(untied[4].hf_shape, (Shape{8, 24}));
  EXPECT_TRUE(untied[4].transposed);
  const Tensor m = iota({2, 3}, 1.0f), t = transpose_2d(m);
  EXPECT_EQ(t.shape(), (Shape{3, 2}));
  for (int r = 0; r < 2; ++r)
    for (int c = 0; c < 3; ++c) EXPECT_EQ(t.data<float>()[c * 2 + r], m.data<float>()[r * 3 + c]);
  test::expect_input_error(
      [] {
        parse_hf_gpt2_config(R"({"model_type":"gpt2","vocab_size":10,"n_positions":4,"n_embd":8,"n_layer":1,)"
                             R"("n_head":2,"reorder_and_upcast_attn":true})",
                             "config.json");
      },
      {"'reorder_and_upcast_attn' is true"});
}

}  // namespace
}  // namespace strata::io
