#include "kvring/attention/step/step_shape.h"

#include <cmath>

#include "gtest/gtest.h"

namespace kvring {
namespace {

StepShape Llama(uint32_t rows) {
  StepShape s;
  s.num_rows = rows;
  s.q_heads = 32;
  s.head_dim = 128;
  s.q_dtype = DType::kBF16;
  s.options.layer = 3;
  s.options.softmax_scale = 0.088f;
  return s;
}

TEST(StepShapeTest, SizesAreTheRowsTimesOneRow) {
  const StepShape s = Llama(5);
  EXPECT_EQ(s.row_elems(), 32u * 128);
  EXPECT_EQ(s.query_row_bytes(), 32u * 128 * 2);
  EXPECT_EQ(s.partial_row_bytes(), (32u * 128 + 32) * 4);
  EXPECT_EQ(s.query_bytes(), 5u * 32 * 128 * 2);
  EXPECT_EQ(s.out_floats(), 5u * 32 * 128);
  EXPECT_EQ(s.lse_floats(), 5u * 32);
  StepShape f = s;
  f.q_dtype = DType::kF32;
  EXPECT_EQ(f.query_bytes(), 5u * 32 * 128 * 4);
  BlockLayout L{16, 32, 8, 128, DType::kBF16};
  EXPECT_EQ(L.kv_row_bytes(), 8u * 128 * 2);
}

TEST(StepShapeTest, EachRuleIsCheckedAndNamed) {
  const BlockLayout L{16, 32, 8, 128, DType::kBF16};
  EXPECT_TRUE(CheckStepShape(Llama(1), nullptr).ok());
  EXPECT_TRUE(CheckStepShape(Llama(1), &L).ok());
  struct Case {
    const char* what;
    void (*bend)(StepShape&);
    const char* message;
  };
  const Case cases[] = {
      {"no heads", [](StepShape& s) { s.q_heads = 0; }, "q_heads must be in [1, 1024]"},
      {"too many heads", [](StepShape& s) { s.q_heads = 1025; }, "q_heads must be in [1, 1024]"},
      {"head_dim 0", [](StepShape& s) { s.head_dim = 0; }, "head_dim must be a multiple of 8"},
      {"head_dim 100", [](StepShape& s) { s.head_dim = 100; }, "head_dim must be a multiple of 8"},
      {"head_dim 520", [](StepShape& s) { s.head_dim = 520; }, "head_dim must be a multiple of 8"},
      {"int8 queries", [](StepShape& s) { s.q_dtype = DType::kINT8; }, "queries must be f32, f16 or bf16"},
      {"layer 256", [](StepShape& s) { s.options.layer = kMaxLayers; }, "layer 256 out of range"},
      {"negative window", [](StepShape& s) { s.options.window = -1; }, "window must be >= 0"},
      {"NaN scale", [](StepShape& s) { s.options.softmax_scale = std::nanf(""); }, "softmax_scale must be finite"},
      {"negative scale", [](StepShape& s) { s.options.softmax_scale = -1; }, "softmax_scale must be finite"},
  };
  for (const Case& c : cases) {
    StepShape s = Llama(1);
    c.bend(s);
    for (const BlockLayout* l : {static_cast<const BlockLayout*>(nullptr), &L}) {
      const absl::Status st = CheckStepShape(s, l);
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.what;
      EXPECT_NE(st.message().find(c.message), absl::string_view::npos) << c.what << ": " << st.message();
    }
  }
  // Against the layout only.
  const Case layout_cases[] = {
      {"head_dim 64", [](StepShape& s) { s.head_dim = 64; }, "query head_dim 64 but the layout's is 128"},
      {"12 heads over 8", [](StepShape& s) { s.q_heads = 12; }, "q_heads 12 is not a multiple of kv_heads 8"},
      {"layer 32", [](StepShape& s) { s.options.layer = 32; }, "layer 32 but the layout has 32 layers"},
  };
  for (const Case& c : layout_cases) {
    StepShape s = Llama(1);
    c.bend(s);
    EXPECT_TRUE(CheckStepShape(s, nullptr).ok()) << c.what;
    const absl::Status st = CheckStepShape(s, &L);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_NE(st.message().find(c.message), absl::string_view::npos) << c.what << ": " << st.message();
  }
}

}  // namespace
}  // namespace kvring
