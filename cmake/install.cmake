# What `cmake --install` puts in place for C++ users (docs/INSTALL.md):
#   lib/libecx.so.X.Y.Z    every layer of src/ in one shared library (soname libecx.so.0.1)
#   include/ecx/           the public headers
#   lib/cmake/ecx/         ecxConfig.cmake: find_package(ecx) -> ecx::ecx
#   lib/pkgconfig/ecx.pc   pkg-config --cflags --libs ecx
#   bin/ecx, bin/ecx-bench the command-line tool (tools/ecx) and its benchmarks (bench/main.cc)
include(CMakePackageConfigHelpers)

set(ECX_LAYERS ecx_common ecx_http ecx_wire ecx_transfer ecx_cache ecx_connector_messages
               ecx_connector ecx_engine ecx_openai ecx_directory ecx_http_server ecx_serve)
set(ecx_objects)
foreach(layer IN LISTS ECX_LAYERS)
  list(APPEND ecx_objects $<TARGET_OBJECTS:${layer}>)
endforeach()
add_library(ecx_shared SHARED ${ecx_objects})
# Until 1.0 every minor version may change the ABI: the soname carries both numbers.
set_target_properties(ecx_shared PROPERTIES
  OUTPUT_NAME ecx EXPORT_NAME ecx
  VERSION ${PROJECT_VERSION} SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR})
target_include_directories(ecx_shared PUBLIC
  $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
  $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
# What the public headers include is public; the rest is linked in, and checked: no
# symbol may stay undefined.
target_link_libraries(ecx_shared
  PUBLIC nlohmann_json::nlohmann_json spdlog::spdlog
  PRIVATE PkgConfig::XXHASH OpenSSL::SSL OpenSSL::Crypto fmt::fmt PkgConfig::HIREDIS PNG::PNG
          JPEG::JPEG PkgConfig::OPENBLAS Threads::Threads ${CMAKE_DL_LIBS})
if(ECX_HAVE_CUDA)
  target_link_libraries(ecx_shared PRIVATE CUDA::cudart_static)
endif()
target_link_options(ecx_shared PRIVATE -Wl,--no-undefined)
add_library(ecx::ecx ALIAS ecx_shared)

install(TARGETS ecx_shared EXPORT ecxTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/ecx
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT dev)
install(EXPORT ecxTargets NAMESPACE ecx:: FILE ecxTargets.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/ecx COMPONENT dev)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/ecxConfig.cmake.in
  ${PROJECT_BINARY_DIR}/ecxConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/ecx)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/ecxConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/ecxConfig.cmake ${PROJECT_BINARY_DIR}/ecxConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/ecx COMPONENT dev)
# @ONLY, with the prefix written at install time: `cmake --install --prefix P` gives P.
install(CODE "
  set(CMAKE_INSTALL_PREFIX \"\${CMAKE_INSTALL_PREFIX}\")
  set(CMAKE_INSTALL_LIBDIR \"${CMAKE_INSTALL_LIBDIR}\")
  set(CMAKE_INSTALL_INCLUDEDIR \"${CMAKE_INSTALL_INCLUDEDIR}\")
  set(PROJECT_VERSION \"${PROJECT_VERSION}\")
  configure_file(\"${PROJECT_SOURCE_DIR}/cmake/ecx.pc.in\"
                 \"\$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_LIBDIR}/pkgconfig/ecx.pc\" @ONLY)
  message(STATUS \"Installing: \$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_LIBDIR}/pkgconfig/ecx.pc\")
" COMPONENT dev)
