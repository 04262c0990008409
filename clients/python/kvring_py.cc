// kvring._kvring: the Python binding of kvring::Client (pybind11 + numpy).
//
// Keys are numpy uint64 arrays of shape (n, 2) holding (lo, hi). Blocks are
// any C-contiguous buffer (numpy array, bytes, memoryview) whose size is a
// whole number of blocks of the given Layout; get_into() writes straight
// into a caller's array (over UCX the bytes land there without a copy), and
// quantized blocks come back dequantized to the layout's dtype. Every error
// status raises a kvring.Error subclass named after its code
// (kvring.NotFoundError, kvring.InvalidArgumentError, ...), with .code and
// the status message. Network calls release the GIL; one Client may be used
// from many Python threads.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "kvring.grpc.pb.h"
#include "kvring/attention/merge.h"
#include "kvring/cache/quantize.h"
#include "kvring/client/client.h"
#include "kvring/protocol/tls.h"

namespace py = pybind11;

namespace kvring {
namespace {

constexpr const char* kModule = "kvring._kvring";

const char* ErrorClassName(absl::StatusCode c) {
  switch (c) {
    case absl::StatusCode::kInvalidArgument: return "InvalidArgumentError";
    case absl::StatusCode::kNotFound: return "NotFoundError";
    case absl::StatusCode::kAlreadyExists: return "AlreadyExistsError";
    case absl::StatusCode::kPermissionDenied: return "PermissionDeniedError";
    case absl::StatusCode::kUnauthenticated: return "UnauthenticatedError";
    case absl::StatusCode::kResourceExhausted: return "ResourceExhaustedError";
    case absl::StatusCode::kFailedPrecondition: return "FailedPreconditionError";
    case absl::StatusCode::kUnavailable: return "UnavailableError";
    case absl::StatusCode::kDeadlineExceeded: return "DeadlineExceededError";
    case absl::StatusCode::kDataLoss: return "DataLossError";
    default: return "Error";
  }
}

[[noreturn]] void Raise(const absl::Status& s) {
  py::object cls = py::module_::import(kModule).attr(ErrorClassName(s.code()));
  py::object exc = cls(std::string(s.message()));
  exc.attr("code") = absl::StatusCodeToString(s.code());
  PyErr_SetObject(cls.ptr(), exc.ptr());
  throw py::error_already_set();
}

void Check(const absl::Status& s) {
  if (!s.ok()) Raise(s);
}

template <typename T>
T Value(absl::StatusOr<T> v) {
  if (!v.ok()) Raise(v.status());
  return std::move(*v);
}

DType ParseDType(const std::string& s) {
  if (s == "bf16" || s == "bfloat16") return DType::kBF16;
  if (s == "f16" || s == "float16" || s == "fp16") return DType::kF16;
  if (s == "f32" || s == "float32" || s == "fp32") return DType::kF32;
  Raise(absl::InvalidArgumentError(absl::StrCat("dtype '", s, "': expected bf16, f16 or f32")));
}

BlockLayout MakeLayout(uint32_t block_tokens, uint32_t layers, uint32_t kv_heads, uint32_t head_dim,
                       const std::string& dtype) {
  BlockLayout l{block_tokens, layers, kv_heads, head_dim, ParseDType(dtype)};
  const char* why = nullptr;
  if (!l.IsValid(&why)) Raise(absl::InvalidArgumentError(absl::StrCat("layout: ", why)));
  return l;
}

// numpy dtype of a layout's elements (bf16 has none: uint16 bit patterns).
py::dtype NumpyDType(const BlockLayout& l) {
  switch (l.dtype) {
    case DType::kF32: return py::dtype::of<float>();
    case DType::kF16: return py::dtype("float16");
    default: return py::dtype::of<uint16_t>();
  }
}

std::vector<BlockKey> KeysFrom(const py::array_t<uint64_t, py::array::c_style | py::array::forcecast>& a) {
  if (a.ndim() != 2 || a.shape(1) != 2) {
    Raise(absl::InvalidArgumentError("keys must be a uint64 array of shape (n, 2) holding (lo, hi)"));
  }
  std::vector<BlockKey> keys(a.shape(0));
  const uint64_t* p = a.data();
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = BlockKey{p[2 * i], p[2 * i + 1]};
  return keys;
}

py::array_t<uint64_t> KeysTo(const std::vector<BlockKey>& keys) {
  py::array_t<uint64_t> a({static_cast<py::ssize_t>(keys.size()), py::ssize_t{2}});
  uint64_t* p = a.mutable_data();
  for (size_t i = 0; i < keys.size(); ++i) {
    p[2 * i] = keys[i].lo;
    p[2 * i + 1] = keys[i].hi;
  }
  return a;
}

// A read-only contiguous view of a buffer holding n blocks of `layout`.
struct BlockBytes {
  py::buffer_info info;
  const uint8_t* data = nullptr;
};

BlockBytes BlocksFrom(const py::buffer& b, size_t n, const BlockLayout& layout) {
  BlockBytes out{b.request()};
  const py::buffer_info& i = out.info;
  py::ssize_t expect = i.itemsize;
  for (py::ssize_t d = i.ndim - 1; d >= 0; --d) {
    if (i.shape[d] != 1 && i.strides[d] != expect) Raise(absl::InvalidArgumentError("blocks must be a C-contiguous buffer"));
    expect *= i.shape[d];
  }
  const uint64_t bytes = static_cast<uint64_t>(i.size) * i.itemsize;
  if (bytes != n * layout.bytes()) {
    Raise(absl::InvalidArgumentError(absl::StrCat("blocks hold ", bytes, " bytes; ", n, " blocks of this layout need ",
                                                  n * layout.bytes())));
  }
  out.data = static_cast<const uint8_t*>(i.ptr);
  return out;
}

std::vector<BlockData> BlockList(const std::vector<BlockKey>& keys, const BlockBytes& bytes, const BlockLayout& layout,
                                 const BlockKey& parent, bool pin) {
  std::vector<BlockData> blocks;
  blocks.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    blocks.push_back(BlockData{keys[i], i ? keys[i - 1] : parent, layout, KvEncoding{},
                               absl::MakeConstSpan(bytes.data + i * layout.bytes(), layout.bytes()), pin});
  }
  return blocks;
}

BlockKey ParentFrom(const py::object& parent) {
  if (parent.is_none()) return BlockKey{};
  auto k = KeysFrom(parent.cast<py::array_t<uint64_t, py::array::c_style | py::array::forcecast>>().reshape({1, 2}));
  return k[0];
}

py::dict ReportDict(const PutReport& r) {
  py::dict d;
  d["blocks"] = r.blocks;
  d["inserted"] = r.inserted;
  d["replicas_written"] = r.replicas_written;
  d["bytes"] = r.bytes;
  return d;
}

class PyClient {
 public:
  PyClient(const std::string& coordinator, const std::string& token, const std::string& ns, bool use_ucx,
           const std::string& quantize, double rpc_timeout_s, const std::string& tls_ca, const std::string& tls_cert,
           const std::string& tls_key) {
    ClientOptions o;
    o.tls = TlsConfig{tls_cert, tls_key, tls_ca, false};
    o.coordinator = coordinator;
    o.token = token;
    o.ns = ns;
    o.use_ucx = use_ucx;
    o.quantize = quantize;
    o.rpc_timeout = absl::Seconds(rpc_timeout_s);
    absl::StatusOr<std::unique_ptr<Client>> c;
    {
      py::gil_scoped_release nogil;
      c = Client::Connect(o);
    }
    c_ = Value(std::move(c));
  }

