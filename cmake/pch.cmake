# Precompiled headers (ECX_PCH; scripts/build turns it on in the sanitizer, TSan and fuzz
# trees): the third-party and standard headers most units include are parsed once per
# tree, into one PCH for the libraries, benchmarks and tools and one for the tests (which
# adds GoogleTest); every target reuses them (ecx_use_pch).
#
# Measured on this 2-core box, one unit at a time: clang with ASan, -O0: 29-39% less
# compile time (src/connector/connector.cc 12.8 -> 9.1 s, src/serve/pd_steps.cc 9.1 ->
# 5.5 s); gcc with TSan at -O2: about 12%.
#
# The release tree and the Python module build without, so that a unit that forgets an
# #include still fails to compile there, and the module keeps getting the release tree's
# objects from ccache (scripts/deps).
option(ECX_PCH "Precompile the common third-party and standard headers" OFF)

set(ECX_PCH_HEADERS
  <nlohmann/json.hpp> <spdlog/spdlog.h>
  <algorithm> <array> <atomic> <chrono> <condition_variable> <cstdint> <cstring> <deque>
  <filesystem> <functional> <map> <memory> <mutex> <optional> <set> <span> <string>
  <string_view> <thread> <unordered_map> <utility> <variant> <vector>)

if(ECX_PCH)
  # (With clang, CMake also instantiates the headers' templates once, in the PCH.)
  file(WRITE ${PROJECT_BINARY_DIR}/ecx_pch.cc "// the precompiled headers' own unit\n")
  add_library(ecx_pch STATIC ${PROJECT_BINARY_DIR}/ecx_pch.cc)
  target_link_libraries(ecx_pch PRIVATE nlohmann_json::nlohmann_json spdlog::spdlog fmt::fmt)
  target_precompile_headers(ecx_pch PRIVATE ${ECX_PCH_HEADERS})
  # In the fuzz tree the units that use it are instrumented for coverage; so is it.
  target_compile_options(ecx_pch PRIVATE ${ECX_FUZZ_COVERAGE})
  if(ECX_BUILD_TESTS)
    find_package(GTest REQUIRED)
    add_library(ecx_test_pch STATIC ${PROJECT_BINARY_DIR}/ecx_pch.cc)
    target_link_libraries(ecx_test_pch PRIVATE nlohmann_json::nlohmann_json spdlog::spdlog
                                               fmt::fmt GTest::gtest)
    target_precompile_headers(ecx_test_pch PRIVATE ${ECX_PCH_HEADERS} <gtest/gtest.h>)
  endif()
endif()

# ecx_use_pch(TARGET [TEST]): TARGET's units include the tree's PCH (the tests' with TEST)
# when ECX_PCH is on.
function(ecx_use_pch target)
  if(NOT ECX_PCH)
    return()
  endif()
  if(ARGV1 STREQUAL "TEST")
    target_precompile_headers(${target} REUSE_FROM ecx_test_pch)
  else()
    target_precompile_headers(${target} REUSE_FROM ecx_pch)
  endif()
endfunction()
