# Target `bundle`: build/bundle/strata-bundle.tar.gz, Strata's programs with the shared
# libraries a bare GPU machine lacks (Open MPI, HDF5, Boost, OpenBLAS, ...), relocatable and
# under 64 MiB, for jobs/gpu-check.sh. See scripts/bundle.sh.
set(_strata_bundle_bins)
set(_strata_bundle_deps)
foreach(_target train strata-data test_cuda_ops test_cuda_dnn test_nccl)
  if(TARGET ${_target})
    list(APPEND _strata_bundle_bins --bin $<TARGET_FILE:${_target}>)
    list(APPEND _strata_bundle_deps ${_target})
  endif()
endforeach()
set(_strata_bundle_extras
  --extra jobs/gpu-check.sh --extra bench/torch_train_step.py --extra bench/torch_models.py
  --extra bench/pipeline_bubble.py --extra bench/lib.sh)
add_custom_target(bundle
  COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/bundle.sh --out ${CMAKE_BINARY_DIR}/bundle
          --src ${PROJECT_SOURCE_DIR} ${_strata_bundle_bins} ${_strata_bundle_extras}
  DEPENDS ${_strata_bundle_deps}
  WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}
  COMMENT "Bundling train and the GPU tests with their libraries into ${CMAKE_BINARY_DIR}/bundle"
  VERBATIM)
# `bundle_check`: unpacks the bundle and runs it in a clean environment (as root: with this
# machine's copies of the bundled libraries hidden in a private mount namespace).
add_custom_target(bundle_check
  COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/bundle.sh --check ${CMAKE_BINARY_DIR}/bundle/strata-bundle.tar.gz
  DEPENDS bundle
  VERBATIM)
# CI runs the clean-environment check as a test (it builds the bundle first; ~20 s).
if(STRATA_BUILD_TESTS)
  add_test(NAME bundle_clean_environment COMMAND ${CMAKE_COMMAND} --build ${CMAKE_BINARY_DIR} --target bundle_check)
  set_tests_properties(bundle_clean_environment PROPERTIES LABELS integration TIMEOUT 600 RUN_SERIAL TRUE)
endif()
