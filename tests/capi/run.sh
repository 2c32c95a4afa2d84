#!/usr/bin/env bash
# Builds libte.so / libte.a and checks them from C and C++: the header's functions are
# exactly what the library exports, and C and C++ programs compiled against include/
# with -Wall -Werror pass (linked to the shared library, and to the static one).
#   tests/capi/run.sh            debug build
#   TE_PROFILE=release tests/capi/run.sh
# Needs cc and c++ (Debian: gcc, g++); CC and CXX override them.
set -euo pipefail
cd "$(dirname "$0")/../.."

profile=${TE_PROFILE:-debug}
cc=${CC:-cc}
cxx=${CXX:-c++}
flags=(-Wall -Wextra -Werror -Iinclude)
if [ "$profile" = release ]; then
  cargo build -p te-capi --release
else
  cargo build -p te-capi
fi
lib=target/$profile
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

echo "== exported symbols of $lib/libte.so"
exported=$(nm -D --defined-only "$lib/libte.so" | awk '{ print $3 }' | sort)
stray=$(grep -v '^te_' <<<"$exported" || true)
if [ -n "$stray" ]; then
  echo "libte.so exports symbols outside te_*:"; echo "$stray"; exit 1
fi
# Backends' plugin entry points (te_plugin_*) come along from their crates; the rest
# must be exactly the functions te.h declares.
declared=$(grep -E '^[a-z][a-z0-9_ *]*\bte_[a-z0-9_]+\(' include/te.h |
  sed -E 's/.*\b(te_[a-z0-9_]+)\(.*/\1/' | sort -u)
if ! diff <(echo "$declared") <(grep -v '^te_plugin_' <<<"$exported"); then
  echo "include/te.h (<) and libte.so (>) disagree"; exit 1
fi
echo "$(wc -l <<<"$declared") functions, declared and exported"

echo "== compiling against $lib/libte.so"
shared=(-L"$lib" -lte -Wl,-rpath,"$PWD/$lib" -lpthread)
"$cc" -std=c11 "${flags[@]}" tests/capi/fixed_names.c -o "$out/fixed_names" "${shared[@]}"
"$cc" -std=c11 "${flags[@]}" tests/capi/te_test.c -o "$out/te_test" "${shared[@]}"
"$cxx" -std=c++17 "${flags[@]}" tests/capi/te_test.cpp -o "$out/te_test_cpp" "${shared[@]}"
timeout 60 "$out/fixed_names"
timeout 300 "$out/te_test"
timeout 120 "$out/te_test_cpp"

# Backends register from constructors in objects nothing refers to; without
# --whole-archive the linker drops them and engines find (almost) no backend.
echo "== compiling against $lib/libte.a (--whole-archive)"
static=(-Wl,--whole-archive "$lib/libte.a" -Wl,--no-whole-archive -lpthread -ldl -lm -lrt -lgcc_s)
"$cc" -std=c11 "${flags[@]}" tests/capi/fixed_names.c -o "$out/fixed_names_static" "${static[@]}"
"$cc" -std=c11 "${flags[@]}" tests/capi/te_test.c -o "$out/te_test_static" "${static[@]}"
timeout 60 "$out/fixed_names_static"
timeout 300 "$out/te_test_static"
echo "C ABI tests: ok"
