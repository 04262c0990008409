#include "kvring/control/request_validation.h"

#include <cmath>
#include <cstring>

#include <limits>

#include "gtest/gtest.h"

namespace kvring {
namespace {

v1::PutBlock GoodBlock() {
  v1::PutBlock b;
  b.mutable_block()->mutable_key()->set_hi(9);
  LayoutToProto(BlockLayout{16, 1, 2, 64, DType::kF16}, b.mutable_block()->mutable_layout());
  b.mutable_block()->set_payload_bytes(16 * 2 * 2 * 64 * 2);
  b.set_payload(std::string(16 * 2 * 2 * 64 * 2, 'a'));
  return b;
}

TEST(RequestValidationTest, AcceptsAWellFormedBlock) {
  BlockMeta m;
  ASSERT_TRUE(ValidatePutBlock(GoodBlock(), RequestLimits{}, false, &m).ok());
  EXPECT_EQ(m.payload_bytes, 8192u);
  EXPECT_EQ(m.layout.head_dim, 64u);
}

TEST(RequestValidationTest, QuantizedBlocksNeedCodesPlusScales) {
  v1::PutBlock b = GoodBlock();
  const BlockLayout l{16, 1, 2, 64, DType::kF16};
  const KvEncoding e{KvCodec::kInt8, ScaleMode::kPerHead};
  b.mutable_block()->set_encoding(e.Pack());
  BlockMeta m;
  EXPECT_FALSE(ValidatePutBlock(b, RequestLimits{}, false, &m).ok());
  b.mutable_block()->set_payload_bytes(static_cast<uint32_t>(EncodedBytes(l, e)));
  b.set_payload(std::string(EncodedBytes(l, e), 'q'));
  EXPECT_TRUE(ValidatePutBlock(b, RequestLimits{}, false, &m).ok());
  b.mutable_block()->set_encoding(0x99);
  EXPECT_FALSE(ValidatePutBlock(b, RequestLimits{}, false, &m).ok());
}

TEST(RequestValidationTest, ABlockByReferenceNamesASequenceAndCarriesNoBytes) {
  v1::PutBlock b;
  b.mutable_block()->mutable_key()->set_hi(9);
  LayoutToProto(BlockLayout{16, 1, 2, 64, DType::kF16}, b.mutable_block()->mutable_layout());
  b.set_by_reference(true);
  BlockMeta m;
  absl::Status s = ValidatePutBlock(b, RequestLimits{}, false, &m);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("belongs to a sequence"), std::string::npos) << s;
  b.mutable_sequence()->set_sequence_id("seq-1");
  b.mutable_sequence()->set_block_index(3);
  ASSERT_TRUE(ValidatePutBlock(b, RequestLimits{}, false, &m).ok());
  EXPECT_EQ(m.payload_bytes, 0u);
  EXPECT_EQ(m.layout.head_dim, 64u);
  for (int bad = 0; bad < 4; ++bad) {
    v1::PutBlock x = b;
    if (bad == 0) x.set_payload("bytes");
    if (bad == 1) x.mutable_block()->set_payload_bytes(8192);
    if (bad == 2) x.mutable_block()->set_checksum(7);
    if (bad == 3) x.set_pin(true);
    EXPECT_EQ(ValidatePutBlock(x, RequestLimits{}, false, &m).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  b.mutable_sequence()->set_sequence_id("");
  EXPECT_EQ(ValidatePutBlock(b, RequestLimits{}, false, &m).code(), absl::StatusCode::kInvalidArgument);
}

v1::AttendRequest GoodAttend() {
  v1::AttendRequest a;
  a.mutable_header()->set_version(1);
  a.set_num_rows(1);
  a.set_q_heads(8);
  a.set_head_dim(128);
  a.set_q_dtype(2);
  a.set_queries(std::string(8 * 128 * 2, 'q'));
  a.add_positions(10);
  v1::AttendSequence* s = a.add_sequences();
  s->set_sequence_id("seq-1");
  s->set_tokens(40);
  s->set_rows(1);
  v1::BlockRange* r = s->add_ranges();
  r->set_begin(0);
  r->set_end(3);
  return a;
}

TEST(RequestValidationTest, AttendShapesMustAgree) {
  const v1::AttendRequest a = GoodAttend();
  ASSERT_TRUE(ParseAttendRequest(a, RequestLimits{}).ok()) << ParseAttendRequest(a, RequestLimits{}).status();
  v1::AttendRequest b = a;
  b.add_positions(11);
  EXPECT_FALSE(ParseAttendRequest(b, RequestLimits{}).ok());
  b = a;
  b.mutable_sequences(0)->set_sequence_id("has/slash");
  EXPECT_FALSE(ParseAttendRequest(b, RequestLimits{}).ok());
  b = a;
  b.set_softmax_scale(std::numeric_limits<float>::infinity());
  EXPECT_FALSE(ParseAttendRequest(b, RequestLimits{}).ok());
  b = a;
  b.set_num_rows(100000);
  EXPECT_FALSE(ParseAttendRequest(b, RequestLimits{}).ok());
  b = a;
  b.set_positions(0, -1);
  EXPECT_FALSE(ParseAttendRequest(b, RequestLimits{}).ok());
  b = a;
  b.set_queries("short");
  EXPECT_NE(ParseAttendRequest(b, RequestLimits{}).status().message().find("queries have 5 bytes"), std::string::npos);
  // What the appends' completed blocks are stored as: an encoding's name, or
  // nothing (the tenant's).
  b = a;
  b.set_quantize("int8/kivi");
  absl::StatusOr<AttendBatch> q = ParseAttendRequest(b, RequestLimits{});
  ASSERT_TRUE(q.ok()) << q.status();
  ASSERT_TRUE(q->quantize.has_value());
  EXPECT_TRUE((*q->quantize == KvEncoding{KvCodec::kInt8, ScaleMode::kKChannelVToken}));
  b.set_quantize("none");
  q = ParseAttendRequest(b, RequestLimits{});
  ASSERT_TRUE(q.ok() && q->quantize.has_value());
  EXPECT_FALSE(q->quantize->quantized());
  EXPECT_FALSE(ParseAttendRequest(a, RequestLimits{})->quantize.has_value());
  for (const std::string& bad : {std::string("int4"), std::string(100, 'x')}) {
    b.set_quantize(bad);
    const absl::Status st = ParseAttendRequest(b, RequestLimits{}).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find("quantize"), std::string::npos) << st;
  }
}

TEST(RequestValidationTest, AttendRangesMustBeSortedDisjointAndNonEmpty) {
  v1::AttendRequest a = GoodAttend();
  v1::BlockRange* r = a.mutable_sequences(0)->add_ranges();
  r->set_begin(2);  // overlaps [0, 3)
  r->set_end(4);
  auto s = ParseAttendRequest(a, RequestLimits{});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("overlaps"), std::string::npos) << s.status();
  r->set_begin(5);
  r->set_end(5);  // empty
  EXPECT_NE(ParseAttendRequest(a, RequestLimits{}).status().message().find("is empty"), std::string::npos);
  // A sequence named twice in one batch.
  a = GoodAttend();
  *a.add_sequences() = a.sequences(0);
  a.set_num_rows(2);
  a.add_positions(3);
  a.set_queries(std::string(2 * 8 * 128 * 2, 'q'));
  EXPECT_NE(ParseAttendRequest(a, RequestLimits{}).status().message().find("named twice"), std::string::npos);
  // Rows must add up, and rows need blocks.
  a = GoodAttend();
  a.mutable_sequences(0)->clear_ranges();
  EXPECT_NE(ParseAttendRequest(a, RequestLimits{}).status().message().find("no blocks"), std::string::npos);
  // Huge ranges are bounded before anything is allocated.
  a = GoodAttend();
  a.mutable_sequences(0)->mutable_ranges(0)->set_end(~0ull);
  EXPECT_FALSE(ParseAttendRequest(a, RequestLimits{}).ok());
}

TEST(RequestValidationTest, AppendsNeedTheLayoutAndMatchingKv) {
  v1::AttendRequest a = GoodAttend();
  v1::AttendSequence* s = a.mutable_sequences(0);
  s->set_append_position(39);
  s->set_append_tokens(1);
  EXPECT_NE(ParseAttendRequest(a, RequestLimits{}).status().message().find("needs the request's layout"),
            std::string::npos);
  v1::Layout* l = a.mutable_layout();
  l->set_block_tokens(16);
  l->set_layers(2);
  l->set_kv_heads(2);
  l->set_head_dim(128);
  l->set_dtype(2);
  EXPECT_NE(ParseAttendRequest(a, RequestLimits{}).status().message().find("new_k / new_v have 0 / 0"),
            std::string::npos);
  a.set_new_k(std::string(2 * 128 * 2, 'k'));
  a.set_new_v(std::string(2 * 128 * 2, 'v'));
  ASSERT_TRUE(ParseAttendRequest(a, RequestLimits{}).ok()) << ParseAttendRequest(a, RequestLimits{}).status();
  // Beyond the sequence's tokens.
  s->set_append_position(40);
  EXPECT_NE(ParseAttendRequest(a, RequestLimits{}).status().message().find("beyond the sequence"), std::string::npos);
  // The same through an external payload (UCX): one buffer, cut by the sizes.
  s->set_append_position(39);
  std::string payload = a.queries() + a.new_k() + a.new_v();
  a.clear_queries();
  a.clear_new_k();
  a.clear_new_v();
  auto b = ParseAttendRequest(a, RequestLimits{},
                              absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(payload.data()), payload.size()));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->new_k.size(), 2u * 128 * 2);
  EXPECT_EQ(b->new_v.data(), b->new_k.data() + b->new_k.size());
  EXPECT_FALSE(
      ParseAttendRequest(a, RequestLimits{},
                         absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(payload.data()), payload.size() - 1))
          .ok());
}

