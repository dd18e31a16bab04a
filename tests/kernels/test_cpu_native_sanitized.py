"""The native CPU kernel's correctness cases under AddressSanitizer and UndefinedBehaviorSanitizer.

The kernel is built with -fsanitize=address,undefined into a cache of its own, and the cases
that call it (its FFI entry's, and its checks against the oracle and the `xla` backend) run in a
pytest subprocess that loads that build through $JAXSERVE_KERNEL_CXXFLAGS. ASan's runtime must
be the process's first library, and python links neither it nor libstdc++, which ASan's
exception interceptor needs from the start: the subprocess preloads both (LD_PRELOAD). Any
sanitizer report fails the test (UBSan's too: -fno-sanitize-recover makes them abort).
Leak checking is off: the Python interpreter and XLA keep allocations to the end by design."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.kernels.cpu import native as cpu_native

REPO_ROOT = Path(__file__).resolve().parents[2]
# -O1 after the usual -O3: the build takes a third of the time; the kernel's vectors are
# written out (vector.h), not left to the optimiser.
SANITIZER_FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                   "-fno-omit-frame-pointer", "-g", "-O1")
CASES = ("tests/kernels/test_cpu_paged_attention_ffi.py", "tests/kernels/test_xla_attention.py",
         "tests/kernels/test_ragged_paged_attention.py")


def runtime(cxx: str, name: str) -> str:
    """The compiler's copy of a runtime library (the bare name where it has none)."""
    done = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True)
    return done.stdout.strip()


@pytest.mark.slow
def test_the_kernels_cases_pass_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    cxx = cpu_native.compiler()
    preload = [runtime(cxx, "libasan.so"), runtime(cxx, "libstdc++.so")]
    if not all(os.path.isabs(path) for path in preload):
        pytest.skip(f"{cxx} has no AddressSanitizer runtime to preload: {preload}")
    lib = cpu_native.build(tmp_path, SANITIZER_FLAGS)
    assert b"__asan_report_load" in lib.read_bytes()  # instrumented
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_")}
    env |= {"JAXSERVE_KERNEL_CACHE": str(tmp_path),
            "JAXSERVE_KERNEL_CXXFLAGS": " ".join(SANITIZER_FLAGS),
            "LD_PRELOAD": " ".join(preload), "ASAN_OPTIONS": "detect_leaks=0",
            "UBSAN_OPTIONS": "print_stacktrace=1",
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])}
    # --capture=sys: a report goes to file descriptor 2 and the process exits at once, so
    # pytest's default capture of that descriptor would swallow it.
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--capture=sys", "-k", "cpu or native", *CASES], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    report = done.stdout + done.stderr
    assert "Sanitizer" not in report and "runtime error:" not in report, report[-6000:]
    assert done.returncode == 0 and " passed" in done.stdout, report[-6000:]
    assert list(tmp_path.glob("*.so")) == [lib]  # the cases ran on the sanitized build
