# strata_add_test(NAME <name> SOURCES <files...> [LIBS <targets...>] [LABELS <labels...>]
#                 [RANKS <n>] [ARGS <args...>] [TIMEOUT <s>])
# One GoogleTest executable per call. With RANKS the test runs under `mpiexec -n <n>
# --oversubscribe`, so multi-rank behaviour is tested with real processes.
set(STRATA_PYTHON /usr/bin/python3 CACHE FILEPATH "Python with Debian's torch, h5py and numpy")
set(STRATA_MPI_TEST_ENV
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
  OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1)

function(strata_add_test)
  cmake_parse_arguments(T "" "NAME;RANKS;TIMEOUT" "SOURCES;LIBS;LABELS;ARGS" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} GTest::gtest GTest::gtest_main strata_warnings)
  target_include_directories(${T_NAME} PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/tests)
  if(T_RANKS)
    add_test(NAME ${T_NAME}
             COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${T_RANKS} --oversubscribe
                     $<TARGET_FILE:${T_NAME}> ${T_ARGS})
    list(APPEND T_LABELS mpi)
  else()
    add_test(NAME ${T_NAME} COMMAND ${T_NAME} ${T_ARGS})
  endif()
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  set_tests_properties(${T_NAME} PROPERTIES LABELS "${T_LABELS}" TIMEOUT ${T_TIMEOUT}
                       ENVIRONMENT "${STRATA_MPI_TEST_ENV}")
endfunction()
