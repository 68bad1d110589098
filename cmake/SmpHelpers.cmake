# Small wrappers so every target gets the same flags (abseil-style).
#
#   smp_cc_library(NAME name SRCS a.cpp b.cpp DEPS dep1 dep2)
#   smp_cc_test(NAME name SRCS a_test.cpp DEPS dep1)

function(smp_apply_warnings target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE
      "$<$<COMPILE_LANGUAGE:CXX>:-Wall;-Wextra;-Wno-unused-parameter>")
  endif()
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
    # GCC 12 at C++20 warns about std::string's own inlined memcpy (GCC bug 105329).
    target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:-Wno-restrict>")
  endif()
endfunction()

function(smp_cc_library)
  cmake_parse_arguments(ARG "" "NAME" "SRCS;DEPS;PUBLIC_INCLUDES" ${ARGN})
  add_library(${ARG_NAME} STATIC ${ARG_SRCS})
  set_target_properties(${ARG_NAME} PROPERTIES POSITION_INDEPENDENT_CODE ON)
  target_include_directories(${ARG_NAME} PUBLIC ${PROJECT_SOURCE_DIR}/include ${ARG_PUBLIC_INCLUDES})
  if(ARG_DEPS)
    target_link_libraries(${ARG_NAME} PUBLIC ${ARG_DEPS})
  endif()
  smp_apply_warnings(${ARG_NAME})
endfunction()

function(smp_cc_test)
  cmake_parse_arguments(ARG "" "NAME" "SRCS;DEPS" ${ARGN})
  add_executable(${ARG_NAME} ${ARG_SRCS})
  target_link_libraries(${ARG_NAME} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gtest_main)
  smp_apply_warnings(${ARG_NAME})
  gtest_discover_tests(${ARG_NAME} DISCOVERY_TIMEOUT 60 PROPERTIES TIMEOUT 120)
endfunction()