  std::string tenant() const { return c_->tenant_name(); }
  std::string ns() const { return c_->namespace_name(); }
  uint64_t map_version() const { return c_->map_version(); }

  py::array_t<uint64_t> Chain(const std::string& model, const BlockLayout& layout,
                              const py::array_t<uint32_t, py::array::c_style | py::array::forcecast>& tokens,
                              const py::object& parent) {
    if (tokens.ndim() != 1) Raise(absl::InvalidArgumentError("tokens must be a 1-D array of token ids"));
    BlockKeyHasher h = c_->Hasher(model, layout);
    const BlockKey p = parent.is_none() ? h.Root() : ParentFrom(parent);
    return KeysTo(h.ChainFrom(p, absl::MakeConstSpan(tokens.data(), tokens.size())));
  }

  size_t Lookup(const py::array_t<uint64_t, py::array::c_style | py::array::forcecast>& keys) {
    const auto k = KeysFrom(keys);
    py::gil_scoped_release nogil;
    auto r = c_->LookupPrefix(k);
    py::gil_scoped_acquire gil;
    return Value(std::move(r));
  }

  py::dict Put(const py::array_t<uint64_t, py::array::c_style | py::array::forcecast>& keys, const py::buffer& blocks,
               const BlockLayout& layout, const py::object& parent, bool pin) {
    const auto k = KeysFrom(keys);
    const BlockBytes bytes = BlocksFrom(blocks, k.size(), layout);
    const auto list = BlockList(k, bytes, layout, ParentFrom(parent), pin);
    absl::StatusOr<PutReport> r;
    {
      py::gil_scoped_release nogil;
      r = c_->Put(list);
    }
    return ReportDict(Value(std::move(r)));
  }

