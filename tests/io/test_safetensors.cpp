// safetensors: what the writer writes the reader reads back (F32 exactly, BF16/F16 rounded to
// nearest even and widened exactly), the header as the format defines it, and damaged files
// refused with one line; the GPT-2 and Llama maps' shapes, the transpose, and Llama's config.json.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/dtype.hpp"
#include "expect_error.hpp"
#include "io/hf_gpt2.hpp"
#include "io/hf_llama.hpp"
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
  const std::vector<HfTensor> tied = gpt2_tensor_map(o);
  EXPECT_EQ(tied.size(), 2u + 2 * 12 + 2);
  o.tie_embeddings = false;
  const std::vector<HfTensor> untied = gpt2_tensor_map(o);
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

// A Llama 3.2-style config.json (transformers 4's rope keys, and 5's rope_parameters) -> the
// options, the name map (grouped-query k/v of kv_heads x head_dim rows, nothing transposed) and
// back; what Strata's llama does not compute is one line naming the key.
TEST(HfLlama, ConfigMapAndRefusals) {
  const std::string v4 = R"({"architectures":["LlamaForCausalLM"],"model_type":"llama","vocab_size":100,
    "hidden_size":32,"intermediate_size":80,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
    "max_position_embeddings":64,"rms_norm_eps":1e-5,"rope_theta":500000.0,"tie_word_embeddings":true,
    "rope_scaling":{"rope_type":"llama3","factor":32.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
                    "original_max_position_embeddings":8192},"hidden_act":"silu","attention_bias":false})";
  const LlamaOptions o = parse_hf_llama_config(v4, "config.json");
  EXPECT_EQ(o.kv_heads, 2);
  EXPECT_EQ(o.ffn_hidden, 80);
  EXPECT_EQ(o.positions, 64);
  EXPECT_DOUBLE_EQ(o.rope_theta, 500000.0);
  EXPECT_DOUBLE_EQ(o.rope_scaling, 32.0);
  EXPECT_TRUE(o.tie_embeddings);
  const std::string v5 = R"({"model_type":"llama","vocab_size":100,"hidden_size":32,"intermediate_size":80,
    "num_hidden_layers":2,"num_attention_heads":4,"rope_parameters":{"rope_type":"default","rope_theta":10000.0}})";
  const LlamaOptions o5 = parse_hf_llama_config(v5, "config.json");
  EXPECT_DOUBLE_EQ(o5.rope_theta, 10000.0);
  EXPECT_EQ(o5.rope_scaling, 0);
  EXPECT_EQ(o5.kv_heads, 4);
  EXPECT_FALSE(o5.tie_embeddings);  // LlamaConfig's default

  const std::vector<HfTensor> map = llama_tensor_map(o);
  EXPECT_EQ(map.size(), 1u + 2 * 9 + 1);  // tied: no lm_head
  EXPECT_EQ(map[2].hf, "model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(map[2].strata, "layers.0/self_attn/k_proj/weight");
  EXPECT_EQ(map[2].hf_shape, (Shape{16, 32}));  // 2 kv heads of 8
  EXPECT_TRUE(std::none_of(map.begin(), map.end(), [](const HfTensor& t) { return t.transposed; }));
  EXPECT_EQ(parse_hf_llama_config(hf_llama_config_json(o, "float32"), "out").rope_scaling, 32.0);

  const auto refused = [&](const std::string& edit, const std::string& message) {
    std::string text = v4;
    text.insert(text.size() - 1, "," + edit);
    test::expect_input_error([&] { parse_hf_llama_config(text, "config.json"); }, {message});
  };
  refused(R"("mlp_bias":true)", "'mlp_bias' is true");
  refused(R"("hidden_act":"gelu")", "'hidden_act' is 'gelu'");
  refused(R"("head_dim":16)", "'head_dim' is 16");
  refused(R"("num_key_value_heads":3)", "'num_key_value_heads' (3) must divide 'num_attention_heads' (4)");
  refused(R"("rope_scaling":{"rope_type":"yarn","factor":4.0})", "rope_type 'yarn' is not supported");
  refused(R"("rope_scaling":{"rope_type":"llama3","factor":8.0,"high_freq_factor":2.0})",
          "differs from Llama 3.1's low_freq_factor 1, high_freq_factor 4");
}

}  // namespace
}  // namespace strata::io