// A NaN or an infinity in appended K/V would poison every later step of
// the sequence (NaN K: O = 0; Inf V: O = inf): refused, naming the sequence
// and token, unless the daemon turned the check off.
TEST(RequestValidationTest, NonFiniteAppendedKvIsRefused) {
  v1::AttendRequest a = GoodAttend();
  v1::AttendSequence* s = a.mutable_sequences(0);
  s->set_append_position(38);
  s->set_append_tokens(2);
  s->set_tokens(40);
  v1::Layout* l = a.mutable_layout();
  l->set_block_tokens(16);
  l->set_layers(2);
  l->set_kv_heads(2);
  l->set_head_dim(128);
  l->set_dtype(2);  // bf16
  std::string k(2 * 2 * 128 * 2, '\0'), v(2 * 2 * 128 * 2, '\0');
  a.set_new_k(k);
  a.set_new_v(v);
  ASSERT_TRUE(ParseAttendRequest(a, RequestLimits{}).ok());
  // bf16 infinity (0x7f80) in V of the second appended token (element 300).
  v[2 * 300] = static_cast<char>(0x80);
  v[2 * 300 + 1] = static_cast<char>(0x7f);
  a.set_new_v(v);
  absl::Status st = ParseAttendRequest(a, RequestLimits{}).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("appended V of sequence 'seq-1' token 39 holds NaN or Inf"), std::string::npos) << st;
  // bf16 NaN (0xffc0) in K of the first.
  a.set_new_v(std::string(v.size(), '\0'));
  k[2 * 5] = static_cast<char>(0xc0);
  k[2 * 5 + 1] = static_cast<char>(0xff);
  a.set_new_k(k);
  st = ParseAttendRequest(a, RequestLimits{}).status();
  EXPECT_NE(st.message().find("appended K of sequence 'seq-1' token 38"), std::string::npos) << st;
  RequestLimits off;
  off.finite_appends = false;
  EXPECT_TRUE(ParseAttendRequest(a, off).ok());
  // f32 and f16 spellings of NaN and Inf; the largest finite values pass.
  const float f32[] = {1.f, 3.4e38f, std::numeric_limits<float>::infinity()};
  EXPECT_EQ(FirstNonFinite(absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(f32), sizeof(f32)), DType::kF32), 2);
  const float nan32 = std::nanf("");
  EXPECT_EQ(FirstNonFinite(absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(&nan32), 4), DType::kF32), 0);
  const uint16_t f16[] = {0x7bff /* 65504 */, 0x7e00 /* NaN */};
  EXPECT_EQ(FirstNonFinite(absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(f16), 4), DType::kF16), 1);
  const uint16_t bf16[] = {0x7f7f /* largest finite */, 0x3f80};
  EXPECT_EQ(FirstNonFinite(absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(bf16), 4), DType::kBF16), -1);
}