  py::dict PutSequence(const std::string& sequence_id, uint64_t first_block,
                       const py::array_t<uint64_t, py::array::c_style | py::array::forcecast>& keys,
                       const py::buffer& blocks, const BlockLayout& layout, const py::object& parent) {
    const auto k = KeysFrom(keys);
    const BlockBytes bytes = BlocksFrom(blocks, k.size(), layout);
    const auto list = BlockList(k, bytes, layout, ParentFrom(parent), false);
    absl::StatusOr<PutReport> r;
    {
      py::gil_scoped_release nogil;
      r = c_->PutSequence(sequence_id, first_block, list);
    }
    return ReportDict(Value(std::move(r)));
  }

  // Reads blocks into `out` (C-contiguous, writable, n * layout.bytes()
  // bytes). Returns a bool array: found[i]. Errors other than NOT_FOUND raise.
  py::array_t<bool> GetInto(const py::array_t<uint64_t, py::array::c_style | py::array::forcecast>& keys,
                            const BlockLayout& layout, py::buffer out) {
    const auto k = KeysFrom(keys);
    py::buffer_info info = out.request(/*writable=*/true);
    if (info.readonly) Raise(absl::InvalidArgumentError("out must be writable"));
    BlockBytes view = BlocksFrom(out, k.size(), layout);
    uint8_t* base = const_cast<uint8_t*>(view.data);
    std::vector<absl::Span<uint8_t>> dsts;
    for (size_t i = 0; i < k.size(); ++i) dsts.push_back(absl::MakeSpan(base + i * layout.bytes(), layout.bytes()));
    std::vector<GetResult> res;
    {
      py::gil_scoped_release nogil;
      res = c_->GetInto(k, dsts);
    }
    py::array_t<bool> found(static_cast<py::ssize_t>(k.size()));
    bool* f = found.mutable_data();
    std::vector<uint8_t> plain;
    for (size_t i = 0; i < res.size(); ++i) {
      f[i] = res[i].status.ok();
      if (!res[i].status.ok()) {
        if (res[i].status.code() != absl::StatusCode::kNotFound) Raise(res[i].status);
        continue;
      }
      if (!(res[i].meta.layout == layout)) {
        Raise(absl::FailedPreconditionError(absl::StrCat("block ", i, " was stored with a different layout")));
      }
      if (res[i].meta.encoding.quantized()) {  // codes in place: dequantize to the layout's dtype
        const auto codes = absl::MakeConstSpan(dsts[i].data(), res[i].meta.payload_bytes);
        std::vector<uint8_t> copy(codes.begin(), codes.end());
        Check(DequantizeBlock(layout, res[i].meta.encoding, copy, &plain));
        std::memcpy(dsts[i].data(), plain.data(), plain.size());
      }
    }
    return found;
  }

