# Installs the build in BUILD_DIR into a scratch prefix, then builds the
# consumer project against it with find_package(tdist) as a user would, and
# runs it on 2 ranks with the installed tdist-run, with no LD_LIBRARY_PATH
# (everything is found through RPATHs), on shm and (WITH_GLOO) on the gloo
# plugin. With OTHER_TORCH_DIR (a TorchConfig.cmake directory of another
# LibTorch version), also checks that a consumer using that LibTorch is
# refused by find_package(tdist) with both versions named. With
# WITH_EXAMPLES, also builds every example against the installed package
# (tests/install/examples).
#   -DBUILD_DIR= -DSOURCE_DIR= -DTORCH_VERSION= [-DSANITIZE=] [-DWITH_GLOO=ON] [-DWITH_EXAMPLES=ON]
#   [-DOTHER_TORCH_DIR= -DOTHER_TORCH_VERSION=]
set(prefix ${BUILD_DIR}/install-test/prefix)
set(consumer_build ${BUILD_DIR}/install-test/consumer)
file(REMOVE_RECURSE ${BUILD_DIR}/install-test)

execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix}
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed: ${rc}")
endif()
# A sanitized libtdist needs a consumer built with the same sanitizers.
set(flags "")
set(SANITIZE_FLAG "")
if(SANITIZE)
  set(flags "-fsanitize=${SANITIZE}")
  set(SANITIZE_FLAG "-fsanitize=${SANITIZE}")
endif()
set(configure_args -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release
                   "-DCMAKE_CXX_FLAGS=${flags}" "-DCMAKE_EXE_LINKER_FLAGS=${flags}")
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/install/consumer -B ${consumer_build}
                        ${configure_args}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the consumer against the installed tdist failed: ${rc}\n${out}\n${err}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${consumer_build} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the consumer failed: ${rc}")
endif()

# LibTorch's patch level is not always in its CMake version (Debian's
# 1.13.1 says 1.13.0): compare major.minor.
string(REGEX MATCH "^[0-9]+\\.[0-9]+" torch_minor "${TORCH_VERSION}")
string(REPLACE "." "\\." torch_minor_re "${torch_minor}")
set(backends shm)
if(WITH_GLOO)
  list(APPEND backends gloo)
