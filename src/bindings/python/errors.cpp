// C++ exceptions become the Python classes of poise/errors.py, which are defined in Python so
// users can raise, catch and pickle them without touching the extension.
#include <nanobind/stl/string.h>

#include <exception>
#include <string>

#include "poise/errors.hpp"
#include "bindings/python/bindings.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace poise::python {
namespace {

// Looked up when an exception is translated, never at import (poise.errors is plain Python).
nb::object error_class(const char* name) { return nb::module_::import_("poise.errors").attr(name); }

// C++ InvalidArgument's what() is "name: rule"; Python's InvalidArgument(name, rule) rebuilds it.
std::string rule_of(const InvalidArgument& e) {
  const std::string what = e.what();
  const std::string prefix = e.name() + ": ";
  return what.rfind(prefix, 0) == 0 ? what.substr(prefix.size()) : what;
}

void translate(const std::exception_ptr& p, void*) {
  try {
    try {
      std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      nb::object error = error_class("InvalidArgument")(e.name(), rule_of(e));
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
    } catch (const NotAvailable& e) {
      PyErr_SetString(error_class("NotAvailable").ptr(), e.what());
    } catch (const DeviceError& e) {
      PyErr_SetString(error_class("DeviceError").ptr(), e.what());
    }
  } catch (nb::python_error& e) {
    e.restore();  // poise.errors could not be imported: report that instead
  }
  // Any other exception propagates to nanobind's default translators.
}

// Throws a C++ error of the given kind, so tests can check the translation without a GPU.
[[noreturn]] void raise_cpp_error(const std::string& kind, const std::string& name, const std::string& message) {
  if (kind == "invalid_argument") throw InvalidArgument(name, message);
  if (kind == "not_available") throw NotAvailable(message);
  if (kind == "device_error") throw DeviceError(message);
  throw std::logic_error(message);
}

}  // namespace

void register_error_translator() { nb::register_exception_translator(translate); }

void bind_errors(nb::module_& m) {
  register_error_translator();
  m.def("_raise_cpp_error", &raise_cpp_error, "kind"_a, "name"_a, "message"_a,
        "Test hook: throws poise::InvalidArgument / NotAvailable / DeviceError (else std::logic_error).");
}

}  // namespace poise::python
