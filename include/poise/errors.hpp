// Errors thrown by the host side of Poise. Every message names the argument or field at fault.
#pragma once

#include <stdexcept>
#include <string>

namespace poise {

// A bad argument or Config field, caught on the host before anything is launched.
// `name()` is the offending field or argument ("top_k", "x_TD", ...).
class InvalidArgument : public std::invalid_argument {
 public:
  InvalidArgument(std::string name, const std::string& rule)
      : std::invalid_argument(name + ": " + rule), name_(std::move(name)) {}
  const std::string& name() const noexcept { return name_; }

 private:
  std::string name_;
};

// A feature that exists in the API but whose implementation has not landed in this build.
class NotAvailable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A failure reported by the device (CUDA error, device error word, timeout with a diagnostic).
class DeviceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace poise