endif()
foreach(backend IN LISTS backends)
  execute_process(COMMAND env -u LD_LIBRARY_PATH ${prefix}/bin/tdist-run --nproc-per-node 2
                          ${consumer_build}/consumer ${backend}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
  message(STATUS "consumer on ${backend} printed:\n${out}${err}")
  foreach(rank 0 1)
    set(want "consumer ok: rank ${rank} of 2, backend ${backend}, tdist [0-9.]+, LibTorch ${torch_minor_re}\\.[0-9]+ \\(headers ${torch_minor_re}")
    if(NOT out MATCHES "${want}")
      message(FATAL_ERROR "the consumer on ${backend} did not run as expected (rc ${rc}): no line for rank ${rank}")
    endif()
  endforeach()
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the consumer on ${backend} exited with ${rc}")
  endif()
endforeach()

# The C ABI as a binding's build would take it: pkg-config's flags for
# tdist_c, a C99 compiler, the installed tdist-run at world 2.
find_program(pkg_config pkg-config)
if(NOT pkg_config)
  message(FATAL_ERROR "pkg-config not found (scripts/install-deps.sh installs it)")
endif()
if(pkg_config)
  execute_process(COMMAND env PKG_CONFIG_PATH=${prefix}/lib/pkgconfig:${prefix}/${CMAKE_INSTALL_LIBDIR}/pkgconfig
                          ${pkg_config} --cflags --libs tdist_c
                  RESULT_VARIABLE rc OUTPUT_VARIABLE pc_flags ERROR_VARIABLE err OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "pkg-config tdist_c failed: ${err}")
  endif()
  separate_arguments(pc_flags UNIX_COMMAND "${pc_flags}")
  string(REGEX MATCH "-L([^ ;]+)" _ "${pc_flags}")
  set(c_libdir ${CMAKE_MATCH_1})
  execute_process(COMMAND cc -std=c99 -pedantic -Wall -Wextra -Werror ${SANITIZE_FLAG} ${SOURCE_DIR}/tests/c/c_api_test.c
                          ${pc_flags} -Wl,-rpath,${c_libdir} -o ${BUILD_DIR}/install-test/c_api_test
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "building the C ABI test against the installed tdist_c failed: ${rc}\n${out}\n${err}")
  endif()
  execute_process(COMMAND env -u LD_LIBRARY_PATH ${prefix}/bin/tdist-run --nproc-per-node 2 ${BUILD_DIR}/install-test/c_api_test
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "c_api ok \\(rank 1 of 2\\)")
    message(FATAL_ERROR "the C ABI test against the installed package failed (rc ${rc}):\n${out}${err}")
  endif()
  message(STATUS "the C ABI test ran against the installed tdist_c (pkg-config)")
  # A program from the header alone trains DDP and FSDP at world 2; the
  # build tree's C++ API run of the same compares the weights bit for bit.
  set(dir ${BUILD_DIR}/install-test/c_header_weights)
  file(REMOVE_RECURSE ${dir})
  file(MAKE_DIRECTORY ${dir})
  execute_process(COMMAND cc -std=c99 -pedantic -Wall -Wextra -Werror ${SANITIZE_FLAG} ${SOURCE_DIR}/tests/c/c_header_train.c
                          ${pc_flags} -lm -Wl,-rpath,${c_libdir} -o ${BUILD_DIR}/install-test/c_header_train
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "building c_header_train against the installed tdist_c failed: ${rc}\n${out}\n${err}")
  endif()
  foreach(program ${BUILD_DIR}/install-test/c_header_train ${BUILD_DIR}/bin/c_header_reference)
    execute_process(COMMAND env -u LD_LIBRARY_PATH ${prefix}/bin/tdist-run --nproc-per-node 2 ${program} ${dir}
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "${program} (installed tdist_c) failed (rc ${rc}):\n${out}${err}")
    endif()
  endforeach()
  if(NOT out MATCHES "equal the C\\+\\+ API's bit for bit")
    message(FATAL_ERROR "c_header_reference did not confirm the weights:\n${out}${err}")
  endif()
  message(STATUS "c_header_train, built against the installed tdist_c, trains to the C++ API's weights")
endif()

# Every example, built against the installed package alone (WITH_EXAMPLES:
# one suite does it; the examples compile the same against both).
if(WITH_EXAMPLES)
  execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/install/examples -B ${consumer_build}-examples
                          ${configure_args} -DEXAMPLES_DIR=${SOURCE_DIR}/examples -DCCACHE_BASEDIR=${SOURCE_DIR}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "configuring the examples against the installed tdist failed: ${rc}\n${out}\n${err}")
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} --build ${consumer_build}-examples -j 2
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "building the examples against the installed tdist failed: ${rc}\n${out}\n${err}")
  endif()
  message(STATUS "every example built against the installed tdist")
endif()

# A consumer on another LibTorch: find_package(tdist) must refuse it, naming both.
if(OTHER_TORCH_DIR)
  execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/install/consumer -B ${consumer_build}-other
                          ${configure_args} -DTorch_DIR=${OTHER_TORCH_DIR}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(REGEX REPLACE "[ \n]+" " " said "${out} ${err}")
  message(STATUS "configuring against LibTorch ${OTHER_TORCH_VERSION} said: ${said}")
  string(REPLACE "." "\\." other_re "${OTHER_TORCH_VERSION}")
  if(rc EQUAL 0)
    message(FATAL_ERROR "a consumer using LibTorch ${OTHER_TORCH_VERSION} was accepted by tdist built on ${TORCH_VERSION}")
  endif()
  if(NOT said MATCHES "built against LibTorch ${torch_minor_re}[0-9.]* .*uses LibTorch ${other_re}")
    message(FATAL_ERROR "the refusal does not name both LibTorch versions")
  endif()
endif()
