"""Session 42: the FP8 compiled decode step's access analysis, with OPAQUE_ASM_CONSTEXPRS as landed and without
CONVERT_V_FIRST (the test must fail then: the analysis falls back to 'every input is mutated').
Run: python3 .gpu/analysis_check.py"""
import sys

import pytest

from mm3_compile.lowerings import kernel_options

test = "tests/lowerings/test_kernel_options.py::test_gpu_compiled_decode_step_launches_dependently"
landed = pytest.main(["-q", "-p", "no:cacheprovider", test])
kernel_options.OPAQUE_ASM_CONSTEXPRS = ("PDL",)
without = pytest.main(["-q", "-p", "no:cacheprovider", test + "[fp8]"])
print("landed rc", int(landed), "| without CONVERT_V_FIRST rc", int(without), "(expected 0 | 1)")
sys.exit(0 if (landed, without) == (0, 1) else 1)
