// The half-precision MPI types and sums, and the dtype -> MPI mapping (mpi_types.hpp).
#include "parallel/comm/mpi_types.hpp"

#include "core/error.hpp"
#include "parallel/runtime/mpi.hpp"

namespace strata::parallel {

namespace {

// The sum of two half arrays, in f32, rounded back once per pair.
template <class Half>
void half_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const Half* a = static_cast<const Half*>(in);
  Half* b = static_cast<Half*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = Half::from_float(a[i].to_float() + b[i].to_float());
}

struct HalfTypes {
  MPI_Datatype bf16 = MPI_DATATYPE_NULL, f16 = MPI_DATATYPE_NULL;
  MPI_Op bf16_sum = MPI_OP_NULL, f16_sum = MPI_OP_NULL;
};

// Frees the half types at MPI_Finalize. Trick: MPI_Finalize first deletes the attributes of
// MPI_COMM_SELF (MPI >= 2.2), which calls this while MPI handles may still be freed.
int free_half_types(MPI_Comm, int, void* attribute, void*) {
  auto* types = static_cast<HalfTypes*>(attribute);
  MPI_Op_free(&types->bf16_sum);
  MPI_Op_free(&types->f16_sum);
  MPI_Type_free(&types->bf16);
  MPI_Type_free(&types->f16);
  delete types;
  return MPI_SUCCESS;
}

// Created once, on the first use after MPI_Init (a function-local static: thread-safe).
const HalfTypes& half_types() {
  static const HalfTypes* types = [] {
    auto* t = new HalfTypes;
    MPI_CHECK(MPI_Type_contiguous(2, MPI_BYTE, &t->bf16));
    MPI_CHECK(MPI_Type_set_name(t->bf16, "strata_bf16"));
    MPI_CHECK(MPI_Type_commit(&t->bf16));
    MPI_CHECK(MPI_Type_contiguous(2, MPI_BYTE, &t->f16));
    MPI_CHECK(MPI_Type_set_name(t->f16, "strata_f16"));
    MPI_CHECK(MPI_Type_commit(&t->f16));
    MPI_CHECK(MPI_Op_create(&half_sum<bf16>, /*commute=*/1, &t->bf16_sum));
    MPI_CHECK(MPI_Op_create(&half_sum<f16>, /*commute=*/1, &t->f16_sum));
    int key = MPI_KEYVAL_INVALID;
    MPI_CHECK(MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &free_half_types, &key, nullptr));
    MPI_CHECK(MPI_Comm_set_attr(MPI_COMM_SELF, key, t));
    return t;
  }();
  return *types;
}

bool is_float(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }

template <class Half>
void scale_half(void* data, int64_t n, float factor) {
  Half* p = static_cast<Half*>(data);
  for (int64_t i = 0; i < n; ++i) p[i] = Half::from_float(p[i].to_float() * factor);
}

}  // namespace

void create_half_types() { half_types(); }

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::F32:
      return MPI_FLOAT;
    case DType::BF16:
      return half_types().bf16;
    case DType::F16:
      return half_types().f16;
    case DType::I32:
      return MPI_INT32_T;
    case DType::U8:
      return MPI_UINT8_T;
  }
  STRATA_THROW("unknown dtype ", static_cast<int>(t));
}

MPI_Op mpi_sum(DType t, ReduceOp op) {
  STRATA_CHECK(op == ReduceOp::Sum || is_float(t), "ReduceOp::Avg needs a float dtype, got ", dtype_name(t));
  if (t == DType::BF16) return half_types().bf16_sum;
  if (t == DType::F16) return half_types().f16_sum;
  return MPI_SUM;
}

void scale_host(void* data, DType dtype, int64_t n, float factor) {
  if (dtype == DType::F32) {
    float* p = static_cast<float*>(data);
    for (int64_t i = 0; i < n; ++i) p[i] *= factor;
  } else if (dtype == DType::BF16) {
    scale_half<bf16>(data, n, factor);
  } else if (dtype == DType::F16) {
    scale_half<f16>(data, n, factor);
  }
}

}  // namespace strata::parallel