  // All blocks, as an array of shape (n, layers, 2, kv_heads, block_tokens,
  // head_dim); a missing block raises NotFoundError.
  py::array Get(const py::array_t<uint64_t, py::array::c_style | py::array::forcecast>& keys, const BlockLayout& layout) {
    const auto k = KeysFrom(keys);
    py::array out(NumpyDType(layout), std::vector<py::ssize_t>{static_cast<py::ssize_t>(k.size()), layout.layers, 2,
                                                               layout.kv_heads, layout.block_tokens, layout.head_dim});
    py::array_t<bool> found = GetInto(keys, layout, out);
    for (size_t i = 0; i < k.size(); ++i) {
      if (!found.data()[i]) Raise(absl::NotFoundError(absl::StrCat("block ", i, " (", k[i].ToHex(), ") is not held")));
    }
    return out;
  }

  void Pin(const py::array_t<uint64_t, py::array::c_style | py::array::forcecast>& keys, bool unpin) {
    const auto k = KeysFrom(keys);
    absl::Status s;
    {
      py::gil_scoped_release nogil;
      s = c_->Pin(k, unpin);
    }
    Check(s);
  }

  // (out [rows, q_heads, head_dim] f32, lse [rows, q_heads] f32) of q over
  // the first num_tokens tokens of the sequence; with report=True also a dict
  // of what it took (shards, blocks, bytes sent and received, seconds).
  py::object Attend(const std::string& sequence_id, const BlockLayout& layout, uint64_t num_tokens, const py::array& q,
                    const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& positions, uint32_t layer,
                    bool causal, float softmax_scale, int64_t window, bool report) {
    if (q.ndim() != 3) Raise(absl::InvalidArgumentError("q must have shape (rows, q_heads, head_dim)"));
    py::array qc;
    DType dt;
    if (q.dtype().is(py::dtype("float16"))) {
      qc = py::array_t<uint16_t, py::array::c_style | py::array::forcecast>(q.attr("view")("uint16"));
      dt = DType::kF16;
    } else {
      qc = py::array_t<float, py::array::c_style | py::array::forcecast>(q);
      dt = DType::kF32;
    }
    const uint32_t rows = static_cast<uint32_t>(q.shape(0)), heads = static_cast<uint32_t>(q.shape(1)),
                   dim = static_cast<uint32_t>(q.shape(2));
    if (positions.ndim() != 1 || positions.shape(0) != q.shape(0)) {
      Raise(absl::InvalidArgumentError("positions must be a 1-D int64 array with one entry per query row"));
    }
    QueryTensor qt{qc.data(), dt, rows, heads, dim, positions.data(), nullptr};
    AttentionOptions o;
    o.layer = layer;
    o.causal = causal;
    o.softmax_scale = softmax_scale;
    o.window = window;
    AttendReport rep;
    absl::StatusOr<PartialResult> r;
    {
      py::gil_scoped_release nogil;
      r = c_->Attend(sequence_id, layout, num_tokens, qt, o, &rep);
    }
    PartialResult p = Value(std::move(r));
    py::array_t<float> out({rows, heads, dim});
    py::array_t<float> lse({rows, heads});
    std::memcpy(out.mutable_data(), p.out.data(), p.out.size() * sizeof(float));
    std::memcpy(lse.mutable_data(), p.lse.data(), p.lse.size() * sizeof(float));
    if (!report) return py::make_tuple(out, lse);
    py::dict d;
    d["shards"] = rep.shards;
    d["blocks"] = rep.blocks;
    d["bytes_sent"] = rep.bytes_sent;
    d["bytes_received"] = rep.bytes_received;
    d["retries"] = rep.retries;
    d["seconds"] = rep.seconds;
    return py::make_tuple(out, lse, d);
  }

  py::list Stats() {
    std::vector<NodeStats> st;
    {
      py::gil_scoped_release nogil;
      st = c_->Stats();
    }
    py::list l;
    for (const NodeStats& s : st) {
      py::dict d;
      d["node_id"] = s.node_id;
      d["address"] = s.address;
      d["state"] = s.state;
      d["ok"] = s.status.ok();
      d["error"] = std::string(s.status.message());
      d["blocks"] = s.blocks;
      d["host_blocks"] = s.host_blocks;
      d["cold_blocks"] = s.cold_blocks;
      d["pinned_blocks"] = s.pinned_blocks;
      d["free_pages"] = s.free_pages;
      d["num_pages"] = s.num_pages;
      d["puts"] = s.puts;
      d["hits"] = s.hits;
      d["misses"] = s.misses;
      d["evictions"] = s.evictions;
      d["sequences"] = s.sequences;
      l.append(d);
    }
    return l;
  }

