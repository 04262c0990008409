#include "kvring/control/request_validation.h"

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

TEST(RequestValidationTest, AttendShapesMustAgree) {
  v1::AttendRequest a;
  a.mutable_header()->set_version(1);
  a.set_sequence_id("seq-1");
  a.set_num_rows(1);
  a.set_q_heads(8);
  a.set_head_dim(128);
  a.set_q_dtype(2);
  a.set_queries(std::string(8 * 128 * 2, 'q'));
  a.add_positions(10);
  EXPECT_TRUE(ValidateAttendRequest(a, RequestLimits{}).ok());
  v1::AttendRequest b = a;
  b.add_positions(11);
  EXPECT_FALSE(ValidateAttendRequest(b, RequestLimits{}).ok());
  b = a;
  b.set_sequence_id("has/slash");
  EXPECT_FALSE(ValidateAttendRequest(b, RequestLimits{}).ok());
  b = a;
  b.set_softmax_scale(std::numeric_limits<float>::infinity());
  EXPECT_FALSE(ValidateAttendRequest(b, RequestLimits{}).ok());
  b = a;
  b.set_num_rows(100000);
  EXPECT_FALSE(ValidateAttendRequest(b, RequestLimits{}).ok());
  b = a;
  b.set_positions(0, -1);
  EXPECT_FALSE(ValidateAttendRequest(b, RequestLimits{}).ok());
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
