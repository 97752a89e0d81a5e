// kvtier._kvtier: the pybind11 bindings behind the `kvtier` Python package (python/kvtier/).
//
//   enums        DtypeKind, KvLayoutKind, AttentionKind, HashAlgorithm, HealthState
//   layouts      ModelShape, ChunkLayout, KvStrides, PagedKvLayout (core/kv_layout.hpp)
//   hashing      TokenHasher, make_model_id, salted_model_id, ChunkKey (core/token_hasher.hpp,
//                core/model_id.hpp, core/chunk_key.hpp); a 128-bit chunk hash is a Python int
//                (hi << 64 | lo)
//   memory       KvRegion (core/kv_region.hpp) and LayerBuffer: one writable buffer per
//                layer (the buffer protocol, bytes), so torch.frombuffer / numpy.frombuffer
//                view it without a copy; typed views are built in Python (kvtier.views)
//   connector    ConnectorOptions, ConnectorTimeouts, Connector (engine/connector.hpp): a
//                worker's (with a KvRegion) or a scheduler's (without)
//
// The GIL: every Connector method converts its arguments with the GIL held, then releases it
// for the call into C++ (which may wait on the connector's mutex, or in wait_ready, on the
// server), and takes it back to build the result. The connector's own thread never runs
// Python code and never takes the GIL: the connector publishes to a null_bus.
//
// Lifetimes: KvRegion is held by std::shared_ptr; a LayerBuffer and a Connector keep their
// region alive, so a view or a connector never outlives the memory it points into, whatever
// order Python drops them in. Connector.close() stops the connector's thread (the server
// releases the registration and its locks at EOF); calls afterwards raise.
//
// Errors: std::invalid_argument -> ValueError, std::out_of_range -> IndexError (pybind11's
// defaults), std::logic_error (a scheduler asked to store, ...) -> kvtier.UsageError, and
// every other failure (a region that cannot be created, a closed connector) ->
// kvtier.KvtierError; the message is the C++ one.

#include <kvtier/core/chunk_key.hpp>
#include <kvtier/core/kv_layout.hpp>
#include <kvtier/core/kv_region.hpp>
#include <kvtier/core/model_id.hpp>
#include <kvtier/core/token_hasher.hpp>
#include <kvtier/engine/connector.hpp>
#include <kvtier/protocol/limits.hpp>
#include <kvtier/version.hpp>

#include <pybind11/numpy.h>
#include <pybind11/operators.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <bit>
#include <chrono>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace py = pybind11;
using namespace kvtier;

namespace {

/// A Python exception type of this module (set at import).
PyObject* kvtier_error = nullptr;
PyObject* usage_error = nullptr;

/// A failure that becomes kvtier.KvtierError.
struct kvtier_failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Tokens as the C++ side takes them: any sequence of ints or any array-like, as uint32
/// (the argument type of every binding that takes tokens; its caster is below).
struct token_input {
  std::span<const token_id> tokens;
};

/// Whether a buffer's struct format is a native 4-byte unsigned int (array('I'), numpy.uint32).
bool native_u32_format(const char* f) {
  if (f == nullptr) return false;  // the buffer gave no format: bytes ("B"), not ints
  const std::string_view s(f);
  return s == "I" || s == "@I" || s == "=I" ||
         (s == (std::endian::native == std::endian::little ? "<I" : ">I"));
}

}  // namespace

namespace pybind11::detail {

/// token_input from Python, by the first of three ways that applies:
/// - a list of ints in 0..2**32-1 (vLLM's token ids): copied in one pass over its items;
/// - a one-dimensional, C-contiguous, aligned buffer of native uint32 (array('I'), a numpy
///   uint32 array, a memoryview of either): read where it lies through the buffer protocol,
///   held until the call returns;
/// - anything else (a list holding something else, other dtypes, torch tensors): numpy's
///   conversion to a C-contiguous uint32 array (forcecast), as before these fast paths.
/// The first two skip numpy, whose conversion was most of what hashing a prompt's tokens cost
/// an engine step: it converts a list item by item through Python, and its code is cold
/// there (docs/performance.md, "vLLM connector: cost per step").
template <>
struct type_caster<token_input> {
  PYBIND11_TYPE_CASTER(token_input, const_name("Sequence[int]"));

  type_caster() = default;
  type_caster(const type_caster&) = delete;
  type_caster& operator=(const type_caster&) = delete;
  ~type_caster() {
    if (view_.obj != nullptr) PyBuffer_Release(&view_);
  }

