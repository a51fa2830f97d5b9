// hisparse_cupy: HS_ABI_CHECK(S), the check of a kernel parameter struct S against its NumPy
// mirror in hisparse_cupy/_abi.py, which defines HS_ABI_<S>_SIZE and HS_ABI_<S>_FIELDS(X) (every
// field's name and size, in order) for every compile. abi.cuh checks the package's structs with
// it, demo/model.cu the demo model's. Use it where S is in scope (in S's namespace).
//
// NVRTC has no offsetof, so the layout is pinned by what it determines: the size of every field,
// their order (a C++20 designated initializer in _abi.py's order is a compile error when the
// declaration order differs) and the struct's size (_abi.py's structs have no tail padding, so a
// field only one side has changes it).
#pragma once

#define HS_ABI_FIELD_SIZE(S, f, n) static_assert(sizeof(S::f) == (n), #S "." #f ": size differs from _abi.py");
#define HS_ABI_DESIGNATOR(S, f, n) .f = {},
#define HS_ABI_CHECK(S)                                                                  \
  HS_ABI_##S##_FIELDS(HS_ABI_FIELD_SIZE)                                                 \
  static_assert(sizeof(S{HS_ABI_##S##_FIELDS(HS_ABI_DESIGNATOR)}) == sizeof(S), #S);     \
  static_assert(sizeof(S) == HS_ABI_##S##_SIZE, #S ": size differs from _abi.py")