 private:
  std::unique_ptr<Client> c_;
};

// Exact merge of attention partials: lists of out [rows, heads, dim] and
// lse [rows, heads] (float32) -> (out, lse).
py::tuple Merge(const std::vector<py::array_t<float, py::array::c_style | py::array::forcecast>>& outs,
                const std::vector<py::array_t<float, py::array::c_style | py::array::forcecast>>& lses) {
  if (outs.empty() || outs.size() != lses.size()) Raise(absl::InvalidArgumentError("merge needs as many lse as out arrays (at least one)"));
  if (outs[0].ndim() != 3) Raise(absl::InvalidArgumentError("out arrays must have shape (rows, heads, dim)"));
  const uint32_t rows = outs[0].shape(0), heads = outs[0].shape(1), dim = outs[0].shape(2);
  std::vector<ConstPartial> in;
  for (size_t i = 0; i < outs.size(); ++i) {
    if (outs[i].ndim() != 3 || outs[i].shape(0) != rows || outs[i].shape(1) != heads || outs[i].shape(2) != dim ||
        lses[i].ndim() != 2 || lses[i].shape(0) != rows || lses[i].shape(1) != heads) {
      Raise(absl::InvalidArgumentError(absl::StrCat("partial ", i, " does not have the shape of partial 0")));
    }
    in.push_back(ConstPartial{outs[i].data(), lses[i].data()});
  }
  py::array_t<float> out({rows, heads, dim});
  py::array_t<float> lse({rows, heads});
  Check(MergePartials(in, rows, heads, dim, PartialOutput{out.mutable_data(), lse.mutable_data()}));
  return py::make_tuple(out, lse);
}

// Admin: creates a tenant; returns its token (shown once).
std::string CreateTenant(const std::string& coordinator, const std::string& admin_token, const std::string& name,
                         const std::vector<std::string>& shared, uint64_t max_pinned_bytes, const std::string& kv_encoding,
                         const std::string& tls_ca) {
  auto stub = v1::Coordinator::NewStub(grpc::CreateChannel(coordinator, Value(MakeChannelCredentials(TlsConfig{"", "", tls_ca, false}))));
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer " + admin_token);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::CreateTenantRequest req;
  req.set_version(1);
  req.set_name(name);
  req.set_max_pinned_bytes(max_pinned_bytes);
  req.set_kv_encoding(kv_encoding);
  for (const auto& s : shared) req.add_shared_namespaces(s);
  v1::CreateTenantResponse resp;
  grpc::Status s;
  {
    py::gil_scoped_release nogil;
    s = stub->CreateTenant(&ctx, req, &resp);
  }
  if (!s.ok()) Raise(absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message()));
  return resp.token();
}

}  // namespace
}  // namespace kvring

