// A byte vector whose growth leaves the new bytes uninitialised (std::vector<uint8_t>'s
// resize() zero-fills them): for buffers a decoder writes right after growing them, where
// the fill would cost about as much memory traffic as the decode's own output.
#pragma once
#include <cstdint>
#include <memory>
#include <new>
#include <utility>
#include <vector>

namespace vitgrid {

template <class T, class A = std::allocator<T>>
struct DefaultInitAllocator : A {
  template <class U>
  struct rebind {
    using other =
        DefaultInitAllocator<U, typename std::allocator_traits<A>::template rebind_alloc<U>>;
  };
  using A::A;
  template <class U>
  void construct(U* p) noexcept(noexcept(::new (static_cast<void*>(p)) U)) {
    ::new (static_cast<void*>(p)) U;  // default-initialised: no zeroing
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    std::allocator_traits<A>::construct(static_cast<A&>(*this), p, std::forward<Args>(args)...);
  }
};

using PixelBuffer = std::vector<uint8_t, DefaultInitAllocator<uint8_t>>;

}  // namespace vitgrid
