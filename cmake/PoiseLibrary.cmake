# poise_add_library(name SOURCES ... [CUDA_OPTIONS ...]): a static library of one src/ folder.
# Its users see include/ and src/ (internal headers are included as "folder/file.hpp").
function(poise_add_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;CUDA_OPTIONS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  target_include_directories(${name} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/src>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  target_compile_options(${name} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:${POISE_CUDA_GENCODE} --expt-relaxed-constexpr -lineinfo ${ARG_CUDA_OPTIONS}>
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>)
endfunction()