PYBIND11_MODULE(_kvring, m) {
  using namespace kvring;
  m.doc() = "kvring: the Python client of a kvring KV-cache cluster";
  py::object base = py::reinterpret_steal<py::object>(PyErr_NewException("kvring._kvring.Error", PyExc_RuntimeError, nullptr));
  m.attr("Error") = base;
  for (const char* name : {"InvalidArgumentError", "NotFoundError", "AlreadyExistsError", "PermissionDeniedError",
                           "UnauthenticatedError", "ResourceExhaustedError", "FailedPreconditionError",
                           "UnavailableError", "DeadlineExceededError", "DataLossError"}) {
    const std::string full = std::string("kvring._kvring.") + name;
    m.attr(name) = py::reinterpret_steal<py::object>(PyErr_NewException(full.c_str(), base.ptr(), nullptr));
  }

  py::class_<BlockLayout>(m, "Layout", "Shape of one KV block: block_tokens x layers x (K, V) x kv_heads x head_dim.")
      .def(py::init(&MakeLayout), py::arg("block_tokens") = 16, py::arg("layers") = 1, py::arg("kv_heads") = 8,
           py::arg("head_dim") = 128, py::arg("dtype") = "bf16")
      .def_readonly("block_tokens", &BlockLayout::block_tokens)
      .def_readonly("layers", &BlockLayout::layers)
      .def_readonly("kv_heads", &BlockLayout::kv_heads)
      .def_readonly("head_dim", &BlockLayout::head_dim)
      .def_property_readonly("dtype", [](const BlockLayout& l) { return std::string(DTypeName(l.dtype)); })
      .def_property_readonly("bytes", &BlockLayout::bytes)
      .def_property_readonly("numpy_dtype", &NumpyDType)
      .def_property_readonly("block_shape",
                             [](const BlockLayout& l) { return py::make_tuple(l.layers, 2, l.kv_heads, l.block_tokens, l.head_dim); })
      .def("__repr__", [](const BlockLayout& l) {
        return absl::StrCat("Layout(block_tokens=", l.block_tokens, ", layers=", l.layers, ", kv_heads=", l.kv_heads,
                            ", head_dim=", l.head_dim, ", dtype='", DTypeName(l.dtype), "')");
      });

  py::class_<PyClient>(m, "Client", "A connection to a kvring cluster (thread-safe).")
      .def(py::init<const std::string&, const std::string&, const std::string&, bool, const std::string&, double,
                    const std::string&, const std::string&, const std::string&>(),
           py::arg("coordinator"), py::arg("token"), py::arg("namespace") = "", py::arg("use_ucx") = true,
           py::arg("quantize") = "", py::arg("rpc_timeout") = 10.0, py::arg("tls_ca") = "", py::arg("tls_cert") = "",
           py::arg("tls_key") = "")
      .def_property_readonly("tenant", &PyClient::tenant)
      .def_property_readonly("namespace", &PyClient::ns)
      .def_property_readonly("map_version", &PyClient::map_version)
      .def("chain", &PyClient::Chain, py::arg("model"), py::arg("layout"), py::arg("tokens"), py::arg("parent") = py::none(),
           "Keys (n, 2) of the full blocks of `tokens`, continuing from `parent` (default: a sequence start).")
      .def("lookup", &PyClient::Lookup, py::arg("keys"), "Length of the longest held prefix of `keys`.")
      .def("put", &PyClient::Put, py::arg("keys"), py::arg("blocks"), py::arg("layout"), py::arg("parent") = py::none(),
           py::arg("pin") = false)
      .def("put_sequence", &PyClient::PutSequence, py::arg("sequence_id"), py::arg("first_block"), py::arg("keys"),
           py::arg("blocks"), py::arg("layout"), py::arg("parent") = py::none())
      .def("get", &PyClient::Get, py::arg("keys"), py::arg("layout"))
      .def("get_into", &PyClient::GetInto, py::arg("keys"), py::arg("layout"), py::arg("out"))
      .def("pin", [](PyClient& c, const py::array_t<uint64_t, py::array::c_style | py::array::forcecast>& k) { c.Pin(k, false); },
           py::arg("keys"))
      .def("unpin", [](PyClient& c, const py::array_t<uint64_t, py::array::c_style | py::array::forcecast>& k) { c.Pin(k, true); },
           py::arg("keys"))
      .def("attend", &PyClient::Attend, py::arg("sequence_id"), py::arg("layout"), py::arg("num_tokens"), py::arg("q"), py::arg("positions"),
           py::arg("layer") = 0, py::arg("causal") = true, py::arg("softmax_scale") = 0.0f, py::arg("window") = 0,
           py::arg("report") = false)
      .def("stats", &PyClient::Stats);

  m.def("merge", &Merge, py::arg("outs"), py::arg("lses"), "Exact merge of attention partials (out, lse).");
  m.def("create_tenant", &CreateTenant, py::arg("coordinator"), py::arg("admin_token"), py::arg("name"),
        py::arg("shared_namespaces") = std::vector<std::string>{}, py::arg("max_pinned_bytes") = 0,
        py::arg("kv_encoding") = "", py::arg("tls_ca") = "");
}
