// Language models: token embeddings, attention heads and attention: each op checks its arguments, then dispatches on
// the device (ops.cpp explains the dtype rules).
#include "core/ops/dispatch.hpp"

namespace strata::ops {

using namespace dispatch;  // the shared checks and staging

// ---- language models -------------------------------------------------------------------------

namespace {
// tokens i32 (B, T); returns nothing, checks the shape only (values are checked by the kernels).
void check_tokens(const Tensor& tokens) {
  check_defined(tokens, "tokens");
  STRATA_CHECK(tokens.dtype() == DType::I32 && tokens.ndim() == 2, "tokens must be i32 (B, T), got ", tokens.str());
}

// A position table (Tmax, D) with Tmax >= t.
void check_position_table(const Tensor& wpe, int64_t t, int64_t d, const char* name) {
  STRATA_CHECK(wpe.ndim() == 2 && wpe.dim(0) >= t && wpe.dim(1) == d, name, " must be (Tmax >= ", t, ", ", d, "), got ",
               wpe.str());
}

// q (B, H, T, Dh) of a float dtype; y, dy, dq (`like`) the same shape and dtype; k, v, dk, dv
// (`kv`) the same dtype and (B, Hkv, T, Dh) with Hkv dividing H (grouped-query attention).
void check_heads(const Tensor& q, std::initializer_list<std::pair<const Tensor*, const char*>> like,
                 std::initializer_list<std::pair<const Tensor*, const char*>> kv) {
  check_float(q, "q");
  STRATA_CHECK(q.ndim() == 4, "attention tensors must be (B, H, T, Dh), got q ", q.str());
  for (const auto& [t, name] : like) {
    check_same_dtype(*t, q, name);
    check_shape(*t, q.shape(), name);
  }
  const Tensor& k = *kv.begin()->first;
  check_defined(k, "k");
  STRATA_CHECK(k.ndim() == 4 && k.dim(1) > 0 && q.dim(1) % k.dim(1) == 0,
               "k must be (B, Hkv, T, Dh) with Hkv dividing ", q.dim(1), " query heads, got ", k.str());
  for (const auto& [t, name] : kv) {
    check_same_dtype(*t, q, name);
    check_shape(*t, Shape{q.dim(0), k.dim(1), q.dim(2), q.dim(3)}, name);
  }
}

// The CUDA kernels read kv head h for query head h: grouped-query attention is CPU only so far.
void check_cuda_heads(const Device& d, const Tensor& q, const Tensor& k) {
  STRATA_CHECK(!d.is_cuda() || q.dim(1) == k.dim(1), "grouped-query attention (", q.dim(1), " query heads, ", k.dim(1),
               " kv heads) has no kernel for ", d.str(), " yet");
}

void check_attention_dropout(float p, const DropoutKey& key, const Tensor& q) {
  STRATA_CHECK(p >= 0.0f && p <= 1.0f, "attention dropout probability must be in [0, 1], got ", p);
  STRATA_CHECK(key.first_sample >= 0, "first_sample must be >= 0, got ", key.first_sample);
  // A slice of the layer's heads must lie inside them (heads 0: q holds all of them).
  STRATA_CHECK(key.heads == 0 ? key.first_head == 0 : key.first_head >= 0 && key.first_head + q.dim(1) <= key.heads,
               "attention dropout key: heads ", key.first_head, "..", key.first_head + q.dim(1), " of ", key.heads);
}

// probs (B, H, T, T): f32 or the dtype of q.
void check_probs(const Tensor& probs, const Tensor& q) {
  check_defined(probs, "probs");
  check_grad_dtype(probs, q, "probs");
  check_shape(probs, Shape{q.dim(0), q.dim(1), q.dim(2), q.dim(2)}, "probs");
}

// lse f32 (B, H, T).
void check_lse(const Tensor& lse, const Tensor& q) {
  check_f32(lse, "lse");
  check_shape(lse, Shape{q.dim(0), q.dim(1), q.dim(2)}, "lse");
}

// Outputs must not share storage with the inputs (the kernels read inputs after writing).
void check_no_alias(std::initializer_list<const Tensor*> outputs, std::initializer_list<const Tensor*> inputs) {
  for (const Tensor* o : outputs)
    for (const Tensor* i : inputs)
      STRATA_CHECK(!o->defined() || !i->defined() || !o->same_storage(*i),
                   "attention outputs must not share storage with its inputs (", o->str(), " and ", i->str(), ")");
}
}  // namespace

void embedding_forward(const Tensor& tokens, const Tensor& wte, const Tensor& wpe, const Tensor& y, int64_t first_token,
                       int64_t vocab) {
  check_tokens(tokens);
  check_float(wte, "wte");
  STRATA_CHECK(wte.ndim() == 2, "wte must be (V, D), got ", wte.str());
  const int64_t b = tokens.dim(0), t = tokens.dim(1), d = wte.dim(1);
  if (vocab == 0) vocab = wte.dim(0);
  // A vocabulary-parallel slice may end past the vocabulary: padding rows, which no token selects.
  STRATA_CHECK(first_token >= 0, "wte's rows start at token ", first_token);
  if (wpe.defined()) {
    check_same_dtype(wpe, wte, "wpe");
    check_position_table(wpe, t, d, "wpe");
  }
  check_same_dtype(y, wte, "y");
  check_shape(y, Shape{b, t, d}, "y");
  const Device dev = common_device({&tokens, &wte, &wpe, &y});
  if (dev.is_meta()) return meta_op({&tokens, &wte, &wpe, &y}, true);
  if (dev.is_cpu())
    return on_cpu([&](F32Staging& s) {
      cpu::embedding_forward(tokens, s.in(wte), wpe.defined() ? s.in(wpe) : Tensor(), s.out(y), first_token, vocab);
    });
  STRATA_CUDA_OP(dev, embedding_forward, tokens, wte, wpe, y, first_token, vocab);
}

void embedding_backward(const Tensor& tokens, const Tensor& dy, const Tensor& dwte, const Tensor& dwpe,
                        int64_t first_token) {
  check_tokens(tokens);
  check_float(dy, "dy");
  const int64_t b = tokens.dim(0), t = tokens.dim(1);
  STRATA_CHECK(dy.ndim() == 3 && dy.dim(0) == b && dy.dim(1) == t, "dy must be (", b, ", ", t, ", D), got ", dy.str());
  const int64_t d = dy.dim(2);
  STRATA_CHECK(first_token >= 0, "first_token must be >= 0, got ", first_token);
  if (dwte.defined()) {
    check_grad_dtype(dwte, dy, "dwte");
    STRATA_CHECK(dwte.ndim() == 2 && dwte.dim(1) == d, "dwte must be (V, ", d, "), got ", dwte.str());
  }
  if (dwpe.defined()) {
    check_grad_dtype(dwpe, dy, "dwpe");
    check_position_table(dwpe, t, d, "dwpe");
  }
  const Device dev = common_device({&tokens, &dy, &dwte, &dwpe});
  if (dev.is_meta()) return meta_op({&tokens, &dy, &dwte, &dwpe}, true);
  if (dev.is_cpu())
    return on_cpu(
        [&](F32Staging& s) { cpu::embedding_backward(tokens, s.in(dy), s.inout(dwte), s.inout(dwpe), first_token); });
  STRATA_CUDA_OP(dev, embedding_backward, tokens, dy, dwte, dwpe, first_token);
}

namespace {
// qkv (B, T, 3 * H * Dh) and q, k, v (B, H, T, Dh) of one float dtype.
void check_qkv(const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v, const char* qkv_name,
               const char* q_name, const char* k_name, const char* v_name) {
  check_float(q, q_name);
  STRATA_CHECK(q.ndim() == 4, q_name, " must be (B, H, T, Dh), got ", q.str());
  check_same_dtype(k, q, k_name);
  check_shape(k, q.shape(), k_name);
  check_same_dtype(v, q, v_name);
  check_shape(v, q.shape(), v_name);
  check_same_dtype(qkv, q, qkv_name);
  check_shape(qkv, Shape{q.dim(0), q.dim(2), 3 * q.dim(1) * q.dim(3)}, qkv_name);
}

// x (B, H, T, Dh) and y (B, T, H * Dh) of one float dtype.
void check_heads_layout(const Tensor& x, const Tensor& y) {
  check_float(x, "x");
  STRATA_CHECK(x.ndim() == 4, "x must be (B, H, T, Dh), got ", x.str());
  check_same_dtype(y, x, "y");
  check_shape(y, Shape{x.dim(0), x.dim(2), x.dim(1) * x.dim(3)}, "y");
}
}  // namespace

void split_qkv(const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v) {
  check_qkv(qkv, q, k, v, "qkv", "q", "k", "v");
  const Device d = common_device({&qkv, &q, &k, &v});
  if (d.is_meta()) return meta_op({&qkv, &q, &k, &v}, false);
  if (d.is_cpu()) return cpu::split_qkv(qkv, q, k, v);  // a copy: any float dtype as is
  STRATA_CUDA_OP(d, split_qkv, qkv, q, k, v);
}

void merge_qkv(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dqkv) {
  check_qkv(dqkv, dq, dk, dv, "dqkv", "dq", "dk", "dv");
  const Device d = common_device({&dq, &dk, &dv, &dqkv});
  if (d.is_meta()) return meta_op({&dq, &dk, &dv, &dqkv}, false);
  if (d.is_cpu()) return cpu::merge_qkv(dq, dk, dv, dqkv);
  STRATA_CUDA_OP(d, merge_qkv, dq, dk, dv, dqkv);
}

void merge_heads(const Tensor& x, const Tensor& y) {
  check_heads_layout(x, y);
  const Device d = common_device({&x, &y});
  if (d.is_meta()) return meta_op({&x, &y}, false);
  if (d.is_cpu()) return cpu::merge_heads(x, y);
  STRATA_CUDA_OP(d, merge_heads, x, y);
}

void split_heads(const Tensor& y, const Tensor& x) {
  check_heads_layout(x, y);
  const Device d = common_device({&y, &x});
  if (d.is_meta()) return meta_op({&y, &x}, false);
  if (d.is_cpu()) return cpu::split_heads(y, x);
  STRATA_CUDA_OP(d, split_heads, y, x);
}

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& y, const Tensor& probs, float p,
                       const DropoutKey& key) {
  check_heads(q, {{&y, "y"}}, {{&k, "k"}, {&v, "v"}});
  check_probs(probs, q);
  check_attention_dropout(p, key, q);
  check_no_alias({&y, &probs}, {&q, &k, &v});
  const Device d = common_device({&q, &k, &v, &y, &probs});
  if (d.is_meta()) return meta_op({&q, &k, &v, &y, &probs}, true);
  if (d.is_cpu())
    return on_cpu(
        [&](F32Staging& s) { cpu::attention_forward(s.in(q), s.in(k), s.in(v), s.out(y), s.out(probs), p, key); });
  check_cuda_heads(d, q, k);
  STRATA_CUDA_OP(d, attention_forward, q, k, v, y, probs, p, key);
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& probs, const Tensor& dy,
                        const Tensor& dq, const Tensor& dk, const Tensor& dv, float p, const DropoutKey& key) {
  check_heads(q, {{&dy, "dy"}, {&dq, "dq"}}, {{&k, "k"}, {&v, "v"}, {&dk, "dk"}, {&dv, "dv"}});
  check_probs(probs, q);
  check_attention_dropout(p, key, q);
  check_no_alias({&dq, &dk, &dv}, {&q, &k, &v, &probs, &dy});
  const Device d = common_device({&q, &k, &v, &probs, &dy, &dq, &dk, &dv});
  if (d.is_meta()) return meta_op({&q, &k, &v, &probs, &dy, &dq, &dk, &dv}, true);
  if (d.is_cpu())
    return on_cpu([&](F32Staging& s) {
      cpu::attention_backward(s.in(q), s.in(k), s.in(v), s.in(probs), s.in(dy), s.out(dq), s.out(dk), s.out(dv), p,
                              key);
    });
  check_cuda_heads(d, q, k);
  STRATA_CUDA_OP(d, attention_backward, q, k, v, probs, dy, dq, dk, dv, p, key);
}

void flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& y, const Tensor& lse,
                             float p, const DropoutKey& key) {
  check_heads(q, {{&y, "y"}}, {{&k, "k"}, {&v, "v"}});
  check_lse(lse, q);
  check_attention_dropout(p, key, q);
  check_no_alias({&y, &lse}, {&q, &k, &v});
  const Device d = common_device({&q, &k, &v, &y, &lse});
  if (d.is_meta()) return meta_op({&q, &k, &v, &y, &lse}, false);
  // On the CPU: bf16 on the bf16 units where oneDNN has fast kernels for the tiles, else staged a
  // head at a time (cpu::flash_tiles_on_units).
  if (d.is_cpu()) return cpu::flash_attention_forward(q, k, v, y, lse, p, key);
  check_cuda_heads(d, q, k);
  STRATA_CUDA_OP(d, flash_attention_forward, q, k, v, y, lse, p, key);
}

void flash_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& y, const Tensor& lse,
                              const Tensor& dy, const Tensor& dq, const Tensor& dk, const Tensor& dv, float p,
                              const DropoutKey& key) {
  check_heads(q, {{&y, "y"}, {&dy, "dy"}, {&dq, "dq"}}, {{&k, "k"}, {&v, "v"}, {&dk, "dk"}, {&dv, "dv"}});
  check_lse(lse, q);
  check_attention_dropout(p, key, q);
  check_no_alias({&dq, &dk, &dv}, {&q, &k, &v, &y, &lse, &dy});
  const Device d = common_device({&q, &k, &v, &y, &lse, &dy, &dq, &dk, &dv});
  if (d.is_meta()) return meta_op({&q, &k, &v, &y, &lse, &dy, &dq, &dk, &dv}, false);
  if (d.is_cpu()) return cpu::flash_attention_backward(q, k, v, y, lse, dy, dq, dk, dv, p, key);  // as forward
  check_cuda_heads(d, q, k);
  STRATA_CUDA_OP(d, flash_attention_backward, q, k, v, y, lse, dy, dq, dk, dv, p, key);
}

}  // namespace strata::ops