// The word-at-a-time scan finds the first Inf or NaN at every position and
// length (whole words and the tail), and passes the largest finite values.
TEST(RequestValidationTest, FirstNonFiniteFindsEveryPosition) {
  struct Kind {
    DType dtype;
    size_t esz;
    uint32_t big_finite, neg_big_finite, inf, nan;
  };
  for (const Kind& k :
       {Kind{DType::kBF16, 2, 0x7f7f, 0xff7f, 0x7f80, 0xffc1}, Kind{DType::kF16, 2, 0x7bff, 0xfbff, 0x7c00, 0x7e01},
        Kind{DType::kF32, 4, 0x7f7fffff, 0xff7fffff, 0x7f800000, 0xffc00001}}) {
    for (size_t n = 1; n <= 23; ++n) {
      std::vector<uint8_t> v(n * k.esz);
      for (size_t i = 0; i < n; ++i) {
        const uint32_t x = i % 2 ? k.big_finite : k.neg_big_finite;
        std::memcpy(v.data() + i * k.esz, &x, k.esz);
      }
      EXPECT_EQ(FirstNonFinite(v, k.dtype), -1) << "n=" << n;
      for (size_t at = 0; at < n; ++at) {
        std::vector<uint8_t> w = v;
        std::memcpy(w.data() + at * k.esz, at % 2 ? &k.inf : &k.nan, k.esz);
        EXPECT_EQ(FirstNonFinite(w, k.dtype), static_cast<int64_t>(at)) << "n=" << n << " at=" << at;
      }
    }
  }
}

TEST(RequestValidationTest, KeyListsAreBoundedAndNonZero) {
  google::protobuf::RepeatedPtrField<v1::Key> keys;
  keys.Add()->set_lo(1);
  RequestLimits lim;
  lim.max_keys = 2;
  EXPECT_TRUE(ValidateKeys(keys, lim).ok());
  keys.Add();
  EXPECT_FALSE(ValidateKeys(keys, lim).ok());  // zero key
  keys.Mutable(1)->set_hi(3);
  keys.Add()->set_lo(4);
  EXPECT_FALSE(ValidateKeys(keys, lim).ok());  // over the limit
}

}  // namespace
}  // namespace kvring