  bool load(handle src, bool convert) {
    if (PyList_CheckExact(src.ptr()) && load_list(src.ptr())) return true;
    if (PyObject_CheckBuffer(src.ptr())) {
      if (PyObject_GetBuffer(src.ptr(), &view_, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
        if (view_.ndim == 1 && view_.itemsize == sizeof(token_id) && native_u32_format(view_.format) &&
            reinterpret_cast<std::uintptr_t>(view_.buf) % alignof(token_id) == 0) {
          value.tokens = {static_cast<const token_id*>(view_.buf), static_cast<std::size_t>(view_.shape[0])};
          return true;
        }
        PyBuffer_Release(&view_);
        view_ = Py_buffer{};
      } else {
        PyErr_Clear();  // not contiguous, or refused: numpy decides
      }
    }
    if (!array_.load(src, convert)) return false;
    const auto& a = static_cast<const array_t<std::uint32_t, array::c_style | array::forcecast>&>(array_);
    if (a.ndim() != 1) throw std::invalid_argument("kvtier: tokens must be one-dimensional");
    value.tokens = {a.data(), static_cast<std::size_t>(a.size())};
    return true;
  }

  static handle cast(const token_input&, return_value_policy, handle) = delete;

 private:
  /// A list whose every item is an int in 0..2**32-1 (what vLLM's token ids are), copied in
  /// one pass; false (nothing loaded) at the first other item, for numpy to convert or refuse.
  bool load_list(PyObject* list) {
    const Py_ssize_t n = PyList_GET_SIZE(list);
    owned_.resize(static_cast<std::size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = PyList_GET_ITEM(list, i);
      if (!PyLong_CheckExact(item)) return false;
      int overflow = 0;
      const long v = PyLong_AsLongAndOverflow(item, &overflow);
      if (overflow != 0 || v < 0 || static_cast<unsigned long>(v) > std::numeric_limits<token_id>::max()) return false;
      owned_[static_cast<std::size_t>(i)] = static_cast<token_id>(v);
    }
    value.tokens = owned_;
    return true;
  }

  std::vector<token_id> owned_;
  Py_buffer view_{};
  type_caster<array_t<std::uint32_t, array::c_style | array::forcecast>> array_;
};

}  // namespace pybind11::detail

namespace {

// --- 128-bit hashes as Python ints ------------------------------------------------------

py::int_ to_int(const hash128& h) {
  py::int_ hi(h.hi);
  py::int_ lo(h.lo);
  PyObject* shifted = PyNumber_Lshift(hi.ptr(), py::int_(64).ptr());
  if (shifted == nullptr) throw py::error_already_set();
  PyObject* both = PyNumber_Or(shifted, lo.ptr());
  Py_DECREF(shifted);
  if (both == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::int_>(both);
}

hash128 to_hash(const py::handle& v) {
  if (!PyLong_Check(v.ptr())) throw py::type_error("kvtier: a chunk hash is an int (0 <= h < 2**128)");
  const py::int_ x = py::reinterpret_borrow<py::int_>(v);
  if (PyObject_RichCompareBool(x.ptr(), py::int_(0).ptr(), Py_LT) == 1 ||
      py::cast<std::size_t>(x.attr("bit_length")()) > 128)
    throw std::invalid_argument("kvtier: a chunk hash is an int with 0 <= h < 2**128");
  hash128 h;
  h.lo = PyLong_AsUnsignedLongLongMask(x.ptr());
  PyObject* high = PyNumber_Rshift(x.ptr(), py::int_(64).ptr());
  if (high == nullptr) throw py::error_already_set();
  h.hi = PyLong_AsUnsignedLongLongMask(high);
  Py_DECREF(high);
  return h;
}

std::vector<hash128> to_hashes(const py::iterable& seq) {
  std::vector<hash128> out;
  for (const py::handle v : seq) out.push_back(to_hash(v));
  return out;
}

py::list to_list(const std::vector<hash128>& hs) {
  py::list l;
  for (const hash128& h : hs) l.append(to_int(h));
  return l;
}

// --- the region -------------------------------------------------------------------------

using region_ptr = std::shared_ptr<kv_region>;

/// One layer's tensor as a writable byte buffer; keeps the region alive.
/// One layer's bytes, or (`whole`) every layer's: from layer 0's base to the end of the last
/// layer's last row (layouts whose layers interleave, such as SGLang's page-first host pool).
struct layer_buffer {
  region_ptr region;
  std::uint32_t layer = 0;
  bool whole = false;

  [[nodiscard]] std::byte* data() const { return region->layers()[layer]; }
  [[nodiscard]] std::size_t size() const {
    return whole ? region->layout().total_bytes() : region->layout().layer_bytes();
  }
};

region_ptr create_region(const paged_kv_layout& layout, const std::string& name) {
  if (auto e = layout.validation_error(); !e.empty()) throw std::invalid_argument("kvtier.KvRegion: " + e);
  auto r = kv_region::create(layout, name.c_str());
  if (!r) throw kvtier_failure("kvtier.KvRegion: cannot create the memfd region: " + r.error().message());
  return std::make_shared<kv_region>(std::move(*r));
}

void check_block(const kv_region& r, std::uint32_t block) {
  if (block >= r.layout().num_blocks)
    throw std::out_of_range("kvtier.KvRegion: block " + std::to_string(block) + " is not below num_blocks " +
                            std::to_string(r.layout().num_blocks));
}

// --- the connector ----------------------------------------------------------------------

/// The connector and the region it points into, destroyed in that order (the region last).
struct connector_box {
  region_ptr region;  ///< null: a scheduler's connector
  std::optional<engine::connector<>> conn;

  connector_box(engine::connector_options o, region_ptr r) : region(std::move(r)) {
    if (region)
      conn.emplace(std::move(o), *region);
    else
      conn.emplace(std::move(o));
  }
};

class py_connector {
 public:
  py_connector(engine::connector_options o, region_ptr region) {
    py::gil_scoped_release nogil;  // the constructor starts a thread and may allocate
    box_ = std::make_shared<connector_box>(std::move(o), std::move(region));
  }

  /// The connector, or KvtierError once closed. Called with the GIL held: the copy of the
  /// shared pointer is what keeps a concurrent close() from destroying it under a call.
  [[nodiscard]] std::shared_ptr<connector_box> box() const {
    if (!box_) throw kvtier_failure("kvtier.Connector: the connector is closed");
    return box_;
  }
  [[nodiscard]] bool closed() const noexcept { return !box_; }

  void close() {
    std::shared_ptr<connector_box> b = std::move(box_);
    py::gil_scoped_release nogil;
    b.reset();  // joins the connector's thread (unless a call in another thread still holds it)
  }

 private:
  std::shared_ptr<connector_box> box_;
};

/// A call that may wait (for the server, a condition, the connector's thread): the GIL is
/// released, so the program's other Python threads run meanwhile.
template <class F>
auto without_gil(const py_connector& self, F&& f) {
  auto b = self.box();
  py::gil_scoped_release nogil;
  return f(*b->conn);
}

/// A call that cannot block (a lock held for microseconds, a non-blocking send): the GIL is
/// kept. Releasing it would hand it to any Python thread waiting for it, and the caller would
/// then wait for that thread to give it back, up to sys.getswitchinterval() (5 ms): a
/// microsecond call costing a tenth of a decode step (docs/python.md, "The GIL"). The
/// connector's thread never takes the GIL, so holding it while waiting for the connector's
/// mutex cannot deadlock.
template <class F>
auto holding_gil(const py_connector& self, F&& f) {
  auto b = self.box();
  return f(*b->conn);
}

/// Token counts from which hashing (or copying) the tokens is worth a release of the GIL:
/// 65536 tokens are 256 KiB, about 25 us of XXH3 on the dev VM.
constexpr std::size_t release_gil_from_tokens = std::size_t{1} << 16;

/// f() with the GIL held, or released when it works on release_gil_from_tokens tokens or
/// more (holding_gil's reason below that).
template <class F>
auto call_for_tokens(std::size_t tokens, F&& f) {
  if (tokens < release_gil_from_tokens) return f();
  py::gil_scoped_release nogil;
  return f();
}

/// call_for_tokens for a connector call (the connector taken with the GIL held).
template <class F>
auto gil_for_tokens(const py_connector& self, std::size_t tokens, F&& f) {
  auto b = self.box();
  return call_for_tokens(tokens, [&] { return f(*b->conn); });
}

std::string options_repr(const engine::connector_options& o) {
  return "ConnectorOptions(socket_path='" + o.socket_path + "', rank=" + std::to_string(o.rank) +
         ", world_size=" + std::to_string(o.world_size) + ", model_name='" + o.model_name +
         "', chunk_tokens=" + std::to_string(o.chunk_tokens) + ")";
}

/// A wait's timeout in seconds as the connector takes it; None: no timeout (the connector's
/// own deadlines end every retrieve, docs/python.md).
/// `Duration`: milliseconds for the waits on requests, microseconds for wait_progress (an idle
/// step's wait, shorter than a millisecond).
template <class Duration = std::chrono::milliseconds>
Duration wait_timeout(std::optional<double> seconds) {
  constexpr Duration none = std::chrono::hours(24 * 366);
  if (!seconds) return none;
  const double ticks = std::max(0.0, *seconds * Duration::period::den / Duration::period::num);
  return ticks >= static_cast<double>(none.count()) ? none : Duration(static_cast<std::int64_t>(ticks));
}

/// A millisecond property of connector_timeouts.
template <auto Member>
void timeout_property(py::class_<engine::connector_timeouts>& c, const char* name, const char* doc) {
  c.def_property(
      name, [](const engine::connector_timeouts& t) { return (t.*Member).count(); },
      [](engine::connector_timeouts& t, std::int64_t ms) { t.*Member = std::chrono::milliseconds(ms); }, doc);
}

}  // namespace

PYBIND11_MODULE(_kvtier, m) {
  m.doc() = "kvtier's C++ core (pybind11): layouts, hashing, the shared-memory KV region and the connector";
  m.attr("__version__") = version_string;
  m.attr("PROTOCOL_VERSION") = protocol::protocol_version;

  // Exceptions.
  kvtier_error = PyErr_NewExceptionWithDoc("kvtier.KvtierError", "A kvtier failure; the message is the C++ one.",
                                           PyExc_RuntimeError, nullptr);
  usage_error = PyErr_NewExceptionWithDoc(
      "kvtier.UsageError", "A call this object cannot serve (e.g. a scheduler's connector asked to store).",
      kvtier_error, nullptr);
  m.attr("KvtierError") = py::handle(kvtier_error);
  m.attr("UsageError") = py::handle(usage_error);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const kvtier_failure& e) {
      PyErr_SetString(kvtier_error, e.what());
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const std::out_of_range& e) {
      PyErr_SetString(PyExc_IndexError, e.what());
    } catch (const std::logic_error& e) {
      PyErr_SetString(usage_error, e.what());
    }
  });

  // Enums (values as on the wire).
  py::enum_<dtype_kind>(m, "DtypeKind", "Element type of the KV cache (part of the model id).")
      .value("FP32", dtype_kind::fp32)
      .value("FP16", dtype_kind::fp16)
      .value("BF16", dtype_kind::bf16)
      .value("FP8_E4M3", dtype_kind::fp8_e4m3)
      .value("FP8_E5M2", dtype_kind::fp8_e5m2)
      .value("INT8", dtype_kind::int8);
  m.def(
      "dtype_bytes", [](dtype_kind d) { return bytes_of(d); }, py::arg("dtype"), "Bytes of one element.");
  m.def(
      "parse_dtype_kind",
      [](const std::string& s) {
        auto d = parse_dtype_kind(s);
        if (!d)
          throw std::invalid_argument("kvtier: unknown dtype '" + s +
                                      "': use fp32, fp16, bf16, fp8_e4m3, fp8_e5m2 or int8 (or torch's names)");
        return *d;
      },
      py::arg("name"), "Parses 'fp16', 'bfloat16', 'float8_e4m3fn', ...");
  py::enum_<kv_layout_kind>(m, "KvLayoutKind", "Order of the tokens and heads of one paged block.")
      .value("NHD", kv_layout_kind::nhd)
      .value("HND", kv_layout_kind::hnd)
      .value("MLA", kv_layout_kind::mla);
  m.def(
      "parse_kv_layout_kind",
      [](const std::string& s) {
        auto k = parse_kv_layout_kind(s);
        if (!k) throw std::invalid_argument("kvtier: unknown layout kind '" + s + "': use NHD, HND or MLA");
        return *k;
      },
      py::arg("name"));
  py::enum_<attention_kind>(m, "AttentionKind").value("MHA", attention_kind::mha).value("MLA", attention_kind::mla);
  py::enum_<hash_algorithm>(m, "HashAlgorithm")
      .value("XXH3_128", hash_algorithm::xxh3_128)
      .value("SHA256", hash_algorithm::sha256);
  py::enum_<engine::health_state>(m, "HealthState")
      .value("STARTING", engine::health_state::starting)
      .value("HEALTHY", engine::health_state::healthy)
      .value("UNHEALTHY", engine::health_state::unhealthy);

  // Layouts.
  py::class_<model_shape>(m, "ModelShape", "A model's KV geometry (one rank's share of the KV heads).")
      .def(py::init([](std::uint32_t num_layers, std::uint32_t num_kv_heads, std::uint32_t head_dim, dtype_kind dtype,
                       attention_kind attention) {
             return model_shape{num_layers, num_kv_heads, head_dim, dtype, attention};
           }),
           py::arg("num_layers") = 0, py::arg("num_kv_heads") = 0, py::arg("head_dim") = 0,
           py::arg("dtype") = dtype_kind::bf16, py::arg("attention") = attention_kind::mha)
      .def_readwrite("num_layers", &model_shape::num_layers)
      .def_readwrite("num_kv_heads", &model_shape::num_kv_heads)
      .def_readwrite("head_dim", &model_shape::head_dim)
      .def_readwrite("dtype", &model_shape::dtype)
      .def_readwrite("attention", &model_shape::attention)
      .def_property_readonly("dtype_bytes", &model_shape::dtype_bytes)
      .def_property_readonly("planes", &model_shape::planes)
      .def_property_readonly("token_plane_bytes", &model_shape::token_plane_bytes)
      .def_property_readonly("token_bytes", &model_shape::token_bytes)
      .def("validation_error", &model_shape::validation_error, "Empty when valid, else what is wrong.")
      .def(py::self == py::self)
      .def("__repr__", [](const model_shape& s) {
        return "ModelShape(num_layers=" + std::to_string(s.num_layers) +
               ", num_kv_heads=" + std::to_string(s.num_kv_heads) + ", head_dim=" + std::to_string(s.head_dim) +
               ", dtype=" + std::string(name(s.dtype)) +
               ", attention=" + (s.attention == attention_kind::mla ? "MLA" : "MHA") + ")";
      });

  py::class_<chunk_layout>(m, "ChunkLayout", "One chunk object: chunk_tokens tokens of every layer and plane.")
      .def(py::init([](const model_shape& model, std::uint32_t chunk_tokens) {
             return chunk_layout{model, chunk_tokens};
           }),
           py::arg("model"), py::arg("chunk_tokens") = 256)
      .def_readwrite("model", &chunk_layout::model)
      .def_readwrite("chunk_tokens", &chunk_layout::chunk_tokens)
      .def_property_readonly("slab_bytes", &chunk_layout::slab_bytes)
      .def_property_readonly("object_bytes", &chunk_layout::object_bytes)
      .def("validation_error", &chunk_layout::validation_error);

  py::class_<kv_strides>(m, "KvStrides",
                         "Byte strides of a paged KV cache: from one layer, plane (K, V), block, token and KV "
                         "head to the next. All zero: the dense layout of the order.")
      .def(py::init([](std::uint64_t layer, std::uint64_t plane, std::uint64_t block, std::uint64_t token,
                       std::uint64_t head) { return kv_strides{layer, plane, block, token, head}; }),
           py::arg("layer") = 0, py::arg("plane") = 0, py::arg("block") = 0, py::arg("token") = 0, py::arg("head") = 0)
      .def_readwrite("layer", &kv_strides::layer)
      .def_readwrite("plane", &kv_strides::plane)
      .def_readwrite("block", &kv_strides::block)
      .def_readwrite("token", &kv_strides::token)
      .def_readwrite("head", &kv_strides::head)
      .def_property_readonly("dense", &kv_strides::dense)
      .def(py::self == py::self)
      .def("__repr__", [](const kv_strides& s) {
        return "KvStrides(layer=" + std::to_string(s.layer) + ", plane=" + std::to_string(s.plane) +
               ", block=" + std::to_string(s.block) + ", token=" + std::to_string(s.token) +
               ", head=" + std::to_string(s.head) + ")";
      });

  py::class_<paged_kv_layout>(m, "PagedKvLayout",
                              "An engine's paged KV cache: per layer NHD, HND or MLA blocks, dense or at explicit "
                              "byte strides (the engine's own tensor layout).")
      .def(py::init([](const model_shape& model, std::uint32_t block_size, std::uint32_t num_blocks,
                       kv_layout_kind order, const kv_strides& strides) {
             return paged_kv_layout{model, block_size, num_blocks, order, strides};
           }),
           py::arg("model"), py::arg("block_size") = 16, py::arg("num_blocks") = 0,
           py::arg("order") = kv_layout_kind::nhd, py::arg("strides") = kv_strides{})
      .def_readwrite("model", &paged_kv_layout::model)
      .def_readwrite("block_size", &paged_kv_layout::block_size)
      .def_readwrite("num_blocks", &paged_kv_layout::num_blocks)
      .def_readwrite("order", &paged_kv_layout::order)
      .def_readwrite("strides", &paged_kv_layout::strides)
      .def_property_readonly("effective_strides", &paged_kv_layout::effective_strides,
                             "The strides in force (the dense ones when `strides` is all zero).")
      .def_property_readonly("segment_contiguous", &paged_kv_layout::segment_contiguous,
                             "Whether a block's rows of one plane are contiguous in object order.")
      .def("describe", &paged_kv_layout::describe, "The shape and strides in words.")
      .def_property_readonly("kind", &paged_kv_layout::kind)
      .def_property_readonly("segment_bytes", &paged_kv_layout::segment_bytes)
      .def_property_readonly("head_row_bytes", &paged_kv_layout::head_row_bytes)
      .def_property_readonly("layer_bytes", &paged_kv_layout::layer_bytes)
      .def_property_readonly("total_bytes", &paged_kv_layout::total_bytes)
      .def("offset_in_layer", &paged_kv_layout::offset_in_layer, py::arg("plane"), py::arg("block"),
           py::arg("token") = 0, py::arg("head") = 0, "Byte offset of a (token, head) row in one layer's tensor.")
      .def("validation_error", &paged_kv_layout::validation_error)
      .def("compatibility_error", &paged_kv_layout::compatibility_error, py::arg("chunk"))
      .def(py::self == py::self)
      .def("__repr__", [](const paged_kv_layout& l) {
        const kv_strides& s = l.strides;
        return "PagedKvLayout(block_size=" + std::to_string(l.block_size) +
               ", num_blocks=" + std::to_string(l.num_blocks) + ", order=" + std::string(name(l.kind())) +
               (s.dense() ? std::string()
                          : ", strides=(" + std::to_string(s.layer) + ", " + std::to_string(s.plane) + ", " +
                                std::to_string(s.block) + ", " + std::to_string(s.token) + ", " +
                                std::to_string(s.head) + ")") +
               ")";
      });

  // Hashing and keys.
  py::class_<token_hasher>(m, "TokenHasher", "The rolling prefix hash that names chunks (one int per full chunk).")
      .def(py::init<std::size_t, hash_algorithm>(), py::arg("chunk_tokens") = token_hasher::default_chunk_size,
           py::arg("algorithm") = hash_algorithm::xxh3_128)
      .def_property_readonly("chunk_tokens", &token_hasher::chunk_size)
      .def_property_readonly("algorithm", &token_hasher::algorithm)
      .def("root", [](const token_hasher& h) { return to_int(h.root()); })
      .def(
          "chunk_hashes",
          [](const token_hasher& h, const token_input& tokens, const py::object& extras) {
            // extras: None, or one bytes object per full chunk (b"": that chunk's tokens alone).
            std::vector<py::bytes> held;  // keeps the buffers alive while the GIL is released
            std::vector<std::span<const std::byte>> spans;
            if (!extras.is_none()) {
              for (const py::handle item : extras) {
                if (!PyBytes_Check(item.ptr()))
                  throw py::type_error("kvtier: TokenHasher.chunk_hashes: each extra is bytes (b\"\" for none), not " +
                                       std::string(py::str(py::type::of(item).attr("__name__"))));
                held.push_back(py::reinterpret_borrow<py::bytes>(item));
                spans.emplace_back(reinterpret_cast<const std::byte*>(PyBytes_AS_STRING(item.ptr())),
                                   static_cast<std::size_t>(PyBytes_GET_SIZE(item.ptr())));
              }
              if (spans.size() != h.full_chunks(tokens.tokens.size()))
                throw std::invalid_argument("kvtier: TokenHasher.chunk_hashes: " + std::to_string(spans.size()) +
                                            " extras for " +
                                            std::to_string(h.full_chunks(tokens.tokens.size())) +
                                            " full chunks: give one bytes object per full chunk (b\"\" for none)");
            }
            const auto tk = tokens.tokens;
            return to_list(call_for_tokens(tk.size(), [&] { return h.chunk_hashes(tk, spans); }));
          },
          py::arg("tokens"), py::arg("extras") = py::none(),
          "The hashes of every full chunk of a sequence that starts at token 0; extras (one bytes per "
          "full chunk, b\"\" = none) are folded into their chunk's hash after its tokens.");
  m.def(
      "make_model_id",
      [](const std::string& model_name, const model_shape& shape, kv_layout_kind layout, const std::string& salt) {
        return make_model_id(model_name, shape, layout, salt);
      },
      py::arg("model_name"), py::arg("shape"), py::arg("layout") = kv_layout_kind::nhd, py::arg("salt") = "",
      "The model namespace of chunk keys (what the server answers a registration with).");
  m.def("salted_model_id", &salted_model_id, py::arg("model_id"), py::arg("salt"),
        "The model id of one request's chunks under its cache salt.");
  py::class_<chunk_key>(m, "ChunkKey", "The identity of one stored object: (model id, world size, rank, hash).")
      .def(py::init([](std::uint64_t model_id, std::uint16_t world_size, std::uint16_t rank, const py::int_& h) {
             return chunk_key{model_id, world_size, rank, to_hash(h)};
           }),
           py::arg("model_id"), py::arg("world_size"), py::arg("rank"), py::arg("hash"))
      .def_readonly("model_id", &chunk_key::model_id)
      .def_readonly("world_size", &chunk_key::world_size)
      .def_readonly("rank", &chunk_key::rank)
      .def_property_readonly("hash", [](const chunk_key& k) { return to_int(k.hash); })
      .def("encode",
           [](const chunk_key& k) {
             const auto a = k.encode();
             return py::bytes(reinterpret_cast<const char*>(a.data()), a.size());
           })
      .def("__str__", &chunk_key::to_string)
      .def("__repr__", [](const chunk_key& k) { return "ChunkKey('" + k.to_string() + "')"; })
      .def(py::self == py::self)
      .def("__hash__", [](const chunk_key& k) { return chunk_key_hash{}(k); });

  // The region.
  py::class_<layer_buffer>(m, "LayerBuffer", py::buffer_protocol(),
                           "One layer's KV tensor in the region as writable bytes (buffer protocol, no copy).")
      .def_buffer([](layer_buffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<std::uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.size())}, {py::ssize_t{1}}, /*readonly=*/false);
      })
      .def_readonly("layer", &layer_buffer::layer)
      .def("__len__", &layer_buffer::size);

  py::class_<kv_region, region_ptr>(m, "KvRegion",
                                    "An engine's paged KV cache in a sealed memfd, with per-block generations.")
      .def_static("create", &create_region, py::arg("layout"), py::arg("name") = "kvtier-kv",
                  "A new zero-filled region for `layout`.")
      .def_static("bytes_for", &kv_region::bytes_for, py::arg("layout"))
      .def_property_readonly("layout", &kv_region::layout)
      .def_property_readonly("bytes", &kv_region::bytes)
      .def_property_readonly("fd", &kv_region::fd)
      .def_property_readonly("num_layers", [](const kv_region& r) { return r.layout().model.num_layers; })
      .def(
          "layer",
          [](const region_ptr& r, std::uint32_t l) {
            if (l >= r->layout().model.num_layers)
              throw std::out_of_range("kvtier.KvRegion.layer: layer " + std::to_string(l) + " is not below " +
                                      std::to_string(r->layout().model.num_layers));
            return layer_buffer{r, l};
          },
          py::arg("layer"), "Layer `layer`'s tensor as a writable byte buffer.")
      .def(
          "data", [](const region_ptr& r) { return layer_buffer{r, 0, true}; },
          "Every layer's KV as one writable byte buffer, from layer 0's base to the end of the last layer's "
          "rows (for layouts whose layers interleave).")
      .def(
          "begin_reuse",
          [](kv_region& r, std::uint32_t block) {
            check_block(r, block);
            r.begin_reuse(block);
          },
          py::arg("block"), "Announce that `block` is about to hold new content (fencing).")
      .def(
          "generation",
          [](const kv_region& r, std::uint32_t block) {
            check_block(r, block);
            return r.generation(block);
          },
          py::arg("block"));

  // The connector.
  py::class_<engine::connector_timeouts> timeouts(m, "ConnectorTimeouts",
                                                  "Deadlines and periods of the connector, in milliseconds.");
  timeouts.def(py::init<>());
  using T = engine::connector_timeouts;
  timeout_property<&T::ping_interval>(timeouts, "ping_interval_ms", "period of the liveness ping");
  timeout_property<&T::ping_timeout>(timeouts, "ping_timeout_ms", "an unanswered ping this long: unhealthy");
  timeout_property<&T::request_timeout>(timeouts, "request_timeout_ms", "deadline of the small calls");
  timeout_property<&T::lookup_timeout>(timeouts, "lookup_timeout_ms", "how long a lookup may stay pending");
  timeout_property<&T::retrieve_timeout>(timeouts, "retrieve_timeout_ms", "past it a retrieve is a load error");
  timeout_property<&T::store_timeout>(timeouts, "store_timeout_ms", "past it a store counts as finished");
  timeout_property<&T::reconnect_initial>(timeouts, "reconnect_initial_ms", "first reconnection pause");
  timeout_property<&T::reconnect_max>(timeouts, "reconnect_max_ms", "longest reconnection pause");
  timeout_property<&T::quarantine_limit>(timeouts, "quarantine_limit_ms",
                                         "0: quarantined blocks wait for the server's answer or death");

  using O = engine::connector_options;
  py::class_<O>(m, "ConnectorOptions", "The connector's configuration (engine/options.hpp).")
      .def(py::init<>())
      .def_readwrite("socket_path", &O::socket_path)
      .def_readwrite("rank", &O::rank)
      .def_readwrite("world_size", &O::world_size)
      .def_readwrite("scheduler", &O::scheduler, "None: the scheduler role is rank 0's")
      .def_readwrite("model_name", &O::model_name)
      .def_readwrite("model", &O::model, "a scheduler's per-rank shape (leave default for a worker)")
      .def_readwrite("layout_kind", &O::layout_kind, "a scheduler's layout kind (a worker's comes from its region)")
      .def_readwrite("cache_salt", &O::cache_salt)
      .def_readwrite("prefill_tokens_per_second", &O::prefill_tokens_per_second)
      .def_readwrite("chunk_tokens", &O::chunk_tokens)
      .def_readwrite("hash", &O::hash)
      .def_readwrite("instance_id", &O::instance_id)
      .def_readwrite("engine_id", &O::engine_id,
                     "the engine instance, the same in its scheduler's and every worker's connector (vLLM's "
                     "kv_transfer_config.engine_id); empty: this connection is an engine of its own")
      .def_readwrite("timeouts", &O::timeouts)
      .def_readwrite("timeout_scale", &O::timeout_scale)
      .def_readwrite("breaker_threshold", &O::breaker_threshold)
      .def_readwrite("finished_window", &O::finished_window)
      .def_readwrite("max_lookups", &O::max_lookups)
      .def_readwrite("describe_chunks", &O::describe_chunks,
                     "describe looked-up chunks (their token ids) for a server's KV events; False: never")
      .def_readwrite("block_size", &O::block_size,
                     "the engine's tokens per block in descriptions; 0: the region's (chunk_tokens without one)")
      .def_readwrite("described_chunks_window", &O::described_chunks_window,
                     "chunks described on a connection that are not described again on it")
      .def("is_scheduler", &O::is_scheduler)
      .def("validation_error", &O::validation_error)
      .def("__repr__", &options_repr);

  py::class_<py_connector>(m, "Connector",
                           "The engine-side client of kvtier-server: a worker's (with a KvRegion) or a scheduler's.")
      .def(py::init([](O options, std::optional<region_ptr> region) {
             return std::make_unique<py_connector>(std::move(options), region.value_or(nullptr));
           }),
           py::arg("options"), py::arg("region") = py::none())
      .def("close", &py_connector::close, "Stops the connector (closes its connection, joins its thread).")
      .def_property_readonly("closed", &py_connector::closed)
      .def(
          "wait_ready",
          [](const py_connector& s, double timeout_s) {
            const auto ms = std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000.0));
            return without_gil(s, [&](auto& c) { return c.wait_ready(ms); });
          },
          py::arg("timeout_s"), "Blocks until registered with a server (True) or the timeout passes.")
      .def_property_readonly("healthy", [](const py_connector& s) { return s.box()->conn->healthy(); })
      .def_property_readonly("state",
                             [](const py_connector& s) { return holding_gil(s, [](auto& c) { return c.state(); }); })
      .def_property_readonly(
          "last_error", [](const py_connector& s) { return holding_gil(s, [](auto& c) { return c.last_error(); }); })
      .def_property_readonly(
          "boot_token", [](const py_connector& s) { return holding_gil(s, [](auto& c) { return c.boot_token(); }); })
      .def_property_readonly("has_region", [](const py_connector& s) { return s.box()->conn->has_region(); })
      .def_property_readonly("options", [](const py_connector& s) { return s.box()->conn->options(); })
      .def("stats",
           [](const py_connector& s) {
             const engine::connector_stats st = holding_gil(s, [](auto& c) { return c.stats(); });
             py::dict d;
             d["registrations"] = st.registrations;
             d["late_replies"] = st.late_replies;
             d["progress_messages"] = st.progress_messages;
             d["ignored_progress"] = st.ignored_progress;
             d["calls_issued"] = st.calls_issued;
             d["calls_sent_by_caller"] = st.calls_sent_by_caller;
             d["pending_calls"] = st.pending_calls;
             d["tracked_requests"] = st.tracked_requests;
             d["lookups"] = st.lookups;
             d["open_connections"] = st.open_connections;
             d["descriptions_sent"] = st.descriptions_sent;
             d["chunks_described"] = st.chunks_described;
             d["quarantined_blocks"] = st.quarantined_blocks;
             d["unhealthy_ns"] = st.unhealthy_ns;
             return d;
           })
      .def_property_readonly(
          "counters",
          [](const py_connector& s) {
            const engine::connector_stats st = holding_gil(s, [](auto& c) { return c.stats(); });
            return py::make_tuple(st.registrations, st.late_replies, st.quarantined_blocks, st.unhealthy_ns);
          },
          "(registrations, late_replies, quarantined_blocks, unhealthy_ns) of stats(), without its dict: what "
          "the vLLM connector samples every step, in one call.")
      .def(
          "chunk_hashes",
          [](const py_connector& s, const token_input& tokens) {
            const auto tk = tokens.tokens;
            return to_list(gil_for_tokens(s, tk.size(), [&](auto& c) { return c.chunk_hashes(tk); }));
          },
          py::arg("tokens"))
      // Scheduler side.
      .def(
          "lookup",
          [](const py_connector& s, const std::string& id, const token_input& tokens, const std::string& salt) {
            const auto tk = tokens.tokens;
            gil_for_tokens(s, tk.size(), [&](auto& c) { c.lookup(id, tk, salt); });
          },
          py::arg("request_id"), py::arg("tokens"), py::arg("cache_salt") = "")
      .def(
          "lookup_hashes",
          [](const py_connector& s, const std::string& id, const py::iterable& hashes, const std::string& salt) {
            auto hs = to_hashes(hashes);
            holding_gil(s, [&](auto& c) { c.lookup_hashes(id, std::move(hs), salt); });
          },
          py::arg("request_id"), py::arg("hashes"), py::arg("cache_salt") = "")
      .def_property_readonly(
          "describes_chunks",
          [](const py_connector& s) { return holding_gil(s, [](auto& c) { return c.describes_chunks(); }); },
          "Whether describe_chunks may send anything now (False once the server said it publishes no KV events).")
      .def(
          "describe_chunks",
          [](const py_connector& s, const py::iterable& hashes, const token_input& tokens, const std::string& salt,
             std::uint32_t block_size, const std::optional<py::int_>& parent, const std::string& lora_name,
             std::int64_t lora_id, const std::vector<std::string>& block_extra_keys) {
            const auto hs = to_hashes(hashes);
            const auto tk = tokens.tokens;
            engine::chunk_description_extras x;
            x.block_size = block_size;
            if (parent) x.parent = to_hash(*parent);
            x.lora_name = lora_name;
            x.lora_id = lora_id;
            x.block_extra_keys = block_extra_keys;
            gil_for_tokens(s, tk.size(), [&](auto& c) { c.describe_chunks(hs, tk, salt, x); });
          },
          py::arg("hashes"), py::arg("tokens"), py::arg("cache_salt") = "", py::kw_only(), py::arg("block_size") = 0,
          py::arg("parent") = py::none(), py::arg("lora_name") = "", py::arg("lora_id") = -1,
          py::arg("block_extra_keys") = std::vector<std::string>{},
          "Tells the server the token ids of consecutive chunks of one prompt (for the KV events it may "
          "publish); fire and forget. tokens: at least len(hashes) * chunk_tokens.")
      .def(
          "lookup_result",
          [](const py_connector& s, const std::string& id) {
            return holding_gil(s, [&](auto& c) { return c.lookup_result(id); });
          },
          py::arg("request_id"), "Hit tokens once answered; None while pending.")
      .def_property_readonly(
          "progress", [](const py_connector& s) { return holding_gil(s, [](auto& c) { return c.progress(); }); },
          "A count that moves each time something an engine acts on happens: a lookup answered, a retrieve's "
          "progress or end, a store's end, quarantined blocks released. Read it at the top of a step; "
          "wait_progress(seen) sleeps until it moved.")
      .def(
          "wait_progress",
          [](const py_connector& s, std::uint64_t seen, std::optional<double> timeout_s) {
            const auto us = wait_timeout<std::chrono::microseconds>(timeout_s);
            return without_gil(s, [&](auto& c) { return c.wait_progress(seen, us); });
          },
          py::arg("seen"), py::arg("timeout_s") = py::none(),
          "Blocks until progress differs from `seen` (True; at once when it moved already) or the timeout "
          "passes (False): an engine with nothing to compute wakes at the connector's next event instead of "
          "polling on a timer.")
      .def(
          "wait_lookups",
          [](const py_connector& s, const std::vector<std::string>& ids, std::optional<double> timeout_s,
             bool release_gil) {
            const auto us = wait_timeout<std::chrono::microseconds>(timeout_s);
            const auto wait = [&](auto& c) { return c.wait_lookups(ids, us); };
            return release_gil ? without_gil(s, wait) : holding_gil(s, wait);
          },
          py::arg("request_ids"), py::arg("timeout_s") = py::none(), py::kw_only(), py::arg("release_gil") = true,
          "Blocks until every listed lookup is answered (True), or the timeout passes (False). release_gil=False "
          "keeps the GIL through the wait: for a wait of a fraction of a millisecond on an engine's thread, which "
          "releasing the GIL could make wait for another Python thread (docs/python.md, \"The GIL\").")
      .def(
          "free_lookup_locks",
          [](const py_connector& s, const std::string& id) {
            holding_gil(s, [&](auto& c) { c.free_lookup_locks(id); });
          },
          py::arg("request_id"))
      .def(
          "end_request",
          [](const py_connector& s, const std::string& id) { holding_gil(s, [&](auto& c) { c.end_request(id); }); },
          py::arg("request_id"))
      // Worker side.
      .def(
          "retrieve",
          [](const py_connector& s, const std::string& id, const token_input& tokens, std::uint32_t first_chunk,
             const std::vector<std::uint32_t>& blocks, std::uint32_t skip, const std::string& salt, bool synchronous) {
            const auto tk = tokens.tokens;
            const engine::retrieve_options how{synchronous};
            gil_for_tokens(s, tk.size(), [&](auto& c) { c.retrieve(id, tk, first_chunk, blocks, skip, salt, how); });
          },
          py::arg("request_id"), py::arg("tokens"), py::arg("first_chunk"), py::arg("block_ids"),
          py::arg("skip_tokens") = 0, py::arg("cache_salt") = "", py::kw_only(), py::arg("synchronous") = false)
      .def(
          "retrieve_hashes",
          [](const py_connector& s, const std::string& id, const py::iterable& hashes, std::uint32_t first_chunk,
             const std::vector<std::uint32_t>& blocks, std::uint32_t skip, const std::string& salt, bool synchronous) {
            const auto hs = to_hashes(hashes);
            const engine::retrieve_options how{synchronous};
            holding_gil(s, [&](auto& c) { c.retrieve_hashes(id, hs, first_chunk, blocks, skip, salt, how); });
          },
          py::arg("request_id"), py::arg("hashes"), py::arg("first_chunk"), py::arg("block_ids"),
          py::arg("skip_tokens") = 0, py::arg("cache_salt") = "", py::kw_only(), py::arg("synchronous") = false)
      .def(
          "store",
          [](const py_connector& s, const std::string& id, const token_input& tokens, std::uint32_t first_chunk,
             std::uint32_t chunk_count, const std::vector<std::uint32_t>& blocks, const std::string& salt) {
            const auto tk = tokens.tokens;
            gil_for_tokens(s, tk.size(), [&](auto& c) { c.store(id, tk, first_chunk, chunk_count, blocks, salt); });
          },
          py::arg("request_id"), py::arg("tokens"), py::arg("first_chunk"), py::arg("chunk_count"),
          py::arg("block_ids"), py::arg("cache_salt") = "")
      .def(
          "store_hashes",
          [](const py_connector& s, const std::string& id, const py::iterable& hashes, std::uint32_t first_chunk,
             const std::vector<std::uint32_t>& blocks, const std::string& salt) {
            const auto hs = to_hashes(hashes);
            holding_gil(s, [&](auto& c) { c.store_hashes(id, hs, first_chunk, blocks, salt); });
          },
          py::arg("request_id"), py::arg("hashes"), py::arg("first_chunk"), py::arg("block_ids"),
          py::arg("cache_salt") = "")
      .def(
          "get_finished",
          [](const py_connector& s, const std::vector<std::string>& finished) {
            engine::finished_requests r = holding_gil(s, [&](auto& c) { return c.get_finished(finished); });
            return py::make_tuple(r.sending, r.recving);
          },
          py::arg("finished_by_engine"), "(finished sending, finished receiving) ids; each id once.")
      .def("take_load_error_blocks",
           [](const py_connector& s) { return holding_gil(s, [](auto& c) { return c.take_load_error_blocks(); }); })
      // Layer-wise loading: the waits release the GIL while they block.
      .def(
          "layers_ready",
          [](const py_connector& s, const std::string& id) {
            return holding_gil(s, [&](auto& c) { return c.layers_ready(id); });
          },
          py::arg("request_id"), "Leading layers usable in every block of the request's retrieves in flight.")
      .def(
          "wait_layers",
          [](const py_connector& s, const std::vector<std::string>& ids, std::uint32_t layers,
             std::optional<double> timeout_s) {
            const auto ms = wait_timeout(timeout_s);
            return without_gil(s, [&](auto& c) { return c.wait_layers(ids, layers, ms); });
          },
          py::arg("request_ids"), py::arg("layers"), py::arg("timeout_s") = py::none(),
          "Blocks until every retrieve in flight of the requests has `layers` layers ready or completed (True), "
          "or the timeout passes (False).")
      .def(
          "wait_retrieves",
          [](const py_connector& s, const std::vector<std::string>& ids, std::optional<double> timeout_s) {
            const auto ms = wait_timeout(timeout_s);
            return without_gil(s, [&](auto& c) { return c.wait_retrieves(ids, ms); });
          },
          py::arg("request_ids"), py::arg("timeout_s") = py::none(),
          "Blocks until no retrieve of the requests is in flight (True), or the timeout passes (False).")
      .def(
          "wait_stores",
          [](const py_connector& s, const std::vector<std::string>& ids, std::optional<double> timeout_s) {
            const auto ms = wait_timeout(timeout_s);
            return without_gil(s, [&](auto& c) { return c.wait_stores(ids, ms); });
          },
          py::arg("request_ids"), py::arg("timeout_s") = py::none(),
          "Blocks until no store of the requests is in flight (True), or the timeout passes (False).")
      .def(
          "wait_released",
          [](const py_connector& s, const std::vector<std::uint32_t>& blocks, std::optional<double> timeout_s) {
            const auto ms = wait_timeout(timeout_s);
            return without_gil(s, [&](auto& c) { return c.wait_released(blocks, ms); });
          },
          py::arg("blocks"), py::arg("timeout_s") = py::none(),
          "Blocks until none of the blocks is quarantined (True), or the timeout passes (False).")
      .def(
          "block_is_quarantined",
          [](const py_connector& s, std::uint32_t b) {
            return holding_gil(s, [&](auto& c) { return c.block_is_quarantined(b); });
          },
          py::arg("block"))
      .def("quarantined_blocks",
           [](const py_connector& s) { return holding_gil(s, [](auto& c) { return c.quarantined_blocks(); }); })
      .def(
          "block_reused",
          [](const py_connector& s, std::uint32_t b) {
            return holding_gil(s, [&](auto& c) { return c.block_reused(b); });
          },
          py::arg("block"), "Fences `block` before the engine writes it; False (nothing done) when quarantined.")
      .def(
          "blocks_reused",
          [](const py_connector& s, const std::vector<std::uint32_t>& blocks) {
            return holding_gil(s, [&](auto& c) { return c.blocks_reused(blocks); });
          },
          py::arg("blocks"), "block_reused for each; returns the quarantined ones (not fenced).");
}
