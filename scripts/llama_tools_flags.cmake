# Read by llama.cpp's configure through CMAKE_PROJECT_INCLUDE (scripts/build_llama_tools): the
# code that only the tools need compiles in less time, the code either runtime computes with is
# built exactly as llama.cpp's Release build builds it.
#
# Only the tools need: argument parsing, chat templates and JSON, downloads, the HTTP server,
# multimodal support (llama-common, server-*, cpp-httplib, mtmd): -O1, and llama-common and the
# server in unity batches of 8 sources, which parse their shared headers once per batch (measured
# on 2 cores: llama-common 322 CPU-s at -O3, 242 at -O1, 156 at -O1 in batches; -O0 is no faster
# than -O1 there, the time goes to parsing). mtmd batches only its 45 per-model graph builders
# (tools/mtmd/models/*.cpp, 1.7 CPU-s each alone at -O1, 5.7 s all merged): its other sources do
# not compile merged, nor does common/json.cpp.
#
# Kept at llama.cpp's -O3: libllama and libggml* (every kernel, shared by the binding and the
# tools), and the tools' code that runs per token: sampling, speculative drafting, n-gram lookup,
# batch helpers, the server's slot loop, llama-speculative-simple itself. GCC and Clang take the
# last -O given: a target's options follow CMAKE_CXX_FLAGS_RELEASE, a source file's follow the
# target's, and CMake keeps a source with options of its own out of unity batches.
#
# CROSSRT_GGML_CPU_OPTIONS (a list, from setup's probe: backends/llama_build_probe.py) goes to
# ggml-cpu alone, so turning its AMX kernels off recompiles that library, not every target.
include_guard(GLOBAL)  # ggml's own project() includes this file again

function(crossrt_tool_flags)
  set(root ${CMAKE_SOURCE_DIR})
  if(CROSSRT_GGML_CPU_OPTIONS)
    target_compile_options(ggml-cpu PRIVATE ${CROSSRT_GGML_CPU_OPTIONS})
  endif()
  foreach(target llama-common mtmd server-context llama-server-impl llama-server cpp-httplib)
    if(TARGET ${target})
      target_compile_options(${target} PRIVATE -O1)
    endif()
  endforeach()
  foreach(target llama-common server-context llama-server-impl)
    if(TARGET ${target})
      set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 8)
    endif()
  endforeach()
  if(TARGET mtmd)
    set_target_properties(mtmd PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 16)
    file(GLOB mtmd_core ${root}/tools/mtmd/*.cpp)
    set_source_files_properties(${mtmd_core} DIRECTORY ${root}/tools/mtmd
                                PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
  endif()
  set_source_files_properties(${root}/common/json.cpp DIRECTORY ${root}/common
                              PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
  file(GLOB ngram ${root}/common/ngram-*.cpp)
  set_source_files_properties(${root}/common/sampling.cpp ${root}/common/speculative.cpp
                              ${root}/common/common.cpp ${ngram}
                              DIRECTORY ${root}/common PROPERTIES COMPILE_OPTIONS -O3)
  set_source_files_properties(${root}/tools/server/server-context.cpp
                              DIRECTORY ${root}/tools/server PROPERTIES COMPILE_OPTIONS -O3)
endfunction()

# At the end of llama.cpp's top-level CMakeLists.txt, when every target exists.
cmake_language(DEFER DIRECTORY ${CMAKE_SOURCE_DIR} CALL crossrt_tool_flags)
